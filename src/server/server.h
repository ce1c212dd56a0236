// The OpenAI-compatible HTTP server (issue 5; ECOSYSTEM §3-§5, RELIABILITY §B5): cpp-httplib with
// a thread pool sized for the maximum number of concurrent streams, on a gen_engine.
//
// Routes: POST /v1/chat/completions, POST /v1/completions (stream and non-stream), GET /v1/models,
// POST /tokenize, POST /detokenize (all behind --api-key when set); GET /health, GET /metrics and
// the web chat page at / are public. Errors are OpenAI error objects; 503 + Retry-After when the
// engine queue is full. A client that disconnects is cancelled in the engine within ~0.2 s
// (socket peeked every 100 ms while waiting; SSE writes fail after a close).
// Note: constructing a server ignores SIGPIPE process-wide (a write to a closed socket must fail,
// not kill the process).
#pragma once
#include "chat/chat.h"
#include "server/gen_engine.h"
#include "tokenizer/tokenizer.h"

#include <memory>
#include <string>

namespace perigee::server {

struct server_options {
    std::string host = "127.0.0.1";
    int port = 8000;                   // 0 = any free port (tests)
    std::string api_key;               // "" = no key
    std::string served_model_name = "default";
    int max_model_len = 4096;          // prompt + generated tokens
    int max_num_seqs = 8;              // running sequences (engine)
    int max_queue = 256;               // waiting requests (engine)
    int http_threads = 0;              // 0 = max_num_seqs + max_queue + 8
    double ping_interval_s = 10.0;     // SSE ": ping" when nothing was written for this long
    size_t max_body_bytes = 8u << 20;  // 413 beyond
    int read_timeout_s = 10;           // slow clients (headers / body)
    int write_timeout_s = 30;          // a client that stops reading a stream
    bool webui = true;                 // serve the chat page at /
    bool default_thinking = true;      // chat: thinking on unless the request turns it off
};

class http_server {
public:
    http_server(server_options opt, gen_engine & eng, const tok::tokenizer & tok, const chat::chat_template & ct);
    ~http_server();
    http_server(const http_server &) = delete;
    http_server & operator=(const http_server &) = delete;

    // Binds the socket; returns the port (useful with port 0). Throws perigee::error on failure.
    int bind();
    // Serves until stop(); bind() first.
    void listen();
    // bind() + listen() on a background thread (tests); returns the port.
    int start();
    // Stops at once: open streams are cut (clients see a dropped connection).
    void stop();
    int port() const;
    // Graceful drain (SIGTERM/SIGINT in `perigee serve`): from now on /health answers 503
    // {"status":"draining"} and new generation requests 503 + Retry-After ("the server is shutting
    // down"); requests already accepted run to their end. Returns true if all finished within
    // timeout_s; otherwise the rest are cancelled in the engine (open streams end with an in-stream
    // error object and [DONE]) and it waits up to 5 s more for their responses to be written.
    // Call stop() afterwards. Safe from any thread; idempotent.
    bool drain(double timeout_s);
    bool draining() const;
    int in_flight() const;   // generation requests accepted and not yet fully answered

    struct impl;

private:
    std::unique_ptr<impl> impl_;
};

// The built-in web chat page (plain HTML/JS, streaming, reasoning and tool calls).
const std::string & webui_html();

} // namespace perigee::server
