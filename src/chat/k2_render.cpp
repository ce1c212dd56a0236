// K2 / Kimi-Linear `<|im_*|>` envelope (TOKENIZER §6.1-6.4, §6.7): the plain variant without
// think blocks. Which options apply is read from the checkpoint's template (chat_template.cpp).
#include "chat/chat.h"

#include "core/error.h"

namespace perigee::chat {

namespace {

std::string str_of(const json & m, const char * key) {
    if (!m.is_object() || !m.contains(key) || m[key].is_null()) return "";
    PG_CHECK(m[key].is_string(), "chat: field '{}' must be a string", key);
    return m[key].get<std::string>();
}

void content_text(std::vector<segment> & segs, const json & content, size_t i) {
    const auto text = [&](const std::string & t) {
        if (!t.empty()) segs.push_back({t, false});
    };
    if (content.is_null()) return;
    if (content.is_string()) {
        text(content.get<std::string>());
        return;
    }
    PG_CHECK(content.is_array(), "chat: message {} content must be a string, a list of parts or null", i);
    for (const auto & part : content) {
        PG_CHECK(part.is_object() && str_of(part, "type") == "text",
                 "chat: message {} has a content part the K2 envelope cannot render (only text parts)", i);
        text(str_of(part, "text"));
    }
}

} // namespace

std::vector<segment> render_k2(const json & messages, const json & tools, const render_options & opt,
                               const k2_options & k2) {
    PG_CHECK(messages.is_array(), "chat: messages must be an array");
    PG_CHECK(tools.is_null() || tools.is_array(), "chat: tools must be an array or null");
    PG_CHECK(opt.tool_choice.empty() || opt.tool_choice == "auto",
             "chat: tool_choice '{}' cannot be expressed in a K2 prompt", opt.tool_choice);
    std::vector<segment> segs;
    const auto sp = [&](const char * t) { segs.push_back({t, true}); };
    const auto text = [&](const std::string & t) {
        if (!t.empty()) segs.push_back({t, false});
    };
    const auto header = [&](const std::string & role, const std::string & name) {
        sp(role == "user" ? "<|im_user|>" : role == "assistant" ? "<|im_assistant|>" : "<|im_system|>");
        text(name.empty() ? role : name);
        sp("<|im_middle|>");
    };
    if (tools.is_array() && !tools.empty()) {
        header("system", "tool_declare");
        text(py_json_dumps(deep_sorted(tools), k2.compact_tools_json));
        sp("<|im_end|>");
    }
    if (!k2.default_system.empty() && (messages.empty() || str_of(messages[0], "role") != "system")) {
        header("system", "system");
        text(k2.default_system);
        sp("<|im_end|>");
    }
    for (size_t i = 0; i < messages.size(); ++i) {
        const json & m = messages[i];
        PG_CHECK(m.is_object(), "chat: message {} is not an object", i);
        const std::string role = str_of(m, "role");
        PG_CHECK(role == "system" || role == "user" || role == "assistant" || role == "tool",
                 "chat: message {} has unsupported role '{}'", i, role);
        const json content = m.contains("content") ? m["content"] : json();
        header(role, str_of(m, "name"));
        if (role == "tool" && k2.return_of_header) {
            text("## Return of " + str_of(m, "tool_call_id") + "\n");
        }
        content_text(segs, content, i);
        if (role == "assistant" && m.contains("tool_calls") && m["tool_calls"].is_array() && !m["tool_calls"].empty()) {
            sp("<|tool_calls_section_begin|>");
            size_t idx = 0;
            for (const auto & call : m["tool_calls"]) {
                const json fn = call.is_object() && call.contains("function") ? call["function"] : json::object();
                std::string id = str_of(call, "id");
                if (id.empty()) id = "functions." + str_of(fn, "name") + ":" + std::to_string(idx);
                sp("<|tool_call_begin|>");
                text(id);
                sp("<|tool_call_argument_begin|>");
                const json args = fn.contains("arguments") ? fn["arguments"] : json::object();
                text(args.is_string() ? args.get<std::string>() : py_json_dumps(args, false));
                sp("<|tool_call_end|>");
                ++idx;
            }
            sp("<|tool_calls_section_end|>");
        }
        sp("<|im_end|>");
    }
    if (opt.add_generation_prompt) header("assistant", "assistant");
    return segs;
}

} // namespace perigee::chat
