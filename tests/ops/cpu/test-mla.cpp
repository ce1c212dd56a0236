// MLA_ATTN and INDEXER_TOPK vs naive fp64: paged cache writes, causal attention per sequence, decode continuation,
// sparse selection, traps 2/3 (k_r shared and raw, scale 192^-0.5), 37 (indexer tie rule), "no more keys than topk".
#include "harness.h"

#include "backend/cpu/cpu-ops.h"

#include <algorithm>
#include <numeric>

namespace perigee::test {
namespace {

struct mla_shape { int H, dn, dr, dv, L; };

// Naive expanded MLA for one token: attends over positions `keys` with per-position c [L], kr [dr].
// mutation 1: kr ignored; 2: kr RMS-normalised like c.
void naive_mla_token(const mla_shape & m, const float * q, const std::vector<const float *> & c, const std::vector<const float *> & kr,
                     const std::vector<int> & keys, const std::vector<float> & kvb, double scale, double * o, int mutation = 0) {
    for (int h = 0; h < m.H; ++h) {
        std::vector<double> sc;
        std::vector<std::vector<double>> vs;
        for (int p : keys) {
            std::vector<double> kn(size_t(m.dn), 0.0), v(size_t(m.dv), 0.0);
            for (int i = 0; i < m.dn; ++i)
                for (int l = 0; l < m.L; ++l) kn[size_t(i)] += double(kvb[size_t((h * (m.dn + m.dv) + i) * m.L + l)]) * c[size_t(p)][l];
            for (int i = 0; i < m.dv; ++i)
                for (int l = 0; l < m.L; ++l) v[size_t(i)] += double(kvb[size_t((h * (m.dn + m.dv) + m.dn + i) * m.L + l)]) * c[size_t(p)][l];
            double krn = 1.0;
            if (mutation == 2) {
                double ss = 0;
                for (int i = 0; i < m.dr; ++i) ss += double(kr[size_t(p)][i]) * kr[size_t(p)][i];
                krn = 1.0 / std::sqrt(ss / m.dr + 1e-6);
            }
            double s = 0;
            const float * qh = q + h * (m.dn + m.dr);
            for (int i = 0; i < m.dn; ++i) s += qh[i] * kn[size_t(i)];
            if (mutation != 1)
                for (int i = 0; i < m.dr; ++i) s += double(qh[m.dn + i]) * kr[size_t(p)][i] * krn;   // the same kr for every head
            sc.push_back(s * scale);
            vs.push_back(v);
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (auto & s : sc) sum += (s = std::exp(s - mx));
        for (int i = 0; i < m.dv; ++i) {
            double acc = 0;
            for (size_t j = 0; j < sc.size(); ++j) acc += sc[j] / sum * vs[j][size_t(i)];
            o[h * m.dv + i] = acc;
        }
    }
}

struct mla_step {
    std::vector<float> q, c, kr;   // [T, H*(dn+dr)], [T, L], [T, dr]
};
mla_step make_step(rng & r, const mla_shape & m, int T, float qscale = 1.0f) {
    return {r.vec(size_t(T * m.H * (m.dn + m.dr)), -qscale, qscale), r.vec(size_t(T * m.L)), r.vec(size_t(T * m.dr))};
}

// Runs MLA_ATTN on `cache` (in place).
std::vector<float> run_mla(const mla_shape & m, mla_step & s, std::vector<float> & kvb, dtype kvb_dt, tensor & cache,
                           std::shared_ptr<batch> b, float scale, std::vector<int32_t> * sel = nullptr, int topk = 0) {
    arena a;
    const int T = int(b->ids.size());
    builder bd(b);
    node_ref selr;
    if (sel) {
        tensor & st = a.raw(dtype::I32, {T, topk});
        std::memcpy(st.data, sel->data(), sel->size() * 4);
        selr = bd.weight(st, "sel");
    }
    node_ref o = bd.mla_attn(bd.weight(a.f32({T, m.H * (m.dn + m.dr)}, s.q), "q"), bd.weight(a.f32({T, m.L}, s.c), "c"),
                             bd.weight(a.f32({T, m.dr}, s.kr), "kr"), bd.weight(a.typed(kvb_dt, {m.H * (m.dn + m.dv), m.L}, kvb), "kv_b"),
                             bd.state(cache, "mla_cache"), selr, {m.H, m.dn, m.dr, m.dv, m.L, scale});
    graph g = bd.finish(o);
    return run_f32(g, o);
}

// Two packed sequences in non-contiguous pages, then a decode step continuing sequence 0 from the cache.
TEST(cpu_mla, attn_paged_prefill_and_decode_vs_naive) {
    rng r(401);
    const mla_shape m{3, 16, 8, 12, 24};
    const float scale = 1.0f / std::sqrt(float(m.dn + m.dr));
    const int ps = 4, n_pages = 8, L0 = 7, L1 = 5;
    auto kvb = r.vec(size_t(m.H * (m.dn + m.dv) * m.L), -0.3f, 0.3f);
    for (dtype dt : {dtype::F32, dtype::BF16}) {
        tensor cache = tensor_new(dtype::F32, {n_pages, ps, m.L + m.dr});
        for (int64_t i = 0; i < cache.numel(); ++i) cache.as<float>()[i] = 1000.0f + float(i);   // poison: must never be read
        const tensor cache0 = [&] { tensor c = tensor_new(dtype::F32, cache.shape); std::memcpy(c.data, cache.data, c.nbytes); return c; }();
        auto b = std::make_shared<batch>();
        b->ids.assign(L0 + L1, 0);
        b->seq_start = {0, L0, L0 + L1};
        b->pos0 = {0, 0};
        b->slot = {0, 1};
        b->page_size = ps;
        b->block_table = {{5, 2, 7}, {0, 3}};
        auto step = make_step(r, m, L0 + L1);
        auto kv = kvb;
        auto out = run_mla(m, step, kv, dt, cache, b, scale);   // kv is rounded to the stored dtype
        std::vector<double> ref(size_t((L0 + L1) * m.H * m.dv));
        for (int s = 0; s < 2; ++s) {
            const int t0 = b->seq_start[size_t(s)], n = b->seq_len(s);
            std::vector<const float *> cs, krs;
            for (int i = 0; i < n; ++i) { cs.push_back(&step.c[size_t((t0 + i) * m.L)]); krs.push_back(&step.kr[size_t((t0 + i) * m.dr)]); }
            for (int i = 0; i < n; ++i) {
                std::vector<int> keys(size_t(i + 1));
                std::iota(keys.begin(), keys.end(), 0);
                naive_mla_token(m, &step.q[size_t((t0 + i) * m.H * (m.dn + m.dr))], cs, krs, keys, kv, scale,
                                &ref[size_t((t0 + i) * m.H * m.dv)]);
            }
        }
        const std::string tag = fmt::format("mla_attn prefill kv_b {}", dtype_name(dt));
        EXPECT_TRUE(check(tag, ref, out, metric::NMSE, k_nmse_f32));
        EXPECT_TRUE(check(tag + " max abs", ref, out, metric::MAX_ABS, k_abs_mla));
        if (dt == dtype::F32) {
            expect_control_fails("mla_attn NMSE", ref, out, metric::NMSE, k_nmse_f32);
            expect_control_fails("mla_attn max abs", ref, out, metric::MAX_ABS, k_abs_mla);
        }
        // cache rows written = [c | kr]; untouched pages 1, 4, 6 bit-exact
        const int W = m.L + m.dr;
        bool rows_ok = true;
        for (int s = 0; s < 2; ++s)
            for (int i = 0; i < b->seq_len(s); ++i) {
                const float * row = cache.as<float>() + (b->block_table[size_t(s)][size_t(i / ps)] * ps + i % ps) * W;
                const int t = b->seq_start[size_t(s)] + i;
                rows_ok &= std::memcmp(row, &step.c[size_t(t * m.L)], size_t(m.L) * 4) == 0;
                rows_ok &= std::memcmp(row + m.L, &step.kr[size_t(t * m.dr)], size_t(m.dr) * 4) == 0;
            }
        EXPECT_TRUE(rows_ok) << "cache rows must hold [c | kr] of each token";
        for (int p : {1, 4, 6})
            EXPECT_TRUE(check_bitwise(fmt::format("untouched page {}", p), cache.as<float>() + p * ps * W, cache0.as<float>() + p * ps * W,
                                      size_t(ps * W) * 4));
        // decode: one more token of sequence 0 at position L0, reading positions 0..L0-1 from the cache only
        auto bd1 = std::make_shared<batch>();
        bd1->ids = {0};
        bd1->seq_start = {0, 1};
        bd1->pos0 = {L0};
        bd1->slot = {0};
        bd1->page_size = ps;
        bd1->block_table = {{5, 2, 7}};
        auto dstep = make_step(r, m, 1);
        auto kv2 = kvb;
        auto dout = run_mla(m, dstep, kv2, dt, cache, bd1, scale);
        std::vector<const float *> cs, krs;
        for (int i = 0; i < L0; ++i) { cs.push_back(&step.c[size_t(i * m.L)]); krs.push_back(&step.kr[size_t(i * m.dr)]); }
        cs.push_back(dstep.c.data());
        krs.push_back(dstep.kr.data());
        std::vector<int> keys(size_t(L0 + 1));
        std::iota(keys.begin(), keys.end(), 0);
        std::vector<double> dref(size_t(m.H * m.dv));
        naive_mla_token(m, dstep.q.data(), cs, krs, keys, kv2, scale, dref.data());
        EXPECT_TRUE(check(fmt::format("mla_attn decode after prefill kv_b {}", dtype_name(dt)), dref, dout, metric::NMSE, k_nmse_f32));
    }
}

// Traps 2 and 3: k_r is one vector shared by all heads, used raw (not normed); the scale is (dn+dr)^-0.5 = 192^-0.5.
TEST(cpu_mla, trap_2_kr_shared_raw_and_trap_3_scale_192) {
    rng r(402);
    const mla_shape m{2, 128, 64, 16, 32};
    const int T = 6;
    const double scale = 1.0 / std::sqrt(192.0);
    auto kvb = r.vec(size_t(m.H * (m.dn + m.dv) * m.L), -0.2f, 0.2f);
    auto step = make_step(r, m, T, 2.0f);   // distinct per-head q_r, large logits
    for (auto & v : step.kr) v *= 3.0f;     // nonzero, not unit-RMS k_r
    tensor cache = tensor_new(dtype::F32, {2, 8, m.L + m.dr});
    auto b = batch_simple(T);
    b->page_size = 8;
    b->block_table = {{1}};
    auto out = run_mla(m, step, kvb, dtype::F32, cache, b, float(scale));
    auto naive = [&](double sc, int mutation) {
        std::vector<double> ref(size_t(T * m.H * m.dv));
        std::vector<const float *> cs, krs;
        for (int i = 0; i < T; ++i) { cs.push_back(&step.c[size_t(i * m.L)]); krs.push_back(&step.kr[size_t(i * m.dr)]); }
        for (int i = 0; i < T; ++i) {
            std::vector<int> keys(size_t(i + 1));
            std::iota(keys.begin(), keys.end(), 0);
            naive_mla_token(m, &step.q[size_t(i * m.H * (m.dn + m.dr))], cs, krs, keys, kvb, sc, &ref[size_t(i * m.H * m.dv)], mutation);
        }
        return ref;
    };
    EXPECT_TRUE(check("mla_attn 192^-0.5", naive(scale, 0), out, metric::NMSE, k_nmse_f32));
    EXPECT_FALSE(check("trap_3/mutation(scale 128^-0.5)", naive(1.0 / std::sqrt(128.0), 0), out, metric::NMSE, k_nmse_f32));
    EXPECT_FALSE(check("trap_2/mutation(k_r dropped)", naive(scale, 1), out, metric::NMSE, k_nmse_f32));
    EXPECT_FALSE(check("trap_2/mutation(k_r normed)", naive(scale, 2), out, metric::NMSE, k_nmse_f32));
}

// With a selection input, only the listed positions are attended (-1 = unused).
TEST(cpu_mla, attn_with_selection) {
    rng r(403);
    const mla_shape m{2, 8, 4, 8, 16};
    const int T = 9, topk = 4;
    const float scale = 1.0f / std::sqrt(12.0f);
    auto kvb = r.vec(size_t(m.H * (m.dn + m.dv) * m.L), -0.3f, 0.3f);
    auto step = make_step(r, m, T);
    std::vector<int32_t> sel(size_t(T * topk), -1);
    std::vector<std::vector<int>> keys(T);
    for (int t = 0; t < T; ++t) {
        std::vector<int> all(size_t(t + 1));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), r.gen);
        const int n = std::min(t + 1, r.randint(1, topk));
        keys[size_t(t)].assign(all.begin(), all.begin() + n);
        std::sort(keys[size_t(t)].begin(), keys[size_t(t)].end());
        for (int j = 0; j < n; ++j) sel[size_t(t * topk + j)] = keys[size_t(t)][size_t(j)];
    }
    tensor cache = tensor_new(dtype::F32, {4, 4, m.L + m.dr});
    auto b = batch_simple(T);
    b->page_size = 4;
    b->block_table = {{3, 0, 2}};
    auto out = run_mla(m, step, kvb, dtype::F32, cache, b, scale, &sel, topk);
    std::vector<double> ref(size_t(T * m.H * m.dv)), dense(size_t(T * m.H * m.dv));
    std::vector<const float *> cs, krs;
    for (int i = 0; i < T; ++i) { cs.push_back(&step.c[size_t(i * m.L)]); krs.push_back(&step.kr[size_t(i * m.dr)]); }
    for (int t = 0; t < T; ++t) {
        naive_mla_token(m, &step.q[size_t(t * m.H * (m.dn + m.dr))], cs, krs, keys[size_t(t)], kvb, scale, &ref[size_t(t * m.H * m.dv)]);
        std::vector<int> all(size_t(t + 1));
        std::iota(all.begin(), all.end(), 0);
        naive_mla_token(m, &step.q[size_t(t * m.H * (m.dn + m.dr))], cs, krs, all, kvb, scale, &dense[size_t(t * m.H * m.dv)]);
    }
    EXPECT_TRUE(check("mla_attn selected", ref, out, metric::NMSE, k_nmse_f32));
    EXPECT_FALSE(check("mla_attn selected/mutation(dense)", dense, out, metric::NMSE, k_nmse_f32));
}

// ---------- INDEXER_TOPK ----------
// Naive: fp64 scores, then a stable order by (score desc, position asc), first topk, ascending, -1 padded.
std::vector<int32_t> naive_select(const std::vector<double> & score, int topk, bool high_positions_win = false) {
    std::vector<int32_t> pos(score.size());
    std::iota(pos.begin(), pos.end(), 0);
    std::stable_sort(pos.begin(), pos.end(), [&](int a, int b) {
        if (score[size_t(a)] != score[size_t(b)]) return score[size_t(a)] > score[size_t(b)];
        return high_positions_win ? a > b : a < b;
    });
    pos.resize(std::min(size_t(topk), pos.size()));
    std::sort(pos.begin(), pos.end());
    pos.resize(size_t(topk), -1);
    return pos;
}

struct idx_step { std::vector<float> qi, ki, wi; };

std::vector<int32_t> run_indexer(int I, int d, int topk, float scale, idx_step & s, tensor & kc, std::shared_ptr<batch> b) {
    arena a;
    const int T = int(b->ids.size());
    builder bd(b);
    node_ref sel = bd.indexer_topk(bd.weight(a.f32({T, I * d}, s.qi), "qi"), bd.weight(a.f32({T, d}, s.ki), "ki"),
                                   bd.weight(a.f32({T, I}, s.wi), "wi"), bd.state(kc, "idx_cache"), {I, d, topk, scale});
    graph g = bd.finish(sel);
    auto be = backend_cpu_init();
    be->run(g);
    return read_i32(*be, sel);
}

// keys_of(pos) for the naive: the step's ki rows of the sequence, in position order
std::vector<int32_t> naive_indexer(int I, int d, int topk, double scale, const float * qi_t, const float * wi_t,
                                   const std::vector<const float *> & keys, bool mut = false) {
    std::vector<double> score;
    for (const float * k : keys) {
        double acc = 0;
        for (int h = 0; h < I; ++h) {
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(qi_t[h * d + i]) * k[i];
            acc += wi_t[h] * std::max(dot, 0.0);
        }
        score.push_back(scale * acc);
    }
    return naive_select(score, topk, mut);
}

TEST(cpu_indexer, topk_random_two_sequences_with_cached_prefix) {
    rng r(501);
    const int I = 4, d = 16, topk = 7, ps = 8;
    const float scale = 1.0f / std::sqrt(float(I * d));
    tensor kc = tensor_new(dtype::F32, {6, ps, d});
    // step 1: sequence A prefill of 12 tokens (pages 4, 1)
    auto b1 = batch_simple(12);
    b1->page_size = ps;
    b1->block_table = {{4, 1}};
    idx_step s1{r.vec(size_t(12 * I * d)), r.vec(size_t(12 * d)), r.vec(size_t(12 * I), -1, 1)};
    auto out1 = run_indexer(I, d, topk, scale, s1, kc, b1);
    // step 2: A continues with 9 tokens at pos 12 (pages 4, 1, 5), B prefills 10 tokens (pages 0, 2)
    auto b2 = std::make_shared<batch>();
    b2->ids.assign(19, 0);
    b2->seq_start = {0, 9, 19};
    b2->pos0 = {12, 0};
    b2->slot = {0, 1};
    b2->page_size = ps;
    b2->block_table = {{4, 1, 5}, {0, 2}};
    idx_step s2{r.vec(size_t(19 * I * d)), r.vec(size_t(19 * d)), r.vec(size_t(19 * I), -1, 1)};
    auto out2 = run_indexer(I, d, topk, scale, s2, kc, b2);
    std::vector<int32_t> ref1, ref2;
    std::vector<const float *> keysA, keysB;
    for (int t = 0; t < 12; ++t) {
        keysA.push_back(&s1.ki[size_t(t * d)]);
        auto v = naive_indexer(I, d, topk, scale, &s1.qi[size_t(t * I * d)], &s1.wi[size_t(t * I)], keysA);
        ref1.insert(ref1.end(), v.begin(), v.end());
    }
    for (int t = 0; t < 19; ++t) {
        auto & keys = t < 9 ? keysA : keysB;
        keys.push_back(&s2.ki[size_t(t * d)]);
        auto v = naive_indexer(I, d, topk, scale, &s2.qi[size_t(t * I * d)], &s2.wi[size_t(t * I)], keys);
        ref2.insert(ref2.end(), v.begin(), v.end());
    }
    EXPECT_TRUE(check_exact_i32("indexer prefill", ref1, out1));
    EXPECT_TRUE(check_exact_i32("indexer continuation + second sequence", ref2, out2));
    auto bad = out2;
    std::swap(bad[size_t(9 * topk)], bad[size_t(9 * topk + 1)]);   // control: swap two ids
    EXPECT_FALSE(check_exact_i32("indexer/control(two ids swapped)", ref2, bad));
}

// Trap 37: planted equal scores straddling the threshold: the lowest positions win; exact zeros from relu too.
TEST(cpu_indexer, trap_37_tie_rule_planted_ties) {
    const int I = 2, d = 8, topk = 5, T = 12;
    // score(s) proportional to alpha[s] (keys alpha*u, all q_h.u > 0, w > 0); alpha 0 gives an exact zero.
    const float alpha[T] = {1, 3, 2, 3, 0, 2, 2, 5, 2, 0, 1, 2};
    idx_step s;
    for (int t = 0; t < T; ++t) {
        for (int h = 0; h < I; ++h)
            for (int i = 0; i < d; ++i) s.qi.push_back(0.25f + 0.125f * float((h + i) % 3));
        for (int i = 0; i < d; ++i) s.ki.push_back(alpha[t] * 0.5f);
        for (int h = 0; h < I; ++h) s.wi.push_back(1.0f + float(h));
    }
    tensor kc = tensor_new(dtype::F32, {2, 16, d});
    auto b = batch_simple(T);
    b->page_size = 16;
    b->block_table = {{1}};
    auto out = run_indexer(I, d, topk, 0.5f, s, kc, b);
    const std::vector<int32_t> last(out.end() - topk, out.end());
    const std::vector<int32_t> expect_last = {1, 2, 3, 5, 7};   // > theta: 7, 1, 3; theta = 2: positions 2, 5 (not 6, 8, 11)
    EXPECT_TRUE(check_exact_i32("trap_37 last token", expect_last, last));
    std::vector<int32_t> ref, ref_mut;
    std::vector<const float *> keys;
    for (int t = 0; t < T; ++t) {
        keys.push_back(&s.ki[size_t(t * d)]);
        auto v = naive_indexer(I, d, topk, 0.5, &s.qi[size_t(t * I * d)], &s.wi[size_t(t * I)], keys);
        ref.insert(ref.end(), v.begin(), v.end());
        auto vm = naive_indexer(I, d, topk, 0.5, &s.qi[size_t(t * I * d)], &s.wi[size_t(t * I)], keys, true);
        ref_mut.insert(ref_mut.end(), vm.begin(), vm.end());
    }
    EXPECT_TRUE(check_exact_i32("trap_37 all tokens", ref, out));
    EXPECT_FALSE(check_exact_i32("trap_37/mutation(higher positions win ties)", ref_mut, out));
    // theta = 0 straddling the cut (relu zeros): the selection rule itself, on planted scores
    const float zs[8] = {0, 0.5f, 0, 0, 0.25f, 0, 0, 0};
    std::vector<int32_t> sel0(5);
    indexer_select_ref(zs, 8, 5, sel0.data());
    EXPECT_TRUE(check_exact_i32("trap_37 theta = 0", {0, 1, 2, 3, 4}, sel0));   // 1, 4 (> 0), then zeros at 0, 2, 3
}

TEST(cpu_indexer, no_more_keys_than_topk_selects_everything) {
    rng r(502);
    const int I = 3, d = 8, topk = 8, T = 6;
    idx_step s{r.vec(size_t(T * I * d)), r.vec(size_t(T * d)), r.vec(size_t(T * I), -1, 1)};
    tensor kc = tensor_new(dtype::F32, {1, 8, d});
    auto b = batch_simple(T);
    b->page_size = 8;
    b->block_table = {{0}};
    auto out = run_indexer(I, d, topk, 1.0f, s, kc, b);
    std::vector<int32_t> ref;
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < topk; ++j) ref.push_back(j <= t ? j : -1);
    EXPECT_TRUE(check_exact_i32("indexer selects everything when pos+1 <= topk", ref, out));
}

} // namespace
} // namespace perigee::test
