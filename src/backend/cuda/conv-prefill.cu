// SHORT_CONV at prefill (cuda_options::conv_prefill_tokens): one thread per (token, channel) instead of one per
// (sequence, channel) walking its tokens. Token i of a sequence reads its window from x (relative positions i - H .. i)
// and, for positions before the sequence's first token, from the slot's state (H = W - 1 values, oldest first); a second
// kernel then writes the last H inputs back to the state (after every token has read it). The sum runs over the window
// in the same order as conv.cu's kernel (oldest first, the current token last).
#include "backend/cuda/common.cuh"
#include "backend/cuda/prefill-ops.h"

namespace perigee::cuda {

namespace {

constexpr int k_max_w = 16;   // conv.cu's limit

__global__ void k_short_conv_tokens(const float * __restrict__ x, int64_t T, int64_t C, dweight w, int W,
                                    const float * __restrict__ state, dbatch b, float * __restrict__ y) {
    pdl_enter();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int H = W - 1;
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        const int s = b.tok_seq[t];
        const int64_t t0 = b.seq_start[s], i = t - t0;
        const float * hist = state + (int64_t(b.slot[s]) * C + c) * H;
        float acc = 0.0f;
        for (int j = 0; j < W; ++j) {
            const int64_t p = i - H + j;   // relative position of window entry j
            const float v = p >= 0 ? x[(t0 + p) * C + c] : hist[H + p];
            acc += wload(w, c * W + j) * v;
        }
        y[t * C + c] = silu_d(acc);
    }
}

__global__ void k_short_conv_state(const float * __restrict__ x, int64_t C, int W, float * __restrict__ state, dbatch b) {
    pdl_enter();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= C) return;
    const int H = W - 1;
    const int64_t t0 = b.seq_start[s], L = b.seq_start[s + 1] - t0;
    float * hist = state + (int64_t(b.slot[s]) * C + c) * H;
    float old[k_max_w];
#pragma unroll
    for (int j = 0; j < k_max_w; ++j) old[j] = j < H ? hist[j] : 0.0f;
#pragma unroll
    for (int j = 0; j < k_max_w; ++j) {
        if (j >= H) break;
        const int64_t p = L - H + j;   // relative position that becomes history entry j
        float v = 0.0f;
        if (p >= 0) {
            v = x[(t0 + p) * C + c];
        } else {
#pragma unroll
            for (int q = 0; q < k_max_w; ++q)
                if (q == L + j) v = old[q];   // register array: static indices only
        }
        hist[j] = v;
    }
}

} // namespace

cudaError_t launch_short_conv_tokens(const float * x, int64_t T, int64_t C, dweight w, int64_t W, float * state,
                                     const dbatch & b, float * y, cudaStream_t st) {
    if (W < 1 || W > k_max_w) return cudaErrorInvalidValue;
    if (T > 0 && C > 0) {
        const unsigned gy = unsigned(T > 65535 ? 65535 : T);
        launch_k(k_short_conv_tokens, dim3(grid_for(C, 128), gy), 128, 0, st, x, T, C, w, int(W), state, b, y);
    }
    if (b.n_seq > 0 && C > 0 && W > 1)
        launch_k(k_short_conv_state, dim3(grid_for(C, 128), unsigned(b.n_seq)), 128, 0, st, x, C, int(W), state, b);
    return cudaGetLastError();
}

} // namespace perigee::cuda
