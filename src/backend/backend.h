// A backend runs a graph. CPU is the naive reference; CUDA the fast path. Both implement every op
// of ir/op.h through one dispatch switch; an op a backend cannot run is an error naming the op,
// never a silent fallback to another backend (STYLE §3.4, §3.6).
#pragma once
#include "ir/graph.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace perigee {

// SLOT-INDEXED STATE POOLS. The runtime owns which sequence holds which KDA slot; the pools
// themselves (model_state's conv windows and recurrent state: F32 tensors [n_slots, ...], one row
// per slot) are STATE leaves that a device backend keeps resident after the first upload, so the
// runtime never reads or writes those host tensors: it zeroes, saves and restores slots through the
// backend (slot_zero, slot_snapshots). `pools` is a list of such tensors (all with the same
// n_slots = dim 0); it is the same list, in the same order, for every call on one model.

// A pool of n snapshots of one slot: each holds that slot's row of every pool, concatenated in
// list order (bytes_per_snapshot() = sum over pools of nbytes / n_slots). It lives where the
// backend keeps its states (CPU: host memory; CUDA: device memory). It refers to the backend that
// made it and to the pool tensors: it must not outlive either.
class slot_snapshots {
public:
    virtual ~slot_snapshots() = default;
    virtual int capacity() const = 0;
    virtual int64_t bytes_per_snapshot() const = 0;
    // slot -> snapshot `snap` (every byte of the slot's rows).
    virtual void save(int slot, int snap) = 0;
    // snapshot `snap` -> slot (every byte of the slot's rows).
    virtual void load(int snap, int slot) = 0;
};

// Checks a pool list (non-null, F32, rank >= 1, one n_slots, rows of whole floats); returns
// n_slots (0 for an empty list). `who` names the caller in errors.
inline int64_t slot_pools_check(const std::vector<tensor *> & pools, const char * who) {
    int64_t n = 0;
    for (size_t i = 0; i < pools.size(); ++i) {
        const tensor * t = pools[i];
        PG_CHECK(t != nullptr && !t->empty(), "{}: state pool {} is empty", who, i);
        PG_CHECK(t->type == dtype::F32, "{}: state pool {} is {}, not F32", who, i, dtype_name(t->type));
        PG_CHECK(!t->shape.empty() && t->dim(0) > 0, "{}: state pool {} has no slot dimension", who, i);
        PG_CHECK(n == 0 || t->dim(0) == n, "{}: state pool {} has {} slots, pool 0 has {}", who, i, t->dim(0), n);
        n = t->dim(0);
        PG_CHECK(t->nbytes % (size_t(n) * sizeof(float)) == 0, "{}: state pool {} of {} bytes is not {} rows of floats", who,
                 i, t->nbytes, n);
    }
    return n;
}

// ON-DEVICE SAMPLING (backend::sample_rows). One logits row's sampling: the host sampler's step 3
// (runtime/sampler.h) without penalties, with the row's uniform drawn by the runtime
// (sample_uniform(seed, draw_index)). sample_row_reference is that math, shared by the host sampler
// and the CPU backend: temperature == 0: argmax, ties to the lower id; otherwise the row sorted by
// (logit descending, id ascending), top-k, p_i = exp(l_i / T - l_0 / T) in double normalised, top-p
// (smallest prefix whose cumulative mass reaches top_p), min-p (prefix of p_i >= min_p * p_0, at
// least one), the first i with u * mass < cumulative_i (else the last kept token).
struct row_sampling {
    float temperature = 0.0f;   // 0 = greedy
    int top_k = 0;              // 0 = off
    float top_p = 1.0f;         // (0, 1]
    float min_p = 0.0f;         // [0, 1]
    double u = 0.0;             // uniform in [0, 1) (unused when greedy)
};
int32_t sample_row_reference(const float * logits, int64_t V, const row_sampling & s);

class backend {
public:
    virtual ~backend() = default;
    virtual std::string name() const = 0;
    // The per-step token budget (engine_options::max_num_batched_tokens: the longest prefill chunk of a step) a caller
    // should use when its user gives none: the chunk size this backend runs well. serve, chat and bench ask for it.
    virtual int step_tokens_default() const = 0;
    // Throws perigee::error naming the first node (name and op) this backend cannot run.
    virtual void check_supported(const graph & g) const = 0;
    // Called after each node has run, with host copies (F32 or I32) of its outputs. For node-by-node
    // comparison between backends (compare-backends) and for dumping.
    using node_callback = std::function<void(const graph & g, int node, const std::vector<tensor> & outs)>;
    // Runs every node in order. STATE leaves are updated in place.
    virtual void run(const graph & g, const node_callback & cb = {}) = 0;
    // Host copy of an output of the last run.
    virtual tensor read(node_ref r) const = 0;

    // Zeroes row `slot` of every pool (where the backend keeps them; CPU: the host tensors, bitwise
    // what state_slot_zero does; CUDA: the device copies, uploading a pool first if it is not yet).
    virtual void slot_zero(const std::vector<tensor *> & pools, int slot) = 0;
    // A snapshot pool of n entries for these pools (see slot_snapshots).
    virtual std::unique_ptr<slot_snapshots> slot_snapshots_new(const std::vector<tensor *> & pools, int n) = 0;

    // One id per row of output `logits` (F32 [R, V]) of the last run, sampled with rows[r]
    // (rows.size() == R); -1 for a row holding a NaN/Inf (the caller fails that request). CPU:
    // sample_row_reference on each row; CUDA: on the device (sample.cu), only the ids are copied back;
    // the same ids as the CPU except when u * mass or top_p ties a cumulative boundary to ~1e-13.
    virtual std::vector<int32_t> sample_rows(node_ref logits, const std::vector<row_sampling> & rows) = 0;
};

std::unique_ptr<backend> backend_cpu_init();

} // namespace perigee
