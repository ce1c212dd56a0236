// kernel-timeline: where the time of a replayed CUDA graph goes, kernel by kernel, from CUPTI's activity records.
//
// Nsight Compute times each kernel alone with flushed caches (launch, ramp and tail inside every figure) and nsys is
// not on the GPU machine, so neither says what a kernel adds to a graph step whose launches overlap through PDL. CUPTI's
// concurrent-kernel records carry the GPU start and end of every kernel of every replay. Per replay, sorted by start:
//   exposed(k) = end(k) - max(end(j) for j < k)   (the time kernel k adds to the step; the exposed times sum to the span)
//   lead(k)    = start(k) - end(k - 1)            (negative: launched early through PDL, waiting or prefetching)
// Tracing costs a little per kernel; the report prints the traced span next to the untraced step time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace perigee::timeline {

struct kernel_rec {
    std::string name;   // demangled, without the anonymous namespace and the parameter list
    uint64_t start = 0, end = 0;   // ns, GPU clock
    uint32_t corr = 0;   // correlation id: one per cudaGraphLaunch
    int grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
};

bool available();   // false: built without CUPTI (start() then throws)
void start();   // enable the concurrent-kernel activity records
std::vector<kernel_rec> stop();   // flush (the caller synchronized), disable, return every record since start()

// Per-position medians over the replays (the first `skip` replays dropped) and the exposed time summed by kernel name.
// untraced_ms: the graph step time measured without tracing (printed beside the traced span).
void report(std::FILE * f, const std::vector<kernel_rec> & recs, int skip, double untraced_ms, const std::string & title);

} // namespace perigee::timeline
