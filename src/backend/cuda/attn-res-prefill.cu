// ATTN_RES_MIX at prefill (cuda_options::attn_res_prefill_tokens): the split form with more bytes in flight per thread.
// 1. w = norm_w * proj_w once per node (fp32, the product the other kernels form per element);
// 2. scores: a warp per (row, candidate), float4 loads, ss and v . w by warp sums (no block barrier):
//    s[r, i] = (v . w) * rsqrt(mean(v^2) + eps);
// 3. mix: a block per (row, 1024 columns); thread 0 forms the row's softmax weights in the serial order of attn-res.cu's
//    kernels, then every thread sums its float4 of the n candidates.
// Needs D % 4 == 0 and 16-byte aligned candidate / output pointers (the caller checks).
#include "backend/cuda/common.cuh"
#include "backend/cuda/prefill-ops.h"

namespace perigee::cuda {

namespace {

__global__ void k_ar_weight(dweight norm_w, dweight proj_w, int64_t D, float * __restrict__ w) {
    pdl_enter();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c < D) w[c] = wload(norm_w, c) * wload(proj_w, c);
}

__global__ void __launch_bounds__(256) k_ar_score(cand_ptrs cands, int n, int64_t R, int64_t D, const float * __restrict__ w,
                                                  float eps, float * __restrict__ s) {
    pdl_enter();
    const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= R * n) return;
    const int64_t r = gw / n;
    const int i = int(gw % n);
    const float * v = nullptr;
#pragma unroll
    for (int k = 0; k < k_attn_res_max; ++k)
        if (k == i) v = cands.p[k];   // static indices into the parameter block
    const float4 * v4 = reinterpret_cast<const float4 *>(v + r * D);
    const float4 * w4 = reinterpret_cast<const float4 *>(w);
    const int64_t n4 = D / 4;
    float ss = 0.0f, dot = 0.0f;
#pragma unroll 4
    for (int64_t c = lane; c < n4; c += 32) {
        const float4 x = v4[c], ww = __ldg(w4 + c);
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        dot += x.x * ww.x + x.y * ww.y + x.z * ww.z + x.w * ww.w;
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (lane == 0) s[r * n + i] = dot * rsqrtf(ss / float(D) + eps);
}

__global__ void __launch_bounds__(256) k_ar_mix(cand_ptrs cands, int n, int64_t D, const float * __restrict__ s,
                                                float * __restrict__ y) {
    pdl_enter();
    __shared__ float a[k_attn_res_max];
    const int64_t r = blockIdx.y;
    if (threadIdx.x == 0) {   // attn-res.cu's order: max, exp, sum in candidate order, then a_i / sum
        float mx = -INFINITY;
        for (int i = 0; i < n; ++i) mx = fmaxf(mx, s[r * n + i]);
        float e[k_attn_res_max];
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i) {
            e[i] = i < n ? expf(s[r * n + i] - mx) : 0.0f;
            sum += e[i];
        }
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i)
            if (i < n) a[i] = e[i] / sum;
    }
    __syncthreads();
    const int64_t c4 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c4 >= D / 4) return;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < k_attn_res_max; ++i) {
        if (i < n) {
            const float4 v = reinterpret_cast<const float4 *>(cands.p[i] + r * D)[c4];
            const float ai = a[i];
            acc.x += ai * v.x;
            acc.y += ai * v.y;
            acc.z += ai * v.z;
            acc.w += ai * v.w;
        }
    }
    reinterpret_cast<float4 *>(y + r * D)[c4] = acc;
}

} // namespace

cudaError_t launch_attn_res_mix_prefill(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, float * scratch, float * y, cudaStream_t st) {
    if (n < 1 || n > k_attn_res_max || D % 4 != 0) return cudaErrorInvalidValue;
    if (R == 0 || D == 0) return cudaGetLastError();
    float * w = scratch;
    float * s = scratch + D;
    launch_k(k_ar_weight, grid_for(D, 256), 256, 0, st, norm_w, proj_w, D, w);
    launch_k(k_ar_score, grid_for(R * n * 32, 256), 256, 0, st, cands, int(n), R, D, w, eps, s);
    const int64_t chunks = (D / 4 + 255) / 256;
    launch_k(k_ar_mix, dim3(unsigned(chunks), unsigned(R)), 256, 0, st, cands, int(n), D, s, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
