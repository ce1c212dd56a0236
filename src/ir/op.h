// The op set: the contract between the model (src/model/forward.cpp) and the backends.
//
// Each op has one semantics paragraph here. Shapes are outermost first ([T, D] = T rows of D).
// T is the number of tokens packed in this step (all sequences of the batch, one after another);
// sequence-aware ops read the batch layout from graph::batch (ir/batch.h). Activations are F32 on
// the CPU reference backend; weights keep the checkpoint's dtype and are converted inside the op.
#pragma once
#include <cstdint>
#include <string_view>

namespace perigee {

enum class op_type : uint8_t {
    // --- leaves ---
    IDS,            // I32 [T]: the token ids of the step (batch::ids)
    WEIGHT,         // a checkpoint tensor (any dtype), read-only
    STATE,          // a mutable pool buffer (KDA state, conv state, MLA latent cache, indexer key cache)

    // --- plain ops ---
    GET_ROWS,       // (table [V, D], ids I32 [T]) -> [T, D]: row lookup, no scaling
    RMS_NORM,       // (x [R, N], w [N] | none) -> [R, N]: y = x * rsqrt(mean(x^2) + eps) * w; p.eps.
                    //  The last dim is N = p.n (x may be viewed as [R*N/p.n, p.n], e.g. per head)
    LAYER_NORM,     // (x [R, N], w [N], b [N]) -> y = (x - mean) * rsqrt(var + eps) * w + b; biased var
    L2_NORM,        // (x [R, N]) -> x / sqrt(sum(x^2) + eps) over groups of p.n values (per head)
    LINEAR,         // (x [T, in], W [out, in]) -> [T, out] = x W^T; W is F32/BF16/F16; f32 accumulation.
                    //  p.bf16_inputs: x is first rounded to bf16 (nearest even), as ARCHITECTURE §3.0's
                    //  reference feeds every Linear; the result stays fp32
    ADD,            // (a, b) same shape -> a + b
    MUL,            // (a, b) same shape -> a * b
    SCALE,          // (x) -> x * p.scale
    SIGMOID,        // (x) -> 1 / (1 + exp(-x))
    SILU_MUL,       // (g [T, N], u [T, N]) -> silu(g) * u                (SwiGLU)
    SITU_MUL,       // (g [T, N], u [T, N]) -> [beta*tanh(g/beta)*sigmoid(g)] * [lin_beta*tanh(u/lin_beta)]
                    //  (SiTU-GLU, ARCHITECTURE §3.0); p.situ_linear_beta <= 0 means "absent": up factor = u
    COLS,           // (x [T, C]) -> [T, p.n] = x[:, p.c0 : p.c0 + p.n] (splits a fused projection)
    SELECT_ROWS,    // (x [T, C]) -> [R, C] = the rows batch::logits_rows lists, in that order (so the
                    //  final norm and lm_head run only for the tokens whose logits are sampled)

    // --- model-family ops ---
    SHORT_CONV,     // (x [T, C], w [C, 1, W] F32|BF16, state [n_slots, C, W-1]) -> [T, C]
                    //  Causal depthwise conv of width W followed by SiLU, per sequence of the batch:
                    //  y_t[c] = silu(sum_j w[c, j] * s_{t-W+1+j}[c]), tap W-1 = current token. The history
                    //  before a sequence's first token in this step is its slot's state (zeros for a new
                    //  sequence: the runtime zeroes recycled slots). Writes the last W-1 inputs back.
    KDA_GATE,       // (f [T, H*K], A_log [>=H] F32, dt_bias [H*K] F32) -> g [T, H*K], log-decay, fp32:
                    //  p.gate_lower_bound < 0:  g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))   (K3)
                    //  otherwise:               g = -exp(A_log[h]) * softplus(f + dt_bias)         (48B)
                    //  A_log is read as H per-head values (the loader checked any tail is zero).
    KDA_SCAN,       // (q [T, H*K], k [T, H*K], v [T, H*V], g [T, H*K], beta [T, H],
                    //  state [n_slots, H, K, V] F32) -> o [T, H*V]
                    //  q, k are already L2-normalised; q is multiplied by p.scale here. Per sequence, from
                    //  its slot's state, per token: S = diag(exp(g)) S; u = beta (v - S^T k); S += k u^T;
                    //  o = S^T q. Writes the final state back to the slot. p.chunk_size = 64 selects the
                    //  chunked (WY) form for the whole-sequence path; 0 the token-by-token recurrence.
    GATED_RMS_NORM, // (o [T, H*V], z [T, H*V], w [V]) -> per head: o * rsqrt(mean(o^2)+eps) * w * sigmoid(z)
    MLA_ATTN,       // (q [T, H*(dn+dr)], c [T, L] normed latent, kr [T, dr], kv_b [H*(dn+dv), L],
                    //  cache [n_pages, page_size, L+dr], sel I32 [T, topk] | none) -> [T, H*dv]
                    //  First writes [c | kr] of every token into its sequence's pages (batch block
                    //  tables), then for each token t at position pos attends causally over positions
                    //  0..pos of its own sequence: k_h(s) = [W_UK_h c_s | kr_s] (kr shared by all heads,
                    //  never rotated), v_h(s) = W_UV_h c_s, score = q_h . k_h * p.scale, softmax in fp32.
                    //  With sel, only the listed positions (-1 = unused) are attended (K3.1).
    INDEXER_TOPK,   // (qi [T, I*d], ki [T, d], wi [T, I], kcache [n_pages, page_size, d]) -> sel I32 [T, topk]
                    //  Writes ki into the pages, then per token: score(s) = p.scale * sum_h wi_h *
                    //  relu(qi_h . k(s)) over s in 0..pos. If pos+1 <= topk every position is selected.
                    //  Otherwise theta = the topk-th largest score; the set is {score > theta} then
                    //  {score == theta} by ascending position, cut at topk. Output sorted ascending,
                    //  padded with -1.
    MOE_ROUTE,      // (x [T, D], gate_w [E, D], bias [E] F32 | none) -> out0 ids I32 [T, k], out1 w F32 [T, k]
                    //  logits in fp32 (upcast x and W); scores = sigmoid (or softmax) of the logits;
                    //  selection by scores + bias, grouped top-k when n_group > 1 (group score = sum of
                    //  its top-2 biased scores, keep topk_group groups); weights = the RAW scores of the
                    //  selected experts, renormalised (sum + 1e-20) when p.renormalize, times p.scale.
                    //  Ids are in descending order of biased score, ties to the lower id.
    MOE_EXPERTS,    // (x [T, Din], ids I32 [T, k], w F32 [T, k]) + p.experts -> [T, Dout]
                    //  out_t = sum_j w[t,j] * down_e( act(gate_e x_t, up_e x_t) ), e = ids[t,j], summed
                    //  in fp32. Expert matrices are BF16/F32 or MXFP4 (decoded by quant/mxfp4 _ref).
                    //  p.bf16_inputs: x and each act(...) row are rounded to bf16 (nearest even) before the
                    //  matrices read them (ARCHITECTURE §3.0: bf16 Linear inputs, the SiTU-GLU output bf16)
    ATTN_RES_MIX,   // (cand_0 .. cand_{n-1} [T, D], norm_w [D], proj_w [1, D]) -> [T, D]
                    //  Block Attention Residuals: w = norm_w * proj_w; s_i = sum_c v_i[c] rsqrt(mean(v_i^2)+eps) w[c];
                    //  alpha = softmax_i(s); out = sum_i alpha_i v_i (the RAW candidates). Only the
                    //  candidates passed are mixed (no padding to a fixed capacity).
    COUNT,
};

std::string_view op_name(op_type op);

} // namespace perigee
