// Slot zeroing and slot snapshots on the device-resident STATE pools (state-ops.h).
#include "backend/cuda/state-ops.h"

#include <algorithm>

#define PG_CUDA_CHECK(call)                                                                              \
    do {                                                                                                 \
        const cudaError_t pg_e_ = (call);                                                                \
        PG_CHECK(pg_e_ == cudaSuccess, "{} failed: {} ({})", #call, cudaGetErrorString(pg_e_), int(pg_e_)); \
    } while (0)

namespace perigee::cuda {

void slot_zero(const std::vector<tensor *> & pools, int slot, int device, cudaStream_t st, const state_resolver & resolve) {
    const int64_t n = slot_pools_check(pools, "slot_zero");
    PG_CHECK(pools.empty() || (slot >= 0 && slot < n), "slot_zero: slot {} outside the pool of {}", slot, n);
    if (pools.empty()) return;
    PG_CUDA_CHECK(cudaSetDevice(device));
    for (tensor * t : pools) {
        const size_t row = t->nbytes / size_t(n);
        char * p = static_cast<char *>(resolve(*t));
        PG_CUDA_CHECK(cudaMemsetAsync(p + row * size_t(slot), 0, row, st));
    }
}

namespace {

class device_slot_snapshots final : public slot_snapshots {
public:
    device_slot_snapshots(const std::vector<tensor *> & pools, int n, int device, cudaStream_t st, state_resolver resolve)
        : pools_(pools), n_(n), dev_(device), st_(st), resolve_(std::move(resolve)) {
        PG_CHECK(n >= 0, "slot_snapshots: {} snapshots", n);
        n_slots_ = slot_pools_check(pools, "slot_snapshots");
        for (const tensor * t : pools) per_ += t->nbytes / size_t(n_slots_);
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        const size_t bytes = std::max<size_t>(per_ * size_t(n), 16);
        const cudaError_t e = cudaMalloc(&data_, bytes);
        PG_CHECK(e == cudaSuccess, "slot_snapshots: cannot allocate {} snapshots of {} bytes ({} bytes) on cuda device {}: {}", n,
                 per_, bytes, dev_, cudaGetErrorString(e));
        // Zeroed like the host pool's, so a load of a never-saved snapshot is defined.
        PG_CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes, st_));
    }
    ~device_slot_snapshots() override {
        cudaSetDevice(dev_);
        cudaStreamSynchronize(st_);
        cudaFree(data_);
    }
    int capacity() const override { return n_; }
    int64_t bytes_per_snapshot() const override { return int64_t(per_); }
    void save(int slot, int snap) override {
        check(slot, snap);
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        char * dst = static_cast<char *>(data_) + per_ * size_t(snap);
        for (tensor * t : pools_) {
            const size_t row = t->nbytes / size_t(n_slots_);
            const char * src = static_cast<const char *>(resolve_(*t)) + row * size_t(slot);
            PG_CUDA_CHECK(cudaMemcpyAsync(dst, src, row, cudaMemcpyDeviceToDevice, st_));
            dst += row;
        }
    }
    void load(int snap, int slot) override {
        check(slot, snap);
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        const char * src = static_cast<const char *>(data_) + per_ * size_t(snap);
        for (tensor * t : pools_) {
            const size_t row = t->nbytes / size_t(n_slots_);
            char * dst = static_cast<char *>(resolve_(*t)) + row * size_t(slot);
            PG_CUDA_CHECK(cudaMemcpyAsync(dst, src, row, cudaMemcpyDeviceToDevice, st_));
            src += row;
        }
    }

private:
    void check(int slot, int snap) const {
        PG_CHECK(snap >= 0 && snap < n_, "slot_snapshots: snapshot {} outside the pool of {}", snap, n_);
        PG_CHECK(slot >= 0 && slot < n_slots_, "slot_snapshots: slot {} outside the pool of {}", slot, n_slots_);
    }
    std::vector<tensor *> pools_;
    int n_;
    int dev_;
    cudaStream_t st_;
    state_resolver resolve_;
    int64_t n_slots_ = 0;
    size_t per_ = 0;
    void * data_ = nullptr;
};

} // namespace

std::unique_ptr<slot_snapshots> slot_snapshots_new(const std::vector<tensor *> & pools, int n, int device, cudaStream_t st,
                                                   state_resolver resolve) {
    return std::make_unique<device_slot_snapshots>(pools, n, device, st, std::move(resolve));
}

} // namespace perigee::cuda
