// The engine: continuous batching over the model runner (nano-vllm's LLMEngine seam).
// One thread runs schedule -> forward -> sample -> post-process; requests arrive through a
// thread-safe queue; results stream back through callbacks. The server and `perigee bench` sit on
// it. THIS HEADER IS THE CONTRACT between src/runtime (implementation) and src/server / tools.
#pragma once
#include "runtime/model-runner.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace perigee {

struct sampling_params {
    float temperature = 0.0f;          // 0 = greedy (argmax, ties to the lower id)
    float top_p = 1.0f;                // (0, 1]
    int top_k = 0;                     // 0 = off
    float min_p = 0.0f;                // [0, 1]
    float presence_penalty = 0.0f;     // OpenAI semantics, over generated tokens
    float frequency_penalty = 0.0f;
    float repetition_penalty = 1.0f;   // > 0; 1 = off (HF semantics, over prompt + generated)
    std::optional<uint64_t> seed;      // same seed + same request -> same tokens
    int max_tokens = 16;               // generated tokens, >= 1
    int logprobs = -1;                 // -1 = none; 0..20 = the sampled token's logprob + this many top
};

enum class finish_reason : uint8_t { NONE, STOP, LENGTH, CANCELLED, ERROR };
std::string_view finish_reason_name(finish_reason r);   // "stop", "length", "cancelled", "error"

struct request {
    std::vector<int32_t> prompt;                 // token ids, non-empty
    sampling_params sp;
    std::vector<int32_t> stop_token_ids;         // besides the model's eos ids (which always stop)
    bool ignore_eos = false;
};

struct token_event {
    uint64_t request_id = 0;
    int32_t token = -1;                          // -1 on a final event that carries no token
    float logprob = 0.0f;                        // when sp.logprobs >= 0
    std::vector<std::pair<int32_t, float>> top_logprobs;
    finish_reason finished = finish_reason::NONE;   // NONE while streaming; set on the last event
    std::string error;                           // when finished == ERROR (names the cause)
    int prompt_tokens = 0, completion_tokens = 0;
};

struct engine_options {
    int max_num_seqs = 8;             // concurrent sequences (= KDA state slots)
    int max_model_len = 4096;         // prompt + generated tokens per sequence
    int max_num_batched_tokens = 512; // per-step token budget (chunked prefill beyond it)
    int page_size = 16;               // MLA cache page, tokens (power of two)
    int n_pages = 0;                  // 0 = enough for max_num_seqs * max_model_len
    int max_queue = 256;              // waiting requests beyond this are refused (server: 503)
    bool enable_prefix_caching = false;   // reuse cached prompt prefixes (MLA pages + KDA snapshots)
    // --- extensions (runtime) ---
    int max_prefill_chunk = 0;        // 0 = only the token budget caps a prefill chunk
    // Prefix caching (runtime/prefix-cache.h has the design). KDA snapshots live in their own pool
    // of prefix_snapshots entries, state_slot_bytes(cfg) each, outside the runner's state pools.
    int prefix_snapshots = 0;         // 0 = 4 * max_num_seqs
    int prefix_snapshot_interval = 0; // pages; > 0 also cuts prefills every this many pages
                                      //  (finer hits for prompts that diverge early; more steps)
};

struct engine_stats {
    int waiting = 0, running = 0;
    int free_slots = 0, free_pages = 0;
    int total_slots = 0, total_pages = 0;
    uint64_t steps = 0, prompt_tokens = 0, generated_tokens = 0;
    // --- extensions (runtime) ---
    uint64_t batched_tokens = 0;      // tokens forwarded, recomputation after preemption included
    uint64_t preemptions = 0;
    uint64_t finished = 0, cancelled = 0, errors = 0;   // requests by how they ended
    uint64_t nan_events = 0;          // requests failed for non-finite logits
    // prefix caching (0 when off, except page_refs). free_pages counts cached pages no request holds.
    int cached_pages = 0;             // pages indexed by the prefix cache
    int snapshots_used = 0, total_snapshots = 0;
    int snapshot_pins = 0;            // 0 between steps
    int64_t page_refs = 0;            // references held on pages (0 when idle)
    uint64_t prefix_hits = 0, prefix_hit_tokens = 0;   // admissions that reused a prefix; tokens reused
    uint64_t snapshots_taken = 0, snapshots_evicted = 0;
};

class engine {
public:
    engine(model_runner & runner, const engine_options & opt);
    ~engine();                        // stops the loop; pending requests finish with CANCELLED
    // Validates (prompt non-empty, ids in vocab, prompt + max_tokens <= max_model_len, sampling
    // values in range) and queues. Throws perigee::error naming the field for a bad request, and
    // engine_full_error when the queue is full. `cb` is called from the engine thread for every
    // token and exactly once with finished != NONE.
    uint64_t submit(request r, std::function<void(const token_event &)> cb);
    // Cancels a queued or running request: frees its slot and pages; its callback gets CANCELLED.
    void cancel(uint64_t request_id);
    engine_stats stats() const;
    const kimi_config & config() const;
    // --- extensions (runtime) ---
    // Blocks until no request is queued or running (or the timeout passes); returns true if idle.
    bool wait_idle(double timeout_s = 1e9);

    struct impl;
private:
    std::unique_ptr<impl> impl_;
};

struct engine_full_error : error {
    using error::error;
};

} // namespace perigee
