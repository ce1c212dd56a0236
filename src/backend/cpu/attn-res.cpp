// ATTN_RES_MIX (Block Attention Residuals, ARCHITECTURE §3.2): softmax over RMS-normalised scores of the
// candidates passed (no padding), weighted sum of the RAW candidates.
#include "backend/cpu/cpu-ops.h"

namespace perigee {

void attn_res_mix_ref(const float * const * cands, int64_t n, int64_t R, int64_t D, wview norm_w, wview proj_w,
                      float eps, float * y) {
    wview_check(norm_w, "attn_res norm weight");
    wview_check(proj_w, "attn_res proj weight");
    PG_CHECK(n >= 1, "attn_res_mix: no candidates");
    std::vector<float> wq(static_cast<size_t>(D));   // effective pseudo-query w = norm_w * proj_w, fp32
    for (int64_t c = 0; c < D; ++c) wq[size_t(c)] = norm_w.at(c) * proj_w.at(c);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        std::vector<double> s(static_cast<size_t>(n));
        double mx = -1e300;
        for (int64_t i = 0; i < n; ++i) {
            const float * v = cands[i] + r * D;
            double ss = 0.0, dot = 0.0;
            for (int64_t c = 0; c < D; ++c) {
                ss += double(v[c]) * v[c];
                dot += double(v[c]) * wq[size_t(c)];
            }
            s[size_t(i)] = dot / std::sqrt(ss / double(D) + double(eps));
            mx = std::max(mx, s[size_t(i)]);
        }
        double sum = 0.0;
        for (auto & v : s) sum += (v = std::exp(v - mx));
        for (int64_t c = 0; c < D; ++c) {
            double acc = 0.0;
            for (int64_t i = 0; i < n; ++i) acc += s[size_t(i)] / sum * cands[i][r * D + c];
            y[r * D + c] = float(acc);
        }
    }
}

void run_attn_res_mix(const cpu_node_io & io) {
    const node & n = io.n();
    const size_t nc = io.in.size() - 2;
    std::vector<const float *> c(nc);
    for (size_t i = 0; i < nc; ++i) {
        c[i] = io.f32_in(i);
        PG_CHECK(io.in[i]->shape == io.in[0]->shape, "{}: candidate {} {} differs from {}", n.name, i,
                 shape_str(io.in[i]->shape), shape_str(io.in[0]->shape));
    }
    const int64_t D = io.in[0]->shape.back();
    attn_res_mix_ref(c.data(), int64_t(nc), io.in[0]->numel() / D, D, io.weight_in(nc), io.weight_in(nc + 1), n.p.eps,
                     (*io.out)[0].f32());
}

} // namespace perigee
