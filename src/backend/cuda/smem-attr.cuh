// The one-time opt-in of a kernel above 48 KB of dynamic shared memory, per (kernel, device): cudaFuncSetAttribute is a
// property of the function on the current device, so a per-process flag would leave a second device without it, and a
// cache per function *type* would set one instantiation's limit only (session 6 call H: every decode-v7 gate/up form
// has the same signature; the 84 KB form then failed to launch). Host code (moe.cu's decode v7, moe-mma.cu).
#pragma once
#include <cuda_runtime.h>

#include <mutex>

namespace perigee::cuda {

constexpr int k_smem_attr_max_devices = 64;

// Sets KERN's dynamic shared-memory limit to max_smem (and the carveout to max shared) on the current device, once;
// returns the result of that first attempt on every later call.
template <auto KERN>
cudaError_t smem_attr(size_t max_smem) {
    static std::mutex mu;
    static cudaError_t done[k_smem_attr_max_devices];
    static bool tried[k_smem_attr_max_devices] = {};
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev < 0 || dev >= k_smem_attr_max_devices) return cudaErrorInvalidDevice;
    const std::lock_guard<std::mutex> lock(mu);
    if (!tried[dev]) {
        e = cudaFuncSetAttribute(KERN, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem));
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(KERN, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
        done[dev] = e;
        tried[dev] = true;
    }
    return done[dev];
}

} // namespace perigee::cuda
