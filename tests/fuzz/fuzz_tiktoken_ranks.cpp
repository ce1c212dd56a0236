// F-4a: the strict tiktoken.model rank loader (RELIABILITY §B2 L-37, §B4 K-07). An accepted rank file must
// give a working tokenizer: decode(encode(s)) == s for a fixed mixed-script probe (every single byte is a
// token, so any valid rank file round-trips).
#include "fuzz_util.h"
#include "tokenizer/utf8.h"

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string_view text(reinterpret_cast<const char *>(data), size);
    tok::rank_file rf;
    try {
        rf = tok::parse_tiktoken_ranks(text, "fuzz/tiktoken.model");
    } catch (const perigee::error &) {
        return 0;
    }
    FUZZ_CHECK(rf.tokens.size() >= 256, "accepted %zu ranks (fewer than the 256 single bytes)", rf.tokens.size());
    for (const std::string & t : rf.tokens) FUZZ_CHECK(!t.empty(), "empty token accepted");
    if (rf.tokens.size() > 20000) return 0;   // keep iterations fast
    const auto base = static_cast<tok::token_id>(rf.tokens.size());
    tok::tokenizer t(std::move(rf), fuzz::k3_specials(base), tok::k_pat_kimi);
    static const std::string probe = "Hello, world! \xe4\xb8\xad\xe6\x96\x87 caf\xc3\xa9 \xf0\x9f\x98\x80  x=1;\n\n\tend <|open|>";
    const auto ids = t.encode_ordinary(probe);
    FUZZ_CHECK(t.decode(ids) == probe, "round trip failed with a fuzzed rank file");
    for (auto id : ids) FUZZ_CHECK(!t.is_special(id), "special id %d from encode_ordinary", id);
    return 0;
}
