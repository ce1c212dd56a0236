// Model directory: model.safetensors.index.json + shards, or a single model.safetensors. RELIABILITY.md §B2.
#include "loader/checkpoint.h"
#include "loader/text.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <optional>
#include <set>
#include <sys/stat.h>
#include <unistd.h>
#include <unordered_set>

namespace perigee {

using loader_detail::printable;

namespace {

constexpr const char * k_index_name = "model.safetensors.index.json";
constexpr const char * k_single_name = "model.safetensors";
constexpr uint64_t k_max_index_bytes = 100'000'000;

// 0: absent, 1: exists; throws on other stat errors (permission, loop, ...).
bool path_exists(const std::string & p) {
    struct stat st{};
    if (::stat(p.c_str(), &st) == 0) return true;
    PG_CHECK(errno == ENOENT || errno == ENOTDIR, "{}: cannot stat: {}", p, std::strerror(errno));
    return false;
}

std::string read_small_file(const std::string & path, uint64_t max) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    PG_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
    struct stat st{};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    const int stat_err = errno;
    std::string s;
    if (stat_ok && S_ISREG(st.st_mode) && uint64_t(st.st_size) <= max) {
        s.resize(size_t(st.st_size));
        size_t got = 0;
        while (got < s.size()) {
            const ssize_t r = ::read(fd, s.data() + got, s.size() - got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            got += size_t(r);
        }
        const int err = errno;
        ::close(fd);
        PG_CHECK(got == s.size(), "{}: read failed after {} of {} bytes: {}", path, got, s.size(), std::strerror(err));
        return s;
    }
    ::close(fd);
    PG_CHECK(stat_ok, "{}: cannot stat: {}", path, std::strerror(stat_err));
    PG_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", path);
    PG_FAIL("{}: file of {} bytes exceeds the limit of {} bytes", path, uint64_t(st.st_size), max);
}

// Strict JSON parse: duplicate keys at any level and nesting deeper than `max_depth` are errors.
nlohmann::json parse_json_strict(const std::string & text, const std::string & path, int max_depth) {
    // nlohmann's lexer ends the input at a NUL byte and silently ignores the rest: refuse it by name.
    if (const size_t nul = text.find('\0'); nul != std::string::npos)
        PG_FAIL("{}: invalid JSON: a NUL byte at offset {}", path, nul);
    std::vector<std::unordered_set<std::string>> keys;
    auto cb = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json & parsed) -> bool {
        using ev_t = nlohmann::json::parse_event_t;
        if (ev == ev_t::object_start || ev == ev_t::array_start) {
            PG_CHECK(depth < max_depth, "{}: JSON nested deeper than {} levels", path, max_depth);
            if (ev == ev_t::object_start) keys.emplace_back();
        } else if (ev == ev_t::object_end) {
            keys.pop_back();
        } else if (ev == ev_t::key) {
            const std::string & k = parsed.get_ref<const std::string &>();
            PG_CHECK(keys.back().insert(k).second, "{}: duplicate key '{}'", path, printable(k));
        }
        return true;
    };
    try {
        return nlohmann::json::parse(text, cb, true, false);
    } catch (const nlohmann::json::exception & e) {
        PG_FAIL("{}: invalid JSON: {}", path, printable(e.what(), 300));
    }
}

std::string strip_slashes(std::string d) {
    while (d.size() > 1 && d.back() == '/') d.pop_back();
    return d;
}

} // namespace

void checkpoint_check_shard_name(const std::string & shard, const std::string & where) {
    bool ok = !shard.empty() && shard.find('/') == std::string::npos && shard.find('\\') == std::string::npos &&
              shard.find("..") == std::string::npos && shard != ".";
    for (char c : shard) ok = ok && static_cast<unsigned char>(c) >= 0x20;
    PG_CHECK(ok, "{}: shard path escapes model dir: '{}' is not a plain file name in the directory", where,
             printable(shard));
}

checkpoint checkpoint::open(const std::string & dir_in) {
    checkpoint c;
    c.dir_ = strip_slashes(dir_in);
    const std::string & dir = c.dir_;
    struct stat st{};
    PG_CHECK(::stat(dir.c_str(), &st) == 0, "{}: cannot open model directory: {}", dir, std::strerror(errno));
    PG_CHECK(S_ISDIR(st.st_mode), "{}: not a directory", dir);

    const std::string index_path = dir + "/" + k_index_name;
    const std::string single_path = dir + "/" + k_single_name;
    const bool has_index = path_exists(index_path), has_single = path_exists(single_path);
    PG_CHECK(!(has_index && has_single), "{}: both {} and {} are present; remove one so the checkpoint is unambiguous",
             dir, k_index_name, k_single_name);
    PG_CHECK(has_index || has_single, "{}: no checkpoint: neither {} nor {} is present", dir, k_index_name,
             k_single_name);

    if (has_single) {
        auto f = safetensors_file::open(single_path);
        for (const st_entry & e : f->entries()) {
            c.index_.emplace(e.name, loc{f.get(), &e});
            c.total_ += e.nbytes();
        }
        c.files_.push_back(std::move(f));
        return c;
    }

    c.sharded_ = true;
    const nlohmann::json j = parse_json_strict(read_small_file(index_path, k_max_index_bytes), index_path, 16);
    PG_CHECK(j.is_object(), "{}: top level must be a JSON object", index_path);
    for (const auto & [k, v] : j.items())
        PG_CHECK(k == "metadata" || k == "weight_map", "{}: unknown key '{}' (allowed: metadata, weight_map)",
                 index_path, printable(k));
    PG_CHECK(j.contains("weight_map"), "{}: missing key 'weight_map'", index_path);
    const auto & wm = j.at("weight_map");
    PG_CHECK(wm.is_object(), "{}: 'weight_map' must be an object of tensor name -> shard file name", index_path);
    std::optional<uint64_t> total_size;
    if (j.contains("metadata")) {
        const auto & md = j.at("metadata");
        PG_CHECK(md.is_object(), "{}: 'metadata' must be an object", index_path);
        if (md.contains("total_size")) {
            const auto & ts = md.at("total_size");
            PG_CHECK(ts.is_number_unsigned(), "{}: metadata.total_size must be a non-negative integer, got {}",
                     index_path, printable(ts.dump(), 60));
            total_size = ts.get<uint64_t>();
        }
    }

    // Tensor -> shard, and the shards in name order.
    std::map<std::string, std::string> weight_map;
    std::map<std::string, std::string> first_tensor_of;   // shard -> one tensor mapped to it (for messages)
    for (const auto & [name, v] : wm.items()) {
        PG_CHECK(v.is_string(), "{}: weight_map: tensor '{}': shard must be a string, got {}", index_path,
                 printable(name), printable(v.dump(), 60));
        const std::string & shard = v.get_ref<const std::string &>();
        checkpoint_check_shard_name(shard, fmt::format("{}: weight_map: tensor '{}'", index_path, printable(name)));
        weight_map.emplace(name, shard);
        first_tensor_of.emplace(shard, name);
    }

    std::map<std::string, const safetensors_file *> shard_files;
    for (const auto & [shard, tensor_name] : first_tensor_of) {
        const std::string p = dir + "/" + shard;
        PG_CHECK(path_exists(p), "{}: shard '{}' named in the index (for tensor '{}') does not exist", dir,
                 printable(shard), printable(tensor_name));
        auto f = safetensors_file::open(p);
        shard_files.emplace(shard, f.get());
        c.files_.push_back(std::move(f));
    }

    // Every shard's tensors are in the index under that shard, and every indexed tensor is in its shard.
    for (const auto & f : c.files_) {
        const std::string shard = f->path().substr(dir.size() + 1);
        for (const st_entry & e : f->entries()) {
            auto it = weight_map.find(e.name);
            PG_CHECK(it != weight_map.end(), "{}: tensor '{}' is in shard '{}' but not listed in the index", dir,
                     printable(e.name), printable(shard));
            PG_CHECK(it->second == shard, "{}: tensor '{}' is in shard '{}' but the index maps it to shard '{}'", dir,
                     printable(e.name), printable(shard), printable(it->second));
            c.index_.emplace(e.name, loc{f.get(), &e});
            c.total_ += e.nbytes();
        }
    }
    for (const auto & [name, shard] : weight_map)
        PG_CHECK(c.index_.count(name) != 0, "{}: index maps tensor '{}' to shard '{}' but that shard has no such tensor",
                 dir, printable(name), printable(shard));
    if (total_size)
        PG_CHECK(*total_size == c.total_, "{}: metadata.total_size is {} but the indexed tensors hold {} bytes",
                 index_path, *total_size, c.total_);
    return c;
}

const checkpoint::loc & checkpoint::at(const std::string & name) const {
    auto it = index_.find(name);
    PG_CHECK(it != index_.end(), "{}: no tensor '{}' in the checkpoint", dir_, printable(name));
    return it->second;
}

std::vector<std::string> checkpoint::names() const {
    std::vector<std::string> r;
    r.reserve(index_.size());
    for (const auto & [k, v] : index_) r.push_back(k);
    return r;
}

bool checkpoint::has(const std::string & name) const { return index_.count(name) != 0; }
const st_entry & checkpoint::entry(const std::string & name) const { return *at(name).e; }
tensor checkpoint::get(const std::string & name) const {
    const loc & l = at(name);
    return l.file->view(*l.e);
}
const std::string & checkpoint::file_of(const std::string & name) const { return at(name).file->path(); }
const std::string & checkpoint::dir() const { return dir_; }
uint64_t checkpoint::total_bytes() const { return total_; }

void checkpoint_write_index(const std::string & dir, const std::map<std::string, std::string> & weight_map,
                            uint64_t total_size) {
    const std::string path = strip_slashes(dir) + "/" + k_index_name;
    nlohmann::json wm = nlohmann::json::object();
    for (const auto & [name, shard] : weight_map) {
        checkpoint_check_shard_name(shard, fmt::format("{}: tensor '{}'", path, printable(name)));
        wm[name] = shard;
    }
    nlohmann::json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", wm}};
    std::string text;
    try {
        text = j.dump(2) + "\n";
    } catch (const nlohmann::json::exception & e) {
        PG_FAIL("{}: cannot encode the index: {}", path, e.what());
    }
    const std::string tmp = path + ".tmp";
    std::FILE * fp = std::fopen(tmp.c_str(), "wb");
    PG_CHECK(fp != nullptr, "{}: cannot create: {}", tmp, std::strerror(errno));
    const bool wrote = std::fwrite(text.data(), 1, text.size(), fp) == text.size();
    const bool closed = std::fclose(fp) == 0;
    if (!wrote || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        std::remove(tmp.c_str());
        PG_FAIL("{}: cannot write the index: {}", path, std::strerror(err));
    }
}

} // namespace perigee
