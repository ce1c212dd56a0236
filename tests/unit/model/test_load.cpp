// Loading: variant gating in both directions (trap 35, tensor half), the reconciler's four buckets through
// `perigee inspect` (issue 2 "Done when"), and the value-level load checks: A_log tail (trap 7), E8M0 0xFF
// (traps 30/32), a missing expert (trap 31), the shared g_proj name (trap 5), o_norm/conv dtypes (trap 42).
// Checkpoints are copies of the golden fixtures or in-process synth trees, rewritten with the project's own
// safetensors reader/writer.
#include "model/synth.h"
#include "model/weights.h"
#include "model_test_util.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include <gtest/gtest.h>

namespace perigee::test {
namespace {

using json = nlohmann::json;

const std::string k_golden = repo_path("tests/golden/kimi_linear");
const std::string k_bin = PERIGEE_BIN;

std::string synth(const temp_dir & t, const std::string & preset, const std::string & name = "") {
    const std::string d = t.sub(name.empty() ? preset : name);
    synth_write(preset, d, 7);
    return d;
}

std::string load_error(const std::string & dir) {
    return error_of([&] {
        runner_options opt;
        opt.max_tokens = 32;
        model_runner r(dir, opt);
    });
}

void expect_contains(const std::string & text, const std::vector<std::string> & needles, const std::string & what) {
    ASSERT_FALSE(text.empty()) << what << ": no error / no output";
    for (const auto & n : needles) EXPECT_NE(text.find(n), std::string::npos) << what << ": lacks '" << n << "' in:\n" << text;
}

proc_result inspect(const std::string & dir) {
    proc_result r = run_cmd("'" + k_bin + "' inspect '" + dir + "'");
    std::printf("[inspect %s] exit %d\n%s", dir.c_str(), r.exit_code, r.output.c_str());
    return r;
}

void remove_if(shard_items & items, const std::function<bool(const std::string &)> & pred) {
    items.erase(std::remove_if(items.begin(), items.end(), [&](const auto & it) { return pred(it.first); }), items.end());
}

// ---------------------------------------------------------------------------------------------------------
// Trap 35, both directions.

TEST(variant_gating, trap_35_k31_tree_loads_as_k31) {
    temp_dir t("gate");
    const std::string d = synth(t, "k31-tiny");
    EXPECT_EQ(load_error(d), "");
    runner_options opt;
    model_runner r(d, opt);
    EXPECT_EQ(r.config().variant, model_variant::K31);
}

TEST(variant_gating, trap_35_k31_tree_without_indexer_tensors_refused) {
    temp_dir t("gate");
    const std::string d = synth(t, "k31-tiny");
    rewrite_tree(d, [](shard_items & items) {
        remove_if(items, [](const std::string & n) { return n.find(".self_attn.indexer.") != std::string::npos; });
    });
    expect_contains(load_error(d), {"kimi_k31", "dsa_config", "no Lightning Indexer tensors"}, "K3.1 tree without indexer");
    // The reconciler names each missing indexer tensor.
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"missing: language_model.model.layers.3.self_attn.indexer.wq_b.weight",
                               "missing: language_model.model.layers.7.self_attn.indexer.k_norm.bias"},
                    "inspect K3.1 without indexer");
}

TEST(variant_gating, trap_35_k3_tree_under_k31_wrapper_without_dsa_config_refused) {
    temp_dir t("gate");
    const std::string d = synth(t, "k3-tiny");
    json c = json::parse(read_text(d + "/config.json"));
    c["model_type"] = "kimi_k31";
    write_text(d + "/config.json", c.dump(2));
    expect_contains(load_error(d), {"config.json", "kimi_k31", "no dsa_config"}, "k3 tree, kimi_k31 wrapper, no dsa_config");
}

TEST(variant_gating, trap_35_k3_tree_under_k31_config_with_dsa_config_refused) {
    temp_dir t("gate");
    const std::string d = synth(t, "k3-tiny");
    write_text(d + "/config.json", synth_config_json("k31-tiny"));   // same geometry + dsa_config
    expect_contains(load_error(d), {"kimi_k31", "no Lightning Indexer tensors", "self_attn.indexer"}, "k3 tree, k31 config");
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"missing: language_model.model.layers.3.self_attn.indexer.wq_b.weight",
                               "missing: language_model.model.layers.7.self_attn.indexer.weights_proj.weight"},
                    "inspect k3 tree under k31 config");
}

TEST(variant_gating, trap_35_k31_tree_under_k3_wrapper_refused) {
    temp_dir t("gate");
    const std::string d = synth(t, "k31-tiny");
    // (a) the K3 config of the same geometry: the indexer tensors are the disagreeing signal
    write_text(d + "/config.json", synth_config_json("k3-tiny"));
    expect_contains(load_error(d), {"Lightning Indexer tensors", "self_attn.indexer.", "kimi_k3"}, "k31 tree, k3 config");
    // (b) only the wrapper type changed, dsa_config kept: the dsa_config is the disagreeing signal
    json c = json::parse(synth_config_json("k31-tiny"));
    c["model_type"] = "kimi_k3";
    write_text(d + "/config.json", c.dump(2));
    expect_contains(load_error(d), {"kimi_k3", "dsa_config"}, "k31 tree, kimi_k3 wrapper with dsa_config");
}

// ---------------------------------------------------------------------------------------------------------
// The reconciler through `perigee inspect`.

TEST(reconciler_cli, golden_and_synth_models_have_empty_buckets) {
    for (const char * c : {"basic", "grouped_qlora", "published_form", "wide_mixed"}) {
        const proc_result r = inspect(k_golden + "/" + c);
        EXPECT_EQ(r.exit_code, 0) << c;
        expect_contains(r.output, {"0 missing, 0 unclaimed, 0 shape mismatches, 0 dtype mismatches"}, c);
    }
    temp_dir t("inspect");
    for (const char * p : {"k3-tiny", "k31-tiny", "kimi-linear-tiny"}) {
        const proc_result r = inspect(synth(t, p));
        EXPECT_EQ(r.exit_code, 0) << p;
        expect_contains(r.output, {"0 missing, 0 unclaimed, 0 shape mismatches, 0 dtype mismatches"}, p);
    }
}

TEST(reconciler_cli, renamed_tensor_names_both_names_and_fails) {
    temp_dir t("inspect");
    const std::string d = t.sub("basic");
    copy_dir(k_golden + "/basic", d);
    const std::string from = "model.layers.2.self_attn.b_proj.weight", to = "model.layers.2.self_attn.beta_proj.weight";
    rewrite_tree(d, [&](shard_items & items) {
        for (auto & [n, tt] : items)
            if (n == from) n = to;
    });
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"1 missing, 1 unclaimed, 0 shape mismatches, 0 dtype mismatches", "missing: " + from,
                               "unclaimed: " + to},
                    "inspect renamed");
    expect_contains(load_error(d), {from, to}, "load renamed");
}

TEST(reconciler_cli, dtype_change_lands_in_dtype_bucket) {
    temp_dir t("inspect");
    const std::string d = t.sub("basic");
    copy_dir(k_golden + "/basic", d);
    const std::string name = "model.norm.weight";
    rewrite_tree(d, [&](shard_items & items) {
        tensor * w = find_item(items, name);
        ASSERT_NE(w, nullptr);
        tensor f64 = tensor_new(dtype::F64, w->shape);
        for (int64_t i = 0; i < w->numel(); ++i) f64.as<double>()[i] = w->f32()[i];
        *w = f64;
    });
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"0 missing, 0 unclaimed, 0 shape mismatches, 1 dtype mismatches",
                               "dtype mismatch: " + name + " is F64"},
                    "inspect dtype");
    expect_contains(load_error(d), {name, "F64"}, "load dtype");
}

TEST(reconciler_cli, shape_change_lands_in_shape_bucket) {
    temp_dir t("inspect");
    const std::string d = t.sub("basic");
    copy_dir(k_golden + "/basic", d);
    const std::string name = "model.layers.3.self_attn.q_proj.weight";   // MLA [96, 64] stored transposed
    rewrite_tree(d, [&](shard_items & items) {
        tensor * w = find_item(items, name);
        ASSERT_NE(w, nullptr);
        ASSERT_EQ(w->shape, (shape_t{96, 64}));
        w->shape = {64, 96};
    });
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"0 missing, 0 unclaimed, 1 shape mismatches, 0 dtype mismatches",
                               "shape mismatch: " + name + " is [64, 96], expected [96, 64]"},
                    "inspect shape");
}

// ---------------------------------------------------------------------------------------------------------
// Value-level checks at load and the K3 traps of the loader.

TEST(load_checks, trap_7_a_log_nonzero_tail_refused) {
    temp_dir t("alog");
    const std::string d = synth(t, "k3-tiny");
    const std::string name = "language_model.model.layers.1.self_attn.A_log";
    rewrite_tree(d, [&](shard_items & items) {
        if (tensor * a = find_item(items, name)) {
            ASSERT_EQ(a->shape, (shape_t{16}));   // padded to head_dim with a zero tail, as K3 ships [128] for 96 heads
            ASSERT_EQ(a->f32()[5], 0.0f);
            a->f32()[5] = 0.5f;   // channel-wise-looking tail
        }
    });
    expect_contains(load_error(d), {"layers.1.self_attn.A_log", "entry 5", "exactly 0"}, "A_log tail");
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"layers.1.self_attn.A_log", "entry 5"}, "inspect A_log tail");
}

TEST(load_checks, trap_7_a_log_padded_zero_tail_accepted_and_heads_used) {
    // Control for the test above: the untouched padded tree loads; and the per-head values matter (changing head 1's
    // A_log changes the logits), so the loader is not silently reading the tail or nothing at all.
    temp_dir t("alog");
    const std::string d = synth(t, "k3-tiny");
    EXPECT_EQ(load_error(d), "");
    const auto ids = make_ids(12, 256, 3);
    const tensor base = prefill(d, ids);
    rewrite_tree(d, [&](shard_items & items) {
        if (tensor * a = find_item(items, "language_model.model.layers.0.self_attn.A_log")) a->f32()[1] += 1.0f;
    });
    EXPECT_FALSE(compare_logits(prefill(d, ids), base).ok()) << "A_log head 1 has no effect";
}

TEST(load_checks, trap_30_32_mxfp4_scale_0xff_refused) {
    // A routed expert's bytes are not read until it is used (issue 3 item 7), so a 0xFF (E8M0 NaN) scale byte is
    // refused (a) by `perigee inspect` / weights_verify_fp4, which scan every scale, and (b) when the expert runs.
    temp_dir t("e8m0");
    const std::string d = synth(t, "k3-tiny");
    const std::string name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale";
    bool found = false;
    rewrite_tree(d, [&](shard_items & items) {
        if (tensor * s = find_item(items, name)) {
            ASSERT_EQ(s->type, dtype::U8);
            s->as<uint8_t>()[1] = 0xFF;
            found = true;
        }
    });
    ASSERT_TRUE(found);
    {
        runner_options opt;
        opt.max_tokens = 32;
        model_runner r(d, opt);
        const auto bad = weights_verify_fp4(r.weights());
        ASSERT_EQ(bad.size(), 1u);
        expect_contains(bad[0], {"layer 2 expert 3", "byte 1", "0xFF"}, "weights_verify_fp4");
    }
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
    expect_contains(r.output, {"fp4: layer 2 expert 3", "0xFF", "fp4 scales: INVALID"}, "inspect 0xFF");
    // (b) every expert of layer 1 poisoned: any token routes into one, and the forward refuses.
    rewrite_tree(d, [&](shard_items & items) {
        for (auto & [n, s] : items)
            if (n.find("layers.1.block_sparse_moe.experts.") != std::string::npos && n.find("w1.weight_scale") != std::string::npos)
                s.as<uint8_t>()[0] = 0xFF;
    });
    expect_contains(error_of([&] { prefill(d, make_ids(4, 256, 9)); }), {"0xFF"}, "forward through a 0xFF expert");
    // Control: the clean tree verifies.
    const std::string clean = synth(t, "k3-tiny", "clean");
    runner_options opt;
    model_runner rc(clean, opt);
    EXPECT_TRUE(weights_verify_fp4(rc.weights()).empty());
    EXPECT_EQ(inspect(clean).exit_code, 0);
}

TEST(load_checks, trap_31_missing_expert_refused) {
    temp_dir t("expert");
    const std::string d = synth(t, "k3-tiny");
    const std::string name = "language_model.model.layers.5.block_sparse_moe.experts.6.w3.weight_packed";
    rewrite_tree(d, [&](shard_items & items) { remove_if(items, [&](const std::string & n) { return n == name; }); });
    expect_contains(load_error(d), {"1 missing", "missing: " + name}, "missing expert");
    const proc_result r = inspect(d);
    EXPECT_NE(r.exit_code, 0);
}

TEST(load_checks, trap_31_expert_as_dense_weight_is_not_silently_accepted) {
    // A loader that expects `.weight` for routed experts and ignores the packed form leaves them empty (trap 31).
    // Here the packed pair is replaced by a `.weight`: both directions must be reported.
    temp_dir t("expert");
    const std::string d = synth(t, "k3-tiny");
    const std::string base = "language_model.model.layers.1.block_sparse_moe.experts.0.w1";
    rewrite_tree(d, [&](shard_items & items) {
        if (!find_item(items, base + ".weight_packed")) return;
        remove_if(items, [&](const std::string & n) { return n == base + ".weight_packed" || n == base + ".weight_scale"; });
        items.emplace_back(base + ".weight", tensor_new(dtype::BF16, {32, 32}));
    });
    expect_contains(load_error(d), {"missing: " + base + ".weight_packed", "missing: " + base + ".weight_scale",
                                    "unclaimed: " + base + ".weight"},
                    "expert as .weight");
}

TEST(load_checks, trap_5_mla_g_proj_is_its_own_tensor) {
    // KDA layers and MLA layers both have self_attn.g_proj; the MLA output gate must be declared and bound per
    // layer (removing the MLA layer's one is refused even though KDA g_proj tensors exist).
    temp_dir t("gproj");
    const std::string d = synth(t, "k3-tiny");
    const std::string name = "language_model.model.layers.3.self_attn.g_proj.weight";
    rewrite_tree(d, [&](shard_items & items) { remove_if(items, [&](const std::string & n) { return n == name; }); });
    expect_contains(load_error(d), {"missing: " + name}, "MLA g_proj removed");
}

TEST(load_checks, trap_42_o_norm_and_conv_dtypes) {
    temp_dir t("dtypes");
    const std::string d = synth(t, "k3-tiny");
    const auto ids = make_ids(9, 256, 5);
    const tensor base = prefill(d, ids);
    // o_norm and conv weights as BF16 (48B style): accepted; values that are exactly representable give the
    // same logits up to the bound.
    rewrite_tree(d, [&](shard_items & items) {
        for (auto & [n, w] : items)
            if ((n.find("o_norm.weight") != std::string::npos || n.find("_conv1d.weight") != std::string::npos) &&
                w.type == dtype::F32) {
                tensor b = tensor_new(dtype::BF16, w.shape);
                for (int64_t i = 0; i < w.numel(); ++i) b.as<uint16_t>()[i] = f32_to_bf16(w.f32()[i]);
                w = b;
            }
    });
    EXPECT_EQ(load_error(d), "");
    const parity p = compare_logits(prefill(d, ids), base);
    std::printf("[trap_42] BF16 o_norm/conv vs F32: %s\n", p.str().c_str());
    EXPECT_TRUE(p.finite);
    // F16 conv weights are not a published form: refused by the dtype bucket.
    rewrite_tree(d, [&](shard_items & items) {
        if (tensor * w = find_item(items, "language_model.model.layers.0.self_attn.q_conv1d.weight")) w->type = dtype::F16;
    });
    expect_contains(load_error(d), {"dtype mismatch: language_model.model.layers.0.self_attn.q_conv1d.weight is F16"},
                    "F16 conv");
}

// Trap 39: generation_config.json says 163586 while the tokenizer's [EOS] is 163585; the engine stops on every id
// that config.json and generation_config.json name.
TEST(load_checks, trap_39_eos_ids_from_generation_config_merged) {
    temp_dir t("eos");
    const std::string d = t.sub("basic");
    copy_dir(k_golden + "/basic", d);
    EXPECT_EQ(config_load(d).eos_token_ids, (std::vector<int64_t>{2}));
    write_text(d + "/generation_config.json", R"({"eos_token_id": [2, 5, 7], "bos_token_id": 1})");
    EXPECT_EQ(config_load(d).eos_token_ids, (std::vector<int64_t>{2, 5, 7}));
    write_text(d + "/generation_config.json", R"({"eos_token_id": "2"})");
    expect_contains(error_of([&] { config_load(d); }), {"generation_config.json", "eos_token_id"}, "bad eos type");
}

// One declaration pass per load: weights_load with the caller's declarations (what `perigee inspect` does) binds
// exactly what the declaring weights_load binds, and the reconciler still checks those declarations against the
// checkpoint. Control: a declaration list that lost an entry is refused, the dropped tensor named as unclaimed.
TEST(load_checks, declarations_passed_in_bind_the_same_and_are_still_reconciled) {
    temp_dir t("decls");
    const std::string d = synth(t, "k3-tiny");
    const kimi_config c = config_load(d);
    const checkpoint ck = checkpoint::open(d);
    const auto decls = weights_declare(c, ck);
    const reconcile_report r2 = weights_reconcile(c, ck), r3 = weights_reconcile(c, ck, decls);
    EXPECT_TRUE(r3.ok()) << r3.str();
    EXPECT_EQ(r3.str(), r2.str());
    EXPECT_EQ(r3.n_declared, int64_t(decls.size()));
    const auto a = weights_load(c, checkpoint::open(d));
    const auto b = weights_load(c, checkpoint::open(d), decls);
    ASSERT_EQ(a->tensors.size(), decls.size());
    ASSERT_EQ(b->tensors.size(), a->tensors.size());
    for (const auto & [name, ta] : a->tensors) {
        auto it = b->tensors.find(name);
        ASSERT_NE(it, b->tensors.end()) << name;
        EXPECT_EQ(it->second.shape, ta.shape) << name;
        EXPECT_EQ(it->second.type, ta.type) << name;
        EXPECT_EQ(it->second.nbytes, ta.nbytes) << name;
        EXPECT_EQ(std::memcmp(it->second.data, ta.data, ta.nbytes), 0) << name;
    }
    EXPECT_EQ(b->layers.size(), a->layers.size());
    // Control: drop one declaration; the load must refuse and name it.
    auto fewer = decls;
    const std::string dropped = "language_model.model.layers.0.self_attn.q_proj.weight";
    const auto n0 = fewer.size();
    fewer.erase(std::remove_if(fewer.begin(), fewer.end(), [&](const weight_decl & x) { return x.name == dropped; }),
                fewer.end());
    ASSERT_EQ(fewer.size(), n0 - 1) << dropped << " is not declared for k3-tiny";
    expect_contains(error_of([&] { weights_load(c, checkpoint::open(d), fewer); }), {"unclaimed: " + dropped},
                    "load with a declaration dropped");
}

} // namespace
} // namespace perigee::test
