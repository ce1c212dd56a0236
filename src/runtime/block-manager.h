// The runtime's two memory pools, separate and named (STYLE §3.3, ARCHITECTURE §3.10):
//  - slot_pool: KDA state slots (conv windows + fp32 recurrent state per KDA layer), one per
//    running sequence, whatever its length;
//  - page_pool: MLA latent-cache pages of page_size tokens (plus the K3.1 indexer keys), allocated
//    as a sequence grows (nano-vllm's block_manager.py).
// Pure bookkeeping: which ids are free. The bytes live in model_state; zeroing a slot before reuse
// is the engine's job (it holds the tensors), and the scheduler tells it which slots are fresh.
#pragma once
#include "model/config.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <vector>

namespace perigee {

class slot_pool {
public:
    explicit slot_pool(int n_slots);
    int capacity() const { return n_; }
    int n_free() const { return int(free_.size()); }
    int n_used() const { return n_ - n_free(); }
    // A free slot (lowest-numbered first for reproducibility), or nullopt when all are in use.
    std::optional<int32_t> alloc();
    void free(int32_t slot);   // throws on a slot that is not in use (double free)
    // Why alloc() would fail now ("" when it would not).
    std::string refusal() const;

private:
    int n_;
    std::vector<int32_t> free_;     // sorted descending; back() is the lowest
    std::vector<bool> used_;
};

// Pages are reference-counted: a page is in use while at least one sequence's block table holds it
// (prefix caching shares full prompt pages between sequences). A page whose last reference is
// dropped goes back to a free list: the plain list when nothing indexes it, or the CACHED list (LRU
// order, least recently freed first) when the prefix cache indexes it, so a later request can take
// it back with share(). Both lists count as free; alloc() takes plain pages first and evicts the
// least recently used cached page only when none is left (calling on_evict first, so the prefix
// cache drops its entry before the page is overwritten).
class page_pool {
public:
    page_pool(int n_pages, int page_size);
    int capacity() const { return n_; }
    int page_size() const { return page_size_; }
    int n_free() const { return int(free_.size() + lru_.size()); }   // unreferenced (plain + cached)
    int n_used() const { return n_ - n_free(); }                      // referenced by some sequence
    int n_cached_free() const { return int(lru_.size()); }            // unreferenced but indexed
    int64_t n_refs() const { return n_refs_; }                        // sum of reference counts
    int refs(int32_t page) const;
    // Pages needed to hold positions 0..n_tokens-1.
    int pages_for(int64_t n_tokens) const { return int((n_tokens + page_size_ - 1) / page_size_); }
    bool can_alloc(int n) const { return n <= n_free(); }
    // Appends n fresh pages (one reference each) to `pages`; throws (naming the shortfall) when
    // fewer than n are free.
    void alloc(int n, std::vector<int32_t> & pages);
    // Drops one reference per page and clears `pages`; throws on a page not in use.
    void free(std::vector<int32_t> & pages);
    // One more reference to a page in use, or revives an unreferenced CACHED page (out of the LRU
    // list). Throws for a plain free page (its contents are not meaningful).
    void share(int32_t page);
    // The prefix cache marks the pages it indexes (cached) and unmarks the ones it drops.
    void set_cached(int32_t page, bool cached);
    bool is_cached(int32_t page) const;
    std::function<void(int32_t page)> on_evict;   // alloc() is about to reuse this cached page
    std::string refusal(int n) const;          // why alloc(n) would fail ("" when it would not)

private:
    void check_page(int32_t p, const char * what) const;
    int n_, page_size_;
    std::deque<int32_t> free_;                 // plain free pages
    std::list<int32_t> lru_;                   // unreferenced cached pages, least recently freed first
    std::vector<std::list<int32_t>::iterator> lru_pos_;
    std::vector<int32_t> refs_;
    std::vector<bool> cached_;
    int64_t n_refs_ = 0;
};

// Pool sizes from a byte budget: max_num_seqs KDA slots and n_snapshots prefix-cache snapshots first
// (each state_slot_bytes: a snapshot is a full copy of a slot; K3: 443 MiB each), the rest of the
// budget as MLA pages (each state_page_bytes), capped at what max_num_seqs sequences of
// max_model_len tokens can use. Throws, saying how many bytes are needed, when the budget cannot
// hold the slots and snapshots plus one full-length sequence's pages.
struct pool_plan {
    int n_slots = 0, n_snapshots = 0, n_pages = 0, page_size = 0;
    int64_t slot_bytes = 0, page_bytes = 0;
    int64_t total_bytes() const {
        return int64_t(n_slots + n_snapshots) * slot_bytes + int64_t(n_pages) * page_bytes;
    }
    std::string str() const;
};
pool_plan plan_pools(const kimi_config & c, int64_t budget_bytes, int max_num_seqs, int page_size, int max_model_len,
                     int n_snapshots);

} // namespace perigee
