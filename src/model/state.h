// The model's persistent per-sequence state, in slot- and page-indexed pools (ARCHITECTURE §3.10):
//  - KDA layers: conv windows (last W-1 pre-conv inputs of q, k, v) and the fp32 recurrent state
//    [H, K, V], one slot per running sequence;
//  - MLA layers: the latent cache [c (kv_lora_rank) | k_rope], paged; K3.1 adds the indexer key cache.
// The runtime decides which sequence owns which slot and pages; the forward graph reads and writes
// them through STATE leaves. CPU pools hold F32.
#pragma once
#include "model/config.h"

#include <vector>

namespace perigee {

struct layer_state {
    tensor conv_q, conv_k, conv_v;   // KDA: [n_slots, H*K, W-1]
    tensor recurrent;                // KDA: [n_slots, H, K, V] F32
    tensor latent;                   // MLA: [n_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    tensor index_keys;               // K3.1 MLA: [n_pages, page_size, index_head_dim]
};

struct model_state {
    int n_slots = 0, n_pages = 0, page_size = 0;
    std::vector<layer_state> layers;
};

model_state state_init(const kimi_config & c, int n_slots, int n_pages, int page_size);
// Zeroes one slot's KDA state in every layer (a recycled slot must never leak another request's state).
void state_slot_zero(model_state & st, int slot);
// Bytes per KDA slot and per MLA page, as the CPU pools store them (F32).
int64_t state_slot_bytes(const kimi_config & c);
int64_t state_page_bytes(const kimi_config & c, int page_size);

} // namespace perigee
