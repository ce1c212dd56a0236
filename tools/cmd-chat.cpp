// perigee chat: an interactive terminal chat on the engine (issue 5 item 8).
//
// Each turn renders the whole conversation (system + every user/assistant message) with the model's
// own chat template (src/chat), runs it through the engine (src/runtime, one sequence), and streams
// the answer: ids -> stream_decoder (specials kept, the parser needs the markers) -> the format's
// output parser -> reasoning (dimmed) and content. A turn ends on the template's stop ids
// (<|end_of_msg|> / [EOS]), at the per-turn token limit, or on Ctrl-C (the turn is cancelled).
//
// Interactive when stdin is a terminal (libedit line editing and history); otherwise one line of
// stdin per turn and the answer on stdout (for scripts and tests). Colour only when stdout is a
// terminal and NO_COLOR is unset or empty (https://no-color.org) and --no-color is not given.
// Commands: /exit (/quit), /reset (forget the conversation), /help; Ctrl-D ends the session.
// --debug-ids prints, per turn on stderr, the generated ids and the id the turn ended on.
#include "chat/chat.h"
#include "chat/parser.h"
#include "command.h"
#include "core/error.h"
#include "runtime/engine.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tiktoken_dir.h"

#include <editline/readline.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>

namespace perigee::cli {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_sigint(int) { g_interrupted = 1; }

struct chat_args {
    std::string model = default_model_dir();
    std::string system;
    std::string thinking = "on";
    std::string thinking_effort = "max";
    int max_tokens = 512;          // per turn
    int max_model_len = 4096;
    float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
    int top_k = 0;
    int64_t seed = -1;
    bool debug_ids = false, no_color = false, hide_reasoning = false;
    std::string backend = "cpu";
};

struct event_queue {
    std::mutex m;
    std::condition_variable cv;
    std::deque<token_event> q;
    void push(const token_event & e) {
        {
            std::lock_guard<std::mutex> lk(m);
            q.push_back(e);
        }
        cv.notify_one();
    }
    std::deque<token_event> pop_all(std::chrono::milliseconds wait) {
        std::unique_lock<std::mutex> lk(m);
        cv.wait_for(lk, wait, [&] { return !q.empty(); });
        std::deque<token_event> out;
        out.swap(q);
        return out;
    }
};

class chat_session {
public:
    chat_session(const chat_args & a, bool interactive)
        : a_(a), interactive_(interactive), td_(tok::load_tiktoken_dir(a.model)),
          ct_(chat::chat_template::detect(*td_.tok, a.model)) {
        const char * nc = std::getenv("NO_COLOR");
        color_ = isatty(STDOUT_FILENO) && !(nc && *nc) && !a.no_color;
        PG_CHECK(a.thinking == "on" || a.thinking == "off", "--thinking: '{}' is not on or off", a.thinking);
        ro_.thinking = a.thinking == "on";
        if (a.thinking_effort == "none") ro_.thinking_effort.reset();
        else ro_.thinking_effort = a.thinking_effort;
        runner_options opt;
        opt.backend = a.backend;
        opt.n_slots = 1;
        opt.max_tokens = a.max_model_len;
        runner_ = std::make_unique<model_runner>(a.model, opt);
        engine_options eo;
        eo.max_num_seqs = 1;
        eo.max_model_len = a.max_model_len;
        eo.max_num_batched_tokens = runner_->be().step_tokens_default();
        eo.page_size = opt.page_size;
        eng_ = std::make_unique<engine>(*runner_, eo);
        for (auto id : ct_.stop_ids())
            if (id < runner_->config().vocab_size) stop_ids_.push_back(id);
        reset();
    }

    void reset() {
        messages_ = chat::json::array();
        if (!a_.system.empty()) messages_.push_back({{"role", "system"}, {"content", a_.system}});
        turn_ = 0;
    }

    // One user turn; returns false when the turn failed (the message is dropped from the history).
    bool turn(const std::string & user) {
        messages_.push_back({{"role", "user"}, {"content", user}});
        std::vector<int32_t> prompt;
        bool trimmed = false;
        for (;;) {
            prompt = ct_.encode(ct_.render(messages_, nullptr, ro_));
            if (int64_t(prompt.size()) < a_.max_model_len) break;
            // Too long: forget the oldest exchange (the system message stays).
            const size_t first = !messages_.empty() && messages_[0]["role"] == "system" ? 1 : 0;
            if (messages_.size() - first <= 1) {
                note(fmt::format("the message is {} tokens; the context holds {} (--max-model-len)", prompt.size(), a_.max_model_len));
                messages_.erase(messages_.end() - 1);
                return false;
            }
            messages_.erase(messages_.begin() + long(first));
            while (messages_.size() > first + 1 && messages_[first]["role"] != "user") messages_.erase(messages_.begin() + long(first));
            trimmed = true;
        }
        if (trimmed) note("the oldest turns were dropped to fit the context");
        request q;
        q.prompt = prompt;
        q.sp.max_tokens = std::min<int>(a_.max_tokens, a_.max_model_len - int(prompt.size()));
        q.sp.temperature = a_.temperature;
        q.sp.top_k = a_.top_k;
        q.sp.top_p = a_.top_p;
        q.sp.min_p = a_.min_p;
        if (a_.seed >= 0) q.sp.seed = uint64_t(a_.seed) + uint64_t(turn_);
        q.stop_token_ids = stop_ids_;
        ++turn_;

        auto evq = std::make_shared<event_queue>();
        g_interrupted = 0;
        const auto t0 = std::chrono::steady_clock::now();
        const uint64_t id = eng_->submit(q, [evq](const token_event & e) { evq->push(e); });
        tok::stream_decoder dec(*td_.tok);
        auto parser = chat::make_parser(ct_.format(), ro_);
        std::vector<int32_t> ids;
        finish_reason why = finish_reason::NONE;
        std::string err;
        bool cancelled = false;
        state_ = out_state::none;
        while (why == finish_reason::NONE) {
            if (g_interrupted && !cancelled) {
                eng_->cancel(id);
                cancelled = true;
            }
            for (const auto & ev : evq->pop_all(std::chrono::milliseconds(50))) {
                if (ev.token >= 0) {
                    ids.push_back(ev.token);
                    show(parser->feed(dec.push(ev.token)));
                }
                if (ev.finished != finish_reason::NONE) {
                    why = ev.finished;
                    err = ev.error;
                }
            }
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (!cancelled) {   // a cancelled turn may stop inside a marker: nothing more to show
            show(parser->feed(dec.finish()));
            show(parser->finish());
        }
        end_output();
        const chat::chat_message & m = parser->message();
        if (a_.debug_ids) {
            std::string s;
            for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
            const int32_t last = ids.empty() ? -1 : ids.back();
            const double dt = std::chrono::duration<double>(t1 - t0).count();
            std::fprintf(stderr, "[debug] turn %d: prompt_tokens=%zu generated=%zu finish=%s last_token=%d last_token_text=%s "
                                 "end_of_msg=%s content_bytes=%zu reasoning_bytes=%zu seconds=%.3f ids=%s\n",
                         turn_, prompt.size(), ids.size(), std::string(finish_reason_name(why)).c_str(), last,
                         last >= 0 ? td_.tok->token_bytes(last).c_str() : "-", parser->done() ? "yes" : "no",
                         m.content.size(), m.reasoning_content.size(), dt, s.c_str());
            for (const auto & w : m.warnings) std::fprintf(stderr, "[debug] parser warning: %s\n", w.c_str());
            std::fflush(stderr);
        }
        if (why == finish_reason::ERROR) {
            note("generation failed: " + err);
            messages_.erase(messages_.end() - 1);
            return false;
        }
        if (cancelled || why == finish_reason::CANCELLED) {
            note("interrupted; the turn was dropped");
            messages_.erase(messages_.end() - 1);
            return false;
        }
        if (why == finish_reason::LENGTH) note(fmt::format("stopped at the per-turn limit of {} tokens (-n)", q.sp.max_tokens));
        chat::json am = {{"role", "assistant"}, {"content", m.content}};
        if (!m.reasoning_content.empty()) am["reasoning_content"] = m.reasoning_content;
        messages_.push_back(am);
        return true;
    }

    bool color() const { return color_; }

private:
    enum class out_state { none, reasoning, content };

    void show(const chat::chat_delta & d) {
        if (!d.reasoning_content.empty() && !a_.hide_reasoning) {
            if (state_ != out_state::reasoning) {
                if (state_ == out_state::content) put("\n");
                put(color_ ? "\x1b[2m" : "<think>\n");
                state_ = out_state::reasoning;
            }
            put(d.reasoning_content);
        }
        if (!d.content.empty()) {
            if (state_ == out_state::reasoning) {
                put(color_ ? "\x1b[0m\n" : "\n</think>\n");
                state_ = out_state::none;
            }
            if (state_ == out_state::none) {
                // the model's answers usually begin with a space or newline after the marker
                std::string c = d.content;
                const size_t b = c.find_first_not_of(" \n");
                if (b == std::string::npos) return;
                c.erase(0, b);
                state_ = out_state::content;
                put(c);
                return;
            }
            put(d.content);
        }
        for (const auto & c : d.tool_calls) {
            if (state_ == out_state::reasoning) put(color_ ? "\x1b[0m\n" : "\n</think>\n");
            put(fmt::format("\n[tool call {}({})]\n", c.name, c.arguments));
            state_ = out_state::none;
        }
    }
    void end_output() {
        if (state_ == out_state::reasoning) put(color_ ? "\x1b[0m" : "\n</think>");
        put("\n");
        std::fflush(stdout);
    }
    void put(const std::string & s) {
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);
    }
    void note(const std::string & s) {
        if (color_) std::fprintf(stderr, "\x1b[33m[%s]\x1b[0m\n", s.c_str());
        else std::fprintf(stderr, "[%s]\n", s.c_str());
        std::fflush(stderr);
    }

    const chat_args & a_;
    bool interactive_;
    tok::tiktoken_dir td_;
    chat::chat_template ct_;
    chat::render_options ro_;
    std::unique_ptr<model_runner> runner_;
    std::unique_ptr<engine> eng_;
    std::vector<int32_t> stop_ids_;
    chat::json messages_;
    int turn_ = 0;
    bool color_ = false;
    out_state state_ = out_state::none;
};

std::string trim(const std::string & s) {
    const size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {};
    const size_t e = s.find_last_not_of(" \t\r\n");
    return s.substr(b, e - b + 1);
}

const char * k_help = "commands: /exit or /quit (or Ctrl-D) ends, /reset forgets the conversation, /help; "
                      "Ctrl-C interrupts an answer";

int run_chat(const chat_args & a) {
    const bool interactive = isatty(STDIN_FILENO);
    chat_session s(a, interactive);
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;   // no SA_RESTART: a blocked read returns
    sigaction(SIGINT, &sa, nullptr);
    if (interactive) {
        std::fprintf(stderr, "perigee chat: %s (%s). %s\n", a.model.c_str(), a.thinking == "on" ? "thinking on" : "thinking off", k_help);
        using_history();
    }
    const std::string prompt = interactive ? "> " : "";   // plain: libedit mangles escape codes in prompts
    for (;;) {
        std::string line;
        if (interactive) {
            g_interrupted = 0;
            char * l = readline(prompt.c_str());
            if (!l) {
                if (g_interrupted) continue;   // Ctrl-C at the prompt: a fresh line
                std::fprintf(stderr, "\n");
                break;                         // Ctrl-D
            }
            line = l;
            std::free(l);
            if (!trim(line).empty()) add_history(line.c_str());
        } else if (!std::getline(std::cin, line)) {
            break;
        }
        line = trim(line);
        if (line.empty()) continue;
        if (line == "/exit" || line == "/quit") break;
        if (line == "/reset") {
            s.reset();
            std::fprintf(stderr, "[conversation reset]\n");
            continue;
        }
        if (line == "/help") {
            std::fprintf(stderr, "%s\n", k_help);
            continue;
        }
        s.turn(line);
    }
    return 0;
}

command_registrar reg{{"chat", "interactive terminal chat with a model (chat template, streaming, reasoning dimmed)",
    [](CLI::App & sub) {
        auto a = std::make_shared<chat_args>();
        sub.add_option("--model,-m", a->model, "model directory (weights + tiktoken.model + tokenizer_config.json)")->capture_default_str();
        sub.add_option("--system", a->system, "system message");
        sub.add_option("--thinking", a->thinking, "thinking mode: on or off")->capture_default_str()->check(CLI::IsMember({"on", "off"}));
        sub.add_option("--thinking-effort", a->thinking_effort, "K3 thinking effort: low, high, max, or none (no effort message)")
            ->capture_default_str()->check(CLI::IsMember({"low", "high", "max", "none"}));
        sub.add_option("-n,--max-tokens", a->max_tokens, "tokens per answer at most")->capture_default_str()->check(CLI::Range(1, 1 << 20));
        sub.add_option("--max-model-len,-c", a->max_model_len, "context: conversation + answer tokens")->capture_default_str()->check(CLI::Range(16, 1 << 24));
        sub.add_option("--temperature", a->temperature, "0 = greedy")->capture_default_str();
        sub.add_option("--top-k", a->top_k, "0 = off")->capture_default_str();
        sub.add_option("--top-p", a->top_p, "nucleus mass")->capture_default_str();
        sub.add_option("--min-p", a->min_p, "min-p floor")->capture_default_str();
        sub.add_option("--seed", a->seed, "sampling seed (turn i uses seed + i; default: random)");
        sub.add_flag("--no-color", a->no_color, "no ANSI colour (also when NO_COLOR is set or stdout is not a terminal)");
        sub.add_flag("--hide-reasoning", a->hide_reasoning, "do not print the reasoning channel");
        sub.add_option("--backend", a->backend, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        sub.add_flag("--debug-ids", a->debug_ids, "print each turn's generated ids and the id it ended on to stderr");
        return std::function<int()>([a] { return run_chat(*a); });
    }}};

} // namespace
} // namespace perigee::cli
