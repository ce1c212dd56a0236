// Element types of checkpoints and activations. The list is every dtype the safetensors format
// defines (huggingface/safetensors README, "Format"), plus the packed FP4 formats the experts use.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace perigee {

enum class dtype : uint8_t {
    BOOL, U8, I8, U16, I16, U32, I32, U64, I64,
    F16, BF16, F32, F64,
    F8_E4M3, F8_E5M2, F8_E8M0,
    F4,          // safetensors "F4": two E2M1 values per byte; shapes count elements
    COUNT,
};

// Bits per element (F4 = 4). Every other dtype is a whole number of bytes.
int dtype_bits(dtype t);
// The safetensors spelling ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(dtype t);
// Parse the safetensors spelling; nullopt for an unknown name.
std::optional<dtype> dtype_from_name(std::string_view s);

// --- scalar conversions (the _ref codecs; exact, no rounding surprises) ---
inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even, NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f8_e4m3_to_f32(uint8_t b);
float f8_e5m2_to_f32(uint8_t b);

} // namespace perigee
