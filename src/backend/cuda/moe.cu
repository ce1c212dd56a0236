// MOE_ROUTE (router logits, sigmoid/softmax, bias-steered grouped top-k) and MOE_EXPERTS (only the selected
// experts are read; MXFP4/NVFP4 weights are dequantized in registers: Hopper has no FP4 tensor cores).
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_route_threads = 256;
constexpr int k_route_max_e = 1024;
constexpr int k_route_max_g = 64;

__global__ void __launch_bounds__(k_route_threads) k_moe_route(const float * __restrict__ x, int64_t D, dweight gate,
                                                               dweight bias, droute c, int32_t * __restrict__ ids,
                                                               float * __restrict__ w) {
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
    if (T > 0) k_moe_route<<<unsigned(T), k_route_threads, 0, st>>>(x, D, gate, bias, c, ids, w);
    return cudaGetLastError();
}

cudaError_t launch_moe_experts(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                               const dexpert * experts, int64_t E, const dexperts_cfg & c, float * scratch, float * y,
                               int * err, cudaStream_t st) {
    if (T * k == 0) return cudaGetLastError();
    float * hbuf = scratch;
    float * ybuf = scratch + T * k * c.d_ff;
    k_moe_gate_up<<<dim3(grid_for(c.d_ff, k_ex_warps), unsigned(T * k)), k_ex_warps * 32, 0, st>>>(x, Din, ids, k, experts,
                                                                                                   E, c, hbuf, err);
    k_moe_down<<<dim3(grid_for(c.d_out, k_ex_warps), unsigned(T * k)), k_ex_warps * 32, 0, st>>>(hbuf, ids, experts, E, c,
                                                                                                 ybuf);
    const int64_t n = T * c.d_out;
    const int64_t bl = (n + 255) / 256;
    k_moe_combine<<<unsigned(bl > 4096 ? 4096 : bl), 256, 0, st>>>(ybuf, w, T, k, c.d_out, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
