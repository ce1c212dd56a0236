// NVFP4 decode and the lossless MXFP4 -> NVFP4 repack (ARCHITECTURE §3.8, trap 32; RELIABILITY §B3 C-03..C-07).
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>

using namespace perigee;

namespace {

// Bitwise equality of two F32 tensors; returns the first differing index or -1.
int64_t first_diff(const tensor & a, const tensor & b) {
    if (a.shape != b.shape) return 0;
    for (int64_t i = 0; i < a.numel(); ++i)
        if (std::memcmp(a.f32() + i, b.f32() + i, 4) != 0) return i;
    return -1;
}

std::string error_of(const std::function<void()> & f) {
    try { f(); } catch (const perigee::error & e) { return e.what(); }
    return "";
}

struct mx { tensor packed, scale; };

// A random MXFP4 matrix: block exponents drawn from [e_lo, e_hi] (both ends used at least once), random
// codes, and a fraction of all-zero blocks (codes 0 and 8 only) whose scale byte is anything but 0xFF.
mx random_mxfp4(std::mt19937 & rng, int64_t out, int64_t in, int e_lo, int e_hi, double zero_frac) {
    mx m{tensor_new(dtype::U8, {out, in / 2}), tensor_new(dtype::U8, {out, in / 32})};
    auto * p = m.packed.as<uint8_t>();
    auto * s = m.scale.as<uint8_t>();
    const int64_t nb = out * (in / 32);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t b = 0; b < nb; ++b) {
        const bool zero = b >= 2 && u(rng) < zero_frac;
        int e = e_lo + int(rng() % uint32_t(e_hi - e_lo + 1));
        if (b == 0) e = e_lo;
        if (b == 1) e = e_hi;
        s[b] = zero ? uint8_t(rng() % 255) : uint8_t(e + 127);
        for (int i = 0; i < 16; ++i) {
            uint8_t lo = uint8_t(rng() % 16), hi = uint8_t(rng() % 16);
            if (zero) { lo &= 8; hi &= 8; }   // +0 / -0 only
            p[b * 16 + i] = uint8_t(lo | (hi << 4));
        }
        if (!zero) p[b * 16] |= 0x07;   // at least one nonzero nibble (6.0)
    }
    return m;
}

} // namespace

TEST(nvfp4, e4m3_powers_of_two) {
    int count = 0;
    for (int k = -9; k <= 8; ++k, ++count) EXPECT_EQ(f8_e4m3_to_f32(e4m3_pow2(k)), std::ldexp(1.0f, k)) << k;
    EXPECT_EQ(count, 18);
    EXPECT_EQ(e4m3_pow2(-9), 0x01);
    EXPECT_EQ(e4m3_pow2(-7), 0x04);
    EXPECT_EQ(e4m3_pow2(-6), 0x08);
    EXPECT_EQ(e4m3_pow2(8), 0x78);
    EXPECT_THROW(e4m3_pow2(-10), perigee::error);
    EXPECT_THROW(e4m3_pow2(9), perigee::error);
}

TEST(nvfp4, dequant_row) {
    std::vector<uint8_t> packed(8, 0), scale = {0x38 /* 1 */, 0x40 /* 2 */};
    packed[0] = 0x20;   // column 1 = 1.0
    packed[7] = 0x0F;   // column 14 = -6
    packed[4] = 0x05;   // column 8 = 3 (first 16-block)
    std::vector<float> out(16);
    nvfp4_dequant_row_ref(packed.data(), scale.data(), 0.5f, 16, out.data());
    EXPECT_EQ(out[1], 0.5f);
    EXPECT_EQ(out[8], 1.5f);
    EXPECT_EQ(out[14], -3.0f);
    EXPECT_EQ(out[0], 0.0f);
    std::vector<uint8_t> packed32(16, 0x22);
    std::vector<float> out32(32);
    nvfp4_dequant_row_ref(packed32.data(), scale.data(), 1.0f, 32, out32.data());
    EXPECT_EQ(out32[15], 1.0f);
    EXPECT_EQ(out32[16], 2.0f);   // second 16-block uses scale 1
}

// Trap 32 / C-04: the repack is bit-exact on random tensors (dequant(NVFP4) == dequant(MXFP4), every element).
TEST(nvfp4, trap32_repack_bit_exact_random) {
    std::mt19937 rng(42);
    const struct { int64_t out, in; int e_lo, e_hi; double zero; } cases[] = {
        {8, 64, -3, 3, 0.0},  {16, 128, -20, -3, 0.2},  {5, 96, 0, 0, 0.1},       // all-equal scales
        {7, 256, -10, 7, 0.3}, {3, 64, 100, 117, 0.0},  {4, 64, -127, -110, 0.2},  // span 17 at both ends
        {32, 3584 / 8, -12, 2, 0.05},
    };
    for (const auto & c : cases) {
        mx m = random_mxfp4(rng, c.out, c.in, c.e_lo, c.e_hi, c.zero);
        nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "t");
        ASSERT_TRUE(r.ok) << r.why;
        EXPECT_EQ(r.e_min, c.e_lo);
        EXPECT_EQ(r.e_max, c.e_hi);
        EXPECT_EQ(r.scale.type, dtype::F8_E4M3);
        EXPECT_EQ(r.scale.shape, (shape_t{c.out, c.in / 16}));
        EXPECT_EQ(r.packed.shape, m.packed.shape);
        EXPECT_EQ(std::memcmp(r.packed.data, m.packed.data, m.packed.nbytes), 0);   // nibbles verbatim
        EXPECT_TRUE(std::isnormal(r.global_scale));                                  // C-07
        EXPECT_EQ(r.global_scale, std::ldexp(1.0f, r.global_log2));
        const auto * sc = r.scale.as<uint8_t>();
        for (int64_t j = 0; j < r.scale.numel(); j += 2) EXPECT_EQ(sc[j], sc[j + 1]) << j;   // both halves
        tensor a = mxfp4_dequant_ref(m.packed, m.scale, "t");
        tensor b = nvfp4_dequant_ref(r.packed, r.scale, r.global_scale, "t");
        EXPECT_EQ(first_diff(a, b), -1) << c.out << "x" << c.in << " e " << c.e_lo << ".." << c.e_hi;
        // Control: one wrong scale byte must be caught by the same comparison.
        tensor bad = tensor_new(dtype::F8_E4M3, r.scale.shape);
        std::memcpy(bad.data, r.scale.data, r.scale.nbytes);
        bad.as<uint8_t>()[0] ^= 0x08;   // block 0 is nonzero by construction
        tensor b2 = nvfp4_dequant_ref(r.packed, bad, r.global_scale, "t");
        EXPECT_NE(first_diff(a, b2), -1);
        // The converter's self-check agrees in both modes, and catches the same wrong byte.
        EXPECT_EQ(nvfp4_matches_mxfp4(m.packed, m.scale, r.packed, r.scale, r.global_scale, "t", true), "");
        EXPECT_EQ(nvfp4_matches_mxfp4(m.packed, m.scale, r.packed, r.scale, r.global_scale, "t", false), "");
        EXPECT_NE(nvfp4_matches_mxfp4(m.packed, m.scale, r.packed, bad, r.global_scale, "t", true), "");
        EXPECT_NE(nvfp4_matches_mxfp4(m.packed, m.scale, r.packed, bad, r.global_scale, "t", false), "");
        EXPECT_NE(nvfp4_matches_mxfp4(m.packed, m.scale, r.packed, r.scale, r.global_scale * 2, "t", false), "");
        tensor badp = tensor_new(dtype::U8, m.packed.shape);
        std::memcpy(badp.data, m.packed.data, m.packed.nbytes);
        badp.as<uint8_t>()[0] ^= 0x01;   // block 0 is nonzero (in an all-zero block a nibble
        // change can leave the decoded +-0 unchanged, since its NVFP4 scale is 0)
        EXPECT_NE(nvfp4_matches_mxfp4(m.packed, m.scale, badp, r.scale, r.global_scale, "t", true), "");
        EXPECT_NE(nvfp4_matches_mxfp4(m.packed, m.scale, badp, r.scale, r.global_scale, "t", false), "");
    }
}

// All-zero blocks (quantisers store byte 0 = 2^-127 for them) are excluded from the range.
TEST(nvfp4, trap32_zero_blocks_excluded_from_range) {
    std::mt19937 rng(3);
    mx m = random_mxfp4(rng, 6, 128, -4, 13, 0.0);   // span 17
    auto * p = m.packed.as<uint8_t>();
    auto * s = m.scale.as<uint8_t>();
    // Blocks 5 and 9: all zero (with some -0 nibbles), scale byte 0 (e = -127), and 254 for block 11.
    for (int b : {5, 9, 11}) {
        s[b] = b == 11 ? 254 : 0;
        for (int i = 0; i < 16; ++i) p[b * 16 + i] = (i % 3 == 0) ? 0x80 : 0x00;
    }
    nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "zeros");
    ASSERT_TRUE(r.ok) << r.why;
    EXPECT_EQ(r.e_min, -4);
    EXPECT_EQ(r.e_max, 13);
    EXPECT_EQ(r.n_zero_blocks, 3);
    EXPECT_EQ(r.n_blocks, 24);
    for (int b : {5, 9, 11}) {
        EXPECT_EQ(r.scale.as<uint8_t>()[2 * b], 0x00);
        EXPECT_EQ(r.scale.as<uint8_t>()[2 * b + 1], 0x00);
    }
    EXPECT_EQ(first_diff(mxfp4_dequant_ref(m.packed, m.scale), nvfp4_dequant_ref(r.packed, r.scale, r.global_scale)), -1);
}

TEST(nvfp4, trap32_span_limits) {
    std::mt19937 rng(5);
    // 17: lossless (needs the subnormal E4M3 scales); 18 and 19: not lossless, nothing produced, reason given.
    {
        mx m = random_mxfp4(rng, 4, 64, 0, 17, 0.0);
        nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "span17");
        ASSERT_TRUE(r.ok) << r.why;
        EXPECT_TRUE(r.subnormal_scales);
        EXPECT_EQ(r.global_log2, 17 - 8);
    }
    for (int span : {18, 19}) {
        mx m = random_mxfp4(rng, 4, 64, -5, -5 + span, 0.0);
        nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "layers.3.block_sparse_moe.experts.7.w2");
        EXPECT_FALSE(r.ok) << span;
        EXPECT_TRUE(r.scale.empty());
        EXPECT_TRUE(r.packed.empty());
        EXPECT_EQ(r.e_max - r.e_min, span);
        EXPECT_NE(r.why.find("layers.3.block_sparse_moe.experts.7.w2"), std::string::npos) << r.why;
        EXPECT_NE(r.why.find(std::to_string(span) + " powers"), std::string::npos) << r.why;
    }
    // Normal-only policy: span 14 fits with normal scales, 15 does not.
    {
        mx m = random_mxfp4(rng, 4, 64, 2, 16, 0.0);
        nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "n14", true);
        ASSERT_TRUE(r.ok) << r.why;
        EXPECT_FALSE(r.subnormal_scales);
        EXPECT_EQ(first_diff(mxfp4_dequant_ref(m.packed, m.scale), nvfp4_dequant_ref(r.packed, r.scale, r.global_scale)), -1);
        mx m2 = random_mxfp4(rng, 4, 64, 2, 17, 0.0);
        EXPECT_FALSE(mxfp4_to_nvfp4(m2.packed, m2.scale, "n15", true).ok);
        EXPECT_TRUE(mxfp4_to_nvfp4(m2.packed, m2.scale, "n15", false).ok);
    }
}

// C-06 / C-07: extreme scale bytes and an all-zero tensor.
TEST(nvfp4, extremes) {
    std::mt19937 rng(9);
    for (auto [lo, hi] : {std::pair{-126, -126}, std::pair{-127, -127}, std::pair{127, 127}, std::pair{110, 127}}) {
        mx m = random_mxfp4(rng, 2, 64, lo, hi, 0.0);
        nvfp4_repack r = mxfp4_to_nvfp4(m.packed, m.scale, "x");
        ASSERT_TRUE(r.ok) << r.why;
        EXPECT_TRUE(std::isnormal(r.global_scale)) << lo;   // never an fp32 subnormal (flush-to-zero safe)
        EXPECT_EQ(first_diff(mxfp4_dequant_ref(m.packed, m.scale), nvfp4_dequant_ref(r.packed, r.scale, r.global_scale)), -1)
            << lo << ".." << hi;
    }
    // Scales 0x01 and 0xFE in one tensor: span 253, not lossless.
    mx m = random_mxfp4(rng, 2, 64, -126, 127, 0.0);
    EXPECT_FALSE(mxfp4_to_nvfp4(m.packed, m.scale, "x").ok);
    // All-zero tensor (+0, -0 nibbles; any scale bytes but 0xFF): lossless, every scale 0.
    tensor p = tensor_new(dtype::U8, {3, 32}), s = tensor_new(dtype::U8, {3, 2});
    std::memset(p.data, 0x88, p.nbytes);
    std::memset(s.data, 0x00, s.nbytes);
    s.as<uint8_t>()[1] = 200;
    nvfp4_repack r = mxfp4_to_nvfp4(p, s, "z");
    ASSERT_TRUE(r.ok);
    EXPECT_EQ(r.n_zero_blocks, 6);
    for (int64_t i = 0; i < r.scale.numel(); ++i) EXPECT_EQ(r.scale.as<uint8_t>()[i], 0);
    EXPECT_EQ(first_diff(mxfp4_dequant_ref(p, s), nvfp4_dequant_ref(r.packed, r.scale, r.global_scale)), -1);
}

// C-03: a planted 0xFF is rejected, naming tensor, row and block, even inside an all-zero block.
TEST(nvfp4, trap32_rejects_e8m0_nan) {
    std::mt19937 rng(11);
    mx m = random_mxfp4(rng, 4, 96, -2, 2, 0.0);
    m.scale.as<uint8_t>()[3 * 3 + 2] = 0xFF;
    const std::string e = error_of([&] { mxfp4_to_nvfp4(m.packed, m.scale, "experts.0.w1"); });
    EXPECT_NE(e.find("experts.0.w1"), std::string::npos) << e;
    EXPECT_NE(e.find("row 3, block 2"), std::string::npos) << e;
    std::memset(static_cast<uint8_t *>(m.packed.data) + 3 * 48 + 2 * 16, 0, 16);   // make that block all zero
    EXPECT_THROW(mxfp4_to_nvfp4(m.packed, m.scale, "experts.0.w1"), perigee::error);
}

TEST(nvfp4, validate) {
    tensor p = tensor_new(dtype::U8, {2, 16}), s = tensor_new(dtype::F8_E4M3, {2, 2});
    EXPECT_NO_THROW(nvfp4_validate(p, s, 1.0f, 2, 32, "x"));
    tensor su = tensor_new(dtype::U8, {2, 2});
    EXPECT_NE(error_of([&] { nvfp4_validate(p, su, 1.0f, 2, 32, "w"); }).find("expected F8_E4M3"), std::string::npos);
    EXPECT_THROW(nvfp4_validate(p, s, 0.0f, 2, 32, "x"), perigee::error);
    EXPECT_THROW(nvfp4_validate(p, s, NAN, 2, 32, "x"), perigee::error);
    s.as<uint8_t>()[3] = 0x7F;
    const std::string e = error_of([&] { nvfp4_validate(p, s, 1.0f, 2, 32, "w"); });
    EXPECT_NE(e.find("row 1, block 1"), std::string::npos) << e;
}
