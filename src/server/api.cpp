// OpenAI request parsing and validation. See api.h for the documented rules.
#include "server/api.h"

#include "tokenizer/utf8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_set>

namespace perigee::server {

json api_error::to_json() const {
    return json{{"error", {{"message", message},
                           {"type", type},
                           {"param", param.empty() ? json(nullptr) : json(param)},
                           {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

void fail(std::string param, std::string message, int status, std::string code, std::string type) {
    api_error e;
    e.status = status;
    e.type = std::move(type);
    e.param = std::move(param);
    e.code = std::move(code);
    e.message = std::move(message);
    throw e;
}

namespace {

struct duplicate_key {
    std::string key;
};

// Nesting depth of the raw text (brackets outside strings); linear, no recursion.
int max_depth(const std::string & s) {
    int depth = 0, best = 0;
    bool in_str = false, esc = false;
    for (char c : s) {
        if (in_str) {
            if (esc) esc = false;
            else if (c == '\\') esc = true;
            else if (c == '"') in_str = false;
            continue;
        }
        if (c == '"') in_str = true;
        else if (c == '[' || c == '{') best = std::max(best, ++depth);
        else if (c == ']' || c == '}') --depth;
    }
    return best;
}

std::string type_name(const json & v) {
    if (v.is_null()) return "null";
    if (v.is_boolean()) return "boolean";
    if (v.is_number_integer()) return "integer";
    if (v.is_number()) return "number";
    if (v.is_string()) return "string";
    if (v.is_array()) return "array";
    return "object";
}

[[noreturn]] void wrong_type(const std::string & param, const char * want, const json & v) {
    fail(param, fmt::format("'{}' must be {}, got {}", param, want, type_name(v)));
}

bool get_bool(const json & j, const char * key, bool def) {
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_boolean()) wrong_type(key, "a boolean", j[key]);
    return j[key].get<bool>();
}

// A JSON integer in [lo, hi]; floats (even 10.0) and strings are refused.
int64_t get_int_v(const json & v, const std::string & param, int64_t lo, int64_t hi) {
    if (!v.is_number_integer()) wrong_type(param, "an integer", v);
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(param, fmt::format("'{}' is out of range [{}, {}]", param, lo, hi));
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) fail(param, fmt::format("'{}' = {} is out of range [{}, {}]", param, x, lo, hi));
    return x;
}

std::optional<int64_t> get_int(const json & j, const char * key, int64_t lo, int64_t hi) {
    if (!j.contains(key) || j[key].is_null()) return std::nullopt;
    return get_int_v(j[key], key, lo, hi);
}

std::optional<double> get_num(const json & j, const char * key, double lo, double hi, bool lo_open = false) {
    if (!j.contains(key) || j[key].is_null()) return std::nullopt;
    const json & v = j[key];
    if (!v.is_number()) wrong_type(key, "a number", v);
    const double x = v.get<double>();
    if (!std::isfinite(x) || x > hi || (lo_open ? x <= lo : x < lo))
        fail(key, fmt::format("'{}' = {} is out of range {}{}, {}]", key, x, lo_open ? "(" : "[", lo, hi));
    return x;
}

std::optional<std::string> get_str(const json & j, const char * key) {
    if (!j.contains(key) || j[key].is_null()) return std::nullopt;
    if (!j[key].is_string()) wrong_type(key, "a string", j[key]);
    return j[key].get<std::string>();
}

// Fields accepted and ignored by both endpoints.
const std::unordered_set<std::string> k_ignored = {
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity",
    "request_id", "cache_prompt", "skip_special_tokens", "parallel_tool_calls"};
// Fields that change semantics we do not implement: refused by name.
const std::unordered_set<std::string> k_refused = {
    "audio", "prediction", "prompt_embeds", "web_search_options", "functions", "function_call", "suffix",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
    "json_schema", "chat_template", "continue_final_message", "prompt_logprobs", "echo_prompt",
    "continuous_usage_stats", "mm_processor_kwargs", "return_tokens_as_token_ids", "documents",
    "repeat_penalty", "repeat_last_n", "n_probs", "best_of_n", "truncate_prompt_tokens", "use_beam_search",
    "length_penalty"};

void check_fields(const json & body, const std::unordered_set<std::string> & known) {
    for (auto it = body.begin(); it != body.end(); ++it) {
        const std::string & k = it.key();
        if (known.count(k) || k_ignored.count(k)) continue;
        if (k_refused.count(k)) fail(k, fmt::format("unsupported parameter '{}'", k), 400, "unsupported_parameter");
        fail(k, fmt::format("unknown parameter '{}'", k), 400, "unknown_parameter");
    }
    // value checks of the ignored fields that could hide a semantic request
    if (body.contains("parallel_tool_calls") && !body["parallel_tool_calls"].is_null() &&
        !body["parallel_tool_calls"].is_boolean())
        wrong_type("parallel_tool_calls", "a boolean", body["parallel_tool_calls"]);
}

void parse_common(const json & b, gen_request & r, const parse_limits & lim) {
    if (b.contains("model") && !b["model"].is_null()) {
        if (!b["model"].is_string()) wrong_type("model", "a string", b["model"]);
        r.model = b["model"].get<std::string>();
        if (!r.model.empty() && r.model != lim.served_model)
            fail("model", fmt::format("The model '{}' does not exist (this server serves '{}')", r.model, lim.served_model),
                 404, "model_not_found", "not_found_error");
    }
    if (r.model.empty()) r.model = lim.served_model;

    auto & sp = r.sp;
    if (auto v = get_num(b, "temperature", 0.0, 2.0)) sp.temperature = float(*v);
    if (auto v = get_num(b, "top_p", 0.0, 1.0, true)) sp.top_p = float(*v);
    if (auto v = get_int(b, "top_k", -1, std::numeric_limits<int32_t>::max())) sp.top_k = *v <= 0 ? 0 : int(*v);
    if (auto v = get_num(b, "min_p", 0.0, 1.0)) sp.min_p = float(*v);
    if (auto v = get_num(b, "presence_penalty", -2.0, 2.0)) sp.presence_penalty = float(*v);
    if (auto v = get_num(b, "frequency_penalty", -2.0, 2.0)) sp.frequency_penalty = float(*v);
    if (auto v = get_num(b, "repetition_penalty", 0.0, 10.0, true)) sp.repetition_penalty = float(*v);
    if (b.contains("seed") && !b["seed"].is_null()) {
        const json & v = b["seed"];
        if (!v.is_number_integer()) wrong_type("seed", "an integer", v);
        if (!v.is_number_unsigned() && v.get<int64_t>() < 0) fail("seed", "'seed' must be >= 0");
        sp.seed = v.get<uint64_t>();
    }
    if (auto v = get_int(b, "n", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max())) {
        if (*v < 1) fail("n", fmt::format("'n' = {} must be >= 1", *v));
        if (*v != 1) fail("n", "'n' > 1 is not supported yet (n must be 1)", 400, "unsupported_parameter");
    }
    if (auto v = get_int(b, "best_of", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max())) {
        if (*v != 1) fail("best_of", "'best_of' other than 1 is not supported", 400, "unsupported_parameter");
    }
    if (auto v = get_int(b, "min_tokens", 0, std::numeric_limits<int32_t>::max())) {
        if (*v > 0) fail("min_tokens", "'min_tokens' > 0 is not supported yet", 400, "unsupported_parameter");
    }
    if (b.contains("logit_bias") && !b["logit_bias"].is_null()) {
        if (!b["logit_bias"].is_object()) wrong_type("logit_bias", "an object", b["logit_bias"]);
        if (!b["logit_bias"].empty()) fail("logit_bias", "'logit_bias' is not supported yet", 400, "unsupported_parameter");
    }
    if (b.contains("priority") && !b["priority"].is_null()) {
        if (get_int_v(b["priority"], "priority", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()) != 0)
            fail("priority", "'priority' scheduling is not supported", 400, "unsupported_parameter");
    }
    if (b.contains("modalities") && !b["modalities"].is_null()) {
        const json & m = b["modalities"];
        if (!m.is_array()) wrong_type("modalities", "an array", m);
        for (const auto & x : m)
            if (!x.is_string() || x.get<std::string>() != "text")
                fail("modalities", "only the \"text\" modality is supported", 400, "unsupported_parameter");
    }

    // max tokens: max_completion_tokens wins
    const int64_t imax = std::numeric_limits<int32_t>::max() - 1;
    std::optional<int64_t> mt;
    if (auto v = get_int(b, "max_tokens", 1, imax)) mt = v;
    if (auto v = get_int(b, "max_completion_tokens", 1, imax)) mt = v;
    if (mt) {
        r.sp.max_tokens = int(*mt);
        r.max_tokens_set = true;
    }

    // stop strings
    if (b.contains("stop") && !b["stop"].is_null()) {
        const json & s = b["stop"];
        std::vector<std::string> stops;
        if (s.is_string()) stops.push_back(s.get<std::string>());
        else if (s.is_array()) {
            for (size_t i = 0; i < s.size(); ++i) {
                if (!s[i].is_string()) wrong_type(fmt::format("stop[{}]", i), "a string", s[i]);
                stops.push_back(s[i].get<std::string>());
            }
        } else {
            wrong_type("stop", "a string or an array of strings", s);
        }
        if (stops.size() > k_max_stop_strings)
            fail("stop", fmt::format("at most {} stop strings are allowed, got {}", k_max_stop_strings, stops.size()));
        for (size_t i = 0; i < stops.size(); ++i) {
            if (stops[i].empty()) fail("stop", fmt::format("stop string {} is empty", i));
            if (stops[i].size() > k_max_stop_bytes)
                fail("stop", fmt::format("stop string {} is {} bytes (limit {})", i, stops[i].size(), k_max_stop_bytes));
        }
        r.stop = std::move(stops);
    }
    if (b.contains("stop_token_ids") && !b["stop_token_ids"].is_null()) {
        const json & s = b["stop_token_ids"];
        if (!s.is_array()) wrong_type("stop_token_ids", "an array of integers", s);
        for (size_t i = 0; i < s.size(); ++i)
            r.stop_token_ids.push_back(int32_t(get_int_v(s[i], fmt::format("stop_token_ids[{}]", i), 0, lim.vocab_size - 1)));
    }
    r.ignore_eos = get_bool(b, "ignore_eos", false);
    r.include_stop_str_in_output = get_bool(b, "include_stop_str_in_output", false);
    if (b.contains("skip_special_tokens") && !b["skip_special_tokens"].is_null() && !b["skip_special_tokens"].is_boolean())
        wrong_type("skip_special_tokens", "a boolean", b["skip_special_tokens"]);

    r.stream = get_bool(b, "stream", false);
    if (b.contains("stream_options") && !b["stream_options"].is_null()) {
        const json & so = b["stream_options"];
        if (!so.is_object()) wrong_type("stream_options", "an object", so);
        if (!r.stream) fail("stream_options", "'stream_options' is only allowed with \"stream\": true");
        for (auto it = so.begin(); it != so.end(); ++it) {
            if (it.key() == "include_usage") {
                if (!it.value().is_boolean()) wrong_type("stream_options.include_usage", "a boolean", it.value());
                r.include_usage = it.value().get<bool>();
            } else if (it.key() == "include_obfuscation") {
                if (!it.value().is_boolean()) wrong_type("stream_options.include_obfuscation", "a boolean", it.value());
            } else {
                fail("stream_options." + it.key(), fmt::format("unsupported parameter 'stream_options.{}'", it.key()),
                     400, "unsupported_parameter");
            }
        }
    }
}

bool valid_tool_name(const std::string & n) {
    if (n.empty() || n.size() > k_max_tool_name) return false;
    for (unsigned char c : n)
        if (!(std::isalnum(c) || c == '_' || c == '-' || c == '.')) return false;
    return true;
}

std::string message_text(const json & content, const std::string & param) {
    if (content.is_string()) return content.get<std::string>();
    if (content.is_null()) return {};
    if (!content.is_array()) wrong_type(param, "a string, an array of content parts or null", content);
    std::string out;
    for (size_t j = 0; j < content.size(); ++j) {
        const json & part = content[j];
        const std::string pp = fmt::format("{}[{}]", param, j);
        if (!part.is_object()) wrong_type(pp, "an object", part);
        if (!part.contains("type") || !part["type"].is_string()) fail(pp + ".type", "content part needs a string 'type'");
        const std::string t = part["type"].get<std::string>();
        if (t != "text")
            fail(pp + ".type", fmt::format("content part type '{}' is not supported (this model is text-only)", t), 400,
                 "unsupported_content");
        if (part.contains("text") && !part["text"].is_null()) {
            if (!part["text"].is_string()) wrong_type(pp + ".text", "a string", part["text"]);
            out += part["text"].get<std::string>();
        }
    }
    return out;
}

json normalise_messages(const json & msgs) {
    if (!msgs.is_array()) wrong_type("messages", "an array", msgs);
    if (msgs.empty()) fail("messages", "'messages' must not be empty");
    static const std::set<std::string> roles = {"system", "developer", "user", "assistant", "tool"};
    static const std::set<std::string> keys = {"role", "content", "name", "tool_calls", "tool_call_id",
                                               "reasoning_content", "reasoning", "refusal"};
    json out = json::array();
    std::set<std::string> call_ids;
    std::string prev_role;
    for (size_t i = 0; i < msgs.size(); ++i) {
        const json & m = msgs[i];
        const std::string p = fmt::format("messages[{}]", i);
        if (!m.is_object()) wrong_type(p, "an object", m);
        for (auto it = m.begin(); it != m.end(); ++it)
            if (!keys.count(it.key()) && !it.value().is_null())
                fail(p + "." + it.key(), fmt::format("unknown message field '{}'", it.key()));
        if (!m.contains("role")) fail(p + ".role", "message has no 'role'");
        if (!m["role"].is_string()) wrong_type(p + ".role", "a string", m["role"]);
        std::string role = m["role"].get<std::string>();
        if (!roles.count(role))
            fail(p + ".role", fmt::format("unknown role '{}' (system, developer, user, assistant, tool)", role));
        if (role == "developer") role = "system";
        json n = {{"role", role}};
        const bool has_content = m.contains("content") && !m["content"].is_null();
        if (!has_content && role != "assistant") fail(p + ".content", "message has no 'content'");
        n["content"] = has_content ? json(message_text(m["content"], p + ".content")) : json(nullptr);
        if (m.contains("name") && !m["name"].is_null()) {
            if (!m["name"].is_string()) wrong_type(p + ".name", "a string", m["name"]);
            n["name"] = m["name"];
        }
        if (role == "assistant") {
            if (prev_role == "assistant") fail(p, "two consecutive assistant messages");
            for (const char * k : {"reasoning_content", "reasoning"}) {
                if (m.contains(k) && !m[k].is_null()) {
                    if (!m[k].is_string()) wrong_type(p + "." + k, "a string", m[k]);
                    n["reasoning_content"] = m[k];
                }
            }
            if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
                const json & tc = m["tool_calls"];
                if (!tc.is_array()) wrong_type(p + ".tool_calls", "an array", tc);
                json calls = json::array();
                for (size_t c = 0; c < tc.size(); ++c) {
                    const std::string cp = fmt::format("{}.tool_calls[{}]", p, c);
                    const json & call = tc[c];
                    if (!call.is_object()) wrong_type(cp, "an object", call);
                    if (!call.contains("id") || !call["id"].is_string()) fail(cp + ".id", "tool call needs a string 'id'");
                    if (call.contains("type") && call["type"] != "function")
                        fail(cp + ".type", "tool call type must be \"function\"");
                    if (!call.contains("function") || !call["function"].is_object())
                        fail(cp + ".function", "tool call needs a 'function' object");
                    const json & fn = call["function"];
                    if (!fn.contains("name") || !fn["name"].is_string()) fail(cp + ".function.name", "tool call needs a string name");
                    if (!fn.contains("arguments") || !fn["arguments"].is_string())
                        fail(cp + ".function.arguments", "tool call arguments must be a JSON string");
                    try {
                        const json a = json::parse(fn["arguments"].get<std::string>());
                        if (!a.is_object()) fail(cp + ".function.arguments", "tool call arguments must encode a JSON object");
                    } catch (const json::exception &) {
                        fail(cp + ".function.arguments", "tool call arguments are not valid JSON");
                    }
                    call_ids.insert(call["id"].get<std::string>());
                    calls.push_back({{"id", call["id"]}, {"type", "function"},
                                     {"function", {{"name", fn["name"]}, {"arguments", fn["arguments"]}}}});
                }
                if (!calls.empty()) n["tool_calls"] = calls;
            }
            if (!has_content && !n.contains("tool_calls")) n["content"] = "";
        } else if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
            fail(p + ".tool_calls", "only assistant messages carry tool_calls");
        }
        if (role == "tool") {
            if (!m.contains("tool_call_id") || !m["tool_call_id"].is_string())
                fail(p + ".tool_call_id", "tool message needs a string 'tool_call_id'");
            const std::string id = m["tool_call_id"].get<std::string>();
            if (!call_ids.count(id))
                fail(p + ".tool_call_id", fmt::format("tool_call_id '{}' matches no earlier assistant tool call", id));
            n["tool_call_id"] = id;
        }
        prev_role = role;
        out.push_back(std::move(n));
    }
    if (prev_role == "assistant")
        fail(fmt::format("messages[{}]", msgs.size() - 1),
             "the last message is from the assistant; continuing an assistant message (prefill) is not supported");
    return out;
}

json parse_tools(const json & t) {
    if (!t.is_array()) wrong_type("tools", "an array", t);
    if (t.size() > k_max_tools) fail("tools", fmt::format("at most {} tools are allowed, got {}", k_max_tools, t.size()));
    std::set<std::string> names;
    json out = json::array();
    for (size_t i = 0; i < t.size(); ++i) {
        const std::string p = fmt::format("tools[{}]", i);
        const json & tool = t[i];
        if (!tool.is_object()) wrong_type(p, "an object", tool);
        if (!tool.contains("type") || tool["type"] != "function") fail(p + ".type", "tool type must be \"function\"");
        if (!tool.contains("function") || !tool["function"].is_object()) fail(p + ".function", "tool needs a 'function' object");
        const json & fn = tool["function"];
        if (!fn.contains("name") || !fn["name"].is_string()) fail(p + ".function.name", "tool function needs a string 'name'");
        const std::string name = fn["name"].get<std::string>();
        if (!valid_tool_name(name))
            fail(p + ".function.name", fmt::format("tool name must be 1-{} characters of [A-Za-z0-9_.-]", k_max_tool_name));
        if (!names.insert(name).second) fail(p + ".function.name", fmt::format("duplicate tool name '{}'", name));
        if (fn.contains("description") && !fn["description"].is_null() && !fn["description"].is_string())
            wrong_type(p + ".function.description", "a string", fn["description"]);
        if (fn.contains("parameters") && !fn["parameters"].is_null()) {
            const json & ps = fn["parameters"];
            if (!ps.is_object()) wrong_type(p + ".function.parameters", "an object (a JSON Schema)", ps);
            if (ps.contains("type") && !ps["type"].is_string() && !ps["type"].is_array())
                fail(p + ".function.parameters.type", "schema 'type' must be a string or an array");
        }
        if (fn.contains("strict") && !fn["strict"].is_null() && !fn["strict"].is_boolean())
            wrong_type(p + ".function.strict", "a boolean", fn["strict"]);
        out.push_back(tool);
    }
    return out;
}

} // namespace

json parse_body(const std::string & body) {
    if (body.empty()) fail("", "the request body is empty (a JSON object is required)");
    // JSON text is UTF-8 without NUL bytes; the JSON parser would stop at a NUL and silently ignore
    // what follows (found by fuzz_server_request), so both are refused before parsing.
    if (const size_t nul = body.find('\0'); nul != std::string::npos)
        fail("", fmt::format("the request body contains a NUL byte at offset {}", nul));
    if (size_t bad = 0; !tok::utf8_valid(body, &bad))
        fail("", fmt::format("the request body is not valid UTF-8 (at byte offset {})", bad));
    if (max_depth(body) > k_max_json_depth)
        fail("", fmt::format("JSON nesting is deeper than {} levels", k_max_json_depth));
    std::vector<std::set<std::string>> keys;
    json j;
    try {
        j = json::parse(body, [&](int depth, json::parse_event_t ev, json & parsed) {
            const size_t d = size_t(std::max(depth, 0));
            if (ev == json::parse_event_t::object_start) {
                if (keys.size() <= d + 1) keys.resize(d + 2);
                keys[d + 1].clear();
            } else if (ev == json::parse_event_t::key) {
                if (keys.size() <= d) keys.resize(d + 1);
                if (!keys[d].insert(parsed.get<std::string>()).second) throw duplicate_key{parsed.get<std::string>()};
            }
            return true;
        });
    } catch (const duplicate_key & k) {
        fail(k.key, fmt::format("duplicate key '{}' in the JSON body", k.key));
    } catch (const json::exception & e) {
        fail("", fmt::format("malformed JSON: {}", e.what()));
    }
    if (!j.is_object()) fail("", fmt::format("the request body must be a JSON object, got {}", type_name(j)));
    return j;
}

gen_request parse_chat_request(const json & b, const parse_limits & lim) {
    static const std::unordered_set<std::string> known = {
        "model", "messages", "tools", "tool_choice", "response_format", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "max_completion_tokens", "stop",
        "seed", "n", "logprobs", "top_logprobs", "stream", "stream_options", "chat_template_kwargs", "reasoning_effort",
        "thinking", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "min_tokens", "logit_bias",
        "add_generation_prompt", "priority", "modalities", "best_of"};
    check_fields(b, known);
    gen_request r;
    r.kind = endpoint::chat;
    parse_common(b, r, lim);
    if (!b.contains("messages")) fail("messages", "'messages' is required");
    r.messages = normalise_messages(b["messages"]);
    if (b.contains("tools") && !b["tools"].is_null()) r.tools = parse_tools(b["tools"]);
    const bool have_tools = r.tools.is_array() && !r.tools.empty();
    if (b.contains("tool_choice") && !b["tool_choice"].is_null()) {
        const json & tc = b["tool_choice"];
        if (tc.is_string()) {
            const std::string s = tc.get<std::string>();
            if (s != "auto" && s != "none" && s != "required")
                fail("tool_choice", fmt::format("tool_choice '{}' is not one of none, auto, required", s));
            if (s == "required" && !have_tools) fail("tool_choice", "tool_choice \"required\" needs 'tools'");
            r.tool_choice = s;
        } else if (tc.is_object()) {
            if (!tc.contains("type") || tc["type"] != "function")
                fail("tool_choice.type", "named tool_choice needs \"type\": \"function\"");
            if (!tc.contains("function") || !tc["function"].is_object() || !tc["function"].contains("name") ||
                !tc["function"]["name"].is_string())
                fail("tool_choice.function.name", "named tool_choice needs function.name");
            const std::string name = tc["function"]["name"].get<std::string>();
            if (!have_tools) fail("tool_choice", "a named tool_choice needs 'tools'");
            json only = json::array();
            for (const auto & t : r.tools)
                if (t["function"]["name"] == name) only.push_back(t);
            if (only.empty()) fail("tool_choice.function.name", fmt::format("tool_choice names unknown tool '{}'", name));
            r.tools = only;
            r.tool_choice = "required";
        } else {
            wrong_type("tool_choice", "a string or an object", tc);
        }
    }
    if (!have_tools && r.tool_choice == "none") r.tool_choice.clear();
    if (b.contains("response_format") && !b["response_format"].is_null()) {
        const json & rf = b["response_format"];
        if (!rf.is_object()) wrong_type("response_format", "an object", rf);
        if (!rf.contains("type") || !rf["type"].is_string()) fail("response_format.type", "response_format needs a string 'type'");
        const std::string t = rf["type"].get<std::string>();
        if (t == "json_schema") {
            if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
                fail("response_format.json_schema", "response_format json_schema needs a 'json_schema' object");
            const json & js = rf["json_schema"];
            if (!js.contains("schema") || !js["schema"].is_object())
                fail("response_format.json_schema.schema", "json_schema needs a 'schema' object");
            r.response_format = rf;
        } else if (t == "json_object") {
            r.response_format = rf;
        } else if (t != "text") {
            fail("response_format.type", fmt::format("response_format type '{}' is not one of text, json_object, json_schema", t));
        }
    }
    // logprobs
    r.logprobs = get_bool(b, "logprobs", false);
    if (auto v = get_int(b, "top_logprobs", 0, 20)) {
        if (!r.logprobs) fail("top_logprobs", "'top_logprobs' requires \"logprobs\": true");
        r.top_logprobs = int(*v);
    }
    r.sp.logprobs = r.logprobs ? r.top_logprobs : -1;
    // thinking controls
    if (b.contains("add_generation_prompt") && !b["add_generation_prompt"].is_null()) {
        if (!get_bool(b, "add_generation_prompt", true))
            fail("add_generation_prompt", "'add_generation_prompt': false is not supported", 400, "unsupported_parameter");
    }
    if (auto e = get_str(b, "reasoning_effort")) {
        const std::string s = *e;
        if (s == "none") r.thinking = false;
        else if (s == "minimal" || s == "low") r.thinking_effort = "low";
        else if (s == "medium" || s == "high") r.thinking_effort = "high";
        else if (s == "xhigh" || s == "max") r.thinking_effort = "max";
        else fail("reasoning_effort", fmt::format("reasoning_effort '{}' is not one of none, minimal, low, medium, high, xhigh, max", s));
        if (s != "none") r.thinking_effort_set = true;
    }
    if (b.contains("thinking") && !b["thinking"].is_null()) {
        const json & t = b["thinking"];
        if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
            fail("thinking", "'thinking' must be {\"type\": \"enabled\" | \"disabled\"}");
        const std::string s = t["type"].get<std::string>();
        if (s != "enabled" && s != "disabled") fail("thinking.type", "'thinking.type' must be \"enabled\" or \"disabled\"");
        r.thinking = s == "enabled";
    }
    if (b.contains("chat_template_kwargs") && !b["chat_template_kwargs"].is_null()) {
        const json & k = b["chat_template_kwargs"];
        if (!k.is_object()) wrong_type("chat_template_kwargs", "an object", k);
        for (auto it = k.begin(); it != k.end(); ++it) {
            const std::string p = "chat_template_kwargs." + it.key();
            if (it.key() == "thinking" || it.key() == "enable_thinking") {
                if (!it.value().is_boolean()) wrong_type(p, "a boolean", it.value());
                r.thinking = it.value().get<bool>();
            } else if (it.key() == "thinking_effort") {
                if (it.value().is_null()) {
                    r.thinking_effort.reset();
                } else {
                    if (!it.value().is_string()) wrong_type(p, "a string or null", it.value());
                    const std::string s = it.value().get<std::string>();
                    if (s != "low" && s != "high" && s != "max") fail(p, "thinking_effort must be low, high, max or null");
                    r.thinking_effort = s;
                }
                r.thinking_effort_set = true;
            } else {
                fail(p, fmt::format("chat_template_kwargs '{}' is not allowed (thinking, thinking_effort)", it.key()), 400,
                     "unsupported_parameter");
            }
        }
    }
    return r;
}

gen_request parse_completion_request(const json & b, const parse_limits & lim) {
    static const std::unordered_set<std::string> known = {
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop", "seed", "n", "best_of", "logprobs", "echo", "stream",
        "stream_options", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "min_tokens", "logit_bias",
        "priority"};
    check_fields(b, known);
    gen_request r;
    r.kind = endpoint::completion;
    r.sp.max_tokens = 16;
    parse_common(b, r, lim);
    if (!b.contains("prompt") || b["prompt"].is_null()) fail("prompt", "'prompt' is required");
    const json & p = b["prompt"];
    auto ids_of = [&](const json & a, const std::string & param) {
        std::vector<int32_t> ids;
        if (a.empty()) fail(param, "the token prompt is empty");
        for (size_t i = 0; i < a.size(); ++i)
            ids.push_back(int32_t(get_int_v(a[i], fmt::format("{}[{}]", param, i), 0, lim.vocab_size - 1)));
        return ids;
    };
    if (p.is_string()) {
        r.prompt_text = p.get<std::string>();
    } else if (p.is_array()) {
        if (p.empty()) fail("prompt", "'prompt' is an empty array");
        if (p[0].is_string() || p[0].is_array()) {
            if (p.size() > 1) fail("prompt", fmt::format("{} prompts given; one prompt per request is supported", p.size()),
                                   400, "unsupported_parameter");
            if (p[0].is_string()) r.prompt_text = p[0].get<std::string>();
            else r.prompt_ids = ids_of(p[0], "prompt[0]");
        } else {
            r.prompt_ids = ids_of(p, "prompt");
        }
    } else {
        wrong_type("prompt", "a string, an array of strings or an array of token ids", p);
    }
    if (r.prompt_text && r.prompt_text->empty()) fail("prompt", "'prompt' is empty");
    r.echo = get_bool(b, "echo", false);
    if (auto v = get_int(b, "logprobs", 0, 5)) {
        r.logprobs = true;
        r.top_logprobs = int(*v);
    }
    r.sp.logprobs = r.logprobs ? r.top_logprobs : -1;
    return r;
}

tokenize_request parse_tokenize_request(const json & b, const parse_limits & lim) {
    tokenize_request t;
    static const std::unordered_set<std::string> known = {"model", "prompt", "messages", "add_special_tokens",
                                                          "return_token_strs", "add_generation_prompt", "tools",
                                                          "chat_template_kwargs"};
    for (auto it = b.begin(); it != b.end(); ++it)
        if (!known.count(it.key())) fail(it.key(), fmt::format("unknown parameter '{}'", it.key()));
    if (b.contains("model") && b["model"].is_string() && !b["model"].get<std::string>().empty() &&
        b["model"].get<std::string>() != lim.served_model)
        fail("model", fmt::format("The model '{}' does not exist", b["model"].get<std::string>()), 404, "model_not_found",
             "not_found_error");
    t.return_token_strs = get_bool(b, "return_token_strs", false);
    get_bool(b, "add_special_tokens", false);
    if (b.contains("messages")) {
        json c = b;
        c.erase("return_token_strs");
        c.erase("add_special_tokens");
        // a tokenize request may end with an assistant message? no: same rules as chat
        t.chat = parse_chat_request(c, lim);
        t.has_messages = true;
    } else {
        auto p = get_str(b, "prompt");
        if (!p) fail("prompt", "'prompt' (a string) or 'messages' is required");
        t.prompt = *p;
    }
    return t;
}

std::vector<int32_t> parse_detokenize_request(const json & b, const parse_limits & lim) {
    for (auto it = b.begin(); it != b.end(); ++it)
        if (it.key() != "model" && it.key() != "tokens") fail(it.key(), fmt::format("unknown parameter '{}'", it.key()));
    if (!b.contains("tokens") || !b["tokens"].is_array()) fail("tokens", "'tokens' must be an array of token ids");
    std::vector<int32_t> ids;
    const json & a = b["tokens"];
    for (size_t i = 0; i < a.size(); ++i)
        ids.push_back(int32_t(get_int_v(a[i], fmt::format("tokens[{}]", i), 0, lim.vocab_size - 1)));
    return ids;
}

bool constant_time_equal(const std::string & a, const std::string & b) {
    const size_t n = std::max(a.size(), b.size());
    volatile unsigned char diff = static_cast<unsigned char>(a.size() != b.size());
    for (size_t i = 0; i < n; ++i) {
        const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
        const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
        diff = static_cast<unsigned char>(diff | (x ^ y));
    }
    return diff == 0;
}

} // namespace perigee::server
