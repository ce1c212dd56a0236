// safetensors_file: the defect matrix (RELIABILITY.md §B1, one generated bad file per rule, each rejected with
// the expected message naming the file and the tensor), the good cases, and a control that proves the matrix
// can fail.
#include "loader_test_util.h"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

namespace perigee::test {
namespace {

// One header entry: "name":{"dtype":..,"shape":..,"data_offsets":[b,e]}.
std::string E(const std::string & name, const std::string & dt, const std::string & shape, uint64_t b, uint64_t e) {
    return fmt::format(R"("{}":{{"dtype":"{}","shape":{},"data_offsets":[{},{}]}})", name, dt, shape, b, e);
}
std::string obj(const std::string & body) { return "{" + body + "}"; }

struct defect {
    std::string id;
    std::string header;
    uint64_t data_size;
    std::optional<uint64_t> n;   // header length prefix, when it should lie
    std::vector<std::string> expect;
};

std::ostream & operator<<(std::ostream & o, const defect & d) { return o << d.id; }

const std::string k_ok = E("a", "F32", "[2]", 0, 8);   // a valid entry needing 8 data bytes

std::vector<defect> defects() {
    const std::string deep(100000, '[');
    const std::string undeep(100000, ']');
    return {
        // L-02, L-03, L-04, L-05: the length prefix, bounded before anything is allocated.
        {"len_zero", "", 0, 0, {"header too small"}},
        {"len_one", "{", 0, std::nullopt, {"header too small"}},
        {"header_too_large", "{}", 0, 100'000'001, {"header too large", "100000001"}},
        {"header_len_2_63", "{}", 0, uint64_t(1) << 63, {"header too large"}},
        {"header_len_u64_max", "{}", 0, UINT64_MAX, {"header too large"}},
        {"header_longer_than_file", "{}      ", 0, 9, {"header length exceeds file", "9"}},
        {"header_50mb_in_small_file", "{}", 0, 50'000'000, {"header length exceeds file"}},
        // L-07: first byte and padding.
        {"first_byte_space", " {}     ", 0, std::nullopt, {"must begin with '{'", "0x20"}},
        {"first_byte_bom", "\xEF\xBB\xBF{}   ", 0, std::nullopt, {"must begin with '{'", "0xef"}},
        {"first_byte_bracket", "[]      ", 0, std::nullopt, {"must begin with '{'"}},
        {"nul_padding", std::string("{}\0\0\0\0\0\0", 8), 0, std::nullopt, {"padding must be spaces", "0x00"}},
        {"tab_padding", "{}\t     ", 0, std::nullopt, {"padding must be spaces", "0x09"}},
        {"newline_padding", "{}\n", 0, std::nullopt, {"padding must be spaces"}},
        {"nul_then_spaces_padding", std::string("{}\0     ", 8), 0, std::nullopt, {"padding must be spaces"}},
        // L-08: not JSON.
        {"json_truncated", R"({"a":{"dtype":"F32")", 0, std::nullopt, {"not valid JSON"}},
        {"json_trailing_comma", obj(k_ok + ","), 8, std::nullopt, {"not valid JSON"}},
        {"json_comment", "{/* c */}", 0, std::nullopt, {"not valid JSON"}},
        {"json_nan_literal", obj(R"("a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]})"), 8, std::nullopt, {"not valid JSON"}},
        {"json_single_quotes", "{'a':{}}", 0, std::nullopt, {"not valid JSON"}},
        {"json_trailing_garbage", "{} x", 0, std::nullopt, {"not valid JSON"}},
        {"json_two_objects", "{}{}", 0, std::nullopt, {"not valid JSON"}},
        // L-06: UTF-8.
        {"utf8_ff", obj(E("a\xff", "F32", "[2]", 0, 8)), 8, std::nullopt, {"not valid UTF-8"}},
        {"utf8_overlong", obj(E("a\xc0\x80", "F32", "[2]", 0, 8)), 8, std::nullopt, {"not valid UTF-8"}},
        {"utf8_surrogate", obj(E("a\xed\xa0\x80", "F32", "[2]", 0, 8)), 8, std::nullopt, {"not valid UTF-8"}},
        // L-10: duplicate keys.
        {"duplicate_tensor", obj(k_ok + "," + E("a", "F32", "[2]", 8, 16)), 16, std::nullopt, {"duplicate key 'a'"}},
        {"duplicate_tensor_same_offsets", obj(k_ok + "," + k_ok), 8, std::nullopt, {"duplicate key 'a'"}},
        {"duplicate_field", obj(R"("a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]})"), 8, std::nullopt,
         {"tensor 'a'", "duplicate key 'dtype'"}},
        {"duplicate_metadata", obj(R"("__metadata__":{"k":"v"},"__metadata__":{"k":"v"})"), 0, std::nullopt,
         {"duplicate key '__metadata__'"}},
        {"duplicate_metadata_key", obj(R"("__metadata__":{"k":"v","k":"w"})"), 0, std::nullopt, {"duplicate key 'k'"}},
        // L-09: schema.
        {"unknown_field", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1})"), 8, std::nullopt,
         {"tensor 'a'", "unknown field 'extra'"}},
        {"missing_dtype", obj(R"("a":{"shape":[2],"data_offsets":[0,8]})"), 8, std::nullopt, {"tensor 'a'", "missing field 'dtype'"}},
        {"missing_shape", obj(R"("a":{"dtype":"F32","data_offsets":[0,8]})"), 8, std::nullopt, {"tensor 'a'", "missing field 'shape'"}},
        {"missing_offsets", obj(R"("a":{"dtype":"F32","shape":[2]})"), 8, std::nullopt, {"tensor 'a'", "missing field 'data_offsets'"}},
        {"entry_array", obj(R"("a":[1])"), 0, std::nullopt, {"tensor 'a'", "must be an object"}},
        {"entry_string", obj(R"("a":"x")"), 0, std::nullopt, {"tensor 'a'", "must be an object"}},
        {"empty_tensor_name", obj(E("", "F32", "[2]", 0, 8)), 8, std::nullopt, {"empty tensor name"}},
        {"tensor_name_too_long", obj(E(std::string(2000, 'n'), "F32", "[2]", 0, 8)), 8, std::nullopt,
         {"tensor name of 2000 bytes exceeds the limit"}},
        {"deep_nesting_entry", obj("\"a\":" + deep + undeep), 0, std::nullopt, {"tensor 'a'", "must be an object"}},
        {"deep_nesting_shape", obj("\"a\":{\"shape\":[" + deep + undeep + "]}"), 0, std::nullopt,
         {"tensor 'a'", "dimension 0 of shape", "array"}},
        // L-11: __metadata__ is string -> string only.
        {"metadata_not_object", obj(R"("__metadata__":"x")"), 0, std::nullopt, {"__metadata__ must be an object"}},
        {"metadata_number_value", obj(R"("__metadata__":{"k":1})"), 0, std::nullopt, {"__metadata__ key 'k'", "must be a string"}},
        {"metadata_nested_value", obj(R"("__metadata__":{"k":{"x":"y"}})"), 0, std::nullopt, {"__metadata__ key 'k'", "must be a string"}},
        {"metadata_null_value", obj(R"("__metadata__":{"k":null})"), 0, std::nullopt, {"__metadata__ key 'k'", "null"}},
        {"metadata_array_value", obj(R"("__metadata__":{"k":["v"]})"), 0, std::nullopt, {"__metadata__ key 'k'"}},
        // L-12: dtype.
        {"dtype_unknown", obj(E("a", "F128", "[2]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "unknown dtype 'F128'"}},
        {"dtype_lowercase", obj(E("a", "f16", "[2]", 0, 4)), 4, std::nullopt, {"tensor 'a'", "unknown dtype 'f16'"}},
        {"dtype_empty", obj(E("a", "", "[2]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "unknown dtype ''"}},
        {"dtype_number", obj(R"("a":{"dtype":5,"shape":[2],"data_offsets":[0,8]})"), 8, std::nullopt,
         {"tensor 'a'", "dtype must be a string"}},
        // L-13: dims.
        {"dim_negative", obj(E("a", "F32", "[-2]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "negative"}},
        {"dim_float", obj(E("a", "F32", "[1.5]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "1.5", "not an integer"}},
        {"dim_float_whole", obj(E("a", "F32", "[2.0]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "not an integer"}},
        {"dim_string", obj(E("a", "F32", "[\"4\"]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "string"}},
        {"dim_above_2_48", obj(E("a", "F32", "[281474976710656]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "overflow"}},
        {"dim_above_u64", obj(E("a", "F32", "[99999999999999999999999]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "not an integer"}},
        {"rank_above_8", obj(E("a", "F32", "[1,1,1,1,1,1,1,1,2]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "more than 8 dimensions"}},
        {"shape_not_array", obj(E("a", "F32", "2", 0, 8)), 8, std::nullopt, {"tensor 'a'", "shape must be an array"}},
        {"numel_overflow", obj(E("a", "F32", "[281474976710655,281474976710655]", 0, 8)), 8, std::nullopt,
         {"tensor 'a'", "overflows 64 bits"}},
        {"nbits_overflow", obj(E("a", "F32", "[1099511627776,4194304]", 0, 8)), 8, std::nullopt,
         {"tensor 'a'", "bit count overflows 64 bits"}},
        // L-14: data_offsets.
        {"offsets_three", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]})"), 8, std::nullopt,
         {"tensor 'a'", "exactly 2 values"}},
        {"offsets_one", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0]})"), 8, std::nullopt,
         {"tensor 'a'", "exactly 2 values, got 1"}},
        {"offsets_negative", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]})"), 8, std::nullopt,
         {"tensor 'a'", "negative"}},
        {"offsets_float", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]})"), 8, std::nullopt,
         {"tensor 'a'", "not an integer"}},
        {"offsets_string", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":["0",8]})"), 8, std::nullopt,
         {"tensor 'a'", "data_offsets value 0"}},
        {"offsets_not_array", obj(R"("a":{"dtype":"F32","shape":[2],"data_offsets":8})"), 8, std::nullopt,
         {"tensor 'a'", "data_offsets must be an array"}},
        {"offsets_end_lt_begin", obj(E("a", "F32", "[2]", 8, 0)), 8, std::nullopt, {"tensor 'a'", "end < begin"}},
        {"offsets_past_buffer", obj(E("a", "F32", "[2]", 0, 8)), 4, std::nullopt, {"tensor 'a'", "past the data buffer"}},
        {"offsets_first_not_zero", obj(E("a", "F32", "[2]", 4, 12)), 12, std::nullopt, {"tensor 'a'", "begins at byte 4, not 0"}},
        {"offsets_hole", obj(k_ok + "," + E("b", "F32", "[2]", 12, 20)), 20, std::nullopt,
         {"tensor 'b'", "hole of 4 bytes", "'a'"}},
        {"offsets_overlap", obj(k_ok + "," + E("b", "F32", "[2]", 4, 12)), 12, std::nullopt, {"tensor 'b'", "overlap", "'a'"}},
        {"offsets_same_region", obj(k_ok + "," + E("b", "F32", "[2]", 0, 8)), 8, std::nullopt, {"tensor 'b'", "overlap"}},
        {"zero_size_inside_other", obj(k_ok + "," + E("z", "F32", "[0]", 4, 4)), 8, std::nullopt, {"tensor 'z'", "overlap"}},
        // L-15, L-16: size vs shape.
        {"size_mismatch", obj(E("a", "F32", "[3]", 0, 8)), 8, std::nullopt, {"tensor 'a'", "size mismatch", "span 8", "needs 12"}},
        {"size_mismatch_mlx_3363", obj(E("a", "F32", "[1000,1000]", 0, 4)), 4, std::nullopt, {"tensor 'a'", "needs 4000000"}},
        {"f4_odd_elements", obj(E("a", "F4", "[3]", 0, 2)), 2, std::nullopt, {"tensor 'a'", "misaligned", "12 bits"}},
        // L-17: trailing bytes.
        {"trailing_bytes", obj(k_ok), 9, std::nullopt, {"trailing bytes", "1 bytes after the last tensor"}},
        {"trailing_bytes_empty_header", "{}", 1, std::nullopt, {"trailing bytes"}},
    };
}

class st_defect : public ::testing::TestWithParam<defect> {};

TEST_P(st_defect, rejected_with_message) {
    const defect & d = GetParam();
    temp_dir td;
    const std::string p = td.file(d.id + ".safetensors");
    write_bytes(p, st_bytes(d.header, d.data_size, d.n));
    std::vector<std::string> parts = d.expect;
    try {
        safetensors_file::open(p);
        ADD_FAILURE() << d.id << ": open() accepted the file";
    } catch (const perigee::error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(p), std::string::npos) << "message does not name the file: " << msg;
        for (const auto & s : parts) EXPECT_NE(msg.find(s), std::string::npos) << "missing '" << s << "' in: " << msg;
    }
}

INSTANTIATE_TEST_SUITE_P(matrix, st_defect, ::testing::ValuesIn(defects()),
                         [](const ::testing::TestParamInfo<defect> & i) { return i.param.id; });

TEST(safetensors, file_smaller_than_8_bytes) {
    temp_dir td;
    for (size_t n : {0, 1, 7}) {
        const std::string p = td.file("small" + std::to_string(n));
        write_bytes(p, std::string(n, '\x02'));
        expect_open_fails(p, {"header too small", std::to_string(n) + " bytes"});
    }
}

TEST(safetensors, missing_file_and_directory) {
    temp_dir td;
    expect_open_fails(td.file("nope.safetensors"), {"cannot open"});
    expect_open_fails(td.path.string(), {"not a regular file"});
}

// The brief's "1 GB header claim in a 100-byte file": rejected on the prefix alone, before any allocation or read.
TEST(safetensors, huge_header_claim_rejected_quickly) {
    temp_dir td;
    for (uint64_t n : {uint64_t(1) << 30, uint64_t(99'999'999)}) {
        const std::string p = td.file("claim.safetensors");
        write_bytes(p, st_bytes(std::string(92, ' '), 0, n));
        const auto t0 = std::chrono::steady_clock::now();
        expect_open_fails(p, {n > k_st_max_header ? "header too large" : "header length exceeds file"});
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_LT(s, 0.5) << "rejecting a header length must not read or allocate it";
    }
}

// Zero-size tensors may share an offset with their neighbour (RELIABILITY A1 rule 9); header key order is free
// (the reference reader sorts by offsets), and entries() come back in offset order.
TEST(safetensors, zero_size_unsorted_header_and_scalar_accepted) {
    temp_dir td;
    const std::string p = td.file("ok.safetensors");
    const std::string h = obj(E("b", "F32", "[2]", 8, 16) + "," + E("z", "BF16", "[0,5]", 8, 8) + "," + k_ok + "," +
                              E("s", "F32", "[]", 16, 20) + "," + E("end", "U8", "[3,0]", 20, 20));
    write_bytes(p, st_bytes(h, 20));
    auto f = safetensors_file::open(p);
    ASSERT_EQ(f->entries().size(), 5u);
    std::vector<std::string> order;
    for (const auto & e : f->entries()) order.push_back(e.name);
    EXPECT_EQ(order, (std::vector<std::string>{"a", "z", "b", "s", "end"}));
    const st_entry * z = f->find("z");
    ASSERT_NE(z, nullptr);
    EXPECT_EQ(z->shape, (shape_t{0, 5}));
    const tensor tz = f->view(*z);
    EXPECT_EQ(tz.nbytes, 0u);
    EXPECT_EQ(tz.data, nullptr);
    const st_entry * s = f->find("s");
    ASSERT_NE(s, nullptr);
    EXPECT_TRUE(s->shape.empty());
    const tensor ts = f->view(*s);
    EXPECT_EQ(ts.numel(), 1);
    EXPECT_EQ(ts.nbytes, 4u);
    EXPECT_EQ(f->find("missing"), nullptr);
    EXPECT_EQ(f->find(""), nullptr);
}

TEST(safetensors, empty_header_empty_buffer_accepted) {
    temp_dir td;
    const std::string p = td.file("empty.safetensors");
    write_bytes(p, st_bytes("{}", 0));
    auto f = safetensors_file::open(p);
    EXPECT_TRUE(f->entries().empty());
    EXPECT_TRUE(f->metadata().empty());
    const std::string q = td.file("empty2.safetensors");
    safetensors_write(q, {});
    EXPECT_TRUE(safetensors_file::open(q)->entries().empty());
}

TEST(safetensors, metadata_and_whitespace_inside_json_accepted) {
    temp_dir td;
    const std::string p = td.file("meta.safetensors");
    const std::string h = "{ \"__metadata__\" : {\"format\":\"pt\", \"x\":\"\"},\n\t" + k_ok + "}  ";
    write_bytes(p, st_bytes(h, 8));
    auto f = safetensors_file::open(p);
    EXPECT_EQ(f->metadata().at("format"), "pt");
    EXPECT_EQ(f->metadata().at("x"), "");
    EXPECT_EQ(f->entries().size(), 1u);
}

tensor random_tensor(dtype t, const shape_t & shape, std::mt19937 & rng) {
    tensor r = tensor_new(t, shape);
    for (size_t i = 0; i < r.nbytes; ++i) static_cast<uint8_t *>(r.data)[i] = uint8_t(rng());
    return r;
}

// Every dtype round-trips: safetensors_write -> open -> view, bytes equal, type and shape equal.
TEST(safetensors, all_dtypes_round_trip) {
    temp_dir td;
    std::mt19937 rng(42);
    std::vector<std::pair<std::string, tensor>> ts;
    for (int i = 0; i < int(dtype::COUNT); ++i) {
        const dtype t = dtype(i);
        ts.emplace_back(std::string("t.") + std::string(dtype_name(t)), random_tensor(t, {3, 4}, rng));
        ts.emplace_back(std::string("v.") + std::string(dtype_name(t)), random_tensor(t, {2, 1, 6}, rng));
    }
    ts.emplace_back("zero", random_tensor(dtype::BF16, {0, 7}, rng));
    ts.emplace_back("scalar", random_tensor(dtype::F64, {}, rng));
    ts.emplace_back("name with \"quotes\" and \xc3\xa9", random_tensor(dtype::U8, {5}, rng));
    const std::map<std::string, std::string> meta{{"format", "pt"}, {"note", "a \"quoted\"\nvalue"}};
    const std::string p = td.file("all.safetensors");
    safetensors_write(p, ts, meta);
    ASSERT_FALSE(fs::exists(p + ".tmp"));

    auto f = safetensors_file::open(p);
    EXPECT_EQ(f->metadata(), meta);
    EXPECT_EQ(f->header_size() % 8, 0u) << "writer pads the header to a multiple of 8";
    ASSERT_EQ(f->entries().size(), ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
        const auto & [name, src] = ts[i];
        EXPECT_EQ(f->entries()[i].name, name) << "tensors are laid out in the given order";
        const st_entry * e = f->find(name);
        ASSERT_NE(e, nullptr) << name;
        const tensor v = f->view(*e);
        EXPECT_EQ(v.type, src.type) << name;
        EXPECT_EQ(v.shape, src.shape) << name;
        ASSERT_EQ(v.nbytes, src.nbytes) << name;
        if (v.nbytes) {
            EXPECT_EQ(std::memcmp(v.data, src.data, v.nbytes), 0) << name;
        }
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f->view(f->entries()[0]).data) % 8, 0u) << "data buffer starts 8-aligned";
}

// Zero-copy: the view points into a MAP_PRIVATE mapping of the file itself, and keeps it mapped after the
// safetensors_file is gone.
TEST(safetensors, view_is_zero_copy_into_the_mapping) {
    temp_dir td;
    std::mt19937 rng(7);
    const std::string p = td.file("zc.safetensors");
    const tensor src = random_tensor(dtype::F32, {64, 64}, rng);
    safetensors_write(p, {{"w", src}});
    tensor v;
    {
        auto f = safetensors_file::open(p);
        v = f->view(*f->find("w"));
        EXPECT_EQ(v.data, f->view(f->entries()[0]).data);
    }
    ASSERT_EQ(std::memcmp(v.data, src.data, src.nbytes), 0) << "the view outlives the file object";
    std::ifstream maps("/proc/self/maps");
    std::string line;
    bool found = false;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(v.data);
    const std::string canon = fs::canonical(p).string();
    while (std::getline(maps, line)) {
        if (line.find(canon) == std::string::npos) continue;
        std::istringstream ls(line);
        std::string range, perms;
        ls >> range >> perms;
        const uintptr_t lo = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
        const uintptr_t hi = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
        if (addr >= lo && addr < hi) {
            found = true;
            EXPECT_EQ(perms.substr(0, 2), "r-") << "mapped read-only: " << line;
            EXPECT_EQ(perms[3], 'p') << "mapped private: " << line;
        }
    }
    EXPECT_TRUE(found) << "tensor data is not inside a mapping of " << canon;
}

TEST(safetensors, writer_rejects_bad_input) {
    temp_dir td;
    const std::string p = td.file("w.safetensors");
    tensor a = tensor_new(dtype::F32, {2});
    auto fails = [&](const std::vector<std::pair<std::string, tensor>> & ts, const std::string & part) {
        try {
            safetensors_write(p, ts);
            ADD_FAILURE() << "writer accepted: " << part;
        } catch (const perigee::error & e) {
            EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
        EXPECT_FALSE(fs::exists(p)) << "no file left behind";
        EXPECT_FALSE(fs::exists(p + ".tmp")) << "no temp file left behind";
    };
    fails({{"a", a}, {"a", a}}, "given twice");
    fails({{"__metadata__", a}}, "invalid tensor name");
    tensor odd = tensor_new(dtype::F4, {3});
    fails({{"odd", odd}}, "misaligned");
    tensor lie = a;
    lie.nbytes = 4;
    fails({{"lie", lie}}, "needs 8");
    fails({{"bad\xff", a}}, "not valid UTF-8");
}

// Control: the matrix can fail. A valid file opens; flipping one byte of its header's offsets makes open() fail.
TEST(safetensors, control_one_flipped_offset_byte_is_detected) {
    temp_dir td;
    std::mt19937 rng(1);
    const std::string p = td.file("ctl.safetensors");
    safetensors_write(p, {{"x", random_tensor(dtype::F32, {4}, rng)}, {"y", random_tensor(dtype::BF16, {4}, rng)}});
    ASSERT_NO_THROW(safetensors_file::open(p));
    std::string bytes;
    {
        std::ifstream in(p, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    const size_t at = bytes.find("\"data_offsets\":[0,16]");
    ASSERT_NE(at, std::string::npos) << bytes.substr(8, 120);
    const size_t digit = at + std::strlen("\"data_offsets\":[0,1");
    ASSERT_EQ(bytes[digit], '6');
    bytes[digit] = '7';   // x now claims [0,17): overlaps y and mismatches its shape
    const std::string q = td.file("ctl_bad.safetensors");
    write_bytes(q, bytes);
    expect_open_fails(q, {"tensor 'x'", "size mismatch"});
}

} // namespace
} // namespace perigee::test
