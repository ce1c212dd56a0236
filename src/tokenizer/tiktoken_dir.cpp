#include "tokenizer/tiktoken_dir.h"

#include "core/error.h"
#include "tokenizer/patterns.h"

#include <nlohmann/json.hpp>

#include <charconv>
#include <filesystem>
#include <map>

namespace perigee::tok {

namespace {

std::string token_name(const nlohmann::json & v, const std::string & path, const char * key) {
    if (!v.contains(key) || v[key].is_null()) return "";
    const auto & t = v[key];
    if (t.is_string()) return t.get<std::string>();
    if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
    PG_FAIL("{}: key '{}' is neither a string nor an object with 'content'", path, key);
}

} // namespace

tiktoken_dir load_tiktoken_dir(const std::string & dir) {
    namespace fs = std::filesystem;
    tiktoken_dir out;
    auto & info = out.info;
    info.dir = dir;
    info.model_path = (fs::path(dir) / "tiktoken.model").string();
    info.config_path = (fs::path(dir) / "tokenizer_config.json").string();
    PG_CHECK(fs::exists(info.model_path), "tokenizer: {} not found", info.model_path);
    PG_CHECK(fs::exists(info.config_path), "tokenizer: {} not found", info.config_path);

    const std::string cfg_text = read_file_bytes(info.config_path);
    // nlohmann's lexer ends the input at a NUL byte and silently ignores the rest: refuse it by name.
    if (const size_t nul = cfg_text.find('\0'); nul != std::string::npos)
        PG_FAIL("{}: invalid JSON: a NUL byte at offset {}", info.config_path, nul);
    nlohmann::json cfg;
    try {
        cfg = nlohmann::json::parse(cfg_text);
    } catch (const nlohmann::json::exception & e) {
        PG_FAIL("{}: invalid JSON: {}", info.config_path, e.what());
    }
    PG_CHECK(cfg.is_object(), "{}: top level is not an object", info.config_path);
    PG_CHECK(cfg.contains("tokenizer_class") && cfg["tokenizer_class"].is_string(),
             "{}: missing string key 'tokenizer_class'", info.config_path);
    info.tokenizer_class = cfg["tokenizer_class"].get<std::string>();
    // The Kimi tokenizer class (tokenization_kimi.py) is the only tiktoken.model layout we know:
    // its pattern and outer chunking are applied below. Anything else is refused, not guessed.
    PG_CHECK(info.tokenizer_class == "TikTokenTokenizer",
             "{}: tokenizer_class '{}' is not supported (expected 'TikTokenTokenizer')", info.config_path,
             info.tokenizer_class);
    info.bos_token = token_name(cfg, info.config_path, "bos_token");
    info.eos_token = token_name(cfg, info.config_path, "eos_token");

    rank_file ranks = load_tiktoken_ranks(info.model_path);
    info.model_sha256 = ranks.sha256;
    info.model_bytes = ranks.file_bytes;
    info.n_ranks = ranks.tokens.size();
    info.n_vocab = info.n_ranks + k_num_reserved_special;

    std::map<int64_t, std::pair<std::string, bool>> added;
    if (cfg.contains("added_tokens_decoder")) {
        const auto & atd = cfg["added_tokens_decoder"];
        PG_CHECK(atd.is_object(), "{}: 'added_tokens_decoder' is not an object", info.config_path);
        for (const auto & [key, v] : atd.items()) {
            int64_t id = -1;
            const auto [p, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
            PG_CHECK(ec == std::errc() && p == key.data() + key.size(),
                     "{}: added_tokens_decoder key '{}' is not an integer id", info.config_path, key);
            PG_CHECK(id >= static_cast<int64_t>(info.n_ranks) && id < static_cast<int64_t>(info.n_vocab),
                     "{}: added_tokens_decoder id {} is outside the reserved range [{}, {})", info.config_path, id,
                     info.n_ranks, info.n_vocab);
            PG_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
                     "{}: added_tokens_decoder[{}] has no string 'content'", info.config_path, key);
            const bool special = v.contains("special") && v["special"].is_boolean() ? v["special"].get<bool>() : true;
            added[id] = {v["content"].get<std::string>(), special};
        }
    }
    std::vector<special_token> specials;
    specials.reserve(k_num_reserved_special);
    for (size_t i = info.n_ranks; i < info.n_vocab; ++i) {
        const auto it = added.find(static_cast<int64_t>(i));
        special_token s;
        s.id = static_cast<token_id>(i);
        if (it != added.end()) {
            s.name = it->second.first;
            s.hf_special = it->second.second;
        } else {
            s.name = "<|reserved_token_" + std::to_string(i) + "|>";
            s.hf_special = true;
        }
        specials.push_back(std::move(s));
    }
    tokenizer_options opt;
    opt.max_encode_chars = 400000;  // tokenization_kimi.py TIKTOKEN_MAX_ENCODE_CHARS
    opt.max_run_chars = 25000;      // tokenization_kimi.py MAX_NO_WHITESPACES_CHARS
    out.tok = std::make_unique<tokenizer>(std::move(ranks), std::move(specials), k_pat_kimi, opt);
    if (!info.bos_token.empty()) {
        PG_CHECK(out.tok->special_id(info.bos_token).has_value(), "{}: bos_token '{}' is not a special token",
                 info.config_path, info.bos_token);
    }
    if (!info.eos_token.empty()) {
        PG_CHECK(out.tok->special_id(info.eos_token).has_value(), "{}: eos_token '{}' is not a special token",
                 info.config_path, info.eos_token);
    }
    return out;
}

} // namespace perigee::tok
