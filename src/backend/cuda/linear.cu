// LINEAR (bandwidth GEMV for small T; cuBLASLt is driven from cuda-backend.cpp for larger T) and GET_ROWS.
#include "backend/cuda/common.cuh"
#include "backend/cuda/fuse-ops.h"

#include <algorithm>

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
        case 1: k_linear_gemv_multi<WT, 1><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 2: k_linear_gemv_multi<WT, 2><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 3: k_linear_gemv_multi<WT, 3><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 4: k_linear_gemv_multi<WT, 4><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 5: k_linear_gemv_multi<WT, 5><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 6: k_linear_gemv_multi<WT, 6><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        case 7: k_linear_gemv_multi<WT, 7><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
        default: k_linear_gemv_multi<WT, 8><<<blocks, k_gemv_warps * 32, 0, st>>>(x, in, g); break;
    }
}

template <wtype WT, int TT>
void gemv_launch(const float * x, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st) {
    k_linear_gemv<WT, TT><<<grid_for(out, k_gemv_warps), k_gemv_warps * 32, 0, st>>>(x, in, W, out, y, out);
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
template <wtype WT, int TT>
__global__ void __launch_bounds__(k_gemv_warps * 32)
    k_linear_gemv_norm_staged(const float * __restrict__ x, int64_t in, fused_segs g, const float * __restrict__ nw,
                              float eps, float * __restrict__ yn) {
    extern __shared__ float4 stage4[];
    float * xs = reinterpret_cast<float *>(stage4);   // [TT, in]
    __shared__ float red[TT][k_gemv_warps];
    __shared__ float inv_s[TT];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int NT = k_gemv_warps * 32;
    const bool vec4 = in % 4 == 0;
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
    {
        float ss[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) ss[t] = 0.0f;
        if (vec4) {
            const int64_t n4 = in / 4;
#pragma unroll
            for (int t = 0; t < TT; ++t)
                for (int64_t c = tid; c < n4; c += NT) {
                    const float4 v = reinterpret_cast<const float4 *>(x + t * in)[c];
                    reinterpret_cast<float4 *>(xs + t * in)[c] = v;
                    ss[t] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
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
        for (int64_t c = tid; c < in; c += NT) {
            float v = xs[t * in + c] * inv;
            if (nw) v *= nw[c];
            xs[t * in + c] = v;
        }
    }
    __syncthreads();
    if (yn)
        for (int64_t i = int64_t(blockIdx.x) * NT + tid; i < int64_t(TT) * in; i += int64_t(gridDim.x) * NT) yn[i] = xs[i];

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

template <wtype WT, int TT>
void staged_launch(const float * x, int64_t in, const fused_segs & g, const float * nw, float eps, float * yn,
                   cudaStream_t st) {
    const auto kern = k_linear_gemv_norm_staged<WT, TT>;
    const size_t smem = size_t(TT) * size_t(in) * 4;
    const int th = k_gemv_warps * 32;
    // prefer the largest shared-memory carve-out (a hint; once per instantiation, never inside a stream capture)
    static bool carveout_set = false;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(st, &cap);
    if (!carveout_set && cap == cudaStreamCaptureStatusNone) {
        cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
        carveout_set = true;
    }
    int dev = 0, sms = 0, occ = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, th, smem);
    const unsigned total = g.start[g.n];
    const unsigned resident = unsigned(std::max(1, sms) * std::max(1, occ));
    kern<<<std::min(total, resident), th, smem, st>>>(x, in, g, nw, eps, yn);
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
        case 1: k_linear_gemv_fused<WT, 1, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 2: k_linear_gemv_fused<WT, 2, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 3: k_linear_gemv_fused<WT, 3, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 4: k_linear_gemv_fused<WT, 4, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 5: k_linear_gemv_fused<WT, 5, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 6: k_linear_gemv_fused<WT, 6, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        case 7: k_linear_gemv_fused<WT, 7, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
        default: k_linear_gemv_fused<WT, 8, NORM><<<blocks, th, 0, st>>>(x, in, g, nw, eps, yn); break;
    }
}

__global__ void k_weight_to_f32(dweight w, int64_t n, float * __restrict__ y) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        y[i] = wload(w, i);
}

__global__ void k_f32_to_bf16(const float * __restrict__ x, int64_t n, uint16_t * __restrict__ y) {
    const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {
        const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
        y[i] = *reinterpret_cast<const uint16_t *>(&h);
    }
}

__global__ void k_f32_to_bf16_split(const float * __restrict__ x, int64_t n, uint16_t * __restrict__ hi,
                                    uint16_t * __restrict__ lo) {
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
    const int64_t t = blockIdx.y;
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < V;
    if (!ok && threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err + ERR_ID_RANGE, 1);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < D; i += int64_t(gridDim.x) * blockDim.x)
        y[t * D + i] = ok ? wload(table, int64_t(id) * D + i) : 0.0f;
}

} // namespace

cudaError_t launch_linear_gemv(const float * x, int64_t T, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st) {
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int64_t tt = T - t0 < 8 ? T - t0 : 8;
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
                                     float * const * y, const int64_t * out, int n, cudaStream_t st) {
    if (n < 1 || n > k_gemv_group_max) return cudaErrorInvalidValue;
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        const int64_t tt = T - t0 < 8 ? T - t0 : 8;
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
                                     const gemv_norm & nm, cudaStream_t st, int * staged_launches) {
    if (n < 1 || n > k_gemv_group_max || in < 1) return cudaErrorInvalidValue;
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
        if (nm.on && nm.staged && tt * in * 4 <= k_gemv_norm_stage_max && in % 4 == 0) {
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
    if (n > 0) k_weight_to_f32<<<grid_for(n, 256) > 1024 ? 1024 : grid_for(n, 256), 256, 0, st>>>(w, n, y);
    return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16(const float * x, int64_t n, uint16_t * y, cudaStream_t st) {
    if (n > 0) k_f32_to_bf16<<<grid_for(n, 256), 256, 0, st>>>(x, n, y);
    return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16_split(const float * x, int64_t n, uint16_t * hi, uint16_t * lo, cudaStream_t st) {
    if (n > 0) k_f32_to_bf16_split<<<grid_for(n, 256), 256, 0, st>>>(x, n, hi, lo);
    return cudaGetLastError();
}

cudaError_t launch_get_rows(dweight table, int64_t V, int64_t D, const int32_t * ids, int64_t T, float * y, int * err,
                            cudaStream_t st) {
    if (T > 0 && D > 0) {
        const unsigned bx = unsigned(D >= 1024 ? 4 : 1);
        k_get_rows<<<dim3(bx, unsigned(T)), 256, 0, st>>>(table, V, D, ids, y, err);
    }
    return cudaGetLastError();
}

} // namespace perigee::cuda
