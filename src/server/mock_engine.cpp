// The deterministic mock engine (see gen_engine.h).
#include "server/gen_engine.h"

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace perigee::server {
namespace {

using clock_t_ = std::chrono::steady_clock;

uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

class mock_engine final : public gen_engine {
public:
    explicit mock_engine(const mock_options & o) : o_(o), thread_([this] { loop(); }) {}
    ~mock_engine() override {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
        std::vector<std::pair<std::function<void(const token_event &)>, token_event>> out;
        for (auto * q : {&waiting_, &running_})
            for (auto & s : *q) out.push_back({s.cb, final_event(s, finish_reason::CANCELLED)});
        for (auto & [cb, ev] : out) cb(ev);
    }

    uint64_t submit(request r, std::function<void(const token_event &)> cb) override {
        PG_CHECK(!r.prompt.empty(), "prompt: the prompt is empty");
        for (size_t i = 0; i < r.prompt.size(); ++i)
            PG_CHECK(r.prompt[i] >= 0 && r.prompt[i] < o_.vocab, "prompt[{}]: token id {} is outside the vocabulary [0, {})", i,
                     r.prompt[i], o_.vocab);
        PG_CHECK(r.sp.max_tokens >= 1, "max_tokens: must be >= 1, got {}", r.sp.max_tokens);
        PG_CHECK(int64_t(r.prompt.size()) + r.sp.max_tokens <= o_.max_model_len,
                 "max_tokens: prompt ({}) + max_tokens ({}) exceeds max_model_len ({})", r.prompt.size(), r.sp.max_tokens,
                 o_.max_model_len);
        std::lock_guard<std::mutex> lk(m_);
        if (int(waiting_.size()) >= o_.max_queue)
            throw engine_full_error(__func__, __FILE__, __LINE__, "the request queue is full");
        seq s;
        s.id = ++next_id_;
        s.cb = std::move(cb);
        uint64_t h = 1469598103934665603ull;
        for (int32_t t : r.prompt) h = mix(h ^ uint64_t(uint32_t(t)));
        s.hash = h;
        if (o_.script) s.scripted = o_.script(r.prompt);
        s.r = std::move(r);
        waiting_.push_back(std::move(s));
        cv_.notify_all();
        return waiting_.back().id;
    }

    void cancel(uint64_t id) override {
        std::function<void(const token_event &)> cb;
        token_event ev;
        {
            std::lock_guard<std::mutex> lk(m_);
            for (auto * q : {&waiting_, &running_}) {
                auto it = std::find_if(q->begin(), q->end(), [&](const seq & s) { return s.id == id; });
                if (it != q->end()) {
                    cb = it->cb;
                    ev = final_event(*it, finish_reason::CANCELLED);
                    q->erase(it);
                    break;
                }
            }
        }
        cv_.notify_all();
        if (cb) cb(ev);
    }

    engine_stats stats() const override {
        std::lock_guard<std::mutex> lk(m_);
        engine_stats s;
        s.waiting = int(waiting_.size());
        s.running = int(running_.size());
        s.total_slots = o_.max_num_seqs;
        s.free_slots = o_.max_num_seqs - s.running;
        s.steps = steps_;
        s.prompt_tokens = prompt_tokens_;
        s.generated_tokens = generated_;
        return s;
    }
    int vocab_size() const override { return o_.vocab; }

private:
    struct seq {
        uint64_t id = 0;
        request r;
        std::function<void(const token_event &)> cb;
        uint64_t hash = 0;
        std::vector<int32_t> scripted;
        int generated = 0;
        clock_t_::time_point ready_at;
    };

    static token_event final_event(const seq & s, finish_reason f) {
        token_event e;
        e.request_id = s.id;
        e.finished = f;
        e.prompt_tokens = int(s.r.prompt.size());
        e.completion_tokens = s.generated;
        return e;
    }

    int32_t next_token(const seq & s) const {
        if (!s.scripted.empty()) return s.scripted[size_t(s.generated)];
        return int32_t(o_.gen_lo + int(mix(s.hash + uint64_t(s.generated)) % uint64_t(o_.gen_hi - o_.gen_lo)));
    }

    void loop() {
        std::unique_lock<std::mutex> lk(m_);
        while (!stop_) {
            const auto now = clock_t_::now();
            while (int(running_.size()) < o_.max_num_seqs && !waiting_.empty()) {
                seq s = std::move(waiting_.front());
                waiting_.pop_front();
                s.ready_at = now + std::chrono::duration_cast<clock_t_::duration>(
                                       std::chrono::duration<double>(o_.prefill_s_per_token * double(s.r.prompt.size())));
                prompt_tokens_ += s.r.prompt.size();
                running_.push_back(std::move(s));
            }
            std::vector<std::pair<std::function<void(const token_event &)>, token_event>> out;
            auto next_wake = clock_t_::time_point::max();
            for (auto it = running_.begin(); it != running_.end();) {
                seq & s = *it;
                if (now < s.ready_at) {
                    next_wake = std::min(next_wake, s.ready_at);
                    ++it;
                    continue;
                }
                const int32_t tok = next_token(s);
                ++s.generated;
                ++generated_;
                token_event e;
                e.request_id = s.id;
                e.token = tok;
                e.prompt_tokens = int(s.r.prompt.size());
                e.completion_tokens = s.generated;
                if (s.r.sp.logprobs >= 0) {
                    e.logprob = -0.25f;
                    for (int k = 0; k < s.r.sp.logprobs; ++k) e.top_logprobs.push_back({(tok + k) % o_.vocab, -0.25f - float(k)});
                }
                const bool is_stop = (!s.r.ignore_eos && std::count(o_.eos_ids.begin(), o_.eos_ids.end(), tok)) ||
                                     std::count(s.r.stop_token_ids.begin(), s.r.stop_token_ids.end(), tok) ||
                                     (!s.scripted.empty() && s.generated == int(s.scripted.size()));
                if (is_stop) e.finished = finish_reason::STOP;
                else if (s.generated >= s.r.sp.max_tokens) e.finished = finish_reason::LENGTH;
                out.push_back({s.cb, e});
                if (e.finished != finish_reason::NONE) {
                    it = running_.erase(it);
                } else {
                    s.ready_at = now + std::chrono::duration_cast<clock_t_::duration>(
                                           std::chrono::duration<double>(o_.decode_s_per_token));
                    next_wake = std::min(next_wake, s.ready_at);
                    ++it;
                }
            }
            if (!out.empty()) ++steps_;
            lk.unlock();
            for (auto & [cb, ev] : out) cb(ev);
            lk.lock();
            if (stop_) break;
            if (!out.empty()) continue;
            if (!waiting_.empty() && int(running_.size()) < o_.max_num_seqs) continue;
            if (next_wake == clock_t_::time_point::max()) cv_.wait(lk);
            else cv_.wait_until(lk, next_wake);
        }
    }

    mock_options o_;
    mutable std::mutex m_;
    std::condition_variable cv_;
    std::deque<seq> waiting_, running_;
    uint64_t next_id_ = 0, steps_ = 0, prompt_tokens_ = 0, generated_ = 0;
    bool stop_ = false;
    std::thread thread_;
};

} // namespace

std::unique_ptr<gen_engine> make_mock_engine(const mock_options & opt) {
    PG_CHECK(opt.gen_hi > opt.gen_lo && opt.gen_hi <= opt.vocab, "mock engine: bad token range [{}, {})", opt.gen_lo, opt.gen_hi);
    return std::make_unique<mock_engine>(opt);
}

} // namespace perigee::server
