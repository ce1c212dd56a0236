// A host tensor: dtype, shape (outermost first, as PyTorch writes it), contiguous bytes.
// It either owns its bytes (tensor_new) or views bytes owned elsewhere (an mmapped shard).
#pragma once
#include "core/dtype.h"
#include "core/error.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace perigee {

using shape_t = std::vector<int64_t>;

std::string shape_str(const shape_t & s);          // "[3, 4]"
int64_t shape_numel(const shape_t & s);            // product, with overflow check

struct tensor {
    dtype type = dtype::F32;
    shape_t shape;
    void * data = nullptr;
    size_t nbytes = 0;
    std::shared_ptr<void> owner;   // keeps the bytes alive (heap block or mmap)

    int64_t numel() const { return shape_numel(shape); }
    int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
    bool empty() const { return data == nullptr && nbytes == 0; }

    template <typename T> T * as() { return static_cast<T *>(data); }
    template <typename T> const T * as() const { return static_cast<const T *>(data); }
    float * f32() { PG_CHECK(type == dtype::F32, "tensor is {}, not F32", dtype_name(type)); return as<float>(); }
    const float * f32() const { PG_CHECK(type == dtype::F32, "tensor is {}, not F32", dtype_name(type)); return as<float>(); }
};

// Zero-filled owned tensor.
tensor tensor_new(dtype t, const shape_t & shape);
// A view over bytes owned by `owner` (no copy).
tensor tensor_view(dtype t, const shape_t & shape, void * data, std::shared_ptr<void> owner);
// Element i of a float-like tensor (F32, BF16, F16, F64, F8_E4M3, F8_E5M2) as f32; errors otherwise.
float tensor_get_f32(const tensor & t, int64_t i);
// Whole tensor converted to f32 (a new owned tensor). Works for the float-like dtypes above.
tensor tensor_to_f32(const tensor & t);

} // namespace perigee
