// F-2a: model.safetensors.index.json of a sharded directory (RELIABILITY §B2 L-30..L-34). The fuzz input is
// the index text; the directory holds two valid shards (a: x, y; b: z) and a stray shard that the index may
// name. Accepted directories must expose exactly the indexed tensors, each readable and in its named shard.
#include "fuzz_util.h"
#include "loader/checkpoint.h"

#include <filesystem>
#include <fstream>

using namespace perigee;
namespace fs = std::filesystem;

namespace {
std::string g_dir;

tensor filled(dtype t, shape_t s, uint8_t v) {
    tensor x = tensor_new(t, s);
    std::fill_n(static_cast<uint8_t *>(x.data), x.nbytes, v);
    return x;
}
} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    const char * base = std::getenv("TMPDIR");
    g_dir = (fs::exists("/dev/shm") ? std::string("/dev/shm") : std::string(base ? base : "/tmp")) +
            "/perigee-fuzz-index-" + std::to_string(getpid());
    fs::create_directories(g_dir);
    safetensors_write(g_dir + "/a.safetensors", {{"x", filled(dtype::F32, {2, 3}, 1)}, {"y", filled(dtype::BF16, {4}, 2)}});
    safetensors_write(g_dir + "/b.safetensors", {{"z", filled(dtype::U8, {5}, 3)}});
    safetensors_write(g_dir + "/stray.safetensors", {{"w", filled(dtype::U8, {1}, 4)}});
    std::atexit([] { std::error_code ec; fs::remove_all(g_dir, ec); });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    {
        std::ofstream o(g_dir + "/model.safetensors.index.json", std::ios::binary | std::ios::trunc);
        o.write(reinterpret_cast<const char *>(data), static_cast<std::streamsize>(size));
    }
    try {
        checkpoint ck = checkpoint::open(g_dir);
        uint64_t total = 0;
        for (const std::string & n : ck.names()) {
            FUZZ_CHECK(ck.has(n), "names() lists %s but has() is false", n.c_str());
            tensor t = ck.get(n);
            total += t.nbytes;
            const std::string & file = ck.file_of(n);
            FUZZ_CHECK(fs::path(file).parent_path() == fs::path(g_dir), "%s: shard %s outside the directory",
                       n.c_str(), file.c_str());
            if (t.nbytes) (void)static_cast<const volatile uint8_t *>(t.data)[t.nbytes - 1];
        }
        FUZZ_CHECK(total == ck.total_bytes(), "total_bytes mismatch");
    } catch (const perigee::error &) {
    }
    return 0;
}
