#!/usr/bin/python3
"""Byte-level BPE for the embedded default model, in the Kimi tiktoken layout (TOKENIZER.md §2-§4).

Plain Python (no `regex` package needed): the training text is ASCII (checked), and on ASCII input the
Kimi pre-tokenizer pattern (TOKENIZER §3.1) reduces exactly to ASCII_PAT below:
  * no Han code points, so alternative 1 never matches;
  * \\p{L} = [A-Za-z], \\p{Lu}/\\p{Lt} upper-case letters, \\p{Ll} lower-case, \\p{Lm}/\\p{Lo}/\\p{M} empty;
  * \\p{N} = [0-9]; \\s (Unicode White_Space) = [\\t\\n\\v\\f\\r ];
  * the contraction group (?i:'s|'t|'re|'ve|'m|'ll|'d) with ASCII case folding (U+017F is not ASCII).
The engine (src/tokenizer, full pattern, PCRE2) and tiktoken give the same pieces on ASCII text; the
tokenizer test in tools/train/check_tokenizer.sh compares ids against `perigee tokenize`.

Encoding follows tiktoken (§4.1): whole-piece lookup first, then repeatedly merge the adjacent pair
whose concatenation has the lowest rank (leftmost on ties). Ranks 0..255 are the single bytes in the
GPT-2 bytes_to_unicode order Kimi uses (§2.1); merges follow in training order. The 256 ids after the
last rank are the reserved special tokens, named from tokenizer_config.json as in K3 (§2.2, §2.3).
"""

import base64
import collections
import json
import os
import re
import sys

_S = r"[\t\n\x0b\x0c\r ]"
_NS = r"[^\t\n\x0b\x0c\r ]"
_CONTR = r"(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
ASCII_PAT = re.compile(
    r"[^\r\nA-Za-z0-9]?[A-Z]*[a-z]+" + _CONTR +
    r"|[^\r\nA-Za-z0-9]?[A-Z]+[a-z]*" + _CONTR +
    r"|[0-9]{1,3}"
    r"| ?[^\t\n\x0b\x0c\r A-Za-z0-9]+[\r\n]*"
    r"|" + _S + r"*[\r\n]+"
    r"|" + _S + r"+(?!" + _NS + r")"
    r"|" + _S + r"+")

# K3 named special tokens: offset from the first special id -> (name, HF "special" flag) (TOKENIZER §2.3,
# K3 table: ids 163584 + offset).
K3_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True), 3: ("<|open|>", False),
    4: ("<|close|>", False), 5: ("<|sep|>", False), 6: ("[start_header_id]", True),
    7: ("[end_header_id]", True), 9: ("[EOT]", True), 18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True), 254: ("[UNK]", True), 255: ("[PAD]", True),
}
N_RESERVED = 256


def byte_order():
    """Bytes in GPT-2 bytes_to_unicode order: the printable ranges first, then the rest ascending."""
    first = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    rest = [b for b in range(256) if b not in set(first)]
    return first + rest


def pieces(text):
    if not text.isascii():
        bad = next(i for i, ch in enumerate(text) if ord(ch) > 127)
        raise ValueError(f"kimi_bpe: non-ASCII character at offset {bad}; the ASCII pattern does not apply")
    out = ASCII_PAT.findall(text)
    assert "".join(out) == text, "kimi_bpe: pre-tokenizer dropped characters"
    return out


def train(text, n_ranks):
    """Returns the list of token byte strings, index = rank."""
    order = byte_order()
    vocab = [bytes([b]) for b in order]
    rank_of = {v: i for i, v in enumerate(vocab)}
    counts = collections.Counter(pieces(text))
    words = []   # [list of ids, count]
    for p, c in counts.items():
        words.append([[rank_of[bytes([b])] for b in p.encode()], c])
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for wi, (ids, c) in enumerate(words):
        for a, b in zip(ids, ids[1:]):
            pair_count[(a, b)] += c
            where[(a, b)].add(wi)
    while len(vocab) < n_ranks:
        if not pair_count:
            break
        # most frequent pair; ties -> lowest (left rank, right rank), deterministic
        best = min(pair_count.items(), key=lambda kv: (-kv[1], kv[0]))
        (a, b), cnt = best
        if cnt < 2:
            break
        new = len(vocab)
        nb = vocab[a] + vocab[b]
        if nb in rank_of:      # a concatenation that already exists cannot get a second rank
            del pair_count[(a, b)]
            continue
        vocab.append(nb)
        rank_of[nb] = new
        for wi in list(where[(a, b)]):
            ids, c = words[wi]
            for x, y in zip(ids, ids[1:]):
                pair_count[(x, y)] -= c
                if pair_count[(x, y)] <= 0:
                    del pair_count[(x, y)]
            merged = []
            i = 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(ids[i])
                    i += 1
            words[wi][0] = merged
            for x, y in zip(merged, merged[1:]):
                pair_count[(x, y)] += c
                where[(x, y)].add(wi)
        del where[(a, b)]
    return vocab


class Encoder:
    """tiktoken-semantics encoder over a rank list (ids = ranks), plus the reserved specials."""

    def __init__(self, vocab, specials):
        self.vocab = vocab
        self.rank = {v: i for i, v in enumerate(vocab)}
        self.specials = specials            # name -> id
        self.cache = {}

    @classmethod
    def load(cls, model_dir):
        vocab = []
        with open(os.path.join(model_dir, "tiktoken.model")) as fh:
            for n, line in enumerate(fh):
                if not line.strip():
                    continue
                b64, r = line.split()
                if int(r) != len(vocab):
                    raise ValueError(f"{model_dir}/tiktoken.model line {n + 1}: rank {r}, expected {len(vocab)}")
                vocab.append(base64.b64decode(b64))
        with open(os.path.join(model_dir, "tokenizer_config.json")) as fh:
            cfg = json.load(fh)
        specials = {}
        for i in range(len(vocab), len(vocab) + N_RESERVED):
            e = cfg.get("added_tokens_decoder", {}).get(str(i))
            specials[e["content"] if e else f"<|reserved_token_{i}|>"] = i
        return cls(vocab, specials)

    def bpe(self, piece):
        b = piece.encode()
        if b in self.rank:
            return [self.rank[b]]
        parts = [bytes([x]) for x in b]
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.rank.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        return [self.rank[p] for p in parts]

    def encode_ordinary(self, text):
        out = []
        for p in pieces(text):
            ids = self.cache.get(p)
            if ids is None:
                ids = self.cache[p] = self.bpe(p)
            out.extend(ids)
        return out

    def decode(self, ids):
        inv = {v: k.encode() for k, v in self.specials.items()}
        return b"".join(self.vocab[i] if i < len(self.vocab) else inv[i] for i in ids).decode("utf-8", "replace")

    def special(self, name):
        return self.specials[name]


def tokenizer_config(n_ranks):
    """tokenizer_config.json of the K3 shape (TikTokenTokenizer, 16 named specials after the ranks)."""
    atd = {}
    for off, (name, sp) in sorted(K3_SPECIALS.items()):
        atd[str(n_ranks + off)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": sp}
    return {
        "added_tokens_decoder": atd,
        "additional_special_tokens": ["<|end_of_msg|>", "[start_header_id]", "[end_header_id]", "[EOT]",
                                      "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                                      "<osagent_mode>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write(vocab, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as fh:
        for i, v in enumerate(vocab):
            fh.write(f"{base64.b64encode(v).decode()} {i}\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tokenizer_config(len(vocab)), fh, indent=2)
        fh.write("\n")


def main():
    import argparse
    ap = argparse.ArgumentParser(description="train the Kimi-layout BPE on the training split")
    ap.add_argument("--text", required=True, help="training text (ASCII)")
    ap.add_argument("--vocab", type=int, default=4096, help="total vocabulary incl. 256 reserved specials")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.text) as fh:
        text = fh.read()
    vocab = train(text, a.vocab - N_RESERVED)
    if len(vocab) != a.vocab - N_RESERVED:
        sys.exit(f"kimi_bpe: only {len(vocab)} ranks could be learned, wanted {a.vocab - N_RESERVED}")
    write(vocab, a.out)
    print(f"kimi_bpe: {len(vocab)} ranks + {N_RESERVED} specials -> {a.out}")


if __name__ == "__main__":
    main()
