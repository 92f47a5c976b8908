"""`dominospec export`: exports hold exactly what the engines load, and the engines' rules reproduce our drafts.

No engine is imported (none installs next to our torch/transformers pins). Instead:
- the files on disk are checked against the contract tables (export/contracts.py) and parsed with
  transformers' AutoConfig, as both engines parse them;
- `EngineReplay`, written here from the engines' rollout rules (fused q/k/v and gate/up, nn.GRU with
  weight_ih_l0/weight_hh_l0, embed_proj as Sequential(Linear, SiLU, Linear), B-1 proposals from slots
  0..B-2 for Domino, B for DSpark, d2t remapping, features concatenated in ascending layer order),
  loads ONLY the exported files plus the target and must reproduce our greedy drafts and logits.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_target
from safetensors.torch import load_file
from torch import nn

from dominospec import Drafter, DrafterConfig
from dominospec.errors import DominoError
from dominospec.export import arch_for_engine, export_drafter, plan_export
from dominospec.export.contracts import CONFIG_READS, MASK_FILE, REPORT_FILE, resolve, speculators_update_dspark
from dominospec.export.plan import why_not_exact

MASK_ID = 5  # a real mask token id for the tiny vocabulary of 64


@pytest.fixture(scope="module")
def target():
    """A tiny float64 target whose weights are exactly representable in fp32, so an fp32 export loses nothing."""
    t = tiny_target("llama", layers=5, seed=3)
    with torch.no_grad():
        for p in t.model.parameters():
            p.copy_(p.float().double())
    return t


def make_drafter(
    target,
    head="domino",
    mask_token_id=MASK_ID,
    draft_vocab=0,
    layer_ids=(3, 0, 2),
    confidence=False,
    confidence_inputs="z",
    block_size=4,
    seed=0,
) -> Drafter:
    """A random drafter whose every weight (head included) matters and is exact in fp32."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(
        target,
        head=head,
        block_size=block_size,
        num_layers=2,
        intermediate_size=48,
        gru_hidden_size=8,
        rank=6,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab,
        target_layer_ids=list(layer_ids),  # unsorted: the export must reorder fc's column blocks
        confidence_head=confidence,
        confidence_inputs=confidence_inputs,
    )
    d = Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a norm read from the wrong tensor shows
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.startswith(("head.", "confidence.")) or name == "mask_embedding":
                p.normal_(0.0, 0.5)
        if draft_vocab:  # scattered and NOT ascending, so index order, id order and the export's order differ
            d.draft_vocab.copy_(torch.randperm(target.vocab_size)[:draft_vocab])
    d.attach(target)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.float().double())
    return d


# ----- our side: the greedy drafts and the final logits per slot, in target-id space -----
def our_rollout(drafter, target, seq: list[int]):
    """(drafts [B], logits [B, V] with -inf outside a draft vocabulary, confidence [B] or None)."""
    feats = target.sequence_features([seq[:-1]], drafter.config.target_layer_ids)[0][0].unsqueeze(0)
    cache = drafter.new_cache()
    drafter.extend_cache(cache, feats)
    anchor = torch.tensor([seq[-1]])
    z = drafter.backbone_block(cache, anchor)[0]  # [B, H]
    base = drafter.base_logits(z)
    head, prev, state = drafter.head, anchor, drafter.head.init_state(z[:1])
    drafts, logits, conf = [], [], []
    for k in range(z.shape[0]):
        prev_emb = drafter.embed(prev)
        if drafter.confidence is not None:
            conf.append(drafter.confidence(z[k : k + 1], prev_emb))
        delta, state = head.step(k, z[k : k + 1], prev_emb, prev, state, base[k : k + 1])
        final = base[k : k + 1] if delta is None else base[k : k + 1] + delta
        full = torch.full((1, drafter.config.vocab_size), -math.inf, dtype=final.dtype)
        idx = drafter.draft_vocab if drafter.config.draft_vocab_size else torch.arange(drafter.config.vocab_size)
        logits.append(full.index_copy(1, idx, final))
        prev = drafter.to_target_ids(final.argmax(-1))
        drafts.append(prev)
    return torch.cat(drafts), torch.cat(logits), (torch.cat(conf) if conf else None)


# ----- the engines' side, from the exported files only -----
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def neox_rope(x, pos, theta):
    # rotate-half RoPE (is_neox_style), x [heads, S, d]; the cos/sin cache in float32, as the engines build it
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float().unsqueeze(-1) * inv
    cos, sin = torch.cat([ang, ang], -1).cos().double(), torch.cat([ang, ang], -1).sin().double()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class EngineReplay:
    """One drafter export, run the way SGLang / vLLM run it (greedy), from its directory alone."""

    def __init__(self, out: Path, target):
        self.t = target
        raw = json.loads((out / "config.json").read_text())
        if "speculators_model_type" in raw:  # vLLM reads it through update_dspark
            self.cfg = {**raw["transformer_layer_config"], **speculators_update_dspark(raw)}
            self.kind = "dspark"
        else:
            self.cfg = raw
            self.kind = "domino" if raw.get("dflash_config", {}).get("projector_type") == "domino" else "dspark"
        c = self.cfg
        self.layer_ids = c["target_layer_ids"] if "target_layer_ids" in c else c["dflash_config"]["target_layer_ids"]
        self.w = {
            k: v.double() if v.is_floating_point() else v for k, v in load_file(str(out / "model.safetensors")).items()
        }
        self.eps, self.theta = c["rms_norm_eps"], c["rope_parameters"]["rope_theta"]
        self.nh, self.kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        mask_id = c["mask_token_id"] if "mask_token_id" in c else c["dflash_config"]["mask_token_id"]
        self.block = c["block_size"] if "block_size" in c else c["dflash_config"]["block_size"]
        # SGLang DFLASH copies mask_embedding.pt into the target's own embedding row
        self.embed = target.embed_weight.detach().double().clone()
        if (out / MASK_FILE).exists():
            m = torch.load(out / MASK_FILE)
            assert m["mask_token_id"] == mask_id
            self.embed[mask_id] = m["embedding"].double()
        self.mask_id = mask_id
        self.lm_head = self.w.get("lm_head.weight", target.output_embeddings().weight.detach().double())

    def layer(self, i, x, ctx, pos_ctx, pos_blk):
        w, p = self.w, f"layers.{i}."
        a = p + "self_attn."
        qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])  # fused at load
        q_n, kv_n = self.nh * self.d, self.kv * self.d
        h = rms(x, w[p + "input_layernorm.weight"], self.eps)
        q, k, v = (h @ qkv.T).split([q_n, kv_n, kv_n], -1)
        # context rows: k/v projections of the normed context, no input_layernorm
        ck, cv = (ctx @ qkv[q_n:].T).split([kv_n, kv_n], -1)

        def heads(t, n):
            return t.view(t.shape[0], n, self.d).transpose(0, 1)

        q = neox_rope(rms(heads(q, self.nh), w[a + "q_norm.weight"], self.eps), pos_blk, self.theta)
        k = neox_rope(rms(heads(k, self.kv), w[a + "k_norm.weight"], self.eps), pos_blk, self.theta)
        ck = neox_rope(rms(heads(ck, self.kv), w[a + "k_norm.weight"], self.eps), pos_ctx, self.theta)
        keys = torch.cat([ck, k], 1).repeat_interleave(self.nh // self.kv, 0)
        vals = torch.cat([heads(cv, self.kv), heads(v, self.kv)], 1).repeat_interleave(self.nh // self.kv, 0)
        att = torch.softmax(q @ keys.transpose(1, 2) / math.sqrt(self.d), -1) @ vals  # non-causal
        x = x + att.transpose(0, 1).reshape(x.shape[0], -1) @ w[a + "o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = (h @ torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def hidden(self, seq):
        feats = self.t.sequence_features([seq[:-1]], self.layer_ids)[0][0].double()  # ascending, as captured
        ctx = rms(feats @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)
        s = len(seq) - 1
        x = self.embed[torch.tensor([seq[-1]] + [self.mask_id] * (self.block - 1))]
        pos_ctx, pos_blk = torch.arange(s), torch.arange(s, s + self.block)
        for i in range(self.cfg["num_hidden_layers"]):
            x = self.layer(i, x, ctx, pos_ctx, pos_blk)
        return rms(x, self.w["norm.weight"], self.eps)  # [B, H]

    def rollout(self, seq):
        """(drafts, logits [P, V] in target-id space, confidence [P] or None) for the block after seq."""
        h = self.hidden(seq)
        return self._domino(h, seq[-1]) if self.kind == "domino" else self._dspark(h, seq[-1])

    def _domino(self, h, anchor):
        w, g_dim = self.w, self.cfg["dflash_config"]["gru_hidden_dim"]
        z = h[: self.block - 1]  # shift_label: proposals from slots 0..B-2
        base = z @ self.lm_head.T  # full target vocabulary
        gru = nn.GRU(h.shape[1], g_dim, bias=False, batch_first=True).double()
        gru.weight_ih_l0.data.copy_(w["prefix_gru.weight_ih_l0"])
        gru.weight_hh_l0.data.copy_(w["prefix_gru.weight_hh_l0"])
        e = w["embed_proj.0.weight"].shape[0]
        proj = nn.Sequential(
            nn.Linear(h.shape[1] + g_dim, e, bias=False), nn.SiLU(), nn.Linear(e, base.shape[1], bias=False)
        )
        proj.double()
        proj[0].weight.data.copy_(w["embed_proj.0.weight"])
        proj[2].weight.data.copy_(w["embed_proj.2.weight"])
        seen, drafts, logits = [anchor], [], []
        for k in range(z.shape[0]):
            if k == 0:  # pure_draft_prefix_len 1: the first proposal is uncorrected
                final = base[0]
            else:
                out, _ = gru(self.embed[torch.tensor(seen)].unsqueeze(0))  # GRU over [anchor, d0, .., d_{k-1}]
                final = base[k] + proj(torch.cat([z[k], out[0, -1]]))
            logits.append(final)
            seen.append(int(final.argmax()))
            drafts.append(seen[-1])
        return torch.tensor(drafts), torch.stack(logits), None

    def _dspark(self, h, anchor):
        w, c = self.w, self.cfg
        base = h @ self.lm_head.T  # [B, Vd]: sample_from_anchor, all B slots propose
        d2t = w.get("d2t")
        w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
        rnn = "markov_head.joint_proj.weight" in w
        s = torch.zeros(w1.shape[1], dtype=torch.float64)
        prev, drafts, logits = anchor, [], []
        conf = []
        for k in range(h.shape[0]):
            if c.get("enable_confidence_head"):
                conf.append(h[k] @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0])
            if rnn:
                g, cand, o = (
                    w["markov_head.joint_proj.weight"] @ torch.cat([s, w1[prev], h[k]])
                    + w["markov_head.joint_proj.bias"]
                ).chunk(3)
                s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(cand)
                bias = w2 @ torch.tanh(o)
            else:
                bias = w2 @ w1[prev]  # indexed by the previous TARGET id
            final = base[k] + bias
            pick = int(final.argmax())
            prev = pick + int(d2t[pick]) if d2t is not None else pick
            full = torch.full((self.embed.shape[0],), -math.inf, dtype=torch.float64)
            idx = torch.arange(final.shape[0]) + d2t if d2t is not None else torch.arange(final.shape[0])
            logits.append(full.index_copy(0, idx, final))
            drafts.append(prev)
        return torch.tensor(drafts), torch.stack(logits), (torch.stack(conf) if conf else None)


def prompts(n=6, length=9, vocab=64, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length + i,), generator=g).tolist() for i in range(n)]


def check_replay(out, drafter, target):
    """The replay of the export proposes exactly our drafts with our logits, block after block."""
    replay = EngineReplay(out, target)
    n_prop = json.loads((out / REPORT_FILE).read_text())["proposals_per_block"]
    for seq in prompts():
        ours, our_logits, our_conf = our_rollout(drafter, target, seq)
        theirs, their_logits, their_conf = replay.rollout(seq)
        assert len(theirs) == n_prop
        assert theirs.tolist() == ours[:n_prop].tolist()
        finite = torch.isfinite(our_logits[:n_prop])
        assert torch.equal(finite, torch.isfinite(their_logits))
        torch.testing.assert_close(their_logits[finite], our_logits[:n_prop][finite], rtol=1e-9, atol=1e-9)
        if our_conf is not None and their_conf is not None:
            torch.testing.assert_close(their_conf, our_conf[:n_prop], rtol=1e-9, atol=1e-9)
    return replay


EXACT_CASES = [
    # (format, drafter settings)
    ("sglang", dict(head="domino")),
    ("sglang", dict(head="domino", mask_token_id=None)),  # learned mask -> mask_embedding.pt
    ("sglang", dict(head="markov", confidence=True)),
    ("sglang", dict(head="rnn")),
    ("sglang", dict(head="none")),
    ("sglang", dict(head="none", mask_token_id=None)),  # Domino with a zero correction (reads the .pt)
    ("vllm", dict(head="markov", draft_vocab=40, confidence=True)),
    ("vllm", dict(head="markov")),
    ("vllm", dict(head="none", draft_vocab=40)),
    ("speculators", dict(head="markov", draft_vocab=40)),
    ("specforge", dict(head="domino")),
]


def _id(case):
    fmt, kw = case
    return fmt + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", EXACT_CASES, ids=[_id(c) for c in EXACT_CASES])
def test_export_replays_our_greedy_drafts_and_logits(case, target, tmp_path):
    fmt, kw = case
    drafter = make_drafter(target, **kw)
    mask = MASK_ID if kw.get("mask_token_id", MASK_ID) is None else None
    report = export_drafter(drafter, fmt, tmp_path / "out", target, mask_token_id=mask, dtype="fp32")
    check_replay(tmp_path / "out", drafter, target)
    if "mask_token_id" not in kw:
        assert report["status"] == "exact", report["approximations"]


def test_replay_is_not_vacuous_a_wrong_gate_order_or_layer_order_is_caught(target, tmp_path):
    """Controls: the replay fails on an export whose GRU gates or fc column blocks are mis-ordered."""
    drafter = make_drafter(target, head="domino")
    export_drafter(drafter, "sglang", tmp_path / "out", target, dtype="fp32")
    from safetensors.torch import save_file

    path = tmp_path / "out" / "model.safetensors"
    good = load_file(str(path))
    for name, broken in [
        ("prefix_gru.weight_ih_l0", lambda t: torch.cat(list(t.chunk(3))[::-1])),  # gates (n, z, r)
        ("fc.weight", lambda t: torch.cat(list(t.chunk(3, dim=1))[::-1], dim=1)),  # descending layers
    ]:
        save_file({**good, name: broken(good[name]).contiguous()}, str(path))
        with pytest.raises(AssertionError):
            check_replay(tmp_path / "out", drafter, target)
    save_file(good, str(path))
    check_replay(tmp_path / "out", drafter, target)


CONTRACT_CASES = [
    ("sglang", "domino", dict(head="domino")),
    ("sglang", "dspark", dict(head="rnn", confidence=True)),
    ("vllm", "dspark", dict(head="markov", draft_vocab=40, confidence=True)),
    ("speculators", "dspark", dict(head="markov", draft_vocab=40)),
    ("specforge", "domino", dict(head="domino")),
]


@pytest.mark.parametrize("fmt,kind,kw", CONTRACT_CASES, ids=[f"{f}-{k}-{kw['head']}" for f, k, kw in CONTRACT_CASES])
def test_export_holds_exactly_the_tensors_and_config_values_the_engine_reads(fmt, kind, kw, target, tmp_path):
    from transformers import AutoConfig, Qwen3Config

    drafter = make_drafter(target, **kw)
    c = drafter.config
    out = tmp_path / "out"
    report = export_drafter(drafter, fmt, out, target, dtype="bf16")
    assert report["kind"] == kind
    tensors = load_file(str(out / "model.safetensors"))
    h, n, vd = c.hidden_size, len(c.target_layer_ids), c.draft_vocab_size or c.vocab_size
    # written out by hand from export-formats.md, not from the contract module
    expected = {
        "fc.weight": (h, n * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(c.num_layers):
        p = f"layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * c.head_dim, h),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * c.head_dim, h),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * c.head_dim, h),
            p + "self_attn.o_proj.weight": (h, c.num_attention_heads * c.head_dim),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        }
    if kind == "domino":
        g, e = c.gru_hidden_size, c.rank
        expected |= {
            "prefix_gru.weight_ih_l0": (3 * g, h),
            "prefix_gru.weight_hh_l0": (3 * g, g),
            "embed_proj.0.weight": (e, h + g),
            "embed_proj.2.weight": (c.vocab_size, e),
        }
    else:
        r = c.rank
        reduced = fmt in ("vllm", "speculators") and c.draft_vocab_size
        expected |= {
            "markov_head.markov_w1.weight": (c.vocab_size, r),
            "markov_head.markov_w2.weight": (vd if reduced else c.vocab_size, r),
        }
        if c.head == "rnn":
            expected |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)}
        if c.confidence_head:
            expected |= {"confidence_head.proj.weight": (1, h), "confidence_head.proj.bias": (1,)}
        if reduced:
            expected |= {"lm_head.weight": (vd, h), "d2t": (vd,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected  # no missing, no extra
    for k, v in tensors.items():
        assert not k.startswith("model.")
        assert v.dtype == (torch.int64 if k == "d2t" else torch.bfloat16), k
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k
    if "d2t" in tensors:
        ids = tensors["d2t"] + torch.arange(vd)
        assert ids.tolist() == sorted(drafter.draft_vocab.tolist())  # ascending target ids

    # every value where the engine reads it, parsed as the engines parse it (transformers)
    raw = json.loads((out / "config.json").read_text())
    ids = sorted(c.target_layer_ids)
    want = {
        "architectures": [
            {
                "domino": "DominoDraftModel" if fmt == "specforge" else "DFlashDraftModel",
                "dspark": "Qwen3DSparkModel",
            }[kind]
        ],
        "hidden_size": h,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": 512,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "target_layer_ids": ids,
        "aux_layer_ids": [i + 1 for i in ids],
        "num_target_layers": c.target_num_layers,
        "mask_token_id": MASK_ID,
        "block_size": c.block_size,
        "projector_domino": "domino",
        "shift_label": True,
        "pure_prefix": 1,
        "gru_hidden_dim": c.gru_hidden_size,
        "emb_dim": c.rank,
        "markov_rank": c.rank,
        "markov_head_type": c.head if c.head == "rnn" else "vanilla",
        "sample_from_anchor": True,
        "enable_confidence_head": c.confidence_head,
        "confidence_head_with_markov": False,
        "draft_vocab_size": vd,
        "speculators_model_type": "dspark",
        "verifier": target.name,
    }
    if fmt == "speculators":
        assert "model_type" not in raw  # vLLM detects the speculators format by its absence
        parsed = {**raw, "transformer_layer_config": Qwen3Config(**raw["transformer_layer_config"])}
        derived = speculators_update_dspark(raw)
        assert derived["target_layer_ids"] == ids and derived["sample_from_anchor"] is True
    else:
        parsed = AutoConfig.from_pretrained(out)
        assert type(parsed).__name__ == "Qwen3Config"
    for read in CONFIG_READS[(fmt, kind)]:
        assert resolve(parsed, read.path) == want[read.value], (read.path, read.source)
    if kind == "dspark" and fmt != "speculators":
        assert "sample_from_anchor" not in raw["dflash_config"]  # vLLM's DFlash base raises on it there


REFUSALS = [
    ("vllm", dict(head="domino"), {}, "no Domino head"),
    ("speculators", dict(head="domino"), {}, "no Domino head"),
    ("vllm", dict(head="rnn"), {}, "vanilla Markov head only"),
    ("sglang", dict(head="domino", mask_token_id=None), {}, "--mask-token-id"),
    ("sglang", dict(head="markov", mask_token_id=None), {"mask_token_id": MASK_ID}, "mask_embedding.pt"),
    ("vllm", dict(head="markov", mask_token_id=None), {"mask_token_id": MASK_ID}, "mask_embedding.pt"),
    ("sglang", dict(head="domino", draft_vocab=40), {}, "--allow-approx"),
    ("specforge", dict(head="markov"), {}, "--allow-approx"),
    ("sglang", dict(head="domino"), {"mask_token_id": MASK_ID + 1}, "trained with mask token"),
    ("sglang", dict(head="domino", mask_token_id=None), {"mask_token_id": 64}, "outside the vocabulary"),
    ("sglang", dict(head="path"), {}, "no serving engine has a path-selector head"),
    ("vllm", dict(head="path"), {}, "no serving engine has a path-selector head"),
]


@pytest.mark.parametrize("fmt,kw,opts,words", REFUSALS, ids=[f"{r[0]}-{r[3][:20]}" for r in REFUSALS])
def test_export_refuses_what_the_engine_cannot_run_as_trained(fmt, kw, opts, words, target, tmp_path):
    drafter = make_drafter(target, **kw)
    with pytest.raises(DominoError, match=words.replace("-", r"\-").replace(".", r"\.")):
        export_drafter(drafter, fmt, tmp_path / "out", target, **opts)
    assert not (tmp_path / "out").exists()  # nothing written
    assert not list(tmp_path.iterdir())


def test_export_refuses_qk_norm_false(target, tmp_path):
    cfg = DrafterConfig.for_target(target, qk_norm=False, mask_token_id=MASK_ID, num_layers=1)
    with pytest.raises(DominoError, match="qk_norm"):
        plan_export(cfg, "sglang")


def test_allow_approx_widens_the_draft_vocabulary_and_says_so(target, tmp_path):
    drafter = make_drafter(target, head="domino", draft_vocab=40)
    report = export_drafter(drafter, "sglang", tmp_path / "out", target, allow_approx=True, dtype="fp32")
    assert report["status"] == "approximate"
    assert any("widened" in a for a in report["approximations"])
    w = load_file(str(tmp_path / "out" / "model.safetensors"))["embed_proj.2.weight"]
    outside = torch.ones(64, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    assert w.shape[0] == 64 and (w[outside] == 0).all() and (w[~outside] != 0).any()


@pytest.mark.parametrize("fmt,head", [("sglang", "domino"), ("vllm", "markov")])
def test_confidence_head_the_engine_cannot_compute_is_dropped_with_a_warning(fmt, head, target, tmp_path):
    drafter = make_drafter(target, head=head, confidence=True, confidence_inputs="z_prev_embed")
    report = export_drafter(drafter, fmt, tmp_path / "out", target, dtype="fp32")
    assert any("confidence head dropped" in a for a in report["approximations"])
    assert not any(k.startswith("confidence") for k in report["tensors"])
    assert json.loads((tmp_path / "out" / "config.json").read_text()).get("enable_confidence_head", False) is False
    check_replay(tmp_path / "out", drafter, target)  # the drafts themselves stay exact


def test_export_replaces_an_earlier_export_but_not_other_files(target, tmp_path):
    drafter = make_drafter(target, head="markov")
    export_drafter(drafter, "vllm", tmp_path / "out", target)
    export_drafter(drafter, "sglang", tmp_path / "out", target)  # over an earlier export: fine
    assert json.loads((tmp_path / "out" / REPORT_FILE).read_text())["format"] == "sglang"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DominoError, match="no earlier export"):
        export_drafter(drafter, "vllm", tmp_path / "other", target)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_report_and_serve_commands_name_the_engine_flags(target, tmp_path):
    d = make_drafter(target, head="domino", mask_token_id=None)
    rep = export_drafter(d, "sglang", tmp_path / "a", target, mask_token_id=MASK_ID)
    assert "--speculative-algorithm DFLASH" in rep["serve_command"]
    assert "--speculative-domino-candidate-pool-size 0" in rep["serve_command"]
    assert any(f"row {MASK_ID}" in a for a in rep["approximations"]) and rep["proposals_per_block"] == 3
    assert rep["dtype"] == "bfloat16"  # SGLang runs Domino in bf16
    m = torch.load(tmp_path / "a" / MASK_FILE)
    assert m["mask_token_id"] == MASK_ID and m["embedding"].shape == (32,)
    rep = export_drafter(make_drafter(target, head="markov"), "vllm", tmp_path / "b", target)
    assert rep["serve_command"].startswith("vllm serve tiny-llama --speculative-config")
    assert '"method": "dspark"' in rep["serve_command"] and '"num_speculative_tokens": 4' in rep["serve_command"]


# ----- training for the engine: --serve-with -----
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_serve_with_chooses_a_drafter_that_exports_exactly(engine, target, tmp_path):
    arch = arch_for_engine(engine, None, MASK_ID, confidence_head=engine == "vllm", draft_vocab=0)
    assert arch["head"] == ("domino" if engine == "sglang" else "markov")
    cfg = DrafterConfig.for_target(target, confidence_head=engine == "vllm", draft_vocab_size=0, **arch)
    plan = plan_export(cfg, engine)
    assert plan.status == "exact", plan.approximations
    assert plan.confidence == (engine == "vllm")


@pytest.mark.parametrize(
    "engine,kw,words",
    [
        ("sglang", dict(head=None, mask_token_id=None), "real mask token"),
        ("sglang", dict(head="domino", mask_token_id=MASK_ID, draft_vocab=100), "full vocabulary"),
        ("sglang", dict(head="domino", mask_token_id=MASK_ID, confidence_head=True), "no confidence head"),
        ("vllm", dict(head="domino", mask_token_id=MASK_ID), "Markov head only"),
        ("sglang", dict(head="path", mask_token_id=MASK_ID), "no serving engine has a path-selector head"),
    ],
)
def test_serve_with_refuses_flags_that_cannot_export_exactly(engine, kw, words):
    kw = {"confidence_head": False, **kw}
    with pytest.raises(DominoError, match=words):
        arch_for_engine(engine, kw.pop("head"), kw.pop("mask_token_id"), **kw)


def test_cli_init_serve_with_refuses_before_loading_a_target(tmp_path, capsys):
    from dominospec.cli import main

    rc = main(["init", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d"), "--serve-with", "vllm"])
    assert rc == 2
    assert "--mask-token-id" in capsys.readouterr().err
    args = ["init", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d"), "--serve-with", "sglang"]
    assert main([*args, "--mask-token-id", "16", "--fuse-context"]) == 2
    assert "no serving engine reads the fused context row" in capsys.readouterr().err


def test_cli_export_writes_the_export_and_prints_the_serve_command(target, tmp_path, capsys):
    from dominospec.cli import main

    tdir = tmp_path / "tiny-target"
    target.model.save_pretrained(tdir)
    drafter = make_drafter(target, head="markov")
    drafter.save_pretrained(tmp_path / "drafter")
    rc = main(
        ["export", str(tmp_path / "drafter"), "--to", "vllm", "--out", str(tmp_path / "out"), "--target", str(tdir)]
    )
    assert rc == 0
    assert capsys.readouterr().out.startswith(f"vllm serve {tdir} --speculative-config")
    assert (tmp_path / "out" / "model.safetensors").exists()
    rc = main(
        [
            "export",
            str(tmp_path / "drafter"),
            "--to",
            "vllm",
            "--out",
            str(tmp_path / "o2"),
            "--target",
            str(tdir),
            "--mask-token-id",
            "7",
        ]
    )
    assert rc == 2 and "trained with mask token" in capsys.readouterr().err


# ----- opt-in: SGLang's own Domino rollout on the export -----
@pytest.mark.skipif(
    not os.environ.get("DOMINOSPEC_SGLANG_DOMINO_UTILS"),
    reason="set DOMINOSPEC_SGLANG_DOMINO_UTILS to sglang/srt/speculative/domino_utils.py to run SGLang's rollout",
)
def test_sglang_domino_rollout_reproduces_our_drafts_on_the_export(target, tmp_path):
    spec = importlib.util.spec_from_file_location("sglang_domino_utils", os.environ["DOMINOSPEC_SGLANG_DOMINO_UTILS"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    drafter = make_drafter(target, head="domino", block_size=6)
    export_drafter(drafter, "sglang", tmp_path / "out", target, dtype="fp32")
    replay = EngineReplay(tmp_path / "out", target)
    w, c = replay.w, replay.cfg["dflash_config"]
    h = drafter.config.hidden_size
    gru = nn.GRU(h, c["gru_hidden_dim"], bias=False, batch_first=True).double()
    gru.weight_ih_l0.data.copy_(w["prefix_gru.weight_ih_l0"])
    gru.weight_hh_l0.data.copy_(w["prefix_gru.weight_hh_l0"])
    e = c["emb_dim"]
    proj = nn.Sequential(nn.Linear(h + c["gru_hidden_dim"], e, bias=False), nn.SiLU(), nn.Linear(e, 64, bias=False))
    proj.double()
    proj[0].weight.data.copy_(w["embed_proj.0.weight"])
    proj[2].weight.data.copy_(w["embed_proj.2.weight"])
    embedding = nn.Embedding.from_pretrained(replay.embed)
    kwargs = dict(
        target_embedding=embedding,
        lm_head_weight=replay.lm_head,
        prefix_gru=gru,
        embed_proj=proj,
        vocab_size=64,
        shift_label=True,
    )
    params = inspect.signature(mod.domino_greedy_rollout).parameters
    if "candidate_pool_size" in params:
        kwargs["candidate_pool_size"] = (
            0  # the full vocabulary, as served with --speculative-domino-candidate-pool-size 0
        )
    if "in_cuda_graph" in params:  # 0.5.23
        kwargs["in_cuda_graph"] = False
    anchor_kw = "bonus_tokens" if "bonus_tokens" in params else "verified_ids"  # renamed across versions
    for seq in prompts(n=30):
        ours = our_rollout(drafter, target, seq)[0]
        hidden = replay.hidden(seq).unsqueeze(0)
        theirs = mod.domino_greedy_rollout(draft_hidden=hidden, **{anchor_kw: torch.tensor([seq[-1]])}, **kwargs)
        assert theirs.reshape(-1).tolist() == ours[: drafter.config.block_size - 1].tolist()


# ----- the shipped drafter -----
@pytest.mark.slow
@pytest.mark.integration
def test_shipped_drafter_exports_to_sglang_approximately_and_says_why(tmp_path):
    from dominospec import Target
    from dominospec.drafter import shipped_drafter_dir

    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    drafter = Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=target)
    for fmt in ("vllm", "speculators"):
        with pytest.raises(DominoError, match="no Domino head"):
            export_drafter(drafter, fmt, tmp_path / fmt, target, mask_token_id=3)
    with pytest.raises(DominoError, match="--mask-token-id"):
        export_drafter(drafter, "sglang", tmp_path / "s", target)
    rep = export_drafter(drafter, "sglang", tmp_path / "s", target, mask_token_id=3, allow_approx=True)
    assert rep["status"] == "approximate" and rep["proposals_per_block"] == 7
    text = " ".join(rep["approximations"])
    assert "widened" in text and "confidence head dropped" in text and "row 3" in text


def test_dspark_form_confidence_head_reads_z_alone_and_round_trips(target, tmp_path):
    drafter = make_drafter(target, head="markov", confidence=True, confidence_inputs="z")
    assert drafter.confidence.proj.weight.shape == (1, 32)
    z, e = torch.randn(2, 4, 32, dtype=torch.float64), torch.randn(2, 4, 32, dtype=torch.float64)
    assert torch.equal(drafter.confidence(z, e), drafter.confidence(z, torch.zeros_like(e)))
    drafter.save_pretrained(tmp_path / "d")
    again = Drafter.from_pretrained(tmp_path / "d")
    assert again.config.confidence_inputs == "z"
    with pytest.raises(DominoError, match="confidence_inputs"):
        DrafterConfig.for_target(target, confidence_inputs="z_markov")


def test_why_not_exact_names_the_first_obstacle(target):
    shipped_like = DrafterConfig.for_target(target, draft_vocab_size=40, confidence_head=True, mask_token_id=None)
    assert "--mask-token-id" in why_not_exact(shipped_like, "sglang")
    assert "no Domino head" in why_not_exact(shipped_like, "vllm")
    served = DrafterConfig.for_target(target, **arch_for_engine("vllm", None, MASK_ID, True), confidence_head=True)
    assert why_not_exact(served, "vllm") is None
