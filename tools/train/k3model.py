"""Kimi K3 / K3.1 at small width, in PyTorch, written from shared/spec/ARCHITECTURE.md §1-§4.

Module and parameter names are the checkpoint names of §2.2 (minus the `language_model.model.`
prefix), so export is a rename-free walk. Routed experts are stored stacked ([E, out, in]) and exported
one matrix per expert in MXFP4 (export.py).

Precision: parameters fp32; training may use TF32 matmuls. Evaluation for parity runs with TF32 off
(fp32) or on the CPU in fp64; the KDA state, gates, router, AttnRes mix and SiTU are always fp32+.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def default_geometry(vocab):
    return dict(
        vocab=vocab, hidden=256, layers=8, attn_res_block=4, dense_inter=768,
        kda_heads=4, kda_dim=64, conv=4,
        mla_heads=4, q_lora=128, kv_lora=64, nope=64, rope=32, v=64,
        experts=16, topk=4, shared=1, moe_inter=256, latent=128,
        situ_beta=4.0, situ_lambda=25.0, eps=1e-5, gate_lower_bound=-5.0,
        index_heads=4, index_dim=32, index_topk=64,
    )


def is_mla(g, l):
    """3:1 KDA:MLA with MLA last (1-based layer l+1 divisible by 4, or the last layer)."""
    return (l + 1) % 4 == 0 or l == g["layers"] - 1


def up(x):
    """Upcast to fp32 (fp64 stays fp64, for the CPU parity runs)."""
    return x if x.dtype == torch.float64 else x.float()


def situ(a, b, beta, lam):
    a = up(a)
    b = up(b)
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (lam * torch.tanh(b / lam))


def rmsnorm(x, w, eps):
    xf = up(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class Norm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


def linear(i, o):
    return nn.Linear(i, o, bias=False)


class ResSite(nn.Module):
    """One AttnRes mix site (§3.2): `<name>_norm.weight` [D] and `<name>_proj.weight` [1, D]."""

    def __init__(self, d, eps):
        super().__init__()
        self.norm = Norm(d, eps)
        self.proj = linear(d, 1)
        nn.init.zeros_(self.proj.weight)   # zero pseudo-query: uniform mix at init (AttnRes paper)
        self.eps = eps

    def forward(self, cands):
        V = up(torch.stack(cands, 0))                                     # [N, B, T, D]
        w = self.norm.weight * self.proj.weight[0]                            # [D]
        r = torch.rsqrt(V.pow(2).mean(-1) + self.eps)                         # [N, B, T]
        s = (V @ w) * r
        a = torch.softmax(s, 0)
        return (a.unsqueeze(-1) * V).sum(0)                                   # mix of RAW candidates


def attention(q, k, v, mask, scale):
    """q,k [B,H,T,dk], v [B,H,T,dv], mask bool [B or 1, 1, T, S] (True = attend), None = causal."""
    if hasattr(F, "scaled_dot_product_attention") and q.dtype != torch.float64:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is None:
        T = q.shape[-2]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device))[None, None]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def causal_conv_silu(x, w):
    """x [B, T, C], w [C, 1, W]: depthwise causal conv (tap W-1 = current token) + SiLU."""
    W = w.shape[-1]
    y = F.conv1d(x.transpose(1, 2), w, padding=W - 1, groups=w.shape[0])[..., :x.shape[1]]
    return F.silu(y.transpose(1, 2))


def kda_recurrent(q, k, v, g, beta):
    """Ground truth (§3.4). q,k,v,g [B,T,H,K], beta [B,T,H] -> o [B,T,H,V]."""
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def kda_chunked(q, k, v, g, beta, C=32):
    """Chunked WY form (§3.4 steps 1-7), identical to the recurrence up to rounding.
    q,k,v,g [B,T,H,K], beta [B,T,H] -> o [B,T,H,V]. Tail padded with k=v=0, beta=0, g=0."""
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    pad = (-T) % C
    tr = lambda a: a.transpose(1, 2)                                          # [B,H,T,...]
    q, k, v, g, beta = tr(q), tr(k), tr(v), tr(g), beta.transpose(1, 2)
    if pad:
        q, k, v, g = (F.pad(a, (0, 0, 0, pad)) for a in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (a.reshape(B, H, N, C, a.shape[-1]) for a in (q, k, v, g))
    beta = beta.reshape(B, H, N, C)
    dev = q.device
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    eye = torch.eye(C, device=dev, dtype=q.dtype)
    S = q.new_zeros(B, H, K, Vd)
    outs = []
    for n in range(N):
        Q, Kc, Vc, G, Bt = q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n], beta[:, :, n]
        Gam = G.cumsum(-2)                                                    # [B,H,C,K] inclusive
        D = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)                             # [B,H,i,j,K]
        E = D.masked_fill(~incl[:, :, None], float("-inf")).exp()            # j <= i only
        KK = torch.einsum("bhid,bhjd,bhijd->bhij", Kc, Kc, E)
        M = Bt.unsqueeze(-1) * KK * strict                                    # step 1
        Tm = torch.linalg.solve_triangular(eye + M, torch.diag_embed(Bt), upper=False,
                                           unitriangular=True)               # step 2
        W = Tm @ (Gam.exp() * Kc)                                             # step 3
        U = Tm @ Vc
        Aqk = torch.einsum("bhid,bhjd,bhijd->bhij", Q, Kc, E) * incl          # step 4
        Vt = U - W @ S                                                        # step 5
        outs.append((Q * Gam.exp()) @ S + Aqk @ Vt)                           # step 6
        last = Gam[:, :, -1]                                                  # [B,H,K]
        S = last.exp().unsqueeze(-1) * S + ((last.unsqueeze(-2) - Gam).exp() * Kc).transpose(-1, -2) @ Vt
    o = torch.stack(outs, 2).reshape(B, H, N * C, Vd)[:, :, :T]
    return o.transpose(1, 2)


class KDA(nn.Module):
    def __init__(self, g):
        super().__init__()
        D, H, K, W = g["hidden"], g["kda_heads"], g["kda_dim"], g["conv"]
        self.H, self.K, self.eps, self.lb = H, K, g["eps"], g["gate_lower_bound"]
        P = H * K
        self.q_proj, self.k_proj, self.v_proj = linear(D, P), linear(D, P), linear(D, P)
        self.q_conv1d = nn.Parameter(torch.randn(P, 1, W) / math.sqrt(W))
        self.k_conv1d = nn.Parameter(torch.randn(P, 1, W) / math.sqrt(W))
        self.v_conv1d = nn.Parameter(torch.randn(P, 1, W) / math.sqrt(W))
        self.A_log = nn.Parameter(torch.zeros(H))
        # per-step decay magnitude |g| log-uniform in [0.005, 1] at f = 0: g = lb * sigmoid(dt)
        mag = torch.exp(torch.empty(P).uniform_(math.log(0.005), math.log(1.0)))
        p = mag / -self.lb
        self.dt_bias = nn.Parameter(torch.log(p / (1 - p)))
        self.f_a_proj, self.f_b_proj = linear(D, K), linear(K, P)
        self.b_proj = linear(D, H)
        self.g_proj = linear(D, P)
        self.o_norm = Norm(K, g["eps"])
        self.o_proj = linear(P, D)
        self.chunked = True

    def forward(self, x):
        B, T, _ = x.shape
        H, K = self.H, self.K
        q = causal_conv_silu(self.q_proj(x), self.q_conv1d).reshape(B, T, H, K)
        k = causal_conv_silu(self.k_proj(x), self.k_conv1d).reshape(B, T, H, K)
        v = causal_conv_silu(self.v_proj(x), self.v_conv1d).reshape(B, T, H, K)
        f = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K)               # no activation between
        a = up(self.A_log).exp().reshape(1, 1, H, 1)                      # per head
        g = self.lb * torch.sigmoid(a * (up(f) + self.dt_bias.reshape(H, K)))
        beta = torch.sigmoid(up(self.b_proj(x)))
        z = self.g_proj(x).reshape(B, T, H, K)
        q = l2norm(up(q)) * K ** -0.5
        k = l2norm(up(k))
        o = (kda_chunked if self.chunked else kda_recurrent)(q, k, up(v), g, beta)
        o = rmsnorm(o, self.o_norm.weight, self.eps) * torch.sigmoid(up(z))
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))


class Indexer(nn.Module):
    """K3.1 Lightning Indexer (§3.6): wq_b, wk, k_norm (LayerNorm with bias, eps 1e-6), weights_proj."""

    def __init__(self, g):
        super().__init__()
        self.I, self.d = g["index_heads"], g["index_dim"]
        self.wq_b = linear(g["q_lora"], self.I * self.d)
        self.wk = linear(g["hidden"], self.d)
        self.k_norm = nn.LayerNorm(self.d, eps=1e-6)
        self.weights_proj = linear(g["hidden"], self.I)

    def scores(self, x, cq):
        B, T, _ = x.shape
        qI = self.wq_b(cq).reshape(B, T, self.I, self.d)
        kI = self.k_norm(self.wk(x))                                          # [B,T,d]
        wI = self.weights_proj(x)                                             # [B,T,I]
        dots = torch.relu(torch.einsum("bthd,bsd->bths", qI, kI))
        return (self.I * self.d) ** -0.5 * torch.einsum("bth,bths->bts", wI, dots)


def indexer_select_mask(sc, topk):
    """[B,T,S] scores -> bool mask of kept keys: causal; rows with t+1 <= topk keep all; else the topk
    best, ties to the lowest position (stable descending sort)."""
    B, T, S = sc.shape
    causal = torch.tril(torch.ones(T, S, dtype=torch.bool, device=sc.device))
    if T <= topk:
        return causal.expand(B, T, S)
    masked = sc.masked_fill(~causal, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :topk]
    keep = torch.zeros(B, T, S, dtype=torch.bool, device=sc.device)
    keep.scatter_(-1, order, True)
    small = (torch.arange(T, device=sc.device) + 1 <= topk).reshape(1, T, 1)
    return torch.where(small, causal.expand(B, T, S), keep & causal)


class MLA(nn.Module):
    def __init__(self, g, indexer=False):
        super().__init__()
        D, H = g["hidden"], g["mla_heads"]
        self.H, self.dn, self.dr, self.dv, self.kvl = H, g["nope"], g["rope"], g["v"], g["kv_lora"]
        self.q_a_proj = linear(D, g["q_lora"])
        self.q_a_layernorm = Norm(g["q_lora"], 1e-6)
        self.q_b_proj = linear(g["q_lora"], H * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = linear(D, self.kvl + self.dr)
        self.kv_a_layernorm = Norm(self.kvl, 1e-6)
        self.kv_b_proj = linear(self.kvl, H * (self.dn + self.dv))
        self.g_proj = linear(D, H * self.dv)
        self.o_proj = linear(H * self.dv, D)
        self.indexer = Indexer(g) if indexer else None
        self.index_topk = g["index_topk"]
        self.use_sparse = indexer          # K3.1: attention restricted to the indexer's selection
        self.kl_loss = None                # set during indexer training

    def forward(self, x):
        B, T, _ = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        cq = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(cq).reshape(B, T, H, dn + dr)
        kv0 = self.kv_a_proj_with_mqa(x)
        lat = self.kv_a_layernorm(kv0[..., :self.kvl])
        kr = kv0[..., self.kvl:]                                               # shared by all heads, no norm
        kvb = self.kv_b_proj(lat).reshape(B, T, H, dn + dv)
        k = torch.cat([kvb[..., :dn], kr.unsqueeze(2).expand(B, T, H, dr)], -1)
        vv = kvb[..., dn:]
        q, k, vv = q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2)   # [B,H,T,.]
        scale = (dn + dr) ** -0.5
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        if self.indexer is not None and (self.use_sparse or self.kl_loss is not None):
            sc = self.indexer.scores(x, cq)                                   # [B,T,T]
            if self.kl_loss is not None:                                      # indexer training (DSV3.2 warm-up)
                with torch.no_grad():
                    att = torch.softmax((q @ k.transpose(-1, -2)).float() * scale
                                        + torch.triu(torch.full((T, T), float("-inf"), device=x.device), 1), -1)
                    tgt = att.sum(1)
                    tgt = tgt / tgt.sum(-1, keepdim=True)
                logp = torch.log_softmax(up(sc).masked_fill(~causal, float("-inf")), -1)
                self.kl_loss = (tgt * (torch.log(tgt.clamp_min(1e-30)) - logp)).masked_fill(~causal, 0).sum(-1).mean()
            if self.use_sparse:
                mask = indexer_select_mask(sc.detach(), self.index_topk)      # [B,T,T]
                o = attention(q, k, vv, mask.unsqueeze(1), scale)
            else:
                o = attention(q, k, vv, None, scale)
        else:
            o = attention(q, k, vv, None, scale)
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, d, inter, g):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(d, inter), linear(d, inter), linear(inter, d)
        self.b, self.lam = g["situ_beta"], g["situ_lambda"]

    def forward(self, x):
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.b, self.lam).to(x.dtype))


class Gate(nn.Module):
    def __init__(self, d, E):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, d) * 0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class MoE(nn.Module):
    """Latent MoE (§3.7): router on the full input (fp32, sigmoid, bias for selection only, raw weights
    renormalised), down once per token, experts in the latent, fp32 combine, RMSNorm on the sum, up,
    plus the shared expert on the full-width input."""

    def __init__(self, g):
        super().__init__()
        D, E, I, Lt = g["hidden"], g["experts"], g["moe_inter"], g["latent"]
        self.E, self.k, self.eps = E, g["topk"], g["eps"]
        self.b, self.lam = g["situ_beta"], g["situ_lambda"]
        self.gate = Gate(D, E)
        self.routed_expert_down_proj = linear(D, Lt)
        self.routed_expert_norm = Norm(Lt, g["eps"])
        self.routed_expert_up_proj = linear(Lt, D)
        self.w1 = nn.Parameter(torch.randn(E, I, Lt) * Lt ** -0.5)           # gate  [E, out, in]
        self.w3 = nn.Parameter(torch.randn(E, I, Lt) * Lt ** -0.5)           # up
        self.w2 = nn.Parameter(torch.randn(E, Lt, I) * I ** -0.5 * 0.5)      # down
        self.shared_experts = MLP(D, I * g["shared"], g)
        self.last_load = None

    def forward(self, h):
        shp = h.shape
        x = h.reshape(-1, shp[-1])
        logits = up(x) @ up(self.gate.weight).t()
        s = torch.sigmoid(logits)
        sel = torch.topk(s.detach() + self.gate.e_score_correction_bias, self.k, dim=-1).indices
        w = s.gather(-1, sel)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        comb = torch.zeros_like(s).scatter(-1, sel, w)                        # [N, E]
        self.last_load = torch.bincount(sel.reshape(-1), minlength=self.E).detach()
        zl = self.routed_expert_down_proj(x)                                  # once per token
        a = torch.einsum("nl,eil->eni", zl, self.w1)
        b = torch.einsum("nl,eil->eni", zl, self.w3)
        ye = torch.einsum("eni,eli->enl", situ(a, b, self.b, self.lam), self.w2)
        acc = torch.einsum("ne,enl->nl", comb, up(ye))
        yr = self.routed_expert_up_proj(self.routed_expert_norm(acc))
        return (yr + self.shared_experts(x)).reshape(shp)


class Layer(nn.Module):
    def __init__(self, g, l, k31):
        super().__init__()
        D = g["hidden"]
        self.mla = is_mla(g, l)
        self.self_attn = MLA(g, indexer=k31) if self.mla else KDA(g)
        self.input_layernorm = Norm(D, g["eps"])
        self.post_attention_layernorm = Norm(D, g["eps"])
        self.self_attention_res = ResSite(D, g["eps"])
        self.mlp_res = ResSite(D, g["eps"])
        if l == 0:
            self.mlp = MLP(D, g["dense_inter"], g)
        else:
            self.block_sparse_moe = MoE(g)

    def ffn(self, x):
        return self.mlp(x) if hasattr(self, "mlp") else self.block_sparse_moe(x)


class K3(nn.Module):
    def __init__(self, g, k31=False, dropout=0.0):
        super().__init__()
        self.g = g
        self.k31 = k31
        D = g["hidden"]
        self.embed_tokens = nn.Embedding(g["vocab"], D)
        self.layers = nn.ModuleList([Layer(g, l, k31) for l in range(g["layers"])])
        self.norm = Norm(D, g["eps"])
        self.output_attn_res = ResSite(D, g["eps"])
        self.lm_head = linear(D, g["vocab"])
        self.drop = nn.Dropout(dropout)
        self._init()

    def _init(self):
        L = self.g["layers"]
        for n, m in self.named_modules():
            if isinstance(m, nn.Linear) and not n.endswith("_res.proj") and not n.endswith("attn_res.proj"):
                nn.init.normal_(m.weight, std=0.02)
                if n.endswith("o_proj") or (n.endswith("down_proj") and "routed" not in n):
                    m.weight.data *= 1 / math.sqrt(2 * L)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)

    def forward(self, ids):
        g = self.g
        P = self.embed_tokens(ids)
        B = []
        for l, layer in enumerate(self.layers):
            A_in = layer.self_attention_res(B + [P]) if B else P
            if l % g["attn_res_block"] == 0:                                   # bank the RAW prefix, restart
                B.append(P)
                P = None
            a = self.drop(layer.self_attn(layer.input_layernorm(A_in)))
            P = a if P is None else P + a
            M_in = layer.mlp_res(B + [P])
            P = P + self.drop(layer.ffn(layer.post_attention_layernorm(M_in)))
        out = self.output_attn_res(B + [P])
        return self.lm_head(self.norm(out))

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

    def mla_layers(self):
        return [m for m in self.modules() if isinstance(m, MLA)]

    def kda_layers(self):
        return [m for m in self.modules() if isinstance(m, KDA)]
