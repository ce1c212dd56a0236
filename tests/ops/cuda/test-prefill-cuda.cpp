// CUDA prefill kernels outside the GEMMs (issue 7) vs the CPU reference and vs the kernels they replace:
//  1. MOE_ROUTE with the logits as one cuBLASLt GEMM (cuda_options::moe_route_gemm_tokens; BF16 gate: x in three bf16
//     parts, F32 gate: an fp32 GEMM) and the existing per-token selection.
//  2. MLA_ATTN prefill in the expanded form with the causal flash-attention kernel (cuda_options::mla_prefill_tokens).
//  3. SHORT_CONV with one thread per (token, channel) (cuda_options::conv_prefill_tokens).
//  4. ATTN_RES_MIX with warp-per-(row, candidate) scores and float4 mixing (cuda_options::attn_res_prefill_tokens).
//
// Same shape as test-ops-cuda (STYLE §3.7): fixed, printed seeds; the CPU backend is the reference; the CUDA backend runs
// in guard mode (outputs poisoned with NaN, sentinel words checked after each node); "measured <= threshold" printed on
// every line. T in {1, 17, 64, 300, 1024}, ragged batches (several sequences, mixed pos0) and resumed sequences (pos0 > 0)
// for MLA. Controls that must FAIL: the new path bitwise equal to the old one (must be DIFFERENT: another summation order
// ran), swapped expert ids, the comparator family (10x perturbation, negative threshold). A printed micro-timing at K3's
// widths, T = 2048 (reported, not asserted). The run ends with "N passed, N failed".
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/prefill-ops.h"
#include "dev-buffer.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

namespace perigee::test {
namespace {

constexpr double k_tol_f32 = 1e-7;      // NMSE: f32-accumulated products of exact weights (test-ops-cuda's k_tol_f32)
constexpr double k_tol_mla_abs = 8e-4;  // max abs: MLA output (test-ops-cuda; FlashMLA dense decode)

int g_passed = 0, g_failed = 0;
void tally(bool ok) { (ok ? g_passed : g_failed)++; }

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the CUDA parity runner needs the GPU machine"

struct out_check { node_ref r; metric m; double thr; bool exact_i32 = false; };
struct state_check { tensor * t; std::set<int64_t> touched; };   // compared exactly; untouched dim-0 rows bitwise

std::vector<float> host_f32(const tensor & t) {
    std::vector<float> v(size_t(t.numel()));
    if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * 4);
    return v;
}

// Runs g on both backends from the same initial states and compares outputs and states. True when every check passed.
bool parity(const std::string & name, graph & g, const std::vector<out_check> & outs, std::vector<state_check> states,
            const cuda_options & opt) {
    std::vector<tensor> init;
    for (auto & s : states) init.push_back(tensor_new(s.t->type, s.t->shape)), std::memcpy(init.back().data, s.t->data, s.t->nbytes);
    auto cpu = backend_cpu_init();
    cpu->check_supported(g);
    cpu->run(g);
    std::vector<tensor> cpu_out, cpu_state;
    for (auto & o : outs) cpu_out.push_back(cpu->read(o.r));
    for (size_t i = 0; i < states.size(); ++i) {
        cpu_state.push_back(tensor_new(states[i].t->type, states[i].t->shape));
        std::memcpy(cpu_state.back().data, states[i].t->data, states[i].t->nbytes);
        std::memcpy(states[i].t->data, init[i].data, init[i].nbytes);   // the CUDA run starts from the same state
    }
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(g);
    gpu->run(g);
    gpu->sync_state_to_host();
    bool all = true;
    for (size_t i = 0; i < outs.size(); ++i) {
        const tensor c = gpu->read(outs[i].r);
        const std::string nm = name + "/" + g.at(outs[i].r).name + (outs[i].r.out ? "#" + std::to_string(outs[i].r.out) : "");
        bool ok;
        if (outs[i].exact_i32) {
            std::vector<int32_t> a(size_t(c.numel())), b(size_t(c.numel()));
            std::memcpy(a.data(), cpu_out[i].data, a.size() * 4);
            std::memcpy(b.data(), c.data, b.size() * 4);
            ok = check_exact_i32(nm, a, b);
        } else {
            ok = check(nm, to_f64(host_f32(cpu_out[i])), host_f32(c), outs[i].m, outs[i].thr);
        }
        tally(ok);
        all &= ok;
    }
    for (size_t i = 0; i < states.size(); ++i) {
        const auto & s = states[i];
        const std::string nm = name + "/state:" + std::to_string(i);
        const bool ok = check(nm, to_f64(host_f32(cpu_state[i])), host_f32(*s.t), metric::NMSE, 0.0);
        tally(ok);
        all &= ok;
        const int64_t rows = s.t->shape.at(0), row_bytes = int64_t(s.t->nbytes) / std::max<int64_t>(rows, 1);
        size_t bad = 0;
        for (int64_t r = 0; r < rows; ++r)
            if (!s.touched.count(r))
                bad += std::memcmp(static_cast<char *>(s.t->data) + r * row_bytes, static_cast<char *>(init[i].data) + r * row_bytes,
                                   size_t(row_bytes)) != 0;
        std::printf("[%s] untouched rows changed: %zu <= 0\n", (nm + "/untouched").c_str(), bad);
        tally(bad == 0);
        all &= bad == 0;
        std::memcpy(s.t->data, init[i].data, init[i].nbytes);   // later runs start from the same state again
    }
    return all;
}

// Comparator controls on a real candidate: a 10x perturbation and a negative threshold must fail.
void controls(const std::string & name, const std::vector<float> & ref, const std::vector<float> & cand, metric m, double thr) {
    const auto r = to_f64(ref);
    const bool pert = check(name + "/control(perturbed 10x)", r, perturb(r, cand, m, thr), m, thr);
    const bool neg = compare(r, cand, m, -1.0).ok;
    std::printf("[%s/control] perturbed %s, negative threshold %s (both must FAIL)\n", name.c_str(), pert ? "PASSED" : "FAILED",
                neg ? "PASSED" : "FAILED");
    EXPECT_FALSE(pert);
    EXPECT_FALSE(neg);
    tally(!pert && !neg);
}

// One CUDA run from the states' current host contents (restored afterwards); returns output r.
template <typename T>
std::vector<T> run_cuda(graph & g, node_ref r, const cuda_options & opt, std::vector<tensor *> states = {}) {
    std::vector<tensor> init;
    for (auto * s : states) init.push_back(tensor_new(s->type, s->shape)), std::memcpy(init.back().data, s->data, s->nbytes);
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(g);
    gpu->run(g);
    const tensor c = gpu->read(r);
    std::vector<T> v(size_t(c.numel()));
    if (!v.empty()) std::memcpy(v.data(), c.data, v.size() * sizeof(T));
    for (size_t i = 0; i < states.size(); ++i) std::memcpy(states[i]->data, init[i].data, init[i].nbytes);
    return v;
}

bool bitwise_same(const void * a, const void * b, size_t n) { return std::memcmp(a, b, n) == 0; }

std::shared_ptr<batch> batch_seqs(const std::vector<int> & lens, const std::vector<int> & pos0, int page_size, int pages_per_seq) {
    auto b = std::make_shared<batch>();
    b->seq_start = {0};
    for (size_t s = 0; s < lens.size(); ++s) {
        b->seq_start.push_back(b->seq_start.back() + lens[s]);
        b->pos0.push_back(pos0[s]);
        b->slot.push_back(int(s));
        std::vector<int32_t> bt;
        for (int p = 0; p < pages_per_seq; ++p) bt.push_back(int32_t(s * pages_per_seq + (pages_per_seq - 1 - p)));   // reversed pages
        b->block_table.push_back(bt);
    }
    b->ids.assign(size_t(b->seq_start.back()), 0);
    b->page_size = page_size;
    return b;
}

// ---- the router's tie rule ----
// Exact id equality with the CPU is not something a GEMM can promise: its logits sum in another order than the CPU's
// sequential fp32 dot, so a near tie at a decision (top-k order, the top-k boundary, the kept groups) may flip. What IS
// guaranteed: every decision the GPU took differently is a near tie of the CPU's own fp32 quantities. Bound on a logit
// l_e = sum_i x_i w_ei: both sums' rounding errors are a random walk of ~D fp32 roundings of partial sums (std ~
// u sqrt(D) |partial| ~ u sum_i |x_i w_ei| / 1.3 here, u = 2^-24; the split's residual adds u |x|),
// so eps_l(e) = K u sum_i |x_i w_ei| with K = 16 (a host simulation measured the CPU's own max error at ~3.8 u sum |x w|
// over 1024 x 96 logits: the difference of two such sums fits K = 16 with margin; far below the deterministic worst
// case (4D + 2) u sum |x w|). Scores: sigmoid eps_s = s (1 - s) eps_l + 2^-22, softmax eps_s = 2 s max_e eps_l + 2^-22.
// Per token eps = max_e eps_s; a decision between two experts is a near tie when its gap <= 2 eps, between two groups
// (each the sum of two scores) when <= 4 eps. The check prints the host-measured CPU logit error against the bound
// (max |l_f32 - l_exact| / (u sum |x w|), must be under K) and every accepted near tie with its gap. Exact ties of
// duplicated gate rows (experts 2i, 2i + 1 for i < n_dup) are held strictly: identical rows give identical GEMM sums, so
// 2i + 1 may appear only after 2i (the lower id first, as on the CPU).
struct route_ref {
    int64_t T = 0, E = 0, k = 0, n_group = 1, topk_group = 1;
    std::vector<float> biased;   // [T, E] the CPU's fp32 biased scores (what the selection compares)
    std::vector<double> eps;     // [T] the per-token score bound
    double cpu_err_ratio = 0;    // max |l_f32 - l_exact| / (u sum |x w|) on the host
};
constexpr double k_route_K = 16.0;

route_ref route_reference(const std::vector<float> & x, const std::vector<float> & gw, const std::vector<float> & bias, int64_t T,
                          int64_t D, int64_t E, int64_t k, int64_t n_group, int64_t topk_group, bool softmax) {
    route_ref rr;
    rr.T = T, rr.E = E, rr.k = k, rr.n_group = n_group, rr.topk_group = topk_group;
    rr.biased.resize(size_t(T * E));
    rr.eps.resize(size_t(T));
    const double u = std::ldexp(1.0, -24);
    std::vector<float> l(static_cast<size_t>(E)), s(static_cast<size_t>(E));
    std::vector<double> el(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
        double max_el = 0;
        for (int64_t e = 0; e < E; ++e) {
            float acc = 0.0f;   // as moe_route_ref: sequential fp32
            double exact = 0, mag = 0;
            for (int64_t i = 0; i < D; ++i) {
                const float xi = x[size_t(t * D + i)], wi = gw[size_t(e * D + i)];
                acc += xi * wi;
                exact += double(xi) * double(wi);
                mag += std::fabs(double(xi) * double(wi));
            }
            l[size_t(e)] = acc;
            el[size_t(e)] = k_route_K * u * mag;
            max_el = std::max(max_el, el[size_t(e)]);
            if (mag > 0) rr.cpu_err_ratio = std::max(rr.cpu_err_ratio, std::fabs(double(acc) - exact) / (u * mag));
        }
        if (!softmax) {
            for (int64_t e = 0; e < E; ++e) s[size_t(e)] = sigmoid_f(l[size_t(e)]);
        } else {
            const float mx = *std::max_element(l.begin(), l.end());
            double sum = 0.0;
            for (int64_t e = 0; e < E; ++e) sum += (s[size_t(e)] = std::exp(l[size_t(e)] - mx));
            for (auto & v : s) v = float(v / sum);
        }
        double ep = 0;
        for (int64_t e = 0; e < E; ++e) {
            const double se = s[size_t(e)];
            ep = std::max(ep, (softmax ? 2 * se * max_el : se * (1 - se) * el[size_t(e)]) + std::ldexp(1.0, -22));
            rr.biased[size_t(t * E + e)] = s[size_t(e)] + (bias.empty() ? 0.0f : bias[size_t(e)]);
        }
        rr.eps[size_t(t)] = ep;
    }
    return rr;
}

// Gap of the largest decision in ids [k] (one token) that the CPU's rule would not take on rr's scores: 0 when ids are
// exactly what the CPU picks (ties to the lower id give 0 too). Invalid lists (repeated / out-of-range ids, more groups
// than kept) give +inf. *group_gap receives the part due to the kept groups.
double route_decision_gap(const route_ref & rr, int64_t t, const int32_t * ids, double * group_gap) {
    const int64_t E = rr.E, k = rr.k, gs = E / rr.n_group;
    const float * b = rr.biased.data() + t * E;
    const double inf = std::numeric_limits<double>::infinity();
    *group_gap = 0;
    std::set<int32_t> uniq(ids, ids + k);
    if (int64_t(uniq.size()) != k || *uniq.begin() < 0 || *uniq.rbegin() >= E) return inf;
    std::vector<bool> eligible(size_t(rr.n_group), true);
    if (rr.n_group > 1 && rr.topk_group < rr.n_group) {
        std::vector<double> gscore(size_t(rr.n_group));
        for (int64_t gi = 0; gi < rr.n_group; ++gi) {
            std::vector<float> v(b + gi * gs, b + (gi + 1) * gs);
            std::sort(v.begin(), v.end(), std::greater<float>());
            gscore[size_t(gi)] = double(v[0] + (gs > 1 ? v[1] : 0.0f));
        }
        std::vector<int64_t> order(size_t(rr.n_group));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return gscore[size_t(a)] > gscore[size_t(c)]; });
        std::vector<bool> cpu_keep(size_t(rr.n_group), false), used(size_t(rr.n_group), false);
        for (int64_t i = 0; i < rr.topk_group; ++i) cpu_keep[size_t(order[size_t(i)])] = true;
        for (int64_t j = 0; j < k; ++j) used[size_t(ids[j] / gs)] = true;
        if (std::count(used.begin(), used.end(), true) > rr.topk_group) return inf;
        double kept_min = inf, extra_min = inf;   // the CPU's weakest kept group; the weakest group only the GPU used
        for (int64_t gi = 0; gi < rr.n_group; ++gi) {
            if (cpu_keep[size_t(gi)]) kept_min = std::min(kept_min, gscore[size_t(gi)]);
            if (used[size_t(gi)] && !cpu_keep[size_t(gi)]) extra_min = std::min(extra_min, gscore[size_t(gi)]);
        }
        const int64_t n_extra = [&] {
            int64_t n = 0;
            for (int64_t gi = 0; gi < rr.n_group; ++gi) n += used[size_t(gi)] && !cpu_keep[size_t(gi)];
            return n;
        }();
        if (n_extra > 0) *group_gap = std::max(*group_gap, kept_min - extra_min);   // took a group below the CPU's cut
        // A CPU-kept group the GPU did not use was either kept with nothing picked from it (its experts stay eligible
        // below), or dropped for a GPU-only group: the latter is the same decision, gap gscore[c] - extra_min.
        int64_t dropped_budget = n_extra;
        std::vector<std::pair<double, int64_t>> unused;
        for (int64_t gi = 0; gi < rr.n_group; ++gi)
            if (cpu_keep[size_t(gi)] && !used[size_t(gi)]) unused.push_back({gscore[size_t(gi)], gi});
        std::sort(unused.begin(), unused.end());   // the weakest CPU groups are the ones dropped
        for (int64_t gi = 0; gi < rr.n_group; ++gi) eligible[size_t(gi)] = used[size_t(gi)];
        for (auto & [gsc, gi] : unused) {
            if (dropped_budget > 0) {
                --dropped_budget;
                *group_gap = std::max(*group_gap, gsc - extra_min);
            } else {
                eligible[size_t(gi)] = true;
            }
        }
    }
    // Position j: ids[j] must be the best eligible expert not yet taken (ties: the lower id).
    double gap = 0;
    std::vector<bool> taken(size_t(E), false);
    for (int64_t j = 0; j < k; ++j) {
        taken[size_t(ids[j])] = true;
        const double bj = b[ids[j]];
        for (int64_t e = 0; e < E; ++e) {
            if (taken[size_t(e)] || !eligible[size_t(e / gs)]) continue;
            const double be = b[e];
            if (be > bj || (be == bj && e < ids[j])) gap = std::max(gap, be - bj);
        }
    }
    return std::max(gap, *group_gap * 0.5);   // a group gap is compared against 4 eps, an expert gap against 2 eps
}

// Every token whose ids differ from the CPU's: accepted when its decision gap is a near tie (<= 2 eps, groups 4 eps),
// printed with the gap; otherwise FAILS. Prints "tolerant: N mismatched tokens, M near ties accepted, F decided".
bool check_route_ids(const std::string & name, const route_ref & rr, const std::vector<int32_t> & cpu_ids,
                     const std::vector<int32_t> & ids, int n_dup = 0) {
    if (ids.size() != size_t(rr.T * rr.k) || cpu_ids.size() != ids.size()) {
        std::printf("[%s] ids: %zu values for %lld x %lld (FAILED)\n", name.c_str(), ids.size(), (long long)rr.T, (long long)rr.k);
        return false;
    }
    size_t mism = 0, ties = 0, decided = 0, dup_bad = 0;
    for (int64_t t = 0; t < rr.T; ++t) {
        const int32_t * a = cpu_ids.data() + t * rr.k, * c = ids.data() + t * rr.k;
        for (int i = 0; i < n_dup; ++i) {   // the duplicated pair's exact tie: 2i + 1 only after 2i
            const auto lo = std::find(c, c + rr.k, 2 * i), hi = std::find(c, c + rr.k, 2 * i + 1);
            if (hi != c + rr.k && (lo == c + rr.k || lo > hi)) {
                ++dup_bad;
                std::printf("[%s] token %lld: duplicated experts %d / %d out of order (exact tie: the lower id first): FAILED\n",
                            name.c_str(), (long long)t, 2 * i, 2 * i + 1);
            }
        }
        if (std::equal(a, a + rr.k, c)) continue;
        ++mism;
        double ggap = 0;
        const double gap = route_decision_gap(rr, t, c, &ggap), tol = 2 * rr.eps[size_t(t)];
        const bool tie = gap <= tol;
        (tie ? ties : decided)++;
        std::string sa, sc;
        for (int64_t j = 0; j < rr.k; ++j) sa += fmt::format("{}{}", j ? "," : "", a[j]), sc += fmt::format("{}{}", j ? "," : "", c[j]);
        std::printf("[%s] token %lld: cpu [%s] got [%s]: decision gap %.3e (group %.3e) %s 2 eps = %.3e: %s\n", name.c_str(),
                    (long long)t, sa.c_str(), sc.c_str(), gap, ggap, tie ? "<=" : ">", tol, tie ? "near tie, accepted" : "DECIDED: FAILED");
    }
    const bool ok = decided == 0 && dup_bad == 0 && rr.cpu_err_ratio <= k_route_K;
    std::printf("[%s] tolerant ids: %zu mismatched tokens, %zu near ties accepted, %zu decided + %zu duplicate-order <= 0 (cpu logit "
                "error %.2f u sum|xw| <= K %.0f)\n", name.c_str(), mism, ties, decided, dup_bad, rr.cpu_err_ratio, k_route_K);
    return ok;
}

// ---- 1. MOE_ROUTE logits by one GEMM (cuda_options::moe_route_gemm_tokens) ----
// BF16 gates: x = p0 + p1 + p2 (24 mantissa bits) against exact bf16 weights, fp32 accumulation: logits at the fp32
// GEMV's accuracy, but summed in another order than the CPU's dot. The ids are checked by the tie rule above
// (check_route_ids: a token whose ids differ from the CPU's passes only when the flipped decision is a near tie of the
// CPU's own scores, printed with its gap), w at the f32 tolerance. The BF16 gates carry 8 duplicated rows (experts 2i
// and 2i + 1 equal: exact logit ties, which must go to the lower id as on the CPU: gap 0, no tolerance needed) and
// grouped selection (8 groups, keep 4) with a bias; an F32 gate with softmax; K3's router shape (896 x 7168, top-16 of
// 8 groups keeping 4) at T = 300. Every case also the GEMV router (the old path) by the same rule, and the GEMM's ids
// against the GEMV's (printed: how many tokens differ). Controls that must FAIL: the GEMM router's w bitwise equal to
// the GEMV router's (must be DIFFERENT: the GEMM ran), two ids swapped at the most decided position of the CPU's ids
// (by the tie rule and exactly), the comparator family.
TEST(cuda_prefill, route_gemm_vs_cpu_and_gemv) {
    NEED_GPU();
    struct shape { int E, D, k, n_group, topk_group; bool bf16, softmax, bias, dup; std::vector<int> Ts; };
    const std::vector<shape> shapes = {{96, 1056, 8, 8, 4, true, false, true, true, {1, 17, 64, 300, 1024}},
                                       {64, 520, 6, 1, 1, false, true, false, false, {1, 17, 64, 300, 1024}},
                                       {896, 7168, 16, 8, 4, true, false, true, true, {300}}};
    for (const shape & sh : shapes) {
        for (int T : sh.Ts) {
            rng r(12000 + uint32_t(sh.E) + uint32_t(T));
            arena a;
            builder bd(batch_simple(T));
            auto xv = r.vec(size_t(T) * size_t(sh.D)), gw = r.vec(size_t(sh.E) * size_t(sh.D), -0.3f, 0.3f);
            if (sh.dup)
                for (int i = 0; i < 8; ++i)
                    std::copy_n(gw.begin() + int64_t(2 * i) * sh.D, sh.D, gw.begin() + int64_t(2 * i + 1) * sh.D);
            auto bv = r.vec(size_t(sh.E), -0.05f, 0.05f);
            if (sh.dup)
                for (int i = 0; i < 8; ++i) bv[size_t(2 * i + 1)] = bv[size_t(2 * i)];
            const node_ref x = bd.scale(bd.weight(a.f32({T, sh.D}, xv), "x"), 1.0f);
            const node_ref gate = bd.weight(sh.bf16 ? a.bf16({sh.E, sh.D}, gw) : a.f32({sh.E, sh.D}, gw), "gate");   // gw: rounded
            const node_ref bias = sh.bias ? bd.weight(a.f32({sh.E}, bv), "bias") : node_ref{};
            auto [ids, w] = bd.moe_route(x, gate, bias, {sh.k, sh.n_group, sh.topk_group, true, 2.5f,
                                                         sh.softmax ? router_act::SOFTMAX : router_act::SIGMOID});
            bd.name(ids, "route");
            graph g = bd.finish(w);
            const std::string nm = fmt::format("route-gemm/{}/E{}/D{}/k{}/T{}", sh.bf16 ? "bf16" : "f32", sh.E, sh.D, sh.k, T);
            const route_ref rr = route_reference(xv, gw, sh.bias ? bv : std::vector<float>{}, T, sh.D, sh.E, sh.k, sh.n_group,
                                                 sh.topk_group, sh.softmax);
            std::vector<int32_t> id_cpu;
            std::vector<float> w_cpu;
            {
                auto cpu = backend_cpu_init();
                cpu->run(g);
                const tensor t = cpu->read(ids);
                id_cpu.resize(size_t(t.numel()));
                std::memcpy(id_cpu.data(), t.data, id_cpu.size() * 4);
                w_cpu = read_f32(*cpu, w);
            }
            const std::vector<out_check> oc{{w, metric::NMSE, k_tol_f32}};
            cuda_options gm{true, 8};
            gm.moe_route_gemm_tokens = 1;   // explicit: the GEMM router at every T
            EXPECT_TRUE(parity(nm, g, oc, {}, gm)) << nm;
            cuda_options old{true, 8};
            old.moe_route_gemm_tokens = 0;   // explicit: the GEMV router (the old path)
            EXPECT_TRUE(parity(nm + "/gemv", g, oc, {}, old)) << nm;
            const auto id_new = run_cuda<int32_t>(g, ids, gm), id_old = run_cuda<int32_t>(g, ids, old);
            const auto w_new = run_cuda<float>(g, w, gm), w_old = run_cuda<float>(g, w, old);
            const bool ids_new_ok = check_route_ids(nm + "/route", rr, id_cpu, id_new, sh.dup ? 8 : 0);
            const bool ids_old_ok = check_route_ids(nm + "/gemv/route", rr, id_cpu, id_old, sh.dup ? 8 : 0);
            EXPECT_TRUE(ids_new_ok && ids_old_ok) << nm;
            tally(ids_new_ok);
            tally(ids_old_ok);
            size_t differ = 0;
            for (int64_t t = 0; t < T; ++t)
                differ += !std::equal(id_new.begin() + t * sh.k, id_new.begin() + (t + 1) * sh.k, id_old.begin() + t * sh.k);
            std::printf("[%s/ids-vs-gemv] %zu tokens differ (info: each already held to the tie rule above)\n", nm.c_str(), differ);
            const bool w_eq = check(nm + "/w-vs-gemv", to_f64(w_old), w_new, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(w_eq) << nm;
            tally(w_eq);
            if (T >= 64) {   // enough logits that some bit differs when another summation order ran
                const bool same = bitwise_same(w_new.data(), w_old.data(), w_new.size() * 4);
                std::printf("[%s/control(gemm w bitwise equal to gemv w)] %s (must be DIFFERENT: the GEMM ran)\n", nm.c_str(),
                            same ? "EQUAL" : "DIFFERENT");
                EXPECT_FALSE(same) << nm;
                tally(!same);
                // The CPU's own ids with the two neighbours of the largest gap swapped: a decided order, must FAIL.
                int64_t bt = 0, bj = 0;
                double best = -1;
                for (int64_t t = 0; t < T; ++t)
                    for (int64_t j = 0; j + 1 < sh.k; ++j) {
                        const double gp = double(rr.biased[size_t(t * sh.E + id_cpu[size_t(t * sh.k + j)])]) -
                                          double(rr.biased[size_t(t * sh.E + id_cpu[size_t(t * sh.k + j + 1)])]);
                        if (gp > best) best = gp, bt = t, bj = j;
                    }
                auto sw = id_cpu;
                std::swap(sw[size_t(bt * sh.k + bj)], sw[size_t(bt * sh.k + bj + 1)]);
                const bool tol_swapped = check_route_ids(nm + "/control(two ids swapped, tie rule)", rr, id_cpu, sw, sh.dup ? 8 : 0);
                const bool ex_swapped = check_exact_i32(nm + "/control(two ids swapped)", id_cpu, sw);
                std::printf("[%s/control(two ids swapped)] tie rule %s, exact %s (both must FAIL)\n", nm.c_str(),
                            tol_swapped ? "PASSED" : "FAILED", ex_swapped ? "PASSED" : "FAILED");
                EXPECT_FALSE(tol_swapped) << nm;
                EXPECT_FALSE(ex_swapped) << nm;
                tally(!tol_swapped && !ex_swapped);
                if (sh.dup) {   // a duplicated pair (exact tie) put higher id first: gap 0, but must FAIL the tie order
                    auto sd = id_cpu;
                    bool done = false;
                    for (int64_t t = 0; t < T && !done; ++t)
                        for (int64_t j = 0; j + 1 < sh.k && !done; ++j) {
                            int32_t & p = sd[size_t(t * sh.k + j)], & q = sd[size_t(t * sh.k + j + 1)];
                            if (p % 2 == 0 && p < 16 && q == p + 1) std::swap(p, q), done = true;
                        }
                    const bool dup_swapped = done && check_route_ids(nm + "/control(duplicated pair swapped)", rr, id_cpu, sd, 8);
                    std::printf("[%s/control(duplicated pair swapped)] %s (must FAIL; %s)\n", nm.c_str(), dup_swapped ? "PASSED" : "FAILED",
                                done ? "a token holds a pair" : "no token holds a pair: not run");
                    EXPECT_FALSE(dup_swapped) << nm;
                    tally(!dup_swapped);
                }
                controls(nm, w_cpu, w_new, metric::NMSE, k_tol_f32);
            }
        }
    }
}

// ---- 2. MLA_ATTN prefill, expanded form + causal flash attention (cuda_options::mla_prefill_tokens) ----
// kv_b BF16 (exact), the gathered latent rows split into bf16 hi + lo (x to ~2^-17 relative) for the expansion GEMM, fp32
// flash attention: expected NMSE vs the CPU ~1e-11, max abs ~1e-6; the tensor-core attention (cuda_options::
// mla_prefill_mma, the default; every operand bf16 hi + lo, three products) ~1e-10; tolerances test-ops-cuda's (max abs
// 8e-4 and NMSE 1e-7). Both attention forms against the CPU and against each other. The cache (written by both backends) must be bitwise equal to the CPU's, pages nobody owns untouched.
// Shapes: small (H 4, dn 16, dr 8, dv 16, L 64: the padded 64-column V tile), odd (H 3, dn 32, dr 16, dv 48, L 96) and
// K3's head widths (dn 128, dr 64, dv 128, L 512) with H 2; batches: one fresh sequence of T in {1, 17, 64, 300, 1024},
// a resumed one (pos0 77, T 300: tiles not aligned to positions), and a ragged batch (lens 17 / 64 / 3 / 1 at pos0
// 0 / 5 / 40 / 9). Every case also against the absorbed kernels (mla_prefill_tokens = 0) directly.
// Controls that must FAIL: the new output bitwise equal to the absorbed kernels' (must be DIFFERENT: the new kernel
// ran), the tensor-core output bitwise equal to the SIMT one's (must be DIFFERENT: the tensor-core kernel ran), the
// comparator family.
TEST(cuda_prefill, mla_flash_vs_cpu_and_absorbed) {
    NEED_GPU();
    struct dims { int H, dn, dr, dv, L, ps; };
    struct bcase { std::vector<int> lens, pos0; };
    const dims small{4, 16, 8, 16, 64, 16}, odd{3, 32, 16, 48, 96, 16}, k3{2, 128, 64, 128, 512, 64};
    std::vector<std::pair<dims, bcase>> cases;
    for (int T : {1, 17, 64, 300, 1024}) cases.push_back({small, {{T}, {0}}});
    cases.push_back({small, {{300}, {77}}});
    cases.push_back({small, {{17, 64, 3, 1}, {0, 5, 40, 9}}});
    cases.push_back({odd, {{17, 64, 3, 1}, {0, 5, 40, 9}}});
    cases.push_back({odd, {{300}, {77}}});
    cases.push_back({k3, {{300}, {77}}});
    cases.push_back({k3, {{1024}, {0}}});
    cases.push_back({k3, {{17, 64, 3, 1}, {0, 5, 40, 9}}});
    for (const auto & [d, bc] : cases) {
        int max_pos = 0;
        for (size_t s = 0; s < bc.lens.size(); ++s) max_pos = std::max(max_pos, bc.pos0[s] + bc.lens[s]);
        const int pages_per = max_pos / d.ps + 2, n_seq = int(bc.lens.size());
        auto b = batch_seqs(bc.lens, bc.pos0, d.ps, pages_per);
        const int T = b->n_tokens();
        const int n_pages = n_seq * pages_per + 2;   // 2 pages nobody owns: must stay untouched
        rng r(13000 + uint32_t(T) * 7 + uint32_t(d.L) + uint32_t(n_seq) * 31 + uint32_t(bc.pos0[0]));
        arena a;
        builder bd(b);
        auto qv = r.vec(size_t(T) * size_t(d.H * (d.dn + d.dr))), cv = r.vec(size_t(T * d.L)), krv = r.vec(size_t(T * d.dr));
        auto kvb = r.vec(size_t(d.H * (d.dn + d.dv) * d.L), -0.08f, 0.08f);
        auto cache0 = r.vec(size_t(n_pages) * size_t(d.ps * (d.L + d.dr)));   // earlier positions: random history
        tensor & cache = a.f32({n_pages, d.ps, d.L + d.dr}, cache0);
        std::set<int64_t> touched;
        for (auto & bt : b->block_table) touched.insert(bt.begin(), bt.end());
        const node_ref o = bd.name(bd.mla_attn(bd.scale(bd.weight(a.f32({T, d.H * (d.dn + d.dr)}, qv), "q"), 1.0f),
                                               bd.scale(bd.weight(a.f32({T, d.L}, cv), "c"), 1.0f),
                                               bd.scale(bd.weight(a.f32({T, d.dr}, krv), "kr"), 1.0f),
                                               bd.weight(a.bf16({d.H * (d.dn + d.dv), d.L}, kvb), "kv_b"),
                                               bd.state(cache, "mla_cache"), node_ref{},
                                               {d.H, d.dn, d.dr, d.dv, d.L, 0.15f}),
                                   "mla_attn");
        graph g = bd.finish(o);
        std::string lens_s;
        for (size_t s = 0; s < bc.lens.size(); ++s) lens_s += fmt::format("{}{}@{}", s ? "," : "", bc.lens[s], bc.pos0[s]);
        const std::string nm = fmt::format("mla-prefill/H{}/dn{}/dr{}/dv{}/L{}/seqs[{}]", d.H, d.dn, d.dr, d.dv, d.L, lens_s);
        const std::vector<out_check> oc{{o, metric::MAX_ABS, k_tol_mla_abs}, {o, metric::NMSE, k_tol_f32}};
        cuda_options fl{true, 8};
        fl.mla_prefill_tokens = 1;
        fl.mla_prefill_pairs_per_row = 0;
        EXPECT_TRUE(parity(nm, g, oc, {{&cache, touched}}, fl)) << nm;
        cuda_options simt = fl;   // the fp32 SIMT attention (fl: the tensor-core form, the default)
        simt.mla_prefill_mma = false;
        EXPECT_TRUE(parity(nm + "/simt", g, oc, {{&cache, touched}}, simt)) << nm;
        cuda_options old{true, 8};
        old.mla_prefill_tokens = 0;
        const auto got_new = run_cuda<float>(g, o, fl, {&cache}), got_old = run_cuda<float>(g, o, old, {&cache});
        const auto got_simt = run_cuda<float>(g, o, simt, {&cache});
        const bool vs = check(nm + "/vs-absorbed", to_f64(got_old), got_new, metric::NMSE, k_tol_f32);
        EXPECT_TRUE(vs) << nm;
        tally(vs);
        const bool vs_simt = check(nm + "/mma-vs-simt", to_f64(got_simt), got_new, metric::NMSE, k_tol_f32);
        EXPECT_TRUE(vs_simt) << nm;
        tally(vs_simt);
        if (T >= 17) {
            const cuda::mla_shape ms{d.H, d.dn, d.dr, d.dv, d.L};
            EXPECT_TRUE(cuda::mla_prefill_mma_supported(ms)) << nm << ": every shape here is in the tensor-core form's range";
            const bool same_simt = bitwise_same(got_new.data(), got_simt.data(), got_new.size() * 4);
            std::printf("[%s/control(mma bitwise equal to simt)] %s (must be DIFFERENT: the tensor-core kernel ran)\n",
                        nm.c_str(), same_simt ? "EQUAL" : "DIFFERENT");
            EXPECT_FALSE(same_simt) << nm;
            tally(!same_simt);
            const bool same = bitwise_same(got_new.data(), got_old.data(), got_new.size() * 4);
            std::printf("[%s/control(flash bitwise equal to absorbed)] %s (must be DIFFERENT: the flash kernel ran)\n", nm.c_str(),
                        same ? "EQUAL" : "DIFFERENT");
            EXPECT_FALSE(same) << nm;
            tally(!same);
            // cuda_options::mla_prefill_max_bytes below the step's buffers: the absorbed kernels run instead (bitwise
            // equal to them), no allocation, no error.
            cuda_options lim = fl;
            lim.mla_prefill_max_bytes = 1;
            const auto got_lim = run_cuda<float>(g, o, lim, {&cache});
            const bool fell_back = bitwise_same(got_lim.data(), got_old.data(), got_old.size() * 4);
            std::printf("[%s/over mla_prefill_max_bytes] %s the absorbed kernels' output (must be EQUAL: the fallback ran)\n",
                        nm.c_str(), fell_back ? "EQUAL to" : "DIFFERENT from");
            EXPECT_TRUE(fell_back) << nm;
            tally(fell_back);
        }
        if (T == 300 || n_seq > 1) {
            std::vector<tensor> keep;
            keep.push_back(tensor_new(cache.type, cache.shape));
            std::memcpy(keep.back().data, cache.data, cache.nbytes);
            auto cpu = backend_cpu_init();
            cpu->run(g);
            const auto ref = read_f32(*cpu, o);
            std::memcpy(cache.data, keep.back().data, cache.nbytes);
            controls(nm, ref, got_new, metric::NMSE, k_tol_f32);
        }
    }
}

// ---- 2a'. The two MLA prefill attention kernels alone (no cuBLAS) ----
// The attention kernels launched directly on random expanded keys / values (kv [P, H * (dn + dv)], krg [P, dr]), split
// by our own launch_f32_to_bf16_split: no cuBLASLt launch in this test, so compute-sanitizer racecheck can run it (its
// internal error on the cuBLAS GEMM of the node path left the tensor-core kernel's shared memory unchecked in session
// 13). Reference: a naive causal softmax attention in double over the packed rows (sequence s from row sum_{s'<s}
// (pos0 + len)). Shapes: K3's head widths (dn 128, dr 64, dv 128) and an odd one (dn 32, dr 16, dv 48), a resumed
// sequence (pos0 77, T 300) and a ragged batch (lens 17 / 64 / 3 / 1 at pos0 0 / 5 / 40 / 9).
// Controls that must FAIL: the same reference without the causal mask (keys past each query included), the
// tensor-core output bitwise equal to the SIMT one (must be DIFFERENT), the comparator family.
TEST(cuda_prefill, mla_attn_kernels_alone) {
    NEED_GPU();
    struct dims { int H, dn, dr, dv; };
    struct bcase { std::vector<int> lens, pos0; };
    const std::vector<std::pair<dims, bcase>> cases{{{2, 128, 64, 128}, {{300}, {77}}},
                                                    {{2, 128, 64, 128}, {{17, 64, 3, 1}, {0, 5, 40, 9}}},
                                                    {{3, 32, 16, 48}, {{17, 64, 3, 1}, {0, 5, 40, 9}}}};
    for (const auto & [d, bc] : cases) {
        const int n_seq = int(bc.lens.size());
        std::vector<int32_t> seq_start{0}, tok_seq;
        int64_t P = 0;
        int max_pos = 0;
        for (int s = 0; s < n_seq; ++s) {
            seq_start.push_back(seq_start.back() + bc.lens[size_t(s)]);
            for (int j = 0; j < bc.lens[size_t(s)]; ++j) tok_seq.push_back(s);
            P += bc.pos0[size_t(s)] + bc.lens[size_t(s)];
            max_pos = std::max(max_pos, bc.pos0[size_t(s)] + bc.lens[size_t(s)]);
        }
        const int T = seq_start.back(), dqk = d.dn + d.dr;
        const int64_t kvw = int64_t(d.H) * (d.dn + d.dv);
        rng r(21000 + uint32_t(T) * 5 + uint32_t(d.dn) + uint32_t(n_seq));
        const auto q = r.vec(size_t(T) * size_t(d.H * dqk)), kv = r.vec(size_t(P * kvw)), kr = r.vec(size_t(P * d.dr));
        const float scale = 1.0f / std::sqrt(float(dqk));
        std::string lens_s;
        for (int s = 0; s < n_seq; ++s) lens_s += fmt::format("{}{}@{}", s ? "," : "", bc.lens[size_t(s)], bc.pos0[size_t(s)]);
        const std::string nm = fmt::format("mla-attn-alone/H{}/dn{}/dr{}/dv{}/seqs[{}]", d.H, d.dn, d.dr, d.dv, lens_s);

        // The reference, causal (and, for the control, without the mask).
        auto reference = [&](bool causal) {
            std::vector<double> o(size_t(T) * size_t(d.H * d.dv), 0.0);
            int64_t koff = 0;
            for (int s = 0; s < n_seq; ++s) {
                const int p0 = bc.pos0[size_t(s)], len = bc.lens[size_t(s)];
                for (int j = 0; j < len; ++j) {
                    const int t = seq_start[size_t(s)] + j, nk = causal ? p0 + j + 1 : p0 + len;
                    for (int h = 0; h < d.H; ++h) {
                        std::vector<double> sc(static_cast<size_t>(nk));
                        double mx = -1e300;
                        for (int k = 0; k < nk; ++k) {
                            const float * qr = &q[(size_t(t) * size_t(d.H) + size_t(h)) * size_t(dqk)];
                            const float * kn = &kv[size_t((koff + k) * kvw + int64_t(h) * (d.dn + d.dv))];
                            const float * kp = &kr[size_t((koff + k) * d.dr)];
                            double a = 0.0;
                            for (int i = 0; i < d.dn; ++i) a += double(qr[i]) * kn[i];
                            for (int i = 0; i < d.dr; ++i) a += double(qr[d.dn + i]) * kp[i];
                            sc[size_t(k)] = a * scale;
                            mx = std::max(mx, sc[size_t(k)]);
                        }
                        double den = 0.0;
                        for (auto & x : sc) den += (x = std::exp(x - mx));
                        double * orow = &o[(size_t(t) * size_t(d.H) + size_t(h)) * size_t(d.dv)];
                        for (int k = 0; k < nk; ++k) {
                            const float * vr = &kv[size_t((koff + k) * kvw + int64_t(h) * (d.dn + d.dv) + d.dn)];
                            for (int c = 0; c < d.dv; ++c) orow[c] += sc[size_t(k)] / den * vr[c];
                        }
                    }
                }
                koff += p0 + len;
            }
            return o;
        };

        // device buffers (dev-buffer.h: freed at scope exit, also when an ASSERT ends the case early)
        const size_t on = size_t(T) * size_t(d.H * d.dv);
        dev<float> q_b(q), kv_b(kv), kr_b(kr), om_b(on), os_b(on);
        dev<int32_t> ss_b(seq_start), p0_b(bc.pos0), ts_b(tok_seq);
        dev<uint16_t> planes_b(size_t(2 * P * (kvw + d.dr)));
        float *dq = q_b.p, *dkv = kv_b.p, *dkr = kr_b.p, *dom = om_b.p, *dos = os_b.p;
        const int32_t *dss = ss_b.p, *dp0 = p0_b.p, *dts = ts_b.p;
        uint16_t *kvh = planes_b.p, *kvl = kvh + P * kvw, *krh = kvl + P * kvw, *krl = krh + P * d.dr;
        cuda::dbatch b;
        b.n_seq = n_seq, b.n_tok = T, b.seq_start = dss, b.pos0 = dp0, b.tok_seq = dts, b.max_pos = max_pos;
        const cuda::mla_shape ms{d.H, d.dn, d.dr, d.dv, 0};
        ASSERT_TRUE(cuda::mla_prefill_mma_supported(ms)) << nm;
        EXPECT_EQ(cuda::launch_f32_to_bf16_split(dkv, P * kvw, kvh, kvl, nullptr), cudaSuccess);
        EXPECT_EQ(cuda::launch_f32_to_bf16_split(dkr, P * d.dr, krh, krl, nullptr), cudaSuccess);
        EXPECT_EQ(cudaMemset(dom, 0xFF, on * 4), cudaSuccess);   // NaN: a row the kernel skips shows
        EXPECT_EQ(cudaMemset(dos, 0xFF, on * 4), cudaSuccess);
        EXPECT_EQ(cuda::launch_mla_prefill_attn_mma(dq, kvh, kvl, krh, krl, ms, scale, b, dom, nullptr), cudaSuccess);
        EXPECT_EQ(cuda::launch_mla_prefill_attn(dq, dkv, dkr, ms, scale, b, dos, nullptr), cudaSuccess);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<float> got_mma(on), got_simt(on);
        EXPECT_EQ(cudaMemcpy(got_mma.data(), dom, on * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(got_simt.data(), dos, on * 4, cudaMemcpyDeviceToHost), cudaSuccess);

        const auto ref = reference(true);
        for (const auto & [form, got] : {std::pair<const char *, const std::vector<float> &>{"mma", got_mma}, {"simt", got_simt}}) {
            const bool a = check(nm + "/" + form + "(max abs)", ref, got, metric::MAX_ABS, k_tol_mla_abs);
            const bool n = check(nm + "/" + form + "(nmse)", ref, got, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(a && n) << nm << " " << form;
            tally(a);
            tally(n);
        }
        const bool unmasked = check(nm + "/control(reference without the causal mask)", reference(false), got_mma,
                                    metric::NMSE, k_tol_f32);
        std::printf("[%s/control] the unmasked reference %s (must FAIL: the mask is what is compared)\n", nm.c_str(),
                    unmasked ? "PASSED" : "FAILED");
        EXPECT_FALSE(unmasked) << nm;
        tally(!unmasked);
        const bool same = bitwise_same(got_mma.data(), got_simt.data(), on * 4);
        std::printf("[%s/control(mma bitwise equal to simt)] %s (must be DIFFERENT: two kernels ran)\n", nm.c_str(),
                    same ? "EQUAL" : "DIFFERENT");
        EXPECT_FALSE(same) << nm;
        tally(!same);
        std::vector<float> ref_f(ref.begin(), ref.end());
        controls(nm + "/mma", ref_f, got_mma, metric::NMSE, k_tol_f32);
    }
}

// ---- 2b. SHORT_CONV token-parallel (cuda_options::conv_prefill_tokens) ----
// The same sums in the same order as the sequential kernel: y expected bitwise equal to it (printed; asserted at the f32
// tolerance) and at the f32 tolerance vs the CPU; the state write-back exact (it copies inputs / old history). Widths W 4
// (K3), 3 and 2; one fresh sequence of T in {1, 17, 64, 300, 1024} in slot 1 of 4 (the others untouched),
// a resumed one, and a ragged batch with sequences shorter than the window (lens 2 / 1 / 40 / 3 in slots 2 / 0 / 3 / 1).
// Controls that must FAIL: the CPU's state after the step vs the state before it (a skipped write-back shows), the
// comparator family.
TEST(cuda_prefill, short_conv_tokens_vs_cpu_and_sequential) {
    NEED_GPU();
    struct bcase { std::vector<int> lens, slots; };
    std::vector<std::pair<int, bcase>> cases;
    for (int T : {1, 17, 64, 300, 1024}) cases.push_back({4, {{T}, {1}}});
    cases.push_back({3, {{2, 1, 40, 3}, {2, 0, 3, 1}}});
    cases.push_back({4, {{2, 1, 40, 3}, {2, 0, 3, 1}}});
    cases.push_back({2, {{17, 5}, {0, 1}}});
    for (const auto & [W, bc] : cases) {
        const int C = 200, n_slots = 4;
        auto b = std::make_shared<batch>();
        b->seq_start = {0};
        for (size_t s = 0; s < bc.lens.size(); ++s) {
            b->seq_start.push_back(b->seq_start.back() + bc.lens[s]);
            b->pos0.push_back(13);   // resumed: the state holds the earlier tokens
            b->slot.push_back(bc.slots[s]);
        }
        b->ids.assign(size_t(b->seq_start.back()), 0);
        const int T = b->n_tokens();
        rng r(15000 + uint32_t(T) * 3 + uint32_t(W) + uint32_t(bc.lens.size()));
        arena a;
        builder bd(b);
        auto xv = r.vec(size_t(T) * C), cw = r.vec(size_t(C) * W, -0.5f, 0.5f), sv = r.vec(size_t(n_slots) * C * (W > 1 ? W - 1 : 1));
        tensor & st = a.f32({n_slots, C, W - 1}, W > 1 ? sv : std::vector<float>{});
        const node_ref x = bd.scale(bd.weight(a.f32({T, C}, xv), "x"), 1.0f);
        const node_ref y = bd.name(bd.short_conv(x, bd.weight(a.bf16({C, 1, W}, cw), "conv_w"), bd.state(st, "conv_state")), "conv");
        graph g = bd.finish(y);
        std::set<int64_t> touched(bc.slots.begin(), bc.slots.end());
        std::string lens_s;
        for (size_t s = 0; s < bc.lens.size(); ++s) lens_s += fmt::format("{}{}", s ? "," : "", bc.lens[s]);
        const std::string nm = fmt::format("conv-tokens/W{}/seqs[{}]", W, lens_s);
        cuda_options tk{true, 8};
        tk.conv_prefill_tokens = 1;
        EXPECT_TRUE(parity(nm, g, {{y, metric::NMSE, k_tol_f32}}, {{&st, touched}}, tk)) << nm;
        cuda_options old{true, 8};
        old.conv_prefill_tokens = 0;
        const auto got_new = run_cuda<float>(g, y, tk, {&st}), got_old = run_cuda<float>(g, y, old, {&st});
        const bool vs = check(nm + "/vs-sequential", to_f64(got_old), got_new, metric::NMSE, k_tol_f32);
        EXPECT_TRUE(vs) << nm;
        tally(vs);
        std::printf("[%s/bitwise vs sequential] %s (expected EQUAL: the same sums in the same order; informational)\n",
                    nm.c_str(), bitwise_same(got_new.data(), got_old.data(), got_new.size() * 4) ? "EQUAL" : "DIFFERENT");
        if (T >= 17 && W > 1) {
            const auto before = host_f32(st);
            auto cpu = backend_cpu_init();
            cpu->run(g);
            const auto ref = read_f32(*cpu, y), after = host_f32(st);
            std::memcpy(st.data, before.data(), before.size() * 4);
            const bool skipped = check(nm + "/control(state not written back)", to_f64(after), before, metric::NMSE, 0.0);
            EXPECT_FALSE(skipped) << nm;
            tally(!skipped);
            controls(nm, ref, got_new, metric::NMSE, k_tol_f32);
        }
    }
}

// ---- 2c. ATTN_RES_MIX prefill kernels (cuda_options::attn_res_prefill_tokens) ----
// Scores' sums in another order (warp sums over float4), the softmax weights in the split kernels' serial order: expected
// NMSE vs the CPU ~1e-14, tolerance the f32 one. n in {1, 3, 9} candidates, D 7168 (K3) and 520, BF16 and F32 norm /
// projection weights, T in {1, 17, 64, 300, 1024}; D 1001 (not a multiple of 4) takes the split kernels (parity only).
// Every case also against the split kernels directly. Controls that must FAIL: bitwise equal to the split kernels (n >= 3,
// T >= 17: must be DIFFERENT, the new scores ran), the comparator family.
TEST(cuda_prefill, attn_res_mix_vs_cpu_and_split) {
    NEED_GPU();
    struct shape { int n, D; bool bf16; std::vector<int> Ts; };
    const std::vector<shape> shapes = {{3, 520, true, {1, 17, 64, 300, 1024}}, {9, 7168, true, {1, 17, 300}},
                                       {1, 520, false, {64}}, {9, 520, false, {1024}}, {3, 1001, true, {300}}};
    for (const shape & sh : shapes) {
        for (int T : sh.Ts) {
            rng r(16000 + uint32_t(sh.n * 100 + sh.D + T));
            arena a;
            builder bd(batch_simple(T));
            std::vector<node_ref> cands;
            for (int i = 0; i < sh.n; ++i)
                cands.push_back(bd.scale(bd.weight(a.f32({T, sh.D}, r.vec(size_t(T) * sh.D, -2.0f, 2.0f)), fmt::format("v{}", i)), 1.0f));
            auto nw = r.vec(size_t(sh.D), 0.5f, 1.5f), pw = r.vec(size_t(sh.D), -0.1f, 0.1f);
            const node_ref y = bd.name(bd.attn_res_mix(cands, bd.weight(a.typed(sh.bf16 ? dtype::BF16 : dtype::F32, {sh.D}, nw), "norm_w"),
                                                       bd.weight(a.typed(sh.bf16 ? dtype::BF16 : dtype::F32, {sh.D}, pw), "proj_w"), 1e-6f),
                                       "attn_res");
            graph g = bd.finish(y);
            const std::string nm = fmt::format("attn-res-prefill/n{}/D{}/{}/T{}", sh.n, sh.D, sh.bf16 ? "bf16" : "f32", T);
            cuda_options pf{true, 8};
            pf.attn_res_prefill_tokens = 1;
            EXPECT_TRUE(parity(nm, g, {{y, metric::NMSE, k_tol_f32}}, {}, pf)) << nm;
            cuda_options old{true, 8};
            old.attn_res_prefill_tokens = 0;
            const auto got_new = run_cuda<float>(g, y, pf), got_old = run_cuda<float>(g, y, old);
            const bool vs = check(nm + "/vs-split", to_f64(got_old), got_new, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(vs) << nm;
            tally(vs);
            if (sh.n >= 3 && T >= 17 && sh.D % 4 == 0) {
                const bool same = bitwise_same(got_new.data(), got_old.data(), got_new.size() * 4);
                std::printf("[%s/control(prefill bitwise equal to split)] %s (must be DIFFERENT: the new kernels ran)\n",
                            nm.c_str(), same ? "EQUAL" : "DIFFERENT");
                EXPECT_FALSE(same) << nm;
                tally(!same);
                auto cpu = backend_cpu_init();
                cpu->run(g);
                controls(nm, read_f32(*cpu, y), got_new, metric::NMSE, k_tol_f32);
            }
        }
    }
}

// The adopted defaults (round 2): every prefill path on from a prefill-sized step, decode-sized batches on the old
// kernels. Host-only: fails when a default is switched off again without this test saying so.
TEST(cuda_prefill, defaults_on_for_prefill) {
    const cuda_options d;
    std::printf("[defaults] moe_route_gemm_tokens %d, mla_prefill_tokens %d (pairs/row %d, max bytes %lld), conv_prefill_tokens %d, "
                "attn_res_prefill_tokens %d\n", d.moe_route_gemm_tokens, d.mla_prefill_tokens, d.mla_prefill_pairs_per_row,
                (long long)d.mla_prefill_max_bytes, d.conv_prefill_tokens, d.attn_res_prefill_tokens);
    for (int v : {d.moe_route_gemm_tokens, d.mla_prefill_tokens, d.conv_prefill_tokens, d.attn_res_prefill_tokens}) {
        EXPECT_GT(v, 1);    // on ...
        EXPECT_LE(v, 64);   // ... for every prefill chunk of 64 tokens or more
    }
    EXPECT_GE(d.mla_prefill_max_bytes, int64_t(1) << 30);
}

// ---- 3. Micro-timing at K3's widths, T = 2048, one fresh sequence (printed, not asserted) ----
// The node's GPU time (cuda_options::profile_nodes, the second of two eager runs) for the new and the old path.
double node_time_ms(graph & g, node_ref r, cuda_options opt) {
    opt.guard = false;
    opt.profile_nodes = true;
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(g);
    gpu->run(g);
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
        gpu->run(g);
        const auto ms = gpu->node_ms();
        if (size_t(r.node) < ms.size()) best = std::min(best, double(ms[size_t(r.node)]));
    }
    return best;
}

TEST(cuda_prefill, timing_k3_widths) {
    NEED_GPU();
    for (int T : {512, 2048}) {
        {   // router: 896 experts x 7168, top-16 of 8 groups keeping 4, BF16 gate
            const int E = 896, D = 7168;
            rng r(14000 + uint32_t(T));
            arena a;
            builder bd(batch_simple(T));
            auto xv = r.vec(size_t(T) * D), gw = r.vec(size_t(E) * D, -0.3f, 0.3f), bv = r.vec(size_t(E), -0.05f, 0.05f);
            const node_ref x = bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f);
            auto [ids, w] = bd.moe_route(x, bd.weight(a.bf16({E, D}, gw), "gate"), bd.weight(a.f32({E}, bv), "bias"),
                                         {16, 8, 4, true, 2.5f, router_act::SIGMOID});
            graph g = bd.finish(w);
            cuda_options gm, old;
            gm.moe_route_gemm_tokens = 1;
            old.moe_route_gemm_tokens = 0;
            const double tn = node_time_ms(g, w, gm), to = node_time_ms(g, w, old);
            std::printf("[timing] MOE_ROUTE E %d D %d T %d: gemm %.3f ms, gemv (old) %.3f ms (%.1fx)\n", E, D, T, tn, to, to / tn);
        }
        {   // MLA: 96 heads, dn 128, dr 64, dv 128, L 512, page 64
            const int H = 96, dn = 128, dr = 64, dv = 128, L = 512, ps = 64;
            const int pages = T / ps + 1;
            auto b = batch_seqs({T}, {0}, ps, pages);
            rng r(14500 + uint32_t(T));
            arena a;
            builder bd(b);
            auto qv = r.vec(size_t(T) * H * (dn + dr)), cv = r.vec(size_t(T) * L), krv = r.vec(size_t(T) * dr);
            auto kvb = r.vec(size_t(H) * (dn + dv) * L, -0.05f, 0.05f);
            auto cache0 = std::vector<float>(size_t(pages) * ps * (L + dr), 0.0f);
            tensor & cache = a.f32({pages, ps, L + dr}, cache0);
            const node_ref o = bd.mla_attn(bd.scale(bd.weight(a.f32({T, H * (dn + dr)}, qv), "q"), 1.0f),
                                           bd.scale(bd.weight(a.f32({T, L}, cv), "c"), 1.0f),
                                           bd.scale(bd.weight(a.f32({T, dr}, krv), "kr"), 1.0f),
                                           bd.weight(a.bf16({H * (dn + dv), L}, kvb), "kv_b"), bd.state(cache, "mla_cache"),
                                           node_ref{}, {H, dn, dr, dv, L, 0.0722f});
            graph g = bd.finish(o);
            cuda_options fl, old;
            fl.mla_prefill_tokens = 1;
        fl.mla_prefill_pairs_per_row = 0;
            old.mla_prefill_tokens = 0;
            const double tn = node_time_ms(g, o, fl), to = node_time_ms(g, o, old);
            std::printf("[timing] MLA_ATTN H %d T %d: flash %.3f ms, absorbed (old) %.3f ms (%.1fx)\n", H, T, tn, to, to / tn);
        }
        {   // SHORT_CONV: 12288 channels (K3's KDA q/k/v width: 96 heads x 128), W 4
            const int C = 12288, W = 4;
            rng r(14800 + uint32_t(T));
            arena a;
            builder bd(batch_simple(T));
            auto xv = r.vec(size_t(T) * C), cw = r.vec(size_t(C) * W, -0.5f, 0.5f);
            tensor & st = a.f32({1, C, W - 1}, std::vector<float>(size_t(C) * (W - 1), 0.0f));
            const node_ref x = bd.scale(bd.weight(a.f32({T, C}, xv), "x"), 1.0f);
            const node_ref y = bd.short_conv(x, bd.weight(a.bf16({C, 1, W}, cw), "conv_w"), bd.state(st, "conv_state"));
            graph g = bd.finish(y);
            cuda_options tk, old;
            tk.conv_prefill_tokens = 1;
            old.conv_prefill_tokens = 0;
            const double tn = node_time_ms(g, y, tk), to = node_time_ms(g, y, old);
            std::printf("[timing] SHORT_CONV C %d W %d T %d: tokens %.3f ms, sequential (old) %.3f ms (%.1fx)\n", C, W, T, tn, to,
                        to / tn);
        }
        {   // ATTN_RES_MIX: 9 candidates of 7168, BF16 norm / projection
            const int n = 9, D = 7168;
            rng r(14900 + uint32_t(T));
            arena a;
            builder bd(batch_simple(T));
            std::vector<node_ref> cands;
            for (int i = 0; i < n; ++i)
                cands.push_back(bd.scale(bd.weight(a.f32({T, D}, r.vec(size_t(T) * D)), fmt::format("v{}", i)), 1.0f));
            auto nw = r.vec(size_t(D), 0.5f, 1.5f), pw = r.vec(size_t(D), -0.1f, 0.1f);
            const node_ref y = bd.attn_res_mix(cands, bd.weight(a.bf16({D}, nw), "norm_w"), bd.weight(a.bf16({D}, pw), "proj_w"), 1e-6f);
            graph g = bd.finish(y);
            cuda_options pf, old;
            pf.attn_res_prefill_tokens = 1;
            old.attn_res_prefill_tokens = 0;
            const double tn = node_time_ms(g, y, pf), to = node_time_ms(g, y, old);
            std::printf("[timing] ATTN_RES_MIX n %d D %d T %d: prefill %.3f ms, split (old) %.3f ms (%.1fx)\n", n, D, T, tn, to,
                        to / tn);
        }
    }
}

class summary : public ::testing::Environment {
public:
    void TearDown() override { std::printf("%d passed, %d failed\n", g_passed, g_failed); }
};
const auto * g_env = ::testing::AddGlobalTestEnvironment(new summary);

} // namespace
} // namespace perigee::test
