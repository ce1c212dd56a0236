// CUDA backend vs CPU reference backend, op by op (STYLE §3.7; llama.cpp test-backend-ops shape).
//
// Each case builds a one- or few-op graph with fixed, printed seeds, runs it on the CPU backend (the reference,
// fp32 with fp64 reductions) and on the CUDA backend (guard mode: every output poisoned with NaN and framed by
// sentinel words that are checked after each node), and compares every output and every STATE buffer: NaN/Inf
// placement first, then the metric, "measured <= threshold" printed on success too. State rows that the step must
// not touch (other slots, pages outside the block tables) must be bitwise equal. Every family has controls that
// must FAIL: a 10x-threshold perturbation, a negative threshold, a flipped sentinel byte, a skipped state
// write-back, swapped expert ids. The run ends with "N passed, N failed".
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/fuse-ops.h"
#include "backend/cuda/fuse-plan.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>

namespace perigee::test {
namespace {

// ---- tolerances (STYLE §3.7 starting table; measured values are printed on every line) ----
constexpr double k_tol_f32 = 1e-7;      // NMSE: f32 elementwise, norms, routing math, f32-accumulated GEMV
constexpr double k_tol_bf16_gemm = 5e-4;  // NMSE: cuBLASLt path rounds activations to bf16 (llama.cpp test_mul_mat)
constexpr double k_tol_kda = 5e-3;      // RMS ratio: KDA o and final state (fla test_kda.py)
constexpr double k_tol_mla_abs = 8e-4;  // max abs: MLA output (FlashMLA dense decode)

// The cuBLASLt LINEAR on bf16-rounded activations (one GEMM, no lo half), the option set by name. The positional
// {true, 8, false} the tests used before session 16 set gemv_unroll (the third field), not linear_split_bf16, so their
// "bf16-act" rows ran the split path; linear_split_stacked's control (one bf16 pass must differ from the split) found
// it. (get_rows_and_linear's x comes from a BF16 embedding, exact in bf16, so its rows cannot tell the two forms apart
// anyway: the control on f32 x in linear_split_stacked is the check that can.)
cuda_options one_bf16_pass() {
    cuda_options o{true, 8};
    o.linear_split_bf16 = false;
    return o;
}

int g_passed = 0, g_failed = 0;
void tally(bool ok) { (ok ? g_passed : g_failed)++; }

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the CUDA parity runner needs the GPU machine"

struct out_check { node_ref r; metric m; double thr; bool exact_i32 = false; };
struct state_check { tensor * t; metric m; double thr; std::set<int64_t> touched; };   // touched dim-0 rows

std::vector<float> host_f32(const tensor & t) {
    std::vector<float> v(size_t(t.numel()));
    if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * 4);
    return v;
}

// Runs g on both backends from the same initial states and compares. Returns true when every check passed.
bool parity(const std::string & name, graph & g, const std::vector<out_check> & outs, std::vector<state_check> states,
            const cuda_options & opt = {true, 8}) {
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
        const bool ok = check(nm, to_f64(host_f32(cpu_state[i])), host_f32(*s.t), s.m, s.thr);
        tally(ok);
        all &= ok;
        // untouched rows: bitwise equal to the initial state on the device side
        const int64_t rows = s.t->shape.at(0), row_bytes = int64_t(s.t->nbytes) / std::max<int64_t>(rows, 1);
        size_t bad = 0;
        for (int64_t r = 0; r < rows; ++r)
            if (!s.touched.count(r))
                bad += std::memcmp(static_cast<char *>(s.t->data) + r * row_bytes, static_cast<char *>(init[i].data) + r * row_bytes,
                                   size_t(row_bytes)) != 0;
        std::printf("[%s] untouched rows changed: %zu <= 0\n", (nm + "/untouched").c_str(), bad);
        tally(bad == 0);
        all &= bad == 0;
    }
    return all;
}

// Comparator controls for one family, on a real candidate: a 10x perturbation and a negative threshold must fail.
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

std::shared_ptr<batch> batch_seqs(const std::vector<int> & lens, const std::vector<int> & pos0, const std::vector<int> & slots,
                                  int page_size = 0, int pages_per_seq = 0) {
    auto b = std::make_shared<batch>();
    b->seq_start = {0};
    for (size_t s = 0; s < lens.size(); ++s) {
        b->seq_start.push_back(b->seq_start.back() + lens[s]);
        b->pos0.push_back(pos0[s]);
        b->slot.push_back(slots[s]);
        if (page_size) {
            std::vector<int32_t> bt;
            for (int p = 0; p < pages_per_seq; ++p) bt.push_back(int32_t(s * pages_per_seq + (pages_per_seq - 1 - p)));   // reversed pages
            b->block_table.push_back(bt);
        }
    }
    b->ids.assign(size_t(b->seq_start.back()), 0);
    b->page_size = page_size;
    return b;
}

// ---------------------------------------------------------------------------------------------------------------

TEST(cuda_ops, elementwise_norms_with_nan_inf_placement) {
    NEED_GPU();
    for (int T : {1, 5, 33}) {
        rng r(1000 + uint32_t(T));
        arena a;
        const int D = 96;
        auto b = batch_simple(T);
        builder bd(b);
        auto xa = r.vec(size_t(T * D), -3, 3), xb = r.vec(size_t(T * D), -3, 3);
        xa[3] = NAN;
        xa[size_t(T * D - 1)] = INFINITY;   // NaN/Inf placement must match
        auto wv = r.vec(size_t(D), 0.5f, 1.5f), bv = r.vec(size_t(D), -0.2f, 0.2f);
        const node_ref x = bd.weight(a.f32({T, D}, xa), "xa_leaf");
        const node_ref y = bd.weight(a.f32({T, D}, xb), "xb_leaf");
        const node_ref X = bd.name(bd.scale(x, 1.0f), "x"), Y = bd.name(bd.scale(y, 0.5f), "y");
        const node_ref w = bd.weight(a.bf16({D}, wv), "w_bf16");
        const node_ref bias = bd.weight(a.f32({D}, bv), "b_f32");
        std::vector<out_check> oc;
        auto add = [&](node_ref n, const char * nm) { oc.push_back({bd.name(n, nm), metric::NMSE, k_tol_f32}); };
        add(bd.add(X, Y), "add");
        add(bd.mul(X, Y), "mul");
        add(bd.sigmoid(Y), "sigmoid");
        add(bd.silu_mul(X, Y), "silu_mul");
        add(bd.situ_mul(X, Y, 2.0f, 3.0f), "situ_mul");
        add(bd.situ_mul(X, Y, 1.5f, 0.0f), "situ_mul_nolin");
        add(bd.cols(Y, 10, 40), "cols");
        add(bd.rms_norm(Y, w, 1e-6f), "rms_norm");
        add(bd.rms_norm(Y, {}, 1e-6f, 16), "rms_norm_noweight_per16");
        add(bd.layer_norm(Y, w, bias, 1e-5f), "layer_norm");
        add(bd.l2_norm(Y, 1e-6f, 32), "l2_norm_per32");
        add(bd.gated_rms_norm(Y, X, bd.weight(a.f32({32}, wv = r.vec(32, 0.5f, 1.5f)), "gw"), 1e-5f, 32), "gated_rms_norm");
        add(bd.rms_norm(X, w, 1e-6f), "rms_norm_nan_rows");
        graph g = bd.finish(oc.back().r);
        EXPECT_TRUE(parity("ew/T" + std::to_string(T), g, oc, {}));
        if (T == 5) {
            auto cpu = backend_cpu_init();
            cpu->run(g);
            auto gpu = backend_cuda_init(0, {true, 8});
            gpu->run(g);
            controls("ew/rms_norm", read_f32(*cpu, oc[7].r), read_f32(*gpu, oc[7].r), metric::NMSE, k_tol_f32);
            // sentinel control: one flipped sentinel byte after the add output must fail the run, naming the node
            gpu->guard_corrupt_next(oc[0].r.node, 0);
            bool threw = false;
            try {
                gpu->run(g);
            } catch (const error & e) {
                threw = std::string(e.what()).find("'add'") != std::string::npos;
                std::printf("[ew/control(sentinel)] FAILED as it must: %s\n", e.what());
            }
            EXPECT_TRUE(threw);
            tally(threw);
        }
    }
}

TEST(cuda_ops, get_rows_and_linear) {
    NEED_GPU();
    for (dtype wt : {dtype::BF16, dtype::F32, dtype::F16}) {
        for (int T : {1, 3, 8, 9, 64}) {
            for (auto [in, out] : std::vector<std::pair<int, int>>{{256, 300}, {100, 37}}) {
                rng r(2000 + uint32_t(T) * 7 + uint32_t(in) + uint32_t(wt) * 1000);
                arena a;
                auto b = batch_simple(T);
                for (int t = 0; t < T; ++t) b->ids[size_t(t)] = r.randint(0, 49);
                builder bd(b);
                auto tab = r.vec(size_t(50 * in));
                auto wv = r.vec(size_t(out * in), -0.1f, 0.1f);
                const node_ref x = bd.name(bd.get_rows(bd.weight(a.typed(wt, {50, in}, tab), "embed"), bd.ids()), "get_rows");
                const node_ref y = bd.name(bd.linear(x, bd.weight(a.typed(wt, {out, in}, wv), "W")), "linear");
                graph g = bd.finish(y);
                // T > 8 with BF16 weights takes cuBLASLt with bf16-rounded activations
                // T > 8 with BF16 weights takes cuBLASLt: split-bf16 activations by default (f32-level error), or
                // plain bf16-rounded activations (linear_split_bf16 = false: the bf16-linear row of the table)
                const double thr = k_tol_f32;
                const std::string nm = fmt::format("linear/{}/T{}/{}x{}", dtype_name(wt), T, out, in);
                EXPECT_TRUE(parity(nm, g, {{x, metric::NMSE, k_tol_f32}, {y, metric::NMSE, thr}}, {})) << nm;
                if (T > 8 && wt == dtype::BF16) {
                    EXPECT_TRUE(parity(nm + "/bf16-act", g, {{y, metric::NMSE, k_tol_bf16_gemm}}, {}, one_bf16_pass())) << nm;
                }
                if (T == 64 && in == 256 && wt == dtype::BF16) {
                    auto cpu = backend_cpu_init();
                    cpu->run(g);
                    auto gpu = backend_cuda_init(0, {true, 8});
                    gpu->run(g);
                    controls(nm, read_f32(*cpu, y), read_f32(*gpu, y), metric::NMSE, thr);
                    auto gpu2 = backend_cuda_init(0, one_bf16_pass());
                    gpu2->run(g);
                    controls(nm + "/bf16-act", read_f32(*cpu, y), read_f32(*gpu2, y), metric::NMSE, k_tol_bf16_gemm);
                }
            }
        }
    }
}

// The split-bf16 cuBLASLt LINEAR as ONE GEMM over the hi rows and the lo rows stacked (2T columns, the weights read
// once) plus an ADD of the halves (cuda_options::linear_split_stacked, up to 256 tokens by default), and as the two
// GEMMs it replaces (0). Both within the f32 tolerance of the CPU; the stacked run is counted (linear_stacked: 1 per
// LINEAR from 9 to 256 tokens, 0 with the switch off and above the bound); the two forms agree to the f32 tolerance.
// Control: the one-bf16-pass result (no lo half) against the stacked one must FAIL the f32 tolerance, i.e. the
// stacked GEMM's lo columns are really added in.
TEST(cuda_ops, linear_split_stacked) {
    NEED_GPU();
    for (int T : {9, 64, 256, 257}) {
        for (auto [in, out] : std::vector<std::pair<int, int>>{{256, 300}, {2304, 1024}}) {
            rng r(7000 + uint32_t(T) * 13 + uint32_t(in));
            arena a;
            builder bd(batch_simple(T));
            auto xv = r.vec(size_t(T) * size_t(in));
            auto wv = r.vec(size_t(out) * size_t(in), -0.05f, 0.05f);
            const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, in}, xv), "x"), 1.0f), "x_scaled");
            const node_ref y = bd.name(bd.linear(x, bd.weight(a.bf16({out, in}, wv), "W")), "linear");
            graph g = bd.finish(y);
            const std::string nm = fmt::format("linear_stacked/T{}/{}x{}", T, out, in);
            cuda_options on{true, 8};
            cuda_options off{true, 8};
            off.linear_split_stacked = 0;
            EXPECT_TRUE(parity(nm + "/stacked", g, {{y, metric::NMSE, k_tol_f32}}, {}, on)) << nm;
            EXPECT_TRUE(parity(nm + "/two-gemms", g, {{y, metric::NMSE, k_tol_f32}}, {}, off)) << nm;
            auto g_on = backend_cuda_init(0, on);
            g_on->run(g);
            const int want = T <= on.linear_split_stacked ? 1 : 0;
            std::printf("[%s/counter] stacked LINEARs %d == %d\n", nm.c_str(), g_on->linear_stacked(), want);
            EXPECT_EQ(g_on->linear_stacked(), want) << nm;
            tally(g_on->linear_stacked() == want);
            auto g_off = backend_cuda_init(0, off);
            g_off->run(g);
            std::printf("[%s/counter-off] stacked LINEARs %d == 0\n", nm.c_str(), g_off->linear_stacked());
            EXPECT_EQ(g_off->linear_stacked(), 0) << nm;
            tally(g_off->linear_stacked() == 0);
            const auto ys = read_f32(*g_on, y), yt = read_f32(*g_off, y);
            std::printf("[%s/bitwise] stacked vs two GEMMs: %s\n", nm.c_str(),
                        std::memcmp(ys.data(), yt.data(), ys.size() * 4) == 0 ? "EQUAL" : "DIFFERENT");
            const bool agree = check(nm + "/stacked-vs-two", to_f64(yt), ys, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(agree) << nm;
            tally(agree);
            if (T == 64) {
                auto one = backend_cuda_init(0, one_bf16_pass());
                one->run(g);
                const bool hi_only = check(nm + "/control(one bf16 pass vs stacked)", to_f64(ys), read_f32(*one, y), metric::NMSE,
                                           k_tol_f32);
                std::printf("[%s/control] one bf16 pass %s the f32 tolerance of the stacked run (must FAIL)\n", nm.c_str(),
                            hi_only ? "PASSED" : "FAILED");
                EXPECT_FALSE(hi_only) << nm;
                tally(!hi_only);
            }
        }
    }
}

// op_params::bf16_inputs (forward_options::bf16_inputs_min_tokens, ARCHITECTURE 3.0): the LINEAR's x rounded to bf16
// first, on every path: the GEMV (T 1 / 3 / 8 on 2304-wide rows and T 1..64 on 256-wide ones, BF16 / F32 / F16 weights),
// the one-pass cuBLASLt GEMM (BF16 weights past the GEMV bound: T 9, 64, 300 on 2304-wide rows) and the fp32 GEMM (F32
// weights). Checks: CUDA vs the CPU's flagged LINEAR at the f32 tolerance (both compute bf16(x) W^T in fp32), so the
// one-pass GEMM matches the reference as closely as the split one does on fp32 x. Controls that must FAIL: the CUDA
// result against the CPU's unflagged LINEAR (the rounding really happened: NMSE ~4e-6 on uniform x) and the
// comparator family; a flagged node runs unfused (the planner's plan is empty for the step).
TEST(cuda_ops, linear_bf16_inputs) {
    NEED_GPU();
    for (dtype wt : {dtype::BF16, dtype::F32, dtype::F16}) {
        for (auto [in, out] : std::vector<std::pair<int, int>>{{2304, 640}, {256, 300}}) {
            for (int T : {1, 3, 8, 9, 64, 300}) {
                if (wt != dtype::BF16 && T > 64) continue;
                rng r(9100 + uint32_t(T) * 13 + uint32_t(in) + uint32_t(wt) * 1000);
                arena a;
                auto xv = r.vec(size_t(T) * size_t(in));
                auto wv = r.vec(size_t(out) * size_t(in), -0.05f, 0.05f);
                auto mk = [&](bool flag) {
                    builder bd(batch_simple(T));
                    bd.bf16_inputs(flag);
                    const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, in}, xv), "x"), 1.0f), "x_scaled");
                    const node_ref y = bd.name(bd.linear(x, bd.weight(a.typed(wt, {out, in}, wv), "W")), "linear");
                    return std::make_pair(bd.finish(y), y);
                };
                auto [g, y] = mk(true);
                const std::string nm = fmt::format("linear_bf16_inputs/{}/T{}/{}x{}", dtype_name(wt), T, out, in);
                EXPECT_TRUE(g.nodes[size_t(y.node)].p.bf16_inputs) << nm;
                const auto plan = cuda_fuse::plan_fusions(g, cuda_options{true, 8});
                EXPECT_EQ(plan.launches_saved(), 0) << nm;
                EXPECT_TRUE(parity(nm, g, {{y, metric::NMSE, k_tol_f32}}, {})) << nm;
                auto gpu = backend_cuda_init(0, {true, 8});
                gpu->run(g);
                const auto yc = read_f32(*gpu, y);
                auto [g0, y0] = mk(false);
                auto cpu0 = backend_cpu_init();
                cpu0->run(g0);
                const bool f32_ok = check(nm + "/control(vs the unflagged CPU LINEAR)", to_f64(read_f32(*cpu0, y0)), yc,
                                          metric::NMSE, k_tol_f32);
                std::printf("[%s/control] flagged CUDA vs unflagged CPU %s (must FAIL)\n", nm.c_str(), f32_ok ? "PASSED" : "FAILED");
                EXPECT_FALSE(f32_ok) << nm;
                tally(!f32_ok);
                if (T == 64 && in == 2304) {
                    auto cpu = backend_cpu_init();
                    cpu->run(g);
                    controls(nm, read_f32(*cpu, y), yc, metric::NMSE, k_tol_f32);
                }
            }
        }
    }
}

// cuda_options::linear_bf16_share_x: flagged BF16 LINEARs on cuBLASLt (T 300) that read the same node output one after
// another take the first one's bf16 copy of x. Graph: three LINEARs on x, one on z = 2 x, one on x again, summed. The
// copy is kept for one input at a time, so exactly two LINEARs share (the 2nd and 3rd; the 4th converts z, the 5th x
// again), counted by linear_shared_x; 0 with the switch off. Every LINEAR within the f32 tolerance of the CPU's flagged
// LINEAR, with dead outputs freed and without; the sum bit for bit the unshared run's. Control that must FAIL: the
// bitwise comparator on a copy with one ulp changed.
TEST(cuda_ops, linear_bf16_shared_x) {
    NEED_GPU();
    const int T = 300, in = 2304, out = 640;
    rng r(9700);
    arena a;
    builder bd(batch_simple(T));
    bd.bf16_inputs(true);
    const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, in}, r.vec(size_t(T) * in)), "x"), 1.0f), "x_scaled");
    const node_ref z = bd.name(bd.scale(x, 2.0f), "z");
    std::vector<node_ref> ys;
    int i = 0;
    for (node_ref src : {x, x, x, z, x}) {
        auto wv = r.vec(size_t(out) * in, -0.05f, 0.05f);
        const node_ref w = bd.weight(a.bf16({out, in}, wv), fmt::format("W{}", i));
        ys.push_back(bd.name(bd.linear(src, w), fmt::format("linear{}", i++)));
    }
    const node_ref y = bd.name(bd.add(bd.add(bd.add(ys[0], ys[1]), bd.add(ys[2], ys[3])), ys[4]), "sum");
    graph g = bd.finish(y);
    std::vector<out_check> oc;
    for (const node_ref & l : ys) oc.push_back({l, metric::NMSE, k_tol_f32});
    for (bool free_dead : {false, true}) {
        const std::string nm = fmt::format("linear_bf16_shared_x/T{}/{}x{}/free_dead{}", T, out, in, int(free_dead));
        cuda_options on{true, 8};
        on.free_dead_outputs = free_dead;
        cuda_options off = on;
        off.linear_bf16_share_x = false;
        if (!free_dead) {
            EXPECT_TRUE(parity(nm, g, oc, {}, on)) << nm;
        }
        auto g_on = backend_cuda_init(0, on);
        g_on->run(g);
        auto g_off = backend_cuda_init(0, off);
        g_off->run(g);
        const int s_on = g_on->linear_shared_x(), s_off = g_off->linear_shared_x();
        std::printf("[%s/counter] shared %d == 2, switch off %d == 0\n", nm.c_str(), s_on, s_off);
        EXPECT_TRUE(s_on == 2 && s_off == 0) << nm;
        tally(s_on == 2 && s_off == 0);
        const auto y_on = read_f32(*g_on, y), y_off = read_f32(*g_off, y);
        const auto bitwise = [](const std::vector<float> & u, const std::vector<float> & v) {
            return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * 4) == 0;
        };
        auto flipped = y_on;
        flipped[7] = std::nextafter(flipped[7], 1e30f);
        const bool same = bitwise(y_on, y_off), control_differs = !bitwise(flipped, y_off);
        std::printf("[%s/bitwise] shared vs unshared %s; control (one ulp changed) %s (must differ)\n", nm.c_str(),
                    same ? "EQUAL" : "DIFFERENT", control_differs ? "differs" : "EQUAL");
        EXPECT_TRUE(same && control_differs) << nm;
        tally(same);
        tally(control_differs);
        if (free_dead) {
            auto cpu = backend_cpu_init();
            cpu->run(g);
            const bool ok = check(nm + "/sum", to_f64(read_f32(*cpu, y)), y_on, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(ok) << nm;
            tally(ok);
        }
    }
}

TEST(cuda_ops, get_rows_id_out_of_range_names_the_node) {
    NEED_GPU();
    arena a;
    auto b = batch_simple(2);
    b->ids = {1, 7};
    builder bd(b);
    std::vector<float> tab(4 * 8, 1.0f);
    const node_ref x = bd.name(bd.get_rows(bd.weight(a.f32({4, 8}, tab), "embed"), bd.ids()), "tok_embd");
    graph g = bd.finish(x);
    auto gpu = backend_cuda_init(0);
    bool named = false;
    try {
        gpu->run(g);
    } catch (const error & e) {
        named = std::string(e.what()).find("tok_embd") != std::string::npos;
        std::printf("[get_rows/id_range] error: %s\n", e.what());
    }
    EXPECT_TRUE(named);
    tally(named);
}

// SHORT_CONV + KDA_GATE + L2 + KDA_SCAN over packed sequences with history, both scan forms on the CPU side.
TEST(cuda_ops, kda_block_recurrent_and_chunked_reference) {
    NEED_GPU();
    for (int chunk : {0, 64}) {
        for (auto lens : std::vector<std::vector<int>>{{1}, {1, 1, 1}, {7, 70}}) {
            const int H = 3, K = 32, V = 48, W = 4, n_slots = 5;
            rng r(3000 + uint32_t(chunk) + uint32_t(lens.size() * 10 + lens.back()));
            arena a;
            std::vector<int> slots, pos0;
            for (size_t s = 0; s < lens.size(); ++s) slots.push_back(int(4 - s)), pos0.push_back(lens[s] == 1 ? 5 : 0);
            auto b = batch_seqs(lens, pos0, slots);
            const int T = b->n_tokens();
            builder bd(b);
            auto xv = r.vec(size_t(T * H * K));
            auto vv = r.vec(size_t(T * H * V));
            auto fv = r.vec(size_t(T * H * K), -2, 2);
            auto bv = r.vec(size_t(T * H), -2, 2);
            auto cw = r.vec(size_t(H * K * W), -0.5f, 0.5f);
            auto alog = r.vec(size_t(H), -1, 1), dtb = r.vec(size_t(H * K), -0.5f, 0.5f);
            auto conv_s = r.vec(size_t(n_slots * H * K * (W - 1)));
            auto kda_s = r.vec(size_t(n_slots * H * K * V), -0.3f, 0.3f);
            tensor & cst = a.f32({n_slots, H * K, W - 1}, conv_s);
            tensor & kst = a.f32({n_slots, H, K, V}, kda_s);
            const node_ref x = bd.scale(bd.weight(a.f32({T, H * K}, xv), "x"), 1.0f);
            const node_ref q = bd.name(bd.short_conv(x, bd.weight(a.bf16({H * K, 1, W}, cw), "conv_w"), bd.state(cst, "conv_state")), "q_conv");
            const node_ref qn = bd.name(bd.l2_norm(q, 1e-6f, K), "q_l2");
            const node_ref kn = bd.name(bd.l2_norm(bd.scale(q, -0.7f), 1e-6f, K), "k_l2");
            const node_ref g1 = bd.name(bd.kda_gate(bd.scale(bd.weight(a.f32({T, H * K}, fv), "f"), 1.0f),
                                                    bd.weight(a.f32({H}, alog), "A_log"), bd.weight(a.f32({H * K}, dtb), "dt_bias"),
                                                    H, K, chunk ? -5.0f : 0.0f),
                                        "gate");
            const node_ref beta = bd.sigmoid(bd.scale(bd.weight(a.f32({T, H}, bv), "b"), 1.0f));
            const node_ref vn = bd.scale(bd.weight(a.f32({T, H * V}, vv), "v"), 1.0f);
            const node_ref o = bd.name(bd.kda_scan(qn, kn, vn, g1, beta, bd.state(kst, "kda_state"), {H, K, V, 0.17f, chunk}), "kda_scan");
            auto onw = r.vec(size_t(V), 0.5f, 1.5f);
            const node_ref on = bd.name(bd.gated_rms_norm(o, vn, bd.weight(a.f32({V}, onw), "onorm"), 1e-5f, V), "o_norm");
            graph g = bd.finish(on);
            std::set<int64_t> touched(slots.begin(), slots.end());
            const std::string nm = fmt::format("kda/chunk{}/seqs{}/T{}", chunk, lens.size(), T);
            const bool ok = parity(nm, g,
                                   {{q, metric::NMSE, k_tol_f32}, {g1, metric::NMSE, k_tol_f32}, {o, metric::RMS_RATIO, k_tol_kda},
                                    {on, metric::RMS_RATIO, k_tol_kda}},
                                   {{&cst, metric::NMSE, k_tol_f32, touched}, {&kst, metric::RMS_RATIO, k_tol_kda, touched}});
            EXPECT_TRUE(ok) << nm;
            if (chunk == 0 && lens.size() == 3) {   // control: a skipped state write-back must fail the state check
                const auto init = kda_s;
                auto cpu = backend_cpu_init();
                std::memcpy(kst.data, init.data(), init.size() * 4);
                cpu->run(g);
                const auto after = host_f32(kst);
                const bool pass = check(nm + "/control(skipped write-back)", to_f64(after), init, metric::RMS_RATIO, k_tol_kda);
                EXPECT_FALSE(pass);
                tally(!pass);
                controls(nm + "/o", after, after, metric::RMS_RATIO, k_tol_kda);
            }
        }
    }
}

TEST(cuda_ops, mla_paged_causal_and_selected_with_indexer) {
    NEED_GPU();
    for (bool with_sel : {false, true}) {
        for (auto lens : std::vector<std::vector<int>>{{1}, {1, 1}, {20, 3}}) {
            const int H = 4, dn = 16, dr = 8, dv = 16, L = 64, ps = 8, pages_per = 6, I = 2, di = 16, topk = 5;
            rng r(4000 + uint32_t(with_sel) * 100 + uint32_t(lens.size() * 10 + lens[0]));
            arena a;
            std::vector<int> pos0, slots;
            for (size_t s = 0; s < lens.size(); ++s) pos0.push_back(lens[s] == 1 ? 17 + int(s) : 2), slots.push_back(int(s));
            auto b = batch_seqs(lens, pos0, slots, ps, pages_per);
            const int T = b->n_tokens();
            const int n_pages = int(lens.size()) * pages_per + 2;   // 2 pages nobody owns: must stay untouched
            builder bd(b);
            auto qv = r.vec(size_t(T * H * (dn + dr))), cv = r.vec(size_t(T * L)), krv = r.vec(size_t(T * dr));
            auto kvb = r.vec(size_t(H * (dn + dv) * L), -0.2f, 0.2f);
            auto cache0 = r.vec(size_t(n_pages * ps * (L + dr)));
            tensor & cache = a.f32({n_pages, ps, L + dr}, cache0);
            node_ref sel{};
            std::vector<out_check> oc;
            std::vector<state_check> sc;
            std::set<int64_t> touched;
            for (auto & bt : b->block_table) touched.insert(bt.begin(), bt.end());
            tensor * kc = nullptr;
            if (with_sel) {
                auto qi = r.vec(size_t(T * I * di)), ki = r.vec(size_t(T * di)), wi = r.vec(size_t(T * I));
                auto kc0 = r.vec(size_t(n_pages * ps * di));
                kc = &a.f32({n_pages, ps, di}, kc0);
                sel = bd.name(bd.indexer_topk(bd.scale(bd.weight(a.f32({T, I * di}, qi), "qi"), 1.0f),
                                              bd.scale(bd.weight(a.f32({T, di}, ki), "ki"), 1.0f),
                                              bd.scale(bd.weight(a.f32({T, I}, wi), "wi"), 1.0f), bd.state(*kc, "index_keys"),
                                              {I, di, topk, 0.25f}),
                              "indexer_topk");
                oc.push_back({sel, metric::NMSE, 0, true});
            }
            const node_ref o = bd.name(bd.mla_attn(bd.scale(bd.weight(a.f32({T, H * (dn + dr)}, qv), "q"), 1.0f),
                                                   bd.scale(bd.weight(a.f32({T, L}, cv), "c"), 1.0f),
                                                   bd.scale(bd.weight(a.f32({T, dr}, krv), "kr"), 1.0f),
                                                   bd.weight(a.bf16({H * (dn + dv), L}, kvb), "kv_b"), bd.state(cache, "mla_cache"), sel,
                                                   {H, dn, dr, dv, L, 0.2f}),
                                       "mla_attn");
            oc.push_back({o, metric::MAX_ABS, k_tol_mla_abs});
            oc.push_back({o, metric::NMSE, k_tol_f32});
            sc.push_back({&cache, metric::NMSE, 0.0, touched});
            if (kc) sc.push_back({kc, metric::NMSE, 0.0, touched});
            graph g = bd.finish(o);
            const std::string nm = fmt::format("mla/{}/seqs{}/T{}", with_sel ? "sel" : "causal", lens.size(), T);
            EXPECT_TRUE(parity(nm, g, oc, sc)) << nm;
            {   // the first kernel (one block per (token, head), no key split) stays selectable: same tolerance
                cuda_options o{true, 8};
                o.mla_split = false;
                EXPECT_TRUE(parity(nm + "/one-block", g, oc, sc, o)) << nm;
            }
        }
    }
}

// INDEXER_TOPK past one selection block (256 threads) with massive EXACT ties: every qi/ki entry is in {-2..2},
// wi in {-1, 0.5, 1, 2} and the scale 0.25, so every score is exact in fp32 whatever the summation order (the CPU's
// sequential dot vs the kernel's warp tree): the two backends see bitwise-equal scores and must select the same
// positions exactly (tie rule: lowest positions win at theta). Keys repeat 5 patterns, so most scores are tied, and
// relu zeros give ties at theta = 0. Pages are handed out in reverse order. Control: moving one tied selection to the
// next equal-score position must fail the exact comparison; and the ties must straddle theta in most tokens.
TEST(cuda_ops, indexer_topk_exact_ties_long) {
    NEED_GPU();
    for (int T : {257, 300, 600}) {
        for (int topk : {8, 64}) {
            const int I = 2, di = 16, ps = 16, pages = (T + ps - 1) / ps;
            rng r(7100 + uint32_t(T) + uint32_t(topk));
            arena a;
            auto b = batch_seqs({T}, {0}, {0}, ps, pages);
            std::reverse(b->block_table[0].begin(), b->block_table[0].end());
            const int n_pages = int(*std::max_element(b->block_table[0].begin(), b->block_table[0].end())) + 1;
            auto pat = r.vec(size_t(5 * di), -2.4f, 2.4f);
            for (auto & v : pat) v = std::round(v);
            std::vector<float> ki(size_t(T * di));
            for (int t = 0; t < T; ++t)
                for (int i = 0; i < di; ++i) ki[size_t(t * di + i)] = pat[size_t(((t * 7) % 5) * di + i)];
            auto qi = r.vec(size_t(T * I * di), -2.4f, 2.4f);
            for (auto & v : qi) v = std::round(v);
            const float wv[4] = {-1.0f, 0.5f, 1.0f, 2.0f};
            std::vector<float> wi(size_t(T * I));
            for (auto & v : wi) v = wv[r.randint(0, 3)];
            std::vector<float> kc0(size_t(n_pages * ps * di), 0.0f);
            tensor & kc = a.f32({n_pages, ps, di}, kc0);
            builder bd(b);
            const float scale = 0.25f;
            const node_ref sel = bd.name(bd.indexer_topk(bd.scale(bd.weight(a.f32({T, I * di}, qi), "qi"), 1.0f),
                                                         bd.scale(bd.weight(a.f32({T, di}, ki), "ki"), 1.0f),
                                                         bd.scale(bd.weight(a.f32({T, I}, wi), "wi"), 1.0f),
                                                         bd.state(kc, "index_keys"), {I, di, topk, scale}),
                                         "indexer_topk");
            graph g = bd.finish(sel);
            std::set<int64_t> touched(b->block_table[0].begin(), b->block_table[0].end());
            const std::string nm = fmt::format("indexer/ties/T{}/top{}", T, topk);
            EXPECT_TRUE(parity(nm, g, {{sel, metric::NMSE, 0, true}}, {{&kc, metric::NMSE, 0.0, touched}})) << nm;
            // The ties really straddle theta (host scores, exact by construction) and the control must fail.
            int straddle = 0;
            int64_t ctl_t = -1, ctl_from = -1, ctl_to = -1;
            auto cpu = backend_cpu_init();
            cpu->run(g);
            const tensor cs = cpu->read(sel);
            std::vector<int32_t> ref(size_t(cs.numel()));
            std::memcpy(ref.data(), cs.data, ref.size() * 4);
            for (int t = 0; t < T; ++t) {
                if (t + 1 <= topk) continue;
                std::vector<float> sc(size_t(t + 1));
                for (int p = 0; p <= t; ++p) {
                    float acc = 0.0f;
                    for (int h = 0; h < I; ++h) {
                        float dot = 0.0f;
                        for (int i = 0; i < di; ++i) dot += qi[size_t((t * I + h) * di + i)] * ki[size_t(p * di + i)];
                        acc += wi[size_t(t * I + h)] * std::max(dot, 0.0f);
                    }
                    sc[size_t(p)] = scale * acc;
                }
                std::vector<float> srt = sc;
                std::nth_element(srt.begin(), srt.begin() + (topk - 1), srt.end(), std::greater<float>());
                const float theta = srt[size_t(topk - 1)];
                int ge = 0;
                for (float v : sc) ge += v >= theta;
                if (ge > topk) {
                    ++straddle;
                    if (ctl_t < 0) {   // the last selected tied position and the first unselected one with the same score
                        const int32_t * row = ref.data() + size_t(t) * size_t(topk);
                        std::set<int32_t> in(row, row + topk);
                        for (int j = topk - 1; j >= 0 && ctl_from < 0; --j)
                            if (sc[size_t(row[j])] == theta) ctl_from = j;
                        for (int p = 0; p <= t && ctl_to < 0; ++p)
                            if (sc[size_t(p)] == theta && !in.count(p)) ctl_to = p;
                        if (ctl_from >= 0 && ctl_to >= 0) ctl_t = t;
                        else ctl_from = ctl_to = -1;
                    }
                }
            }
            std::printf("[measure] %s: %d of %d selecting tokens have ties straddling theta\n", nm.c_str(), straddle, T - topk);
            EXPECT_GT(straddle, (T - topk) / 4) << nm << ": the test needs exact ties at the threshold";
            ASSERT_GE(ctl_t, 0) << nm;
            auto bad = ref;
            bad[size_t(ctl_t * topk + ctl_from)] = int32_t(ctl_to);   // the same score, the tie rule broken
            const bool pass = check_exact_i32(nm + "/control(tie to a higher position)", ref, bad);
            EXPECT_FALSE(pass);
            tally(!pass);
        }
    }
}

// Decode at the true latent widths over a long context: the key split (16 ranges of ~40 keys, over many pages)
// against the CPU and against the one-block kernel.
TEST(cuda_ops, mla_decode_long_context_split_keys) {
    NEED_GPU();
    for (int T : {1, 2}) {
        const int H = 2, dn = 32, dr = 64, dv = 32, L = 512, ps = 16, pages_per = 40;
        rng r(4500 + uint32_t(T));
        arena a;
        std::vector<int> lens(size_t(T), 1), pos0, slots;
        for (int s = 0; s < T; ++s) pos0.push_back(600 + 17 * s), slots.push_back(s);
        auto b = batch_seqs(lens, pos0, slots, ps, pages_per);
        const int n_pages = T * pages_per;
        builder bd(b);
        auto qv = r.vec(size_t(T * H * (dn + dr))), cv = r.vec(size_t(T * L)), krv = r.vec(size_t(T * dr));
        auto kvb = r.vec(size_t(H * (dn + dv) * L), -0.05f, 0.05f);
        auto cache0 = r.vec(size_t(n_pages * ps * (L + dr)), -0.3f, 0.3f);
        tensor & cache = a.f32({n_pages, ps, L + dr}, cache0);
        std::set<int64_t> touched;
        for (auto & bt : b->block_table) touched.insert(bt.begin(), bt.end());
        const node_ref o = bd.name(bd.mla_attn(bd.scale(bd.weight(a.f32({T, H * (dn + dr)}, qv), "q"), 1.0f),
                                               bd.scale(bd.weight(a.f32({T, L}, cv), "c"), 1.0f),
                                               bd.scale(bd.weight(a.f32({T, dr}, krv), "kr"), 1.0f),
                                               bd.weight(a.bf16({H * (dn + dv), L}, kvb), "kv_b"), bd.state(cache, "mla_cache"),
                                               node_ref{}, {H, dn, dr, dv, L, 0.1f}),
                                   "mla_attn");
        std::vector<out_check> oc{{o, metric::MAX_ABS, k_tol_mla_abs}, {o, metric::NMSE, k_tol_f32}};
        std::vector<state_check> sc{{&cache, metric::NMSE, 0.0, touched}};
        graph g = bd.finish(o);
        const std::string nm = fmt::format("mla/long/T{}", T);
        EXPECT_TRUE(parity(nm, g, oc, sc)) << nm;
        cuda_options one{true, 8};
        one.mla_split = false;
        EXPECT_TRUE(parity(nm + "/one-block", g, oc, sc, one)) << nm;
        auto cpu = backend_cpu_init();
        cpu->run(g);
        auto gpu = backend_cuda_init(0);
        gpu->run(g);
        controls(nm, read_f32(*cpu, o), read_f32(*gpu, o), metric::NMSE, k_tol_f32);
    }
}

// MXFP4 decode (T == 1) at rows longer than one pass of the v2 kernel (4224 columns = 132 units: 128 + a tail of 4)
// and a down row of 3 units per warp: v2 against the CPU and the first grouped kernel against the CPU.
TEST(cuda_ops, moe_mxfp4_decode_v2_long_rows) {
    NEED_GPU();
    for (int F : {96, 2080}) {
        const int T = 1, D = 4224, E = 8, k = 3;
        rng r(5500 + uint32_t(F));
        arena a;
        builder bd(batch_simple(T));
        auto xv = r.vec(size_t(T * D)), gw = r.vec(size_t(E * D), -0.3f, 0.3f);
        auto ex = std::make_shared<std::vector<expert_weights>>(size_t(E));
        auto mk = [&](int out, int in) {
            expert_matrix m;
            m.out = out;
            m.in = in;
            tensor & p = a.raw(dtype::U8, {out, in / 2});
            tensor & s = a.raw(dtype::U8, {out, in / 32});
            for (int64_t i = 0; i < p.numel(); ++i) p.as<uint8_t>()[i] = uint8_t(r.randint(0, 255));
            for (int64_t i = 0; i < s.numel(); ++i) s.as<uint8_t>()[i] = uint8_t(r.randint(114, 120));
            m.packed = &p;
            m.scale = &s;
            m.format = fp4_format::MXFP4;
            m.global_scale = 1.0f;
            return m;
        };
        for (auto & e : *ex) e = {mk(F, D), mk(F, D), mk(D, F)};
        const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f), "x");
        auto [ids, w] = bd.moe_route(x, bd.weight(a.bf16({E, D}, gw), "gate"), {}, {k, 1, 1, true, 1.0f, router_act::SIGMOID});
        const node_ref y = bd.name(bd.moe_experts(x, ids, w, {glu_act::SITU, 2.0f, 3.0f, D, ex}), "experts");
        graph g = bd.finish(y);
        const std::string nm = fmt::format("moe/mxfp4-v2/D{}/F{}", D, F);
        const std::vector<out_check> oc{{ids, metric::NMSE, 0, true}, {y, metric::NMSE, k_tol_f32}};
        EXPECT_TRUE(parity(nm, g, oc, {})) << nm;
        cuda_options first{true, 8};
        first.moe_fp4_v2 = false;
        EXPECT_TRUE(parity(nm + "/first-grouped", g, oc, {}, first)) << nm;
        auto cpu = backend_cpu_init();
        cpu->run(g);
        auto gpu = backend_cuda_init(0);
        gpu->run(g);
        controls(nm, read_f32(*cpu, y), read_f32(*gpu, y), metric::NMSE, k_tol_f32);
    }
}

TEST(cuda_ops, moe_route_and_experts_dense_mxfp4_nvfp4) {
    NEED_GPU();
    for (int fmt_i : {0, 1, 2}) {
        for (int T : {1, 4, 19}) {
            const int D = 64, F = 32, E = 16, k = 4;
            rng r(5000 + uint32_t(fmt_i) * 100 + uint32_t(T));
            arena a;
            auto b = batch_simple(T);
            builder bd(b);
            auto xv = r.vec(size_t(T * D)), gw = r.vec(size_t(E * D), -0.3f, 0.3f), bias = r.vec(size_t(E), -0.1f, 0.1f);
            auto ex = std::make_shared<std::vector<expert_weights>>(size_t(E));
            auto mk = [&](int out, int in) {
                expert_matrix m;
                m.out = out;
                m.in = in;
                if (fmt_i == 0) {
                    auto v = r.vec(size_t(out * in), -0.2f, 0.2f);
                    m.weight = &a.bf16({out, in}, v);
                    return m;
                }
                const int blk = fmt_i == 1 ? 32 : 16;
                tensor & p = a.raw(dtype::U8, {out, in / 2});
                tensor & s = a.raw(fmt_i == 1 ? dtype::U8 : dtype::F8_E4M3, {out, in / blk});
                for (int64_t i = 0; i < p.numel(); ++i) p.as<uint8_t>()[i] = uint8_t(r.randint(0, 255));
                for (int64_t i = 0; i < s.numel(); ++i) s.as<uint8_t>()[i] = uint8_t(fmt_i == 1 ? r.randint(118, 126) : r.randint(0x20, 0x48));
                m.packed = &p;
                m.scale = &s;
                m.format = fmt_i == 1 ? fp4_format::MXFP4 : fp4_format::NVFP4;
                m.global_scale = fmt_i == 1 ? 1.0f : 0.37f;
                return m;
            };
            for (auto & e : *ex) e = {mk(F, D), mk(F, D), mk(D, F)};
            const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f), "x");
            auto [ids, w] = bd.moe_route(x, bd.weight(a.bf16({E, D}, gw), "gate"), bd.weight(a.f32({E}, bias), "bias"),
                                         {k, 4, 2, true, 2.5f, router_act::SIGMOID});
            bd.name(ids, "route");
            const node_ref y = bd.name(bd.moe_experts(x, ids, w, {fmt_i == 2 ? glu_act::SITU : glu_act::SILU, 2.0f, 3.0f, D, ex}),
                                       "experts");
            graph g = bd.finish(y);
            const std::string nm = fmt::format("moe/{}/T{}", fmt_i == 0 ? "bf16" : fmt_i == 1 ? "mxfp4" : "nvfp4", T);
            EXPECT_TRUE(parity(nm, g, {{ids, metric::NMSE, 0, true}, {w, metric::NMSE, k_tol_f32}, {y, metric::NMSE, k_tol_f32}}, {}))
                << nm;
            {   // the first per-slot kernels stay selectable (cuda_options::moe_grouped = false): same tolerance
                cuda_options o{true, 8};
                o.moe_grouped = false;
                o.moe_route_fast = false;   // and the first router kernel
                EXPECT_TRUE(parity(nm + "/per-slot", g, {{ids, metric::NMSE, 0, true}, {w, metric::NMSE, k_tol_f32},
                                                         {y, metric::NMSE, k_tol_f32}}, {}, o)) << nm;
            }
            if (fmt_i == 1 && T == 1) {   // the first grouped MXFP4 kernel (cuda_options::moe_fp4_v2 = false)
                cuda_options o{true, 8};
                o.moe_fp4_v2 = false;
                EXPECT_TRUE(parity(nm + "/first-grouped", g, {{ids, metric::NMSE, 0, true}, {w, metric::NMSE, k_tol_f32},
                                                              {y, metric::NMSE, k_tol_f32}}, {}, o)) << nm;
            }
            if (T == 4 && fmt_i == 1) {   // control: two swapped expert ids must fail the exact check
                auto gpu = backend_cuda_init(0);
                gpu->run(g);
                auto cid = read_i32(*gpu, ids);
                auto sw = cid;
                std::swap(sw[0], sw[1]);
                const bool pass = check_exact_i32(nm + "/control(swapped ids)", cid, sw);
                EXPECT_FALSE(pass);
                tally(!pass);
                auto cpu = backend_cpu_init();
                cpu->run(g);
                controls(nm + "/experts", read_f32(*cpu, y), read_f32(*gpu, y), metric::NMSE, k_tol_f32);
            }
        }
    }
    // softmax router, ungrouped, no bias
    {
        const int T = 6, D = 48, E = 24, k = 3;
        rng r(5999);
        arena a;
        builder bd(batch_simple(T));
        auto xv = r.vec(size_t(T * D)), gw = r.vec(size_t(E * D), -0.3f, 0.3f);
        const node_ref x = bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f);
        auto [ids, w] = bd.moe_route(x, bd.weight(a.f32({E, D}, gw), "gate"), {}, {k, 1, 1, false, 1.0f, router_act::SOFTMAX});
        graph g = bd.finish(w);
        EXPECT_TRUE(parity("moe/route_softmax", g, {{ids, metric::NMSE, 0, true}, {w, metric::NMSE, k_tol_f32}}, {}));
    }
}

// capture() + replay(): the CUDA graph of a step gives bitwise the eager run's outputs (no state in this graph), and a
// step whose expert ids go out of range is still reported after a replay, naming the node.
TEST(cuda_ops, capture_replay_equals_eager) {
    NEED_GPU();
    for (int T : {1, 3}) {
        const int D = 64, F = 32, E = 16, k = 4;
        rng r(7100 + uint32_t(T));
        arena a;
        builder bd(batch_simple(T));
        auto xv = r.vec(size_t(T * D)), gw = r.vec(size_t(E * D), -0.3f, 0.3f), wl = r.vec(size_t(D * D), -0.2f, 0.2f);
        auto ex = std::make_shared<std::vector<expert_weights>>(size_t(E));
        auto mk = [&](int out, int in) {
            expert_matrix m;
            m.out = out;
            m.in = in;
            tensor & pk = a.raw(dtype::U8, {out, in / 2});
            tensor & sc = a.raw(dtype::U8, {out, in / 32});
            for (int64_t i = 0; i < pk.numel(); ++i) pk.as<uint8_t>()[i] = uint8_t(r.randint(0, 255));
            for (int64_t i = 0; i < sc.numel(); ++i) sc.as<uint8_t>()[i] = uint8_t(r.randint(118, 126));
            m.packed = &pk;
            m.scale = &sc;
            m.format = fp4_format::MXFP4;
            return m;
        };
        for (auto & e : *ex) e = {mk(F, D), mk(F, D), mk(D, F)};
        const node_ref x = bd.linear(bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f), bd.weight(a.bf16({D, D}, wl), "wl"));
        auto [ids, w] = bd.moe_route(x, bd.weight(a.bf16({E, D}, gw), "gate"), {}, {k, 1, 1, true, 1.0f, router_act::SIGMOID});
        const node_ref y = bd.name(bd.rms_norm(bd.moe_experts(x, ids, w, {glu_act::SILU, 1.0f, 0.0f, D, ex}), {}, 1e-5f), "y");
        graph g = bd.finish(y);
        auto gpu = backend_cuda_init(0);
        gpu->run(g);
        const auto eager = read_f32(*gpu, y);
        gpu->capture(g);
        gpu->replay(3);
        const auto rep = read_f32(*gpu, y);
        const bool same = eager.size() == rep.size() && std::memcmp(eager.data(), rep.data(), eager.size() * 4) == 0;
        std::printf("[capture/T%d] replayed output bitwise equal to eager: %s\n", T, same ? "yes" : "NO");
        EXPECT_TRUE(same);
        tally(same);
        auto bad = rep;   // control: one flipped value must be seen
        bad[0] = bad[0] + 1.0f;
        const bool ctl = std::memcmp(eager.data(), bad.data(), eager.size() * 4) == 0;
        EXPECT_FALSE(ctl);
        tally(!ctl);
        gpu->run(g);   // eager again after a capture: the graph is dropped, outputs come back from the pool
        const auto again = read_f32(*gpu, y);
        EXPECT_EQ(std::memcmp(eager.data(), again.data(), eager.size() * 4), 0);
        EXPECT_THROW(gpu->replay(1), error);   // run() dropped the graph
    }
}

// weight_generate: device-made weights are deterministic per seed, inside [lo, hi], not constant, and their host
// bytes are never read (the host address is an inaccessible mapping: any host read would fault).
TEST(cuda_ops, weight_generate_device_resident) {
    NEED_GPU();
    const int V = 300, D = 40, T = 5;
    void * res = mmap(nullptr, size_t(V * D * 2), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(res, MAP_FAILED);
    const tensor t = tensor_view(dtype::BF16, {V, D}, res, nullptr);
    auto b = batch_simple(T);
    for (int i = 0; i < T; ++i) b->ids[size_t(i)] = (i * 71 + 3) % V;
    builder bd(b);
    const node_ref y = bd.get_rows(bd.weight(t, "table"), bd.ids());
    graph g = bd.finish(y);
    std::vector<float> v1, v2, v3;
    {
        auto gpu = backend_cuda_init(0);
        gpu->weight_generate(t, 42, -0.5f, 0.25f);
        EXPECT_THROW(gpu->weight_generate(t, 42, -0.5f, 0.25f), error);   // already on the device
        gpu->run(g);
        v1 = read_f32(*gpu, y);
    }
    {
        auto gpu = backend_cuda_init(0);
        gpu->weight_generate(t, 42, -0.5f, 0.25f);
        gpu->run(g);
        v2 = read_f32(*gpu, y);
    }
    {
        auto gpu = backend_cuda_init(0);
        gpu->weight_generate(t, 43, -0.5f, 0.25f);
        gpu->run(g);
        v3 = read_f32(*gpu, y);
    }
    munmap(res, size_t(V * D * 2));
    float mn = 1e9f, mx = -1e9f;
    for (float x : v1) mn = std::min(mn, x), mx = std::max(mx, x);
    std::printf("[weight_generate] range [%g, %g] within [-0.5, 0.25]; same seed equal %d; other seed differs %d\n", mn, mx,
                int(v1 == v2), int(v1 != v3));
    const bool ok = mn >= -0.5f && mx <= 0.25f && mx - mn > 0.5f && v1 == v2 && v1 != v3;
    EXPECT_TRUE(ok);
    tally(ok);
}

TEST(cuda_ops, attn_res_mix) {
    NEED_GPU();
    for (int n : {1, 3, 9, 17}) {
        rng r(6000 + uint32_t(n));
        arena a;
        const int T = n == 17 ? 1 : 5, D = n == 17 ? 7168 : 80;   // n 17: a K3 decode row (T 1, 7168 wide)
        builder bd(batch_simple(T));
        std::vector<node_ref> c;
        for (int i = 0; i < n; ++i) {
            auto v = r.vec(size_t(T * D), -2, 2);
            c.push_back(bd.scale(bd.weight(a.f32({T, D}, v), "cand" + std::to_string(i)), 1.0f));
        }
        auto nw = r.vec(size_t(D), 0.5f, 1.5f), pw = r.vec(size_t(D), -1, 1);
        const node_ref y = bd.name(bd.attn_res_mix(c, bd.weight(a.bf16({D}, nw), "nw"), bd.weight(a.f32({1, D}, pw), "pw"), 1e-6f),
                                   "attn_res");
        graph g = bd.finish(y);
        EXPECT_TRUE(parity("attn_res/n" + std::to_string(n), g, {{y, metric::NMSE, k_tol_f32}}, {}));
        // the older forms, each with the one-launch cluster (on by default, tested below) switched off so they still run
        cuda_options first{true, 8};   // the first kernel (one block per row) stays selectable
        first.attn_res_cluster = false;
        first.attn_res_split = false;
        first.attn_res_chunk = 0;
        EXPECT_TRUE(parity("attn_res/n" + std::to_string(n) + "/one-block", g, {{y, metric::NMSE, k_tol_f32}}, {}, first));
        cuda_options split{true, 8};   // the split form (block per (row, candidate) over all D columns)
        split.attn_res_cluster = false;
        split.attn_res_chunk = 0;
        EXPECT_TRUE(parity("attn_res/n" + std::to_string(n) + "/split", g, {{y, metric::NMSE, k_tol_f32}}, {}, split));
        for (int chunk : {16, 64, 1024}) {   // the chunked form (the default at 1024): 5 / 2 / 1 chunks at D 80, 448 / 112 / 7 at 7168
            cuda_options ch{true, 8};
            ch.attn_res_cluster = false;
            ch.attn_res_chunk = chunk;
            EXPECT_TRUE(parity("attn_res/n" + std::to_string(n) + "/chunk" + std::to_string(chunk), g,
                               {{y, metric::NMSE, k_tol_f32}}, {}, ch));
        }
        if (n == 17) {
            auto cpu = backend_cpu_init();
            cpu->run(g);
            auto gpu = backend_cuda_init(0);
            gpu->run(g);
            controls("attn_res/n17", read_f32(*cpu, y), read_f32(*gpu, y), metric::NMSE, k_tol_f32);
        }
    }
}

// The one-launch ATTN_RES_MIX (cuda_options::attn_res_cluster: a thread-block cluster of column blocks per row, the chunk
// partials shared through distributed shared memory). Per case:
//   - the kernel itself, called directly (cuda::launch_attn_res_mix_cluster on device copies of the graph's inputs), so
//     its proof does not depend on the backend's dispatch: CPU parity at the f32 tolerance;
//   - the backend with the switch on at chunk 0 / 64 / 1024: CPU parity, and parity with the chunked form (two launches)
//     at the same chunk (reported bitwise or not; session 4's claim that it is always bitwise did not hold on the H200).
// The projection weights are small (|pw| <= 0.02) so that the scores are O(1) and the output is a real blend of the
// candidates (with |pw| ~ 1 at D = 7168 the softmax is one-hot and dropping a losing candidate changes nothing: the
// session-4 control that could not fail). Controls on the K3 decode row (n 9, D 7168): a perturbed output, the CPU
// reference with the last candidate dropped, and with the first two candidates' values swapped in one row (the softmax
// is order-free, so a swap of VALUES between candidates with different scores must move the output) must all FAIL.
TEST(cuda_ops, attn_res_mix_cluster) {
    NEED_GPU();
    struct arcase { int n, T, D; };
    // K3 decode rows (D 7168: 7 blocks of 1024), 3 rows per launch, 8 blocks exactly (8192), a D that needs the chunk
    // grown (9216 -> 1152 x 8), the 17-candidate (N 32) and 1-candidate buckets, narrow rows
    for (const arcase cs : {arcase{9, 1, 7168}, arcase{9, 3, 7168}, arcase{5, 1, 8192}, arcase{6, 2, 9216}, arcase{17, 1, 7168},
                            arcase{1, 1, 7168}, arcase{3, 5, 80}, arcase{8, 1, 4}}) {
        const int n = cs.n, T = cs.T, D = cs.D;
        const std::string nm = "attn_res_cluster/n" + std::to_string(n) + "/T" + std::to_string(T) + "/D" + std::to_string(D);
        rng rr(6200 + uint32_t(n * 7 + T * 131 + D));
        std::vector<std::vector<float>> cv;
        for (int i = 0; i < n; ++i) cv.push_back(rr.vec(size_t(T * D), -2, 2));
        auto nwv = rr.vec(size_t(D), 0.5f, 1.5f), pwv = rr.vec(size_t(D), -0.02f, 0.02f);
        arena a;
        const tensor & nw_t = a.bf16({D}, nwv);   // nwv now holds the bf16-rounded values
        // the graph over candidates `c` (a subset or a modified copy of cv)
        auto make = [&](const std::vector<std::vector<float>> & c) {
            builder bd(batch_simple(T));
            std::vector<node_ref> cn;
            for (size_t i = 0; i < c.size(); ++i) cn.push_back(bd.scale(bd.weight(a.f32({T, D}, c[i]), "cand" + std::to_string(i)), 1.0f));
            const node_ref y = bd.name(bd.attn_res_mix(cn, bd.weight(a.f32({D}, nwv), "nw"), bd.weight(a.f32({1, D}, pwv), "pw"), 1e-6f),
                                       "attn_res");
            return std::make_pair(bd.finish(y), y);
        };
        auto [g, y] = make(cv);
        auto cpu = backend_cpu_init();
        cpu->run(g);
        const auto ref = read_f32(*cpu, y);
        // 1. the kernel, called directly
        std::vector<float> yd(size_t(T) * D);
        {
            std::vector<void *> dc(static_cast<size_t>(n), nullptr);
            cuda::cand_ptrs cp{};
            for (int i = 0; i < n; ++i) {
                ASSERT_EQ(cudaMalloc(&dc[size_t(i)], size_t(T) * D * 4), cudaSuccess);
                ASSERT_EQ(cudaMemcpy(dc[size_t(i)], cv[size_t(i)].data(), size_t(T) * D * 4, cudaMemcpyHostToDevice), cudaSuccess);
                cp.p[i] = static_cast<const float *>(dc[size_t(i)]);
            }
            void *dnw = nullptr, *dpw = nullptr, *dyv = nullptr;
            ASSERT_EQ(cudaMalloc(&dnw, size_t(D) * 2), cudaSuccess);
            ASSERT_EQ(cudaMalloc(&dpw, size_t(D) * 4), cudaSuccess);
            ASSERT_EQ(cudaMalloc(&dyv, size_t(T) * D * 4), cudaSuccess);
            float * dy = static_cast<float *>(dyv);
            ASSERT_EQ(cudaMemcpy(dnw, nw_t.data, size_t(D) * 2, cudaMemcpyHostToDevice), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(dpw, pwv.data(), size_t(D) * 4, cudaMemcpyHostToDevice), cudaSuccess);
            ASSERT_EQ(cudaMemset(dy, 0xff, size_t(T) * D * 4), cudaSuccess);   // NaN until written
            const cudaError_t e = cuda::launch_attn_res_mix_cluster(cp, n, T, D, cuda::dweight{dnw, cuda::wtype::BF16}, cuda::dweight{dpw, cuda::wtype::F32}, 1e-6f,
                                                                    1024, dy, nullptr);
            EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
            EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(yd.data(), dy, yd.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
            for (void * p : dc) cudaFree(p);
            cudaFree(dnw);
            cudaFree(dpw);
            cudaFree(dy);
            const bool ok = check(nm + "/direct", to_f64(ref), yd, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(ok);
            tally(ok);
        }
        // 2. the backend with the switch on, against the CPU and the chunked form
        auto run_gpu = [&](const cuda_options & o) {
            auto gpu = backend_cuda_init(0, o);
            gpu->run(g);
            return read_f32(*gpu, y);
        };
        for (int chunk : {0, 64, 1024}) {
            cuda_options cl{true, 8};
            cl.attn_res_cluster = true;
            cl.attn_res_chunk = chunk;
            EXPECT_TRUE(parity(nm + "/chunk" + std::to_string(chunk), g, {{y, metric::NMSE, k_tol_f32}}, {}, cl));
            const int ch = chunk > 0 ? chunk : 1024;   // what the cluster kernel runs at (if D needs <= 8 blocks)
            if ((D + ch - 1) / ch > 8) continue;
            cuda_options two{true, 8};   // the chunked form: the cluster switched off (it is the default)
            two.attn_res_cluster = false;
            two.attn_res_chunk = ch;
            const auto yc = run_gpu(cl), y2 = run_gpu(two);
            const bool ok = check(nm + "/chunk" + std::to_string(chunk) + "/vs-chunked" + std::to_string(ch), to_f64(y2), yc, metric::NMSE,
                                  k_tol_f32);
            EXPECT_TRUE(ok);
            tally(ok);
            std::printf("[%s/chunk%d] bitwise the chunked form: %s\n", nm.c_str(), chunk,
                        std::memcmp(yc.data(), y2.data(), yc.size() * 4) == 0 ? "yes" : "no");
        }
        if (n == 9 && T == 1) {   // controls on the K3 decode row (the direct kernel's output)
            controls(nm, ref, yd, metric::NMSE, k_tol_f32);
            auto drop = cv;
            drop.pop_back();
            auto [g8, y8] = make(drop);
            auto cpu8 = backend_cpu_init();
            cpu8->run(g8);
            const bool dropped = check(nm + "/control(dropped candidate)", to_f64(read_f32(*cpu8, y8)), yd, metric::NMSE, k_tol_f32);
            std::printf("[%s/control] dropped candidate %s (must FAIL)\n", nm.c_str(), dropped ? "PASSED - BAD" : "FAILED as required");
            EXPECT_FALSE(dropped);
            tally(!dropped);
            auto swp = cv;
            std::swap(swp[0], swp[1]);
            auto [gs, ys] = make(swp);
            auto cpus = backend_cpu_init();
            cpus->run(gs);
            // a swap of whole candidates is invisible to an order-free mix: swap their VALUES in the second half only
            auto half = cv;
            for (int i = D / 2; i < D; ++i) std::swap(half[0][size_t(i)], half[1][size_t(i)]);
            auto [gh, yh] = make(half);
            auto cpuh = backend_cpu_init();
            cpuh->run(gh);
            const bool same_order = check(nm + "/order-free (whole swap)", to_f64(read_f32(*cpus, ys)), yd, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(same_order) << "the mix must not depend on the candidates' order";
            tally(same_order);
            const bool swapped = check(nm + "/control(half-swapped values)", to_f64(read_f32(*cpuh, yh)), yd, metric::NMSE, k_tol_f32);
            std::printf("[%s/control] half-swapped values %s (must FAIL)\n", nm.c_str(), swapped ? "PASSED - BAD" : "FAILED as required");
            EXPECT_FALSE(swapped);
            tally(!swapped);
        }
    }
}

// Wide rows (N >= 4096: 1024 threads per row) for the norms at decode widths.
TEST(cuda_ops, norms_wide_rows) {
    NEED_GPU();
    for (int T : {1, 3}) {
        rng r(6500 + uint32_t(T));
        arena a;
        const int D = 7168 + 32;
        builder bd(batch_simple(T));
        auto xv = r.vec(size_t(T * D), -3, 3), zv = r.vec(size_t(T * D), -3, 3), wv = r.vec(size_t(D), 0.5f, 1.5f);
        const node_ref X = bd.scale(bd.weight(a.f32({T, D}, xv), "x"), 1.0f);
        const node_ref Z = bd.scale(bd.weight(a.f32({T, D}, zv), "z"), 1.0f);
        const node_ref W = bd.weight(a.bf16({D}, wv), "w");
        const node_ref n1 = bd.name(bd.rms_norm(X, W, 1e-6f), "rms_norm");
        const node_ref n2 = bd.name(bd.l2_norm(n1, 1e-6f, D), "l2_norm");
        const node_ref n3 = bd.name(bd.gated_rms_norm(n2, Z, W, 1e-5f, D), "gated_rms_norm");
        graph g = bd.finish(n3);
        const std::string nm = fmt::format("norm/wide/T{}", T);
        EXPECT_TRUE(parity(nm, g, {{n1, metric::NMSE, k_tol_f32}, {n2, metric::NMSE, k_tol_f32}, {n3, metric::NMSE, k_tol_f32}}, {}))
            << nm;
        if (T == 3) {
            auto cpu = backend_cpu_init();
            cpu->run(g);
            auto gpu = backend_cuda_init(0);
            gpu->run(g);
            controls(nm, read_f32(*cpu, n3), read_f32(*gpu, n3), metric::NMSE, k_tol_f32);
        }
    }
}

// LINEARs over the same input run as one launch (cuda_options::linear_group): four projections of x with other nodes
// between them, one over a different input, one F32 weight (not grouped with the BF16 ones); against the CPU with
// grouping on and off, for T 1 and 5 (GEMV path) and 19 (cuBLASLt: not grouped).
TEST(cuda_ops, linear_group_same_input) {
    NEED_GPU();
    for (int T : {1, 5, 19}) {
        rng r(7000 + uint32_t(T));
        arena a;
        const int K = 264;
        builder bd(batch_simple(T));
        auto xv = r.vec(size_t(T * K));
        const node_ref x = bd.name(bd.scale(bd.weight(a.f32({T, K}, xv), "x"), 1.0f), "x");
        const node_ref x2 = bd.name(bd.scale(x, 0.5f), "x2");
        std::vector<node_ref> ys;
        const int outs[] = {256, 40, 1000, 8};
        for (int i = 0; i < 4; ++i) {
            auto wv = r.vec(size_t(outs[i] * K), -0.2f, 0.2f);
            ys.push_back(bd.name(bd.linear(x, bd.weight(a.bf16({outs[i], K}, wv), "w" + std::to_string(i))), "lin" + std::to_string(i)));
            if (i == 1) ys.push_back(bd.name(bd.sigmoid(ys.back()), "between"));
        }
        auto wo = r.vec(size_t(64 * K), -0.2f, 0.2f), wf = r.vec(size_t(48 * K), -0.2f, 0.2f);
        ys.push_back(bd.name(bd.linear(x2, bd.weight(a.bf16({64, K}, wo), "w_other")), "lin_other_input"));
        ys.push_back(bd.name(bd.linear(x, bd.weight(a.f32({48, K}, wf), "w_f32")), "lin_f32"));
        node_ref acc = bd.cols(ys[0], 0, 8);
        for (size_t i = 1; i < ys.size(); ++i) acc = bd.add(acc, bd.cols(ys[i], 0, 8));
        graph g = bd.finish(bd.name(acc, "sum"));
        std::vector<out_check> oc;
        for (auto & y : ys) oc.push_back({y, metric::NMSE, k_tol_f32});
        const std::string nm = fmt::format("linear_group/T{}", T);
        cuda_options on{true, 8};
        on.linear_group = true;
        EXPECT_TRUE(parity(nm, g, oc, {}, on)) << nm;
        cuda_options off{true, 8};
        off.linear_group = false;
        EXPECT_TRUE(parity(nm + "/ungrouped", g, oc, {}, off)) << nm;
        cuda_options fast;
        fast.linear_group = true;
        auto gpu = backend_cuda_init(0, fast);
        gpu->run(g);
        // the four BF16 projections of x form one group (3 mates); the F32 one and the one over x2 stay alone;
        // T 19 is past the GEMV path: nothing grouped
        EXPECT_EQ(gpu->linear_grouped(), T <= 8 ? 3 : 0) << nm;
        if (T == 1) {
            auto cpu = backend_cpu_init();
            cpu->run(g);
            controls(nm + "/lin2", read_f32(*cpu, ys[3]), read_f32(*gpu, ys[3]), metric::NMSE, k_tol_f32);
        }
    }
}

// Wide GEMV LINEARs (K 7168: K3's hidden width) with F32 and BF16 weights at T 1 and 8 (the GEMV path's edge), plain and
// after an RMS_NORM, with every fusion switch explicitly off and explicitly on (the defaults turn them on since round 2),
// each run in a fresh backend after a decoy backend of the same shapes and other values (round 2's K7168/F32/T8 failure:
// a leaf read before its upload landed gave all-zero LINEARs in the 2nd and later backends of a case). x must come back
// bitwise equal to its leaf. Each with the first GEMV kernels (cuda_options::gemv_unroll 0), the default v2 kernels and
// v3 (cuda_options::gemv_v3 2; it runs for the BF16 weights at T = 1) and the tensor-core kernel (gemv_mma_min_tokens 3:
// it runs for the BF16 weights at T = 8; a counter shows it ran there and nowhere else).
TEST(cuda_ops, linear_wide_gemv_fusions_off_and_on) {
    NEED_GPU();
    const int K = 7168, O = 2304;
    for (dtype wt : {dtype::F32, dtype::BF16})
        for (int T : {1, 8}) {
            auto build = [&](arena & a, uint32_t seed, std::vector<node_ref> & ys, node_ref & xr, std::vector<float> & xv) {
                rng r(seed);
                builder bd(batch_simple(T));
                xv = r.vec(size_t(T) * K);
                auto w1 = r.vec(size_t(O) * K, -0.03f, 0.03f), w2 = r.vec(size_t(O) * K, -0.03f, 0.03f);
                auto nv = r.vec(size_t(K), 0.8f, 1.2f);
                xr = bd.name(bd.scale(bd.weight(a.f32({T, K}, xv), "x_leaf"), 1.0f), "x");
                ys = {bd.name(bd.linear(xr, bd.weight(a.typed(wt, {O, K}, w1), "w1")), "lin_plain")};
                const node_ref h = bd.name(bd.rms_norm(xr, bd.weight(a.f32({K}, nv), "nw"), 1e-5f), "h");
                ys.push_back(bd.name(bd.linear(h, bd.weight(a.typed(wt, {O, K}, w2), "w2")), "lin_after_norm"));
                return bd.finish(bd.name(bd.add(ys[0], ys[1]), "sum"));
            };
            arena a, ad;
            std::vector<node_ref> ys, yd;
            node_ref xr, xd;
            std::vector<float> xv, xdv;
            const uint32_t seed = 7100 + uint32_t(T) + (wt == dtype::F32 ? 0u : 50u);
            graph g = build(a, seed, ys, xr, xv);
            graph gd = build(ad, seed + 1, yd, xd, xdv);
            std::vector<out_check> oc;
            for (auto & y : ys) oc.push_back({y, metric::NMSE, k_tol_f32});
            for (int on = 0; on < 2; ++on)
            for (int var : {0, 1, 2, 3}) {   // the first GEMV kernels, v2, v3 (gemv_v3 2: BF16 at T = 1), the tensor-core kernel
                const int unroll = var == 0 ? 0 : cuda::k_gemv_unroll_default;
                const std::string nm = fmt::format("linear_wide/{}/K{}/T{}/fusions-{}/u{}{}", dtype_name(wt), K, T, on ? "on" : "off",
                                                   unroll, var == 2 ? "/v3" : var == 3 ? "/mma" : "");
                cuda_options o{true, 8};
                o.gemv_max_elems = 0;   // T = 8 x K 7168 on the GEMV path (the default bound sends it to cuBLASLt)
                o.gemv_unroll = unroll;
                o.gemv_v3 = var == 2 ? 2 : 0;
                o.gemv_mma_min_tokens = var == 3 ? 3 : 0;   // (3: the default; it runs for the BF16 weights at T = 8)
                o.gemv_v3_min_in = 0;          // v3 on every width here (the default keeps it to the 48B's 2304-wide rows)
                o.gemv_v3_max_in = 1 << 20;
                o.linear_group = on != 0;
                o.fuse_norm_linear = o.fuse_add = o.fuse_conv_l2 = o.fuse_sigmoid = o.fuse_kda_decode = on != 0;
                o.fuse_norm_staged = true;
                o.fuse_norm_max_weight_bytes = int64_t(256) << 20;
                {
                    auto d = backend_cuda_init(0, o);   // the decoy: other values in allocations of the same sizes
                    d->run(gd);
                }
                EXPECT_TRUE(parity(nm, g, oc, {}, o)) << nm;
                auto gpu = backend_cuda_init(0, o);
                const long mma0 = cuda::gemv_mma_launches();
                gpu->run(g);
                const long mma_ran = cuda::gemv_mma_launches() - mma0;
                const bool mma_ok = (mma_ran > 0) == (var == 3 && wt == dtype::BF16 && T == 8);
                std::printf("[%s] tensor-core GEMV launches %ld\n", nm.c_str(), mma_ran);
                EXPECT_TRUE(mma_ok) << nm << ": tensor-core GEMV launches " << mma_ran;
                tally(mma_ok);
                const auto xg = read_f32(*gpu, xr);
                const bool xb = xg.size() == xv.size() && std::memcmp(xg.data(), xv.data(), xv.size() * 4) == 0;
                std::printf("[%s/x] %s\n", nm.c_str(), xb ? "bitwise equal to its leaf" : "DIFFERS from its leaf");
                EXPECT_TRUE(xb) << nm;
                tally(xb);
                const int folded = on && int64_t(T) * K * 4 <= 47 * 1024 ? 1 : 0;   // the staged norm fold (47 KiB stage)
                EXPECT_EQ(gpu->fused_norms(), folded) << nm;
                tally(gpu->fused_norms() == folded);
                std::printf("[%s] fused_norms %d (want %d)\n", nm.c_str(), gpu->fused_norms(), folded);
                if (T == 8 && on == 0) {
                    auto cpu = backend_cpu_init();
                    cpu->run(g);
                    controls(nm + "/lin_plain", read_f32(*cpu, ys[0]), read_f32(*gpu, ys[0]), metric::NMSE, k_tol_f32);
                    // control: the decoy's x (other values) against this x must fail
                    const bool same = check(nm + "/control(decoy x vs x)", to_f64(xv), xdv, metric::NMSE, k_tol_f32);
                    std::printf("[%s/control(decoy x vs x)] (must FAIL) %s\n", nm.c_str(), same ? "PASSED - BAD" : "FAILED as required");
                    EXPECT_FALSE(same);
                    tally(!same);
                }
            }
        }
}

// ---- GEMV kernels at the launcher level (linear.cu; cuda_options::gemv_unroll) ----
// Every kernel generation (unroll 0: the first kernels; 1/2/4/8: v2 with that many 16-byte loads in flight per lane) and
// forced row splits (1/2/8 warps per row; 0: the launch-time choice) against an fp64 host reference, four launch kinds:
// plain (launch_linear_gemv), grouped (3 segments), fused with the epilogues (sigmoid, +res0, +res0+res1) and the folded
// RMSNorm (staged where it fits: T_chunk * in * 4 <= 47 KiB, else the first in-warp kernel). Shapes: in not a multiple of
// the 256-element chunk nor of the unroll, in % 8 != 0 (the element path of 16-bit weights), out not a multiple of the
// rows per tile, 1 row per segment; T 1..8, 9 and 11 (two token chunks); BF16 / F16 / F32 weights. Each output buffer is
// filled with NaN before the launch (an unwritten element fails the NaN placement). Worst NMSE per (dtype, kind, cfg)
// printed; controls: a perturbed candidate per (dtype, kind) must fail, a second launch must be bitwise equal, an invalid
// cfg must be refused. v3 (gemv_cfg::v3, one-token chunks of 16-bit weights): the same references and tolerance, its own
// perturbed control per (dtype, kind) at T = 1, and with one warp per row every output bit for bit equal to v2 u4 s1's
// (the same per-lane order; control: one ulp moved must compare unequal).
struct dmem {
    void * p = nullptr;
    explicit dmem(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess); }
    dmem(const void * h, size_t bytes) : dmem(bytes) { EXPECT_EQ(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), cudaSuccess); }
    ~dmem() { cudaFree(p); }
    dmem(const dmem &) = delete;
    dmem & operator=(const dmem &) = delete;
    float * f() const { return static_cast<float *>(p); }
};
std::vector<float> dget(const float * p, size_t n) {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
}

TEST(cuda_ops, linear_gemv_kernels_all_variants) {
    NEED_GPU();
    // v3 (gemv_cfg::v3; runs on chunks of one token with 16-bit weights and in % 8 == 0, else unroll/split's kernel):
    // chosen U and split, v3 == 2 (first loads before the PDL wait), forced U 3 / 9 / 16 (rounds with a tail, one round,
    // more U than chunks), forced splits 2 and 8 with U 1 (several rounds per slice, pipelined across rows and tiles).
    const std::vector<cuda::gemv_cfg> cfgs = {{0, 0},       {1, 0},       {2, 0},       {4, 0},       {8, 0},
                                              {4, 1},       {4, 2},       {4, 8},       {8, 8},       {1, 2},
                                              {0, 0, 1, 0}, {0, 0, 2, 0}, {0, 1, 1, 0}, {0, 0, 1, 3}, {0, 0, 1, 9},
                                              {0, 0, 1, 16}, {0, 2, 1, 1}, {0, 8, 1, 1},
                                              // the weights with the L2 policy evict_first (gemv_cfg::evict_first):
                                              // the references, and at T = 1 split 1 bit for bit the same cfg without
                                              // it (v2 u4 s1; v3 early s1)
                                              {4, 1, 0, 0, true}, {4, 0, 0, 0, true},
                                              {0, 1, 2, 0}, {0, 1, 2, 0, true}, {0, 0, 2, 0, true},
                                              // the tensor-core kernel (gemv_cfg::mma; BF16, in % 8 == 0, else the
                                              // unroll/split kernel) on every chunk, 3 parts, with the split-K scratch:
                                              // chosen K slices, forced 1 / 2 / 8; from 3 tokens (the default threshold:
                                              // 1-2 token chunks keep v2) WITHOUT the scratch (one slice per group)
                                              {4, 0, 0, 0, false, 1}, {4, 1, 0, 0, false, 1}, {4, 2, 0, 0, false, 1},
                                              {4, 8, 0, 0, false, 1}, {4, 0, 0, 0, false, 3}};
    const int64_t part_floats = int64_t(2) << 20, ctr_n = 16384;
    dmem mma_part(size_t(part_floats) * 4), mma_ctr(size_t(ctr_n) * 4);
    cudaMemset(mma_ctr.p, 0, size_t(ctr_n) * 4);
    const char * kinds[] = {"plain", "group", "epilogue", "norm"};
    std::map<std::string, std::pair<double, int>> worst;   // (dtype/kind/cfg) -> (worst NMSE, cases)
    int n_bad = 0, n_v3_bitwise = 0, n_v3_expected = 0, n_pf_bitwise = 0, n_pf3_bitwise = 0;
    bool controls_done[3][4] = {}, controls_v3_done[3][4] = {}, controls_mma_done[4] = {};
    int n_mma_ran = 0, n_mma_expected = 0, n_mma_parts_fail = 0, n_mma_parts_cases = 0;
    // Every candidate output of one launch bit for bit the kept outputs of another (`ref`), counted in n_equal; and its
    // control: the first output with the low bit of its LAST element flipped (one ulp, never inf or NaN) must compare
    // unequal, so a comparison that stopped short of the end (a byte count off) could not pass it.
    using ref_pairs = std::vector<std::pair<std::vector<double>, std::vector<float>>>;
    auto same_bits = [&](const ref_pairs & pr, const std::vector<std::vector<float>> & ref, const std::string & what, int & n_equal) {
        bool same = ref.size() == pr.size();
        for (size_t i = 0; same && i < pr.size(); ++i)
            same = pr[i].second.size() == ref[i].size() && std::memcmp(pr[i].second.data(), ref[i].data(), ref[i].size() * 4) == 0;
        if (!same) std::printf("[%s] NOT bitwise equal\n", what.c_str());
        else ++n_equal;
        EXPECT_TRUE(same) << what;
        tally(same);
        if (pr.empty() || ref.empty() || pr[0].second.empty()) return;
        auto moved = pr[0].second;
        uint32_t u;
        std::memcpy(&u, &moved.back(), 4);
        u ^= 1u;
        std::memcpy(&moved.back(), &u, 4);
        const bool ctl = moved.size() == ref[0].size() && std::memcmp(moved.data(), ref[0].data(), moved.size() * 4) == 0;
        EXPECT_FALSE(ctl) << what << ": the one-ulp control compared equal";
        tally(!ctl);
    };
    for (dtype wt : {dtype::BF16, dtype::F16, dtype::F32}) {
        const cuda::wtype cw = wt == dtype::BF16 ? cuda::wtype::BF16 : wt == dtype::F16 ? cuda::wtype::F16 : cuda::wtype::F32;
        // + the Kimi-Linear-48B widths: 2304 (9 chunks per lane: one v3 round), 4096 (o_proj), 128 (KDA f_b: half a chunk)
        std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 264}, {300, 1000}, {130, 100}, {70, 2312}, {1, 520},
                                                           {75, 2304}, {41, 4096}, {33, 128}};
        if (wt == dtype::BF16) shapes.push_back({65, 7176});
        for (auto [out0, in] : shapes)
            for (int T : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11}) {   // 9: a one-token second chunk (v3 after a v1/v2 chunk)
                rng r(9100 + uint32_t(T) * 13 + uint32_t(in) + uint32_t(out0) * 7 + uint32_t(wt) * 100000);
                arena a;
                const int64_t outs[3] = {out0, 17, 260};
                auto xv = r.vec(size_t(T * in));
                std::vector<std::vector<float>> wv(3);
                std::vector<const tensor *> wtens(3);
                for (int s = 0; s < 3; ++s) {
                    wv[size_t(s)] = r.vec(size_t(outs[s] * in), -0.1f, 0.1f);
                    wtens[size_t(s)] = &a.typed(wt, {outs[s], in}, wv[size_t(s)]);   // wv rounded to the stored values
                }
                auto nw = r.vec(size_t(in), 0.8f, 1.2f);
                std::vector<std::vector<float>> res0(3), res1(3);
                for (int s = 0; s < 3; ++s) res0[size_t(s)] = r.vec(size_t(T * outs[s])), res1[size_t(s)] = r.vec(size_t(T * outs[s]));
                const float eps = 1e-5f;
                // fp64 references: y_s = x W_s^T; norm: x' = x * rsqrt(mean(x^2) + eps) * nw
                std::vector<double> xn(size_t(T * in));
                for (int t = 0; t < T; ++t) {
                    double ss = 0;
                    for (int64_t c = 0; c < in; ++c) ss += double(xv[size_t(t * in + c)]) * xv[size_t(t * in + c)];
                    const double inv = 1.0 / std::sqrt(ss / double(in) + eps);
                    for (int64_t c = 0; c < in; ++c) xn[size_t(t * in + c)] = xv[size_t(t * in + c)] * inv * nw[size_t(c)];
                }
                auto mm = [&](const std::vector<double> & xx, int s) {
                    std::vector<double> y(size_t(T * outs[s]));
                    for (int t = 0; t < T; ++t)
                        for (int64_t o = 0; o < outs[s]; ++o) {
                            double acc = 0;
                            const float * w = wv[size_t(s)].data() + o * in;
                            for (int64_t c = 0; c < in; ++c) acc += double(w[c]) * xx[size_t(t * in + c)];
                            y[size_t(t * outs[s] + o)] = acc;
                        }
                    return y;
                };
                std::vector<std::vector<double>> yref(3), ynref(3);
                for (int s = 0; s < 3; ++s) yref[size_t(s)] = mm(to_f64(xv), s), ynref[size_t(s)] = mm(xn, s);
                dmem dx(xv.data(), xv.size() * 4), dnw(nw.data(), nw.size() * 4);
                std::vector<std::unique_ptr<dmem>> dw, dy, dsig, dz0, dz1, dr0, dr1;
                for (int s = 0; s < 3; ++s) {
                    const size_t no = size_t(T * outs[s]);
                    dw.push_back(std::make_unique<dmem>(wtens[size_t(s)]->data, wtens[size_t(s)]->nbytes));
                    for (auto * v : {&dy, &dsig, &dz0, &dz1}) v->push_back(std::make_unique<dmem>(no * 4));
                    dr0.push_back(std::make_unique<dmem>(res0[size_t(s)].data(), no * 4));
                    dr1.push_back(std::make_unique<dmem>(res1[size_t(s)].data(), no * 4));
                }
                dmem dyn(size_t(T * in) * 4);
                auto nan_fill = [&] {
                    for (int s = 0; s < 3; ++s)
                        for (auto * v : {&dy, &dsig, &dz0, &dz1}) cudaMemset((*v)[size_t(s)]->p, 0xff, size_t(T * outs[s]) * 4);
                    cudaMemset(dyn.p, 0xff, size_t(T * in) * 4);
                };
                std::vector<std::vector<float>> v2_s1[4];   // T = 1: v2 u4 s1's outputs per kind (the v3 bitwise check)
                std::vector<std::vector<float>> v3e_s1[4];  // T = 1: v3 early s1's (the evict_first bitwise check)
                for (const auto & cfg0 : cfgs)
                    for (int kind = 0; kind < 4; ++kind) {
                        cuda::gemv_cfg cfg = cfg0;
                        if (cfg.mma == 1) {
                            cfg.mma_part = mma_part.f(), cfg.mma_part_floats = part_floats;
                            cfg.mma_ctr = static_cast<unsigned *>(mma_ctr.p), cfg.mma_ctr_n = ctr_n;
                        }
                        nan_fill();
                        cudaError_t e = cudaSuccess;
                        const void * wp[3] = {dw[0]->p, dw[1]->p, dw[2]->p};
                        float * yp[3] = {dy[0]->f(), dy[1]->f(), dy[2]->f()};
                        cuda::gemv_fused_seg segs[3];
                        for (int s = 0; s < 3; ++s) segs[s].w = wp[s], segs[s].y = yp[s], segs[s].out = outs[s];
                        cuda::gemv_norm nm;
                        const long mma0 = cuda::gemv_mma_launches();
                        if (kind == 0) e = cuda::launch_linear_gemv(dx.f(), T, in, {dw[0]->p, cw}, outs[0], yp[0], nullptr, cfg);
                        if (kind == 1) e = cuda::launch_linear_gemv_group(dx.f(), T, in, cw, wp, yp, outs, 3, nullptr, cfg);
                        if (kind == 2) {   // seg 0: sigmoid + both residuals; seg 1: sigmoid; seg 2: one residual
                            segs[0].sig = dsig[0]->f(), segs[1].sig = dsig[1]->f();
                            segs[0].res[0] = dr0[0]->f(), segs[0].res[1] = dr1[0]->f(), segs[0].z[0] = dz0[0]->f(), segs[0].z[1] = dz1[0]->f();
                            segs[2].res[0] = dr0[2]->f(), segs[2].z[0] = dz0[2]->f();
                        }
                        if (kind == 3) nm.on = true, nm.staged = true, nm.w = dnw.f(), nm.eps = eps, nm.y = dyn.f();
                        if (kind >= 2) e = cuda::launch_linear_gemv_fused(dx.f(), T, in, cw, segs, 3, nm, nullptr, nullptr, cfg);
                        if (e == cudaSuccess) e = cudaDeviceSynchronize();
                        // the tensor-core kernel ran exactly where it applies: a chunk of >= cfg.mma tokens, BF16, in % 8
                        // == 0 (the folded norm: only where it is staged; T = 9 / 11: two chunks); nowhere else
                        {
                            const auto applies = [&](int tt) { return cfg.mma > 0 && tt >= cfg.mma && wt == dtype::BF16 && in % 8 == 0; };
                            long want = 0;
                            for (int t0 = 0; t0 < T; t0 += 8) {
                                const int tt = std::min(8, T - t0);
                                if (applies(tt) && (kind != 3 || tt * in * 4 <= cuda::k_gemv_norm_stage_max)) ++want;
                            }
                            const long got = cuda::gemv_mma_launches() - mma0;
                            if (want > 0) ++n_mma_expected;
                            if (want > 0 && got == want) ++n_mma_ran;
                            EXPECT_EQ(got, want) << "tensor-core GEMV launches, " << dtype_name(wt) << " kind " << kinds[kind] << " T " << T
                                                 << " in " << in << " mma " << cfg.mma;
                            tally(got == want);
                        }
                        const std::string key = cfg.mma ? fmt::format("gemv/{}/{}/mma{}s{}", dtype_name(wt), kinds[kind], cfg.mma, cfg.split)
                                              : cfg.v3 ? fmt::format("gemv/{}/{}/v3-{}u{}s{}{}", dtype_name(wt), kinds[kind], cfg.v3,
                                                                      cfg.v3_unroll, cfg.split,
                                                                      cfg.evict_first ? "-ef" : "")
                                                       : fmt::format("gemv/{}/{}/u{}s{}{}", dtype_name(wt), kinds[kind], cfg.unroll, cfg.split,
                                                                     cfg.evict_first ? "-ef" : "");
                        const std::string nm_case = fmt::format("{}/{}x{}/T{}", key, out0, in, T);
                        EXPECT_EQ(e, cudaSuccess) << nm_case << ": " << cudaGetErrorString(e);
                        // (reference, candidate) pairs of this launch
                        std::vector<std::pair<std::vector<double>, std::vector<float>>> pr;
                        const int nseg = kind == 0 ? 1 : 3;
                        for (int s = 0; s < nseg; ++s) {
                            const size_t no = size_t(T * outs[s]);
                            const auto & yr = kind == 3 ? ynref[size_t(s)] : yref[size_t(s)];
                            pr.push_back({yr, dget(dy[size_t(s)]->f(), no)});
                            if (kind == 2 && s <= 1) {
                                std::vector<double> sg(no);
                                for (size_t i = 0; i < no; ++i) sg[i] = sigmoid_d(yr[i]);
                                pr.push_back({sg, dget(dsig[size_t(s)]->f(), no)});
                            }
                            if (kind == 2 && s != 1) {
                                std::vector<double> z0(no), z1(no);
                                for (size_t i = 0; i < no; ++i) z0[i] = yr[i] + res0[size_t(s)][i], z1[i] = z0[i] + res1[size_t(s)][i];
                                pr.push_back({z0, dget(dz0[size_t(s)]->f(), no)});
                                if (s == 0) pr.push_back({z1, dget(dz1[size_t(s)]->f(), no)});
                            }
                        }
                        if (kind == 3) pr.push_back({xn, dget(dyn.f(), size_t(T * in))});
                        for (size_t i = 0; i < pr.size(); ++i) {
                            const cmp_result c = compare(pr[i].first, pr[i].second, metric::NMSE, k_tol_f32);
                            auto & w = worst[key];
                            w.first = std::max(w.first, c.ok ? c.measured : 1.0), w.second++;
                            tally(c.ok);
                            if (!c.ok) {
                                ++n_bad;
                                std::printf("[%s/out%zu] FAIL: NMSE %.3e %s\n", nm_case.c_str(), i, c.measured, c.why.c_str());
                            }
                            EXPECT_TRUE(c.ok) << nm_case << " output " << i;
                        }
                        // controls, once per (dtype, kind) with the default cfg: a perturbed output must fail
                        const int di = wt == dtype::BF16 ? 0 : wt == dtype::F16 ? 1 : 2;
                        // the tensor-core kernel: a perturbed output must fail, once per kind (BF16, T = 5, a shape it runs on);
                        // and with x in ONE bf16 part instead of three (the lo parts dropped) the f32 tolerance must fail on the
                        // wide rows (in >= 2304): the comparison can see the precision the split buys
                        if (cfg.mma == 1 && cfg.split == 0 && wt == dtype::BF16 && T == 5 && in % 8 == 0) {
                            if (!controls_mma_done[kind]) {
                                controls_mma_done[kind] = true;
                                const bool pert = check(nm_case + "/control(perturbed 10x)", pr[0].first,
                                                        perturb(pr[0].first, pr[0].second, metric::NMSE, k_tol_f32), metric::NMSE, k_tol_f32);
                                std::printf("[%s/control] (must FAIL) %s\n", nm_case.c_str(), pert ? "PASSED - BAD" : "FAILED as required");
                                EXPECT_FALSE(pert);
                                tally(!pert);
                            }
                            if (kind == 0 && in >= 2304) {
                                cuda::gemv_cfg one = cfg;
                                one.mma_parts = 1;
                                nan_fill();
                                e = cuda::launch_linear_gemv(dx.f(), T, in, {dw[0]->p, cw}, outs[0], yp[0], nullptr, one);
                                EXPECT_EQ(e == cudaSuccess ? cudaDeviceSynchronize() : e, cudaSuccess);
                                const cmp_result c1 = compare(yref[0], dget(dy[0]->f(), size_t(T * outs[0])), metric::NMSE, k_tol_f32);
                                ++n_mma_parts_cases;
                                if (!c1.ok) ++n_mma_parts_fail;
                                std::printf("[%s/control(one bf16 part)] (must FAIL) NMSE %.3e: %s\n", nm_case.c_str(), c1.measured,
                                            c1.ok ? "PASSED - BAD" : "FAILED as required");
                                EXPECT_FALSE(c1.ok);
                                tally(!c1.ok);
                            }
                        }
                        if (cfg.mma == 0 && cfg.unroll == cuda::k_gemv_unroll_default && cfg.split == 0 && !controls_done[di][kind] && T == 3) {
                            controls_done[di][kind] = true;
                            const bool pert = check(nm_case + "/control(perturbed 10x)", pr[0].first,
                                                    perturb(pr[0].first, pr[0].second, metric::NMSE, k_tol_f32), metric::NMSE, k_tol_f32);
                            std::printf("[%s/control] (must FAIL) %s\n", nm_case.c_str(), pert ? "PASSED - BAD" : "FAILED as required");
                            EXPECT_FALSE(pert);
                            tally(!pert);
                        }
                        // v3 controls, once per (16-bit dtype, kind) at T = 1 where v3 runs: a perturbed output must fail
                        const bool v3_ran = cfg.v3 > 0 && T == 1 && wt != dtype::F32 && in % 8 == 0;
                        if (v3_ran && cfg.v3 == 1 && cfg.v3_unroll == 0 && cfg.split == 0 && !controls_v3_done[di][kind]) {
                            controls_v3_done[di][kind] = true;
                            const bool pert = check(nm_case + "/control(perturbed 10x)", pr[0].first,
                                                    perturb(pr[0].first, pr[0].second, metric::NMSE, k_tol_f32), metric::NMSE, k_tol_f32);
                            std::printf("[%s/control] (must FAIL) %s\n", nm_case.c_str(), pert ? "PASSED - BAD" : "FAILED as required");
                            EXPECT_FALSE(pert);
                            tally(!pert);
                        }
                        // v3 with one warp per row sums each lane's chunks in v2's order (v2 at T = 1: one row per warp):
                        // every output bit for bit equal to v2 u4 s1's; v2 without the split keeps its outputs for that
                        if (T == 1 && cfg.v3 == 0 && cfg.mma == 0 && cfg.unroll == 4 && cfg.split == 1 && !cfg.evict_first) {
                            v2_s1[kind].clear();
                            for (const auto & q : pr) v2_s1[kind].push_back(q.second);
                        }
                        if (T == 1 && cfg.v3 == 2 && cfg.split == 1 && !cfg.evict_first) {
                            v3e_s1[kind].clear();
                            for (const auto & q : pr) v3e_s1[kind].push_back(q.second);
                        }
                        // a cache policy changes no bit: evict_first at T = 1, split 1 against the same cfg without it
                        if (T == 1 && cfg.v3 == 2 && cfg.split == 1 && cfg.evict_first)
                            same_bits(pr, v3e_s1[kind], nm_case + "/vs v3 early s1 without evict_first", n_pf3_bitwise);
                        if (T == 1 && cfg.evict_first && cfg.v3 == 0 && cfg.mma == 0 && cfg.unroll == 4 && cfg.split == 1)
                            same_bits(pr, v2_s1[kind], nm_case + "/vs v2 u4s1 without evict_first", n_pf_bitwise);
                        if (v3_ran && cfg.v3 == 1 && cfg.split == 1 && cfg.v3_unroll == 0) {
                            ++n_v3_expected;
                            same_bits(pr, v2_s1[kind], nm_case + "/vs v2 u4s1", n_v3_bitwise);
                        }
                        // determinism: the same launch again gives the same bits (split rows summed in a fixed order)
                        if (kind == 1 && cfg.split != 1 && (T == 1 || T == 8)) {
                            const auto first = pr[0].second;
                            e = cuda::launch_linear_gemv_group(dx.f(), T, in, cw, wp, yp, outs, 3, nullptr, cfg);
                            EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                            const auto again = dget(dy[0]->f(), size_t(T * outs[0]));
                            const bool same = std::memcmp(first.data(), again.data(), first.size() * 4) == 0;
                            if (!same) std::printf("[%s/again] NOT bitwise equal\n", nm_case.c_str());
                            EXPECT_TRUE(same) << nm_case;
                            tally(same);
                        }
                    }
            }
    }
    for (const auto & [k, w] : worst) std::printf("[%s] worst NMSE %.3e <= %.1e over %d outputs\n", k.c_str(), w.first, k_tol_f32, w.second);
    std::printf("[gemv] %d failing outputs; v3 s1 bitwise equal to v2 u4s1 in %d of %d launches (16-bit weights, T = 1, in %% 8 "
                "== 0: 15 shapes x 4 kinds = 60 expected)\n", n_bad, n_v3_bitwise, n_v3_expected);
    EXPECT_EQ(n_v3_expected, 60);
    // evict_first at T = 1, split 1: (9 BF16 + 8 F16 + 8 F32 shapes) x 4 kinds, every output bit for bit the run without
    std::printf("[gemv] v2 u4s1 evict_first bitwise equal to v2 u4s1 in %d of 100 launches\n", n_pf_bitwise);
    EXPECT_EQ(n_pf_bitwise, 100);
    std::printf("[gemv] v3 early s1 evict_first bitwise equal to v3 early s1 in %d of 100 launches\n", n_pf3_bitwise);
    EXPECT_EQ(n_pf3_bitwise, 100);
    // the tensor-core kernel ran in every launch where it applies (BF16: 8 shapes with in % 8 == 0 x 10 token counts x 4
    // kinds x 4 cfgs from 1 token, less the folded norms too wide to stage; + the cfg from 3 tokens), and dropping its
    // lo parts failed the tolerance on each wide shape (2304, 2312, 4096, 7176)
    std::printf("[gemv] tensor-core kernel ran as expected in %d of %d launches; one-bf16-part control failed in %d of %d\n",
                n_mma_ran, n_mma_expected, n_mma_parts_fail, n_mma_parts_cases);
    EXPECT_GT(n_mma_expected, 100);
    EXPECT_EQ(n_mma_ran, n_mma_expected);
    EXPECT_EQ(n_mma_parts_cases, 4);
    EXPECT_EQ(n_mma_parts_fail, n_mma_parts_cases);
    {   // every split-K arrival counter is back at 0 (the last slice of each group resets it)
        std::vector<unsigned> c(static_cast<size_t>(ctr_n));
        EXPECT_EQ(cudaMemcpy(c.data(), mma_ctr.p, c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        const auto nz = std::count_if(c.begin(), c.end(), [](unsigned v) { return v != 0; });
        std::printf("[gemv] tensor-core split-K counters left non-zero: %ld of %ld (must be 0)\n", long(nz), long(ctr_n));
        EXPECT_EQ(nz, 0);
        tally(nz == 0);
    }
    // an invalid cfg is refused, not run
    {
        dmem x(64 * 4), w(64 * 64 * 2), y(64 * 4);
        const cudaError_t e3 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr, {3, 0});
        const cudaError_t e5 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr, {4, 3});
        const cudaError_t e6 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr, {0, 0, 3, 0});
        const cudaError_t e7 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr, {0, 0, 1, 7});
        const cudaError_t e8 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr, {4, 0, 0, 0, false, 9});
        const cudaError_t e9 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr,
                                                        {4, 0, 0, 0, false, 1, 4});
        const cudaError_t e10 = cuda::launch_linear_gemv(x.f(), 1, 64, {w.p, cuda::wtype::BF16}, 64, y.f(), nullptr,
                                                         {4, 2, 0, 0, false, 1});   // 2 K slices forced, no scratch
        std::printf("[gemv/invalid cfg] mma 9: %s, mma_parts 4: %s, mma split 2 without scratch: %s (must be invalid value)\n",
                    cudaGetErrorString(e8), cudaGetErrorString(e9), cudaGetErrorString(e10));
        EXPECT_EQ(e8, cudaErrorInvalidValue);
        EXPECT_EQ(e9, cudaErrorInvalidValue);
        EXPECT_EQ(e10, cudaErrorInvalidValue);
        tally(e8 == cudaErrorInvalidValue && e9 == cudaErrorInvalidValue && e10 == cudaErrorInvalidValue);
        std::printf("[gemv/invalid cfg] unroll 3: %s, split 3: %s, v3 3: %s, v3_unroll 7: %s (all must be invalid value)\n",
                    cudaGetErrorString(e3), cudaGetErrorString(e5), cudaGetErrorString(e6), cudaGetErrorString(e7));
        EXPECT_EQ(e3, cudaErrorInvalidValue);
        EXPECT_EQ(e5, cudaErrorInvalidValue);
        EXPECT_EQ(e6, cudaErrorInvalidValue);
        EXPECT_EQ(e7, cudaErrorInvalidValue);
        tally(e3 == cudaErrorInvalidValue && e5 == cudaErrorInvalidValue && e6 == cudaErrorInvalidValue &&
              e7 == cudaErrorInvalidValue);
        cudaGetLastError();
        cuda_options o;
        o.gemv_unroll = 3;   // the backend refuses it at init, naming the option
        bool named = false;
        try {
            backend_cuda_init(0, o);
        } catch (const error & e) {
            named = std::string(e.what()).find("gemv_unroll") != std::string::npos;
            std::printf("[gemv/invalid option] %s\n", e.what());
        }
        EXPECT_TRUE(named);
        tally(named);
        o.gemv_unroll = 4;
        o.gemv_v3 = 3;   // likewise gemv_v3
        named = false;
        try {
            backend_cuda_init(0, o);
        } catch (const error & e) {
            named = std::string(e.what()).find("gemv_v3") != std::string::npos;
            std::printf("[gemv/invalid option] %s\n", e.what());
        }
        EXPECT_TRUE(named);
        tally(named);
        o.gemv_v3 = 2;
        o.gemv_mma_min_tokens = 9;   // likewise gemv_mma_min_tokens
        named = false;
        try {
            backend_cuda_init(0, o);
        } catch (const error & e) {
            named = std::string(e.what()).find("gemv_mma_min_tokens") != std::string::npos;
            std::printf("[gemv/invalid option] %s\n", e.what());
        }
        EXPECT_TRUE(named);
        tally(named);
    }
}

// The register-row norm kernels (cuda_options::norm_reg, norm.cu k_norm_reg) against the loop kernel they replace: every
// output bit for bit, for the four norms, widths of 1 to 16 elements per thread (PT 1, 2, 4, 8, 16, partial last
// rounds, both block sizes) and one width past the register form (the loop kernel on both sides), rows 1 and 5, a NaN
// row placed where the x^2 sum meets it, F32 / BF16 / absent weights. Controls: one ulp moved compares unequal; the
// CPU parity of both forms is the tests above (norms_wide_rows, elementwise_norms_with_nan_inf_placement run the
// backend's default, the register form).
TEST(cuda_ops, norm_reg_bitwise) {
    NEED_GPU();
    int n_cases = 0, n_same = 0;
    for (int64_t N : {int64_t(32), int64_t(100), int64_t(256), int64_t(300), int64_t(1536), int64_t(2304), int64_t(4095),
                      int64_t(4096), int64_t(7168), int64_t(16384), int64_t(20000)})
        for (int R : {1, 5})
            for (int mode = 0; mode < 4; ++mode)
                for (int wk = 0; wk < 3; ++wk) {   // weights: 0 F32, 1 BF16, 2 absent (RMS only)
                    if (wk == 2 && mode != 0) continue;
                    if (mode == 1 && wk != 0) continue;   // L2 has no weights
                    rng r(7700 + uint32_t(N) + uint32_t(R) * 3 + uint32_t(mode) * 11 + uint32_t(wk) * 101);
                    auto xv = r.vec(size_t(R * N), -3, 3), zv = r.vec(size_t(R * N), -3, 3);
                    auto wv = r.vec(size_t(N), 0.5f, 1.5f), bv = r.vec(size_t(N), -0.2f, 0.2f);
                    if (R == 5) xv[size_t(2 * N + N / 2)] = NAN;   // row 2 all NaN (the sum meets it)
                    std::vector<uint16_t> wb(static_cast<size_t>(N));
                    for (int64_t i = 0; i < N; ++i) {
                        uint32_t u;
                        std::memcpy(&u, &wv[size_t(i)], 4);
                        wb[size_t(i)] = uint16_t(u >> 16);
                    }
                    dmem dx(xv.data(), xv.size() * 4), dz(zv.data(), zv.size() * 4), db(bv.data(), bv.size() * 4);
                    dmem dwf(wv.data(), wv.size() * 4), dwb(wb.data(), wb.size() * 2);
                    dmem y0(size_t(R * N) * 4), y1(size_t(R * N) * 4);
                    const cuda::dweight w = wk == 0 ? cuda::dweight{dwf.p, cuda::wtype::F32}
                                          : wk == 1 ? cuda::dweight{dwb.p, cuda::wtype::BF16}
                                                    : cuda::dweight{};
                    const cuda::dweight b{db.p, cuda::wtype::F32};
                    auto launch = [&](float * y, bool reg) {
                        cudaMemset(y, 0xff, size_t(R * N) * 4);
                        cudaError_t e = cudaSuccess;
                        if (mode == 0) e = cuda::launch_rms_norm(dx.f(), R, N, w, 1e-6f, y, nullptr, reg);
                        if (mode == 1) e = cuda::launch_l2_norm(dx.f(), R, N, 1e-6f, y, nullptr, reg);
                        if (mode == 2) e = cuda::launch_gated_rms_norm(dx.f(), dz.f(), R, N, w, 1e-5f, y, nullptr, reg);
                        if (mode == 3) e = cuda::launch_layer_norm(dx.f(), R, N, w, b, 1e-5f, y, nullptr, reg);
                        EXPECT_EQ(e, cudaSuccess);
                        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                        return dget(y, size_t(R * N));
                    };
                    const auto a0 = launch(y0.f(), false), a1 = launch(y1.f(), true);
                    const bool same = std::memcmp(a0.data(), a1.data(), a0.size() * 4) == 0;
                    ++n_cases;
                    n_same += same;
                    if (!same) std::printf("[norm_reg/mode%d/w%d/N%lld/R%d] NOT bitwise the loop kernel\n", mode, wk, (long long)N, R);
                    EXPECT_TRUE(same) << "mode " << mode << " N " << N << " R " << R;
                    tally(same);
                    if (N == 2304 && R == 1) {   // control: one ulp moved must compare unequal
                        auto moved = a1;
                        moved[7] = std::nextafter(moved[7], INFINITY);
                        const bool ctl = std::memcmp(a0.data(), moved.data(), a0.size() * 4) == 0;
                        EXPECT_FALSE(ctl);
                        tally(!ctl);
                    }
                }
    std::printf("[norm_reg] %d of %d cases bit for bit the loop kernel\n", n_same, n_cases);
}

TEST(cuda_ops, unsupported_is_an_error_naming_the_node) {
    NEED_GPU();
    arena a;
    builder bd(batch_simple(2));
    std::vector<float> v(2 * 4, 1.0f);
    tensor & st = a.f32({1, 4, 20}, v = std::vector<float>(80, 0.0f));
    std::vector<float> xw(8, 1.0f), cw(4 * 21, 0.1f);
    const node_ref x = bd.scale(bd.weight(a.f32({2, 4}, xw), "x"), 1.0f);
    const node_ref y = bd.name(bd.short_conv(x, bd.weight(a.f32({4, 1, 21}, cw), "wide_conv"), bd.state(st, "s")), "too_wide");
    graph g = bd.finish(y);
    auto gpu = backend_cuda_init(0);
    bool named = false;
    try {
        gpu->check_supported(g);
    } catch (const error & e) {
        named = std::string(e.what()).find("too_wide") != std::string::npos && std::string(e.what()).find("SHORT_CONV") != std::string::npos;
        std::printf("[unsupported] %s\n", e.what());
    }
    EXPECT_TRUE(named);
    tally(named);
}

class summary : public ::testing::Environment {
public:
    void TearDown() override { std::printf("%d passed, %d failed\n", g_passed, g_failed); }
};
const auto * g_env = ::testing::AddGlobalTestEnvironment(new summary);

} // namespace
} // namespace perigee::test
