// Pools and scheduler: pure bookkeeping, no model.
#include "core/error.h"
#include "runtime/block-manager.h"
#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>

using namespace perigee;

namespace {

std::unique_ptr<sequence> make_seq(uint64_t id, int prompt_len, int max_tokens = 4) {
    auto s = std::make_unique<sequence>();
    s->id = id;
    s->tokens.assign(size_t(prompt_len), 1);
    s->n_prompt = prompt_len;
    s->sp.max_tokens = max_tokens;
    s->max_model_len = 1 << 20;
    return s;
}

// Runs the plan as the engine would: commit, then append a token to every sampling sequence.
void run_plan(scheduler & sch, const step_plan & p) {
    sch.commit(p);
    for (const auto & it : p.items)
        if (it.samples()) {
            const finish_reason why = sequence_append(*it.seq, 7);
            if (why != finish_reason::NONE) sch.finish(it.seq, why);
        }
}

} // namespace

TEST(pools, slot_pool_refuses_with_reason_and_catches_double_free) {
    slot_pool sp(3);
    EXPECT_EQ(sp.refusal(), "");
    for (int i = 0; i < 3; ++i) EXPECT_EQ(*sp.alloc(), i);   // lowest first
    EXPECT_FALSE(sp.alloc().has_value());
    EXPECT_EQ(sp.refusal(), "no free KDA state slot (3 of 3 in use)");
    sp.free(1);
    EXPECT_EQ(*sp.alloc(), 1);
    sp.free(2);
    EXPECT_THROW(sp.free(2), error);
    EXPECT_THROW(sp.free(7), error);
}

TEST(pools, page_pool_refuses_with_reason) {
    page_pool pp(4, 16);
    EXPECT_EQ(pp.pages_for(0), 0);
    EXPECT_EQ(pp.pages_for(16), 1);
    EXPECT_EQ(pp.pages_for(17), 2);
    std::vector<int32_t> a, b;
    pp.alloc(3, a);
    EXPECT_EQ(pp.n_free(), 1);
    EXPECT_EQ(pp.refusal(2), "not enough MLA cache pages: need 2, 1 of 4 free (16 tokens per page)");
    try {
        pp.alloc(2, b);
        FAIL() << "alloc beyond the pool did not throw";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("need 2, 1 of 4 free"), std::string::npos) << e.what();
    }
    pp.free(a);
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(pp.n_free(), 4);
    EXPECT_THROW(page_pool(4, 12), error);   // not a power of two
}

TEST(pools, plan_from_byte_budget) {
    kimi_config c;
    c.num_hidden_layers = 2;
    c.layer_is_kda = {true, false};
    c.layer_is_dsa = {false, false};
    c.kda_num_heads = 2;
    c.kda_head_dim = 4;
    c.kda_short_conv_kernel_size = 4;
    c.kv_lora_rank = 8;
    c.qk_rope_head_dim = 2;
    // slot: 4 B * (3 * 8 * 3 + 2 * 4 * 4) = 416; page (16 tokens): 10 * 4 * 16 = 640.
    pool_plan p = plan_pools(c, 2 * 416 + 10 * 640, 2, 16, 64, 0);
    EXPECT_EQ(p.slot_bytes, 416);
    EXPECT_EQ(p.page_bytes, 640);
    EXPECT_EQ(p.n_pages, 8);   // capped at 2 sequences x 4 pages
    p = plan_pools(c, 2 * 416 + 5 * 640 + 639, 2, 16, 64, 0);
    EXPECT_EQ(p.n_pages, 5);
    try {
        plan_pools(c, 2 * 416 + 3 * 640, 2, 16, 64, 0);
        FAIL() << "a budget below one full sequence was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("need at least 3392 bytes"), std::string::npos) << e.what();
    }
    // prefix snapshots are full slots (K3: 443 MiB each) and come out of the same budget before the pages: the budget that
    // gave 8 pages gives 8 - ceil(3 * 416 / 640) = 6 with 3 snapshots, and the plan's total stays within the budget
    p = plan_pools(c, 2 * 416 + 10 * 640, 2, 16, 64, 3);
    EXPECT_EQ(p.n_snapshots, 3);
    EXPECT_EQ(p.n_pages, 8);   // 10 * 640 - 1248 = 5152 -> 8 pages (still capped at 8)
    p = plan_pools(c, 2 * 416 + 8 * 640, 2, 16, 64, 3);
    EXPECT_EQ(p.n_pages, 6);   // (8 * 640 - 3 * 416) / 640 = 6.05
    EXPECT_LE(p.total_bytes(), 2 * 416 + 8 * 640);
    EXPECT_EQ(plan_pools(c, 2 * 416 + 8 * 640, 2, 16, 64, 0).n_pages, 8);   // control: without snapshots, 8
    try {
        plan_pools(c, 2 * 416 + 4 * 640, 2, 16, 64, 2);   // one sequence's 4 pages fit only without the 2 snapshots
        FAIL() << "a budget that cannot hold the snapshots was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("2 prefix snapshots"), std::string::npos) << e.what();
    }
}

TEST(scheduler, capacity_one_more_sequence_than_fits_waits_and_pool_says_why) {
    slot_pool slots(2);
    page_pool pages(64, 16);
    scheduler sch({.max_num_batched_tokens = 1000}, slots, pages);
    auto a = make_seq(1, 10), b = make_seq(2, 10), c = make_seq(3, 10);
    sch.add(a.get());
    sch.add(b.get());
    sch.add(c.get());
    step_plan p = sch.schedule();
    ASSERT_EQ(p.items.size(), 2u);
    EXPECT_EQ(sch.n_waiting(), 1);
    EXPECT_EQ(sch.waiting().front(), c.get());
    EXPECT_EQ(slots.refusal(), "no free KDA state slot (2 of 2 in use)");
    run_plan(sch, p);
    sch.finish(a.get(), finish_reason::CANCELLED);
    p = sch.schedule();   // c admitted into a's slot
    bool has_c = false;
    for (auto & it : p.items) has_c |= it.seq == c.get() && it.fresh_slot && c->slot == 0;
    EXPECT_TRUE(has_c);
}

TEST(scheduler, token_budget_decodes_first_then_prefill_chunks) {
    slot_pool slots(4);
    page_pool pages(64, 16);
    scheduler sch({.max_num_batched_tokens = 16}, slots, pages);
    auto a = make_seq(1, 5, 100), b = make_seq(2, 40, 100);
    sch.add(a.get());
    step_plan p = sch.schedule();
    ASSERT_EQ(p.n_tokens, 5);
    run_plan(sch, p);
    sch.add(b.get());
    // b's 40-token prompt goes in chunks of 15 next to a's decode token, then the rest.
    std::vector<int> b_chunks;
    for (int step = 0; step < 4; ++step) {
        p = sch.schedule();
        EXPECT_LE(p.n_tokens, 16);
        ASSERT_GE(p.items.size(), 1u);
        EXPECT_EQ(p.items[0].seq, a.get());   // the running decode goes first
        EXPECT_EQ(p.items[0].n_tokens, 1);
        for (auto & it : p.items)
            if (it.seq == b.get()) b_chunks.push_back(it.n_tokens);
        run_plan(sch, p);
    }
    EXPECT_EQ(b_chunks, (std::vector<int>{15, 15, 10, 1}));
    EXPECT_EQ(b->status, seq_status::DECODE);
}

TEST(scheduler, fifo_admission_does_not_let_short_requests_overtake) {
    slot_pool slots(4);
    page_pool pages(4, 16);
    scheduler sch({.max_num_batched_tokens = 1000}, slots, pages);
    auto a = make_seq(1, 40), big = make_seq(2, 40), small = make_seq(3, 4);
    sch.add(a.get());
    sch.add(big.get());
    sch.add(small.get());
    step_plan p = sch.schedule();   // a takes 3 pages; big needs 3 (1 left); small (1 page) must wait behind big
    ASSERT_EQ(p.items.size(), 1u);
    EXPECT_EQ(sch.waiting().front(), big.get());
    EXPECT_EQ(sch.n_waiting(), 2);
}

TEST(scheduler, preempts_youngest_when_pages_run_out_and_requeues_it_first) {
    slot_pool slots(4);
    page_pool pages(3, 4);
    scheduler sch({.max_num_batched_tokens = 100}, slots, pages);
    auto a = make_seq(1, 4, 100), b = make_seq(2, 4, 100), w = make_seq(3, 4, 100);
    sch.add(a.get());
    sch.add(b.get());
    step_plan p = sch.schedule();
    ASSERT_EQ(p.items.size(), 2u);
    run_plan(sch, p);   // a, b: 5 tokens each, 4 cached, 1 page each
    sch.add(w.get());
    p = sch.schedule();   // a needs a 2nd page (1 free) -> gets it; b needs one -> none left -> b preempted
    ASSERT_EQ(p.preempted.size(), 1u);
    EXPECT_EQ(p.preempted[0], b.get());
    EXPECT_EQ(b->status, seq_status::WAITING);
    EXPECT_EQ(b->n_cached, 0);
    EXPECT_EQ(b->slot, -1);
    EXPECT_TRUE(b->pages.empty());
    EXPECT_EQ(sch.waiting().front(), b.get());   // ahead of w (FIFO by arrival)
    EXPECT_EQ(sch.waiting().back(), w.get());
    ASSERT_EQ(p.items.size(), 1u);
    EXPECT_EQ(p.items[0].seq, a.get());
    EXPECT_EQ(sch.n_preemptions(), 1u);
}

TEST(scheduler, cancel_in_every_state_frees_everything_once) {
    slot_pool slots(2);
    page_pool pages(16, 4);
    scheduler sch({.max_num_batched_tokens = 6}, slots, pages);
    auto dec = make_seq(1, 3, 100), pre = make_seq(2, 20, 100), q = make_seq(3, 5, 100);
    sch.add(dec.get());
    sch.add(pre.get());
    sch.add(q.get());
    run_plan(sch, sch.schedule());   // dec prefilled (3), pre got a 3-token chunk
    run_plan(sch, sch.schedule());
    EXPECT_EQ(dec->status, seq_status::DECODE);
    EXPECT_EQ(pre->status, seq_status::PREFILL);
    EXPECT_EQ(q->status, seq_status::WAITING);
    sch.finish(q.get(), finish_reason::CANCELLED);
    sch.finish(pre.get(), finish_reason::CANCELLED);
    sch.finish(dec.get(), finish_reason::CANCELLED);
    sch.finish(dec.get(), finish_reason::STOP);   // duplicate: no-op, first reason wins
    EXPECT_EQ(dec->finished, finish_reason::CANCELLED);
    EXPECT_EQ(slots.n_used(), 0);
    EXPECT_EQ(pages.n_used(), 0);
    EXPECT_FALSE(sch.has_work());
}

TEST(scheduler, thousand_random_admit_cancel_finish_events_leave_pools_empty) {
    std::mt19937 rng(1234);
    slot_pool slots(5);
    page_pool pages(24, 8);
    scheduler sch({.max_num_batched_tokens = 32, .max_prefill_chunk = 20}, slots, pages);
    std::vector<std::unique_ptr<sequence>> all;
    std::vector<sequence *> open;
    uint64_t next = 1;
    int events = 0, preempted = 0;
    while (events < 1000) {
        const int r = int(rng() % 10);
        if (r < 4) {   // admit
            all.push_back(make_seq(next++, 1 + int(rng() % 60), 1 + int(rng() % 40)));
            sch.add(all.back().get());
            open.push_back(all.back().get());
        } else if (r < 6 && !open.empty()) {   // cancel a random open sequence (any state)
            const size_t i = rng() % open.size();
            sch.finish(open[i], finish_reason::CANCELLED);
        } else if (r < 7 && !open.empty()) {   // finish (e.g. a stop string found by the caller)
            const size_t i = rng() % open.size();
            sch.finish(open[i], finish_reason::STOP);
        } else {   // one engine step
            step_plan p = sch.schedule();
            preempted += int(p.preempted.size());
            run_plan(sch, p);
        }
        ++events;
        std::erase_if(open, [](sequence * s) { return s->is_finished(); });
        // Invariants: pool usage equals what the running sequences hold.
        int held_pages = 0;
        for (sequence * s : sch.running()) {
            held_pages += int(s->pages.size());
            ASSERT_GE(s->slot, 0);
            ASSERT_GE(int(s->pages.size()) * 8, s->n_cached);
        }
        ASSERT_EQ(slots.n_used(), sch.n_running());
        ASSERT_EQ(pages.n_used(), held_pages);
        for (sequence * s : sch.waiting()) ASSERT_TRUE(s->slot < 0 && s->pages.empty() && s->n_cached == 0);
    }
    for (sequence * s : open) sch.finish(s, finish_reason::CANCELLED);
    EXPECT_EQ(slots.n_used(), 0);
    EXPECT_EQ(pages.n_used(), 0);
    EXPECT_EQ(sch.n_running(), 0);
    EXPECT_EQ(sch.n_waiting(), 0);
    EXPECT_GT(preempted, 0) << "the random walk never exercised preemption; shrink the page pool";
}
