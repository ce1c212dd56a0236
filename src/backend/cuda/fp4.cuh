// FP4 decoding helpers shared by the grouped expert kernels (moe.cu) and the tensor-core experts (moe-mma.cu,
// moe-wgmma.cu): E2M1 nibbles to exact bf16 pairs / floats, and the E8M0 / E4M3 scale bytes to float.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace perigee::cuda {

// E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as bf16: high bytes and low bytes, 8 entries in two words each.
constexpr uint32_t k_fp4_hi0 = 0x3F3F3F00u, k_fp4_hi1 = 0x40404040u;
constexpr uint32_t k_fp4_lo0 = 0xC0800000u, k_fp4_lo1 = 0xC0804000u;

// 8 E2M1 nibbles (low nibble first) -> 4 packed bf16 pairs (columns 0|1, 2|3, 4|5, 6|7; low half first), exact.
__device__ __forceinline__ void fp4x8_pairs(uint32_t q, uint32_t (&p)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t c = (q >> (16 * h)) & 0xFFFFu;          // 4 nibbles
        const uint32_t sel = c & 0x7777u;
        const uint32_t hi = __byte_perm(k_fp4_hi0, k_fp4_hi1, sel);
        const uint32_t lo = __byte_perm(k_fp4_lo0, k_fp4_lo1, sel);
        uint32_t p0 = __byte_perm(lo, hi, 0x5140u), p1 = __byte_perm(lo, hi, 0x7362u);
        p0 |= ((c & 0x8u) << 12) | ((c & 0x80u) << 24);
        p1 |= ((c & 0x800u) << 4) | ((c & 0x8000u) << 16);
        p[2 * h] = p0;
        p[2 * h + 1] = p1;
    }
}

// fp4x8_pairs with fewer integer ops (the tensor-core experts v2-v4): both halves' magnitudes from one masked selector
// word, and the signs of pair i (nibble 2i's bit 3 -> bit 15, nibble 2i+1's bit 3 -> bit 31) gathered by one byte
// permute of (q << 4, q): byte 1 = (q << 4) byte i (its msb: nibble 2i's sign), byte 3 = q byte i (its msb: nibble
// 2i+1's sign). Bit-identical to fp4x8_pairs (checked on the host over all 16-bit halves and 4M random words with an
// emulated prmt).
__device__ __forceinline__ void fp4x8_pairs2(uint32_t q, uint32_t (&p)[4]) {
    const uint32_t sel = q & 0x77777777u, sel1 = sel >> 16, q4 = q << 4;
    const uint32_t hA = __byte_perm(k_fp4_hi0, k_fp4_hi1, sel), lA = __byte_perm(k_fp4_lo0, k_fp4_lo1, sel);
    const uint32_t hB = __byte_perm(k_fp4_hi0, k_fp4_hi1, sel1), lB = __byte_perm(k_fp4_lo0, k_fp4_lo1, sel1);
    p[0] = __byte_perm(lA, hA, 0x5140u) | (__byte_perm(q4, q, 0x4000u) & 0x80008000u);
    p[1] = __byte_perm(lA, hA, 0x7362u) | (__byte_perm(q4, q, 0x5010u) & 0x80008000u);
    p[2] = __byte_perm(lB, hB, 0x5140u) | (__byte_perm(q4, q, 0x6020u) & 0x80008000u);
    p[3] = __byte_perm(lB, hB, 0x7362u) | (__byte_perm(q4, q, 0x7030u) & 0x80008000u);
}

// E8M0 scale byte b as a bf16 pair (both halves): the exponent field b (b = 0: 2^-127, the subnormal 0x0040, which
// max() picks since b << 7 >= 0x80 for every other b).
__device__ __forceinline__ __nv_bfloat162 e8m0_bf16x2(uint32_t b) {
    const uint32_t w = max(b << 7, 0x40u) * 0x10001u;
    return *reinterpret_cast<const __nv_bfloat162 *>(&w);
}

// The tensor-core experts' A fragment words of one weight row and 32-column scale block (v2-v4): the 8 nibbles of
// 32-bit word wv (columns 8q .. 8q + 7 for lane q) as 4 bf16 pairs times the block's scale sc, exact (E2M1 x E8M0 or
// x E4M3 fits bf16): p[0], p[1] feed k16 step 0 (rows' registers 0-1 and 2-3: logical k 2q.. and 2q + 8..), p[2], p[3]
// step 1.
__device__ __forceinline__ void fp4_a_pairs(uint32_t wv, __nv_bfloat162 sc, uint32_t (&p)[4]) {
    fp4x8_pairs2(wv, p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&p[i]), sc);
        p[i] = *reinterpret_cast<const uint32_t *>(&v);
    }
}

// The shift form (cuda_options::moe_mma_v4_shift): 8 E2M1 nibbles of q (nibble i = column i) -> the pairs (i, i + 4),
// i = 0..3, as bf16x2 bits whose values are the E2M1 values times 2^-126, exact: each nibble's magnitude bits (e1 e0 m)
// go to bf16 bits 8..6 (the exponent's two low bits and the mantissa's top bit) and its sign to bit 15, so e >= 1
// reads 2^(e - 127) (1 + m / 2) and e = 0 the subnormal m 2^-127 (an E2M1 value is 2^(e - 1) (1 + m / 2), or m / 2).
// Two shifts and two logic ops a pair, against fp4x8_pairs2's table lookups; the pairs hold columns 4 apart, so the
// activations are laid out to match (moe-wgmma.cu m4s_pos).
__device__ __forceinline__ void fp4x8_shift_pairs(uint32_t q, uint32_t (&p)[4]) {
    constexpr uint32_t mag = 0x01C001C0u, sgn = 0x80008000u;
    p[0] = ((q << 6) & mag) | ((q << 12) & sgn);
    p[1] = ((q << 2) & mag) | ((q << 8) & sgn);
    p[2] = ((q >> 2) & mag) | ((q << 4) & sgn);
    p[3] = ((q >> 6) & mag) | (q & sgn);
}

// fp4x8_shift_pairs times the E8M0 scale 2^(b - 127), i.e. times 2^(b - 1) in all, as ONE bf16x2 multiply: exact for
// b <= 128, where 2^(b - 1) is a bf16 (biased exponent b + 126; b = 0 gives 2^-1, no subnormal case). PRECONDITION
// b <= 128: above it 2^(b - 1) has no bf16 and the result is wrong (fp4_dequant_forms' control shows it), so the backend
// takes this form only for expert tables whose scale bytes are all <= fp4_shift_max_scale (cuda-ops.h; cuda-backend.cpp
// expert_fmt::shift_ok; real checkpoints' scales are ~2^-9..2^0, bytes ~118..127) and the table form (fp4_a_pairs) otherwise.
// Why the precondition instead of a second multiply for b > 128 (session 21's form): the compiler issued that multiply
// as 4 predicated HMUL2 per word on every call (~32 of ~400 instructions per warp and K-tile of an issue-bound kernel).
__device__ __forceinline__ void fp4_a_pairs_shift(uint32_t q, uint32_t b, uint32_t (&p)[4]) {
    fp4x8_shift_pairs(q, p);
    const uint32_t f = ((b + 126u) << 7) * 0x10001u;
    const __nv_bfloat162 sc = *reinterpret_cast<const __nv_bfloat162 *>(&f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&p[i]), sc);
        p[i] = *reinterpret_cast<const uint32_t *>(&v);
    }
}

// 8 E2M1 nibbles (low nibble first) -> 8 floats, exact.
__device__ __forceinline__ void fp4x8(uint32_t q, float * o) {
    uint32_t p[4];
    fp4x8_pairs(q, p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = __uint_as_float(p[i] << 16);
        o[2 * i + 1] = __uint_as_float(p[i] & 0xFFFF0000u);
    }
}

__device__ __forceinline__ float e8m0_g(uint8_t b) { return b == 0 ? __int_as_float(0x00400000) : __int_as_float(int(b) << 23); }
__device__ __forceinline__ float e4m3_g(uint8_t b) {
    const int sgn = b >> 7, ex = (b >> 3) & 15, mn = b & 7;
    float v = ex == 0 ? ldexpf(float(mn), -9) : ldexpf(1.0f + float(mn) / 8.0f, ex - 7);
    return sgn ? -v : v;
}

} // namespace perigee::cuda
