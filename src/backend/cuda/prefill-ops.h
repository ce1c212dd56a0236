// Prefill kernels outside the GEMMs (issue 7): the router's logits as a GEMM, the MLA prefill in expanded form with a
// flash-attention kernel. Host launchers; the backend (cuda-backend.cpp) drives the cuBLASLt GEMMs between them.
#pragma once
#include "backend/cuda/cuda-ops.h"

namespace perigee::cuda {

// ---- route-prefill.cu ----
// x [n] -> three bf16 parts p0 + p1 + p2 (each the bf16 rounding of what the earlier parts left): 24 mantissa bits, so
// a GEMM over the three parts with exact bf16 weights and fp32 accumulation carries x at fp32 accuracy.
cudaError_t launch_f32_to_bf16_split3(const float * x, int64_t n, uint16_t * p0, uint16_t * p1, uint16_t * p2,
                                      cudaStream_t st);
// MOE_ROUTE's selection alone (moe.cu k_moe_select: the decode-fast router's parallel per-token selection) from the
// logits [T, E] the backend computed: ids [T, topk], w [T, topk].
cudaError_t launch_moe_select(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                              cudaStream_t st);
// ---- route-select.cu ----
// The same selection with one warp per token and no block barrier (cuda_options::moe_select_warp): ids and weights
// bit for bit those of launch_moe_select. E <= 1024, topk <= 64, n_group <= 64.
cudaError_t launch_moe_select_warp(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                   cudaStream_t st);
// The same selection by a bitonic sort of (score, id) keys per token (cuda_options::moe_select_sort); a token with a NaN
// score takes the serial scan. Same limits.
cudaError_t launch_moe_select_sort(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                   cudaStream_t st);
// The same selection by a threshold search (cuda_options::moe_select_radix): one thread per expert, the k-th largest
// (score, id) key found bit by bit with one counting barrier per bit, then the k picks ranked; a token with a NaN score
// takes the serial scan. 1 <= topk <= 64, E <= 1024, n_group <= 64.
cudaError_t launch_moe_select_radix(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                    cudaStream_t st);
// The same selection by the small form (cuda_options::moe_select_small): one block of 4 warps (two experts per lane) or 8
// per token, k reduction rounds per warp, then the W k candidates ranked; a token with a NaN score takes the serial
// scan. Routes in its domain only: sigmoid, no group pruning, E <= 256, top-k <= 8 (moe_select_small_supported);
// cudaErrorInvalidValue outside it.
bool moe_select_small_supported(int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool softmax);
cudaError_t launch_moe_select_small4(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                     cudaStream_t st);
cudaError_t launch_moe_select_small8(const float * logits, int64_t T, dweight bias, const droute & c, int32_t * ids, float * w,
                                     cudaStream_t st);
// T == 1 in one launch (cuda_options::moe_route_fused_radix): logits [E] = gate [E, D] x (BF16 gate, D a multiple of 32;
// written to `logits`, scratch) by blocks of E rounded up to a warp, then the last block to finish runs the threshold
// selection. counter: one device word that is 0 before the first launch; each complete launch leaves it 0 again (atomicInc
// wraps it), so a persistent zeroed word per stream needs no memset. cudaErrorInvalidValue for another gate dtype or D.
cudaError_t launch_moe_route_radix_fused(const float * x, int64_t D, dweight gate, dweight bias, const droute & c,
                                         float * logits, unsigned * counter, int32_t * ids, float * w, cudaStream_t st);

// ---- mla-prefill.cu ----
// MLA_ATTN prefill without a selection (cuda_options::mla_prefill_tokens), the CPU reference's expanded form:
// 1. launch_mla_prefill_gather: writes every token's [c | kr] into its page, then gathers the cached rows of all
//    positions 0..pos0+len-1 of every sequence s, packed by sequence (sequence s from row sum_{s'<s} (pos0 + len)),
//    into cg [P, L] and krg [P, dr] (P = that sum over the batch).
// 2. (backend) kv [P, H * (dn + dv)] = cg W^T, W = kv_b [H * (dn + dv), L]: per head k_nope (dn) then v (dv).
// 3. launch_mla_prefill_attn: per (64-token query tile of one sequence, head) a causal flash-attention pass over the key
//    tiles (fp32 SIMT, online softmax): o [T, H, dv].
cudaError_t launch_mla_prefill_gather(const float * c, const float * kr, int64_t L, int64_t dr, float * cache, const dbatch & b,
                                      int64_t P, float * cg, float * krg, cudaStream_t st);
// Dynamic shared memory the attention kernel needs; 0 when the shape is unsupported (dn + dr > 256 or dv > 128).
size_t mla_prefill_smem(const mla_shape & d);
cudaError_t launch_mla_prefill_attn(const float * q, const float * kv, const float * krg, const mla_shape & d, float scale,
                                    const dbatch & b, float * o, cudaStream_t st);
// 3'. The tensor-core form (cuda_options::mla_prefill_mma): kv and krg split into bf16 hi + lo planes first (kvh / kvl
// [P, H * (dn + dv)], krh / krl [P, dr]; launch_f32_to_bf16_split), each product hi.hi + hi.lo + lo.hi with fp32
// accumulation, the softmax in fp32. Shapes: mla_prefill_mma_supported (dn, dr, dv multiples of 8, dn + dr <= 192,
// dv <= 128); cudaErrorInvalidValue otherwise.
bool mla_prefill_mma_supported(const mla_shape & d);
cudaError_t launch_mla_prefill_attn_mma(const float * q, const uint16_t * kvh, const uint16_t * kvl, const uint16_t * krh,
                                        const uint16_t * krl, const mla_shape & d, float scale, const dbatch & b, float * o,
                                        cudaStream_t st);

// ---- conv-prefill.cu ----
// SHORT_CONV with one thread per (token, channel) (cuda_options::conv_prefill_tokens): y [T, C] as conv.cu computes it
// (same window, same summation order), then the state write-back per (sequence, channel). W <= 16.
cudaError_t launch_short_conv_tokens(const float * x, int64_t T, int64_t C, dweight w, int64_t W, float * state,
                                     const dbatch & b, float * y, cudaStream_t st);

// ---- attn-res-prefill.cu ----
// ATTN_RES_MIX with a warp per (row, candidate) for the scores and float4 mixing (cuda_options::attn_res_prefill_tokens):
// y [R, D] as attn-res.cu computes it (the scores' sums in another order). D % 4 == 0, candidates and y 16-byte aligned.
// scratch: D + R * n floats.
cudaError_t launch_attn_res_mix_prefill(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, float * scratch, float * y, cudaStream_t st);

} // namespace perigee::cuda
