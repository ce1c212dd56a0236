// F-7: the lossless MXFP4 -> NVFP4 repack, differential against the scalar references (RELIABILITY §B3
// C-03..C-06, ARCHITECTURE §3.8 trap 32). Input: 4 header bytes (rows, 32-blocks per row, scale mode,
// scale base) then the packed nibbles and scale bytes (cycled when short).
// Properties:
//  * throws perigee::error  <=>  some scale byte is 0xFF (shapes are valid by construction);
//  * ok  <=>  e_max - e_min <= 17 (14 with normal_scales_only) over the blocks with a nonzero nibble;
//  * ok  =>  nvfp4_dequant_ref(repack) == mxfp4_dequant_ref(input) bit for bit, both self-checks agree,
//            the nibbles are verbatim, the global scale is a normal power of two;
//  * !ok =>  a reason is given.
#include "fuzz_util.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

#include <cmath>
#include <cstring>

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 5) return 0;
    const int64_t rows = 1 + data[0] % 8;
    const int64_t nb = 1 + data[1] % 8;             // 32-blocks per row
    const int64_t in = nb * k_mxfp4_block;
    const uint8_t mode = data[2];
    const uint8_t base = data[3];
    const bool normal_only = (mode & 0x80) != 0;
    const uint8_t * src = data + 4;
    const size_t n_src = size - 4;

    tensor packed = tensor_new(dtype::U8, {rows, in / 2});
    tensor scale = tensor_new(dtype::U8, {rows, nb});
    uint8_t * pk = packed.as<uint8_t>();
    uint8_t * sc = scale.as<uint8_t>();
    size_t k = 0;
    for (size_t i = 0; i < packed.nbytes; ++i) pk[i] = src[k++ % n_src];
    // Scale bytes: raw (mode 0), or base + small spread (mode 1..3, spreads up to 7 / 19 / 31) so that the
    // lossless and the lossy side of the 17-power limit are both reached often.
    const int spread[4] = {256, 8, 20, 32};
    for (size_t i = 0; i < scale.nbytes; ++i) {
        const uint8_t b = src[k++ % n_src];
        sc[i] = (mode & 3) == 0 ? b : uint8_t(std::min(254, base + b % spread[mode & 3]));
    }
    if (mode & 0x40) sc[(mode >> 3) % scale.nbytes] = 0xFF;   // sometimes a NaN scale

    bool has_ff = false;
    int e_min = 1000, e_max = -1000;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t s = sc[r * nb + b];
            if (s == 0xFF) has_ff = true;
            bool nonzero = false;
            for (int64_t j = 0; j < k_mxfp4_block / 2; ++j) {
                const uint8_t v = pk[r * (in / 2) + b * 16 + j];
                nonzero |= (v & 0x7) != 0 || (v & 0x70) != 0;
            }
            if (nonzero && s != 0xFF) { e_min = std::min(e_min, s - 127); e_max = std::max(e_max, s - 127); }
        }

    nvfp4_repack rp;
    try {
        rp = mxfp4_to_nvfp4(packed, scale, "fuzz", normal_only);
    } catch (const perigee::error &) {
        FUZZ_CHECK(has_ff, "repack threw without a 0xFF scale");
        return 0;
    }
    FUZZ_CHECK(!has_ff, "a 0xFF (NaN) scale was accepted");
    const int limit = normal_only ? 14 : 17;
    const bool want_ok = e_max < e_min || e_max - e_min <= limit;
    FUZZ_CHECK(rp.ok == want_ok, "ok=%d but span %d (limit %d): %s", int(rp.ok), e_max - e_min, limit, rp.why.c_str());
    if (!rp.ok) {
        FUZZ_CHECK(!rp.why.empty(), "lossy without a reason");
        return 0;
    }
    FUZZ_CHECK(std::isnormal(rp.global_scale) && rp.global_scale == std::ldexp(1.0f, rp.global_log2), "global scale");
    FUZZ_CHECK(rp.packed.nbytes == packed.nbytes && std::memcmp(rp.packed.data, pk, packed.nbytes) == 0, "nibbles changed");
    const tensor a = mxfp4_dequant_ref(packed, scale, "fuzz");
    const tensor b = nvfp4_dequant_ref(rp.packed, rp.scale, rp.global_scale, "fuzz");
    FUZZ_CHECK(a.nbytes == b.nbytes, "dequant sizes");
    const uint32_t * ua = static_cast<const uint32_t *>(a.data);
    const uint32_t * ub = static_cast<const uint32_t *>(b.data);
    for (size_t i = 0; i < a.nbytes / 4; ++i)
        FUZZ_CHECK(ua[i] == ub[i], "element %zu: mxfp4 %08x != nvfp4 %08x (row %lld)", i, ua[i], ub[i],
                   (long long)(int64_t(i) / in));
    const std::string full = nvfp4_matches_mxfp4(packed, scale, rp.packed, rp.scale, rp.global_scale, "fuzz", true);
    const std::string cheap = nvfp4_matches_mxfp4(packed, scale, rp.packed, rp.scale, rp.global_scale, "fuzz", false);
    FUZZ_CHECK(full.empty() && cheap.empty(), "self-check disagrees: full '%s' cheap '%s'", full.c_str(), cheap.c_str());
    return 0;
}
