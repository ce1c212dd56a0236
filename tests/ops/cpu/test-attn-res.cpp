// ATTN_RES_MIX vs naive fp64; traps 19 (mix the RAW candidates, scored by RMS-normalised ones, w = norm_w*proj_w)
// and 21 (only the candidates passed: zero padding is not neutral).
#include "harness.h"

namespace perigee::test {
namespace {

// mutation 1: mix the normalised candidates; 2: pad with a zero candidate.
std::vector<double> naive_mix(const std::vector<std::vector<float>> & cands, int R, int D, const std::vector<float> & nw,
                              const std::vector<float> & pw, double eps, int mutation = 0) {
    std::vector<double> y(size_t(R * D));
    std::vector<std::vector<float>> cs = cands;
    if (mutation == 2) cs.push_back(std::vector<float>(size_t(R * D), 0.0f));
    for (int r = 0; r < R; ++r) {
        std::vector<double> s, rn;
        for (const auto & v : cs) {
            double ss = 0, dot = 0;
            for (int c = 0; c < D; ++c) ss += double(v[size_t(r * D + c)]) * v[size_t(r * D + c)];
            const double inv = 1.0 / std::sqrt(ss / D + eps);
            for (int c = 0; c < D; ++c) dot += v[size_t(r * D + c)] * inv * double(nw[size_t(c)]) * pw[size_t(c)];
            s.push_back(dot);
            rn.push_back(inv);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (auto & v : s) sum += (v = std::exp(v - mx));
        for (int c = 0; c < D; ++c) {
            double acc = 0;
            for (size_t i = 0; i < cs.size(); ++i)
                acc += s[i] / sum * cs[i][size_t(r * D + c)] * (mutation == 1 ? rn[i] : 1.0);
            y[size_t(r * D + c)] = acc;
        }
    }
    return y;
}

TEST(cpu_attn_res, trap_19_raw_candidates_and_trap_21_no_padding) {
    rng r(701);
    const int R = 5, D = 64;
    for (int n : {1, 2, 5}) {
        for (dtype dt : {dtype::F32, dtype::BF16}) {
            arena a;
            std::vector<std::vector<float>> cands;
            for (int i = 0; i < n; ++i) {
                const float mag = std::pow(10.0f, float(i) - 1.0f);   // very different magnitudes (trap 19)
                cands.push_back(r.vec(size_t(R * D), -mag, mag));
            }
            auto nw = r.vec(D, 0.5f, 1.5f), pw = r.vec(D, -0.3f, 0.3f);
            builder bd(batch_simple(R));
            std::vector<node_ref> cr;
            for (int i = 0; i < n; ++i) cr.push_back(bd.weight(a.f32({R, D}, cands[size_t(i)]), fmt::format("cand{}", i)));
            node_ref y = bd.attn_res_mix(cr, bd.weight(a.typed(dt, {D}, nw), "res_norm"), bd.weight(a.typed(dt, {1, D}, pw), "res_proj"),
                                         1e-5f);
            graph g = bd.finish(y);
            auto out = run_f32(g, y);
            auto ref = naive_mix(cands, R, D, nw, pw, 1e-5);
            const std::string tag = fmt::format("attn_res_mix n={} {}", n, dtype_name(dt));
            EXPECT_TRUE(check(tag, ref, out, metric::NMSE, k_nmse_f32));
            if (n > 1) {
                EXPECT_FALSE(check(tag + "/trap_19 mutation(mix normalised)", naive_mix(cands, R, D, nw, pw, 1e-5, 1), out,
                                   metric::NMSE, k_nmse_f32));
            }
            EXPECT_FALSE(check(tag + "/trap_21 mutation(zero padding)", naive_mix(cands, R, D, nw, pw, 1e-5, 2), out, metric::NMSE,
                               k_nmse_f32));
            if (n == 5 && dt == dtype::F32) expect_control_fails("attn_res_mix", ref, out, metric::NMSE, k_nmse_f32);
        }
    }
}

} // namespace
} // namespace perigee::test
