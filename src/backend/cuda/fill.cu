// Device-side random fill for weights created directly on the device (GPU benchmarks of models too large to build
// on the host: k3-layers-4 is ~70 GB, the Kimi-Linear-48B geometry ~98 GB). Counter-based: value i depends only on
// (seed, i).
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {   // splitmix64 finalizer
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__global__ void k_fill_random(void * p, int64_t n, int kind, uint64_t seed, float lo, float hi) {
    pdl_enter();
    const uint64_t s = mix64(seed + 0x9E3779B97F4A7C15ull);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const uint64_t h = mix64(s ^ (uint64_t(i) * 0xD1B54A32D192ED03ull));
        const float u = float(h >> 40) * (1.0f / 16777216.0f);   // [0, 1)
        const float v = lo + (hi - lo) * u;
        switch (kind) {
            case 0: static_cast<float *>(p)[i] = v; break;
            case 1: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16(v); break;
            case 2: static_cast<__half *>(p)[i] = __float2half(v); break;
            default: {
                const int lo_i = int(lo), span = int(hi) - lo_i + 1;
                static_cast<uint8_t *>(p)[i] = uint8_t(lo_i + int((h >> 8) % uint64_t(span > 0 ? span : 1)));
            }
        }
    }
}

} // namespace

cudaError_t launch_fill_random(void * p, int64_t n, int kind, uint64_t seed, float lo, float hi, cudaStream_t st) {
    if (n <= 0) return cudaGetLastError();
    const int64_t bl = (n + 255) / 256;
    launch_k(k_fill_random, unsigned(bl > 65536 ? 65536 : bl), 256, 0, st, p, n, kind, seed, lo, hi);
    return cudaGetLastError();
}

} // namespace perigee::cuda
