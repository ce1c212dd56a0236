#!/usr/bin/python3
"""CPU self-test of the trainer's model and export, before any GPU time is spent.

Builds a randomly initialised (perturbed so every parameter matters) K3 or K3.1 model, exports it,
reads it back, and compares the trainer's forward (fp64, recurrent and chunked KDA) with the
independent numpy reference tests/reference/kimi_ref.py and, if given, the engine's `logits` CLI.

    /usr/bin/python3 tools/train/selftest.py --tok DIR [--k31] [--engine build-x/tools/perigee] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "reference"))
import export as X  # noqa: E402
import k3model as M  # noqa: E402
import kimi_ref as R  # noqa: E402


def perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_res" in n or "attn_res" in n or n.endswith("norm.weight") or "k_norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            if n.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2)
            if ".w1" in n or ".w3" in n or ".w2" in n:
                p.mul_(3.0)
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.copy_(0.05 * torch.randn(m.E, generator=gen))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", required=True)
    ap.add_argument("--k31", action="store_true")
    ap.add_argument("--engine")
    ap.add_argument("--out", default="/tmp/trainer-selftest")
    ap.add_argument("--len", type=int, default=40)
    ap.add_argument("--topk", type=int, default=16)
    a = ap.parse_args()
    n_ranks = sum(1 for _ in open(os.path.join(a.tok, "tiktoken.model")))
    g = M.default_geometry(n_ranks + 256)
    g["index_topk"] = a.topk
    torch.manual_seed(0)
    model = M.K3(g, k31=a.k31)
    perturb(model, 1)
    X.export(model, a.out, a.tok, k31=a.k31)
    back = M.K3(g, k31=a.k31)
    X.load_checkpoint_into(back, a.out)
    back = back.double().eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, n_ranks, a.len).tolist()
    res = {}
    with torch.no_grad():
        for kda in ("chunked", "recurrent"):
            for m in back.kda_layers():
                m.chunked = kda == "chunked"
            res[kda] = back(torch.tensor([ids]))[0].numpy()
    ref = R.Model(a.out).forward(ids)
    scale = np.abs(ref).max()
    report = {"len": len(ids), "max_abs_ref": float(scale)}
    for k, v in res.items():
        report[f"torch_{k}_vs_numpy_rel"] = float(np.abs(v - ref).max() / scale)
    if a.engine:
        p = subprocess.run([a.engine, "logits", "--model", a.out, "--ids", ",".join(map(str, ids))],
                           capture_output=True, text=True)
        if p.returncode:
            sys.exit(p.stderr)
        eng = np.array(json.loads(p.stdout)["logits"] if p.stdout.strip().startswith("{") else json.loads(p.stdout))
        report["engine_vs_numpy_rel"] = float(np.abs(eng - ref).max() / scale)
        report["engine_vs_torch_rel"] = float(np.abs(eng - res["chunked"]).max() / scale)
    print(json.dumps(report, indent=1))
    bad = [k for k, v in report.items() if k.endswith("_rel") and not v < 1e-4]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
