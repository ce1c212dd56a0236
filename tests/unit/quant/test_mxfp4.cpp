// MXFP4 scalar codecs (ARCHITECTURE §2.5, §3.8; trap 30).
#include "quant/mxfp4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <random>
#include <vector>

using namespace perigee;

namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Bitwise comparison of two float arrays; returns the first differing index or -1.
int64_t first_diff(const float * a, const float * b, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (!same_bits(a[i], b[i])) return i;
    return -1;
}

} // namespace

TEST(mxfp4, e2m1_table) {
    const float want[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int c = 0; c < 16; ++c) {
        EXPECT_TRUE(same_bits(e2m1_to_f32(uint8_t(c)), want[c])) << "code " << c;
        EXPECT_EQ(f32_to_e2m1(want[c]), c) << "value " << want[c];
    }
    EXPECT_TRUE(std::signbit(e2m1_to_f32(8)));   // code 8 is -0, not +0
}

TEST(mxfp4, e2m1_round_to_nearest_even_and_saturate) {
    // Midpoints go to the even code (even mantissa bit).
    EXPECT_EQ(f32_to_e2m1(0.25f), 0);   // 0 | 0.5
    EXPECT_EQ(f32_to_e2m1(0.75f), 2);   // 0.5 | 1
    EXPECT_EQ(f32_to_e2m1(1.25f), 2);   // 1 | 1.5
    EXPECT_EQ(f32_to_e2m1(1.75f), 4);   // 1.5 | 2
    EXPECT_EQ(f32_to_e2m1(2.5f), 4);    // 2 | 3
    EXPECT_EQ(f32_to_e2m1(3.5f), 6);    // 3 | 4
    EXPECT_EQ(f32_to_e2m1(5.0f), 6);    // 4 | 6
    EXPECT_EQ(f32_to_e2m1(0.26f), 1);
    EXPECT_EQ(f32_to_e2m1(5.01f), 7);
    EXPECT_EQ(f32_to_e2m1(100.0f), 7);  // saturates at 6
    EXPECT_EQ(f32_to_e2m1(-100.0f), 15);
    EXPECT_EQ(f32_to_e2m1(-0.1f), 8);   // sign kept: -0
}

TEST(mxfp4, e8m0) {
    EXPECT_EQ(e8m0_to_f32(127), 1.0f);
    EXPECT_EQ(e8m0_to_f32(128), 2.0f);
    EXPECT_EQ(e8m0_to_f32(126), 0.5f);
    EXPECT_EQ(e8m0_to_f32(254), std::ldexp(1.0f, 127));
    // Byte 0 is 2^-127 (an fp32 subnormal), not zero.
    const float z = e8m0_to_f32(0);
    EXPECT_GT(z, 0.0f);
    EXPECT_EQ(z, std::ldexp(1.0f, -127));
    EXPECT_EQ(z * 2.0f, std::ldexp(1.0f, -126));
    EXPECT_TRUE(std::isnan(e8m0_to_f32(0xFF)));
    for (int b = 0; b < 255; ++b) EXPECT_EQ(std::ilogb(e8m0_to_f32(uint8_t(b))), b - 127) << b;
}

// A planted value in column 1 must come out at column 1 (low nibble = even column).
TEST(mxfp4, trap30_nibble_order) {
    std::vector<uint8_t> packed(16, 0), scale(1, 127);
    packed[0] = uint8_t(2 << 4);   // code 2 (= 1.0) in the high nibble of byte 0 = column 1
    std::vector<float> out(32);
    mxfp4_dequant_row_ref(packed.data(), scale.data(), 32, out.data());
    std::vector<float> want(32, 0.0f);
    want[1] = 1.0f;
    EXPECT_EQ(first_diff(out.data(), want.data(), 32), -1);

    // Control: a decoder with the nibble order swapped (high nibble = even column) must fail the same check.
    std::vector<float> swapped(32);
    for (int c = 0; c < 32; ++c) {
        const uint8_t code = (c % 2 == 0) ? (packed[c / 2] >> 4) : (packed[c / 2] & 0x0F);
        swapped[c] = e2m1_to_f32(code) * e8m0_to_f32(scale[0]);
    }
    EXPECT_NE(first_diff(swapped.data(), want.data(), 32), -1);

    // The encoder agrees: a value planted at column 1 lands in the high nibble of byte 0.
    std::vector<float> in(32, 0.0f);
    in[1] = 4.0f;
    mxfp4_quantize_row_ref(in.data(), 32, packed.data(), scale.data());
    EXPECT_EQ(packed[0] & 0x0F, 0);
    EXPECT_NE(packed[0] >> 4, 0);
}

// Scale byte g covers columns 32g..32g+31 of its own row.
TEST(mxfp4, trap30_scale_groups_along_input) {
    const int64_t out = 2, in = 64;
    tensor p = tensor_new(dtype::U8, {out, in / 2}), s = tensor_new(dtype::U8, {out, in / 32});
    std::memset(p.data, 0x22, p.nbytes);              // every element 1.0
    auto * sb = s.as<uint8_t>();
    sb[0] = 127; sb[1] = 128; sb[2] = 129; sb[3] = 130;   // row 0: 1, 2; row 1: 4, 8
    tensor w = mxfp4_dequant_ref(p, s, "t");
    ASSERT_EQ(w.shape, (shape_t{out, in}));
    const float * f = w.f32();
    for (int64_t r = 0; r < out; ++r)
        for (int64_t c = 0; c < in; ++c)
            EXPECT_EQ(f[r * in + c], std::ldexp(1.0f, int(r * 2 + c / 32))) << r << "," << c;
}

// quantize -> dequantize is the identity on values MXFP4 represents exactly.
TEST(mxfp4, quantize_dequantize_round_trip_exact) {
    std::mt19937 rng(1234);
    const int64_t n = 32 * 40;
    std::vector<float> in(n);
    std::vector<uint8_t> want_scale(n / 32);
    for (int64_t b = 0; b < n / 32; ++b) {
        const int e = int(rng() % 61) - 30 + (b == 0 ? -97 : 0) + (b == 1 ? 100 : 0);   // incl. extremes
        want_scale[b] = uint8_t(e + 127);
        for (int i = 0; i < 32; ++i) in[b * 32 + i] = std::ldexp(e2m1_to_f32(uint8_t(rng() % 16)), e);
        // One element of magnitude 4 or 6 pins the shared exponent to e (floor(log2 max) - 2 == e).
        in[b * 32 + rng() % 32] = std::ldexp(e2m1_to_f32(uint8_t((rng() % 2 ? 6 : 7) | (rng() % 2 ? 8 : 0))), e);
    }
    std::vector<uint8_t> packed(n / 2), scale(n / 32);
    mxfp4_quantize_row_ref(in.data(), n, packed.data(), scale.data());
    EXPECT_EQ(scale, want_scale);
    std::vector<float> out(n);
    mxfp4_dequant_row_ref(packed.data(), scale.data(), n, out.data());
    EXPECT_EQ(first_diff(out.data(), in.data(), n), -1);

    // Control: the comparison notices a one-nibble change.
    packed[7] ^= 0x10;
    mxfp4_dequant_row_ref(packed.data(), scale.data(), n, out.data());
    EXPECT_NE(first_diff(out.data(), in.data(), n), -1);
}

TEST(mxfp4, quantize_error_bound_and_zero_block) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 0.02f);
    const int64_t n = 32 * 16;
    std::vector<float> in(n);
    for (auto & x : in) x = nd(rng);
    for (int i = 0; i < 32; ++i) in[3 * 32 + i] = 0.0f;   // block 3 all zero
    std::vector<uint8_t> packed(n / 2), scale(n / 32);
    mxfp4_quantize_row_ref(in.data(), n, packed.data(), scale.data());
    EXPECT_EQ(scale[3], 0);
    std::vector<float> out(n);
    mxfp4_dequant_row_ref(packed.data(), scale.data(), n, out.data());
    for (int64_t b = 0; b < n / 32; ++b) {
        const float unit = e8m0_to_f32(scale[b]);   // values are x/unit in [0, 8); E2M1 spacing <= 2 there
        for (int i = 0; i < 32; ++i) {
            const float x = in[b * 32 + i], y = out[b * 32 + i];
            EXPECT_LE(std::fabs(x - y), 2.0f * unit) << b << "," << i;   // incl. saturation 6..8
            if (std::fabs(x) / unit <= 6.0f) { EXPECT_LE(std::fabs(x - y), 1.0f * unit) << b << "," << i; }
        }
    }
    std::vector<float> bad(32, 1.0f);
    bad[5] = NAN;
    EXPECT_THROW(mxfp4_quantize_row_ref(bad.data(), 32, packed.data(), scale.data()), perigee::error);
}

TEST(mxfp4, matrix_quantize_helper) {
    tensor w = tensor_new(dtype::F32, {3, 64});
    for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = e2m1_to_f32(uint8_t(i % 16)) * 0.25f;
    mxfp4_matrix m = mxfp4_quantize_ref(w);
    EXPECT_EQ(m.packed.shape, (shape_t{3, 32}));
    EXPECT_EQ(m.scale.shape, (shape_t{3, 2}));
    tensor d = mxfp4_dequant_ref(m.packed, m.scale, "w");
    EXPECT_EQ(first_diff(d.f32(), w.f32(), w.numel()), -1);
}

static std::string error_of(const std::function<void()> & f) {
    try { f(); } catch (const perigee::error & e) { return e.what(); }
    return "";
}

TEST(mxfp4, validate) {
    tensor p = tensor_new(dtype::U8, {4, 32}), s = tensor_new(dtype::U8, {4, 2});
    EXPECT_NO_THROW(mxfp4_validate(p, s, 4, 64, "x"));
    // C-01: dtypes, naming both tensors' roles.
    tensor pb = tensor_new(dtype::BF16, {4, 32});
    EXPECT_NE(error_of([&] { mxfp4_validate(pb, s, 4, 64, "layers.1.w1"); }).find("layers.1.w1"), std::string::npos);
    tensor sf = tensor_new(dtype::F32, {4, 2});
    EXPECT_NE(error_of([&] { mxfp4_validate(p, sf, 4, 64, "x"); }).find("weight_scale is F32"), std::string::npos);
    tensor se = tensor_new(dtype::F8_E8M0, {4, 2});
    EXPECT_NO_THROW(mxfp4_validate(p, se, 4, 64, "x"));
    // C-02: shapes, K % 32.
    tensor s3 = tensor_new(dtype::U8, {4, 3});
    const std::string e2 = error_of([&] { mxfp4_validate(p, s3, 4, 64, "pair"); });
    EXPECT_NE(e2.find("pair"), std::string::npos);
    EXPECT_NE(e2.find("[4, 3]"), std::string::npos);
    tensor p48 = tensor_new(dtype::U8, {4, 24}), s48 = tensor_new(dtype::U8, {4, 1});
    EXPECT_THROW(mxfp4_validate(p48, s48, 4, 48, "x"), perigee::error);
    // C-03: 0xFF names tensor, row and block; 0x00 is fine.
    s.as<uint8_t>()[2 * 2 + 1] = 0xFF;
    const std::string e3 = error_of([&] { mxfp4_validate(p, s, 4, 64, "experts.3.w2"); });
    EXPECT_NE(e3.find("experts.3.w2"), std::string::npos) << e3;
    EXPECT_NE(e3.find("row 2, block 1"), std::string::npos) << e3;
    EXPECT_THROW(mxfp4_dequant_ref(p, s, "x"), perigee::error);
}
