// K3 XTML renderer, written from TOKENIZER §7 (segments, attribute splitting, message order).
#include "chat/chat.h"

#include "core/error.h"

#include <algorithm>

namespace perigee::chat {

namespace {

constexpr const char * k_open = "<|open|>";
constexpr const char * k_close = "<|close|>";
constexpr const char * k_sep = "<|sep|>";
constexpr const char * k_eom = "<|end_of_msg|>";
constexpr const char * k_image_placeholder = "<|kimi_image_placeholder|>";

using attrs = std::vector<std::pair<std::string, std::string>>;

struct builder {
    std::vector<segment> segs;
    void text(const std::string & t) {
        if (!t.empty()) segs.push_back({t, false});
    }
    void special(const std::string & t) {
        if (!t.empty()) segs.push_back({t, true});
    }
    static std::string escape(const std::string & v) {
        std::string out;
        for (char c : v) {
            if (c == '&') out += "&amp;";
            else if (c == '"') out += "&quot;";
            else out.push_back(c);
        }
        return out;
    }
    void open(const std::string & tag, const attrs & a = {}) {
        special(k_open);
        text(tag);
        for (const auto & [k, v] : a) {
            text(" " + k);
            text("=\"");
            text(escape(v));
            text("\"");
        }
        special(k_sep);
    }
    void close(const std::string & tag) {
        special(k_close);
        text(tag);
        special(k_sep);
    }
    void message(const attrs & a, const std::string & body) {
        open("message", a);
        text(body);
        close("message");
        special(k_eom);
    }
};

std::string str_field(const json & m, const char * key) {
    if (!m.is_object() || !m.contains(key) || m[key].is_null()) return "";
    PG_CHECK(m[key].is_string(), "chat: field '{}' must be a string", key);
    return m[key].get<std::string>();
}

struct content_ctx {
    const std::optional<std::vector<std::string>> * prompts;
    size_t next_image = 0;
};

void content_segments(builder & b, const json & content, content_ctx & ctx, size_t msg_index) {
    if (content.is_null()) return;
    const auto next_image = [&]() -> std::pair<std::string, bool> {
        if (ctx.prompts->has_value()) {
            const auto & p = ctx.prompts->value();
            PG_CHECK(ctx.next_image < p.size(), "chat: message {} has more images than image prompts ({})", msg_index,
                     p.size());
            return {p[ctx.next_image++], true};
        }
        return {k_image_placeholder, true};
    };
    if (content.is_string()) {
        const std::string s = content.get<std::string>();
        if (!ctx.prompts->has_value()) {
            b.text(s);
            return;
        }
        size_t pos = 0;
        while (true) {
            const size_t at = s.find(k_image_placeholder, pos);
            if (at == std::string::npos) break;
            b.text(s.substr(pos, at - pos));
            b.special(next_image().first);
            pos = at + std::string(k_image_placeholder).size();
        }
        b.text(s.substr(pos));
        return;
    }
    PG_CHECK(content.is_array(), "chat: message {} content must be a string, a list of parts or null", msg_index);
    for (const auto & part : content) {
        PG_CHECK(part.is_object(), "chat: message {} has a content part that is not an object", msg_index);
        const std::string type = str_field(part, "type");
        if (type == "text") {
            b.text(str_field(part, "text"));
        } else if (type == "image" || type == "image_url") {
            b.special(next_image().first);
        } else {
            PG_FAIL("chat: message {} has an unsupported content part type '{}'", msg_index, type);
        }
    }
}

// Tool-call arguments (§7.2 step 2): object (kept in order), or a raw "json block".
struct call_args {
    bool is_block = false;
    json object;
    std::string raw;
};

call_args parse_arguments(const json & args, size_t msg_index) {
    call_args out;
    if (args.is_null()) {
        out.object = json::object();
        return out;
    }
    if (args.is_object()) {
        out.object = args;
        return out;
    }
    PG_CHECK(args.is_string(), "chat: message {} tool call arguments must be an object or a string", msg_index);
    const std::string s = args.get<std::string>();
    if (py_is_blank(s)) {
        out.object = json::object();
        return out;
    }
    json parsed = json::parse(s, nullptr, false);
    if (parsed.is_discarded()) {
        out.is_block = true;
        out.raw = s;
        return out;
    }
    PG_CHECK(parsed.is_object(), "chat: message {} tool call arguments are valid JSON but not an object: {}", msg_index,
             s.substr(0, 200));
    out.object = std::move(parsed);
    return out;
}

std::string arg_type(const json & v) {
    if (v.is_boolean()) return "boolean";
    if (v.is_null()) return "null";
    if (v.is_number()) return "number";
    if (v.is_string()) return "string";
    if (v.is_object()) return "object";
    return "array";
}

const json & function_of(const json & call) {
    static const json empty = json::object();
    if (call.is_object() && call.contains("function") && call["function"].is_object()) return call["function"];
    return empty;
}

std::string tool_declare_body(const json & tools, bool dynamic) {
    const std::string t = py_json_dumps(deep_sorted(tools), true);
    if (dynamic) {
        return "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
               "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
               "```json\n" + t + "\n```";
    }
    return "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + t + "\n```";
}

// §7.2 pre-processing step 1: re-order tool results that answer the preceding assistant's calls.
json reorder_tool_results(const json & messages) {
    json msgs = messages;
    for (size_t i = 0; i < msgs.size(); ++i) {
        const json & m = msgs[i];
        if (str_field(m, "role") != "assistant" || !m.contains("tool_calls") || !m["tool_calls"].is_array() ||
            m["tool_calls"].empty()) {
            continue;
        }
        const json calls = m["tool_calls"];
        size_t j = i + 1;
        while (j < msgs.size() && str_field(msgs[j], "role") == "tool") ++j;
        if (j == i + 1) continue;
        std::vector<std::pair<size_t, json>> run;  // (1-based call position, message)
        bool all = true;
        for (size_t k = i + 1; k < j && all; ++k) {
            std::string id = str_field(msgs[k], "tool_call_id");
            if (id.empty()) id = str_field(msgs[k], "id");
            size_t pos = 0;
            for (size_t c = 0; c < calls.size() && !id.empty(); ++c) {
                if (calls[c].is_object() && calls[c].contains("id") && calls[c]["id"].is_string() &&
                    calls[c]["id"].get<std::string>() == id) {
                    pos = c + 1;
                    break;
                }
            }
            if (pos == 0) all = false;
            else run.emplace_back(pos, msgs[k]);
        }
        if (!all) continue;
        std::stable_sort(run.begin(), run.end(), [](const auto & a, const auto & b) { return a.first < b.first; });
        for (size_t k = 0; k < run.size(); ++k) {
            json tm = run[k].second;
            const std::string name = str_field(function_of(calls[run[k].first - 1]), "name");
            tm["tool"] = name;
            if (tm.contains("name")) tm["name"] = name;
            msgs[i + 1 + k] = std::move(tm);
        }
        i = j - 1;
    }
    return msgs;
}

} // namespace

std::vector<segment> render_k3(const json & messages_in, const json & tools, const render_options & opt) {
    PG_CHECK(messages_in.is_array(), "chat: messages must be an array");
    PG_CHECK(tools.is_null() || tools.is_array(), "chat: tools must be an array or null");
    const json messages = reorder_tool_results(messages_in);
    builder b;
    content_ctx ctx{&opt.image_prompts};

    if (tools.is_array() && !tools.empty()) {
        b.message({{"role", "system"}, {"type", "tool-declare"}}, tool_declare_body(tools, false));
    }
    if (opt.thinking && opt.thinking_effort.has_value()) {
        const std::string & e = *opt.thinking_effort;
        PG_CHECK(e == "low" || e == "high" || e == "max",
                 "chat: thinking_effort '{}' is not supported (low, high or max)", e);
        b.message({{"role", "system"}, {"type", "thinking-effort"}},
                  "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                  "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                  "Now the system is invoked with `thinking_effort=" + e + "`.");
    }
    json last_calls = json::array();
    size_t tool_counter = 0;
    for (size_t i = 0; i < messages.size(); ++i) {
        const json & m = messages[i];
        PG_CHECK(m.is_object(), "chat: message {} is not an object", i);
        const std::string role = str_field(m, "role");
        const std::string name = str_field(m, "name");
        const json content = m.contains("content") ? m["content"] : json();
        if (role == "user" || (role == "system" && !(m.contains("tools") && m["tools"].is_array() && !m["tools"].empty()))) {
            attrs a = {{"role", role}};
            if (!name.empty()) a.emplace_back("name", name);
            b.open("message", a);
            content_segments(b, content, ctx, i);
            b.close("message");
            b.special(k_eom);
        } else if (role == "system") {
            b.message({{"role", "system"}, {"type", "tool-declare"}}, tool_declare_body(m["tools"], true));
        } else if (role == "assistant") {
            attrs a = {{"role", "assistant"}};
            if (!name.empty()) a.emplace_back("name", name);
            b.open("message", a);
            if (opt.thinking) {
                b.open("think");
                std::string reasoning = str_field(m, "reasoning_content");
                if (reasoning.empty()) reasoning = str_field(m, "reasoning");
                if (!py_is_blank(reasoning)) b.text(reasoning);
                b.close("think");
            }
            b.open("response");
            content_segments(b, content, ctx, i);
            b.close("response");
            last_calls = m.contains("tool_calls") && m["tool_calls"].is_array() ? m["tool_calls"] : json::array();
            tool_counter = 0;
            if (!last_calls.empty()) {
                b.open("tools");
                for (size_t p = 0; p < last_calls.size(); ++p) {
                    const json & fn = function_of(last_calls[p]);
                    const std::string fname = str_field(fn, "name");
                    b.open("call", {{"tool", fname}, {"index", std::to_string(p + 1)}});
                    const call_args args = parse_arguments(fn.contains("arguments") ? fn["arguments"] : json(), i);
                    if (args.is_block) {
                        b.open("json", {{"type", "object"}});
                        b.text(args.raw);
                        b.close("json");
                    } else {
                        for (auto it = args.object.begin(); it != args.object.end(); ++it) {
                            b.open("argument", {{"key", it.key()}, {"type", arg_type(it.value())}});
                            b.text(it.value().is_string() ? it.value().get<std::string>()
                                                          : py_json_dumps(it.value(), false));
                            b.close("argument");
                        }
                    }
                    b.close("call");
                }
                b.close("tools");
            }
            b.close("message");
            b.special(k_eom);
        } else if (role == "tool") {
            ++tool_counter;
            std::string tname = str_field(m, "tool");
            if (tname.empty()) tname = name;
            if (tname.empty() && tool_counter <= last_calls.size()) {
                tname = str_field(function_of(last_calls[tool_counter - 1]), "name");
            }
            PG_CHECK(!tname.empty(), "chat: tool message {} has no tool name (no 'tool'/'name' field and no matching "
                                     "call in the previous assistant message)", i);
            b.open("message", {{"role", "tool"}, {"tool", tname}, {"index", std::to_string(tool_counter)}});
            content_segments(b, content, ctx, i);
            b.close("message");
            b.special(k_eom);
        } else {
            // Upstream skips unknown roles silently; we refuse (RELIABILITY K-09).
            PG_FAIL("chat: message {} has unsupported role '{}'", i, role);
        }
    }
    if (opt.tool_choice == "required") {
        b.message({{"role", "system"}, {"type", "tool-choice"}},
                  "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.");
    } else if (opt.tool_choice == "none") {
        b.message({{"role", "system"}, {"type", "tool-choice"}},
                  "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.");
    } else {
        PG_CHECK(opt.tool_choice.empty() || opt.tool_choice == "auto",
                 "chat: tool_choice '{}' cannot be expressed in a K3 prompt", opt.tool_choice);
    }
    if (opt.response_format.is_object()) {
        const std::string type = str_field(opt.response_format, "type");
        const std::string head = "The system is invoked with `response_format=" + type +
                                 "`.\nYour response must be raw JSON data without markdown code blocks (```json) or "
                                 "any additional formatting.";
        if (type == "json_object") {
            b.message({{"role", "system"}, {"type", "response-format"}}, head);
        } else if (type == "json_schema") {
            json schema = opt.response_format.contains("json_schema") ? opt.response_format["json_schema"] : json();
            if (schema.is_object() && schema.contains("schema")) schema = schema["schema"];
            else if (schema.is_object() && schema.contains("json_schema")) schema = schema["json_schema"];
            PG_CHECK(!schema.is_null(), "chat: response_format json_schema without a schema");
            b.message({{"role", "system"}, {"type", "response-format"}},
                      head + "\nThe JSON data must match the following schema:\n```json\n" +
                          py_json_dumps(deep_sorted(schema), true) + "\n```");
        } else {
            PG_CHECK(type == "text" || type.empty(), "chat: response_format type '{}' is not supported", type);
        }
    }
    if (opt.add_generation_prompt) {
        b.open("message", {{"role", "assistant"}});
        b.open(opt.thinking ? "think" : "response");
    }
    return b.segs;
}

std::string join_segments(const std::vector<segment> & segs) {
    std::string out;
    for (const auto & s : segs) out += s.text;
    return out;
}

} // namespace perigee::chat
