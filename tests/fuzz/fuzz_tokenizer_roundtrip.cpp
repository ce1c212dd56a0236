// F-4b: encode/decode round trip (RELIABILITY §B4 K-01, K-03, K-06). Input: byte 0 = flags, the rest = text.
//  * invalid UTF-8 -> perigee::error (never UB, never a partial result);
//  * valid UTF-8   -> decode(encode_ordinary(s)) == s, no special id from ordinary text (K-06),
//                     decode(encode(s, all specials)) == s, the same with small outer chunking,
//                     and the two BPE merge strategies (linear scan / heap) agree on every piece.
#include "fuzz_util.h"
#include "tokenizer/utf8.h"

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0 || size > 4096) return 0;
    const uint8_t flags = data[0];
    const std::string_view text(reinterpret_cast<const char *>(data + 1), size - 1);
    const tok::tokenizer & t = fuzz::synthetic_tokenizer((flags & 1) != 0);
    if (!tok::utf8_valid(text)) {
        bool threw = false;
        try { (void)t.encode_ordinary(text); } catch (const perigee::error &) { threw = true; }
        FUZZ_CHECK(threw, "invalid UTF-8 was encoded without an error");
        return 0;
    }
    const auto ids = t.encode_ordinary(text);
    for (auto id : ids) FUZZ_CHECK(!t.is_special(id), "special id %d from ordinary text", id);
    FUZZ_CHECK(t.decode(ids) == text, "decode(encode_ordinary(s)) != s (%zu ids)", ids.size());

    const auto specials = t.all_special_ids();
    const auto ids2 = t.encode(text, specials);
    FUZZ_CHECK(t.decode(ids2) == text, "decode(encode(s, specials)) != s");
    if (flags & 2) {
        const auto none = t.encode(text, {});
        FUZZ_CHECK(none == ids, "encode(s, {}) != encode_ordinary(s)");
    }
    if (flags & 4) {
        for (const std::string & piece : t.pieces(text)) {
            std::vector<tok::token_id> a, b;
            t.bpe_piece(piece, a, false);
            t.bpe_piece(piece, b, true);
            FUZZ_CHECK(a == b, "bpe_piece scan vs heap disagree on a %zu-byte piece", piece.size());
        }
    }
    return 0;
}
