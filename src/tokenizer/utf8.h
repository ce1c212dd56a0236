// UTF-8 helpers shared by the tokenizer and the chat parsers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace perigee::tok {

// Length of the well-formed UTF-8 sequence starting at s[i] (1..4), or 0 if the bytes there are
// not a complete well-formed sequence. `incomplete` is set when the sequence is a valid prefix cut
// off by the end of `s` (more bytes could make it valid).
size_t utf8_seq_len(std::string_view s, size_t i, bool * incomplete = nullptr);

// True iff `s` is well-formed UTF-8 (no surrogates, no overlongs, <= U+10FFFF). On failure
// *bad_offset (if given) is the byte offset of the first ill-formed sequence.
bool utf8_valid(std::string_view s, size_t * bad_offset = nullptr);

// Replaces ill-formed subsequences by U+FFFD, one per maximal subpart (the Unicode / WHATWG /
// Python errors="replace" convention). If `hold_tail` is set, a trailing sequence that is merely
// incomplete is not replaced but left out, and its length is stored in *held (streaming use).
std::string utf8_replace_invalid(std::string_view s, bool hold_tail = false, size_t * held = nullptr);

// Length of the longest prefix of `s` that does not end inside an incomplete (cut-off) sequence.
size_t utf8_complete_prefix(std::string_view s);

// Decodes the well-formed sequence at s[i] of length n (from utf8_seq_len).
uint32_t utf8_decode_at(std::string_view s, size_t i, size_t n);

// Appends the UTF-8 encoding of code point cp.
void utf8_append(std::string & out, uint32_t cp);

} // namespace perigee::tok
