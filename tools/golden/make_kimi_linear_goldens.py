#!/usr/bin/env python3
"""Golden logits for tiny random Kimi-Linear models, from HF transformers' KimiLinearForCausalLM.

Runs where torch + transformers are installed (the GPU machine: torch 2.11, transformers 5.17). Everything
runs in float32 on the CPU with eager attention and the native port's pure-torch KDA fallback (no fla /
Triton kernels, no TF32; see ARCHITECTURE.md §3.4 "Goldens").

    python3 tools/golden/make_kimi_linear_goldens.py --out tests/golden/kimi_linear

For every case it writes <out>/<case>/:
    config.json, generation_config.json, model.safetensors   (save_pretrained, fp32)
    golden.safetensors                                        (prompts, logits, greedy runs)
    golden.json                                               (seed, config highlights, versions, margins)
The case `published_form` holds the weights of `grouped_qlora` under the ORIGINAL Kimi-Linear checkpoint
names with a config.json in the published 48B form; the script checks that transformers loads it with no
missing/unexpected keys and reproduces the same logits before it writes the goldens.
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import sys
import traceback

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

PROMPT_LENGTHS = [1, 7, 70, 131]
GREEDY_NEW_TOKENS = 12

# ---------------------------------------------------------------------------------------------------------
# Cases. `layers` uses K = KDA (linear_attention), M = MLA (full_attention). Layer 0 is dense, the rest MoE.
# ---------------------------------------------------------------------------------------------------------
CASES = [
    dict(
        name="basic",
        seed=1001,
        what="q_lora_rank null (q_proj direct), ungrouped routing (1 group), 1 shared expert, 8 experts top-2, "
        "KDA 2 heads x 32 vs MLA 4 heads x (16 nope + 8 rope | v 16), layers K K K M",
        layers="KKKM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        top_k=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        kda_heads=2,
        kda_head_dim=32,
        mla_heads=4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=32,
        q_lora_rank=None,
    ),
    dict(
        name="grouped_qlora",
        seed=2002,
        what="q_lora_rank set (q_a_proj/q_a_layernorm/q_b_proj), grouped routing 16 experts in 4 groups, "
        "topk_group 2, top-4, 2 shared experts (one MLP of width 2*moe_intermediate), routed_scaling 1.5, "
        "KDA 4 heads x 16 vs MLA 2 heads x (24 nope + 8 rope | v 20), layers K M K K M",
        layers="KMKKM",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=24,
        num_experts=16,
        top_k=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        kda_heads=4,
        kda_head_dim=16,
        mla_heads=2,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=20,
        kv_lora_rank=24,
        q_lora_rank=40,
    ),
    dict(
        name="wide_mixed",
        seed=3003,
        what="6 layers K K M K K M, hidden 80, 12 experts in 3 groups (topk_group 2), top-3, 2 shared, "
        "KDA 3 heads x 32 (projection 96 != hidden) vs MLA 3 heads x (32 nope + 16 rope | v 32), "
        "q_lora_rank null",
        layers="KKMKKM",
        vocab_size=320,
        hidden_size=80,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_experts=12,
        top_k=3,
        n_group=3,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.0,
        kda_heads=3,
        kda_head_dim=32,
        mla_heads=3,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        kv_lora_rank=48,
        q_lora_rank=None,
    ),
]
PUBLISHED_TWIN_OF = "grouped_qlora"


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------
def config_fields():
    f = getattr(KimiLinearConfig, "__dataclass_fields__", None)
    if f:
        return set(f)
    return set(inspect.signature(KimiLinearConfig.__init__).parameters)


def layer_types_of(case):
    return ["linear_attention" if c == "K" else "full_attention" for c in case["layers"]]


def native_config_kwargs(case):
    fields = config_fields()
    L = len(case["layers"])
    kw = dict(
        vocab_size=case["vocab_size"],
        hidden_size=case["hidden_size"],
        intermediate_size=case["intermediate_size"],
        moe_intermediate_size=case["moe_intermediate_size"],
        num_hidden_layers=L,
        num_attention_heads=case["mla_heads"],
        num_key_value_heads=case["mla_heads"],
        n_shared_experts=case["n_shared_experts"],
        routed_scaling_factor=case["routed_scaling_factor"],
        kv_lora_rank=case["kv_lora_rank"],
        q_lora_rank=case["q_lora_rank"],
        qk_rope_head_dim=case["qk_rope_head_dim"],
        qk_nope_head_dim=case["qk_nope_head_dim"],
        v_head_dim=case["v_head_dim"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        num_experts_per_tok=case["top_k"],
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        layer_types=layer_types_of(case),
        mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
        linear_head_dim=case["kda_head_dim"],
        linear_num_heads=case["kda_heads"],
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
    )
    for k in ("num_local_experts", "n_routed_experts", "num_experts"):
        if k in fields:
            kw[k] = case["num_experts"]
            break
    else:
        kw["num_experts"] = case["num_experts"]
    if "mla_use_nope" in fields:
        kw["mla_use_nope"] = True
    if "first_k_dense_replace" in fields:
        kw["first_k_dense_replace"] = 1
    dropped = [k for k in list(kw) if fields and k not in fields]
    return kw, dropped


def make_config(case):
    kw, not_fields = native_config_kwargs(case)
    log(f"[{case['name']}] config kwargs not declared as fields (passed anyway): {not_fields}")
    cfg = KimiLinearConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def published_config(case, native_cfg_dict):
    """The same model in the published Kimi-Linear-48B-A3B config.json form (1-based layer lists)."""
    lt = layer_types_of(case)
    kda = [i + 1 for i, t in enumerate(lt) if t == "linear_attention"]
    full = [i + 1 for i, t in enumerate(lt) if t == "full_attention"]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": case["vocab_size"],
        "hidden_size": case["hidden_size"],
        "intermediate_size": case["intermediate_size"],
        "num_hidden_layers": len(lt),
        "num_attention_heads": case["mla_heads"],
        "num_key_value_heads": case["mla_heads"],
        "head_dim": case["hidden_size"] // case["mla_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": case["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_experts": case["num_experts"],
        "num_experts_per_token": case["top_k"],
        "num_shared_experts": case["n_shared_experts"],
        "routed_scaling_factor": case["routed_scaling_factor"],
        "use_grouped_topk": True,
        "num_expert_group": case["n_group"],
        "topk_group": case["topk_group"],
        "topk_method": "noaux_tc",
        "q_lora_rank": case["q_lora_rank"],
        "kv_lora_rank": case["kv_lora_rank"],
        "qk_nope_head_dim": case["qk_nope_head_dim"],
        "qk_rope_head_dim": case["qk_rope_head_dim"],
        "v_head_dim": case["v_head_dim"],
        "mla_use_nope": True,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "full_attn_layers": full,
            "head_dim": case["kda_head_dim"],
            "kda_layers": kda,
            "num_heads": case["kda_heads"],
            "short_conv_kernel_size": 4,
        },
        "model_max_length": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
        "use_cache": True,
    }


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------
INIT_RULES = (
    "embed_tokens ~ N(0,1); every linear / expert / router weight [.., out, in] ~ N(0, 1/in); depthwise conv "
    "[C,1,W] ~ N(0, 1/W); RMSNorm weights (1-D, 'norm' in name) = 1 + U(-0.2, 0.2); A_log = log U(1,16); "
    "dt_bias ~ N(0, 0.5^2) (variance 0.25); e_score_correction_bias ~ N(0, 0.1^2). Drawn in sorted-name order "
    "from one torch.Generator seeded with the case seed."
)


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    done = []
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if not t.is_floating_point():
                continue
            leaf = name.split(".")[-1]
            shape = tuple(t.shape)
            if leaf == "A_log" or name.endswith("A_log"):
                v = torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
            elif "dt_bias" in name:
                v = torch.randn(shape, generator=g) * 0.5
            elif "e_score_correction_bias" in name:
                v = torch.randn(shape, generator=g) * 0.1
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=g)
            elif ("norm" in name) and t.dim() == 1:
                v = 1.0 + torch.empty(shape).uniform_(-0.2, 0.2, generator=g)
            elif t.dim() == 3 and shape[1] == 1 and "conv" in name:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            elif t.dim() >= 2:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            else:
                raise RuntimeError(f"no init rule for tensor {name} shape {shape}")
            t.copy_(v.to(t.dtype))
            done.append(name)
    return done


# Native transformers name -> original Kimi-Linear checkpoint name (ARCHITECTURE §2.1). Anything that this
# function does not recognise is kept as is; the published-form reload check decides whether it is right.
def to_original_names(sd, cfg):
    out = {}
    P = cfg.linear_num_heads * cfg.linear_head_dim
    for name, t in sd.items():
        n = name
        m = re.match(r"(model\.layers\.\d+\.)(.*)$", n)
        if not m:
            out[n] = t
            continue
        pre, rest = m.groups()
        rest = rest.replace("self_attn.forget_gate.", "self_attn.")  # transformers 5.17 groups these four
        if rest == "self_attn.conv1d.weight":
            assert t.shape[0] == 3 * P, (name, t.shape)
            for i, which in enumerate(("q", "k", "v")):
                out[pre + f"self_attn.{which}_conv1d.weight"] = t[i * P:(i + 1) * P].clone().reshape(P, 1, -1)
            continue
        if rest == "mlp.experts.gate_up_proj":
            E, I2, H = t.shape
            for e in range(E):
                out[pre + f"block_sparse_moe.experts.{e}.w1.weight"] = t[e, : I2 // 2].clone()
                out[pre + f"block_sparse_moe.experts.{e}.w3.weight"] = t[e, I2 // 2:].clone()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[pre + f"block_sparse_moe.experts.{e}.w2.weight"] = t[e].clone()
            continue
        if rest == "self_attn.A_log":  # checkpoint shape [1, 1, H, 1]
            out[pre + rest] = t.reshape(1, 1, -1, 1).clone()
            continue
        if rest == "self_attn.dt_bias":  # checkpoint shape [H * K]
            out[pre + rest] = t.reshape(-1).clone()
            continue
        for a, b in (
            ("self_attn.forget_gate_down.", "self_attn.f_a_proj."),
            ("self_attn.forget_gate_up.", "self_attn.f_b_proj."),
            ("self_attn.beta_proj.", "self_attn.b_proj."),
            ("self_attn.output_gate_down.", "self_attn.g_a_proj."),
            ("self_attn.output_gate_up.", "self_attn.g_b_proj."),
            ("self_attn.output_gate.", "self_attn.g_proj."),
        ):
            if rest.startswith(a):
                rest = b + rest[len(a):]
                break
        if rest.startswith("mlp.") and not (
            rest.startswith("mlp.gate_proj") or rest.startswith("mlp.up_proj") or rest.startswith("mlp.down_proj")
        ):
            rest = "block_sparse_moe." + rest[len("mlp."):]
        out[pre + rest] = t.clone() if isinstance(t, torch.Tensor) else t
    return out


# ---------------------------------------------------------------------------------------------------------
# Router margins (how close the expert / group selections came to a tie), measured with hooks
# ---------------------------------------------------------------------------------------------------------
class RouterProbe:
    def __init__(self, model, cfg):
        self.margins = []
        self.handles = []
        self.cfg = cfg
        for name, mod in model.named_modules():
            if hasattr(mod, "e_score_correction_bias") and hasattr(mod, "weight"):
                self.handles.append(mod.register_forward_hook(self.hook))

    def hook(self, mod, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
        w = mod.weight.double()
        b = mod.e_score_correction_bias.double()
        s = torch.sigmoid(x @ w.T) + b  # [T, E]
        E = s.shape[-1]
        G = int(getattr(self.cfg, "n_group", 1) or 1)
        tg = int(getattr(self.cfg, "topk_group", 1) or 1)
        k = int(self.cfg.num_experts_per_tok)
        gmargin = float("inf")
        if G > 1 and tg < G:
            gs = s.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
            srt = gs.sort(dim=-1, descending=True)[0]
            gmargin = float((srt[:, tg - 1] - srt[:, tg]).min())
            keep = gs.topk(tg, dim=-1)[1]
            mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
            s = s.masked_fill(~mask.repeat_interleave(E // G, dim=1), float("-inf"))
        srt = s.sort(dim=-1, descending=True)[0]
        emargin = float((srt[:, k - 1] - srt[:, k]).min()) if k < E else float("inf")
        self.margins.append((emargin, gmargin))

    def take(self):
        m = self.margins
        self.margins = []
        if not m:
            return None
        return {"expert_select_margin_min": min(a for a, _ in m), "group_select_margin_min": min(b for _, b in m)}

    def close(self):
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def prefill_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def greedy(model, prompt, n):
    """Manual greedy loop on the oracle's own cache: one prefill, then one-token steps with use_cache=True."""
    out = model(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=True)
    past = out.past_key_values
    step_logits = [out.logits[0, -1].float()]
    toks = []
    for i in range(n):
        nxt = int(step_logits[-1].argmax())
        toks.append(nxt)
        if i == n - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), past_key_values=past, use_cache=True)
        past = out.past_key_values
        step_logits.append(out.logits[0, -1].float())
    return toks, torch.stack(step_logits)


def top2_margin(logits):
    t = logits.topk(2, dim=-1)[0]
    return float((t[..., 0] - t[..., 1]).min())


def describe_model(model, cfg):
    info = []
    for i, layer in enumerate(model.model.layers):
        attn = type(layer.self_attn).__name__
        mlp = type(layer.mlp).__name__
        extra = {}
        for attr in ("activation",):
            o = getattr(getattr(layer.self_attn, "o_norm", None), attr, None)
            if o is not None:
                extra["o_norm.activation"] = o
        for attr in ("forget_gate_lower_bound", "use_full_rank_output_gate", "activation"):
            if hasattr(layer.self_attn, attr):
                extra[attr] = getattr(layer.self_attn, attr)
        info.append(f"layer {i}: {attn} / {mlp} {extra}")
    return info


def check_structure(model, case, cfg):
    sd = model.state_dict()
    L = len(case["layers"])
    assert len(model.model.layers) == L
    for i, c in enumerate(case["layers"]):
        p = f"model.layers.{i}."
        if c == "M":
            assert (p + "self_attn.kv_a_proj_with_mqa.weight") in sd, f"layer {i} is not MLA"
            if case["q_lora_rank"] is None:
                assert (p + "self_attn.q_proj.weight") in sd and (p + "self_attn.q_a_proj.weight") not in sd
            else:
                assert sd[p + "self_attn.q_a_proj.weight"].shape[0] == case["q_lora_rank"]
            qk = case["qk_nope_head_dim"] + case["qk_rope_head_dim"]
            qn = "q_proj" if case["q_lora_rank"] is None else "q_b_proj"
            assert sd[p + f"self_attn.{qn}.weight"].shape[0] == case["mla_heads"] * qk
        else:
            assert (p + "self_attn.kv_a_proj_with_mqa.weight") not in sd, f"layer {i} is not KDA"
            assert sd[p + "self_attn.q_proj.weight"].shape[0] == case["kda_heads"] * case["kda_head_dim"]
            alog = [k for k in sd if k.startswith(p) and k.endswith("A_log")]
            assert len(alog) == 1 and sd[alog[0]].numel() == case["kda_heads"], alog
        if i == 0:
            assert (p + "mlp.gate_proj.weight") in sd and sd[p + "mlp.gate_proj.weight"].shape[0] == case[
                "intermediate_size"
            ], f"layer 0 must be the dense MLP"
        else:
            gate = [k for k in sd if k.startswith(p) and k.endswith("e_score_correction_bias")]
            assert len(gate) == 1 and sd[gate[0]].numel() == case["num_experts"], f"layer {i} is not MoE"
            sh = [k for k in sd if k.startswith(p) and "shared_experts" in k and k.endswith("gate_proj.weight")]
            assert len(sh) == 1 and sd[sh[0]].shape[0] == case["moe_intermediate_size"] * case["n_shared_experts"]
    assert cfg.num_experts_per_tok == case["top_k"], cfg.num_experts_per_tok
    assert getattr(cfg, "n_group") == case["n_group"] and cfg.topk_group == case["topk_group"]


def safetensors_listing(path):
    rows = []
    with safe_open(path, framework="pt") as f:
        for k in sorted(f.keys()):
            sl = f.get_slice(k)
            rows.append([k, str(sl.get_dtype()), list(sl.get_shape())])
    return rows


def load_checked(path, ref_model=None, prompts=None):
    m, info = KimiLinearForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    m.eval()
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return m, info, bad


def run_case(case, out_root, versions):
    name = case["name"]
    log(f"===== case {name} =====")
    cfg = make_config(case)
    torch.manual_seed(case["seed"])
    model = KimiLinearForCausalLM(cfg).eval()
    init_weights(model, case["seed"])
    for line in describe_model(model, cfg):
        log("  " + line)
    log("  config: " + json.dumps(cfg.to_dict(), default=str, sort_keys=True))
    for k, v in model.state_dict().items():
        log(f"    native {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)}")
    check_structure(model, case, cfg)

    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.save_pretrained(d)
    files = sorted(os.listdir(d))
    log(f"  save_pretrained wrote: {files}")
    listing = safetensors_listing(os.path.join(d, "model.safetensors"))
    for r in listing:
        log(f"    {r[0]} {r[1]} {r[2]}")
    # How the names save_pretrained wrote differ from the original Kimi-Linear checkpoint names.
    saved_names = {r[0] for r in listing}
    orig_names = set(to_original_names(model.state_dict(), cfg))
    quirks = {"only_in_save_pretrained": sorted(saved_names - orig_names),
              "only_in_original_naming": sorted(orig_names - saved_names)}
    log(f"  save_pretrained vs original names: {json.dumps(quirks)}")

    # Reload what was written and make every golden from the reloaded model: the fixture files are then
    # exactly what produced the numbers.
    model2, info, bad = load_checked(d)
    assert not bad, f"{name}: reload of save_pretrained output is not clean: {bad}"

    goldens, meta = compute_goldens(model2, case, cfg)
    # The in-memory model must agree bit-for-bit (same weights, same code path).
    for L in PROMPT_LENGTHS:
        ref = prefill_logits(model, goldens[f"prompt.{L}"].tolist())
        diff = float((ref - goldens[f"logits.{L}"]).abs().max())
        assert diff == 0.0, f"{name}: in-memory vs reloaded logits differ by {diff} at length {L}"
    write_goldens(d, case, cfg, goldens, meta, versions, listing, form="transformers-native (save_pretrained)",
                  extra={"save_pretrained_vs_original_names": quirks})
    return model2, cfg, goldens


def compute_goldens(model, case, cfg):
    g = torch.Generator().manual_seed(case["seed"] + 7)
    V = case["vocab_size"]
    probe = RouterProbe(model, cfg)
    goldens, meta = {}, {"prompts": {}}
    for L in PROMPT_LENGTHS:
        ids = torch.randint(0, V, (L,), generator=g).tolist()
        lg = prefill_logits(model, ids)
        goldens[f"prompt.{L}"] = torch.tensor(ids, dtype=torch.int32)
        goldens[f"logits.{L}"] = lg.contiguous()
        rm = probe.take()
        meta["prompts"][str(L)] = {
            "max_abs_logit": float(lg.abs().max()),
            "logit_std": float(lg.std()),
            "argmax_top2_margin_min": top2_margin(lg),
            "router": rm,
        }
        assert torch.isfinite(lg).all()
    # Greedy runs: a short prompt and one whose prefill spans two 64-token chunks. A prompt is redrawn (up to
    # 20 tries) if some greedy step had a top-2 margin below 1e-3 * max|logit|, so that a correct engine
    # cannot flip a token on rounding alone.
    for tag, plen in (("greedy", 5), ("greedy_long", 70)):
        for attempt in range(20):
            prompt = torch.randint(0, V, (plen,), generator=g).tolist()
            toks, step_logits = greedy(model, prompt, GREEDY_NEW_TOKENS)
            margin = top2_margin(step_logits)
            scale = float(step_logits.abs().max())
            if margin > 1e-3 * scale:
                break
        probe.take()
        full = prefill_logits(model, prompt + toks[:-1])
        # Oracle self-consistency: cached decode logits vs prefill of the whole sequence.
        dec_vs_prefill = float((full[plen - 1:] - step_logits).abs().max())
        goldens[f"{tag}.prompt"] = torch.tensor(prompt, dtype=torch.int32)
        goldens[f"{tag}.tokens"] = torch.tensor(toks, dtype=torch.int32)
        goldens[f"{tag}.logits"] = step_logits.contiguous()
        meta[tag] = {
            "prompt_len": plen,
            "new_tokens": GREEDY_NEW_TOKENS,
            "redraws": attempt,
            "top2_margin_min": margin,
            "max_abs_logit": scale,
            "oracle_decode_vs_prefill_max_abs_diff": dec_vs_prefill,
            "tokens": toks,
        }
        probe.take()
    probe.close()
    return goldens, meta


def write_goldens(d, case, cfg, goldens, meta, versions, listing, form, extra=None):
    path = os.path.join(d, "golden.safetensors")
    save_file({k: v.contiguous() for k, v in goldens.items()}, path, metadata={"case": case["name"]})
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    doc = {
        "case": case["name"],
        "covers": case["what"],
        "config_form": form,
        "seed": case["seed"],
        "prompt_seed": case["seed"] + 7,
        "weight_init": INIT_RULES,
        "oracle": versions,
        "dtype": "float32 on CPU, eager attention, pure-torch KDA (no fla/Triton), TF32 off",
        "config_highlights": {
            "layers": case["layers"],
            "layer_types": list(cfg.layer_types),
            "mlp_layer_types": list(getattr(cfg, "mlp_layer_types", []) or []),
            "vocab_size": case["vocab_size"],
            "hidden_size": case["hidden_size"],
            "intermediate_size": case["intermediate_size"],
            "moe_intermediate_size": case["moe_intermediate_size"],
            "num_experts": case["num_experts"],
            "num_experts_per_tok": case["top_k"],
            "n_group": case["n_group"],
            "topk_group": case["topk_group"],
            "n_shared_experts": case["n_shared_experts"],
            "routed_scaling_factor": case["routed_scaling_factor"],
            "kda_heads": case["kda_heads"],
            "kda_head_dim": case["kda_head_dim"],
            "mla_heads": case["mla_heads"],
            "qk_nope_head_dim": case["qk_nope_head_dim"],
            "qk_rope_head_dim": case["qk_rope_head_dim"],
            "v_head_dim": case["v_head_dim"],
            "kv_lora_rank": case["kv_lora_rank"],
            "q_lora_rank": case["q_lora_rank"],
            "rms_norm_eps": 1e-5,
        },
        "golden_tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in goldens.items()},
        "model_safetensors_sha256": sha,
        "weights": listing,
    }
    doc.update(meta)
    if extra:
        doc.update(extra)
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def make_published_twin(src_dir, src_model, src_cfg, case, src_goldens, out_root, versions):
    name = "published_form"
    log(f"===== case {name} (twin of {case['name']}) =====")
    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    pub = published_config(case, src_cfg.to_dict())
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(pub, f, indent=2)
        f.write("\n")
    if os.path.exists(os.path.join(src_dir, "generation_config.json")):
        shutil.copy(os.path.join(src_dir, "generation_config.json"), d)

    native_sd = {k: v.detach().clone().contiguous() for k, v in src_model.state_dict().items()}
    attempts = [("original checkpoint names (ARCHITECTURE §2.1)", to_original_names(native_sd, src_cfg))]
    with safe_open(os.path.join(src_dir, "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    attempts.append(("names exactly as save_pretrained wrote them", saved))
    chosen = None
    for label, sd in attempts:
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        try:
            m, info, bad = load_checked(d)
        except Exception as e:  # noqa: BLE001
            log(f"  published form with {label}: load failed: {e!r}")
            continue
        if bad:
            log(f"  published form with {label}: loading info not clean: {bad}")
            continue
        diffs = []
        for L in PROMPT_LENGTHS:
            lg = prefill_logits(m, src_goldens[f"prompt.{L}"].tolist())
            diffs.append(float((lg - src_goldens[f"logits.{L}"]).abs().max()))
        log(f"  published form with {label}: loads clean, max|dlogit| vs twin per length = {diffs}")
        if max(diffs) == 0.0:
            chosen = (label, m, info)
            break
    assert chosen is not None, "no published-form variant reproduced the twin's logits"
    label, m, info = chosen
    cfg = m.config
    log(f"  published form uses {label}; loaded layer_types={cfg.layer_types}")
    goldens, meta = compute_goldens(m, case, cfg)
    for k in src_goldens:
        assert torch.equal(goldens[k], src_goldens[k]), f"published twin golden {k} differs from {case['name']}"
    listing = safetensors_listing(os.path.join(d, "model.safetensors"))
    c2 = dict(case)
    c2["name"] = name
    c2["what"] = (f"the model of case '{case['name']}' (identical weights and goldens) with config.json in the "
                  f"PUBLISHED Kimi-Linear-48B-A3B form (linear_attn_config with 1-based kda_layers/"
                  f"full_attn_layers, num_experts, num_experts_per_token, first_k_dense_replace, "
                  f"num_expert_group, ...) and weights under {label}")
    write_goldens(d, c2, cfg, goldens, meta, versions, listing, form="published Kimi-Linear-48B-A3B form",
                  extra={"twin_of": case["name"], "weight_names": label})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/golden/kimi_linear")
    ap.add_argument("--cases", default="", help="comma list; default all")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    import importlib.util

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": __import__("safetensors").__version__,
        "python": sys.version.split()[0],
        "fla_importable": importlib.util.find_spec("fla") is not None,
        "modeling_file": inspect.getsourcefile(KimiLinearForCausalLM),
    }
    log(json.dumps(versions))
    os.makedirs(args.out, exist_ok=True)
    wanted = set(filter(None, args.cases.split(",")))
    results, failed = {}, []
    for case in CASES:
        if wanted and case["name"] not in wanted:
            continue
        try:
            results[case["name"]] = run_case(case, args.out, versions)
        except Exception:  # noqa: BLE001  (keep going: one run of this script should report every problem)
            traceback.print_exc()
            failed.append(case["name"])
    if PUBLISHED_TWIN_OF in results:
        m, cfg, gold = results[PUBLISHED_TWIN_OF]
        case = next(c for c in CASES if c["name"] == PUBLISHED_TWIN_OF)
        try:
            make_published_twin(os.path.join(args.out, PUBLISHED_TWIN_OF), m, cfg, case, gold, args.out,
                                versions)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append("published_form")
    total = 0
    for root, _, fs in os.walk(args.out):
        for f in fs:
            total += os.path.getsize(os.path.join(root, f))
    log(f"total fixture bytes: {total}")
    if failed:
        log(f"FAILED cases: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
