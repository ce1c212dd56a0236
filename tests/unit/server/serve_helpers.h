// Test helpers: a `perigee serve` child process on 127.0.0.1 (port 0, stderr captured, the port
// read from its "Listening on" line) and a raw streaming client whose reads and close the test
// controls. PERIGEE_BIN must name the perigee executable.
#pragma once
#include <httplib.h>

#include <arpa/inet.h>
#include <csignal>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace perigee_test {

using steady = std::chrono::steady_clock;
inline double since(steady::time_point t) { return std::chrono::duration<double>(steady::now() - t).count(); }

// ---------------------------------------------------------------- the server process
class serve_proc {
public:
    serve_proc(const std::string & model, const std::vector<std::string> & extra) {
        int p[2];
        if (pipe(p) != 0) throw std::runtime_error("pipe");
        std::vector<std::string> args = {PERIGEE_BIN, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                                         "--served-model-name", "tiny"};
        args.insert(args.end(), extra.begin(), extra.end());
        pid_ = fork();
        if (pid_ == 0) {
            dup2(p[1], 2);
            const int devnull = open("/dev/null", O_RDWR);
            dup2(devnull, 0);
            dup2(devnull, 1);
            close(p[0]);
            setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
            std::vector<char *> av;
            for (auto & a : args) av.push_back(a.data());
            av.push_back(nullptr);
            execv(av[0], av.data());
            _exit(127);
        }
        close(p[1]);
        fd_ = p[0];
        reader_ = std::thread([this] {
            char buf[4096];
            for (;;) {
                const ssize_t n = read(fd_, buf, sizeof buf);
                if (n <= 0) break;
                std::lock_guard<std::mutex> lk(m_);
                log_.append(buf, size_t(n));
            }
        });
        const auto t0 = steady::now();
        const std::regex re(R"(Listening on http://127\.0\.0\.1:(\d+))");
        while (since(t0) < 60) {
            {
                std::lock_guard<std::mutex> lk(m_);
                std::smatch mm;
                if (std::regex_search(log_, mm, re)) {
                    port_ = std::stoi(mm[1]);
                    return;
                }
            }
            if (waitpid(pid_, &status_, WNOHANG) == pid_) {
                exited_ = true;
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        throw std::runtime_error("perigee serve did not start: " + log());
    }
    ~serve_proc() {
        if (!exited_) {
            kill(pid_, SIGKILL);
            waitpid(pid_, &status_, 0);
        }
        if (reader_.joinable()) reader_.join();
        close(fd_);
    }
    int port() const { return port_; }
    pid_t pid() const { return pid_; }
    std::string log() const {
        std::lock_guard<std::mutex> lk(m_);
        return log_;
    }
    // Exit code, or -1 if it did not exit within timeout_s (or died of a signal).
    int wait_exit(double timeout_s) {
        const auto t0 = steady::now();
        while (since(t0) < timeout_s) {
            if (waitpid(pid_, &status_, WNOHANG) == pid_) {
                exited_ = true;
                return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        return -1;
    }

    httplib::Client client() const {
        httplib::Client c("127.0.0.1", port_);
        c.set_read_timeout(60, 0);
        c.set_connection_timeout(5, 0);
        return c;
    }
    std::pair<int, std::string> post(const std::string & path, const std::string & body) const {
        auto c = client();
        auto r = c.Post(path.c_str(), body, "application/json");
        if (!r) return {-1, "transport error: " + httplib::to_string(r.error())};
        return {r->status, r->body};
    }
    std::map<std::string, double> metrics() const {
        auto c = client();
        std::map<std::string, double> out;
        auto r = c.Get("/metrics");
        if (!r) return out;
        std::istringstream ss(r->body);
        std::string line;
        while (std::getline(ss, line)) {
            if (line.empty() || line[0] == '#') continue;
            const size_t sp = line.rfind(' ');
            if (sp == std::string::npos) continue;
            out[line.substr(0, sp)] = std::atof(line.c_str() + sp + 1);
        }
        return out;
    }
    // true when nothing runs, waits or holds a slot / page / flight.
    bool idle() const {
        auto m = metrics();
        return !m.empty() && m["perigee:num_requests_running"] == 0 && m["perigee:num_requests_waiting"] == 0 &&
               m["perigee:slots_in_use"] == 0 && m["perigee:pages_in_use"] == 0 && m["perigee:requests_in_flight"] == 0;
    }
    // Seconds until idle(), or -1 past the deadline.
    double wait_idle(double timeout_s) const {
        const auto t0 = steady::now();
        while (since(t0) < timeout_s) {
            if (idle()) return since(t0);
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        return -1;
    }

private:
    pid_t pid_ = -1;
    int fd_ = -1, port_ = -1, status_ = 0;
    bool exited_ = false;
    std::thread reader_;
    mutable std::mutex m_;
    std::string log_;
};

// ---------------------------------------------------------------- raw streaming client
// A streamed POST on its own socket, so a test controls exactly when it reads and when it closes.
class raw_stream {
public:
    raw_stream(int port, const std::string & body_text, const std::string & path = "/v1/completions") {
        fd_ = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(uint16_t(port));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd_, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
            close(fd_);
            fd_ = -1;
            return;
        }
        const std::string & b = body_text;
        const std::string req = "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
                                std::to_string(b.size()) + "\r\nConnection: close\r\n\r\n" + b;
        if (send(fd_, req.data(), req.size(), MSG_NOSIGNAL) != ssize_t(req.size())) close_now();
    }
    ~raw_stream() { close_now(); }
    bool ok() const { return fd_ >= 0; }
    // Reads until `needle` is in the data (true), EOF or the deadline (false).
    bool read_until(const std::string & needle, double timeout_s) {
        const auto t0 = steady::now();
        while (data_.find(needle) == std::string::npos) {
            if (fd_ < 0 || eof_ || since(t0) > timeout_s) return false;
            pollfd p{fd_, POLLIN, 0};
            if (poll(&p, 1, 50) <= 0) continue;
            char buf[8192];
            const ssize_t n = recv(fd_, buf, sizeof buf, 0);
            if (n <= 0) eof_ = true;
            else data_.append(buf, size_t(n));
        }
        return true;
    }
    bool read_to_end(double timeout_s) {
        read_until(std::string(1, '\0'), timeout_s);   // never in the data: reads to EOF or the deadline
        return eof_;
    }
    void close_now() {
        if (fd_ >= 0) close(fd_);
        fd_ = -1;
    }
    const std::string & data() const { return data_; }

private:
    int fd_ = -1;
    bool eof_ = false;
    std::string data_;
};

} // namespace perigee_test
