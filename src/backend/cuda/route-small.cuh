// MOE_ROUTE selection device code of route-select.cu's kernels: the helpers every form shares and the small selection
// (cuda_options::moe_select_small). All of it has the serial rule's exact outcome
// (highest biased score, ties to the lower id, -0 == +0, a NaN at the first untaken id wins as the serial scan lets it)
// and bit for bit the block selection's weights (moe.cu k_moe_select).
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

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

// ---- The small selection (cuda_options::moe_select_small: k_moe_select_small, one block per token) ----
// One token, sigmoid scores, no group pruning, E <= 64 W, 1 <= k <= k_small_max_k (route_small_supported). W warps of
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
constexpr int k_small_max_k = 8;
constexpr int k_small_max_e = 256;   // the gate/up blocks' 4 warps x 2 per lane

struct route_small_smem {
    float score[k_small_max_e];
    float biased[k_small_max_e];
    unsigned long long cand[8 * k_small_max_k];   // W k candidates, W <= 8 warps (the down stage's 8)
    int32_t sel[k_small_max_k];
    int32_t ids[k_small_max_k];
    float w[k_small_max_k];
};

// Whether the small selection takes this route (the backend's rule, through moe_select_small_supported).
__host__ __device__ inline bool route_small_supported(const droute & c) {
    return c.softmax == 0 && (c.n_group <= 1 || c.topk_group >= c.n_group) && c.n_expert >= 1 &&
           c.n_expert <= k_small_max_e && c.topk >= 1 && c.topk <= k_small_max_k && c.topk <= c.n_expert;
}

// Expert tid + 32 W p's bias (0 without a bias or past E), p < 2. A weight (never written by a kernel): callers load it
// before their PDL wait.
template <int W>
__device__ __forceinline__ void route_small_bias(const dweight & bias, const droute & c, float (&b)[2]) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const int e = int(threadIdx.x) + 32 * W * p;
        b[p] = bias.data && int(threadIdx.x) < 32 * W && e < c.n_expert ? wload(bias, e) : 0.0f;
    }
}

// Called by EVERY thread of the block (block barriers); the block has at least W warps. lrow [E]: the token's logits
// (complete and visible: read through L2). On return s.sel [k] holds the picks in order and s.score the scores (both
// valid for all threads); with weights, s.ids / s.w hold route_write's outputs too.
template <int W>
__device__ void route_select_small(const float * __restrict__ lrow, const float (&bias_mine)[2], const droute & c,
                                   route_small_smem & s, bool weights) {
    static_assert(W >= 1 && W <= 8, "route_small_smem::cand holds 8 warps' candidates");
    const int E = int(c.n_expert), k = int(c.topk);
    const int tid = int(threadIdx.x), lane = tid & 31, wid = tid >> 5;
    unsigned long long key[2] = {0ull, 0ull};
    bool nan = false;
    if (wid < W) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int e = tid + 32 * W * p;
            if (e >= E) continue;
            const float sc = sigmoid_d(__ldcg(lrow + e));   // as route_prologue: score, then score + bias
            const float b = sc + bias_mine[p];
            s.score[e] = sc;
            s.biased[e] = b;
            if (b != b) nan = true;
            else key[p] = pick_key(b, e);
        }
    }
    if (__syncthreads_or(nan)) {   // the serial rule, as the reference scans
        if (tid == 0) serial_pick(s.biased, E, k, s.sel);
    } else {
        if (wid < W) {
            for (int r = 0; r < k; ++r) {   // the warp's r-th best key
                const unsigned long long mine = key[0] > key[1] ? key[0] : key[1];
                const unsigned hi = __reduce_max_sync(0xffffffffu, unsigned(mine >> 32));
                const unsigned lo = __reduce_max_sync(0xffffffffu, unsigned(mine >> 32) == hi ? unsigned(mine) : 0u);
                const unsigned long long top = hi ? (static_cast<unsigned long long>(hi) << 32) | lo : 0ull;
                if (top) {
                    if (key[0] == top) key[0] = 0ull;
                    if (key[1] == top) key[1] = 0ull;
                }
                if (lane == 0) s.cand[wid * k + r] = top;
            }
        }
        __syncthreads();
        if (wid == 0) {   // place = the number of candidates above this one; 0 keys (a warp short of k experts) never picked
            const int n = W * k;
            for (int i = lane; i < n; i += 32) {
                const unsigned long long mine = s.cand[i];
                if (!mine) continue;
                int place = 0;
                for (int j = 0; j < n; ++j) place += s.cand[j] > mine;
                if (place < k) s.sel[place] = pick_id(mine);
            }
        }
    }
    __syncthreads();
    if (weights) {
        if (wid == 0) route_write(s.score, s.sel, c, 0, s.ids, s.w);
        __syncthreads();
    }
}

} // namespace perigee::cuda
