// Sampler: greedy, temperature, top-k/p, min-p, penalties, seeded draws, logprobs.
#include "core/error.h"
#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

using namespace perigee;

namespace {
const std::vector<float> L = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f};
sample_output draw(const sampling_params & sp, uint64_t seed = 1, uint64_t idx = 0, std::vector<int32_t> toks = {0}, int np = 1) {
    return sample_token(L.data(), int64_t(L.size()), sp, toks, np, seed, idx);
}
} // namespace

TEST(sampler, greedy_argmax_ties_to_lower_id) {
    sampling_params sp;
    EXPECT_EQ(draw(sp).token, 1);
}

TEST(sampler, logprobs_are_raw_log_softmax_and_top_sorted) {
    sampling_params sp;
    sp.logprobs = 3;
    sp.repetition_penalty = 2.0f;   // penalties must not change the reported logprobs
    sample_output o = draw(sp, 1, 0, {1, 3}, 2);
    double z = 0;
    for (float x : L) z += std::exp(double(x));
    EXPECT_NEAR(o.logprob, L[size_t(o.token)] - std::log(z), 1e-6);
    ASSERT_EQ(o.top_logprobs.size(), 3u);
    EXPECT_EQ(o.top_logprobs[0].first, 1);
    EXPECT_EQ(o.top_logprobs[1].first, 3);
    EXPECT_EQ(o.top_logprobs[2].first, 2);
    EXPECT_NEAR(o.top_logprobs[2].second, 2.0 - std::log(z), 1e-6);
}

TEST(sampler, seeded_draws_reproduce_and_follow_the_distribution) {
    sampling_params sp;
    sp.temperature = 1.0f;
    std::map<int, int> hist;
    for (uint64_t i = 0; i < 20000; ++i) {
        const int t = draw(sp, 42, i).token;
        EXPECT_EQ(t, draw(sp, 42, i).token);
        hist[t]++;
    }
    double z = 0;
    for (float x : L) z += std::exp(double(x));
    for (int t = 0; t < 6; ++t) EXPECT_NEAR(hist[t] / 20000.0, std::exp(double(L[size_t(t)])) / z, 0.015) << "token " << t;
    // Control: a different seed gives a different sequence of draws.
    int diff = 0;
    for (uint64_t i = 0; i < 50; ++i) diff += draw(sp, 42, i).token != draw(sp, 43, i).token;
    EXPECT_GT(diff, 0);
}

TEST(sampler, top_k_top_p_min_p_restrict_the_support) {
    sampling_params sp;
    sp.temperature = 1.0f;
    sp.top_k = 2;   // {1, 3}
    for (uint64_t i = 0; i < 200; ++i) {
        const int t = draw(sp, 7, i).token;
        EXPECT_TRUE(t == 1 || t == 3) << t;
    }
    sp.top_k = 0;
    sp.top_p = 0.05f;   // only the best token (ties: lower id first)
    for (uint64_t i = 0; i < 200; ++i) EXPECT_EQ(draw(sp, 7, i).token, 1);
    sp.top_p = 1.0f;
    sp.min_p = 0.5f;   // p >= 0.5 * p_max: tokens 1, 3 (e^-1 = 0.37 excludes 2)
    for (uint64_t i = 0; i < 200; ++i) {
        const int t = draw(sp, 7, i).token;
        EXPECT_TRUE(t == 1 || t == 3) << t;
    }
}

TEST(sampler, penalties) {
    sampling_params sp;
    sp.repetition_penalty = 4.0f;   // 1 and 3 seen: 3/4 = 0.75 -> token 2 wins
    EXPECT_EQ(draw(sp, 1, 0, {1, 3}, 2).token, 2);
    sp = {};
    sp.frequency_penalty = 0.6f;   // generated: 1 twice -> 3 - 1.2; 3 once -> 2.4 -> token 3
    EXPECT_EQ(draw(sp, 1, 0, {0, 1, 1, 3}, 1).token, 3);
    sp = {};
    sp.presence_penalty = 1.5f;   // generated 1 and 3 -> 1.5 each -> token 2
    EXPECT_EQ(draw(sp, 1, 0, {1, 3}, 0).token, 2);
    sp.presence_penalty = 1.5f;   // the prompt does not count for presence
    EXPECT_EQ(draw(sp, 1, 0, {1, 3}, 2).token, 1);
}

TEST(sampler, validation_names_the_field) {
    auto msg = [](sampling_params sp) {
        try {
            sampling_params_validate(sp);
        } catch (const error & e) {
            return std::string(e.what());
        }
        return std::string("(accepted)");
    };
    sampling_params sp;
    EXPECT_EQ(msg(sp), "(accepted)");
    sp.top_p = 0.0f;
    EXPECT_NE(msg(sp).find("sampling_params.top_p"), std::string::npos);
    sp = {};
    sp.temperature = -1.0f;
    EXPECT_NE(msg(sp).find("sampling_params.temperature"), std::string::npos);
    sp = {};
    sp.max_tokens = 0;
    EXPECT_NE(msg(sp).find("sampling_params.max_tokens"), std::string::npos);
    sp = {};
    sp.logprobs = 21;
    EXPECT_NE(msg(sp).find("sampling_params.logprobs"), std::string::npos);
    sp = {};
    sp.repetition_penalty = 0.0f;
    EXPECT_NE(msg(sp).find("sampling_params.repetition_penalty"), std::string::npos);
}
