// Asynchronous global -> shared copies (cp.async, sm_80+) and shared loads by address, for the kernels that stage data
// in shared memory through a pipeline (moe-mma.cu's tensor-core experts, moe.cu's decode v7 ring, mla.cu's key tiles).
// Every asm carries a memory clobber: the compiler must not move a shared load above the wait that makes its data
// valid, nor a copy above the reads of the slot it refills.
#pragma once
#include <cstdint>

namespace perigee::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void * p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes, L2 only (.cg: streamed data that must not evict L1).
__device__ __forceinline__ void cp_async16(void * dst, const void * src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
// 16 bytes of which the first src_bytes are read, the rest zero-filled (src_bytes 0: a zero row).
__device__ __forceinline__ void cp_async16_zfill(void * dst, const void * src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes) : "memory");
}
// 4 or 8 bytes (.ca: .cg takes 16 only).
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void * dst, const void * src) {
    static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_u32(dst)), "l"(src), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's committed groups are pending (its own copies: other threads' need a barrier too).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Shared loads by address (ld.shared even where the pointer has passed through casts that hide its state space).
__device__ __forceinline__ uint4 lds128(const void * p) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(smem_u32(p)) : "memory");
    return r;
}
__device__ __forceinline__ uint32_t lds_u8(const void * p) {
    uint32_t r;
    asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(r) : "r"(smem_u32(p)) : "memory");
    return r;
}

} // namespace perigee::cuda
