// `perigee convert` (src/quant/convert.h): MXFP4 -> NVFP4 repack of a checkpoint tree (issue 3 item 6;
// ARCHITECTURE §3.8, trap 32; RELIABILITY §B3). The input tree is generated here with safetensors_write.
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "quant/convert.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <unistd.h>

using namespace perigee;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string k_pfx = "language_model.model.layers.1.block_sparse_moe.experts.";
const std::string k_bad = k_pfx + "3.w2";   // planted: block exponents span 19 -> must stay MXFP4

std::string read_file(const fs::path & p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_file(const fs::path & p, const std::string & s) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << s;
}

// Bitwise comparison of two F32 tensors: first differing index, or -1.
int64_t first_diff(const tensor & a, const tensor & b) {
    if (a.shape != b.shape) return 0;
    for (int64_t i = 0; i < a.numel(); ++i)
        if (std::memcmp(a.f32() + i, b.f32() + i, 4) != 0) return i;
    return -1;
}

tensor random_bf16(std::mt19937 & rng, const shape_t & s) {
    tensor t = tensor_new(dtype::BF16, s);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t i = 0; i < t.numel(); ++i) t.as<uint16_t>()[i] = f32_to_bf16(nd(rng));
    return t;
}

mxfp4_matrix random_expert(std::mt19937 & rng, int64_t out, int64_t in) {
    tensor w = tensor_new(dtype::F32, {out, in});
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = nd(rng);
    for (int64_t c = 0; c < 32; ++c) w.f32()[c] = 0.0f;   // row 0, block 0 all zero: scale byte 0 (2^-127)
    return mxfp4_quantize_ref(w);
}

struct fixture_tree {
    fs::path root, in, out;
    std::vector<std::string> pairs;   // every `<x>`
    explicit fixture_tree(const std::string & tag) {
        root = fs::temp_directory_path() / fmt::format("perigee-convert-{}-{}", tag, ::getpid());
        fs::remove_all(root);
        in = root / "in";
        out = root / "out";
        fs::create_directories(in);
    }
    ~fixture_tree() {
        std::error_code ec;
        fs::remove_all(root, ec);
    }

    // Three shards; expert 4's w1 pair straddles shards 2 and 3; expert 3's w2 is out of range.
    void build(bool sharded = true) {
        std::mt19937 rng(2024);
        std::vector<std::vector<std::pair<std::string, tensor>>> shards(3);
        shards[0].emplace_back("language_model.model.embed_tokens.weight", random_bf16(rng, {16, 64}));
        for (int e = 0; e < 5; ++e)
            for (int w = 1; w <= 3; ++w) {
                const std::string x = k_pfx + std::to_string(e) + ".w" + std::to_string(w);
                mxfp4_matrix m = random_expert(rng, w == 2 ? 64 : 32, w == 2 ? 32 : 64);
                if (x == k_bad) {   // row 0: block exponents -10 and +9 (span 19), every block nonzero
                    m.scale.as<uint8_t>()[0] = 127 - 10;
                    m.scale.as<uint8_t>()[1] = 127 + 9;
                    std::memset(m.packed.data, 0x35, 32);
                }
                const int sp = e < 2 ? 0 : (e < 4 ? 1 : 2), ss = (e == 4 && w == 1) ? 1 : sp;
                shards[size_t(sp)].emplace_back(x + ".weight_packed", m.packed);
                shards[size_t(ss)].emplace_back(x + ".weight_scale", m.scale);
                pairs.push_back(x);
            }
        tensor bias = tensor_new(dtype::F32, {8});
        for (int i = 0; i < 8; ++i) bias.f32()[i] = 0.25f * float(i);
        shards[1].emplace_back("language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias", bias);
        shards[2].emplace_back("language_model.lm_head.weight", random_bf16(rng, {16, 64}));
        shards[2].emplace_back("vision_tower.stub.weight", random_bf16(rng, {4, 4}));
        if (sharded) {
            std::map<std::string, std::string> wm;
            uint64_t total = 0;
            for (int s = 0; s < 3; ++s) {
                const std::string fn = fmt::format("model-{:05d}-of-00003.safetensors", s + 1);
                safetensors_write((in / fn).string(), shards[size_t(s)], {{"format", "pt"}});
                for (const auto & [n, t] : shards[size_t(s)]) {
                    wm[n] = fn;
                    total += t.nbytes;
                }
            }
            checkpoint_write_index(in.string(), wm, total);
        } else {
            std::vector<std::pair<std::string, tensor>> all;
            for (auto & s : shards)
                for (auto & p : s) all.push_back(p);
            safetensors_write((in / "model.safetensors").string(), all, {{"format", "pt"}});
        }
        const json cfg = {
            {"model_type", "kimi_k3"},
            {"architectures", {"KimiK3ForConditionalGeneration"}},
            {"text_config",
             {{"model_type", "kimi_linear"},
              {"hidden_size", 64},
              {"quantization_config",
               {{"quant_method", "compressed-tensors"},
                {"format", "mxfp4-pack-quantized"},
                {"quantization_status", "compressed"},
                {"config_groups",
                 {{"group_0",
                   {{"format", "mxfp4-pack-quantized"},
                    {"targets", {"Linear"}},
                    {"weights",
                     {{"num_bits", 4}, {"group_size", 32}, {"type", "float"}, {"strategy", "group"},
                      {"symmetric", true}, {"scale_dtype", "torch.uint8"}}}}}}},
                {"ignore", {"re:.*self_attn.*", "re:.*lm_head.*"}}}}}},
            {"vision_config", {{"patch_size", 14}}}};
        write_file(in / "config.json", cfg.dump(2));
        write_file(in / "generation_config.json", R"({"eos_token_id": 163586})");
        write_file(in / "tiktoken.model", "aGVsbG8= 0\n");
        write_file(in / "tokenizer_config.json", R"({"model_max_length": 1048576})");
        write_file(in / "extra" / "notes.txt", "sub-directory file\n");
    }
};

convert_options opts(const fixture_tree & t, std::vector<std::string> * log = nullptr) {
    convert_options o;
    o.in_dir = t.in.string();
    o.out_dir = t.out.string();
    o.log = [log](const std::string & s) {
        if (log) log->push_back(s);
    };
    return o;
}

bool any_contains(const std::vector<std::string> & lines, const std::string & what) {
    for (const auto & l : lines)
        if (l.find(what) != std::string::npos) return true;
    return false;
}

// Every tensor of the output checked against the input: repacked pairs decode bit-identically, kept pairs and
// every other tensor are byte-identical.
void check_output(const fixture_tree & t) {
    const checkpoint a = checkpoint::open(t.in.string());
    const checkpoint b = checkpoint::open(t.out.string());   // validates the index against the shards
    std::set<std::string> want;
    for (const auto & n : a.names()) want.insert(n);
    for (const auto & x : t.pairs)
        if (x != k_bad) want.insert(x + ".weight_global_scale");
    const auto got_v = b.names();
    EXPECT_EQ(std::set<std::string>(got_v.begin(), got_v.end()), want);
    std::set<std::string> pair_tensors;
    for (const auto & x : t.pairs) {
        pair_tensors.insert(x + ".weight_packed");
        pair_tensors.insert(x + ".weight_scale");
        const tensor ap = a.get(x + ".weight_packed"), as = a.get(x + ".weight_scale");
        const tensor bp = b.get(x + ".weight_packed"), bs = b.get(x + ".weight_scale");
        ASSERT_EQ(bp.type, dtype::U8) << x;
        ASSERT_EQ(bp.nbytes, ap.nbytes) << x;
        EXPECT_EQ(std::memcmp(ap.data, bp.data, ap.nbytes), 0) << x << ": nibbles must be verbatim";
        const tensor ref = mxfp4_dequant_ref(ap, as, x);
        if (x == k_bad) {
            EXPECT_EQ(bs.type, dtype::U8) << x << " must stay MXFP4";
            EXPECT_FALSE(b.has(x + ".weight_global_scale"));
            EXPECT_EQ(first_diff(ref, mxfp4_dequant_ref(bp, bs, x)), -1) << x;
            continue;
        }
        ASSERT_EQ(bs.type, dtype::F8_E4M3) << x;
        EXPECT_EQ(bs.shape, (shape_t{ap.dim(0), ap.dim(1) * 2 / 16})) << x;
        const tensor g = b.get(x + ".weight_global_scale");
        ASSERT_EQ(g.type, dtype::F32);
        ASSERT_EQ(g.shape, (shape_t{1}));
        const tensor nv = nvfp4_dequant_ref(bp, bs, g.f32()[0], x);
        EXPECT_EQ(first_diff(ref, nv), -1) << x << ": NVFP4 must decode bit-identically to MXFP4";
    }
    for (const auto & n : a.names()) {
        if (pair_tensors.count(n)) continue;
        const tensor x = a.get(n), y = b.get(n);
        EXPECT_EQ(x.type, y.type) << n;
        EXPECT_EQ(x.shape, y.shape) << n;
        ASSERT_EQ(x.nbytes, y.nbytes) << n;
        EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes), 0) << n;
    }
}

} // namespace

TEST(convert, trap32_tree_bit_exact_kept_reported_and_resumable) {
    fixture_tree t("main");
    t.build();
    std::vector<std::string> log;
    const convert_report r = convert_mxfp4_to_nvfp4(opts(t, &log));
    EXPECT_EQ(r.shards, 3);
    EXPECT_EQ(r.shards_converted, 3);
    EXPECT_EQ(r.shards_skipped, 0);
    EXPECT_EQ(r.pairs_repacked, int64_t(t.pairs.size()) - 1);
    ASSERT_EQ(r.kept_mxfp4.size(), 1u);
    EXPECT_EQ(r.kept_mxfp4[0].first, k_bad);
    EXPECT_NE(r.kept_mxfp4[0].second.find(k_bad), std::string::npos);
    EXPECT_NE(r.kept_mxfp4[0].second.find("19 powers"), std::string::npos) << r.kept_mxfp4[0].second;
    EXPECT_TRUE(any_contains(log, k_bad)) << "the kept tensor is reported by name on the progress stream";
    EXPECT_TRUE(any_contains(log, "[3/3]"));
    EXPECT_EQ(r.span_histogram.count(19), 1u);
    check_output(t);

    // Config: rewritten quantization_config; everything else in config.json unchanged.
    const json in_cfg = json::parse(read_file(t.in / "config.json"));
    json cfg = json::parse(read_file(t.out / "config.json"));
    const json & qc = cfg["text_config"]["quantization_config"];
    EXPECT_EQ(qc["format"], "nvfp4-pack-quantized");
    EXPECT_EQ(qc["config_groups"]["group_0"]["format"], "nvfp4-pack-quantized");
    EXPECT_EQ(qc["config_groups"]["group_0"]["weights"]["group_size"], 16);
    EXPECT_EQ(qc["config_groups"]["group_1"]["format"], "mxfp4-pack-quantized");
    EXPECT_EQ(qc["mxfp4_kept"], json::array({k_bad}));
    ASSERT_EQ(qc["config_groups"]["group_1"]["targets"].size(), 1u);
    EXPECT_EQ(qc["config_groups"]["group_1"]["targets"][0],
              "re:^language_model\\.model\\.layers\\.1\\.block_sparse_moe\\.experts\\.3\\.w2$");
    EXPECT_NE(qc["config_groups"]["group_0"]["perigee_conversion"]["weight_global_scale"].get<std::string>().find("multiplier"),
              std::string::npos);
    EXPECT_EQ(qc["ignore"], in_cfg["text_config"]["quantization_config"]["ignore"]);
    cfg["text_config"].erase("quantization_config");
    json in_rest = in_cfg;
    in_rest["text_config"].erase("quantization_config");
    EXPECT_EQ(cfg, in_rest);
    // Other files copied verbatim, sub-directories included; the report is written.
    for (const char * f : {"generation_config.json", "tiktoken.model", "tokenizer_config.json", "extra/notes.txt"})
        EXPECT_EQ(read_file(t.out / f), read_file(t.in / f)) << f;
    const json rep = json::parse(read_file(t.out / "perigee_convert_report.json"));
    EXPECT_EQ(rep["kept_mxfp4"][0]["name"], k_bad);

    // Re-run: every shard is verified complete and skipped; the files are not rewritten.
    const auto mtime = fs::last_write_time(t.out / "model-00002-of-00003.safetensors");
    log.clear();
    const convert_report r2 = convert_mxfp4_to_nvfp4(opts(t, &log));
    EXPECT_EQ(r2.shards_skipped, 3);
    EXPECT_EQ(r2.shards_converted, 0);
    EXPECT_EQ(r2.pairs_repacked, r.pairs_repacked);
    EXPECT_EQ(r2.kept_mxfp4, r.kept_mxfp4);
    EXPECT_EQ(r2.span_histogram, r.span_histogram);
    EXPECT_EQ(r2.total_size, r.total_size);
    EXPECT_TRUE(any_contains(log, "skipped"));
    EXPECT_EQ(fs::last_write_time(t.out / "model-00002-of-00003.safetensors"), mtime);
    check_output(t);

    // A damaged output shard (one data byte flipped) fails its hash and only that shard is converted again;
    // a deleted marker likewise.
    {
        const fs::path p = t.out / "model-00001-of-00003.safetensors";
        std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(-3, std::ios::end);
        char c;
        f.get(c);
        f.seekp(-3, std::ios::end);
        f.put(char(c ^ 0x40));
    }
    fs::remove(t.out / ".perigee-convert" / "model-00003-of-00003.safetensors.done.json");
    log.clear();
    const convert_report r3 = convert_mxfp4_to_nvfp4(opts(t, &log));
    EXPECT_EQ(r3.shards_converted, 2);
    EXPECT_EQ(r3.shards_skipped, 1);
    EXPECT_TRUE(any_contains(log, "content hash differs"));
    EXPECT_EQ(r3.pairs_repacked, r.pairs_repacked);
    check_output(t);

    // A rewritten input shard (new mtime) is converted again even though its marker and output are intact.
    {
        const fs::path p = t.in / "model-00003-of-00003.safetensors";
        fs::last_write_time(p, fs::last_write_time(p) + std::chrono::seconds(5));
        log.clear();
        const convert_report r4 = convert_mxfp4_to_nvfp4(opts(t, &log));
        EXPECT_EQ(r4.shards_converted, 1);
        EXPECT_TRUE(any_contains(log, "input shard changed"));
    }

    // --force converts everything again, byte-identically (RELIABILITY C-09: convert twice -> same bytes).
    std::vector<uint64_t> before;
    for (int s = 1; s <= 3; ++s)
        before.push_back(convert_file_hash((t.out / fmt::format("model-{:05d}-of-00003.safetensors", s)).string()));
    const std::string index_before = read_file(t.out / "model.safetensors.index.json");
    const std::string config_before = read_file(t.out / "config.json");
    convert_options of = opts(t);
    of.force = true;
    EXPECT_EQ(convert_mxfp4_to_nvfp4(of).shards_converted, 3);
    for (int s = 1; s <= 3; ++s)
        EXPECT_EQ(convert_file_hash((t.out / fmt::format("model-{:05d}-of-00003.safetensors", s)).string()),
                  before[size_t(s - 1)]) << s;
    EXPECT_EQ(read_file(t.out / "model.safetensors.index.json"), index_before);
    EXPECT_EQ(read_file(t.out / "config.json"), config_before);
    check_output(t);

    // --require-all fails naming the tensor that had to stay MXFP4 (the output is still complete).
    convert_options oa = opts(t);
    oa.require_all = true;
    try {
        convert_mxfp4_to_nvfp4(oa);
        ADD_FAILURE() << "expected an error";
    } catch (const perigee::error & e) {
        EXPECT_NE(std::string(e.what()).find(k_bad), std::string::npos) << e.what();
    }
}

// Control for the comparator used above: a wrong scale byte in the output must be reported.
TEST(convert, comparator_control) {
    fixture_tree t("control");
    t.build();
    convert_mxfp4_to_nvfp4(opts(t));
    const checkpoint a = checkpoint::open(t.in.string()), b = checkpoint::open(t.out.string());
    const std::string x = k_pfx + "0.w1";
    const tensor bs = b.get(x + ".weight_scale");
    tensor bad = tensor_new(dtype::F8_E4M3, bs.shape);
    std::memcpy(bad.data, bs.data, bs.nbytes);
    bad.as<uint8_t>()[bad.nbytes - 1] += 8;   // x2 on the last block (nonzero: random weights)
    const tensor ref = mxfp4_dequant_ref(a.get(x + ".weight_packed"), a.get(x + ".weight_scale"));
    const float g = b.get(x + ".weight_global_scale").f32()[0];
    EXPECT_EQ(first_diff(ref, nvfp4_dequant_ref(b.get(x + ".weight_packed"), bs, g)), -1);
    EXPECT_NE(first_diff(ref, nvfp4_dequant_ref(b.get(x + ".weight_packed"), bad, g)), -1);
    EXPECT_NE(first_diff(ref, nvfp4_dequant_ref(b.get(x + ".weight_packed"), bs, g * 2)), -1);
}

TEST(convert, single_file_input_and_full_verify) {
    fixture_tree t("single");
    t.build(false);
    convert_options o = opts(t);
    o.verify_full = true;
    const convert_report r = convert_mxfp4_to_nvfp4(o);
    EXPECT_EQ(r.shards, 1);
    EXPECT_TRUE(fs::exists(t.out / "model.safetensors"));
    EXPECT_FALSE(fs::exists(t.out / "model.safetensors.index.json"));
    check_output(t);
}

TEST(convert, normal_scales_only_policy) {
    fixture_tree t("normal");
    t.build();
    convert_options o = opts(t);
    o.normal_scales_only = true;
    const convert_report r = convert_mxfp4_to_nvfp4(o);
    // Random N(0, 0.05) experts have a small exponent span (<= 14), except for the planted one.
    EXPECT_EQ(r.kept_mxfp4.size(), 1u);
    check_output(t);
    // A marker written under other options does not vouch for the shard.
    const convert_report r2 = convert_mxfp4_to_nvfp4(opts(t));
    EXPECT_EQ(r2.shards_converted, 3);
}

TEST(convert, errors_name_the_problem) {
    auto expect_error = [](const convert_options & o, const std::string & what) {
        try {
            convert_mxfp4_to_nvfp4(o);
            ADD_FAILURE() << "expected an error mentioning " << what;
        } catch (const perigee::error & e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    {   // 0xFF (E8M0 NaN) in an expert scale: fails naming the tensor, row and block.
        fixture_tree t("nan");
        t.build(false);
        const fs::path p = t.in / "model.safetensors";
        auto f = safetensors_file::open(p.string());
        std::vector<std::pair<std::string, tensor>> ts;
        for (const auto & e : f->entries()) {
            const tensor v = f->view(e);
            tensor c = tensor_new(v.type, v.shape);
            std::memcpy(c.data, v.data, v.nbytes);
            if (e.name == k_pfx + "1.w3.weight_scale") c.as<uint8_t>()[2 * 2 + 1] = 0xFF;
            ts.emplace_back(e.name, c);
        }
        f.reset();
        safetensors_write(p.string(), ts);
        expect_error(opts(t), k_pfx + "1.w3");
        expect_error(opts(t), "row 2, block 1");
    }
    {   // Output inside the input.
        fixture_tree t("inside");
        t.build(false);
        convert_options o = opts(t);
        o.out_dir = (t.in / "nv").string();
        expect_error(o, "inside");
    }
    {   // A packed tensor without its scale.
        fixture_tree t("orphan");
        t.build(false);
        const fs::path p = t.in / "model.safetensors";
        auto f = safetensors_file::open(p.string());
        std::vector<std::pair<std::string, tensor>> ts;
        for (const auto & e : f->entries()) {
            if (e.name == k_pfx + "2.w1.weight_scale") continue;
            const tensor v = f->view(e);
            tensor c = tensor_new(v.type, v.shape);
            std::memcpy(c.data, v.data, v.nbytes);
            ts.emplace_back(e.name, c);
        }
        f.reset();
        safetensors_write(p.string(), ts);
        expect_error(opts(t), k_pfx + "2.w1.weight_packed");
    }
}
