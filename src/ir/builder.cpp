#include "ir/builder.h"

#include "core/error.h"

namespace perigee {

int graph::find(const std::string & nm) const {
    for (size_t i = 0; i < nodes.size(); ++i)
        if (nodes[i].name == nm) return int(i);
    return -1;
}

namespace {
node_output f32_out(shape_t s) { return node_output{dtype::F32, std::move(s)}; }
} // namespace

builder::builder(std::shared_ptr<const batch> b) { g_.b = std::move(b); }

node_ref builder::push(node n) {
    for (const auto & s : n.src)
        PG_CHECK(!s.valid() || (s.node < int(g_.nodes.size()) && s.out < int(g_.nodes[size_t(s.node)].outs.size())),
                 "graph: {} refers to a node that does not exist", op_name(n.op));
    g_.nodes.push_back(std::move(n));
    return node_ref{int(g_.nodes.size()) - 1, 0};
}

node_ref builder::name(node_ref r, const std::string & nm, int il) {
    g_.nodes.at(size_t(r.node)).name = il >= 0 ? "blk." + std::to_string(il) + "." + nm : nm;
    return r;
}

node_ref builder::ids() {
    node n;
    n.op = op_type::IDS;
    n.name = "ids";
    n.outs = {node_output{dtype::I32, {int64_t(g_.b->n_tokens())}}};
    return push(std::move(n));
}

node_ref builder::weight(const tensor & t, const std::string & nm) {
    node n;
    n.op = op_type::WEIGHT;
    n.name = nm;
    n.leaf = &t;
    n.outs = {node_output{t.type, t.shape}};
    return push(std::move(n));
}

node_ref builder::state(tensor & t, const std::string & nm) {
    node n;
    n.op = op_type::STATE;
    n.name = nm;
    n.leaf = &t;
    n.state = &t;
    n.outs = {node_output{t.type, t.shape}};
    return push(std::move(n));
}

node_ref builder::get_rows(node_ref table, node_ref ids) {
    const auto & t = out(table);
    PG_CHECK(t.shape.size() == 2, "get_rows: table must be 2-D, got {}", shape_str(t.shape));
    PG_CHECK(out(ids).type == dtype::I32, "get_rows: ids must be I32");
    node n;
    n.op = op_type::GET_ROWS;
    n.src = {table, ids};
    n.outs = {f32_out({out(ids).shape[0], t.shape[1]})};
    return push(std::move(n));
}

node_ref builder::rms_norm(node_ref x, node_ref w, float eps, int64_t group) {
    const auto & xs = out(x).shape;
    const int64_t nn = group > 0 ? group : xs.back();
    PG_CHECK(xs.back() % nn == 0, "rms_norm: width {} is not a multiple of the group {}", xs.back(), nn);
    if (w.valid()) PG_CHECK(shape_numel(out(w).shape) == nn, "rms_norm: weight {} for group width {}", shape_str(out(w).shape), nn);
    node n;
    n.op = op_type::RMS_NORM;
    n.src = {x, w};
    n.p.eps = eps;
    n.p.n = nn;
    n.outs = {f32_out(xs)};
    return push(std::move(n));
}

node_ref builder::layer_norm(node_ref x, node_ref w, node_ref b, float eps) {
    const auto & xs = out(x).shape;
    PG_CHECK(shape_numel(out(w).shape) == xs.back() && shape_numel(out(b).shape) == xs.back(),
             "layer_norm: weight/bias must have {} values", xs.back());
    node n;
    n.op = op_type::LAYER_NORM;
    n.src = {x, w, b};
    n.p.eps = eps;
    n.p.n = xs.back();
    n.outs = {f32_out(xs)};
    return push(std::move(n));
}

node_ref builder::l2_norm(node_ref x, float eps, int64_t group) {
    const auto & xs = out(x).shape;
    PG_CHECK(group > 0 && xs.back() % group == 0, "l2_norm: width {} not a multiple of {}", xs.back(), group);
    node n;
    n.op = op_type::L2_NORM;
    n.src = {x};
    n.p.eps = eps;
    n.p.n = group;
    n.outs = {f32_out(xs)};
    return push(std::move(n));
}

node_ref builder::linear(node_ref x, node_ref w) {
    const auto & xs = out(x).shape;
    const auto & ws = out(w).shape;
    PG_CHECK(xs.size() == 2 && ws.size() == 2 && xs[1] == ws[1], "linear {}: x {} does not match weight {}",
             at_name(w), shape_str(xs), shape_str(ws));
    node n;
    n.op = op_type::LINEAR;
    n.src = {x, w};
    n.p.bf16_inputs = bf16_inputs_;
    n.outs = {f32_out({xs[0], ws[0]})};
    return push(std::move(n));
}

node_ref builder::add(node_ref a, node_ref b) {
    PG_CHECK(out(a).shape == out(b).shape, "add: shapes {} and {} differ", shape_str(out(a).shape), shape_str(out(b).shape));
    node n;
    n.op = op_type::ADD;
    n.src = {a, b};
    n.outs = {f32_out(out(a).shape)};
    return push(std::move(n));
}

node_ref builder::mul(node_ref a, node_ref b) {
    PG_CHECK(out(a).shape == out(b).shape, "mul: shapes {} and {} differ", shape_str(out(a).shape), shape_str(out(b).shape));
    node n;
    n.op = op_type::MUL;
    n.src = {a, b};
    n.outs = {f32_out(out(a).shape)};
    return push(std::move(n));
}

node_ref builder::scale(node_ref x, float s) {
    node n;
    n.op = op_type::SCALE;
    n.src = {x};
    n.p.scale = s;
    n.outs = {f32_out(out(x).shape)};
    return push(std::move(n));
}

node_ref builder::sigmoid(node_ref x) {
    node n;
    n.op = op_type::SIGMOID;
    n.src = {x};
    n.outs = {f32_out(out(x).shape)};
    return push(std::move(n));
}

node_ref builder::silu_mul(node_ref g, node_ref u) {
    PG_CHECK(out(g).shape == out(u).shape, "silu_mul: gate {} and up {} differ", shape_str(out(g).shape), shape_str(out(u).shape));
    node n;
    n.op = op_type::SILU_MUL;
    n.src = {g, u};
    n.outs = {f32_out(out(g).shape)};
    return push(std::move(n));
}

node_ref builder::situ_mul(node_ref g, node_ref u, float beta, float linear_beta) {
    PG_CHECK(out(g).shape == out(u).shape, "situ_mul: gate {} and up {} differ", shape_str(out(g).shape), shape_str(out(u).shape));
    PG_CHECK(beta > 0, "situ_mul: beta must be positive, got {}", beta);
    node n;
    n.op = op_type::SITU_MUL;
    n.src = {g, u};
    n.p.act = glu_act::SITU;
    n.p.situ_beta = beta;
    n.p.situ_linear_beta = linear_beta;
    n.outs = {f32_out(out(g).shape)};
    return push(std::move(n));
}

node_ref builder::cols(node_ref x, int64_t c0, int64_t nn) {
    const auto & xs = out(x).shape;
    PG_CHECK(xs.size() == 2 && c0 >= 0 && nn > 0 && c0 + nn <= xs[1], "cols: [{}, {}) outside {}", c0, c0 + nn, shape_str(xs));
    node n;
    n.op = op_type::COLS;
    n.src = {x};
    n.p.c0 = c0;
    n.p.n = nn;
    n.outs = {f32_out({xs[0], nn})};
    return push(std::move(n));
}

node_ref builder::select_rows(node_ref x) {
    const auto & xs = out(x).shape;
    PG_CHECK(xs.size() == 2, "select_rows: x must be 2-D, got {}", shape_str(xs));
    const auto & rows = g_.b->logits_rows;
    node n;
    n.op = op_type::SELECT_ROWS;
    n.src = {x};
    n.outs = {f32_out({rows.empty() ? xs[0] : int64_t(rows.size()), xs[1]})};
    return push(std::move(n));
}

node_ref builder::short_conv(node_ref x, node_ref w, node_ref st) {
    const auto & xs = out(x).shape;
    const auto & ws = out(w).shape;
    const auto & ss = out(st).shape;
    PG_CHECK(ws.size() == 3 && ws[0] == xs[1] && ws[1] == 1, "short_conv: weight {} for {} channels", shape_str(ws), xs[1]);
    PG_CHECK(ss.size() == 3 && ss[1] == xs[1] && ss[2] == ws[2] - 1, "short_conv: state {} for weight {}", shape_str(ss), shape_str(ws));
    node n;
    n.op = op_type::SHORT_CONV;
    n.src = {x, w, st};
    n.outs = {f32_out(xs)};
    return push(std::move(n));
}

node_ref builder::kda_gate(node_ref f, node_ref a_log, node_ref dt_bias, int64_t n_head, int64_t head_dim, float lb) {
    const auto & fs = out(f).shape;
    PG_CHECK(fs.size() == 2 && fs[1] == n_head * head_dim, "kda_gate: f {} for {} heads x {}", shape_str(fs), n_head, head_dim);
    PG_CHECK(shape_numel(out(a_log).shape) >= n_head, "kda_gate: A_log {} has fewer than {} values", shape_str(out(a_log).shape), n_head);
    PG_CHECK(shape_numel(out(dt_bias).shape) == n_head * head_dim, "kda_gate: dt_bias {} for {} channels", shape_str(out(dt_bias).shape), n_head * head_dim);
    node n;
    n.op = op_type::KDA_GATE;
    n.src = {f, a_log, dt_bias};
    n.p.n_head = n_head;
    n.p.head_dim_k = head_dim;
    n.p.gate_lower_bound = lb;
    n.outs = {f32_out(fs)};
    return push(std::move(n));
}

node_ref builder::kda_scan(node_ref q, node_ref k, node_ref v, node_ref g, node_ref beta, node_ref st,
                           const kda_scan_params & p) {
    const int64_t T = out(q).shape[0];
    PG_CHECK(out(q).shape == (shape_t{T, p.n_head * p.head_dim_k}) && out(k).shape == out(q).shape &&
                 out(g).shape == out(q).shape,
             "kda_scan: q/k/g must be [{}, {}]", T, p.n_head * p.head_dim_k);
    PG_CHECK(out(v).shape == (shape_t{T, p.n_head * p.head_dim_v}), "kda_scan: v {} for {} heads x {}", shape_str(out(v).shape), p.n_head, p.head_dim_v);
    PG_CHECK(out(beta).shape == (shape_t{T, p.n_head}), "kda_scan: beta {} for {} heads", shape_str(out(beta).shape), p.n_head);
    const auto & ss = out(st).shape;
    PG_CHECK(ss.size() == 4 && ss[1] == p.n_head && ss[2] == p.head_dim_k && ss[3] == p.head_dim_v && out(st).type == dtype::F32,
             "kda_scan: state must be F32 [slots, {}, {}, {}], got {}", p.n_head, p.head_dim_k, p.head_dim_v, shape_str(ss));
    PG_CHECK(p.chunk_size == 0 || p.chunk_size == 64, "kda_scan: unsupported chunk size {} (0 or 64)", p.chunk_size);
    node n;
    n.op = op_type::KDA_SCAN;
    n.src = {q, k, v, g, beta, st};
    n.p.n_head = p.n_head;
    n.p.head_dim_k = p.head_dim_k;
    n.p.head_dim_v = p.head_dim_v;
    n.p.scale = p.scale;
    n.p.chunk_size = p.chunk_size;
    n.outs = {f32_out(out(v).shape)};
    return push(std::move(n));
}

node_ref builder::gated_rms_norm(node_ref o, node_ref z, node_ref w, float eps, int64_t head_dim) {
    PG_CHECK(out(o).shape == out(z).shape, "gated_rms_norm: o {} and gate {} differ", shape_str(out(o).shape), shape_str(out(z).shape));
    PG_CHECK(shape_numel(out(w).shape) == head_dim && out(o).shape.back() % head_dim == 0,
             "gated_rms_norm: weight {} for head dim {}", shape_str(out(w).shape), head_dim);
    node n;
    n.op = op_type::GATED_RMS_NORM;
    n.src = {o, z, w};
    n.p.eps = eps;
    n.p.n = head_dim;
    n.outs = {f32_out(out(o).shape)};
    return push(std::move(n));
}

node_ref builder::mla_attn(node_ref q, node_ref c, node_ref kr, node_ref kv_b, node_ref cache, node_ref sel,
                           const mla_params & p) {
    const int64_t T = out(q).shape[0];
    PG_CHECK(out(q).shape == (shape_t{T, p.n_head * (p.head_dim_nope + p.head_dim_rope)}), "mla_attn: q {}", shape_str(out(q).shape));
    PG_CHECK(out(c).shape == (shape_t{T, p.kv_lora_rank}), "mla_attn: latent {}", shape_str(out(c).shape));
    PG_CHECK(out(kr).shape == (shape_t{T, p.head_dim_rope}), "mla_attn: k_rope {}", shape_str(out(kr).shape));
    PG_CHECK(out(kv_b).shape == (shape_t{p.n_head * (p.head_dim_nope + p.head_dim_v), p.kv_lora_rank}),
             "mla_attn: kv_b_proj {} for {} heads x ({} + {}) x {}", shape_str(out(kv_b).shape), p.n_head, p.head_dim_nope,
             p.head_dim_v, p.kv_lora_rank);
    const auto & cs = out(cache).shape;
    PG_CHECK(cs.size() == 3 && cs[2] == p.kv_lora_rank + p.head_dim_rope && out(cache).type == dtype::F32,
             "mla_attn: cache must be F32 [pages, page_size, {}], got {}", p.kv_lora_rank + p.head_dim_rope, shape_str(cs));
    if (sel.valid()) PG_CHECK(out(sel).type == dtype::I32 && out(sel).shape[0] == T, "mla_attn: selection must be I32 [T, topk]");
    node n;
    n.op = op_type::MLA_ATTN;
    n.src = {q, c, kr, kv_b, cache, sel};
    n.p.n_head = p.n_head;
    n.p.head_dim_nope = p.head_dim_nope;
    n.p.head_dim_rope = p.head_dim_rope;
    n.p.head_dim_v = p.head_dim_v;
    n.p.kv_lora_rank = p.kv_lora_rank;
    n.p.scale = p.scale;
    n.outs = {f32_out({T, p.n_head * p.head_dim_v})};
    return push(std::move(n));
}

node_ref builder::indexer_topk(node_ref qi, node_ref ki, node_ref wi, node_ref kcache, const indexer_params & p) {
    const int64_t T = out(qi).shape[0];
    PG_CHECK(out(qi).shape == (shape_t{T, p.n_head * p.head_dim}), "indexer_topk: q {}", shape_str(out(qi).shape));
    PG_CHECK(out(ki).shape == (shape_t{T, p.head_dim}), "indexer_topk: k {}", shape_str(out(ki).shape));
    PG_CHECK(out(wi).shape == (shape_t{T, p.n_head}), "indexer_topk: weights {}", shape_str(out(wi).shape));
    const auto & cs = out(kcache).shape;
    PG_CHECK(cs.size() == 3 && cs[2] == p.head_dim && out(kcache).type == dtype::F32, "indexer_topk: key cache {}", shape_str(cs));
    PG_CHECK(p.topk > 0, "indexer_topk: topk must be positive");
    node n;
    n.op = op_type::INDEXER_TOPK;
    n.src = {qi, ki, wi, kcache};
    n.p.n_head = p.n_head;
    n.p.head_dim_k = p.head_dim;
    n.p.topk = p.topk;
    n.p.scale = p.scale;
    n.outs = {node_output{dtype::I32, {T, p.topk}}};
    return push(std::move(n));
}

std::pair<node_ref, node_ref> builder::moe_route(node_ref x, node_ref gate_w, node_ref bias, const route_params & p) {
    const auto & xs = out(x).shape;
    const auto & ws = out(gate_w).shape;
    PG_CHECK(ws.size() == 2 && ws[1] == xs[1], "moe_route: gate {} for input {}", shape_str(ws), shape_str(xs));
    const int64_t E = ws[0];
    if (bias.valid()) PG_CHECK(shape_numel(out(bias).shape) == E, "moe_route: bias {} for {} experts", shape_str(out(bias).shape), E);
    PG_CHECK(p.n_expert_used > 0 && p.n_expert_used <= E, "moe_route: top-{} of {} experts", p.n_expert_used, E);
    PG_CHECK(p.n_group >= 1 && E % p.n_group == 0 && p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route: {} experts in {} groups, keeping {}", E, p.n_group, p.topk_group);
    node n;
    n.op = op_type::MOE_ROUTE;
    n.src = {x, gate_w, bias};
    n.p.topk = p.n_expert_used;
    n.p.n_group = p.n_group;
    n.p.topk_group = p.topk_group;
    n.p.renormalize = p.renormalize;
    n.p.scale = p.scale;
    n.p.router = p.act;
    n.outs = {node_output{dtype::I32, {xs[0], p.n_expert_used}}, f32_out({xs[0], p.n_expert_used})};
    node_ref r = push(std::move(n));
    return {node_ref{r.node, 0}, node_ref{r.node, 1}};
}

node_ref builder::moe_experts(node_ref x, node_ref ids, node_ref w, const experts_params & p) {
    PG_CHECK(p.experts && !p.experts->empty(), "moe_experts: no experts");
    const auto & xs = out(x).shape;
    PG_CHECK(out(ids).shape == out(w).shape && out(ids).shape[0] == xs[0], "moe_experts: ids/weights must be [T, k]");
    for (size_t e = 0; e < p.experts->size(); ++e) {
        const auto & ex = (*p.experts)[e];
        PG_CHECK(ex.gate.in == xs[1] && ex.up.in == xs[1] && ex.gate.out == ex.up.out && ex.down.in == ex.gate.out &&
                     ex.down.out == p.d_out,
                 "moe_experts: expert {} shapes gate [{}, {}] up [{}, {}] down [{}, {}] do not fit input {} -> {}", e,
                 ex.gate.out, ex.gate.in, ex.up.out, ex.up.in, ex.down.out, ex.down.in, xs[1], p.d_out);
    }
    node n;
    n.op = op_type::MOE_EXPERTS;
    n.src = {x, ids, w};
    n.p.act = p.act;
    n.p.situ_beta = p.situ_beta;
    n.p.situ_linear_beta = p.situ_linear_beta;
    n.p.experts = p.experts;
    n.p.bf16_inputs = bf16_inputs_;
    n.outs = {f32_out({xs[0], p.d_out})};
    return push(std::move(n));
}

node_ref builder::attn_res_mix(const std::vector<node_ref> & cands, node_ref norm_w, node_ref proj_w, float eps) {
    PG_CHECK(!cands.empty(), "attn_res_mix: no candidates");
    const auto & s0 = out(cands[0]).shape;
    for (auto c : cands) PG_CHECK(out(c).shape == s0, "attn_res_mix: candidate shapes differ");
    PG_CHECK(shape_numel(out(norm_w).shape) == s0.back() && shape_numel(out(proj_w).shape) == s0.back(),
             "attn_res_mix: norm {} / proj {} for width {}", shape_str(out(norm_w).shape), shape_str(out(proj_w).shape), s0.back());
    node n;
    n.op = op_type::ATTN_RES_MIX;
    n.src = cands;
    n.src.push_back(norm_w);
    n.src.push_back(proj_w);
    n.p.eps = eps;
    n.outs = {f32_out(s0)};
    return push(std::move(n));
}

graph builder::finish(node_ref logits) {
    g_.logits = logits;
    return std::move(g_);
}

} // namespace perigee
