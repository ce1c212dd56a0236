// Small helpers shared by the CLI subcommands.
#pragma once
#include "core/error.h"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace perigee::cli {

// "1,2,3" -> {1, 2, 3}; every entry a non-negative 32-bit integer; errors name the bad entry.
inline std::vector<int32_t> parse_id_list(const std::string & s, const char * flag = "--ids") {
    std::vector<int32_t> ids;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        size_t pos = 0;
        long v = -1;
        try {
            v = std::stol(item, &pos);
        } catch (const std::exception &) {
            PG_FAIL("{}: '{}' is not an integer", flag, item);
        }
        PG_CHECK(pos == item.size() && v >= 0 && v <= INT32_MAX, "{}: '{}' is not a token id", flag, item);
        ids.push_back(int32_t(v));
    }
    PG_CHECK(!ids.empty(), "{}: no token ids given", flag);
    return ids;
}

} // namespace perigee::cli
