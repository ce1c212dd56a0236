// KDA_SCAN token recurrence, v2 kernels (kda.cu, cuda_options::kda_decode_v2): the decode path (and short steps below
// the chunked threshold). Declared apart from cuda-ops.h so that the v2 kernel's interface stays in one place.
#pragma once
#include "backend/cuda/cuda-ops.h"

namespace perigee::cuda {

// Whether the v2 kernel takes these dims and pointers: 1 <= K <= 256, V % 4 == 0, state / v / o 16-byte aligned.
bool kda_scan_v2_supported(int64_t K, int64_t V, const float * v, const float * state, const float * o);

// Same contract as launch_kda_scan_recurrent (state [n_slots, H, K, V] fp32, read once and written once per launch;
// tokens of a sequence in order), with the state tile streamed by 16-byte loads: one block of 128 threads per (32
// value columns, head, sequence); thread (row group rg of 16, column quad cq of 8) holds rows [rg*R, rg*R + R) x 4
// columns (R = K / 16 rounded up to 1, 2, 4, 8, 16); S^T k and S^T q are summed over the thread's rows in order, over
// the 4 row groups of a warp by two shuffles, then over the 4 warps in warp order through shared memory (two barriers
// per token; deterministic).
// Returns cudaErrorInvalidValue when kda_scan_v2_supported() is false.
cudaError_t launch_kda_scan_v2(const float * q, const float * k, const float * v, const float * g, const float * beta,
                               int64_t H, int64_t K, int64_t V, float scale, float * state, const dbatch & b, float * o,
                               cudaStream_t st);

} // namespace perigee::cuda
