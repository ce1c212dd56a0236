// bench-decode: whole decode steps of a real-width model on the GPU, against the HBM floor measured in the same run.
//
// The model is built from src/model (config -> weights_declare -> weights_load -> forward_build), but its weights are
// created directly on the device (backend_cuda::weight_generate): the checkpoint is a SPARSE safetensors file (header
// only, holes for the data), so the host never holds the 70-100 GB, and its mapping addresses serve as the weight
// cache keys. Presets: k3-layers-4 (synth preset: K3's true widths, 4 layers, MXFP4 experts) and kimi-linear-48b
// (the Kimi-Linear-48B-A3B geometry of ARCHITECTURE §1.1, bf16 experts; defined here, not in synth).
//
// For each batch size B (B sequences, 1 token each, every sequence at position --ctx) it prints ms/step eager (host
// launches every kernel) and as one replayed CUDA graph, tok/s, the bytes the step must read (weights touched incl.
// only the experts actually selected in this step, KDA/conv state read+written, MLA latents read), achieved GB/s and
// % of the bandwidth floor (bytes / measured copy bandwidth). Ceilings measured in the same run: 2 GiB D2D copy
// (bytes read + written) and a cuBLASLt bf16 8192^3 GEMM. Per-op GPU time from an event-profiled replay follows.
// Timings: host wall clock around N launches + one sync (graph) or N runs (eager), after warm-up; median of 3 reps.
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/fuse-plan.h"
#include "kernel-timeline.h"
#include "core/error.h"
#include "loader/checkpoint.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/state.h"
#include "model/synth.h"
#include "model/weights.h"

#include <cublasLt.h>

#include <sstream>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace perigee;
using json = nlohmann::json;

#define CK(x) do { cudaError_t e_ = (x); PG_CHECK(e_ == cudaSuccess, "{}: {}", #x, cudaGetErrorString(e_)); } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); PG_CHECK(s_ == CUBLAS_STATUS_SUCCESS, "{}: status {}", #x, int(s_)); } while (0)

namespace {

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- ceilings ----
double copy_gbs() {
    const size_t n = size_t(2) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 0x5A, n));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> v;
    for (int i = 0; i < 13; ++i) {
        CK(cudaEventRecord(e0));
        CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) v.push_back(ms);
    }
    std::sort(v.begin(), v.end());
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 2.0 * double(n) / (v[v.size() / 2] * 1e-3) / 1e9;
}

double gemm_tflops() {
    const int64_t M = 8192, N = 8192, K = 8192;
    void *A, *B, *D, *ws;
    CK(cudaMalloc(&A, size_t(M * K) * 2));
    CK(cudaMalloc(&B, size_t(N * K) * 2));
    CK(cudaMalloc(&D, size_t(M * N) * 4));
    const size_t wsz = 32u << 20;
    CK(cudaMalloc(&ws, wsz));
    {   // random bf16 in [-1, 1) (never zeros: zeros run faster)
        std::vector<uint16_t> h(size_t(M * K));
        uint32_t x = 12345;
        for (auto & v : h) {
            x = x * 1664525u + 1013904223u;
            const float f = float(x >> 8) / 16777216.0f * 2.0f - 1.0f;
            uint32_t b;
            std::memcpy(&b, &f, 4);
            v = uint16_t(b >> 16);
        }
        CK(cudaMemcpy(A, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(B, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
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
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    PG_CHECK(found > 0, "no cuBLASLt algorithm for the GEMM ceiling");
    const float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> v;
    for (int i = 0; i < 13; ++i) {
        CK(cudaEventRecord(e0));
        CB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, ws, wsz, nullptr));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3) v.push_back(ms);
    }
    std::sort(v.begin(), v.end());
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(lt);
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(D));
    CK(cudaFree(ws));
    return 2.0 * double(M) * N * K / (v[v.size() / 2] * 1e-3) / 1e12;
}

// ---- the model ----
int g_layers = 0;   // --layers N: the Kimi-Linear-48B geometry cut to its first N layers (0: all 27)

std::string config_text(const std::string & preset) {
    if (preset != "kimi-linear-48b") {
        PG_CHECK(g_layers == 0, "--layers applies to the kimi-linear-48b preset only, not {}", preset);
        return synth_config_json(preset);
    }
    // Kimi-Linear-48B-A3B (ARCHITECTURE §1.1, the released config's values), on the published-form template.
    json t = json::parse(synth_config_json("kimi-linear-tiny"));
    std::vector<int64_t> full = {4, 8, 12, 16, 20, 24, 27}, kda;
    for (int64_t l = 1; l <= 27; ++l)
        if (std::find(full.begin(), full.end(), l) == full.end()) kda.push_back(l);
    t["vocab_size"] = 163840;
    t["hidden_size"] = 2304;
    t["intermediate_size"] = 9216;
    t["num_hidden_layers"] = 27;
    t["num_attention_heads"] = 32;
    t["num_key_value_heads"] = 32;
    t["q_lora_rank"] = nullptr;
    t["kv_lora_rank"] = 512;
    t["qk_nope_head_dim"] = 128;
    t["qk_rope_head_dim"] = 64;
    t["v_head_dim"] = 128;
    t["rms_norm_eps"] = 1e-5;
    t["num_experts"] = 256;
    t["num_experts_per_token"] = 8;
    t["num_shared_experts"] = 1;
    t["moe_intermediate_size"] = 1024;
    t["routed_scaling_factor"] = 2.446;
    t["num_expert_group"] = 1;
    t["topk_group"] = 1;
    t["first_k_dense_replace"] = 1;
    t["bos_token_id"] = 163584;
    t["eos_token_id"] = 163586;
    t["pad_token_id"] = 163839;
    t["linear_attn_config"]["num_heads"] = 32;
    t["linear_attn_config"]["head_dim"] = 128;
    t["linear_attn_config"]["short_conv_kernel_size"] = 4;
    if (g_layers > 0) {   // the first N layers, in the same order (1-based layer numbers, as the released config)
        PG_CHECK(g_layers <= 27, "--layers {}: the 48B geometry has 27 layers", g_layers);
        auto cut = [](std::vector<int64_t> & v) { v.erase(std::remove_if(v.begin(), v.end(), [](int64_t l) { return l > g_layers; }), v.end()); };
        cut(full);
        cut(kda);
        t["num_hidden_layers"] = g_layers;
    }
    t["linear_attn_config"]["kda_layers"] = kda;
    t["linear_attn_config"]["full_attn_layers"] = full;
    return t.dump(2);
}

// config.json + one sparse model.safetensors (header written, data left as a hole: no disk, no host memory).
void write_sparse_model(const std::string & preset, const std::string & dir) {
    std::filesystem::create_directories(dir);
    const std::string cfg = config_text(preset);
    std::ofstream(dir + "/config.json") << cfg;
    const kimi_config c = config_parse(cfg, preset);
    const checkpoint none{};
    auto decls = weights_declare(c, none);
    // F32 first, then 2-byte, then bytes: every tensor stays aligned to its element size without gaps.
    std::stable_sort(decls.begin(), decls.end(), [](const weight_decl & a, const weight_decl & b) {
        return dtype_bits(a.dtypes.at(0)) > dtype_bits(b.dtypes.at(0));
    });
    json h = json::object();
    h["__metadata__"] = {{"format", "pt"}};
    uint64_t off = 0;
    for (const auto & d : decls) {
        const dtype t = d.dtypes.at(0);
        const shape_t & s = d.shapes.at(0);
        const uint64_t nb = uint64_t(shape_numel(s)) * uint64_t(dtype_bits(t)) / 8;
        h[d.name] = {{"dtype", std::string(dtype_name(t))}, {"shape", s}, {"data_offsets", {off, off + nb}}};
        off += nb;
    }
    std::string hs = h.dump();
    while (hs.size() % 8) hs.push_back(' ');
    const std::string path = dir + "/model.safetensors";
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    PG_CHECK(fd >= 0, "{}: cannot create", path);
    const uint64_t n = hs.size();
    bool ok = ::write(fd, &n, 8) == 8 && ::write(fd, hs.data(), hs.size()) == ssize_t(hs.size());
    ok = ok && ::ftruncate(fd, off_t(8 + hs.size() + off)) == 0;
    ::close(fd);
    PG_CHECK(ok, "{}: write failed", path);
    std::printf("%s: sparse checkpoint %.2f GB of tensor data (%zu tensors)\n", preset.c_str(), double(off) / 1e9, decls.size());
}

bool ends_with(const std::string & s, const std::string & suf) {
    return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// Ranges by role, matching the synth preset's distributions in mean and spread (uniform instead of normal).
void generate(backend_cuda & be, const kimi_config & c, const model_weights & w) {
    uint64_t seed = 1;
    const float r3 = std::sqrt(3.0f);
    for (const auto & [n, t] : w.tensors) {
        float lo, hi;
        if (ends_with(n, "A_log")) lo = 0.0f, hi = std::log(16.0f);
        else if (ends_with(n, "dt_bias")) lo = -0.25f * r3, hi = 0.25f * r3;
        else if (ends_with(n, "e_score_correction_bias") || ends_with(n, "k_norm.bias")) lo = -0.1f * r3, hi = 0.1f * r3;
        else if (ends_with(n, "norm.weight") || ends_with(n, "layernorm.weight")) lo = 0.8f, hi = 1.2f;
        else if (ends_with(n, "_conv1d.weight")) lo = -r3 / 2, hi = r3 / 2;
        else if (ends_with(n, "embed_tokens.weight")) lo = -r3, hi = r3;
        else if (ends_with(n, "weight_packed")) lo = 0, hi = 255;
        else if (ends_with(n, "weight_scale")) lo = 118, hi = 121;   // E8M0 2^-9..2^-6: |w| ~ 1/sqrt(fan_in)
        else {
            const float s = 1.0f / std::sqrt(float(t.shape.back()));
            lo = -s * r3, hi = s * r3;
        }
        be.weight_generate(t, seed++, lo, hi);
    }
    (void)c;
}

struct step_bytes { double weights = 0, experts = 0, state = 0, kv = 0; double total() const { return weights + experts + state + kv; } };

// The weight bytes of the experts a MOE_EXPERTS node selected in the last run (each selected expert once).
double selected_expert_bytes(const node & n, backend_cuda & be) {
    const tensor ids = be.read(n.src[1]);
    const auto & ex = *n.p.experts;
    std::set<int32_t> used(ids.as<int32_t>(), ids.as<int32_t>() + ids.numel());
    double bytes = 0;
    for (int32_t e : used) {
        if (e < 0 || size_t(e) >= ex.size()) continue;
        for (const expert_matrix * m : {&ex[size_t(e)].gate, &ex[size_t(e)].up, &ex[size_t(e)].down})
            bytes += m->weight ? double(m->weight->nbytes) : double(m->packed->nbytes) + double(m->scale->nbytes);
    }
    return bytes;
}

// Bytes the step must read (and, for recurrent state, write), from the graph and the experts this step selected.
step_bytes count_bytes(const graph & g, backend_cuda & be) {
    step_bytes r;
    std::set<const void *> seen;
    const batch & b = *g.b;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
        const node & n = g.nodes[i];
        for (size_t s = 0; s < n.src.size(); ++s) {
            if (!n.src[s].valid()) continue;
            const node & l = g.at(n.src[s]);
            if (l.op == op_type::WEIGHT) {
                if (n.op == op_type::GET_ROWS) {
                    r.weights += double(b.n_tokens()) * double(l.leaf->nbytes) / double(l.leaf->shape.at(0));
                } else if (seen.insert(l.leaf->data).second) {
                    r.weights += double(l.leaf->nbytes);
                }
            } else if (l.op == op_type::STATE) {
                const tensor & st = *l.state;
                const double per_row = double(st.nbytes) / double(st.shape.at(0));
                if (n.op == op_type::KDA_SCAN || n.op == op_type::SHORT_CONV) {
                    r.state += 2.0 * per_row * b.n_seq();   // one slot row per sequence, read + written
                } else {   // paged caches: one row per position read, the new token's written
                    const double row = per_row / double(st.shape.at(1));
                    for (int q = 0; q < b.n_seq(); ++q) r.kv += row * double(b.pos0[size_t(q)] + b.seq_len(q) + b.seq_len(q));
                }
            }
        }
        if (n.op == op_type::MOE_EXPERTS) r.experts += selected_expert_bytes(n, be);
    }
    return r;
}

template <class F> double median_ms_per(F f, int reps) {
    std::vector<double> v;
    for (int i = 0; i < reps; ++i) v.push_back(f());
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct opts {
    std::vector<std::string> presets = {"k3-layers-4", "kimi-linear-48b"};
    std::vector<int> batches = {1, 8, 64};
    int ctx = 1024, steps = 20, page = 64;
    bool compare_moe = true, profile = true;
    int moe_mma = -1;   // -1: the backend's default; --moe-mma N: cuda_options::moe_mma_tokens for the timed passes (prefill: off vs N side by side)
    std::vector<int> prefill;   // --prefill N,M: time one sequence of N prompt tokens instead of the decode steps
    int bf16_inputs = 0;   // --bf16-inputs N (prefill): forward_options::bf16_inputs_min_tokens = N for every prefill pass and the profile
    int kda_chunk = -1;   // -1: the backend's default; --kda-chunk N (prefill): an extra pass with cuda_options::kda_chunk_min_tokens = N; the profile too
    int moe_mma_v2 = -1;   // --moe-mma-v2 0|1: cuda_options::moe_mma_v2 for the decode passes and the prefill profile; prefill: + passes "v2-N", "v2-1"
    int fuse = -1;   // --fuse 0|1: cuda_options::fuse_norm_linear + fuse_add + fuse_conv_l2 + fuse_sigmoid + fuse_kda_decode for every pass (-1: the defaults)
    int moe_v4 = -1;   // --moe-v4 0|1: cuda_options::moe_decode_v4 + moe_small_v4 for every pass and the profile (-1: the defaults)
    int moe_v5 = -1;   // --moe-v5 0|1: cuda_options::moe_decode_v5 for every pass and the profile (-1: the default); pass "dec-v5-off"/"dec-v5" flips the default
    int prefill_fast = -1;   // --prefill-fast N: cuda_options::moe_route_gemm_tokens = mla_prefill_tokens = conv_prefill_tokens = attn_res_prefill_tokens = N in every prefill pass and the profile (-1: the defaults)
    int pdl = -1;   // --pdl 0|1: cuda_options::pdl for every pass (-1: the default) + the pass "pdl-off"/"pdl-on" that flips it
    int timeline = 0;   // --timeline N: CUPTI kernel records of N graph replays per batch size (pass 0), kernel-timeline.h
    bool dry = false;   // no GPU: write the sparse model, load it, build the B=1 graph (checks this machine's half)
    std::vector<std::pair<std::string, int>> sets;   // --set name=value,...: cuda_options fields for every pass (after the others)
};

// --set: the cuda_options switches a run can pin by name (ints; bools as 0/1). An unknown name is an error naming it.
void apply_sets(cuda_options & co, const opts & o) {
    // The bench times run() as the eager step and its own capture()/replay() as the graph step; the engine's graph replay
    // inside run() (graph_decode) would turn the eager column into replays, so it is off unless --set graph_decode=1 (then
    // "eager ms" is what the engine's decode step costs).
    co.graph_decode = false;
    for (const auto & [k, v] : o.sets) {
        if (k == "gemv_unroll") co.gemv_unroll = v;
        else if (k == "gemv_max_tokens") co.gemv_max_tokens = v;
        else if (k == "gemv_mma_min_tokens") co.gemv_mma_min_tokens = v;
        else if (k == "gemv_max_elems") co.gemv_max_elems = v;
        else if (k == "gemv_v2_min_in") co.gemv_v2_min_in = v;
        else if (k == "gemv_v3") co.gemv_v3 = v;
        else if (k == "gemv_v3_max_in") co.gemv_v3_max_in = v;
        else if (k == "gemv_v3_min_in") co.gemv_v3_min_in = v;
        else if (k == "moe_bf16_early") co.moe_bf16_early = v;
        else if (k == "pdl") co.pdl = v != 0;
        else if (k == "moe_decode_v5") co.moe_decode_v5 = v != 0;
        else if (k == "moe_decode_v6") co.moe_decode_v6 = v != 0;
        else if (k == "moe_decode_v7") co.moe_decode_v7 = v != 0;
        else if (k == "moe_decode_v7_form") {
            PG_CHECK(v >= 0 && v % 10 == 0 && v / 100 <= 4 && v / 10 % 10 <= 3,
                     "--set moe_decode_v7_form={}: 100 x gate/up form (0-4) + 10 x down form (0-3)", v);
            co.moe_decode_v7_form = v;
        }
        else if (k == "moe_decode_bf16") co.moe_decode_bf16 = v != 0;
        else if (k == "moe_decode_pairs_mxfp4") co.moe_decode_pairs_mxfp4 = v;
        else if (k == "moe_decode_pairs_bf16") co.moe_decode_pairs_bf16 = v;
        else if (k == "moe_decode_pairs_sorted") co.moe_decode_pairs_sorted = v != 0;
        else if (k == "moe_small_v4") co.moe_small_v4 = v != 0;
        else if (k == "moe_mma_tokens") co.moe_mma_tokens = v;
        else if (k == "moe_mma_v3") co.moe_mma_v3 = v != 0;
        else if (k == "moe_mma_v4") co.moe_mma_v4 = v != 0;
        else if (k == "moe_mma_v4_bf16") co.moe_mma_v4_bf16 = v != 0;
        else if (k == "moe_mma_v4_shift") co.moe_mma_v4_shift = v != 0;
        else if (k == "linear_bf16_share_x") co.linear_bf16_share_x = v != 0;
        else if (k == "mla_prefill_mma") co.mla_prefill_mma = v != 0;
        else if (k == "free_dead_outputs") co.free_dead_outputs = v != 0;
        else if (k == "moe_decode_v4") co.moe_decode_v4 = v != 0;
        else if (k == "moe_select_warp") co.moe_select_warp = v != 0;
        else if (k == "moe_select_sort") co.moe_select_sort = v != 0;
        else if (k == "moe_select_radix") co.moe_select_radix = v != 0;
        else if (k == "moe_route_gemv_v2") co.moe_route_gemv_v2 = v != 0;
        else if (k == "moe_route_fused_radix") co.moe_route_fused_radix = v != 0;
        else if (k == "attn_res_chunk") co.attn_res_chunk = v;
        else if (k == "attn_res_cluster") co.attn_res_cluster = v != 0;
        else if (k == "attn_res_split") co.attn_res_split = v != 0;
        else if (k == "linear_group") co.linear_group = v != 0;
        else if (k == "mla_decode_v2") co.mla_decode_v2 = v != 0;
        else if (k == "mla_decode_v3") co.mla_decode_v3 = v != 0;
        else if (k == "mla_attn_v4") co.mla_attn_v4 = v != 0;
        else if (k == "fuse_mla_kv") co.fuse_mla_kv = v != 0;
        else if (k == "fuse_kda_decode") co.fuse_kda_decode = v != 0;
        else if (k == "moe_shared_slot") co.moe_shared_slot = v != 0;
        else if (k == "moe_layer_fused") co.moe_layer_fused = v != 0;
        else if (k == "kda_oproj_fused") co.kda_oproj_fused = v != 0;
        else if (k == "moe_select_small") co.moe_select_small = int(v);
        else if (k == "moe_shared_prefetch") co.moe_shared_prefetch = v != 0;
        else if (k == "gemv_evict_first") co.gemv_evict_first = v != 0;
        else if (k == "l2_side_prefetch_mib") co.l2_side_prefetch_mib = int(v);
        else if (k == "l2_side_prefetch_blocks") co.l2_side_prefetch_blocks = int(v);
        else if (k == "linear_split_bf16") co.linear_split_bf16 = v != 0;
        else if (k == "linear_split_stacked") co.linear_split_stacked = v;
        else if (k == "moe_mma_split") co.moe_mma_split = v != 0;
        else if (k == "moe_bf16_evict_first") co.moe_bf16_evict_first = v != 0;
        else if (k == "norm_reg") co.norm_reg = v != 0;
        else if (k == "fuse_norm_route") co.fuse_norm_route = v != 0;
        else if (k == "fuse_norm_max_mib") co.fuse_norm_max_weight_bytes = int64_t(v) << 20;
        else if (k == "kda_decode_v2") co.kda_decode_v2 = v != 0;
        else if (k == "graph_decode") co.graph_decode = v != 0;
        else if (k == "fuse") co.fuse_norm_linear = co.fuse_add = co.fuse_conv_l2 = co.fuse_sigmoid = co.fuse_kda_decode = v != 0;
        else PG_FAIL("--set: unknown cuda_options name '{}'", k);
    }
}

std::string model_dir(const std::string & preset) {
    return "/tmp/pg-bench/" + preset + (g_layers > 0 ? "-L" + std::to_string(g_layers) : "");
}

void bench_preset(const std::string & preset, const opts & o, double bw_gbs) {
    const std::string dir = model_dir(preset);
    write_sparse_model(preset, dir);
    const kimi_config c = config_load(dir);
    auto w = weights_load(c, checkpoint::open(dir));
    const int max_b = *std::max_element(o.batches.begin(), o.batches.end());
    const int pps = (o.ctx + 1 + o.page - 1) / o.page;
    model_state st = state_init(c, max_b, max_b * pps, o.page);
    // pass 0: every current kernel; then batch 1 with one switch back each (compare mode):
    // 1 "mla-1blk": MLA one block per head (no key split); 2 "fp4-v1": the first grouped MXFP4 kernel;
    // 3 "lin-1": one launch per LINEAR (linear_group off; the grouped GEMV is the default since 2026-11-29 late);
    // 4 "ares-1": ATTN_RES_MIX one block per row.
    // (The first router + per-slot expert kernels, moe_grouped/moe_route_fast = false, are no longer timed here:
    // 8% / 7% of the floor at batch 1, bench/RESULTS.md 2026-11-29.)
    // 5: MXFP4 decode v3 flipped from its default ("fp4-v3" when the default is v2; fp4-v1 turns v2 off); 6: the decode
    // router flipped from its default ("route-1": one fused launch, "route-2": GEMV + select).
    // Fusion passes (fuse-plan.h; both off by default until their H200 run): "+fnorm" RMS_NORM folded into the next
    // GEMV(s), "+fadd" residual ADDs into the GEMV epilogue, "+fuse" both; "+fconv" SHORT_CONV + its L2_NORM in one
    // launch (fuse_conv_l2), "+fsig" SIGMOID into its GEMV's epilogue (fuse_sigmoid), "+fall" all four, "+fnorm-nolim"
    // fuse_norm_linear without its weight-bytes limit (fuse_norm_max_weight_bytes). --fuse 0|1 sets all four for every pass.
    const cuda_options defaults;
    const char * labels[] = {"new", "mla-1blk", "fp4-v1", "lin-1", "ares-1", defaults.moe_fp4_v3 ? "fp4-v2" : "fp4-v3",
                             defaults.moe_route_fused ? "route-2" : "route-1", "+fnorm", "+fadd", "+fuse",
                             defaults.moe_decode_v4 ? "dec-old" : "dec-v4", defaults.moe_small_v4 ? "small-old" : "small-v4", "+fconv", "+fsig", "+fall", "+fnorm-nolim",
                             "gemv-0", "gemv-8",   // cuda_options::gemv_unroll 0 (the first GEMV kernels) / 8
                             // cuda_options::pdl flipped from pass 0's setting (--pdl, else the default); with --pdl it runs
                             // even under --no-compare, so one run times the step both ways
                             (o.pdl >= 0 ? o.pdl != 0 : defaults.pdl) ? "pdl-off" : "pdl-on",
                             defaults.moe_decode_v5 ? "dec-v5-off" : "dec-v5"};   // MXFP4 decode v5 flipped (T == 1)
    for (int pass = 0; pass < int(std::size(labels)); ++pass) {
        const bool pdl_pass = std::strcmp(labels[pass], "pdl-off") == 0 || std::strcmp(labels[pass], "pdl-on") == 0;
        if (!o.compare_moe && pass > 0 && !(pdl_pass && o.pdl >= 0)) continue;
        cuda_options co;
        if (o.pdl >= 0) co.pdl = o.pdl != 0;
        if (pdl_pass) co.pdl = std::strcmp(labels[pass], "pdl-on") == 0;
        co.mla_split = pass != 1;
        co.moe_fp4_v2 = pass != 2;
        if (pass == 5) co.moe_fp4_v3 = !defaults.moe_fp4_v3;
        if (pass == 6) co.moe_route_fused = !defaults.moe_route_fused;
        if (o.moe_v4 >= 0) co.moe_decode_v4 = co.moe_small_v4 = o.moe_v4 != 0;
        if (pass == 10) co.moe_decode_v4 = !defaults.moe_decode_v4;   // MoE decode v4 flipped (T == 1, BF16/MXFP4)
        if (pass == 11) co.moe_small_v4 = !defaults.moe_small_v4;     // T > 1 GEMV experts v4 flipped: every batch size
        if (o.moe_v5 >= 0) co.moe_decode_v5 = o.moe_v5 != 0;
        if (std::strcmp(labels[pass], "dec-v5-off") == 0 || std::strcmp(labels[pass], "dec-v5") == 0)
            co.moe_decode_v5 = !defaults.moe_decode_v5;
        co.linear_group = pass != 3;
        co.attn_res_split = pass != 4;
        if (o.moe_mma >= 0) co.moe_mma_tokens = o.moe_mma, co.moe_mma_large_step = 0;
        if (o.moe_mma_v2 >= 0) co.moe_mma_v2 = o.moe_mma_v2 != 0;
        const char * label = labels[pass];
        if (o.fuse >= 0) co.fuse_norm_linear = co.fuse_add = co.fuse_conv_l2 = co.fuse_sigmoid = co.fuse_kda_decode = o.fuse != 0;
        if (std::strcmp(label, "+fall") == 0) co.fuse_norm_linear = co.fuse_add = co.fuse_conv_l2 = co.fuse_sigmoid = true;
        if (std::strcmp(label, "+fconv") == 0) co.fuse_conv_l2 = true;
        if (std::strcmp(label, "+fsig") == 0) co.fuse_sigmoid = true;
        if (std::strcmp(label, "+fnorm-nolim") == 0) {   // the staged norm GEMV on every foldable norm, however big
            co.fuse_norm_linear = true;
            co.fuse_norm_max_weight_bytes = INT64_MAX;
        }
        if (std::strcmp(label, "+fnorm") == 0 || std::strcmp(label, "+fuse") == 0) co.fuse_norm_linear = true;
        if (std::strcmp(label, "+fadd") == 0 || std::strcmp(label, "+fuse") == 0) co.fuse_add = true;
        if (std::strcmp(label, "gemv-0") == 0) co.gemv_unroll = 0;
        if (std::strcmp(label, "gemv-8") == 0) co.gemv_unroll = 8;
        apply_sets(co, o);
        const double t0 = now_ms();
        auto be = backend_cuda_init(0, co);
        generate(*be, c, *w);
        std::printf("%s [%s]: %.2f GB of weights generated on the device in %.0f ms (%s)\n", preset.c_str(),
                    label, double(be->weight_bytes()) / 1e9, now_ms() - t0,
                    be->device_name().c_str());
        std::printf("%-16s %-10s %5s %10s %10s %10s %11s %9s %8s\n", "preset", "kernels", "B", "eager ms", "graph ms", "tok/s",
                    "GB/step", "GB/s", "% floor");
        for (int B : o.batches) {
            if (pass > 0 && B != 1 && pass != 11) continue;   // the comparisons: batch 1 only (pass 11: every batch)
            auto b = std::make_shared<batch>();
            b->seq_start = {0};
            b->page_size = o.page;
            for (int s = 0; s < B; ++s) {
                b->ids.push_back(int32_t((s * 7919 + 17) % c.vocab_size));
                b->seq_start.push_back(s + 1);
                b->pos0.push_back(o.ctx);
                b->slot.push_back(s);
                std::vector<int32_t> bt;
                for (int p = 0; p < pps; ++p) bt.push_back(s * pps + p);
                b->block_table.push_back(bt);
            }
            graph g = forward_build(c, *w, st, b);
            be->check_supported(g);
            be->run(g);
            be->run(g);
            const step_bytes sb = count_bytes(g, *be);
            const double eager = median_ms_per([&] {
                const double a = now_ms();
                for (int i = 0; i < o.steps / 2; ++i) be->run(g);
                return (now_ms() - a) / (o.steps / 2);
            }, 3);
            be->capture(g);
            be->replay(3);
            if (be->side_prefetches() > 0) std::printf("    side L2 prefetch nodes in the graph: %d\n", be->side_prefetches());
            if (be->fused_moe_layers() > 0) std::printf("    MoE blocks as one launch (moe_layer_fused): %d\n", be->fused_moe_layers());
            if (be->fused_kda_oprojs() > 0) std::printf("    KDA tails with their o_proj (kda_oproj_fused): %d\n", be->fused_kda_oprojs());
            const double gms = median_ms_per([&] {
                const double a = now_ms();
                be->replay(o.steps);
                return (now_ms() - a) / o.steps;
            }, 3);
            if (o.timeline > 0 && pass == 0) {   // two replays more, dropped: the first traced launches pay CUPTI's setup
                timeline::start();
                be->replay(o.timeline + 2);
                timeline::report(stdout, timeline::stop(), 2, gms, preset + " B=" + std::to_string(B));
            }
            const double gb = sb.total() / 1e9;
            const double floor_ms = sb.total() / (bw_gbs * 1e9) * 1e3;
            std::printf("%-16s %-10s %5d %10.3f %10.3f %10.1f %11.3f %9.0f %7.1f%%\n", preset.c_str(),
                        label, B, eager, gms, B / (gms * 1e-3), gb, gb / (gms * 1e-3),
                        100.0 * floor_ms / gms);
            std::printf("    bytes: weights %.3f GB, experts %.3f GB (selected only), state R+W %.3f GB, latents %.4f GB;"
                        " floor %.3f ms at %.0f GB/s\n",
                        sb.weights / 1e9, sb.experts / 1e9, sb.state / 1e9, sb.kv / 1e9, floor_ms, bw_gbs);
            std::fflush(stdout);
        }
        if (o.profile && pass == 0) {
            be.reset();
            cuda_options cp = co;
            cp.profile_nodes = true;
            auto pb = backend_cuda_init(0, cp);
            generate(*pb, c, *w);
            for (int B : {1, max_b}) {
                auto b = std::make_shared<batch>();
                b->seq_start = {0};
                b->page_size = o.page;
                for (int s = 0; s < B; ++s) {
                    b->ids.push_back(int32_t((s * 7919 + 17) % c.vocab_size));
                    b->seq_start.push_back(s + 1);
                    b->pos0.push_back(o.ctx);
                    b->slot.push_back(s);
                    std::vector<int32_t> bt;
                    for (int p = 0; p < pps; ++p) bt.push_back(s * pps + p);
                    b->block_table.push_back(bt);
                }
                graph g = forward_build(c, *w, st, b);
                pb->run(g);
                pb->run(g);
                // fused launches (fuse-plan.h) carry the time of the nodes they fold: label them so
                const auto fp = cuda_fuse::plan_fusions(g, cp);
                const auto ms = pb->node_ms();
                std::map<std::string, std::pair<double, int>> by_op;
                double tot = 0;
                std::vector<std::pair<double, std::string>> top;
                for (size_t i = 0; i < ms.size(); ++i) {
                    const node & n = g.nodes[i];
                    if (n.op == op_type::WEIGHT || n.op == op_type::STATE || n.op == op_type::IDS) continue;
                    std::string key(op_name(n.op));
                    if (n.op == op_type::LINEAR) {   // split linears by weight size
                        const double mb = double(g.at(n.src[1]).leaf->nbytes) / 1e6;
                        key += mb >= 100 ? " (>=100MB)" : mb >= 10 ? " (10-100MB)" : " (<10MB)";
                    }
                    if (!fp.at[i].empty()) {
                        bool adds = false, sigs = false;
                        for (const auto & gr : fp.at[i].groups)
                            for (const auto & sg : gr) adds |= sg.add[0] >= 0, sigs |= sg.sig >= 0;
                        if (fp.at[i].norm >= 0) key += " + its GEMVs (fused)";
                        if (adds) key += " + ADD epilogue";
                        if (sigs) key += " + SIGMOID epilogue";
                    }
                    if (fp.conv_l2[i] >= 0) key += " + L2_NORM (fused)";
                    by_op[key].first += ms[i];
                    by_op[key].second += 1;
                    tot += ms[i];
                    top.push_back({ms[i], n.name});
                }
                std::printf("  per-op GPU time, %s B=%d (events after every node of an eager run; sum %.3f ms over %zu nodes):\n", preset.c_str(),
                            B, tot, ms.size());
                std::vector<std::pair<double, std::string>> rows;
                for (auto & [k, v] : by_op) rows.push_back({v.first, fmt::format("{} x{}", k, v.second)});
                std::sort(rows.rbegin(), rows.rend());
                for (auto & [t, k] : rows) std::printf("    %8.3f ms %5.1f%%  %s\n", t, 100 * t / tot, k.c_str());
                std::sort(top.rbegin(), top.rend());
                for (size_t i = 0; i < std::min<size_t>(6, top.size()); ++i)
                    std::printf("    top node %zu: %.3f ms %s\n", i, top[i].first, top[i].second.c_str());
                std::fflush(stdout);
            }
        }
    }
}

// GEMM FLOPs of a step: every LINEAR (2 · T · out · in) and every selected (token, expert) slot of MOE_EXPERTS
// (2 · (gate + up + down) · out · in). Attention, the KDA recurrence and the rest are not counted.
// The GEMM FLOPs of one node (2 T out in per LINEAR with a 2-D weight; 2 out in per matrix and (token, slot) of
// MOE_EXPERTS: every slot runs one expert and all experts of a layer have one shape, so the ids need not be read: the
// timing passes release them after their last reader, cuda_options::free_dead_outputs); 0 for any other node.
double node_gemm_flops(const graph & g, const node & n) {
    const double T = double(g.b->n_tokens());
    if (n.op == op_type::LINEAR) {
        const node & wn = g.at(n.src[1]);
        if (wn.op != op_type::WEIGHT || !wn.leaf || wn.leaf->shape.size() != 2) return 0;
        return 2.0 * T * double(wn.leaf->shape[0]) * double(wn.leaf->shape[1]);
    }
    if (n.op != op_type::MOE_EXPERTS) return 0;
    const auto & ex = *n.p.experts;
    const double slots = double(shape_numel(g.at(n.src[1]).outs.at(size_t(n.src[1].out)).shape));
    double f = 0;
    for (const expert_matrix * m : {&ex.at(0).gate, &ex.at(0).up, &ex.at(0).down}) f += slots * 2.0 * double(m->out) * double(m->in);
    return f;
}

double gemm_flops(const graph & g) {
    double f = 0;
    for (const node & n : g.nodes) f += node_gemm_flops(g, n);
    return f;
}

// The GEMM-class nodes' roofline of a prefill step (LINEAR + MOE_EXPERTS): per node, the larger of its tensor-core
// time (FLOPs x passes over the measured bf16 GEMM rate) and its memory time (the weights it must read, the selected
// experts' once each, plus its fp32 activations in and out, over the measured copy rate). passes = 2 is the split
// policy the backend runs by default (activations as bf16 hi + lo: two GEMMs per LINEAR, two wgmmas per expert tile),
// 1 the one-bf16-pass policy of ARCHITECTURE section 3.0. An expert at ~18 tokens (K3 at T = 2048: 16 384 slots over
// 896 experts) is memory bound, so a FLOP-rate target over the GEMM share has to be read against this floor.
struct gemm_floor { double flop_ms = 0, byte_ms = 0, floor_ms = 0; };
gemm_floor gemm_roofline(const graph & g, backend_cuda & be, double bw_gbs, double gemm_tf, int passes) {
    gemm_floor r;
    const double T = double(g.b->n_tokens());
    auto add = [&](double flops, double bytes) {
        const double f = passes * flops / (gemm_tf * 1e12) * 1e3, b = bytes / (bw_gbs * 1e9) * 1e3;
        r.flop_ms += f;
        r.byte_ms += b;
        r.floor_ms += std::max(f, b);
    };
    for (const node & n : g.nodes) {
        const double flops = node_gemm_flops(g, n);
        if (flops == 0) continue;
        if (n.op == op_type::LINEAR) {   // the weight and the fp32 activations in and out
            const tensor & wt = *g.at(n.src[1]).leaf;
            add(flops, double(wt.nbytes) + 4.0 * T * double(wt.shape[0] + wt.shape[1]));
        } else {   // the selected experts' weights and the tokens' rows in and out (d_out wide)
            add(flops, selected_expert_bytes(n, be) + 8.0 * T * double(n.p.experts->at(0).down.out));
        }
    }
    return r;
}

// Prefill: one sequence of T prompt tokens from position 0, eager (one step per prompt). Two passes: LINEARs on
// cuBLASLt with split bf16 activations (hi + lo, two GEMMs: the default) and with one bf16 GEMM. Then the per-op
// profile of the default pass: GEMM share (LINEAR + MOE_EXPERTS node time) and what it achieves vs the ceiling.
void bench_prefill(const std::string & preset, const opts & o, double gemm_tf, double bw_gbs) {
    const std::string dir = model_dir(preset);
    write_sparse_model(preset, dir);
    const kimi_config c = config_load(dir);
    auto w = weights_load(c, checkpoint::open(dir));
    const int max_t = *std::max_element(o.prefill.begin(), o.prefill.end());
    const int pages = (max_t + o.page - 1) / o.page;
    model_state st = state_init(c, 1, pages, o.page);
    auto make_batch = [&](int T) {
        auto b = std::make_shared<batch>();
        for (int i = 0; i < T; ++i) b->ids.push_back(int32_t((int64_t(i) * 7919 + 17) % c.vocab_size));
        b->seq_start = {0, T};
        b->pos0 = {0};
        b->slot = {0};
        b->page_size = o.page;
        std::vector<int32_t> bt;
        for (int p = 0; p < (T + o.page - 1) / o.page; ++p) bt.push_back(p);
        b->block_table.push_back(bt);
        return b;
    };
    // --moe-mma N: both passes split bf16, pass 1 with the tensor-core experts (moe_mma_tokens = N), pass 2 the same with
    // the experts' activations as bf16 hi only (moe_mma_split off: the cost of the hi + lo split); else split vs one.
    const std::string mma_label = "mma-" + std::to_string(o.moe_mma), hi_label = mma_label + "-hi";
    // --kda-chunk N: one more pass, the last one's settings (or pass 1's) with the chunked KDA prefill from N tokens.
    const std::string kda_label = "kda-" + std::to_string(o.kda_chunk);
    // --moe-mma-v2 B: two more passes with the tensor-core experts v2 (cuda_options::moe_mma_v2), at the threshold of
    // --moe-mma (or the default) and at 1 (every expert on mma); passes 0-3 keep v2 at its default.
    const std::string v2_label = "v2-" + std::to_string(o.moe_mma > 0 ? o.moe_mma : cuda_options{}.moe_mma_tokens);
    forward_options fo;   // --bf16-inputs N: ARCHITECTURE 3.0's bf16 GEMM inputs for steps of N tokens or more
    fo.bf16_inputs_min_tokens = o.bf16_inputs;
    // the precision the forward chose for a step's graph (op_params::bf16_inputs on its GEMM-class nodes)
    const auto policy = [](const graph & g) {
        return std::any_of(g.nodes.begin(), g.nodes.end(), [](const node & n) { return n.p.bf16_inputs; }) ? "bf16 inputs" : "split-bf16";
    };
    const char * labels[] = {o.moe_mma > 0 ? "mma-off" : o.bf16_inputs > 0 ? "bf16-in" : "default", o.moe_mma > 0 ? mma_label.c_str() : "one-bf16",
                             hi_label.c_str(), kda_label.c_str(), v2_label.c_str(), "v2-1"};
    for (int pass = 0; pass < 6; ++pass) {
        if (pass == 2 && o.moe_mma <= 0) continue;
        if (pass == 3 && o.kda_chunk <= 0) continue;
        if (pass >= 4 && o.moe_mma_v2 < 0) continue;
        cuda_options co;
        co.linear_split_bf16 = pass != 1 || o.moe_mma > 0;
        // Without --moe-mma / --kda-chunk every pass keeps the backend's defaults for those switches.
        if (o.moe_mma > 0) co.moe_mma_tokens = pass == 0 ? 0 : o.moe_mma;
        // an explicit threshold (--moe-mma, the v2-N / v2-1 passes) applies to every step size, the large-step one included
        if (o.moe_mma > 0 || pass >= 4) co.moe_mma_large_step = 0;
        co.moe_mma_split = pass != 2;
        if (o.prefill_fast >= 0) co.moe_route_gemm_tokens = co.mla_prefill_tokens = co.conv_prefill_tokens = co.attn_res_prefill_tokens = o.prefill_fast;
        if (o.pdl >= 0) co.pdl = o.pdl != 0;
        if (o.kda_chunk > 0) co.kda_chunk_min_tokens = pass == 3 ? o.kda_chunk : 0;
        if (pass >= 4) co.moe_mma_v2 = true;
        if (pass == 5) co.moe_mma_tokens = 1;
        co.free_dead_outputs = true;   // as the runtime runs (these passes read nothing back); the profile below keeps all
        apply_sets(co, o);
        auto be = backend_cuda_init(0, co);
        generate(*be, c, *w);
        for (int T : o.prefill) {
          try {   // one size failing (a launch limit, say) leaves the others and the profile to run
            graph g = forward_build(c, *w, st, make_batch(T), fo);
            be->check_supported(g);
            cudaMemPool_t pool = nullptr;   // the stream-ordered allocator's pool: its high-water mark over one step
            CK(cudaDeviceGetDefaultMemPool(&pool, 0));
            uint64_t zero = 0, peak = 0, used0 = 0;
            CK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
            CK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used0));
            be->run(g);
            CK(cudaDeviceSynchronize());
            CK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &peak));
            std::printf("prefill %-16s %-10s T %5d: step allocations peak %.2f GB (pool high-water, %.2f GB in use before;"
                        " free_dead_outputs %d)\n", preset.c_str(), labels[pass], T, double(peak) / 1e9, double(used0) / 1e9,
                        int(co.free_dead_outputs));
            const double ms = median_ms_per([&] {
                const double a = now_ms();
                be->run(g);
                CK(cudaDeviceSynchronize());
                return now_ms() - a;
            }, 3);
            const double fl = gemm_flops(g);
            std::printf("prefill %-16s %-10s T %5d: %9.3f ms/step eager, %9.0f tok/s; GEMM %.1f GFLOP -> %.1f TFLOP/s"
                        " over the whole step = %.1f%% of the %.0f TFLOP/s GEMM ceiling\n",
                        preset.c_str(), labels[pass], T, ms, T / (ms * 1e-3), fl / 1e9, fl / (ms * 1e-3) / 1e12,
                        100.0 * fl / (ms * 1e-3) / 1e12 / gemm_tf, gemm_tf);
            std::fflush(stdout);
          } catch (const std::exception & e) {
            std::printf("prefill %s %s T %d: FAILED: %s\n", preset.c_str(), labels[pass], T, e.what());
            std::fflush(stdout);
          }
        }
    }
    if (!o.profile) return;
    cuda_options cp;
    cp.profile_nodes = true;
    if (o.moe_mma >= 0) cp.moe_mma_tokens = o.moe_mma, cp.moe_mma_large_step = 0;
    if (o.kda_chunk >= 0) cp.kda_chunk_min_tokens = o.kda_chunk;
    if (o.prefill_fast >= 0) cp.moe_route_gemm_tokens = cp.mla_prefill_tokens = cp.conv_prefill_tokens = cp.attn_res_prefill_tokens = o.prefill_fast;
    if (o.pdl >= 0) cp.pdl = o.pdl != 0;
    if (o.moe_mma_v2 >= 0) cp.moe_mma_v2 = o.moe_mma_v2 != 0;
    apply_sets(cp, o);
    auto pb = backend_cuda_init(0, cp);
    generate(*pb, c, *w);
    for (int T : o.prefill) {
        graph g = forward_build(c, *w, st, make_batch(T), fo);
        try {
            pb->run(g);
            pb->run(g);
        } catch (const std::exception & e) {
            std::printf("  prefill profile %s T=%d: FAILED: %s\n", preset.c_str(), T, e.what());
            continue;
        }
        const auto ms = pb->node_ms();
        std::map<std::string, std::pair<double, int>> by_op;
        double tot = 0, gemm_ms = 0;
        for (size_t i = 0; i < ms.size(); ++i) {
            const node & n = g.nodes[i];
            if (n.op == op_type::WEIGHT || n.op == op_type::STATE || n.op == op_type::IDS) continue;
            by_op[std::string(op_name(n.op))].first += ms[i];
            by_op[std::string(op_name(n.op))].second += 1;
            tot += ms[i];
            if (n.op == op_type::LINEAR || n.op == op_type::MOE_EXPERTS) gemm_ms += ms[i];
        }
        const double fl = gemm_flops(g);
        std::printf("  prefill per-op GPU time, %s T=%d (%s; sum %.3f ms): GEMM share (LINEAR + MOE_EXPERTS) %.3f ms"
                    " = %.1f%%; %.1f GFLOP over it = %.1f TFLOP/s = %.1f%% of the GEMM ceiling\n",
                    preset.c_str(), T, policy(g), tot, gemm_ms, 100 * gemm_ms / tot, fl / 1e9, fl / (gemm_ms * 1e-3) / 1e12,
                    100.0 * fl / (gemm_ms * 1e-3) / 1e12 / gemm_tf);
        std::vector<std::pair<double, std::string>> rows;
        for (auto & [k, v] : by_op) rows.push_back({v.first, fmt::format("{} x{}", k, v.second)});
        std::sort(rows.rbegin(), rows.rend());
        for (size_t i = 0; i < std::min<size_t>(10, rows.size()); ++i)
            std::printf("    %9.3f ms %5.1f%%  %s\n", rows[i].first, 100 * rows[i].first / tot, rows[i].second.c_str());
        for (int passes : {2, 1}) {
            const gemm_floor f = gemm_roofline(g, *pb, bw_gbs, gemm_tf, passes);
            std::printf("  GEMM-class roofline, %s T=%d, %s: floor %.3f ms (tensor %.3f ms, bytes %.3f ms at %.0f GB/s) ="
                        " %.1f%% of the GEMM share's %.3f ms\n", preset.c_str(), T,
                        passes == 2 ? "split policy (2 bf16 passes, the default)" : "one bf16 pass (ARCHITECTURE 3.0)",
                        f.floor_ms, f.flop_ms, f.byte_ms, bw_gbs, 100.0 * f.floor_ms / gemm_ms, gemm_ms);
        }
        std::fflush(stdout);
    }
}

// --dry: the fusion planner of the CUDA backend (fuse-plan.h, the code the backend runs) on the B=1 graph, rule by rule.
// Launch counts are of nodes (an op with several kernels, e.g. MLA_ATTN or MOE_EXPERTS, counts once).
void dry_fusions(const graph & g) {
    int n_lin = 0, n_norm = 0, n_add = 0, n_launch = 0;
    for (const node & n : g.nodes) {
        n_lin += n.op == op_type::LINEAR;
        n_norm += n.op == op_type::RMS_NORM;
        n_add += n.op == op_type::ADD;
        n_launch += n.op != op_type::WEIGHT && n.op != op_type::STATE && n.op != op_type::IDS;
    }
    std::printf("  B=1 graph: %d launching nodes; %d LINEAR, %d RMS_NORM, %d ADD\n", n_launch, n_lin, n_norm, n_add);
    // the plans with one switch off and on, every other option at its default
    const auto off_on = [&](bool cuda_options::*sw) {
        cuda_options co;
        co.*sw = false;
        auto p0 = cuda_fuse::plan_fusions(g, co);
        co.*sw = true;
        return std::make_pair(std::move(p0), cuda_fuse::plan_fusions(g, co));
    };
    {   // fuse_kda_decode off -> on (on by default since session 5)
        const auto [p0, p] = off_on(&cuda_options::fuse_kda_decode);
        std::printf("  fuse_kda_decode off -> on: %d KDA decode tails folded, %d node launches (%d fewer than with it off)\n",
                    p.kda_decodes, n_launch - p.launches_saved(), p.launches_saved() - p0.launches_saved());
    }
    {   // moe_shared_slot on vs off (on by default since session 6): the shared expert as a slot of the routed experts' launch
        const auto [p0, p] = off_on(&cuda_options::moe_shared_slot);
        std::printf("  moe_shared_slot off -> on: %d shared experts folded into MOE_EXPERTS (%d node launches), norms folded"
                    " %d -> %d, adds folded %d -> %d, LINEARs grouped %d -> %d: %d node launches (%d fewer than with it"
                    " off)\n",
                    p.moe_shareds, p.moe_shared_launches, p0.norms, p.norms, p0.adds, p.adds, p0.linear_grouped,
                    p.linear_grouped, n_launch - p.launches_saved(), p.launches_saved() - p0.launches_saved());
    }
    {   // fuse_norm_route off -> on (on by default since session 8): the router logits as a segment of the norm's launch
        const auto [p0, p] = off_on(&cuda_options::fuse_norm_route);
        std::printf("  fuse_norm_route off -> on: %d router GEMVs folded into a norm's launch of LINEARs, norms folded %d -> %d:"
                    " %d node launches (%d fewer than with it off)\n",
                    p.routes, p0.norms, p.norms, n_launch - p.launches_saved(), p.launches_saved() - p0.launches_saved());
    }
    struct pass { const char * label; bool group, norm, add, conv = false, sig = false; };
    int base = -1;
    for (const pass & ps : {pass{"lin-1 (no grouping)", false, false, false}, pass{"linear_group (default)", true, false, false},
                            pass{"+ fuse_norm_linear", true, true, false}, pass{"+ fuse_add", true, false, true},
                            pass{"+ both fusions", true, true, true}, pass{"+ fuse_conv_l2", true, false, false, true},
                            pass{"+ fuse_sigmoid", true, false, false, false, true},
                            pass{"+ all four", true, true, true, true, true}}) {
        cuda_options co;
        co.linear_group = ps.group;
        co.fuse_norm_linear = ps.norm;
        co.fuse_add = ps.add;
        co.fuse_conv_l2 = ps.conv;
        co.fuse_sigmoid = ps.sig;
        co.fuse_kda_decode = false;   // counted on its own line above
        const auto p = cuda_fuse::plan_fusions(g, co);
        if (base < 0) base = p.launches_saved();
        std::printf("  %-24s LINEARs grouped %3d, norms folded %3d of %d, adds folded %3d of %d: %4d node launches"
                    " (%d fewer than lin-1)\n",
                    ps.label, p.linear_grouped, p.norms, n_norm, p.adds, n_add, n_launch - p.launches_saved(),
                    p.launches_saved() - base);
        if (ps.conv) std::printf("  %-24s L2_NORMs folded into their SHORT_CONV: %d\n", "", p.conv_l2s);
        if (ps.sig) std::printf("  %-24s SIGMOIDs folded into their GEMV's epilogue: %d\n", "", p.sigmoids);
        if (ps.conv && ps.sig)   // fuse_mla_kv is at its default (on) in every pass: 2 launches fewer per fold everywhere
            std::printf("  %-24s MLA kv_a splits folded (fuse_mla_kv, on in every pass): %d\n", "", p.mla_kvs);
        if (ps.norm)   // foldable norms the planner keeps (fuse-plan.h): x' past the 47 KiB stage, weights past the limit
            std::printf("  %-24s norms kept: %d (stage), %d (LINEAR weights > %lld MiB)\n", "", p.norms_kept_stage,
                        p.norms_kept_big, (long long)(co.fuse_norm_max_weight_bytes >> 20));
        if (ps.norm && ps.add && !ps.conv && !ps.sig) {   // what stays unfolded, by the consumer/producer that blocks it
            std::map<std::string, int> why;
            for (size_t i = 0; i < g.nodes.size(); ++i) {
                const node & n = g.nodes[i];
                if (n.op == op_type::RMS_NORM && p.at[i].norm < 0) {
                    std::string k = "norm '" + n.name.substr(n.name.rfind('.') + 1) + "' ->";
                    for (size_t j = i + 1; j < g.nodes.size(); ++j)
                        for (const node_ref & r : g.nodes[j].src)
                            if (r.node == int(i)) { k += std::string(" ") + std::string(op_name(g.nodes[j].op)); break; }
                    why[k]++;
                }
                if (n.op == op_type::ADD && p.done_by[i] < 0) {
                    std::string k = "add '" + n.name.substr(n.name.rfind('.') + 1) + "' <-";
                    for (const node_ref & r : n.src) k += std::string(" ") + std::string(op_name(g.at(r).op));
                    why[k]++;
                }
            }
            for (const auto & [k, v] : why) std::printf("    not folded: %3d x %s\n", v, k.c_str());
        }
    }
}

std::vector<int> parse_ints(const std::string & s) {
    std::vector<int> v;
    size_t p = 0;
    while (p < s.size()) {
        const size_t q = s.find(',', p);
        v.push_back(std::stoi(s.substr(p, q == std::string::npos ? std::string::npos : q - p)));
        if (q == std::string::npos) break;
        p = q + 1;
    }
    return v;
}

} // namespace

int main(int argc, char ** argv) {
    opts o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto val = [&]() -> std::string {
            PG_CHECK(i + 1 < argc, "{} needs a value", a);
            return argv[++i];
        };
        if (a == "--preset") o.presets = {val()};
        else if (a == "--batch") o.batches = parse_ints(val());
        else if (a == "--ctx") o.ctx = std::stoi(val());
        else if (a == "--steps") o.steps = std::stoi(val());
        else if (a == "--no-compare") o.compare_moe = false;
        else if (a == "--no-profile") o.profile = false;
        else if (a == "--dry") o.dry = true;
        else if (a == "--layers") g_layers = std::stoi(val());
        else if (a == "--prefill") o.prefill = parse_ints(val());
        else if (a == "--moe-mma") o.moe_mma = std::stoi(val());
        else if (a == "--moe-mma-v2") o.moe_mma_v2 = std::stoi(val());
        else if (a == "--fuse") o.fuse = std::stoi(val());
        else if (a == "--moe-v4") o.moe_v4 = std::stoi(val());
        else if (a == "--moe-v5") o.moe_v5 = std::stoi(val());
        else if (a == "--kda-chunk") o.kda_chunk = std::stoi(val());
        else if (a == "--bf16-inputs") o.bf16_inputs = std::stoi(val());
        else if (a == "--prefill-fast") o.prefill_fast = std::stoi(val());
        else if (a == "--pdl") o.pdl = std::stoi(val());
        else if (a == "--timeline") o.timeline = std::stoi(val());
        else if (a == "--set") {   // name=value[,name=value...]
            std::string v = val(), item;
            std::stringstream ss(v);
            while (std::getline(ss, item, ',')) {
                const size_t eq = item.find('=');
                PG_CHECK(eq != std::string::npos, "--set: '{}' is not name=value", item);
                o.sets.push_back({item.substr(0, eq), std::stoi(item.substr(eq + 1))});
            }
        }
        else {
            std::fprintf(stderr, "usage: bench-cuda-decode [--preset k3-layers-4|kimi-linear-48b] [--batch 1,8,64] [--ctx N] "
                                 "[--steps N] [--set name=value,...] [--no-compare] [--no-profile] [--layers N (kimi-linear-48b cut to N layers)] "
                                 "[--prefill T1,T2 (prefill of one sequence instead of decode)] [--moe-mma N] [--moe-mma-v2 0|1] [--kda-chunk N] [--bf16-inputs N (prefill: steps of >= N tokens with bf16 GEMM inputs)] [--prefill-fast N] [--fuse 0|1] [--moe-v4 0|1] [--moe-v5 0|1] [--pdl 0|1] [--timeline N (CUPTI kernel records of N graph replays)] [--dry]\n");
            return 2;
        }
    }
    try {
        { cuda_options probe; apply_sets(probe, o); }   // an unknown --set name fails here, before any GPU work
        PG_CHECK(o.timeline >= 0, "--timeline {}: a number of graph replays, >= 0", o.timeline);
        PG_CHECK(o.timeline == 0 || timeline::available(), "--timeline: this binary was built without CUPTI");
        if (o.dry) {
            for (const auto & p : o.presets) {
                const std::string dir = model_dir(p);
                write_sparse_model(p, dir);
                const kimi_config c = config_load(dir);
                auto w = weights_load(c, checkpoint::open(dir));
                model_state st = state_init(c, 1, 1 + (o.ctx + 1) / o.page, o.page);
                auto b = std::make_shared<batch>();
                b->ids = {1};
                b->seq_start = {0, 1};
                b->pos0 = {o.ctx};
                b->slot = {0};
                b->page_size = o.page;
                b->block_table.push_back({});
                for (int q = 0; q <= (o.ctx + 1) / o.page; ++q) b->block_table[0].push_back(q);
                graph g = forward_build(c, *w, st, b);
                std::printf("%s: %s; %zu tensors, graph of %zu nodes\n", p.c_str(), config_summary(c).c_str(), w->tensors.size(),
                            g.nodes.size());
                // The backend's own planner (src/backend/cuda/fuse-plan.h), run on the host: what each rule folds at B=1.
                dry_fusions(g);
            }
            return 0;
        }
        cudaDeviceProp prop{};
        CK(cudaGetDeviceProperties(&prop, 0));
        const double bw = copy_gbs();
        const double tf = gemm_tflops();
        std::printf("device %s, %d SMs; HBM copy ceiling %.0f GB/s (2 GiB D2D, R+W); bf16 GEMM ceiling %.0f TFLOP/s "
                    "(cuBLASLt 8192^3)\n", prop.name, prop.multiProcessorCount, bw, tf);
        if (o.prefill.empty())
            std::printf("decode steps: every sequence at position %d, 1 token each; timings median of 3 x %d steps\n", o.ctx,
                        o.steps);
        else
            std::printf("prefill: one sequence of T prompt tokens from position 0, eager, median of 3 steps\n");
        for (const auto & p : o.presets) {
            if (o.prefill.empty()) bench_preset(p, o, bw);
            else bench_prefill(p, o, tf, bw);
        }
    } catch (const std::exception & e) {
        std::fprintf(stderr, "bench-cuda-decode: %s\n", e.what());
        return 1;
    }
    return 0;
}
