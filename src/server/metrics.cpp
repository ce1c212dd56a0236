#include "server/metrics.h"

#include <fmt/format.h>

namespace perigee::server {

void histogram::observe(double v) {
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    ++counts_[i];
    sum_ += v;
    ++n_;
}

void histogram::render(std::string & out, const std::string & name, const std::string & help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
        cum += counts_[i];
        out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
    }
    cum += counts_.back();
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cum, name, sum_, name, n_);
}

metrics::metrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      itl_({0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0}) {}

void metrics::request_started() {
    std::lock_guard<std::mutex> lk(m_);
    ++started_;
}

void metrics::request_finished(const std::string & endpoint, const std::string & reason, int pt, int ct, double e2e) {
    std::lock_guard<std::mutex> lk(m_);
    ++finished_[{endpoint, reason}];
    prompt_tokens_ += uint64_t(pt);
    generation_tokens_ += uint64_t(ct);
    e2e_.observe(e2e);
}

void metrics::http_error(int status) {
    std::lock_guard<std::mutex> lk(m_);
    ++errors_[status];
}
void metrics::ttft(double s) {
    std::lock_guard<std::mutex> lk(m_);
    ttft_.observe(s);
}
void metrics::itl(double s) {
    std::lock_guard<std::mutex> lk(m_);
    itl_.observe(s);
}
void metrics::cancelled() {
    std::lock_guard<std::mutex> lk(m_);
    ++cancelled_;
}

std::string metrics::render(const engine_stats & st) const {
    std::lock_guard<std::mutex> lk(m_);
    std::string o;
    auto gauge = [&](const char * n, const char * help, double v) {
        o += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", n, help, n, n, v);
    };
    auto counter = [&](const char * n, const char * help, uint64_t v) {
        o += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", n, help, n, n, v);
    };
    gauge("perigee:num_requests_running", "Sequences running in the engine.", st.running);
    gauge("perigee:num_requests_waiting", "Requests queued in the engine.", st.waiting);
    gauge("perigee:free_slots", "Free sequence (state) slots.", st.free_slots);
    gauge("perigee:free_pages", "Free KV-cache pages.", st.free_pages);
    gauge("perigee:total_pages", "KV-cache pages.", st.total_pages);
    gauge("perigee:total_slots", "Sequence (state) slots.", st.total_slots);
    gauge("perigee:slots_in_use", "Sequence slots held by requests (0 when idle).", st.total_slots - st.free_slots);
    gauge("perigee:pages_in_use", "KV-cache pages held (0 when idle without prefix caching).", st.total_pages - st.free_pages);
    counter("perigee:engine_errors_total", "Requests the engine failed (e.g. non-finite logits).", st.errors);
    counter("perigee:nan_events_total", "Requests failed for non-finite logits.", st.nan_events);
    counter("perigee:engine_steps_total", "Engine steps.", st.steps);
    counter("perigee:requests_received_total", "Generation requests accepted by the server.", started_);
    counter("perigee:requests_cancelled_total", "Generation requests cancelled (client disconnected).", cancelled_);
    counter("perigee:prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens_);
    counter("perigee:generation_tokens_total", "Generated tokens of finished requests.", generation_tokens_);
    o += "# HELP perigee:request_success_total Finished requests by endpoint and finish reason.\n"
         "# TYPE perigee:request_success_total counter\n";
    for (const auto & [k, v] : finished_)
        o += fmt::format("perigee:request_success_total{{endpoint=\"{}\",finished_reason=\"{}\"}} {}\n", k.first, k.second, v);
    o += "# HELP perigee:http_errors_total Error responses by HTTP status.\n# TYPE perigee:http_errors_total counter\n";
    for (const auto & [k, v] : errors_) o += fmt::format("perigee:http_errors_total{{status=\"{}\"}} {}\n", k, v);
    ttft_.render(o, "perigee:time_to_first_token_seconds", "Time to the first generated token.");
    itl_.render(o, "perigee:inter_token_latency_seconds", "Time between generated tokens.");
    e2e_.render(o, "perigee:e2e_request_latency_seconds", "Request latency, arrival to last token.");
    return o;
}

} // namespace perigee::server
