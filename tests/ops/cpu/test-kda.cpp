// KDA ops: KDA_GATE, SHORT_CONV, KDA_SCAN (recurrence and chunked WY form) vs naive fp64, state write-back,
// untouched slots, packed vs separate sequences, and the op-level traps of ARCHITECTURE §4 (8, 9, 11, 12, 13, 16).
#include "harness.h"

namespace perigee::test {
namespace {

// ---------- KDA_GATE ----------
std::vector<double> naive_gate(const std::vector<float> & f, int T, int H, int K, const std::vector<float> & a_log,
                               const std::vector<float> & dt, double lb, int mutation) {
    std::vector<double> g(f.size());
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int d = 0; d < K; ++d) {
                const size_t i = size_t(t * H * K + h * K + d);
                const double bias = mutation == 2 ? 0.0 : mutation == 3 ? dt[size_t(d)] : dt[size_t(h * K + d)];
                const double xb = f[i] + bias;
                const double a = std::exp(double(a_log[size_t(h)]));
                if (lb < 0 && mutation != 1) g[i] = lb * sigmoid_d(a * xb);
                else g[i] = -a * softplus_d(xb);
            }
    return g;
}

// Traps 8 and 9: the lower-bound gate is lb*sigmoid(exp(A_log)*(f+dt_bias)); dt_bias sits inside, indexed h*K+d.
TEST(cpu_kda, gate_trap_8_lower_bound_and_trap_9_dt_bias) {
    rng r(201);
    const int T = 4, H = 3, K = 8;
    for (dtype dt : {dtype::F32, dtype::BF16}) {
        arena a;
        auto fv = r.vec(T * H * K, -3, 3), alog = r.vec(4, -1, 1), dtb = r.vec(H * K, -2, 2);
        alog[3] = 0.0f;   // A_log padded past H (read as H per-head values)
        tensor & F = a.f32({T, H * K}, fv);
        tensor & A = a.typed(dt, {4}, alog);
        tensor & B = a.typed(dt, {H * K}, dtb);
        builder bd(batch_simple(T));
        node_ref g_lb = bd.kda_gate(bd.weight(F, "f"), bd.weight(A, "A_log"), bd.weight(B, "dt_bias"), H, K, -5.0f);
        node_ref g_sp = bd.kda_gate(bd.weight(F, "f2"), bd.weight(A, "A_log2"), bd.weight(B, "dt_bias2"), H, K, 0.0f);
        graph g = bd.finish(g_lb);
        auto be = backend_cpu_init();
        be->run(g);
        auto out_lb = read_f32(*be, g_lb), out_sp = read_f32(*be, g_sp);
        const std::string tag = dtype_name(dt).data();
        EXPECT_TRUE(check("kda_gate lower bound " + tag, naive_gate(fv, T, H, K, alog, dtb, -5, 0), out_lb, metric::NMSE, k_nmse_f32));
        EXPECT_TRUE(check("kda_gate softplus " + tag, naive_gate(fv, T, H, K, alog, dtb, 0, 0), out_sp, metric::NMSE, k_nmse_f32));
        for (float v : out_lb) EXPECT_TRUE(v < 0.0f && v > -5.0f);
        // trap 8: a softplus gate where the lower-bound form is required must fail.
        EXPECT_FALSE(check("trap_8/mutation(softplus instead of lower bound)", naive_gate(fv, T, H, K, alog, dtb, -5, 1), out_lb,
                           metric::NMSE, k_nmse_f32));
        // trap 9: omitting dt_bias, or indexing it by d only, must fail.
        EXPECT_FALSE(check("trap_9/mutation(no dt_bias)", naive_gate(fv, T, H, K, alog, dtb, -5, 2), out_lb, metric::NMSE, k_nmse_f32));
        EXPECT_FALSE(check("trap_9/mutation(dt_bias[d])", naive_gate(fv, T, H, K, alog, dtb, -5, 3), out_lb, metric::NMSE, k_nmse_f32));
        expect_control_fails("kda_gate", naive_gate(fv, T, H, K, alog, dtb, -5, 0), out_lb, metric::NMSE, k_nmse_f32);
    }
}

// ---------- SHORT_CONV ----------
// x [T, C], w [C, W], hist [C, W-1] (oldest first) -> y; hist updated to the last W-1 inputs.
std::vector<double> naive_conv(const std::vector<float> & x, int T, int C, const std::vector<float> & w, int W,
                               std::vector<float> & hist, bool reversed_taps = false) {
    std::vector<double> y(size_t(T * C));
    for (int c = 0; c < C; ++c) {
        std::vector<float> s;   // full stream: history then inputs
        for (int j = 0; j < W - 1; ++j) s.push_back(hist[size_t(c * (W - 1) + j)]);
        for (int t = 0; t < T; ++t) s.push_back(x[size_t(t * C + c)]);
        for (int t = 0; t < T; ++t) {
            double acc = 0;
            for (int j = 0; j < W; ++j) {
                const int tap = reversed_taps ? W - 1 - j : j;
                acc += double(w[size_t(c * W + tap)]) * s[size_t(t + j)];   // s[t + W-1] is the current token
            }
            y[size_t(t * C + c)] = silu_d(acc);
        }
        for (int j = 0; j < W - 1; ++j) hist[size_t(c * (W - 1) + j)] = s[s.size() - size_t(W - 1) + size_t(j)];
    }
    return y;
}

struct conv_run {
    std::vector<float> y;
    tensor state;
};

// Runs SHORT_CONV on a batch; `state` is [n_slots, C, W-1] (copied in, returned updated).
conv_run run_conv(const std::vector<float> & xv, int C, std::vector<float> & wv, int W, dtype wdt, std::shared_ptr<batch> b,
                  const tensor & state0) {
    arena a;
    tensor & x = a.f32({int64_t(b->ids.size()), C}, xv);
    tensor & w = a.typed(wdt, {C, 1, W}, wv);
    tensor & st = a.raw(dtype::F32, state0.shape);
    std::memcpy(st.data, state0.data, st.nbytes);
    builder bd(b);
    node_ref y = bd.short_conv(bd.weight(x, "x"), bd.weight(w, "conv.weight"), bd.state(st, "conv_state"));
    graph g = bd.finish(y);
    conv_run r{run_f32(g, y), tensor_new(dtype::F32, st.shape)};
    std::memcpy(r.state.data, st.data, st.nbytes);
    return r;
}

TEST(cpu_kda, short_conv_with_history_and_state_write_back) {
    rng r(202);
    const int C = 12, W = 4;
    for (int T : {1, 2, 3, 9}) {   // T < W-1 exercises the shift of old history into the new state
        for (dtype wdt : {dtype::F32, dtype::BF16}) {
            auto xv = r.vec(size_t(T * C), -2, 2), wv = r.vec(size_t(C * W), -1, 1);
            tensor st0 = tensor_new(dtype::F32, {3, C, W - 1});
            for (int64_t i = 0; i < st0.numel(); ++i) st0.as<float>()[i] = r.uniform(-1, 1);
            auto b = batch_simple(T);
            b->slot = {1};
            if (wdt == dtype::BF16)   // round w like the tensor will
                for (auto & v : wv) v = bf16_round(v);
            auto res = run_conv(xv, C, wv, W, wdt, b, st0);
            std::vector<float> hist(st0.as<float>() + C * (W - 1), st0.as<float>() + 2 * C * (W - 1));
            auto ref = naive_conv(xv, T, C, wv, W, hist);
            const std::string tag = fmt::format("short_conv T={} {}", T, dtype_name(wdt));
            EXPECT_TRUE(check(tag, ref, res.y, metric::NMSE, k_nmse_f32));
            EXPECT_TRUE(check_bitwise(tag + " state slot 1", res.state.as<float>() + C * (W - 1), hist.data(), hist.size() * 4));
            EXPECT_TRUE(check_bitwise(tag + " untouched slot 0", res.state.as<float>(), st0.as<float>(), size_t(C * (W - 1)) * 4));
            EXPECT_TRUE(check_bitwise(tag + " untouched slot 2", res.state.as<float>() + 2 * C * (W - 1),
                                      st0.as<float>() + 2 * C * (W - 1), size_t(C * (W - 1)) * 4));
            if (T == 9 && wdt == dtype::F32) expect_control_fails("short_conv", ref, res.y, metric::NMSE, k_nmse_f32);
        }
    }
}

// Trap 16: tap W-1 is the current token, zero history at a sequence start, packed == separate.
TEST(cpu_kda, trap_16_conv_tap_order_zero_history_packed) {
    rng r(203);
    const int C = 8, W = 4, T1 = 7, T2 = 2;
    auto x1 = r.vec(T1 * C, -2, 2), x2 = r.vec(T2 * C, -2, 2), wv = r.vec(C * W, -1, 1);
    tensor st0 = tensor_new(dtype::F32, {2, C, W - 1});   // fresh slots: zeros
    // separate runs
    auto r1 = run_conv(x1, C, wv, W, dtype::F32, batch_simple(T1), st0);
    auto b2 = batch_simple(T2);
    b2->slot = {1};
    auto r2 = run_conv(x2, C, wv, W, dtype::F32, b2, st0);
    // packed run: seq 0 in slot 0 (T1 tokens), seq 1 in slot 1 (T2 tokens)
    auto bp = std::make_shared<batch>();
    bp->ids.assign(T1 + T2, 0);
    bp->seq_start = {0, T1, T1 + T2};
    bp->pos0 = {0, 0};
    bp->slot = {0, 1};
    std::vector<float> xp = x1;
    xp.insert(xp.end(), x2.begin(), x2.end());
    auto rp = run_conv(xp, C, wv, W, dtype::F32, bp, st0);
    std::vector<float> y_sep = r1.y;
    y_sep.insert(y_sep.end(), r2.y.begin(), r2.y.end());
    EXPECT_TRUE(check_bitwise("short_conv packed == separate (y)", rp.y.data(), y_sep.data(), y_sep.size() * 4));
    EXPECT_TRUE(check_bitwise("short_conv packed == separate (slot 0)", rp.state.as<float>(), r1.state.as<float>(), size_t(C * (W - 1)) * 4));
    EXPECT_TRUE(check_bitwise("short_conv packed == separate (slot 1)", rp.state.as<float>() + C * (W - 1),
                              r2.state.as<float>() + C * (W - 1), size_t(C * (W - 1)) * 4));
    // against naive with zero history; reversed taps must fail
    std::vector<float> h0(size_t(C * (W - 1)), 0.0f), h1 = h0;
    auto ref = naive_conv(x1, T1, C, wv, W, h0);
    EXPECT_TRUE(check("trap_16 conv zero history", ref, r1.y, metric::NMSE, k_nmse_f32));
    EXPECT_FALSE(check("trap_16/mutation(reversed taps)", naive_conv(x1, T1, C, wv, W, h1, true), r1.y, metric::NMSE, k_nmse_f32));
    // leakage mutation: seq 1 continuing from seq 0's tail instead of zeros must differ
    std::vector<float> leak = h0;   // h0 now holds seq 0's last inputs
    EXPECT_FALSE(check("trap_16/mutation(history leaks across sequences)", naive_conv(x2, T2, C, wv, W, leak), r2.y,
                       metric::NMSE, k_nmse_f32));
}

// ---------- KDA_SCAN ----------
struct kda_inputs {
    int T, H, K, V;
    std::vector<float> q, k, v, g, beta;
};

void l2_rows(std::vector<float> & x, int K) {
    for (size_t r = 0; r < x.size() / size_t(K); ++r) {
        double ss = 0;
        for (int i = 0; i < K; ++i) ss += double(x[r * K + i]) * x[r * K + i];
        for (int i = 0; i < K; ++i) x[r * K + i] = float(x[r * K + i] / std::sqrt(ss + 1e-6));
    }
}

kda_inputs make_kda(rng & r, int T, int H, int K, int V) {
    kda_inputs in{T, H, K, V, r.vec(size_t(T * H * K)), r.vec(size_t(T * H * K)), r.vec(size_t(T * H * V), -2, 2), {}, {}};
    l2_rows(in.q, K);
    l2_rows(in.k, K);
    for (int i = 0; i < T * H * K; ++i) in.g.push_back(float(-5.0 * sigmoid_d(r.uniform(-6, 2))));   // K3 gate range
    for (int i = 0; i < T * H; ++i) in.beta.push_back(float(sigmoid_d(r.uniform(-3, 3))));
    return in;
}

// Naive fp64 recurrence over tokens [t0, t1), S [H, K, V] (double) in/out, o [T, H*V].
// mutation 1: read o before the update; 2: delta update before the decay.
void naive_kda(const kda_inputs & in, int t0, int t1, double scale, std::vector<double> & S, std::vector<double> & o,
               int mutation = 0) {
    const int H = in.H, K = in.K, V = in.V;
    for (int t = t0; t < t1; ++t)
        for (int h = 0; h < H; ++h) {
            double * Sh = S.data() + size_t(h) * K * V;
            const float *q = &in.q[size_t((t * H + h) * K)], *k = &in.k[size_t((t * H + h) * K)];
            const float *v = &in.v[size_t((t * H + h) * V)], *g = &in.g[size_t((t * H + h) * K)];
            const double beta = in.beta[size_t(t * H + h)];
            auto decay = [&] {
                for (int d = 0; d < K; ++d)
                    for (int e = 0; e < V; ++e) Sh[d * V + e] *= std::exp(double(g[d]));
            };
            auto read = [&] {
                for (int e = 0; e < V; ++e) {
                    double acc = 0;
                    for (int d = 0; d < K; ++d) acc += Sh[d * V + e] * q[d] * scale;
                    o[size_t((t * H + h) * V + e)] = acc;
                }
            };
            auto delta = [&] {
                std::vector<double> u(static_cast<size_t>(V));
                for (int e = 0; e < V; ++e) {
                    double pred = 0;
                    for (int d = 0; d < K; ++d) pred += Sh[d * V + e] * k[d];
                    u[size_t(e)] = beta * (v[e] - pred);
                }
                for (int d = 0; d < K; ++d)
                    for (int e = 0; e < V; ++e) Sh[d * V + e] += k[d] * u[size_t(e)];
            };
            if (mutation == 2) { delta(); decay(); read(); }
            else if (mutation == 1) { decay(); read(); delta(); }
            else { decay(); delta(); read(); }
        }
}

// Runs KDA_SCAN for `b` on state `st` (in place); returns o.
std::vector<float> run_scan(const kda_inputs & in, std::shared_ptr<batch> b, tensor & st, float scale, int chunk) {
    arena a;
    const int T = in.T, H = in.H, K = in.K, V = in.V;
    auto q = in.q, k = in.k, v = in.v, g = in.g, beta = in.beta;
    tensor &Q = a.f32({T, H * K}, q), &Kt = a.f32({T, H * K}, k), &Vt = a.f32({T, H * V}, v), &G = a.f32({T, H * K}, g),
           &B = a.f32({T, H}, beta);
    builder bd(b);
    node_ref o = bd.kda_scan(bd.weight(Q, "q"), bd.weight(Kt, "k"), bd.weight(Vt, "v"), bd.weight(G, "g"), bd.weight(B, "beta"),
                             bd.state(st, "kda_state"), {H, K, V, scale, chunk});
    graph gr = bd.finish(o);
    return run_f32(gr, o);
}

tensor random_state(rng & r, int n_slots, int H, int K, int V) {
    tensor st = tensor_new(dtype::F32, {n_slots, H, K, V});
    for (int64_t i = 0; i < st.numel(); ++i) st.as<float>()[i] = r.uniform(-0.5f, 0.5f);
    return st;
}
tensor clone(const tensor & t) {
    tensor c = tensor_new(t.type, t.shape);
    std::memcpy(c.data, t.data, t.nbytes);
    return c;
}

// Recurrence and chunked form vs the fp64 naive loop, across chunk boundaries, from a nonzero slot state;
// final state written back to its slot; other slots untouched (bit-exact); skipping the write-back is detected.
TEST(cpu_kda, scan_vs_naive_recurrent_and_chunked_state_write_back) {
    const int H = 2, K = 16, V = 12;
    const float scale = 1.0f / std::sqrt(float(K));
    for (int T : {1, 3, 70, 131}) {
        rng r(uint32_t(300 + T));
        auto in = make_kda(r, T, H, K, V);
        tensor st0 = random_state(r, 3, H, K, V);
        const size_t slot_n = size_t(H * K * V);
        std::vector<double> S(st0.as<float>() + slot_n, st0.as<float>() + 2 * slot_n), o(size_t(T * H * V));
        naive_kda(in, 0, T, scale, S, o);
        std::vector<float> o_by_chunk[2];
        for (int ci = 0; ci < 2; ++ci) {
            const int chunk = ci ? 64 : 0;
            tensor st = clone(st0);
            auto b = batch_simple(T);
            b->slot = {1};
            auto out = run_scan(in, b, st, scale, chunk);
            o_by_chunk[ci] = out;
            const std::string tag = fmt::format("kda_scan T={} chunk={}", T, chunk);
            EXPECT_TRUE(check(tag + " o", o, out, metric::RMS_RATIO, k_rms_kda));
            std::vector<float> s_out(st.as<float>() + slot_n, st.as<float>() + 2 * slot_n);
            EXPECT_TRUE(check(tag + " final state", S, s_out, metric::RMS_RATIO, k_rms_kda));
            EXPECT_TRUE(check_bitwise(tag + " untouched slot 0", st.as<float>(), st0.as<float>(), slot_n * 4));
            EXPECT_TRUE(check_bitwise(tag + " untouched slot 2", st.as<float>() + 2 * slot_n, st0.as<float>() + 2 * slot_n, slot_n * 4));
            // control: a backend that skipped the write-back leaves the slot at its initial value.
            std::vector<float> skipped(st0.as<float>() + slot_n, st0.as<float>() + 2 * slot_n);
            EXPECT_FALSE(check(tag + "/control(skip state write-back)", S, skipped, metric::RMS_RATIO, k_rms_kda));
            if (T == 70) expect_control_fails("kda_scan", o, out, metric::RMS_RATIO, k_rms_kda);
        }
        // chunked vs recurrent (both fp32 paths): the same tolerance, measured
        EXPECT_TRUE(check(fmt::format("kda_scan T={} chunked vs recurrent", T), to_f64(o_by_chunk[0]), o_by_chunk[1],
                          metric::RMS_RATIO, k_rms_kda));
    }
}

// A continuation (prefill 70 then 61 more from the written state) equals one run of 131; decode T=1 steps too.
TEST(cpu_kda, scan_continuation_from_slot_state) {
    rng r(311);
    const int H = 2, K = 8, V = 8, T = 131, split = 70;
    auto in = make_kda(r, T, H, K, V);
    const float scale = 1.0f / std::sqrt(float(K));
    for (int chunk : {0, 64}) {
        tensor full = tensor_new(dtype::F32, {1, H, K, V});
        auto o_full = run_scan(in, batch_simple(T), full, scale, chunk);
        tensor part = tensor_new(dtype::F32, {1, H, K, V});
        auto first = in, second = in;
        auto cut = [&](kda_inputs & x, int a0, int a1) {
            auto sl = [&](std::vector<float> & v, int w) { v = std::vector<float>(v.begin() + a0 * w, v.begin() + a1 * w); };
            sl(x.q, H * K); sl(x.k, H * K); sl(x.g, H * K); sl(x.v, H * V); sl(x.beta, H);
            x.T = a1 - a0;
        };
        cut(first, 0, split);
        cut(second, split, T);
        auto o1 = run_scan(first, batch_simple(split), part, scale, chunk);
        auto b2 = batch_simple(T - split);
        b2->pos0 = {split};
        auto o2 = run_scan(second, b2, part, scale, chunk);
        o1.insert(o1.end(), o2.begin(), o2.end());
        EXPECT_TRUE(check(fmt::format("kda_scan continuation chunk={}", chunk), to_f64(o_full), o1, metric::RMS_RATIO, 1e-5));
        EXPECT_TRUE(check(fmt::format("kda_scan continuation state chunk={}", chunk), to_f64(to_vec(full)), to_vec(part),
                          metric::RMS_RATIO, 1e-5));
    }
}

// Packed prefill of two sequences of unequal lengths (conv + l2 + scan, distinct slots) == two separate runs.
TEST(cpu_kda, packed_two_sequences_equal_separate_runs) {
    rng r(312);
    const int H = 2, K = 8, V = 8, C = H * K, W = 4, L1 = 70, L2 = 5;
    auto xq = r.vec(size_t((L1 + L2) * C)), xk = r.vec(size_t((L1 + L2) * C)), xv = r.vec(size_t((L1 + L2) * H * V));
    auto wq = r.vec(size_t(C * W)), wk = r.vec(size_t(C * W)), wv = r.vec(size_t(H * V * W));
    std::vector<float> gv, bv;
    for (int i = 0; i < (L1 + L2) * C; ++i) gv.push_back(float(-5.0 * sigmoid_d(r.uniform(-6, 2))));
    for (int i = 0; i < (L1 + L2) * H; ++i) bv.push_back(float(sigmoid_d(r.uniform(-3, 3))));
    auto slice = [](const std::vector<float> & v, int w, int a0, int a1) {
        return std::vector<float>(v.begin() + a0 * w, v.begin() + a1 * w);
    };
    struct result { std::vector<float> o; tensor kda, cq, ck, cv; };
    auto run = [&](std::shared_ptr<batch> b, int a0, int a1, tensor kda, tensor cq, tensor ck, tensor cvs, int chunk) {
        arena a;
        const int T = a1 - a0;
        auto q = slice(xq, C, a0, a1), k = slice(xk, C, a0, a1), v = slice(xv, H * V, a0, a1), g = slice(gv, C, a0, a1),
             be = slice(bv, H, a0, a1);
        builder bd(b);
        auto conv = [&](std::vector<float> & x, int ch, std::vector<float> & w, tensor & st, const char * nm) {
            return bd.short_conv(bd.weight(a.f32({T, ch}, x), nm), bd.weight(a.f32({ch, 1, W}, w), nm), bd.state(st, nm));
        };
        node_ref qn = bd.l2_norm(conv(q, C, wq, cq, "q"), 1e-6f, K), kn = bd.l2_norm(conv(k, C, wk, ck, "k"), 1e-6f, K);
        node_ref vc = conv(v, H * V, wv, cvs, "v");
        node_ref o = bd.kda_scan(qn, kn, vc, bd.weight(a.f32({T, C}, g), "g"), bd.weight(a.f32({T, H}, be), "beta"),
                                 bd.state(kda, "kda"), {H, K, V, 1.0f / std::sqrt(float(K)), chunk});
        graph gr = bd.finish(o);
        return result{run_f32(gr, o), kda, cq, ck, cvs};
    };
    for (int chunk : {0, 64}) {
        auto fresh = [&](std::vector<int64_t> s) { return tensor_new(dtype::F32, s); };
        // packed: seq 0 (L1 tokens) in slot 1, seq 1 (L2 tokens) in slot 0
        auto bp = std::make_shared<batch>();
        bp->ids.assign(L1 + L2, 0);
        bp->seq_start = {0, L1, L1 + L2};
        bp->pos0 = {0, 0};
        bp->slot = {1, 0};
        auto P = run(bp, 0, L1 + L2, fresh({2, H, K, V}), fresh({2, C, W - 1}), fresh({2, C, W - 1}), fresh({2, H * V, W - 1}), chunk);
        auto b1 = batch_simple(L1);
        b1->slot = {1};
        auto S1 = run(b1, 0, L1, fresh({2, H, K, V}), fresh({2, C, W - 1}), fresh({2, C, W - 1}), fresh({2, H * V, W - 1}), chunk);
        auto b2 = batch_simple(L2);
        b2->slot = {0};
        auto S2 = run(b2, L1, L1 + L2, fresh({2, H, K, V}), fresh({2, C, W - 1}), fresh({2, C, W - 1}), fresh({2, H * V, W - 1}), chunk);
        std::vector<float> sep = S1.o;
        sep.insert(sep.end(), S2.o.begin(), S2.o.end());
        const std::string tag = fmt::format("packed == separate chunk={}", chunk);
        EXPECT_TRUE(check_bitwise(tag + " o", P.o.data(), sep.data(), sep.size() * 4));
        const size_t sn = size_t(H * K * V);
        EXPECT_TRUE(check_bitwise(tag + " kda slot 1", P.kda.as<float>() + sn, S1.kda.as<float>() + sn, sn * 4));
        EXPECT_TRUE(check_bitwise(tag + " kda slot 0", P.kda.as<float>(), S2.kda.as<float>(), sn * 4));
        const size_t cn = size_t(C * (W - 1));
        EXPECT_TRUE(check_bitwise(tag + " conv q slot 1", P.cq.as<float>() + cn, S1.cq.as<float>() + cn, cn * 4));
        EXPECT_TRUE(check_bitwise(tag + " conv k slot 0", P.ck.as<float>(), S2.ck.as<float>(), cn * 4));
    }
}

// Trap 11 (beta applied once), trap 12 (q/k L2-normalised, q scaled by K^-0.5, v not normalised):
// the graph of the KDA block (sigmoid on beta logits, l2_norm on q and k, scale in the scan) vs the from-spec
// naive loop, and mutations of the naive loop must fail.
TEST(cpu_kda, trap_11_beta_once_and_trap_12_qk_norm_scale) {
    rng r(313);
    const int T = 9, H = 2, K = 16, V = 8;
    auto in = make_kda(r, T, H, K, V);
    auto q_raw = r.vec(size_t(T * H * K), -3, 3), k_raw = r.vec(size_t(T * H * K), -3, 3), b_raw = r.vec(size_t(T * H), -3, 3);
    arena a;
    builder bd(batch_simple(T));
    tensor & st = a.raw(dtype::F32, {1, H, K, V});
    node_ref q = bd.l2_norm(bd.weight(a.f32({T, H * K}, q_raw), "q"), 1e-6f, K);
    node_ref k = bd.l2_norm(bd.weight(a.f32({T, H * K}, k_raw), "k"), 1e-6f, K);
    node_ref beta = bd.sigmoid(bd.weight(a.f32({T, H}, b_raw), "b_logits"));
    node_ref o = bd.kda_scan(q, k, bd.weight(a.f32({T, H * V}, in.v), "v"), bd.weight(a.f32({T, H * K}, in.g), "g"), beta,
                             bd.state(st, "kda"), {H, K, V, 1.0f / std::sqrt(float(K)), 0});
    graph g = bd.finish(o);
    auto out = run_f32(g, o);
    auto naive_from = [&](bool norm_qk, bool scale_q, bool norm_v, int beta_sig) {
        kda_inputs x = in;
        x.q = q_raw;
        x.k = k_raw;
        if (norm_qk) { l2_rows(x.q, K); l2_rows(x.k, K); }
        if (norm_v) l2_rows(x.v, V);
        for (size_t i = 0; i < x.beta.size(); ++i) {
            double bb = b_raw[i];
            for (int s = 0; s < beta_sig; ++s) bb = sigmoid_d(bb);
            x.beta[i] = float(bb);
        }
        std::vector<double> S(size_t(H * K * V), 0.0), oo(size_t(T * H * V));
        naive_kda(x, 0, T, scale_q ? 1.0 / std::sqrt(double(K)) : 1.0, S, oo);
        return oo;
    };
    EXPECT_TRUE(check("kda block (l2, sigmoid beta, scale)", naive_from(true, true, false, 1), out, metric::RMS_RATIO, k_rms_kda));
    EXPECT_FALSE(check("trap_11/mutation(beta sigmoid twice)", naive_from(true, true, false, 2), out, metric::RMS_RATIO, k_rms_kda));
    EXPECT_FALSE(check("trap_11/mutation(beta raw logits)", naive_from(true, true, false, 0), out, metric::RMS_RATIO, k_rms_kda));
    EXPECT_FALSE(check("trap_12/mutation(no q scale)", naive_from(true, false, false, 1), out, metric::RMS_RATIO, k_rms_kda));
    EXPECT_FALSE(check("trap_12/mutation(no l2 on q,k)", naive_from(false, true, false, 1), out, metric::RMS_RATIO, k_rms_kda));
    EXPECT_FALSE(check("trap_12/mutation(v normalised)", naive_from(true, true, true, 1), out, metric::RMS_RATIO, k_rms_kda));
}

// Trap 13: decay -> delta update -> read after the update; T = 1 and T = 3, random inputs and state.
TEST(cpu_kda, trap_13_recurrence_order) {
    const int H = 2, K = 8, V = 8;
    for (int T : {1, 3}) {
        rng r(uint32_t(320 + T));
        auto in = make_kda(r, T, H, K, V);
        tensor st0 = random_state(r, 1, H, K, V);
        for (int chunk : {0, 64}) {
            tensor st = clone(st0);
            auto out = run_scan(in, batch_simple(T), st, 0.5f, chunk);
            auto naive = [&](int mutation) {
                std::vector<double> S(st0.as<float>(), st0.as<float>() + st0.numel()), o(size_t(T * H * V));
                naive_kda(in, 0, T, 0.5, S, o, mutation);
                return o;
            };
            const std::string tag = fmt::format("trap_13 T={} chunk={}", T, chunk);
            EXPECT_TRUE(check(tag, naive(0), out, metric::RMS_RATIO, k_rms_kda));
            EXPECT_FALSE(check(tag + "/mutation(read before update)", naive(1), out, metric::RMS_RATIO, k_rms_kda));
            EXPECT_FALSE(check(tag + "/mutation(update before decay)", naive(2), out, metric::RMS_RATIO, k_rms_kda));
        }
    }
}

} // namespace
} // namespace perigee::test
