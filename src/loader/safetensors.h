// safetensors reader (mmap, strict validation) and writer.
// Format and rules: huggingface/safetensors README "Format"; our checklist: RELIABILITY.md §A1, §B1.
// Every number in a header is untrusted: it is bounded before it sizes anything or indexes memory.
#pragma once
#include "core/tensor.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace perigee {

// Limits (safetensors MAX_HEADER_SIZE, plus our documented caps, RELIABILITY §A1 rule 12).
inline constexpr uint64_t k_st_max_header = 100'000'000;       // bytes of JSON header
inline constexpr uint64_t k_st_max_int = (uint64_t(1) << 48) - 1;  // any dim or offset
inline constexpr size_t k_st_max_rank = 8;
inline constexpr size_t k_st_max_name = 1024;                  // bytes of a tensor name
inline constexpr size_t k_st_max_tensors = 1'000'000;          // entries per file

struct st_entry {
    std::string name;
    dtype type;
    shape_t shape;                 // element counts (F4: elements, 2 per byte)
    uint64_t begin = 0, end = 0;   // byte offsets relative to the data buffer (after the header)
    uint64_t nbytes() const { return end - begin; }
};

class safetensors_file {
public:
    // mmaps (MAP_PRIVATE, PROT_READ) and validates every rule; throws perigee::error naming the file and,
    // where there is one, the tensor. Nothing is copied: tensor bytes stay in the mapping.
    static std::shared_ptr<safetensors_file> open(const std::string & path);

    const std::string & path() const { return path_; }
    const std::vector<st_entry> & entries() const { return entries_; }   // in offset order
    const st_entry * find(std::string_view name) const;                  // nullptr when absent
    // Zero-copy view into the mapping; the returned tensor's owner keeps the file mapped.
    // The bytes are read-only (PROT_READ): writing through the view faults. A zero-size tensor has data == nullptr.
    tensor view(const st_entry & e) const;
    const std::map<std::string, std::string> & metadata() const { return metadata_; }

    uint64_t header_size() const { return header_size_; }   // N (JSON bytes incl. padding)
    uint64_t file_size() const { return file_size_; }

    safetensors_file(const safetensors_file &) = delete;
    safetensors_file & operator=(const safetensors_file &) = delete;

private:
    safetensors_file() = default;   // use open()
    std::string path_;
    std::shared_ptr<void> map_;     // the mapping (munmap when the last owner goes)
    const uint8_t * base_ = nullptr;
    uint64_t file_size_ = 0, header_size_ = 0;
    std::vector<st_entry> entries_;
    std::vector<size_t> by_name_;   // indices into entries_, sorted by name
    std::map<std::string, std::string> metadata_;
};

// Writes a valid file: header padded with spaces to a multiple of 8, tensors in the given order (offsets
// assigned in that order; the header lists them in that order after __metadata__). Streams each tensor's
// bytes to disk; writes to "<path>.tmp" and renames, so a failed write leaves no partial file at `path`.
void safetensors_write(const std::string & path, const std::vector<std::pair<std::string, tensor>> & tensors,
                       const std::map<std::string, std::string> & metadata = {});

} // namespace perigee
