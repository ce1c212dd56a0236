#!/usr/bin/python3
"""CI parity checks of the shipped trained models (issue 8) against the trainer's records.

    check_trained.py --engine PERIGEE --model models/default --record expected.json --name default

1. `perigee perplexity --file heldout-slice.txt --context C --json` equals the trainer's recorded value
   (tools/train/train.py, fp32 on the GPU) within 0.5% relative.
2. `perigee logits` on the committed prompts (prompts.json) equals the trainer's recorded logits
   (logits-<name>.f32: fp64 CPU forward of the exported weights, stored fp32, the last ROWS rows of each
   prompt): max|d| <= 1e-3 * max|ref| per prompt.
Controls: each comparator is also run on a perturbed record and must report failure.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"FAIL: {' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    return p.stdout


def ppl_ok(eng, rec, rtol=5e-3):
    return abs(eng - rec) <= rtol * abs(rec)


def logits_ok(eng, ref, rtol=1e-3):
    err = float(np.abs(eng - ref).max() / np.abs(ref).max())
    return err <= rtol, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True, help="record key: default or k31")
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args()
    with open(os.path.join(HERE, "expected.json")) as fh:
        rec = json.load(fh)[a.name]
    fails = []
    # 1. perplexity
    out = json.loads(run([a.engine, "perplexity", "--model", a.model, "--file", os.path.join(HERE, "heldout-slice.txt"),
                          "--context", str(a.context), "--json"]))
    want = rec["slice_ppl"][str(a.context)]
    ok = ppl_ok(out["ppl"], want)
    print(f"{a.name}: perplexity engine {out['ppl']:.6f} trainer {want:.6f} rel {abs(out['ppl'] - want) / want:.2e} "
          f"({out['tokens_scored']} tokens, {out['tokens_per_second']:.1f} tok/s) {'ok' if ok else 'FAIL'}")
    if not ok:
        fails.append("perplexity")
    if ppl_ok(out["ppl"], want * 1.01):
        fails.append("perplexity control (a 1% perturbed record passed)")
    # 2. logits
    with open(os.path.join(HERE, "prompts.json")) as fh:
        prompts = json.load(fh)["prompts"]
    rows = rec["logit_rows"]
    V = rec["vocab"]
    ref = np.fromfile(os.path.join(HERE, f"logits-{a.name}.f32"), dtype="<f4").reshape(len(prompts), rows, V)
    for i, p in enumerate(prompts):
        o = json.loads(run([a.engine, "logits", "--model", a.model, "--ids", ",".join(map(str, p["ids"]))]))
        eng = np.array(o["logits"], dtype=np.float64)[-rows:]
        ok, err = logits_ok(eng, ref[i].astype(np.float64))
        print(f"{a.name}: logits {p['name']} ({len(p['ids'])} ids) max|d|/max|ref| {err:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append(f"logits {p['name']}")
        bad = ref[i].astype(np.float64).copy()
        bad[0, int(np.argmax(bad[0]))] += 0.01 * np.abs(bad).max()
        if logits_ok(eng, bad)[0]:
            fails.append(f"logits control {p['name']} (a perturbed record passed)")
    if fails:
        print("FAILED:", "; ".join(fails))
        return 1
    print(f"{a.name}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
