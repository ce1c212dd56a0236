#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

namespace perigee {

std::string shape_str(const shape_t & s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
}

int64_t shape_numel(const shape_t & s) {
    int64_t n = 1;
    for (int64_t d : s) {
        PG_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
        PG_CHECK(d == 0 || n <= INT64_MAX / d, "shape {} overflows 64 bits", shape_str(s));
        n *= d;
    }
    return n;
}

tensor tensor_new(dtype t, const shape_t & shape) {
    tensor r;
    r.type = t;
    r.shape = shape;
    const int64_t n = shape_numel(shape);
    r.nbytes = size_t((n * dtype_bits(t) + 7) / 8);
    if (r.nbytes > 0) {
        void * p = std::calloc(r.nbytes, 1);
        PG_CHECK(p != nullptr, "out of host memory allocating {} bytes for {}", r.nbytes, shape_str(shape));
        r.owner = std::shared_ptr<void>(p, std::free);
        r.data = p;
    }
    return r;
}

tensor tensor_view(dtype t, const shape_t & shape, void * data, std::shared_ptr<void> owner) {
    tensor r;
    r.type = t;
    r.shape = shape;
    r.nbytes = size_t((shape_numel(shape) * dtype_bits(t) + 7) / 8);
    r.data = data;
    r.owner = std::move(owner);
    return r;
}

float tensor_get_f32(const tensor & t, int64_t i) {
    switch (t.type) {
        case dtype::F32: return t.as<float>()[i];
        case dtype::F64: return float(t.as<double>()[i]);
        case dtype::BF16: return bf16_to_f32(t.as<uint16_t>()[i]);
        case dtype::F16: return f16_to_f32(t.as<uint16_t>()[i]);
        case dtype::F8_E4M3: return f8_e4m3_to_f32(t.as<uint8_t>()[i]);
        case dtype::F8_E5M2: return f8_e5m2_to_f32(t.as<uint8_t>()[i]);
        default: PG_FAIL("cannot read {} as a float", dtype_name(t.type));
    }
}

tensor tensor_to_f32(const tensor & t) {
    tensor r = tensor_new(dtype::F32, t.shape);
    const int64_t n = t.numel();
    float * o = r.as<float>();
    if (t.type == dtype::F32) {
        if (n) std::memcpy(o, t.data, size_t(n) * 4);
        return r;
    }
    for (int64_t i = 0; i < n; ++i) o[i] = tensor_get_f32(t, i);
    return r;
}

} // namespace perigee
