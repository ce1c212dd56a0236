// The CPU reference ops (private to backend/cpu and its tests).
//
// Every op of ir/op.h has a plain `_ref` function on raw pointers and sizes, so tests and the CUDA parity
// runner can call it without a graph, plus a node adapter `run_<op>` that the dispatch switch in
// cpu-backend.cpp calls. Activations are F32, accumulation fp32 (fp64 in the small reductions where it
// is free); weights are read through `wview`, which converts F32/BF16/F16 per element.
#pragma once
#include "core/tensor.h"
#include "ir/batch.h"
#include "ir/graph.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace perigee {

// A read-only view of float weights of any float-like dtype (F32, BF16, F16, F64). data == nullptr = none.
struct wview {
    const void * data = nullptr;
    dtype type = dtype::F32;
    bool present() const { return data != nullptr; }
    float at(int64_t i) const {
        switch (type) {
            case dtype::F32: return static_cast<const float *>(data)[i];
            case dtype::BF16: return bf16_to_f32(static_cast<const uint16_t *>(data)[i]);
            case dtype::F16: return f16_to_f32(static_cast<const uint16_t *>(data)[i]);
            case dtype::F64: return float(static_cast<const double *>(data)[i]);
            default: PG_FAIL("unsupported weight dtype: {}", dtype_name(type));
        }
    }
    // out[j] = at(i0 + j), j < n
    void row(int64_t i0, int64_t n, float * out) const {
        if (type == dtype::F32) {
            const float * p = static_cast<const float *>(data) + i0;
            for (int64_t j = 0; j < n; ++j) out[j] = p[j];
            return;
        }
        if (type == dtype::BF16) {   // the common checkpoint dtype: a plain loop the compiler vectorises
            const uint16_t * p = static_cast<const uint16_t *>(data) + i0;
            for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_f32(p[j]);
            return;
        }
        for (int64_t j = 0; j < n; ++j) out[j] = at(i0 + j);
    }
};
inline wview wview_of(const tensor & t) { return wview{t.data, t.type}; }
// Throws "unsupported <what> dtype: X" unless the view is empty or float-like. Call before parallel loops
// (an exception must not leave an OpenMP region).
inline void wview_check(const wview & w, const char * what) {
    if (!w.present()) return;
    PG_CHECK(w.type == dtype::F32 || w.type == dtype::BF16 || w.type == dtype::F16 || w.type == dtype::F64,
             "unsupported {} dtype: {}", what, dtype_name(w.type));
}

inline float sigmoid_f(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu_f(float x) { return x * sigmoid_f(x); }
inline float softplus_f(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
// SiTU-GLU (ARCHITECTURE §3.0): [beta*tanh(a/beta)*sigmoid(a)] * [lin_beta*tanh(b/lin_beta)], lin_beta <= 0: b.
inline float situ_f(float a, float b, float beta, float lin_beta) {
    const float gate = beta * std::tanh(a / beta) * sigmoid_f(a);
    const float up = lin_beta > 0.0f ? lin_beta * std::tanh(b / lin_beta) : b;
    return gate * up;
}

// ---- norm.cpp ----
// x [R, N] -> y [R, N]; w [N] or none (= 1)
void rms_norm_ref(const float * x, int64_t R, int64_t N, wview w, float eps, float * y);
// biased variance; w, b [N]
void layer_norm_ref(const float * x, int64_t R, int64_t N, wview w, wview b, float eps, float * y);
// x / sqrt(sum(x^2) + eps) per row of N
void l2_norm_ref(const float * x, int64_t R, int64_t N, float eps, float * y);
// per row of N: o * rsqrt(mean(o^2) + eps) * w * sigmoid(z)
void gated_rms_norm_ref(const float * o, const float * z, int64_t R, int64_t N, wview w, float eps, float * y);

// ---- linear.cpp ----
// x [T, in], W [out, in] -> y [T, out] = x W^T
void linear_ref(const float * x, int64_t T, int64_t in, wview W, int64_t out, float * y);
// x [n] rounded to bf16, nearest even (op_params::bf16_inputs), as fp32 values.
std::vector<float> bf16_rounded(const float * x, int64_t n);
// table [V, D], ids [T] -> y [T, D]; an id outside 0..V-1 is an error naming `what`
void get_rows_ref(wview table, int64_t V, int64_t D, const int32_t * ids, int64_t T, float * y, const std::string & what);

// ---- elementwise.cpp ----
void add_ref(const float * a, const float * b, int64_t n, float * y);
void mul_ref(const float * a, const float * b, int64_t n, float * y);
void scale_ref(const float * x, int64_t n, float s, float * y);
void sigmoid_ref(const float * x, int64_t n, float * y);
void silu_mul_ref(const float * g, const float * u, int64_t n, float * y);
void situ_mul_ref(const float * g, const float * u, int64_t n, float beta, float lin_beta, float * y);
// x [T, C] -> y [T, n] = x[:, c0 : c0 + n]
void cols_ref(const float * x, int64_t T, int64_t C, int64_t c0, int64_t n, float * y);

// ---- conv.cpp ----
// x [T, C], w [C, 1, W], state F32 [n_slots, C, W-1] (updated in place) -> y [T, C]
void short_conv_ref(const float * x, int64_t C, wview w, int64_t W, float * state, int64_t n_slots, const batch & b,
                    float * y);

// ---- kda.cpp ----
// f [T, H*K], A_log [>=H], dt_bias [H*K] -> g [T, H*K]
void kda_gate_ref(const float * f, int64_t T, int64_t H, int64_t K, wview a_log, wview dt_bias, float lower_bound,
                  float * g);
struct kda_dims { int64_t n_head, head_dim_k, head_dim_v; };
// q, k, g [T, H*K], v [T, H*V], beta [T, H], state [n_slots, H, K, V] (updated in place) -> o [T, H*V].
// chunk_size 0 = token recurrence, 64 = chunked WY form (ARCHITECTURE §3.4 steps 1-7).
void kda_scan_ref(const float * q, const float * k, const float * v, const float * g, const float * beta,
                  const kda_dims & d, float scale, int chunk_size, float * state, int64_t n_slots, const batch & b,
                  float * o);

// ---- mla.cpp ----
struct mla_dims { int64_t n_head, head_dim_nope, head_dim_rope, head_dim_v, kv_lora_rank; };
// q [T, H*(dn+dr)], c [T, L], kr [T, dr], kv_b [H*(dn+dv), L], cache [n_pages, page_size, L+dr] (written),
// sel I32 [T, topk] or nullptr -> o [T, H*dv]
void mla_attn_ref(const float * q, const float * c, const float * kr, wview kv_b, const mla_dims & d, float scale,
                  float * cache, int64_t n_pages, const int32_t * sel, int64_t topk, const batch & b, float * o);

// ---- indexer.cpp ----
// qi [T, I*d], ki [T, d], wi [T, I], kcache [n_pages, page_size, d] (written) -> sel I32 [T, topk]
void indexer_topk_ref(const float * qi, const float * ki, const float * wi, int64_t n_head, int64_t head_dim,
                      int64_t topk, float scale, float * kcache, int64_t n_pages, const batch & b, int32_t * sel);
// The selection rule alone, on one token's scores [n]: writes topk entries (ascending, -1 padded).
void indexer_select_ref(const float * score, int64_t n, int64_t topk, int32_t * out);

// ---- moe.cpp ----
struct route_cfg { int64_t n_expert, topk, n_group, topk_group; bool renormalize; float scale; router_act act; };
// x [T, D], gate [E, D], bias [E] or none -> ids I32 [T, topk], w F32 [T, topk]
void moe_route_ref(const float * x, int64_t T, int64_t D, wview gate, wview bias, const route_cfg & c, int32_t * ids,
                   float * w);
// One row r of an expert matrix ([out, in]) decoded to f32 (dense F32/BF16/F16, MXFP4 or NVFP4).
void expert_row_ref(const expert_matrix & m, int64_t r, float * out);
// bf16_inputs: each act(gate x, up x) row is rounded to bf16 before down reads it (the caller rounds x).
struct experts_cfg { glu_act act; float situ_beta, situ_linear_beta; int64_t d_out; bool bf16_inputs = false; };
// x [T, Din], ids I32 [T, k], w F32 [T, k] -> y [T, Dout]; only the selected experts are read.
void moe_experts_ref(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                     const std::vector<expert_weights> & experts, const experts_cfg & c, float * y);

// ---- attn-res.cpp ----
// cands[n] each [R, D], norm_w [D], proj_w [D] -> y [R, D]
void attn_res_mix_ref(const float * const * cands, int64_t n, int64_t R, int64_t D, wview norm_w, wview proj_w,
                      float eps, float * y);

// ---- node adapters (cpu-backend.cpp dispatches to these) ----
struct cpu_node_io {
    const graph & g;
    int id;                                   // node index
    std::vector<const tensor *> in;           // one per src (nullptr = none)
    std::vector<tensor> * out;                // the node's outputs, allocated by the backend
    const node & n() const { return g.nodes[size_t(id)]; }
    const float * f32_in(size_t i) const;     // checks F32, names the node
    const int32_t * i32_in(size_t i) const;   // checks I32
    wview weight_in(size_t i) const;          // checks a float-like dtype; none -> empty view
    tensor & state_in(size_t i) const;        // the mutable STATE leaf behind src i
};

void run_norm(const cpu_node_io & io);        // RMS_NORM, LAYER_NORM, L2_NORM, GATED_RMS_NORM
// Fixed-order fp32 dot product (8 partial sums), shared by the matrix ops.
float dot_f32(const float * a, const float * b, int64_t n);
void run_linear(const cpu_node_io & io);      // LINEAR
void run_get_rows(const cpu_node_io & io);    // GET_ROWS
void run_elementwise(const cpu_node_io & io); // ADD, MUL, SCALE, SIGMOID, SILU_MUL, SITU_MUL, COLS, SELECT_ROWS
void run_short_conv(const cpu_node_io & io);
void run_kda_gate(const cpu_node_io & io);
void run_kda_scan(const cpu_node_io & io);
void run_mla_attn(const cpu_node_io & io);
void run_indexer_topk(const cpu_node_io & io);
void run_moe_route(const cpu_node_io & io);
void run_moe_experts(const cpu_node_io & io);
void run_attn_res_mix(const cpu_node_io & io);

} // namespace perigee
