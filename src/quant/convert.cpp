#include "quant/convert.h"

#include "core/error.h"
#include "loader/checkpoint.h"
#include "loader/safetensors.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace perigee {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr const char * k_marker_dir = ".perigee-convert";
constexpr int k_marker_version = 1;
constexpr const char * k_index_name = "model.safetensors.index.json";
constexpr const char * k_report_name = "perigee_convert_report.json";
constexpr std::string_view k_experts = ".block_sparse_moe.experts.";
constexpr std::string_view k_packed = ".weight_packed";
constexpr std::string_view k_scale = ".weight_scale";
constexpr std::string_view k_global = ".weight_global_scale";

bool ends_with(std::string_view s, std::string_view suf) {
    return s.size() >= suf.size() && s.substr(s.size() - suf.size()) == suf;
}
std::string strip(std::string_view s, std::string_view suf) { return std::string(s.substr(0, s.size() - suf.size())); }
// a + b (spelled out: GCC 12's -Wrestrict misfires on inlined std::string operator+).
std::string cat(std::string_view a, std::string_view b) {
    std::string r;
    r.reserve(a.size() + b.size());
    r.append(a);
    r.append(b);
    return r;
}

// --- the marker hash: 8-byte words, multiply-xorshift mixing, length folded in at the end ---
struct hasher {
    uint64_t h = 0x243F6A8885A308D3ull;
    uint64_t n = 0;
    void word(uint64_t w) {
        h ^= w;
        h *= 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    // `len` must be a multiple of 8 except on the last call.
    void update(const uint8_t * p, size_t len) {
        size_t i = 0;
        for (; i + 8 <= len; i += 8) {
            uint64_t w;
            std::memcpy(&w, p + i, 8);
            word(w);
        }
        if (i < len) {
            uint64_t w = 0;
            std::memcpy(&w, p + i, len - i);
            word(w ^ 0xA5);
        }
        n += len;
    }
    uint64_t final() const {
        uint64_t x = h ^ n;
        x *= 0xFF51AFD7ED558CCDull;
        x ^= x >> 33;
        return x;
    }
};

// The input's modification time (file clock ticks): with its size and header hash, what says "unchanged" without
// re-reading the input's data.
int64_t mtime_of(const std::string & path) {
    std::error_code ec;
    const auto t = fs::last_write_time(path, ec);
    PG_CHECK(!ec, "{}: cannot stat: {}", path, ec.message());
    return int64_t(t.time_since_epoch().count());
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

uint64_t hash_prefix(const std::string & path, uint64_t nbytes) {
    std::FILE * fp = std::fopen(path.c_str(), "rb");
    PG_CHECK(fp != nullptr, "{}: cannot open: {}", path, std::strerror(errno));
    std::vector<uint8_t> buf(size_t(4) << 20);
    hasher hs;
    uint64_t left = nbytes;
    while (left > 0) {
        const size_t want = size_t(std::min<uint64_t>(left, buf.size()));
        const size_t got = std::fread(buf.data(), 1, want, fp);
        if (got == 0) break;
        hs.update(buf.data(), got);
        left -= got;
        if (got < want) break;
    }
    const bool err = std::ferror(fp) != 0;
    std::fclose(fp);
    PG_CHECK(!err, "{}: read error while hashing", path);
    return hs.final();
}

void write_text_atomic(const std::string & path, const std::string & text) {
    const std::string tmp = path + ".tmp";
    std::FILE * fp = std::fopen(tmp.c_str(), "wb");
    PG_CHECK(fp != nullptr, "{}: cannot create: {}", tmp, std::strerror(errno));
    const bool wrote = std::fwrite(text.data(), 1, text.size(), fp) == text.size();
    const bool closed = std::fclose(fp) == 0;
    if (!wrote || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        std::remove(tmp.c_str());
        PG_FAIL("{}: cannot write: {}", path, std::strerror(err));
    }
}

std::string regex_escape(const std::string & s) {
    std::string r;
    for (char c : s) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') r += '\\';
        r += c;
    }
    return r;
}

struct pair_decision {
    bool ok = false;
    bool all_zero = false;
    int e_min = 0, e_max = 0;
    std::string why;
};

class converter {
public:
    explicit converter(const convert_options & o) : o_(o) {}
    convert_report run();

private:
    template <typename... A> void log(fmt::format_string<A...> f, A &&... a) {
        const std::string line = fmt::format(f, std::forward<A>(a)...);
        if (o_.log) o_.log(line);
        else fmt::print(stderr, "{}\n", line);
    }
    void find_pairs();
    nvfp4_repack repack(const std::string & x);
    const pair_decision & decide(const std::string & x);
    void record(const std::string & x, const pair_decision & d);
    bool try_skip(const safetensors_file & in, const std::string & shard, int i);
    void convert_shard(const safetensors_file & in, const std::string & shard, int i);
    void copy_other_files(const std::set<std::string> & shard_names);
    void write_config();
    void write_report();
    std::string marker_path(const std::string & shard) const {
        return (fs::path(o_.out_dir) / k_marker_dir / (shard + ".done.json")).string();
    }
    uint64_t input_header_hash(const safetensors_file & in) const { return hash_prefix(in.path(), 8 + in.header_size()); }

    convert_options o_;
    convert_report rep_;
    checkpoint ck_;
    std::set<std::string> pairs_;                        // `<x>` of every MXFP4 expert pair
    std::map<std::string, pair_decision> decided_;       // per pair, once computed
    std::set<std::string> recorded_;                     // pairs counted in the report
    std::map<std::string, std::string> weight_map_;      // output tensor -> shard file name
    int n_shards_ = 0;
};

void converter::find_pairs() {
    for (const std::string & n : ck_.names()) {
        if (ends_with(n, k_global))
            PG_FAIL("{}: tensor '{}' is an NVFP4 global scale: the input is already (partly) NVFP4", ck_.file_of(n), n);
        if (ends_with(n, k_packed)) {
            const std::string x = strip(n, k_packed);
            PG_CHECK(n.find(k_experts) != std::string::npos,
                     "{}: '{}' is packed FP4 outside `block_sparse_moe.experts.` (K3 quantizes only routed experts)",
                     ck_.file_of(n), n);
            PG_CHECK(ck_.has(cat(x, k_scale)), "{}: '{}' has no paired '{}{}'", ck_.file_of(n), n, x, k_scale);
            pairs_.insert(x);
        } else if (ends_with(n, k_scale)) {
            const std::string x = strip(n, k_scale);
            PG_CHECK(ck_.has(cat(x, k_packed)), "{}: '{}' has no paired '{}{}'", ck_.file_of(n), n, x,
                     k_packed);
        }
    }
    PG_CHECK(!pairs_.empty(), "{}: no MXFP4 expert pairs (`...block_sparse_moe.experts.*.weight_packed`) to convert",
             o_.in_dir);
}

nvfp4_repack converter::repack(const std::string & x) {
    const std::string pn = cat(x, k_packed), sn = cat(x, k_scale);
    const tensor p = ck_.get(pn), s = ck_.get(sn);
    PG_CHECK(s.type == dtype::U8 || s.type == dtype::F8_E8M0,
             "{}: '{}' is {} (paired with '{}' {}): expected U8/F8_E8M0 E8M0 scales; is the input already NVFP4?",
             ck_.file_of(sn), sn, dtype_name(s.type), pn, dtype_name(p.type));
    return mxfp4_to_nvfp4(p, s, x, o_.normal_scales_only);
}

const pair_decision & converter::decide(const std::string & x) {
    auto it = decided_.find(x);
    if (it != decided_.end()) return it->second;
    const nvfp4_repack r = repack(x);
    pair_decision d{r.ok, r.n_zero_blocks == r.n_blocks, r.e_min, r.e_max, r.why};
    return decided_.emplace(x, d).first->second;
}

void converter::record(const std::string & x, const pair_decision & d) {
    if (!recorded_.insert(x).second) return;
    if (!d.all_zero) rep_.span_histogram[d.e_max - d.e_min]++;
    if (d.ok) {
        rep_.pairs_repacked++;
    } else {
        rep_.kept_mxfp4.emplace_back(x, d.why);
        log("convert: kept MXFP4: {}", d.why);
    }
}

bool converter::try_skip(const safetensors_file & in, const std::string & shard, int i) {
    const std::string mpath = marker_path(shard), opath = (fs::path(o_.out_dir) / shard).string();
    if (o_.force || !fs::exists(mpath)) return false;
    auto redo = [&](const std::string & why) {
        log("[{}/{}] {}: marker present but {}; converting again", i + 1, n_shards_, shard, why);
        return false;
    };
    ojson m;
    try {
        std::ifstream f(mpath);
        m = ojson::parse(f);
        if (m.value("version", 0) != k_marker_version) return redo("its version differs");
        if (m.at("options").at("normal_scales_only").get<bool>() != o_.normal_scales_only)
            return redo("it was made with other options");
        const auto & mi = m.at("input");
        if (mi.at("file").get<std::string>() != shard || mi.at("size").get<uint64_t>() != in.file_size() ||
            mi.at("mtime").get<int64_t>() != mtime_of(in.path()) ||
            mi.at("header_hash").get<std::string>() != hex64(input_header_hash(in)))
            return redo("the input shard changed");
        const auto & mo = m.at("output");
        if (!fs::exists(opath)) return redo("the output shard is missing");
        if (fs::file_size(opath) != mo.at("size").get<uint64_t>()) return redo("the output shard's size differs");
        if (hex64(convert_file_hash(opath)) != mo.at("hash").get<std::string>())
            return redo("the output shard's content hash differs");
    } catch (const nlohmann::json::exception & e) {
        return redo(fmt::format("it is unreadable ({})", e.what()));
    }
    std::shared_ptr<safetensors_file> out;
    try {
        out = safetensors_file::open(opath);
    } catch (const perigee::error & e) {
        return redo(fmt::format("the output does not open ({})", e.what()));
    }
    for (const st_entry & e : out->entries()) {
        weight_map_[e.name] = shard;
        rep_.total_size += e.nbytes();
    }
    for (const auto & p : m.at("pairs")) {
        pair_decision d{p.at("repacked").get<bool>(), p.at("all_zero").get<bool>(), p.at("e_min").get<int>(),
                        p.at("e_max").get<int>(), p.at("why").get<std::string>()};
        const std::string x = p.at("name").get<std::string>();
        decided_.emplace(x, d);
        record(x, d);
    }
    rep_.shards_skipped++;
    log("[{}/{}] {}: skipped (verified complete: marker, size and content hash match)", i + 1, n_shards_, shard);
    return true;
}

void converter::convert_shard(const safetensors_file & in, const std::string & shard, int i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string opath = (fs::path(o_.out_dir) / shard).string();
    std::vector<std::pair<std::string, tensor>> outs;
    std::vector<std::string> repacked_here, pairs_here;
    int64_t n_copied = 0, n_kept = 0;
    auto last = t0;
    int64_t done = 0;
    for (const st_entry & e : in.entries()) {
        const std::string & n = e.name;
        const bool is_p = ends_with(n, k_packed) && pairs_.count(strip(n, k_packed));
        const bool is_s = ends_with(n, k_scale) && pairs_.count(strip(n, k_scale));
        if (!is_p && !is_s) {
            outs.emplace_back(n, in.view(e));
            ++n_copied;
            continue;
        }
        const std::string x = strip(n, is_p ? k_packed : k_scale);
        if (is_s) {
            // A scale goes out unchanged only when its pair stays MXFP4; a repacked pair's new scale is written
            // next to its packed tensor (possibly in another shard).
            if (!decide(x).ok) outs.emplace_back(n, in.view(e));
            continue;
        }
        pairs_here.push_back(x);
        if (decided_.count(x) && !decided_.at(x).ok) {
            outs.emplace_back(n, in.view(e));
            ++n_kept;
            continue;
        }
        nvfp4_repack r = repack(x);
        decided_.emplace(x, pair_decision{r.ok, r.n_zero_blocks == r.n_blocks, r.e_min, r.e_max, r.why});
        if (!r.ok) {
            outs.emplace_back(n, in.view(e));
            ++n_kept;
            continue;
        }
        tensor g = tensor_new(dtype::F32, {1});
        g.f32()[0] = r.global_scale;
        outs.emplace_back(n, r.packed);
        outs.emplace_back(cat(x, k_scale), std::move(r.scale));
        outs.emplace_back(cat(x, k_global), std::move(g));
        repacked_here.push_back(x);
        ++done;
        const auto now = std::chrono::steady_clock::now();
        if (now - last > std::chrono::seconds(5)) {
            log("[{}/{}] {}: {} pairs repacked so far", i + 1, n_shards_, shard, done);
            last = now;
        }
    }
    uint64_t bytes = 0;
    for (const auto & [n, t] : outs) {
        weight_map_[n] = shard;
        bytes += t.nbytes;
    }
    rep_.total_size += bytes;
    std::error_code ec;
    fs::remove(marker_path(shard), ec);   // a stale marker must never vouch for the new file
    safetensors_write(opath, outs, in.metadata());
    outs.clear();   // drop the new scales before verifying

    // Self-check (trap 32): reopen what was written and compare every repacked pair with the input.
    auto out = safetensors_file::open(opath);
    for (const std::string & x : repacked_here) {
        const auto * ep = out->find(cat(x, k_packed));
        const auto * es = out->find(cat(x, k_scale));
        const auto * eg = out->find(cat(x, k_global));
        PG_CHECK(ep && es && eg, "{}: written shard lacks a tensor of pair '{}'", opath, x);
        const tensor g = out->view(*eg);
        PG_CHECK(g.type == dtype::F32 && g.numel() == 1, "{}: '{}{}' is not F32 [1]", opath, x, k_global);
        const std::string diff =
            nvfp4_matches_mxfp4(ck_.get(cat(x, k_packed)), ck_.get(cat(x, k_scale)),
                                out->view(*ep), out->view(*es), g.f32()[0], x, o_.verify_full);
        PG_CHECK(diff.empty(), "{}: repacked pair does not decode bit-identically: {}", opath, diff);
    }
    const uint64_t out_size = fs::file_size(opath);
    ojson m;
    m["version"] = k_marker_version;
    m["tool"] = "perigee convert (MXFP4 -> NVFP4)";
    m["options"] = {{"normal_scales_only", o_.normal_scales_only}};
    m["input"] = {{"file", shard}, {"size", in.file_size()}, {"mtime", mtime_of(in.path())},
                  {"header_hash", hex64(input_header_hash(in))}};
    m["output"] = {{"file", shard}, {"size", out_size}, {"hash", hex64(convert_file_hash(opath))}};
    ojson pj = ojson::array();
    for (const std::string & x : pairs_here) {
        const pair_decision & d = decided_.at(x);
        pj.push_back({{"name", x}, {"repacked", d.ok}, {"all_zero", d.all_zero}, {"e_min", d.e_min},
                      {"e_max", d.e_max}, {"why", d.why}});
        record(x, d);
    }
    m["pairs"] = pj;
    write_text_atomic(marker_path(shard), m.dump(1) + "\n");
    rep_.shards_converted++;
    rep_.tensors_copied += n_copied;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log("[{}/{}] {}: {} pairs repacked, {} kept MXFP4, {} tensors copied, {:.1f} MB in {:.1f} s ({:.0f} MB/s)", i + 1,
        n_shards_, shard, repacked_here.size(), n_kept, n_copied, bytes / 1e6, s, s > 0 ? bytes / 1e6 / s : 0.0);
}

void converter::copy_other_files(const std::set<std::string> & shard_names) {
    const fs::path in(o_.in_dir), out(o_.out_dir);
    for (auto it = fs::recursive_directory_iterator(in); it != fs::recursive_directory_iterator(); ++it) {
        const fs::path rel = fs::relative(it->path(), in);
        const std::string top = rel.begin()->string();
        if (top == k_marker_dir) {
            it.disable_recursion_pending();
            continue;
        }
        if (!it->is_regular_file()) continue;   // follows symlinks (HF cache links to blobs)
        const std::string r = rel.generic_string();
        if (r == "config.json" || r == k_index_name || r == k_report_name || shard_names.count(r)) continue;
        const fs::path dst = out / rel;
        fs::create_directories(dst.parent_path());
        const fs::path tmp = dst.string() + ".tmp";
        std::error_code ec;
        fs::copy_file(it->path(), tmp, fs::copy_options::overwrite_existing, ec);
        PG_CHECK(!ec, "copying {} to {}: {}", it->path().string(), tmp.string(), ec.message());
        fs::rename(tmp, dst, ec);
        PG_CHECK(!ec, "renaming {} to {}: {}", tmp.string(), dst.string(), ec.message());
        rep_.files_copied.push_back(r);
    }
    std::sort(rep_.files_copied.begin(), rep_.files_copied.end());
}

void converter::write_config() {
    const fs::path src = fs::path(o_.in_dir) / "config.json";
    ojson cfg;
    try {
        std::ifstream f(src);
        cfg = ojson::parse(f);
    } catch (const nlohmann::json::exception & e) {
        PG_FAIL("{}: cannot parse: {}", src.string(), e.what());
    }
    const bool nested = cfg.contains("text_config") && cfg["text_config"].is_object();
    ojson & holder = nested ? cfg["text_config"] : cfg;
    const std::string where = nested ? "text_config.quantization_config" : "quantization_config";
    PG_CHECK(holder.contains("quantization_config") && holder["quantization_config"].is_object(),
             "{}: no {} (the tree has MXFP4 experts, so it must declare them)", src.string(), where);
    ojson & qc = holder["quantization_config"];
    PG_CHECK(qc.value("format", "") == "mxfp4-pack-quantized", "{}: {}.format is '{}', expected mxfp4-pack-quantized",
             src.string(), where, qc.value("format", ""));

    ojson old_weights = nullptr, targets = ojson::array({"Linear"});
    if (qc.contains("config_groups") && qc["config_groups"].is_object() && qc["config_groups"].contains("group_0")) {
        const ojson & g0 = qc["config_groups"]["group_0"];
        if (g0.contains("weights")) old_weights = g0["weights"];
        if (g0.contains("targets")) targets = g0["targets"];
    }
    ojson g0 = qc.contains("config_groups") && qc["config_groups"].contains("group_0") ? qc["config_groups"]["group_0"]
                                                                                      : ojson::object();
    g0["format"] = "nvfp4-pack-quantized";
    g0["targets"] = targets;
    g0["weights"] = {{"num_bits", 4}, {"group_size", 16}, {"type", "float"}, {"strategy", "tensor_group"},
                     {"symmetric", true}, {"dynamic", false}, {"scale_dtype", "torch.float8_e4m3fn"}};
    // The conventions, documented in the file itself (the engine's strict config parser skips config_groups;
    // the tensors' dtypes and names are what it checks).
    g0["perigee_conversion"] = {
        {"tool", "perigee convert"},
        {"converted_from", "mxfp4-pack-quantized"},
        {"nvfp4_value", "e2m1(weight_packed nibble) * e4m3(weight_scale) * weight_global_scale"},
        {"weight_global_scale",
         "F32 [1], the multiplier itself (not a reciprocal divisor); a power of two and a normal fp32"},
        {"scale_range", o_.normal_scales_only ? "E4M3 normal powers of two 2^-6..2^8"
                                              : "E4M3 powers of two 2^-9..2^8 (subnormal scales allowed)"},
        {"format_by_scale_dtype", "weight_scale F8_E4M3 + weight_global_scale = NVFP4; weight_scale U8 (E8M0) = MXFP4"},
    };
    ojson groups = {{"group_0", g0}};
    ojson kept = ojson::array();
    for (const auto & [x, why] : rep_.kept_mxfp4) kept.push_back(x);
    if (!rep_.kept_mxfp4.empty()) {
        ojson t = ojson::array();
        for (const auto & [x, why] : rep_.kept_mxfp4) t.push_back(cat(cat("re:^", regex_escape(x)), "$"));
        groups["group_1"] = {{"format", "mxfp4-pack-quantized"}, {"targets", t}, {"weights", old_weights}};
    }
    // The tree's format is NVFP4; the pairs that did not fit stay MXFP4 and are listed in `mxfp4_kept`
    // (their `<x>` prefixes), and described by group_1.
    qc["format"] = "nvfp4-pack-quantized";
    qc["config_groups"] = groups;
    qc["mxfp4_kept"] = kept;
    write_text_atomic((fs::path(o_.out_dir) / "config.json").string(), cfg.dump(2) + "\n");
}

void converter::write_report() {
    ojson j;
    j["shards"] = rep_.shards;
    j["shards_converted"] = rep_.shards_converted;
    j["shards_skipped"] = rep_.shards_skipped;
    j["pairs_repacked"] = rep_.pairs_repacked;
    ojson kept = ojson::array();
    for (const auto & [x, why] : rep_.kept_mxfp4) kept.push_back({{"name", x}, {"reason", why}});
    j["kept_mxfp4"] = kept;
    ojson h = ojson::object();
    for (const auto & [span, n] : rep_.span_histogram) h[std::to_string(span)] = n;
    j["block_exponent_span_histogram"] = h;
    j["total_size"] = rep_.total_size;
    write_text_atomic((fs::path(o_.out_dir) / k_report_name).string(), j.dump(2) + "\n");
}

convert_report converter::run() {
    PG_CHECK(!o_.in_dir.empty() && !o_.out_dir.empty(), "convert: --in and --out are both required");
    PG_CHECK(fs::is_directory(o_.in_dir), "convert: input '{}' is not a directory", o_.in_dir);
    PG_CHECK(fs::exists(fs::path(o_.in_dir) / "config.json"), "convert: {}: no config.json", o_.in_dir);
    const fs::path in_c = fs::weakly_canonical(o_.in_dir), out_c = fs::weakly_canonical(o_.out_dir);
    const std::string in_s = in_c.string() + "/", out_s = out_c.string() + "/";
    PG_CHECK(out_s.rfind(in_s, 0) != 0, "convert: output '{}' is the input directory or inside it ('{}')", o_.out_dir,
             o_.in_dir);
    PG_CHECK(in_s.rfind(out_s, 0) != 0, "convert: input '{}' is inside the output directory '{}'", o_.in_dir,
             o_.out_dir);
    fs::create_directories(fs::path(o_.out_dir) / k_marker_dir);

    ck_ = checkpoint::open(o_.in_dir);
    find_pairs();
    // Fail on a bad config before writing any shard.
    {
        const fs::path src = fs::path(o_.in_dir) / "config.json";
        std::ifstream f(src);
        ojson cfg = ojson::parse(f, nullptr, false);
        PG_CHECK(!cfg.is_discarded(), "{}: not valid JSON", src.string());
    }
    const auto & files = ck_.files();
    n_shards_ = int(files.size());
    rep_.shards = n_shards_;
    log("convert: {} -> {}: {} shard(s), {} MXFP4 expert pairs", o_.in_dir, o_.out_dir, n_shards_, pairs_.size());
    std::set<std::string> shard_names;
    for (int i = 0; i < n_shards_; ++i) {
        const safetensors_file & f = *files[size_t(i)];
        const std::string shard = fs::path(f.path()).filename().string();
        shard_names.insert(shard);
        if (!try_skip(f, shard, i)) convert_shard(f, shard, i);
    }
    // Pairs whose packed half lives in a shard that was skipped are recorded from its marker; any left
    // (impossible unless a marker is inconsistent) are decided now so the report is complete.
    for (const std::string & x : pairs_) record(x, decide(x));
    std::sort(rep_.kept_mxfp4.begin(), rep_.kept_mxfp4.end());

    const fs::path out_index = fs::path(o_.out_dir) / k_index_name;
    if (ck_.sharded()) {
        checkpoint_write_index(o_.out_dir, weight_map_, rep_.total_size);
    } else {
        std::error_code ec;
        fs::remove(out_index, ec);   // a single-file input gives a single-file output
    }
    copy_other_files(shard_names);
    write_config();
    write_report();
    log("convert: done: {} pairs repacked to NVFP4, {} kept MXFP4; {} shard(s) converted, {} skipped; {} files copied",
        rep_.pairs_repacked, rep_.kept_mxfp4.size(), rep_.shards_converted, rep_.shards_skipped,
        rep_.files_copied.size());
    if (o_.require_all && !rep_.kept_mxfp4.empty()) {
        std::string names;
        for (const auto & [x, why] : rep_.kept_mxfp4) names += names.empty() ? x : cat(", ", x);
        PG_FAIL("convert: {} pair(s) could not be repacked losslessly and were kept MXFP4: {}", rep_.kept_mxfp4.size(),
                names);
    }
    return rep_;
}

} // namespace

uint64_t convert_file_hash(const std::string & path) {
    std::error_code ec;
    const uint64_t n = fs::file_size(path, ec);
    PG_CHECK(!ec, "{}: cannot stat: {}", path, ec.message());
    return hash_prefix(path, n);
}

convert_report convert_mxfp4_to_nvfp4(const convert_options & opt) { return converter(opt).run(); }

} // namespace perigee
