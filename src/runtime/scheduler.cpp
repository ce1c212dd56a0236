#include "runtime/scheduler.h"

#include "core/error.h"
#include "runtime/prefix-cache.h"

#include <algorithm>

namespace perigee {

scheduler::scheduler(const scheduler_options & opt, slot_pool & slots, page_pool & pages, prefix_cache * cache)
    : opt_(opt), slots_(slots), pages_(pages), cache_(cache) {
    PG_CHECK(opt.snapshot_interval_pages >= 0, "scheduler: snapshot_interval_pages {} must be >= 0", opt.snapshot_interval_pages);
    PG_CHECK(opt.max_num_batched_tokens >= 1, "scheduler: max_num_batched_tokens {} must be >= 1", opt.max_num_batched_tokens);
    PG_CHECK(opt.max_prefill_chunk >= 0, "scheduler: max_prefill_chunk {} must be >= 0", opt.max_prefill_chunk);
}

void scheduler::add(sequence * s) {
    PG_CHECK(s && s->status == seq_status::WAITING && s->slot < 0 && s->pages.empty() && s->n_cached == 0,
             "scheduler: sequence {} added in state {} (must be fresh and waiting)", s ? s->id : 0,
             s ? seq_status_name(s->status) : "null");
    PG_CHECK(s->n_tokens() >= 1, "scheduler: sequence {} has no tokens", s->id);
    waiting_.push_back(s);
}

void scheduler::release(sequence * s) {
    if (s->slot >= 0) slots_.free(s->slot);
    s->slot = -1;
    pages_.free(s->pages);
    s->n_cached = 0;
    if (s->snapshot_pin >= 0 && cache_) cache_->unpin(s->snapshot_pin);
    s->snapshot_pin = -1;
    s->page_hashes.clear();
    s->cache_blocked = false;
}

int scheduler::chunk(const sequence * s, int32_t start, int budget) const {
    const int32_t left = s->n_tokens() - start;
    int n = std::min(left, budget);
    if (opt_.max_prefill_chunk > 0 && left > 1) n = std::min(n, opt_.max_prefill_chunk);
    if (!cache_ || start >= s->n_prompt || n <= 0) return n;
    const int32_t ps = pages_.page_size();
    int32_t e = start + n;
    const int32_t last = ((s->n_prompt - 1) / ps) * ps;   // last page boundary strictly inside the prompt
    if (start < last && last < e) e = last;
    if (opt_.snapshot_interval_pages > 0) {
        const int32_t every = opt_.snapshot_interval_pages * ps;
        const int32_t next = (start / every + 1) * every;
        if (next < e && next <= s->n_prompt) e = next;
    }
    if (e < s->n_prompt && e % ps != 0 && (e / ps) * ps > start) e = (e / ps) * ps;   // cut short: end on a boundary
    return e - start;
}

void scheduler::preempt(sequence * s) {
    auto it = std::find(running_.begin(), running_.end(), s);
    PG_ASSERT(it != running_.end());
    running_.erase(it);
    release(s);
    s->status = seq_status::WAITING;
    s->n_preemptions++;
    n_preemptions_++;
    waiting_.push_front(s);
}

step_plan scheduler::schedule() {
    step_plan p;
    int budget = opt_.max_num_batched_tokens;
    // 1. running, oldest first; preempt the youngest when pages run out.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
        sequence * s = running_[i];
        const int n = chunk(s, s->n_cached, budget);
        const int need = pages_.pages_for(int64_t(s->n_cached) + n) - int(s->pages.size());
        bool self_preempted = false;
        while (!pages_.can_alloc(need)) {
            sequence * victim = running_.back();
            preempt(victim);
            p.preempted.push_back(victim);
            if (victim == s) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break;   // s was the youngest: nothing after it remains
        pages_.alloc(std::max(need, 0), s->pages);
        p.items.push_back({s, s->n_cached, n, false});
        budget -= n;
        ++i;
    }
    // 2. admit waiting sequences FIFO (not in a step that had to preempt).
    while (p.preempted.empty() && !waiting_.empty() && budget > 0 && slots_.n_free() > 0) {
        sequence * s = waiting_.front();
        prefix_hit hit;
        if (cache_) hit = cache_->lookup(s->tokens, std::min(s->n_prompt, s->n_tokens() - 1));
        const int n = chunk(s, hit.n_tokens, budget);
        const int need = pages_.pages_for(int64_t(hit.n_tokens) + n) - int(hit.pages.size());
        const int revive = cache_ ? cache_->pages_to_revive(hit) : 0;
        if (!pages_.can_alloc(need + revive)) break;
        waiting_.pop_front();
        s->slot = *slots_.alloc();
        if (cache_) cache_->acquire(hit, *s);   // before alloc: alloc may evict unreferenced cached pages
        pages_.alloc(need, s->pages);
        s->status = seq_status::PREFILL;
        running_.push_back(s);
        scheduled_seq item{s, s->n_cached, n, true};
        item.restore_snapshot = s->snapshot_pin;
        p.items.push_back(item);
        budget -= n;
    }
    for (const auto & it : p.items) p.n_tokens += it.n_tokens;
    return p;
}

void scheduler::commit(const step_plan & p) {
    for (const auto & it : p.items) {
        sequence * s = it.seq;
        if (s->is_finished()) continue;
        PG_ASSERT(s->n_cached == it.pos0);
        s->n_cached += it.n_tokens;
        s->status = s->n_cached >= s->n_prompt ? seq_status::DECODE : seq_status::PREFILL;
        if (cache_) cache_->register_pages(*s);
    }
}

void scheduler::finish(sequence * s, finish_reason why, const std::string & error) {
    if (s->is_finished()) return;
    auto w = std::find(waiting_.begin(), waiting_.end(), s);
    if (w != waiting_.end()) waiting_.erase(w);
    auto r = std::find(running_.begin(), running_.end(), s);
    if (r != running_.end()) running_.erase(r);
    release(s);
    s->status = seq_status::FINISHED;
    s->finished = why;
    s->error = error;
}

} // namespace perigee
