// MLA_ATTN in absorbed form over the paged latent cache (ARCHITECTURE §3.5): write [c | kr] into the pages,
// then per (token, head): q_lat = W_UK_h^T q_nope; score(s) = (q_lat . c_s + q_rope . kr_s) * scale; online
// softmax over the causal (or selected) positions; o_lat = sum p_s c_s; out = W_UV_h o_lat. The CPU reference
// expands k and v per position instead; both are the same function (fp32 rounding differs).
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"

#include <algorithm>

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


// ---- Decode v2 (cuda_options::mla_decode_v2) ----
// Why v1 is slow at decode (bench/RESULTS.md round 3: 78 us per 48B layer at batch 1, 1.06 ms at batch 64): its
// attention block serves ONE head and walks its keys one at a time (a 512-wide dot, a warp reduction and an online-
// softmax update per key: a serial chain), and every head re-reads the same latent rows; q_absorb walks the 128 rows of
// W_UK serially per thread; k_mla_out is a warp per (token, head, row), so at batch 64 every weight row is read 64 times.
// v2:
//  * k_mla_q_absorb_v2 / k_mla_out_v2: per head a small matrix product with the weights read once per token tile of up
//    to 8 tokens, every lane holding 16 independent 4-element weight loads in flight; partials over the 8 warps summed
//    in shared memory in warp order (deterministic).
//  * k_mla_attn_v2: a block per (token, group of 4 * HPW heads, key range). Tiles of 32 latent rows are copied to shared
//    memory once (cp.async, zero-filled for masked keys) and shared by every head of the group. Scores: lane = key, the
//    warp's HPW heads at once (q rows broadcast from shared memory, 4 independent partial sums per head). Online softmax
//    once per tile per head (one warp max + one warp sum). P.V: lanes over the latent columns (float4), keys in order.
//  * k_mla_combine_v2: the exp weights of the ns partials computed once per (token, head), then lanes over L.
// fp32 throughout; the summation order differs from v1 (held to the CPU reference at the f32 tolerance).
constexpr int k_v2_keys = 32;    // keys per tile (= lanes)
constexpr int k_v2_warps = 4;    // warps of the attention block
constexpr int k_v2_max_split = 64;

__device__ __forceinline__ void cp_async_commit_wait_all() {
    cp_async_commit();
    cp_async_wait<0>();
}

// Four consecutive weight elements (i a multiple of 4), one 8- or 16-byte read-only load.
template <wtype WT>
__device__ __forceinline__ float4 wload4(const void * w, int64_t i) {
    if constexpr (WT == wtype::F32) {
        return __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(w) + i));
    } else {
        const uint2 u = __ldg(reinterpret_cast<const uint2 *>(static_cast<const uint16_t *>(w) + i));
        if constexpr (WT == wtype::BF16) {
            return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                               __uint_as_float(u.y & 0xffff0000u));
        } else {
            const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
            const float2 c = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
            return make_float4(a.x, a.y, c.x, c.y);
        }
    }
}
__device__ __forceinline__ void fma4(float4 & a, float s, const float4 & v) {
    a.x = fmaf(s, v.x, a.x);
    a.y = fmaf(s, v.y, a.y);
    a.z = fmaf(s, v.z, a.z);
    a.w = fmaf(s, v.w, a.w);
}

constexpr int k_qa_rows = 16;   // rows of W_UK per warp per batch of loads

// qlat [T, H, L] = q_nope [T, H, dn] x W_UK_h [dn, L]. Block per (head, 128 columns) x tile of TT tokens, 8 warps: warp
// w takes rows w, w + 8, ...; lane c4 four columns. dn <= 256.
template <wtype WT, int TT>
__global__ void __launch_bounds__(256, 1) k_mla_q_absorb_v2(const float * __restrict__ q, const void * __restrict__ kv_b,
                                                         int64_t T, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t L,
                                                         float * __restrict__ qlat) {
    pdl_enter();
    __shared__ float qs[TT][256 + 8 * k_qa_rows];   // zero past dn: rows clamped into the matrix meet a 0
    __shared__ float4 red[8][TT][32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t L4 = L / 4, nct = (L4 + 31) / 32;
    const int64_t h = blockIdx.x / nct, cb = (blockIdx.x % nct) * 32, c4 = cb + lane;
    const int64_t t0 = int64_t(blockIdx.y) * TT;
    constexpr int QW = 256 + 8 * k_qa_rows;
    for (int i = threadIdx.x; i < TT * QW; i += blockDim.x) {
        const int tt = i / QW, k = i % QW;
        const int64_t t = t0 + tt;
        qs[tt][k] = t < T && k < dn ? q[(t * H + h) * (dn + dr) + k] : 0.0f;
    }
    __syncthreads();
    float4 acc[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) acc[tt] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // Loads unconditional (row and column clamped into the matrix; a clamped row is multiplied by 0, a clamped column is
    // never written), so that all k_qa_rows of them are issued before the first use.
    const int64_t wbase = h * (dn + dv) * L + 4 * min(c4, L4 - 1);
    for (int64_t i0 = wid; i0 < dn; i0 += 8 * k_qa_rows) {
        float4 w[k_qa_rows];
#pragma unroll
        for (int r = 0; r < k_qa_rows; ++r) w[r] = wload4<WT>(kv_b, wbase + min(i0 + 8 * r, dn - 1) * L);
#pragma unroll
        for (int r = 0; r < k_qa_rows; ++r) {
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) fma4(acc[tt], qs[tt][i0 + 8 * r], w[r]);   // i0 + 8r < dn + 8 * k_qa_rows
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) red[wid][tt][lane] = acc[tt];
    __syncthreads();
    for (int o = threadIdx.x; o < TT * 32; o += blockDim.x) {
        const int tt = o / 32, cc = o % 32;
        const int64_t t = t0 + tt, c = cb + cc;
        if (t >= T || c >= L4) continue;
        float4 sum = red[0][tt][cc];
#pragma unroll
        for (int w = 1; w < 8; ++w) {
            const float4 v = red[w][tt][cc];
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        reinterpret_cast<float4 *>(qlat + (t * H + h) * L)[c] = sum;
    }
}

// Block per (token, group of k_v2_warps * HPW heads) x key range (gridDim.y ranges). L <= 512, dr <= 64, L, dr and dn
// multiples of 4. Dynamic shared memory: mla_v2_smem(HPW, L + dr).
template <int HPW>
__global__ void __launch_bounds__(k_v2_warps * 32, 2) k_mla_attn_v2(
    const float * __restrict__ q, const float * __restrict__ qlat, int64_t H, int64_t dn, int64_t dr, int64_t L,
    float scale, const float * __restrict__ cache, const int32_t * __restrict__ sel, int64_t topk, dbatch b,
    float * __restrict__ olat, float * __restrict__ part, int * err) {
    pdl_enter();
    constexpr int HG = k_v2_warps * HPW;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t G = (H + HG - 1) / HG;
    const int64_t t = blockIdx.x / G, h0 = (blockIdx.x % G) * HG;
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    const int W = int(L + dr), W4 = W / 4, S = W4 | 1, L4 = int(L / 4);   // S: odd row stride in float4s (no conflicts)
    extern __shared__ float4 sm4[];
    float4 * cs = sm4;                                                 // [k_v2_keys][S] latent rows [c | kr]
    float4 * qs = cs + k_v2_keys * S;                                  // [HG][S] [q_lat | q_rope] of the group
    float * ps = reinterpret_cast<float *>(qs + HG * S);               // [HG][k_v2_keys] probabilities of the tile
    int64_t * rows = reinterpret_cast<int64_t *>(ps + HG * k_v2_keys); // [k_v2_keys] float offset of each key's row, -1 masked
    for (int i = threadIdx.x; i < HG * W4; i += blockDim.x) {
        const int hh = i / W4, c = i % W4;
        const int64_t h = h0 + hh;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (h < H)
            v = c < L4 ? reinterpret_cast<const float4 *>(qlat + (t * H + h) * L)[c]
                       : reinterpret_cast<const float4 *>(q + (t * H + h) * (dn + dr) + dn)[c - L4];
        qs[hh * S + c] = v;
    }
    float m[HPW], lsum[HPW];
    float4 acc[HPW][4];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        m[hh] = -INFINITY;
        lsum[hh] = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[hh][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const int64_t n_keys = sel ? topk : pos + 1;
    const int64_t ns = gridDim.y, chunk = (n_keys + ns - 1) / ns;
    const int64_t j0 = int64_t(blockIdx.y) * chunk, j1 = min(n_keys, j0 + chunk);
    const float4 * qw = qs + wid * HPW * S;
    for (int64_t jt = j0; jt < j1; jt += k_v2_keys) {
        __syncthreads();   // the previous tile's readers are done
        if (wid == 0) {
            const int64_t j = jt + lane;
            int64_t row = -1;
            if (j < j1) {
                int64_t p = j;
                if (sel) {
                    p = sel[t * topk + j];
                    if (p > pos) {
                        atomicOr(err + ERR_SEL_RANGE, 1);
                        p = -1;
                    }
                }
                if (p >= 0) row = cache_row(b, s, p) * W;
            }
            rows[lane] = row;
        }
        __syncthreads();
        for (int r = wid; r < k_v2_keys; r += k_v2_warps) {
            const int64_t row = rows[r];
            for (int c = lane; c < W4; c += 32)
                cp_async16_zfill(cs + r * S + c, row >= 0 ? cache + row + 4 * c : cache, row >= 0 ? 16 : 0);
        }
        cp_async_commit_wait_all();
        __syncthreads();
        // scores: lane = key
        const bool kv = rows[lane] >= 0;
        float sx[HPW], sy[HPW], sz[HPW], sw[HPW];
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) sx[hh] = sy[hh] = sz[hh] = sw[hh] = 0.0f;
        const float4 * cr = cs + lane * S;
#pragma unroll 4
        for (int c = 0; c < W4; ++c) {
            const float4 kv4 = cr[c];
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                const float4 qv = qw[hh * S + c];
                sx[hh] = fmaf(qv.x, kv4.x, sx[hh]);
                sy[hh] = fmaf(qv.y, kv4.y, sy[hh]);
                sz[hh] = fmaf(qv.z, kv4.z, sz[hh]);
                sw[hh] = fmaf(qv.w, kv4.w, sw[hh]);
            }
        }
        // online softmax, once per tile per head
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            const float sc = kv ? ((sx[hh] + sy[hh]) + (sz[hh] + sw[hh])) * scale : -INFINITY;
            const float mn = fmaxf(m[hh], warp_max(sc));
            float p = 0.0f, corr = 1.0f;
            if (mn != -INFINITY) {
                p = kv ? expf(sc - mn) : 0.0f;
                corr = expf(m[hh] - mn);   // 0 while m was -inf (acc and lsum are 0 then)
            }
            lsum[hh] = lsum[hh] * corr + warp_sum(p);
            m[hh] = mn;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[hh][k].x *= corr;
                acc[hh][k].y *= corr;
                acc[hh][k].z *= corr;
                acc[hh][k].w *= corr;
            }
            ps[(wid * HPW + hh) * k_v2_keys + lane] = p;
        }
        __syncwarp();
        // P.V: lanes over the latent columns, keys in order
        const int nk = int(min(int64_t(k_v2_keys), j1 - jt));
        for (int j = 0; j < nk; ++j) {
            float pj[HPW];
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) pj[hh] = ps[(wid * HPW + hh) * k_v2_keys + j];
            const float4 * crow = cs + j * S;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int c4 = lane + 32 * k;
                if (c4 < L4) {
                    const float4 cv = crow[c4];
#pragma unroll
                    for (int hh = 0; hh < HPW; ++hh) fma4(acc[hh][k], pj[hh], cv);
                }
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const int64_t h = h0 + wid * HPW + hh;
        if (h >= H) continue;
        const int64_t th = t * H + h;
        if (part) {   // unnormalised partial [m, l, acc[L]] of this key range, merged by k_mla_combine_v2
            float * pp = part + (th * ns + blockIdx.y) * (L + 2);
            if (lane == 0) {
                pp[0] = m[hh];
                pp[1] = lsum[hh];
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int c4 = lane + 32 * k;
                if (c4 < L4) {
                    pp[2 + 4 * c4] = acc[hh][k].x;
                    pp[3 + 4 * c4] = acc[hh][k].y;
                    pp[4 + 4 * c4] = acc[hh][k].z;
                    pp[5 + 4 * c4] = acc[hh][k].w;
                }
            }
            continue;
        }
        if (m[hh] == -INFINITY && lane == 0 && sel) atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
        const float inv = lsum[hh] > 0.0f ? 1.0f / lsum[hh] : 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c4 = lane + 32 * k;
            if (c4 < L4)
                reinterpret_cast<float4 *>(olat + th * L)[c4] =
                    make_float4(acc[hh][k].x * inv, acc[hh][k].y * inv, acc[hh][k].z * inv, acc[hh][k].w * inv);
        }
    }
}

// olat [T, H, L] from the ns <= k_v2_max_split partials of each (t, h): block per (t, h); the weights exp(m_i - M) once.
__global__ void k_mla_combine_v2(const float * __restrict__ part, int64_t ns, int64_t L, const int32_t * __restrict__ sel,
                                 float * __restrict__ olat, int * err) {
    pdl_enter();
    __shared__ float f[k_v2_max_split];
    const int64_t th = blockIdx.x;
    const float * pp = part + th * ns * (L + 2);
    float M = -INFINITY;
    for (int64_t i = 0; i < ns; ++i) M = fmaxf(M, pp[i * (L + 2)]);
    for (int64_t i = threadIdx.x; i < ns; i += blockDim.x) {
        const float mi = pp[i * (L + 2)];
        f[i] = mi == -INFINITY ? 0.0f : expf(mi - M);
    }
    __syncthreads();
    float den = 0.0f;
    for (int64_t i = 0; i < ns; ++i) den += f[i] * pp[i * (L + 2) + 1];
    if (M == -INFINITY && threadIdx.x == 0 && sel) atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int64_t l = threadIdx.x; l < L; l += blockDim.x) {
        float v = 0.0f;
#pragma unroll 8
        for (int64_t i = 0; i < ns; ++i) v += f[i] * pp[i * (L + 2) + 2 + l];
        olat[th * L + l] = v * inv;
    }
}

// o [T, H, dv] = olat [T, H, L] x W_UV_h^T. Block per (head, 32 rows of W_UV) x tile of TT tokens, 8 warps of 4 rows;
// lanes over L in float4s (L <= 512: 16 loads in flight per lane), one warp sum per (row, token).
template <wtype WT, int TT>
__global__ void __launch_bounds__(256) k_mla_out_v2(const float * __restrict__ olat, const void * __restrict__ kv_b,
                                                    int64_t T, int64_t H, int64_t dn, int64_t dv, int64_t L,
                                                    float * __restrict__ o) {
    pdl_enter();
    __shared__ float4 os[TT][128];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t L4 = L / 4, nrc = (dv + 31) / 32;
    const int64_t h = blockIdx.x / nrc, r0 = (blockIdx.x % nrc) * 32 + wid * 4;
    const int64_t t0 = int64_t(blockIdx.y) * TT;
    for (int i = threadIdx.x; i < TT * 128; i += blockDim.x) {
        const int tt = i / 128, c = i % 128;
        const int64_t t = t0 + tt;
        os[tt][c] = t < T && c < L4 ? reinterpret_cast<const float4 *>(olat + (t * H + h) * L)[c]
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float4 w[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            // clamped into the matrix (loads unconditional, all 16 in flight); clamped rows are not written and clamped
            // columns meet the zeros of os
            const int64_t i = min(r0 + r, dv - 1), c4 = min(int64_t(lane + 32 * k), L4 - 1);
            w[r][k] = wload4<WT>(kv_b, (h * (dn + dv) + dn + i) * L + 4 * c4);
        }
    }
    __syncthreads();
    for (int tt = 0; tt < TT; ++tt) {
        const int64_t t = t0 + tt;
        if (t >= T) break;
        float pr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 ov = os[tt][lane + 32 * k];
#pragma unroll
            for (int r = 0; r < 4; ++r) pr[r] += w[r][k].x * ov.x + w[r][k].y * ov.y + w[r][k].z * ov.z + w[r][k].w * ov.w;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) pr[r] = warp_sum(pr[r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (r0 + r < dv) o[(t * H + h) * dv + r0 + r] = pr[r];
        }
    }
}

size_t mla_v2_smem(int hpw, int64_t W) {
    const int64_t S = (W / 4) | 1, HG = int64_t(k_v2_warps) * hpw;
    return size_t((k_v2_keys + HG) * S * 16 + HG * k_v2_keys * 4 + k_v2_keys * 8);
}
int mla_v2_hpw(int64_t T) { return T >= 8 ? 4 : 2; }
// Once per instantiation (outside any stream capture in practice: the first call is an eager run): the largest dynamic
// shared memory (L 512 + dr 64) and the maximal shared-memory carveout, so that two blocks share an SM.
template <int HPW>
cudaError_t mla_v2_attrs() {
    static const cudaError_t e = [] {
        cudaError_t r = cudaFuncSetAttribute(k_mla_attn_v2<HPW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(mla_v2_smem(HPW, 512 + 64)));
        if (r == cudaSuccess)
            r = cudaFuncSetAttribute(k_mla_attn_v2<HPW>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared));
        return r;
    }();
    return e;
}

template <wtype WT>
void launch_mla_v2_linear(bool out, const float * x, dweight kv_b, int64_t T, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                          int64_t L, float * y, cudaStream_t st) {
    const unsigned ty1 = unsigned(T), ty8 = unsigned((T + 7) / 8);
    if (!out) {
        const unsigned gx = unsigned(H * ((L / 4 + 31) / 32));
        if (T == 1) launch_k(k_mla_q_absorb_v2<WT, 1>, dim3(gx, ty1), 256, 0, st, x, kv_b.data, T, H, dn, dr, dv, L, y);
        else launch_k(k_mla_q_absorb_v2<WT, 8>, dim3(gx, ty8), 256, 0, st, x, kv_b.data, T, H, dn, dr, dv, L, y);
    } else {
        const unsigned gx = unsigned(H * ((dv + 31) / 32));
        if (T == 1) launch_k(k_mla_out_v2<WT, 1>, dim3(gx, ty1), 256, 0, st, x, kv_b.data, T, H, dn, dv, L, y);
        else launch_k(k_mla_out_v2<WT, 8>, dim3(gx, ty8), 256, 0, st, x, kv_b.data, T, H, dn, dv, L, y);
    }
}
void launch_mla_v2_linear_any(bool out, const float * x, dweight kv_b, int64_t T, int64_t H, int64_t dn, int64_t dr,
                              int64_t dv, int64_t L, float * y, cudaStream_t st) {
    switch (kv_b.type) {
        case wtype::BF16: launch_mla_v2_linear<wtype::BF16>(out, x, kv_b, T, H, dn, dr, dv, L, y, st); break;
        case wtype::F16: launch_mla_v2_linear<wtype::F16>(out, x, kv_b, T, H, dn, dr, dv, L, y, st); break;
        default: launch_mla_v2_linear<wtype::F32>(out, x, kv_b, T, H, dn, dr, dv, L, y, st); break;
    }
}

// ---- Decode v3 (cuda_options::mla_decode_v3; needs v2's shapes) ----
// Why v2 is still slow at batch 1 (bench/session4-h200-2026-11-30-ncu-48b-step.txt, one 48B MLA layer, each kernel
// isolated: cache_write 5.2 + q_absorb 4.6 + attention 21.0 + combine 9.2 + out 4.5 us for ~13 MB): five launches, each
// a chain of dependent memory latencies (the attention: batch arrays -> block table -> tile, after q rows loaded one
// float4 at a time; the combine: per thread a serial walk over the ns partials in three passes, 32 blocks only).
// v3, three launches, with everything that does not depend on the kernel just before issued BEFORE pdl_wait (under PDL
// it overlaps that kernel; see the ordering argument below):
//  * k_mla_q_absorb_v3: q_absorb v2 with the first batch of W_UK loads before pdl_wait, plus one more block column that
//    writes the latent cache rows of the step (the cache write launch is gone).
//  * k_mla_attn_v3: v2's attention. Before pdl_wait: the batch arrays, the first key tile (cp.async) and the q_rope rows;
//    after it only the q_lat rows (written by q_absorb). Key ranges are whole 32-key tiles. Keys of THIS step's tokens
//    (positions >= pos0 of the sequence) are read from the c / kr inputs, not from the cache, so the attention never
//    waits for the cache write. Partials as [acc (ns x L, 16-byte aligned)] + [m, l] pairs.
//  * k_mla_out_v3: the combine folded into the output projection: W_UV loads before pdl_wait, then per (token, head)
//    the ns exp weights from one warp (lanes over the partials) and the merged o_lat tile in shared memory.
// Ordering (PDL): every kernel passes pdl_wait before its pdl_trigger, so when a kernel's pre-wait code runs, the kernel
// before its predecessor has completed (and transitively all earlier ones): the attention may read the cache, c, kr, q
// and sel before its wait (only q_lat comes from its predecessor); q_absorb and out read only weights before theirs.
// Nothing is written before a wait. fp32; the summation order of the combine differs from v2 (f32 tolerance).
constexpr int k_v3_tiles_max = 64;

// qlat as v2 (TT tokens per block); the last block column (blockIdx.x == gridDim.x - 1) writes the cache rows [c | kr]
// of the tile's tokens instead.
template <wtype WT, int TT>
__global__ void __launch_bounds__(256, 1) k_mla_q_absorb_v3(const float * __restrict__ q, const void * __restrict__ kv_b,
                                                         int64_t T, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t L,
                                                         float * __restrict__ qlat, const float * __restrict__ c,
                                                         const float * __restrict__ kr, float * __restrict__ cache, dbatch b) {
    const int64_t t0 = int64_t(blockIdx.y) * TT;
    if (blockIdx.x == gridDim.x - 1) {   // the cache write of tokens t0 .. t0 + TT - 1
        pdl_enter();
        for (int tt = 0; tt < TT && t0 + tt < T; ++tt) {
            const int64_t t = t0 + tt;
            const int s = b.tok_seq[t];
            const int64_t pos = b.pos0[s] + t - b.seq_start[s];
            float * row = cache + cache_row(b, s, pos) * (L + dr);
            for (int64_t i = threadIdx.x; i < L + dr; i += blockDim.x) row[i] = i < L ? c[t * L + i] : kr[t * dr + i - L];
        }
        return;
    }
    __shared__ float qs[TT][256 + 8 * k_qa_rows];
    __shared__ float4 red[8][TT][32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t L4 = L / 4, nct = (L4 + 31) / 32;
    const int64_t h = blockIdx.x / nct, cb = (blockIdx.x % nct) * 32, c4 = cb + lane;
    const int64_t wbase = h * (dn + dv) * L + 4 * min(c4, L4 - 1);
    float4 w[k_qa_rows];
    // weights: constant for the step, loaded before the wait
#pragma unroll
    for (int r = 0; r < k_qa_rows; ++r) w[r] = wload4<WT>(kv_b, wbase + min(int64_t(wid + 8 * r), dn - 1) * L);
    pdl_enter();
    constexpr int QW = 256 + 8 * k_qa_rows;
    for (int i = threadIdx.x; i < TT * QW; i += blockDim.x) {
        const int tt = i / QW, k = i % QW;
        const int64_t t = t0 + tt;
        qs[tt][k] = t < T && k < dn ? q[(t * H + h) * (dn + dr) + k] : 0.0f;
    }
    __syncthreads();
    float4 acc[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) acc[tt] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int64_t i0 = wid; i0 < dn; i0 += 8 * k_qa_rows) {
        if (i0 != wid) {
#pragma unroll
            for (int r = 0; r < k_qa_rows; ++r) w[r] = wload4<WT>(kv_b, wbase + min(i0 + 8 * r, dn - 1) * L);
        }
#pragma unroll
        for (int r = 0; r < k_qa_rows; ++r) {
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) fma4(acc[tt], qs[tt][i0 + 8 * r], w[r]);
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) red[wid][tt][lane] = acc[tt];
    __syncthreads();
    for (int o = threadIdx.x; o < TT * 32; o += blockDim.x) {
        const int tt = o / 32, cc = o % 32;
        const int64_t t = t0 + tt, cidx = cb + cc;
        if (t >= T || cidx >= L4) continue;
        float4 sum = red[0][tt][cc];
#pragma unroll
        for (int ww = 1; ww < 8; ++ww) {
            const float4 v = red[ww][tt][cc];
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        reinterpret_cast<float4 *>(qlat + (t * H + h) * L)[cidx] = sum;
    }
}

// The key tile of the v3 / v4 attention kernels. mla_key_rows: key j of token t (j < j1) -> the sources of its latent and
// rope parts (null when masked or past the range): this step's tokens from c / kr (their cache rows are written beside
// the kernel), earlier positions from the paged cache; a selected position past the token's own sets bad and is masked.
__device__ __forceinline__ void mla_key_rows(int64_t j, int64_t j1, const float * c, const float * kr, const float * cache,
                                             const int32_t * sel, int64_t topk, const dbatch & b, int s, int64_t t,
                                             int64_t pos, int64_t p0, int64_t tok0, int64_t L, int64_t dr, int W,
                                             const float *& src_c, const float *& src_r, bool & bad) {
    const float *rc = nullptr, *rr = nullptr;
    if (j < j1) {
        int64_t p = j;
        if (sel) {
            p = sel[t * topk + j];
            if (p > pos) {
                bad = true;
                p = -1;
            }
        }
        if (p >= p0) {   // a token of this step: its row is not in the cache yet (written beside this kernel)
            const int64_t tp = tok0 + p - p0;
            rc = c + tp * L;
            rr = kr + tp * dr;
        } else if (p >= 0) {
            rc = cache + cache_row(b, s, p) * W;
            rr = rc + L;
        }
    }
    src_c = rc;
    src_r = rr;
}
// mla_tile_copy: the tile's k_v2_keys rows [c | kr] into cs (row stride S float4s) by cp.async, rows over the block's
// NW warps; a masked row is zero-filled.
template <int NW>
__device__ __forceinline__ void mla_tile_copy(float4 * cs, int S, int W4, int L4, const float * const * src_c,
                                              const float * const * src_r, const float * cache, int wid, int lane) {
    for (int r = wid; r < k_v2_keys; r += NW) {
        const float * rc = src_c[r];
        const float * rr = src_r[r];
        for (int cc = lane; cc < W4; cc += 32) {
            const float * src = cc < L4 ? rc + 4 * cc : rr + 4 * (cc - L4);
            cp_async16_zfill(cs + r * S + cc, rc ? src : cache, rc ? 16 : 0);
        }
    }
}

// mla_q_rows: the query rows of heads h0 .. h0 + HG - 1 of token t into qs by cp.async: each head's n4 float4s at
// src + (t * H + h) * row + off go to qs row hh (stride qs_s float4s) from column qs_c; heads past H are zero-filled.
__device__ __forceinline__ void mla_q_rows(float4 * qs, int qs_s, int qs_c, int n4, const float * src, int64_t row,
                                           int64_t off, int64_t t, int64_t h0, int64_t H, int HG) {
    for (int i = threadIdx.x; i < HG * n4; i += blockDim.x) {
        const int hh = i / n4, cc = i % n4;
        const int64_t h = h0 + hh;
        cp_async16_zfill(qs + hh * qs_s + qs_c + cc, h < H ? src + (t * H + h) * row + off + 4 * cc : src, h < H ? 16 : 0);
    }
}

// Block per (token, group of k_v2_warps * HPW heads) x key range of kpb keys (a multiple of 32). Shapes as v2, plus c
// and kr 16-byte aligned. Dynamic shared memory: mla_v3_smem(HPW, L + dr).
template <int HPW>
__global__ void __launch_bounds__(k_v2_warps * 32, 2) k_mla_attn_v3(
    const float * __restrict__ q, const float * __restrict__ qlat, const float * __restrict__ c, const float * __restrict__ kr,
    int64_t H, int64_t dn, int64_t dr, int64_t L, float scale, const float * __restrict__ cache,
    const int32_t * __restrict__ sel, int64_t topk, dbatch b, int64_t kpb, float * __restrict__ olat,
    float * __restrict__ part_acc, float * __restrict__ part_ml, int * err) {
    constexpr int HG = k_v2_warps * HPW;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t G = (H + HG - 1) / HG;
    const int64_t t = blockIdx.x / G, h0 = (blockIdx.x % G) * HG;
    // ---- before pdl_wait: nothing here is written by q_absorb (the kernel just before) ----
    const int s = b.tok_seq[t];
    const int64_t p0 = b.pos0[s], tok0 = b.seq_start[s];
    const int64_t pos = p0 + t - tok0;
    const int W = int(L + dr), W4 = W / 4, S = W4 | 1, L4 = int(L / 4);
    extern __shared__ float4 sm4[];
    float4 * cs = sm4;                                                        // [k_v2_keys][S] key rows [c | kr]
    float4 * qs = cs + k_v2_keys * S;                                         // [HG][S] [q_lat | q_rope]
    float * ps = reinterpret_cast<float *>(qs + HG * S);                      // [HG][k_v2_keys]
    const float ** src_c = reinterpret_cast<const float **>(ps + HG * k_v2_keys);   // [k_v2_keys] latent part, null: masked
    const float ** src_r = src_c + k_v2_keys;                                 // [k_v2_keys] rope part
    const int64_t n_keys = sel ? topk : pos + 1;
    const int64_t j0 = int64_t(blockIdx.y) * kpb, j1 = min(n_keys, j0 + kpb);
    bool bad = false;   // a selected position past the token's own (reported after the wait: no write before it)
    // q_rope rows of the group
    mla_q_rows(qs, S, L4, W4 - L4, q, dn + dr, dn, t, h0, H, HG);
    // the row sources of the tile at jt (warp 0), then every warp's cp.async of its rows
    auto issue_tile = [&](int64_t jt) {
        if (wid == 0)
            mla_key_rows(jt + lane, j1, c, kr, cache, sel, topk, b, s, t, pos, p0, tok0, L, dr, W, src_c[lane], src_r[lane],
                         bad);
        __syncthreads();
        mla_tile_copy<k_v2_warps>(cs, S, W4, L4, src_c, src_r, cache, wid, lane);
    };
    if (j0 < j1) issue_tile(j0);
    pdl_wait();
    pdl_trigger();
    // ---- after the wait: q_lat ----
    mla_q_rows(qs, S, 0, L4, qlat, L, 0, t, h0, H, HG);
    cp_async_commit_wait_all();
    __syncthreads();
    float m[HPW], lsum[HPW];
    float4 acc[HPW][4];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        m[hh] = -INFINITY;
        lsum[hh] = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[hh][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const float4 * qw = qs + wid * HPW * S;
    for (int64_t jt = j0; jt < j1; jt += k_v2_keys) {
        if (jt != j0) {
            __syncthreads();   // the previous tile's readers are done
            issue_tile(jt);
            cp_async_commit_wait_all();
            __syncthreads();
        }
        const bool kv = src_c[lane] != nullptr;
        float sx[HPW], sy[HPW], sz[HPW], sw[HPW];
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) sx[hh] = sy[hh] = sz[hh] = sw[hh] = 0.0f;
        const float4 * cr = cs + lane * S;
#pragma unroll 4
        for (int cc = 0; cc < W4; ++cc) {
            const float4 kv4 = cr[cc];
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) {
                const float4 qv = qw[hh * S + cc];
                sx[hh] = fmaf(qv.x, kv4.x, sx[hh]);
                sy[hh] = fmaf(qv.y, kv4.y, sy[hh]);
                sz[hh] = fmaf(qv.z, kv4.z, sz[hh]);
                sw[hh] = fmaf(qv.w, kv4.w, sw[hh]);
            }
        }
#pragma unroll
        for (int hh = 0; hh < HPW; ++hh) {
            const float sc = kv ? ((sx[hh] + sy[hh]) + (sz[hh] + sw[hh])) * scale : -INFINITY;
            const float mn = fmaxf(m[hh], warp_max(sc));
            float p = 0.0f, corr = 1.0f;
            if (mn != -INFINITY) {
                p = kv ? expf(sc - mn) : 0.0f;
                corr = expf(m[hh] - mn);
            }
            lsum[hh] = lsum[hh] * corr + warp_sum(p);
            m[hh] = mn;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[hh][k].x *= corr;
                acc[hh][k].y *= corr;
                acc[hh][k].z *= corr;
                acc[hh][k].w *= corr;
            }
            ps[(wid * HPW + hh) * k_v2_keys + lane] = p;
        }
        __syncwarp();
        const int nk = int(min(int64_t(k_v2_keys), j1 - jt));
        for (int j = 0; j < nk; ++j) {
            float pj[HPW];
#pragma unroll
            for (int hh = 0; hh < HPW; ++hh) pj[hh] = ps[(wid * HPW + hh) * k_v2_keys + j];
            const float4 * crow = cs + j * S;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int cc = lane + 32 * k;
                if (cc < L4) {
                    const float4 cv = crow[cc];
#pragma unroll
                    for (int hh = 0; hh < HPW; ++hh) fma4(acc[hh][k], pj[hh], cv);
                }
            }
        }
    }
    if (bad) atomicOr(err + ERR_SEL_RANGE, 1);
    const int64_t ns = gridDim.y;
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const int64_t h = h0 + wid * HPW + hh;
        if (h >= H) continue;
        const int64_t th = t * H + h;
        if (part_acc) {   // unnormalised partial of this key range, merged by k_mla_out_v3
            float4 * pa = reinterpret_cast<float4 *>(part_acc + (th * ns + blockIdx.y) * L);
            if (lane == 0) {
                part_ml[(th * ns + blockIdx.y) * 2] = m[hh];
                part_ml[(th * ns + blockIdx.y) * 2 + 1] = lsum[hh];
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int cc = lane + 32 * k;
                if (cc < L4) pa[cc] = acc[hh][k];
            }
            continue;
        }
        if (m[hh] == -INFINITY && lane == 0 && sel) atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
        const float inv = lsum[hh] > 0.0f ? 1.0f / lsum[hh] : 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int cc = lane + 32 * k;
            if (cc < L4)
                reinterpret_cast<float4 *>(olat + th * L)[cc] =
                    make_float4(acc[hh][k].x * inv, acc[hh][k].y * inv, acc[hh][k].z * inv, acc[hh][k].w * inv);
        }
    }
}

// o [T, H, dv] as k_mla_out_v2; o_lat from the ns <= k_v3_tiles_max partials when part_acc is set (the combine), else
// read from olat.
template <wtype WT, int TT>
__global__ void __launch_bounds__(256) k_mla_out_v3(const float * __restrict__ olat, const float * __restrict__ part_acc,
                                                    const float * __restrict__ part_ml, int64_t ns,
                                                    const int32_t * __restrict__ sel, int * err, const void * __restrict__ kv_b,
                                                    int64_t T, int64_t H, int64_t dn, int64_t dv, int64_t L,
                                                    float * __restrict__ o) {
    __shared__ float4 os[TT][128];
    __shared__ float fw[TT][k_v3_tiles_max];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t L4 = L / 4, nrc = (dv + 31) / 32;
    const int64_t h = blockIdx.x / nrc, r0 = (blockIdx.x % nrc) * 32 + wid * 4;
    const int64_t t0 = int64_t(blockIdx.y) * TT;
    float4 w[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int64_t i = min(r0 + r, dv - 1), c4 = min(int64_t(lane + 32 * k), L4 - 1);
            w[r][k] = wload4<WT>(kv_b, (h * (dn + dv) + dn + i) * L + 4 * c4);
        }
    }
    pdl_enter();   // the weights above are constant; the partials / o_lat come from the attention just before
    if (part_acc) {
        for (int tt = wid; tt < TT; tt += 8) {   // the exp weights of (token, head): lanes over the partials
            const int64_t t = t0 + tt;
            if (t >= T) break;
            const float * ml = part_ml + (t * H + h) * ns * 2;
            const float ma = lane < ns ? ml[2 * lane] : -INFINITY, la = lane < ns ? ml[2 * lane + 1] : 0.0f;
            const float mb = lane + 32 < ns ? ml[2 * (lane + 32)] : -INFINITY;
            const float lb = lane + 32 < ns ? ml[2 * (lane + 32) + 1] : 0.0f;
            const float M = warp_max(fmaxf(ma, mb));
            const float fa = ma == -INFINITY ? 0.0f : expf(ma - M), fb = mb == -INFINITY ? 0.0f : expf(mb - M);
            const float den = warp_sum(fa * la + fb * lb);
            const float inv = den > 0.0f ? 1.0f / den : 0.0f;
            if (lane < ns) fw[tt][lane] = fa * inv;
            if (lane + 32 < ns) fw[tt][lane + 32] = fb * inv;
            if (M == -INFINITY && lane == 0 && sel && blockIdx.x % nrc == 0) atomicOr(err + ERR_SEL_RANGE, 1);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < TT * 128; i += blockDim.x) {
            const int tt = i / 128, cc = i % 128;
            const int64_t t = t0 + tt;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t < T && cc < L4) {
                const float4 * pa = reinterpret_cast<const float4 *>(part_acc + (t * H + h) * ns * L) + cc;
#pragma unroll 8
                for (int64_t k = 0; k < ns; ++k) fma4(v, fw[tt][k], pa[k * L4]);
            }
            os[tt][cc] = v;
        }
    } else {
        for (int i = threadIdx.x; i < TT * 128; i += blockDim.x) {
            const int tt = i / 128, cc = i % 128;
            const int64_t t = t0 + tt;
            os[tt][cc] = t < T && cc < L4 ? reinterpret_cast<const float4 *>(olat + (t * H + h) * L)[cc]
                                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    __syncthreads();
    for (int tt = 0; tt < TT; ++tt) {
        const int64_t t = t0 + tt;
        if (t >= T) break;
        float pr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float4 ov = os[tt][lane + 32 * k];
#pragma unroll
            for (int r = 0; r < 4; ++r) pr[r] += w[r][k].x * ov.x + w[r][k].y * ov.y + w[r][k].z * ov.z + w[r][k].w * ov.w;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) pr[r] = warp_sum(pr[r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
                if (r0 + r < dv) o[(t * H + h) * dv + r0 + r] = pr[r];
        }
    }
}

size_t mla_v3_smem(int hpw, int64_t W) {
    const int64_t S = (W / 4) | 1, HG = int64_t(k_v2_warps) * hpw;
    return size_t((k_v2_keys + HG) * S * 16 + HG * k_v2_keys * 4 + 2 * k_v2_keys * 8);
}
template <int HPW>
cudaError_t mla_v3_attrs() {
    static const cudaError_t e = [] {
        cudaError_t r = cudaFuncSetAttribute(k_mla_attn_v3<HPW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(mla_v3_smem(HPW, 512 + 64)));
        if (r == cudaSuccess)
            r = cudaFuncSetAttribute(k_mla_attn_v3<HPW>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared));
        return r;
    }();
    return e;
}

// ---- Decode v4 attention (cuda_options::mla_attn_v4; with v3, at v3's 8-head groups: T < 8) ----
// Why v3's attention is slow (Nsight Compute on the H200, K3 widths, ctx 1024, grid 12x17 of 128 threads: 37 us, 143
// registers, 94 KB dynamic shared memory -> 2 blocks per SM, 1.5 warps active per scheduler, 0.30 eligible, top stall
// short scoreboard, L1 35%, DRAM 1.5%; on the 48B geometry, grid 4x33 = one 4-warp block per SM, 19 us of the graph
// step per MLA layer for 2.5 MB): it is latency-bound. Each warp walks its 2 heads over the whole row, ~3.4k dependent
// instructions per tile (scores: lane = key, 144 float4 steps x 2 heads; values: 32 keys x 2 heads x all 512 columns),
// with only 4 warps per SM to hide the shared-memory latency.
// v4, same grid, inputs, pre-wait work and partial format as v3 (k_mla_out_v3 unchanged), 8 warps per block of 8 heads:
//  * scores: the 576 dims split over the 8 warps (18 float4 each); lane = key, each lane the 8 heads' partial dot products
//    over its warp's slice (q broadcast from shared memory); partials [warp][head][key] to shared memory, then thread
//    (head = warp, key = lane) sums the 8 in warp order (deterministic). With dr = 64 the partials live in the rope
//    columns of the key tile (dead once the scores are read; one barrier more), so shared memory stays at v3's.
//  * online softmax: warp h owns head h (one warp max + one warp sum per tile, as v3), p [key][head] and the correction
//    factors to shared memory.
//  * values: the 512 latent columns split over the 8 warps (a float2 per lane), each lane acc[8 heads][2]; per key one
//    float2 of the row and the 8 p (two float4 broadcasts), 16 FMAs.
// Per warp per tile ~18 x (9 loads + 32 FMAs) for the scores and 32 x (3 loads + 16 FMAs) for the values instead of
// ~3.4k dependent instructions, 8 warps per block instead of 4. fp32; the score summation order differs from v3 (f32
// tolerance). Predicted (before any run): 48B attention ~19 -> ~5 us per layer, K3 (the ncu geometry) ~37 -> ~10 us.
// Measured (session 9 calls C, D; kernel timeline of the graph step, H200): 48B 18.9 -> 11.7 us, K3 34.8 -> 20.4 us. ncu
// (call D, 48B): 10.5 us isolated, 128 registers, 2 blocks per SM, 0.45 eligible warps per scheduler: still latency-bound;
// the next step is fewer dependent shared-memory round trips per tile (5-6 barriers), not more warps.
constexpr int k_v4_warps = 8;   // warps of the block = heads per block (warp h owns head h's softmax)
constexpr int k_v4_heads = 8;
constexpr int k_v4_sp_floats = k_v4_warps * k_v4_heads * k_v2_keys;   // the score partials [warp][head][key]

// The partials fit in the rope columns (and the row pad) of the key tile when each of its 32 rows has 64 floats there.
__host__ __device__ __forceinline__ bool mla_v4_sp_alias(int S, int L4) { return 4 * (S - L4) * k_v2_keys >= k_v4_sp_floats; }

// Block per (token, group of 8 heads) x key range of kpb keys (a multiple of 32): v3's grid at HPW 2. Shapes as v3.
// Dynamic shared memory: mla_v4_smem(L, dr).
__global__ void __launch_bounds__(k_v4_warps * 32, 2) k_mla_attn_v4(
    const float * __restrict__ q, const float * __restrict__ qlat, const float * __restrict__ c, const float * __restrict__ kr,
    int64_t H, int64_t dn, int64_t dr, int64_t L, float scale, const float * __restrict__ cache,
    const int32_t * __restrict__ sel, int64_t topk, dbatch b, int64_t kpb, float * __restrict__ olat,
    float * __restrict__ part_acc, float * __restrict__ part_ml, int * err) {
    constexpr int HG = k_v4_heads;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t G = (H + HG - 1) / HG;
    const int64_t t = blockIdx.x / G, h0 = (blockIdx.x % G) * HG;
    // ---- before pdl_wait: nothing here is written by q_absorb (the kernel just before) ----
    const int s = b.tok_seq[t];
    const int64_t p0 = b.pos0[s], tok0 = b.seq_start[s];
    const int64_t pos = p0 + t - tok0;
    const int W = int(L + dr), W4 = W / 4, S = W4 | 1, L4 = int(L / 4);
    extern __shared__ float4 sm4[];
    float4 * cs = sm4;                                                     // [k_v2_keys][S] key rows [c | kr]
    float4 * qs = cs + k_v2_keys * S;                                      // [HG][W4] [q_lat | q_rope] (broadcast reads)
    float * ps = reinterpret_cast<float *>(qs + HG * W4);                  // [k_v2_keys][HG] p of the tile
    float * cf = ps + k_v2_keys * HG;                                      // [HG] correction factors of the tile
    float * ls = cf + HG;                                                  // [HG] running softmax sums
    const float ** src_c = reinterpret_cast<const float **>(ls + HG);     // [k_v2_keys] latent part, null: masked
    const float ** src_r = src_c + k_v2_keys;                              // [k_v2_keys] rope part
    // score partials: row i / 64, column i % 64 of [rows][sp_rs] at sp_base (the tile's rope columns, or their own region)
    const bool sp_alias = mla_v4_sp_alias(S, L4);
    float * sp_base = sp_alias ? reinterpret_cast<float *>(cs) + L : reinterpret_cast<float *>(src_r + k_v2_keys);
    const int sp_rs = sp_alias ? 4 * S : 64;
    const int64_t n_keys = sel ? topk : pos + 1;
    const int64_t j0 = int64_t(blockIdx.y) * kpb, j1 = min(n_keys, j0 + kpb);
    bool bad = false;   // a selected position past the token's own (reported after the wait: no write before it)
    // q_rope rows of the group
    mla_q_rows(qs, W4, L4, W4 - L4, q, dn + dr, dn, t, h0, H, HG);
    // the row sources of the tile at jt (warp 0), then every warp's cp.async of its rows (as v3)
    auto issue_tile = [&](int64_t jt) {
        if (wid == 0)
            mla_key_rows(jt + lane, j1, c, kr, cache, sel, topk, b, s, t, pos, p0, tok0, L, dr, W, src_c[lane], src_r[lane],
                         bad);
        __syncthreads();
        mla_tile_copy<k_v4_warps>(cs, S, W4, L4, src_c, src_r, cache, wid, lane);
    };
    if (j0 < j1) issue_tile(j0);
    pdl_wait();
    pdl_trigger();
    // ---- after the wait: q_lat ----
    mla_q_rows(qs, W4, 0, L4, qlat, L, 0, t, h0, H, HG);
    cp_async_commit_wait_all();
    __syncthreads();
    // this warp's dims for the scores (float4 columns [cb, ce)) and latent columns for the values (col, col + 1)
    const int CW = (W4 + k_v4_warps - 1) / k_v4_warps, cb = min(W4, wid * CW), ce = min(W4, cb + CW);
    const int col = 2 * (wid * 32 + lane);
    const bool vcol = col < L;
    float m = -INFINITY, lsum = 0.0f;   // head h0 + wid (this warp's), the same in every lane
    float acc[HG][2];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) acc[hh][0] = acc[hh][1] = 0.0f;
    const float4 * ps4 = reinterpret_cast<const float4 *>(ps);
    for (int64_t jt = j0; jt < j1; jt += k_v2_keys) {
        if (jt != j0) {
            __syncthreads();   // the previous tile's readers are done
            issue_tile(jt);
            cp_async_commit_wait_all();
            __syncthreads();
        }
        // scores, partial over this warp's dims: lane = key, the 8 heads
        {
            float sx[HG], sy[HG], sz[HG], sw[HG];
#pragma unroll
            for (int hh = 0; hh < HG; ++hh) sx[hh] = sy[hh] = sz[hh] = sw[hh] = 0.0f;
            const float4 * cr = cs + lane * S;
#pragma unroll 2
            for (int cc = cb; cc < ce; ++cc) {
                const float4 kv4 = cr[cc];
#pragma unroll
                for (int hh = 0; hh < HG; ++hh) {
                    const float4 qv = qs[hh * W4 + cc];
                    sx[hh] = fmaf(qv.x, kv4.x, sx[hh]);
                    sy[hh] = fmaf(qv.y, kv4.y, sy[hh]);
                    sz[hh] = fmaf(qv.z, kv4.z, sz[hh]);
                    sw[hh] = fmaf(qv.w, kv4.w, sw[hh]);
                }
            }
            if (sp_alias) __syncthreads();   // every warp has read the rope columns the partials overwrite
            // partial (warp, head hh) at i = (wid * HG + hh) * 32 + lane: row wid * 4 + hh / 2, column (hh % 2) * 32 + lane
#pragma unroll
            for (int hh = 0; hh < HG; ++hh)
                sp_base[(wid * (HG / 2) + hh / 2) * sp_rs + (hh % 2) * 32 + lane] = (sx[hh] + sy[hh]) + (sz[hh] + sw[hh]);
        }
        __syncthreads();
        // online softmax of head h0 + wid: the 8 partials summed in warp order, lane = key
        {
            const bool kv = src_c[lane] != nullptr;
            const float * spr = sp_base + (wid / 2) * sp_rs + (wid % 2) * 32 + lane;
            float dot = spr[0];
#pragma unroll
            for (int w = 1; w < k_v4_warps; ++w) dot += spr[w * (HG / 2) * sp_rs];
            const float sc = kv ? dot * scale : -INFINITY;
            const float mn = fmaxf(m, warp_max(sc));
            float p = 0.0f, corr = 1.0f;
            if (mn != -INFINITY) {
                p = kv ? expf(sc - mn) : 0.0f;
                corr = expf(m - mn);
            }
            lsum = lsum * corr + warp_sum(p);
            m = mn;
            ps[lane * HG + wid] = p;
            if (lane == 0) {
                cf[wid] = corr;
                ls[wid] = lsum;
            }
        }
        __syncthreads();
        // values: this warp's two latent columns, the 8 heads, keys in order
        if (vcol) {
            const float4 ca = reinterpret_cast<const float4 *>(cf)[0], cb4 = reinterpret_cast<const float4 *>(cf)[1];
            const float corr[HG] = {ca.x, ca.y, ca.z, ca.w, cb4.x, cb4.y, cb4.z, cb4.w};
#pragma unroll
            for (int hh = 0; hh < HG; ++hh) {
                acc[hh][0] *= corr[hh];
                acc[hh][1] *= corr[hh];
            }
            const int nk = int(min(int64_t(k_v2_keys), j1 - jt));
            const float * cbase = reinterpret_cast<const float *>(cs) + col;
#pragma unroll 4
            for (int j = 0; j < nk; ++j) {
                const float2 cv = *reinterpret_cast<const float2 *>(cbase + j * 4 * S);
                const float4 pa = ps4[2 * j], pb = ps4[2 * j + 1];
                const float pj[HG] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
                for (int hh = 0; hh < HG; ++hh) {
                    acc[hh][0] = fmaf(pj[hh], cv.x, acc[hh][0]);
                    acc[hh][1] = fmaf(pj[hh], cv.y, acc[hh][1]);
                }
            }
        }
    }
    if (bad) atomicOr(err + ERR_SEL_RANGE, 1);
    const int64_t ns = gridDim.y;
    {   // m, l of this warp's head
        const int64_t h = h0 + wid;
        if (h < H && lane == 0) {
            const int64_t th = t * H + h;
            if (part_acc) {
                part_ml[(th * ns + blockIdx.y) * 2] = m;
                part_ml[(th * ns + blockIdx.y) * 2 + 1] = lsum;
            } else if (m == -INFINITY && sel) {
                atomicOr(err + ERR_SEL_RANGE, 1);   // no position selected
            }
        }
    }
    if (!vcol) return;
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
        const int64_t h = h0 + hh;
        if (h >= H) continue;
        const int64_t th = t * H + h;
        if (part_acc) {   // unnormalised partial of this key range, merged by k_mla_out_v3
            *reinterpret_cast<float2 *>(part_acc + (th * ns + blockIdx.y) * L + col) = make_float2(acc[hh][0], acc[hh][1]);
            continue;
        }
        // the head's sum as its warp left it after the last tile (the barrier after the softmax orders it)
        const float l = j0 < j1 ? ls[hh] : 0.0f;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        *reinterpret_cast<float2 *>(olat + th * L + col) = make_float2(acc[hh][0] * inv, acc[hh][1] * inv);
    }
}

size_t mla_v4_smem(int64_t L, int64_t dr) {
    const int64_t W4 = (L + dr) / 4, S = W4 | 1, L4 = L / 4;
    const int64_t base = k_v2_keys * S * 16 + k_v4_heads * W4 * 16 + (k_v2_keys * k_v4_heads + 2 * k_v4_heads) * 4 +
                         2 * k_v2_keys * 8;
    return size_t(mla_v4_sp_alias(int(S), int(L4)) ? base : base + k_v4_sp_floats * 4);
}
// Once (see mla_v2_attrs): the largest dynamic shared memory over the supported shapes (L 512, any dr <= 64).
cudaError_t mla_v4_attrs() {
    static const cudaError_t e = [] {
        size_t mx = 0;
        for (int64_t dr = 0; dr <= 64; dr += 4) mx = std::max(mx, mla_v4_smem(512, dr));
        cudaError_t r = cudaFuncSetAttribute(k_mla_attn_v4, cudaFuncAttributeMaxDynamicSharedMemorySize, int(mx));
        if (r == cudaSuccess)
            r = cudaFuncSetAttribute(k_mla_attn_v4, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared));
        return r;
    }();
    return e;
}

template <wtype WT>
void launch_mla_v3_linears(bool out, const float * x, dweight kv_b, int64_t T, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                           int64_t L, float * y, const float * c, const float * kr, float * cache, const dbatch & b,
                           const float * part_acc, const float * part_ml, int64_t ns, const int32_t * sel, int * err,
                           cudaStream_t st) {
    const unsigned ty1 = unsigned(T), ty8 = unsigned((T + 7) / 8);
    if (!out) {
        const unsigned gx = unsigned(H * ((L / 4 + 31) / 32)) + 1;   // + the cache-write column
        if (T == 1)
            launch_k(k_mla_q_absorb_v3<WT, 1>, dim3(gx, ty1), 256, 0, st, x, kv_b.data, T, H, dn, dr, dv, L, y, c, kr, cache, b);
        else
            launch_k(k_mla_q_absorb_v3<WT, 8>, dim3(gx, ty8), 256, 0, st, x, kv_b.data, T, H, dn, dr, dv, L, y, c, kr, cache, b);
    } else {
        const unsigned gx = unsigned(H * ((dv + 31) / 32));
        if (T == 1)
            launch_k(k_mla_out_v3<WT, 1>, dim3(gx, ty1), 256, 0, st, x, part_acc, part_ml, ns, sel, err, kv_b.data, T, H, dn,
                     dv, L, y);
        else
            launch_k(k_mla_out_v3<WT, 8>, dim3(gx, ty8), 256, 0, st, x, part_acc, part_ml, ns, sel, err, kv_b.data, T, H, dn,
                     dv, L, y);
    }
}
void launch_mla_v3_linears_any(bool out, const float * x, dweight kv_b, int64_t T, int64_t H, int64_t dn, int64_t dr,
                               int64_t dv, int64_t L, float * y, const float * c, const float * kr, float * cache,
                               const dbatch & b, const float * part_acc, const float * part_ml, int64_t ns,
                               const int32_t * sel, int * err, cudaStream_t st) {
    switch (kv_b.type) {
        case wtype::BF16:
            launch_mla_v3_linears<wtype::BF16>(out, x, kv_b, T, H, dn, dr, dv, L, y, c, kr, cache, b, part_acc, part_ml, ns, sel,
                                               err, st);
            break;
        case wtype::F16:
            launch_mla_v3_linears<wtype::F16>(out, x, kv_b, T, H, dn, dr, dv, L, y, c, kr, cache, b, part_acc, part_ml, ns, sel,
                                              err, st);
            break;
        default:
            launch_mla_v3_linears<wtype::F32>(out, x, kv_b, T, H, dn, dr, dv, L, y, c, kr, cache, b, part_acc, part_ml, ns, sel,
                                              err, st);
            break;
    }
}

// ---- The MLA kv_a split (cuda_options::fuse_mla_kv; fuse-plan.h rule 6) ----
// cols(x, 0, L) -> RMS_NORM -> c and cols(x, L, W - L) -> kr of the model graph in one launch: block per token, the
// RMS_NORM exactly as k_norm<0> with the same thread count (norm.cu threads_for: 256 for 256 <= L < 4096), so c is
// bitwise the unfused kernel's; the raw columns written too (every node of the pattern keeps its output).
__global__ void __launch_bounds__(1024) k_mla_kv_split(const float * __restrict__ x, int64_t W, int64_t L, dweight w, float eps,
                                                    float * __restrict__ cols, float * __restrict__ c,
                                                    float * __restrict__ kr) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    const float * xr = x + t * W;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
        const float d = xr[i];
        ss += d * d;
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / float(L) + eps);
    for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
        const float v = xr[i];
        cols[t * L + i] = v;
        c[t * L + i] = v * inv * wload_or(w, i, 1.0f);
    }
    for (int64_t i = threadIdx.x; i < W - L; i += blockDim.x) kr[t * (W - L) + i] = xr[L + i];
}

} // namespace

bool mla_v2_supported(const mla_shape & d) {
    return d.kv_lora_rank > 0 && d.kv_lora_rank <= 512 && d.kv_lora_rank % 4 == 0 && d.head_dim_rope <= 64 &&
           d.head_dim_rope % 4 == 0 && d.head_dim_nope <= 256 && d.head_dim_nope % 4 == 0 && d.head_dim_v > 0;
}

int mla_split_for(int64_t T, const mla_shape & d, bool enabled, bool v2) {
    if (!enabled) return 1;
    if (v2 && mla_v2_supported(d)) {
        // At most one wave of 2 resident blocks per SM of an H200 (132 SMs) over (token, head group) x key ranges; the
        // launcher caps the ranges at one 32-key tile each (it knows the step's longest context).
        const int64_t hg = int64_t(k_v2_warps) * mla_v2_hpw(T), blocks = T * ((d.n_head + hg - 1) / hg);
        const int64_t want = 264 / blocks;
        return int(want < 1 ? 1 : want > k_v2_max_split ? k_v2_max_split : want);
    }
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
                            float * scratch, float * o, int * err, cudaStream_t st, bool v2, bool v3, bool v4) {
    const int64_t T = b.n_tok, H = d.n_head, dn = d.head_dim_nope, dr = d.head_dim_rope, dv = d.head_dim_v,
                  L = d.kv_lora_rank;
    if (T == 0) return cudaGetLastError();
    if (L > 512 || dr > 64) return cudaErrorInvalidValue;
    float * qlat = scratch;
    float * olat = scratch + T * H * L;
    // v2 reads q, the q_rope rows and the cache rows as float4s: 16-byte aligned bases (device allocations are).
    const bool aligned = (reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(cache)) % 16 == 0;
    const bool aligned_ckr = (reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(kr)) % 16 == 0;
    if (v2 && v3 && mla_v2_supported(d) && aligned && aligned_ckr) {
        if (n_split < 1 || n_split > k_v2_max_split) return cudaErrorInvalidValue;
        // whole 32-key tiles per range: per = ceil(tiles / n_split) tiles each, ns = ceil(tiles / per) ranges
        const int64_t max_keys = sel ? topk : int64_t(b.max_pos), tiles = std::max<int64_t>(1, (max_keys + k_v2_keys - 1) / k_v2_keys);
        const int64_t per = (tiles + n_split - 1) / n_split, ns = (tiles + per - 1) / per;
        float * part_acc = ns > 1 ? scratch + 2 * T * H * L : nullptr;
        float * part_ml = ns > 1 ? part_acc + T * H * ns * L : nullptr;   // within mla_scratch_floats (ns <= n_split)
        launch_mla_v3_linears_any(false, q, kv_b, T, H, dn, dr, dv, L, qlat, c, kr, cache, b, nullptr, nullptr, 0, sel, err, st);
        const int hpw = mla_v2_hpw(T);
        const int64_t hg = int64_t(k_v2_warps) * hpw, G = (H + hg - 1) / hg;
        const dim3 grid(unsigned(T * G), unsigned(ns));
        if (v4 && hg == k_v4_heads) {   // v4's attention: v3's grid at 8-head groups (T < 8), else v3's
            const cudaError_t e = mla_v4_attrs();
            if (e != cudaSuccess) return e;
            launch_k(k_mla_attn_v4, grid, k_v4_warps * 32, mla_v4_smem(L, dr), st, q, qlat, c, kr, H, dn, dr, L, scale, cache,
                     sel, topk, b, per * k_v2_keys, olat, part_acc, part_ml, err);
            launch_mla_v3_linears_any(true, olat, kv_b, T, H, dn, dr, dv, L, o, c, kr, cache, b, part_acc, part_ml, ns, sel, err,
                                      st);
            return cudaGetLastError();
        }
        const size_t smem = mla_v3_smem(hpw, L + dr);
        const cudaError_t e = hpw == 4 ? mla_v3_attrs<4>() : mla_v3_attrs<2>();
        if (e != cudaSuccess) return e;
        if (hpw == 4) {
            launch_k(k_mla_attn_v3<4>, grid, k_v2_warps * 32, smem, st, q, qlat, c, kr, H, dn, dr, L, scale, cache, sel, topk, b,
                     per * k_v2_keys, olat, part_acc, part_ml, err);
        } else {
            launch_k(k_mla_attn_v3<2>, grid, k_v2_warps * 32, smem, st, q, qlat, c, kr, H, dn, dr, L, scale, cache, sel, topk, b,
                     per * k_v2_keys, olat, part_acc, part_ml, err);
        }
        launch_mla_v3_linears_any(true, olat, kv_b, T, H, dn, dr, dv, L, o, c, kr, cache, b, part_acc, part_ml, ns, sel, err, st);
        return cudaGetLastError();
    }
    if (v2 && mla_v2_supported(d) && aligned) {
        if (n_split < 1 || n_split > k_v2_max_split) return cudaErrorInvalidValue;
        // At most one range per 32-key tile of the longest key list of the step (fewer partials to merge).
        const int64_t max_keys = sel ? topk : int64_t(b.max_pos), tiles = (max_keys + k_v2_keys - 1) / k_v2_keys;
        const int ns = int(std::max<int64_t>(1, std::min<int64_t>(n_split, tiles)));
        float * part = ns > 1 ? scratch + 2 * T * H * L : nullptr;
        launch_k(k_mla_cache_write, unsigned(T), 128, 0, st, c, kr, L, dr, cache, b);
        launch_mla_v2_linear_any(false, q, kv_b, T, H, dn, dr, dv, L, qlat, st);
        const int hpw = mla_v2_hpw(T);
        const int64_t hg = int64_t(k_v2_warps) * hpw, G = (H + hg - 1) / hg;
        const size_t smem = mla_v2_smem(hpw, L + dr);
        const dim3 grid(unsigned(T * G), unsigned(ns));
        const cudaError_t e = hpw == 4 ? mla_v2_attrs<4>() : mla_v2_attrs<2>();
        if (e != cudaSuccess) return e;
        if (hpw == 4) {
            launch_k(k_mla_attn_v2<4>, grid, k_v2_warps * 32, smem, st, q, qlat, H, dn, dr, L, scale, cache, sel, topk, b,
                     olat, part, err);
        } else {
            launch_k(k_mla_attn_v2<2>, grid, k_v2_warps * 32, smem, st, q, qlat, H, dn, dr, L, scale, cache, sel, topk, b,
                     olat, part, err);
        }
        // one thread per latent column (L <= 512): each sums its ns partials with 8 loads in flight
        const int cthreads = int(std::min<int64_t>(512, (L + 31) / 32 * 32));
        if (part) launch_k(k_mla_combine_v2, unsigned(T * H), cthreads, 0, st, part, int64_t(ns), L, sel, olat, err);
        launch_mla_v2_linear_any(true, olat, kv_b, T, H, dn, dr, dv, L, o, st);
        return cudaGetLastError();
    }
    if (v2 && n_split > 16) n_split = 16;   // a v2 split count on the first kernels (unaligned q or cache): fewer ranges
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

cudaError_t launch_mla_kv_split(const float * x, int64_t T, int64_t W, int64_t L, dweight w, float eps, float * cols, float * c,
                                float * kr, cudaStream_t st) {
    if (L <= 0 || L > W) return cudaErrorInvalidValue;
    // k_norm<0>'s thread count for a row of L (norm.cu threads_for), so that the sums are the same
    const int threads = L >= 4096 ? 1024 : L >= 256 ? 256 : int((L + 31) / 32 * 32);
    if (T > 0) launch_k(k_mla_kv_split, unsigned(T), threads, 0, st, x, W, L, w, eps, cols, c, kr);
    return cudaGetLastError();
}

} // namespace perigee::cuda
