#include "runtime/sampler.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

namespace perigee {

void sampling_params_validate(const sampling_params & sp) {
    PG_CHECK(std::isfinite(sp.temperature) && sp.temperature >= 0.0f,
             "sampling_params.temperature {} must be finite and >= 0", sp.temperature);
    PG_CHECK(sp.top_p > 0.0f && sp.top_p <= 1.0f, "sampling_params.top_p {} must be in (0, 1]", sp.top_p);
    PG_CHECK(sp.top_k >= 0, "sampling_params.top_k {} must be >= 0 (0 = off)", sp.top_k);
    PG_CHECK(sp.min_p >= 0.0f && sp.min_p <= 1.0f, "sampling_params.min_p {} must be in [0, 1]", sp.min_p);
    PG_CHECK(sp.presence_penalty >= -2.0f && sp.presence_penalty <= 2.0f,
             "sampling_params.presence_penalty {} must be in [-2, 2]", sp.presence_penalty);
    PG_CHECK(sp.frequency_penalty >= -2.0f && sp.frequency_penalty <= 2.0f,
             "sampling_params.frequency_penalty {} must be in [-2, 2]", sp.frequency_penalty);
    PG_CHECK(std::isfinite(sp.repetition_penalty) && sp.repetition_penalty > 0.0f,
             "sampling_params.repetition_penalty {} must be > 0", sp.repetition_penalty);
    PG_CHECK(sp.max_tokens >= 1, "sampling_params.max_tokens {} must be >= 1", sp.max_tokens);
    PG_CHECK(sp.logprobs >= -1 && sp.logprobs <= 20, "sampling_params.logprobs {} must be in [-1, 20]", sp.logprobs);
}

double sample_uniform(uint64_t seed, uint64_t index) {
    auto mix = [](uint64_t z) {
        z += 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    };
    const uint64_t x = mix(mix(seed) ^ (index * 0xD1B54A32D192ED03ull + 1));
    return double(x >> 11) * 0x1.0p-53;
}

row_sampling sampling_row(const sampling_params & sp, uint64_t seed, uint64_t draw_index) {
    return {sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.temperature == 0.0f ? 0.0 : sample_uniform(seed, draw_index)};
}

bool sampling_needs_host(const sampling_params & sp) {
    return sp.logprobs >= 0 || sp.repetition_penalty != 1.0f || sp.frequency_penalty != 0.0f || sp.presence_penalty != 0.0f;
}

bool row_is_finite(const float * row, int64_t V) {
    for (int64_t i = 0; i < V; ++i)
        if (!std::isfinite(row[i])) return false;
    return true;
}

sample_output sample_token(const float * logits, int64_t V, const sampling_params & sp, const std::vector<int32_t> & tokens,
                           int32_t n_prompt, uint64_t seed, uint64_t draw_index) {
    PG_CHECK(V > 0, "sample_token: empty logits row");
    sample_output out;
    // 1. raw log-softmax (only when asked for).
    std::vector<float> raw_lp;
    if (sp.logprobs >= 0) {
        const float mx = *std::max_element(logits, logits + V);
        double sum = 0.0;
        for (int64_t i = 0; i < V; ++i) sum += std::exp(double(logits[i]) - mx);
        const double lse = double(mx) + std::log(sum);
        raw_lp.resize(size_t(V));
        for (int64_t i = 0; i < V; ++i) raw_lp[size_t(i)] = float(double(logits[i]) - lse);
        if (sp.logprobs > 0) {
            std::vector<int32_t> idx(static_cast<size_t>(V));
            std::iota(idx.begin(), idx.end(), 0);
            const int64_t k = std::min<int64_t>(sp.logprobs, V);
            std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
                return raw_lp[size_t(a)] > raw_lp[size_t(b)] || (raw_lp[size_t(a)] == raw_lp[size_t(b)] && a < b);
            });
            for (int64_t i = 0; i < k; ++i) out.top_logprobs.push_back({idx[size_t(i)], raw_lp[size_t(idx[size_t(i)])]});
        }
    }
    // 2. penalties.
    std::vector<float> l(logits, logits + V);
    if (sp.repetition_penalty != 1.0f) {
        std::vector<bool> seen(size_t(V), false);
        for (int32_t t : tokens)
            if (t >= 0 && t < V) seen[size_t(t)] = true;
        for (int64_t i = 0; i < V; ++i)
            if (seen[size_t(i)]) l[size_t(i)] = l[size_t(i)] > 0 ? l[size_t(i)] / sp.repetition_penalty : l[size_t(i)] * sp.repetition_penalty;
    }
    if (sp.frequency_penalty != 0.0f || sp.presence_penalty != 0.0f) {
        std::unordered_map<int32_t, int> count;
        for (size_t i = size_t(n_prompt); i < tokens.size(); ++i) count[tokens[i]]++;
        for (auto [t, c] : count)
            if (t >= 0 && t < V) l[size_t(t)] -= float(c) * sp.frequency_penalty + sp.presence_penalty;
    }
    // 3. choose: the math backend::sample_rows shares (backend.h sample_row_reference).
    out.token = sample_row_reference(l.data(), V, sampling_row(sp, seed, draw_index));
    if (sp.logprobs >= 0) out.logprob = raw_lp[size_t(out.token)];
    return out;
}

} // namespace perigee
