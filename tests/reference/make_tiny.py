#!/usr/bin/python3
"""Tiny random-weight checkpoints in the published layouts, for the numpy reference's own tests.

    python3 tests/reference/make_tiny.py --preset k3 --out DIR [--seed S]

Presets:
  k3        wrapper config (kimi_k3), `language_model.` prefix, AttnRes (block 3, 7 layers, 3 MLA),
            latent MoE with MXFP4 compressed-tensors experts, SiTU, MLA q-LoRA + output gate,
            KDA lower-bound gate + full-rank g_proj, F32 conv, A_log F32[head_dim] with zero tail,
            F32 o_norm, vision stub tensors, 3 shards + model.safetensors.index.json.
  k31       k3 + dsa_config + the 5 indexer tensors on every MLA layer, index_topk 5.
  k3-nvfp4  k3 with the experts repacked losslessly to NVFP4 (weight_scale F8_E4M3 [out,in/16],
            weight_global_scale F32[1], a multiplier); must give the same logits as k3.
  kimi-linear  the published Kimi-Linear-48B form: no prefix, no AttnRes, softplus gate, low-rank
            g_a/g_b, A_log [1,1,H,1], BF16 conv/o_norm, q_proj direct, BF16 `.weight` experts
            (non-latent), 2 expert groups, SiLU, single model.safetensors.

Shares no code with the C++ engine (its synth command is a separate implementation).
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ref  # noqa: E402  (safetensors writer and BF16 rounding only)

E2M1_POS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w):
    """float [out, in] -> (packed U8 [out, in/2], scale U8 [out, in/32]); round to nearest E2M1."""
    out, inn = w.shape
    assert inn % 32 == 0
    g = w.reshape(out, inn // 32, 32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int64)
    scaled = g / np.ldexp(1.0, e)[..., None]
    mag = np.abs(scaled)
    code = np.abs(mag[..., None] - E2M1_POS).argmin(-1)             # nearest magnitude
    code = code | np.where((scaled < 0) & (code > 0), 8, 0)
    code = code.reshape(out, inn).astype(np.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def mxfp4_to_nvfp4(packed, scale):
    """Lossless repack (ARCHITECTURE 3.8): nibbles verbatim, E4M3 power-of-two scales, F32 global."""
    e = scale.astype(np.int64) - 127
    emax, emin = e.max(), e.min()
    assert emax - emin <= 17, "tiny weights always fit"
    gexp = emax - 8
    p = e - gexp                                                    # in [-9, 8]
    byte = np.where(p >= -6, (p + 7) << 3, np.where(p == -7, 4, np.where(p == -8, 2, 1)))
    nv = np.repeat(byte.astype(np.uint8), 2, axis=1)
    return packed, nv, np.array([2.0 ** gexp], dtype=np.float32)


class Builder:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.t = {}

    def bf16(self, name, arr):
        self.t[name] = ("BF16", kimi_ref.f64_to_bf16_bits(arr))

    def f32(self, name, arr):
        self.t[name] = ("F32", np.asarray(arr, dtype=np.float32))

    def u8(self, name, arr):
        self.t[name] = ("U8", np.asarray(arr, dtype=np.uint8))

    def lin(self, name, out, inn, scale=1.0):
        self.bf16(name, self.rng.standard_normal((out, inn)) * scale / np.sqrt(inn))

    def norm(self, name, n, dtype="BF16"):
        v = 1.0 + 0.2 * self.rng.standard_normal(n)
        (self.bf16 if dtype == "BF16" else self.f32)(name, v)


def build(preset, seed):
    k3like = preset in ("k3", "k31", "k3-nvfp4")
    b = Builder(seed)
    D, V = 64, 256
    if k3like:
        L, full = 7, [3, 6, 7]
    else:
        L, full = 5, [2, 5]
    kda_layers = [i for i in range(1, L + 1) if i not in full]
    H, K = 4, 16                        # KDA heads x head dim
    P = H * K
    MH, NOPE, ROPE, VD = 4, 16, 8, 16   # MLA
    QL, KVL = 32, 32
    E, TOPK = 8, 2
    I_MOE, LAT = 32, 32
    NSH = 2
    DENSE = 96
    pre = "language_model." if k3like else ""
    m = pre + "model."
    b.bf16(m + "embed_tokens.weight", b.rng.standard_normal((V, D)))
    b.norm(m + "norm.weight", D)
    b.lin(pre + "lm_head.weight", V, D, 2.0)
    if k3like:
        b.norm(m + "output_attn_res_norm.weight", D)
        b.lin(m + "output_attn_res_proj.weight", 1, D, 1.5)
    for l in range(L):
        p = f"{m}layers.{l}."
        b.norm(p + "input_layernorm.weight", D)
        b.norm(p + "post_attention_layernorm.weight", D)
        if k3like:
            for s in ("self_attention_res", "mlp_res"):
                b.norm(p + s + "_norm.weight", D)
                b.lin(p + s + "_proj.weight", 1, D, 1.5)
        a = p + "self_attn."
        if (l + 1) in kda_layers:
            for x in "qkv":
                b.lin(a + f"{x}_proj.weight", P, D)
                conv = b.rng.standard_normal((P, 1, 4)) * 0.6
                if k3like:
                    b.f32(a + f"{x}_conv1d.weight", conv)
                else:
                    b.bf16(a + f"{x}_conv1d.weight", conv)
            alog = 0.5 * b.rng.standard_normal(H)
            if k3like:
                b.f32(a + "A_log", np.concatenate([alog, np.zeros(K - H)]))   # per head + zero tail
            else:
                b.f32(a + "A_log", alog.reshape(1, 1, H, 1))
            b.f32(a + "dt_bias", 0.5 * b.rng.standard_normal(P))
            b.lin(a + "f_a_proj.weight", K, D)
            b.lin(a + "f_b_proj.weight", P, K)
            b.lin(a + "b_proj.weight", H, D, 2.0)
            if k3like:
                b.lin(a + "g_proj.weight", P, D)
            else:
                b.lin(a + "g_a_proj.weight", K, D)
                b.lin(a + "g_b_proj.weight", P, K)
            b.norm(a + "o_norm.weight", K, "F32" if k3like else "BF16")
            b.lin(a + "o_proj.weight", D, P)
        else:
            if k3like:
                b.lin(a + "q_a_proj.weight", QL, D)
                b.norm(a + "q_a_layernorm.weight", QL)
                b.lin(a + "q_b_proj.weight", MH * (NOPE + ROPE), QL, 3.0)
                b.lin(a + "g_proj.weight", MH * VD, D)
            else:
                b.lin(a + "q_proj.weight", MH * (NOPE + ROPE), D, 3.0)
            b.lin(a + "kv_a_proj_with_mqa.weight", KVL + ROPE, D, 2.0)
            b.norm(a + "kv_a_layernorm.weight", KVL)
            b.lin(a + "kv_b_proj.weight", MH * (NOPE + VD), KVL, 2.0)
            b.lin(a + "o_proj.weight", D, MH * VD)
            if preset == "k31":
                ix = a + "indexer."
                b.lin(ix + "wq_b.weight", 4 * 16, QL, 2.0)
                b.lin(ix + "wk.weight", 16, D, 2.0)
                b.norm(ix + "k_norm.weight", 16)
                b.bf16(ix + "k_norm.bias", 0.2 * b.rng.standard_normal(16))
                b.lin(ix + "weights_proj.weight", 4, D)
        if l == 0:
            b.lin(p + "mlp.gate_proj.weight", DENSE, D, 2.0)
            b.lin(p + "mlp.up_proj.weight", DENSE, D, 2.0)
            b.lin(p + "mlp.down_proj.weight", D, DENSE)
        else:
            mo = p + "block_sparse_moe."
            b.lin(mo + "gate.weight", E, D, 2.0)
            b.f32(mo + "gate.e_score_correction_bias", 0.1 * b.rng.standard_normal(E))
            xin = LAT if k3like else D
            if k3like:
                b.lin(mo + "routed_expert_down_proj.weight", LAT, D)
                b.norm(mo + "routed_expert_norm.weight", LAT)
                b.lin(mo + "routed_expert_up_proj.weight", D, LAT)
            for e in range(E):
                for name, (o, i) in (("w1", (I_MOE, xin)), ("w3", (I_MOE, xin)), ("w2", (xin, I_MOE))):
                    w = b.rng.standard_normal((o, i)) * 2.0 / np.sqrt(i)
                    base = f"{mo}experts.{e}.{name}."
                    if k3like:
                        packed, scale = quantize_mxfp4(w)
                        if preset == "k3-nvfp4":
                            pk, nv, gs = mxfp4_to_nvfp4(packed, scale)
                            b.u8(base + "weight_packed", pk)
                            b.t[base + "weight_scale"] = ("F8_E4M3", nv)
                            b.f32(base + "weight_global_scale", gs)
                        else:
                            b.u8(base + "weight_packed", packed)
                            b.u8(base + "weight_scale", scale)
                    else:
                        b.bf16(base + "weight", w)
            sw = I_MOE * NSH
            b.lin(mo + "shared_experts.gate_proj.weight", sw, D, 2.0)
            b.lin(mo + "shared_experts.up_proj.weight", sw, D, 2.0)
            b.lin(mo + "shared_experts.down_proj.weight", D, sw)
    if k3like:
        b.bf16("vision_tower.patch_embed.proj.weight", b.rng.standard_normal((8, 3 * 14 * 14)))
        b.bf16("mm_projector.proj.0.weight", b.rng.standard_normal((D, 8)))

    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": V, "hidden_size": D, "intermediate_size": DENSE, "num_hidden_layers": L,
        "num_attention_heads": MH, "num_key_value_heads": MH,
        "q_lora_rank": QL if k3like else None, "kv_lora_rank": KVL,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": VD,
        "mla_use_nope": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": E, "num_experts_per_token": TOPK, "num_shared_experts": NSH,
        "moe_intermediate_size": I_MOE, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "use_grouped_topk": True, "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {"num_heads": H, "head_dim": K, "short_conv_kernel_size": 4,
                               "kda_layers": kda_layers, "full_attn_layers": full},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    if k3like:
        text.update({
            "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "mla_use_output_gate": True, "routed_expert_hidden_size": LAT, "latent_moe_use_norm": True,
            "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
            "attn_res_block_size": 3,
        })
        text["linear_attn_config"].update({"use_full_rank_gate": True, "gate_lower_bound": -5.0})
        text["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized" if preset == "k3-nvfp4" else "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "group_size": 16 if preset == "k3-nvfp4" else 32, "type": "float",
                "symmetric": True, "strategy": "group"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
        if preset == "k31":
            text["dsa_config"] = {"dsa_layers": full, "index_rope_dim": 0, "index_n_heads": 4,
                                  "index_head_dim": 16, "index_topk": 5}
        cfg = {"architectures": ["KimiK3ForConditionalGeneration"],
               "model_type": "kimi_k31" if preset == "k31" else "kimi_k3",
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
               "text_config": text, "vision_config": {"patch_size": 14, "vt_hidden_size": 8}}
    else:
        text.update({"hidden_act": "silu", "routed_scaling_factor": 2.446, "num_expert_group": 2,
                     "topk_group": 1})
        cfg = text
    return cfg, b.t


def write(out_dir, cfg, tensors, shards):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": cfg.get("bos_token_id", 1), "eos_token_id": cfg.get("eos_token_id", 2)}, fh)
    names = list(tensors)
    if shards <= 1:
        kimi_ref.write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
        return
    wm = {}
    total = 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for i, n in enumerate(names) if i % shards == s}
        kimi_ref.write_safetensors(os.path.join(out_dir, fname), part, {"format": "pt"})
        for n, (_, a) in part.items():
            wm[n] = fname
            total += a.nbytes
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, fh, indent=1)


PRESETS = ("k3", "k31", "k3-nvfp4", "kimi-linear")


def make(preset, out_dir, seed=0):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; have {PRESETS}")
    cfg, tensors = build(preset, seed)
    write(out_dir, cfg, tensors, 1 if preset == "kimi-linear" else 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True, choices=PRESETS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.preset, a.out, a.seed)


if __name__ == "__main__":
    main()
