#include "core/dtype.h"

#include <cmath>

namespace perigee {

namespace {
struct dtype_info { dtype t; const char * name; int bits; };
constexpr dtype_info k_dtypes[] = {
    {dtype::BOOL, "BOOL", 8},   {dtype::U8, "U8", 8},       {dtype::I8, "I8", 8},
    {dtype::U16, "U16", 16},    {dtype::I16, "I16", 16},    {dtype::U32, "U32", 32},
    {dtype::I32, "I32", 32},    {dtype::U64, "U64", 64},    {dtype::I64, "I64", 64},
    {dtype::F16, "F16", 16},    {dtype::BF16, "BF16", 16},  {dtype::F32, "F32", 32},
    {dtype::F64, "F64", 64},    {dtype::F8_E4M3, "F8_E4M3", 8}, {dtype::F8_E5M2, "F8_E5M2", 8},
    {dtype::F8_E8M0, "F8_E8M0", 8}, {dtype::F4, "F4", 4},
};
static_assert(sizeof(k_dtypes) / sizeof(k_dtypes[0]) == size_t(dtype::COUNT));
} // namespace

int dtype_bits(dtype t) { return k_dtypes[size_t(t)].bits; }
std::string_view dtype_name(dtype t) { return k_dtypes[size_t(t)].name; }
std::optional<dtype> dtype_from_name(std::string_view s) {
    for (const auto & d : k_dtypes) if (s == d.name) return d.t;
    return std::nullopt;
}

float f16_to_f32(uint16_t h) {
    const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = std::ldexp(float(man), -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = std::ldexp(float(man | 0x400), int(exp) - 25);
    return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
    // Round-to-nearest-even through the bit pattern.
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = int32_t((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return uint16_t(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return uint16_t(sign);
        man |= 0x800000;
        const int shift = 14 - exp;
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return uint16_t(sign | half);
    }
    uint32_t half = (uint32_t(exp) << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return uint16_t(sign | half);
}

float f8_e4m3_to_f32(uint8_t b) {
    // E4M3 "fn": bias 7, no infinities, 0x7f/0xff are NaN.
    const int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
    float v;
    if (exp == 0xf && man == 7) return NAN;
    if (exp == 0) v = std::ldexp(float(man), -9);
    else v = std::ldexp(float(8 + man), exp - 10);
    return sign ? -v : v;
}

float f8_e5m2_to_f32(uint8_t b) { return f16_to_f32(uint16_t(b) << 8); }

} // namespace perigee
