// SHA-256 (FIPS 180-4), used to report and pin vocabulary files.
#pragma once
#include <string>
#include <string_view>

namespace perigee::tok {

// Lower-case hex digest of `data`.
std::string sha256_hex(std::string_view data);

} // namespace perigee::tok
