// MLA_ATTN prefill in the CPU reference's expanded form (cuda_options::mla_prefill_tokens; prefill-ops.h): the cached
// latent rows of every position are gathered, expanded to per-head k_nope / v by one cuBLASLt GEMM (the backend), and a
// causal flash-attention kernel runs per (64-token query tile, head): fp32 SIMT tiles in shared memory, online softmax,
// fp32 accumulation. The absorbed-form kernels in mla.cu stay for decode, selections and compare mode.
#include "backend/cuda/common.cuh"
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
