// safetensors reader and writer. Rules: RELIABILITY.md §A1 (format), §B1 (defect checklist L-01..L-19).
// The header is parsed by a SAX handler that accepts exactly the schema (no DOM, no recursion), so duplicate
// keys, unknown fields, wrong value types and deep nesting are rejected where they appear.
#include "loader/safetensors.h"
#include "loader/text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <unordered_set>

namespace perigee {

namespace {

uint64_t read_le64(const uint8_t * p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

using loader_detail::printable;

std::string known_dtypes() {
    std::string r;
    for (int i = 0; i < int(dtype::COUNT); ++i) {
        if (i) r += ' ';
        r += dtype_name(dtype(i));
    }
    return r;
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t & out) { return __builtin_mul_overflow(a, b, &out); }

// SAX handler accepting exactly: { "__metadata__": {str: str, ...}?, name: {dtype, shape, data_offsets}, ... }.
class header_sax : public nlohmann::json_sax<nlohmann::json> {
public:
    header_sax(const std::string & path, uint64_t buffer_size, std::vector<st_entry> & out,
               std::map<std::string, std::string> & meta)
        : path_(path), buffer_size_(buffer_size), out_(out), meta_(meta) {}

    bool null() override { return bad_value("null"); }
    bool boolean(bool v) override { return bad_value(v ? "true" : "false"); }
    bool number_integer(number_integer_t v) override {
        // nlohmann reports only numbers written with a minus sign here.
        return bad_value(fmt::format("{} (negative)", v));
    }
    bool number_unsigned(number_unsigned_t v) override {
        if (st_ == state::in_shape) {
            PG_CHECK(v <= k_st_max_int, "{}: dimension {} of shape is {}, above the limit 2^48-1 (overflow)",
                     where(), cur_.shape.size(), v);
            PG_CHECK(cur_.shape.size() < k_st_max_rank, "{}: shape has more than {} dimensions", where(),
                     k_st_max_rank);
            cur_.shape.push_back(int64_t(v));
            return true;
        }
        if (st_ == state::in_offsets) {
            PG_CHECK(n_offsets_ < 2, "{}: data_offsets must have exactly 2 values, got more", where());
            offsets_[n_offsets_++] = v;
            return true;
        }
        return bad_value(fmt::format("{}", v));
    }
    bool number_float(number_float_t, const string_t & raw) override {
        return bad_value(fmt::format("{} (not an integer)", printable(raw)));
    }
    bool string(string_t & v) override {
        if (st_ == state::field_dtype) {
            const auto t = dtype_from_name(v);
            PG_CHECK(t.has_value(), "{}: unknown dtype '{}' (known: {})", where(), printable(v), known_dtypes());
            cur_.type = *t;
            st_ = state::in_entry;
            return true;
        }
        if (st_ == state::meta_value) {
            meta_[meta_key_] = v;
            st_ = state::in_meta;
            return true;
        }
        return bad_value(fmt::format("string \"{}\"", printable(v, 40)));
    }
    bool binary(binary_t &) override { return bad_value("binary"); }

    bool start_object(std::size_t) override {
        switch (st_) {
            case state::top: st_ = state::in_top; return true;
            case state::expect_meta: st_ = state::in_meta; return true;
            case state::expect_entry:
                st_ = state::in_entry;
                cur_ = st_entry{};
                cur_.name = cur_name_;
                has_dtype_ = has_shape_ = has_offsets_ = false;
                n_offsets_ = 0;
                return true;
            default: return bad_value("an object");
        }
    }
    bool key(string_t & k) override {
        switch (st_) {
            case state::in_top:
                // Duplicate tensor names are found after the parse, on the name-sorted index (cheaper than a set).
                if (k == "__metadata__") {
                    PG_CHECK(!seen_metadata_, "{}: header: duplicate key '__metadata__'", path_);
                    seen_metadata_ = true;
                    st_ = state::expect_meta;
                    in_tensor_ = false;
                    return true;
                }
                PG_CHECK(!k.empty(), "{}: header: empty tensor name", path_);
                PG_CHECK(k.size() <= k_st_max_name, "{}: header: tensor name of {} bytes exceeds the limit of {} ('{}')",
                         path_, k.size(), k_st_max_name, printable(k, 60));
                PG_CHECK(out_.size() < k_st_max_tensors, "{}: header: more than {} tensors", path_, k_st_max_tensors);
                cur_name_ = k;
                in_tensor_ = true;
                st_ = state::expect_entry;
                return true;
            case state::in_meta:
                PG_CHECK(meta_.count(k) == 0, "{}: __metadata__: duplicate key '{}'", path_, printable(k));
                meta_key_ = k;
                st_ = state::meta_value;
                return true;
            case state::in_entry: {
                bool * seen = k == "dtype" ? &has_dtype_ : k == "shape" ? &has_shape_ : k == "data_offsets" ? &has_offsets_ : nullptr;
                PG_CHECK(seen != nullptr, "{}: unknown field '{}' (allowed: dtype, shape, data_offsets)", where(),
                         printable(k));
                PG_CHECK(!*seen, "{}: duplicate key '{}'", where(), k);
                *seen = true;
                st_ = k == "dtype" ? state::field_dtype : k == "shape" ? state::field_shape : state::field_offsets;
                return true;
            }
            default: PG_FAIL("{}: header: unexpected key '{}'", path_, printable(k));
        }
    }
    bool end_object() override {
        switch (st_) {
            case state::in_top: st_ = state::done; return true;
            case state::in_meta: st_ = state::in_top; return true;
            case state::in_entry: finish_entry(); st_ = state::in_top; return true;
            default: PG_FAIL("{}: header: unexpected end of object", path_);
        }
    }
    bool start_array(std::size_t) override {
        if (st_ == state::field_shape) { st_ = state::in_shape; return true; }
        if (st_ == state::field_offsets) { st_ = state::in_offsets; return true; }
        return bad_value("an array");
    }
    bool end_array() override {
        if (st_ == state::in_shape) { st_ = state::in_entry; return true; }
        if (st_ == state::in_offsets) {
            PG_CHECK(n_offsets_ == 2, "{}: data_offsets must have exactly 2 values, got {}", where(), n_offsets_);
            st_ = state::in_entry;
            return true;
        }
        PG_FAIL("{}: header: unexpected end of array", path_);
    }
    bool parse_error(std::size_t pos, const std::string &, const nlohmann::detail::exception & ex) override {
        const std::string what = ex.what();
        if (what.find("UTF-8") != std::string::npos)
            PG_FAIL("{}: header is not valid UTF-8 (near byte {}): {}", path_, pos, printable(what, 300));
        PG_FAIL("{}: header is not valid JSON (near byte {}): {}", path_, pos, printable(what, 300));
    }

    bool done() const { return st_ == state::done; }

private:
    enum class state {
        top, in_top, expect_meta, in_meta, meta_value, expect_entry, in_entry,
        field_dtype, field_shape, in_shape, field_offsets, in_offsets, done,
    };

    std::string where() const {
        return in_tensor_ ? fmt::format("{}: tensor '{}'", path_, printable(cur_name_)) : fmt::format("{}: header", path_);
    }

    bool bad_value(const std::string & got) {
        switch (st_) {
            case state::top: PG_FAIL("{}: header: top level must be a JSON object, got {}", path_, got);
            case state::expect_meta: PG_FAIL("{}: __metadata__ must be an object of string values, got {}", path_, got);
            case state::meta_value:
                PG_FAIL("{}: __metadata__ key '{}': value must be a string, got {}", path_, printable(meta_key_), got);
            case state::expect_entry:
                PG_FAIL("{}: entry must be an object with dtype, shape, data_offsets, got {}", where(), got);
            case state::field_dtype: PG_FAIL("{}: dtype must be a string, got {}", where(), got);
            case state::field_shape: PG_FAIL("{}: shape must be an array of integers, got {}", where(), got);
            case state::in_shape:
                PG_FAIL("{}: dimension {} of shape must be a non-negative integer, got {}", where(), cur_.shape.size(), got);
            case state::field_offsets: PG_FAIL("{}: data_offsets must be an array of 2 integers, got {}", where(), got);
            case state::in_offsets:
                PG_FAIL("{}: data_offsets value {} must be a non-negative integer, got {}", where(), n_offsets_, got);
            default: PG_FAIL("{}: unexpected value {}", where(), got);
        }
    }

    void finish_entry() {
        PG_CHECK(has_dtype_, "{}: missing field 'dtype'", where());
        PG_CHECK(has_shape_, "{}: missing field 'shape'", where());
        PG_CHECK(has_offsets_, "{}: missing field 'data_offsets'", where());
        cur_.begin = offsets_[0];
        cur_.end = offsets_[1];
        PG_CHECK(cur_.end >= cur_.begin, "{}: data_offsets [{}, {}]: end < begin", where(), cur_.begin, cur_.end);
        PG_CHECK(cur_.end <= buffer_size_, "{}: data_offsets [{}, {}]: end is past the data buffer ({} bytes)", where(),
                 cur_.begin, cur_.end, buffer_size_);
        uint64_t numel = 1;
        for (int64_t d : cur_.shape)
            PG_CHECK(!mul_overflows(numel, uint64_t(d), numel), "{}: shape {}: element count overflows 64 bits", where(),
                     shape_str(cur_.shape));
        PG_CHECK(numel <= uint64_t(INT64_MAX), "{}: shape {}: element count overflows int64", where(), shape_str(cur_.shape));
        const int bits = dtype_bits(cur_.type);
        uint64_t nbits = 0;
        PG_CHECK(!mul_overflows(numel, uint64_t(bits), nbits), "{}: shape {} of {}: bit count overflows 64 bits", where(),
                 shape_str(cur_.shape), dtype_name(cur_.type));
        PG_CHECK(nbits % 8 == 0, "{}: misaligned: {} elements of {} are {} bits, not a whole number of bytes", where(),
                 numel, dtype_name(cur_.type), nbits);
        PG_CHECK(cur_.end - cur_.begin == nbits / 8,
                 "{}: size mismatch: data_offsets [{}, {}] span {} bytes, but shape {} of {} needs {} bytes", where(),
                 cur_.begin, cur_.end, cur_.end - cur_.begin, shape_str(cur_.shape), dtype_name(cur_.type), nbits / 8);
        out_.push_back(std::move(cur_));
        in_tensor_ = false;
    }

    const std::string & path_;
    const uint64_t buffer_size_;
    std::vector<st_entry> & out_;
    std::map<std::string, std::string> & meta_;
    state st_ = state::top;
    bool seen_metadata_ = false;
    std::string cur_name_, meta_key_;
    bool in_tensor_ = false;
    st_entry cur_;
    bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
    size_t n_offsets_ = 0;
    uint64_t offsets_[2] = {0, 0};
};

struct fd_closer {
    int fd;
    ~fd_closer() { if (fd >= 0) ::close(fd); }
};

void write_all(int fd, const void * data, size_t n, const std::string & path) {
    const char * p = static_cast<const char *>(data);
    while (n > 0) {
        const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
        if (w < 0 && errno == EINTR) continue;
        PG_CHECK(w > 0, "{}: write failed: {}", path, std::strerror(errno));
        p += w;
        n -= size_t(w);
    }
}

} // namespace

std::shared_ptr<safetensors_file> safetensors_file::open(const std::string & path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    PG_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
    fd_closer closer{fd};
    struct stat st{};
    PG_CHECK(::fstat(fd, &st) == 0, "{}: cannot stat: {}", path, std::strerror(errno));
    PG_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", path);
    const uint64_t size = uint64_t(st.st_size);
    PG_CHECK(size >= 8, "{}: header too small: the file is {} bytes, a safetensors file needs at least 8", path, size);

    // The length prefix is read and bounded before anything is sized from it.
    uint8_t prefix[8];
    size_t got = 0;
    while (got < 8) {
        const ssize_t r = ::pread(fd, prefix + got, 8 - got, off_t(got));
        if (r < 0 && errno == EINTR) continue;
        PG_CHECK(r > 0, "{}: cannot read the header length: {}", path, r < 0 ? std::strerror(errno) : "end of file");
        got += size_t(r);
    }
    const uint64_t n = read_le64(prefix);
    PG_CHECK(n <= k_st_max_header, "{}: header too large: header length {} exceeds the limit of {} bytes", path, n,
             k_st_max_header);
    PG_CHECK(n <= size - 8, "{}: header length exceeds file: header length {} but only {} bytes follow the length prefix",
             path, n, size - 8);
    PG_CHECK(n >= 2, "{}: header too small: header length {} cannot hold a JSON object", path, n);

    void * p = ::mmap(nullptr, size_t(size), PROT_READ, MAP_PRIVATE, fd, 0);
    PG_CHECK(p != MAP_FAILED, "{}: mmap of {} bytes failed: {}", path, size, std::strerror(errno));
    const size_t map_len = size_t(size);
    std::shared_ptr<void> map(p, [map_len](void * q) { ::munmap(q, map_len); });

    std::shared_ptr<safetensors_file> f(new safetensors_file());
    f->path_ = path;
    f->map_ = map;
    f->base_ = static_cast<const uint8_t *>(p);
    f->file_size_ = size;
    f->header_size_ = n;
    const uint64_t buffer_size = size - 8 - n;

    const char * h = reinterpret_cast<const char *>(f->base_ + 8);
    PG_CHECK(h[0] == '{', "{}: header must begin with '{{' (0x7b), got byte 0x{:02x}", path, uint8_t(h[0]));
    // Only 0x20 may follow the JSON object (the writer's padding). Find the JSON's end without trusting the parser
    // to reject other whitespace (JSON itself allows tab, CR, LF after the value).
    size_t m = size_t(n);
    while (m > 0 && h[m - 1] == ' ') --m;
    if (h[m - 1] != '}') {
        size_t k = m;
        while (k > 0 && h[k - 1] != '}') --k;
        bool only_blank = k > 0;
        for (size_t i = k; i < m && only_blank; ++i) only_blank = h[i] == '\0' || h[i] == '\t' || h[i] == '\n' || h[i] == '\r';
        PG_CHECK(!only_blank, "{}: header padding must be spaces (0x20) after the closing '}}': found byte 0x{:02x} at "
                              "header offset {}", path, uint8_t(h[k]), k);
    }

    // The shortest entry is ~50 header bytes, so n / 48 bounds the count: reserving it (virtual memory only,
    // touched as filled) avoids the reallocation peak of a header with very many entries.
    f->entries_.reserve(size_t(std::min<uint64_t>(n / 48 + 1, k_st_max_tensors)));
    header_sax sax(f->path_, buffer_size, f->entries_, f->metadata_);
    const bool ok = nlohmann::json::sax_parse(h, h + m, &sax, nlohmann::json::input_format_t::json, true, false);
    PG_CHECK(ok && sax.done(), "{}: header is not valid JSON", path);

    // Offset order (header key order is free, as in the reference reader, which sorts by offsets).
    auto & es = f->entries_;
    const auto by_offset = [](const st_entry & a, const st_entry & b) {
        if (a.begin != b.begin) return a.begin < b.begin;
        if (a.end != b.end) return a.end < b.end;
        return a.name < b.name;
    };
    if (!std::is_sorted(es.begin(), es.end(), by_offset)) std::sort(es.begin(), es.end(), by_offset);

    // Name index for find(); duplicate tensor keys show up as neighbours.
    f->by_name_.resize(es.size());
    for (size_t i = 0; i < es.size(); ++i) f->by_name_[i] = i;
    std::sort(f->by_name_.begin(), f->by_name_.end(), [&es](size_t a, size_t b) { return es[a].name < es[b].name; });
    for (size_t i = 1; i < es.size(); ++i)
        PG_CHECK(es[f->by_name_[i - 1]].name != es[f->by_name_[i]].name, "{}: header: duplicate key '{}'", path,
                 printable(es[f->by_name_[i]].name));

    // Each tensor starts where the previous ended, the first at 0, the last at the end of the buffer.
    uint64_t pos = 0;
    for (size_t i = 0; i < es.size(); ++i) {
        const st_entry & e = es[i];
        if (i == 0)
            PG_CHECK(e.begin == 0, "{}: tensor '{}': first tensor (in offset order) begins at byte {}, not 0", path,
                     printable(e.name), e.begin);
        PG_CHECK(e.begin >= pos, "{}: tensor '{}': overlap: data_offsets [{}, {}] overlap tensor '{}' which ends at {}",
                 path, printable(e.name), e.begin, e.end, printable(es[i - 1].name), pos);
        PG_CHECK(e.begin == pos, "{}: tensor '{}': hole of {} bytes before data_offsets [{}, {}] (previous tensor '{}' "
                 "ends at {})", path, printable(e.name), e.begin - pos, e.begin, e.end, printable(es[i - 1].name), pos);
        pos = e.end;
    }
    PG_CHECK(pos == buffer_size, "{}: trailing bytes: buffer not fully covered: the data buffer is {} bytes but the "
             "tensors cover {} ({} bytes after the last tensor)", path, buffer_size, pos, buffer_size - pos);
    return f;
}

const st_entry * safetensors_file::find(std::string_view name) const {
    auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                               [this](size_t i, std::string_view n) { return entries_[i].name < n; });
    if (it == by_name_.end() || entries_[*it].name != name) return nullptr;
    return &entries_[*it];
}

tensor safetensors_file::view(const st_entry & e) const {
    // The entry may come from elsewhere: re-check it against this file before pointing into the mapping.
    const uint64_t buffer_size = file_size_ - 8 - header_size_;
    PG_CHECK(e.begin <= e.end && e.end <= buffer_size, "{}: tensor '{}': data_offsets [{}, {}] outside the buffer ({} bytes)",
             path_, printable(e.name), e.begin, e.end, buffer_size);
    tensor t;
    t.type = e.type;
    t.shape = e.shape;
    t.nbytes = size_t(e.end - e.begin);
    uint64_t numel = 1, nbits = 0;
    bool ok = e.shape.size() <= k_st_max_rank && size_t(e.type) < size_t(dtype::COUNT);
    for (int64_t d : e.shape) ok = ok && d >= 0 && !mul_overflows(numel, uint64_t(d), numel);
    ok = ok && !mul_overflows(numel, uint64_t(dtype_bits(e.type)), nbits) && nbits % 8 == 0 && nbits / 8 == t.nbytes;
    PG_CHECK(ok, "{}: tensor '{}': entry size does not match its shape {}", path_, printable(e.name),
             shape_str(e.shape));
    if (t.nbytes > 0) {
        t.data = const_cast<uint8_t *>(base_ + 8 + header_size_ + e.begin);
        t.owner = map_;
    }
    return t;
}

void safetensors_write(const std::string & path, const std::vector<std::pair<std::string, tensor>> & tensors,
                       const std::map<std::string, std::string> & metadata) {
    // Header, built as text (an ordered JSON object would be quadratic in the tensor count).
    std::string h = "{";
    auto jstr = [&path](const std::string & s) {
        try {
            return nlohmann::json(s).dump();
        } catch (const nlohmann::json::exception &) {
            PG_FAIL("{}: name or metadata '{}' is not valid UTF-8", path, printable(s));
        }
    };
    if (!metadata.empty()) {
        h += "\"__metadata__\":{";
        bool first = true;
        for (const auto & [k, v] : metadata) {
            if (!first) h += ",";
            first = false;
            h += jstr(k) + ":" + jstr(v);
        }
        h += "}";
    }
    std::unordered_set<std::string_view> seen;
    uint64_t off = 0;
    for (const auto & [name, t] : tensors) {
        PG_CHECK(!name.empty() && name != "__metadata__", "{}: invalid tensor name '{}'", path, printable(name));
        PG_CHECK(seen.insert(name).second, "{}: tensor '{}' given twice", path, printable(name));
        uint64_t numel = 1, nbits = 0;
        for (int64_t d : t.shape)
            PG_CHECK(d >= 0 && !mul_overflows(numel, uint64_t(d), numel), "{}: tensor '{}': bad shape {}", path,
                     printable(name), shape_str(t.shape));
        PG_CHECK(!mul_overflows(numel, uint64_t(dtype_bits(t.type)), nbits) && nbits % 8 == 0,
                 "{}: tensor '{}': misaligned: shape {} of {} is not a whole number of bytes", path, printable(name),
                 shape_str(t.shape), dtype_name(t.type));
        PG_CHECK(t.nbytes == nbits / 8, "{}: tensor '{}': holds {} bytes but shape {} of {} needs {}", path,
                 printable(name), t.nbytes, shape_str(t.shape), dtype_name(t.type), nbits / 8);
        PG_CHECK(t.nbytes == 0 || t.data != nullptr, "{}: tensor '{}': no data", path, printable(name));
        if (h.size() > 1) h += ",";
        h += jstr(name) + fmt::format(":{{\"dtype\":\"{}\",\"shape\":[", dtype_name(t.type));
        for (size_t i = 0; i < t.shape.size(); ++i) {
            if (i) h += ',';
            h += std::to_string(t.shape[i]);
        }
        h += fmt::format("],\"data_offsets\":[{},{}]}}", off, off + t.nbytes);
        off += t.nbytes;
    }
    h += "}";
    while (h.size() % 8 != 0) h += ' ';
    PG_CHECK(h.size() <= k_st_max_header, "{}: header of {} bytes exceeds the limit of {}", path, h.size(), k_st_max_header);

    const std::string tmp = path + ".tmp";
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    PG_CHECK(fd >= 0, "{}: cannot create: {}", tmp, std::strerror(errno));
    bool closed = false;
    try {
        uint8_t prefix[8];
        uint64_t n = h.size();
        for (int i = 0; i < 8; ++i) prefix[i] = uint8_t(n >> (8 * i));
        write_all(fd, prefix, 8, tmp);
        write_all(fd, h.data(), h.size(), tmp);
        for (const auto & [name, t] : tensors)
            if (t.nbytes) write_all(fd, t.data, t.nbytes, tmp);
        const int rc = ::close(fd);
        closed = true;
        PG_CHECK(rc == 0, "{}: close failed: {}", tmp, std::strerror(errno));
    } catch (...) {
        if (!closed) ::close(fd);
        ::unlink(tmp.c_str());
        throw;
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        PG_FAIL("{}: cannot rename {} into place: {}", path, tmp, std::strerror(err));
    }
}

} // namespace perigee
