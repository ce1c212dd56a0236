// One token of the KDA delta rule on a state tile held in registers: the v2 decode layout (kda.cu k_kda_scan_v2) and
// the fused decode tail (kda-fused-decode.cu) both run this one definition, so the fused kernel is the unfused one's
// arithmetic by construction (test-fuse-cuda kda_decode_tail checks the two bit for bit).
//
// Layout: a tile of 32 value columns is 128 threads (4 warps); thread (warp w, lane = rl * 8 + cq) holds rows
// [d0, d0 + R) (d0 = (4 w + rl) R, 16 row groups) x the 4 columns of quad cq in r[R]. Per token, the CPU reference's
// math: S = exp(g) . S (rows); pred = S^T k; u = beta (v - pred); S += k u^T; o = S^T (scale q); the sums over rows
// are per thread in row order, then over the 4 row groups of a warp by two shuffles, then over the 4 warps in warp
// order through shared memory (two block barriers per token: every thread of the block must call this).
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

__device__ __forceinline__ float4 f4_zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
// Sum over the 4 row groups of a warp (lanes cq, cq + 8, cq + 16, cq + 24): every lane gets the same bits.
__device__ __forceinline__ float4 f4_rowgroup_sum(float4 p) {
#pragma unroll
    for (int o = 8; o <= 16; o <<= 1) {
        p.x += __shfl_xor_sync(0xffffffffu, p.x, o);
        p.y += __shfl_xor_sync(0xffffffffu, p.y, o);
        p.z += __shfl_xor_sync(0xffffffffu, p.z, o);
        p.w += __shfl_xor_sync(0xffffffffu, p.w, o);
    }
    return p;
}
// red[0] + red[1] + red[2] + red[3] in warp order.
__device__ __forceinline__ float4 f4_warp_order_sum(const float4 (&red)[4][8], int cq) {
    float4 a = red[0][cq];
#pragma unroll
    for (int w = 1; w < 4; ++w) {
        const float4 b = red[w][cq];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
    }
    return a;
}

// One token: r (the thread's state rows) updated in place; kd = k rows, qd = scale * q rows, ad = exp(g) rows (0 for rows
// past K), bt = beta, vv = v of the quad's columns, col_in = the quad is inside V (else u = 0). Returns the quad's output
// columns (the same bits in every thread of the tile; the caller writes them from one thread per quad).
template <int R>
__device__ __forceinline__ float4 kda_v2_step(float4 (&r)[R], const float (&kd)[R], const float (&qd)[R], const float (&ad)[R],
                                              float bt, float4 vv, bool col_in, float4 (&red_pred)[4][8],
                                              float4 (&red_out)[4][8], int w, int rl, int cq) {
    // decay, then this thread's share of S^T k (its rows in order)
    float4 p = f4_zero();
#pragma unroll
    for (int i = 0; i < R; ++i) {
        r[i].x *= ad[i];
        r[i].y *= ad[i];
        r[i].z *= ad[i];
        r[i].w *= ad[i];
        p.x += r[i].x * kd[i];
        p.y += r[i].y * kd[i];
        p.z += r[i].z * kd[i];
        p.w += r[i].w * kd[i];
    }
    p = f4_rowgroup_sum(p);
    if (rl == 0) red_pred[w][cq] = p;
    __syncthreads();
    const float4 pr = f4_warp_order_sum(red_pred, cq);
    const float4 u = col_in ? make_float4(bt * (vv.x - pr.x), bt * (vv.y - pr.y), bt * (vv.z - pr.z), bt * (vv.w - pr.w))
                            : f4_zero();
    // S += k u^T, then this thread's share of S^T (scale q)
    float4 po = f4_zero();
#pragma unroll
    for (int i = 0; i < R; ++i) {
        r[i].x += kd[i] * u.x;
        r[i].y += kd[i] * u.y;
        r[i].z += kd[i] * u.z;
        r[i].w += kd[i] * u.w;
        po.x += r[i].x * qd[i];
        po.y += r[i].y * qd[i];
        po.z += r[i].z * qd[i];
        po.w += r[i].w * qd[i];
    }
    po = f4_rowgroup_sum(po);
    if (rl == 0) red_out[w][cq] = po;
    __syncthreads();
    // red_pred is rewritten next token only after this barrier (all its reads are above it); red_out only after the
    // next token's first barrier (the reads below come before every thread reaches that one).
    return f4_warp_order_sum(red_out, cq);
}

} // namespace perigee::cuda
