// LINEAR (bandwidth GEMV for small T; cuBLASLt is driven from cuda-backend.cpp for larger T) and GET_ROWS.
#include "backend/cuda/common.cuh"
#include "backend/cuda/fuse-ops.h"
#include "backend/cuda/mma-sync.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace perigee::cuda {

namespace {

// 8 consecutive weights of row `row` at column c (c % 8 == 0, 16-byte aligned for 16-bit types).
template <wtype WT> struct wvec;
template <> struct wvec<wtype::BF16> {
    static constexpr int n = 8;
    __device__ static void load(const void * base, int64_t i, float * o) {
        const uint4 u = *reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(base) + i);
        const uint32_t p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[2 * j] = __uint_as_float(p[j] << 16);
            o[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        }
    }
};
template <> struct wvec<wtype::F16> {
    static constexpr int n = 8;
    __device__ static void load(const void * base, int64_t i, float * o) {
        const uint4 u = *reinterpret_cast<const uint4 *>(static_cast<const __half *>(base) + i);
        const __half2 * h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(h[j]);
            o[2 * j] = f.x;
            o[2 * j + 1] = f.y;
        }
    }
};
template <> struct wvec<wtype::F32> {
    static constexpr int n = 4;
    __device__ static void load(const void * base, int64_t i, float * o) {
        const float4 f = *reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i);
        o[0] = f.x; o[1] = f.y; o[2] = f.z; o[3] = f.w;
    }
};

constexpr int k_gemv_warps = 8;

// One warp per output row, TT tokens per launch (TT <= 8). Vector path when in % VN == 0.
template <wtype WT, int TT>
__device__ __forceinline__ void gemv_row(const float * __restrict__ x, int64_t in, dweight W, int64_t row,
                                         float * __restrict__ y, int64_t ldy) {
    constexpr int VN = wvec<WT>::n;
    const int lane = threadIdx.x & 31;
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
    const int64_t base = row * in;
    if (in % VN == 0) {
        for (int64_t c = int64_t(lane) * VN; c < in; c += 32 * VN) {
            float wv[VN];
            wvec<WT>::load(W.data, base + c, wv);
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                const float * xt = x + t * in + c;
#pragma unroll
                for (int j = 0; j < VN; j += 4) {
                    const float4 xv = *reinterpret_cast<const float4 *>(xt + j);
                    acc[t] += wv[j] * xv.x + wv[j + 1] * xv.y + wv[j + 2] * xv.z + wv[j + 3] * xv.w;
                }
            }
        }
    } else {
        for (int64_t c = lane; c < in; c += 32) {
            const float wv = wload(W, base + c);
#pragma unroll
            for (int t = 0; t < TT; ++t) acc[t] += wv * x[t * in + c];
        }
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) y[t * ldy + row] = s;
    }
}

template <wtype WT, int TT>
__global__ void __launch_bounds__(k_gemv_warps * 32) k_linear_gemv(const float * __restrict__ x, int64_t in, dweight W,
                                                                   int64_t out, float * __restrict__ y, int64_t ldy) {
    pdl_enter();
    const int64_t row = int64_t(blockIdx.x) * k_gemv_warps + (threadIdx.x >> 5);
    if (row >= out) return;
    gemv_row<WT, TT>(x, in, W, row, y, ldy);
}

// Several LINEARs over the same x in one launch: block b belongs to the segment s with start[s] <= b < start[s + 1].
struct gemv_segs {
    const void * w[k_gemv_group_max];
    float * y[k_gemv_group_max];
    int64_t out[k_gemv_group_max];
    unsigned start[k_gemv_group_max + 1];
    int n;
};

template <wtype WT, int TT>
__global__ void __launch_bounds__(k_gemv_warps * 32) k_linear_gemv_multi(const float * __restrict__ x, int64_t in, gemv_segs g) {
    pdl_enter();
    int s = 0;
    while (s + 1 < g.n && blockIdx.x >= g.start[s + 1]) ++s;
    const int64_t row = int64_t(blockIdx.x - g.start[s]) * k_gemv_warps + (threadIdx.x >> 5);
    if (row >= g.out[s]) return;
    gemv_row<WT, TT>(x, in, dweight{g.w[s], WT}, row, g.y[s], g.out[s]);
}

template <wtype WT>
void gemv_multi_chunk(const float * x, int64_t tt, int64_t in, const gemv_segs & g, cudaStream_t st) {
    const unsigned blocks = g.start[g.n];
    switch (tt) {
        case 1: launch_k(k_linear_gemv_multi<WT, 1>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 2: launch_k(k_linear_gemv_multi<WT, 2>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 3: launch_k(k_linear_gemv_multi<WT, 3>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 4: launch_k(k_linear_gemv_multi<WT, 4>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 5: launch_k(k_linear_gemv_multi<WT, 5>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 6: launch_k(k_linear_gemv_multi<WT, 6>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        case 7: launch_k(k_linear_gemv_multi<WT, 7>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
        default: launch_k(k_linear_gemv_multi<WT, 8>, blocks, k_gemv_warps * 32, 0, st, x, in, g); break;
    }
}

template <wtype WT, int TT>
void gemv_launch(const float * x, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st) {
    launch_k(k_linear_gemv<WT, TT>, grid_for(out, k_gemv_warps), k_gemv_warps * 32, 0, st, x, in, W, out, y, out);
}

template <wtype WT>
void gemv_chunk(const float * x, int64_t tt, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st) {
    switch (tt) {
        case 1: gemv_launch<WT, 1>(x, in, W, out, y, st); break;
        case 2: gemv_launch<WT, 2>(x, in, W, out, y, st); break;
        case 3: gemv_launch<WT, 3>(x, in, W, out, y, st); break;
        case 4: gemv_launch<WT, 4>(x, in, W, out, y, st); break;
        case 5: gemv_launch<WT, 5>(x, in, W, out, y, st); break;
        case 6: gemv_launch<WT, 6>(x, in, W, out, y, st); break;
        case 7: gemv_launch<WT, 7>(x, in, W, out, y, st); break;
        default: gemv_launch<WT, 8>(x, in, W, out, y, st); break;
    }
}

// ---- fused GEMV (fuse-plan.h): optional RMS_NORM prologue, residual-add epilogue ----
struct fused_segs {
    const void * w[k_gemv_group_max];
    float * y[k_gemv_group_max];
    const float * res0[k_gemv_group_max];
    const float * res1[k_gemv_group_max];
    float * z0[k_gemv_group_max];
    float * z1[k_gemv_group_max];
    float * sig[k_gemv_group_max];
    int64_t out[k_gemv_group_max];
    int64_t roff[k_gemv_group_max + 1];   // rows before segment s (the norm-output writers are numbered by row)
    unsigned start[k_gemv_group_max + 1];
    int n;
};

// One warp per output row over all segments. NORM: the warp also sums x^2 of each token's row while it streams the
// row for the dot product (it reads the whole row anyway), so inv = rsqrt(mean(x^2) + eps) needs no extra pass:
// y = inv * sum_c W[r, c] * (x[c] * nw[c]). Then the warp writes its share of the norm's output (yn) when given.
template <wtype WT, int TT, bool NORM>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_fused(const float * __restrict__ x, int64_t in, fused_segs g, const float * __restrict__ nw, float eps,
                        float * __restrict__ yn) {
    pdl_enter();
    int s = 0;
    while (s + 1 < g.n && blockIdx.x >= g.start[s + 1]) ++s;
    const int64_t row = int64_t(blockIdx.x - g.start[s]) * k_gemv_warps + (threadIdx.x >> 5);
    if (row >= g.out[s]) return;
    constexpr int VN = wvec<WT>::n;
    const int lane = threadIdx.x & 31;
    const bool has_w = nw != nullptr;
    float acc[TT], ss[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] = 0.0f, ss[t] = 0.0f;
    const void * W = g.w[s];
    const int64_t base = row * in;
    if (in % VN == 0) {
        for (int64_t c = int64_t(lane) * VN; c < in; c += 32 * VN) {
            float wv[VN];
            wvec<WT>::load(W, base + c, wv);
            float nv[VN];
            if (NORM) {
#pragma unroll
                for (int j = 0; j < VN; j += 4) {
                    const float4 f = has_w ? *reinterpret_cast<const float4 *>(nw + c + j) : make_float4(1.f, 1.f, 1.f, 1.f);
                    nv[j] = f.x, nv[j + 1] = f.y, nv[j + 2] = f.z, nv[j + 3] = f.w;
                }
            }
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                const float * xt = x + t * in + c;
#pragma unroll
                for (int j = 0; j < VN; j += 4) {
                    const float4 xv = *reinterpret_cast<const float4 *>(xt + j);
                    if (NORM) {
                        ss[t] += xv.x * xv.x + xv.y * xv.y + xv.z * xv.z + xv.w * xv.w;
                        acc[t] += wv[j] * (xv.x * nv[j]) + wv[j + 1] * (xv.y * nv[j + 1]) + wv[j + 2] * (xv.z * nv[j + 2]) +
                                  wv[j + 3] * (xv.w * nv[j + 3]);
                    } else {
                        acc[t] += wv[j] * xv.x + wv[j + 1] * xv.y + wv[j + 2] * xv.z + wv[j + 3] * xv.w;
                    }
                }
            }
        }
    } else {
        const dweight Wd{W, WT};
        for (int64_t c = lane; c < in; c += 32) {
            const float wv = wload(Wd, base + c);
            const float nc = NORM && has_w ? nw[c] : 1.0f;
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                const float xv = x[t * in + c];
                if (NORM) ss[t] += xv * xv;
                acc[t] += wv * (NORM ? xv * nc : xv);
            }
        }
    }
    const int64_t ldy = g.out[s];
    float inv[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        float v = warp_sum(acc[t]);
        inv[t] = 1.0f;
        if (NORM) {
            inv[t] = rsqrtf(warp_sum(ss[t]) / float(in) + eps);
            v *= inv[t];
        }
        if (lane == 0) {
            const int64_t i = t * ldy + row;
            g.y[s][i] = v;
            if (g.sig[s]) g.sig[s][i] = sigmoid_d(v);
            if (g.z0[s]) {
                v = v + g.res0[s][i];
                g.z0[s][i] = v;
                if (g.z1[s]) g.z1[s][i] = v + g.res1[s][i];
            }
        }
    }
    if (NORM && yn) {   // the norm's output: warp v of all segments' rows takes columns v*32+lane, v*32+lane + 32*rows, ...
        const int64_t wv = g.roff[s] + row, stride = g.roff[g.n] * 32;
#pragma unroll
        for (int t = 0; t < TT; ++t)
            for (int64_t c = wv * 32 + lane; c < in; c += stride) yn[t * in + c] = x[t * in + c] * inv[t] * (has_w ? nw[c] : 1.0f);
    }
}

// The NORM prologue staged once per block (fuse_norm_linear, round 2): the block reduces x^2 over each token's row,
// writes x' = (x * inv) * nw (the norm kernel's order) into shared memory [TT, in], and its warps then run the plain
// GEMV inner loop over x' from shared memory: per weight the same arithmetic as the unfused GEMV (the round-1 kernel
// summed x^2 and multiplied by nw in every warp, per output row: compute-bound on 7168-wide rows). The grid is at most
// the resident blocks (persistent: block b takes virtual blocks b, b + gridDim, ...), so the staging is paid once per
// resident block, not per 8 rows. TT * in * 4 <= k_gemv_norm_stage_max (no dynamic-smem opt-in; the planner keeps the
// norm launch otherwise). The norm's output yn is the staged x', written by all blocks (slices of TT * in).
static_assert(k_gemv_norm_stage_max + 8 * (k_gemv_warps + 1) * 4 <= 48 * 1024,
              "the staged x' and the static reduction scratch must fit 48 KiB (no dynamic-smem opt-in)");
// Loads in flight per thread in the prologue: k_stage_batch float4s of x per round, 4 x k_stage_batch floats of nw (one
// round for a 2304-wide row, two for 7168). Why (session 8): the first form's loops waited for each load before the next
// (9 dependent loads of nw per thread for the 48B's 2304-wide rows, from HBM: the weights leave L2 every step).
constexpr int k_stage_batch = 4;
// Before the PDL wait of a staged kernel (nw is a weight: never written by a kernel of the step): the norm weights into
// L2, one bulk request by thread 0, so the prologue's loads of nw hit L2.
__device__ __forceinline__ void stage_norm_prefetch(const float * nw, int64_t in) {
    if (nw && threadIdx.x == 0 && (in * 4) % 16 == 0 && (reinterpret_cast<uintptr_t>(nw) & 15u) == 0)
        prefetch_l2_bulk(nw, uint32_t(in * 4));
}

// The staged-norm prologue (k_linear_gemv_norm_staged, the v2 and v3 staged kernels): the block reduces x^2 over each
// token's row, writes x' = (x * inv) * nw (the norm kernel's order) into xs [TT, in] (shared memory), then its slice of
// the norm's output yn (blocks b, b + gridDim, ... of NT elements). Every thread of the block calls it; xs is complete
// and the block synchronized when it returns.
template <int TT>
__device__ __forceinline__ void stage_norm(const float * __restrict__ x, int64_t in, const float * __restrict__ nw, float eps,
                                           float * xs, float * __restrict__ yn) {
    __shared__ float red[TT][k_gemv_warps];
    __shared__ float inv_s[TT];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int NT = k_gemv_warps * 32;
    const bool vec4 = in % 4 == 0;
    {
        float ss[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) ss[t] = 0.0f;
        if (vec4) {
            const int64_t n4 = in / 4;
#pragma unroll
            for (int t = 0; t < TT; ++t)
                for (int64_t c0 = tid; c0 < n4; c0 += k_stage_batch * NT) {   // the batch's loads first, then the sums
                    float4 v[k_stage_batch];
#pragma unroll
                    for (int u = 0; u < k_stage_batch; ++u) {
                        const int64_t c = c0 + int64_t(u) * NT;
                        v[u] = c < n4 ? reinterpret_cast<const float4 *>(x + t * in)[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    }
#pragma unroll
                    for (int u = 0; u < k_stage_batch; ++u) {
                        const int64_t c = c0 + int64_t(u) * NT;
                        if (c < n4) {
                            reinterpret_cast<float4 *>(xs + t * in)[c] = v[u];
                            ss[t] += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
                        }
                    }
                }
        } else {
#pragma unroll
            for (int t = 0; t < TT; ++t)
                for (int64_t c = tid; c < in; c += NT) {
                    const float v = x[t * in + c];
                    xs[t * in + c] = v;
                    ss[t] += v * v;
                }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            const float v = warp_sum(ss[t]);
            if (lane == 0) red[t][warp] = v;
        }
    }
    __syncthreads();
    if (tid < TT) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < k_gemv_warps; ++w) s += red[tid][w];
        inv_s[tid] = rsqrtf(s / float(in) + eps);
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        const float inv = inv_s[t];
        for (int64_t c0 = tid; c0 < in; c0 += 4 * k_stage_batch * NT) {   // the batch's weight loads first
            float wv[4 * k_stage_batch];
#pragma unroll
            for (int u = 0; u < 4 * k_stage_batch; ++u) {
                const int64_t c = c0 + int64_t(u) * NT;
                wv[u] = nw && c < in ? nw[c] : 1.0f;
            }
#pragma unroll
            for (int u = 0; u < 4 * k_stage_batch; ++u) {
                const int64_t c = c0 + int64_t(u) * NT;
                if (c < in) {
                    float v = xs[t * in + c] * inv;
                    if (nw) v *= wv[u];
                    xs[t * in + c] = v;
                }
            }
        }
    }
    __syncthreads();
    if (yn)
        for (int64_t i = int64_t(blockIdx.x) * NT + tid; i < int64_t(TT) * in; i += int64_t(gridDim.x) * NT) yn[i] = xs[i];
}

template <wtype WT, int TT>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_norm_staged(const float * __restrict__ x, int64_t in, fused_segs g, const float * __restrict__ nw,
                              float eps, float * __restrict__ yn) {
    stage_norm_prefetch(nw, in);
    pdl_enter();
    extern __shared__ float4 stage4[];
    float * xs = reinterpret_cast<float *>(stage4);   // [TT, in]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int NT = k_gemv_warps * 32;
    if (blockIdx.x < g.start[g.n]) {   // the first virtual block's weight rows -> L2 while the block stages x'
        int s = 0;
        while (s + 1 < g.n && blockIdx.x >= g.start[s + 1]) ++s;
        const int64_t r0 = int64_t(blockIdx.x - g.start[s]) * k_gemv_warps;
        const int64_t rows = g.out[s] - r0 < k_gemv_warps ? g.out[s] - r0 : k_gemv_warps;
        constexpr int64_t esz = WT == wtype::F32 ? 4 : 2;
        const char * p0 = static_cast<const char *>(g.w[s]) + r0 * in * esz;
        for (int64_t off = int64_t(tid) * 128; off < rows * in * esz; off += int64_t(NT) * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p0 + off));
    }
    stage_norm<TT>(x, in, nw, eps, xs, yn);

    constexpr int VN = wvec<WT>::n;
    // 16-bit weights: a lane's 8 x' values are two float4s 32 bytes apart from the next lane's; lanes 4-7 of each
    // quarter warp read their second half first, so each LDS.128 phase touches 32 distinct banks.
    const int sw = VN == 8 ? ((lane >> 2) & 1) * 4 : 0;
    const unsigned total = g.start[g.n];
    for (unsigned vb = blockIdx.x; vb < total; vb += gridDim.x) {
        int s = 0;
        while (s + 1 < g.n && vb >= g.start[s + 1]) ++s;
        const int64_t row = int64_t(vb - g.start[s]) * k_gemv_warps + warp;
        if (row >= g.out[s]) continue;
        float acc[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
        const void * W = g.w[s];
        const int64_t base = row * in;
        if (in % VN == 0) {
            for (int64_t c = int64_t(lane) * VN; c < in; c += 32 * VN) {
                float wv[VN];
                wvec<WT>::load(W, base + c, wv);
#pragma unroll
                for (int t = 0; t < TT; ++t) {
                    const float * xt = xs + t * in + c;
                    if (VN == 8) {
                        const float4 p = *reinterpret_cast<const float4 *>(xt + sw);
                        const float4 q = *reinterpret_cast<const float4 *>(xt + (sw ^ 4));
                        const float4 a = sw ? q : p, b = sw ? p : q;
                        acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w;
                        acc[t] += wv[VN - 4] * b.x + wv[VN - 3] * b.y + wv[VN - 2] * b.z + wv[VN - 1] * b.w;
                    } else {
#pragma unroll
                        for (int j = 0; j < VN; j += 4) {
                            const float4 xv = *reinterpret_cast<const float4 *>(xt + j);
                            acc[t] += wv[j] * xv.x + wv[j + 1] * xv.y + wv[j + 2] * xv.z + wv[j + 3] * xv.w;
                        }
                    }
                }
            }
        } else {
            const dweight Wd{W, WT};
            for (int64_t c = lane; c < in; c += 32) {
                const float wv = wload(Wd, base + c);
#pragma unroll
                for (int t = 0; t < TT; ++t) acc[t] += wv * xs[t * in + c];
            }
        }
        const int64_t ldy = g.out[s];
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            float v = warp_sum(acc[t]);
            if (lane == 0) {
                const int64_t i = t * ldy + row;
                g.y[s][i] = v;
                if (g.sig[s]) g.sig[s][i] = sigmoid_d(v);
                if (g.z0[s]) {
                    v = v + g.res0[s][i];
                    g.z0[s][i] = v;
                    if (g.z1[s]) g.z1[s][i] = v + g.res1[s][i];
                }
            }
        }
    }
}

int device_sms() {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, sms);
}

// Resident blocks per SM of kernel K at th threads and smem bytes of dynamic shared memory (>= 1). With shared memory
// (a staged prologue) the largest carve-out is asked for first (a hint: once per kernel, never inside a stream capture)
// and the occupancy is queried on every call (smem follows the row width); without, once per kernel. Shared by the
// launchers of the staged, v2 and tensor-core GEMVs.
template <auto K>
int gemv_occupancy(int th, size_t smem, cudaStream_t st) {
    int occ = 0;
    if (smem > 0) {
        static bool carveout_set = false;
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        cudaStreamIsCapturing(st, &cap);
        if (!carveout_set && cap == cudaStreamCaptureStatusNone) {
            cudaFuncSetAttribute(K, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
            carveout_set = true;
        }
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, K, th, smem);
    } else {
        static int occ_plain = 0;
        if (occ_plain == 0) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_plain, K, th, 0);
        occ = occ_plain;
    }
    return std::max(1, occ);
}

template <wtype WT, int TT>
void staged_launch(const float * x, int64_t in, const fused_segs & g, const float * nw, float eps, float * yn,
                   cudaStream_t st) {
    constexpr auto kern = k_linear_gemv_norm_staged<WT, TT>;
    const size_t smem = size_t(TT) * size_t(in) * 4;
    const int th = k_gemv_warps * 32;
    const unsigned total = g.start[g.n];
    const unsigned resident = unsigned(device_sms() * gemv_occupancy<kern>(th, smem, st));
    launch_k(kern, std::min(total, resident), th, smem, st, x, in, g, nw, eps, yn);
}

template <wtype WT>
void staged_chunk(const float * x, int64_t tt, int64_t in, const fused_segs & g, const float * nw, float eps, float * yn,
                  cudaStream_t st) {
    switch (tt) {
        case 1: staged_launch<WT, 1>(x, in, g, nw, eps, yn, st); break;
        case 2: staged_launch<WT, 2>(x, in, g, nw, eps, yn, st); break;
        case 3: staged_launch<WT, 3>(x, in, g, nw, eps, yn, st); break;
        case 4: staged_launch<WT, 4>(x, in, g, nw, eps, yn, st); break;
        case 5: staged_launch<WT, 5>(x, in, g, nw, eps, yn, st); break;
        case 6: staged_launch<WT, 6>(x, in, g, nw, eps, yn, st); break;
        case 7: staged_launch<WT, 7>(x, in, g, nw, eps, yn, st); break;
        default: staged_launch<WT, 8>(x, in, g, nw, eps, yn, st); break;
    }
}

template <wtype WT, bool NORM>
void fused_chunk(const float * x, int64_t tt, int64_t in, const fused_segs & g, const float * nw, float eps, float * yn,
                 cudaStream_t st) {
    const unsigned blocks = g.start[g.n];
    const int th = k_gemv_warps * 32;
    switch (tt) {
        case 1: launch_k(k_linear_gemv_fused<WT, 1, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 2: launch_k(k_linear_gemv_fused<WT, 2, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 3: launch_k(k_linear_gemv_fused<WT, 3, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 4: launch_k(k_linear_gemv_fused<WT, 4, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 5: launch_k(k_linear_gemv_fused<WT, 5, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 6: launch_k(k_linear_gemv_fused<WT, 6, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        case 7: launch_k(k_linear_gemv_fused<WT, 7, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
        default: launch_k(k_linear_gemv_fused<WT, 8, NORM>, blocks, th, 0, st, x, in, g, nw, eps, yn); break;
    }
}

// ---- GEMV v2 (cuda_options::gemv_unroll = U > 0) ----
// The first kernels above give each lane ONE 16-byte weight load in flight per loop iteration (a 7168-wide bf16 row is
// 28 dependent round trips per warp) and one warp per row, so a grid of few rows (4096 rows = 512 blocks) leaves the
// SMs short of bytes in flight: ~60% of the copy bandwidth on K3's dense LINEARs (bench/RESULTS.md round 3). v2:
//  - each lane issues U independent 16-byte weight loads (ld.global.nc, no L1 allocation: the weights are streamed once,
//    L1 keeps x) before any conversion or math;
//  - R rows per warp (1 for 1-2 tokens, 2 for 3-5, 4 for 6-8; at most 2 in the staged-norm kernel): each x chunk a lane
//    loads serves R rows (at T = 8 the x reads, TT times the weight bytes, otherwise load the L1 harder than the weights);
//  - S warps of a block share each row (split-K over whole 32 x VN-element chunks) when the tiles would not spread evenly
//    over the SMs (launch-time choice, gemv2_split); the S partials are summed in shared memory in warp order.
// The per-lane accumulation order is the first kernels' (4 products summed, then added), then the warp's butterfly sum;
// with S > 1 the slices' sums are added in slice order. Deterministic for a given (unroll, split, rows per warp).
constexpr int gemv2_rows_per_warp(int tt, bool staged) {
    return tt >= 6 ? (staged ? 2 : 4) : tt >= 3 ? 2 : 1;
}

static_assert(k_gemv_norm_stage_max + (k_gemv_warps * gemv2_rows_per_warp(8, true) * 8 + 8 * k_gemv_warps + 8) * 4 <= 48 * 1024,
              "v2 staged: x' and the static scratch (partials, x^2 sums, inv) must fit 48 KiB (no dynamic-smem opt-in)");

template <wtype WT>
__device__ __forceinline__ uint4 wraw_load(const void * base, int64_t i, uint64_t pol) {
    const char * p = static_cast<const char *>(base) + i * (WT == wtype::F32 ? 4 : 2);
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(pol));
    return r;
}
template <wtype WT>
__device__ __forceinline__ void wraw_cvt(const uint4 & u, float * o) {
    if constexpr (WT == wtype::BF16) {
        const uint32_t p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[2 * j] = __uint_as_float(p[j] << 16);
            o[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        }
    } else if constexpr (WT == wtype::F16) {
        const __half2 * h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(h[j]);
            o[2 * j] = f.x;
            o[2 * j + 1] = f.y;
        }
    } else {
        o[0] = __uint_as_float(u.x), o[1] = __uint_as_float(u.y), o[2] = __uint_as_float(u.z), o[3] = __uint_as_float(u.w);
    }
}

// y (and the epilogue outputs) of segment s, row `row`, token t.
__device__ __forceinline__ void gemv_store(const fused_segs & g, int s, int64_t row, int t, float v) {
    const int64_t i = t * g.out[s] + row;
    g.y[s][i] = v;
    if (g.sig[s]) g.sig[s][i] = sigmoid_d(v);
    if (g.z0[s]) {
        v = v + g.res0[s][i];
        g.z0[s][i] = v;
        if (g.z1[s]) g.z1[s][i] = v + g.res1[s][i];
    }
}

// One launch over all segments of g (plain GEMV: one segment, no epilogue). Tiles of (8 / split) * R rows; block b takes
// tiles b, b + gridDim, ... (the plain grid has one block per tile; the staged grid is at most the resident blocks).
// STAGED: x' = RMSNorm(x) * nw staged once per block in dynamic shared memory [TT, in] as k_linear_gemv_norm_staged
// does (same arithmetic), yn written from it; needs in % 4 == 0.
template <wtype WT, int TT, int U, bool STAGED>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_v2(const float * __restrict__ x, int64_t in, fused_segs g, int split, const float * __restrict__ nw,
                     float eps, float * __restrict__ yn, bool ef) {
    constexpr int R = gemv2_rows_per_warp(TT, STAGED);
    const uint64_t pol = l2_stream_policy(ef);   // the weights' L2 policy (gemv_cfg::evict_first)
    if constexpr (STAGED) stage_norm_prefetch(nw, in);   // a weight: before the wait
    pdl_enter();
    constexpr int UC = U / R >= 1 ? U / R : 1;   // chunks per iteration (R * UC loads in flight per lane)
    constexpr int VN = wvec<WT>::n;
    constexpr int CH = 32 * VN;                  // elements of one warp-wide chunk (512 bytes)
    __shared__ float part[k_gemv_warps][R * TT];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int S = split, groups = k_gemv_warps / S, gi = warp / S, ks = warp % S;
    const int64_t rows_tile = int64_t(groups) * R;
    const unsigned total = g.start[g.n];
    const bool vec = in % VN == 0;
    const int64_t nch = (in + CH - 1) / CH;
    const float * xs = x;
    if constexpr (STAGED) {
        // the first loads of this warp's first tile -> L2 while the block stages x' (R * UC * 512 bytes per warp: ~10 MB
        // over a full grid, well inside the L2; the whole first tile would not be)
        if (vec && blockIdx.x < total) {
            int s = 0;
            while (s + 1 < g.n && blockIdx.x >= g.start[s + 1]) ++s;
            const int64_t r0 = int64_t(blockIdx.x - g.start[s]) * rows_tile + int64_t(gi) * R;
            const int64_t kb = nch * ks / S, ke = nch * (ks + 1) / S;
            const char * W = static_cast<const char *>(g.w[s]);
            constexpr int64_t esz = WT == wtype::F32 ? 4 : 2;
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int u = 0; u < UC; ++u) {
                    const int64_t c = (kb + u) * CH + int64_t(lane) * VN;
                    if (r0 + r < g.out[s] && kb + u < ke && c < in)
                        asm volatile("prefetch.global.L2 [%0];" ::"l"(W + ((r0 + r) * in + c) * esz));
                }
        }
        extern __shared__ float4 stage4[];
        float * st = reinterpret_cast<float *>(stage4);   // [TT, in]
        stage_norm<TT>(x, in, nw, eps, st, yn);
        xs = st;
    }
    // 16-bit weights: a lane's 8 x values are two float4s; lanes 4-7 of each quarter warp read their second half first,
    // so each 16-byte shared-memory phase touches 32 distinct banks (staged x'); the sums keep the fixed order.
    const int sw = VN == 8 ? ((lane >> 2) & 1) * 4 : 0;
    for (unsigned vb = blockIdx.x; vb < total; vb += gridDim.x) {
        int s = 0;
        while (s + 1 < g.n && vb >= g.start[s + 1]) ++s;
        const int64_t out = g.out[s];
        const int64_t tile0 = int64_t(vb - g.start[s]) * rows_tile;
        const int64_t r0 = tile0 + int64_t(gi) * R;
        const void * W = g.w[s];
        int64_t rb[R];   // row bases, rows past the end clamped to the last row (read, never written)
#pragma unroll
        for (int r = 0; r < R; ++r) rb[r] = (r0 + r < out ? r0 + r : out - 1) * in;
        float acc[R][TT];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
        if (vec) {
            const int64_t kb = nch * ks / S, ke = nch * (ks + 1) / S;
            for (int64_t k = kb; k < ke; k += UC) {
                uint4 raw[R][UC];
#pragma unroll
                for (int u = 0; u < UC; ++u) {
                    const int64_t c = (k + u) * CH + int64_t(lane) * VN;
                    const bool ok = k + u < ke && c < in;
#pragma unroll
                    for (int r = 0; r < R; ++r) raw[r][u] = ok ? wraw_load<WT>(W, rb[r] + c, pol) : make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int u = 0; u < UC; ++u) {
                    const int64_t c = (k + u) * CH + int64_t(lane) * VN;
                    if (k + u < ke && c < in) {
                        float wv[R][VN];
#pragma unroll
                        for (int r = 0; r < R; ++r) wraw_cvt<WT>(raw[r][u], wv[r]);
#pragma unroll
                        for (int t = 0; t < TT; ++t) {
                            const float * xt = xs + t * in + c;
                            if constexpr (VN == 8) {
                                const float4 p = *reinterpret_cast<const float4 *>(xt + sw);
                                const float4 q = *reinterpret_cast<const float4 *>(xt + (sw ^ 4));
                                const float4 a = sw ? q : p, b = sw ? p : q;
#pragma unroll
                                for (int r = 0; r < R; ++r) {
                                    acc[r][t] += wv[r][0] * a.x + wv[r][1] * a.y + wv[r][2] * a.z + wv[r][3] * a.w;
                                    acc[r][t] += wv[r][4] * b.x + wv[r][5] * b.y + wv[r][6] * b.z + wv[r][7] * b.w;
                                }
                            } else {
                                const float4 a = *reinterpret_cast<const float4 *>(xt);
#pragma unroll
                                for (int r = 0; r < R; ++r)
                                    acc[r][t] += wv[r][0] * a.x + wv[r][1] * a.y + wv[r][2] * a.z + wv[r][3] * a.w;
                            }
                        }
                    }
                }
            }
        } else {   // in % VN != 0: element by element over this warp's slice of the row
            const dweight Wd{W, WT};
            const int64_t eb = in * ks / S, ee = in * (ks + 1) / S;
            for (int64_t c = eb + lane; c < ee; c += 32) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float wv = wload(Wd, rb[r] + c);
#pragma unroll
                    for (int t = 0; t < TT; ++t) acc[r][t] += wv * xs[t * in + c];
                }
            }
        }
        if (S == 1) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int t = 0; t < TT; ++t) {
                    const float v = warp_sum(acc[r][t]);
                    if (lane == r * TT + t && r0 + r < out) gemv_store(g, s, r0 + r, t, v);
                }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int t = 0; t < TT; ++t) {
                    const float v = warp_sum(acc[r][t]);
                    if (lane == r * TT + t) part[warp][r * TT + t] = v;
                }
            __syncthreads();
            if (tid < groups * R * TT) {
                const int g2 = tid / (R * TT), rt = tid % (R * TT);
                const int64_t row = tile0 + int64_t(g2) * R + rt / TT;
                float v = 0.0f;
                for (int q = 0; q < S; ++q) v += part[g2 * S + q][rt];
                if (row < out) gemv_store(g, s, row, rt % TT, v);
            }
            __syncthreads();   // part is reused by the next tile
        }
    }
}

// Warps per row: the smallest S in 1, 2, 4, 8 whose tiles spread evenly (>= 90%) over the machine, each warp keeping at
// least one chunk of the row; else the S with the best balance. Balance: when every tile is resident at once (tiles <=
// `slots`, the resident blocks of the kernel), tiles per SM over its ceiling; else (several waves of the plain grid, or
// a persistent staged grid) tiles per slot over its ceiling: the last wave's share. >= 8 per SM or per slot counts as
// balanced. (ncu, k3-layers-4 B=1: the first kernels' 896-block grids of 7168 rows ran at 57-65% of the DRAM peak with
// one wave of ~6.8 blocks per SM; the 112-block router grid at 18%.)
int gemv2_split(const int64_t * out, int n, int64_t in, int rows_per_warp, int vn, int sms, int64_t slots) {
    const int64_t nch = (in + 32 * vn - 1) / (32 * vn);
    int best = 1;
    double best_eff = -1.0;
    for (int S = 1; S <= k_gemv_warps; S *= 2) {
        if (S > 1 && nch < S) break;
        const int64_t rows_tile = int64_t(k_gemv_warps / S) * rows_per_warp;
        int64_t tiles = 0;
        for (int i = 0; i < n; ++i) tiles += (out[i] + rows_tile - 1) / rows_tile;
        const double per = tiles > slots ? double(tiles) / double(slots) : double(tiles) / sms;
        const double eff = per >= 8.0 ? 1.0 : per / std::ceil(per);
        if (eff >= 0.9) return S;
        if (eff > best_eff + 1e-9) best_eff = eff, best = S;
    }
    return best;
}

template <wtype WT, int TT, int U, bool STAGED>
cudaError_t v2_launch(const float * x, int64_t in, fused_segs g, const gemv_cfg & cfg, const float * nw, float eps,
                      float * yn, cudaStream_t st) {
    constexpr int R = gemv2_rows_per_warp(TT, STAGED);
    constexpr auto kern = k_linear_gemv_v2<WT, TT, U, STAGED>;
    const int th = k_gemv_warps * 32;
    const int sms = device_sms();
    const size_t smem = STAGED ? size_t(TT) * size_t(in) * 4 : 0;
    const int64_t slots = int64_t(sms) * gemv_occupancy<kern>(th, smem, st);
    const int S = cfg.split > 0 ? cfg.split : gemv2_split(g.out, g.n, in, R, wvec<WT>::n, sms, slots);
    const int64_t rows_tile = int64_t(k_gemv_warps / S) * R;
    g.start[0] = 0;
    for (int s = 0; s < g.n; ++s) g.start[s + 1] = g.start[s] + unsigned((g.out[s] + rows_tile - 1) / rows_tile);
    const unsigned total = g.start[g.n];
    const unsigned grid = STAGED ? unsigned(std::min<int64_t>(total, slots)) : total;
    launch_k(kern, grid, th, smem, st, x, in, g, S, nw, eps, yn, cfg.evict_first);
    return cudaGetLastError();
}

template <wtype WT, int TT, bool STAGED>
cudaError_t v2_unroll(const float * x, int64_t in, const fused_segs & g, const gemv_cfg & cfg, const float * nw, float eps,
                      float * yn, cudaStream_t st) {
    switch (cfg.unroll) {
        case 1: return v2_launch<WT, TT, 1, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 2: return v2_launch<WT, TT, 2, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 4: return v2_launch<WT, TT, 4, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        default: return v2_launch<WT, TT, 8, STAGED>(x, in, g, cfg, nw, eps, yn, st);
    }
}

template <wtype WT, bool STAGED>
cudaError_t v2_tokens(const float * x, int64_t tt, int64_t in, const fused_segs & g, const gemv_cfg & cfg,
                      const float * nw, float eps, float * yn, cudaStream_t st) {
    switch (tt) {
        case 1: return v2_unroll<WT, 1, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 2: return v2_unroll<WT, 2, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 3: return v2_unroll<WT, 3, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 4: return v2_unroll<WT, 4, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 5: return v2_unroll<WT, 5, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 6: return v2_unroll<WT, 6, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 7: return v2_unroll<WT, 7, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        default: return v2_unroll<WT, 8, STAGED>(x, in, g, cfg, nw, eps, yn, st);
    }
}

// One chunk of <= 8 tokens through the v2 kernels (g.start is set here from the chosen tile size).
cudaError_t v2_chunk(const float * x, int64_t tt, int64_t in, wtype wt, const fused_segs & g, const gemv_cfg & cfg,
                     bool staged, const float * nw, float eps, float * yn, cudaStream_t st) {
    switch (wt) {
        case wtype::BF16:
            return staged ? v2_tokens<wtype::BF16, true>(x, tt, in, g, cfg, nw, eps, yn, st)
                          : v2_tokens<wtype::BF16, false>(x, tt, in, g, cfg, nw, eps, yn, st);
        case wtype::F16:
            return staged ? v2_tokens<wtype::F16, true>(x, tt, in, g, cfg, nw, eps, yn, st)
                          : v2_tokens<wtype::F16, false>(x, tt, in, g, cfg, nw, eps, yn, st);
        default:
            return staged ? v2_tokens<wtype::F32, true>(x, tt, in, g, cfg, nw, eps, yn, st)
                          : v2_tokens<wtype::F32, false>(x, tt, in, g, cfg, nw, eps, yn, st);
    }
}

// ---- GEMV v3 (gemv_cfg::v3; chunks of one token, 16-bit weights) ----
// What held the 48B geometry's 2304-wide rows (bench/session4-h200-2026-11-30-ncu-48b-step.txt, 1.6-2.8 TB/s): a bf16
// row of 2304 columns is 9 warp-wide chunks, so v1 pays 9 dependent round trips per row (one 16-byte load in flight per
// lane) and v2 with U = 4 pays 3 rounds of which the last carries 1 chunk (a whole latency for 1/9 of the bytes); the
// staged-norm kernels issue no weight load until x' is staged (two block barriers), and every row of a persistent
// block starts with an empty pipe. v3:
//  - a warp's slice of a row (S warps per row; slice = ceil(chunks / S)) is read in rounds of U chunks per lane, U chosen
//    so that the rounds are whole (v3_u_for: 9 for a 2304-wide row, 16 for 4096, 8 for 4096 split in 2);
//  - the loads of the NEXT round (the next row of this warp when this row is done) are issued into each register as
//    soon as its chunk is summed, so every lane keeps U loads in flight across rows, with no drain between them;
//  - the first round's loads are issued before the staged-norm prologue (before the PDL wait too with v3 == 2);
//  - a persistent grid: at most the resident blocks; block b takes tiles b, b + gridDim, ... (8 / S rows per tile).
// Per lane the accumulation order is v2's (the chunk's 8 products as two sums of 4, added in chunk order), then the
// butterfly sum; with S > 1 the slices' sums are added in slice order: deterministic for a given (U, S).
template <wtype WT, int U, bool STAGED, bool EARLY>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_v3(const float * __restrict__ x, int64_t in, fused_segs g, int split, const float * __restrict__ nw,
                     float eps, float * __restrict__ yn, bool ef) {
    constexpr int VN = wvec<WT>::n;
    const uint64_t pol = l2_stream_policy(ef);   // the weights' L2 policy (gemv_cfg::evict_first)
    constexpr int CH = 32 * VN;
    __shared__ float part[k_gemv_warps];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int S = split, groups = k_gemv_warps / S, gi = warp / S, ks = warp % S;
    const unsigned total = g.start[g.n];
    const int64_t nch = (in + CH - 1) / CH;
    const int64_t kb = nch * ks / S, ke = nch * (ks + 1) / S;
    const int rounds = int(((nch + S - 1) / S + U - 1) / U);   // the same for every warp of the block
    // tile vb -> (segment, row of this warp, whether the row exists)
    auto locate = [&](unsigned vb, int & s, int64_t & row, bool & ok) {
        s = 0;
        while (s + 1 < g.n && vb >= g.start[s + 1]) ++s;
        row = int64_t(vb - g.start[s]) * groups + gi;
        ok = vb < total && row < g.out[s];
        if (!ok) row = 0;
    };
    auto issue = [&](uint4 & r, int s, int64_t row, bool ok, int rd, int u) {
        const int64_t k = kb + int64_t(rd) * U + u, c = k * CH + int64_t(lane) * VN;
        r = ok && k < ke && c < in ? wraw_load<WT>(g.w[s], row * in + c, pol) : make_uint4(0u, 0u, 0u, 0u);
    };
    unsigned vb = blockIdx.x;
    int rd = 0, s = 0;
    int64_t row = 0;
    bool ok = false;
    uint4 raw[U];
    locate(vb, s, row, ok);
    if constexpr (EARLY) {   // weights only: never written by the kernel before
#pragma unroll
        for (int u = 0; u < U; ++u) issue(raw[u], s, row, ok, 0, u);
    }
    if constexpr (STAGED) stage_norm_prefetch(nw, in);   // a weight: before the wait
    pdl_enter();
    if constexpr (!EARLY) {
#pragma unroll
        for (int u = 0; u < U; ++u) issue(raw[u], s, row, ok, 0, u);
    }
    const float * xs = x;
    if constexpr (STAGED) {
        extern __shared__ float4 stage4[];
        float * st = reinterpret_cast<float *>(stage4);   // [1, in]
        stage_norm<1>(x, in, nw, eps, st, yn);
        xs = st;
    }
    const int sw = VN == 8 ? ((lane >> 2) & 1) * 4 : 0;
    float acc = 0.0f;
    while (vb < total) {
        unsigned nvb = vb;
        int nrd = rd + 1, ns = s;
        int64_t nrow = row;
        bool nok = ok;
        if (nrd == rounds) {
            nrd = 0, nvb = vb + gridDim.x;
            locate(nvb, ns, nrow, nok);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t k = kb + int64_t(rd) * U + u, c = k * CH + int64_t(lane) * VN;
            if (ok && k < ke && c < in) {
                float wv[VN];
                wraw_cvt<WT>(raw[u], wv);
                const float * xt = xs + c;
                if constexpr (VN == 8) {
                    const float4 p = *reinterpret_cast<const float4 *>(xt + sw);
                    const float4 q = *reinterpret_cast<const float4 *>(xt + (sw ^ 4));
                    const float4 a = sw ? q : p, b = sw ? p : q;
                    acc += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w;
                    acc += wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
                } else {
                    const float4 a = *reinterpret_cast<const float4 *>(xt);
                    acc += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w;
                }
            }
            issue(raw[u], ns, nrow, nok, nrd, u);   // this register's next load, while the others are still in flight
        }
        if (nrd == 0) {   // the row (slice) is done
            const float v = warp_sum(acc);
            acc = 0.0f;
            if (S == 1) {
                if (lane == 0 && ok) gemv_store(g, s, row, 0, v);
            } else {
                if (lane == 0) part[warp] = v;
                __syncthreads();
                if (tid < groups) {
                    const int64_t r2 = int64_t(vb - g.start[s]) * groups + tid;
                    float sum = 0.0f;
                    for (int q = 0; q < S; ++q) sum += part[tid * S + q];
                    if (r2 < g.out[s]) gemv_store(g, s, r2, 0, sum);
                }
                __syncthreads();   // part is reused by the next tile
            }
        }
        vb = nvb, rd = nrd, s = ns, row = nrow, ok = nok;
    }
}

// The U of a slice of `per` chunks per lane: one round when per <= 16 (the smallest instantiated U >= per), else
// ceil(per / 16) rounds of equal size.
constexpr int k_v3_us[] = {1, 2, 3, 4, 5, 8, 9, 16};
int v3_u_for(int64_t per) {
    const int64_t rounds = (per + 15) / 16;
    const int64_t want = (per + rounds - 1) / rounds;
    for (int u : k_v3_us)
        if (u >= want) return u;
    return 16;
}
bool v3_u_valid(int u) {
    for (int v : k_v3_us)
        if (v == u) return true;
    return false;
}

template <wtype WT, int U, bool STAGED, bool EARLY>
struct v3_kern {
    static constexpr auto fn = k_linear_gemv_v3<WT, U, STAGED, EARLY>;
    // resident blocks per SM (gemv_occupancy: the carve-out hint for the staged forms)
    static int occupancy(size_t smem, cudaStream_t st) { return gemv_occupancy<fn>(k_gemv_warps * 32, smem, st); }
};

template <wtype WT, bool STAGED, bool EARLY>
int v3_occupancy(int u, size_t smem, cudaStream_t st) {
    switch (u) {
        case 1: return v3_kern<WT, 1, STAGED, EARLY>::occupancy(smem, st);
        case 2: return v3_kern<WT, 2, STAGED, EARLY>::occupancy(smem, st);
        case 3: return v3_kern<WT, 3, STAGED, EARLY>::occupancy(smem, st);
        case 4: return v3_kern<WT, 4, STAGED, EARLY>::occupancy(smem, st);
        case 5: return v3_kern<WT, 5, STAGED, EARLY>::occupancy(smem, st);
        case 8: return v3_kern<WT, 8, STAGED, EARLY>::occupancy(smem, st);
        case 9: return v3_kern<WT, 9, STAGED, EARLY>::occupancy(smem, st);
        default: return v3_kern<WT, 16, STAGED, EARLY>::occupancy(smem, st);
    }
}

template <wtype WT, bool STAGED, bool EARLY>
cudaError_t v3_run(const float * x, int64_t in, fused_segs g, const gemv_cfg & cfg, const float * nw, float eps, float * yn,
                   cudaStream_t st) {
    const int sms = device_sms();
    const size_t smem = STAGED ? size_t(in) * 4 : 0;
    const int64_t nch = (in + 32 * wvec<WT>::n - 1) / (32 * wvec<WT>::n);
    // S: forced, or the smallest of 1, 2, 4, 8 whose tiles spread evenly (>= 90%) over the SMs, else the best spread.
    // Per SM, not per resident slot (v2's rule): a block streams its tiles back to back with the pipe kept full, so what
    // must balance is the bytes each SM pulls (a resident block's U loads per lane could pull ~3x its share of the copy
    // rate); >= 4 tiles per SM counts as balanced. 48B: S = 1 for the 2304-wide groups (>= 256 tiles) and KDA f_b; S = 2
    // for the 2304-row LINEARs (o_proj, the downs: 576 tiles); S = 4 for the 256-row router.
    int S = cfg.split;
    if (S == 0) {
        double best_eff = -1.0;
        for (int c = 1; c <= k_gemv_warps; c *= 2) {
            if (c > 1 && nch < c) break;
            const int64_t rows_tile = k_gemv_warps / c;
            int64_t tiles = 0;
            for (int i = 0; i < g.n; ++i) tiles += (g.out[i] + rows_tile - 1) / rows_tile;
            const double per = double(tiles) / sms;
            const double eff = per >= 4.0 ? 1.0 : per / std::ceil(per);
            if (eff > best_eff + 1e-9) best_eff = eff, S = c;
            if (eff >= 0.9) break;
        }
    }
    const int U = cfg.v3_unroll > 0 ? cfg.v3_unroll : v3_u_for((nch + S - 1) / S);
    const int occ = v3_occupancy<WT, STAGED, EARLY>(U, smem, st);
    const int64_t rows_tile = k_gemv_warps / S;
    g.start[0] = 0;
    for (int s = 0; s < g.n; ++s) g.start[s + 1] = g.start[s] + unsigned((g.out[s] + rows_tile - 1) / rows_tile);
    const unsigned grid = unsigned(std::min<int64_t>(g.start[g.n], int64_t(sms) * occ));
    const int th = k_gemv_warps * 32;
    const bool ef = cfg.evict_first;
    switch (U) {
        case 1: return launch_k(v3_kern<WT, 1, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 2: return launch_k(v3_kern<WT, 2, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 3: return launch_k(v3_kern<WT, 3, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 4: return launch_k(v3_kern<WT, 4, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 5: return launch_k(v3_kern<WT, 5, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 8: return launch_k(v3_kern<WT, 8, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        case 9: return launch_k(v3_kern<WT, 9, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
        default: return launch_k(v3_kern<WT, 16, STAGED, EARLY>::fn, grid, th, smem, st, x, in, g, S, nw, eps, yn, ef);
    }
}

// Whether a chunk of tt tokens goes to v3: one token, 16-bit weights, whole 8-element vectors (16-byte loads).
bool v3_applies(const gemv_cfg & cfg, int64_t tt, int64_t in, wtype wt) {
    return cfg.v3 > 0 && tt == 1 && wt != wtype::F32 && in % 8 == 0;
}

cudaError_t v3_chunk(const float * x, int64_t in, wtype wt, const fused_segs & g, const gemv_cfg & cfg, bool staged,
                     const float * nw, float eps, float * yn, cudaStream_t st) {
    const bool early = cfg.v3 == 2;
    if (wt == wtype::BF16) {
        if (staged) return early ? v3_run<wtype::BF16, true, true>(x, in, g, cfg, nw, eps, yn, st)
                                 : v3_run<wtype::BF16, true, false>(x, in, g, cfg, nw, eps, yn, st);
        return early ? v3_run<wtype::BF16, false, true>(x, in, g, cfg, nw, eps, yn, st)
                     : v3_run<wtype::BF16, false, false>(x, in, g, cfg, nw, eps, yn, st);
    }
    if (staged) return early ? v3_run<wtype::F16, true, true>(x, in, g, cfg, nw, eps, yn, st)
                             : v3_run<wtype::F16, true, false>(x, in, g, cfg, nw, eps, yn, st);
    return early ? v3_run<wtype::F16, false, true>(x, in, g, cfg, nw, eps, yn, st)
                 : v3_run<wtype::F16, false, false>(x, in, g, cfg, nw, eps, yn, st);
}

// ---- GEMV on the tensor cores (gemv_cfg::mma; chunks of mma..8 tokens, BF16 weights, in % 8 == 0) ----
// Why: past 2 tokens the kernels above are bound by the FP32 pipe and L1, not by the weights: every weight element takes
// TT FMAs and every lane re-reads TT x 32 bytes of x per 16 bytes of weights (x / weight bytes 4:1 at T = 8 with 4 rows
// per warp). Session 16 calls G/H: k3-layers-4 B=8 7.25 ms/step on them, 4.86 ms with those LINEARs on cuBLASLt; B=4
// 4.40 vs 3.63 ms. Here a warp computes 32 rows x 8 tokens with mma.sync m16n8k16 (two 16-row tiles):
//  - weights straight from global, no shared memory: in each 32-column step lane (g, q) (g = lane / 4, q = lane % 4)
//    loads 16 bytes of rows g, g + 8, g + 16, g + 24 at columns 8q .. 8q + 7 (the 4 lanes of a row read 64 contiguous
//    bytes). A dot product does not depend on the order of k, so the step's two m16n8k16 products take physical columns
//    {8q, 8q+1 | 8q+2, 8q+3} and {8q+4, 8q+5 | 8q+6, 8q+7} where the fragment layout says {2q, 2q+1 | 2q+8, 2q+9};
//    the B fragment (token g, read by the same lane from the same 8 columns of x) is permuted the same way;
//  - x = p0 + p1 + p2 with each part bf16 (p0 = bf16(x), p1 = bf16(x - p0), p2 = bf16(x - p0 - p1): 24 significant
//    bits, the prefill router's split3): bf16 x bf16 products are exact in fp32, so the sums are fp32 sums of exact
//    products, as in the FP32 kernels (the order differs: tensor-core accumulation). x / weight bytes 1:2;
//  - tokens past TT are zero fragments (the mma always computes 8 columns; they are not stored);
//  - work items are (32-row group, K slice) per WARP, KS slices per group: a group of 32 rows is one warp's work, so a
//    LINEAR of few rows (K3's 128-row f_a, a 896-row router) would otherwise stream its weights through a handful of
//    SMs (session 17 call A, one slice per group inside a block: k3-layers-4 B=3 4.10 ms vs 3.61 on the FP32 kernels;
//    call B with these items: 3.96 ms, and the 48B slower than call A's form: off by default, cuda_options::
//    gemv_mma_min_tokens).
//    With KS > 1 each slice's 32 x 8 partial sums go to global scratch (gemv_cfg::mma_part); the warp whose arrival
//    counter (gemv_cfg::mma_ctr, one per group, left at 0) reads KS - 1 sums the KS partials in slice order, applies
//    the epilogue and resets the counter: deterministic, one launch;
//  - a persistent grid (at most the resident blocks; warps take items w, w + 8 gridDim, ...); STAGED: x' = RMSNorm(x)
//    * nw staged in shared memory first by each block (stage_norm, as v2).
constexpr int k_mma_rows = 32;    // rows per warp item (two m16 tiles)
constexpr int k_mma_steps = 2;    // 32-column steps in flight per lane (4 rows x 16 bytes each)
constexpr int k_mma_item = k_mma_rows * 8;   // partial sums per item [32 rows][8 tokens]
std::atomic<long> g_mma_launches{0};

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t *>(&v); }

// The three bf16 parts of 8 fp32 values (x[0..7]), each as 4 packed pairs: pt[p][j] = part p of (x[2j], x[2j+1]).
__device__ __forceinline__ void split3_pairs(const float (&x)[8], uint32_t (&pt)[3][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float a = x[2 * j], b = x[2 * j + 1];
        const __nv_bfloat162 h0 = __floats2bfloat162_rn(a, b);
        const float2 f0 = __bfloat1622float2(h0);
        const float ra = a - f0.x, rb = b - f0.y;   // exact: bf16(a) is within one bf16 ulp of a
        const __nv_bfloat162 h1 = __floats2bfloat162_rn(ra, rb);
        const float2 f1 = __bfloat1622float2(h1);
        const __nv_bfloat162 h2 = __floats2bfloat162_rn(ra - f1.x, rb - f1.y);
        pt[0][j] = bf2_bits(h0), pt[1][j] = bf2_bits(h1), pt[2][j] = bf2_bits(h2);
    }
}

// g.start[s]: the first 32-row group of segment s (groups numbered over all segments).
template <int TT, bool STAGED>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_mma(const float * __restrict__ x, int64_t in, fused_segs g, int KS, int parts,
                      const float * __restrict__ nw, float eps, float * __restrict__ yn, bool ef, float * part,
                      unsigned * ctr) {
    const uint64_t pol = l2_stream_policy(ef);
    if constexpr (STAGED) stage_norm_prefetch(nw, in);   // a weight: before the wait
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, q = lane & 3;
    const unsigned groups = g.start[g.n];
    const int64_t items = int64_t(groups) * KS;
    const int64_t nst = (in + 31) / 32;   // 32-column steps
    const float * xs = x;
    if constexpr (STAGED) {
        extern __shared__ float4 stage4[];
        float * st = reinterpret_cast<float *>(stage4);   // [TT, in]
        stage_norm<TT>(x, in, nw, eps, st, yn);
        xs = st;
    }
    const bool tok = gq < TT;   // this lane's B column (token gq) is a real token
    const float * xt = xs + int64_t(tok ? gq : 0) * in;
    for (int64_t it = int64_t(blockIdx.x) * k_gemv_warps + warp; it < items; it += int64_t(gridDim.x) * k_gemv_warps) {
        const unsigned G = unsigned(it / KS);
        const int ks = int(it % KS);
        int s = 0;
        while (s + 1 < g.n && G >= g.start[s + 1]) ++s;
        const int64_t out = g.out[s];
        const int64_t r0 = int64_t(G - g.start[s]) * k_mma_rows;
        const void * W = g.w[s];
        int64_t rb[4];   // rows r0 + gq + 8j (tile j / 2, fragment half j % 2), past the end clamped (read, never stored)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int64_t r = r0 + gq + 8 * j;
            rb[j] = (r < out ? r : out - 1) * in;
        }
        float acc[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
        const int64_t kb = nst * ks / KS, ke = nst * (ks + 1) / KS;
        for (int64_t k = kb; k < ke; k += k_mma_steps) {
            uint4 w[k_mma_steps][4];
#pragma unroll
            for (int u = 0; u < k_mma_steps; ++u) {
                const int64_t c = (k + u) * 32 + 8 * q;
                const bool ok = k + u < ke && c < in;
#pragma unroll
                for (int j = 0; j < 4; ++j) w[u][j] = ok ? wraw_load<wtype::BF16>(W, rb[j] + c, pol) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < k_mma_steps; ++u) {
                if (k + u >= ke) break;   // warp-uniform: every lane runs the same mma instructions
                const int64_t c = (k + u) * 32 + 8 * q;
                float xv[8];
                if (tok && c < in) {
                    const float4 a = *reinterpret_cast<const float4 *>(xt + c), b = *reinterpret_cast<const float4 *>(xt + c + 4);
                    xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w, xv[4] = b.x, xv[5] = b.y, xv[6] = b.z, xv[7] = b.w;
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) xv[i] = 0.0f;
                }
                uint32_t pt[3][4];
                split3_pairs(xv, pt);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const uint4 lo = w[u][2 * m], hi = w[u][2 * m + 1];   // rows g and g + 8 of tile m
                    const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};      // physical columns 8q .. 8q + 3
                    const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};      // 8q + 4 .. 8q + 7
#pragma unroll
                    for (int p = 2; p >= 0; --p) {   // the smallest part first
                        if (p >= parts) continue;
                        mma_bf16(acc[m], a0, pt[p][0], pt[p][1]);
                        mma_bf16(acc[m], a1, pt[p][2], pt[p][3]);
                    }
                }
            }
        }
        // acc[m][e]: row r0 + 16m + gq + 8 (e / 2), token 2q + e % 2 (item-local index (16m + gq + 8 (e / 2)) * 8 + token)
        if (KS > 1) {
            float * mine = part + it * k_mma_item;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) mine[(16 * m + gq + 8 * (e >> 1)) * 8 + 2 * q + (e & 1)] = acc[m][e];
            __threadfence();   // the partials visible device-wide before the arrival is counted
            __syncwarp();
            unsigned arrived = 0;
            if (lane == 0) arrived = atomicAdd(ctr + G, 1u);
            arrived = __shfl_sync(0xffffffffu, arrived, 0);
            if (arrived != unsigned(KS - 1)) continue;   // not the last slice of this group
            __threadfence();
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int64_t o = (16 * m + gq + 8 * (e >> 1)) * 8 + 2 * q + (e & 1);
                    float v = 0.0f;
                    for (int j = 0; j < KS; ++j) v += __ldcg(part + (int64_t(G) * KS + j) * k_mma_item + o);   // slice order
                    acc[m][e] = v;
                }
            if (lane == 0) ctr[G] = 0u;   // left at 0 for the next launch (stream order)
        }
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int64_t row = r0 + 16 * m + gq + 8 * (e >> 1);
                const int t = 2 * q + (e & 1);
                if (t < TT && row < out) gemv_store(g, s, row, t, acc[m][e]);
            }
    }
}

template <int TT, bool STAGED>
cudaError_t mma_launch(const float * x, int64_t in, fused_segs g, const gemv_cfg & cfg, const float * nw, float eps,
                       float * yn, cudaStream_t st) {
    constexpr auto kern = k_linear_gemv_mma<TT, STAGED>;
    const int th = k_gemv_warps * 32;
    const int sms = device_sms();
    const size_t smem = STAGED ? size_t(TT) * size_t(in) * 4 : 0;
    const int64_t slots = int64_t(sms) * gemv_occupancy<kern>(th, smem, st);
    g.start[0] = 0;
    for (int s = 0; s < g.n; ++s) g.start[s + 1] = g.start[s] + unsigned((g.out[s] + k_mma_rows - 1) / k_mma_rows);
    const int64_t groups = g.start[g.n];
    const int64_t nst = (in + 31) / 32;
    // KS: forced (cfg.split), or the smallest power of 2 up to 64 giving every resident warp an item, each slice at
    // least 4 steps (128 columns); > 1 only with scratch for the partials and the counters.
    const auto fits = [&](int64_t ks) {
        return ks == 1 || (cfg.mma_part && cfg.mma_ctr && groups * ks * k_mma_item <= cfg.mma_part_floats && groups <= cfg.mma_ctr_n);
    };
    int KS = cfg.split;
    if (KS == 0) {
        KS = 1;
        while (KS < 64 && groups * KS < slots * k_gemv_warps && nst / (2 * KS) >= 4 && fits(2 * KS)) KS *= 2;
    }
    if (!fits(KS)) return cudaErrorInvalidValue;
    const int64_t items = groups * KS;
    const unsigned grid = unsigned(std::min<int64_t>((items + k_gemv_warps - 1) / k_gemv_warps, slots));
    g_mma_launches.fetch_add(1, std::memory_order_relaxed);
    return launch_k(kern, grid, th, smem, st, x, in, g, KS, cfg.mma_parts, nw, eps, yn, cfg.evict_first, cfg.mma_part,
                    cfg.mma_ctr);
}

template <bool STAGED>
cudaError_t mma_tokens(const float * x, int64_t tt, int64_t in, const fused_segs & g, const gemv_cfg & cfg, const float * nw,
                       float eps, float * yn, cudaStream_t st) {
    switch (tt) {
        case 1: return mma_launch<1, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 2: return mma_launch<2, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 3: return mma_launch<3, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 4: return mma_launch<4, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 5: return mma_launch<5, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 6: return mma_launch<6, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        case 7: return mma_launch<7, STAGED>(x, in, g, cfg, nw, eps, yn, st);
        default: return mma_launch<8, STAGED>(x, in, g, cfg, nw, eps, yn, st);
    }
}

// Whether a chunk of tt tokens goes to the tensor-core kernel.
bool mma_applies(const gemv_cfg & cfg, int64_t tt, int64_t in, wtype wt) {
    return cfg.mma > 0 && tt >= cfg.mma && wt == wtype::BF16 && in % 8 == 0;
}

cudaError_t mma_chunk(const float * x, int64_t tt, int64_t in, const fused_segs & g, const gemv_cfg & cfg, bool staged,
                      const float * nw, float eps, float * yn, cudaStream_t st) {
    return staged ? mma_tokens<true>(x, tt, in, g, cfg, nw, eps, yn, st) : mma_tokens<false>(x, tt, in, g, cfg, nw, eps, yn, st);
}

bool cfg_valid(const gemv_cfg & c) {
    const bool u = c.unroll == 0 || c.unroll == 1 || c.unroll == 2 || c.unroll == 4 || c.unroll == 8;
    const bool s = c.split == 0 || c.split == 1 || c.split == 2 || c.split == 4 || c.split == 8;
    const bool v3 = (c.v3 >= 0 && c.v3 <= 2) && (c.v3_unroll == 0 || v3_u_valid(c.v3_unroll));
    const bool mma = c.mma >= 0 && c.mma <= 8 && c.mma_parts >= 1 && c.mma_parts <= 3;
    return u && s && v3 && mma;
}

__global__ void k_weight_to_f32(dweight w, int64_t n, float * __restrict__ y) {
    pdl_enter();
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        y[i] = wload(w, i);
}

__global__ void k_f32_to_bf16(const float * __restrict__ x, int64_t n, uint16_t * __restrict__ y) {
    pdl_enter();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
        y[i] = *reinterpret_cast<const uint16_t *>(&h);
    }
}

__global__ void k_f32_round_bf16(const float * __restrict__ x, int64_t n, float * __restrict__ y) {
    pdl_enter();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}

__global__ void k_f32_to_bf16_split(const float * __restrict__ x, int64_t n, uint16_t * __restrict__ hi,
                                    uint16_t * __restrict__ lo) {
    pdl_enter();
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
        const __nv_bfloat16 l = __float2bfloat16_rn(x[i] - __bfloat162float(h));
        hi[i] = *reinterpret_cast<const uint16_t *>(&h);
        lo[i] = *reinterpret_cast<const uint16_t *>(&l);
    }
}

__global__ void k_get_rows(dweight table, int64_t V, int64_t D, const int32_t * __restrict__ ids, float * __restrict__ y,
                           int * err) {
    pdl_enter();
    const int64_t t = blockIdx.y;
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < V;
    if (!ok && threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err + ERR_ID_RANGE, 1);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < D; i += int64_t(gridDim.x) * blockDim.x)
        y[t * D + i] = ok ? wload(table, int64_t(id) * D + i) : 0.0f;
}

} // namespace

long gemv_mma_launches() { return g_mma_launches.load(std::memory_order_relaxed); }

cudaError_t launch_linear_gemv(const float * x, int64_t T, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st,
                               gemv_cfg cfg) {
    if (!cfg_valid(cfg)) return cudaErrorInvalidValue;
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int64_t tt = T - t0 < 8 ? T - t0 : 8;
        if (cfg.unroll > 0 || v3_applies(cfg, tt, in, W.type) || mma_applies(cfg, tt, in, W.type)) {
            fused_segs g{};
            g.n = 1;
            g.w[0] = W.data;
            g.y[0] = y + t0 * out;
            g.out[0] = out;
            const cudaError_t e = mma_applies(cfg, tt, in, W.type)
                                      ? mma_chunk(x + t0 * in, tt, in, g, cfg, false, nullptr, 0.0f, nullptr, st)
                                  : v3_applies(cfg, tt, in, W.type)
                                      ? v3_chunk(x + t0 * in, in, W.type, g, cfg, false, nullptr, 0.0f, nullptr, st)
                                      : v2_chunk(x + t0 * in, tt, in, W.type, g, cfg, false, nullptr, 0.0f, nullptr, st);
            if (e != cudaSuccess) return e;
            continue;
        }
        // y rows t0.. are written with ldy = out by each chunk (y offset by t0 rows).
        switch (W.type) {
            case wtype::BF16: gemv_chunk<wtype::BF16>(x + t0 * in, tt, in, W, out, y + t0 * out, st); break;
            case wtype::F16: gemv_chunk<wtype::F16>(x + t0 * in, tt, in, W, out, y + t0 * out, st); break;
            default: gemv_chunk<wtype::F32>(x + t0 * in, tt, in, W, out, y + t0 * out, st); break;
        }
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaGetLastError();
}

cudaError_t launch_linear_gemv_group(const float * x, int64_t T, int64_t in, wtype wt, const void * const * w,
                                     float * const * y, const int64_t * out, int n, cudaStream_t st, gemv_cfg cfg) {
    if (n < 1 || n > k_gemv_group_max || !cfg_valid(cfg)) return cudaErrorInvalidValue;
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int64_t tt = T - t0 < 8 ? T - t0 : 8;
        if (cfg.unroll > 0 || v3_applies(cfg, tt, in, wt) || mma_applies(cfg, tt, in, wt)) {
            fused_segs g{};
            g.n = n;
            for (int s = 0; s < n; ++s) {
                g.w[s] = w[s];
                g.y[s] = y[s] + t0 * out[s];
                g.out[s] = out[s];
            }
            const cudaError_t e = mma_applies(cfg, tt, in, wt)
                                      ? mma_chunk(x + t0 * in, tt, in, g, cfg, false, nullptr, 0.0f, nullptr, st)
                                  : v3_applies(cfg, tt, in, wt)
                                      ? v3_chunk(x + t0 * in, in, wt, g, cfg, false, nullptr, 0.0f, nullptr, st)
                                      : v2_chunk(x + t0 * in, tt, in, wt, g, cfg, false, nullptr, 0.0f, nullptr, st);
            if (e != cudaSuccess) return e;
            continue;
        }
        gemv_segs g{};
        g.n = n;
        g.start[0] = 0;
        for (int s = 0; s < n; ++s) {
            g.w[s] = w[s];
            g.y[s] = y[s] + t0 * out[s];
            g.out[s] = out[s];
            g.start[s + 1] = g.start[s] + grid_for(out[s], k_gemv_warps);
        }
        switch (wt) {
            case wtype::BF16: gemv_multi_chunk<wtype::BF16>(x + t0 * in, tt, in, g, st); break;
            case wtype::F16: gemv_multi_chunk<wtype::F16>(x + t0 * in, tt, in, g, st); break;
            default: gemv_multi_chunk<wtype::F32>(x + t0 * in, tt, in, g, st); break;
        }
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaGetLastError();
}

cudaError_t launch_linear_gemv_fused(const float * x, int64_t T, int64_t in, wtype wt, const gemv_fused_seg * segs, int n,
                                     const gemv_norm & nm, cudaStream_t st, int * staged_launches, gemv_cfg cfg) {
    if (n < 1 || n > k_gemv_group_max || in < 1 || !cfg_valid(cfg)) return cudaErrorInvalidValue;
    for (int s = 0; s < n; ++s)
        if (segs[s].out < 1 || (segs[s].z[1] && !segs[s].z[0])) return cudaErrorInvalidValue;
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int64_t tt = T - t0 < 8 ? T - t0 : 8;
        fused_segs g{};
        g.n = n;
        for (int s = 0; s < n; ++s) {
            const int64_t o = t0 * segs[s].out;
            g.w[s] = segs[s].w;
            g.y[s] = segs[s].y + o;
            g.out[s] = segs[s].out;
            g.res0[s] = segs[s].res[0] ? segs[s].res[0] + o : nullptr;
            g.res1[s] = segs[s].res[1] ? segs[s].res[1] + o : nullptr;
            g.z0[s] = segs[s].z[0] ? segs[s].z[0] + o : nullptr;
            g.z1[s] = segs[s].z[1] ? segs[s].z[1] + o : nullptr;
            g.sig[s] = segs[s].sig ? segs[s].sig + o : nullptr;
            g.start[s + 1] = g.start[s] + grid_for(segs[s].out, k_gemv_warps);
            g.roff[s + 1] = g.roff[s] + segs[s].out;
        }
        const float * xc = x + t0 * in;
        float * yn = nm.on && nm.y ? nm.y + t0 * in : nullptr;
        const bool staged = nm.on && nm.staged && tt * in * 4 <= k_gemv_norm_stage_max && in % 4 == 0;
        if (mma_applies(cfg, tt, in, wt) && (staged || !nm.on)) {   // the in-warp norm prologue keeps the first kernel
            const cudaError_t e = mma_chunk(xc, tt, in, g, cfg, staged, nm.w, nm.eps, yn, st);
            if (e != cudaSuccess) return e;
            if (staged && staged_launches) ++*staged_launches;
            continue;
        }
        if (v3_applies(cfg, tt, in, wt) && (staged || !nm.on)) {   // the in-warp norm prologue keeps the first kernel
            const cudaError_t e = v3_chunk(xc, in, wt, g, cfg, staged, nm.w, nm.eps, yn, st);
            if (e != cudaSuccess) return e;
            if (staged && staged_launches) ++*staged_launches;
            continue;
        }
        if (cfg.unroll > 0 && (staged || !nm.on)) {   // the in-warp norm prologue (not staged) keeps the first kernel
            const cudaError_t e = v2_chunk(xc, tt, in, wt, g, cfg, staged, nm.w, nm.eps, yn, st);
            if (e != cudaSuccess) return e;
            if (staged && staged_launches) ++*staged_launches;
            continue;
        }
        if (staged) {
            switch (wt) {
                case wtype::BF16: staged_chunk<wtype::BF16>(xc, tt, in, g, nm.w, nm.eps, yn, st); break;
                case wtype::F16: staged_chunk<wtype::F16>(xc, tt, in, g, nm.w, nm.eps, yn, st); break;
                default: staged_chunk<wtype::F32>(xc, tt, in, g, nm.w, nm.eps, yn, st); break;
            }
            const cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) return e;
            if (staged_launches) ++*staged_launches;
            continue;
        }
        switch (wt) {
            case wtype::BF16:
                if (nm.on) fused_chunk<wtype::BF16, true>(xc, tt, in, g, nm.w, nm.eps, yn, st);
                else fused_chunk<wtype::BF16, false>(xc, tt, in, g, nullptr, 0.0f, nullptr, st);
                break;
            case wtype::F16:
                if (nm.on) fused_chunk<wtype::F16, true>(xc, tt, in, g, nm.w, nm.eps, yn, st);
                else fused_chunk<wtype::F16, false>(xc, tt, in, g, nullptr, 0.0f, nullptr, st);
                break;
            default:
                if (nm.on) fused_chunk<wtype::F32, true>(xc, tt, in, g, nm.w, nm.eps, yn, st);
                else fused_chunk<wtype::F32, false>(xc, tt, in, g, nullptr, 0.0f, nullptr, st);
                break;
        }
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaGetLastError();
}

cudaError_t launch_weight_to_f32(dweight w, int64_t n, float * y, cudaStream_t st) {
    if (n > 0) launch_k(k_weight_to_f32, grid_for(n, 256) > 1024 ? 1024 : grid_for(n, 256), 256, 0, st, w, n, y);
    return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16(const float * x, int64_t n, uint16_t * y, cudaStream_t st) {
    if (n > 0) launch_k(k_f32_to_bf16, grid_for(n, 256), 256, 0, st, x, n, y);
    return cudaGetLastError();
}

cudaError_t launch_f32_round_bf16(const float * x, int64_t n, float * y, cudaStream_t st) {
    if (n > 0) launch_k(k_f32_round_bf16, grid_for(n, 256), 256, 0, st, x, n, y);
    return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16_split(const float * x, int64_t n, uint16_t * hi, uint16_t * lo, cudaStream_t st) {
    if (n > 0) launch_k(k_f32_to_bf16_split, grid_for(n, 256), 256, 0, st, x, n, hi, lo);
    return cudaGetLastError();
}

cudaError_t launch_get_rows(dweight table, int64_t V, int64_t D, const int32_t * ids, int64_t T, float * y, int * err,
                            cudaStream_t st) {
    if (T > 0 && D > 0) {
        const unsigned bx = unsigned(D >= 1024 ? 4 : 1);
        launch_k(k_get_rows, dim3(bx, unsigned(T)), 256, 0, st, table, V, D, ids, y, err);
    }
    return cudaGetLastError();
}

} // namespace perigee::cuda
