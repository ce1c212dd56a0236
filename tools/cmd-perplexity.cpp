// perigee perplexity: held-out perplexity with the trainer's tokenization and windowing
// (tools/train/train.py): ids = encode_ordinary(file bytes) with the model directory's tokenizer;
// windows start at 0, N, 2N, ...; each window feeds ids[s, min(s+N, n-1)) into a fresh sequence and
// scores the next token at every position, so every token 1..n-1 is predicted exactly once.
// ppl = exp(sum NLL / (n-1)); the log-softmax is taken in double over the engine's fp32 logits.
#include "command.h"
#include "core/error.h"
#include "runtime/model-runner.h"
#include "tokenizer/tiktoken_dir.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace perigee::cli {
namespace {

std::string read_all(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    PG_CHECK(f.good(), "perplexity: cannot open {}", path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Whitespace/comma separated decimal ids (the --ids-file form, for pre-tokenized input).
std::vector<int32_t> read_ids_file(const std::string & path) {
    const std::string s = read_all(path);
    std::vector<int32_t> ids;
    size_t i = 0;
    while (i < s.size()) {
        while (i < s.size() && (s[i] == ',' || std::isspace(static_cast<unsigned char>(s[i])))) ++i;
        if (i >= s.size()) break;
        size_t j = i;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        PG_CHECK(j > i && j - i < 10, "{}: byte {}: expected a token id", path, i);
        ids.push_back(int32_t(std::stol(s.substr(i, j - i))));
        i = j;
    }
    return ids;
}

struct ppl_opts {
    std::string model = default_model_dir(), file, ids_file;
    int context = 256;
    int max_windows = 0;
    bool json = false;
    std::string backend = "cpu";
};

int run(const ppl_opts & o) {
    PG_CHECK(o.file.empty() != o.ids_file.empty(), "perplexity: give exactly one of --file or --ids-file");
    PG_CHECK(o.context >= 1, "perplexity: --context must be >= 1, got {}", o.context);
    std::vector<int32_t> ids;
    if (!o.file.empty()) {
        const auto td = tok::load_tiktoken_dir(o.model);
        for (auto id : td.tok->encode_ordinary(read_all(o.file))) ids.push_back(id);
    } else {
        ids = read_ids_file(o.ids_file);
    }
    PG_CHECK(ids.size() >= 2, "perplexity: {} gives {} tokens; need at least 2", o.file.empty() ? o.ids_file : o.file,
             ids.size());
    runner_options ropt;
    ropt.backend = o.backend;
    ropt.max_tokens = o.context;
    model_runner r(o.model, ropt);
    const int64_t V = r.config().vocab_size;
    for (size_t i = 0; i < ids.size(); ++i)
        PG_CHECK(ids[i] >= 0 && ids[i] < V, "perplexity: token {} (position {}) is outside the vocabulary of {}", ids[i], i, V);
    const int64_t n = int64_t(ids.size());
    double nll = 0.0;
    int64_t scored = 0, windows = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < n - 1; s += o.context) {
        if (o.max_windows > 0 && windows >= o.max_windows) break;
        const int64_t e = std::min<int64_t>(s + o.context, n - 1);
        std::vector<int32_t> win(ids.begin() + s, ids.begin() + e);
        single_sequence seq(r);
        const tensor lg = seq.feed(win);   // [e - s, V]
        PG_CHECK(lg.shape.size() == 2 && lg.shape[0] == e - s && lg.shape[1] == V,
                 "perplexity: logits shape {} for a window of {} tokens", shape_str(lg.shape), e - s);
        for (int64_t t = 0; t < e - s; ++t) {
            const float * row = lg.as<float>() + t * V;
            double mx = -INFINITY;
            for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
            double se = 0.0;
            for (int64_t v = 0; v < V; ++v) se += std::exp(double(row[v]) - mx);
            const double lp = double(row[ids[size_t(s + t + 1)]]) - mx - std::log(se);
            PG_CHECK(std::isfinite(lp), "perplexity: non-finite log-probability at position {}", s + t);
            nll -= lp;
            ++scored;
        }
        ++windows;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double loss = nll / double(scored);
    if (o.json) {
        nlohmann::json j = {{"tokens", n}, {"tokens_scored", scored}, {"windows", windows}, {"context", o.context},
                            {"nll_sum", nll}, {"loss", loss}, {"ppl", std::exp(loss)},
                            {"tokens_per_second", double(scored) / std::max(secs, 1e-9)}};
        std::printf("%s\n", j.dump(1).c_str());
    } else {
        std::printf("perplexity %.4f (mean NLL %.5f nats over %lld tokens, %lld windows of <= %d; %.1f tokens/s)\n",
                    std::exp(loss), loss, (long long)scored, (long long)windows, o.context,
                    double(scored) / std::max(secs, 1e-9));
    }
    return 0;
}

command_registrar reg{{"perplexity", "held-out perplexity of a text file (trainer's tokenization and windowing)",
    [](CLI::App & sub) {
        auto o = std::make_shared<ppl_opts>();
        sub.add_option("--model", o->model, "model directory")->capture_default_str();
        sub.add_option("--file", o->file, "text file, encoded with the model's tokenizer (no special tokens)");
        sub.add_option("--ids-file", o->ids_file, "pre-tokenized input: decimal ids separated by spaces/commas");
        sub.add_option("--context", o->context, "window length N (tokens fed per fresh sequence)")->capture_default_str();
        sub.add_option("--max-windows", o->max_windows, "stop after this many windows (0 = all)");
        sub.add_flag("--json", o->json, "print a JSON record");
        sub.add_option("--backend", o->backend, "backend: cpu or cuda (the runner errors on a name this build lacks)")->capture_default_str();
        return std::function<int()>([o] { return run(*o); });
    }}};

} // namespace
} // namespace perigee::cli
