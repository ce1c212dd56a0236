// Backend-level fusions of the CUDA decode step (src/backend/cuda/fuse-plan.h) against the CPU reference.
//
// Each case builds a small graph shaped like the decode step's hot spots (a norm feeding grouped projections with a
// non-LINEAR consumer before them, like the MoE router; LINEAR -> residual ADD -> second ADD, like the shared expert's
// down projection -> ffn_moe_out -> l_out), runs it on the CPU backend and on the CUDA backend with the fusion on and
// off (guard mode: NaN-poisoned outputs framed by sentinels), and compares every output, the norm's own output
// included. Tolerance k_tol_f32 (the GEMV path accumulates in fp32, as test-ops-cuda). Controls that must FAIL: the
// fused output against a CPU graph with a wrong eps, the fused y + r against y alone (a dropped residual), the second
// chain ADD against the first, and the comparator's perturbation/negative-threshold controls. Every fused case also
// asserts the backend's counters (fused_norms / fused_adds / linear_grouped), so a fusion that did not fire fails.
// The planner itself (host code) is checked without a GPU. The run ends with "N passed, N failed".
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/fuse-plan.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <cstring>

namespace perigee::test {
namespace {

constexpr double k_tol_f32 = 1e-7;   // NMSE: f32-accumulated GEMV, norms, elementwise (test-ops-cuda's table)

int g_passed = 0, g_failed = 0;
void tally(bool ok) { (ok ? g_passed : g_failed)++; }

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the CUDA fusion tests need the GPU machine"

cuda_options fuse_opts(bool norm, bool add, bool guard = true) {
    cuda_options o;
    o.guard = guard;
    o.fuse_norm_linear = norm;
    o.fuse_add = add;
    return o;
}

std::vector<float> as_f32(const tensor & t) {
    std::vector<float> v(size_t(t.numel()));
    if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * 4);
    return v;
}

// CPU reference outputs of `outs`.
std::vector<std::vector<float>> cpu_outputs(graph & g, const std::vector<node_ref> & outs) {
    auto cpu = backend_cpu_init();
    cpu->check_supported(g);
    cpu->run(g);
    std::vector<std::vector<float>> r;
    for (node_ref o : outs) r.push_back(read_f32(*cpu, o));
    return r;
}

// Runs g on the CUDA backend with `opt` and checks every output against `ref` (NMSE k_tol_f32). Returns the backend
// (for its counters and further reads) and whether all passed.
std::unique_ptr<backend_cuda> gpu_check(const std::string & name, graph & g, const std::vector<node_ref> & outs,
                                        const std::vector<std::vector<float>> & ref, const cuda_options & opt, bool & all) {
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(g);
    gpu->run(g);
    all = true;
    for (size_t i = 0; i < outs.size(); ++i) {
        const bool ok = check(name + "/" + g.at(outs[i]).name, to_f64(ref[i]), read_f32(*gpu, outs[i]), metric::NMSE, k_tol_f32);
        tally(ok);
        all &= ok;
    }
    return gpu;
}

// A control that must FAIL: `cand` against `ref` at the f32 tolerance.
void must_fail(const std::string & name, const std::vector<float> & ref, const std::vector<float> & cand) {
    const bool passed = check(name, to_f64(ref), cand, metric::NMSE, k_tol_f32);
    std::printf("[%s] (control: must FAIL) %s\n", name.c_str(), passed ? "PASSED - BAD" : "FAILED as required");
    EXPECT_FALSE(passed) << name;
    tally(!passed);
}

void comparator_controls(const std::string & name, const std::vector<float> & ref, const std::vector<float> & cand) {
    const auto r = to_f64(ref);
    const bool pert = check(name + "/control(perturbed 10x)", r, perturb(r, cand, metric::NMSE, k_tol_f32), metric::NMSE, k_tol_f32);
    const bool neg = compare(r, cand, metric::NMSE, -1.0).ok;
    EXPECT_FALSE(pert);
    EXPECT_FALSE(neg);
    tally(!pert && !neg);
}

// ---- norm -> grouped LINEARs ----
// x [T, N] (small values: mean(x^2) ~ eps, so eps matters), h = rms_norm(x, nw, eps); a sigmoid(h) BEFORE the
// projections (a non-LINEAR consumer that needs h first, like the MoE router); 9 projections of the main dtype (a
// launch of 8 + a launch of 1) and one of the other dtype (its own launch); a weightless norm with one projection.
struct norm_graph {
    arena a;
    graph g;
    std::vector<node_ref> outs;   // h, sigmoid, lin0..lin9, h2, lin_h2
    node_ref lin0;
};
void build_norm_graph(norm_graph & ng, rng & r, int T, int N, dtype wt, float eps, std::vector<float> & xv,
                      std::vector<float> & nwv, std::vector<std::vector<float>> & wvs) {
    builder bd(batch_simple(T));
    const node_ref x = bd.name(bd.scale(bd.weight(ng.a.f32({T, N}, xv), "x_leaf"), 1.0f), "x");
    const node_ref nw = bd.weight(N == 2304 ? ng.a.bf16({N}, nwv) : ng.a.f32({N}, nwv), "norm_w");
    const node_ref h = bd.name(bd.rms_norm(x, nw, eps), "h");
    ng.outs.push_back(h);
    ng.outs.push_back(bd.name(bd.sigmoid(h), "router_like"));
    const int outs[] = {256, 40, 1000, 8, 64, 72, 32, 16, 24};
    const dtype other = wt == dtype::BF16 ? dtype::F32 : dtype::BF16;
    for (int i = 0; i < 10; ++i) {
        const int O = i < 9 ? outs[i] : 48;
        if (wvs.size() <= size_t(i)) wvs.push_back(r.vec(size_t(O) * size_t(N), -0.05f, 0.05f));
        const node_ref w = bd.weight(ng.a.typed(i < 9 ? wt : other, {O, N}, wvs[size_t(i)]), "w" + std::to_string(i));
        ng.outs.push_back(bd.name(bd.linear(h, w), "lin" + std::to_string(i)));
    }
    ng.lin0 = ng.outs[2];
    const node_ref h2 = bd.name(bd.rms_norm(bd.scale(x, 3.0f), {}, eps), "h2_noweight");
    ng.outs.push_back(h2);
    if (wvs.size() <= 10) wvs.push_back(r.vec(size_t(128) * size_t(N), -0.05f, 0.05f));
    ng.outs.push_back(bd.name(bd.linear(h2, bd.weight(ng.a.typed(wt, {128, N}, wvs[10]), "w_h2")), "lin_h2"));
    node_ref acc = bd.cols(ng.outs[2], 0, 8);
    for (size_t i = 3; i < ng.outs.size(); ++i) acc = bd.add(acc, bd.cols(ng.outs[i], 0, 8));
    ng.g = bd.finish(bd.name(acc, "sum"));
}

TEST(cuda_fuse, norm_into_grouped_linears) {
    NEED_GPU();
    for (int N : {2304, 7168})
        for (dtype wt : {dtype::BF16, dtype::F32})
            for (int T : {1, 2, 5, 8}) {
                if (N == 7168 && (T == 2 || T == 5)) continue;   // keep the CPU reference short
                const std::string nm = fmt::format("norm_linear/N{}/{}/T{}", N, dtype_name(wt), T);
                rng r(9100 + uint32_t(N) + uint32_t(T) * 7 + (wt == dtype::BF16 ? 0u : 3u));
                const float eps = 1e-5f;
                auto xv = r.vec(size_t(T) * size_t(N), -0.006f, 0.006f);
                auto nwv = r.vec(size_t(N), 0.8f, 1.2f);
                std::vector<std::vector<float>> wvs;
                norm_graph ng;
                build_norm_graph(ng, r, T, N, wt, eps, xv, nwv, wvs);
                const auto ref = cpu_outputs(ng.g, ng.outs);
                bool ok_f = false, ok_u = false;
                auto fused = gpu_check(nm + "/fused", ng.g, ng.outs, ref, fuse_opts(true, false), ok_f);
                EXPECT_TRUE(ok_f) << nm;
                // the two norms folded; their launches: [8 x wt] + [1 x wt] + [1 x other] and [1 x wt]
                EXPECT_EQ(fused->fused_norms(), 2) << nm;
                EXPECT_EQ(fused->linear_grouped(), 7) << nm;
                tally(fused->fused_norms() == 2 && fused->linear_grouped() == 7);
                std::printf("[%s] fused_norms %d (want 2), linear_grouped %d (want 7)\n", nm.c_str(), fused->fused_norms(),
                            fused->linear_grouped());
                auto plain = gpu_check(nm + "/unfused", ng.g, ng.outs, ref, fuse_opts(false, false), ok_u);
                EXPECT_TRUE(ok_u) << nm;
                EXPECT_EQ(plain->fused_norms(), 0) << nm;
                // fused vs unfused on the GPU (same tolerance)
                const auto got = read_f32(*fused, ng.lin0);
                const bool agree = check(nm + "/fused-vs-unfused/lin0", to_f64(read_f32(*plain, ng.lin0)), got, metric::NMSE, k_tol_f32);
                EXPECT_TRUE(agree);
                tally(agree);
                if (T == 1 || T == 8) {
                    // control: the same graph with a wrong eps on the CPU must not match the fused output
                    norm_graph bad;
                    rng r2(1);
                    build_norm_graph(bad, r2, T, N, wt, 1e-6f, xv, nwv, wvs);
                    const auto ref_bad = cpu_outputs(bad.g, {bad.lin0, bad.outs[0]});
                    must_fail(nm + "/control(wrong eps)/lin0", ref_bad[0], got);
                    must_fail(nm + "/control(wrong eps)/h", ref_bad[1], read_f32(*fused, ng.outs[0]));
                    comparator_controls(nm + "/lin0", ref[2], got);
                }
            }
    // past the GEMV path (BF16, T > 8: cuBLASLt): nothing folds, and the result still matches
    {
        const int T = 19, N = 2304;
        rng r(9199);
        auto xv = r.vec(size_t(T) * size_t(N), -0.006f, 0.006f);
        auto nwv = r.vec(size_t(N), 0.8f, 1.2f);
        std::vector<std::vector<float>> wvs;
        norm_graph ng;
        build_norm_graph(ng, r, T, N, dtype::BF16, 1e-5f, xv, nwv, wvs);
        auto gpu = backend_cuda_init(0, fuse_opts(true, true));
        gpu->run(ng.g);
        EXPECT_EQ(gpu->fused_norms(), 0);
        tally(gpu->fused_norms() == 0);
        std::printf("[norm_linear/T19] fused_norms %d (want 0: cuBLASLt path)\n", gpu->fused_norms());
    }
}

// ---- LINEAR -> ADD (-> ADD) ----
// y1 = x W1, z1 = r + y1 (residual on the left, like attn_residual); y2 = silu(x) x W2, z2 = y2 + q, z3 = z1 + z2
// (the chain: shared down -> ffn_moe_out -> l_out); y3 = x W3 and y4 = x W4 grouped with y1: z4 = y3 + rl with rl
// computed AFTER the group's launch (must not fold), z5 = y4 + r (folds into the group's segment); a norm folded into
// y6 = rms_norm(xa) W6 with z6 = y6 + r in the same launch's epilogue.
struct add_graph {
    arena a;
    graph g;
    std::vector<node_ref> outs;   // y1 z1 y2 z2 z3 y3 z4 y4 z5 y6 z6
};
void build_add_graph(add_graph & ag, rng & r, int T, int K, dtype wt) {
    const int D = 2304;
    builder bd(batch_simple(T));
    auto xv = r.vec(size_t(T) * size_t(K)), rv = r.vec(size_t(T) * D, -2, 2), qv = r.vec(size_t(T) * D, -2, 2);
    const node_ref x = bd.name(bd.scale(bd.weight(ag.a.f32({T, K}, xv), "x_leaf"), 1.0f), "x");
    const node_ref res = bd.name(bd.scale(bd.weight(ag.a.f32({T, D}, rv), "r_leaf"), 1.0f), "r");
    const node_ref q = bd.name(bd.scale(bd.weight(ag.a.f32({T, D}, qv), "q_leaf"), 1.0f), "q");
    auto W = [&](const char * nm) {
        auto v = r.vec(size_t(D) * size_t(K), -0.03f, 0.03f);
        return bd.weight(ag.a.typed(wt, {D, K}, v), nm);
    };
    const node_ref y1 = bd.name(bd.linear(x, W("w1")), "y1");
    const node_ref z1 = bd.name(bd.add(res, y1), "z1");
    const node_ref x2 = bd.name(bd.silu_mul(x, x), "x2");
    const node_ref y2 = bd.name(bd.linear(x2, W("w2")), "y2");
    const node_ref z2 = bd.name(bd.add(y2, q), "z2");
    const node_ref z3 = bd.name(bd.add(z1, z2), "z3");
    const node_ref y3 = bd.name(bd.linear(x, W("w3")), "y3");
    const node_ref rl = bd.name(bd.scale(res, 2.0f), "r_late");
    const node_ref z4 = bd.name(bd.add(y3, rl), "z4");
    const node_ref y4 = bd.name(bd.linear(x, W("w4")), "y4");
    const node_ref z5 = bd.name(bd.add(y4, res), "z5");
    auto nv = r.vec(size_t(K), 0.8f, 1.2f);
    const node_ref h = bd.name(bd.rms_norm(bd.scale(x, 0.5f), bd.weight(ag.a.f32({K}, nv), "nw"), 1e-5f), "h");
    const node_ref y6 = bd.name(bd.linear(h, W("w6")), "y6");
    const node_ref z6 = bd.name(bd.add(y6, res), "z6");
    ag.outs = {y1, z1, y2, z2, z3, y3, z4, y4, z5, y6, z6};
    node_ref acc = bd.add(z3, z4);
    acc = bd.add(bd.add(acc, z5), z6);
    ag.g = bd.finish(bd.name(acc, "sum"));
}

TEST(cuda_fuse, residual_add_into_gemv_epilogue) {
    NEED_GPU();
    for (int K : {2304, 7168})
        for (dtype wt : {dtype::BF16, dtype::F32})
            for (int T : {1, 3, 8}) {
                if (K == 7168 && T == 3) continue;
                const std::string nm = fmt::format("linear_add/K{}/{}/T{}", K, dtype_name(wt), T);
                rng r(9300 + uint32_t(K) + uint32_t(T) * 11 + (wt == dtype::BF16 ? 0u : 5u));
                add_graph ag;
                build_add_graph(ag, r, T, K, wt);
                const auto ref = cpu_outputs(ag.g, ag.outs);
                for (int mode = 0; mode < 3; ++mode) {   // add only, add + norm, neither
                    const bool add = mode < 2, norm = mode == 1;
                    const std::string m = nm + (mode == 0 ? "/add" : mode == 1 ? "/add+norm" : "/unfused");
                    bool ok = false;
                    auto gpu = gpu_check(m, ag.g, ag.outs, ref, fuse_opts(norm, add), ok);
                    EXPECT_TRUE(ok) << m;
                    // folds: z1, z2, z3 (chain), z5 (group segment), z6 (norm launch or its own); z4 never (late r)
                    const int want = add ? 5 : 0;
                    EXPECT_EQ(gpu->fused_adds(), want) << m;
                    EXPECT_EQ(gpu->fused_norms(), norm ? 1 : 0) << m;
                    tally(gpu->fused_adds() == want && gpu->fused_norms() == (norm ? 1 : 0));
                    std::printf("[%s] fused_adds %d (want %d), fused_norms %d\n", m.c_str(), gpu->fused_adds(), want,
                                gpu->fused_norms());
                    if (mode == 1 && (T == 1 || T == 8)) {
                        const auto z1 = read_f32(*gpu, ag.outs[1]), z3 = read_f32(*gpu, ag.outs[4]);
                        must_fail(m + "/control(residual dropped: z1 vs y1)", ref[0], z1);
                        must_fail(m + "/control(second residual dropped: z3 vs z1)", ref[1], z3);
                        must_fail(m + "/control(residual dropped: z6 vs y6)", ref[9], read_f32(*gpu, ag.outs[10]));
                        comparator_controls(m + "/z3", ref[4], z3);
                    }
                }
            }
}

// The fused launches inside a CUDA graph: replay equals the eager run bitwise, and the counters are the same.
TEST(cuda_fuse, capture_replay_bitwise) {
    NEED_GPU();
    rng r(9400);
    add_graph ag;
    build_add_graph(ag, r, 1, 2304, dtype::BF16);
    auto gpu = backend_cuda_init(0, fuse_opts(true, true, false));
    gpu->run(ag.g);
    std::vector<tensor> eager;
    for (node_ref o : ag.outs) eager.push_back(gpu->read(o));
    gpu->capture(ag.g);
    gpu->replay(3);
    bool all = true;
    for (size_t i = 0; i < ag.outs.size(); ++i) {
        const tensor t = gpu->read(ag.outs[i]);
        all &= check_bitwise("capture/" + ag.g.at(ag.outs[i]).name, eager[i].data, t.data, t.nbytes);
    }
    EXPECT_TRUE(all);
    EXPECT_EQ(gpu->fused_adds(), 5);
    EXPECT_EQ(gpu->fused_norms(), 1);
    tally(all && gpu->fused_adds() == 5 && gpu->fused_norms() == 1);
    // control: the bitwise comparator sees a one-bit change
    tensor t = gpu->read(ag.outs[4]);
    std::vector<float> v = as_f32(t);
    uint32_t u;
    std::memcpy(&u, &v[0], 4);
    u ^= 1u;
    std::memcpy(&v[0], &u, 4);
    const bool same = std::memcmp(v.data(), eager[4].data, eager[4].nbytes) == 0;
    EXPECT_FALSE(same);
    tally(!same);
}

// ---- the planner (host only: runs on any machine) ----
TEST(cuda_fuse, planner_rules) {
    {
        rng r(9500);
        add_graph ag;
        build_add_graph(ag, r, 1, 256, dtype::BF16);
        const auto p = cuda_fuse::plan_fusions(ag.g, fuse_opts(true, true, false));
        EXPECT_EQ(p.norms, 1);
        EXPECT_EQ(p.adds, 5);
        const node_ref z4 = ag.outs[6], z3 = ag.outs[4], y2 = ag.outs[2];
        EXPECT_EQ(p.done_by[size_t(z4.node)], -1) << "z4's residual is computed after the group launch";
        EXPECT_EQ(p.done_by[size_t(z3.node)], y2.node) << "z3 chains onto y2's epilogue";
        const auto off = cuda_fuse::plan_fusions(ag.g, fuse_opts(false, false, false));
        EXPECT_EQ(off.norms + off.adds, 0);
        EXPECT_EQ(off.linear_grouped, 2);   // y1 + y3 + y4
        tally(p.norms == 1 && p.adds == 5 && p.done_by[size_t(z4.node)] == -1 && off.norms + off.adds == 0);
        // T past the GEMV path: nothing folds
        rng r2(9501);
        add_graph big;
        build_add_graph(big, r2, 9, 256, dtype::BF16);
        const auto pb = cuda_fuse::plan_fusions(big.g, fuse_opts(true, true, false));
        EXPECT_EQ(pb.norms + pb.adds + pb.linear_grouped, 0);
        tally(pb.norms + pb.adds + pb.linear_grouped == 0);
    }
    {   // a per-head norm (p.n < the row width) never folds into a LINEAR over the whole row
        arena a;
        builder bd(batch_simple(1));
        std::vector<float> xv(256, 0.1f), wv(64 * 256, 0.01f);
        const node_ref x = bd.scale(bd.weight(a.f32({1, 256}, xv), "x"), 1.0f);
        const node_ref h = bd.rms_norm(x, {}, 1e-5f, 64);
        const node_ref y = bd.linear(h, bd.weight(a.bf16({64, 256}, wv), "w"));
        graph g = bd.finish(y);
        const auto p = cuda_fuse::plan_fusions(g, fuse_opts(true, true, false));
        EXPECT_EQ(p.norms, 0);
        tally(p.norms == 0);
    }
}

class summary : public ::testing::Environment {
public:
    void TearDown() override { std::printf("%d passed, %d failed\n", g_passed, g_failed); }
};
const auto * g_env = ::testing::AddGlobalTestEnvironment(new summary);

} // namespace
} // namespace perigee::test
