#include "chat/chat.h"

#include "core/error.h"
#include "tokenizer/ranks.h"

#include <filesystem>

namespace perigee::chat {

const char * chat_format_name(chat_format f) {
    switch (f) {
        case chat_format::k3_xtml: return "k3-xtml";
        case chat_format::k2_im: return "k2-im";
    }
    return "?";
}

std::vector<std::string> structural_specials(chat_format f) {
    if (f == chat_format::k3_xtml) {
        return {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>",
                "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"};
    }
    return {"<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"};
}

chat_template::chat_template(const tok::tokenizer & tok, chat_format f, k2_options k2)
    : tok_(&tok), format_(f), k2_(std::move(k2)) {
    for (const auto & name : structural_specials(f)) {
        if (auto id = tok.special_id(name)) allowed_.push_back(*id);
    }
}

chat_template chat_template::detect(const tok::tokenizer & tok, const std::string & model_dir) {
    namespace fs = std::filesystem;
    const auto has_all = [&](std::initializer_list<const char *> names) {
        for (const char * n : names) {
            if (!tok.special_id(n)) return false;
        }
        return true;
    };
    const bool k3 = has_all({"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"});
    const bool k2 = has_all({"<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>"});
    PG_CHECK(!(k3 && k2), "chat: {} defines both K3 XTML markers and K2 <|im_*|> tokens; format is ambiguous", model_dir);
    // The checkpoint's template text, if it ships one.
    std::string tmpl;
    const fs::path jinja = fs::path(model_dir) / "chat_template.jinja";
    const fs::path cfg_path = fs::path(model_dir) / "tokenizer_config.json";
    if (fs::exists(jinja)) tmpl = tok::read_file_bytes(jinja.string());
    if (tmpl.empty() && fs::exists(cfg_path)) {
        const json cfg = json::parse(tok::read_file_bytes(cfg_path.string()), nullptr, false);
        if (cfg.is_object() && cfg.contains("chat_template")) {
            const auto & ct = cfg["chat_template"];
            if (ct.is_string()) tmpl = ct.get<std::string>();
            else if (ct.is_array()) {
                for (const auto & e : ct) {
                    if (e.is_object() && e.value("name", "") == "default" && e.contains("template")) {
                        tmpl = e["template"].get<std::string>();
                    }
                }
            }
        }
    }
    if (k3) {
        // K3 ships no Jinja template (its encoder is Python); a template here means another format.
        PG_CHECK(tmpl.empty() || tmpl.find("<|open|>") != std::string::npos,
                 "chat: {} has K3 markers but a chat template that does not use them; unknown format", model_dir);
        return chat_template(tok, chat_format::k3_xtml);
    }
    if (k2) {
        k2_options o;
        if (!tmpl.empty()) {
            PG_CHECK(tmpl.find("<|im_middle|>") != std::string::npos,
                     "chat: {} chat template does not use <|im_middle|>; unknown K2 variant", model_dir);
            PG_CHECK(tmpl.find("<think>") == std::string::npos,
                     "chat: {} chat template renders <think> blocks (K2-Thinking / K2.5+); that variant is not "
                     "implemented", model_dir);
            for (const char * sys : {"You are Kimi, an AI assistant created by Moonshot AI.", "You are a helpful assistant"}) {
                if (tmpl.find(sys) != std::string::npos) o.default_system = sys;
            }
            o.return_of_header = tmpl.find("## Return of") != std::string::npos;
            o.compact_tools_json = tmpl.find("separators") != std::string::npos;
        } else {
            // No template file: the plain Kimi-Linear envelope (TOKENIZER §6.7).
            o.return_of_header = false;
        }
        return chat_template(tok, chat_format::k2_im, o);
    }
    PG_FAIL("chat: {}: unknown chat format (neither K3 XTML markers nor K2 <|im_*|> tokens in the special table)",
            model_dir);
}

std::vector<segment> chat_template::render(const json & messages, const json & tools, const render_options & opt) const {
    return format_ == chat_format::k3_xtml ? render_k3(messages, tools, opt) : render_k2(messages, tools, opt, k2_);
}

std::vector<tok::token_id> chat_template::encode(const std::vector<segment> & segs) const {
    std::vector<tok::token_id> ids;
    for (const auto & s : segs) {
        if (s.special) tok_->encode_append(s.text, allowed_, ids);
        else tok_->encode_ordinary_append(s.text, ids);
    }
    for (tok::token_id id : ids) {
        PG_CHECK(id >= 0 && static_cast<size_t>(id) < tok_->n_vocab(), "chat: produced id {} >= n_vocab {}", id,
                 tok_->n_vocab());
    }
    return ids;
}

std::vector<tok::token_id> chat_template::encode_flat(const std::string & prompt) const {
    return tok_->encode(prompt, allowed_);
}

std::vector<tok::token_id> chat_template::stop_ids() const {
    std::vector<tok::token_id> ids;
    for (const char * n : {"[EOS]", format_ == chat_format::k3_xtml ? "<|end_of_msg|>" : "<|im_end|>"}) {
        if (auto id = tok_->special_id(n)) ids.push_back(*id);
    }
    return ids;
}

} // namespace perigee::chat
