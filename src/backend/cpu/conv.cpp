// SHORT_CONV: causal depthwise conv of width W + SiLU, per sequence, history from the slot's state.
#include "backend/cpu/cpu-ops.h"

namespace perigee {

void short_conv_ref(const float * x, int64_t C, wview w, int64_t W, float * state, int64_t n_slots, const batch & b,
                    float * y) {
    wview_check(w, "short_conv weight");
    PG_CHECK(W >= 1, "short_conv: width {} must be >= 1", W);
    const int n_seq = b.n_seq();
    for (int s = 0; s < n_seq; ++s)
        PG_CHECK(b.slot[size_t(s)] >= 0 && b.slot[size_t(s)] < n_slots, "short_conv: batch.slot[{}] = {} outside {} slots",
                 s, b.slot[size_t(s)], n_slots);
    const int64_t H = W - 1;   // history length
    // One (sequence, channel) pair per iteration: they are independent.
#pragma omp parallel for collapse(2) schedule(static)
    for (int s = 0; s < n_seq; ++s) {
        for (int64_t c = 0; c < C; ++c) {
            const int64_t t0 = b.seq_start[size_t(s)];
            const int64_t L = b.seq_start[size_t(s) + 1] - t0;
            float * hist = state + (int64_t(b.slot[size_t(s)]) * C + c) * H;   // [W-1], oldest first
            // in(i) = the pre-conv input at local step i; i < 0 reads the history (i = -1 is the newest).
            auto in = [&](int64_t i) { return i >= 0 ? x[(t0 + i) * C + c] : hist[H + i]; };
            for (int64_t i = 0; i < L; ++i) {
                float acc = 0.0f;
                for (int64_t j = 0; j < W; ++j) acc += w.at(c * W + j) * in(i - H + j);   // tap W-1 = current
                y[(t0 + i) * C + c] = silu_f(acc);
            }
            // New history: the last W-1 inputs, which may still include old history when L < W-1.
            std::vector<float> nh(static_cast<size_t>(H));
            for (int64_t j = 0; j < H; ++j) nh[size_t(j)] = in(L - H + j);
            for (int64_t j = 0; j < H; ++j) hist[j] = nh[size_t(j)];
        }
    }
}

void run_short_conv(const cpu_node_io & io) {
    const tensor & x = *io.in.at(0);
    const tensor & w = *io.in.at(1);
    tensor & st = io.state_in(2);
    const node & n = io.n();
    PG_CHECK(w.shape.size() == 3 && w.dim(0) == x.dim(1), "{}: conv weight {} for {} channels", n.name,
             shape_str(w.shape), x.dim(1));
    PG_CHECK(st.shape.size() == 3 && st.dim(1) == x.dim(1) && st.dim(2) == w.dim(2) - 1, "{}: conv state {} for weight {}",
             n.name, shape_str(st.shape), shape_str(w.shape));
    PG_CHECK(io.g.b->n_tokens() == x.dim(0), "{}: batch has {} tokens, input {}", n.name, io.g.b->n_tokens(), x.dim(0));
    short_conv_ref(io.f32_in(0), x.dim(1), io.weight_in(1), w.dim(2), st.f32(), st.dim(0), *io.g.b, (*io.out)[0].f32());
}

} // namespace perigee
