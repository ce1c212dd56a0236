// RMS_NORM, LAYER_NORM, L2_NORM, GATED_RMS_NORM: per-row reductions in fp64, outputs in fp32.
#include "backend/cpu/cpu-ops.h"

namespace perigee {

void rms_norm_ref(const float * x, int64_t R, int64_t N, wview w, float eps, float * y) {
    wview_check(w, "rms_norm weight");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        const float * xr = x + r * N;
        double ss = 0.0;
        for (int64_t i = 0; i < N; ++i) ss += double(xr[i]) * xr[i];
        const float inv = float(1.0 / std::sqrt(ss / double(N) + double(eps)));
        for (int64_t i = 0; i < N; ++i) y[r * N + i] = xr[i] * inv * (w.present() ? w.at(i) : 1.0f);
    }
}

void layer_norm_ref(const float * x, int64_t R, int64_t N, wview w, wview b, float eps, float * y) {
    wview_check(w, "layer_norm weight");
    wview_check(b, "layer_norm bias");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        const float * xr = x + r * N;
        double mean = 0.0;
        for (int64_t i = 0; i < N; ++i) mean += xr[i];
        mean /= double(N);
        double var = 0.0;   // biased: divide by N
        for (int64_t i = 0; i < N; ++i) var += (xr[i] - mean) * (xr[i] - mean);
        var /= double(N);
        const double inv = 1.0 / std::sqrt(var + double(eps));
        for (int64_t i = 0; i < N; ++i) y[r * N + i] = float((xr[i] - mean) * inv) * w.at(i) + b.at(i);
    }
}

void l2_norm_ref(const float * x, int64_t R, int64_t N, float eps, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        const float * xr = x + r * N;
        double ss = 0.0;
        for (int64_t i = 0; i < N; ++i) ss += double(xr[i]) * xr[i];
        const float inv = float(1.0 / std::sqrt(ss + double(eps)));
        for (int64_t i = 0; i < N; ++i) y[r * N + i] = xr[i] * inv;
    }
}

void gated_rms_norm_ref(const float * o, const float * z, int64_t R, int64_t N, wview w, float eps, float * y) {
    wview_check(w, "gated_rms_norm weight");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
        const float * orow = o + r * N;
        double ss = 0.0;
        for (int64_t i = 0; i < N; ++i) ss += double(orow[i]) * orow[i];
        const float inv = float(1.0 / std::sqrt(ss / double(N) + double(eps)));
        for (int64_t i = 0; i < N; ++i) y[r * N + i] = orow[i] * inv * w.at(i) * sigmoid_f(z[r * N + i]);
    }
}

void run_norm(const cpu_node_io & io) {
    const node & n = io.n();
    const tensor & xt = *io.in.at(0);
    const int64_t N = n.p.n;
    PG_CHECK(N > 0 && xt.numel() % N == 0, "{} ({}): width {} does not divide {} values", n.name, op_name(n.op), N,
             xt.numel());
    const int64_t R = xt.numel() / N;
    float * y = (*io.out)[0].f32();
    switch (n.op) {
        case op_type::RMS_NORM: rms_norm_ref(io.f32_in(0), R, N, io.weight_in(1), n.p.eps, y); break;
        case op_type::LAYER_NORM: layer_norm_ref(io.f32_in(0), R, N, io.weight_in(1), io.weight_in(2), n.p.eps, y); break;
        case op_type::L2_NORM: l2_norm_ref(io.f32_in(0), R, N, n.p.eps, y); break;
        case op_type::GATED_RMS_NORM:
            gated_rms_norm_ref(io.f32_in(0), io.f32_in(1), R, N, io.weight_in(2), n.p.eps, y);
            break;
        default: PG_FAIL("{}: run_norm cannot run {}", n.name, op_name(n.op));
    }
}

} // namespace perigee
