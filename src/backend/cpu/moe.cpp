// MOE_ROUTE and MOE_EXPERTS (latent MoE, ARCHITECTURE §3.7; FP4 experts §3.8).
#include "backend/cpu/cpu-ops.h"

#include <algorithm>
#include <limits>
#include <numeric>

#if defined(PERIGEE_HAVE_QUANT)
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"
#endif

namespace perigee {

void moe_route_ref(const float * x, int64_t T, int64_t D, wview gate, wview bias, const route_cfg & c, int32_t * ids,
                   float * w) {
    wview_check(gate, "moe_route gate");
    wview_check(bias, "moe_route bias");
    const int64_t E = c.n_expert;
    PG_CHECK(c.topk >= 1 && c.topk <= E, "moe_route: top-{} of {} experts", c.topk, E);
    PG_CHECK(c.n_group >= 1 && E % c.n_group == 0 && c.topk_group >= 1 && c.topk_group <= c.n_group,
             "moe_route: {} experts in {} groups, keeping {}", E, c.n_group, c.topk_group);
    const bool grouped = c.n_group > 1 && c.topk_group < c.n_group;
    const int64_t gs = E / c.n_group;
    if (grouped) PG_CHECK(c.topk_group * gs >= c.topk, "moe_route: {} kept groups of {} cannot hold top-{}", c.topk_group, gs, c.topk);
    std::vector<float> gw(size_t(E * D));   // logits in fp32: upcast the gate once
    gate.row(0, E * D, gw.data());
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        std::vector<float> score(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
            float acc = 0.0f;
            for (int64_t i = 0; i < D; ++i) acc += x[t * D + i] * gw[size_t(e * D + i)];
            score[size_t(e)] = acc;
        }
        if (c.act == router_act::SIGMOID) {
            for (auto & s : score) s = sigmoid_f(s);
        } else {
            const float mx = *std::max_element(score.begin(), score.end());
            double sum = 0.0;
            for (auto & s : score) sum += (s = std::exp(s - mx));
            for (auto & s : score) s = float(s / sum);
        }
        for (int64_t e = 0; e < E; ++e) biased[size_t(e)] = score[size_t(e)] + (bias.present() ? bias.at(e) : 0.0f);
        // Descending biased score, ties to the lower id.
        auto before = [&](int64_t a, int64_t b2) {
            return biased[size_t(a)] > biased[size_t(b2)] || (biased[size_t(a)] == biased[size_t(b2)] && a < b2);
        };
        if (grouped) {   // group score = sum of its top-2 biased scores; keep topk_group groups
            std::vector<float> gscore(size_t(c.n_group));
            for (int64_t gi = 0; gi < c.n_group; ++gi) {
                std::vector<float> v(biased.begin() + gi * gs, biased.begin() + (gi + 1) * gs);
                std::sort(v.begin(), v.end(), std::greater<float>());
                gscore[size_t(gi)] = v[0] + (gs > 1 ? v[1] : 0.0f);
            }
            std::vector<int64_t> order(size_t(c.n_group));
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(),
                             [&](int64_t a, int64_t b2) { return gscore[size_t(a)] > gscore[size_t(b2)]; });
            std::vector<bool> keep(size_t(c.n_group), false);
            for (int64_t i = 0; i < c.topk_group; ++i) keep[size_t(order[size_t(i)])] = true;
            for (int64_t e = 0; e < E; ++e)
                if (!keep[size_t(e / gs)]) biased[size_t(e)] = -std::numeric_limits<float>::infinity();
        }
        std::vector<int64_t> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + c.topk, order.end(), before);
        double sum = 0.0;
        for (int64_t j = 0; j < c.topk; ++j) sum += score[size_t(order[size_t(j)])];
        for (int64_t j = 0; j < c.topk; ++j) {
            const int64_t e = order[size_t(j)];
            ids[t * c.topk + j] = int32_t(e);
            float wj = score[size_t(e)];   // the RAW score, not the biased one
            if (c.renormalize) wj = float(wj / (sum + 1e-20));
            w[t * c.topk + j] = wj * c.scale;
        }
    }
}

namespace {

// Checks an expert matrix before any parallel loop reads it.
void expert_matrix_check(const expert_matrix & m, const std::string & what) {
    PG_CHECK(m.out > 0 && m.in > 0, "{}: empty shape [{}, {}]", what, m.out, m.in);
    switch (m.format) {
        case fp4_format::NONE:
            PG_CHECK(m.weight != nullptr, "{}: dense matrix without a weight", what);
            PG_CHECK(m.weight->type == dtype::F32 || m.weight->type == dtype::BF16 || m.weight->type == dtype::F16,
                     "{}: unsupported expert weight dtype: {}", what, dtype_name(m.weight->type));
            PG_CHECK(m.weight->numel() == m.out * m.in, "{}: weight {} for [{}, {}]", what, shape_str(m.weight->shape), m.out,
                     m.in);
            return;
        case fp4_format::MXFP4:
        case fp4_format::NVFP4: {
            const bool mx = m.format == fp4_format::MXFP4;
            const int64_t blk = mx ? 32 : 16;
            PG_CHECK(m.packed != nullptr && m.scale != nullptr, "{}: FP4 matrix without packed/scale", what);
            PG_CHECK(m.in % blk == 0, "{}: unsupported {} input width: {} (multiple of {})", what, mx ? "MXFP4" : "NVFP4",
                     m.in, blk);
            PG_CHECK(m.packed->type == dtype::U8 && m.packed->nbytes >= size_t(m.out * m.in / 2),
                     "{}: packed {} {} for [{}, {}]", what, dtype_name(m.packed->type), shape_str(m.packed->shape), m.out, m.in);
            const bool scale_ok = mx ? (m.scale->type == dtype::U8 || m.scale->type == dtype::F8_E8M0)
                                     : (m.scale->type == dtype::F8_E4M3 || m.scale->type == dtype::U8);
            PG_CHECK(scale_ok, "{}: unsupported {} scale dtype: {}", what, mx ? "MXFP4" : "NVFP4", dtype_name(m.scale->type));
            PG_CHECK(m.scale->nbytes >= size_t(m.out * (m.in / blk)), "{}: scale {} for [{}, {}]", what,
                     shape_str(m.scale->shape), m.out, m.in);
#if defined(PERIGEE_HAVE_QUANT)
            // The codecs' own validators: exact shapes, no NaN scale byte (the error names row and block).
            if (mx) mxfp4_validate(*m.packed, *m.scale, m.out, m.in, what);
            else nvfp4_validate(*m.packed, *m.scale, m.global_scale, m.out, m.in, what);
#else
            PG_FAIL("{}: unsupported expert format: FP4 (built without perigee_quant)", what);
#endif
            return;
        }
    }
    PG_FAIL("{}: unsupported expert format: {}", what, int(m.format));
}

} // namespace

void expert_row_ref(const expert_matrix & m, int64_t r, float * out) {
    switch (m.format) {
        case fp4_format::NONE: wview_of(*m.weight).row(r * m.in, m.in, out); return;
#if defined(PERIGEE_HAVE_QUANT)
        case fp4_format::MXFP4:
            mxfp4_dequant_row_ref(m.packed->as<uint8_t>() + r * (m.in / 2), m.scale->as<uint8_t>() + r * (m.in / 32), m.in,
                                  out);
            return;
        case fp4_format::NVFP4:
            nvfp4_dequant_row_ref(m.packed->as<uint8_t>() + r * (m.in / 2), m.scale->as<uint8_t>() + r * (m.in / 16),
                                  m.global_scale, m.in, out);
            return;
#else
        case fp4_format::MXFP4:
        case fp4_format::NVFP4: break;
#endif
    }
    PG_ASSERT(false && "expert_row_ref: unchecked matrix format");
}

void moe_experts_ref(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                     const std::vector<expert_weights> & experts, const experts_cfg & c, float * y) {
    const int64_t E = int64_t(experts.size());
    const int64_t Dout = c.d_out;
    // Tokens routed to each expert, as (token, slot j) pairs; only these experts are read.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> routed(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids[t * k + j];
            PG_CHECK(e >= 0 && e < E, "moe_experts: expert id {} at [{}, {}] outside 0..{}", e, t, j, E - 1);
            routed[size_t(e)].push_back({t, j});
        }
    for (int64_t e = 0; e < E; ++e) {
        if (routed[size_t(e)].empty()) continue;
        const auto & ex = experts[size_t(e)];
        expert_matrix_check(ex.gate, fmt::format("expert {} gate", e));
        expert_matrix_check(ex.up, fmt::format("expert {} up", e));
        expert_matrix_check(ex.down, fmt::format("expert {} down", e));
        PG_CHECK(ex.gate.in == Din && ex.up.in == Din && ex.up.out == ex.gate.out && ex.down.in == ex.gate.out &&
                     ex.down.out == Dout,
                 "moe_experts: expert {} shapes do not fit input {} -> {}", e, Din, Dout);
        if (c.act == glu_act::SITU) PG_CHECK(c.situ_beta > 0.0f, "moe_experts: situ beta must be positive, got {}", c.situ_beta);
    }
    std::vector<float> ybuf(size_t(T * k * Dout), 0.0f);   // [T, k, Dout]: each expert's output per routed slot
    for (int64_t e = 0; e < E; ++e) {
        const auto & rt = routed[size_t(e)];
        if (rt.empty()) continue;
        const auto & ex = experts[size_t(e)];
        const int64_t F = ex.gate.out, n = int64_t(rt.size());
        std::vector<float> m(size_t(n * F));   // act(gate x, up x) per routed token [n, F]
#pragma omp parallel
        {
            std::vector<float> grow(static_cast<size_t>(Din)), urow(static_cast<size_t>(Din)), drow(static_cast<size_t>(F));
#pragma omp for schedule(static)
            for (int64_t r = 0; r < F; ++r) {   // gate and up rows, decoded once, applied to every routed token
                expert_row_ref(ex.gate, r, grow.data());
                expert_row_ref(ex.up, r, urow.data());
                for (int64_t i = 0; i < n; ++i) {
                    const float * xt = x + rt[size_t(i)].first * Din;
                    const float ga = dot_f32(grow.data(), xt, Din), ua = dot_f32(urow.data(), xt, Din);
                    const float a = c.act == glu_act::SITU ? situ_f(ga, ua, c.situ_beta, c.situ_linear_beta)
                                                           : silu_f(ga) * ua;
                    m[size_t(i * F + r)] = c.bf16_inputs ? bf16_round(a) : a;
                }
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < Dout; ++r) {   // down rows
                expert_row_ref(ex.down, r, drow.data());
                for (int64_t i = 0; i < n; ++i) {
                    ybuf[size_t((rt[size_t(i)].first * k + rt[size_t(i)].second) * Dout + r)] =
                        dot_f32(drow.data(), m.data() + i * F, F);
                }
            }
        }
    }
    // Combine in fp32, in slot order.
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < Dout; ++r) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; ++j) acc += w[t * k + j] * ybuf[size_t((t * k + j) * Dout + r)];
            y[t * Dout + r] = acc;
        }
}

void run_moe_route(const cpu_node_io & io) {
    const node & n = io.n();
    const tensor & x = *io.in.at(0);
    const tensor & gw = *io.in.at(1);
    PG_CHECK(gw.shape.size() == 2 && gw.dim(1) == x.dim(1), "{}: gate {} for input {}", n.name, shape_str(gw.shape),
             shape_str(x.shape));
    const wview bias = io.weight_in(2);
    if (bias.present())
        PG_CHECK(io.in[2]->numel() == gw.dim(0), "{}: bias {} for {} experts", n.name, shape_str(io.in[2]->shape), gw.dim(0));
    const route_cfg c{gw.dim(0), n.p.topk, n.p.n_group, n.p.topk_group, n.p.renormalize, n.p.scale, n.p.router};
    moe_route_ref(io.f32_in(0), x.dim(0), x.dim(1), io.weight_in(1), bias, c, (*io.out)[0].as<int32_t>(),
                  (*io.out)[1].f32());
}

void run_moe_experts(const cpu_node_io & io) {
    const node & n = io.n();
    const tensor & x = *io.in.at(0);
    const tensor & ids = *io.in.at(1);
    PG_CHECK(io.in.at(2)->shape == ids.shape && ids.shape.size() == 2 && ids.dim(0) == x.dim(0),
             "{}: ids {} / weights {} for {} tokens", n.name, shape_str(ids.shape), shape_str(io.in.at(2)->shape), x.dim(0));
    const experts_cfg c{n.p.act, n.p.situ_beta, n.p.situ_linear_beta, n.outs.at(0).shape.at(1), n.p.bf16_inputs};
    const float * xin = io.f32_in(0);
    std::vector<float> xr;   // op_params::bf16_inputs: x rounded to bf16 first (the GLU rows in moe_experts_ref)
    if (n.p.bf16_inputs) xin = (xr = bf16_rounded(xin, x.numel())).data();
    moe_experts_ref(xin, x.dim(0), x.dim(1), io.i32_in(1), io.f32_in(2), ids.dim(1), *n.p.experts, c, (*io.out)[0].f32());
}

} // namespace perigee
