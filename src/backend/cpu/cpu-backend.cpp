// The CPU reference backend: one dispatch switch over op_type, one file per op family.
// Outputs are host tensors (F32, or I32 for ids/selections) allocated per node; WEIGHT leaves are
// read in place through node.leaf; STATE leaves are updated in place through node.state.
#include "backend/backend.h"
#include "backend/cpu/cpu-ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace perigee {

// ---- sampling (backend.h row_sampling): the host sampler's step 3, moved here unchanged ----

int32_t sample_row_reference(const float * l, int64_t V, const row_sampling & sp) {
    PG_CHECK(V > 0, "sample_row_reference: empty logits row");
    if (sp.temperature == 0.0f) {
        int64_t best = 0;
        for (int64_t i = 1; i < V; ++i)
            if (l[i] > l[best]) best = i;
        return int32_t(best);
    }
    std::vector<int32_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    int64_t n = V;
    if (sp.top_k > 0 && sp.top_k < V) {
        n = sp.top_k;
        std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), better);
    } else {
        std::sort(idx.begin(), idx.end(), better);
    }
    const double inv_t = 1.0 / double(sp.temperature);
    const double mx = double(l[idx[0]]) * inv_t;
    std::vector<double> p(static_cast<size_t>(n));
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += p[size_t(i)] = std::exp(double(l[idx[size_t(i)]]) * inv_t - mx);
    for (auto & x : p) x /= sum;
    if (sp.top_p < 1.0f) {
        double c = 0.0;
        int64_t keep = n;
        for (int64_t i = 0; i < n; ++i) {
            c += p[size_t(i)];
            if (c >= double(sp.top_p)) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (sp.min_p > 0.0f) {
        const double floor = double(sp.min_p) * p[0];
        int64_t keep = 1;
        while (keep < n && p[size_t(keep)] >= floor) ++keep;
        n = keep;
    }
    double mass = 0.0;
    for (int64_t i = 0; i < n; ++i) mass += p[size_t(i)];
    const double u = sp.u * mass;
    double c = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        c += p[size_t(i)];
        if (u < c) return idx[size_t(i)];
    }
    return idx[size_t(n - 1)];
}

// ---- cpu_node_io ----

const float * cpu_node_io::f32_in(size_t i) const {
    const tensor * t = in.at(i);
    PG_CHECK(t != nullptr, "{} ({}): input {} is missing", n().name, op_name(n().op), i);
    PG_CHECK(t->type == dtype::F32, "{} ({}): unsupported input {} dtype: {} (activations are F32)", n().name,
             op_name(n().op), i, dtype_name(t->type));
    return t->as<float>();
}

const int32_t * cpu_node_io::i32_in(size_t i) const {
    const tensor * t = in.at(i);
    PG_CHECK(t != nullptr, "{} ({}): input {} is missing", n().name, op_name(n().op), i);
    PG_CHECK(t->type == dtype::I32, "{} ({}): unsupported input {} dtype: {} (expected I32)", n().name,
             op_name(n().op), i, dtype_name(t->type));
    return t->as<int32_t>();
}

wview cpu_node_io::weight_in(size_t i) const {
    const tensor * t = in.at(i);
    if (t == nullptr) return {};
    wview w = wview_of(*t);
    PG_CHECK(t->type == dtype::F32 || t->type == dtype::BF16 || t->type == dtype::F16 || t->type == dtype::F64,
             "{} ({}): unsupported weight dtype: {} (input {})", n().name, op_name(n().op), dtype_name(t->type), i);
    return w;
}

tensor & cpu_node_io::state_in(size_t i) const {
    const node_ref r = n().src.at(i);
    const node & s = g.at(r);
    PG_CHECK(s.op == op_type::STATE && s.state != nullptr, "{} ({}): input {} must be a STATE leaf, got {} ({})",
             n().name, op_name(n().op), i, s.name, op_name(s.op));
    return *s.state;
}

namespace {

enum class slot_kind { ACT, IDS, W_ANY, W_F32_BF16, STATE_F32, OPT_W_F32_BF16 };

struct slot_rule { size_t src; slot_kind kind; };

// Which inputs are activations, ids, weights (and which weight dtypes) or states, per op.
std::vector<slot_rule> input_rules(const node & n) {
    using K = slot_kind;
    switch (n.op) {
        case op_type::IDS:
        case op_type::WEIGHT:
        case op_type::STATE: return {};
        case op_type::GET_ROWS: return {{0, K::W_ANY}, {1, K::IDS}};
        case op_type::RMS_NORM: return {{0, K::ACT}, {1, K::OPT_W_F32_BF16}};
        case op_type::LAYER_NORM: return {{0, K::ACT}, {1, K::W_F32_BF16}, {2, K::W_F32_BF16}};
        case op_type::L2_NORM: return {{0, K::ACT}};
        case op_type::LINEAR: return {{0, K::ACT}, {1, K::W_ANY}};
        case op_type::ADD:
        case op_type::MUL:
        case op_type::SILU_MUL:
        case op_type::SITU_MUL: return {{0, K::ACT}, {1, K::ACT}};
        case op_type::SCALE:
        case op_type::SIGMOID:
        case op_type::COLS: return {{0, K::ACT}};
        case op_type::SELECT_ROWS: return {{0, K::ACT}};
        case op_type::SHORT_CONV: return {{0, K::ACT}, {1, K::W_F32_BF16}, {2, K::STATE_F32}};
        case op_type::KDA_GATE: return {{0, K::ACT}, {1, K::W_F32_BF16}, {2, K::W_F32_BF16}};
        case op_type::KDA_SCAN:
            return {{0, K::ACT}, {1, K::ACT}, {2, K::ACT}, {3, K::ACT}, {4, K::ACT}, {5, K::STATE_F32}};
        case op_type::GATED_RMS_NORM: return {{0, K::ACT}, {1, K::ACT}, {2, K::W_F32_BF16}};
        case op_type::MLA_ATTN: {
            std::vector<slot_rule> r = {{0, K::ACT}, {1, K::ACT}, {2, K::ACT}, {3, K::W_ANY}, {4, K::STATE_F32}};
            if (n.src.size() > 5 && n.src[5].valid()) r.push_back({5, K::IDS});
            return r;
        }
        case op_type::INDEXER_TOPK: return {{0, K::ACT}, {1, K::ACT}, {2, K::ACT}, {3, K::STATE_F32}};
        case op_type::MOE_ROUTE: return {{0, K::ACT}, {1, K::W_ANY}, {2, K::OPT_W_F32_BF16}};
        case op_type::MOE_EXPERTS: return {{0, K::ACT}, {1, K::IDS}, {2, K::ACT}};
        case op_type::ATTN_RES_MIX: {
            std::vector<slot_rule> r;
            const size_t nc = n.src.size() - 2;
            for (size_t i = 0; i < nc; ++i) r.push_back({i, K::ACT});
            r.push_back({nc, K::W_F32_BF16});
            r.push_back({nc + 1, K::W_F32_BF16});
            return r;
        }
        case op_type::COUNT: break;
    }
    PG_FAIL("{}: unsupported op: {}", n.name, int(n.op));
}

// Throws "unsupported <what>: <value>" naming the node when the CPU backend cannot run it.
void check_node(const graph & g, int id) {
    const node & n = g.nodes[size_t(id)];
    const std::string who = fmt::format("node {} '{}' ({})", id, n.name, op_name(n.op));
    for (const auto & r : input_rules(n)) {
        const bool optional = r.kind == slot_kind::OPT_W_F32_BF16;
        PG_CHECK(r.src < n.src.size(), "{}: input {} is missing", who, r.src);
        const node_ref ref = n.src[r.src];
        if (!ref.valid()) {
            PG_CHECK(optional, "{}: input {} is missing", who, r.src);
            continue;
        }
        const dtype t = g.out(ref).type;
        switch (r.kind) {
            case slot_kind::ACT:
                PG_CHECK(t == dtype::F32, "{}: unsupported activation dtype: {} (input {})", who, dtype_name(t), r.src);
                break;
            case slot_kind::IDS:
                PG_CHECK(t == dtype::I32, "{}: unsupported ids dtype: {} (input {})", who, dtype_name(t), r.src);
                break;
            case slot_kind::W_ANY:
                PG_CHECK(t == dtype::F32 || t == dtype::BF16 || t == dtype::F16, "{}: unsupported weight dtype: {} (input {})",
                         who, dtype_name(t), r.src);
                break;
            case slot_kind::W_F32_BF16:
            case slot_kind::OPT_W_F32_BF16:
                PG_CHECK(t == dtype::F32 || t == dtype::BF16, "{}: unsupported weight dtype: {} (input {})", who,
                         dtype_name(t), r.src);
                break;
            case slot_kind::STATE_F32: {
                const node & s = g.at(ref);
                PG_CHECK(s.op == op_type::STATE && s.state != nullptr, "{}: input {} must be a STATE leaf, got '{}' ({})",
                         who, r.src, s.name, op_name(s.op));
                PG_CHECK(t == dtype::F32, "{}: unsupported state dtype: {} (input {})", who, dtype_name(t), r.src);
                break;
            }
        }
    }
    if (n.op == op_type::WEIGHT || n.op == op_type::STATE)
        PG_CHECK(n.leaf != nullptr, "{}: leaf without a tensor", who);
    if (n.op == op_type::IDS || n.op == op_type::SHORT_CONV || n.op == op_type::KDA_SCAN || n.op == op_type::MLA_ATTN ||
        n.op == op_type::INDEXER_TOPK)
        PG_CHECK(g.b != nullptr, "{}: the graph has no batch layout", who);
    if (n.op == op_type::MOE_EXPERTS) {
        PG_CHECK(n.p.experts && !n.p.experts->empty(), "{}: no experts", who);
        PG_CHECK(n.p.act == glu_act::SILU || n.p.act == glu_act::SITU, "{}: unsupported activation: {}", who, int(n.p.act));
    }
    if (n.op == op_type::MOE_ROUTE)
        PG_CHECK(n.p.router == router_act::SIGMOID || n.p.router == router_act::SOFTMAX, "{}: unsupported router: {}", who,
                 int(n.p.router));
    if (n.op == op_type::KDA_SCAN)
        PG_CHECK(n.p.chunk_size == 0 || n.p.chunk_size == 64, "{}: unsupported chunk size: {}", who, n.p.chunk_size);
}

tensor copy_tensor(const tensor & t) {
    tensor r = tensor_new(t.type, t.shape);
    if (t.nbytes) std::memcpy(r.data, t.data, t.nbytes);
    return r;
}

// Slot snapshots in host memory: one contiguous block of floats per snapshot, the slot's rows of
// every pool in list order (the byte layout the runtime's snapshot_store had before it moved here).
class cpu_slot_snapshots final : public slot_snapshots {
public:
    cpu_slot_snapshots(const std::vector<tensor *> & pools, int n) : pools_(pools), n_(n) {
        PG_CHECK(n >= 0, "slot_snapshots: {} snapshots", n);
        n_slots_ = slot_pools_check(pools, "slot_snapshots");
        for (const tensor * t : pools) per_ += t->nbytes / size_t(n_slots_);
        data_.assign(per_ / sizeof(float) * size_t(n), 0.0f);
    }
    int capacity() const override { return n_; }
    int64_t bytes_per_snapshot() const override { return int64_t(per_); }
    void save(int slot, int snap) override {
        check(slot, snap);
        char * dst = reinterpret_cast<char *>(data_.data()) + per_ * size_t(snap);
        for (const tensor * t : pools_) {
            const size_t row = t->nbytes / size_t(n_slots_);
            std::memcpy(dst, static_cast<const char *>(t->data) + row * size_t(slot), row);
            dst += row;
        }
    }
    void load(int snap, int slot) override {
        check(slot, snap);
        const char * src = reinterpret_cast<const char *>(data_.data()) + per_ * size_t(snap);
        for (tensor * t : pools_) {
            const size_t row = t->nbytes / size_t(n_slots_);
            std::memcpy(static_cast<char *>(t->data) + row * size_t(slot), src, row);
            src += row;
        }
    }

private:
    void check(int slot, int snap) const {
        PG_CHECK(snap >= 0 && snap < n_, "slot_snapshots: snapshot {} outside the pool of {}", snap, n_);
        PG_CHECK(slot >= 0 && slot < n_slots_, "slot_snapshots: slot {} outside the pool of {}", slot, n_slots_);
    }
    std::vector<tensor *> pools_;
    int n_;
    int64_t n_slots_ = 0;
    size_t per_ = 0;
    std::vector<float> data_;
};

class cpu_backend final : public backend {
public:
    void slot_zero(const std::vector<tensor *> & pools, int slot) override {
        const int64_t n = slot_pools_check(pools, "slot_zero");
        PG_CHECK(pools.empty() || (slot >= 0 && slot < n), "slot_zero: slot {} outside the pool of {}", slot, n);
        for (tensor * t : pools) {
            const size_t row = t->nbytes / size_t(n);
            std::memset(static_cast<char *>(t->data) + row * size_t(slot), 0, row);
        }
    }
    std::unique_ptr<slot_snapshots> slot_snapshots_new(const std::vector<tensor *> & pools, int n) override {
        return std::make_unique<cpu_slot_snapshots>(pools, n);
    }

    std::string name() const override { return "cpu"; }
    // A step is slow here (seconds for a long chunk of a real model): a small budget keeps the other streams' decodes
    // responsive, and the CPU's prefill rate hardly depends on the chunk length.
    int step_tokens_default() const override { return 512; }

    void check_supported(const graph & g) const override {
        for (int i = 0; i < int(g.nodes.size()); ++i) check_node(g, i);
    }

    void run(const graph & g, const node_callback & cb) override {
        outs_.assign(g.nodes.size(), {});
        for (int id = 0; id < int(g.nodes.size()); ++id) {
            check_node(g, id);
            try {
                run_node(g, id);
            } catch (const error & e) {
                const node & n = g.nodes[size_t(id)];
                const std::string msg = e.what();
                if (!n.name.empty() && msg.find(n.name) != std::string::npos) throw;
                throw error(e.func(), e.file(), e.line(), fmt::format("node {} '{}' ({}): {}", id, n.name, op_name(n.op), msg));
            }
            if (cb) {
                const node & n = g.nodes[size_t(id)];
                if (n.op == op_type::STATE) {
                    // The pool buffer is updated later in the run: hand out a snapshot of it as it is now.
                    std::vector<tensor> snap;
                    for (const auto & t : outs_[size_t(id)]) snap.push_back(copy_tensor(t));
                    cb(g, id, snap);
                } else {
                    cb(g, id, outs_[size_t(id)]);
                }
            }
        }
    }

    tensor read(node_ref r) const override {
        PG_CHECK(r.node >= 0 && size_t(r.node) < outs_.size(), "read: node {} was not run", r.node);
        const auto & o = outs_[size_t(r.node)];
        PG_CHECK(r.out >= 0 && size_t(r.out) < o.size(), "read: node {} has no output {}", r.node, r.out);
        return copy_tensor(o[size_t(r.out)]);
    }

    std::vector<int32_t> sample_rows(node_ref logits, const std::vector<row_sampling> & rows) override {
        PG_CHECK(logits.node >= 0 && size_t(logits.node) < outs_.size() && logits.out >= 0 &&
                     size_t(logits.out) < outs_[size_t(logits.node)].size(),
                 "sample_rows: node {} output {} was not run", logits.node, logits.out);
        const tensor & t = outs_[size_t(logits.node)][size_t(logits.out)];
        PG_CHECK(t.type == dtype::F32 && t.shape.size() == 2, "sample_rows: logits must be F32 [R, V], got {} of rank {}",
                 dtype_name(t.type), t.shape.size());
        PG_CHECK(t.dim(0) == int64_t(rows.size()), "sample_rows: {} logits rows, {} sampling entries", t.dim(0), rows.size());
        const int64_t V = t.dim(1);
        std::vector<int32_t> ids(rows.size());
        for (size_t r = 0; r < rows.size(); ++r) {
            const float * row = t.as<float>() + int64_t(r) * V;
            bool finite = true;
            for (int64_t i = 0; i < V && finite; ++i) finite = std::isfinite(row[i]);
            ids[r] = finite ? sample_row_reference(row, V, rows[r]) : -1;
        }
        return ids;
    }

private:
    void run_node(const graph & g, int id) {
        const node & n = g.nodes[size_t(id)];
        std::vector<tensor> & out = outs_[size_t(id)];
        // Leaves expose their tensors without a copy (a view with the same bytes).
        switch (n.op) {
            case op_type::IDS: {
                tensor t = tensor_new(dtype::I32, n.outs.at(0).shape);
                PG_CHECK(int64_t(g.b->ids.size()) == t.numel(), "{}: batch has {} ids, node wants {}", n.name,
                         g.b->ids.size(), t.numel());
                if (t.nbytes) std::memcpy(t.data, g.b->ids.data(), t.nbytes);
                out.push_back(std::move(t));
                return;
            }
            case op_type::WEIGHT:
            case op_type::STATE:
                out.push_back(tensor_view(n.leaf->type, n.leaf->shape, n.leaf->data, nullptr));
                return;
            default: break;
        }
        for (const auto & o : n.outs) out.push_back(tensor_new(o.type, o.shape));
        cpu_node_io io{g, id, {}, &out};
        for (const auto & s : n.src) io.in.push_back(s.valid() ? &outs_.at(size_t(s.node)).at(size_t(s.out)) : nullptr);

        switch (n.op) {
            case op_type::IDS:
            case op_type::WEIGHT:
            case op_type::STATE: break;   // handled above
            case op_type::GET_ROWS: run_get_rows(io); break;
            case op_type::RMS_NORM:
            case op_type::LAYER_NORM:
            case op_type::L2_NORM:
            case op_type::GATED_RMS_NORM: run_norm(io); break;
            case op_type::LINEAR: run_linear(io); break;
            case op_type::ADD:
            case op_type::MUL:
            case op_type::SCALE:
            case op_type::SIGMOID:
            case op_type::SILU_MUL:
            case op_type::SITU_MUL:
            case op_type::COLS: run_elementwise(io); break;
            case op_type::SELECT_ROWS: run_elementwise(io); break;
            case op_type::SHORT_CONV: run_short_conv(io); break;
            case op_type::KDA_GATE: run_kda_gate(io); break;
            case op_type::KDA_SCAN: run_kda_scan(io); break;
            case op_type::MLA_ATTN: run_mla_attn(io); break;
            case op_type::INDEXER_TOPK: run_indexer_topk(io); break;
            case op_type::MOE_ROUTE: run_moe_route(io); break;
            case op_type::MOE_EXPERTS: run_moe_experts(io); break;
            case op_type::ATTN_RES_MIX: run_attn_res_mix(io); break;
            case op_type::COUNT: PG_FAIL("{}: op COUNT is not an op", n.name);
        }
    }

    std::vector<std::vector<tensor>> outs_;
};

} // namespace

std::unique_ptr<backend> backend_cpu_init() { return std::make_unique<cpu_backend>(); }

} // namespace perigee
