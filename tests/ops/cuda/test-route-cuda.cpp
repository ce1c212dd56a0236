// MOE_ROUTE selection kernels (route-select.cu) on the GPU: one warp per token (cuda_options::moe_select_warp), a
// bitonic sort per token (moe_select_sort) and the threshold search (moe_select_radix), all held to the same checks:
//  1. fast_equals_block: over many shapes (E 1..1024, top-1..64, T 1..37, bias or none, sigmoid/softmax, grouped or not,
//     renormalized or not) with logits from a coarse grid (so that exact ties are everywhere), continuous logits, NaN,
//     -inf and all-equal cases, each form's ids and weights are bit for bit those of the block-wide selection (moe.cu
//     k_moe_select, the kernel the parity suites already hold to the CPU reference).
//  2. fast_equals_cpu_rule: on the same logits (no NaN), the ids equal a host implementation of the reference's rule
//     (descending biased score, ties to the lower id, group pruning by top-2 sums, ties to the lower group) and the
//     weights agree to 1e-6.
//  3. controls_fail: one swapped id and one weight moved by one ulp must each be reported; the host rule with ties to
//     the HIGHER id must disagree with every kernel on tie-heavy logits (the tie rule is really exercised).
//  4. fused_t1: the one-launch T == 1 route (GEMV + last block selects): logits vs the host in double, ids and weights bit
//     for bit the block selection over its own logits, the counter back at 0 and a second launch identical; control: a
//     counter that never yields the last ticket leaves the sentinels, which the comparison must report.
//  5. small_equals_radix: the small selection (route-select.cu, cuda_options::moe_select_small) with 4 warps (two
//     experts per lane) and 8, bit for bit the threshold form on every case in its domain (sigmoid, no group pruning, E <= 256, top-k
//     <= 8) plus extra E / k / tie / NaN cases; every case outside the domain refused; controls: a swapped pick, a
//     weight one ulp off, and the small form's output with its candidate merge cut to one warp (a wrong selection on
//     these logits) must each be reported.
//  6. timing: [timing] lines for the decode route (router GEMV v1 / v2, then each selection, the small form where it
//     applies; the fused route at T = 1) at
//     the Kimi-Linear-48B and K3 geometries: CUDA graphs of back-to-back launches with PDL on, router weights rotated
//     past the L2.
// The cases skip (saying why) on a machine without a CUDA device.
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/prefill-ops.h"
#include "dev-buffer.h"
#include "graph-timer.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace perigee::cuda {
namespace {

using test::cu;
using test::dev;

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the routing-selection tests need the GPU machine"

struct rcase {
    int E, k, T, n_group, topk_group;
    bool bias, softmax, renorm;
    int special;   // 0 none, 1 NaN at expert 0 of every token, 2 NaN in the middle, 3 half the experts -inf,
                   // 4 continuous logits (no ties), 5 every logit equal, 6 every logit -inf
};

struct result {
    std::vector<int32_t> ids;
    std::vector<float> w;
};

enum class kind { block, warp, sort, radix, small4, small8 };
const char * kind_name(kind k) {
    return k == kind::warp ? "warp" : k == kind::sort ? "sort" : k == kind::radix ? "radix" : k == kind::small4 ? "small4"
           : k == kind::small8 ? "small8" : "block";
}

// Runs one selection kernel on the device over logits [T, E].
result run_select(kind kk, const rcase & c, const std::vector<float> & logits, const std::vector<float> & bias) {
    dev<float> dl(logits), dw(size_t(c.T * c.k));
    std::unique_ptr<dev<float>> db;
    if (c.bias) db = std::make_unique<dev<float>>(bias);
    dev<int32_t> di(size_t(c.T * c.k));
    cu(cudaMemset(di.p, 0xff, di.n * 4), "memset ids");   // sentinels: an unwritten slot shows up as -1 / NaN
    cu(cudaMemset(dw.p, 0xff, dw.n * 4), "memset w");
    const droute r{c.E, c.k, c.n_group, c.topk_group, c.renorm, 2.5f, c.softmax ? 1 : 0};
    const dweight bw{db ? db->p : nullptr, wtype::F32};
    cudaStream_t st;
    cu(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    const cudaError_t e = kk == kind::warp    ? launch_moe_select_warp(dl.p, c.T, bw, r, di.p, dw.p, st)
                          : kk == kind::sort  ? launch_moe_select_sort(dl.p, c.T, bw, r, di.p, dw.p, st)
                          : kk == kind::radix ? launch_moe_select_radix(dl.p, c.T, bw, r, di.p, dw.p, st)
                          : kk == kind::small4 ? launch_moe_select_small4(dl.p, c.T, bw, r, di.p, dw.p, st)
                          : kk == kind::small8 ? launch_moe_select_small8(dl.p, c.T, bw, r, di.p, dw.p, st)
                                              : launch_moe_select(dl.p, c.T, bw, r, di.p, dw.p, st);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    cudaStreamDestroy(st);
    return result{di.down(), dw.down()};
}

// The reference's rule on the host (src/backend/cpu/moe.cpp moe_route_ref, from given logits).
// ties_high: ties to the HIGHER id instead (a wrong rule, for the control that must fail).
result host_select(const rcase & c, const std::vector<float> & logits, const std::vector<float> & bias, bool ties_high = false) {
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
            return biased[size_t(a)] > biased[size_t(b)] ||
                   (biased[size_t(a)] == biased[size_t(b)] && (ties_high ? a > b : a < b));
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
    // wide top-k (the threshold form's 64 candidate slots, the epilogue's second lane slot), tiny E, E not a multiple of
    // 32 (a partial last warp), continuous / all-equal / all -inf logits, the two target geometries
    for (int E : {64, 100, 256, 896, 1024})
        for (int k : {32, 33, 64})
            for (int special : {0, 4}) v.push_back(rcase{E, k, 3, 1, 1, true, false, true, special});
    for (int E : {1, 2, 3, 5, 7, 31, 33, 65})
        for (int k : {1, 2, 5})
            if (k <= E) v.push_back(rcase{E, k, 2, 1, 1, E % 2 == 1, false, true, E == 33 ? 4 : 0});
    for (int special : {5, 6})
        for (int E : {8, 256, 896}) {
            v.push_back(rcase{E, 8, 2, 1, 1, false, false, true, special});
            v.push_back(rcase{E, 8, 2, 1, 1, true, special == 5, true, special});
        }
    for (int T : {1, 8}) {
        v.push_back(rcase{256, 8, T, 1, 1, true, false, true, 4});   // Kimi-Linear-48B
        v.push_back(rcase{896, 16, T, 1, 1, true, false, true, 4});  // K3
        v.push_back(rcase{256, 8, T, 8, 4, true, false, true, 4});   // grouped, continuous
    }
    return v;
}

void make_inputs(const rcase & c, uint32_t seed, std::vector<float> & logits, std::vector<float> & bias) {
    std::mt19937 rng(seed);
    logits.assign(size_t(c.T) * c.E, 0.0f);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (auto & x : logits) x = c.special == 4 ? nd(rng) : float(int(rng() % 9) - 4) * 0.5f;   // coarse: exact ties everywhere
    bias.assign(size_t(c.E), 0.0f);
    for (auto & b : bias) b = c.special == 4 ? nd(rng) * 0.01f : float(int(rng() % 5) - 2) * 0.125f;
    if (c.special == 5 || c.special == 6) {   // every key equal: the picks are ids 0..k-1
        for (auto & x : logits) x = c.special == 5 ? 0.75f : -std::numeric_limits<float>::infinity();
        for (auto & b : bias) b = 0.25f;
    }
    for (int t = 0; t < c.T; ++t) {
        float * row = logits.data() + size_t(t) * c.E;
        if (c.special == 1) row[0] = std::nanf("");
        if (c.special == 2) row[c.E / 2] = std::nanf("");
        if (c.special == 3)
            for (int e = 0; e < c.E; e += 2) row[e] = -std::numeric_limits<float>::infinity();
    }
}

std::string describe(const rcase & c) {
    return "E " + std::to_string(c.E) + " k " + std::to_string(c.k) + " T " + std::to_string(c.T) + " groups " +
           std::to_string(c.n_group) + "/" + std::to_string(c.topk_group) + " bias " + std::to_string(c.bias) + " softmax " +
           std::to_string(c.softmax) + " renorm " + std::to_string(c.renorm) + " special " + std::to_string(c.special);
}

const kind k_fast[] = {kind::warp, kind::sort, kind::radix};

TEST(route_select, fast_equals_block) {
    NEED_GPU();
    int n = 0;
    uint32_t seed = 1;
    for (const rcase & c : cases()) {
        std::vector<float> logits, bias;
        make_inputs(c, seed++, logits, bias);
        const result blk = run_select(kind::block, c, logits, bias);
        for (const kind kk : k_fast)
            EXPECT_EQ(diff_bitwise(run_select(kk, c, logits, bias), blk), "") << kind_name(kk) << ": " << describe(c);
        ++n;
    }
    std::printf("[route_select] warp, sort and radix == block bit for bit on %d cases\n", n);
}

TEST(route_select, fast_equals_cpu_rule) {
    NEED_GPU();
    int n = 0;
    uint32_t seed = 1000;
    for (const rcase & c : cases()) {
        if (c.special == 1 || c.special == 2) continue;   // the host rule's partial_sort is not defined on NaN
        std::vector<float> logits, bias;
        make_inputs(c, seed++, logits, bias);
        const result ref = host_select(c, logits, bias);
        for (const kind kk : k_fast)
            EXPECT_EQ(diff_ids_close(run_select(kk, c, logits, bias), ref, 1e-6f), "") << kind_name(kk) << ": " << describe(c);
        ++n;
    }
    std::printf("[route_select] warp, sort and radix == the reference rule on %d cases\n", n);
}

TEST(route_select, controls_fail) {
    NEED_GPU();
    for (const kind kk : k_fast) {
        const rcase c{896, 16, 3, 1, 1, true, false, true, 0};
        std::vector<float> logits, bias;
        make_inputs(c, 77, logits, bias);
        const result got = run_select(kk, c, logits, bias), blk = run_select(kind::block, c, logits, bias),
                     ref = host_select(c, logits, bias);
        ASSERT_EQ(diff_bitwise(got, blk), "") << kind_name(kk);
        ASSERT_EQ(diff_ids_close(got, ref, 1e-6f), "") << kind_name(kk);
        result swapped = got;
        std::swap(swapped.ids[0], swapped.ids[1]);
        EXPECT_NE(diff_bitwise(swapped, blk), "") << kind_name(kk) << " control: a swapped pick must be reported (bitwise)";
        EXPECT_NE(diff_ids_close(swapped, ref, 1e-6f), "") << kind_name(kk) << " control: a swapped pick must be reported (reference)";
        result ulp = got;
        ulp.w[5] = std::nextafter(ulp.w[5], 1e30f);
        EXPECT_NE(diff_bitwise(ulp, blk), "") << kind_name(kk) << " control: a weight one ulp off must be reported (bitwise)";
        result far = got;
        far.w[5] *= 1.0001f;
        EXPECT_NE(diff_ids_close(far, ref, 1e-6f), "") << kind_name(kk) << " control: a weight 1e-4 off must be reported (reference)";
        // the tie rule matters on these logits: the rule with ties to the higher id picks other experts
        EXPECT_NE(diff_ids_close(got, host_select(c, logits, bias, true), 1e-6f), "")
            << kind_name(kk) << " control: ties to the higher id must give other picks on the tie-heavy logits";
    }
    // the same tie control on the all-equal case: the picks must be 0..k-1, never k-1..0 or the top ids
    const rcase eq{256, 8, 1, 1, 1, false, false, true, 5};
    std::vector<float> logits, bias;
    make_inputs(eq, 5, logits, bias);
    const result got = run_select(kind::radix, eq, logits, bias);
    for (int j = 0; j < eq.k; ++j) EXPECT_EQ(got.ids[size_t(j)], j) << "radix, all scores equal: pick " << j;
    EXPECT_NE(diff_ids_close(got, host_select(eq, logits, bias, true), 1e-6f), "")
        << "control: ties to the higher id must pick 255..248 on all-equal scores";
}

// The small selection's domain (route-select.cu route_small_supported; moe_select_small_supported is the backend's rule).
bool small_domain(const rcase & c) {
    return !c.softmax && (c.n_group <= 1 || c.topk_group >= c.n_group) && c.E <= 256 && c.k <= 8 && c.k <= c.E;
}

TEST(route_select, small_equals_radix) {
    NEED_GPU();
    std::vector<rcase> v;
    for (const rcase & c : cases())
        if (small_domain(c)) v.push_back(c);
    // every top-k 1..8 at the 48B's E, E around the lane / warp boundaries, all-equal and NaN rows at top-8
    for (int k = 1; k <= 8; ++k)
        for (int special : {0, 4}) v.push_back(rcase{256, k, 4, 1, 1, true, false, true, special});
    for (int E : {8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 255})
        for (int k : {1, 7, 8})
            if (k <= E) v.push_back(rcase{E, k, 3, 1, 1, E % 3 != 0, false, E % 2 == 0, E % 5 == 0 ? 4 : 0});
    for (int special : {1, 2, 3, 5, 6}) v.push_back(rcase{256, 8, 3, 1, 1, true, false, true, special});
    v.push_back(rcase{256, 8, 5, 8, 8, true, false, true, 4});   // groups, all kept: no pruning (in the domain)
    int n = 0;
    uint32_t seed = 5000;
    for (const rcase & c : v) {
        std::vector<float> logits, bias;
        make_inputs(c, seed++, logits, bias);
        const result rad = run_select(kind::radix, c, logits, bias);
        for (const kind kk : {kind::small4, kind::small8})
            EXPECT_EQ(diff_bitwise(run_select(kk, c, logits, bias), rad), "") << kind_name(kk) << ": " << describe(c);
        ++n;
    }
    std::printf("[route_select] small (4 and 8 warps) == radix bit for bit on %d cases\n", n);
    // outside the domain: refused by both launchers (nothing launched) and by the backend's rule
    const dweight nb{};
    int bad = 0, n_out = 0;
    for (const auto & [E, k, ng, tg, sm] : std::vector<std::tuple<int, int, int, int, int>>{
             {257, 8, 1, 1, 0}, {256, 9, 1, 1, 0}, {256, 8, 1, 1, 1}, {256, 8, 8, 4, 0}, {4, 8, 1, 1, 0}, {0, 1, 1, 1, 0}}) {
        const droute r{E, k, ng, tg, true, 1.0f, sm};
        ++n_out;
        bad += launch_moe_select_small4(nullptr, 1, nb, r, nullptr, nullptr, nullptr) != cudaErrorInvalidValue;
        bad += launch_moe_select_small8(nullptr, 1, nb, r, nullptr, nullptr, nullptr) != cudaErrorInvalidValue;
        bad += moe_select_small_supported(E, k, ng, tg, sm != 0);
    }
    EXPECT_EQ(bad, 0) << "the small selection accepted a route outside its domain";
    const bool in_ok = moe_select_small_supported(256, 8, 1, 1, false) && moe_select_small_supported(256, 8, 8, 8, false);
    EXPECT_TRUE(in_ok) << "the backend's rule refused the 48B route";
    std::printf("[route_select] small: %d out-of-domain routes, %d accepted\n", n_out, bad);
}

TEST(route_select, small_controls_fail) {
    NEED_GPU();
    const rcase c{256, 8, 4, 1, 1, true, false, true, 0};
    std::vector<float> logits, bias;
    make_inputs(c, 91, logits, bias);
    const result rad = run_select(kind::radix, c, logits, bias);
    const result got = run_select(kind::small4, c, logits, bias);
    ASSERT_EQ(diff_bitwise(got, rad), "");
    result swapped = got;
    std::swap(swapped.ids[2], swapped.ids[3]);
    EXPECT_NE(diff_bitwise(swapped, rad), "") << "control: a swapped pick must be reported";
    result ulp = got;
    ulp.w[7] = std::nextafter(ulp.w[7], 1e30f);
    EXPECT_NE(diff_bitwise(ulp, rad), "") << "control: a weight one ulp off must be reported";
    // one warp's candidates only (E = 256 seen through the first 64 experts): another selection, which must be reported
    rcase cut = c;
    cut.E = 64;
    std::vector<float> lcut;
    for (int t = 0; t < c.T; ++t) lcut.insert(lcut.end(), logits.begin() + t * 256, logits.begin() + t * 256 + 64);
    const result part = run_select(kind::small4, cut, lcut, std::vector<float>(bias.begin(), bias.begin() + 64));
    EXPECT_NE(diff_bitwise(part, rad), "") << "control: the picks among a quarter of the experts must be reported";
}

// The one-launch route at T == 1 (launch_moe_route_radix_fused): its logits against a double-precision host dot product,
// its ids and weights bit for bit the block selection's over ITS OWN logits, a second launch with the counter it left
// (0 again) identical; control: a counter not at 0 (0xFFFFFFFF: no block ever draws the last ticket) leaves the sentinel
// outputs, which the comparison must report.
struct fused_out {
    std::vector<float> logits;
    result r;
    unsigned counter_after = 0;
};

fused_out run_fused(int E, int k, int64_t D, const std::vector<uint16_t> & gate, const std::vector<float> & x,
                    const std::vector<float> & bias, unsigned counter0, cudaError_t * err = nullptr) {
    dev<uint16_t> dg(gate);
    dev<float> dx(x), db(bias), dl(static_cast<size_t>(E)), dw(static_cast<size_t>(k));
    dev<int32_t> di(static_cast<size_t>(k));
    dev<unsigned> dc(std::vector<unsigned>{counter0});
    cu(cudaMemset(di.p, 0xff, di.n * 4), "memset ids");
    cu(cudaMemset(dw.p, 0xff, dw.n * 4), "memset w");
    const droute r{E, k, 1, 1, true, 2.5f, 0};
    cudaStream_t st;
    cu(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    const cudaError_t e = launch_moe_route_radix_fused(dx.p, D, {dg.p, wtype::BF16}, {db.p, wtype::F32}, r, dl.p, dc.p, di.p,
                                                       dw.p, st);
    if (err) *err = e;
    else EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    cudaStreamDestroy(st);
    return fused_out{dl.down(), result{di.down(), dw.down()}, dc.down().at(0)};
}

TEST(route_select, fused_t1) {
    NEED_GPU();
    struct fcase { int E, k; int64_t D; };
    int n = 0;
    for (const fcase & f : {fcase{256, 8, 2304}, fcase{896, 16, 7168}, fcase{64, 6, 256}, fcase{100, 8, 512}, fcase{8, 2, 64},
                            fcase{1024, 64, 1024}, fcase{200, 8, 96}}) {
        std::mt19937 rng(uint32_t(f.E * 31 + f.k));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<uint16_t> gate(size_t(f.E) * size_t(f.D));
        for (auto & g : gate) {
            const float v = nd(rng) * 0.05f;
            uint32_t u;
            std::memcpy(&u, &v, 4);
            g = uint16_t(u >> 16);
        }
        std::vector<float> x(size_t(f.D)), bias(size_t(f.E));
        for (auto & v : x) v = nd(rng);
        for (auto & b : bias) b = nd(rng) * 0.01f;
        const std::string what = "E " + std::to_string(f.E) + " k " + std::to_string(f.k) + " D " + std::to_string(f.D);
        const fused_out a = run_fused(f.E, f.k, f.D, gate, x, bias, 0u);
        int shifted_fail = 0;
        for (int e = 0; e < f.E; ++e) {   // fp32 sums vs the host in double: |err| <= D eps sum |w x| (fp32 sum bound)
            double ref = 0.0, mag = 0.0;
            for (int64_t i = 0; i < f.D; ++i) {
                uint32_t u = uint32_t(gate[size_t(e * f.D + i)]) << 16;
                float wv;
                std::memcpy(&wv, &u, 4);
                ref += double(wv) * x[size_t(i)];
                mag += std::fabs(double(wv) * x[size_t(i)]);
            }
            ASSERT_LE(std::fabs(a.logits[size_t(e)] - ref), double(f.D) * 6e-8 * mag + 1e-30) << what << ": logit " << e;
            // control: the next row's logit held to this row's reference must mostly fail the same bound
            shifted_fail += std::fabs(a.logits[size_t((e + 1) % f.E)] - ref) > double(f.D) * 6e-8 * mag + 1e-30;
        }
        EXPECT_GT(shifted_fail, f.E / 2) << what << " control: logits of the wrong rows passed the logit bound";
        const rcase c{f.E, f.k, 1, 1, 1, true, false, true, 0};
        const result blk = run_select(kind::block, c, a.logits, bias);
        EXPECT_EQ(diff_bitwise(a.r, blk), "") << "fused vs the block selection over its logits: " << what;
        EXPECT_EQ(a.counter_after, 0u) << what << ": the counter must wrap back to 0";
        const fused_out b = run_fused(f.E, f.k, f.D, gate, x, bias, a.counter_after);
        EXPECT_EQ(diff_bitwise(b.r, a.r), "") << what << ": a second launch on the counter the first left";
        EXPECT_EQ(b.logits, a.logits) << what << ": logits not deterministic";
        // control: a counter that never yields the last ticket leaves the sentinels; the comparison must see it
        const fused_out bad = run_fused(f.E, f.k, f.D, gate, x, bias, 0xFFFFFFFFu);
        EXPECT_NE(diff_bitwise(bad.r, blk), "") << what << " control: no block selected, yet the outputs compare equal";
        ++n;
    }
    // shapes the kernel must refuse (not compute wrongly)
    cudaError_t e = cudaSuccess;
    std::vector<uint16_t> g(size_t(256) * 100, 0x3f80);
    std::vector<float> x(100, 1.0f), bias(256, 0.0f);
    (void)run_fused(256, 8, 100, g, x, bias, 0u, &e);   // D = 100: not a multiple of 32
    EXPECT_EQ(e, cudaErrorInvalidValue) << "D 100 must be refused";
    std::printf("[route_select] fused T=1 route: logits within the fp32 bound, selection == block bit for bit on %d shapes\n", n);
}

// ---- timing ----
struct gpu_timer {
    cudaStream_t st{};
    explicit gpu_timer(cudaStream_t s) : st(s) {}
    // median over 7 replays of a graph of nl back-to-back launches of f(i), per launch, in us
    double us(const std::function<void(int)> & f, int nl) {
        bool first = true;   // the eager run (graph_replay_ms's first body()) launches f(0) once, as before
        const double ms = test::graph_replay_ms(st, [&] {
            if (first) {
                first = false;
                f(0);
                return;
            }
            for (int i = 0; i < nl; ++i) f(i);
        }, 7, 3);
        return ms * 1000.0 / nl;
    }
};

TEST(route_select, timing) {
    NEED_GPU();
    pdl_scope pdl(true);   // as the backend's decode step runs
    struct geo { const char * name; int E, k; int64_t D; };
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    gpu_timer tm(st);
    for (const geo & g : {geo{"48B", 256, 8, 2304}, geo{"K3", 896, 16, 7168}}) {
        const size_t wbytes = size_t(g.E) * size_t(g.D) * 2;
        const int copies = int((size_t(160) << 20) / wbytes + 1), nl = 64;
        std::vector<uint16_t> hw(size_t(g.E) * size_t(g.D));
        std::mt19937 rng(11);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto & x : hw) {
            const float f = nd(rng) * 0.02f;
            uint32_t u;
            std::memcpy(&u, &f, 4);
            x = uint16_t(u >> 16);
        }
        std::vector<std::unique_ptr<dev<uint16_t>>> wcb;   // copies of the router weight (L2-cold launches)
        std::vector<void *> wc;
        for (int i = 0; i < copies; ++i) {
            wcb.push_back(std::make_unique<dev<uint16_t>>(hw));
            wc.push_back(wcb.back()->p);
        }
        std::vector<float> hx(size_t(8 * g.D)), hb(size_t(g.E));
        for (auto & v : hx) v = nd(rng);
        for (auto & b : hb) b = nd(rng) * 0.01f;
        dev<float> xb(hx), dbb(hb), lgb(size_t(8 * g.E)), wb(size_t(8 * g.k));
        dev<int32_t> idsb(size_t(8 * g.k));
        float *x = xb.p, *db = dbb.p, *lg = lgb.p, *w = wb.p;
        int32_t * ids = idsb.p;
        const droute r{g.E, g.k, 1, 1, true, 2.5f, 0};
        const dweight bw{db, wtype::F32};
        using sel_fn = cudaError_t (*)(const float *, int64_t, dweight, const droute &, int32_t *, float *, cudaStream_t);
        std::vector<std::pair<const char *, sel_fn>> sels = {
            {"block", launch_moe_select}, {"sort", launch_moe_select_sort}, {"radix", launch_moe_select_radix}};
        if (moe_select_small_supported(g.E, g.k, 1, 1, false)) {   // the small form where it applies (the 48B)
            sels.emplace_back("small4", launch_moe_select_small4);
            sels.emplace_back("small8", launch_moe_select_small8);
        }
        const std::pair<const char *, gemv_cfg> gemvs[] = {{"gemv-v1", gemv_cfg{0, 0}}, {"gemv-v2", gemv_cfg{4, 0}}};
        for (int T : {1, 8}) {
            auto gemv = [&](int i, const gemv_cfg & cfg) {
                EXPECT_EQ(launch_linear_gemv(x, T, g.D, dweight{wc[size_t(i % copies)], wtype::BF16}, g.E, lg, st, cfg),
                          cudaSuccess);
            };
            std::printf("[timing] %s route E=%d top-%d D=%lld T=%d (us per launch, graph of %d, PDL):", g.name, g.E, g.k,
                        (long long)g.D, T, nl);
            for (const auto & gv : gemvs) std::printf(" %s %.2f", gv.first, tm.us([&](int i) { gemv(i, gv.second); }, nl));
            for (const auto & sv : sels)
                std::printf(" | %s %.2f", sv.first,
                            tm.us([&](int) { EXPECT_EQ(sv.second(lg, T, bw, r, ids, w, st), cudaSuccess); }, nl));
            if (T == 1) {
                dev<unsigned> ctrb(std::vector<unsigned>{0u});
                unsigned * ctr = ctrb.p;
                std::printf(" | fused %.2f", tm.us([&](int i) {
                                EXPECT_EQ(launch_moe_route_radix_fused(x, g.D, dweight{wc[size_t(i % copies)], wtype::BF16}, bw, r, lg,
                                                                       ctr, ids, w, st),
                                          cudaSuccess);
                            }, nl));
            }
            std::printf("\n[timing] %s route T=%d, GEMV + selection:", g.name, T);
            for (const auto & gv : gemvs)
                for (const auto & sv : sels)
                    std::printf(" | %s+%s %.2f", gv.first, sv.first, tm.us([&](int i) {
                                    gemv(i, gv.second);
                                    EXPECT_EQ(sv.second(lg, T, bw, r, ids, w, st), cudaSuccess);
                                }, nl));
            std::printf("\n");
        }
    }
    cudaStreamDestroy(st);
}

} // namespace
} // namespace perigee::cuda
