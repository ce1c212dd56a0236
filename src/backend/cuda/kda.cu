// KDA_GATE and KDA_SCAN (token recurrence; fp32 state read once and written once per launch).
#include "backend/cuda/common.cuh"
#include "backend/cuda/kda-decode.h"
#include "backend/cuda/kda-step.cuh"

namespace perigee::cuda {

namespace {

__global__ void k_kda_gate(const float * __restrict__ f, int64_t T, int64_t H, int64_t K, dweight a_log, dweight dt_bias,
                           float lb, float * __restrict__ g) {
    pdl_enter();
    const int64_t n = T * H * K;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t hk = i % (H * K), h = hk / K;
        const float a = expf(wload(a_log, h));
        const float xb = f[i] + wload(dt_bias, hk);
        g[i] = kda_gate_value_d(a, xb, lb);
    }
}

constexpr int k_scan_warps = 4;
constexpr int k_scan_cols = 8;   // value columns per warp

// Grid (V tiles, H, n_seq). Lane l holds rows d = l + 32 j (j < KPL) of k_scan_cols columns of S in registers.
// Every column of S evolves independently given q, k, g, beta: S[:,e] = exp(g) . S[:,e]; u_e = beta (v_e - S[:,e].k);
// S[:,e] += k u_e; o_e = S[:,e].(scale q).
template <int KPL>
__global__ void __launch_bounds__(k_scan_warps * 32) k_kda_scan_recurrent(
    const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v, const float * __restrict__ g,
    const float * __restrict__ beta, int H, int K, int V, float scale, float * __restrict__ state, dbatch b,
    float * __restrict__ o) {
    pdl_enter();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int h = blockIdx.y, s = blockIdx.z;
    const int e0 = (blockIdx.x * k_scan_warps + wid) * k_scan_cols;
    if (e0 >= V) return;
    float * S = state + ((int64_t(b.slot[s]) * H + h) * K) * V;
    float r[KPL][k_scan_cols];
#pragma unroll
    for (int j = 0; j < KPL; ++j) {
        const int d = lane + 32 * j;
#pragma unroll
        for (int c = 0; c < k_scan_cols; ++c)
            r[j][c] = (d < K && e0 + c < V) ? S[int64_t(d) * V + e0 + c] : 0.0f;
    }
    const int64_t t0 = b.seq_start[s], t1 = b.seq_start[s + 1];
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t qk = (t * H + h) * K;
        float qd[KPL], kd[KPL], ad[KPL];
#pragma unroll
        for (int j = 0; j < KPL; ++j) {
            const int d = lane + 32 * j;
            const bool in = d < K;
            qd[j] = in ? q[qk + d] * scale : 0.0f;
            kd[j] = in ? k[qk + d] : 0.0f;
            ad[j] = in ? expf(g[qk + d]) : 0.0f;
        }
        const float bt = beta[t * H + h];
        const float * vt = v + (t * H + h) * V;
        float pred[k_scan_cols];
#pragma unroll
        for (int c = 0; c < k_scan_cols; ++c) {
            float p = 0.0f;
#pragma unroll
            for (int j = 0; j < KPL; ++j) {
                r[j][c] *= ad[j];
                p += r[j][c] * kd[j];
            }
            pred[c] = warp_sum(p);
        }
        float out[k_scan_cols];
#pragma unroll
        for (int c = 0; c < k_scan_cols; ++c) {
            const float u = (e0 + c < V) ? bt * (vt[e0 + c] - pred[c]) : 0.0f;
            float p = 0.0f;
#pragma unroll
            for (int j = 0; j < KPL; ++j) {
                r[j][c] += kd[j] * u;
                p += r[j][c] * qd[j];
            }
            out[c] = warp_sum(p);
        }
        if (lane < k_scan_cols && e0 + lane < V) {
            float val = 0.0f;
#pragma unroll
            for (int c = 0; c < k_scan_cols; ++c)
                if (c == lane) val = out[c];
            o[(t * H + h) * V + e0 + lane] = val;
        }
    }
#pragma unroll
    for (int j = 0; j < KPL; ++j) {
        const int d = lane + 32 * j;
#pragma unroll
        for (int c = 0; c < k_scan_cols; ++c)
            if (d < K && e0 + c < V) S[int64_t(d) * V + e0 + c] = r[j][c];
    }
}

// ---- Decode v2 (cuda_options::kda_decode_v2) ----
// Why v1 is slow: lane l holds rows l + 32 j of 8 consecutive columns, so each of its 32 scalar loads (and stores) of
// the state touches 32 different 128-byte lines: 1024 L1 wavefronts per warp to load 4 KB. At batch 64 that, not DRAM,
// bounds it (~250 GB/s measured); at batch 1 it is the latency of those serialized requests plus 16 warp reductions.
// v2: lanes run along the columns (float4 each), so a warp's load covers 4 full 128-byte lines (4 wavefronts); the
// dot products over the rows are per-thread FMA chains, then 2 shuffles and one shared-memory step per column.
constexpr int k_v2_cq = 8;                        // column quads per block: 32 value columns
constexpr int k_v2_rg = 16;                       // row groups per block (4 per warp)
constexpr int k_v2_threads = k_v2_cq * k_v2_rg;   // 128 = 4 warps
constexpr int k_v2_warps = k_v2_threads / 32;

// Grid (ceil(V / 32), H, n_seq), 128 threads. Thread (warp w, lane = rl * 8 + cq) is row group rg = 4 w + rl (rows
// [rg R, rg R + R)) and column quad cq (columns e .. e + 3 of the block's 32). Per token, the same math as v1 and the
// CPU reference: S = exp(g) . S (rows); pred = S^T k; u = beta (v - pred); S += k u^T; o = S^T (scale q).
template <int R>
__global__ void __launch_bounds__(k_v2_threads, R >= 16 ? 1 : 4) k_kda_scan_v2(
    const float * __restrict__ q, const float * __restrict__ k, const float * __restrict__ v, const float * __restrict__ g,
    const float * __restrict__ beta, int H, int K, int V, float scale, float * __restrict__ state, dbatch b,
    float * __restrict__ o) {
    pdl_enter();
    __shared__ float4 red_pred[k_v2_warps][k_v2_cq];
    __shared__ float4 red_out[k_v2_warps][k_v2_cq];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int cq = lane & 7, rl = lane >> 3;
    const int d0 = (w * 4 + rl) * R;
    const int h = blockIdx.y, s = blockIdx.z;
    const int e = blockIdx.x * (4 * k_v2_cq) + 4 * cq;
    const bool col_in = e < V;   // V % 4 == 0: a quad is all in or all out
    const int v4 = V >> 2;
    float4 * S = reinterpret_cast<float4 *>(state + ((int64_t(b.slot[s]) * H + h) * K) * V + (col_in ? e : 0));
    float4 r[R];
#pragma unroll
    for (int i = 0; i < R; ++i) r[i] = (col_in && d0 + i < K) ? S[int64_t(d0 + i) * v4] : f4_zero();
    const int64_t t0 = b.seq_start[s], t1 = b.seq_start[s + 1];
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t qk = (t * H + h) * K;
        float kd[R], qd[R], ad[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int d = d0 + i;
            const bool in = d < K;
            kd[i] = in ? k[qk + d] : 0.0f;
            qd[i] = in ? q[qk + d] * scale : 0.0f;
            ad[i] = in ? g[qk + d] : 0.0f;
        }
        const float bt = beta[t * H + h];
        const float4 vv = col_in ? *reinterpret_cast<const float4 *>(v + (t * H + h) * V + e) : f4_zero();
#pragma unroll
        for (int i = 0; i < R; ++i)
            if (d0 + i < K) ad[i] = expf(ad[i]);
        const float4 o4 = kda_v2_step<R>(r, kd, qd, ad, bt, vv, col_in, red_pred, red_out, w, rl, cq);
        if (w == 0 && rl == 0 && col_in) *reinterpret_cast<float4 *>(o + (t * H + h) * V + e) = o4;
    }
#pragma unroll
    for (int i = 0; i < R; ++i)
        if (col_in && d0 + i < K) S[int64_t(d0 + i) * v4] = r[i];
}

} // namespace

cudaError_t launch_kda_gate(const float * f, int64_t T, int64_t H, int64_t K, dweight a_log, dweight dt_bias,
                            float lower_bound, float * g, cudaStream_t st) {
    const int64_t n = T * H * K;
    if (n > 0) {
        const int64_t bl = (n + 255) / 256;
        launch_k(k_kda_gate, unsigned(bl > 4096 ? 4096 : bl), 256, 0, st, f, T, H, K, a_log, dt_bias, lower_bound, g);
    }
    return cudaGetLastError();
}

cudaError_t launch_kda_scan_recurrent(const float * q, const float * k, const float * v, const float * g,
                                      const float * beta, int64_t H, int64_t K, int64_t V, float scale, float * state,
                                      const dbatch & b, float * o, cudaStream_t st) {
    if (b.n_seq == 0 || H == 0) return cudaGetLastError();
    const dim3 grid(grid_for(V, k_scan_warps * k_scan_cols), unsigned(H), unsigned(b.n_seq));
    const int kpl = int((K + 31) / 32);
#define PG_KDA_CASE(N)                                                                                               \
    case N:                                                                                                          \
        launch_k(k_kda_scan_recurrent<N>, grid, k_scan_warps * 32, 0, st, q, k, v, g, beta, int(H), int(K), int(V),  \
                 scale, state, b, o);                                                                                \
        break;
    switch (kpl) {
        PG_KDA_CASE(1)
        PG_KDA_CASE(2)
        case 3: PG_KDA_CASE(4)
        case 5: case 6: case 7: PG_KDA_CASE(8)
        default: return cudaErrorInvalidValue;
    }
#undef PG_KDA_CASE
    return cudaGetLastError();
}

bool kda_scan_v2_supported(int64_t K, int64_t V, const float * v, const float * state, const float * o) {
    auto a16 = [](const float * p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
    return K >= 1 && K <= 16 * k_v2_rg && V >= 4 && V % 4 == 0 && a16(v) && a16(state) && a16(o);
}

cudaError_t launch_kda_scan_v2(const float * q, const float * k, const float * v, const float * g, const float * beta,
                               int64_t H, int64_t K, int64_t V, float scale, float * state, const dbatch & b, float * o,
                               cudaStream_t st) {
    if (!kda_scan_v2_supported(K, V, v, state, o)) return cudaErrorInvalidValue;
    if (b.n_seq == 0 || H == 0) return cudaGetLastError();
    const dim3 grid(grid_for(V, 4 * k_v2_cq), unsigned(H), unsigned(b.n_seq));
    const int64_t rows = (K + k_v2_rg - 1) / k_v2_rg;   // rows per thread
#define PG_KDA_V2_CASE(N)                                                                                            \
    launch_k(k_kda_scan_v2<N>, grid, k_v2_threads, 0, st, q, k, v, g, beta, int(H), int(K), int(V), scale, state, b, \
             o)
    if (rows <= 1) PG_KDA_V2_CASE(1);
    else if (rows <= 2) PG_KDA_V2_CASE(2);
    else if (rows <= 4) PG_KDA_V2_CASE(4);
    else if (rows <= 8) PG_KDA_V2_CASE(8);
    else PG_KDA_V2_CASE(16);
#undef PG_KDA_V2_CASE
    return cudaGetLastError();
}

} // namespace perigee::cuda
