#include "server/mock_script.h"

#include <cctype>

namespace perigee::server {

std::vector<int32_t> completion_ids_for(const chat::chat_template & ct, const chat::json & assistant, bool thinking) {
    const chat::json user = {{"role", "user"}, {"content", "q"}};
    chat::render_options o;
    o.thinking = thinking;
    o.thinking_effort = std::nullopt;
    const auto prefix = ct.render(chat::json::array({user}), chat::json(), o);
    o.add_generation_prompt = false;
    const auto full = ct.render(chat::json::array({user, assistant}), chat::json(), o);
    const std::vector<chat::segment> rest(full.begin() + static_cast<ptrdiff_t>(prefix.size()), full.end());
    return ct.encode(rest);
}

std::function<std::vector<int32_t>(const std::vector<int32_t> &)> make_mock_script(const tok::tokenizer & tok,
                                                                                  const chat::chat_template & ct) {
    return [&tok, &ct](const std::vector<int32_t> & prompt) -> std::vector<int32_t> {
        const std::string text = tok.decode(prompt);
        auto ends = [&](const std::string & suf) {
            return text.size() >= suf.size() && text.compare(text.size() - suf.size(), suf.size(), suf) == 0;
        };
        const bool thinking = ends("think<|sep|>") || ends("<think>");
        const size_t call = text.rfind("MOCK_TOOL_CALL:");
        const size_t say = text.rfind("MOCK_SAY:");
        const size_t tool_result = text.rfind("role=\"tool\"");
        chat::json asst = {{"role", "assistant"}};
        if (call != std::string::npos && (say == std::string::npos || call > say)) {
            if (tool_result != std::string::npos && tool_result > call) {
                asst["content"] = "tool result received";
            } else {
                size_t e = call + 15;
                while (e < text.size() && (std::isalnum(static_cast<unsigned char>(text[e])) || text[e] == '_' || text[e] == '-')) ++e;
                asst["content"] = "";
                asst["tool_calls"] = chat::json::array(
                    {{{"id", "call_1"}, {"type", "function"},
                      {"function", {{"name", text.substr(call + 15, e - call - 15)}, {"arguments", "{\"city\": \"Paris\"}"}}}}});
            }
        } else if (say != std::string::npos) {
            size_t e = say + 9;
            while (e < text.size() && text[e] != '<' && text[e] != '\n') ++e;
            asst["content"] = text.substr(say + 9, e - say - 9);
        } else {
            return {};
        }
        if (thinking) asst["reasoning_content"] = "thinking about it";
        return completion_ids_for(ct, asst, thinking);
    };
}

} // namespace perigee::server
