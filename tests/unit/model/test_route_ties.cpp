// The router's near-tie rule (model/route-ties.h), which perigee compare-backends applies where the CUDA backend's
// MOE_ROUTE ids differ from the CPU's. One-dimensional router inputs make every score a chosen number: h = [1], gate
// row e = [logit e], sigmoid scores. Each accepted case has a decided twin that must FAIL:
//  - ungrouped: a boundary pair 1e-6 apart in logit is a near tie; the worst expert in place of a picked one is not;
//    ids out of range or repeated are refused.
//  - grouped (4 groups of 2, keep 2): the other side keeps another group whose score is 1e-6 (in logit) behind the
//    CPU's last kept group and picks the CPU's top-k inside its groups: accepted; the same with the groups 1 apart:
//    FAILS; ids spread over more groups than are kept: refused; within the same groups, an expert-level near tie:
//    accepted.
//  - inputs: a group gap of 2e-4 in score is decided on identical inputs and a near tie when the other side's h is 1%
//    off (the bound grows with the inputs' difference); an exact tie on identical inputs must be resolved the same way
//    by both sides (lower id), so taking the other group is not accepted.
#include "model/route-ties.h"

#include <gtest/gtest.h>

#include <vector>

namespace perigee::test {
namespace {

struct router {
    tensor gate;
    explicit router(const std::vector<float> & logits) : gate(tensor_new(dtype::F32, {int64_t(logits.size()), 1})) {
        for (size_t e = 0; e < logits.size(); ++e) gate.as<float>()[e] = logits[e];
    }
    route_tie check(const std::vector<int32_t> & a, const std::vector<int32_t> & b, float h_b = 1.0f, int64_t n_group = 1,
                    int64_t topk_group = 1) const {
        const float h_a = 1.0f;
        return route_near_tie(a.data(), b.data(), int64_t(a.size()), &h_a, &h_b, gate, nullptr, router_act::SIGMOID, n_group,
                              topk_group);
    }
};

void expect(const char * name, const route_tie & r, bool tie, bool refused = false) {
    std::printf("[route-ties/%s] %s gap %.3e bound %.3e delta %.3e: %s (want %s)\n", name, r.what.c_str(), r.gap, r.bound, r.delta,
                r.refused ? "refused" : r.tie ? "near tie" : "decided", refused ? "refused" : tie ? "near tie" : "decided");
    EXPECT_EQ(r.tie, tie) << name;
    EXPECT_EQ(r.refused, refused) << name;
}

TEST(route_ties, ungrouped) {
    const router r({2.0f, 1.0f + 1e-6f, 1.0f, 0.0f});
    expect("boundary-pair", r.check({0, 1}, {0, 2}), true);
    expect("boundary-pair/other-order", r.check({0, 1}, {1, 0}), false);   // 2.0 vs 1.0: decided
    expect("control/worst-expert", r.check({0, 1}, {0, 3}), false);
    expect("refused/repeated", r.check({0, 1}, {0, 0}), false, true);
    expect("refused/out-of-range", r.check({0, 1}, {0, 4}), false, true);
}

TEST(route_ties, grouped) {
    // groups {0,1} {2,3} {4,5} {6,7}; the CPU keeps groups 0 and 1 and picks 0 and 2
    const router near({3.0f, -5.0f, 1.0f + 1e-6f, -5.0f, 1.0f, -5.0f, -5.0f, -5.0f});
    expect("group-near-tie", near.check({0, 2}, {0, 4}, 1.0f, 4, 2), true);
    const router apart({3.0f, -5.0f, 2.0f, -5.0f, 1.0f, -5.0f, -5.0f, -5.0f});
    expect("control/group-decided", apart.check({0, 2}, {0, 4}, 1.0f, 4, 2), false);
    expect("refused/three-groups", near.check({0, 2, 3}, {0, 2, 4}, 1.0f, 4, 2), false, true);
    // inside the same kept groups (0 and 1): experts 1 and 2 1e-6 apart
    const router inner({3.0f, 1.0f + 1e-6f, 1.0f, -5.0f, -5.0f, -5.0f, -5.0f, -5.0f});
    expect("expert-near-tie-in-groups", inner.check({0, 1}, {0, 2}, 1.0f, 4, 2), true);
    expect("control/expert-decided-in-groups", inner.check({0, 1}, {0, 3}, 1.0f, 4, 2), false);
}

TEST(route_ties, input_difference_and_exact_ties) {
    // group 1 ahead of group 2 by ~2e-4 in score (logit 1e-3): decided on identical inputs, a near tie with h 1% off
    const router r({3.0f, -5.0f, 1.0f + 1e-3f, -5.0f, 1.0f, -5.0f, -5.0f, -5.0f});
    expect("control/identical-inputs", r.check({0, 2}, {0, 4}, 1.0f, 4, 2), false);
    expect("inputs-one-percent-off", r.check({0, 2}, {0, 4}, 1.01f, 4, 2), true);
    // groups 1 and 2 exactly equal: both sides keep the lower id on identical inputs
    const router exact({3.0f, -5.0f, 1.0f, -5.0f, 1.0f, -5.0f, -5.0f, -5.0f});
    expect("control/exact-tie-identical-inputs", exact.check({0, 2}, {0, 4}, 1.0f, 4, 2), false);
}

} // namespace
} // namespace perigee::test
