// KDA_SCAN, chunked WY form (ARCHITECTURE §3.4 "Chunked (prefill) form", steps 1-7), fp32 on CUDA cores.
//
// Two kernels per launch:
//   k_kda_chunk_prep  grid (chunks of the longest sequence, H, n_seq): everything that depends on one chunk only, all
//                     chunks in parallel. Gamma = inclusive cumsum of g (log2 units) per channel; M and A_qk with
//                     exp2(Gamma_i - Gamma_j) formed per element (j <= i, so every factor is <= 1: no bound on g is
//                     needed, a very negative decay only underflows to 0); X = (I + M)^-1 by forward substitution;
//                     W = X diag(beta) (exp(Gamma) . K), U = X diag(beta) V, plus Q . exp(Gamma) (scaled q), the decayed
//                     keys exp(Gamma_last - Gamma) . K and exp(Gamma_last). U goes into o (the output buffer), the rest
//                     into scratch, all indexed by packed token.
//   k_kda_chunk_state grid (V tiles of 32 columns, H, n_seq): the state pass, chunk after chunk (columns of S are
//                     independent given the chunk's W, Q, K): Vt = U - W S; O = (Q exp(Gamma)) S + A_qk Vt (written over
//                     U in o); S <- diag(exp(Gamma_last)) S + (exp(Gamma_last - Gamma) . K)^T Vt. The fp32 state is read
//                     once and written once per launch, like the recurrent kernel. The chunk's tiles (W; Qg and A;
//                     Kd and exp(Gamma_last)) each have their own shared buffer, filled by cp.async one chunk ahead:
//                     each is refilled for chunk c + 1 as soon as its phase of chunk c has read it. (The first form
//                     staged each tile with a plain load loop when its phase began: 32 dependent global round trips
//                     per tile per thread, ~94 us per chunk on the H200; the 48B prefill spent 15 of 57 ms in it at
//                     T=512, session 12 call C. Same arithmetic in the same order: the outputs are bit for bit.)
//                     The prep kernel's input loads are batched 8 per thread for the same reason.
// Chunks start at each sequence's first token; the tail chunk of n < 64 tokens is padded with k = q = v = g = beta = 0
// (state unchanged by the padding rows, and they are never written out).
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_c = 64;        // chunk
constexpr int k_kmax = 128;    // K and V limits of this path
constexpr int k_cp = k_c + 1;  // padded stride of the transposed [d][j] buffers (conflict-free both ways)
constexpr int k_vt = 32;       // state columns per block in the state pass
constexpr float k_log2e = 1.4426950408889634f;

// Scratch layout (floats): W, Qg, Kd [T, H, K] each; A [T, H, 64]; gl [n_chunk_slots, H, K]. The chunk slot of chunk c
// of sequence s is floor(seq_start[s] / 64) + s + c: distinct for all chunks, fewer than T/64 + n_seq + 1.
struct chunk_scratch {
    float *w, *qg, *kd, *a, *gl;
};
__host__ __device__ inline chunk_scratch scratch_split(float * p, int64_t T, int64_t H, int64_t K) {
    chunk_scratch s;
    s.w = p;
    s.qg = s.w + T * H * K;
    s.kd = s.qg + T * H * K;
    s.a = s.kd + T * H * K;
    s.gl = s.a + T * H * k_c;
    return s;
}

constexpr size_t k_prep_smem_floats = size_t(3 * k_c * k_kmax + 2 * k_kmax * k_cp + 2 * k_c * k_cp + k_c);

__global__ void __launch_bounds__(256) k_kda_chunk_prep(const float * __restrict__ q, const float * __restrict__ k,
                                                        const float * __restrict__ v, const float * __restrict__ g,
                                                        const float * __restrict__ beta, int H, int K, int V, float scale,
                                                        dbatch b, int64_t T, float * __restrict__ scratch,
                                                        float * __restrict__ o) {
    pdl_enter();
    extern __shared__ float4 smem4[];
    float * sm = reinterpret_cast<float *>(smem4);
    float * g_row = sm;                       // [64][128] Gamma (log2 units), row-major
    float * k_row = g_row + k_c * k_kmax;     // [64][128] k, later exp(Gamma) . k
    float * q_row = k_row + k_c * k_kmax;     // [64][128] scale q, later v
    float * g_t = q_row + k_c * k_kmax;       // [128][65] Gamma transposed
    float * k_t = g_t + k_kmax * k_cp;        // [128][65] k transposed
    float * m_s = k_t + k_kmax * k_cp;        // [64][65] M (strictly lower)
    float * x_s = m_s + k_c * k_cp;           // [64][65] X = (I + M)^-1
    float * b_s = x_s + k_c * k_cp;           // [64] beta

    const int s = blockIdx.z, h = blockIdx.y;
    const int64_t t0 = int64_t(b.seq_start[s]) + int64_t(blockIdx.x) * k_c, t1 = b.seq_start[s + 1];
    if (t0 >= t1) return;
    const int n = int(t1 - t0 < k_c ? t1 - t0 : k_c);
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int64_t HK = int64_t(H) * K;
    const chunk_scratch sc = scratch_split(scratch, T, H, K);

    for (int base = 0; base < k_c * k_kmax; base += 256 * 8) {   // 8 elements per thread in flight, then stored
        float gv[8], kv[8], qv[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int idx = base + tid + 256 * r, i = idx / k_kmax, d = idx % k_kmax;
            const bool in = i < n && d < K;
            const int64_t gi = (t0 + i) * HK + int64_t(h) * K + d;
            gv[r] = in ? g[gi] * k_log2e : 0.0f;
            kv[r] = in ? k[gi] : 0.0f;
            qv[r] = in ? q[gi] * scale : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int idx = base + tid + 256 * r, i = idx / k_kmax, d = idx % k_kmax;
            g_row[idx] = gv[r];
            k_row[idx] = kv[r];
            q_row[idx] = qv[r];
            k_t[d * k_cp + i] = kv[r];
        }
    }
    if (tid < k_c) b_s[tid] = tid < n ? beta[(t0 + tid) * H + h] : 0.0f;
    __syncthreads();
    if (tid < k_kmax) {   // inclusive cumsum over the chunk, per channel (padding rows add 0)
        float acc = 0.0f;
        for (int i = 0; i < k_c; ++i) {
            acc += g_row[i * k_kmax + tid];
            g_row[i * k_kmax + tid] = acc;
            g_t[tid * k_cp + i] = acc;
        }
    }
    __syncthreads();

    // M[i][j] = beta_i sum_d k_i k_j exp2(G_i - G_j) (j < i); A[i][j] = sum_d q_i k_j exp2(G_i - G_j) (j <= i).
    // Thread: rows i = w + 8 m (m < 8), columns j0 = lane, j1 = lane + 32 (rows < 32 need only j0).
    {
        float am[8][2], aa[8][2];
#pragma unroll
        for (int m = 0; m < 8; ++m) am[m][0] = am[m][1] = aa[m][0] = aa[m][1] = 0.0f;
        const int j0 = lane, j1 = lane + 32;
        for (int d0 = 0; d0 < K; d0 += 4) {
            float gj0[4], gj1[4], kj0[4], kj1[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                gj0[u] = g_t[(d0 + u) * k_cp + j0];
                gj1[u] = g_t[(d0 + u) * k_cp + j1];
                kj0[u] = k_t[(d0 + u) * k_cp + j0];
                kj1[u] = k_t[(d0 + u) * k_cp + j1];
            }
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int i = w + 8 * m;
                const float4 gi = *reinterpret_cast<const float4 *>(g_row + i * k_kmax + d0);
                const float4 ki = *reinterpret_cast<const float4 *>(k_row + i * k_kmax + d0);
                const float4 qi = *reinterpret_cast<const float4 *>(q_row + i * k_kmax + d0);
                const float giv[4] = {gi.x, gi.y, gi.z, gi.w}, kiv[4] = {ki.x, ki.y, ki.z, ki.w},
                            qiv[4] = {qi.x, qi.y, qi.z, qi.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    // min(., 0): j > i gives a positive exponent; those entries are masked below.
                    const float t0v = kj0[u] * exp2f(fminf(giv[u] - gj0[u], 0.0f));
                    am[m][0] += kiv[u] * t0v;
                    aa[m][0] += qiv[u] * t0v;
                    if (m >= 4) {
                        const float t1v = kj1[u] * exp2f(fminf(giv[u] - gj1[u], 0.0f));
                        am[m][1] += kiv[u] * t1v;
                        aa[m][1] += qiv[u] * t1v;
                    }
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = w + 8 * m;
            const float bi = b_s[i];
            m_s[i * k_cp + j0] = j0 < i ? bi * am[m][0] : 0.0f;
            m_s[i * k_cp + j1] = j1 < i ? bi * am[m][1] : 0.0f;
            if (i < n) {
                float * arow = sc.a + ((t0 + i) * H + h) * k_c;
                arow[j0] = j0 <= i ? aa[m][0] : 0.0f;
                arow[j1] = j1 <= i ? aa[m][1] : 0.0f;
            }
        }
    }
    __syncthreads();

    // X = (I + M)^-1, unit lower triangular, column by column: 4 threads per column j split the sum over m.
    {
        const int j = tid >> 2, part = tid & 3;
        for (int i = 0; i < k_c; ++i) {
            float p = 0.0f;
            for (int m = j + part; m < i; m += 4) p -= m_s[i * k_cp + m] * x_s[m * k_cp + j];
            p += __shfl_xor_sync(0xffffffffu, p, 1);
            p += __shfl_xor_sync(0xffffffffu, p, 2);
            if (part == 0) x_s[i * k_cp + j] = i < j ? 0.0f : (i == j ? 1.0f : p);
            __syncwarp();
        }
    }
    __syncthreads();

    // Outputs that need no X: Q exp(G), exp(G_last - G) K, exp(G_last); then k_row <- exp(G) K.
    {
        const int64_t cslot = int64_t(b.seq_start[s]) / k_c + s + blockIdx.x;
        for (int idx = tid; idx < k_c * k_kmax; idx += 256) {
            const int i = idx / k_kmax, d = idx % k_kmax;
            if (d >= K) continue;
            const float gi = g_row[idx], gl = g_row[(k_c - 1) * k_kmax + d], kv = k_row[idx];
            if (i < n) {
                const int64_t oi = (t0 + i) * HK + int64_t(h) * K + d;
                sc.qg[oi] = q_row[idx] * exp2f(gi);
                sc.kd[oi] = kv * exp2f(gl - gi);
            }
            k_row[idx] = kv * exp2f(gi);
            if (i == 0) sc.gl[(cslot * H + h) * K + d] = exp2f(gl);
        }
    }
    __syncthreads();
    for (int base = 0; base < k_c * k_kmax; base += 256 * 8) {   // q_row <- v [64][V], 8 loads per thread in flight
        float vv[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int idx = base + tid + 256 * r, i = idx / k_kmax, e = idx % k_kmax;
            vv[r] = (i < n && e < V) ? v[(t0 + i) * int64_t(H) * V + int64_t(h) * V + e] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) q_row[base + tid + 256 * r] = vv[r];
    }
    __syncthreads();

    // W[i][d] = sum_j X[i][j] beta_j kg[j][d]; U[i][e] = sum_j X[i][j] beta_j v[j][e]. Rows i = w + 8 m, cols lane + 32 c.
    {
        float aw[8][4], au[8][4];
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
            for (int c = 0; c < 4; ++c) aw[m][c] = au[m][c] = 0.0f;
        for (int j = 0; j < n; ++j) {
            float kg[4], vv[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                kg[c] = k_row[j * k_kmax + lane + 32 * c];
                vv[c] = q_row[j * k_kmax + lane + 32 * c];
            }
            const float bj = b_s[j];
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const float tij = x_s[(w + 8 * m) * k_cp + j] * bj;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    aw[m][c] += tij * kg[c];
                    au[m][c] += tij * vv[c];
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = w + 8 * m;
            if (i >= n) continue;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int d = lane + 32 * c;
                if (d < K) sc.w[(t0 + i) * HK + int64_t(h) * K + d] = aw[m][c];
                if (d < V) o[(t0 + i) * int64_t(H) * V + int64_t(h) * V + d] = au[m][c];
            }
        }
    }
}

// W, Qg, Kd [64][128] each, A [64][64], the state tile [128][32], Vt [64][32], exp(Gamma_last) [128].
constexpr size_t k_state_smem_floats = size_t(3 * k_c * k_kmax + k_c * k_c + k_kmax * k_vt + k_c * k_vt + k_kmax);

// cp.async of rows [0, n) of chunk t0's slice of a [*, H, ncol] scratch array (columns < ncol_valid) into buf
// [64][ncol], 16 bytes a copy, zero-filled elsewhere (rows >= n, columns >= ncol_valid). ncol_valid % 4 == 0.
template <int NCOL>
__device__ __forceinline__ void tile_async(float * buf, const float * __restrict__ src, int64_t t0, int n, int H, int h,
                                           int ncol_valid) {
    constexpr int per_row = NCOL / 4, copies = k_c * per_row / 256;
#pragma unroll
    for (int r = 0; r < copies; ++r) {
        const int ch = threadIdx.x + 256 * r, i = ch / per_row, c = 4 * (ch % per_row);
        const bool ok = i < n && c < ncol_valid;
        const float * p = ok ? src + ((t0 + i) * H + h) * int64_t(ncol_valid) + c : src;
        cp_async16_zfill(buf + i * NCOL + c, p, ok ? 16 : 0);
    }
}

__global__ void __launch_bounds__(256) k_kda_chunk_state(int H, int K, int V, float * __restrict__ state, dbatch b,
                                                         int64_t T, const float * __restrict__ scratch,
                                                         float * __restrict__ o) {
    pdl_enter();
    extern __shared__ float4 smem4[];
    float * sm = reinterpret_cast<float *>(smem4);
    float * w_s = sm;                          // [64][128] W
    float * q_s = w_s + k_c * k_kmax;          // [64][128] Q exp(Gamma)
    float * k_s = q_s + k_c * k_kmax;          // [64][128] exp(Gamma_last - Gamma) K
    float * a_s = k_s + k_c * k_kmax;          // [64][64] A_qk
    float * s_s = a_s + k_c * k_c;             // [128][32] state tile S[d][e0 + e]
    float * v_s = s_s + k_kmax * k_vt;         // [64][32] Vt
    float * gl_s = v_s + k_c * k_vt;           // [128] exp(Gamma_last)

    const int s = blockIdx.z, h = blockIdx.y, e0 = blockIdx.x * k_vt;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int e = e0 + lane;
    const bool ev = e < V;
    const chunk_scratch sc = scratch_split(const_cast<float *>(scratch), T, H, K);
    float * S = state + ((int64_t(b.slot[s]) * H + h) * K) * V;
    const int64_t ts = b.seq_start[s], te = b.seq_start[s + 1];
    if (ts >= te) return;   // nothing to do: the state stays as it is
    // The three copy groups of chunk c (from t0, cslot): W; Qg + A; Kd + exp(Gamma_last). Committed in that order,
    // always (an empty group past the last chunk), so that "wait until 2 groups are pending" is the one wait.
    auto issue_w = [&](int64_t t0) {
        if (t0 < te) tile_async<k_kmax>(w_s, sc.w, t0, int(te - t0 < k_c ? te - t0 : k_c), H, h, K);
        cp_async_commit();
    };
    auto issue_qa = [&](int64_t t0) {
        if (t0 < te) {
            tile_async<k_kmax>(q_s, sc.qg, t0, int(te - t0 < k_c ? te - t0 : k_c), H, h, K);
            tile_async<k_c>(a_s, sc.a, t0, int(te - t0 < k_c ? te - t0 : k_c), H, h, k_c);
        }
        cp_async_commit();
    };
    auto issue_kd = [&](int64_t t0, int64_t cslot) {
        if (t0 < te) {
            tile_async<k_kmax>(k_s, sc.kd, t0, int(te - t0 < k_c ? te - t0 : k_c), H, h, K);
            if (tid < k_kmax / 4) {
                const bool ok = 4 * tid < K;
                const float * p = ok ? sc.gl + (cslot * H + h) * K + 4 * tid : sc.gl;
                cp_async16_zfill(gl_s + 4 * tid, p, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    const int64_t cslot0 = int64_t(ts) / k_c + s;
    issue_w(ts);
    issue_qa(ts);
    issue_kd(ts, cslot0);
    for (int idx = tid; idx < k_kmax * k_vt; idx += 256) {
        const int d = idx / k_vt, c = idx % k_vt;
        s_s[idx] = (d < K && e0 + c < V) ? S[int64_t(d) * V + e0 + c] : 0.0f;
    }
    const int64_t ldo = int64_t(H) * V;
    for (int64_t t0 = ts, c = 0; t0 < te; t0 += k_c, ++c) {
        const int n = int(te - t0 < k_c ? te - t0 : k_c);
        // 1. U (own rows i = 8 w + m, column e); W of this chunk.
        float u[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int i = 8 * w + m;
            u[m] = (i < n && ev) ? o[(t0 + i) * ldo + int64_t(h) * V + e] : 0.0f;
        }
        cp_async_wait<2>();
        __syncthreads();   // W landed for every thread; the state tile of the previous chunk is complete
        // 2. Vt = U - W S
        for (int d0 = 0; d0 < K; d0 += 4) {
            const float s0 = s_s[(d0 + 0) * k_vt + lane], s1 = s_s[(d0 + 1) * k_vt + lane], s2 = s_s[(d0 + 2) * k_vt + lane],
                        s3 = s_s[(d0 + 3) * k_vt + lane];
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const float4 wv = *reinterpret_cast<const float4 *>(w_s + (8 * w + m) * k_kmax + d0);
                u[m] -= wv.x * s0 + wv.y * s1 + wv.z * s2 + wv.w * s3;
            }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) v_s[(8 * w + m) * k_vt + lane] = u[m];
        __syncthreads();   // W read by every thread; Vt complete
        issue_w(t0 + k_c);
        cp_async_wait<2>();
        __syncthreads();   // Qg and A landed
        // 3. O = Qg S + A Vt
        {
            float acc[8];
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
            for (int d0 = 0; d0 < K; d0 += 4) {
                const float s0 = s_s[(d0 + 0) * k_vt + lane], s1 = s_s[(d0 + 1) * k_vt + lane],
                            s2 = s_s[(d0 + 2) * k_vt + lane], s3 = s_s[(d0 + 3) * k_vt + lane];
#pragma unroll
                for (int m = 0; m < 8; ++m) {
                    const float4 qv = *reinterpret_cast<const float4 *>(q_s + (8 * w + m) * k_kmax + d0);
                    acc[m] += qv.x * s0 + qv.y * s1 + qv.z * s2 + qv.w * s3;
                }
            }
            const int jmax = 8 * w + 8 < n ? 8 * w + 8 : n;   // A[i][j] = 0 for j > i
            for (int j = 0; j < jmax; ++j) {
                const float vj = v_s[j * k_vt + lane];
#pragma unroll
                for (int m = 0; m < 8; ++m) acc[m] += a_s[(8 * w + m) * k_c + j] * vj;
            }
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int i = 8 * w + m;
                if (i < n && ev) o[(t0 + i) * ldo + int64_t(h) * V + e] = acc[m];
            }
        }
        __syncthreads();   // Qg and A read by every thread
        issue_qa(t0 + k_c);
        cp_async_wait<2>();
        __syncthreads();   // Kd and exp(Gamma_last) landed
        // 4. S <- diag(gl) S + Kd^T Vt; rows d = 16 w + r.
        {
            float acc[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) acc[r] = gl_s[16 * w + r] * s_s[(16 * w + r) * k_vt + lane];
            for (int j = 0; j < n; ++j) {
                const float vj = v_s[j * k_vt + lane];
#pragma unroll
                for (int r4 = 0; r4 < 4; ++r4) {
                    const float4 kv = *reinterpret_cast<const float4 *>(k_s + j * k_kmax + 16 * w + 4 * r4);
                    acc[4 * r4 + 0] += kv.x * vj;
                    acc[4 * r4 + 1] += kv.y * vj;
                    acc[4 * r4 + 2] += kv.z * vj;
                    acc[4 * r4 + 3] += kv.w * vj;
                }
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) s_s[(16 * w + r) * k_vt + lane] = acc[r];
        }
        __syncthreads();   // Kd and exp(Gamma_last) read by every thread; the state tile updated
        issue_kd(t0 + k_c, cslot0 + c + 1);
    }
    cp_async_wait<0>();   // the empty groups past the last chunk
    for (int idx = tid; idx < k_kmax * k_vt; idx += 256) {
        const int d = idx / k_vt, cc = idx % k_vt;
        if (d < K && e0 + cc < V) S[int64_t(d) * V + e0 + cc] = s_s[idx];
    }
}

} // namespace

int64_t kda_chunk_scratch_floats(int64_t T, int64_t n_seq, int64_t H, int64_t K) {
    return T * H * (3 * K + k_c) + (T / k_c + n_seq + 1) * H * K;
}

cudaError_t launch_kda_scan_chunked(const float * q, const float * k, const float * v, const float * g, const float * beta,
                                    int64_t H, int64_t K, int64_t V, float scale, float * state, const dbatch & b,
                                    int max_seq_len, float * scratch, float * o, cudaStream_t st) {
    if (K < 1 || K > k_kmax || K % 4 != 0 || V < 1 || V > k_kmax) return cudaErrorInvalidValue;
    if (b.n_seq == 0 || H == 0 || max_seq_len <= 0) return cudaGetLastError();
    const size_t prep_smem = k_prep_smem_floats * sizeof(float), state_smem = k_state_smem_floats * sizeof(float);
    // Dynamic shared memory above 48 KiB is opted into once per process (one device per process in this engine).
    static const cudaError_t attr_err = [&] {
        cudaError_t e = cudaFuncSetAttribute(k_kda_chunk_prep, cudaFuncAttributeMaxDynamicSharedMemorySize, int(prep_smem));
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(k_kda_chunk_state, cudaFuncAttributeMaxDynamicSharedMemorySize, int(state_smem));
        return e;
    }();
    if (attr_err != cudaSuccess) return attr_err;
    const unsigned n_chunks = unsigned((max_seq_len + k_c - 1) / k_c);
    launch_k(k_kda_chunk_prep, dim3(n_chunks, unsigned(H), unsigned(b.n_seq)), 256, prep_smem, st,
        q, k, v, g, beta, int(H), int(K), int(V), scale, b, int64_t(b.n_tok), scratch, o);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    launch_k(k_kda_chunk_state, dim3(grid_for(V, k_vt), unsigned(H), unsigned(b.n_seq)), 256, state_smem, st,
        int(H), int(K), int(V), state, b, int64_t(b.n_tok), scratch, o);
    return cudaGetLastError();
}

} // namespace perigee::cuda
