// perigee logits / generate / inspect: the stable model interfaces (DESIGN "Interfaces that stay stable").
#include "cli-util.h"
#include "command.h"
#include "core/error.h"
#include "model/weights.h"
#include "chat/chat.h"
#include "runtime/engine.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tiktoken_dir.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>

namespace perigee::cli {
namespace {


void check_ids(const std::vector<int32_t> & ids, const kimi_config & c) {
    for (int32_t id : ids) PG_CHECK(id < c.vocab_size, "--ids: token id {} is outside the vocabulary of {}", id, c.vocab_size);
}

command_registrar reg_logits{{"logits", "print the logits of a whole-sequence prefill as JSON",
    [](CLI::App & sub) {
        auto model = std::make_shared<std::string>(default_model_dir());
        auto ids = std::make_shared<std::string>();
        auto be = std::make_shared<std::string>("cpu");
        sub.add_option("--model", *model, "model directory")->capture_default_str();
        sub.add_option("--ids", *ids, "comma-separated token ids")->required();
        sub.add_option("--backend", *be, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        return std::function<int()>([model, ids, be] {
            runner_options opt;
            opt.backend = *be;
            auto tok = parse_id_list(*ids);
            opt.max_tokens = int(tok.size());
            model_runner r(*model, opt);
            check_ids(tok, r.config());
            single_sequence seq(r);
            tensor lg = seq.feed(tok);
            std::string out = "{\"logits\": [";
            const int64_t T = lg.shape[0], V = lg.shape[1];
            for (int64_t t = 0; t < T; ++t) {
                out += t ? ", [" : "[";
                for (int64_t v = 0; v < V; ++v) {
                    char buf[32];
                    std::snprintf(buf, sizeof buf, v ? ", %.9g" : "%.9g", double(lg.as<float>()[t * V + v]));
                    out += buf;
                }
                out += "]";
            }
            out += "]}\n";
            std::fwrite(out.data(), 1, out.size(), stdout);
            return 0;
        });
    }}};

command_registrar reg_generate{{"generate", "generate tokens (greedy by default) after a prompt, through the engine",
    [](CLI::App & sub) {
        struct opts {
            std::string model = default_model_dir(), ids, prompt, backend = "cpu";
            int n = 16;
            bool print_ids = false, ignore_eos = false, raw = false;
            float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
            int top_k = 0;
            int64_t seed = -1;
        };
        auto o = std::make_shared<opts>();
        sub.add_option("--model", o->model, "model directory")->capture_default_str();
        auto * ids_opt = sub.add_option("--ids", o->ids, "comma-separated prompt token ids");
        auto * prompt_opt = sub.add_option("--prompt", o->prompt, "prompt text (rendered with the model's chat template "
                                                                "as one user message, unless --raw)");
        ids_opt->excludes(prompt_opt);
        sub.add_flag("--raw", o->raw, "with --prompt: plain completion of the text, no chat template");
        sub.add_option("-n", o->n, "tokens to generate")->capture_default_str()->check(CLI::Range(1, 1 << 20));
        sub.add_flag("--print-ids", o->print_ids, "print the generated ids (the default output)");
        sub.add_flag("--ignore-eos", o->ignore_eos, "do not stop at the model's eos ids");
        sub.add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str();
        sub.add_option("--top-k", o->top_k, "0 = off")->capture_default_str();
        sub.add_option("--top-p", o->top_p, "nucleus mass")->capture_default_str();
        sub.add_option("--min-p", o->min_p, "min-p floor")->capture_default_str();
        sub.add_option("--seed", o->seed, "sampling seed (default: random)");
        sub.add_option("--backend", o->backend, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        return std::function<int()>([o] {
            PG_CHECK(!o->ids.empty() || !o->prompt.empty(), "generate: give --ids or --prompt");
            // Text in and out go through the model's own tokenizer and chat format (src/tokenizer,
            // src/chat); a model without tokenizer files can only be driven with --ids.
            std::optional<tok::tiktoken_dir> td;
            std::optional<chat::chat_template> ct;
            std::vector<int32_t> prompt, extra_stops;
            if (!o->prompt.empty()) {
                td = tok::load_tiktoken_dir(o->model);
                if (o->raw) {
                    prompt = td->tok->encode_ordinary(o->prompt);
                    // A plain completion ends where the model starts chat structure (a model trained on
                    // plain text and chat renders may close a "turn"): stop on the format's structural
                    // special tokens, besides the eos ids.
                    const auto fmt = chat::chat_template::detect(*td->tok, o->model).format();
                    for (const auto & name : chat::structural_specials(fmt))
                        if (auto id = td->tok->special_id(name)) extra_stops.push_back(int32_t(*id));
                } else {
                    ct = chat::chat_template::detect(*td->tok, o->model);
                    const chat::json msgs = chat::json::array({chat::json{{"role", "user"}, {"content", o->prompt}}});
                    prompt = ct->encode(ct->render(msgs, nullptr, chat::render_options{}));
                    for (auto id : ct->stop_ids()) extra_stops.push_back(id);
                }
                PG_CHECK(!prompt.empty(), "generate: the prompt encodes to no tokens");
            } else {
                prompt = parse_id_list(o->ids);
            }
            runner_options opt;
            opt.backend = o->backend;
            opt.max_tokens = int(prompt.size()) + o->n;
            model_runner r(o->model, opt);
            check_ids(prompt, r.config());
            engine_options eo;
            eo.max_num_seqs = 1;
            eo.max_model_len = opt.max_tokens;
            eo.max_num_batched_tokens = std::max(512, int(prompt.size()));
            eo.page_size = opt.page_size;
            engine e(r, eo);
            request q;
            q.prompt = prompt;
            q.sp.max_tokens = o->n;
            q.sp.temperature = o->temperature;
            q.sp.top_k = o->top_k;
            q.sp.top_p = o->top_p;
            q.sp.min_p = o->min_p;
            if (o->seed >= 0) q.sp.seed = uint64_t(o->seed);
            q.ignore_eos = o->ignore_eos;
            q.stop_token_ids = extra_stops;
            const bool text_out = td.has_value() && !o->print_ids;
            std::optional<tok::stream_decoder> sd;
            if (text_out) sd.emplace(*td->tok);
            std::vector<int32_t> out;
            std::string err;
            finish_reason why = finish_reason::NONE;
            std::chrono::steady_clock::time_point t_first;
            const auto t0 = std::chrono::steady_clock::now();
            e.submit(q, [&](const token_event & ev) {   // engine thread; wait_idle orders the reads below
                if (ev.token >= 0) {
                    if (out.empty()) t_first = std::chrono::steady_clock::now();
                    out.push_back(ev.token);
                    if (text_out && !td->tok->is_special(ev.token)) {   // stream text as it comes
                        const std::string piece = sd->push(ev.token);
                        std::fwrite(piece.data(), 1, piece.size(), stdout);
                        std::fflush(stdout);
                    }
                }
                if (ev.finished != finish_reason::NONE) {
                    why = ev.finished;
                    err = ev.error;
                }
            });
            e.wait_idle();
            const auto t2 = std::chrono::steady_clock::now();
            PG_CHECK(why != finish_reason::ERROR, "generate failed: {}", err);
            if (text_out) {
                const std::string tail = sd->finish();
                std::printf("%s\n", tail.c_str());
            } else {
                std::string s;
                for (size_t i = 0; i < out.size(); ++i) {
                    if (i) s += ",";
                    s += std::to_string(out[i]);
                }
                std::printf("%s\n", s.c_str());
            }
            std::fflush(stdout);
            const double pf = out.empty() ? 0.0 : std::chrono::duration<double>(t_first - t0).count();
            const double dc = out.empty() ? 0.0 : std::chrono::duration<double>(t2 - t_first).count();
            std::fprintf(stderr, "prefill %zu tokens in %.3f s; decode %zu tokens in %.3f s (%.1f tok/s); finish: %s\n",
                         prompt.size(), pf, out.size() > 0 ? out.size() - 1 : 0, dc,
                         out.size() > 1 && dc > 0 ? double(out.size() - 1) / dc : 0.0, std::string(finish_reason_name(why)).c_str());
            return 0;
        });
    }}};

command_registrar reg_inspect{{"inspect", "print a model directory's config summary and the reconciler report",
    [](CLI::App & sub) {
        auto dir = std::make_shared<std::string>();
        sub.add_option("dir", *dir, "model directory")->required();
        return std::function<int()>([dir] {
            const kimi_config c = config_load(*dir);
            std::printf("%s", config_summary(c).c_str());
            const checkpoint ck = checkpoint::open(*dir);
            const auto decls = weights_declare(c, ck);   // once, for the report and the load
            const reconcile_report rep = weights_reconcile(c, ck, decls);
            std::printf("checkpoint: %zu tensors, %.1f MB\n%s", ck.names().size(), double(ck.total_bytes()) / 1e6,
                        rep.str().c_str());
            if (!rep.ok()) return 2;
            // Value-level checks that loading defers (every MXFP4 scale byte; A_log tails).
            const auto w = weights_load(c, checkpoint::open(*dir), decls);
            const auto bad = weights_verify_fp4(*w);
            for (const auto & b : bad) std::printf("fp4: %s\n", b.c_str());
            std::printf("fp4 scales: %s\n", bad.empty() ? "ok" : "INVALID");
            return bad.empty() ? 0 : 2;
        });
    }}};

} // namespace
} // namespace perigee::cli
