// Incremental output parsers (TOKENIZER §8): turn the detokenized model output (all markers kept,
// no spaces between specials) into reasoning_content, content and tool_calls. feed() accepts any
// byte split (even mid code point or mid marker); the concatenated deltas of feed()...finish()
// equal the one-shot parse, every delta is valid UTF-8 when the input is (the server feeds the
// streaming detokenizer's output, which always is; ill-formed input bytes pass through), and the work
// is linear in the input.
// Unknown shapes (text outside channels, incomplete calls, unparsable arguments) are reported in
// `warnings`, never silently dropped.
#pragma once
#include "chat/chat.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace perigee::chat {

struct tool_call {
    std::string id;         // K2: the model's id ("functions.get_weather:0"); K3: "call_<n>"
    std::string name;
    std::string arguments;  // JSON text (OpenAI `function.arguments`)
    bool operator==(const tool_call &) const = default;
};

struct chat_message {
    std::string reasoning_content;
    std::string content;
    std::vector<tool_call> tool_calls;
    std::vector<std::string> warnings;
};

struct chat_delta {
    std::string reasoning_content;
    std::string content;
    std::vector<tool_call> tool_calls;  // complete calls only, each emitted once
    bool empty() const { return reasoning_content.empty() && content.empty() && tool_calls.empty(); }
};

class output_parser {
public:
    virtual ~output_parser() = default;
    chat_delta feed(std::string_view bytes);
    chat_delta finish();
    const chat_message & message() const { return msg_; }
    bool done() const { return done_; }  // end-of-message marker seen

protected:
    struct marker { std::string text; int id; };
    enum sink { SINK_REASONING, SINK_CONTENT, SINK_BUFFER, SINK_STRAY };
    // Markers searched for in the current state.
    virtual const std::vector<marker> & markers() const = 0;
    virtual sink current_sink() const = 0;
    virtual void on_marker(int id, chat_delta & d) = 0;
    virtual void on_finish(chat_delta & d) = 0;

    void emit(std::string_view text, chat_delta & d);  // to current_sink()
    void warn(std::string w) { msg_.warnings.push_back(std::move(w)); }
    void add_call(tool_call c, chat_delta & d);

    chat_message msg_;
    std::string buffer_;  // SINK_BUFFER text (the call being read)
    bool done_ = false;

private:
    void run(chat_delta & d, bool at_end);
    void flush_text(std::string_view text, chat_delta & d, bool at_end);
    std::string pending_;     // unscanned input (a possible marker prefix / cut code point)
    std::string utf8_hold_;   // emitted-text bytes waiting for the rest of a code point
    std::string stray_;       // stray text of the current gap
};

// K3: the prompt ends with `<|open|>think<|sep|>` (thinking) or `<|open|>response<|sep|>`.
std::unique_ptr<output_parser> make_k3_parser(bool prompt_opened_think);
// K2 family: `prompt_opened_think` when the generation prompt ends with `<think>` (K2.5+).
std::unique_ptr<output_parser> make_k2_parser(bool prompt_opened_think);
std::unique_ptr<output_parser> make_parser(chat_format f, const render_options & opt);

// One-shot convenience: feed everything, finish, return the message.
chat_message parse_output(output_parser & p, std::string_view text);

} // namespace perigee::chat
