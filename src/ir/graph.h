// A forward graph: nodes in execution order, each with an op, inputs, outputs and a stable name
// (`blk.<il>.<name>`, STYLE §3.4). The model builds it; a backend runs it.
#pragma once
#include "core/tensor.h"
#include "ir/batch.h"
#include "ir/op.h"

#include <memory>
#include <string>
#include <vector>

namespace perigee {

// One expert's matrices for MOE_EXPERTS. A matrix is either dense (BF16/F32 `weight`) or FP4:
//   MXFP4: `packed` U8 [out, in/2] (low nibble = even column) + `scale` U8 [out, in/32] (E8M0, 2^(s-127));
//   NVFP4: `packed` U8 [out, in/2] + `scale` F8_E4M3 [out, in/16] + `global_scale` (value = e2m1*e4m3*global).
// `in`/`out` give the logical shape. Decoding is src/quant's _ref codecs.
enum class fp4_format : uint8_t { NONE, MXFP4, NVFP4 };
struct expert_matrix {
    const tensor * weight = nullptr;
    const tensor * packed = nullptr;
    const tensor * scale = nullptr;
    fp4_format format = fp4_format::NONE;
    float global_scale = 1.0f;
    int64_t out = 0, in = 0;
};
struct expert_weights { expert_matrix gate, up, down; };   // w1 = gate, w3 = up, w2 = down

enum class glu_act : uint8_t { SILU, SITU };
enum class router_act : uint8_t { SIGMOID, SOFTMAX };

struct op_params {
    float eps = 0.0f;
    int64_t n = 0;                 // RMS_NORM / L2_NORM / GATED_RMS_NORM: group width (head dim); COLS: width
    int64_t c0 = 0;                // COLS: first column
    float scale = 1.0f;            // SCALE, KDA_SCAN (q scale), MLA_ATTN (softmax scale), MOE_ROUTE, INDEXER_TOPK
    // SITU_MUL / MOE_EXPERTS
    glu_act act = glu_act::SILU;
    float situ_beta = 1.0f;
    float situ_linear_beta = 0.0f; // <= 0: absent
    // KDA
    int64_t n_head = 0, head_dim_k = 0, head_dim_v = 0;
    float gate_lower_bound = 0.0f; // < 0: lower-bound gate (K3); 0: softplus gate (48B)
    int chunk_size = 0;            // KDA_SCAN: 64 = chunked form, 0 = recurrence
    // MLA
    int64_t head_dim_nope = 0, head_dim_rope = 0, kv_lora_rank = 0;
    // INDEXER_TOPK / MOE_ROUTE
    int64_t topk = 0;
    // MOE_ROUTE
    int64_t n_group = 1, topk_group = 1;
    bool renormalize = true;
    router_act router = router_act::SIGMOID;
    // MOE_EXPERTS
    std::shared_ptr<const std::vector<expert_weights>> experts;
    // LINEAR / MOE_EXPERTS: the matrices read bf16-rounded inputs (op.h; forward_options::bf16_inputs_min_tokens)
    bool bf16_inputs = false;
};

struct node_ref {
    int node = -1;
    int out = 0;
    bool valid() const { return node >= 0; }
};

struct node_output {
    dtype type = dtype::F32;
    shape_t shape;
};

struct node {
    op_type op = op_type::COUNT;
    std::string name;                  // stable, e.g. "blk.3.attn_norm"; leaves: the tensor name
    std::vector<node_ref> src;         // an invalid ref means "none" for optional inputs
    std::vector<node_output> outs;
    op_params p;
    const tensor * leaf = nullptr;     // WEIGHT: the checkpoint tensor; STATE: the pool buffer
    tensor * state = nullptr;          // STATE: the mutable buffer (same as leaf)
};

struct graph {
    std::vector<node> nodes;
    std::shared_ptr<const batch> b;    // the step's layout
    node_ref logits;                   // the output node
    const node & at(node_ref r) const { return nodes.at(size_t(r.node)); }
    const node_output & out(node_ref r) const { return at(r).outs.at(size_t(r.out)); }
    // Index of the node with this name, -1 when absent.
    int find(const std::string & name) const;
};

} // namespace perigee
