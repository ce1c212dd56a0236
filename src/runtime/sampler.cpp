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
    // 3. choose.
    if (sp.temperature == 0.0f) {
        int64_t best = 0;
        for (int64_t i = 1; i < V; ++i)
            if (l[size_t(i)] > l[size_t(best)]) best = i;
        out.token = int32_t(best);
    } else {
        std::vector<int32_t> idx(static_cast<size_t>(V));
        std::iota(idx.begin(), idx.end(), 0);
        auto better = [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)] || (l[size_t(a)] == l[size_t(b)] && a < b); };
        int64_t n = V;
        if (sp.top_k > 0 && sp.top_k < V) {
            n = sp.top_k;
            std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), better);
        } else {
            std::sort(idx.begin(), idx.end(), better);
        }
        const double inv_t = 1.0 / double(sp.temperature);
        const double mx = double(l[size_t(idx[0])]) * inv_t;
        std::vector<double> p(static_cast<size_t>(n));
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) sum += p[size_t(i)] = std::exp(double(l[size_t(idx[size_t(i)])]) * inv_t - mx);
        for (auto & x : p) x /= sum;
        if (sp.top_p < 1.0f) {
            double c = 0.0;
            int64_t keep = n;
            for (int64_t i = 0; i < n; ++i) {
                c += p[size_t(i)];
                if (c >= double(sp.top_p)) {
                    keep = i + 1;
                    break;
                }
            }
            n = keep;
        }
        if (sp.min_p > 0.0f) {
            const double floor = double(sp.min_p) * p[0];
            int64_t keep = 1;
            while (keep < n && p[size_t(keep)] >= floor) ++keep;
            n = keep;
        }
        double mass = 0.0;
        for (int64_t i = 0; i < n; ++i) mass += p[size_t(i)];
        const double u = sample_uniform(seed, draw_index) * mass;
        double c = 0.0;
        out.token = idx[size_t(n - 1)];
        for (int64_t i = 0; i < n; ++i) {
            c += p[size_t(i)];
            if (u < c) {
                out.token = idx[size_t(i)];
                break;
            }
        }
    }
    if (sp.logprobs >= 0) out.logprob = raw_lp[size_t(out.token)];
    return out;
}

} // namespace perigee
