#include "model/synth.h"

#include "core/error.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "model/weights.h"
#include "quant/mxfp4.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace perigee {

using json = nlohmann::json;

namespace {

struct geometry {
    std::string wrapper;     // "kimi_k3", "kimi_k31" or "" (kimi_linear published form)
    int64_t vocab, hidden, layers, dense_inter;
    int64_t kda_heads, kda_dim;
    int64_t mla_heads, q_lora, kv_lora, nope, rope, v;
    int64_t experts, topk, shared, moe_inter, latent, groups, topk_group;
    int64_t block;           // AttnRes block size (0 = none)
    int64_t index_heads = 0, index_dim = 0, index_topk = 0;
    float routed_scale = 1.0f;
    int n_shards = 3;
};

geometry preset_geometry(const std::string & p) {
    // Tiny presets keep the real structure: >= 2 AttnRes blocks, 3:1 KDA:MLA with MLA last, >= 2 MLA
    // layers, >= 8 experts; widths multiples of 32 so the MXFP4 blocks tile the expert matrices.
    if (p == "k3-tiny" || p == "k31-tiny" || p == "k3-tiny-v512") {
        geometry g{"kimi_k3", 256, 64, 8, 96, 2, 16, 2, 32, 32, 16, 8, 16, 8, 2, 2, 32, 32, 1, 1, 3};
        // k3-tiny-v512: room for a 256-byte tokenizer plus its 256 special ids (server tests)
        if (p == "k3-tiny-v512") g.vocab = 512;
        if (p == "k31-tiny") {
            g.wrapper = "kimi_k31";
            g.index_heads = 2;
            g.index_dim = 16;
            g.index_topk = 8;   // well below the test prompts' lengths, so the indexer really selects
        }
        return g;
    }
    if (p == "kimi-linear-tiny") {
        geometry g{"", 256, 64, 4, 96, 2, 16, 2, 0, 32, 16, 8, 16, 8, 2, 2, 32, 0, 2, 1, 0};
        g.routed_scale = 2.446f;
        return g;
    }
    if (p == "k3-layers-4") {   // K3's true widths, 4 layers (3 KDA + 1 MLA), for GPU performance work
        geometry g{"kimi_k3", 163840, 7168, 4, 33792, 96, 128, 96, 1536, 512, 128, 64, 128, 896, 16, 2, 3072, 3584, 1, 1, 12};
        g.n_shards = 8;
        return g;
    }
    PG_FAIL("unknown synth preset '{}' (known: k3-tiny, k3-tiny-v512, k31-tiny, kimi-linear-tiny, k3-layers-4)", p);
}

json text_config(const geometry & g) {
    std::vector<int64_t> kda, full;
    for (int64_t l = 1; l <= g.layers; ++l) (l % 4 == 0 || l == g.layers ? full : kda).push_back(l);
    json lin = {{"num_heads", g.kda_heads}, {"head_dim", g.kda_dim}, {"short_conv_kernel_size", 4},
                {"kda_layers", kda}, {"full_attn_layers", full}};
    json t = {
        {"model_type", "kimi_linear"}, {"vocab_size", g.vocab}, {"hidden_size", g.hidden},
        {"intermediate_size", g.dense_inter}, {"num_hidden_layers", g.layers},
        {"num_attention_heads", g.mla_heads}, {"num_key_value_heads", g.mla_heads},
        {"q_lora_rank", g.q_lora > 0 ? json(g.q_lora) : json(nullptr)}, {"kv_lora_rank", g.kv_lora},
        {"qk_nope_head_dim", g.nope}, {"qk_rope_head_dim", g.rope}, {"v_head_dim", g.v}, {"mla_use_nope", true},
        {"rms_norm_eps", 1e-5}, {"tie_word_embeddings", false}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 1},
        {"num_experts", g.experts}, {"num_experts_per_token", g.topk}, {"num_shared_experts", g.shared},
        {"moe_intermediate_size", g.moe_inter}, {"moe_router_activation_func", "sigmoid"}, {"moe_renormalize", true},
        {"routed_scaling_factor", g.routed_scale}, {"use_grouped_topk", true}, {"num_expert_group", g.groups},
        {"topk_group", g.topk_group}, {"topk_method", "noaux_tc"}, {"num_nextn_predict_layers", 0},
        {"max_position_embeddings", 1048576}, {"bos_token_id", g.vocab - 4}, {"eos_token_id", g.vocab - 3},
        {"pad_token_id", g.vocab - 1},
    };
    if (g.wrapper.empty()) {
        t["hidden_act"] = "silu";
    } else {
        t["hidden_act"] = "situ";
        t["activation_situ_beta"] = 4.0;
        t["activation_situ_linear_beta"] = 25.0;
        t["mla_use_output_gate"] = true;
        t["attn_res_block_size"] = g.block;
        t["routed_expert_hidden_size"] = g.latent;
        t["latent_moe_use_norm"] = true;
        lin["use_full_rank_gate"] = true;
        lin["gate_lower_bound"] = -5.0;
        t["quantization_config"] = {
            {"quant_method", "compressed-tensors"}, {"format", "mxfp4-pack-quantized"},
            {"config_groups", {{"group_0", {{"format", "mxfp4-pack-quantized"}, {"targets", {"Linear"}},
                {"weights", {{"num_bits", 4}, {"group_size", 32}, {"type", "float"}, {"symmetric", true},
                             {"strategy", "group"}, {"scale_dtype", "torch.uint8"}}}}}}},
            {"ignore", {"re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                        "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"}}};
        if (g.index_heads > 0)
            t["dsa_config"] = {{"dsa_layers", full}, {"index_rope_dim", 0}, {"index_n_heads", g.index_heads},
                               {"index_head_dim", g.index_dim}, {"index_topk", g.index_topk}};
    }
    t["linear_attn_config"] = lin;
    return t;
}

json config_json(const geometry & g) {
    json t = text_config(g);
    if (g.wrapper.empty()) return t;
    return json{{"architectures", {"KimiK3ForConditionalGeneration"}}, {"model_type", g.wrapper},
                {"bos_token_id", t["bos_token_id"]}, {"eos_token_id", t["eos_token_id"]},
                {"pad_token_id", t["pad_token_id"]}, {"media_placeholder_token_id", g.vocab - 2},
                {"tie_word_embeddings", false}, {"text_config", t},
                {"vision_config", {{"patch_size", 14}, {"vt_hidden_size", 16}}}};
}

bool ends_with(const std::string & s, const std::string & suf) {
    return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// Fills one declared tensor by role (non-trivial values: see the foundation issue, item 8).
tensor make_tensor(const weight_decl & d, const kimi_config & c, std::mt19937_64 & rng) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    const shape_t & shape = d.shapes.back();   // the padded A_log form is declared last
    const std::string & n = d.name;
    const int64_t numel = shape_numel(shape);
    std::vector<float> v(static_cast<size_t>(numel));
    dtype out = dtype::BF16;
    if (ends_with(n, "A_log")) {
        out = dtype::F32;
        for (int64_t i = 0; i < numel; ++i) v[size_t(i)] = i < c.kda_num_heads ? float(std::log(1.0 + 15.0 * uni(rng))) : 0.0f;
    } else if (ends_with(n, "dt_bias")) {
        out = dtype::F32;
        for (auto & x : v) x = float(0.25 * normal(rng));
    } else if (ends_with(n, "e_score_correction_bias")) {
        out = dtype::F32;
        for (auto & x : v) x = float(0.1 * normal(rng));
    } else if (ends_with(n, "k_norm.bias")) {
        for (auto & x : v) x = float(0.1 * normal(rng));
    } else if (ends_with(n, "norm.weight") || ends_with(n, "layernorm.weight")) {
        if (ends_with(n, "o_norm.weight")) out = dtype::F32;   // K3 ships o_norm in F32
        for (auto & x : v) x = float(1.0 + 0.4 * (uni(rng) - 0.5));
    } else if (ends_with(n, "_conv1d.weight")) {
        out = dtype::F32;   // K3 ships the conv weights in F32 (trap 42)
        const double s = 1.0 / std::sqrt(double(shape.back()));
        for (auto & x : v) x = float(s * normal(rng));
    } else if (ends_with(n, "embed_tokens.weight")) {
        for (auto & x : v) x = float(normal(rng));
    } else {
        // Linear [out, in] (and AttnRes pseudo-queries [1, D]): N(0, 1/fan_in).
        const double s = 1.0 / std::sqrt(double(shape.back()));
        for (auto & x : v) x = float(s * normal(rng));
    }
    tensor t = tensor_new(out, shape);
    for (int64_t i = 0; i < numel; ++i) {
        if (out == dtype::F32) t.as<float>()[i] = v[size_t(i)];
        else t.as<uint16_t>()[i] = f32_to_bf16(v[size_t(i)]);
    }
    return t;
}

} // namespace

std::vector<std::string> synth_presets() { return {"kimi-linear-tiny", "k3-tiny", "k3-tiny-v512", "k31-tiny", "k3-layers-4"}; }

std::string synth_config_json(const std::string & preset) { return config_json(preset_geometry(preset)).dump(2); }

void synth_write(const std::string & preset, const std::string & dir, uint64_t seed) {
    const geometry g = preset_geometry(preset);
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    const std::string cfg_text = synth_config_json(preset);
    const kimi_config c = config_parse(cfg_text, preset + " preset");
    {
        std::ofstream f(dir + "/config.json");
        f << cfg_text << "\n";
        std::ofstream gen(dir + "/generation_config.json");
        gen << json{{"bos_token_id", c.bos_token_id}, {"eos_token_id", c.eos_token_ids.at(0)}, {"do_sample", false}}.dump(2)
            << "\n";
    }
    // Declarations with an empty checkpoint: dense/MXFP4 per the config, A_log padded to the head dim
    // as K3 ships it ([128] with a zero tail for 96 heads).
    std::vector<weight_decl> decls = weights_declare(c, checkpoint{});
    for (auto & d : decls)
        if (ends_with(d.name, "A_log")) d.shapes.push_back({std::max(c.kda_num_heads, c.kda_head_dim)});
    std::mt19937_64 rng(seed);
    std::map<std::string, std::string> weight_map;
    uint64_t total = 0, written = 0, next_report = 1ull << 30;
    const size_t per_shard = (decls.size() + size_t(g.n_shards) - 1) / size_t(g.n_shards);
    for (int s = 0; s < g.n_shards; ++s) {
        const std::string shard = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, g.n_shards);
        std::vector<std::pair<std::string, tensor>> items;
        for (size_t i = size_t(s) * per_shard; i < std::min(decls.size(), size_t(s + 1) * per_shard); ++i) {
            const weight_decl & d = decls[i];
            if (ends_with(d.name, ".weight_packed")) continue;   // written with its scale below
            if (ends_with(d.name, ".weight_scale")) {
                // An MXFP4 expert matrix: random N(0, 1/in) weights, quantized with the _ref codec.
                const std::string base = d.name.substr(0, d.name.size() - std::string(".weight_scale").size());
                const int64_t out = d.shapes[0][0], in = d.shapes[0][1] * 32;
                weight_decl dense{base + ".weight", {{out, in}}, {dtype::F32}};
                tensor w = make_tensor(dense, c, rng);
                tensor wf = tensor_to_f32(w);
                mxfp4_matrix q = mxfp4_quantize_ref(wf);
                items.emplace_back(base + ".weight_packed", q.packed);
                items.emplace_back(base + ".weight_scale", q.scale);
                continue;
            }
            items.emplace_back(d.name, make_tensor(d, c, rng));
        }
        if (s == 0 && !g.wrapper.empty()) {   // vision stubs: recognised and ignored by a text engine
            for (const char * n : {"vision_tower.patch_embed.proj.weight", "mm_projector.proj.weight"}) {
                weight_decl vd{n, {{8, 8}}, {dtype::BF16}};
                items.emplace_back(n, make_tensor(vd, c, rng));
            }
        }
        for (const auto & [name, t] : items) {
            weight_map[name] = shard;
            total += t.nbytes;
        }
        safetensors_write(dir + "/" + shard, items, {{"format", "pt"}});
        written = total;
        if (written >= next_report) {
            std::fprintf(stderr, "synth %s: shard %d/%d, %.1f GB written\n", preset.c_str(), s + 1, g.n_shards, double(written) / 1e9);
            next_report = written + (1ull << 30);
        }
    }
    checkpoint_write_index(dir, weight_map, total);
}

} // namespace perigee
