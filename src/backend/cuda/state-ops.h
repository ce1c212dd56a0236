// Slot operations on the device-resident STATE pools (backend.h: slot_zero, slot_snapshots) for the
// CUDA backend. Copies and memsets on the backend's stream, so they are ordered with its runs; the
// pools' device buffers are looked up through `resolve` at every call (it uploads a pool that is not
// resident yet, and sees a new buffer after state_reload()).
//
// COST. One K3 slot (69 KDA layers x (3 conv windows [96*128, 3] + recurrent [96, 128, 128]) F32) is
// 464,633,856 bytes (443 MiB); Kimi-Linear-48B: 44,892,160 bytes (43 MiB); models/default: 6 KDA layers x
// 74,752 B = 448,512 bytes. A save or load is one device-to-device copy per pool (~0.6 ms for a K3 slot
// at ~1.5 TB/s copy rate); zeroing is one memset per pool. The snapshot pool is device memory:
// n x bytes_per_snapshot (K3: 64 snapshots = 29.7 GB); a runner sized from a memory budget counts them
// (plan_pools' n_snapshots, runner_options.prefix_snapshots) and the engine refuses more than it reserved.
#pragma once
#include "backend/backend.h"

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <vector>

namespace perigee::cuda {

// The device copy of a STATE pool (uploaded on first use).
using state_resolver = std::function<void *(tensor &)>;

// Zeroes row `slot` of every pool's device copy (asynchronous on `st`).
void slot_zero(const std::vector<tensor *> & pools, int slot, int device, cudaStream_t st, const state_resolver & resolve);

// A pool of n slot snapshots in device memory.
std::unique_ptr<slot_snapshots> slot_snapshots_new(const std::vector<tensor *> & pools, int n, int device, cudaStream_t st,
                                                   state_resolver resolve);

} // namespace perigee::cuda
