// KDA_GATE and KDA_SCAN (token recurrence; fp32 state read once and written once per launch).
#include "backend/cuda/common.cuh"

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
        g[i] = lb < 0.0f ? lb * sigmoid_d(a * xb) : -a * softplus_d(xb);
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

} // namespace perigee::cuda
