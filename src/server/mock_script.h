// Scripted outputs for the mock engine (tests of the tool-call / reasoning plumbing without a
// trained model). The script looks at the decoded prompt:
//  * "MOCK_TOOL_CALL:NAME" in the last user turn (no tool result after it) -> the model "calls"
//    NAME with {"city": "Paris"} (rendered in the model's own chat format, so the server's output
//    parser sees exactly what a real model would emit);
//  * a tool result after it -> content "tool result received";
//  * "MOCK_SAY:TEXT" (TEXT up to the next '<' or newline) -> reasoning "thinking about it" (when
//    the prompt opened a think block) and content TEXT;
//  * otherwise: no script (pseudo-random tokens).
#pragma once
#include "chat/chat.h"

#include <functional>
#include <vector>

namespace perigee::server {

// The ids a model emits for `assistant` (an OpenAI assistant message) after a generation prompt
// rendered with thinking on/off.
std::vector<int32_t> completion_ids_for(const chat::chat_template & ct, const chat::json & assistant, bool thinking);

std::function<std::vector<int32_t>(const std::vector<int32_t> &)> make_mock_script(const tok::tokenizer & tok,
                                                                                  const chat::chat_template & ct);

} // namespace perigee::server
