// RMS_NORM, LAYER_NORM, L2_NORM, GATED_RMS_NORM: one block per row, fp32 block reductions.
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_threads = 256;

// mode 0 = rms, 1 = l2, 2 = gated rms (z), 3 = layer norm (w, b)
template <int MODE>
__global__ void k_norm(const float * __restrict__ x, const float * __restrict__ z, int64_t N, dweight w, dweight bias,
                       float eps, float * __restrict__ y) {
    pdl_enter();
    const int64_t r = blockIdx.x;
    const float * xr = x + r * N;
    float mean = 0.0f;
    if (MODE == 3) {
        float s = 0.0f;
        for (int64_t i = threadIdx.x; i < N; i += blockDim.x) s += xr[i];
        mean = block_sum(s) / float(N);
    }
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
        const float d = xr[i] - mean;
        ss += d * d;
    }
    ss = block_sum(ss);
    const float inv = MODE == 1 ? rsqrtf(ss + eps) : rsqrtf(ss / float(N) + eps);
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
        float v = (xr[i] - mean) * inv;
        if (MODE == 0) v *= wload_or(w, i, 1.0f);
        if (MODE == 2) v = v * wload(w, i) * sigmoid_d(z[r * N + i]);
        if (MODE == 3) v = v * wload(w, i) + wload(bias, i);
        y[r * N + i] = v;
    }
}

// Wide rows (decode: few rows, one block each) get 1024 threads so a row's loads are spread over 32 warps.
int threads_for(int64_t N) { return N >= 4096 ? 1024 : N >= k_threads ? k_threads : int((N + 31) / 32 * 32); }

} // namespace

cudaError_t launch_rms_norm(const float * x, int64_t R, int64_t N, dweight w, float eps, float * y, cudaStream_t st) {
    if (R > 0) launch_k(k_norm<0>, unsigned(R), threads_for(N), 0, st, x, nullptr, N, w, dweight{}, eps, y);
    return cudaGetLastError();
}
cudaError_t launch_l2_norm(const float * x, int64_t R, int64_t N, float eps, float * y, cudaStream_t st) {
    if (R > 0) launch_k(k_norm<1>, unsigned(R), threads_for(N), 0, st, x, nullptr, N, dweight{}, dweight{}, eps, y);
    return cudaGetLastError();
}
cudaError_t launch_gated_rms_norm(const float * o, const float * z, int64_t R, int64_t N, dweight w, float eps, float * y,
                                  cudaStream_t st) {
    if (R > 0) launch_k(k_norm<2>, unsigned(R), threads_for(N), 0, st, o, z, N, w, dweight{}, eps, y);
    return cudaGetLastError();
}
cudaError_t launch_layer_norm(const float * x, int64_t R, int64_t N, dweight w, dweight b, float eps, float * y,
                              cudaStream_t st) {
    if (R > 0) launch_k(k_norm<3>, unsigned(R), threads_for(N), 0, st, x, nullptr, N, w, b, eps, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
