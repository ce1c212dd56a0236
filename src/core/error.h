// perigee::error — the one error type of the project (STYLE §3.6).
// Library code throws it; only tools/ and server/ turn it into an exit code or an HTTP error.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace perigee {

class error : public std::runtime_error {
public:
    error(const char * func, const char * file, int line, const std::string & msg)
        : std::runtime_error(msg), func_(func), file_(file), line_(line) {}
    const char * func() const { return func_; }
    const char * file() const { return file_; }
    int line() const { return line_; }
private:
    const char * func_;
    const char * file_;
    int line_;
};

[[noreturn]] inline void throw_error(const char * func, const char * file, int line, const std::string & msg) {
    throw error(func, file, line, msg);
}

} // namespace perigee

// PG_CHECK(cond, "format {}", args...): throws perigee::error with the formatted message.
#define PG_CHECK(cond, ...)                                                              \
    do {                                                                                 \
        if (!(cond)) ::perigee::throw_error(__func__, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
    } while (0)
#define PG_FAIL(...) ::perigee::throw_error(__func__, __FILE__, __LINE__, fmt::format(__VA_ARGS__))
// PG_ASSERT: for invariants that validated inputs make impossible; aborts with a message.
#define PG_ASSERT(cond)                                                                  \
    do {                                                                                 \
        if (!(cond)) { fmt::print(stderr, "PG_ASSERT failed: {} at {}:{}\n", #cond, __FILE__, __LINE__); std::abort(); } \
    } while (0)
