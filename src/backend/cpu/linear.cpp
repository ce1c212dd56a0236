// LINEAR and GET_ROWS: weights in F32/BF16/F16, converted per element; fp32 accumulation.
#include "backend/cpu/cpu-ops.h"

namespace perigee {

// fp32 dot product in a fixed order: 8 interleaved partial sums (so the compiler can vectorise it
// without -ffast-math), added pairwise, then the tail. The order depends only on n, never on T,
// the batch or the thread count, so every row is computed identically in every batching.
float dot_f32(const float * a, const float * b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

void linear_ref(const float * x, int64_t T, int64_t in, wview W, int64_t out, float * y) {
    wview_check(W, "linear weight");
    // OpenMP over output rows: each weight row is converted once and used for every token.
#pragma omp parallel
    {
        std::vector<float> wrow(static_cast<size_t>(in));
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out; ++o) {
            W.row(o * in, in, wrow.data());
            for (int64_t t = 0; t < T; ++t) y[t * out + o] = dot_f32(x + t * in, wrow.data(), in);
        }
    }
}

void get_rows_ref(wview table, int64_t V, int64_t D, const int32_t * ids, int64_t T, float * y, const std::string & what) {
    wview_check(table, "get_rows table");
    for (int64_t t = 0; t < T; ++t)
        PG_CHECK(ids[t] >= 0 && ids[t] < V, "{}: id {} at token {} outside 0..{}", what, ids[t], t, V - 1);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) table.row(int64_t(ids[t]) * D, D, y + t * D);
}

std::vector<float> bf16_rounded(const float * x, int64_t n) {
    std::vector<float> r(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) r[size_t(i)] = bf16_round(x[i]);
    return r;
}

void run_linear(const cpu_node_io & io) {
    const tensor & x = *io.in.at(0);
    const tensor & w = *io.in.at(1);
    const float * xin = io.f32_in(0);
    std::vector<float> xr;   // op_params::bf16_inputs: x rounded to bf16 first (ARCHITECTURE §3.0)
    if (io.n().p.bf16_inputs) xin = (xr = bf16_rounded(xin, x.numel())).data();
    linear_ref(xin, x.dim(0), x.dim(1), io.weight_in(1), w.dim(0), (*io.out)[0].f32());
}

void run_get_rows(const cpu_node_io & io) {
    const tensor & table = *io.in.at(0);
    const tensor & ids = *io.in.at(1);
    get_rows_ref(io.weight_in(0), table.dim(0), table.dim(1), io.i32_in(1), ids.numel(), (*io.out)[0].f32(),
                 fmt::format("{} (GET_ROWS)", io.n().name));
}

} // namespace perigee
