#include "tokenizer/utf8.h"

namespace perigee::tok {

size_t utf8_seq_len(std::string_view s, size_t i, bool * incomplete) {
    if (incomplete) *incomplete = false;
    const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
    const uint8_t c = b(i);
    if (c < 0x80) return 1;
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0) lo = 0xA0;   // no overlongs
        if (c == 0xED) hi = 0x9F;   // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0) lo = 0x90;   // no overlongs
        if (c == 0xF4) hi = 0x8F;   // <= U+10FFFF
    } else {
        return 0;
    }
    for (size_t k = 1; k < n; ++k) {
        if (i + k >= s.size()) {
            if (incomplete) *incomplete = true;
            return 0;
        }
        const uint8_t x = b(i + k);
        const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (x < l || x > h) return 0;
    }
    return n;
}

bool utf8_valid(std::string_view s, size_t * bad_offset) {
    size_t i = 0;
    while (i < s.size()) {
        // ASCII fast path
        if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
        const size_t n = utf8_seq_len(s, i);
        if (n == 0) {
            if (bad_offset) *bad_offset = i;
            return false;
        }
        i += n;
    }
    return true;
}

// Length of the maximal subpart at s[i] (an ill-formed sequence): the bytes that form a valid
// prefix of some sequence, at least 1.
static size_t maximal_subpart(std::string_view s, size_t i) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 1;
    size_t k = 1;
    for (; k < n && i + k < s.size(); ++k) {
        const uint8_t x = static_cast<uint8_t>(s[i + k]);
        const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (x < l || x > h) break;
    }
    return k;
}

std::string utf8_replace_invalid(std::string_view s, bool hold_tail, size_t * held) {
    std::string out;
    out.reserve(s.size());
    if (held) *held = 0;
    size_t i = 0;
    while (i < s.size()) {
        if (static_cast<uint8_t>(s[i]) < 0x80) { out.push_back(s[i]); ++i; continue; }
        bool incomplete = false;
        const size_t n = utf8_seq_len(s, i, &incomplete);
        if (n > 0) {
            out.append(s.substr(i, n));
            i += n;
        } else if (incomplete && hold_tail) {
            if (held) *held = s.size() - i;
            break;
        } else {
            out.append("\xEF\xBF\xBD");
            i += incomplete ? s.size() - i : maximal_subpart(s, i);
        }
    }
    return out;
}

size_t utf8_complete_prefix(std::string_view s) {
    // Look back at most 3 bytes for a lead byte whose sequence is cut off by the end.
    const size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n; ++back) {
        const size_t i = n - back;
        const uint8_t c = static_cast<uint8_t>(s[i]);
        if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
        bool incomplete = false;
        utf8_seq_len(s, i, &incomplete);
        return incomplete ? i : n;
    }
    return n;
}

uint32_t utf8_decode_at(std::string_view s, size_t i, size_t n) {
    const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
    switch (n) {
        case 1: return b(0);
        case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
        case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
        default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
    }
}

void utf8_append(std::string & out, uint32_t cp) {
    if (cp < 0x80) {
        out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
        out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
        out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

} // namespace perigee::tok
