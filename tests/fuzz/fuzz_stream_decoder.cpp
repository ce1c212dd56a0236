// F-5: the streaming detokenizer on arbitrary id sequences (RELIABILITY §B4 K-08). Input: byte 0 = flags,
// then little-endian u16 pairs mapped onto [0, n_vocab] where n_vocab itself stands for an out-of-range id
// (alternately -1, n_vocab, 2^31-1). Properties: out-of-range ids and unassigned special slots throw perigee::error; every delta is valid
// UTF-8; the deltas concatenate to utf8_replace_invalid(decode(ids)) whether ids are pushed one by one or
// in spans; held_bytes() stays below 4.
#include "fuzz_util.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/utf8.h"

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0 || size > 8192) return 0;
    const uint8_t flags = data[0];
    const tok::tokenizer & t = fuzz::synthetic_tokenizer(false);
    const auto n_vocab = static_cast<tok::token_id>(t.n_vocab());
    std::vector<tok::token_id> ids;
    int bad = -1;
    static const tok::token_id out_of_range[3] = {-1, 0, 0x7fffffff};
    for (size_t i = 1; i + 1 < size; i += 2) {
        const uint32_t v = uint32_t(data[i]) | (uint32_t(data[i + 1]) << 8);
        tok::token_id id = static_cast<tok::token_id>(v % uint32_t(n_vocab + 1));
        if (id == n_vocab) id = out_of_range[ids.size() % 3] == 0 ? n_vocab : out_of_range[ids.size() % 3];
        if (bad < 0) {   // an unassigned special slot (a gap in the special table) is invalid too
            try { (void)t.token_bytes(id); } catch (const perigee::error &) { bad = static_cast<int>(ids.size()); }
        }
        ids.push_back(id);
    }
    const bool skip = (flags & 1) != 0;
    tok::stream_decoder one(t, skip);
    std::string joined;
    size_t i = 0;
    try {
        for (; i < ids.size(); ++i) {
            const std::string d = one.push(ids[i]);
            FUZZ_CHECK(tok::utf8_valid(d), "delta %zu is not valid UTF-8", i);
            FUZZ_CHECK(one.held_bytes() < 4, "holding %zu bytes", one.held_bytes());
            joined += d;
        }
    } catch (const perigee::error &) {
        FUZZ_CHECK(bad >= 0 && i == size_t(bad), "push threw at %zu (first out-of-range id at %d)", i, bad);
        return 0;
    }
    FUZZ_CHECK(bad < 0, "out-of-range id at %d accepted", bad);
    const std::string tail = one.finish();
    FUZZ_CHECK(tok::utf8_valid(tail), "finish() is not valid UTF-8");
    joined += tail;
    const std::string want = tok::utf8_replace_invalid(t.decode(ids, skip));
    FUZZ_CHECK(joined == want, "streamed %zu bytes != one-shot %zu bytes", joined.size(), want.size());

    // Same ids pushed as spans of pseudo-random lengths.
    fuzz::rng r(flags);
    tok::stream_decoder spans(t, skip);
    std::string joined2;
    for (size_t p = 0; p < ids.size();) {
        const size_t n = std::min(ids.size() - p, 1 + r.below(5));
        joined2 += spans.push(std::span<const tok::token_id>(ids.data() + p, n));
        p += n;
    }
    joined2 += spans.finish();
    FUZZ_CHECK(joined2 == want, "span pushes disagree with the one-shot decode");
    return 0;
}
