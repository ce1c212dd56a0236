// The engine loop: schedule -> forward -> sample -> post-process on one thread (nano-vllm's
// LLMEngine.step), with a thread-safe inbox for submits and cancels. Everything below `impl`'s
// "engine thread only" line is touched by the engine thread alone; the rest is under `mu`.
#include "runtime/engine.h"

#include "core/error.h"
#include "runtime/block-manager.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"
#include "runtime/step.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

namespace perigee {

using callback = std::function<void(const token_event &)>;

struct engine::impl {
    model_runner & runner;
    engine_options opt;
    const kimi_config & cfg;

    mutable std::mutex mu;
    std::condition_variable cv, idle_cv;
    struct pending {
        uint64_t id;
        request r;
        callback cb;
    };
    std::deque<pending> incoming;
    std::vector<uint64_t> cancels;
    bool stopping = false;
    int n_open = 0;             // submitted requests whose final event has not been delivered
    engine_stats st;
    uint64_t next_id = 1;
    std::mt19937_64 seed_rng{std::random_device{}()};

    // --- engine thread only ---
    slot_pool slots;
    page_pool pages;
    std::unique_ptr<prefix_cache> cache;       // null when prefix caching is off
    std::unique_ptr<snapshot_store> snaps;
    scheduler sched;
    struct live_req {
        std::unique_ptr<sequence> seq;
        callback cb;
    };
    std::unordered_map<uint64_t, live_req> live;
    std::thread th;

    impl(model_runner & r, const engine_options & o, int n_pages)
        : runner(r), opt(o), cfg(r.config()), slots(o.max_num_seqs), pages(n_pages, o.page_size),
          cache(o.enable_prefix_caching ? std::make_unique<prefix_cache>(pages, n_snapshots(o), cfg.n_kda_layers() > 0) : nullptr),
          snaps(o.enable_prefix_caching ? std::make_unique<snapshot_store>(r, n_snapshots(o)) : nullptr),
          sched({.max_num_batched_tokens = o.max_num_batched_tokens,
                 .max_prefill_chunk = o.max_prefill_chunk,
                 .snapshot_interval_pages = o.prefix_snapshot_interval},
                slots, pages, cache.get()) {
        if (snaps)
            PG_CHECK(snaps->bytes_per_snapshot() == state_slot_bytes(cfg),
                     "prefix cache: a snapshot holds {} bytes but a KDA slot is {} bytes", snaps->bytes_per_snapshot(),
                     state_slot_bytes(cfg));
        st.total_slots = slots.capacity();
        st.total_pages = pages.capacity();
        st.free_slots = slots.n_free();
        st.free_pages = pages.n_free();
    }

    static int n_snapshots(const engine_options & o) { return o.prefix_snapshots > 0 ? o.prefix_snapshots : 4 * o.max_num_seqs; }

    void deliver(live_req & lr, const token_event & ev) {
        try {
            lr.cb(ev);
        } catch (...) {
            // A throwing callback must not take the engine down; the request just ends here.
        }
    }

    // Ends a request: frees everything, sends the final event (unless `ev` already carried it).
    void end(uint64_t id, finish_reason why, const std::string & err, const token_event * final_ev = nullptr) {
        auto it = live.find(id);
        if (it == live.end()) return;
        sequence & s = *it->second.seq;
        sched.finish(&s, why, err);
        if (final_ev) {
            deliver(it->second, *final_ev);
        } else {
            token_event ev;
            ev.request_id = id;
            ev.finished = why;
            ev.error = err;
            ev.prompt_tokens = s.n_prompt;
            ev.completion_tokens = s.n_generated();
            deliver(it->second, ev);
        }
        live.erase(it);
        std::lock_guard lk(mu);
        --n_open;
        st.finished += why == finish_reason::STOP || why == finish_reason::LENGTH;
        st.cancelled += why == finish_reason::CANCELLED;
        st.errors += why == finish_reason::ERROR;
    }

    void publish() {
        std::lock_guard lk(mu);
        st.waiting = sched.n_waiting() + int(incoming.size());
        st.running = sched.n_running();
        st.free_slots = slots.n_free();
        st.free_pages = pages.n_free();
        st.preemptions = sched.n_preemptions();
        st.page_refs = pages.n_refs();
        if (cache) {
            const prefix_cache_stats cs = cache->stats();
            st.cached_pages = cs.entries;
            st.snapshots_used = cs.snapshots_used;
            st.total_snapshots = cs.snapshots_total;
            st.snapshot_pins = cs.snapshot_pins;
            st.prefix_hits = cs.hits;
            st.prefix_hit_tokens = cs.hit_tokens;
            st.snapshots_taken = cs.snapshots_taken;
            st.snapshots_evicted = cs.snapshots_evicted;
        }
        idle_cv.notify_all();
    }

    void step() {
        step_plan plan = sched.schedule();
        if (plan.empty()) return;
        auto b = step_prepare(plan, runner, cache.get(), snaps.get());
        tensor rows;
        // On-device sampling (backend::sample_rows) when the backend is a device one and no sampling
        // request needs the host sampler (logprobs or penalties): then only the ids come back.
        std::vector<int32_t> ids;
        bool on_device = !b->logits_rows.empty() && runner.device_sampling();
        for (const auto & it : plan.items)
            if (on_device && it.samples() && sampling_needs_host(it.seq->sp)) on_device = false;
        try {
            if (b->logits_rows.empty()) {
                runner.advance(b);   // no logits needed: none read back
            } else if (on_device) {
                std::vector<row_sampling> rs;
                for (const auto & it : plan.items)
                    if (it.samples()) rs.push_back(sampling_row(it.seq->sp, it.seq->seed, uint64_t(it.seq->n_generated())));
                ids = runner.step_sample(b, rs);
            } else {
                rows = runner.step_rows(b);
            }
        } catch (const std::exception & e) {
            const std::string msg = fmt::format("forward step failed: {}", e.what());
            for (const auto & it : plan.items) end(it.seq->id, finish_reason::ERROR, msg);
            return;
        }
        step_commit(plan, sched, runner, cache.get(), snaps.get());
        {
            std::lock_guard lk(mu);
            st.steps++;
            st.batched_tokens += uint64_t(plan.n_tokens);
        }
        const int64_t V = cfg.vocab_size;
        int64_t r = 0;
        for (const auto & it : plan.items) {
            if (!it.samples()) continue;
            sequence & s = *it.seq;
            const int64_t ri = r++;
            const float * row = on_device ? nullptr : rows.f32() + ri * rows.dim(1);
            if (on_device ? ids.at(size_t(ri)) < 0 : !row_is_finite(row, V)) {
                {
                    std::lock_guard lk(mu);
                    st.nan_events++;
                }
                end(s.id, finish_reason::ERROR,
                    fmt::format("non-finite logits (NaN/Inf) for request {} at position {} (step {})", s.id, s.n_tokens() - 1, st.steps));
                continue;
            }
            sample_output so;
            if (on_device) so.token = ids[size_t(ri)];
            else so = sample_token(row, V, s.sp, s.tokens, s.n_prompt, s.seed, uint64_t(s.n_generated()));
            const finish_reason why = sequence_append(s, so.token);
            token_event ev;
            ev.request_id = s.id;
            ev.token = so.token;
            ev.logprob = so.logprob;
            ev.top_logprobs = so.top_logprobs;
            ev.finished = why;
            ev.prompt_tokens = s.n_prompt;
            ev.completion_tokens = s.n_generated();
            {
                std::lock_guard lk(mu);
                st.generated_tokens++;
            }
            if (why != finish_reason::NONE) end(s.id, why, "", &ev);
            else deliver(live.at(s.id), ev);
        }
    }

    void loop() {
        for (;;) {
            std::deque<pending> in;
            std::vector<uint64_t> cx;
            bool stop = false;
            {
                std::unique_lock lk(mu);
                cv.wait(lk, [&] { return stopping || !incoming.empty() || !cancels.empty() || sched.has_work(); });
                in.swap(incoming);
                cx.swap(cancels);
                stop = stopping;
            }
            for (auto & p : in) {
                auto s = std::make_unique<sequence>();
                s->id = p.id;
                s->tokens = std::move(p.r.prompt);
                s->n_prompt = s->n_tokens();
                s->sp = p.r.sp;
                s->seed = *p.r.sp.seed;
                s->max_model_len = opt.max_model_len;
                if (!p.r.ignore_eos)
                    for (int64_t e : cfg.eos_token_ids) s->stop_ids.push_back(int32_t(e));
                s->stop_ids.insert(s->stop_ids.end(), p.r.stop_token_ids.begin(), p.r.stop_token_ids.end());
                sched.add(s.get());
                {
                    std::lock_guard lk(mu);
                    st.prompt_tokens += uint64_t(s->n_prompt);
                }
                live.emplace(p.id, live_req{std::move(s), std::move(p.cb)});
            }
            for (uint64_t id : cx) end(id, finish_reason::CANCELLED, "");
            if (stop) {
                std::vector<uint64_t> ids;
                for (auto & [id, lr] : live) ids.push_back(id);
                std::sort(ids.begin(), ids.end());
                for (uint64_t id : ids) end(id, finish_reason::CANCELLED, "engine stopped");
                publish();
                return;
            }
            if (sched.has_work()) {
                try {
                    step();
                } catch (const std::exception & e) {
                    // A bookkeeping failure: fail what is running rather than wedge the loop.
                    std::vector<uint64_t> ids;
                    for (auto & [id, lr] : live) ids.push_back(id);
                    for (uint64_t id : ids) end(id, finish_reason::ERROR, fmt::format("engine step failed: {}", e.what()));
                }
            }
            publish();
        }
    }
};

engine::engine(model_runner & runner, const engine_options & opt) {
    const kimi_config & c = runner.config();
    const model_state & ms = runner.state();
    PG_CHECK(opt.max_num_seqs >= 1 && opt.max_num_seqs <= ms.n_slots,
             "engine_options.max_num_seqs {} must be in [1, {}] (the runner's KDA state slots)", opt.max_num_seqs, ms.n_slots);
    PG_CHECK(opt.page_size == ms.page_size, "engine_options.page_size {} differs from the runner's page size {}", opt.page_size,
             ms.page_size);
    PG_CHECK(opt.max_model_len >= 1 && opt.max_model_len <= c.max_position_embeddings,
             "engine_options.max_model_len {} must be in [1, {}] (max_position_embeddings)", opt.max_model_len,
             c.max_position_embeddings);
    PG_CHECK(opt.max_num_batched_tokens >= 1, "engine_options.max_num_batched_tokens {} must be >= 1", opt.max_num_batched_tokens);
    PG_CHECK(opt.max_queue >= 1, "engine_options.max_queue {} must be >= 1", opt.max_queue);
    PG_CHECK(opt.max_prefill_chunk >= 0, "engine_options.max_prefill_chunk {} must be >= 0", opt.max_prefill_chunk);
    PG_CHECK(opt.prefix_snapshots >= 0, "engine_options.prefix_snapshots {} must be >= 0", opt.prefix_snapshots);
    // A runner sized from a memory budget reserved room for its snapshots (plan_pools); more would overrun the budget.
    PG_CHECK(runner.budget_snapshots() < 0 || impl::n_snapshots(opt) <= runner.budget_snapshots(),
             "engine_options.prefix_snapshots: {} snapshots ({} B each) but the runner's memory budget reserved {} "
             "(runner_options.prefix_snapshots)", impl::n_snapshots(opt), state_slot_bytes(c), runner.budget_snapshots());
    PG_CHECK(opt.prefix_snapshot_interval >= 0, "engine_options.prefix_snapshot_interval {} must be >= 0",
             opt.prefix_snapshot_interval);
    const int per_seq = (opt.max_model_len + opt.page_size - 1) / opt.page_size;
    int n_pages = opt.n_pages > 0 ? opt.n_pages : std::min(ms.n_pages, per_seq * opt.max_num_seqs);
    PG_CHECK(n_pages <= ms.n_pages, "engine_options.n_pages {} exceeds the runner's {} MLA cache pages", n_pages, ms.n_pages);
    PG_CHECK(per_seq <= n_pages,
             "engine_options.max_model_len {}: one full-length sequence needs {} MLA cache pages of {} tokens; the pool has {}",
             opt.max_model_len, per_seq, opt.page_size, n_pages);
    impl_ = std::make_unique<impl>(runner, opt, n_pages);
    impl_->th = std::thread([this] { impl_->loop(); });
}

engine::~engine() {
    {
        std::lock_guard lk(impl_->mu);
        impl_->stopping = true;
    }
    impl_->cv.notify_all();
    if (impl_->th.joinable()) impl_->th.join();
}

uint64_t engine::submit(request r, std::function<void(const token_event &)> cb) {
    const kimi_config & c = impl_->cfg;
    PG_CHECK(bool(cb), "request: no callback given");
    PG_CHECK(!r.prompt.empty(), "request.prompt is empty");
    for (size_t i = 0; i < r.prompt.size(); ++i)
        PG_CHECK(r.prompt[i] >= 0 && r.prompt[i] < c.vocab_size, "request.prompt[{}] = {} is outside the vocabulary of {}", i,
                 r.prompt[i], c.vocab_size);
    for (size_t i = 0; i < r.stop_token_ids.size(); ++i)
        PG_CHECK(r.stop_token_ids[i] >= 0 && r.stop_token_ids[i] < c.vocab_size,
                 "request.stop_token_ids[{}] = {} is outside the vocabulary of {}", i, r.stop_token_ids[i], c.vocab_size);
    sampling_params_validate(r.sp);
    const int64_t total = int64_t(r.prompt.size()) + r.sp.max_tokens;
    PG_CHECK(total <= impl_->opt.max_model_len,
             "request.prompt ({} tokens) + sampling_params.max_tokens ({}) = {} exceeds max_model_len {}", r.prompt.size(),
             r.sp.max_tokens, total, impl_->opt.max_model_len);
    uint64_t id = 0;
    {
        std::lock_guard lk(impl_->mu);
        PG_CHECK(!impl_->stopping, "engine is stopping; request refused");
        const int queued = impl_->st.waiting + int(impl_->incoming.size());
        if (queued >= impl_->opt.max_queue)
            throw engine_full_error(__func__, __FILE__, __LINE__,
                                    fmt::format("engine queue is full ({} waiting, max_queue {})", queued, impl_->opt.max_queue));
        if (!r.sp.seed) r.sp.seed = impl_->seed_rng();
        id = impl_->next_id++;
        impl_->n_open++;
        impl_->incoming.push_back({id, std::move(r), std::move(cb)});
    }
    impl_->cv.notify_all();
    return id;
}

void engine::cancel(uint64_t request_id) {
    {
        std::lock_guard lk(impl_->mu);
        impl_->cancels.push_back(request_id);
    }
    impl_->cv.notify_all();
}

engine_stats engine::stats() const {
    std::lock_guard lk(impl_->mu);
    return impl_->st;
}

const kimi_config & engine::config() const { return impl_->cfg; }

bool engine::wait_idle(double timeout_s) {
    std::unique_lock lk(impl_->mu);
    return impl_->idle_cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return impl_->n_open == 0; });
}

} // namespace perigee
