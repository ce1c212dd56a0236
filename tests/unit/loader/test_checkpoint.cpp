// checkpoint: sharded layout rules (RELIABILITY.md §B2 L-30..L-35) and the single-file layout.
#include "loader/checkpoint.h"
#include "loader_test_util.h"

#include <cstring>

namespace perigee::test {
namespace {

tensor filled(dtype t, const shape_t & shape, uint8_t seed) {
    tensor r = tensor_new(t, shape);
    for (size_t i = 0; i < r.nbytes; ++i) static_cast<uint8_t *>(r.data)[i] = uint8_t(seed + i * 13);
    return r;
}

// Two shards: s1 = {a, b}, s2 = {c}; total 8 + 4 + 12 = 24 bytes.
struct sharded_fixture {
    temp_dir td;
    std::string dir = td.path.string();
    tensor a = filled(dtype::F32, {2}, 1), b = filled(dtype::BF16, {2}, 2), c = filled(dtype::U8, {3, 4}, 3);
    std::map<std::string, std::string> wm{{"a", "s1.safetensors"}, {"b", "s1.safetensors"}, {"c", "s2.safetensors"}};
    sharded_fixture() {
        safetensors_write(td.file("s1.safetensors"), {{"a", a}, {"b", b}});
        safetensors_write(td.file("s2.safetensors"), {{"c", c}});
    }
    void index(const std::map<std::string, std::string> & m, uint64_t total = 24) { checkpoint_write_index(dir, m, total); }
    void raw_index(const std::string & json) { write_bytes(td.file("model.safetensors.index.json"), json); }
};

void expect_ckpt_fails(const std::string & dir, std::initializer_list<std::string> parts) {
    try {
        checkpoint::open(dir);
        ADD_FAILURE() << "checkpoint::open accepted " << dir;
    } catch (const perigee::error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(dir), std::string::npos) << "message does not name the directory: " << msg;
        for (const auto & p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    }
}

TEST(checkpoint, sharded_good) {
    sharded_fixture fx;
    fx.index(fx.wm);
    // L-35: an extra .safetensors the index does not name is never opened (this one is garbage).
    write_bytes(fx.td.file("stale.safetensors"), "garbage");
    const checkpoint ck = checkpoint::open(fx.dir + "/");
    EXPECT_EQ(ck.dir(), fx.dir);
    EXPECT_TRUE(ck.sharded());
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_TRUE(ck.has("c"));
    EXPECT_FALSE(ck.has("d"));
    EXPECT_EQ(ck.total_bytes(), 24u);
    EXPECT_EQ(ck.files().size(), 2u);
    EXPECT_EQ(ck.file_of("c"), fx.td.file("s2.safetensors"));
    EXPECT_EQ(ck.entry("b").type, dtype::BF16);
    for (const auto & [name, src] : std::vector<std::pair<std::string, const tensor *>>{{"a", &fx.a}, {"b", &fx.b}, {"c", &fx.c}}) {
        const tensor t = ck.get(name);
        EXPECT_EQ(t.shape, src->shape);
        ASSERT_EQ(t.nbytes, src->nbytes);
        EXPECT_EQ(std::memcmp(t.data, src->data, t.nbytes), 0) << name;
    }
    const checkpoint copy = ck;   // copies share the mappings
    EXPECT_EQ(std::memcmp(copy.get("c").data, fx.c.data, fx.c.nbytes), 0);
    try {
        ck.entry("nope");
        ADD_FAILURE();
    } catch (const perigee::error & e) {
        EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
    }
    EXPECT_THROW(ck.get("nope"), perigee::error);
}

TEST(checkpoint, single_file_good) {
    temp_dir td;
    const tensor a = filled(dtype::F16, {4}, 9);
    safetensors_write(td.file("model.safetensors"), {{"w", a}});
    const checkpoint ck = checkpoint::open(td.path.string());
    EXPECT_FALSE(ck.sharded());
    EXPECT_EQ(ck.names(), std::vector<std::string>{"w"});
    EXPECT_EQ(ck.total_bytes(), 8u);
    EXPECT_EQ(ck.file_of("w"), td.file("model.safetensors"));
    EXPECT_EQ(std::memcmp(ck.get("w").data, a.data, 8), 0);
}

// HF cache layout: snapshot files are symlinks into ../../blobs. Followed; only index-given names are guarded.
TEST(checkpoint, symlinked_shard_followed) {
    sharded_fixture fx;
    fs::create_directories(fx.td.path / "blobs");
    fs::rename(fx.td.path / "s2.safetensors", fx.td.path / "blobs" / "abc");
    fs::create_symlink("blobs/abc", fx.td.path / "s2.safetensors");
    fx.index(fx.wm);
    EXPECT_EQ(checkpoint::open(fx.dir).names().size(), 3u);
}

TEST(checkpoint, both_index_and_single_file) {
    sharded_fixture fx;
    fx.index(fx.wm);
    safetensors_write(fx.td.file("model.safetensors"), {});
    expect_ckpt_fails(fx.dir, {"both", "model.safetensors.index.json"});
}

TEST(checkpoint, neither_index_nor_single_file) {
    sharded_fixture fx;   // shards present, but nothing says which to use
    expect_ckpt_fails(fx.dir, {"neither"});
}

TEST(checkpoint, not_a_directory) {
    temp_dir td;
    expect_ckpt_fails(td.file("absent"), {"cannot open model directory"});
    write_bytes(td.file("f"), "x");
    expect_ckpt_fails(td.file("f"), {"not a directory"});
}

TEST(checkpoint, index_names_missing_shard) {   // L-31
    sharded_fixture fx;
    auto wm = fx.wm;
    wm["c"] = "s3.safetensors";
    fx.index(wm);
    expect_ckpt_fails(fx.dir, {"shard 's3.safetensors'", "tensor 'c'", "does not exist"});
}

TEST(checkpoint, shard_paths_escaping_the_dir) {   // L-30
    for (const std::string bad : {"../s2.safetensors", "/tmp/s2.safetensors", "a/../../x.safetensors", "sub/s2.safetensors",
                                  "", "..", ".", "s2..safetensors", "s2.safetensors\\\\x"}) {
        sharded_fixture fx;
        fx.raw_index(std::string(R"({"metadata":{"total_size":24},"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":")") +
                     bad + "\"}}");
        expect_ckpt_fails(fx.dir, {"shard path escapes model dir", "tensor 'c'"});
    }
    sharded_fixture fx;   // NUL inside the name (JSON \u0000)
    fx.raw_index(R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors\u0000x"}})");
    expect_ckpt_fails(fx.dir, {"shard path escapes model dir", "\\x00"});
    EXPECT_THROW(checkpoint_write_index(fx.dir, {{"a", "../x"}}, 0), perigee::error);
}

TEST(checkpoint, tensor_in_wrong_shard) {   // L-32
    sharded_fixture fx;
    auto wm = fx.wm;
    wm["b"] = "s2.safetensors";
    fx.index(wm);
    expect_ckpt_fails(fx.dir, {"tensor 'b'", "is in shard 's1.safetensors'", "maps it to shard 's2.safetensors'"});
}

TEST(checkpoint, shard_holds_unindexed_tensor) {   // L-32 (second half), L-33 shape
    sharded_fixture fx;
    auto wm = fx.wm;
    wm.erase("b");
    fx.index(wm, 20);
    expect_ckpt_fails(fx.dir, {"tensor 'b'", "shard 's1.safetensors'", "not listed in the index"});
}

TEST(checkpoint, same_tensor_in_two_shards) {   // L-33
    sharded_fixture fx;
    safetensors_write(fx.td.file("s2.safetensors"), {{"c", fx.c}, {"a", fx.a}});
    fx.index(fx.wm, 32);
    expect_ckpt_fails(fx.dir, {"tensor 'a'", "s1.safetensors", "s2.safetensors"});
}

TEST(checkpoint, index_lists_tensor_no_shard_has) {   // L-32
    sharded_fixture fx;
    auto wm = fx.wm;
    wm["ghost"] = "s2.safetensors";
    fx.index(wm);
    expect_ckpt_fails(fx.dir, {"tensor 'ghost'", "shard 's2.safetensors'", "has no such tensor"});
}

TEST(checkpoint, total_size_mismatch) {   // L-34
    sharded_fixture fx;
    fx.index(fx.wm, 25);
    expect_ckpt_fails(fx.dir, {"total_size is 25", "24 bytes"});
}

TEST(checkpoint, bad_shard_is_rejected_naming_it) {
    sharded_fixture fx;
    fx.index(fx.wm);
    write_bytes(fx.td.file("s2.safetensors"), st_bytes("{}", 3));
    expect_ckpt_fails(fx.dir, {"s2.safetensors", "trailing bytes"});
}

TEST(checkpoint, malformed_index) {
    struct bad { const char * json; const char * expect; };
    for (const bad & b : std::vector<bad>{
             {R"({"weight_map":{"a":"s1.safetensors","a":"s2.safetensors"}})", "duplicate key 'a'"},
             {R"({"weight_map":{"a":1}})", "shard must be a string"},
             {R"({"weight_map":["a"]})", "'weight_map' must be an object"},
             {R"({"metadata":{}})", "missing key 'weight_map'"},
             {R"({"weight_map":{},"extra":1})", "unknown key 'extra'"},
             {R"({"metadata":{"total_size":-1},"weight_map":{}})", "total_size must be a non-negative integer"},
             {R"({"metadata":{"total_size":"24"},"weight_map":{}})", "total_size must be a non-negative integer"},
             {R"({"metadata":[],"weight_map":{}})", "'metadata' must be an object"},
             {R"([])", "top level must be a JSON object"},
             {R"({"weight_map":{)", "invalid JSON"},
         }) {
        sharded_fixture fx;
        fx.raw_index(b.json);
        expect_ckpt_fails(fx.dir, {"model.safetensors.index.json", b.expect});
    }
    {
        // nlohmann stops at a NUL byte and would ignore the rest (here an unknown key): refused by name
        sharded_fixture fx;
        fx.raw_index(std::string(R"({"weight_map":{}})") + std::string(1, '\0') + R"(,"extra":1})");
        expect_ckpt_fails(fx.dir, {"model.safetensors.index.json", "a NUL byte at offset 17"});
    }
    sharded_fixture fx;
    fx.raw_index(std::string(100000, '[') + std::string(100000, ']'));
    expect_ckpt_fails(fx.dir, {"nested deeper"});
}

TEST(checkpoint, write_index_round_trip) {
    sharded_fixture fx;
    fx.index(fx.wm);
    std::ifstream in(fx.td.file("model.safetensors.index.json"));
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    EXPECT_NE(text.find("\"total_size\": 24"), std::string::npos) << text;
    EXPECT_NE(text.find("\"weight_map\""), std::string::npos) << text;
    EXPECT_NO_THROW(checkpoint::open(fx.dir));
}

} // namespace
} // namespace perigee::test
