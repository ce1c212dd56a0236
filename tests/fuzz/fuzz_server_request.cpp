// F-3: HTTP request body -> strict JSON parse -> validated request -> chat render -> ids (RELIABILITY §B5,
// §C3 F-3), the same path the server's handlers take (src/server/server.cpp prepare()). Input: byte 0 picks
// the endpoint (chat, completion, tokenize, detokenize), the rest is the body.
// Contract: a bad body is an api_error (a 4xx) or a perigee::error (the server maps it to 400); any other
// exception would be a 500 and is a finding; so are crashes, sanitizer reports and hangs.
#include "fuzz_util.h"
#include "chat/chat.h"
#include "server/api.h"
#include "tokenizer/utf8.h"

using namespace perigee;
using namespace perigee::server;

namespace {
const chat::chat_template * g_k3 = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    try {
        static chat::chat_template ct(fuzz::synthetic_tokenizer(false), chat::chat_format::k3_xtml);
        g_k3 = &ct;
    } catch (const perigee::error & e) {
        std::fprintf(stderr, "fuzz_server_request: no K3 renderer over the synthetic vocabulary (%s); "
                             "fuzzing validation only\n", e.what());
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0 || size > 65536) return 0;
    const int which = data[0] & 3;
    const std::string body(reinterpret_cast<const char *>(data + 1), size - 1);
    parse_limits lim;
    lim.vocab_size = static_cast<int>(fuzz::synthetic_tokenizer(false).n_vocab());
    lim.served_model = "perigee-fuzz";
    try {
        const json j = parse_body(body);
        FUZZ_CHECK(tok::utf8_valid(body), "parse_body accepted invalid UTF-8");
        switch (which) {
        case 0:
        case 1: {
            const gen_request r = which == 0 ? parse_chat_request(j, lim) : parse_completion_request(j, lim);
            for (int32_t id : r.prompt_ids) FUZZ_CHECK(id >= 0 && id < lim.vocab_size, "prompt id %d accepted", id);
            for (int32_t id : r.stop_token_ids) FUZZ_CHECK(id >= 0 && id < lim.vocab_size, "stop id %d accepted", id);
            FUZZ_CHECK(r.stop.size() <= k_max_stop_strings, "%zu stop strings accepted", r.stop.size());
            if (g_k3 && which == 0) {
                chat::render_options o;
                o.thinking = r.thinking.value_or(true);
                if (r.thinking_effort_set) o.thinking_effort = r.thinking_effort;
                o.tool_choice = r.tool_choice;
                o.response_format = r.response_format;
                const auto ids = g_k3->encode(g_k3->render(r.messages, r.tools, o));
                for (auto id : ids) FUZZ_CHECK(id >= 0 && size_t(id) < fuzz::synthetic_tokenizer(false).n_vocab(), "id");
            } else if (g_k3 && r.prompt_text) {
                (void)g_k3->encode_flat(*r.prompt_text);
            }
            break;
        }
        case 2: (void)parse_tokenize_request(j, lim); break;
        case 3: {
            for (int32_t id : parse_detokenize_request(j, lim))
                FUZZ_CHECK(id >= 0 && id < lim.vocab_size, "detokenize id %d accepted", id);
            break;
        }
        }
    } catch (const api_error & e) {
        FUZZ_CHECK(e.status >= 400 && e.status < 500, "api_error status %d for a bad body", e.status);
    } catch (const perigee::error &) {
    }
    return 0;
}
