// KDA_GATE and KDA_SCAN (Kimi Delta Attention, ARCHITECTURE §3.4).
#include "backend/cpu/cpu-ops.h"

namespace perigee {

void kda_gate_ref(const float * f, int64_t T, int64_t H, int64_t K, wview a_log, wview dt_bias, float lower_bound,
                  float * g) {
    wview_check(a_log, "kda A_log");
    wview_check(dt_bias, "kda dt_bias");
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) {
            const float a = std::exp(a_log.at(h));   // per head: A_log[0..H-1]
            for (int64_t d = 0; d < K; ++d) {
                const int64_t i = h * K + d;
                const float xb = f[t * H * K + i] + dt_bias.at(i);   // dt_bias inside the nonlinearity
                g[t * H * K + i] = lower_bound < 0.0f ? lower_bound * sigmoid_f(a * xb)   // K3
                                                      : -a * softplus_f(xb);              // 48B
            }
        }
    }
}

namespace {

struct head_io {
    const float *q, *k, *v, *g, *beta;
    int64_t H, K, V;
    int64_t h;
    float scale;
    const float * qp(int64_t t) const { return q + (t * H + h) * K; }
    const float * kp(int64_t t) const { return k + (t * H + h) * K; }
    const float * vp(int64_t t) const { return v + (t * H + h) * V; }
    const float * gp(int64_t t) const { return g + (t * H + h) * K; }
    float bt(int64_t t) const { return beta[t * H + h]; }
};

// Token recurrence over tokens [t0, t1) of one head; S [K, V] in place; o [T, H*V].
void kda_head_recurrent(const head_io & x, int64_t t0, int64_t t1, float * S, float * o) {
    const int64_t K = x.K, V = x.V;
    std::vector<float> u(static_cast<size_t>(V));
    for (int64_t t = t0; t < t1; ++t) {
        const float *q = x.qp(t), *k = x.kp(t), *v = x.vp(t), *g = x.gp(t);
        for (int64_t d = 0; d < K; ++d) {   // decay: row d scaled by exp(g[d])
            const float a = std::exp(g[d]);
            for (int64_t e = 0; e < V; ++e) S[d * V + e] *= a;
        }
        for (int64_t e = 0; e < V; ++e) {   // u = beta (v - S^T k)
            float pred = 0.0f;
            for (int64_t d = 0; d < K; ++d) pred += S[d * V + e] * k[d];
            u[size_t(e)] = x.bt(t) * (v[e] - pred);
        }
        for (int64_t d = 0; d < K; ++d)     // S += k u^T
            for (int64_t e = 0; e < V; ++e) S[d * V + e] += k[d] * u[size_t(e)];
        float * ot = o + (t * x.H + x.h) * V;
        for (int64_t e = 0; e < V; ++e) {   // o = S^T (scale q), read after the update
            float acc = 0.0f;
            for (int64_t d = 0; d < K; ++d) acc += S[d * V + e] * (q[d] * x.scale);
            ot[e] = acc;
        }
    }
}

// Chunked WY form (ARCHITECTURE §3.4 steps 1-7) over tokens [t0, t1) of one head, chunks of C from t0.
// The tail chunk is handled by its true length n < C, which equals padding with k = v = beta = g = 0.
// Chunk internals in fp64; exp is only ever taken of Gamma_i - Gamma_j (j <= i) or of Gamma itself (<= 0).
void kda_head_chunked(const head_io & x, int64_t t0, int64_t t1, int64_t C, float * S, float * o) {
    const int64_t K = x.K, V = x.V;
    std::vector<double> G(size_t(C * K)), M(size_t(C * C)), X(size_t(C * C)), Tm(size_t(C * C)), Wc(size_t(C * K)),
        Uc(size_t(C * V)), A(size_t(C * C)), Vt(size_t(C * V)), Sd(size_t(K * V));
    auto at = [](std::vector<double> & m, int64_t cols, int64_t i, int64_t j) -> double & { return m[size_t(i * cols + j)]; };
    for (int64_t c0 = t0; c0 < t1; c0 += C) {
        const int64_t n = std::min(C, t1 - c0);
        for (int64_t d = 0; d < K * V; ++d) Sd[size_t(d)] = S[d];
        // Gamma: inclusive cumulative sum of g within the chunk.
        for (int64_t i = 0; i < n; ++i)
            for (int64_t d = 0; d < K; ++d) at(G, K, i, d) = (i ? at(G, K, i - 1, d) : 0.0) + x.gp(c0 + i)[d];
        auto decay_dot = [&](const float * a, int64_t i, const float * b, int64_t j, double sa) {
            double acc = 0.0;   // sum_d a[d] b[d] exp(G_i[d] - G_j[d]), j <= i
            for (int64_t d = 0; d < K; ++d) acc += double(a[d]) * sa * b[d] * std::exp(at(G, K, i, d) - at(G, K, j, d));
            return acc;
        };
        // 1. M (strictly lower) and 4. A_qk (lower incl. diagonal)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
                at(M, C, i, j) = j < i ? x.bt(c0 + i) * decay_dot(x.kp(c0 + i), i, x.kp(c0 + j), j, 1.0) : 0.0;
                at(A, C, i, j) = j <= i ? decay_dot(x.qp(c0 + i), i, x.kp(c0 + j), j, x.scale) : 0.0;
            }
        // 2. X = (I + M)^{-1} by forward substitution; T = X diag(beta)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
                double xij = (i == j) ? 1.0 : 0.0;
                if (j < i)
                    for (int64_t m = j; m < i; ++m) xij -= at(M, C, i, m) * at(X, C, m, j);
                at(X, C, i, j) = j <= i ? xij : 0.0;
                at(Tm, C, i, j) = at(X, C, i, j) * x.bt(c0 + j);
            }
        // 3. W = T (exp(Gamma) . K), U = T V
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t d = 0; d < K; ++d) {
                double acc = 0.0;
                for (int64_t j = 0; j <= i; ++j) acc += at(Tm, C, i, j) * std::exp(at(G, K, j, d)) * x.kp(c0 + j)[d];
                at(Wc, K, i, d) = acc;
            }
            for (int64_t e = 0; e < V; ++e) {
                double acc = 0.0;
                for (int64_t j = 0; j <= i; ++j) acc += at(Tm, C, i, j) * x.vp(c0 + j)[e];
                at(Uc, V, i, e) = acc;
            }
        }
        // 5. Vt = U - W S
        for (int64_t i = 0; i < n; ++i)
            for (int64_t e = 0; e < V; ++e) {
                double acc = at(Uc, V, i, e);
                for (int64_t d = 0; d < K; ++d) acc -= at(Wc, K, i, d) * Sd[size_t(d * V + e)];
                at(Vt, V, i, e) = acc;
            }
        // 6. O = (Q . exp(Gamma)) S + A_qk Vt
        for (int64_t i = 0; i < n; ++i) {
            const float * q = x.qp(c0 + i);
            float * ot = o + ((c0 + i) * x.H + x.h) * V;
            for (int64_t e = 0; e < V; ++e) {
                double acc = 0.0;
                for (int64_t d = 0; d < K; ++d) acc += double(q[d]) * x.scale * std::exp(at(G, K, i, d)) * Sd[size_t(d * V + e)];
                for (int64_t j = 0; j <= i; ++j) acc += at(A, C, i, j) * at(Vt, V, j, e);
                ot[e] = float(acc);
            }
        }
        // 7. S <- diag(exp(Gamma_last)) S + (exp(Gamma_last - Gamma) . K)^T Vt
        for (int64_t d = 0; d < K; ++d) {
            const double gl = at(G, K, n - 1, d);
            for (int64_t e = 0; e < V; ++e) {
                double acc = std::exp(gl) * Sd[size_t(d * V + e)];
                for (int64_t j = 0; j < n; ++j) acc += std::exp(gl - at(G, K, j, d)) * x.kp(c0 + j)[d] * at(Vt, V, j, e);
                S[d * V + e] = float(acc);
            }
        }
    }
}

} // namespace

void kda_scan_ref(const float * q, const float * k, const float * v, const float * g, const float * beta,
                  const kda_dims & dm, float scale, int chunk_size, float * state, int64_t n_slots, const batch & b,
                  float * o) {
    PG_CHECK(chunk_size == 0 || chunk_size == 64, "kda_scan: unsupported chunk size: {}", chunk_size);
    const int n_seq = b.n_seq();
    for (int s = 0; s < n_seq; ++s)
        PG_CHECK(b.slot[size_t(s)] >= 0 && b.slot[size_t(s)] < n_slots, "kda_scan: batch.slot[{}] = {} outside {} slots", s,
                 b.slot[size_t(s)], n_slots);
    const int64_t H = dm.n_head, K = dm.head_dim_k, V = dm.head_dim_v;
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int s = 0; s < n_seq; ++s) {
        for (int64_t h = 0; h < H; ++h) {
            const head_io x{q, k, v, g, beta, H, K, V, h, scale};
            float * S = state + ((int64_t(b.slot[size_t(s)]) * H + h) * K) * V;
            const int64_t t0 = b.seq_start[size_t(s)], t1 = b.seq_start[size_t(s) + 1];
            if (chunk_size == 0) kda_head_recurrent(x, t0, t1, S, o);
            else kda_head_chunked(x, t0, t1, chunk_size, S, o);
        }
    }
}

void run_kda_gate(const cpu_node_io & io) {
    const node & n = io.n();
    const tensor & f = *io.in.at(0);
    PG_CHECK(io.in.at(1)->numel() >= n.p.n_head, "{}: A_log has {} values for {} heads", n.name, io.in.at(1)->numel(),
             n.p.n_head);
    PG_CHECK(io.in.at(2)->numel() == n.p.n_head * n.p.head_dim_k, "{}: dt_bias has {} values for {} channels", n.name,
             io.in.at(2)->numel(), n.p.n_head * n.p.head_dim_k);
    kda_gate_ref(io.f32_in(0), f.dim(0), n.p.n_head, n.p.head_dim_k, io.weight_in(1), io.weight_in(2),
                 n.p.gate_lower_bound, (*io.out)[0].f32());
}

void run_kda_scan(const cpu_node_io & io) {
    const node & n = io.n();
    tensor & st = io.state_in(5);
    const kda_dims d{n.p.n_head, n.p.head_dim_k, n.p.head_dim_v};
    PG_CHECK(st.shape.size() == 4 && st.dim(1) == d.n_head && st.dim(2) == d.head_dim_k && st.dim(3) == d.head_dim_v,
             "{}: state {} for {} heads x {} x {}", n.name, shape_str(st.shape), d.n_head, d.head_dim_k, d.head_dim_v);
    PG_CHECK(io.g.b->n_tokens() == io.in.at(0)->dim(0), "{}: batch has {} tokens, q has {}", n.name, io.g.b->n_tokens(),
             io.in.at(0)->dim(0));
    kda_scan_ref(io.f32_in(0), io.f32_in(1), io.f32_in(2), io.f32_in(3), io.f32_in(4), d, n.p.scale, n.p.chunk_size,
                 st.f32(), st.dim(0), *io.g.b, (*io.out)[0].f32());
}

} // namespace perigee
