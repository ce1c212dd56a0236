// bench-kernels: the card's two ceilings and the decode kernels against them, measured in one run.
//   copy:  device-to-device copy of 2 GiB (bytes read + written) -> the HBM bandwidth ceiling
//   gemm:  cuBLASLt bf16 x bf16 -> f32, 8192^3 -> the bf16 matrix ceiling
//   gemv:  the backend's LINEAR GEMV (bf16 weights, T = 1 and 8) on K3-sized matrices (weights >> L2)
//   moe:   MOE_EXPERTS decode, MXFP4 experts at K3's latent-MoE widths, 16 of 64 experts selected
//   kda:   KDA recurrent decode step at K3 widths (H 96, K = V = 128), state rotated over 16 slots
// Every figure: median of 20 timed launches after 3 warm-ups, cudaEvent timing, inputs random (never zeros).
#include "backend/cuda/cuda-ops.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

using namespace perigee::cuda;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::fprintf(stderr, "%s: status %d\n", #x, int(s_)); std::exit(1); } } while (0)

static cudaStream_t st;

static double median_ms(const std::function<void()> & f, int reps = 20) {
    for (int i = 0; i < 3; ++i) f();
    CK(cudaStreamSynchronize(st));
    std::vector<double> v;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(a, st));
        f();
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static void * dev_random(size_t bytes, uint32_t seed, bool as_bf16 = false) {
    std::vector<uint16_t> h(bytes / 2);
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto & x : h) {
        if (as_bf16) {
            const float f = u(g) * 0.05f;
            uint32_t b;
            std::memcpy(&b, &f, 4);
            x = uint16_t(b >> 16);
        } else {
            x = uint16_t(g());
        }
    }
    void * d;
    CK(cudaMalloc(reinterpret_cast<void **>(&d), bytes));
    CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    return d;
}

int main() {
    CK(cudaSetDevice(0));
    cudaDeviceProp p{};
    CK(cudaGetDeviceProperties(&p, 0));
    CK(cudaStreamCreate(&st));
    std::printf("device: %s, %d SMs, L2 %d MB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);

    // copy ceiling
    const size_t cb = size_t(2) << 30;
    void *src = dev_random(cb, 1), *dst;
    CK(cudaMalloc(reinterpret_cast<void **>(&dst), cb));
    const double ms_copy = median_ms([&] { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, st)); });
    const double bw = 2.0 * double(cb) / (ms_copy * 1e-3) / 1e9;
    std::printf("copy   2 GiB D2D: %.3f ms, %.0f GB/s (read + write)  <- bandwidth ceiling\n", ms_copy, bw);
    CK(cudaFree(dst));
    CK(cudaFree(src));

    // gemm ceiling: bf16 8192^3 via cuBLASLt, f32 out (what LINEAR does for prefill)
    {
        const int64_t M = 8192, N = 8192, K = 8192;
        void * A = dev_random(size_t(M * K) * 2, 2, true);
        void * B = dev_random(size_t(N * K) * 2, 3, true);
        void * D;
        CK(cudaMalloc(reinterpret_cast<void **>(&D), size_t(M * N) * 4));
        cublasLtHandle_t lt;
        CB(cublasLtCreate(&lt));
        cublasLtMatmulDesc_t desc;
        CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        cublasLtMatrixLayout_t la, lb, ld;
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, N, K));
        CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, M, N, M));
        cublasLtMatmulPreference_t pref;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        size_t wsb = 32u << 20;
        void * ws;
        CK(cudaMalloc(reinterpret_cast<void **>(&ws), wsb));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        cublasLtMatmulHeuristicResult_t h{};
        int found = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &h, &found));
        const float al = 1, be = 0;
        const double ms = median_ms([&] { CB(cublasLtMatmul(lt, desc, &al, A, la, B, lb, &be, D, ld, D, ld, &h.algo, ws, wsb, st)); }, 10);
        std::printf("gemm   bf16 8192^3 -> f32 (cuBLASLt): %.3f ms, %.0f TFLOP/s  <- matrix ceiling\n", ms,
                    2.0 * double(M) * N * K / (ms * 1e-3) / 1e12);
        CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(ws));
    }

    // GEMV: the decode LINEAR path
    for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{7168, 18432}, {16384, 7168}, {163840, 7168}, {2048, 7168}}) {
        void * W = dev_random(size_t(out * in) * 2, 4, true);
        float *x, *y;
        CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(8 * in) * 4));
        CK(cudaMemset(x, 0x3c, size_t(8 * in) * 4));   // 0x3c3c3c3c ~ 0.0115, nonzero
        CK(cudaMalloc(reinterpret_cast<void **>(&y), size_t(8 * out) * 4));
        for (int T : {1, 8}) {
            const double ms = median_ms([&] { CK(launch_linear_gemv(x, T, in, {W, wtype::BF16}, out, y, st)); });
            const double bytes = double(out * in) * 2 + double(T) * (in + out) * 4;
            std::printf("gemv   bf16 [%lld x %lld] T=%d: %.4f ms, %.0f GB/s = %.0f%% of copy\n", (long long)out, (long long)in, T, ms,
                        bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / bw);
        }
        CK(cudaFree(W)); CK(cudaFree(x)); CK(cudaFree(y));
    }

    // MoE decode, MXFP4 experts: latent width 3584 -> 3072 -> 3584 (k3-layers-4 geometry), 16 of 64 experts
    {
        const int64_t E = 64, k = 16, D = 3584, F = 3072;
        std::vector<dexpert> h(static_cast<size_t>(E));
        std::vector<void *> bufs;
        auto mk = [&](int64_t out, int64_t in, uint32_t seed) {
            dexpert_matrix m;
            m.out = out; m.in = in; m.fmt = 1;
            m.packed = static_cast<const uint8_t *>(dev_random(size_t(out * in / 2), seed));
            std::vector<uint8_t> sc(size_t(out * in / 32));
            std::mt19937 g(seed);
            for (auto & s : sc) s = uint8_t(118 + g() % 8);
            void * d;
            CK(cudaMalloc(reinterpret_cast<void **>(&d), sc.size()));
            CK(cudaMemcpy(d, sc.data(), sc.size(), cudaMemcpyHostToDevice));
            m.scale = static_cast<const uint8_t *>(d);
            return m;
        };
        for (int64_t e = 0; e < E; ++e) h[size_t(e)] = {mk(F, D, 100 + uint32_t(e)), mk(F, D, 200 + uint32_t(e)), mk(D, F, 300 + uint32_t(e))};
        dexpert * dex;
        CK(cudaMalloc(reinterpret_cast<void **>(&dex), h.size() * sizeof(dexpert)));
        CK(cudaMemcpy(dex, h.data(), h.size() * sizeof(dexpert), cudaMemcpyHostToDevice));
        std::vector<int32_t> ids(static_cast<size_t>(k));
        for (int64_t j = 0; j < k; ++j) ids[size_t(j)] = int32_t(j * 4 + 1);
        std::vector<float> wts(static_cast<size_t>(k), 1.0f / float(k));
        int32_t * dids; float *dw, *x, *y, *scr; int * err;
        CK(cudaMalloc(reinterpret_cast<void **>(&dids), 64)); CK(cudaMemcpy(dids, ids.data(), size_t(k) * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(reinterpret_cast<void **>(&dw), 64)); CK(cudaMemcpy(dw, wts.data(), size_t(k) * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(D) * 4)); CK(cudaMemset(x, 0x3c, size_t(D) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&y), size_t(D) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&scr), size_t(k * (F + D)) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&err), 16)); CK(cudaMemset(err, 0, 16));
        const dexperts_cfg c{1, 1.0f, 0.0f, F, D};
        const double ms = median_ms([&] { CK(launch_moe_experts(x, 1, D, dids, dw, k, dex, E, c, scr, y, err, st)); });
        const double bytes = double(k) * 3 * double(F * D) * (0.5 + 1.0 / 32);
        std::printf("moe    mxfp4 16 experts [3 x %lld x %lld] T=1: %.4f ms, %.0f GB/s = %.0f%% of copy\n", (long long)F, (long long)D, ms,
                    bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / bw);
    }

    // KDA recurrent decode step at K3 widths; state rotated over 16 slots (100 MB > L2)
    {
        const int64_t H = 96, K = 128, V = 128, S = 16;
        float * state = static_cast<float *>(dev_random(size_t(S * H * K * V) * 4, 7));
        CK(cudaMemset(state, 0, size_t(S * H * K * V) * 4));
        float *q, *kk, *v, *g, *beta, *o;
        for (float ** pp : {&q, &kk, &v, &g, &o}) { CK(cudaMalloc(reinterpret_cast<void **>(pp), size_t(H * K) * 4)); CK(cudaMemset(*pp, 0x3c, size_t(H * K) * 4)); }
        CK(cudaMalloc(reinterpret_cast<void **>(&beta), size_t(H) * 4)); CK(cudaMemset(beta, 0x3c, size_t(H) * 4));
        int32_t hb[5];
        int32_t * db;
        CK(cudaMalloc(reinterpret_cast<void **>(&db), 5 * 4));
        int slot = 0;
        auto step = [&] {
            hb[0] = 0; hb[1] = 1; hb[2] = 0; hb[3] = slot; hb[4] = 0;
            slot = (slot + 1) % int(S);
            CK(cudaMemcpyAsync(db, hb, 5 * 4, cudaMemcpyHostToDevice, st));
            dbatch b;
            b.n_seq = 1; b.n_tok = 1; b.seq_start = db; b.pos0 = db + 2; b.slot = db + 3; b.tok_seq = db + 4;
            CK(launch_kda_scan_recurrent(q, kk, v, g, beta, H, K, V, 0.1f, state, b, o, st));
        };
        const double ms = median_ms(step);
        const double bytes = 2.0 * double(H * K * V) * 4;
        std::printf("kda    recurrent decode H=%lld K=V=%lld: %.4f ms, %.0f GB/s state R+W = %.0f%% of copy (incl. a 20 B H2D copy)\n",
                    (long long)H, (long long)K, ms, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / bw);
    }
    return 0;
}
