// Prefix caching with recurrent-state snapshots (issue 6 item 6; nano-vllm's block_manager hashing,
// extended for the hybrid KDA/MLA model).
//
// WHY SNAPSHOTS. An MLA layer's cache is per position: a page of latents written for a prefix is
// valid for any sequence with that prefix. A KDA layer's state is a running summary: resuming at
// token n needs the conv windows and recurrent state after EXACTLY n tokens. So a reusable prefix is
// (the MLA pages of its first k full pages) + (a snapshot of every KDA layer's slot state at the
// boundary k * page_size).
//
// INDEX. Every full page of PROMPT tokens gets a chained hash h_i = H(h_{i-1}, tokens of page i)
// (h_{-1} a fixed root). The index maps h_i -> entry {parent hash, the page's tokens, the MLA page
// id, an optional snapshot id for the boundary at the END of page i}. Lookups verify the parent hash
// and the tokens at every level, so a hash collision can only cause a miss, never a wrong hit (a
// sequence whose registration collides stops indexing its prompt: cache_blocked).
//
// PAGES are shared, reference-counted (page_pool) and read-only once full: a sequence only writes
// positions >= its n_cached, and every shared page lies wholly below the hit. A page whose last
// reference goes stays indexed in the pool's cached LRU list; alloc() evicts the least recently
// freed one only when no plain free page is left (page_pool::on_evict drops the entry and frees its
// snapshot).
//
// SNAPSHOTS live in a separate, bounded pool (snapshot_store holds the bytes: state_slot_bytes(cfg)
// each; this class does the bookkeeping). When the pool is full, taking a new snapshot evicts the
// least recently used unpinned one (it is detached from its entry; the entry's page stays cached).
// A snapshot is pinned only from admission (acquire) until the engine has copied it into the
// sequence's slot in the same step (unpin), so eviction cannot race a restore.
//
// TAKING SNAPSHOTS. The KDA state exists only at chunk ends, so with caching on the scheduler cuts
// prefill chunks at page boundaries (scheduler.h): a chunk cut short by the budget ends on a page
// boundary; the chunk that would cross the last page boundary strictly inside the prompt,
// B = ((n_prompt - 1) / page_size) * page_size, ends at B (one extra step per prompt, so that an
// identical or extending prompt can resume at B); with snapshot_interval_pages > 0 chunks also end
// at every multiple of that many pages (finer hits for prompts that diverge early, more steps).
// After the forward, a sequence whose chunk ended on a page boundary <= n_prompt has its full
// prompt pages indexed and the slot's state copied into a new snapshot for that boundary (if the
// boundary has none yet).
//
// HITS. On admission the scheduler looks up the longest indexed chain of full prompt pages whose
// END carries a snapshot, limited to min(n_prompt, n_tokens - 1) tokens so at least one token is
// computed and there are logits to sample. It shares those pages, pins the snapshot, sets n_cached
// to the hit length; the engine restores the snapshot into the fresh slot (instead of zeroing it)
// and prefills only the rest. A prompt whose common prefix with a cached one ends inside a page
// reuses the full pages below that page and recomputes the partial page (no copy-on-write): the
// hit is at most the last boundary <= the common prefix that carries a snapshot.
//
// EXACTNESS. A hit restores bit-for-bit what a cold run had at that boundary; a cold run chunked at
// the same boundaries gives bit-identical logits. With other chunkings the results differ only by
// the forward's own chunking-invariance (tests: <= 1e-5 relative).
//
// Only prompt pages are indexed (generated tokens are not). Models without KDA layers need no
// snapshots: any indexed page chain is a hit. The snapshot bytes live with the backend's state pools
// (snapshot_store below: host memory for CPU, device memory for CUDA).
#pragma once
#include "model/state.h"
#include "runtime/model-runner.h"
#include "runtime/block-manager.h"
#include "runtime/sequence.h"

#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

namespace perigee {

struct prefix_hit {
    int32_t n_tokens = 0;            // cached prefix length (a multiple of page_size; 0 = miss)
    std::vector<int32_t> pages;      // its MLA pages, in position order
    std::vector<uint64_t> hashes;    // their chained hashes
    int32_t snapshot = -1;           // KDA snapshot at the boundary n_tokens (-1 when no KDA layers)
};

struct prefix_cache_stats {
    int entries = 0;                 // indexed pages
    int snapshots_used = 0, snapshots_total = 0;
    int snapshot_pins = 0;           // pinned snapshots (0 between steps)
    uint64_t lookups = 0, hits = 0, hit_tokens = 0;
    uint64_t snapshots_taken = 0, snapshots_evicted = 0, pages_evicted = 0;
};

class prefix_cache {
public:
    // Registers itself as pages.on_evict. `need_snapshots` = the model has KDA layers.
    prefix_cache(page_pool & pages, int n_snapshots, bool need_snapshots);
    ~prefix_cache();
    prefix_cache(const prefix_cache &) = delete;
    prefix_cache & operator=(const prefix_cache &) = delete;

    static uint64_t page_hash(uint64_t parent, const int32_t * tokens, int n);
    static constexpr uint64_t root_hash = 0x6b696d692d6b3321ull;

    // The longest usable cached prefix of tokens[0, limit) (no side effects).
    prefix_hit lookup(const std::vector<int32_t> & tokens, int32_t limit) const;
    // Hit pages that are unreferenced now (counted in pages.n_free(); acquiring them uses free pages).
    int pages_to_revive(const prefix_hit & h) const;
    // Takes the hit for a waiting sequence with nothing cached: shares its pages into s.pages, sets
    // s.page_hashes, s.n_cached and s.n_prefix_hit, pins the snapshot into s.snapshot_pin.
    void acquire(const prefix_hit & h, sequence & s);
    // Releases a pin taken by acquire (after the restore, or when the sequence is released first).
    void unpin(int32_t snapshot);
    // Indexes s's full prompt pages below min(n_cached, n_prompt) not indexed yet (after a commit).
    void register_pages(sequence & s);
    // For a chunk of s that ended at the page boundary (level + 1) * page_size: a snapshot id to
    // copy the slot's state into (the boundary's entry had none), or -1 (already has one, no entry,
    // or every snapshot is pinned).
    int32_t snapshot_for(const sequence & s, int level);
    prefix_cache_stats stats() const;
    int n_snapshots() const { return int(snap_owner_.size()); }

private:
    struct entry {
        uint64_t parent = 0;
        std::vector<int32_t> tokens;
        int32_t page = -1;
        int32_t snapshot = -1;
    };
    bool matches(const entry & e, uint64_t parent, const int32_t * tokens) const;
    void evict_page(int32_t page);
    void free_snapshot(int32_t snap);
    int32_t alloc_snapshot();
    void touch(int32_t snap);

    page_pool & pages_;
    const int ps_;
    const bool need_snapshots_;
    std::unordered_map<uint64_t, entry> map_;
    std::vector<uint64_t> page_key_;          // per page: its entry's key (valid when page_indexed_)
    std::vector<bool> page_indexed_;
    // snapshots
    std::vector<uint64_t> snap_owner_;        // entry key owning each used snapshot
    std::vector<bool> snap_used_;
    std::vector<int32_t> snap_pins_;
    std::vector<int32_t> snap_free_;
    std::list<int32_t> snap_lru_;             // used, unpinned; least recently used first
    std::vector<std::list<int32_t>::iterator> snap_lru_pos_;
    mutable prefix_cache_stats st_;
};

// The bytes of the snapshot pool: n snapshots of one KDA slot each (conv windows + recurrent state
// of every KDA layer, F32 like the pools; bytes_per_snapshot() == state_slot_bytes(cfg)). They live
// where the runner's backend keeps its states (backend.h slot_snapshots: host memory on CPU, device
// memory on CUDA, where a save/load is a device-to-device copy); this wrapper only names the runner.
class snapshot_store {
public:
    snapshot_store(model_runner & r, int n_snapshots);
    int capacity() const { return pool_->capacity(); }
    int64_t bytes_per_snapshot() const { return pool_->bytes_per_snapshot(); }
    void save(int slot, int snap) { pool_->save(slot, snap); }   // slot -> snapshot
    void load(int snap, int slot) { pool_->load(snap, slot); }   // snapshot -> slot (every KDA byte)

private:
    std::unique_ptr<slot_snapshots> pool_;
};

} // namespace perigee
