// Helpers for the loader tests: temp directories, raw safetensors bytes, and "open must fail with ..." checks.
#pragma once
#include "core/error.h"
#include "loader/safetensors.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <unistd.h>

namespace perigee::test {

namespace fs = std::filesystem;

struct temp_dir {
    fs::path path;
    temp_dir() {
        static std::atomic<int> counter{0};
        path = fs::temp_directory_path() /
               ("perigee_loader_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
        fs::remove_all(path);
        fs::create_directories(path);
    }
    ~temp_dir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
    std::string file(const std::string & name) const { return (path / name).string(); }
};

inline void write_bytes(const std::string & path, const std::string & bytes) {
    std::ofstream o(path, std::ios::binary | std::ios::trunc);
    o.write(bytes.data(), std::streamsize(bytes.size()));
    ASSERT_TRUE(o.good()) << path;
}

inline std::string le64(uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(v >> (8 * i)));
    return s;
}

// 8-byte length (the header's size unless `n` is given), header bytes verbatim, then `data_size` bytes of data.
inline std::string st_bytes(const std::string & header, uint64_t data_size, std::optional<uint64_t> n = std::nullopt) {
    std::string s = le64(n ? *n : header.size()) + header;
    for (uint64_t i = 0; i < data_size; ++i) s += char(uint8_t(i * 7 + 1));
    return s;
}

// open() must throw perigee::error whose message contains the path and every substring given.
inline void expect_open_fails(const std::string & path, std::initializer_list<std::string> parts) {
    try {
        safetensors_file::open(path);
        ADD_FAILURE() << "open() accepted " << path;
    } catch (const perigee::error & e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
        for (const auto & p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
    }
}

} // namespace perigee::test
