// Chat formats of the Kimi family: rendering OpenAI-style messages into prompt segments and ids.
//  * K3 / K3.1 "XTML" frames (TOKENIZER §7), re-implemented from the spec.
//  * K2 / Kimi-Linear `<|im_*|>` envelope (TOKENIZER §6), the plain variant (no think blocks).
// A prompt is a list of segments; each is encoded separately (§4.5): special segments may contain
// the structural special tokens, text segments never become special tokens, and BPE never merges
// across a segment boundary. Which format applies is decided by the model's own files
// (chat_template::detect); an unknown format is an error.
#pragma once
#include "chat/pyjson.h"
#include "tokenizer/tokenizer.h"

#include <optional>
#include <string>
#include <vector>

namespace perigee::chat {

struct segment {
    std::string text;
    bool special = false;  // structural: encoded with the format's special tokens allowed
    bool operator==(const segment &) const = default;
};

enum class chat_format { k3_xtml, k2_im };
const char * chat_format_name(chat_format f);

struct render_options {
    bool add_generation_prompt = true;
    bool thinking = true;
    // K3: "low" | "high" | "max"; nullopt = no thinking-effort message. The HF default is "max".
    std::optional<std::string> thinking_effort = std::string("max");
    std::string tool_choice;        // "" | "auto" | "required" | "none" (named choices: not expressible)
    json response_format;           // null, or {"type": "json_object" | "json_schema", ...}
    std::optional<std::vector<std::string>> image_prompts;  // K3 image prompt strings, in order
};

// K3 XTML segments (TOKENIZER §7.1-7.4). `messages` is an array of OpenAI messages (keep key
// order: parse with ordered_json), `tools` an array or null. Errors name the message index.
std::vector<segment> render_k3(const json & messages, const json & tools, const render_options & opt);

// K2 / Kimi-Linear envelope (TOKENIZER §6): options that the checkpoint's template decides.
struct k2_options {
    std::string default_system;      // injected when the first message is not system ("" = none)
    bool return_of_header = true;    // tool results "## Return of {id}\n{content}"
    bool compact_tools_json = false; // tool_declare JSON separators
};
std::vector<segment> render_k2(const json & messages, const json & tools, const render_options & opt,
                               const k2_options & k2);

std::string join_segments(const std::vector<segment> & segs);

// The structural special names each format may emit (everything else in a special segment,
// e.g. `<|kimi_image_placeholder|>`, encodes as text).
std::vector<std::string> structural_specials(chat_format f);

class chat_template {
public:
    // Decides the format from the tokenizer's special table and the model directory
    // (tokenizer_config.json "chat_template" / chat_template.jinja). Throws when unknown.
    static chat_template detect(const tok::tokenizer & tok, const std::string & model_dir);
    chat_template(const tok::tokenizer & tok, chat_format f, k2_options k2 = {});

    chat_format format() const { return format_; }
    const k2_options & k2() const { return k2_; }
    std::vector<segment> render(const json & messages, const json & tools, const render_options & opt) const;
    // Segment-wise encoding (§4.5). Checks every id < n_vocab.
    std::vector<tok::token_id> encode(const std::vector<segment> & segs) const;
    // Ids to stop generation on: [EOS] and the end-of-message token (TOKENIZER §2.4).
    std::vector<tok::token_id> stop_ids() const;
    // Encoding a flat prompt string (raw completions): only the structural specials are allowed.
    std::vector<tok::token_id> encode_flat(const std::string & prompt) const;

private:
    const tok::tokenizer * tok_;
    chat_format format_;
    k2_options k2_;
    std::vector<tok::token_id> allowed_;  // structural special ids present in the vocabulary
};

} // namespace perigee::chat
