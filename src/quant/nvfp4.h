// NVFP4: scalar _ref decode and the lossless MXFP4 -> NVFP4 repack (ARCHITECTURE §3.8, trap 32;
// RELIABILITY §B3).
//
// Layout of one matrix W [out, in]:
//   packed U8 [out, in/2]       same E2M1 codes and nibble order as MXFP4 (low nibble = even column)
//   scale  F8_E4M3 [out, in/16] one E4M3 ("fn", bias 7) scale per 16 elements along the input dimension
//   global_scale (fp32)         one per tensor
//   W[r, c] = e2m1(nibble(r, c)) * e4m3(scale[r, c/16]) * global_scale,   evaluated in that order in fp32.
// Convention of this project: global_scale is the MULTIPLIER itself (not compressed-tensors' reciprocal-style
// divisor). The converter stores it as `<x>.weight_global_scale` F32 [1] with exactly this meaning.
#pragma once
#include "core/tensor.h"

#include <cstdint>
#include <string>

namespace perigee {

inline constexpr int64_t k_nvfp4_block = 16;   // elements per E4M3 scale

// E4M3 byte of the power of two 2^k, k in [-9, 8] (the 18 powers E4M3 represents: 0x01, 0x02, 0x04 are the
// subnormals 2^-9..2^-7; 0x08..0x78 are 2^-6..2^8, byte = (k+7)<<3). Out-of-range k is an error.
uint8_t e4m3_pow2(int k);

// One row: `packed` n_cols/2 bytes, `scale_e4m3` n_cols/16 bytes; n_cols % 16 == 0 (checked).
void nvfp4_dequant_row_ref(const uint8_t * packed, const uint8_t * scale_e4m3, float global_scale, int64_t n_cols,
                           float * out);

// Checks one NVFP4 matrix: packed U8 [out, in/2], scale F8_E4M3 [out, in/16], in % 16 == 0, bytes present,
// no NaN scale byte (0x7F / 0xFF; the error names the row and block), global_scale finite and > 0.
void nvfp4_validate(const tensor & packed, const tensor & scale, float global_scale, int64_t out, int64_t in,
                    const std::string & name);

// Whole-matrix decode to an owned F32 tensor [out, in] (validates first; out = dim 0, in = 2 * packed dim 1).
tensor nvfp4_dequant_ref(const tensor & packed, const tensor & scale, float global_scale,
                         const std::string & name = "nvfp4");

// Result of repacking one MXFP4 matrix.
struct nvfp4_repack {
    bool ok = false;            // true: lossless, packed/scale/global_scale are set
    std::string why;            // when !ok: the reason (span and limit), for the converter's report
    int e_min = 0, e_max = 0;   // block exponents (E8M0 byte - 127) over the non-all-zero blocks
    int64_t n_blocks = 0;       // 32-blocks in the tensor
    int64_t n_zero_blocks = 0;  // all-zero 32-blocks (excluded from the range; their E4M3 scale is 0x00)
    bool subnormal_scales = false;  // some block's E4M3 scale is subnormal (2^-9..2^-7)
    tensor packed;              // U8 [out, in/2]: the MXFP4 nibbles verbatim (shares the input's bytes)
    tensor scale;               // F8_E4M3 [out, in/16]: each 32-block's byte written at 2j and 2j+1
    int global_log2 = 0;        // global_scale = 2^global_log2
    float global_scale = 1.0f;  // the multiplier (see the convention above); a normal fp32 (>= 2^-126)
};

// The lossless MXFP4 -> NVFP4 repack (ARCHITECTURE §3.8):
//  1. mxfp4_validate (U8 dtypes, shapes, in % 32 == 0) — any scale byte 0xFF throws, naming tensor/row/block;
//  2. e_min/e_max over the blocks with some nonzero nibble ((code & 7) != 0); all-zero blocks are excluded;
//  3. span = e_max - e_min must be <= 17 (E4M3's 18 powers 2^-9..2^8; with normal_scales_only, <= 14 so every
//     scale is in 2^-6..2^8). Then G = 2^max(e_max - 8, -126) (never an fp32 subnormal), and each block's
//     scale 2^(e - log2 G) is exact in E4M3;
//  4. otherwise ok = false with the reason: the caller keeps the tensor in MXFP4. Nothing is ever clamped.
// Guarantee when ok: nvfp4_dequant_ref(result) == mxfp4_dequant_ref(input) bit for bit, every element.
// `packed` must be 2-D [out, in/2]. `name` is used in errors and in `why`.
nvfp4_repack mxfp4_to_nvfp4(const tensor & packed, const tensor & scale, const std::string & name = "mxfp4",
                            bool normal_scales_only = false);

// Checks that an NVFP4 matrix decodes to exactly the values of an MXFP4 matrix, bit for bit (trap 32's
// self-test). Returns "" when they agree, else a description of the first difference naming `name`.
//  full = true:  decodes both row by row (bounded memory) and compares every element's bits.
//  full = false: the equivalent cheap check: packed bytes identical, and for every 32-block with a nonzero
//                nibble, e4m3(scale[2j]) * G == e4m3(scale[2j+1]) * G == 2^(e8m0 - 127) exactly in fp32 (values
//                are then equal because every product is an exact power-of-two scaling); all-zero blocks
//                only need non-NaN scales (their values are +-0 either way).
// Both inputs are validated first (shapes, dtypes, 0xFF / NaN bytes).
std::string nvfp4_matches_mxfp4(const tensor & mx_packed, const tensor & mx_scale, const tensor & nv_packed,
                                const tensor & nv_scale, float global_scale, const std::string & name, bool full);

} // namespace perigee
