#include "tokenizer/ranks.h"

#include "core/error.h"
#include "tokenizer/sha256.h"

#include <array>
#include <charconv>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace perigee::tok {

namespace {

constexpr std::array<int8_t, 256> make_b64_table() {
    std::array<int8_t, 256> t{};
    for (auto & v : t) v = -1;
    const char * alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<uint8_t>(alpha[i])] = static_cast<int8_t>(i);
    return t;
}
constexpr auto k_b64 = make_b64_table();

// Strict standard base64 with padding. Returns false on any deviation.
bool b64_decode(std::string_view in, std::string & out) {
    out.clear();
    if (in.empty() || in.size() % 4 != 0) return false;
    size_t pad = 0;
    if (in.back() == '=') pad = in[in.size() - 2] == '=' ? 2 : 1;
    for (size_t i = 0; i + 4 <= in.size(); i += 4) {
        int v[4];
        const bool last = i + 4 == in.size();
        for (int k = 0; k < 4; ++k) {
            const char c = in[i + k];
            if (c == '=') {
                if (!last || k < 4 - static_cast<int>(pad)) return false;
                v[k] = 0;
            } else {
                v[k] = k_b64[static_cast<uint8_t>(c)];
                if (v[k] < 0) return false;
            }
        }
        const uint32_t w = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
        out.push_back(static_cast<char>(w >> 16));
        if (!(last && pad == 2)) out.push_back(static_cast<char>((w >> 8) & 0xFF));
        if (!(last && pad >= 1)) out.push_back(static_cast<char>(w & 0xFF));
        // non-canonical padding bits (e.g. "QR==") are rejected: they would alias another token
        if (last && pad == 2 && (v[1] & 0x0F) != 0) return false;
        if (last && pad == 1 && (v[2] & 0x03) != 0) return false;
    }
    return !out.empty();
}

} // namespace

std::string read_file_bytes(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    PG_CHECK(f.good(), "cannot open {}", path);
    std::ostringstream ss;
    ss << f.rdbuf();
    PG_CHECK(!f.bad(), "error reading {}", path);
    return ss.str();
}

rank_file parse_tiktoken_ranks(std::string_view text, const std::string & source) {
    rank_file rf;
    rf.source = source;
    rf.file_bytes = text.size();
    rf.sha256 = sha256_hex(text);
    std::vector<std::pair<std::string, size_t>> entries;  // by rank; .second = line number (0 = unset)
    std::unordered_map<std::string, size_t> seen;         // token -> line
    std::string bytes;
    // Ranks are contiguous 0..n-1, one per line of >= 4 bytes, so a rank >= the file's byte count is a gap for
    // sure: rejecting it before the resize below keeps `entries` sized by the file, not by an untrusted number
    // (a 16-byte file naming rank 2^31-1 allocated ~80 GB; found by tests/fuzz/fuzz_tiktoken_ranks).
    size_t pos = 0, line_no = 0;
    while (pos < text.size()) {
        ++line_no;
        size_t eol = text.find('\n', pos);
        if (eol == std::string_view::npos) eol = text.size();
        std::string_view line = text.substr(pos, eol - pos);
        pos = eol + 1;
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        PG_CHECK(!line.empty(), "{}:{}: empty line", source, line_no);
        const size_t sp = line.find(' ');
        PG_CHECK(sp != std::string_view::npos && sp > 0, "{}:{}: expected '<base64> <rank>'", source, line_no);
        const std::string_view b64 = line.substr(0, sp), num = line.substr(sp + 1);
        PG_CHECK(b64_decode(b64, bytes), "{}:{}: invalid base64 '{}'", source, line_no, b64);
        uint64_t rank = 0;
        const auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), rank);
        PG_CHECK(ec == std::errc() && p == num.data() + num.size() && !num.empty(),
                 "{}:{}: invalid rank '{}'", source, line_no, num);
        PG_CHECK(rank < (uint64_t(1) << 31), "{}:{}: rank {} out of range", source, line_no, rank);
        PG_CHECK(rank < text.size(), "{}:{}: rank {} cannot be contiguous (0..n-1) in a file of {} bytes", source,
                 line_no, rank, text.size());
        if (rank >= entries.size()) entries.resize(rank + 1);
        PG_CHECK(entries[rank].second == 0, "{}:{}: duplicate rank {} (first on line {})", source, line_no, rank,
                 entries[rank].second);
        const auto [it, inserted] = seen.emplace(bytes, line_no);
        PG_CHECK(inserted, "{}:{}: duplicate token '{}' (first on line {})", source, line_no, b64, it->second);
        entries[rank] = {bytes, line_no};
    }
    PG_CHECK(!entries.empty(), "{}: no entries", source);
    rf.tokens.reserve(entries.size());
    for (size_t r = 0; r < entries.size(); ++r) {
        PG_CHECK(entries[r].second != 0, "{}: rank {} is missing (ranks must be contiguous 0..{})", source, r,
                 entries.size() - 1);
        rf.tokens.push_back(std::move(entries[r].first));
    }
    for (int b = 0; b < 256; ++b) {
        PG_CHECK(seen.count(std::string(1, static_cast<char>(b))) == 1,
                 "{}: single byte 0x{:02X} has no rank (byte-level BPE needs all 256)", source, b);
    }
    return rf;
}

rank_file load_tiktoken_ranks(const std::string & path) {
    return parse_tiktoken_ranks(read_file_bytes(path), path);
}

} // namespace perigee::tok
