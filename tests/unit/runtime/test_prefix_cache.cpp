// Prefix caching with KDA state snapshots (runtime/prefix-cache.h): bookkeeping (ref-counted pages,
// index, snapshot LRU, page-boundary chunk cuts, 1,000 random events back to baseline) and, on
// k3-tiny, kimi-linear-tiny and k31-tiny (indexer key pages) synthesized in-process, hits that equal
// cold runs exactly, controls that must fail, eviction, and random engine traffic back to baseline.
#include "core/error.h"
#include "rt_test_util.h"
#include "runtime/engine.h"
#include "runtime/step.h"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

using namespace perigee;
using namespace rt_test;

namespace {

constexpr int PS = 16;   // page size everywhere below

std::unique_ptr<sequence> make_seq(uint64_t id, std::vector<int32_t> prompt, int max_tokens = 4) {
    auto s = std::make_unique<sequence>();
    s->id = id;
    s->tokens = std::move(prompt);
    s->n_prompt = s->n_tokens();
    s->sp.max_tokens = max_tokens;
    s->max_model_len = 1 << 20;
    return s;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t> & b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

std::vector<int32_t> head(const std::vector<int32_t> & a, int n) { return {a.begin(), a.begin() + n}; }

// Bookkeeping-only step (no model): prepare as the engine does (unpin restored snapshots), commit,
// take snapshots (ids only), append a token to sampling sequences.
void bk_step(scheduler & sch, prefix_cache & pc, const step_plan & p) {
    for (const auto & it : p.items)
        if (it.restore_snapshot >= 0) {
            pc.unpin(it.restore_snapshot);
            it.seq->snapshot_pin = -1;
        }
    sch.commit(p);
    for (const auto & it : p.items) {
        const int32_t e = it.pos0 + it.n_tokens;
        if (!it.seq->is_finished() && e % PS == 0 && e <= it.seq->n_prompt) (void)pc.snapshot_for(*it.seq, e / PS - 1);
    }
    for (const auto & it : p.items)
        if (it.samples()) {
            const finish_reason why = sequence_append(*it.seq, 7);
            if (why != finish_reason::NONE) sch.finish(it.seq, why);
        }
}

std::vector<int> chunks_of(scheduler & sch, prefix_cache & pc, sequence * s) {
    std::vector<int> out;
    while (s->n_cached < s->n_prompt) {
        step_plan p = sch.schedule();
        for (auto & it : p.items)
            if (it.seq == s) out.push_back(it.n_tokens);
        bk_step(sch, pc, p);
    }
    return out;
}

} // namespace

// ---------------------------------------------------------------------------------------------
// Bookkeeping

TEST(prefix_pages, refcounts_cached_lru_and_eviction_order) {
    page_pool pp(4, PS);
    std::vector<int32_t> evicted;
    pp.on_evict = [&](int32_t p) { evicted.push_back(p); };
    std::vector<int32_t> a, b;
    pp.alloc(2, a);   // pages 0, 1
    pp.set_cached(a[0], true);
    pp.share(a[0]);
    EXPECT_EQ(pp.refs(a[0]), 2);
    EXPECT_EQ(pp.n_refs(), 3);
    b = {a[0]};
    pp.free(b);                       // one reference left
    EXPECT_EQ(pp.n_used(), 2);
    pp.free(a);                       // page 0 -> cached LRU, page 1 -> plain free list
    EXPECT_EQ(pp.n_free(), 4);
    EXPECT_EQ(pp.n_cached_free(), 1);
    EXPECT_EQ(pp.n_refs(), 0);
    EXPECT_THROW(pp.share(1), error) << "a plain free page holds nothing to share";
    std::vector<int32_t> c;
    pp.alloc(3, c);                   // plain pages first: 2, 3, 1; the cached page survives
    EXPECT_TRUE(evicted.empty());
    EXPECT_EQ(pp.n_cached_free(), 1);
    pp.alloc(1, c);                   // only the cached page is left: evicted
    ASSERT_EQ(evicted.size(), 1u);
    EXPECT_EQ(evicted[0], 0);
    EXPECT_FALSE(pp.is_cached(0));
    pp.free(c);
    EXPECT_EQ(pp.n_free(), 4);
    EXPECT_THROW(pp.free(c = {2}), error) << "double free";
}

TEST(prefix_sched, prefill_chunks_end_on_page_boundaries_with_the_cache_only) {
    for (bool cached : {false, true}) {
        slot_pool slots(2);
        page_pool pages(32, PS);
        prefix_cache pc(pages, 4, true);
        scheduler sch({.max_num_batched_tokens = 20}, slots, pages, cached ? &pc : nullptr);
        auto s = make_seq(1, random_prompt(45, 1));
        sch.add(s.get());
        const auto ch = chunks_of(sch, pc, s.get());
        if (cached) EXPECT_EQ(ch, (std::vector<int>{16, 16, 13})) << "cut short -> boundary; never across 32";
        else EXPECT_EQ(ch, (std::vector<int>{20, 20, 5}));
    }
    // A whole-prompt budget: one cut at the last boundary inside the prompt (32 for 45, 16 for 32).
    for (auto [len, want] : {std::pair{45, std::vector<int>{32, 13}}, std::pair{32, std::vector<int>{16, 16}},
                             std::pair{10, std::vector<int>{10}}}) {
        slot_pool slots(1);
        page_pool pages(8, PS);
        prefix_cache pc(pages, 4, true);
        scheduler sch({.max_num_batched_tokens = 512}, slots, pages, &pc);
        auto s = make_seq(1, random_prompt(len, 2));
        sch.add(s.get());
        EXPECT_EQ(chunks_of(sch, pc, s.get()), want) << "prompt of " << len;
    }
    // snapshot_interval_pages = 1: every page boundary.
    slot_pool slots(1);
    page_pool pages(8, PS);
    prefix_cache pc(pages, 8, true);
    scheduler sch({.max_num_batched_tokens = 512, .snapshot_interval_pages = 1}, slots, pages, &pc);
    auto s = make_seq(1, random_prompt(50, 3));
    sch.add(s.get());
    EXPECT_EQ(chunks_of(sch, pc, s.get()), (std::vector<int>{16, 16, 16, 2}));
    EXPECT_EQ(pc.stats().snapshots_used, 3);
}

TEST(prefix_sched, hit_shares_pages_and_needs_a_snapshot_at_its_end) {
    slot_pool slots(3);
    page_pool pages(16, PS);
    prefix_cache pc(pages, 4, true);
    scheduler sch({.max_num_batched_tokens = 512}, slots, pages, &pc);
    const auto base = random_prompt(45, 4);
    auto a = make_seq(1, base, 8);
    sch.add(a.get());
    EXPECT_EQ(chunks_of(sch, pc, a.get()), (std::vector<int>{32, 13}));
    EXPECT_EQ(pc.stats().entries, 2);          // pages 0, 1 (page 2 is partial)
    EXPECT_EQ(pc.stats().snapshots_used, 1);   // at 32
    // Lookup limits: a 32-token prompt equal to the prefix may only use 16 (needs a token to
    // compute), and there is no snapshot at 16 -> miss; 33 tokens -> hit at 32.
    EXPECT_EQ(pc.lookup(head(base, 32), 31).n_tokens, 0);
    EXPECT_EQ(pc.lookup(head(base, 33), 32).n_tokens, 32);
    // Mid-page divergence at 40: full pages 0, 1 reused; page 2 recomputed.
    auto b = make_seq(2, concat(head(base, 40), random_prompt(10, 5)));
    sch.add(b.get());
    step_plan p = sch.schedule();
    ASSERT_EQ(p.items.size(), 2u);
    const scheduled_seq & ib = p.items[1];
    EXPECT_EQ(ib.seq, b.get());
    EXPECT_EQ(ib.pos0, 32);
    EXPECT_EQ(ib.n_tokens, 16) << "cut at b's last boundary 48";
    EXPECT_GE(ib.restore_snapshot, 0);
    EXPECT_EQ(b->n_prefix_hit, 32);
    EXPECT_EQ(b->pages[0], a->pages[0]);
    EXPECT_EQ(b->pages[1], a->pages[1]);
    EXPECT_NE(b->pages[2], a->pages[2]);
    EXPECT_EQ(pages.refs(a->pages[0]), 2);
    EXPECT_EQ(pc.stats().snapshot_pins, 1);
    bk_step(sch, pc, p);
    EXPECT_EQ(pc.stats().snapshot_pins, 0);
    // Finishing both: shared pages stay indexed but free; counters at baseline.
    sch.finish(a.get(), finish_reason::CANCELLED);
    sch.finish(b.get(), finish_reason::CANCELLED);
    EXPECT_EQ(pages.n_refs(), 0);
    EXPECT_EQ(pages.n_free(), pages.capacity());
    EXPECT_EQ(pages.n_cached_free(), pc.stats().entries);
    EXPECT_EQ(pc.stats().entries, 3);   // b's page 2 (32..47) indexed too
    EXPECT_EQ(pc.stats().snapshots_used, 2);   // 32 (a) and 48 (b)
}

TEST(prefix_sched, snapshot_pool_evicts_least_recently_used) {
    slot_pool slots(1);
    page_pool pages(32, PS);
    prefix_cache pc(pages, 2, true);
    scheduler sch({.max_num_batched_tokens = 512}, slots, pages, &pc);
    std::vector<std::vector<int32_t>> pr;
    std::vector<std::unique_ptr<sequence>> all;
    auto run = [&](const std::vector<int32_t> & prompt) {
        all.push_back(make_seq(all.size() + 1, prompt, 1));
        sch.add(all.back().get());
        while (!all.back()->is_finished()) bk_step(sch, pc, sch.schedule());
        return all.back()->n_prefix_hit;
    };
    for (uint32_t i = 0; i < 3; ++i) pr.push_back(random_prompt(40, 50 + i));
    EXPECT_EQ(run(pr[0]), 0);
    EXPECT_EQ(run(pr[1]), 0);
    EXPECT_EQ(run(pr[0]), 32);   // hit: pr[0]'s snapshot becomes the most recent
    EXPECT_EQ(run(pr[2]), 0);    // pool full: evicts pr[1]'s (least recently used)
    EXPECT_EQ(pc.stats().snapshots_evicted, 1u);
    EXPECT_EQ(pc.lookup(pr[1], 39).n_tokens, 0) << "evicted snapshot -> no usable prefix (pages alone are not enough)";
    EXPECT_EQ(pc.lookup(pr[0], 39).n_tokens, 32);
    EXPECT_EQ(pc.lookup(pr[2], 39).n_tokens, 32);
    EXPECT_EQ(pc.stats().entries, 6) << "pages outlive their snapshots";
    EXPECT_EQ(pages.n_refs(), 0);
}

TEST(prefix_sched, page_eviction_drops_entries_and_their_snapshots) {
    slot_pool slots(1);
    page_pool pages(4, PS);   // one 40-token prompt needs 3 pages
    prefix_cache pc(pages, 4, true);
    scheduler sch({.max_num_batched_tokens = 512}, slots, pages, &pc);
    auto a = make_seq(1, random_prompt(40, 60), 1), b = make_seq(2, random_prompt(40, 61), 1);
    sch.add(a.get());
    while (!a->is_finished()) bk_step(sch, pc, sch.schedule());
    EXPECT_EQ(pc.stats().entries, 2);
    sch.add(b.get());   // needs 3 pages: 2 plain + 1 evicted cached
    while (!b->is_finished()) bk_step(sch, pc, sch.schedule());
    const auto st = pc.stats();
    EXPECT_GE(st.pages_evicted, 1u);
    EXPECT_EQ(pc.lookup(a->tokens, 39).n_tokens, 0);
    EXPECT_EQ(st.pages_evicted, 1u);
    EXPECT_EQ(st.entries, 3);   // a's page 1 (unreachable without page 0) + b's two
    EXPECT_EQ(pages.n_free(), 4);
    EXPECT_EQ(pages.n_refs(), 0);
}

// 1,000 random admit / cancel / finish / step events over prompts that share prefixes: after every
// event, page references equal what the running sequences hold and no snapshot stays pinned; at
// the end slots, pages, references and pins are back to zero.
TEST(prefix_sched, thousand_random_events_leave_every_counter_at_baseline) {
    std::mt19937 rng(99);
    slot_pool slots(4);
    page_pool pages(20, 8);
    prefix_cache pc(pages, 6, true);
    scheduler sch({.max_num_batched_tokens = 40, .max_prefill_chunk = 24}, slots, pages, &pc);
    std::vector<std::vector<int32_t>> bases;
    for (uint32_t i = 0; i < 3; ++i) bases.push_back(random_prompt(48, 200 + i, 20));
    std::vector<std::unique_ptr<sequence>> all;
    std::vector<sequence *> open;
    uint64_t next = 1;
    int events = 0, preempted = 0;
    auto ps = 8;
    auto chk_step = [&](const step_plan & p) {   // as bk_step, with the page size 8
        for (const auto & it : p.items)
            if (it.restore_snapshot >= 0) {
                pc.unpin(it.restore_snapshot);
                it.seq->snapshot_pin = -1;
            }
        sch.commit(p);
        for (const auto & it : p.items) {
            const int32_t e = it.pos0 + it.n_tokens;
            if (!it.seq->is_finished() && e % ps == 0 && e <= it.seq->n_prompt) (void)pc.snapshot_for(*it.seq, e / ps - 1);
        }
        for (const auto & it : p.items)
            if (it.samples() && !it.seq->is_finished()) {
                const finish_reason why = sequence_append(*it.seq, 3);
                if (why != finish_reason::NONE) sch.finish(it.seq, why);
            }
    };
    while (events < 1000) {
        const int r = int(rng() % 10);
        if (r < 4) {
            const auto & base = bases[rng() % bases.size()];
            auto prompt = head(base, 1 + int(rng() % 48));
            const auto tail = random_prompt(int(rng() % 12), uint32_t(rng()), 20);
            all.push_back(make_seq(next++, concat(prompt, tail), 1 + int(rng() % 20)));
            sch.add(all.back().get());
            open.push_back(all.back().get());
        } else if (r < 6 && !open.empty()) {
            sch.finish(open[rng() % open.size()], finish_reason::CANCELLED);
        } else if (r < 7 && !open.empty()) {
            sch.finish(open[rng() % open.size()], finish_reason::STOP);
        } else {
            step_plan p = sch.schedule();
            preempted += int(p.preempted.size());
            chk_step(p);
        }
        ++events;
        std::erase_if(open, [](sequence * s) { return s->is_finished(); });
        int64_t held = 0;
        for (sequence * s : sch.running()) held += int64_t(s->pages.size());
        ASSERT_EQ(pages.n_refs(), held);
        ASSERT_EQ(slots.n_used(), sch.n_running());
        ASSERT_EQ(pc.stats().snapshot_pins, 0);
        ASSERT_LE(pc.stats().snapshots_used, 6);
        ASSERT_EQ(pc.stats().entries, [&] {
            int n = 0;
            for (int32_t p = 0; p < pages.capacity(); ++p) n += pages.is_cached(p);
            return n;
        }());
        for (sequence * s : sch.waiting()) ASSERT_TRUE(s->slot < 0 && s->pages.empty() && s->n_cached == 0 && s->snapshot_pin < 0);
    }
    for (sequence * s : open) sch.finish(s, finish_reason::CANCELLED);
    const auto st = pc.stats();
    EXPECT_EQ(slots.n_used(), 0);
    EXPECT_EQ(pages.n_used(), 0);
    EXPECT_EQ(pages.n_refs(), 0);
    EXPECT_EQ(pages.n_free(), pages.capacity());
    EXPECT_EQ(st.snapshot_pins, 0);
    EXPECT_GT(st.hits, 20u) << "the walk barely exercised hits";
    EXPECT_GT(st.snapshots_evicted, 0u);
    EXPECT_GT(st.pages_evicted, 0u);
    EXPECT_GT(preempted, 0) << "the walk never preempted; shrink the page pool";
    std::printf("[measure] random walk: %llu hits (%llu tokens), %llu snapshots taken, %llu evicted, %llu pages evicted, %d preemptions\n",
                (unsigned long long)st.hits, (unsigned long long)st.hit_tokens, (unsigned long long)st.snapshots_taken,
                (unsigned long long)st.snapshots_evicted, (unsigned long long)st.pages_evicted, preempted);
}

// ---------------------------------------------------------------------------------------------
// With a model: the engine's step mechanics (step_prepare / forward / step_commit) driven by hand,
// so every fed position's logits can be compared.

namespace {

// A runner plus the runtime's pools, scheduler and (optionally) prefix cache.
struct rig {
    model_runner & r;
    slot_pool slots;
    page_pool pages;
    std::unique_ptr<prefix_cache> pc;
    std::unique_ptr<snapshot_store> snaps;
    scheduler sch;
    std::function<void(const step_plan &)> after_prepare;   // test hook: runs before the forward
    std::map<uint64_t, std::map<int, std::vector<float>>> rows;   // request -> position -> logits
    std::vector<std::unique_ptr<sequence>> all;

    rig(model_runner & runner, bool cache, int n_snapshots = 8, int budget = 512, int n_pages = 0)
        : r(runner), slots(runner.state().n_slots), pages(n_pages > 0 ? n_pages : runner.state().n_pages, runner.state().page_size),
          pc(cache ? std::make_unique<prefix_cache>(pages, n_snapshots, true) : nullptr),
          snaps(cache ? std::make_unique<snapshot_store>(runner, n_snapshots) : nullptr),
          sch({.max_num_batched_tokens = budget}, slots, pages, pc.get()) {}

    sequence * add(const std::vector<int32_t> & prompt, int max_tokens) {
        all.push_back(make_seq(all.size() + 1, prompt, max_tokens));
        sch.add(all.back().get());
        return all.back().get();
    }
    // One step; greedy tokens for the sampling sequences. Returns the plan's (seq, chunk) list.
    std::vector<std::pair<uint64_t, int>> step() {
        step_plan p = sch.schedule();
        auto b = step_prepare(p, r, pc.get(), snaps.get(), /*all_rows=*/true);
        if (after_prepare) after_prepare(p);
        tensor lg = r.step(b);
        step_commit(p, sch, r, pc.get(), snaps.get());
        std::vector<std::pair<uint64_t, int>> fed;
        const int64_t V = lg.dim(1);
        int64_t row = 0;
        for (const auto & it : p.items) {
            fed.push_back({it.seq->id, it.n_tokens});
            for (int i = 0; i < it.n_tokens; ++i, ++row)
                rows[it.seq->id][it.pos0 + i] = std::vector<float>(lg.f32() + row * V, lg.f32() + (row + 1) * V);
            if (it.samples()) {
                const auto & last = rows[it.seq->id][it.pos0 + it.n_tokens - 1];
                const finish_reason why = sequence_append(*it.seq, int32_t(argmax(last)));
                if (why != finish_reason::NONE) sch.finish(it.seq, why);
            }
        }
        return fed;
    }
    void run_all() {
        while (sch.has_work()) step();
    }
    // Runs one request alone to completion; returns it.
    sequence * run(const std::vector<int32_t> & prompt, int max_tokens) {
        sequence * s = add(prompt, max_tokens);
        run_all();
        return s;
    }
};

// Logits rows of positions [from, to) of request a (rig x) vs request b (rig y): worst relative
// difference, and whether every row is bit-identical.
struct cmp_result {
    double worst = 0;
    bool exact = true;
    int n = 0;
};
cmp_result compare(const std::map<int, std::vector<float>> & a, const std::map<int, std::vector<float>> & b, int from, int to) {
    cmp_result c;
    for (int p = from; p < to; ++p) {
        auto ia = a.find(p), ib = b.find(p);
        if (ia == a.end() || ib == b.end()) {
            ADD_FAILURE() << "no logits at position " << p;
            c.exact = false;
            c.worst = INFINITY;
            continue;
        }
        c.worst = std::max(c.worst, rel_diff(ia->second, ib->second));
        c.exact = c.exact && std::memcmp(ia->second.data(), ib->second.data(), ia->second.size() * sizeof(float)) == 0;
        c.n++;
    }
    return c;
}

// The cold reference for a prompt: alone on a fresh runner state, chunked at the given sizes (as
// a cached run with the same boundaries feeds it), then greedy decoding; logits per position.
std::map<int, std::vector<float>> cold(model_runner & r, const std::vector<int32_t> & prompt, const std::vector<int> & chunks, int n_decode) {
    r.zero_slot(0);
    sim_seq s;
    s.tokens = prompt;
    s.slot = 0;
    s.pages = pages_range(0, r.state().n_pages);
    for (int c : chunks) feed(r, {{&s, c}});
    EXPECT_EQ(s.n_cached, int(prompt.size()));
    for (int i = 0; i < n_decode; ++i) {
        s.tokens.push_back(int32_t(argmax(s.rows.back())));
        if (i + 1 < n_decode) feed(r, {{&s, 1}});
    }
    std::map<int, std::vector<float>> m;
    for (size_t i = 0; i < s.rows.size(); ++i) m[int(i)] = s.rows[i];
    return m;
}

runner_options ropts(int slots, int pages) {
    runner_options o;
    o.n_slots = slots;
    o.n_pages = pages;
    o.page_size = PS;
    return o;
}

class prefix_model : public ::testing::TestWithParam<std::string> {};

} // namespace

// A hit, including one whose shared prefix ends mid-page, equals a cold run chunked at the same
// boundaries bit for bit (logits of every computed position and the greedy tokens), and a cold run
// of the whole prompt at once within 1e-5. Controls: skipping the snapshot restore, or restoring
// another prefix's snapshot, changes the logits.
TEST_P(prefix_model, hit_equals_cold_run_exactly_including_a_mid_page_hit) {
    model_runner r(synth_model(GetParam()), ropts(2, 24));
    const auto a_prompt = random_prompt(45, 11);
    const auto b_prompt = concat(head(a_prompt, 40), random_prompt(10, 12));   // shares 40: ends inside page 2
    const int N = 3;   // greedy tokens
    std::map<int, std::vector<float>> cold_a, cold_b, cold_b_whole;
    cold_a = cold(r, a_prompt, {32, 13}, N);
    cold_b = cold(r, b_prompt, {32, 16, 2}, N);
    cold_b_whole = cold(r, b_prompt, {50}, N);

    rig g(r, true);
    sequence * a = g.run(a_prompt, N);
    EXPECT_EQ(a->n_prefix_hit, 0);
    {
        const auto c = compare(g.rows[a->id], cold_a, 0, 45 + N - 1);
        EXPECT_TRUE(c.exact) << "a cold run through the cache-on scheduler (chunks 32, 13) must equal the same chunks fed by hand; worst "
                             << c.worst;
    }
    sequence * b = g.run(b_prompt, N);
    EXPECT_EQ(b->n_prefix_hit, 32) << "shared prefix 40 -> full pages 0, 1 reused, page 2 recomputed";
    EXPECT_TRUE(g.rows[b->id].count(31) == 0 && g.rows[b->id].count(32) == 1) << "positions below the hit were not recomputed";
    const auto cb = compare(g.rows[b->id], cold_b, 32, 50 + N - 1);
    EXPECT_TRUE(cb.exact) << "prefix hit vs cold run with the same chunk boundaries: worst rel " << cb.worst;
    EXPECT_EQ(std::vector<int32_t>(b->tokens.begin() + 50, b->tokens.end()),
              (std::vector<int32_t>{argmax(cold_b.at(49)), argmax(cold_b.at(50)), argmax(cold_b.at(51))}));
    const auto cw = compare(g.rows[b->id], cold_b_whole, 32, 50 + N - 1);
    EXPECT_LE(cw.worst, 1e-5) << "prefix hit vs whole-prompt cold run";
    std::printf("[measure] %s: hit vs same-boundary cold exact=%d (%d rows), vs whole-prompt cold %.3g\n", GetParam().c_str(),
                int(cb.exact), cb.n, cw.worst);

    // b again: hit at 48 (its own last boundary), exact.
    sequence * b2 = g.run(b_prompt, N);
    EXPECT_EQ(b2->n_prefix_hit, 48);
    EXPECT_TRUE(compare(g.rows[b2->id], cold_b, 48, 50 + N - 1).exact);
    EXPECT_EQ(b2->tokens, b->tokens);
    // The identical prompt again: hit at 32, exact vs the first run.
    sequence * a2 = g.run(a_prompt, N);
    EXPECT_EQ(a2->n_prefix_hit, 32);
    EXPECT_TRUE(compare(g.rows[a2->id], cold_a, 32, 45 + N - 1).exact);
    EXPECT_EQ(a2->tokens, a->tokens);

    // Control 1: a hit whose KDA snapshot is not restored (the slot zeroed instead).
    g.after_prepare = [&](const step_plan & p) {
        for (const auto & it : p.items)
            if (it.restore_snapshot >= 0) r.zero_slot(it.seq->slot);
    };
    sequence * b_noz = g.run(b_prompt, N);
    EXPECT_EQ(b_noz->n_prefix_hit, 48) << "b's own snapshot at its last boundary";
    const auto c1 = compare(g.rows[b_noz->id], cold_b, 48, 50 + N - 1);
    EXPECT_GT(c1.worst, 1e-3) << "control: without the KDA snapshot the logits must differ";
    // Control 2: restore the snapshot of a different prefix (another prompt's boundary 32).
    const auto c_prompt = random_prompt(40, 13);
    g.after_prepare = nullptr;
    (void)g.run(c_prompt, 1);
    const prefix_hit other = g.pc->lookup(c_prompt, 39);
    ASSERT_EQ(other.n_tokens, 32);
    g.after_prepare = [&](const step_plan & p) {
        for (const auto & it : p.items)
            if (it.restore_snapshot >= 0) {
                ASSERT_NE(it.restore_snapshot, other.snapshot);
                g.snaps->load(other.snapshot, it.seq->slot);
            }
    };
    sequence * b_wrong = g.run(b_prompt, N);
    g.after_prepare = nullptr;
    EXPECT_EQ(b_wrong->n_prefix_hit, 48);
    const auto c2 = compare(g.rows[b_wrong->id], cold_b, 48, 50 + N - 1);
    EXPECT_GT(c2.worst, 1e-3) << "control: another prefix's snapshot must change the logits";
    EXPECT_EQ(g.pages.n_refs(), 0);
    EXPECT_EQ(g.pc->stats().snapshot_pins, 0);
}

// Two requests sharing a prefix run at the same time: B is admitted with a hit on A's pages while A
// is still decoding (the shared pages have two references); both equal their solo runs.
TEST_P(prefix_model, two_requests_sharing_a_prefix_concurrently) {
    model_runner r(synth_model(GetParam()), ropts(3, 24));
    const auto p = random_prompt(35, 21);
    const auto a_prompt = concat(p, random_prompt(4, 22)), b_prompt = concat(p, random_prompt(9, 23));
    const int N = 4;
    const auto cold_a = cold(r, a_prompt, {32, 7}, N), cold_b = cold(r, b_prompt, {32, 12}, N);
    rig g(r, true);
    sequence * a = g.add(a_prompt, N);
    g.step();   // a: 32
    g.step();   // a: 7, samples its first token
    sequence * b = g.add(b_prompt, N);
    const auto fed = g.step();   // a decodes, b admitted with a hit at 32 (a's pages and snapshot)
    EXPECT_EQ(b->n_prefix_hit, 32);
    ASSERT_EQ(fed.size(), 2u);
    EXPECT_EQ(fed[1], (std::pair<uint64_t, int>{b->id, 12}));
    EXPECT_EQ(g.pages.refs(a->pages[0]), 2);
    EXPECT_EQ(g.pages.refs(a->pages[1]), 2);
    EXPECT_EQ(b->pages[0], a->pages[0]);
    g.run_all();
    const auto ca = compare(g.rows[a->id], cold_a, 0, 39 + N - 1), cb = compare(g.rows[b->id], cold_b, 32, 44 + N - 1);
    EXPECT_LE(ca.worst, 1e-5);
    EXPECT_LE(cb.worst, 1e-5);
    std::printf("[measure] %s concurrent: a %.3g (exact %d), b %.3g (exact %d)\n", GetParam().c_str(), ca.worst, int(ca.exact), cb.worst,
                int(cb.exact));
    for (int i = 0; i < N; ++i) {
        EXPECT_EQ(a->tokens[size_t(39 + i)], argmax(cold_a.at(38 + i))) << "a's greedy token " << i;
        EXPECT_EQ(b->tokens[size_t(44 + i)], argmax(cold_b.at(43 + i))) << "b's greedy token " << i;
    }
    // Two identical prompts admitted in the same step: neither can hit the other (nothing computed
    // yet); both index the same pages (the second's are duplicates) and the counters stay exact.
    const auto q = random_prompt(40, 24);
    sequence * x = g.add(q, 2);
    sequence * y = g.add(q, 2);
    g.run_all();
    EXPECT_EQ(x->n_prefix_hit, 0);
    EXPECT_EQ(y->n_prefix_hit, 0);
    EXPECT_EQ(x->tokens, y->tokens);
    sequence * z = g.run(q, 2);
    EXPECT_EQ(z->n_prefix_hit, 32);
    EXPECT_EQ(z->tokens, x->tokens);
    EXPECT_EQ(g.pages.n_refs(), 0);
    EXPECT_EQ(g.pages.n_free(), g.pages.capacity());
    EXPECT_EQ(g.slots.n_used(), 0);
}

// A snapshot pool of 2 and a page pool of 8 under 4 prompts: snapshots and pages are evicted (LRU),
// and every run, hit or miss, still equals its cold run exactly (same boundaries).
TEST_P(prefix_model, eviction_under_small_pools_keeps_results_exact) {
    model_runner r(synth_model(GetParam()), ropts(1, 24));
    std::vector<std::vector<int32_t>> pr;
    std::vector<std::map<int, std::vector<float>>> ref;
    for (uint32_t i = 0; i < 3; ++i) {
        pr.push_back(random_prompt(40, 30 + i));
        ref.push_back(cold(r, pr.back(), {32, 8}, 2));
    }
    rig g(r, true, /*n_snapshots=*/2, 512, /*n_pages=*/8);
    const std::vector<int> order = {0, 1, 0, 2, 1, 0, 2, 2};
    std::vector<int> hits;
    for (int i : order) {
        sequence * s = g.run(pr[size_t(i)], 2);
        hits.push_back(s->n_prefix_hit);
        const auto c = compare(g.rows[s->id], ref[size_t(i)], s->n_prefix_hit, 41);
        EXPECT_TRUE(c.exact) << "prompt " << i << " hit " << s->n_prefix_hit << ": worst " << c.worst;
    }
    // 0 miss; 1 miss; 0 hit; 2 miss (its snapshot evicts 1's, the least recently used); 1 miss (its
    // pages are still indexed but their snapshot is gone; its new snapshot evicts 0's, and its last
    // page evicts its own first cached page); 0 miss (evicts 2's); 2 miss (evicts 1's); 2 hit.
    EXPECT_EQ(hits, (std::vector<int>{0, 0, 32, 0, 0, 0, 0, 32}));
    const auto st = g.pc->stats();
    EXPECT_GT(st.snapshots_evicted, 0u);
    EXPECT_GT(st.pages_evicted, 0u);
    EXPECT_LE(st.snapshots_used, 2);
    EXPECT_EQ(g.pages.n_refs(), 0);
    std::printf("[measure] %s eviction: %llu snapshots evicted, %llu pages evicted\n", GetParam().c_str(),
                (unsigned long long)st.snapshots_evicted, (unsigned long long)st.pages_evicted);
}


// ---------------------------------------------------------------------------------------------
// Through the engine (enable_prefix_caching).

namespace {

struct events {
    std::mutex mu;
    std::map<uint64_t, std::vector<token_event>> ev;
    std::function<void(const token_event &)> cb() {
        return [this](const token_event & e) {
            std::lock_guard lk(mu);
            ev[e.request_id].push_back(e);
        };
    }
    std::vector<int32_t> tokens(uint64_t id) {
        std::lock_guard lk(mu);
        std::vector<int32_t> t;
        for (auto & e : ev[id])
            if (e.token >= 0) t.push_back(e.token);
        return t;
    }
    std::vector<float> logprobs(uint64_t id) {
        std::lock_guard lk(mu);
        std::vector<float> t;
        for (auto & e : ev[id])
            if (e.token >= 0) t.push_back(e.logprob);
        return t;
    }
    int n_final(uint64_t id) {
        std::lock_guard lk(mu);
        int n = 0;
        for (auto & e : ev[id]) n += e.finished != finish_reason::NONE;
        return n;
    }
};

request greedy(std::vector<int32_t> prompt, int max_tokens) {
    request q;
    q.prompt = std::move(prompt);
    q.sp.max_tokens = max_tokens;
    q.sp.logprobs = 0;
    q.ignore_eos = true;
    return q;
}

void expect_baseline(engine & e) {
    ASSERT_TRUE(e.wait_idle(300));
    const engine_stats s = e.stats();
    EXPECT_EQ(s.free_slots, s.total_slots);
    EXPECT_EQ(s.free_pages, s.total_pages);
    EXPECT_EQ(s.page_refs, 0);
    EXPECT_EQ(s.snapshot_pins, 0);
    EXPECT_LE(s.snapshots_used, s.total_snapshots);
    EXPECT_EQ(s.running, 0);
    EXPECT_EQ(s.waiting, 0);
}

} // namespace

// The engine with caching on: a request sharing a prefix with an earlier one (ending mid-page)
// reuses it and produces exactly the tokens and logprobs of the same request on a fresh
// caching engine with the same chunk boundaries, and the tokens of an engine without caching.
TEST_P(prefix_model, engine_hit_gives_the_cold_tokens_and_logprobs) {
    model_runner r(synth_model(GetParam()), ropts(2, 24));
    const auto a = random_prompt(45, 41), b = concat(head(a, 40), random_prompt(12, 42));
    engine_options o;
    o.max_num_seqs = 2;
    o.max_model_len = 96;
    std::vector<int32_t> cold_tok, nocache_tok;
    std::vector<float> cold_lp;
    {
        events c;   // before the engine: destroyed after it (an engine still stopping may call back)
        engine e(r, o);   // caching off
        const uint64_t id = e.submit(greedy(b, 5), c.cb());
        ASSERT_TRUE(e.wait_idle(300));
        nocache_tok = c.tokens(id);
        EXPECT_EQ(e.stats().total_snapshots, 0);
    }
    o.enable_prefix_caching = true;
    o.prefix_snapshots = 4;
    o.prefix_snapshot_interval = 2;   // the cold run of b is then chunked 32 | 16 | 4, like the hit (32 +) 16 | 4
    {
        events c;   // before the engine: destroyed after it (an engine still stopping may call back)
        engine e(r, o);   // caching on, cold
        const uint64_t id = e.submit(greedy(b, 5), c.cb());
        ASSERT_TRUE(e.wait_idle(300));
        cold_tok = c.tokens(id);
        cold_lp = c.logprobs(id);
        EXPECT_EQ(e.stats().prefix_hits, 0u);
    }
    EXPECT_EQ(cold_tok, nocache_tok);
    events c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    (void)e.submit(greedy(a, 3), c.cb());
    ASSERT_TRUE(e.wait_idle(300));
    const uint64_t id = e.submit(greedy(b, 5), c.cb());
    expect_baseline(e);
    const engine_stats st = e.stats();
    EXPECT_EQ(st.prefix_hits, 1u);
    EXPECT_EQ(st.prefix_hit_tokens, 32u);
    EXPECT_GE(st.cached_pages, 3);
    EXPECT_EQ(st.total_snapshots, 4);
    EXPECT_EQ(c.tokens(id), cold_tok);
    const auto lp = c.logprobs(id);
    ASSERT_EQ(lp.size(), cold_lp.size());
    for (size_t i = 0; i < lp.size(); ++i) EXPECT_EQ(lp[i], cold_lp[i]) << "logprob " << i << " (exact: same chunk boundaries)";
    EXPECT_EQ(c.n_final(id), 1);
}

// Random submits (prompts drawn from shared prefixes) and cancels hammer a caching engine with
// small pools (preemption, snapshot and page eviction); every request ends exactly once, completed
// ones give the tokens of their cold run, and every counter returns to baseline.
TEST_P(prefix_model, engine_random_events_return_to_baseline) {
    model_runner r(synth_model(GetParam()), ropts(3, 12));
    std::mt19937 rng(5);
    std::vector<std::vector<int32_t>> prompts;
    const auto base0 = random_prompt(48, 51), base1 = random_prompt(48, 52);
    for (int i = 0; i < 8; ++i) {
        const auto & base = i % 2 ? base1 : base0;
        prompts.push_back(concat(head(base, 8 + 5 * i), random_prompt(1 + i % 3, uint32_t(60 + i))));
    }
    engine_options o;
    o.max_num_seqs = 3;
    o.max_model_len = 64;
    o.max_num_batched_tokens = 40;
    o.n_pages = 6;   // three sequences of up to 4 pages: preemption happens
    std::map<size_t, std::vector<int32_t>> ref;
    {
        events c;   // before the engine: destroyed after it (an engine still stopping may call back)
        engine e(r, o);   // references, caching off, one at a time
        for (size_t i = 0; i < prompts.size(); ++i) {
            const uint64_t id = e.submit(greedy(prompts[i], 4), c.cb());
            ASSERT_TRUE(e.wait_idle(300));
            ref[i] = c.tokens(id);
        }
    }
    o.enable_prefix_caching = true;
    o.prefix_snapshots = 3;
    events c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::vector<std::pair<uint64_t, size_t>> ids;
    const int n_events = GetParam() == "kimi-linear-tiny" ? 1000 : 300;   // k3-tiny steps cost ~5x more
    for (int ev = 0; ev < n_events; ++ev) {
        const int k = int(rng() % 10);
        if (k < 5) {
            const size_t i = rng() % prompts.size();
            try {
                ids.push_back({e.submit(greedy(prompts[i], 4), c.cb()), i});
            } catch (const engine_full_error &) {
            }
        } else if (k < 7 && !ids.empty()) {
            e.cancel(ids[rng() % ids.size()].first);
        } else if (k < 8) {
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
        }
    }
    expect_baseline(e);
    int completed = 0;
    for (auto [id, i] : ids) {
        EXPECT_EQ(c.n_final(id), 1) << "request " << id;
        const auto t = c.tokens(id);
        if (t.size() == 4) {
            EXPECT_EQ(t, ref[i]) << "request " << id << " (prompt " << i << ")";
            ++completed;
        }
    }
    const engine_stats st = e.stats();
    EXPECT_GT(completed, 10);
    EXPECT_GT(st.prefix_hits, 5u);
    EXPECT_GT(st.preemptions, 0u) << "the walk never preempted; shrink the page pool";
    std::printf("[measure] %s engine random: %zu requests, %d completed, %llu cancelled, %llu hits (%llu tokens), %llu preemptions, "
                "%llu snapshots evicted\n",
                GetParam().c_str(), ids.size(), completed, (unsigned long long)st.cancelled, (unsigned long long)st.prefix_hits,
                (unsigned long long)st.prefix_hit_tokens, (unsigned long long)st.preemptions, (unsigned long long)st.snapshots_evicted);
}

INSTANTIATE_TEST_SUITE_P(presets, prefix_model, ::testing::Values("k3-tiny", "kimi-linear-tiny", "k31-tiny"),
                         [](const auto & info) { std::string s = info.param; std::replace(s.begin(), s.end(), '-', '_'); return s; });
