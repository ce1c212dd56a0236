// What the server needs of an engine: submit / cancel / stats (the contract of runtime/engine.h),
// behind an interface so the HTTP layer can be tested against a mock engine (RELIABILITY §C1).
#pragma once
#include "runtime/engine.h"

#include <functional>
#include <memory>

namespace perigee::server {

class gen_engine {
public:
    virtual ~gen_engine() = default;
    // Same contract as perigee::engine::submit: throws perigee::error naming the field for a bad
    // request, engine_full_error when the queue is full; `cb` gets every token and exactly one
    // final event (finished != NONE), from the engine's thread.
    virtual uint64_t submit(request r, std::function<void(const token_event &)> cb) = 0;
    virtual void cancel(uint64_t request_id) = 0;
    virtual engine_stats stats() const = 0;
    virtual int vocab_size() const = 0;
};

// The real engine (only when src/runtime provides it: PERIGEE_HAVE_ENGINE).
std::unique_ptr<gen_engine> wrap_engine(engine & e);

// A deterministic mock for tests: token i of a request is a function of (prompt, i) only, so a
// request gives the same tokens alone or among others; it honours max_tokens, stop_token_ids,
// eos, max_num_seqs (running) + max_queue (waiting, else engine_full_error), cancel, and delays
// (prefill per prompt token, decode per token) so tests can disconnect in each phase.
struct mock_options {
    int vocab = 512;
    int max_num_seqs = 4;
    int max_queue = 64;
    int max_model_len = 4096;
    double prefill_s_per_token = 0.0;
    double decode_s_per_token = 0.0;
    std::vector<int32_t> eos_ids;
    // Optional script: if it returns a non-empty vector for a prompt, those ids are generated
    // (then the request stops with STOP), instead of the pseudo-random ones.
    std::function<std::vector<int32_t>(const std::vector<int32_t> &)> script;
    // Token ids the pseudo-random generator may produce: [lo, hi).
    int gen_lo = 32, gen_hi = 127;
};
std::unique_ptr<gen_engine> make_mock_engine(const mock_options & opt);

} // namespace perigee::server
