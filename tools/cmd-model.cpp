// perigee logits / generate / inspect: the stable model interfaces (DESIGN "Interfaces that stay stable").
#include "command.h"
#include "core/error.h"
#include "model/weights.h"
#include "runtime/model-runner.h"

#include <chrono>
#include <cstdio>
#include <sstream>

namespace perigee::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string & s) {
    std::vector<int32_t> ids;
    std::stringstream ss(s);
    std::string tok;
    while (std::getline(ss, tok, ',')) {
        size_t pos = 0;
        long v = 0;
        try {
            v = std::stol(tok, &pos);
        } catch (const std::exception &) {
            PG_FAIL("--ids: '{}' is not an integer", tok);
        }
        PG_CHECK(pos == tok.size() && v >= 0 && v <= INT32_MAX, "--ids: '{}' is not a token id", tok);
        ids.push_back(int32_t(v));
    }
    PG_CHECK(!ids.empty(), "--ids: no token ids given");
    return ids;
}

void check_ids(const std::vector<int32_t> & ids, const kimi_config & c) {
    for (int32_t id : ids) PG_CHECK(id < c.vocab_size, "--ids: token id {} is outside the vocabulary of {}", id, c.vocab_size);
}

int32_t argmax_row(const tensor & logits, int64_t row) {
    const int64_t V = logits.shape[1];
    const float * p = logits.as<float>() + row * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
        if (p[i] > p[best]) best = i;   // ties to the lower id
    return int32_t(best);
}

command_registrar reg_logits{{"logits", "print the logits of a whole-sequence prefill as JSON",
    [](CLI::App & sub) {
        auto model = std::make_shared<std::string>(default_model_dir());
        auto ids = std::make_shared<std::string>();
        sub.add_option("--model", *model, "model directory")->capture_default_str();
        sub.add_option("--ids", *ids, "comma-separated token ids")->required();
        return std::function<int()>([model, ids] {
            runner_options opt;
            auto tok = parse_ids(*ids);
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

command_registrar reg_generate{{"generate", "generate tokens (greedy by default) after a prompt",
    [](CLI::App & sub) {
        struct opts {
            std::string model = default_model_dir(), ids;
            int n = 16;
            bool print_ids = false;
        };
        auto o = std::make_shared<opts>();
        sub.add_option("--model", o->model, "model directory")->capture_default_str();
        sub.add_option("--ids", o->ids, "comma-separated prompt token ids")->required();
        sub.add_option("-n", o->n, "tokens to generate")->capture_default_str()->check(CLI::Range(1, 1 << 20));
        sub.add_flag("--print-ids", o->print_ids, "print the generated ids");
        return std::function<int()>([o] {
            auto prompt = parse_ids(o->ids);
            runner_options opt;
            opt.max_tokens = int(prompt.size()) + o->n;
            model_runner r(o->model, opt);
            check_ids(prompt, r.config());
            single_sequence seq(r);
            const auto t0 = std::chrono::steady_clock::now();
            tensor lg = seq.feed(prompt);
            std::vector<int32_t> out;
            int32_t next = argmax_row(lg, lg.shape[0] - 1);
            const auto t1 = std::chrono::steady_clock::now();
            for (int i = 0; i < o->n; ++i) {
                out.push_back(next);
                const auto & eos = r.config().eos_token_ids;
                if (std::find(eos.begin(), eos.end(), next) != eos.end()) break;
                if (i + 1 == o->n) break;
                lg = seq.feed({next});
                next = argmax_row(lg, 0);
            }
            const auto t2 = std::chrono::steady_clock::now();
            std::string s;
            for (size_t i = 0; i < out.size(); ++i) s += (i ? "," : "") + std::to_string(out[i]);
            std::printf("%s\n", s.c_str());
            const double pf = std::chrono::duration<double>(t1 - t0).count();
            const double dc = std::chrono::duration<double>(t2 - t1).count();
            std::fprintf(stderr, "prefill %zu tokens in %.3f s; decode %zu tokens in %.3f s (%.1f tok/s)\n", prompt.size(), pf,
                         out.size() > 0 ? out.size() - 1 : 0, dc, out.size() > 1 ? double(out.size() - 1) / dc : 0.0);
            (void)o->print_ids;
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
            const reconcile_report rep = weights_reconcile(c, ck);
            std::printf("checkpoint: %zu tensors, %.1f MB\n%s", ck.names().size(), double(ck.total_bytes()) / 1e6,
                        rep.str().c_str());
            if (!rep.ok()) return 2;
            // Value-level checks that loading defers (every MXFP4 scale byte; A_log tails).
            const auto w = weights_load(c, checkpoint::open(*dir));
            const auto bad = weights_verify_fp4(*w);
            for (const auto & b : bad) std::printf("fp4: %s\n", b.c_str());
            std::printf("fp4 scales: %s\n", bad.empty() ? "ok" : "INVALID");
            return bad.empty() ? 0 : 2;
        });
    }}};

} // namespace
} // namespace perigee::cli
