#!/usr/bin/python3
"""Writes the committed CI inputs for the trained-model parity tests (run once, before training):
tests/golden/trained/heldout-slice.txt (the first lines of the held-out split, about 600 tokens) and
tests/golden/trained/prompts.json (three prompts of >= 100 tokens: plain text and two K3 chat renders,
long enough that the K3.1 indexer selects with index_topk 64)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import data as D  # noqa: E402
import kimi_bpe  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
tok = sys.argv[1]
enc = kimi_bpe.Encoder.load(tok)
text = open("/work/shared/data/tinyshakespeare.txt").read() if len(sys.argv) < 3 else open(sys.argv[2]).read()
_, val = D.split(text)
lines = val.split("\n")
out, n = [], 0
for ln in lines:
    out.append(ln)
    n = len(enc.encode_ordinary("\n".join(out) + "\n"))
    if n >= 600:
        break
sl = "\n".join(out) + "\n"
gold = os.path.join(ROOT, "tests", "golden", "trained")
open(os.path.join(gold, "heldout-slice.txt"), "w").write(sl)
rest = "\n".join(lines[len(out):len(out) + 60])
plain = enc.encode_ordinary(rest)[:110]
r = D.Renderer(enc)
sp = D.speeches(rest)
chat1 = r.message([("role", "system")], r.text("You are GREMIO.")) + \
    r.message([("role", "user")], r.text(sp[0][1])) + r.generation_prompt(True)
chat2 = r.message([("role", "user")], r.text(sp[2][1])) + \
    r.message([("role", "assistant")], r.assistant_body(sp[3][1], False)) + \
    r.message([("role", "user")], r.text(sp[4][1])) + r.generation_prompt(False)
prompts = [{"name": "plain", "ids": plain}, {"name": "chat_think", "ids": chat1}, {"name": "chat_multi", "ids": chat2}]
for p in prompts:
    p["text"] = enc.decode(p["ids"])
json.dump({"note": "token ids for the trained-model logits parity test; text is informational",
           "prompts": prompts}, open(os.path.join(gold, "prompts.json"), "w"), indent=1)
print("slice tokens", n, [len(p["ids"]) for p in prompts])
