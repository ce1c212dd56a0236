// Cache paging shared by MLA_ATTN and INDEXER_TOPK: position pos of sequence s lives in page
// block_table[s][pos / page_size], row pos % page_size.
#pragma once
#include "core/error.h"
#include "ir/batch.h"

#include <cstdint>

namespace perigee {

// Checks that every position written in this step (and so every earlier one) has a page in 0..n_pages-1.
inline void paging_check(const batch & b, int64_t n_pages, const char * what) {
    PG_CHECK(b.page_size > 0, "{}: batch.page_size is {}", what, b.page_size);
    PG_CHECK(int(b.block_table.size()) == b.n_seq(), "{}: batch.block_table has {} rows for {} sequences", what,
             b.block_table.size(), b.n_seq());
    for (int s = 0; s < b.n_seq(); ++s) {
        const int64_t last = int64_t(b.pos0[size_t(s)]) + b.seq_len(s) - 1;
        const auto & bt = b.block_table[size_t(s)];
        PG_CHECK(int64_t(bt.size()) * b.page_size > last, "{}: batch.block_table[{}] has {} pages, position {} needs more",
                 what, s, bt.size(), last);
        for (int64_t p = 0; p <= last / b.page_size; ++p)
            PG_CHECK(bt[size_t(p)] >= 0 && bt[size_t(p)] < n_pages, "{}: batch.block_table[{}][{}] = {} outside {} pages",
                     what, s, p, bt[size_t(p)], n_pages);
    }
}

// Row of position pos of sequence s in a cache [n_pages, page_size, width].
inline float * paging_row(float * cache, const batch & b, int s, int64_t pos, int64_t width) {
    const int64_t page = b.block_table[size_t(s)][size_t(pos / b.page_size)];
    return cache + (page * b.page_size + pos % b.page_size) * width;
}

} // namespace perigee
