// MOE_ROUTE at prefill (cuda_options::moe_route_gemm_tokens): the router logits [T, E] are one cuBLASLt GEMM (driven by
// cuda-backend.cpp) over x split into three bf16 parts (this file), then moe.cu's per-token selection kernel.
#include "backend/cuda/common.cuh"
#include "backend/cuda/prefill-ops.h"

namespace perigee::cuda {

namespace {

__device__ __forceinline__ uint16_t bf16_rn_bits(float v, float & back) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    back = __bfloat162float(h);
    return *reinterpret_cast<const uint16_t *>(&h);
}

// x = p0 + p1 + p2 + r with |r| <= 2^-24 |x| (each part takes the next ~8 mantissa bits of what is left; the residues
// are exact in fp32). Non-finite x: p0 carries it, p1 = p2 = 0 (an inf/NaN logit as the fp32 GEMV would give).
__global__ void k_f32_to_bf16_split3(const float * __restrict__ x, int64_t n, uint16_t * __restrict__ p0,
                                     uint16_t * __restrict__ p1, uint16_t * __restrict__ p2) {
    pdl_enter();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    float b0, b1, b2;
    p0[i] = bf16_rn_bits(v, b0);
    if (!isfinite(v) || !isfinite(b0)) {
        p1[i] = 0;
        p2[i] = 0;
        return;
    }
    const float r1 = v - b0;
    p1[i] = bf16_rn_bits(r1, b1);
    p2[i] = bf16_rn_bits(r1 - b1, b2);
}

} // namespace

cudaError_t launch_f32_to_bf16_split3(const float * x, int64_t n, uint16_t * p0, uint16_t * p1, uint16_t * p2,
                                      cudaStream_t st) {
    if (n > 0) launch_k(k_f32_to_bf16_split3, grid_for(n, 256), 256, 0, st, x, n, p0, p1, p2);
    return cudaGetLastError();
}

} // namespace perigee::cuda
