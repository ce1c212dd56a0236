// On-device sampling (src/backend/cuda/sample.cu) vs the host math (backend.h sample_row_reference, which the
// runtime's sampler uses): greedy ids == argmax at the full K3 vocabulary (163840) with ties; for fixed uniforms the
// CUDA ids == the CPU ids across temperature / top-k / top-p / min-p (mismatches counted, must be 0: sample.cu says
// why only a ~1e-13 tie with a cumulative boundary could differ); NaN rows give -1; a chi-square test of sampled
// frequencies against the filtered softmax on a 16-token vocabulary, with the control that the distribution at a
// wrong temperature must be rejected; and the backend entry (backend::sample_rows on a graph output) on both
// backends. Cases skip without a CUDA device.
#include "backend/backend.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/cuda-ops.h"
#include "ir/builder.h"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using namespace perigee;

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the on-device sampling tests need the GPU machine"

constexpr int64_t k_vocab = 163840;   // K3's vocabulary

// Splitmix-style uniform in [0, 1), as the runtime draws them (runtime/sampler.cpp sample_uniform).
double uniform(uint64_t seed, uint64_t index) {
    auto mix = [](uint64_t z) {
        z += 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    };
    return double(mix(mix(seed) ^ (index * 0xD1B54A32D192ED03ull + 1)) >> 11) * 0x1.0p-53;
}

// Rows of V logits (normal, sd 3); rows with r % 3 == 2 quantized to 1/8 steps (exact ties everywhere).
std::vector<float> make_rows(int R, int64_t V, uint32_t seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<float> x(size_t(R) * size_t(V));
    for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < V; ++i) {
            const float v = nd(g);
            x[size_t(r) * size_t(V) + size_t(i)] = r % 3 == 2 ? std::round(v * 8.0f) / 8.0f : v;
        }
    return x;
}

std::vector<int32_t> device_ids(const std::vector<float> & x, int R, int64_t V, const std::vector<row_sampling> & s) {
    float * d = nullptr;
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void **>(&d), x.size() * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<cuda::sample_row_param> p(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) p[size_t(r)] = {s[size_t(r)].temperature, s[size_t(r)].top_k, s[size_t(r)].top_p, s[size_t(r)].min_p, s[size_t(r)].u};
    std::vector<int32_t> ids(static_cast<size_t>(R), -2);
    const cudaError_t e = cuda::sample_rows(d, R, V, p.data(), ids.data(), nullptr);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    cudaFree(d);
    return ids;
}

TEST(cuda_sample, greedy_is_argmax_ties_to_lower_id) {
    NEED_GPU();
    const int R = 9;
    std::vector<float> x = make_rows(R, k_vocab, 1);
    // Row 0: the max at two ids (the lower must win); row 1: every value equal (id 0 wins); row 4: max at the last id.
    x[5000] = x[90000] = 100.0f;
    std::fill(x.begin() + k_vocab, x.begin() + 2 * k_vocab, 0.25f);
    x[size_t(4 * k_vocab + k_vocab - 1)] = 1e30f;
    std::vector<row_sampling> s(static_cast<size_t>(R));
    const std::vector<int32_t> ids = device_ids(x, R, k_vocab, s);
    for (int r = 0; r < R; ++r)
        EXPECT_EQ(ids[size_t(r)], sample_row_reference(x.data() + int64_t(r) * k_vocab, k_vocab, s[size_t(r)])) << "row " << r;
    EXPECT_EQ(ids[0], 5000);
    EXPECT_EQ(ids[1], 0);
    EXPECT_EQ(ids[4], int32_t(k_vocab - 1));
}

TEST(cuda_sample, fixed_uniforms_give_the_cpu_ids) {
    NEED_GPU();
    const int R = 12;
    const std::vector<float> x = make_rows(R, k_vocab, 2);
    int compared = 0, mismatches = 0, sampled = 0;
    uint64_t draw = 0;
    double dev_ms = 0.0;
    for (float t : {0.0f, 0.5f, 1.0f, 2.0f})
        for (int k : {0, 1, 50, 4096})
            for (float p : {1.0f, 0.95f, 0.3f})
                for (float m : {0.0f, 0.1f}) {
                    std::vector<row_sampling> s(static_cast<size_t>(R));
                    for (int r = 0; r < R; ++r) s[size_t(r)] = {t, k, p, m, uniform(99, draw++)};
                    const auto t0 = std::chrono::steady_clock::now();
                    const std::vector<int32_t> ids = device_ids(x, R, k_vocab, s);
                    dev_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
                    for (int r = 0; r < R; ++r) {
                        const int32_t want = sample_row_reference(x.data() + int64_t(r) * k_vocab, k_vocab, s[size_t(r)]);
                        ++compared;
                        sampled += t != 0.0f;
                        if (ids[size_t(r)] != want) {
                            ++mismatches;
                            std::printf("[cuda_sample] MISMATCH T %g top_k %d top_p %g min_p %g u %.17g row %d: cuda %d cpu %d\n", t, k,
                                        p, m, s[size_t(r)].u, r, ids[size_t(r)], want);
                        }
                    }
                }
    std::printf("[cuda_sample] %d rows of %lld (%d sampled, %d greedy): %d mismatches; %.1f ms in sample_rows incl. uploads\n",
                compared, (long long)k_vocab, sampled, compared - sampled, mismatches, dev_ms);
    EXPECT_EQ(mismatches, 0);
}

TEST(cuda_sample, non_finite_rows_are_minus_one) {
    NEED_GPU();
    const int R = 4;
    std::vector<float> x = make_rows(R, 1000, 3);
    x[1000 + 17] = NAN;
    x[3000 + 999] = INFINITY;
    const std::vector<int32_t> ids = device_ids(x, R, 1000, {{}, {}, {1.0f, 0, 0.9f, 0.0f, 0.3}, {1.0f, 0, 0.9f, 0.0f, 0.3}});
    EXPECT_GE(ids[0], 0);
    EXPECT_EQ(ids[1], -1);
    EXPECT_GE(ids[2], 0);
    EXPECT_EQ(ids[3], -1);
}

// Chi-square of N draws (one row per draw, uniforms from the runtime's generator) vs the filtered softmax at
// temperature t_expect; returns the statistic and the degrees of freedom.
std::pair<double, int> chi_square(float t_sample, float t_expect, int N) {
    const int64_t V = 16;
    std::vector<float> base(V);
    for (int64_t i = 0; i < V; ++i) base[size_t(i)] = 0.3f * float(i % 7) - 0.05f * float(i);
    std::vector<float> x(size_t(N) * V);
    for (int r = 0; r < N; ++r) std::copy(base.begin(), base.end(), x.begin() + int64_t(r) * V);
    const int top_k = 12;
    const float top_p = 0.97f, min_p = 0.05f;
    std::vector<row_sampling> s(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) s[size_t(r)] = {t_sample, top_k, top_p, min_p, uniform(4242, uint64_t(r))};
    const std::vector<int32_t> ids = device_ids(x, N, V, s);
    // Expected: the filtered, renormalised softmax at t_expect (sorted order, top-k, top-p, min-p).
    std::vector<int> idx(V);
    for (int i = 0; i < V; ++i) idx[size_t(i)] = i;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return base[size_t(a)] > base[size_t(b)]; });
    std::vector<double> p(top_k);
    double sum = 0;
    for (int i = 0; i < top_k; ++i) sum += p[size_t(i)] = std::exp((double(base[size_t(idx[size_t(i)])]) - base[size_t(idx[0])]) / t_expect);
    for (auto & v : p) v /= sum;
    int n = top_k;
    double c = 0;
    for (int i = 0; i < top_k; ++i)
        if ((c += p[size_t(i)]) >= double(top_p)) {
            n = i + 1;
            break;
        }
    int keep = 1;
    while (keep < n && p[size_t(keep)] >= double(min_p) * p[0]) ++keep;
    double mass = 0;
    for (int i = 0; i < keep; ++i) mass += p[size_t(i)];
    std::vector<int> count(V, 0);
    for (int32_t id : ids) count[size_t(id)]++;
    double chi = 0;
    int outside = 0;
    for (int i = 0; i < V; ++i) {
        int rank = -1;
        for (int j = 0; j < keep; ++j)
            if (idx[size_t(j)] == i) rank = j;
        if (rank < 0) {
            outside += count[size_t(i)];
            continue;
        }
        const double e = double(N) * p[size_t(rank)] / mass;
        chi += (count[size_t(i)] - e) * (count[size_t(i)] - e) / e;
    }
    if (outside > 0) chi = INFINITY;   // a filtered token was drawn
    return {chi, keep - 1};
}

TEST(cuda_sample, chi_square_matches_the_filtered_softmax_and_control_fails) {
    NEED_GPU();
    const int N = 40000;
    const auto [chi, df] = chi_square(0.8f, 0.8f, N);
    const auto [chi_ctl, df_ctl] = chi_square(0.8f, 1.2f, N);   // control: expected at the wrong temperature
    // Critical value at p = 0.001 (Wilson-Hilferty): df (1 - 2/(9 df) + 3.09 sqrt(2/(9 df)))^3.
    auto crit = [](int d) {
        const double a = 2.0 / (9.0 * d);
        return d * std::pow(1.0 - a + 3.09 * std::sqrt(a), 3.0);
    };
    std::printf("[cuda_sample] chi-square %.2f (df %d, critical %.2f at p=0.001); control at a wrong temperature %.2f (df %d)\n",
                chi, df, crit(df), chi_ctl, df_ctl);
    ASSERT_GE(df, 3) << "the filters should leave several tokens";
    EXPECT_LT(chi, crit(df));
    EXPECT_GT(chi_ctl, crit(df_ctl)) << "control: a distribution at the wrong temperature must be rejected";
}

// backend::sample_rows on a graph output: CPU backend and CUDA backend give the same ids.
TEST(cuda_sample, backend_entry_cpu_equals_cuda) {
    NEED_GPU();
    const int R = 6;
    const int64_t V = 4096;
    const std::vector<float> x = make_rows(R, V, 7);
    tensor t = tensor_new(dtype::F32, {R, V});
    std::copy(x.begin(), x.end(), t.f32());
    auto b = std::make_shared<batch>();
    b->ids = {0};
    b->seq_start = {0, 1};
    b->pos0 = {0};
    b->slot = {0};
    b->block_table = {{0}};
    b->page_size = 16;
    std::vector<row_sampling> s;
    for (int r = 0; r < R; ++r) s.push_back({r == 0 ? 0.0f : 0.7f, r == 1 ? 20 : 0, r == 2 ? 0.8f : 1.0f, r == 3 ? 0.1f : 0.0f, uniform(5, uint64_t(r))});
    std::vector<int32_t> got[2];
    std::unique_ptr<backend> bes[2] = {backend_cpu_init(), backend_cuda_init(0)};
    for (int k = 0; k < 2; ++k) {
        builder bd(b);
        graph g = bd.finish(bd.scale(bd.weight(t, "logits_leaf"), 1.0f));
        bes[k]->run(g);
        got[k] = bes[k]->sample_rows(g.logits, s);
    }
    EXPECT_EQ(got[0], got[1]);
    EXPECT_THROW(bes[1]->sample_rows(node_ref{999, 0}, s), error);
}

} // namespace
