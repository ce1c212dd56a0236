// F-6: the incremental K3 / K2 output parsers (tool calls, reasoning; TOKENIZER §8, RELIABILITY §C3 F-6),
// built twice: fuzz_k3_parser (PG_FUZZ_K2 = 0) and fuzz_k2_parser (PG_FUZZ_K2 = 1).
// Input: byte 0 = flags (bit 0: the prompt opened thinking; bit 1: raw bytes), byte 1 = split seed, the rest =
// model output. By default the text first goes through utf8_replace_invalid, as in the server, where the parser
// only ever sees the streaming detokenizer's output (valid UTF-8). Properties: feed() at arbitrary cut points
// (even mid code point / mid marker) gives deltas whose concatenation equals the one-shot parse, and the
// same tool calls; with valid UTF-8 input every delta and every tool-call field is valid UTF-8. Raw mode
// (ill-formed bytes reach the parser, which passes them through verbatim) checks only crash-freedom and
// split invariance.
#include "fuzz_util.h"
#include "chat/parser.h"
#include "tokenizer/utf8.h"

#ifndef PG_FUZZ_K2
#define PG_FUZZ_K2 0
#endif

using namespace perigee;

namespace {
std::unique_ptr<chat::output_parser> make(bool think) {
    return PG_FUZZ_K2 ? chat::make_k2_parser(think) : chat::make_k3_parser(think);
}
bool g_check_utf8 = true;
void append(chat::chat_message & m, const chat::chat_delta & d, const char * where) {
    FUZZ_CHECK(!g_check_utf8 || tok::utf8_valid(d.reasoning_content), "%s: reasoning delta not valid UTF-8", where);
    FUZZ_CHECK(!g_check_utf8 || tok::utf8_valid(d.content), "%s: content delta not valid UTF-8", where);
    m.reasoning_content += d.reasoning_content;
    m.content += d.content;
    m.tool_calls.insert(m.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 2 || size > 16384) return 0;
    const bool think = (data[0] & 1) != 0;
    const std::string_view raw(reinterpret_cast<const char *>(data + 2), size - 2);
    g_check_utf8 = (data[0] & 2) == 0;
    const std::string text = g_check_utf8 ? tok::utf8_replace_invalid(raw) : std::string(raw);
    try {
        auto whole = make(think);
        const chat::chat_message ref = chat::parse_output(*whole, text);

        auto p = make(think);
        chat::chat_message got;
        fuzz::rng r(data[1]);
        for (size_t i = 0; i < text.size();) {
            const size_t n = std::min(text.size() - i, r.below(9));   // 0-byte feeds included
            append(got, p->feed(std::string_view(text).substr(i, n)), "feed");
            i += n;
        }
        append(got, p->finish(), "finish");
        FUZZ_CHECK(got.reasoning_content == ref.reasoning_content, "split reasoning differs from the one-shot parse");
        FUZZ_CHECK(got.content == ref.content, "split content differs from the one-shot parse");
        FUZZ_CHECK(got.tool_calls == ref.tool_calls, "split tool calls differ (%zu vs %zu)", got.tool_calls.size(),
                   ref.tool_calls.size());
        FUZZ_CHECK(p->message().tool_calls == ref.tool_calls, "message() tool calls differ from the deltas");
        if (!g_check_utf8) return 0;
        FUZZ_CHECK(tok::utf8_valid(ref.content) && tok::utf8_valid(ref.reasoning_content), "one-shot output not UTF-8");
        for (const auto & c : ref.tool_calls)
            FUZZ_CHECK(tok::utf8_valid(c.name) && tok::utf8_valid(c.arguments) && tok::utf8_valid(c.id),
                       "tool call field not valid UTF-8");
    } catch (const perigee::error &) {
    }
    return 0;
}
