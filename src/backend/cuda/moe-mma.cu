// MOE_EXPERTS on bf16 tensor cores (cuda_options::moe_mma_tokens): the grouped path's experts with at least n_min
// tokens (the grouped GEMV kernels in moe.cu take the others). Moved out of moe.cu; declarations in cuda-ops.h.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"
#include "backend/cuda/fp4.cuh"
#include "backend/cuda/moe-mma-blocks.cuh"
#include "backend/cuda/smem-attr.cuh"

#include <algorithm>
#include <atomic>
#include <mma.h>

namespace perigee::cuda {

namespace {

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
    pdl_enter();
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
    launch_k(k_moe_mma<FMT, 2>, dim3(unsigned((c.d_ff + k_mm_rows / 2 - 1) / (k_mm_rows / 2)), unsigned(A)), k_mm_threads, 0, st,
        x, Din, k, experts, A, S, gw, c, n_min, xsplit, hbuf);
    launch_k(k_moe_mma<FMT, 1>, dim3(unsigned((c.d_out + k_mm_rows - 1) / k_mm_rows), unsigned(A)), k_mm_threads, 0, st,
        hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, xsplit, ybuf);
}

// ---- v2 (cuda_options::moe_mma_v2): MXFP4/NVFP4 with K a multiple of 128 (the others keep v1). Limiter model of v1
// (bench/RESULTS.md): every 32-token tile costs 2 x 32-token wmma work per weight (9 real tokens at T=512), the raw
// bytes of a K-tile come through one register stage per thread (34 B in flight per thread, 4 blocks of 128 threads
// per SM at 128 registers: ~17 KB per SM, under the ~30 KB HBM needs at ~1 us), the row-per-thread 16-byte loads touch
// 32 B of each of 128 rows per K-tile, and every tile goes bf16 -> shared -> wmma fragments.
// v2: one block of 256 threads per (expert, 256 weight rows: gate/up 128 + 128, down 256), all the expert's tokens
// (up to 64 per pass) in one walk over K, so each weight byte leaves HBM once. The raw FP4 bytes + scales and the fp32
// activations of 128-column K-tiles stream into shared memory through a 3-stage cp.async pipeline (64 B contiguous per
// row per stage). The activations are split once per tile into bf16 hi + lo in shared memory. Each warp owns 32 rows
// and dequantizes its A fragments of mma.sync m16n8k16 straight from the raw bytes in registers (E2M1 pairs x scale,
// exact); tokens are the n side, 8 per mma, so a 9-token expert pads to 16, not 32. The k order inside each 32-column
// scale block is permuted the same way for A and B (lane q takes the 8 columns of 32-bit word q), which leaves the
// sum unchanged and lets a lane's A fragments come from one 32-bit word per row.
constexpr int k_m2_rows = 256, k_m2_kt = 128, k_m2_tok = 64, k_m2_threads = 256, k_m2_stages = 3;
constexpr int k_m2_wld = 80;                       // bytes per weight row per stage (64 + 16: conflict-free LDS.32)
constexpr int k_m2_sld = 8;                        // scale bytes per row per stage (MXFP4 4, NVFP4 8)
constexpr int k_m2_xld = k_m2_kt * 4 + 16;         // bytes per token row of the fp32 stage
constexpr int k_m2_hld = k_m2_kt + 32;             // bf16 per token row of Xh / Xl (320 B: conflict-free LDS.128)
constexpr int k_m2_cld = k_m2_rows + 4;            // floats per token row of the epilogue tile
constexpr int k_m2_stage_bytes = k_m2_rows * k_m2_wld + k_m2_rows * k_m2_sld + k_m2_tok * k_m2_xld;
constexpr int k_m2_pipe_bytes = k_m2_stages * k_m2_stage_bytes;
constexpr int k_m2_c_bytes = k_m2_tok * k_m2_cld * 4;
constexpr int k_m2_smem = (k_m2_pipe_bytes > k_m2_c_bytes ? k_m2_pipe_bytes : k_m2_c_bytes) + 2 * k_m2_tok * k_m2_hld * 2;

// FMT 2 (MXFP4) / 3 (NVFP4). NM, xin, k_div, out as k_moe_mma. grid (ceil(rows / (256 / NM)), A); dynamic smem k_m2_smem.
template <int FMT, int NM>
__global__ void __launch_bounds__(k_m2_threads, 1) k_moe_mma2(const float * __restrict__ xin, int64_t ldx, int64_t k_div,
                                                               const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                               const int32_t * __restrict__ gw, dexperts_cfg c, int n_min,
                                                               bool xsplit, float * __restrict__ out) {
    pdl_enter();
    static_assert(FMT == 2 || FMT == 3, "v2: FP4 only");
    extern __shared__ __align__(128) unsigned char sm2[];
    const int a = blockIdx.y;
    if (a >= gw[0]) return;
    const int n = gw[2 + 2 * A + S + a];
    if (n < n_min) return;
    const int e = gw[1 + a];
    const int32_t * slots = gw + 2 + 2 * A + gw[1 + A + a];
    constexpr int BN = k_m2_rows / NM;   // output rows per block
    constexpr int SPR = FMT == 2 ? 4 : 8;   // scale bytes per row per stage
    const int64_t n_rows = NM == 2 ? c.d_ff : c.d_out;
    const int64_t r0 = int64_t(blockIdx.x) * BN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const dexpert_matrix m0 = NM == 2 ? ex[e].gate : ex[e].down;
    const dexpert_matrix m1 = NM == 2 ? ex[e].up : m0;
    const float gs0 = FMT == 3 ? m0.global_scale : 1.0f, gs1 = FMT == 3 ? m1.global_scale : 1.0f;
    const int64_t K = m0.in;
    const int nk = int(K / k_m2_kt);
    unsigned char * Xh_b = sm2 + (k_m2_pipe_bytes > k_m2_c_bytes ? k_m2_pipe_bytes : k_m2_c_bytes);
    __nv_bfloat16 * Xh = reinterpret_cast<__nv_bfloat16 *>(Xh_b);
    __nv_bfloat16 * Xl = Xh + k_m2_tok * k_m2_hld;
    float * Cs = reinterpret_cast<float *>(sm2);
    // scale rows aligned for 4/8-byte cp.async (else byte copies); per matrix, uniform
    const bool sc_al0 = (reinterpret_cast<uintptr_t>(m0.scale) % SPR) == 0 && ((K / (FMT == 2 ? 32 : 16)) % SPR) == 0;
    const bool sc_al1 = (reinterpret_cast<uintptr_t>(m1.scale) % SPR) == 0 && ((K / (FMT == 2 ? 32 : 16)) % SPR) == 0;

    // this thread's copies: 4 chunks of 16 B of weight rows (256 rows x 64 B per stage) and one row's scales
    const uint8_t * wsrc[4];
    int wdst[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int ch = tid + i * k_m2_threads, row = ch >> 2, part = ch & 3;
        const int64_t wr = r0 + (NM == 2 ? row % BN : row);
        const uint8_t * pk = (NM == 2 && row >= BN) ? m1.packed : m0.packed;
        wsrc[i] = wr < n_rows ? pk + wr * (K / 2) + part * 16 : nullptr;
        wdst[i] = row * k_m2_wld + part * 16;
    }
    const uint8_t * ssrc;
    bool s_al;
    {
        const int64_t wr = r0 + (NM == 2 ? tid % BN : tid);
        const bool up = NM == 2 && tid >= BN;
        const uint8_t * sc = up ? m1.scale : m0.scale;
        ssrc = wr < n_rows ? sc + wr * (K / (FMT == 2 ? 32 : 16)) : nullptr;
        s_al = up ? sc_al1 : sc_al0;
    }
    __shared__ int64_t xoff[k_m2_tok];
    for (int t0 = 0; t0 < n; t0 += k_m2_tok) {
        const int nt = min(k_m2_tok, n - t0);   // tokens of this pass
        const int nj = (nt + 7) >> 3;            // 8-token mma tiles
        // the pass's activation rows (slot -> token row: one 64-bit division per token and pass, not per tile)
        if (tid < nt) xoff[tid] = int64_t(slots[t0 + tid] / k_div) * ldx;
        __syncthreads();
        // stage st <- K-tile kt (raw weights, scales, fp32 activations of the pass's tokens)
        auto issue = [&](int kt, int st) {
            unsigned char * base = sm2 + st * k_m2_stage_bytes;
            unsigned char * Sst = base + k_m2_rows * k_m2_wld;
            unsigned char * Xst = Sst + k_m2_rows * k_m2_sld;
            const int64_t k0 = int64_t(kt) * k_m2_kt;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (wsrc[i]) cp_async16(base + wdst[i], wsrc[i] + k0 / 2);
            if (ssrc) {
                const uint8_t * src = ssrc + k0 / (FMT == 2 ? 32 : 16);
                if (s_al) {
                    if constexpr (FMT == 2) cp_async_small<4>(Sst + tid * k_m2_sld, src);
                    else cp_async_small<8>(Sst + tid * k_m2_sld, src);
                } else {
#pragma unroll
                    for (int i = 0; i < SPR; ++i) Sst[tid * k_m2_sld + i] = __ldg(src + i);
                }
            }
            for (int ch = tid; ch < nt * 32; ch += k_m2_threads) {   // activations: nt rows x 32 chunks of 16 B
                const int t = ch >> 5, part = ch & 31;
                cp_async16(Xst + t * k_m2_xld + part * 16, xin + xoff[t] + k0 + part * 4);
            }
        };

        float acc[2][8][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[mi][j][r] = 0.0f;

#pragma unroll
        for (int s = 0; s < k_m2_stages - 1; ++s) {
            if (s < nk) issue(s, s);
            cp_async_commit();
        }
        for (int kt = 0; kt < nk; ++kt) {
            cp_async_wait<k_m2_stages - 2>();
            __syncthreads();   // stage kt landed for every thread; every warp is done with tile kt - 1
            if (kt + k_m2_stages - 1 < nk) issue(kt + k_m2_stages - 1, (kt + k_m2_stages - 1) % k_m2_stages);
            cp_async_commit();
            const int st = kt % k_m2_stages;
            const unsigned char * Wst = sm2 + st * k_m2_stage_bytes;
            const unsigned char * Sst = Wst + k_m2_rows * k_m2_wld;
            const unsigned char * Xst = Sst + k_m2_rows * k_m2_sld;
            // fp32 activations -> bf16 hi + lo (rows nt .. 8 nj - 1 zero)
            for (int ch = tid; ch < nj * 8 * 32; ch += k_m2_threads) {
                const int t = ch >> 5, part = ch & 31;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (t < nt) v = *reinterpret_cast<const float4 *>(Xst + t * k_m2_xld + part * 16);
                const __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y), h1 = __floats2bfloat162_rn(v.z, v.w);
                const float2 f0 = __bfloat1622float2(h0), f1 = __bfloat1622float2(h1);
                const __nv_bfloat162 l0 = xsplit ? __floats2bfloat162_rn(v.x - f0.x, v.y - f0.y) : __floats2bfloat162_rn(0.0f, 0.0f);
                const __nv_bfloat162 l1 = xsplit ? __floats2bfloat162_rn(v.z - f1.x, v.w - f1.y) : __floats2bfloat162_rn(0.0f, 0.0f);
                uint2 hv, lv;
                hv.x = *reinterpret_cast<const uint32_t *>(&h0);
                hv.y = *reinterpret_cast<const uint32_t *>(&h1);
                lv.x = *reinterpret_cast<const uint32_t *>(&l0);
                lv.y = *reinterpret_cast<const uint32_t *>(&l1);
                *reinterpret_cast<uint2 *>(Xh + t * k_m2_hld + part * 4) = hv;
                *reinterpret_cast<uint2 *>(Xl + t * k_m2_hld + part * 4) = lv;
            }
            __syncthreads();
#pragma unroll
            for (int kb = 0; kb < k_m2_kt / 32; ++kb) {
                // A fragments of this warp's two m16 tiles for the two k16 steps of scale block kb
                uint32_t af[2][2][4];   // [mi][step][reg]
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {   // row g, row g + 8
                        const int row = warp * 32 + mi * 16 + g + 8 * hr;
                        const uint32_t wv = *reinterpret_cast<const uint32_t *>(Wst + row * k_m2_wld + kb * 16 + q * 4);
                        uint8_t sb;
                        if constexpr (FMT == 2) sb = Sst[row * k_m2_sld + kb];
                        else sb = Sst[row * k_m2_sld + 2 * kb + (q >> 1)];
                        uint32_t p[4];
                        fp4_a_pairs(wv, FMT == 2 ? e8m0_bf16x2(sb) : __float2bfloat162_rn(e4m3_g(sb)), p);
                        // step s: reg (hr) = columns 4s + {0,1} (logical 2q..), reg (2 + hr) = 4s + {2,3} (logical 8 + 2q..)
                        af[mi][0][hr] = p[0];
                        af[mi][0][2 + hr] = p[1];
                        af[mi][1][hr] = p[2];
                        af[mi][1][2 + hr] = p[3];
                    }
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (j < nj) {
                        const int tok = 8 * j + g;
                        const uint4 bh = *reinterpret_cast<const uint4 *>(Xh + tok * k_m2_hld + kb * 32 + q * 8);
#pragma unroll
                        for (int mi = 0; mi < 2; ++mi) {
                            mma_bf16(acc[mi][j], af[mi][0], bh.x, bh.y);
                            mma_bf16(acc[mi][j], af[mi][1], bh.z, bh.w);
                        }
                        if (xsplit) {
                            const uint4 bl = *reinterpret_cast<const uint4 *>(Xl + tok * k_m2_hld + kb * 32 + q * 8);
#pragma unroll
                            for (int mi = 0; mi < 2; ++mi) {
                                mma_bf16(acc[mi][j], af[mi][0], bl.x, bl.y);
                                mma_bf16(acc[mi][j], af[mi][1], bl.z, bl.w);
                            }
                        }
                    }
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();   // the pipeline's memory becomes the epilogue tile
        // Cs [token][row]: acc[mi][j] = rows warp*32 + mi*16 + g (+8), tokens 8j + 2q (+1)
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < nj) {
                    const int row = warp * 32 + mi * 16 + g, tok = 8 * j + 2 * q;
                    Cs[tok * k_m2_cld + row] = acc[mi][j][0];
                    Cs[(tok + 1) * k_m2_cld + row] = acc[mi][j][1];
                    Cs[tok * k_m2_cld + row + 8] = acc[mi][j][2];
                    Cs[(tok + 1) * k_m2_cld + row + 8] = acc[mi][j][3];
                }
            }
        __syncthreads();
        for (int i = tid; i < nt * BN; i += k_m2_threads) {
            const int t = i / BN, rr = i % BN;
            if (r0 + rr >= n_rows) continue;
            float v;
            if constexpr (NM == 2) {
                const float gt = Cs[t * k_m2_cld + rr] * gs0, up = Cs[t * k_m2_cld + BN + rr] * gs1;
                v = c.act == 1 ? situ_d(gt, up, c.situ_beta, c.situ_linear_beta) : silu_d(gt) * up;
            } else {
                v = Cs[t * k_m2_cld + rr] * gs0;
            }
            out[int64_t(slots[t0 + t]) * n_rows + r0 + rr] = v;
        }
        __syncthreads();   // Cs is the next pass's pipeline
    }
}

template <int FMT, int NM>
void launch_mma2(const float * xin, int64_t ldx, int64_t k_div, const dexpert * experts, int64_t A, int64_t S,
                 const int32_t * gw, const dexperts_cfg & c, int n_min, bool xsplit, float * out, cudaStream_t st) {
    smem_attr<k_moe_mma2<FMT, NM>>(k_m2_smem);   // above 48 KB of dynamic shared memory: once per device
    constexpr int BN = k_m2_rows / NM;
    const int64_t rows = NM == 2 ? c.d_ff : c.d_out;
    launch_k(k_moe_mma2<FMT, NM>, dim3(unsigned((rows + BN - 1) / BN), unsigned(A)), k_m2_threads, k_m2_smem, st,
        xin, ldx, k_div, experts, A, S, gw, c, n_min, xsplit, out);
}

// ---- v3 (cuda_options::moe_mma_v3): MXFP4 stages, y bit for bit v2's. Limiter model of v2 (session 6, k3-layers-4
// prefill T=2048: MOE_EXPERTS ~84 ms = 77 TFLOP/s of model FLOPs, ~154 TFLOP/s of mma work with the hi + lo split, a
// quarter of what mma.sync sustains): one block of 8 warps per SM (169 KB of pipeline: a stage holds 64 tokens' fp32
// activations, 32 KB, twice the raw weights), two barriers per K-tile, and every block converting its tokens' fp32
// activations to bf16 hi + lo once per tile (each of an expert's 24 gate/up row blocks repeats that work) while the tensor
// cores wait. v3:
//  - the activations are split into bf16 hi + lo planes once per stage, not once per (block, tile): gate/up reads x's
//    planes (k_split_planes, written into ybuf's memory, which the down stage overwrites only afterwards), down reads
//    h's planes, which the gate/up epilogue writes in place of fp32 h (into hbuf's memory). Same values as v2's in-kernel
//    split (hi = rn(v), lo = rn(v - hi)), so every mma sees v2's operands in v2's order: y is v2's bit for bit;
//  - K-tiles of 64 columns through a 3-stage cp.async pipeline with one barrier per tile; a stage is 24 KB (256 rows x
//    32 B of FP4, 64 tokens x 128 B of each plane), the block's E8M0 scales (256 rows x K / 32 B) are copied once at
//    the start, so a block takes ~100 KB and two blocks (16 warps) share an SM;
//  - shared layouts without bank conflicts: a weight row's two 16-byte halves swap for rows 4..7 mod 8 (the A-fragment
//    LDS.32 of 8 rows x 4 lanes), a token row's 16-byte chunks XOR 4 for odd tokens (the B-fragment LDS.128 of two
//    tokens x 4 lanes per quarter warp).
// The inner loop is v2's: each warp owns 32 rows (two m16 tiles), A fragments dequantized from one 32-bit word per row
// and scale block (E2M1 pairs x the E8M0 scale, exact in bf16), tokens 8 per mma (n side), hi then lo into the same fp32
// accumulators. NVFP4 keeps v2 (its scales are twice the bytes: two blocks would not fit an SM).
constexpr int k_m3_rows = 256, k_m3_kt = 64, k_m3_tok = 64, k_m3_threads = 256, k_m3_stages = 3;
constexpr int k_m3_wbytes = k_m3_rows * k_m3_kt / 2;   // raw FP4 of a stage
constexpr int k_m3_xbytes = k_m3_tok * k_m3_kt * 2;    // one bf16 plane of a stage
constexpr int k_m3_stage_bytes = k_m3_wbytes + 2 * k_m3_xbytes;
constexpr int k_m3_pipe_bytes = k_m3_stages * k_m3_stage_bytes;   // 72 KB
constexpr int k_m3_cld = k_m3_rows + 4;                           // floats per token row of the epilogue tile
static_assert(k_m3_tok * k_m3_cld * 4 <= k_m3_pipe_bytes, "v3: the epilogue tile lives in the pipeline's memory");
constexpr int64_t k_m3_max_smem = 113 * 1024;   // two blocks per SM (228 KB, 1 KB reserved per block)

constexpr int64_t m3_smem(int64_t K) { return k_m3_pipe_bytes + k_m3_rows * mma_scale_ld(K); }

// x [n] (fp32) -> bf16 hi [n], lo [n] with x = hi + lo to ~16 mantissa bits (lo = 0 when !xsplit). n % 4 == 0.
__global__ void k_split_planes(const float * __restrict__ x, int64_t n, bool xsplit, __nv_bfloat16 * __restrict__ hi,
                               __nv_bfloat16 * __restrict__ lo) {
    pdl_enter();
    for (int64_t i = 4 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x); i < n; i += 4 * int64_t(gridDim.x) * blockDim.x) {
        __nv_bfloat162 h[2], l[2];
        split_hi_lo(*reinterpret_cast<const float4 *>(x + i), xsplit, h, l);
        *reinterpret_cast<__nv_bfloat162 *>(hi + i) = h[0];
        *reinterpret_cast<__nv_bfloat162 *>(hi + i + 2) = h[1];
        *reinterpret_cast<__nv_bfloat162 *>(lo + i) = l[0];
        *reinterpret_cast<__nv_bfloat162 *>(lo + i + 2) = l[1];
    }
}

// NM == 2: gate/up; xh / xl = x's planes [T, ldx], token row = slot / k_div; writes h's planes oh / ol [S, d_ff] (GLU
// applied, split as v2's down stage splits it). NM == 1: down; xh / xl = h's planes [S, ldx], token row = slot; writes
// of32 = ybuf [S, d_out]. grid (ceil(rows / (256 / NM)), A); dynamic smem m3_smem(K).
template <int NM>
__global__ void __launch_bounds__(k_m3_threads, 2)
    k_moe_mma3(const __nv_bfloat16 * __restrict__ xh, const __nv_bfloat16 * __restrict__ xl, int64_t ldx, int64_t k_div,
               const dexpert * __restrict__ ex, int64_t A, int64_t S, const int32_t * __restrict__ gw, dexperts_cfg c,
               int n_min, bool xsplit, __nv_bfloat16 * __restrict__ oh, __nv_bfloat16 * __restrict__ ol,
               float * __restrict__ of32) {
    pdl_enter();
    extern __shared__ __align__(128) unsigned char sm3[];
    const int a = blockIdx.y;
    if (a >= gw[0]) return;
    const int n = gw[2 + 2 * A + S + a];
    if (n < n_min) return;
    const int e = gw[1 + a];
    const int32_t * slots = gw + 2 + 2 * A + gw[1 + A + a];
    constexpr int BN = k_m3_rows / NM;   // output rows per block
    const int64_t n_rows = NM == 2 ? c.d_ff : c.d_out;
    const int64_t r0 = int64_t(blockIdx.x) * BN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const dexpert_matrix m0 = NM == 2 ? ex[e].gate : ex[e].down;
    const dexpert_matrix m1 = NM == 2 ? ex[e].up : m0;
    const int64_t K = m0.in, ksc = K / 32, sld = mma_scale_ld(K);
    const int nk = int(K / k_m3_kt);
    unsigned char * Ssm = sm3 + k_m3_pipe_bytes;   // [256][sld]: the block's E8M0 scales, all of K
    float * Cs = reinterpret_cast<float *>(sm3);   // [64][k_m3_cld]: the epilogue tile, after the K loop

    // this thread's weight copies: 2 of the stage's 512 16-byte halves (row ch / 2, half ch % 2)
    const uint8_t * wsrc[2];
    int wdst[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int ch = tid + i * k_m3_threads, row = ch >> 1, half = ch & 1;
        const int64_t wr = r0 + (NM == 2 ? row % BN : row);
        const uint8_t * pk = (NM == 2 && row >= BN) ? m1.packed : m0.packed;
        wsrc[i] = wr < n_rows ? pk + wr * (K / 2) + half * 16 : nullptr;
        wdst[i] = row * 32 + ((half ^ ((row >> 2) & 1)) << 4);
    }
    // the scales of every row of the block, once (with the first stage's group)
    mma_copy_scales<k_m3_rows, NM, k_m3_threads>(Ssm, sld, m0, m1, r0, n_rows, ksc, tid);

    __shared__ int64_t xoff[k_m3_tok];
    for (int t0 = 0; t0 < n; t0 += k_m3_tok) {
        const int nt = min(k_m3_tok, n - t0);   // tokens of this pass
        const int nj = (nt + 7) >> 3;            // 8-token mma tiles
        if (tid < nt) xoff[tid] = int64_t(slots[t0 + tid] / k_div) * ldx;
        __syncthreads();
        // stage st <- K-tile kt: raw weights, and the pass's tokens' hi (and lo) chunks
        auto issue = [&](int kt, int st) {
            unsigned char * W = sm3 + st * k_m3_stage_bytes;
            unsigned char * X = W + k_m3_wbytes;
            const int64_t k0 = int64_t(kt) * k_m3_kt;
#pragma unroll
            for (int i = 0; i < 2; ++i)
                if (wsrc[i]) cp_async16(W + wdst[i], wsrc[i] + k0 / 2);
            const int nch = nt * 8 * (xsplit ? 2 : 1);
            for (int ch = tid; ch < nch; ch += k_m3_threads) {
                const int p = ch / (nt * 8), r = ch % (nt * 8), t = r >> 3, cc = r & 7;
                const __nv_bfloat16 * src = (p ? xl : xh) + xoff[t] + k0 + cc * 8;
                cp_async16(X + p * k_m3_xbytes + t * 128 + ((cc ^ ((t & 1) << 2)) << 4), src);
            }
        };

        float acc[2][8][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[mi][j][r] = 0.0f;

#pragma unroll
        for (int s = 0; s < k_m3_stages - 1; ++s) {
            if (s < nk) issue(s, s);
            cp_async_commit();
        }
        for (int kt = 0; kt < nk; ++kt) {
            cp_async_wait<k_m3_stages - 2>();
            __syncthreads();   // stage kt (and the scales) landed for every thread; every warp is done with tile kt - 1
            if (kt + k_m3_stages - 1 < nk) issue(kt + k_m3_stages - 1, (kt + k_m3_stages - 1) % k_m3_stages);
            cp_async_commit();
            const unsigned char * W = sm3 + (kt % k_m3_stages) * k_m3_stage_bytes;
            const unsigned char * Xh = W + k_m3_wbytes;
            const unsigned char * Xl = Xh + k_m3_xbytes;
#pragma unroll
            for (int kb = 0; kb < k_m3_kt / 32; ++kb) {
                // A fragments of this warp's two m16 tiles for the two k16 steps of scale block kt * 2 + kb (v2's)
                uint32_t af[2][2][4];   // [mi][step][reg]
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {   // row g, row g + 8
                        const int row = warp * 32 + mi * 16 + g + 8 * hr;
                        const uint32_t wv = *reinterpret_cast<const uint32_t *>(W + row * 32 + ((kb ^ ((row >> 2) & 1)) << 4) + q * 4);
                        uint32_t p[4];
                        fp4_a_pairs(wv, e8m0_bf16x2(Ssm[row * sld + kt * 2 + kb]), p);
                        af[mi][0][hr] = p[0];
                        af[mi][0][2 + hr] = p[1];
                        af[mi][1][hr] = p[2];
                        af[mi][1][2 + hr] = p[3];
                    }
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (j < nj) {
                        const int tok = 8 * j + g, cc = kb * 4 + q;
                        const int off = tok * 128 + ((cc ^ ((tok & 1) << 2)) << 4);
                        const uint4 bh = *reinterpret_cast<const uint4 *>(Xh + off);
#pragma unroll
                        for (int mi = 0; mi < 2; ++mi) {
                            mma_bf16(acc[mi][j], af[mi][0], bh.x, bh.y);
                            mma_bf16(acc[mi][j], af[mi][1], bh.z, bh.w);
                        }
                        if (xsplit) {
                            const uint4 bl = *reinterpret_cast<const uint4 *>(Xl + off);
#pragma unroll
                            for (int mi = 0; mi < 2; ++mi) {
                                mma_bf16(acc[mi][j], af[mi][0], bl.x, bl.y);
                                mma_bf16(acc[mi][j], af[mi][1], bl.z, bl.w);
                            }
                        }
                    }
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();   // the pipeline's memory becomes the epilogue tile
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < nj) {
                    const int row = warp * 32 + mi * 16 + g, tok = 8 * j + 2 * q;
                    Cs[tok * k_m3_cld + row] = acc[mi][j][0];
                    Cs[(tok + 1) * k_m3_cld + row] = acc[mi][j][1];
                    Cs[tok * k_m3_cld + row + 8] = acc[mi][j][2];
                    Cs[(tok + 1) * k_m3_cld + row + 8] = acc[mi][j][3];
                }
            }
        __syncthreads();
        for (int i = tid; i < nt * BN; i += k_m3_threads) {
            const int t = i / BN, rr = i % BN;
            if (r0 + rr >= n_rows) continue;
            const int64_t o = int64_t(slots[t0 + t]) * n_rows + r0 + rr;
            if constexpr (NM == 2) {
                const float gt = Cs[t * k_m3_cld + rr], up = Cs[t * k_m3_cld + BN + rr];
                const float v = c.act == 1 ? situ_d(gt, up, c.situ_beta, c.situ_linear_beta) : silu_d(gt) * up;
                const __nv_bfloat16 h = __float2bfloat16_rn(v);
                oh[o] = h;
                ol[o] = __float2bfloat16_rn(xsplit ? v - __bfloat162float(h) : 0.0f);
            } else {
                of32[o] = Cs[t * k_m3_cld + rr];
            }
        }
        __syncthreads();   // Cs is the next pass's pipeline; xoff is rewritten
    }
}

// v3's bounds: MXFP4 (vfmt 2), K of both stages a multiple of 512 (whole 64-column tiles, 16-byte scale copies), x's
// planes fit in ybuf (Din <= k d_out), the block's shared memory within two blocks per SM.
bool mma3_supported(int vfmt, int64_t Din, int64_t k, const dexperts_cfg & c) {
    return vfmt == 2 && Din % 512 == 0 && c.d_ff % 512 == 0 && Din <= k * c.d_out && m3_smem(Din) <= k_m3_max_smem &&
           m3_smem(c.d_ff) <= k_m3_max_smem;
}

// v3's traits for mma_stages (moe-mma-blocks.cuh).
struct mma3_traits {
    template <int NM> static constexpr auto kern = k_moe_mma3<NM>;
    static constexpr auto split = k_split_planes;
    static constexpr int rows = k_m3_rows, threads = k_m3_threads;
    static constexpr int64_t max_smem = k_m3_max_smem;
    static constexpr int64_t smem(int64_t K) { return m3_smem(K); }
};

cudaError_t launch_mma3_stages(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                               const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st,
                               int n_min, bool xsplit) {
    return mma_stages<mma3_traits>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, xsplit);
}

} // namespace

namespace {
std::atomic<int64_t> g_mma_launches[3];   // v3, v4, v4 MXFP4 in the shift form
} // namespace

int64_t moe_mma_launches(int v) { return v == 3 || v == 4 ? g_mma_launches[v - 3].load(std::memory_order_relaxed) : 0; }
int64_t moe_mma4_shift_launches() { return g_mma_launches[2].load(std::memory_order_relaxed); }

void launch_moe_mma_stages(int vfmt, const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                           const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st,
                           int n_min, const dmoe_opts & o) {
    // v4 / v3: both stages (x's and h's planes pass between them), in prefill-sized steps (T >= mma_large_step when that
    // is set): in a decode batch almost no expert reaches the threshold, and there v4 measured slower than v2 (session
    // 7 call H: k3-layers-4 B=64 step 83.25 vs 82.39 ms). A failed launch stays in cudaGetLastError.
    const bool large = o.mma_large_step <= 0 || S / k >= o.mma_large_step;
    if (large && o.mma_v4 && (vfmt != 1 || o.mma_v4_bf16) && moe_mma4_supported(vfmt, Din, k, c)) {
        if (launch_moe_mma4_stages(vfmt, x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split, o.mma_v4_shift) ==
            cudaSuccess) {
            g_mma_launches[1].fetch_add(1, std::memory_order_relaxed);
            if (vfmt == 2 && o.mma_v4_shift) g_mma_launches[2].fetch_add(1, std::memory_order_relaxed);
        }
        return;
    }
    if (large && o.mma_v3 && mma3_supported(vfmt, Din, k, c)) {
        if (launch_mma3_stages(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split) == cudaSuccess)
            g_mma_launches[0].fetch_add(1, std::memory_order_relaxed);
        return;
    }
    // v2: FP4 stages whose K is a multiple of its 128-column tile (gate/up K = Din, down K = d_ff); the others v1.
    const bool v2 = o.mma_v2 && (vfmt == 2 || vfmt == 3);
    const bool v2_gu = v2 && Din % k_m2_kt == 0, v2_dn = v2 && c.d_ff % k_m2_kt == 0;
    if (v2_gu || v2_dn) {
        if (vfmt == 2) {
            if (v2_gu) launch_mma2<2, 2>(x, Din, k, experts, A, S, gw, c, n_min, o.mma_split, hbuf, st);
            else launch_k(k_moe_mma<2, 2>, dim3(unsigned((c.d_ff + k_mm_rows / 2 - 1) / (k_mm_rows / 2)), unsigned(A)), k_mm_threads, 0, st,
                x, Din, k, experts, A, S, gw, c, n_min, o.mma_split, hbuf);
            if (v2_dn) launch_mma2<2, 1>(hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, o.mma_split, ybuf, st);
            else launch_k(k_moe_mma<2, 1>, dim3(unsigned((c.d_out + k_mm_rows - 1) / k_mm_rows), unsigned(A)), k_mm_threads, 0, st,
                hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, o.mma_split, ybuf);
        } else {
            if (v2_gu) launch_mma2<3, 2>(x, Din, k, experts, A, S, gw, c, n_min, o.mma_split, hbuf, st);
            else launch_k(k_moe_mma<3, 2>, dim3(unsigned((c.d_ff + k_mm_rows / 2 - 1) / (k_mm_rows / 2)), unsigned(A)), k_mm_threads, 0, st,
                x, Din, k, experts, A, S, gw, c, n_min, o.mma_split, hbuf);
            if (v2_dn) launch_mma2<3, 1>(hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, o.mma_split, ybuf, st);
            else launch_k(k_moe_mma<3, 1>, dim3(unsigned((c.d_out + k_mm_rows - 1) / k_mm_rows), unsigned(A)), k_mm_threads, 0, st,
                hbuf, c.d_ff, 1, experts, A, S, gw, c, n_min, o.mma_split, ybuf);
        }
        return;
    }
    if (vfmt == 1) launch_mma_stages<1>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
    else if (vfmt == 2) launch_mma_stages<2>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
    else launch_mma_stages<3>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, o.mma_split);
}

} // namespace perigee::cuda

