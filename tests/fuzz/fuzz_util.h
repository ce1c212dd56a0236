// Shared helpers of the libFuzzer targets (tests/fuzz, issue 9, RELIABILITY.md §A5).
//
// Contract checked by every target: malformed input may only ever produce perigee::error (or the server's
// api_error); any other exception, a crash, a sanitizer report, a hang (> -timeout) or an allocation above
// -rss_limit_mb is a finding. FUZZ_CHECK is for properties (round trips, differential equality): it prints
// what disagreed and aborts, so libFuzzer saves the input.
#pragma once
#include "core/error.h"
#include "tokenizer/patterns.h"
#include "tokenizer/ranks.h"
#include "tokenizer/tokenizer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#define FUZZ_CHECK(cond, ...)                                                              \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            std::fprintf(stderr, "FUZZ_CHECK failed: %s at %s:%d: ", #cond, __FILE__, __LINE__); \
            std::fprintf(stderr, __VA_ARGS__);                                             \
            std::fprintf(stderr, "\n");                                                    \
            std::abort();                                                                  \
        }                                                                                  \
    } while (0)

namespace perigee::fuzz {

// A file in memory (memfd) whose path (/proc/self/fd/N) can be opened and mmapped like a shard.
class mem_file {
public:
    mem_file() : fd_(memfd_create("perigee-fuzz", 0)) { FUZZ_CHECK(fd_ >= 0, "memfd_create failed"); }
    ~mem_file() { close(fd_); }
    mem_file(const mem_file &) = delete;
    mem_file & operator=(const mem_file &) = delete;
    // Replaces the contents.
    void set(const uint8_t * data, size_t size) {
        FUZZ_CHECK(ftruncate(fd_, 0) == 0, "ftruncate");
        size_t off = 0;
        while (off < size) {
            const ssize_t n = pwrite(fd_, data + off, size - off, static_cast<off_t>(off));
            FUZZ_CHECK(n > 0, "pwrite");
            off += static_cast<size_t>(n);
        }
    }
    std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }
private:
    int fd_;
};

// Deterministic split points / choices from a seed (xorshift; no <random> distribution differences).
struct rng {
    uint64_t s;
    explicit rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
    size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(next() % n); }
};

inline std::string base64(std::string_view in) {
    static const char * t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < in.size(); i += 3) {
        const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
        out += t[v >> 18]; out += t[(v >> 12) & 63]; out += t[(v >> 6) & 63]; out += t[v & 63];
    }
    if (i + 1 == in.size()) {
        const uint32_t v = uint8_t(in[i]) << 16;
        out += t[v >> 18]; out += t[(v >> 12) & 63]; out += "==";
    } else if (i + 2 == in.size()) {
        const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
        out += t[v >> 18]; out += t[(v >> 12) & 63]; out += t[(v >> 6) & 63]; out += '=';
    }
    return out;
}

// A small but realistic tiktoken rank file, built deterministically: the 256 single bytes, then every
// substring of 2..6 bytes that occurs at least twice in a mixed-script sample (English, code, CJK, emoji,
// accented Latin, whitespace runs), ordered by (length, bytes). Every longer token's prefix is a token, so
// BPE merges reach them. Returned as rank-file TEXT so that building it also goes through the strict loader.
inline std::string synthetic_rank_text() {
    static const char * sample =
        "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.\n\n"
        "int main(int argc, char ** argv) { return argc > 1 ? 0 : 1; }\n    if (x == y) { return; }\n"
        "def f(x):\n    return x * 2  # comment\n\tindented\r\n"
        "\xe4\xb8\xad\xe6\x96\x87\xe6\xb5\x8b\xe8\xaf\x95\xef\xbc\x8c\xe4\xb8\xad\xe6\x96\x87\xe6\xb5\x8b\xe8\xaf\x95\xe3\x80\x82 "
        "caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9 caf\xc3\xa9 \xf0\x9f\x98\x80\xf0\x9f\x98\x80 \xf0\x9f\x91\x8d\xf0\x9f\x91\x8d "
        "1234567890 1234567890 3.14159 2.71828 ____ ^^^^ .... ---- ==== \"quoted\" 'quoted' {\"json\": [1, 2]} {\"json\": [3]}";
    const std::string s(sample);
    std::map<std::string, int> count;
    for (size_t len = 2; len <= 6; ++len)
        for (size_t i = 0; i + len <= s.size(); ++i) count[s.substr(i, len)]++;
    std::vector<std::string> toks;
    for (int b = 0; b < 256; ++b) toks.push_back(std::string(1, char(b)));
    std::vector<std::string> multi;
    for (auto & [k, v] : count)
        if (v >= 2) multi.push_back(k);
    std::stable_sort(multi.begin(), multi.end(), [](const std::string & a, const std::string & b) { return a.size() < b.size(); });
    toks.insert(toks.end(), multi.begin(), multi.end());
    std::string text;
    for (size_t r = 0; r < toks.size(); ++r) text += base64(toks[r]) + " " + std::to_string(r) + "\n";
    return text;
}

// K3 special names (TOKENIZER §2.3), placed right after the ranks; ids with gaps as in the real table.
inline std::vector<tok::special_token> k3_specials(tok::token_id base) {
    return {{"[BOS]", base + 0, true},           {"[EOS]", base + 1, true},          {"<|end_of_msg|>", base + 2, true},
            {"<|open|>", base + 3, false},        {"<|close|>", base + 4, false},     {"<|sep|>", base + 5, false},
            {"[start_header_id]", base + 6, true}, {"[end_header_id]", base + 7, true}, {"[EOT]", base + 9, true},
            {"<|im_end|>", base + 10, true},       {"<think>", base + 11, false},      {"</think>", base + 12, false}};
}

// The fuzzers' tokenizer (built once per process). `chunked` adds a small Kimi-style outer chunking so the
// window/run splitting is exercised on short inputs.
inline const tok::tokenizer & synthetic_tokenizer(bool chunked) {
    static std::unique_ptr<tok::tokenizer> plain, small_chunks;
    auto & t = chunked ? small_chunks : plain;
    if (!t) {
        tok::rank_file rf = tok::parse_tiktoken_ranks(synthetic_rank_text(), "synthetic");
        const auto base = static_cast<tok::token_id>(rf.tokens.size());
        tok::tokenizer_options opt;
        if (chunked) { opt.max_encode_chars = 48; opt.max_run_chars = 7; }
        t = std::make_unique<tok::tokenizer>(std::move(rf), k3_specials(base), tok::k_pat_kimi, opt);
    }
    return *t;
}

} // namespace perigee::fuzz
