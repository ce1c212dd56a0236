#!/usr/bin/python3
"""Training data for the embedded default model (plain Python, runs on the CPU machine).

  split   tinyshakespeare.txt -> train.txt / val.txt. The held-out split is the last 10% by bytes, cut
          at a line boundary (shared/data/README.md): val starts after the first '\\n' at or after byte
          floor(0.9 * N).
  ids     train_plain.u16: encode_ordinary(train.txt); val.u16: encode_ordinary(val.txt);
          train_chat.u16: consecutive speeches of the training split rendered as K3 XTML conversations
          (TOKENIZER §7: one speaker as user, the next as assistant), encoded segment by segment as
          K3's apply_chat_template does (structural markers are special ids, text segments are
          encoded with no special recognition, BPE never crosses a segment boundary).
All id files are little-endian uint16.
"""

import argparse
import array
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_bpe  # noqa: E402


def split(text):
    cut = len(text.encode()) * 9 // 10
    assert text.isascii()
    nl = text.index("\n", cut)
    return text[:nl + 1], text[nl + 1:]


def speeches(text):
    """[(speaker, speech text)] from blank-line separated blocks 'NAME:\\nline\\n...'."""
    out = []
    for block in text.split("\n\n"):
        lines = [x for x in block.strip("\n").split("\n") if x.strip()]
        if len(lines) >= 2 and lines[0].endswith(":") and len(lines[0]) < 40:
            out.append((lines[0][:-1].strip(), "\n".join(lines[1:]).strip()))
    return out


class Renderer:
    """K3 XTML segments -> ids (TOKENIZER §7.1, §7.4, §4.5)."""

    def __init__(self, enc):
        self.enc = enc
        self.OPEN, self.CLOSE = enc.special("<|open|>"), enc.special("<|close|>")
        self.SEP, self.EOM = enc.special("<|sep|>"), enc.special("<|end_of_msg|>")

    def text(self, s):
        return self.enc.encode_ordinary(s) if s else []

    def open(self, tag, attrs=()):
        ids = [self.OPEN] + self.text(tag)
        for k, v in attrs:
            v = str(v).replace("&", "&amp;").replace('"', "&quot;")
            ids += self.text(" " + k) + self.text('="') + self.text(v) + self.text('"')
        return ids + [self.SEP]

    def close(self, tag):
        return [self.CLOSE] + self.text(tag) + [self.SEP]

    def message(self, attrs, body):
        return self.open("message", attrs) + body + self.close("message") + [self.EOM]

    def assistant_body(self, content, thinking):
        ids = []
        if thinking:
            ids += self.open("think") + self.close("think")
        return ids + self.open("response") + self.text(content) + self.close("response")

    def generation_prompt(self, thinking):
        return self.open("message", [("role", "assistant")]) + (self.open("think") if thinking else self.open("response"))


def chat_stream(enc, train_text, seed=1234):
    rng = random.Random(seed)
    r = Renderer(enc)
    sp = speeches(train_text)
    out = []
    n_conv = 0
    i = 0
    while i + 1 < len(sp):
        turns = rng.choice([1, 1, 2, 3])
        chunk = sp[i:i + 2 * turns]
        if len(chunk) % 2:
            chunk = chunk[:-1]
        thinking = rng.random() < 0.5
        ids = []
        if rng.random() < 0.5:
            ids += r.message([("role", "system")], r.text(f"You are {chunk[1][0]}."))
        for j in range(0, len(chunk), 2):
            (ua, ut), (aa, at) = chunk[j], chunk[j + 1]
            uattrs = [("role", "user")] + ([("name", ua)] if rng.random() < 0.3 else [])
            ids += r.message(uattrs, r.text(ut))
            ids += r.message([("role", "assistant")], r.assistant_body(at, thinking))
        out.extend(ids)
        n_conv += 1
        i += max(1, len(chunk) - 1)
    return out, n_conv


def write_u16(path, ids):
    assert max(ids) < 65536
    a = array.array("H", ids)
    if sys.byteorder != "little":
        a.byteswap()
    with open(path, "wb") as fh:
        a.tofile(fh)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="tinyshakespeare.txt")
    ap.add_argument("--tok", required=True, help="dir with tiktoken.model + tokenizer_config.json")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.data) as fh:
        text = fh.read()
    train, val = split(text)
    os.makedirs(a.out, exist_ok=True)
    for name, t in (("train.txt", train), ("val.txt", val)):
        with open(os.path.join(a.out, name), "w") as fh:
            fh.write(t)
    enc = kimi_bpe.Encoder.load(a.tok)
    plain = enc.encode_ordinary(train)
    vids = enc.encode_ordinary(val)
    chat, n_conv = chat_stream(enc, train)
    write_u16(os.path.join(a.out, "train_plain.u16"), plain)
    write_u16(os.path.join(a.out, "val.u16"), vids)
    write_u16(os.path.join(a.out, "train_chat.u16"), chat)
    print(f"data: train {len(train)} B -> {len(plain)} ids; val {len(val)} B -> {len(vids)} ids; "
          f"chat {n_conv} conversations -> {len(chat)} ids")


if __name__ == "__main__":
    main()
