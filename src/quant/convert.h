// `perigee convert`: repack a K3 checkpoint tree's MXFP4 routed experts to NVFP4, losslessly
// (ARCHITECTURE §3.8, trap 32; RELIABILITY §B3). The CLI front end is tools/cmd-convert.cpp.
//
// What it does, for --in DIR --out DIR:
//  * every pair `<x>.weight_packed` U8 [out, in/2] + `<x>.weight_scale` U8/F8_E8M0 [out, in/32] (E8M0) under
//    `.block_sparse_moe.experts.` becomes
//        `<x>.weight_packed`       U8 [out, in/2]       the nibbles, verbatim
//        `<x>.weight_scale`        F8_E4M3 [out, in/16] each E8M0 block scale as an E4M3 power of two, twice
//        `<x>.weight_global_scale` F32 [1]              the per-tensor power-of-two MULTIPLIER G:
//    value = e2m1 * e4m3(weight_scale) * weight_global_scale. (This project's convention; compressed-tensors
//    stores a reciprocal-style divisor there. The output config says so in `perigee_conversion`.)
//    A pair whose block exponents do not fit E4M3's 18 powers of two stays MXFP4 (both tensors copied
//    unchanged) and is reported by name with the reason; nothing is ever clamped. A tensor's format can always
//    be told from its scale dtype: U8/F8_E8M0 = MXFP4, F8_E4M3 = NVFP4.
//  * every other tensor is copied; every other file (tokenizer, generation_config.json, ...) is copied;
//    config.json's quantization_config (inside text_config when there is one) is rewritten: format
//    nvfp4-pack-quantized, config_groups.group_0 the NVFP4 group (with a `perigee_conversion` block documenting
//    the conventions), group_1 an MXFP4 group targeting the kept pairs (when any), and `mxfp4_kept`: the list of
//    kept `<x>` prefixes (always present, maybe empty); model.safetensors.index.json is written (sharded
//    input) with the same shard file names; `perigee_convert_report.json` records kept tensors and the
//    histogram of block-exponent spans.
//  * shard by shard: each output shard holds only views into the mmapped input plus its new scales
//    (1/8 of its packed bytes); each is verified after writing by reopening it and checking every repacked
//    pair against the input (nvfp4_matches_mxfp4) before its done-marker is written.
//  * resumable: `<out>/.perigee-convert/<shard>.done.json` records the input shard's size, mtime and header hash, the
//    options, and the output shard's size and content hash. A re-run skips a shard whose marker matches
//    and whose output re-hashes to the recorded value; anything else is converted again.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace perigee {

struct convert_options {
    std::string in_dir, out_dir;
    bool normal_scales_only = false;   // require E4M3 scales in 2^-6..2^8 (span <= 14) instead of <= 17
    bool verify_full = false;          // post-write check decodes every element (slow) instead of the scale check
    bool force = false;                // ignore done-markers: convert every shard again
    bool require_all = false;          // error (after writing) if any pair had to stay MXFP4
    std::function<void(const std::string &)> log;   // progress lines; empty: stderr
};

struct convert_report {
    int shards = 0, shards_converted = 0, shards_skipped = 0;
    int64_t pairs_repacked = 0;                                  // MXFP4 pairs now NVFP4
    std::vector<std::pair<std::string, std::string>> kept_mxfp4; // (`<x>`, reason), sorted by name
    std::map<int, int64_t> span_histogram;                       // e_max - e_min -> pairs (non-all-zero tensors)
    int64_t tensors_copied = 0;                                  // other tensors (in converted shards)
    std::vector<std::string> files_copied;                       // non-shard files, relative paths
    uint64_t total_size = 0;                                     // output tensor bytes (the index's total_size)
};

// Runs the conversion. Errors (unreadable input, malformed pair, 0xFF scale, out inside in, ...) throw
// perigee::error naming the file/tensor. Returns the report (also written as JSON into out_dir).
convert_report convert_mxfp4_to_nvfp4(const convert_options & opt);

// The marker's 64-bit content hash of a file (a fast non-cryptographic checksum over 8-byte words; it detects
// accidental change and truncation, not tampering). Exposed for tests.
uint64_t convert_file_hash(const std::string & path);

} // namespace perigee
