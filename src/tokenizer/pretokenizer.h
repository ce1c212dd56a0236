// Regex pre-tokenizer: splits text into the pieces that BPE encodes independently, exactly as the
// tiktoken Rust core (fancy-regex, leftmost-first, find_iter) does for a given `pat_str`.
// Implemented with PCRE2 (UTF + UCP, JIT) after translating the tiktoken pattern syntax
// (TOKENIZER §3.4): `\p{Script}` -> `\p{sc:Script}` (Script, not Script_Extensions),
// `[X&&[^Y]]` -> `(?:(?!Y)[X])`, `\s`/`\S` -> the explicit 25-code-point White_Space class.
// Unicode tables are PCRE2's (10.42: Unicode 15.0); see TOKENIZER §3.4 for the version caveat.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace perigee::tok {

// Rewrites a tiktoken (fancy-regex) pattern into an equivalent PCRE2 pattern. Throws on syntax
// it does not know how to translate (it never guesses).
std::string translate_tiktoken_pattern(std::string_view pat_str);

class pretokenizer {
public:
    explicit pretokenizer(std::string_view pat_str);
    ~pretokenizer();
    pretokenizer(const pretokenizer &) = delete;
    pretokenizer & operator=(const pretokenizer &) = delete;

    // Calls fn(piece) for every match, in order. `text` must be valid UTF-8 (checked by callers;
    // PCRE2 is told not to re-check). Text between matches (never produced by the Kimi, o200k or
    // cl100k patterns) is dropped, like fancy-regex's find_iter.
    template <typename F>
    void split(std::string_view text, F && fn) const {
        size_t pos = 0;
        while (pos < text.size()) {
            size_t start = 0, end = 0;
            if (!next_match(text, pos, start, end)) break;
            fn(text.substr(start, end - start));
            pos = end;
        }
    }
    std::vector<std::string> split(std::string_view text) const;

    const std::string & pcre2_pattern() const { return pcre2_pattern_; }
    const std::string & pat_str() const { return pat_str_; }

private:
    // Finds the first match at or after `pos`; false if none.
    bool next_match(std::string_view text, size_t pos, size_t & start, size_t & end) const;

    std::string pat_str_;
    std::string pcre2_pattern_;
    void * code_ = nullptr;  // pcre2_code_8 *
    bool jit_ = false;
};

} // namespace perigee::tok
