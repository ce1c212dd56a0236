#include "tokenizer/pretokenizer.h"

#include "core/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>

namespace perigee::tok {

namespace {

// Unicode White_Space (25 code points), the meaning of `\s` in Rust regex (TOKENIZER §3.2). PCRE2's
// UCP `\s` also matches U+180E, so it is replaced by this explicit class.
constexpr const char * k_ws_items =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

bool is_general_category(std::string_view n) {
    static const char * cats[] = {"L", "Lu", "Ll", "Lt", "Lm", "Lo", "LC", "L&", "M", "Mn", "Mc", "Me",
                                  "N", "Nd", "Nl", "No", "P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po",
                                  "S", "Sm", "Sc", "Sk", "So", "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf",
                                  "Cs", "Co", "Cn", "Any"};
    for (const char * c : cats) {
        if (n == c) return true;
    }
    return false;
}

// Translates one escape starting at pat[i] == '\\'; advances i past it.
std::string translate_escape(std::string_view pat, size_t & i, bool in_class) {
    PG_CHECK(i + 1 < pat.size(), "tiktoken pattern: dangling '\\' at offset {}", i);
    const char c = pat[i + 1];
    if (c == 'p' || c == 'P') {
        PG_CHECK(i + 2 < pat.size() && pat[i + 2] == '{', "tiktoken pattern: \\{} without braces at offset {}", c, i);
        const size_t close = pat.find('}', i + 3);
        PG_CHECK(close != std::string_view::npos, "tiktoken pattern: unterminated \\{}{{ at offset {}", c, i);
        std::string_view name = pat.substr(i + 3, close - (i + 3));
        i = close + 1;
        std::string out = "\\";
        out += c;
        out += '{';
        if (is_general_category(name) || name.find(':') != std::string_view::npos ||
            name.find('=') != std::string_view::npos) {
            out += name;
        } else {
            // Rust regex: a bare script name means Script; PCRE2 >= 10.40 would read it as
            // Script_Extensions (TOKENIZER §3.4 rewrite 2).
            out += "sc:";
            out += name;
        }
        out += '}';
        return out;
    }
    if (c == 's') {
        i += 2;
        return in_class ? std::string(k_ws_items) : "[" + std::string(k_ws_items) + "]";
    }
    if (c == 'S') {
        PG_CHECK(!in_class, "tiktoken pattern: \\S inside a class is not supported (offset {})", i);
        i += 2;
        return "[^" + std::string(k_ws_items) + "]";
    }
    PG_CHECK(c != 'd' && c != 'w' && c != 'D' && c != 'W' && c != 'b' && c != 'B',
             "tiktoken pattern: \\{} is not supported (offset {}); its Unicode meaning differs between engines", c, i);
    std::string out(pat.substr(i, 2));
    i += 2;
    return out;
}

// Translates the body of a class (after '[' and optional '^', up to but not including its ']').
// Stops at "&&" (returned through `stopped_at_and`) or at the closing ']'.
std::string translate_class_items(std::string_view pat, size_t & i, bool & stopped_at_and) {
    std::string out;
    stopped_at_and = false;
    bool first = true;
    while (true) {
        PG_CHECK(i < pat.size(), "tiktoken pattern: unterminated character class");
        const char c = pat[i];
        if (c == ']' && !first) break;
        if (c == '&' && i + 1 < pat.size() && pat[i + 1] == '&') {
            stopped_at_and = true;
            i += 2;
            break;
        }
        if (c == '\\') {
            out += translate_escape(pat, i, true);
        } else {
            PG_CHECK(c != '[', "tiktoken pattern: nested class at offset {} is only supported after '&&'", i);
            out += c;
            ++i;
        }
        first = false;
    }
    return out;
}

// pat[i] == '['. Returns the PCRE2 text for the whole class, advancing i past its ']'.
std::string translate_class(std::string_view pat, size_t & i) {
    const size_t open = i;
    ++i;
    bool negated = false;
    if (i < pat.size() && pat[i] == '^') {
        negated = true;
        ++i;
    }
    bool and_ = false;
    const std::string left = translate_class_items(pat, i, and_);
    if (!and_) {
        ++i;  // ']'
        return std::string(negated ? "[^" : "[") + left + "]";
    }
    // [LEFT&&[^RIGHT]]  ->  (?:(?![RIGHT])[LEFT])   (TOKENIZER §3.4 rewrite 1)
    PG_CHECK(!negated, "tiktoken pattern: negated class with '&&' at offset {} is not supported", open);
    PG_CHECK(i + 1 < pat.size() && pat[i] == '[' && pat[i + 1] == '^',
             "tiktoken pattern: only '&&[^...]' class subtraction is supported (offset {})", open);
    i += 2;
    bool and2 = false;
    const std::string right = translate_class_items(pat, i, and2);
    PG_CHECK(!and2, "tiktoken pattern: chained '&&' at offset {} is not supported", open);
    ++i;  // inner ']'
    PG_CHECK(i < pat.size() && pat[i] == ']', "tiktoken pattern: expected ']' closing the class at offset {}", open);
    ++i;  // outer ']'
    return "(?:(?![" + right + "])[" + left + "])";
}

struct jit_stack_holder {
    pcre2_jit_stack * stack = nullptr;
    pcre2_match_context * mctx = nullptr;
    pcre2_match_data * md = nullptr;
    jit_stack_holder() {
        // Group repeats (the lookahead subtraction) back-track per character: give the JIT a
        // large, lazily grown stack (heap memory, not the thread stack).
        stack = pcre2_jit_stack_create(64 * 1024, 256 * 1024 * 1024, nullptr);
        mctx = pcre2_match_context_create(nullptr);
        pcre2_jit_stack_assign(mctx, nullptr, stack);
        md = pcre2_match_data_create(1, nullptr);
    }
    ~jit_stack_holder() {
        pcre2_match_data_free(md);
        pcre2_match_context_free(mctx);
        pcre2_jit_stack_free(stack);
    }
};

jit_stack_holder & thread_jit() {
    thread_local jit_stack_holder h;
    return h;
}

} // namespace

std::string translate_tiktoken_pattern(std::string_view pat) {
    std::string out;
    size_t i = 0;
    while (i < pat.size()) {
        const char c = pat[i];
        if (c == '\\') {
            out += translate_escape(pat, i, false);
        } else if (c == '[') {
            out += translate_class(pat, i);
        } else {
            out += c;
            ++i;
        }
    }
    return out;
}

pretokenizer::pretokenizer(std::string_view pat_str) : pat_str_(pat_str) {
    pcre2_pattern_ = translate_tiktoken_pattern(pat_str);
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code * code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre2_pattern_.data()), pcre2_pattern_.size(),
                                      PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY | PCRE2_NO_UTF_CHECK, &err,
                                      &err_off, nullptr);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        PG_FAIL("pre-tokenizer pattern does not compile at offset {}: {} (PCRE2 pattern: {})", err_off,
                reinterpret_cast<const char *>(msg), pcre2_pattern_);
    }
    code_ = code;
    jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

pretokenizer::~pretokenizer() { pcre2_code_free(static_cast<pcre2_code *>(code_)); }

bool pretokenizer::next_match(std::string_view text, size_t pos, size_t & start, size_t & end) const {
    auto & h = thread_jit();
    auto * code = static_cast<pcre2_code *>(code_);
    const auto * subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    while (pos <= text.size()) {
        const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, h.md, h.mctx)
                            : pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, h.md, h.mctx);
        if (rc == PCRE2_ERROR_NOMATCH) return false;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            PG_FAIL("pre-tokenizer match failed at byte {}: {}", pos, reinterpret_cast<const char *>(msg));
        }
        const PCRE2_SIZE * ov = pcre2_get_ovector_pointer(h.md);
        start = ov[0];
        end = ov[1];
        if (end > start) return true;
        // An empty match cannot come from the supported patterns; step over one code point so the
        // scan always terminates.
        pos = start + 1;
        while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
    }
    return false;
}

std::vector<std::string> pretokenizer::split(std::string_view text) const {
    std::vector<std::string> out;
    split(text, [&](std::string_view p) { out.emplace_back(p); });
    return out;
}

} // namespace perigee::tok
