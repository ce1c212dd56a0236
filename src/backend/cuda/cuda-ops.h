// The CUDA kernels' host launchers (private to backend/cuda and its tests).
//
// Plain C++ on raw device pointers, so the .cu files need none of the project's host headers (fmt does
// not go through nvcc) and cuda-backend.cpp needs no CUDA compiler. Every launcher enqueues on `st` and
// returns the launch's cudaError_t (cudaGetLastError after the launch); the backend turns a failure into
// a perigee::error naming the node. Shapes are outermost first. Activations are F32 on the device;
// weights keep the checkpoint dtype (wtype). Kernels are named k_<op>_<variant> (STYLE §3.5).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace perigee::cuda {

enum class wtype : int { F32 = 0, BF16 = 1, F16 = 2 };
// A read-only device weight of a float-like dtype; data == nullptr = none.
struct dweight {
    const void * data = nullptr;
    wtype type = wtype::F32;
};

// The step's batch layout on the device (ir/batch.h), uploaded once per run.
struct dbatch {
    int n_seq = 0, n_tok = 0;
    int page_size = 0, max_pages = 0;   // block_table is [n_seq, max_pages], -1 padded
    const int32_t * seq_start = nullptr;  // [n_seq + 1]
    const int32_t * pos0 = nullptr;       // [n_seq]
    const int32_t * slot = nullptr;       // [n_seq]
    const int32_t * block_table = nullptr;// [n_seq, max_pages]
    const int32_t * tok_seq = nullptr;    // [n_tok] sequence of each packed token
    int max_pos = 0;                      // largest position of any token + 1
};

// ---- pdl.cu: Programmatic Dependent Launch (cuda_options::pdl) ----
// Whether kernels launched through launch_k (common.cuh) on this host thread carry the PDL launch attribute. A
// per-thread setting rather than one more argument of every launcher: the backend sets it from its options for the
// duration of each entry point that launches kernels (pdl_scope in run, capture, weight_generate, sample_rows), so
// several backends with different options may live in one process. Outside any scope: true (the default of
// cuda_options::pdl; tests that call launchers directly run with it on).
bool pdl_enabled();
void pdl_set(bool on);
class pdl_scope {
public:
    explicit pdl_scope(bool on) : old_(pdl_enabled()) { pdl_set(on); }
    ~pdl_scope() { pdl_set(old_); }
    pdl_scope(const pdl_scope &) = delete;
    pdl_scope & operator=(const pdl_scope &) = delete;

private:
    bool old_;
};
// Test probes of the ordering (tests/ops/cuda/test-pdl-cuda.cpp), all launched through launch_k:
// producer: pdl_wait, then pdl_trigger, then every thread spins `spin` clock64 cycles and writes buf[i] = value (n ints).
// consumer: (pdl_wait when `wait`) out[i] = buf[i]; without the wait under PDL it may read buf before the producer
// wrote it (the control). chain step: pdl_enter, then y[i] = x[i] * 3 + add + i after `spin` cycles (x, y: n ints).
cudaError_t launch_pdl_probe_producer(int * buf, int64_t n, int64_t spin, int value, cudaStream_t st);
cudaError_t launch_pdl_probe_consumer(const int * buf, int64_t n, bool wait, int * out, cudaStream_t st);
cudaError_t launch_pdl_probe_step(const int * x, int64_t n, int add, int64_t spin, int * y, cudaStream_t st);

// Device error flags (one int per kind; the backend reads them after a run and names the node).
// ERR_SYNC_TIMEOUT: a device-wide barrier of a persistent kernel (moe-layer-decode.cu) waited past its bound (its grid
// was not all resident, or a counter never completed): the launch ended with wrong outputs instead of hanging.
enum : int { ERR_ID_RANGE = 0, ERR_SEL_RANGE = 1, ERR_EXPERT_ID = 2, ERR_SYNC_TIMEOUT = 3, ERR_COUNT = 4 };

// ---- l2-side-prefetch.cu: the decode graph's side-branch L2 prefetch (cuda_options::l2_side_prefetch_mib) ----
// Up to k_max device ranges asked into L2 (cp.async.bulk.prefetch.L2), in order.
struct l2_ranges {
    static constexpr int k_max = 8;
    const void * p[k_max] = {};
    uint64_t bytes[k_max] = {};
    int n = 0;
};
// Adds to graph g a kernel node of `blocks` one-warp blocks that prefetches the ranges (each trimmed to 16-byte
// alignment; cudaErrorInvalidValue when nothing is left), depending on node dep only (a full edge: it starts when dep's
// kernel has completed). Nothing depends on it.
cudaError_t add_l2_prefetch_node(cudaGraph_t g, cudaGraphNode_t dep, const l2_ranges & r, int blocks, cudaGraphNode_t * out);

// ---- norm.cu ----
// One block per row. reg (cuda_options::norm_reg): rows of up to 16 elements per thread are held in registers, every
// load issued at once and the weights before the PDL wait (k_norm_reg); bit for bit the loop kernel (reg false).
cudaError_t launch_rms_norm(const float * x, int64_t R, int64_t N, dweight w, float eps, float * y, cudaStream_t st,
                            bool reg = true);
cudaError_t launch_layer_norm(const float * x, int64_t R, int64_t N, dweight w, dweight b, float eps, float * y,
                              cudaStream_t st, bool reg = true);
cudaError_t launch_l2_norm(const float * x, int64_t R, int64_t N, float eps, float * y, cudaStream_t st, bool reg = true);
cudaError_t launch_gated_rms_norm(const float * o, const float * z, int64_t R, int64_t N, dweight w, float eps, float * y,
                                  cudaStream_t st, bool reg = true);

// ---- linear.cu ----
// Which GEMV kernels run (cuda_options::gemv_unroll). unroll 0: the first kernels (one warp per row, one 16-byte weight
// load in flight per lane); 1, 2, 4 or 8: the v2 kernels with that many independent 16-byte weight loads in flight per
// lane (at least one per row of the warp), 1-4 rows per warp by token count, the warps of a block splitting each row's
// dot product when the grid would not fill the SMs (partials summed in shared memory in a fixed order: deterministic).
// split: 0 = chosen from the grid size and SM count; 1, 2, 4 or 8 = that many warps per row (benchmarks, tests).
// Any other value: cudaErrorInvalidValue.
// v3 (cuda_options::gemv_v3; chunks of ONE token, 16-bit weights, in % 8 == 0; any other chunk keeps the kernel that
// unroll/split choose): a persistent grid (at most the resident blocks) whose lanes hold U 16-byte weight loads of their
// row slice in flight, U chosen to cover the slice in whole rounds (a 2304-wide bf16 row: 9 chunks per lane = one round
// of U = 9, no tail round), and each register refilled with the NEXT row's load as soon as it is consumed (the loads of
// row i + 1 stream while row i is summed); the staged norm's first loads are issued before its prologue. v3: 0 = off;
// 1 = on; 2 = on, with the first loads issued even before the PDL wait (the weights must not be written by the kernel
// before: true of checkpoint weights inside a step). v3_unroll: 0 = chosen from the slice, else 1, 2, 3, 4, 5, 8, 9 or
// 16 (benchmarks, tests). split as above; 0 = chosen by v3's rule (linear.cu v3_run: tiles per SM).
inline constexpr int k_gemv_unroll_default = 4;
struct gemv_cfg {
    int unroll = k_gemv_unroll_default;
    int split = 0;
    int v3 = 0;
    int v3_unroll = 0;
    // v2 / v3 (cuda_options::gemv_evict_first): weights loaded with the L2 policy evict_first. Results unchanged.
    bool evict_first = false;
    // The tensor-core GEMV (cuda_options::gemv_mma_min_tokens; linear.cu "GEMV on the tensor cores"): chunks of at least
    // this many tokens (1..8) with BF16 weights and in % 8 == 0 run as mma.sync over 32 rows x 8 tokens per warp item, x split
    // into mma_parts bf16 parts (3: x = p0 + p1 + p2, 24 significant bits, fp32 parity; 1 or 2: fewer bits, for the
    // tests' controls). 0 = off (every chunk keeps the kernels above). Takes precedence over v3 and unroll.
    // split: K slices per 32-row group (forced 1, 2, 4, 8; 0 = chosen, up to 64: enough items for every resident warp). With more than one
    // slice the kernel needs mma_part (>= groups x slices x 256 floats) and mma_ctr (>= groups counters, all 0, left at
    // 0); without them (or too small) the chosen split is 1 and a forced one is cudaErrorInvalidValue.
    int mma = 0;
    int mma_parts = 3;
    float * mma_part = nullptr;
    int64_t mma_part_floats = 0;
    unsigned * mma_ctr = nullptr;
    int64_t mma_ctr_n = 0;
};
// Launches of the tensor-core GEMV kernel since the process started (host counter; tests check the path ran).
long gemv_mma_launches();
// y [T, out] = x [T, in] W^T, W [out, in]; the bandwidth GEMV path (any T, best for T <= 8).
cudaError_t launch_linear_gemv(const float * x, int64_t T, int64_t in, dweight W, int64_t out, float * y, cudaStream_t st,
                               gemv_cfg cfg = {});
// Up to k_gemv_group_max LINEARs over the same x [T, in] (same weight type) as one launch: y[s] [T, out[s]].
inline constexpr int k_gemv_group_max = 8;
cudaError_t launch_linear_gemv_group(const float * x, int64_t T, int64_t in, wtype wt, const void * const * w,
                                     float * const * y, const int64_t * out, int n, cudaStream_t st, gemv_cfg cfg = {});
// x F32 [n] -> bf16 [n] (round to nearest even), for the cuBLASLt path.
cudaError_t launch_f32_to_bf16(const float * x, int64_t n, uint16_t * y, cudaStream_t st);
// x F32 [n] -> y F32 [n] = x rounded to bf16 (nearest even): op_params::bf16_inputs ahead of a GEMV or an fp32 GEMM.
cudaError_t launch_f32_round_bf16(const float * x, int64_t n, float * y, cudaStream_t st);
// x F32 [n] -> hi = bf16(x), lo = bf16(x - hi): x is hi + lo to ~16 mantissa bits (the split-bf16 GEMM path).
cudaError_t launch_f32_to_bf16_split(const float * x, int64_t n, uint16_t * hi, uint16_t * lo, cudaStream_t st);
// table [V, D], ids [T] -> y [T, D]; an id outside 0..V-1 sets err[ERR_ID_RANGE] and writes zeros.
cudaError_t launch_get_rows(dweight table, int64_t V, int64_t D, const int32_t * ids, int64_t T, float * y, int * err,
                            cudaStream_t st);

// ---- elementwise.cu ----
enum class ew_op : int { ADD, MUL, SCALE, SIGMOID, SILU_MUL, SITU_MUL };
struct ew_params { float scale = 1.0f, beta = 1.0f, lin_beta = 0.0f; };
cudaError_t launch_elementwise(ew_op op, const float * a, const float * b, int64_t n, const ew_params & p, float * y,
                               cudaStream_t st);
cudaError_t launch_cols(const float * x, int64_t T, int64_t C, int64_t c0, int64_t n, float * y, cudaStream_t st);

// ---- conv.cu ----
// x [T, C], w [C, 1, W], state [n_slots, C, W-1] (in place) -> y [T, C]; W <= 16.
cudaError_t launch_short_conv(const float * x, int64_t C, dweight w, int64_t W, float * state, const dbatch & b, float * y,
                              cudaStream_t st);

// ---- kda.cu ----
cudaError_t launch_kda_gate(const float * f, int64_t T, int64_t H, int64_t K, dweight a_log, dweight dt_bias,
                            float lower_bound, float * g, cudaStream_t st);
// Token recurrence, fp32 state [n_slots, H, K, V] read and written once per launch; K <= 256.
cudaError_t launch_kda_scan_recurrent(const float * q, const float * k, const float * v, const float * g,
                                      const float * beta, int64_t H, int64_t K, int64_t V, float scale, float * state,
                                      const dbatch & b, float * o, cudaStream_t st);
// Chunked WY form (kda-chunked.cu; chunks of 64 from each sequence's first token), fp32; 4 <= K <= 128 with K % 4 == 0,
// V <= 128. max_seq_len: the longest sequence of the batch. scratch: kda_chunk_scratch_floats(T, n_seq, H, K) floats.
// o is used as scratch between the two kernels (it ends as the output).
int64_t kda_chunk_scratch_floats(int64_t T, int64_t n_seq, int64_t H, int64_t K);
cudaError_t launch_kda_scan_chunked(const float * q, const float * k, const float * v, const float * g, const float * beta,
                                    int64_t H, int64_t K, int64_t V, float scale, float * state, const dbatch & b,
                                    int max_seq_len, float * scratch, float * o, cudaStream_t st);

// ---- mla.cu ----
struct mla_shape { int64_t n_head, head_dim_nope, head_dim_rope, head_dim_v, kv_lora_rank; };
// Absorbed-form MLA over the paged latent cache. n_split: blocks per (token, head) over contiguous key ranges
// (flash-decoding; partials merged by a combine kernel); 1 = one block per (token, head), the first kernel.
// mla_split_for picks it from the block count (1 when disabled). scratch: mla_scratch_floats(T, d, n_split) floats.
// v2 (cuda_options::mla_decode_v2): head groups sharing 32-key latent tiles in shared memory, weights read once per token
// tile (mla.cu "Decode v2"); n_split up to 64; shapes outside mla_v2_supported run the first kernels.
// v3 (cuda_options::mla_decode_v3, only with v2): three launches instead of five (the cache write inside q_absorb's
// launch, the combine inside the output projection), loads that do not depend on the previous kernel issued before the
// PDL wait (mla.cu "Decode v3"); c and kr must be 16-byte aligned, else v2 runs.
// v4 (cuda_options::mla_attn_v4, only with v3): v3 with the attention kernel k_mla_attn_v4 (8 warps per 8-head group,
// dims split over the warps; mla.cu "Decode v4") where v3 uses 8-head groups (T < 8), else v3's attention.
bool mla_v2_supported(const mla_shape & d);
int mla_split_for(int64_t T, const mla_shape & d, bool enabled, bool v2 = false);
int64_t mla_scratch_floats(int64_t T, const mla_shape & d, int n_split);
cudaError_t launch_mla_attn(const float * q, const float * c, const float * kr, dweight kv_b, const mla_shape & d,
                            float scale, float * cache, const int32_t * sel, int64_t topk, const dbatch & b, int n_split,
                            float * scratch, float * o, int * err, cudaStream_t st, bool v2 = false, bool v3 = false,
                            bool v4 = false);
// The MLA kv_a split (cuda_options::fuse_mla_kv, fuse-plan.h rule 6): x [T, W] -> cols = x[:, :L], c = RMS_NORM(cols)
// (w may be absent, eps), kr = x[:, L:] in one launch; c bitwise launch_rms_norm's.
cudaError_t launch_mla_kv_split(const float * x, int64_t T, int64_t W, int64_t L, dweight w, float eps, float * cols, float * c,
                                float * kr, cudaStream_t st);

// ---- indexer.cu ----
// scratch: at least T * b.max_pos floats.
cudaError_t launch_indexer_topk(const float * qi, const float * ki, const float * wi, int64_t n_head, int64_t head_dim,
                                int64_t topk, float scale, float * kcache, const dbatch & b, float * scratch, int32_t * sel,
                                cudaStream_t st);

// ---- moe.cu ----
struct droute { int64_t n_expert, topk, n_group, topk_group; bool renormalize; float scale; int softmax; };
// x [T, D], gate [E, D], bias [E] | none -> ids [T, topk], w [T, topk]; E <= 1024.
cudaError_t launch_moe_route(const float * x, int64_t T, int64_t D, dweight gate, dweight bias, const droute & c,
                             int32_t * ids, float * w, cudaStream_t st);
// The same outputs, decode-fast: logits [T, E] (scratch) by the GEMV over all SMs, then a parallel selection per token
// with the serial rule's exact outcome (cuda_options::moe_route_fast).
cudaError_t launch_moe_route_fast(const float * x, int64_t T, int64_t D, dweight gate, dweight bias, const droute & c,
                                  float * logits, int32_t * ids, float * w, cudaStream_t st);
// T == 1 in one launch (cuda_options::moe_route_fused): every block computes a slice of the logits [E] (scratch), the
// last block to finish (device counter, zeroed here by a memset on `st`) selects. counter: one device int.
cudaError_t launch_moe_route_fused(const float * x, int64_t D, dweight gate, dweight bias, const droute & c, float * logits,
                                   unsigned * counter, int32_t * ids, float * w, cudaStream_t st);
// One expert matrix on the device: dense (F32/BF16/F16) or FP4 (fmt 1 = MXFP4, 2 = NVFP4).
// Device pointers 16-byte aligned (the decode kernels read 16-byte units; v7 copies the packed rows and the scale bytes
// with cp.async of 16 / 4U bytes from row offsets that are multiples of those): expert_table checks it.
struct dexpert_matrix {
    const void * w = nullptr;          // dense [out, in]
    const uint8_t * packed = nullptr;  // [out, in/2]
    const uint8_t * scale = nullptr;   // MXFP4 E8M0 [out, in/32]; NVFP4 E4M3 [out, in/16]
    int fmt = 0;
    wtype type = wtype::F32;
    float global_scale = 1.0f;
    int64_t out = 0, in = 0;
};
struct dexpert { dexpert_matrix gate, up, down; };
struct dexperts_cfg { int act; float situ_beta, situ_linear_beta; int64_t d_ff, d_out; };   // act 0 SiLU, 1 SiTU
// experts: device array [E]. scratch: T*k*(d_ff + d_out) floats. round_h: the GLU rows rounded to bf16 before the down
// projection (op_params::bf16_inputs; the caller rounds x).
cudaError_t launch_moe_experts(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                               const dexpert * experts, int64_t E, const dexperts_cfg & c, float * scratch, float * y,
                               int * err, cudaStream_t st, bool round_h = false);
// The grouped decode path (cuda_options::moe_grouped): slots grouped by expert on the device, one block per (expert,
// 8 output rows) over all selected experts, each selected expert's rows read once with 16-byte loads. vfmt: 1 = dense
// BF16 (Din, d_ff multiples of 8), 2 = MXFP4, 3 = NVFP4 (multiples of 32); every expert in that format; E <= 1024.
// scratch as above; gw: moe_group_ints(T, k, E, c.d_out) ints.
// The grouped kernels' segment tables, or the decode kernels' combine counters (v6 / v7: one per (token, row tile of
// down), tiles of >= 64 rows): whichever is larger.
int64_t moe_group_ints(int64_t T, int64_t k, int64_t E, int64_t d_out);
// Kernel choices of the grouped path (the MoE fields of cuda_options, backend-cuda.h).
struct dmoe_opts {
    bool fp4_v2 = true;     // MXFP4 at T == 1: the v2 kernels (when fp4_v3 is off)
    bool fp4_v3 = true;     // MXFP4 at T == 1: the v3 kernels (no grouping, combine folded into down, fp16 dequant)
    int mma_tokens = 0;     // > 0: experts with >= this many tokens on bf16 tensor cores
    bool mma_split = true;  // tensor-core experts: activations as bf16 hi + lo (false: hi only)
    bool mma_v2 = false;    // tensor-core experts, MXFP4/NVFP4 with K % 128 == 0: k_moe_mma2 (moe-mma.cu); false: v1
    bool dec_v4 = false;    // T == 1, BF16/MXFP4, k <= 32: the v4 kernels (no grouping; down + combine, slots on warps)
    bool small_v4 = false;  // T > 1, BF16/MXFP4 GEMV experts: the v4 kernels (each row read once for up to 8 tokens)
    int mma_large_step = 0;        // > 0: steps of at least this many tokens use mma_large_tokens instead of mma_tokens
    int mma_large_tokens = 0;      //   (the tensor-core threshold of prefill-sized steps)
    bool dec_v5 = false;    // T == 1, MXFP4: the v5 kernels (fp16 tensor cores; precedes dec_v4)
    int v5_cfg = 0;         // benchmarks: v5 kernel forms and stages (moe.cu launch_v5_one); 0 = the defaults
    bool dec_bf16 = false;  // T == 1, BF16, shapes of moe_bf16_decode_supported: moe-bf16-decode.cu (precedes dec_v4)
    int dec_pairs_fp4 = 0;  // 1 < T <= this, MXFP4: dec_v5's v6 / v7 kernels with each (token, pick) pair as a slot
    int dec_pairs_bf16 = 0; // 1 < T <= this, BF16: dec_bf16's pair the same way
    bool pairs_sorted = false;  // the pair form's slots run in expert order (moe.cu k_moe_slot_order)
    int bf16_cfg = 0;       // benchmarks: launch_moe_bf16_decode's cfg; 0 = the defaults
    bool mma_v3 = false;    // tensor-core experts, MXFP4 with Din, d_ff multiples of 512: k_moe_mma3 (precedes mma_v2)
    bool mma_v4 = false;    // ... the wgmma form (moe-wgmma.cu; precedes mma_v3)
    bool mma_v4_bf16 = false;   // ... and over BF16 experts with Din, d_ff multiples of 64 (else v1)
    bool mma_v4_shift = false;  // ... MXFP4 in the shift form (moe-wgmma.cu FMT 3)
};
// moe-bf16-decode.cu: the BF16 decode pair (T == 1; gate/up one warp per (slot, row); down + combine, y bit for bit v4's).
// Shapes: Din and d_ff 256 NU with NU in {4, 8, 9} (gate/up) / {4, 8} (down), k <= 16, d_out a multiple of 2 (or of 3,
// k <= 8). cfg: ones digit 1 = gate/up alone, 2 = down + combine alone (benchmarks); tens digit 1 = down R 2 at 3 blocks
// per SM instead of R 3 at 2; hundreds digit (cuda_options::moe_bf16_early) 1 = the down stage's ids and weight loads
// before its PDL wait and, with the shared slot, that slot on blockIdx.y 0 with all its work but the writes before the
// wait; 2 = the down stage's only; thousands digit (cuda_options::moe_bf16_evict_first) 1 = the weights loaded with
// the L2 policy evict_first. Outputs bit for bit the same whatever the digits.
bool moe_bf16_decode_supported(int64_t Din, int64_t k, const dexperts_cfg & c, int cfg = 0);
// False (nothing launched) when the shape is not supported. T tokens (x [T, Din], ids / w [T, k], y [T, d_out]); T > 1
// is the pair form: every (token, pick) pair a slot of the T == 1 kernels, each token's y bit for bit a T == 1 launch's on
// that token alone (cuda_options::moe_decode_pairs_bf16). hbuf: T * k * d_ff floats.
// order (T > 1, optional): a permutation of the T k slots (the gate/up blocks take slot order[blockIdx.y]: the slots in
// expert order, so that an expert's re-reads by several tokens run back to back; outputs unchanged).
bool launch_moe_bf16_decode(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                            const dexpert * experts, int64_t E, const dexperts_cfg & c, float * hbuf, float * y, int * err,
                            cudaStream_t st, int cfg = 0, const int32_t * order = nullptr);
// The shared expert as slot k of the BF16 decode pair (cuda_options::moe_shared_slot, fuse-plan.h): weight 1.0, added
// after the routed sum. w: its dense BF16 matrices (gate/up [d_ff, Din], down [d_out, d_ff]: the routed widths). The pair
// writes gate/up [d_ff] (its projections), act [d_ff] (the GLU product, read back by the down stage), down [d_out], the
// routed sum into y (bit for bit launch_moe_bf16_decode's), sum = y + down, and with res: sum2 = sum + res (res and sum2
// both set or both null). Device pointers, 16-byte aligned.
struct dmoe_shared {
    dexpert w;
    float * gate = nullptr;
    float * up = nullptr;
    float * act = nullptr;
    float * down = nullptr;
    float * sum = nullptr;
    const float * res = nullptr;
    float * sum2 = nullptr;
    // The gate/up launch's blocks of routed slot 0 ask the shared expert's gate, up and down rows into L2 before their
    // PDL wait (while the route still runs): the shared slot's warps then read them from L2. Results unchanged.
    bool prefetch = false;
};
// Whether the shared slot runs for these widths (the planner's rule; = moe_bf16_decode_supported at cfg 0). Declared
// also in fuse-plan.h (which stays free of CUDA headers).
bool moe_bf16_shared_supported(int64_t Din, int64_t d_ff, int64_t d_out, int64_t k);
// cudaErrorInvalidValue (nothing launched) when the shapes, dtypes or pointers are not the above. hbuf: k * d_ff floats.
cudaError_t launch_moe_bf16_decode_shared(const float * x, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                                          const dexpert * experts, int64_t E, const dexperts_cfg & c, const dmoe_shared & sh,
                                          float * hbuf, float * y, int * err, cudaStream_t st, int cfg = 0);
// moe-layer-decode.cu: the MoE block at T == 1 in one persistent launch (cuda_options::moe_layer_fused): h = RMS_NORM(x),
// logits = router . h, the small selection (ids, w), the routed BF16 experts' gate / up / GLU (hbuf) and down with the
// shared expert as slot k (dmoe_shared's outputs: gate / up / act / down / sum and sum2 = sum + res), y = the routed sum.
// Every output but the logits bit for bit the unfused launches' given the same logits. Shapes: the 48B's (D 2304, d_ff
// 1024, top-8 of E <= 256, sigmoid without group pruning: moe_layer_decode_supported); BF16 router, shared and routed
// experts (the table's entries are not read on the host: the caller's). sync: 3 device counters, 0 before the first
// launch and 0 again after each complete launch (a launch that faults leaves them set: reset them with the state).
struct dmoe_layer {
    const float * x = nullptr;   // [D] the norm's input
    dweight norm_w;              // [D] or none
    float eps = 0.0f;
    const void * router = nullptr;   // BF16 [E, D]
    dweight bias;                    // [E] or none
    droute rc{};
    const dexpert * experts = nullptr;   // device table [E]
    int64_t E = 0;
    dexperts_cfg c{};
    dmoe_shared sh;              // the shared expert's weights (sh.w) and outputs
    float * h = nullptr;         // [D]
    float * logits = nullptr;    // [E]
    int32_t * ids = nullptr;     // [k]
    float * w = nullptr;         // [k]
    float * hbuf = nullptr;      // [k, d_ff]
    float * y = nullptr;         // [D]
    unsigned * sync = nullptr;   // [3]
    int * err = nullptr;
};
bool moe_layer_decode_supported(int64_t D, int64_t d_ff, int64_t E, int64_t k, const droute & rc);
// cudaErrorInvalidValue (nothing launched) outside the shapes above, for a missing pointer or a misaligned one.
// cfg: thousands digit 1 = the weights loaded with the L2 policy evict_first (as the pair's); ones digit 9 (tests only:
// the timeout's control) = the first barrier waits for one router row more than there are, so it must time out.
cudaError_t launch_moe_layer_decode(const dmoe_layer & p, cudaStream_t st, int cfg = 0);
cudaError_t launch_moe_experts_grouped(int vfmt, const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w,
                                       int64_t k, const dexpert * experts, int64_t E, const dexperts_cfg & c,
                                       float * scratch, int32_t * gw, float * y, int * err, cudaStream_t st,
                                       const dmoe_opts & o = {});
// moe-mma.cu: the tensor-core stages of the grouped path (gate/up into hbuf, down into ybuf) for the experts with at
// least n_min tokens; gw grouped by k_moe_group. vfmt as above. Called by launch_moe_experts_grouped BEFORE the GEMV
// stages of the same step: v3 / v4 use ybuf and hbuf as scratch for their bf16 activation planes, rows the GEMV
// stages' slots then overwrite with their own results.
void launch_moe_mma_stages(int vfmt, const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                           const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st,
                           int n_min, const dmoe_opts & o);
// Host-side count of the stage pairs of tensor-core version v (3 or 4) launch_moe_mma_stages has launched in this
// process (tests: that the version asked for, not its predecessor, ran).
int64_t moe_mma_launches(int v);
// Host-side count of the MXFP4 v4 launches in the shift form (dmoe_opts::mma_v4_shift).
int64_t moe_mma4_shift_launches();
// The largest E8M0 scale byte the shift form (fp4.cuh fp4_a_pairs_shift: one bf16 multiply by 2^(b - 1)) is exact for:
// launch_moe_mma4_stages' shift is for expert tables whose scale bytes are all at most this.
inline constexpr unsigned fp4_shift_max_scale = 128;
// Tests: n MXFP4 words q (8 E2M1 nibbles, low first) with their E8M0 scale bytes -> each word's 8 values in column order
// as the v4 A fragments carry them, by the table form (fp4_a_pairs) and by the shift form (fp4_a_pairs_shift): table
// and shift [n * 8] on the device. Both exact where the scale byte is at most fp4_shift_max_scale; above it the shift
// form is wrong (its precondition; the table form stays exact).
cudaError_t fp4_dequant_forms(const uint32_t * q, const uint8_t * scale, int64_t n, float * table, float * shift, cudaStream_t st);
// Host-side count of the MOE_EXPERTS launches at T > 1 that ran the pair form (fmt 2 MXFP4 v6 / v7, 1 BF16) in this
// process (tests: that the pair form, not the grouped kernels, ran).
int64_t moe_pair_launches(int fmt);
// moe-wgmma.cu: the v4 stages (wgmma), MXFP4 (vfmt 2; shift: the dequant of fp4.cuh fp4_a_pairs_shift, the activation
// planes in its order; only for experts whose scale bytes are all <= fp4_shift_max_scale) and BF16 (vfmt 1); the
// shapes it takes.
bool moe_mma4_supported(int vfmt, int64_t Din, int64_t k, const dexperts_cfg & c);
cudaError_t launch_moe_mma4_stages(int vfmt, const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A,
                                   int64_t S, const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf,
                                   cudaStream_t st, int n_min, bool xsplit, bool shift);

// ---- attn-res.cu ----
inline constexpr int k_attn_res_max = 32;
struct cand_ptrs { const float * p[k_attn_res_max]; };
// scratch: R * n floats for the split form (scores by one block per (row, candidate), then the mix over many blocks);
// nullptr: the first kernel (one block per row).
cudaError_t launch_attn_res_mix(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w, dweight proj_w,
                                float eps, float * scratch, float * y, cudaStream_t st);
// The chunked form (cuda_options::attn_res_chunk): scores from partial sums over `chunk` columns per block (chunk % 4
// == 0, D % 4 == 0, candidates and y 16-byte aligned), reduced in chunk order by the mix kernel. part: the floats
// attn_res_chunk_parts() counts.
int64_t attn_res_chunk_parts(int64_t n, int64_t R, int64_t D, int64_t chunk);
cudaError_t launch_attn_res_mix_chunked(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, int64_t chunk, float * part, float * y, cudaStream_t st);
// The one-launch form (cuda_options::attn_res_cluster): grid (ceil(D / chunk) <= 8 column blocks, R), a thread-block
// cluster per row; scores from the cluster's chunk partials through distributed shared memory (the chunked form's sums,
// not its bits; chunk grows to ceil(D / 8) rounded up to 4 where D needs more than 8 blocks). D % 4 == 0,
// candidates and y 16-byte aligned; no scratch.
cudaError_t launch_attn_res_mix_cluster(const cand_ptrs & cands, int64_t n, int64_t R, int64_t D, dweight norm_w,
                                        dweight proj_w, float eps, int64_t chunk, float * y, cudaStream_t st);

// ---- guard.cu (debug sentinels) ----
cudaError_t launch_fill_u32(uint32_t * p, int64_t n, uint32_t v, cudaStream_t st);

// ---- fill.cu (device-generated weights for GPU benchmarks) ----
// n elements of kind 0 = F32, 1 = BF16, 2 = F16 (uniform in [lo, hi]) or 3 = bytes (integers uniform in [lo, hi]),
// from a counter-based hash of (seed, index): the same seed gives the same values on any launch geometry.
cudaError_t launch_fill_random(void * p, int64_t n, int kind, uint64_t seed, float lo, float hi, cudaStream_t st);

// ---- sample.cu ----
// One row's sampling parameters (backend.h row_sampling without the project's headers).
struct sample_row_param {
    float temperature = 0.0f;   // 0 = greedy
    int top_k = 0;
    float top_p = 1.0f;
    float min_p = 0.0f;
    double u = 0.0;             // the row's uniform in [0, 1)
};
// logits [R, V] (device, F32) -> ids_host[R] (host): the host sampler's step 3 per row (sample.cu has the
// algorithm and how far it agrees with the host), -1 for a row with a NaN/Inf. prm is host memory. Synchronizes st.
cudaError_t sample_rows(const float * logits, int R, int64_t V, const sample_row_param * prm, int32_t * ids_host,
                        cudaStream_t st);

} // namespace perigee::cuda
