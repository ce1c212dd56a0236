// The scheduler: which sequences run this step and how many tokens each feeds. Pure bookkeeping
// (no tensors), after nano-vllm's scheduler.py and vLLM v1's single token budget.
//
// POLICY (one shared per-step token budget, max_num_batched_tokens):
//  1. Running sequences, oldest admission first. Each gets min(its uncached tokens, the budget
//     left): a decoding sequence feeds its one new token, a sequence part-way through its prompt
//     feeds the next chunk. Decodes are therefore never starved by prefills of younger requests.
//  2. If a running sequence needs pages and none are free, the YOUNGEST running sequence is
//     preempted (slot and pages freed, n_cached reset to 0, put back at the FRONT of the waiting
//     queue, recomputed later from its prompt + generated tokens); if the needy sequence is itself
//     the youngest, it is the one preempted.
//  3. If nothing was preempted this step, waiting sequences are admitted strictly in FIFO order
//     while a slot is free, budget is left and the pages of their first chunk are free; the first
//     that does not fit stops admission (no overtaking), so long prompts are not starved.
//  Chunked prefill: a prompt longer than the remaining budget is fed in chunks over several steps,
//  alongside the decodes; `max_prefill_chunk` (0 = no cap) additionally caps one chunk.
//  Prefix caching (a prefix_cache given; runtime/prefix-cache.h): an admitted sequence first takes
//  the longest cached prefix (shared pages, a pinned KDA snapshot; its item carries
//  restore_snapshot and starts at pos0 = the hit), and prefill chunks are cut at page boundaries
//  so that KDA snapshots can be taken there: a chunk cut short by the budget ends on a page
//  boundary (when one lies inside it), a chunk never crosses the last page boundary strictly inside
//  the prompt, nor (snapshot_interval_pages > 0) a multiple of that many pages. Decodes are never cut.
// Cancellation (finish with CANCELLED) at any point frees the slot and pages exactly once.
#pragma once
#include "runtime/block-manager.h"
#include "runtime/sequence.h"

#include <deque>
#include <vector>

namespace perigee {

struct scheduler_options {
    int max_num_batched_tokens = 512;   // per-step token budget
    int max_prefill_chunk = 0;          // 0 = only the budget limits a prefill chunk
    int snapshot_interval_pages = 0;    // with a prefix cache: also cut prefill chunks every this many pages
};

class prefix_cache;

struct scheduled_seq {
    sequence * seq = nullptr;
    int32_t pos0 = 0;           // first position fed (= n_cached before the step)
    int32_t n_tokens = 0;       // tokens fed this step
    bool fresh_slot = false;    // slot newly assigned: the engine must zero it before the forward
    int32_t restore_snapshot = -1;   // prefix hit: restore this KDA snapshot into the slot instead
                                     //  of zeroing it, then prefix_cache::unpin it
    bool samples() const { return pos0 + n_tokens == seq->n_tokens(); }
};

struct step_plan {
    std::vector<scheduled_seq> items;    // in batch order
    std::vector<sequence *> preempted;   // this step's preemptions (now waiting again)
    int n_tokens = 0;
    bool empty() const { return items.empty(); }
};

class scheduler {
public:
    scheduler(const scheduler_options & opt, slot_pool & slots, page_pool & pages, prefix_cache * cache = nullptr);
    // Queues a sequence (status WAITING, nothing cached, no slot or pages).
    void add(sequence * s);
    step_plan schedule();
    // After the forward ran: n_cached += n_tokens for every item; PREFILL/DECODE status updated;
    // with a prefix cache, the sequence's newly full prompt pages are indexed.
    void commit(const step_plan & p);
    // Finishes a sequence (any state, idempotent): frees its slot and pages, drops it from the
    // queues, sets status FINISHED and the reason (the first reason wins).
    void finish(sequence * s, finish_reason why, const std::string & error = "");
    int n_waiting() const { return int(waiting_.size()); }
    int n_running() const { return int(running_.size()); }
    bool has_work() const { return !waiting_.empty() || !running_.empty(); }
    uint64_t n_preemptions() const { return n_preemptions_; }
    prefix_cache * cache() const { return cache_; }
    const std::deque<sequence *> & waiting() const { return waiting_; }
    const std::vector<sequence *> & running() const { return running_; }

private:
    void preempt(sequence * s);
    void release(sequence * s);
    int chunk(const sequence * s, int32_t start, int budget) const;

    scheduler_options opt_;
    slot_pool & slots_;
    page_pool & pages_;
    prefix_cache * cache_ = nullptr;
    std::deque<sequence *> waiting_;
    std::vector<sequence *> running_;   // admission order, oldest first
    uint64_t n_preemptions_ = 0;
};

} // namespace perigee
