// Device helpers shared by the kernels: weight loads by dtype, warp/block reductions, activations.
#pragma once
#include "backend/cuda/cuda-ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

namespace perigee::cuda {

// ---- Programmatic Dependent Launch (PDL, sm_90) ----
// A kernel launched by launch_k with PDL on may start while the kernel before it in the stream is still running. Every
// kernel launched through launch_k therefore calls pdl_wait() as its FIRST statement (before any read of memory an
// earlier kernel wrote, before any global write: WAR hazards, and before any early return, so that the grid's
// completion implies its predecessor's completion for the kernel after it). pdl_wait() returns once the preceding grid
// has completed and its writes are visible; without a programmatic dependency (an ordinary launch) it returns at once.
// pdl_trigger() lets the next PDL-launched kernel be scheduled before this grid ends (it launches once every block of
// this grid has triggered or exited); it carries no memory guarantee, so where it sits never affects correctness.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The prologue of every kernel launched by launch_k: wait for the predecessor, then let the successor be scheduled
// (its blocks become resident and park in their own pdl_wait() while this grid runs: this grid's blocks are all
// resident or done by the time the trigger fires, so they are never starved).
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

// Launches `k` on `st` with the PDL attribute (cudaLaunchAttributeProgrammaticStreamSerialization) when pdl_enabled()
// (cuda-ops.h: cuda_options::pdl for the backend's calls) and `st` is not the legacy default stream; else an ordinary
// launch. Only for kernels that start with pdl_enter() / pdl_wait(). Returns the launch's error (also left for
// cudaGetLastError, which the launchers return). Under stream capture a PDL launch becomes a programmatic graph edge.
template <typename... P, typename... A>
cudaError_t launch_k(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A &&... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    if (pdl_enabled() && st != nullptr && st != cudaStreamLegacy) {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, k, std::forward<A>(args)...);
}

// Asks the memory system to bring [p, p + bytes) into L2 (cp.async.bulk.prefetch.L2, sm_90): one instruction, no
// completion to wait for, no data returned, so it may be issued before pdl_wait() for memory no kernel of the step
// writes (weights). p 16-byte aligned, bytes a multiple of 16 (the callers check).
__device__ __forceinline__ void prefetch_l2_bulk(const void * p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// An L2 cache policy for weight streams (read once per step): evict_first marks their lines as the first to go, so that
// a stream of tens of MB does not evict the step's other lines (activations, state, caches); evict_normal is an ordinary
// load's policy. For ld.global...L2::cache_hint (cuda_options::moe_bf16_evict_first, gemv_evict_first).
__device__ __forceinline__ uint64_t l2_stream_policy(bool evict_first) {
    uint64_t pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (evict_first) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
#endif
    return pol;
}

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
// g of one KDA channel (KDA_GATE): a = exp(A_log[h]), xb = f + dt_bias; lb < 0: the lower-bound gate lb * sigmoid(a xb)
// (K3), else -a softplus(xb) (Kimi-Linear). kda.cu's gate kernel and kda-fused-decode.cu.
__device__ __forceinline__ float kda_gate_value_d(float a, float xb, float lb) {
    return lb < 0.0f ? lb * sigmoid_d(a * xb) : -a * softplus_d(xb);
}
__device__ __forceinline__ float situ_d(float a, float b, float beta, float lin_beta) {
    const float gate = beta * tanhf(a / beta) * sigmoid_d(a);
    const float up = lin_beta > 0.0f ? lin_beta * tanhf(b / lin_beta) : b;
    return gate * up;
}

inline unsigned grid_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

} // namespace perigee::cuda
