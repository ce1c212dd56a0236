// The OpenAI-compatible HTTP server. See server.h.
#include "server/server.h"

#include "chat/parser.h"
#include "core/error.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/stop_matcher.h"
#include "tokenizer/stream_decoder.h"

#include <httplib.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <thread>

namespace perigee::server {

namespace {

using steady = std::chrono::steady_clock;
constexpr auto k_poll = std::chrono::milliseconds(100);

double seconds_since(steady::time_point t) { return std::chrono::duration<double>(steady::now() - t).count(); }

std::string dump(const json & j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string random_id(const char * prefix) {
    static std::atomic<uint64_t> counter{0};
    static const uint64_t salt = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}() ^
                                 uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    uint64_t x = salt + (++counter * 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return fmt::format("{}{:016x}", prefix, x);
}

// ---- the connection's socket (for disconnect detection while nothing is written) ----
//
// httplib (0.11.x) runs a connection entirely on one worker thread: Server::process_and_close_socket(sock) is
// the task the listener enqueues after accept(); it loops over the keep-alive requests (process_request runs
// routing, the handler and the response writer, chunked content providers included) and only then shuts the
// socket down and closes it, on that same thread. conn_server overrides that virtual entry point (the
// extension point httplib's own SSLServer uses) with the same loop, and publishes `sock` to the handler in a
// thread_local for exactly the span of process_request. So a handler reads the fd of ITS OWN connection,
// and that fd cannot be closed or reused while the handler or its content provider polls it: the only close
// is below, after process_request has returned. (Replaces a /proc/self/fd scan matched by address pair,
// which fstat()ed other workers' descriptors while they closed them: a data race and a TOCTOU.)
thread_local int t_conn_fd = -1;

// The fd of the connection whose request this thread is handling; -1 outside a conn_server request.
int connection_fd() { return t_conn_fd; }

// true when `sock` has something to read (a request, or EOF) within timeout_s; false on timeout, error,
// or when the server stops listening meanwhile (so stop() does not wait out idle keep-alive connections).
bool wait_next_request(socket_t sock, time_t timeout_s, const std::atomic<socket_t> & listening) {
    const auto until = steady::now() + std::chrono::seconds(timeout_s);
    while (listening != INVALID_SOCKET) {
        pollfd p{sock, POLLIN, 0};
        const int n = ::poll(&p, 1, 10);
        if (n > 0) return true;
        if (n < 0 && errno != EINTR) return false;
        if (steady::now() >= until) return false;
    }
    return false;
}

// Runs a few requests through a throw-away httplib::Server in memory (no socket) so that the function-local
// statics on httplib's server request path are initialised on the calling thread, before any worker thread
// exists: the method set in parse_request_line, the Range regex in parse_range_header, the "0\r\n\r\n"
// done-marker string of the chunked writer (found in the Debian 0.11.4 libcpp-httplib.so: every
// __cxa_guard_acquire caller on the server path; the others are client-side, multipart or file serving).
// Why: libcpp-httplib.so is not instrumented, so ThreadSanitizer does not see the inline acquire load of a
// static's guard byte. When two workers reach such a static for the first time together, the one that skips
// the initialisation reads bytes TSan saw the other write (memcpy/memcmp/send interceptors) with no
// happens-before edge, and reports a race (server_http.queue_full_is_503_with_retry_after, the sigterm
// drills). The library is correct (guard acquire/release per the C++ ABI); initialising the statics here
// gives TSan the edge through thread creation, instead of a suppression that would hide real races in
// everything httplib calls on our behalf. A static this misses still shows up as a TSan report.
void init_httplib_statics() {
    struct primer : httplib::Server {
        void run(const std::string & request) {
            httplib::detail::BufferStream s;
            s.write(request.data(), request.size());
            bool closed = false;
            // the chunked writer stops as soon as the server is not listening (svr_sock_ == INVALID_SOCKET); this
            // one never listens, so it holds a placeholder for the run (never polled, accepted on or closed)
            svr_sock_ = 0;
            process_request(s, true, closed, nullptr);
            svr_sock_ = INVALID_SOCKET;
        }
    } p;
    p.Get("/chunked", [](const httplib::Request &, httplib::Response & res) {
        res.set_chunked_content_provider("text/plain", [](size_t, httplib::DataSink & sink) {
            sink.write("x", 1);
            sink.done();
            return true;
        });
    });
    p.run("GET /chunked HTTP/1.1\r\nHost: localhost\r\n\r\n");
    p.run("GET /none HTTP/1.1\r\nHost: localhost\r\nRange: bytes=0-1\r\n\r\n");
}

class conn_server : public httplib::Server {
public:
    conn_server() {
        static const bool once = (init_httplib_statics(), true);   // (an instrumented guard: TSan sees this one)
        (void)once;
    }

    // httplib 0.11.4 listens with a backlog of 5 (create_server_socket; `ss -ltn` shows Send-Q 5). A burst of
    // new connections while the accept thread is not scheduled overflows that queue: Linux then drops the SYN or
    // the handshake's last ACK, and the client waits for a retransmit (1 s, 3 s, 7 s, ...; ListenOverflows in
    // /proc/net/netstat counts them). On a busy 2-core machine 32 streaming clients produced 35 overflows in
    // 10 s and, in one CI run, handshakes that did not finish within the client's 30 s read timeout. listen()
    // on a listening socket only changes its backlog; SOMAXCONN is clamped by net.core.somaxconn.
    bool widen_backlog() { return svr_sock_ != INVALID_SOCKET && ::listen(svr_sock_, SOMAXCONN) == 0; }

private:
    // Same as httplib 0.11.4's Server::process_and_close_socket (checked against the disassembly of the Debian
    // libcpp-httplib.so: keep-alive loop while listening, count > 0 and the next request arrives in time; one
    // SocketStream per request with the read/write timeouts; the last allowed request closes the connection;
    // then shutdown + close), plus the thread_local fd around process_request.
    bool process_and_close_socket(socket_t sock) override {
        bool ret = false;
        for (size_t left = keep_alive_max_count_;
             left > 0 && svr_sock_ != INVALID_SOCKET && wait_next_request(sock, keep_alive_timeout_sec_, svr_sock_); --left) {
            const bool close_connection = left == 1;
            bool connection_closed = false;
            ret = httplib::detail::process_client_socket(
                sock, read_timeout_sec_, read_timeout_usec_, write_timeout_sec_, write_timeout_usec_,
                [&](httplib::Stream & strm) {
                    t_conn_fd = sock;
                    struct reset {
                        ~reset() { t_conn_fd = -1; }
                    } r;
                    return process_request(strm, close_connection, connection_closed, nullptr);
                });
            if (!ret || connection_closed) break;
        }
        ::shutdown(sock, SHUT_RDWR);
        httplib::detail::close_socket(sock);
        return ret;
    }
};

// true when the peer has closed (EOF or error); data waiting (a pipelined request) is not a close.
bool peer_closed(int fd) {
    if (fd < 0) return false;
    char c;
    const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    return false;
}

// ---- events from the engine thread ----

struct event_queue {
    std::mutex m;
    std::condition_variable cv;
    std::deque<token_event> q;

    void push(const token_event & e) {
        {
            std::lock_guard<std::mutex> lk(m);
            q.push_back(e);
        }
        cv.notify_one();
    }
    std::vector<token_event> pop_all(std::chrono::milliseconds wait) {
        std::unique_lock<std::mutex> lk(m);
        cv.wait_for(lk, wait, [&] { return !q.empty(); });
        std::vector<token_event> out(q.begin(), q.end());
        q.clear();
        return out;
    }
};

double finite_logprob(float lp) { return std::isfinite(lp) ? double(lp) : -9999.0; }

// One generation's output pipeline: ids -> UTF-8 text -> stop strings -> (chat) output parser.
struct piece {
    std::string content, reasoning;
    std::vector<chat::tool_call> calls;
    json logprobs = json::array();   // chat entries, or completion (token, lp, top) triples
    bool empty() const { return content.empty() && reasoning.empty() && calls.empty() && logprobs.empty(); }
};

class gen_state {
public:
    gen_state(const tok::tokenizer & tok, const gen_request & r, std::unique_ptr<chat::output_parser> parser, metrics & m)
        : tok_(tok), r_(r), dec_(tok, r.kind == endpoint::completion), stop_(r.stop, r.include_stop_str_in_output),
          parser_(std::move(parser)), m_(m), t0_(steady::now()) {}

    // Consumes one engine event; returns what it adds to the output.
    piece on_event(const token_event & ev) {
        piece p;
        if (finished_) return p;
        if (ev.token >= 0) {
            const auto now = steady::now();
            if (n_tokens_ == 0) m_.ttft(std::chrono::duration<double>(now - t0_).count());
            else m_.itl(std::chrono::duration<double>(now - last_).count());
            last_ = now;
            ++n_tokens_;
            if (r_.logprobs) p.logprobs.push_back(logprob_entry(ev));
            if (!stop_.stopped()) deliver(stop_.push(dec_.push(ev.token)), p);
        }
        prompt_tokens_ = ev.prompt_tokens;
        completion_tokens_ = std::max(completion_tokens_, ev.completion_tokens);
        if (stop_.stopped()) {
            finish(p, "stop");
        } else if (ev.finished != finish_reason::NONE) {
            if (ev.finished == finish_reason::ERROR) {
                error_ = ev.error.empty() ? "the engine failed" : ev.error;
            } else if (ev.finished == finish_reason::CANCELLED) {
                error_ = "the request was cancelled by the server";
            }
            finish(p, ev.finished == finish_reason::LENGTH ? "length" : "stop");
        }
        return p;
    }

    bool finished() const { return finished_; }
    bool stopped_by_string() const { return stop_.stopped(); }
    const std::string & error() const { return error_; }
    const std::string & finish_reason_str() const { return reason_; }
    int prompt_tokens() const { return prompt_tokens_; }
    int completion_tokens() const { return completion_tokens_; }
    int n_calls() const { return n_calls_; }
    double elapsed() const { return seconds_since(t0_); }

    json logprob_entry(const token_event & ev) const {
        auto one = [&](int32_t id, float lp) {
            const std::string & b = tok_.token_bytes(id);
            json bytes = json::array();
            for (unsigned char c : b) bytes.push_back(int(c));
            return json{{"token", b}, {"logprob", finite_logprob(lp)}, {"bytes", bytes}};
        };
        json e = one(ev.token, ev.logprob);
        json top = json::array();
        for (const auto & [id, lp] : ev.top_logprobs) top.push_back(one(id, lp));
        e["top_logprobs"] = top;
        return e;
    }

private:
    void deliver(const std::string & text, piece & p) {
        if (text.empty()) return;
        if (!parser_) {
            p.content += text;
            return;
        }
        add(parser_->feed(text), p);
    }
    void add(const chat::chat_delta & d, piece & p) {
        p.content += d.content;
        p.reasoning += d.reasoning_content;
        for (auto c : d.tool_calls) {
            if (c.id.rfind("call_", 0) == 0) c.id = random_id("call_");   // K3: positional, make ids unique
            p.calls.push_back(std::move(c));
        }
        n_calls_ += int(d.tool_calls.size());
    }
    void finish(piece & p, const char * reason) {
        if (!stop_.stopped()) {
            std::string rest = stop_.push(dec_.finish());
            rest += stop_.finish();
            deliver(rest, p);
        }
        if (parser_) add(parser_->finish(), p);
        reason_ = reason;
        if (stop_.stopped()) reason_ = "stop";
        if (n_calls_ > 0) reason_ = "tool_calls";
        finished_ = true;
    }

    const tok::tokenizer & tok_;
    const gen_request & r_;
    tok::stream_decoder dec_;
    stop_matcher stop_;
    std::unique_ptr<chat::output_parser> parser_;
    metrics & m_;
    steady::time_point t0_, last_;
    int n_tokens_ = 0, prompt_tokens_ = 0, completion_tokens_ = 0, n_calls_ = 0;
    bool finished_ = false;
    std::string reason_, error_;
};

json tool_calls_json(const std::vector<chat::tool_call> & calls, int first_index, bool stream) {
    json a = json::array();
    for (size_t i = 0; i < calls.size(); ++i) {
        json c = {{"id", calls[i].id}, {"type", "function"},
                  {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
        if (stream) {
            json s = {{"index", first_index + int(i)}};
            s.update(c);
            c = std::move(s);
        }
        a.push_back(c);
    }
    return a;
}

json completion_logprobs(const json & entries, size_t text_offset0) {
    json tokens = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
    size_t off = text_offset0;
    for (const auto & e : entries) {
        tokens.push_back(e["token"]);
        lps.push_back(e["logprob"]);
        json t = json::object();
        for (const auto & x : e["top_logprobs"]) t[x["token"].get<std::string>()] = x["logprob"];
        tops.push_back(t);
        offs.push_back(off);
        off += e["token"].get<std::string>().size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

} // namespace

// ---------------------------------------------------------------------------------------------

struct http_server::impl {
    server_options opt;
    gen_engine & eng;
    const tok::tokenizer & tok;
    const chat::chat_template & ct;
    metrics met;
    conn_server svr;
    std::thread thread;
    int bound_port = -1;
    parse_limits lim;
    // drain: generation requests from accept to the last byte of their response
    std::atomic<bool> draining{false};
    mutable std::mutex flight_m;
    std::condition_variable flight_cv;
    std::set<uint64_t> flight_ids;   // engine ids of accepted requests still being answered
    int flight_n = 0;

    impl(server_options o, gen_engine & e, const tok::tokenizer & t, const chat::chat_template & c)
        : opt(std::move(o)), eng(e), tok(t), ct(c) {
        lim.vocab_size = std::min(int(tok.n_vocab()), eng.vocab_size());
        lim.served_model = opt.served_model_name;
        setup();
    }

    // ---- responses ----
    void send_error(httplib::Response & res, const api_error & e) {
        res.status = e.status;
        res.set_content(dump(e.to_json()), "application/json");
        met.http_error(e.status);
    }

    static void send_json(httplib::Response & res, const json & j) { res.set_content(dump(j), "application/json"); }

    bool authorised(const httplib::Request & req) const {
        if (opt.api_key.empty()) return true;
        const std::string want = "Bearer " + opt.api_key;
        bool ok = false;
        if (req.has_header("Authorization")) ok |= constant_time_equal(req.get_header_value("Authorization"), want);
        if (req.has_header("x-api-key")) ok |= constant_time_equal(req.get_header_value("x-api-key"), opt.api_key);
        return ok;
    }

    // Runs a handler body, mapping every exception to an OpenAI error (never a 5xx for input).
    template <typename F>
    void guarded(httplib::Response & res, F && f) {
        try {
            f();
        } catch (const api_error & e) {
            send_error(res, e);
        } catch (const engine_full_error & e) {
            res.set_header("Retry-After", "1");
            send_error(res, {503, "unavailable_error", "", "queue_full", std::string("the server is busy: ") + e.what()});
        } catch (const perigee::error & e) {
            // engine / renderer validation: the message starts with the field it names
            std::string msg = e.what(), param;
            const size_t colon = msg.find(':');
            if (colon != std::string::npos && colon < 64 && msg.find(' ') > colon) param = msg.substr(0, colon);
            send_error(res, {400, "invalid_request_error", param, "", msg});
        } catch (const std::exception & e) {
            send_error(res, {500, "server_error", "", "", std::string("internal error: ") + e.what()});
        }
    }

    json parse_request_body(const httplib::Request & req) {
        if (req.has_header("Content-Type")) {
            const std::string ctype = req.get_header_value("Content-Type");
            if (ctype.rfind("application/json", 0) != 0)
                fail("", fmt::format("Content-Type '{}' is not supported (use application/json)", ctype), 415, "",
                     "invalid_request_error");
        }
        return parse_body(req.body);
    }

    // ---- prompt building ----
    struct prepared {
        gen_request r;
        std::vector<int32_t> ids;
        chat::render_options ro;
    };

    chat::render_options render_opts(const gen_request & r) const {
        chat::render_options o;
        o.thinking = r.thinking.value_or(opt.default_thinking);
        if (r.thinking_effort_set) o.thinking_effort = r.thinking_effort;
        o.tool_choice = r.tool_choice;
        o.response_format = r.response_format;
        return o;
    }

    std::vector<int32_t> render_chat(const gen_request & r, const chat::render_options & o) const {
        try {
            return ct.encode(ct.render(r.messages, r.tools, o));
        } catch (const perigee::error & e) {
            fail("messages", e.what());
        }
    }

    prepared prepare(const json & body, endpoint kind) {
        prepared p;
        p.r = kind == endpoint::chat ? parse_chat_request(body, lim) : parse_completion_request(body, lim);
        if (kind == endpoint::chat) {
            p.ro = render_opts(p.r);
            p.ids = render_chat(p.r, p.ro);
        } else if (p.r.prompt_text) {
            try {
                p.ids = ct.encode_flat(*p.r.prompt_text);
            } catch (const perigee::error & e) {
                fail("prompt", e.what());
            }
        } else {
            p.ids = p.r.prompt_ids;
        }
        const int64_t n = int64_t(p.ids.size());
        if (n == 0) fail("prompt", "the prompt is empty");
        if (n >= opt.max_model_len)
            fail(kind == endpoint::chat ? "messages" : "prompt",
                 fmt::format("This model's maximum context length is {} tokens; the prompt has {} tokens", opt.max_model_len, n),
                 400, "context_length_exceeded");
        const int64_t room = opt.max_model_len - n;
        if (p.r.max_tokens_set) {
            if (p.r.sp.max_tokens > room)
                fail(kind == endpoint::chat && body.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
                     fmt::format("This model's maximum context length is {} tokens; the prompt has {} tokens and {} "
                                 "were requested for the completion (n_prompt_tokens={}, max_tokens={}, n_ctx={})",
                                 opt.max_model_len, n, p.r.sp.max_tokens, n, p.r.sp.max_tokens, opt.max_model_len),
                     400, "context_length_exceeded");
        } else {
            p.r.sp.max_tokens = int(kind == endpoint::chat ? room : std::min<int64_t>(p.r.sp.max_tokens, room));
        }
        return p;
    }

    request engine_request(const prepared & p) const {
        request rq;
        rq.prompt = p.ids;
        rq.sp = p.r.sp;
        rq.stop_token_ids = p.r.stop_token_ids;
        rq.ignore_eos = p.r.ignore_eos;
        if (!p.r.ignore_eos)
            for (auto id : ct.stop_ids())
                if (id < lim.vocab_size) rq.stop_token_ids.push_back(id);
        return rq;
    }

    std::unique_ptr<chat::output_parser> make_parser(const prepared & p) const {
        if (p.r.kind != endpoint::chat) return nullptr;
        return chat::make_parser(ct.format(), p.ro);
    }

    json usage_json(const gen_state & st) const {
        return {{"prompt_tokens", st.prompt_tokens()},
                {"completion_tokens", st.completion_tokens()},
                {"total_tokens", st.prompt_tokens() + st.completion_tokens()},
                {"prompt_tokens_details", {{"cached_tokens", 0}}}};
    }

    // ---- drain bookkeeping ----
    // A token held while a request is being answered; its release ends the request's flight.
    std::shared_ptr<void> enter_flight() {
        {
            std::lock_guard<std::mutex> lk(flight_m);
            ++flight_n;
        }
        return std::shared_ptr<void>(nullptr, [this](void *) {
            {
                std::lock_guard<std::mutex> lk(flight_m);
                --flight_n;
            }
            flight_cv.notify_all();
        });
    }
    // The engine id of a flight (so a drain past its timeout can cancel it); released with it.
    std::shared_ptr<void> track_id(uint64_t id) {
        {
            std::lock_guard<std::mutex> lk(flight_m);
            flight_ids.insert(id);
        }
        return std::shared_ptr<void>(nullptr, [this, id](void *) {
            std::lock_guard<std::mutex> lk(flight_m);
            flight_ids.erase(id);
        });
    }
    void refuse_if_draining() {
        if (draining.load())
            fail("", "the server is shutting down (draining); retry on another instance", 503, "server_shutting_down",
                 "unavailable_error");
    }

    bool drain(double timeout_s) {
        draining = true;
        std::unique_lock<std::mutex> lk(flight_m);
        const auto until = steady::now() + std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(timeout_s));
        if (flight_cv.wait_until(lk, until, [&] { return flight_n == 0; })) return true;
        const std::vector<uint64_t> ids(flight_ids.begin(), flight_ids.end());
        lk.unlock();
        for (auto id : ids) eng.cancel(id);
        lk.lock();
        flight_cv.wait_for(lk, std::chrono::seconds(5), [&] { return flight_n == 0; });
        return false;
    }

    // ---- generation ----
    void handle_generate(const httplib::Request & req, httplib::Response & res, endpoint kind) {
        guarded(res, [&] {
            if (draining.load()) res.set_header("Retry-After", "1");
            refuse_if_draining();
            auto flight = enter_flight();
            const json body = parse_request_body(req);
            auto prep = std::make_shared<prepared>(prepare(body, kind));
            auto q = std::make_shared<event_queue>();
            const uint64_t id = eng.submit(engine_request(*prep), [q](const token_event & e) { q->push(e); });
            auto tracked = track_id(id);
            met.request_started();
            if (prep->r.stream) stream_response(res, kind, prep, q, id, {flight, tracked});
            else blocking_response(res, kind, *prep, q, id);
        });
    }

    void finished_metrics(endpoint kind, const gen_state & st) {
        met.request_finished(kind == endpoint::chat ? "chat" : "completions",
                             st.error().empty() ? st.finish_reason_str() : "error", st.prompt_tokens(),
                             st.completion_tokens(), st.elapsed());
    }

    void blocking_response(httplib::Response & res, endpoint kind, const prepared & p,
                           const std::shared_ptr<event_queue> & q, uint64_t id) {
        const int fd = connection_fd();
        gen_state st(tok, p.r, make_parser(p), met);
        piece all;
        while (!st.finished()) {
            for (const auto & ev : q->pop_all(k_poll)) {
                piece x = st.on_event(ev);
                all.content += x.content;
                all.reasoning += x.reasoning;
                for (auto & c : x.calls) all.calls.push_back(c);
                for (auto & l : x.logprobs) all.logprobs.push_back(l);
                if (st.finished()) break;
            }
            if (!st.finished() && peer_closed(fd)) {
                eng.cancel(id);
                met.cancelled();
                res.status = 499;   // nobody reads it
                return;
            }
        }
        if (st.stopped_by_string()) eng.cancel(id);
        finished_metrics(kind, st);
        if (!st.error().empty()) {
            send_error(res, {500, "server_error", "", "engine_error", st.error()});
            return;
        }
        const std::string created_id = random_id(kind == endpoint::chat ? "chatcmpl-" : "cmpl-");
        json out;
        if (kind == endpoint::chat) {
            json msg = {{"role", "assistant"}, {"content", all.content.empty() && !all.calls.empty() ? json(nullptr) : json(all.content)},
                        {"refusal", nullptr}};
            if (!all.reasoning.empty()) msg["reasoning_content"] = all.reasoning;
            if (!all.calls.empty()) msg["tool_calls"] = tool_calls_json(all.calls, 0, false);
            out = {{"id", created_id}, {"object", "chat.completion"}, {"created", int64_t(std::time(nullptr))},
                   {"model", p.r.model},
                   {"choices", json::array({{{"index", 0}, {"message", msg},
                                             {"logprobs", p.r.logprobs ? json{{"content", all.logprobs}} : json(nullptr)},
                                             {"finish_reason", st.finish_reason_str()}}})},
                   {"usage", usage_json(st)}};
        } else {
            std::string prefix;
            if (p.r.echo) prefix = p.r.prompt_text ? *p.r.prompt_text : tok.decode(p.ids);
            out = {{"id", created_id}, {"object", "text_completion"}, {"created", int64_t(std::time(nullptr))},
                   {"model", p.r.model},
                   {"choices", json::array({{{"index", 0}, {"text", prefix + all.content},
                                             {"logprobs", p.r.logprobs ? completion_logprobs(all.logprobs, prefix.size()) : json(nullptr)},
                                             {"finish_reason", st.finish_reason_str()}}})},
                   {"usage", usage_json(st)}};
        }
        send_json(res, out);
    }

    struct stream_ctx {
        std::shared_ptr<prepared> p;
        std::shared_ptr<event_queue> q;
        std::unique_ptr<gen_state> st;
        uint64_t id = 0;
        endpoint kind = endpoint::chat;
        std::string resp_id;
        int64_t created = 0;
        int fd = -1;
        bool sent_first = false, complete = false;
        int n_calls_sent = 0;
        int close_probes = 0;
        steady::time_point last_write = steady::now();
        std::vector<std::shared_ptr<void>> holds;   // drain bookkeeping (see enter_flight)
    };

    json chunk_base(const stream_ctx & c) const {
        json j = {{"id", c.resp_id},
                  {"object", c.kind == endpoint::chat ? "chat.completion.chunk" : "text_completion"},
                  {"created", c.created},
                  {"model", c.p->r.model}};
        return j;
    }

    std::string frame(const stream_ctx & c, json choice) const {
        json j = chunk_base(c);
        j["choices"] = json::array({std::move(choice)});
        if (c.p->r.include_usage) j["usage"] = nullptr;
        return "data: " + dump(j) + "\n\n";
    }

    std::string piece_frames(stream_ctx & c, const piece & x) const {
        if (x.empty()) return {};
        if (c.kind == endpoint::chat) {
            json delta = json::object();
            if (!x.reasoning.empty()) delta["reasoning_content"] = x.reasoning;
            if (!x.content.empty()) delta["content"] = x.content;
            if (!x.calls.empty()) {
                delta["tool_calls"] = tool_calls_json(x.calls, c.n_calls_sent, true);
                c.n_calls_sent += int(x.calls.size());
            }
            if (delta.empty() && x.logprobs.empty()) return {};
            return frame(c, {{"index", 0}, {"delta", delta},
                             {"logprobs", c.p->r.logprobs ? json{{"content", x.logprobs}} : json(nullptr)},
                             {"finish_reason", nullptr}});
        }
        if (x.content.empty() && x.logprobs.empty()) return {};
        return frame(c, {{"index", 0}, {"text", x.content},
                         {"logprobs", c.p->r.logprobs ? completion_logprobs(x.logprobs, 0) : json(nullptr)},
                         {"finish_reason", nullptr}});
    }

    std::string final_frames(stream_ctx & c) {
        const gen_state & st = *c.st;
        std::string out;
        if (!st.error().empty()) {
            api_error e{500, "server_error", "", "engine_error", st.error()};
            out += "data: " + dump(e.to_json()) + "\n\n";
        } else {
            if (c.kind == endpoint::chat)
                out += frame(c, {{"index", 0}, {"delta", json::object()}, {"logprobs", nullptr},
                                 {"finish_reason", st.finish_reason_str()}});
            else
                out += frame(c, {{"index", 0}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", st.finish_reason_str()}});
            if (c.p->r.include_usage) {
                json j = chunk_base(c);
                j["choices"] = json::array();
                j["usage"] = usage_json(st);
                out += "data: " + dump(j) + "\n\n";
            }
        }
        out += "data: [DONE]\n\n";
        return out;
    }

    void stream_response(httplib::Response & res, endpoint kind,
                         const std::shared_ptr<prepared> & p, const std::shared_ptr<event_queue> & q, uint64_t id,
                         std::vector<std::shared_ptr<void>> holds) {
        auto c = std::make_shared<stream_ctx>();
        c->holds = std::move(holds);   // the flight ends when httplib drops the provider (response written)
        c->p = p;
        c->q = q;
        c->id = id;
        c->kind = kind;
        c->st = std::make_unique<gen_state>(tok, p->r, make_parser(*p), met);
        c->resp_id = random_id(kind == endpoint::chat ? "chatcmpl-" : "cmpl-");
        c->created = int64_t(std::time(nullptr));
        c->fd = connection_fd();   // valid for the provider too: it runs inside this request's process_request
        res.set_header("Cache-Control", "no-cache");
        res.set_header("X-Accel-Buffering", "no");
        res.set_chunked_content_provider(
            "text/event-stream",
            [this, c](size_t, httplib::DataSink & sink) { return stream_step(*c, sink); },
            [this, c](bool) {
                if (!c->complete) {
                    eng.cancel(c->id);
                    met.cancelled();
                }
            });
    }

    bool stream_step(stream_ctx & c, httplib::DataSink & sink) {
        std::string out;
        if (!c.sent_first) {
            c.sent_first = true;
            if (c.kind == endpoint::chat) {
                out += frame(c, {{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                                 {"finish_reason", nullptr}});
            } else if (c.p->r.echo) {
                const std::string prefix = c.p->r.prompt_text ? *c.p->r.prompt_text : tok.decode(c.p->ids);
                out += frame(c, {{"index", 0}, {"text", prefix}, {"logprobs", nullptr}, {"finish_reason", nullptr}});
            }
        }
        for (const auto & ev : c.q->pop_all(out.empty() ? k_poll : std::chrono::milliseconds(0))) {
            out += piece_frames(c, c.st->on_event(ev));
            if (c.st->finished()) break;
        }
        if (c.st->finished()) {
            if (c.st->stopped_by_string()) eng.cancel(c.id);
            finished_metrics(c.kind, *c.st);
            out += final_frames(c);
            c.complete = true;
            sink.write(out.data(), out.size());
            sink.done();
            return true;
        }
        if (out.empty()) {
            // nothing to send: probe the connection, ping now and then
            if (c.fd >= 0 && peer_closed(c.fd)) {
                // a full close makes the second write fail (RST); a half-close keeps working
                if (++c.close_probes > 3) c.fd = -1;   // half-closed: rely on write errors from now on
                out = ": ping\n\n";
            } else if (seconds_since(c.last_write) >= opt.ping_interval_s) {
                out = ": ping\n\n";
            }
        }
        if (!out.empty()) {
            if (!sink.write(out.data(), out.size())) return false;
            c.last_write = steady::now();
        }
        return true;
    }

    int in_flight() const {
        std::lock_guard<std::mutex> lk(flight_m);
        return flight_n;
    }

    // 200 {"status":"ok", engine gauges} when serving; 503 {"status":"draining"} while draining,
    // 503 {"status":"unhealthy"} when the engine's pools are inconsistent (more in use than exist)
    // or its stats cannot be read.
    void handle_health(httplib::Response & r) {
        json j;
        std::string status = "ok";
        try {
            const engine_stats st = eng.stats();
            j = {{"running", st.running}, {"waiting", st.waiting}, {"free_slots", st.free_slots}, {"total_slots", st.total_slots},
                 {"free_pages", st.free_pages}, {"total_pages", st.total_pages}, {"in_flight", in_flight()},
                 {"errors", st.errors}, {"nan_events", st.nan_events}};
            if (st.free_slots < 0 || st.free_slots > st.total_slots || st.free_pages < 0 || st.free_pages > st.total_pages)
                status = "unhealthy";
        } catch (const std::exception & e) {
            status = "unhealthy";
            j["error"] = e.what();
        }
        if (draining.load()) status = "draining";
        j["status"] = status;
        if (status != "ok") {
            r.status = 503;
            if (status == "draining") r.set_header("Retry-After", "1");
        }
        send_json(r, j);
    }

    // ---- other endpoints ----
    void handle_models(httplib::Response & res) {
        send_json(res, {{"object", "list"},
                        {"data", json::array({{{"id", opt.served_model_name}, {"object", "model"}, {"created", 0},
                                               {"owned_by", "perigee"}, {"root", opt.served_model_name},
                                               {"max_model_len", opt.max_model_len}}})}});
    }

    void handle_tokenize(const httplib::Request & req, httplib::Response & res) {
        guarded(res, [&] {
            const tokenize_request t = parse_tokenize_request(parse_request_body(req), lim);
            std::vector<int32_t> ids;
            if (t.has_messages) ids = render_chat(t.chat, render_opts(t.chat));
            else {
                try {
                    ids = ct.encode_flat(*t.prompt);
                } catch (const perigee::error & e) {
                    fail("prompt", e.what());
                }
            }
            json out = {{"count", ids.size()}, {"max_model_len", opt.max_model_len}, {"tokens", ids}};
            if (t.return_token_strs) {
                json strs = json::array();
                for (auto id : ids) strs.push_back(tok.token_bytes(id));
                out["token_strs"] = strs;
            }
            send_json(res, out);
        });
    }

    void handle_detokenize(const httplib::Request & req, httplib::Response & res) {
        guarded(res, [&] {
            const auto ids = parse_detokenize_request(parse_request_body(req), lim);
            send_json(res, {{"prompt", tok.decode(ids)}});
        });
    }

    void setup() {
        std::signal(SIGPIPE, SIG_IGN);
        const size_t threads = opt.http_threads > 0 ? size_t(opt.http_threads) : size_t(opt.max_num_seqs + opt.max_queue + 8);
        svr.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
        svr.set_payload_max_length(opt.max_body_bytes);
        svr.set_read_timeout(opt.read_timeout_s, 0);
        svr.set_write_timeout(opt.write_timeout_s, 0);
        svr.set_keep_alive_timeout(5);
        svr.set_tcp_nodelay(true);

        const std::vector<std::string> public_paths = {"/", "/health", "/metrics", "/favicon.ico"};
        svr.set_pre_routing_handler([this, public_paths](const httplib::Request & req, httplib::Response & res) {
            if (req.method == "OPTIONS") return httplib::Server::HandlerResponse::Unhandled;
            for (const auto & p : public_paths)
                if (req.path == p) return httplib::Server::HandlerResponse::Unhandled;
            if (!authorised(req)) {
                send_error(res, {401, "authentication_error", "", "invalid_api_key",
                                 "Incorrect or missing API key (send 'Authorization: Bearer <key>')"});
                return httplib::Server::HandlerResponse::Handled;
            }
            return httplib::Server::HandlerResponse::Unhandled;
        });
        svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request & req, httplib::Response & res) {
            if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
            api_error e;
            e.status = res.status;
            switch (res.status) {
                case 404: e.type = "not_found_error"; e.message = fmt::format("no route for {} {}", req.method, req.path.substr(0, 200)); break;
                case 413: e.message = fmt::format("the request body is larger than {} bytes", opt.max_body_bytes); break;
                case 414: e.message = "the request URI is too long"; break;
                case 431: e.message = "the request header block is too large"; break;
                default: e.message = fmt::format("HTTP {}", res.status); break;
            }
            res.set_content(dump(e.to_json()), "application/json");
            met.http_error(res.status);
            return httplib::Server::HandlerResponse::Handled;
        }));
        svr.set_exception_handler([this](const httplib::Request &, httplib::Response & res, std::exception_ptr) {
            send_error(res, {500, "server_error", "", "", "internal error"});
        });

        svr.Post("/v1/chat/completions", [this](const httplib::Request & q, httplib::Response & r) { handle_generate(q, r, endpoint::chat); });
        svr.Post("/v1/completions", [this](const httplib::Request & q, httplib::Response & r) { handle_generate(q, r, endpoint::completion); });
        svr.Post("/tokenize", [this](const httplib::Request & q, httplib::Response & r) { handle_tokenize(q, r); });
        svr.Post("/detokenize", [this](const httplib::Request & q, httplib::Response & r) { handle_detokenize(q, r); });
        svr.Get("/v1/models", [this](const httplib::Request &, httplib::Response & r) { handle_models(r); });
        svr.Get("/health", [this](const httplib::Request &, httplib::Response & r) { handle_health(r); });
        svr.Get("/metrics", [this](const httplib::Request &, httplib::Response & r) {
            std::string m = met.render(eng.stats());
            m += fmt::format("# HELP perigee:draining 1 while the server drains before shutting down.\n"
                             "# TYPE perigee:draining gauge\nperigee:draining {}\n"
                             "# HELP perigee:requests_in_flight Generation requests accepted and not yet fully answered.\n"
                             "# TYPE perigee:requests_in_flight gauge\nperigee:requests_in_flight {}\n",
                             draining.load() ? 1 : 0, in_flight());
            r.set_content(m, "text/plain; version=0.0.4");
        });
        if (opt.webui)
            svr.Get("/", [](const httplib::Request &, httplib::Response & r) { r.set_content(webui_html(), "text/html; charset=utf-8"); });
        // wrong methods on known routes: 405
        auto not_allowed = [this](const char * allow) {
            return [this, allow](const httplib::Request & q, httplib::Response & r) {
                r.set_header("Allow", allow);
                send_error(r, {405, "invalid_request_error", "", "method_not_allowed",
                               fmt::format("method {} is not allowed on {} (use {})", q.method, q.path, allow)});
            };
        };
        for (const char * p : {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}) {
            svr.Get(p, not_allowed("POST"));
            svr.Put(p, not_allowed("POST"));
            svr.Delete(p, not_allowed("POST"));
            svr.Patch(p, not_allowed("POST"));
        }
        for (const char * p : {"/v1/models", "/health", "/metrics"}) {
            svr.Post(p, not_allowed("GET"));
            svr.Put(p, not_allowed("GET"));
            svr.Delete(p, not_allowed("GET"));
        }
    }
};

http_server::http_server(server_options opt, gen_engine & eng, const tok::tokenizer & tok, const chat::chat_template & ct)
    : impl_(std::make_unique<impl>(std::move(opt), eng, tok, ct)) {}

http_server::~http_server() { stop(); }

int http_server::bind() {
    auto & I = *impl_;
    if (I.opt.port == 0) I.bound_port = I.svr.bind_to_any_port(I.opt.host);
    else I.bound_port = I.svr.bind_to_port(I.opt.host, I.opt.port) ? I.opt.port : -1;
    PG_CHECK(I.bound_port > 0, "server: cannot listen on {}:{} (address in use or not available)", I.opt.host, I.opt.port);
    PG_CHECK(I.svr.widen_backlog(), "server: cannot set the listen backlog of {}:{} to {}: {}", I.opt.host, I.bound_port,
             SOMAXCONN, std::strerror(errno));
    return I.bound_port;
}

void http_server::listen() { impl_->svr.listen_after_bind(); }

int http_server::start() {
    const int p = bind();
    impl_->thread = std::thread([this] { listen(); });
    for (int i = 0; i < 500 && !impl_->svr.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return p;
}

void http_server::stop() {
    if (!impl_) return;
    impl_->svr.stop();
    if (impl_->thread.joinable()) impl_->thread.join();
}

int http_server::port() const { return impl_->bound_port; }

bool http_server::drain(double timeout_s) { return impl_->drain(timeout_s); }
bool http_server::draining() const { return impl_->draining.load(); }
int http_server::in_flight() const { return impl_->in_flight(); }

} // namespace perigee::server
