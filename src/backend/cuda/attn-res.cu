// ATTN_RES_MIX (Block Attention Residuals): per row, s_i = (v_i . w) * rsqrt(mean(v_i^2) + eps) with
// w = norm_w * proj_w; alpha = softmax(s); out = sum_i alpha_i v_i (the raw candidates).
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

__global__ void k_attn_res_mix(cand_ptrs cands, int n, int64_t D, dweight norm_w, dweight proj_w, float eps,
                               float * __restrict__ y) {
    pdl_enter();
    __shared__ float s[k_attn_res_max];
    const int64_t r = blockIdx.x;
    for (int i = 0; i < n; ++i) {
        const float * v = cands.p[i] + r * D;
        float ss = 0.0f, dot = 0.0f;
        for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
            const float x = v[c];
            ss += x * x;
            dot += x * (wload(norm_w, c) * wload(proj_w, c));
        }
        ss = block_sum(ss);
        dot = block_sum(dot);
        if (threadIdx.x == 0) s[i] = dot * rsqrtf(ss / float(D) + eps);
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int i = 0; i < n; ++i) mx = fmaxf(mx, s[i]);
    float a[k_attn_res_max];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < k_attn_res_max; ++i) {
        a[i] = i < n ? expf(s[i] - mx) : 0.0f;
        sum += a[i];
    }
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i)
            if (i < n) acc += a[i] / sum * cands.p[i][r * D + c];
        y[r * D + c] = acc;
    }
}

// Split form, scores: block per (candidate i, row r): s[r, i] = (v . w) * rsqrt(mean(v^2) + eps).
__global__ void k_attn_res_score(cand_ptrs cands, int n, int64_t D, dweight norm_w, dweight proj_w, float eps,
                                 float * __restrict__ s) {
    pdl_enter();
    const int i = blockIdx.x;
    const int64_t r = blockIdx.y;
    const float * v = cands.p[i] + r * D;
    float ss = 0.0f, dot = 0.0f;
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
        const float x = v[c];
        ss += x * x;
        dot += x * (wload(norm_w, c) * wload(proj_w, c));
    }
    ss = block_sum(ss);
    dot = block_sum(dot);
    if (threadIdx.x == 0) s[r * n + i] = dot * rsqrtf(ss / float(D) + eps);
}

// Split form, mix: grid (column chunks, rows); every thread forms the softmax of the row's n scores itself.
__global__ void k_attn_res_apply(cand_ptrs cands, int n, int64_t D, const float * __restrict__ s, float * __restrict__ y) {
    pdl_enter();
    const int64_t r = blockIdx.y;
    float mx = -INFINITY;
    for (int i = 0; i < n; ++i) mx = fmaxf(mx, s[r * n + i]);
    float a[k_attn_res_max];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < k_attn_res_max; ++i) {
        a[i] = i < n ? expf(s[r * n + i] - mx) : 0.0f;
        sum += a[i];
    }
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < D; c += int64_t(gridDim.x) * blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i)
            if (i < n) acc += a[i] / sum * cands.p[i][r * D + c];
        y[r * D + c] = acc;
    }
}

__global__ void k_fill_u32(uint32_t * p, int64_t n, uint32_t v) {
    pdl_enter();
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = v;
}

} // namespace

cudaError_t launch_attn_res_mix(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w, dweight proj_w,
                                float eps, float * scratch, float * y, cudaStream_t st) {
    if (n < 1 || n > k_attn_res_max) return cudaErrorInvalidValue;
    if (R > 0 && scratch) {
        launch_k(k_attn_res_score, dim3(unsigned(n), unsigned(R)), 256, 0, st, cands, int(n), D, norm_w, proj_w, eps, scratch);
        const int64_t chunks = (D + 255) / 256;
        launch_k(k_attn_res_apply, dim3(unsigned(chunks > 64 ? 64 : chunks), unsigned(R)), 256, 0, st, cands, int(n), D, scratch, y);
    } else if (R > 0) {
        launch_k(k_attn_res_mix, unsigned(R), 256, 0, st, cands, int(n), D, norm_w, proj_w, eps, y);
    }
    return cudaGetLastError();
}

cudaError_t launch_fill_u32(uint32_t * p, int64_t n, uint32_t v, cudaStream_t st) {
    if (n > 0) {
        const int64_t bl = (n + 255) / 256;
        launch_k(k_fill_u32, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, p, n, v);
    }
    return cudaGetLastError();
}

} // namespace perigee::cuda
