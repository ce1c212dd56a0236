// Device helpers shared by the kernels: weight loads by dtype, warp/block reductions, activations.
#pragma once
#include "backend/cuda/cuda-ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace perigee::cuda {

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// Element i of a float-like weight.
__device__ __forceinline__ float wload(const dweight & w, int64_t i) {
    switch (w.type) {
        case wtype::BF16: return bf16_bits_to_f32(static_cast<const uint16_t *>(w.data)[i]);
        case wtype::F16: return __half2float(static_cast<const __half *>(w.data)[i]);
        default: return static_cast<const float *>(w.data)[i];
    }
}
__device__ __forceinline__ float wload_or(const dweight & w, int64_t i, float dflt) {
    return w.data ? wload(w, i) : dflt;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();   // red may still be read by a previous call
    if (lane == 0) red[wid] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.0f;
    return warp_sum(r);
}

__device__ __forceinline__ float sigmoid_d(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_d(float x) { return x * sigmoid_d(x); }
__device__ __forceinline__ float softplus_d(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float situ_d(float a, float b, float beta, float lin_beta) {
    const float gate = beta * tanhf(a / beta) * sigmoid_d(a);
    const float up = lin_beta > 0.0f ? lin_beta * tanhf(b / lin_beta) : b;
    return gate * up;
}

inline unsigned grid_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

} // namespace perigee::cuda
