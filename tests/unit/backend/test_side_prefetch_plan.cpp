// The placement rule of the decode graph's side-branch L2 prefetches (src/backend/cuda/side-prefetch-plan.h), on a
// machine without a GPU. The steps below are the launch patterns of the real models: the 48B's KDA + MoE layer (the
// projection group streams, the KDA tail and the norm / router / selection do not), a dense pair with nothing between,
// the embedding gather. Each rule is checked with the case that must not place a prefetch beside the one that must.
#include "backend/cuda/side-prefetch-plan.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace perigee {
namespace {

using cuda_side::launch;
using cuda_side::plan;

constexpr size_t MiB = size_t(1) << 20;

const void * addr(uintptr_t a) { return reinterpret_cast<const void *>(a); }

launch streaming(uintptr_t a, size_t bytes) {
    launch l;
    l.launched = true;
    l.reads = {{addr(a), bytes}};
    return l;
}
launch light(size_t weight_bytes = 0) {
    launch l;
    l.launched = true;
    if (weight_bytes) l.reads = {{addr(0x9000000), weight_bytes}};
    return l;
}

// One 48B KDA + MoE layer and the next layer's projections: group (58 MB) -> KDA tail -> o_proj (18.9 MB) -> norm ->
// router (1.2 MB) -> selection -> experts (shared gate, up, down: 4.7 + 4.7 + 4.7 MB) -> next group.
std::vector<launch> kda_moe_layer() {
    std::vector<launch> ls;
    ls.push_back(streaming(0x1000000, 58 * MiB));   // 0 projection group
    ls.push_back(light(64 * 1024));                  // 1 KDA tail (its low-rank weights)
    ls.push_back(streaming(0x2000000, 18 * MiB));   // 2 o_proj
    ls.push_back(light(9216));                       // 3 norm
    ls.push_back(light(1179648));                    // 4 router
    ls.push_back(light());                           // 5 selection
    launch ex;                                       // 6 experts: the shared expert's three matrices
    ex.launched = true;
    ex.reads = {{addr(0x3000000), 4718592}, {addr(0x4000000), 4718592}, {addr(0x5000000), 4718592}};
    ls.push_back(ex);
    ls.push_back(streaming(0x6000000, 58 * MiB));   // 7 next projection group (right after the experts)
    return ls;
}

TEST(side_prefetch_plan, kda_moe_layer_gets_two) {
    const auto ps = plan(kda_moe_layer(), 8 * MiB);
    ASSERT_EQ(ps.size(), 2u) << "o_proj behind the KDA tail and the experts behind norm / router / selection";
    EXPECT_EQ(ps[0].fork, 0);
    EXPECT_EQ(ps[0].target, 2);
    ASSERT_EQ(ps[0].ranges.size(), 1u);
    EXPECT_EQ(ps[0].ranges[0].first, addr(0x2000000));
    EXPECT_EQ(ps[0].ranges[0].second, 8 * MiB) << "cut at the budget";
    EXPECT_EQ(ps[1].fork, 2);
    EXPECT_EQ(ps[1].target, 6);
    ASSERT_EQ(ps[1].ranges.size(), 2u) << "4.5 MiB of gate, then 3.5 of up: the budget, in read order";
    EXPECT_EQ(ps[1].ranges[0], std::make_pair(addr(0x3000000), size_t(4718592)));
    EXPECT_EQ(ps[1].ranges[1], std::make_pair(addr(0x4000000), 8 * MiB - 4718592));
}

TEST(side_prefetch_plan, no_gap_no_prefetch) {
    // experts -> next group: streaming after streaming, nothing to fill (the layer above: no third prefetch)
    std::vector<launch> ls = {streaming(0x1000000, 8 * MiB), streaming(0x2000000, 8 * MiB)};
    EXPECT_TRUE(plan(ls, 8 * MiB).empty());
    // control: one light launch between makes it one
    ls.insert(ls.begin() + 1, light());
    const auto ps = plan(ls, 8 * MiB);
    ASSERT_EQ(ps.size(), 1u);
    EXPECT_EQ(ps[0].fork, 0);
    EXPECT_EQ(ps[0].target, 2);
}

TEST(side_prefetch_plan, first_streaming_launch_has_no_fork) {
    // embedding gather (a whole table in its reads, never streaming) -> norm -> first group
    launch gather;
    gather.launched = true;
    gather.get_rows = true;
    gather.reads = {{addr(0x7000000), 755 * MiB}};
    const std::vector<launch> ls = {gather, light(), streaming(0x1000000, 58 * MiB)};
    EXPECT_TRUE(plan(ls, 8 * MiB).empty()) << "the gather is not a fork, nor a target";
    // control: the same table read by a launch that is not a gather is streaming, so it forks one
    std::vector<launch> c = ls;
    c[0].get_rows = false;
    const auto ps = plan(c, 8 * MiB);
    ASSERT_EQ(ps.size(), 1u);
    EXPECT_EQ(ps[0].fork, 0);
}

TEST(side_prefetch_plan, thresholds_and_skips) {
    // a launch just under the streaming threshold is light, at it streaming
    std::vector<launch> ls = {streaming(0x1000000, 4 * MiB), light(4 * MiB - 1), streaming(0x2000000, 4 * MiB)};
    auto ps = plan(ls, 8 * MiB);
    ASSERT_EQ(ps.size(), 1u);
    EXPECT_EQ(ps[0].fork, 0);
    EXPECT_EQ(ps[0].target, 2);
    ls[1] = streaming(0x8000000, 4 * MiB);
    EXPECT_TRUE(plan(ls, 8 * MiB).empty()) << "at the threshold the middle launch streams: no gap";
    // nodes that launched nothing (weights, views) neither open a gap nor fork
    launch none;
    none.reads = {{addr(0x1000000), 64 * MiB}};
    ls = {streaming(0x1000000, 8 * MiB), none, streaming(0x2000000, 8 * MiB)};
    EXPECT_TRUE(plan(ls, 8 * MiB).empty());
    // budget 0: off
    EXPECT_TRUE(plan(kda_moe_layer(), 0).empty());
}

TEST(side_prefetch_plan, range_cap) {
    launch many;
    many.launched = true;
    for (int i = 0; i < 12; ++i) many.reads.push_back({addr(0x10000000 + uintptr_t(i) * 0x1000000), MiB});
    const std::vector<launch> ls = {streaming(0x1000000, 8 * MiB), light(), many};
    const auto ps = plan(ls, 64 * MiB, 4 * MiB, 8);
    ASSERT_EQ(ps.size(), 1u);
    EXPECT_EQ(ps[0].ranges.size(), 8u) << "at most max_ranges ranges (the kernel node's argument holds 8)";
    EXPECT_EQ(ps[0].ranges[7].first, addr(0x10000000 + 7 * 0x1000000));
}

} // namespace
} // namespace perigee
