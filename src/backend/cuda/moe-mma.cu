// MOE_EXPERTS on bf16 tensor cores (cuda_options::moe_mma_tokens): the grouped path's experts with at least n_min
// tokens (the grouped GEMV kernels in moe.cu take the others). Moved out of moe.cu; declarations in cuda-ops.h.
#include "backend/cuda/common.cuh"

#include <mma.h>

namespace perigee::cuda {

namespace {

// (copies of moe.cu's helpers: that file's anonymous namespace)
// E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as bf16: high bytes and low bytes, 8 entries in two words each.
constexpr uint32_t k_fp4_hi0 = 0x3F3F3F00u, k_fp4_hi1 = 0x40404040u;
constexpr uint32_t k_fp4_lo0 = 0xC0800000u, k_fp4_lo1 = 0xC0804000u;

// 8 E2M1 nibbles (low nibble first) -> 4 packed bf16 pairs (columns 0|1, 2|3, 4|5, 6|7; low half first), exact.
__device__ __forceinline__ void fp4x8_pairs(uint32_t q, uint32_t (&p)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t c = (q >> (16 * h)) & 0xFFFFu;          // 4 nibbles
        const uint32_t sel = c & 0x7777u;
        const uint32_t hi = __byte_perm(k_fp4_hi0, k_fp4_hi1, sel);
        const uint32_t lo = __byte_perm(k_fp4_lo0, k_fp4_lo1, sel);
        uint32_t p0 = __byte_perm(lo, hi, 0x5140u), p1 = __byte_perm(lo, hi, 0x7362u);
        p0 |= ((c & 0x8u) << 12) | ((c & 0x80u) << 24);
        p1 |= ((c & 0x800u) << 4) | ((c & 0x8000u) << 16);
        p[2 * h] = p0;
        p[2 * h + 1] = p1;
    }
}

__device__ __forceinline__ float e8m0_g(uint8_t b) { return b == 0 ? __int_as_float(0x00400000) : __int_as_float(int(b) << 23); }
__device__ __forceinline__ float e4m3_g(uint8_t b) {
    const int sgn = b >> 7, ex = (b >> 3) & 15, mn = b & 7;
    float v = ex == 0 ? ldexpf(float(mn), -9) : ldexpf(1.0f + float(mn) / 8.0f, ex - 7);
    return sgn ? -v : v;
}

// ---- Tensor-core grouped experts (cuda_options::moe_mma_tokens): the experts with at least n_min tokens. A block
// takes one active expert and 128 weight rows (gate/up: 64 rows of each; down: 128 rows) and walks the expert's tokens
// in tiles of 32; per K-tile of 64 columns the rows are dequantized once into shared memory as bf16, exactly: MXFP4
// (E2M1 x E8M0) and BF16 rows are exact in bf16, NVFP4 as E2M1 x E4M3 (at most 6 significant bits, exact) with the
// per-matrix global scale applied in fp32 in the epilogue. The token tile's activations are split into bf16 hi + lo
// (x = hi + lo to ~16 mantissa bits, as the cuBLASLt LINEAR path does) and both run through bf16 wmma 16x16x16 into
// the same fp32 accumulators (xsplit = false: hi only, the first form; NMSE ~1e-5, compare mode). SiLU/SiTU GLU in
// the epilogue (fp32 hbuf, which the down stage splits the same way). The raw weight bytes and activations of K-tile
// i+1 are loaded into registers before tile i is dequantized and multiplied (one tile of loads in flight behind the
// math; the first form issued each tile's loads only after the previous tile's mma).
constexpr int k_mm_rows = 128, k_mm_m = 32, k_mm_k = 64, k_mm_ld = k_mm_k + 8, k_mm_threads = 128;

// The raw bytes of one 64-column K-tile of one weight row: BF16 8 x 16 B; MXFP4 2 x 16 B + 2 E8M0 bytes; NVFP4
// 2 x 16 B + 4 E4M3 bytes. Units past the row's end load as zero.
template <int FMT> struct mm_raw {
    static constexpr int NQ = FMT == 1 ? 8 : 2;
    uint4 q[NQ];
    uint8_t s[4];
    __device__ __forceinline__ void load(const dexpert_matrix & m, int64_t row, int64_t k0, bool ok) {
        const int64_t K = m.in;
#pragma unroll
        for (int i = 0; i < NQ; ++i) {
            const int64_t c0 = k0 + (FMT == 1 ? 8 : 32) * i;   // first column of this 16-byte unit
            if (!ok || c0 >= K) {
                q[i] = make_uint4(0u, 0u, 0u, 0u);
                continue;
            }
            if constexpr (FMT == 1) q[i] = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(m.w) + row * K + c0));
            else q[i] = __ldg(reinterpret_cast<const uint4 *>(m.packed + row * (K / 2) + c0 / 2));
        }
        if constexpr (FMT == 2) {
#pragma unroll
            for (int i = 0; i < 2; ++i) s[i] = (ok && k0 + 32 * i < K) ? __ldg(m.scale + row * (K / 32) + k0 / 32 + i) : uint8_t(127);
        } else if constexpr (FMT == 3) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[i] = (ok && k0 + 16 * i < K) ? __ldg(m.scale + row * (K / 16) + k0 / 16 + i) : uint8_t(0x38);
        }
    }
    // Columns [32 h, 32 h + 32) of the tile as 16 packed bf16 pairs (exact; NVFP4 without its global scale).
    __device__ __forceinline__ void bf16(int h, uint32_t (&o)[16]) const {
        if constexpr (FMT == 1) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint4 v = q[4 * h + i];
                o[4 * i] = v.x;
                o[4 * i + 1] = v.y;
                o[4 * i + 2] = v.z;
                o[4 * i + 3] = v.w;
            }
        } else {
            // E2M1 pairs straight to bf16, times the scale as a bf16x2 product: exact (E8M0 is a power of two, E4M3 has 4
            // significant bits, E2M1 2: the product fits bf16's 8; bf16 has fp32's exponent range, subnormals included).
            const uint4 v = q[h];
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
            __nv_bfloat162 s0, s1;
            if constexpr (FMT == 2) {
                s0 = s1 = __float2bfloat162_rn(e8m0_g(s[h]));
            } else {
                s0 = __float2bfloat162_rn(e4m3_g(s[2 * h]));
                s1 = __float2bfloat162_rn(e4m3_g(s[2 * h + 1]));
            }
#pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
                uint32_t p[4];
                fp4x8_pairs(words[wi], p);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&p[i]), wi < 2 ? s0 : s1);
                    o[4 * wi + i] = *reinterpret_cast<const uint32_t *>(&b);
                }
            }
        }
    }
};

// NM == 2: gate/up, xin = x [T, ldx], token row = slot / k_div, out = hbuf [S, d_ff] (GLU applied).
// NM == 1: down, xin = hbuf [S, ldx], token row = slot, out = ybuf [S, d_out]. grid (rows / (128 / NM), A).
template <int FMT, int NM>
__global__ void __launch_bounds__(k_mm_threads, FMT == 1 ? 3 : 4) k_moe_mma(const float * __restrict__ xin, int64_t ldx, int64_t k_div,
                                                          const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                          const int32_t * __restrict__ gw, dexperts_cfg c, int n_min,
                                                          bool xsplit, float * __restrict__ out) {
    namespace wm = nvcuda::wmma;
    const int a = blockIdx.y;
    if (a >= gw[0]) return;
    const int n = gw[2 + 2 * A + S + a];
    if (n < n_min) return;
    const int e = gw[1 + a];
    const int32_t * slots = gw + 2 + 2 * A + gw[1 + A + a];
    constexpr int BN = k_mm_rows / NM;
    const int64_t n_rows = NM == 2 ? c.d_ff : c.d_out;
    const int64_t r0 = int64_t(blockIdx.x) * BN;
    const int tid = threadIdx.x, warp = tid >> 5;
    const dexpert_matrix wmat = (NM == 2 && tid >= BN) ? ex[e].up : (NM == 2 ? ex[e].gate : ex[e].down);
    // NVFP4: the global scale of each output column's matrix, applied in the epilogue
    const float gs0 = FMT == 3 ? (NM == 2 ? ex[e].gate.global_scale : ex[e].down.global_scale) : 1.0f;
    const float gs1 = FMT == 3 && NM == 2 ? ex[e].up.global_scale : gs0;
    const int64_t wrow = r0 + tid % BN;
    const bool row_ok = wrow < n_rows;
    const int64_t K = wmat.in;
    constexpr int tile_bytes = (k_mm_rows + 2 * k_mm_m) * k_mm_ld * 2, c_bytes = k_mm_m * k_mm_rows * 4;
    __shared__ __align__(128) unsigned char smem[tile_bytes > c_bytes ? tile_bytes : c_bytes];   // 27 KB
    __nv_bfloat16 * Ws = reinterpret_cast<__nv_bfloat16 *>(smem);            // [128][ld]: weight rows, K-tile
    __nv_bfloat16 * Xh = Ws + k_mm_rows * k_mm_ld;                            // [32][ld]: tokens, K-tile, bf16 hi
    __nv_bfloat16 * Xl = Xh + k_mm_m * k_mm_ld;                               // [32][ld]: x - hi, bf16
    float * Cs = reinterpret_cast<float *>(smem);                             // [32][128]: after the K loop
    const int xt = tid >> 2, xc = (tid & 3) * 16;   // activation tile: token xt, 16 columns from xc
    for (int t0 = 0; t0 < n; t0 += k_mm_m) {
        wm::fragment<wm::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) wm::fill_fragment(acc[i][j], 0.0f);
        const float * xrow = t0 + xt < n ? xin + int64_t(slots[t0 + xt] / k_div) * ldx : nullptr;
        mm_raw<FMT> raw;
        float4 xv[4];
        auto load_x = [&](int64_t k0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                xv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (xrow && k0 + xc + 4 * i < K) xv[i] = *reinterpret_cast<const float4 *>(xrow + k0 + xc + 4 * i);
            }
        };
        raw.load(wmat, wrow, 0, row_ok);
        load_x(0);
        for (int64_t k0 = 0; k0 < K; k0 += k_mm_k) {
            const mm_raw<FMT> cur = raw;
            float4 xcur[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) xcur[i] = xv[i];
            if (k0 + k_mm_k < K) {   // the next tile's loads, in flight during this tile's dequant and mma
                raw.load(wmat, wrow, k0 + k_mm_k, row_ok);
                load_x(k0 + k_mm_k);
            }
#pragma unroll
            for (int h = 0; h < k_mm_k / 32; ++h) {
                uint32_t o[16];
                cur.bf16(h, o);
                uint4 * dst = reinterpret_cast<uint4 *>(Ws + tid * k_mm_ld + 32 * h);
#pragma unroll
                for (int i = 0; i < 4; ++i) dst[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
            }
            {
                uint32_t oh[8], ol[8];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float4 v = xcur[i];
                    const __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y), h1 = __floats2bfloat162_rn(v.z, v.w);
                    const float2 f0 = __bfloat1622float2(h0), f1 = __bfloat1622float2(h1);
                    const __nv_bfloat162 l0 = xsplit ? __floats2bfloat162_rn(v.x - f0.x, v.y - f0.y) : __floats2bfloat162_rn(0.0f, 0.0f);
                    const __nv_bfloat162 l1 = xsplit ? __floats2bfloat162_rn(v.z - f1.x, v.w - f1.y) : __floats2bfloat162_rn(0.0f, 0.0f);
                    oh[2 * i] = *reinterpret_cast<const uint32_t *>(&h0);
                    oh[2 * i + 1] = *reinterpret_cast<const uint32_t *>(&h1);
                    ol[2 * i] = *reinterpret_cast<const uint32_t *>(&l0);
                    ol[2 * i + 1] = *reinterpret_cast<const uint32_t *>(&l1);
                }
                uint4 * dh = reinterpret_cast<uint4 *>(Xh + xt * k_mm_ld + xc);
                uint4 * dl = reinterpret_cast<uint4 *>(Xl + xt * k_mm_ld + xc);
                dh[0] = make_uint4(oh[0], oh[1], oh[2], oh[3]);
                dh[1] = make_uint4(oh[4], oh[5], oh[6], oh[7]);
                dl[0] = make_uint4(ol[0], ol[1], ol[2], ol[3]);
                dl[1] = make_uint4(ol[4], ol[5], ol[6], ol[7]);
            }
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < k_mm_k; kk += 16) {
                wm::fragment<wm::matrix_a, 16, 16, 16, __nv_bfloat16, wm::row_major> fa[2];
                wm::fragment<wm::matrix_b, 16, 16, 16, __nv_bfloat16, wm::col_major> fb[2];
#pragma unroll
                for (int j = 0; j < 2; ++j) wm::load_matrix_sync(fb[j], Ws + (warp * 32 + 16 * j) * k_mm_ld + kk, k_mm_ld);
#pragma unroll
                for (int i = 0; i < 2; ++i) wm::load_matrix_sync(fa[i], Xh + (16 * i) * k_mm_ld + kk, k_mm_ld);
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 2; ++j) wm::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
                if (xsplit) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) wm::load_matrix_sync(fa[i], Xl + (16 * i) * k_mm_ld + kk, k_mm_ld);
#pragma unroll
                    for (int i = 0; i < 2; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j) wm::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wm::store_matrix_sync(Cs + (16 * i) * k_mm_rows + warp * 32 + 16 * j, acc[i][j], k_mm_rows, wm::mem_row_major);
        __syncthreads();
        for (int i = tid; i < k_mm_m * BN; i += k_mm_threads) {
            const int t = i / BN, rr = i % BN;
            if (t0 + t >= n || r0 + rr >= n_rows) continue;
            float v;
            if constexpr (NM == 2) {
                const float g = Cs[t * k_mm_rows + rr] * gs0, up = Cs[t * k_mm_rows + BN + rr] * gs1;
                v = c.act == 1 ? situ_d(g, up, c.situ_beta, c.situ_linear_beta) : silu_d(g) * up;
            } else {
                v = Cs[t * k_mm_rows + rr] * gs0;
            }
            out[int64_t(slots[t0 + t]) * n_rows + r0 + rr] = v;
        }
        __syncthreads();
    }
}

template <int FMT>
void launch_mma_stages(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                       const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st, int n_min,
                       bool xsplit) {
    k_moe_mma<FMT, 2><<<dim3(unsigned((c.d_ff + k_mm_rows / 2 - 1) / (k_mm_rows / 2)), unsigned(A)), k_mm_threads, 0, st>>>(
        x, Din, k, experts, A, S, gw, c, n_min, xsplit, hbuf);
    k_moe_mma<FMT, 1><<<dim3(unsigned((c.d_out + k_mm_rows - 1) / k_mm_rows), unsigned(A)), k_mm_threads, 0, st>>>(
        hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, xsplit, ybuf);
}

} // namespace

void launch_moe_mma_stages(int vfmt, const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                           const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st,
                           int n_min, const dmoe_opts & o) {
    if (vfmt == 1) launch_mma_stages<1>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
    else if (vfmt == 2) launch_mma_stages<2>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
    else launch_mma_stages<3>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
}

} // namespace perigee::cuda
