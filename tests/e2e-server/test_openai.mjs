// End-to-end: the official `openai` npm client, unchanged, against `perigee serve` on 127.0.0.1.
//  * mock engine (deterministic; scripted tool calls / replies rendered in the K3 chat format, so
//    the server's real output parser runs): chat + completions, stream + non-stream,
//    include_usage, tool-call round trip (streamed and not), stop strings, error types.
//  * real engine on a synthetic k3-tiny-v512 checkpoint (CPU): greedy completions are repeatable
//    and streamed == non-streamed; a chat stream ends with finish_reason and [DONE].
// Env: PERIGEE_BIN (the perigee executable), PERIGEE_E2E_NO_REAL=1 skips the real-engine part.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";

const here = path.dirname(fileURLToPath(import.meta.url));
const bin = process.env.PERIGEE_BIN || path.join(here, "../../build/tools/perigee");
const KEY = "e2e-test-key";
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "perigee-e2e-"));
const servers = [];

function startServer(args) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ["serve", "--port", "0", ...args], { stdio: ["ignore", "ignore", "pipe"] });
    servers.push(p);
    let err = "";
    const timer = setTimeout(() => reject(new Error("server did not start: " + err)), 60000);
    p.stderr.on("data", (d) => {
      err += d.toString();
      const m = err.match(/Listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) { clearTimeout(timer); resolve({ proc: p, port: Number(m[1]) }); }
    });
    p.on("exit", (code) => { clearTimeout(timer); reject(new Error(`server exited ${code}: ${err}`)); });
  });
}

let mock, client;
const tools = [{ type: "function", function: { name: "get_weather", description: "weather of a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];

before(async () => {
  const tokdir = path.join(tmp, "tok");
  execFileSync("python3", [path.join(here, "make_tiny_tokenizer.py"), tokdir]);
  mock = await startServer(["--model", tokdir, "--mock-engine", "--served-model-name", "tiny", "--api-key", KEY,
                            "--max-num-seqs", "4", "--max-model-len", "2048"]);
  client = new OpenAI({ baseURL: `http://127.0.0.1:${mock.port}/v1`, apiKey: KEY, maxRetries: 0 });
});

after(() => {
  for (const p of servers) p.kill("SIGTERM");
  fs.rmSync(tmp, { recursive: true, force: true });
});

test("models.list", async () => {
  const models = await client.models.list();
  assert.equal(models.data[0].id, "tiny");
  assert.equal(models.data[0].object, "model");
});

test("chat non-stream: content, reasoning, usage", async () => {
  const r = await client.chat.completions.create({ model: "tiny", messages: [{ role: "user", content: "MOCK_SAY:Hello from perigee" }] });
  assert.equal(r.object, "chat.completion");
  assert.equal(r.choices[0].message.role, "assistant");
  assert.equal(r.choices[0].message.content, "Hello from perigee");
  assert.equal(r.choices[0].message.reasoning_content, "thinking about it");
  assert.equal(r.choices[0].finish_reason, "stop");
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test("chat stream with include_usage equals non-stream", async () => {
  const req = { model: "tiny", messages: [{ role: "system", content: "be brief" }, { role: "user", content: "MOCK_SAY:streamed words" }] };
  const whole = await client.chat.completions.create(req);
  const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  let content = "", reasoning = "", finish = null, usage = null, n = 0;
  for await (const chunk of stream) {
    n++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      content += c.delta.content ?? "";
      reasoning += c.delta.reasoning_content ?? "";
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.ok(n >= 3);
  assert.equal(content, whole.choices[0].message.content);
  assert.equal(reasoning, whole.choices[0].message.reasoning_content);
  assert.equal(finish, "stop");
  assert.deepEqual(usage, whole.usage);
});

test("completions stream and non-stream", async () => {
  const req = { model: "tiny", prompt: "Once upon a time", max_tokens: 12, temperature: 0 };
  const whole = await client.completions.create(req);
  assert.equal(whole.object, "text_completion");
  assert.equal(whole.choices[0].finish_reason, "length");
  assert.equal(whole.usage.completion_tokens, 12);
  let text = "", finish = null;
  for await (const chunk of await client.completions.create({ ...req, stream: true })) {
    for (const c of chunk.choices) { text += c.text; if (c.finish_reason) finish = c.finish_reason; }
  }
  assert.equal(text, whole.choices[0].text);
  assert.equal(finish, "length");
});

test("stop strings are not returned or streamed", async () => {
  const r = await client.chat.completions.create({ model: "tiny", stop: ["STOP"], messages: [{ role: "user", content: "MOCK_SAY:before STOP after" }] });
  assert.equal(r.choices[0].message.content, "before ");
  let text = "";
  for await (const chunk of await client.chat.completions.create({ model: "tiny", stop: "STOP", stream: true,
      messages: [{ role: "user", content: "MOCK_SAY:before STOP after" }] })) {
    for (const c of chunk.choices) text += c.delta.content ?? "";
  }
  assert.equal(text, "before ");
});

test("tool call round trip (non-stream)", async () => {
  const messages = [{ role: "user", content: "MOCK_TOOL_CALL:get_weather" }];
  const r = await client.chat.completions.create({ model: "tiny", messages, tools, tool_choice: "auto" });
  const choice = r.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.type, "function");
  assert.equal(call.function.name, "get_weather");
  assert.deepEqual(JSON.parse(call.function.arguments), { city: "Paris" });
  messages.push(choice.message);
  messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify({ temp: 21 }) });
  const r2 = await client.chat.completions.create({ model: "tiny", messages, tools });
  assert.equal(r2.choices[0].message.content, "tool result received");
  assert.equal(r2.choices[0].finish_reason, "stop");
});

test("tool call deltas (stream) accumulate to the same call", async () => {
  const stream = await client.chat.completions.create({ model: "tiny", stream: true, tools,
    messages: [{ role: "user", content: "MOCK_TOOL_CALL:get_weather" }] });
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      for (const tc of c.delta.tool_calls ?? []) {
        calls[tc.index] ??= { id: tc.id, name: "", arguments: "" };
        if (tc.function?.name) calls[tc.index].name += tc.function.name;
        if (tc.function?.arguments) calls[tc.index].arguments += tc.function.arguments;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(finish, "tool_calls");
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, "get_weather");
  assert.ok(calls[0].id);
  assert.deepEqual(JSON.parse(calls[0].arguments), { city: "Paris" });
});

test("error types", async () => {
  await assert.rejects(client.chat.completions.create({ model: "tiny", temperature: 5, messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === "temperature" && e.type === "invalid_request_error");
  await assert.rejects(client.chat.completions.create({ model: "tiny", n: 2, messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  await assert.rejects(client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found");
  await assert.rejects(client.chat.completions.create({ model: "tiny", max_tokens: 100000, messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof OpenAI.BadRequestError && e.code === "context_length_exceeded");
  const bad = new OpenAI({ baseURL: `http://127.0.0.1:${mock.port}/v1`, apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});

test("real engine on a synthetic K3 checkpoint", { skip: process.env.PERIGEE_E2E_NO_REAL ? "PERIGEE_E2E_NO_REAL set" : false }, async () => {
  const dir = path.join(tmp, "k3-tiny-v512");
  execFileSync(bin, ["synth", "--preset", "k3-tiny-v512", "--out", dir]);
  execFileSync("python3", [path.join(here, "make_tiny_tokenizer.py"), dir]);
  const real = await startServer(["--model", dir, "--served-model-name", "k3-tiny", "--max-num-seqs", "2", "--max-model-len", "512"]);
  const c = new OpenAI({ baseURL: `http://127.0.0.1:${real.port}/v1`, apiKey: "none", maxRetries: 0, timeout: 120000 });
  const req = { model: "k3-tiny", prompt: [65, 66, 67, 68], max_tokens: 4, temperature: 0 };
  const a = await c.completions.create(req);
  const b = await c.completions.create(req);
  assert.equal(a.usage.completion_tokens, 4);
  assert.equal(a.choices[0].text, b.choices[0].text, "greedy decoding must repeat");
  let text = "";
  for await (const chunk of await c.completions.create({ ...req, stream: true })) for (const x of chunk.choices) text += x.text;
  assert.equal(text, a.choices[0].text);
  let finish = null;
  for await (const chunk of await c.chat.completions.create({ model: "k3-tiny", stream: true, max_tokens: 2,
      messages: [{ role: "user", content: "hi" }], chat_template_kwargs: { thinking: false } })) {
    for (const x of chunk.choices) if (x.finish_reason) finish = x.finish_reason;
  }
  assert.ok(["length", "stop", "tool_calls"].includes(finish), String(finish));
});
