#include "runtime/block-manager.h"

#include "core/error.h"
#include "model/state.h"

#include <algorithm>

namespace perigee {

slot_pool::slot_pool(int n_slots) : n_(n_slots), used_(size_t(std::max(n_slots, 0)), false) {
    PG_CHECK(n_slots > 0, "slot_pool: {} slots; need at least one", n_slots);
    for (int i = n_slots - 1; i >= 0; --i) free_.push_back(i);
}

std::optional<int32_t> slot_pool::alloc() {
    if (free_.empty()) return std::nullopt;
    const int32_t s = free_.back();
    free_.pop_back();
    used_[size_t(s)] = true;
    return s;
}

void slot_pool::free(int32_t slot) {
    PG_CHECK(slot >= 0 && slot < n_, "slot_pool: slot {} outside the pool of {}", slot, n_);
    PG_CHECK(used_[size_t(slot)], "slot_pool: slot {} freed twice", slot);
    used_[size_t(slot)] = false;
    free_.insert(std::upper_bound(free_.begin(), free_.end(), slot, std::greater<int32_t>()), slot);
}

std::string slot_pool::refusal() const {
    if (!free_.empty()) return "";
    return fmt::format("no free KDA state slot ({} of {} in use)", n_used(), n_);
}

page_pool::page_pool(int n_pages, int page_size)
    : n_(n_pages), page_size_(page_size), lru_pos_(size_t(std::max(n_pages, 0))), refs_(size_t(std::max(n_pages, 0)), 0),
      cached_(size_t(std::max(n_pages, 0)), false) {
    PG_CHECK(n_pages > 0, "page_pool: {} pages; need at least one", n_pages);
    PG_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0, "page_pool: page size {} is not a power of two", page_size);
    for (int i = 0; i < n_pages; ++i) free_.push_back(i);
}

void page_pool::check_page(int32_t p, const char * what) const {
    PG_CHECK(p >= 0 && p < n_, "page_pool: {} of page {} outside the pool of {}", what, p, n_);
}

int page_pool::refs(int32_t page) const {
    check_page(page, "refs");
    return refs_[size_t(page)];
}

bool page_pool::is_cached(int32_t page) const {
    check_page(page, "is_cached");
    return cached_[size_t(page)];
}

void page_pool::alloc(int n, std::vector<int32_t> & pages) {
    PG_CHECK(n >= 0, "page_pool: alloc of {} pages", n);
    PG_CHECK(can_alloc(n), "page_pool: {}", refusal(n));
    for (int i = 0; i < n; ++i) {
        int32_t p;
        if (!free_.empty()) {
            p = free_.front();
            free_.pop_front();
        } else {
            p = lru_.front();
            lru_.pop_front();
            cached_[size_t(p)] = false;
            if (on_evict) on_evict(p);
        }
        refs_[size_t(p)] = 1;
        n_refs_++;
        pages.push_back(p);
    }
}

void page_pool::free(std::vector<int32_t> & pages) {
    for (int32_t p : pages) {
        check_page(p, "free");
        PG_CHECK(refs_[size_t(p)] > 0, "page_pool: page {} freed twice", p);
        n_refs_--;
        if (--refs_[size_t(p)] > 0) continue;
        if (cached_[size_t(p)]) lru_pos_[size_t(p)] = lru_.insert(lru_.end(), p);
        else free_.push_back(p);
    }
    pages.clear();
}

void page_pool::share(int32_t page) {
    check_page(page, "share");
    if (refs_[size_t(page)] == 0) {
        PG_CHECK(cached_[size_t(page)], "page_pool: page {} is free and not cached; it cannot be shared", page);
        lru_.erase(lru_pos_[size_t(page)]);
    }
    refs_[size_t(page)]++;
    n_refs_++;
}

void page_pool::set_cached(int32_t page, bool cached) {
    check_page(page, "set_cached");
    if (cached_[size_t(page)] == cached) return;
    cached_[size_t(page)] = cached;
    if (refs_[size_t(page)] > 0) return;   // in use: the flag decides where it goes when freed
    if (cached) {
        free_.erase(std::find(free_.begin(), free_.end(), page));
        lru_pos_[size_t(page)] = lru_.insert(lru_.end(), page);
    } else {
        lru_.erase(lru_pos_[size_t(page)]);
        free_.push_back(page);
    }
}

std::string page_pool::refusal(int n) const {
    if (can_alloc(n)) return "";
    return fmt::format("not enough MLA cache pages: need {}, {} of {} free ({} tokens per page)", n, n_free(), n_, page_size_);
}

std::string pool_plan::str() const {
    return fmt::format("{} KDA slots + {} prefix snapshots x {} B + {} MLA pages x {} B ({} tokens each) = {:.1f} MiB", n_slots,
                       n_snapshots, slot_bytes, n_pages, page_bytes, page_size, double(total_bytes()) / (1 << 20));
}

pool_plan plan_pools(const kimi_config & c, int64_t budget_bytes, int max_num_seqs, int page_size, int max_model_len,
                     int n_snapshots) {
    PG_CHECK(max_num_seqs > 0, "max_num_seqs {} must be >= 1", max_num_seqs);
    PG_CHECK(max_model_len > 0, "max_model_len {} must be >= 1", max_model_len);
    PG_CHECK(n_snapshots >= 0, "prefix snapshots {} must be >= 0", n_snapshots);
    pool_plan p;
    p.page_size = page_size;
    p.n_slots = max_num_seqs;
    p.n_snapshots = n_snapshots;
    p.slot_bytes = state_slot_bytes(c);
    p.page_bytes = state_page_bytes(c, page_size);
    const int per_seq = (max_model_len + page_size - 1) / page_size;
    const int64_t fixed = int64_t(max_num_seqs + n_snapshots) * p.slot_bytes;
    const int64_t need_min = fixed + int64_t(per_seq) * p.page_bytes;
    PG_CHECK(budget_bytes >= need_min,
             "memory budget of {} bytes cannot hold {} KDA slots and {} prefix snapshots ({} B each) plus the {} MLA pages "
             "({} B each) of one {}-token sequence: need at least {} bytes",
             budget_bytes, max_num_seqs, n_snapshots, p.slot_bytes, per_seq, p.page_bytes, max_model_len, need_min);
    const int64_t pages = p.page_bytes > 0 ? (budget_bytes - fixed) / p.page_bytes : int64_t(per_seq) * max_num_seqs;
    p.n_pages = int(std::min<int64_t>(pages, int64_t(per_seq) * max_num_seqs));
    return p;
}

} // namespace perigee
