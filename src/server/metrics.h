// Server metrics in the Prometheus text exposition format (hand-written, ECOSYSTEM §4):
// request / token counters, running / waiting gauges (from the engine), TTFT, inter-token and
// end-to-end latency histograms. Names use the `perigee:` prefix (vLLM-like).
#pragma once
#include "runtime/engine.h"

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace perigee::server {

class histogram {
public:
    explicit histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
    void observe(double v);
    void render(std::string & out, const std::string & name, const std::string & help) const;

private:
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;
    double sum_ = 0;
    uint64_t n_ = 0;
};

class metrics {
public:
    metrics();
    void request_started();
    void request_finished(const std::string & endpoint, const std::string & finish_reason, int prompt_tokens,
                          int completion_tokens, double e2e_s);
    void http_error(int status);
    void ttft(double s);
    void itl(double s);
    void cancelled();
    std::string render(const engine_stats & st) const;

private:
    mutable std::mutex m_;
    uint64_t started_ = 0, cancelled_ = 0, prompt_tokens_ = 0, generation_tokens_ = 0;
    std::map<std::pair<std::string, std::string>, uint64_t> finished_;   // (endpoint, reason)
    std::map<int, uint64_t> errors_;
    histogram ttft_, itl_, e2e_;
};

} // namespace perigee::server
