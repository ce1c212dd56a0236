#include "server/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace perigee::server {

std::string stop_matcher::push(std::string_view text) {
    if (stopped_) return {};
    held_.append(text);
    if (stops_.empty()) return std::exchange(held_, {});
    // earliest match (longest stop on ties)
    size_t best = std::string::npos, best_len = 0;
    for (const auto & s : stops_) {
        const size_t p = held_.find(s);
        if (p != std::string::npos && (p < best || (p == best && s.size() > best_len))) {
            best = p;
            best_len = s.size();
        }
    }
    if (best != std::string::npos) {
        stopped_ = true;
        matched_ = held_.substr(best, best_len);
        std::string out = held_.substr(0, include_stop_ ? best + best_len : best);
        held_.clear();
        return out;
    }
    // hold the longest suffix that is a proper prefix of some stop string
    size_t hold = 0;
    for (const auto & s : stops_) {
        const size_t lim = std::min(s.size() - 1, held_.size());
        for (size_t l = lim; l > hold; --l) {
            if (held_.compare(held_.size() - l, l, s, 0, l) == 0) {
                hold = l;
                break;
            }
        }
    }
    std::string out = held_.substr(0, held_.size() - hold);
    held_.erase(0, held_.size() - hold);
    return out;
}

std::string stop_matcher::finish() {
    if (stopped_) return {};
    return std::exchange(held_, {});
}

} // namespace perigee::server
