// OpenAI request parsing and validation (ECOSYSTEM §3, RELIABILITY §B5), independent of HTTP.
// Strict: every field is known, explicitly ignored (the short list below) or refused by name.
//
// Documented rules:
//  * Integer fields take JSON integers only: 10 is fine, 10.0 / 1.5 / "10" are 400 (H-14).
//  * Duplicate keys anywhere, nesting deeper than k_max_json_depth, comments, NaN are 400 (H-10/H-13).
//  * Accepted and ignored (no effect on generation): user, metadata, store, service_tier,
//    prompt_cache_key, safety_identifier, verbosity, stream_options.include_obfuscation,
//    parallel_tool_calls, request_id, priority (0 only), cache_prompt, skip_special_tokens (always
//    true: specials never reach content), modalities ["text"], logit_bias {} (empty).
//  * Refused by name (400 "unsupported parameter"): n != 1, best_of != 1, audio, prediction,
//    prompt_embeds, web_search_options, functions, function_call, logit_bias (non-empty),
//    min_tokens > 0, suffix, structured_outputs, guided_*, grammar, json_schema, chat_template,
//    continue_final_message, a final assistant message (prefill), any unknown field.
//  * max_completion_tokens wins over max_tokens when both are given; absent -> chat: the rest of
//    the context; completions: 16 (OpenAI's default), clipped to the context.
//  * tool_choice named {"type":"function","function":{"name":N}}: only that tool is rendered and the
//    prompt says tool_choice=required (no constrained decoding yet).
//  * response_format json_object / json_schema: rendered into the prompt by the model's chat
//    format (the official template's behaviour); no constrained decoding yet.
//  * stream_options without stream: 400.  model: "" or absent -> the served model; unknown -> 404.
#pragma once
#include "runtime/engine.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace perigee::server {

using json = nlohmann::ordered_json;

constexpr int k_max_json_depth = 64;
constexpr size_t k_max_stop_strings = 16;
constexpr size_t k_max_stop_bytes = 1024;
constexpr size_t k_max_tools = 128;
constexpr size_t k_max_tool_name = 64;

// An OpenAI error: status, type, param (field path or empty), code (or empty), message.
struct api_error {
    int status = 400;
    std::string type = "invalid_request_error";
    std::string param;
    std::string code;
    std::string message;
    json to_json() const;
};

[[noreturn]] void fail(std::string param, std::string message, int status = 400, std::string code = {},
                       std::string type = "invalid_request_error");

// Parses the body strictly (duplicate keys, depth cap, UTF-8, one object). Throws api_error.
json parse_body(const std::string & body);

enum class endpoint { chat, completion };

struct gen_request {
    endpoint kind = endpoint::chat;
    std::string model;
    // chat
    json messages = json::array();    // normalised for the renderer (developer -> system, text parts joined)
    json tools;                       // null or array (a named tool_choice keeps only that tool)
    std::string tool_choice;          // "" | "auto" | "none" | "required"
    json response_format;             // null or the object
    std::optional<bool> thinking;     // chat_template_kwargs.thinking / reasoning_effort none
    std::optional<std::string> thinking_effort;   // low | high | max ("" = none)
    bool thinking_effort_set = false;
    // completions
    std::optional<std::string> prompt_text;
    std::vector<int32_t> prompt_ids;
    bool echo = false;
    // both
    sampling_params sp;
    bool max_tokens_set = false;
    std::vector<std::string> stop;
    std::vector<int32_t> stop_token_ids;
    bool ignore_eos = false;
    bool include_stop_str_in_output = false;
    bool stream = false;
    bool include_usage = false;
    bool logprobs = false;            // chat: logprobs:true; completions: logprobs:int given
    int top_logprobs = 0;
};

struct parse_limits {
    int vocab_size = 0;               // ids must be < this (stop_token_ids, token prompts)
    std::string served_model;
};

gen_request parse_chat_request(const json & body, const parse_limits & lim);
gen_request parse_completion_request(const json & body, const parse_limits & lim);

// /tokenize {"prompt": str | "messages": [...], "add_special_tokens"?, "return_token_strs"?, "model"?}
// and /detokenize {"tokens": [int], "model"?}: field checks only.
struct tokenize_request {
    std::optional<std::string> prompt;
    gen_request chat;                 // when messages are given
    bool has_messages = false;
    bool return_token_strs = false;
};
tokenize_request parse_tokenize_request(const json & body, const parse_limits & lim);
std::vector<int32_t> parse_detokenize_request(const json & body, const parse_limits & lim);

// Constant-time equality (length leaks only through the max of both lengths).
bool constant_time_equal(const std::string & a, const std::string & b);

} // namespace perigee::server
