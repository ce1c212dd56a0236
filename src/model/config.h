// The model configuration, parsed strictly from the checkpoint's config.json (STYLE §3.6).
//
// Three families share one struct: Kimi-Linear (model_type kimi_linear, in the published
// configuration_kimi.py form or the transformers-native save_pretrained form), Kimi K3 (wrapper
// model_type kimi_k3 around a kimi_linear text_config) and K3.1 Pro (wrapper kimi_k31 plus
// dsa_config and the Lightning Indexer). Field names are the checkpoint's own keys.
// Unknown keys are errors; keys we deliberately ignore are listed with a reason in config.cpp;
// missing keys that shape the model are errors.
#pragma once
#include "ir/graph.h"

#include <cstdint>
#include <string>
#include <vector>

namespace perigee {

enum class model_variant : uint8_t { KIMI_LINEAR, K3, K31 };
std::string_view model_variant_name(model_variant v);

enum class expert_format : uint8_t { DENSE, MXFP4, NVFP4 };

// Which of the accepted config.json forms a config was parsed from.
enum class kimi_config_form : uint8_t {
    PUBLISHED,      // model_type kimi_linear with linear_attn_config (configuration_kimi.py, Kimi-Linear-48B)
    TRANSFORMERS,   // model_type kimi_linear, transformers-native save_pretrained form (layer_types)
    K3_WRAPPER,     // model_type kimi_k3 / kimi_k31 wrapper around a kimi_linear text_config
};
// "published", "transformers" or "k3-wrapper" (the words messages print).
std::string_view config_form_name(kimi_config_form f);

struct kimi_config {
    model_variant variant = model_variant::KIMI_LINEAR;
    kimi_config_form config_form = kimi_config_form::PUBLISHED;  // the default asks for no form-specific leniency
    std::string tensor_prefix;          // "" or "language_model."

    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;      // dense MLP width (layers < first_k_dense_replace)
    int64_t num_hidden_layers = 0;
    float rms_norm_eps = 0;
    bool tie_word_embeddings = false;
    int64_t max_position_embeddings = 0;

    // Per layer (0-based), derived from the 1-based layer lists or layer_types.
    std::vector<bool> layer_is_kda;     // [num_hidden_layers]; false = MLA
    std::vector<bool> layer_is_moe;     // [num_hidden_layers]; false = dense MLP

    // KDA (linear_attn_config)
    int64_t kda_num_heads = 0, kda_head_dim = 0, kda_short_conv_kernel_size = 0;
    bool kda_use_full_rank_gate = false;   // g_proj [H*K, D] instead of g_a_proj/g_b_proj
    float kda_gate_lower_bound = 0;        // < 0: -lb*sigmoid gate (K3); 0: softplus gate (48B)

    // MLA (NoPE)
    int64_t num_attention_heads = 0;
    int64_t q_lora_rank = 0;               // 0: q_proj directly
    int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
    bool mla_use_output_gate = false;

    // MLP activation
    glu_act hidden_act = glu_act::SILU;
    float activation_situ_beta = 1.0f;
    float activation_situ_linear_beta = 0.0f;  // <= 0: absent (up branch is the identity)

    // MoE
    int64_t first_k_dense_replace = 0, moe_layer_freq = 1;
    int64_t num_experts = 0, num_experts_per_token = 0, num_shared_experts = 0, moe_intermediate_size = 0;
    int64_t num_expert_group = 1, topk_group = 1;
    bool moe_renormalize = true;
    float routed_scaling_factor = 1.0f;
    router_act moe_router_activation_func = router_act::SIGMOID;
    int64_t routed_expert_hidden_size = 0;     // > 0: latent MoE (K3)
    bool latent_moe_use_norm = false;
    expert_format experts = expert_format::DENSE;

    // Block Attention Residuals
    int64_t attn_res_block_size = 0;           // 0: plain residual stream

    // K3.1 Lightning Indexer (dsa_config)
    std::vector<bool> layer_is_dsa;            // [num_hidden_layers]
    int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;

    // Special ids
    int64_t bos_token_id = -1, pad_token_id = -1;
    std::vector<int64_t> eos_token_ids;

    int64_t n_kda_layers() const;
    int64_t n_mla_layers() const;
};

// Parses DIR/config.json (and DIR/generation_config.json for extra eos ids, when present).
kimi_config config_load(const std::string & model_dir);
// Parses a config.json text; `where` names the file in errors.
kimi_config config_parse(const std::string & json_text, const std::string & where);
// One-paragraph human summary (perigee inspect).
std::string config_summary(const kimi_config & c);

} // namespace perigee
