// Warp-level tensor-core helpers shared by the mma.sync kernels (moe-mma.cu, mla-prefill.cu): the bf16 hi + lo split of
// fp32 values, mma.sync m16n8k16 and ldmatrix. Fragment layouts are the PTX ISA's ("Matrix fragments for mma.m16n8k16"):
// with g = lane / 4 and q = lane % 4, A (16 x 16, row-major) register 0 holds row g, columns 2q, 2q + 1; register 1 row
// g + 8; registers 2, 3 the same rows at columns 2q + 8, 2q + 9. B (16 x 8) register 0 holds column g, rows 2q, 2q + 1;
// register 1 rows 2q + 8, 2q + 9. C (16 x 8, fp32) elements 0, 1: row g, columns 2q, 2q + 1; elements 2, 3: row g + 8.
#pragma once
#include "backend/cuda/cp-async.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace perigee::cuda {

// v = hi + lo with hi = bf16(v), lo = bf16(v - hi) (lo = 0 when !xsplit): ~16 significant bits in two bf16 planes.
__device__ __forceinline__ void split_hi_lo(float4 v, bool xsplit, __nv_bfloat162 (&h)[2], __nv_bfloat162 (&l)[2]) {
    h[0] = __floats2bfloat162_rn(v.x, v.y);
    h[1] = __floats2bfloat162_rn(v.z, v.w);
    const float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    l[0] = xsplit ? __floats2bfloat162_rn(v.x - f0.x, v.y - f0.y) : __floats2bfloat162_rn(0.0f, 0.0f);
    l[1] = xsplit ? __floats2bfloat162_rn(v.z - f1.x, v.w - f1.y) : __floats2bfloat162_rn(0.0f, 0.0f);
}

// D += A B, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 b16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte
// aligned); register i receives matrix i, thread t holding its row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
// ... transposed: thread t holds column t / 4 of matrix i, rows 2 (t % 4) and 2 (t % 4) + 1 (a B fragment from a
// row-major [k][n] tile).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

} // namespace perigee::cuda
