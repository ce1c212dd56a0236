// Helpers shared by the model-level tests (tests/unit/model, tests/golden/kimi_linear): temporary model
// directories, checkpoint rewriting through the project's own safetensors reader/writer, the logit parity
// comparator (max|Δ| <= 1e-4 · max|ref|, ARCHITECTURE / issue 2 item 9), and running the perigee binary.
#pragma once
#include "core/error.h"
#include "core/tensor.h"
#include "ir/batch.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "model/synth.h"
#include "runtime/model-runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace perigee::test {

namespace fs = std::filesystem;

// The parity bound of issue 2 item 9 / issue 3 item 5.
inline constexpr double k_parity_rtol = 1e-4;

inline std::string repo_path(const std::string & rel) { return std::string(PERIGEE_REPO_ROOT) + "/" + rel; }

// A fresh directory under the system temp dir, removed with everything in it when the object dies.
class temp_dir {
public:
    explicit temp_dir(const std::string & tag) {
        static std::atomic<int> counter{0};
        path_ = (fs::temp_directory_path() /
                 ("perigee-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++)))
                    .string();
        fs::remove_all(path_);
        fs::create_directories(path_);
    }
    ~temp_dir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    temp_dir(const temp_dir &) = delete;
    temp_dir & operator=(const temp_dir &) = delete;
    const std::string & path() const { return path_; }
    std::string sub(const std::string & name) const { return path_ + "/" + name; }

private:
    std::string path_;
};

inline void copy_dir(const std::string & src, const std::string & dst) {
    fs::create_directories(dst);
    for (const auto & e : fs::directory_iterator(src))
        if (e.is_regular_file()) fs::copy_file(e.path(), fs::path(dst) / e.path().filename(), fs::copy_options::overwrite_existing);
}

inline std::string read_text(const std::string & path) {
    std::ifstream f(path);
    PG_CHECK(f.good(), "cannot open {}", path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}
inline void write_text(const std::string & path, const std::string & text) {
    std::ofstream f(path);
    PG_CHECK(f.good(), "cannot write {}", path);
    f << text;
}

// An owned, writable copy of a (read-only, mmapped) tensor.
inline tensor tensor_copy(const tensor & t) {
    tensor o = tensor_new(t.type, t.shape);
    PG_CHECK(o.nbytes == t.nbytes, "tensor_copy: {} bytes vs {}", o.nbytes, t.nbytes);
    if (t.nbytes) std::memcpy(o.data, t.data, t.nbytes);
    return o;
}

// Rewrites every shard of the model directory `dir` in place: `fn(items)` sees each shard's tensors as owned
// copies (in file order) and may modify, rename, remove or add entries. The index (when sharded) is rewritten
// to match. Uses only the project's safetensors reader and writer.
using shard_items = std::vector<std::pair<std::string, tensor>>;
inline void rewrite_tree(const std::string & dir, const std::function<void(shard_items &)> & fn) {
    struct shard {
        std::string file;
        shard_items items;
        std::map<std::string, std::string> meta;
    };
    std::vector<shard> shards;
    bool sharded = false;
    {
        const checkpoint ck = checkpoint::open(dir);
        sharded = ck.sharded();
        for (const auto & f : ck.files()) {
            shard s;
            s.file = f->path();
            s.meta = f->metadata();
            for (const auto & e : f->entries()) s.items.emplace_back(e.name, tensor_copy(f->view(e)));
            shards.push_back(std::move(s));
        }
    }   // all mappings released here
    std::map<std::string, std::string> weight_map;
    uint64_t total = 0;
    for (auto & s : shards) {
        fn(s.items);
        safetensors_write(s.file, s.items, s.meta);
        for (const auto & [n, t] : s.items) {
            weight_map[n] = fs::path(s.file).filename().string();
            total += t.nbytes;
        }
    }
    if (sharded) checkpoint_write_index(dir, weight_map, total);
}

// Finds a tensor in a shard's items (nullptr when absent).
inline tensor * find_item(shard_items & items, const std::string & name) {
    for (auto & [n, t] : items)
        if (n == name) return &t;
    return nullptr;
}

// Result of the logit parity comparison: max|got - want| against k_parity_rtol · max|want|.
struct parity {
    double max_abs_diff = 0, max_ref = 0;
    int64_t worst = -1;          // flat index of the largest difference
    bool finite = true;
    double ratio() const { return max_ref > 0 ? max_abs_diff / max_ref : max_abs_diff; }
    bool ok() const { return finite && max_abs_diff <= k_parity_rtol * max_ref; }
    std::string str() const {
        char buf[200];
        std::snprintf(buf, sizeof buf, "max|d|=%.3g max|ref|=%.3g ratio=%.3g (bound %.0e) at flat %lld%s", max_abs_diff,
                      max_ref, ratio(), k_parity_rtol, (long long)worst, finite ? "" : " NON-FINITE");
        return buf;
    }
};
inline parity compare_logits(const float * got, const float * want, int64_t n) {
    parity p;
    for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(got[i]) || !std::isfinite(want[i])) p.finite = false;
        p.max_ref = std::max(p.max_ref, double(std::fabs(want[i])));
        const double d = std::fabs(double(got[i]) - double(want[i]));
        if (p.worst < 0 || d > p.max_abs_diff) {
            p.max_abs_diff = d;
            p.worst = i;
        }
    }
    return p;
}
inline parity compare_logits(const tensor & got, const tensor & want) {
    EXPECT_EQ(got.shape, want.shape);
    if (got.shape != want.shape) {
        parity p;
        p.finite = false;
        return p;
    }
    return compare_logits(got.f32(), want.f32(), got.numel());
}

// Row r of a [rows, V] F32 tensor as a new [1, V] tensor.
inline tensor row_of(const tensor & t, int64_t r) {
    const int64_t V = t.shape.at(1);
    tensor o = tensor_new(dtype::F32, {1, V});
    std::memcpy(o.data, t.f32() + r * V, size_t(V) * 4);
    return o;
}
// Rows [r0, r1) as a new tensor.
inline tensor rows_of(const tensor & t, int64_t r0, int64_t r1) {
    const int64_t V = t.shape.at(1);
    tensor o = tensor_new(dtype::F32, {r1 - r0, V});
    std::memcpy(o.data, t.f32() + r0 * V, size_t((r1 - r0) * V) * 4);
    return o;
}

inline int32_t argmax_row(const tensor & logits, int64_t row) {
    const int64_t V = logits.shape.at(1);
    const float * p = logits.f32() + row * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
        if (p[i] > p[best]) best = i;
    return int32_t(best);
}

inline bool bitwise_equal(const tensor & a, const tensor & b) {
    return a.type == b.type && a.shape == b.shape && a.nbytes == b.nbytes && std::memcmp(a.data, b.data, a.nbytes) == 0;
}

inline std::vector<int32_t> ids_of(const tensor & t) {
    PG_CHECK(t.type == dtype::I32, "expected an I32 tensor, got {}", dtype_name(t.type));
    return std::vector<int32_t>(t.as<int32_t>(), t.as<int32_t>() + t.numel());
}

// Deterministic token ids in [0, vocab) (a fixed LCG, so prompts are the same on every machine).
inline std::vector<int32_t> make_ids(int n, int vocab, uint32_t seed) {
    std::vector<int32_t> v;
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int i = 0; i < n; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v.push_back(int32_t((s >> 33) % uint64_t(vocab)));
    }
    return v;
}

// Runs a one-sequence prefill on a fresh runner (slot 0, zeroed state).
inline tensor prefill(const std::string & model_dir, const std::vector<int32_t> & ids) {
    runner_options opt;
    opt.max_tokens = int(ids.size()) + 16;
    model_runner r(model_dir, opt);
    single_sequence s(r);
    return s.feed(ids);
}

// The message of the perigee::error thrown by f (empty when it does not throw).
// A parameterized test over synthetic presets (GetParam() names one): SetUp writes that preset's tree into a fresh
// temp dir (dir_) with seed k_synth_seed.
inline constexpr uint64_t k_synth_seed = 7;
class synth_tree_test : public ::testing::TestWithParam<std::string> {
protected:
    void SetUp() override {
        tmp_ = std::make_unique<temp_dir>("synth");
        dir_ = tmp_->sub(GetParam());
        synth_write(GetParam(), dir_, k_synth_seed);
    }
    std::unique_ptr<temp_dir> tmp_;
    std::string dir_;
};

inline std::string error_of(const std::function<void()> & f) {
    try {
        f();
    } catch (const perigee::error & e) {
        return e.what();
    }
    return {};
}

struct proc_result {
    int exit_code = -1;
    std::string output;   // stdout and stderr together
};
// Runs a shell command line, capturing stdout+stderr.
inline proc_result run_cmd(const std::string & cmd) {
    proc_result r;
    FILE * p = ::popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return r;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
    const int st = ::pclose(p);
    r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return r;
}

} // namespace perigee::test
