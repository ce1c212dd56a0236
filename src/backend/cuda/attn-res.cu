// ATTN_RES_MIX (Block Attention Residuals): per row, s_i = (v_i . w) * rsqrt(mean(v_i^2) + eps) with
// w = norm_w * proj_w; alpha = softmax(s); out = sum_i alpha_i v_i (the raw candidates).
#include "backend/cuda/common.cuh"

#include <cooperative_groups.h>

namespace perigee::cuda {

namespace cg = cooperative_groups;

namespace {

// The softmax numerators of the row's n scores s[0..n) into a[0..N) (0 past n) and their sum: exp(s_i - max s) in
// candidate order. Every ATTN_RES_MIX decode kernel forms its weights with this (then a_i / sum per candidate).
template <int N>
__device__ __forceinline__ float softmax_terms(const float * s, int n, float (&a)[N]) {
    float mx = -INFINITY;
    for (int i = 0; i < n; ++i) mx = fmaxf(mx, s[i]);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        a[i] = i < n ? expf(s[i] - mx) : 0.0f;
        sum += a[i];
    }
    return sum;
}

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
    float a[k_attn_res_max];
    const float sum = softmax_terms(s, n, a);
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
    float a[k_attn_res_max];
    const float sum = softmax_terms(s + r * n, n, a);
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < D; c += int64_t(gridDim.x) * blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i)
            if (i < n) acc += a[i] / sum * cands.p[i][r * D + c];
        y[r * D + c] = acc;
    }
}

// Chunked form (cuda_options::attn_res_chunk), for decode-sized R: the split form's score blocks walk a whole row of D
// columns one load per thread per step (K3: 28 dependent steps, ~14 us on 2 blocks per row, Nsight Compute 2026-11-30).
// Here block (chunk q, candidate i, row r) reduces only `chunk` columns (float4 loads, one or two per thread) into a
// partial (sum v^2, sum v w) at part[((r * n + i) * S + q) * 2]; the mix kernel adds a row's S partials per candidate in
// chunk order (a fixed order: deterministic) before its softmax. Candidates and y must be 16-byte aligned, D % 4 == 0.
__global__ void k_attn_res_score_chunk(cand_ptrs cands, int n, int64_t D, int64_t chunk, dweight norm_w, dweight proj_w,
                                       float * __restrict__ part) {
    pdl_enter();
    const int q = blockIdx.x, i = blockIdx.y;
    const int64_t r = blockIdx.z, S = gridDim.x;
    const float * v = cands.p[i] + r * D;
    const int64_t c0 = int64_t(q) * chunk, c1 = c0 + chunk < D ? c0 + chunk : D;
    float ss = 0.0f, dot = 0.0f;
    for (int64_t c = c0 + 4 * int64_t(threadIdx.x); c < c1; c += 4 * int64_t(blockDim.x)) {
        const float4 x = *reinterpret_cast<const float4 *>(v + c);
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        dot += x.x * (wload(norm_w, c) * wload(proj_w, c)) + x.y * (wload(norm_w, c + 1) * wload(proj_w, c + 1)) +
               x.z * (wload(norm_w, c + 2) * wload(proj_w, c + 2)) + x.w * (wload(norm_w, c + 3) * wload(proj_w, c + 3));
    }
    ss = block_sum(ss);
    dot = block_sum(dot);
    if (threadIdx.x == 0) {
        float * o = part + ((r * n + i) * S + q) * 2;
        o[0] = ss;
        o[1] = dot;
    }
}

// grid (column chunks, R): the row's n scores from its partials (thread i < n, chunk order), softmax, then the mix.
__global__ void k_attn_res_apply_chunk(cand_ptrs cands, int n, int64_t D, int S, float eps, const float * __restrict__ part,
                                       float * __restrict__ y) {
    pdl_enter();
    __shared__ float s[k_attn_res_max];
    const int64_t r = blockIdx.y;
    if (threadIdx.x < n) {
        const float * p = part + (r * n + threadIdx.x) * int64_t(S) * 2;
        float ss = 0.0f, dot = 0.0f;
        for (int q = 0; q < S; ++q) {
            ss += p[2 * q];
            dot += p[2 * q + 1];
        }
        s[threadIdx.x] = dot * rsqrtf(ss / float(D) + eps);
    }
    __syncthreads();
    float a[k_attn_res_max];
    const float sum = softmax_terms(s, n, a);
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < D; c += int64_t(gridDim.x) * blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < k_attn_res_max; ++i)
            if (i < n) acc += a[i] / sum * cands.p[i][r * D + c];
        y[r * D + c] = acc;
    }
}

// One-launch form (cuda_options::attn_res_cluster), decode-sized R: grid (S column chunks, R), a thread-block cluster of
// the S chunk blocks per row (S <= 8). Block q reduces its own `chunk` columns per candidate exactly as
// k_attn_res_score_chunk does (the same per-thread float4 partials, the same warp / cross-warp tree as block_sum), into
// its shared memory; after one cluster barrier every block adds the S partials of each candidate from its peers'
// shared memory (distributed shared memory) in chunk order, as k_attn_res_apply_chunk does, forms the softmax the same
// way and mixes its own columns (float4; per element the apply kernel's sum). The same sums in the same order as the
// chunked form at the same chunk, but not bit for bit: the compiler contracts the products into FMAs differently in the
// two kernels (H200, session 5: NMSE ~1e-14 between them; session 4's bitwise claim did not hold for n > 1).
// Candidates are read once from L2 for the scores (again from L1 for the mix); no partials in global
// memory, no second launch. N: candidates unrolled (n <= N); the loads of all candidates are issued together.
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <int N>
__global__ void k_attn_res_mix_cluster(cand_ptrs cands, int n, int64_t D, int64_t chunk, dweight norm_w, dweight proj_w,
                                       float eps, float * __restrict__ y) {
    pdl_enter();
    __shared__ float red[N][2][32];       // per candidate: (sum v^2, sum v w) of each warp
    __shared__ float part[N][2];          // this block's chunk partials, read by the cluster's blocks
    __shared__ float s[N];                // the row's scores
    cg::cluster_group cl = cg::this_cluster();
    const int q = blockIdx.x, S = gridDim.x;   // the cluster spans x: block rank == blockIdx.x
    const int64_t r = blockIdx.y;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    const int64_t c0 = int64_t(q) * chunk, c1 = c0 + chunk < D ? c0 + chunk : D;
    float ss[N], dot[N];
#pragma unroll
    for (int i = 0; i < N; ++i) ss[i] = dot[i] = 0.0f;
    for (int64_t c = c0 + 4 * int64_t(threadIdx.x); c < c1; c += 4 * int64_t(blockDim.x)) {
        const float w0 = wload(norm_w, c) * wload(proj_w, c), w1 = wload(norm_w, c + 1) * wload(proj_w, c + 1);
        const float w2 = wload(norm_w, c + 2) * wload(proj_w, c + 2), w3 = wload(norm_w, c + 3) * wload(proj_w, c + 3);
        float4 x[N];   // all N loads unconditional (slots i >= n re-read candidate 0, an L1 hit): issued together
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = *reinterpret_cast<const float4 *>(cands.p[i < n ? i : 0] + r * D + c);
#pragma unroll
        for (int i = 0; i < N; ++i) {   // sums of slots i >= n are never used
            ss[i] += x[i].x * x[i].x + x[i].y * x[i].y + x[i].z * x[i].z + x[i].w * x[i].w;
            dot[i] += x[i].x * w0 + x[i].y * w1 + x[i].z * w2 + x[i].w * w3;
        }
    }
    // block_sum's tree per (candidate, sum): xor butterfly in each warp, then warp 0..nw-1 values by a warp
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (i < n) {
            const float a = warp_sum(ss[i]), b = warp_sum(dot[i]);
            if (lane == 0) {
                red[i][0][wid] = a;
                red[i][1][wid] = b;
            }
        }
    }
    __syncthreads();
    for (int p = wid; p < 2 * n; p += nw) {
        const float v = warp_sum(lane < nw ? red[p >> 1][p & 1][lane] : 0.0f);
        if (lane == 0) part[p >> 1][p & 1] = v;
    }
    cl.sync();   // every block's part[] written and visible to the cluster
    if (int(threadIdx.x) < n) {
        float a = 0.0f, b = 0.0f;
        for (int k = 0; k < S; ++k) {
            const float * pk = cl.map_shared_rank(&part[0][0], k) + 2 * threadIdx.x;
            a += pk[0];
            b += pk[1];
        }
        s[threadIdx.x] = b * rsqrtf(a / float(D) + eps);
    }
    cluster_arrive_release();   // done reading the peers' part[]; each block waits below before it exits
    __syncthreads();
    float al[N];
    const float sum = softmax_terms(s, n, al);
    for (int64_t c = c0 + 4 * int64_t(threadIdx.x); c < c1; c += 4 * int64_t(blockDim.x)) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 v[N];
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = *reinterpret_cast<const float4 *>(cands.p[i < n ? i : 0] + r * D + c);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (i < n) {
                const float w = al[i] / sum;
                acc.x += w * v[i].x;
                acc.y += w * v[i].y;
                acc.z += w * v[i].z;
                acc.w += w * v[i].w;
            }
        }
        *reinterpret_cast<float4 *>(y + r * D + c) = acc;
    }
    cluster_wait_acquire();   // no block leaves while a peer may still read its part[]
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

int64_t attn_res_chunk_parts(int64_t n, int64_t R, int64_t D, int64_t chunk) {
    return chunk > 0 ? R * n * ((D + chunk - 1) / chunk) * 2 : 0;
}

cudaError_t launch_attn_res_mix_chunked(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, int64_t chunk, float * part, float * y, cudaStream_t st) {
    if (n < 1 || n > k_attn_res_max || chunk < 4 || chunk % 4 != 0 || D % 4 != 0) return cudaErrorInvalidValue;
    if (R <= 0) return cudaGetLastError();
    const int64_t S = (D + chunk - 1) / chunk;
    if (S > 65535 || R > 65535) return cudaErrorInvalidValue;
    const int threads = chunk >= 1024 ? 256 : int((chunk / 4 + 31) / 32 * 32);
    launch_k(k_attn_res_score_chunk, dim3(unsigned(S), unsigned(n), unsigned(R)), threads, 0, st, cands, int(n), D, chunk,
             norm_w, proj_w, part);
    const int64_t chunks = (D + 255) / 256;
    launch_k(k_attn_res_apply_chunk, dim3(unsigned(chunks > 64 ? 64 : chunks), unsigned(R)), 256, 0, st, cands, int(n), D,
             int(S), eps, static_cast<const float *>(part), y);
    return cudaGetLastError();
}

namespace {
constexpr int64_t k_attn_res_cluster_max = 8;   // the portable cluster size

// The columns per block: `chunk` (a positive multiple of 4, else 1024) while that needs at most 8 blocks per row, else
// the least multiple of 4 that does (only then does the sum order differ from the chunked form's at `chunk`).
int64_t attn_res_cluster_chunk(int64_t D, int64_t chunk) {
    if (chunk < 4 || chunk % 4 != 0) chunk = 1024;
    if ((D + chunk - 1) / chunk > k_attn_res_cluster_max)
        chunk = ((D + k_attn_res_cluster_max - 1) / k_attn_res_cluster_max + 3) / 4 * 4;
    return chunk;
}

template <int N>
cudaError_t launch_mix_cluster_n(const cand_ptrs & cands, int n, int64_t R, int64_t D, dweight norm_w, dweight proj_w,
                                 float eps, int64_t chunk, float * y, cudaStream_t st) {
    const int64_t S = (D + chunk - 1) / chunk;
    const int threads = chunk >= 1024 ? 256 : int((chunk / 4 + 31) / 32 * 32);   // k_attn_res_score_chunk's block
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(S), unsigned(R));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = 0;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(S);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (pdl_enabled() && st != nullptr && st != cudaStreamLegacy) {   // as launch_k
        attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[1].val.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs = 2;
    }
    return cudaLaunchKernelEx(&cfg, k_attn_res_mix_cluster<N>, cands, n, D, chunk, norm_w, proj_w, eps, y);
}
} // namespace

cudaError_t launch_attn_res_mix_cluster(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, int64_t chunk, float * y, cudaStream_t st) {
    if (n < 1 || n > k_attn_res_max || D % 4 != 0 || D < 4) return cudaErrorInvalidValue;
    if (R <= 0) return cudaGetLastError();
    if (R > 65535) return cudaErrorInvalidValue;
    chunk = attn_res_cluster_chunk(D, chunk);
    const int nn = int(n);
    if (nn <= 4) return launch_mix_cluster_n<4>(cands, nn, R, D, norm_w, proj_w, eps, chunk, y, st);
    if (nn <= 8) return launch_mix_cluster_n<8>(cands, nn, R, D, norm_w, proj_w, eps, chunk, y, st);
    if (nn <= 16) return launch_mix_cluster_n<16>(cands, nn, R, D, norm_w, proj_w, eps, chunk, y, st);
    return launch_mix_cluster_n<32>(cands, nn, R, D, norm_w, proj_w, eps, chunk, y, st);
}

cudaError_t launch_fill_u32(uint32_t * p, int64_t n, uint32_t v, cudaStream_t st) {
    if (n > 0) {
        const int64_t bl = (n + 255) / 256;
        launch_k(k_fill_u32, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, p, n, v);
    }
    return cudaGetLastError();
}

} // namespace perigee::cuda
