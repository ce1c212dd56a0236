// The Kimi family forward pass (ARCHITECTURE §3), written once as a graph of named ops.
//
//   Kimi-Linear: x -> [norm -> KDA|MLA -> +residual -> norm -> dense|MoE -> +residual] x L -> norm -> lm_head
//   K3 / K3.1:   the residual adds are replaced by Block Attention Residuals (§3.1–3.2): each sub-layer
//                reads a softmax mix over the block snapshots and the running prefix sum.
//
// Activations are F32 on the CPU reference (no bf16 rounding between modules; see README).
#include "model/forward.h"

#include "ir/builder.h"

#include <cmath>

namespace perigee {

namespace {

// Small named-parameter bundles so each call can be checked against the config without opening a
// declaration (STYLE §3.4.1).
struct ctx {
    builder & b;
    const kimi_config & c;
    model_state & st;
    int chunk_size;
    node_ref W(const tensor * t, const std::string & name) { return b.weight(*t, name); }
};

node_ref glu(ctx & x, node_ref g, node_ref u) {
    return x.c.hidden_act == glu_act::SITU
               ? x.b.situ_mul(g, u, x.c.activation_situ_beta, x.c.activation_situ_linear_beta)
               : x.b.silu_mul(g, u);
}

node_ref mlp_block(ctx & x, const mlp_weights & w, node_ref h, int il, const std::string & prefix) {
    builder & b = x.b;
    node_ref g = b.name(b.linear(h, x.W(w.gate_proj, prefix + ".gate_proj")), prefix + "_gate", il);
    node_ref u = b.name(b.linear(h, x.W(w.up_proj, prefix + ".up_proj")), prefix + "_up", il);
    node_ref a = b.name(glu(x, g, u), prefix + "_act", il);
    return b.name(b.linear(a, x.W(w.down_proj, prefix + ".down_proj")), prefix + "_out", il);
}

// KDA (ARCHITECTURE §3.4): projections, short conv, gate, beta, normalised q/k, delta-rule scan,
// gated per-head RMSNorm, o_proj.
node_ref kda_block(ctx & x, const kda_weights & w, layer_state & ls, node_ref h, int il) {
    builder & b = x.b;
    const kimi_config & c = x.c;
    const int64_t H = c.kda_num_heads, K = c.kda_head_dim;
    node_ref q = b.name(b.linear(h, x.W(w.q_proj, "q_proj")), "kda_q", il);
    node_ref k = b.name(b.linear(h, x.W(w.k_proj, "k_proj")), "kda_k", il);
    node_ref v = b.name(b.linear(h, x.W(w.v_proj, "v_proj")), "kda_v", il);
    q = b.name(b.short_conv(q, x.W(w.q_conv1d, "q_conv1d"), b.state(ls.conv_q, "conv_q")), "kda_q_conv", il);
    k = b.name(b.short_conv(k, x.W(w.k_conv1d, "k_conv1d"), b.state(ls.conv_k, "conv_k")), "kda_k_conv", il);
    v = b.name(b.short_conv(v, x.W(w.v_conv1d, "v_conv1d"), b.state(ls.conv_v, "conv_v")), "kda_v_conv", il);
    // Forget gate: low rank, no activation between f_a and f_b (trap 10).
    node_ref f = b.name(b.linear(b.linear(h, x.W(w.f_a_proj, "f_a_proj")), x.W(w.f_b_proj, "f_b_proj")), "kda_f", il);
    node_ref g = b.name(b.kda_gate(f, x.W(w.A_log, "A_log"), x.W(w.dt_bias, "dt_bias"), H, K, c.kda_gate_lower_bound),
                        "kda_gate", il);
    node_ref beta = b.name(b.sigmoid(b.linear(h, x.W(w.b_proj, "b_proj"))), "kda_beta", il);   // applied once (trap 11)
    node_ref qn = b.name(b.l2_norm(q, 1e-6f, K), "kda_q_l2", il);
    node_ref kn = b.name(b.l2_norm(k, 1e-6f, K), "kda_k_l2", il);
    node_ref o = b.name(b.kda_scan(qn, kn, v, g, beta, b.state(ls.recurrent, "kda_state"),
                                   {.n_head = H, .head_dim_k = K, .head_dim_v = K,
                                    .scale = 1.0f / std::sqrt(float(K)), .chunk_size = x.chunk_size}),
                        "kda_scan", il);
    node_ref z = w.g_proj ? b.linear(h, x.W(w.g_proj, "g_proj"))
                          : b.linear(b.linear(h, x.W(w.g_a_proj, "g_a_proj")), x.W(w.g_b_proj, "g_b_proj"));
    b.name(z, "kda_out_gate", il);
    node_ref on = b.name(b.gated_rms_norm(o, z, x.W(w.o_norm, "o_norm"), c.rms_norm_eps, K), "kda_o_norm", il);
    return b.name(b.linear(on, x.W(w.o_proj, "o_proj")), "kda_out", il);
}

// NoPE MLA with the optional sigmoid output gate and the optional K3.1 Lightning Indexer
// (ARCHITECTURE §3.5–3.6). q_a/kv_a layernorms use eps 1e-6 as the reference does (§5.4).
node_ref mla_block(ctx & x, const mla_weights & w, layer_state & ls, node_ref h, int il) {
    builder & b = x.b;
    const kimi_config & c = x.c;
    const int64_t L = c.kv_lora_rank, dr = c.qk_rope_head_dim;
    node_ref q, cq;
    if (w.q_a_proj) {
        cq = b.name(b.rms_norm(b.linear(h, x.W(w.q_a_proj, "q_a_proj")), x.W(w.q_a_layernorm, "q_a_layernorm"), 1e-6f),
                    "mla_q_latent", il);
        q = b.linear(cq, x.W(w.q_b_proj, "q_b_proj"));
    } else {
        q = b.linear(h, x.W(w.q_proj, "q_proj"));
    }
    b.name(q, "mla_q", il);
    node_ref kv0 = b.name(b.linear(h, x.W(w.kv_a_proj_with_mqa, "kv_a_proj_with_mqa")), "mla_kv_a", il);
    // The latent is normed; k_rope is NOT (trap 2) and is never rotated (trap 1).
    node_ref lat = b.name(b.rms_norm(b.cols(kv0, 0, L), x.W(w.kv_a_layernorm, "kv_a_layernorm"), 1e-6f), "mla_latent", il);
    node_ref kr = b.name(b.cols(kv0, L, dr), "mla_k_rope", il);
    node_ref sel;
    if (w.has_indexer) {
        const auto & ix = w.indexer;
        node_ref qi = b.name(b.linear(cq, x.W(ix.wq_b, "indexer.wq_b")), "idx_q", il);
        node_ref ki = b.name(b.layer_norm(b.linear(h, x.W(ix.wk, "indexer.wk")), x.W(ix.k_norm_weight, "indexer.k_norm.weight"),
                                          x.W(ix.k_norm_bias, "indexer.k_norm.bias"), 1e-6f),
                             "idx_k", il);
        node_ref wi = b.name(b.linear(h, x.W(ix.weights_proj, "indexer.weights_proj")), "idx_w", il);
        sel = b.name(b.indexer_topk(qi, ki, wi, b.state(ls.index_keys, "index_keys"),
                                    {.n_head = c.index_n_heads, .head_dim = c.index_head_dim, .topk = c.index_topk,
                                     .scale = 1.0f / std::sqrt(float(c.index_n_heads * c.index_head_dim))}),
                     "idx_topk", il);
    }
    node_ref o = b.name(b.mla_attn(q, lat, kr, x.W(w.kv_b_proj, "kv_b_proj"), b.state(ls.latent, "mla_cache"), sel,
                                   {.n_head = c.num_attention_heads, .head_dim_nope = c.qk_nope_head_dim,
                                    .head_dim_rope = dr, .head_dim_v = c.v_head_dim, .kv_lora_rank = L,
                                    .scale = 1.0f / std::sqrt(float(c.qk_nope_head_dim + dr))}),   // 192^-0.5 (trap 3)
                        "mla_attn", il);
    if (w.g_proj)   // per-channel output gate from the normed attention input (trap 4)
        o = b.name(b.mul(o, b.sigmoid(b.linear(h, x.W(w.g_proj, "g_proj")))), "mla_gated", il);
    return b.name(b.linear(o, x.W(w.o_proj, "o_proj")), "mla_out", il);
}

// MoE (ARCHITECTURE §3.7): fp32 sigmoid router on the full input; latent experts when configured
// (down once per token, experts, fp32 combine, RMSNorm on the sum, up); shared expert added last.
node_ref moe_block(ctx & x, const moe_weights & w, node_ref h, int il) {
    builder & b = x.b;
    const kimi_config & c = x.c;
    auto [ids, wts] = b.moe_route(h, x.W(w.gate, "gate"),
                                  w.e_score_correction_bias ? x.W(w.e_score_correction_bias, "e_score_correction_bias")
                                                            : node_ref{},
                                  {.n_expert_used = c.num_experts_per_token, .n_group = c.num_expert_group,
                                   .topk_group = c.topk_group, .renormalize = c.moe_renormalize,
                                   .scale = c.routed_scaling_factor, .act = c.moe_router_activation_func});
    b.name(ids, "moe_route", il);
    const bool latent = w.routed_expert_down_proj != nullptr;
    node_ref xin = latent ? b.name(b.linear(h, x.W(w.routed_expert_down_proj, "routed_expert_down_proj")), "moe_latent_in", il)
                          : h;
    const int64_t d_out = latent ? c.routed_expert_hidden_size : c.hidden_size;
    node_ref y = b.name(b.moe_experts(xin, ids, wts, {.act = c.hidden_act, .situ_beta = c.activation_situ_beta,
                                                      .situ_linear_beta = c.activation_situ_linear_beta, .d_out = d_out,
                                                      .experts = w.experts}),
                        "moe_experts", il);
    if (latent) {
        y = b.name(b.rms_norm(y, x.W(w.routed_expert_norm, "routed_expert_norm"), c.rms_norm_eps), "moe_latent_norm", il);
        y = b.name(b.linear(y, x.W(w.routed_expert_up_proj, "routed_expert_up_proj")), "moe_latent_out", il);
    }
    if (w.has_shared) y = b.add(y, mlp_block(x, w.shared, h, il, "shared"));
    return b.name(y, "ffn_moe_out", il);
}

} // namespace

void forward_options_check(const forward_options & opt) {
    PG_CHECK(opt.bf16_inputs_min_tokens == 0 || opt.bf16_inputs_min_tokens >= 2,
             "bf16_inputs_min_tokens {} (--bf16-inputs-tokens): 0 (off) or at least 2 (a one-token step keeps fp32 inputs)",
             opt.bf16_inputs_min_tokens);
}

graph forward_build(const kimi_config & c, const model_weights & w, model_state & st, std::shared_ptr<const batch> bt,
                    const forward_options & opt) {
    batch_validate(*bt, st.n_slots, st.n_pages);
    PG_CHECK(bt->page_size == st.page_size, "batch page size {} != pool page size {}", bt->page_size, st.page_size);
    bool prefill = false;
    for (int s = 0; s < bt->n_seq(); ++s) prefill |= bt->seq_len(s) > 1;
    builder b(bt);
    forward_options_check(opt);
    b.bf16_inputs(opt.bf16_inputs_min_tokens > 0 && bt->n_tokens() >= opt.bf16_inputs_min_tokens);
    ctx x{b, c, st, prefill ? opt.kda_chunk_size : 0};

    node_ref cur = b.name(b.get_rows(x.W(w.embed_tokens, "embed_tokens"), b.ids()), "token_embd");
    const bool attn_res = c.attn_res_block_size > 0;
    // AttnRes state of the step: block snapshots B (raw prefix sums) and the running prefix P.
    std::vector<node_ref> snapshots;
    node_ref prefix = cur;
    auto mix = [&](const tensor * nw, const tensor * pw, const char * name, int il) {
        std::vector<node_ref> cands = snapshots;   // snapshots first, prefix last (§3.2)
        cands.push_back(prefix);
        return b.name(b.attn_res_mix(cands, x.W(nw, "res_norm"), x.W(pw, "res_proj"), c.rms_norm_eps), name, il);
    };

    for (int il = 0; il < int(c.num_hidden_layers); ++il) {
        const layer_weights & lw = w.layers[size_t(il)];
        layer_state & ls = st.layers[size_t(il)];
        // --- attention sub-layer ---
        node_ref a_in = cur;
        if (attn_res) {
            a_in = snapshots.empty() ? prefix : mix(lw.self_attention_res_norm, lw.self_attention_res_proj, "attn_res_mix", il);
            if (il % c.attn_res_block_size == 0) {   // bank the RAW prefix and restart the sum (after the mix, trap 20)
                snapshots.push_back(prefix);
                prefix = node_ref{};
            }
        }
        node_ref h = b.name(b.rms_norm(a_in, x.W(lw.input_layernorm, "input_layernorm"), c.rms_norm_eps), "attn_norm", il);
        node_ref a = lw.is_kda ? kda_block(x, lw.kda, ls, h, il) : mla_block(x, lw.mla, ls, h, il);
        node_ref m_in;
        if (attn_res) {
            prefix = prefix.valid() ? b.add(prefix, a) : a;
            b.name(prefix, "attn_prefix", il);
            m_in = mix(lw.mlp_res_norm, lw.mlp_res_proj, "mlp_res_mix", il);
        } else {
            cur = b.name(b.add(cur, a), "attn_residual", il);
            m_in = cur;
        }
        // --- FFN sub-layer ---
        h = b.name(b.rms_norm(m_in, x.W(lw.post_attention_layernorm, "post_attention_layernorm"), c.rms_norm_eps),
                   "ffn_norm", il);
        node_ref f = lw.is_moe ? moe_block(x, lw.moe, h, il) : mlp_block(x, lw.mlp, h, il, "mlp");
        if (attn_res) prefix = b.name(b.add(prefix, f), "l_out", il);
        else cur = b.name(b.add(cur, f), "l_out", il);
    }
    node_ref out = attn_res ? mix(w.output_attn_res_norm, w.output_attn_res_proj, "output_res_mix", -1) : cur;
    if (!bt->logits_rows.empty()) out = b.name(b.select_rows(out), "logits_rows");
    node_ref hn = b.name(b.rms_norm(out, x.W(w.norm, "norm"), c.rms_norm_eps), "output_norm");
    node_ref logits = b.name(b.linear(hn, x.W(w.lm_head, "lm_head")), "logits");
    return b.finish(logits);
}

} // namespace perigee
