// Weight declarations and the reconciler.
//
// The model declares every tensor it needs (name, allowed shapes, allowed dtypes) from its config.
// At load, the checkpoint is reconciled against the declarations into four buckets — declared but
// missing, present but unclaimed, shape mismatch, dtype mismatch — plus the tensors deliberately
// ignored (the vision tower). Any non-empty bucket refuses to run (STYLE §3.6, trap 31).
#pragma once
#include "loader/checkpoint.h"
#include "model/config.h"

#include <map>
#include <string>
#include <vector>

namespace perigee {

struct weight_decl {
    std::string name;                 // full checkpoint name
    std::vector<shape_t> shapes;      // accepted shapes (usually one)
    std::vector<dtype> dtypes;        // accepted dtypes
};

struct reconcile_report {
    std::vector<std::string> missing;     // declared, not in the checkpoint
    std::vector<std::string> unclaimed;   // in the checkpoint, not declared
    std::vector<std::string> shape_mismatch;
    std::vector<std::string> dtype_mismatch;
    int64_t n_ignored = 0;                // vision tensors, recognised and never loaded
    int64_t n_declared = 0;
    bool ok() const { return missing.empty() && unclaimed.empty() && shape_mismatch.empty() && dtype_mismatch.empty(); }
    std::string str() const;
};

// Every tensor the config implies, in checkpoint names. `ck` is consulted only where the published
// format itself leaves a choice that the tensors settle (an NVFP4 tree may keep some experts in MXFP4).
std::vector<weight_decl> weights_declare(const kimi_config & c, const checkpoint & ck);
// Reconciles `ck` against `decls`, which must be weights_declare(c, ck) for this config and a checkpoint
// with the same tensors (declaring K3 makes ~497k entries: declare once, pass the list to each step).
reconcile_report weights_reconcile(const kimi_config & c, const checkpoint & ck, const std::vector<weight_decl> & decls);
// Declares, then reconciles.
reconcile_report weights_reconcile(const kimi_config & c, const checkpoint & ck);

// Typed views, per layer, named after the checkpoint (pointers into model_weights::tensors).
struct kda_weights {
    const tensor *q_proj, *k_proj, *v_proj;            // [H*K, D]
    const tensor *q_conv1d, *k_conv1d, *v_conv1d;      // [H*K, 1, W]
    const tensor *A_log;                               // [H] (or padded; tail checked zero)
    const tensor *dt_bias;                             // [H*K]
    const tensor *f_a_proj, *f_b_proj;                 // [K, D], [H*K, K]
    const tensor *b_proj;                              // [H, D]
    const tensor *g_proj;                              // [H*K, D] full rank, or null
    const tensor *g_a_proj, *g_b_proj;                 // low rank, or null
    const tensor *o_norm;                              // [K]
    const tensor *o_proj;                              // [D, H*K]
};
struct indexer_weights {
    const tensor *wq_b;           // [I*d, q_lora]
    const tensor *wk;             // [d, D]
    const tensor *k_norm_weight, *k_norm_bias;  // [d]
    const tensor *weights_proj;   // [I, D]
};
struct mla_weights {
    const tensor *q_proj;                          // [H*(dn+dr), D] when q_lora_rank == 0
    const tensor *q_a_proj, *q_a_layernorm, *q_b_proj;
    const tensor *kv_a_proj_with_mqa;              // [L+dr, D]
    const tensor *kv_a_layernorm;                  // [L]
    const tensor *kv_b_proj;                       // [H*(dn+dv), L]
    const tensor *g_proj;                          // [H*dv, D] output gate, or null
    const tensor *o_proj;                          // [D, H*dv]
    bool has_indexer = false;
    indexer_weights indexer{};
};
struct mlp_weights { const tensor *gate_proj, *up_proj, *down_proj; };
struct moe_weights {
    const tensor *gate;                            // [E, D]
    const tensor *e_score_correction_bias;         // [E] or null
    const tensor *routed_expert_down_proj, *routed_expert_norm, *routed_expert_up_proj;  // latent, or null
    std::shared_ptr<const std::vector<expert_weights>> experts;
    bool has_shared = false;
    mlp_weights shared{};
};
struct layer_weights {
    const tensor *input_layernorm, *post_attention_layernorm;
    const tensor *self_attention_res_norm = nullptr, *self_attention_res_proj = nullptr;  // AttnRes
    const tensor *mlp_res_norm = nullptr, *mlp_res_proj = nullptr;
    bool is_kda = false, is_moe = false;
    kda_weights kda{};
    mla_weights mla{};
    mlp_weights mlp{};
    moe_weights moe{};
};
struct model_weights {
    checkpoint ck;
    std::map<std::string, tensor> tensors;   // views into the mmapped shards, by checkpoint name
    const tensor *embed_tokens, *norm, *lm_head;
    const tensor *output_attn_res_norm = nullptr, *output_attn_res_proj = nullptr;
    std::vector<layer_weights> layers;
};

// Reconciles (throws with the full report when any bucket is non-empty), checks value-level rules
// (A_log tail exactly zero), and binds the typed views. Nothing is copied.
// Declares once; the same declarations feed the reconciler and the binding.
std::unique_ptr<model_weights> weights_load(const kimi_config & c, checkpoint ck);
// The same with declarations the caller already made (weights_declare(c, ck) of a checkpoint with these
// tensors, e.g. for its own weights_reconcile); the reconciler still checks them against `ck`.
std::unique_ptr<model_weights> weights_load(const kimi_config & c, checkpoint ck, const std::vector<weight_decl> & decls);
// Reads every MXFP4 scale byte and lists the 0xFF (E8M0 NaN) ones, by layer and expert. Loading does
// not do this (a routed expert is not read until it is used); perigee inspect does.
std::vector<std::string> weights_verify_fp4(const model_weights & w);

} // namespace perigee
