// HTTP server tests against the deterministic mock engine (RELIABILITY §B5/§C1), in process on
// 127.0.0.1 with a tiny K3-style tokenizer (256 byte ranks + the K3 specials) written at set-up:
// stop-string hold-back, request validation, the bad-input corpus (every request its 4xx, zero
// 5xx, a canary unchanged after each), SSE framing, tool-call plumbing through the K3 output
// parser, disconnects while queued / in prefill / in decode, queue-full 503, API key, and 32
// concurrent streams without cross-talk.
#include "chat/chat.h"
#include "server/api.h"
#include "server/mock_script.h"
#include "server/server.h"
#include "server/stop_matcher.h"
#include "tokenizer/tiktoken_dir.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

using namespace perigee;
using namespace perigee::server;
namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------- tiny tokenizer fixture
std::string b64(unsigned char c) {
    static const char * t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string s;
    s += t[c >> 2];
    s += t[(c & 3) << 4];
    s += "==";
    return s;
}

std::string tiny_tokenizer_dir() {
    static std::string dir;
    if (!dir.empty()) return dir;
    dir = (fs::temp_directory_path() / ("perigee_server_tok_" + std::to_string(::getpid()))).string();
    fs::create_directories(dir);
    std::vector<int> order;
    for (int b = 0x21; b < 0x7F; ++b) order.push_back(b);
    for (int b = 0xA1; b < 0xAD; ++b) order.push_back(b);
    for (int b = 0xAE; b < 0x100; ++b) order.push_back(b);
    for (int b = 0; b < 256; ++b)
        if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
    std::ofstream m(dir + "/tiktoken.model");
    for (size_t r = 0; r < order.size(); ++r) m << b64(static_cast<unsigned char>(order[r])) << ' ' << r << '\n';
    m.close();
    const std::vector<std::pair<int, std::string>> sp = {
        {0, "[BOS]"}, {1, "[EOS]"}, {2, "<|end_of_msg|>"}, {3, "<|open|>"}, {4, "<|close|>"}, {5, "<|sep|>"},
        {6, "[start_header_id]"}, {7, "[end_header_id]"}, {9, "[EOT]"}, {254, "[UNK]"}, {255, "[PAD]"}};
    json atd = json::object();
    for (const auto & [off, name] : sp)
        atd[std::to_string(256 + off)] = {{"content", name}, {"special", name != "<|open|>" && name != "<|close|>" && name != "<|sep|>"}};
    json cfg = {{"tokenizer_class", "TikTokenTokenizer"}, {"bos_token", "[BOS]"}, {"eos_token", "[EOS]"},
                {"added_tokens_decoder", atd}};
    std::ofstream c(dir + "/tokenizer_config.json");
    c << cfg.dump(1);
    return dir;
}

struct tok_fixture {
    tok::tiktoken_dir td;
    std::unique_ptr<chat::chat_template> ct;
    tok_fixture() : td(tok::load_tiktoken_dir(tiny_tokenizer_dir())) {
        ct = std::make_unique<chat::chat_template>(chat::chat_template::detect(*td.tok, tiny_tokenizer_dir()));
    }
};
tok_fixture & fx() {
    static tok_fixture f;
    return f;
}

// ---------------------------------------------------------------- a server on a mock engine
struct test_server {
    std::unique_ptr<gen_engine> eng;
    std::unique_ptr<http_server> srv;
    int port = 0;
    explicit test_server(mock_options mo = {}, server_options so = {}) {
        mo.vocab = int(fx().td.tok->n_vocab());
        mo.eos_ids = fx().ct->stop_ids();
        mo.gen_lo = 0;
        mo.gen_hi = 94;   // printable ASCII ranks
        if (!mo.script) mo.script = make_mock_script(*fx().td.tok, *fx().ct);
        so.port = 0;
        so.served_model_name = "tiny";
        so.max_num_seqs = mo.max_num_seqs;
        so.max_queue = mo.max_queue;
        so.max_model_len = mo.max_model_len;
        so.http_threads = 64;
        eng = make_mock_engine(mo);
        srv = std::make_unique<http_server>(so, *eng, *fx().td.tok, *fx().ct);
        port = srv->start();
        // One request from this thread before any test thread exists: it also initialises the function-local
        // statics of httplib's client (read_response_line's status-line regex) here, so ThreadSanitizer sees
        // them ordered before the client threads' reads (the library is uninstrumented; see conn_server in
        // src/server/server.cpp for the same effect on the server side).
        EXPECT_EQ(get("/health").first, 200);
    }
    ~test_server() {
        srv->stop();
    }
    httplib::Client client() const {
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(30, 0);
        return c;
    }
    std::pair<int, std::string> post(const std::string & path, const std::string & body,
                                     const std::string & ctype = "application/json", httplib::Headers h = {}) const {
        auto c = client();
        auto r = c.Post(path.c_str(), h, body, ctype.c_str());
        if (!r) return {-1, "transport error: " + httplib::to_string(r.error())};
        return {r->status, r->body};
    }
    std::pair<int, std::string> get(const std::string & path, httplib::Headers h = {}) const {
        auto c = client();
        auto r = c.Get(path.c_str(), h);
        if (!r) return {-1, "transport error"};
        return {r->status, r->body};
    }
    engine_stats stats() const { return eng->stats(); }
};

// SSE body -> the data payloads, in order
std::vector<std::string> sse_data(const std::string & body) {
    std::vector<std::string> out;
    size_t p = 0;
    while (p < body.size()) {
        size_t e = body.find("\n\n", p);
        if (e == std::string::npos) e = body.size();
        std::string ev = body.substr(p, e - p);
        if (ev.rfind("data: ", 0) == 0) out.push_back(ev.substr(6));
        p = e + 2;
    }
    return out;
}

struct stream_result {
    std::string content, reasoning, finish;
    int n_finish = 0;
    bool done = false, role_first = false, same_id = true, usage = false;
    json calls = json::array();
};

stream_result parse_stream(const std::string & body, bool chat = true) {
    stream_result r;
    std::string id;
    const auto ev = sse_data(body);
    for (size_t i = 0; i < ev.size(); ++i) {
        if (ev[i] == "[DONE]") {
            r.done = i + 1 == ev.size();
            continue;
        }
        const json j = json::parse(ev[i]);
        if (id.empty()) id = j["id"];
        r.same_id &= j["id"] == id;
        if (j.contains("usage") && j["usage"].is_object()) r.usage = true;
        for (const auto & c : j["choices"]) {
            if (chat) {
                const json & d = c["delta"];
                if (i == 0) r.role_first = d.value("role", "") == "assistant";
                r.content += d.value("content", "");
                r.reasoning += d.value("reasoning_content", "");
                if (d.contains("tool_calls")) for (const auto & t : d["tool_calls"]) r.calls.push_back(t);
            } else {
                r.content += c.value("text", "");
            }
            if (!c["finish_reason"].is_null()) {
                ++r.n_finish;
                r.finish = c["finish_reason"];
            }
        }
    }
    return r;
}

// Raw socket helpers (disconnect tests and transport-level cases).
int connect_to(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}
void send_all(int fd, const std::string & s) {
    size_t off = 0;
    while (off < s.size()) {
        const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
        if (n <= 0) return;
        off += size_t(n);
    }
}
std::string http_request(const std::string & path, const std::string & body) {
    return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
           std::to_string(body.size()) + "\r\n\r\n" + body;
}
// reads until `needle` appears or timeout; returns what was read
std::string read_until(int fd, const std::string & needle, double timeout_s) {
    std::string got;
    const auto t0 = std::chrono::steady_clock::now();
    timeval tv{0, 100000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
        char buf[4096];
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n > 0) got.append(buf, size_t(n));
        if (n == 0) break;
        if (got.find(needle) != std::string::npos) break;
    }
    return got;
}

// The accept-queue limit (backlog) of the TCP socket listening on 127.0.0.1:port, read back from the kernel
// through NETLINK_SOCK_DIAG (for a listening socket inet_diag_msg.idiag_wqueue is sk_max_ack_backlog, what
// `ss -ltn` prints as Send-Q); -1 when no such socket is found, -2 when this sandbox has no sock_diag netlink.
int listen_backlog(int port) {
    const int nl = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0) return -2;
    struct {
        nlmsghdr nlh;
        inet_diag_req_v2 r;
    } req{};
    req.nlh.nlmsg_len = sizeof req;
    req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.nlh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
    req.r.sdiag_family = AF_INET;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = 1u << TCP_LISTEN;
    int backlog = -1;
    if (::send(nl, &req, sizeof req, 0) == ssize_t(sizeof req)) {
        alignas(nlmsghdr) char buf[16384];
        for (bool done = false; !done;) {
            const ssize_t n = ::recv(nl, buf, sizeof buf, 0);
            if (n <= 0) break;
            int len = int(n);
            for (auto * h = reinterpret_cast<nlmsghdr *>(buf); NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
                if (h->nlmsg_type == NLMSG_DONE || h->nlmsg_type == NLMSG_ERROR) {
                    done = true;
                    break;
                }
                const auto * m = static_cast<const inet_diag_msg *>(NLMSG_DATA(h));
                if (ntohs(m->id.idiag_sport) == port) backlog = int(m->idiag_wqueue);
            }
        }
    }
    ::close(nl);
    return backlog;
}

bool wait_for(const std::function<bool()> & pred, double timeout_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
        if (pred()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pred();
}

double metric(const std::string & text, const std::string & name) {
    const size_t p = text.find("\n" + name + " ");
    if (p == std::string::npos) return -1;
    return std::stod(text.substr(p + name.size() + 2));
}

const std::string k_tool = R"({"type":"function","function":{"name":"get_weather","description":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}})";

} // namespace

// ================================================================ stop strings
TEST(server_stop, hold_back_never_streams_a_stop_string) {
    const std::string text = "Hello there STOPX world";
    for (size_t cut = 1; cut <= 4; ++cut) {
        stop_matcher m({"STOPX", "zzz"});
        std::string out;
        for (size_t i = 0; i < text.size(); i += cut) {
            const std::string piece = m.push(text.substr(i, cut));
            out += piece;
            EXPECT_EQ(out.find("STOP"), std::string::npos) << "streamed part of the stop string: " << out;
            if (m.stopped()) break;
        }
        out += m.finish();
        EXPECT_EQ(out, "Hello there ");
        EXPECT_TRUE(m.stopped());
        EXPECT_EQ(m.matched(), "STOPX");
    }
    // held text that turns out not to be a stop is released; regex metacharacters are literal
    stop_matcher m2({"(a+)+$"});
    std::string o = m2.push("xx(a+");
    o += m2.push(")+ y");
    o += m2.finish();
    EXPECT_EQ(o, "xx(a+)+ y");
    EXPECT_FALSE(m2.stopped());
    stop_matcher m3({"END"}, /*include_stop=*/true);
    std::string o3 = m3.push("abEN");
    o3 += m3.push("Dcd");
    EXPECT_EQ(o3, "abEND");
    // control: without stop strings the text passes through (the checks above can fail)
    stop_matcher none({});
    EXPECT_EQ(none.push(text), text);
}

// ================================================================ parsing (no HTTP)
TEST(server_api, json_rules) {
    EXPECT_THROW(parse_body(""), api_error);
    EXPECT_THROW(parse_body("{\"stream\":true,\"stream\":false}"), api_error);
    EXPECT_NO_THROW(parse_body("{\"a\":{\"x\":1},\"b\":{\"x\":1}}"));   // same key in sibling objects is fine
    EXPECT_THROW(parse_body(std::string(100000, '[')), api_error);
    EXPECT_THROW(parse_body("[1]"), api_error);
    EXPECT_EQ(parse_body("{\"c\":\"a\\u0000b\"}")["c"].get<std::string>().size(), 3u);
    try {
        parse_limits lim{512, "tiny"};
        parse_chat_request(parse_body(R"({"messages":[{"role":"user","content":"x"}],"temperature":"0.5"})"), lim);
        FAIL() << "no error";
    } catch (const api_error & e) {
        EXPECT_EQ(e.status, 400);
        EXPECT_EQ(e.param, "temperature");
    }
    EXPECT_TRUE(constant_time_equal("Bearer k", "Bearer k"));
    EXPECT_FALSE(constant_time_equal("Bearer k", "Bearer K"));
    EXPECT_FALSE(constant_time_equal("Bearer k", "Bearer k "));
}

// ================================================================ endpoints
TEST(server_http, basic_endpoints_and_shapes) {
    test_server s;
    auto [hs, hb] = s.get("/health");
    EXPECT_EQ(hs, 200);
    auto [ms, mb] = s.get("/v1/models");
    ASSERT_EQ(ms, 200);
    EXPECT_EQ(json::parse(mb)["data"][0]["id"], "tiny");
    EXPECT_EQ(json::parse(mb)["data"][0]["max_model_len"], 4096);
    auto [ws, wb] = s.get("/");
    EXPECT_EQ(ws, 200);
    EXPECT_NE(wb.find("/v1/chat/completions"), std::string::npos);

    auto [cs, cb] = s.post("/v1/chat/completions", R"({"model":"tiny","messages":[{"role":"user","content":"MOCK_SAY:Hi there"}]})");
    ASSERT_EQ(cs, 200) << cb;
    const json c = json::parse(cb);
    EXPECT_EQ(c["object"], "chat.completion");
    EXPECT_EQ(c["choices"][0]["message"]["content"], "Hi there");
    EXPECT_EQ(c["choices"][0]["message"]["reasoning_content"], "thinking about it");
    EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(c["usage"]["total_tokens"].get<int>(), c["usage"]["prompt_tokens"].get<int>() + c["usage"]["completion_tokens"].get<int>());
    // thinking off: no reasoning
    auto [ns, nb] = s.post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"MOCK_SAY:Hi"}],"chat_template_kwargs":{"thinking":false}})");
    ASSERT_EQ(ns, 200) << nb;
    EXPECT_FALSE(json::parse(nb)["choices"][0]["message"].contains("reasoning_content"));

    // completions, logprobs, echo
    auto [ps, pb] = s.post("/v1/completions", R"({"prompt":"hello","max_tokens":5,"logprobs":2,"echo":true})");
    ASSERT_EQ(ps, 200) << pb;
    const json p = json::parse(pb);
    EXPECT_EQ(p["object"], "text_completion");
    EXPECT_EQ(p["choices"][0]["text"].get<std::string>().rfind("hello", 0), 0u);
    EXPECT_EQ(p["choices"][0]["logprobs"]["tokens"].size(), 5u);
    EXPECT_EQ(p["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(p["usage"]["completion_tokens"], 5);

    // tokenize / detokenize round trip, specials only where structural
    auto [ts, tb] = s.post("/tokenize", R"({"prompt":"hi<|open|>","return_token_strs":true})");
    ASSERT_EQ(ts, 200) << tb;
    const json t = json::parse(tb);
    EXPECT_EQ(t["count"], 3);
    auto [ds, db] = s.post("/detokenize", json{{"tokens", t["tokens"]}}.dump());
    ASSERT_EQ(ds, 200) << db;
    EXPECT_EQ(json::parse(db)["prompt"], "hi<|open|>");

    // metrics: Prometheus text with the gauges, counters and histograms
    auto [xs, xb] = s.get("/metrics");
    EXPECT_EQ(xs, 200);
    for (const char * n : {"perigee:num_requests_running 0", "perigee:num_requests_waiting 0", "perigee:prompt_tokens_total",
                           "perigee:generation_tokens_total", "perigee:time_to_first_token_seconds_bucket",
                           "perigee:inter_token_latency_seconds_bucket", "perigee:e2e_request_latency_seconds_count"})
        EXPECT_NE(xb.find(n), std::string::npos) << n;
}

TEST(server_http, sse_contract_and_stream_equals_nonstream) {
    test_server s;
    for (const char * prompt : {"MOCK_SAY:Hello world, streamed", "plain random prompt"}) {
        json req = {{"messages", json::array({{{"role", "user"}, {"content", prompt}}})}, {"max_tokens", 40}, {"seed", 1}};
        auto [a, ab] = s.post("/v1/chat/completions", req.dump());
        ASSERT_EQ(a, 200) << ab;
        req["stream"] = true;
        req["stream_options"] = {{"include_usage", true}};
        auto [b, bb] = s.post("/v1/chat/completions", req.dump());
        ASSERT_EQ(b, 200) << bb;
        // every frame is `data: <json>\n\n` (or a `: ping` comment)
        for (size_t p = 0; p < bb.size();) {
            const size_t e = bb.find("\n\n", p);
            ASSERT_NE(e, std::string::npos);
            const std::string ev = bb.substr(p, e - p);
            EXPECT_TRUE(ev.rfind("data: ", 0) == 0 || ev.rfind(": ping", 0) == 0) << ev;
            p = e + 2;
        }
        const stream_result r = parse_stream(bb);
        const json ns = json::parse(ab)["choices"][0];
        EXPECT_TRUE(r.role_first);
        EXPECT_TRUE(r.same_id);
        EXPECT_TRUE(r.done);
        EXPECT_TRUE(r.usage);
        EXPECT_EQ(r.n_finish, 1);
        EXPECT_EQ(r.finish, ns["finish_reason"]);
        EXPECT_EQ(r.content, ns["message"]["content"].is_null() ? "" : ns["message"]["content"].get<std::string>());
        EXPECT_EQ(r.reasoning, ns["message"].value("reasoning_content", ""));
    }
    // stop string: never streamed, finish_reason stop; control without it
    json req = {{"messages", json::array({{{"role", "user"}, {"content", "MOCK_SAY:Hello there STOPX world"}}})},
                {"stream", true}, {"stop", "STOPX"}};
    auto [st, sb] = s.post("/v1/chat/completions", req.dump());
    ASSERT_EQ(st, 200);
    EXPECT_EQ(sb.find("STOP"), std::string::npos);
    EXPECT_EQ(parse_stream(sb).content, "Hello there ");
    EXPECT_EQ(parse_stream(sb).finish, "stop");
    req.erase("stop");
    auto [st2, sb2] = s.post("/v1/chat/completions", req.dump());
    EXPECT_EQ(parse_stream(sb2).content, "Hello there STOPX world");
    // completions stream
    auto [cs, cb] = s.post("/v1/completions", R"({"prompt":"abc","max_tokens":7,"stream":true})");
    ASSERT_EQ(cs, 200);
    const auto cr = parse_stream(cb, false);
    auto [cs2, cb2] = s.post("/v1/completions", R"({"prompt":"abc","max_tokens":7})");
    EXPECT_EQ(cr.content, json::parse(cb2)["choices"][0]["text"]);
    EXPECT_EQ(cr.finish, "length");
    EXPECT_TRUE(cr.done);
}

TEST(server_http, tool_calls_round_trip) {
    test_server s;
    const std::string tools = "[" + k_tool + "]";
    // non-stream: the scripted model output goes through the K3 output parser
    auto [a, ab] = s.post("/v1/chat/completions",
                          R"({"messages":[{"role":"user","content":"MOCK_TOOL_CALL:get_weather"}],"tools":)" + tools + "}");
    ASSERT_EQ(a, 200) << ab;
    const json m = json::parse(ab)["choices"][0];
    EXPECT_EQ(m["finish_reason"], "tool_calls");
    ASSERT_EQ(m["message"]["tool_calls"].size(), 1u);
    const json call = m["message"]["tool_calls"][0];
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json::parse(R"({"city":"Paris"})"));
    // stream: tool-call deltas with index/id/type/name
    auto [b, bb] = s.post("/v1/chat/completions",
                          R"({"stream":true,"messages":[{"role":"user","content":"MOCK_TOOL_CALL:get_weather"}],"tools":)" + tools + "}");
    const auto r = parse_stream(bb);
    EXPECT_EQ(r.finish, "tool_calls");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0]["index"], 0);
    EXPECT_EQ(r.calls[0]["function"]["name"], "get_weather");
    // send the result back
    json msgs = json::array({{{"role", "user"}, {"content", "MOCK_TOOL_CALL:get_weather"}}, m["message"],
                             {{"role", "tool"}, {"tool_call_id", call["id"]}, {"content", "sunny"}}});
    msgs[1].erase("refusal");
    auto [c, cb] = s.post("/v1/chat/completions", json{{"messages", msgs}, {"tools", json::parse(tools)}}.dump());
    ASSERT_EQ(c, 200) << cb;
    EXPECT_EQ(json::parse(cb)["choices"][0]["message"]["content"], "tool result received");
    EXPECT_EQ(json::parse(cb)["choices"][0]["finish_reason"], "stop");
}

// ================================================================ bad-input corpus
TEST(server_http, bad_input_corpus) {
    mock_options mo;
    mo.max_model_len = 2048;
    test_server s(mo);
    const std::string canary_req = R"({"prompt":"canary prompt","max_tokens":8,"temperature":0})";
    auto [c0, canary] = s.post("/v1/completions", canary_req);
    ASSERT_EQ(c0, 200);
    const std::string canary_text = json::parse(canary)["choices"][0]["text"];

    struct bad { std::string path, body, ctype; int status; std::string param; };
    std::vector<bad> corpus;
    const std::string C = "/v1/chat/completions", P = "/v1/completions";
    const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
    auto chat = [&](const std::string & extra, int st = 400, std::string param = "") {
        corpus.push_back({C, "{" + msgs + "," + extra + "}", "application/json", st, param});
    };
    auto comp = [&](const std::string & extra, int st = 400, std::string param = "") {
        corpus.push_back({P, R"({"prompt":"hi",)" + extra + "}", "application/json", st, param});
    };
    auto raw = [&](const std::string & path, const std::string & body, int st = 400) {
        corpus.push_back({path, body, "application/json", st, ""});
    };
    // H-10 / H-11 / H-12 / H-13 syntax
    raw(C, "");
    raw(C, "{");
    raw(C, R"({"messages":[],})");
    raw(C, "{/*c*/\"messages\":[]}");
    raw(C, R"({"temperature":NaN})");
    raw(C, R"({"temperature":Infinity})");
    raw(C, R"({"stream":true,"stream":false,"messages":[{"role":"user","content":"x"}]})");
    for (const char * b : {"\"string\"", "[1,2]", "42", "null", "true"}) raw(C, b);
    raw(C, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}");
    raw(C, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xc0\xaf\"}]}");
    raw(C, "{\"messages\":[{\"role\":\"user\",\"content\":\"\xed\xa0\xbd\"}]}");
    raw(C, R"({"messages":[{"role":"user","content":"\ud83d"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"\ude00"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"\ude00\ud83d"}]})");
    raw(C, std::string(100000, '['));
    raw(C, "{\"messages\":" + std::string(70, '[') + std::string(70, ']') + "}");
    // H-14 numbers
    chat(R"("max_tokens":1e309)");
    chat(R"("max_tokens":18446744073709551616)", 400, "max_tokens");
    chat(R"("max_tokens":1.5)", 400, "max_tokens");
    chat(R"("max_tokens":1.0)", 400, "max_tokens");
    // H-15 types
    raw(C, R"({"messages":null})");
    raw(C, R"({"messages":"str"})");
    raw(C, R"({"messages":[123]})");
    raw(C, R"({"messages":[{}]})");
    raw(C, R"({"messages":[{"role":123,"content":"x"}]})");
    raw(C, R"({"messages":[{"role":"user","content":123}]})");
    raw(C, R"({"messages":[{"role":"user","content":{}}]})");
    chat(R"("stream":"true")", 400, "stream");
    chat(R"("temperature":"0.5")", 400, "temperature");
    chat(R"("stop":5)", 400, "stop");
    chat(R"("tools":{})", 400, "tools");
    // H-16 unknown / unsupported
    chat(R"("foo":1)", 400, "foo");
    chat(R"("n":2)", 400, "n");
    chat(R"("audio":{"voice":"x"})", 400, "audio");
    chat(R"("modalities":["audio"])", 400, "modalities");
    chat(R"("prediction":{"type":"content","content":"x"})", 400, "prediction");
    chat(R"("prompt_embeds":"AAAA")", 400, "prompt_embeds");
    chat(R"("functions":[])", 400, "functions");
    chat(R"("logit_bias":{"1":5})", 400, "logit_bias");
    chat(R"("min_tokens":3)", 400, "min_tokens");
    // H-20 / H-21 messages
    raw(C, R"({"messages":[]})");
    raw(C, R"({"messages":[{"content":"x"}]})");
    raw(C, R"({"messages":[{"role":"robot","content":"x"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"assistant","content":"c"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]})");
    raw(C, R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x"}}]}]})");
    raw(C, R"({"messages":[{"role":"user","content":[{"type":"sound"}]}]})");
    raw(C, R"({"messages":[{"role":"user","content":[42]}]})");
    raw(C, R"({"messages":[{"role":"user"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"x","weird":1}]})");
    // H-22 context
    chat(R"("max_tokens":2000)", 400, "max_tokens");
    chat(R"("max_completion_tokens":2000)", 400, "max_completion_tokens");
    chat(R"("max_tokens":2000,"stream":true)", 400, "max_tokens");
    raw(C, json{{"messages", json::array({{{"role", "user"}, {"content", std::string(3000, 'a')}}})}}.dump());
    raw(P, json{{"prompt", std::string(3000, 'a')}}.dump());
    // H-23 max tokens
    for (const char * v : {"0", "-1", "-10", "\"10\"", "2147483648", "9223372036854775808"}) chat(std::string("\"max_tokens\":") + v, 400, "max_tokens");
    chat(R"("max_completion_tokens":0)", 400, "max_completion_tokens");
    // H-24 n
    for (const char * v : {"0", "-1", "8"}) chat(std::string("\"n\":") + v, 400, "n");
    // H-25 sampling bounds
    for (const char * kv : {R"("temperature":-0.1)", R"("temperature":2.01)", R"("top_p":0)", R"("top_p":1.01)", R"("top_k":-2)",
                            R"("min_p":-0.1)", R"("min_p":1.5)", R"("frequency_penalty":2.5)", R"("frequency_penalty":-2.5)",
                            R"("presence_penalty":3)", R"("presence_penalty":-3)", R"("repetition_penalty":0)",
                            R"("repetition_penalty":-1)", R"("seed":-1)", R"("seed":18446744073709551616)", R"("seed":1.5)"})
        chat(kv);
    // H-26 logit_bias
    chat(R"("logit_bias":[1])", 400, "logit_bias");
    // H-27 logprobs
    chat(R"("logprobs":true,"top_logprobs":21)", 400, "top_logprobs");
    chat(R"("logprobs":true,"top_logprobs":-1)", 400, "top_logprobs");
    chat(R"("top_logprobs":3)", 400, "top_logprobs");
    chat(R"("logprobs":"yes")", 400, "logprobs");
    comp(R"("logprobs":6)", 400, "logprobs");
    // H-28 stop
    chat(R"("stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"])", 400, "stop");
    chat(R"("stop":"")", 400, "stop");
    chat("\"stop\":\"" + std::string(100 * 1024, 'x') + "\"", 400, "stop");
    chat(R"("stop":[1])", 400, "stop[0]");
    chat(R"("stop_token_ids":[100000])", 400, "stop_token_ids[0]");
    chat(R"("stop_token_ids":[-1])", 400, "stop_token_ids[0]");
    // H-29 completions prompts
    raw(P, R"({"prompt":[]})");
    raw(P, R"({"prompt":[-1]})");
    raw(P, R"({"prompt":[100000]})");
    raw(P, R"({"prompt":["a","b"]})");
    raw(P, R"({"prompt":42})");
    raw(P, R"({"prompt":""})");
    raw(P, R"({"max_tokens":3})");
    comp(R"("suffix":"x")", 400, "suffix");
    comp(R"("best_of":2)", 400, "best_of");
    comp(R"("echo":"yes")", 400, "echo");
    // H-30 response_format
    chat(R"("response_format":{"type":"sound"})", 400, "response_format.type");
    chat(R"("response_format":{"type":"json_schema"})", 400, "response_format.json_schema");
    chat(R"("response_format":{"type":"json_schema","json_schema":{"name":"x","schema":5}})", 400, "response_format.json_schema.schema");
    chat(R"("response_format":"json")", 400, "response_format");
    // H-31 tools
    chat(R"("tools":[{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"a"}}])", 400, "tools[1].function.name");
    chat("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"" + std::string(1024, 'a') + "\"}}]", 400, "tools[0].function.name");
    chat(R"("tools":[{"type":"function","function":{"name":"a","parameters":5}}])", 400, "tools[0].function.parameters");
    chat(R"("tools":[{"type":"function","function":{"name":"a","parameters":{"type":5}}}])", 400, "tools[0].function.parameters.type");
    chat(R"("tools":[{"type":"retrieval"}])", 400, "tools[0].type");
    chat(R"("tools":[)" + k_tool + R"(],"tool_choice":{"type":"function","function":{"name":"nope"}})", 400, "tool_choice.function.name");
    chat(R"("tool_choice":"required")", 400, "tool_choice");
    chat(R"("tool_choice":"sometimes","tools":[)" + k_tool + "]", 400, "tool_choice");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"tool","content":"r"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"zz","content":"r"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{}}}]},{"role":"user","content":"b"}]})");
    raw(C, R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{bad"}}]},{"role":"user","content":"b"}]})");
    // H-32 template overrides
    chat(R"("chat_template":"{{x}}")", 400, "chat_template");
    chat(R"("chat_template_kwargs":{"foo":1})", 400, "chat_template_kwargs.foo");
    chat(R"("chat_template_kwargs":{"thinking":"yes"})", 400, "chat_template_kwargs.thinking");
    chat(R"("chat_template_kwargs":{"thinking_effort":"extreme"})", 400, "chat_template_kwargs.thinking_effort");
    chat(R"("add_generation_prompt":false)", 400, "add_generation_prompt");
    chat(R"("reasoning_effort":"huge")", 400, "reasoning_effort");
    chat(R"("thinking":{"type":"maybe"})", 400, "thinking.type");
    // H-33 model
    chat(R"("model":"gpt-4")", 404, "model");
    chat(R"("model":5)", 400, "model");
    // H-34
    chat(R"("stream_options":{"include_usage":true})", 400, "stream_options");
    chat(R"("stream":true,"stream_options":{"include_usage":"yes"})", 400, "stream_options.include_usage");
    chat(R"("stream":true,"stream_options":{"continuous_usage_stats":true})", 400, "stream_options.continuous_usage_stats");
    // content type (H-05), methods and routes (H-04)
    corpus.push_back({C, "{" + msgs + "}", "text/plain", 415, ""});
    corpus.push_back({C, "messages=x", "application/x-www-form-urlencoded", 415, ""});
    corpus.push_back({"/v1/nothing", "{}", "application/json", 404, ""});
    // tokenize / detokenize
    raw("/tokenize", R"({"text":"x"})");
    raw("/tokenize", R"({})");
    raw("/detokenize", R"({"tokens":[1,"a"]})");
    raw("/detokenize", R"({"tokens":[99999]})");
    raw("/detokenize", R"({"tokens":5})");

    ASSERT_GE(corpus.size(), 100u);
    int n5xx = 0;
    for (size_t i = 0; i < corpus.size(); ++i) {
        const bad & b = corpus[i];
        auto [st, body] = s.post(b.path, b.body, b.ctype);
        EXPECT_EQ(st, b.status) << "case " << i << ": " << b.body.substr(0, 200) << " -> " << body;
        if (st >= 500 || st < 0) ++n5xx;
        if (st >= 400) {
            json e = json::parse(body, nullptr, false);
            ASSERT_FALSE(e.is_discarded()) << "case " << i << " error body is not JSON: " << body;
            ASSERT_TRUE(e.contains("error")) << body;
            for (const char * k : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(k)) << k << " in " << body;
            if (!b.param.empty()) {
                EXPECT_EQ(e["error"]["param"], b.param) << "case " << i << ": " << body;
            }
        }
        auto [cs, cb] = s.post("/v1/completions", canary_req);
        ASSERT_EQ(cs, 200) << "canary after case " << i;
        EXPECT_EQ(json::parse(cb)["choices"][0]["text"], canary_text) << "canary changed after case " << i;
    }
    EXPECT_EQ(n5xx, 0);
    // methods
    EXPECT_EQ(s.get("/v1/chat/completions").first, 405);
    EXPECT_EQ(s.post("/health", "{}").first, 405);
    // accepted edge cases: NUL kept, valid surrogate pair, empty text part, ignored fields, 200 inside bounds
    for (const std::string & ok : std::vector<std::string>{R"({"messages":[{"role":"user","content":"a\u0000b"}],"max_tokens":2})",
                                 R"({"messages":[{"role":"user","content":"\ud83d\ude00"}],"max_tokens":2})",
                                 R"({"messages":[{"role":"user","content":[{"type":"text"}]}],"max_tokens":2})",
                                 R"({"messages":[{"role":"developer","content":"sys"},{"role":"user","content":"x"}],"max_tokens":2,"user":"u","metadata":{"a":"b"},"store":false,"parallel_tool_calls":true})",
                                 R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"temperature":2,"top_p":1,"top_k":-1,"min_p":1,"presence_penalty":-2,"frequency_penalty":2,"seed":18446744073709551615,"n":1})",
                                 R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"logprobs":true,"top_logprobs":20})",
                                 R"({"model":"","messages":[{"role":"user","content":"x"}],"max_completion_tokens":2,"max_tokens":99999})",
                                 R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"response_format":{"type":"json_object"}})",
                                 R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"reasoning_effort":"medium"})",
                                 R"({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tools":[)" + k_tool + R"(],"tool_choice":{"type":"function","function":{"name":"get_weather"}}})"}) {
        auto [st, body] = s.post(C, ok);
        EXPECT_EQ(st, 200) << ok << " -> " << body;
    }
    auto [nst, nbody] = s.post(C, R"({"messages":[{"role":"user","content":"MOCK_SAY:a"}],"max_tokens":50})");
    EXPECT_EQ(nst, 200) << nbody;
    EXPECT_EQ(s.stats().running, 0);
}

TEST(server_http, transport_limits) {
    server_options so;
    so.max_body_bytes = 1 << 16;
    test_server s({}, so);
    auto [st, body] = s.post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"" + std::string(1 << 17, 'a') + "\"}]}");
    EXPECT_EQ(st, 413) << body;
    // a header block over 8 KiB: refused or closed, never served
    const int fd = connect_to(s.port);
    ASSERT_GE(fd, 0);
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(9000, 'a') + "\r\n\r\n");
    const std::string got = read_until(fd, "\r\n\r\n", 3);
    ::close(fd);
    EXPECT_EQ(got.find("200 OK"), std::string::npos) << got.substr(0, 100);
    // keep-alive: 100 sequential requests on one connection
    auto c = s.client();
    c.set_keep_alive(true);
    for (int i = 0; i < 100; ++i) {
        auto r = c.Get("/health");
        ASSERT_TRUE(r);
        ASSERT_EQ(r->status, 200);
    }
    EXPECT_EQ(s.get("/health").first, 200);
}

// 32 clients opening connections while the accept thread waits for a core overflowed httplib's default backlog
// of 5 (ListenOverflows in /proc/net/netstat; in one CI run handshakes stalled past the client's 30 s read
// timeout). The server listens with SOMAXCONN; the control is a plain httplib::Server, which must read back 5,
// so the kernel query is shown able to see a short queue.
TEST(server_http, listen_backlog_is_somaxconn) {
    test_server s;
    const int backlog = listen_backlog(s.port);
    if (backlog == -2) GTEST_SKIP() << "no NETLINK_SOCK_DIAG socket here: " << std::strerror(errno);
    int somaxconn = SOMAXCONN;
    std::ifstream("/proc/sys/net/core/somaxconn") >> somaxconn;
    EXPECT_EQ(backlog, std::min(SOMAXCONN, somaxconn));
    httplib::Server plain;
    const int p = plain.bind_to_any_port("127.0.0.1");
    ASSERT_GT(p, 0);
    EXPECT_EQ(listen_backlog(p), 5) << "control: httplib's own backlog";
}

TEST(server_http, api_key) {
    server_options so;
    so.api_key = "sekret-Key";
    test_server s({}, so);
    const std::string body = R"({"prompt":"x","max_tokens":2})";
    for (const std::string h : {"", "Bearer wrong", "Basic c2VrcmV0LUtleQ==", "Bearer sekret-key", "Bearer  sekret-Key", "Bearer sekret-Ke", "sekret-Key"}) {
        // (a trailing space is optional whitespace in HTTP, not part of the header value)
        httplib::Headers hd;
        if (!h.empty()) hd.emplace("Authorization", h);
        auto [st, b] = s.post("/v1/completions", body, "application/json", hd);
        EXPECT_EQ(st, 401) << "'" << h << "'";
        EXPECT_EQ(json::parse(b)["error"]["type"], "authentication_error");
        EXPECT_EQ(b.find("sekret"), std::string::npos) << "the key leaked into an error";
    }
    EXPECT_EQ(s.post("/v1/completions", body, "application/json", {{"Authorization", "Bearer sekret-Key"}}).first, 200);
    EXPECT_EQ(s.post("/v1/completions", body, "application/json", {{"x-api-key", "sekret-Key"}}).first, 200);
    EXPECT_EQ(s.get("/v1/models").first, 401);
    EXPECT_EQ(s.get("/health").first, 200);    // public by design
    EXPECT_EQ(s.get("/metrics").first, 200);   // public by design
}

TEST(server_http, queue_full_is_503_with_retry_after) {
    mock_options mo;
    mo.max_num_seqs = 1;
    mo.max_queue = 1;
    mo.decode_s_per_token = 0.05;
    test_server s(mo);
    std::vector<std::thread> th;
    std::vector<int> holder_status(2, -1);
    auto hold = [&](int i) {
        th.emplace_back([&, i] {
            holder_status[i] = s.post("/v1/completions", json{{"prompt", "busy " + std::to_string(i)}, {"max_tokens", 200}}.dump()).first;
        });
    };
    // The holders go in one after the other: the second is posted only once the first is running. Posted together, the
    // second could find the first still in the one-entry queue and be refused itself (seen once in a clean-clone CI run on
    // a loaded machine: holder statuses 200, 503). Each holder decodes for ~10 s, so both are in the engine together for
    // ~10 s even when a post is late (TSan's slowdown on a loaded 2-core machine). No speed is asserted.
    hold(0);
    const bool first_running = wait_for([&] { return s.stats().running == 1; }, 20);
    if (first_running) hold(1);
    const bool busy = first_running && wait_for([&] { return s.stats().running == 1 && s.stats().waiting == 1; }, 20);
    const int run_seen = s.stats().running, wait_seen = s.stats().waiting;
    if (!busy)
        for (auto & t : th) t.join();   // (leaving with joinable threads would terminate the test binary)
    ASSERT_TRUE(busy) << "running " << run_seen << ", waiting " << wait_seen << " after 20 s; holder statuses "
                      << holder_status[0] << ", " << holder_status[1];
    auto c = s.client();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c.Post("/v1/completions", R"({"prompt":"x","max_tokens":2})", "application/json");
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503);
    EXPECT_EQ(r->get_header_value("Retry-After"), "1");
    // refused at once, not queued behind the holders: answered well before the running holder (~10 s) could finish
    EXPECT_LT(dt, 5.0);
    for (auto & t : th) t.join();
    EXPECT_EQ(holder_status[0], 200);
    EXPECT_EQ(holder_status[1], 200);
    EXPECT_EQ(s.post("/v1/completions", R"({"prompt":"x","max_tokens":2})").first, 200);
}

// ================================================================ disconnects
namespace {
void expect_freed(test_server & s, const char * phase) {
    EXPECT_TRUE(wait_for([&] { return s.stats().running == 0 && s.stats().waiting == 0; }, 1.0))
        << phase << ": running " << s.stats().running << ", waiting " << s.stats().waiting << " after 1 s";
    auto [st, m] = s.get("/metrics");
    EXPECT_EQ(metric(m, "perigee:num_requests_running"), 0) << phase;
    EXPECT_EQ(metric(m, "perigee:num_requests_waiting"), 0) << phase;
    // the next request is unaffected
    auto [a, b] = s.post("/v1/completions", R"({"prompt":"after","max_tokens":3})");
    EXPECT_EQ(a, 200) << phase << ": " << b;
}
}   // namespace

TEST(server_disconnect, decode_prefill_queued_stream_and_nonstream) {
    mock_options mo;
    mo.max_num_seqs = 1;
    mo.decode_s_per_token = 0.05;
    mo.prefill_s_per_token = 0.0;
    test_server s(mo);
    for (bool stream : {true, false}) {
        // decode: read the first token, then close
        int fd = connect_to(s.port);
        send_all(fd, http_request("/v1/completions", json{{"prompt", "decode"}, {"max_tokens", 1000}, {"stream", stream}}.dump()));
        if (stream) EXPECT_NE(read_until(fd, "\"text\"", 3).find("\"text\""), std::string::npos);
        else ASSERT_TRUE(wait_for([&] { return s.stats().running == 1; }, 2));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        ::close(fd);
        expect_freed(s, stream ? "decode (stream)" : "decode (non-stream)");
    }
    {
        // queued: one request holds the only slot; a second waits, then disconnects
        int hold = connect_to(s.port);
        send_all(hold, http_request("/v1/completions", json{{"prompt", "holder"}, {"max_tokens", 1000}, {"stream", true}}.dump()));
        ASSERT_TRUE(wait_for([&] { return s.stats().running == 1; }, 2));
        int fd = connect_to(s.port);
        send_all(fd, http_request("/v1/completions", json{{"prompt", "queued"}, {"max_tokens", 10}, {"stream", true}}.dump()));
        ASSERT_TRUE(wait_for([&] { return s.stats().waiting == 1; }, 2));
        ::close(fd);
        EXPECT_TRUE(wait_for([&] { return s.stats().waiting == 0; }, 1.0)) << "queued request not removed within 1 s";
        EXPECT_EQ(s.stats().running, 1);
        ::close(hold);
        expect_freed(s, "queued");
    }
    auto [m0s, m0] = s.get("/metrics");
    EXPECT_GE(metric(m0, "perigee:requests_cancelled_total"), 3);
}

TEST(server_disconnect, prefill) {
    mock_options mo;
    mo.prefill_s_per_token = 0.02;   // a ~380-token chat prompt: ~7 s of "prefill"
    test_server s(mo);
    for (bool stream : {true, false}) {
        int fd = connect_to(s.port);
        send_all(fd, http_request("/v1/chat/completions",
                                  json{{"messages", json::array({{{"role", "user"}, {"content", "long prefill"}}})}, {"stream", stream}}.dump()));
        ASSERT_TRUE(wait_for([&] { return s.stats().running == 1; }, 2));
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ::close(fd);
        expect_freed(s, stream ? "prefill (stream)" : "prefill (non-stream)");
    }
}

// The disconnect probe watches the request's own connection (the fd httplib processes it on, not one found by
// address): a later request on a keep-alive connection is watched too, and the first one's probing did not
// disturb the connection.
TEST(server_disconnect, second_request_on_a_keep_alive_connection) {
    mock_options mo;
    mo.max_num_seqs = 1;
    mo.decode_s_per_token = 0.05;
    test_server s(mo);
    for (bool stream : {true, false}) {
        const int fd = connect_to(s.port);
        ASSERT_GE(fd, 0);
        send_all(fd, http_request("/v1/completions", json{{"prompt", "first"}, {"max_tokens", 2}}.dump()));
        const std::string first = read_until(fd, "total_tokens", 5);
        EXPECT_EQ(first.rfind("HTTP/1.1 200", 0), 0u) << first.substr(0, 200);
        EXPECT_EQ(first.find("Connection: close"), std::string::npos) << "the server closed the keep-alive connection";
        send_all(fd, http_request("/v1/completions", json{{"prompt", "second"}, {"max_tokens", 1000}, {"stream", stream}}.dump()));
        if (stream) EXPECT_NE(read_until(fd, "data: ", 3).find("data: "), std::string::npos);
        else ASSERT_TRUE(wait_for([&] { return s.stats().running == 1; }, 3));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        ::close(fd);
        expect_freed(s, stream ? "keep-alive, second request (stream)" : "keep-alive, second request (non-stream)");
    }
}

TEST(server_http, sse_pings_while_waiting) {
    mock_options mo;
    mo.prefill_s_per_token = 0.004;
    server_options so;
    so.ping_interval_s = 0.2;
    test_server s(mo, so);
    auto [st, body] = s.post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"MOCK_SAY:pong"}],"stream":true})");
    ASSERT_EQ(st, 200);
    EXPECT_NE(body.find(": ping\n\n"), std::string::npos);
    EXPECT_EQ(parse_stream(body).content, "pong");
}

// ================================================================ concurrency
TEST(server_concurrency, streams_32_no_cross_talk) {
    mock_options mo;
    mo.max_num_seqs = 8;
    mo.decode_s_per_token = 0.002;
    test_server s(mo);
    const int N = 32;
    const double budget_s = std::getenv("PERIGEE_SERVER_SOAK_S") ? std::atof(std::getenv("PERIGEE_SERVER_SOAK_S")) : 4.0;
    std::vector<std::string> alone(N);
    for (int i = 0; i < N; ++i) {
        auto [st, b] = s.post("/v1/completions", json{{"prompt", "stream " + std::to_string(i)}, {"max_tokens", 48}}.dump());
        ASSERT_EQ(st, 200);
        alone[size_t(i)] = json::parse(b)["choices"][0]["text"];
    }
    std::atomic<int> failures{0}, rounds{0}, transport_retries{0};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int i = 0; i < N; ++i) {
        th.emplace_back([&, i] {
            do {
                const bool chat = rounds.load() % 2 == 1;
                auto once = [&] {
                    return chat ? s.post("/v1/chat/completions", json{{"messages", json::array({{{"role", "user"}, {"content", "MOCK_SAY:hello " + std::to_string(i)}}})}, {"stream", true}}.dump())
                                : s.post("/v1/completions", json{{"prompt", "stream " + std::to_string(i)}, {"max_tokens", 48}, {"stream", true}}.dump());
                };
                auto [st, b] = once();
                if (st == -1) {   // client-side connect/read failure under CPU starvation (2 shared cores): one retry, counted
                    std::fprintf(stderr, "stream %d: %s; retrying once\n", i, b.c_str());
                    ++transport_retries;
                    std::tie(st, b) = once();
                }
                const auto r = parse_stream(b, chat);
                const std::string want = chat ? "hello " + std::to_string(i) : alone[size_t(i)];
                if (st != 200 || !r.done || r.n_finish != 1 || r.content != want) {
                    if (++failures <= 3)
                        ADD_FAILURE() << "stream " << i << (chat ? " (chat)" : " (completions)") << ": status " << st
                                      << ", done " << r.done << ", finishes " << r.n_finish << ", got '" << r.content
                                      << "' want '" << want << "'; body: " << b.substr(0, 300);
                }
                ++rounds;
            } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < budget_s);
        });
    }
    for (auto & t : th) t.join();
    EXPECT_EQ(failures.load(), 0) << "of " << rounds.load() << " streams";
    EXPECT_GE(rounds.load(), N);
    EXPECT_LE(transport_retries.load() * 50, rounds.load()) << transport_retries.load() << " transport retries";
    expect_freed(s, "after the concurrent streams");
}
