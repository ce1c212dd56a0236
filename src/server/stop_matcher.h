// Stop strings with hold-back (ECOSYSTEM §3.1): text that could be the start of a stop string is
// held until it is known not to be one, so a stop string is never streamed. Matching is literal.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace perigee::server {

class stop_matcher {
public:
    explicit stop_matcher(std::vector<std::string> stops, bool include_stop = false)
        : stops_(std::move(stops)), include_stop_(include_stop) {}
    // Appends text; returns what can be released now. After a match, `stopped()` is true, the
    // returned text ends before the stop string (or after it with include_stop) and later input
    // is ignored.
    std::string push(std::string_view text);
    // End of generation: releases what is held.
    std::string finish();
    bool stopped() const { return stopped_; }
    const std::string & matched() const { return matched_; }

private:
    std::vector<std::string> stops_;
    bool include_stop_;
    std::string held_;
    bool stopped_ = false;
    std::string matched_;
};

} // namespace perigee::server
