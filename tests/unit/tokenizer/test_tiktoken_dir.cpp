// Model tokenizer directories (tiktoken.model + tokenizer_config.json): the reserved-id rule of
// TOKENIZER §2.2, names from added_tokens_decoder only, and errors that name file and key.
#include "core/error.h"
#include "tokenizer/tiktoken_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

using namespace perigee::tok;

namespace {

struct temp_dir {
    std::filesystem::path path;
    temp_dir() {
        static int n = 0;
        path = std::filesystem::temp_directory_path() /
               ("perigee_tokdir_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
        std::filesystem::create_directories(path);
    }
    ~temp_dir() { std::filesystem::remove_all(path); }
    void write(const std::string & name, const std::string & text) const { std::ofstream(path / name) << text; }
};

// 256 single bytes + "hi" (rank 256) + "hi!" (rank 257).
std::string tiny_model() {
    static const char * alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string s;
    for (int b = 0; b < 256; ++b) {
        s += alpha[b >> 2];
        s += alpha[(b & 3) << 4];
        s += "== " + std::to_string(b) + "\n";
    }
    return s + "aGk= 256\naGkh 257\n";
}

const char * k3_like_config = R"({
  "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
  "added_tokens_decoder": {
    "258": {"content": "[BOS]", "special": true}, "259": {"content": "[EOS]", "special": true},
    "260": {"content": "<|end_of_msg|>", "special": true}, "261": {"content": "<|open|>", "special": false},
    "513": {"content": "[PAD]", "special": true}}})";

std::string load_error(const temp_dir & d) {
    try {
        load_tiktoken_dir(d.path.string());
    } catch (const perigee::error & e) {
        return e.what();
    }
    return "";
}

} // namespace

TEST(tokenizer_dir, reserved_id_rule) {
    temp_dir d;
    d.write("tiktoken.model", tiny_model());
    d.write("tokenizer_config.json", k3_like_config);
    const auto td = load_tiktoken_dir(d.path.string());
    const auto & t = *td.tok;
    EXPECT_EQ(td.info.n_ranks, 258u);
    EXPECT_EQ(td.info.n_vocab, 258u + 256u);
    EXPECT_EQ(t.n_vocab(), 514u);
    EXPECT_EQ(td.info.model_sha256.size(), 64u);
    EXPECT_EQ(*t.special_id("<|open|>"), 261);
    EXPECT_EQ(*t.special_id("[PAD]"), 513);
    EXPECT_EQ(*t.special_id("<|reserved_token_262|>"), 262);  // unnamed ids get the reserved name
    EXPECT_EQ(t.specials().size(), 256u);
    EXPECT_FALSE(t.special_id("<|im_end|>").has_value());      // never invented
    EXPECT_FALSE(t.is_hf_special(261));
    EXPECT_TRUE(t.is_hf_special(260));
    // ordinary text with special names stays text; ids stay below the reserved range
    for (auto id : t.encode_ordinary("hi! [EOS]<|open|>")) EXPECT_LT(id, 258);
    EXPECT_EQ(t.encode_ordinary("hi!"), (std::vector<token_id>{256, 33}));  // pre-tokenizer splits "hi" | "!"
    EXPECT_EQ(t.encode("hi<|open|>", std::vector<token_id>{261}), (std::vector<token_id>{256, 261}));
    EXPECT_EQ(t.decode(std::vector<token_id>{256, 261, 262}), "hi<|open|><|reserved_token_262|>");
}

TEST(tokenizer_dir, errors_name_file_and_key) {
    temp_dir d;
    EXPECT_NE(load_error(d).find("tiktoken.model not found"), std::string::npos);
    d.write("tiktoken.model", tiny_model());
    EXPECT_NE(load_error(d).find("tokenizer_config.json not found"), std::string::npos);
    d.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizer"})");
    EXPECT_NE(load_error(d).find("tokenizer_class 'LlamaTokenizer'"), std::string::npos);
    d.write("tokenizer_config.json", R"({"added_tokens_decoder": {}})");
    EXPECT_NE(load_error(d).find("'tokenizer_class'"), std::string::npos);
    d.write("tokenizer_config.json", R"({"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": {"600": {"content": "x"}}})");
    EXPECT_NE(load_error(d).find("id 600 is outside the reserved range"), std::string::npos) << load_error(d);
    d.write("tokenizer_config.json", R"({"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": {"12": {"content": "x"}}})");
    EXPECT_NE(load_error(d).find("id 12 is outside the reserved range"), std::string::npos);
    d.write("tokenizer_config.json", R"({"tokenizer_class": "TikTokenTokenizer", "eos_token": "[EOS]"})");
    EXPECT_NE(load_error(d).find("eos_token '[EOS]' is not a special token"), std::string::npos);
    d.write("tokenizer_config.json", R"({"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": {"300": {"content": "a"}, "301": {"content": "a"}}})");
    EXPECT_NE(load_error(d).find("given twice"), std::string::npos);
    d.write("tokenizer_config.json", "{not json");
    EXPECT_NE(load_error(d).find("invalid JSON"), std::string::npos);
    // nlohmann stops at a NUL byte and ignores the rest: refused by name (the text before the NUL alone is valid)
    d.write("tokenizer_config.json", std::string(k3_like_config) + std::string(1, '\0') + "junk");
    EXPECT_NE(load_error(d).find("invalid JSON: a NUL byte at offset"), std::string::npos) << load_error(d);
    d.write("tiktoken.model", tiny_model() + "!!!! 258\n");
    d.write("tokenizer_config.json", k3_like_config);
    EXPECT_NE(load_error(d).find("tiktoken.model:259: invalid base64"), std::string::npos) << load_error(d);
    // control: the valid pair loads
    d.write("tiktoken.model", tiny_model());
    EXPECT_EQ(load_error(d), "");
}
