// Pieces the tensor-core experts v3 (moe-mma.cu) and v4 (moe-wgmma.cu) share: the bf16 hi + lo split of activations,
// the row stride of a block's scale copy, and that copy.
#pragma once
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"

namespace perigee::cuda {

// v = hi + lo to ~16 mantissa bits (lo = 0 when !xsplit), as bf16 pairs (v.x, v.y) and (v.z, v.w).
__device__ __forceinline__ void split_hi_lo(float4 v, bool xsplit, __nv_bfloat162 (&h)[2], __nv_bfloat162 (&l)[2]) {
    h[0] = __floats2bfloat162_rn(v.x, v.y);
    h[1] = __floats2bfloat162_rn(v.z, v.w);
    const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    l[0] = xsplit ? __floats2bfloat162_rn(v.x - f0.x, v.y - f0.y) : __floats2bfloat162_rn(0.0f, 0.0f);
    l[1] = xsplit ? __floats2bfloat162_rn(v.z - f1.x, v.w - f1.y) : __floats2bfloat162_rn(0.0f, 0.0f);
}

// Bytes per row of a block's scale copy: K / 32 rounded up to 16 (16-byte copies), then to an odd multiple of 4 words
// (rows g = 0..7 read in one LDS.8 land on distinct banks; e.g. K = 3072: 96 -> 112).
constexpr int64_t mma_scale_ld(int64_t K) {
    int64_t s = (K / 32 + 15) / 16 * 16;
    return (s / 4) % 8 == 0 ? s + 16 : s;
}

// The E8M0 scales of a block's ROWS rows (from r0; NM 2: the first ROWS / 2 of m0 = gate, the rest of m1 = up), all
// ksc bytes of each, into Ssm [ROWS][sld]: 16-byte cp.async where the source is aligned, else byte copies; rows past
// the matrix are left unset (their outputs are never stored). The caller commits and waits.
template <int ROWS, int NM, int THREADS>
__device__ __forceinline__ void mma_copy_scales(unsigned char * Ssm, int64_t sld, const dexpert_matrix & m0,
                                                const dexpert_matrix & m1, int64_t r0, int64_t n_rows, int64_t ksc, int tid) {
    constexpr int BN = ROWS / NM;
    for (int ch = tid; ch < ROWS * int(ksc / 16); ch += THREADS) {
        const int row = ch / int(ksc / 16), part = ch % int(ksc / 16);
        const int64_t wr = r0 + (NM == 2 ? row % BN : row);
        if (wr >= n_rows) continue;
        const uint8_t * sc = (NM == 2 && row >= BN) ? m1.scale : m0.scale;
        const uint8_t * src = sc + wr * ksc + part * 16;
        unsigned char * dst = Ssm + row * sld + part * 16;
        if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) cp_async16(dst, src);
        else
            for (int i = 0; i < 16; ++i) dst[i] = src[i];
    }
}

} // namespace perigee::cuda
