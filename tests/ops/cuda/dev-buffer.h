// A device buffer for the CUDA tests: cudaMalloc in the constructor, cudaFree in the destructor, so that a test which
// stops at a failed ASSERT does not leak device memory into the next one (the process runs every case). cu() turns a
// CUDA error into an exception naming the call, which gtest reports as the case's failure.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace perigee::test {

inline void cu(cudaError_t e, const char * what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
struct dev {
    T * p = nullptr;
    size_t n = 0;
    explicit dev(size_t n_) : n(n_) { cu(cudaMalloc(reinterpret_cast<void **>(&p), std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
    explicit dev(const std::vector<T> & v) : dev(v.size()) { up(v); }
    ~dev() { cudaFree(p); }
    dev(const dev &) = delete;
    dev & operator=(const dev &) = delete;
    void up(const std::vector<T> & v) { cu(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"); }
    std::vector<T> down() const {
        std::vector<T> v(n);
        cu(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
        return v;
    }
};

} // namespace perigee::test
