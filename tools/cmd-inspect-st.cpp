// perigee inspect-st PATH [--limit N]: validate a .safetensors file or a model directory (index + shards, or
// model.safetensors) with the strict loader and list its tensors. Exit 1 with the loader's message on a defect.
#include "command.h"
#include "loader/checkpoint.h"

#include <chrono>
#include <cstdio>
#include <sys/stat.h>

namespace perigee::cli {
namespace {

void print_entry(const st_entry & e) {
    std::printf("%-60s %-8s %-24s [%llu, %llu) %llu B\n", e.name.c_str(), std::string(dtype_name(e.type)).c_str(),
                shape_str(e.shape).c_str(), (unsigned long long)e.begin, (unsigned long long)e.end,
                (unsigned long long)e.nbytes());
}

command_registrar reg{{"inspect-st", "validate a safetensors file or model directory and list its tensors",
    [](CLI::App & sub) {
        struct opts { std::string path; size_t limit = 50; };
        auto o = std::make_shared<opts>();
        sub.add_option("path", o->path, "a .safetensors file or a model directory")->required();
        sub.add_option("--limit", o->limit, "list at most this many tensors (0: all)")->capture_default_str();
        return std::function<int()>([o] {
            const auto t0 = std::chrono::steady_clock::now();
            struct stat st{};
            const bool is_dir = ::stat(o->path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
            size_t shown = 0, count = 0;
            uint64_t bytes = 0;
            size_t files = 1;
            if (is_dir) {
                const checkpoint ck = checkpoint::open(o->path);
                const auto t1 = std::chrono::steady_clock::now();
                for (const auto & name : ck.names()) {
                    if (o->limit == 0 || shown < o->limit) { print_entry(ck.entry(name)); ++shown; }
                    ++count;
                }
                bytes = ck.total_bytes();
                files = ck.files().size();
                std::printf("%s: %s, %zu file(s), %zu tensors, %llu bytes, opened in %.3f s\n", ck.dir().c_str(),
                            ck.sharded() ? "sharded" : "single file", files, count, (unsigned long long)bytes,
                            std::chrono::duration<double>(t1 - t0).count());
            } else {
                const auto f = safetensors_file::open(o->path);
                const auto t1 = std::chrono::steady_clock::now();
                for (const auto & [k, v] : f->metadata()) std::printf("__metadata__ %s = %s\n", k.c_str(), v.c_str());
                for (const auto & e : f->entries()) {
                    if (o->limit == 0 || shown < o->limit) { print_entry(e); ++shown; }
                    ++count;
                    bytes += e.nbytes();
                }
                std::printf("%s: header %llu bytes, %zu tensors, %llu data bytes, opened in %.3f s\n", f->path().c_str(),
                            (unsigned long long)f->header_size(), count, (unsigned long long)bytes,
                            std::chrono::duration<double>(t1 - t0).count());
            }
            if (shown < count) std::printf("(%zu more not listed; --limit 0 lists all)\n", count - shown);
            return 0;
        });
    }}};

} // namespace
} // namespace perigee::cli
