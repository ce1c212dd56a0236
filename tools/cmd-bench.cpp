// perigee bench: continuous-batching throughput through the engine, per batch size.
// Backend-agnostic: everything goes through model_runner / engine; --backend picks the backend
// (cpu today; the CUDA backend and HBM-floor figures plug in here later).
#include "command.h"
#include "core/error.h"
#include "model/synth.h"
#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <unistd.h>

namespace perigee::cli {
namespace {

std::vector<int> parse_batches(const std::string & s) {
    std::vector<int> out;
    std::stringstream ss(s);
    std::string tok;
    while (std::getline(ss, tok, ',')) {
        size_t pos = 0;
        int v = 0;
        try {
            v = std::stoi(tok, &pos);
        } catch (const std::exception &) {
            PG_FAIL("--batch: '{}' is not an integer", tok);
        }
        PG_CHECK(pos == tok.size() && v >= 1, "--batch: '{}' is not a batch size >= 1", tok);
        out.push_back(v);
    }
    PG_CHECK(!out.empty(), "--batch: no batch sizes given");
    return out;
}

struct bench_result {
    double prefill_s = 0, decode_s = 0;
    uint64_t prefill_steps = 0, decode_steps = 0, decode_tokens = 0, batched_tokens = 0;
};

// B requests of P random prompt tokens, each generating N tokens (eos ignored), all submitted at once.
// The prefill phase ends when every request has its first token; the rest is the decode phase.
bench_result run_batch(model_runner & r, int B, int P, int N, int budget) {
    engine_options eo;
    eo.max_num_seqs = B;
    eo.max_model_len = P + N;
    eo.max_num_batched_tokens = std::max(budget, B);
    eo.page_size = r.state().page_size;
    eo.max_queue = B;
    engine e(r, eo);
    std::mutex mu;
    int have_first = 0;
    std::chrono::steady_clock::time_point t_prefilled;
    uint64_t steps_prefilled = 0, batched_prefilled = 0;
    const int64_t V = r.config().vocab_size;
    const auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < B; ++b) {
        request q;
        for (int i = 0; i < P; ++i) q.prompt.push_back(int32_t((uint64_t(b) * 7919 + uint64_t(i) * 104729 + 17) % uint64_t(V)));
        q.sp.max_tokens = N;
        q.ignore_eos = true;
        e.submit(q, [&](const token_event & ev) {
            if (ev.token < 0 || ev.completion_tokens != 1) return;
            std::lock_guard lk(mu);
            if (++have_first == B) {
                t_prefilled = std::chrono::steady_clock::now();
                const engine_stats s = e.stats();   // steps already counts the step being sampled
                steps_prefilled = s.steps;
                batched_prefilled = s.batched_tokens;
            }
        });
    }
    e.wait_idle();
    const auto t1 = std::chrono::steady_clock::now();
    const engine_stats s = e.stats();
    bench_result res;
    res.prefill_s = std::chrono::duration<double>(t_prefilled - t0).count();
    res.decode_s = std::chrono::duration<double>(t1 - t_prefilled).count();
    res.prefill_steps = steps_prefilled;
    res.decode_steps = s.steps - steps_prefilled;
    res.decode_tokens = uint64_t(B) * uint64_t(N - 1);
    res.batched_tokens = s.batched_tokens;
    (void)batched_prefilled;
    PG_CHECK(s.errors == 0, "bench: {} requests failed", s.errors);
    return res;
}

command_registrar reg{{"bench", "continuous-batching throughput per batch size (ms/step, tok/s, tokens per step)",
    [](CLI::App & sub) {
        struct opts {
            std::string model, synthetic, batches = "1,8,32", backend = "cpu";
            int prompt_len = 64, decode = 32, budget = 0, bf16_inputs = 0;
        };
        auto o = std::make_shared<opts>();
        sub.add_option("--model", o->model, "model directory");
        sub.add_option("--synthetic", o->synthetic, "synthesize this preset into a temp dir instead (perigee synth presets)");
        sub.add_option("--prompt-len", o->prompt_len, "prompt tokens per request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
        sub.add_option("--decode", o->decode, "generated tokens per request")->capture_default_str()->check(CLI::Range(2, 1 << 20));
        sub.add_option("--batch", o->batches, "comma-separated batch sizes")->capture_default_str();
        sub.add_option("--max-batched-tokens", o->budget, "per-step token budget (0: the backend's default, cpu 512, cuda 2048)")
            ->capture_default_str()->check(CLI::Range(0, 1 << 20));
        sub.add_option("--backend", o->backend, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        sub.add_option("--bf16-inputs-tokens", o->bf16_inputs, "steps of at least this many tokens feed their Linears and experts bf16-rounded inputs (0: never, else >= 2)")
            ->capture_default_str()->check(CLI::Range(0, 1 << 20));
        return std::function<int()>([o] {
            PG_CHECK(o->model.empty() != o->synthetic.empty(), "bench: give exactly one of --model DIR or --synthetic PRESET");
            const auto batches = parse_batches(o->batches);
            std::string dir = o->model;
            std::filesystem::path tmp;
            if (!o->synthetic.empty()) {
                tmp = std::filesystem::temp_directory_path() / ("perigee-bench-" + std::to_string(getpid()));
                dir = (tmp / o->synthetic).string();
                std::filesystem::create_directories(dir);
                synth_write(o->synthetic, dir, 1);
            }
            struct cleanup {
                std::filesystem::path p;
                ~cleanup() {
                    std::error_code ec;
                    if (!p.empty()) std::filesystem::remove_all(p, ec);
                }
            } clean{tmp};
            runner_options ro;
            ro.n_slots = *std::max_element(batches.begin(), batches.end());
            ro.max_tokens = o->prompt_len + o->decode;
            ro.backend = o->backend;
            ro.forward.bf16_inputs_min_tokens = o->bf16_inputs;
            model_runner r(dir, ro);
            if (o->budget == 0) o->budget = r.be().step_tokens_default();
            std::printf("bench: %s, backend %s, prompt %d, decode %d, budget %d tokens/step\n",
                        o->synthetic.empty() ? dir.c_str() : ("synthetic " + o->synthetic).c_str(), r.be().name().c_str(),
                        o->prompt_len, o->decode, o->budget);
            std::printf("%6s %12s %10s %14s %14s %12s %16s\n", "batch", "prefill_s", "pf_steps", "decode_ms/step",
                        "decode_tok/s", "tok/step", "total_tok/s");
            (void)run_batch(r, 1, 2, 2, o->budget);   // warm-up: page in the weights
            for (int B : batches) {
                const bench_result res = run_batch(r, B, o->prompt_len, o->decode, o->budget);
                const double ms = res.decode_steps ? 1e3 * res.decode_s / double(res.decode_steps) : 0.0;
                const double tps = res.decode_s > 0 ? double(res.decode_tokens) / res.decode_s : 0.0;
                const double per_step = res.decode_steps ? double(res.decode_tokens) / double(res.decode_steps) : 0.0;
                const double total = double(res.batched_tokens) / (res.prefill_s + res.decode_s);
                std::printf("%6d %12.3f %10llu %14.2f %14.1f %12.2f %16.1f\n", B, res.prefill_s,
                            (unsigned long long)res.prefill_steps, ms, tps, per_step, total);
                std::fflush(stdout);
            }
            return 0;
        });
    }}};

} // namespace
} // namespace perigee::cli
