// The CUDA backend: one dispatch switch over op_type (STYLE §3.4 rule 4), device mirrors of weights and
// states, per-run output buffers from the stream-ordered allocator, cuBLASLt for LINEAR with many tokens.
#include "backend/cuda/backend-cuda.h"
#include "backend/cuda/cuda-ops.h"
#include "backend/cuda/fuse-ops.h"
#include "backend/cuda/fuse-plan.h"
#include "backend/cuda/side-prefetch-plan.h"
#include "backend/cuda/kda-decode.h"
#include "backend/cuda/prefill-ops.h"
#include "backend/cuda/state-ops.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#define PG_CUDA_CHECK(call)                                                                              \
    do {                                                                                                 \
        const cudaError_t pg_e_ = (call);                                                                \
        PG_CHECK(pg_e_ == cudaSuccess, "{} failed: {} ({})", #call, cudaGetErrorString(pg_e_), int(pg_e_)); \
    } while (0)
#define PG_CUBLAS_CHECK(call)                                                                          \
    do {                                                                                               \
        const cublasStatus_t pg_s_ = (call);                                                           \
        PG_CHECK(pg_s_ == CUBLAS_STATUS_SUCCESS, "{} failed: cublas status {}", #call, int(pg_s_));      \
    } while (0)

namespace perigee {

namespace {

using cuda::dweight;
using cuda::wtype;

constexpr size_t k_guard_bytes = 256;

constexpr uint32_t k_guard_word = 0xA5C3A5C3u;
constexpr uint32_t k_poison_word = 0x7fc00000u;   // quiet NaN (also an impossible id in I32 outputs)

struct dtensor {
    void * p = nullptr;       // first element
    void * alloc = nullptr;   // owned allocation (nullptr for leaves)
    dtype type = dtype::F32;
    shape_t shape;
    size_t nbytes = 0;
};

size_t dtype_bytes(dtype t, int64_t n) { return size_t(n) * size_t(dtype_bits(t)) / 8; }

wtype wtype_of(dtype t, const std::string & who) {
    switch (t) {
        case dtype::F32: return wtype::F32;
        case dtype::BF16: return wtype::BF16;
        case dtype::F16: return wtype::F16;
        default: PG_FAIL("{}: unsupported weight dtype: {}", who, dtype_name(t));
    }
}

bool is_wdtype(dtype t) { return t == dtype::F32 || t == dtype::BF16 || t == dtype::F16; }

// ---- support check: the CPU rules plus this backend's own limits ----
void check_node(const graph & g, int id) {
    const node & n = g.nodes[size_t(id)];
    const std::string who = fmt::format("node {} '{}' ({})", id, n.name, op_name(n.op));
    auto in_type = [&](size_t i) -> dtype {
        PG_CHECK(i < n.src.size() && n.src[i].valid(), "{}: input {} is missing", who, i);
        return g.out(n.src[i]).type;
    };
    auto act = [&](size_t i) {
        PG_CHECK(in_type(i) == dtype::F32, "{}: unsupported activation dtype: {} (input {})", who, dtype_name(in_type(i)), i);
    };
    auto ids = [&](size_t i) {
        PG_CHECK(in_type(i) == dtype::I32, "{}: unsupported ids dtype: {} (input {})", who, dtype_name(in_type(i)), i);
    };
    auto wt = [&](size_t i, bool optional) {
        if (optional && (i >= n.src.size() || !n.src[i].valid())) return;
        PG_CHECK(g.at(n.src.at(i)).op == op_type::WEIGHT, "{}: input {} must be a WEIGHT leaf on cuda, got '{}' ({})", who,
                 i, g.at(n.src[i]).name, op_name(g.at(n.src[i]).op));
        PG_CHECK(is_wdtype(in_type(i)), "{}: unsupported weight dtype: {} (input {})", who, dtype_name(in_type(i)), i);
    };
    auto state = [&](size_t i) {
        const node & s = g.at(n.src.at(i));
        PG_CHECK(s.op == op_type::STATE && s.state != nullptr, "{}: input {} must be a STATE leaf, got '{}' ({})", who, i,
                 s.name, op_name(s.op));
        PG_CHECK(s.state->type == dtype::F32, "{}: unsupported state dtype: {} (input {})", who,
                 dtype_name(s.state->type), i);
    };
    auto need_batch = [&] { PG_CHECK(g.b != nullptr, "{}: the graph has no batch layout", who); };
    switch (n.op) {
        case op_type::IDS: need_batch(); return;
        case op_type::WEIGHT:
        case op_type::STATE: PG_CHECK(n.leaf != nullptr, "{}: leaf without a tensor", who); return;
        case op_type::GET_ROWS: wt(0, false); ids(1); return;
        case op_type::RMS_NORM: act(0); wt(1, true); return;
        case op_type::LAYER_NORM: act(0); wt(1, false); wt(2, false); return;
        case op_type::L2_NORM: act(0); return;
        case op_type::LINEAR: act(0); wt(1, false); return;
        case op_type::ADD:
        case op_type::MUL:
        case op_type::SILU_MUL:
        case op_type::SITU_MUL: act(0); act(1); return;
        case op_type::SCALE:
        case op_type::SIGMOID:
        case op_type::COLS: act(0); return;
        case op_type::SELECT_ROWS: act(0); need_batch(); return;
        case op_type::SHORT_CONV: {
            act(0); wt(1, false); state(2); need_batch();
            const int64_t W = g.out(n.src[1]).shape.back();
            PG_CHECK(W >= 1 && W <= 16, "{}: unsupported conv width: {} (1..16)", who, W);
            return;
        }
        case op_type::KDA_GATE: act(0); wt(1, false); wt(2, false); return;
        case op_type::KDA_SCAN:
            for (size_t i = 0; i < 5; ++i) act(i);
            state(5); need_batch();
            PG_CHECK(n.p.head_dim_k >= 1 && n.p.head_dim_k <= 256, "{}: unsupported head_dim_k: {} (1..256)", who,
                     n.p.head_dim_k);
            PG_CHECK(n.p.chunk_size == 0 || n.p.chunk_size == 64, "{}: unsupported chunk size: {}", who, n.p.chunk_size);
            return;
        case op_type::GATED_RMS_NORM: act(0); act(1); wt(2, false); return;
        case op_type::MLA_ATTN:
            act(0); act(1); act(2); wt(3, false); state(4); need_batch();
            if (n.src.size() > 5 && n.src[5].valid()) ids(5);
            PG_CHECK(n.p.kv_lora_rank >= 1 && n.p.kv_lora_rank <= 512, "{}: unsupported kv_lora_rank: {} (1..512)", who,
                     n.p.kv_lora_rank);
            PG_CHECK(n.p.head_dim_rope <= 64, "{}: unsupported head_dim_rope: {} (<= 64)", who, n.p.head_dim_rope);
            return;
        case op_type::INDEXER_TOPK: act(0); act(1); act(2); state(3); need_batch(); return;
        case op_type::MOE_ROUTE: {
            act(0); wt(1, false); wt(2, true);
            const int64_t E = g.out(n.src[1]).shape.at(0);
            PG_CHECK(E <= 1024, "{}: unsupported expert count: {} (<= 1024)", who, E);
            PG_CHECK(n.p.n_group <= 64, "{}: unsupported n_group: {} (<= 64)", who, n.p.n_group);
            PG_CHECK(n.p.router == router_act::SIGMOID || n.p.router == router_act::SOFTMAX, "{}: unsupported router: {}",
                     who, int(n.p.router));
            return;
        }
        case op_type::MOE_EXPERTS: {
            act(0); ids(1); act(2);
            PG_CHECK(n.p.experts && !n.p.experts->empty(), "{}: no experts", who);
            PG_CHECK(n.p.act == glu_act::SILU || n.p.act == glu_act::SITU, "{}: unsupported activation: {}", who,
                     int(n.p.act));
            const auto & ex = *n.p.experts;
            for (size_t e = 0; e < ex.size(); ++e)
                PG_CHECK(ex[e].gate.out == ex[0].gate.out && ex[e].down.out == ex[0].down.out,
                         "{}: unsupported expert shapes: expert {} differs from expert 0 (uniform d_ff required)", who, e);
            return;
        }
        case op_type::ATTN_RES_MIX: {
            const size_t nc = n.src.size() - 2;
            PG_CHECK(n.src.size() >= 3, "{}: no candidates", who);
            PG_CHECK(nc <= size_t(cuda::k_attn_res_max), "{}: unsupported candidate count: {} (<= {})", who, nc,
                     cuda::k_attn_res_max);
            for (size_t i = 0; i < nc; ++i) act(i);
            wt(nc, false); wt(nc + 1, false);
            return;
        }
        case op_type::COUNT: break;
    }
    PG_FAIL("{}: op not implemented on cuda", who);
}

// Paging invariants (the CPU's paging_check): every position written has a page in 0..n_pages-1.
void paging_check(const batch & b, int64_t n_pages, const std::string & who) {
    PG_CHECK(b.page_size > 0, "{}: batch.page_size is {}", who, b.page_size);
    PG_CHECK(int(b.block_table.size()) == b.n_seq(), "{}: batch.block_table has {} rows for {} sequences", who,
             b.block_table.size(), b.n_seq());
    for (int s = 0; s < b.n_seq(); ++s) {
        const int64_t last = int64_t(b.pos0[size_t(s)]) + b.seq_len(s) - 1;
        const auto & bt = b.block_table[size_t(s)];
        PG_CHECK(int64_t(bt.size()) * b.page_size > last, "{}: batch.block_table[{}] has {} pages, position {} needs more",
                 who, s, bt.size(), last);
        for (int64_t p = 0; p <= last / b.page_size; ++p)
            PG_CHECK(bt[size_t(p)] >= 0 && bt[size_t(p)] < n_pages, "{}: batch.block_table[{}][{}] = {} outside {} pages",
                     who, s, p, bt[size_t(p)], n_pages);
    }
}

void slots_check(const batch & b, int64_t n_slots, const std::string & who) {
    for (int s = 0; s < b.n_seq(); ++s)
        PG_CHECK(b.slot[size_t(s)] >= 0 && b.slot[size_t(s)] < n_slots, "{}: batch.slot[{}] = {} outside {} slots", who, s,
                 b.slot[size_t(s)], n_slots);
}

class cuda_backend final : public backend_cuda {
public:
    cuda_backend(int device, const cuda_options & opt) : dev_(device), opt_(opt) {
        PG_CHECK(opt.gemv_unroll == 0 || opt.gemv_unroll == 1 || opt.gemv_unroll == 2 || opt.gemv_unroll == 4 ||
                     opt.gemv_unroll == 8,
                 "cuda_options::gemv_unroll {} is not one of 0, 1, 2, 4, 8", opt.gemv_unroll);
        PG_CHECK(opt.gemv_v3 >= 0 && opt.gemv_v3 <= 2, "cuda_options::gemv_v3 {} is not one of 0, 1, 2", opt.gemv_v3);
        PG_CHECK(opt.gemv_max_elems >= 0, "cuda_options::gemv_max_elems {} is negative (0: no bound)", opt.gemv_max_elems);
        PG_CHECK(opt.moe_select_small == 0 || opt.moe_select_small == 4 || opt.moe_select_small == 8,
                 "cuda_options::moe_select_small {} is not 0, 4 or 8 (warps per block; 0: off)", opt.moe_select_small);
        PG_CHECK(opt.gemv_mma_min_tokens >= 0 && opt.gemv_mma_min_tokens <= 8,
                 "cuda_options::gemv_mma_min_tokens {} is not in 0..8 (0: off)", opt.gemv_mma_min_tokens);
        PG_CHECK(opt.moe_bf16_early >= 0 && opt.moe_bf16_early <= 2, "cuda_options::moe_bf16_early {} is not one of 0, 1, 2",
                 opt.moe_bf16_early);
        int n = 0;
        PG_CUDA_CHECK(cudaGetDeviceCount(&n));
        PG_CHECK(device >= 0 && device < n, "cuda device {} does not exist ({} devices)", device, n);
        PG_CUDA_CHECK(cudaSetDevice(device));
        cudaDeviceProp prop{};
        PG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
        name_ = prop.name;
        PG_CHECK(prop.major == 9, "cuda device {} ({}) is sm_{}{}; this build has sm_90a code only", device, name_,
                 prop.major, prop.minor);
        PG_CUDA_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking));
        cudaMemPool_t pool;
        PG_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
        uint64_t thr = UINT64_MAX;
        PG_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr));
        PG_CUBLAS_CHECK(cublasLtCreate(&lt_));
        PG_CUDA_CHECK(cudaMalloc(&lt_ws_, k_lt_ws));
        PG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&route_ctr_), 4));   // fused route counter
        PG_CUDA_CHECK(cudaMemset(route_ctr_, 0, 4));
        if (opt.moe_layer_fused) {   // the one-launch MoE block's device-wide counters (moe-layer-decode.cu; self-resetting)
            PG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&moe_layer_sync_), 16));
            PG_CUDA_CHECK(cudaMemset(moe_layer_sync_, 0, 16));
        }
        if (opt.kda_oproj_fused) {   // the KDA tail + o_proj launch's 2 device-wide counters (kda-fused-decode.cu; self-resetting)
            PG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&kda_oproj_sync_), 8));
            PG_CUDA_CHECK(cudaMemset(kda_oproj_sync_, 0, 8));
        }
        // the tensor-core GEMV's split-K partials and per-group counters (linear.cu; the counters are left at 0), when on
        if (opt.gemv_mma_min_tokens > 0) {
            PG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&mma_part_), size_t(k_mma_part_floats) * 4));
            PG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&mma_ctr_), size_t(k_mma_ctr_n) * 4));
            PG_CUDA_CHECK(cudaMemset(mma_ctr_, 0, size_t(k_mma_ctr_n) * 4));
        }
    }
    ~cuda_backend() override {
        cudaSetDevice(dev_);
        free_outputs();
        cudaStreamSynchronize(st_);
        for (auto & [k, v] : weights_) cudaFree(v);
        for (auto & [k, v] : states_) cudaFree(v);
        for (auto & [k, v] : expert_tables_) cudaFree(v);
        for (auto & [k, v] : norm_w32_) cudaFree(v);
        drop_graph();
        drop_graph_entries();
        for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
        if (arena_) cudaFree(arena_);
        if (lt_ws_) cudaFree(lt_ws_);
        if (route_ctr_) cudaFree(route_ctr_);
        if (moe_layer_sync_) cudaFree(moe_layer_sync_);
        if (kda_oproj_sync_) cudaFree(kda_oproj_sync_);
        if (mma_part_) cudaFree(mma_part_);
        if (mma_ctr_) cudaFree(mma_ctr_);
        if (lt_) cublasLtDestroy(lt_);
        if (st_) cudaStreamDestroy(st_);
    }

    std::string name() const override { return "cuda"; }
    // Every prefill chunk re-reads all the routed experts (the 48B geometry's ~94 GB), so the chunk length sets the
    // long-prompt throughput: 48B prefill 512 tokens 44.4 ms vs 2048 tokens 123.6 ms per step (11.5k vs 16.6k tok/s,
    // bench/RESULTS.md session 14), at the price of a ~124 ms decode stall for the other streams while a 2048-token
    // chunk runs (vLLM's API server picks 8192 on H100 / H200-class GPUs).
    int step_tokens_default() const override { return 2048; }
    std::string device_name() const override { return name_; }
    size_t weight_bytes() const override { return weight_bytes_; }

    void check_supported(const graph & g) const override {
        for (int i = 0; i < int(g.nodes.size()); ++i) check_node(g, i);
    }

    void run(const graph & g, const node_callback & cb) override {
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        const cuda::pdl_scope pdl(opt_.pdl);   // launch_k's PDL attribute for this backend's launches (cuda-ops.h)
        drop_graph();
        released_.clear();   // a replayed step releases nothing; an eager one plans its own (plan_release)
        uint64_t key = 0;
        if (graph_decode_eligible(g, cb)) {
            key = graph_key(g);
            if (graph_entry * e = find_entry(key)) {
                replay_entry(*e, g);
                return;
            }
            const auto seen = seen_bytes_.find(key);
            if (seen != seen_bytes_.end()) {   // second step of this layout: capture it (no execution), then replay it
                replay_entry(capture_entry(g, key, seen->second), g);
                return;
            }
        }
        free_outputs();
        arena_on_ = false;
        run_bytes_ = 0;
        const int n_err = prepare(g);
        plan_release(g, cb);
        PG_CUDA_CHECK(cudaMemsetAsync(err_, 0, size_t(std::max(1, n_err)) * cuda::ERR_COUNT * sizeof(int), st_));
        if (g.b) upload_batch(*g.b);
        if (opt_.profile_nodes) {
            while (events_.size() < g.nodes.size() + 1) {
                cudaEvent_t ev;
                PG_CUDA_CHECK(cudaEventCreate(&ev));
                events_.push_back(ev);
            }
            PG_CUDA_CHECK(cudaEventRecord(events_[0], st_));
            prof_nodes_ = g.nodes.size();
        }
        for (int id = 0; id < int(g.nodes.size()); ++id) {
            const node & n = g.nodes[size_t(id)];
            check_node(g, id);
            try {
                run_node(g, id);
                if (opt_.profile_nodes) PG_CUDA_CHECK(cudaEventRecord(events_[size_t(id) + 1], st_));
                const cudaError_t e = cudaGetLastError();
                PG_CHECK(e == cudaSuccess, "kernel launch failed: {}", cudaGetErrorString(e));
                if (opt_.guard) guard_check(id);
                // nodes an earlier position skipped because this launch computes them (fuse_kda_decode folds them into
                // a later node): their sentinels now
                if (opt_.guard)
                    for (int j : later_done(id)) guard_check(j);
            } catch (const error & e) {
                const std::string msg = e.what();
                if (!n.name.empty() && msg.find(n.name) != std::string::npos) throw;
                throw error(e.func(), e.file(), e.line(), fmt::format("node {} '{}' ({}): {}", id, n.name, op_name(n.op), msg));
            }
            release_after(id);
            if (cb) {   // each node once, when its outputs exist: a node computed by a later launch is reported after it
                auto report = [&](int j) {
                    std::vector<tensor> host;
                    for (size_t o = 0; o < outs_[size_t(j)].size(); ++o) host.push_back(to_host(outs_[size_t(j)][o]));
                    cb(g, j, host);
                };
                if (!done_later(id)) report(id);
                for (int j : later_done(id)) report(j);
            }
        }
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        check_flags(g, n_err);
        if (key != 0) {   // an eligible layout seen for the first time: remember what its step allocates
            if (seen_bytes_.size() >= 64) seen_bytes_.clear();
            seen_bytes_[key] = run_bytes_;
        }
    }

    void graph_skip_upload_next() override { skip_upload_next_ = true; }
    int graph_captures() const override { return n_graph_captures_; }
    int graph_replays() const override { return n_graph_replays_; }

    int linear_grouped() const override { return n_grouped_; }
    int fused_norms() const override { return n_fused_norms_; }
    int fused_adds() const override { return n_fused_adds_; }
    int fused_norm_staged_launches() const override { return n_norm_staged_; }
    int fused_conv_l2s() const override { return n_conv_l2_; }
    int fused_sigmoids() const override { return n_fused_sig_; }
    int fused_kda_decodes() const override { return n_kda_fused_; }
    int fused_moe_shared() const override { return n_moe_shared_; }
    int fused_moe_layers() const override { return n_moe_layer_; }
    int fused_kda_oprojs() const override { return n_kda_oproj_; }
    int side_prefetches() const override { return n_side_prefetch_; }
    int fused_routes() const override { return n_fused_routes_; }
    int linear_stacked() const override { return n_linear_stacked_; }
    int linear_shared_x() const override { return n_linear_shared_x_; }

    void capture(const graph & g) override {
        PG_CHECK(!opt_.guard, "capture: the guard mode (sentinel checks after every node) cannot be captured");
        const cuda::pdl_scope pdl(opt_.pdl);   // PDL launches are captured as programmatic edges
        in_capture_ = true;   // this run is eager whatever graph_decode says (it sizes the arena below)
        try {
            run(g, {});   // uploads weights and states, creates the cuBLASLt plans, sizes the arena
        } catch (...) {
            in_capture_ = false;
            throw;
        }
        in_capture_ = false;
        const size_t need = run_bytes_;
        free_outputs();
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        if (arena_size_ < need) {
            if (arena_) PG_CUDA_CHECK(cudaFree(arena_));
            arena_ = nullptr;
            arena_size_ = 0;
            PG_CUDA_CHECK(cudaMalloc(&arena_, need));
            arena_size_ = need;
        }
        arena_on_ = true;
        arena_off_ = 0;
        const int n_err = prepare(g);
        if (g.b) upload_batch(*g.b);   // pageable host -> device: outside the capture
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        exec_ = capture_nodes(g, n_err, "capture");
        cap_g_ = &g;
        cap_n_err_ = n_err;
    }

    void replay(int n) override {
        PG_CHECK(exec_ != nullptr && cap_g_ != nullptr, "replay: no captured graph (call capture first)");
        for (int i = 0; i < n; ++i) PG_CUDA_CHECK(cudaGraphLaunch(exec_, st_));
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        check_flags(*cap_g_, cap_n_err_);
    }

    std::vector<float> node_ms() const override {
        std::vector<float> v;
        if (!opt_.profile_nodes) return v;
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        for (size_t i = 0; i < prof_nodes_; ++i) {
            float ms = 0.0f;
            PG_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
            v.push_back(ms);
        }
        return v;
    }

    void weight_generate(const tensor & t, uint64_t seed, float lo, float hi) override {
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        const cuda::pdl_scope pdl(opt_.pdl);
        PG_CHECK(t.data != nullptr || t.nbytes == 0, "weight_generate: tensor without a data address");
        PG_CHECK(!weights_.count(t.data), "weight_generate: this tensor is already on the device");
        int kind = -1;
        switch (t.type) {
            case dtype::F32: kind = 0; break;
            case dtype::BF16: kind = 1; break;
            case dtype::F16: kind = 2; break;
            case dtype::U8:
            case dtype::I8:
            case dtype::F8_E4M3:
            case dtype::F8_E8M0: kind = 3; break;
            default: PG_FAIL("weight_generate: unsupported dtype {}", dtype_name(t.type));
        }
        void * p = nullptr;
        PG_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(t.nbytes, 16)));
        const int64_t n = kind == 3 ? int64_t(t.nbytes) : t.numel();
        PG_CUDA_CHECK(cuda::launch_fill_random(p, n, kind, seed, lo, hi, st_));
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        weights_[t.data] = p;
        // byte tensors: k_fill_random's bytes are int(lo) + [0, int(hi) - int(lo)], cast to a byte (any wrap: 255)
        generated_[t.data] = kind != 3 ? -1 : int(lo) < 0 || int(hi) > 255 ? 255 : std::max(int(lo), int(hi));
        weight_bytes_ += t.nbytes;
    }

private:
    // Output bookkeeping for one run of g: error-flag slots; returns their count.
    int prepare(const graph & g) {
        outs_.assign(g.nodes.size(), {});
        route_logits_.assign(g.nodes.size(), nullptr);
        err_slot_.assign(g.nodes.size(), -1);
        plan_fusions(g);
        int n_err = 0;
        for (size_t i = 0; i < g.nodes.size(); ++i) {
            const op_type o = g.nodes[i].op;
            if (o == op_type::GET_ROWS || o == op_type::MLA_ATTN || o == op_type::MOE_EXPERTS ||
                fplan_.kda_oproj[i].linear >= 0)   // the KDA tail + o_proj launch's barrier (kda_oproj_fused)
                err_slot_[i] = n_err++;
        }
        err_ = static_cast<int *>(alloc(size_t(std::max(1, n_err)) * cuda::ERR_COUNT * sizeof(int)));
        return n_err;
    }
    // ---- decode steps as replayed CUDA graphs (cuda_options::graph_decode) ----
    // run() of a decode step (every sequence one token, no node callback, no guard, no per-node profile) looks its
    // layout up: the graph's structure (ops, names, sources, output shapes and types, the leaves' host tensors and
    // bytes), the sequence and token counts, the logits rows and a position capacity. The first step of a layout runs
    // eagerly (the real step; it binds every leaf and measures the bytes the step allocates); the second captures the
    // step into a CUDA graph whose intermediates live in an arena of its own (capture records, it executes nothing)
    // and replays it; later ones only upload the batch (positions, slots, block tables, ids: the same array layout,
    // into the same device address) and replay. Host-side values that a kernel takes as an argument are fixed per
    // layout: the block-table width and max_pos are the capacity (pos_cap_for), never the step's own, and the kernels
    // bound each sequence by its own positions read from the device (mla.cu, indexer.cu). A new capacity or batch
    // size is a new layout. At most k_graph_entries graphs are kept (least recently used goes).
    struct graph_entry {
        uint64_t key = 0;
        cudaGraphExec_t exec = nullptr;
        void * arena = nullptr;
        std::vector<std::vector<dtensor>> outs;   // the step's outputs, in the arena
        std::vector<int> err_slot;
        int * err = nullptr;
        int n_err = 0;
        cuda::dbatch db;
        int32_t * batch_dev = nullptr;   // the batch array the graph reads (in the arena)
        size_t batch_ints = 0;
        const int32_t * ids_dev = nullptr;
        int pages_cap = 0, pos_cap = 0;
        uint64_t last_use = 0;
    };
    static constexpr size_t k_graph_entries = 8;

    static int pos_cap_for(int max_pos) {
        int gran = 1024;   // at most 1024 positions of slack below 8192; above, at most 1/8 of the position
        while (gran * 8 < max_pos) gran *= 2;
        return (std::max(max_pos, 1) + gran - 1) / gran * gran;
    }
    static int pages_cap_for(const batch & b, int pos_cap) {
        int pages = (pos_cap + b.page_size - 1) / std::max(1, b.page_size);
        for (const auto & bt : b.block_table) pages = std::max(pages, int(bt.size()));
        return pages;
    }
    static int batch_max_pos(const batch & b) {
        int m = 0;
        for (int s = 0; s < b.n_seq(); ++s) m = std::max(m, b.pos0[size_t(s)] + b.seq_len(s));
        return m;
    }

    bool graph_decode_eligible(const graph & g, const node_callback & cb) const {
        if (!opt_.graph_decode || cb || opt_.guard || opt_.profile_nodes || in_capture_ || !g.b) return false;
        const batch & b = *g.b;
        if (b.n_seq() < 1 || b.n_tokens() != b.n_seq() || b.page_size <= 0) return false;
        for (int s = 0; s < b.n_seq(); ++s)
            if (b.seq_len(s) != 1) return false;
        return true;
    }

    // FNV-1a over everything a captured step depends on besides the batch's contents.
    uint64_t graph_key(const graph & g) const {
        uint64_t h = 1469598103934665603ull;
        auto mix = [&h](const void * p, size_t n) {
            const auto * c = static_cast<const unsigned char *>(p);
            for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
        };
        auto mix_v = [&mix](auto v) { mix(&v, sizeof v); };
        const batch & b = *g.b;
        const int pos_cap = pos_cap_for(batch_max_pos(b));
        mix_v(b.n_seq());
        mix_v(b.page_size);
        mix_v(pos_cap);
        mix_v(pages_cap_for(b, pos_cap));
        mix_v(b.logits_rows.size());
        mix(b.logits_rows.data(), b.logits_rows.size() * sizeof(int32_t));
        mix_v(g.nodes.size());
        mix_v(g.logits.node);
        for (const node & n : g.nodes) {
            mix_v(int(n.op));
            mix_v(n.p.bf16_inputs);   // (the forward sets it from the step's size; mixed in so no other rule can alias)
            mix(n.name.data(), n.name.size());
            for (const node_ref & r : n.src) {
                mix_v(r.node);
                mix_v(r.out);
            }
            for (const node_output & o : n.outs) {
                mix_v(int(o.type));
                mix(o.shape.data(), o.shape.size() * sizeof(int64_t));
            }
            mix_v(static_cast<const void *>(n.leaf));
            if (n.leaf) mix_v(static_cast<const void *>(n.leaf->data));
        }
        return h == 0 ? 1 : h;
    }

    graph_entry * find_entry(uint64_t key) {
        for (auto & e : graph_entries_)
            if (e.key == key) return &e;
        return nullptr;
    }
    void free_entry(graph_entry & e) {
        if (e.exec) cudaGraphExecDestroy(e.exec);
        if (e.arena) cudaFree(e.arena);
        e = {};
    }
    void drop_graph_entries() {
        cudaStreamSynchronize(st_);
        for (auto & e : graph_entries_) free_entry(e);
        graph_entries_.clear();
        seen_bytes_.clear();
    }

    // The capture itself, shared by capture() and capture_entry(): the error-flag reset and every node's launches
    // recorded on st_ (outputs from the arena set up by the caller), instantiated. Executes nothing. An error names
    // the node (prefixed by `who`) and leaves no capture open.
    cudaGraphExec_t capture_nodes(const graph & g, int n_err, const char * who) {
        const bool side = opt_.l2_side_prefetch_mib > 0;
        std::vector<cuda_side::launch> launches;   // side prefetch: per node, whether it launched and the weights it read
        std::vector<cudaGraphNode_t> tail;         // side prefetch: per node, its last captured kernel node (none: nullptr)
        if (side) {
            launches.assign(g.nodes.size(), {});
            tail.assign(g.nodes.size(), nullptr);
            is_weight_node_.assign(g.nodes.size(), 0);
            for (size_t i = 0; i < g.nodes.size(); ++i) is_weight_node_[i] = g.nodes[i].op == op_type::WEIGHT;
        }
        PG_CUDA_CHECK(cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal));
        try {
            PG_CUDA_CHECK(cudaMemsetAsync(err_, 0, size_t(std::max(1, n_err)) * cuda::ERR_COUNT * sizeof(int), st_));
            cudaGraphNode_t last = capture_tail();
            for (int id = 0; id < int(g.nodes.size()); ++id) {
                try {
                    if (side) reads_log_ = &launches[size_t(id)].reads;
                    run_node(g, id);
                    reads_log_ = nullptr;
                    if (side) {
                        const cudaGraphNode_t t = capture_tail();
                        if (t != last) tail[size_t(id)] = t;
                        last = t;
                        launches[size_t(id)].launched = tail[size_t(id)] != nullptr;
                        launches[size_t(id)].get_rows = g.nodes[size_t(id)].op == op_type::GET_ROWS;
                    }
                } catch (const error & ex) {
                    const node & n = g.nodes[size_t(id)];
                    throw error(ex.func(), ex.file(), ex.line(),
                                fmt::format("{}: node {} '{}' ({}): {}", who, id, n.name, op_name(n.op), ex.what()));
                }
            }
        } catch (...) {
            reads_log_ = nullptr;   // any exception type: the log points into this frame's vectors
            cudaGraph_t junk = nullptr;
            cudaStreamEndCapture(st_, &junk);
            if (junk) cudaGraphDestroy(junk);
            cudaGetLastError();
            throw;
        }
        cudaGraph_t cg = nullptr;
        PG_CUDA_CHECK(cudaStreamEndCapture(st_, &cg));
        if (side) {
            try {
                add_side_prefetches(g, cg, launches, tail);
            } catch (...) {
                cudaGraphDestroy(cg);
                throw;
            }
        }
        cudaGraphExec_t exec = nullptr;
        const cudaError_t ie = cudaGraphInstantiate(&exec, cg, 0);
        cudaGraphDestroy(cg);
        PG_CHECK(ie == cudaSuccess, "{}: cudaGraphInstantiate failed: {}", who, cudaGetErrorString(ie));
        return exec;
    }

    // The capture's current last node on st_ (nullptr when it has none or several).
    cudaGraphNode_t capture_tail() const {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        const cudaGraphNode_t * deps = nullptr;
        size_t nd = 0;
        PG_CUDA_CHECK(cudaStreamGetCaptureInfo(st_, &cs, nullptr, nullptr, &deps, nullptr, &nd));
        return cs == cudaStreamCaptureStatusActive && nd == 1 ? deps[0] : nullptr;
    }

    // cuda_options::l2_side_prefetch_mib: the prefetch nodes side-prefetch-plan.h places (after a streaming launch p
    // followed by latency-bound ones, the next streaming launch s's weights), each a kernel node depending on p's last
    // kernel node alone. Weights s reads but not through in() (the routed experts' tables: unknown until the selection)
    // are not asked for.
    void add_side_prefetches(const graph & g, cudaGraph_t cg, const std::vector<cuda_side::launch> & ls,
                             const std::vector<cudaGraphNode_t> & tail) {
        n_side_prefetch_ = 0;
        for (const auto & f : cuda_side::plan(ls, size_t(opt_.l2_side_prefetch_mib) << 20, size_t(4) << 20, cuda::l2_ranges::k_max)) {
            cuda::l2_ranges rg;
            for (const auto & r : f.ranges) {
                rg.p[rg.n] = r.first;
                rg.bytes[rg.n] = r.second;
                ++rg.n;
            }
            cudaGraphNode_t pn = nullptr;
            const cudaError_t e = cuda::add_l2_prefetch_node(cg, tail[size_t(f.fork)], rg, opt_.l2_side_prefetch_blocks, &pn);
            PG_CHECK(e == cudaSuccess, "side L2 prefetch of node '{}' (forked after node '{}'): {}", g.nodes[size_t(f.target)].name,
                     g.nodes[size_t(f.fork)].name, cudaGetErrorString(e));
            ++n_side_prefetch_;
        }
    }

    // Captures the decode step g (its layout seen before, which allocated `bytes`) into a new entry; executes nothing.
    graph_entry & capture_entry(const graph & g, uint64_t key, size_t bytes) {
        if (graph_entries_.size() >= k_graph_entries) {   // the least recently used goes
            auto lru = std::min_element(graph_entries_.begin(), graph_entries_.end(),
                                        [](const graph_entry & a, const graph_entry & b) { return a.last_use < b.last_use; });
            PG_CUDA_CHECK(cudaStreamSynchronize(st_));
            free_entry(*lru);
            graph_entries_.erase(lru);
        }
        free_outputs();
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        graph_entry e;
        e.key = key;
        e.pos_cap = pos_cap_for(batch_max_pos(*g.b));
        e.pages_cap = pages_cap_for(*g.b, e.pos_cap);
        // the eager run's bytes plus the capacity's larger block table and scratch (indexer: T x max_pos floats)
        const size_t need = bytes + size_t(g.b->n_seq()) * size_t(e.pages_cap) * 4 +
                            size_t(g.b->n_tokens()) * size_t(e.pos_cap) * 4 + (size_t(64) << 10);
        PG_CUDA_CHECK(cudaMalloc(&e.arena, need));
        void * saved_arena = arena_;
        const size_t saved_size = arena_size_;
        arena_ = e.arena;
        arena_size_ = need;
        arena_off_ = 0;
        arena_on_ = true;
        in_capture_ = true;
        try {
            e.n_err = prepare(g);
            upload_batch(*g.b, e.pages_cap, e.pos_cap);
            e.batch_dev = const_cast<int32_t *>(db_.seq_start);
            e.batch_ints = host_batch_.size();
            PG_CUDA_CHECK(cudaStreamSynchronize(st_));
            e.exec = capture_nodes(g, e.n_err, "graph_decode capture");
        } catch (...) {
            arena_ = saved_arena;
            arena_size_ = saved_size;
            arena_on_ = false;
            in_capture_ = false;
            free_entry(e);
            throw;
        }
        arena_ = saved_arena;
        arena_size_ = saved_size;
        arena_on_ = false;
        in_capture_ = false;
        e.outs = outs_;
        e.err_slot = err_slot_;
        e.err = err_;
        e.db = db_;
        e.ids_dev = ids_dev_;
        ++n_graph_captures_;
        graph_entries_.push_back(std::move(e));
        return graph_entries_.back();
    }

    // One decode step by the captured graph of its layout: the batch checks of the eager path, the batch into the
    // graph's device array, one launch, the error flags.
    void replay_entry(graph_entry & e, const graph & g) {
        free_outputs();
        for (const node & n : g.nodes) {   // what run_node checks on the host about the batch
            switch (n.op) {
                case op_type::SHORT_CONV: slots_check(*g.b, state_host(g, n, 2).shape.at(0), "short_conv"); break;
                case op_type::KDA_SCAN: slots_check(*g.b, state_host(g, n, 5).shape.at(0), "kda_scan"); break;
                case op_type::MLA_ATTN: paging_check(*g.b, state_host(g, n, 4).shape.at(0), "mla_attn"); break;
                case op_type::INDEXER_TOPK: paging_check(*g.b, state_host(g, n, 3).shape.at(0), "indexer_topk"); break;
                case op_type::IDS:
                    PG_CHECK(int64_t(g.b->ids.size()) == shape_numel(n.outs.at(0).shape), "batch has {} ids, node wants {}",
                             g.b->ids.size(), shape_numel(n.outs.at(0).shape));
                    break;
                default: break;
            }
        }
        if (skip_upload_next_) {   // test control only: the graph reads the previous step's batch
            skip_upload_next_ = false;
        } else {
            upload_batch(*g.b, e.pages_cap, e.pos_cap, e.batch_dev, e.batch_ints);
        }
        PG_CHECK(db_.seq_start == e.db.seq_start && db_.max_pages == e.db.max_pages && db_.max_pos == e.db.max_pos &&
                     db_.n_seq == e.db.n_seq && db_.n_tok == e.db.n_tok,
                 "graph_decode: the batch layout differs from the captured one");
        outs_ = e.outs;
        err_slot_ = e.err_slot;
        err_ = e.err;
        ids_dev_ = e.ids_dev;
        e.last_use = ++graph_clock_;
        PG_CUDA_CHECK(cudaGraphLaunch(e.exec, st_));
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        ++n_graph_replays_;
        check_flags(g, e.n_err);
    }
    void drop_graph() {
        if (exec_) cudaGraphExecDestroy(exec_);
        exec_ = nullptr;
        cap_g_ = nullptr;
    }
    void check_flags(const graph & g, int n_err) {
        if (n_err > 0) {
            std::vector<int> flags(size_t(n_err) * cuda::ERR_COUNT);
            PG_CUDA_CHECK(cudaMemcpy(flags.data(), err_, flags.size() * sizeof(int), cudaMemcpyDeviceToHost));
            for (int id = 0; id < int(g.nodes.size()); ++id) {
                if (err_slot_[size_t(id)] < 0) continue;
                const int * f = flags.data() + err_slot_[size_t(id)] * cuda::ERR_COUNT;
                const node & n = g.nodes[size_t(id)];
                const std::string who = fmt::format("node {} '{}' ({})", id, n.name, op_name(n.op));
                PG_CHECK(!f[cuda::ERR_ID_RANGE], "{}: an id is outside the table's rows", who);
                PG_CHECK(!f[cuda::ERR_SEL_RANGE], "{}: a selected position is outside 0..pos, or a token selects none", who);
                PG_CHECK(!f[cuda::ERR_EXPERT_ID], "{}: an expert id is outside the experts", who);
                PG_CHECK(!f[cuda::ERR_SYNC_TIMEOUT], "{}: a device-wide barrier of its persistent kernel timed out (the grid was not "
                         "all resident: another stream's kernel held SMs?)", who);
            }
        }
    }

public:

    tensor read(node_ref r) const override {
        PG_CHECK(r.node >= 0 && size_t(r.node) < outs_.size(), "read: node {} was not run", r.node);
        const auto & o = outs_[size_t(r.node)];
        PG_CHECK(r.out >= 0 && size_t(r.out) < o.size(), "read: node {} has no output {}", r.node, r.out);
        PG_CHECK(!released(r.node), "read: node {}'s outputs were released after their last use in the step "
                 "(cuda_options::free_dead_outputs; only the graph's logits are kept)", r.node);
        return to_host(o[size_t(r.out)]);
    }

    void sync_state_to_host() override {
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        for (auto & [t, p] : states_) PG_CUDA_CHECK(cudaMemcpy(t->data, p, t->nbytes, cudaMemcpyDeviceToHost));
    }
    void state_reload() override {
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        free_outputs();   // leaves may point into the states
        outs_.clear();
        drop_graph_entries();   // the captured graphs hold the old states' device addresses
        for (auto & [k, v] : states_) cudaFree(v);
        states_.clear();
    }
    void guard_corrupt_next(int node, int out) override { corrupt_ = {node, out}; }
    // On-device sampling (sample.cu): only the ids come back.
    std::vector<int32_t> sample_rows(node_ref r, const std::vector<row_sampling> & rows) override {
        PG_CHECK(r.node >= 0 && size_t(r.node) < outs_.size() && r.out >= 0 && size_t(r.out) < outs_[size_t(r.node)].size(),
                 "sample_rows: node {} output {} was not run", r.node, r.out);
        PG_CHECK(!released(r.node), "sample_rows: node {}'s outputs were released after their last use in the step "
                 "(cuda_options::free_dead_outputs; only the graph's logits are kept)", r.node);
        const dtensor & t = outs_[size_t(r.node)][size_t(r.out)];
        PG_CHECK(t.type == dtype::F32 && t.shape.size() == 2, "sample_rows: logits must be F32 [R, V], got {} of rank {}",
                 dtype_name(t.type), t.shape.size());
        PG_CHECK(t.shape[0] == int64_t(rows.size()), "sample_rows: {} logits rows, {} sampling entries", t.shape[0], rows.size());
        std::vector<cuda::sample_row_param> prm(rows.size());
        for (size_t i = 0; i < rows.size(); ++i)
            prm[i] = {rows[i].temperature, rows[i].top_k, rows[i].top_p, rows[i].min_p, rows[i].u};
        std::vector<int32_t> ids(rows.size());
        PG_CUDA_CHECK(cudaSetDevice(dev_));
        const cuda::pdl_scope pdl(opt_.pdl);
        PG_CUDA_CHECK(cuda::sample_rows(static_cast<const float *>(t.p), int(rows.size()), t.shape[1], prm.data(), ids.data(), st_));
        return ids;
    }
    // Slot operations on the resident STATE pools (state-ops.cpp).
    void slot_zero(const std::vector<tensor *> & pools, int slot) override {
        cuda::slot_zero(pools, slot, dev_, st_, [this](tensor & t) -> void * { return state_dev(t); });
    }
    std::unique_ptr<slot_snapshots> slot_snapshots_new(const std::vector<tensor *> & pools, int n) override {
        return cuda::slot_snapshots_new(pools, n, dev_, st_, [this](tensor & t) -> void * { return state_dev(t); });
    }

private:
    static constexpr size_t k_lt_ws = 32u << 20;

    // ---- memory ----
    // An eager step's node outputs live until the step ends (read() may ask for any of them), and so does every scratch
    // buffer. With cuda_options::free_dead_outputs (the runtime's setting) an eager run without a node callback, guard
    // or profile releases each node's outputs once the last launch that reads them is enqueued (stream-ordered
    // cudaFreeAsync: the pool hands the bytes to a later allocation on st_ only after those launches), and the scratch
    // that node_scratch() gave a node right after that node. The logits node is kept. A captured step (arena) is
    // unchanged: its arena is sized by the bytes the eager run asked for in all, freed or not.
    void plan_release(const graph & g, const backend::node_callback & cb) {
        release_at_.clear();
        released_.assign(g.nodes.size(), 0);
        release_on_ = opt_.free_dead_outputs && !cb && !opt_.guard && !opt_.profile_nodes && !in_capture_;
        if (!release_on_) return;
        std::vector<int> last(g.nodes.size(), -1);
        for (int i = 0; i < int(g.nodes.size()); ++i) {
            // the position whose launch runs node i (a fused launch may run it at a later node; one at an earlier
            // position reads its inputs earlier, so i itself is a safe bound then)
            const int at = fplan_.done_by.empty() ? i : std::max(i, fplan_.done_by[size_t(i)]);
            for (const node_ref & r : g.nodes[size_t(i)].src)
                if (r.valid()) last[size_t(r.node)] = std::max(last[size_t(r.node)], at);
        }
        release_at_.assign(g.nodes.size(), {});
        // free_dead_debug 2 (a control for tests): one position early, so the last reader reads poisoned bytes
        const int early = opt_.free_dead_debug == 2 ? 1 : 0;
        for (int j = 0; j < int(g.nodes.size()); ++j)
            if (last[size_t(j)] >= 0 && j != g.logits.node)
                release_at_[size_t(std::max(0, last[size_t(j)] - early))].push_back(j);
    }
    void release_after(int pos) {
        for (void * p : node_temps_) {
            cudaFreeAsync(p, st_);
            run_allocs_.erase(p);
        }
        node_temps_.clear();
        if (!release_on_) return;
        for (int j : release_at_[size_t(pos)]) {
            for (dtensor & d : outs_[size_t(j)]) {
                if (!d.alloc) continue;   // leaves (and an output not allocated yet: debug 2 only)
                if (opt_.free_dead_debug > 0)   // poison first: a reader after this point sees NaN / -1, not stale data
                    PG_CUDA_CHECK(cudaMemsetAsync(d.alloc, 0xFF, d.nbytes, st_));
                PG_CUDA_CHECK(cudaFreeAsync(d.alloc, st_));
                run_allocs_.erase(d.alloc);
                d.alloc = d.p = nullptr;
            }
            released_[size_t(j)] = 1;
        }
    }
    bool released(int node) const { return size_t(node) < released_.size() && released_[size_t(node)]; }
    // Scratch read and written only by the launches of the node being run: with release on, freed right after it.
    void * node_scratch(size_t bytes) {
        void * p = alloc(bytes);
        if (release_on_ && !arena_on_) node_temps_.push_back(p);
        return p;
    }
    void * alloc(size_t bytes) {
        const size_t sz = (std::max<size_t>(bytes, 16) + 255) & ~size_t(255);
        run_bytes_ += sz;
        if (arena_on_) {
            PG_CHECK(arena_off_ + sz <= arena_size_, "capture: the step needs more than the {} arena bytes the eager run used",
                     arena_size_);
            void * p = static_cast<char *>(arena_) + arena_off_;
            arena_off_ += sz;
            return p;
        }
        void * p = nullptr;
        PG_CUDA_CHECK(cudaMallocAsync(&p, std::max<size_t>(bytes, 16), st_));
        run_allocs_.insert(p);
        return p;
    }
    void free_outputs() {
        for (void * p : run_allocs_) cudaFreeAsync(p, st_);
        run_allocs_.clear();
        node_temps_.clear();   // (they were in run_allocs_ too)
    }
    dtensor new_out(dtype t, const shape_t & s) {
        dtensor d;
        d.type = t;
        d.shape = s;
        d.nbytes = dtype_bytes(t, shape_numel(s));
        if (!opt_.guard) {
            d.alloc = alloc(d.nbytes);
            d.p = d.alloc;
            return d;
        }
        const size_t words = (d.nbytes + 3) / 4;
        d.alloc = alloc(2 * k_guard_bytes + words * 4);
        d.p = static_cast<char *>(d.alloc) + k_guard_bytes;
        PG_CUDA_CHECK(cuda::launch_fill_u32(static_cast<uint32_t *>(d.alloc), int64_t(k_guard_bytes / 4), k_guard_word, st_));
        PG_CUDA_CHECK(cuda::launch_fill_u32(static_cast<uint32_t *>(d.p), int64_t(words), k_poison_word, st_));
        PG_CUDA_CHECK(cuda::launch_fill_u32(reinterpret_cast<uint32_t *>(static_cast<char *>(d.p) + words * 4),
                                            int64_t(k_guard_bytes / 4), k_guard_word, st_));
        return d;
    }
    void guard_check(int id) {
        auto & outs = outs_[size_t(id)];
        for (size_t o = 0; o < outs.size(); ++o) {
            const dtensor & d = outs[o];
            if (!d.alloc) continue;   // leaves
            const size_t words = (d.nbytes + 3) / 4;
            char * after = static_cast<char *>(d.p) + words * 4;
            if (corrupt_.first == id && corrupt_.second == int(o)) {
                const uint8_t bad = 0;
                PG_CUDA_CHECK(cudaMemcpyAsync(after + 7, &bad, 1, cudaMemcpyHostToDevice, st_));
                corrupt_ = {-1, -1};
            }
            std::vector<uint32_t> before(k_guard_bytes / 4), aft(k_guard_bytes / 4);
            PG_CUDA_CHECK(cudaMemcpyAsync(before.data(), d.alloc, k_guard_bytes, cudaMemcpyDeviceToHost, st_));
            PG_CUDA_CHECK(cudaMemcpyAsync(aft.data(), after, k_guard_bytes, cudaMemcpyDeviceToHost, st_));
            PG_CUDA_CHECK(cudaStreamSynchronize(st_));
            for (size_t i = 0; i < before.size(); ++i) {
                PG_CHECK(before[i] == k_guard_word, "output {}: sentinel word {} before the output was overwritten", o, i);
                PG_CHECK(aft[i] == k_guard_word, "output {}: sentinel word {} after the output was overwritten", o, i);
            }
        }
    }

    tensor to_host(const dtensor & d) const {
        tensor t = tensor_new(d.type, d.shape);
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
        if (t.nbytes) PG_CUDA_CHECK(cudaMemcpy(t.data, d.p, t.nbytes, cudaMemcpyDeviceToHost));
        return t;
    }

    // Host -> device copy of a leaf (weight, state, expert table) ordered before everything later on st_: a plain
    // cudaMemcpy runs on the legacy default stream, which does not order the non-blocking st_, and from pageable
    // memory it may return before its DMA lands ("API synchronization behavior": "the DMA to final destination may
    // not have completed"); a kernel on st_ could then read the allocation's old contents (test-fuse-cuda round 2:
    // K7168/F32/T8, every LINEAR output 0). On st_ and synchronized: complete before the first reader. Never inside
    // a capture (the eager run before it uploads every leaf).
    void upload(void * dst, const void * src, size_t bytes) {
        if (!bytes) return;
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        PG_CUDA_CHECK(cudaStreamIsCapturing(st_, &cap));
        PG_CHECK(cap == cudaStreamCaptureStatusNone, "upload of {} bytes during a stream capture (a leaf the eager run did not bind)",
                 bytes);
        PG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_));
        PG_CUDA_CHECK(cudaStreamSynchronize(st_));
    }
    const void * weight_dev(const tensor & t) {
        auto it = weights_.find(t.data);
        if (it != weights_.end()) return it->second;
        void * p = nullptr;
        PG_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(t.nbytes, 16)));
        upload(p, t.data, t.nbytes);
        weights_[t.data] = p;
        weight_bytes_ += t.nbytes;
        return p;
    }
    float * state_dev(tensor & t) {
        auto it = states_.find(&t);
        if (it != states_.end()) return static_cast<float *>(it->second);
        void * p = nullptr;
        PG_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(t.nbytes, 16)));
        upload(p, t.data, t.nbytes);
        states_[&t] = p;
        return static_cast<float *>(p);
    }

    // The batch's device copy (one int32 array: seq_start, pos0, slot, block_table [n_seq, max_pages], tok_seq, ids) and
    // db_. pages_cap / pos_cap > 0 (graph_decode): the block table is padded to pages_cap columns and db_.max_pos says
    // pos_cap, so that every step of a replayed graph has the layout and the scalars the graph was captured with (the
    // kernels bound each sequence by its own pos0 / seq_start, read from the device; max_pos is only a stride and an
    // upper bound). dst != nullptr: copy into that device array (a replay: same size as at its capture) instead of a new one.
    void upload_batch(const batch & b, int pages_cap = 0, int pos_cap = 0, int32_t * dst = nullptr, size_t dst_ints = 0) {
        const int n_seq = b.n_seq(), T = b.n_tokens();
        int max_pages = 0, max_pos = 0;
        for (const auto & bt : b.block_table) max_pages = std::max(max_pages, int(bt.size()));
        PG_CHECK(pages_cap == 0 || max_pages <= pages_cap, "batch: a block table of {} pages for a graph of {}", max_pages,
                 pages_cap);
        if (pages_cap > 0) max_pages = pages_cap;
        std::vector<int32_t> tok_seq(size_t(T), 0);
        PG_CHECK(int(b.seq_start.size()) == n_seq + 1 || n_seq == 0, "batch: seq_start has {} entries", b.seq_start.size());
        PG_CHECK(b.pos0.size() >= size_t(n_seq) && b.slot.size() >= size_t(n_seq), "batch: pos0/slot shorter than {} sequences",
                 n_seq);
        for (int s = 0; s < n_seq; ++s) {
            PG_CHECK(b.seq_start[size_t(s)] <= b.seq_start[size_t(s) + 1] && b.seq_start[size_t(s) + 1] <= T,
                     "batch: seq_start[{}] is not monotone within {} tokens", s, T);
            for (int t = b.seq_start[size_t(s)]; t < b.seq_start[size_t(s) + 1]; ++t) tok_seq[size_t(t)] = s;
            max_pos = std::max(max_pos, b.pos0[size_t(s)] + b.seq_len(s));
        }
        std::vector<int32_t> h;
        auto put = [&](const int32_t * p, size_t n) {
            const size_t off = h.size();
            h.insert(h.end(), p, p + n);
            return off;
        };
        const size_t o_ss = put(b.seq_start.data(), b.seq_start.size());
        const size_t o_p0 = put(b.pos0.data(), size_t(n_seq));
        const size_t o_sl = put(b.slot.data(), size_t(n_seq));
        const size_t o_bt = h.size();
        for (int s = 0; s < n_seq; ++s) {
            std::vector<int32_t> row(size_t(max_pages), -1);
            if (size_t(s) < b.block_table.size())
                std::copy(b.block_table[size_t(s)].begin(), b.block_table[size_t(s)].end(), row.begin());
            put(row.data(), row.size());
        }
        const size_t o_ts = put(tok_seq.data(), tok_seq.size());
        const size_t o_ids = put(b.ids.data(), b.ids.size());
        PG_CHECK(pos_cap == 0 || max_pos <= pos_cap, "batch: position {} for a graph of {}", max_pos, pos_cap);
        if (pos_cap > 0) max_pos = pos_cap;
        PG_CHECK(!dst || h.size() == dst_ints, "batch layout of {} ints for a graph captured with {}", h.size(), dst_ints);
        auto * d = dst ? dst : static_cast<int32_t *>(alloc(std::max<size_t>(h.size(), 1) * 4));
        PG_CUDA_CHECK(cudaMemcpyAsync(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice, st_));
        host_batch_ = std::move(h);   // the async copy reads it: keep it alive until the next run
        db_ = {};
        db_.n_seq = n_seq;
        db_.n_tok = T;
        db_.page_size = b.page_size;
        db_.max_pages = max_pages;
        db_.seq_start = d + o_ss;
        db_.pos0 = d + o_p0;
        db_.slot = d + o_sl;
        db_.block_table = d + o_bt;
        db_.tok_seq = d + o_ts;
        db_.max_pos = max_pos;
        ids_dev_ = d + o_ids;
    }

    // ---- node inputs ----
    const dtensor & in(const node & n, size_t i) const {
        const node_ref r = n.src.at(i);
        const dtensor & d = outs_.at(size_t(r.node)).at(size_t(r.out));
        if (reads_log_ && is_weight_node_[size_t(r.node)]) {
            bool seen = false;
            for (const auto & e : *reads_log_) seen |= e.first == d.p;
            if (!seen) reads_log_->emplace_back(d.p, d.nbytes);
        }
        return d;
    }
    const float * f32_in(const node & n, size_t i) const { return static_cast<const float *>(in(n, i).p); }
    const int32_t * i32_in(const node & n, size_t i) const { return static_cast<const int32_t *>(in(n, i).p); }
    dweight w_in(const node & n, size_t i) const {
        if (i >= n.src.size() || !n.src[i].valid()) return {};
        const dtensor & d = in(n, i);
        return {d.p, wtype_of(d.type, n.name)};
    }
    float * state_in(const graph & g, const node & n, size_t i) {
        return static_cast<float *>(outs_.at(size_t(n.src.at(i).node)).at(0).p);
        (void)g;
    }
    const tensor & state_host(const graph & g, const node & n, size_t i) const { return *g.at(n.src.at(i)).state; }

    // ---- dispatch ----
    void run_node(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        auto & out = outs_[size_t(id)];
        switch (n.op) {
            case op_type::IDS: {
                PG_CHECK(int64_t(g.b->ids.size()) == shape_numel(n.outs.at(0).shape), "batch has {} ids, node wants {}",
                         g.b->ids.size(), shape_numel(n.outs.at(0).shape));
                dtensor d;
                d.p = const_cast<int32_t *>(ids_dev_);
                d.type = dtype::I32;
                d.shape = n.outs.at(0).shape;
                d.nbytes = dtype_bytes(dtype::I32, shape_numel(d.shape));
                out.push_back(d);
                return;
            }
            case op_type::WEIGHT: {
                if (!out.empty()) return;   // already bound by a LINEAR group that launched before this node
                dtensor d;
                d.p = const_cast<void *>(weight_dev(*n.leaf));
                d.type = n.leaf->type;
                d.shape = n.leaf->shape;
                d.nbytes = n.leaf->nbytes;
                out.push_back(d);
                return;
            }
            case op_type::STATE: {
                dtensor d;
                d.p = state_dev(*n.state);
                d.type = n.state->type;
                d.shape = n.state->shape;
                d.nbytes = n.state->nbytes;
                out.push_back(d);
                return;
            }
            default: break;
        }
        if (!fplan_.done_by.empty() && fplan_.done_by[size_t(id)] >= 0) return;   // computed by another node's fused launch
        for (const auto & o : n.outs) out.push_back(new_out(o.type, o.shape));
        if (!fplan_.at.empty() && !fplan_.at[size_t(id)].empty()) {   // a fused launch (fuse-plan.h) at this node
            run_fused(g, id);
            return;
        }
        if (!fplan_.conv_l2.empty() && fplan_.conv_l2[size_t(id)] >= 0) {   // SHORT_CONV + its L2_NORM (fuse_conv_l2)
            run_conv_l2(g, id);
            return;
        }
        if (!fplan_.kda.empty() && fplan_.kda[size_t(id)].scan >= 0) {   // the KDA decode tail (fuse_kda_decode)
            run_kda_fused(g, id);
            return;
        }
        if (!fplan_.moe_shared.empty() && fplan_.moe_shared[size_t(id)].add >= 0) {   // experts + shared slot (moe_shared_slot)
            run_moe_shared(g, id);
            return;
        }
        if (!fplan_.mla_kv_norm.empty() && fplan_.mla_kv_norm[size_t(id)] >= 0) {   // the MLA kv_a split (fuse_mla_kv)
            run_mla_kv_split(g, id);
            return;
        }
        float * y = static_cast<float *>(out.at(0).p);
        int * err = err_slot_[size_t(id)] >= 0 ? err_ + err_slot_[size_t(id)] * cuda::ERR_COUNT : nullptr;
        const dtensor & x = in(n, 0);
        const int64_t xn = shape_numel(x.shape);
        switch (n.op) {
            case op_type::IDS:
            case op_type::WEIGHT:
            case op_type::STATE: break;
            case op_type::GET_ROWS: {
                const dtensor & tab = in(n, 0);
                PG_CUDA_CHECK(cuda::launch_get_rows(w_in(n, 0), tab.shape.at(0), tab.shape.at(1), i32_in(n, 1),
                                                    shape_numel(in(n, 1).shape), y, err, st_));
                break;
            }
            case op_type::RMS_NORM:
            case op_type::LAYER_NORM:
            case op_type::L2_NORM:
            case op_type::GATED_RMS_NORM: {
                const int64_t N = n.p.n;
                PG_CHECK(N > 0 && xn % N == 0, "width {} does not divide {} values", N, xn);
                const int64_t R = xn / N;
                if (n.op == op_type::RMS_NORM) PG_CUDA_CHECK(cuda::launch_rms_norm(f32_in(n, 0), R, N, w_in(n, 1), n.p.eps, y, st_, opt_.norm_reg));
                if (n.op == op_type::LAYER_NORM)
                    PG_CUDA_CHECK(cuda::launch_layer_norm(f32_in(n, 0), R, N, w_in(n, 1), w_in(n, 2), n.p.eps, y, st_, opt_.norm_reg));
                if (n.op == op_type::L2_NORM) PG_CUDA_CHECK(cuda::launch_l2_norm(f32_in(n, 0), R, N, n.p.eps, y, st_, opt_.norm_reg));
                if (n.op == op_type::GATED_RMS_NORM)
                    PG_CUDA_CHECK(cuda::launch_gated_rms_norm(f32_in(n, 0), f32_in(n, 1), R, N, w_in(n, 2), n.p.eps, y, st_, opt_.norm_reg));
                break;
            }
            case op_type::LINEAR: run_linear(n, y); break;
            case op_type::ADD:
            case op_type::MUL:
            case op_type::SCALE:
            case op_type::SIGMOID:
            case op_type::SILU_MUL:
            case op_type::SITU_MUL: {
                const bool two = n.op == op_type::ADD || n.op == op_type::MUL || n.op == op_type::SILU_MUL ||
                                 n.op == op_type::SITU_MUL;
                if (two) PG_CHECK(shape_numel(in(n, 1).shape) == xn, "inputs have {} and {} values", xn, shape_numel(in(n, 1).shape));
                if (n.op == op_type::SITU_MUL) PG_CHECK(n.p.situ_beta > 0.0f, "situ_mul: beta must be positive, got {}", n.p.situ_beta);
                const cuda::ew_op op = n.op == op_type::ADD       ? cuda::ew_op::ADD
                                       : n.op == op_type::MUL     ? cuda::ew_op::MUL
                                       : n.op == op_type::SCALE   ? cuda::ew_op::SCALE
                                       : n.op == op_type::SIGMOID ? cuda::ew_op::SIGMOID
                                       : n.op == op_type::SILU_MUL ? cuda::ew_op::SILU_MUL
                                                                   : cuda::ew_op::SITU_MUL;
                cuda::ew_params p;
                p.scale = n.p.scale;
                p.beta = n.p.situ_beta;
                p.lin_beta = n.p.situ_linear_beta;
                PG_CUDA_CHECK(cuda::launch_elementwise(op, f32_in(n, 0), two ? f32_in(n, 1) : nullptr, xn, p, y, st_));
                break;
            }
            case op_type::COLS: {
                const int64_t C = x.shape.at(1);
                PG_CHECK(n.p.c0 >= 0 && n.p.n >= 0 && n.p.c0 + n.p.n <= C, "cols: [{}, {}) outside {} columns", n.p.c0,
                         n.p.c0 + n.p.n, C);
                PG_CUDA_CHECK(cuda::launch_cols(f32_in(n, 0), x.shape.at(0), C, n.p.c0, n.p.n, y, st_));
                break;
            }
            case op_type::SELECT_ROWS: {   // rows are host-known: one device copy per row
                const auto & rows = g.b->logits_rows;
                const int64_t C = x.shape.at(1);
                if (rows.empty()) {
                    PG_CUDA_CHECK(cudaMemcpyAsync(y, x.p, size_t(xn) * 4, cudaMemcpyDeviceToDevice, st_));
                    break;
                }
                for (size_t r = 0; r < rows.size(); ++r) {
                    PG_CHECK(rows[r] >= 0 && rows[r] < x.shape.at(0), "logits row {} outside 0..{}", rows[r], x.shape.at(0) - 1);
                    PG_CUDA_CHECK(cudaMemcpyAsync(y + int64_t(r) * C, f32_in(n, 0) + rows[r] * C, size_t(C) * 4,
                                                  cudaMemcpyDeviceToDevice, st_));
                }
                break;
            }
            case op_type::SHORT_CONV: {
                const dtensor & w = in(n, 1);
                const tensor & sth = state_host(g, n, 2);
                const int64_t C = x.shape.at(1);
                PG_CHECK(w.shape.size() == 3 && w.shape[0] == C, "conv weight {} for {} channels", shape_str(w.shape), C);
                PG_CHECK(sth.shape.size() == 3 && sth.shape[1] == C && sth.shape[2] == w.shape[2] - 1,
                         "conv state {} for weight {}", shape_str(sth.shape), shape_str(w.shape));
                PG_CHECK(g.b->n_tokens() == x.shape.at(0), "batch has {} tokens, input {}", g.b->n_tokens(), x.shape.at(0));
                slots_check(*g.b, sth.shape[0], "short_conv");
                if (opt_.conv_prefill_tokens > 0 && x.shape.at(0) >= opt_.conv_prefill_tokens) {
                    PG_CUDA_CHECK(cuda::launch_short_conv_tokens(f32_in(n, 0), x.shape.at(0), C, w_in(n, 1), w.shape[2],
                                                                 state_in(g, n, 2), db_, y, st_));
                    break;
                }
                PG_CUDA_CHECK(cuda::launch_short_conv(f32_in(n, 0), C, w_in(n, 1), w.shape[2], state_in(g, n, 2), db_, y, st_));
                break;
            }
            case op_type::KDA_GATE: {
                PG_CHECK(shape_numel(in(n, 1).shape) >= n.p.n_head, "A_log has {} values for {} heads",
                         shape_numel(in(n, 1).shape), n.p.n_head);
                PG_CHECK(shape_numel(in(n, 2).shape) == n.p.n_head * n.p.head_dim_k, "dt_bias has {} values for {} channels",
                         shape_numel(in(n, 2).shape), n.p.n_head * n.p.head_dim_k);
                PG_CUDA_CHECK(cuda::launch_kda_gate(f32_in(n, 0), x.shape.at(0), n.p.n_head, n.p.head_dim_k, w_in(n, 1),
                                                    w_in(n, 2), n.p.gate_lower_bound, y, st_));
                break;
            }
            case op_type::KDA_SCAN: {
                const tensor & sth = state_host(g, n, 5);
                PG_CHECK(sth.shape.size() == 4 && sth.shape[1] == n.p.n_head && sth.shape[2] == n.p.head_dim_k &&
                             sth.shape[3] == n.p.head_dim_v,
                         "state {} for {} heads x {} x {}", shape_str(sth.shape), n.p.n_head, n.p.head_dim_k, n.p.head_dim_v);
                PG_CHECK(g.b->n_tokens() == x.shape.at(0), "batch has {} tokens, q has {}", g.b->n_tokens(), x.shape.at(0));
                slots_check(*g.b, sth.shape[0], "kda_scan");
                const int64_t kK = n.p.head_dim_k, kV = n.p.head_dim_v;
                if (kda_scan_chunked(n, x.shape.at(0))) {   // chunked WY form (cuda_options::kda_chunk_min_tokens)
                    int max_len = 0;
                    for (int s = 0; s < g.b->n_seq(); ++s) max_len = std::max(max_len, g.b->seq_len(s));
                    float * scratch = static_cast<float *>(
                        node_scratch(size_t(cuda::kda_chunk_scratch_floats(x.shape.at(0), g.b->n_seq(), n.p.n_head, kK)) * 4));
                    PG_CUDA_CHECK(cuda::launch_kda_scan_chunked(f32_in(n, 0), f32_in(n, 1), f32_in(n, 2), f32_in(n, 3),
                                                                f32_in(n, 4), n.p.n_head, kK, kV, n.p.scale,
                                                                state_in(g, n, 5), db_, max_len, scratch, y, st_));
                    break;
                }
                if (opt_.kda_decode_v2 && cuda::kda_scan_v2_supported(kK, kV, f32_in(n, 2), state_in(g, n, 5), y)) {
                    PG_CUDA_CHECK(cuda::launch_kda_scan_v2(f32_in(n, 0), f32_in(n, 1), f32_in(n, 2), f32_in(n, 3), f32_in(n, 4),
                                                           n.p.n_head, kK, kV, n.p.scale, state_in(g, n, 5), db_, y, st_));
                    break;
                }
                PG_CUDA_CHECK(cuda::launch_kda_scan_recurrent(f32_in(n, 0), f32_in(n, 1), f32_in(n, 2), f32_in(n, 3),
                                                              f32_in(n, 4), n.p.n_head, n.p.head_dim_k, n.p.head_dim_v,
                                                              n.p.scale, state_in(g, n, 5), db_, y, st_));
                break;
            }
            case op_type::MLA_ATTN: {
                const tensor & ch = state_host(g, n, 4);
                const cuda::mla_shape d{n.p.n_head, n.p.head_dim_nope, n.p.head_dim_rope, n.p.head_dim_v, n.p.kv_lora_rank};
                PG_CHECK(ch.shape.size() == 3 && ch.shape[1] == g.b->page_size && ch.shape[2] == d.kv_lora_rank + d.head_dim_rope,
                         "cache {} for page size {} and width {}", shape_str(ch.shape), g.b->page_size,
                         d.kv_lora_rank + d.head_dim_rope);
                PG_CHECK(g.b->n_tokens() == x.shape.at(0), "batch has {} tokens, q has {}", g.b->n_tokens(), x.shape.at(0));
                paging_check(*g.b, ch.shape[0], "mla_attn");
                const bool has_sel = n.src.size() > 5 && n.src[5].valid();
                if (opt_.mla_prefill_tokens > 0 && !has_sel && x.shape.at(0) >= opt_.mla_prefill_tokens &&
                    (w_in(n, 3).type == wtype::BF16 || w_in(n, 3).type == wtype::F32) && cuda::mla_prefill_smem(d) > 0 &&
                    mla_prefill_pays(*g.b) && mla_prefill_bytes(*g.b, d) <= opt_.mla_prefill_max_bytes) {
                    run_mla_prefill(g, n, d, y);
                    break;
                }
                const int ns = cuda::mla_split_for(x.shape.at(0), d, opt_.mla_split, opt_.mla_decode_v2);
                float * scratch = static_cast<float *>(node_scratch(size_t(cuda::mla_scratch_floats(x.shape.at(0), d, ns)) * 4));
                PG_CUDA_CHECK(cuda::launch_mla_attn(f32_in(n, 0), f32_in(n, 1), f32_in(n, 2), w_in(n, 3), d, n.p.scale,
                                                    state_in(g, n, 4), has_sel ? i32_in(n, 5) : nullptr,
                                                    has_sel ? in(n, 5).shape.at(1) : 0, db_, ns, scratch, y, err, st_,
                                                    opt_.mla_decode_v2, opt_.mla_decode_v3, opt_.mla_attn_v4));
                break;
            }
            case op_type::INDEXER_TOPK: {
                const tensor & kc = state_host(g, n, 3);
                PG_CHECK(kc.shape.size() == 3 && kc.shape[1] == g.b->page_size && kc.shape[2] == n.p.head_dim_k,
                         "key cache {} for page size {} and head dim {}", shape_str(kc.shape), g.b->page_size, n.p.head_dim_k);
                PG_CHECK(g.b->n_tokens() == x.shape.at(0), "batch has {} tokens, q has {}", g.b->n_tokens(), x.shape.at(0));
                paging_check(*g.b, kc.shape[0], "indexer_topk");
                float * scratch = static_cast<float *>(node_scratch(size_t(x.shape.at(0)) * size_t(std::max(1, db_.max_pos)) * 4));
                PG_CUDA_CHECK(cuda::launch_indexer_topk(f32_in(n, 0), f32_in(n, 1), f32_in(n, 2), n.p.n_head, n.p.head_dim_k,
                                                        n.p.topk, n.p.scale, state_in(g, n, 3), db_, scratch,
                                                        static_cast<int32_t *>(out[0].p), st_));
                break;
            }
            case op_type::MOE_ROUTE: {
                const dtensor & gw = in(n, 1);
                PG_CHECK(gw.shape.size() == 2 && gw.shape[1] == x.shape.at(1), "gate {} for input {}", shape_str(gw.shape),
                         shape_str(x.shape));
                const int64_t E = gw.shape[0];
                const dweight bias = w_in(n, 2);
                if (bias.data) PG_CHECK(shape_numel(in(n, 2).shape) == E, "bias {} for {} experts", shape_str(in(n, 2).shape), E);
                PG_CHECK(n.p.topk >= 1 && n.p.topk <= E, "moe_route: top-{} of {} experts", n.p.topk, E);
                PG_CHECK(n.p.n_group >= 1 && E % n.p.n_group == 0 && n.p.topk_group >= 1 && n.p.topk_group <= n.p.n_group,
                         "moe_route: {} experts in {} groups, keeping {}", E, n.p.n_group, n.p.topk_group);
                if (n.p.n_group > 1 && n.p.topk_group < n.p.n_group)
                    PG_CHECK(n.p.topk_group * (E / n.p.n_group) >= n.p.topk, "moe_route: {} kept groups of {} cannot hold top-{}",
                             n.p.topk_group, E / n.p.n_group, n.p.topk);
                const cuda::droute c{E, n.p.topk, n.p.n_group, n.p.topk_group, n.p.renormalize, n.p.scale,
                                     n.p.router == router_act::SOFTMAX ? 1 : 0};
                if (const float * lg = route_logits_.empty() ? nullptr : route_logits_[size_t(id)]) {   // fuse_norm_route
                    PG_CUDA_CHECK(select_fn(c)(lg, x.shape.at(0), bias, c, static_cast<int32_t *>(out[0].p),
                                              static_cast<float *>(out[1].p), st_));
                    break;
                }
                PG_CHECK(fplan_.route_by.empty() || fplan_.route_by[size_t(id)] < 0,
                         "MOE_ROUTE '{}': planned into the launch of norm '{}' but its logits were not computed", n.name,
                         g.nodes[size_t(fplan_.route_by[size_t(id)])].name);
                if (opt_.moe_route_gemm_tokens > 0 && x.shape.at(0) >= opt_.moe_route_gemm_tokens &&
                    (w_in(n, 1).type == wtype::BF16 || w_in(n, 1).type == wtype::F32)) {   // prefill: logits by one GEMM
                    const int64_t T = x.shape.at(0), D = x.shape.at(1);
                    const dweight gw = w_in(n, 1);
                    float * logits = static_cast<float *>(node_scratch(size_t(T * E) * 4));
                    if (gw.type == wtype::F32) {
                        lt_matmul(gw.data, x.p, CUDA_R_32F, logits, E, T, D, 0.0f);
                    } else {   // x = p0 + p1 + p2 (24 bits), smallest part first into the fp32 accumulator
                        uint16_t * xb[3];   // separate allocations: each part 256-byte aligned for cuBLASLt
                        for (auto & p : xb) p = static_cast<uint16_t *>(node_scratch(size_t(T * D) * 2));
                        PG_CUDA_CHECK(cuda::launch_f32_to_bf16_split3(f32_in(n, 0), T * D, xb[0], xb[1], xb[2], st_));
                        for (int k = 2; k >= 0; --k)
                            lt_matmul(gw.data, xb[k], CUDA_R_16BF, logits, E, T, D, k == 2 ? 0.0f : 1.0f);
                    }
                    PG_CUDA_CHECK(select_fn(c)(logits, T, bias, c, static_cast<int32_t *>(out[0].p), static_cast<float *>(out[1].p),
                                              st_));
                    break;
                }
                if (opt_.moe_route_fast && opt_.moe_route_fused && x.shape.at(0) == 1) {
                    float * logits = static_cast<float *>(alloc(size_t(E) * 4));
                    auto * counter = static_cast<unsigned *>(alloc(4));
                    PG_CUDA_CHECK(cuda::launch_moe_route_fused(f32_in(n, 0), x.shape.at(1), w_in(n, 1), bias, c, logits, counter,
                                                               static_cast<int32_t *>(out[0].p), static_cast<float *>(out[1].p),
                                                               st_));
                    break;
                }
                if (opt_.moe_route_fast && opt_.moe_route_fused_radix && x.shape.at(0) == 1 && w_in(n, 1).type == wtype::BF16 &&
                    x.shape.at(1) % 32 == 0) {   // one launch: GEMV, the last block selects
                    float * logits = static_cast<float *>(alloc(size_t(E) * 4));
                    PG_CUDA_CHECK(cuda::launch_moe_route_radix_fused(f32_in(n, 0), x.shape.at(1), w_in(n, 1), bias, c, logits,
                                                                     route_ctr_, static_cast<int32_t *>(out[0].p),
                                                                     static_cast<float *>(out[1].p), st_));
                    break;
                }
                if (opt_.moe_route_fast &&
                    (opt_.moe_select_radix || opt_.moe_select_sort || opt_.moe_select_warp)) {   // GEMV, then the selection
                    const int64_t T = x.shape.at(0);
                    float * logits = static_cast<float *>(alloc(size_t(T * E) * 4));
                    cuda::gemv_cfg rc = gemv_cfg_for(x.shape.at(1));
                    if (opt_.moe_route_gemv_v2) rc.unroll = opt_.gemv_unroll;   // v2 (row split) whatever the width
                    PG_CUDA_CHECK(cuda::launch_linear_gemv(f32_in(n, 0), T, x.shape.at(1), w_in(n, 1), E, logits, st_, rc));
                    PG_CUDA_CHECK(select_fn(c)(logits, T, bias, c, static_cast<int32_t *>(out[0].p), static_cast<float *>(out[1].p),
                                              st_));
                    break;
                }
                if (opt_.moe_route_fast) {
                    float * logits = static_cast<float *>(alloc(size_t(x.shape.at(0) * E) * 4));
                    PG_CUDA_CHECK(cuda::launch_moe_route_fast(f32_in(n, 0), x.shape.at(0), x.shape.at(1), w_in(n, 1), bias, c,
                                                              logits, static_cast<int32_t *>(out[0].p),
                                                              static_cast<float *>(out[1].p), st_));
                    break;
                }
                PG_CUDA_CHECK(cuda::launch_moe_route(f32_in(n, 0), x.shape.at(0), x.shape.at(1), w_in(n, 1), bias, c,
                                                     static_cast<int32_t *>(out[0].p), static_cast<float *>(out[1].p), st_));
                break;
            }
            case op_type::MOE_EXPERTS: {
                const dtensor & idt = in(n, 1);
                PG_CHECK(in(n, 2).shape == idt.shape && idt.shape.size() == 2 && idt.shape[0] == x.shape.at(0),
                         "ids {} / weights {} for {} tokens", shape_str(idt.shape), shape_str(in(n, 2).shape), x.shape.at(0));
                const auto & ex = *n.p.experts;
                const int64_t T = x.shape.at(0), Din = x.shape.at(1), k = idt.shape[1];
                const int64_t F = ex[0].gate.out, Dout = n.outs.at(0).shape.at(1);
                const cuda::dexpert * table = expert_table(n);
                const cuda::dexperts_cfg c{n.p.act == glu_act::SITU ? 1 : 0, n.p.situ_beta, n.p.situ_linear_beta, F, Dout};
                float * scratch = static_cast<float *>(node_scratch(size_t(T * k * (F + Dout)) * 4));
                const expert_fmt ef = expert_fmt_.at(n.p.experts.get());
                const int vfmt = opt_.moe_grouped ? ef.vfmt : 0;
                if (vfmt > 0 && int64_t(ex.size()) <= 1024) {
                    auto * gw = static_cast<int32_t *>(node_scratch(size_t(cuda::moe_group_ints(T, k, int64_t(ex.size()), Dout)) * 4));
                    cuda::dmoe_opts mo;
                    mo.fp4_v2 = opt_.moe_fp4_v2;
                    mo.fp4_v3 = opt_.moe_fp4_v3;
                    mo.mma_tokens = opt_.moe_mma_tokens;
                    mo.mma_split = opt_.moe_mma_split;
                    mo.mma_v2 = opt_.moe_mma_v2;
                    mo.mma_v3 = opt_.moe_mma_v3;
                    mo.mma_v4 = opt_.moe_mma_v4;
                    mo.mma_v4_bf16 = opt_.moe_mma_v4_bf16;
                    // the shift form's one multiply is exact only for scale bytes <= fp4_shift_max_scale (fp4.cuh)
                    mo.mma_v4_shift = opt_.moe_mma_v4_shift && ef.shift_ok;
                    mo.dec_v4 = opt_.moe_decode_v4;
                    mo.small_v4 = opt_.moe_small_v4;
                    mo.mma_large_step = opt_.moe_mma_large_step;
                    mo.mma_large_tokens = opt_.moe_mma_large_tokens;
                    mo.dec_v5 = opt_.moe_decode_v5;
                    mo.v5_cfg = opt_.moe_decode_v6 ? (opt_.moe_decode_v7 ? 2000 + opt_.moe_decode_v7_form % 1000 / 10 * 10 : 1000) : 0;
                    mo.dec_bf16 = opt_.moe_decode_bf16;
                    mo.dec_pairs_fp4 = opt_.moe_decode_pairs_mxfp4;
                    mo.dec_pairs_bf16 = opt_.moe_decode_pairs_bf16;
                    mo.pairs_sorted = opt_.moe_decode_pairs_sorted;
                    mo.bf16_cfg = 100 * opt_.moe_bf16_early + (opt_.moe_bf16_evict_first ? 1000 : 0);
                    if (n.p.bf16_inputs) {   // every expert on the tensor-core stages, activations hi only: x and h rounded
                        PG_CHECK(T >= 2, "{}: bf16 inputs for {} token: the tensor-core experts need a step of 2 or more",
                                 n.name, T);
                        mo.mma_tokens = mo.mma_large_tokens = 1;
                        mo.mma_split = false;
                        mo.dec_v5 = mo.dec_bf16 = mo.dec_v4 = false;
                        mo.dec_pairs_fp4 = mo.dec_pairs_bf16 = 0;
                    }
                    PG_CUDA_CHECK(cuda::launch_moe_experts_grouped(vfmt, f32_in(n, 0), T, Din, i32_in(n, 1), f32_in(n, 2), k,
                                                                   table, int64_t(ex.size()), c, scratch, gw, y, err, st_, mo));
                    break;
                }
                // The per-pick kernels (F32 experts, or grouping off): bf16 inputs as a rounded copy of x and the GLU
                // rows rounded in place before the down projection.
                const float * xin = f32_in(n, 0);
                if (n.p.bf16_inputs) {
                    auto * xr = static_cast<float *>(node_scratch(size_t(T * Din) * 4));
                    PG_CUDA_CHECK(cuda::launch_f32_round_bf16(xin, T * Din, xr, st_));
                    xin = xr;
                }
                PG_CUDA_CHECK(cuda::launch_moe_experts(xin, T, Din, i32_in(n, 1), f32_in(n, 2), k, table, int64_t(ex.size()), c,
                                                       scratch, y, err, st_, n.p.bf16_inputs));
                break;
            }
            case op_type::ATTN_RES_MIX: {
                const size_t nc = n.src.size() - 2;
                cuda::cand_ptrs cp{};
                for (size_t i = 0; i < nc; ++i) {
                    PG_CHECK(in(n, i).shape == x.shape, "candidate {} {} differs from {}", i, shape_str(in(n, i).shape),
                             shape_str(x.shape));
                    cp.p[i] = f32_in(n, i);
                }
                const int64_t D = x.shape.back();
                bool ar_aligned = D % 4 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;   // float4 path of the prefill kernels
                for (size_t i = 0; i < nc; ++i) ar_aligned &= reinterpret_cast<uintptr_t>(cp.p[i]) % 16 == 0;
                if (opt_.attn_res_prefill_tokens > 0 && xn / D >= opt_.attn_res_prefill_tokens && ar_aligned) {
                    float * scr = static_cast<float *>(alloc(size_t(D + xn / D * int64_t(nc)) * 4));
                    PG_CUDA_CHECK(cuda::launch_attn_res_mix_prefill(cp, int64_t(nc), xn / D, D, w_in(n, nc), w_in(n, nc + 1), n.p.eps,
                                                                    scr, y, st_));
                    break;
                }
                if (opt_.attn_res_cluster && ar_aligned) {   // decode, one launch: a cluster of column blocks per row
                    PG_CUDA_CHECK(cuda::launch_attn_res_mix_cluster(cp, int64_t(nc), xn / D, D, w_in(n, nc), w_in(n, nc + 1), n.p.eps,
                                                                    opt_.attn_res_chunk, y, st_));
                    break;
                }
                if (opt_.attn_res_chunk > 0 && ar_aligned) {   // decode: scores from column-chunk partials
                    const int64_t R = xn / D;
                    float * part = static_cast<float *>(alloc(size_t(cuda::attn_res_chunk_parts(int64_t(nc), R, D, opt_.attn_res_chunk)) * 4));
                    PG_CUDA_CHECK(cuda::launch_attn_res_mix_chunked(cp, int64_t(nc), R, D, w_in(n, nc), w_in(n, nc + 1), n.p.eps,
                                                                    opt_.attn_res_chunk, part, y, st_));
                    break;
                }
                float * sc = opt_.attn_res_split ? static_cast<float *>(alloc(size_t(xn / D * int64_t(nc)) * 4)) : nullptr;
                PG_CUDA_CHECK(cuda::launch_attn_res_mix(cp, int64_t(nc), xn / D, D, w_in(n, nc), w_in(n, nc + 1), n.p.eps, sc, y,
                                                        st_));
                break;
            }
            case op_type::COUNT: PG_FAIL("op COUNT is not an op");
        }
    }

    // MOE_ROUTE's selection kernel from the logits for route c: the small form inside its domain (moe_select_small), else
    // threshold (moe_select_radix), sort (moe_select_sort), warp
    // (moe_select_warp) or the block kernel.
    using select_launcher = cudaError_t (*)(const float *, int64_t, cuda::dweight, const cuda::droute &, int32_t *, float *,
                                            cudaStream_t);
    select_launcher select_fn(const cuda::droute & c) const {
        if (opt_.moe_select_small && cuda::moe_select_small_supported(c.n_expert, c.topk, c.n_group, c.topk_group, c.softmax != 0))
            return opt_.moe_select_small == 4 ? cuda::launch_moe_select_small4 : cuda::launch_moe_select_small8;
        if (opt_.moe_select_radix) return cuda::launch_moe_select_radix;
        return opt_.moe_select_sort ? cuda::launch_moe_select_sort
                                    : opt_.moe_select_warp ? cuda::launch_moe_select_warp : cuda::launch_moe_select;
    }

    // The GEMV kernels for rows of `in` columns: v2 (cuda_options::gemv_unroll) from gemv_v2_min_in columns, else the first.
    cuda::gemv_cfg gemv_cfg_for(int64_t in) const {
        return cuda::gemv_cfg{in >= opt_.gemv_v2_min_in ? opt_.gemv_unroll : 0, 0, in >= opt_.gemv_v3_min_in && in <= opt_.gemv_v3_max_in ? opt_.gemv_v3 : 0, 0,
                              opt_.gemv_evict_first, opt_.gemv_mma_min_tokens, 3, mma_part_, mma_part_ ? k_mma_part_floats : 0,
                              mma_ctr_, mma_ctr_ ? k_mma_ctr_n : 0};
    }

    // KDA_SCAN on the chunked WY kernels (cuda_options::kda_chunk_min_tokens) for this step?
    bool kda_scan_chunked(const node & n, int64_t T) const {
        return n.p.chunk_size == 64 && opt_.kda_chunk_min_tokens > 0 && T >= opt_.kda_chunk_min_tokens &&
               n.p.head_dim_k <= 128 && n.p.head_dim_k % 4 == 0 && n.p.head_dim_v <= 128;
    }
    // Whether node `id` is computed by a launch at a LATER node (fuse_kda_decode; moe_shared_slot when a graph places a
    // shared-expert node before its MOE_EXPERTS); the nodes launch `id` computes that come before it (in order). For the
    // node callback and the guard: they report such nodes after that launch.
    bool done_later(int id) const { return !fplan_.done_by.empty() && fplan_.done_by[size_t(id)] > id; }
    std::vector<int> later_done(int id) const {
        std::vector<int> v;
        if ((!fplan_.kda.empty() && fplan_.kda[size_t(id)].scan >= 0) ||
            (!fplan_.moe_shared.empty() && fplan_.moe_shared[size_t(id)].add >= 0))
            for (int j = 0; j < id; ++j)
                if (fplan_.done_by[size_t(j)] == id) v.push_back(j);
        return v;
    }
    // ---- fusions (fuse-plan.h: the one planner; bench-cuda-decode --dry counts the same rule) ----
    void plan_fusions(const graph & g) {
        fplan_ = cuda_fuse::plan_fusions(g, opt_);
        n_grouped_ = n_fused_norms_ = n_fused_adds_ = n_norm_staged_ = n_conv_l2_ = n_fused_sig_ = n_kda_fused_ = n_moe_shared_ = n_moe_layer_ = n_kda_oproj_ = 0;
        n_fused_routes_ = n_linear_stacked_ = n_linear_shared_x_ = 0;
        shared_x_ = {};   // a new step: no bf16 copy of any input yet (linear_bf16_share_x)
        // F32 copies of the folded norms' weights (made here, outside any capture; cached by device pointer)
        fnorm_w_.assign(g.nodes.size(), nullptr);
        for (size_t i = 0; i < g.nodes.size(); ++i) {
            const node & n = g.nodes[i];
            if (fplan_.at[i].norm < 0 || n.src.size() < 2 || !n.src[1].valid()) continue;
            const tensor & t = *g.at(n.src[1]).leaf;
            const void * d = weight_dev(t);
            if (t.type == dtype::F32) {
                fnorm_w_[i] = static_cast<const float *>(d);
                continue;
            }
            auto it = norm_w32_.find(d);
            if (it == norm_w32_.end()) {
                void * p = nullptr;
                PG_CUDA_CHECK(cudaMalloc(&p, size_t(std::max<int64_t>(t.numel(), 4)) * 4));
                PG_CUDA_CHECK(cuda::launch_weight_to_f32(dweight{d, wtype_of(t.type, n.name)}, t.numel(), static_cast<float *>(p), st_));
                PG_CUDA_CHECK(cudaStreamSynchronize(st_));
                it = norm_w32_.emplace(d, static_cast<float *>(p)).first;
            }
            fnorm_w_[i] = it->second;
        }
    }
    // The launches planned at node `id` (its own outputs are allocated): every LINEAR segment's output and its
    // epilogue ADDs' outputs are allocated here, weights bound on demand (declared at their use, after this node).
    void run_fused(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        const cuda_fuse::launch & L = fplan_.at[size_t(id)];
        const bool norm = L.norm >= 0;
        const dtensor & x = norm ? in(n, 0) : in(g.nodes[size_t(L.groups.at(0).at(0).linear)], 0);
        PG_CHECK(x.shape.size() == 2, "fused launch: input {} is not [T, K]", shape_str(x.shape));
        const int64_t T = x.shape[0], K = x.shape[1];
        bool plain_group = !norm;   // a linear_group launch without epilogue: the measured grouped kernel
        for (const auto & gr : L.groups)
            for (const auto & sg : gr) plain_group &= sg.add[0] < 0 && sg.sig < 0;
        for (size_t gi = 0; gi < L.groups.size(); ++gi) {
            const auto & gr = L.groups[gi];
            cuda::gemv_fused_seg segs[cuda::k_gemv_group_max];
            PG_CHECK(!gr.empty() && gr.size() <= size_t(cuda::k_gemv_group_max), "fused launch of {} LINEARs", gr.size());
            wtype wt = wtype::F32;
            for (size_t k = 0; k < gr.size(); ++k) {
                const node & m = g.nodes[size_t(gr[k].linear)];
                if (outs_[size_t(m.src[1].node)].empty()) run_node(g, m.src[1].node);
                const dtensor & w = in(m, 1);
                PG_CHECK(w.shape.size() == 2 && w.shape[1] == K, "fused LINEAR '{}': weight {} for input {}", m.name,
                         shape_str(w.shape), shape_str(x.shape));
                const wtype t = wtype_of(w.type, m.name);
                PG_CHECK(k == 0 || t == wt, "fused LINEAR '{}': weight dtype differs within its launch", m.name);
                wt = t;
                if (gr[k].route) {   // fuse_norm_route: the router's logits [T, E]; the MOE_ROUTE node selects from them
                    PG_CHECK(m.op == op_type::MOE_ROUTE && !route_logits_[size_t(gr[k].linear)], "fused route '{}'", m.name);
                    float * lg = static_cast<float *>(alloc(size_t(T * w.shape[0]) * 4));
                    route_logits_[size_t(gr[k].linear)] = lg;
                    segs[k].w = w.p;
                    segs[k].y = lg;
                    segs[k].out = w.shape[0];
                    ++n_fused_routes_;
                    continue;
                }
                auto & o = outs_[size_t(gr[k].linear)];
                if (gr[k].linear != id) {
                    PG_CHECK(o.empty(), "fused LINEAR '{}' already has outputs", m.name);
                    for (const auto & oo : m.outs) o.push_back(new_out(oo.type, oo.shape));
                }
                segs[k].w = w.p;
                segs[k].y = static_cast<float *>(o.at(0).p);
                segs[k].out = w.shape[0];
                for (int a = 0; a < 2 && gr[k].add[a] >= 0; ++a) {
                    const node & an = g.nodes[size_t(gr[k].add[a])];
                    const node_ref r = gr[k].res[a];
                    PG_CHECK(!outs_[size_t(r.node)].empty(), "fused ADD '{}': residual '{}' is not computed yet", an.name,
                             g.at(r).name);
                    auto & ao = outs_[size_t(gr[k].add[a])];
                    PG_CHECK(ao.empty(), "fused ADD '{}' already has outputs", an.name);
                    for (const auto & oo : an.outs) ao.push_back(new_out(oo.type, oo.shape));
                    segs[k].res[a] = static_cast<const float *>(outs_[size_t(r.node)].at(size_t(r.out)).p);
                    segs[k].z[a] = static_cast<float *>(ao.at(0).p);
                    ++n_fused_adds_;
                }
                if (gr[k].sig >= 0) {   // the SIGMOID over this LINEAR (fuse_sigmoid)
                    const node & sn = g.nodes[size_t(gr[k].sig)];
                    auto & so = outs_[size_t(gr[k].sig)];
                    PG_CHECK(so.empty(), "fused SIGMOID '{}' already has outputs", sn.name);
                    for (const auto & oo : sn.outs) so.push_back(new_out(oo.type, oo.shape));
                    segs[k].sig = static_cast<float *>(so.at(0).p);
                    ++n_fused_sig_;
                }
            }
            n_grouped_ += int(gr.size()) - 1;
            if (plain_group) {   // the grouped kernel takes the segments' weights, outputs and widths as arrays
                const void * wp[cuda::k_gemv_group_max];
                float * yp[cuda::k_gemv_group_max];
                int64_t op[cuda::k_gemv_group_max];
                for (size_t k = 0; k < gr.size(); ++k) {
                    wp[k] = segs[k].w;
                    yp[k] = segs[k].y;
                    op[k] = segs[k].out;
                }
                PG_CUDA_CHECK(cuda::launch_linear_gemv_group(static_cast<const float *>(x.p), T, K, wt, wp, yp, op,
                                                             int(gr.size()), st_, gemv_cfg_for(K)));
                continue;
            }
            cuda::gemv_norm nm;
            if (norm) {
                nm.on = true;
                nm.staged = opt_.fuse_norm_staged;
                nm.w = fnorm_w_[size_t(id)];
                nm.eps = n.p.eps;
                nm.y = gi == 0 ? static_cast<float *>(outs_[size_t(id)].at(0).p) : nullptr;
            }
            PG_CUDA_CHECK(cuda::launch_linear_gemv_fused(static_cast<const float *>(x.p), T, K, wt, segs, int(gr.size()), nm, st_,
                                                         &n_norm_staged_, gemv_cfg_for(K)));
        }
        if (norm) ++n_fused_norms_;
    }

    // MLA_ATTN prefill in the expanded form (cuda_options::mla_prefill_tokens; prefill-ops.h): gather the cached latent
    // rows of every sequence's positions, kv [P, H * (dn + dv)] = cg kv_b^T (BF16: cg split hi + lo, two GEMMs), then
    // the causal flash-attention kernel.
    bool mla_prefill_pays(const batch & hb) const {
        int64_t pairs = 0, rows = 0;
        for (int s = 0; s < hb.n_seq(); ++s) {
            const int64_t p0 = hb.pos0[size_t(s)], len = hb.seq_len(s);
            pairs += len * p0 + len * (len + 1) / 2;
            rows += p0 + len;
        }
        return pairs >= int64_t(opt_.mla_prefill_pairs_per_row) * rows;
    }
    // Device bytes run_mla_prefill allocates for the step: cg (L f32), its bf16 hi + lo (L * 4), krg (dr f32) and the
    // expanded kv (H * (dn + dv) f32) per gathered position, and with the tensor-core attention kv's and krg's bf16 hi + lo
    // (as many bytes again) (cuda_options::mla_prefill_max_bytes bounds it).
    int64_t mla_prefill_bytes(const batch & hb, const cuda::mla_shape & d) const {
        int64_t P = 0;
        for (int s = 0; s < hb.n_seq(); ++s) P += hb.pos0[size_t(s)] + hb.seq_len(s);
        const int64_t M = d.n_head * (d.head_dim_nope + d.head_dim_v);
        const bool split = opt_.mla_prefill_mma && cuda::mla_prefill_mma_supported(d);
        return P * (d.kv_lora_rank * 8 + (d.head_dim_rope * 4 + M * 4) * (split ? 2 : 1));
    }
    void run_mla_prefill(const graph & g, const node & n, const cuda::mla_shape & d, float * y) {
        const batch & hb = *g.b;
        int64_t P = 0;   // positions 0..pos0+len-1 of every sequence, packed by sequence
        for (int s = 0; s < hb.n_seq(); ++s) P += hb.pos0[size_t(s)] + hb.seq_len(s);
        const int64_t L = d.kv_lora_rank, dr = d.head_dim_rope, M = d.n_head * (d.head_dim_nope + d.head_dim_v);
        PG_CHECK(mla_prefill_bytes(hb, d) <= opt_.mla_prefill_max_bytes,
                 "{}: mla_attn prefill of {} gathered positions needs {} device bytes, over cuda_options::mla_prefill_max_bytes "
                 "{}", n.name, P, mla_prefill_bytes(hb, d), opt_.mla_prefill_max_bytes);
        PG_CHECK(w_in(n, 3).type == wtype::F32 || w_in(n, 3).type == wtype::BF16, "mla_attn prefill: kv_b must be F32 or BF16");
        PG_CHECK(shape_numel(in(n, 3).shape) == M * L, "kv_b {} for {} heads x {} wide x {} latent", shape_str(in(n, 3).shape),
                 d.n_head, d.head_dim_nope + d.head_dim_v, L);
        float * cg = static_cast<float *>(node_scratch(size_t(P * L) * 4));
        float * krg = static_cast<float *>(node_scratch(size_t(P * dr) * 4));
        float * kv = static_cast<float *>(node_scratch(size_t(P * M) * 4));
        PG_CUDA_CHECK(cuda::launch_mla_prefill_gather(f32_in(n, 1), f32_in(n, 2), L, dr, state_in(g, n, 4), db_, P, cg, krg, st_));
        const dweight W = w_in(n, 3);
        if (W.type == wtype::F32) {
            lt_matmul(W.data, cg, CUDA_R_32F, kv, M, P, L, 0.0f);
        } else {
            auto * hi = static_cast<uint16_t *>(node_scratch(size_t(P * L) * 2));   // separate: 256-byte aligned for cuBLASLt
            auto * lo = static_cast<uint16_t *>(node_scratch(size_t(P * L) * 2));
            PG_CUDA_CHECK(cuda::launch_f32_to_bf16_split(cg, P * L, hi, lo, st_));
            lt_matmul(W.data, lo, CUDA_R_16BF, kv, M, P, L, 0.0f);
            lt_matmul(W.data, hi, CUDA_R_16BF, kv, M, P, L, 1.0f);
        }
        if (opt_.mla_prefill_mma && cuda::mla_prefill_mma_supported(d)) {
            // the keys split once for every query tile of a head (mla-prefill.cu "The tensor-core form")
            auto * kvh = static_cast<uint16_t *>(node_scratch(size_t(P * M) * 2));
            auto * kvl = static_cast<uint16_t *>(node_scratch(size_t(P * M) * 2));
            auto * krh = static_cast<uint16_t *>(node_scratch(size_t(P * dr) * 2));
            auto * krl = static_cast<uint16_t *>(node_scratch(size_t(P * dr) * 2));
            PG_CUDA_CHECK(cuda::launch_f32_to_bf16_split(kv, P * M, kvh, kvl, st_));
            PG_CUDA_CHECK(cuda::launch_f32_to_bf16_split(krg, P * dr, krh, krl, st_));
            PG_CUDA_CHECK(cuda::launch_mla_prefill_attn_mma(f32_in(n, 0), kvh, kvl, krh, krl, d, n.p.scale, db_, y, st_));
        } else {
            PG_CUDA_CHECK(cuda::launch_mla_prefill_attn(f32_in(n, 0), kv, krg, d, n.p.scale, db_, y, st_));
        }
    }

    // SHORT_CONV node `id` (outputs allocated) and the L2_NORM the plan folds into it: one launch, both outputs.
    void run_conv_l2(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        const node & m = g.nodes[size_t(fplan_.conv_l2[size_t(id)])];
        const dtensor & x = in(n, 0);
        const dtensor & w = in(n, 1);
        const tensor & sth = state_host(g, n, 2);
        const int64_t C = x.shape.at(1);
        PG_CHECK(w.shape.size() == 3 && w.shape[0] == C, "conv weight {} for {} channels", shape_str(w.shape), C);
        PG_CHECK(sth.shape.size() == 3 && sth.shape[1] == C && sth.shape[2] == w.shape[2] - 1,
                 "conv state {} for weight {}", shape_str(sth.shape), shape_str(w.shape));
        PG_CHECK(g.b->n_tokens() == x.shape.at(0), "batch has {} tokens, input {}", g.b->n_tokens(), x.shape.at(0));
        slots_check(*g.b, sth.shape[0], "short_conv");
        auto & mo = outs_[size_t(fplan_.conv_l2[size_t(id)])];
        PG_CHECK(mo.empty(), "fused L2_NORM '{}' already has outputs", m.name);
        for (const auto & oo : m.outs) mo.push_back(new_out(oo.type, oo.shape));
        PG_CUDA_CHECK(cuda::launch_short_conv_l2(f32_in(n, 0), C, w_in(n, 1), w.shape[2], state_in(g, n, 2), db_,
                                                 static_cast<float *>(outs_[size_t(id)].at(0).p), m.p.n, m.p.eps,
                                                 static_cast<float *>(mo.at(0).p), st_));
        ++n_conv_l2_;
    }

    // GATED_RMS_NORM node `id` (outputs allocated) and the KDA tail the plan folds into it (fuse-plan.h rule 7): one
    // launch; the folded nodes' outputs are allocated here (they were skipped at their own positions). The checks are
    // the unfused ops' checks.
    void run_kda_fused(const graph & g, int id) {
        const node & nn = g.nodes[size_t(id)];
        const cuda_fuse::kda_fold & kf = fplan_.kda[size_t(id)];
        auto outp = [&](int j) {
            auto & o = outs_[size_t(j)];
            PG_CHECK(o.empty(), "fused KDA node '{}' already has outputs", g.nodes[size_t(j)].name);
            for (const auto & oo : g.nodes[size_t(j)].outs) o.push_back(new_out(oo.type, oo.shape));
            return static_cast<float *>(o.at(0).p);
        };
        const node & sc = g.nodes[size_t(kf.scan)];
        const node & gt = g.nodes[size_t(kf.gate)];
        const tensor & sth = state_host(g, sc, 5);
        const int64_t Kh = sc.p.head_dim_k;
        PG_CHECK(sth.shape.size() == 4 && sth.shape[1] == sc.p.n_head && sth.shape[2] == Kh && sth.shape[3] == Kh,
                 "state {} for {} heads x {} x {}", shape_str(sth.shape), sc.p.n_head, Kh, Kh);
        slots_check(*g.b, sth.shape[0], "kda_scan");
        PG_CHECK(shape_numel(in(gt, 1).shape) >= gt.p.n_head, "A_log has {} values for {} heads", shape_numel(in(gt, 1).shape),
                 gt.p.n_head);
        PG_CHECK(shape_numel(in(gt, 2).shape) == gt.p.n_head * Kh, "dt_bias has {} values for {} channels",
                 shape_numel(in(gt, 2).shape), gt.p.n_head * Kh);
        cuda::kda_decode_args a;
        a.H = int(sc.p.n_head);
        a.K = a.V = int(Kh);
        a.W = 4;
        float * cst[3];
        const float * cx[3];
        dweight cw[3];
        for (int q = 0; q < 3; ++q) {
            const node & cv = g.nodes[size_t(kf.conv[q])];
            const tensor & cs = state_host(g, cv, 2);
            const int64_t C = in(cv, 0).shape.at(1);
            PG_CHECK(cs.shape.size() == 3 && cs.shape[1] == C && cs.shape[2] == 3, "conv state {} for {} channels, width 4",
                     shape_str(cs.shape), C);
            PG_CHECK(g.b->n_tokens() == in(cv, 0).shape.at(0), "batch has {} tokens, input {}", g.b->n_tokens(),
                     in(cv, 0).shape.at(0));
            slots_check(*g.b, cs.shape[0], "short_conv");
            cst[q] = state_in(g, cv, 2);
            cx[q] = f32_in(cv, 0);
            cw[q] = w_in(cv, 1);
        }
        a.q = cx[0], a.k = cx[1], a.v = cx[2];
        a.conv_q = cw[0], a.conv_k = cw[1], a.conv_v = cw[2];
        a.conv_state_q = cst[0], a.conv_state_k = cst[1], a.conv_state_v = cst[2];
        // a folded low-rank projection: its input [T, R], its BF16 weight, R
        auto lowrank = [&](int lin, const float *& x, const void *& w, int & R) {
            const node & l = g.nodes[size_t(lin)];
            x = f32_in(l, 0);
            w = in(l, 1).p;
            R = int(in(l, 1).shape.at(1));
        };
        if (kf.f_b >= 0) lowrank(kf.f_b, a.fa, a.f_b, a.Rf);
        else a.f = f32_in(gt, 0);
        a.a_log = w_in(gt, 1);
        a.dt_bias = w_in(gt, 2);
        a.lower_bound = gt.p.gate_lower_bound;
        a.beta = f32_in(sc, 4);
        if (kf.g_b >= 0) lowrank(kf.g_b, a.ga, a.g_b, a.Rg);
        else a.z = f32_in(nn, 1);
        a.o_norm = w_in(nn, 2);
        a.l2_eps = g.nodes[size_t(kf.l2[0])].p.eps;
        PG_CHECK(g.nodes[size_t(kf.l2[1])].p.eps == a.l2_eps, "fused KDA: q and k L2 norms with different eps");
        a.norm_eps = nn.p.eps;
        a.scale = sc.p.scale;
        a.state = state_in(g, sc, 5);
        a.y_q = outp(kf.conv[0]);
        a.y_k = outp(kf.conv[1]);
        a.y_v = outp(kf.conv[2]);
        a.y_qn = outp(kf.l2[0]);
        a.y_kn = outp(kf.l2[1]);
        if (kf.f_b >= 0) a.y_f = outp(kf.f_b);
        a.y_g = outp(kf.gate);
        if (kf.g_b >= 0) a.y_z = outp(kf.g_b);
        a.y_o = outp(kf.scan);
        a.y_on = static_cast<float *>(outs_[size_t(id)].at(0).p);
        PG_CHECK(cuda::kda_decode_fused_supported(a), "fused KDA decode at '{}': unsupported layout or alignment", nn.name);
        const cuda_fuse::seg & os = fplan_.kda_oproj[size_t(id)];
        if (os.linear < 0) {
            PG_CUDA_CHECK(cuda::launch_kda_decode_fused(a, db_, st_));
        } else {   // kda_oproj_fused: the o_proj LINEAR and its epilogue ADDs in the same (persistent) launch
            const node & l = g.nodes[size_t(os.linear)];
            if (outs_[size_t(l.src[1].node)].empty()) run_node(g, l.src[1].node);   // the weight, bound on demand
            const dtensor & w = in(l, 1);
            PG_CHECK(w.type == dtype::BF16 && w.shape.size() == 2 && w.shape[1] == a.H * a.V, "{}: o_proj weight {} {} for {} inputs",
                     l.name, dtype_name(w.type), shape_str(w.shape), a.H * a.V);
            PG_CHECK(g.b->n_seq() == 1 && g.b->n_tokens() == 1, "{}: the tail + o_proj launch takes one token of one sequence, "
                     "not {} tokens of {}", l.name, g.b->n_tokens(), g.b->n_seq());
            PG_CHECK(kda_oproj_sync_ && err_slot_[size_t(id)] >= 0, "{}: kda_oproj_fused planned without its counters", l.name);
            cuda::kda_oproj_args o;
            o.w = w.p;
            o.D = w.shape[0];
            o.y = outp(os.linear);
            const float ** res[2] = {&o.res0, &o.res1};
            float ** z[2] = {&o.z0, &o.z1};
            for (int k = 0; k < 2 && os.add[k] >= 0; ++k) {
                PG_CHECK(!outs_[size_t(os.res[k].node)].empty(), "fused ADD '{}': residual '{}' is not computed yet",
                         g.nodes[size_t(os.add[k])].name, g.at(os.res[k]).name);
                *res[k] = static_cast<const float *>(outs_[size_t(os.res[k].node)].at(size_t(os.res[k].out)).p);
                *z[k] = outp(os.add[k]);
                ++n_fused_adds_;
            }
            o.sync = kda_oproj_sync_;
            o.err = err_ + err_slot_[size_t(id)] * cuda::ERR_COUNT;
            PG_CHECK(cuda::kda_oproj_fused_supported(a, o), "{}: the tail + o_proj launch does not take {} heads of {} x {}, "
                     "{} rows", l.name, a.H, a.K, a.V, o.D);
            PG_CUDA_CHECK(cuda::launch_kda_oproj_fused(a, o, db_, st_, (opt_.gemv_evict_first ? 1000 : 0) +
                                                                 (opt_.persistent_test_timeout ? 9 : 0)));
            ++n_kda_oproj_;
        }
        ++n_kda_fused_;
    }

    // MOE_EXPERTS node `id` (outputs allocated) with the shared expert the plan folds into it as slot k
    // (moe_shared_slot): the BF16 decode pair writes y, the shared gate/up/GLU/down outputs, the ADD and the chained ADD.
    // The planner allowed it only where the pair runs; anything else here is an error, never another kernel.
    void run_moe_shared(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        const cuda_fuse::moe_shared_fold & f = fplan_.moe_shared[size_t(id)];
        // moe_layer_fused: the norm and the route are this node's input producers (src 0 and src 1 / 2)
        const bool layer = !fplan_.moe_layer.empty() && fplan_.moe_layer[size_t(id)];
        const int ml_norm = layer ? n.src.at(0).node : -1, ml_route = layer ? n.src.at(1).node : -1;
        auto alloc_outs = [&](int j) {   // a folded node's outputs (its own position launched nothing)
            auto & o = outs_[size_t(j)];
            PG_CHECK(o.empty(), "folded node '{}' already has outputs", g.nodes[size_t(j)].name);
            for (const auto & oo : g.nodes[size_t(j)].outs) o.push_back(new_out(oo.type, oo.shape));
            for (const auto & d : o)
                PG_CHECK(reinterpret_cast<uintptr_t>(d.p) % 16 == 0, "'{}': output not 16-byte aligned", g.nodes[size_t(j)].name);
        };
        if (layer) {   // the norm's and the route's outputs are this launch's too (read below as inputs)
            alloc_outs(ml_norm);
            alloc_outs(ml_route);
        }
        const dtensor & x = in(n, 0);
        const dtensor & idt = in(n, 1);
        PG_CHECK(x.shape.size() == 2 && x.shape[0] == 1 && in(n, 2).shape == idt.shape && idt.shape.size() == 2 &&
                     idt.shape[0] == 1,
                 "{}: shared slot for x {} / ids {} (one token only)", n.name, shape_str(x.shape), shape_str(idt.shape));
        const auto & ex = *n.p.experts;
        const int64_t Din = x.shape[1], k = idt.shape[1], F = ex[0].gate.out, Dout = n.outs.at(0).shape.at(1);
        const cuda::dexpert * table = expert_table(n);
        PG_CHECK(opt_.moe_grouped && opt_.moe_decode_bf16 && expert_fmt_.at(n.p.experts.get()).vfmt == 1 && int64_t(ex.size()) <= 1024,
                 "{}: the shared slot needs the grouped BF16 decode experts", n.name);
        auto outp = [&](int j) {
            alloc_outs(j);
            return static_cast<float *>(outs_[size_t(j)].at(0).p);
        };
        auto dense = [&](int lin) {   // the shared LINEAR's BF16 weight (bound here: its WEIGHT node comes later)
            const node & l = g.nodes[size_t(lin)];
            if (outs_[size_t(l.src[1].node)].empty()) run_node(g, l.src[1].node);
            const dtensor & w = in(l, 1);
            PG_CHECK(w.type == dtype::BF16 && w.shape.size() == 2, "shared-slot LINEAR '{}': weight {} {}", l.name,
                     dtype_name(w.type), shape_str(w.shape));
            cuda::dexpert_matrix m;
            m.w = w.p;
            m.type = cuda::wtype::BF16;
            m.out = w.shape[0];
            m.in = w.shape[1];
            return m;
        };
        cuda::dmoe_shared sh;
        sh.w.gate = dense(f.gate);
        sh.w.up = dense(f.up);
        sh.w.down = dense(f.down);
        sh.gate = outp(f.gate);
        sh.up = outp(f.up);
        sh.act = outp(f.act);
        sh.down = outp(f.down);
        sh.sum = outp(f.add);
        sh.prefetch = opt_.moe_shared_prefetch;
        if (f.add2 >= 0) {
            PG_CHECK(!outs_[size_t(f.res2.node)].empty(), "shared slot: residual '{}' is not computed yet", g.at(f.res2).name);
            sh.res = static_cast<const float *>(outs_[size_t(f.res2.node)].at(size_t(f.res2.out)).p);
            sh.sum2 = outp(f.add2);
        }
        const cuda::dexperts_cfg c{n.p.act == glu_act::SITU ? 1 : 0, n.p.situ_beta, n.p.situ_linear_beta, F, Dout};
        int * err = err_ + err_slot_[size_t(id)] * cuda::ERR_COUNT;
        float * hbuf = static_cast<float *>(alloc(size_t(k * F) * 4));
        if (layer) {
            run_moe_layer(g, id, table, int64_t(ex.size()), c, sh, hbuf, err);
            return;
        }
        PG_CUDA_CHECK(cuda::launch_moe_bf16_decode_shared(f32_in(n, 0), Din, i32_in(n, 1), f32_in(n, 2), k, table, int64_t(ex.size()),
                                                          c, sh, hbuf, static_cast<float *>(outs_[size_t(id)].at(0).p), err, st_,
                                                          100 * opt_.moe_bf16_early + (opt_.moe_bf16_evict_first ? 1000 : 0)));
        ++n_moe_shared_;
    }

    // The MoE block at MOE_EXPERTS node `id` as one persistent launch (moe_layer_fused): the norm and route nodes producing
    // its inputs (outputs allocated by run_moe_shared) and the experts with the shared slot `sh`. The planner allowed it
    // only for the kernel's shapes; anything else here is an error, never another kernel.
    void run_moe_layer(const graph & g, int id, const cuda::dexpert * table, int64_t E, const cuda::dexperts_cfg & c,
                       const cuda::dmoe_shared & sh, float * hbuf, int * err) {
        const node & n = g.nodes[size_t(id)];
        const int ml_norm = n.src.at(0).node, ml_route = n.src.at(1).node;
        const node & nn = g.nodes[size_t(ml_norm)];
        const node & rn = g.nodes[size_t(ml_route)];
        auto bind = [&](const node & u, size_t i) {   // a WEIGHT input (bound on demand, as the shared slot's)
            if (i < u.src.size() && u.src[i].valid() && outs_[size_t(u.src[i].node)].empty()) run_node(g, u.src[i].node);
        };
        bind(nn, 1);
        bind(rn, 1);
        bind(rn, 2);
        PG_CHECK(moe_layer_sync_, "{}: moe_layer_fused planned without its counters", n.name);
        cuda::dmoe_layer p;
        p.x = f32_in(nn, 0);
        p.norm_w = w_in(nn, 1);
        p.eps = nn.p.eps;
        const dtensor & gw = in(rn, 1);
        PG_CHECK(gw.type == dtype::BF16 && gw.shape.size() == 2 && gw.shape[0] == E, "{}: router {} {} for {} experts", rn.name,
                 dtype_name(gw.type), shape_str(gw.shape), E);
        p.router = gw.p;
        p.bias = w_in(rn, 2);
        p.rc = cuda::droute{E, rn.p.topk, rn.p.n_group, rn.p.topk_group, rn.p.renormalize, rn.p.scale,
                            rn.p.router == router_act::SOFTMAX ? 1 : 0};
        p.experts = table;
        p.E = E;
        p.c = c;
        p.sh = sh;
        p.h = static_cast<float *>(outs_[size_t(ml_norm)].at(0).p);
        p.ids = static_cast<int32_t *>(outs_[size_t(ml_route)].at(0).p);
        p.w = static_cast<float *>(outs_[size_t(ml_route)].at(1).p);
        p.logits = static_cast<float *>(alloc(size_t(E) * 4));
        p.hbuf = hbuf;
        p.y = static_cast<float *>(outs_[size_t(id)].at(0).p);
        p.sync = moe_layer_sync_;
        p.err = err;
        PG_CHECK(cuda::moe_layer_decode_supported(sh.w.gate.in, c.d_ff, E, p.rc.topk, p.rc),
                 "{}: the one-launch MoE block does not take D {} d_ff {} top-{} of {}", n.name, sh.w.gate.in, c.d_ff, p.rc.topk, E);
        PG_CUDA_CHECK(cuda::launch_moe_layer_decode(p, st_, (opt_.moe_bf16_evict_first ? 1000 : 0) +
                                                                (opt_.persistent_test_timeout ? 9 : 0)));
        ++n_moe_shared_;
        ++n_moe_layer_;
    }

    // COLS node `id` (outputs allocated), the RMS_NORM over it and the rope COLS the plan folds into it: one launch.
    void run_mla_kv_split(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        const int rn = fplan_.mla_kv_norm[size_t(id)], rc = fplan_.mla_kv_rope[size_t(id)];
        const dtensor & x = in(n, 0);
        const int64_t W = x.shape.at(1), L = n.p.n;
        PG_CHECK(L > 0 && L < W && fplan_.mla_kv_rope[size_t(id)] >= 0, "{}: kv_a split of {} columns from {}", n.name, L, W);
        for (int j : {rn, rc}) {
            auto & mo = outs_[size_t(j)];
            PG_CHECK(mo.empty(), "fused node '{}' already has outputs", g.nodes[size_t(j)].name);
            for (const auto & oo : g.nodes[size_t(j)].outs) mo.push_back(new_out(oo.type, oo.shape));
        }
        const node & nm = g.nodes[size_t(rn)];
        const bool has_w = nm.src.size() > 1 && nm.src[1].valid();
        if (has_w && outs_[size_t(nm.src[1].node)].empty()) run_node(g, nm.src[1].node);   // bound on demand
        const dweight w = has_w ? w_in(nm, 1) : dweight{};
        PG_CUDA_CHECK(cuda::launch_mla_kv_split(f32_in(n, 0), x.shape.at(0), W, L, w, nm.p.eps,
                                                static_cast<float *>(outs_[size_t(id)].at(0).p),
                                                static_cast<float *>(outs_[size_t(rn)].at(0).p),
                                                static_cast<float *>(outs_[size_t(rc)].at(0).p), st_));
    }

    void run_linear(const node & n, float * y) {
        const dtensor & x = in(n, 0);
        const dtensor & w = in(n, 1);
        const int64_t T = x.shape.at(0), K = x.shape.at(1), O = w.shape.at(0);
        PG_CHECK(w.shape.size() == 2 && w.shape[1] == K, "weight {} for input {}", shape_str(w.shape), shape_str(x.shape));
        const dweight W = w_in(n, 1);
        const bool gemv = cuda_fuse::gemv_takes(opt_, T, K, W.type == wtype::F16);
        const float * xin = f32_in(n, 0);
        // op_params::bf16_inputs: x rounded to bf16 first. BF16 weights off the GEMV path take it as the one-pass GEMM's
        // operand below (the same rounding); every other path reads a rounded fp32 copy.
        if (n.p.bf16_inputs && (gemv || W.type != wtype::BF16)) {
            auto * xr = static_cast<float *>(node_scratch(size_t(T * K) * 4));
            PG_CUDA_CHECK(cuda::launch_f32_round_bf16(xin, T * K, xr, st_));
            xin = xr;
        }
        if (gemv) {
            PG_CUDA_CHECK(cuda::launch_linear_gemv(xin, T, K, W, O, y, st_, gemv_cfg_for(K)));
            return;
        }
        if (W.type != wtype::BF16) {   // F32 weights: fp32 GEMM
            lt_matmul(W.data, xin, CUDA_R_32F, y, O, T, K, 0.0f);
            return;
        }
        // BF16 weights: activations to bf16 for the tensor cores, fp32 accumulation; optionally hi + lo split (never for
        // bf16 inputs: their lo part is 0).
        const bool split = opt_.linear_split_bf16 && !n.p.bf16_inputs;
        if (!split && n.p.bf16_inputs && opt_.linear_bf16_share_x) {
            lt_matmul(W.data, shared_bf16_x(n, T * K), CUDA_R_16BF, y, O, T, K, 0.0f);
            return;
        }
        auto * xb = static_cast<uint16_t *>(node_scratch(size_t(T * K) * 2 * (split ? 2 : 1)));
        if (!split) {
            PG_CUDA_CHECK(cuda::launch_f32_to_bf16(f32_in(n, 0), T * K, xb, st_));
            lt_matmul(W.data, xb, CUDA_R_16BF, y, O, T, K, 0.0f);
            return;
        }
        PG_CUDA_CHECK(cuda::launch_f32_to_bf16_split(f32_in(n, 0), T * K, xb, xb + T * K, st_));
        if (T <= opt_.linear_split_stacked) {   // hi rows then lo rows: one GEMM of 2T columns, the weights read once
            auto * d = static_cast<float *>(node_scratch(size_t(2 * T * O) * 4));
            lt_matmul(W.data, xb, CUDA_R_16BF, d, O, 2 * T, K, 0.0f);
            PG_CUDA_CHECK(cuda::launch_elementwise(cuda::ew_op::ADD, d, d + T * O, T * O, {}, y, st_));
            ++n_linear_stacked_;
            return;
        }
        lt_matmul(W.data, xb, CUDA_R_16BF, y, O, T, K, 0.0f);
        lt_matmul(W.data, xb + T * K, CUDA_R_16BF, y, O, T, K, 1.0f);
    }

    // linear_bf16_share_x: x of LINEAR n (count elements) as bf16, converted by the first flagged LINEAR that reads this
    // node output and reused by the ones right after it. The copy lives until another input replaces it or the step
    // ends (alloc, not node_scratch: the next LINEAR reads it); a replaced copy is freed in stream order when this eager
    // run releases memory (a captured step's arena keeps it).
    const void * shared_bf16_x(const node & n, int64_t count) {
        const node_ref src = n.src.at(0);
        if (shared_x_.p && shared_x_.src.node == src.node && shared_x_.src.out == src.out && shared_x_.n == count) {
            ++n_linear_shared_x_;
            return shared_x_.p;
        }
        if (shared_x_.p && release_on_ && !arena_on_) {
            cudaFreeAsync(shared_x_.p, st_);
            run_allocs_.erase(shared_x_.p);
        }
        shared_x_ = {src, count, alloc(size_t(count) * 2)};
        PG_CUDA_CHECK(cuda::launch_f32_to_bf16(f32_in(n, 0), count, static_cast<uint16_t *>(shared_x_.p), st_));
        return shared_x_.p;
    }

    // D [N cols of M] (col-major, ld M) = A^T B: A = W [M rows of K] row-major, B = x [N rows of K] row-major.
    void lt_matmul(const void * A, const void * B, cudaDataType_t ab, float * D, int64_t M, int64_t N, int64_t K, float beta) {
        const auto key = std::make_tuple(M, N, K, int(ab));
        auto it = plans_.find(key);
        if (it == plans_.end()) {
            plan p;
            PG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            PG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
            PG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
            PG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, ab, uint64_t(K), uint64_t(M), K));
            PG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, ab, uint64_t(K), uint64_t(N), K));
            PG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_32F, uint64_t(M), uint64_t(N), M));
            cublasLtMatmulPreference_t pref;
            PG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
            const size_t ws = k_lt_ws;
            PG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
            int found = 0;
            PG_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.d, p.d, pref, 1, &p.heur, &found));
            cublasLtMatmulPreferenceDestroy(pref);
            PG_CHECK(found > 0, "cuBLASLt has no algorithm for [{} x {}] x [{} x {}] ({})", N, K, K, M,
                     ab == CUDA_R_16BF ? "bf16" : "f32");
            it = plans_.emplace(key, p).first;
        }
        const float alpha = 1.0f;
        const plan & p = it->second;
        PG_CUBLAS_CHECK(cublasLtMatmul(lt_, p.desc, &alpha, A, p.a, B, p.b, &beta, D, p.d, D, p.d, &p.heur.algo, lt_ws_,
                                       k_lt_ws, st_));
    }

    // The device table of one MOE_EXPERTS node's experts (uploaded once per experts vector).
    const cuda::dexpert * expert_table(const node & n) {
        const auto * key = n.p.experts.get();
        auto it = expert_tables_.find(key);
        if (it != expert_tables_.end()) return static_cast<const cuda::dexpert *>(it->second);
        const auto & ex = *n.p.experts;
        std::vector<cuda::dexpert> h(ex.size());
        int smax = 0;   // the largest FP4 scale byte of the node's experts (expert_fmt::shift_ok)
        for (size_t e = 0; e < ex.size(); ++e) {
            h[e].gate = expert_matrix_dev(ex[e].gate, fmt::format("{}: expert {} gate", n.name, e), smax);
            h[e].up = expert_matrix_dev(ex[e].up, fmt::format("{}: expert {} up", n.name, e), smax);
            h[e].down = expert_matrix_dev(ex[e].down, fmt::format("{}: expert {} down", n.name, e), smax);
            PG_CHECK(ex[e].up.out == ex[e].gate.out && ex[e].up.in == ex[e].gate.in && ex[e].down.in == ex[e].gate.out,
                     "{}: expert {} shapes do not chain", n.name, e);
        }
        // The grouped kernels' format: one format for all experts, widths that tile 16-byte units.
        int vfmt = 0;
        {
            auto fmt_of = [](const expert_matrix & m) {
                if (m.format == fp4_format::MXFP4) return 2;
                if (m.format == fp4_format::NVFP4) return 3;
                return m.weight && m.weight->type == dtype::BF16 ? 1 : 0;
            };
            vfmt = fmt_of(ex[0].gate);
            for (size_t e = 0; e < ex.size() && vfmt > 0; ++e)
                for (const expert_matrix * m : {&ex[e].gate, &ex[e].up, &ex[e].down})
                    if (fmt_of(*m) != vfmt) vfmt = 0;
            const int64_t C = vfmt == 1 ? 8 : 32;
            if (vfmt > 0 && (ex[0].gate.in % C != 0 || ex[0].gate.out % C != 0)) vfmt = 0;
        }
        expert_fmt_[key] = {vfmt, vfmt == 2 && smax <= int(cuda::fp4_shift_max_scale)};
        void * d = nullptr;
        PG_CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(cuda::dexpert)));
        upload(d, h.data(), h.size() * sizeof(cuda::dexpert));
        expert_tables_[key] = d;
        return static_cast<const cuda::dexpert *>(d);
    }
    // smax: raised to the largest scale byte of an FP4 matrix (host bytes: scanned here; generated ones: their range).
    cuda::dexpert_matrix expert_matrix_dev(const expert_matrix & m, const std::string & what, int & smax) {
        cuda::dexpert_matrix d;
        d.out = m.out;
        d.in = m.in;
        PG_CHECK(m.out > 0 && m.in > 0, "{}: empty shape [{}, {}]", what, m.out, m.in);
        if (m.format == fp4_format::NONE) {
            PG_CHECK(m.weight != nullptr, "{}: dense matrix without a weight", what);
            PG_CHECK(is_wdtype(m.weight->type), "{}: unsupported expert weight dtype: {}", what, dtype_name(m.weight->type));
            PG_CHECK(m.weight->numel() == m.out * m.in, "{}: weight {} for [{}, {}]", what, shape_str(m.weight->shape), m.out,
                     m.in);
            d.w = weight_dev(*m.weight);
            PG_CHECK(reinterpret_cast<uintptr_t>(d.w) % 16 == 0, "{}: device weight not 16-byte aligned", what);
            d.type = wtype_of(m.weight->type, what);
            return d;
        }
        const bool mx = m.format == fp4_format::MXFP4;
        const int64_t blk = mx ? 32 : 16;
        PG_CHECK(m.packed != nullptr && m.scale != nullptr, "{}: FP4 matrix without packed/scale", what);
        PG_CHECK(m.in % blk == 0, "{}: unsupported {} input width: {} (multiple of {})", what, mx ? "MXFP4" : "NVFP4", m.in, blk);
        PG_CHECK(m.packed->nbytes >= size_t(m.out * m.in / 2), "{}: packed {} for [{}, {}]", what, shape_str(m.packed->shape),
                 m.out, m.in);
        PG_CHECK(m.scale->nbytes >= size_t(m.out * (m.in / blk)), "{}: scale {} for [{}, {}]", what, shape_str(m.scale->shape),
                 m.out, m.in);
        const auto * sb = m.scale->as<uint8_t>();
        const auto gen = generated_.find(m.scale->data);
        for (int64_t i = 0; gen == generated_.end() && i < m.out * (m.in / blk); ++i) {
            const bool nan = mx ? sb[i] == 0xFF : (sb[i] & 0x7F) == 0x7F;
            PG_CHECK(!nan, "{}: NaN scale byte 0x{:02X} at row {} block {}", what, sb[i], i / (m.in / blk), i % (m.in / blk));
            smax = std::max(smax, int(sb[i]));
        }
        if (gen != generated_.end()) smax = std::max(smax, gen->second < 0 ? 255 : gen->second);   // not bytes: no shift form
        d.packed = static_cast<const uint8_t *>(weight_dev(*m.packed));
        d.scale = static_cast<const uint8_t *>(weight_dev(*m.scale));
        PG_CHECK(reinterpret_cast<uintptr_t>(d.packed) % 16 == 0 && reinterpret_cast<uintptr_t>(d.scale) % 16 == 0,
                 "{}: device packed/scale not 16-byte aligned (the expert kernels' 16-byte copies)", what);
        d.fmt = mx ? 1 : 2;
        d.global_scale = m.global_scale;
        return d;
    }

    struct plan {
        cublasLtMatmulDesc_t desc{};
        cublasLtMatrixLayout_t a{}, b{}, d{};
        cublasLtMatmulHeuristicResult_t heur{};
    };

    int dev_;
    cuda_options opt_;
    std::string name_;
    cudaStream_t st_ = nullptr;
    cublasLtHandle_t lt_ = nullptr;
    void * lt_ws_ = nullptr;
    unsigned * kda_oproj_sync_ = nullptr;   // the KDA tail + o_proj launch's 2 counters (kda_oproj_fused; self-resetting)
    unsigned * moe_layer_sync_ = nullptr;   // the one-launch MoE block's 3 counters (moe_layer_fused; self-resetting)
    unsigned * route_ctr_ = nullptr;   // the fused T == 1 route's last-block counter (route-select.cu; self-resetting)
    // The tensor-core GEMV's scratch (cuda::gemv_cfg::mma_part / mma_ctr): split-K partials of at most ~2 x the resident
    // warps' items (2 x 132 SMs x 2 blocks x 8 warps x 256 floats = 4.3 MB on the H200) and one counter per 32-row group.
    static constexpr int64_t k_mma_part_floats = int64_t(2) << 20;   // 8 MB
    static constexpr int64_t k_mma_ctr_n = 16384;
    float * mma_part_ = nullptr;
    unsigned * mma_ctr_ = nullptr;
    std::map<std::tuple<int64_t, int64_t, int64_t, int>, plan> plans_;
    std::unordered_map<const void *, void *> weights_;          // host data pointer -> device copy
    std::unordered_map<tensor *, void *> states_;               // host STATE tensor -> device-resident copy
    std::unordered_map<const void *, void *> expert_tables_;    // experts vector -> device dexpert[E]
    size_t weight_bytes_ = 0;
    // weight_generate keys (host bytes never read) -> the largest byte generated (byte tensors), else -1
    std::unordered_map<const void *, int> generated_;
    struct expert_fmt {
        int vfmt = 0;            // grouped kernel format (0: none)
        bool shift_ok = false;   // MXFP4 with every scale byte <= cuda::fp4_shift_max_scale (v4's shift form may run)
    };
    std::unordered_map<const void *, expert_fmt> expert_fmt_;   // experts vector -> its formats
    // CUDA graph of one step (capture/replay) and the arena its outputs live in.
    cudaGraphExec_t exec_ = nullptr;
    const graph * cap_g_ = nullptr;
    int cap_n_err_ = 0;
    void * arena_ = nullptr;
    size_t arena_size_ = 0, arena_off_ = 0, run_bytes_ = 0;
    bool arena_on_ = false;
    std::vector<cudaEvent_t> events_;
    size_t prof_nodes_ = 0;   // profile_nodes: one before the first node and one after each node
    std::vector<std::vector<dtensor>> outs_;
    std::unordered_set<void *> run_allocs_;
    std::vector<void *> node_temps_;                // node_scratch of the node being run (release on)
    bool release_on_ = false;                       // this eager run releases dead outputs (plan_release)
    std::vector<std::vector<int>> release_at_;      // per position: the nodes whose outputs die after its launch
    std::vector<char> released_;                    // per node: its outputs were released in the last run
    std::vector<int> err_slot_;
    cuda_fuse::plan fplan_;                      // fused launches of the current run (fuse-plan.h)
    std::vector<const float *> fnorm_w_;         // per folded RMS_NORM: its weight as F32 on the device (or nullptr)
    std::unordered_map<const void *, float *> norm_w32_;   // device weight -> its F32 copy (non-F32 norm weights)
    int n_grouped_ = 0, n_fused_norms_ = 0, n_fused_adds_ = 0, n_norm_staged_ = 0, n_conv_l2_ = 0, n_fused_sig_ = 0;
    int n_fused_routes_ = 0;
    int n_linear_stacked_ = 0;
    int n_linear_shared_x_ = 0;
    // linear_bf16_share_x: the bf16 copy of the last input a flagged BF16 LINEAR converted (its node output and size).
    struct shared_x {
        node_ref src;
        int64_t n = 0;
        void * p = nullptr;
    } shared_x_;
    std::vector<float *> route_logits_;   // per MOE_ROUTE node: logits computed by a norm's launch this run (fuse_norm_route)
    int n_kda_fused_ = 0;
    int n_moe_shared_ = 0;
    int n_moe_layer_ = 0;
    int n_kda_oproj_ = 0;
    int n_side_prefetch_ = 0;
    // The side prefetch's bookkeeping while a capture runs with it (capture_nodes): the weight ranges the current node's
    // launches read, logged by in() for inputs produced by WEIGHT nodes (is_weight_node_).
    mutable std::vector<cuda_side::range> * reads_log_ = nullptr;
    std::vector<char> is_weight_node_;
    int * err_ = nullptr;
    std::vector<int32_t> host_batch_;
    cuda::dbatch db_;
    const int32_t * ids_dev_ = nullptr;
    std::pair<int, int> corrupt_{-1, -1};
    // graph_decode: captured decode steps, and the layouts seen once (key -> bytes their eager step allocated)
    std::vector<graph_entry> graph_entries_;
    std::unordered_map<uint64_t, size_t> seen_bytes_;
    uint64_t graph_clock_ = 0;
    bool in_capture_ = false;   // capture() / capture_entry(): run() and run_node() must not start another capture
    int n_graph_captures_ = 0, n_graph_replays_ = 0;
    bool skip_upload_next_ = false;
};

} // namespace

std::unique_ptr<backend_cuda> backend_cuda_init(int device, const cuda_options & opt) {
    return std::make_unique<cuda_backend>(device, opt);
}

} // namespace perigee
