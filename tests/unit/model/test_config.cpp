// Strict config parsing (issue 2 item 4, issue 3 item 1; ARCHITECTURE §1, traps 33/34/35 config half) and the
// declared tensor set of the full K3 geometry (§2.2-2.4; traps 15/24/29/31/41 as header shape/count checks).
// Every defect must be rejected with a message naming the key and the file.
#include "model/config.h"
#include "model/synth.h"
#include "model/weights.h"
#include "model_test_util.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

namespace perigee::test {
namespace {

using json = nlohmann::json;
const char * k_where = "cfgtest/config.json";

json load_json(const std::string & rel) { return json::parse(read_text(repo_path(rel))); }
json native_cfg() { return load_json("tests/golden/kimi_linear/basic/config.json"); }
json published_cfg() { return load_json("tests/golden/kimi_linear/published_form/config.json"); }
json k3_tiny_cfg() { return json::parse(synth_config_json("k3-tiny")); }
json k31_tiny_cfg() { return json::parse(synth_config_json("k31-tiny")); }

// ARCHITECTURE §1.5, the proposed complete K3 config, verbatim (dimensions, lists, quantization_config).
const char * k_k3_full = R"({
  "architectures": ["KimiK3ForConditionalGeneration"],
  "model_type": "kimi_k3",
  "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
  "media_placeholder_token_id": 163605,
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 33792,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": true,
    "mla_use_output_gate": true,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": false,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": true,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": true,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": true,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 12,
    "eos_token_id": 163586,
    "linear_attn_config": {
      "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
      "use_full_rank_gate": true, "gate_lower_bound": -5.0,
      "full_attn_layers": [4,8,12,16,20,24,28,32,36,40,44,48,52,56,60,64,68,72,76,80,84,88,92,93],
      "kda_layers": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26,27,29,30,31,33,34,35,
                     37,38,39,41,42,43,45,46,47,49,50,51,53,54,55,57,58,59,61,62,63,65,66,67,
                     69,70,71,73,74,75,77,78,79,81,82,83,85,86,87,89,90,91]
    },
    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 4, "group_size": 32, "type": "float", "symmetric": true,
                    "strategy": "group", "scale_dtype": "torch.uint8"}}},
      "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                 "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
    }
  },
  "vision_config": {"patch_size": 14, "vt_hidden_size": 1024}
})";
const std::vector<int64_t> k_k3_mla0 = {3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79, 83, 87, 91, 92};

json k3_full() { return json::parse(k_k3_full); }
json k31_full() {
    json j = k3_full();
    j["model_type"] = "kimi_k31";
    j["text_config"]["dsa_config"] = {{"dsa_layers", j["text_config"]["linear_attn_config"]["full_attn_layers"]},
                                      {"index_rope_dim", 0}, {"index_n_heads", 32}, {"index_head_dim", 128},
                                      {"index_topk", 2048}};
    return j;
}

kimi_config parse(const json & j) { return config_parse(j.dump(), k_where); }

// Expects config_parse to throw with a message that contains every one of `needles` and the file name.
void expect_rejected(const json & j, std::vector<std::string> needles, const std::string & what) {
    const std::string msg = error_of([&] { parse(j); });
    ASSERT_FALSE(msg.empty()) << what << ": accepted, expected an error";
    needles.push_back(k_where);
    for (const auto & n : needles) EXPECT_NE(msg.find(n), std::string::npos) << what << ": message lacks '" << n << "': " << msg;
    std::printf("[rejected] %s: %s\n", what.c_str(), msg.c_str());
}

std::vector<int64_t> mla_layers(const kimi_config & c) {
    std::vector<int64_t> v;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        if (!c.layer_is_kda[size_t(l)]) v.push_back(l);
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// The forms in the wild parse, with the derived tables right.

TEST(config_forms, transformers_native_form) {
    const kimi_config c = parse(native_cfg());
    EXPECT_EQ(c.config_form, kimi_config_form::TRANSFORMERS);
    EXPECT_EQ(c.variant, model_variant::KIMI_LINEAR);
    EXPECT_EQ(c.tensor_prefix, "");
    EXPECT_EQ(c.layer_is_kda, (std::vector<bool>{true, true, true, false}));
    EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, true, true, true}));
    EXPECT_EQ(c.q_lora_rank, 0);
    EXPECT_EQ(c.kda_num_heads, 2);
    EXPECT_EQ(c.kda_head_dim, 32);
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.num_experts_per_token, 2);
    EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.446f);
    EXPECT_EQ(c.kda_gate_lower_bound, 0.0f);   // softplus gate
}

// The words messages print for each form (config_summary, perigee inspect) are the ones the string field held.
TEST(config_forms, form_names_and_summary) {
    EXPECT_EQ(config_form_name(kimi_config_form::PUBLISHED), "published");
    EXPECT_EQ(config_form_name(kimi_config_form::TRANSFORMERS), "transformers");
    EXPECT_EQ(config_form_name(kimi_config_form::K3_WRAPPER), "k3-wrapper");
    EXPECT_NE(config_summary(parse(native_cfg())).find("(transformers config)"), std::string::npos);
    EXPECT_NE(config_summary(parse(published_cfg())).find("(published config)"), std::string::npos);
    EXPECT_NE(config_summary(parse(k3_full())).find("kimi_k3 (k3-wrapper config)"), std::string::npos);
    // Control: the summary of one form does not carry another's word.
    EXPECT_EQ(config_summary(parse(native_cfg())).find("(published config)"), std::string::npos);
}

TEST(config_forms, published_form_equals_its_native_twin) {
    const kimi_config p = parse(published_cfg());
    const kimi_config n = parse(load_json("tests/golden/kimi_linear/grouped_qlora/config.json"));
    EXPECT_EQ(p.config_form, kimi_config_form::PUBLISHED);
    EXPECT_EQ(n.config_form, kimi_config_form::TRANSFORMERS);
    EXPECT_EQ(p.layer_is_kda, (std::vector<bool>{true, false, true, true, false}));
    EXPECT_EQ(p.layer_is_kda, n.layer_is_kda);
    EXPECT_EQ(p.layer_is_moe, n.layer_is_moe);
    EXPECT_EQ(p.q_lora_rank, 40);
    EXPECT_EQ(p.q_lora_rank, n.q_lora_rank);
    EXPECT_EQ(p.num_expert_group, 4);
    EXPECT_EQ(p.topk_group, 2);
    EXPECT_EQ(p.num_expert_group, n.num_expert_group);
    EXPECT_EQ(p.num_shared_experts, n.num_shared_experts);
    EXPECT_EQ(p.kda_num_heads, n.kda_num_heads);
    EXPECT_EQ(p.kda_head_dim, n.kda_head_dim);
    EXPECT_EQ(p.num_experts, n.num_experts);
    EXPECT_EQ(p.routed_scaling_factor, n.routed_scaling_factor);
}

TEST(config_forms, trap_33_published_48b_layer_tables) {
    const kimi_config c = config_parse(read_text(repo_path("fixtures/configs/kimi-linear-48b-a3b.config.json")),
                                       "kimi-linear-48b-a3b.config.json");
    EXPECT_EQ(c.num_hidden_layers, 27);
    EXPECT_TRUE(c.layer_is_kda[0]) << "layer 0 must be KDA (1-based lists)";
    EXPECT_EQ(mla_layers(c), (std::vector<int64_t>{3, 7, 11, 15, 19, 23, 26}));
    EXPECT_FALSE(c.layer_is_moe[0]);
    for (int l = 1; l < 27; ++l) EXPECT_TRUE(c.layer_is_moe[size_t(l)]) << l;
    EXPECT_EQ(c.num_experts, 256);
    EXPECT_EQ(c.num_experts_per_token, 8);
    EXPECT_EQ(c.kda_num_heads, 32);
    EXPECT_EQ(c.kda_head_dim, 128);
    EXPECT_EQ(c.q_lora_rank, 0);
    EXPECT_FALSE(c.kda_use_full_rank_gate);
    EXPECT_EQ(c.attn_res_block_size, 0);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{163586}));
}

TEST(config_forms, trap_33_k3_full_config) {
    const kimi_config c = parse(k3_full());
    EXPECT_EQ(c.variant, model_variant::K3);
    EXPECT_EQ(c.config_form, kimi_config_form::K3_WRAPPER);
    EXPECT_EQ(c.tensor_prefix, "language_model.");
    EXPECT_EQ(c.num_hidden_layers, 93);
    EXPECT_EQ(mla_layers(c), k_k3_mla0);
    EXPECT_TRUE(c.layer_is_kda[0]);
    EXPECT_FALSE(c.layer_is_kda[91]);
    EXPECT_FALSE(c.layer_is_kda[92]);
    EXPECT_EQ(c.n_kda_layers(), 69);
    EXPECT_FALSE(c.layer_is_moe[0]);
    for (int l = 1; l < 93; ++l) EXPECT_TRUE(c.layer_is_moe[size_t(l)]) << l;
    // AttnRes, latent MoE, SiTU, gates
    EXPECT_EQ(c.attn_res_block_size, 12);
    EXPECT_EQ(c.routed_expert_hidden_size, 3584);
    EXPECT_TRUE(c.latent_moe_use_norm);
    EXPECT_EQ(c.hidden_act, glu_act::SITU);
    EXPECT_EQ(c.activation_situ_beta, 4.0f);
    EXPECT_EQ(c.activation_situ_linear_beta, 25.0f);
    EXPECT_TRUE(c.mla_use_output_gate);
    EXPECT_TRUE(c.kda_use_full_rank_gate);
    EXPECT_EQ(c.kda_gate_lower_bound, -5.0f);
    EXPECT_EQ(c.experts, expert_format::MXFP4);
    EXPECT_EQ(c.q_lora_rank, 1536);
    EXPECT_EQ(c.num_experts, 896);
    EXPECT_EQ(c.num_experts_per_token, 16);
    EXPECT_EQ(c.num_shared_experts, 2);
    EXPECT_EQ(c.routed_scaling_factor, 1.0f);
    EXPECT_EQ(c.intermediate_size, 33792);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{163586}));
    for (bool d : c.layer_is_dsa) EXPECT_FALSE(d);
}

TEST(config_forms, k31_full_config_indexer_on_every_mla_layer) {
    const kimi_config c = parse(k31_full());
    EXPECT_EQ(c.variant, model_variant::K31);
    EXPECT_EQ(c.index_n_heads, 32);
    EXPECT_EQ(c.index_head_dim, 128);
    EXPECT_EQ(c.index_topk, 2048);
    std::vector<int64_t> dsa;
    for (int64_t l = 0; l < 93; ++l)
        if (c.layer_is_dsa[size_t(l)]) dsa.push_back(l);
    EXPECT_EQ(dsa, k_k3_mla0);
}

TEST(config_forms, tiny_presets_parse) {
    const kimi_config k3 = parse(k3_tiny_cfg()), k31 = parse(k31_tiny_cfg());
    EXPECT_EQ(k3.variant, model_variant::K3);
    EXPECT_EQ(k31.variant, model_variant::K31);
    EXPECT_EQ(k31.index_topk, 8);
    EXPECT_EQ(mla_layers(k3), (std::vector<int64_t>{3, 7}));
}

// ---------------------------------------------------------------------------------------------------------
// Defects, each rejected naming the key and the file.

TEST(config_defects, unknown_key_top_level) {
    json a = native_cfg();
    a["bogus_key"] = 1;
    expect_rejected(a, {"unknown key 'bogus_key'"}, "native top level");
    json b = published_cfg();
    b["num_routed_experts"] = 256;   // a DeepSeek spelling: must not be silently ignored (trap 34)
    expect_rejected(b, {"unknown key 'num_routed_experts'"}, "published top level");
    json c = k3_full();
    c["bogus_key"] = true;
    expect_rejected(c, {"unknown key 'bogus_key'"}, "K3 wrapper top level");
}

TEST(config_defects, unknown_key_inside_linear_attn_config) {
    json a = published_cfg();
    a["linear_attn_config"]["expand_v"] = 1.0;   // fla's layer option (trap 44): not a Kimi checkpoint key
    expect_rejected(a, {"linear_attn_config", "unknown key 'expand_v'"}, "published linear_attn_config");
    json b = k3_full();
    b["text_config"]["linear_attn_config"]["chunk_size"] = 64;
    expect_rejected(b, {"linear_attn_config", "unknown key 'chunk_size'"}, "K3 linear_attn_config");
}

TEST(config_defects, unknown_key_inside_text_config) {
    json a = k3_full();
    a["text_config"]["num_experts_per_tok"] = 16;   // the HF-native spelling inside the published form (trap 34)
    expect_rejected(a, {"text_config", "unknown key 'num_experts_per_tok'"}, "K3 text_config");
}

TEST(config_defects, unknown_key_inside_dsa_config) {
    json a = k31_full();
    a["text_config"]["dsa_config"]["index_rope_theta"] = 10000;
    expect_rejected(a, {"dsa_config", "unknown key 'index_rope_theta'"}, "K3.1 dsa_config");
}

TEST(config_defects, unknown_key_inside_quantization_config) {
    json a = k3_full();
    a["text_config"]["quantization_config"]["bits"] = 4;
    expect_rejected(a, {"quantization_config", "unknown key 'bits'"}, "K3 quantization_config");
}

TEST(config_defects, missing_required_key) {
    json a = native_cfg();
    a.erase("hidden_size");
    expect_rejected(a, {"missing required key 'hidden_size'"}, "native hidden_size");
    json b = published_cfg();
    b.erase("num_experts");
    expect_rejected(b, {"missing required key 'num_experts'"}, "published num_experts");
    json c = published_cfg();
    c["linear_attn_config"].erase("kda_layers");
    expect_rejected(c, {"linear_attn_config", "missing required key 'kda_layers'"}, "published kda_layers");
    json d = native_cfg();
    d.erase("q_lora_rank");   // null is meaningful (q_proj directly); absence is not
    expect_rejected(d, {"missing required key 'q_lora_rank'"}, "native q_lora_rank");
    // K3-critical keys never default (trap 34).
    for (const char * k : {"attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate",
                           "activation_situ_beta", "activation_situ_linear_beta", "num_experts"}) {
        json e = k3_full();
        e["text_config"].erase(k);
        expect_rejected(e, {fmt::format("missing required key '{}'", k)}, fmt::format("K3 {}", k));
    }
    for (const char * k : {"use_full_rank_gate", "gate_lower_bound"}) {
        json e = k3_full();
        e["text_config"]["linear_attn_config"].erase(k);
        expect_rejected(e, {"linear_attn_config", fmt::format("missing required key '{}'", k)}, fmt::format("K3 {}", k));
    }
    json f = k3_full();
    f.erase("text_config");
    expect_rejected(f, {"missing required key 'text_config'"}, "K3 text_config");
    json g = k31_full();
    g["text_config"]["dsa_config"].erase("index_topk");
    expect_rejected(g, {"dsa_config", "index_topk"}, "K3.1 index_topk");
}

// nlohmann's lexer stops at a NUL byte: `{...}\0garbage` parsed as `{...}` before the check (RELIABILITY: no silent
// acceptance); the control is the same text without the NUL, which parses.
TEST(config_defects, nul_byte_is_refused) {
    const std::string text = native_cfg().dump();
    EXPECT_NO_THROW(config_parse(text, "config.json"));
    try {
        config_parse(text + std::string(1, '\0') + "{\"junk\": [", "config.json");
        ADD_FAILURE() << "a config.json with a NUL byte was accepted";
    } catch (const perigee::error & e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("config.json: not valid JSON: a NUL byte at offset {}", text.size())),
                  std::string::npos) << e.what();
    }
}

// fuzz_config finding #10: num_hidden_layers sized per-layer tables before any check (2^48 layers: an allocation of 1 PiB
// and an abort); it is bounded where it is read, in both config forms. Control: the real counts parse (other tests).
TEST(config_defects, layer_count_is_bounded) {
    for (int64_t n : {int64_t(281474976710656), int64_t(1025), int64_t(0), int64_t(-3)}) {
        json a = native_cfg();
        a["num_hidden_layers"] = n;
        expect_rejected(a, {fmt::format("num_hidden_layers {} is outside 1..1024", n)}, "native num_hidden_layers");
        json b = published_cfg();
        b["num_hidden_layers"] = n;
        expect_rejected(b, {fmt::format("num_hidden_layers {} is outside 1..1024", n)}, "published num_hidden_layers");
    }
}

TEST(config_defects, wrong_type) {
    json a = native_cfg();
    a["hidden_size"] = "64";
    expect_rejected(a, {"'hidden_size' must be an integer"}, "hidden_size string");
    json b = published_cfg();
    b["moe_renormalize"] = 1;
    expect_rejected(b, {"'moe_renormalize' must be true or false"}, "moe_renormalize int");
    json c = published_cfg();
    c["linear_attn_config"]["kda_layers"] = "1,3,4";
    expect_rejected(c, {"'kda_layers' must be a list"}, "kda_layers string");
    json d = published_cfg();
    d["linear_attn_config"]["kda_layers"] = {1, 3, 4.5};
    expect_rejected(d, {"'kda_layers' must be an integer"}, "kda_layers float entry");
    json e = k3_full();
    e["text_config"]["attn_res_block_size"] = 12.5;
    expect_rejected(e, {"'attn_res_block_size' must be an integer"}, "attn_res_block_size float");
    json f = native_cfg();
    f["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", 3};
    expect_rejected(f, {"'layer_types' must be a string"}, "layer_types entry int");
    // fuzz_config finding #8: a number where the native form's attention_bias must be a boolean escaped as nlohmann's
    // type_error (terminate in the CLI) instead of an error naming the key
    json g = native_cfg();
    g["attention_bias"] = 0.02;
    expect_rejected(g, {"'attention_bias' must be true or false"}, "native attention_bias number");
    json h = native_cfg();
    h["attention_bias"] = true;
    expect_rejected(h, {"attention_bias=true is not supported"}, "native attention_bias true");
}

TEST(config_defects, layer_lists_must_partition) {
    // gap: a layer in neither list
    json a = published_cfg();
    a["linear_attn_config"]["kda_layers"] = {1, 3};   // layer 4 missing
    expect_rejected(a, {"layer 4 (1-based) is in neither", "partition"}, "gap");
    // duplicate: a layer in both lists
    json b = published_cfg();
    b["linear_attn_config"]["kda_layers"] = {1, 2, 3, 4};   // 2 is also in full_attn_layers
    expect_rejected(b, {"layer 2 appears twice"}, "duplicate across lists");
    json c = published_cfg();
    c["linear_attn_config"]["kda_layers"] = {1, 3, 3, 4};
    expect_rejected(c, {"layer 3 appears twice"}, "duplicate within a list");
    // 0-based lists (contains 0)
    json d = published_cfg();
    d["linear_attn_config"]["kda_layers"] = {0, 2, 3};
    d["linear_attn_config"]["full_attn_layers"] = {1, 4};
    expect_rejected(d, {"kda_layers entry 0", "1-based"}, "0-based list containing 0");
    // 0-based shape without the 0: max = L-1, layer L missing
    json e = published_cfg();
    e["linear_attn_config"]["kda_layers"] = {2, 3};
    e["linear_attn_config"]["full_attn_layers"] = {1, 4};
    expect_rejected(e, {"layer 5 (1-based) is in neither"}, "0-based list missing L");
    // out of range
    json f = published_cfg();
    f["linear_attn_config"]["full_attn_layers"] = {2, 6};
    expect_rejected(f, {"full_attn_layers entry 6"}, "entry > L");
    // K3 full config shifted to 0-based (trap 33): refused, not silently shifted
    json g = k3_full();
    for (auto * key : {"kda_layers", "full_attn_layers"})
        for (auto & v : g["text_config"]["linear_attn_config"][key]) v = v.get<int64_t>() - 1;
    expect_rejected(g, {"entry 0", "1-based"}, "K3 lists shifted to 0-based");
    // native form: wrong length / bad value
    json h = native_cfg();
    h["layer_types"].erase(h["layer_types"].size() - 1);
    expect_rejected(h, {"layer_types", "num_hidden_layers"}, "layer_types too short");
    json i = native_cfg();
    i["layer_types"][1] = "sliding_attention";
    expect_rejected(i, {"layer_types[1]", "sliding_attention"}, "layer_types bad value");
    // dsa_layers naming a KDA layer
    json j = k31_full();
    j["text_config"]["dsa_config"]["dsa_layers"][0] = 1;
    expect_rejected(j, {"dsa_layers", "KDA layer"}, "dsa on a KDA layer");
}

TEST(config_defects, unsupported_activation_and_router) {
    json a = native_cfg();
    a["hidden_act"] = "gelu";
    expect_rejected(a, {"hidden_act 'gelu'"}, "native gelu");
    json b = published_cfg();
    b["hidden_act"] = "relu";
    expect_rejected(b, {"hidden_act 'relu'"}, "published relu");
    json c = published_cfg();
    c["moe_router_activation_func"] = "relu";
    expect_rejected(c, {"moe_router_activation_func 'relu'"}, "router relu");
    json d = published_cfg();
    d["topk_method"] = "greedy";
    expect_rejected(d, {"topk_method 'greedy'"}, "topk_method greedy");
    json e = published_cfg();
    e["mla_use_nope"] = false;
    expect_rejected(e, {"mla_use_nope"}, "rotary MLA");
    json f = k3_full();
    f["text_config"]["quantization_config"]["format"] = "int4-pack-quantized";
    expect_rejected(f, {"int4-pack-quantized"}, "quantization format");
    json g = published_cfg();
    g["model_type"] = "deepseek_v3";
    expect_rejected(g, {"model_type 'deepseek_v3'"}, "model_type");
    json h = k3_full();
    h["text_config"]["linear_attn_config"]["gate_lower_bound"] = 5.0;
    expect_rejected(h, {"gate_lower_bound"}, "positive gate_lower_bound");
}

// Trap 34: the nesting. quantization_config / dsa_config belong inside text_config.
TEST(config_defects, trap_34_nesting) {
    json a = k3_full();
    a["quantization_config"] = a["text_config"]["quantization_config"];
    a["text_config"].erase("quantization_config");
    expect_rejected(a, {"unknown key 'quantization_config'"}, "quantization_config at the wrapper");
    json b = k31_full();
    b["dsa_config"] = b["text_config"]["dsa_config"];
    b["text_config"].erase("dsa_config");
    expect_rejected(b, {"dsa_config"}, "dsa_config at the wrapper");
    json c = k3_full();
    c["text_config"]["model_type"] = "kimi_k3";
    expect_rejected(c, {"text_config.model_type", "kimi_linear"}, "text_config.model_type");
}

// Trap 35, config half: kimi_k31 needs dsa_config; kimi_k3 must not have one; a kimi_linear config has none.
TEST(config_defects, trap_35_variant_gating_config) {
    json a = k3_full();
    a["model_type"] = "kimi_k31";
    expect_rejected(a, {"kimi_k31", "no dsa_config"}, "kimi_k31 without dsa_config");
    json b = k31_full();
    b["model_type"] = "kimi_k3";
    expect_rejected(b, {"kimi_k3", "dsa_config"}, "kimi_k3 with dsa_config");
    json c = published_cfg();
    c["dsa_config"] = {{"dsa_layers", {2, 5}}, {"index_rope_dim", 0}, {"index_n_heads", 2}, {"index_head_dim", 8},
                       {"index_topk", 4}};
    expect_rejected(c, {"dsa_config"}, "kimi_linear with dsa_config");
}

// ---------------------------------------------------------------------------------------------------------
// The declared tensor set of the real K3 geometry (§2.2-2.4), from the config alone.

std::map<std::string, weight_decl> decl_map(const std::vector<weight_decl> & v) {
    std::map<std::string, weight_decl> m;
    for (const auto & d : v) m[d.name] = d;
    return m;
}

TEST(config_declarations, trap_31_k3_tensor_counts) {
    const auto k3 = weights_declare(parse(k3_full()), checkpoint{});
    const auto k31 = weights_declare(parse(k31_full()), checkpoint{});
    // §2.4: 497,052 text tensors (+168 vision = 497,220 in the published tree); K3.1 adds 24 x 5 indexer tensors.
    EXPECT_EQ(k3.size(), 497052u);
    EXPECT_EQ(k31.size(), 497052u + 120u);
    size_t routed = 0;
    for (const auto & d : k3)
        if (d.name.find(".experts.") != std::string::npos) {
            ++routed;
            EXPECT_EQ(d.name.find(".weight", d.name.size() - 7), std::string::npos)
                << d.name << ": routed experts ship only weight_packed/weight_scale (trap 31)";
        }
    EXPECT_EQ(routed, size_t(92) * 896 * 6);
}

TEST(config_declarations, trap_15_24_29_41_k3_declared_shapes) {
    const auto m = decl_map(weights_declare(parse(k3_full()), checkpoint{}));
    auto shape = [&](const std::string & n) -> shape_t {
        auto it = m.find("language_model.model." + n);
        if (it == m.end()) it = m.find("language_model." + n);
        EXPECT_NE(it, m.end()) << n << " not declared";
        return it == m.end() ? shape_t{} : it->second.shapes.front();
    };
    // trap 15: full-rank KDA output gate, low-rank forget gate; A_log per head
    EXPECT_EQ(shape("layers.0.self_attn.g_proj.weight"), (shape_t{12288, 7168}));
    EXPECT_EQ(shape("layers.0.self_attn.f_a_proj.weight"), (shape_t{128, 7168}));
    EXPECT_EQ(shape("layers.0.self_attn.f_b_proj.weight"), (shape_t{12288, 128}));
    EXPECT_EQ(m.count("language_model.model.layers.0.self_attn.g_a_proj.weight"), 0u);
    // trap 5: the MLA layer's g_proj is the output gate [H*dv, D]
    EXPECT_EQ(shape("layers.3.self_attn.g_proj.weight"), (shape_t{96 * 128, 7168}));
    EXPECT_EQ(shape("layers.3.self_attn.q_b_proj.weight"), (shape_t{18432, 1536}));
    EXPECT_EQ(shape("layers.3.self_attn.kv_a_proj_with_mqa.weight"), (shape_t{576, 7168}));
    // trap 24: experts at the latent width 3584
    EXPECT_EQ(shape("layers.1.block_sparse_moe.experts.0.w1.weight_packed"), (shape_t{3072, 1792}));
    EXPECT_EQ(shape("layers.1.block_sparse_moe.experts.0.w1.weight_scale"), (shape_t{3072, 112}));
    EXPECT_EQ(shape("layers.1.block_sparse_moe.experts.895.w2.weight_packed"), (shape_t{3584, 1536}));
    EXPECT_EQ(shape("layers.1.block_sparse_moe.experts.895.w2.weight_scale"), (shape_t{3584, 96}));
    EXPECT_EQ(shape("layers.92.block_sparse_moe.routed_expert_down_proj.weight"), (shape_t{3584, 7168}));
    // trap 29: dense layer 0 width 33792; the shared experts are ONE MLP of width 6144
    EXPECT_EQ(shape("layers.0.mlp.gate_proj.weight"), (shape_t{33792, 7168}));
    EXPECT_EQ(shape("layers.1.block_sparse_moe.shared_experts.gate_proj.weight"), (shape_t{6144, 7168}));
    EXPECT_EQ(shape("layers.1.block_sparse_moe.shared_experts.down_proj.weight"), (shape_t{7168, 6144}));
    // trap 41: untied lm_head with the full vocab
    EXPECT_EQ(shape("lm_head.weight"), (shape_t{163840, 7168}));
    EXPECT_EQ(shape("embed_tokens.weight"), (shape_t{163840, 7168}));
    // AttnRes pseudo-queries
    EXPECT_EQ(shape("layers.5.self_attention_res_proj.weight"), (shape_t{1, 7168}));
    EXPECT_EQ(shape("output_attn_res_proj.weight"), (shape_t{1, 7168}));
}

} // namespace
} // namespace perigee::test
