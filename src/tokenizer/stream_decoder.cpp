#include "tokenizer/stream_decoder.h"

#include "tokenizer/utf8.h"

namespace perigee::tok {

std::string stream_decoder::push(token_id id) {
    const std::string & b = tok_.token_bytes(id);
    if (skip_special_ && tok_.is_hf_special(id)) return {};
    pending_ += b;
    size_t held = 0;
    std::string out = utf8_replace_invalid(pending_, true, &held);
    pending_.erase(0, pending_.size() - held);
    return out;
}

std::string stream_decoder::push(std::span<const token_id> ids) {
    std::string out;
    for (token_id id : ids) out += push(id);
    return out;
}

std::string stream_decoder::finish() {
    std::string out = utf8_replace_invalid(pending_);
    pending_.clear();
    return out;
}

} // namespace perigee::tok
