#include "model/state.h"

#include <cstring>

namespace perigee {

model_state state_init(const kimi_config & c, int n_slots, int n_pages, int page_size) {
    PG_CHECK(n_slots > 0 && n_pages > 0, "state pools need at least one slot and one page (got {} and {})", n_slots, n_pages);
    PG_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0, "page size {} is not a power of two", page_size);
    model_state st;
    st.n_slots = n_slots;
    st.n_pages = n_pages;
    st.page_size = page_size;
    st.layers.resize(size_t(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        auto & ls = st.layers[size_t(l)];
        if (c.layer_is_kda[size_t(l)]) {
            const int64_t HK = c.kda_num_heads * c.kda_head_dim, W1 = c.kda_short_conv_kernel_size - 1;
            ls.conv_q = tensor_new(dtype::F32, {n_slots, HK, W1});
            ls.conv_k = tensor_new(dtype::F32, {n_slots, HK, W1});
            ls.conv_v = tensor_new(dtype::F32, {n_slots, HK, W1});
            ls.recurrent = tensor_new(dtype::F32, {n_slots, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim});
        } else {
            ls.latent = tensor_new(dtype::F32, {n_pages, page_size, c.kv_lora_rank + c.qk_rope_head_dim});
            if (c.layer_is_dsa[size_t(l)]) ls.index_keys = tensor_new(dtype::F32, {n_pages, page_size, c.index_head_dim});
        }
    }
    return st;
}

void state_slot_zero(model_state & st, int slot) {
    PG_CHECK(slot >= 0 && slot < st.n_slots, "slot {} outside the pool of {}", slot, st.n_slots);
    auto zero = [&](tensor & t) {
        if (t.empty()) return;
        const size_t per = t.nbytes / size_t(st.n_slots);
        std::memset(static_cast<char *>(t.data) + per * size_t(slot), 0, per);
    };
    for (auto & ls : st.layers) {
        zero(ls.conv_q);
        zero(ls.conv_k);
        zero(ls.conv_v);
        zero(ls.recurrent);
    }
}

int64_t state_slot_bytes(const kimi_config & c) {
    const int64_t HK = c.kda_num_heads * c.kda_head_dim;
    return c.n_kda_layers() * 4 * (3 * HK * (c.kda_short_conv_kernel_size - 1) + c.kda_num_heads * c.kda_head_dim * c.kda_head_dim);
}

int64_t state_page_bytes(const kimi_config & c, int page_size) {
    int64_t per_tok = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        if (!c.layer_is_kda[size_t(l)])
            per_tok += c.kv_lora_rank + c.qk_rope_head_dim + (c.layer_is_dsa[size_t(l)] ? c.index_head_dim : 0);
    return per_tok * 4 * page_size;
}

} // namespace perigee
