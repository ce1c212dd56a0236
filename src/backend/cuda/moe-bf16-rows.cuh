// The BF16 expert rows' device pieces shared by the decode pair (moe-bf16-decode.cu) and the fused MoE layer kernel
// (moe-layer-decode.cu): the streaming load, the 8-column dot, a warp's gate and up rows (their loads issued apart from
// their sums, so a caller may issue them early), and the GLU. One definition of the arithmetic, so the two kernels' rows
// are bit for bit the same.
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {
namespace {

// pol: the weight stream's L2 policy (common.cuh l2_stream_policy; cfg thousands digit 1 = evict_first,
// cuda_options::moe_bf16_evict_first).
__device__ __forceinline__ uint4 ld_stream_bf(const uint4 * p, uint64_t pol) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(pol));
    return r;
}

// One unit (8 BF16 columns, column i at bits 16 (i % 2) of word i / 2) dotted with 8 floats: v4's fma chain from 0.
__device__ __forceinline__ float dot8_bf(const uint4 & q, const float4 & x0, const float4 & x1) {
    float a = 0.0f;
    a = fmaf(__uint_as_float(q.x << 16), x0.x, a);
    a = fmaf(__uint_as_float(q.x & 0xFFFF0000u), x0.y, a);
    a = fmaf(__uint_as_float(q.y << 16), x0.z, a);
    a = fmaf(__uint_as_float(q.y & 0xFFFF0000u), x0.w, a);
    a = fmaf(__uint_as_float(q.z << 16), x1.x, a);
    a = fmaf(__uint_as_float(q.z & 0xFFFF0000u), x1.y, a);
    a = fmaf(__uint_as_float(q.w << 16), x1.z, a);
    a = fmaf(__uint_as_float(q.w & 0xFFFF0000u), x1.w, a);
    return a;
}

// How a row's x is read: XM_LDG (__ldg), XM_L2 (__ldcg: never a line an L1 kept from before x's write), XM_PLAIN (an
// ordinary load: x in shared memory).
enum { XM_LDG = 0, XM_L2 = 1, XM_PLAIN = 2 };
template <int XM>
__device__ __forceinline__ float4 ld_x4(const float4 * p) {
    if constexpr (XM == XM_LDG) return __ldg(p);
    else if constexpr (XM == XM_L2) return __ldcg(p);
    else return *p;
}

// A row of nu = 32 NU units: lane's units lane + 32 i, i < NU.
template <int NU>
__device__ __forceinline__ void bf16_row_issue(const void * w, int row, uint64_t pol, int lane, uint4 (&q)[NU]) {
    const uint4 * p = static_cast<const uint4 *>(w) + (row * (32 * NU) + lane);
#pragma unroll
    for (int i = 0; i < NU; ++i) q[i] = ld_stream_bf(p + 32 * i, pol);
}

// The lane's part of row . x (x [256 NU]), units in increasing i, each unit's fma chain added to the sum from 0 (not yet
// warp-summed).
template <int NU, int XM>
__device__ __forceinline__ float bf16_row_lane_dot(const uint4 (&q)[NU], const float * x, int lane) {
    const float4 * xv = reinterpret_cast<const float4 *>(x) + 2 * lane;
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < NU; ++i) a += dot8_bf(q[i], ld_x4<XM>(xv + 64 * i), ld_x4<XM>(xv + 64 * i + 1));
    return a;
}

// A warp's gate and up rows: loads (issue), then sums (finish).
template <int NU>
struct bf16_gate_up_loads {
    uint4 g[NU], u[NU];
};
template <int NU>
__device__ __forceinline__ void bf16_gate_up_issue(const void * gw, const void * uw, int row, uint64_t pol, int lane,
                                                   bf16_gate_up_loads<NU> & q) {
    const uint4 * gp = static_cast<const uint4 *>(gw) + (row * (32 * NU) + lane);
    const uint4 * up = static_cast<const uint4 *>(uw) + (row * (32 * NU) + lane);
#pragma unroll
    for (int i = 0; i < NU; ++i) {   // gate and up interleaved, as the pair always issued them
        q.g[i] = ld_stream_bf(gp + 32 * i, pol);
        q.u[i] = ld_stream_bf(up + 32 * i, pol);
    }
}
template <int NU, int XM>
__device__ __forceinline__ float2 bf16_gate_up_finish(const bf16_gate_up_loads<NU> & q, const float * x, int lane) {
    const float4 * xv = reinterpret_cast<const float4 *>(x) + 2 * lane;
    float ag = 0.0f, au = 0.0f;
#pragma unroll
    for (int i = 0; i < NU; ++i) {
        const float4 x0 = ld_x4<XM>(xv + 64 * i);
        const float4 x1 = ld_x4<XM>(xv + 64 * i + 1);
        ag += dot8_bf(q.g[i], x0, x1);
        au += dot8_bf(q.u[i], x0, x1);
    }
    return make_float2(warp_sum(ag), warp_sum(au));
}

// One warp's row of gate and up over x: (gate[row] . x, up[row] . x), warp-summed, all 2 NU weight loads in flight
// first. X_L2: x read through L2 (__ldcg; the early path, which runs before the PDL wait, must never take a line an L1
// kept from before x's write), else __ldg.
template <int NU, bool X_L2>
__device__ __forceinline__ float2 bf16_gate_up_row(const void * gw, const void * uw, int row, const float * __restrict__ x,
                                                   uint64_t pol, int lane) {
    bf16_gate_up_loads<NU> q;
    bf16_gate_up_issue<NU>(gw, uw, row, pol, lane, q);
    return bf16_gate_up_finish<NU, X_L2 ? XM_L2 : XM_LDG>(q, x, lane);
}

// The GLU node of one row: SiTU (act 1) or SiLU(gate) * up.
__device__ __forceinline__ float bf16_glu(const dexperts_cfg & c, float ag, float au) {
    return c.act == 1 ? situ_d(ag, au, c.situ_beta, c.situ_linear_beta) : silu_d(ag) * au;
}

} // namespace
} // namespace perigee::cuda
