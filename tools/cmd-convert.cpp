// perigee convert --in DIR --out DIR: lossless MXFP4 -> NVFP4 repack of a K3 checkpoint tree.
// The work is src/quant/convert.h (documented there); this file is the command line.
#include "command.h"
#include "quant/convert.h"

#include <fmt/format.h>

namespace {

perigee::cli::command_registrar reg{{
    "convert",
    "Repack a K3 checkpoint's MXFP4 routed experts to NVFP4, losslessly (tensors that do not fit stay MXFP4)",
    [](CLI::App & sub) {
        auto o = std::make_shared<perigee::convert_options>();
        sub.add_option("--in", o->in_dir, "input checkpoint directory (MXFP4 experts)")->required();
        sub.add_option("--out", o->out_dir, "output directory (created; resumable)")->required();
        sub.add_flag("--normal-scales-only", o->normal_scales_only,
                     "only use normal E4M3 scales (2^-6..2^8, span <= 14); wider tensors stay MXFP4");
        sub.add_flag("--verify-full", o->verify_full,
                     "after writing each shard, decode every repacked element and compare bit for bit (slow)");
        sub.add_flag("--force", o->force, "ignore done-markers and convert every shard again");
        sub.add_flag("--require-all", o->require_all, "fail if any tensor had to stay MXFP4");
        return std::function<int()>([o] {
            const perigee::convert_report r = perigee::convert_mxfp4_to_nvfp4(*o);
            for (const auto & [x, why] : r.kept_mxfp4) fmt::print(stderr, "kept MXFP4: {}\n", why);
            fmt::print("converted {} pairs to NVFP4, kept {} MXFP4 ({} shards converted, {} skipped)\n",
                       r.pairs_repacked, r.kept_mxfp4.size(), r.shards_converted, r.shards_skipped);
            return 0;
        });
    },
}};

} // namespace
