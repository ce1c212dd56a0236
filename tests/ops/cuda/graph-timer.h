// Timing for the CUDA tests' [timing] lines: capture a body of launches on a stream into a graph once, replay it, and
// take the median time of a replay (the first `warm` replays dropped). Reports only; no test asserts a time.
#pragma once

#include "dev-buffer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace perigee::test {

// Median ms of one replay of the graph captured from body() on st, over `replays` replays after `warm` dropped ones.
// body() runs once eagerly first (one-time attributes and allocations outside the capture).
inline double graph_replay_ms(cudaStream_t st, const std::function<void()> & body, int replays, int warm) {
    body();
    cu(cudaStreamSynchronize(st), "eager run before capture");
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    cu(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), "capture");
    body();
    cu(cudaStreamEndCapture(st, &gr), "capture");
    cu(cudaGraphInstantiate(&ge, gr, 0), "instantiate");
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> v;
    for (int r = 0; r < warm + replays; ++r) {
        cudaEventRecord(a, st);
        cudaGraphLaunch(ge, st);
        cudaEventRecord(b, st);
        cudaEventSynchronize(b);
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        if (r >= warm) v.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(gr);
    cu(cudaGetLastError(), "replays");
    std::sort(v.begin(), v.end());
    return double(v[v.size() / 2]);
}

} // namespace perigee::test
