// Internal to the loader: untrusted text (names, keys from files) made safe for an error message.
#pragma once
#include <fmt/format.h>

#include <string>
#include <string_view>

namespace perigee::loader_detail {

// Printable ASCII kept, everything else as \xNN, long text cut with "...".
inline std::string printable(std::string_view s, size_t max = 160) {
    std::string r;
    for (size_t i = 0; i < s.size(); ++i) {
        if (r.size() >= max) { r += "..."; break; }
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7f && c != '\\') r += char(c);
        else r += fmt::format("\\x{:02x}", c);
    }
    return r;
}

} // namespace perigee::loader_detail
