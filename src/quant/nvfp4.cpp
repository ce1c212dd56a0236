#include "quant/nvfp4.h"

#include "quant/mxfp4.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

namespace perigee {

uint8_t e4m3_pow2(int k) {
    PG_CHECK(k >= -9 && k <= 8, "2^{} is not representable in E4M3 (powers 2^-9..2^8 only)", k);
    if (k < -6) return uint8_t(1u << (k + 9));   // subnormal: mantissa m gives m * 2^-9
    return uint8_t((k + 7) << 3);                // normal: exponent field k + 7, mantissa 0
}

void nvfp4_dequant_row_ref(const uint8_t * packed, const uint8_t * scale_e4m3, float global_scale, int64_t n_cols,
                           float * out) {
    PG_CHECK(n_cols % k_nvfp4_block == 0, "nvfp4 row of {} columns is not a multiple of {}", n_cols, k_nvfp4_block);
    for (int64_t c = 0; c < n_cols; ++c) {
        const uint8_t byte = packed[c / 2];
        const uint8_t code = (c % 2 == 0) ? (byte & 0x0F) : (byte >> 4);   // low nibble = even column
        out[c] = e2m1_to_f32(code) * f8_e4m3_to_f32(scale_e4m3[c / k_nvfp4_block]) * global_scale;
    }
}

void nvfp4_validate(const tensor & packed, const tensor & scale, float global_scale, int64_t out, int64_t in,
                    const std::string & name) {
    PG_CHECK(packed.type == dtype::U8, "{}: weight_packed is {}, expected U8 (paired scale is {})", name,
             dtype_name(packed.type), dtype_name(scale.type));
    PG_CHECK(scale.type == dtype::F8_E4M3, "{}: weight_scale is {}, expected F8_E4M3 (paired packed is {})", name,
             dtype_name(scale.type), dtype_name(packed.type));
    PG_CHECK(in > 0 && out > 0 && in % k_nvfp4_block == 0,
             "{}: logical shape [{}, {}]: the input width must be a positive multiple of {}", name, out, in,
             k_nvfp4_block);
    const shape_t want_p{out, in / 2}, want_s{out, in / k_nvfp4_block};
    PG_CHECK(packed.shape == want_p && scale.shape == want_s,
             "{}: weight_packed {} / weight_scale {} do not match [out, in] = [{}, {}] (expected {} and {})", name,
             shape_str(packed.shape), shape_str(scale.shape), out, in, shape_str(want_p), shape_str(want_s));
    PG_CHECK(packed.data && packed.nbytes >= size_t(out * (in / 2)), "{}: weight_packed has {} bytes, needs {}",
             name, packed.nbytes, out * (in / 2));
    PG_CHECK(scale.data && scale.nbytes >= size_t(out * (in / k_nvfp4_block)),
             "{}: weight_scale has {} bytes, needs {}", name, scale.nbytes, out * (in / k_nvfp4_block));
    PG_CHECK(std::isfinite(global_scale) && global_scale > 0.0f,
             "{}: weight_global_scale is {}, expected a finite positive multiplier", name, global_scale);
    const auto * s = scale.as<uint8_t>();
    const int64_t nb = in / k_nvfp4_block;
    for (int64_t r = 0; r < out; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t v = s[r * nb + b];
            PG_CHECK((v & 0x7F) != 0x7F, "{}: weight_scale byte 0x{:02X} (E4M3 NaN) at row {}, block {} (columns {}..{})",
                     name, v, r, b, b * k_nvfp4_block, b * k_nvfp4_block + k_nvfp4_block - 1);
        }
}

tensor nvfp4_dequant_ref(const tensor & packed, const tensor & scale, float global_scale, const std::string & name) {
    PG_CHECK(packed.shape.size() == 2, "{}: weight_packed has shape {}, expected 2-D [out, in/2]", name,
             shape_str(packed.shape));
    const int64_t out = packed.shape[0], in = packed.shape[1] * 2;
    nvfp4_validate(packed, scale, global_scale, out, in, name);
    tensor w = tensor_new(dtype::F32, {out, in});
    const auto * p = packed.as<uint8_t>();
    const auto * s = scale.as<uint8_t>();
    float * o = w.f32();
    for (int64_t r = 0; r < out; ++r)
        nvfp4_dequant_row_ref(p + r * (in / 2), s + r * (in / k_nvfp4_block), global_scale, in, o + r * in);
    return w;
}

nvfp4_repack mxfp4_to_nvfp4(const tensor & packed, const tensor & scale, const std::string & name,
                            bool normal_scales_only) {
    PG_CHECK(packed.shape.size() == 2, "{}: weight_packed has shape {}, expected 2-D [out, in/2]", name,
             shape_str(packed.shape));
    const int64_t out = packed.shape[0], in = packed.shape[1] * 2;
    mxfp4_validate(packed, scale, out, in, name);   // dtypes, shapes, 0xFF (throws naming row and block)

    const auto * p = packed.as<uint8_t>();
    const auto * s = scale.as<uint8_t>();
    const int64_t nb = in / k_mxfp4_block;            // 32-blocks per row
    constexpr int64_t k_block_bytes = k_mxfp4_block / 2;

    // 1) Which blocks are all zero ((code & 7) == 0 for all 32 nibbles, i.e. +0 or -0), and the exponent range
    //    over the others.
    nvfp4_repack r;
    r.n_blocks = out * nb;
    std::vector<uint8_t> zero_block(size_t(out * nb), 0);
    int e_min = INT_MAX, e_max = INT_MIN;
    for (int64_t row = 0; row < out; ++row)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t * q = p + row * (in / 2) + b * k_block_bytes;
            bool nonzero = false;
            for (int64_t i = 0; i < k_block_bytes && !nonzero; ++i) nonzero = (q[i] & 0x77) != 0;
            if (!nonzero) {
                zero_block[size_t(row * nb + b)] = 1;
                ++r.n_zero_blocks;
                continue;
            }
            const int e = int(s[row * nb + b]) - 127;
            e_min = std::min(e_min, e);
            e_max = std::max(e_max, e);
        }

    // 2) The global exponent g: every nonzero block needs e - g in [-9, 8] (or [-6, 8] for normal scales only),
    //    and G = 2^g must stay a normal fp32 (g >= -126) so a flush-to-zero kernel cannot lose it.
    int g = 0;
    if (e_min == INT_MAX) {   // every block is zero: any G works
        r.e_min = r.e_max = 0;
    } else {
        r.e_min = e_min;
        r.e_max = e_max;
        const int lowest_scale = normal_scales_only ? -6 : -9;
        const int max_span = 8 - lowest_scale;   // 17, or 14 for normal-only
        if (e_max - e_min > max_span) {
            r.ok = false;
            r.why = fmt::format("{}: block exponents span 2^{}..2^{} ({} powers of two apart) but E4M3 scales hold "
                                "only 2^{}..2^8 (span <= {}); not lossless, kept MXFP4",
                                name, e_min, e_max, e_max - e_min, lowest_scale, max_span);
            return r;
        }
        g = std::max(e_max - 8, -126);
        PG_ASSERT(e_min - g >= lowest_scale && e_max - g <= 8);   // e_min >= -127 > -126 - 9
    }

    // 3) Scales: each 32-block's E4M3 byte written at NVFP4 indices 2j and 2j+1. Nibbles verbatim (shared bytes).
    r.scale = tensor_new(dtype::F8_E4M3, {out, in / k_nvfp4_block});
    auto * o = r.scale.as<uint8_t>();
    for (int64_t row = 0; row < out; ++row)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t v = 0x00;   // all-zero block: scale 0 (its values are +-0 either way)
            if (!zero_block[size_t(row * nb + b)]) {
                const int k = int(s[row * nb + b]) - 127 - g;
                v = e4m3_pow2(k);
                if (k < -6) r.subnormal_scales = true;
            }
            o[row * (2 * nb) + 2 * b] = v;
            o[row * (2 * nb) + 2 * b + 1] = v;
        }
    r.packed = packed;
    r.global_log2 = g;
    r.global_scale = std::ldexp(1.0f, g);
    r.ok = true;
    return r;
}

std::string nvfp4_matches_mxfp4(const tensor & mx_packed, const tensor & mx_scale, const tensor & nv_packed,
                                const tensor & nv_scale, float global_scale, const std::string & name, bool full) {
    PG_CHECK(mx_packed.shape.size() == 2, "{}: weight_packed has shape {}, expected 2-D [out, in/2]", name,
             shape_str(mx_packed.shape));
    const int64_t out = mx_packed.shape[0], in = mx_packed.shape[1] * 2;
    mxfp4_validate(mx_packed, mx_scale, out, in, name);
    nvfp4_validate(nv_packed, nv_scale, global_scale, out, in, name);
    const auto * mp = mx_packed.as<uint8_t>();
    const auto * np = nv_packed.as<uint8_t>();
    const auto * ms = mx_scale.as<uint8_t>();
    const auto * ns = nv_scale.as<uint8_t>();
    if (full) {
        std::vector<float> a(static_cast<size_t>(in)), b(static_cast<size_t>(in));
        for (int64_t r = 0; r < out; ++r) {
            mxfp4_dequant_row_ref(mp + r * (in / 2), ms + r * (in / k_mxfp4_block), in, a.data());
            nvfp4_dequant_row_ref(np + r * (in / 2), ns + r * (in / k_nvfp4_block), global_scale, in, b.data());
            for (int64_t c = 0; c < in; ++c)
                if (std::memcmp(&a[size_t(c)], &b[size_t(c)], 4) != 0)
                    return fmt::format("{}: row {}, column {}: MXFP4 decodes to {} but NVFP4 to {}", name, r, c,
                                       a[size_t(c)], b[size_t(c)]);
        }
        return "";
    }
    for (int64_t r = 0; r < out; ++r) {
        const int64_t off = r * (in / 2);
        if (std::memcmp(mp + off, np + off, size_t(in / 2)) != 0) {
            int64_t j = 0;
            while (mp[off + j] == np[off + j]) ++j;
            return fmt::format("{}: row {}, packed byte {}: MXFP4 0x{:02X}, NVFP4 0x{:02X} (nibbles must be verbatim)",
                               name, r, j, mp[off + j], np[off + j]);
        }
        const int64_t nb = in / k_mxfp4_block;
        for (int64_t b = 0; b < nb; ++b) {
            bool nonzero = false;
            for (int64_t i = 0; i < k_mxfp4_block / 2 && !nonzero; ++i) nonzero = (mp[off + b * 16 + i] & 0x77) != 0;
            if (!nonzero) continue;   // +-0 in both encodings (validate rejected NaN scales)
            const float want = e8m0_to_f32(ms[r * nb + b]);
            for (int h = 0; h < 2; ++h) {
                const float got = f8_e4m3_to_f32(ns[r * 2 * nb + 2 * b + h]) * global_scale;
                if (std::memcmp(&got, &want, 4) != 0)
                    return fmt::format("{}: row {}, block {} (half {}): NVFP4 scale x global = {} but MXFP4 scale = {}",
                                       name, r, b, h, got, want);
            }
        }
    }
    return "";
}

} // namespace perigee
