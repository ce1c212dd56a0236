// MXFP4 (OCP Microscaling FP4, compressed-tensors `mxfp4-pack-quantized`): scalar _ref codecs.
// Spec: ARCHITECTURE §2.5 (layout), §3.8 (decode), trap 30. These are the readable reference that every
// faster decoder (CPU SIMD, CUDA) is tested against; they favour clarity over speed.
//
// Layout of one expert matrix W [out, in]:
//   packed U8 [out, in/2]:  byte j of row r holds column 2j in bits 0..3 and column 2j+1 in bits 4..7
//                           (low nibble = even column).
//   scale  U8 [out, in/32]: byte g of row r scales columns 32g..32g+31 of row r; value 2^(byte-127).
//   W[r, c] = e2m1(nibble(r, c)) * 2^(scale[r, c/32] - 127). No global scale, no zero point.
#pragma once
#include "core/tensor.h"

#include <cstdint>
#include <string>

namespace perigee {

inline constexpr int64_t k_mxfp4_block = 32;    // elements per E8M0 scale, along the input (K) dimension

// E2M1 code (0..15; bit 3 = sign, bits 0..2 = magnitude) -> value. Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6;
// code 8 is -0. There is no Inf or NaN. Codes above 15 are an invariant violation (only the low 4 bits
// are meaningful; callers pass nibbles).
float e2m1_to_f32(uint8_t code);
// Value -> E2M1 code, round to nearest, ties to even code (= even mantissa), saturating at +-6.
// The sign is kept (a negative value that rounds to zero gives code 8, -0). NaN is an invariant violation.
uint8_t f32_to_e2m1(float x);
// E8M0 byte -> 2^(b-127) for b in 0..254 (b = 0 is 2^-127, an fp32 subnormal, NOT zero); 0xFF -> NaN.
float e8m0_to_f32(uint8_t b);

// One row: `packed` n_cols/2 bytes, `scale` n_cols/32 bytes; n_cols % 32 == 0 (checked).
// out[c] = e2m1(nibble c) * e8m0(scale[c/32]); exact in fp32 for every byte (0xFF gives NaN; validate first).
void mxfp4_dequant_row_ref(const uint8_t * packed, const uint8_t * scale, int64_t n_cols, float * out);

// One row, OCP MX v1.0 rule per 32-block: shared exponent = floor(log2(max|x|)) - 2 (2 = E2M1 emax), clamped
// to the E8M0 range [-127, 127]; each x / 2^shared is rounded to nearest-even E2M1, saturating at 6.
// An all-zero block gets scale byte 0. Inputs must be finite (a NaN/Inf is an error naming the column).
void mxfp4_quantize_row_ref(const float * in, int64_t n_cols, uint8_t * packed, uint8_t * scale);

// Checks one MXFP4 matrix pair before anything reads it (RELIABILITY §B3 C-01..C-03):
//   packed U8 [out, in/2], scale U8 (or F8_E8M0) [out, in/32], in % 32 == 0, bytes present for the shape,
//   and no scale byte 0xFF (NaN). Errors name `name`, the shapes and, for 0xFF, the row and block.
void mxfp4_validate(const tensor & packed, const tensor & scale, int64_t out, int64_t in, const std::string & name);

// Whole-matrix decode: validates (shape from `packed`: out = dim 0, in = 2 * dim 1) and returns an owned
// F32 tensor [out, in]. `name` is only used in error messages.
tensor mxfp4_dequant_ref(const tensor & packed, const tensor & scale, const std::string & name = "mxfp4");

// Whole-matrix encode of an F32 tensor [out, in] (in % 32 == 0): returns {packed U8 [out, in/2],
// scale U8 [out, in/32]}. Used by `perigee synth` to make random MXFP4 experts.
struct mxfp4_matrix { tensor packed, scale; };
mxfp4_matrix mxfp4_quantize_ref(const tensor & w);

} // namespace perigee
