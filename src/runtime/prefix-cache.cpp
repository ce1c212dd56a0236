#include "runtime/prefix-cache.h"

#include "core/error.h"

#include <algorithm>

namespace perigee {

namespace {

uint64_t mix64(uint64_t x) {   // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

} // namespace

uint64_t prefix_cache::page_hash(uint64_t parent, const int32_t * tokens, int n) {
    uint64_t h = mix64(parent ^ 0x70726566697863ull);
    for (int i = 0; i < n; ++i) h = mix64(h ^ uint64_t(uint32_t(tokens[i])));
    return h;
}

prefix_cache::prefix_cache(page_pool & pages, int n_snapshots, bool need_snapshots)
    : pages_(pages), ps_(pages.page_size()), need_snapshots_(need_snapshots), page_key_(size_t(pages.capacity()), 0),
      page_indexed_(size_t(pages.capacity()), false) {
    PG_CHECK(n_snapshots >= 0, "prefix_cache: {} snapshots", n_snapshots);
    PG_CHECK(!need_snapshots || n_snapshots >= 1, "prefix_cache: a model with KDA layers needs at least one snapshot (got {})",
             n_snapshots);
    snap_owner_.assign(size_t(n_snapshots), 0);
    snap_used_.assign(size_t(n_snapshots), false);
    snap_pins_.assign(size_t(n_snapshots), 0);
    snap_lru_pos_.resize(size_t(n_snapshots));
    for (int i = n_snapshots - 1; i >= 0; --i) snap_free_.push_back(i);
    st_.snapshots_total = n_snapshots;
    pages_.on_evict = [this](int32_t p) { evict_page(p); };
}

prefix_cache::~prefix_cache() { pages_.on_evict = nullptr; }

bool prefix_cache::matches(const entry & e, uint64_t parent, const int32_t * tokens) const {
    return e.parent == parent && std::equal(e.tokens.begin(), e.tokens.end(), tokens);
}

prefix_hit prefix_cache::lookup(const std::vector<int32_t> & tokens, int32_t limit) const {
    st_.lookups++;
    prefix_hit h;
    limit = std::min<int32_t>(limit, int32_t(tokens.size()));
    uint64_t parent = root_hash;
    int best = -1;
    int32_t best_snap = -1;
    for (int i = 0; int64_t(i + 1) * ps_ <= limit; ++i) {
        const int32_t * t = tokens.data() + int64_t(i) * ps_;
        const uint64_t key = page_hash(parent, t, ps_);
        auto it = map_.find(key);
        if (it == map_.end() || !matches(it->second, parent, t)) break;
        h.pages.push_back(it->second.page);
        h.hashes.push_back(key);
        if (!need_snapshots_ || it->second.snapshot >= 0) {
            best = i;
            best_snap = it->second.snapshot;
        }
        parent = key;
    }
    h.pages.resize(size_t(best + 1));
    h.hashes.resize(size_t(best + 1));
    h.n_tokens = (best + 1) * ps_;
    h.snapshot = need_snapshots_ ? best_snap : -1;
    return h;
}

int prefix_cache::pages_to_revive(const prefix_hit & h) const {
    int n = 0;
    for (int32_t p : h.pages) n += pages_.refs(p) == 0;
    return n;
}

void prefix_cache::acquire(const prefix_hit & h, sequence & s) {
    PG_CHECK(s.pages.empty() && s.n_cached == 0 && s.snapshot_pin < 0,
             "prefix_cache: sequence {} already holds pages or a snapshot", s.id);
    PG_CHECK(!need_snapshots_ || h.n_tokens == 0 || h.snapshot >= 0, "prefix_cache: a hit of {} tokens without a KDA snapshot",
             h.n_tokens);
    s.page_hashes.clear();
    s.cache_blocked = false;
    s.n_prefix_hit = h.n_tokens;
    if (h.n_tokens == 0) return;
    for (int32_t p : h.pages) {
        PG_CHECK(pages_.is_cached(p), "prefix_cache: hit page {} is not indexed", p);
        pages_.share(p);
    }
    s.pages = h.pages;
    s.page_hashes = h.hashes;
    s.n_cached = h.n_tokens;
    if (h.snapshot >= 0) {
        PG_CHECK(snap_used_[size_t(h.snapshot)], "prefix_cache: hit snapshot {} is not in use", h.snapshot);
        if (snap_pins_[size_t(h.snapshot)]++ == 0) snap_lru_.erase(snap_lru_pos_[size_t(h.snapshot)]);
        s.snapshot_pin = h.snapshot;
        st_.snapshot_pins++;
    }
    st_.hits++;
    st_.hit_tokens += uint64_t(h.n_tokens);
}

void prefix_cache::unpin(int32_t snap) {
    PG_CHECK(snap >= 0 && snap < n_snapshots() && snap_pins_[size_t(snap)] > 0, "prefix_cache: snapshot {} is not pinned", snap);
    st_.snapshot_pins--;
    if (--snap_pins_[size_t(snap)] == 0) snap_lru_pos_[size_t(snap)] = snap_lru_.insert(snap_lru_.end(), snap);
}

void prefix_cache::touch(int32_t snap) {
    if (snap_pins_[size_t(snap)] > 0) return;
    snap_lru_.splice(snap_lru_.end(), snap_lru_, snap_lru_pos_[size_t(snap)]);
}

void prefix_cache::register_pages(sequence & s) {
    if (s.cache_blocked) return;
    const int32_t full = std::min(s.n_cached, s.n_prompt) / ps_;
    while (int32_t(s.page_hashes.size()) < full) {
        const size_t i = s.page_hashes.size();
        const uint64_t parent = i == 0 ? root_hash : s.page_hashes[i - 1];
        const int32_t * t = s.tokens.data() + int64_t(i) * ps_;
        const uint64_t key = page_hash(parent, t, ps_);
        auto it = map_.find(key);
        if (it == map_.end()) {
            const int32_t page = s.pages[i];
            PG_CHECK(!page_indexed_[size_t(page)], "prefix_cache: page {} of sequence {} is already indexed", page, s.id);
            map_.emplace(key, entry{parent, std::vector<int32_t>(t, t + ps_), page, -1});
            page_key_[size_t(page)] = key;
            page_indexed_[size_t(page)] = true;
            pages_.set_cached(page, true);
            st_.entries++;
        } else if (!matches(it->second, parent, t)) {
            s.cache_blocked = true;   // a hash collision: index nothing more of this prompt
            return;
        }
        // else: the same prefix page is already indexed (another sequence computed it): keep that one
        s.page_hashes.push_back(key);
    }
}

int32_t prefix_cache::snapshot_for(const sequence & s, int level) {
    if (!need_snapshots_ || s.cache_blocked || level < 0 || level >= int(s.page_hashes.size())) return -1;
    auto it = map_.find(s.page_hashes[size_t(level)]);
    if (it == map_.end()) return -1;   // the entry was evicted meanwhile (its page was someone else's)
    const uint64_t parent = level == 0 ? root_hash : s.page_hashes[size_t(level) - 1];
    if (!matches(it->second, parent, s.tokens.data() + int64_t(level) * ps_)) return -1;
    if (it->second.snapshot >= 0) {
        touch(it->second.snapshot);
        return -1;
    }
    const int32_t snap = alloc_snapshot();
    if (snap < 0) return -1;
    it->second.snapshot = snap;
    snap_owner_[size_t(snap)] = it->first;
    st_.snapshots_taken++;
    return snap;
}

int32_t prefix_cache::alloc_snapshot() {
    int32_t snap = -1;
    if (!snap_free_.empty()) {
        snap = snap_free_.back();
        snap_free_.pop_back();
    } else if (!snap_lru_.empty()) {
        snap = snap_lru_.front();
        snap_lru_.pop_front();
        auto it = map_.find(snap_owner_[size_t(snap)]);
        PG_ASSERT(it != map_.end() && it->second.snapshot == snap);
        it->second.snapshot = -1;
        st_.snapshots_evicted++;
        st_.snapshots_used--;
    } else {
        return -1;   // every snapshot is pinned
    }
    snap_used_[size_t(snap)] = true;
    snap_lru_pos_[size_t(snap)] = snap_lru_.insert(snap_lru_.end(), snap);
    st_.snapshots_used++;
    return snap;
}

void prefix_cache::free_snapshot(int32_t snap) {
    PG_CHECK(snap_pins_[size_t(snap)] == 0, "prefix_cache: snapshot {} freed while pinned", snap);
    snap_lru_.erase(snap_lru_pos_[size_t(snap)]);
    snap_used_[size_t(snap)] = false;
    snap_free_.push_back(snap);
    st_.snapshots_used--;
}

void prefix_cache::evict_page(int32_t page) {
    if (!page_indexed_[size_t(page)]) return;
    auto it = map_.find(page_key_[size_t(page)]);
    PG_ASSERT(it != map_.end() && it->second.page == page);
    if (it->second.snapshot >= 0) free_snapshot(it->second.snapshot);
    map_.erase(it);
    page_indexed_[size_t(page)] = false;
    st_.entries--;
    st_.pages_evicted++;
}

prefix_cache_stats prefix_cache::stats() const { return st_; }

// --- snapshot_store ---

snapshot_store::snapshot_store(model_runner & r, int n_snapshots) {
    PG_CHECK(n_snapshots >= 0, "snapshot_store: {} snapshots", n_snapshots);
    pool_ = r.new_snapshots(n_snapshots);
}

} // namespace perigee
