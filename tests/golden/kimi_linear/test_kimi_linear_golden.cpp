// Kimi-Linear parity against HF transformers' goldens (issue 2 items 8-9; tools/golden/README.md).
// For every case folder under tests/golden/kimi_linear/: the model is loaded in-process (model_runner +
// single_sequence, the CPU reference backend) and
//  - the prefill logits of every golden prompt (L = 1, 7, 70, 131) match at every position within
//    max|Δ| <= 1e-4 · max|logit| (the measured ratio is printed);
//  - greedy 12-token generation through the decode path (KDA conv/recurrent state, MLA latent cache) gives
//    golden greedy.tokens / greedy_long.tokens, and each step's logits match greedy.logits within the bound;
//  - decode after prefill equals a prefill of the whole sequence (same bound) (traps 43/45 on Kimi-Linear);
//  - two runs are bitwise identical.
// Controls that must fail: one weight element perturbed (written with the loader's safetensors writer into a
// temporary copy), and one golden element perturbed by 10x the bound.
#include "../../unit/model/model_test_util.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

namespace perigee::test {
namespace {

const std::string k_golden_root = repo_path("tests/golden/kimi_linear");

std::vector<std::string> golden_cases() {
    std::vector<std::string> v;
    if (!fs::is_directory(k_golden_root)) return v;
    for (const auto & e : fs::directory_iterator(k_golden_root))
        if (e.is_directory() && fs::exists(e.path() / "golden.safetensors") && fs::exists(e.path() / "config.json"))
            v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
}

TEST(kimi_linear_golden, all_four_cases_present) {
    const auto v = golden_cases();
    for (const char * c : {"basic", "grouped_qlora", "published_form", "wide_mixed"})
        EXPECT_NE(std::find(v.begin(), v.end(), c), v.end()) << "golden case folder missing: " << c;
}

class golden : public ::testing::TestWithParam<std::string> {
protected:
    void SetUp() override {
        dir_ = k_golden_root + "/" + GetParam();
        gold_ = safetensors_file::open(dir_ + "/golden.safetensors");
    }
    tensor g(const std::string & name) const {
        const st_entry * e = gold_->find(name);
        PG_CHECK(e != nullptr, "{}/golden.safetensors: no tensor '{}'", dir_, name);
        return gold_->view(*e);
    }
    std::unique_ptr<model_runner> runner(int max_tokens = 160) const {
        runner_options opt;
        opt.max_tokens = max_tokens;
        return std::make_unique<model_runner>(dir_, opt);
    }
    void report(const std::string & what, const parity & p) const {
        std::printf("[parity] %s %s: %s %s\n", GetParam().c_str(), what.c_str(), p.str().c_str(), p.ok() ? "OK" : "FAIL");
    }

    std::string dir_;
    std::shared_ptr<safetensors_file> gold_;
};

TEST_P(golden, prefill_logits_every_prompt_every_position) {
    auto r = runner();
    for (int L : {1, 7, 70, 131}) {
        const auto ids = ids_of(g("prompt." + std::to_string(L)));
        const tensor want = g("logits." + std::to_string(L));
        ASSERT_EQ(int64_t(ids.size()), L);
        single_sequence s(*r);   // zeroes slot 0; the MLA pages are rewritten from position 0
        const tensor got = s.feed(ids);
        const parity p = compare_logits(got, want);
        report("prefill L=" + std::to_string(L), p);
        EXPECT_TRUE(p.ok()) << GetParam() << " prefill L=" << L << ": " << p.str();
        // Every position individually too (a bad position must not hide behind a large max elsewhere).
        for (int64_t t = 0; t < L; ++t) {
            const parity pr = compare_logits(row_of(got, t), row_of(want, t));
            EXPECT_TRUE(pr.ok()) << GetParam() << " prefill L=" << L << " position " << t << ": " << pr.str();
        }
    }
}

TEST_P(golden, greedy_decode_tokens_and_logits) {
    auto r = runner();
    for (const std::string run : {"greedy", "greedy_long"}) {
        const auto prompt = ids_of(g(run + ".prompt"));
        const auto want_tokens = ids_of(g(run + ".tokens"));
        const tensor want_logits = g(run + ".logits");
        ASSERT_EQ(want_tokens.size(), 12u);
        single_sequence s(*r);
        tensor lg = s.feed(prompt);
        std::vector<int32_t> got;
        parity worst;
        for (int i = 0; i < 12; ++i) {
            const tensor row = row_of(lg, lg.shape[0] - 1);
            const parity p = compare_logits(row, row_of(want_logits, i));
            EXPECT_TRUE(p.ok()) << GetParam() << " " << run << " step " << i << ": " << p.str();
            if (p.ratio() > worst.ratio() || i == 0) worst = p;
            const int32_t next = argmax_row(row, 0);
            got.push_back(next);
            if (i + 1 < 12) lg = s.feed({next});   // decode path, one token with state
        }
        report(run + " (worst step)", worst);
        EXPECT_EQ(got, want_tokens) << GetParam() << " " << run << ": greedy tokens differ from transformers";
    }
}

TEST_P(golden, decode_after_prefill_equals_whole_prefill) {
    auto r = runner();
    const auto prompt = ids_of(g("greedy_long.prompt"));   // 70 tokens: the prefill spans two KDA chunks
    const auto toks = ids_of(g("greedy_long.tokens"));
    std::vector<int32_t> whole = prompt;
    whole.insert(whole.end(), toks.begin(), toks.end() - 1);   // 81 tokens
    single_sequence s(*r);
    std::vector<tensor> decoded;
    decoded.push_back(row_of(s.feed(prompt), int64_t(prompt.size()) - 1));
    for (size_t i = 0; i + 1 < toks.size(); ++i) decoded.push_back(s.feed({toks[i]}));
    single_sequence s2(*r);
    const tensor full = s2.feed(whole);
    parity worst;
    for (size_t i = 0; i < decoded.size(); ++i) {
        const parity p = compare_logits(decoded[i], row_of(full, int64_t(prompt.size() - 1 + i)));
        EXPECT_TRUE(p.ok()) << GetParam() << " decode step " << i << " vs whole prefill: " << p.str();
        if (p.ratio() > worst.ratio() || i == 0) worst = p;
    }
    report("decode-vs-whole-prefill (worst step)", worst);
}

TEST_P(golden, two_runs_bitwise_identical) {
    const auto ids = ids_of(g("prompt.131"));
    auto r1 = runner();
    auto r2 = runner();
    single_sequence a(*r1), b(*r2);
    const tensor la = a.feed(ids), lb = b.feed(ids);
    EXPECT_TRUE(bitwise_equal(la, lb)) << GetParam() << ": two prefills of the same prompt differ";
    // Decode too, and a reused runner (slot recycled) gives the same bits as a fresh one.
    const tensor da = a.feed({ids[3]}), db = b.feed({ids[3]});
    EXPECT_TRUE(bitwise_equal(da, db)) << GetParam() << ": two decodes differ";
    single_sequence c(*r1);
    EXPECT_TRUE(bitwise_equal(c.feed(ids), la)) << GetParam() << ": a recycled slot changes the result";
}

// Control: one weight element changed in a copy of the checkpoint -> the parity check must report failure.
TEST_P(golden, control_perturbed_weight_fails) {
    temp_dir tmp("golden-perturb-" + GetParam());
    copy_dir(dir_, tmp.path());
    const std::string name = "model.layers.1.self_attn.o_proj.weight";
    bool found = false;
    rewrite_tree(tmp.path(), [&](shard_items & items) {
        if (tensor * t = find_item(items, name)) {
            ASSERT_EQ(t->type, dtype::F32);
            t->f32()[5] += 0.25f;   // one element of one tensor (weights ~ N(0, 1/in))
            found = true;
        }
    });
    ASSERT_TRUE(found) << name << " not in " << dir_;
    const tensor want = g("logits.70");
    const auto ids = ids_of(g("prompt.70"));
    const parity clean = compare_logits(prefill(dir_, ids), want);
    const parity bad = compare_logits(prefill(tmp.path(), ids), want);
    report("control(perturbed weight) must FAIL", bad);
    EXPECT_TRUE(clean.ok()) << clean.str();
    EXPECT_FALSE(bad.ok()) << "the parity check did not notice a perturbed weight: " << bad.str();
}

// Control: one golden element moved by 10x the bound -> the parity check must report failure.
TEST_P(golden, control_perturbed_golden_fails) {
    const auto ids = ids_of(g("prompt.70"));
    const tensor got = prefill(dir_, ids);
    tensor want = tensor_copy(g("logits.70"));
    const parity clean = compare_logits(got, want);
    ASSERT_TRUE(clean.ok()) << clean.str();
    const int64_t V = want.shape[1];
    want.f32()[35 * V + 7] += float(10 * k_parity_rtol * clean.max_ref);
    const parity bad = compare_logits(got, want);
    report("control(perturbed golden) must FAIL", bad);
    EXPECT_FALSE(bad.ok()) << "the parity check did not notice a perturbed golden element: " << bad.str();
    EXPECT_EQ(bad.worst, 35 * V + 7);
}

INSTANTIATE_TEST_SUITE_P(kimi_linear, golden, ::testing::ValuesIn(golden_cases()),
                         [](const ::testing::TestParamInfo<std::string> & i) { return i.param; });

} // namespace
} // namespace perigee::test
