// perigee compare-backends: runs the same model on the CPU reference and the CUDA backend, node by node
// (STYLE §3.4 rule 5, ggml_backend_compare_graph_backend), and names the first node out of tolerance.
// A prefill of --ids then --decode greedy steps; each backend has its own state pools (the CUDA ones stay
// on the device); every F32 output is compared by NMSE, every I32 output (routing ids, indexer selections)
// exactly. Greedy tokens must be identical. Exit code 1 on any difference.
#include "cli-util.h"
#include "command.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/forward.h"
#include "model/route-ties.h"
#include "model/weights.h"

#if defined(PERIGEE_HAVE_CUDA)
#include "backend/cuda/backend-cuda.h"
#endif

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

namespace perigee::cli {
namespace {


struct opts {
    std::string model;
    std::string ids;
    int decode = 4;
    double tol = 1e-6;
    bool all = false;
    int device = 0;
    int chunk = 64;
    int linear_group = -1;   // cuda_options::linear_group: -1 the default, 0 off, 1 on
    int moe_mma = -1;        // cuda_options::moe_mma_tokens: -1 the default, 0 off, N > 0 the token threshold
    int fuse = -1;           // cuda_options::fuse_norm_linear, fuse_add, fuse_conv_l2, fuse_sigmoid, fuse_kda_decode: -1 the defaults, 0 all off, 1 all on
    int kda_chunk = -1;      // cuda_options::kda_chunk_min_tokens: -1 the default, 0 off, N > 0 the token threshold
    int prefill_fast = -1;   // cuda_options::{moe_route_gemm,mla_prefill,conv_prefill,attn_res_prefill}_tokens: -1 the defaults, 0 off, N > 0
    int moe_mma_v2 = -1;     // cuda_options::moe_mma_v2: -1 the default, 0 off, 1 on
    int moe_v4 = -1;         // cuda_options::moe_decode_v4 + moe_small_v4: -1 the defaults, 0 both off, 1 both on
    int moe_shared_slot = -1;   // cuda_options::moe_shared_slot: -1 the default, 0 off, 1 on
    int bf16_inputs = 0;     // forward_options::bf16_inputs_min_tokens (both backends' graphs): 0 off, N >= 2
};

#if defined(PERIGEE_HAVE_CUDA)

struct diff { double nmse = 0.0; int64_t mismatches = 0; bool nonfinite = false; };

diff compare_tensors(const tensor & a, const tensor & b) {
    diff d;
    if (a.type != b.type || a.shape != b.shape) {
        d.mismatches = -1;
        return d;
    }
    if (a.type == dtype::I32) {
        for (int64_t i = 0; i < a.numel(); ++i) d.mismatches += a.as<int32_t>()[i] != b.as<int32_t>()[i];
        return d;
    }
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < a.numel(); ++i) {
        const double x = a.as<float>()[i], y = b.as<float>()[i];
        if (std::isfinite(x) != std::isfinite(y)) d.nonfinite = true;
        if (!std::isfinite(x) || !std::isfinite(y)) continue;
        num += (x - y) * (x - y);
        den += x * x;
    }
    d.nmse = den > 0 ? num / den : num;
    return d;
}

// ---- INDEXER_TOPK near ties ----
// The CUDA scores differ from the CPU's by fp32 rounding (the kernel sums the dot in a warp tree and fuses
// multiply-adds; the CPU sums sequentially) and by the upstream differences in qi / ki / wi (each within --tol), so
// at the top-k boundary a near tie may flip. Per token whose selected set differs: the flipped boundary's gap on the
// CPU's own scores, gap = min(score of CPU-only positions) - max(score of CUDA-only positions) (>= 0: the CPU set is
// the exact top-k), is accepted as a near tie only when gap <= 2 (delta + r), where delta = max_p |s_cpu(p) -
// s(p) from the CUDA inputs| (both scored on the host with the CPU formula) and r = 2 (d + I + 1) 2^-24 max_p
// |scale| sum_h |w_h| sum_i |q_hi k_pi| (the fp32 summation-order bound, both sides). An exact tie (gap 0) with
// identical scores (delta 0) must go to the lower position: it is never accepted. Sets of different sizes, -1 padding
// in other places or repeated ids always fail.
struct idx_keys { std::vector<float> cpu, gpu; int64_t d = 0; };   // per layer: key rows by position, both sides

// What a near-tie check found (INDEXER_TOPK and MOE_ROUTE alike): tokens whose picks differ, of which near ties
// accepted and decided (failures), and the largest gap and bound seen.
struct near_tie_verdict {
    int64_t tokens = 0, ties = 0, decided = 0;
    double max_gap = 0.0, max_bound = 0.0;
    void add(bool tie, double gap, double bound) {
        (tie ? ties : decided)++;
        max_gap = std::max(max_gap, gap);
        max_bound = std::max(max_bound, bound);
    }
};

// The controls of both rules: the best-scored selected entry of `row` (K picks) swapped for the worst-scored unselected
// one of 0..n-1. Returns whether that changes the set's scores (false: every score equal, nothing to decide).
template <typename S>
bool swap_best_for_worst(int32_t * row, int64_t K, const std::vector<S> & sc, int64_t n) {
    const std::set<int32_t> in(row, row + K);
    int64_t best = 0, worst = -1;
    for (int64_t j = 1; j < K; ++j)
        if (sc[size_t(row[j])] > sc[size_t(row[best])]) best = j;
    for (int64_t p = 0; p < n; ++p)
        if (!in.count(int32_t(p)) && (worst < 0 || sc[size_t(p)] < sc[size_t(worst)])) worst = p;
    const bool flips = sc[size_t(worst)] < sc[size_t(row[best])];
    row[best] = int32_t(worst);
    return flips;
}

std::vector<float> idx_scores(const float * q, const float * w, const std::vector<float> & keys, int64_t I, int64_t d,
                              float scale, int64_t n, double * abs_max) {
    std::vector<float> sc(static_cast<size_t>(n));
    double am = 0.0;
    for (int64_t p = 0; p < n; ++p) {
        const float * kp = keys.data() + p * d;
        float acc = 0.0f;
        double ab = 0.0;
        for (int64_t h = 0; h < I; ++h) {
            float dot = 0.0f;
            double ad = 0.0;
            for (int64_t i = 0; i < d; ++i) dot += q[h * d + i] * kp[i], ad += std::fabs(double(q[h * d + i]) * kp[i]);
            acc += w[h] * std::max(dot, 0.0f);
            ab += std::fabs(double(w[h])) * ad;
        }
        sc[size_t(p)] = scale * acc;
        am = std::max(am, std::fabs(double(scale)) * ab);
    }
    *abs_max = am;
    return sc;
}

near_tie_verdict idx_check(const node & n, const tensor & sel_cpu, const tensor & sel_gpu, const tensor & q_cpu, const tensor & w_cpu,
                           const tensor & q_gpu, const tensor & w_gpu, const idx_keys & keys, int n_past, const std::string & name) {
    near_tie_verdict v;
    const int64_t T = sel_cpu.shape.at(0), K = sel_cpu.shape.at(1), I = n.p.n_head, d = n.p.head_dim_k;
    for (int64_t t = 0; t < T; ++t) {
        const int32_t * rc = sel_cpu.as<int32_t>() + t * K;
        const int32_t * rg = sel_gpu.as<int32_t>() + t * K;
        if (std::equal(rc, rc + K, rg)) continue;
        ++v.tokens;
        const int64_t npos = n_past + t + 1;
        std::vector<int32_t> a(rc, rc + K), b(rg, rg + K), only_c, only_g;
        const auto valid = [&](const std::vector<int32_t> & x) {
            std::set<int32_t> u;
            int64_t cnt = 0;
            for (int32_t e : x) {
                if (e < 0) continue;
                if (e >= npos || !u.insert(e).second) return int64_t(-1);
                ++cnt;
            }
            return cnt;
        };
        const int64_t na = valid(a), nb = valid(b);
        if (na < 0 || nb < 0 || na != nb || na != std::min<int64_t>(K, npos)) {
            std::printf("    %s token %lld: CUDA selection invalid or of another size (%lld vs %lld valid ids): FAILED\n", name.c_str(),
                        (long long)t, (long long)nb, (long long)na);
            ++v.decided;
            continue;
        }
        std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
        std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only_c));
        std::set_difference(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(only_g));
        double am_c = 0.0, am_g = 0.0;
        const auto sc = idx_scores(q_cpu.as<float>() + t * I * d, w_cpu.as<float>() + t * I, keys.cpu, I, d, n.p.scale, npos, &am_c);
        const auto sg = idx_scores(q_gpu.as<float>() + t * I * d, w_gpu.as<float>() + t * I, keys.gpu, I, d, n.p.scale, npos, &am_g);
        double delta = 0.0;
        for (int64_t p = 0; p < npos; ++p) delta = std::max(delta, std::fabs(double(sc[size_t(p)]) - sg[size_t(p)]));
        const double r = 2.0 * double(d + I + 1) * std::ldexp(1.0, -24) * std::max(am_c, am_g);
        const double bound = 2.0 * (delta + r);
        float lo_c = INFINITY, hi_g = -INFINITY;
        for (int32_t p : only_c) lo_c = std::min(lo_c, sc[size_t(p)]);
        for (int32_t p : only_g) hi_g = std::max(hi_g, sc[size_t(p)]);
        const double gap = double(lo_c) - double(hi_g);
        const bool tie = gap >= 0.0 && gap <= bound && !(gap == 0.0 && delta == 0.0);
        v.add(tie, gap, bound);
        std::string sa, sb;
        for (int32_t p : only_c) sa += fmt::format("{}{}({:.9g})", sa.empty() ? "" : ",", p, sc[size_t(p)]);
        for (int32_t p : only_g) sb += fmt::format("{}{}({:.9g})", sb.empty() ? "" : ",", p, sc[size_t(p)]);
        std::printf("    %s token %lld (pos %lld): cpu-only [%s] cuda-only [%s] (cpu scores); gap %.3e %s bound %.3e "
                    "(delta %.3e from the inputs, fp32 order %.3e): %s\n",
                    name.c_str(), (long long)t, (long long)(npos - 1), sa.c_str(), sb.c_str(), gap, tie ? "<=" : ">", bound, delta, r,
                    tie ? "near tie, accepted" : "DECIDED: FAILED");
    }
    return v;
}

// ---- MOE_ROUTE near ties ----
// The router is a top-k too: the CUDA logits differ from the CPU's by fp32 summation order and by the upstream
// differences in the router's input h (within --tol), so at the top-k boundary a near tie may flip (first seen on
// models/k31-default with a 300-token prompt, session 7: 2 of 1 200 picks at layer 4, greedy tokens identical). The
// INDEXER_TOPK rule above, applied to the router: per token whose ids differ, the biased scores (sigmoid or softmax of
// the logits, plus the bias) are recomputed on the host in fp64 from the CPU's h and from the CUDA's h; delta = their
// largest difference, r = 2 D 2^-24 max_e sum_i |h_i g_ei| + 2^-22 (the fp32 summation-order bound of a logit, both
// sides, which the sigmoid / softmax do not enlarge, plus the score and bias roundings). A different set is accepted
// only when gap = min(biased of CPU-only ids) - max(biased of CUDA-only ids) is in [0, 2 (delta + r)] (and not an exact
// tie on identical inputs); the same set in another order only when every pair in the other order is within the bound.
// Grouped routing (groups dropped before the top-k): the group choice under the same rule on the group scores (sums
// of two biased scores: twice the bound), then the experts inside the CUDA's groups (model/route-ties.h). Until
// session 21 grouped routing had no rule and every difference failed (the Kimi-Linear goldens under bf16 inputs).

near_tie_verdict route_check(const node & n, const tensor & ids_c, const tensor & ids_g, const tensor & h_c,
                             const tensor & h_g, const tensor & gate, const tensor * bias, const std::string & name) {
    near_tie_verdict v;
    const int64_t T = ids_c.shape.at(0), K = ids_c.shape.at(1), D = gate.shape.at(1);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t * rc = ids_c.as<int32_t>() + t * K;
        const int32_t * rg = ids_g.as<int32_t>() + t * K;
        if (std::equal(rc, rc + K, rg)) continue;
        ++v.tokens;
        const route_tie rt = route_near_tie(rc, rg, K, h_c.as<float>() + t * D, h_g.as<float>() + t * D, gate, bias, n.p.router,
                                            n.p.n_group, n.p.topk_group);
        if (rt.refused) {
            std::printf("    %s token %lld: CUDA %s: FAILED\n", name.c_str(), (long long)t, rt.what.c_str());
            ++v.decided;
            continue;
        }
        v.add(rt.tie, rt.gap, rt.bound);
        std::printf("    %s token %lld: %s gap %.3e %s bound %.3e (delta %.3e from the inputs, fp32 order %.3e): %s\n",
                    name.c_str(), (long long)t, rt.what.c_str(), rt.gap, rt.tie ? "<=" : ">", rt.bound, rt.delta, rt.r,
                    rt.tie ? "near tie, accepted" : "DECIDED: FAILED");
    }
    return v;
}

int32_t argmax_last(const tensor & logits) {
    const int64_t V = logits.shape.at(1), r = logits.shape.at(0) - 1;
    const float * p = logits.as<float>() + r * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
        if (p[i] > p[best]) best = i;   // ties to the lower id
    return int32_t(best);
}

int run_compare(const opts & o) {
    const kimi_config cfg = config_load(o.model);
    auto w = weights_load(cfg, checkpoint::open(o.model));
    auto prompt = parse_id_list(o.ids);
    for (int32_t id : prompt) PG_CHECK(id < cfg.vocab_size, "--ids: token id {} is outside the vocabulary of {}", id, cfg.vocab_size);
    const int page_size = 16;
    const int total = int(prompt.size()) + o.decode;
    const int n_pages = (total + page_size - 1) / page_size;
    model_state st_cpu = state_init(cfg, 1, n_pages, page_size);
    model_state st_gpu = state_init(cfg, 1, n_pages, page_size);
    auto cpu = backend_cpu_init();
    cuda_options co;
    if (o.linear_group >= 0) co.linear_group = o.linear_group != 0;
    if (o.moe_mma >= 0) co.moe_mma_tokens = o.moe_mma, co.moe_mma_large_step = 0;
    if (o.fuse >= 0) co.fuse_norm_linear = co.fuse_add = co.fuse_conv_l2 = co.fuse_sigmoid = co.fuse_kda_decode = o.fuse != 0;
    if (o.kda_chunk >= 0) co.kda_chunk_min_tokens = o.kda_chunk;
    if (o.moe_mma_v2 >= 0) co.moe_mma_v2 = o.moe_mma_v2 != 0;
    if (o.moe_v4 >= 0) co.moe_decode_v4 = co.moe_small_v4 = o.moe_v4 != 0;
    if (o.moe_shared_slot >= 0) co.moe_shared_slot = o.moe_shared_slot != 0;
    if (o.prefill_fast >= 0) co.moe_route_gemm_tokens = co.mla_prefill_tokens = co.conv_prefill_tokens = co.attn_res_prefill_tokens = o.prefill_fast;
    auto gpu = backend_cuda_init(o.device, co);
    std::printf("compare-backends: model %s, cpu vs cuda (%s), prompt %zu tokens, %d decode steps, NMSE tolerance %.1e\n",
                o.model.c_str(), gpu->device_name().c_str(), prompt.size(), o.decode, o.tol);
    std::vector<int32_t> toks_cpu, toks_gpu;
    std::vector<int32_t> pages;
    for (int p = 0; p < n_pages; ++p) pages.push_back(p);
    int n_past = 0;
    bool ok = true;
    std::map<std::string, idx_keys> idx_hist;   // INDEXER_TOPK key rows by position, both backends (near-tie check)
    std::string tie_at;                          // the first accepted near tie (indexer or router): later differences not held to --tol
    int64_t n_ties = 0;
    bool idx_control_done = false;   // once per run, at the first INDEXER_TOPK that selects
    bool route_control_done = false; // once per run, at the first MOE_ROUTE
    std::vector<int32_t> feed = prompt;
    for (int step = 0; step <= o.decode; ++step) {
        auto b = std::make_shared<batch>();
        b->ids = feed;
        b->seq_start = {0, int32_t(feed.size())};
        b->pos0 = {n_past};
        b->slot = {0};
        b->page_size = page_size;
        b->block_table = {pages};
        forward_options fo;
        fo.kda_chunk_size = o.chunk;
        fo.bf16_inputs_min_tokens = o.bf16_inputs;
        graph gc = forward_build(cfg, *w, st_cpu, b, fo);
        graph gg = forward_build(cfg, *w, st_gpu, b, fo);
        PG_CHECK(gc.nodes.size() == gg.nodes.size(), "the two graphs differ in size: {} vs {}", gc.nodes.size(), gg.nodes.size());
        cpu->check_supported(gc);
        gpu->check_supported(gg);
        std::vector<std::vector<tensor>> ref(gc.nodes.size());
        std::set<int> idx_src;   // nodes feeding an INDEXER_TOPK or a MOE_ROUTE: CUDA outputs kept for the near-tie checks
        for (const node & n : gg.nodes) {
            if (n.op == op_type::INDEXER_TOPK)
                for (int k = 0; k < 3; ++k) idx_src.insert(n.src.at(size_t(k)).node);
            if (n.op == op_type::MOE_ROUTE) idx_src.insert(n.src.at(0).node);   // the router's input h (its near ties)
        }
        std::map<int, std::vector<tensor>> gkeep;
        cpu->run(gc, [&](const graph & g, int id, const std::vector<tensor> & outs) {
            if (g.nodes[size_t(id)].op == op_type::WEIGHT) return;
            for (const auto & t : outs) {
                tensor c = tensor_new(t.type, t.shape);
                if (t.nbytes) std::memcpy(c.data, t.data, t.nbytes);
                ref[size_t(id)].push_back(std::move(c));
            }
        });
        int first_bad = -1, compared = 0;
        double worst = 0.0;
        std::string worst_name;
        const auto t0 = std::chrono::steady_clock::now();
        gpu->run(gg, [&](const graph & g, int id, const std::vector<tensor> & outs) {
            const node & n = g.nodes[size_t(id)];
            if (n.op == op_type::WEIGHT) return;
            if (idx_src.count(id))
                for (const auto & t : outs) {
                    tensor c = tensor_new(t.type, t.shape);
                    if (t.nbytes) std::memcpy(c.data, t.data, t.nbytes);
                    gkeep[id].push_back(std::move(c));
                }
            if (n.op == op_type::INDEXER_TOPK) {   // this step's key rows, appended at positions n_past..
                const node_ref kr = n.src.at(1);
                const tensor & kc = ref[size_t(kr.node)].at(size_t(kr.out));
                const bool have_g = gkeep.count(kr.node) && gkeep.at(kr.node).size() > size_t(kr.out);
                if (!have_g) std::printf("  note: no CUDA output of '%s' seen (fused?): the near-tie check uses the CPU's keys\n",
                                         gg.nodes[size_t(kr.node)].name.c_str());
                const tensor & kg = have_g ? gkeep.at(kr.node).at(size_t(kr.out)) : kc;
                idx_keys & h = idx_hist[n.name];
                h.d = n.p.head_dim_k;
                PG_CHECK(kc.numel() == int64_t(feed.size()) * h.d && kg.numel() == kc.numel() && int64_t(h.cpu.size()) == n_past * h.d,
                         "{}: index keys of {} values for {} tokens of width {} after {} positions", n.name, kc.numel(), feed.size(),
                         h.d, n_past);
                h.cpu.insert(h.cpu.end(), kc.as<float>(), kc.as<float>() + kc.numel());
                h.gpu.insert(h.gpu.end(), kg.as<float>(), kg.as<float>() + kg.numel());
            }
            for (size_t k = 0; k < outs.size(); ++k) {
                const diff d = compare_tensors(ref[size_t(id)].at(k), outs[k]);
                ++compared;
                bool bad = d.mismatches != 0 || d.nonfinite || d.nmse > o.tol;
                if (d.nmse > worst) worst = d.nmse, worst_name = n.name;
                // a near-tie verdict on this output: printed; only near ties (none decided) clear it, and the first
                // accepted tie marks where the two runs may diverge downstream
                const auto settle = [&](const near_tie_verdict & v, int64_t mismatches) {
                    std::printf("  node %d '%s' (%s): %lld exact mismatches in %lld tokens: %lld near ties accepted, %lld "
                                "decided (max gap %.3e, max bound %.3e)\n", id, n.name.c_str(), std::string(op_name(n.op)).c_str(),
                                (long long)mismatches, (long long)v.tokens, (long long)v.ties, (long long)v.decided, v.max_gap,
                                v.max_bound);
                    if (v.decided == 0 && v.ties > 0) {
                        bad = false;
                        n_ties += v.ties;
                        if (tie_at.empty()) tie_at = fmt::format("step {} '{}'", step, n.name);
                    }
                };
                if (n.op == op_type::INDEXER_TOPK && !idx_control_done) {   // control: a decided swap must FAIL the near-tie rule
                    const tensor & rc = ref[size_t(id)].at(k);
                    const int64_t K = rc.shape.at(1), t = rc.shape.at(0) - 1, npos = n_past + t + 1;
                    if (npos > K + 1) {
                        idx_control_done = true;
                        tensor bad_sel = tensor_new(rc.type, rc.shape);
                        std::memcpy(bad_sel.data, rc.data, rc.nbytes);
                        const node_ref qr = n.src.at(0), wr = n.src.at(2);
                        double am = 0.0;
                        const auto sc = idx_scores(ref[size_t(qr.node)].at(size_t(qr.out)).as<float>() + t * n.p.n_head * n.p.head_dim_k,
                                                   ref[size_t(wr.node)].at(size_t(wr.out)).as<float>() + t * n.p.n_head,
                                                   idx_hist[n.name].cpu, n.p.n_head, n.p.head_dim_k, n.p.scale, npos, &am);
                        const bool flips = swap_best_for_worst(bad_sel.as<int32_t>() + t * K, K, sc, npos);
                        std::printf("  control: '%s' with the best selected position of token %lld swapped for the worst:\n", n.name.c_str(),
                                    (long long)t);
                        const near_tie_verdict cv = idx_check(n, rc, bad_sel, ref[size_t(qr.node)].at(size_t(qr.out)),
                                                         ref[size_t(wr.node)].at(size_t(wr.out)), ref[size_t(qr.node)].at(size_t(qr.out)),
                                                         ref[size_t(wr.node)].at(size_t(wr.out)), idx_hist[n.name], n_past, n.name + "/control");
                        const bool cok = !flips || cv.decided > 0;
                        std::printf("  control: %s\n", !flips ? "skipped (all scores equal)" : cok ? "decided, FAILS as it must" : "ACCEPTED: the near-tie rule is broken");
                        ok &= cok;
                    }
                }
                if (bad && n.op == op_type::INDEXER_TOPK && d.mismatches > 0) {
                    const auto ref_of = [&](int src) -> const tensor & {
                        const node_ref r = n.src.at(size_t(src));
                        return ref[size_t(r.node)].at(size_t(r.out));
                    };
                    const auto gpu_of = [&](int src) -> const tensor & {
                        const node_ref r = n.src.at(size_t(src));
                        if (gkeep.count(r.node) && gkeep.at(r.node).size() > size_t(r.out)) return gkeep.at(r.node).at(size_t(r.out));
                        return ref[size_t(r.node)].at(size_t(r.out));   // not seen on the CUDA side (fused): the CPU's
                    };
                    settle(idx_check(n, ref[size_t(id)].at(k), outs[k], ref_of(0), ref_of(2), gpu_of(0), gpu_of(2), idx_hist[n.name],
                                     n_past, n.name),
                           d.mismatches);
                }
                if (n.op == op_type::MOE_ROUTE && k == 0 && !route_control_done && n.src.at(0).valid()) {
                    // control: the best selected expert of the last token swapped for the worst unselected: DECIDED
                    route_control_done = true;
                    const tensor & rc = ref[size_t(id)].at(k);
                    const node_ref hr = n.src.at(0);
                    const tensor & h = ref[size_t(hr.node)].at(size_t(hr.out));
                    const tensor & gate = *gg.nodes[size_t(n.src.at(1).node)].leaf;
                    const tensor * bias = n.src.size() > 2 && n.src[2].valid() ? gg.nodes[size_t(n.src[2].node)].leaf : nullptr;
                    const int64_t K = rc.shape.at(1), t = rc.shape.at(0) - 1, E = gate.shape.at(0), D = gate.shape.at(1);
                    if (K < E) {
                        tensor bad_ids = tensor_new(rc.type, rc.shape);
                        std::memcpy(bad_ids.data, rc.data, rc.nbytes);
                        double am = 0.0;
                        const auto sc = route_biased(h.as<float>() + t * D, gate, bias, n.p.router, &am);
                        const bool flips = swap_best_for_worst(bad_ids.as<int32_t>() + t * K, K, sc, E);
                        std::printf("  control: '%s' with the best selected expert of token %lld swapped for the worst:\n",
                                    n.name.c_str(), (long long)t);
                        const near_tie_verdict cv = route_check(n, rc, bad_ids, h, h, gate, bias, n.name + "/control");
                        const bool cok = !flips || cv.decided > 0;
                        std::printf("  control: %s\n", !flips ? "skipped (all scores equal)"
                                                               : cok ? "decided, FAILS as it must" : "ACCEPTED: the near-tie rule is broken");
                        ok &= cok;
                    }
                }
                if (bad && n.op == op_type::MOE_ROUTE && k == 0 && d.mismatches > 0 && n.src.at(0).valid()) {
                    const node_ref hr = n.src.at(0);
                    const tensor & hc = ref[size_t(hr.node)].at(size_t(hr.out));
                    const bool have_g = gkeep.count(hr.node) && gkeep.at(hr.node).size() > size_t(hr.out);
                    if (!have_g) std::printf("  note: no CUDA output of '%s' seen (fused?): the near-tie check uses the CPU's h\n",
                                             gg.nodes[size_t(hr.node)].name.c_str());
                    const tensor & hg = have_g ? gkeep.at(hr.node).at(size_t(hr.out)) : hc;
                    const tensor & gate = *gg.nodes[size_t(n.src.at(1).node)].leaf;
                    const tensor * bias = n.src.size() > 2 && n.src[2].valid() ? gg.nodes[size_t(n.src[2].node)].leaf : nullptr;
                    settle(route_check(n, ref[size_t(id)].at(k), outs[k], hc, hg, gate, bias, n.name), d.mismatches);
                }
                if (bad && !tie_at.empty()) {   // downstream of a flipped near tie: printed, not held to --tol
                    if (o.all)
                        std::printf("  node %d '%s' (%s) out %zu: NMSE %.3e, %lld exact mismatches (after the near tie at %s: not held to --tol)\n",
                                    id, n.name.c_str(), std::string(op_name(n.op)).c_str(), k, d.nmse, (long long)d.mismatches,
                                    tie_at.c_str());
                    bad = false;
                }
                if (bad && (first_bad < 0 || o.all)) {
                    if (first_bad < 0) first_bad = id;
                    if (d.mismatches < 0)
                        std::printf("  node %d '%s' (%s) out %zu: shape/dtype differ\n", id, n.name.c_str(),
                                    std::string(op_name(n.op)).c_str(), k);
                    else
                        std::printf("  node %d '%s' (%s) out %zu: NMSE %.3e %s %.1e, %lld exact mismatches%s\n", id, n.name.c_str(),
                                    std::string(op_name(n.op)).c_str(), k, d.nmse, d.nmse > o.tol ? ">" : "<=", o.tol,
                                    (long long)d.mismatches, d.nonfinite ? ", NaN/Inf placement differs" : "");
                }
            }
        });
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (o.moe_shared_slot >= 0)   // whether the rule fired on this model (its shapes decide: fuse-plan.h)
            std::printf("step %d: %d MOE_EXPERTS launches with the shared expert as a slot (moe_shared_slot %d)\n", step,
                        gpu->fused_moe_shared(), o.moe_shared_slot);
        const tensor lc = cpu->read(gc.logits), lg = gpu->read(gg.logits);
        const int32_t tc = argmax_last(lc), tg = argmax_last(lg);
        std::printf("step %d (%s %zu tokens at pos %d): %d outputs compared, worst NMSE %.3e at '%s', first out of tolerance: %s; "
                    "next token cpu %d cuda %d (%.1f ms with per-node copies)\n",
                    step, step == 0 ? "prefill" : "decode", feed.size(), n_past, compared, worst, worst_name.c_str(),
                    first_bad < 0 ? "none" : fmt::format("node {} '{}' ({})", first_bad, gg.nodes[size_t(first_bad)].name,
                                                         op_name(gg.nodes[size_t(first_bad)].op)).c_str(),
                    tc, tg, ms);
        ok &= first_bad < 0;
        toks_cpu.push_back(tc);
        toks_gpu.push_back(tg);
        n_past += int(feed.size());
        feed = {tc};   // both continue from the reference's token so later steps stay comparable
    }
    // The CUDA states must equal the CPU ones after the whole run (device-resident: sync them first).
    gpu->sync_state_to_host();
    double worst_state = 0.0;
    for (size_t il = 0; il < st_cpu.layers.size(); ++il) {
        const layer_state & a = st_cpu.layers[il];
        const layer_state & b2 = st_gpu.layers[il];
        for (auto [x, y] : {std::pair{&a.conv_q, &b2.conv_q}, {&a.conv_k, &b2.conv_k}, {&a.conv_v, &b2.conv_v},
                            {&a.recurrent, &b2.recurrent}, {&a.latent, &b2.latent}, {&a.index_keys, &b2.index_keys}})
            if (!x->empty()) worst_state = std::max(worst_state, compare_tensors(*x, *y).nmse);
    }
    const bool same = toks_cpu == toks_gpu;
    std::string sc, sg;
    for (size_t i = 0; i < toks_cpu.size(); ++i) sc += (i ? "," : "") + std::to_string(toks_cpu[i]), sg += (i ? "," : "") + std::to_string(toks_gpu[i]);
    std::printf("final states: worst NMSE %.3e %s %.1e%s\n", worst_state, worst_state <= o.tol ? "<=" : ">", o.tol,
                tie_at.empty() ? "" : " (after a near tie: not held to --tol)");
    if (!tie_at.empty()) {
        std::printf("near ties (indexer / router): %lld accepted, the first at %s; every later node and the final states were NOT held to "
                    "--tol (rerun a shorter prompt for a strict comparison)\n", (long long)n_ties, tie_at.c_str());
        worst_state = 0.0;
    }
    std::printf("greedy tokens cpu [%s] cuda [%s]: %s\n", sc.c_str(), sg.c_str(), same ? "identical" : "DIFFERENT");
    std::printf("compare-backends: %s\n", ok && same && worst_state <= o.tol ? "PASS" : "FAIL");
    return ok && same && worst_state <= o.tol ? 0 : 1;
}
#endif

command_registrar reg{{"compare-backends", "run a model on the CPU and CUDA backends node by node; name the first node out of tolerance",
    [](CLI::App & sub) {
        auto o = std::make_shared<opts>();
        sub.add_option("--model", o->model, "model directory")->required();
        sub.add_option("--ids", o->ids, "comma-separated prompt token ids")->required();
        sub.add_option("--decode", o->decode, "greedy decode steps after the prefill")->capture_default_str();
        sub.add_option("--tol", o->tol, "NMSE tolerance per F32 node output (I32 outputs must be equal)")->capture_default_str();
        sub.add_option("--chunk", o->chunk, "KDA chunk size for prefill steps (64 or 0)")->capture_default_str();
        sub.add_option("--device", o->device, "CUDA device")->capture_default_str();
        sub.add_option("--linear-group", o->linear_group,
                       "cuda_options::linear_group: 1 on, 0 off, -1 the backend's default")->capture_default_str();
        sub.add_option("--moe-mma", o->moe_mma,
                       "cuda_options::moe_mma_tokens: N > 0 tensor-core experts from N tokens, 0 off, -1 the default")
            ->capture_default_str();
        sub.add_option("--fuse", o->fuse,
                       "cuda_options::fuse_norm_linear + fuse_add + fuse_conv_l2 + fuse_sigmoid + fuse_kda_decode (RMS_NORM into"
                       " the next GEMV, residual ADD and SIGMOID into its epilogue, L2_NORM into its SHORT_CONV, the KDA decode"
                       " tail in one launch):"
                       " 1 on, 0 off, -1 the backend's defaults")->capture_default_str();
        sub.add_option("--bf16-inputs-tokens", o->bf16_inputs,
                       "forward_options::bf16_inputs_min_tokens for both graphs: steps of at least N tokens round their LINEAR"
                       " and expert inputs to bf16 (ARCHITECTURE 3.0); 0 off")->capture_default_str()->check(CLI::Range(0, 1 << 20));
        sub.add_option("--kda-chunk", o->kda_chunk,
                       "cuda_options::kda_chunk_min_tokens: N > 0 the chunked KDA prefill kernel from N tokens, 0 off,"
                       " -1 the default")->capture_default_str();
        sub.add_option("--moe-mma-v2", o->moe_mma_v2,
                       "cuda_options::moe_mma_v2 (the pipelined tensor-core expert kernel): 1 on, 0 off, -1 the default")
            ->capture_default_str();
        sub.add_option("--moe-v4", o->moe_v4,
                       "cuda_options::moe_decode_v4 + moe_small_v4 (decode / few-token expert kernels): 1 on, 0 off, -1 the defaults")
            ->capture_default_str();
        sub.add_option("--moe-shared-slot", o->moe_shared_slot,
                       "cuda_options::moe_shared_slot (the shared expert as a slot of the BF16 decode experts' launch): 1 on,"
                       " 0 off, -1 the default")
            ->capture_default_str();
        sub.add_option("--prefill-fast", o->prefill_fast,
                       "cuda_options::{moe_route_gemm,mla_prefill,conv_prefill,attn_res_prefill}_tokens: N > 0 the prefill router GEMM,"
                       " MLA flash kernel, token-parallel SHORT_CONV and float4 ATTN_RES_MIX from N tokens, 0 off, -1 the defaults")->capture_default_str();
        sub.add_flag("--all", o->all, "print every node out of tolerance, not only the first");
        return std::function<int()>([o] {
#if defined(PERIGEE_HAVE_CUDA)
            return run_compare(*o);
#else
            PG_FAIL("compare-backends: not compiled with CUDA (configure with -DPERIGEE_CUDA=ON)");
            return 1;
#endif
        });
    }}};

} // namespace
} // namespace perigee::cli
