// Fault drills (issue 9 item 4) against a real `perigee serve` process on 127.0.0.1 with the real
// engine on a tiny synthetic checkpoint (`perigee synth --preset k3-tiny-v512` + a 256-byte K3-style
// tokenizer written here). Each drill asserts that only the faulty request fails and that the
// server stays healthy with its pools back to baseline (per /metrics):
//  * NaN injected into one sequence's logits (the hidden TEST-ONLY flag --test-nan-token, see
//    src/server/fault_drill.h): that request fails with an error (streamed: an in-stream error
//    object; non-streamed: 500 naming non-finite logits), the others are unaffected (text and
//    tokens bitwise equal to the same requests run alone, greedy; logprobs within 1e-4, see output_diff);
//  * admission beyond capacity: 503 + Retry-After naming the full queue; a prompt beyond the
//    context: 400 context_length_exceeded;
//  * a disconnect storm: 200 streams closed by the client mid-stream; slots and pages back to zero
//    within 2 s;
//  * SIGTERM with streams in flight: graceful drain (503 to /health and new requests, every
//    accepted stream ends with finish_reason + [DONE], exit 0); and past --drain-timeout the
//    remaining streams end with an in-stream error, exit 0.
// Bounded: every wait has a deadline; only loopback sockets.
#include "serve_helpers.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <csignal>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <thread>

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace perigee_test;

namespace {

// ---------------------------------------------------------------- model fixture
std::string b64(unsigned char c) {
    static const char * t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    return {t[c >> 2], t[(c & 3) << 4], '=', '='};
}

// k3-tiny-v512 weights + a tokenizer of the 256 bytes (GPT-2 byte order) and the K3 specials at
// 256.. (same as tests/e2e-server/make_tiny_tokenizer.py).
struct dir_cleanup {
    std::string dir;
    ~dir_cleanup() {
        if (!dir.empty()) fs::remove_all(dir);
    }
};

const std::string & model_dir() {
    static std::string dir;
    static dir_cleanup cleanup;
    if (!dir.empty()) return dir;
    dir = (fs::temp_directory_path() / ("perigee_drills_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir);
    const std::string cmd = std::string("'") + PERIGEE_BIN + "' synth --preset k3-tiny-v512 --out '" + dir + "' > /dev/null";
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("perigee synth failed: " + cmd);
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
    std::ofstream c(dir + "/tokenizer_config.json");
    c << json{{"tokenizer_class", "TikTokenTokenizer"}, {"bos_token", "[BOS]"}, {"eos_token", "[EOS]"}, {"added_tokens_decoder", atd}}.dump(1);
    cleanup.dir = dir;
    return dir;
}

json completion(const std::vector<int> & prompt, int max_tokens, bool stream = false) {
    json j = {{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}};
    if (stream) {
        j["stream"] = true;
        j["stream_options"] = {{"include_usage", true}};
    } else {
        j["logprobs"] = 2;
    }
    return j;
}

std::string completion_s(const std::vector<int> & prompt, int max_tokens, bool stream = false) {
    return completion(prompt, max_tokens, stream).dump();
}

// "" when two completions of the same greedy request agree: text, tokens and finish_reason
// bitwise, every logprob (sampled and top) within 1e-4. (Logprobs are not bitwise batch-invariant
// on the CPU backend: the same request alone and batched with others differs in the last bits,
// fault or not; the tokens never do.) Otherwise what differs.
std::string output_diff(const std::string & a_body, const std::string & b_body) {
    const json a = json::parse(a_body, nullptr, false), b = json::parse(b_body, nullptr, false);
    if (a.is_discarded() || !a.contains("choices")) return "unparsable: " + a_body.substr(0, 300);
    if (b.is_discarded() || !b.contains("choices")) return "unparsable: " + b_body.substr(0, 300);
    const json & x = a["choices"][0];
    const json & y = b["choices"][0];
    if (x["text"] != y["text"]) return "text differs";
    if (x["finish_reason"] != y["finish_reason"]) return "finish_reason differs";
    const json & lx = x["logprobs"];
    const json & ly = y["logprobs"];
    if (lx.is_null() != ly.is_null()) return "logprobs present in one only";
    if (lx.is_null()) return "";
    if (lx["tokens"] != ly["tokens"]) return "tokens differ";
    const auto & px = lx["token_logprobs"];
    const auto & py = ly["token_logprobs"];
    if (px.size() != py.size()) return "logprob counts differ";
    for (size_t i = 0; i < px.size(); ++i)
        if (std::fabs(px[i].get<double>() - py[i].get<double>()) > 1e-4) return "logprob " + std::to_string(i) + " differs";
    const auto & tx = lx["top_logprobs"];
    const auto & ty = ly["top_logprobs"];
    if (tx.size() != ty.size()) return "top_logprobs counts differ";
    for (size_t i = 0; i < tx.size(); ++i) {
        if (tx[i].size() != ty[i].size()) return "top_logprobs " + std::to_string(i) + " differ";
        for (auto it = tx[i].begin(); it != tx[i].end(); ++it) {
            if (!ty[i].contains(it.key())) return "top_logprobs " + std::to_string(i) + " name other tokens";
            if (std::fabs(it.value().get<double>() - ty[i][it.key()].get<double>()) > 1e-4)
                return "top logprob " + std::to_string(i) + " differs";
        }
    }
    return "";
}

} // namespace

TEST(drill_helpers, output_diff_controls_fail_on_perturbed_outputs) {
    json r = {{"choices", json::array({{{"text", "ab"}, {"finish_reason", "length"},
                                        {"logprobs", {{"tokens", {"a", "b"}}, {"token_logprobs", {-0.5, -1.25}},
                                                      {"top_logprobs", json::array({{{"a", -0.5}}, {{"b", -1.25}}})}}}}})}};
    EXPECT_EQ(output_diff(r.dump(), r.dump()), "");
    json p = r;
    p["choices"][0]["logprobs"]["token_logprobs"][1] = -1.25 + 1e-3;
    EXPECT_NE(output_diff(r.dump(), p.dump()), "") << "a 1e-3 logprob change must be seen";
    p = r;
    p["choices"][0]["logprobs"]["top_logprobs"][0]["a"] = -0.6;
    EXPECT_NE(output_diff(r.dump(), p.dump()), "");
    p = r;
    p["choices"][0]["logprobs"]["tokens"][1] = "c";
    EXPECT_NE(output_diff(r.dump(), p.dump()), "");
    p = r;
    p["choices"][0]["text"] = "ac";
    EXPECT_NE(output_diff(r.dump(), p.dump()), "");
    p = r;
    p["choices"][0]["finish_reason"] = "stop";
    EXPECT_NE(output_diff(r.dump(), p.dump()), "");
}

TEST(server_drills, nan_in_one_sequence_fails_only_that_request) {
    constexpr int k_trigger = 126;   // a byte id no other prompt here contains
    serve_proc s(model_dir(), {"--max-num-seqs", "4", "--max-model-len", "256", "--test-nan-token", std::to_string(k_trigger),
                  "--test-nan-after", "3"});
    const std::vector<std::vector<int>> prompts = {{65, 66, 67, 68}, {70, 71, 72}, {80, 81, 82, 83, 84, 85}};
    std::vector<std::string> alone;
    for (const auto & p : prompts) {
        const auto [st, body] = s.post("/v1/completions", completion_s(p, 24));
        ASSERT_EQ(st, 200) << body;
        alone.push_back(body);
    }
    ASSERT_EQ(s.metrics()["perigee:nan_events_total"], 0);
    // Together: the three, a poisoned stream and a poisoned non-streamed request.
    std::vector<std::string> together(prompts.size());
    std::string poisoned_stream;
    std::pair<int, std::string> poisoned_plain;
    std::vector<std::thread> ts;
    for (size_t i = 0; i < prompts.size(); ++i)
        ts.emplace_back([&, i] {
            const auto [st, body] = s.post("/v1/completions", completion_s(prompts[i], 24));
            together[i] = st == 200 ? body : "HTTP " + std::to_string(st) + ": " + body;
        });
    ts.emplace_back([&] {
        raw_stream r(s.port(), completion_s({65, k_trigger, 66}, 24, true));
        r.read_to_end(60);
        poisoned_stream = r.data();
    });
    ts.emplace_back([&] { poisoned_plain = s.post("/v1/completions", completion_s({k_trigger, 90}, 24)); });
    for (auto & t : ts) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(output_diff(together[i], alone[i]), "") << "request " << i << " was affected by the fault";
    // the poisoned stream: some tokens, then an in-stream error object naming the cause, then [DONE]
    EXPECT_NE(poisoned_stream.find("\"text\""), std::string::npos) << poisoned_stream;
    EXPECT_NE(poisoned_stream.find("\"error\""), std::string::npos) << poisoned_stream;
    EXPECT_NE(poisoned_stream.find("non-finite logits"), std::string::npos) << poisoned_stream;
    EXPECT_NE(poisoned_stream.find("data: [DONE]"), std::string::npos) << poisoned_stream;
    EXPECT_EQ(poisoned_stream.find("\"finish_reason\":\"length\""), std::string::npos) << "a failed stream must not look complete";
    EXPECT_EQ(poisoned_plain.first, 500) << poisoned_plain.second;
    EXPECT_NE(poisoned_plain.second.find("non-finite logits"), std::string::npos) << poisoned_plain.second;
    // healthy, pools back to baseline, the failures counted, and the same requests still give the same output
    EXPECT_GE(s.wait_idle(2.0), 0.0) << "pools not back to baseline";
    auto m = s.metrics();
    EXPECT_EQ(m["perigee:nan_events_total"], 2);
    auto c = s.client();
    auto h = c.Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200) << h->body;
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(output_diff(s.post("/v1/completions", completion_s(prompts[i], 24)).second, alone[i]), "");
}

TEST(server_drills, admission_beyond_capacity_is_refused_with_a_reason) {
    serve_proc s(model_dir(), {"--max-num-seqs", "1", "--max-queue", "1", "--max-model-len", "2048"});
    raw_stream running(s.port(), completion_s({65, 66}, 2000, true));
    ASSERT_TRUE(running.read_until("\"text\"", 30)) << running.data() << s.log();   // admitted and decoding
    raw_stream queued(s.port(), completion_s({67, 68}, 2000, true));
    // the queued one is waiting in the engine once /metrics says so
    const auto t0 = steady::now();
    while (s.metrics()["perigee:num_requests_waiting"] < 1 && since(t0) < 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(s.metrics()["perigee:num_requests_waiting"], 1);
    auto c = s.client();
    auto r = c.Post("/v1/completions", completion_s({69}, 4), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_EQ(r->get_header_value("Retry-After"), "1");
    const json e = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(e.contains("error")) << r->body;
    EXPECT_EQ(e["error"]["code"], "queue_full") << r->body;
    EXPECT_NE(e["error"]["message"].get<std::string>().find("queue"), std::string::npos) << r->body;
    // beyond the context: 400 naming the limit (never admitted)
    std::vector<int> long_prompt(2100, 65);
    const auto [st, body] = s.post("/v1/completions", completion_s(long_prompt, 4));
    EXPECT_EQ(st, 400) << body;
    EXPECT_NE(body.find("context_length_exceeded"), std::string::npos) << body;
    // the refused requests took nothing; closing the two streams frees everything
    running.close_now();
    queued.close_now();
    EXPECT_GE(s.wait_idle(2.0), 0.0) << "pools not back to baseline after the refusals";
    const auto [st2, body2] = s.post("/v1/completions", completion_s({69}, 4));
    EXPECT_EQ(st2, 200) << body2;
}

TEST(server_drills, disconnect_storm_200_streams_frees_everything_within_2s) {
    serve_proc s(model_dir(), {"--max-num-seqs", "8", "--max-queue", "256", "--max-model-len", "1024"});
    const auto [st0, canary0] = s.post("/v1/completions", completion_s({65, 66, 67}, 8));
    ASSERT_EQ(st0, 200) << canary0;
    const double cancelled0 = s.metrics()["perigee:requests_cancelled_total"];
    constexpr int k_threads = 20, k_each = 10;
    std::atomic<int> mid_stream{0}, failed{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < k_threads; ++t)
        ts.emplace_back([&, t] {
            for (int i = 0; i < k_each; ++i) {
                const int k = t * k_each + i;
                raw_stream r(s.port(), completion_s({65 + k % 26, 66 + k % 13, 67 + k % 7}, 1000, true));
                // mid-stream: at least one generated token received, then the client goes away
                if (r.read_until("\"text\":\"", 60)) mid_stream++;
                else failed++;
                r.close_now();
            }
        });
    for (auto & t : ts) t.join();
    const auto t_closed = steady::now();
    EXPECT_EQ(mid_stream.load(), k_threads * k_each) << failed.load() << " streams never produced a token";
    const double idle_s = s.wait_idle(2.0);
    EXPECT_GE(idle_s, 0.0) << "slots/pages not back to zero within 2 s of the last disconnect";
    std::fprintf(stderr, "[drill] storm: idle %.3f s after the last of 200 disconnects (%.3f s since)\n", idle_s, since(t_closed));
    auto m = s.metrics();
    EXPECT_GE(m["perigee:requests_cancelled_total"] - cancelled0, double(k_threads * k_each));
    EXPECT_EQ(m["perigee:slots_in_use"], 0);
    EXPECT_EQ(m["perigee:pages_in_use"], 0);
    const auto [st1, canary1] = s.post("/v1/completions", completion_s({65, 66, 67}, 8));
    EXPECT_EQ(st1, 200);
    EXPECT_EQ(output_diff(canary1, canary0), "") << "the canary changed after the storm";
}

TEST(server_drills, sigterm_drains_streams_in_flight_and_exits_0) {
    serve_proc s(model_dir(), {"--max-num-seqs", "4", "--max-model-len", "512", "--drain-timeout", "30"});
    constexpr int k_streams = 4, k_tokens = 120;
    std::vector<std::unique_ptr<raw_stream>> rs;
    for (int i = 0; i < k_streams; ++i) rs.push_back(std::make_unique<raw_stream>(s.port(), completion_s({65 + i, 70}, k_tokens, true)));
    for (auto & r : rs) ASSERT_TRUE(r->read_until("\"text\":\"", 30)) << r->data();
    ASSERT_EQ(kill(s.pid(), SIGTERM), 0);
    // while draining: /health 503 draining, new requests 503
    const auto t0 = steady::now();
    int health = 0;
    std::string health_body;
    while (since(t0) < 5) {
        auto c = s.client();
        auto h = c.Get("/health");
        if (h) {
            health = h->status;
            health_body = h->body;
        }
        if (health == 503) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(health, 503) << health_body;
    EXPECT_NE(health_body.find("draining"), std::string::npos) << health_body;
    const auto [st, body] = s.post("/v1/completions", completion_s({65}, 4));
    EXPECT_EQ(st, 503) << body;
    EXPECT_NE(body.find("shutting down"), std::string::npos) << body;
    // every accepted stream runs to its end
    for (auto & r : rs) {
        r->read_to_end(60);
        EXPECT_NE(r->data().find("\"finish_reason\":\"length\""), std::string::npos) << r->data().substr(r->data().size() > 600 ? r->data().size() - 600 : 0);
        EXPECT_NE(r->data().find("\"completion_tokens\":" + std::to_string(k_tokens)), std::string::npos);
        EXPECT_NE(r->data().find("data: [DONE]"), std::string::npos);
        EXPECT_EQ(r->data().find("\"error\""), std::string::npos);
    }
    EXPECT_EQ(s.wait_exit(30), 0) << s.log();
    EXPECT_NE(s.log().find("every request finished"), std::string::npos) << s.log();
}

TEST(server_drills, sigterm_past_the_drain_timeout_cancels_the_rest_and_exits_0) {
    serve_proc s(model_dir(), {"--max-num-seqs", "2", "--max-model-len", "4096", "--drain-timeout", "0.5"});
    std::vector<std::unique_ptr<raw_stream>> rs;
    for (int i = 0; i < 2; ++i) rs.push_back(std::make_unique<raw_stream>(s.port(), completion_s({65 + i}, 4000, true)));
    for (auto & r : rs) ASSERT_TRUE(r->read_until("\"text\":\"", 30)) << r->data();
    const auto t0 = steady::now();
    ASSERT_EQ(kill(s.pid(), SIGTERM), 0);
    for (auto & r : rs) {
        r->read_to_end(20);
        EXPECT_NE(r->data().find("\"error\""), std::string::npos) << "a stream cut by the drain must end with an error object";
        EXPECT_NE(r->data().find("data: [DONE]"), std::string::npos);
    }
    EXPECT_EQ(s.wait_exit(20), 0) << s.log();
    EXPECT_LT(since(t0), 10.0);
    EXPECT_NE(s.log().find("the rest were cancelled"), std::string::npos) << s.log();
}
