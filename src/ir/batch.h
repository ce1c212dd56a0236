// The layout of one forward step: which sequences, how many tokens each, where their state lives.
// Built by the runtime (or a CLI tool), read by the sequence-aware ops (SHORT_CONV, KDA_SCAN,
// MLA_ATTN, INDEXER_TOPK). Tokens of all sequences are packed along one axis, sequence after sequence.
#pragma once
#include <cstdint>
#include <vector>

namespace perigee {

struct batch {
    std::vector<int32_t> ids;          // [T] token ids, packed
    std::vector<int32_t> seq_start;    // [n_seq + 1] offsets into ids; seq s owns [seq_start[s], seq_start[s+1])
    std::vector<int32_t> pos0;         // [n_seq] position of the sequence's first token in this step
                                       //  (= tokens already in its caches; 0 for a fresh prefill)
    std::vector<int32_t> slot;         // [n_seq] KDA state slot (conv + recurrent state)
    std::vector<std::vector<int32_t>> block_table;  // [n_seq][pages] MLA / indexer cache pages
    int32_t page_size = 0;             // tokens per cache page (power of two)
    std::vector<int32_t> logits_rows;  // packed token indices whose logits are wanted (empty = all)

    int n_seq() const { return int(seq_start.empty() ? 0 : seq_start.size() - 1); }
    int n_tokens() const { return int(ids.size()); }
    int seq_len(int s) const { return seq_start[s + 1] - seq_start[s]; }
};

// Checks the invariants above (monotone offsets, positions >= 0, distinct slots, enough pages for
// every position written); throws perigee::error naming the field.
void batch_validate(const batch & b, int n_slots, int n_pages);

} // namespace perigee
