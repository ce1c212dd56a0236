// Differential-fuzz oracle for tests/unit/tokenizer: generates random Unicode strings with a
// seeded PRNG and prints, one JSON object per line, {"text": ..., "ids": [...]} as encoded by the
// tiktoken Rust core (npm tiktoken@1.0.22, WASM) with the given rank file and pattern.
// usage: node fuzz_oracle.cjs RANK_FILE PATTERN_FILE SEED COUNT [MAX_LEN]
"use strict";
const fs = require("fs");
const path = require("path");
const { Tiktoken } = require(path.join(__dirname, "node_modules/tiktoken/lite/tiktoken.cjs"));

const [rankFile, patFile, seedArg, countArg, maxLenArg] = process.argv.slice(2);
const pat = fs.readFileSync(patFile, "utf8");
const enc = new Tiktoken(fs.readFileSync(rankFile, "utf8"), { "<|oracle_special|>": 1000000 }, pat);

// mulberry32
let state = (Number(seedArg) >>> 0) || 1;
function rnd() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pick = (a) => a[Math.floor(rnd() * a.length)];
const range = (lo, hi) => lo + Math.floor(rnd() * (hi - lo + 1));

// Code point sources (assigned before Unicode 15.0, so PCRE2 10.42 and the oracle agree).
const gens = [
  () => range(0x61, 0x7a), () => range(0x41, 0x5a), () => range(0x30, 0x39),
  () => pick([0x20, 0x20, 0x20, 0x0a, 0x0d, 0x09, 0x0b, 0x0c, 0x85, 0xa0, 0x1680, 0x2000, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000, 0x180e, 0x1c, 0x1f]),
  () => pick([0x21, 0x22, 0x23, 0x27, 0x27, 0x27, 0x2c, 0x2e, 0x2f, 0x3a, 0x3b, 0x3c, 0x3e, 0x5b, 0x5d, 0x5f, 0x7b, 0x7c, 0x7d, 0x2019, 0x201c]),
  () => pick([0x73, 0x74, 0x6d, 0x64, 0x53, 0x54, 0x4c, 0x52, 0x56, 0x17f, 0x212a]),  // contraction letters, ſ, Kelvin
  () => range(0xc0, 0x24f), () => range(0x370, 0x3ff), () => range(0x400, 0x4ff),
  () => range(0x300, 0x36f),  // combining marks
  () => range(0x4e00, 0x9fff), () => range(0x3400, 0x4dbf), () => range(0x3000, 0x303f),
  () => range(0x2e80, 0x2ef3), () => range(0x2f00, 0x2fd5), () => range(0x3040, 0x30ff),
  () => range(0xac00, 0xd7a3), () => range(0x600, 0x6ff), () => range(0x900, 0x97f), () => range(0xe00, 0xe5b),
  () => range(0x1f300, 0x1f64f), () => pick([0x200d, 0xfe0f, 0xfeff, 0x1f3fb]),
  () => range(0xff01, 0xff5e), () => range(0x2150, 0x218b), () => range(0x660, 0x669),
  () => range(0x20000, 0x2a6df), () => range(0x1, 0x1f), () => range(0x7f, 0xbf),
  () => range(0x1d400, 0x1d7ff), () => range(0x10a0, 0x10ff), () => range(0x1e00, 0x1eff),
];
const maxLen = Number(maxLenArg || 40);
const count = Number(countArg);
const out = [];
for (let n = 0; n < count; n++) {
  const len = 1 + Math.floor(rnd() * maxLen);
  const g = [pick(gens), pick(gens), pick(gens)];  // a few sources per string, so runs form
  let s = "";
  for (let i = 0; i < len; i++) s += String.fromCodePoint(pick(g)());
  const ids = Array.from(enc.encode(s, [], []));
  out.push(JSON.stringify({ text: s, ids }));
}
enc.free();
process.stdout.write(out.join("\n") + "\n");
