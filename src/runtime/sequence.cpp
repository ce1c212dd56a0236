#include "runtime/sequence.h"

#include "core/error.h"

#include <algorithm>

namespace perigee {

std::string_view seq_status_name(seq_status s) {
    switch (s) {
        case seq_status::WAITING: return "waiting";
        case seq_status::PREFILL: return "prefill";
        case seq_status::DECODE: return "decode";
        case seq_status::FINISHED: return "finished";
    }
    return "?";
}

std::string_view finish_reason_name(finish_reason r) {
    switch (r) {
        case finish_reason::NONE: return "none";
        case finish_reason::STOP: return "stop";
        case finish_reason::LENGTH: return "length";
        case finish_reason::CANCELLED: return "cancelled";
        case finish_reason::ERROR: return "error";
    }
    return "?";
}

finish_reason sequence_append(sequence & s, int32_t token) {
    PG_CHECK(!s.is_finished(), "sequence {}: token appended after it finished", s.id);
    s.tokens.push_back(token);
    if (std::find(s.stop_ids.begin(), s.stop_ids.end(), token) != s.stop_ids.end()) return finish_reason::STOP;
    if (s.n_generated() >= s.sp.max_tokens) return finish_reason::LENGTH;
    if (s.max_model_len > 0 && s.n_tokens() >= s.max_model_len) return finish_reason::LENGTH;
    return finish_reason::NONE;
}

} // namespace perigee
