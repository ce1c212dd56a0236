// Programmatic Dependent Launch: the per-thread switch read by launch_k (common.cuh) and the ordering probes of
// tests/ops/cuda/test-pdl-cuda.cpp (cuda-ops.h).
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {
thread_local bool t_pdl = true;   // cuda_options::pdl's default

__global__ void k_pdl_producer(int * __restrict__ buf, int64_t n, int64_t spin, int value) {
    pdl_wait();
    pdl_trigger();   // the consumer may be scheduled from here on, long before the writes below
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        buf[i] = value;
}

__global__ void k_pdl_consumer(const int * __restrict__ buf, int64_t n, bool wait, int * __restrict__ out) {
    if (wait) pdl_wait();
    pdl_trigger();
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        out[i] = buf[i];
}

__global__ void k_pdl_step(const int * __restrict__ x, int64_t n, int add, int64_t spin, int * __restrict__ y) {
    pdl_enter();
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        y[i] = int(unsigned(x[i]) * 3u + unsigned(add) + unsigned(i));
}

unsigned probe_blocks(int64_t n) { return unsigned(n <= 0 ? 1 : n > 256 * 1024 ? 1024 : (n + 255) / 256); }
} // namespace

bool pdl_enabled() { return t_pdl; }
void pdl_set(bool on) { t_pdl = on; }

cudaError_t launch_pdl_probe_producer(int * buf, int64_t n, int64_t spin, int value, cudaStream_t st) {
    launch_k(k_pdl_producer, probe_blocks(n), 256, 0, st, buf, n, spin, value);
    return cudaGetLastError();
}
cudaError_t launch_pdl_probe_consumer(const int * buf, int64_t n, bool wait, int * out, cudaStream_t st) {
    launch_k(k_pdl_consumer, probe_blocks(n), 256, 0, st, buf, n, wait, out);
    return cudaGetLastError();
}
cudaError_t launch_pdl_probe_step(const int * x, int64_t n, int add, int64_t spin, int * y, cudaStream_t st) {
    launch_k(k_pdl_step, probe_blocks(n), 256, 0, st, x, n, add, spin, y);
    return cudaGetLastError();
}

} // namespace perigee::cuda
