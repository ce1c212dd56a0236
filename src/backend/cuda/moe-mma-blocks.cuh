// Pieces the tensor-core experts v3 (moe-mma.cu) and v4 (moe-wgmma.cu) share (the bf16 hi + lo split of activations is
// mma-sync.cuh's split_hi_lo): the row stride of a block's scale copy, that copy, and the host side of their two stages.
#pragma once
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"
#include "backend/cuda/mma-sync.cuh"
#include "backend/cuda/smem-attr.cuh"

#include <algorithm>

namespace perigee::cuda {

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

// ---- host: the two stages of a version over activation planes ----
// V, the version's traits (a struct in its .cu file): V::kern<NM> (the kernel; NM 2: gate/up writing h's planes, NM 1:
// down writing y), V::split (x -> bf16 hi + lo planes, in the order the version's kernels read them), V::rows (weight
// rows of a block at NM 1; NM 2 takes rows / 2 of gate and of up), V::threads, V::max_smem (the opt-in limit) and
// V::smem(K) (one launch's dynamic shared memory for K columns).

// One stage: grid (blocks of rows / NM rows, A active experts), dynamic shared memory V::smem(K).
template <typename V, int NM>
cudaError_t mma_stage(const __nv_bfloat16 * xh, const __nv_bfloat16 * xl, int64_t ldx, int64_t k_div, int64_t K,
                      const dexpert * experts, int64_t A, int64_t S, const int32_t * gw, const dexperts_cfg & c, int n_min,
                      bool xsplit, __nv_bfloat16 * oh, __nv_bfloat16 * ol, float * of32, cudaStream_t st) {
    constexpr auto kern = V::template kern<NM>;
    const cudaError_t attr = smem_attr<kern>(size_t(V::max_smem));
    if (attr != cudaSuccess) return attr;
    constexpr int BN = V::rows / NM;
    const int64_t rows = NM == 2 ? c.d_ff : c.d_out;
    return launch_k(kern, dim3(unsigned((rows + BN - 1) / BN), unsigned(A)), V::threads, size_t(V::smem(K)), st, xh, xl, ldx,
                    k_div, experts, A, S, gw, c, n_min, xsplit, oh, ol, of32);
}

// x's planes in ybuf's memory (the down stage overwrites ybuf only after gate/up has read them), h's planes in hbuf's;
// the split, gate/up, down. S = T k slots.
template <typename V>
cudaError_t mma_stages(const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A, int64_t S,
                       const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf, cudaStream_t st, int n_min,
                       bool xsplit) {
    const int64_t T = S / k;
    auto * xh = reinterpret_cast<__nv_bfloat16 *>(ybuf);
    auto * xl = xh + T * Din;
    auto * hh = reinterpret_cast<__nv_bfloat16 *>(hbuf);
    auto * hl = hh + S * c.d_ff;
    const int64_t n4 = T * Din / 4;
    cudaError_t e = launch_k(V::split, unsigned(std::min<int64_t>((n4 + 255) / 256, 4096)), 256, 0, st, x, T * Din, xsplit,
                             xh, xl);
    if (e == cudaSuccess) e = mma_stage<V, 2>(xh, xl, Din, k, Din, experts, A, S, gw, c, n_min, xsplit, hh, hl, nullptr, st);
    if (e == cudaSuccess) e = mma_stage<V, 1>(hh, hl, c.d_ff, 1, c.d_ff, experts, A, S, gw, c, n_min, xsplit, nullptr, nullptr, ybuf, st);
    return e;
}

} // namespace perigee::cuda
