// Plain ops: GET_ROWS, RMS_NORM, LAYER_NORM, L2_NORM, LINEAR, ADD, MUL, SCALE, SIGMOID, SILU_MUL, SITU_MUL,
// COLS, GATED_RMS_NORM, plus dispatch errors. CPU backend vs naive fp64, NMSE <= 1e-7.
#include "harness.h"

namespace perigee::test {
namespace {

TEST(cpu_ops, get_rows_f32_bf16_f16) {
    rng r(101);
    const int V = 17, D = 24, T = 9;
    for (dtype dt : {dtype::F32, dtype::BF16, dtype::F16}) {
        arena a;
        auto tv = r.vec(V * D);
        tensor & table = a.typed(dt, {V, D}, tv);
        auto b = batch_simple(T);
        for (int t = 0; t < T; ++t) b->ids[size_t(t)] = r.randint(0, V - 1);
        builder bd(b);
        node_ref y = bd.get_rows(bd.weight(table, "tok_embd"), bd.ids());
        graph g = bd.finish(y);
        auto out = run_f32(g, y);
        std::vector<double> ref(size_t(T * D));
        for (int t = 0; t < T; ++t)
            for (int d = 0; d < D; ++d) ref[size_t(t * D + d)] = tv[size_t(b->ids[size_t(t)] * D + d)];
        EXPECT_TRUE(check(fmt::format("get_rows {}", dtype_name(dt)), ref, out, metric::NMSE, 0.0));   // exact copy
    }
}

TEST(cpu_ops, get_rows_rejects_out_of_range_id) {
    arena a;
    std::vector<float> tv(4 * 3, 1.0f);
    tensor & table = a.f32({4, 3}, tv);
    auto b = batch_simple(2);
    b->ids = {1, 7};
    builder bd(b);
    node_ref y = bd.name(bd.get_rows(bd.weight(table, "tok_embd"), bd.ids()), "embed");
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    try {
        be->run(g);
        FAIL() << "an id outside the table must be an error";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("embed"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
    }
}

std::vector<double> naive_rms(const std::vector<float> & x, int64_t N, const std::vector<float> * w, double eps) {
    std::vector<double> y(x.size());
    for (size_t r = 0; r < x.size() / size_t(N); ++r) {
        double ss = 0;
        for (int64_t i = 0; i < N; ++i) ss += double(x[r * N + i]) * x[r * N + i];
        const double inv = 1.0 / std::sqrt(ss / double(N) + eps);
        for (int64_t i = 0; i < N; ++i) y[r * N + i] = x[r * N + i] * inv * (w ? (*w)[size_t(i)] : 1.0);
    }
    return y;
}

TEST(cpu_ops, rms_norm_weight_bf16_f32_none_and_grouped) {
    rng r(102);
    const int T = 7, D = 64;
    auto xv = r.vec(T * D, -3, 3);
    for (int variant = 0; variant < 4; ++variant) {   // 0: F32 w, 1: BF16 w, 2: no weight, 3: per-head group 16 BF16
        arena a;
        const int64_t n = variant == 3 ? 16 : D;
        auto wv = r.vec(size_t(n), 0.5f, 1.5f);
        tensor & x = a.f32({T, D}, xv);
        tensor & w = variant == 0 ? a.f32({n}, wv) : a.bf16({n}, wv);
        builder bd(batch_simple(T));
        node_ref wr = variant == 2 ? node_ref{} : bd.weight(w, "norm.weight");
        node_ref y = bd.rms_norm(bd.weight(x, "x"), wr, 1e-5f, variant == 3 ? 16 : 0);
        graph g = bd.finish(y);
        auto out = run_f32(g, y);
        auto ref = naive_rms(xv, n, variant == 2 ? nullptr : &wv, 1e-5);
        EXPECT_TRUE(check(fmt::format("rms_norm variant {}", variant), ref, out, metric::NMSE, k_nmse_f32));
        if (variant == 0) expect_control_fails("rms_norm", ref, out, metric::NMSE, k_nmse_f32);
    }
}

TEST(cpu_ops, layer_norm_biased_variance) {
    rng r(103);
    const int T = 5, D = 128;
    arena a;
    auto xv = r.vec(T * D, -2, 4), wv = r.vec(D, 0.5, 1.5), bv = r.vec(D, -0.5, 0.5);
    tensor &x = a.f32({T, D}, xv), &w = a.bf16({D}, wv), &bb = a.f32({D}, bv);
    builder bd(batch_simple(T));
    node_ref y = bd.layer_norm(bd.weight(x, "x"), bd.weight(w, "w"), bd.weight(bb, "b"), 1e-6f);
    graph g = bd.finish(y);
    auto out = run_f32(g, y);
    std::vector<double> ref(xv.size());
    for (int t = 0; t < T; ++t) {
        double m = 0, v = 0;
        for (int i = 0; i < D; ++i) m += xv[size_t(t * D + i)];
        m /= D;
        for (int i = 0; i < D; ++i) v += (xv[size_t(t * D + i)] - m) * (xv[size_t(t * D + i)] - m);
        v /= D;   // biased
        for (int i = 0; i < D; ++i) ref[size_t(t * D + i)] = (xv[size_t(t * D + i)] - m) / std::sqrt(v + 1e-6) * wv[size_t(i)] + bv[size_t(i)];
    }
    EXPECT_TRUE(check("layer_norm", ref, out, metric::NMSE, k_nmse_f32));
}

TEST(cpu_ops, l2_norm_per_head) {
    rng r(104);
    const int T = 4, H = 3, K = 32;
    arena a;
    auto xv = r.vec(T * H * K);
    tensor & x = a.f32({T, H * K}, xv);
    builder bd(batch_simple(T));
    node_ref y = bd.l2_norm(bd.weight(x, "x"), 1e-6f, K);
    graph g = bd.finish(y);
    auto out = run_f32(g, y);
    std::vector<double> ref(xv.size());
    for (int r0 = 0; r0 < T * H; ++r0) {
        double ss = 0;
        for (int i = 0; i < K; ++i) ss += double(xv[size_t(r0 * K + i)]) * xv[size_t(r0 * K + i)];
        for (int i = 0; i < K; ++i) ref[size_t(r0 * K + i)] = xv[size_t(r0 * K + i)] / std::sqrt(ss + 1e-6);
    }
    EXPECT_TRUE(check("l2_norm", ref, out, metric::NMSE, k_nmse_f32));
}

TEST(cpu_ops, linear_f32_bf16_f16) {
    rng r(105);
    const int T = 6, IN = 96, OUT = 40;
    auto xv = r.vec(T * IN);
    for (dtype dt : {dtype::F32, dtype::BF16, dtype::F16}) {
        arena a;
        auto wv = r.vec(OUT * IN);
        tensor & x = a.f32({T, IN}, xv);
        tensor & w = a.typed(dt, {OUT, IN}, wv);
        builder bd(batch_simple(T));
        node_ref y = bd.linear(bd.weight(x, "x"), bd.weight(w, "w"));
        graph g = bd.finish(y);
        auto out = run_f32(g, y);
        std::vector<double> ref(size_t(T * OUT));
        for (int t = 0; t < T; ++t)
            for (int o = 0; o < OUT; ++o) {
                double acc = 0;
                for (int i = 0; i < IN; ++i) acc += double(xv[size_t(t * IN + i)]) * wv[size_t(o * IN + i)];
                ref[size_t(t * OUT + o)] = acc;
            }
        EXPECT_TRUE(check(fmt::format("linear {}", dtype_name(dt)), ref, out, metric::NMSE, k_nmse_f32));
        if (dt == dtype::BF16) expect_control_fails("linear", ref, out, metric::NMSE, k_nmse_f32);
    }
}

// op_params::bf16_inputs (ARCHITECTURE 3.0): x rounded to bf16 (nearest even) before the product, the result fp32. The
// fp64 reference rounds x the same way; bit for bit the unflagged LINEAR over a pre-rounded x. Controls that must FAIL:
// the fp64 reference on the unrounded x, and the unflagged LINEAR's bits.
TEST(cpu_ops, linear_bf16_inputs_round_x_first) {
    rng r(106);
    const int T = 5, IN = 200, OUT = 24;
    auto xv = r.vec(T * IN);
    std::vector<float> xr(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) xr[i] = bf16_round(xv[i]);
    for (dtype dt : {dtype::F32, dtype::BF16}) {
        arena a;
        auto wv = r.vec(OUT * IN);
        tensor & w = a.typed(dt, {OUT, IN}, wv);
        auto run = [&](const std::vector<float> & xin, bool flag) {
            builder bd(batch_simple(T));
            bd.bf16_inputs(flag);
            node_ref y = bd.linear(bd.weight(a.f32({T, IN}, xin), "x"), bd.weight(w, "w"));
            graph g = bd.finish(y);
            EXPECT_EQ(g.at(y).p.bf16_inputs, flag);
            return run_f32(g, y);
        };
        const auto out = run(xv, true);
        auto naive = [&](const std::vector<float> & xin) {
            std::vector<double> ref(size_t(T * OUT));
            for (int t = 0; t < T; ++t)
                for (int o = 0; o < OUT; ++o) {
                    double acc = 0;
                    for (int i = 0; i < IN; ++i) acc += double(xin[size_t(t * IN + i)]) * double(wv[size_t(o * IN + i)]);
                    ref[size_t(t * OUT + o)] = acc;
                }
            return ref;
        };
        const std::string tag = fmt::format("linear bf16 inputs {}", dtype_name(dt));
        EXPECT_TRUE(check(tag, naive(xr), out, metric::NMSE, k_nmse_f32));
        EXPECT_FALSE(check(tag + "/control(unrounded x)", naive(xv), out, metric::NMSE, k_nmse_f32));
        const auto pre = run(xr, false), plain = run(xv, false);
        EXPECT_EQ(std::memcmp(pre.data(), out.data(), out.size() * 4), 0) << tag << ": not the LINEAR over a pre-rounded x";
        EXPECT_NE(std::memcmp(plain.data(), out.data(), out.size() * 4), 0) << tag << ": the flag changed nothing";
    }
}

TEST(cpu_ops, linear_unsupported_weight_dtype_names_node) {
    arena a;
    std::vector<float> xv(8, 1.0f);
    tensor & x = a.f32({2, 4}, xv);
    tensor & w = a.raw(dtype::I8, {3, 4});
    builder bd(batch_simple(2));
    node_ref y = bd.name(bd.linear(bd.weight(x, "x"), bd.weight(w, "blk.0.attn_q.weight")), "attn_q", 0);
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    try {
        be->check_supported(g);
        FAIL() << "an I8 weight must be rejected";
    } catch (const error & e) {
        const std::string m = e.what();
        std::printf("error: %s\n", m.c_str());
        EXPECT_NE(m.find("unsupported"), std::string::npos);
        EXPECT_NE(m.find("blk.0.attn_q"), std::string::npos);
        EXPECT_NE(m.find("I8"), std::string::npos);
    }
}

TEST(cpu_ops, elementwise_add_mul_scale_sigmoid_silu_mul_cols) {
    rng r(106);
    const int T = 5, N = 33;
    arena a;
    auto av = r.vec(T * N, -4, 4), bv = r.vec(T * N, -4, 4);
    tensor &A = a.f32({T, N}, av), &B = a.f32({T, N}, bv);
    builder bd(batch_simple(T));
    node_ref ra = bd.weight(A, "a"), rb = bd.weight(B, "b");
    node_ref y_add = bd.add(ra, rb), y_mul = bd.mul(ra, rb), y_sc = bd.scale(ra, -0.37f), y_sig = bd.sigmoid(ra),
             y_silu = bd.silu_mul(ra, rb), y_cols = bd.cols(ra, 7, 11);
    graph g = bd.finish(y_cols);
    auto be = backend_cpu_init();
    be->run(g);
    std::vector<double> r_add, r_mul, r_sc, r_sig, r_silu, r_cols;
    for (int i = 0; i < T * N; ++i) {
        const double x = av[size_t(i)], y = bv[size_t(i)];
        r_add.push_back(x + y);
        r_mul.push_back(x * y);
        r_sc.push_back(x * double(-0.37f));
        r_sig.push_back(sigmoid_d(x));
        r_silu.push_back(silu_d(x) * y);
    }
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < 11; ++j) r_cols.push_back(av[size_t(t * N + 7 + j)]);
    EXPECT_TRUE(check("add", r_add, read_f32(*be, y_add), metric::NMSE, k_nmse_f32));
    EXPECT_TRUE(check("mul", r_mul, read_f32(*be, y_mul), metric::NMSE, k_nmse_f32));
    EXPECT_TRUE(check("scale", r_sc, read_f32(*be, y_sc), metric::NMSE, k_nmse_f32));
    EXPECT_TRUE(check("sigmoid", r_sig, read_f32(*be, y_sig), metric::NMSE, k_nmse_f32));
    EXPECT_TRUE(check("silu_mul", r_silu, read_f32(*be, y_silu), metric::NMSE, k_nmse_f32));
    EXPECT_TRUE(check("cols", r_cols, read_f32(*be, y_cols), metric::NMSE, 0.0));
    expect_control_fails("silu_mul", r_silu, read_f32(*be, y_silu), metric::NMSE, k_nmse_f32);
}

// SELECT_ROWS keeps the rows batch::logits_rows lists, in that order (the final norm and lm_head run
// only on them).
TEST(cpu_ops, select_rows_follows_logits_rows) {
    rng r(107);
    const int T = 6, N = 9;
    arena a;
    auto av = r.vec(T * N, -4, 4);
    tensor & A = a.f32({T, N}, av);
    auto b = std::make_shared<batch>(*batch_simple(T));
    b->logits_rows = {5, 0, 3};
    builder bd(b);
    node_ref y = bd.select_rows(bd.weight(A, "a"));
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    be->run(g);
    std::vector<double> ref;
    for (int row : b->logits_rows)
        for (int j = 0; j < N; ++j) ref.push_back(av[size_t(row * N + j)]);
    EXPECT_TRUE(check("select_rows", ref, read_f32(*be, y), metric::NMSE, 0.0));
    expect_control_fails("select_rows", ref, read_f32(*be, y), metric::NMSE, k_nmse_f32);
}

double naive_situ(double a, double b, double beta, double lam) {
    const double gate = beta * std::tanh(a / beta) * sigmoid_d(a);
    return gate * (lam > 0 ? lam * std::tanh(b / lam) : b);
}

// Trap 28: SiTU constants (beta = 4 on the gate, lambda = 25 on up), gate = first input; values from §3.0/§4.
TEST(cpu_ops, trap_28_situ_values_and_gate_up_order) {
    arena a;
    std::vector<float> gv = {1.0f, -3.0f, 10.0f}, uv = {1.0f, 2.0f, 10.0f};
    tensor &G = a.f32({1, 3}, gv), &U = a.f32({1, 3}, uv);
    builder bd(batch_simple(1));
    node_ref y = bd.situ_mul(bd.weight(G, "g"), bd.weight(U, "u"), 4.0f, 25.0f);
    node_ref y_swap = bd.situ_mul(bd.weight(U, "u2"), bd.weight(G, "g2"), 4.0f, 25.0f);
    node_ref y_nolam = bd.situ_mul(bd.weight(G, "g3"), bd.weight(U, "u3"), 4.0f, 0.0f);
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    be->run(g);
    auto out = read_f32(*be, y);
    std::printf("SiTU(1,1)=%.5f SiTU(-3,2)=%.5f SiTU(10,10)=%.3f\n", out[0], out[1], out[2]);
    EXPECT_NEAR(out[0], 0.71582, 1e-5);
    EXPECT_NEAR(out[1], -0.24047, 1e-5);
    EXPECT_NEAR(out[2], 37.485, 1e-3);
    std::vector<double> ref;
    for (int i = 0; i < 3; ++i) ref.push_back(naive_situ(gv[size_t(i)], uv[size_t(i)], 4, 25));
    EXPECT_TRUE(check("situ_mul", ref, out, metric::NMSE, k_nmse_f32));
    // Mutation: gate/up swapped must fail the comparison.
    EXPECT_FALSE(check("situ_mul/mutation(gate<->up)", ref, read_f32(*be, y_swap), metric::NMSE, k_nmse_f32));
    // lambda absent: the up factor is u itself.
    std::vector<double> ref_nolam;
    for (int i = 0; i < 3; ++i) ref_nolam.push_back(naive_situ(gv[size_t(i)], uv[size_t(i)], 4, 0));
    EXPECT_TRUE(check("situ_mul no lambda", ref_nolam, read_f32(*be, y_nolam), metric::NMSE, k_nmse_f32));
}

TEST(cpu_ops, situ_mul_random) {
    rng r(107);
    const int T = 4, N = 50;
    arena a;
    auto gv = r.vec(T * N, -12, 12), uv = r.vec(T * N, -60, 60);
    tensor &G = a.f32({T, N}, gv), &U = a.f32({T, N}, uv);
    builder bd(batch_simple(T));
    node_ref y = bd.situ_mul(bd.weight(G, "g"), bd.weight(U, "u"), 4.0f, 25.0f);
    graph g = bd.finish(y);
    auto out = run_f32(g, y);
    std::vector<double> ref;
    for (int i = 0; i < T * N; ++i) ref.push_back(naive_situ(gv[size_t(i)], uv[size_t(i)], 4, 25));
    EXPECT_TRUE(check("situ_mul random", ref, out, metric::NMSE, k_nmse_f32));
    expect_control_fails("situ_mul", ref, out, metric::NMSE, k_nmse_f32);
}

std::vector<double> naive_gated_rms(const std::vector<float> & o, const std::vector<float> & z, const std::vector<float> & w,
                                    int64_t N, double eps, bool silu_gate) {
    std::vector<double> y(o.size());
    for (size_t r = 0; r < o.size() / size_t(N); ++r) {
        double ss = 0;
        for (int64_t i = 0; i < N; ++i) ss += double(o[r * N + i]) * o[r * N + i];
        const double inv = 1.0 / std::sqrt(ss / double(N) + eps);
        for (int64_t i = 0; i < N; ++i) {
            const double zz = z[r * N + i];
            y[r * N + i] = o[r * N + i] * inv * w[size_t(i)] * (silu_gate ? silu_d(zz) : sigmoid_d(zz));
        }
    }
    return y;
}

// Trap 14: the KDA output norm gates with sigmoid(z), not silu(z).
TEST(cpu_ops, trap_14_gated_rms_norm_sigmoid_not_silu) {
    rng r(108);
    const int T = 3, H = 4, V = 32;
    for (dtype dt : {dtype::F32, dtype::BF16}) {
        arena a;
        auto ov = r.vec(T * H * V, -2, 2), zv = r.vec(T * H * V, -3, 3), wv = r.vec(V, 0.5, 1.5);
        tensor &O = a.f32({T, H * V}, ov), &Z = a.f32({T, H * V}, zv);
        tensor & W = a.typed(dt, {V}, wv);
        builder bd(batch_simple(T));
        node_ref y = bd.gated_rms_norm(bd.weight(O, "o"), bd.weight(Z, "z"), bd.weight(W, "o_norm"), 1e-5f, V);
        graph g = bd.finish(y);
        auto out = run_f32(g, y);
        auto ref = naive_gated_rms(ov, zv, wv, V, 1e-5, false);
        EXPECT_TRUE(check(fmt::format("gated_rms_norm {}", dtype_name(dt)), ref, out, metric::NMSE, k_nmse_f32));
        auto ref_silu = naive_gated_rms(ov, zv, wv, V, 1e-5, true);
        EXPECT_FALSE(check("gated_rms_norm/mutation(silu gate)", ref_silu, out, metric::NMSE, k_nmse_f32));
    }
}

TEST(cpu_ops, run_reports_each_node_to_callback) {
    arena a;
    std::vector<float> xv = {1, 2, 3, 4};
    tensor & x = a.f32({2, 2}, xv);
    builder bd(batch_simple(2));
    node_ref s = bd.scale(bd.weight(x, "x"), 2.0f);
    node_ref y = bd.add(s, s);
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    int calls = 0;
    float last = 0;
    be->run(g, [&](const graph &, int id, const std::vector<tensor> & outs) {
        ++calls;
        if (id == y.node) last = outs.at(0).as<float>()[3];
    });
    EXPECT_EQ(calls, 3);
    EXPECT_EQ(last, 16.0f);
}

} // namespace
} // namespace perigee::test

namespace perigee::test {
namespace {

// A KDA state that is not F32 is rejected before running, naming the node and the dtype.
TEST(cpu_ops, unsupported_state_dtype_names_node) {
    arena a;
    const int T = 2, H = 1, K = 4;
    std::vector<float> q(T * H * K, 0.1f);
    builder bd(batch_simple(T));
    // the builder itself insists on F32 state for KDA_SCAN; SHORT_CONV's state dtype is left to the backend
    tensor & w = a.f32({H * K, 1, 4}, std::vector<float>(H * K * 4, 0.1f));
    tensor & cst = a.raw(dtype::BF16, {1, H * K, 3});
    node_ref y = bd.name(bd.short_conv(bd.weight(a.f32({T, H * K}, q), "x"), bd.weight(w, "conv.weight"), bd.state(cst, "conv_state")),
                         "q_conv", 2);
    graph g = bd.finish(y);
    auto be = backend_cpu_init();
    try {
        be->check_supported(g);
        FAIL() << "a BF16 conv state must be rejected";
    } catch (const error & e) {
        const std::string m = e.what();
        std::printf("error: %s\n", m.c_str());
        EXPECT_NE(m.find("blk.2.q_conv"), std::string::npos);
        EXPECT_NE(m.find("unsupported state dtype: BF16"), std::string::npos);
    }
}

} // namespace
} // namespace perigee::test
