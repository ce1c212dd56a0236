// Backend-level fusions of the CUDA decode step, planned over the unchanged graph (the graph and the CPU reference
// stay the single definition of the math). Host-only and header-only: the backend plans each run with it, and
// bench-cuda-decode --dry counts what it folds on a machine without a GPU.
//
// Rules (each behind a cuda_options switch):
// None applies to a step with bf16 GEMM inputs (op_params::bf16_inputs: forward_options::bf16_inputs_min_tokens).
//   linear_group      LINEARs on the GEMV path over the same input, same weight dtype and width: one launch of up to
//                     k_group_max weight pointers, at the first of them (the others are "done by" it).
//   fuse_norm_linear  RMS_NORM over whole rows [T, N] whose output feeds LINEAR(s) on the GEMV path (K == N): the norm
//                     node launches those LINEARs itself (grouped as above, by weight dtype); each resident block
//                     stages x' = x * inv_rms * w in shared memory once and runs the plain GEMV loop over it
//                     (fuse_norm_staged; the round-1 in-warp prologue otherwise); the same launch writes the norm's
//                     output for the other consumers and for node-by-node comparison. The norm kernel launch is
//                     removed. Kept (not folded): min(T, 8) * K * 4 > 47 KiB (the stage), or the LINEARs' weights
//                     > fuse_norm_max_weight_bytes (256 MiB: one launch saved is not worth a risk on a long pass). The LINEARs run at the norm's
//                     position (earlier than in the graph): their only input is the norm's output, and weights are
//                     bound on demand.
//   fuse_add          ADD(y, r) with y the output of a LINEAR on the GEMV path (any of the above or a single one):
//                     the GEMV epilogue writes y and y + r; a second ADD(y + r, r2) chains (y + r + r2, e.g. the
//                     shared expert's down projection -> ffn_moe_out -> l_out). Only when r is computed before the
//                     LINEAR's launch position. float addition commutes bitwise, so y + r is the CPU's value.
//   fuse_conv_l2      L2_NORM per head (N % 32 == 0, N <= 1024, N | C) of a SHORT_CONV's output [T, C], T <= 8 (decode):
//                     the conv kernel normalizes each head's outputs in the same launch (fuse-conv.cu) and writes both
//                     outputs; the L2_NORM launch is removed (the KDA q/k path: 2 launches per KDA layer).
//   fuse_sigmoid      SIGMOID(y) with y the output of a LINEAR on the GEMV path: the GEMV epilogue writes y and sigmoid(y)
//                     (the KDA beta = sigmoid(b_proj h): 1 launch per KDA layer); the SIGMOID launch is removed.
//   fuse_mla_kv       The MLA kv_a split (forward.cpp mla_block): a = COLS(x, 0, L), c = RMS_NORM(a) over whole rows of L,
//                     r = COLS(x, L, W - L) with x [T, W] F32: one launch at a's position (mla.cu k_mla_kv_split) writes
//                     a, c and r; the RMS_NORM and the second COLS launches are removed (2 launches per MLA layer). Only
//                     when every consumer of c and r comes after a (they are computed earlier than in the graph).
//   fuse_kda_decode   The KDA block's decode tail (forward.cpp kda_block), at most 8 tokens, K = V in {32, 64, 128},
//                     conv width 4:
//                     SHORT_CONV q/k/v, the L2_NORMs of q and k, LINEAR f_b (BF16, rank <= 128, folded when its input
//                     is ready; else f is an input), KDA_GATE, LINEAR g_b (same; K3's full-rank g_proj: z is an input),
//                     KDA_SCAN and the GATED_RMS_NORM: one launch at the GATED_RMS_NORM's position (kda-fused-decode.cu)
//                     writes every one of their outputs; 7-9 launches removed per KDA layer. Only when each folded
//                     node's consumers are folded too or come after that position, and no input is computed later.
//   moe_shared_slot   (planned FIRST, so the rules above never see its nodes) MOE_EXPERTS with T == 1, every expert dense
//                     BF16, on the grouped BF16 decode pair (moe_grouped, moe_decode_bf16, E <= 1024, widths of
//                     cuda::moe_bf16_shared_supported), whose output y meets a shared expert in ADD(y, s) (forward.cpp
//                     moe_block, non-latent): s = LINEAR down(GLU(LINEAR gate(x), LINEAR up(x))) over the SAME input node x
//                     as the experts, BF16 [F, Din] / [F, Din] / [Dout, F] at the experts' widths, GLU = SILU_MUL (act
//                     SiLU) or SITU_MUL with the experts' betas. One launch pair at the MOE_EXPERTS node
//                     (moe-bf16-decode.cu, the shared expert as slot k) writes y, the gate/up/GLU/down outputs, the ADD
//                     and, when the ADD's only consumer is a second ADD(sum, r2) with r2 computed before, that one too
//                     (l_out). The shared gate/up thereby leave the post-attention norm's GEMV group (the norm runs: the
//                     router and the experts read it). Refused (nothing folded) when a folded node has a consumer outside
//                     the group placed before the launch, an input computed after it, an output other than 0 read, a
//                     dtype or width outside the kernel, or when the ADD's other operand is not y.
//   moe_layer_fused   (planned right after moe_shared_slot) a MOE_EXPERTS launch with its shared slot whose input x is
//                     RMS_NORM(x0) over whole rows and whose ids / weights are outputs 0 / 1 of a MOE_ROUTE over the same
//                     x, at the widths of cuda::moe_layer_decode_supported (the 48B block: D 2304, d_ff 1024, top-8
//                     sigmoid of <= 256 without group pruning, BF16 router): the norm and the route join that launch,
//                     which becomes one persistent kernel (moe-layer-decode.cu) writing every folded node's outputs.
//                     Only when every consumer of the norm's and the route's outputs is folded or comes after the
//                     launch, and the router is a 2-D BF16 WEIGHT [E, D].
//   kda_oproj_fused   (after fuse_kda_decode, which it extends) one token: the fused KDA tail's gated-norm output [1, C]
//                     whose only consumer is a BF16 LINEAR on the GEMV path (o_proj, widths of
//                     cuda::kda_oproj_fused_supported_shape: the 48B's 32 heads of 128) launching itself alone or with
//                     rule 4's ADDs: that LINEAR and its ADDs join the tail's launch, which becomes one persistent kernel
//                     (kda-fused-decode.cu k_kda_oproj_d1). Only when the ADDs' other operands exist at the tail's
//                     position.
#pragma once
#include "backend/cuda/backend-cuda.h"
#include "ir/graph.h"

#include <algorithm>
#include <vector>

namespace perigee::cuda {
// moe-bf16-decode.cu (also declared in cuda-ops.h): whether the shared slot runs for these widths. The planner calls the
// kernel file's own rule so the two cannot drift; declared here to keep this header free of CUDA headers.
bool moe_bf16_shared_supported(int64_t Din, int64_t d_ff, int64_t d_out, int64_t k);
// moe-layer-decode.cu: whether the one-launch MoE block runs for these widths and this route (moe_layer_fused).
// kda-fused-decode.cu: whether the KDA tail's launch can also compute the o_proj rows for these widths (kda_oproj_fused).
bool kda_oproj_fused_supported_shape(int64_t H, int64_t K, int64_t V, int64_t D);
bool moe_layer_decode_supported_shape(int64_t D, int64_t d_ff, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                                      bool softmax);
} // namespace perigee::cuda

namespace perigee::cuda_fuse {

inline constexpr int k_group_max = 8;   // = cuda::k_gemv_group_max (cuda-ops.h)
inline constexpr int64_t k_norm_stage_max = 47 * 1024;    // = cuda::k_gemv_norm_stage_max (fuse-ops.h)

// One LINEAR of a launch and the ADDs its epilogue writes (chain: add[0] = y + res[0], add[1] = add[0] + res[1]).
struct seg {
    int linear = -1;
    int add[2] = {-1, -1};
    node_ref res[2];
    int sig = -1;   // a SIGMOID over the LINEAR's output, written by the epilogue (fuse_sigmoid)
    bool route = false;   // `linear` is a MOE_ROUTE: the segment writes its router logits (fuse_norm_route), not outputs
};
// The kernels launched at one node: groups of segments (one launch each, one weight dtype per group); norm >= 0: the
// RMS_NORM whose prologue is folded into every group (the first group writes its output).
struct launch {
    int norm = -1;
    std::vector<std::vector<seg>> groups;
    bool empty() const { return groups.empty(); }
};

// The nodes one fused KDA decode launch computes (fuse_kda_decode), launched at the GATED_RMS_NORM node.
struct kda_fold {
    int conv[3] = {-1, -1, -1};   // SHORT_CONV q, k, v
    int l2[2] = {-1, -1};         // L2_NORM of q, k
    int f_b = -1;                 // LINEAR f_b (-1: f is an input of the launch)
    int gate = -1;                // KDA_GATE
    int g_b = -1;                 // LINEAR g_b (-1: z is an input)
    int scan = -1;                // KDA_SCAN
    int n() const { return 7 + (f_b >= 0) + (g_b >= 0); }
};

// The nodes one MOE_EXPERTS launch computes with the shared expert as its extra slot (moe_shared_slot), launched at the
// MOE_EXPERTS node.
struct moe_shared_fold {
    int gate = -1, up = -1;   // LINEARs gate_proj / up_proj of the shared expert
    int act = -1;             // SILU_MUL / SITU_MUL
    int down = -1;            // LINEAR down_proj
    int add = -1;             // ADD(y, down)
    int add2 = -1;            // ADD(add, res2) (l_out), -1: not folded
    node_ref res2;
    int n() const { return 5 + (add2 >= 0); }
};

struct plan {
    std::vector<int> done_by;        // per node: the node at whose position its output is computed; -1: its own
    std::vector<launch> at;          // per node: the fused launches it issues (empty: its ordinary kernel)
    int linear_grouped = 0;          // LINEARs launched together with an earlier LINEAR of the same launch
    int norms = 0;                   // RMS_NORM launches removed (folded into a GEMV)
    int adds = 0;                    // ADD launches removed (written by a GEMV epilogue)
    std::vector<int> conv_l2;        // per SHORT_CONV node: the L2_NORM its launch also computes (-1: none)
    int conv_l2s = 0;                // L2_NORM launches removed (computed by their SHORT_CONV's launch)
    int sigmoids = 0;                // SIGMOID launches removed (written by their LINEAR's GEMV epilogue)
    std::vector<int> mla_kv_norm;    // per COLS node: the RMS_NORM its k_mla_kv_split launch also computes (-1: none)
    std::vector<int> mla_kv_rope;    // ... and the second COLS (the rope columns)
    int mla_kvs = 0;                 // kv_a splits folded (2 launches removed each)
    std::vector<kda_fold> kda;       // per GATED_RMS_NORM node: the KDA tail its launch computes (scan < 0: none)
    int kda_decodes = 0;             // fused KDA decode launches
    int kda_launches = 0;            // launches they remove (conv_l2's folded L2_NORMs not counted twice)
    std::vector<seg> kda_oproj;      // per GATED_RMS_NORM node with a KDA fold: the o_proj LINEAR (and its epilogue ADDs)
                                     // that launch also computes (linear < 0: none; kda_oproj_fused)
    int kda_oprojs = 0;              // o_proj launches folded so (one launch removed each)
    std::vector<moe_shared_fold> moe_shared;   // per MOE_EXPERTS node: the shared expert its launch computes (add < 0: none)
    int moe_shareds = 0;             // MOE_EXPERTS launches with the shared slot
    int moe_shared_launches = 0;     // node launches they remove (gate, up, GLU, down, ADD, chained ADD)
    // per MOE_EXPERTS node: 1 when its launch also computes the RMS_NORM producing its input (src 0) and the MOE_ROUTE
    // producing its ids / weights (src 1 / 2) (moe_layer_fused)
    std::vector<char> moe_layer;
    int moe_layers = 0;              // one-launch MoE blocks (each removes the norm's and the route's node launches)
    std::vector<int> route_by;       // per MOE_ROUTE node: the RMS_NORM whose launch computes its logits (-1: its own GEMV)
    int routes = 0;                  // router GEMV launches folded into a norm's launch (their logits one more segment)
    int norms_kept_stage = 0;        // foldable norms kept: min(T, 8) rows of x' exceed the shared-memory stage
    int norms_kept_big = 0;          // foldable norms kept: their LINEARs' weights exceed fuse_norm_max_weight_bytes
    int launches_saved() const {
        return linear_grouped + norms + adds + conv_l2s + sigmoids + 2 * mla_kvs + kda_launches + moe_shared_launches + routes +
               2 * moe_layers + kda_oprojs;
    }
};

// Whether a LINEAR of T tokens over rows of K columns runs on the GEMV path (the rule of cuda-backend.cpp run_linear and
// of the planner): T <= gemv_max_tokens and, from 3 tokens, T x K <= gemv_max_elems (0: no bound); F16 weights any T.
inline bool gemv_takes(const cuda_options & o, int64_t T, int64_t K, bool f16) {
    if (f16) return true;
    if (T > o.gemv_max_tokens) return false;
    return T <= 2 || o.gemv_max_elems <= 0 || T * K <= o.gemv_max_elems;
}

// A LINEAR on the GEMV path (gemv_takes): 2-D input [T, K], 2-D BF16/F16/F32 WEIGHT leaf [O, K].
inline bool gemv_linear(const graph & g, const node & n, const cuda_options & o, dtype & wt, int64_t & K) {
    if (n.op != op_type::LINEAR || n.src.size() < 2 || !n.src[0].valid() || !n.src[1].valid()) return false;
    const node & wn = g.nodes[size_t(n.src[1].node)];
    if (wn.op != op_type::WEIGHT || !wn.leaf || wn.leaf->shape.size() != 2) return false;
    const auto & xs = g.out(n.src[0]).shape;
    if (xs.size() != 2 || g.out(n.src[0]).type != dtype::F32) return false;
    wt = wn.leaf->type;
    if (wt != dtype::BF16 && wt != dtype::F16 && wt != dtype::F32) return false;
    if (!gemv_takes(o, xs[0], xs[1], wt == dtype::F16)) return false;
    K = xs[1];
    return wn.leaf->shape[1] == K;
}

// Input i of n absent, or a WEIGHT leaf of `numel` F32 / BF16 / F16 values (a norm's weight, a route's bias).
inline bool float_leaf_or_none(const graph & g, const node & n, size_t i, int64_t numel) {
    if (n.src.size() <= i || !n.src[i].valid()) return true;
    const node & wn = g.at(n.src[i]);
    if (wn.op != op_type::WEIGHT || !wn.leaf || wn.leaf->numel() != numel) return false;
    const dtype t = wn.leaf->type;
    return t == dtype::F32 || t == dtype::BF16 || t == dtype::F16;
}

// The position at which node j's output is computed under plan p: the node whose launch computes it, else j itself.
inline int at_pos(const plan & p, int j) { return p.done_by[size_t(j)] >= 0 ? p.done_by[size_t(j)] : j; }

// The same output of the same node.
inline bool same(node_ref a, node_ref b) { return a.node == b.node && a.out == b.out; }

// A MOE_ROUTE whose logits the backend computes by a GEMV followed by the selection (cuda-backend.cpp MOE_ROUTE: the
// "GEMV, then the selection" branch, the only one taken under these options): input [T, K] F32 with T <= gemv_max_tokens
// and below the prefill GEMM router's threshold, a 2-D BF16/F16/F32 WEIGHT gate [E, K], E <= 1024, the one-launch routes
// off. Rule fuse_norm_route may then compute its logits as one more segment of a norm's launch.
inline bool gemv_route(const graph & g, const node & n, const cuda_options & o, dtype & wt, int64_t & K) {
    if (n.op != op_type::MOE_ROUTE || n.src.size() < 2 || !n.src[0].valid() || !n.src[1].valid()) return false;
    if (!o.moe_route_fast || !(o.moe_select_radix || o.moe_select_sort || o.moe_select_warp) || o.moe_route_fused ||
        o.moe_route_fused_radix)
        return false;
    const node & wn = g.nodes[size_t(n.src[1].node)];
    if (wn.op != op_type::WEIGHT || !wn.leaf || wn.leaf->shape.size() != 2 || wn.leaf->shape[0] > 1024) return false;
    const auto & xs = g.out(n.src[0]).shape;
    if (xs.size() != 2 || g.out(n.src[0]).type != dtype::F32 || xs[0] > o.gemv_max_tokens) return false;
    if (o.moe_route_gemm_tokens > 0 && xs[0] >= o.moe_route_gemm_tokens) return false;
    wt = wn.leaf->type;
    if (wt != dtype::BF16 && wt != dtype::F16 && wt != dtype::F32) return false;
    K = xs[1];
    return wn.leaf->shape[1] == K;
}

// Rule moe_shared_slot (see the header), planned before the others: fills p.moe_shared / done_by for each MOE_EXPERTS
// node whose launch can take its shared expert as an extra slot. cons: consumers of output 0 of each node.
inline void plan_moe_shared(const graph & g, const std::vector<std::vector<int>> & cons, plan & p) {
    const size_t N = g.nodes.size();
    auto free_node = [&](int j) { return p.done_by[size_t(j)] < 0 && p.at[size_t(j)].empty() && p.moe_shared[size_t(j)].add < 0; };
    auto f32_row = [&](const node_output & t, int64_t C) {
        return t.type == dtype::F32 && t.shape.size() == 2 && t.shape[0] == 1 && t.shape[1] == C;
    };
    // LINEAR j over exactly x, with W a 2-D BF16 WEIGHT leaf [O, I] and output [1, O] F32
    auto bf16_linear = [&](int j, node_ref x, int64_t O, int64_t I) {
        const node & l = g.nodes[size_t(j)];
        if (l.op != op_type::LINEAR || l.src.size() < 2 || !l.src[1].valid() || !same(l.src[0], x)) return false;
        const node & wn = g.at(l.src[1]);
        return wn.op == op_type::WEIGHT && wn.leaf && wn.leaf->type == dtype::BF16 && wn.leaf->shape.size() == 2 &&
               wn.leaf->shape[0] == O && wn.leaf->shape[1] == I && f32_row(l.outs.at(0), O);
    };
    for (size_t e = 0; e < N; ++e) {
        const node & m = g.nodes[e];
        if (m.op != op_type::MOE_EXPERTS || !free_node(int(e)) || m.src.size() < 3 || !m.p.experts || m.p.experts->empty())
            continue;
        const node_ref x = m.src[0];
        if (!x.valid() || !m.src[1].valid() || g.out(x).shape.size() != 2) continue;
        const int64_t Din = g.out(x).shape[1];
        if (!f32_row(g.out(x), Din) || m.outs.empty() || m.outs[0].shape.size() != 2) continue;   // T == 1
        const int64_t Dout = m.outs[0].shape[1];
        const auto & idt = g.out(m.src[1]);
        if (!f32_row(m.outs[0], Dout) || idt.shape.size() != 2 || idt.shape[0] != 1) continue;
        const int64_t k = idt.shape[1];
        // the routed experts: every matrix dense BF16, one width (what the BF16 decode pair reads)
        const auto & ex = *m.p.experts;
        const int64_t F = ex[0].gate.out;
        bool ok = ex.size() <= 1024;
        for (const expert_weights & w : ex) {
            for (const expert_matrix * mm : {&w.gate, &w.up, &w.down})
                ok &= mm->format == fp4_format::NONE && mm->weight && mm->weight->type == dtype::BF16;
            ok &= w.gate.out == F && w.gate.in == Din && w.up.out == F && w.up.in == Din && w.down.out == Dout && w.down.in == F;
        }
        if (!ok || !cuda::moe_bf16_shared_supported(Din, F, Dout, k)) continue;
        // ADD(y, s) with s = down(GLU(gate(x), up(x))): the first ADD over y whose other operand has that shape
        moe_shared_fold f;
        for (int j : cons[e]) {
            const node & a = g.nodes[size_t(j)];
            if (a.op != op_type::ADD || a.src.size() != 2 || !free_node(j) || !f32_row(a.outs.at(0), Dout)) continue;
            for (int side = 0; side < 2 && f.add < 0; ++side) {
                const node_ref yr = a.src[size_t(side)], sr = a.src[size_t(1 - side)];
                if (!same(yr, node_ref{int(e), 0}) || !sr.valid() || sr.out != 0 || sr.node == int(e)) continue;
                const node & dn = g.nodes[size_t(sr.node)];
                if (dn.op != op_type::LINEAR || dn.src.empty() || !dn.src[0].valid() || dn.src[0].out != 0) continue;
                const int act = dn.src[0].node;
                const node & an = g.nodes[size_t(act)];
                const bool glu_ok = m.p.act == glu_act::SILU
                                        ? an.op == op_type::SILU_MUL
                                        : an.op == op_type::SITU_MUL && an.p.situ_beta == m.p.situ_beta &&
                                              an.p.situ_linear_beta == m.p.situ_linear_beta;
                if (!glu_ok || an.src.size() != 2 || !an.src[0].valid() || !an.src[1].valid() || an.src[0].out != 0 ||
                    an.src[1].out != 0 || an.src[0].node == an.src[1].node || !f32_row(an.outs.at(0), F))
                    continue;
                if (!bf16_linear(sr.node, node_ref{act, 0}, Dout, F) || !bf16_linear(an.src[0].node, x, F, Din) ||
                    !bf16_linear(an.src[1].node, x, F, Din))
                    continue;
                f = moe_shared_fold{an.src[0].node, an.src[1].node, act, sr.node, j, -1, {}};
            }
            if (f.add >= 0) break;
        }
        if (f.add < 0) continue;
        // the chained residual ADD (l_out): the sum's only consumer, its other operand computed before the launch
        if (cons[size_t(f.add)].size() == 1) {
            const int j = cons[size_t(f.add)][0];
            const node & a2 = g.nodes[size_t(j)];
            if (a2.op == op_type::ADD && a2.src.size() == 2 && free_node(j) && f32_row(a2.outs.at(0), Dout))
                for (int side = 0; side < 2; ++side) {
                    const node_ref sr = a2.src[size_t(side)], rr = a2.src[size_t(1 - side)];
                    if (!same(sr, node_ref{f.add, 0}) || !rr.valid() || rr.node == f.add || !f32_row(g.out(rr), Dout)) continue;
                    if (at_pos(p, rr.node) >= int(e)) continue;
                    f.add2 = j;
                    f.res2 = rr;
                    break;
                }
        }
        std::vector<int> set{f.gate, f.up, f.act, f.down, f.add};
        if (f.add2 >= 0) set.push_back(f.add2);
        auto in_set = [&](int j) { return j == int(e) || std::find(set.begin(), set.end(), j) != set.end(); };
        for (int j : set) {
            ok &= free_node(j);
            for (int u : cons[size_t(j)]) ok &= in_set(u) || at_pos(p, u) > int(e);   // consumers: folded or after the launch
            for (const node_ref & r : g.nodes[size_t(j)].src)   // inputs from outside: computed before the launch
                if (r.valid() && !in_set(r.node)) ok &= at_pos(p, r.node) < int(e) || g.nodes[size_t(r.node)].op == op_type::WEIGHT;
        }
        for (size_t j = 0; j < N && ok; ++j)   // outputs other than 0 of a folded node: none exist for these ops
            for (const node_ref & r : g.nodes[j].src)
                if (r.valid() && r.out != 0 && r.node != int(e) && in_set(r.node)) ok = false;
        if (!ok) continue;
        for (int j : set) p.done_by[size_t(j)] = int(e);
        p.moe_shared[e] = f;
        ++p.moe_shareds;
        p.moe_shared_launches += f.n();
    }
}

// Rule moe_layer_fused (see the header), planned right after moe_shared_slot: fills p.moe_layer / done_by for each
// MOE_EXPERTS node with a shared slot whose norm and route can join its launch.
inline void plan_moe_layer(const graph & g, plan & p) {
    const size_t N = g.nodes.size();
    for (size_t e = 0; e < N; ++e) {
        if (p.moe_shared[e].add < 0) continue;
        const node & m = g.nodes[e];
        const node_ref x = m.src[0], ir = m.src[1], wr = m.src.size() > 2 ? m.src[2] : node_ref{};
        if (!x.valid() || x.out != 0 || !ir.valid() || !wr.valid() || ir.node != wr.node || ir.out != 0 || wr.out != 1) continue;
        const int ni = x.node, ri = ir.node;
        const node & nn = g.nodes[size_t(ni)];
        const node & rn = g.nodes[size_t(ri)];
        if (nn.op != op_type::RMS_NORM || rn.op != op_type::MOE_ROUTE || p.done_by[size_t(ni)] >= 0 || p.done_by[size_t(ri)] >= 0 ||
            !p.at[size_t(ni)].empty() || !p.at[size_t(ri)].empty())
            continue;
        // the norm: whole rows of one token, F32 input, its weight a WEIGHT leaf of D floats (or none)
        if (nn.src.empty() || !nn.src[0].valid()) continue;
        const auto & xs = g.out(nn.src[0]);
        if (xs.type != dtype::F32 || xs.shape.size() != 2 || xs.shape[0] != 1 || nn.p.n != xs.shape[1]) continue;
        const int64_t D = xs.shape[1];
        if (!float_leaf_or_none(g, nn, 1, D)) continue;
        // the route over the same x: BF16 router [E, D], its bias a WEIGHT leaf of E floats (or none)
        if (rn.src.size() < 2 || !same(rn.src[0], x) || !rn.src[1].valid()) continue;
        const node & gw = g.at(rn.src[1]);
        if (gw.op != op_type::WEIGHT || !gw.leaf || gw.leaf->type != dtype::BF16 || gw.leaf->shape.size() != 2 ||
            gw.leaf->shape[1] != D)
            continue;
        const int64_t E = gw.leaf->shape[0];
        if (!float_leaf_or_none(g, rn, 2, E)) continue;
        const auto & ex = *m.p.experts;
        if (int64_t(ex.size()) != E ||
            !cuda::moe_layer_decode_supported_shape(D, ex[0].gate.out, E, rn.p.topk, rn.p.n_group, rn.p.topk_group,
                                                    rn.p.router == router_act::SOFTMAX) ||
            m.outs.at(0).shape.at(1) != D)
            continue;
        // every consumer of the norm's and the route's outputs folded into this launch or after it
        bool ok = true;
        for (size_t j = 0; j < N && ok; ++j) {
            if (int(j) == ri || int(j) == int(e) || p.done_by[j] == int(e)) continue;
            for (const node_ref & r : g.nodes[j].src)
                if (r.valid() && (r.node == ni || r.node == ri) && at_pos(p, int(j)) <= int(e)) ok = false;
        }
        if (!ok) continue;
        p.done_by[size_t(ni)] = int(e);
        p.done_by[size_t(ri)] = int(e);
        p.moe_layer[e] = 1;
        ++p.moe_layers;
    }
}

inline plan plan_fusions(const graph & g, const cuda_options & o) {
    const size_t N = g.nodes.size();
    plan p;
    p.done_by.assign(N, -1);
    p.at.assign(N, {});
    p.conv_l2.assign(N, -1);
    p.mla_kv_norm.assign(N, -1);
    p.mla_kv_rope.assign(N, -1);
    p.kda.assign(N, {});
    p.kda_oproj.assign(N, {});
    p.moe_shared.assign(N, {});
    p.moe_layer.assign(N, {});
    p.route_by.assign(N, -1);

    // A step whose GEMM inputs are rounded to bf16 (op_params::bf16_inputs) runs unfused: the fused launches read the
    // LINEARs' and experts' fp32 inputs.
    for (const node & n : g.nodes)
        if (n.p.bf16_inputs) return p;

    // consumers of output 0 of each node, in graph order
    std::vector<std::vector<int>> cons(N);
    for (size_t i = 0; i < N; ++i)
        for (const node_ref & r : g.nodes[i].src)
            if (r.valid() && r.out == 0 && (cons[size_t(r.node)].empty() || cons[size_t(r.node)].back() != int(i)))
                cons[size_t(r.node)].push_back(int(i));

    // 0. the shared expert as a slot of the routed experts' launch (before the rules that would claim its nodes)
    if (o.moe_shared_slot && o.moe_grouped && o.moe_decode_bf16) plan_moe_shared(g, cons, p);
    // 0b. the norm and the route into that launch: one persistent kernel per MoE block
    if (o.moe_layer_fused && o.moe_shared_slot && o.moe_grouped && o.moe_decode_bf16) plan_moe_layer(g, p);

    // LINEARs (in order) -> launches of at most k_group_max, one weight dtype each (first-seen dtype order)
    auto groups_of = [&](const std::vector<int> & lins) {
        std::vector<std::vector<seg>> out;
        std::vector<dtype> types;
        for (int j : lins) {
            const dtype t = g.nodes[size_t(g.nodes[size_t(j)].src[1].node)].leaf->type;
            if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
        }
        for (dtype t : types) {
            std::vector<seg> cur;
            for (int j : lins) {
                if (g.nodes[size_t(g.nodes[size_t(j)].src[1].node)].leaf->type != t) continue;
                cur.push_back(seg{j, {-1, -1}, {}});
                if (int(cur.size()) == k_group_max) out.push_back(std::move(cur)), cur.clear();
            }
            if (!cur.empty()) out.push_back(std::move(cur));
        }
        return out;
    };

    // 1. RMS_NORM -> LINEAR(s)
    if (o.fuse_norm_linear) {
        for (size_t i = 0; i < N; ++i) {
            const node & n = g.nodes[i];
            if (n.op != op_type::RMS_NORM || n.src.empty() || !n.src[0].valid() || p.done_by[i] >= 0) continue;
            const auto & xs = g.out(n.src[0]).shape;
            if (xs.size() != 2 || n.p.n != xs[1] || g.out(n.src[0]).type != dtype::F32) continue;   // whole rows only
            if (!float_leaf_or_none(g, n, 1, xs[1])) continue;
            std::vector<int> lins;
            for (int j : cons[i]) {
                dtype wt;
                int64_t K;
                const node & m = g.nodes[size_t(j)];
                if (p.done_by[size_t(j)] < 0 && gemv_linear(g, m, o, wt, K) && same(m.src[0], node_ref{int(i), 0}) &&
                    K == xs[1])
                    lins.push_back(j);
                // fuse_norm_route: the router's logits as one more segment (the MOE_ROUTE still selects at its position)
                if (o.fuse_norm_route && p.done_by[size_t(j)] < 0 && gemv_route(g, m, o, wt, K) &&
                    same(m.src[0], node_ref{int(i), 0}) && K == xs[1])
                    lins.push_back(j);
            }
            // fuse_norm_route: a router joins a launch of LINEARs of its gate's dtype only (one launch fewer). Alone with
            // the norm (the 48B post-attention norm) it measured neutral (session 8 call D: 48B B=1 2.385 -> 2.389 ms);
            // the K3 form (with the shared gate/up) paid: k3-layers-4 2.466 -> 2.421 ms.
            const auto wdtype = [&](int j) { return g.at(g.nodes[size_t(j)].src[1]).leaf->type; };
            lins.erase(std::remove_if(lins.begin(), lins.end(),
                                      [&](int j) {
                                          return g.nodes[size_t(j)].op == op_type::MOE_ROUTE &&
                                                 std::none_of(lins.begin(), lins.end(), [&](int l) {
                                                     return g.nodes[size_t(l)].op == op_type::LINEAR && wdtype(l) == wdtype(j);
                                                 });
                                      }),
                       lins.end());
            if (lins.empty()) continue;
            // the staged prologue holds min(T, 8) rows of x' in shared memory (linear.cu); past that, keep the norm
            if (o.fuse_norm_staged && (std::min<int64_t>(xs[0], 8) * xs[1] * 4 > k_norm_stage_max || xs[1] % 4 != 0)) {
                ++p.norms_kept_stage;
                continue;
            }
            int64_t wbytes = 0;
            for (int j : lins) {
                const tensor & wl = *g.nodes[size_t(g.nodes[size_t(j)].src[1].node)].leaf;
                wbytes += wl.numel() * dtype_bits(wl.type) / 8;
            }
            if (wbytes > o.fuse_norm_max_weight_bytes) {   // a launch saved is not worth the risk on a long pass
                ++p.norms_kept_big;
                continue;
            }
            p.at[i].norm = int(i);
            p.at[i].groups = groups_of(lins);
            for (auto & gr : p.at[i].groups) {   // every group holds a LINEAR (routes join their dtype's group only)
                int n_lin = 0;
                for (auto & sg : gr) {
                    sg.route = g.nodes[size_t(sg.linear)].op == op_type::MOE_ROUTE;
                    n_lin += !sg.route;
                }
                p.linear_grouped += n_lin - 1;   // launches saved: the LINEARs grouped beyond the first
            }
            for (int j : lins) {
                if (g.nodes[size_t(j)].op == op_type::MOE_ROUTE) {
                    p.route_by[size_t(j)] = int(i);
                    ++p.routes;
                } else {
                    p.done_by[size_t(j)] = int(i);
                }
            }
            ++p.norms;
        }
    }

    // 2. LINEARs over the same input (the first one launches the group)
    if (o.linear_group) {
        for (size_t i = 0; i < N; ++i) {
            dtype wt;
            int64_t K;
            if (p.done_by[i] >= 0 || !gemv_linear(g, g.nodes[i], o, wt, K)) continue;
            const node_ref src = g.nodes[i].src[0];
            std::vector<seg> gr{seg{int(i), {-1, -1}, {}}};
            for (size_t j = i + 1; j < N && int(gr.size()) < k_group_max; ++j) {
                const node & m = g.nodes[j];
                dtype wt2;
                int64_t K2;
                if (p.done_by[j] >= 0 || m.op != op_type::LINEAR || !same(m.src[0], src)) continue;
                if (!gemv_linear(g, m, o, wt2, K2) || wt2 != wt || K2 != K) continue;
                gr.push_back(seg{int(j), {-1, -1}, {}});
                p.done_by[j] = int(i);
            }
            if (gr.size() > 1) {
                p.linear_grouped += int(gr.size()) - 1;
                p.at[i].groups.push_back(std::move(gr));
            }
        }
    }

    // 3. SHORT_CONV -> L2_NORM per head (decode)
    if (o.fuse_conv_l2) {
        for (size_t i = 0; i < N; ++i) {
            const node & n = g.nodes[i];
            if (n.op != op_type::SHORT_CONV || n.src.empty() || !n.src[0].valid()) continue;
            const auto & xs = g.out(n.src[0]).shape;
            if (xs.size() != 2 || xs[0] > 8 || g.out(n.src[0]).type != dtype::F32) continue;
            for (int j : cons[i]) {
                const node & m = g.nodes[size_t(j)];
                if (m.op != op_type::L2_NORM || p.done_by[size_t(j)] >= 0 || !same(m.src[0], node_ref{int(i), 0})) continue;
                const int64_t hn = m.p.n;
                if (hn < 32 || hn > 1024 || hn % 32 != 0 || xs[1] % hn != 0) continue;
                p.conv_l2[i] = j;
                p.done_by[size_t(j)] = int(i);
                ++p.conv_l2s;
                break;
            }
        }
    }

    // 4. ADD into the producing GEMV's epilogue
    if (o.fuse_add) {
        auto ready = [&](int node) { return p.done_by[size_t(node)] >= 0 ? p.done_by[size_t(node)] : node; };
        std::vector<int> add_lin(N, -1);   // fused ADD -> its LINEAR
        auto find_seg = [&](int lin) -> seg * {
            for (auto & gr : p.at[size_t(ready(lin))].groups)
                for (auto & s : gr)
                    if (s.linear == lin) return &s;
            return nullptr;
        };
        for (size_t i = 0; i < N; ++i) {
            const node & n = g.nodes[i];
            if (n.op != op_type::ADD || n.src.size() != 2 || !n.src[0].valid() || !n.src[1].valid()) continue;
            if (p.done_by[i] >= 0) continue;   // computed by another launch (moe_shared_slot)
            const int64_t numel = shape_numel(n.outs.at(0).shape);
            int best_side = -1, best_lin = -1, best_slot = -1, best_pos = -1;
            for (int s = 0; s < 2; ++s) {
                const node_ref a = n.src[size_t(s)], r = n.src[size_t(1 - s)];
                if (a.out != 0 || a.node == r.node) continue;
                if (g.out(r).type != dtype::F32 || shape_numel(g.out(r).shape) != numel) continue;
                const node & an = g.nodes[size_t(a.node)];
                int lin = -1, slot = -1;
                dtype wt;
                int64_t K;
                if (an.op == op_type::LINEAR && p.moe_shared[size_t(ready(a.node))].add < 0 &&   // not in a shared-slot launch
                    gemv_linear(g, an, o, wt, K)) {
                    lin = a.node;
                    slot = 0;
                } else if (an.op == op_type::ADD && add_lin[size_t(a.node)] >= 0) {
                    lin = add_lin[size_t(a.node)];
                    slot = 1;
                } else {
                    continue;
                }
                if (shape_numel(g.nodes[size_t(lin)].outs.at(0).shape) != numel) continue;
                const int pos = ready(lin);
                if (ready(r.node) >= pos) continue;   // r must exist when the GEMV runs
                if (const seg * sg = p.at[size_t(pos)].empty() ? nullptr : find_seg(lin)) {
                    if (sg->add[slot] >= 0 || (slot == 1 && sg->add[0] != a.node)) continue;
                } else if (slot != 0) {
                    continue;
                }
                if (pos > best_pos) best_side = s, best_lin = lin, best_slot = slot, best_pos = pos;
            }
            if (best_side < 0) continue;
            seg * sg = find_seg(best_lin);
            if (!sg) {   // a single LINEAR: it launches itself as a one-segment group
                p.at[size_t(best_lin)].groups.push_back({seg{best_lin, {-1, -1}, {}}});
                sg = &p.at[size_t(best_lin)].groups.back().back();
            }
            sg->add[best_slot] = int(i);
            sg->res[best_slot] = n.src[size_t(1 - best_side)];
            p.done_by[i] = best_pos;
            add_lin[i] = best_lin;
            ++p.adds;
        }
    }

    // 5. SIGMOID into the producing GEMV's epilogue
    if (o.fuse_sigmoid) {
        auto ready = [&](int node) { return p.done_by[size_t(node)] >= 0 ? p.done_by[size_t(node)] : node; };
        for (size_t i = 0; i < N; ++i) {
            const node & n = g.nodes[i];
            if (n.op != op_type::SIGMOID || n.src.size() != 1 || !n.src[0].valid() || n.src[0].out != 0) continue;
            const int lin = n.src[0].node;
            dtype wt;
            int64_t K;
            if (!gemv_linear(g, g.nodes[size_t(lin)], o, wt, K)) continue;
            if (n.outs.at(0).type != dtype::F32 || shape_numel(n.outs.at(0).shape) != shape_numel(g.nodes[size_t(lin)].outs.at(0).shape))
                continue;
            const int pos = ready(lin);
            seg * sg = nullptr;
            for (auto & gr : p.at[size_t(pos)].groups)
                for (auto & s : gr)
                    if (s.linear == lin) sg = &s;
            if (!sg) {
                if (pos != lin) continue;   // a LINEAR done by another launch (a group, or the shared-slot MOE_EXPERTS)
                p.at[size_t(lin)].groups.push_back({seg{lin, {-1, -1}, {}}});
                sg = &p.at[size_t(lin)].groups.back().back();
            }
            if (sg->sig >= 0) continue;
            sg->sig = int(i);
            p.done_by[i] = pos;
            ++p.sigmoids;
        }
    }

    // 6. the MLA kv_a split: COLS(x, 0, L) -> RMS_NORM, COLS(x, L, W - L)
    if (o.fuse_mla_kv) {
        for (size_t i = 0; i < N; ++i) {
            const node & a = g.nodes[i];
            if (a.op != op_type::COLS || p.done_by[i] >= 0 || a.src.empty() || !a.src[0].valid() || a.p.c0 != 0) continue;
            const auto & xs = g.out(a.src[0]).shape;
            if (xs.size() != 2 || g.out(a.src[0]).type != dtype::F32 || a.p.n <= 0 || a.p.n >= xs[1]) continue;
            const int64_t L = a.p.n;
            int rn = -1, rc = -1;
            for (int j : cons[i]) {
                const node & m = g.nodes[size_t(j)];
                if (m.op == op_type::RMS_NORM && p.done_by[size_t(j)] < 0 && p.at[size_t(j)].empty() && m.p.n == L &&
                    same(m.src[0], node_ref{int(i), 0}) && g.out(m.src[0]).type == dtype::F32) {
                    if (m.src.size() > 1 && m.src[1].valid()) {
                        const node & wn = g.at(m.src[1]);
                        if (wn.op != op_type::WEIGHT || !wn.leaf || wn.leaf->numel() != L) continue;
                        const dtype t = wn.leaf->type;
                        if (t != dtype::F32 && t != dtype::BF16 && t != dtype::F16) continue;
                    }
                    rn = j;
                    break;
                }
            }
            if (rn < 0) continue;
            for (size_t j = 0; j < N; ++j) {
                const node & m = g.nodes[j];
                if (j != i && m.op == op_type::COLS && p.done_by[j] < 0 && !m.src.empty() && same(m.src[0], a.src[0]) &&
                    m.p.c0 == L && m.p.n == xs[1] - L) {
                    rc = int(j);
                    break;
                }
            }
            if (rc < 0) continue;
            bool later = true;   // every consumer of c and r after a (computed at a's position)
            for (int j : cons[size_t(rn)]) later &= at_pos(p, j) > int(i);
            for (int j : cons[size_t(rc)]) later &= at_pos(p, j) > int(i);
            for (size_t j = 0; j < N && later; ++j)   // outputs other than 0 are not in cons: none for these ops
                for (const node_ref & r : g.nodes[j].src)
                    if (r.valid() && (r.node == rn || r.node == rc) && r.out != 0) later = false;
            if (!later) continue;
            p.mla_kv_norm[i] = rn;
            p.mla_kv_rope[i] = rc;
            p.done_by[size_t(rn)] = int(i);
            p.done_by[size_t(rc)] = int(i);
            ++p.mla_kvs;
        }
    }

    // 7. the KDA decode tail
    if (o.fuse_kda_decode) {
        auto is = [&](node_ref r, op_type op) { return r.valid() && r.out == 0 && g.nodes[size_t(r.node)].op == op; };
        auto free_node = [&](int j) { return p.done_by[size_t(j)] < 0 && p.at[size_t(j)].empty(); };
        // a BF16 low-rank projection the launch can fold: its only consumer is `user`, rank % 32 == 0 and <= 128
        auto lowrank = [&](node_ref r, int user, int64_t rows) {
            dtype wt;
            int64_t R;
            if (!is(r, op_type::LINEAR) || !free_node(r.node)) return false;
            const node & l = g.nodes[size_t(r.node)];
            if (!gemv_linear(g, l, o, wt, R) || wt != dtype::BF16 || R % 32 != 0 || R > 128) return false;
            if (g.nodes[size_t(l.src[1].node)].leaf->shape[0] != rows) return false;
            return cons[size_t(r.node)].size() == 1 && cons[size_t(r.node)][0] == user;
        };
        auto f32_2d = [&](node_ref r, int64_t T, int64_t C) {
            const auto & t = g.out(r);
            return t.type == dtype::F32 && t.shape.size() == 2 && t.shape[0] == T && t.shape[1] == C;
        };
        for (size_t i = 0; i < N; ++i) {
            const node & nn = g.nodes[i];
            if (nn.op != op_type::GATED_RMS_NORM || !free_node(int(i)) || nn.src.size() < 3) continue;
            if (!is(nn.src[0], op_type::KDA_SCAN) || !nn.src[1].valid() || nn.src[1].out != 0) continue;
            kda_fold kf;
            kf.scan = nn.src[0].node;
            const node & sc = g.nodes[size_t(kf.scan)];
            const int64_t Kh = sc.p.head_dim_k;   // K = V = the gated norm's width, 32 / 64 / 128
            if (!free_node(kf.scan) || sc.src.size() < 6 || (Kh != 32 && Kh != 64 && Kh != 128) || sc.p.head_dim_v != Kh ||
                nn.p.n != Kh)
                continue;
            const int64_t H = sc.p.n_head, C = H * Kh;
            if (H < 1 || !sc.src[0].valid()) continue;
            const int64_t T = g.out(sc.src[0]).shape.empty() ? 0 : g.out(sc.src[0]).shape[0];
            if (T < 1 || T > 8) continue;
            bool ok = is(sc.src[0], op_type::L2_NORM) && is(sc.src[1], op_type::L2_NORM) && is(sc.src[2], op_type::SHORT_CONV) &&
                      is(sc.src[3], op_type::KDA_GATE) && sc.src[4].valid() && f32_2d(sc.src[4], T, H) && f32_2d(nn.src[1], T, C);
            if (!ok) continue;
            for (int q = 0; q < 2 && ok; ++q) {
                const node & l2 = g.nodes[size_t(sc.src[size_t(q)].node)];
                ok = l2.p.n == Kh && is(l2.src[0], op_type::SHORT_CONV) && f32_2d(l2.src[0], T, C);
                kf.l2[q] = sc.src[size_t(q)].node;
                kf.conv[q] = ok ? l2.src[0].node : -1;
            }
            kf.conv[2] = sc.src[2].node;
            ok = ok && kf.conv[0] != kf.conv[1] && kf.conv[2] != kf.conv[0] && kf.conv[2] != kf.conv[1] && kf.l2[0] != kf.l2[1];
            for (int q = 0; q < 3 && ok; ++q) {
                const node & cv = g.nodes[size_t(kf.conv[q])];
                const node & wn = g.at(cv.src[1]);
                ok = cv.src.size() >= 3 && f32_2d(cv.src[0], T, C) && wn.op == op_type::WEIGHT && wn.leaf &&
                     wn.leaf->shape.size() == 3 && wn.leaf->shape[0] == C && wn.leaf->shape[2] == 4;
            }
            kf.gate = sc.src[3].node;
            const node & gt = g.nodes[size_t(kf.gate)];
            ok = ok && gt.p.n_head == H && gt.p.head_dim_k == Kh && gt.src.size() >= 3 && f32_2d(gt.src[0], T, C);
            if (!ok) continue;
            if (lowrank(gt.src[0], kf.gate, C)) kf.f_b = gt.src[0].node;
            if (lowrank(nn.src[1], int(i), C)) kf.g_b = nn.src[1].node;
            std::vector<int> folded{kf.conv[0], kf.conv[1], kf.conv[2], kf.l2[0], kf.l2[1], kf.gate, kf.scan};
            if (kf.f_b >= 0) folded.push_back(kf.f_b);
            if (kf.g_b >= 0) folded.push_back(kf.g_b);
            auto in_set = [&](int j) { return j == int(i) || std::find(folded.begin(), folded.end(), j) != folded.end(); };
            for (int j : folded) {
                // each folded node: not claimed by another fusion (conv_l2 of these convs is taken over below)
                const bool conv_l2_own = (j == kf.conv[0] && p.conv_l2[size_t(j)] == kf.l2[0]) ||
                                         (j == kf.conv[1] && p.conv_l2[size_t(j)] == kf.l2[1]);
                const bool l2_by_conv = (j == kf.l2[0] && p.done_by[size_t(j)] == kf.conv[0]) ||
                                        (j == kf.l2[1] && p.done_by[size_t(j)] == kf.conv[1]);
                ok &= (l2_by_conv || p.done_by[size_t(j)] < 0) && p.at[size_t(j)].empty() &&
                      (conv_l2_own || p.conv_l2[size_t(j)] < 0) && p.mla_kv_norm[size_t(j)] < 0;
                for (int u : cons[size_t(j)]) ok &= in_set(u) || at_pos(p, u) > int(i);   // consumers: folded or later
                // inputs from outside the set: computed before the launch
                for (const node_ref & r : g.nodes[size_t(j)].src)
                    if (r.valid() && !in_set(r.node)) ok &= at_pos(p, r.node) < int(i) || g.nodes[size_t(r.node)].op == op_type::WEIGHT ||
                                                           g.nodes[size_t(r.node)].op == op_type::STATE;
            }
            for (const node_ref & r : nn.src)   // the anchor's own inputs (z when g_b is not folded, o_norm)
                if (r.valid() && !in_set(r.node)) ok &= at_pos(p, r.node) < int(i) || g.nodes[size_t(r.node)].op == op_type::WEIGHT;
            for (size_t j = 0; j < N && ok; ++j)   // outputs other than 0 of a folded node: none expected
                for (const node_ref & r : g.nodes[j].src)
                    if (r.valid() && r.out != 0 && in_set(r.node) && r.node != int(i)) ok = false;
            if (!ok) continue;
            for (int q = 0; q < 2; ++q)
                if (p.conv_l2[size_t(kf.conv[q])] >= 0) p.conv_l2[size_t(kf.conv[q])] = -1, --p.conv_l2s;
            for (int j : folded) p.done_by[size_t(j)] = int(i);
            p.kda[i] = kf;
            ++p.kda_decodes;
            p.kda_launches += kf.n();
        }
    }

    // 7b. the layer's output projection (and the ADDs its GEMV epilogue writes) into that launch (kda_oproj_fused)
    if (o.fuse_kda_decode && o.kda_oproj_fused) {
        for (size_t i = 0; i < N; ++i) {
            if (p.kda[i].scan < 0) continue;
            const node & sc = g.nodes[size_t(p.kda[i].scan)];
            const auto & ys = g.nodes[i].outs.at(0).shape;   // the gated norm's output [T, H * V]
            if (ys.size() != 2 || ys[0] != 1 || cons[i].size() != 1) continue;
            const int L = cons[i][0];
            const node & l = g.nodes[size_t(L)];
            dtype wt;
            int64_t K;
            if (p.done_by[size_t(L)] >= 0 || !gemv_linear(g, l, o, wt, K) || wt != dtype::BF16 ||
                !same(l.src[0], node_ref{int(i), 0}) || K != ys[1])
                continue;
            const int64_t D = g.at(l.src[1]).leaf->shape[0];
            if (!cuda::kda_oproj_fused_supported_shape(sc.p.n_head, sc.p.head_dim_k, sc.p.head_dim_v, D)) continue;
            // the LINEAR launches itself, alone or with the ADDs of rule 4 (no other segment, no norm, no sigmoid)
            seg sg{L, {-1, -1}, {}};
            const launch & la = p.at[size_t(L)];
            if (!la.empty()) {
                if (la.norm >= 0 || la.groups.size() != 1 || la.groups[0].size() != 1 || la.groups[0][0].linear != L ||
                    la.groups[0][0].sig >= 0 || la.groups[0][0].route)
                    continue;
                sg = la.groups[0][0];
            }
            // moved earlier (from L to i): its residual operands must exist by then; outputs other than 0: none read
            bool ok = true;
            for (int k = 0; k < 2; ++k)
                if (sg.add[k] >= 0) ok &= at_pos(p, sg.res[k].node) < int(i) || g.at(sg.res[k]).op == op_type::WEIGHT;
            for (size_t j = 0; j < N && ok; ++j)
                for (const node_ref & r : g.nodes[j].src)
                    if (r.valid() && r.out != 0 && (r.node == L || r.node == sg.add[0] || r.node == sg.add[1])) ok = false;
            if (!ok) continue;
            p.at[size_t(L)] = {};
            p.done_by[size_t(L)] = int(i);
            for (int k = 0; k < 2; ++k)
                if (sg.add[k] >= 0) p.done_by[size_t(sg.add[k])] = int(i);
            p.kda_oproj[i] = sg;
            ++p.kda_oprojs;
        }
    }
    return p;
}

} // namespace perigee::cuda_fuse
