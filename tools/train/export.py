"""Export a trained k3model.K3 in the published Kimi K3 / K3.1 checkpoint layout (ARCHITECTURE §1.3-§2.5),
and read such a checkpoint back into the PyTorch model (the trainer's view of the shipped weights).

Layout: wrapper config.json (model_type kimi_k3 / kimi_k31, text_config with quantization_config and,
for K3.1, dsa_config), generation_config.json, model.safetensors.index.json + shards, tiktoken.model,
tokenizer_config.json. Tensor names carry `language_model.`. Dtypes as K3 ships them: BF16, except F32
for A_log (padded to the head dim with a zero tail), dt_bias, the conv weights, o_norm and
e_score_correction_bias. Routed experts are compressed-tensors MXFP4 (`weight_packed` U8 [out, in/2],
low nibble = even column; `weight_scale` U8 [out, in/32], E8M0), quantised with the OCP MX rule that
src/quant/mxfp4.h documents (shared exponent floor(log2 amax) - 2, round to nearest E2M1, ties to the
even code, saturate at 6; all-zero block -> scale byte 0).
"""

import json
import os
import shutil
import struct

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------------
# number formats
# ---------------------------------------------------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def bf16_bits(x):
    """float32 array -> BF16 bit patterns (round to nearest even)."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[np.isnan(f)] = 0x7FC0
    return r


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def e2m1_code(m):
    """|x| (already scaled) -> magnitude code 0..7, round to nearest, ties to the even code, saturating."""
    code = np.zeros(m.shape, dtype=np.uint8)
    for t in (0.25, 1.25, 2.5, 5.0):      # tie goes to the lower (even) code
        code += (m > t)
    for t in (0.75, 1.75, 3.5):           # tie goes to the upper (even) code
        code += (m >= t)
    return code


def mxfp4_quantize(w):
    """float32 [out, in] -> (packed U8 [out, in/2], scale U8 [out, in/32])."""
    w = np.asarray(w, dtype=np.float32)
    out, inn = w.shape
    assert inn % 32 == 0 and np.isfinite(w).all()
    blk = w.reshape(out, inn // 32, 32).astype(np.float64)
    amax = np.abs(blk).max(-1)
    _, e2 = np.frexp(amax)                                   # amax = m * 2^e2, m in [0.5, 1)
    shared = np.where(amax > 0, np.clip(e2 - 1 - 2, -127, 127), -127).astype(np.int64)
    scaled = np.ldexp(blk, -shared[..., None])
    code = e2m1_code(np.abs(scaled)) | np.where(np.signbit(scaled), 8, 0).astype(np.uint8)
    code = code.reshape(out, inn)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return packed, (shared + 127).astype(np.uint8)


def mxfp4_dequant(packed, scale):
    lo, hi = packed & 0x0F, packed >> 4
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = lo, hi
    v = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    s = np.ldexp(1.0, scale.astype(np.int64) - 127)
    return (v * np.repeat(s, 32, axis=1)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------------

_NP = {"BF16": np.uint16, "F32": np.float32, "U8": np.uint8}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr.astype(_NP[dt])).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hj)))
        fh.write(hj)
        for b in blobs:
            fh.write(b)
    return off


def read_safetensors(path):
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        data = fh.read()
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = (e["dtype"], np.frombuffer(data[a:b], dtype=_NP[e["dtype"]]).reshape(e["shape"]))
    return out


def read_checkpoint(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        wm = json.load(fh)["weight_map"]
    files = {}
    for f in sorted(set(wm.values())):
        files[f] = read_safetensors(os.path.join(d, f))
    return {n: files[f][n] for n, f in wm.items()}


# ---------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------

def config_json(g, n_ranks, k31):
    L = g["layers"]
    full = [l + 1 for l in range(L) if (l + 1) % 4 == 0 or l == L - 1]
    kda = [l + 1 for l in range(L) if l + 1 not in full]
    bos, eos, pad, media = n_ranks + 0, n_ranks + 2, n_ranks + 255, n_ranks + 21
    t = {
        "model_type": "kimi_linear", "vocab_size": g["vocab"], "hidden_size": g["hidden"],
        "intermediate_size": g["dense_inter"], "num_hidden_layers": L,
        "num_attention_heads": g["mla_heads"], "num_key_value_heads": g["mla_heads"],
        "q_lora_rank": g["q_lora"], "kv_lora_rank": g["kv_lora"], "qk_nope_head_dim": g["nope"],
        "qk_rope_head_dim": g["rope"], "v_head_dim": g["v"], "mla_use_nope": True,
        "rms_norm_eps": g["eps"], "tie_word_embeddings": False, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": g["experts"], "num_experts_per_token": g["topk"], "num_shared_experts": g["shared"],
        "moe_intermediate_size": g["moe_inter"], "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "hidden_act": "situ", "activation_situ_beta": g["situ_beta"], "activation_situ_linear_beta": g["situ_lambda"],
        "mla_use_output_gate": True, "attn_res_block_size": g["attn_res_block"],
        "routed_expert_hidden_size": g["latent"], "latent_moe_use_norm": True,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "group_size": 32, "type": "float",
                                                      "symmetric": True, "strategy": "group",
                                                      "scale_dtype": "torch.uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]},
        "linear_attn_config": {"num_heads": g["kda_heads"], "head_dim": g["kda_dim"],
                               "short_conv_kernel_size": g["conv"], "kda_layers": kda, "full_attn_layers": full,
                               "use_full_rank_gate": True, "gate_lower_bound": g["gate_lower_bound"]},
    }
    if k31:
        t["dsa_config"] = {"dsa_layers": full, "index_rope_dim": 0, "index_n_heads": g["index_heads"],
                           "index_head_dim": g["index_dim"], "index_topk": g["index_topk"]}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k31" if k31 else "kimi_k3",
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "media_placeholder_token_id": media,
            "tie_word_embeddings": False, "text_config": t,
            "vision_config": {"patch_size": 14, "vt_hidden_size": 1024}}


# ---------------------------------------------------------------------------------------------------
# name mapping
# ---------------------------------------------------------------------------------------------------

F32_SUFFIXES = ("A_log", "dt_bias", "_conv1d", "o_norm.weight", "e_score_correction_bias")


def ck_name(n):
    """torch state_dict name -> checkpoint name (without routed experts)."""
    n = n.replace("self_attention_res.norm.", "self_attention_res_norm.")
    n = n.replace("self_attention_res.proj.", "self_attention_res_proj.")
    n = n.replace("mlp_res.norm.", "mlp_res_norm.").replace("mlp_res.proj.", "mlp_res_proj.")
    n = n.replace("output_attn_res.norm.", "output_attn_res_norm.").replace("output_attn_res.proj.", "output_attn_res_proj.")
    for c in ("q_conv1d", "k_conv1d", "v_conv1d"):
        if n.endswith("self_attn." + c):
            n += ".weight"
    if n.startswith("lm_head."):
        return "language_model." + n
    return "language_model.model." + n


def checkpoint_tensors(model, quantize=True):
    """{checkpoint name: (dtype, numpy array)} of the model."""
    g = model.g
    out = {}
    for n, t in model.state_dict().items():
        a = t.detach().float().cpu().numpy()
        if n.endswith(".w1") or n.endswith(".w3") or n.endswith(".w2"):
            base = ck_name(n[:-3]) + ".experts."
            m = n[-2:]
            for e in range(a.shape[0]):
                packed, scale = mxfp4_quantize(a[e])
                out[f"{base}{e}.{m}.weight_packed"] = ("U8", packed)
                out[f"{base}{e}.{m}.weight_scale"] = ("U8", scale)
            continue
        name = ck_name(n)
        if n.endswith("A_log"):
            pad = np.zeros(max(g["kda_heads"], g["kda_dim"]), dtype=np.float32)
            pad[:a.size] = a
            a = pad
        if any(name.endswith(s) for s in F32_SUFFIXES):
            out[name] = ("F32", a.astype(np.float32))
        else:
            out[name] = ("BF16", bf16_bits(a))
    return out


def load_checkpoint_into(model, d):
    """Fill the torch model from an exported checkpoint dir (BF16 decoded exactly, MXFP4 dequantised)."""
    ck = read_checkpoint(d)
    used = set()
    sd = model.state_dict()
    new = {}
    for n, t in sd.items():
        if n.endswith(".w1") or n.endswith(".w3") or n.endswith(".w2"):
            base = ck_name(n[:-3]) + ".experts."
            mats = []
            for e in range(t.shape[0]):
                p, s = f"{base}{e}.{n[-2:]}.weight_packed", f"{base}{e}.{n[-2:]}.weight_scale"
                mats.append(mxfp4_dequant(ck[p][1], ck[s][1]))
                used.update((p, s))
            new[n] = torch.from_numpy(np.stack(mats))
            continue
        name = ck_name(n)
        dt, a = ck[name]
        used.add(name)
        v = bf16_to_f32(a) if dt == "BF16" else a.astype(np.float32)
        if n.endswith("A_log"):
            assert not v[t.numel():].any(), f"{name}: non-zero A_log tail"
            v = v[:t.numel()]
        new[n] = torch.from_numpy(np.ascontiguousarray(v)).reshape(t.shape)
    missing = set(ck) - used
    assert not missing, f"{d}: tensors not consumed by the model: {sorted(missing)[:5]}"
    model.load_state_dict(new)
    return model


def export(model, out_dir, tok_dir, k31=False, n_shards=2, shard_names=None, only=None, generation=None):
    """Writes the whole model dir. `shard_names`/`only` let a K3.1 dir reuse the K3 shards: tensors not
    selected by `only` are mapped to the given existing shard names (caller makes them available)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = checkpoint_tensors(model)
    n_ranks = sum(1 for _ in open(os.path.join(tok_dir, "tiktoken.model")))
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config_json(model.g, n_ranks, k31), fh, indent=2)
        fh.write("\n")
    gen = {"bos_token_id": n_ranks, "eos_token_id": [n_ranks + 2, n_ranks + 1], "do_sample": True,
           "temperature": 0.8, "top_p": 0.95}
    if generation:
        gen.update(generation)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump(gen, fh, indent=2)
        fh.write("\n")
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))
    weight_map = {}
    total = 0
    if only is not None:
        own = {n: v for n, v in tensors.items() if only(n)}
        for n in tensors:
            if n not in own:
                weight_map[n] = shard_names[n]
        fname = "model-k31-indexer.safetensors"
        write_safetensors(os.path.join(out_dir, fname), own)
        total = sum(a.nbytes for _, a in tensors.values())   # the whole model, shared shards included
        for n in own:
            weight_map[n] = fname
    else:
        names = list(tensors)
        sizes = [tensors[n][1].nbytes for n in names]
        budget = sum(sizes) / n_shards
        shard, acc, groups = 0, 0, [[] for _ in range(n_shards)]
        for n, s in zip(names, sizes):
            if acc + s > budget * (shard + 1) and shard < n_shards - 1:
                shard += 1
            groups[shard].append(n)
            acc += s
        for i, grp in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            total += write_safetensors(os.path.join(out_dir, fname), {n: tensors[n] for n in grp})
            for n in grp:
                weight_map[n] = fname
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=1)
        fh.write("\n")
    return weight_map
