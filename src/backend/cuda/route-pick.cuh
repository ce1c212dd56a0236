// The routing selection's pick rule shared by route-select.cu's kernels and the fused MoE layer kernel
// (moe-layer-decode.cu): the order keys, the serial scan for NaN rows, the epilogue that writes ids and weights, and the
// small selection (cuda_options::moe_select_small) as a block-level device function.
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {
namespace {

// A float's bits mapped to an unsigned key with the same order (for non-NaN values; -0 is mapped as +0 first, so the
// two zeros tie as they compare equal). Every finite value and -inf maps above 0, so 0 means "no candidate".
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned u = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The 64-bit pick key of expert e: descending key = descending biased score, ties to the lower id. Never 0.
__device__ __forceinline__ unsigned long long pick_key(float biased, int e) {
    return (static_cast<unsigned long long>(order_key(biased)) << 32) | (0xFFFFFFFFull - unsigned(e));
}
__device__ __forceinline__ int32_t pick_id(unsigned long long key) { return int32_t(0xFFFFFFFFull - (key & 0xFFFFFFFFull)); }

// The serial rule on one thread, as the reference scans: pick j = the first untaken id unless a later untaken id has a
// strictly greater biased score (a NaN there, or no comparable candidate, keeps the first). For tokens with a NaN score.
__device__ inline void serial_pick(const float * biased, int E, int k, int32_t * sel) {
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= sel[i] == e;
            if (taken) continue;
            if (best < 0 || biased[e] > biased[best]) best = e;
        }
        sel[j] = best;
    }
}

// The epilogue, called by one whole warp (all 32 lanes) once sel [k] (shared) holds the picks in order: ids [k] and the
// weights score / (sum + 1e-20) * scale, the sum over the picks in double in pick order (as the reference sums; every
// lane forms the same sum from shuffles), each lane writing the slots j = lane, lane + 32.
__device__ inline void route_write(const float * score, const int32_t * sel, const droute & c, int64_t t, int32_t * ids,
                                   float * w) {
    const int lane = threadIdx.x & 31, k = int(c.topk);
    const float s0 = lane < k ? score[sel[lane]] : 0.0f, s1 = lane + 32 < k ? score[sel[lane + 32]] : 0.0f;
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, j < 32 ? s0 : s1, j & 31);
    for (int j = lane; j < k; j += 32) {
        float wj = j < 32 ? s0 : s1;
        if (c.renormalize) wj = float(wj / (sum + 1e-20));
        ids[t * c.topk + j] = sel[j];
        w[t * c.topk + j] = wj * c.scale;
    }
}

constexpr int k_small_max_k = 8;
constexpr int k_small_max_e = 256;   // 4 warps x 2 experts per lane

// Whether the small selection takes this route (moe_select_small_supported: the backend's rule).
__host__ __device__ inline bool route_small_supported(const droute & c) {
    return c.softmax == 0 && (c.n_group <= 1 || c.topk_group >= c.n_group) && c.n_expert >= 1 &&
           c.n_expert <= k_small_max_e && c.topk >= 1 && c.topk <= k_small_max_k && c.topk <= c.n_expert;
}

// Expert tid's and tid + 32 W's bias (0 without a bias or past E), for threads of the first W warps (others: 0). A
// weight (never written by a kernel): callers load it before their PDL wait.
template <int W>
__device__ __forceinline__ void select_small_bias(const dweight & bias, const droute & c, float (&bias_mine)[2]) {
    const int tid = int(threadIdx.x);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const int e = tid + 32 * W * p;
        bias_mine[p] = bias.data && tid < 32 * W && e < c.n_expert ? wload(bias, e) : 0.0f;
    }
}

// The small selection of one token's logits lrow [E] (read through L2: written by another block or kernel) into
// ids [t k .. t k + k), w [same] (global or shared). Called by EVERY thread of the block (it has block barriers); the
// first W warps hold the experts (2 per lane: e = tid and tid + 32 W), any further warps only pass the barriers.
template <int W>
__device__ void select_small_block(const float * __restrict__ lrow, const float (&bias_mine)[2], const droute & c, int64_t t,
                                   int32_t * ids, float * w) {
    static_assert(W >= 1 && W <= 8, "cand holds 8 warps' candidates");
    __shared__ float score[k_small_max_e];
    __shared__ float biased[k_small_max_e];
    __shared__ unsigned long long cand[W * k_small_max_k];
    __shared__ int32_t sel[k_small_max_k];
    const int E = int(c.n_expert), k = int(c.topk);
    const int tid = int(threadIdx.x), lane = tid & 31, wid = tid >> 5;
    const bool holds = wid < W;
    unsigned long long key[2] = {0ull, 0ull};
    bool nan = false;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const int e = tid + 32 * W * p;
        if (!holds || e >= E) continue;
        const float sc = sigmoid_d(__ldcg(lrow + e));   // as route_prologue: score, then score + bias
        const float b = sc + bias_mine[p];
        score[e] = sc;
        biased[e] = b;
        if (b != b) nan = true;
        else key[p] = pick_key(b, e);
    }
    if (__syncthreads_or(nan)) {   // the serial rule, as the reference scans
        if (tid == 0) serial_pick(biased, E, k, sel);
    } else {
        if (holds)
            for (int r = 0; r < k; ++r) {   // the warp's r-th best key: value bits first, then ~id among the equal values
                const unsigned long long mine = key[0] > key[1] ? key[0] : key[1];
                const unsigned hi = __reduce_max_sync(0xffffffffu, unsigned(mine >> 32));
                const unsigned lo = __reduce_max_sync(0xffffffffu, unsigned(mine >> 32) == hi ? unsigned(mine) : 0u);
                const unsigned long long top = hi ? (static_cast<unsigned long long>(hi) << 32) | lo : 0ull;
                if (top) {
                    if (key[0] == top) key[0] = 0ull;
                    if (key[1] == top) key[1] = 0ull;
                }
                if (lane == 0) cand[wid * k + r] = top;
            }
        __syncthreads();
        if (wid == 0) {   // place = the number of candidates above this one; 0 keys (a warp short of k experts) never picked
            const int n = W * k;
            for (int i = lane; i < n; i += 32) {
                const unsigned long long mine = cand[i];
                if (!mine) continue;
                int place = 0;
                for (int j = 0; j < n; ++j) place += cand[j] > mine;
                if (place < k) sel[place] = pick_id(mine);
            }
        }
    }
    __syncthreads();
    if (wid == 0) route_write(score, sel, c, t, ids, w);
}

} // namespace
} // namespace perigee::cuda
