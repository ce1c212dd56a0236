// ADD, MUL, SCALE, SIGMOID, SILU_MUL, SITU_MUL, COLS.
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

template <ew_op OP>
__global__ void k_elementwise(const float * __restrict__ a, const float * __restrict__ b, int64_t n, ew_params p,
                              float * __restrict__ y) {
    pdl_enter();
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float x = a[i];
        float r;
        if constexpr (OP == ew_op::ADD) r = x + b[i];
        else if constexpr (OP == ew_op::MUL) r = x * b[i];
        else if constexpr (OP == ew_op::SCALE) r = x * p.scale;
        else if constexpr (OP == ew_op::SIGMOID) r = sigmoid_d(x);
        else if constexpr (OP == ew_op::SILU_MUL) r = silu_d(x) * b[i];
        else r = situ_d(x, b[i], p.beta, p.lin_beta);
        y[i] = r;
    }
}

__global__ void k_cols(const float * __restrict__ x, int64_t T, int64_t C, int64_t c0, int64_t n, float * __restrict__ y) {
    pdl_enter();
    const int64_t total = T * n;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = i / n, j = i % n;
        y[i] = x[t * C + c0 + j];
    }
}

unsigned blocks_for(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return unsigned(b > 4096 ? 4096 : (b < 1 ? 1 : b));
}

} // namespace

cudaError_t launch_elementwise(ew_op op, const float * a, const float * b, int64_t n, const ew_params & p, float * y,
                               cudaStream_t st) {
    if (n <= 0) return cudaGetLastError();
    const unsigned g = blocks_for(n);
    switch (op) {
        case ew_op::ADD: launch_k(k_elementwise<ew_op::ADD>, g, 256, 0, st, a, b, n, p, y); break;
        case ew_op::MUL: launch_k(k_elementwise<ew_op::MUL>, g, 256, 0, st, a, b, n, p, y); break;
        case ew_op::SCALE: launch_k(k_elementwise<ew_op::SCALE>, g, 256, 0, st, a, b, n, p, y); break;
        case ew_op::SIGMOID: launch_k(k_elementwise<ew_op::SIGMOID>, g, 256, 0, st, a, b, n, p, y); break;
        case ew_op::SILU_MUL: launch_k(k_elementwise<ew_op::SILU_MUL>, g, 256, 0, st, a, b, n, p, y); break;
        case ew_op::SITU_MUL: launch_k(k_elementwise<ew_op::SITU_MUL>, g, 256, 0, st, a, b, n, p, y); break;
    }
    return cudaGetLastError();
}

cudaError_t launch_cols(const float * x, int64_t T, int64_t C, int64_t c0, int64_t n, float * y, cudaStream_t st) {
    if (T * n > 0) launch_k(k_cols, blocks_for(T * n), 256, 0, st, x, T, C, c0, n, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
