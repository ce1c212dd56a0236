// CUDA KDA_SCAN decode (issue 7): the v2 recurrent kernel (kda.cu k_kda_scan_v2, cuda_options::kda_decode_v2) vs the CPU
// reference (kda_scan_ref, the fp32 token recurrence) over SEVERAL CONSECUTIVE DECODE STEPS with the state kept on the
// device between steps (so the state each step writes back is exactly what the next one reads), at the 48B geometry
// (H=32) and K3's (H=96), K = V = 128, batch 1/5 (and 64 at the 48B), permuted slots; odd dims (K 32/80/200, V 44/48:
// partial tiles, every row-count instance); ragged multi-token steps; the v1 kernel on the same data; the backend dispatch (a KDA_SCAN graph run 3 times on the device-
// resident state, v2 on / off vs the CPU backend). Controls that must fail: a dropped state write-back (the device state
// restored after each step), one gate value perturbed, two sequences' slots swapped, and the comparator controls.
// Timing ("[timing]" lines, printed, never asserted): v1 vs v2 at both geometries, batch 1 and 64, eager back-to-back
// launches and inside a CUDA graph (PDL on).
//
// Tolerance: RMS(err)/RMS(ref) <= 2e-5 (test-kda-cuda's; both sides are fp32 with another summation order: ~1e-6 per
// step, the state carried over up to 8 steps).
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/kda-decode.h"
#include "dev-buffer.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <numeric>
#include <set>

namespace perigee::test {
namespace {

constexpr double k_tol = 2e-5;

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the KDA decode kernels run on the GPU machine"

struct dims {
    int H, K, V, n_slots;
    float lb;   // KDA_GATE lower bound: < 0 K3's form, 0 the 48B's softplus form
};

// One step's inputs. f (the gate projection) and the gate weights give g = KDA_GATE(f) on the CPU.
struct step_data {
    batch b;
    int T = 0;
    std::vector<float> q, k, v, f, g, beta;
};

struct gate_w {
    std::vector<float> a_log, dt_bias;
};

gate_w make_gate(rng & r, const dims & dm) {
    gate_w w;
    w.a_log = r.vec(size_t(dm.H), -1.0f, 1.0f);
    w.dt_bias = r.vec(size_t(dm.H) * dm.K, -1.0f, 1.0f);
    return w;
}

void l2_rows(std::vector<float> & x, int K) {
    for (size_t row = 0; row < x.size() / size_t(K); ++row) {
        double ss = 0;
        for (int i = 0; i < K; ++i) ss += double(x[row * K + i]) * x[row * K + i];
        const float inv = float(1.0 / std::sqrt(ss + 1e-6));
        for (int i = 0; i < K; ++i) x[row * K + i] *= inv;
    }
}

step_data make_step(rng & r, const dims & dm, const gate_w & gw, const std::vector<int> & lens, const std::vector<int> & slots,
                    int pos0) {
    step_data d;
    d.b.seq_start = {0};
    for (size_t s = 0; s < lens.size(); ++s) {
        d.b.seq_start.push_back(d.b.seq_start.back() + lens[s]);
        d.b.pos0.push_back(pos0 + int(s));
        d.b.slot.push_back(slots[s]);
    }
    d.T = d.b.seq_start.back();
    d.b.ids.assign(size_t(d.T), 0);
    const size_t TK = size_t(d.T) * dm.H * dm.K;
    d.q = r.vec(TK);
    d.k = r.vec(TK);
    l2_rows(d.q, dm.K);
    l2_rows(d.k, dm.K);
    d.v = r.vec(size_t(d.T) * dm.H * dm.V);
    d.f = r.vec(TK, -3.0f, 3.0f);
    d.g.resize(TK);
    kda_gate_ref(d.f.data(), d.T, dm.H, dm.K, wview{gw.a_log.data(), dtype::F32}, wview{gw.dt_bias.data(), dtype::F32}, dm.lb,
                 d.g.data());
    d.beta = r.vec(size_t(d.T) * dm.H);
    for (auto & x : d.beta) x = float(sigmoid_d(3.0 * x));
    return d;
}

struct gpu_batch {
    dev<int32_t> seq_start, pos0, slot;
    cuda::dbatch db;
    explicit gpu_batch(const batch & b) : seq_start(b.seq_start), pos0(b.pos0), slot(b.slot) {
        db.n_seq = b.n_seq();
        db.n_tok = b.n_tokens();
        db.seq_start = seq_start.p;
        db.pos0 = pos0.p;
        db.slot = slot.p;
        for (int s = 0; s < b.n_seq(); ++s) db.max_pos = std::max(db.max_pos, b.pos0[size_t(s)] + b.seq_len(s));
    }
};

enum class kern { v1, v2 };
const char * kern_name(kern k) { return k == kern::v1 ? "v1" : "v2"; }

// One step on the device state `st` (kept on the device between steps); returns o.
std::vector<float> gpu_step(kern kk, const dims & dm, const step_data & d, float scale, dev<float> & st) {
    dev<float> q(d.q), k(d.k), v(d.v), g(d.g), beta(d.beta), o(size_t(d.T) * dm.H * dm.V);
    cu(cudaMemset(o.p, 0xff, o.n * 4), "memset o");   // NaN: an unwritten output fails the comparison
    gpu_batch gb(d.b);
    if (kk == kern::v1) {
        cu(cuda::launch_kda_scan_recurrent(q.p, k.p, v.p, g.p, beta.p, dm.H, dm.K, dm.V, scale, st.p, gb.db, o.p, nullptr), "v1");
    } else {
        EXPECT_TRUE(cuda::kda_scan_v2_supported(dm.K, dm.V, v.p, st.p, o.p));
        cu(cuda::launch_kda_scan_v2(q.p, k.p, v.p, g.p, beta.p, dm.H, dm.K, dm.V, scale, st.p, gb.db, o.p, nullptr), "v2");
    }
    cu(cudaDeviceSynchronize(), "kda step");
    return o.down();
}

std::vector<float> slots_of(const dims & dm, const std::vector<float> & st, const std::set<int> & used, bool touched) {
    const size_t n = size_t(dm.H) * dm.K * dm.V;
    std::vector<float> r;
    for (int s = 0; s < dm.n_slots; ++s)
        if (used.count(s) == size_t(touched)) r.insert(r.end(), st.begin() + long(s * n), st.begin() + long((s + 1) * n));
    return r;
}

enum class fault { none, drop_writeback, gate_perturbed, slots_swapped };

// n_steps consecutive steps: the CPU reference (host state) vs kernel kk (device state, never re-uploaded). lens: tokens
// per sequence each step; slots permuted each step. Returns whether every comparison passed (expect = the caller's
// verdict; with a fault injected the run must fail).
bool run_steps(const std::string & tag, kern kk, const dims & dm, int n_steps, const std::vector<int> & lens, uint32_t seed,
               fault ft = fault::none) {
    rng r(seed);
    const float scale = 1.0f / std::sqrt(float(dm.K));
    const gate_w gw = make_gate(r, dm);
    std::vector<float> host_state = r.vec(size_t(dm.n_slots) * dm.H * dm.K * dm.V, -0.5f, 0.5f);
    const std::vector<float> init_state = host_state;
    dev<float> st(host_state);
    std::vector<int> perm(size_t(dm.n_slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::set<int> used;
    bool ok = true;
    for (int step = 0; step < n_steps; ++step) {
        std::shuffle(perm.begin(), perm.end(), r.gen);
        std::vector<int> slots(perm.begin(), perm.begin() + long(lens.size()));
        used.insert(slots.begin(), slots.end());
        step_data d = make_step(r, dm, gw, lens, slots, 100 + step);
        std::vector<float> o_ref(size_t(d.T) * dm.H * dm.V);
        kda_scan_ref(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), kda_dims{dm.H, dm.K, dm.V}, scale, 0,
                     host_state.data(), dm.n_slots, d.b, o_ref.data());
        step_data dg = d;
        if (ft == fault::gate_perturbed && step == n_steps - 1) {   // last step, sequence 0, head 1 (or 0), channel 5
            const size_t i = size_t(std::min(1, dm.H - 1)) * dm.K + 5;
            dg.f[i] = dg.f[i] > 0.0f ? -6.0f : 6.0f;
            kda_gate_ref(dg.f.data(), dg.T, dm.H, dm.K, wview{gw.a_log.data(), dtype::F32}, wview{gw.dt_bias.data(), dtype::F32},
                         dm.lb, dg.g.data());
        }
        if (ft == fault::slots_swapped && lens.size() >= 2) std::swap(dg.b.slot[0], dg.b.slot[1]);
        const std::vector<float> before = ft == fault::drop_writeback ? st.down() : std::vector<float>{};
        const std::vector<float> o = gpu_step(kk, dm, dg, scale, st);
        if (ft == fault::drop_writeback) st.up(before);   // the control: this step's state write-back lost
        ok &= check(fmt::format("{} step {} o", tag, step), to_f64(o_ref), o, metric::RMS_RATIO, k_tol);
    }
    const std::vector<float> got = st.down();
    ok &= check(tag + " final state (touched slots)", to_f64(slots_of(dm, host_state, used, true)), slots_of(dm, got, used, true),
                metric::RMS_RATIO, k_tol);
    const auto ua = slots_of(dm, init_state, used, false), ub = slots_of(dm, got, used, false);
    if (!ua.empty()) ok &= check_bitwise(tag + " untouched slots", ua.data(), ub.data(), ua.size() * 4);
    return ok;
}

const dims k_48b{32, 128, 128, 6, 0.0f};
const dims k_k3{96, 128, 128, 6, -5.0f};

TEST(cuda_kda_decode, v2_multi_step_48b_and_k3) {
    NEED_GPU();
    for (const auto & [name, dm] : {std::pair{"48B H=32", k_48b}, std::pair{"K3 H=96", k_k3}}) {
        for (int B : {1, 5}) {
            const std::vector<int> lens(size_t(B), 1);
            for (kern kk : {kern::v2, kern::v1}) {
                const std::string tag = fmt::format("kda-decode {} {} B={} 8 steps", kern_name(kk), name, B);
                EXPECT_TRUE(run_steps(tag, kk, dm, 8, lens, uint32_t(7000 + B + 10 * dm.H + 1000 * int(kk)))) << tag;
            }
        }
    }
}

TEST(cuda_kda_decode, v2_batch64_48b) {
    NEED_GPU();
    dims dm = k_48b;
    dm.n_slots = 70;
    const std::vector<int> lens(64, 1);
    EXPECT_TRUE(run_steps("kda-decode v2 48B B=64 3 steps", kern::v2, dm, 3, lens, 7100));
}

// Every rows-per-thread instance (K 16 -> 1, 32 -> 2, 64 -> 4, 80 -> 8 with 48 rows masked, 200 -> 16), partial column
// tiles (V 44, 48, 36), ragged multi-token steps, both gate forms (K3's lower bound, the 48B's softplus).
TEST(cuda_kda_decode, v2_odd_dims_and_ragged) {
    NEED_GPU();
    const std::vector<dims> ds = {{3, 16, 44, 5, -5.0f}, {3, 32, 48, 5, 0.0f}, {2, 64, 36, 5, -5.0f}, {3, 80, 44, 5, 0.0f},
                                  {2, 200, 72, 5, -5.0f}, {1, 128, 4, 5, 0.0f}};
    for (const dims & dm : ds) {
        for (kern kk : {kern::v2}) {
            const std::string tag = fmt::format("kda-decode {} H={} K={} V={} lb={}", kern_name(kk), dm.H, dm.K, dm.V, dm.lb);
            EXPECT_TRUE(run_steps(tag + " decode B=3 5 steps", kk, dm, 5, {1, 1, 1}, uint32_t(7200 + dm.K + dm.V))) << tag;
            EXPECT_TRUE(run_steps(tag + " ragged {3,1,7} 3 steps", kk, dm, 3, {3, 1, 7}, uint32_t(7300 + dm.K + dm.V))) << tag;
        }
    }
    // not supported: V % 4 != 0 and K > 256 are refused (the backend then runs v1)
    dev<float> buf(64);
    EXPECT_FALSE(cuda::kda_scan_v2_supported(128, 42, buf.p, buf.p, buf.p));
    EXPECT_FALSE(cuda::kda_scan_v2_supported(257, 128, buf.p, buf.p, buf.p));
    EXPECT_FALSE(cuda::kda_scan_v2_supported(128, 128, buf.p + 1, buf.p, buf.p));
    EXPECT_TRUE(cuda::kda_scan_v2_supported(256, 128, buf.p, buf.p, buf.p));
}

TEST(cuda_kda_decode, controls_must_fail) {
    NEED_GPU();
    const std::vector<int> lens = {1, 1, 1};
    for (kern kk : {kern::v2, kern::v1}) {
        const std::string base = fmt::format("kda-decode {} 48B B=3 4 steps", kern_name(kk));
        EXPECT_TRUE(run_steps(base, kk, k_48b, 4, lens, 7400));
        EXPECT_FALSE(run_steps(base + "/control(state write-back dropped)", kk, k_48b, 4, lens, 7400, fault::drop_writeback));
        EXPECT_FALSE(run_steps(base + "/control(one gate perturbed)", kk, k_48b, 4, lens, 7400, fault::gate_perturbed));
        EXPECT_FALSE(run_steps(base + "/control(slots of sequences 0 and 1 swapped)", kk, k_48b, 4, lens, 7400,
                               fault::slots_swapped));
    }
    // comparator controls on one v2 output
    rng r(7401);
    const gate_w gw = make_gate(r, k_48b);
    std::vector<float> host_state = r.vec(size_t(k_48b.n_slots) * k_48b.H * k_48b.K * k_48b.V, -0.5f, 0.5f);
    dev<float> st(host_state);
    const step_data d = make_step(r, k_48b, gw, {1, 1}, {4, 2}, 50);
    const float scale = 1.0f / std::sqrt(128.0f);
    std::vector<float> o_ref(size_t(d.T) * k_48b.H * k_48b.V);
    kda_scan_ref(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), kda_dims{k_48b.H, k_48b.K, k_48b.V}, scale, 0,
                 host_state.data(), k_48b.n_slots, d.b, o_ref.data());
    const std::vector<float> o = gpu_step(kern::v2, k_48b, d, scale, st);
    EXPECT_TRUE(check("kda-decode v2 one step o", to_f64(o_ref), o, metric::RMS_RATIO, k_tol));
    expect_control_fails("kda-decode v2 one step o", to_f64(o_ref), o, metric::RMS_RATIO, k_tol);
}

// The backend: a decode KDA_SCAN node (chunk_size 64, 2 sequences of 1 token) run 3 times on the device-resident state
// with kda_decode_v2 on and off, vs the CPU backend run 3 times.
TEST(cuda_kda_decode, backend_dispatch_three_runs) {
    NEED_GPU();
    rng r(7500);
    const dims dm{4, 128, 128, 3, -5.0f};
    const gate_w gw = make_gate(r, dm);
    const step_data d = make_step(r, dm, gw, {1, 1}, {2, 0}, 300);
    const std::vector<float> init = r.vec(size_t(dm.n_slots) * dm.H * dm.K * dm.V, -0.5f, 0.5f);
    const float scale = 1.0f / std::sqrt(float(dm.K));
    std::vector<std::vector<float>> ref_o;
    std::vector<float> ref_state;
    for (int v2 : {-1, 1, 0}) {   // -1: the CPU backend
        arena a;
        auto bp = std::make_shared<batch>(d.b);
        builder bd(bp);
        auto qv = d.q, kv = d.k, vv = d.v, gv = d.g, bv = d.beta;
        tensor &Q = a.f32({d.T, dm.H * dm.K}, qv), &Kt = a.f32({d.T, dm.H * dm.K}, kv), &Vt = a.f32({d.T, dm.H * dm.V}, vv),
               &G = a.f32({d.T, dm.H * dm.K}, gv), &B = a.f32({d.T, dm.H}, bv);
        tensor & st = a.f32({dm.n_slots, dm.H, dm.K, dm.V}, init);
        const node_ref o = bd.kda_scan(bd.weight(Q, "q"), bd.weight(Kt, "k"), bd.weight(Vt, "v"), bd.weight(G, "g"),
                                       bd.weight(B, "beta"), bd.state(st, "kda_state"), {dm.H, dm.K, dm.V, scale, 64});
        graph gr = bd.finish(o);
        std::unique_ptr<backend> be;
        backend_cuda * gpu = nullptr;
        if (v2 < 0) {
            be = backend_cpu_init();
        } else {
            cuda_options opt;
            opt.guard = true;
            opt.kda_decode_v2 = v2 == 1;
            auto g = backend_cuda_init(0, opt);
            gpu = g.get();
            be = std::move(g);
            be->check_supported(gr);
        }
        std::vector<std::vector<float>> outs;
        for (int run = 0; run < 3; ++run) {
            be->run(gr);
            outs.push_back(read_f32(*be, o));
        }
        if (gpu) gpu->sync_state_to_host();
        if (v2 < 0) {
            ref_o = outs;
            ref_state = to_vec(st);
            continue;
        }
        bool ok = true;
        for (int run = 0; run < 3; ++run)
            ok &= check(fmt::format("kda backend kda_decode_v2={} run {} o", v2, run), to_f64(ref_o[size_t(run)]),
                        outs[size_t(run)], metric::RMS_RATIO, k_tol);
        ok &= check(fmt::format("kda backend kda_decode_v2={} state after 3 runs", v2), to_f64(ref_state), to_vec(st),
                    metric::RMS_RATIO, k_tol);
        EXPECT_TRUE(ok) << v2;
        // control: the third run's output is not the first's (the state evolves between runs)
        EXPECT_FALSE(check(fmt::format("kda backend kda_decode_v2={}/control(run 0 output as run 2's)", v2),
                           to_f64(ref_o[2]), outs[0], metric::RMS_RATIO, k_tol));
    }
}

// The backend with the gate: KDA_GATE -> KDA_SCAN (decode, 3 sequences) run 3 times on the device-resident state with
// kda_decode_v2 on and off, vs the CPU backend: o, g (the gate node's output) and the state after 3 runs; both gate forms
// (K3's lower bound, 48B's).
TEST(cuda_kda_decode, backend_gate_three_runs) {
    NEED_GPU();
    for (float lb : {-5.0f, 0.0f}) {
        rng r(lb < 0 ? 7550 : 7551);
        const dims dm{4, 128, 128, 4, lb};
        const gate_w gw = make_gate(r, dm);
        const step_data d = make_step(r, dm, gw, {1, 1, 1}, {3, 0, 2}, 300);
        const std::vector<float> init = r.vec(size_t(dm.n_slots) * dm.H * dm.K * dm.V, -0.5f, 0.5f);
        const float scale = 1.0f / std::sqrt(float(dm.K));
        std::vector<std::vector<float>> ref_o;
        std::vector<float> ref_g, ref_state;
        for (int mode : {-1, 1, 0}) {   // -1: the CPU backend; else kda_decode_v2
            arena a;
            auto bp = std::make_shared<batch>(d.b);
            builder bd(bp);
            tensor &Q = a.f32({d.T, dm.H * dm.K}, d.q), &Kt = a.f32({d.T, dm.H * dm.K}, d.k), &Vt = a.f32({d.T, dm.H * dm.V}, d.v),
                   &F = a.f32({d.T, dm.H * dm.K}, d.f), &B = a.f32({d.T, dm.H}, d.beta), &AL = a.f32({dm.H}, gw.a_log),
                   &DB = a.f32({dm.H * dm.K}, gw.dt_bias);
            tensor & st = a.f32({dm.n_slots, dm.H, dm.K, dm.V}, init);
            const node_ref gn = bd.kda_gate(bd.weight(F, "f"), bd.weight(AL, "a_log"), bd.weight(DB, "dt_bias"), dm.H, dm.K, lb);
            const node_ref o = bd.kda_scan(bd.weight(Q, "q"), bd.weight(Kt, "k"), bd.weight(Vt, "v"), gn, bd.weight(B, "beta"),
                                           bd.state(st, "kda_state"), {dm.H, dm.K, dm.V, scale, 64});
            graph gr = bd.finish(o);
            std::unique_ptr<backend> be;
            backend_cuda * gpu = nullptr;
            if (mode < 0) {
                be = backend_cpu_init();
            } else {
                cuda_options opt;
                opt.guard = true;
                opt.kda_decode_v2 = mode == 1;
                auto g = backend_cuda_init(0, opt);
                gpu = g.get();
                be = std::move(g);
                be->check_supported(gr);
            }
            std::vector<std::vector<float>> outs;
            std::vector<float> gv;
            for (int run = 0; run < 3; ++run) {
                be->run(gr);
                outs.push_back(read_f32(*be, o));
                gv = read_f32(*be, gn);
            }
            if (gpu) gpu->sync_state_to_host();
            if (mode < 0) {
                ref_o = outs;
                ref_g = gv;
                ref_state = to_vec(st);
                continue;
            }
            const std::string tag = fmt::format("kda backend gate lb={} kda_decode_v2={}", lb, mode);
            bool ok = true;
            for (int run = 0; run < 3; ++run)
                ok &= check(fmt::format("{} run {} o", tag, run), to_f64(ref_o[size_t(run)]), outs[size_t(run)], metric::RMS_RATIO,
                            k_tol);
            ok &= check(tag + " g (gate node output)", to_f64(ref_g), gv, metric::RMS_RATIO, 1e-6);
            ok &= check(tag + " state after 3 runs", to_f64(ref_state), to_vec(st), metric::RMS_RATIO, k_tol);
            EXPECT_TRUE(ok) << tag;
            expect_control_fails(tag + " g", to_f64(ref_g), gv, metric::RMS_RATIO, 1e-6);
        }
    }
}

// Timing (printed, never asserted): per KDA_SCAN launch, decode (1 token per sequence), v1 vs v2, the 48B (H=32) and K3 (H=96) geometries, batch 1 and 64; eager (50 launches back to back on a stream, PDL on)
// and as a CUDA graph of 50 launches. Bytes: the state read + written once (2 x B x H x K x V x 4).
TEST(cuda_kda_decode, timing) {
    NEED_GPU();
    cudaStream_t sm;
    cu(cudaStreamCreateWithFlags(&sm, cudaStreamNonBlocking), "stream");
    cudaEvent_t e0, e1;
    cu(cudaEventCreate(&e0), "event");
    cu(cudaEventCreate(&e1), "event");
    for (const auto & [name, dm0] : {std::pair{"48B H=32", k_48b}, std::pair{"K3 H=96", k_k3}}) {
        for (int B : {1, 64}) {
            dims dm = dm0;
            dm.n_slots = B;
            rng r(uint32_t(7600 + B + dm.H));
            const gate_w gw = make_gate(r, dm);
            std::vector<int> slots(static_cast<size_t>(B));
            std::iota(slots.begin(), slots.end(), 0);
            const step_data d = make_step(r, dm, gw, std::vector<int>(size_t(B), 1), slots, 1024);
            dev<float> q(d.q), k(d.k), v(d.v), g(d.g), beta(d.beta), o(size_t(d.T) * dm.H * dm.V);
            dev<float> st(size_t(B) * dm.H * dm.K * dm.V);
            cu(cudaMemset(st.p, 0, st.n * 4), "memset state");
            gpu_batch gb(d.b);
            const float scale = 1.0f / std::sqrt(float(dm.K));
            const double bytes = 2.0 * double(st.n) * 4;
            double us[2][2] = {};
            for (int kk = 0; kk < 2; ++kk) {
                auto launch = [&] {
                    if (kk == 0)
                        cu(cuda::launch_kda_scan_recurrent(q.p, k.p, v.p, g.p, beta.p, dm.H, dm.K, dm.V, scale, st.p, gb.db,
                                                           o.p, sm),
                           "v1");
                    else
                        cu(cuda::launch_kda_scan_v2(q.p, k.p, v.p, g.p, beta.p, dm.H, dm.K, dm.V, scale, st.p, gb.db, o.p, sm),
                           "v2");
                };
                const int reps = 50;
                for (int i = 0; i < 3; ++i) launch();   // warm-up
                cu(cudaStreamSynchronize(sm), "warm-up");
                cu(cudaEventRecord(e0, sm), "record");
                for (int i = 0; i < reps; ++i) launch();
                cu(cudaEventRecord(e1, sm), "record");
                cu(cudaEventSynchronize(e1), "sync");
                float ms = 0;
                cu(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
                us[kk][0] = 1e3 * ms / reps;
                cudaGraph_t gr;
                cudaGraphExec_t ge;
                cu(cudaStreamBeginCapture(sm, cudaStreamCaptureModeThreadLocal), "capture");
                for (int i = 0; i < reps; ++i) launch();
                cu(cudaStreamEndCapture(sm, &gr), "end capture");
                cu(cudaGraphInstantiate(&ge, gr, 0), "instantiate");
                cu(cudaGraphLaunch(ge, sm), "graph warm-up");
                cu(cudaStreamSynchronize(sm), "graph warm-up");
                cu(cudaEventRecord(e0, sm), "record");
                cu(cudaGraphLaunch(ge, sm), "graph");
                cu(cudaEventRecord(e1, sm), "record");
                cu(cudaEventSynchronize(e1), "sync");
                cu(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
                us[kk][1] = 1e3 * ms / reps;
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(gr);
            }
            for (int kk = 0; kk < 2; ++kk)
                std::printf("[timing] kda_scan decode %s B=%d K=V=128 %-7s eager %8.2f us/launch, graph %8.2f us/launch "
                            "(%.0f GB/s state R+W)%s\n",
                            name, B, kk == 0 ? "v1" : "v2", us[kk][0], us[kk][1],
                            bytes / (us[kk][1] * 1e-6) / 1e9,
                            kk == 0 ? "" : fmt::format("  {:.1f}x v1 (graph)", us[0][1] / std::max(us[kk][1], 1e-3)).c_str());
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(sm);
}

} // namespace
} // namespace perigee::test
