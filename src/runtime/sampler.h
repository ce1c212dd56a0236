// The sampler: one logits row -> one token, on the CPU, engine side (nano-vllm's layers/sampler.py
// without the GPU). Order of operations:
//   1. logprobs / top_logprobs: log-softmax of the RAW logits (before penalties and temperature);
//   2. penalties: repetition (HF: over prompt + generated, logit > 0 ? l / r : l * r), then
//      frequency and presence (OpenAI: over generated tokens, l -= count * f + (count > 0) * p);
//   3. temperature == 0: greedy argmax of the penalized logits, ties to the lower id;
//      otherwise l / T, then top-k, top-p (smallest prefix of the sorted distribution whose mass
//      reaches p), min-p (drop tokens below min_p * p_max), renormalise, draw.
// The draw is a pure function of (seed, draw_index), so the same seed and request give the same
// tokens, also after a preemption recomputes the sequence.
#pragma once
#include "runtime/engine.h"

#include <cstdint>
#include <vector>

namespace perigee {

struct sample_output {
    int32_t token = -1;
    float logprob = 0.0f;                                  // raw log-softmax of the sampled token
    std::vector<std::pair<int32_t, float>> top_logprobs;   // sp.logprobs entries, best first
};

// Throws perigee::error naming the field (e.g. "sampling_params.top_p") when a value is out of range.
void sampling_params_validate(const sampling_params & sp);

// logits: one row [V]. tokens: prompt + generated so far (n_prompt of them are the prompt).
// draw_index: which draw of this request (the number of tokens generated so far).
sample_output sample_token(const float * logits, int64_t V, const sampling_params & sp, const std::vector<int32_t> & tokens,
                           int32_t n_prompt, uint64_t seed, uint64_t draw_index);

// The row_sampling of a request's next draw (backend::sample_rows): its temperature/top-k/top-p/min-p
// and the uniform sample_uniform(seed, draw_index). Valid for on-device sampling only when
// sampling_needs_host(sp) is false.
row_sampling sampling_row(const sampling_params & sp, uint64_t seed, uint64_t draw_index);
// True when the request needs the host sampler: logprobs (read from the raw row) or penalties (they
// need the token history). Otherwise backend::sample_rows gives the same token as sample_token.
bool sampling_needs_host(const sampling_params & sp);

// Uniform in [0, 1) from (seed, index): splitmix64 of the pair.
double sample_uniform(uint64_t seed, uint64_t index);

// True when every value of the row is finite.
bool row_is_finite(const float * row, int64_t V);

} // namespace perigee
