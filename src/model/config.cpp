// Strict config.json parsing. Every key of every object is either read, or listed as ignored with a
// reason, or an error. See config.h for the three forms.
#include "model/config.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace perigee {

using json = nlohmann::json;

std::string_view model_variant_name(model_variant v) {
    switch (v) {
        case model_variant::KIMI_LINEAR: return "kimi_linear";
        case model_variant::K3: return "kimi_k3";
        case model_variant::K31: return "kimi_k31";
    }
    return "?";
}

std::string_view config_form_name(kimi_config_form f) {
    switch (f) {
        case kimi_config_form::PUBLISHED: return "published";
        case kimi_config_form::TRANSFORMERS: return "transformers";
        case kimi_config_form::K3_WRAPPER: return "k3-wrapper";
    }
    return "?";
}

int64_t kimi_config::n_kda_layers() const {
    int64_t n = 0;
    for (bool b : layer_is_kda) n += b;
    return n;
}
int64_t kimi_config::n_mla_layers() const { return num_hidden_layers - n_kda_layers(); }

namespace {

// Reads keys of one JSON object, remembering which were consumed; finish() rejects the rest.
class key_reader {
public:
    key_reader(const json & obj, std::string where) : obj_(obj), where_(std::move(where)) {
        PG_CHECK(obj_.is_object(), "{}: expected a JSON object", where_);
    }
    bool has(const std::string & k) const { return obj_.contains(k) && !obj_.at(k).is_null(); }
    bool present(const std::string & k) const { return obj_.contains(k); }
    const json & raw(const std::string & k) {
        used_.insert(k);
        PG_CHECK(obj_.contains(k), "{}: missing required key '{}'", where_, k);
        return obj_.at(k);
    }
    int64_t req_int(const std::string & k) { return as_int(k, raw(k)); }
    double req_num(const std::string & k) { return as_num(k, raw(k)); }
    bool req_bool(const std::string & k) { return as_bool(k, raw(k)); }
    std::string req_str(const std::string & k) { return as_str(k, raw(k)); }
    std::optional<int64_t> opt_int(const std::string & k) {
        used_.insert(k);
        return has(k) ? std::optional<int64_t>(as_int(k, obj_.at(k))) : std::nullopt;
    }
    std::optional<double> opt_num(const std::string & k) {
        used_.insert(k);
        return has(k) ? std::optional<double>(as_num(k, obj_.at(k))) : std::nullopt;
    }
    std::optional<bool> opt_bool(const std::string & k) {
        used_.insert(k);
        return has(k) ? std::optional<bool>(as_bool(k, obj_.at(k))) : std::nullopt;
    }
    std::optional<std::string> opt_str(const std::string & k) {
        used_.insert(k);
        return has(k) ? std::optional<std::string>(as_str(k, obj_.at(k))) : std::nullopt;
    }
    std::vector<int64_t> int_list(const std::string & k) {
        const json & v = raw(k);
        PG_CHECK(v.is_array(), "{}: key '{}' must be a list of integers", where_, k);
        std::vector<int64_t> r;
        for (const auto & e : v) r.push_back(as_int(k, e));
        return r;
    }
    std::vector<std::string> str_list(const std::string & k) {
        const json & v = raw(k);
        PG_CHECK(v.is_array(), "{}: key '{}' must be a list of strings", where_, k);
        std::vector<std::string> r;
        for (const auto & e : v) r.push_back(as_str(k, e));
        return r;
    }
    // A key we know and deliberately do not use; the reason documents why that is safe.
    void ignore(const std::string & k, const char * /*reason*/) { used_.insert(k); }
    void finish() const {
        for (auto it = obj_.begin(); it != obj_.end(); ++it)
            PG_CHECK(used_.count(it.key()), "{}: unknown key '{}' (not part of the {} schema this engine knows)",
                     where_, it.key(), where_);
    }
    const std::string & where() const { return where_; }

private:
    int64_t as_int(const std::string & k, const json & v) const {
        PG_CHECK(v.is_number_integer(), "{}: key '{}' must be an integer, got {}", where_, k, v.dump());
        return v.get<int64_t>();
    }
    double as_num(const std::string & k, const json & v) const {
        PG_CHECK(v.is_number(), "{}: key '{}' must be a number, got {}", where_, k, v.dump());
        return v.get<double>();
    }
    bool as_bool(const std::string & k, const json & v) const {
        PG_CHECK(v.is_boolean(), "{}: key '{}' must be true or false, got {}", where_, k, v.dump());
        return v.get<bool>();
    }
    std::string as_str(const std::string & k, const json & v) const {
        PG_CHECK(v.is_string(), "{}: key '{}' must be a string, got {}", where_, k, v.dump());
        return v.get<std::string>();
    }
    const json & obj_;
    std::string where_;
    std::set<std::string> used_;
};

// Keys every form may carry that do not change the computation.
void ignore_bookkeeping(key_reader & r) {
    r.ignore("architectures", "class names for other frameworks; the model_type decides");
    r.ignore("auto_map", "remote-code entry points for transformers");
    r.ignore("transformers_version", "provenance only");
    r.ignore("torch_dtype", "storage dtype; each tensor's own dtype is read from the shards");
    r.ignore("dtype", "storage dtype; each tensor's own dtype is read from the shards");
    r.ignore("initializer_range", "training-time init");
    r.ignore("use_cache", "a transformers runtime switch");
    r.ignore("output_attentions", "a transformers runtime switch");
    r.ignore("output_hidden_states", "a transformers runtime switch");
    r.ignore("return_dict", "a transformers runtime switch");
    r.ignore("_name_or_path", "provenance only");
}

void set_eos(kimi_config & c, const json & v, const std::string & where) {
    c.eos_token_ids.clear();
    if (v.is_number_integer()) c.eos_token_ids.push_back(v.get<int64_t>());
    else if (v.is_array())
        for (const auto & e : v) {
            PG_CHECK(e.is_number_integer(), "{}: eos_token_id entries must be integers", where);
            c.eos_token_ids.push_back(e.get<int64_t>());
        }
    else PG_FAIL("{}: eos_token_id must be an integer or a list of integers, got {}", where, v.dump());
}

void read_token_ids(key_reader & r, kimi_config & c) {
    if (auto v = r.opt_int("bos_token_id")) c.bos_token_id = *v;
    if (auto v = r.opt_int("pad_token_id")) c.pad_token_id = *v;
    if (r.has("eos_token_id")) set_eos(c, r.raw("eos_token_id"), r.where());
    else r.ignore("eos_token_id", "null");
}

// num_hidden_layers sizes per-layer tables as soon as the layer lists are read, so it is bounded right where it is read
// (fuzz_config finding #10: 281474976710656 layers made layers_from_lists allocate 1 PiB). The largest real model has
// fewer than 100 layers; 1024 leaves room for any plausible K3 variant.
constexpr int64_t k_max_layers = 1024;
int64_t read_layer_count(key_reader & r) {
    const int64_t L = r.req_int("num_hidden_layers");
    PG_CHECK(L >= 1 && L <= k_max_layers, "{}: num_hidden_layers {} is outside 1..{}", r.where(), L, k_max_layers);
    return L;
}

// 1-based layer lists -> per-layer flags; the lists must partition 1..L.
void layers_from_lists(kimi_config & c, const std::vector<int64_t> & kda, const std::vector<int64_t> & full,
                       const std::string & where) {
    const int64_t L = c.num_hidden_layers;
    std::vector<int> seen(size_t(L), 0);
    c.layer_is_kda.assign(size_t(L), false);
    auto mark = [&](const std::vector<int64_t> & list, const char * name, bool is_kda) {
        for (int64_t l : list) {
            PG_CHECK(l >= 1 && l <= L, "{}: linear_attn_config.{} entry {} is outside 1..{} (the lists are 1-based)",
                     where, name, l, L);
            PG_CHECK(seen[size_t(l - 1)]++ == 0, "{}: layer {} appears twice in kda_layers/full_attn_layers", where, l);
            c.layer_is_kda[size_t(l - 1)] = is_kda;
        }
    };
    mark(kda, "kda_layers", true);
    mark(full, "full_attn_layers", false);
    for (int64_t l = 0; l < L; ++l)
        PG_CHECK(seen[size_t(l)] == 1, "{}: layer {} (1-based) is in neither kda_layers nor full_attn_layers; "
                 "the two lists must partition 1..{}", where, l + 1, L);
}

void derive_moe_layers(kimi_config & c) {
    PG_CHECK(c.moe_layer_freq >= 1 && c.first_k_dense_replace >= 0,
             "moe_layer_freq must be >= 1 and first_k_dense_replace >= 0 (got {} and {})", c.moe_layer_freq,
             c.first_k_dense_replace);
    c.layer_is_moe.assign(size_t(c.num_hidden_layers), false);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        c.layer_is_moe[size_t(l)] = c.num_experts > 0 && l >= c.first_k_dense_replace && l % c.moe_layer_freq == 0;
}

void read_linear_attn_config(kimi_config & c, const json & v, const std::string & where, bool k3) {
    key_reader r(v, where + ": linear_attn_config");
    c.kda_num_heads = r.req_int("num_heads");
    c.kda_head_dim = r.req_int("head_dim");
    c.kda_short_conv_kernel_size = r.req_int("short_conv_kernel_size");
    const auto kda = r.int_list("kda_layers");
    const auto full = r.int_list("full_attn_layers");
    if (k3) {
        c.kda_use_full_rank_gate = r.req_bool("use_full_rank_gate");
        c.kda_gate_lower_bound = float(r.req_num("gate_lower_bound"));
    } else {
        c.kda_use_full_rank_gate = r.opt_bool("use_full_rank_gate").value_or(false);
        c.kda_gate_lower_bound = float(r.opt_num("gate_lower_bound").value_or(0.0));
    }
    PG_CHECK(c.kda_gate_lower_bound <= 0, "{}: linear_attn_config.gate_lower_bound must be negative (or absent), got {}",
             where, c.kda_gate_lower_bound);
    r.finish();
    layers_from_lists(c, kda, full, where);
}

void read_quantization_config(kimi_config & c, const json & v, const std::string & where) {
    key_reader r(v, where + ": quantization_config");
    const std::string method = r.req_str("quant_method");
    PG_CHECK(method == "compressed-tensors", "{}: quantization_config.quant_method '{}' is not supported "
             "(compressed-tensors only)", where, method);
    const std::string format = r.req_str("format");
    if (format == "mxfp4-pack-quantized") c.experts = expert_format::MXFP4;
    else if (format == "nvfp4-pack-quantized") c.experts = expert_format::NVFP4;
    else PG_FAIL("{}: quantization_config.format '{}' is not supported (mxfp4-pack-quantized, nvfp4-pack-quantized)",
                 where, format);
    // The group descriptions and the ignore list are checked against the tensors themselves by the
    // weight declarations (each expert matrix must be present in the declared FP4 form).
    r.ignore("config_groups", "the expert tensors' dtypes and shapes are checked at load");
    r.ignore("ignore", "only block_sparse_moe.experts.* are quantized; checked through the declarations");
    r.ignore("kv_cache_scheme", "must be null: the KV cache is not quantized");
    r.ignore("quantization_status", "provenance only");
    r.ignore("global_compression_ratio", "provenance only");
    r.ignore("sparsity_config", "no sparsity");
    r.ignore("version", "provenance only");
    r.ignore("mxfp4_kept", "tensors perigee convert left in MXFP4; read from the tensors' dtypes");
    r.finish();
}

void read_dsa_config(kimi_config & c, const json & v, const std::string & where) {
    key_reader r(v, where + ": dsa_config");
    const auto dsa = r.int_list("dsa_layers");
    const int64_t rope = r.req_int("index_rope_dim");
    PG_CHECK(rope == 0, "{}: dsa_config.index_rope_dim {} is not supported (the K3.1 indexer has no RoPE)", where, rope);
    // ARCHITECTURE §5.3: the key names besides dsa_layers/index_rope_dim are reconstructed; accept aliases.
    auto alias = [&](std::initializer_list<const char *> names, const char * what) {
        std::optional<int64_t> v;
        std::string found;
        for (const char * n : names)
            if (auto x = r.opt_int(n)) {
                PG_CHECK(!v, "{}: dsa_config gives {} twice ('{}' and '{}')", where, what, found, n);
                v = x;
                found = n;
            }
        PG_CHECK(v.has_value(), "{}: dsa_config is missing {} (one of the keys {})", where, what,
                 fmt::format("{}", fmt::join(names, ", ")));
        return *v;
    };
    c.index_n_heads = alias({"index_n_heads", "num_heads", "n_heads"}, "the indexer head count");
    c.index_head_dim = alias({"index_head_dim", "head_dim"}, "the indexer head dim");
    c.index_topk = alias({"index_topk", "topk"}, "the indexer top-k");
    r.finish();
    c.layer_is_dsa.assign(size_t(c.num_hidden_layers), false);
    for (int64_t l : dsa) {
        PG_CHECK(l >= 1 && l <= c.num_hidden_layers, "{}: dsa_config.dsa_layers entry {} is outside 1..{} (1-based)", where, l,
                 c.num_hidden_layers);
        PG_CHECK(!c.layer_is_kda[size_t(l - 1)], "{}: dsa_config.dsa_layers names layer {} (1-based), which is a KDA layer; "
                 "the indexer runs on MLA layers", where, l);
        c.layer_is_dsa[size_t(l - 1)] = true;
    }
}

// The kimi_linear text config in the published (configuration_kimi.py) form, with the K3 keys.
void read_published_text_config(kimi_config & c, key_reader & r, bool k3) {
    ignore_bookkeeping(r);
    c.vocab_size = r.req_int("vocab_size");
    c.hidden_size = r.req_int("hidden_size");
    c.intermediate_size = r.req_int("intermediate_size");
    c.num_hidden_layers = read_layer_count(r);
    c.num_attention_heads = r.req_int("num_attention_heads");
    const int64_t kvh = r.opt_int("num_key_value_heads").value_or(c.num_attention_heads);
    PG_CHECK(kvh == c.num_attention_heads, "{}: num_key_value_heads {} != num_attention_heads {} is not supported for MLA",
             r.where(), kvh, c.num_attention_heads);
    c.rms_norm_eps = float(r.req_num("rms_norm_eps"));
    c.tie_word_embeddings = r.opt_bool("tie_word_embeddings").value_or(false);
    if (auto v = r.opt_int("max_position_embeddings")) c.max_position_embeddings = *v;
    if (auto v = r.opt_int("model_max_length")) c.max_position_embeddings = std::max(c.max_position_embeddings, *v);
    read_token_ids(r, c);

    const std::string act = r.req_str("hidden_act");
    if (act == "silu") c.hidden_act = glu_act::SILU;
    else if (act == "situ") c.hidden_act = glu_act::SITU;
    else PG_FAIL("{}: hidden_act '{}' is not supported (silu, situ)", r.where(), act);

    // MLA
    c.q_lora_rank = r.opt_int("q_lora_rank").value_or(0);
    r.raw("q_lora_rank");  // the key itself is required (null = q_proj directly)
    c.kv_lora_rank = r.req_int("kv_lora_rank");
    c.qk_nope_head_dim = r.req_int("qk_nope_head_dim");
    c.qk_rope_head_dim = r.req_int("qk_rope_head_dim");
    c.v_head_dim = r.req_int("v_head_dim");
    const bool nope = r.req_bool("mla_use_nope");
    PG_CHECK(nope, "{}: mla_use_nope=false (rotary MLA) is not supported by this engine", r.where());
    r.ignore("head_dim", "hidden/heads; used by neither KDA (linear_attn_config.head_dim) nor MLA (qk_*_head_dim)");
    r.ignore("rope_theta", "MLA is NoPE (mla_use_nope): no rotary embedding anywhere");
    if (r.has("rope_scaling")) PG_FAIL("{}: rope_scaling must be null for a NoPE model", r.where());
    r.ignore("rope_scaling", "null");

    // MoE
    c.num_experts = r.req_int("num_experts");
    c.num_experts_per_token = r.req_int("num_experts_per_token");
    c.num_shared_experts = r.req_int("num_shared_experts");
    c.moe_intermediate_size = r.req_int("moe_intermediate_size");
    c.first_k_dense_replace = r.req_int("first_k_dense_replace");
    c.moe_layer_freq = r.req_int("moe_layer_freq");
    c.moe_renormalize = r.req_bool("moe_renormalize");
    c.routed_scaling_factor = float(r.req_num("routed_scaling_factor"));
    const std::string ract = r.req_str("moe_router_activation_func");
    if (ract == "sigmoid") c.moe_router_activation_func = router_act::SIGMOID;
    else if (ract == "softmax") c.moe_router_activation_func = router_act::SOFTMAX;
    else PG_FAIL("{}: moe_router_activation_func '{}' is not supported (sigmoid, softmax)", r.where(), ract);
    const bool grouped = r.req_bool("use_grouped_topk");
    c.num_expert_group = r.req_int("num_expert_group");
    c.topk_group = r.req_int("topk_group");
    if (!grouped) c.num_expert_group = c.topk_group = 1;
    if (auto m = r.opt_str("topk_method"))
        PG_CHECK(*m == "noaux_tc", "{}: topk_method '{}' is not supported (noaux_tc)", r.where(), *m);
    const int64_t mtp = r.opt_int("num_nextn_predict_layers").value_or(0);
    PG_CHECK(mtp == 0, "{}: num_nextn_predict_layers {} (MTP heads) is not supported", r.where(), mtp);

    // K3 extensions: required for K3, optional with the reference's meaning of absence for Kimi-Linear.
    auto k3_int = [&](const char * k) { return k3 ? r.req_int(k) : r.opt_int(k).value_or(0); };
    c.attn_res_block_size = k3_int("attn_res_block_size");
    c.routed_expert_hidden_size = k3_int("routed_expert_hidden_size");
    c.latent_moe_use_norm = k3 ? r.req_bool("latent_moe_use_norm") : r.opt_bool("latent_moe_use_norm").value_or(false);
    c.mla_use_output_gate = k3 ? r.req_bool("mla_use_output_gate") : r.opt_bool("mla_use_output_gate").value_or(false);
    if (auto b = r.opt_num("activation_situ_beta")) c.activation_situ_beta = float(*b);
    else PG_CHECK(!k3, "{}: missing required key 'activation_situ_beta'", r.where());
    if (auto b = r.opt_num("activation_situ_linear_beta")) c.activation_situ_linear_beta = float(*b);
    else PG_CHECK(!k3, "{}: missing required key 'activation_situ_linear_beta'", r.where());
    if (c.routed_expert_hidden_size > 0)
        PG_CHECK(c.latent_moe_use_norm, "{}: latent MoE without latent_moe_use_norm is not supported", r.where());

    read_linear_attn_config(c, r.raw("linear_attn_config"), r.where(), k3);
    if (r.has("quantization_config")) read_quantization_config(c, r.raw("quantization_config"), r.where());
    else r.ignore("quantization_config", "null: experts are dense");
    if (r.has("dsa_config")) read_dsa_config(c, r.raw("dsa_config"), r.where());
    else r.ignore("dsa_config", "null");
    r.finish();
}


// The transformers-native form written by KimiLinearConfig.save_pretrained (transformers 5.x,
// ARCHITECTURE §1.2; tools/golden/README.md lists what 5.17 writes). Layer kinds come from
// layer_types / mlp_layer_types instead of the 1-based lists. The native port only implements the
// sigmoid router with grouped top-k and the softplus KDA gate; it has no K3 keys.
void read_native_config(kimi_config & c, key_reader & r) {
    ignore_bookkeeping(r);
    r.ignore("attention_bias", "must be false: checked below");
    r.ignore("attention_dropout", "training only");
    r.ignore("pretraining_tp", "training only");
    r.ignore("head_dim", "written as qk_rope_head_dim by transformers; unused");
    r.ignore("qk_head_dim", "derived: qk_nope_head_dim + qk_rope_head_dim, checked below");
    // opt_bool checks the type (a number here was an unchecked json::get<bool> that escaped as nlohmann's type_error:
    // fuzz_config finding #8)
    if (const auto ab = r.opt_bool("attention_bias")) PG_CHECK(!*ab, "{}: attention_bias=true is not supported", r.where());
    c.vocab_size = r.req_int("vocab_size");
    c.hidden_size = r.req_int("hidden_size");
    c.intermediate_size = r.req_int("intermediate_size");
    c.num_hidden_layers = read_layer_count(r);
    c.num_attention_heads = r.req_int("num_attention_heads");
    const int64_t kvh = r.req_int("num_key_value_heads");
    PG_CHECK(kvh == c.num_attention_heads, "{}: num_key_value_heads {} != num_attention_heads {}", r.where(), kvh,
             c.num_attention_heads);
    c.rms_norm_eps = float(r.req_num("rms_norm_eps"));
    c.tie_word_embeddings = r.req_bool("tie_word_embeddings");
    if (auto v = r.opt_int("model_max_length")) c.max_position_embeddings = *v;
    if (auto v = r.opt_int("max_position_embeddings")) c.max_position_embeddings = *v;
    read_token_ids(r, c);
    const std::string act = r.req_str("hidden_act");
    PG_CHECK(act == "silu", "{}: hidden_act '{}' is not supported in the transformers-native form (silu)", r.where(), act);
    c.hidden_act = glu_act::SILU;
    c.q_lora_rank = r.opt_int("q_lora_rank").value_or(0);
    r.raw("q_lora_rank");
    c.kv_lora_rank = r.req_int("kv_lora_rank");
    c.qk_nope_head_dim = r.req_int("qk_nope_head_dim");
    c.qk_rope_head_dim = r.req_int("qk_rope_head_dim");
    c.v_head_dim = r.req_int("v_head_dim");
    if (auto v = r.opt_int("qk_head_dim"))
        PG_CHECK(*v == c.qk_nope_head_dim + c.qk_rope_head_dim, "{}: qk_head_dim {} != qk_nope_head_dim + qk_rope_head_dim",
                 r.where(), *v);
    c.kda_num_heads = r.req_int("linear_num_heads");
    c.kda_head_dim = r.req_int("linear_head_dim");
    c.kda_short_conv_kernel_size = r.req_int("linear_conv_kernel_dim");
    c.num_experts = r.req_int("num_experts");
    c.num_experts_per_token = r.req_int("num_experts_per_token");
    c.num_shared_experts = r.req_int("num_shared_experts");
    c.moe_intermediate_size = r.req_int("moe_intermediate_size");
    c.moe_renormalize = r.req_bool("moe_renormalize");
    c.routed_scaling_factor = float(r.req_num("routed_scaling_factor"));
    c.num_expert_group = r.req_int("num_expert_group");
    c.topk_group = r.req_int("topk_group");
    c.moe_router_activation_func = router_act::SIGMOID;
    const auto lt = r.str_list("layer_types");
    const auto mt = r.str_list("mlp_layer_types");
    PG_CHECK(int64_t(lt.size()) == c.num_hidden_layers && int64_t(mt.size()) == c.num_hidden_layers,
             "{}: layer_types ({}) and mlp_layer_types ({}) must have num_hidden_layers = {} entries", r.where(), lt.size(),
             mt.size(), c.num_hidden_layers);
    for (size_t l = 0; l < lt.size(); ++l) {
        PG_CHECK(lt[l] == "linear_attention" || lt[l] == "full_attention", "{}: layer_types[{}] = '{}' (linear_attention, "
                 "full_attention)", r.where(), l, lt[l]);
        PG_CHECK(mt[l] == "dense" || mt[l] == "sparse", "{}: mlp_layer_types[{}] = '{}' (dense, sparse)", r.where(), l, mt[l]);
        c.layer_is_kda.push_back(lt[l] == "linear_attention");
        c.layer_is_moe.push_back(mt[l] == "sparse");
    }
    r.finish();
}

void validate(const kimi_config & c, const std::string & where) {
    auto pos = [&](int64_t v, const char * k) { PG_CHECK(v > 0, "{}: {} must be positive, got {}", where, k, v); };
    pos(c.vocab_size, "vocab_size");
    pos(c.hidden_size, "hidden_size");
    pos(c.num_hidden_layers, "num_hidden_layers");
    pos(c.kda_num_heads, "linear_attn_config.num_heads");
    pos(c.kda_head_dim, "linear_attn_config.head_dim");
    pos(c.kda_short_conv_kernel_size, "linear_attn_config.short_conv_kernel_size");
    PG_CHECK(c.rms_norm_eps > 0, "{}: rms_norm_eps must be positive", where);
    if (c.n_mla_layers() > 0) {
        pos(c.num_attention_heads, "num_attention_heads");
        pos(c.kv_lora_rank, "kv_lora_rank");
        pos(c.qk_nope_head_dim, "qk_nope_head_dim");
        pos(c.v_head_dim, "v_head_dim");
        PG_CHECK(c.qk_rope_head_dim >= 0 && c.q_lora_rank >= 0, "{}: negative MLA dims", where);
    }
    PG_CHECK(c.first_k_dense_replace >= 0 && c.moe_layer_freq >= 1, "{}: bad first_k_dense_replace/moe_layer_freq", where);
    if (c.num_experts > 0) {
        PG_CHECK(c.num_experts_per_token > 0 && c.num_experts_per_token <= c.num_experts,
                 "{}: num_experts_per_token {} must be in 1..num_experts {}", where, c.num_experts_per_token, c.num_experts);
        pos(c.moe_intermediate_size, "moe_intermediate_size");
        PG_CHECK(c.num_expert_group >= 1 && c.num_experts % c.num_expert_group == 0 && c.topk_group >= 1 &&
                     c.topk_group <= c.num_expert_group,
                 "{}: {} experts cannot be split into num_expert_group={} keeping topk_group={}", where, c.num_experts,
                 c.num_expert_group, c.topk_group);
    }
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        if (!c.layer_is_moe[size_t(l)]) pos(c.intermediate_size, "intermediate_size");
    PG_CHECK(c.attn_res_block_size >= 0, "{}: attn_res_block_size must be >= 0", where);
    PG_CHECK(c.activation_situ_beta > 0, "{}: activation_situ_beta must be positive", where);
}

} // namespace

kimi_config config_parse(const std::string & text, const std::string & where) {
    // nlohmann's lexer ends the input at a NUL byte and ignores whatever follows it, so `{...}\0garbage` would parse
    // (the same finding as fuzz_server_request #6); JSON text has no raw NUL, so it is refused by name.
    if (const size_t nul = text.find('\0'); nul != std::string::npos)
        PG_FAIL("{}: not valid JSON: a NUL byte at offset {}", where, nul);
    json j;
    try {
        j = json::parse(text);
    } catch (const json::exception & e) {  // parse_error, and out_of_range 406 (number overflow, e.g. 1e3092)
        PG_FAIL("{}: not valid JSON: {}", where, e.what());
    }
    PG_CHECK(j.is_object(), "{}: the top level must be a JSON object", where);
    PG_CHECK(j.contains("model_type") && j["model_type"].is_string(), "{}: missing required key 'model_type'", where);
    const std::string mt = j["model_type"].get<std::string>();

    kimi_config c;
    if (mt == "kimi_k3" || mt == "kimi_k31") {
        c.variant = mt == "kimi_k3" ? model_variant::K3 : model_variant::K31;
        c.config_form = kimi_config_form::K3_WRAPPER;
        c.tensor_prefix = "language_model.";
        key_reader w(j, where);
        w.raw("model_type");
        ignore_bookkeeping(w);
        w.ignore("vision_config", "the vision tower is not served; its tensors are declared ignored");
        w.ignore("media_placeholder_token_id", "vision input only");
        read_token_ids(w, c);
        const bool tie = w.opt_bool("tie_word_embeddings").value_or(false);
        const json & tc = w.raw("text_config");
        w.finish();
        key_reader r(tc, where + ": text_config");
        const std::string tmt = r.req_str("model_type");
        PG_CHECK(tmt == "kimi_linear", "{}: text_config.model_type is '{}', expected kimi_linear", where, tmt);
        const kimi_config outer = c;
        read_published_text_config(c, r, true);
        // The wrapper's token ids win where both give them (the wrapper is what HF reads first).
        if (outer.bos_token_id >= 0) c.bos_token_id = outer.bos_token_id;
        if (!outer.eos_token_ids.empty()) c.eos_token_ids = outer.eos_token_ids;
        if (outer.pad_token_id >= 0) c.pad_token_id = outer.pad_token_id;
        PG_CHECK(tie == c.tie_word_embeddings, "{}: tie_word_embeddings differs between the wrapper and text_config", where);
        // Variant gating, config half (ARCHITECTURE §1.4, trap 35): K3.1 iff the wrapper says kimi_k31
        // AND dsa_config is present. The tensor half is checked by the weight declarations.
        const bool has_dsa = !c.layer_is_dsa.empty();
        PG_CHECK(!(c.variant == model_variant::K31 && !has_dsa),
                 "{}: model_type is kimi_k31 but text_config has no dsa_config; a K3.1 Pro tree needs both", where);
        PG_CHECK(!(c.variant == model_variant::K3 && has_dsa),
                 "{}: model_type is kimi_k3 but text_config has a dsa_config (a K3.1 Pro signal); refusing to guess "
                 "the variant", where);
    } else if (mt == "kimi_linear") {
        key_reader r(j, where);
        r.raw("model_type");
        if (j.contains("linear_attn_config")) {
            c.config_form = kimi_config_form::PUBLISHED;
            read_published_text_config(c, r, false);
        } else {
            c.config_form = kimi_config_form::TRANSFORMERS;
            read_native_config(c, r);
        }
        PG_CHECK(c.layer_is_dsa.empty(), "{}: a kimi_linear config with dsa_config: the indexer is only known in "
                 "kimi_k31 wrappers", where);
    } else {
        PG_FAIL("{}: model_type '{}' is not supported (kimi_linear, kimi_k3, kimi_k31)", where, mt);
    }
    if (c.layer_is_dsa.empty()) c.layer_is_dsa.assign(size_t(c.num_hidden_layers), false);
    if (c.layer_is_moe.empty()) derive_moe_layers(c);
    validate(c, where);
    return c;
}

kimi_config config_load(const std::string & dir) {
    const std::string path = dir + "/config.json";
    std::ifstream f(path);
    PG_CHECK(f.good(), "cannot open {}", path);
    std::stringstream ss;
    ss << f.rdbuf();
    kimi_config c = config_parse(ss.str(), path);
    // generation_config.json may name more stop ids (trap 39: 163586 vs 163585); stop on all of them.
    std::ifstream g(dir + "/generation_config.json");
    if (g.good()) {
        std::stringstream gs;
        gs << g.rdbuf();
        const std::string gtext = gs.str();
        if (const size_t nul = gtext.find('\0'); nul != std::string::npos)
            PG_FAIL("{}/generation_config.json: not valid JSON: a NUL byte at offset {}", dir, nul);
        json gj;
        try {
            gj = json::parse(gtext);
        } catch (const json::exception & e) {  // parse_error, and out_of_range 406 (number overflow, e.g. 1e3092)
            PG_FAIL("{}/generation_config.json: not valid JSON: {}", dir, e.what());
        }
        if (gj.contains("eos_token_id") && !gj["eos_token_id"].is_null()) {
            kimi_config tmp;
            set_eos(tmp, gj["eos_token_id"], dir + "/generation_config.json");
            for (int64_t id : tmp.eos_token_ids)
                if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
                    c.eos_token_ids.push_back(id);
        }
    }
    return c;
}

std::string config_summary(const kimi_config & c) {
    std::string s = fmt::format("{} ({} config): {} layers ({} KDA, {} MLA), hidden {}, vocab {}\n",
                                model_variant_name(c.variant), config_form_name(c.config_form), c.num_hidden_layers, c.n_kda_layers(),
                                c.n_mla_layers(), c.hidden_size, c.vocab_size);
    s += fmt::format("  KDA: {} heads x {}, conv {}, gate {}, output gate {}\n", c.kda_num_heads, c.kda_head_dim,
                     c.kda_short_conv_kernel_size,
                     c.kda_gate_lower_bound < 0 ? fmt::format("lower bound {}", c.kda_gate_lower_bound) : "softplus",
                     c.kda_use_full_rank_gate ? "full rank" : "low rank");
    s += fmt::format("  MLA: {} heads, q_lora {}, kv_lora {}, qk {}+{}, v {}, output gate {}\n", c.num_attention_heads,
                     c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                     c.mla_use_output_gate ? "yes" : "no");
    s += fmt::format("  MoE: {} experts, top-{}, groups {}/{}, shared {}, width {}, latent {}, experts {}, "
                     "{} dense layer(s) (width {})\n",
                     c.num_experts, c.num_experts_per_token, c.topk_group, c.num_expert_group, c.num_shared_experts,
                     c.moe_intermediate_size, c.routed_expert_hidden_size,
                     c.experts == expert_format::MXFP4 ? "MXFP4" : c.experts == expert_format::NVFP4 ? "NVFP4" : "dense",
                     std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), false), c.intermediate_size);
    s += fmt::format("  act {}, AttnRes block {}, indexer {}\n", c.hidden_act == glu_act::SITU ? "situ" : "silu",
                     c.attn_res_block_size,
                     c.variant == model_variant::K31
                         ? fmt::format("{} heads x {}, top-{}", c.index_n_heads, c.index_head_dim, c.index_topk)
                         : "none");
    return s;
}

} // namespace perigee
