// RMS_NORM, LAYER_NORM, L2_NORM, GATED_RMS_NORM: one block per row, fp32 block reductions.
#include "backend/cuda/norm-row.cuh"

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
        if (MODE == 3) v = __fadd_rn(__fmul_rn(v, wload(w, i)), wload(bias, i));   // two roundings, never contracted
        y[r * N + i] = v;
    }
}

// The same arithmetic with the row held in registers (PT elements per thread, element i = threadIdx.x + j * blockDim.x
// for j < PT, as the loops above visit them): every load of the row is issued before the first sum, and the weights
// (never written by a kernel of the step) before the PDL wait; the arithmetic is norm-row.cuh's norm_row_reg. Why (ncu,
// 48B decode step, session 8): k_norm<0> on one 2304-wide row took 8.5-10.2 us on one block; each thread's 9 loads of
// x, then of w, went out one after another (the loop bound is not a constant), i.e. ~18 dependent memory round trips.
// Same order of every sum and product as k_norm, so the outputs are bit for bit k_norm's (test-ops-cuda
// norm_reg_bitwise; LAYER_NORM's w * v + b as two explicit roundings in both kernels: the compiler contracted one form
// into an fma and not the other, session 8 call B). Launch bound 1024: 16 values per thread at 1024 threads spill
// rather than fail to launch (64 registers per thread).
template <int MODE, int PT>
__global__ void __launch_bounds__(1024) k_norm_reg(const float * __restrict__ x, const float * __restrict__ z, int64_t N, dweight w, dweight bias,
                           float eps, float * __restrict__ y) {
    float wv[PT], bv[PT];
#pragma unroll
    for (int j = 0; j < PT; ++j) {
        const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
        wv[j] = 1.0f, bv[j] = 0.0f;
        if (i < N) {
            if (MODE == 0) wv[j] = wload_or(w, i, 1.0f);
            if (MODE == 2 || MODE == 3) wv[j] = wload(w, i);
            if (MODE == 3) bv[j] = wload(bias, i);
        }
    }
    pdl_enter();
    const int64_t r = blockIdx.x;
    const float * xr = x + r * N;
    float xv[PT], zv[PT];
#pragma unroll
    for (int j = 0; j < PT; ++j) {
        const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
        xv[j] = i < N ? xr[i] : 0.0f;
        zv[j] = MODE == 2 && i < N ? z[r * N + i] : 0.0f;
    }
    float v[PT];
    norm_row_reg<MODE, PT>(xv, zv, wv, bv, N, eps, v);
#pragma unroll
    for (int j = 0; j < PT; ++j) {
        const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
        if (i < N) y[r * N + i] = v[j];
    }
}

// Wide rows (decode: few rows, one block each) get 1024 threads so a row's loads are spread over 32 warps.
int threads_for(int64_t N) { return N >= 4096 ? 1024 : N >= k_threads ? k_threads : int((N + 31) / 32 * 32); }

// k_norm_reg for rows of up to 16 elements per thread (PT the next power of two), else the loop kernel.
template <int MODE>
void launch_norm(unsigned R, const float * x, const float * z, int64_t N, dweight w, dweight b, float eps, float * y,
                 cudaStream_t st, bool reg) {
    const int th = threads_for(N);
    const int64_t per = (N + th - 1) / th;
    if (!reg || per > 16) launch_k(k_norm<MODE>, R, th, 0, st, x, z, N, w, b, eps, y);
    else if (per <= 1) launch_k(k_norm_reg<MODE, 1>, R, th, 0, st, x, z, N, w, b, eps, y);
    else if (per <= 2) launch_k(k_norm_reg<MODE, 2>, R, th, 0, st, x, z, N, w, b, eps, y);
    else if (per <= 4) launch_k(k_norm_reg<MODE, 4>, R, th, 0, st, x, z, N, w, b, eps, y);
    else if (per <= 8) launch_k(k_norm_reg<MODE, 8>, R, th, 0, st, x, z, N, w, b, eps, y);
    else launch_k(k_norm_reg<MODE, 16>, R, th, 0, st, x, z, N, w, b, eps, y);
}

} // namespace

cudaError_t launch_rms_norm(const float * x, int64_t R, int64_t N, dweight w, float eps, float * y, cudaStream_t st,
                            bool reg) {
    if (R > 0) launch_norm<0>(unsigned(R), x, nullptr, N, w, dweight{}, eps, y, st, reg);
    return cudaGetLastError();
}
cudaError_t launch_l2_norm(const float * x, int64_t R, int64_t N, float eps, float * y, cudaStream_t st, bool reg) {
    if (R > 0) launch_norm<1>(unsigned(R), x, nullptr, N, dweight{}, dweight{}, eps, y, st, reg);
    return cudaGetLastError();
}
cudaError_t launch_gated_rms_norm(const float * o, const float * z, int64_t R, int64_t N, dweight w, float eps, float * y,
                                  cudaStream_t st, bool reg) {
    if (R > 0) launch_norm<2>(unsigned(R), o, z, N, w, dweight{}, eps, y, st, reg);
    return cudaGetLastError();
}
cudaError_t launch_layer_norm(const float * x, int64_t R, int64_t N, dweight w, dweight b, float eps, float * y,
                              cudaStream_t st, bool reg) {
    if (R > 0) launch_norm<3>(unsigned(R), x, nullptr, N, w, b, eps, y, st, reg);
    return cudaGetLastError();
}

} // namespace perigee::cuda
