// The CUDA backend's host-side routing rules (src/backend/cuda/fuse-plan.h), checked on a machine without a GPU: the
// header is host-only, so CI runs these while the kernels they choose between run only on the GPU machine.
//  gemv_takes: which LINEARs run on the GEMV path (the rule run_linear and the fuse planner share). 1-2 tokens always
//  (up to gemv_max_tokens); from 3 tokens only while T x K <= gemv_max_elems (0: no bound); F16 weights at any T.
//  Each boundary is checked on both sides, so a rule moved by one token or one element fails here.
#include "backend/cuda/fuse-plan.h"

#include <gtest/gtest.h>

namespace perigee {
namespace {

TEST(cuda_fuse_rules, gemv_takes_defaults) {
    const cuda_options o;   // the shipped defaults
    ASSERT_EQ(o.gemv_max_elems, 12288) << "the default this test's boundaries are written for";
    // K3's 7168-wide rows: GEMV at 1-2 tokens, cuBLASLt from 3 (3 x 7168 > 12288)
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 1, 7168, false));
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 2, 7168, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, 3, 7168, false));
    // the 48B's 2304-wide rows: GEMV to 5 tokens (5 x 2304 = 11520), cuBLASLt from 6 (13824)
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 5, 2304, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, 6, 2304, false));
    // 4096-wide rows: GEMV at 3 tokens (12288, the bound itself), cuBLASLt from 4; one more element at 3 tokens does not stay
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 3, 4096, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, 4, 4096, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, 3, 4097, false));
    // F16 weights: the GEMV path at any T (no F16 cuBLASLt LINEAR)
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 64, 7168, true));
}

TEST(cuda_fuse_rules, gemv_takes_options) {
    cuda_options o;
    o.gemv_max_elems = 0;   // no bound: session 16's rule, tokens only
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, o.gemv_max_tokens, 7168, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, o.gemv_max_tokens + 1, 7168, false));
    o.gemv_max_elems = 16384;
    o.gemv_max_tokens = 2;   // every 3+ token LINEAR on cuBLASLt, whatever its width
    EXPECT_TRUE(cuda_fuse::gemv_takes(o, 2, 64, false));
    EXPECT_FALSE(cuda_fuse::gemv_takes(o, 3, 64, false));
    // control that must fail: the boundary cases above with the rule's comparison reversed give other answers
    const auto reversed = [](const cuda_options & p, int64_t T, int64_t K) {
        return T <= 2 || p.gemv_max_elems <= 0 || T * K < p.gemv_max_elems;   // strict: a plausible off-by-one
    };
    const cuda_options d;
    EXPECT_NE(reversed(d, 3, 4096), cuda_fuse::gemv_takes(d, 3, 4096, false))
        << "control: a strict bound must disagree with the rule at T x K == gemv_max_elems";
}

} // namespace
} // namespace perigee
