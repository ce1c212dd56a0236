#include "ir/batch.h"

#include "core/error.h"

#include <set>

namespace perigee {

void batch_validate(const batch & b, int n_slots, int n_pages) {
    const int n_seq = b.n_seq();
    PG_CHECK(n_seq >= 1, "batch: no sequences");
    PG_CHECK(b.seq_start.front() == 0 && b.seq_start.back() == b.n_tokens(),
             "batch.seq_start must run from 0 to n_tokens={} (got {}..{})", b.n_tokens(), b.seq_start.front(),
             b.seq_start.back());
    PG_CHECK(int(b.pos0.size()) == n_seq && int(b.slot.size()) == n_seq,
             "batch: pos0 ({}) and slot ({}) must have one entry per sequence ({})", b.pos0.size(), b.slot.size(), n_seq);
    std::set<int> slots;
    for (int s = 0; s < n_seq; ++s) {
        PG_CHECK(b.seq_start[s + 1] > b.seq_start[s], "batch.seq_start: sequence {} is empty", s);
        PG_CHECK(b.pos0[s] >= 0, "batch.pos0[{}] = {} is negative", s, b.pos0[s]);
        PG_CHECK(b.slot[s] >= 0 && b.slot[s] < n_slots, "batch.slot[{}] = {} outside the pool of {} slots", s,
                 b.slot[s], n_slots);
        PG_CHECK(slots.insert(b.slot[s]).second, "batch.slot: slot {} used by two sequences", b.slot[s]);
    }
    if (b.page_size > 0) {
        PG_CHECK((b.page_size & (b.page_size - 1)) == 0, "batch.page_size {} is not a power of two", b.page_size);
        PG_CHECK(int(b.block_table.size()) == n_seq, "batch.block_table has {} rows for {} sequences",
                 b.block_table.size(), n_seq);
        for (int s = 0; s < n_seq; ++s) {
            const int64_t last = int64_t(b.pos0[s]) + b.seq_len(s) - 1;
            PG_CHECK(int64_t(b.block_table[s].size()) * b.page_size > last,
                     "batch.block_table[{}]: {} pages cannot hold position {}", s, b.block_table[s].size(), last);
            for (int32_t p : b.block_table[s])
                PG_CHECK(p >= 0 && p < n_pages, "batch.block_table[{}] names page {} outside the pool of {}", s, p, n_pages);
        }
    }
    for (int32_t r : b.logits_rows)
        PG_CHECK(r >= 0 && r < b.n_tokens(), "batch.logits_rows: row {} outside 0..{}", r, b.n_tokens() - 1);
}

} // namespace perigee
