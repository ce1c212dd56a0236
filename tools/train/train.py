#!/usr/bin/env python3
"""Train the embedded default model (small Kimi K3 on Tiny Shakespeare) and its K3.1 variant, export
both in the K3 checkpoint layout, and record everything the CI parity tests need.

    python3 tools/train/train.py --data build-trainer-data --out OUTDIR [--train-seconds 170]

Stages (each writes to OUTDIR/metrics.json as it completes):
  1. train K3 (AdamW, cosine LR, dropout 0.1, bias-balanced router), keep the best held-out checkpoint;
  2. held-out loss in fp32 (TF32 off) before quantisation, after MXFP4 quantisation of the routed experts,
     and after a short fine-tune of the non-expert weights with the quantised experts frozen;
  3. export OUTDIR/models/default, read it back, evaluate the shipped weights (BF16 + MXFP4);
  4. K3.1: indexer (KL to the dense attention distribution, rest frozen), index_topk < context;
     export OUTDIR/models/k31-default (indexer shard + the K3 shards), read back, evaluate sparse;
  5. parity records: fp64 CPU logits of the shipped weights on tests/golden/trained/prompts.json,
     perplexity of tests/golden/trained/heldout-slice.txt; samples.

Evaluation windowing (the same as `perigee perplexity`): ids = encode_ordinary(text); windows start at
0, N, 2N, ...; a window feeds ids[s : min(s+N, n-1)] from an empty state and is scored on the next token
of each position; every token 1..n-1 is predicted exactly once. ppl = exp(sum NLL / (n - 1)).
"""

import argparse
import copy
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import export as X  # noqa: E402
import k3model as M  # noqa: E402
import kimi_bpe  # noqa: E402
import data as D  # noqa: E402

METRICS = {}
OUT = "."


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def save_metrics():
    with open(os.path.join(OUT, "metrics.json"), "w") as fh:
        json.dump(METRICS, fh, indent=1)


def load_u16(p):
    return np.fromfile(p, dtype="<u2").astype(np.int64)


def windows(n, ctx):
    return [(s, min(s + ctx, n - 1)) for s in range(0, n - 1, ctx)]


@torch.no_grad()
def eval_nll(model, ids, ctx, dev, batch=32, dtype=torch.float32):
    """Sum of NLL (fp64) and count over the windows of `ids` (see module docstring)."""
    model.eval()
    ids_t = torch.tensor(ids, dtype=torch.long)
    tot, cnt = 0.0, 0
    ws = windows(len(ids), ctx)
    groups = {}
    for s, e in ws:
        groups.setdefault(e - s, []).append(s)
    for L, starts in groups.items():
        for i in range(0, len(starts), batch):
            st = starts[i:i + batch]
            x = torch.stack([ids_t[s:s + L] for s in st]).to(dev)
            y = torch.stack([ids_t[s + 1:s + 1 + L] for s in st]).to(dev)
            lg = model(x).to(torch.float64)
            nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction="sum")
            tot += float(nll)
            cnt += y.numel()
    return tot, cnt


def ppl_record(model, ids, ctx, dev, **kw):
    tot, cnt = eval_nll(model, ids, ctx, dev, **kw)
    return {"nll_sum": tot, "tokens_scored": cnt, "loss": tot / cnt, "ppl": math.exp(tot / cnt), "context": ctx}


def set_tf32(on):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


class Batcher:
    def __init__(self, plain, chat, ctx, bsz, seed):
        self.plain, self.chat, self.ctx, self.bsz = plain, chat, ctx, bsz
        self.rng = np.random.default_rng(seed)

    def __call__(self):
        rows = []
        for i in range(self.bsz):
            src = self.plain if i % 2 == 0 else self.chat
            s = int(self.rng.integers(0, len(src) - self.ctx - 1))
            rows.append(src[s:s + self.ctx + 1])
        a = torch.from_numpy(np.stack(rows))
        return a[:, :-1], a[:, 1:]


def balance_bias(model, gamma):
    for m in model.moe_layers():
        if m.last_load is None:
            continue
        load = m.last_load.float()
        err = load.mean() - load
        m.gate.e_score_correction_bias.add_(gamma * torch.sign(err))


def train_loop(model, params, batcher, dev, seconds, lr, min_lr, warmup, eval_fn, eval_every, wd,
               tag, max_steps=100000, bias_gamma=1e-3):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    t0 = time.time()
    total = None
    best = (float("inf"), None, 0)
    step = 0
    hist = []
    while True:
        el = time.time() - t0
        if step == 5:
            t5 = el
        if step == 25:
            per = (el - t5) / 20
            total = min(max_steps, 25 + int(max(0.0, seconds - el) / per))
            log(f"{tag}: {per * 1000:.0f} ms/step -> {total} steps")
        if (total is not None and step >= total) or step >= max_steps:
            break
        T = total or max_steps
        if step < warmup:
            cur = lr * (step + 1) / warmup
        else:
            cur = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, T - warmup))))
        for gp in opt.param_groups:
            gp["lr"] = cur
        model.train()
        x, y = batcher()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        lg = model(x)
        loss = F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if bias_gamma:
            with torch.no_grad():
                balance_bias(model, bias_gamma)
        step += 1
        if step % eval_every == 0 or (total is not None and step == total):
            vl = eval_fn()
            hist.append((step, float(loss), vl))
            log(f"{tag} step {step} lr {cur:.2e} train {float(loss):.4f} val {vl:.4f} ({time.time() - t0:.0f}s)")
            if vl < best[0]:
                best = (vl, copy.deepcopy(model.state_dict()), step)
    return best, hist, step, time.time() - t0


def quantize_experts_(model):
    """Replace routed-expert weights by their MXFP4 round trip (in place)."""
    with torch.no_grad():
        for m in model.moe_layers():
            for p in (m.w1, m.w3, m.w2):
                a = p.detach().float().cpu().numpy()
                q = np.stack([X.mxfp4_dequant(*X.mxfp4_quantize(a[e])) for e in range(a.shape[0])])
                p.copy_(torch.from_numpy(q))


@torch.no_grad()
def sample(model, enc, prompt_ids, n, dev, temp=0.8, seed=0, stop=()):
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(n):
        lg = model(torch.tensor([ids[-256:]], device=dev))[0, -1].float().cpu()
        p = torch.softmax(lg / temp, -1)
        nxt = int(torch.multinomial(p, 1, generator=gen))
        ids.append(nxt)
        if nxt in stop:
            break
    return enc.decode(ids[len(prompt_ids):])


def parity_logits(model_dir, g, k31, prompts, rows, out_path):
    """fp64 CPU forward of the EXPORTED weights; last `rows` rows of each prompt, stored fp32."""
    m = M.K3(g, k31=k31)
    X.load_checkpoint_into(m, model_dir)
    m = m.double().eval()
    for mla in m.mla_layers():
        mla.use_sparse = k31
    recs = []
    with torch.no_grad():
        for p in prompts:
            lg = m(torch.tensor([p["ids"]]))[0]
            recs.append(lg[-rows:].float().numpy())
    arr = np.stack(recs)                                           # [P, rows, V]
    arr.astype("<f4").tofile(out_path)
    return m, arr


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-seconds", type=float, default=170)
    ap.add_argument("--qat-seconds", type=float, default=15)
    ap.add_argument("--indexer-seconds", type=float, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cpu", action="store_true", help="tiny smoke run on the CPU")
    a = ap.parse_args()
    OUT = a.out
    os.makedirs(OUT, exist_ok=True)
    dev = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(a.seed)
    METRICS["args"] = vars(a)
    METRICS["torch"] = torch.__version__
    METRICS["device"] = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    tok_dir = os.path.join(a.data, "tok")
    enc = kimi_bpe.Encoder.load(tok_dir)
    n_ranks = len(enc.vocab)
    g = M.default_geometry(n_ranks + kimi_bpe.N_RESERVED)
    plain, chat = load_u16(os.path.join(a.data, "train_plain.u16")), load_u16(os.path.join(a.data, "train_chat.u16"))
    val = load_u16(os.path.join(a.data, "val.u16")).tolist()
    gold = os.path.join(ROOT, "tests", "golden", "trained")
    with open(os.path.join(gold, "heldout-slice.txt")) as fh:
        slice_ids = enc.encode_ordinary(fh.read())
    with open(os.path.join(gold, "prompts.json")) as fh:
        prompts = json.load(fh)["prompts"]
    METRICS["geometry"] = g
    METRICS["data"] = {"train_plain_tokens": len(plain), "train_chat_tokens": len(chat), "val_tokens": len(val),
                       "slice_tokens": len(slice_ids)}
    model = M.K3(g, dropout=a.dropout).to(dev)
    METRICS["params"] = sum(p.numel() for p in model.parameters())
    METRICS["params_routed_experts"] = sum(p.numel() for m in model.moe_layers() for p in (m.w1, m.w3, m.w2))
    log(f"params {METRICS['params']:,} (routed experts {METRICS['params_routed_experts']:,}) on {dev}")
    save_metrics()
    if a.cpu:
        val = val[:2048]
    quick_val = val[:a.ctx * 16 + 1]

    def quick_eval():
        set_tf32(False)
        t, c = eval_nll(model, quick_val, a.ctx, dev)
        set_tf32(True)
        return t / c

    # ---- 1. train -------------------------------------------------------------------------------
    set_tf32(True)
    batcher = Batcher(plain, chat, a.ctx, a.batch, a.seed)
    best, hist, steps, secs = train_loop(model, list(model.parameters()), batcher, dev, a.train_seconds, a.lr,
                                         a.lr / 10, 100 if not a.cpu else 2, quick_eval, a.eval_every, 0.1,
                                         "k3", max_steps=a.max_steps)
    model.load_state_dict(best[1])
    METRICS["train"] = {"steps": steps, "seconds": secs, "best_step": best[2], "best_quick_val": best[0],
                        "history": hist, "batch": a.batch, "ctx": a.ctx,
                        "tokens_seen": steps * a.batch * a.ctx}
    set_tf32(False)
    model.drop.p = 0.0
    METRICS["val_fp32"] = ppl_record(model, val, a.ctx, dev)
    log("val fp32", METRICS["val_fp32"])
    save_metrics()

    # ---- 2. MXFP4 experts ------------------------------------------------------------------------
    quantize_experts_(model)
    METRICS["val_mxfp4_ptq"] = ppl_record(model, val, a.ctx, dev)
    log("val after MXFP4 PTQ", METRICS["val_mxfp4_ptq"])
    save_metrics()
    if a.qat_seconds > 0:
        model.drop.p = a.dropout
        for m in model.moe_layers():
            for p in (m.w1, m.w3, m.w2):
                p.requires_grad_(False)
        rest = [p for p in model.parameters() if p.requires_grad]
        set_tf32(True)
        best_q, hist_q, steps_q, _ = train_loop(model, rest, batcher, dev, a.qat_seconds, a.lr / 10, a.lr / 100,
                                                10 if not a.cpu else 1, quick_eval, max(10, a.eval_every // 2), 0.1,
                                                "k3-qft", max_steps=a.max_steps, bias_gamma=0.0)
        prev_q = METRICS["val_mxfp4_ptq"]
        model.load_state_dict(best_q[1])
        set_tf32(False)
        model.drop.p = 0.0
        METRICS["val_mxfp4_finetuned"] = ppl_record(model, val, a.ctx, dev)
        METRICS["qft"] = {"steps": steps_q, "history": hist_q}
        log("val after frozen-expert fine-tune", METRICS["val_mxfp4_finetuned"], "(PTQ", prev_q["loss"], ")")
    save_metrics()

    # ---- 3. export K3 ----------------------------------------------------------------------------
    mdir = os.path.join(OUT, "models", "default")
    wmap = X.export(model.cpu(), mdir, tok_dir)
    model.to(dev)
    shipped = M.K3(g)
    X.load_checkpoint_into(shipped, mdir)
    shipped = shipped.to(dev).eval()
    METRICS["shipped"] = {"val": ppl_record(shipped, val, a.ctx, dev),
                          "slice": {str(c): ppl_record(shipped, slice_ids, c, dev) for c in (64, 128, 256)}}
    log("shipped K3 val", METRICS["shipped"]["val"])
    save_metrics()
    try:
        hello = D.Renderer(enc)
        stop = {enc.special("<|end_of_msg|>"), enc.special("[EOS]")}
        samp = {"plain_ROMEO": sample(shipped, enc, enc.encode_ordinary("ROMEO:\n"), 120, dev),
                "plain_KING": sample(shipped, enc, enc.encode_ordinary("KING HENRY VI:\nWhat"), 120, dev, seed=1)}
        chat = hello.message([("role", "user")], hello.text("What news from Verona, good sir?")) + \
            hello.generation_prompt(False)
        samp["chat_nothink"] = sample(shipped, enc, chat, 120, dev, stop=stop, seed=2)
        chat2 = hello.message([("role", "system")], hello.text("You are HAMLET.")) + \
            hello.message([("role", "user")], hello.text("My lord, how does your honour for this many a day?")) + \
            hello.generation_prompt(True)
        samp["chat_think"] = sample(shipped, enc, chat2, 120, dev, stop=stop, seed=3)
        METRICS["samples_k3"] = samp
        for k, v in samp.items():
            log(f"sample {k}: {v!r}")
    except Exception:
        METRICS["samples_error"] = traceback.format_exc()
    save_metrics()
    try:
        _, arr = parity_logits(mdir, g, False, prompts, 4, os.path.join(OUT, "logits-default.f32"))
        METRICS["parity_default"] = {"rows": 4, "shape": list(arr.shape), "max_abs": float(np.abs(arr).max())}
    except Exception:
        METRICS["parity_default_error"] = traceback.format_exc()
    save_metrics()

    # ---- 4. K3.1 variant -------------------------------------------------------------------------
    try:
        k31 = M.K3(g, k31=True).to(dev)
        missing, unexpected = k31.load_state_dict(shipped.state_dict(), strict=False)
        assert not unexpected and all(".indexer." in n for n in missing), (missing, unexpected)
        for n, p in k31.named_parameters():
            p.requires_grad_(".indexer." in n)
        idx_params = [p for p in k31.parameters() if p.requires_grad]
        METRICS["params_indexer"] = sum(p.numel() for p in idx_params)
        opt = torch.optim.AdamW(idx_params, lr=3e-3, weight_decay=0.0)
        set_tf32(True)
        t0, st = time.time(), 0
        k31.eval()  # no dropout; indexer trained on the frozen model's dense attention
        kl_hist = []
        while time.time() - t0 < a.indexer_seconds and st < a.max_steps:
            for m in k31.mla_layers():
                m.use_sparse = False
                m.kl_loss = torch.zeros((), device=dev)
            x, _ = batcher()
            with torch.enable_grad():
                k31(x.to(dev))
                kl = sum(m.kl_loss for m in k31.mla_layers())
                opt.zero_grad(set_to_none=True)
                kl.backward()
                opt.step()
            st += 1
            if st % 25 == 0:
                kl_hist.append((st, float(kl)))
                log(f"indexer step {st} KL(sum over MLA layers) {float(kl):.4f}")
        for m in k31.mla_layers():
            m.kl_loss = None
        set_tf32(False)
        for m in k31.mla_layers():
            m.use_sparse = False
        dense = ppl_record(k31, val, a.ctx, dev)
        for m in k31.mla_layers():
            m.use_sparse = True
        sparse = ppl_record(k31, val, a.ctx, dev)
        METRICS["k31_train"] = {"steps": st, "kl_history": kl_hist, "val_dense": dense, "val_sparse": sparse,
                                "index_topk": g["index_topk"]}
        log("K3.1 val dense", dense["loss"], "sparse", sparse["loss"])
        kdir = os.path.join(OUT, "models", "k31-default")
        X.export(k31.cpu(), kdir, tok_dir, k31=True, shard_names=wmap, only=lambda n: ".indexer." in n)
        for f in set(wmap.values()):
            os.symlink(os.path.join("..", "default", f), os.path.join(kdir, f))
        k31s = M.K3(g, k31=True)
        X.load_checkpoint_into(k31s, kdir)
        k31s = k31s.to(dev).eval()
        for m in k31s.mla_layers():
            m.use_sparse = True
        METRICS["shipped_k31"] = {"val": ppl_record(k31s, val, a.ctx, dev),
                                  "slice": {str(c): ppl_record(k31s, slice_ids, c, dev) for c in (64, 128, 256)}}
        log("shipped K3.1 val", METRICS["shipped_k31"]["val"])
        save_metrics()
        _, arr = parity_logits(kdir, g, True, prompts, 4, os.path.join(OUT, "logits-k31.f32"))
        METRICS["parity_k31"] = {"rows": 4, "shape": list(arr.shape), "max_abs": float(np.abs(arr).max())}
    except Exception:
        METRICS["k31_error"] = traceback.format_exc()
        log(METRICS["k31_error"])
    save_metrics()
    log("done")


if __name__ == "__main__":
    main()
