// F-1: one safetensors shard (header + data) from arbitrary bytes (RELIABILITY §B1 L-01..L-20).
// A file that opens must satisfy the format's invariants, and every tensor view must lie inside the mapping.
#include "fuzz_util.h"
#include "loader/safetensors.h"

using namespace perigee;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    static fuzz::mem_file f;
    f.set(data, size);
    std::shared_ptr<safetensors_file> st;
    try {
        st = safetensors_file::open(f.path());
    } catch (const perigee::error &) {
        return 0;
    }
    FUZZ_CHECK(st->file_size() == size, "file_size %llu != %zu", (unsigned long long)st->file_size(), size);
    FUZZ_CHECK(st->header_size() <= size - 8, "header_size past the file");
    const uint64_t buffer = size - 8 - st->header_size();
    uint64_t covered = 0, prev_end = 0;
    for (const st_entry & e : st->entries()) {
        FUZZ_CHECK(e.begin <= e.end && e.end <= buffer, "%s: [%llu, %llu) outside buffer %llu", e.name.c_str(),
                   (unsigned long long)e.begin, (unsigned long long)e.end, (unsigned long long)buffer);
        FUZZ_CHECK(e.begin >= prev_end || e.begin == e.end, "%s overlaps the previous tensor", e.name.c_str());
        const int64_t n = shape_numel(e.shape);
        FUZZ_CHECK(uint64_t(n) * uint64_t(dtype_bits(e.type)) == e.nbytes() * 8, "%s: size mismatch", e.name.c_str());
        FUZZ_CHECK(st->find(e.name) == &e, "%s: find() disagrees", e.name.c_str());
        tensor t = st->view(e);
        FUZZ_CHECK(t.nbytes == e.nbytes(), "%s: view size", e.name.c_str());
        if (t.nbytes) {
            const volatile uint8_t * p = static_cast<const uint8_t *>(t.data);
            (void)p[0];
            (void)p[t.nbytes - 1];   // faults (SEGV, reported) if the view leaves the mapping
        }
        covered += e.nbytes();
        prev_end = std::max(prev_end, e.end);
    }
    FUZZ_CHECK(covered == buffer, "buffer %llu not fully covered (%llu)", (unsigned long long)buffer,
               (unsigned long long)covered);
    return 0;
}
