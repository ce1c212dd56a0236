// MLA_ATTN (ARCHITECTURE §3.5, §3.6): write [c | kr] into the paged cache, then attend per token over
// positions 0..pos of its own sequence (or the selected ones), reading keys/values only from the cache.
// Expanded form: k_h(s) = [W_UK_h c_s | kr_s], v_h(s) = W_UV_h c_s, with kv_b rows h*(dn+dv) .. +dn = W_UK_h
// and +dn .. +dn+dv = W_UV_h. kr is shared by all heads and never rotated.
#include "backend/cpu/cpu-ops.h"
#include "backend/cpu/paging.h"

#include <limits>

namespace perigee {

void mla_attn_ref(const float * q, const float * c, const float * kr, wview kv_b, const mla_dims & d, float scale,
                  float * cache, int64_t n_pages, const int32_t * sel, int64_t topk, const batch & b, float * o) {
    wview_check(kv_b, "mla kv_b_proj");
    paging_check(b, n_pages, "mla_attn");
    const int64_t H = d.n_head, dn = d.head_dim_nope, dr = d.head_dim_rope, dv = d.head_dim_v, L = d.kv_lora_rank;
    const int64_t W = L + dr, dqk = dn + dr;

    // 1. Write every token's [c | kr] into its sequence's page first.
    for (int s = 0; s < b.n_seq(); ++s)
        for (int64_t t = b.seq_start[size_t(s)]; t < b.seq_start[size_t(s) + 1]; ++t) {
            float * row = paging_row(cache, b, s, b.pos0[size_t(s)] + t - b.seq_start[size_t(s)], W);
            for (int64_t i = 0; i < L; ++i) row[i] = c[t * L + i];
            for (int64_t i = 0; i < dr; ++i) row[L + i] = kr[t * dr + i];
        }
    if (sel) {   // listed positions must exist: 0 <= p <= pos of the token
        for (int s = 0; s < b.n_seq(); ++s)
            for (int64_t t = b.seq_start[size_t(s)]; t < b.seq_start[size_t(s) + 1]; ++t) {
                const int64_t pos = b.pos0[size_t(s)] + t - b.seq_start[size_t(s)];
                int64_t n_valid = 0;
                for (int64_t j = 0; j < topk; ++j) {
                    const int32_t p = sel[t * topk + j];
                    PG_CHECK(p >= -1 && p <= pos, "mla_attn: selection [{}, {}] = {} outside 0..{}", t, j, p, pos);
                    n_valid += p >= 0;
                }
                PG_CHECK(n_valid > 0, "mla_attn: token {} selects no position", t);
            }
    }

    std::vector<float> wkv(size_t(H * (dn + dv) * L));
    kv_b.row(0, H * (dn + dv) * L, wkv.data());

    // 2. Per sequence: expand every cached position 0..last into per-head k_nope and v (from the cache only).
    for (int s = 0; s < b.n_seq(); ++s) {
        const int64_t t0 = b.seq_start[size_t(s)], t1 = b.seq_start[size_t(s) + 1];
        const int64_t n_pos = b.pos0[size_t(s)] + (t1 - t0);
        std::vector<float> kn(size_t(n_pos * H * dn)), vv(size_t(n_pos * H * dv));   // [n_pos, H, dn|dv]
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < n_pos; ++p) {
            const float * cs = paging_row(cache, b, s, p, W);
            for (int64_t h = 0; h < H; ++h) {
                const float * wuk = wkv.data() + (h * (dn + dv)) * L;
                const float * wuv = wuk + dn * L;
                for (int64_t i = 0; i < dn; ++i) {
                    float acc = 0.0f;
                    for (int64_t l = 0; l < L; ++l) acc += wuk[i * L + l] * cs[l];
                    kn[size_t((p * H + h) * dn + i)] = acc;
                }
                for (int64_t i = 0; i < dv; ++i) {
                    float acc = 0.0f;
                    for (int64_t l = 0; l < L; ++l) acc += wuv[i * L + l] * cs[l];
                    vv[size_t((p * H + h) * dv + i)] = acc;
                }
            }
        }
        // 3. Attention per (token, head): fp32 softmax with max subtraction.
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t h = 0; h < H; ++h) {
                const int64_t pos = b.pos0[size_t(s)] + t - t0;
                std::vector<int64_t> keys;
                if (sel) {
                    for (int64_t j = 0; j < topk; ++j)
                        if (sel[t * topk + j] >= 0) keys.push_back(sel[t * topk + j]);
                } else {
                    for (int64_t p = 0; p <= pos; ++p) keys.push_back(p);
                }
                const float * qh = q + (t * H + h) * dqk;
                std::vector<float> sc(keys.size());
                float mx = -std::numeric_limits<float>::infinity();
                for (size_t j = 0; j < keys.size(); ++j) {
                    const int64_t p = keys[j];
                    const float * kr_p = paging_row(cache, b, s, p, W) + L;
                    const float * kn_p = kn.data() + (p * H + h) * dn;
                    float acc = 0.0f;
                    for (int64_t i = 0; i < dn; ++i) acc += qh[i] * kn_p[i];
                    for (int64_t i = 0; i < dr; ++i) acc += qh[dn + i] * kr_p[i];
                    sc[j] = acc * scale;
                    mx = std::max(mx, sc[j]);
                }
                float sum = 0.0f;
                for (auto & x : sc) sum += (x = std::exp(x - mx));
                float * oh = o + (t * H + h) * dv;
                for (int64_t i = 0; i < dv; ++i) oh[i] = 0.0f;
                for (size_t j = 0; j < keys.size(); ++j) {
                    const float pj = sc[j] / sum;
                    const float * v_p = vv.data() + (keys[j] * H + h) * dv;
                    for (int64_t i = 0; i < dv; ++i) oh[i] += pj * v_p[i];
                }
            }
        }
    }
}

void run_mla_attn(const cpu_node_io & io) {
    const node & n = io.n();
    tensor & cache = io.state_in(4);
    const mla_dims d{n.p.n_head, n.p.head_dim_nope, n.p.head_dim_rope, n.p.head_dim_v, n.p.kv_lora_rank};
    PG_CHECK(cache.shape.size() == 3 && cache.dim(1) == io.g.b->page_size && cache.dim(2) == d.kv_lora_rank + d.head_dim_rope,
             "{}: cache {} for page size {} and width {}", n.name, shape_str(cache.shape), io.g.b->page_size,
             d.kv_lora_rank + d.head_dim_rope);
    PG_CHECK(io.g.b->n_tokens() == io.in.at(0)->dim(0), "{}: batch has {} tokens, q has {}", n.name, io.g.b->n_tokens(),
             io.in.at(0)->dim(0));
    const bool has_sel = io.in.size() > 5 && io.in[5] != nullptr;
    mla_attn_ref(io.f32_in(0), io.f32_in(1), io.f32_in(2), io.weight_in(3), d, n.p.scale, cache.f32(), cache.dim(0),
                 has_sel ? io.i32_in(5) : nullptr, has_sel ? io.in[5]->dim(1) : 0, *io.g.b, (*io.out)[0].f32());
}

} // namespace perigee
