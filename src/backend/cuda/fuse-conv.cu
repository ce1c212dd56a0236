// SHORT_CONV with the per-head L2_NORM of its output in the same launch (cuda_options::fuse_conv_l2, fuse-plan.h): the
// KDA q/k path at decode (conv -> l2 per head of K channels). Kept apart from conv.cu (the prefill kernels live there).
// Block (head, sequence), one thread per channel of the head (blockDim = N); per token of the sequence: the causal
// depthwise conv + SiLU exactly as k_short_conv, then the head's sum of squares by a block reduction and
// y_l2 = y * rsqrt(sum + eps) (k_norm's L2 mode). The conv output is still written (other consumers, comparison).
#include "backend/cuda/common.cuh"
#include "backend/cuda/fuse-ops.h"

namespace perigee::cuda {

namespace {

constexpr int k_conv_max_w = 16;   // = conv.cu k_max_w

__global__ void k_short_conv_l2(const float * __restrict__ x, int64_t C, dweight w, int W, float * __restrict__ state,
                                dbatch b, float * __restrict__ y, float eps, float * __restrict__ yn) {
    pdl_enter();
    const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;   // C % blockDim.x == 0: every thread has a channel
    const int s = blockIdx.y;
    const int H = W - 1;
    const int64_t t0 = b.seq_start[s], L = b.seq_start[s + 1] - t0;
    float * hist = state + (int64_t(b.slot[s]) * C + c) * H;
    float win[k_conv_max_w];   // win[0..H-1] = history (oldest first)
    float wc[k_conv_max_w];
#pragma unroll
    for (int j = 0; j < k_conv_max_w; ++j) {
        win[j] = j < H ? hist[j] : 0.0f;
        wc[j] = j < W ? wload(w, c * W + j) : 0.0f;
    }
    for (int64_t i = 0; i < L; ++i) {
        const float xi = x[(t0 + i) * C + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < k_conv_max_w; ++j)
            if (j < W) acc += wc[j] * (j == H ? xi : win[j]);
        const float v = silu_d(acc);
        y[(t0 + i) * C + c] = v;
        const float ss = block_sum(v * v);
        yn[(t0 + i) * C + c] = v * rsqrtf(ss + eps);
#pragma unroll
        for (int j = 0; j + 1 < k_conv_max_w; ++j)
            if (j + 1 < H) win[j] = win[j + 1];
        if (H > 0) {
#pragma unroll
            for (int j = 0; j < k_conv_max_w; ++j)
                if (j == H - 1) win[j] = xi;
        }
    }
#pragma unroll
    for (int j = 0; j < k_conv_max_w; ++j)
        if (j < H) hist[j] = win[j];
}

} // namespace

cudaError_t launch_short_conv_l2(const float * x, int64_t C, dweight w, int64_t W, float * state, const dbatch & b, float * y,
                                 int64_t N, float eps, float * yn, cudaStream_t st) {
    if (W < 1 || W > k_conv_max_w || N < 32 || N > 1024 || N % 32 != 0 || C % N != 0) return cudaErrorInvalidValue;
    if (b.n_seq > 0 && C > 0)
        launch_k(k_short_conv_l2, dim3(unsigned(C / N), unsigned(b.n_seq)), unsigned(N), 0, st, x, C, w, int(W), state, b, y, eps, yn);
    return cudaGetLastError();
}

} // namespace perigee::cuda
