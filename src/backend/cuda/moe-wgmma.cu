// MOE_EXPERTS on Hopper's warpgroup tensor cores (cuda_options::moe_mma_v4): the tensor-core experts' MXFP4 stages with
// wgmma.mma_async, and the same kernel over BF16 experts (cuda_options::moe_mma_v4_bf16; the 48B's). Called by
// launch_moe_mma_stages (moe-mma.cu); declarations in cuda-ops.h.
//
// Limiter of v3 (moe-mma.cu, Nsight Compute on the H200, k3-layers-4 prefill T 2048, session 7 call A): the gate/up
// kernel issues ~320 instructions per warp per 32-column scale block for ~40 mma.sync (5 token tiles x 2 row tiles x
// 2 k16 steps x hi + lo): issue slots 53% busy, 1.1 eligible warps of 4 per scheduler, the top stall a fixed-latency
// dependency, the ALU (the FP4 dequant) the busiest pipe at 40% and the tensor pipe below it. v4 keeps v3's pipeline
// (64-column K-tiles, 3 cp.async stages, the block's scales copied once, two blocks of 8 warps per SM, activations as
// bf16 hi + lo planes made once per stage) and its dequant (A fragments from one 32-bit word per row and scale block,
// E2M1 x E8M0 exact in bf16), but the products are warpgroup MMAs: each warpgroup owns 128 rows (two m64 tiles) and
// one wgmma m64nNk16 (N = the pass's tokens rounded up to 8) replaces N / 8 x 4 mma.sync, with B (the tokens'
// activations) read by the tensor core straight from shared memory through a descriptor (K-major, 128-byte swizzle).
// While one warpgroup's wgmmas run, the SM's other three dequantize.
//
// The k order. v3's A fragment of lane q takes the 8 nibbles of 32-bit word q of a row's 32-column scale block (columns
// 8q .. 8q + 7) and spreads them over the two k16 steps: step s, logical k 2q + i <- column 8q + 4s + i, logical k
// 2q + 8 + i <- column 8q + 4s + 2 + i (i = 0, 1). mma.sync could read B in the same order from registers; wgmma reads
// B from shared memory in logical order, so the activation planes are written permuted inside each 32-column block:
// column c sits at plane position m4_pos(c). The sum over k is the same; its order inside the tensor core is not v3's,
// so y is compared with v3 at the f32 tolerance, not bit for bit.
//
// BF16 experts (FMT 1). Before this form they ran on v1 (moe-mma.cu k_moe_mma: wmma 16x16x16 through a bf16 copy of the
// tile in shared memory, 32-token tiles); Kimi-Linear-48B prefill at T=512 spent 55.6 of its 89 ms there (session 12
// call B). The A fragment of lane q is then simply the row's 16 bytes of columns 8q .. 8q + 7 of the 32-column block:
// 4 bf16 pairs in exactly the order fp4x8_pairs gives the FP4 form, so the planes, their permutation and the wgmmas are
// shared. A stage holds 128 bytes per row (64 columns), 16-byte chunks swizzled by the row's parity (chunk ^ 4 on odd
// rows: the 8 lanes of a read phase take rows g and g + 1 and land on all 32 banks); two stages, so that two blocks
// still fit an SM (2 x 99 KB).
//
// MXFP4 in the shift form (FMT 3, cuda_options::moe_mma_v4_shift, the default since session 21): the same stages and
// wgmmas, the A fragments from fp4.cuh fp4_a_pairs_shift (each nibble's bits shifted into a bf16 of value x 2^-126, the
// 2^126 folded into the scale's multiply) instead of the byte-permute table of fp4_a_pairs. Its pairs hold columns
// (8q + r, 8q + r + 4), so the activation planes follow m4s_pos instead of m4_pos (k_split_planes4s, and the gate/up
// epilogue's h). Measured 6% faster on the H100 under both precision policies (session 21 call B). One multiply by the
// scale per pair, exact for scale bytes <= 128 only: the backend picks this form for such expert tables only.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cp-async.cuh"
#include "backend/cuda/fp4.cuh"
#include "backend/cuda/moe-mma-blocks.cuh"
#include "backend/cuda/smem-attr.cuh"

#include <algorithm>

namespace perigee::cuda {

namespace {

constexpr int k_m4_rows = 256, k_m4_kt = 64, k_m4_tok = 64, k_m4_threads = 256;
constexpr int k_m4_xbytes = k_m4_tok * 128;                        // a plane of a stage: 64 tokens x 64 bf16, 8 KB
constexpr int k_m4_cld = k_m4_rows + 4;                            // floats per token row of the epilogue tile
constexpr int64_t k_m4_max_smem = 113 * 1024;   // two blocks per SM

// The weight format's stage geometry. FMT 2 (MXFP4): 32 bytes of raw FP4 per row and K-tile (8 KB a stage), 3 stages,
// the E8M0 scales of the block's rows copied once. FMT 1 (BF16): 128 bytes per row and K-tile (32 KB), 2 stages.
template <int FMT> struct m4_fmt {
    static_assert(FMT >= 1 && FMT <= 3, "v4: BF16, MXFP4 or MXFP4 in the shift form");
    static constexpr int row_bytes = FMT == 1 ? k_m4_kt * 2 : k_m4_kt / 2;   // one row's K-tile
    static constexpr int stages = FMT == 1 ? 2 : 3;
    static constexpr int wbytes = k_m4_rows * row_bytes;
    static constexpr int stage_bytes = 2 * k_m4_xbytes + wbytes;          // planes first, 1024-byte aligned
    static constexpr int pipe_bytes = stages * stage_bytes;
    static constexpr int wcopies = wbytes / 16 / k_m4_threads;            // 16-byte weight copies per thread per stage
    static_assert(k_m4_tok * k_m4_cld * 4 <= pipe_bytes, "v4: the epilogue tile lives in the pipeline's memory");
    static_assert(k_m4_xbytes % 1024 == 0 && stage_bytes % 1024 == 0, "v4: swizzle atoms are 1024-byte aligned");
    static_assert(wcopies * 16 * k_m4_threads == wbytes, "v4: the stage's weights split evenly over the threads");
};

// + 1024: the dynamic window is aligned up to the swizzle atom at run time.
template <int FMT>
constexpr int64_t m4_smem(int64_t K) { return 1024 + m4_fmt<FMT>::pipe_bytes + (FMT != 1 ? k_m4_rows * mma_scale_ld(K) : 0); }

// Plane position of column c inside its 32-column block (the k order of the A fragments; see the top of the file):
// c = 8 q + 4 s + j -> 16 s + 2 q + j (j < 2) or 16 s + 8 + 2 q + j - 2.
__host__ __device__ constexpr int m4_pos(int c) {
    const int q = c >> 3, s = (c >> 2) & 1, j = c & 3;
    return 16 * s + (j >= 2 ? 8 : 0) + 2 * q + (j & 1);
}
// Every plane position holds exactly one column (a permutation of 0..31: no column lost, none written twice).
constexpr bool is_block_permutation(int (*pos)(int)) {
    bool seen[32] = {};
    for (int c = 0; c < 32; ++c) {
        const int p = pos(c);
        if (p < 0 || p >= 32 || seen[p]) return false;
        seen[p] = true;
    }
    return true;
}
static_assert(is_block_permutation(m4_pos), "v4: the plane order must be a permutation of each 32-column block");

// FMT 3, the shift form (fp4.cuh fp4x8_shift_pairs): lane q's word gives the pairs of columns (8 q + r, 8 q + r + 4),
// r = 0..3, and pair r feeds step r / 2, logical k 2 q (r even) or 2 q + 8 (r odd). Column c = 8 q + r' (r' = 0..7)
// therefore sits at 16 ((r' >> 1) & 1) + 2 q + 8 (r' & 1) + (r' >> 2): a column and the one 4 further on, side by side.
__host__ __device__ constexpr int m4s_pos(int c) {
    const int q = c >> 3, r = c & 7;
    return 16 * ((r >> 1) & 1) + 2 * q + 8 * (r & 1) + (r >> 2);
}
static_assert(is_block_permutation(m4s_pos), "v4: the shift form's plane order must be a permutation of each 32-column block");
// (c, c + 4) for c % 8 < 4 land on adjacent positions, low one first: the split kernel writes them as one bf16 pair.
static_assert(m4s_pos(1) + 1 == m4s_pos(5) && m4s_pos(10) + 1 == m4s_pos(14) && m4s_pos(27) + 1 == m4s_pos(31),
              "v4: the shift form's pairs are adjacent");
template <int FMT>
__host__ __device__ constexpr int m4_pos_of(int c) { return FMT == 3 ? m4s_pos(c) : m4_pos(c); }

// x [rows, D] (fp32) -> bf16 hi + lo planes [rows, D] in v4's column order (lo not written when !xsplit). D % 32 == 0.
// Each thread takes 4 columns c .. c + 3 (c % 4 == 0): positions m4_pos(c) and m4_pos(c + 2), two pairs each.
__global__ void k_split_planes4(const float * __restrict__ x, int64_t n, bool xsplit, __nv_bfloat16 * __restrict__ hi,
                                __nv_bfloat16 * __restrict__ lo) {
    pdl_enter();
    for (int64_t i = 4 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x); i < n; i += 4 * int64_t(gridDim.x) * blockDim.x) {
        const int cb = int(i & 31);
        const int64_t p0 = (i & ~int64_t(31)) + m4_pos(cb), p1 = (i & ~int64_t(31)) + m4_pos(cb + 2);
        __nv_bfloat162 h[2], l[2];
        split_hi_lo(*reinterpret_cast<const float4 *>(x + i), xsplit, h, l);
        *reinterpret_cast<__nv_bfloat162 *>(hi + p0) = h[0];
        *reinterpret_cast<__nv_bfloat162 *>(hi + p1) = h[1];
        if (xsplit) {   // (hi-only passes never read the lo plane)
            *reinterpret_cast<__nv_bfloat162 *>(lo + p0) = l[0];
            *reinterpret_cast<__nv_bfloat162 *>(lo + p1) = l[1];
        }
    }
}

// The same for the shift form (FMT 3): each thread takes 8 columns c .. c + 7 (c % 8 == 0) and writes the pairs
// (c + r, c + r + 4), r = 0..3, at m4s_pos(c + r).
__global__ void k_split_planes4s(const float * __restrict__ x, int64_t n, bool xsplit, __nv_bfloat16 * __restrict__ hi,
                                 __nv_bfloat16 * __restrict__ lo) {
    pdl_enter();
    for (int64_t i = 8 * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x); i < n; i += 8 * int64_t(gridDim.x) * blockDim.x) {
        const int cb = int(i & 31);
        const float4 a = *reinterpret_cast<const float4 *>(x + i), b = *reinterpret_cast<const float4 *>(x + i + 4);
        const float4 pr[2] = {make_float4(a.x, b.x, a.y, b.y), make_float4(a.z, b.z, a.w, b.w)};   // (c, c + 4) pairs
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
            __nv_bfloat162 h[2], l[2];
            split_hi_lo(pr[h2], xsplit, h, l);
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int64_t p = (i & ~int64_t(31)) + m4s_pos(cb + 2 * h2 + u);
                *reinterpret_cast<__nv_bfloat162 *>(hi + p) = h[u];
                if (xsplit) *reinterpret_cast<__nv_bfloat162 *>(lo + p) = l[u];
            }
        }
    }
}

// wgmma.mma_async m64nNk16, A (bf16) from registers, B (bf16) from shared memory by descriptor (K-major), fp32
// accumulators d[N / 2] += A B. One overload per N used by v4 (8 .. 64 tokens).
__device__ __forceinline__ void wgmma_rs(float (&d)[4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3"
                 "}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7"
                 "}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[12], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11"
                 "}, {%12,%13,%14,%15}, %16, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[20], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19"
                 "}, {%20,%21,%22,%23}, %24, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[24], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23"
                 "}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[28], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27"
                 "}, {%28,%29,%30,%31}, %32, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator registers across the asynchronous MMAs (they are written by the tensor
// core between the issue and the wait).
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async wrote the stage through the generic proxy; wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Descriptor of a K-major bf16 tile with 128-byte rows (64 columns) and the 128-byte swizzle: start address >> 4
// (bits 0-13), leading byte offset unused with a swizzle (1, bits 16-29), stride byte offset 1024 >> 4 between groups of
// 8 rows (bits 32-45), base offset 0 (atoms 1024-byte aligned), swizzle mode 1 = 128 B (bits 62-63). A k16 step
// further along the rows starts 32 bytes later (the swizzle is applied to the address bits): the low word + 2.
constexpr uint32_t k_m4_desc_hi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t m4_desc_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t m4_desc(uint32_t lo) { return (uint64_t(k_m4_desc_hi) << 32) | lo; }

// What a pass of v4 needs from its block (the pass's tokens' offsets are in xoff).
template <int FMT>
struct m4_block {
    const __nv_bfloat16 * xh;
    const __nv_bfloat16 * xl;
    unsigned char * sm;           // the aligned window: stages, then the scales (MXFP4)
    const unsigned char * ssm;    // [256][sld] scales (MXFP4)
    int64_t sld;
    const uint8_t * wsrc[m4_fmt<FMT>::wcopies];   // this thread's 16-byte weight copies per stage (at K-tile 0)
    int wdst[m4_fmt<FMT>::wcopies];
    const int64_t * xoff;         // [64]: plane row offsets of the pass's tokens
    int nk, nt;
};

// One pass over K for the pass's nt <= 8 NJ tokens (acc[mi] = the warpgroup's row tile mi, 64 rows, x 8 NJ tokens),
// then the products into the epilogue tile Cs [token][row] (the pipeline's memory). XS: the lo plane too.
template <int FMT, int NJ, bool XS>
__device__ __forceinline__ void m4_pass(const m4_block<FMT> & b, float * Cs) {
    using F = m4_fmt<FMT>;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    float acc[2][4 * NJ];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int r = 0; r < 4 * NJ; ++r) acc[mi][r] = 0.0f;
    // stage st <- K-tile kt: raw weights (F::wcopies x 16 B per thread), the tokens' plane chunks (chunk tid % 8 of
    // tokens tid / 8 and tid / 8 + 32, hi and lo)
    auto issue = [&](int kt, int st) {
        unsigned char * X = b.sm + st * F::stage_bytes;
        unsigned char * W = X + 2 * k_m4_xbytes;
        const int64_t k0 = int64_t(kt) * k_m4_kt;
#pragma unroll
        for (int i = 0; i < F::wcopies; ++i)
            if (b.wsrc[i]) cp_async16(W + b.wdst[i], b.wsrc[i] + int64_t(kt) * F::row_bytes);
        const int cc = tid & 7;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int t = (tid >> 3) + 32 * i;
            if (t < b.nt) {
                const int dst = t * 128 + ((cc ^ (t & 7)) << 4);
                cp_async16(X + dst, b.xh + b.xoff[t] + k0 + cc * 8);
                if (XS) cp_async16(X + k_m4_xbytes + dst, b.xl + b.xoff[t] + k0 + cc * 8);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < F::stages - 1; ++s) {
        if (s < b.nk) issue(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < b.nk; ++kt) {
        cp_async_wait<F::stages - 2>();
        fence_proxy_async();
        __syncthreads();   // stage kt landed for every thread; every warpgroup's MMAs on tile kt - 1 are complete
        if (kt + F::stages - 1 < b.nk) issue(kt + F::stages - 1, (kt + F::stages - 1) % F::stages);
        cp_async_commit();
        const unsigned char * X = b.sm + (kt % F::stages) * F::stage_bytes;
        const unsigned char * W = X + 2 * k_m4_xbytes;
        const uint32_t dh = m4_desc_lo(smem_u32(X)), dl = m4_desc_lo(smem_u32(X + k_m4_xbytes));
        // A fragments of scale block kb (columns 32 kb .. 32 kb + 31 of the K-tile) of this warp's 16 rows of the
        // warpgroup's two m64 tiles, both k16 steps (v3's dequant; BF16: the row's 16 bytes): af[mi][step][reg]
        auto dequant = [&](int kb, uint32_t (&af)[2][2][4]) {
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {   // row g, row g + 8
                    const int row = 128 * wg + 64 * mi + 16 * wq + g + 8 * hr;
                    uint32_t p[4];
                    if constexpr (FMT == 1) {
                        const uint4 v = *reinterpret_cast<const uint4 *>(W + row * 128 + (((kb * 4 + q) ^ ((row & 1) << 2)) << 4));
                        p[0] = v.x;
                        p[1] = v.y;
                        p[2] = v.z;
                        p[3] = v.w;
                    } else {
                        const uint32_t wv = *reinterpret_cast<const uint32_t *>(W + row * 32 + ((kb ^ ((row >> 2) & 1)) << 4) + q * 4);
                        const uint32_t sb = b.ssm[row * b.sld + kt * 2 + kb];
                        if constexpr (FMT == 3) fp4_a_pairs_shift(wv, sb, p);
                        else fp4_a_pairs(wv, e8m0_bf16x2(sb), p);
                    }
                    af[mi][0][hr] = p[0];
                    af[mi][0][2 + hr] = p[1];
                    af[mi][1][hr] = p[2];
                    af[mi][1][2 + hr] = p[3];
                }
            }
        };
        // the 4 (8 with lo) wgmmas of scale block kb, one commit group
        auto mma = [&](int kb, const uint32_t (&af)[2][2][4]) {
            reg_fence(acc[0]);
            reg_fence(acc[1]);
            wgmma_fence();
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const uint32_t off = uint32_t(kb * 2 + s) * (32 >> 4);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    wgmma_rs(acc[mi], af[mi][s], m4_desc(dh + off));
                    if (XS) wgmma_rs(acc[mi], af[mi][s], m4_desc(dl + off));
                }
            }
            wgmma_commit();
        };
        // one fragment set: each scale block's wgmmas complete before the next block's dequant (two sets, the second
        // dequantized while the first block's wgmmas run, measured no faster: session 7 call C, 8.64 vs 8.59 ms)
        uint32_t af[2][2][4];
        dequant(0, af);
        mma(0, af);
        wgmma_wait_all();
        reg_fence(acc[0]);
        reg_fence(acc[1]);
        dequant(1, af);
        mma(1, af);
        wgmma_wait_all();   // the stage is refilled after the next barrier; the fragments are rewritten
        reg_fence(acc[0]);
        reg_fence(acc[1]);
    }
    cp_async_wait<0>();
    __syncthreads();   // the pipeline's memory becomes the epilogue tile
    // acc[mi][4 j + r]: row 128 wg + 64 mi + 16 wq + g (+ 8 for r >= 2), token 8 j + 2 q + (r & 1)
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int row = 128 * wg + 64 * mi + 16 * wq + g, tok = 8 * j + 2 * q;
            Cs[tok * k_m4_cld + row] = acc[mi][4 * j];
            Cs[(tok + 1) * k_m4_cld + row] = acc[mi][4 * j + 1];
            Cs[tok * k_m4_cld + row + 8] = acc[mi][4 * j + 2];
            Cs[(tok + 1) * k_m4_cld + row + 8] = acc[mi][4 * j + 3];
        }
}

// NM == 2: gate/up; xh / xl = x's planes [T, ldx] (v4 order), token row = slot / k_div; writes h's planes oh / ol
// [S, d_ff] in v4 order (GLU applied; ol only when xsplit). NM == 1: down; xh / xl = h's planes [S, ldx], token row = slot; writes of32 =
// ybuf [S, d_out]. grid (ceil(rows / (256 / NM)), A); dynamic smem m4_smem(K).
template <int NM, int FMT>
__global__ void __launch_bounds__(k_m4_threads, 2)
    k_moe_mma4(const __nv_bfloat16 * __restrict__ xh, const __nv_bfloat16 * __restrict__ xl, int64_t ldx, int64_t k_div,
               const dexpert * __restrict__ ex, int64_t A, int64_t S, const int32_t * __restrict__ gw, dexperts_cfg c,
               int n_min, bool xsplit, __nv_bfloat16 * __restrict__ oh, __nv_bfloat16 * __restrict__ ol,
               float * __restrict__ of32) {
    pdl_enter();
    extern __shared__ unsigned char sm4_raw[];
    const int a = blockIdx.y;
    if (a >= gw[0]) return;
    const int n = gw[2 + 2 * A + S + a];
    if (n < n_min) return;
    const int e = gw[1 + a];
    const int32_t * slots = gw + 2 + 2 * A + gw[1 + A + a];
    constexpr int BN = k_m4_rows / NM;   // output rows per block
    const int64_t n_rows = NM == 2 ? c.d_ff : c.d_out;
    const int64_t r0 = int64_t(blockIdx.x) * BN;
    const int tid = threadIdx.x;
    const dexpert_matrix m0 = NM == 2 ? ex[e].gate : ex[e].down;
    const dexpert_matrix m1 = NM == 2 ? ex[e].up : m0;
    const int64_t K = m0.in, ksc = K / 32;
    unsigned char * sm = sm4_raw + ((1024u - (smem_u32(sm4_raw) & 1023u)) & 1023u);
    unsigned char * Ssm = sm + m4_fmt<FMT>::pipe_bytes;
    float * Cs = reinterpret_cast<float *>(sm);   // [64][k_m4_cld]: the epilogue tile, after the K loop
    __shared__ int64_t xoff[k_m4_tok];

    m4_block<FMT> b;
    b.xh = xh;
    b.xl = xl;
    b.sm = sm;
    b.ssm = Ssm;
    b.sld = mma_scale_ld(K);
    b.xoff = xoff;
    b.nk = int(K / k_m4_kt);
    if constexpr (FMT == 1) {
#pragma unroll
        for (int i = 0; i < m4_fmt<1>::wcopies; ++i) {   // row ch / 8, 16-byte chunk ch % 8 (chunk ^ 4 on odd rows)
            const int ch = tid + i * k_m4_threads, row = ch >> 3, chunk = ch & 7;
            const int64_t wr = r0 + (NM == 2 ? row % BN : row);
            const auto * w = static_cast<const uint8_t *>((NM == 2 && row >= BN) ? m1.w : m0.w);
            b.wsrc[i] = wr < n_rows ? w + wr * K * 2 + chunk * 16 : nullptr;
            b.wdst[i] = row * 128 + ((chunk ^ ((row & 1) << 2)) << 4);
        }
    } else {
#pragma unroll
        for (int i = 0; i < m4_fmt<FMT>::wcopies; ++i) {   // row ch / 2, half ch % 2 (halves swapped for rows 4..7 mod 8)
            const int ch = tid + i * k_m4_threads, row = ch >> 1, half = ch & 1;
            const int64_t wr = r0 + (NM == 2 ? row % BN : row);
            const uint8_t * pk = (NM == 2 && row >= BN) ? m1.packed : m0.packed;
            b.wsrc[i] = wr < n_rows ? pk + wr * (K / 2) + half * 16 : nullptr;
            b.wdst[i] = row * 32 + ((half ^ ((row >> 2) & 1)) << 4);
        }
    }
    // the block's scales, once (completed with the first pass's first stage). This is mma_copy_scales (moe-mma-blocks.cuh)
    // written out: calling it gave the same kernel another register allocation (cubin .text compared, session 7) after
    // the device time to retest v4 was spent; switch with the next GPU run of test-moe-cuda mma_v4_prefill.
    for (int ch = tid; FMT != 1 && ch < k_m4_rows * int(ksc / 16); ch += k_m4_threads) {
        const int row = ch / int(ksc / 16), part = ch % int(ksc / 16);
        const int64_t wr = r0 + (NM == 2 ? row % BN : row);
        if (wr >= n_rows) continue;
        const uint8_t * sc = (NM == 2 && row >= BN) ? m1.scale : m0.scale;
        const uint8_t * src = sc + wr * ksc + part * 16;
        unsigned char * dst = Ssm + row * b.sld + part * 16;
        if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) cp_async16(dst, src);
        else
            for (int i = 0; i < 16; ++i) dst[i] = src[i];
    }

    for (int t0 = 0; t0 < n; t0 += k_m4_tok) {
        const int nt = min(k_m4_tok, n - t0);
        const int nj = (nt + 7) >> 3;
        if (tid < nt) xoff[tid] = int64_t(slots[t0 + tid] / k_div) * ldx;
        __syncthreads();
        b.nt = nt;
        switch (nj * 2 + (xsplit ? 1 : 0)) {
#define PG_M4_PASS(J)                                       \
        case 2 * J: m4_pass<FMT, J, false>(b, Cs); break;    \
        case 2 * J + 1: m4_pass<FMT, J, true>(b, Cs); break;
            PG_M4_PASS(1) PG_M4_PASS(2) PG_M4_PASS(3) PG_M4_PASS(4) PG_M4_PASS(5) PG_M4_PASS(6) PG_M4_PASS(7) PG_M4_PASS(8)
#undef PG_M4_PASS
            default: break;
        }
        __syncthreads();
        for (int i = tid; i < nt * BN; i += k_m4_threads) {
            const int t = i / BN, rr = i % BN;
            if (r0 + rr >= n_rows) continue;
            const int64_t s = slots[t0 + t];
            if constexpr (NM == 2) {
                const float gt = Cs[t * k_m4_cld + rr], up = Cs[t * k_m4_cld + BN + rr];
                const float v = c.act == 1 ? situ_d(gt, up, c.situ_beta, c.situ_linear_beta) : silu_d(gt) * up;
                const int64_t col = r0 + rr, o = s * n_rows + (col & ~int64_t(31)) + m4_pos_of<FMT>(int(col & 31));
                const __nv_bfloat16 h = __float2bfloat16_rn(v);
                oh[o] = h;
                if (xsplit) ol[o] = __float2bfloat16_rn(v - __bfloat162float(h));   // (hi-only passes never read it)
            } else {
                of32[s * n_rows + r0 + rr] = Cs[t * k_m4_cld + rr];
            }
        }
        __syncthreads();   // Cs is the next pass's pipeline; xoff is rewritten
    }
}

// v4's traits for mma_stages (moe-mma-blocks.cuh), per weight format.
template <int FMT>
struct mma4_traits {
    template <int NM> static constexpr auto kern = k_moe_mma4<NM, FMT>;
    static constexpr auto split = FMT == 3 ? k_split_planes4s : k_split_planes4;
    static constexpr int rows = k_m4_rows, threads = k_m4_threads;
    static constexpr int64_t max_smem = k_m4_max_smem;
    static constexpr int64_t smem(int64_t K) { return m4_smem<FMT>(K); }
};

// fp4_dequant_forms: word i with scale byte i -> its 8 values (column order) by the table form and by the shift form
// (every byte, also those above the shift form's precondition: the test's control).
__global__ void k_fp4_forms(const uint32_t * __restrict__ q, const uint8_t * __restrict__ sb, int64_t n, float * __restrict__ tab,
                            float * __restrict__ sft) {
    pdl_enter();
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint32_t a[4], b[4];
        fp4_a_pairs(q[i], e8m0_bf16x2(sb[i]), a);   // pairs (2r, 2r + 1)
        fp4_a_pairs_shift(q[i], sb[i], b);          // pairs (r, r + 4)
        for (int r = 0; r < 4; ++r) {
            tab[8 * i + 2 * r] = __uint_as_float(a[r] << 16);
            tab[8 * i + 2 * r + 1] = __uint_as_float(a[r] & 0xFFFF0000u);
            sft[8 * i + r] = __uint_as_float(b[r] << 16);
            sft[8 * i + r + 4] = __uint_as_float(b[r] & 0xFFFF0000u);
        }
    }
}

} // namespace

cudaError_t fp4_dequant_forms(const uint32_t * q, const uint8_t * scale, int64_t n, float * table, float * shift, cudaStream_t st) {
    return launch_k(k_fp4_forms, unsigned(std::min<int64_t>((n + 255) / 256, 1024)), 256, 0, st, q, scale, n, table, shift);
}

// MXFP4: K multiples of 512 (the scale copy's 16-byte chunks); BF16: of the 64-column K-tile. Both: x's planes fit
// ybuf (Din <= k d_out), the shared memory within two blocks per SM.
bool moe_mma4_supported(int vfmt, int64_t Din, int64_t k, const dexperts_cfg & c) {
    if (Din > k * c.d_out) return false;
    if (vfmt == 2)
        return Din % 512 == 0 && c.d_ff % 512 == 0 && m4_smem<2>(Din) <= k_m4_max_smem && m4_smem<2>(c.d_ff) <= k_m4_max_smem;
    if (vfmt == 1) return Din % k_m4_kt == 0 && c.d_ff % k_m4_kt == 0 && m4_smem<1>(Din) <= k_m4_max_smem;
    return false;
}

cudaError_t launch_moe_mma4_stages(int vfmt, const float * x, int64_t Din, int64_t k, const dexpert * experts, int64_t A,
                                   int64_t S, const int32_t * gw, const dexperts_cfg & c, float * hbuf, float * ybuf,
                                   cudaStream_t st, int n_min, bool xsplit, bool shift) {
    if (vfmt == 1) return mma_stages<mma4_traits<1>>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, xsplit);
    if (vfmt == 2 && shift) return mma_stages<mma4_traits<3>>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, xsplit);
    if (vfmt == 2) return mma_stages<mma4_traits<2>>(x, Din, k, experts, A, S, gw, c, hbuf, ybuf, st, n_min, xsplit);
    return cudaErrorInvalidValue;
}

} // namespace perigee::cuda
