// perigee serve: the OpenAI-compatible HTTP server (src/server) on the engine (src/runtime).
#include "chat/chat.h"
#include "command.h"
#include "core/error.h"
#include "server/fault_drill.h"
#include "server/mock_script.h"
#include "server/server.h"
#include "tokenizer/tiktoken_dir.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <memory>
#include <pthread.h>
#include <thread>

namespace perigee::cli {
namespace {

struct serve_args {
    std::string model = default_model_dir();
    server::server_options so;
    std::string api_key_file;
    bool mock = false;
    double mock_decode_s = 0.0, mock_prefill_s = 0.0;
    // 0: the backend's default (backend::step_tokens_default: cpu 512, cuda 2048; the reasons are there).
    int max_num_batched_tokens = 0;
    int bf16_inputs_tokens = 0;   // forward_options::bf16_inputs_min_tokens
    double drain_timeout_s = 30.0;
    // TEST-ONLY fault drill (server/fault_drill.h): NaN logits for prompts containing this id.
    int test_nan_token = -1, test_nan_after = 2;
    std::string backend = "cpu";
};

int run_serve(serve_args & a) {
    if (a.so.api_key.empty() && !a.api_key_file.empty()) {
        FILE * f = std::fopen(a.api_key_file.c_str(), "rb");
        PG_CHECK(f, "--api-key-file {}: cannot open", a.api_key_file);
        char buf[4096];
        const size_t n = std::fread(buf, 1, sizeof buf, f);
        std::fclose(f);
        a.so.api_key.assign(buf, n);
        while (!a.so.api_key.empty() && (a.so.api_key.back() == '\n' || a.so.api_key.back() == '\r')) a.so.api_key.pop_back();
        PG_CHECK(!a.so.api_key.empty(), "--api-key-file {}: the file is empty", a.api_key_file);
    }
    if (a.so.served_model_name.empty() || a.so.served_model_name == "default") {
        std::string m = a.model;
        while (m.size() > 1 && m.back() == '/') m.pop_back();
        a.so.served_model_name = m.substr(m.find_last_of('/') + 1);
    }
    // SIGINT / SIGTERM are taken by a watcher thread (blocked here, before any thread starts)
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

    const tok::tiktoken_dir td = tok::load_tiktoken_dir(a.model);
    const auto ct = chat::chat_template::detect(*td.tok, a.model);
    std::unique_ptr<server::gen_engine> eng;
#ifdef PERIGEE_HAVE_ENGINE
    std::unique_ptr<model_runner> runner;
    std::unique_ptr<engine> real;
#endif
    if (a.mock) {
        server::mock_options mo;
        mo.vocab = int(td.tok->n_vocab());
        mo.max_num_seqs = a.so.max_num_seqs;
        mo.max_queue = a.so.max_queue;
        mo.max_model_len = a.so.max_model_len;
        mo.decode_s_per_token = a.mock_decode_s;
        mo.prefill_s_per_token = a.mock_prefill_s;
        mo.eos_ids = ct.stop_ids();
        mo.gen_lo = 0;   // ranks 0..93 are the printable ASCII bytes in every Kimi-style rank file
        mo.gen_hi = 94;
        mo.script = server::make_mock_script(*td.tok, ct);
        eng = server::make_mock_engine(mo);
        std::fprintf(stderr, "perigee serve: MOCK engine (deterministic pseudo-random tokens; for HTTP-layer tests)\n");
    } else {
#ifdef PERIGEE_HAVE_ENGINE
        runner_options ro;
        ro.backend = a.backend;
        ro.n_slots = a.so.max_num_seqs;
        ro.max_tokens = a.so.max_model_len;
        ro.forward.bf16_inputs_min_tokens = a.bf16_inputs_tokens;
        runner = std::make_unique<model_runner>(a.model, ro);
        engine_options eo;
        eo.max_num_seqs = a.so.max_num_seqs;
        eo.max_model_len = a.so.max_model_len;
        eo.max_queue = a.so.max_queue;
        eo.max_num_batched_tokens = a.max_num_batched_tokens > 0 ? a.max_num_batched_tokens : runner->be().step_tokens_default();
        if (a.max_num_batched_tokens == 0)
            std::fprintf(stderr, "perigee serve: --max-num-batched-tokens %d (the %s backend's default)\n",
                         eo.max_num_batched_tokens, a.backend.c_str());
        if (a.bf16_inputs_tokens > 0)   // the precision differs from the default fp32-input reference: say so
            std::fprintf(stderr, "perigee serve: steps of >= %d tokens feed their Linears and experts bf16-rounded inputs"
                                 " (--bf16-inputs-tokens; ARCHITECTURE 3.0)\n", a.bf16_inputs_tokens);
        if (a.test_nan_token >= 0) {
            server::install_nan_drill(*runner, a.test_nan_token, a.test_nan_after);
            std::fprintf(stderr, "perigee serve: TEST FAULT DRILL: NaN logits for prompts containing token %d after %d tokens\n",
                         a.test_nan_token, a.test_nan_after);
        }
        real = std::make_unique<engine>(*runner, eo);
        eng = server::wrap_engine(*real);
        if (size_t(eng->vocab_size()) < td.tok->n_vocab())
            std::fprintf(stderr, "perigee serve: warning: the model's vocabulary (%d) is smaller than the tokenizer's (%zu); "
                                 "ids beyond it are refused\n", eng->vocab_size(), td.tok->n_vocab());
#else
        PG_FAIL("serve: this build has no engine (src/runtime/engine.cpp); use --mock-engine for HTTP tests");
#endif
    }
    server::http_server srv(a.so, *eng, *td.tok, ct);
    const int port = srv.bind();
    // First SIGINT/SIGTERM: graceful drain (503 to new requests and /health, accepted requests run
    // to their end for up to --drain-timeout s, then the rest are cancelled), then stop; exit 0.
    // A second signal stops at once.
    std::atomic<bool> quit{false};
    std::thread drainer;
    std::thread watcher([&srv, &quit, &drainer, sigs, t = a.drain_timeout_s] {
        for (int n = 0; !quit.load(); ++n) {
            int sig = 0;
            sigwait(&sigs, &sig);
            if (quit.load()) break;
            if (n == 0) {
                std::fprintf(stderr, "perigee serve: signal %d, draining (%d in flight, up to %.1f s; again to stop now)\n", sig,
                             srv.in_flight(), t);
                std::fflush(stderr);
                drainer = std::thread([&srv, t] {
                    const bool clean = srv.drain(t);
                    std::fprintf(stderr, "perigee serve: drained (%s), stopping\n",
                                 clean ? "every request finished" : "timeout: the rest were cancelled");
                    std::fflush(stderr);
                    srv.stop();
                });
            } else {
                std::fprintf(stderr, "perigee serve: signal %d again, stopping now\n", sig);
                srv.stop();
                break;
            }
        }
    });
    std::fprintf(stderr, "perigee serve: model %s (%s chat format), max_model_len %d, max_num_seqs %d\n",
                 a.so.served_model_name.c_str(), chat::chat_format_name(ct.format()), a.so.max_model_len, a.so.max_num_seqs);
    std::fprintf(stderr, "Listening on http://%s:%d (OpenAI API at /v1)\n", a.so.host.c_str(), port);
    std::fflush(stderr);
    srv.listen();
    srv.stop();
    quit = true;
    pthread_kill(watcher.native_handle(), SIGTERM);
    watcher.join();
    if (drainer.joinable()) drainer.join();
    return 0;
}

command_registrar reg{{"serve", "OpenAI-compatible HTTP server (chat, completions, streaming, tools, metrics)",
    [](CLI::App & sub) {
        auto a = std::make_shared<serve_args>();
        sub.add_option("--model,-m", a->model, "model directory (weights + tiktoken.model + tokenizer_config.json)")->capture_default_str();
        sub.add_option("--host", a->so.host, "address to listen on")->capture_default_str();
        sub.add_option("--backend", a->backend, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        sub.add_option("--port", a->so.port, "port (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
        sub.add_option("--api-key", a->so.api_key, "require 'Authorization: Bearer KEY' (env PERIGEE_API_KEY)")->envname("PERIGEE_API_KEY");
        sub.add_option("--api-key-file", a->api_key_file, "read the API key from a file");
        sub.add_option("--max-num-seqs", a->so.max_num_seqs, "concurrent sequences")->capture_default_str()->check(CLI::Range(1, 4096));
        sub.add_option("--max-model-len,-c", a->so.max_model_len, "prompt + generated tokens per sequence")->capture_default_str()->check(CLI::Range(2, 1 << 24));
        sub.add_option("--max-queue", a->so.max_queue, "waiting requests before 503")->capture_default_str()->check(CLI::Range(1, 1 << 16));
        sub.add_option("--max-num-batched-tokens", a->max_num_batched_tokens, "per-step token budget (0: the backend's default, cpu 512, cuda 2048)")->capture_default_str()->check(CLI::Range(0, 1 << 20));
        sub.add_option("--bf16-inputs-tokens", a->bf16_inputs_tokens, "steps of at least this many tokens feed their Linears and experts bf16-rounded inputs (ARCHITECTURE 3.0's precision; faster prefill on cuda); 0: never, else >= 2")->capture_default_str()->check(CLI::Range(0, 1 << 20));
        sub.add_option("--served-model-name,--alias", a->so.served_model_name, "model id in the API (default: the directory name)");
        sub.add_option("--sse-ping-interval", a->so.ping_interval_s, "seconds between ': ping' comments on an idle stream")->capture_default_str();
        sub.add_option("--max-body-size", a->so.max_body_bytes, "largest request body in bytes (413 beyond)")->capture_default_str();
        sub.add_option("--timeout", a->so.read_timeout_s, "socket read timeout in seconds")->capture_default_str();
        sub.add_option("--http-threads", a->so.http_threads, "HTTP worker threads (0 = max-num-seqs + max-queue + 8)")->capture_default_str();
        sub.add_option("--drain-timeout", a->drain_timeout_s, "on SIGTERM/SIGINT: seconds accepted requests may take to finish")
            ->capture_default_str()->check(CLI::Range(0.0, 86400.0));
        sub.add_flag("--no-webui", [a](int64_t) { a->so.webui = false; }, "do not serve the chat page at /");
        sub.add_flag("--no-thinking", [a](int64_t) { a->so.default_thinking = false; }, "chat: thinking off unless a request turns it on");
        sub.add_flag("--mock-engine", a->mock, "TEST ONLY (hidden): a deterministic mock engine instead of the model (HTTP-layer tests; needs only the tokenizer files)")->group("");
        sub.add_option("--mock-decode-s", a->mock_decode_s, "mock engine: seconds per decoded token")->group("");
        sub.add_option("--mock-prefill-s", a->mock_prefill_s, "mock engine: seconds per prompt token")->group("");
        // TEST-ONLY (hidden): the fault drills' NaN injection (server/fault_drill.h).
        sub.add_option("--test-nan-token", a->test_nan_token, "TEST ONLY: NaN logits for prompts containing this id")->group("");
        sub.add_option("--test-nan-after", a->test_nan_after, "TEST ONLY: ... after this many generated tokens")->group("");
        return std::function<int()>([a] { return run_serve(*a); });
    }}};

} // namespace
} // namespace perigee::cli
