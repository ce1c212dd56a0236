// One row of RMS_NORM / L2_NORM / GATED_RMS_NORM / LAYER_NORM held in registers: the arithmetic of norm.cu's k_norm_reg,
// shared with the kernels that compute a norm inside a larger launch (moe-layer-decode.cu), so that their outputs are
// the norm launch's bit for bit by construction rather than by a copied expression. Same order of every sum and
// product as norm.cu's loop kernel k_norm (test-ops-cuda norm_reg_bitwise).
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

// mode 0 = rms (w), 1 = l2, 2 = gated rms (w, z), 3 = layer norm (w, b). Element j of each array is the row's element
// i = threadIdx.x + j * blockDim.x; elements with i >= N are ignored and their out[j] left unset. zv is read in mode 2
// only, bv in mode 3 only, wv in modes 0, 2, 3. Every thread of the block must call it (two block sums).
template <int MODE, int PT>
__device__ __forceinline__ void norm_row_reg(const float (&xv)[PT], const float (&zv)[PT], const float (&wv)[PT],
                                             const float (&bv)[PT], int64_t N, float eps, float (&out)[PT]) {
    float mean = 0.0f;
    if (MODE == 3) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < PT; ++j)
            if (threadIdx.x + int64_t(j) * blockDim.x < N) s += xv[j];
        mean = block_sum(s) / float(N);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PT; ++j)
        if (threadIdx.x + int64_t(j) * blockDim.x < N) {
            const float d = xv[j] - mean;
            ss += d * d;
        }
    ss = block_sum(ss);
    const float inv = MODE == 1 ? rsqrtf(ss + eps) : rsqrtf(ss / float(N) + eps);
#pragma unroll
    for (int j = 0; j < PT; ++j)
        if (threadIdx.x + int64_t(j) * blockDim.x < N) {
            float v = (xv[j] - mean) * inv;
            if (MODE == 0) v *= wv[j];
            if (MODE == 2) v = v * wv[j] * sigmoid_d(zv[j]);
            if (MODE == 3) v = __fadd_rn(__fmul_rn(v, wv[j]), bv[j]);   // two roundings, never contracted (as k_norm)
            out[j] = v;
        }
}

} // namespace perigee::cuda
