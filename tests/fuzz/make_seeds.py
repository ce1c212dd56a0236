#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets into tests/fuzz/corpus/<target>/ (issue 9).

Seeds come from the committed fixtures (configs, golden checkpoints' headers, chat goldens, tokenizer
pre-tokenizer goldens) plus small hand-built valid files and a few defects of each kind (they give the
fuzzer the interesting branches early). Deterministic; re-running rewrites the same files. Small files only.
Usage: python3 tests/fuzz/make_seeds.py [--synth DIR ...]   (DIR: a `perigee synth` output, for its config)
"""
import hashlib, json, os, struct, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
SHARED = os.path.join(ROOT, "..", "shared")


def put(target, data, name=None):
    if isinstance(data, str):
        data = data.encode("utf-8")
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    name = name or hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def shard(tensors, metadata=None, pad=True, raw_header=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    hdr, off, buf = {}, 0, b""
    if metadata is not None:
        hdr["__metadata__"] = metadata
    for name, dt, shape, data in tensors:
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        buf += data
    h = raw_header if raw_header is not None else json.dumps(hdr, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + buf


def safetensors_seeds():
    t = "fuzz_safetensors"
    put(t, shard([("a", "F32", [2, 2], b"\x00" * 16), ("b", "BF16", [3], b"\x01" * 6)], {"format": "pt"}), "valid_f32_bf16")
    put(t, shard([("w", "U8", [4, 8], bytes(range(32))), ("s", "F8_E8M0", [4, 1], b"\x7f" * 4)]), "valid_mxfp4_pair")
    put(t, shard([("q", "F4", [2, 4], b"\x12\x34\x56\x78"), ("e", "F8_E4M3", [2], b"\x38\x40")]), "valid_f4_e4m3")
    put(t, shard([("z", "F32", [0, 3], b""), ("s", "I64", [], b"\x05" + b"\x00" * 7)]), "valid_zero_and_scalar")
    put(t, shard([]), "valid_empty")
    put(t, shard([("x", "F16", [1, 1, 1, 1, 1, 1, 1, 2], b"\x00\x3c" * 2)], {"k": "v", "n": "1"}), "valid_rank8_meta")
    put(t, b"\x04\x00\x00", "defect_short")
    put(t, struct.pack("<Q", 1) + b"{", "defect_one_byte")
    put(t, shard([("a", "F32", [2, 2], b"\x00" * 12)]), "defect_size_mismatch")
    put(t, shard([], raw_header=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + b"\x00" * 8, "defect_dup_key")
    put(t, shard([], raw_header=b'{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}') + b"\x00" * 4, "defect_overflow")
    # Real tensor names and shapes: the header of a golden checkpoint, with a truncated data buffer.
    p = os.path.join(ROOT, "tests", "golden", "kimi_linear", "basic", "model.safetensors")
    if os.path.exists(p):
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n < 60000:
                f.seek(0)
                put(t, f.read(8 + n + 256), "golden_header_truncated")


def index_seeds():
    t = "fuzz_shard_index"
    wm = {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
    put(t, json.dumps({"metadata": {"total_size": 24 + 8 + 5}, "weight_map": wm}, indent=2), "valid")
    put(t, json.dumps({"weight_map": wm}), "valid_no_metadata")
    put(t, json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}), "defect_total_size")
    put(t, json.dumps({"weight_map": dict(wm, z="../b.safetensors")}), "defect_escape")
    put(t, json.dumps({"weight_map": dict(wm, w="stray.safetensors")}), "stray_named")
    put(t, json.dumps({"weight_map": {"x": "a.safetensors"}}), "defect_unlisted")
    put(t, json.dumps({"weight_map": dict(wm, q="missing.safetensors")}), "defect_missing")


def config_seeds(synth_dirs):
    t = "fuzz_config"
    paths = [os.path.join(ROOT, "fixtures", "configs", f) for f in sorted(os.listdir(os.path.join(ROOT, "fixtures", "configs")))]
    g = os.path.join(ROOT, "tests", "golden", "kimi_linear")
    paths += [os.path.join(g, d, "config.json") for d in sorted(os.listdir(g)) if os.path.exists(os.path.join(g, d, "config.json"))]
    paths += [os.path.join(d, "config.json") for d in synth_dirs]
    for p in paths:
        with open(p, "rb") as f:
            put(t, f.read())


def rank_text(tokens):
    import base64
    return "".join(f"{base64.b64encode(tok).decode()} {i}\n" for i, tok in enumerate(tokens))


def ranks_seeds():
    t = "fuzz_tiktoken_ranks"
    byte_toks = [bytes([b]) for b in range(256)]
    put(t, rank_text(byte_toks), "valid_bytes_only")
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"\xe4\xb8", b"\xe4\xb8\xad", b"  ", b"\n\n"]
    put(t, rank_text(byte_toks + merges), "valid_merges")
    put(t, rank_text(byte_toks + merges).replace("\n", "\r\n"), "crlf")
    put(t, rank_text(byte_toks[:255]), "defect_missing_byte")
    put(t, rank_text(byte_toks + [b"th", b"th"]), "defect_duplicate_token")
    put(t, rank_text(byte_toks) + "dGg= 300\n", "defect_gap")
    put(t, rank_text(byte_toks) + "dGg 256\n", "defect_bad_base64")


def pretok_strings(limit=48):
    out = []
    p = os.path.join(SHARED, "kimi-tokenizer", "kimi_pretok_golden.jsonl")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            lines = f.readlines()
        step = max(1, len(lines) // limit)
        for line in lines[::step][:limit]:
            rec = json.loads(line)
            s = rec.get("text") if isinstance(rec, dict) else None
            if s is None and isinstance(rec, dict):
                s = next((v for v in rec.values() if isinstance(v, str)), None)
            if s:
                out.append(s[:1500])
    out += ["Hello, world!", "中文测试，中文测试。", "café naïve 😀👍🏽 👨‍👩‍👧", "a\r\nb\rc\n\n\n  \t x",
            "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|>[EOS]", "_" * 300, "0" * 200,
            "\u202eRTL\u202c \u0301\u0301 \x00 nul"]
    return out


def tokenizer_seeds():
    for i, s in enumerate(pretok_strings()):
        put("fuzz_tokenizer_roundtrip", bytes([i % 8]) + s.encode("utf-8"))
    put("fuzz_tokenizer_roundtrip", b"\x00a\xc0\x80b", "invalid_overlong")
    put("fuzz_tokenizer_roundtrip", b"\x00\xed\xa0\x80", "invalid_surrogate")


def stream_seeds():
    def ids(seq, flags=0):
        return bytes([flags]) + b"".join(struct.pack("<H", v) for v in seq)
    t = "fuzz_stream_decoder"
    put(t, ids(list("héllo 中文 😀".encode())), "bytes_utf8")         # byte tokens = byte values
    put(t, ids([0xE4, 0xB8]), "cut_3byte")
    put(t, ids([0xF0, 0x9F, 0x98]), "cut_4byte")
    put(t, ids([0xC0, 0x80, 0x41]), "overlong")
    put(t, ids([0xED, 0xA0, 0x80, 0x41]), "surrogate")
    put(t, ids([0xF4, 0x90, 0x80, 0x80]), "above_max")
    put(t, ids([300, 301, 302, 1000, 0xE4, 0xB8, 0xAD], 1), "merges_skip_special")


def k3_outputs():
    out = [
        "hmm<|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>",
        "a<|close|>think<|sep|><|open|>response<|sep|>b<|clo",
        "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"b\" index=\"2\"<|sep|><|open|>argument key=\"k\" type=\"number\"<|sep|>7<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>json<|sep|>{\"a\": [1, 2, {\"b\": null}]}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        "Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
    ]
    p = os.path.join(SHARED, "kimi-tokenizer", "k3_render_golden.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            for g in json.load(f):
                text = "".join(s["text"] for s in g["segments"])
                key = "role=\"assistant\""
                if key in text:
                    tail = text[text.rfind(key):]
                    out.append(tail[tail.find("<|sep|>") + len("<|sep|>"):][:8000])
    return out


def k2_outputs():
    return [
        "<think>let me check</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|><|tool_call_begin|> functions.get_weather:1 "
        "<|tool_call_argument_begin|>{\"city\": \"Shanghai\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
        "thinking<|tool_call_begin|>search:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"",
        "plain answer 中文 😀<|im_end|>",
        "</think>after<think>nested<think>x</think>",
    ]


def parser_seeds():
    for i, s in enumerate(k3_outputs()):
        put("fuzz_k3_parser", bytes([i & 1, i * 37 & 255]) + s.encode("utf-8"))
    for i, s in enumerate(k2_outputs()):
        put("fuzz_k2_parser", bytes([i & 1, i * 37 & 255]) + s.encode("utf-8"))


def server_seeds():
    t = "fuzz_server_request"
    chat = [
        {"model": "perigee-fuzz", "messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["\n", "END"], "stream": True, "stream_options": {"include_usage": True}},
        {"messages": [{"role": "user", "content": "weather?"}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
         "tool_choice": "auto"},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "user", "content": "and?"}],
         "reasoning_effort": "high", "chat_template_kwargs": {"thinking": True}},
        {"messages": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "y"}], "response_format": {"type": "json_object"}, "seed": 7, "n": 1},
        {"messages": [{"role": "user", "content": "z"}], "tool_choice": {"type": "function", "function": {"name": "g"}},
         "tools": [{"type": "function", "function": {"name": "g", "parameters": {}}}], "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2},
    ]
    for i, c in enumerate(chat):
        put(t, b"\x00" + json.dumps(c).encode(), f"chat_{i}")
    comp = [{"prompt": "Once upon a time", "max_tokens": 8, "echo": True},
            {"prompt": [1, 2, 3], "stop_token_ids": [5], "ignore_eos": True, "logprobs": 1},
            {"prompt": "x", "stream": True, "frequency_penalty": 0.5, "presence_penalty": -0.5, "top_k": 40, "min_p": 0.1}]
    for i, c in enumerate(comp):
        put(t, b"\x01" + json.dumps(c).encode(), f"completion_{i}")
    put(t, b"\x02" + json.dumps({"prompt": "hello", "return_token_strs": True}).encode(), "tokenize_prompt")
    put(t, b"\x02" + json.dumps({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}).encode(), "tokenize_messages")
    put(t, b"\x03" + json.dumps({"tokens": [1, 2, 3]}).encode(), "detokenize")
    put(t, b'\x00{"messages":[{"role":"user","content":"a"}],"messages":[]}', "defect_dup_key")
    put(t, b'\x00{"messages":[{"role":"user","content":"a"}],"max_tokens":10.0}', "defect_float_int")
    put(t, b"\x00" + b"[" * 100 + b"]" * 100, "defect_deep")


def repack_seeds():
    t = "fuzz_mxfp4_repack"
    put(t, bytes([1, 0, 1, 120]) + bytes(range(1, 17)) + bytes([3]), "one_block_narrow")
    put(t, bytes([3, 2, 2, 100]) + bytes((i * 7 + 1) & 255 for i in range(96 + 9)), "spread_19")
    put(t, bytes([0, 0, 0, 0]) + b"\x00" * 16 + b"\x7f", "all_zero_nibbles")
    put(t, bytes([1, 1, 3, 0]) + b"\x77\x88\xff\x00" * 8 + b"\x01\xfe", "extreme_scales")
    put(t, bytes([0, 0, 0x41, 0]) + b"\x11" * 16 + b"\x80", "nan_scale")
    put(t, bytes([7, 7, 0x81, 110]) + bytes((i * 13 + 5) & 255 for i in range(64 * 8 + 64)), "normal_only")


def main():
    synth = [a for a in sys.argv[1:] if not a.startswith("--")]
    safetensors_seeds(); index_seeds(); config_seeds(synth); ranks_seeds(); tokenizer_seeds()
    stream_seeds(); parser_seeds(); server_seeds(); repack_seeds()
    for d in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, d))
        print(f"{d}: {len(files)} seeds, {sum(os.path.getsize(os.path.join(CORPUS, d, f)) for f in files)} bytes")


if __name__ == "__main__":
    main()
