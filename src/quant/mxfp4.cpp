#include "quant/mxfp4.h"

#include <cmath>
#include <cstring>

namespace perigee {

namespace {
constexpr float k_e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
} // namespace

float e2m1_to_f32(uint8_t code) {
    PG_ASSERT(code < 16);
    const float m = k_e2m1_mag[code & 7];
    return (code & 8) ? -m : m;
}

uint8_t f32_to_e2m1(float x) {
    PG_ASSERT(!std::isnan(x));
    const float a = std::fabs(x);
    // Midpoints between neighbours; at a tie the even code wins (<= keeps the lower code when it is even).
    uint8_t c;
    if (a <= 0.25f) c = 0;        // tie 0 | 0.5 -> 0
    else if (a < 0.75f) c = 1;    // tie 0.5 | 1 -> 1 (code 2)
    else if (a <= 1.25f) c = 2;   // tie 1 | 1.5 -> 1
    else if (a < 1.75f) c = 3;    // tie 1.5 | 2 -> 2 (code 4)
    else if (a <= 2.5f) c = 4;    // tie 2 | 3 -> 2
    else if (a < 3.5f) c = 5;     // tie 3 | 4 -> 4 (code 6)
    else if (a <= 5.0f) c = 6;    // tie 4 | 6 -> 4
    else c = 7;                   // saturate at 6
    return uint8_t((std::signbit(x) ? 8 : 0) | c);
}

float e8m0_to_f32(uint8_t b) {
    if (b == 0xFF) return NAN;
    // 2^(b-127) built from its bit pattern: biased exponent b for b >= 1 (a normal float), and the
    // subnormal 2^-127 (mantissa bit 22) for b == 0. Same value as ldexp(1, b-127), without libm.
    const uint32_t bits = b == 0 ? 0x00400000u : uint32_t(b) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

void mxfp4_dequant_row_ref(const uint8_t * packed, const uint8_t * scale, int64_t n_cols, float * out) {
    PG_CHECK(n_cols % k_mxfp4_block == 0, "mxfp4 row of {} columns is not a multiple of {}", n_cols, k_mxfp4_block);
    for (int64_t blk = 0; blk < n_cols / k_mxfp4_block; ++blk) {
        const float s = e8m0_to_f32(scale[blk]);   // one scale per 32 columns
        for (int64_t c = blk * k_mxfp4_block; c < (blk + 1) * k_mxfp4_block; c += 2) {
            const uint8_t byte = packed[c / 2];
            out[c] = e2m1_to_f32(byte & 0x0F) * s;      // low nibble = even column
            out[c + 1] = e2m1_to_f32(byte >> 4) * s;    // high nibble = odd column
        }
    }
}

void mxfp4_quantize_row_ref(const float * in, int64_t n_cols, uint8_t * packed, uint8_t * scale) {
    PG_CHECK(n_cols % k_mxfp4_block == 0, "mxfp4 row of {} columns is not a multiple of {}", n_cols, k_mxfp4_block);
    for (int64_t c = 0; c < n_cols; ++c)
        PG_CHECK(std::isfinite(in[c]), "mxfp4 quantize: column {} is {} (inputs must be finite)", c, in[c]);
    for (int64_t b = 0; b < n_cols / k_mxfp4_block; ++b) {
        const float * x = in + b * k_mxfp4_block;
        float amax = 0.0f;
        for (int64_t i = 0; i < k_mxfp4_block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
        int shared = -127;   // all-zero block: scale byte 0
        if (amax > 0.0f) {
            int e2;
            std::frexp(amax, &e2);          // amax = m * 2^e2, m in [0.5, 1): floor(log2(amax)) = e2 - 1
            shared = (e2 - 1) - 2;          // minus E2M1 emax (6 = 1.5 * 2^2)
            if (shared < -127) shared = -127;
            if (shared > 127) shared = 127;
        }
        scale[b] = uint8_t(shared + 127);
        for (int64_t i = 0; i < k_mxfp4_block; i += 2) {
            const uint8_t lo = f32_to_e2m1(std::ldexp(x[i], -shared));       // exact scaling by a power of two
            const uint8_t hi = f32_to_e2m1(std::ldexp(x[i + 1], -shared));
            packed[(b * k_mxfp4_block + i) / 2] = uint8_t(lo | (hi << 4));
        }
    }
}

void mxfp4_validate(const tensor & packed, const tensor & scale, int64_t out, int64_t in, const std::string & name) {
    PG_CHECK(packed.type == dtype::U8, "{}: weight_packed is {}, expected U8 (paired scale is {})", name,
             dtype_name(packed.type), dtype_name(scale.type));
    PG_CHECK(scale.type == dtype::U8 || scale.type == dtype::F8_E8M0,
             "{}: weight_scale is {}, expected U8 or F8_E8M0 (E8M0 bytes; paired packed is {})", name,
             dtype_name(scale.type), dtype_name(packed.type));
    PG_CHECK(in > 0 && out > 0 && in % k_mxfp4_block == 0,
             "{}: logical shape [{}, {}]: the input width must be a positive multiple of {}", name, out, in,
             k_mxfp4_block);
    const shape_t want_p{out, in / 2}, want_s{out, in / k_mxfp4_block};
    PG_CHECK(packed.shape == want_p && scale.shape == want_s,
             "{}: weight_packed {} / weight_scale {} do not match [out, in] = [{}, {}] (expected {} and {})", name,
             shape_str(packed.shape), shape_str(scale.shape), out, in, shape_str(want_p), shape_str(want_s));
    PG_CHECK(packed.data && packed.nbytes >= size_t(out * (in / 2)), "{}: weight_packed has {} bytes, needs {}",
             name, packed.nbytes, out * (in / 2));
    PG_CHECK(scale.data && scale.nbytes >= size_t(out * (in / k_mxfp4_block)),
             "{}: weight_scale has {} bytes, needs {}", name, scale.nbytes, out * (in / k_mxfp4_block));
    const auto * s = scale.as<uint8_t>();
    const int64_t nb = in / k_mxfp4_block;
    for (int64_t r = 0; r < out; ++r)
        for (int64_t b = 0; b < nb; ++b)
            PG_CHECK(s[r * nb + b] != 0xFF,
                     "{}: weight_scale byte 0xFF (E8M0 NaN) at row {}, block {} (columns {}..{})", name, r, b,
                     b * k_mxfp4_block, b * k_mxfp4_block + k_mxfp4_block - 1);
}

tensor mxfp4_dequant_ref(const tensor & packed, const tensor & scale, const std::string & name) {
    PG_CHECK(packed.shape.size() == 2, "{}: weight_packed has shape {}, expected 2-D [out, in/2]", name,
             shape_str(packed.shape));
    const int64_t out = packed.shape[0], in = packed.shape[1] * 2;
    mxfp4_validate(packed, scale, out, in, name);
    tensor w = tensor_new(dtype::F32, {out, in});
    const auto * p = packed.as<uint8_t>();
    const auto * s = scale.as<uint8_t>();
    float * o = w.f32();
    for (int64_t r = 0; r < out; ++r)
        mxfp4_dequant_row_ref(p + r * (in / 2), s + r * (in / k_mxfp4_block), in, o + r * in);
    return w;
}

mxfp4_matrix mxfp4_quantize_ref(const tensor & w) {
    PG_CHECK(w.type == dtype::F32 && w.shape.size() == 2, "mxfp4 quantize: expected an F32 [out, in] tensor, got {} {}",
             dtype_name(w.type), shape_str(w.shape));
    const int64_t out = w.shape[0], in = w.shape[1];
    PG_CHECK(in % k_mxfp4_block == 0, "mxfp4 quantize: input width {} is not a multiple of {}", in, k_mxfp4_block);
    mxfp4_matrix m{tensor_new(dtype::U8, {out, in / 2}), tensor_new(dtype::U8, {out, in / k_mxfp4_block})};
    const float * x = w.f32();
    for (int64_t r = 0; r < out; ++r)
        mxfp4_quantize_row_ref(x + r * in, in, m.packed.as<uint8_t>() + r * (in / 2),
                               m.scale.as<uint8_t>() + r * (in / k_mxfp4_block));
    return m;
}

} // namespace perigee
