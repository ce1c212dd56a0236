// Host launchers of the fused decode kernels (fuse-plan.h plans them; private to backend/cuda and its tests).
// Plain C++ on raw device pointers, like cuda-ops.h.
#pragma once
#include "backend/cuda/cuda-ops.h"

namespace perigee::cuda {

// One LINEAR of a fused GEMV launch: y [T, out] = x' W^T, then the epilogue's residual chain:
// z[0] = y + res[0], z[1] = z[0] + res[1] (each [T, out]; nullptr: none).
struct gemv_fused_seg {
    const void * w = nullptr;
    float * y = nullptr;
    int64_t out = 0;
    const float * res[2] = {nullptr, nullptr};
    float * z[2] = {nullptr, nullptr};
    float * sig = nullptr;   // epilogue: sigmoid(y) [T, out] (a SIGMOID node over y; nullptr: none)
};
// The RMS_NORM folded into the launch's prologue: x' = x * rsqrt(mean(x^2) + eps) * w (w: F32 [in], nullptr = none);
// y: the norm's output [T, in] written by the same launch (nullptr: not written by this launch).
// staged: x' computed once per block into shared memory, then the plain GEMV loop (needs T_chunk * in * 4 <=
// k_gemv_norm_stage_max and in % 4 == 0, else the in-warp kernel runs); false: the round-1 in-warp kernel (every warp
// sums x^2 of the row it streams and scales by w per weight; compare mode).
inline constexpr int64_t k_gemv_norm_stage_max = 47 * 1024;   // bytes of x' per block: + the static reduction
                                                               // scratch within the 48 KiB of no dynamic-smem opt-in
struct gemv_norm {
    bool on = false;
    bool staged = true;
    const float * w = nullptr;
    float eps = 0.0f;
    float * y = nullptr;
};
// Up to k_gemv_group_max segments over the same x [T, in], one weight type; any T (chunks of 8 tokens).
// staged_launches (optional): incremented per launch of the staged-norm kernel (the tests' proof that it ran).
cudaError_t launch_linear_gemv_fused(const float * x, int64_t T, int64_t in, wtype wt, const gemv_fused_seg * segs, int n,
                                     const gemv_norm & nm, cudaStream_t st, int * staged_launches = nullptr,
                                     gemv_cfg cfg = {});
// SHORT_CONV (as launch_short_conv: y [T, C], state updated) and the L2_NORM of y per head of N channels into yn [T, C]
// in one launch (fuse-conv.cu). N % 32 == 0, 32 <= N <= 1024, C % N == 0.
cudaError_t launch_short_conv_l2(const float * x, int64_t C, dweight w, int64_t W, float * state, const dbatch & b, float * y,
                                 int64_t N, float eps, float * yn, cudaStream_t st);
// The KDA block's decode tail in one launch (kda-fused-decode.cu; fuse-plan.h rule 7): the q/k/v short convs (+ SiLU,
// state updated), the per-head L2 norms of q and k, the forget gate (f = fa W_fb^T folded, or f given), the output gate
// (z = ga W_gb^T folded, or z given), the delta-rule step (fp32 state read and written once) and the gated RMSNorm,
// every intermediate written. Layouts as the unfused ops: activations [T, H * K] (beta [T, H]); conv weights
// [H * K, 1, W] and states [slots, H * K, W - 1]; f_b / g_b BF16 [H * K, R]; KDA state [slots, H, K, K].
// Takes K = V in {32, 64, 128}, W = 4, R % 32 == 0 and R <= 128, 16-byte aligned state / y_o / f_b / g_b
// (kda_decode_fused_supported); else cudaErrorInvalidValue.
struct kda_decode_args {
    int H = 0, K = 0, V = 0, W = 0;
    const float * q = nullptr;   // projections before the conv
    const float * k = nullptr;
    const float * v = nullptr;
    dweight conv_q, conv_k, conv_v;
    float * conv_state_q = nullptr;
    float * conv_state_k = nullptr;
    float * conv_state_v = nullptr;
    const float * f = nullptr;   // the gate's input when f_b is not folded (f_b.data == nullptr)
    const float * fa = nullptr;  // [T, Rf] when folded
    const void * f_b = nullptr;  // BF16 [H * K, Rf]
    int Rf = 0;
    dweight a_log, dt_bias;
    float lower_bound = 0.0f;
    const float * beta = nullptr;   // [T, H], sigmoid already applied
    const float * z = nullptr;      // the output gate when g_b is not folded
    const float * ga = nullptr;     // [T, Rg] when folded
    const void * g_b = nullptr;     // BF16 [H * K, Rg]
    int Rg = 0;
    dweight o_norm;
    float l2_eps = 0.0f, norm_eps = 0.0f, scale = 0.0f;
    float * state = nullptr;
    // outputs
    float * y_q = nullptr;   // conv outputs
    float * y_k = nullptr;
    float * y_v = nullptr;
    float * y_qn = nullptr;  // their L2 norms
    float * y_kn = nullptr;
    float * y_f = nullptr;   // f (folded only)
    float * y_g = nullptr;   // the gate
    float * y_z = nullptr;   // z (folded only)
    float * y_o = nullptr;   // the scan's output
    float * y_on = nullptr;  // the gated norm's output
};
bool kda_decode_fused_supported(const kda_decode_args & a);
cudaError_t launch_kda_decode_fused(const kda_decode_args & a, const dbatch & b, cudaStream_t st);
// The layer's output projection computed by the tail's launch (cuda_options::kda_oproj_fused, fuse-plan.h rule 7b; one
// token of one sequence): y = o_proj(y_on) [D], and the GEMV epilogue's adds z0 = y + res0, z1 = z0 + res1 when given.
// One persistent launch (kda-fused-decode.cu k_kda_oproj_d1): the o_proj rows stream while the heads' tails run.
struct kda_oproj_args {
    const void * w = nullptr;   // BF16 [D, H * V]
    int64_t D = 0;
    float * y = nullptr;
    const float * res0 = nullptr;   // with z0: the first ADD (fuse_add), else both null
    float * z0 = nullptr;
    const float * res1 = nullptr;   // with z1: the chained ADD
    float * z1 = nullptr;
    unsigned * sync = nullptr;   // 2 device counters, 0 before the first launch (the launch leaves them 0)
    int * err = nullptr;         // the backend's error flags (ERR_SYNC_TIMEOUT)
};
// The widths the launch takes (the 48B: 32 heads of K = V = 128, any D); the planner asks the same rule.
bool kda_oproj_fused_supported_shape(int64_t H, int64_t K, int64_t V, int64_t D);
bool kda_oproj_fused_supported(const kda_decode_args & a, const kda_oproj_args & o);
// cfg: thousands digit 1 = the weight rows' L2 policy evict_first; ones digit 9 = tests only: a counter that can never
// complete (the launch must end with ERR_SYNC_TIMEOUT flagged).
cudaError_t launch_kda_oproj_fused(const kda_decode_args & a, const kda_oproj_args & o, const dbatch & b, cudaStream_t st,
                                   int cfg);
// w (any float-like dtype) [n] -> F32 [n] (norm weights for the fused prologue).
cudaError_t launch_weight_to_f32(dweight w, int64_t n, float * y, cudaStream_t st);

} // namespace perigee::cuda
