// backend::sample_rows on the CPU backend and the host sampler that now shares its math
// (backend.h sample_row_reference) are bitwise the sampler before the move: old_choose below is the
// old sampler.cpp step 3, verbatim. Across random rows (with exact ties), temperatures, top-k, top-p,
// min-p and uniforms: zero mismatches; the control (a wrong temperature) must mismatch. And the
// engine's on-device branch (model_runner::force_backend_sampling on the CPU backend) generates the
// same tokens as the host sampler, seeded sampling included.
#include "backend/backend.h"
#include "ir/builder.h"
#include "rt_test_util.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>

namespace {

using namespace perigee;

// The old runtime/sampler.cpp step 3 (before sample_row_reference), verbatim but for the signature.
int32_t old_choose(const std::vector<float> & l, int64_t V, const sampling_params & sp, uint64_t seed, uint64_t draw_index) {
    if (sp.temperature == 0.0f) {
        int64_t best = 0;
        for (int64_t i = 1; i < V; ++i)
            if (l[size_t(i)] > l[size_t(best)]) best = i;
        return int32_t(best);
    }
    std::vector<int32_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)] || (l[size_t(a)] == l[size_t(b)] && a < b); };
    int64_t n = V;
    if (sp.top_k > 0 && sp.top_k < V) {
        n = sp.top_k;
        std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), better);
    } else {
        std::sort(idx.begin(), idx.end(), better);
    }
    const double inv_t = 1.0 / double(sp.temperature);
    const double mx = double(l[size_t(idx[0])]) * inv_t;
    std::vector<double> p(static_cast<size_t>(n));
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += p[size_t(i)] = std::exp(double(l[size_t(idx[size_t(i)])]) * inv_t - mx);
    for (auto & x : p) x /= sum;
    if (sp.top_p < 1.0f) {
        double c = 0.0;
        int64_t keep = n;
        for (int64_t i = 0; i < n; ++i) {
            c += p[size_t(i)];
            if (c >= double(sp.top_p)) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (sp.min_p > 0.0f) {
        const double floor = double(sp.min_p) * p[0];
        int64_t keep = 1;
        while (keep < n && p[size_t(keep)] >= floor) ++keep;
        n = keep;
    }
    double mass = 0.0;
    for (int64_t i = 0; i < n; ++i) mass += p[size_t(i)];
    const double u = sample_uniform(seed, draw_index) * mass;
    double c = 0.0;
    int32_t token = idx[size_t(n - 1)];
    for (int64_t i = 0; i < n; ++i) {
        c += p[size_t(i)];
        if (u < c) {
            token = idx[size_t(i)];
            break;
        }
    }
    return token;
}

std::vector<sampling_params> settings() {
    std::vector<sampling_params> v;
    for (float t : {0.0f, 0.3f, 1.0f, 1.7f})
        for (int k : {0, 1, 5, 300})
            for (float p : {1.0f, 0.9f, 0.4f})
                for (float m : {0.0f, 0.05f, 0.5f}) {
                    sampling_params sp;
                    sp.temperature = t;
                    sp.top_k = k;
                    sp.top_p = p;
                    sp.min_p = m;
                    v.push_back(sp);
                }
    return v;
}

// Random rows of V logits; every third row quantized to steps of 0.25 so exact ties are common.
std::vector<std::vector<float>> make_rows(int n, int64_t V, uint32_t seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> nd(0.0f, 2.5f);
    std::vector<std::vector<float>> out(static_cast<size_t>(n), std::vector<float>(static_cast<size_t>(V)));
    for (int r = 0; r < n; ++r)
        for (auto & x : out[size_t(r)]) x = r % 3 == 2 ? std::round(nd(g) * 4.0f) / 4.0f : nd(g);
    return out;
}

// Ids from backend::sample_rows on the CPU backend: the rows as a [R, V] weight leaf, scaled by 1.
std::vector<int32_t> backend_ids(backend & be, const std::vector<std::vector<float>> & rs, const std::vector<row_sampling> & s) {
    const int64_t R = int64_t(rs.size()), V = int64_t(rs[0].size());
    tensor t = tensor_new(dtype::F32, {R, V});
    for (int64_t r = 0; r < R; ++r) std::copy(rs[size_t(r)].begin(), rs[size_t(r)].end(), t.f32() + r * V);
    auto b = std::make_shared<batch>();
    b->ids = {0};
    b->seq_start = {0, 1};
    b->pos0 = {0};
    b->slot = {0};
    b->block_table = {{0}};
    b->page_size = 16;
    builder bd(b);
    graph g = bd.finish(bd.scale(bd.weight(t, "logits_leaf"), 1.0f));
    be.run(g);
    return be.sample_rows(g.logits, s);
}

TEST(sample_rows, cpu_backend_and_host_sampler_equal_the_old_sampler_bitwise) {
    const int64_t V = 1000;
    const auto rs = make_rows(6, V, 11);
    auto be = backend_cpu_init();
    int compared = 0, mismatch_host = 0, mismatch_backend = 0, control_diff = 0;
    uint64_t draw = 0;
    for (const sampling_params & sp : settings()) {
        std::vector<row_sampling> s;
        std::vector<int32_t> old_ids;
        for (size_t r = 0; r < rs.size(); ++r, ++draw) {
            const uint64_t seed = 1234 + r;
            old_ids.push_back(old_choose(rs[r], V, sp, seed, draw));
            const sample_output so = sample_token(rs[r].data(), V, sp, {}, 0, seed, draw);
            mismatch_host += so.token != old_ids.back();
            s.push_back(sampling_row(sp, seed, draw));
            // Control: the old sampler at a wrong temperature (x1.5) must pick differently somewhere.
            if (sp.temperature > 0.0f) {
                sampling_params wrong = sp;
                wrong.temperature *= 1.5f;
                control_diff += old_choose(rs[r], V, wrong, seed, draw) != old_ids.back();
            }
        }
        const std::vector<int32_t> ids = backend_ids(*be, rs, s);
        for (size_t r = 0; r < rs.size(); ++r) mismatch_backend += ids[r] != old_ids[r];
        compared += int(rs.size());
    }
    EXPECT_EQ(mismatch_host, 0) << "of " << compared;
    EXPECT_EQ(mismatch_backend, 0) << "of " << compared;
    EXPECT_GT(control_diff, 20) << "control: a 1.5x temperature should change many sampled ids";
    std::printf("[sample_rows] %d rows x settings compared: host %d, backend %d mismatches; control (T x1.5) differs on %d\n",
                compared, mismatch_host, mismatch_backend, control_diff);
}

TEST(sample_rows, non_finite_row_is_minus_one_and_the_others_sample) {
    auto rs = make_rows(3, 50, 5);
    rs[1][7] = NAN;
    auto be = backend_cpu_init();
    const std::vector<int32_t> ids = backend_ids(*be, rs, {row_sampling{}, row_sampling{}, row_sampling{1.0f, 0, 1.0f, 0.0f, 0.5}});
    EXPECT_GE(ids[0], 0);
    EXPECT_EQ(ids[1], -1);
    EXPECT_GE(ids[2], 0);
    EXPECT_EQ(ids[0], sample_row_reference(rs[0].data(), 50, row_sampling{}));
    EXPECT_THROW(backend_ids(*be, rs, {row_sampling{}}), error);   // 3 rows, 1 entry: named error
}

TEST(sample_rows, needs_host_for_logprobs_and_penalties) {
    sampling_params sp;
    EXPECT_FALSE(sampling_needs_host(sp));
    sp.logprobs = 0;
    EXPECT_TRUE(sampling_needs_host(sp));
    sp.logprobs = -1;
    sp.repetition_penalty = 1.1f;
    EXPECT_TRUE(sampling_needs_host(sp));
    sp.repetition_penalty = 1.0f;
    sp.presence_penalty = 0.5f;
    EXPECT_TRUE(sampling_needs_host(sp));
}

// The engine's backend-sampling branch (forced on the CPU backend) = the host sampler, token for token.
TEST(sample_rows, engine_backend_sampling_branch_equals_host_sampler) {
    runner_options ro;
    ro.n_slots = 4;
    ro.max_tokens = 64;
    auto run = [&](bool force, bool penalties) {
        model_runner r(rt_test::synth_model("k3-tiny"), ro);
        r.force_backend_sampling = force;
        EXPECT_EQ(r.device_sampling(), force);
        engine_options eo;
        eo.max_num_seqs = 4;
        eo.max_model_len = 64;
        std::mutex mu;   // declared before the engine: destroyed after it (an engine still stopping may call back)
        std::map<uint64_t, std::vector<int32_t>> got;
        std::vector<uint64_t> ids;
        engine e(r, eo);
        for (int q = 0; q < 4; ++q) {
            request rq;
            rq.prompt = {1, 5, 9, int32_t(20 + q)};
            rq.ignore_eos = true;
            rq.sp.max_tokens = 12;
            rq.sp.temperature = q == 0 ? 0.0f : 0.9f;
            rq.sp.top_k = q == 2 ? 8 : 0;
            rq.sp.top_p = q == 3 ? 0.8f : 1.0f;
            rq.sp.min_p = q == 3 ? 0.05f : 0.0f;
            rq.sp.seed = 77 + uint64_t(q);
            if (penalties && q == 1) rq.sp.repetition_penalty = 1.3f;   // this step batch goes to the host sampler
            ids.push_back(e.submit(rq, [&](const token_event & ev) {
                std::lock_guard lk(mu);
                if (ev.token >= 0) got[ev.request_id].push_back(ev.token);
            }));
        }
        EXPECT_TRUE(e.wait_idle(120));
        std::vector<std::vector<int32_t>> out;
        for (uint64_t id : ids) out.push_back(got[id]);
        return out;
    };
    const auto host = run(false, false), dev = run(true, false), mixed = run(true, true);
    ASSERT_EQ(host.size(), 4u);
    for (size_t q = 0; q < host.size(); ++q) {
        EXPECT_EQ(host[q].size(), 12u);
        EXPECT_EQ(host[q], dev[q]) << "request " << q;
        if (q != 1) {
            EXPECT_EQ(host[q], mixed[q]) << "request " << q;
        }
    }
    EXPECT_NE(mixed[1], host[1]) << "control: a repetition penalty must change request 1's tokens";
}

} // namespace
