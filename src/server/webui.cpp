// The built-in web chat page: one self-contained HTML/JS document (no build step). It streams
// /v1/chat/completions over fetch + SSE, shows reasoning (dimmed, foldable) and tool calls, and
// has a stop button (the server cancels the request when the connection closes).
#include "server/server.h"

namespace perigee::server {

const std::string & webui_html() {
    static const std::string html = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Perigee chat</title>
<style>
body{font-family:system-ui,sans-serif;margin:0;display:flex;flex-direction:column;height:100vh;background:#fafafa}
header{padding:8px 12px;background:#222;color:#eee;display:flex;gap:12px;align-items:center;font-size:14px}
header input{font-size:13px}
#log{flex:1;overflow:auto;padding:12px}
.msg{max-width:900px;margin:8px auto;padding:8px 12px;border-radius:8px;white-space:pre-wrap;word-wrap:break-word}
.user{background:#dbeafe}.assistant{background:#fff;border:1px solid #ddd}.error{background:#fee2e2}
.reasoning{color:#888;font-style:italic;border-left:3px solid #ccc;padding-left:8px;margin-bottom:6px}
.tool{font-family:monospace;background:#f3f4f6;padding:4px;margin-top:6px;border-radius:4px}
.meta{color:#999;font-size:12px;margin-top:4px}
form{display:flex;gap:8px;padding:12px;max-width:900px;margin:0 auto;width:100%;box-sizing:border-box}
textarea{flex:1;font-size:15px;height:60px}
button{font-size:15px}
</style></head><body>
<header><b>Perigee</b><span id="model"></span>
<label>API key <input id="key" type="password" size="12"></label>
<label><input id="think" type="checkbox" checked> thinking</label>
<label>max tokens <input id="maxtok" type="number" value="256" style="width:5em"></label>
<button id="clear" type="button">clear</button></header>
<div id="log"></div>
<form id="f"><textarea id="input" placeholder="Message (Enter to send, Shift+Enter for a new line)"></textarea>
<button id="send" type="submit">Send</button><button id="stop" type="button" disabled>Stop</button></form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
let ctrl = null;
$("key").value = localStorage.getItem("perigee_key") || "";
$("key").onchange = () => localStorage.setItem("perigee_key", $("key").value);
function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(j => {
  if (j.data && j.data[0]) $("model").textContent = j.data[0].id;
}).catch(() => {});
function bubble(cls) {
  const d = document.createElement("div");
  d.className = "msg " + cls;
  $("log").appendChild(d);
  return d;
}
$("clear").onclick = () => { history.length = 0; $("log").innerHTML = ""; };
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("f").requestSubmit(); }
});
$("stop").onclick = () => { if (ctrl) ctrl.abort(); };
$("f").onsubmit = async (e) => {
  e.preventDefault();
  const text = $("input").value;
  if (!text.trim() || ctrl) return;
  $("input").value = "";
  history.push({role: "user", content: text});
  bubble("user").textContent = text;
  const box = bubble("assistant");
  const rdiv = document.createElement("div"); rdiv.className = "reasoning"; rdiv.hidden = true;
  const cdiv = document.createElement("div"); cdiv.className = "content";
  const tdiv = document.createElement("div");
  const meta = document.createElement("div"); meta.className = "meta";
  box.append(rdiv, cdiv, tdiv, meta);
  let reasoning = "", content = "", calls = [], finish = null, usage = null;
  ctrl = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const t0 = performance.now();
  try {
    const body = {model: $("model").textContent || undefined, messages: history, stream: true,
                  stream_options: {include_usage: true}, max_tokens: parseInt($("maxtok").value) || undefined,
                  chat_template_kwargs: {thinking: $("think").checked}};
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body), signal: ctrl.signal});
    if (!r.ok) { const j = await r.json().catch(() => ({})); throw new Error((j.error && j.error.message) || ("HTTP " + r.status)); }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!ev.startsWith("data: ")) continue;
        const data = ev.slice(6);
        if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        if (j.usage) usage = j.usage;
        for (const ch of j.choices || []) {
          const d = ch.delta || {};
          if (d.reasoning_content) { reasoning += d.reasoning_content; rdiv.hidden = false; rdiv.textContent = reasoning; }
          if (d.content) { content += d.content; cdiv.textContent = content; }
          for (const tc of d.tool_calls || []) {
            if (!calls[tc.index]) calls[tc.index] = {id: tc.id, type: "function", function: {name: "", arguments: ""}};
            const c = calls[tc.index];
            if (tc.function && tc.function.name) c.function.name = tc.function.name;
            if (tc.function && tc.function.arguments) c.function.arguments += tc.function.arguments;
            tdiv.innerHTML = "";
            for (const x of calls) { const p = document.createElement("div"); p.className = "tool";
              p.textContent = "tool call " + x.function.name + "(" + x.function.arguments + ")"; tdiv.appendChild(p); }
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
    const secs = (performance.now() - t0) / 1000;
    meta.textContent = "finish: " + finish + (usage ? " · " + usage.completion_tokens + " tokens · " +
      (usage.completion_tokens / secs).toFixed(1) + " tok/s" : "");
    const m = {role: "assistant", content: content};
    if (reasoning) m.reasoning_content = reasoning;
    if (calls.length) m.tool_calls = calls;
    history.push(m);
  } catch (err) {
    if (err.name === "AbortError") meta.textContent = "stopped";
    else { box.className = "msg error"; meta.textContent = String(err.message || err); }
    history.pop();
  } finally {
    ctrl = null; $("send").disabled = false; $("stop").disabled = true;
  }
};
</script></body></html>
)HTML";
    return html;
}

} // namespace perigee::server
