#include "model/weights.h"

#include "core/error.h"

#include <algorithm>
#include <set>

namespace perigee {

namespace {

const std::vector<dtype> k_float = {dtype::BF16, dtype::F32, dtype::F16};
const std::vector<dtype> k_f32ish = {dtype::F32, dtype::BF16};

bool is_ignored_name(const kimi_config & c, const std::string & name) {
    // The K3 wrapper ships a vision tower; a text engine recognises it and never loads it.
    return c.config_form == kimi_config_form::K3_WRAPPER && (name.rfind("vision_tower.", 0) == 0 || name.rfind("mm_projector.", 0) == 0);
}

struct decl_list {
    std::vector<weight_decl> v;
    void add(std::string name, shape_t shape, std::vector<dtype> dt) { v.push_back({std::move(name), {std::move(shape)}, std::move(dt)}); }
    void add_any(std::string name, std::vector<shape_t> shapes, std::vector<dtype> dt) { v.push_back({std::move(name), std::move(shapes), std::move(dt)}); }
};

// FP4 or dense expert matrix [out, in]. The tensors decide MXFP4 vs NVFP4 per matrix: an NVFP4 tree
// may keep a tensor in MXFP4 when its exponents do not fit E4M3 (perigee convert).
void declare_expert_matrix(decl_list & d, const kimi_config & c, const checkpoint & ck, const std::string & base,
                           int64_t out, int64_t in) {
    if (c.experts == expert_format::DENSE) {
        d.add(base + ".weight", {out, in}, k_float);
        return;
    }
    d.add(base + ".weight_packed", {out, in / 2}, {dtype::U8});
    if (c.experts == expert_format::NVFP4 && ck.has(base + ".weight_global_scale")) {
        d.add(base + ".weight_scale", {out, in / 16}, {dtype::F8_E4M3});
        d.add_any(base + ".weight_global_scale", {{1}, {}}, {dtype::F32});
    } else {
        d.add(base + ".weight_scale", {out, in / 32}, {dtype::U8});
    }
}

// The dense MLP is `mlp.*` in the published checkpoints; transformers 5.x save_pretrained writes it
// as `block_sparse_moe.{gate,up,down}_proj` (its reverse rename catches the dense layer too;
// tools/golden/README.md). Only the transformers-native form may use the second spelling.
std::string dense_mlp_prefix(const kimi_config & c, const checkpoint & ck, const std::string & L) {
    if (c.config_form == kimi_config_form::TRANSFORMERS && ck.has(L + "block_sparse_moe.gate_proj.weight")) return L + "block_sparse_moe.";
    return L + "mlp.";
}

} // namespace

std::vector<weight_decl> weights_declare(const kimi_config & c, const checkpoint & ck) {
    decl_list d;
    const std::string P = c.tensor_prefix;
    const int64_t D = c.hidden_size, V = c.vocab_size;
    d.add(P + "model.embed_tokens.weight", {V, D}, k_float);
    d.add(P + "model.norm.weight", {D}, k_float);
    if (!c.tie_word_embeddings) d.add(P + "lm_head.weight", {V, D}, k_float);
    if (c.attn_res_block_size > 0) {
        d.add(P + "model.output_attn_res_norm.weight", {D}, k_float);
        d.add(P + "model.output_attn_res_proj.weight", {1, D}, k_float);
    }
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const std::string L = P + "model.layers." + std::to_string(l) + ".";
        d.add(L + "input_layernorm.weight", {D}, k_float);
        d.add(L + "post_attention_layernorm.weight", {D}, k_float);
        if (c.attn_res_block_size > 0) {
            d.add(L + "self_attention_res_norm.weight", {D}, k_float);
            d.add(L + "self_attention_res_proj.weight", {1, D}, k_float);
            d.add(L + "mlp_res_norm.weight", {D}, k_float);
            d.add(L + "mlp_res_proj.weight", {1, D}, k_float);
        }
        const std::string A = L + "self_attn.";
        if (c.layer_is_kda[size_t(l)]) {
            const int64_t H = c.kda_num_heads, K = c.kda_head_dim, HK = H * K, W = c.kda_short_conv_kernel_size;
            for (const char * x : {"q", "k", "v"}) {
                d.add(A + x + "_proj.weight", {HK, D}, k_float);
                d.add(A + x + "_conv1d.weight", {HK, 1, W}, k_f32ish);  // K3 ships F32, the 48B BF16
            }
            // A_log: one value per head, stored [H], [1,1,H,1] or padded [>=H] with a zero tail (§2.6.4).
            std::vector<shape_t> a_shapes = {{H}, {1, 1, H, 1}};
            if (ck.has(A + "A_log")) {
                const auto & e = ck.entry(A + "A_log");
                if (e.shape.size() == 1 && e.shape[0] > H) a_shapes.push_back(e.shape);
            }
            d.add_any(A + "A_log", a_shapes, {dtype::F32});
            d.add(A + "dt_bias", {HK}, k_f32ish);
            d.add(A + "f_a_proj.weight", {K, D}, k_float);
            d.add(A + "f_b_proj.weight", {HK, K}, k_float);
            d.add(A + "b_proj.weight", {H, D}, k_float);
            if (c.kda_use_full_rank_gate) {
                d.add(A + "g_proj.weight", {HK, D}, k_float);
            } else {
                d.add(A + "g_a_proj.weight", {K, D}, k_float);
                d.add(A + "g_b_proj.weight", {HK, K}, k_float);
            }
            d.add(A + "o_norm.weight", {K}, k_float);
            d.add(A + "o_proj.weight", {D, HK}, k_float);
        } else {
            const int64_t H = c.num_attention_heads, dqk = c.qk_nope_head_dim + c.qk_rope_head_dim;
            if (c.q_lora_rank > 0) {
                d.add(A + "q_a_proj.weight", {c.q_lora_rank, D}, k_float);
                d.add(A + "q_a_layernorm.weight", {c.q_lora_rank}, k_float);
                d.add(A + "q_b_proj.weight", {H * dqk, c.q_lora_rank}, k_float);
            } else {
                d.add(A + "q_proj.weight", {H * dqk, D}, k_float);
            }
            d.add(A + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, D}, k_float);
            d.add(A + "kv_a_layernorm.weight", {c.kv_lora_rank}, k_float);
            d.add(A + "kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, k_float);
            if (c.mla_use_output_gate) d.add(A + "g_proj.weight", {H * c.v_head_dim, D}, k_float);
            d.add(A + "o_proj.weight", {D, H * c.v_head_dim}, k_float);
            if (c.layer_is_dsa[size_t(l)]) {
                const int64_t I = c.index_n_heads, dI = c.index_head_dim;
                d.add(A + "indexer.wq_b.weight", {I * dI, c.q_lora_rank}, k_float);
                d.add(A + "indexer.wk.weight", {dI, D}, k_float);
                d.add(A + "indexer.k_norm.weight", {dI}, k_float);
                d.add(A + "indexer.k_norm.bias", {dI}, k_float);
                d.add(A + "indexer.weights_proj.weight", {I, D}, k_float);
            }
        }
        if (!c.layer_is_moe[size_t(l)]) {
            const int64_t I = c.intermediate_size;
            const std::string F = dense_mlp_prefix(c, ck, L);
            d.add(F + "gate_proj.weight", {I, D}, k_float);
            d.add(F + "up_proj.weight", {I, D}, k_float);
            d.add(F + "down_proj.weight", {D, I}, k_float);
        } else {
            const std::string M = L + "block_sparse_moe.";
            const int64_t E = c.num_experts, I = c.moe_intermediate_size;
            d.add(M + "gate.weight", {E, D}, k_float);
            d.add(M + "gate.e_score_correction_bias", {E}, k_f32ish);
            int64_t Din = D;
            if (c.routed_expert_hidden_size > 0) {
                Din = c.routed_expert_hidden_size;
                d.add(M + "routed_expert_down_proj.weight", {Din, D}, k_float);
                d.add(M + "routed_expert_norm.weight", {Din}, k_float);
                d.add(M + "routed_expert_up_proj.weight", {D, Din}, k_float);
            }
            for (int64_t e = 0; e < E; ++e) {
                const std::string X = M + "experts." + std::to_string(e) + ".";
                declare_expert_matrix(d, c, ck, X + "w1", I, Din);
                declare_expert_matrix(d, c, ck, X + "w3", I, Din);
                declare_expert_matrix(d, c, ck, X + "w2", Din, I);
            }
            if (c.num_shared_experts > 0) {
                const int64_t S = I * c.num_shared_experts;  // ONE MLP of this width (ARCHITECTURE §3.3)
                d.add(M + "shared_experts.gate_proj.weight", {S, D}, k_float);
                d.add(M + "shared_experts.up_proj.weight", {S, D}, k_float);
                d.add(M + "shared_experts.down_proj.weight", {D, S}, k_float);
            }
        }
    }
    return d.v;
}

std::string reconcile_report::str() const {
    std::string s = fmt::format("reconciler: {} declared, {} missing, {} unclaimed, {} shape mismatches, "
                                "{} dtype mismatches, {} ignored (vision)\n",
                                n_declared, missing.size(), unclaimed.size(), shape_mismatch.size(), dtype_mismatch.size(),
                                n_ignored);
    auto list = [&](const char * what, const std::vector<std::string> & v) {
        const size_t show = std::min<size_t>(v.size(), 20);
        for (size_t i = 0; i < show; ++i) s += fmt::format("  {}: {}\n", what, v[i]);
        if (v.size() > show) s += fmt::format("  {}: ... and {} more\n", what, v.size() - show);
    };
    list("missing", missing);
    list("unclaimed", unclaimed);
    list("shape mismatch", shape_mismatch);
    list("dtype mismatch", dtype_mismatch);
    return s;
}

reconcile_report weights_reconcile(const kimi_config & c, const checkpoint & ck) {
    return weights_reconcile(c, ck, weights_declare(c, ck));
}

reconcile_report weights_reconcile(const kimi_config & c, const checkpoint & ck, const std::vector<weight_decl> & decls) {
    reconcile_report r;
    r.n_declared = int64_t(decls.size());
    std::set<std::string> declared;
    for (const auto & d : decls) {
        declared.insert(d.name);
        if (!ck.has(d.name)) {
            r.missing.push_back(d.name);
            continue;
        }
        const auto & e = ck.entry(d.name);
        if (std::find(d.shapes.begin(), d.shapes.end(), e.shape) == d.shapes.end()) {
            std::string want;
            for (const auto & s : d.shapes) {
                if (!want.empty()) want += " or ";
                want += shape_str(s);
            }
            r.shape_mismatch.push_back(fmt::format("{} is {}, expected {}", d.name, shape_str(e.shape), want));
        }
        if (std::find(d.dtypes.begin(), d.dtypes.end(), e.type) == d.dtypes.end()) {
            std::string want;
            for (auto t : d.dtypes) {
                if (!want.empty()) want += "/";
                want += dtype_name(t);
            }
            r.dtype_mismatch.push_back(fmt::format("{} is {}, expected {}", d.name, dtype_name(e.type), want));
        }
    }
    for (const auto & n : ck.names()) {
        if (declared.count(n)) continue;
        if (is_ignored_name(c, n)) ++r.n_ignored;
        else r.unclaimed.push_back(n);
    }
    return r;
}

namespace {

// Variant gating, tensor half (trap 35): the indexer tensors must agree with the config.
void check_variant_signals(const kimi_config & c, const checkpoint & ck) {
    std::string indexer_tensor;
    for (const auto & n : ck.names())
        if (n.find(".self_attn.indexer.") != std::string::npos) {
            indexer_tensor = n;
            break;
        }
    if (c.variant == model_variant::K31)
        PG_CHECK(!indexer_tensor.empty(), "{}: config.json says kimi_k31 with a dsa_config, but the checkpoint has no "
                 "Lightning Indexer tensors (no '*.self_attn.indexer.*'); refusing to run a K3 tree as K3.1", ck.dir());
    else
        PG_CHECK(indexer_tensor.empty(), "{}: the checkpoint has Lightning Indexer tensors (e.g. {}) but config.json says {}; "
                 "a K3.1 Pro tree must not run as {}", ck.dir(), indexer_tensor, model_variant_name(c.variant),
                 model_variant_name(c.variant));
}

} // namespace

std::unique_ptr<model_weights> weights_load(const kimi_config & c, checkpoint ck) {
    const auto decls = weights_declare(c, ck);
    return weights_load(c, std::move(ck), decls);
}

std::unique_ptr<model_weights> weights_load(const kimi_config & c, checkpoint ck_in, const std::vector<weight_decl> & decls) {
    auto w = std::make_unique<model_weights>(model_weights{std::move(ck_in), {}, nullptr, nullptr, nullptr, nullptr, nullptr, {}});
    const checkpoint & ck = w->ck;
    check_variant_signals(c, ck);
    const auto rep = weights_reconcile(c, ck, decls);
    PG_CHECK(rep.ok(), "{}: the checkpoint does not match the model its config.json describes\n{}", ck.dir(), rep.str());
    for (const auto & d : decls) w->tensors.emplace(d.name, ck.get(d.name));
    auto T = [&](const std::string & n) -> const tensor * { return &w->tensors.at(n); };
    auto T_opt = [&](const std::string & n) -> const tensor * {
        auto it = w->tensors.find(n);
        return it == w->tensors.end() ? nullptr : &it->second;
    };
    const std::string P = c.tensor_prefix;
    w->embed_tokens = T(P + "model.embed_tokens.weight");
    w->norm = T(P + "model.norm.weight");
    w->lm_head = c.tie_word_embeddings ? w->embed_tokens : T(P + "lm_head.weight");
    w->output_attn_res_norm = T_opt(P + "model.output_attn_res_norm.weight");
    w->output_attn_res_proj = T_opt(P + "model.output_attn_res_proj.weight");
    w->layers.resize(size_t(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        auto & lw = w->layers[size_t(l)];
        const std::string L = P + "model.layers." + std::to_string(l) + ".";
        const std::string A = L + "self_attn.";
        lw.input_layernorm = T(L + "input_layernorm.weight");
        lw.post_attention_layernorm = T(L + "post_attention_layernorm.weight");
        lw.self_attention_res_norm = T_opt(L + "self_attention_res_norm.weight");
        lw.self_attention_res_proj = T_opt(L + "self_attention_res_proj.weight");
        lw.mlp_res_norm = T_opt(L + "mlp_res_norm.weight");
        lw.mlp_res_proj = T_opt(L + "mlp_res_proj.weight");
        lw.is_kda = c.layer_is_kda[size_t(l)];
        lw.is_moe = c.layer_is_moe[size_t(l)];
        if (lw.is_kda) {
            auto & k = lw.kda;
            k.q_proj = T(A + "q_proj.weight");
            k.k_proj = T(A + "k_proj.weight");
            k.v_proj = T(A + "v_proj.weight");
            k.q_conv1d = T(A + "q_conv1d.weight");
            k.k_conv1d = T(A + "k_conv1d.weight");
            k.v_conv1d = T(A + "v_conv1d.weight");
            k.A_log = T(A + "A_log");
            // Trap 7: A_log is per head; a padded tensor must have an exactly-zero tail.
            for (int64_t i = c.kda_num_heads; i < k.A_log->numel(); ++i)
                PG_CHECK(k.A_log->as<float>()[i] == 0.0f, "{}A_log: entry {} is {} but entries {}.. must be exactly 0 "
                         "(A_log holds one value per head; a non-zero tail would mean a channel-wise A_log, which this "
                         "engine does not implement)", A, i, k.A_log->as<float>()[i], c.kda_num_heads);
            k.dt_bias = T(A + "dt_bias");
            k.f_a_proj = T(A + "f_a_proj.weight");
            k.f_b_proj = T(A + "f_b_proj.weight");
            k.b_proj = T(A + "b_proj.weight");
            k.g_proj = T_opt(A + "g_proj.weight");
            k.g_a_proj = T_opt(A + "g_a_proj.weight");
            k.g_b_proj = T_opt(A + "g_b_proj.weight");
            k.o_norm = T(A + "o_norm.weight");
            k.o_proj = T(A + "o_proj.weight");
        } else {
            auto & m = lw.mla;
            m.q_proj = T_opt(A + "q_proj.weight");
            m.q_a_proj = T_opt(A + "q_a_proj.weight");
            m.q_a_layernorm = T_opt(A + "q_a_layernorm.weight");
            m.q_b_proj = T_opt(A + "q_b_proj.weight");
            m.kv_a_proj_with_mqa = T(A + "kv_a_proj_with_mqa.weight");
            m.kv_a_layernorm = T(A + "kv_a_layernorm.weight");
            m.kv_b_proj = T(A + "kv_b_proj.weight");
            m.g_proj = T_opt(A + "g_proj.weight");
            m.o_proj = T(A + "o_proj.weight");
            m.has_indexer = c.layer_is_dsa[size_t(l)];
            if (m.has_indexer) {
                m.indexer.wq_b = T(A + "indexer.wq_b.weight");
                m.indexer.wk = T(A + "indexer.wk.weight");
                m.indexer.k_norm_weight = T(A + "indexer.k_norm.weight");
                m.indexer.k_norm_bias = T(A + "indexer.k_norm.bias");
                m.indexer.weights_proj = T(A + "indexer.weights_proj.weight");
            }
        }
        if (!lw.is_moe) {
            const std::string F = dense_mlp_prefix(c, ck, L);
            lw.mlp = {T(F + "gate_proj.weight"), T(F + "up_proj.weight"), T(F + "down_proj.weight")};
        } else {
            const std::string M = L + "block_sparse_moe.";
            auto & mo = lw.moe;
            mo.gate = T(M + "gate.weight");
            mo.e_score_correction_bias = T_opt(M + "gate.e_score_correction_bias");
            mo.routed_expert_down_proj = T_opt(M + "routed_expert_down_proj.weight");
            mo.routed_expert_norm = T_opt(M + "routed_expert_norm.weight");
            mo.routed_expert_up_proj = T_opt(M + "routed_expert_up_proj.weight");
            const int64_t Din = c.routed_expert_hidden_size > 0 ? c.routed_expert_hidden_size : c.hidden_size;
            const int64_t I = c.moe_intermediate_size;
            auto experts = std::make_shared<std::vector<expert_weights>>(size_t(c.num_experts));
            auto bind = [&](const std::string & base, int64_t out, int64_t in) {
                expert_matrix m;
                m.out = out;
                m.in = in;
                if (auto t = T_opt(base + ".weight")) {
                    m.weight = t;
                    return m;
                }
                m.packed = T(base + ".weight_packed");
                m.scale = T(base + ".weight_scale");
                if (auto gs = T_opt(base + ".weight_global_scale")) {
                    m.format = fp4_format::NVFP4;
                    m.global_scale = gs->as<float>()[0];
                } else {
                    // E8M0 byte 0xFF (NaN) is refused when the expert is decoded, not here: a routed
                    // expert's bytes are not read until it is used (issue 3 item 7). `perigee inspect`
                    // scans every scale (weights_verify_fp4).
                    m.format = fp4_format::MXFP4;
                }
                return m;
            };
            for (int64_t e = 0; e < c.num_experts; ++e) {
                const std::string X = M + "experts." + std::to_string(e) + ".";
                (*experts)[size_t(e)] = {bind(X + "w1", I, Din), bind(X + "w3", I, Din), bind(X + "w2", Din, I)};
            }
            mo.experts = experts;
            mo.has_shared = c.num_shared_experts > 0;
            if (mo.has_shared)
                mo.shared = {T(M + "shared_experts.gate_proj.weight"), T(M + "shared_experts.up_proj.weight"),
                             T(M + "shared_experts.down_proj.weight")};
        }
    }
    return w;
}

} // namespace perigee

namespace perigee {

std::vector<std::string> weights_verify_fp4(const model_weights & w) {
    std::vector<std::string> bad;
    for (size_t l = 0; l < w.layers.size(); ++l) {
        const auto & mo = w.layers[l].moe;
        if (!mo.experts) continue;
        for (size_t e = 0; e < mo.experts->size(); ++e) {
            const expert_weights & ex = (*mo.experts)[e];
            for (const expert_matrix * m : {&ex.gate, &ex.up, &ex.down}) {
                if (m->format != fp4_format::MXFP4) continue;
                const uint8_t * s = m->scale->as<uint8_t>();
                for (int64_t i = 0; i < m->scale->numel(); ++i)
                    if (s[i] == 0xFF) {
                        bad.push_back(fmt::format("layer {} expert {}: weight_scale byte {} (row {}, block {}) is 0xFF, "
                                                  "the E8M0 NaN", l, e, i, i / m->scale->shape[1], i % m->scale->shape[1]));
                        break;
                    }
            }
        }
    }
    return bad;
}

} // namespace perigee
