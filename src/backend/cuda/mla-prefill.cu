// MLA_ATTN prefill in the CPU reference's expanded form (cuda_options::mla_prefill_tokens; prefill-ops.h): the cached
// latent rows of every position are gathered, expanded to per-head k_nope / v by one cuBLASLt GEMM (the backend), and a
// causal flash-attention kernel runs per (64-token query tile, head): fp32 SIMT tiles in shared memory, online softmax,
// fp32 accumulation. The absorbed-form kernels in mla.cu stay for decode, selections and compare mode.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"
#include "backend/cuda/mma-sync.cuh"
#include "backend/cuda/prefill-ops.h"

namespace perigee::cuda {

namespace {

constexpr int k_bq = 64, k_bk = 64, k_threads = 256;
constexpr int k_ld = 68;   // row stride of the transposed Q / K tiles: float4-aligned, transposing stores ~2-way

__device__ __forceinline__ int64_t page_row(const dbatch & b, int s, int64_t pos) {
    const int32_t page = b.block_table[int64_t(s) * b.max_pages + pos / b.page_size];
    return int64_t(page) * b.page_size + pos % b.page_size;
}

__global__ void k_prefill_cache_write(const float * __restrict__ c, const float * __restrict__ kr, int64_t L, int64_t dr,
                                      float * __restrict__ cache, dbatch b) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    float * row = cache + page_row(b, s, pos) * (L + dr);
    for (int64_t i = threadIdx.x; i < L + dr; i += blockDim.x) row[i] = i < L ? c[t * L + i] : kr[t * dr + i - L];
}

// Row r of the packed positions: sequence s (rows from sum_{s'<s} (pos0 + len)), position p.
__global__ void k_prefill_gather(const float * __restrict__ cache, int64_t L, int64_t dr, dbatch b, float * __restrict__ cg,
                                 float * __restrict__ krg) {
    pdl_enter();
    const int64_t r = blockIdx.x;
    int64_t off = 0;
    int s = 0;
    for (; s < b.n_seq; ++s) {
        const int64_t n = b.pos0[s] + b.seq_start[s + 1] - b.seq_start[s];
        if (r < off + n) break;
        off += n;
    }
    if (s == b.n_seq) return;
    const float * row = cache + page_row(b, s, r - off) * (L + dr);
    for (int64_t i = threadIdx.x; i < L + dr; i += blockDim.x) {
        if (i < L) cg[r * L + i] = row[i];
        else krg[r * dr + i - L] = row[i];
    }
}

// Block per (query tile of one sequence, head); thread (ty, tx) of 16 x 16 owns score rows ty*4.. +4, columns tx*4.. +4
// and output rows ty*4.. +4, columns 64 k + tx*4.. +4 (k < VPT / 4). Shared: Qt [dqk][k_ld], Kt [dqk][k_ld] (transposed),
// V [k_bk][16 VPT], P [k_bq][k_ld].
template <int VPT>
__global__ void __launch_bounds__(k_threads) k_mla_prefill_attn(const float * __restrict__ q, const float * __restrict__ kv,
                                                                const float * __restrict__ krg, int H, int dn, int dr, int dv,
                                                                float scale, dbatch b, float * __restrict__ o) {
    pdl_enter();
    constexpr int DVP = 16 * VPT;
    const int dqk = dn + dr, h = blockIdx.y;
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    // The tile: sequences in order, within one the last (heaviest) tile first.
    int tile = blockIdx.x, s = 0;
    int64_t koff = 0;
    for (; s < b.n_seq; ++s) {
        const int len = b.seq_start[s + 1] - b.seq_start[s], nt = (len + k_bq - 1) / k_bq;
        if (tile < nt) {
            tile = nt - 1 - tile;
            break;
        }
        tile -= nt;
        koff += b.pos0[s] + len;
    }
    if (s == b.n_seq) return;
    const int len = b.seq_start[s + 1] - b.seq_start[s];
    const int64_t t0 = b.seq_start[s] + int64_t(tile) * k_bq;
    const int nq = min(k_bq, len - tile * k_bq);
    const int64_t qpos0 = b.pos0[s] + int64_t(tile) * k_bq, last = qpos0 + nq - 1;

    extern __shared__ __align__(16) float sm[];
    float * Qt = sm;
    float * Kt = Qt + dqk * k_ld;
    float * Vs = Kt + dqk * k_ld;
    float * Ps = Vs + k_bk * DVP;
    const int64_t kvw = int64_t(H) * (dn + dv);
    const int d4n = dqk / 4;
    // Q, transposed: lanes take 8 rows x 4 float4 (full 32-byte sectors), stores ~2-way.
    for (int idx = tid; idx < k_bq * d4n; idx += k_threads) {
        const int jl = idx & 7, d4 = (idx >> 3) % d4n, r = (idx >> 3) / d4n * 8 + jl;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nq) v = *reinterpret_cast<const float4 *>(q + ((t0 + r) * H + h) * dqk + 4 * d4);
        Qt[(4 * d4 + 0) * k_ld + r] = v.x;
        Qt[(4 * d4 + 1) * k_ld + r] = v.y;
        Qt[(4 * d4 + 2) * k_ld + r] = v.z;
        Qt[(4 * d4 + 3) * k_ld + r] = v.w;
    }
    for (int idx = tid; idx < k_bk * DVP; idx += k_threads) Vs[idx] = 0.0f;   // columns >= dv stay 0

    float m[4], l[4], acc[4][VPT];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int v = 0; v < VPT; ++v) acc[i][v] = 0.0f;
    }
    const int v4n = dv / 4;
    for (int64_t k0 = 0; k0 <= last; k0 += k_bk) {
        const int nk = int(min(int64_t(k_bk), last + 1 - k0));
        __syncthreads();   // the previous tile's K / V / P reads are done (and Q, V zeroing on the first)
        for (int idx = tid; idx < k_bk * d4n; idx += k_threads) {
            const int jl = idx & 7, d4 = (idx >> 3) % d4n, j = (idx >> 3) / d4n * 8 + jl;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j < nk) {
                const int64_t row = koff + k0 + j;
                const int d = 4 * d4;
                v = d < dn ? *reinterpret_cast<const float4 *>(kv + row * kvw + int64_t(h) * (dn + dv) + d)
                           : *reinterpret_cast<const float4 *>(krg + row * dr + d - dn);
            }
            Kt[(4 * d4 + 0) * k_ld + j] = v.x;
            Kt[(4 * d4 + 1) * k_ld + j] = v.y;
            Kt[(4 * d4 + 2) * k_ld + j] = v.z;
            Kt[(4 * d4 + 3) * k_ld + j] = v.w;
        }
        for (int idx = tid; idx < k_bk * v4n; idx += k_threads) {
            const int v4 = idx % v4n, j = idx / v4n;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j < nk) v = *reinterpret_cast<const float4 *>(kv + (koff + k0 + j) * kvw + int64_t(h) * (dn + dv) + dn + 4 * v4);
            *reinterpret_cast<float4 *>(Vs + j * DVP + 4 * v4) = v;
        }
        __syncthreads();
        float sc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) sc[i][j] = 0.0f;
        for (int d = 0; d < dqk; ++d) {
            const float4 a = *reinterpret_cast<const float4 *>(Qt + d * k_ld + ty * 4);
            const float4 kk = *reinterpret_cast<const float4 *>(Kt + d * k_ld + tx * 4);
            const float av[4] = {a.x, a.y, a.z, a.w}, kv4[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) sc[i][j] = fmaf(av[i], kv4[j], sc[i][j]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int64_t qp = qpos0 + ty * 4 + i;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int64_t kp = k0 + tx * 4 + j;
                sc[i][j] = kp <= qp && ty * 4 + i < nq ? sc[i][j] * scale : -INFINITY;
                mx = fmaxf(mx, sc[i][j]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mn = fmaxf(m[i], mx);
            float corr = 1.0f, rs = 0.0f;
            if (mn != -INFINITY) {
                corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - mn);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    sc[i][j] = sc[i][j] == -INFINITY ? 0.0f : expf(sc[i][j] - mn);
                    rs += sc[i][j];
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) sc[i][j] = 0.0f;
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, off);
            l[i] = l[i] * corr + rs;
            m[i] = mn;
#pragma unroll
            for (int v = 0; v < VPT; ++v) acc[i][v] *= corr;
            *reinterpret_cast<float4 *>(Ps + (ty * 4 + i) * k_ld + tx * 4) = make_float4(sc[i][0], sc[i][1], sc[i][2], sc[i][3]);
        }
        __syncthreads();
        for (int c = 0; c < nk; ++c) {
            float pv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pv[i] = Ps[(ty * 4 + i) * k_ld + c];
#pragma unroll
            for (int k = 0; k < VPT / 4; ++k) {
                const float4 vv = *reinterpret_cast<const float4 *>(Vs + c * DVP + 64 * k + tx * 4);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[i][4 * k + 0] = fmaf(pv[i], vv.x, acc[i][4 * k + 0]);
                    acc[i][4 * k + 1] = fmaf(pv[i], vv.y, acc[i][4 * k + 1]);
                    acc[i][4 * k + 2] = fmaf(pv[i], vv.z, acc[i][4 * k + 2]);
                    acc[i][4 * k + 3] = fmaf(pv[i], vv.w, acc[i][4 * k + 3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i;
        if (r >= nq) continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        float * orow = o + ((t0 + r) * H + h) * dv;
#pragma unroll
        for (int k = 0; k < VPT / 4; ++k)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 64 * k + tx * 4 + e;
                if (col < dv) orow[col] = acc[i][4 * k + e] * inv;
            }
    }
}

// ---- The tensor-core form (cuda_options::mla_prefill_mma) ----
// The same causal flash attention on mma.sync m16n8k16. Block per (64-token query tile, head) as above, 4 warps, warp w
// owning query rows 16 w .. 16 w + 15. Every operand is split into bf16 hi + lo (~16 significant bits) and each product is
// hi.hi + hi.lo + lo.hi with fp32 accumulation: the dropped lo.lo term and the roundings are ~2^-16 relative per product,
// the accuracy of the backend's split GEMMs (NMSE vs the fp32 CPU ~1e-10), where one bf16 pass would be ~2^-9. The row
// max, exp, row sums and the final division are fp32 as in the SIMT kernel.
// K and V arrive split already (the backend splits the expanded kv and krg once per step: every query tile of a head
// reads the same keys), so a 64-key tile is copied into shared memory by cp.async (K's copies in one group, V's in the
// next: S = Q K^T starts while V lands) and read by ldmatrix (K as the B operand of S, V transposed as the B operand of
// O += P V). Q's fragments (hi and lo, split from fp32 once per block) stay in registers for the whole key loop; P's A
// fragments are S's accumulators re-packed (the C layout of two n8 tiles is the A layout of one k16 step). Groups of 16
// keys past the warp's last query position are skipped (exact: their probabilities are 0). Shapes: dn, dr, dv multiples
// of 8, dn + dr <= 192, dv <= 128 (padded with zeros to multiples of 16).
constexpr int k_mq = 64, k_mk = 64, k_mthreads = 128;
constexpr int k_mks = 12, k_mnv = 8;               // most k16 steps of q.k (dn + dr <= 192), 16-column groups of v
constexpr int k_mkld = 16 * k_mks + 8;             // bf16 per K (and Q) row in shared memory: 400 bytes, so the 8 rows
constexpr int k_mvld = 16 * k_mnv + 8;             // of an ldmatrix land on distinct 16-byte bank groups; V: 272 bytes
constexpr size_t k_msmem = size_t(2 * k_mk * k_mkld + 2 * k_mk * k_mvld) * 2;   // Kh, Kl, Vh, Vl (Q staged in Kh, Kl)

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}
// (a, b) -> hi pair and lo pair (the residuals), as split_hi_lo.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t & h, uint32_t & l) {
    const __nv_bfloat162 hv = __floats2bfloat162_rn(a, b);
    const float2 f = __bfloat1622float2(hv);
    h = *reinterpret_cast<const uint32_t *>(&hv);
    l = pack_bf16(a - f.x, b - f.y);
}

// One 64-row tile of a split plane pair into shared memory (hi / lo rows of stride ld bf16), 8 columns (16 bytes) per
// copy, w16 columns: for row j < n, columns c < w0 come from hi0 + j * ld0 + c, columns w0 <= c < w1 from hi1 + j * ld1 +
// c - w0 (the lo planes at the same offsets from lo0 / lo1), columns >= w1 and rows >= n are zeros. The (row, column)
// of a thread's copies advance by 128 copies each step without a division (the per-copy index math was most of the
// staging's instructions in the first form: Nsight Compute, session 13 call B).
__device__ __forceinline__ void stage_tile(__nv_bfloat16 * hi, __nv_bfloat16 * lo, int ld, int n, int w16,
                                           const __nv_bfloat16 * hi0, const __nv_bfloat16 * lo0, int64_t ld0, int w0,
                                           const __nv_bfloat16 * hi1, const __nv_bfloat16 * lo1, int64_t ld1, int w1) {
    const int c8n = w16 / 8, step_j = k_mthreads / c8n, step_c = k_mthreads % c8n;
    int j = threadIdx.x / c8n, c = 8 * (threadIdx.x % c8n);
    for (; j < k_mk; j += step_j) {
        __nv_bfloat16 * dh = hi + j * ld + c;
        __nv_bfloat16 * dl = lo + j * ld + c;
        if (j < n && c < w0) {
            cp_async16(dh, hi0 + j * ld0 + c);
            cp_async16(dl, lo0 + j * ld0 + c);
        } else if (j < n && c < w1) {
            cp_async16(dh, hi1 + j * ld1 + (c - w0));
            cp_async16(dl, lo1 + j * ld1 + (c - w0));
        } else {
            *reinterpret_cast<uint4 *>(dh) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(dl) = make_uint4(0u, 0u, 0u, 0u);
        }
        c += 8 * step_c;
        if (c >= w16) {
            c -= w16;
            ++j;
        }
    }
}

// kvh / kvl [P, H * (dn + dv)]: the expanded kv split; krh / krl [P, dr]: the gathered k_rope split.
__global__ void __launch_bounds__(k_mthreads, 2)
    k_mla_prefill_mma(const float * __restrict__ q, const __nv_bfloat16 * __restrict__ kvh, const __nv_bfloat16 * __restrict__ kvl,
                      const __nv_bfloat16 * __restrict__ krh, const __nv_bfloat16 * __restrict__ krl, int H, int dn, int dr,
                      int dv, float scale, dbatch b, float * __restrict__ o) {
    pdl_enter();
    const int dqk = dn + dr, h = blockIdx.y;
    const int ks_n = (dqk + 15) / 16, nv_n = (dv + 15) / 16;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, qd = lane & 3;
    int tile = blockIdx.x, s = 0;   // sequences in order, within one the last (heaviest) tile first
    int64_t koff = 0;
    for (; s < b.n_seq; ++s) {
        const int len = b.seq_start[s + 1] - b.seq_start[s], nt = (len + k_mq - 1) / k_mq;
        if (tile < nt) {
            tile = nt - 1 - tile;
            break;
        }
        tile -= nt;
        koff += b.pos0[s] + len;
    }
    if (s == b.n_seq) return;
    const int len = b.seq_start[s + 1] - b.seq_start[s];
    const int64_t t0 = b.seq_start[s] + int64_t(tile) * k_mq;
    const int nq = min(k_mq, len - tile * k_mq);
    const int64_t qpos0 = b.pos0[s] + int64_t(tile) * k_mq, last = qpos0 + nq - 1;
    const int64_t wlast = min(last, qpos0 + 16 * warp + 15);   // the warp's last query position

    extern __shared__ __align__(16) unsigned char smm[];
    auto * Kh = reinterpret_cast<__nv_bfloat16 *>(smm);
    auto * Kl = Kh + k_mk * k_mkld;
    auto * Vh = Kl + k_mk * k_mkld;
    auto * Vl = Vh + k_mk * k_mvld;
    const int64_t kvw = int64_t(H) * (dn + dv);

    // Q, split, through the K buffers, then its fragments: qh / ql [k16 step][A register]
    for (int idx = tid; idx < k_mq * 4 * ks_n; idx += k_mthreads) {
        const int j = idx / (4 * ks_n), c = 4 * (idx % (4 * ks_n));
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < nq && c < dqk) v = *reinterpret_cast<const float4 *>(q + ((t0 + j) * H + h) * dqk + c);
        __nv_bfloat162 hv[2], lv[2];
        split_hi_lo(v, true, hv, lv);
        *reinterpret_cast<__nv_bfloat162 *>(Kh + j * k_mkld + c) = hv[0];
        *reinterpret_cast<__nv_bfloat162 *>(Kh + j * k_mkld + c + 2) = hv[1];
        *reinterpret_cast<__nv_bfloat162 *>(Kl + j * k_mkld + c) = lv[0];
        *reinterpret_cast<__nv_bfloat162 *>(Kl + j * k_mkld + c + 2) = lv[1];
    }
    __syncthreads();
    uint32_t qh[k_mks][4], ql[k_mks][4];
    {
        const int mi = lane >> 3, row = 16 * warp + (mi & 1) * 8 + (lane & 7), col = (mi >> 1) * 8;
#pragma unroll
        for (int ks = 0; ks < k_mks; ++ks)
            if (ks < ks_n) {
                ldmatrix_x4(qh[ks], Kh + row * k_mkld + 16 * ks + col);
                ldmatrix_x4(ql[ks], Kl + row * k_mkld + 16 * ks + col);
            }
    }

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[2 * k_mnv][4];
#pragma unroll
    for (int i = 0; i < 2 * k_mnv; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
    const int64_t qp[2] = {qpos0 + 16 * warp + g, qpos0 + 16 * warp + g + 8};
    const bool qok[2] = {16 * warp + g < nq, 16 * warp + g + 8 < nq};   // rows past the tile's end: masked out

    for (int64_t k0 = 0; k0 <= last; k0 += k_mk) {
        const int nk = int(min(int64_t(k_mk), last + 1 - k0));
        __syncthreads();   // every warp is done with the previous tile (and with Q's staging on the first)
        const int64_t r0 = koff + k0;   // the tile's first gathered row
        const int64_t hoff = int64_t(h) * (dn + dv);
        stage_tile(Kh, Kl, k_mkld, nk, 16 * ks_n, kvh + r0 * kvw + hoff, kvl + r0 * kvw + hoff, kvw, dn, krh + r0 * dr,
                   krl + r0 * dr, dr, dqk);
        cp_async_commit();
        stage_tile(Vh, Vl, k_mvld, nk, 16 * nv_n, kvh + r0 * kvw + hoff + dn, kvl + r0 * kvw + hoff + dn, kvw, dv, kvh, kvl,
                   0, dv);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();   // K landed for every thread

        // S = Q K^T for the tile's 4 groups of 16 keys (n8 tiles 2 kg, 2 kg + 1). The k16 steps outermost, so that the
        // 8 accumulators' MMAs can interleave (the first form, k-steps innermost, made each pair of n8 tiles one chain of
        // 36 dependent MMAs; measured the same within 1%, session 13 calls A / B). Tried and removed (call D): the three
        // products as three passes over the key groups (8 independent MMAs in a row, K's hi fragments read twice): 44%
        // more instructions, k3-layers-4 T=2048 MLA_ATTN 3.76 -> 5.45 ms.
        float sc[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[i][e] = 0.0f;
        {
            const int mi = lane >> 3, krow_l = (mi >> 1) * 8 + (lane & 7), col = (mi & 1) * 8;
#pragma unroll
            for (int ks = 0; ks < k_mks; ++ks) {
                if (ks >= ks_n) continue;
#pragma unroll
                for (int kg = 0; kg < 4; ++kg) {
                    if (k0 + 16 * kg > wlast) continue;
                    uint32_t bh[4], bl[4];
                    ldmatrix_x4(bh, Kh + (16 * kg + krow_l) * k_mkld + 16 * ks + col);
                    ldmatrix_x4(bl, Kl + (16 * kg + krow_l) * k_mkld + 16 * ks + col);
                    mma_bf16(sc[2 * kg], qh[ks], bh[0], bh[1]);
                    mma_bf16(sc[2 * kg], qh[ks], bl[0], bl[1]);
                    mma_bf16(sc[2 * kg], ql[ks], bh[0], bh[1]);
                    mma_bf16(sc[2 * kg + 1], qh[ks], bh[2], bh[3]);
                    mma_bf16(sc[2 * kg + 1], qh[ks], bl[2], bl[3]);
                    mma_bf16(sc[2 * kg + 1], ql[ks], bh[2], bh[3]);
                }
            }
        }
        // scale, causal mask, online softmax (rows g and g + 8; a row's 64 keys are spread over its quad). The mask only
        // where the tile reaches past the warp's first query position or the warp has rows past the tile's end.
        const bool masked = k0 + k_mk - 1 > qpos0 + 16 * warp || 16 * warp + 15 >= nq;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = -INFINITY;
            const int rel = qok[hr] ? int(min(qp[hr] - k0, int64_t(k_mk))) : -1;   // the row's last key in the tile
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float & v = sc[nt][2 * hr + e];
                    v = !masked || 8 * nt + 2 * qd + e <= rel ? v * scale : -INFINITY;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[hr], mx);
            float corr = 1.0f, rs = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float & v = sc[nt][2 * hr + e];
                    v = mn == -INFINITY ? 0.0f : expf(v - mn);   // expf(-inf) = 0 for the masked keys
                    rs += v;
                }
            if (mn != -INFINITY) corr = m[hr] == -INFINITY ? 0.0f : expf(m[hr] - mn);
            l[hr] = l[hr] * corr + rs;   // this thread's part of the row sum (the quad's parts are added at the end)
            m[hr] = mn;
#pragma unroll
            for (int i = 0; i < 2 * k_mnv; ++i) {
                acc[i][2 * hr] *= corr;
                acc[i][2 * hr + 1] *= corr;
            }
        }
        cp_async_wait<0>();
        __syncthreads();   // V landed for every thread
        // O += P V, one k16 step per group of 16 keys
        {
            const int mi = lane >> 3, vrow_l = (mi & 1) * 8 + (lane & 7), col = (mi >> 1) * 8;
#pragma unroll
            for (int kg = 0; kg < 4; ++kg) {
                if (k0 + 16 * kg > wlast) continue;
                uint32_t ah[4], al[4];
                split_pair(sc[2 * kg][0], sc[2 * kg][1], ah[0], al[0]);
                split_pair(sc[2 * kg][2], sc[2 * kg][3], ah[1], al[1]);
                split_pair(sc[2 * kg + 1][0], sc[2 * kg + 1][1], ah[2], al[2]);
                split_pair(sc[2 * kg + 1][2], sc[2 * kg + 1][3], ah[3], al[3]);
#pragma unroll
                for (int vg = 0; vg < k_mnv; ++vg) {
                    if (vg >= nv_n) continue;
                    uint32_t bh[4], bl[4];
                    ldmatrix_x4_trans(bh, Vh + (16 * kg + vrow_l) * k_mvld + 16 * vg + col);
                    ldmatrix_x4_trans(bl, Vl + (16 * kg + vrow_l) * k_mvld + 16 * vg + col);
                    mma_bf16(acc[2 * vg], ah, bh[0], bh[1]);
                    mma_bf16(acc[2 * vg], ah, bl[0], bl[1]);
                    mma_bf16(acc[2 * vg], al, bh[0], bh[1]);
                    mma_bf16(acc[2 * vg + 1], ah, bh[2], bh[3]);
                    mma_bf16(acc[2 * vg + 1], ah, bl[2], bl[3]);
                    mma_bf16(acc[2 * vg + 1], al, bh[2], bh[3]);
                }
            }
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float lt = l[hr];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        if (!qok[hr]) continue;
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        float * orow = o + ((t0 + 16 * warp + g + 8 * hr) * H + h) * dv;
#pragma unroll
        for (int i = 0; i < 2 * k_mnv; ++i) {
            const int col = 8 * i + 2 * qd;
            if (col < dv) *reinterpret_cast<float2 *>(orow + col) = make_float2(acc[i][2 * hr] * inv, acc[i][2 * hr + 1] * inv);
        }
    }
}

template <int VPT> size_t attn_smem(int dqk) { return size_t(2 * dqk * k_ld + k_bk * 16 * VPT + k_bq * k_ld) * sizeof(float); }

} // namespace

size_t mla_prefill_smem(const mla_shape & d) {
    const int64_t dqk = d.head_dim_nope + d.head_dim_rope;
    if (dqk > 256 || d.head_dim_v > 128 || d.head_dim_nope % 4 || d.head_dim_rope % 4 || d.head_dim_v % 4 || dqk == 0)
        return 0;
    return d.head_dim_v <= 64 ? attn_smem<4>(int(dqk)) : attn_smem<8>(int(dqk));
}

cudaError_t launch_mla_prefill_gather(const float * c, const float * kr, int64_t L, int64_t dr, float * cache, const dbatch & b,
                                      int64_t P, float * cg, float * krg, cudaStream_t st) {
    if (b.n_tok > 0) launch_k(k_prefill_cache_write, unsigned(b.n_tok), 128, 0, st, c, kr, L, dr, cache, b);
    if (P > 0) launch_k(k_prefill_gather, unsigned(P), 128, 0, st, cache, L, dr, b, cg, krg);
    return cudaGetLastError();
}

bool mla_prefill_mma_supported(const mla_shape & d) {
    const int64_t dn = d.head_dim_nope, dr = d.head_dim_rope, dv = d.head_dim_v;
    return dn % 8 == 0 && dr % 8 == 0 && dv % 8 == 0 && dn + dr > 0 && dn + dr <= 16 * k_mks && dv > 0 && dv <= 16 * k_mnv;
}

cudaError_t launch_mla_prefill_attn_mma(const float * q, const uint16_t * kvh, const uint16_t * kvl, const uint16_t * krh,
                                        const uint16_t * krl, const mla_shape & d, float scale, const dbatch & b, float * o,
                                        cudaStream_t st) {
    if (!mla_prefill_mma_supported(d)) return cudaErrorInvalidValue;
    if (b.n_tok == 0) return cudaGetLastError();
    const unsigned tiles = unsigned((b.n_tok + k_mq - 1) / k_mq + b.n_seq);   // as launch_mla_prefill_attn
    const dim3 grid(tiles, unsigned(d.n_head));
    const cudaError_t e = cudaFuncSetAttribute(k_mla_prefill_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, int(k_msmem));
    if (e != cudaSuccess) return e;
    auto bf = [](const uint16_t * p) { return reinterpret_cast<const __nv_bfloat16 *>(p); };
    launch_k(k_mla_prefill_mma, grid, k_mthreads, k_msmem, st, q, bf(kvh), bf(kvl), bf(krh), bf(krl), int(d.n_head),
             int(d.head_dim_nope), int(d.head_dim_rope), int(d.head_dim_v), scale, b, o);
    return cudaGetLastError();
}

cudaError_t launch_mla_prefill_attn(const float * q, const float * kv, const float * krg, const mla_shape & d, float scale,
                                    const dbatch & b, float * o, cudaStream_t st) {
    const size_t smem = mla_prefill_smem(d);
    if (smem == 0) return cudaErrorInvalidValue;
    if (b.n_tok == 0) return cudaGetLastError();
    // Tiles: at most ceil(T / 64) + n_seq over all sequences (each sequence's last tile may be partial).
    const unsigned tiles = unsigned((b.n_tok + k_bq - 1) / k_bq + b.n_seq);
    const dim3 grid(tiles, unsigned(d.n_head));
    const int H = int(d.n_head), dn = int(d.head_dim_nope), dr = int(d.head_dim_rope), dv = int(d.head_dim_v);
    cudaError_t e;
    if (dv <= 64) {
        e = cudaFuncSetAttribute(k_mla_prefill_attn<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (e != cudaSuccess) return e;
        launch_k(k_mla_prefill_attn<4>, grid, k_threads, smem, st, q, kv, krg, H, dn, dr, dv, scale, b, o);
    } else {
        e = cudaFuncSetAttribute(k_mla_prefill_attn<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (e != cudaSuccess) return e;
        launch_k(k_mla_prefill_attn<8>, grid, k_threads, smem, st, q, kv, krg, H, dn, dr, dv, scale, b, o);
    }
    return cudaGetLastError();
}

} // namespace perigee::cuda
