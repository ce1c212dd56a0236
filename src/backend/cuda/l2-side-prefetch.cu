// The decode graph's side-branch L2 prefetch (cuda_options::l2_side_prefetch_mib): a kernel node added to a captured
// step beside the chain, never in it. It depends on the completion of one weight-streaming launch p and has no
// successor, so it runs while the latency-bound launches after p (the KDA tail, the norm / router / selection) leave the
// HBM idle, and asks the weights of the next streaming launch into L2. Nothing in the chain waits for it: a prefetch
// changes no value, so every output is bit for bit the graph without it (test-fuse-cuda side_prefetch_replay_bitwise).
//
// Why a graph branch (session 23): session 10 measured four prefetch forms issued by chain kernels themselves (the
// route's selection block, the latency-bound kernels after their wait, each GEMV block before its wait) and removed all
// of them: cp.async.bulk.prefetch.L2 drains at ~250 GB/s per issuing SM, and a chain kernel cannot end before its
// prefetches are issued, so one block's prefetch lengthened the chain (+47 us for 12 MB), and many blocks' competed with
// the streams they were meant to hide behind. A branch node issues from many SMs at once and delays no chain kernel.
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

// One thread per 16 KiB chunk of the ranges laid end to end (a grid-stride loop); each chunk one bulk prefetch. The
// ranges are 16-byte aligned with sizes a multiple of 16 (add_l2_prefetch_node trims them).
__global__ void k_l2_side_prefetch(l2_ranges r) {
    constexpr uint64_t chunk = 16384;
    uint64_t total = 0;
    for (int i = 0; i < r.n; ++i) total += r.bytes[i];
    const uint64_t n_chunks = (total + chunk - 1) / chunk;
    for (uint64_t c = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < n_chunks; c += uint64_t(gridDim.x) * blockDim.x) {
        uint64_t off = c * chunk;
        int i = 0;
        while (i < r.n && off >= r.bytes[i]) off -= r.bytes[i++];
        if (i == r.n) break;
        const uint64_t left = r.bytes[i] - off;
        prefetch_l2_bulk(static_cast<const char *>(r.p[i]) + off, uint32_t(left < chunk ? left : chunk));
    }
}

} // namespace

cudaError_t add_l2_prefetch_node(cudaGraph_t g, cudaGraphNode_t dep, const l2_ranges & in, int blocks, cudaGraphNode_t * out) {
    l2_ranges r{};
    for (int i = 0; i < in.n && i < l2_ranges::k_max; ++i) {   // 16-byte aligned inside each range
        const uintptr_t a = reinterpret_cast<uintptr_t>(in.p[i]), b = a + in.bytes[i];
        const uintptr_t a16 = (a + 15) & ~uintptr_t(15), b16 = b & ~uintptr_t(15);
        if (b16 <= a16) continue;
        r.p[r.n] = reinterpret_cast<const void *>(a16);
        r.bytes[r.n] = uint64_t(b16 - a16);
        ++r.n;
    }
    if (r.n == 0) return cudaErrorInvalidValue;
    void * args[] = {&r};
    cudaKernelNodeParams p{};
    p.func = reinterpret_cast<void *>(k_l2_side_prefetch);
    p.gridDim = dim3(unsigned(blocks < 1 ? 1 : blocks));
    p.blockDim = dim3(32);
    p.sharedMemBytes = 0;
    p.kernelParams = args;
    p.extra = nullptr;
    return cudaGraphAddKernelNode(out, g, &dep, 1, &p);
}

} // namespace perigee::cuda
