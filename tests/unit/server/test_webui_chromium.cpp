// The built-in web chat page (GET /) in headless Chromium, driven through chromedriver's W3C
// WebDriver HTTP API: `perigee serve` on 127.0.0.1 with the shipped default model, the page typed
// into and sent like a user would, the answer observed while it streams (a MutationObserver counts
// the content updates), and a screenshot kept at <build>/tests/unit/server/webui_chromium/answer.png.
// Skipped (with the reason) when chromium / chromedriver (scripts/install-server-test-deps.sh) or
// models/default are absent. Flags per ECOSYSTEM: --headless --no-sandbox --disable-gpu
// --disable-quic --no-first-run --disable-background-networking --disable-component-update
// --disable-sync and a fresh --user-data-dir.
#include "serve_helpers.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace perigee_test;

namespace {

std::string which(const char * name) {
    const char * path = std::getenv("PATH");
    std::stringstream ss(path ? path : "/usr/bin:/bin");
    std::string d;
    while (std::getline(ss, d, ':')) {
        const fs::path p = fs::path(d) / name;
        if (fs::exists(p) && access(p.c_str(), X_OK) == 0) return p.string();
    }
    return "";
}

int free_port() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a);
    socklen_t l = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr *>(&a), &l);
    close(fd);
    return ntohs(a.sin_port);
}

std::string b64decode(const std::string & s) {
    auto val = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+') return 62;
        if (c == '/') return 63;
        return -1;
    };
    std::string out;
    int buf = 0, bits = 0;
    for (char c : s) {
        const int v = val(c);
        if (v < 0) continue;
        buf = (buf << 6) | v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out += char((buf >> bits) & 0xFF);
        }
    }
    return out;
}

// chromedriver as a child process on a loopback port.
class driver_proc {
public:
    explicit driver_proc(const std::string & bin) : port_(free_port()) {
        pid_ = fork();
        if (pid_ == 0) {
            const int devnull = open("/dev/null", O_RDWR);
            dup2(devnull, 0);
            dup2(devnull, 1);
            dup2(devnull, 2);
            const std::string port = "--port=" + std::to_string(port_);
            execl(bin.c_str(), bin.c_str(), port.c_str(), "--allowed-ips=127.0.0.1", static_cast<char *>(nullptr));
            _exit(127);
        }
    }
    ~driver_proc() {
        kill(pid_, SIGTERM);
        int st = 0;
        waitpid(pid_, &st, 0);
    }
    int port() const { return port_; }

private:
    pid_t pid_ = -1;
    int port_ = 0;
};

class webdriver {
public:
    explicit webdriver(int port) : c_("127.0.0.1", port) {
        c_.set_read_timeout(60, 0);
        c_.set_connection_timeout(2, 0);
    }
    bool wait_ready(double timeout_s) {
        const auto t0 = steady::now();
        while (since(t0) < timeout_s) {
            auto r = c_.Get("/status");
            if (r && r->status == 200 && r->body.find("\"ready\":true") != std::string::npos) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return false;
    }
    json call(const std::string & method, const std::string & path, const json & body = json::object()) {
        httplib::Result r = method == "GET" ? c_.Get(path.c_str())
                          : method == "DELETE" ? c_.Delete(path.c_str())
                                               : c_.Post(path.c_str(), body.dump(), "application/json");
        if (!r) throw std::runtime_error("webdriver " + method + " " + path + ": " + httplib::to_string(r.error()));
        const json j = json::parse(r->body, nullptr, false);
        if (r->status != 200 || j.is_discarded())
            throw std::runtime_error("webdriver " + method + " " + path + ": HTTP " + std::to_string(r->status) + " " + r->body.substr(0, 500));
        return j["value"];
    }
    std::string session(const std::string & chromium, const std::string & user_data) {
        const json caps = {{"capabilities", {{"alwaysMatch", {{"browserName", "chrome"},
            {"goog:chromeOptions", {{"binary", chromium},
                                    {"args", {"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                                              "--disable-background-networking", "--disable-component-update", "--disable-sync",
                                              "--disable-dev-shm-usage", "--window-size=1000,700",
                                              "--user-data-dir=" + user_data}}}}}}}}};
        sid_ = call("POST", "/session", caps)["sessionId"].get<std::string>();
        return sid_;
    }
    json s(const std::string & method, const std::string & path, const json & body = json::object()) {
        return call(method, "/session/" + sid_ + path, body);
    }
    json exec(const std::string & script) { return s("POST", "/execute/sync", {{"script", script}, {"args", json::array()}}); }
    std::string element(const std::string & css) {
        const json e = s("POST", "/element", {{"using", "css selector"}, {"value", css}});
        return e.begin().value().get<std::string>();   // {"element-6066-...": id}
    }
    ~webdriver() {
        if (!sid_.empty()) {
            try {
                s("DELETE", "");
            } catch (...) {
            }
        }
    }

private:
    httplib::Client c_;
    std::string sid_;
};

} // namespace

TEST(webui_chromium, send_a_message_and_see_a_streamed_answer) {
    const std::string chromium = which("chromium"), chromedriver = which("chromedriver");
    if (chromium.empty() || chromedriver.empty())
        GTEST_SKIP() << "chromium / chromedriver not installed (Debian chromium chromium-driver; scripts/install-server-test-deps.sh)";
    const std::string model = std::string(PERIGEE_REPO_ROOT) + "/models/default";
    if (!fs::exists(model + "/tiktoken.model")) GTEST_SKIP() << "models/default is not in this checkout";
    const fs::path out = fs::path(PERIGEE_TEST_OUT_DIR) / "webui_chromium";
    fs::create_directories(out);
    const fs::path profile = fs::temp_directory_path() / ("perigee_chromium_" + std::to_string(getpid()));
    fs::remove_all(profile);

    serve_proc srv(model, {"--max-num-seqs", "2", "--max-model-len", "1024"});
    driver_proc drv(chromedriver);
    webdriver wd(drv.port());
    ASSERT_TRUE(wd.wait_ready(30)) << "chromedriver did not start";
    wd.session(chromium, profile.string());
    wd.s("POST", "/url", {{"url", "http://127.0.0.1:" + std::to_string(srv.port()) + "/"}});
    EXPECT_EQ(wd.exec("return document.title;"), "Perigee chat");
    // count the answer's content updates as they arrive
    wd.exec("window.__updates = [];"
            "new MutationObserver(() => { const c = document.querySelector('.assistant .content');"
            "  if (c && c.textContent.length && window.__updates[window.__updates.length - 1] !== c.textContent.length)"
            "    window.__updates.push(c.textContent.length); })"
            ".observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});");
    // type and send like a user
    const std::string input = wd.element("#input");
    wd.s("POST", "/element/" + input + "/value", {{"text", "Good morrow, who art thou?"}});
    wd.s("POST", "/element/" + wd.element("#send") + "/click");
    std::string meta;
    const auto t0 = steady::now();
    while (since(t0) < 90) {
        const json m = wd.exec("const m = document.querySelector('.assistant .meta, .error .meta'); return m ? m.textContent : '';");
        meta = m.is_string() ? m.get<std::string>() : "";
        if (!meta.empty()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const std::string png = b64decode(wd.s("GET", "/screenshot").get<std::string>());
    {
        std::ofstream f(out / "answer.png", std::ios::binary);
        f << png;
    }
    std::fprintf(stderr, "[webui] screenshot: %s (%zu bytes); meta: %s\n", (out / "answer.png").c_str(), png.size(), meta.c_str());
    ASSERT_EQ(meta.rfind("finish: ", 0), 0u) << "the answer did not finish: '" << meta << "'\n" << srv.log();
    const std::string answer = wd.exec("return document.querySelector('.assistant .content').textContent;").get<std::string>();
    const json updates = wd.exec("return window.__updates;");
    EXPECT_GT(answer.size(), 5u) << answer;
    EXPECT_EQ(answer.find("\xEF\xBF\xBD"), std::string::npos) << answer;
    EXPECT_EQ(answer.find("<|"), std::string::npos) << "markers leaked into the answer: " << answer;
    EXPECT_GE(updates.size(), 2u) << "the answer did not arrive in pieces (not streamed?): " << updates.dump();
    EXPECT_EQ(png.rfind("\x89PNG", 0), 0u) << "the screenshot is not a PNG";
    EXPECT_EQ(wd.exec("return document.querySelector('.user').textContent;"), "Good morrow, who art thou?");
    fs::remove_all(profile);
}
