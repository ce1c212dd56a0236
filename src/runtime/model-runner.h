// The model runner: a loaded model (config, weights, state pools) plus a backend, running one
// forward step for a batch. The scheduler and engine loop sit on top of it (nano-vllm's
// model_runner seam); the CLI's logits/generate use it directly for one sequence.
#pragma once
#include "backend/backend.h"
#include "model/forward.h"

#include <functional>
#include <memory>
#include <string>

namespace perigee {

struct runner_options {
    int n_slots = 1;           // KDA state slots (concurrent sequences)
    int n_pages = 0;           // MLA cache pages; 0 = enough for n_slots sequences of max_tokens
    int page_size = 16;
    int max_tokens = 4096;     // per sequence, used to size pages when n_pages == 0
    int64_t memory_budget_bytes = 0;   // > 0: n_pages from this byte budget (runtime/block-manager.h
                                       //  plan_pools: n_slots slots and the snapshots first, the rest as pages)
    int prefix_snapshots = 0;          // with a budget: the prefix-cache snapshots the engine will allocate (its
                                       //  engine_options.prefix_snapshots, resolved: 4 * max_num_seqs when that is 0)
    std::string backend = "cpu";   // "cpu", or "cuda" in a build with the CUDA backend (PERIGEE_HAVE_CUDA)
    int device = 0;                 // cuda: the device index
    bool graph_decode = true;       // cuda: decode steps as replayed CUDA graphs (cuda_options::graph_decode)
    forward_options forward;        // how each step's graph is built (model/forward.h: e.g. bf16_inputs_min_tokens)
};

// The backends this build can run ("cpu" or "cpu, cuda"), for option help and errors.
std::string runner_backends();

class model_runner {
public:
    model_runner(const std::string & model_dir, const runner_options & opt);
    const kimi_config & config() const { return cfg_; }
    // With a memory budget: the prefix snapshots its plan reserved (runner_options.prefix_snapshots); -1 without a budget.
    int budget_snapshots() const { return budget_snapshots_; }
    // The host state pools. With a device backend (cuda) they are stale after the first step: the
    // backend keeps them resident; slots are zeroed/saved/restored only through zero_slot and
    // new_snapshots below (the runtime never touches these host tensors).
    model_state & state() { return st_; }
    const model_weights & weights() const { return *w_; }
    backend & be() { return *be_; }
    // Runs one step; returns logits F32 [n_tokens, vocab].
    tensor step(std::shared_ptr<const batch> b, const backend::node_callback & cb = {});
    // Runs one step and returns only the logits rows named by b->logits_rows (packed token
    // indices), F32 [rows, vocab] in that order. Sets logits_rows on the batch it forwards, so a
    // forward that honours it computes only those rows; one that does not is sliced here.
    tensor step_rows(std::shared_ptr<const batch> b);
    // Runs one step like step_rows and samples each row on the backend (backend::sample_rows):
    // returns one id per b->logits_rows entry (-1 for a row with a NaN/Inf); no logits row is copied
    // back. `rows` is the sampling of each row, in logits_rows order.
    std::vector<int32_t> step_sample(std::shared_ptr<const batch> b, const std::vector<row_sampling> & rows);
    // True when the engine should sample on the backend (step_sample) for requests that need neither
    // logprobs nor penalties: a device backend (cuda) and no logits_hook (the hook needs host rows).
    // use_device_sampling = false forces the host sampler (tests, comparisons).
    bool device_sampling() const {
        return use_device_sampling && (be_->name() != "cpu" || force_backend_sampling) && !logits_hook;
    }
    bool use_device_sampling = true;
    uint64_t backend_sampled_rows = 0;   // rows sampled through step_sample so far (tests, stats)
    // TEST HOOK: the engine samples through backend::sample_rows on the CPU backend too (its
    // on-device branch, tested without a GPU).
    bool force_backend_sampling = false;
    // Runs one step whose logits nobody reads (a prefill chunk that samples nothing): the forward
    // computes the lm_head for one row only (logits_rows = the last token) and nothing is copied
    // back. The state updates are those of step().
    void advance(std::shared_ptr<const batch> b);

    // TEST HOOKS (never set in production):
    //  - logits_hook runs on the rows step_rows returns, before the caller sees them (tests
    //    poison one sequence's row with NaN);
    //  - skip_slot_zero makes zero_slot a no-op (the control for the recycled-slot test).
    std::function<void(const batch &, tensor & rows)> logits_hook;
    bool skip_slot_zero = false;
    // Zeroes one KDA state slot in every layer (a recycled slot must not leak state), through the
    // backend (CPU: the host pools, bitwise state_slot_zero; CUDA: the device copies).
    void zero_slot(int slot);
    // The slot-indexed KDA pools (conv_q, conv_k, conv_v, recurrent of every KDA layer, in layer
    // order): what zero_slot and the snapshots cover.
    const std::vector<tensor *> & slot_pools() const { return slot_pools_; }
    // A pool of n KDA slot snapshots where the backend keeps its states (backend.h slot_snapshots);
    // bytes_per_snapshot() == state_slot_bytes(config()).
    std::unique_ptr<slot_snapshots> new_snapshots(int n);

private:
    int budget_snapshots_ = -1;
    kimi_config cfg_;
    forward_options fwd_;
    std::unique_ptr<model_weights> w_;
    model_state st_;
    std::vector<tensor *> slot_pools_;
    std::unique_ptr<backend> be_;
};

// A single sequence on slot 0 with its own pages: prefill then decode, as the CLI needs.
class single_sequence {
public:
    explicit single_sequence(model_runner & r);
    // Appends tokens to the sequence in one step; returns their logits [n, vocab].
    tensor feed(const std::vector<int32_t> & ids);
    int32_t n_past() const { return n_past_; }

private:
    model_runner & r_;
    int32_t n_past_ = 0;
    std::vector<int32_t> pages_;
};

} // namespace perigee
