// MLA_ATTN decode kernels v2 (cuda_options::mla_decode_v2; src/backend/cuda/mla.cu "Decode v2"), v3
// (cuda_options::mla_decode_v3, "Decode v3": three launches, loads before the PDL wait, the step's own keys read from
// c / kr) and v4 (cuda_options::mla_attn_v4, "Decode v4": v3 with the 8-warp attention k_mla_attn_v4, dims split over
// the warps; only where v3 uses 8-head groups, T < 8, else it is v3) vs the CPU reference and vs the first kernels (v1),
// issue 7. Every case runs v1, v2, v3 and v4 (split on; v2, v3 and v4 also with one key range); v3 must also differ
// bitwise from v2 where several key ranges are merged (its combine normalises before summing), and v4 from v3 where a
// tile holds several keys (its scores are summed in another order), else their kernels did not run.
//
// Same shape as test-ops-cuda (STYLE §3.7): fixed, printed seeds; the CPU backend is the reference; the CUDA backend runs
// in guard mode; "measured <= threshold" printed on every line; the latent cache compared exactly (the cache write is
// the same kernel) and every page outside the block tables bitwise untouched. Cases: T 1..64 one token per sequence at
// several positions incl. page boundaries (the new token first / last in its page), ragged chunks (several tokens per
// sequence, pos0 > 0), head counts that do not fill a head group (4, 12) and that do (8, 32), kv_b in BF16 / F16 / F32,
// the key split on and off, and the K3.1 selected-positions path (`sel` from INDEXER_TOPK, and a hand-made selection with
// -1 padding, unordered and duplicated positions, more than one 32-key tile).
// Controls that must FAIL: the comparator family (10x perturbation, negative threshold; v2, v3, v4); v2 bitwise equal
// to v1, v3 to v2, v4 to v3 (must be DIFFERENT: the new kernels ran); v2, v3 and v4 against a reference that lost ONE
// selected key (a dropped key must be visible at this tolerance); a selected position past the token's own position
// must raise the backend's range error (v1 .. v4). A printed timing (reported, not asserted) of the MLA node at the
// Kimi-Linear-48B (32 heads) and K3 (96 heads) widths, ctx 1024, batch 1 and 64, v1 .. v4 in the same run (v4 is v3 at
// batch 64). The run ends with "N passed, N failed".
#include "backend/cpu/cpu-ops.h"
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/fuse-plan.h"
#include "core/error.h"
#include "harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace perigee::test {
namespace {

constexpr double k_tol_f32 = 1e-7;      // NMSE (test-ops-cuda's k_tol_f32)
constexpr double k_tol_mla_abs = 8e-4;  // max abs: MLA output (test-ops-cuda; FlashMLA dense decode)

int g_passed = 0, g_failed = 0;
void tally(bool ok) { (ok ? g_passed : g_failed)++; }

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the CUDA parity runner needs the GPU machine"

// ver 1: the first kernels, 2: v2, 3: v3 (mla.cu "Decode v3": cache write inside q_absorb's launch, combine inside the
// output projection, loads before the PDL wait), 4: v3 with the attention k_mla_attn_v4 (mla.cu "Decode v4"; T < 8).
cuda_options opts(int ver, bool split = true) {
    cuda_options o{true, 8};   // guard mode
    o.mla_decode_v2 = ver >= 2;
    o.mla_decode_v3 = ver >= 3;
    o.mla_attn_v4 = ver >= 4;
    o.mla_split = split;
    return o;
}

// One sequence per entry: lens[s] tokens from pos0[s]; pages handed out in reverse order (sequence s owns pages
// s * pages_per + 0 .. pages_per - 1); two more pages nobody owns.
std::shared_ptr<batch> make_batch(const std::vector<int> & lens, const std::vector<int> & pos0, int ps, int pages_per) {
    auto b = std::make_shared<batch>();
    b->seq_start = {0};
    for (size_t s = 0; s < lens.size(); ++s) {
        b->seq_start.push_back(b->seq_start.back() + lens[s]);
        b->pos0.push_back(pos0[s]);
        b->slot.push_back(int(s));
        std::vector<int32_t> bt;
        for (int p = 0; p < pages_per; ++p) bt.push_back(int32_t(s * size_t(pages_per) + size_t(pages_per - 1 - p)));
        b->block_table.push_back(bt);
    }
    b->ids.assign(size_t(b->seq_start.back()), 0);
    b->page_size = ps;
    return b;
}

struct geo { int H, dn, dr, dv, L; };

struct mla_case {
    arena a;
    std::shared_ptr<batch> b;
    graph g;
    node_ref o, sel;
    tensor * cache = nullptr;
    std::set<int64_t> touched;
    int T = 0;
};

// Builds the MLA node over a random cache. sel_mode: 0 causal, 1 INDEXER_TOPK selection (topk), 2 the given selection.
void build(mla_case & mc, const geo & d, const std::vector<int> & lens, const std::vector<int> & pos0, int ps, dtype wt,
           uint32_t seed, int sel_mode = 0, int topk = 0, const std::vector<int32_t> & given = {}) {
    int max_end = 0;
    for (size_t s = 0; s < lens.size(); ++s) max_end = std::max(max_end, pos0[s] + lens[s]);
    const int pages_per = (max_end + ps - 1) / ps + 1;
    mc.b = make_batch(lens, pos0, ps, pages_per);
    mc.T = mc.b->n_tokens();
    const int T = mc.T, n_pages = int(lens.size()) * pages_per + 2;
    rng r(seed);
    builder bd(mc.b);
    auto qv = r.vec(size_t(T) * d.H * (d.dn + d.dr)), cv = r.vec(size_t(T) * d.L, -0.5f, 0.5f), krv = r.vec(size_t(T) * d.dr);
    auto kvb = r.vec(size_t(d.H) * (d.dn + d.dv) * d.L, -0.08f, 0.08f);
    auto cache0 = r.vec(size_t(n_pages) * ps * (d.L + d.dr), -0.5f, 0.5f);
    mc.cache = &mc.a.f32({n_pages, ps, d.L + d.dr}, cache0);
    for (auto & bt : mc.b->block_table) mc.touched.insert(bt.begin(), bt.end());
    if (sel_mode == 1) {
        const int I = 2, di = 16;
        auto qi = r.vec(size_t(T * I * di)), ki = r.vec(size_t(T * di)), wi = r.vec(size_t(T * I));
        auto kc0 = r.vec(size_t(n_pages) * ps * di);
        tensor & kc = mc.a.f32({n_pages, ps, di}, kc0);
        mc.sel = bd.name(bd.indexer_topk(bd.scale(bd.weight(mc.a.f32({T, I * di}, qi), "qi"), 1.0f),
                                         bd.scale(bd.weight(mc.a.f32({T, di}, ki), "ki"), 1.0f),
                                         bd.scale(bd.weight(mc.a.f32({T, I}, wi), "wi"), 1.0f), bd.state(kc, "index_keys"),
                                         {I, di, topk, 0.25f}),
                         "indexer_topk");
    } else if (sel_mode == 2) {
        tensor & st = mc.a.raw(dtype::I32, {T, int64_t(given.size()) / T});
        std::memcpy(st.data, given.data(), given.size() * 4);
        mc.sel = bd.name(bd.weight(st, "sel"), "sel");
    }
    // a scale that makes the softmax neither flat nor one-hot at these widths
    const float scale = 1.5f / std::sqrt(float(d.dn + d.dr));
    mc.o = bd.name(bd.mla_attn(bd.scale(bd.weight(mc.a.f32({T, d.H * (d.dn + d.dr)}, qv), "q"), 1.0f),
                               bd.scale(bd.weight(mc.a.f32({T, d.L}, cv), "c"), 1.0f),
                               bd.scale(bd.weight(mc.a.f32({T, d.dr}, krv), "kr"), 1.0f),
                               bd.weight(mc.a.typed(wt, {d.H * (d.dn + d.dv), d.L}, kvb), "kv_b"), bd.state(*mc.cache, "mla_cache"),
                               mc.sel, {d.H, d.dn, d.dr, d.dv, d.L, scale}),
                   "mla_attn");
    mc.g = bd.finish(mc.o);
}

std::vector<float> snapshot(const tensor & t) {
    std::vector<float> v(size_t(t.numel()));
    std::memcpy(v.data(), t.data, t.nbytes);
    return v;
}
void restore(tensor & t, const std::vector<float> & v) { std::memcpy(t.data, v.data(), t.nbytes); }

// CPU reference output and cache after the step; the cache is restored to its initial contents.
struct ref_out { std::vector<float> o, cache; };
ref_out run_cpu(mla_case & mc) {
    const auto init = snapshot(*mc.cache);
    auto cpu = backend_cpu_init();
    cpu->check_supported(mc.g);
    cpu->run(mc.g);
    ref_out r{read_f32(*cpu, mc.o), snapshot(*mc.cache)};
    restore(*mc.cache, init);
    return r;
}
struct gpu_out { std::vector<float> o, cache; };
gpu_out run_gpu(mla_case & mc, const cuda_options & opt) {
    const auto init = snapshot(*mc.cache);
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(mc.g);
    gpu->run(mc.g);
    gpu->sync_state_to_host();
    gpu_out r{read_f32(*gpu, mc.o), snapshot(*mc.cache)};
    restore(*mc.cache, init);
    return r;
}

// Output at the MLA tolerance (max abs + NMSE), the cache exactly, untouched pages bitwise.
bool check_case(const std::string & nm, mla_case & mc, const ref_out & ref, const gpu_out & got) {
    bool ok = check(nm + "/o(max abs)", to_f64(ref.o), got.o, metric::MAX_ABS, k_tol_mla_abs);
    ok &= check(nm + "/o(nmse)", to_f64(ref.o), got.o, metric::NMSE, k_tol_f32);
    ok &= check(nm + "/cache", to_f64(ref.cache), got.cache, metric::MAX_ABS, 0.0);
    const auto init = snapshot(*mc.cache);
    const int64_t rows = mc.cache->shape[0], rw = int64_t(init.size()) / rows;
    size_t bad = 0;
    for (int64_t p = 0; p < rows; ++p)
        if (!mc.touched.count(p)) bad += std::memcmp(got.cache.data() + p * rw, init.data() + p * rw, size_t(rw) * 4) != 0;
    std::printf("[%s/untouched pages] changed: %zu <= 0\n", nm.c_str(), bad);
    ok &= bad == 0;
    tally(ok);
    return ok;
}

void controls(const std::string & name, const std::vector<float> & ref, const std::vector<float> & cand) {
    const auto r = to_f64(ref);
    const bool pert = check(name + "/control(perturbed 10x)", r, perturb(r, cand, metric::NMSE, k_tol_f32), metric::NMSE, k_tol_f32);
    const bool neg = compare(r, cand, metric::NMSE, -1.0).ok;
    std::printf("[%s/control] perturbed %s, negative threshold %s (both must FAIL)\n", name.c_str(), pert ? "PASSED" : "FAILED",
                neg ? "PASSED" : "FAILED");
    EXPECT_FALSE(pert);
    EXPECT_FALSE(neg);
    tally(!pert && !neg);
}

void control_differs(const std::string & nm, const std::vector<float> & v2, const std::vector<float> & v1,
                     const char * a = "v2", const char * b = "v1") {
    const bool same = v2.size() == v1.size() && std::memcmp(v2.data(), v1.data(), v2.size() * 4) == 0;
    std::printf("[%s/control(%s bitwise equal to %s)] %s (must be DIFFERENT: the %s kernels ran)\n", nm.c_str(), a, b,
                same ? "EQUAL" : "DIFFERENT", a);
    EXPECT_FALSE(same) << nm;
    tally(!same);
}

const geo k_small{4, 16, 8, 16, 64};
const geo k_real8{8, 128, 64, 128, 512};    // the true latent widths, fewer heads (the CPU reference stays quick)
const geo k_real12{12, 128, 64, 128, 512};  // a head count that leaves part of the last head group empty

// ---- 1. causal decode: one token per sequence ----
TEST(cuda_mla, decode_causal_vs_cpu_v1_v2) {
    NEED_GPU();
    struct cs { geo d; int T; int ps; std::vector<int> pos; dtype wt; };
    // positions: 0 (one key), page boundaries (63 = last slot of page 0, 64 = first slot of page 1 with ps 64; 15/16 for
    // ps 16), 31/32/33 around a key tile, long contexts over many tiles and pages.
    const std::vector<cs> cases = {
        {k_small, 1, 8, {0}, dtype::BF16},           {k_small, 1, 8, {17}, dtype::F32},
        {k_small, 3, 8, {7, 8, 9}, dtype::F16},      {k_real8, 1, 64, {63}, dtype::BF16},
        {k_real8, 1, 64, {64}, dtype::BF16},         {k_real8, 1, 16, {700}, dtype::BF16},
        {k_real8, 2, 16, {15, 16}, dtype::F32},      {k_real8, 5, 64, {0, 31, 32, 33, 127}, dtype::BF16},
        {k_real12, 8, 16, {1, 40, 64, 65, 100, 200, 255, 256}, dtype::BF16},
        {k_real8, 17, 64, {}, dtype::F16},           {k_real8, 64, 64, {}, dtype::BF16},
        {k_real12, 64, 32, {}, dtype::BF16},         {geo{32, 128, 64, 128, 512}, 1, 64, {1024}, dtype::BF16},
    };
    int ci = 0;
    for (const cs & c : cases) {
        std::vector<int> pos = c.pos;
        for (int s = int(pos.size()); s < c.T; ++s) pos.push_back((s * 37) % 300);   // 0..299, page boundaries among them
        const std::vector<int> lens(size_t(c.T), 1);
        mla_case mc;
        build(mc, c.d, lens, pos, c.ps, c.wt, 21000 + uint32_t(ci++));
        const std::string nm = fmt::format("mla-decode/H{}/L{}/T{}/ps{}/pos{}{}/{}", c.d.H, c.d.L, c.T, c.ps, pos[0],
                                           c.T > 1 ? "..." : "", dtype_name(c.wt));
        const ref_out ref = run_cpu(mc);
        const gpu_out v2 = run_gpu(mc, opts(2)), v2one = run_gpu(mc, opts(2, false)), v1 = run_gpu(mc, opts(1));
        const gpu_out v3 = run_gpu(mc, opts(3)), v3one = run_gpu(mc, opts(3, false));
        const gpu_out v4 = run_gpu(mc, opts(4)), v4one = run_gpu(mc, opts(4, false));
        EXPECT_TRUE(check_case(nm + "/v2", mc, ref, v2)) << nm;
        EXPECT_TRUE(check_case(nm + "/v2-one-range", mc, ref, v2one)) << nm;
        EXPECT_TRUE(check_case(nm + "/v3", mc, ref, v3)) << nm;
        EXPECT_TRUE(check_case(nm + "/v3-one-range", mc, ref, v3one)) << nm;
        EXPECT_TRUE(check_case(nm + "/v4", mc, ref, v4)) << nm;
        EXPECT_TRUE(check_case(nm + "/v4-one-range", mc, ref, v4one)) << nm;
        EXPECT_TRUE(check_case(nm + "/v1", mc, ref, v1)) << nm;
        if (c.d.L == 512) control_differs(nm, v2.o, v1.o);
        // v3's combine sums (f_i / den) acc_i where v2 sums f_i acc_i then divides: with several key ranges the two differ
        // in the last bits, so bitwise equality would mean v3's kernels did not run
        if (c.d.L == 512 && c.T == 1 && pos[0] >= 64) control_differs(nm + "/v3-vs-v2", v3.o, v2.o, "v3", "v2");
        // v4 sums each score over 8 warp slices where v3 sums 4 interleaved lanes of the whole row: with several keys in
        // a tile the scores (and so the outputs) differ in the last bits; v4 runs at T < 8 only (8-head groups)
        if (c.d.L == 512 && c.T < 8 && pos[0] >= 31) {
            control_differs(nm + "/v4-vs-v3", v4.o, v3.o, "v4", "v3");
            control_differs(nm + "/v4-one-range-vs-v3", v4one.o, v3one.o, "v4", "v3");
        }
        if (ci == 6 || ci == 11) controls(nm + "/v2", ref.o, v2.o);
        if (ci == 6 || ci == 13) controls(nm + "/v3", ref.o, v3.o);
        if (ci == 6 || ci == 13) controls(nm + "/v4", ref.o, v4.o);
    }
}

// ---- 2. ragged chunks (several tokens per sequence, causal within the chunk), pos0 > 0 ----
TEST(cuda_mla, ragged_chunks_vs_cpu) {
    NEED_GPU();
    struct cs { geo d; std::vector<int> lens, pos0; int ps; };
    const std::vector<cs> cases = {
        {k_small, {20, 3}, {2, 0}, 8},
        {k_real8, {5, 1, 9}, {60, 130, 0}, 64},
        {k_real12, {31, 33}, {1, 33}, 16},
        {k_real8, {3, 2}, {40, 95}, 16},   // T 5 < 8: v4's kernel (8-head groups) on chunks, the step's keys from c / kr
        {k_small, {4, 1}, {6, 0}, 8},
    };
    int ci = 0;
    for (const cs & c : cases) {
        mla_case mc;
        build(mc, c.d, c.lens, c.pos0, c.ps, dtype::BF16, 22000 + uint32_t(ci++));
        const std::string nm = fmt::format("mla-ragged/H{}/L{}/T{}/seqs{}", c.d.H, c.d.L, mc.T, c.lens.size());
        const ref_out ref = run_cpu(mc);
        EXPECT_TRUE(check_case(nm + "/v2", mc, ref, run_gpu(mc, opts(2)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v3", mc, ref, run_gpu(mc, opts(3)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v3-one-range", mc, ref, run_gpu(mc, opts(3, false)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v4", mc, ref, run_gpu(mc, opts(4)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v4-one-range", mc, ref, run_gpu(mc, opts(4, false)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v1", mc, ref, run_gpu(mc, opts(1)))) << nm;
    }
}

// ---- 3. K3.1 selected positions from INDEXER_TOPK ----
TEST(cuda_mla, selected_by_indexer_vs_cpu) {
    NEED_GPU();
    struct cs { geo d; std::vector<int> lens, pos0; int ps, topk; };
    const std::vector<cs> cases = {
        {k_small, {1}, {17}, 8, 5},                 {k_small, {20, 3}, {2, 0}, 8, 5},
        {k_real8, {1, 1, 1}, {10, 64, 300}, 64, 40},   // topk 40 > pos + 1 for the first: -1 padding; 2 tiles
        {k_real12, {1, 1}, {500, 90}, 16, 100},     {k_real8, {4, 1}, {200, 33}, 32, 64},
    };
    int ci = 0;
    for (const cs & c : cases) {
        mla_case mc;
        build(mc, c.d, c.lens, c.pos0, c.ps, dtype::BF16, 23000 + uint32_t(ci++), 1, c.topk);
        const std::string nm = fmt::format("mla-sel/H{}/L{}/T{}/top{}", c.d.H, c.d.L, mc.T, c.topk);
        const ref_out ref = run_cpu(mc);
        EXPECT_TRUE(check_case(nm + "/v2", mc, ref, run_gpu(mc, opts(2)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v2-one-range", mc, ref, run_gpu(mc, opts(2, false)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v3", mc, ref, run_gpu(mc, opts(3)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v3-one-range", mc, ref, run_gpu(mc, opts(3, false)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v4", mc, ref, run_gpu(mc, opts(4)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v4-one-range", mc, ref, run_gpu(mc, opts(4, false)))) << nm;
        EXPECT_TRUE(check_case(nm + "/v1", mc, ref, run_gpu(mc, opts(1)))) << nm;
    }
}

// ---- 4. a given selection: -1 padding anywhere, unordered, duplicated, more than one tile; the dropped-key control;
// a position past the token's own must raise the range error ----
TEST(cuda_mla, selected_given_and_controls) {
    NEED_GPU();
    const geo d = k_real8;
    const std::vector<int> lens{1, 1}, pos0{150, 70};
    const int topk = 45;
    rng r(24000);
    std::vector<int32_t> sel(size_t(2 * topk));
    for (int t = 0; t < 2; ++t)
        for (int j = 0; j < topk; ++j) {
            int32_t p = int32_t(r.randint(0, pos0[size_t(t)]));
            if (j % 7 == 3) p = -1;                   // padding inside the list
            if (j == 10) p = sel[size_t(t * topk + 2)];   // a duplicate
            sel[size_t(t * topk + j)] = p;
        }
    mla_case mc;
    build(mc, d, lens, pos0, 64, dtype::BF16, 24001, 2, 0, sel);
    const std::string nm = "mla-sel-given/H8/L512/T2/top45";
    const ref_out ref = run_cpu(mc);
    const gpu_out v2 = run_gpu(mc, opts(2)), v3 = run_gpu(mc, opts(3)), v4 = run_gpu(mc, opts(4));
    EXPECT_TRUE(check_case(nm + "/v2", mc, ref, v2)) << nm;
    EXPECT_TRUE(check_case(nm + "/v2-one-range", mc, ref, run_gpu(mc, opts(2, false)))) << nm;
    EXPECT_TRUE(check_case(nm + "/v3", mc, ref, v3)) << nm;
    EXPECT_TRUE(check_case(nm + "/v3-one-range", mc, ref, run_gpu(mc, opts(3, false)))) << nm;
    EXPECT_TRUE(check_case(nm + "/v4", mc, ref, v4)) << nm;
    EXPECT_TRUE(check_case(nm + "/v4-one-range", mc, ref, run_gpu(mc, opts(4, false)))) << nm;
    EXPECT_TRUE(check_case(nm + "/v1", mc, ref, run_gpu(mc, opts(1)))) << nm;
    controls(nm + "/v2", ref.o, v2.o);
    controls(nm + "/v3", ref.o, v3.o);
    controls(nm + "/v4", ref.o, v4.o);
    control_differs(nm + "/v4-vs-v3", v4.o, v3.o, "v4", "v3");
    {   // control: the reference with ONE selected key dropped (in the second tile) must not pass for v2's .. v4's output
        auto dropped = sel;
        int j = 40;
        while (dropped[size_t(j)] < 0) ++j;
        dropped[size_t(j)] = -1;
        mla_case md;
        build(md, d, lens, pos0, 64, dtype::BF16, 24001, 2, 0, dropped);
        const ref_out rd = run_cpu(md);
        for (const gpu_out * g : {&v2, &v3, &v4}) {
            const char * vn = g == &v2 ? "v2" : g == &v3 ? "v3" : "v4";
            const bool pass = check(nm + "/control(" + vn + " vs reference without key " + std::to_string(j) + ")", to_f64(rd.o),
                                    g->o, metric::NMSE, k_tol_f32);
            std::printf("[%s/control(dropped key, %s)] %s (must FAIL)\n", nm.c_str(), vn, pass ? "PASSED" : "FAILED");
            EXPECT_FALSE(pass) << vn;
            tally(!pass);
        }
    }
    for (int v : {4, 3, 2, 1}) {   // control: position 71 selected by the token at position 70
        auto bad = sel;
        bad[size_t(topk + 5)] = pos0[1] + 1;
        mla_case mb;
        build(mb, d, lens, pos0, 64, dtype::BF16, 24001, 2, 0, bad);
        bool threw = false;
        try {
            run_gpu(mb, opts(v));
        } catch (const perigee::error & e) {
            threw = true;
            std::printf("[%s/control(selected position past pos, v%d)] raised: %s\n", nm.c_str(), v, e.what());
        }
        EXPECT_TRUE(threw) << "a selected position past the token's own must raise (v" << v << ")";
        tally(threw);
    }
}

// ---- 4b. the MLA kv_a split (cuda_options::fuse_mla_kv, fuse-plan.h rule 6): the model's pattern x [T, L + dr] ->
// COLS(0, L) -> RMS_NORM -> c, COLS(L, dr) -> kr -> MLA_ATTN. The fold's outputs (the raw columns, the normed latent,
// k_rope) and o vs the CPU, and bitwise equal to the unfused kernels (same sums); the plan folds exactly one split, none
// when the option is off, none when the rope COLS is not the rest of the row (control) ----
struct kv_case {
    mla_case mc;
    node_ref a, c, kr;
};
void build_kv(kv_case & kc, const geo & d, const std::vector<int> & lens, const std::vector<int> & pos0, int ps, uint32_t seed,
              int64_t rope_c0 = -1) {
    mla_case & mc = kc.mc;
    int max_end = 0;
    for (size_t s = 0; s < lens.size(); ++s) max_end = std::max(max_end, pos0[s] + lens[s]);
    const int pages_per = (max_end + ps - 1) / ps + 1;
    mc.b = make_batch(lens, pos0, ps, pages_per);
    mc.T = mc.b->n_tokens();
    const int T = mc.T, n_pages = int(lens.size()) * pages_per + 2;
    const int64_t W = d.L + d.dr + (rope_c0 >= 0 ? 4 : 0);
    rng r(seed);
    builder bd(mc.b);
    auto qv = r.vec(size_t(T) * d.H * (d.dn + d.dr)), xv = r.vec(size_t(T * W), -2.0f, 2.0f), nw = r.vec(size_t(d.L), 0.5f, 1.5f);
    auto kvb = r.vec(size_t(d.H) * (d.dn + d.dv) * d.L, -0.08f, 0.08f);
    auto cache0 = r.vec(size_t(n_pages) * ps * (d.L + d.dr), -0.5f, 0.5f);
    mc.cache = &mc.a.f32({n_pages, ps, d.L + d.dr}, cache0);
    for (auto & bt : mc.b->block_table) mc.touched.insert(bt.begin(), bt.end());
    node_ref x = bd.name(bd.scale(bd.weight(mc.a.f32({T, W}, xv), "kv_a"), 1.0f), "mla_kv_a");
    kc.a = bd.name(bd.cols(x, 0, d.L), "kv_cols");
    kc.c = bd.name(bd.rms_norm(kc.a, bd.weight(mc.a.typed(dtype::BF16, {d.L}, nw), "kv_a_layernorm"), 1e-6f), "mla_latent");
    kc.kr = bd.name(bd.cols(x, rope_c0 >= 0 ? rope_c0 : d.L, d.dr), "mla_k_rope");
    const float scale = 1.5f / std::sqrt(float(d.dn + d.dr));
    mc.o = bd.name(bd.mla_attn(bd.scale(bd.weight(mc.a.f32({T, d.H * (d.dn + d.dr)}, qv), "q"), 1.0f), kc.c, kc.kr,
                               bd.weight(mc.a.typed(dtype::BF16, {d.H * (d.dn + d.dv), d.L}, kvb), "kv_b"),
                               bd.state(*mc.cache, "mla_cache"), node_ref{}, {d.H, d.dn, d.dr, d.dv, d.L, scale}),
                   "mla_attn");
    mc.g = bd.finish(mc.o);
}

TEST(cuda_mla, kv_split_fold_vs_cpu) {
    {   // the plan (host only: runs without a GPU)
        kv_case kc;
        build_kv(kc, k_real8, {1, 1}, {70, 3}, 64, 26000);
        cuda_options on, off;
        off.fuse_mla_kv = false;
        const int n_on = cuda_fuse::plan_fusions(kc.mc.g, on).mla_kvs, n_off = cuda_fuse::plan_fusions(kc.mc.g, off).mla_kvs;
        kv_case bad;
        build_kv(bad, k_real8, {1, 1}, {70, 3}, 64, 26000, k_real8.L + 4);   // rope COLS not the rest of the row
        const int n_bad = cuda_fuse::plan_fusions(bad.mc.g, on).mla_kvs;
        std::printf("[mla-kv-split/plan] folds: on %d (must be 1), off %d (must be 0), control(rope cols at L + 4) %d (must be 0)\n",
                    n_on, n_off, n_bad);
        EXPECT_EQ(n_on, 1);
        EXPECT_EQ(n_off, 0);
        EXPECT_EQ(n_bad, 0);
        tally(n_on == 1 && n_off == 0 && n_bad == 0);
    }
    NEED_GPU();
    struct cs { geo d; std::vector<int> lens, pos0; int ps; };
    const std::vector<cs> cases = {{k_real8, {1, 1}, {70, 3}, 64}, {geo{32, 128, 64, 128, 512}, {1}, {1024}, 64},
                                   {k_real12, {5, 1}, {60, 130}, 16}, {k_small, {3}, {9}, 8}};
    int ci = 0;
    for (const cs & c : cases) {
        kv_case kc;
        build_kv(kc, c.d, c.lens, c.pos0, c.ps, 26100 + uint32_t(ci++));
        mla_case & mc = kc.mc;
        const std::string nm = fmt::format("mla-kv-split/H{}/L{}/T{}", c.d.H, c.d.L, mc.T);
        const auto init = snapshot(*mc.cache);
        auto cpu = backend_cpu_init();
        cpu->run(mc.g);
        const auto ra = read_f32(*cpu, kc.a), rc = read_f32(*cpu, kc.c), rk = read_f32(*cpu, kc.kr), ro = read_f32(*cpu, mc.o);
        restore(*mc.cache, init);
        std::vector<float> got[2][4];
        for (int fold = 0; fold < 2; ++fold) {
            cuda_options o = opts(3);
            o.fuse_mla_kv = fold == 1;
            auto gpu = backend_cuda_init(0, o);
            gpu->check_supported(mc.g);
            gpu->run(mc.g);
            got[fold][0] = read_f32(*gpu, kc.a);
            got[fold][1] = read_f32(*gpu, kc.c);
            got[fold][2] = read_f32(*gpu, kc.kr);
            got[fold][3] = read_f32(*gpu, mc.o);
            restore(*mc.cache, init);
        }
        bool ok = true;
        for (int fold = 0; fold < 2; ++fold) {
            const std::string f = nm + (fold ? "/fold" : "/unfused");
            ok &= check(f + "/cols", to_f64(ra), got[fold][0], metric::MAX_ABS, 0.0);
            ok &= check(f + "/latent(nmse)", to_f64(rc), got[fold][1], metric::NMSE, k_tol_f32);
            ok &= check(f + "/k_rope", to_f64(rk), got[fold][2], metric::MAX_ABS, 0.0);
            ok &= check(f + "/o(max abs)", to_f64(ro), got[fold][3], metric::MAX_ABS, k_tol_mla_abs);
            ok &= check(f + "/o(nmse)", to_f64(ro), got[fold][3], metric::NMSE, k_tol_f32);
        }
        for (int k = 0; k < 4; ++k) {
            const bool same = got[0][k].size() == got[1][k].size() &&
                              std::memcmp(got[0][k].data(), got[1][k].data(), got[0][k].size() * 4) == 0;
            std::printf("[%s/fold bitwise unfused, output %d] %s (must be EQUAL)\n", nm.c_str(), k, same ? "EQUAL" : "DIFFERENT");
            ok &= same;
        }
        EXPECT_TRUE(ok) << nm;
        tally(ok);
        if (ci == 1) controls(nm + "/fold latent", rc, got[1][1]);
    }
}

// ---- 5. the switch's default ----
TEST(cuda_mla, default_is_v4) {
    const cuda_options d;
    std::printf("[defaults] mla_decode_v2 %d, mla_decode_v3 %d, mla_attn_v4 %d, mla_split %d\n", int(d.mla_decode_v2),
                int(d.mla_decode_v3), int(d.mla_attn_v4), int(d.mla_split));
    EXPECT_TRUE(d.mla_decode_v2);
    EXPECT_TRUE(d.mla_decode_v3);
    EXPECT_TRUE(d.mla_attn_v4);   // on since its H200 run (session 9 call C)
    EXPECT_TRUE(d.fuse_mla_kv);
}

// ---- 6. timing at the true geometries, ctx 1024 (printed, not asserted) ----
// The node's GPU time (cuda_options::profile_nodes, best of 3 eager runs after one warm-up), v1 (the current defaults
// before v2: key split on), v2, v3 and v4 in the same process; v2 .. v4 also held to v1 at the f32 tolerance on these
// shapes.
double node_time_ms(graph & g, node_ref r, cuda_options opt, std::vector<float> * out) {
    opt.guard = false;
    opt.profile_nodes = true;
    auto gpu = backend_cuda_init(0, opt);
    gpu->check_supported(g);
    gpu->run(g);
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
        gpu->run(g);
        const auto ms = gpu->node_ms();
        if (size_t(r.node) < ms.size()) best = std::min(best, double(ms[size_t(r.node)]));
    }
    if (out) *out = read_f32(*gpu, r);
    return best;
}

TEST(cuda_mla, timing_true_geometries) {
    NEED_GPU();
    struct gm { const char * name; geo d; };
    const gm geos[] = {{"kimi-linear-48b", {32, 128, 64, 128, 512}}, {"k3", {96, 128, 64, 128, 512}}};
    for (const gm & G : geos) {
        for (int B : {1, 64}) {
            const int ctx = 1024, ps = 64;
            mla_case mc;
            build(mc, G.d, std::vector<int>(size_t(B), 1), std::vector<int>(size_t(B), ctx), ps, dtype::BF16,
                  25000 + uint32_t(B) + uint32_t(G.d.H));
            const auto init = snapshot(*mc.cache);
            std::vector<float> o1, o2, o3, o4;
            const double t1 = node_time_ms(mc.g, mc.o, opts(1), &o1);
            restore(*mc.cache, init);
            const double t2 = node_time_ms(mc.g, mc.o, opts(2), &o2);
            restore(*mc.cache, init);
            const double t3 = node_time_ms(mc.g, mc.o, opts(3), &o3);
            restore(*mc.cache, init);
            const double t4 = node_time_ms(mc.g, mc.o, opts(4), &o4);
            restore(*mc.cache, init);
            std::printf("[timing] MLA_ATTN %s H %d ctx %d B %d: v1 %.4f ms, v2 %.4f ms, v3 %.4f ms, v4 %.4f ms%s (v2/v3 %.2fx, "
                        "v3/v4 %.2fx)\n",
                        G.name, G.d.H, ctx, B, t1, t2, t3, t4, B < 8 ? "" : " (= v3: 16-head groups)", t2 / t3, t3 / t4);
            const std::string nm = fmt::format("mla-timing/{}/B{}", G.name, B);
            const bool ok = check(nm + "/v2-vs-v1", to_f64(o1), o2, metric::NMSE, k_tol_f32);
            const bool ok3 = check(nm + "/v3-vs-v1", to_f64(o1), o3, metric::NMSE, k_tol_f32);
            const bool ok4 = check(nm + "/v4-vs-v1", to_f64(o1), o4, metric::NMSE, k_tol_f32);
            EXPECT_TRUE(ok) << nm;
            EXPECT_TRUE(ok3) << nm;
            EXPECT_TRUE(ok4) << nm;
            tally(ok);
            tally(ok3);
            tally(ok4);
        }
    }
}

class summary : public ::testing::Environment {
public:
    void TearDown() override { std::printf("%d passed, %d failed\n", g_passed, g_failed); }
};
const auto * g_env = ::testing::AddGlobalTestEnvironment(new summary);

} // namespace
} // namespace perigee::test
