// ADD, MUL, SCALE, SIGMOID, SILU_MUL, SITU_MUL, COLS.
#include <algorithm>
#include "backend/cpu/cpu-ops.h"

namespace perigee {

void add_ref(const float * a, const float * b, int64_t n, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void mul_ref(const float * a, const float * b, int64_t n, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = a[i] * b[i];
}

void scale_ref(const float * x, int64_t n, float s, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
}

void sigmoid_ref(const float * x, int64_t n, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = sigmoid_f(x[i]);
}

void silu_mul_ref(const float * g, const float * u, int64_t n, float * y) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = silu_f(g[i]) * u[i];
}

void situ_mul_ref(const float * g, const float * u, int64_t n, float beta, float lin_beta, float * y) {
    PG_CHECK(beta > 0.0f, "situ_mul: beta must be positive, got {}", beta);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = situ_f(g[i], u[i], beta, lin_beta);
}

void cols_ref(const float * x, int64_t T, int64_t C, int64_t c0, int64_t n, float * y) {
    PG_CHECK(c0 >= 0 && n >= 0 && c0 + n <= C, "cols: [{}, {}) outside {} columns", c0, c0 + n, C);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < n; ++j) y[t * n + j] = x[t * C + c0 + j];
}

void run_elementwise(const cpu_node_io & io) {
    const node & n = io.n();
    const tensor & x = *io.in.at(0);
    const int64_t cnt = x.numel();
    float * y = (*io.out)[0].f32();
    if (n.op == op_type::ADD || n.op == op_type::MUL || n.op == op_type::SILU_MUL || n.op == op_type::SITU_MUL)
        PG_CHECK(io.in.at(1)->numel() == cnt, "{} ({}): inputs have {} and {} values", n.name, op_name(n.op), cnt,
                 io.in.at(1)->numel());
    switch (n.op) {
        case op_type::ADD: add_ref(io.f32_in(0), io.f32_in(1), cnt, y); break;
        case op_type::MUL: mul_ref(io.f32_in(0), io.f32_in(1), cnt, y); break;
        case op_type::SCALE: scale_ref(io.f32_in(0), cnt, n.p.scale, y); break;
        case op_type::SIGMOID: sigmoid_ref(io.f32_in(0), cnt, y); break;
        case op_type::SILU_MUL: silu_mul_ref(io.f32_in(0), io.f32_in(1), cnt, y); break;
        case op_type::SITU_MUL:
            situ_mul_ref(io.f32_in(0), io.f32_in(1), cnt, n.p.situ_beta, n.p.situ_linear_beta, y);
            break;
        case op_type::COLS: cols_ref(io.f32_in(0), x.dim(0), x.dim(1), n.p.c0, n.p.n, y); break;
        case op_type::SELECT_ROWS: {
            const auto & rows = io.g.b->logits_rows;
            const int64_t C = x.dim(1);
            if (rows.empty()) {
                std::copy(io.f32_in(0), io.f32_in(0) + cnt, y);
                break;
            }
            for (size_t r = 0; r < rows.size(); ++r) {
                PG_CHECK(rows[r] >= 0 && rows[r] < x.dim(0), "{}: logits row {} outside 0..{}", n.name, rows[r], x.dim(0) - 1);
                std::copy(io.f32_in(0) + rows[r] * C, io.f32_in(0) + (rows[r] + 1) * C, y + int64_t(r) * C);
            }
            break;
        }
        default: PG_FAIL("{}: run_elementwise cannot run {}", n.name, op_name(n.op));
    }
}

} // namespace perigee
