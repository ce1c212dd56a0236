#!/usr/bin/env python3
"""HF transformers' KimiLinearForCausalLM on the Kimi-Linear-48B geometry cut to a few layers: batch-1 decode with
its cache, timed the same way as bench-cuda-decode's eager/graph rows (wall clock around N steps + one sync).

Random bf16 weights (the model's own init), built directly on the GPU. Prints one line per figure, prefixed "hf:",
so tools/gpu/run.sh can put it next to Perigee's bench-cuda-decode --layers N in one log. Run on the GPU machine:
    python3 tools/gpu/hf_side_by_side.py --layers 4 --ctx 256 --steps 20
Which KDA path transformers takes is printed: without flash-linear-attention (fla) installed, its pure-torch
fallback (that is what the GPU image has as of 2026-11).
"""
import argparse
import importlib
import importlib.util
import sys
import time
import traceback


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()

    import torch
    import transformers

    print(f"hf: transformers {transformers.__version__}, torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
    print(f"hf: flash-linear-attention (fla) installed: {importlib.util.find_spec('fla') is not None}; "
          f"causal_conv1d installed: {importlib.util.find_spec('causal_conv1d') is not None}")
    try:
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ImportError:
        from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
    mod = importlib.import_module(KimiLinearForCausalLM.__module__)
    fast = {n: getattr(mod, n) is not None for n in dir(mod)
            if any(k in n.lower() for k in ("kda", "fla", "fast_path", "chunk_", "fused_recurrent", "causal_conv"))
            and not n.startswith("__") and not isinstance(getattr(mod, n), type(sys))}
    print(f"hf: kernel symbols in {mod.__name__} (True = a kernel is bound): {fast}")

    L = a.layers
    full = [l for l in (4, 8, 12, 16, 20, 24, 27) if l <= L]
    kda = [l for l in range(1, L + 1) if l not in full]
    kw = dict(num_hidden_layers=L, first_k_dense_replace=1,
              linear_attn_config={"kda_layers": kda, "full_attn_layers": full, "num_heads": 32, "head_dim": 128,
                                  "short_conv_kernel_size": 4})
    try:
        cfg = KimiLinearConfig(**kw)
    except TypeError as e:   # a version without the checkpoint-style keys: the defaults are the 48B geometry
        print(f"hf: KimiLinearConfig(**checkpoint keys) refused ({e}); using num_hidden_layers only")
        cfg = KimiLinearConfig(num_hidden_layers=L)
    for k in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "intermediate_size",
              "num_experts", "num_local_experts", "num_experts_per_token", "num_experts_per_tok", "layer_types",
              "mlp_layer_types", "linear_num_heads", "linear_head_dim", "_attn_implementation",
              "_experts_implementation"):
        if hasattr(cfg, k):
            print(f"hf: config {k} = {getattr(cfg, k)}")

    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = KimiLinearForCausalLM(cfg)
    model.eval()
    torch.cuda.synchronize()
    nb = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"hf: model built on the GPU in {time.time() - t0:.1f} s, {nb / 1e9:.2f} GB of bf16 parameters")

    V = cfg.vocab_size
    ids = torch.tensor([[(i * 7919 + 17) % V for i in range(a.ctx)]], device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)   # warm-up prefill (first-call overheads)
        torch.cuda.synchronize()
        t = time.time()
        out = model(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
        pre_ms = (time.time() - t) * 1e3
        print(f"hf: prefill {a.ctx} tokens: {pre_ms:.1f} ms ({a.ctx / pre_ms * 1e3:.0f} tok/s), "
              f"cache {type(out.past_key_values).__name__}")
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t = time.time()
        for _ in range(a.steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        ms = (time.time() - t) * 1e3 / a.steps
    print(f"hf: decode batch 1, {L} layers, at position ~{a.ctx + 3}: {ms:.3f} ms/step, {1e3 / ms:.1f} tok/s "
          f"(eager PyTorch, greedy token fed back each step, mean of {a.steps} steps)")
    print(f"hf: peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        print("hf: FAILED")
        traceback.print_exc(file=sys.stdout)
        sys.exit(1)
