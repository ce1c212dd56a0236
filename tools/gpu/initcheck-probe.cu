// initcheck probe (issue 9 item 5): does compute-sanitizer's initcheck see what a cuBLASLt GEMM writes on this GPU?
// One cuBLASLt fp32-output GEMM (bf16 inputs) writes C into a fresh cudaMalloc buffer; a plain kernel then reads every
// element of C. Run it under `compute-sanitizer --tool initcheck`: a report here, where C is fully written by the GEMM
// (the program checks every element against a host reference and prints the worst error), is a report about the tool,
// not about the reading kernel. The control reads a second fresh buffer of which the program itself writes only half:
// initcheck must report that one (the half never written).
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a tools/gpu/initcheck-probe.cu -lcublasLt -o initcheck-probe
//   compute-sanitizer --tool initcheck ./initcheck-probe gemm      # C written by cuBLASLt only
//   compute-sanitizer --tool initcheck ./initcheck-probe control   # half of the buffer never written: must report
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); return 2; } } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::printf("cuBLASLt %d at %d\n", int(s_), __LINE__); return 2; } } while (0)

__global__ void k_sum(const float * c, long n, float * out) {
    float s = 0.0f;
    for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x) s += c[i];
    atomicAdd(out, s);
}

__global__ void k_fill_half(float * c, long n) {
    for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n / 2; i += long(gridDim.x) * blockDim.x) c[i] = 1.0f;
}

int main(int argc, char ** argv) {
    const bool control = argc > 1 && std::strcmp(argv[1], "control") == 0;
    const int M = 256, N = 512, K = 1024;   // column-major C [M, N]: every element is checked below
    float * c = nullptr, * out = nullptr;
    CK(cudaMalloc(&c, size_t(M) * N * 4));
    CK(cudaMalloc(&out, 4));
    CK(cudaMemset(out, 0, 4));
    if (control) {
        k_fill_half<<<64, 256>>>(c, long(M) * N);
        k_sum<<<64, 256>>>(c, long(M) * N, out);
        CK(cudaDeviceSynchronize());
        std::printf("initcheck-probe control: read %d floats of which the program wrote %d (initcheck must report)\n", M * N,
                    M * N / 2);
        return 0;
    }
    std::vector<__nv_bfloat16> ha(size_t(M) * K), hb(size_t(K) * N);
    std::vector<float> fa(ha.size()), fb(hb.size());
    for (size_t i = 0; i < ha.size(); ++i) { fa[i] = float(int(i * 37 % 17) - 8) / 8.0f; ha[i] = __float2bfloat16(fa[i]); }
    for (size_t i = 0; i < hb.size(); ++i) { fb[i] = float(int(i * 53 % 13) - 6) / 4.0f; hb[i] = __float2bfloat16(fb[i]); }
    __nv_bfloat16 * a = nullptr, * b = nullptr;
    CK(cudaMalloc(&a, ha.size() * 2));
    CK(cudaMalloc(&b, hb.size() * 2));
    CK(cudaMemcpy(a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    void * ws = nullptr;
    const size_t ws_bytes = 32u << 20;
    CK(cudaMalloc(&ws, ws_bytes));
    cublasLtHandle_t lt;
    LK(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t op;
    LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // column-major: A [M, K] (lda M), B [K, N] (ldb K), C [M, N] (ldc M)
    cublasLtMatrixLayout_t la, lb, lc;
    LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, M, K, M));
    LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, N, K));
    LK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, M, N, M));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t h{};
    int found = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &h, &found));
    if (found == 0) { std::printf("no cuBLASLt algorithm\n"); return 2; }
    const float alpha = 1.0f, beta = 0.0f;
    LK(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &h.algo, ws, ws_bytes, 0));
    k_sum<<<64, 256>>>(c, long(M) * N, out);
    CK(cudaDeviceSynchronize());
    std::vector<float> hc(size_t(M) * N);
    CK(cudaMemcpy(hc.data(), c, hc.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int j = 0; j < N; ++j)
        for (int i = 0; i < M; ++i) {
            double r = 0.0;
            for (int k = 0; k < K; ++k) r += double(fa[size_t(k) * M + i]) * double(fb[size_t(j) * K + k]);
            worst = std::fmax(worst, std::fabs(r - double(hc[size_t(j) * M + i])));
        }
    std::printf("initcheck-probe gemm: C [%d x %d] written by cuBLASLt (bf16 in, fp32 out), every element checked: worst "
                "|error| %.3g (%s)\n", M, N, worst, worst < 1e-3 ? "fully written and right" : "WRONG");
    return worst < 1e-3 ? 0 : 1;
}
