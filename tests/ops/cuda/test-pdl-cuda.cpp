// Programmatic Dependent Launch (cuda_options::pdl; common.cuh launch_k / pdl_enter): ordering proofs on the GPU.
//  1. probe_chain_*: a chain of dependent kernels ping-ponging two buffers (each step reads what the previous one wrote and
//     overwrites what the one before read: RAW and WAR hazards), some steps spinning on clock64 so that the next grid is
//     resident long before its predecessor ends; launched with PDL on a non-blocking stream, repeated: bitwise equal to
//     the same chain without PDL and to the host's values. Captured into a graph: one programmatic edge per kernel pair
//     with PDL on, none with it off; the graph replayed, bitwise equal.
//  2. control_consumer_without_wait: a producer that triggers its dependents at once, spins ~1 ms, then writes; a consumer
//     WITHOUT pdl_wait() launched with PDL must read stale data (the control that must fail: it shows that the attribute
//     takes effect and that the wait is what orders the reads); with the wait, or without PDL, it must never.
//  3. backend_graph_pdl_on_equals_off: a decode-sized graph of small nodes (norms, elementwise, COLS) mixed with GEMVs
//     (ordinary launches from linear.cu), pool buffers reused along the chain, run eagerly and as a replayed CUDA graph
//     with cuda_options::pdl on and off: bitwise equal; the output vs the CPU reference as a sanity check.
// The cases skip (saying why) on a machine without a CUDA device.
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/cuda-ops.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace perigee::test {
namespace {

int g_passed = 0, g_failed = 0;
void tally(bool ok) { (ok ? g_passed : g_failed)++; }

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the PDL ordering tests need the GPU machine"

#define CU(x)                                                                                           \
    do {                                                                                                \
        const cudaError_t e_ = (x);                                                                     \
        ASSERT_EQ(e_, cudaSuccess) << #x << ": " << cudaGetErrorString(e_);                             \
    } while (0)

struct dbuf {
    int * p = nullptr;
    size_t n = 0;
    explicit dbuf(size_t n_) : n(n_) { cudaMalloc(reinterpret_cast<void **>(&p), n * sizeof(int)); }
    ~dbuf() { cudaFree(p); }
    std::vector<int> host() const {
        std::vector<int> v(n);
        cudaMemcpy(v.data(), p, n * sizeof(int), cudaMemcpyDeviceToHost);
        return v;
    }
};

// The chain's host value: step j maps x to x * 3 + add_j + i (uint32 arithmetic, as the kernel).
std::vector<int> chain_host(const std::vector<int> & x0, int steps) {
    std::vector<int> x = x0, y(x0.size());
    for (int j = 0; j < steps; ++j) {
        for (size_t i = 0; i < x.size(); ++i) y[i] = int(unsigned(x[i]) * 3u + unsigned(j * 7 + 1) + unsigned(i));
        std::swap(x, y);
    }
    return x;
}
int64_t chain_spin(int j) { return j % 3 == 0 ? 20000 : 0; }   // ~10 us at ~2 GHz on every third step

// Enqueues the chain a -> b -> a -> ...; the result is in a when steps is even, else in b.
cudaError_t chain_enqueue(int * a, int * b, int64_t n, int steps, cudaStream_t st) {
    for (int j = 0; j < steps; ++j) {
        const cudaError_t e = j % 2 == 0 ? cuda::launch_pdl_probe_step(a, n, j * 7 + 1, chain_spin(j), b, st)
                                         : cuda::launch_pdl_probe_step(b, n, j * 7 + 1, chain_spin(j), a, st);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

TEST(cuda_pdl, probe_chain_bitwise_eager_and_graph) {
    NEED_GPU();
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    constexpr int steps = 256;   // even: the result ends in a
    for (int64_t n : {int64_t(4096), int64_t(1) << 22}) {
        std::vector<int> x0(static_cast<size_t>(n));
        for (size_t i = 0; i < x0.size(); ++i) x0[i] = int(i * 2654435761u);
        const std::vector<int> want = chain_host(x0, steps);
        dbuf a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
        auto run_once = [&](bool pdl) {
            const cuda::pdl_scope sc(pdl);
            cudaMemcpyAsync(a.p, x0.data(), size_t(n) * 4, cudaMemcpyHostToDevice, st);
            const cudaError_t e = chain_enqueue(a.p, b.p, n, steps, st);
            cudaStreamSynchronize(st);
            EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
            return a.host();
        };
        const std::vector<int> off = run_once(false);
        const std::string nm = "probe/n" + std::to_string(n);
        bool ok = check_bitwise(nm + "/no-pdl vs host", off.data(), want.data(), want.size() * 4);
        int bad_reps = 0;
        for (int rep = 0; rep < 20; ++rep) {
            const std::vector<int> on = run_once(true);
            bad_reps += std::memcmp(on.data(), want.data(), want.size() * 4) != 0;
        }
        std::printf("[%s/pdl eager] %d of 20 repetitions of %d steps differ from the host value (<= 0)\n", nm.c_str(), bad_reps,
                    steps);
        ok &= bad_reps == 0;

        // Graph: PDL launches captured as programmatic edges; replays bitwise equal.
        for (bool pdl : {true, false}) {
            const cuda::pdl_scope sc(pdl);
            CU(cudaMemcpy(a.p, x0.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
            cudaGraph_t gr = nullptr;
            CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            const cudaError_t ce = chain_enqueue(a.p, b.p, n, steps, st);
            CU(cudaStreamEndCapture(st, &gr));
            CU(ce);
            size_t ne = 0;
            CU(cudaGraphGetEdges(gr, nullptr, nullptr, nullptr, &ne));
            std::vector<cudaGraphNode_t> from(ne), to(ne);
            std::vector<cudaGraphEdgeData> ed(ne);
            if (ne) CU(cudaGraphGetEdges(gr, from.data(), to.data(), ed.data(), &ne));
            size_t prog = 0;
            for (const auto & e : ed) prog += e.type == cudaGraphDependencyTypeProgrammatic;
            const size_t want_prog = pdl ? size_t(steps - 1) : 0;
            std::printf("[%s/graph pdl=%d] %zu edges, %zu programmatic (want %zu)%s\n", nm.c_str(), int(pdl), ne, prog, want_prog,
                        ne && pdl ? (" first edge ports " + std::to_string(ed[0].from_port) + "->" + std::to_string(ed[0].to_port)).c_str()
                                  : "");
            ok &= prog == want_prog && ne == size_t(steps - 1);
            cudaGraphExec_t ex = nullptr;
            CU(cudaGraphInstantiate(&ex, gr, 0));
            int bad = 0;
            for (int rep = 0; rep < 10; ++rep) {
                CU(cudaMemcpyAsync(a.p, x0.data(), size_t(n) * 4, cudaMemcpyHostToDevice, st));
                CU(cudaGraphLaunch(ex, st));
                CU(cudaStreamSynchronize(st));
                const std::vector<int> r = a.host();
                bad += std::memcmp(r.data(), want.data(), want.size() * 4) != 0;
            }
            std::printf("[%s/graph pdl=%d] %d of 10 replays differ from the host value (<= 0)\n", nm.c_str(), int(pdl), bad);
            ok &= bad == 0;
            cudaGraphExecDestroy(ex);
            cudaGraphDestroy(gr);
        }
        EXPECT_TRUE(ok);
        tally(ok);
    }
    // Comparator control: one flipped element must be reported.
    std::vector<int> x0(64, 5), w = chain_host(x0, 4);
    std::vector<int> bad = w;
    bad[17] ^= 1;
    const bool ctl = check_bitwise("probe/control(one flipped element)", bad.data(), w.data(), w.size() * 4);
    EXPECT_FALSE(ctl);
    tally(!ctl);
    cudaStreamDestroy(st);
}

// Producer (triggers at once, spins, writes `value`) then consumer; returns how many of n elements the consumer saw stale.
int64_t consumer_stale(int * buf, int * out, int64_t n, bool pdl, bool wait, cudaStream_t st) {
    const cuda::pdl_scope sc(pdl);
    cudaMemsetAsync(buf, 0, size_t(n) * 4, st);
    cudaMemsetAsync(out, 0xff, size_t(n) * 4, st);
    cudaStreamSynchronize(st);
    cuda::launch_pdl_probe_producer(buf, n, 2000000, 1, st);   // ~1 ms at ~2 GHz
    cuda::launch_pdl_probe_consumer(buf, n, wait, out, st);
    const cudaError_t e = cudaStreamSynchronize(st);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    std::vector<int> h(static_cast<size_t>(n));
    cudaMemcpy(h.data(), out, size_t(n) * 4, cudaMemcpyDeviceToHost);
    int64_t stale = 0;
    for (int v : h) stale += v != 1;
    return stale;
}

TEST(cuda_pdl, control_consumer_without_wait) {
    NEED_GPU();
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    constexpr int64_t n = 4096;   // 16 blocks of each kernel: both grids fit on the GPU at once
    dbuf buf(n), out(n);
    constexpr int trials = 5;
    int stale_nowait = 0, stale_wait = 0, stale_plain = 0;
    int64_t max_nowait = 0;
    for (int t = 0; t < trials; ++t) {
        const int64_t s0 = consumer_stale(buf.p, out.p, n, true, false, st);
        stale_nowait += s0 > 0;
        max_nowait = std::max(max_nowait, s0);
        stale_wait += consumer_stale(buf.p, out.p, n, true, true, st) > 0;
        stale_plain += consumer_stale(buf.p, out.p, n, false, false, st) > 0;
    }
    std::printf("[pdl/control(consumer without pdl_wait, PDL)] stale reads in %d of %d trials (max %lld of %lld elements): "
                "must be > 0 (the control must FAIL the comparison)\n",
                stale_nowait, trials, (long long)max_nowait, (long long)n);
    std::printf("[pdl/consumer with pdl_wait, PDL] stale in %d of %d trials (<= 0)\n", stale_wait, trials);
    std::printf("[pdl/consumer without pdl_wait, no PDL] stale in %d of %d trials (<= 0)\n", stale_plain, trials);
    EXPECT_GT(stale_nowait, 0) << "a consumer without griddepcontrol.wait never saw stale data: either PDL did not take "
                                  "effect (the launch fell back to an ordinary one) or this GPU serialises anyway";
    EXPECT_EQ(stale_wait, 0);
    EXPECT_EQ(stale_plain, 0);
    tally(stale_nowait > 0);
    tally(stale_wait == 0);
    tally(stale_plain == 0);
    cudaStreamDestroy(st);
}

// ---- 3. the backend with cuda_options::pdl on and off ----

struct chain_graph {
    arena a;
    graph g;
    node_ref y, c;
};

void build_chain(chain_graph & cg, int T, int D, int layers) {
    rng r(9100 + uint32_t(T));
    builder bd(batch_simple(T));
    auto xv = r.vec(size_t(T * D));
    node_ref h = bd.name(bd.scale(bd.weight(cg.a.f32({T, D}, xv), "x"), 1.0f), "h0");
    for (int il = 0; il < layers; ++il) {
        auto nw = r.vec(size_t(D), 0.5f, 1.5f), wv = r.vec(size_t(D) * size_t(D), -0.05f, 0.05f);
        const node_ref n = bd.name(bd.rms_norm(h, bd.weight(cg.a.bf16({D}, nw), "nw" + std::to_string(il)), 1e-6f), "norm", il);
        const node_ref l = bd.name(bd.linear(n, bd.weight(cg.a.bf16({D, D}, wv), "w" + std::to_string(il))), "lin", il);
        const node_ref s = bd.name(bd.silu_mul(l, n), "silu_mul", il);
        const node_ref gt = bd.name(bd.sigmoid(h), "gate", il);
        const node_ref m = bd.name(bd.mul(gt, s), "mul", il);
        h = bd.name(bd.add(h, m), "res", il);
        if (il % 2 == 1) h = bd.name(bd.scale(bd.l2_norm(h, 1e-6f, 64), 8.0f), "l2", il);
    }
    cg.c = bd.name(bd.cols(h, 16, D / 2), "cols");
    cg.y = bd.name(bd.rms_norm(h, {}, 1e-6f), "y");
    cg.g = bd.finish(cg.y);
}

TEST(cuda_pdl, backend_graph_pdl_on_equals_off) {
    NEED_GPU();
    for (int T : {1, 4}) {
        chain_graph cg;
        build_chain(cg, T, 1024, 12);
        const std::string nm = "backend/T" + std::to_string(T);
        std::vector<float> eager[2], replay[2], cols[2];
        for (int pdl = 0; pdl < 2; ++pdl) {
            cuda_options o;
            o.pdl = pdl != 0;
            auto gpu = backend_cuda_init(0, o);
            gpu->check_supported(cg.g);
            gpu->run(cg.g);
            gpu->run(cg.g);
            eager[pdl] = read_f32(*gpu, cg.y);
            cols[pdl] = read_f32(*gpu, cg.c);
            gpu->capture(cg.g);
            gpu->replay(50);
            replay[pdl] = read_f32(*gpu, cg.y);
        }
        bool ok = check_bitwise(nm + "/eager pdl on vs off", eager[1].data(), eager[0].data(), eager[0].size() * 4);
        ok &= check_bitwise(nm + "/cols pdl on vs off", cols[1].data(), cols[0].data(), cols[0].size() * 4);
        ok &= check_bitwise(nm + "/replay x50 pdl on vs off", replay[1].data(), replay[0].data(), replay[0].size() * 4);
        ok &= check_bitwise(nm + "/replay vs eager (pdl on)", replay[1].data(), eager[1].data(), eager[1].size() * 4);
        // sanity: the CPU reference (a reordering would give NMSE ~1, not rounding-level differences)
        const auto ref = to_f64(run_f32(cg.g, cg.y));
        ok &= check(nm + "/vs cpu", ref, eager[1], metric::NMSE, 1e-5);
        EXPECT_TRUE(ok);
        tally(ok);
        if (T == 1) {
            std::vector<float> bad = eager[1];
            bad[bad.size() / 2] = std::nextafter(bad[bad.size() / 2], 1e30f);
            const bool ctl = check_bitwise(nm + "/control(one ulp)", bad.data(), eager[0].data(), eager[0].size() * 4);
            const bool ctl2 = check(nm + "/control(perturbed 10x)", ref, perturb(ref, eager[1], metric::NMSE, 1e-5),
                                    metric::NMSE, 1e-5);
            EXPECT_FALSE(ctl);
            EXPECT_FALSE(ctl2);
            tally(!ctl && !ctl2);
        }
    }
}

struct summary : ::testing::Environment {
    void TearDown() override { std::printf("test-pdl-cuda: %d passed, %d failed\n", g_passed, g_failed); }
};
const auto * g_env = ::testing::AddGlobalTestEnvironment(new summary);

} // namespace
} // namespace perigee::test
