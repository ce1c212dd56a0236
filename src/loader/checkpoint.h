// A model directory of safetensors shards (HF layout). Rules: RELIABILITY.md §B2 (L-30..L-35).
#pragma once
#include "loader/safetensors.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace perigee {

// A model directory: either model.safetensors.index.json (sharded; every shard named must be a plain file
// name inside the directory — no '/', no '..', no absolute path; every indexed tensor must be in the shard the
// index names; no shard may hold a tensor the index does not list; every shard is opened and validated) or,
// without an index, exactly one model.safetensors. Both present, or neither: error naming the directory.
// The index may carry {"metadata": {"total_size": N}}; N must equal the tensors' total bytes.
// Shards that exist in the directory but are not named by the index are never opened.
// Symlinked shards are followed (the Hugging Face cache links snapshot files to ../../blobs); the guard against
// escaping the directory is on the names the index gives, which are untrusted.
class checkpoint {
public:
    static checkpoint open(const std::string & dir);
    std::vector<std::string> names() const;                   // sorted
    bool has(const std::string & name) const;
    const st_entry & entry(const std::string & name) const;   // error naming the tensor when absent
    tensor get(const std::string & name) const;               // zero-copy view
    const std::string & file_of(const std::string & name) const;   // path of the shard holding it
    const std::string & dir() const;
    uint64_t total_bytes() const;                             // sum of all tensors' byte sizes

    bool sharded() const { return sharded_; }                 // opened through an index
    const std::vector<std::shared_ptr<safetensors_file>> & files() const { return files_; }

private:
    struct loc {
        const safetensors_file * file;
        const st_entry * e;
    };
    const loc & at(const std::string & name) const;

    std::string dir_;
    bool sharded_ = false;
    std::vector<std::shared_ptr<safetensors_file>> files_;
    std::map<std::string, loc, std::less<>> index_;
    uint64_t total_ = 0;
};

// Throws unless `shard` is a plain file name (non-empty, no '/', '\\', "..", NUL or control characters).
void checkpoint_check_shard_name(const std::string & shard, const std::string & where);

// Writes model.safetensors.index.json for a set of shards: {"metadata": {"total_size": N}, "weight_map": {...}}.
void checkpoint_write_index(const std::string & dir, const std::map<std::string, std::string> & weight_map,
                            uint64_t total_size);

} // namespace perigee
