// F-2b: the strict config.json parser (RELIABILITY §B2 L-36): any text -> a kimi_config or perigee::error.
// An accepted config must be self-consistent enough to summarise and to size the per-layer tables.
#include "fuzz_util.h"
#include "model/config.h"

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string text(reinterpret_cast<const char *>(data), size);
    try {
        kimi_config c = config_parse(text, "fuzz/config.json");
        FUZZ_CHECK(c.num_hidden_layers > 0, "accepted %lld layers", (long long)c.num_hidden_layers);
        FUZZ_CHECK(int64_t(c.layer_is_kda.size()) == c.num_hidden_layers, "layer_is_kda size");
        FUZZ_CHECK(int64_t(c.layer_is_moe.size()) == c.num_hidden_layers, "layer_is_moe size");
        FUZZ_CHECK(c.n_kda_layers() + c.n_mla_layers() == c.num_hidden_layers, "KDA + MLA != layers");
        (void)config_summary(c);
    } catch (const perigee::error &) {
    }
    return 0;
}
