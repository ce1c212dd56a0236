// bench-kernels: the card's two ceilings and the decode kernels against them, measured in one run.
//   copy:  device-to-device copy of 2 GiB (bytes read + written) -> the HBM bandwidth ceiling
//   gemm:  cuBLASLt bf16 x bf16 -> f32, 8192^3 -> the bf16 matrix ceiling
//   gemv:  the backend's LINEAR GEMV kernels (bf16 weights, T = 1 and 8) on K3's dense shapes, each cuda_options::gemv_unroll
//          variant side by side (weights rotated over > 3x the L2; graphs of back-to-back launches)
//   gemv48: the same at the Kimi-Linear-48B geometry, T = 1: the kernels the step runs now vs v3 (gemv_cfg::v3); the
//          argument "gemv48" runs only the copy ceiling and these lines
//   moe:   MOE_EXPERTS decode, MXFP4 experts at K3's latent-MoE widths, 16 of 64 experts selected
//   kda:   KDA recurrent decode step at K3 widths (H 96, K = V = 128), state rotated over 16 slots
//   route: MOE_ROUTE decode (T = 1 and 8): the router GEMV (u0 / u4) then each selection (block, sort, radix), and the
//          one-launch route at T = 1, at the Kimi-Linear-48B and K3 router geometries; the argument "route" runs only
//          the copy ceiling and these lines
//   attnres: ATTN_RES_MIX decode at K3's width (split / chunked / one-launch cluster), cold and L2-hot candidates; the
//          argument "attnres" runs only the copy ceiling and these lines
// Every figure: median of 20 timed launches after 3 warm-ups, cudaEvent timing, inputs random (never zeros).
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/fuse-ops.h"
#include "backend/cuda/prefill-ops.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

using namespace perigee::cuda;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::fprintf(stderr, "%s: status %d\n", #x, int(s_)); std::exit(1); } } while (0)

static cudaStream_t st;

static double median_ms(const std::function<void()> & f, int reps = 20) {
    for (int i = 0; i < 3; ++i) f();
    CK(cudaStreamSynchronize(st));
    std::vector<double> v;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(a, st));
        f();
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Microseconds per call of f(i), i = 0 .. nl-1, as a CUDA graph of those nl calls (median of 7 replays / nl); f(0) runs
// once eagerly first, outside any capture (one-time function attributes).
static double graph_us(int nl, const std::function<void(int)> & f) {
    f(0);
    CK(cudaStreamSynchronize(st));
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < nl; ++i) f(i);
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    const double ms = median_ms([&] { CK(cudaGraphLaunch(ge, st)); }, 7) / nl;
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(gr));
    return ms * 1e3;
}

static void * dev_random(size_t bytes, uint32_t seed, bool as_bf16 = false) {
    std::vector<uint16_t> h(bytes / 2);
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto & x : h) {
        if (as_bf16) {
            const float f = u(g) * 0.05f;
            uint32_t b;
            std::memcpy(&b, &f, 4);
            x = uint16_t(b >> 16);
        } else {
            x = uint16_t(g());
        }
    }
    void * d;
    CK(cudaMalloc(reinterpret_cast<void **>(&d), bytes));
    CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    return d;
}

// route: MOE_ROUTE at decode: the router GEMV (u0 = the first kernels, u4 = v2 with the row split) then a selection
// (block = moe.cu k_moe_select, sort = moe_select_sort, radix = moe_select_radix), at the Kimi-Linear-48B (256 x 2304,
// top-8) and K3 (896 x 7168, top-16) routers, sigmoid + bias, renormalized. Each figure: a CUDA graph of 64 back-to-back
// launches (or GEMV + selection pairs) with PDL on, router weights rotated over >= 160 MB, median of 7 replays / 64.
static void bench_route() {
    pdl_scope pdl(true);
    struct geo { const char * name; int E, k; int64_t D; };
    for (const geo & g : {geo{"48B", 256, 8, 2304}, geo{"K3", 896, 16, 7168}}) {
        const size_t wbytes = size_t(g.E) * size_t(g.D) * 2;
        const int copies = int((size_t(160) << 20) / wbytes + 1), nl = 64;
        std::vector<void *> wc{dev_random(wbytes, 21, true)};
        for (int i = 1; i < copies; ++i) {
            void * d;
            CK(cudaMalloc(&d, wbytes));
            CK(cudaMemcpy(d, wc[0], wbytes, cudaMemcpyDeviceToDevice));
            wc.push_back(d);
        }
        float *x, *lg, *w, *bias;
        int32_t * ids;
        CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(8 * g.D) * 4));
        CK(cudaMemset(x, 0x3c, size_t(8 * g.D) * 4));   // ~0.0115: logits = row sums of random bf16, all distinct
        CK(cudaMalloc(reinterpret_cast<void **>(&bias), size_t(g.E) * 4));
        CK(cudaMemset(bias, 0x3c, size_t(g.E) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&lg), size_t(8 * g.E) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&ids), size_t(8 * g.k) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&w), size_t(8 * g.k) * 4));
        const droute r{g.E, g.k, 1, 1, true, 2.5f, 0};
        using sel_fn = cudaError_t (*)(const float *, int64_t, dweight, const droute &, int32_t *, float *, cudaStream_t);
        const std::pair<const char *, sel_fn> sels[] = {
            {"block", launch_moe_select}, {"sort", launch_moe_select_sort}, {"radix", launch_moe_select_radix}};
        const std::pair<const char *, gemv_cfg> gemvs[] = {{"u0", gemv_cfg{0, 0}}, {"u4", gemv_cfg{4, 0}}};
        auto graph_us = [&](const std::function<void(int)> & f) { return ::graph_us(nl, f); };
        for (int T : {1, 8}) {
            auto gemv = [&](int i, const gemv_cfg & cfg) {
                CK(launch_linear_gemv(x, T, g.D, dweight{wc[size_t(i % copies)], wtype::BF16}, g.E, lg, st, cfg));
            };
            std::printf("route  %-3s [%3d x %4lld] top-%-2d T=%d us:", g.name, g.E, (long long)g.D, g.k, T);
            for (const auto & gv : gemvs) std::printf(" gemv %s %.2f |", gv.first, graph_us([&](int i) { gemv(i, gv.second); }));
            for (const auto & sv : sels)
                std::printf(" %s %.2f |", sv.first, graph_us([&](int) { CK(sv.second(lg, T, {bias, wtype::F32}, r, ids, w, st)); }));
            for (const auto & gv : gemvs)
                for (const auto & sv : sels)
                    std::printf(" %s+%s %.2f", gv.first, sv.first, graph_us([&](int i) {
                                    gemv(i, gv.second);
                                    CK(sv.second(lg, T, {bias, wtype::F32}, r, ids, w, st));
                                }));
            if (T == 1) {   // one launch (moe_route_fused_radix); its counter starts at 0 and every launch leaves it at 0
                unsigned * ctr;
                CK(cudaMalloc(reinterpret_cast<void **>(&ctr), 4));
                CK(cudaMemset(ctr, 0, 4));
                std::printf(" | fused %.2f", graph_us([&](int i) {
                                CK(launch_moe_route_radix_fused(x, g.D, dweight{wc[size_t(i % copies)], wtype::BF16},
                                                                {bias, wtype::F32}, r, lg, ctr, ids, w, st));
                            }));
                CK(cudaFree(ctr));
            }
            std::printf("\n");
        }
        for (void * p : wc) CK(cudaFree(p));
        for (void * p : {static_cast<void *>(x), static_cast<void *>(lg), static_cast<void *>(w), static_cast<void *>(bias),
                         static_cast<void *>(ids)})
            CK(cudaFree(p));
    }
}

// attnres: ATTN_RES_MIX at decode, K3 width (D 7168), n candidates (f32), bf16 norm weight, f32 projection: the split
// form (score block per candidate, then the mix), the chunked form at 1024 (cuda_options::attn_res_chunk, two launches)
// and the one-launch cluster form (cuda_options::attn_res_cluster). Each figure: a CUDA graph of 64 back-to-back mixes
// with PDL on, median of 7 replays / 64: us per mix. "cold": each mix reads its own candidate set, 256 sets rotated
// (> the 50 MB L2 at n 9); "hot": one set (L2-resident). The argument "attnres" runs only the copy ceiling and these.
static void bench_attnres() {
    pdl_scope pdl(true);
    const int64_t D = 7168, nsets = 256;
    const int nl = 64;
    for (int R : {1, 4}) {
        for (int n : {3, 6, 9}) {
            const size_t set_floats = size_t(n) * size_t(R * D);
            float *cand, *y, *part, *pw;
            uint16_t * nw;
            CK(cudaMalloc(reinterpret_cast<void **>(&cand), set_floats * size_t(nsets) * 4));
            CK(launch_fill_random(cand, int64_t(set_floats) * nsets, 0, 31, -2.0f, 2.0f, st));
            CK(cudaMalloc(reinterpret_cast<void **>(&nw), size_t(D) * 2));
            CK(launch_fill_random(nw, D, 1, 32, 0.5f, 1.5f, st));
            CK(cudaMalloc(reinterpret_cast<void **>(&pw), size_t(D) * 4));
            CK(launch_fill_random(pw, D, 0, 33, -1.0f, 1.0f, st));
            CK(cudaMalloc(reinterpret_cast<void **>(&y), size_t(R * D) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&part), size_t(attn_res_chunk_parts(n, R, D, 1024) + R * n) * 4));
            const dweight dnw{nw, wtype::BF16}, dpw{pw, wtype::F32};
            auto cands = [&](int set) {
                cand_ptrs cp{};
                for (int i = 0; i < n; ++i) cp.p[i] = cand + size_t(set) * set_floats + size_t(i) * size_t(R * D);
                return cp;
            };
            auto graph_us = [&](const std::function<void(int)> & f) { return ::graph_us(nl, f); };
            std::printf("attnres K3 D=%lld n=%d R=%d us per mix:", (long long)D, n, R);
            int set = 0;   // advances over the whole run: consecutive replays never start on a set the last one left in L2
            for (bool cold : {true, false}) {
                auto pick = [&] { return cold ? (set++ % int(nsets)) : 0; };
                std::printf(" %s: split %.2f", cold ? "cold" : "| hot",
                            graph_us([&](int) { CK(launch_attn_res_mix(cands(pick()), n, R, D, dnw, dpw, 1e-6f, part, y, st)); }));
                std::printf(" chunked1024 %.2f", graph_us([&](int) {
                                CK(launch_attn_res_mix_chunked(cands(pick()), n, R, D, dnw, dpw, 1e-6f, 1024, part, y, st));
                            }));
                std::printf(" cluster1024 %.2f", graph_us([&](int) {
                                CK(launch_attn_res_mix_cluster(cands(pick()), n, R, D, dnw, dpw, 1e-6f, 1024, y, st));
                            }));
            }
            std::printf("\n");
            for (void * p : {static_cast<void *>(cand), static_cast<void *>(y), static_cast<void *>(part), static_cast<void *>(pw),
                             static_cast<void *>(nw)})
                CK(cudaFree(p));
        }
    }
}

// mla: MLA_ATTN absorbed decode (mla.cu; cuda_options::mla_decode_v2 / mla_decode_v3) at the Kimi-Linear-48B (32 heads)
// and K3 (96 heads) widths (kv_lora 512, rope 64, nope 128, v 128, bf16 kv_b), context 1024 (page size 64), T = 1 and 8
// (one token per sequence). Each figure: a CUDA graph of 64 back-to-back MLA launches with PDL on (as in the decode
// step's graph), each over its own latent cache (24 caches rotated: > the 50 MB L2 at T = 1), median of 7 replays / 64:
// us per MLA layer. The argument "mla" runs only the copy ceiling and these lines.
static void bench_mla() {
    pdl_scope pdl(true);
    struct geo { const char * name; int64_t H; };
    for (const geo & g : {geo{"48B", 32}, geo{"K3", 96}}) {
        const mla_shape d{g.H, 128, 64, 128, 512};
        const int64_t L = d.kv_lora_rank, dr = d.head_dim_rope, W = L + dr, ctx = 1024, ps = 64;
        for (int T : {1, 8}) {
            const int64_t pages = (ctx + 1 + ps - 1) / ps, n_pages = pages * T;
            const int nc = 24, nl = 64;
            std::vector<float *> caches;
            for (int i = 0; i < nc; ++i) {   // 0x3c3c3c3c ~ 0.0115 everywhere: a flat softmax (timing only, finite)
                float * cc;
                CK(cudaMalloc(reinterpret_cast<void **>(&cc), size_t(n_pages * ps * W) * 4));
                CK(cudaMemset(cc, 0x3c, size_t(n_pages * ps * W) * 4));
                caches.push_back(cc);
            }
            float *q, *c, *kr, *o, *scr;
            int *err;
            const size_t qn = size_t(T * d.n_head * (d.head_dim_nope + dr));
            std::vector<float> hq(qn), hc(size_t(T * L)), hk(size_t(T * dr));
            std::mt19937 rg(7);
            std::uniform_real_distribution<float> u(-0.05f, 0.05f);
            for (auto & v : hq) v = u(rg);
            for (auto & v : hc) v = u(rg);
            for (auto & v : hk) v = u(rg);
            CK(cudaMalloc(reinterpret_cast<void **>(&q), qn * 4));
            CK(cudaMemcpy(q, hq.data(), qn * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(reinterpret_cast<void **>(&c), hc.size() * 4));
            CK(cudaMemcpy(c, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(reinterpret_cast<void **>(&kr), hk.size() * 4));
            CK(cudaMemcpy(kr, hk.data(), hk.size() * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(reinterpret_cast<void **>(&o), size_t(T * d.n_head * d.head_dim_v) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&err), 64));
            CK(cudaMemset(err, 0, 64));
            void * kvb = dev_random(size_t(d.n_head * (d.head_dim_nope + d.head_dim_v) * L) * 2, 9, true);
            // batch: T sequences, sequence s at position ctx, pages s * pages .. (s + 1) * pages - 1
            std::vector<int32_t> hb;
            for (int s = 0; s <= T; ++s) hb.push_back(s);                       // seq_start [T + 1]
            for (int s = 0; s < T; ++s) hb.push_back(int32_t(ctx));             // pos0 [T]
            for (int s = 0; s < T; ++s) hb.push_back(s);                        // slot [T]
            for (int s = 0; s < T; ++s) hb.push_back(s);                        // tok_seq [T]
            for (int64_t i = 0; i < n_pages; ++i) hb.push_back(int32_t(i));    // block_table [T, pages]
            int32_t * db;
            CK(cudaMalloc(reinterpret_cast<void **>(&db), hb.size() * 4));
            CK(cudaMemcpy(db, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
            dbatch b;
            b.n_seq = T; b.n_tok = T; b.page_size = int(ps); b.max_pages = int(pages);
            b.seq_start = db; b.pos0 = db + T + 1; b.slot = db + 2 * T + 1; b.tok_seq = db + 3 * T + 1;
            b.block_table = db + 4 * T + 1; b.max_pos = int(ctx + 1);
            std::printf("mla    %-3s H=%lld ctx %lld T=%d us/layer:", g.name, (long long)g.H, (long long)ctx, T);
            for (int ver : {2, 3}) {
                const int ns = mla_split_for(T, d, true, true);
                CK(cudaMalloc(reinterpret_cast<void **>(&scr), size_t(mla_scratch_floats(T, d, ns)) * 4));
                auto launch = [&](int i) {
                    CK(launch_mla_attn(q, c, kr, dweight{kvb, wtype::BF16}, d, 0.07f, caches[size_t(i % nc)], nullptr, 0, b, ns,
                                       scr, o, err, st, true, ver == 3));
                };
                std::printf(" | v%d %.2f (split %d)", ver, graph_us(nl, launch), ns);
                CK(cudaFree(scr));
            }
            std::printf("\n");
            for (float * cc : caches) CK(cudaFree(cc));
            for (void * pp : {static_cast<void *>(q), static_cast<void *>(c), static_cast<void *>(kr), static_cast<void *>(o),
                              static_cast<void *>(err), kvb, static_cast<void *>(db)})
                CK(cudaFree(pp));
        }
    }
}

int main(int argc, char ** argv) {
    // "bench-cuda-kernels gemv48": the copy ceiling and the gemv48 lines only
    const bool all = !(argc > 1 && std::strcmp(argv[1], "gemv48") == 0);
    CK(cudaSetDevice(0));
    cudaDeviceProp p{};
    CK(cudaGetDeviceProperties(&p, 0));
    CK(cudaStreamCreate(&st));
    std::printf("device: %s, %d SMs, L2 %d MB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);

    // copy ceiling
    const size_t cb = size_t(2) << 30;
    void *src = dev_random(cb, 1), *dst;
    CK(cudaMalloc(reinterpret_cast<void **>(&dst), cb));
    const double ms_copy = median_ms([&] { CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, st)); });
    const double bw = 2.0 * double(cb) / (ms_copy * 1e-3) / 1e9;
    std::printf("copy   2 GiB D2D: %.3f ms, %.0f GB/s (read + write)  <- bandwidth ceiling\n", ms_copy, bw);
    CK(cudaFree(dst));
    CK(cudaFree(src));
    if (argc > 1 && std::strcmp(argv[1], "mla") == 0) {   // "bench-cuda-kernels mla": the copy ceiling and mla only
        bench_mla();
        return 0;
    }
    if (argc > 1 && std::strcmp(argv[1], "route") == 0) {   // "bench-cuda-kernels route": the copy ceiling and route only
        bench_route();
        return 0;
    }
    if (argc > 1 && std::strcmp(argv[1], "attnres") == 0) {   // "bench-cuda-kernels attnres": the copy ceiling and attnres only
        bench_attnres();
        return 0;
    }

    // gemm ceiling: bf16 8192^3 via cuBLASLt, f32 out (what LINEAR does for prefill)
    if (all) {
        const int64_t M = 8192, N = 8192, K = 8192;
        void * A = dev_random(size_t(M * K) * 2, 2, true);
        void * B = dev_random(size_t(N * K) * 2, 3, true);
        void * D;
        CK(cudaMalloc(reinterpret_cast<void **>(&D), size_t(M * N) * 4));
        cublasLtHandle_t lt;
        CB(cublasLtCreate(&lt));
        cublasLtMatmulDesc_t desc;
        CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        cublasLtMatrixLayout_t la, lb, ld;
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, N, K));
        CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, M, N, M));
        cublasLtMatmulPreference_t pref;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        size_t wsb = 32u << 20;
        void * ws;
        CK(cudaMalloc(reinterpret_cast<void **>(&ws), wsb));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        cublasLtMatmulHeuristicResult_t h{};
        int found = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &h, &found));
        const float al = 1, be = 0;
        const double ms = median_ms([&] { CB(cublasLtMatmul(lt, desc, &al, A, la, B, lb, &be, D, ld, D, ld, &h.algo, ws, wsb, st)); }, 10);
        std::printf("gemm   bf16 8192^3 -> f32 (cuBLASLt): %.3f ms, %.0f TFLOP/s  <- matrix ceiling\n", ms,
                    2.0 * double(M) * N * K / (ms * 1e-3) / 1e12);
        CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(ws));
    }

    // GEMV: the decode LINEAR path on K3's dense shapes (k3-layers-4: 3 KDA + 1 MLA layer, layer 1 dense, 3 MoE layers),
    // every kernel generation side by side (cuda_options::gemv_unroll: u0 = the first kernels; uN = v2 with N 16-byte
    // loads in flight per lane, split chosen at launch; uNs1 = v2 without the row split). Each figure: a CUDA graph of n
    // launches (n so that a replay streams >= 512 MB) over rotating weight copies (>= 160 MB in all: the L2 is 50 MB, so
    // every launch reads its weights from HBM), 3 warm-up replays, median of 7 replays / n; GB/s = weight + x + y bytes.
    // The launches of a graph run back to back as in the decode step's graph, so the time includes the gaps between
    // kernels (what the step pays). The last line weights each case by its count in one k3-layers-4 step (the launches of
    // the ncu profile of 2026-11-30: the KDA group of 6172 blocks carries the beta SIGMOID epilogue, one KDA o_proj of
    // three has no ADD; here every KDA group is plain and every o_proj has its ADD).
    if (all) {
        struct gcase {
            const char * name;
            std::vector<int64_t> outs;
            int64_t in;
            int kind;    // 0 plain / grouped, 1 RMSNorm folded (staged), 2 ADD epilogue (one residual)
            int count;   // launches per k3-layers-4 step
        };
        const std::vector<gcase> cases = {
            {"kda q/k/v/g/f_a/b (grouped)", {12288, 12288, 12288, 12288, 128, 96}, 7168, 0, 3},
            {"kda f_b", {12288}, 128, 0, 3},
            {"kda o_proj + ADD", {7168}, 12288, 2, 3},
            {"mla q_a/kv_a/g + norm (staged)", {1536, 576, 12288}, 7168, 1, 1},
            {"mla q_b + q_a_layernorm (staged)", {18432}, 1536, 1, 1},
            {"mla o_proj + ADD", {7168}, 12288, 2, 1},
            {"dense gate/up (grouped)", {33792, 33792}, 7168, 0, 1},
            {"dense down + ADD", {7168}, 33792, 2, 1},
            {"moe router gate (MOE_ROUTE's GEMV)", {896}, 7168, 0, 3},
            {"moe latent down/shared gate/up + norm (staged)", {3584, 6144, 6144}, 7168, 1, 3},
            {"moe latent up + routed norm (staged)", {7168}, 3584, 1, 3},
            {"moe shared down + ADD", {7168}, 6144, 2, 3},
            {"lm_head", {163840}, 7168, 0, 1},
            {"q_a alone (narrow)", {1536}, 7168, 0, 0},
            {"kv_a alone (narrow)", {576}, 7168, 0, 0},
        };
        const std::vector<std::pair<const char *, gemv_cfg>> vars = {
            {"u0", {0, 0}}, {"u1", {1, 0}}, {"u2", {2, 0}}, {"u4", {4, 0}}, {"u8", {8, 0}}, {"u4s1", {4, 1}}, {"u8s1", {8, 1}}};
        std::vector<double> step_ms(vars.size(), 0.0);
        double step_bytes = 0.0;
        for (const auto & c : cases) {
            const int n = int(c.outs.size());
            int64_t rows = 0;
            for (auto o : c.outs) rows += o;
            const size_t wbytes = size_t(rows * c.in) * 2;
            const int copies = int(std::max<size_t>(1, (size_t(160) << 20) / wbytes + 1));
            const int nl = int(std::min<size_t>(50, std::max<size_t>(2, (size_t(512) << 20) / wbytes)));
            // one weight buffer per copy holding every segment's rows; random bf16 in +-0.05 (a 64 MB random block
            // repeated: generating GBs on the host takes seconds)
            const size_t blk = std::min(wbytes, size_t(64) << 20);
            void * wr = dev_random(blk, 4, true);
            void * w0;
            CK(cudaMalloc(&w0, wbytes));
            for (size_t o = 0; o < wbytes; o += blk)
                CK(cudaMemcpy(static_cast<char *>(w0) + o, wr, std::min(blk, wbytes - o), cudaMemcpyDeviceToDevice));
            CK(cudaFree(wr));
            std::vector<void *> wc{w0};
            for (int i = 1; i < copies; ++i) {
                void * d;
                CK(cudaMalloc(&d, wbytes));
                CK(cudaMemcpy(d, w0, wbytes, cudaMemcpyDeviceToDevice));
                wc.push_back(d);
            }
            float *x, *nw, *yn, *res;
            CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(8 * c.in) * 4));
            CK(cudaMemset(x, 0x3c, size_t(8 * c.in) * 4));   // 0x3c3c3c3c ~ 0.0115, nonzero
            CK(cudaMalloc(reinterpret_cast<void **>(&nw), size_t(c.in) * 4));
            CK(cudaMemset(nw, 0x3f, size_t(c.in) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&yn), size_t(8 * c.in) * 4));
            std::vector<float *> ys(static_cast<size_t>(n)), zs(static_cast<size_t>(n));
            for (int s = 0; s < n; ++s) {
                CK(cudaMalloc(reinterpret_cast<void **>(&ys[size_t(s)]), size_t(8 * c.outs[size_t(s)]) * 4));
                CK(cudaMalloc(reinterpret_cast<void **>(&zs[size_t(s)]), size_t(8 * c.outs[size_t(s)]) * 4));
            }
            CK(cudaMalloc(reinterpret_cast<void **>(&res), size_t(8 * rows) * 4));
            CK(cudaMemset(res, 0, size_t(8 * rows) * 4));
            auto launch = [&](int copy, const gemv_cfg & cfg, int T) {
                const char * base = static_cast<const char *>(wc[size_t(copy)]);
                const void * wp[k_gemv_group_max];
                gemv_fused_seg segs[k_gemv_group_max];
                int64_t off = 0;
                for (int s = 0; s < n; ++s) {
                    wp[s] = base + off * c.in * 2;
                    segs[s].w = wp[s];
                    segs[s].y = ys[size_t(s)];
                    segs[s].out = c.outs[size_t(s)];
                    if (c.kind == 2) segs[s].res[0] = res, segs[s].z[0] = zs[size_t(s)];
                    off += c.outs[size_t(s)];
                }
                if (c.kind == 0 && n == 1) CK(launch_linear_gemv(x, T, c.in, {wp[0], wtype::BF16}, c.outs[0], ys[0], st, cfg));
                else if (c.kind == 0) CK(launch_linear_gemv_group(x, T, c.in, wtype::BF16, wp, ys.data(), c.outs.data(), n, st, cfg));
                else {
                    gemv_norm nm;
                    if (c.kind == 1) nm.on = true, nm.staged = true, nm.w = nw, nm.eps = 1e-5f, nm.y = yn;
                    CK(launch_linear_gemv_fused(x, T, c.in, wtype::BF16, segs, n, nm, st, nullptr, cfg));
                }
            };
            for (int T : {1, 8}) {
                if (T == 8 && c.count == 0) continue;
                const double bytes = double(wbytes) + double(T) * double(c.in + rows) * 4;
                std::printf("gemv   %-46s [%6lld x %5lld] %7.1f MB T=%d x%d:", c.name, (long long)rows, (long long)c.in,
                            double(wbytes) / 1e6, T, c.count);
                double best = 1e30, u0 = 0;
                const char * best_name = "";
                for (size_t v = 0; v < vars.size(); ++v) {
                    launch(0, vars[v].second, T);   // eager once: outside any capture (one-time function attributes)
                    CK(cudaStreamSynchronize(st));
                    cudaGraph_t gr;
                    cudaGraphExec_t ge;
                    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                    for (int i = 0; i < nl; ++i) launch(i % copies, vars[v].second, T);
                    CK(cudaStreamEndCapture(st, &gr));
                    CK(cudaGraphInstantiate(&ge, gr, 0));
                    const double ms = median_ms([&] { CK(cudaGraphLaunch(ge, st)); }, 7) / nl;
                    CK(cudaGraphExecDestroy(ge));
                    CK(cudaGraphDestroy(gr));
                    const double gbs = bytes / (ms * 1e-3) / 1e9;
                    std::printf(" | %s %.4f ms %4.0f GB/s %3.0f%%", vars[v].first, ms, gbs, 100.0 * gbs / bw);
                    if (v == 0) u0 = ms;
                    if (ms < best) best = ms, best_name = vars[v].first;
                    if (T == 1) step_ms[v] += ms * c.count;
                }
                std::printf(" | best %s %.2fx u0\n", best_name, u0 / best);
                if (T == 1) step_bytes += bytes * c.count;
            }
            for (void * p : wc) CK(cudaFree(p));
            for (int s = 0; s < n; ++s) {
                CK(cudaFree(ys[size_t(s)]));
                CK(cudaFree(zs[size_t(s)]));
            }
            CK(cudaFree(x)); CK(cudaFree(nw)); CK(cudaFree(yn)); CK(cudaFree(res));
        }
        std::printf("gemv   k3-layers-4 step, dense LINEARs at T=1 (%.2f GB):", step_bytes / 1e9);
        for (size_t v = 0; v < vars.size(); ++v)
            std::printf(" | %s %.3f ms %3.0f%%", vars[v].first, step_ms[v], 100.0 * step_bytes / (step_ms[v] * 1e-3) / 1e9 / bw);
        std::printf("\n");
    }

    // GEMV at the Kimi-Linear-48B geometry (hidden 2304, KDA 32 x 128, MLA, dense 9216, shared expert 1024), T = 1:
    // the kernels the step runs now ("cur": v1 below 3072 columns, v2 u4 from there: cuda_options::gemv_v2_min_in) vs
    // v3 (gemv_cfg::v3; "v3-1": first loads after the PDL wait, "v3-2": before it; "v3s1": one warp per row; "v3u3": U = 3,
    // three rounds of a 2304-wide row). Same method as the K3 lines above (graphs of back-to-back launches over weight
    // copies rotated past the L2). Per case: us per launch and GB/s (weight + x + y bytes); the last line weights each
    // case by its launches in one 27-layer step (20 KDA + 7 MLA layers; layer 1 dense, 26 MoE).
    {
        struct gcase {
            const char * name;
            std::vector<int64_t> outs;
            int64_t in;
            int kind;    // 0 plain / grouped, 1 RMSNorm folded (staged), 2 ADD epilogue
            int count;   // launches per 27-layer step
        };
        const std::vector<gcase> cases = {
            {"kda q/k/v/f_a/b/g_a + norm (staged)", {4096, 4096, 4096, 128, 32, 128}, 2304, 1, 20},
            {"mla q/kv_a + norm (staged)", {6144, 576}, 2304, 1, 7},
            {"dense gate/up + norm (staged)", {9216, 9216}, 2304, 1, 1},
            {"shared gate/up + norm (staged)", {1024, 1024}, 2304, 1, 26},
            {"o_proj + ADD", {2304}, 4096, 2, 27},
            {"dense down + ADD", {2304}, 9216, 2, 1},
            {"shared down + ADD", {2304}, 1024, 2, 26},
            {"kda f_b / g_b", {4096}, 128, 0, 40},
            {"moe router gate", {256}, 2304, 0, 26},
            {"lm_head", {163840}, 2304, 0, 1},
        };
        auto cur = [](int64_t in) { return gemv_cfg{in >= 3072 ? 4 : 0, 0}; };
        const std::vector<std::pair<const char *, gemv_cfg>> vars = {
            {"cur", {}}, {"u4", {4, 0}}, {"v3-1", {0, 0, 1, 0}}, {"v3-2", {0, 0, 2, 0}}, {"v3s1", {0, 1, 2, 0}}, {"v3u3", {0, 0, 2, 3}}};
        std::vector<double> step_us(vars.size(), 0.0);
        double step_bytes = 0.0;
        for (const auto & c : cases) {
            const int n = int(c.outs.size());
            int64_t rows = 0;
            for (auto o : c.outs) rows += o;
            const size_t wbytes = size_t(rows * c.in) * 2;
            const int copies = int(std::max<size_t>(1, (size_t(160) << 20) / wbytes + 1));
            const int nl = int(std::min<size_t>(200, std::max<size_t>(2, (size_t(512) << 20) / wbytes)));
            const size_t blk = std::min(wbytes, size_t(64) << 20);
            void * wr = dev_random(blk, 5, true);
            std::vector<void *> wc;
            for (int i = 0; i < copies; ++i) {
                void * d;
                CK(cudaMalloc(&d, wbytes));
                for (size_t o = 0; o < wbytes; o += blk)
                    CK(cudaMemcpy(static_cast<char *>(d) + o, wr, std::min(blk, wbytes - o), cudaMemcpyDeviceToDevice));
                wc.push_back(d);
            }
            CK(cudaFree(wr));
            float *x, *nw, *yn, *res, *y, *z;
            CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(c.in) * 4));
            CK(cudaMemset(x, 0x3c, size_t(c.in) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&nw), size_t(c.in) * 4));
            CK(cudaMemset(nw, 0x3f, size_t(c.in) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&yn), size_t(c.in) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&res), size_t(rows) * 4));
            CK(cudaMemset(res, 0, size_t(rows) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&y), size_t(rows) * 4));
            CK(cudaMalloc(reinterpret_cast<void **>(&z), size_t(rows) * 4));
            auto launch = [&](int copy, const gemv_cfg & cfg) {
                const char * base = static_cast<const char *>(wc[size_t(copy)]);
                const void * wp[k_gemv_group_max];
                float * ys[k_gemv_group_max];
                gemv_fused_seg segs[k_gemv_group_max];
                int64_t off = 0;
                for (int s = 0; s < n; ++s) {
                    wp[s] = base + off * c.in * 2;
                    ys[s] = y + off;
                    segs[s].w = wp[s], segs[s].y = ys[s], segs[s].out = c.outs[size_t(s)];
                    if (c.kind == 2) segs[s].res[0] = res + off, segs[s].z[0] = z + off;
                    off += c.outs[size_t(s)];
                }
                if (c.kind == 0 && n == 1) CK(launch_linear_gemv(x, 1, c.in, {wp[0], wtype::BF16}, c.outs[0], ys[0], st, cfg));
                else if (c.kind == 0) CK(launch_linear_gemv_group(x, 1, c.in, wtype::BF16, wp, ys, c.outs.data(), n, st, cfg));
                else {
                    gemv_norm nm;
                    if (c.kind == 1) nm.on = true, nm.staged = true, nm.w = nw, nm.eps = 1e-5f, nm.y = yn;
                    CK(launch_linear_gemv_fused(x, 1, c.in, wtype::BF16, segs, n, nm, st, nullptr, cfg));
                }
            };
            const double bytes = double(wbytes) + double(c.in + rows) * 4;
            std::printf("gemv48 %-38s [%6lld x %4lld] %6.1f MB x%-2d:", c.name, (long long)rows, (long long)c.in, double(wbytes) / 1e6,
                        c.count);
            std::vector<double> case_us(vars.size());
            for (size_t v = 0; v < vars.size(); ++v) {
                const gemv_cfg cfg = v == 0 ? cur(c.in) : vars[v].second;
                launch(0, cfg);   // eager once: outside any capture (one-time function attributes)
                CK(cudaStreamSynchronize(st));
                cudaGraph_t gr;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                for (int i = 0; i < nl; ++i) launch(i % copies, cfg);
                CK(cudaStreamEndCapture(st, &gr));
                CK(cudaGraphInstantiate(&ge, gr, 0));
                const double us = median_ms([&] { CK(cudaGraphLaunch(ge, st)); }, 7) / nl * 1e3;
                CK(cudaGraphExecDestroy(ge));
                CK(cudaGraphDestroy(gr));
                case_us[v] = us;
                std::printf(" | %s %6.2f us %4.0f GB/s", vars[v].first, us, bytes / (us * 1e-6) / 1e9);
                step_us[v] += us * c.count;
            }
            std::printf(" | cur/v3-2 %.2fx\n", case_us[0] / case_us[3]);
            step_bytes += bytes * c.count;
            for (void * p : wc) CK(cudaFree(p));
            CK(cudaFree(x)); CK(cudaFree(nw)); CK(cudaFree(yn)); CK(cudaFree(res)); CK(cudaFree(y)); CK(cudaFree(z));
        }
        std::printf("gemv48 27-layer step, these LINEARs at T=1 (%.2f GB):", step_bytes / 1e9);
        for (size_t v = 0; v < vars.size(); ++v)
            std::printf(" | %s %.3f ms %3.0f%%", vars[v].first, step_us[v] * 1e-3, 100.0 * step_bytes / (step_us[v] * 1e-6) / 1e9 / bw);
        std::printf("\n");
    }

    // MoE decode, MXFP4 experts: latent width 3584 -> 3072 -> 3584 (k3-layers-4 geometry), 16 of 64 experts
    if (all) {
        const int64_t E = 64, k = 16, D = 3584, F = 3072;
        std::vector<dexpert> h(static_cast<size_t>(E));
        std::vector<void *> bufs;
        auto mk = [&](int64_t out, int64_t in, uint32_t seed) {
            dexpert_matrix m;
            m.out = out; m.in = in; m.fmt = 1;
            m.packed = static_cast<const uint8_t *>(dev_random(size_t(out * in / 2), seed));
            std::vector<uint8_t> sc(size_t(out * in / 32));
            std::mt19937 g(seed);
            for (auto & s : sc) s = uint8_t(118 + g() % 8);
            void * d;
            CK(cudaMalloc(reinterpret_cast<void **>(&d), sc.size()));
            CK(cudaMemcpy(d, sc.data(), sc.size(), cudaMemcpyHostToDevice));
            m.scale = static_cast<const uint8_t *>(d);
            return m;
        };
        for (int64_t e = 0; e < E; ++e) h[size_t(e)] = {mk(F, D, 100 + uint32_t(e)), mk(F, D, 200 + uint32_t(e)), mk(D, F, 300 + uint32_t(e))};
        dexpert * dex;
        CK(cudaMalloc(reinterpret_cast<void **>(&dex), h.size() * sizeof(dexpert)));
        CK(cudaMemcpy(dex, h.data(), h.size() * sizeof(dexpert), cudaMemcpyHostToDevice));
        std::vector<int32_t> ids(static_cast<size_t>(k));
        for (int64_t j = 0; j < k; ++j) ids[size_t(j)] = int32_t(j * 4 + 1);
        std::vector<float> wts(static_cast<size_t>(k), 1.0f / float(k));
        int32_t * dids; float *dw, *x, *y, *scr; int * err;
        CK(cudaMalloc(reinterpret_cast<void **>(&dids), 64)); CK(cudaMemcpy(dids, ids.data(), size_t(k) * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(reinterpret_cast<void **>(&dw), 64)); CK(cudaMemcpy(dw, wts.data(), size_t(k) * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(reinterpret_cast<void **>(&x), size_t(D) * 4)); CK(cudaMemset(x, 0x3c, size_t(D) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&y), size_t(D) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&scr), size_t(k * (F + D)) * 4));
        CK(cudaMalloc(reinterpret_cast<void **>(&err), 16)); CK(cudaMemset(err, 0, 16));
        const dexperts_cfg c{1, 1.0f, 0.0f, F, D};
        const double ms = median_ms([&] { CK(launch_moe_experts(x, 1, D, dids, dw, k, dex, E, c, scr, y, err, st)); });
        const double bytes = double(k) * 3 * double(F * D) * (0.5 + 1.0 / 32);
        std::printf("moe    mxfp4 16 experts [3 x %lld x %lld] T=1: %.4f ms, %.0f GB/s = %.0f%% of copy\n", (long long)F, (long long)D, ms,
                    bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / bw);
        {   // the grouped path at T == 1 (the backend's): decode v5 (3 launches) vs v6 and v7 (2; moe.cu "Decode v6", "v7")
            int32_t * gw;
            CK(cudaMalloc(reinterpret_cast<void **>(&gw), size_t(moe_group_ints(1, k, E, D)) * 4));
            for (int ver = 0; ver < 3; ++ver) {
                dmoe_opts o;
                o.dec_v4 = o.dec_v5 = true;
                o.v5_cfg = ver * 1000;
                const double mg = median_ms([&] { CK(launch_moe_experts_grouped(2, x, 1, D, dids, dw, k, dex, E, c, scr, gw, y, err, st, o)); });
                std::printf("moe    mxfp4 16 experts [3 x %lld x %lld] T=1 grouped %s: %.4f ms, %.0f GB/s = %.0f%% of copy\n", (long long)F,
                            (long long)D, ver == 2 ? "v7" : ver == 1 ? "v6" : "v5", mg, bytes / (mg * 1e-3) / 1e9, 100.0 * bytes / (mg * 1e-3) / 1e9 / bw);
            }
            CK(cudaFree(gw));
        }
    }

    // KDA recurrent decode step at K3 widths; state rotated over 16 slots (100 MB > L2)
    if (all) {
        const int64_t H = 96, K = 128, V = 128, S = 16;
        float * state = static_cast<float *>(dev_random(size_t(S * H * K * V) * 4, 7));
        CK(cudaMemset(state, 0, size_t(S * H * K * V) * 4));
        float *q, *kk, *v, *g, *beta, *o;
        for (float ** pp : {&q, &kk, &v, &g, &o}) { CK(cudaMalloc(reinterpret_cast<void **>(pp), size_t(H * K) * 4)); CK(cudaMemset(*pp, 0x3c, size_t(H * K) * 4)); }
        CK(cudaMalloc(reinterpret_cast<void **>(&beta), size_t(H) * 4)); CK(cudaMemset(beta, 0x3c, size_t(H) * 4));
        int32_t hb[5];
        int32_t * db;
        CK(cudaMalloc(reinterpret_cast<void **>(&db), 5 * 4));
        int slot = 0;
        auto step = [&] {
            hb[0] = 0; hb[1] = 1; hb[2] = 0; hb[3] = slot; hb[4] = 0;
            slot = (slot + 1) % int(S);
            CK(cudaMemcpyAsync(db, hb, 5 * 4, cudaMemcpyHostToDevice, st));
            dbatch b;
            b.n_seq = 1; b.n_tok = 1; b.seq_start = db; b.pos0 = db + 2; b.slot = db + 3; b.tok_seq = db + 4;
            CK(launch_kda_scan_recurrent(q, kk, v, g, beta, H, K, V, 0.1f, state, b, o, st));
        };
        const double ms = median_ms(step);
        const double bytes = 2.0 * double(H * K * V) * 4;
        std::printf("kda    recurrent decode H=%lld K=V=%lld: %.4f ms, %.0f GB/s state R+W = %.0f%% of copy (incl. a 20 B H2D copy)\n",
                    (long long)H, (long long)K, ms, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / bw);
    }
    if (all) bench_route();
    if (all) bench_mla();
    return 0;
}
