// MOE_ROUTE selection by one warp per token and by a bitonic sort per token (route-select.cu, cuda_options::
// moe_select_warp / moe_select_sort), on the GPU (both held to the same checks):
//  1. warp_equals_block: over many shapes (E 8..1024, top-1..16, T 1..37, bias or none, sigmoid/softmax, grouped or not,
//     renormalized or not) with logits from a coarse grid (so that exact ties are everywhere) plus NaN and -inf cases,
//     the warp selection's ids and weights are bit for bit those of the block-wide selection (moe.cu k_moe_select, the
//     kernel the parity suites already hold to the CPU reference).
//  2. warp_equals_cpu_rule: on the same tie-heavy logits (no NaN), the ids equal a host implementation of the reference's
//     rule (descending biased score, ties to the lower id, group pruning by top-2 sums, ties to the lower group) and the
//     weights agree to 1e-6.
//  3. the comparators' controls: one swapped id and one weight moved by one ulp must each be reported.
// The cases skip (saying why) on a machine without a CUDA device.
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/prefill-ops.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace perigee::cuda {
namespace {

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the routing-selection tests need the GPU machine"

struct rcase {
    int E, k, T, n_group, topk_group;
    bool bias, softmax, renorm;
    int special;   // 0 none, 1 NaN at expert 0 of every token, 2 NaN in the middle, 3 half the experts -inf
};

struct result {
    std::vector<int32_t> ids;
    std::vector<float> w;
};

enum class kind { block, warp, sort };

// Runs one selection kernel on the device over logits [T, E].
result run_select(kind kk, const rcase & c, const std::vector<float> & logits, const std::vector<float> & bias) {
    float *dl = nullptr, *db = nullptr, *dw = nullptr;
    int32_t * di = nullptr;
    cudaMalloc(reinterpret_cast<void **>(&dl), logits.size() * 4);
    cudaMemcpy(dl, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice);
    if (c.bias) {
        cudaMalloc(reinterpret_cast<void **>(&db), bias.size() * 4);
        cudaMemcpy(db, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice);
    }
    cudaMalloc(reinterpret_cast<void **>(&di), size_t(c.T * c.k) * 4);
    cudaMalloc(reinterpret_cast<void **>(&dw), size_t(c.T * c.k) * 4);
    cudaMemset(di, 0xff, size_t(c.T * c.k) * 4);   // sentinels: an unwritten slot shows up as -1 / NaN
    cudaMemset(dw, 0xff, size_t(c.T * c.k) * 4);
    const droute r{c.E, c.k, c.n_group, c.topk_group, c.renorm, 2.5f, c.softmax ? 1 : 0};
    const dweight bw{db, wtype::F32};
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    const cudaError_t e = kk == kind::warp   ? launch_moe_select_warp(dl, c.T, bw, r, di, dw, st)
                          : kk == kind::sort ? launch_moe_select_sort(dl, c.T, bw, r, di, dw, st)
                                             : launch_moe_select(dl, c.T, bw, r, di, dw, st);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    cudaStreamDestroy(st);
    result out{std::vector<int32_t>(size_t(c.T * c.k)), std::vector<float>(size_t(c.T * c.k))};
    cudaMemcpy(out.ids.data(), di, out.ids.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(out.w.data(), dw, out.w.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(dl);
    cudaFree(db);
    cudaFree(di);
    cudaFree(dw);
    return out;
}

// The reference's rule on the host (src/backend/cpu/moe.cpp moe_route_ref, from given logits).
result host_select(const rcase & c, const std::vector<float> & logits, const std::vector<float> & bias) {
    result out{std::vector<int32_t>(size_t(c.T * c.k)), std::vector<float>(size_t(c.T * c.k))};
    const int E = c.E;
    for (int t = 0; t < c.T; ++t) {
        std::vector<float> score(logits.begin() + int64_t(t) * E, logits.begin() + int64_t(t + 1) * E);
        std::vector<float> biased(static_cast<size_t>(E));
        if (!c.softmax) {
            for (auto & s : score) s = 1.0f / (1.0f + std::exp(-s));
        } else {
            const float mx = *std::max_element(score.begin(), score.end());
            double sum = 0.0;
            for (auto & s : score) sum += (s = std::exp(s - mx));
            for (auto & s : score) s = float(s / sum);
        }
        for (int e = 0; e < E; ++e) biased[size_t(e)] = score[size_t(e)] + (c.bias ? bias[size_t(e)] : 0.0f);
        if (c.n_group > 1 && c.topk_group < c.n_group) {
            const int gs = E / c.n_group;
            std::vector<float> gscore(size_t(c.n_group));
            for (int g = 0; g < c.n_group; ++g) {
                std::vector<float> v(biased.begin() + g * gs, biased.begin() + (g + 1) * gs);
                std::sort(v.begin(), v.end(), std::greater<float>());
                gscore[size_t(g)] = v[0] + (gs > 1 ? v[1] : 0.0f);
            }
            std::vector<int> order(static_cast<size_t>(c.n_group));
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
            std::vector<bool> keep(size_t(c.n_group), false);
            for (int i = 0; i < c.topk_group; ++i) keep[size_t(order[size_t(i)])] = true;
            for (int e = 0; e < E; ++e)
                if (!keep[size_t(e / gs)]) biased[size_t(e)] = -std::numeric_limits<float>::infinity();
        }
        std::vector<int> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + c.k, order.end(), [&](int a, int b) {
            return biased[size_t(a)] > biased[size_t(b)] || (biased[size_t(a)] == biased[size_t(b)] && a < b);
        });
        double sum = 0.0;
        for (int j = 0; j < c.k; ++j) sum += score[size_t(order[size_t(j)])];
        for (int j = 0; j < c.k; ++j) {
            float wj = score[size_t(order[size_t(j)])];
            if (c.renorm) wj = float(wj / (sum + 1e-20));
            out.ids[size_t(t * c.k + j)] = order[size_t(j)];
            out.w[size_t(t * c.k + j)] = wj * 2.5f;
        }
    }
    return out;
}

// Bitwise: every id equal and every weight's bits equal. Returns the first difference ("" = equal).
std::string diff_bitwise(const result & a, const result & b) {
    for (size_t i = 0; i < a.ids.size(); ++i) {
        if (a.ids[i] != b.ids[i]) return "id " + std::to_string(i) + ": " + std::to_string(a.ids[i]) + " vs " + std::to_string(b.ids[i]);
        uint32_t x, y;
        std::memcpy(&x, &a.w[i], 4);
        std::memcpy(&y, &b.w[i], 4);
        if (x != y) return "weight " + std::to_string(i) + ": " + std::to_string(a.w[i]) + " vs " + std::to_string(b.w[i]);
    }
    return "";
}

// Ids equal, weights within rel (the host's exp may differ from the device's by an ulp).
std::string diff_ids_close(const result & a, const result & b, float rel) {
    for (size_t i = 0; i < a.ids.size(); ++i) {
        if (a.ids[i] != b.ids[i]) return "id " + std::to_string(i) + ": " + std::to_string(a.ids[i]) + " vs " + std::to_string(b.ids[i]);
        if (!(std::fabs(a.w[i] - b.w[i]) <= rel * std::fabs(b.w[i]) + 1e-30f))
            return "weight " + std::to_string(i) + ": " + std::to_string(a.w[i]) + " vs " + std::to_string(b.w[i]);
    }
    return "";
}

std::vector<rcase> cases() {
    std::vector<rcase> v;
    for (int E : {8, 64, 256, 896, 1024})
        for (int k : {1, 2, 8, 16})
            for (int T : {1, 3, 37}) {
                if (k > E) continue;
                for (int variant = 0; variant < 4; ++variant) {
                    rcase c{E, k, T, 1, 1, (variant & 1) != 0, variant == 3, variant != 2, 0};
                    if (variant == 2 && E % 8 == 0 && (E / 8) * 4 >= k) { c.n_group = 8; c.topk_group = 4; }
                    v.push_back(c);
                }
            }
    for (int special : {1, 2, 3})
        for (int E : {64, 896}) v.push_back(rcase{E, 8, 5, 1, 1, true, false, true, special});
    return v;
}

void make_inputs(const rcase & c, uint32_t seed, std::vector<float> & logits, std::vector<float> & bias) {
    std::mt19937 rng(seed);
    logits.assign(size_t(c.T) * c.E, 0.0f);
    for (auto & x : logits) x = float(int(rng() % 9) - 4) * 0.5f;   // 9 values: exact ties everywhere
    bias.assign(size_t(c.E), 0.0f);
    for (auto & b : bias) b = float(int(rng() % 5) - 2) * 0.125f;
    for (int t = 0; t < c.T; ++t) {
        float * row = logits.data() + size_t(t) * c.E;
        if (c.special == 1) row[0] = std::nanf("");
        if (c.special == 2) row[c.E / 2] = std::nanf("");
        if (c.special == 3)
            for (int e = 0; e < c.E; e += 2) row[e] = -std::numeric_limits<float>::infinity();
    }
}

TEST(route_select, warp_equals_block) {
    NEED_GPU();
    int n = 0;
    uint32_t seed = 1;
    for (const rcase & c : cases()) {
        std::vector<float> logits, bias;
        make_inputs(c, seed++, logits, bias);
        const result blk = run_select(kind::block, c, logits, bias), wrp = run_select(kind::warp, c, logits, bias),
                     srt = run_select(kind::sort, c, logits, bias);
        EXPECT_EQ(diff_bitwise(srt, blk), "") << "sort: E " << c.E << " k " << c.k << " T " << c.T << " groups " << c.n_group
                                              << "/" << c.topk_group << " bias " << c.bias << " softmax " << c.softmax
                                              << " special " << c.special;
        const std::string d = diff_bitwise(wrp, blk);
        EXPECT_EQ(d, "") << "E " << c.E << " k " << c.k << " T " << c.T << " groups " << c.n_group << "/" << c.topk_group
                         << " bias " << c.bias << " softmax " << c.softmax << " special " << c.special;
        ++n;
    }
    std::printf("[route_select] warp == block and sort == block bit for bit on %d cases\n", n);
}

TEST(route_select, warp_equals_cpu_rule) {
    NEED_GPU();
    int n = 0;
    uint32_t seed = 1000;
    for (const rcase & c : cases()) {
        if (c.special == 1 || c.special == 2) continue;   // the host rule's partial_sort is not defined on NaN
        std::vector<float> logits, bias;
        make_inputs(c, seed++, logits, bias);
        const result wrp = run_select(kind::warp, c, logits, bias), ref = host_select(c, logits, bias);
        EXPECT_EQ(diff_ids_close(run_select(kind::sort, c, logits, bias), ref, 1e-6f), "") << "sort: E " << c.E << " k " << c.k;
        const std::string d = diff_ids_close(wrp, ref, 1e-6f);
        EXPECT_EQ(d, "") << "E " << c.E << " k " << c.k << " T " << c.T << " groups " << c.n_group << "/" << c.topk_group
                         << " bias " << c.bias << " softmax " << c.softmax << " special " << c.special;
        ++n;
    }
    std::printf("[route_select] warp == the reference rule on %d cases\n", n);
}

TEST(route_select, controls_fail) {
    NEED_GPU();
    const rcase c{896, 16, 3, 1, 1, true, false, true, 0};
    std::vector<float> logits, bias;
    make_inputs(c, 77, logits, bias);
    const result wrp = run_select(kind::warp, c, logits, bias), blk = run_select(kind::block, c, logits, bias),
                 ref = host_select(c, logits, bias);
    ASSERT_EQ(diff_bitwise(wrp, blk), "");
    ASSERT_EQ(diff_ids_close(wrp, ref, 1e-6f), "");
    result swapped = wrp;
    std::swap(swapped.ids[0], swapped.ids[1]);
    EXPECT_NE(diff_bitwise(swapped, blk), "") << "control: a swapped pick must be reported (bitwise)";
    EXPECT_NE(diff_ids_close(swapped, ref, 1e-6f), "") << "control: a swapped pick must be reported (reference)";
    result ulp = wrp;
    ulp.w[5] = std::nextafter(ulp.w[5], 1e30f);
    EXPECT_NE(diff_bitwise(ulp, blk), "") << "control: a weight one ulp off must be reported (bitwise)";
    result far = wrp;
    far.w[5] *= 1.0001f;
    EXPECT_NE(diff_ids_close(far, ref, 1e-6f), "") << "control: a weight 1e-4 off must be reported (reference)";
}

} // namespace
} // namespace perigee::cuda
