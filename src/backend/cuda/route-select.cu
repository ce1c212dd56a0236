// MOE_ROUTE selection, one warp per token (cuda_options::moe_select_warp): the k picks of the serial rule (highest
// biased score, ties to the lower id, a NaN at the first untaken id wins as the serial scan lets it) without a single
// __syncthreads. Why: the block-wide selection (moe.cu k_moe_select) pays two block barriers and a serial thread-0 merge
// per pick; at K3's top-16 of 896 that is ~28 us per token (Nsight Compute / per-op profile, bench/RESULTS.md
// 2026-11-30), longer than reading the router weight. Here each lane owns the experts e = lane + 32 i (i < 32, E <= 1024)
// and keeps their taken flags in one register; a pick is a lane-local scan plus three warp reductions (__reduce_*_sync).
#include "backend/cuda/common.cuh"
#include "backend/cuda/prefill-ops.h"

#include <climits>

namespace perigee::cuda {

namespace {

constexpr int k_sw_max_e = 1024;

// A float's bits mapped to an unsigned key with the same order (for non-NaN values; -0 is mapped as +0 first, so the
// two zeros tie as they compare equal). Every finite value and -inf maps above 0, so 0 means "no candidate".
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned u = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// grid T, block 32: token t = blockIdx.x. logits [T, E] -> ids [T, k], w [T, k].
__global__ void __launch_bounds__(32) k_moe_select_warp(const float * __restrict__ logits, dweight bias, droute c,
                                                        int32_t * __restrict__ ids, float * __restrict__ w) {
    pdl_enter();
    __shared__ float score[k_sw_max_e];
    __shared__ float biased[k_sw_max_e];
    __shared__ int32_t sel[64];
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x;
    const int E = int(c.n_expert);
    const float * lrow = logits + t * c.n_expert;
    for (int e = lane; e < E; e += 32) score[e] = lrow[e];
    __syncwarp();
    if (c.softmax) {   // serial, as the reference sums (fp32 exp, double sum)
        if (lane == 0) {
            float mx = -INFINITY;
            for (int e = 0; e < E; ++e) mx = fmaxf(mx, score[e]);
            double sum = 0.0;
            for (int e = 0; e < E; ++e) {
                score[e] = expf(score[e] - mx);
                sum += score[e];
            }
            for (int e = 0; e < E; ++e) score[e] = float(score[e] / sum);
        }
        __syncwarp();
    } else {
        for (int e = lane; e < E; e += 32) score[e] = sigmoid_d(score[e]);
    }
    for (int e = lane; e < E; e += 32) biased[e] = score[e] + (bias.data ? wload(bias, e) : 0.0f);
    __syncwarp();
    if (c.n_group > 1 && c.topk_group < c.n_group) {   // group pruning: serial, as the other kernels (n_group <= 64)
        if (lane == 0) {
            const int64_t gs = E / c.n_group;
            float gscore[64];
            bool keep[64];
            for (int64_t g = 0; g < c.n_group; ++g) {
                float a = -INFINITY, b2 = -INFINITY;
                for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
                    const float v = biased[e];
                    if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
                }
                gscore[g] = a + (gs > 1 ? b2 : 0.0f);
                keep[g] = false;
            }
            for (int64_t i = 0; i < c.topk_group; ++i) {   // ties to the lower group
                int64_t best = -1;
                for (int64_t g = 0; g < c.n_group; ++g)
                    if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                keep[best] = true;
            }
            for (int64_t e = 0; e < E; ++e)
                if (!keep[e / gs]) biased[e] = -INFINITY;
        }
        __syncwarp();
    }
    const int n_i = (E + 31) / 32;
    unsigned taken = 0;   // bit i: expert lane + 32 i already picked
    for (int64_t j = 0; j < c.topk; ++j) {
        unsigned best_key = 0;
        int best_e = INT_MAX, first = INT_MAX;
        for (int i = 0; i < n_i; ++i) {
            const int e = lane + 32 * i;
            if (e >= E || ((taken >> i) & 1u)) continue;
            if (first == INT_MAX) first = e;
            const float v = biased[e];
            if (v != v) continue;
            const unsigned key = order_key(v);
            if (key > best_key) { best_key = key; best_e = e; }   // strict: the lower id keeps a tie within the lane
        }
        const unsigned top = __reduce_max_sync(0xffffffffu, best_key);
        const int arg = __reduce_min_sync(0xffffffffu, (best_key == top && best_key != 0) ? best_e : INT_MAX);
        const int first_all = __reduce_min_sync(0xffffffffu, first);
        // the serial scan starts at the first untaken id and only a strictly greater score replaces it: a NaN there
        // (or no non-NaN candidate at all) keeps it
        const int pick = (arg == INT_MAX || biased[first_all] != biased[first_all]) ? first_all : arg;
        if ((pick & 31) == lane) taken |= 1u << (pick >> 5);
        if (lane == 0) sel[j] = pick;
    }
    __syncwarp();
    if (lane == 0) {
        int32_t * oid = ids + t * c.topk;
        double sum = 0.0;
        for (int64_t j = 0; j < c.topk; ++j) sum += score[sel[j]];
        for (int64_t j = 0; j < c.topk; ++j) {
            float wj = score[sel[j]];
            if (c.renormalize) wj = float(wj / (sum + 1e-20));
            oid[j] = sel[j];
            w[t * c.topk + j] = wj * c.scale;
        }
    }
}

// ---- Sort form (cuda_options::moe_select_sort): one block per token; the E biased scores become 64-bit keys
// (order-preserving value bits << 32 | ~id: descending key = descending score, ties to the lower id, -0 == +0) and a
// bitonic sort in shared memory orders them in log2(N)(log2(N)+1)/2 barrier-separated stages (55 at N = 1024); the
// first k keys are the serial rule's k picks. Why: the block selection pays two barriers and a serial merge per pick
// (k3: MOE_ROUTE ~38 us per layer, ~28 of them the top-16 selection; measured, bench/RESULTS.md session 3), and the
// warp form (above) was slower still. The serial rule's NaN case (a NaN at the first untaken id is picked) has no
// sort order, so a token with any NaN score takes the serial scan on one thread (exactly the reference's decisions).
constexpr int k_ss_threads = 512;

__global__ void __launch_bounds__(k_ss_threads) k_moe_select_sort(const float * __restrict__ logits, dweight bias, droute c,
                                                                  int32_t * __restrict__ ids, float * __restrict__ w) {
    pdl_enter();
    __shared__ float score[k_sw_max_e];
    __shared__ float biased[k_sw_max_e];
    __shared__ unsigned long long key[k_sw_max_e];
    __shared__ int32_t sel[64];
    const int64_t t = blockIdx.x;
    const int E = int(c.n_expert);
    const float * lrow = logits + t * c.n_expert;
    for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = lrow[e];
    __syncthreads();
    if (c.softmax) {   // serial, as the reference sums (fp32 exp, double sum)
        if (threadIdx.x == 0) {
            float mx = -INFINITY;
            for (int e = 0; e < E; ++e) mx = fmaxf(mx, score[e]);
            double sum = 0.0;
            for (int e = 0; e < E; ++e) {
                score[e] = expf(score[e] - mx);
                sum += score[e];
            }
            for (int e = 0; e < E; ++e) score[e] = float(score[e] / sum);
        }
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = sigmoid_d(score[e]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) biased[e] = score[e] + (bias.data ? wload(bias, e) : 0.0f);
    __syncthreads();
    if (c.n_group > 1 && c.topk_group < c.n_group && threadIdx.x == 0) {   // group pruning: serial (n_group <= 64)
        const int64_t gs = E / c.n_group;
        float gscore[64];
        bool keep[64];
        for (int64_t g = 0; g < c.n_group; ++g) {
            float a = -INFINITY, b2 = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
                const float v = biased[e];
                if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
            }
            gscore[g] = a + (gs > 1 ? b2 : 0.0f);
            keep[g] = false;
        }
        for (int64_t i = 0; i < c.topk_group; ++i) {   // ties to the lower group
            int64_t best = -1;
            for (int64_t g = 0; g < c.n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = true;
        }
        for (int64_t e = 0; e < E; ++e)
            if (!keep[e / gs]) biased[e] = -INFINITY;
    }
    __syncthreads();
    int nan = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) nan |= biased[e] != biased[e];
    if (__syncthreads_or(nan)) {   // the serial rule, as the reference scans
        if (threadIdx.x == 0) {
            for (int64_t j = 0; j < c.topk; ++j) {
                int best = -1;
                for (int e = 0; e < E; ++e) {
                    bool taken = false;
                    for (int64_t i = 0; i < j; ++i) taken |= sel[i] == e;
                    if (taken) continue;
                    if (best < 0 || biased[e] > biased[best]) best = e;
                }
                sel[j] = best;
            }
        }
    } else {
        int N = 1;
        while (N < E) N <<= 1;
        for (int e = threadIdx.x; e < N; e += blockDim.x)
            key[e] = e < E ? (static_cast<unsigned long long>(order_key(biased[e])) << 32) | (0xFFFFFFFFull - unsigned(e)) : 0ull;
        __syncthreads();
        for (int k = 2; k <= N; k <<= 1)       // bitonic sort, descending
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = threadIdx.x; i < N; i += blockDim.x) {
                    const int ixj = i ^ j;
                    if (ixj > i) {
                        const unsigned long long a = key[i], b = key[ixj];
                        if (((i & k) == 0) ? a < b : a > b) {
                            key[i] = b;
                            key[ixj] = a;
                        }
                    }
                }
                __syncthreads();
            }
        if (threadIdx.x < c.topk) sel[threadIdx.x] = int32_t(0xFFFFFFFFull - (key[threadIdx.x] & 0xFFFFFFFFull));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t * oid = ids + t * c.topk;
        double sum = 0.0;
        for (int64_t j = 0; j < c.topk; ++j) sum += score[sel[j]];
        for (int64_t j = 0; j < c.topk; ++j) {
            float wj = score[sel[j]];
            if (c.renormalize) wj = float(wj / (sum + 1e-20));
            oid[j] = sel[j];
            w[t * c.topk + j] = wj * c.scale;
        }
    }
}

} // namespace

cudaError_t launch_moe_select_sort(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                   cudaStream_t st) {
    if (c.n_expert > k_sw_max_e || c.n_group > 64 || c.topk > 64 || c.topk > c.n_expert) return cudaErrorInvalidValue;
    if (T > 0) return launch_k(k_moe_select_sort, unsigned(T), k_ss_threads, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}

cudaError_t launch_moe_select_warp(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                   cudaStream_t st) {
    if (c.n_expert > k_sw_max_e || c.n_group > 64 || c.topk > 64 || c.topk > c.n_expert) return cudaErrorInvalidValue;
    if (T > 0) return launch_k(k_moe_select_warp, unsigned(T), 32, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}

} // namespace perigee::cuda
