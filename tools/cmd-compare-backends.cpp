// perigee compare-backends: runs the same model on the CPU reference and the CUDA backend, node by node
// (STYLE §3.4 rule 5, ggml_backend_compare_graph_backend), and names the first node out of tolerance.
// A prefill of --ids then --decode greedy steps; each backend has its own state pools (the CUDA ones stay
// on the device); every F32 output is compared by NMSE, every I32 output (routing ids, indexer selections)
// exactly. Greedy tokens must be identical. Exit code 1 on any difference.
#include "cli-util.h"
#include "command.h"
#include "core/error.h"
#include "model/forward.h"
#include "model/weights.h"

#if defined(PERIGEE_HAVE_CUDA)
#include "backend/cuda/backend-cuda.h"
#endif

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace perigee::cli {
namespace {


struct opts {
    std::string model;
    std::string ids;
    int decode = 4;
    double tol = 1e-6;
    bool all = false;
    int device = 0;
    int chunk = 64;
    int linear_group = -1;   // cuda_options::linear_group: -1 the default, 0 off, 1 on
    int moe_mma = -1;        // cuda_options::moe_mma_tokens: -1 the default, 0 off, N > 0 the token threshold
    int fuse = -1;           // cuda_options::fuse_norm_linear, fuse_add, fuse_conv_l2, fuse_sigmoid: -1 the defaults, 0 all off, 1 all on
    int kda_chunk = -1;      // cuda_options::kda_chunk_min_tokens: -1 the default, 0 off, N > 0 the token threshold
    int prefill_fast = -1;   // cuda_options::{moe_route_gemm,mla_prefill,conv_prefill,attn_res_prefill}_tokens: -1 the defaults, 0 off, N > 0
    int moe_mma_v2 = -1;     // cuda_options::moe_mma_v2: -1 the default, 0 off, 1 on
    int moe_v4 = -1;         // cuda_options::moe_decode_v4 + moe_small_v4: -1 the defaults, 0 both off, 1 both on
};

#if defined(PERIGEE_HAVE_CUDA)

struct diff { double nmse = 0.0; int64_t mismatches = 0; bool nonfinite = false; };

diff compare_tensors(const tensor & a, const tensor & b) {
    diff d;
    if (a.type != b.type || a.shape != b.shape) {
        d.mismatches = -1;
        return d;
    }
    if (a.type == dtype::I32) {
        for (int64_t i = 0; i < a.numel(); ++i) d.mismatches += a.as<int32_t>()[i] != b.as<int32_t>()[i];
        return d;
    }
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < a.numel(); ++i) {
        const double x = a.as<float>()[i], y = b.as<float>()[i];
        if (std::isfinite(x) != std::isfinite(y)) d.nonfinite = true;
        if (!std::isfinite(x) || !std::isfinite(y)) continue;
        num += (x - y) * (x - y);
        den += x * x;
    }
    d.nmse = den > 0 ? num / den : num;
    return d;
}

int32_t argmax_last(const tensor & logits) {
    const int64_t V = logits.shape.at(1), r = logits.shape.at(0) - 1;
    const float * p = logits.as<float>() + r * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
        if (p[i] > p[best]) best = i;   // ties to the lower id
    return int32_t(best);
}

int run_compare(const opts & o) {
    const kimi_config cfg = config_load(o.model);
    auto w = weights_load(cfg, checkpoint::open(o.model));
    auto prompt = parse_id_list(o.ids);
    for (int32_t id : prompt) PG_CHECK(id < cfg.vocab_size, "--ids: token id {} is outside the vocabulary of {}", id, cfg.vocab_size);
    const int page_size = 16;
    const int total = int(prompt.size()) + o.decode;
    const int n_pages = (total + page_size - 1) / page_size;
    model_state st_cpu = state_init(cfg, 1, n_pages, page_size);
    model_state st_gpu = state_init(cfg, 1, n_pages, page_size);
    auto cpu = backend_cpu_init();
    cuda_options co;
    if (o.linear_group >= 0) co.linear_group = o.linear_group != 0;
    if (o.moe_mma >= 0) co.moe_mma_tokens = o.moe_mma, co.moe_mma_large_step = 0;
    if (o.fuse >= 0) co.fuse_norm_linear = co.fuse_add = co.fuse_conv_l2 = co.fuse_sigmoid = o.fuse != 0;
    if (o.kda_chunk >= 0) co.kda_chunk_min_tokens = o.kda_chunk;
    if (o.moe_mma_v2 >= 0) co.moe_mma_v2 = o.moe_mma_v2 != 0;
    if (o.moe_v4 >= 0) co.moe_decode_v4 = co.moe_small_v4 = o.moe_v4 != 0;
    if (o.prefill_fast >= 0) co.moe_route_gemm_tokens = co.mla_prefill_tokens = co.conv_prefill_tokens = co.attn_res_prefill_tokens = o.prefill_fast;
    auto gpu = backend_cuda_init(o.device, co);
    std::printf("compare-backends: model %s, cpu vs cuda (%s), prompt %zu tokens, %d decode steps, NMSE tolerance %.1e\n",
                o.model.c_str(), gpu->device_name().c_str(), prompt.size(), o.decode, o.tol);
    std::vector<int32_t> toks_cpu, toks_gpu;
    std::vector<int32_t> pages;
    for (int p = 0; p < n_pages; ++p) pages.push_back(p);
    int n_past = 0;
    bool ok = true;
    std::vector<int32_t> feed = prompt;
    for (int step = 0; step <= o.decode; ++step) {
        auto b = std::make_shared<batch>();
        b->ids = feed;
        b->seq_start = {0, int32_t(feed.size())};
        b->pos0 = {n_past};
        b->slot = {0};
        b->page_size = page_size;
        b->block_table = {pages};
        forward_options fo;
        fo.kda_chunk_size = o.chunk;
        graph gc = forward_build(cfg, *w, st_cpu, b, fo);
        graph gg = forward_build(cfg, *w, st_gpu, b, fo);
        PG_CHECK(gc.nodes.size() == gg.nodes.size(), "the two graphs differ in size: {} vs {}", gc.nodes.size(), gg.nodes.size());
        cpu->check_supported(gc);
        gpu->check_supported(gg);
        std::vector<std::vector<tensor>> ref(gc.nodes.size());
        cpu->run(gc, [&](const graph & g, int id, const std::vector<tensor> & outs) {
            if (g.nodes[size_t(id)].op == op_type::WEIGHT) return;
            for (const auto & t : outs) {
                tensor c = tensor_new(t.type, t.shape);
                if (t.nbytes) std::memcpy(c.data, t.data, t.nbytes);
                ref[size_t(id)].push_back(std::move(c));
            }
        });
        int first_bad = -1, compared = 0;
        double worst = 0.0;
        std::string worst_name;
        const auto t0 = std::chrono::steady_clock::now();
        gpu->run(gg, [&](const graph & g, int id, const std::vector<tensor> & outs) {
            const node & n = g.nodes[size_t(id)];
            if (n.op == op_type::WEIGHT) return;
            for (size_t k = 0; k < outs.size(); ++k) {
                const diff d = compare_tensors(ref[size_t(id)].at(k), outs[k]);
                ++compared;
                const bool bad = d.mismatches != 0 || d.nonfinite || d.nmse > o.tol;
                if (d.nmse > worst) worst = d.nmse, worst_name = n.name;
                if (bad && (first_bad < 0 || o.all)) {
                    if (first_bad < 0) first_bad = id;
                    if (d.mismatches < 0)
                        std::printf("  node %d '%s' (%s) out %zu: shape/dtype differ\n", id, n.name.c_str(),
                                    std::string(op_name(n.op)).c_str(), k);
                    else
                        std::printf("  node %d '%s' (%s) out %zu: NMSE %.3e %s %.1e, %lld exact mismatches%s\n", id, n.name.c_str(),
                                    std::string(op_name(n.op)).c_str(), k, d.nmse, d.nmse > o.tol ? ">" : "<=", o.tol,
                                    (long long)d.mismatches, d.nonfinite ? ", NaN/Inf placement differs" : "");
                }
            }
        });
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        const tensor lc = cpu->read(gc.logits), lg = gpu->read(gg.logits);
        const int32_t tc = argmax_last(lc), tg = argmax_last(lg);
        std::printf("step %d (%s %zu tokens at pos %d): %d outputs compared, worst NMSE %.3e at '%s', first out of tolerance: %s; "
                    "next token cpu %d cuda %d (%.1f ms with per-node copies)\n",
                    step, step == 0 ? "prefill" : "decode", feed.size(), n_past, compared, worst, worst_name.c_str(),
                    first_bad < 0 ? "none" : fmt::format("node {} '{}' ({})", first_bad, gg.nodes[size_t(first_bad)].name,
                                                         op_name(gg.nodes[size_t(first_bad)].op)).c_str(),
                    tc, tg, ms);
        ok &= first_bad < 0;
        toks_cpu.push_back(tc);
        toks_gpu.push_back(tg);
        n_past += int(feed.size());
        feed = {tc};   // both continue from the reference's token so later steps stay comparable
    }
    // The CUDA states must equal the CPU ones after the whole run (device-resident: sync them first).
    gpu->sync_state_to_host();
    double worst_state = 0.0;
    for (size_t il = 0; il < st_cpu.layers.size(); ++il) {
        const layer_state & a = st_cpu.layers[il];
        const layer_state & b2 = st_gpu.layers[il];
        for (auto [x, y] : {std::pair{&a.conv_q, &b2.conv_q}, {&a.conv_k, &b2.conv_k}, {&a.conv_v, &b2.conv_v},
                            {&a.recurrent, &b2.recurrent}, {&a.latent, &b2.latent}, {&a.index_keys, &b2.index_keys}})
            if (!x->empty()) worst_state = std::max(worst_state, compare_tensors(*x, *y).nmse);
    }
    const bool same = toks_cpu == toks_gpu;
    std::string sc, sg;
    for (size_t i = 0; i < toks_cpu.size(); ++i) sc += (i ? "," : "") + std::to_string(toks_cpu[i]), sg += (i ? "," : "") + std::to_string(toks_gpu[i]);
    std::printf("final states: worst NMSE %.3e %s %.1e\n", worst_state, worst_state <= o.tol ? "<=" : ">", o.tol);
    std::printf("greedy tokens cpu [%s] cuda [%s]: %s\n", sc.c_str(), sg.c_str(), same ? "identical" : "DIFFERENT");
    std::printf("compare-backends: %s\n", ok && same && worst_state <= o.tol ? "PASS" : "FAIL");
    return ok && same && worst_state <= o.tol ? 0 : 1;
}
#endif

command_registrar reg{{"compare-backends", "run a model on the CPU and CUDA backends node by node; name the first node out of tolerance",
    [](CLI::App & sub) {
        auto o = std::make_shared<opts>();
        sub.add_option("--model", o->model, "model directory")->required();
        sub.add_option("--ids", o->ids, "comma-separated prompt token ids")->required();
        sub.add_option("--decode", o->decode, "greedy decode steps after the prefill")->capture_default_str();
        sub.add_option("--tol", o->tol, "NMSE tolerance per F32 node output (I32 outputs must be equal)")->capture_default_str();
        sub.add_option("--chunk", o->chunk, "KDA chunk size for prefill steps (64 or 0)")->capture_default_str();
        sub.add_option("--device", o->device, "CUDA device")->capture_default_str();
        sub.add_option("--linear-group", o->linear_group,
                       "cuda_options::linear_group: 1 on, 0 off, -1 the backend's default")->capture_default_str();
        sub.add_option("--moe-mma", o->moe_mma,
                       "cuda_options::moe_mma_tokens: N > 0 tensor-core experts from N tokens, 0 off, -1 the default")
            ->capture_default_str();
        sub.add_option("--fuse", o->fuse,
                       "cuda_options::fuse_norm_linear + fuse_add + fuse_conv_l2 + fuse_sigmoid (RMS_NORM into the next GEMV,"
                       " residual ADD and SIGMOID into its epilogue, L2_NORM into its SHORT_CONV):"
                       " 1 on, 0 off, -1 the backend's defaults")->capture_default_str();
        sub.add_option("--kda-chunk", o->kda_chunk,
                       "cuda_options::kda_chunk_min_tokens: N > 0 the chunked KDA prefill kernel from N tokens, 0 off,"
                       " -1 the default")->capture_default_str();
        sub.add_option("--moe-mma-v2", o->moe_mma_v2,
                       "cuda_options::moe_mma_v2 (the pipelined tensor-core expert kernel): 1 on, 0 off, -1 the default")
            ->capture_default_str();
        sub.add_option("--moe-v4", o->moe_v4,
                       "cuda_options::moe_decode_v4 + moe_small_v4 (decode / few-token expert kernels): 1 on, 0 off, -1 the defaults")
            ->capture_default_str();
        sub.add_option("--prefill-fast", o->prefill_fast,
                       "cuda_options::{moe_route_gemm,mla_prefill,conv_prefill,attn_res_prefill}_tokens: N > 0 the prefill router GEMM,"
                       " MLA flash kernel, token-parallel SHORT_CONV and float4 ATTN_RES_MIX from N tokens, 0 off, -1 the defaults")->capture_default_str();
        sub.add_flag("--all", o->all, "print every node out of tolerance, not only the first");
        return std::function<int()>([o] {
#if defined(PERIGEE_HAVE_CUDA)
            return run_compare(*o);
#else
            PG_FAIL("compare-backends: not compiled with CUDA (configure with -DPERIGEE_CUDA=ON)");
            return 1;
#endif
        });
    }}};

} // namespace
} // namespace perigee::cli
