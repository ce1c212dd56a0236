// Helpers for the runtime tests that run a model: synthetic checkpoints made in-process
// (synth_write into a temp dir, once per preset per test binary) and a small driver that feeds
// sequences chunk by chunk through model_runner::step on chosen slots and pages.
#pragma once
#include "model/synth.h"
#include "runtime/model-runner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

namespace rt_test {

using namespace perigee;

inline const std::string & synth_model(const std::string & preset) {
    static std::map<std::string, std::string> dirs;
    auto it = dirs.find(preset);
    if (it != dirs.end()) return it->second;
    const auto dir = std::filesystem::temp_directory_path() / ("perigee-rt-" + std::to_string(getpid())) / preset;
    std::filesystem::create_directories(dir);
    synth_write(preset, dir.string(), 7);
    static struct cleanup {
        ~cleanup() {
            std::error_code ec;
            std::filesystem::remove_all(std::filesystem::temp_directory_path() / ("perigee-rt-" + std::to_string(getpid())), ec);
        }
    } c;
    return dirs[preset] = dir.string();
}

// A sequence driven by hand: its tokens, slot, pages (preassigned) and how many are cached.
struct sim_seq {
    std::vector<int32_t> tokens;
    int32_t slot = 0;
    std::vector<int32_t> pages;
    int32_t n_cached = 0;
    std::vector<std::vector<float>> rows;   // logits of every position fed so far
};

// One step feeding `n` tokens of each listed sequence; appends the logits rows to each.
inline void feed(model_runner & r, const std::vector<std::pair<sim_seq *, int>> & items) {
    auto b = std::make_shared<batch>();
    b->page_size = r.state().page_size;
    b->seq_start = {0};
    for (auto [s, n] : items) {
        b->ids.insert(b->ids.end(), s->tokens.begin() + s->n_cached, s->tokens.begin() + s->n_cached + n);
        b->seq_start.push_back(int32_t(b->ids.size()));
        b->pos0.push_back(s->n_cached);
        b->slot.push_back(s->slot);
        b->block_table.push_back(s->pages);
    }
    tensor lg = r.step(b);
    const int64_t V = lg.dim(1);
    int64_t row = 0;
    for (auto [s, n] : items) {
        for (int i = 0; i < n; ++i, ++row) s->rows.emplace_back(lg.f32() + row * V, lg.f32() + (row + 1) * V);
        s->n_cached += n;
    }
}

inline std::vector<int32_t> pages_range(int first, int n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) p[size_t(i)] = first + i;
    return p;
}

// max |a - b| / max |b| over one row (relative to the row's scale).
inline double rel_diff(const std::vector<float> & a, const std::vector<float> & b) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < a.size(); ++i) {
        num = std::max(num, double(std::fabs(a[i] - b[i])));
        den = std::max(den, double(std::fabs(b[i])));
    }
    return std::isfinite(num) ? num / den : INFINITY;
}

inline int argmax(const std::vector<float> & v) { return int(std::max_element(v.begin(), v.end()) - v.begin()); }

inline std::vector<int32_t> random_prompt(int n, uint32_t seed, int vocab = 240) {
    std::vector<int32_t> p;
    uint32_t x = seed * 2654435761u + 12345u;
    for (int i = 0; i < n; ++i) {
        x = x * 1664525u + 1013904223u;
        p.push_back(int32_t((x >> 8) % uint32_t(vocab)));
    }
    return p;
}

// Worst relative difference between all rows of a and b (same number of rows).
inline double worst_rel(const sim_seq & a, const sim_seq & b) {
    EXPECT_EQ(a.rows.size(), b.rows.size());
    double w = 0;
    for (size_t i = 0; i < std::min(a.rows.size(), b.rows.size()); ++i) w = std::max(w, rel_diff(a.rows[i], b.rows[i]));
    return w;
}

} // namespace rt_test
