// The fused MoE layer kernel (moe-layer-decode.cu, launch_moe_layer_decode) on the GPU, at the Kimi-Linear-48B geometry
// (D 2304, d_ff 1024, 256 BF16 experts, top-8 sigmoid with bias, one shared expert), weights filled on the device:
//  1. fused_equals_unfused: against the launches it replaces, run on the same inputs:
//     - h bit for bit launch_rms_norm's;
//     - the logits against launch_linear_gemv (the router's launcher, v3 as the backend runs it) and an fp64 host dot,
//       within 1e-5 of sum |w h| (the router row is summed in another order, so not bitwise);
//     - ids and weights bit for bit launch_moe_select_small4 over the fused logits, and the ids equal to the selection
//       over the GEMV's logits (the 8th / 9th gap printed);
//     - every expert output (hbuf, y, the shared gate / up / act / down / sum, sum2 = sum + res) bit for bit
//       launch_moe_bf16_decode_shared over the fused h, ids and weights (cfg 1100: the backend's);
//     - for two inputs, and over 20 graph replays (the counters reset by each launch: every replay bit for bit the first);
//     - controls that must FAIL: a flipped bit of y through the comparator; one norm weight scaled by 1.001 (h differs);
//       the table entries of the first pick and an unpicked expert exchanged (y differs); a logit moved by 1e-3 against
//       the logit tolerance; a first barrier that can never complete (cfg 9) must time out with ERR_SYNC_TIMEOUT, the
//       counters reset and the next launch right again.
//  2. refuses: shapes outside the kernel's (D 2048, top-4, softmax route, grouped route), a missing output and sum2
//     without res each return cudaErrorInvalidValue with nothing launched.
//  3. timing: [timing] per MoE layer over a chain of 6 layers of distinct weights (x -> sum2 -> next x), CUDA graphs with
//     PDL: the unfused launches (norm, router GEMV, selection, the pair with the shared slot) vs the fused kernel, with
//     the bytes a layer must read and the D2D copy rate measured in the same run. A benchmark: it reports; it asserts
//     no speed, only that both chains ran without an error flag.
// The cases skip (saying why) on a machine without a CUDA device.
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/prefill-ops.h"
#include "dev-buffer.h"
#include "graph-timer.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace perigee::cuda {
namespace {

bool have_gpu() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define NEED_GPU() \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device on this machine: the fused MoE layer tests need the GPU machine"

constexpr int64_t kD = 2304, kF = 1024, kE = 256, kK = 8;
constexpr float kEps = 1e-6f;

float bf16_to_f32(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Device allocations freed together.
struct pool {
    std::vector<void *> ps;
    ~pool() {
        for (void * p : ps) cudaFree(p);
    }
    template <class T = void>
    T * get(size_t bytes) {
        void * p = nullptr;
        test::cu(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc");
        ps.push_back(p);
        return static_cast<T *>(p);
    }
};

std::vector<float> host_f32(const float * p, int64_t n) {
    std::vector<float> v(size_t(n), 0.0f);
    test::cu(cudaMemcpy(v.data(), p, size_t(n) * 4, cudaMemcpyDeviceToHost), "download");
    return v;
}
std::vector<float> host_bf16(const void * p, int64_t n) {
    std::vector<uint16_t> b(static_cast<size_t>(n));
    test::cu(cudaMemcpy(b.data(), p, size_t(n) * 2, cudaMemcpyDeviceToHost), "download");
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_f32(b[i]);
    return v;
}

// "" when a and b are bit for bit equal, else the first differing index and values.
template <class T>
std::string bitwise(const std::vector<T> & a, const std::vector<T> & b) {
    if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
            return "index " + std::to_string(i) + ": " + std::to_string(double(a[i])) + " vs " + std::to_string(double(b[i]));
    return "";
}

// One MoE layer's weights on the device.
struct layer {
    float * norm_w = nullptr;   // F32 [D]
    const void * router = nullptr;   // BF16 [E, D]
    float * bias = nullptr;     // F32 [E]
    std::vector<dexpert> hex;   // the table, host copy
    dexpert * dex = nullptr;    // the table on the device
    dexpert shared;
};

dexpert_matrix bf16_mat(pool & m, int64_t out, int64_t in, uint64_t seed, float a, cudaStream_t st) {
    dexpert_matrix r;
    void * p = m.get(size_t(out * in * 2));
    test::cu(launch_fill_random(p, out * in, 1, seed, -a, a, st), "fill");
    r.w = p;
    r.type = wtype::BF16;
    r.out = out;
    r.in = in;
    return r;
}

layer make_layer(pool & m, uint64_t seed, cudaStream_t st) {
    layer L;
    L.norm_w = m.get<float>(size_t(kD) * 4);
    test::cu(launch_fill_random(L.norm_w, kD, 0, seed + 1, 0.5f, 1.5f, st), "fill");
    L.router = bf16_mat(m, kE, kD, seed + 2, 0.05f, st).w;
    L.bias = m.get<float>(size_t(kE) * 4);
    test::cu(launch_fill_random(L.bias, kE, 0, seed + 3, -0.02f, 0.02f, st), "fill");
    for (int64_t e = 0; e < kE; ++e)
        L.hex.push_back({bf16_mat(m, kF, kD, seed + 100 + 3 * e, 0.03f, st), bf16_mat(m, kF, kD, seed + 101 + 3 * e, 0.03f, st),
                         bf16_mat(m, kD, kF, seed + 102 + 3 * e, 0.03f, st)});
    L.shared = {bf16_mat(m, kF, kD, seed + 7, 0.03f, st), bf16_mat(m, kF, kD, seed + 8, 0.03f, st),
                bf16_mat(m, kD, kF, seed + 9, 0.03f, st)};
    L.dex = m.get<dexpert>(L.hex.size() * sizeof(dexpert));
    test::cu(cudaMemcpy(L.dex, L.hex.data(), L.hex.size() * sizeof(dexpert), cudaMemcpyHostToDevice), "table");
    return L;
}

const droute kRoute{kE, kK, 1, 1, true, 2.446f, 0};
const dexperts_cfg kCfg{0, 1.0f, 0.0f, kF, kD};

// Every output of one MoE layer (the fused kernel's, or the unfused launches').
struct outs {
    float *h, *logits, *w, *hbuf, *y, *gate, *up, *act, *down, *sum, *sum2;
    int32_t * ids;
    outs(pool & m) {
        h = m.get<float>(kD * 4), logits = m.get<float>(kE * 4), w = m.get<float>(kK * 4), hbuf = m.get<float>(kK * kF * 4);
        y = m.get<float>(kD * 4), gate = m.get<float>(kF * 4), up = m.get<float>(kF * 4), act = m.get<float>(kF * 4);
        down = m.get<float>(kD * 4), sum = m.get<float>(kD * 4), sum2 = m.get<float>(kD * 4);
        ids = m.get<int32_t>(kK * 4);
    }
    void poison(cudaStream_t st) const {   // NaN everywhere, -1 ids: an unwritten output cannot pass
        for (auto [p, n] : {std::pair<float *, int64_t>{h, kD}, {logits, kE}, {w, kK}, {hbuf, kK * kF}, {y, kD}, {gate, kF},
                            {up, kF}, {act, kF}, {down, kD}, {sum, kD}, {sum2, kD}})
            test::cu(cudaMemsetAsync(p, 0xff, size_t(n) * 4, st), "poison");
        test::cu(cudaMemsetAsync(ids, 0xff, kK * 4, st), "poison");
    }
    dmoe_shared shared(const dexpert & w, const float * res) const {
        dmoe_shared s;
        s.w = w;
        s.gate = gate, s.up = up, s.act = act, s.down = down, s.sum = sum, s.res = res, s.sum2 = sum2;
        return s;
    }
};

dmoe_layer fused_args(const layer & L, const float * x, const outs & o, unsigned * sync, int * err) {
    dmoe_layer p;
    p.x = x;
    p.norm_w = dweight{L.norm_w, wtype::F32};
    p.eps = kEps;
    p.router = L.router;
    p.bias = dweight{L.bias, wtype::F32};
    p.rc = kRoute;
    p.experts = L.dex;
    p.E = kE;
    p.c = kCfg;
    p.sh = o.shared(L.shared, x);
    p.h = o.h, p.logits = o.logits, p.ids = o.ids, p.w = o.w, p.hbuf = o.hbuf, p.y = o.y;
    p.sync = sync;
    p.err = err;
    return p;
}

gemv_cfg router_gemv() {   // the backend's form for a 2304-wide router (cuda_options gemv_v3 2, gemv_evict_first)
    gemv_cfg g;
    g.v3 = 2;
    g.evict_first = true;
    return g;
}

// The unfused launches of one layer: norm -> router GEMV -> small selection -> the pair with the shared slot. With
// `over` set, the selection and the pair take the fused run's h and logits (the bitwise comparison of everything after
// the router); else the chain's own.
void unfused(const layer & L, const float * x, const outs & o, int * err, cudaStream_t st, const outs * over = nullptr) {
    test::cu(launch_rms_norm(x, 1, kD, dweight{L.norm_w, wtype::F32}, kEps, o.h, st, true), "norm");
    test::cu(launch_linear_gemv(o.h, 1, kD, dweight{L.router, wtype::BF16}, kE, o.logits, st, router_gemv()), "router");
    const float * lg = over ? over->logits : o.logits;
    const float * h = over ? over->h : o.h;
    test::cu(launch_moe_select_small4(lg, 1, dweight{L.bias, wtype::F32}, kRoute, o.ids, o.w, st), "select");
    test::cu(launch_moe_bf16_decode_shared(h, kD, o.ids, o.w, kK, L.dex, kE, kCfg, o.shared(L.shared, x), o.hbuf, o.y, err, st, 1100),
             "pair");
}

struct snapshot {
    std::vector<float> h, logits, w, hbuf, y, gate, up, act, down, sum, sum2;
    std::vector<int32_t> ids;
    explicit snapshot(const outs & o) {
        h = host_f32(o.h, kD), logits = host_f32(o.logits, kE), w = host_f32(o.w, kK), hbuf = host_f32(o.hbuf, kK * kF);
        y = host_f32(o.y, kD), gate = host_f32(o.gate, kF), up = host_f32(o.up, kF), act = host_f32(o.act, kF);
        down = host_f32(o.down, kD), sum = host_f32(o.sum, kD), sum2 = host_f32(o.sum2, kD);
        ids.resize(kK);
        test::cu(cudaMemcpy(ids.data(), o.ids, kK * 4, cudaMemcpyDeviceToHost), "download");
    }
};

// Every output after the router, bit for bit; "" or the first difference named.
std::string after_router_bitwise(const snapshot & f, const snapshot & r) {
    const std::pair<const char *, std::string> cs[] = {
        {"ids", bitwise(f.ids, r.ids)},   {"w", bitwise(f.w, r.w)},       {"hbuf", bitwise(f.hbuf, r.hbuf)},
        {"y", bitwise(f.y, r.y)},         {"gate", bitwise(f.gate, r.gate)}, {"up", bitwise(f.up, r.up)},
        {"act", bitwise(f.act, r.act)},   {"down", bitwise(f.down, r.down)}, {"sum", bitwise(f.sum, r.sum)},
        {"sum2", bitwise(f.sum2, r.sum2)}};
    for (const auto & c : cs)
        if (!c.second.empty()) return std::string(c.first) + " " + c.second;
    return "";
}

// The logits within tol * sum |w h| of the reference (per expert); "" or the first expert out of it.
std::string logits_close(const std::vector<float> & a, const std::vector<double> & ref, const std::vector<double> & mag,
                         double tol) {
    for (size_t e = 0; e < a.size(); ++e)
        if (!(std::fabs(double(a[e]) - ref[e]) <= tol * mag[e]))
            return "expert " + std::to_string(e) + ": " + std::to_string(a[e]) + " vs " + std::to_string(ref[e]);
    return "";
}

TEST(moe_layer, fused_equals_unfused) {
    NEED_GPU();
    pdl_scope pdl(true);
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    pool m;
    layer L = make_layer(m, 9000, st);
    float * x = m.get<float>(kD * 4);
    unsigned * sync = m.get<unsigned>(64);
    int * err = m.get<int>(64);
    ASSERT_EQ(cudaMemsetAsync(sync, 0, 64, st), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(err, 0, 64, st), cudaSuccess);
    outs fo(m), ro(m), co(m);
    ASSERT_TRUE(moe_layer_decode_supported(kD, kF, kE, kK, kRoute));
    const auto router = host_bf16(L.router, kE * kD);
    for (uint64_t xs : {41u, 77u}) {
        SCOPED_TRACE("x seed " + std::to_string(xs));
        ASSERT_EQ(launch_fill_random(x, kD, 0, xs, -2.0f, 2.0f, st), cudaSuccess);
        fo.poison(st), ro.poison(st), co.poison(st);
        ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, fo, sync, err), st, 1000), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const snapshot f(fo);
        unfused(L, x, ro, err, st, &fo);   // after the router: the fused h and logits
        unfused(L, x, co, err, st);        // the whole chain on its own logits
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const snapshot r(ro), c(co);
        EXPECT_EQ(bitwise(f.h, r.h), "") << "h vs launch_rms_norm";
        EXPECT_EQ(after_router_bitwise(f, r), "") << "the fused outputs vs the unfused launches over the fused logits";
        // the logits: fp64 host dot over the device's own h and weights, against both
        std::vector<double> ref(kE), mag(kE);
        for (int64_t e = 0; e < kE; ++e) {
            double s = 0.0, a = 0.0;
            for (int64_t d = 0; d < kD; ++d) {
                const double t = double(router[size_t(e * kD + d)]) * double(f.h[size_t(d)]);
                s += t, a += std::fabs(t);
            }
            ref[size_t(e)] = s, mag[size_t(e)] = a;
        }
        EXPECT_EQ(logits_close(f.logits, ref, mag, 1e-5), "") << "fused logits vs fp64";
        EXPECT_EQ(logits_close(c.logits, ref, mag, 1e-5), "") << "GEMV logits vs fp64";
        EXPECT_EQ(bitwise(f.ids, c.ids), "") << "the picks over the GEMV's own logits";
        // the margin that makes the last comparison meaningful: the 8th and 9th biased scores
        std::vector<double> b(kE);
        const auto bias = host_f32(L.bias, kE);
        for (int64_t e = 0; e < kE; ++e) b[size_t(e)] = 1.0 / (1.0 + std::exp(-ref[size_t(e)])) + bias[size_t(e)];
        std::sort(b.begin(), b.end(), std::greater<double>());
        std::printf("[moe_layer] x seed %llu: picks %d %d %d %d %d %d %d %d, 8th - 9th biased score %.3g\n", (unsigned long long)xs,
                    f.ids[0], f.ids[1], f.ids[2], f.ids[3], f.ids[4], f.ids[5], f.ids[6], f.ids[7], b[7] - b[8]);
        int herr[ERR_COUNT] = {};
        ASSERT_EQ(cudaMemcpy(herr, err, sizeof(herr), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(herr[ERR_EXPERT_ID], 0);
        EXPECT_EQ(herr[ERR_SYNC_TIMEOUT], 0);
        // controls (first input only)
        if (xs != 41u) continue;
        {   // the comparator sees one flipped bit
            snapshot g = f;
            uint32_t u;
            std::memcpy(&u, &g.y[100], 4);
            u ^= 1u;
            std::memcpy(&g.y[100], &u, 4);
            EXPECT_NE(after_router_bitwise(g, r), "") << "control: a flipped bit of y must be reported";
        }
        {   // the logit tolerance sees a 1e-3 move
            std::vector<float> g = f.logits;
            g[3] += 1e-3f * float(std::fabs(g[3]) + 1.0);
            EXPECT_NE(logits_close(g, ref, mag, 1e-5), "") << "control: a logit moved by 1e-3 must be reported";
        }
        {   // one norm weight scaled: h differs from the reference norm's
            std::vector<float> nw = host_f32(L.norm_w, kD), nw2 = nw;
            nw2[5] *= 1.001f;
            test::cu(cudaMemcpy(L.norm_w, nw2.data(), kD * 4, cudaMemcpyHostToDevice), "upload");
            ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, co, sync, err), st, 1000), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
            EXPECT_NE(bitwise(host_f32(co.h, kD), f.h), "") << "control: a changed norm weight must change h";
            test::cu(cudaMemcpy(L.norm_w, nw.data(), kD * 4, cudaMemcpyHostToDevice), "upload");
        }
        {   // the first pick's table entry exchanged with an unpicked expert's: y differs
            int other = 0;
            while (std::find(f.ids.begin(), f.ids.end(), other) != f.ids.end()) ++other;
            std::vector<dexpert> t = L.hex;
            std::swap(t[size_t(f.ids[0])], t[size_t(other)]);
            test::cu(cudaMemcpy(L.dex, t.data(), t.size() * sizeof(dexpert), cudaMemcpyHostToDevice), "table");
            ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, co, sync, err), st, 1000), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
            const snapshot s(co);
            EXPECT_EQ(bitwise(s.ids, f.ids), "") << "the picks do not depend on the table";
            EXPECT_NE(bitwise(s.y, f.y), "") << "control: exchanged experts must change y";
            test::cu(cudaMemcpy(L.dex, L.hex.data(), L.hex.size() * sizeof(dexpert), cudaMemcpyHostToDevice), "table");
        }
    }
    // 20 graph replays of one launch, each bit for bit the eager run (the counters come back to 0 every time)
    {
        ASSERT_EQ(launch_fill_random(x, kD, 0, 41u, -2.0f, 2.0f, st), cudaSuccess);
        ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, fo, sync, err), st, 1000), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const snapshot f(fo);
        cudaGraph_t gr;
        cudaGraphExec_t ge;
        ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), cudaSuccess);
        EXPECT_EQ(launch_moe_layer_decode(fused_args(L, x, co, sync, err), st, 1000), cudaSuccess);
        ASSERT_EQ(cudaStreamEndCapture(st, &gr), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&ge, gr, 0), cudaSuccess);
        int bad = 0;
        for (int r = 0; r < 20; ++r) {
            co.poison(st);
            ASSERT_EQ(cudaGraphLaunch(ge, st), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
            const snapshot s(co);
            const std::string d = after_router_bitwise(s, f) + bitwise(s.h, f.h) + bitwise(s.logits, f.logits);
            if (!d.empty()) {
                ADD_FAILURE() << "replay " << r << ": " << d;
                ++bad;
            }
        }
        unsigned hs[3];
        ASSERT_EQ(cudaMemcpy(hs, sync, 12, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(hs[0] + hs[1] + hs[2], 0u) << "the counters are reset by every launch";
        std::printf("[moe_layer] 20 graph replays: %d differ from the eager run\n", bad);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(gr);
        // the timeout: a first barrier that can never complete (cfg 9: one router row more than there are) must end
        // with ERR_SYNC_TIMEOUT set and the counters reset, and the next launch must be right again
        ASSERT_EQ(cudaMemsetAsync(err, 0, 64, st), cudaSuccess);
        ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, co, sync, err), st, 1009), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        int herr[ERR_COUNT] = {};
        ASSERT_EQ(cudaMemcpy(herr, err, sizeof(herr), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(herr[ERR_SYNC_TIMEOUT], 1) << "control: an incomplete barrier must be flagged";
        ASSERT_EQ(cudaMemcpy(hs, sync, 12, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(hs[0] + hs[1] + hs[2], 0u) << "the counters are reset after a timed-out launch too";
        ASSERT_EQ(cudaMemsetAsync(err, 0, 64, st), cudaSuccess);
        co.poison(st);
        ASSERT_EQ(launch_moe_layer_decode(fused_args(L, x, co, sync, err), st, 1000), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        const snapshot s(co);
        EXPECT_EQ(after_router_bitwise(s, f), "") << "the launch after a timed-out one";
        std::printf("[moe_layer] timeout control: ERR_SYNC_TIMEOUT %d (must be 1), next launch %s\n", herr[ERR_SYNC_TIMEOUT],
                    after_router_bitwise(s, f).empty() ? "bitwise the eager run" : "DIFFERENT");
    }
    cudaStreamDestroy(st);
}

TEST(moe_layer, refuses) {
    NEED_GPU();
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_FALSE(moe_layer_decode_supported(2048, kF, kE, kK, kRoute));
    EXPECT_FALSE(moe_layer_decode_supported(kD, kF, kE, 4, droute{kE, 4, 1, 1, true, 1.0f, 0}));
    EXPECT_FALSE(moe_layer_decode_supported(kD, kF, kE, kK, droute{kE, kK, 1, 1, true, 1.0f, 1}));
    EXPECT_FALSE(moe_layer_decode_supported(kD, kF, kE, kK, droute{kE, kK, 8, 4, true, 1.0f, 0}));
    EXPECT_TRUE(moe_layer_decode_supported(kD, kF, kE, kK, kRoute));
    EXPECT_TRUE(moe_layer_decode_supported(kD, kF, 64, kK, droute{64, kK, 1, 1, true, 1.0f, 0}));
    pool m;
    // a small layer (E 16) suffices: every refusal happens before a launch
    dexpert_matrix g = bf16_mat(m, kF, kD, 1, 0.1f, st), dn = bf16_mat(m, kD, kF, 2, 0.1f, st);
    layer L;
    L.norm_w = m.get<float>(kD * 4);
    L.router = bf16_mat(m, 16, kD, 3, 0.1f, st).w;
    L.bias = m.get<float>(16 * 4);
    L.hex.assign(16, dexpert{g, g, dn});
    L.dex = m.get<dexpert>(16 * sizeof(dexpert));
    L.shared = {g, g, dn};
    float * x = m.get<float>(kD * 4);
    unsigned * sync = m.get<unsigned>(64);
    int * err = m.get<int>(64);
    outs o(m);
    auto base = [&] {
        dmoe_layer p = fused_args(L, x, o, sync, err);
        p.E = 16;
        p.rc = droute{16, kK, 1, 1, true, 1.0f, 0};
        return p;
    };
    const std::pair<const char *, std::function<void(dmoe_layer &)>> bad[] = {
        {"softmax route", [](dmoe_layer & p) { p.rc.softmax = 1; }},
        {"top-4", [](dmoe_layer & p) { p.rc.topk = 4; }},
        {"E not the route's", [](dmoe_layer & p) { p.E = 32; }},
        {"d_ff 2048", [](dmoe_layer & p) { p.c.d_ff = 2048; }},
        {"F32 shared gate", [](dmoe_layer & p) { p.sh.w.gate.type = wtype::F32; }},
        {"no logits", [](dmoe_layer & p) { p.logits = nullptr; }},
        {"no sync", [](dmoe_layer & p) { p.sync = nullptr; }},
        {"sum2 without res", [](dmoe_layer & p) { p.sh.res = nullptr; }},
        {"misaligned x", [](dmoe_layer & p) { p.x = p.x + 1; }},
    };
    for (const auto & b : bad) {
        dmoe_layer p = base();
        b.second(p);
        EXPECT_EQ(launch_moe_layer_decode(p, st), cudaErrorInvalidValue) << b.first;
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    cudaStreamDestroy(st);
}

// [timing] per layer over a chain of layers, graphs with PDL, median of replays.
TEST(moe_layer, timing) {
    NEED_GPU();
    pdl_scope pdl(true);
    cudaStream_t st;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    pool m;
    constexpr int NL = 6;
    std::vector<layer> Ls;
    for (int l = 0; l < NL; ++l) Ls.push_back(make_layer(m, 20000 + 1000 * uint64_t(l), st));
    std::vector<float *> xs;
    for (int l = 0; l <= NL; ++l) xs.push_back(m.get<float>(kD * 4));
    ASSERT_EQ(launch_fill_random(xs[0], kD, 0, 5, -2.0f, 2.0f, st), cudaSuccess);
    unsigned * sync = m.get<unsigned>(64);
    int * err = m.get<int>(64);
    ASSERT_EQ(cudaMemsetAsync(sync, 0, 64, st), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(err, 0, 64, st), cudaSuccess);
    outs o(m);
    auto chain = [&](bool fused) {
        for (int l = 0; l < NL; ++l) {
            outs ol = o;
            ol.sum2 = xs[size_t(l + 1)];
            if (fused) test::cu(launch_moe_layer_decode(fused_args(Ls[size_t(l)], xs[size_t(l)], ol, sync, err), st, 1000), "fused");
            else unfused(Ls[size_t(l)], xs[size_t(l)], ol, err, st);
        }
    };
    auto time_us = [&](bool fused) { return test::graph_replay_ms(st, [&] { chain(fused); }, 20, 5) * 1000.0 / NL; };
    // the D2D copy rate (read + write) of 1 GiB, median of 5
    double gbs = 0.0;
    {
        const size_t n = size_t(1) << 30;
        void * a = m.get(n), * b = m.get(n);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        std::vector<float> v;
        for (int r = 0; r < 6; ++r) {
            cudaEventRecord(e0, st);
            cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st);
            cudaEventRecord(e1, st);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (r) v.push_back(ms);
        }
        std::sort(v.begin(), v.end());
        gbs = 2.0 * double(n) / (double(v[v.size() / 2]) * 1e-3) / 1e9;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    const double bytes = double(kE * kD * 2) + double(kK + 1) * 3.0 * double(kF * kD * 2);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("[timing] %s: a MoE layer reads %.1f MB (router + %lld routed + 1 shared expert), floor %.1f us at the %.0f GB/s "
                "D2D copy\n", prop.name, bytes / 1e6, (long long)kK, bytes / gbs / 1e3, gbs);
    for (int round = 0; round < 2; ++round) {
        const double u = time_us(false), f = time_us(true);
        std::printf("[timing] round %d, us per MoE layer (chain of %d, graph, PDL): unfused %.2f (%.0f GB/s, %.1f%% of the "
                    "floor), fused %.2f (%.0f GB/s, %.1f%%)\n", round, NL, u, bytes / u / 1e3, 100.0 * bytes / gbs / 1e3 / u, f,
                    bytes / f / 1e3, 100.0 * bytes / gbs / 1e3 / f);
    }
    int herr[ERR_COUNT] = {};
    ASSERT_EQ(cudaMemcpy(herr, err, sizeof(herr), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(herr[ERR_EXPERT_ID], 0);
    EXPECT_EQ(herr[ERR_SYNC_TIMEOUT], 0);
    cudaStreamDestroy(st);
}

} // namespace
} // namespace perigee::cuda
