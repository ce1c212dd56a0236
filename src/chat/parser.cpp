#include "chat/parser.h"

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace perigee::chat {

// ---------------------------------------------------------------------------------------------
// generic marker-driven engine

chat_delta output_parser::feed(std::string_view bytes) {
    chat_delta d;
    pending_.append(bytes);
    run(d, false);
    return d;
}

chat_delta output_parser::finish() {
    chat_delta d;
    run(d, true);
    on_finish(d);
    // a code point still cut at the very end becomes U+FFFD (never a partial sequence)
    if (!utf8_hold_.empty()) {
        const std::string rest = tok::utf8_replace_invalid(utf8_hold_);
        utf8_hold_.clear();
        emit(rest, d);
    }
    if (!stray_.empty()) {
        if (!py_is_blank(stray_)) warn("text outside any channel: " + stray_.substr(0, 200));
        stray_.clear();
    }
    return d;
}

void output_parser::run(chat_delta & d, bool at_end) {
    while (!pending_.empty()) {
        const auto & ms = markers();
        size_t best = std::string::npos, best_len = 0;
        int best_id = -1;
        for (const auto & m : ms) {
            const size_t at = pending_.find(m.text);
            if (at != std::string::npos && (at < best || (at == best && m.text.size() > best_len))) {
                best = at;
                best_len = m.text.size();
                best_id = m.id;
            }
        }
        if (best != std::string::npos) {
            flush_text(std::string_view(pending_).substr(0, best), d, true);
            pending_.erase(0, best + best_len);
            on_marker(best_id, d);
            continue;
        }
        // hold back the longest suffix that is a proper prefix of a marker
        size_t keep = 0;
        if (!at_end) {
            for (const auto & m : ms) {
                const size_t max_k = std::min(m.text.size() - 1, pending_.size());
                for (size_t k = max_k; k > keep; --k) {
                    if (pending_.compare(pending_.size() - k, k, m.text, 0, k) == 0) {
                        keep = k;
                        break;
                    }
                }
            }
        }
        flush_text(std::string_view(pending_).substr(0, pending_.size() - keep), d, at_end);
        pending_.erase(0, pending_.size() - keep);
        break;
    }
}

void output_parser::flush_text(std::string_view text, chat_delta & d, bool complete) {
    // A held cut-off tail is flushed when a marker follows it (complete), even with no new text, so that it lands
    // in the same channel as in the one-shot parse (found by tests/fuzz/fuzz_k{2,3}_parser on ill-formed input).
    if (text.empty() && (!complete || utf8_hold_.empty())) return;
    std::string t = utf8_hold_;
    utf8_hold_.clear();
    t.append(text);
    if (!complete) {
        const size_t n = tok::utf8_complete_prefix(t);
        utf8_hold_ = t.substr(n);
        t.resize(n);
    }
    emit(t, d);
}

void output_parser::emit(std::string_view text, chat_delta & d) {
    if (text.empty()) return;
    switch (current_sink()) {
        case SINK_REASONING:
            msg_.reasoning_content.append(text);
            d.reasoning_content.append(text);
            break;
        case SINK_CONTENT:
            msg_.content.append(text);
            d.content.append(text);
            break;
        case SINK_BUFFER: buffer_.append(text); break;
        case SINK_STRAY: stray_.append(text); break;
    }
}

void output_parser::add_call(tool_call c, chat_delta & d) {
    msg_.tool_calls.push_back(c);
    d.tool_calls.push_back(std::move(c));
}

chat_message parse_output(output_parser & p, std::string_view text) {
    p.feed(text);
    p.finish();
    return p.message();
}

namespace {

std::string trim(std::string_view s) {
    const char * ws = " \t\r\n";
    const size_t a = s.find_first_not_of(ws);
    if (a == std::string_view::npos) return "";
    const size_t b = s.find_last_not_of(ws);
    return std::string(s.substr(a, b - a + 1));
}

// ---------------------------------------------------------------------------------------------
// K3 (TOKENIZER §8.3)

enum k3_marker {
    K3_THINK_OPEN, K3_THINK_CLOSE, K3_RESP_OPEN, K3_RESP_CLOSE, K3_TOOLS_OPEN, K3_TOOLS_CLOSE,
    K3_MSG_CLOSE, K3_CALL_OPEN, K3_CALL_CLOSE, K3_EOM,
};

class k3_parser final : public output_parser {
public:
    explicit k3_parser(bool think) : state_(think ? THINK : CONTENT) {}

private:
    enum state { THINK, BETWEEN, CONTENT, AFTER, TOOLS, CALL, DONE };
    static const marker & m(k3_marker id) {
        static const std::vector<marker> all = {
            {"<|open|>think<|sep|>", K3_THINK_OPEN},     {"<|close|>think<|sep|>", K3_THINK_CLOSE},
            {"<|open|>response<|sep|>", K3_RESP_OPEN},   {"<|close|>response<|sep|>", K3_RESP_CLOSE},
            {"<|open|>tools<|sep|>", K3_TOOLS_OPEN},     {"<|close|>tools<|sep|>", K3_TOOLS_CLOSE},
            {"<|close|>message<|sep|>", K3_MSG_CLOSE},   {"<|open|>call", K3_CALL_OPEN},
            {"<|close|>call<|sep|>", K3_CALL_CLOSE},     {"<|end_of_msg|>", K3_EOM},
        };
        return all[id];
    }
    static std::vector<marker> set(std::initializer_list<k3_marker> ids) {
        std::vector<marker> v;
        for (auto id : ids) v.push_back(m(id));
        return v;
    }
    const std::vector<marker> & markers() const override {
        static const std::vector<marker> think = set({K3_THINK_OPEN, K3_THINK_CLOSE, K3_RESP_OPEN, K3_TOOLS_OPEN, K3_MSG_CLOSE, K3_EOM});
        static const std::vector<marker> between = set({K3_THINK_OPEN, K3_RESP_OPEN, K3_TOOLS_OPEN, K3_MSG_CLOSE, K3_EOM});
        static const std::vector<marker> content = set({K3_RESP_CLOSE, K3_TOOLS_OPEN, K3_MSG_CLOSE, K3_EOM});
        static const std::vector<marker> after = set({K3_THINK_OPEN, K3_RESP_OPEN, K3_TOOLS_OPEN, K3_MSG_CLOSE, K3_EOM});
        static const std::vector<marker> tools = set({K3_CALL_OPEN, K3_TOOLS_CLOSE, K3_MSG_CLOSE, K3_EOM});
        static const std::vector<marker> call = set({K3_CALL_OPEN, K3_CALL_CLOSE, K3_TOOLS_CLOSE, K3_MSG_CLOSE, K3_EOM});
        // After `<|close|>message<|sep|>` the turn's terminator `<|end_of_msg|>` still follows; it is
        // consumed silently (anything else after the message is stray text and warned about).
        static const std::vector<marker> done = set({K3_EOM});
        static const std::vector<marker> none;
        switch (state_) {
            case THINK: return think;
            case BETWEEN: return between;
            case CONTENT: return content;
            case AFTER: return after;
            case TOOLS: return tools;
            case CALL: return call;
            case DONE: return done;
        }
        return none;
    }
    sink current_sink() const override {
        switch (state_) {
            case THINK: return SINK_REASONING;
            case CONTENT: return SINK_CONTENT;
            case CALL: return SINK_BUFFER;
            default: return SINK_STRAY;
        }
    }
    void end_message() {
        state_ = DONE;
        done_ = true;
    }
    void drop_call(const char * why) {
        warn(std::string("dropped an incomplete tool call (") + why + "): " + buffer_.substr(0, 200));
        buffer_.clear();
    }
    void on_marker(int id, chat_delta & d) override {
        switch (state_) {
            case THINK:
                if (id == K3_THINK_CLOSE) state_ = BETWEEN;
                else if (id == K3_RESP_OPEN) state_ = CONTENT;  // model skipped the think close
                else if (id == K3_TOOLS_OPEN) state_ = TOOLS;
                else if (id == K3_MSG_CLOSE || id == K3_EOM) end_message();
                // K3_THINK_OPEN re-emitted inside thinking: ignored
                break;
            case BETWEEN:
            case AFTER:
                if (id == K3_THINK_OPEN) state_ = THINK;
                else if (id == K3_RESP_OPEN) state_ = CONTENT;
                else if (id == K3_TOOLS_OPEN) state_ = TOOLS;
                else end_message();
                break;
            case CONTENT:
                if (id == K3_RESP_CLOSE) state_ = AFTER;
                else if (id == K3_TOOLS_OPEN) state_ = TOOLS;
                else end_message();
                break;
            case TOOLS:
                if (id == K3_CALL_OPEN) { buffer_.clear(); state_ = CALL; }
                else if (id == K3_TOOLS_CLOSE) state_ = AFTER;
                else end_message();
                break;
            case CALL:
                if (id == K3_CALL_CLOSE) {
                    finish_call(d);
                    state_ = TOOLS;
                } else if (id == K3_CALL_OPEN) {
                    drop_call("a new call opened before it closed");
                } else {
                    drop_call("tools or message closed first");
                    if (id == K3_TOOLS_CLOSE) state_ = AFTER;
                    else end_message();
                }
                break;
            case DONE: break;
        }
    }
    void on_finish(chat_delta &) override {
        if (state_ == CALL) drop_call("output ended");
    }

    // attrs: ` tool="NAME" index="1"` -> map (unescape &quot; then &amp;)
    static std::vector<std::pair<std::string, std::string>> parse_attrs(std::string_view s) {
        std::vector<std::pair<std::string, std::string>> out;
        size_t i = 0;
        while (i < s.size()) {
            while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n')) ++i;
            size_t k = i;
            while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
            if (k == i || k + 1 >= s.size() || s[k] != '=' || s[k + 1] != '"') break;
            const size_t vend = s.find('"', k + 2);
            if (vend == std::string_view::npos) break;
            std::string v(s.substr(k + 2, vend - (k + 2)));
            for (const auto & [from, to] : {std::pair<std::string, std::string>{"&quot;", "\""}, {"&amp;", "&"}}) {
                size_t p = 0;
                while ((p = v.find(from, p)) != std::string::npos) {
                    v.replace(p, from.size(), to);
                    p += to.size();
                }
            }
            out.emplace_back(std::string(s.substr(i, k - i)), std::move(v));
            i = vend + 1;
        }
        return out;
    }
    static std::string attr(const std::vector<std::pair<std::string, std::string>> & a, const char * key) {
        for (const auto & [k, v] : a) {
            if (k == key) return v;
        }
        return "";
    }

    void finish_call(chat_delta & d) {
        const std::string body = std::move(buffer_);
        buffer_.clear();
        const std::string sep = "<|sep|>";
        const size_t hs = body.find(sep);
        if (hs == std::string::npos) {
            warn("tool call without <|sep|> after its attributes: " + body.substr(0, 200));
            return;
        }
        const auto head = parse_attrs(std::string_view(body).substr(0, hs));
        const std::string name = attr(head, "tool");
        if (name.empty()) {
            warn("tool call without a tool attribute dropped: " + body.substr(0, 200));
            return;
        }
        json args = json::object();
        std::string raw_block;
        bool have_block = false;
        size_t pos = hs + sep.size();
        const std::string arg_open = "<|open|>argument", arg_close = "<|close|>argument<|sep|>";
        const std::string json_open = "<|open|>json", json_close = "<|close|>json<|sep|>";
        while (pos < body.size()) {
            const bool is_arg = body.compare(pos, arg_open.size(), arg_open) == 0;
            const bool is_json = body.compare(pos, json_open.size(), json_open) == 0;
            if (!is_arg && !is_json) {
                const std::string rest = body.substr(pos);
                if (!py_is_blank(rest)) warn("unexpected text inside tool call '" + name + "': " + rest.substr(0, 200));
                break;
            }
            const size_t a0 = pos + (is_arg ? arg_open.size() : json_open.size());
            const size_t s = body.find(sep, a0);
            const std::string & close = is_arg ? arg_close : json_close;
            const size_t e = s == std::string::npos ? std::string::npos : body.find(close, s + sep.size());
            if (e == std::string::npos) {
                warn("unterminated argument in tool call '" + name + "'");
                break;
            }
            const std::string value = body.substr(s + sep.size(), e - (s + sep.size()));
            if (is_arg) {
                const auto a = parse_attrs(std::string_view(body).substr(a0, s - a0));
                const std::string key = attr(a, "key"), type = attr(a, "type");
                if (type == "string") {
                    args[key] = value;
                } else {
                    json v = json::parse(value, nullptr, false);
                    if (v.is_discarded()) {
                        warn("argument '" + key + "' of '" + name + "' is not valid JSON for type '" + type +
                             "'; kept as a string");
                        args[key] = value;
                    } else {
                        args[key] = std::move(v);
                    }
                }
            } else {
                raw_block += value;
                have_block = true;
            }
            pos = e + close.size();
        }
        tool_call c;
        c.id = "call_" + std::to_string(msg_.tool_calls.size());
        c.name = name;
        c.arguments = have_block && args.empty() ? raw_block : py_json_dumps(args, false);
        add_call(std::move(c), d);
    }

    state state_;
};

// ---------------------------------------------------------------------------------------------
// K2 family (TOKENIZER §8.1, §8.2)

enum k2_marker { K2_THINK_OPEN, K2_THINK_CLOSE, K2_SEC_BEGIN, K2_SEC_END, K2_CALL_BEGIN, K2_ARG_BEGIN, K2_CALL_END, K2_IM_END };

class k2_parser final : public output_parser {
public:
    explicit k2_parser(bool think) : state_(think ? THINK : CONTENT) {}

private:
    enum state { THINK, CONTENT, SECTION, CALL_ID, CALL_ARGS, DONE };
    static std::vector<marker> set(std::initializer_list<k2_marker> ids) {
        static const std::vector<marker> all = {
            {"<think>", K2_THINK_OPEN}, {"</think>", K2_THINK_CLOSE},
            {"<|tool_calls_section_begin|>", K2_SEC_BEGIN}, {"<|tool_calls_section_end|>", K2_SEC_END},
            {"<|tool_call_begin|>", K2_CALL_BEGIN}, {"<|tool_call_argument_begin|>", K2_ARG_BEGIN},
            {"<|tool_call_end|>", K2_CALL_END}, {"<|im_end|>", K2_IM_END},
        };
        std::vector<marker> v;
        for (auto id : ids) v.push_back(all[id]);
        return v;
    }
    const std::vector<marker> & markers() const override {
        static const auto think = set({K2_THINK_CLOSE, K2_SEC_BEGIN, K2_CALL_BEGIN, K2_IM_END});
        static const auto content = set({K2_THINK_OPEN, K2_SEC_BEGIN, K2_CALL_BEGIN, K2_IM_END});
        static const auto section = set({K2_CALL_BEGIN, K2_SEC_END, K2_IM_END});
        static const auto call_id = set({K2_ARG_BEGIN, K2_CALL_END, K2_CALL_BEGIN, K2_SEC_END, K2_IM_END});
        static const auto call_args = set({K2_CALL_END, K2_CALL_BEGIN, K2_SEC_END, K2_IM_END});
        static const std::vector<marker> none;
        switch (state_) {
            case THINK: return think;
            case CONTENT: return content;
            case SECTION: return section;
            case CALL_ID: return call_id;
            case CALL_ARGS: return call_args;
            case DONE: return none;
        }
        return none;
    }
    sink current_sink() const override {
        switch (state_) {
            case THINK: return SINK_REASONING;
            case CONTENT: return SINK_CONTENT;
            case CALL_ID: case CALL_ARGS: return SINK_BUFFER;
            default: return SINK_STRAY;
        }
    }
    void drop(const char * why) {
        warn(std::string("dropped an incomplete tool call (") + why + "): " + (id_ + buffer_).substr(0, 200));
        buffer_.clear();
        id_.clear();
    }
    void end() { state_ = DONE; done_ = true; }
    void on_marker(int id, chat_delta & d) override {
        switch (state_) {
            case THINK:
            case CONTENT:
                if (id == K2_THINK_OPEN) state_ = THINK;
                else if (id == K2_THINK_CLOSE) state_ = CONTENT;
                else if (id == K2_SEC_BEGIN) state_ = SECTION;
                else if (id == K2_CALL_BEGIN) { buffer_.clear(); state_ = CALL_ID; }  // section begin missing
                else end();
                break;
            case SECTION:
                if (id == K2_CALL_BEGIN) { buffer_.clear(); state_ = CALL_ID; }
                else if (id == K2_SEC_END) state_ = CONTENT;
                else end();
                break;
            case CALL_ID:
                if (id == K2_ARG_BEGIN) { id_ = trim(buffer_); buffer_.clear(); state_ = CALL_ARGS; }
                else { id_ = buffer_; drop("no argument marker"); after_drop(id); }
                break;
            case CALL_ARGS:
                if (id == K2_CALL_END) { finish_call(d); state_ = SECTION; }
                else { drop("no <|tool_call_end|>"); after_drop(id); }
                break;
            case DONE: break;
        }
    }
    void after_drop(int id) {
        if (id == K2_CALL_BEGIN) state_ = CALL_ID;
        else if (id == K2_SEC_END) state_ = CONTENT;
        else if (id == K2_CALL_END) state_ = SECTION;
        else end();
    }
    void on_finish(chat_delta &) override {
        if (state_ == CALL_ID || state_ == CALL_ARGS) {
            if (state_ == CALL_ID) id_ = buffer_, buffer_.clear();
            drop("output ended");
        }
    }
    void finish_call(chat_delta & d) {
        tool_call c;
        c.id = id_;
        // name = text after the last '.' before the ':index' suffix ("functions.get_weather:0")
        std::string n = id_;
        const size_t colon = n.rfind(':');
        if (colon != std::string::npos) n.resize(colon);
        const size_t dot = n.rfind('.');
        if (dot != std::string::npos) n = n.substr(dot + 1);
        c.name = n;
        c.arguments = trim(buffer_);
        buffer_.clear();
        id_.clear();
        if (c.name.empty()) {
            warn("tool call with an empty name dropped (id '" + c.id + "')");
            return;
        }
        add_call(std::move(c), d);
    }
    state state_;
    std::string id_;
};

} // namespace

std::unique_ptr<output_parser> make_k3_parser(bool prompt_opened_think) {
    return std::make_unique<k3_parser>(prompt_opened_think);
}
std::unique_ptr<output_parser> make_k2_parser(bool prompt_opened_think) {
    return std::make_unique<k2_parser>(prompt_opened_think);
}
std::unique_ptr<output_parser> make_parser(chat_format f, const render_options & opt) {
    if (f == chat_format::k3_xtml) return make_k3_parser(opt.add_generation_prompt && opt.thinking);
    return make_k2_parser(false);
}

} // namespace perigee::chat
