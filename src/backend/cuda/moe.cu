// MOE_ROUTE (router logits, sigmoid/softmax, bias-steered grouped top-k) and MOE_EXPERTS (only the selected
// experts are read; MXFP4/NVFP4 weights are dequantized in registers: Hopper has no FP4 tensor cores).
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"
#include "backend/cuda/fp4.cuh"
#include "backend/cuda/smem-attr.cuh"

#include <atomic>
#include <climits>
#include <mma.h>

namespace perigee::cuda {

namespace {

constexpr int k_route_threads = 256;
constexpr int k_route_max_e = 1024;
constexpr int k_route_max_g = 64;

__global__ void __launch_bounds__(k_route_threads) k_moe_route(const float * __restrict__ x, int64_t D, dweight gate,
                                                               dweight bias, droute c, int32_t * __restrict__ ids,
                                                               float * __restrict__ w) {
    pdl_enter();
    __shared__ float score[k_route_max_e];
    __shared__ float biased[k_route_max_e];
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int64_t E = c.n_expert;
    for (int64_t e = wid; e < E; e += nw) {   // logits in fp32
        float acc = 0.0f;
        for (int64_t i = lane; i < D; i += 32) acc += x[t * D + i] * wload(gate, e * D + i);
        acc = warp_sum(acc);
        if (lane == 0) score[e] = acc;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    // Selection on one thread (E <= 1024, k small): exactly the reference's order of decisions.
    if (c.softmax) {
        float mx = -INFINITY;
        for (int64_t e = 0; e < E; ++e) mx = fmaxf(mx, score[e]);
        double sum = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            score[e] = expf(score[e] - mx);
            sum += score[e];
        }
        for (int64_t e = 0; e < E; ++e) score[e] = float(score[e] / sum);
    } else {
        for (int64_t e = 0; e < E; ++e) score[e] = sigmoid_d(score[e]);
    }
    for (int64_t e = 0; e < E; ++e) biased[e] = score[e] + (bias.data ? wload(bias, e) : 0.0f);
    const bool grouped = c.n_group > 1 && c.topk_group < c.n_group;
    if (grouped) {
        const int64_t gs = E / c.n_group;
        float gscore[k_route_max_g];
        bool keep[k_route_max_g];
        for (int64_t g = 0; g < c.n_group; ++g) {
            float a = -INFINITY, b2 = -INFINITY;   // top-2 of the group
            for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
                const float v = biased[e];
                if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
            }
            gscore[g] = a + (gs > 1 ? b2 : 0.0f);
            keep[g] = false;
        }
        for (int64_t i = 0; i < c.topk_group; ++i) {   // stable: ties to the lower group
            int64_t best = -1;
            for (int64_t g = 0; g < c.n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = true;
        }
        for (int64_t e = 0; e < E; ++e)
            if (!keep[e / gs]) biased[e] = -INFINITY;
    }
    double sum = 0.0;
    int32_t * oid = ids + t * c.topk;
    for (int64_t j = 0; j < c.topk; ++j) {   // descending biased score, ties to the lower id
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= oid[i] == e;
            if (taken) continue;
            if (best < 0 || biased[e] > biased[best]) best = e;
        }
        oid[j] = int32_t(best);
        sum += score[best];
    }
    for (int64_t j = 0; j < c.topk; ++j) {
        float wj = score[oid[j]];
        if (c.renormalize) wj = float(wj / (sum + 1e-20));
        w[t * c.topk + j] = wj * c.scale;
    }
}

__constant__ float k_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__device__ __forceinline__ float e8m0_d(uint8_t b) { return b == 0 ? __int_as_float(0x00400000) : __int_as_float(int(b) << 23); }
__device__ __forceinline__ float e4m3_d(uint8_t b) {
    const int sgn = b >> 7, ex = (b >> 3) & 15, mn = b & 7;
    float v = ex == 0 ? ldexpf(float(mn), -9) : ldexpf(1.0f + float(mn) / 8.0f, ex - 7);
    return sgn ? -v : v;
}

// Dot of row r of an expert matrix with x [in], lanes of one warp split the columns; result on every lane.
__device__ float emat_dot(const dexpert_matrix & m, int64_t r, const float * __restrict__ x) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (m.fmt == 0) {
        const dweight wv{m.w, m.type};
        const int64_t base = r * m.in;
        for (int64_t c = lane; c < m.in; c += 32) acc += wload(wv, base + c) * x[c];
    } else {
        const int64_t nb = m.in / 2;
        const uint8_t * p = m.packed + r * nb;
        const bool mx = m.fmt == 1;
        const int64_t blk = mx ? 32 : 16;
        const uint8_t * sc = m.scale + r * (m.in / blk);
        for (int64_t j = lane; j < nb; j += 32) {
            const uint8_t byte = p[j];
            const int64_t col = 2 * j;
            const uint8_t sb = sc[col / blk];
            const float s = mx ? e8m0_d(sb) : e4m3_d(sb);
            float lo = k_e2m1[byte & 15] * s, hi = k_e2m1[byte >> 4] * s;
            if (!mx) {
                lo *= m.global_scale;
                hi *= m.global_scale;
            }
            acc += lo * x[col] + hi * x[col + 1];
        }
    }
    return warp_sum(acc);
}

constexpr int k_ex_warps = 8;

// hbuf [T*k, F] = act(gate x_t, up x_t) for slot tj = t*k + j: grid (F / warps, T*k), warp per row.
__global__ void __launch_bounds__(k_ex_warps * 32) k_moe_gate_up(const float * __restrict__ x, int64_t Din,
                                                                 const int32_t * __restrict__ ids, int64_t k,
                                                                 const dexpert * __restrict__ ex, int64_t E,
                                                                 dexperts_cfg c, float * __restrict__ hbuf, int * err) {
    pdl_enter();
    const int64_t tj = blockIdx.y;
    const int64_t r = int64_t(blockIdx.x) * k_ex_warps + (threadIdx.x >> 5);
    if (r >= c.d_ff) return;
    const int lane = threadIdx.x & 31;
    const int32_t e = ids[tj];
    if (e < 0 || e >= E) {
        if (lane == 0) {
            atomicOr(err + ERR_EXPERT_ID, 1);
            hbuf[tj * c.d_ff + r] = 0.0f;
        }
        return;
    }
    const float * xt = x + (tj / k) * Din;
    const float ga = emat_dot(ex[e].gate, r, xt);
    const float ua = emat_dot(ex[e].up, r, xt);
    if (lane == 0) hbuf[tj * c.d_ff + r] = c.act == 1 ? situ_d(ga, ua, c.situ_beta, c.situ_linear_beta) : silu_d(ga) * ua;
}

// ybuf [T*k, Dout] = down h: grid (Dout / warps, T*k).
__global__ void __launch_bounds__(k_ex_warps * 32) k_moe_down(const float * __restrict__ hbuf,
                                                              const int32_t * __restrict__ ids,
                                                              const dexpert * __restrict__ ex, int64_t E, dexperts_cfg c,
                                                              float * __restrict__ ybuf) {
    pdl_enter();
    const int64_t tj = blockIdx.y;
    const int64_t r = int64_t(blockIdx.x) * k_ex_warps + (threadIdx.x >> 5);
    if (r >= c.d_out) return;
    const int32_t e = ids[tj];
    const float v = (e < 0 || e >= E) ? 0.0f : emat_dot(ex[e].down, r, hbuf + tj * c.d_ff);
    if ((threadIdx.x & 31) == 0) ybuf[tj * c.d_out + r] = v;
}

// y [T, Dout] = sum_j w[t, j] ybuf[t*k + j] in slot order (fp32), as the reference combines.
__global__ void k_moe_combine(const float * __restrict__ ybuf, const float * __restrict__ w, int64_t T, int64_t k,
                              int64_t Dout, float * __restrict__ y) {
    pdl_enter();
    const int64_t n = T * Dout;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = i / Dout, r = i % Dout;
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) acc += w[t * k + j] * ybuf[(t * k + j) * Dout + r];
        y[i] = acc;
    }
}

} // namespace

cudaError_t launch_moe_route(const float * x, int64_t T, int64_t D, dweight gate, dweight bias, const droute & c,
                             int32_t * ids, float * w, cudaStream_t st) {
    if (c.n_expert > k_route_max_e || c.n_group > k_route_max_g) return cudaErrorInvalidValue;
    if (T > 0) launch_k(k_moe_route, unsigned(T), k_route_threads, 0, st, x, D, gate, bias, c, ids, w);
    return cudaGetLastError();
}

cudaError_t launch_moe_experts(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                               const dexpert * experts, int64_t E, const dexperts_cfg & c, float * scratch, float * y,
                               int * err, cudaStream_t st, bool round_h) {
    if (T * k == 0) return cudaGetLastError();
    float * hbuf = scratch;
    float * ybuf = scratch + T * k * c.d_ff;
    launch_k(k_moe_gate_up, dim3(grid_for(c.d_ff, k_ex_warps), unsigned(T * k)), k_ex_warps * 32, 0, st, x, Din, ids, k, experts,
                                                                                                   E, c, hbuf, err);
    if (round_h) {   // op_params::bf16_inputs: the down projection's input (the GLU rows) rounded to bf16, in place
        const cudaError_t e = launch_f32_round_bf16(hbuf, T * k * c.d_ff, hbuf, st);
        if (e != cudaSuccess) return e;
    }
    launch_k(k_moe_down, dim3(grid_for(c.d_out, k_ex_warps), unsigned(T * k)), k_ex_warps * 32, 0, st, hbuf, ids, experts, E, c,
                                                                                                 ybuf);
    const int64_t n = T * c.d_out;
    const int64_t bl = (n + 255) / 256;
    launch_k(k_moe_combine, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, ybuf, w, T, k, c.d_out, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda

// ---- Grouped expert path (decode): the selected (token, slot) pairs are grouped by expert on the device, then one
// launch per matrix stage runs one block per (expert, tile of 8 output rows) over ALL selected experts; each weight
// row of a selected expert is read once per step (16-byte loads, MXFP4/NVFP4 dequantized in registers with the
// block scale applied once per 32 columns) and applied to every token that selected it.
namespace perigee::cuda {

namespace {

constexpr int k_grp_threads = 1024;

// gw layout (ints): [0] n_active | [1, 1+A) active expert | [1+A, 2+2A) segment starts | [2+2A, 2+2A+S) slots by expert
// | [2+2A+S, 2+2A+2S) position within the expert (scratch). A = min(E, S), S = T*k.
__global__ void __launch_bounds__(k_grp_threads) k_moe_group(const int32_t * __restrict__ ids, int64_t S, int64_t E,
                                                             int64_t A, int32_t * __restrict__ gw, int * err) {
    pdl_enter();
    __shared__ int cnt[1024], eidx[1024];
    __shared__ int n_act, total;
    int32_t * active = gw + 1;
    int32_t * start = gw + 1 + A;
    int32_t * slots = gw + 2 + 2 * A;
    int32_t * pos = slots + S;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    if (threadIdx.x == 0) n_act = total = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) {
        const int32_t e = ids[i];
        if (e < 0 || e >= E) {
            atomicOr(err + ERR_EXPERT_ID, 1);
            pos[i] = -1;
        } else {
            pos[i] = atomicAdd(&cnt[e], 1);
        }
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        if (cnt[e] == 0) continue;
        const int a = atomicAdd(&n_act, 1);
        eidx[e] = a;
        active[a] = int32_t(e);
        start[a] = atomicAdd(&total, cnt[e]);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x)
        if (pos[i] >= 0) slots[start[eidx[ids[i]]] + pos[i]] = int32_t(i);
    if (threadIdx.x == 0) {
        gw[0] = n_act;
        // segment a ends where the next one starts; starts were handed out in atomic order, so store the end
        // of each segment explicitly after the starts (the reader uses start[a] and start[a] + cnt).
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n_act; a += blockDim.x) pos[a] = cnt[active[a]];   // pos reused: count per segment
}

// Active expert a of the grouped layout (gw above, after k_moe_group): its id, first slot in the by-expert slot list, slot
// count and that list. false: no such active expert, or (n_max) more slots than the kernel takes (another kernel runs
// that expert): the block leaves.
struct group_entry {
    int e, s0, n;
    const int32_t * slots;
};
__device__ __forceinline__ bool group_of(const int32_t * __restrict__ gw, int64_t A, int64_t S, int a, int n_max,
                                         group_entry & g) {
    if (a >= gw[0]) return false;
    g.n = gw[2 + 2 * A + S + a];
    if (g.n >= n_max) return false;
    g.e = gw[1 + a];
    g.s0 = gw[1 + A + a];
    g.slots = gw + 2 + 2 * A;
    return true;
}

// One 16-byte unit of a weight row: FMT 1 = BF16 (8 columns), 2 = MXFP4 (32 columns, one E8M0 scale),
// 3 = NVFP4 (32 columns, two E4M3 scales, global scale). dot() returns sum_c w[c] x[c] over the unit, scales applied.
template <int FMT> struct wunit {
    static constexpr int C = FMT == 1 ? 8 : 32;
    float w[C];
    float s0 = 1.0f, s1 = 1.0f;
    __device__ __forceinline__ void load(const dexpert_matrix & m, int64_t r, int64_t u) {
        if constexpr (FMT == 1) {
            const uint4 q = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(m.w) + r * m.in) + u);
            const uint32_t p[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                w[2 * j] = __uint_as_float(p[j] << 16);
                w[2 * j + 1] = __uint_as_float(p[j] & 0xFFFF0000u);
            }
        } else {
            const uint4 q = __ldg(reinterpret_cast<const uint4 *>(m.packed + r * (m.in / 2)) + u);
            fp4x8(q.x, w);
            fp4x8(q.y, w + 8);
            fp4x8(q.z, w + 16);
            fp4x8(q.w, w + 24);
            if constexpr (FMT == 2) {
                s0 = e8m0_g(m.scale[r * (m.in / 32) + u]);
            } else {
                const uint8_t * sc = m.scale + r * (m.in / 16) + 2 * u;
                s0 = e4m3_g(sc[0]) * m.global_scale;
                s1 = e4m3_g(sc[1]) * m.global_scale;
            }
        }
    }
    __device__ __forceinline__ float dot(const float * __restrict__ x) const {   // x: the unit's columns
        float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
        for (int c = 0; c < C; c += 4) {
            const float4 v = *reinterpret_cast<const float4 *>(x + c);
            float & a = (FMT == 3 && c >= 16) ? a1 : a0;
            a = fmaf(w[c], v.x, a);
            a = fmaf(w[c + 1], v.y, a);
            a = fmaf(w[c + 2], v.z, a);
            a = fmaf(w[c + 3], v.w, a);
        }
        if constexpr (FMT == 1) return a0;
        else if constexpr (FMT == 2) return a0 * s0;
        else return a0 * s0 + a1 * s1;
    }
};

constexpr int k_g_warps = 8;

// hbuf [S, F] for every selected slot: grid (F / 8, A). TT tokens of the expert share each weight load.
template <int FMT, int TT>
__global__ void __launch_bounds__(k_g_warps * 32) k_moe_gate_up_g(const float * __restrict__ x, int64_t Din, int64_t k,
                                                                  const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                                  const int32_t * __restrict__ gw, dexperts_cfg c,
                                                                  float * __restrict__ hbuf, int n_max) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), n_max, ge)) return;
    const int64_t r = int64_t(blockIdx.x) * k_g_warps + (threadIdx.x >> 5);
    if (r >= c.d_ff) return;
    const int lane = threadIdx.x & 31;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const dexpert_matrix G = ex[e].gate, U = ex[e].up;
    constexpr int C = wunit<FMT>::C;
    const int64_t nu = Din / C;
    for (int t0 = 0; t0 < n; t0 += TT) {
        const int nt = min(TT, n - t0);
        const float * xp[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) xp[j] = x + int64_t(slots[s0 + t0 + (j < nt ? j : 0)] / k) * Din;
        float ag[TT], au[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) ag[j] = au[j] = 0.0f;
#pragma unroll 2
        for (int64_t u = lane; u < nu; u += 32) {
            wunit<FMT> wg, wu;
            wg.load(G, r, u);
            wu.load(U, r, u);
#pragma unroll
            for (int j = 0; j < TT; ++j) {
                if (j >= nt) break;
                ag[j] += wg.dot(xp[j] + u * C);
                au[j] += wu.dot(xp[j] + u * C);
            }
        }
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= nt) break;
            const float g = warp_sum(ag[j]), up = warp_sum(au[j]);
            if (lane == 0)
                hbuf[int64_t(slots[s0 + t0 + j]) * c.d_ff + r] =
                    c.act == 1 ? situ_d(g, up, c.situ_beta, c.situ_linear_beta) : silu_d(g) * up;
        }
    }
}

// ybuf [S, Dout] = down h for every selected slot: grid (Dout / 8, A).
template <int FMT, int TT>
__global__ void __launch_bounds__(k_g_warps * 32) k_moe_down_g(const float * __restrict__ hbuf, const dexpert * __restrict__ ex,
                                                               int64_t A, int64_t S, const int32_t * __restrict__ gw,
                                                               dexperts_cfg c, float * __restrict__ ybuf, int n_max) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), n_max, ge)) return;
    const int64_t r = int64_t(blockIdx.x) * k_g_warps + (threadIdx.x >> 5);
    if (r >= c.d_out) return;
    const int lane = threadIdx.x & 31;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const dexpert_matrix D = ex[e].down;
    constexpr int C = wunit<FMT>::C;
    const int64_t nu = c.d_ff / C;
    for (int t0 = 0; t0 < n; t0 += TT) {
        const int nt = min(TT, n - t0);
        const float * hp[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) hp[j] = hbuf + int64_t(slots[s0 + t0 + (j < nt ? j : 0)]) * c.d_ff;
        float acc[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) acc[j] = 0.0f;
#pragma unroll 2
        for (int64_t u = lane; u < nu; u += 32) {
            wunit<FMT> wd;
            wd.load(D, r, u);
#pragma unroll
            for (int j = 0; j < TT; ++j) {
                if (j >= nt) break;
                acc[j] += wd.dot(hp[j] + u * C);
            }
        }
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= nt) break;
            const float v = warp_sum(acc[j]);
            if (lane == 0) ybuf[int64_t(slots[s0 + t0 + j]) * c.d_out + r] = v;
        }
    }
}

// y [T, Dout] = sum_j w[t, j] ybuf[t*k + j] in slot order; a slot with an invalid expert id contributes 0.
__global__ void k_moe_combine_g(const float * __restrict__ ybuf, const float * __restrict__ w, const int32_t * __restrict__ ids,
                                int64_t E, int64_t T, int64_t k, int64_t Dout, float * __restrict__ y) {
    pdl_enter();
    const int64_t n = T * Dout;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = i / Dout, r = i % Dout;
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids[t * k + j];
            const float v = (e >= 0 && e < E) ? ybuf[(t * k + j) * Dout + r] : 0.0f;
            acc += w[t * k + j] * v;
        }
        y[i] = acc;
    }
}

// ---- MXFP4, decode (v2): a warp takes R consecutive rows of NM matrices (gate and up, or down); every 16-byte unit
// of those rows that the lane owns (unit = base + lane + 32 i, i < NU) and its E8M0 scale byte are loaded into
// registers before any dequant or math, so R * NM * NU loads are in flight per lane (the first kernel: 2-4), and the
// raw words (4 registers per unit instead of 32 dequantized floats) keep occupancy up. Each 8-column chunk of x is
// loaded once for all R * NM rows; the scale is applied once per unit (32 columns).
template <int NM, int R, int NU>
__device__ __forceinline__ void fp4_rows_dot(const dexpert_matrix * mats, int64_t r0, int64_t n_rows, int64_t nu,
                                             const float * __restrict__ xp, float (&acc)[NM][R]) {
    const int lane = threadIdx.x & 31;
    const int64_t rb = nu * 16;   // bytes per packed row
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    for (int64_t base = 0; base < nu; base += 32 * NU) {
        uint4 q[NM][R][NU];
        uint32_t sc[NM][R][NU];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < NU; ++i) {
                    const int64_t u = base + lane + 32 * i, row = r0 + r;
                    if (u < nu && row < n_rows) {
                        q[m][r][i] = __ldg(reinterpret_cast<const uint4 *>(mats[m].packed + row * rb) + u);
                        sc[m][r][i] = __ldg(mats[m].scale + row * nu + u);
                    } else {
                        q[m][r][i] = make_uint4(0, 0, 0, 0);
                        sc[m][r][i] = 127;
                    }
                }
#pragma unroll
        for (int i = 0; i < NU; ++i) {
            const int64_t u = base + lane + 32 * i;
            if (u >= nu) break;
            const float * xu = xp + u * 32;
            float part[NM][R];
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) part[m][r] = 0.0f;
#pragma unroll
            for (int wd = 0; wd < 4; ++wd) {
                const float4 x0 = *reinterpret_cast<const float4 *>(xu + 8 * wd);
                const float4 x1 = *reinterpret_cast<const float4 *>(xu + 8 * wd + 4);
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint4 & qq = q[m][r][i];
                        const uint32_t word = wd == 0 ? qq.x : wd == 1 ? qq.y : wd == 2 ? qq.z : qq.w;
                        float w8[8];
                        fp4x8(word, w8);
                        float a = part[m][r];
                        a = fmaf(w8[0], x0.x, a);
                        a = fmaf(w8[1], x0.y, a);
                        a = fmaf(w8[2], x0.z, a);
                        a = fmaf(w8[3], x0.w, a);
                        a = fmaf(w8[4], x1.x, a);
                        a = fmaf(w8[5], x1.y, a);
                        a = fmaf(w8[6], x1.z, a);
                        a = fmaf(w8[7], x1.w, a);
                        part[m][r] = a;
                    }
            }
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[m][r] += part[m][r] * e8m0_g(uint8_t(sc[m][r][i]));
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
}

constexpr int k_v2_warps = 8;

// hbuf [S, F]: grid (F / (8 R), A); every token of the expert's segment (T == 1: one) re-reads the rows.
template <int R, int NU>
__global__ void __launch_bounds__(k_v2_warps * 32) k_moe_gate_up_fp4_v2(const float * __restrict__ x, int64_t Din, int64_t k,
                                                                       const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                                       const int32_t * __restrict__ gw, dexperts_cfg c,
                                                                       float * __restrict__ hbuf) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), INT_MAX, ge)) return;
    const int64_t r0 = (int64_t(blockIdx.x) * k_v2_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_ff) return;
    const int lane = threadIdx.x & 31;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const dexpert_matrix mats[2] = {ex[e].gate, ex[e].up};
    for (int ti = 0; ti < n; ++ti) {
        const int slot = slots[s0 + ti];
        float acc[2][R];
        fp4_rows_dot<2, R, NU>(mats, r0, c.d_ff, Din / 32, x + int64_t(slot / k) * Din, acc);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r0 + r < c.d_ff)
                    hbuf[int64_t(slot) * c.d_ff + r0 + r] =
                        c.act == 1 ? situ_d(acc[0][r], acc[1][r], c.situ_beta, c.situ_linear_beta) : silu_d(acc[0][r]) * acc[1][r];
        }
    }
}

// ybuf [S, Dout]: grid (Dout / (8 R), A).
template <int R, int NU>
__global__ void __launch_bounds__(k_v2_warps * 32) k_moe_down_fp4_v2(const float * __restrict__ hbuf, const dexpert * __restrict__ ex,
                                                                    int64_t A, int64_t S, const int32_t * __restrict__ gw,
                                                                    dexperts_cfg c, float * __restrict__ ybuf) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), INT_MAX, ge)) return;
    const int64_t r0 = (int64_t(blockIdx.x) * k_v2_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_out) return;
    const int lane = threadIdx.x & 31;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const dexpert_matrix mats[1] = {ex[e].down};
    for (int ti = 0; ti < n; ++ti) {
        const int slot = slots[s0 + ti];
        float acc[1][R];
        fp4_rows_dot<1, R, NU>(mats, r0, c.d_out, c.d_ff / 32, hbuf + int64_t(slot) * c.d_ff, acc);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r0 + r < c.d_out) ybuf[int64_t(slot) * c.d_out + r0 + r] = acc[0][r];
        }
    }
}

template <int NU> void launch_gate_up_v2(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                                         const int32_t * gw, const dexperts_cfg & c, float * hbuf, cudaStream_t st) {
    constexpr int R = 2;
    launch_k(k_moe_gate_up_fp4_v2<R, NU>, dim3(grid_for(c.d_ff, k_v2_warps * R), unsigned(A)), k_v2_warps * 32, 0, st,
        x, Din, k, experts, A, S, gw, c, hbuf);
}
template <int NU> void launch_down_v2(const dexpert * experts, int64_t A, int64_t S, const int32_t * gw,
                                      const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st) {
    constexpr int R = 4;
    launch_k(k_moe_down_fp4_v2<R, NU>, dim3(grid_for(c.d_out, k_v2_warps * R), unsigned(A)), k_v2_warps * 32, 0, st,
        hbuf, experts, A, S, gw, c, ybuf);
}
// Units per lane for a row of nu 16-byte units: 1, 2 or 4 (longer rows loop over chunks of 128 units).
inline int v2_nu(int64_t nu) { return nu <= 32 ? 1 : nu <= 64 ? 2 : 4; }

void launch_fp4_v2_stages(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                          const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st) {
    switch (v2_nu(Din / 32)) {
        case 1: launch_gate_up_v2<1>(x, Din, k, experts, A, S, gw, c, hbuf, st); break;
        case 2: launch_gate_up_v2<2>(x, Din, k, experts, A, S, gw, c, hbuf, st); break;
        default: launch_gate_up_v2<4>(x, Din, k, experts, A, S, gw, c, hbuf, st); break;
    }
    switch (v2_nu(c.d_ff / 32)) {
        case 1: launch_down_v2<1>(experts, A, S, gw, c, hbuf, ybuf, st); break;
        case 2: launch_down_v2<2>(experts, A, S, gw, c, hbuf, ybuf, st); break;
        default: launch_down_v2<4>(experts, A, S, gw, c, hbuf, ybuf, st); break;
    }
}

// ---- MXFP4, decode (v3, cuda_options::moe_fp4_v3, T == 1): no grouping kernel and no combine kernel. The gate/up
// kernel takes slot j = blockIdx.y and reads its expert id directly (T == 1: each slot is its own group); the down
// kernel takes a tile of output rows over ALL k slots (two at a time, loads of both in flight) and sums w_j * y_j in
// slot order in registers, so y is written once and the combine launch is gone: 2 launches per node instead of 4.
// Dequant: E2M1 nibble -> fp16 by bit placement (magnitude bits to the fp16 exponent/mantissa boundary, sign to bit
// 15: the fp16 value is exactly the E2M1 value * 2^-14, subnormals included), two nibbles per 32-bit op, converted to
// fp32 for the FMA; the 2^14 is applied with the E8M0 scale once per 32 columns. ~2 integer ops per value (v2: ~4.5,
// byte_perm LUT + sign + bf16 split), the integer pipe being half the FP32 rate on sm_90.

// acc + sum_c w[c] x[c] * 2^-14 over the 8 columns of word q (nibble c = bits 4c..4c+3; x0: columns 0-3, x1: 4-7).
__device__ __forceinline__ float fp4x8_dot_h(uint32_t q, float4 x0, float4 x1, float acc) {
    const float xa[4] = {x0.x, x0.y, x0.z, x0.w}, xb[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {   // pair i: nibble i (low half) and nibble i + 4 (high half)
        const uint32_t mag = i < 3 ? (q << (9 - 4 * i)) : (q >> 3);
        const uint32_t sgn = q << (12 - 4 * i);
        const uint32_t hb = (mag & 0x0E000E00u) | (sgn & 0x80008000u);
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hb));
        acc = fmaf(f.x, xa[i], acc);
        acc = fmaf(f.y, xb[i], acc);
    }
    return acc;
}

// fp4_rows_dot with one x per matrix (xps[m]) and the fp16 dequant; rows[m] = 0 reads nothing (acc 0).
template <int NM, int R, int NU>
__device__ __forceinline__ void fp4_rows_dot_v3(const dexpert_matrix * mats, const int64_t * rows, const float * const * xps,
                                                int64_t r0, int64_t nu, float (&acc)[NM][R]) {
    const int lane = threadIdx.x & 31;
    const int64_t rb = nu * 16;
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    for (int64_t base = 0; base < nu; base += 32 * NU) {
        uint4 q[NM][R][NU];
        uint32_t sc[NM][R][NU];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < NU; ++i) {
                    const int64_t u = base + lane + 32 * i, row = r0 + r;
                    if (u < nu && row < rows[m]) {
                        q[m][r][i] = __ldg(reinterpret_cast<const uint4 *>(mats[m].packed + row * rb) + u);
                        sc[m][r][i] = __ldg(mats[m].scale + row * nu + u);
                    } else {
                        q[m][r][i] = make_uint4(0, 0, 0, 0);
                        sc[m][r][i] = 127;
                    }
                }
#pragma unroll
        for (int i = 0; i < NU; ++i) {
            const int64_t u = base + lane + 32 * i;
            if (u >= nu) break;
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                if (rows[m] == 0) continue;
                const float * xu = xps[m] + u * 32;
                float4 xv[8];
#pragma unroll
                for (int wd = 0; wd < 8; ++wd) xv[wd] = *reinterpret_cast<const float4 *>(xu + 4 * wd);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const uint4 & qq = q[m][r][i];
                    float part = 0.0f;
                    part = fp4x8_dot_h(qq.x, xv[0], xv[1], part);
                    part = fp4x8_dot_h(qq.y, xv[2], xv[3], part);
                    part = fp4x8_dot_h(qq.z, xv[4], xv[5], part);
                    part = fp4x8_dot_h(qq.w, xv[6], xv[7], part);
                    acc[m][r] = fmaf(part * 16384.0f, e8m0_g(uint8_t(sc[m][r][i])), acc[m][r]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
}

constexpr int k_v3_warps = 8;

// hbuf [k, F] for T == 1: grid (F / (8 R), k); slot j = blockIdx.y uses expert ids[j].
template <int R, int NU>
__global__ void __launch_bounds__(k_v3_warps * 32) k_moe_gate_up_fp4_v3(const float * __restrict__ x, int64_t Din,
                                                                       const int32_t * __restrict__ ids,
                                                                       const dexpert * __restrict__ ex, int64_t E,
                                                                       dexperts_cfg c, float * __restrict__ hbuf,
                                                                       int * err) {
    pdl_enter();
    const int j = blockIdx.y;
    const int32_t e = ids[j];
    if (e < 0 || e >= E) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err + ERR_EXPERT_ID, 1);
        return;
    }
    const int64_t r0 = (int64_t(blockIdx.x) * k_v3_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_ff) return;
    const dexpert_matrix mats[2] = {ex[e].gate, ex[e].up};
    const int64_t rows[2] = {c.d_ff, c.d_ff};
    const float * xps[2] = {x, x};
    float acc[2][R];
    fp4_rows_dot_v3<2, R, NU>(mats, rows, xps, r0, Din / 32, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r0 + r < c.d_ff)
                hbuf[int64_t(j) * c.d_ff + r0 + r] =
                    c.act == 1 ? situ_d(acc[0][r], acc[1][r], c.situ_beta, c.situ_linear_beta) : silu_d(acc[0][r]) * acc[1][r];
    }
}

// y [1, Dout] = sum_j w[j] down_{ids[j]} h_j, slots in order (an invalid id contributes 0): grid (Dout / (8 R)).
template <int R, int NU, int NS>
__global__ void __launch_bounds__(k_v3_warps * 32) k_moe_down_comb_fp4_v3(const float * __restrict__ hbuf,
                                                                         const int32_t * __restrict__ ids,
                                                                         const float * __restrict__ w, int64_t k,
                                                                         const dexpert * __restrict__ ex, int64_t E,
                                                                         dexperts_cfg c, float * __restrict__ y) {
    pdl_enter();
    const int64_t r0 = (int64_t(blockIdx.x) * k_v3_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_out) return;
    float out[R];
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = 0.0f;
    for (int64_t j0 = 0; j0 < k; j0 += NS) {
        dexpert_matrix mats[NS];
        int64_t rows[NS];
        const float * xps[NS];
#pragma unroll
        for (int m = 0; m < NS; ++m) {
            const int64_t j = j0 + m;
            const int32_t e = j < k ? ids[j] : -1;
            const bool ok = e >= 0 && e < E;
            mats[m] = ex[ok ? e : 0].down;
            rows[m] = ok ? c.d_out : 0;
            xps[m] = hbuf + (j < k ? j : 0) * c.d_ff;
        }
        float acc[NS][R];
        fp4_rows_dot_v3<NS, R, NU>(mats, rows, xps, r0, c.d_ff / 32, acc);
#pragma unroll
        for (int m = 0; m < NS; ++m) {
            if (j0 + m >= k) break;
            const float wj = w[j0 + m];
#pragma unroll
            for (int r = 0; r < R; ++r) out[r] += wj * (rows[m] ? acc[m][r] : 0.0f);
        }
    }
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r0 + r < c.d_out) y[r0 + r] = out[r];
    }
}

template <int NU> void launch_gate_up_v3(const float * x, int64_t Din, const int32_t * ids, int64_t k, const dexpert * experts,
                                         int64_t E, const dexperts_cfg & c, float * hbuf, int * err, cudaStream_t st) {
    constexpr int R = 2;
    launch_k(k_moe_gate_up_fp4_v3<R, NU>, dim3(grid_for(c.d_ff, k_v3_warps * R), unsigned(k)), k_v3_warps * 32, 0, st,
        x, Din, ids, experts, E, c, hbuf, err);
}
template <int NU> void launch_down_v3(const float * hbuf, const int32_t * ids, const float * w, int64_t k,
                                      const dexpert * experts, int64_t E, const dexperts_cfg & c, float * y, cudaStream_t st) {
    constexpr int R = 2, NS = 2;
    launch_k(k_moe_down_comb_fp4_v3<R, NU, NS>, grid_for(c.d_out, k_v3_warps * R), k_v3_warps * 32, 0, st, hbuf, ids, w, k, experts,
                                                                                                     E, c, y);
}

void launch_fp4_v3(const float * x, int64_t Din, const int32_t * ids, const float * w, int64_t k, const dexpert * experts,
                   int64_t E, const dexperts_cfg & c, float * hbuf, float * y, int * err, cudaStream_t st) {
    // units per lane: 1..4 (3 fits K3's 3072-wide down rows, 96 units, without idle registers; longer rows loop)
    auto nu_of = [](int64_t nu) { return nu <= 32 ? 1 : nu <= 64 ? 2 : nu <= 96 ? 3 : 4; };
    switch (nu_of(Din / 32)) {
        case 1: launch_gate_up_v3<1>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        case 2: launch_gate_up_v3<2>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        case 3: launch_gate_up_v3<3>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        default: launch_gate_up_v3<4>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
    }
    switch (nu_of(c.d_ff / 32)) {
        case 1: launch_down_v3<1>(hbuf, ids, w, k, experts, E, c, y, st); break;
        case 2: launch_down_v3<2>(hbuf, ids, w, k, experts, E, c, y, st); break;
        case 3: launch_down_v3<3>(hbuf, ids, w, k, experts, E, c, y, st); break;
        default: launch_down_v3<4>(hbuf, ids, w, k, experts, E, c, y, st); break;
    }
}

// ---- Decode v4 (cuda_options::moe_decode_v4 at T == 1, moe_small_v4 at T > 1), MXFP4 and BF16 experts.
// Diagnosis of v3 (round 1, H200): its gate/up kernel is v2's (same grid, 128 registers) with the cheaper dequant, but its
// down + combine kernel runs ONE block per 16 output rows over all k slots: 224 blocks of 8 warps for K3's 3584 rows
// (< 1 wave at 2 blocks/SM: 92 SMs get 2 blocks, 40 get 1), and every warp walks the 16 slots in 8 dependent rounds
// (load 12 units -> wait -> dequant/FMA -> next), so 1792 warps do what v2 spreads over 14336, with no other warps to
// cover a round's latency. v4 keeps what is free in v3 (no grouping launch at T == 1; the combine folded into down; the
// E2M1 -> fp16 bit placement) and v2's shape (all units of R rows in flight per lane before any math; grids of many
// blocks). The down kernel puts the k slots on the 8 warps of one block (warp w: slots w, w + 8, ... loaded together),
// so the combine is a shared-memory sum in slot order (the reference's order) and the grid is d_out / R blocks.
// BF16 rows use the same structure (8 columns per 16-byte unit). At T > 1 (moe_small_v4) the GEMV experts (fewer than
// moe_mma_tokens tokens) load each row's units once, dequantize each 8-column chunk once and apply it to up to 8 tokens
// held in registers: every selected row is read once per step (the first grouped kernel dequantized each unit into 32
// floats per 4 tokens, 168 registers: 1 block/SM).

// 8 columns of a unit as floats: FMT 1 = BF16 (the unit), FMT 2 = E2M1 word ch of the unit, values * 2^-14 (fp16
// placement as v3; the caller applies 2^14 * the E8M0 scale once per unit). Column order: w8[i] = column i.
template <int FMT>
__device__ __forceinline__ void dq8_v4(const uint4 & q, int ch, float (&w8)[8]) {
    if constexpr (FMT == 1) {
        const uint32_t p[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w8[2 * j] = __uint_as_float(p[j] << 16);
            w8[2 * j + 1] = __uint_as_float(p[j] & 0xFFFF0000u);
        }
    } else {
        const uint32_t wq = ch == 0 ? q.x : ch == 1 ? q.y : ch == 2 ? q.z : q.w;
#pragma unroll
        for (int i = 0; i < 4; ++i) {   // nibble i -> low half, nibble i + 4 -> high half
            const uint32_t mag = i < 3 ? (wq << (9 - 4 * i)) : (wq >> 3);
            const uint32_t sgn = wq << (12 - 4 * i);
            const uint32_t hb = (mag & 0x0E000E00u) | (sgn & 0x80008000u);
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hb));
            w8[i] = f.x;
            w8[i + 4] = f.y;
        }
    }
}

// acc[m][r][t] = sum over the row (r0 + r) of matrix m of w * xs[m][t] (warp-reduced, on every lane), t < nt.
// base[m]: byte address of row 0 (nullptr: matrix skipped, acc 0); rows of nu 16-byte units; scl[m]: E8M0 [rows, nu]
// (FMT 2). xs [NM * TT]: token t's x for matrix m at xs[m * TT + t]; SX: every matrix reads xs[t], loaded once per chunk.
template <int FMT, int NM, int R, int NU, int TT, bool SX>
__device__ __forceinline__ void rows_dot_v4(const uint8_t * const * base, const uint8_t * const * scl, int64_t r0,
                                            int64_t n_rows, int64_t nu, const float * const * xs, int nt,
                                            float (&acc)[NM][R][TT]) {
    constexpr int C = FMT == 1 ? 8 : 32, NCH = C / 8, NX = SX ? 1 : NM;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) acc[m][r][t] = 0.0f;
    for (int64_t b0 = 0; b0 < nu; b0 += 32 * NU) {
        uint4 q[NM][R][NU];
        uint32_t sc[NM][R][NU];
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < NU; ++i) {
                    const int64_t u = b0 + lane + 32 * i, row = r0 + r;
                    q[m][r][i] = make_uint4(0, 0, 0, 0);
                    sc[m][r][i] = 0;
                    if (base[m] && u < nu && row < n_rows) {
                        q[m][r][i] = __ldg(reinterpret_cast<const uint4 *>(base[m] + row * nu * 16) + u);
                        if constexpr (FMT == 2) sc[m][r][i] = __ldg(scl[m] + row * nu + u);
                    }
                }
        (void)sc;   // BF16: no scales
#pragma unroll
        for (int i = 0; i < NU; ++i) {
            const int64_t u = b0 + lane + 32 * i;
            if (u >= nu) break;
            float part[NM][R][TT];
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int t = 0; t < TT; ++t) part[m][r][t] = 0.0f;
#pragma unroll(TT > 1 ? 1 : NCH)   // several tokens: one chunk at a time (their x chunks fill the registers)
            for (int ch = 0; ch < NCH; ++ch) {
                float4 xv[NX][TT][2];
#pragma unroll
                for (int mx = 0; mx < NX; ++mx)
#pragma unroll
                    for (int t = 0; t < TT; ++t) {
                        if (t < nt && base[mx]) {
                            const float * xp = xs[mx * TT + t] + u * C + 8 * ch;
                            xv[mx][t][0] = *reinterpret_cast<const float4 *>(xp);
                            xv[mx][t][1] = *reinterpret_cast<const float4 *>(xp + 4);
                        } else {
                            xv[mx][t][0] = xv[mx][t][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        }
                    }
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float w8[8];
                        dq8_v4<FMT>(q[m][r][i], ch, w8);
#pragma unroll
                        for (int t = 0; t < TT; ++t) {
                            const float4 x0 = xv[SX ? 0 : m][t][0], x1 = xv[SX ? 0 : m][t][1];
                            float a = part[m][r][t];
                            a = fmaf(w8[0], x0.x, a);
                            a = fmaf(w8[1], x0.y, a);
                            a = fmaf(w8[2], x0.z, a);
                            a = fmaf(w8[3], x0.w, a);
                            a = fmaf(w8[4], x1.x, a);
                            a = fmaf(w8[5], x1.y, a);
                            a = fmaf(w8[6], x1.z, a);
                            a = fmaf(w8[7], x1.w, a);
                            part[m][r][t] = a;
                        }
                    }
            }
#pragma unroll
            for (int m = 0; m < NM; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    // E8M0 byte b: 2^(b - 127) (b = 0: 2^-127); the fp16 placement's 2^14 goes on the partial sum first
                    // (2^14 times a scale near 2^127 would overflow).
#pragma unroll
                    for (int t = 0; t < TT; ++t) {
                        if constexpr (FMT == 2)
                            acc[m][r][t] = fmaf(part[m][r][t] * 16384.0f, e8m0_g(uint8_t(sc[m][r][i])), acc[m][r][t]);
                        else
                            acc[m][r][t] += part[m][r][t];
                    }
                }
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) acc[m][r][t] = warp_sum(acc[m][r][t]);
}

__device__ __forceinline__ const uint8_t * mat_base(const dexpert_matrix & m, int FMT) {
    return FMT == 1 ? static_cast<const uint8_t *>(m.w) : m.packed;
}

constexpr int k_v4_warps = 8;

// T == 1: hbuf [k, F]; grid (F / (8 R), k), slot j = blockIdx.y with expert ids[j] (no grouping launch).
template <int FMT, int R, int NU>
__global__ void __launch_bounds__(k_v4_warps * 32, 2) k_moe_gate_up_v4(const float * __restrict__ x, int64_t Din,
                                                                   const int32_t * __restrict__ ids,
                                                                   const dexpert * __restrict__ ex, int64_t E,
                                                                   dexperts_cfg c, float * __restrict__ hbuf, int * err) {
    pdl_enter();
    const int j = blockIdx.y;
    const int32_t e = ids[j];
    if (e < 0 || e >= E) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err + ERR_EXPERT_ID, 1);
        return;
    }
    const int64_t r0 = (int64_t(blockIdx.x) * k_v4_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_ff) return;
    const uint8_t * const base[2] = {mat_base(ex[e].gate, FMT), mat_base(ex[e].up, FMT)};
    const uint8_t * const scl[2] = {ex[e].gate.scale, ex[e].up.scale};
    const float * const xs[2] = {x, x};
    float acc[2][R][1];
    rows_dot_v4<FMT, 2, R, NU, 1, true>(base, scl, r0, c.d_ff, Din / (FMT == 1 ? 8 : 32), xs, 1, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r0 + r < c.d_ff)
                hbuf[int64_t(j) * c.d_ff + r0 + r] = c.act == 1 ? situ_d(acc[0][r][0], acc[1][r][0], c.situ_beta, c.situ_linear_beta)
                                                                : silu_d(acc[0][r][0]) * acc[1][r][0];
    }
}

// T == 1: y [Dout] = sum_j w[j] down_{ids[j]} h_j in slot order (an invalid id contributes 0); grid (Dout / R), block of
// 8 warps: warp wd takes slots wd + 8 s (s < NS, k <= 8 NS), all their units in flight together; the partial rows meet
// in shared memory and R threads sum them in slot order.
template <int FMT, int R, int NU, int NS>
__global__ void __launch_bounds__(k_v4_warps * 32, NS <= 2 ? 2 : 1) k_moe_down_comb_v4(const float * __restrict__ hbuf,
                                                                     const int32_t * __restrict__ ids,
                                                                     const float * __restrict__ w, int64_t k,
                                                                     const dexpert * __restrict__ ex, int64_t E,
                                                                     dexperts_cfg c, float * __restrict__ y) {
    pdl_enter();
    __shared__ float part[k_v4_warps * NS][R];
    const int wd = threadIdx.x >> 5;
    const int64_t r0 = int64_t(blockIdx.x) * R;
    const uint8_t * base[NS];
    const uint8_t * scl[NS];
    const float * xs[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
        const int64_t j = wd + k_v4_warps * s;
        const int32_t e = j < k ? ids[j] : -1;
        const bool ok = e >= 0 && e < E;
        base[s] = ok ? mat_base(ex[e].down, FMT) : nullptr;
        scl[s] = ok ? ex[e].down.scale : nullptr;
        xs[s] = hbuf + (ok ? j : 0) * c.d_ff;
    }
    float acc[NS][R][1];
    rows_dot_v4<FMT, NS, R, NU, 1, false>(base, scl, r0, c.d_out, c.d_ff / (FMT == 1 ? 8 : 32), xs, 1, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int s = 0; s < NS; ++s)
#pragma unroll
            for (int r = 0; r < R; ++r) part[wd + k_v4_warps * s][r] = acc[s][r][0];
    }
    __syncthreads();
    if (threadIdx.x < R && r0 + threadIdx.x < c.d_out) {
        float o = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids[j];
            const float v = (e >= 0 && e < E) ? part[j][threadIdx.x] : 0.0f;
            o += w[j] * v;
        }
        y[r0 + threadIdx.x] = o;
    }
}

// The T > 1 kernels run blocks of 4 warps: ~130-150 registers (8 tokens' x chunks in registers) without spills, 3 blocks
// per SM (a 2-block bound of 8 warps spilled 188 bytes in MXFP4 gate/up).
constexpr int k_v4s_warps = 4;

// T > 1 (moe_small_v4): the grouped GEMV experts (segment count < n_max); hbuf [S, F], grid (F / (4 R), A). Up to TT
// tokens of the expert per pass from registers (n_max <= TT: one pass, every row read once).
template <int FMT, int R, int NU, int TT>
__global__ void __launch_bounds__(k_v4s_warps * 32) k_moe_gate_up_small_v4(const float * __restrict__ x, int64_t Din, int64_t k,
                                                                         const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                                         const int32_t * __restrict__ gw, dexperts_cfg c,
                                                                         float * __restrict__ hbuf, int n_max) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), n_max, ge)) return;
    const int64_t r0 = (int64_t(blockIdx.x) * k_v4s_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_ff) return;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const uint8_t * const base[2] = {mat_base(ex[e].gate, FMT), mat_base(ex[e].up, FMT)};
    const uint8_t * const scl[2] = {ex[e].gate.scale, ex[e].up.scale};
    for (int t0 = 0; t0 < n; t0 += TT) {
        const int nt = min(TT, n - t0);
        const float * xs[2][TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) xs[0][t] = xs[1][t] = x + int64_t(slots[s0 + t0 + (t < nt ? t : 0)] / k) * Din;
        float acc[2][R][TT];
        rows_dot_v4<FMT, 2, R, NU, TT, true>(base, scl, r0, c.d_ff, Din / (FMT == 1 ? 8 : 32),
                                             &xs[0][0], nt, acc);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                if (t >= nt) break;
                const int64_t slot = slots[s0 + t0 + t];
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (r0 + r < c.d_ff)
                        hbuf[slot * c.d_ff + r0 + r] = c.act == 1 ? situ_d(acc[0][r][t], acc[1][r][t], c.situ_beta, c.situ_linear_beta)
                                                                  : silu_d(acc[0][r][t]) * acc[1][r][t];
            }
        }
    }
}

// T > 1 (moe_small_v4): ybuf [S, Dout] for the GEMV experts; grid (Dout / (4 R), A).
template <int FMT, int R, int NU, int TT>
__global__ void __launch_bounds__(k_v4s_warps * 32) k_moe_down_small_v4(const float * __restrict__ hbuf,
                                                                      const dexpert * __restrict__ ex, int64_t A, int64_t S,
                                                                      const int32_t * __restrict__ gw, dexperts_cfg c,
                                                                      float * __restrict__ ybuf, int n_max) {
    pdl_enter();
    group_entry ge;
    if (!group_of(gw, A, S, int(blockIdx.y), n_max, ge)) return;
    const int64_t r0 = (int64_t(blockIdx.x) * k_v4s_warps + (threadIdx.x >> 5)) * R;
    if (r0 >= c.d_out) return;
    const int e = ge.e, s0 = ge.s0, n = ge.n;
    const int32_t * slots = ge.slots;
    const uint8_t * const base[1] = {mat_base(ex[e].down, FMT)};
    const uint8_t * const scl[1] = {ex[e].down.scale};
    for (int t0 = 0; t0 < n; t0 += TT) {
        const int nt = min(TT, n - t0);
        const float * xs[1][TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) xs[0][t] = hbuf + int64_t(slots[s0 + t0 + (t < nt ? t : 0)]) * c.d_ff;
        float acc[1][R][TT];
        rows_dot_v4<FMT, 1, R, NU, TT, true>(base, scl, r0, c.d_out, c.d_ff / (FMT == 1 ? 8 : 32),
                                             &xs[0][0], nt, acc);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int t = 0; t < TT; ++t) {
                if (t >= nt) break;
                const int64_t slot = slots[s0 + t0 + t];
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (r0 + r < c.d_out) ybuf[slot * c.d_out + r0 + r] = acc[0][r][t];
            }
        }
    }
}

// Units per lane for rows of nu units: up to 3 exactly when that is one pass; longer rows: 4, or 3 when 3 takes as many
// passes (less idle registers; 48B's 288-unit BF16 rows: 3 passes of 96).
inline int v4_nu(int64_t nu) {
    if (nu <= 32) return 1;
    if (nu <= 64) return 2;
    if (nu <= 96) return 3;
    return (nu + 127) / 128 == (nu + 95) / 96 ? 3 : 4;
}

template <int FMT, int NU>
void launch_v4_gate_up(const float * x, int64_t Din, const int32_t * ids, int64_t k, const dexpert * experts, int64_t E,
                       const dexperts_cfg & c, float * hbuf, int * err, cudaStream_t st) {
    constexpr int R = 2;
    launch_k(k_moe_gate_up_v4<FMT, R, NU>, dim3(grid_for(c.d_ff, k_v4_warps * R), unsigned(k)), k_v4_warps * 32, 0, st,
        x, Din, ids, experts, E, c, hbuf, err);
}
template <int FMT, int NU, int NS>
void launch_v4_down(const float * hbuf, const int32_t * ids, const float * w, int64_t k, const dexpert * experts, int64_t E,
                    const dexperts_cfg & c, float * y, cudaStream_t st) {
    constexpr int R = 2;
    launch_k(k_moe_down_comb_v4<FMT, R, NU, NS>, grid_for(c.d_out, R), k_v4_warps * 32, 0, st, hbuf, ids, w, k, experts, E, c, y);
}
template <int FMT, int NU>
void launch_v4_down_ns(const float * hbuf, const int32_t * ids, const float * w, int64_t k, const dexpert * experts, int64_t E,
                       const dexperts_cfg & c, float * y, cudaStream_t st) {
    if (k <= k_v4_warps) launch_v4_down<FMT, NU, 1>(hbuf, ids, w, k, experts, E, c, y, st);
    else if (k <= 2 * k_v4_warps) launch_v4_down<FMT, NU, 2>(hbuf, ids, w, k, experts, E, c, y, st);
    else launch_v4_down<FMT, NU, 4>(hbuf, ids, w, k, experts, E, c, y, st);
}

// T == 1, k <= 32: 2 launches (gate/up per slot; down with the combine).
template <int FMT>
void launch_v4_one(const float * x, int64_t Din, const int32_t * ids, const float * w, int64_t k, const dexpert * experts,
                   int64_t E, const dexperts_cfg & c, float * hbuf, float * y, int * err, cudaStream_t st) {
    constexpr int C = FMT == 1 ? 8 : 32;
    switch (v4_nu(Din / C)) {
        case 1: launch_v4_gate_up<FMT, 1>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        case 2: launch_v4_gate_up<FMT, 2>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        case 3: launch_v4_gate_up<FMT, 3>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
        default: launch_v4_gate_up<FMT, 4>(x, Din, ids, k, experts, E, c, hbuf, err, st); break;
    }
    switch (v4_nu(c.d_ff / C)) {
        case 1: launch_v4_down_ns<FMT, 1>(hbuf, ids, w, k, experts, E, c, y, st); break;
        case 2: launch_v4_down_ns<FMT, 2>(hbuf, ids, w, k, experts, E, c, y, st); break;
        case 3: launch_v4_down_ns<FMT, 3>(hbuf, ids, w, k, experts, E, c, y, st); break;
        default: launch_v4_down_ns<FMT, 4>(hbuf, ids, w, k, experts, E, c, y, st); break;
    }
}

template <int FMT, int NU, int TT>
void launch_v4_small_tt(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                        const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st, int n_max) {
    constexpr int R = 1;
    launch_k(k_moe_gate_up_small_v4<FMT, R, NU, TT>, dim3(grid_for(c.d_ff, k_v4s_warps * R), unsigned(A)), k_v4s_warps * 32, 0, st,
        x, Din, k, experts, A, S, gw, c, hbuf, n_max);
    launch_k(k_moe_down_small_v4<FMT, R, NU, TT>, dim3(grid_for(c.d_out, k_v4s_warps * R), unsigned(A)), k_v4s_warps * 32, 0, st,
        hbuf, experts, A, S, gw, c, ybuf, n_max);
}

// T > 1: the GEMV experts' two stages (the grouping and the combine launches are the caller's). MXFP4: 8 tokens per pass
// (dequant-bound: each chunk dequantized once for all of them), 2 units of gate and of up in flight per lane; when the
// step's slots are sparse over the experts (S <= E / 2: K3 at batch 8, ~1 token per expert) 2 tokens per pass and 4 units
// in flight (the T == 1 balance; an expert with more tokens re-reads its rows from L2). BF16 (bandwidth-bound, the dequant
// is a shift): 4 tokens per pass and 4 units in flight (87 registers: 20 warps per SM x 8 loads).
template <int FMT>
void launch_v4_small(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S, int64_t E,
                     const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st, int n_max) {
    if constexpr (FMT == 1) launch_v4_small_tt<1, 4, 4>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_max);
    else if (2 * S <= E) launch_v4_small_tt<2, 4, 2>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_max);
    else launch_v4_small_tt<2, 2, 8>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_max);
}

template <int FMT, int TT>
void launch_grouped_stages(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                           const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st,
                           int n_max) {
    launch_k(k_moe_gate_up_g<FMT, TT>, dim3(grid_for(c.d_ff, k_g_warps), unsigned(A)), k_g_warps * 32, 0, st,
        x, Din, k, experts, A, S, gw, c, hbuf, n_max);
    launch_k(k_moe_down_g<FMT, TT>, dim3(grid_for(c.d_out, k_g_warps), unsigned(A)), k_g_warps * 32, 0, st, hbuf, experts, A, S,
                                                                                                     gw, c, ybuf, n_max);
}

// ---- Decode v5 (cuda_options::moe_decode_v5, MXFP4 at T == 1): the expert GEMVs on fp16 tensor cores.
// Why: v2, v3 and v4 all stop near 0.23 ms per K3 expert node (28% of the copy rate) although they differ in shape; what
// they share is the per-value work on the FP32 and integer pipes: a dequant (~2-4.5 integer ops, half rate on sm_90), a
// conversion (v3/v4: cvt.f32.f16, a conversion-unit op) and an FMA for every weight, i.e. 4+ instructions per value and
// 4 values per byte. v5 keeps only the dequant (~1.75 integer ops per value, below) and gives the multiply-adds to
// mma.sync m16n8k16 (f16 x f16 -> f32): no FMA, no conversion per value.
// - A (16 x 16) = 16 weight rows of one matrix: fp16 by bit placement (E2M1 magnitude bits to fp16 bits 9-11, sign to
//   15: exactly the E2M1 value * 2^-14, subnormals included), two values per 32-bit op; the sign comes from a byte
//   permute of the word's masked sign bits (fp4x8_f16_v5).
// - The E8M0 scale differs per 32 columns, so one mma must not mix units of different scales... unless its output
//   columns keep them apart: lane (g, t) of a quad holds A's k slots {2t, 2t+1, 2t+8, 2t+9}; those slots carry unit t of
//   a 4-unit (128-column) step, and B (16 x 8) is block diagonal: column n = 2 u + v holds x's hi (v = 0) or lo (v = 1)
//   part on unit u's k slots and zeros elsewhere. D[row][2u + v] is then unit u's dot with x_v, and lane (g, t) holds
//   exactly D[g][2t, 2t+1] and D[g+8][2t, 2t+1]: its own unit's partial sums for its rows, to which it applies its own
//   scale bytes. Every column of the 8 is used; 8 mmas per step and matrix (4 values per lane and row each).
// - x (f32) is split per block into fp16 hi + lo after scaling by 2^e (max|x| 2^e in [2^14, 2^15)): ~22 mantissa bits
//   (the prefill mma kernels' bf16 hi + lo carry ~16) and no fp16 range problem; 2^-e is applied to the final sums. The
//   split x lives in shared memory, permuted so that one 16-byte load gives a lane the B values of one word (8 columns).
// - Rows: a warp owns 16 rows (gate and up for the first kernel); a block of 8 warps 128 rows of one slot. Weight units
//   of the next PD steps are in flight (registers) while one step is dequantized and multiplied; the first steps are
//   issued before the x prologue. The down kernel writes y_j unweighted per slot; k_moe_combine_g sums w_j y_j in slot
//   order (the reference's order): 3 launches per node.

// 8 E2M1 nibbles (column i = bits 4i..4i+3) -> 4 fp16 pairs p[i] = (column i | column i + 4), each value E2M1 * 2^-14.
// 14 integer ops for 8 values: per pair a shift (magnitudes), a byte permute (signs) and a LOP3 merging them.
__device__ __forceinline__ void fp4x8_f16_v5(uint32_t q, uint32_t (&p)[4]) {
    constexpr uint32_t P = 0x0E000E00u;    // fp16 bits 9-11 of both halves: the magnitude
    const uint32_t t = q & 0x88888888u;    // sign bits: odd nibbles at bit 7 of their byte, even ones at bit 3
    const uint32_t t4 = t << 4;            // even nibbles' signs at bit 7 of their byte (odd ones at bit 3 of the next)
    // Byte permutes move the byte holding sign i to byte 1 (bit 15) and sign i + 4 to byte 3 (bit 31); bytes 0 and 2 are
    // zero. The other sign bit of a moved byte lands on bit 11 or 27, inside P, where the magnitude word wins.
    const uint32_t s0 = __byte_perm(t4, 0u, 0x2404u), s1 = __byte_perm(t, 0u, 0x2404u);
    const uint32_t s2 = __byte_perm(t4, 0u, 0x3414u), s3 = __byte_perm(t, 0u, 0x3414u);
    p[0] = ((q << 9) & P) | (s0 & ~P);
    p[1] = ((q << 5) & P) | (s1 & ~P);
    p[2] = ((q << 1) & P) | (s2 & ~P);
    p[3] = ((q >> 3) & P) | (s3 & ~P);
}

__device__ __forceinline__ void mma_f16_v5(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

constexpr int k_v5_warps = 8;
constexpr int k_v5_rows = 16 * k_v5_warps;   // rows per block
// The lo array starts 16 bytes after the hi array's end: the two lanes of a quarter warp that read one unit's hi and lo
// words (lanes 9t and 9t + 4) then hit different banks (without it: 2-way conflicts on every B load).
constexpr int k_v5_lo_pad = 4;
__host__ __device__ constexpr size_t v5_smem(int64_t K) { return size_t(K) * 4 + k_v5_lo_pad * 4; }

// x [K] (f32, global) -> shared hi / lo [K / 2] fp16 pairs, scaled by 2^e (returned), permuted: entry u*16 + w*4 + i =
// (column 32u + 8w + i | column 32u + 8w + i + 4), the order of fp4x8_f16_v5's pairs. Every thread of the block calls it.
template <int W = k_v5_warps>   // warps of the block
__device__ __forceinline__ int v5_stage_x(const float * __restrict__ x, int64_t K, uint32_t * xs_hi, uint32_t * xs_lo) {
    __shared__ float red[W];
    // Both passes unrolled 8 so that a thread's loads of x are independent and in flight together: rolled, each pass is
    // a chain of dependent L2 round trips (28 + 14 per thread for K3's gate/up at 4 warps, ~10 us before the block's
    // first mma). fmaxf is exact and order-free; the entries are computed as before: the staged words are unchanged.
    float m = 0.0f;
    const int Ki = int(K);
#pragma unroll 8
    for (int c = threadIdx.x; c < Ki; c += blockDim.x) m = fmaxf(m, fabsf(x[c]));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < W; ++i) m = fmaxf(m, red[i]);
    int e = 0;
    if (m > 0.0f && m <= 3.0e38f) {   // finite and non-zero: max |x| 2^e in [2^14, 2^15)
        int ex;
        frexpf(m, &ex);
        e = 15 - ex;
    }
#pragma unroll 8
    for (int idx = threadIdx.x; idx < Ki / 2; idx += blockDim.x) {
        const int c0 = (idx >> 4) * 32 + ((idx >> 2) & 3) * 8 + (idx & 3);
        const float a = ldexpf(x[c0], e), b = ldexpf(x[c0 + 4], e);
        const __half ah = __float2half_rn(a), bh = __float2half_rn(b);
        const __half al = __float2half_rn(a - __half2float(ah)), bl = __float2half_rn(b - __half2float(bh));
        xs_hi[idx] = uint32_t(__half_as_ushort(ah)) | (uint32_t(__half_as_ushort(bh)) << 16);
        xs_lo[idx] = uint32_t(__half_as_ushort(al)) | (uint32_t(__half_as_ushort(bl)) << 16);
    }
    __syncthreads();
    return e;
}

// One step's weights for a lane: units (4 UL s + 4 l + t), l < UL, of rows g and g + 8 of each matrix (a step covers
// 64 UL contiguous bytes of each of the warp's rows), and their scale bytes.
template <int NM, int UL>
struct v5_buf {
    uint4 q[NM][2][UL];
    uint32_t sc[NM][2][UL];
};

template <int NM, int UL>
__device__ __forceinline__ void v5_load(v5_buf<NM, UL> & b, const uint8_t * const * base, const uint8_t * const * scl,
                                        int64_t row_g, int64_t n_rows, int64_t nu, int64_t s, int t) {
#pragma unroll
    for (int l = 0; l < UL; ++l) {
        const int64_t u = 4 * UL * s + 4 * l + t;
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t row = row_g + 8 * h;
                b.q[m][h][l] = make_uint4(0, 0, 0, 0);
                b.sc[m][h][l] = 0;
                if (base[m] && u < nu && row < n_rows) {
                    b.q[m][h][l] = __ldg(reinterpret_cast<const uint4 *>(base[m] + row * nu * 16) + u);
                    b.sc[m][h][l] = __ldg(scl[m] + row * nu + u);
                }
            }
    }
}

// One 4-unit group (units u0 + t of the quad's lanes): 8 mmas per matrix into fresh D, then each lane's own scales.
template <int NM, int UL>
__device__ __forceinline__ void v5_group(const uint4 (&qq)[NM][2][UL], const uint32_t (&scs)[NM][2][UL], int l,
                                         const uint32_t * xs_hi, const uint32_t * xs_lo, int64_t nu, int64_t u0, int g, int t,
                                         float (&acc)[NM][2]) {
    // B: lane (g, t) supplies column n = g of B on its k slots; non-zero when n's unit (g >> 1) is the lane's unit t.
    const int64_t u = u0 + t;
    const bool act = (g >> 1) == t && u < nu;
    const uint32_t * xv = (g & 1) ? xs_lo : xs_hi;
    float d[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m) d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint4 xb = make_uint4(0, 0, 0, 0);
        if (act) xb = *reinterpret_cast<const uint4 *>(xv + u * 16 + w * 4);
        uint32_t pg[NM][4], ph[NM][4];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const uint4 & q0 = qq[m][0][l];
            const uint4 & q1 = qq[m][1][l];
            fp4x8_f16_v5(w == 0 ? q0.x : w == 1 ? q0.y : w == 2 ? q0.z : q0.w, pg[m]);
            fp4x8_f16_v5(w == 0 ? q1.x : w == 1 ? q1.y : w == 2 ? q1.z : q1.w, ph[m]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {   // pairs 2hh, 2hh + 1 of the word: k slots (2t, 2t+1) and (2t+8, 2t+9)
            const uint32_t b0 = hh == 0 ? xb.x : xb.z, b1 = hh == 0 ? xb.y : xb.w;
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                const uint32_t a[4] = {pg[m][2 * hh], ph[m][2 * hh], pg[m][2 * hh + 1], ph[m][2 * hh + 1]};
                mma_f16_v5(d[m], a, b0, b1);
            }
        }
    }
    // D[g][2t + v], D[g + 8][2t + v]: unit t's hi and lo sums for rows g, g + 8. E8M0 byte b: 2^(b - 127); the fp16
    // placement's 2^14 goes on the partial sum first (2^14 times a scale near 2^127 would overflow).
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        acc[m][0] = fmaf((d[m][0] + d[m][1]) * 16384.0f, e8m0_g(uint8_t(scs[m][0][l])), acc[m][0]);
        acc[m][1] = fmaf((d[m][2] + d[m][3]) * 16384.0f, e8m0_g(uint8_t(scs[m][1][l])), acc[m][1]);
    }
}

// acc[m][h] += this step's dot of row (g + 8 h) of matrix m with x, over the lane's units 4 UL s + 4 l + t only (the quad
// sums the units later).
template <int NM, int UL>
__device__ __forceinline__ void v5_step(const v5_buf<NM, UL> & b, const uint32_t * xs_hi, const uint32_t * xs_lo, int64_t nu,
                                        int64_t s, int g, int t, float (&acc)[NM][2]) {
#pragma unroll
    for (int l = 0; l < UL; ++l) v5_group<NM>(b.q, b.sc, l, xs_hi, xs_lo, nu, 4 * UL * s + 4 * l, g, t, acc);
}

// The end of every v5/v6/v7 K loop: acc[m][h] summed over the quad's 4 lanes (each lane's units; every lane of the quad
// gets the same bits) and scaled back by 2^-e (the x staging's power of two).
template <int NM>
__device__ __forceinline__ void quad_sum_unscale(float (&acc)[NM][2], int e) {
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = acc[m][h];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            acc[m][h] = ldexpf(v, -e);
        }
}

// The K loop of one warp: acc[m][h] = dot of row (row_g + 8 h) of matrix m with x (the quad's partial sums added, on every
// lane of the quad), scaled back by 2^-e. PD steps in flight ahead of the one being computed; the first PD are issued
// before x is staged (the caller passes `stage`, run between the first loads and the loop).
template <int NM, int PD, int UL, typename STAGE>
__device__ __forceinline__ void v5_rows(const uint8_t * const * base, const uint8_t * const * scl, int64_t row_g,
                                        int64_t n_rows, int64_t nu, const uint32_t * xs_hi, const uint32_t * xs_lo,
                                        STAGE stage, float (&acc)[NM][2]) {
    constexpr int NB = PD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t ns = (nu + 4 * UL - 1) / (4 * UL);
    v5_buf<NM, UL> buf[NB];
#pragma unroll
    for (int i = 0; i < PD; ++i) v5_load<NM, UL>(buf[i], base, scl, row_g, n_rows, nu, i, t);
    const int e = stage();
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = 0.0f;
    for (int64_t s0 = 0; s0 < ns; s0 += NB) {
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int64_t s = s0 + i;
            if (s + PD < ns) v5_load<NM, UL>(buf[(i + PD) % NB], base, scl, row_g, n_rows, nu, s + PD, t);
            if (s < ns) v5_step<NM, UL>(buf[i], xs_hi, xs_lo, nu, s, g, t, acc);
        }
    }
    quad_sum_unscale<NM>(acc, e);
}

// hbuf [k, F] for T == 1: grid (F / 128, k); slot j = blockIdx.y with expert ids[j]; dynamic shared v5_smem(Din) bytes.
template <int PD, int MINB, int UL>
__global__ void __launch_bounds__(k_v5_warps * 32, MINB) k_moe_gate_up_v5(const float * __restrict__ x, int64_t Din,
                                                                      const int32_t * __restrict__ ids,
                                                                      const dexpert * __restrict__ ex, int64_t E,
                                                                      dexperts_cfg c, float * __restrict__ hbuf, int * err) {
    pdl_enter();
    extern __shared__ uint32_t xs_v5[];
    const int j = blockIdx.y;
    const int32_t e = ids[j];
    if (e < 0 || e >= E) {   // the whole block leaves: no barrier is reached
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err + ERR_EXPERT_ID, 1);
        return;
    }
    uint32_t * xs_hi = xs_v5;
    uint32_t * xs_lo = xs_v5 + Din / 2 + k_v5_lo_pad;
    const int64_t row_g = int64_t(blockIdx.x) * k_v5_rows + (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2);
    const uint8_t * const base[2] = {ex[e].gate.packed, ex[e].up.packed};
    const uint8_t * const scl[2] = {ex[e].gate.scale, ex[e].up.scale};
    float acc[2][2];
    v5_rows<2, PD, UL>(base, scl, row_g, c.d_ff, Din / 32, xs_hi, xs_lo, [&] { return v5_stage_x(x, Din, xs_hi, xs_lo); }, acc);
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = row_g + 8 * h;
            if (row < c.d_ff)
                hbuf[int64_t(j) * c.d_ff + row] = c.act == 1 ? situ_d(acc[0][h], acc[1][h], c.situ_beta, c.situ_linear_beta)
                                                             : silu_d(acc[0][h]) * acc[1][h];
        }
    }
}

// ybuf [k, Dout] = down_{ids[j]} h_j (unweighted; an invalid id writes nothing: the combine skips it): grid (Dout / 128, k);
// dynamic shared v5_smem(F) bytes.
template <int PD, int MINB, int UL>
__global__ void __launch_bounds__(k_v5_warps * 32, MINB) k_moe_down_v5(const float * __restrict__ hbuf,
                                                                   const int32_t * __restrict__ ids,
                                                                   const dexpert * __restrict__ ex, int64_t E,
                                                                   dexperts_cfg c, float * __restrict__ ybuf) {
    pdl_enter();
    extern __shared__ uint32_t xs_v5[];
    const int j = blockIdx.y;
    const int32_t e = ids[j];
    if (e < 0 || e >= E) return;
    uint32_t * xs_hi = xs_v5;
    uint32_t * xs_lo = xs_v5 + c.d_ff / 2 + k_v5_lo_pad;
    const int64_t row_g = int64_t(blockIdx.x) * k_v5_rows + (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2);
    const uint8_t * const base[1] = {ex[e].down.packed};
    const uint8_t * const scl[1] = {ex[e].down.scale};
    const float * h = hbuf + int64_t(j) * c.d_ff;
    float acc[1][2];
    v5_rows<1, PD, UL>(base, scl, row_g, c.d_out, c.d_ff / 32, xs_hi, xs_lo, [&] { return v5_stage_x(h, c.d_ff, xs_hi, xs_lo); },
                   acc);
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int64_t row = row_g + 8 * hh;
            if (row < c.d_out) ybuf[int64_t(j) * c.d_out + row] = acc[0][hh];
        }
    }
}

// The largest K (Din or d_ff) v5 stages in shared memory: v5_smem(K) bytes within the default 48 KiB (a multiple of 32).
constexpr int64_t k_v5_max_k = 12256;
static_assert(k_v5_max_k * 4 + k_v5_lo_pad * 4 <= 48 * 1024, "v5 x staging exceeds the default shared memory");

template <int PD, int MINB, int UL = 1>
void launch_v5_gate_up(const float * x, int64_t Din, const int32_t * ids, int64_t k, const dexpert * experts, int64_t E,
                       const dexperts_cfg & c, float * hbuf, int * err, cudaStream_t st) {
    launch_k(k_moe_gate_up_v5<PD, MINB, UL>, dim3(grid_for(c.d_ff, k_v5_rows), unsigned(k)), k_v5_warps * 32, v5_smem(Din), st,
        x, Din, ids, experts, E, c, hbuf, err);
}
template <int PD, int MINB, int UL = 1>
void launch_v5_down(const float * hbuf, const int32_t * ids, int64_t k, const dexpert * experts, int64_t E,
                    const dexperts_cfg & c, float * ybuf, cudaStream_t st) {
    launch_k(k_moe_down_v5<PD, MINB, UL>, dim3(grid_for(c.d_out, k_v5_rows), unsigned(k)), k_v5_warps * 32, v5_smem(c.d_ff), st,
        hbuf, ids, experts, E, c, ybuf);
}

// T == 1, MXFP4: gate/up, down, combine (3 launches). cfg (dmoe_opts::v5_cfg, benchmarks): 0 the defaults, else
// 100 * gate/up form + 10 * down form + stages (0 all, 1 gate/up only, 2 down + combine only); forms: gate/up 1 = PD 1 at
// 3 blocks/SM (the default), 2 = PD 2 at 2, 3 = PD 3 at 1; down 1 = PD 2 at 4 (the default), 2 = PD 3 at 2, 3 = PD 4 at 2,
// 4 = PD 2 at 3; UL 2 (128 contiguous bytes per row and step instead of 64: DRAM locality): gate/up 4 = PD 1 at 2, down
// 5 = PD 1 at 3, 6 = PD 2 at 2 (registers, no spills: gate/up 80 / 121 / 161 / 127, down 62 / 96 / 107 / 71 / <= 85 / 125).
// K3 in one wave: gate/up 24 x 16 blocks at 3 per SM (396 slots), down 28 x 16 at 4 (528 slots).
void launch_v5_one(const float * x, int64_t Din, const int32_t * ids, const float * w, int64_t k, const dexpert * experts,
                   int64_t E, const dexperts_cfg & c, float * hbuf, float * ybuf, float * y, int * err, cudaStream_t st,
                   int cfg) {
    const int gu = cfg / 100 % 10, dn = cfg / 10 % 10, stages = cfg % 10;
    if (stages != 2) {
        if (gu == 2) launch_v5_gate_up<2, 2>(x, Din, ids, k, experts, E, c, hbuf, err, st);
        else if (gu == 3) launch_v5_gate_up<3, 1>(x, Din, ids, k, experts, E, c, hbuf, err, st);
        else if (gu == 4) launch_v5_gate_up<1, 2, 2>(x, Din, ids, k, experts, E, c, hbuf, err, st);
        else launch_v5_gate_up<1, 3>(x, Din, ids, k, experts, E, c, hbuf, err, st);
    }
    if (stages != 1) {
        if (dn == 2) launch_v5_down<3, 2>(hbuf, ids, k, experts, E, c, ybuf, st);
        else if (dn == 3) launch_v5_down<4, 2>(hbuf, ids, k, experts, E, c, ybuf, st);
        else if (dn == 4) launch_v5_down<2, 3>(hbuf, ids, k, experts, E, c, ybuf, st);
        else if (dn == 5) launch_v5_down<1, 3, 2>(hbuf, ids, k, experts, E, c, ybuf, st);
        else if (dn == 6) launch_v5_down<2, 2, 2>(hbuf, ids, k, experts, E, c, ybuf, st);
        else launch_v5_down<2, 4>(hbuf, ids, k, experts, E, c, ybuf, st);
        const int64_t bl = (c.d_out + 255) / 256;
        launch_k(k_moe_combine_g, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, ybuf, w, ids, E, 1, k, c.d_out, y);
    }
}

// ---- Decode v6 (cuda_options::moe_decode_v6, MXFP4 at T == 1; v5_cfg 1000s digit 1): v5's arithmetic on a lean loop,
// the combine folded into the down kernel. Why: v5's gate/up kernel issues ~510 SASS instructions per step (4-unit group)
// and warp, of which ~240 are the dequant and the mmas (static count of the cubin, 512 more per unrolled step; H200, Nsight,
// session 4: issue 0.51 per scheduler, 61% SM throughput, DRAM 41%): the rest is per-load 64-bit address arithmetic
// (row * nu * 16 recomputed for each of the 8 loads of a step), the bounds branches around every load and B load, and the
// zero moves that feed them. v6 takes shapes where no bound can fail (Din, d_ff, d_out multiples of 128: K3, 3584 / 3072)
// and keeps per lane one pointer per (matrix, row) and one for its B words, so a step is its loads at immediate offsets,
// the dequant, 16 mmas and the scales. The weight stream is loaded with L1::no_allocate (read once) so that the scale bytes
// (each 32-byte sector serves 8 steps of a row) stay in L1 instead of going back to L2 (v5: 29% excess L2 sectors, the
// scale loads). The arithmetic is v5's, in v5's order: y is bit for bit v5's.
// Combine: the down kernel's blocks of one 128-row tile (one per slot) count themselves on a per-tile counter; the last to
// arrive sums w_j y_j over the slots in slot order for the tile's rows with k_moe_combine_g's expression (same result,
// bit for bit), after a fence. The counters live in gw (moe_group_ints ints, unused by v5/v6 otherwise) and are zeroed by
// the gate/up kernel (which the down kernel waits for: stream order or PDL's full-grid wait). 2 launches per node.
__device__ __forceinline__ uint4 ld_stream_v6(const uint4 * p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// fp4x8_f16_v5's output, bit for bit (checked on the host for all 2^32 words), in 11 integer ops instead of 14: the
// even nibbles' fields (magnitude bits 0-2 of a byte, sign moved to bit 6 by a LOP3 of q and q << 3) and the odd ones'
// (magnitude at bits 1-3 from q >> 3, sign at bit 7 where it is) sit 6 bits apart as fp16 bits 9-11 and 15 need, so each
// pair is one shift (or none) and one AND with the pair mask: p[0] = e << 9, p[1] = o << 8, p[2] = e << 1, p[3] = o.
__device__ __forceinline__ void fp4x8_f16_v6(uint32_t q, uint32_t (&p)[4]) {
    constexpr uint32_t M = 0x8E008E00u;   // fp16 bits 9-11 and 15 of both halves
    const uint32_t e = (q & 0x07070707u) | ((q << 3) & ~0x07070707u);
    const uint32_t o = ((q >> 3) & 0x0E0E0E0Eu) | (q & ~0x0E0E0E0Eu);
    p[0] = (e << 9) & M;
    p[1] = (o << 8) & M;
    p[2] = (e << 1) & M;
    p[3] = o & M;
}

// e8m0_g's value (b == 0: 2^-127 as 0x00400000; else b << 23), as one max.
__device__ __forceinline__ float e8m0_v6(uint32_t b) { return __int_as_float(max(int(b << 23), 0x00400000)); }

// Lane (g, t)'s streams: q[m][h] = unit t of row (row_g + 8 h) of matrix m (a step s adds 4 s units), sc[m][h] its scale
// byte; xl = the lane's B words of unit t (hi for even g, lo for odd; a step adds 64 words), act = lane supplies B.
template <int NM>
struct v6_lane {
    const uint4 * q[NM];       // row row_g; row row_g + 8 is rs units further
    const uint8_t * sc[NM];    // its scale bytes (row row_g + 8: rs bytes further)
    int rs;                    // 8 nu
};

template <int NM>
__device__ __forceinline__ void v6_load(v5_buf<NM, 1> & b, const v6_lane<NM> & p, int s) {
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            b.q[m][h][0] = ld_stream_v6(p.q[m] + (h ? p.rs : 0) + 4 * s);
            b.sc[m][h][0] = __ldg(p.sc[m] + (h ? p.rs : 0) + 4 * s);
        }
}

// v5_group for one step without bounds: the same loads of B (active lanes only), dequant, mmas and scale steps in the same
// order, so the sums are v5's bit for bit.
template <int NM>
__device__ __forceinline__ void v6_group(const v5_buf<NM, 1> & b, const uint32_t * xl, bool act, uint4 & xb,
                                         float (&acc)[NM][2]) {
    float d[NM][4];
#pragma unroll
    for (int m = 0; m < NM; ++m) d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        if (act) xb = *reinterpret_cast<const uint4 *>(xl + w * 4);   // inactive lanes keep the caller's zeros
        // Matrix by matrix (v5 dequantizes both first): each d[m] sees the same mmas in the same order; 8 fewer live
        // registers.
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            uint32_t pg[4], ph[4];
            const uint4 & q0 = b.q[m][0][0];
            const uint4 & q1 = b.q[m][1][0];
            fp4x8_f16_v6(w == 0 ? q0.x : w == 1 ? q0.y : w == 2 ? q0.z : q0.w, pg);
            fp4x8_f16_v6(w == 0 ? q1.x : w == 1 ? q1.y : w == 2 ? q1.z : q1.w, ph);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const uint32_t b0 = hh == 0 ? xb.x : xb.z, b1 = hh == 0 ? xb.y : xb.w;
                const uint32_t a[4] = {pg[2 * hh], ph[2 * hh], pg[2 * hh + 1], ph[2 * hh + 1]};
                mma_f16_v5(d[m], a, b0, b1);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        acc[m][0] = fmaf((d[m][0] + d[m][1]) * 16384.0f, e8m0_v6(b.sc[m][0][0]), acc[m][0]);
        acc[m][1] = fmaf((d[m][2] + d[m][3]) * 16384.0f, e8m0_v6(b.sc[m][1][0]), acc[m][1]);
    }
}

// v5_rows without bounds: ns = nu / 4 steps (nu % 4 == 0), every row valid. Same order of steps and of the quad sums.
template <int NM, int PD, typename STAGE>
__device__ __forceinline__ void v6_rows(const v6_lane<NM> & p, int ns, const uint32_t * xl, STAGE stage,
                                        float (&acc)[NM][2]) {
    constexpr int NB = PD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool act = (g >> 1) == t;
    uint4 xb = make_uint4(0, 0, 0, 0);   // B words: loaded by active lanes only, zero for the others throughout
    v5_buf<NM, 1> buf[NB];
#pragma unroll
    for (int i = 0; i < PD; ++i)
        if (i < ns) v6_load<NM>(buf[i], p, i);
    const int e = stage();
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = 0.0f;
    for (int s0 = 0; s0 < ns; s0 += NB) {
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int s = s0 + i;
            if (s + PD < ns) v6_load<NM>(buf[(i + PD) % NB], p, s + PD);
            if (s < ns) v6_group<NM>(buf[i], xl + 64 * s, act, xb, acc);
        }
    }
    quad_sum_unscale<NM>(acc, e);
}

// ---- Decode v7 (cuda_options::moe_decode_v7; v5_cfg 1000s digit 2): v6's arithmetic with the weight stream through a
// per-warp ring in shared memory (cp.async), issued in batches of U steps, and blocks of W warps (16 W rows).
// Why. v6's gate/up reads, per warp and step, 64 bytes of each of its 32 rows (16 rows x gate/up; rows 1792 bytes apart
// at K3): every warp load is 16 scattered 64-byte pieces, and the next 64 bytes of the same rows are requested one step
// (~2.8 us at the measured 2.4 TB/s) later, so the DRAM sees ~100k independent 64-byte streams. Session 6, call A
// measured the first ring form (one step per issue, D = 3 steps in flight, twice v6's bytes in flight): SLOWER (gate/up
// 77.8 -> 89.8 us), i.e. the limit is not the bytes in flight but how they are asked for. So here each issue asks for U
// consecutive steps of a row at once (U x 64 contiguous bytes per row, back to back), and the ring holds NB such batches
// (NB - 1 in flight while one is computed).
// Layout per warp and batch slot: the weights [U steps][matrix][row half][lane] uint4 (512 contiguous bytes per (step,
// matrix, half): conflict-free copies and reads), then the scale bytes [matrix][16 rows][4 U bytes] (the U steps' units of
// a row are 4 U contiguous bytes: lane 16 m + r copies those of row r of matrix m with one 4U-byte cp.async). Lanes read
// scale bytes other lanes copied, so each batch is: wait_group (own copies done) + __syncwarp (everyone's visible),
// compute, and the __syncwarp at the next batch's top orders every lane's reads of a slot before its refill.
// Bounds (the launcher's): Din, d_ff, d_out multiples of 128 and nu = K / 32 a multiple of 4 U (whole batches; the
// 4U-byte scale copies aligned). The dequant, mmas and sums are v6_group's in v6's order: y is v6's bit for bit.
// cp.async and the ring's shared loads: cp-async.cuh.

// Bytes of one batch slot of a warp's ring: U steps of NM x 2 x 32 uint4, then NM x 16 rows x 4 U scale bytes.
template <int NM, int U>
constexpr int v7_slot_bytes() { return U * NM * 1024 + NM * 64 * U; }
// Dynamic shared bytes of a v7 block: the x staging (v5_smem(K), a multiple of 16) + W warps' rings of NB slots.
template <int NM, int W, int U, int NB>
constexpr size_t v7_smem(int64_t K) { return v5_smem(K) + size_t(W) * NB * v7_slot_bytes<NM, U>(); }

// The lane's copy streams: its weight units (v6_lane, v6's addresses) and, for lanes < 16 NM, the scale bytes of row
// (warp's first row + lane % 16) of matrix lane / 16.
template <int NM>
struct v7_lane {
    v6_lane<NM> w;
    const uint8_t * sc;   // this lane's scale row (nullptr: the lane copies no scales)
};

// Batch bt (steps U bt .. U bt + U - 1) of the lane's streams into ring slot `slot`.
template <int NM, int U>
__device__ __forceinline__ void v7_issue(uint8_t * slot, const v7_lane<NM> & p, int bt) {
    const int lane = threadIdx.x & 31;
    uint4 * q = reinterpret_cast<uint4 *>(slot);
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int u = 0; u < U; ++u)   // a row's U steps back to back: U x 64 contiguous bytes over the quad
                cp_async16(q + ((u * NM + m) * 2 + h) * 32 + lane, p.w.q[m] + (h ? p.w.rs : 0) + 4 * (U * bt + u));
    if (p.sc) {
        uint8_t * d = slot + U * NM * 1024 + lane * 4 * U;
        if constexpr (U == 4) cp_async16(d, p.sc + 4 * U * bt);
        else cp_async_small<4 * U>(d, p.sc + 4 * U * bt);
    }
}

// v6_rows over the ring. One commit group per batch (empty ones near the end keep the count uniform): after the
// commit at batch b, b + NB groups exist and wait_group NB - 1 completes the first b + 1, i.e. batch b's copies.
template <int NM, int U, int NB, typename STAGE>
__device__ __forceinline__ void v7_rows(const v7_lane<NM> & p, int ns, const uint32_t * xl, uint8_t * ring, STAGE stage,
                                        float (&acc)[NM][2]) {
    static_assert(NB >= 2 && (U == 1 || U == 2 || U == 4), "v7: one batch in flight at least; 4U-byte scale copies");
    constexpr int SB = v7_slot_bytes<NM, U>();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool act = (g >> 1) == t;
    const int nb = ns / U;   // whole batches (the launcher's bound)
    uint4 xb = make_uint4(0, 0, 0, 0);   // B words: loaded by active lanes only, zero for the others throughout
#pragma unroll
    for (int i = 0; i < NB - 1; ++i) {
        if (i < nb) v7_issue<NM, U>(ring + i * SB, p, i);
        cp_async_commit();
    }
    const int e = stage();
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += NB) {
#pragma unroll
        for (int i = 0; i < NB; ++i) {
            const int bt = b0 + i;
            __syncwarp();   // every lane's reads of slot (i + NB - 1) % NB (batch bt - 1) are done
            if (bt + NB - 1 < nb) v7_issue<NM, U>(ring + ((i + NB - 1) % NB) * SB, p, bt + NB - 1);
            cp_async_commit();
            cp_async_wait<NB - 1>();
            __syncwarp();   // batch bt's copies, the scale bytes of other lanes included, visible to the warp
            if (bt < nb) {
                const uint8_t * slot = ring + i * SB;
                const uint4 * q = reinterpret_cast<const uint4 *>(slot);
                const uint8_t * sc = slot + U * NM * 1024;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    v5_buf<NM, 1> b;
#pragma unroll
                    for (int m = 0; m < NM; ++m)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            b.q[m][h][0] = lds128(q + ((u * NM + m) * 2 + h) * 32 + lane);
                            b.sc[m][h][0] = lds_u8(sc + (m * 16 + g + 8 * h) * 4 * U + 4 * u + t);
                        }
                    v6_group<NM>(b, xl + 64 * (U * bt + u), act, xb, acc);
                }
            }
        }
    }
    quad_sum_unscale<NM>(acc, e);
}

// This warp's ring: after the x staging of K columns (v5_smem(K) bytes from the dynamic shared base).
template <int NM, int U, int NB>
__device__ __forceinline__ uint8_t * v7_ring(uint32_t * smem, int64_t K) {
    return reinterpret_cast<uint8_t *>(smem) + v5_smem(K) + (threadIdx.x >> 5) * (NB * v7_slot_bytes<NM, U>());
}

// The scale row a lane copies: row (warp's first row + lane % 16) of matrix lane / 16, for lanes < 16 NM.
template <int NM>
__device__ __forceinline__ const uint8_t * v7_scale_row(const uint8_t * const * scl, int64_t warp_row0, int64_t nu) {
    const int lane = threadIdx.x & 31;
    const uint8_t * m = scl[0];   // a select, not scl[lane >> 4]: a runtime index puts scl in local memory
    if (NM > 1 && lane >= 16) m = scl[NM - 1];
    return lane < 16 * NM ? m + (warp_row0 + (lane & 15)) * nu : nullptr;
}

// The lane's streams for rows row_g, row_g + 8 of NM matrices with nu units per row, and its B pointer into xs.
template <int NM>
__device__ __forceinline__ const uint32_t * v6_setup(v6_lane<NM> & p, const uint8_t * const * base, const uint8_t * const * scl,
                                                     int64_t row_g, int64_t nu, const uint32_t * xs_hi, const uint32_t * xs_lo) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
        p.q[m] = reinterpret_cast<const uint4 *>(base[m] + row_g * nu * 16) + t;
        p.sc[m] = scl[m] + row_g * nu + t;
    }
    p.rs = int(8 * nu);
    return ((g & 1) ? xs_lo : xs_hi) + t * 16;
}

// hbuf [T k, F]: grid (F / (16 W), T k), F and Din multiples of 128; block W warps (16 W rows). Slot j = blockIdx.y is
// pick j % k of token j / k (T == 1: slot j is pick j; T > 1: every (token, pick) pair is a slot of its own, the "pair
// form", see launch_v6). U == 0: v6's register pipeline of PD steps, dynamic shared v5_smem(Din); U > 0: v7's ring of NB
// batches of U steps (PD unused), dynamic shared v7_smem<2, W, U, NB>(Din). Block (0, 0) zeroes the n_cnt combine
// counters of the down kernel that follows.
template <int PD, int MINB, int W = k_v5_warps, int U = 0, int NB = 0>
__global__ void __launch_bounds__(W * 32, MINB) k_moe_gate_up_v6(const float * __restrict__ x, int64_t Din,
                                                                const int32_t * __restrict__ ids, int k,
                                                                const dexpert * __restrict__ ex, int64_t E, dexperts_cfg c,
                                                                float * __restrict__ hbuf, int * err, int * __restrict__ cnt,
                                                                int n_cnt, const int32_t * __restrict__ order) {
    pdl_enter();
    if (blockIdx.x == 0 && blockIdx.y == 0)
        for (int i = threadIdx.x; i < n_cnt; i += blockDim.x) cnt[i] = 0;
    extern __shared__ uint32_t xs_v5[];
    const int j = order ? order[blockIdx.y] : int(blockIdx.y);   // order: the slots sorted by expert (launch_v6)
    x += int64_t(j / k) * Din;   // the slot's token
    const int32_t e = ids[j];
    if (e < 0 || e >= E) {   // the whole block leaves: no barrier is reached
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err + ERR_EXPERT_ID, 1);
        return;
    }
    uint32_t * xs_hi = xs_v5;
    uint32_t * xs_lo = xs_v5 + Din / 2 + k_v5_lo_pad;
    const int64_t warp_row0 = int64_t(blockIdx.x) * (16 * W) + (threadIdx.x >> 5) * 16;
    const int64_t row_g = warp_row0 + ((threadIdx.x & 31) >> 2);
    const uint8_t * const base[2] = {ex[e].gate.packed, ex[e].up.packed};
    const uint8_t * const scl[2] = {ex[e].gate.scale, ex[e].up.scale};
    float acc[2][2];
    const auto stage = [&] { return v5_stage_x<W>(x, Din, xs_hi, xs_lo); };
    if constexpr (U > 0) {
        v7_lane<2> p;
        const uint32_t * xl = v6_setup<2>(p.w, base, scl, row_g, Din / 32, xs_hi, xs_lo);
        p.sc = v7_scale_row<2>(scl, warp_row0, Din / 32);
        v7_rows<2, U, NB>(p, int(Din / 128), xl, v7_ring<2, U, NB>(xs_v5, Din), stage, acc);
    } else {
        v6_lane<2> p;
        const uint32_t * xl = v6_setup<2>(p, base, scl, row_g, Din / 32, xs_hi, xs_lo);
        v6_rows<2, PD>(p, int(Din / 128), xl, stage, acc);
    }
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = row_g + 8 * h;
            hbuf[int64_t(j) * c.d_ff + row] = c.act == 1 ? situ_d(acc[0][h], acc[1][h], c.situ_beta, c.situ_linear_beta)
                                                         : silu_d(acc[0][h]) * acc[1][h];
        }
    }
}

// ybuf [T k, Dout] = down_{ids[j]} h_j (unweighted), then y [t] = sum_j w_j ybuf_j over token t's k slots (in slot order)
// by the last of its slots' blocks of each 16 W-row tile: grid (Dout / (16 W), T k), Dout and F multiples of 128; block W
// warps; dynamic shared v5_smem(F) (U == 0: v6) or v7_smem<1, W, U, NB>(F) (U > 0: the v7 ring, PD unused); cnt [T,
// Dout / (16 W)] zeroed by the gate/up kernel. A slot with an invalid id writes nothing and contributes 0 (as
// k_moe_combine_g), but its block still counts. Token t's y is bit for bit a T == 1 launch's on its row alone.
template <int PD, int MINB, int W = k_v5_warps, int U = 0, int NB = 0>
__global__ void __launch_bounds__(W * 32, MINB) k_moe_down_comb_v6(const float * __restrict__ hbuf,
                                                                  const int32_t * __restrict__ ids,
                                                                  const dexpert * __restrict__ ex, int64_t E, dexperts_cfg c,
                                                                  float * __restrict__ ybuf, const float * __restrict__ w,
                                                                  int64_t k, int * __restrict__ cnt, float * __restrict__ y,
                                                                  const int32_t * __restrict__ order) {
    pdl_enter();
    extern __shared__ uint32_t xs_v5[];
    __shared__ int last;
    constexpr int R = 16 * W;   // rows per block
    const int j = order ? order[blockIdx.y] : int(blockIdx.y);   // as in the gate/up kernel
    const int64_t t = j / k, j0t = t * k;   // the slot's token and its first slot
    const int32_t e = ids[j];
    const int64_t Dout = c.d_out;
    if (e >= 0 && e < E) {   // uniform over the block
        uint32_t * xs_hi = xs_v5;
        uint32_t * xs_lo = xs_v5 + c.d_ff / 2 + k_v5_lo_pad;
        const int64_t warp_row0 = int64_t(blockIdx.x) * R + (threadIdx.x >> 5) * 16;
        const int64_t row_g = warp_row0 + ((threadIdx.x & 31) >> 2);
        const uint8_t * const base[1] = {ex[e].down.packed};
        const uint8_t * const scl[1] = {ex[e].down.scale};
        const float * h = hbuf + int64_t(j) * c.d_ff;
        float acc[1][2];
        const auto stage = [&] { return v5_stage_x<W>(h, c.d_ff, xs_hi, xs_lo); };
        if constexpr (U > 0) {
            v7_lane<1> p;
            const uint32_t * xl = v6_setup<1>(p.w, base, scl, row_g, c.d_ff / 32, xs_hi, xs_lo);
            p.sc = v7_scale_row<1>(scl, warp_row0, c.d_ff / 32);
            v7_rows<1, U, NB>(p, int(c.d_ff / 128), xl, v7_ring<1, U, NB>(xs_v5, c.d_ff), stage, acc);
        } else {
            v6_lane<1> p;
            const uint32_t * xl = v6_setup<1>(p, base, scl, row_g, c.d_ff / 32, xs_hi, xs_lo);
            v6_rows<1, PD>(p, int(c.d_ff / 128), xl, stage, acc);
        }
        if ((threadIdx.x & 3) == 0) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) ybuf[int64_t(j) * Dout + row_g + 8 * hh] = acc[0][hh];
        }
    }
    __threadfence();   // this block's ybuf rows before its count
    __syncthreads();
    if (threadIdx.x == 0)   // modulo: a down-only benchmark
        last = (atomicAdd(cnt + t * gridDim.x + blockIdx.x, 1) + 1) % int(k) == 0;
    __syncthreads();
    if (!last) return;
    __threadfence();   // the other slots' rows (their fence came before their count)
    if (threadIdx.x < R) {
        const int64_t r = int64_t(blockIdx.x) * R + threadIdx.x;
        float a = 0.0f;
        for (int64_t j0 = 0; j0 < k; j0 += 8) {   // k_moe_combine_g's sum (T == 1), in slot order; 8 loads in flight
            float v[8], wv[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int64_t jj = j0t + j0 + i;
                v[i] = wv[i] = 0.0f;
                if (j0 + i < k) {
                    const int32_t ej = ids[jj];
                    wv[i] = w[jj];
                    v[i] = (ej >= 0 && ej < E) ? __ldcg(ybuf + jj * Dout + r) : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (j0 + i < k) a += wv[i] * v[i];
        }
        y[t * Dout + r] = a;
    }
}

// A v7 kernel's dynamic shared limit is raised to its largest use (K = k_v5_max_k) once per (instantiation, device) by
// smem_attr (smem-attr.cuh). The carveout asks for the most shared memory: K3's gate/up block takes 66 576 bytes (x
// staging 14 352 + 4 warps' rings 52 224), 3 per SM with their 1 KB reserves ~198 KiB, so the SM runs the 228 KiB
// carveout and L1 keeps ~28 KiB (the scale bytes no longer go through L1: they are in the ring).
// Each launcher checks the bounds its own (W, U) needs, so that a form table and a dispatch that disagreed could only
// fail the launch, never run partial batches or a mismatched set of combine counters.
template <int W, int U, int NB, int MINB>
cudaError_t launch_v7_gate_up(const float * x, int64_t T, int64_t Din, const int32_t * ids, int64_t k, const dexpert * experts,
                              int64_t E, const dexperts_cfg & c, float * hbuf, int * err, int * cnt, int n_cnt, cudaStream_t st,
                              const int32_t * order) {
    if ((Din / 32) % (4 * U) != 0 || Din % 128 != 0 || c.d_ff % (16 * W) != 0) return cudaErrorInvalidValue;
    constexpr auto kern = k_moe_gate_up_v6<1, MINB, W, U, NB>;
    const cudaError_t attr = smem_attr<kern>(v7_smem<2, W, U, NB>(k_v5_max_k));
    if (attr != cudaSuccess) return attr;
    return launch_k(kern, dim3(unsigned(c.d_ff / (16 * W)), unsigned(T * k)), W * 32, v7_smem<2, W, U, NB>(Din), st, x, Din,
                    ids, int(k), experts, E, c, hbuf, err, cnt, n_cnt, order);
}
template <int W, int U, int NB, int MINB>
cudaError_t launch_v7_down(const float * hbuf, int64_t T, const int32_t * ids, int64_t k, const dexpert * experts, int64_t E,
                           const dexperts_cfg & c, float * ybuf, const float * w, int * cnt, int n_cnt, float * y,
                           cudaStream_t st, const int32_t * order) {
    if ((c.d_ff / 32) % (4 * U) != 0 || c.d_ff % 128 != 0 || c.d_out % (16 * W) != 0 || n_cnt != T * (c.d_out / (16 * W)))
        return cudaErrorInvalidValue;
    constexpr auto kern = k_moe_down_comb_v6<1, MINB, W, U, NB>;
    const cudaError_t attr = smem_attr<kern>(v7_smem<1, W, U, NB>(k_v5_max_k));
    if (attr != cudaSuccess) return attr;
    return launch_k(kern, dim3(unsigned(c.d_out / (16 * W)), unsigned(T * k)), W * 32, v7_smem<1, W, U, NB>(c.d_ff), st, hbuf,
                    ids, experts, E, c, ybuf, w, k, cnt, y, order);
}

// The v7 forms, (warps W, steps per batch U, batches NB, blocks per SM), gate/up by cfg / 100 % 10, down + combine by
// cfg / 10 % 10. K3 node microbenchmark (session 6 calls B, C, H200; v6: gate/up 83.7 us, down + combine 46.2):
//   gate/up 0/1 = (4, 2, 3, 3): 75.7-75.9 us; 2 = (4, 4, 2, 2): 76.9-77.1 (84 KB, 768 blocks = 2.9 waves of 264);
//           3 = (2, 4, 2, 4): 90.7; 4 = (8, 2, 2, 2): 80.1.
//   down    0/1 = (8, 2, 2, 4): 39.9-40.1 us; 2 = (8, 4, 2, 2): 44.9; 3 = (4, 4, 2, 4): 60.0.
// Measured and removed: call A's one step per issue, (8, 1, 3, 3) / (8, 1, 4, 4): 89.8 / 47.6 us (slower than v6); call C's
// batch steps as interleaved mma chains: 76.6 / 41.1 us (no gain); call E's prefetch of the packed rows into L2 2 or 4
// batches beyond the ring: node 123.6 / 127.8 us vs 113.9, k3 step 2.492 / 2.506 vs 2.464 ms (slower).
struct v7_form { int W, U; };
inline v7_form v7_gu_form(int gu) { return gu == 2 ? v7_form{4, 4} : gu == 3 ? v7_form{2, 4} : gu == 4 ? v7_form{8, 2} : v7_form{4, 2}; }
inline v7_form v7_dn_form(int dn) { return dn == 2 ? v7_form{8, 4} : dn == 3 ? v7_form{4, 4} : v7_form{8, 2}; }

// The combine counters' room in gw at the head (one per (token, down row tile of >= 64 rows)).
int64_t moe_counter_ints(int64_t T, int64_t d_out) { return T * ((d_out + 63) / 64); }

// order [S] = the slots 0 .. S - 1 sorted by expert id, stably (an invalid id sorts as E, after every valid one): slot
// order[i] is the i-th. One block; each thread ranks its slots against all S keys staged in shared memory (S <= 4096:
// ~S / 1024 x S compares per thread, a few us at S = 1 024).
constexpr int k_order_max = 4096;
__global__ void __launch_bounds__(1024) k_moe_slot_order(const int32_t * __restrict__ ids, int S, int64_t E,
                                                         int32_t * __restrict__ order) {
    pdl_enter();
    __shared__ int32_t key[k_order_max];
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const int32_t e = ids[j];
        key[j] = e >= 0 && e < E ? e : int32_t(E);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const int32_t kj = key[j];
        int r = 0;
        for (int i = 0; i < S; ++i) {
            const int32_t ki = key[i];
            r += ki < kj || (ki == kj && i < j);
        }
        order[r] = j;
    }
}

// The pair form's slot order for a step of T tokens (dmoe_opts::pairs_sorted), for the MXFP4 and the BF16 pair alike:
// *order = the T k slots sorted by expert (k_moe_slot_order, written into gw after the combine counters), or nullptr
// when there is nothing to sort (one token, sorting off) or more than k_order_max slots (the blocks then run in slot
// order: a speed choice only, the outputs are the same in any order). gw: moe_group_ints(T, k, E, d_out) ints.
cudaError_t launch_pair_order(bool sorted, const int32_t * ids, int64_t T, int64_t k, int64_t E, int64_t d_out, int32_t * gw,
                              cudaStream_t st, const int32_t ** order) {
    *order = nullptr;
    const int64_t S = T * k;
    if (!sorted || T < 2 || S > k_order_max) return cudaSuccess;
    int32_t * ord = gw + moe_counter_ints(T, d_out);
    const cudaError_t e = launch_k(k_moe_slot_order, 1, 1024, 0, st, ids, int(S), E, ord);
    if (e == cudaSuccess) *order = ord;
    return e;
}

// v6 when every bound holds (else false: the caller runs v5 at T == 1, the grouped kernels at T > 1): Din, d_ff, d_out
// multiples of 128, the T x Dout / 128 counters fit in gw (n_gw ints), T k <= 65535 slots.
// T > 1, the pair form (cuda_options::moe_decode_pairs_mxfp4): every (token, pick) pair is a slot of the T == 1 kernels
// (grid T k, the token's x staged per block, one combine counter set per token), so each token's y is bit for bit what
// a T == 1 launch gives on that token alone; an expert picked by n tokens of the step is read n times (no grouping).
// cfg / 1000 % 10 == 2: the v7 kernels (v7_gu_form / v7_dn_form) where also nu % 4U == 0 for both K (else v6); *launch_err
// gets a failed attribute call or launch.
// Forms (cfg / 100 % 10, cfg / 10 % 10 as v5's digits): gate/up 0/1 = PD 1 at 3 blocks/SM, 2 = PD 2 at 2; down 0/1 = PD 2
// at 4, 2 = PD 3 at 2, 4 = PD 2 at 3. Stages (cfg % 10): 0 both, 1 gate/up only, 2 down (+ combine) only.
bool launch_v6(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k, const dexpert * experts,
               int64_t E, const dexperts_cfg & c, float * hbuf, float * ybuf, float * y, int32_t * gw, int64_t n_gw, int * err,
               cudaStream_t st, int cfg, cudaError_t * launch_err, bool sorted) {
    const int64_t tiles = c.d_out / k_v5_rows;
    if (Din % 128 != 0 || c.d_ff % 128 != 0 || c.d_out % 128 != 0 || T < 1 || T * tiles > n_gw || k < 1 || T * k > 65535)
        return false;
    const int32_t * order = nullptr;   // sorted: the slots in expert order (launch_pair_order)
    if (const cudaError_t oe = launch_pair_order(sorted, ids, T, k, E, c.d_out, gw, st, &order); oe != cudaSuccess) {
        *launch_err = oe;
        return true;
    }
    int gu = cfg / 100 % 10, dn = cfg / 10 % 10;
    const int stages = cfg % 10;
    int * cnt = reinterpret_cast<int *>(gw);
    const v7_form fg = v7_gu_form(gu), fd = v7_dn_form(dn);
    const int64_t vt = c.d_out / (16 * fd.W);   // the v7 down form's tiles = combine counters per token
    // v7: the weight stream through a shared-memory ring in batches (same outputs); outside its bounds v6 below runs
    // with its default forms (v7's form digits name other forms there).
    bool v7 = cfg / 1000 % 10 == 2;
    if (v7 && !((Din / 32) % (4 * fg.U) == 0 && (c.d_ff / 32) % (4 * fd.U) == 0 && T * vt <= n_gw)) v7 = false, gu = dn = 0;
    if (v7) {
        cudaError_t e = cudaSuccess;
        const int nc = int(T * vt);
        if (stages != 2) {
            if (gu == 2) e = launch_v7_gate_up<4, 4, 2, 2>(x, T, Din, ids, k, experts, E, c, hbuf, err, cnt, nc, st, order);
            else if (gu == 3) e = launch_v7_gate_up<2, 4, 2, 4>(x, T, Din, ids, k, experts, E, c, hbuf, err, cnt, nc, st, order);
            else if (gu == 4) e = launch_v7_gate_up<8, 2, 2, 2>(x, T, Din, ids, k, experts, E, c, hbuf, err, cnt, nc, st, order);
            else e = launch_v7_gate_up<4, 2, 3, 3>(x, T, Din, ids, k, experts, E, c, hbuf, err, cnt, nc, st, order);
        }
        if (stages != 1 && e == cudaSuccess) {
            if (dn == 2) e = launch_v7_down<8, 4, 2, 2>(hbuf, T, ids, k, experts, E, c, ybuf, w, cnt, nc, y, st, order);
            else if (dn == 3) e = launch_v7_down<4, 4, 2, 4>(hbuf, T, ids, k, experts, E, c, ybuf, w, cnt, nc, y, st, order);
            else e = launch_v7_down<8, 2, 2, 4>(hbuf, T, ids, k, experts, E, c, ybuf, w, cnt, nc, y, st, order);
        }
        *launch_err = e;
        return true;
    }
    const int ki = int(k), nc = int(T * tiles);
    if (stages != 2) {
        const dim3 grid{unsigned(c.d_ff / k_v5_rows), unsigned(T * k)};
        if (gu == 2)
            launch_k(k_moe_gate_up_v6<2, 2>, grid, k_v5_warps * 32, v5_smem(Din), st, x, Din, ids, ki, experts, E, c, hbuf, err,
                     cnt, nc, order);
        else
            launch_k(k_moe_gate_up_v6<1, 3>, grid, k_v5_warps * 32, v5_smem(Din), st, x, Din, ids, ki, experts, E, c, hbuf, err,
                     cnt, nc, order);
    }
    if (stages != 1) {
        const dim3 grid{unsigned(tiles), unsigned(T * k)};
        const float * hb = hbuf;
        if (dn == 2)
            launch_k(k_moe_down_comb_v6<3, 2>, grid, k_v5_warps * 32, v5_smem(c.d_ff), st, hb, ids, experts, E, c, ybuf, w, k,
                     cnt, y, order);
        else if (dn == 4)
            launch_k(k_moe_down_comb_v6<2, 3>, grid, k_v5_warps * 32, v5_smem(c.d_ff), st, hb, ids, experts, E, c, ybuf, w, k,
                     cnt, y, order);
        else
            launch_k(k_moe_down_comb_v6<2, 4>, grid, k_v5_warps * 32, v5_smem(c.d_ff), st, hb, ids, experts, E, c, ybuf, w, k,
                     cnt, y, order);
    }
    return true;
}

} // namespace

namespace {
std::atomic<int64_t> g_pair_launches[2];   // BF16, MXFP4
}
int64_t moe_pair_launches(int fmt) {
    return fmt == 1 || fmt == 2 ? g_pair_launches[fmt - 1].load(std::memory_order_relaxed) : 0;
}

int64_t moe_group_ints(int64_t T, int64_t k, int64_t E, int64_t d_out) {
    const int64_t S = T * k, A = S < E ? S : E, groups = 2 + 2 * A + 2 * S, counters = moe_counter_ints(T, d_out) + S;
    return groups > counters ? groups : counters;   // counters: the combine counters, then the sorted slot order
}

cudaError_t launch_moe_experts_grouped(int vfmt, const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w,
                                       int64_t k, const dexpert * experts, int64_t E, const dexperts_cfg & c,
                                       float * scratch, int32_t * gw, float * y, int * err, cudaStream_t st,
                                       const dmoe_opts & o) {
    const int64_t S = T * k;
    // Prefill-sized steps may use a lower tensor-core threshold (cuda_options::moe_mma_large_step / _tokens): there most
    // experts have a few tokens and the GEMV kernels re-read each row per token chunk.
    const int mma_tokens = o.mma_large_step > 0 && o.mma_large_tokens > 0 && T >= o.mma_large_step ? o.mma_large_tokens
                                                                                                     : o.mma_tokens;
    if (S == 0) return cudaGetLastError();
    if (E > 1024 || vfmt < 1 || vfmt > 3) return cudaErrorInvalidValue;
    const int64_t A = S < E ? S : E;
    const int C = vfmt == 1 ? 8 : 32;
    if (Din % C != 0 || c.d_ff % C != 0) return cudaErrorInvalidValue;
    float * hbuf = scratch;
    float * ybuf = scratch + S * c.d_ff;
    const bool one = T == 1;
    // T > 1 up to dec_pairs_fp4 / dec_pairs_bf16 tokens: the T == 1 kernels below with every (token, pick) pair as a slot
    // (the pair form; no grouping launch and no combine launch); outside their bounds the grouped kernels further down.
    if ((one || T <= o.dec_pairs_fp4) && o.dec_v5 && vfmt == 2 && Din <= k_v5_max_k && c.d_ff <= k_v5_max_k) {
        // 3 launches (v5: fp16 tensor cores). v5_cfg's 1000s digit 1: the v6 kernels (cuda_options::moe_decode_v6) where
        // their bounds hold, else v5 (T == 1 only). 2: the v7 kernels (cuda_options::moe_decode_v7) under the same bounds.
        cudaError_t e = cudaSuccess;
        const int ver = o.v5_cfg / 1000 % 10;
        const bool v6 = (ver == 1 || ver == 2) &&
                        launch_v6(x, T, Din, ids, w, k, experts, E, c, hbuf, ybuf, y, gw, moe_group_ints(T, k, E, c.d_out), err, st, o.v5_cfg, &e,
                                  o.pairs_sorted);
        if (v6 || one) {
            if (!v6) launch_v5_one(x, Din, ids, w, k, experts, E, c, hbuf, ybuf, y, err, st, o.v5_cfg);
            if (!one) g_pair_launches[1].fetch_add(1, std::memory_order_relaxed);
            return e != cudaSuccess ? e : cudaGetLastError();
        }
    }
    if ((one || T <= o.dec_pairs_bf16) && o.dec_bf16 && vfmt == 1 && moe_bf16_decode_supported(Din, k, c, o.bf16_cfg) &&
        T * k <= 65535) {   // BF16 decode pair (moe-bf16-decode.cu) where its shapes hold; else v4 below
        const int32_t * order = nullptr;   // the gate/up slots in expert order (pairs_sorted)
        if (const cudaError_t oe = launch_pair_order(o.pairs_sorted, ids, T, k, E, c.d_out, gw, st, &order); oe != cudaSuccess)
            return oe;
        if (!launch_moe_bf16_decode(x, T, Din, ids, w, k, experts, E, c, hbuf, y, err, st, o.bf16_cfg, order))
            return cudaErrorInvalidValue;   // (its own bounds are the ones checked above)
        if (!one) g_pair_launches[0].fetch_add(1, std::memory_order_relaxed);
        return cudaGetLastError();
    }
    if (one && o.dec_v4 && (vfmt == 1 || vfmt == 2) && k <= 32) {   // 2 launches (v4: gate/up per slot, down + combine)
        if (vfmt == 1) launch_v4_one<1>(x, Din, ids, w, k, experts, E, c, hbuf, y, err, st);
        else launch_v4_one<2>(x, Din, ids, w, k, experts, E, c, hbuf, y, err, st);
        return cudaGetLastError();
    }
    if (vfmt == 2 && one && o.fp4_v2 && o.fp4_v3) {   // 2 launches: gate/up per slot, down + combine (fp4_v2 off: first)
        launch_fp4_v3(x, Din, ids, w, k, experts, E, c, hbuf, y, err, st);
        return cudaGetLastError();
    }
    launch_k(k_moe_group, 1, k_grp_threads, 0, st, ids, S, E, A, gw, err);
    // Experts with >= mma_tokens tokens take the tensor-core kernels, the others the grouped GEMV kernels (each kernel
    // skips the other's experts on the device). T == 1: every expert has one token, GEMV only.
    const bool mma = mma_tokens > 0 && !one && S >= mma_tokens;
    const int n_max = mma ? mma_tokens : INT_MAX;
    // The tensor-core stages run first: v3 / v4 keep x's bf16 planes in ybuf's memory and h's in hbuf's (scratch the
    // GEMV stages' slots overwrite afterwards with their own rows); run after the GEMV stages they would clobber those
    // rows (test-moe-cuda small_v4_batch, session 7 call C).
#define PG_GRP(F)                                                                                              \
    if (mma) launch_moe_mma_stages(F, x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, mma_tokens, o);          \
    if (one) launch_grouped_stages<F, 1>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_max);              \
    else if (o.small_v4 && F != 3) launch_v4_small<F == 3 ? 2 : F>(x, Din, k, experts, A, S, E, gw, c, hbuf, ybuf, st, n_max); \
    else launch_grouped_stages<F, 4>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_max);
    if (vfmt == 2 && one && o.fp4_v2) launch_fp4_v2_stages(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st);
    else if (vfmt == 1) { PG_GRP(1) } else if (vfmt == 2) { PG_GRP(2) } else { PG_GRP(3) }
#undef PG_GRP
    const int64_t n = T * c.d_out;
    const int64_t bl = (n + 255) / 256;
    launch_k(k_moe_combine_g, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, ybuf, w, ids, E, T, k, c.d_out, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda

// ---- MOE_ROUTE, decode-fast form: logits by the bandwidth GEMV (all SMs read the router weight once), then one block
// per token selects in parallel: each of the k picks is a block-wide arg-max with exactly the serial rule's outcome
// (highest biased score, ties to the lower id; a NaN at the first untaken id wins as the serial scan lets it).
namespace perigee::cuda {

namespace {

constexpr int k_sel_threads = 256;

// Token t's selection from its logits row (read with ld.cg: the fused router's rows were written by other blocks).
// Block of k_sel_threads threads; every thread must call it.
__device__ void route_select(const float * __restrict__ lrow, int64_t t, dweight bias, const droute & c,
                             int32_t * __restrict__ ids, float * __restrict__ w) {
    __shared__ float score[1024];
    __shared__ float biased[1024];
    __shared__ unsigned char taken[1024];
    __shared__ float red_v[k_sel_threads / 32];
    __shared__ int red_i[k_sel_threads / 32], red_f[k_sel_threads / 32];
    const int E = int(c.n_expert);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        score[e] = __ldcg(lrow + e);
        taken[e] = 0;
    }
    __syncthreads();
    if (c.softmax) {   // serial, as the reference sums (E <= 1024)
        if (threadIdx.x == 0) {
            float mx = -INFINITY;
            for (int e = 0; e < E; ++e) mx = fmaxf(mx, score[e]);
            double sum = 0.0;
            for (int e = 0; e < E; ++e) {
                score[e] = expf(score[e] - mx);
                sum += score[e];
            }
            for (int e = 0; e < E; ++e) score[e] = float(score[e] / sum);
        }
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = sigmoid_d(score[e]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) biased[e] = score[e] + (bias.data ? wload(bias, e) : 0.0f);
    __syncthreads();
    const bool grouped = c.n_group > 1 && c.topk_group < c.n_group;
    if (grouped && threadIdx.x == 0) {   // group pruning: serial, as the per-token kernel does it (n_group <= 64)
        const int64_t gs = E / c.n_group;
        float gscore[64];
        bool keep[64];
        for (int64_t g = 0; g < c.n_group; ++g) {
            float a = -INFINITY, b2 = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
                const float v = biased[e];
                if (v > a) { b2 = a; a = v; } else if (v > b2) { b2 = v; }
            }
            gscore[g] = a + (gs > 1 ? b2 : 0.0f);
            keep[g] = false;
        }
        for (int64_t i = 0; i < c.topk_group; ++i) {
            int64_t best = -1;
            for (int64_t g = 0; g < c.n_group; ++g)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            keep[best] = true;
        }
        for (int64_t e = 0; e < E; ++e)
            if (!keep[e / gs]) biased[e] = -INFINITY;
    }
    __syncthreads();
    int32_t * oid = ids + t * c.topk;
    for (int64_t j = 0; j < c.topk; ++j) {
        float bv = -INFINITY;
        int bi = -1, first = 0x7fffffff;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            if (taken[e]) continue;
            first = min(first, e);
            const float v = biased[e];
            if (v == v && (bi < 0 || v > bv)) { bv = v; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            const int of = __shfl_xor_sync(0xffffffffu, first, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
            first = min(first, of);
        }
        if (lane == 0) { red_v[wid] = bv; red_i[wid] = bi; red_f[wid] = first; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int q = 1; q < int(blockDim.x >> 5); ++q) {
                const float ov = red_v[q];
                const int oi = red_i[q];
                if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
                first = min(first, red_f[q]);
            }
            const int pick = (biased[first] != biased[first] || bi < 0) ? first : bi;
            oid[j] = pick;
            taken[pick] = 1;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int64_t j = 0; j < c.topk; ++j) sum += score[oid[j]];
        for (int64_t j = 0; j < c.topk; ++j) {
            float wj = score[oid[j]];
            if (c.renormalize) wj = float(wj / (sum + 1e-20));
            w[t * c.topk + j] = wj * c.scale;
        }
    }
}

__global__ void __launch_bounds__(k_sel_threads) k_moe_select(const float * __restrict__ logits, dweight bias, droute c,
                                                              int32_t * __restrict__ ids, float * __restrict__ w) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    route_select(logits + t * c.n_expert, t, bias, c, ids, w);
}

// T == 1: logits by a warp per expert row (grid-strided over the blocks), then the last block to finish selects.
__global__ void __launch_bounds__(k_sel_threads) k_moe_route_fused(const float * __restrict__ x, int64_t D, dweight gate,
                                                                   dweight bias, droute c, float * __restrict__ logits,
                                                                   unsigned * __restrict__ counter,
                                                                   int32_t * __restrict__ ids, float * __restrict__ w) {
    pdl_enter();
    __shared__ bool last;
    const int lane = threadIdx.x & 31, nw = k_sel_threads / 32;
    const int64_t E = c.n_expert;
    const bool vec = gate.type == wtype::BF16 && D % 8 == 0;
    for (int64_t e = int64_t(blockIdx.x) * nw + (threadIdx.x >> 5); e < E; e += int64_t(gridDim.x) * nw) {
        float acc = 0.0f;
        if (vec) {
            const uint4 * row = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(gate.data) + e * D);
            for (int64_t u = lane; u < D / 8; u += 32) {
                const uint4 q = __ldg(row + u);
                const float4 x0 = *reinterpret_cast<const float4 *>(x + 8 * u);
                const float4 x1 = *reinterpret_cast<const float4 *>(x + 8 * u + 4);
                acc = fmaf(__uint_as_float(q.x << 16), x0.x, acc);
                acc = fmaf(__uint_as_float(q.x & 0xFFFF0000u), x0.y, acc);
                acc = fmaf(__uint_as_float(q.y << 16), x0.z, acc);
                acc = fmaf(__uint_as_float(q.y & 0xFFFF0000u), x0.w, acc);
                acc = fmaf(__uint_as_float(q.z << 16), x1.x, acc);
                acc = fmaf(__uint_as_float(q.z & 0xFFFF0000u), x1.y, acc);
                acc = fmaf(__uint_as_float(q.w << 16), x1.z, acc);
                acc = fmaf(__uint_as_float(q.w & 0xFFFF0000u), x1.w, acc);
            }
        } else {
            for (int64_t i = lane; i < D; i += 32) acc = fmaf(wload(gate, e * D + i), x[i], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) logits[e] = acc;
    }
    __threadfence();   // this block's logits are visible device-wide before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    route_select(logits, 0, bias, c, ids, w);
}

} // namespace

cudaError_t launch_moe_route_fused(const float * x, int64_t D, dweight gate, dweight bias, const droute & c, float * logits,
                                   unsigned * counter, int32_t * ids, float * w, cudaStream_t st) {
    if (c.n_expert > 1024 || c.n_group > 64) return cudaErrorInvalidValue;
    const cudaError_t me = cudaMemsetAsync(counter, 0, sizeof(unsigned), st);
    if (me != cudaSuccess) return me;
    constexpr int nw = k_sel_threads / 32;
    const int64_t blocks = (c.n_expert + nw - 1) / nw;
    launch_k(k_moe_route_fused, unsigned(blocks), k_sel_threads, 0, st, x, D, gate, bias, c, logits, counter, ids, w);
    return cudaGetLastError();
}

cudaError_t launch_moe_route_fast(const float * x, int64_t T, int64_t D, dweight gate, dweight bias, const droute & c,
                                  float * logits, int32_t * ids, float * w, cudaStream_t st) {
    if (c.n_expert > 1024 || c.n_group > 64) return cudaErrorInvalidValue;
    if (T == 0) return cudaGetLastError();
    const cudaError_t e = launch_linear_gemv(x, T, D, gate, c.n_expert, logits, st);
    if (e != cudaSuccess) return e;
    launch_k(k_moe_select, unsigned(T), k_sel_threads, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}

} // namespace perigee::cuda

// The selection alone, from logits the caller computed (prefill-ops.h; the prefill router's cuBLASLt logits).
namespace perigee::cuda {

cudaError_t launch_moe_select(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                              cudaStream_t st) {
    if (c.n_expert > 1024 || c.n_group > 64) return cudaErrorInvalidValue;
    if (T > 0) launch_k(k_moe_select, unsigned(T), k_sel_threads, 0, st, logits, bias, c, ids, w);
    return cudaGetLastError();
}

} // namespace perigee::cuda
