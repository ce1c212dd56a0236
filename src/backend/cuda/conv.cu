// SHORT_CONV: causal depthwise conv + SiLU per sequence; one thread per (sequence, channel) walks its tokens
// with the window in registers, then writes the last W-1 inputs back to the slot's state.
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_max_w = 16;

__global__ void k_short_conv(const float * __restrict__ x, int64_t C, dweight w, int W, float * __restrict__ state,
                             dbatch b, float * __restrict__ y) {
    pdl_enter();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= C) return;
    const int H = W - 1;
    const int64_t t0 = b.seq_start[s], L = b.seq_start[s + 1] - t0;
    float * hist = state + (int64_t(b.slot[s]) * C + c) * H;
    float win[k_max_w];   // win[0..H-1] = history (oldest first), win[H] = current
    float wc[k_max_w];
#pragma unroll
    for (int j = 0; j < k_max_w; ++j) {
        win[j] = j < H ? hist[j] : 0.0f;
        wc[j] = j < W ? wload(w, c * W + j) : 0.0f;
    }
    for (int64_t i = 0; i < L; ++i) {
        const float xi = x[(t0 + i) * C + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < k_max_w; ++j)
            if (j < W) acc += wc[j] * (j == H ? xi : win[j]);
        y[(t0 + i) * C + c] = silu_d(acc);
        // shift the window by one
#pragma unroll
        for (int j = 0; j + 1 < k_max_w; ++j)
            if (j + 1 < H) win[j] = win[j + 1];
        if (H > 0) {
#pragma unroll
            for (int j = 0; j < k_max_w; ++j)
                if (j == H - 1) win[j] = xi;
        }
    }
#pragma unroll
    for (int j = 0; j < k_max_w; ++j)
        if (j < H) hist[j] = win[j];
}

} // namespace

cudaError_t launch_short_conv(const float * x, int64_t C, dweight w, int64_t W, float * state, const dbatch & b, float * y,
                              cudaStream_t st) {
    if (W < 1 || W > k_max_w) return cudaErrorInvalidValue;
    if (b.n_seq > 0 && C > 0) launch_k(k_short_conv, dim3(grid_for(C, 128), unsigned(b.n_seq)), 128, 0, st, x, C, w, int(W), state, b, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
