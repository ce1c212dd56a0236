// The engine: continuous batching end to end on k3-tiny (synthesized in-process).
#include "rt_test_util.h"
#include "model/config.h"
#include "model/state.h"
#include "runtime/engine.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

using namespace perigee;
using namespace rt_test;

namespace {

struct collector {
    std::mutex mu;
    std::map<uint64_t, std::vector<token_event>> ev;
    std::function<void(const token_event &)> extra;   // runs on the engine thread after recording
    std::function<void(const token_event &)> cb() {
        return [this](const token_event & e) {
            {
                std::lock_guard lk(mu);
                ev[e.request_id].push_back(e);
            }
            if (extra) extra(e);
        };
    }
    std::vector<int32_t> tokens(uint64_t id) {
        std::lock_guard lk(mu);
        std::vector<int32_t> t;
        for (auto & e : ev[id])
            if (e.token >= 0) t.push_back(e.token);
        return t;
    }
    int n_final(uint64_t id) {
        std::lock_guard lk(mu);
        int n = 0;
        for (auto & e : ev[id]) n += e.finished != finish_reason::NONE;
        return n;
    }
    token_event last(uint64_t id) {
        std::lock_guard lk(mu);
        return ev[id].back();
    }
};

runner_options ropts(int slots = 4, int max_tokens = 64) {
    runner_options o;
    o.n_slots = slots;
    o.max_tokens = max_tokens;
    return o;
}

request req(std::vector<int32_t> prompt, int max_tokens, int logprobs = -1) {
    request r;
    r.prompt = std::move(prompt);
    r.sp.max_tokens = max_tokens;
    r.sp.logprobs = logprobs;
    r.ignore_eos = true;
    return r;
}

void expect_pools_free(engine & e) {
    ASSERT_TRUE(e.wait_idle(120));
    const engine_stats s = e.stats();
    EXPECT_EQ(s.free_slots, s.total_slots);
    EXPECT_EQ(s.free_pages, s.total_pages);
    EXPECT_EQ(s.running, 0);
    EXPECT_EQ(s.waiting, 0);
}

// Each prompt alone (one sequence at a time, whole-prompt prefill): the reference tokens/logprobs.
std::vector<std::vector<token_event>> run_alone(model_runner & r, const std::vector<std::vector<int32_t>> & prompts, int n) {
    engine_options o;
    o.max_num_seqs = 1;
    o.max_model_len = 64;
    o.max_num_batched_tokens = 64;
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::vector<std::vector<token_event>> out;
    for (const auto & p : prompts) {
        const uint64_t id = e.submit(req(p, n, 0), c.cb());
        EXPECT_TRUE(e.wait_idle(120));
        std::lock_guard lk(c.mu);
        out.push_back(c.ev[id]);
    }
    return out;
}

} // namespace

TEST(engine, continuous_batching_gives_each_request_its_solo_tokens) {
    model_runner r(synth_model("k3-tiny"), ropts());
    const std::vector<std::vector<int32_t>> prompts = {random_prompt(19, 1), random_prompt(5, 2), random_prompt(30, 3),
                                                       random_prompt(11, 4)};
    const auto ref = run_alone(r, prompts, 6);
    engine_options o;
    o.max_num_seqs = 4;
    o.max_model_len = 64;
    o.max_num_batched_tokens = 12;   // long prompts are chunked next to the decodes
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::vector<uint64_t> ids;
    for (const auto & p : prompts) ids.push_back(e.submit(req(p, 6, 0), c.cb()));
    expect_pools_free(e);
    for (size_t i = 0; i < ids.size(); ++i) {
        std::vector<int32_t> want;
        for (auto & ev : ref[i]) want.push_back(ev.token);
        EXPECT_EQ(c.tokens(ids[i]), want) << "request " << i;
        EXPECT_EQ(c.n_final(ids[i]), 1);
        EXPECT_EQ(c.last(ids[i]).finished, finish_reason::LENGTH);
        std::lock_guard lk(c.mu);
        for (size_t k = 0; k < ref[i].size(); ++k) EXPECT_NEAR(c.ev[ids[i]][k].logprob, ref[i][k].logprob, 1e-4);
    }
    EXPECT_GT(e.stats().steps, 6u);
}

TEST(engine, preemption_by_recompute_gives_the_same_tokens) {
    model_runner r(synth_model("k3-tiny"), ropts());
    const std::vector<std::vector<int32_t>> prompts = {random_prompt(20, 5), random_prompt(18, 6), random_prompt(22, 7)};
    const auto ref = run_alone(r, prompts, 20);
    engine_options o;
    o.max_num_seqs = 3;
    o.max_model_len = 48;   // 3 pages of 16 per sequence
    o.n_pages = 5;          // three sequences need up to 9: someone must be preempted
    o.max_num_batched_tokens = 64;
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::vector<uint64_t> ids;
    for (const auto & p : prompts) ids.push_back(e.submit(req(p, 20, 0), c.cb()));
    expect_pools_free(e);
    EXPECT_GT(e.stats().preemptions, 0u) << "the pool was large enough that nothing was preempted";
    for (size_t i = 0; i < ids.size(); ++i) {
        std::vector<int32_t> want;
        for (auto & ev : ref[i]) want.push_back(ev.token);
        EXPECT_EQ(c.tokens(ids[i]), want) << "request " << i;
        EXPECT_EQ(c.n_final(ids[i]), 1);
    }
}

TEST(engine, concurrent_submits_from_several_threads) {
    model_runner r(synth_model("k3-tiny"), ropts());
    engine_options o;
    o.max_num_seqs = 4;
    o.max_model_len = 64;
    o.max_num_batched_tokens = 32;
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::mutex idm;
    std::vector<std::pair<int, uint64_t>> ids;   // (prompt kind, id)
    std::vector<std::thread> th;
    for (int t = 0; t < 4; ++t)
        th.emplace_back([&, t] {
            for (int k = 0; k < 4; ++k) {
                const int kind = (t + k) % 3;
                const uint64_t id = e.submit(req(random_prompt(6 + kind, uint32_t(100 + kind)), 3), c.cb());
                std::lock_guard lk(idm);
                ids.push_back({kind, id});
            }
        });
    for (auto & x : th) x.join();
    expect_pools_free(e);
    ASSERT_EQ(ids.size(), 16u);
    std::map<int, std::vector<int32_t>> by_kind;
    std::set<uint64_t> unique;
    for (auto [kind, id] : ids) {
        unique.insert(id);
        EXPECT_EQ(c.n_final(id), 1);
        const auto toks = c.tokens(id);
        EXPECT_EQ(toks.size(), 3u);
        if (!by_kind.count(kind)) by_kind[kind] = toks;
        EXPECT_EQ(toks, by_kind[kind]) << "same prompt, different tokens under concurrency";
    }
    EXPECT_EQ(unique.size(), 16u);
    EXPECT_EQ(e.stats().finished, 16u);
}

TEST(engine, cancel_while_queued_prefilling_decoding_frees_everything) {
    model_runner r(synth_model("k3-tiny"), ropts(2));
    engine_options o;
    o.max_num_seqs = 2;
    o.max_model_len = 64;
    o.max_num_batched_tokens = 8;   // P's 40-token prompt takes 5+ steps
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::atomic<uint64_t> d_id{0}, p_id{0}, q_id{0}, d_seen{0};
    std::atomic<int> running_at_cancel{-1};
    std::atomic<size_t> p_events_at_cancel{99};
    std::atomic<bool> p_wait_timed_out{false};
    std::atomic<int> p_cancel_at{-1}, d_cancel_at{-1};   // D's token count when P / D were cancelled
    // D's own callback (engine thread) drives the test. It takes D's id from the event, not from d_id: the engine can
    // deliver D's first token before submit() has returned to this thread. The engine may also run D's first step
    // before P is submitted (a 2-core machine under load: CI hit it once, running_at_cancel 1), so at D's first token
    // the callback waits until P's submit() has returned, and P is cancelled at the first of D's tokens where the
    // engine's stats (published after each step) show both running; P's 40 tokens at <= 7 per step take 6 steps, so it
    // is still prefilling then (asserted: no events of P before its cancel).
    auto record = c.cb();
    auto on_d = [&](const token_event & ev) {
        record(ev);
        if (ev.token < 0) return;
        const uint64_t me = ev.request_id;
        d_seen = me;
        const int n = int(c.tokens(me).size());
        if (n == 1) {   // Q goes in behind D and P (both slots taken by the next step at the latest): cancel it queued
            const auto t0 = std::chrono::steady_clock::now();
            while (p_id == 0) {
                if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) {
                    p_wait_timed_out = true;
                    break;
                }
                std::this_thread::yield();
            }
            q_id = e.submit(req(random_prompt(5, 9), 4), c.cb());
            e.cancel(q_id);
        } else if (p_cancel_at < 0) {   // P still prefilling: cancel it once the stats show it running (or give up at 4)
            const int running = e.stats().running;
            if (running == 2 || n >= 4) {
                running_at_cancel = running;
                {
                    std::lock_guard lk(c.mu);
                    p_events_at_cancel = c.ev[p_id].size();
                }
                e.cancel(p_id);
                p_cancel_at = n;
            }
        } else if (n == p_cancel_at + 2) {
            e.cancel(me);   // while decoding
            d_cancel_at = n;
        }
    };
    d_id = e.submit(req(random_prompt(4, 8), 30), on_d);
    p_id = e.submit(req(random_prompt(40, 10), 4), c.cb());
    expect_pools_free(e);
    EXPECT_EQ(c.last(q_id).finished, finish_reason::CANCELLED);
    EXPECT_TRUE(c.tokens(q_id).empty());
    EXPECT_FALSE(p_wait_timed_out.load()) << "P's submit() did not return within 30 s";
    EXPECT_EQ(d_seen.load(), d_id.load());
    EXPECT_EQ(running_at_cancel.load(), 2);
    EXPECT_EQ(p_events_at_cancel.load(), 0u) << "P had produced tokens: it was not prefilling when cancelled";
    EXPECT_EQ(c.last(p_id).finished, finish_reason::CANCELLED);
    EXPECT_TRUE(c.tokens(p_id).empty());
    EXPECT_EQ(c.last(d_id).finished, finish_reason::CANCELLED);
    EXPECT_GE(d_cancel_at.load(), 4);
    EXPECT_EQ(c.tokens(d_id).size(), size_t(d_cancel_at.load())) << "D's tokens after its cancel";
    for (uint64_t id : {d_id.load(), p_id.load(), q_id.load()}) EXPECT_EQ(c.n_final(id), 1) << "request " << id;
    // Duplicate cancel, cancel after completion, unknown id: no events, nothing freed twice.
    e.cancel(d_id);
    e.cancel(d_id);
    e.cancel(12345);
    expect_pools_free(e);
    for (uint64_t id : {d_id.load(), p_id.load(), q_id.load()}) EXPECT_EQ(c.n_final(id), 1);
    EXPECT_EQ(e.stats().cancelled, 3u);
}

TEST(engine, nan_in_one_sequence_fails_only_that_request) {
    model_runner r(synth_model("k3-tiny"), ropts(2));
    const auto pa = random_prompt(9, 21), pb = random_prompt(7, 22);
    const auto ref = run_alone(r, {pa, pb}, 8);
    engine_options o;
    o.max_num_seqs = 2;
    o.max_model_len = 64;
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    std::atomic<int> poisoned{0};
    // Poison B's row (slot 1) on its third sampled token.
    r.logits_hook = [&](const batch & b, tensor & rows) {
        int row = 0;
        for (int s = 0; s < b.n_seq(); ++s) {
            const int last = b.seq_start[size_t(s) + 1] - 1;
            if (std::find(b.logits_rows.begin(), b.logits_rows.end(), last) == b.logits_rows.end()) continue;
            if (b.slot[size_t(s)] == 1 && b.pos0[size_t(s)] + b.seq_len(s) == int(pb.size()) + 2) {
                rows.f32()[int64_t(row) * rows.dim(1) + 17] = NAN;
                poisoned++;
            }
            ++row;
        }
    };
    // A must hold slot 0 before B arrives.
    std::atomic<uint64_t> a_id{0}, b_id{0};
    c.extra = [&](const token_event & ev) {
        if (ev.request_id == a_id && c.tokens(a_id).size() == 1) b_id = e.submit(req(pb, 8, 0), c.cb());
    };
    a_id = e.submit(req(pa, 8, 0), c.cb());
    expect_pools_free(e);
    r.logits_hook = nullptr;
    EXPECT_EQ(poisoned.load(), 1);
    const token_event lb = c.last(b_id);
    EXPECT_EQ(lb.finished, finish_reason::ERROR);
    EXPECT_NE(lb.error.find("non-finite logits"), std::string::npos) << lb.error;
    EXPECT_EQ(c.tokens(b_id).size(), 2u);
    std::vector<int32_t> want_a, want_b;
    for (auto & ev : ref[0]) want_a.push_back(ev.token);
    for (auto & ev : ref[1]) want_b.push_back(ev.token);
    EXPECT_EQ(c.tokens(a_id), want_a) << "the other request was affected";
    EXPECT_EQ(c.last(a_id).finished, finish_reason::LENGTH);
    EXPECT_EQ(e.stats().nan_events, 1u);
    // The faulted request's slot serves the next request cleanly.
    const uint64_t again = e.submit(req(pb, 8, 0), c.cb());
    expect_pools_free(e);
    EXPECT_EQ(c.tokens(again), want_b);
}

// A runner sized from a memory budget reserves its prefix snapshots (plan_pools); an engine asking for more would allocate
// device memory outside the budget (a K3 snapshot is 443 MiB), so it is refused by name. Control: the reserved count works.
TEST(engine, snapshots_beyond_the_runner_budget_are_refused) {
    const std::string dir = synth_model("k3-tiny");
    const kimi_config c = config_load(dir);
    const int64_t slot = state_slot_bytes(c), page = state_page_bytes(c, 16);
    runner_options ro = ropts(2, 64);
    ro.memory_budget_bytes = (2 + 4) * slot + 8 * page;
    ro.prefix_snapshots = 4;
    model_runner r(dir, ro);
    EXPECT_EQ(r.budget_snapshots(), 4);
    engine_options o;
    o.max_num_seqs = 2;
    o.max_model_len = 64;
    o.prefix_snapshots = 5;
    try {
        engine e(r, o);
        ADD_FAILURE() << "an engine with more snapshots than the runner's budget reserved was accepted";
    } catch (const error & x) {
        EXPECT_NE(std::string(x.what()).find("engine_options.prefix_snapshots: 5 snapshots"), std::string::npos) << x.what();
        EXPECT_NE(std::string(x.what()).find("reserved 4"), std::string::npos) << x.what();
    }
    o.prefix_snapshots = 4;
    EXPECT_NO_THROW(engine(r, o));
    o.prefix_snapshots = 0;   // 0 = 4 * max_num_seqs = 8 > 4
    EXPECT_THROW(engine(r, o), error);
}

TEST(engine, submit_validates_and_names_the_field) {
    model_runner r(synth_model("k3-tiny"), ropts(1));
    engine_options o;
    o.max_num_seqs = 1;
    o.max_model_len = 32;
    o.max_queue = 1;
    collector c;   // before the engine: destroyed after it (an engine still stopping may call back)
    engine e(r, o);
    auto msg = [&](request q) {
        try {
            e.submit(std::move(q), c.cb());
        } catch (const error & x) {
            return std::string(x.what());
        }
        return std::string("(accepted)");
    };
    EXPECT_NE(msg(req({}, 4)).find("request.prompt is empty"), std::string::npos);
    EXPECT_NE(msg(req({1, 2, 999}, 4)).find("request.prompt[2] = 999"), std::string::npos);
    EXPECT_NE(msg(req(random_prompt(30, 1), 4)).find("exceeds max_model_len 32"), std::string::npos);
    request bad = req({1, 2}, 4);
    bad.sp.top_p = 2.0f;
    EXPECT_NE(msg(bad).find("sampling_params.top_p"), std::string::npos);
    bad = req({1, 2}, 4);
    bad.stop_token_ids = {-1};
    EXPECT_NE(msg(bad).find("request.stop_token_ids[0]"), std::string::npos);
    EXPECT_EQ(e.stats().steps, 0u);
    // Queue bound: while A's first callback blocks the engine, B queues and C is refused.
    std::mutex m;
    std::condition_variable cv;
    bool entered = false, release = false;
    c.extra = [&](const token_event &) {
        std::unique_lock lk(m);
        entered = true;
        cv.notify_all();
        cv.wait(lk, [&] { return release; });
    };
    e.submit(req({1, 2, 3}, 2), c.cb());
    {
        std::unique_lock lk(m);
        cv.wait(lk, [&] { return entered; });
    }
    e.submit(req({4, 5}, 2), c.cb());
    EXPECT_THROW(e.submit(req({6, 7}, 2), c.cb()), engine_full_error);
    {
        std::lock_guard lk(m);
        release = true;
    }
    cv.notify_all();
    expect_pools_free(e);
    // Options are checked against the runner.
    engine_options big;
    big.max_num_seqs = 2;
    EXPECT_THROW(engine(r, big), error);
}
