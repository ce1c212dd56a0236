// perigee render: render a conversation with the model's own chat format and print the prompt
// and its ids (segment-wise encoding, TOKENIZER §4.5).
#include "chat/chat.h"
#include "command.h"
#include "core/error.h"
#include "tokenizer/ranks.h"
#include "tokenizer/tiktoken_dir.h"

#include <cstdio>
#include <memory>

namespace {

struct render_args {
    std::string model, messages, tools, effort = "default", tool_choice;
    bool no_gen = false, no_thinking = false, json = false, segments = false;
};

perigee::chat::json read_json(const std::string & path) {
    try {
        return perigee::chat::json::parse(perigee::tok::read_file_bytes(path));
    } catch (const perigee::chat::json::exception & e) {
        PG_FAIL("{}: invalid JSON: {}", path, e.what());
    }
}

int run_render(const render_args & a) {
    using namespace perigee;
    const std::string dir = a.model.empty() ? cli::default_model_dir() : a.model;
    const tok::tiktoken_dir td = tok::load_tiktoken_dir(dir);
    const auto ct = chat::chat_template::detect(*td.tok, dir);
    chat::json msgs = read_json(a.messages);
    chat::json tools;
    if (msgs.is_object()) {  // {"messages": [...], "tools": [...]} request bodies work too
        if (msgs.contains("tools")) tools = msgs["tools"];
        msgs = msgs.value("messages", chat::json::array());
    }
    if (!a.tools.empty()) tools = read_json(a.tools);
    chat::render_options o;
    o.add_generation_prompt = !a.no_gen;
    o.thinking = !a.no_thinking;
    if (a.effort == "none") o.thinking_effort.reset();
    else if (a.effort != "default") o.thinking_effort = a.effort;
    o.tool_choice = a.tool_choice;
    const auto segs = ct.render(msgs, tools, o);
    const auto ids = ct.encode(segs);
    if (a.json) {
        chat::json segj = chat::json::array();
        for (const auto & s : segs) segj.push_back({{"text", s.text}, {"special", s.special}});
        chat::json j = {{"format", chat::chat_format_name(ct.format())}, {"rendered", chat::join_segments(segs)},
                        {"ids", ids}};
        if (a.segments) j["segments"] = segj;
        std::printf("%s\n", j.dump().c_str());
        return 0;
    }
    std::printf("# format: %s, %zu segments, %zu ids\n", chat::chat_format_name(ct.format()), segs.size(), ids.size());
    if (a.segments) {
        for (const auto & s : segs) std::printf("%s %s\n", s.special ? "S" : "T", chat::json(s.text).dump().c_str());
    }
    const std::string r = chat::join_segments(segs);
    std::fwrite(r.data(), 1, r.size(), stdout);
    std::printf("\n");
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? "," : "", ids[i]);
    std::printf("\n");
    return 0;
}

perigee::cli::command_registrar reg{{"render", "Render a conversation with the model's chat format",
    [](CLI::App & sub) {
        auto a = std::make_shared<render_args>();
        sub.add_option("--model", a->model, "model directory (tiktoken.model + tokenizer_config.json)");
        sub.add_option("--messages", a->messages, "JSON file: messages array, or a request body")->required();
        sub.add_option("--tools", a->tools, "JSON file: tools array");
        sub.add_option("--thinking-effort", a->effort, "K3: low | high | max | none (default: max)");
        sub.add_option("--tool-choice", a->tool_choice, "auto | required | none");
        sub.add_flag("--no-generation-prompt", a->no_gen, "do not open the assistant turn");
        sub.add_flag("--no-thinking", a->no_thinking, "thinking off");
        sub.add_flag("--segments", a->segments, "also print the segment list");
        sub.add_flag("--json", a->json, "print {format, rendered, ids[, segments]} as JSON");
        return std::function<int()>([a] { return run_render(*a); });
    }}};

} // namespace
