// CUDA KDA_SCAN: the chunked WY kernels (backend/cuda/kda-chunked.cu) vs the CPU reference (kda_scan_ref: the chunked
// form with fp64 chunk internals, and the fp32 token recurrence) and vs the CUDA token recurrence, output o and the final
// state, over T in {1, 63, 64, 65, 200, 1000}, gates near the lower bound / near 0 / unbounded (48B softplus), resumed
// slot states (pos0 > 0) and a ragged packed batch of 3 sequences; then the backend dispatch
// (cuda_options::kda_chunk_min_tokens) on a graph; controls that must fail; and a timing (printed, never asserted).
//
// Tolerance: RMS(err)/RMS(ref) <= 2e-5 for o and state. Both sides are fp32 arithmetic; the expected difference is
// ~1e-6: dot products of 128 (and 64) fp32 terms (~sqrt(128) * 6e-8), exp2f (2 ulp), the fp32 cumulative log-decay
// (absolute error ~|Gamma| * 6e-8 in an exponent, so a relative error of that size only on factors close to 1, i.e.
// where |Gamma| is small), X = (I + M)^-1 with |M_ij| = beta |k_i.k_j| decay <= ~0.3 for random unit keys in 128-d
// (well conditioned), and the fp32 state carried over up to 16 chunks. 2e-5 is the CPU suite's chunk-vs-recurrence pin
// (k_rms_kda = 1e-5) with 2x more room for the GPU's different summation order; fla's bf16 bar (5e-3) would hide bugs.
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/cuda-ops.h"
#include "dev-buffer.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <set>

namespace perigee::test {
namespace {

constexpr double k_tol = 2e-5;   // RMS ratio, o and final state (reasoning in the header)

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the chunked KDA kernels run on the GPU machine"

enum class gate_kind { k3_mixed, near_lb, near_zero, softplus_deep };
const char * gate_name(gate_kind g) {
    switch (g) {
        case gate_kind::k3_mixed: return "k3-mixed";
        case gate_kind::near_lb: return "near-lower-bound";
        case gate_kind::near_zero: return "near-zero";
        default: return "softplus-deep";
    }
}

struct kda_data {
    int T = 0, H = 0, K = 0, V = 0, n_slots = 0;
    float scale = 0;
    std::vector<float> q, k, v, g, beta, state;
    batch b;
};

// lens/slots: the packed sequences; resumed: every slot starts from a random state and pos0 > 0 (else zero state).
kda_data make_data(uint32_t seed, const std::vector<int> & lens, const std::vector<int> & slots, int n_slots, int H, int K,
                   int V, gate_kind gk, bool resumed) {
    rng r(seed);
    kda_data d;
    d.H = H, d.K = K, d.V = V, d.n_slots = n_slots;
    d.scale = 1.0f / std::sqrt(float(K));
    d.b.seq_start = {0};
    for (size_t s = 0; s < lens.size(); ++s) {
        d.b.seq_start.push_back(d.b.seq_start.back() + lens[s]);
        d.b.pos0.push_back(resumed ? 37 + int(s) : 0);
        d.b.slot.push_back(slots[s]);
    }
    d.T = d.b.seq_start.back();
    d.b.ids.assign(size_t(d.T), 0);
    const size_t TK = size_t(d.T) * H * K;
    d.q = r.vec(TK);
    d.k = r.vec(TK);
    for (auto * x : {&d.q, &d.k})   // l2 per (token, head), eps 1e-6 as the model's L2_NORM
        for (size_t row = 0; row < size_t(d.T) * H; ++row) {
            double ss = 0;
            for (int i = 0; i < K; ++i) ss += double((*x)[row * K + i]) * (*x)[row * K + i];
            const float inv = float(1.0 / std::sqrt(ss + 1e-6));
            for (int i = 0; i < K; ++i) (*x)[row * K + i] *= inv;
        }
    d.v = r.vec(size_t(d.T) * H * V);
    d.g.resize(TK);
    for (auto & x : d.g) {
        switch (gk) {
            case gate_kind::k3_mixed: x = float(-5.0 * sigmoid_d(r.uniform(-4, 4))); break;
            case gate_kind::near_lb: x = float(-5.0 * sigmoid_d(r.uniform(5, 9))); break;      // (-5, -4.97)
            case gate_kind::near_zero: x = float(-5.0 * sigmoid_d(r.uniform(-14, -9))); break;  // (-6e-4, -4e-6)
            case gate_kind::softplus_deep: x = float(-std::exp(r.uniform(0, 2)) * softplus_d(r.uniform(-3, 3))); break;
        }
    }
    d.beta = r.vec(size_t(d.T) * H);
    for (auto & x : d.beta) x = float(sigmoid_d(3.0 * x));
    d.state.assign(size_t(n_slots) * H * K * V, 0.0f);
    std::set<int> used(slots.begin(), slots.end());
    for (int s = 0; s < n_slots; ++s)   // untouched slots always random (they must stay bitwise as they are)
        if (resumed || !used.count(s))
            for (size_t i = 0; i < size_t(H) * K * V; ++i) d.state[size_t(s) * H * K * V + i] = r.uniform(-0.5f, 0.5f);
    return d;
}

struct result {
    std::vector<float> o, state;
};

result run_cpu(const kda_data & d, int chunk) {
    result r{std::vector<float>(size_t(d.T) * d.H * d.V), d.state};
    kda_scan_ref(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), kda_dims{d.H, d.K, d.V}, d.scale, chunk,
                 r.state.data(), d.n_slots, d.b, r.o.data());
    return r;
}

struct gpu_batch {
    dev<int32_t> seq_start, pos0, slot;
    cuda::dbatch db;
    int max_len = 0;
    explicit gpu_batch(const batch & b) : seq_start(b.seq_start), pos0(b.pos0), slot(b.slot) {
        db.n_seq = b.n_seq();
        db.n_tok = b.n_tokens();
        db.seq_start = seq_start.p;
        db.pos0 = pos0.p;
        db.slot = slot.p;
        for (int s = 0; s < b.n_seq(); ++s) {
            max_len = std::max(max_len, b.seq_len(s));
            db.max_pos = std::max(db.max_pos, b.pos0[size_t(s)] + b.seq_len(s));
        }
    }
};

// One launch of the chunked (or recurrent) kernels; o starts as NaN so an unwritten output fails the comparison.
result run_gpu(const kda_data & d, bool chunked) {
    dev<float> q(d.q), k(d.k), v(d.v), g(d.g), beta(d.beta), st(d.state), o(size_t(d.T) * d.H * d.V);
    cu(cudaMemset(o.p, 0xff, o.n * 4), "memset");
    gpu_batch gb(d.b);
    if (chunked) {
        dev<float> scratch(size_t(cuda::kda_chunk_scratch_floats(d.T, d.b.n_seq(), d.H, d.K)));
        cu(cuda::launch_kda_scan_chunked(q.p, k.p, v.p, g.p, beta.p, d.H, d.K, d.V, d.scale, st.p, gb.db, gb.max_len,
                                         scratch.p, o.p, nullptr),
           "launch_kda_scan_chunked");
        cu(cudaDeviceSynchronize(), "chunked kernels");
    } else {
        cu(cuda::launch_kda_scan_recurrent(q.p, k.p, v.p, g.p, beta.p, d.H, d.K, d.V, d.scale, st.p, gb.db, o.p, nullptr),
           "launch_kda_scan_recurrent");
        cu(cudaDeviceSynchronize(), "recurrent kernel");
    }
    return {o.down(), st.down()};
}

std::vector<float> slots_of(const kda_data & d, const std::vector<float> & st, bool touched) {
    std::set<int> used(d.b.slot.begin(), d.b.slot.end());
    const size_t n = size_t(d.H) * d.K * d.V;
    std::vector<float> r;
    for (int s = 0; s < d.n_slots; ++s)
        if (used.count(s) == size_t(touched)) r.insert(r.end(), st.begin() + long(s * n), st.begin() + long((s + 1) * n));
    return r;
}

// The full comparison of one candidate against a reference: o, touched state (metric), untouched slots (bitwise).
bool compare_all(const std::string & tag, const kda_data & d, const result & ref, const result & cand, bool print_untouched = true) {
    bool ok = check(tag + " o", to_f64(ref.o), cand.o, metric::RMS_RATIO, k_tol);
    ok &= check(tag + " final state", to_f64(slots_of(d, ref.state, true)), slots_of(d, cand.state, true), metric::RMS_RATIO, k_tol);
    const auto ua = slots_of(d, d.state, false), ub = slots_of(d, cand.state, false);
    if (print_untouched || ua != ub) ok &= check_bitwise(tag + " untouched slots", ua.data(), ub.data(), ua.size() * 4);
    return ok;
}

// FNV-1a over the bytes of v: printed per case so that two builds whose kernels differ only in how they load (not in
// their arithmetic) can be shown to give the same bits (session 12: the state pass's cp.async tiles vs the first form).
uint64_t bits_hash(const std::vector<float> & v) {
    uint64_t h = 1469598103934665603ull;
    const auto * p = reinterpret_cast<const unsigned char *>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

// Chunked GPU vs CPU chunked (fp64 chunk internals) and vs the CUDA recurrence; the CPU recurrence printed for context.
void run_case(const std::string & tag, const kda_data & d) {
    const result ref = run_cpu(d, 64);
    const result gch = run_gpu(d, true);
    std::printf("[%s chunked-cuda bits] o %016llx state %016llx (info)\n", tag.c_str(),
                static_cast<unsigned long long>(bits_hash(gch.o)), static_cast<unsigned long long>(bits_hash(gch.state)));
    const result grec = run_gpu(d, false);
    EXPECT_TRUE(compare_all(tag + " chunked-cuda vs cpu", d, ref, gch)) << tag;
    EXPECT_TRUE(compare_all(tag + " chunked-cuda vs recurrent-cuda", d, grec, gch, false)) << tag;
    EXPECT_TRUE(compare_all(tag + " recurrent-cuda vs cpu", d, ref, grec, false)) << tag;
    if (d.T <= 200) {
        const result rrec = run_cpu(d, 0);
        check(tag + " (context) cpu recurrent vs cpu chunked", to_f64(ref.o), rrec.o, metric::RMS_RATIO, k_tol);
    }
}

// ---------------------------------------------------------------------------------------------------------------

TEST(cuda_kda, chunked_single_sequence_lengths_resumed_state) {
    NEED_GPU();
    for (int T : {1, 63, 64, 65, 200, 1000}) {
        const kda_data d = make_data(uint32_t(5000 + T), {T}, {1}, 3, 4, 128, 128, gate_kind::k3_mixed, true);
        run_case(fmt::format("kda-chunked T={} H=4 K=V=128 k3-mixed resumed", T), d);
    }
}

TEST(cuda_kda, chunked_gate_regimes) {
    NEED_GPU();
    for (gate_kind gk : {gate_kind::near_lb, gate_kind::near_zero, gate_kind::softplus_deep}) {
        for (int T : {65, 200}) {
            const kda_data d = make_data(uint32_t(5100 + T + 7 * int(gk)), {T}, {0}, 2, 4, 128, 128, gk, T == 200);
            run_case(fmt::format("kda-chunked T={} H=4 {} {}", T, gate_name(gk), T == 200 ? "resumed" : "fresh"), d);
        }
    }
    // fresh sequence (zero state) with gates near 0 over 1000 tokens: the state only accumulates
    const kda_data d = make_data(5199, {1000}, {0}, 1, 2, 128, 128, gate_kind::near_zero, false);
    run_case("kda-chunked T=1000 H=2 near-zero fresh", d);
}

// Ragged packed batch of 3 sequences resuming from saved slot states (pos0 > 0), plus the controls.
TEST(cuda_kda, chunked_ragged_batch_and_controls) {
    NEED_GPU();
    const std::vector<int> lens = {65, 1, 200}, slots = {2, 0, 3};
    const kda_data d = make_data(5300, lens, slots, 5, 4, 128, 128, gate_kind::k3_mixed, true);
    const std::string tag = "kda-chunked ragged {65,1,200} slots {2,0,3}/5 H=4 K=V=128 resumed";
    run_case(tag, d);
    // small odd dims: K = 32, V = 48 (partial V tile), lengths around one chunk
    const kda_data d2 = make_data(5301, {7, 70, 1}, {4, 1, 2}, 5, 3, 32, 48, gate_kind::k3_mixed, true);
    run_case("kda-chunked ragged {7,70,1} H=3 K=32 V=48 resumed", d2);

    const result ref = run_cpu(d, 64);
    const result gch = run_gpu(d, true);
    // control 1: the state write-back dropped (the touched slots keep their initial values) must fail the state check.
    {
        const bool pass = check(tag + "/control(state write-back dropped)", to_f64(slots_of(d, ref.state, true)),
                                slots_of(d, d.state, true), metric::RMS_RATIO, k_tol);
        EXPECT_FALSE(pass);
    }
    // control 2: one gate value perturbed (token 198 of 200 of sequence 2, head 1, channel 5) must fail o and the final
    // state (near the end, so that the decay of the following tokens has not erased it from the state).
    {
        kda_data p = d;
        const size_t i = (size_t(d.b.seq_start[2] + 198) * d.H + 1) * d.K + 5;
        p.g[i] = p.g[i] > -2.5f ? -4.9f : -0.05f;
        const result gp = run_gpu(p, true);
        const bool po = check(tag + "/control(one gate perturbed) o", to_f64(ref.o), gp.o, metric::RMS_RATIO, k_tol);
        const bool ps = check(tag + "/control(one gate perturbed) state", to_f64(slots_of(d, ref.state, true)),
                              slots_of(d, gp.state, true), metric::RMS_RATIO, k_tol);
        EXPECT_FALSE(po);
        EXPECT_FALSE(ps);
    }
    // control 3: two sequences swapped (slots of sequences 0 and 2 exchanged) must fail.
    {
        kda_data p = d;
        std::swap(p.b.slot[0], p.b.slot[2]);
        const result gp = run_gpu(p, true);
        const bool po = check(tag + "/control(sequences 0 and 2 swapped) o", to_f64(ref.o), gp.o, metric::RMS_RATIO, k_tol);
        EXPECT_FALSE(po);
    }
    // comparator controls: a 10x-threshold perturbation and a negative threshold must fail.
    expect_control_fails(tag + " o", to_f64(ref.o), gch.o, metric::RMS_RATIO, k_tol);
}

// The backend dispatch: a KDA_SCAN graph node with chunk_size 64 on the CUDA backend with kda_chunk_min_tokens = 1
// (chunked kernels) and 0 (recurrence), vs the CPU backend.
TEST(cuda_kda, backend_dispatch_chunked_vs_cpu) {
    NEED_GPU();
    const kda_data d = make_data(5400, {130, 9}, {1, 0}, 2, 2, 128, 128, gate_kind::k3_mixed, true);
    for (int min_tok : {1, 0}) {
        arena a;
        auto bp = std::make_shared<batch>(d.b);
        builder bd(bp);
        auto qv = d.q, kv = d.k, vv = d.v, gv = d.g, bv = d.beta;
        tensor &Q = a.f32({d.T, d.H * d.K}, qv), &Kt = a.f32({d.T, d.H * d.K}, kv), &Vt = a.f32({d.T, d.H * d.V}, vv),
               &G = a.f32({d.T, d.H * d.K}, gv), &B = a.f32({d.T, d.H}, bv);
        tensor & st = a.f32({d.n_slots, d.H, d.K, d.V}, d.state);
        const node_ref o = bd.kda_scan(bd.weight(Q, "q"), bd.weight(Kt, "k"), bd.weight(Vt, "v"), bd.weight(G, "g"),
                                       bd.weight(B, "beta"), bd.state(st, "kda_state"), {d.H, d.K, d.V, d.scale, 64});
        graph gr = bd.finish(o);
        auto cpu = backend_cpu_init();
        cpu->run(gr);
        const result ref{read_f32(*cpu, o), to_vec(st)};
        std::memcpy(st.data, d.state.data(), st.nbytes);
        cuda_options opt;
        opt.guard = true;
        opt.kda_chunk_min_tokens = min_tok;
        auto gpu = backend_cuda_init(0, opt);
        gpu->check_supported(gr);
        gpu->run(gr);
        gpu->sync_state_to_host();
        const result got{read_f32(*gpu, o), to_vec(st)};
        EXPECT_TRUE(compare_all(fmt::format("kda backend kda_chunk_min_tokens={} vs cpu backend", min_tok), d, ref, got))
            << min_tok;
    }
}

// Timing (printed, never asserted): one sequence, K = V = 128, chunked vs recurrent, H = 32 (48B) and 96 (K3).
TEST(cuda_kda, bench_prefill_chunked_vs_recurrent) {
    NEED_GPU();
    for (int H : {32, 96}) {
        for (int T : {512, 2048}) {
            const kda_data d = make_data(uint32_t(5500 + T + H), {T}, {0}, 1, H, 128, 128, gate_kind::k3_mixed, true);
            dev<float> q(d.q), k(d.k), v(d.v), g(d.g), beta(d.beta), st(d.state), o(size_t(d.T) * d.H * d.V);
            dev<float> scratch(size_t(cuda::kda_chunk_scratch_floats(d.T, 1, d.H, d.K)));
            gpu_batch gb(d.b);
            cudaEvent_t e0, e1;
            cu(cudaEventCreate(&e0), "event");
            cu(cudaEventCreate(&e1), "event");
            double ms[2] = {0, 0};
            for (int chunked : {1, 0}) {
                auto launch = [&] {
                    if (chunked)
                        cu(cuda::launch_kda_scan_chunked(q.p, k.p, v.p, g.p, beta.p, d.H, d.K, d.V, d.scale, st.p, gb.db,
                                                         gb.max_len, scratch.p, o.p, nullptr),
                           "chunked");
                    else
                        cu(cuda::launch_kda_scan_recurrent(q.p, k.p, v.p, g.p, beta.p, d.H, d.K, d.V, d.scale, st.p, gb.db,
                                                           o.p, nullptr),
                           "recurrent");
                };
                launch();   // warm-up
                cu(cudaDeviceSynchronize(), "warm-up");
                const int reps = 5;
                cu(cudaEventRecord(e0), "record");
                for (int i = 0; i < reps; ++i) launch();
                cu(cudaEventRecord(e1), "record");
                cu(cudaEventSynchronize(e1), "sync");
                float t = 0;
                cu(cudaEventElapsedTime(&t, e0, e1), "elapsed");
                ms[chunked] = t / reps;
            }
            std::printf("[bench] kda_scan T=%d H=%d K=V=128: chunked %.3f ms, recurrent %.3f ms (%.1fx)\n", T, H, ms[1], ms[0],
                        ms[0] / std::max(ms[1], 1e-6));
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
        }
    }
}

} // namespace
} // namespace perigee::test
