// Device-wide counters for the persistent decode kernels (moe-layer-decode.cu, kda-oproj-decode.cu): a grid of exactly
// the co-resident blocks runs several phases with counters in place of kernel boundaries.
//
// Protocol: a phase's producers write their outputs, then (block_arrive, or one thread after its own writes) fence at
// device scope and add 1 to a counter; consumers wait (block_wait_count) until it reaches the number of producers, with
// acquire semantics, so every write counted is visible to the whole block after the wait. Data written by other blocks
// is read after the wait with loads that bypass L1 (__ldcg / XM_L2). The last block to leave resets every counter
// (grid_exit_reset), so each launch finds them 0 (they must be 0 before the first launch). Requires every block of the
// grid to be resident at once (the launcher sizes the grid by the occupancy query) and one such grid at a time per
// device (the engine runs one decode stream per device).
#pragma once
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned * p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// How long a block waits at a counter before it gives up: 4 s, far beyond a legitimate wait (the previous kernel's drain
// plus one phase: microseconds), so only a grid that can never complete (not all resident) should reach it.
constexpr uint64_t k_grid_wait_ns = 4000000000ull;

// One thread spins until *ctr >= target (acquire), then the block passes a barrier: every thread's later reads see the
// writes counted. Past k_grid_wait_ns it flags ERR_SYNC_TIMEOUT and lets the block go on (wrong outputs, flagged,
// rather than a hung device).
__device__ __forceinline__ void block_wait_count(const unsigned * ctr, unsigned target, int * err) {
    if (threadIdx.x == 0) {
        const uint64_t t0 = global_ns();
        while (ld_acquire_gpu(ctr) < target) {
            __nanosleep(32);
            if (global_ns() - t0 > k_grid_wait_ns) {
                atomicOr(err + ERR_SYNC_TIMEOUT, 1);
                break;
            }
        }
    }
    __syncthreads();
}

// The block's writes so far counted once on ctr: a block barrier, then one thread's device-scope fence and add (the
// pattern of a cooperative grid sync).
__device__ __forceinline__ void block_arrive(unsigned * ctr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(ctr, 1u);
    }
}

// The last of the grid's blocks to get here resets ctrs[0 .. n) and the exit counter itself. Every block must call it
// once, after its last wait on any of them.
__device__ __forceinline__ void grid_exit_reset(unsigned * ctrs, int n, unsigned * exit_ctr) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(exit_ctr, 1u) == gridDim.x - 1u) {
        for (int i = 0; i < n; ++i) atomicExch(ctrs + i, 0u);
        atomicExch(exit_ctr, 0u);
    }
}

// Host: the grid of a persistent kernel: every block of `threads` threads that fits on the device at once (SMs x the
// occupancy query), cached per device ordinal; 0 when a query fails (the launcher refuses).
template <auto Kernel, int threads>
int resident_grid() {
    constexpr int k_max_dev = 64;
    static int grid[k_max_dev] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= k_max_dev) return 0;
    if (grid[dev] == 0) {
        int sms = 0, per = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, Kernel, threads, 0) != cudaSuccess)
            return 0;
        grid[dev] = sms * per;
    }
    return grid[dev];
}

} // namespace perigee::cuda
