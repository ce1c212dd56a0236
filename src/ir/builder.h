// Graph builder: one function per op, shape inference and checks at build time, named nodes.
// The model code reads like the paper through these calls (STYLE §3.4).
#pragma once
#include "ir/graph.h"

#include <string>

namespace perigee {

class builder {
public:
    explicit builder(std::shared_ptr<const batch> b);

    // Name the last node (or a given node): "blk.<il>.<name>", or "<name>" when il < 0.
    node_ref name(node_ref r, const std::string & nm, int il = -1);

    node_ref ids();
    node_ref weight(const tensor & t, const std::string & nm);
    node_ref state(tensor & t, const std::string & nm);

    node_ref get_rows(node_ref table, node_ref ids);
    node_ref rms_norm(node_ref x, node_ref w, float eps, int64_t n = 0);  // w may be {} (no weight)
    node_ref layer_norm(node_ref x, node_ref w, node_ref b, float eps);
    node_ref l2_norm(node_ref x, float eps, int64_t n);
    node_ref linear(node_ref x, node_ref w);
    node_ref add(node_ref a, node_ref b);
    node_ref mul(node_ref a, node_ref b);
    node_ref scale(node_ref x, float s);
    node_ref sigmoid(node_ref x);
    node_ref silu_mul(node_ref g, node_ref u);
    node_ref situ_mul(node_ref g, node_ref u, float beta, float linear_beta);
    // Keep columns [c0, c0+n) of a 2-D [T, C] input (a copy; used to split fused projections).
    node_ref cols(node_ref x, int64_t c0, int64_t n);
    // Keep the rows batch::logits_rows lists ([R, C]); identity-shaped when the list is empty.
    node_ref select_rows(node_ref x);

    node_ref short_conv(node_ref x, node_ref w, node_ref st);
    node_ref kda_gate(node_ref f, node_ref a_log, node_ref dt_bias, int64_t n_head, int64_t head_dim,
                      float lower_bound);
    struct kda_scan_params { int64_t n_head, head_dim_k, head_dim_v; float scale; int chunk_size; };
    node_ref kda_scan(node_ref q, node_ref k, node_ref v, node_ref g, node_ref beta, node_ref st,
                      const kda_scan_params & p);
    node_ref gated_rms_norm(node_ref o, node_ref z, node_ref w, float eps, int64_t head_dim);
    struct mla_params { int64_t n_head, head_dim_nope, head_dim_rope, head_dim_v, kv_lora_rank; float scale; };
    node_ref mla_attn(node_ref q, node_ref c, node_ref kr, node_ref kv_b, node_ref cache, node_ref sel,
                      const mla_params & p);
    struct indexer_params { int64_t n_head, head_dim, topk; float scale; };
    node_ref indexer_topk(node_ref qi, node_ref ki, node_ref wi, node_ref kcache, const indexer_params & p);
    struct route_params { int64_t n_expert_used, n_group, topk_group; bool renormalize; float scale; router_act act; };
    // Returns {ids, weights}.
    std::pair<node_ref, node_ref> moe_route(node_ref x, node_ref gate_w, node_ref bias, const route_params & p);
    struct experts_params { glu_act act; float situ_beta, situ_linear_beta; int64_t d_out;
                            std::shared_ptr<const std::vector<expert_weights>> experts; };
    node_ref moe_experts(node_ref x, node_ref ids, node_ref w, const experts_params & p);
    node_ref attn_res_mix(const std::vector<node_ref> & cands, node_ref norm_w, node_ref proj_w, float eps);

    // From now on, LINEAR and MOE_EXPERTS nodes round their inputs to bf16 (op_params::bf16_inputs) or not.
    void bf16_inputs(bool on) { bf16_inputs_ = on; }

    const node_output & out(node_ref r) const { return g_.out(r); }
    graph finish(node_ref logits);

private:
    node_ref push(node n);
    const std::string & at_name(node_ref r) const { return g_.at(r).name; }
    graph g_;
    bool bf16_inputs_ = false;
};

} // namespace perigee
