// Streaming detokenizer: turns generated ids into text deltas that are always valid UTF-8.
// A token that ends mid code point is held back until the sequence completes; ill-formed bytes
// become U+FFFD (one per maximal subpart, as Python's errors="replace"); finish() flushes a
// cut-off tail as U+FFFD. The concatenated deltas equal utf8_replace_invalid(decode(all ids)).
#pragma once
#include "tokenizer/tokenizer.h"

#include <span>
#include <string>

namespace perigee::tok {

class stream_decoder {
public:
    explicit stream_decoder(const tokenizer & tok, bool skip_special = false) : tok_(tok), skip_special_(skip_special) {}
    // Returns the text completed by this id (possibly empty). Out-of-range ids throw.
    std::string push(token_id id);
    std::string push(std::span<const token_id> ids);
    // Returns what is still held (an incomplete sequence becomes U+FFFD) and resets.
    std::string finish();
    size_t held_bytes() const { return pending_.size(); }

private:
    const tokenizer & tok_;
    bool skip_special_;
    std::string pending_;
};

} // namespace perigee::tok
