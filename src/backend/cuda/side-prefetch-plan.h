// Where the decode graph's side-branch L2 prefetches go (cuda_options::l2_side_prefetch_mib; the kernel node is
// l2-side-prefetch.cu). Host-only and header-only, so CI checks the rule on a machine without a GPU
// (tests/unit/backend/test_side_prefetch_plan.cpp) while the backend (cuda-backend.cpp add_side_prefetches) runs it on
// the launches of each captured step.
//
// The rule: over the captured launches in graph order, those that read >= streaming_bytes of weights are the
// streaming ones (a GET_ROWS reads rows of its table only: never streaming). After each streaming launch p followed by
// at least one other launch before the next streaming launch s, one prefetch: s's weights in the order s read them, cut
// at budget_bytes and at max_ranges ranges, forked from p (it starts when p completes, while the launches between run).
// The first streaming launch has no p, and two streaming launches in a row leave no idle time to fill.
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace perigee::cuda_side {

using range = std::pair<const void *, size_t>;   // device address, bytes

// One graph node's part of a captured step.
struct launch {
    bool launched = false;      // the node added captured work (a node that launched nothing is skipped)
    bool get_rows = false;      // its weight reads are a table it gathers rows from
    std::vector<range> reads;   // the weights its launches read, each once, in first-read order
};

struct prefetch {
    int fork = -1;     // the streaming launch p it depends on
    int target = -1;   // the streaming launch s whose weights it asks for
    std::vector<range> ranges;
};

inline size_t weight_bytes(const launch & l) {
    size_t b = 0;
    if (!l.get_rows)
        for (const auto & r : l.reads) b += r.second;
    return b;
}

inline std::vector<prefetch> plan(const std::vector<launch> & ls, size_t budget_bytes, size_t streaming_bytes = size_t(4) << 20,
                                  int max_ranges = 8) {
    std::vector<prefetch> out;
    if (budget_bytes == 0) return out;
    int p = -1;          // the last streaming launch
    bool gap = false;    // a launch since p
    for (size_t id = 0; id < ls.size(); ++id) {
        if (!ls[id].launched) continue;
        if (weight_bytes(ls[id]) < streaming_bytes) {
            gap = true;
            continue;
        }
        if (p >= 0 && gap) {
            prefetch f;
            f.fork = p;
            f.target = int(id);
            size_t left = budget_bytes;
            for (const auto & r : ls[id].reads) {
                if (left == 0 || int(f.ranges.size()) == max_ranges) break;
                const size_t n = std::min(r.second, left);
                f.ranges.emplace_back(r.first, n);
                left -= n;
            }
            out.push_back(std::move(f));
        }
        p = int(id);
        gap = false;
    }
    return out;
}

} // namespace perigee::cuda_side
