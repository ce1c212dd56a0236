// kernel-timeline: CUPTI activity records of a replayed CUDA graph -> per-kernel exposed time (kernel-timeline.h).
#include "kernel-timeline.h"

#include "core/error.h"

#include <algorithm>
#include <cstdlib>
#include <cxxabi.h>
#include <map>
#include <mutex>

#ifdef PERIGEE_CUPTI
#include <cupti.h>
#endif

namespace perigee::timeline {

namespace {

// "(anonymous namespace)::k_norm<0>(float const*, ...)" -> "k_norm<0>"
std::string short_name(const char * mangled) {
    if (!mangled) return "?";
    int st = 0;
    char * d = abi::__cxa_demangle(mangled, nullptr, nullptr, &st);
    std::string s = st == 0 && d ? d : mangled;
    std::free(d);
    for (const std::string anon : {"(anonymous namespace)::", "perigee::", "cuda::"}) {
        for (size_t p; (p = s.find(anon)) != std::string::npos;) s.erase(p, anon.size());
    }
    // drop the parameter list: the '(' that closes the name at template depth 0
    int depth = 0;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '<') ++depth;
        else if (s[i] == '>') --depth;
        else if (s[i] == '(' && depth == 0 && i > 0) return s.substr(0, i);
    }
    return s;
}

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

#ifdef PERIGEE_CUPTI
std::mutex g_mu;
std::vector<kernel_rec> g_recs;

#define PG_CUPTI(x)                                                                                              \
    do {                                                                                                         \
        CUptiResult r_ = (x);                                                                                    \
        if (r_ != CUPTI_SUCCESS) {                                                                               \
            const char * s_ = nullptr;                                                                           \
            cuptiGetResultString(r_, &s_);                                                                       \
            PG_FAIL("{}: {}", #x, s_ ? s_ : "?");                                                                \
        }                                                                                                        \
    } while (0)

void CUPTIAPI buf_requested(uint8_t ** buf, size_t * size, size_t * max_records) {
    *size = size_t(16) << 20;
    *buf = static_cast<uint8_t *>(std::aligned_alloc(8, *size));
    *max_records = 0;
}

void CUPTIAPI buf_completed(CUcontext, uint32_t, uint8_t * buf, size_t, size_t valid) {
    CUpti_Activity * r = nullptr;
    std::lock_guard<std::mutex> lk(g_mu);
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const auto * k = reinterpret_cast<const CUpti_ActivityKernel10 *>(r);
        kernel_rec e;
        e.name = short_name(k->name);
        e.start = k->start;
        e.end = k->end;
        e.corr = k->correlationId;
        e.grid[0] = k->gridX, e.grid[1] = k->gridY, e.grid[2] = k->gridZ;
        e.block[0] = k->blockX, e.block[1] = k->blockY, e.block[2] = k->blockZ;
        g_recs.push_back(std::move(e));
    }
    std::free(buf);
}
#endif

} // namespace

#ifdef PERIGEE_CUPTI
bool available() { return true; }

void start() {
    static bool registered = false;
    if (!registered) {
        PG_CUPTI(cuptiActivityRegisterCallbacks(buf_requested, buf_completed));
        registered = true;
    }
    {
        std::lock_guard<std::mutex> lk(g_mu);
        g_recs.clear();
    }
    PG_CUPTI(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
}

std::vector<kernel_rec> stop() {
    PG_CUPTI(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    PG_CUPTI(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    std::lock_guard<std::mutex> lk(g_mu);
    return std::move(g_recs);
}
#else
bool available() { return false; }
void start() { PG_FAIL("kernel timeline: this binary was built without CUPTI (CUDA::cupti not found by CMake)"); }
std::vector<kernel_rec> stop() { return {}; }
#endif

void report(std::FILE * f, const std::vector<kernel_rec> & recs, int skip, double untraced_ms, const std::string & title) {
    std::map<uint32_t, std::vector<kernel_rec>> by_launch;
    for (const auto & r : recs) by_launch[r.corr].push_back(r);
    std::vector<std::vector<kernel_rec>> reps;
    for (auto & [c, v] : by_launch) {
        std::sort(v.begin(), v.end(), [](const kernel_rec & a, const kernel_rec & b) { return a.start < b.start; });
        reps.push_back(std::move(v));
    }
    std::sort(reps.begin(), reps.end(), [](const auto & a, const auto & b) { return a.front().start < b.front().start; });
    PG_CHECK(int(reps.size()) > skip, "kernel timeline: {} graph launches recorded, {} to skip", reps.size(), skip);
    reps.erase(reps.begin(), reps.begin() + skip);
    // Side-branch kernels (cuda_options::l2_side_prefetch_mib: graph nodes beside the chain, in no fixed order with it)
    // are taken out of the chain's table and reported after it: the duration of each and the chain kernels it overlaps.
    std::vector<std::vector<kernel_rec>> side(reps.size());
    for (size_t q = 0; q < reps.size(); ++q) {
        auto & r = reps[q];
        std::vector<kernel_rec> chain;
        for (auto & k : r) (k.name.find("l2_side_prefetch") != std::string::npos ? side[q] : chain).push_back(k);
        r = std::move(chain);
    }
    const size_t n = reps.front().size();
    for (const auto & r : reps)
        PG_CHECK(r.size() == n, "kernel timeline: replays with {} and {} kernels (not one graph?)", n, r.size());

    std::vector<std::vector<double>> dur(n), exposed(n), lead(n);
    std::vector<double> span, gap;
    for (size_t q = 0; q < reps.size(); ++q) {
        const auto & r = reps[q];
        uint64_t maxend = r[0].start;
        for (size_t k = 0; k < n; ++k) {
            PG_CHECK(r[k].name == reps[0][k].name, "kernel timeline: replay {} kernel {} is {}, replay 0 has {}", q, k,
                     r[k].name, reps[0][k].name);
            dur[k].push_back((r[k].end - r[k].start) * 1e-3);
            exposed[k].push_back(r[k].end > maxend ? (r[k].end - maxend) * 1e-3 : 0.0);
            lead[k].push_back(k == 0 ? 0.0 : (double(r[k].start) - double(r[k - 1].end)) * 1e-3);
            maxend = std::max(maxend, r[k].end);
        }
        span.push_back((maxend - r[0].start) * 1e-6);
        if (q + 1 < reps.size()) gap.push_back((double(reps[q + 1][0].start) - double(maxend)) * 1e-3);
    }
    std::fprintf(f, "kernel timeline %s: %zu replays x %zu kernels; span (first start .. last end) median %.3f ms, gap to the"
                    " next replay %.2f us; untraced graph step %.3f ms\n",
                 title.c_str(), reps.size(), n, median(span), median(gap), untraced_ms);
    std::fprintf(f, "  %4s %9s %9s %9s %13s %5s  %s\n", "#", "exposed", "dur", "lead", "grid", "blk", "kernel (us, medians)");
    double sum_exp = 0;
    std::map<std::string, std::pair<double, int>> by_name;
    for (size_t k = 0; k < n; ++k) {
        const auto & r = reps[0][k];
        const double e = median(exposed[k]);
        sum_exp += e;
        by_name[r.name].first += e;
        by_name[r.name].second += 1;
        char grid[32];
        std::snprintf(grid, sizeof grid, "%dx%dx%d", r.grid[0], r.grid[1], r.grid[2]);
        std::fprintf(f, "  %4zu %9.2f %9.2f %9.2f %13s %5d  %s\n", k, e, median(dur[k]), median(lead[k]), grid, r.block[0],
                     r.name.c_str());
    }
    std::fprintf(f, "  exposed time by kernel (sum of the per-position medians %.3f ms):\n", sum_exp * 1e-3);
    std::vector<std::pair<double, std::string>> rows;
    for (const auto & [k, v] : by_name) rows.push_back({v.first, k + " x" + std::to_string(v.second)});
    std::sort(rows.rbegin(), rows.rend());
    for (const auto & [t, k] : rows) std::fprintf(f, "    %9.1f us %5.1f%%  %s\n", t, 100 * t / sum_exp, k.c_str());
    const size_t ns = side.front().size();
    bool same = true;
    for (const auto & v : side) same &= v.size() == ns;
    if (ns > 0 && same) {
        std::fprintf(f, "  side-branch kernels: %zu per replay (us, medians; 'from .. to': the chain kernels running at its start"
                        " and end)\n", ns);
        for (size_t i = 0; i < ns; ++i) {
            std::vector<double> d, a, b;
            for (size_t q = 0; q < reps.size(); ++q) {
                const kernel_rec & k = side[q][i];
                d.push_back((k.end - k.start) * 1e-3);
                auto at = [&](uint64_t t) {   // the last chain kernel started by t
                    double idx = 0;
                    for (size_t j = 0; j < n; ++j)
                        if (reps[q][j].start <= t) idx = double(j);
                    return idx;
                };
                a.push_back(at(k.start));
                b.push_back(at(k.end));
            }
            std::fprintf(f, "  %4zu %9.2f  from #%.0f to #%.0f  grid %d\n", i, median(d), median(a), median(b), side[0][i].grid[0]);
        }
    } else if (ns > 0 || !same) {
        std::fprintf(f, "  side-branch kernels: a different count per replay (replay 0: %zu)\n", ns);
    }
    std::fflush(f);
}

} // namespace perigee::timeline
