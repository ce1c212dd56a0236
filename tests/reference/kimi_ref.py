#!/usr/bin/python3
"""Independent float64 reference of the Kimi K3 / K3.1 / Kimi-Linear forward pass.

Written from ../shared/spec/ARCHITECTURE.md (sections 1-4) with plain Python + numpy.  No code is
shared with the C++ engine.  Run it with /usr/bin/python3 (Debian python3-numpy).

    python3 tests/reference/kimi_ref.py logits   --model DIR --ids 1,2,3
    python3 tests/reference/kimi_ref.py generate --model DIR --ids 1,2,3 -n 12
    python3 tests/reference/kimi_ref.py check    --model DIR      # two-way tensor coverage

Precision policy (deliberate, differs from the bf16 HF reference of ARCHITECTURE 3.0):
  * every weight is upcast EXACTLY to float64 (BF16 -> fp32 by bit shift, then fp64);
  * every activation is float64 and is never rounded to bf16 between modules.
  The C++ CPU reference also keeps fp32 activations, so both sit within fp32 rounding of the exact
  real-number forward, not within bf16 rounding of the HF bf16 run.

Spec points where a choice had to be made are marked "RESOLVED:" in the comments.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

# ----------------------------------------------------------------------------------------------------
# safetensors reading (plain Python: 8-byte LE header length, JSON header, data offsets)
# ----------------------------------------------------------------------------------------------------

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)


def _e4m3_table():
    """float64 value of every F8_E4M3 (fn) byte; 0x7F/0xFF are NaN."""
    t = np.zeros(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 0x7
        if e == 0xF and m == 0x7:
            t[b] = np.nan
        elif e == 0:
            t[b] = s * (m / 8.0) * 2.0 ** -6
        else:
            t[b] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


_E4M3 = _e4m3_table()

_DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4,
                "I64": 8, "BOOL": 1, "F8_E4M3": 1}


def bf16_bits_to_f64(u16):
    """BF16 bit patterns (uint16 array) -> float64, exactly (shift into the high half of fp32)."""
    u32 = u16.astype(np.uint32) << np.uint32(16)
    return u32.view(np.float32).astype(np.float64)


def f64_to_bf16_bits(x):
    """Round float values to BF16 (round to nearest even); returns uint16 bit patterns."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, tensor bytes read on demand."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024 * 1024:
                raise ValueError(f"{path}: header length {n} is implausible")
            header = json.loads(fh.read(n).decode("utf-8"))
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        size = os.path.getsize(path)
        for name, e in header.items():
            dt = e["dtype"]
            if dt not in _DTYPE_SIZES:
                raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
            begin, end = e["data_offsets"]
            want = _DTYPE_SIZES[dt] * int(np.prod(e["shape"], dtype=np.int64))
            if end - begin != want:
                raise ValueError(f"{path}: tensor {name}: {end - begin} bytes for shape {e['shape']} {dt}")
            if self.data_start + end > size:
                raise ValueError(f"{path}: tensor {name}: data runs past the end of the file")

    def raw(self, name):
        """(dtype string, shape tuple, raw numpy array in its storage type)."""
        e = self.entries[name]
        dt, shape = e["dtype"], tuple(e["shape"])
        begin, end = e["data_offsets"]
        with open(self.path, "rb") as fh:
            fh.seek(self.data_start + begin)
            buf = fh.read(end - begin)
        np_t = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "U8": "u1", "I8": "i1",
                "I16": "<i2", "I32": "<i4", "I64": "<i8", "BOOL": "u1", "F8_E4M3": "u1"}[dt]
        arr = np.frombuffer(buf, dtype=np_t).reshape(shape)
        return dt, shape, arr


def to_f64(dt, arr, name="tensor"):
    """Decode a raw tensor to float64 exactly."""
    if dt == "BF16":
        return bf16_bits_to_f64(arr)
    if dt in ("F16", "F32", "F64", "I8", "I16", "I32", "I64"):
        return arr.astype(np.float64)
    if dt == "F8_E4M3":
        v = _E4M3[arr]
        if np.isnan(v).any():
            raise ValueError(f"{name}: F8_E4M3 NaN byte present")
        return v
    raise ValueError(f"{name}: dtype {dt} has no float decode")


def write_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> (dtype string, numpy array already in storage type)."""
    header = {}
    blobs = []
    off = 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata is not None:
        header["__metadata__"] = metadata
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hj)))
        fh.write(hj)
        for b in blobs:
            fh.write(b)


class Checkpoint:
    """All tensors of a model directory: model.safetensors or model.safetensors.index.json shards."""

    def __init__(self, model_dir):
        self.dir = model_dir
        self.where = {}
        idx = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        files = {}
        if os.path.exists(idx):
            with open(idx) as fh:
                wm = json.load(fh)["weight_map"]
            for name, fname in wm.items():
                if fname not in files:
                    files[fname] = SafetensorsFile(os.path.join(model_dir, fname))
                if name not in files[fname].entries:
                    raise ValueError(f"{idx}: {name} mapped to {fname} but that shard's header lacks it")
                self.where[name] = files[fname]
            for fname, f in files.items():
                for name in f.entries:
                    if name not in wm:
                        raise ValueError(f"{fname}: tensor {name} is not in {idx}")
        elif os.path.exists(single):
            f = SafetensorsFile(single)
            for name in f.entries:
                self.where[name] = f
        else:
            raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
        self.used = set()

    def has(self, name):
        return name in self.where

    def dtype(self, name):
        return self.where[name].entries[name]["dtype"]

    def shape(self, name):
        return tuple(self.where[name].entries[name]["shape"])

    def raw(self, name):
        if name not in self.where:
            raise KeyError(f"{self.dir}: tensor {name} not found")
        self.used.add(name)
        return self.where[name].raw(name)

    def f64(self, name):
        dt, _, arr = self.raw(name)
        return to_f64(dt, arr, name)


# ----------------------------------------------------------------------------------------------------
# Quantised expert decoding (ARCHITECTURE 2.5, 3.8)
# ----------------------------------------------------------------------------------------------------

def unpack_e2m1(packed):
    """U8 [out, in/2] -> float64 [out, in]; low nibble = even column."""
    lo = packed & 0x0F
    hi = packed >> 4
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.float64)
    out[:, 0::2] = _E2M1[lo]
    out[:, 1::2] = _E2M1[hi]
    return out


def decode_mxfp4(packed, scale, name="tensor"):
    """compressed-tensors mxfp4-pack-quantized: W[r,c] = E2M1(nib) * 2^(scale[r, c/32] - 127)."""
    rows, half = packed.shape
    cols = half * 2
    if scale.shape != (rows, cols // 32) or cols % 32:
        raise ValueError(f"{name}: MXFP4 scale shape {scale.shape} does not fit packed {packed.shape}")
    if (scale == 0xFF).any():
        raise ValueError(f"{name}: E8M0 scale byte 0xFF (NaN)")
    w = unpack_e2m1(packed)
    s = np.ldexp(1.0, scale.astype(np.int64) - 127)  # [rows, cols/32]
    return w * np.repeat(s, 32, axis=1)


def decode_nvfp4(packed, scale_e4m3, global_scale, name="tensor"):
    """NVFP4: W = E2M1 * E4M3(scale[r, c/16]) * global.
    RESOLVED: weight_global_scale is applied as a MULTIPLIER (the project's convention, see brief)."""
    rows, half = packed.shape
    cols = half * 2
    if scale_e4m3.shape != (rows, cols // 16) or cols % 16:
        raise ValueError(f"{name}: NVFP4 scale shape {scale_e4m3.shape} does not fit packed {packed.shape}")
    s = _E4M3[scale_e4m3]
    if np.isnan(s).any():
        raise ValueError(f"{name}: NVFP4 E4M3 scale NaN")
    return unpack_e2m1(packed) * np.repeat(s, 16, axis=1) * float(global_scale)


# ----------------------------------------------------------------------------------------------------
# Config (three forms, ARCHITECTURE 1)
# ----------------------------------------------------------------------------------------------------

def _first(d, keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


class Config:
    """Canonical view of the model configuration."""

    def __init__(self, raw):
        self.raw = raw
        mt = raw.get("model_type")
        if mt in ("kimi_k3", "kimi_k31"):
            self.form = "wrapper"
            self.variant = "k31" if mt == "kimi_k31" else "k3"
            if "text_config" not in raw:
                raise ValueError(f"config.json: model_type {mt} without text_config")
            t = raw["text_config"]
            if t.get("model_type") != "kimi_linear":
                raise ValueError(f"config.json: text_config.model_type is {t.get('model_type')!r}, want 'kimi_linear'")
            self.prefix = "language_model."
            if "quantization_config" in raw and "quantization_config" not in t:
                raise ValueError("config.json: quantization_config sits at top level; it belongs inside text_config")
            if "dsa_config" in raw and "dsa_config" not in t:
                raise ValueError("config.json: dsa_config sits at top level; it belongs inside text_config")
        else:
            t = raw
            self.prefix = ""
            self.variant = "kimi_linear"
            self.form = "original" if "linear_attn_config" in t else "native"
        self.t = t
        L = int(_first(t, ["num_hidden_layers"]))
        self.n_layers = L
        self.vocab = int(t["vocab_size"])
        self.hidden = int(t["hidden_size"])
        self.eps = float(_first(t, ["rms_norm_eps"], 1e-5 if self.form == "native" else 1e-6))

        # --- layer types (1-based lists, ARCHITECTURE 1.6) ---
        lac = t.get("linear_attn_config") or {}
        if "kda_layers" in lac or "full_attn_layers" in lac:
            kda = list(lac.get("kda_layers", []))
            full = list(lac.get("full_attn_layers", []))
            for v in kda + full:
                if not 1 <= v <= L:
                    raise ValueError(f"config.json: linear_attn_config layer {v} outside 1..{L} (lists are 1-based)")
            if sorted(kda + full) != list(range(1, L + 1)):
                raise ValueError("config.json: linear_attn_config.kda_layers and full_attn_layers do not partition 1..%d" % L)
            self.is_mla = [(l + 1) in full for l in range(L)]
        elif t.get("layer_types") is not None:
            lt = t["layer_types"]
            if len(lt) != L:
                raise ValueError(f"config.json: layer_types has {len(lt)} entries for {L} layers")
            bad = [x for x in lt if x not in ("full_attention", "linear_attention")]
            if bad:
                raise ValueError(f"config.json: unknown layer_types entry {bad[0]!r}")
            self.is_mla = [x == "full_attention" for x in lt]
        else:
            raise ValueError("config.json: no layer-type information (linear_attn_config lists or layer_types)")

        # --- KDA ---
        self.kda_heads = int(_first(lac, ["num_heads"], _first(
            t, ["linear_num_heads", "linear_attn_key_heads", "linear_attn_value_heads"], 32)))
        self.kda_head_dim = int(_first(lac, ["head_dim"], _first(
            t, ["linear_head_dim", "linear_attn_key_head_dim", "linear_attn_value_head_dim"], 128)))
        self.conv_k = int(_first(lac, ["short_conv_kernel_size"], _first(t, ["linear_conv_kernel_dim"], 4)))
        self.gate_lower_bound = _first(lac, ["gate_lower_bound"],
                                       _first(t, ["gate_lower_bound", "forget_gate_lower_bound"]))

        # --- MLA ---
        self.heads = int(t["num_attention_heads"])
        self.q_lora = t.get("q_lora_rank")
        self.kv_lora = int(t["kv_lora_rank"])
        self.nope = int(t["qk_nope_head_dim"])
        self.rope = int(t.get("qk_rope_head_dim", 0))
        self.v_dim = int(t["v_head_dim"])
        self.mla_gate = bool(t.get("mla_use_output_gate", False))

        # --- FFN / MoE ---
        self.n_experts = _first(t, ["num_experts", "num_local_experts", "n_routed_experts"])
        self.top_k = _first(t, ["num_experts_per_token", "num_experts_per_tok"])
        self.n_shared = int(_first(t, ["num_shared_experts", "n_shared_experts"], 0))
        self.routed_scale = float(_first(t, ["routed_scaling_factor"], 1.0))
        self.renorm = bool(_first(t, ["moe_renormalize", "norm_topk_prob"], True))
        self.router_act = _first(t, ["moe_router_activation_func"], "sigmoid")
        if self.router_act not in ("sigmoid", "softmax"):
            raise ValueError(f"config.json: moe_router_activation_func {self.router_act!r} unknown")
        self.n_group = int(_first(t, ["num_expert_group", "n_group"], 1))
        self.topk_group = int(_first(t, ["topk_group"], 1))
        self.latent = t.get("routed_expert_hidden_size")
        # RESOLVED: latent_moe_use_norm decides when stated; when absent, the presence of
        # routed_expert_norm.weight decides (Model.moe).
        self.latent_norm = t.get("latent_moe_use_norm")
        fkdr = int(_first(t, ["first_k_dense_replace"], 0 if self.form != "native" else 1))
        freq = int(_first(t, ["moe_layer_freq"], 1))
        if t.get("mlp_layer_types") is not None:
            mlt = t["mlp_layer_types"]
            if len(mlt) != L or any(x not in ("dense", "sparse") for x in mlt):
                raise ValueError("config.json: mlp_layer_types must list 'dense'/'sparse' once per layer")
            self.is_moe = [x == "sparse" for x in mlt]
        else:
            self.is_moe = [self.n_experts is not None and l >= fkdr and l % freq == 0 for l in range(L)]
        if any(self.is_moe) and (self.n_experts is None or self.top_k is None):
            raise ValueError("config.json: MoE layers but num_experts / num_experts_per_token missing")
        self.act = t.get("hidden_act", "silu")
        if self.act not in ("silu", "situ"):
            raise ValueError(f"config.json: hidden_act {self.act!r} unsupported")
        self.situ_beta = float(_first(t, ["activation_situ_beta"], 1.0))
        lb = t.get("activation_situ_linear_beta")
        # RESOLVED (ARCHITECTURE 1.2 a): a missing linear beta is identity in the original/wrapper form,
        # 1.0 (tanh(u)) in the transformers-native form, whose default it is.
        if lb is None and self.form == "native":
            lb = 1.0
        self.situ_linear_beta = None if lb is None else float(lb)

        # --- AttnRes ---
        self.attn_res = int(t.get("attn_res_block_size") or 0)

        # --- K3.1 indexer ---
        dsa = t.get("dsa_config")
        self.dsa = dsa is not None
        if self.variant == "k31" and not self.dsa:
            raise ValueError("config.json: model_type kimi_k31 but text_config has no dsa_config")
        if self.variant == "k3" and self.dsa:
            raise ValueError("config.json: model_type kimi_k3 but text_config has a dsa_config")
        if self.dsa:
            layers = dsa.get("dsa_layers")
            if layers is None:
                raise ValueError("config.json: dsa_config.dsa_layers missing")
            self.dsa_layer = [(l + 1) in layers for l in range(L)]
            for l in range(L):
                if self.dsa_layer[l] and not self.is_mla[l]:
                    raise ValueError(f"config.json: dsa_layers names layer {l + 1} (1-based), which is not MLA")
            if int(dsa.get("index_rope_dim", 0)) != 0:
                raise ValueError("config.json: dsa_config.index_rope_dim != 0 is not supported (spec: no RoPE)")
            self.index_heads = _first(dsa, ["index_n_heads", "index_num_heads", "num_heads", "n_heads"])
            self.index_head_dim = _first(dsa, ["index_head_dim", "head_dim"])
            topk = _first(dsa, ["index_topk", "topk"])
            if topk is None:
                raise ValueError("config.json: dsa_config has no index_topk (aliases: topk)")
            self.index_topk = int(topk)
        else:
            self.dsa_layer = [False] * L


# ----------------------------------------------------------------------------------------------------
# Primitives (ARCHITECTURE 3.0)
# ----------------------------------------------------------------------------------------------------

def sigmoid(x):
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def softplus(x):
    return np.logaddexp(0.0, x)


def silu(x):
    return x * sigmoid(x)


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layernorm(x, w, b, eps):
    mu = np.mean(x, axis=-1, keepdims=True)
    d = x - mu
    return d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + eps) * w + b


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ(a, b, beta, linear_beta):
    """SiTU-GLU: [beta*tanh(a/beta)*sigmoid(a)] * [lambda*tanh(b/lambda)] (identity up if lambda None)."""
    g = beta * np.tanh(a / beta) * sigmoid(a)
    u = b if linear_beta is None else linear_beta * np.tanh(b / linear_beta)
    return g * u


def glu(cfg, a, b):
    if cfg.act == "situ":
        return situ(a, b, cfg.situ_beta, cfg.situ_linear_beta)
    return silu(a) * b


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def attn_res_mix(cands, norm_w, proj_w, eps):
    """AttnResMix (ARCHITECTURE 3.2). cands: list of [T, D] (snapshots first, prefix last)."""
    V = np.stack(cands, axis=0)                                   # [N, T, D]
    w = norm_w * proj_w.reshape(-1)                               # [D]
    r = 1.0 / np.sqrt(np.mean(V * V, axis=-1) + eps)              # [N, T]
    s = np.einsum("ntd,d->nt", V, w) * r                          # [N, T]
    a = softmax(s, axis=0)                                        # [N, T]
    return np.einsum("nt,ntd->td", a, V)                          # weighted sum of RAW candidates


def kda_gate(f, dt_bias, a_log, lower_bound):
    """Log-decay g[..., h, d] (ARCHITECTURE 3.4). f: [..., H, K]; dt_bias [H, K]; a_log [H]."""
    a = np.exp(a_log)[:, None]                                    # per head
    if lower_bound is not None:
        return float(lower_bound) * sigmoid(a * (f + dt_bias))
    return -a * softplus(f + dt_bias)


def kda_recurrent(q, k, v, g, beta, S0=None):
    """Ground-truth recurrence. q,k: [T,H,K] (already normed/scaled), v: [T,H,V], g: [T,H,K],
    beta: [T,H]. Order per step: decay -> delta update -> read. Returns (o [T,H,V], S [H,K,V])."""
    T, H, K = k.shape
    Vd = v.shape[-1]
    S = np.zeros((H, K, Vd)) if S0 is None else S0.copy()
    o = np.empty((T, H, Vd))
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        u = beta[t][:, None] * (v[t] - pred)
        S = S + k[t][:, :, None] * u[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def kda_chunked(q, k, v, g, beta, S0=None, C=64):
    """Chunked WY form, ARCHITECTURE 3.4 steps 1-7, per head; tail padded with k=v=0, beta=0, g=0."""
    T, H, K = k.shape
    Vd = v.shape[-1]
    pad = (-T) % C
    if pad:
        z = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:])], axis=0)
        q, k, v, g, beta = z(q), z(k), z(v), z(g), z(beta)
    S = np.zeros((H, K, Vd)) if S0 is None else S0.copy()
    out = np.empty((T + pad, H, Vd))
    strict = np.tril(np.ones((C, C), dtype=bool), -1)
    incl = np.tril(np.ones((C, C), dtype=bool), 0)
    for c0 in range(0, T + pad, C):
        sl = slice(c0, c0 + C)
        for h in range(H):
            Q, Kc, Vc, G, Bt = q[sl, h], k[sl, h], v[sl, h], g[sl, h], beta[sl, h]
            Gam = np.cumsum(G, axis=0)                                      # [C, K] inclusive
            D = Gam[:, None, :] - Gam[None, :, :]                           # [i, j, K]
            E = np.exp(np.where(incl[:, :, None], D, -np.inf))              # only j <= i: exponent <= 0
            M = Bt[:, None] * np.einsum("id,jd,ijd->ij", Kc, Kc, E) * strict        # step 1
            # step 2: T = (I + M)^-1 diag(beta) by forward substitution over rows
            Tm = np.zeros((C, C))
            for i in range(C):
                row = np.zeros(C)
                row[i] = Bt[i]
                row -= M[i, :i] @ Tm[:i, :]
                Tm[i] = row
            W = Tm @ (np.exp(Gam) * Kc)                                     # step 3
            U = Tm @ Vc
            Aqk = np.einsum("id,jd,ijd->ij", Q, Kc, E) * incl               # step 4
            Vt = U - W @ S[h]                                               # step 5
            out[sl, h] = (Q * np.exp(Gam)) @ S[h] + Aqk @ Vt                # step 6
            last = Gam[-1]
            S[h] = np.exp(last)[:, None] * S[h] + (np.exp(last[None, :] - Gam) * Kc).T @ Vt   # step 7
    return out[:T], S


def causal_conv_silu(s, w):
    """Depthwise causal conv + SiLU with zero history. s: [T, P] pre-conv stream, w: [P, W]; tap W-1
    multiplies the current token."""
    T, P = s.shape
    W = w.shape[1]
    padded = np.concatenate([np.zeros((W - 1, P)), s], axis=0)
    y = np.zeros((T, P))
    for j in range(W):
        y += w[:, j] * padded[j:j + T]
    return silu(y)


def indexer_select(scores, topk):
    """Selection rule of ARCHITECTURE 3.6 for one query row. scores: [n] over positions 0..n-1.
    Returns ascending list: all strictly above theta, then the theta group from the lowest position,
    truncated to topk."""
    n = scores.shape[0]
    if n <= topk:
        return np.arange(n)
    theta = np.sort(scores)[::-1][topk - 1]
    above = np.nonzero(scores > theta)[0]
    equal = np.nonzero(scores == theta)[0]
    sel = np.concatenate([above, equal[:topk - len(above)]])
    return np.sort(sel)


def moe_route(logits, bias, k, n_group=1, topk_group=1, renorm=True, scale=1.0, act="sigmoid"):
    """Selection by score + correction bias (grouped when n_group > 1: group score = sum of its top-2
    biased scores, keep topk_group groups, others -inf); weights = RAW scores of the chosen experts,
    renormalised with +1e-20, times scale. Returns (sel [T, k], weights [T, k])."""
    E = logits.shape[-1]
    scores = sigmoid(logits) if act == "sigmoid" else softmax(logits, axis=-1)
    choice = scores + bias
    if n_group > 1:
        gsz = E // n_group
        grp = choice.reshape(-1, n_group, gsz)
        top2 = -np.sort(-grp, axis=-1)[:, :, :2].sum(-1)
        keep = np.argsort(-top2, axis=-1, kind="stable")[:, :topk_group]
        gm = np.zeros(top2.shape, dtype=bool)
        np.put_along_axis(gm, keep, True, axis=-1)
        choice = np.where(np.repeat(gm, gsz, axis=-1), choice, -np.inf)
    # RESOLVED: exact ties in the biased score go to the lower expert index (stable sort).
    sel = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    wts = np.take_along_axis(scores, sel, axis=-1)
    if renorm and k > 1:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return sel, wts * scale


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------

class Model:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as fh:
            self.cfg = Config(json.load(fh))
        self.ck = Checkpoint(model_dir)
        self.cache = {}
        self.margins = {}   # selection margins seen by the last forward (see _note_margin)
        c = self.cfg
        # K3.1 detection in both directions (ARCHITECTURE 1.4): indexer tensors must agree.
        mla_layers = [l for l in range(c.n_layers) if c.is_mla[l]]
        has_idx = [self._indexer_names(l) is not None for l in mla_layers]
        if c.dsa:
            missing = [l for l in range(c.n_layers) if c.dsa_layer[l] and self._indexer_names(l) is None]
            if missing:
                raise ValueError(f"config says K3.1 (dsa_config) but layer {missing[0]} has no indexer tensors")
        elif any(has_idx):
            raise ValueError("indexer tensors present but config has no dsa_config (K3.1 tree under a K3 config?)")

    # -- weight access --
    def name(self, suffix, layer=None):
        base = self.cfg.prefix + "model."
        if layer is not None:
            base += f"layers.{layer}."
        return base + suffix

    def w(self, suffix, layer=None, top=False):
        n = (self.cfg.prefix + suffix) if top else self.name(suffix, layer)
        if n not in self.cache:
            self.cache[n] = self.ck.f64(n)
        return self.cache[n]

    def has(self, suffix, layer=None):
        return self.ck.has(self.name(suffix, layer))

    def pick(self, layer, *cands):
        for s in cands:
            if self.has(s, layer):
                return self.w(s, layer)
        raise KeyError(f"layer {layer}: none of {cands} present under {self.name('', layer)}")

    def _indexer_names(self, l):
        base = "self_attn.indexer."
        names = [base + x for x in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                                    "weights_proj.weight")]
        if all(self.has(n, l) for n in names):
            return names
        if any(self.has(n, l) for n in names):
            raise ValueError(f"layer {l}: incomplete indexer tensor set under self_attn.indexer.")
        return None

    # -- modules --
    def kda(self, l, x):
        c = self.cfg
        H, K = c.kda_heads, c.kda_head_dim
        T = x.shape[0]
        qs = x @ self.pick(l, "self_attn.q_proj.weight").T
        ks = x @ self.pick(l, "self_attn.k_proj.weight").T
        vs = x @ self.pick(l, "self_attn.v_proj.weight").T
        if self.has("self_attn.q_conv1d.weight", l):
            cw = [self.w(f"self_attn.{p}_conv1d.weight", l).reshape(H * K, -1) for p in "qkv"]
        else:  # native: one packed conv1d [q | k | v]
            packed = self.w("self_attn.conv1d.weight", l).reshape(3 * H * K, -1)
            cw = [packed[:H * K], packed[H * K:2 * H * K], packed[2 * H * K:]]
        q = causal_conv_silu(qs, cw[0]).reshape(T, H, K)
        k = causal_conv_silu(ks, cw[1]).reshape(T, H, K)
        v = causal_conv_silu(vs, cw[2]).reshape(T, H, K)
        fa = self.pick(l, "self_attn.f_a_proj.weight", "self_attn.forget_gate_down.weight")
        fb = self.pick(l, "self_attn.f_b_proj.weight", "self_attn.forget_gate_up.weight")
        f = ((x @ fa.T) @ fb.T).reshape(T, H, K)                   # no activation between f_a and f_b
        bl = x @ self.pick(l, "self_attn.b_proj.weight", "self_attn.beta_proj.weight").T
        if self.has("self_attn.g_proj.weight", l) or self.has("self_attn.output_gate.weight", l):
            z = x @ self.pick(l, "self_attn.g_proj.weight", "self_attn.output_gate.weight").T
        else:
            ga = self.pick(l, "self_attn.g_a_proj.weight", "self_attn.output_gate_down.weight")
            gb = self.pick(l, "self_attn.g_b_proj.weight", "self_attn.output_gate_up.weight")
            z = (x @ ga.T) @ gb.T
        z = z.reshape(T, H, K)
        a_log = self.a_log(l)
        dt = self.w("self_attn.dt_bias", l).reshape(H, K)
        g = kda_gate(f, dt, a_log, c.gate_lower_bound)
        beta = sigmoid(bl)
        q = l2norm(q) * K ** -0.5
        k = l2norm(k)
        if getattr(self, "kda_mode", "recurrent") == "chunked":
            o, _ = kda_chunked(q, k, v, g, beta)
        else:
            o, _ = kda_recurrent(q, k, v, g, beta)
        on = self.w("self_attn.o_norm.weight", l)
        # RESOLVED: o_norm eps = rms_norm_eps (ARCHITECTURE 3.0 lists it with the 1e-5 group).
        o = rmsnorm(o, on, c.eps) * sigmoid(z)                      # gated RMSNorm, SIGMOID gate
        return o.reshape(T, H * K) @ self.pick(l, "self_attn.o_proj.weight").T

    def a_log(self, l):
        H = self.cfg.kda_heads
        a = self.w("self_attn.A_log", l)
        flat = a.reshape(-1)
        if flat.size < H:
            raise ValueError(f"layer {l}: A_log has {flat.size} values for {H} heads")
        if flat.size > H and np.any(flat[H:] != 0):
            raise ValueError(f"layer {l}: A_log {a.shape} has a non-zero tail after {H} per-head values")
        return flat[:H]

    def mla(self, l, x):
        c = self.cfg
        T = x.shape[0]
        H, dn, dr, dv = c.heads, c.nope, c.rope, c.v_dim
        cq = None
        if self.has("self_attn.q_a_proj.weight", l):
            cq = rmsnorm(x @ self.w("self_attn.q_a_proj.weight", l).T,
                         self.w("self_attn.q_a_layernorm.weight", l), 1e-6)   # eps 1e-6 (trap 6)
            q = cq @ self.w("self_attn.q_b_proj.weight", l).T
        else:
            q = x @ self.w("self_attn.q_proj.weight", l).T
        q = q.reshape(T, H, dn + dr)
        kv0 = x @ self.w("self_attn.kv_a_proj_with_mqa.weight", l).T
        lat = rmsnorm(kv0[:, :c.kv_lora], self.w("self_attn.kv_a_layernorm.weight", l), 1e-6)
        kr = kv0[:, c.kv_lora:]                                     # shared by all heads, never normed/rotated
        kvb = (lat @ self.w("self_attn.kv_b_proj.weight", l).T).reshape(T, H, dn + dv)
        k = np.concatenate([kvb[:, :, :dn], np.broadcast_to(kr[:, None, :], (T, H, dr))], axis=-1)
        vv = kvb[:, :, dn:]
        sc = np.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5
        mask = np.tril(np.ones((T, T), dtype=bool))
        if c.dsa_layer[l]:
            mask = mask & self.indexer_mask(l, x, cq)
        sc = np.where(mask[None], sc, -np.inf)
        p = softmax(sc, axis=-1)
        o = np.einsum("hts,shd->thd", p, vv).reshape(T, H * dv)
        if c.mla_gate:
            o = o * sigmoid(x @ self.w("self_attn.g_proj.weight", l).T)
        return o @ self.w("self_attn.o_proj.weight", l).T

    def indexer_scores(self, l, x, cq):
        c = self.cfg
        if cq is None:
            raise ValueError(f"layer {l}: indexer needs the q-LoRA latent but the layer has no q_a_proj")
        wq = self.w("self_attn.indexer.wq_b.weight", l)
        wk = self.w("self_attn.indexer.wk.weight", l)
        d = wk.shape[0]
        nh = wq.shape[0] // d
        if c.index_heads is not None and int(c.index_heads) != nh:
            raise ValueError(f"layer {l}: indexer wq_b gives {nh} heads, dsa_config says {c.index_heads}")
        if c.index_head_dim is not None and int(c.index_head_dim) != d:
            raise ValueError(f"layer {l}: indexer wk gives head dim {d}, dsa_config says {c.index_head_dim}")
        T = x.shape[0]
        qI = (cq @ wq.T).reshape(T, nh, d)
        # RESOLVED: key LayerNorm eps 1e-6 (DSV3.2 default, ARCHITECTURE 5.2).
        kI = layernorm(x @ wk.T, self.w("self_attn.indexer.k_norm.weight", l),
                       self.w("self_attn.indexer.k_norm.bias", l), 1e-6)
        wI = x @ self.w("self_attn.indexer.weights_proj.weight", l).T          # [T, nh]
        kappa = (nh * d) ** -0.5                                                # ranking-neutral
        dots = np.maximum(np.einsum("thd,sd->ths", qI, kI), 0.0)               # [T, nh, S]
        return kappa * np.einsum("th,ths->ts", wI, dots)                       # [T, S]

    def indexer_mask(self, l, x, cq):
        T = x.shape[0]
        topk = self.cfg.index_topk
        mask = np.zeros((T, T), dtype=bool)
        if T <= topk:
            mask[:] = True
            return mask
        sc = self.indexer_scores(l, x, cq)
        for t in range(T):
            row = sc[t, :t + 1]
            mask[t, indexer_select(row, topk)] = True
            if t + 1 > topk:
                self._note_margin("indexer", l, t, row, topk)
        return mask

    def _note_margin(self, kind, l, t, row, k):
        """Record how close the k-th / (k+1)-th boundary is: a different engine may flip a selection
        only where this gap is within its rounding. Exact ties are counted apart (the tie rule decides)."""
        v = np.sort(row)[::-1]
        if v.size <= k or not np.isfinite(v[k]):
            return
        gap = float(v[k - 1] - v[k])
        m = self.margins.setdefault(kind, {"min_gap": None, "where": None, "exact_ties": 0})
        if gap == 0.0:
            m["exact_ties"] += 1
            d = v[v != v[k - 1]]
            gap = float(np.min(np.abs(d - v[k - 1]))) if d.size else float("inf")
        if m["min_gap"] is None or gap < m["min_gap"]:
            m["min_gap"], m["where"] = gap, {"layer": l, "position": t}

    def dense_mlp(self, l, x, pre):
        gp = self.w(pre + "gate_proj.weight", l)
        up = self.w(pre + "up_proj.weight", l)
        dp = self.w(pre + "down_proj.weight", l)
        return glu(self.cfg, x @ gp.T, x @ up.T) @ dp.T

    def expert(self, l, e):
        """(w1 gate [I, in], w3 up [I, in], w2 down [out, I]) in float64."""
        key = ("expert", l, e)
        if key in self.cache:
            return self.cache[key]
        if self.has("mlp.experts.gate_up_proj", l):     # transformers-native 3-D experts
            gu = self.w("mlp.experts.gate_up_proj", l)[e]
            I = gu.shape[0] // 2
            res = (gu[:I], gu[I:], self.w("mlp.experts.down_proj", l)[e])
        else:
            res = tuple(self.expert_matrix(l, e, m) for m in ("w1", "w3", "w2"))
        self.cache[key] = res
        return res

    def expert_matrix(self, l, e, m):
        base = self.name(f"block_sparse_moe.experts.{e}.{m}.", l)
        ck = self.ck
        if ck.has(base + "weight"):
            return ck.f64(base + "weight")
        if ck.has(base + "weight_packed"):
            dtp, _, packed = ck.raw(base + "weight_packed")
            dts, _, scale = ck.raw(base + "weight_scale")
            if dtp != "U8":
                raise ValueError(f"{base}weight_packed: dtype {dtp}, want U8")
            if dts == "U8":
                return decode_mxfp4(packed, scale, base + "weight")
            if dts == "F8_E4M3":
                gname = base + "weight_global_scale"
                if not ck.has(gname):
                    raise ValueError(f"{base}: NVFP4 scales without weight_global_scale")
                gs = ck.f64(gname).reshape(-1)
                if gs.size != 1:
                    raise ValueError(f"{gname}: want one value, got {gs.size}")
                return decode_nvfp4(packed, scale, gs[0], base + "weight")
            raise ValueError(f"{base}weight_scale: dtype {dts} is neither U8 (MXFP4) nor F8_E4M3 (NVFP4)")
        raise KeyError(f"{base}: no weight / weight_packed tensor")

    def route(self, l, h, pre):
        """Router (ARCHITECTURE 3.7) on the full hidden. Returns (sel [T, k], weights [T, k])."""
        c = self.cfg
        logits = h @ self.w(pre + "gate.weight", l).T               # [T, E], float64
        bname = pre + "gate.e_score_correction_bias"
        bias = self.w(bname, l) if self.has(bname, l) else np.zeros(logits.shape[1])
        sel, wts = moe_route(logits, bias, int(c.top_k), c.n_group, c.topk_group, c.renorm,
                             c.routed_scale, c.router_act)
        scores = sigmoid(logits) if c.router_act == "sigmoid" else softmax(logits, axis=-1)
        for t in range(logits.shape[0]):
            self._note_margin("router", l, t, scores[t] + bias, int(c.top_k))
        return sel, wts

    def moe(self, l, h):
        c = self.cfg
        pre = self.moe_prefix(l)
        sel, wts = self.route(l, h, pre)
        latent = self.has(pre + "routed_expert_down_proj.weight", l)
        zl = h @ self.w(pre + "routed_expert_down_proj.weight", l).T if latent else h   # once per token
        acc = np.zeros_like(zl)
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)
            w1, w3, w2 = self.expert(l, int(e))
            xe = zl[rows]
            ye = glu(c, xe @ w1.T, xe @ w3.T) @ w2.T
            np.add.at(acc, rows, wts[rows, slot][:, None] * ye)
        if latent:
            nname = pre + "routed_expert_norm.weight"
            if c.latent_norm if c.latent_norm is not None else self.has(nname, l):
                acc = rmsnorm(acc, self.w(nname, l), c.eps)         # on the combined SUM
            out = acc @ self.w(pre + "routed_expert_up_proj.weight", l).T
        else:
            out = acc
        if self.has(pre + "shared_experts.gate_proj.weight", l):
            out = out + self.dense_mlp(l, h, pre + "shared_experts.")
        elif c.n_shared > 0:
            raise KeyError(f"layer {l}: num_shared_experts={c.n_shared} but no {pre}shared_experts tensors")
        return out

    def moe_prefix(self, l):
        """Checkpoint naming of the MoE block: `block_sparse_moe.` (Kimi checkpoints) or `mlp.`
        (transformers save_pretrained)."""
        return "mlp." if self.has("mlp.gate.weight", l) else "block_sparse_moe."

    def ffn(self, l, x):
        if self.cfg.is_moe[l]:
            return self.moe(l, x)
        # transformers 5.x save_pretrained writes the dense layer's MLP as block_sparse_moe.{gate,up,down}_proj
        pre = "mlp." if self.has("mlp.gate_proj.weight", l) or not self.has(
            "block_sparse_moe.gate_proj.weight", l) else "block_sparse_moe."
        return self.dense_mlp(l, x, pre)

    def attn(self, l, x):
        return self.mla(l, x) if self.cfg.is_mla[l] else self.kda(l, x)

    def forward(self, ids):
        """Whole-sequence prefill. Returns logits [T, V] float64."""
        c = self.cfg
        self.margins = {}
        ids = np.asarray(ids, dtype=np.int64)
        emb = self.w("embed_tokens.weight")
        if ids.min() < 0 or ids.max() >= emb.shape[0]:
            raise ValueError(f"token id out of range 0..{emb.shape[0] - 1}")
        P = emb[ids]
        bs = c.attn_res
        if bs > 0:
            B = []
            for l in range(c.n_layers):
                # With B empty (layer 0) the mix has one candidate, softmax weight exactly 1: A_in = P.
                A_in = attn_res_mix(B + [P], self.w("self_attention_res_norm.weight", l),
                                    self.w("self_attention_res_proj.weight", l), c.eps)
                if l % bs == 0:                                     # boundary: bank RAW prefix, restart
                    B.append(P)
                    P = None
                a = self.attn(l, rmsnorm(A_in, self.w("input_layernorm.weight", l), c.eps))
                P = a if P is None else P + a
                M_in = attn_res_mix(B + [P], self.w("mlp_res_norm.weight", l),
                                    self.w("mlp_res_proj.weight", l), c.eps)
                f = self.ffn(l, rmsnorm(M_in, self.w("post_attention_layernorm.weight", l), c.eps))
                P = P + f
            out = attn_res_mix(B + [P], self.w("output_attn_res_norm.weight"),
                               self.w("output_attn_res_proj.weight"), c.eps)
        else:
            hcur = P
            for l in range(c.n_layers):
                hcur = hcur + self.attn(l, rmsnorm(hcur, self.w("input_layernorm.weight", l), c.eps))
                hcur = hcur + self.ffn(l, rmsnorm(hcur, self.w("post_attention_layernorm.weight", l), c.eps))
            out = hcur
        hn = rmsnorm(out, self.w("norm.weight"), c.eps)
        head = self.lm_head()
        return hn @ head.T

    def lm_head(self):
        n = self.cfg.prefix + "lm_head.weight"
        if self.ck.has(n):
            return self.w("lm_head.weight", top=True)
        if self.cfg.t.get("tie_word_embeddings") or self.cfg.raw.get("tie_word_embeddings"):
            return self.w("embed_tokens.weight")
        raise KeyError(f"{n} missing and tie_word_embeddings is false")

    def generate(self, ids, n):
        """Greedy: each step recomputes the whole-sequence prefill (decode == prefill by definition)."""
        seq = list(ids)
        out = []
        for _ in range(n):
            nxt = int(np.argmax(self.forward(seq)[-1]))
            out.append(nxt)
            seq.append(nxt)
        return out

    # -- coverage --
    def expected_names(self):
        """Every tensor the forward would consume if all experts were used."""
        c = self.cfg
        ck = self.ck
        T = min(4, c.vocab)
        ck.used = set()
        self.forward(list(range(T)))
        # touch every expert of every MoE layer
        for l in range(c.n_layers):
            if c.is_moe[l]:
                if self.has("mlp.experts.gate_up_proj", l):
                    self.w("mlp.experts.gate_up_proj", l)
                    self.w("mlp.experts.down_proj", l)
                else:
                    for e in range(int(c.n_experts)):
                        self.expert(l, e)
            if c.dsa_layer[l]:
                for nm in self._indexer_names(l):
                    self.w(nm, l)
        return set(ck.used)


def coverage_report(model):
    used = model.expected_names()
    all_names = set(model.ck.where)
    ignored = {n for n in all_names if n.startswith("vision_tower.") or n.startswith("mm_projector.")}
    unused = sorted(all_names - used - ignored)
    return {"tensors": len(all_names), "consumed": len(used), "ignored_vision": len(ignored),
            "unconsumed": unused}


def parse_ids(s):
    return [int(x) for x in s.split(",") if x.strip() != ""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("logits", help="prefill logits, one row per position")
    a.add_argument("--model", required=True)
    a.add_argument("--ids", required=True)
    a.add_argument("--kda", choices=["recurrent", "chunked"], default="recurrent",
                   help="KDA form: the token recurrence (default) or the chunked WY form (C=64)")
    a.add_argument("--margins", action="store_true",
                   help="also print the smallest router / indexer selection gaps (near-tie diagnostics)")
    g = sub.add_parser("generate", help="greedy ids")
    g.add_argument("--model", required=True)
    g.add_argument("--ids", required=True)
    g.add_argument("-n", type=int, default=12)
    k = sub.add_parser("check", help="two-way tensor coverage")
    k.add_argument("--model", required=True)
    args = ap.parse_args(argv)
    m = Model(args.model)
    if args.cmd == "logits":
        m.kda_mode = args.kda
        lg = m.forward(parse_ids(args.ids))
        res = {"logits": lg.tolist()}
        if args.margins:
            res["margins"] = m.margins
        json.dump(res, sys.stdout)
        sys.stdout.write("\n")
    elif args.cmd == "generate":
        json.dump(m.generate(parse_ids(args.ids), args.n), sys.stdout)
        sys.stdout.write("\n")
    else:
        rep = coverage_report(m)
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 1 if rep["unconsumed"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
