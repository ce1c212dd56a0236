// The CUDA backend (H200, sm_90a): the same op enum and graph as the CPU reference, run on one device.
//
// Device residency: WEIGHT leaves are uploaded once and cached by host data pointer (the checkpoint's dtype
// is kept: BF16/F16/F32, MXFP4/NVFP4 experts as packed bytes + scales). STATE leaves (KDA state, conv windows,
// MLA latent pages, indexer keys) are uploaded on first use and then stay on the device: the host tensors are
// NOT updated by run(); call sync_state_to_host() to copy them back (parity comparisons, checkpointing), and
// state_reload() after the host changed a pool (e.g. state_slot_zero) so the next run re-uploads it. The runtime
// does neither: it zeroes, saves and restores KDA slots on the device through backend::slot_zero/slot_snapshots_new
// (state-ops.h; snapshots live in device memory).
// Activations are F32. An op or shape this backend cannot run is an error naming the node and the op
// (check_supported), never a CPU fallback (STYLE §3.6).
#pragma once
#include "backend/backend.h"

#include <memory>
#include <vector>

namespace perigee {

struct cuda_options {
    // Debug: every output is poisoned with NaN before its node runs and surrounded by sentinel words that
    // are checked after the node (an error names the node). For the parity runner; slows every node.
    bool guard = false;
    // LINEAR with more than this many tokens goes to cuBLASLt (BF16/F32 weights); at most, the GEMV path.
    int gemv_max_tokens = 8;
    // ... and so does one of 3 or more tokens whose input holds more than this many elements (T x K; 0 = no bound).
    // F16 weights keep the GEMV path at any T. Why: at 3-8 tokens the GEMV kernels are bound by FMAs and L1 traffic,
    // not by the weights, on wide rows; the split-bf16 cuBLASLt LINEAR (stacked, weights read once) then wins even
    // though it gives up the GEMV fusions. Measured (session 17 calls A/B, same binary, ms/step; "all" = every 3-8-token
    // LINEAR on cuBLASLt): k3-layers-4 (K 7168) B=3 3.57-3.61 GEMV vs 3.36-3.40 all, B=4 4.41-4.94 vs 3.64-3.68, B=8
    // 7.23-7.26 vs 4.85-4.89; Kimi-Linear-48B (K 2304) B=3 4.73-4.75 vs 5.76-5.81, B=4 6.19-6.21 vs 6.30-6.32, B=6
    // 8.21-8.24 vs 7.77-7.82, B=8 10.75-10.79 vs 9.34-9.38. Session 17's 16384 sent K3's 7168-wide rows there from 3
    // tokens and the 48B's 2304-wide ones from 8 (T x K = 18432). Session 18 call C (same binary, two rounds): 13824
    // against 16384, 48B B=7 9.340 / 9.339 -> 8.468 / 8.465 ms (its 2304-wide rows to cuBLASLt at 7 tokens), k3 B=4
    // 3.721 -> 3.688 (4096-wide rows at 4 tokens), 48B B=6 unchanged (8.18: 6 x 2304 = 13824 stays). 12288 (this
    // default) also moves the 48B's 6-token 2304-wide rows (B=6 all-cuBLASLt 7.77-7.82 above) and keeps 3 x 4096 and
    // 5 x 2304 (B=5: 7.02 GEMV vs 7.09-7.12) on the GEMV path; predicted 48B B=6 8.18 -> ~7.8 ms. Measured (call D,
    // same binary, two rounds, 16384 / 13824 / 12288): 48B B=4 6.14 / 5.89 / 5.89 (its 4096-wide o_proj to cuBLASLt),
    // B=6 8.14 / 8.14 / 7.63, B=7 9.28 / 8.40 / 8.40 ms; B=3, 5, 8 and k3 B=3, 5-8 unchanged within 0.01 ms; k3 B=4
    // 3.67 / 3.64 / 3.64.
    int64_t gemv_max_elems = 12288;
    // GEMV kernels of the LINEARs on that path (plain, grouped, fused epilogues, staged norm; linear.cu): 0 = the first
    // kernels (one 16-byte weight load in flight per lane, one warp per row); 1, 2, 4 or 8 = the v2 kernels with that
    // many 16-byte weight loads in flight per lane, 1-4 rows per warp by token count and the row split over the warps of
    // a block when the grid would not fill the SMs (cuda::gemv_cfg). The in-warp folded norm (fuse_norm_staged off, or a
    // stage too big) keeps the first kernel. Default 4: the predicted best before its H200 run (bench-cuda-kernels gemv).
    int gemv_unroll = 4;
    // ... for rows of at least this many columns; narrower rows keep the first kernels. Measured on the H200 (session 3,
    // bench-cuda-kernels / bench-cuda-decode): v2 wins on every K3 row of >= 3584 columns (dense LINEARs 2.19 -> 1.98 ms
    // per k3-layers-4 step) but loses on K=128 (KDA f_b: 3.2 -> 5.7 us) and the Kimi-Linear-48B geometry's step was
    // 0.14 ms slower with v2 everywhere (rows of 2304 and less). 3072 by that evidence; the final run checks 2048.
    int gemv_v2_min_in = 3072;
    // GEMV v3 (linear.cu k_linear_gemv_v3, cuda::gemv_cfg::v3) for the one-token chunks of 16-bit weights with in % 8 ==
    // 0 and gemv_v3_min_in <= in <= gemv_v3_max_in (other chunks keep the kernels above): U loads in flight per lane
    // chosen to cover a row slice in whole rounds (9 for 2304-wide rows), each register refilled with the next row's load
    // as soon as it is summed, the first loads issued before the staged-norm prologue. 0 = off, 1 = on, 2 = on with the
    // first loads issued before the PDL wait (weights are never written by a kernel of the step). Predicted 48B step 3.26
    // -> ~2.9 ms. Measured (session 4 call F, bench-cuda-kernels gemv48, H200): faster on every 2304-wide row (the KDA
    // q/k/v group 22.0 -> 19.5 us, the MLA group 17.6 -> 14.6, dense gate/up 28.7 -> 26.5, lm_head 182 -> 181) but slower
    // on 4096 (o_proj 7.6 -> 9.6), 9216 (dense down 14.0 -> 16.2), 1024 (shared down 3.5 -> 4.3) and 128 (f_b 1.9 -> 2.7),
    // and v3 everywhere made the k3-layers-4 step slower (2.712 -> 2.871 ms: 7168-wide rows). Hence 2 on [2048, 2304].
    int gemv_v3 = 2;
    int gemv_v3_min_in = 2048;
    int gemv_v3_max_in = 2304;
    // The tensor-core GEMV (linear.cu "GEMV on the tensor cores", cuda::gemv_cfg::mma) for the chunks of at least this many
    // tokens with BF16 weights and in % 8 == 0, in every GEMV launch form (plain, grouped, fused epilogues, staged norm,
    // the decode router's logits); fp32 parity (x in three bf16 parts; NMSE <= 1e-9 vs fp64 in test-ops-cuda). 0 = off.
    // OFF: measured slower than what it was to replace (session 17 calls A/B, ms/step, mma from 3 tokens vs the FP32
    // GEMV kernels vs cuBLASLt): k3-layers-4 B=3 3.96-4.10 vs 3.57-3.61 vs 3.36-3.40, B=8 5.74-5.81 vs 7.23-7.26 vs
    // 4.85-4.89; 48B B=3 5.60-6.09 vs 4.73-4.75 vs 5.76-5.81, B=8 8.99-9.85 vs 10.75-10.79 vs 9.34-9.38. Predicted
    // before call A: k3 B=4 ~3.3 ms (measured 4.25-4.48), B=8 ~4.5 (5.74-5.81). Kept as a tested switch for the next
    // attempt (a per-shape profile first: where its time goes is not yet measured).
    int gemv_mma_min_tokens = 0;
    // cuBLASLt path with BF16 weights: activations split into bf16 hi + lo and two GEMMs accumulated (x to ~16
    // mantissa bits; NMSE vs the fp32 CPU reference ~1e-10, twice the tensor-core work). false: one GEMM on
    // bf16-rounded activations (NMSE ~3e-6 per LINEAR; enough to flip near-tie routing/greedy picks in tiny
    // random models, measured on k3-tiny 2026-11-29).
    bool linear_split_bf16 = true;
    // ... with the split, up to this many tokens the hi and lo rows run as ONE GEMM of 2T columns (they sit back to
    // back in the scratch: a [2T, K] matrix), then an ADD of the two halves (hi part + lo part, the sum the second
    // GEMM's beta = 1 epilogue forms), so the weights are read once instead of twice. Why: a decode batch past
    // gemv_max_tokens is weight-bound, and the second pass re-read every weight (k3-layers-4 B=16: 9.38 ms with the
    // split, 7.25 with one bf16 pass; session 16 call B). Above it (prefill chunks, compute-bound) the two GEMMs stay:
    // there the ADD's extra 2T x O fp32 traffic would cost more than the weights. 0: two GEMMs everywhere.
    // Measured (session 16 call C, same binary, 256 vs 0, two rounds): k3-layers-4 B=16 9.38 -> 7.34 ms, B=64 23.2 ->
    // 21.3 ms; 48B B=16 16.44 -> 15.15 ms, B=64 37.04 -> 35.77 ms; B=1 unchanged (GEMV path). The output is bit for bit
    // the two GEMMs' in every case of test-ops-cuda linear_split_stacked (T 9 / 64 / 256, two shapes).
    int linear_split_stacked = 256;
    // op_params::bf16_inputs (ARCHITECTURE 3.0): a flagged BF16 LINEAR on cuBLASLt converts x to bf16 first; the LINEARs
    // that read the same node output one after another (a KDA layer's q / k / v / g / beta projections of one normed x,
    // MLA's q_a / kv_a) take the copy the first one made, so x is converted once, not once per LINEAR. The copy is the
    // same bytes: y bit for bit (test-ops-cuda linear_bf16_inputs). One copy is kept at a time (the last input
    // converted); a step's other nodes never write a node output after it is made, so the copy cannot go stale.
    // Why: k3-layers-4 T=2048 under the policy converted ~48 inputs of 2048 x 7168 (~30 us each) where ~12 are distinct.
    // Prediction (session 21, before its first run): LINEAR x48 at T=2048 24.6 -> 24.0-24.3 ms.
    bool linear_bf16_share_x = true;
    // MOE_EXPERTS: the grouped kernels (slots grouped by expert on the device, each selected expert's rows read once
    // with 16-byte loads, FP4 dequantized in registers). false: the first per-slot kernels (compare mode).
    bool moe_grouped = true;
    // MOE_ROUTE: logits by the GEMV over all SMs and a parallel per-token selection. false: the first kernel (one
    // block per token computes the logits and one thread selects; compare mode).
    bool moe_route_fast = true;
    // MOE_ROUTE with one token (decode, with moe_route_fast): logits and selection in one launch (every block computes a
    // slice of the logits, the last block to finish selects). false: the GEMV + select launches.
    // Off: its H200 run (bench/RESULTS.md 2026-11-29, round 1) measured no gain (48B B=1 graph 4.715 ms fused vs 4.656
    // ms two launches; k3-layers-4 equal). Parity passes (test-moe-cuda), so it stays as a switch.
    bool moe_route_fused = false;
    // MOE_ROUTE's selection after the logits (decode GEMV path with moe_route_fast, and the prefill GEMM router): one warp
    // per token, the picks by warp reductions with no block barrier (route-select.cu), instead of the block-wide
    // selection. Same ids and weights bit for bit (test-route-cuda, H200). OFF: measured slower on the H200 (session 3,
    // bench-cuda-decode B=1: k3-layers-4 step 2.850 ms with it vs 2.748 ms without; 48B 3.519 vs 3.503): one warp walks
    // K3's 896 experts 16 times (28 per lane per pick) where the block selection spreads each pick over 8 warps; the
    // prediction (~28 us per token saved) assumed the barriers, not the scan, dominated. Kept for comparison.
    bool moe_select_warp = false;
    // ... by a bitonic sort of (score, id) keys per token in one block (route-select.cu sort form; a token with a NaN score
    // takes the serial scan): the picks are the first k keys, with no per-pick barrier or merge. Takes precedence over
    // moe_select_warp. Bit for bit the block selection (test-route-cuda, H200: 234 cases). Predicted k3 MOE_ROUTE ~38 ->
    // ~13 us per layer; measured (session 3, same run) k3 step 2.772 -> 2.752 ms (~7 us per layer), 48B 3.278 -> 3.261 ms:
    // on (never slower), the selection was a smaller part of MOE_ROUTE than predicted.
    bool moe_select_sort = true;
    // ... by a threshold search (route-select.cu threshold form): one thread per expert, the k-th largest (score, id) key
    // built bit by bit with one __syncthreads_count per bit, then the k picks ranked among themselves (33 counting
    // barriers instead of the sort's 55 / 36 stages over all keys; the bias loaded before the PDL wait; a token with a NaN
    // score takes the serial scan). Takes precedence over moe_select_sort / moe_select_warp. Bit for bit the block
    // selection (test-route-cuda). On by prediction pending its H200 run (session 4: ncu k_moe_select_sort 19.8 us K3,
    // 8.9 us 48B; predicted ~4 us both, isolated).
    bool moe_select_radix = true;
    // ... by the small form (route-select.cu k_moe_select_small) where the route is in its domain (one token's row at a
    // time; sigmoid, no group pruning, E <= 256, top-k <= 8: the 48B router), a block of this many warps (4: two experts
    // per lane, or 8) per token: k rounds of two warp reductions per warp, then one ranking pass over the W k candidates;
    // a token with a NaN score takes the serial scan. Takes precedence over the forms above inside its domain. Bit for
    // bit the threshold form (test-route-cuda small_equals_radix). 0 = off. Predicted (session 18, before its run): the
    // 48B selection launch ~4.5 -> ~3 us exposed per MoE layer, step -0.03..-0.04 ms. Measured (call B, same binary, two
    // rounds): 48B B=1 2.290 / 2.288 (off) -> 2.278 / 2.275 (4 warps), 2.287 / 2.282 (8 warps); the selection 118 -> 101
    // us of exposed time per step (timelines); test-route-cuda [timing] radix 3.46 -> small4 2.46 / small8 2.98 us per
    // launch. 4. (Session 18 call A first ran this selection inside the BF16 decode pair's own blocks instead of a launch:
    // correct, 48B 2.29 -> 2.59 ms, removed; route-select.cu says why.)
    int moe_select_small = 4;
    // (Tried and removed, session 11 call A: a one-warp form with each lane's 8 experts' keys in registers, each pick a
    // lane max and two warp reductions, for E <= 256 sigmoid ungrouped routes, bit for bit the block selection over 118
    // cases. Predicted 48B -0.05..-0.08 ms; measured 48B B=1 2.287 / 2.288 -> 2.318 / 2.316 ms, selection 4.5 -> 5.6 us
    // exposed per layer, router + selection microbenchmark 6.24 -> 7.00 us: 8 dependent picks on one warp cost more than
    // 33 counting barriers of 8 warps.)
    // The decode router's GEMV (MOE_ROUTE, GEMV path with moe_route_fast) on the v2 kernels with the row split whatever
    // gemv_v2_min_in says (gemv_unroll 0 still means the first kernels): the 48B router (256 rows of 2304) ran 32 blocks
    // on the first kernels (ncu session 4: 6.4 us for 1.2 MB). false: gemv_v2_min_in decides, as for any LINEAR. gemv_v3
    // (when on and in range) still applies: it only replaces the v1 choice of gemv_v2_min_in.
    bool moe_route_gemv_v2 = true;
    // MOE_ROUTE with one token (decode, moe_route_fast), BF16 router gate with D % 32 == 0: the GEMV and the threshold
    // selection in ONE launch (route-select.cu: blocks of E threads rounded up to a warp, 4 warps per logit row, the last
    // block to finish selects; a per-backend counter that each launch leaves at 0, no memset). Takes precedence over the
    // two-launch paths (moe_route_fused, the older one-launch kernel, is checked first). Off until its H200 run
    // (bench-cuda-decode --set moe_route_fused_radix=1):
    // predicted ~1-2 us per MoE layer under the GEMV v2 + radix pair (one kernel ramp and one dependent-launch wait less).
    bool moe_route_fused_radix = false;
    // MLA_ATTN decode: several blocks per (token, head) over key ranges, then a combine kernel (flash-decoding).
    // false: one block per (token, head) serial over all keys (the first kernel; compare mode).
    bool mla_split = true;
    // MLA_ATTN absorbed kernels v2 (mla.cu "Decode v2"): heads in groups of 8/16 sharing 32-key latent tiles in shared
    // memory (one online-softmax update per tile), up to 64 key ranges, q_absorb / output projection with the weights
    // read once per 8-token tile. false: the first kernels (compare mode). Predicted (before any run), MLA node per
    // layer at ctx 1024: 48B 0.078 -> ~0.028 ms at batch 1, 1.06 -> ~0.15 ms at batch 64; k3 0.125 -> ~0.035 ms at
    // batch 1, 2.71 -> ~0.42 ms at batch 64.
    bool mla_decode_v2 = true;
    // MLA_ATTN decode v3 (mla.cu "Decode v3"; only with mla_decode_v2): 3 launches instead of 5 (the cache write inside
    // q_absorb's launch, the key-split combine inside the output projection), the attention's key tile / batch arrays /
    // q_rope and the projections' weights loaded before the PDL wait, key ranges of whole 32-key tiles. false: v2.
    // Predicted (before any run), 48B MLA layer B=1 ctx 1024 isolated ~44 -> ~20 us; graph step 48B -0.10 ms, k3 -0.02 ms.
    bool mla_decode_v3 = true;
    // MLA_ATTN decode attention v4 (mla.cu "Decode v4"; only with mla_decode_v3, where v3 uses 8-head groups: T < 8):
    // k_mla_attn_v4, 8 warps per (token, 8 heads) with the 576 score dims and the 512 value columns split over the warps,
    // instead of v3's 4 warps each walking whole rows for 2 heads (ncu: latency-bound, short-scoreboard stalls, 1.5 warps
    // per scheduler). Same grid and partials; k_mla_out_v3 unchanged. Predicted (before any run): attention 48B ~19 ->
    // ~5 us per MLA layer, K3 ~37 -> ~10 us. Measured (session 9 call C, kernel timeline in the graph step, H200):
    // 48B 18.9 -> 11.6 us per MLA layer (7 layers -51 us), step 2.378 -> 2.324 ms; k3 34.8 -> 20.4 us, step 2.417 ->
    // 2.403. Less than predicted (still 11.6 us for 2.5 MB): the next lever is in the kernel, not around it. On.
    bool mla_attn_v4 = true;
    // MLA kv_a split (fuse-plan.h rule 6): COLS -> RMS_NORM (the latent) and COLS (k_rope) of one kv_a output in one
    // launch (mla.cu k_mla_kv_split; the norm bitwise the unfused kernel's): 3 -> 1 launch per MLA layer. Predicted 48B
    // step -0.02 ms (7 layers x 2 launches x ~1.5 us under PDL), k3 ~-0.003 ms.
    bool fuse_mla_kv = true;
    // MOE_EXPERTS grouped MXFP4 (decode, T == 1): raw 16-byte loads of every unit of a lane issued before any
    // dequant/math, several rows per warp for short rows. false: the first grouped kernel (compare mode).
    bool moe_fp4_v2 = true;
    // MOE_EXPERTS grouped MXFP4, T == 1: v3 kernels (no grouping launch: gate/up per slot; the combine folded into the
    // down kernel, which sums the k slots per output row; E2M1 -> fp16 by bit placement, ~2 integer ops per value).
    // false: v2. moe_fp4_v2 = false selects the first grouped kernel whatever this says.
    // Off: slower than v2 on the H200 (round 1: k3-layers-4 B=1 graph 3.749 ms with v3, 3.487 ms with v2; expert node
    // 0.32 vs ~0.27 ms per layer). Parity passes (test-moe-cuda); kept as a switch for the next attempt.
    bool moe_fp4_v3 = false;
    // MOE_EXPERTS grouped, T == 1, BF16 or MXFP4 experts, top-k <= 32: v4 kernels, 2 launches (no grouping launch:
    // gate/up per slot with all units of 2 rows in flight per lane; down with the k slots on the 8 warps of one block and
    // the combine summed in shared memory in slot order), E2M1 -> fp16 bit placement. Takes precedence over moe_fp4_v2/v3.
    // Why v3 was slower (its down + combine ran 224 blocks for K3, each warp 8 dependent rounds over the 16 slots): see
    // moe.cu "Decode v4". On since its H200 run (round 2): test-moe-cuda decode_v4_t1 at the f32 tolerance, compare-backends
    // --moe-v4 1 PASS on all 14; B=1 graph step 48B 4.646 -> 4.453 ms, k3-layers-4 3.475 -> 3.477 ms (no change).
    bool moe_decode_v4 = true;
    // MOE_EXPERTS grouped, T == 1, MXFP4 experts (Din, d_ff <= 12256): v5 kernels (moe.cu "Decode v5"): the expert GEMVs on
    // fp16 tensor cores (mma.sync m16n8k16; E2M1 -> fp16 by bit placement, ~1.75 integer ops per value, no FMA or cvt per
    // value; x as fp16 hi + lo scaled by a power of two), 3 launches (gate/up, down, combine). Takes precedence over
    // moe_decode_v4. On by prediction (issue 7, K3 expert node ~0.23 -> ~0.11 ms per layer); the H200 run decides.
    bool moe_decode_v5 = true;
    // With moe_decode_v5, Din / d_ff / d_out multiples of 128 (K3): the v6 kernels (moe.cu "Decode v6"): v5's arithmetic
    // (y bit for bit v5's) on a loop without per-load bounds or 64-bit address math (~25% fewer SASS instructions per
    // gate/up step), the weight stream loaded L1::no_allocate, and the combine folded into the down kernel (2 launches).
    // Predicted node ~159 -> 100-110 us. Measured (session 4 call F, H200): test-moe-cuda decode_v6_t1 y bit for bit v5's,
    // CPU parity, invalid ids flagged; bench_decode_k3_experts node 159.4 -> 132.3 us (41% -> 50% of copy: gate/up 94.9 ->
    // 83.9, down+combine 65.1 -> 46.2); k3-layers-4 B=1 graph step 2.712 -> 2.653 ms. On.
    bool moe_decode_v6 = true;
    // With moe_decode_v6 and its bounds (also K / 32 a multiple of 4U): the v7 kernels (moe.cu "Decode v7"): v6's
    // arithmetic (y bit for bit v6's) with the weight stream through a per-warp ring in shared memory (cp.async), each
    // issue asking for U consecutive steps of a row (U x 64 contiguous bytes instead of 64), blocks of W warps; gate/up
    // (W 4, U 2, 3 batches, 3 blocks per SM), down + combine (W 8, U 2, 2 batches, 4 per SM).
    // Predicted (session 6, before the first GPU run, for the first ring form: one step per issue, D stages): K3 expert
    // node 132 -> ~90 us, k3-layers-4 B=1 graph step -0.10..-0.13 ms. Measured (H200, K3 node microbenchmark; v6 in the
    // same binary): call A, that first form, SLOWER (135.3 vs 124.2 us) -> batched issue (call B: 116 us best forms);
    // call D, the shipped form (+ unrolled x staging, ld.shared ring reads): node 123.9 -> 113.7 us (gate/up 74.5, down +
    // combine 39.8; 58% of copy), k3-layers-4 B=1 graph step 2.530 -> 2.464-2.469 ms (83.6-83.9% -> 86.0-86.4% of the
    // floor); call E 2.529 -> 2.464; call F's machine 2.491-2.494 ms (84.4-85.0%). Parity: every form bit for bit v5's
    // at D = F = 1024 with invalid ids (decode_v6_invalid_ids), the default form bit for bit v6's eager and over graph
    // replays at the K3 shape and two more (decode_v6_t1), every form bit for bit v6's at the K3 shape eager and replayed
    // (decode_v7_forms_k3); memcheck / racecheck / synccheck 0. On.
    bool moe_decode_v7 = true;
    // Benchmarks: the v7 kernel forms as moe.cu's cfg digits (100 x gate/up form 0-4 + 10 x down form 0-3; 0 = the
    // defaults above; bench-cuda-decode rejects other values).
    int moe_decode_v7_form = 0;
    // (Tried and removed, session 11 call A: the v7 ring's weight copies with the L2 policy evict_first
    // (cp.async...L2::cache_hint), as moe_bf16_evict_first; every form bit for bit v6. Measured k3-layers-4 B=1 2.427 /
    // 2.426 -> 2.434 / 2.433 ms, same binary: the ring's copies are latency bound, not L2-thrash bound.)
    // MOE_EXPERTS grouped, T == 1, BF16 experts (Kimi-Linear-48B) in the shapes of cuda::moe_bf16_decode_supported: the
    // moe-bf16-decode.cu pair (gate/up: one warp per (slot, row), all of the lane's units of both rows in flight in one
    // pass, no bounds, L1::no_allocate; down + combine: v4's slots-on-warps block with 3 rows per block, 2.91 waves
    // instead of 4.36), y bit for bit v4's. Precedes moe_decode_v4. Predicted (48B geometry, isolated): gate/up 24.9 ->
    // ~20 us, down + combine 14.6 -> ~11.5 us; 48B step ~-0.15 ms. Measured (session 4 call H, H200): decode_bf16_t1 /
    // _direct y bitwise v4's, CPU parity, graph replay = eager, memcheck 0 / racecheck 0; node 38.8 -> 31.3 us (68% -> 84%
    // of copy; gate/up alone 19.8 us = 89%, down + combine 11.8 us); 48B B=1 graph step 2.890 -> 2.789 ms. On.
    bool moe_decode_bf16 = true;
    // The BF16 decode pair's loads before the PDL wait (moe-bf16-decode.cu `early`; launch_moe_bf16_decode's cfg 100):
    // the down stage reads ids and issues all its weight loads before its wait (the gate/up launch between it and the
    // route makes ids complete), and the shared slot (moe_shared_slot) moves to blockIdx.y 0, so its blocks are the ones
    // resident while the route runs, and does everything but its writes before the wait. Outputs bit for bit the same.
    // Why: the session-9 kernel timeline (48B graph step) has gate/up 22.4 us exposed (85 MB, floor 20.1) and down 14 us
    // (42.5 MB, floor 10.0), each starting only after its wait. Predicted 48B -2 us (gate/up) and -1.5 us (down) per MoE
    // layer: step -0.08..-0.1 ms. Measured (session 9, H200): call C (kernel timeline) down -2.8 us and gate/up -0.6 us
    // per layer, the selection +1.3 us (the shared slot's 9.4 MB stream now runs beside it), the next GEMV group +0.9;
    // call G, after h / act moved to coherent loads (moe-bf16-decode.cu, a stale read found by the cfg-200 test): 48B
    // step 2.367 -> 2.281 ms (three rounds each); k3 unchanged (MXFP4 experts). 1 (on): both; 2: the down stage's
    // loads only (calls D, E: between 0 and 1; kept for the test that found the stale read); 0: off.
    int moe_bf16_early = 1;
    // MOE_EXPERTS grouped, T > 1, BF16 or MXFP4 experts on the GEMV kernels (fewer than moe_mma_tokens tokens): v4
    // kernels that load each row's units once, dequantize each 8-column chunk once and apply it to up to 8 of the
    // expert's tokens held in registers (the first kernels: 4 tokens per pass, 168 registers for MXFP4 gate/up).
    // Off: mixed in its H200 run (round 2, pass "small-v4"): k3-layers-4 B=8 24.58 -> 21.58 ms, but 48B (BF16) B=8 15.11 ->
    // 15.89 and B=64 52.38 -> 53.62 ms; parity passes (test-moe-cuda small_v4_batch).
    bool moe_small_v4 = false;
    // MOE_EXPERTS, steps of 1 < T <= this many tokens (decode batches; prefill chunks that short too), MXFP4 experts:
    // the T == 1 kernels (v6 / v7, moe_decode_v6 / _v7) with every (token, pick) pair as a slot of its own (moe.cu
    // launch_v6, "pair form"): no grouping or combine launch, each token's y bit for bit what a T == 1 launch gives on that token alone, but an expert picked by
    // n tokens is read n times. 0: off (the grouped GEMV kernels, moe_small_v4, and the tensor-core experts from
    // moe_mma_tokens tokens). Why: at T > 1 every expert pick ran the grouped GEMV kernels, which were never brought to
    // the T == 1 kernels' bandwidth (k3-layers-4 B=8 17.9 ms = 18.5% of its floor, B=1 88%). Predicted (session 15,
    // before the run): k3 B=8 ~17.9 -> ~5.5 ms, B=64 ~83 -> ~27 ms. Measured (session 15 call A, H200, same binary, off ->
    // on): k3-layers-4 B=8 17.86 -> 7.25 ms, B=16 29.43 -> 9.36, B=32 50.88 -> 14.36, B=64 82.19 -> 24.87 ms (MOE_EXPERTS
    // x3 76.2 -> 16.2 ms: 1 024 slots x 17.5 MB per layer at ~3.3 TB/s); B=1 unchanged (2.398 / 2.401). Tests: every
    // token's row bit for bit its T == 1 launch (decode_pairs_direct), CPU parity at the f32 tolerance from a routed
    // graph (decode_pairs_batch, K3's expert shape included), memcheck / racecheck 0. Call B: B=128 91.13 -> 47.42 ms
    // (64: 82.26 -> 25.87). On up to 128, the measured range (the time grows with the slots, T x 16, so somewhere below
    // moe_mma_large_step = 256, where the tensor-core experts take over, the grouped kernels would win again; not measured).
    int moe_decode_pairs_mxfp4 = 128;
    // ... the same for BF16 experts (moe_decode_bf16's pair, moe-bf16-decode.cu: the 48B geometry). Measured (same call,
    // slots unsorted): 48B B=8 11.85 -> 10.88 ms, B=16 17.50 -> 17.60, B=32 28.44 -> 29.06, B=64 37.66 -> 51.86 ms: BF16
    // experts are 4x the bytes of MXFP4 ones per row and the grouped kernels already read them at a good share of the copy
    // rate, so the re-reads of experts shared by tokens cost more than the pair form saves. With the slots sorted
    // (moe_decode_pairs_sorted, call G, same binary, two rounds): B=16 17.07 -> 16.39-16.42, B=32 27.91-27.92 -> 26.24-26.25
    // ms; B=64 still slower (call F: 45.29 vs 37.66). On up to 32.
    int moe_decode_pairs_bf16 = 32;
    // The pair form's slots in expert order (moe.cu k_moe_slot_order, one more launch per MoE layer: a stable sort of the
    // T k slots by expert id), so that the blocks re-reading an expert picked by several tokens run back to back and the
    // later reads can hit L2 (MXFP4: gate/up and down + combine; BF16: gate/up). Outputs bit for bit the unsorted ones.
    // Predicted (session 15, before its run): k3-layers-4 B=64 experts 16.2 -> ~11 ms (~40% of the slots re-read an
    // expert), step ~25 -> ~20 ms; B=8 no change. Measured (call F, same binary, off -> on): k3-layers-4 B=8 7.252 -> 7.223,
    // B=64 25.39 -> 22.96, B=128 46.68 -> 40.52 ms (less than predicted: a part of the re-reads still misses L2); 48B with
    // the BF16 pair form to 64 tokens B=8 10.98 -> 10.78, B=16 17.36 -> 16.41, B=32 28.97 -> 26.28, B=64 52.11 -> 45.29.
    // Tests: the sorted runs bitwise the unsorted ones (decode_pairs_direct, decode_pairs_batch eager and replayed). On.
    bool moe_decode_pairs_sorted = true;
    // MOE_EXPERTS grouped, T > 1: experts routed at least this many tokens run on bf16 tensor cores (moe.cu k_moe_mma:
    // weight tile dequantized to bf16 in shared memory once per 32-token tile, activations rounded to bf16, fp32
    // accumulation); the others keep the grouped GEMV kernels. 0: off (every expert on the GEMV kernels).
    // 8 since its H200 run with the hi + lo split (round 1): compare-backends PASS on all 14 with identical greedy
    // tokens, test-moe-cuda at the f32 tolerance; k3-layers-4 prefill T=512 635 -> 107 ms, T=2048 2550 -> 331 ms.
    int moe_mma_tokens = 8;
    // The tensor-core experts split the activations (x, and h between gate/up and down) into bf16 hi + lo, two mmas into
    // the same fp32 accumulators: NMSE vs the fp32 CPU reference at the f32 level (MXFP4/BF16 weights are exact in
    // bf16; NVFP4 E2M1 x E4M3 is too, its global scale applied in fp32). false: hi only (NMSE ~1e-5; compare mode).
    bool moe_mma_split = true;
    // The tensor-core experts, MXFP4/NVFP4 with Din and d_ff multiples of 128: v2 (moe-mma.cu k_moe_mma2: one block per
    // (expert, 256 weight rows) over all the expert's tokens, raw FP4 + scales + activations through a 3-stage cp.async
    // pipeline, A fragments of mma.sync m16n8k16 dequantized from the raw bytes in registers, tokens 8 per mma).
    // false: v1 (k_moe_mma). On since its H200 run (round 2): test-moe-cuda mma_v2 at the f32 tolerance, compare-backends
    // --moe-mma-v2 1 PASS on all 14; k3-layers-4 prefill (with the prefill kernels) T=512 87.3 -> 81.6 ms, T=2048 202.2 ->
    // 180.9 ms at threshold 8.
    bool moe_mma_v2 = true;
    // The tensor-core experts, MXFP4 with Din and d_ff multiples of 512: v3 (moe-mma.cu k_moe_mma3: v2's inner loop with
    // the activations split into bf16 hi + lo planes once per stage instead of once per (block, K-tile), 64-column
    // K-tiles through a 3-stage pipeline with one barrier per tile, the block's scales copied once, two blocks per SM;
    // y bit for bit v2's). Prediction (before its first H200 run): MOE_EXPERTS at k3-layers-4 prefill T=2048 ~84 ->
    // ~45 ms (2 blocks per SM and no per-tile conversion: ~1.8x), prefill step 164 -> ~125 ms, GEMM share 23% -> ~30%.
    // Measured (session 7 call A, H200, same binary): MOE_EXPERTS 83.2 -> 60.8 ms at T=2048 (34.9 -> 24.6 at T=512),
    // step 160.3 -> 139.0 ms, GEMM share 22.6% -> 27.2%; Nsight: gate/up 12.2 ms per layer, issue slots 53% busy, 1.1
    // eligible warps of 4 per scheduler, ALU the busiest pipe (40%). y bitwise v2 (test-moe-cuda mma_v3_prefill, K3's
    // shape included), memcheck / racecheck 0. On (v4 takes precedence where it is on).
    bool moe_mma_v3 = true;
    // ... v4 (moe-wgmma.cu k_moe_mma4: v3's pipeline and dequant, the products as wgmma m64nNk16 with A from registers
    // and the tokens' planes read from shared memory by descriptor; y at the f32 tolerance of v3, not bitwise).
    // Prediction (before its first H200 run): v3's gate/up issues ~320 instructions per warp and scale block for 40
    // mma.sync; v4 issues 8 wgmma instead, leaving the dequant (~110) as the issue load, so MOE_EXPERTS at T=2048 ~61 ->
    // ~30 ms (tensor-bound at ~35% of the wgmma peak with 5 of 8 token tiles used). Takes precedence over v3.
    // Measured (session 7 call B, H200, same binary as v3): MOE_EXPERTS 60.7 -> 44.8 ms at T=2048 (24.7 -> 21.4 at
    // T=512), step 140.6 -> 125.1 ms, GEMM share 27.2% -> 32.1%; Nsight: gate/up 8.6 ms per layer (v3 12.2), tensor pipe
    // active 37%, ALU 49%, issue slots 56% busy: each warpgroup waits for its wgmmas before dequantizing the next scale
    // block. v4 vs v3 NMSE <= 5.6e-13, vs the CPU <= 3.2e-11, memcheck / racecheck 0. On, for prefill-sized steps only
    // (T >= moe_mma_large_step when that is set; v3 the same): in decode batches v2 stays, since there v4 measured
    // slower (call H, k3-layers-4 B=64 step 83.25 vs 82.39 ms; almost no expert reaches the threshold of 8 tokens, cause
    // of the difference not isolated).
    bool moe_mma_v4 = true;
    // v4 over BF16 experts too (moe-wgmma.cu FMT 1: the A fragments are the rows' bf16 straight from the stage, no
    // dequant; Din and d_ff multiples of 64), in the same prefill-sized steps; false: v1 (moe-mma.cu k_moe_mma, wmma
    // through a bf16 tile in shared memory), which took 55.6 of the 48B's 89.2 ms prefill step at T=512 (session 12
    // call B; 89.3 of 152.6 ms at T=1024). Prediction before its first run: 48B MOE_EXPERTS T=512 55.6 -> 20-30 ms.
    bool moe_mma_v4_bf16 = true;
    // v4 over MXFP4 in the shift form (moe-wgmma.cu FMT 3, fp4.cuh fp4_a_pairs_shift): each nibble's bits shifted into
    // place as a bf16 of value x 2^-126 (e = 0 a subnormal), the pairs of columns 4 apart, the 2^126 folded into the
    // scale's multiply; the activation planes in the matching order (m4s_pos). The products are the same exact values
    // in another k order: y within the f32 tolerance of the table form (fp4x8_pairs2), not bit for bit.
    // Why: the dequant is most of v4's instructions (session 7 SASS: ~190 of ~420 per warp and K-tile) and issue is
    // what bounds it (the deeper pipeline of session 21 call A did not help): ~15 integer ops per 8 nibbles instead of
    // ~19, and the scale's bf16 pair in 2 instead of 3.
    // Prediction (session 21, before its first run): MOE_EXPERTS x3 at T=2048 under the bf16 policy 35.7 -> 34-35 ms.
    // Measured (session 21 call B, H100, same binary, table / shift alternating): under the bf16 policy 35.05, 36.12 ->
    // 34.18, 32.74 ms (-6%), the GEMM share 58.6, 59.8 -> 57.9, 56.4 ms (50.8%, 49.4% -> 51.4%, 52.3% of the GEMM rate);
    // under the split policy 44.6 -> 41.9 ms. Both forms exact against the scalar decode over every 16-bit pattern and
    // scale byte (test-moe-cuda fp4_dequant_forms_exact). On.
    // Session 22: the form's second multiply for scale bytes above 128 (4 predicated HMUL2 per word, issued on every call
    // in session 21's SASS) is gone: the shift form now runs only for expert tables whose scale bytes are all <= 128
    // (cuda::fp4_shift_max_scale; found when the table is built: real checkpoints' bytes are ~118..127), the table form
    // otherwise. Prediction (before its first run): MOE_EXPERTS x3 at T=2048 under the bf16 policy -3..-5%.
    bool moe_mma_v4_shift = true;
    // Measured and removed (session 7 call C): two fragment sets per warp, the second scale block of a K-tile dequantized
    // while the first block's wgmmas run (predicted gate/up 8.6 -> ~6.5 ms per layer): 8.64 ms, no gain.
    // Measured and removed (session 7 call F): blocks of 128 rows (one m64 tile per warpgroup, 79 registers, 3 blocks =
    // 24 warps per SM; predicted gate/up 8.6 -> ~7 ms): 8.47 ms, issue slots 64% busy, tensor pipe still 38%; the step no faster
    // (T=2048 123.8 vs 121.4-122.1 ms). SASS of the 256-row form (call E): ~420 instructions per warp per K-tile for 16
    // HGMMA (the FP4 dequant ~190 of them); a round of one scale block on an SM's four warpgroups takes ~1 700 cycles
    // against ~840 of issue and ~640 of tensor work. Next: warp-specialized producers that dequantize into shared memory
    // for wgmma with both operands there (the consumers issue only wgmma), the X tiles by TMA.
    // Measured and removed (session 21 call A, H100, k3-layers-4 T=2048 under the bf16 policy, same binary): for hi-only
    // activations a stage layout without the lo planes, spending the freed 8 KB per stage on 5 MXFP4 stages instead of
    // 3 (four K-tiles of weights in flight per block instead of two, still two blocks per SM; y bit for bit the 3-stage
    // form's). Predicted MOE_EXPERTS x3 36.1 -> 31-33 ms (the blocks waiting on their weights); measured 35.7 -> 36.8 and
    // 36.9 ms, slower: the wait is not for memory but the dequant / wgmma dependency chain above.
    // Steps of at least moe_mma_large_step tokens (prefill-sized) use moe_mma_large_tokens as the tensor-core threshold:
    // at T=512 ~30% of K3's experts get fewer than 8 tokens and the GEMV kernels are slow on them. Round 2 measured v2 at
    // threshold 1 vs 8: T=512 52.9 vs 81.6 ms, T=2048 162.0 vs 180.9 ms. Decode batches (T < 256) keep moe_mma_tokens
    // (threshold 1 there was not measured). 0: off.
    int moe_mma_large_step = 256;
    int moe_mma_large_tokens = 1;
    // LINEARs on the GEMV path that read the same input (e.g. a KDA layer's q/k/v/f_a/b/g_a projections) run as one
    // launch over several weight pointers, at the first of them. On since its H200 run (bench/RESULTS.md 2026-11-29,
    // late): compare-backends PASS on all 14 both ways; 48B decode 5.21 -> 4.65 ms. false: one launch per LINEAR.
    bool linear_group = true;
    // ATTN_RES_MIX: candidate scores by one block per (row, candidate), then the mix by many blocks over the row.
    // false: the first kernel (one block per row, candidates serial; compare mode).
    bool attn_res_split = true;
    // KDA_SCAN nodes with chunk_size 64 (prefill graphs) run the chunked WY kernels (kda-chunked.cu: chunk-parallel
    // intra-chunk work, then one state pass per (sequence, head, 32 columns)) when the step has at least this many
    // tokens and K <= 128, K % 4 == 0, V <= 128. 0: off (the token recurrence, also the decode path and compare mode).
    // 64 since its H200 run (round 1): test-kda-cuda 5/5 (RMS error ratio <= 2e-5 vs the CPU, controls fail), compare-backends
    // PASS on all 14 with --kda-chunk 16; k3-layers-4 prefill KDA_SCAN x3 5.2 -> 3.2 ms (T=512), 20.9 -> 13.1 ms (T=2048).
    int kda_chunk_min_tokens = 64;
    // KDA_SCAN on the token recurrence (decode, and steps below kda_chunk_min_tokens): v2 kernel (kda.cu k_kda_scan_v2,
    // kda-decode.h): lanes along the value columns with 16-byte state loads (a warp's load = 4 full lines; v1's scalar
    // loads touched 32 lines each), per-thread row sums, 2 shuffles + one shared-memory step per column, 128 blocks per
    // sequence at the 48B (32 heads), 384 at K3. Needs V % 4 == 0 and 16-byte aligned state/v/o, else v1 runs.
    // false: v1 (compare mode). On by prediction (issue 7): KDA_SCAN per node 48B B=1 21 -> ~5 us, B=64 540 -> ~90 us;
    // K3 B=1 42 -> ~7 us, B=64 1570 -> ~240 us; the H200 run (test-kda-decode-cuda [timing]) decides.
    bool kda_decode_v2 = true;
    // RMS_NORM over whole rows whose output feeds LINEAR(s) on the GEMV path: the norm node launches those GEMVs with
    // the inverse RMS computed in the GEMV (from the x row each warp reads anyway) and writes the norm's output from
    // the same launch; the norm kernel launch is removed (fuse-plan.h). On since the H200 round 2 (bench/RESULTS.md): all four decode fusions
    // together ("+fall") k3-layers-4 B=1 3.475 -> 3.445 ms, 48B 4.646 -> 4.252 ms; compare-backends --fuse 1 PASS on all 14.
    bool fuse_norm_linear = true;
    // The folded norm's prologue staged once per block in shared memory (x' = x * inv_rms * w), the GEMV inner loop
    // unchanged (linear.cu k_linear_gemv_norm_staged); the planner folds only when min(T, 8) * K * 4 bytes fit the
    // 47 KiB stage (decode B=1: K <= 12032). false: the round-1 in-warp prologue at any T (compare mode; it lost
    // 0.27 ms on k3-layers-4, its 7168-wide GEMVs turned compute-bound).
    bool fuse_norm_staged = true;
    // The planner keeps the norm launch when the LINEARs it would fold into read more weight bytes than this. A folded
    // norm saves one launch, ~5 us (RMS_NORM x62 0.555 ms eager on the 48B); a launch streaming W bytes at ~4.3 TB/s
    // takes W / 4.3 TB/s, so the fused GEMV may be at most 5 us / that slower before the fusion loses: 8% at 256 MiB,
    // 2% at 1 GiB. 256 MiB keeps the norm before k3's KDA projections (~0.5 GB per launch), its dense MLP (0.97 GB)
    // and lm_head (2.35 GB) and the 48B's lm_head (0.75 GB): those gain < 2% and carried round 1's loss; every other
    // launch folds. bench-cuda-decode pass "+fnorm-nolim" measures the staged kernel without the limit.
    int64_t fuse_norm_max_weight_bytes = int64_t(256) << 20;
    // SHORT_CONV whose output feeds an L2_NORM per head (the KDA q/k path) with at most 8 tokens: one launch computes
    // the conv and the head norms (fuse-conv.cu); the L2_NORM launch is removed (fuse-plan.h). On (round 2: +fconv 48B
    // 4.646 -> 4.605 ms, k3 3.475 -> 3.469).
    bool fuse_conv_l2 = true;
    // The KDA block's decode tail (at most 8 tokens, K = V in {32, 64, 128}, conv width 4): the 3 short convs, q/k L2
    // norms, the f_b and g_b low-rank projections (BF16, rank <= 128), the gate, the delta-rule step and the gated norm as
    // one launch per (head, sequence) at the gated norm's position (kda-fused-decode.cu, fuse-plan.h rule 7); 7-9
    // launches removed per KDA layer. Predicted (session 5, before the first GPU run): 48B step 2.79 -> ~2.50 ms (20 KDA
    // layers at ~18-22 -> ~5 us), k3-layers-4 -0.03 ms. Measured (session 5 call J, H200, same binary): 48B B=1 graph step
    // 2.790 -> 2.593 ms (358.5 -> 385.7 tok/s; ~10 us per layer saved, half the prediction), k3 2.602 -> 2.576 ms (81.5% ->
    // 82.4% of the floor); test-fuse-cuda kda_decode_tail: CPU NMSE <= 2.1e-11 over two steps, bitwise the unfused
    // kernels when f and z are inputs; memcheck 0, racecheck 0. On.
    // Measured and reverted (session 6 call G): the launch as a thread-block cluster of K / 32 blocks per (head,
    // sequence), each owning 32 value columns of the state, the g rows and the norm partials exchanged through
    // distributed shared memory (two cluster barriers per token). Predicted: the fused node 48B ~12 -> ~5-6 us, k3 ~13 ->
    // ~5 us. Measured: outputs bit for bit the single-block form's (test-fuse-cuda kda_decode_tail 784/0, compare-backends
    // PASS, memcheck / racecheck / synccheck 0) but the node SLOWER: 48B 12.9 us (eager, per layer), k3 22 us; 48B B=1
    // step 2.593 ms (2.574 with the single block in call F). The tail is latency-bound on its serial phases (conv -> norms
    // -> low-rank GEMVs -> gate -> step -> norm), which the cluster's barriers lengthen; the state bytes were not the limit.
    bool fuse_kda_decode = true;
    // SIGMOID over the output of a LINEAR on the GEMV path (the KDA beta): the GEMV epilogue writes sigmoid(y) too; the
    // SIGMOID launch is removed (fuse-plan.h). On (round 2: +fsig 48B 4.646 -> 4.599 ms, k3 3.475 -> 3.462).
    bool fuse_sigmoid = true;
    // ADD(y, r) after a LINEAR y on the GEMV path (and a second ADD of that sum): the GEMV epilogue writes y, y + r
    // (and y + r + r2); the ADD launches are removed (fuse-plan.h). On (round 1 and 2: never slower; 48B -0.09 to -0.10
    // ms, k3 -0.01 ms).
    bool fuse_add = true;
    // MOE_EXPERTS at T == 1 on the BF16 decode pair (moe_grouped + moe_decode_bf16, shapes of
    // cuda::moe_bf16_shared_supported) whose input also feeds a shared expert of the same widths (forward.cpp moe_block,
    // non-latent: Kimi-Linear-48B): the shared expert runs as a ninth slot of the routed kernels (weight 1.0, added after
    // the routed sum in slot order), and the one launch pair writes the shared gate/up/GLU/down outputs, the routed sum,
    // the ADD (routed + shared) and a chained residual ADD (l_out); the shared gate/up leave the post-attention norm's
    // GEMV group (the norm then launches alone), the GLU and down launches go (fuse-plan.h, planned before the other
    // rules). Prediction (session 6, written before any GPU run): per 48B MoE layer the shared expert's ~21 us (norm +
    // gate/up 10, SILU_MUL 4, down + ADDs 7) becomes a plain RMS_NORM (~3 us) plus ~5 us more in MOE_EXPERTS (9 slots:
    // 2304 gate/up blocks = 4.36 waves of 528 instead of 3.88; a ninth warp in the down blocks), ~13 us saved per layer:
    // 48B B=1 graph step 2.61 -> ~2.30 ms (-0.2 to -0.35 ms); k3 unchanged (latent MXFP4 experts: the rule does not fire).
    // Measured (session 6 call B, H200, 48B B=1): bench graph off 2.620 / 2.621 ms, on 2.575 / 2.581 ms; engine path
    // (graph_decode=1) off 2.619, on 2.576 ms: -0.04 ms, ~1/5 of the prediction's low end (~1.7 us per MoE layer, not
    // ~13). Why: bench-cuda-decode --dry shows 224 -> 172 node launches, 52 = 2 per MoE layer (26): the shared expert's
    // 3 launches (norm + gate/up GEMV, SILU_MUL, down + ADDs GEMV) become a standalone RMS_NORM (before, it rode in the
    // gate/up GEMV's staged prologue) while its 14.2 MB of BF16 weights per layer still stream, now inside MOE_EXPERTS
    // (gate/up 2048 -> 2304 blocks: 3.88 -> 4.36 waves of 528, a fifth partial wave); so the saving is about two launch
    // gaps per layer, not the shared expert's time (per-kernel split not profiled). The call's test-fuse-cuda
    // moe_shared_slot failure at D 2304 (routed sum not bitwise the unfused one) was the test's: the default unfused plan
    // computes h in the GEMV's norm prologue (another sum(x^2) order: an ulp off at that seed), the fused plan in k_norm;
    // the test now compares against an unfused run with the norm alone (bitwise). Call E (H200, the fixed test): h and the
    // routed sum bitwise the norm-alone unfused run on every shape, CPU parity, controls fail as required (test-fuse-cuda
    // 3 062/0), memcheck 0; 48B B=1 bench graph 2.607 -> 2.568 ms (383.6 -> 389.4 tok/s), engine path 2.606 -> 2.569 ms;
    // k3 unchanged (2.464 / 2.463). On.
    bool moe_shared_slot = true;
    // ... with the shared expert's weights asked into L2 by the gate/up launch before its PDL wait (dmoe_shared::prefetch),
    // while the route's selection still runs and the HBM is idle. Results unchanged (a prefetch returns no data).
    // Predicted (session 8, before any run): ~2 us per 48B MoE layer (14 MB of the shared expert read from L2). Measured
    // (session 8 calls A and B, same binary, two rounds each): 48B B=1 graph step 2.571 -> 2.540 ms (norm_reg off), 2.464
    // -> 2.432 ms (norm_reg on): ~1.2 us per layer; k3 unchanged (no shared slot). test-moe-cuda decode_bf16_shared_direct:
    // every output bit for bit the run without it. Off since session 9: with moe_bf16_early 1 the blocks that issue the
    // prefetch are the shared slot's own, which load the same gate / up rows right after it (the request made twice), and
    // call E measured it neutral (48B 2.320 / 2.324 ms with it, 2.319 / 2.320 without, same binary).
    bool moe_shared_prefetch = false;
    // The MoE block of one token as ONE persistent launch (fuse-plan.h rule moe_layer_fused, moe-layer-decode.cu): the
    // post-attention RMS_NORM and the MOE_ROUTE join the MOE_EXPERTS launch with its shared slot; device-wide counters
    // replace the four kernel boundaries, and the weights each phase can know early (router rows and the shared expert
    // before the PDL wait, the first down slots before the last barrier) are in flight early. Every output but the router
    // logits (a scratch, not a node output) bit for bit the unfused launches' given the same logits (test-moe-layer-cuda).
    // Only the 48B block's widths (D 2304, d_ff 1024, top-8 sigmoid of <= 256, BF16 router and experts).
    // Predicted (session 24, before any GPU run): per MoE layer on the H200 ~43 -> ~33 us (norm 2.0 + router 2.5 +
    // selection 4.0 us exposed mostly hidden, gate/up and down ramps shared), 48B B=1 2.27 -> ~2.0 ms.
    bool moe_layer_fused = false;
    // The KDA layer's decode tail and its o_proj (with the residual ADDs of its GEMV epilogue) as ONE persistent launch
    // (fuse-plan.h rule kda_oproj_fused, kda-fused-decode.cu k_kda_oproj_d1; needs fuse_kda_decode): the o_proj rows are
    // loaded into registers (and L2) by the blocks without a head while the heads' tails run, instead of after the tail
    // kernel ends. One token, the 48B's widths (32 heads of 128). The tail's outputs bit for bit the plain launch's; the
    // o_proj rows one warp's sum each (not the GEMV's order). Predicted (session 25, before any GPU run): per KDA layer
    // tail + o_proj ~14 -> ~9 us (H100, the session 23 timeline: 6.5 + 7.8 exposed), 48B B=1 -3..-4%.
    bool kda_oproj_fused = false;
    // Tests only: the persistent kernels (moe_layer_fused, kda_oproj_fused) are launched with a first barrier that waits
    // for one more arrival than exists, so each must end with ERR_SYNC_TIMEOUT flagged after k_grid_wait_ns (4 s) and the
    // run must fail naming the node (the control that a barrier which never completes is reported, not hung or silent).
    bool persistent_test_timeout = false;
    // The BF16 decode expert pair (moe-bf16-decode.cu) loads its weights with the L2 policy evict_first (cfg thousands
    // digit 1, common.cuh l2_stream_policy): read once per step, they go first, so their ~130 MB per 48B MoE layer does
    // not evict the step's other lines. Results unchanged (a cache policy; test-moe-cuda cfg 1000 / 1100 bit for bit).
    // Measured (session 10 call C, same binary, two rounds): 48B B=1 2.309 / 2.307 -> 2.287 / 2.286 ms. On.
    // (Tried with it in session 10 and removed, calls B and C: L2 prefetches of the next kernel's weights issued by a
    // latency-bound kernel after its wait (the KDA tail for o_proj: tail +2-3 us, o_proj no faster; one SM drains bulk
    // prefetches at ~250 GB/s), by the route's one-block selection (48B 2.31 -> 3.5-5.9 ms), and by the streaming
    // GEMVs' own blocks before their PDL wait (v2 first tile: 48B +0.016 ms, k3 +0.26 ms; v3 next 1 / 2 / 4 tiles: 48B
    // +0.015 / +0.048 / +0.07 ms).)
    bool moe_bf16_evict_first = true;
    // GEMV v2 / v3 launches load their weights with the L2 policy evict_first (gemv_cfg::evict_first), as
    // moe_bf16_evict_first does for the experts. Results unchanged (test-ops-cuda: every v2 / v3 form bit for bit the
    // run without). Predicted (session 10, before any run): if the experts' gain came from the step's activations and
    // states surviving in L2, another -0.01..-0.03 ms on the 48B. Measured (call D, same binary, two rounds): 48B B=1
    // 2.300 / 2.297 -> 2.282 / 2.281 ms; k3-layers-4 2.540 / 2.541 -> 2.395 / 2.396 ms (83.3% -> 88.4% of that machine's
    // floor; its k3 base was the slowest of the session's machines, 2.398-2.426 elsewhere). On.
    // (Tried with it and removed, call D: the route selection's PDL trigger before its wait, so that the experts' launch
    // is resident while the router runs: 48B 2.300 -> 2.380 ms.)
    bool gemv_evict_first = true;
    // The captured decode graph gets side-branch L2 prefetches (l2-side-prefetch.cu): after each weight-streaming launch p
    // (a node whose launch reads >= 4 MiB of weights) that is followed by latency-bound launches before the next
    // streaming launch s, a kernel node depending on p alone asks up to this many MiB of s's weights into L2 while the
    // latency-bound launches run (the HBM idle). Nothing waits for it; results unchanged (test-fuse-cuda
    // side_prefetch_replay_bitwise). 0 = off. Predicted (session 23, before any run): the 48B's o_proj behind the KDA
    // tail and the shared expert behind norm / router / selection from L2, -5..6 us per layer (~-6%). Measured (H100,
    // 48B cut to 16 layers, two calls, same binary): 1.787 -> 1.767 ms (8 MiB), 1.775 (16), 1.777 (32), 1.783 (64);
    // 1.771 -> 1.749 (8); k3-layers-4 3.281 -> 3.269 (16), 3.262 (32). The timeline: o_proj 11.4 -> 7.7 us per KDA layer
    // (its weights do come from L2), but the MoE gap's prefetch slows the router GEMV beside it (2.5 -> 3.2 us) about as
    // much as gate/up gains. Call C (every CUDA test, compare-backends 9/9 and the serve smoke with it on): 48B-16
    // 1.768 -> 1.751 ms, k3 3.208 -> 3.187 ms. (Tried and removed: the next streaming launch's weights too, within 24
    // MiB: 1.761 / 1.747 vs 8 MiB's 1.767 / 1.749, not separable from noise; the fork moved to any launch reading >= 512
    // KiB, meant for the 48B router: it also made the KDA tail a fork, so o_proj lost its prefetch, 1.768.) On at 8
    // MiB; not yet measured on an H200. See bench/RESULTS.md session 23.
    int l2_side_prefetch_mib = 8;
    // Blocks (one warp each) of each side prefetch node: the issue rate (~250 GB/s per SM, session 10).
    int l2_side_prefetch_blocks = 32;
    // RMS_NORM / LAYER_NORM / L2_NORM / GATED_RMS_NORM launches of rows of up to 16 elements per thread: the row held in
    // registers, every load issued at once, the weights before the PDL wait (norm.cu k_norm_reg); bit for bit the loop
    // kernel. false: the loop kernel. Why: ncu (session 8 call A, 48B decode step) timed the post-attention norm of one
    // 2304-wide row at 8.5-10.2 us (each thread's 9 loads of x, then of w, one after another). Predicted: ~3 us, 48B
    // step -0.1..-0.15 ms (28 such norms), k3 -0.02 ms. Measured (call B, same binary, two rounds): 48B B=1 graph step
    // 2.580 -> 2.464 ms, k3 2.512 -> 2.496 ms. On.
    bool norm_reg = true;
    // Rule fuse_norm_route (fuse-plan.h, with fuse_norm_linear): a MOE_ROUTE on the GEMV-then-selection path whose input
    // is the output of an RMS_NORM folded into a launch of LINEARs gets its router logits computed as one more segment
    // of that launch; the MOE_ROUTE node then only selects. K3: the router joins the post-attention norm's shared
    // gate/up launch. Logits from the staged x' (the folded LINEARs' input), not from the norm kernel's output: the two
    // differ in the last bit of inv (another summation order), as for every folded LINEAR. Predicted (session 8, before
    // any run): k3 -0.01 ms, 48B -0.05..-0.08 ms (norm + router as one launch). Measured (call D, same binary, two
    // rounds): k3-layers-4 B=1 2.466 -> 2.421 ms (84.8% -> 87.3% on that machine); the 48B form (the norm's only
    // consumer on the GEMV path is the router: a launch of the router alone) 2.385 -> 2.389 ms, so the rule now takes
    // a router only into a launch that has LINEARs (the 48B keeps the norm kernel and the router GEMV). On.
    bool fuse_norm_route = true;
    // MOE_ROUTE with at least this many tokens (prefill): the router logits [T, E] as one cuBLASLt GEMM (BF16 gate: x
    // split into three bf16 parts, 24 mantissa bits, three GEMMs into one fp32 accumulator: the fp32 GEMV's accuracy;
    // F32 gate: an fp32 GEMM), then the decode-fast router's per-token selection (route-prefill.cu). 0: off (the GEMV
    // path, moe_route_fast; compare mode). On from 16 tokens (round-2 H200: k3-layers-4 T=2048 MOE_ROUTE x3 40.5 ->
    // 0.78 ms, compare-backends --prefill-fast 1 PASS on all 14): decode batches below 16 keep the tuned GEMV router.
    // The ids equal the CPU's up to near ties of the logits (another summation order; test-prefill-cuda's tie rule).
    int moe_route_gemm_tokens = 16;
    // MLA_ATTN without a selection with at least this many tokens (prefill): the expanded form (cached latent rows
    // gathered, k_nope / v expanded by one cuBLASLt GEMM, split bf16 hi + lo for BF16 kv_b) and a causal flash-attention
    // kernel per (64-token query tile, head) (mla-prefill.cu). Needs dn + dr <= 256, dv <= 128, all multiples of 4; else
    // the absorbed kernels run. 0: off (the absorbed kernels; compare mode). On from 32 tokens (round-2 H200: k3-layers-4
    // T=2048 MLA_ATTN 69.8 -> 9.1 ms, compare-backends PASS; 32 = where mla_prefill_pairs_per_row 16 lets a fresh
    // sequence in anyway: pairs / rows = (T + 1) / 2).
    int mla_prefill_tokens = 32;
    // ... and only when the step's (token, key) pairs are at least this many times its gathered rows (sum over sequences of
    // pos0 + len): the expansion GEMM reads every cached position once, so batched decode (one token per sequence, pairs
    // ~= rows) stays on the absorbed kernels, a fresh prefill of T tokens (pairs ~ T^2 / 2) takes the new path from T ~ 32.
    // 0: every step with enough tokens (tests).
    int mla_prefill_pairs_per_row = 16;
    // ... and only while its device buffers fit in this many bytes: the gathered rows, their bf16 split and the expanded
    // k_nope / v, P x (L * 8 + dr * 4 + H * (dn + dv) * 4) bytes for P gathered positions (K3, 64 heads: ~68 KB a
    // position, 8 GiB ~ 126K positions); with mla_prefill_mma the expanded rows' bf16 hi + lo as well (P x (dr * 4 + H *
    // (dn + dv) * 4) more: ~130 KB a position, ~66K positions). Beyond it the absorbed kernels run (no extra memory); run_mla_prefill itself
    // refuses a larger step with an error naming this limit.
    int64_t mla_prefill_max_bytes = int64_t(8) << 30;
    // ... the causal attention of that form on mma.sync (mla-prefill.cu "The tensor-core form": every operand split into
    // bf16 hi + lo, three products per pair, fp32 accumulation and softmax; dn, dr, dv multiples of 8, dn + dr <= 192,
    // dv <= 128, else the SIMT kernel). false: the fp32 SIMT kernel (compare mode). Predicted before its first H200 run (session 13): the
    // attention ~6x faster, k3-layers-4 T=2048 MLA_ATTN 9.5 -> 1.5-2 ms, 48B T=1024 7.2 -> ~1.3 ms (the expansion GEMM
    // and the gather stay). Measured (session 13, bench/RESULTS.md): k3-layers-4 T=2048 9.4 -> 3.7 ms, 48B T=1024 7.1 -> 3.4
    // ms (the kernel is latency-bound at 8 warps per SM, not tensor-bound); 48B T=8192 step 717.5 -> 514.5 ms.
    bool mla_prefill_mma = true;
    // SHORT_CONV with at least this many tokens (prefill): one thread per (token, channel), the window read from x or the
    // state, then the state write-back (conv-prefill.cu; the same sums as the sequential kernel). 0: off (one thread per
    // (sequence, channel) walking its tokens; compare mode). On from 16 tokens (round-2 H200: SHORT_CONV 11.5 -> 2.0 ms
    // at T=2048, compare-backends PASS); decode batches below 16 keep the sequential kernel (and fuse_conv_l2's).
    int conv_prefill_tokens = 16;
    // ATTN_RES_MIX with at least this many rows (prefill): scores by a warp per (row, candidate) with float4 loads (no
    // block barriers), the mix with float4 and the softmax weights formed once per block (attn-res-prefill.cu). Needs
    // D % 4 == 0 and 16-byte aligned inputs, else the split kernels run. 0: off (compare mode). On from 16 rows (round-2
    // H200: ATTN_RES_MIX 15.5 -> 1.2 ms at T=2048, compare-backends PASS); decode batches below 16 keep the old kernels.
    int attn_res_prefill_tokens = 16;
    // ATTN_RES_MIX below attn_res_prefill_tokens (decode): scores from partial sums over this many columns per block
    // (attn-res.cu chunked form), the mix kernel adding the partials in chunk order; 0 = the split form (one block per
    // (row, candidate) walking all D columns: ~24 us per mix at K3's D = 7168 with 2 blocks, Nsight Compute 2026-11-30).
    // 1024 by prediction (k3 ATTN_RES_MIX x8 0.20 -> ~0.06 ms per step); the H200 run decides. With attn_res_cluster on
    // (the default) the one-launch kernel runs instead, at this chunk (0: 1024); the chunked / split forms run only with
    // it off (or for unaligned inputs).
    int attn_res_chunk = 1024;
    // ATTN_RES_MIX below attn_res_prefill_tokens (decode), D % 4 == 0 and 16-byte aligned: ONE launch per mix
    // (attn-res.cu k_attn_res_mix_cluster: a thread-block cluster of the row's ceil(D / attn_res_chunk) <= 8 column
    // blocks; chunk partials shared through distributed shared memory, then each block mixes its own columns). false:
    // the chunked form (two launches). Session 4 (H200): removed because its test was wrong (a bitwise claim that did
    // not hold, a control that could not fail). Session 5 call K (H200), corrected test: the kernel called directly,
    // CPU NMSE <= 1.1e-13 on 8 shapes, parity with the chunked form, dropped-candidate and half-swapped-values controls
    // fail as required, memcheck 0 / racecheck 0; kernel 9.50 -> 4.55 us (n 3) / 9.70 -> 9.04 us (n 9); k3-layers-4 B=1
    // step 2.617 -> 2.579 ms (same binary, same run). On.
    bool attn_res_cluster = true;
    // run() (eager) records a CUDA event after every node, so node_ms() can split the step's GPU time by node
    // (benchmarks; when the GPU, not the host, is the bottleneck these are the kernels' times plus small gaps).
    bool profile_nodes = false;
    // Programmatic Dependent Launch (Hopper): the kernels launched through common.cuh's launch_k (every kernel of the
    // backend; cuBLASLt and memsets stay ordinary) carry cudaLaunchAttributeProgrammaticStreamSerialization, so each may be scheduled while
    // the kernel before it still runs and waits in its first statement (griddepcontrol.wait) for that kernel's completion;
    // captured graphs get programmatic edges. Same results bit for bit (test-pdl-cuda). false: ordinary launches (compare
    // mode; bench-cuda-decode --pdl 0|1).
    bool pdl = true;
    // run() of a decode step (one token per sequence, no node callback, no guard, no profile): the step is replayed as a
    // CUDA graph captured for its layout (batch size, logits rows, a position capacity: cuda-backend.cpp "decode steps
    // as replayed CUDA graphs"); the first step of a layout runs eagerly, the second captures and replays, the later
    // ones replay (only the batch's device array is rewritten). Up to 8 layouts kept. Same kernels as the eager run;
    // the position capacity may change MLA's key-range split (another summation order). false: every step eager.
    bool graph_decode = true;
    // Eager runs without a node callback, guard or profile release each node's outputs after the last launch that reads
    // them, and the big per-node scratch (LINEAR's bf16 planes, MoE / KDA / MLA / router scratch) after its node
    // (cuda-backend.cpp plan_release); read() of a released node is an error naming it; the logits node is kept. The
    // runtime turns it on (it reads only the logits). Off (the default): every output stays readable until the next run
    // (tests, compare-backends, benchmarks reading intermediates). Why: an eager prefill step kept ~20 MB per node alive,
    // so a 2048-token step of the 48B (98 GB of weights) ran out of the H200's memory at layer 18 (session 12 call A).
    bool free_dead_outputs = false;
    // Tests of the release (test-runtime-cuda): 1 = fill each released output with 0xFF bytes (NaN, id -1) before it is
    // freed, so that a launch reading it after its release cannot pass unseen (memory returned to the pool keeps its
    // bytes until reused, and compute-sanitizer does not see pool reuse); 2 = the same, released one position early
    // (a control that must change the logits). 0: off.
    int free_dead_debug = 0;
};

class backend_cuda : public backend {
public:
    // Copies every device-resident STATE buffer back into its host tensor.
    virtual void sync_state_to_host() = 0;
    // Forgets the device copies of STATE buffers; the next run uploads them from the host again.
    virtual void state_reload() = 0;
    // Test hook for the sentinel control: flips one sentinel byte after output `out` of `node` in the next
    // guarded run, so that run must fail naming the node.
    virtual void guard_corrupt_next(int node, int out) = 0;
    // LINEAR nodes the last run launched together with an earlier LINEAR over the same input (linear_group).
    virtual int linear_grouped() const = 0;
    // Fusions the last run/capture executed (cuda_options::fuse_norm_linear / fuse_add): RMS_NORM launches folded into
    // a GEMV, ADD launches folded into a GEMV epilogue.
    virtual int fused_norms() const = 0;
    virtual int fused_adds() const = 0;
    // Launches of the staged-norm GEMV kernel (cuda_options::fuse_norm_staged) the last run/capture executed.
    virtual int fused_norm_staged_launches() const = 0;
    // L2_NORM launches the last run/capture folded into their SHORT_CONV's launch (cuda_options::fuse_conv_l2).
    virtual int fused_conv_l2s() const = 0;
    // SIGMOID launches the last run/capture folded into their LINEAR's GEMV epilogue (cuda_options::fuse_sigmoid).
    virtual int fused_sigmoids() const = 0;
    // Fused KDA decode launches the last run/capture executed (cuda_options::fuse_kda_decode).
    virtual int fused_kda_decodes() const = 0;
    // MOE_EXPERTS launches the last run/capture executed with the shared expert as their extra slot
    // (cuda_options::moe_shared_slot).
    virtual int fused_moe_shared() const = 0;
    // MoE blocks the last run/capture executed as one persistent launch (cuda_options::moe_layer_fused).
    virtual int fused_moe_layers() const = 0;
    // KDA tails the last run/capture executed together with their o_proj (cuda_options::kda_oproj_fused).
    virtual int fused_kda_oprojs() const = 0;
    // Side-branch L2 prefetch nodes added to the last captured graph (cuda_options::l2_side_prefetch_mib).
    virtual int side_prefetches() const = 0;
    // Router logits the last run/capture computed inside a norm's launch (cuda_options::fuse_norm_route).
    virtual int fused_routes() const = 0;
    // BF16 LINEARs the last run/capture ran as one stacked hi + lo GEMM (cuda_options::linear_split_stacked).
    virtual int linear_stacked() const = 0;
    // Flagged BF16 LINEARs the last run/capture ran on another LINEAR's bf16 copy of x (cuda_options::linear_bf16_share_x).
    virtual int linear_shared_x() const = 0;
    // Device name and bytes of device memory held for weights / states.
    virtual std::string device_name() const = 0;
    virtual size_t weight_bytes() const = 0;

    // Device-resident weights without a host copy (GPU benchmarks of 70-100 GB synthetic models): allocates the
    // device buffer of `t` under its weight-cache key (t.data, e.g. an address in a sparse mmapped file) and fills it
    // on the device from a counter-based hash of `seed`: F32/BF16/F16 uniform in [lo, hi]; U8/F8 bytes, integers
    // uniform in [lo, hi]. The host bytes are never read for this tensor (an FP4 scale tensor made this way is not
    // scanned for NaN bytes: the range is the caller's promise). Error if the tensor is already on the device.
    virtual void weight_generate(const tensor & t, uint64_t seed, float lo, float hi) = 0;

    // One step as a CUDA graph: runs `g` once eagerly (uploads weights and states, creates cuBLASLt plans), then
    // captures all its kernels into one CUDA graph whose outputs live in a persistent arena. The batch's device copy
    // is taken at capture: every replay runs the same step layout (same positions and slots); a new layout needs a
    // new capture (per batch-size bucket). `g` must outlive the replays. run() drops the captured graph.
    virtual void capture(const graph & g) = 0;
    // Launches the captured graph n times back to back, waits, and checks the device error flags (naming the node).
    // read() then returns the outputs of the last replay.
    virtual void replay(int n) = 0;
    // With cuda_options::profile_nodes: GPU milliseconds of each node (graph order) in the last eager run; else empty.
    virtual std::vector<float> node_ms() const = 0;
    // cuda_options::graph_decode: decode-step graphs captured and replays run so far.
    virtual int graph_captures() const = 0;
    virtual int graph_replays() const = 0;
    // Test hook for the graph_decode control: the next replay skips the batch upload (the graph then reads the previous
    // step's positions, slots and ids), so that a comparison against the eager path must fail.
    virtual void graph_skip_upload_next() = 0;
};

std::unique_ptr<backend_cuda> backend_cuda_init(int device, const cuda_options & opt = {});

} // namespace perigee
