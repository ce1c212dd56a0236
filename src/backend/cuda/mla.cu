// MLA_ATTN in absorbed form over the paged latent cache (ARCHITECTURE §3.5): write [c | kr] into the pages,
// then per (token, head): q_lat = W_UK_h^T q_nope; score(s) = (q_lat . c_s + q_rope . kr_s) * scale; online
// softmax over the causal (or selected) positions; o_lat = sum p_s c_s; out = W_UV_h o_lat. The CPU reference
// expands k and v per position instead; both are the same function (fp32 rounding differs).
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

__device__ __forceinline__ int64_t cache_row(const dbatch & b, int s, int64_t pos) {
    const int32_t page = b.block_table[int64_t(s) * b.max_pages + pos / b.page_size];
    return int64_t(page) * b.page_size + pos % b.page_size;
}

__global__ void k_mla_cache_write(const float * __restrict__ c, const float * __restrict__ kr, int64_t L, int64_t dr,
                                  float * __restrict__ cache, dbatch b) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    float * row = cache + cache_row(b, s, pos) * (L + dr);
    for (int64_t i = threadIdx.x; i < L + dr; i += blockDim.x) row[i] = i < L ? c[t * L + i] : kr[t * dr + i - L];
}

// qlat [T, H, L]: thread per (t, h, l).
__global__ void k_mla_q_absorb(const float * __restrict__ q, dweight kv_b, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                               int64_t L, float * __restrict__ qlat) {
    pdl_enter();
    // (t, h) on x: T * H passes gridDim.y's 65535 at prefill (K3, 64 heads: T > 1023).
    const int64_t l = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
    const int64_t th = blockIdx.x, h = th % H;
    if (l >= L) return;
    const float * qh = q + th * (dn + dr);
    float acc = 0.0f;
    for (int64_t i = 0; i < dn; ++i) acc += qh[i] * wload(kv_b, (h * (dn + dv) + i) * L + l);
    qlat[th * L + l] = acc;
}

constexpr int k_attn_warps = 4;

// Block per (t, h). Warps take keys round-robin with an online softmax each, then merge.
template <int LPL>
__global__ void __launch_bounds__(k_attn_warps * 32) k_mla_attn_absorbed(
    const float * __restrict__ q, const float * __restrict__ qlat, int64_t H, int64_t dn, int64_t dr, int64_t L,
    float scale, const float * __restrict__ cache, const int32_t * __restrict__ sel, int64_t topk, dbatch b,
    float * __restrict__ olat, float * __restrict__ part, int * err) {
    pdl_enter();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t th = blockIdx.x, t = th / H;
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    const int64_t W = L + dr;
    float ql[LPL], acc[LPL];
#pragma unroll
    for (int j = 0; j < LPL; ++j) {
        const int64_t l = lane + 32 * j;
        ql[j] = l < L ? qlat[th * L + l] : 0.0f;
        acc[j] = 0.0f;
    }
    const float * qr = q + th * (dn + dr) + dn;
    const float qr0 = lane < dr ? qr[lane] : 0.0f, qr1 = lane + 32 < dr ? qr[lane + 32] : 0.0f;
    float m = -INFINITY, lsum = 0.0f;
    const int64_t n_keys = sel ? topk : pos + 1;
    // Split over the keys (flash-decoding): block y of gridDim.y takes one contiguous key range.
    const int64_t ns = gridDim.y, chunk = (n_keys + ns - 1) / ns;
    const int64_t j0 = int64_t(blockIdx.y) * chunk, j1 = min(n_keys, j0 + chunk);
    for (int64_t j = j0 + wid; j < j1; j += k_attn_warps) {
        int64_t p = j;
        if (sel) {
            p = sel[t * topk + j];
            if (p < 0) continue;
            if (p > pos) {
                if (lane == 0) atomicOr(err + ERR_SEL_RANGE, 1);
                continue;
            }
        }
        const float * row = cache + cache_row(b, s, p) * W;
        float cv[LPL];
        float d = 0.0f;
#pragma unroll
        for (int jj = 0; jj < LPL; ++jj) {
            const int64_t l = lane + 32 * jj;
            cv[jj] = l < L ? row[l] : 0.0f;
            d += ql[jj] * cv[jj];
        }
        if (lane < dr) d += qr0 * row[L + lane];
        if (lane + 32 < dr) d += qr1 * row[L + lane + 32];
        const float sc = warp_sum(d) * scale;
        const float mn = fmaxf(m, sc);
        const float corr = expf(m - mn), pe = expf(sc - mn);
        lsum = lsum * corr + pe;
#pragma unroll
        for (int jj = 0; jj < LPL; ++jj) acc[jj] = acc[jj] * corr + pe * cv[jj];
        m = mn;
    }
    extern __shared__ float sm[];   // [k_attn_warps][L] acc, then m[k_attn_warps], l[k_attn_warps]
    float * sacc = sm;
    float * sm_m = sm + k_attn_warps * L;
    float * sm_l = sm_m + k_attn_warps;
#pragma unroll
    for (int jj = 0; jj < LPL; ++jj) {
        const int64_t l = lane + 32 * jj;
        if (l < L) sacc[wid * L + l] = acc[jj];
    }
    if (lane == 0) {
        sm_m[wid] = m;
        sm_l[wid] = lsum;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < k_attn_warps; ++w) M = fmaxf(M, sm_m[w]);
    float den = 0.0f;
    float f[k_attn_warps];
    for (int w = 0; w < k_attn_warps; ++w) {
        f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - M);
        den += f[w] * sm_l[w];
    }
    if (part) {   // partial of this key range: [m, l, acc[L]] unnormalised, merged by k_mla_combine
        float * pp = part + (th * ns + blockIdx.y) * (L + 2);
        if (threadIdx.x == 0) {
            pp[0] = M;
            pp[1] = den;
        }
        for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
            float v = 0.0f;
            for (int w = 0; w < k_attn_warps; ++w) v += f[w] * sacc[w * L + l];
            pp[2 + l] = v;
        }
        return;
    }
    if (M == -INFINITY && threadIdx.x == 0 && sel) atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
    for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < k_attn_warps; ++w) v += f[w] * sacc[w * L + l];
        olat[th * L + l] = den > 0.0f ? v / den : 0.0f;
    }
}

// olat [T, H, L] from the ns partials of each (t, h): block per (t, h), threads over L.
__global__ void k_mla_combine(const float * __restrict__ part, int64_t ns, int64_t L, const int32_t * __restrict__ sel,
                              float * __restrict__ olat, int * err) {
    pdl_enter();
    const int64_t th = blockIdx.x;
    const float * pp = part + th * ns * (L + 2);
    float M = -INFINITY;
    for (int64_t i = 0; i < ns; ++i) M = fmaxf(M, pp[i * (L + 2)]);
    float den = 0.0f;
    for (int64_t i = 0; i < ns; ++i) {
        const float mi = pp[i * (L + 2)];
        den += mi == -INFINITY ? 0.0f : expf(mi - M) * pp[i * (L + 2) + 1];
    }
    if (M == -INFINITY && threadIdx.x == 0 && sel) atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
    for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
        float v = 0.0f;
        for (int64_t i = 0; i < ns; ++i) {
            const float mi = pp[i * (L + 2)];
            if (mi != -INFINITY) v += expf(mi - M) * pp[i * (L + 2) + 2 + l];
        }
        olat[th * L + l] = den > 0.0f ? v / den : 0.0f;
    }
}

// o [T, H, dv]: warp per (t, h, i), lanes over L.
__global__ void k_mla_out(const float * __restrict__ olat, dweight kv_b, int64_t T, int64_t H, int64_t dn, int64_t dv,
                          int64_t L, float * __restrict__ o) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int64_t gw = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    if (gw >= T * H * dv) return;
    const int64_t i = gw % dv, th = gw / dv, h = th % H;
    const int64_t wrow = (h * (dn + dv) + dn + i) * L;
    float acc = 0.0f;
    for (int64_t l = lane; l < L; l += 32) acc += wload(kv_b, wrow + l) * olat[th * L + l];
    acc = warp_sum(acc);
    if (lane == 0) o[gw] = acc;
}

} // namespace

int mla_split_for(int64_t T, const mla_shape & d, bool enabled) {
    if (!enabled) return 1;
    // Enough blocks for ~2 per SM of an H200 (132 SMs); at most 16 key ranges (the combine reads them all).
    const int64_t blocks = T * d.n_head, want = (264 + blocks - 1) / blocks;
    return int(want < 1 ? 1 : want > 16 ? 16 : want);
}

int64_t mla_scratch_floats(int64_t T, const mla_shape & d, int n_split) {
    const int64_t base = 2 * T * d.n_head * d.kv_lora_rank;
    return n_split > 1 ? base + T * d.n_head * n_split * (d.kv_lora_rank + 2) : base;
}

cudaError_t launch_mla_attn(const float * q, const float * c, const float * kr, dweight kv_b, const mla_shape & d,
                            float scale, float * cache, const int32_t * sel, int64_t topk, const dbatch & b, int n_split,
                            float * scratch, float * o, int * err, cudaStream_t st) {
    const int64_t T = b.n_tok, H = d.n_head, dn = d.head_dim_nope, dr = d.head_dim_rope, dv = d.head_dim_v,
                  L = d.kv_lora_rank;
    if (T == 0) return cudaGetLastError();
    if (L > 512 || dr > 64) return cudaErrorInvalidValue;
    float * qlat = scratch;
    float * olat = scratch + T * H * L;
    if (n_split < 1 || n_split > 16) return cudaErrorInvalidValue;
    float * part = n_split > 1 ? scratch + 2 * T * H * L : nullptr;
    launch_k(k_mla_cache_write, unsigned(T), 128, 0, st, c, kr, L, dr, cache, b);
    launch_k(k_mla_q_absorb, dim3(unsigned(T * H), grid_for(L, 128)), 128, 0, st, q, kv_b, H, dn, dr, dv, L, qlat);
    const size_t smem = size_t(k_attn_warps * L + 2 * k_attn_warps) * sizeof(float);
    const int lpl = int((L + 31) / 32);
#define PG_MLA_CASE(N)                                                                                                  \
    launch_k(k_mla_attn_absorbed<N>, dim3(unsigned(T * H), unsigned(n_split)), k_attn_warps * 32, smem, st, q, qlat, H, \
             dn, dr, L, scale, cache, sel, topk, b, olat, part, err);                                                   \
    break;
    switch (lpl) {
        case 1: PG_MLA_CASE(1)
        case 2: PG_MLA_CASE(2)
        case 3: case 4: PG_MLA_CASE(4)
        case 5: case 6: case 7: case 8: PG_MLA_CASE(8)
        default: PG_MLA_CASE(16)
    }
#undef PG_MLA_CASE
    if (part) launch_k(k_mla_combine, unsigned(T * H), 128, 0, st, part, n_split, L, sel, olat, err);
    const int64_t warps = T * H * dv;
    launch_k(k_mla_out, grid_for(warps * 32, 256), 256, 0, st, olat, kv_b, T, H, dn, dv, L, o);
    return cudaGetLastError();
}

} // namespace perigee::cuda
