// perigee tokenize: encode text (or decode ids) with a model's tokenizer (DIR/tiktoken.model +
// DIR/tokenizer_config.json). User text is encoded without special tokens unless --allow-special.
#include "command.h"
#include "core/error.h"
#include "tokenizer/ranks.h"
#include "tokenizer/tiktoken_dir.h"
#include "tokenizer/utf8.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <sstream>

namespace {

struct tokenize_args {
    std::string model, text, file, decode;
    bool json = false, allow_special = false, info = false;
};

std::vector<perigee::tok::token_id> parse_id_list(const std::string & s) {
    std::vector<perigee::tok::token_id> ids;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        const auto a = item.find_first_not_of(" \t[]"), b = item.find_last_not_of(" \t[]");
        if (a == std::string::npos) continue;
        item = item.substr(a, b - a + 1);
        size_t used = 0;
        long long v = 0;
        try {
            v = std::stoll(item, &used);
        } catch (const std::exception &) {
            used = 0;
        }
        PG_CHECK(used == item.size() && v >= INT32_MIN && v <= INT32_MAX, "--decode: '{}' is not a token id", item);
        ids.push_back(static_cast<perigee::tok::token_id>(v));
    }
    return ids;
}

int run_tokenize(const tokenize_args & a) {
    using namespace perigee::tok;
    const std::string dir = a.model.empty() ? perigee::cli::default_model_dir() : a.model;
    const int n_inputs = !a.text.empty() + !a.file.empty() + !a.decode.empty();
    PG_CHECK(n_inputs == 1, "tokenize: give exactly one of --text, --file, --decode");
    const tiktoken_dir td = load_tiktoken_dir(dir);
    const tokenizer & tok = *td.tok;
    if (a.info) {
        std::fprintf(stderr, "tokenizer: %s sha256 %s, %zu ranks, n_vocab %zu\n", td.info.model_path.c_str(),
                     td.info.model_sha256.c_str(), td.info.n_ranks, td.info.n_vocab);
    }
    if (!a.decode.empty()) {
        const auto ids = parse_id_list(a.decode);
        const std::string bytes = tok.decode(ids);
        if (a.json) {
            nlohmann::json j = {{"text", utf8_replace_invalid(bytes)}, {"valid_utf8", utf8_valid(bytes)}};
            std::printf("%s\n", j.dump().c_str());
        } else {
            std::fwrite(bytes.data(), 1, bytes.size(), stdout);
            std::printf("\n");
        }
        return 0;
    }
    const std::string text = !a.text.empty() ? a.text : read_file_bytes(a.file);
    const auto ids = a.allow_special ? tok.encode(text, tok.all_special_ids()) : tok.encode_ordinary(text);
    nlohmann::json pieces = nlohmann::json::array();
    for (token_id id : ids) pieces.push_back(utf8_replace_invalid(tok.token_bytes(id)));
    if (a.json) {
        nlohmann::json j = {{"ids", ids}, {"pieces", pieces}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        for (size_t i = 0; i < ids.size(); ++i) std::printf("%d\t%s\n", ids[i], pieces[i].dump().c_str());
        std::printf("# %zu tokens\n", ids.size());
    }
    return 0;
}

perigee::cli::command_registrar reg{{"tokenize", "Encode text or decode ids with a model's tokenizer",
    [](CLI::App & sub) {
        auto a = std::make_shared<tokenize_args>();
        sub.add_option("--model", a->model, "model directory (tiktoken.model + tokenizer_config.json)");
        sub.add_option("--text", a->text, "text to encode");
        sub.add_option("--file", a->file, "file whose bytes to encode");
        sub.add_option("--decode", a->decode, "comma-separated ids to decode, e.g. 1,2,3");
        sub.add_flag("--json", a->json, "print {\"ids\": [...], \"pieces\": [...]}");
        sub.add_flag("--allow-special", a->allow_special, "recognise special-token names in the text (never do this for user text)");
        sub.add_flag("--info", a->info, "print the vocabulary file, sha256 and sizes to stderr");
        return std::function<int()>([a] { return run_tokenize(*a); });
    }}};

} // namespace
