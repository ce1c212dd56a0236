// A backend runs a graph. CPU is the naive reference; CUDA the fast path. Both implement every op
// of ir/op.h through one dispatch switch; an op a backend cannot run is an error naming the op,
// never a silent fallback to another backend (STYLE §3.4, §3.6).
#pragma once
#include "ir/graph.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace perigee {

class backend {
public:
    virtual ~backend() = default;
    virtual std::string name() const = 0;
    // Throws perigee::error naming the first node (name and op) this backend cannot run.
    virtual void check_supported(const graph & g) const = 0;
    // Called after each node has run, with host copies (F32 or I32) of its outputs. For node-by-node
    // comparison between backends (compare-backends) and for dumping.
    using node_callback = std::function<void(const graph & g, int node, const std::vector<tensor> & outs)>;
    // Runs every node in order. STATE leaves are updated in place.
    virtual void run(const graph & g, const node_callback & cb = {}) = 0;
    // Host copy of an output of the last run.
    virtual tensor read(node_ref r) const = 0;
};

std::unique_ptr<backend> backend_cpu_init();

} // namespace perigee
