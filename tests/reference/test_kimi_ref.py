#!/usr/bin/python3
"""Self-tests of the numpy reference (tests/reference/kimi_ref.py).

    cd tests/reference && /usr/bin/python3 -m unittest -v test_kimi_ref
    /usr/bin/python3 -m unittest discover -s tests/reference -v          (from the repo root)

Every check has a control: a mutated formula (the trap reintroduced) must give a different answer.
Test names carry the ARCHITECTURE §4 trap number where one applies.
"""

import copy
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kimi_ref as R  # noqa: E402
import make_tiny  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def write_json(path, obj):
    with open(path, "w") as fh:
        json.dump(obj, fh)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ----------------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------------

class TestSiTU(unittest.TestCase):
    def test_trap28_appendix_b_values(self):
        self.assertAlmostEqual(R.situ(1.0, 1.0, 4.0, 25.0), 0.71582, places=5)
        self.assertAlmostEqual(R.situ(-3.0, 2.0, 4.0, 25.0), -0.24047, places=5)
        self.assertAlmostEqual(R.situ(10.0, 10.0, 4.0, 25.0), 37.485, places=3)

    def test_trap28_controls(self):
        ref = R.situ(-3.0, 2.0, 4.0, 25.0)
        swapped = R.situ(2.0, -3.0, 4.0, 25.0)                       # gate/up swap
        hf_docstring = -3.0 * R.sigmoid(np.array(4.0 * -3.0)) * 2.0   # "gate*sigmoid(beta*gate)*up"
        tanh_up_1 = R.situ(-3.0, 2.0, 4.0, 1.0)                      # HF-native default lambda = 1
        for bad in (swapped, hf_docstring, tanh_up_1):
            self.assertGreater(abs(bad - ref), 1e-3)

    def test_identity_up_when_linear_beta_absent(self):
        self.assertAlmostEqual(R.situ(1.0, 3.0, 4.0, None), 4 * np.tanh(0.25) * R.sigmoid(np.array(1.0)) * 3.0)


class TestGate(unittest.TestCase):
    def test_trap08_lower_bound_value(self):
        g = R.kda_gate(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1), -5.0)
        self.assertEqual(float(g[0, 0]), -2.5)
        self.assertAlmostEqual(float(np.exp(g[0, 0])), 0.0821, places=4)

    def test_trap08_softplus_mutation_differs(self):
        g_sp = R.kda_gate(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1), None)
        self.assertAlmostEqual(float(g_sp[0, 0]), -np.log(2.0))
        self.assertGreater(abs(float(g_sp[0, 0]) + 2.5), 1.0)

    def test_trap09_dt_bias_inside_sigmoid_and_per_head_a_log(self):
        f = np.array([[1.0, 0.0], [0.5, -0.5]])
        dt = np.array([[-1.0, 0.0], [0.25, 0.75]])
        alog = np.array([0.0, np.log(2.0)])
        g = R.kda_gate(f, dt, alog, -5.0)
        want = np.array([[-2.5, -2.5], [-5 / (1 + np.exp(-2 * 0.75)), -5 / (1 + np.exp(-2 * 0.25))]])
        np.testing.assert_allclose(g, want, rtol=1e-15)
        outside = -5.0 * R.sigmoid(np.exp(alog)[:, None] * f) + dt      # dt_bias added outside: mutation
        self.assertGreater(np.max(np.abs(outside - g)), 0.1)
        chan = -5.0 * R.sigmoid(np.exp(np.array([0.0, 0.0]))[None, :] * (f + dt))  # channel-wise A_log[d]
        self.assertGreater(np.max(np.abs(chan - g)), 0.1)


def _kda_inputs(rng, T, H, K, V, lower=-5.0):
    q = R.l2norm(rng.standard_normal((T, H, K))) * K ** -0.5
    k = R.l2norm(rng.standard_normal((T, H, K)))
    v = rng.standard_normal((T, H, V))
    f = rng.standard_normal((T, H, K))
    g = R.kda_gate(f, 0.3 * rng.standard_normal((H, K)), 0.5 * rng.standard_normal(H), lower)
    beta = R.sigmoid(rng.standard_normal((T, H)))
    return q, k, v, g, beta


class TestKDA(unittest.TestCase):
    def test_chunked_equals_recurrence(self):
        rng = np.random.default_rng(1)
        for T in (1, 3, 64, 150):
            q, k, v, g, beta = _kda_inputs(rng, T, 2, 8, 6)
            S0 = rng.standard_normal((2, 8, 6))
            o_r, S_r = R.kda_recurrent(q, k, v, g, beta, S0)
            o_c, S_c = R.kda_chunked(q, k, v, g, beta, S0, C=64)
            self.assertLess(np.max(np.abs(o_r - o_c)), 1e-10, f"T={T}")
            self.assertLess(np.max(np.abs(S_r - S_c)), 1e-10, f"T={T}")

    def test_chunked_equals_recurrence_softplus_gate(self):
        rng = np.random.default_rng(2)
        q, k, v, g, beta = _kda_inputs(rng, 100, 3, 16, 16, lower=None)
        o_r, _ = R.kda_recurrent(q, k, v, g, beta)
        o_c, _ = R.kda_chunked(q, k, v, g, beta, C=64)
        self.assertLess(np.max(np.abs(o_r - o_c)), 1e-10)

    def test_chunked_control_exclusive_cumsum_fails(self):
        rng = np.random.default_rng(3)
        q, k, v, g, beta = _kda_inputs(rng, 70, 2, 8, 8)
        o_r, _ = R.kda_recurrent(q, k, v, g, beta)
        # shift the decay by one step (exclusive instead of inclusive cumulative sum)
        g_shift = np.concatenate([np.zeros_like(g[:1]), g[:-1]], axis=0)
        o_bad, _ = R.kda_chunked(q, k, v, g_shift, beta, C=64)
        self.assertGreater(np.max(np.abs(o_r - o_bad)), 1e-3)

    def test_trap13_order_one_and_three_tokens(self):
        rng = np.random.default_rng(4)
        q, k, v, g, beta = _kda_inputs(rng, 3, 1, 4, 4)
        o, _ = R.kda_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1])
        # T = 1 from zero state: o = (q.k) * beta * v
        want = (q[0, 0] @ k[0, 0]) * beta[0, 0] * v[0, 0]
        np.testing.assert_allclose(o[0, 0], want, rtol=1e-13)

        def read_before_update(q, k, v, g, beta):
            S = np.zeros((1, 4, 4))
            out = []
            for t in range(q.shape[0]):
                S = S * np.exp(g[t])[:, :, None]
                out.append(np.einsum("hkv,hk->hv", S, q[t]))
                u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
                S = S + k[t][:, :, None] * u[:, None, :]
            return np.array(out)

        def decay_after_update(q, k, v, g, beta):
            S = np.zeros((1, 4, 4))
            out = []
            for t in range(q.shape[0]):
                u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
                S = S + k[t][:, :, None] * u[:, None, :]
                S = S * np.exp(g[t])[:, :, None]
                out.append(np.einsum("hkv,hk->hv", S, q[t]))
            return np.array(out)

        o3, _ = R.kda_recurrent(q, k, v, g, beta)
        for bad in (read_before_update, decay_after_update):
            self.assertGreater(np.max(np.abs(bad(q, k, v, g, beta) - o3)), 1e-3, bad.__name__)

    def test_trap16_conv_causal_zero_history_tap3_current(self):
        s = np.array([[1.0], [2.0], [3.0], [4.0]])
        w = np.array([[0.1, 0.2, 0.3, 1.0]])
        y = R.causal_conv_silu(s, w)
        pre = np.array([1.0, 2 + 0.3, 3 + 0.6 + 0.2, 4 + 0.9 + 0.4 + 0.1])
        np.testing.assert_allclose(y[:, 0], R.silu(pre), rtol=1e-15)
        reversed_taps = R.causal_conv_silu(s, w[:, ::-1])              # tap 0 = current: mutation
        self.assertGreater(np.max(np.abs(reversed_taps - y)), 0.1)


class TestAttnRes(unittest.TestCase):
    def test_trap19_magnitudes_and_raw_sum(self):
        rng = np.random.default_rng(5)
        D = 32
        a, b, c = (rng.standard_normal((2, D)) for _ in range(3))
        cands = [1e-4 * a, 1e4 * b, c]
        nu = 1 + 0.1 * rng.standard_normal(D)
        pi = rng.standard_normal((1, D)) / np.sqrt(D)
        out = R.attn_res_mix(cands, nu, pi, 1e-5)
        # by hand, one token at a time
        for t in range(2):
            s = []
            for v in cands:
                vn = v[t] / np.sqrt(np.mean(v[t] ** 2) + 1e-5)
                s.append(float(np.sum(vn * nu * pi[0])))
            al = np.exp(np.array(s) - max(s))
            al /= al.sum()
            want = sum(al[i] * cands[i][t] for i in range(3))
            np.testing.assert_allclose(out[t], want, rtol=1e-12)
        # control: mixing the NORMALISED candidates gives a very different answer
        V = np.stack(cands)
        Vn = V / np.sqrt(np.mean(V * V, -1, keepdims=True) + 1e-5)
        w = R.softmax(np.einsum("ntd,d->nt", Vn, nu * pi[0]), axis=0)
        bad = np.einsum("nt,ntd->td", w, Vn)
        self.assertGreater(rel_err(bad, out), 0.5)
        # control: scoring the RAW candidates (no RMS normalisation) gives a different answer
        bad2 = np.einsum("nt,ntd->td", R.softmax(np.einsum("ntd,d->nt", V, nu * pi[0]), axis=0), V)
        self.assertGreater(rel_err(bad2, out), 1e-3)

    def test_trap21_zero_padded_candidate_is_not_neutral(self):
        rng = np.random.default_rng(6)
        cands = [rng.standard_normal((1, 16)) for _ in range(2)]
        nu, pi = np.ones(16), rng.standard_normal((1, 16)) / 4
        out = R.attn_res_mix(cands, nu, pi, 1e-5)
        padded = R.attn_res_mix([np.zeros((1, 16))] + cands, nu, pi, 1e-5)
        self.assertGreater(rel_err(padded, out), 1e-3)

    def test_single_candidate_is_identity(self):
        x = np.random.default_rng(7).standard_normal((3, 8))
        np.testing.assert_array_equal(R.attn_res_mix([x], np.ones(8), np.ones((1, 8)), 1e-5), x)


class TestFormats(unittest.TestCase):
    def test_bf16_decode_and_round(self):
        bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F80, 0x3FC0], dtype=np.uint16)
        v = R.bf16_bits_to_f64(bits)
        self.assertEqual(list(v[[0, 1, 4]]), [1.0, -2.0, 1.5])
        self.assertEqual(v[2], 2.0 ** -133)
        self.assertTrue(np.isinf(v[3]))
        # round to nearest even: 1 + 2^-8 is a tie between 1 and 1+2^-7 -> 1 ; 1 + 3*2^-8 -> 1 + 2^-6
        r = R.f64_to_bf16_bits(np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8]))
        self.assertEqual(list(R.bf16_bits_to_f64(r)), [1.0, 1.0 + 2 ** -6])
        # control: shifting into the LOW half is wrong
        wrong = bits.astype(np.uint32).view(np.float32)
        self.assertNotEqual(float(wrong[0]), 1.0)

    def test_trap30_mxfp4_planted(self):
        codes = np.arange(32) % 16                                 # 0..15 twice
        row = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # low nibble = even column
        packed = np.stack([row, row, row])
        scale = np.array([[127], [130], [0]], dtype=np.uint8)
        w = R.decode_mxfp4(packed, scale)
        e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
        np.testing.assert_array_equal(w[0], np.array(e2m1 * 2))
        np.testing.assert_array_equal(w[1], np.array(e2m1 * 2) * 8)
        np.testing.assert_array_equal(w[2], np.array(e2m1 * 2) * 2.0 ** -127)   # byte 0 is not zero
        self.assertNotEqual(w[2, 1], 0.0)
        with self.assertRaisesRegex(ValueError, "0xFF"):
            R.decode_mxfp4(packed, np.array([[127], [255], [127]], dtype=np.uint8), "blk.w1")
        # control: high-nibble-first decoding differs
        hi_first = R.decode_mxfp4(((packed >> 4) | (packed << 4)).astype(np.uint8), scale)
        self.assertFalse(np.array_equal(hi_first, w))

    def test_nvfp4_and_e4m3_planted(self):
        self.assertEqual(R._E4M3[0x38], 1.0)
        self.assertEqual(R._E4M3[0x40], 2.0)
        self.assertEqual(R._E4M3[0x01], 2.0 ** -9)
        self.assertEqual(R._E4M3[0x7E], 448.0)
        self.assertTrue(np.isnan(R._E4M3[0x7F]))
        packed = np.full((1, 16), 0x22, dtype=np.uint8)             # every element = 1.0
        scale = np.array([[0x38, 0x40]], dtype=np.uint8)            # block 0 x1, block 1 x2
        w = R.decode_nvfp4(packed, scale, 0.5)
        np.testing.assert_array_equal(w[0], np.array([0.5] * 16 + [1.0] * 16))

    def test_mxfp4_to_nvfp4_repack_is_lossless(self):
        rng = np.random.default_rng(8)
        wf = rng.standard_normal((8, 64)) * np.exp(rng.uniform(-4, 4, size=(8, 1)))
        p, s = make_tiny.quantize_mxfp4(wf)
        p2, nv, gs = make_tiny.mxfp4_to_nvfp4(p, s)
        np.testing.assert_array_equal(R.decode_mxfp4(p, s), R.decode_nvfp4(p2, nv, gs[0]))

    def test_safetensors_roundtrip(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "model.safetensors")
            a = np.arange(6, dtype=np.float32).reshape(2, 3)
            R.write_safetensors(path, {"x": ("F32", a), "y": ("U8", np.array([1, 2, 3], np.uint8)),
                                       "z": ("BF16", R.f64_to_bf16_bits([1.5, -2.0]))})
            f = R.SafetensorsFile(path)
            np.testing.assert_array_equal(R.to_f64(*f.raw("x")[::2]), a)
            self.assertEqual(f.raw("y")[2].tolist(), [1, 2, 3])
            self.assertEqual(R.to_f64("BF16", f.raw("z")[2]).tolist(), [1.5, -2.0])
            # control: a truncated file is rejected
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) - 1)
            with self.assertRaisesRegex(ValueError, "past the end"):
                R.SafetensorsFile(path)


class TestIndexerSelect(unittest.TestCase):
    def test_trap37_planted_ties(self):
        sc = np.array([3.0, 1.0, 1.0, 5.0, 1.0, 0.0, 1.0])
        self.assertEqual(R.indexer_select(sc, 4).tolist(), [0, 1, 2, 3])
        self.assertEqual(R.indexer_select(sc, 5).tolist(), [0, 1, 2, 3, 4])
        self.assertEqual(R.indexer_select(sc, 2).tolist(), [0, 3])
        zeros = np.zeros(9)                                        # relu ties at 0
        self.assertEqual(R.indexer_select(zeros, 3).tolist(), [0, 1, 2])
        self.assertEqual(R.indexer_select(sc[:3], 4).tolist(), [0, 1, 2])   # n <= topk: all
        # control: a highest-position-first tie break picks a different set
        order = sorted(range(len(sc)), key=lambda i: (-sc[i], -i))[:4]
        self.assertNotEqual(sorted(order), [0, 1, 2, 3])


class TestRouting(unittest.TestCase):
    def test_trap25_bias_selects_raw_weights(self):
        logits = np.array([[2.0, 1.0, 0.0, -1.0]])
        bias = np.array([0.0, 0.0, 0.0, 2.0])
        sel, w = R.moe_route(logits, bias, 2, scale=1.0)
        self.assertEqual(sorted(sel[0].tolist()), [0, 3])
        s = R.sigmoid(logits[0])
        want = {0: s[0] / (s[0] + s[3]), 3: s[3] / (s[0] + s[3])}
        for e, x in zip(sel[0], w[0]):
            self.assertAlmostEqual(x, want[int(e)], places=15)
        # controls: biased weights, softmax weights and no bias all differ at the gate output
        biased = (s + bias)[[0, 3]] / (s + bias)[[0, 3]].sum()
        self.assertGreater(abs(biased[0] - want[0]), 1e-2)
        sel_nb, _ = R.moe_route(logits, np.zeros(4), 2)
        self.assertNotEqual(sorted(sel_nb[0].tolist()), [0, 3])
        _, w_sm = R.moe_route(logits, bias, 2, act="softmax")
        self.assertGreater(np.max(np.abs(np.sort(w_sm[0]) - np.sort(w[0]))), 1e-3)

    def test_grouped_topk(self):
        # 2 groups of 4; group 1 has the best top-2 sum, though expert 0 alone is the single best
        logits = np.array([[5.0, -5, -5, -5, 2.0, 2.0, 1.9, -5]])
        sel, w = R.moe_route(logits, np.zeros(8), 2, n_group=2, topk_group=1, scale=2.0)
        self.assertEqual(sorted(sel[0].tolist()), [4, 5])
        self.assertAlmostEqual(float(w.sum()), 2.0, places=12)
        sel1, _ = R.moe_route(logits, np.zeros(8), 2, n_group=1)
        self.assertIn(0, sel1[0].tolist())                          # control: no grouping differs


class TestConfig(unittest.TestCase):
    K3_FULL = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93]

    def k3_raw(self):
        kda = [i for i in range(1, 94) if i not in self.K3_FULL]
        text = {"model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168,
                "num_hidden_layers": 93, "num_attention_heads": 96, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                "rms_norm_eps": 1e-5, "first_k_dense_replace": 1, "num_experts": 896,
                "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
                "routed_expert_hidden_size": 3584, "attn_res_block_size": 12,
                "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                       "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                       "kda_layers": kda, "full_attn_layers": self.K3_FULL},
                "quantization_config": {"quant_method": "compressed-tensors"}}
        return {"model_type": "kimi_k3", "text_config": text}

    def test_trap33_one_based_lists(self):
        c = R.Config(self.k3_raw())
        mla = [l for l in range(93) if c.is_mla[l]]
        self.assertEqual(mla, [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75, 79,
                               83, 87, 91, 92])
        self.assertFalse(c.is_mla[0])
        self.assertEqual(c.is_moe, [False] + [True] * 92)
        self.assertEqual((c.prefix, c.variant, c.gate_lower_bound, c.situ_linear_beta), ("language_model.", "k3", -5.0, 25.0))

    def test_trap34_nesting_and_forms(self):
        raw = self.k3_raw()
        bad = copy.deepcopy(raw)
        bad["quantization_config"] = bad["text_config"].pop("quantization_config")
        with self.assertRaisesRegex(ValueError, "quantization_config"):
            R.Config(bad)
        bad = copy.deepcopy(raw)
        bad["text_config"]["linear_attn_config"]["kda_layers"].remove(1)
        with self.assertRaisesRegex(ValueError, "partition"):
            R.Config(bad)
        # original (48B) form: no prefix, 1-based lists at top level, num_experts spelling
        orig = copy.deepcopy(raw["text_config"])
        c = R.Config(orig)
        self.assertEqual((c.form, c.prefix, c.n_experts, c.top_k), ("original", "", 896, 16))
        # native form: layer_types, num_local_experts / num_experts_per_tok, linear_* keys
        nat = {k: v for k, v in orig.items() if k not in ("linear_attn_config", "num_experts",
                                                            "num_experts_per_token", "activation_situ_linear_beta")}
        nat.update({"layer_types": ["full_attention" if R.Config(orig).is_mla[i] else "linear_attention"
                                    for i in range(93)],
                    "num_local_experts": 896, "num_experts_per_tok": 16, "linear_num_heads": 96,
                    "linear_head_dim": 128, "linear_conv_kernel_dim": 4})
        cn = R.Config(nat)
        self.assertEqual(cn.form, "native")
        self.assertEqual(cn.is_mla, c.is_mla)
        self.assertEqual((cn.n_experts, cn.top_k, cn.kda_heads, cn.situ_linear_beta), (896, 16, 96, 1.0))

    def test_trap35_variant_gating_in_config(self):
        raw = self.k3_raw()
        k31 = copy.deepcopy(raw)
        k31["model_type"] = "kimi_k31"
        with self.assertRaisesRegex(ValueError, "dsa_config"):
            R.Config(k31)
        k3dsa = copy.deepcopy(raw)
        k3dsa["text_config"]["dsa_config"] = {"dsa_layers": self.K3_FULL, "index_rope_dim": 0, "index_topk": 2048}
        with self.assertRaisesRegex(ValueError, "kimi_k3 but"):
            R.Config(k3dsa)
        k31["text_config"]["dsa_config"] = {"dsa_layers": self.K3_FULL, "index_rope_dim": 0, "topk": 2048}
        self.assertEqual(R.Config(k31).index_topk, 2048)           # alias accepted


# ----------------------------------------------------------------------------------------------------
# end to end on tiny checkpoints
# ----------------------------------------------------------------------------------------------------

class TestTinyModels(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kimi_ref_")
        cls.dirs = {}
        for p in make_tiny.PRESETS:
            d = os.path.join(cls.tmp, p)
            make_tiny.make(p, d, seed=11)
            cls.dirs[p] = d
        cls.ids = [int(x) for x in np.random.default_rng(12).integers(0, 256, size=20)]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def logits(self, preset, ids, **attrs):
        m = R.Model(self.dirs[preset])
        for k, v in attrs.items():
            setattr(m, k, v)
        return m.forward(ids)

    def test_finite_and_causal(self):
        for p in make_tiny.PRESETS:
            full = self.logits(p, self.ids)
            self.assertTrue(np.all(np.isfinite(full)), p)
            self.assertGreater(np.std(full), 0.1, p)
            for n in (1, 7):
                part = self.logits(p, self.ids[:n])
                self.assertLess(rel_err(part, full[:n]), 1e-12, f"{p} prefix {n}")

    def test_trap45_chunked_kda_in_model(self):
        for p in ("k3", "kimi-linear"):
            a = self.logits(p, self.ids)
            b = self.logits(p, self.ids, kda_mode="chunked")
            self.assertLess(rel_err(b, a), 1e-10, p)

    def test_nvfp4_tree_equals_mxfp4_tree(self):
        a = self.logits("k3", self.ids)
        b = self.logits("k3-nvfp4", self.ids)
        self.assertLess(rel_err(b, a), 1e-13)

    def test_coverage_two_way(self):
        for p in make_tiny.PRESETS:
            rep = R.coverage_report(R.Model(self.dirs[p]))
            self.assertEqual(rep["unconsumed"], [], p)
            self.assertEqual(rep["ignored_vision"], 0 if p == "kimi-linear" else 2)

    def test_trap36_indexer_selects_beyond_topk_only(self):
        topk = 5
        dense = R.Model(self.dirs["k31"])
        dense.cfg.index_topk = 10 ** 9
        sparse = R.Model(self.dirs["k31"])
        self.assertEqual(sparse.cfg.index_topk, topk)
        short = self.ids[:topk]
        np.testing.assert_array_equal(sparse.forward(short), dense.forward(short))   # bit for bit
        a, b = sparse.forward(self.ids), dense.forward(self.ids)
        np.testing.assert_array_equal(a[:topk], b[:topk])
        self.assertIn("indexer", sparse.margins)                   # near-tie diagnostics recorded
        self.assertNotIn("indexer", dense.margins)
        self.assertGreater(rel_err(a[topk:], b[topk:]), 1e-4)
        # the mask really keeps exactly topk keys per query beyond topk
        l = [i for i in range(sparse.cfg.n_layers) if sparse.cfg.dsa_layer[i]][0]
        x = np.random.default_rng(0).standard_normal((12, 64))
        cq = np.random.default_rng(1).standard_normal((12, 32))
        mask = sparse.indexer_mask(l, x, cq)
        self.assertEqual(mask.sum(1).tolist(), [1, 2, 3, 4, 5] + [5] * 7)
        self.assertFalse(np.any(np.triu(mask, 1)))

    def test_trap04_mla_gate_zero_is_half(self):
        m = R.Model(self.dirs["k3"])
        l = [i for i in range(m.cfg.n_layers) if m.cfg.is_mla[i]][0]
        x = np.random.default_rng(2).standard_normal((6, 64))
        m.w("self_attn.g_proj.weight", l)
        m.cache[m.name("self_attn.g_proj.weight", l)] = np.zeros((64, 64))
        gated = m.mla(l, x)
        m.cfg.mla_gate = False
        ungated = m.mla(l, x)
        np.testing.assert_allclose(gated, 0.5 * ungated, rtol=1e-13)

    def test_trap01_nope_no_position_dependence(self):
        m = R.Model(self.dirs["k3"])
        l = [i for i in range(m.cfg.n_layers) if m.cfg.is_mla[i]][0]
        x = np.tile(np.random.default_rng(3).standard_normal((1, 64)), (5, 1))
        y = m.mla(l, x)
        np.testing.assert_allclose(y, np.tile(y[:1], (5, 1)), rtol=1e-12)

    def test_trap18_attnres_wiring_matters(self):
        a = self.logits("k3", self.ids)
        m = R.Model(self.dirs["k3"])
        m.cfg.attn_res = 0                                          # plain residual: mutation
        self.assertGreater(rel_err(m.forward(self.ids), a), 1e-3)
        m = R.Model(self.dirs["k3"])
        m.cfg.attn_res = 2                                          # other boundaries: mutation
        self.assertGreater(rel_err(m.forward(self.ids), a), 1e-3)

    def test_trap08_model_gate_formula_matters(self):
        a = self.logits("k3", self.ids)
        m = R.Model(self.dirs["k3"])
        m.cfg.gate_lower_bound = None
        self.assertGreater(rel_err(m.forward(self.ids), a), 1e-3)

    def test_trap07_a_log_tail_and_variant_gating(self):
        src = self.dirs["k3"]
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(src, d, dirs_exist_ok=True)
            idx = read_json(os.path.join(d, "model.safetensors.index.json"))
            name = "language_model.model.layers.0.self_attn.A_log"
            shard = os.path.join(d, idx["weight_map"][name])
            f = R.SafetensorsFile(shard)
            t = {n: f.raw(n)[::2] for n in f.entries}
            arr = t[name][1].copy()
            arr[-1] = 0.25
            t[name] = ("F32", arr)
            R.write_safetensors(shard, t)
            with self.assertRaisesRegex(ValueError, "non-zero tail"):
                R.Model(d).forward([1, 2])
        # K3.1 tree under a K3 config is refused; K3 tree under a kimi_k31 config is refused
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(self.dirs["k31"], d, dirs_exist_ok=True)
            cfg = read_json(os.path.join(d, "config.json"))
            cfg["model_type"] = "kimi_k3"
            del cfg["text_config"]["dsa_config"]
            write_json(os.path.join(d, "config.json"), cfg)
            with self.assertRaisesRegex(ValueError, "indexer tensors present"):
                R.Model(d)
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(src, d, dirs_exist_ok=True)
            cfg = read_json(os.path.join(d, "config.json"))
            cfg["model_type"] = "kimi_k31"
            cfg["text_config"]["dsa_config"] = {"dsa_layers": [3, 6, 7], "index_rope_dim": 0, "index_topk": 5}
            write_json(os.path.join(d, "config.json"), cfg)
            with self.assertRaisesRegex(ValueError, "no indexer tensors"):
                R.Model(d)

    def test_cli_logits_and_generate(self):
        script = os.path.join(HERE, "kimi_ref.py")
        ids = ",".join(str(i) for i in self.ids[:6])
        out = subprocess.run([sys.executable, script, "logits", "--model", self.dirs["k31"], "--ids", ids],
                             check=True, capture_output=True, text=True).stdout
        lg = np.array(json.loads(out)["logits"])
        np.testing.assert_array_equal(lg, self.logits("k31", self.ids[:6]))   # JSON keeps full precision
        out = subprocess.run([sys.executable, script, "generate", "--model", self.dirs["k3"], "--ids", ids,
                              "-n", "4"], check=True, capture_output=True, text=True).stdout
        gen = json.loads(out)
        self.assertEqual(len(gen), 4)
        seq = list(self.ids[:6])
        for g in gen:
            self.assertEqual(g, int(np.argmax(self.logits("k3", seq)[-1])))
            seq.append(g)


    def test_trap23_latent_moe_order_per_token(self):
        m = R.Model(self.dirs["k3"])
        l = 1
        pre = m.cfg.prefix + f"model.layers.{l}.block_sparse_moe."
        ck = m.ck
        W = lambda n: ck.f64(pre + n)
        h = np.random.default_rng(9).standard_normal((5, 64))
        got = m.moe(l, h)

        def by_hand(norm_where):
            outs = []
            for x in h:
                s = R.sigmoid(W("gate.weight") @ x)                  # router on the FULL hidden
                choice = s + W("gate.e_score_correction_bias")
                sel = np.argsort(-choice, kind="stable")[:2]
                w = s[sel] / (s[sel].sum() + 1e-20) * 1.0
                z = W("routed_expert_down_proj.weight") @ x          # once per token
                acc = np.zeros_like(z)
                for e, we in zip(sel, w):
                    w1, w3, w2 = (R.decode_mxfp4(ck.raw(pre + f"experts.{e}.{k}.weight_packed")[2],
                                                 ck.raw(pre + f"experts.{e}.{k}.weight_scale")[2]) for k in ("w1", "w3", "w2"))
                    y = w2 @ R.situ(w1 @ z, w3 @ z, 4.0, 25.0)
                    if norm_where == "per_expert":
                        y = R.rmsnorm(y, W("routed_expert_norm.weight"), 1e-5)
                    acc += we * y
                if norm_where == "sum":
                    acc = R.rmsnorm(acc, W("routed_expert_norm.weight"), 1e-5)
                up = W("routed_expert_up_proj.weight") @ acc
                if norm_where == "after_up":
                    up = R.rmsnorm(up, np.ones(64), 1e-5)
                sh = W("shared_experts.down_proj.weight") @ R.situ(W("shared_experts.gate_proj.weight") @ x,
                                                                   W("shared_experts.up_proj.weight") @ x, 4.0, 25.0)
                outs.append(up + sh)
            return np.array(outs)

        np.testing.assert_allclose(got, by_hand("sum"), rtol=1e-12, atol=1e-12)
        for bad in ("per_expert", "after_up"):                     # controls: wrong norm placement
            self.assertGreater(rel_err(by_hand(bad), got), 1e-2, bad)

    def test_compare_script_self_and_control(self):
        import compare_perigee as C
        me = [sys.executable, os.path.join(HERE, "kimi_ref.py")]
        res = C.compare(me, self.dirs["k31"], [1, 9], 3, [4], 1e-4, 0)
        self.assertTrue(res["pass"], res)
        shim = os.path.join(self.tmp, "perturbed_engine.py")
        with open(shim, "w") as fh:
            fh.write("import sys\nsys.path.insert(0, %r)\nimport numpy as np, kimi_ref as R\n"
                     "f = R.Model.forward\n"
                     "def g(self, ids):\n    y = f(self, ids)\n    y[-1, 0] += 1e-2\n    return y\n"
                     "R.Model.forward = g\nsys.exit(R.main())\n" % HERE)
        res = C.compare([sys.executable, shim], self.dirs["k31"], [9], 0, [], 1e-4, 0)
        self.assertFalse(res["pass"])


# ----------------------------------------------------------------------------------------------------
# cross-check against the transformers goldens (tests/golden/kimi_linear/<case>/), when present
# ----------------------------------------------------------------------------------------------------

class TestGoldens(unittest.TestCase):
    def test_against_goldens(self):
        cases = sorted(glob.glob(os.path.join(REPO, "tests", "golden", "kimi_linear", "*", "golden.safetensors")))
        if not cases:
            self.skipTest("no tests/golden/kimi_linear/<case>/golden.safetensors in this tree yet")
        for gpath in cases:
            case = os.path.dirname(gpath)
            with self.subTest(case=os.path.basename(case)):
                compare_golden_case(self, case)


def golden_ids(case_dir, f, n):
    """Token ids of a golden case: a tensor 'ids.<n>' / 'input_ids.<n>' in golden.safetensors or a JSON
    file in the case directory."""
    for nm in (f"prompt.{n}", f"ids.{n}", f"input_ids.{n}"):
        if nm in f.entries:
            return [int(v) for v in f.raw(nm)[2].reshape(-1)[:n]]
    for fn in ("ids.json", "input_ids.json", "golden.json", "meta.json"):
        p = os.path.join(case_dir, fn)
        if os.path.exists(p):
            j = read_json(p)
            for key in ("ids", "input_ids", "prompt_ids"):
                if key in j:
                    v = j[key]
                    if isinstance(v, dict):
                        v = v.get(str(n), v.get(n))
                    return [int(x) for x in v][:n]
    raise AssertionError(f"{case_dir}: cannot find the token ids for logits.{n}")


def compare_golden_case(tc, case_dir):
    f = R.SafetensorsFile(os.path.join(case_dir, "golden.safetensors"))
    model_dir = case_dir if os.path.exists(os.path.join(case_dir, "config.json")) else os.path.join(case_dir, "model")
    m = R.Model(model_dir)
    names = sorted(n for n in f.entries if n.startswith("logits."))
    tc.assertTrue(names, f"{case_dir}: no logits.<len> tensors")
    for nm in names:
        n = int(nm.split(".")[1])
        ids = golden_ids(case_dir, f, n)
        gold = R.to_f64(*f.raw(nm)[::2]).reshape(n, -1)
        ours = m.forward(ids)
        err = rel_err(ours, gold)
        tc.assertLess(err, 1e-4, f"{case_dir}: {nm}: max|d|/max|golden| = {err:.3e}")
        # control: the same comparison must fail on a perturbed golden
        bad = gold.copy()
        bad[-1, int(np.argmax(np.abs(bad[-1])))] *= 1.01
        tc.assertGreater(rel_err(ours, bad), 1e-4, f"{case_dir}: {nm}: comparator control did not fail")
    for g in ("greedy", "greedy_long"):
        if f"{g}.prompt" not in f.entries:
            continue
        prompt = [int(v) for v in f.raw(f"{g}.prompt")[2]]
        want = [int(v) for v in f.raw(f"{g}.tokens")[2]]
        glog = R.to_f64(*f.raw(f"{g}.logits")[::2]) if f"{g}.logits" in f.entries else None
        seq = list(prompt)
        for i, tok in enumerate(want):
            row = m.forward(seq)[-1]
            if glog is not None:
                err = rel_err(row, glog[i])
                tc.assertLess(err, 1e-4, f"{case_dir}: {g} step {i}: max|d|/max|golden| = {err:.3e}")
            tc.assertEqual(int(np.argmax(row)), tok, f"{case_dir}: {g} step {i}")
            seq.append(tok)


if __name__ == "__main__":
    unittest.main()
