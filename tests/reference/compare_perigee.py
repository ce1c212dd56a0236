#!/usr/bin/python3
"""Compare an engine's `logits` / `generate` CLI against the numpy reference (issue 3 item 5).

    python3 tests/reference/compare_perigee.py --engine build/tools/perigee --model DIR \
        [--lengths 1,7,70,131] [--decode 12] [--decode-prompts 7,70] [--rtol 1e-4] [--seed 0]

Pass criteria (per prompt length): max|logit_engine - logit_ref| <= rtol * max|logit_ref|; greedy tokens
identical (the engine may stop early only on an EOS id of config/generation_config). On a greedy
mismatch the reference's top-2 margin at that step is printed, so a near-tie can be told from a bug.
Prints a JSON summary; exit status 0 = pass, 1 = fail. `--engine` may be a command with arguments
(split on spaces), e.g. "/usr/bin/python3 tests/reference/kimi_ref.py" for a self-check.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref as R  # noqa: E402


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


def parse_ids_output(s):
    s = s.strip()
    if s.startswith("["):
        return [int(x) for x in json.loads(s)]
    return [int(x) for x in s.replace(",", " ").split()]


def eos_ids(model_dir):
    ids = set()
    for fn in ("config.json", "generation_config.json"):
        p = os.path.join(model_dir, fn)
        if not os.path.exists(p):
            continue
        with open(p) as fh:
            j = json.load(fh)
        for src in (j, j.get("text_config") or {}):
            v = src.get("eos_token_id")
            if v is None:
                continue
            ids.update(v if isinstance(v, list) else [v])
    return ids


def logits_ok(ref, eng, rtol):
    if eng.shape != ref.shape:
        return False, float("inf")
    err = float(np.max(np.abs(eng - ref)) / max(np.max(np.abs(ref)), 1e-30))
    return err <= rtol, err


def compare(engine, model_dir, lengths, decode, decode_prompts, rtol, seed):
    m = R.Model(model_dir)
    rng = np.random.default_rng(seed)
    V = m.cfg.vocab
    res = {"model": model_dir, "rtol": rtol, "prefill": [], "decode": [], "pass": True}
    for n in lengths:
        ids = [int(x) for x in rng.integers(0, V, size=n)]
        ref = m.forward(ids)
        margins = dict(m.margins)
        out = run(engine + ["logits", "--model", model_dir, "--ids", ",".join(map(str, ids))])
        eng = np.asarray(json.loads(out)["logits"], dtype=np.float64)
        ok, err = logits_ok(ref, eng, rtol)
        # comparator control: a perturbation just above the tolerance must be reported
        bad = ref.copy()
        bad[-1, int(np.argmax(np.abs(bad[-1])))] += 2.0 * rtol * np.max(np.abs(ref))
        if logits_ok(ref, bad, rtol)[0]:
            raise AssertionError("comparator control passed a perturbed copy")
        argmax_same = bool(eng.shape == ref.shape and np.array_equal(eng.argmax(-1), ref.argmax(-1)))
        res["prefill"].append({"len": n, "ok": ok, "rel_err": err, "argmax_identical": argmax_same,
                               "ref_selection_margins": margins})
        res["pass"] &= ok
    eos = eos_ids(model_dir)
    for n in decode_prompts if decode > 0 else []:
        prompt = [int(x) for x in rng.integers(0, V, size=n)]
        got = parse_ids_output(run(engine + ["generate", "--model", model_dir, "--ids",
                                             ",".join(map(str, prompt)), "-n", str(decode)]))
        seq = list(prompt)
        want, first_diff = [], None
        for i in range(decode):
            row = m.forward(seq)[-1]
            tok = int(np.argmax(row))
            want.append(tok)
            if first_diff is None and i < len(got) and got[i] != tok:
                top = np.sort(row)[::-1]
                first_diff = {"step": i, "engine": got[i], "ref": tok, "ref_top2_margin": float(top[0] - top[1])}
            seq.append(tok)
        early = len(got) < decode and (not got or got[-1] in eos)
        ok = first_diff is None and (len(got) == decode or early) and got == want[:len(got)]
        res["decode"].append({"prompt_len": n, "ok": ok, "engine": got, "ref": want, "first_diff": first_diff})
        res["pass"] &= ok
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, help="engine command (split on spaces)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="1,7,70,131")
    ap.add_argument("--decode", type=int, default=12)
    ap.add_argument("--decode-prompts", default="7,70")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    res = compare(a.engine.split(), a.model, R.parse_ids(a.lengths), a.decode, R.parse_ids(a.decode_prompts),
                  a.rtol, a.seed)
    json.dump(res, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
