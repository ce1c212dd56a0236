// INDEXER_TOPK (K3.1 Lightning Indexer, ARCHITECTURE §3.6): write ki into the key pages, score every
// position 0..pos, select top-k with the deterministic tie rule (lower positions win at the threshold).
#include "backend/cpu/cpu-ops.h"
#include "backend/cpu/paging.h"

#include <algorithm>
#include <functional>

namespace perigee {

void indexer_select_ref(const float * score, int64_t n, int64_t topk, int32_t * out) {
    for (int64_t j = 0; j < topk; ++j) out[j] = -1;
    if (n <= topk) {   // every position is selected
        for (int64_t p = 0; p < n; ++p) out[p] = int32_t(p);
        return;
    }
    std::vector<float> sorted(score, score + n);
    std::nth_element(sorted.begin(), sorted.begin() + (topk - 1), sorted.end(), std::greater<float>());
    const float theta = sorted[size_t(topk - 1)];   // the topk-th largest score
    std::vector<int32_t> chosen;
    for (int64_t p = 0; p < n; ++p)
        if (score[p] > theta) chosen.push_back(int32_t(p));
    for (int64_t p = 0; p < n && int64_t(chosen.size()) < topk; ++p)
        if (score[p] == theta) chosen.push_back(int32_t(p));
    std::sort(chosen.begin(), chosen.end());
    for (size_t j = 0; j < chosen.size(); ++j) out[j] = chosen[j];
}

void indexer_topk_ref(const float * qi, const float * ki, const float * wi, int64_t I, int64_t d, int64_t topk,
                      float scale, float * kcache, int64_t n_pages, const batch & b, int32_t * sel) {
    paging_check(b, n_pages, "indexer_topk");
    for (int s = 0; s < b.n_seq(); ++s)   // write the keys first
        for (int64_t t = b.seq_start[size_t(s)]; t < b.seq_start[size_t(s) + 1]; ++t) {
            float * row = paging_row(kcache, b, s, b.pos0[size_t(s)] + t - b.seq_start[size_t(s)], d);
            for (int64_t i = 0; i < d; ++i) row[i] = ki[t * d + i];
        }
    for (int s = 0; s < b.n_seq(); ++s) {
        const int64_t t0 = b.seq_start[size_t(s)], t1 = b.seq_start[size_t(s) + 1];
#pragma omp parallel for schedule(dynamic)
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t pos = b.pos0[size_t(s)] + t - t0;
            std::vector<float> score(size_t(pos + 1));
            for (int64_t p = 0; p <= pos; ++p) {
                const float * kp = paging_row(kcache, b, s, p, d);
                float acc = 0.0f;
                for (int64_t h = 0; h < I; ++h) {   // fixed head order
                    const float * qh = qi + (t * I + h) * d;
                    float dot = 0.0f;
                    for (int64_t i = 0; i < d; ++i) dot += qh[i] * kp[i];
                    acc += wi[t * I + h] * std::max(dot, 0.0f);
                }
                score[size_t(p)] = scale * acc;
            }
            indexer_select_ref(score.data(), pos + 1, topk, sel + t * topk);
        }
    }
}

void run_indexer_topk(const cpu_node_io & io) {
    const node & n = io.n();
    tensor & kc = io.state_in(3);
    PG_CHECK(kc.shape.size() == 3 && kc.dim(1) == io.g.b->page_size && kc.dim(2) == n.p.head_dim_k,
             "{}: key cache {} for page size {} and head dim {}", n.name, shape_str(kc.shape), io.g.b->page_size,
             n.p.head_dim_k);
    PG_CHECK(io.g.b->n_tokens() == io.in.at(0)->dim(0), "{}: batch has {} tokens, q has {}", n.name, io.g.b->n_tokens(),
             io.in.at(0)->dim(0));
    indexer_topk_ref(io.f32_in(0), io.f32_in(1), io.f32_in(2), n.p.n_head, n.p.head_dim_k, n.p.topk, n.p.scale, kc.f32(),
                     kc.dim(0), *io.g.b, (*io.out)[0].as<int32_t>());
}

} // namespace perigee
