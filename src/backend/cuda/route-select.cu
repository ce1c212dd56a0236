// MOE_ROUTE selection kernels from the logits [T, E] (one block per token), all with the serial rule's exact outcome
// (highest biased score, ties to the lower id, -0 == +0, a NaN at the first untaken id wins as the serial scan lets it)
// and bit for bit the block selection's weights (moe.cu k_moe_select):
//  - warp form (cuda_options::moe_select_warp): one warp, the picks by warp reductions with no block barrier;
//  - sort form (cuda_options::moe_select_sort): a bitonic sort of (score, id) keys in one block;
//  - threshold form (cuda_options::moe_select_radix): the k-th largest key found bit by bit with one counting barrier per
//    bit, then the k picks ranked among themselves.
//  - small form (cuda_options::moe_select_small; sigmoid, no group pruning, E <= 256, top-k <= 8): each warp's k best
//    keys by warp reductions, then the warps' candidates ranked.
// The three share one prologue (route_prologue: scores, bias, group pruning), one serial scan for NaN tokens and one
// epilogue (route_write: ids and the renormalized weights).
#include "backend/cuda/common.cuh"
#include "backend/cuda/prefill-ops.h"
#include "backend/cuda/route-pick.cuh"

#include <climits>

namespace perigee::cuda {

namespace {

constexpr int k_sw_max_e = 1024;

// The route prologue, block-cooperative (every thread of the block calls it; a block of one warp is fine): the row's
// logits -> score [E] (sigmoid, or softmax with fp32 exp and a double sum as the reference sums) and biased [E] (score +
// bias, then the experts of pruned groups set to -inf: group score = sum of its top-2 biased scores, ties to the lower
// group; serial, n_group <= 64). Both arrays in shared memory, complete when it returns (ends with a barrier).
// own_bias: a block of one thread per expert whose caller already loaded expert threadIdx.x's bias (0 without a bias)
// into `bias_mine` (before pdl_enter: a weight, never written by a kernel, so its latency overlaps the predecessor).
__device__ void route_prologue(const float * __restrict__ lrow, const dweight & bias, const droute & c, float * score,
                               float * biased, bool own_bias = false, float bias_mine = 0.0f) {
    const int E = int(c.n_expert);
    for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = __ldcg(lrow + e);   // L2: written by another block/kernel
    if (c.softmax) {   // serial, as the reference sums (fp32 exp, double sum)
        __syncthreads();
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
        __syncthreads();
    } else {   // each thread converts the entries it loaded itself: no barrier needed in between
        for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = sigmoid_d(score[e]);
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        biased[e] = score[e] + (own_bias ? bias_mine : bias.data ? wload(bias, e) : 0.0f);
    __syncthreads();
    if (c.n_group > 1 && c.topk_group < c.n_group) {
        if (threadIdx.x == 0) {
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
    }
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
    route_prologue(logits + t * c.n_expert, bias, c, score, biased);
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
    route_write(score, sel, c, t, ids, w);
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
    route_prologue(logits + t * c.n_expert, bias, c, score, biased);
    int nan = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) nan |= biased[e] != biased[e];
    if (__syncthreads_or(nan)) {   // the serial rule, as the reference scans
        if (threadIdx.x == 0) serial_pick(biased, E, int(c.topk), sel);
    } else {
        int N = 1;
        while (N < E) N <<= 1;
        for (int e = threadIdx.x; e < N; e += blockDim.x)
            key[e] = e < E ? pick_key(biased[e], e) : 0ull;
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
        if (threadIdx.x < c.topk) sel[threadIdx.x] = pick_id(key[threadIdx.x]);
    }
    __syncthreads();
    if (threadIdx.x < 32) route_write(score, sel, c, t, ids, w);
}

// ---- Threshold form (cuda_options::moe_select_radix): one block per token, one thread per expert (block = E rounded up
// to a warp, <= 1024). Each expert's biased score becomes its 32-bit order key (order_key: -0 == +0, -inf above 0, 0 =
// no expert). The k-th largest key K is built from the top bit down, one __syncthreads_count per bit: bit b is kept
// when at least k keys are >= (prefix | bit b). The picks are then every key > K plus the (k - #{key > K}) lowest ids
// among the keys == K (their rank among equal keys from a ballot and the per-warp counts): exactly the serial rule's
// set (ties to the lower id). Each pick's place is its rank among the k picks by (key, ~id), counted by k threads over
// the k candidates. 33 counting barriers and 3 plain ones whatever E, instead of the sort's 55 (K3) / 36 (48B) stages
// each touching all keys (session 4 ncu: k_moe_select_sort 19.8 us for K3, 8.9 us for the 48B). A token with a NaN
// score takes the serial scan, as in the sort form.
// The threshold selection of one token, by a block of one thread per expert (blockDim.x = E rounded up to a warp):
// lrow [E] logits -> ids [t, k], w [t, k]. bias_mine: expert threadIdx.x's bias, loaded by the caller (0 without one).
__device__ void select_radix_token(const float * __restrict__ lrow, const dweight & bias, const droute & c, int64_t t,
                                   float bias_mine, int32_t * __restrict__ ids, float * __restrict__ w) {
    __shared__ float score[k_sw_max_e];
    __shared__ float biased[k_sw_max_e];
    __shared__ unsigned long long cand[64];
    __shared__ int32_t sel[64];
    __shared__ int eq_warp[32];
    __shared__ int n_cand;
    const int E = int(c.n_expert), k = int(c.topk);
    const int e = threadIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    route_prologue(lrow, bias, c, score, biased, true, bias_mine);
    const float v = e < E ? biased[e] : 0.0f;
    if (__syncthreads_or(e < E && v != v)) {   // the serial rule, as the reference scans
        if (threadIdx.x == 0) serial_pick(biased, E, k, sel);
    } else {
        const unsigned key = e < E ? order_key(v) : 0u;
        unsigned thr = 0;   // after the loop: the k-th largest key (>= 1: there are >= k experts, all keys >= 1)
        for (int b = 31; b >= 0; --b) {
            const unsigned probe = thr | (1u << b);
            if (__syncthreads_count(key >= probe) >= k) thr = probe;
        }
        const int need = k - __syncthreads_count(key > thr);   // how many of the keys == thr are picked (>= 1)
        const bool eq = key == thr;
        const unsigned bal = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) eq_warp[wid] = __popc(bal);
        if (threadIdx.x == 0) n_cand = 0;
        __syncthreads();
        bool pick = key > thr;
        if (eq) {   // rank among the equal keys by id: lower lanes of this warp, then the earlier warps
            int before = __popc(bal & ((1u << lane) - 1u));
            for (int q = 0; q < wid; ++q) before += eq_warp[q];
            pick = before < need;
        }
        if (pick) cand[atomicAdd(&n_cand, 1)] = (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFull - unsigned(e));
        __syncthreads();
        if (threadIdx.x < k) {   // place = the number of picks before this one (greater key, or equal and lower id)
            const unsigned long long mine = cand[threadIdx.x];
            int place = 0;
            for (int j = 0; j < k; ++j) place += cand[j] > mine;
            sel[place] = pick_id(mine);
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) route_write(score, sel, c, t, ids, w);
}

__device__ __forceinline__ float bias_of_thread(const dweight & bias, const droute & c) {
    return bias.data && int(threadIdx.x) < c.n_expert ? wload(bias, threadIdx.x) : 0.0f;
}

// grid T, block E rounded up to a warp: token t = blockIdx.x.
__global__ void __launch_bounds__(k_sw_max_e) k_moe_select_radix(const float * __restrict__ logits, dweight bias, droute c,
                                                                 int32_t * __restrict__ ids, float * __restrict__ w) {
    const float bias_mine = bias_of_thread(bias, c);   // a weight (never written by a kernel): before the PDL wait
    pdl_enter();
    select_radix_token(logits + int64_t(blockIdx.x) * c.n_expert, bias, c, blockIdx.x, bias_mine, ids, w);
}

// ---- One launch for T == 1 (cuda_options::moe_route_fused_radix): the router GEMV and the threshold selection. Block =
// E rounded up to a warp (the selection's shape); the block's warps split into groups of S = min(4, warps) warps, each
// group one logit row, each warp a contiguous quarter of the row's 16-byte units (bf16, D % (8 S) == 0) with all its
// loads issued before the FMAs; the S partials summed in shared memory in warp order (deterministic). Grid: enough
// blocks for E rows. The last block to finish (ticket from atomicInc on `counter`, which wraps it back to 0: the
// counter must be 0 before the first launch and is 0 again after every complete launch) selects from the logits in L2.
// Why: the two-launch route pays a second kernel's ramp and a dependent-launch wait per MoE layer (ncu session 4, 48B:
// GEMV 6.4 us on 32 blocks + selection 8.9 us).
constexpr int k_rf_units = 8;   // 16-byte units per lane held in registers at once

__global__ void __launch_bounds__(k_sw_max_e) k_moe_route_radix_fused(const float * __restrict__ x, int64_t D, dweight gate,
                                                                      dweight bias, droute c, float * __restrict__ logits,
                                                                      unsigned * __restrict__ counter,
                                                                      int32_t * __restrict__ ids, float * __restrict__ w) {
    const float bias_mine = bias_of_thread(bias, c);
    pdl_enter();
    __shared__ float part[32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int S = nw < 4 ? nw : 4, rows = nw / S;   // warps per row, rows per block
    const int64_t row = int64_t(blockIdx.x) * rows + wid / S;
    const int ks = wid % S;
    float acc = 0.0f;
    if (wid < rows * S && row < c.n_expert) {
        const int64_t nu = D / 8 / S;   // units of this warp's slice
        const uint4 * wr = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(gate.data) + row * D) + ks * nu;
        const float4 * xr = reinterpret_cast<const float4 *>(x) + 2 * ks * nu;
        for (int64_t u0 = 0; u0 < nu; u0 += 32 * k_rf_units) {
            uint4 q[k_rf_units];
#pragma unroll
            for (int i = 0; i < k_rf_units; ++i) {
                const int64_t u = u0 + lane + 32 * i;
                q[i] = u < nu ? __ldg(wr + u) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int i = 0; i < k_rf_units; ++i) {
                const int64_t u = u0 + lane + 32 * i;
                if (u >= nu) break;
                const float4 x0 = xr[2 * u], x1 = xr[2 * u + 1];
                acc = fmaf(__uint_as_float(q[i].x << 16), x0.x, acc);
                acc = fmaf(__uint_as_float(q[i].x & 0xFFFF0000u), x0.y, acc);
                acc = fmaf(__uint_as_float(q[i].y << 16), x0.z, acc);
                acc = fmaf(__uint_as_float(q[i].y & 0xFFFF0000u), x0.w, acc);
                acc = fmaf(__uint_as_float(q[i].z << 16), x1.x, acc);
                acc = fmaf(__uint_as_float(q[i].z & 0xFFFF0000u), x1.y, acc);
                acc = fmaf(__uint_as_float(q[i].w << 16), x1.z, acc);
                acc = fmaf(__uint_as_float(q[i].w & 0xFFFF0000u), x1.w, acc);
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) part[wid] = acc;
    __syncthreads();
    if (ks == 0 && lane == 0 && wid < rows * S && row < c.n_expert) {
        float y = part[wid];
        for (int i = 1; i < S; ++i) y += part[wid + i];
        logits[row] = y;
    }
    __threadfence();   // this block's logits are visible device-wide before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicInc(counter, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    select_radix_token(logits, bias, c, 0, bias_mine, ids, w);
}

// ---- The small selection (cuda_options::moe_select_small: k_moe_select_small, one block per token; its body is
// route-pick.cuh's select_small_block, shared with the fused MoE layer kernel) ----
// One token, sigmoid scores, no group pruning, E <= 64 W, 1 <= k <= k_small_max_k (route_small_supported). The W warps of
// the block hold 2 experts per lane (e = tid and tid + 32 W); each warp takes its k best keys by k rounds of two warp
// reductions (value bits, then ~id among the equal values: the 64-bit pick key); warp 0 ranks the W k candidates by
// counting. The top k of all experts are among the warps' top k, so the picks are the threshold / block selection's
// picks in the same order. A token with a NaN biased score takes the serial scan. Why: k reduction rounds per warp and
// one ranking pass instead of the threshold form's 33 counting barriers over the whole block (the 48B selection launch:
// 4.2-6.6 us exposed per MoE layer, session 11 call B timeline).
// Written first (session 18, call A) to run INSIDE the BF16 decode pair's blocks (every gate/up block of a routed slot
// after its wait, every down block before it; the selection launch gone): correct (every output bit for bit the
// selection launch + pair) but the 48B step went 2.29 -> 2.59 ms: per MoE layer the router 2.5 -> 5.7 us (the gate/up's
// early shared-slot blocks, which had run during the selection launch, now overlapped the router), gate/up 21.9 -> 27.2
// and down 12.6 -> 19.3 us (the selection paid once per block on each of ~4 / 3 waves). Removed; the standalone kernel
// stayed.
// grid T, block 32 W (W <= 8): token t = blockIdx.x. logits [T, E] -> ids [T, k], w [T, k].
template <int W>
__global__ void __launch_bounds__(32 * W) k_moe_select_small(const float * __restrict__ logits, dweight bias, droute c,
                                                             int32_t * __restrict__ ids, float * __restrict__ w) {
    float bias_mine[2];   // experts tid and tid + 32 W: a weight (never written by a kernel), before the PDL wait
    select_small_bias<W>(bias, c, bias_mine);
    pdl_enter();
    select_small_block<W>(logits + int64_t(blockIdx.x) * c.n_expert, bias_mine, c, blockIdx.x, ids, w);
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

cudaError_t launch_moe_route_radix_fused(const float * x, int64_t D, dweight gate, dweight bias, const droute & c,
                                         float * logits, unsigned * counter, int32_t * ids, float * w, cudaStream_t st) {
    if (c.n_expert < 1 || c.n_expert > k_sw_max_e || c.n_group > 64 || c.topk < 1 || c.topk > 64 || c.topk > c.n_expert)
        return cudaErrorInvalidValue;
    const int threads = int((c.n_expert + 31) / 32 * 32), nw = threads / 32, S = nw < 4 ? nw : 4, rows = nw / S;
    if (gate.type != wtype::BF16 || D <= 0 || D % (8 * S) != 0) return cudaErrorInvalidValue;
    const int64_t blocks = (c.n_expert + rows - 1) / rows;
    return launch_k(k_moe_route_radix_fused, unsigned(blocks), unsigned(threads), 0, st, x, D, gate, bias, c, logits, counter,
                    ids, w);
}

cudaError_t launch_moe_select_radix(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                    cudaStream_t st) {
    if (c.n_expert < 1 || c.n_expert > k_sw_max_e || c.n_group > 64 || c.topk < 1 || c.topk > 64 || c.topk > c.n_expert)
        return cudaErrorInvalidValue;
    const unsigned threads = unsigned((c.n_expert + 31) / 32 * 32);
    if (T > 0) return launch_k(k_moe_select_radix, unsigned(T), threads, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}

bool moe_select_small_supported(int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool softmax) {
    return route_small_supported(droute{E, k, n_group, topk_group, true, 1.0f, softmax ? 1 : 0});
}

template <int W>
cudaError_t launch_select_small(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                cudaStream_t st) {
    if (!route_small_supported(c)) return cudaErrorInvalidValue;
    if (T > 0) return launch_k(k_moe_select_small<W>, unsigned(T), 32 * W, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}
cudaError_t launch_moe_select_small4(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                     cudaStream_t st) {
    return launch_select_small<4>(logits, T, bias, c, ids, w, st);
}
cudaError_t launch_moe_select_small8(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                     cudaStream_t st) {
    return launch_select_small<8>(logits, T, bias, c, ids, w, st);
}

} // namespace perigee::cuda
