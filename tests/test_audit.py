"""Audit: the bugs that made other DFlash-family trainers look like "low tau with little data".

Each test protects one property whose violation trains a drafter that looks merely weak: it
fails when the property breaks. The last test replays a live greedy run the training way and
demands the same accepted count in every cycle.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_drafter, tiny_target

from dominospec import generate_speculative
from dominospec.data.prepare import ChatCodec, PrepareConfig, regenerate_batch
from dominospec.data.prompts import Conversation
from dominospec.train.blocks import IGNORE, anchor_candidates, make_blocks, teacher_forced_blocks
from dominospec.train.trainer import TrainConfig, Trainer
from dominospec.train.validate import accepted_lengths, greedy_hits

B = 4


def features_of(target, ids, layer_ids):
    """Feature rows [S, n*H] of one sequence from a cached prefill (the decoding path)."""
    return target.forward(torch.tensor([ids]), target.new_cache(), layer_ids=layer_ids).features[0]


# ----- 1. a block never sees target states at or after its anchor -----


def test_many_overlapping_blocks_equal_cached_inference_and_ignore_states_from_their_anchor_on(qwen3_target):
    """forward_blocks with a block at every position equals one cached backbone_block per anchor,
    and perturbing the feature row at p changes exactly the blocks anchored after p."""
    target = qwen3_target
    d = tiny_drafter(target, head="domino", block_size=B)
    torch.manual_seed(0)
    ids = torch.randint(1, target.vocab_size - 1, (19,))
    feats = features_of(target, ids.tolist(), d.config.target_layer_ids).unsqueeze(0)  # [1, S, n*H]
    anchors = torch.arange(ids.shape[0])  # every position, so blocks overlap as much as they can
    with torch.no_grad():
        z = d.forward_blocks(feats, anchors, ids[anchors])
        for a in anchors.tolist():
            cache = d.new_cache()
            d.extend_cache(cache, feats[:, :a])
            assert torch.allclose(d.backbone_block(cache, ids[a : a + 1])[0], z[a], atol=1e-10), a
        for p in (0, 5, 11, 18):
            bent = feats.clone()
            bent[:, p] = torch.randn_like(bent[:, p]) * 3
            zb = d.forward_blocks(bent, anchors, ids[anchors])
            for a in anchors.tolist():
                moved = float((zb[a] - z[a]).abs().max())
                if a <= p:
                    assert moved < 1e-12, f"block at {a} saw the feature row at {p} (moved {moved})"
                else:
                    assert moved > 1e-6, f"block at {a} ignores the context row at {p}"


def test_tokens_from_a_slots_label_on_never_reach_it(qwen3_target):
    """End to end (padded target feature pass -> backbone -> teacher-forced head): changing the token at
    p > a leaves slots 0..p-a-1 of the block anchored at a unchanged (slot p-a-1 is labelled x_p) and
    changes slot p-a, which reads x_p."""
    target = qwen3_target
    d = tiny_drafter(target, head="domino", block_size=B)
    torch.manual_seed(1)
    seq = torch.randint(1, target.vocab_size - 1, (18,)).tolist()
    partner = torch.randint(1, target.vocab_size - 1, (23,)).tolist()  # a longer batch mate pads seq
    a = 7

    def final(s):
        feats = target.sequence_features([s, partner], d.config.target_layer_ids)[0][0]
        with torch.no_grad():
            return teacher_forced_blocks(d, feats, torch.tensor(s), torch.ones(len(s)), torch.tensor([a])).final[0]

    ref = final(seq)
    for p in range(a + 1, a + B + 1):
        changed = list(seq)
        changed[p] = (seq[p] + 1) % target.vocab_size
        got = final(changed)
        k = p - a - 1
        assert float((got[: k + 1] - ref[: k + 1]).abs().max()) < 1e-12, f"slot <= {k} saw x_{p}"
        if k + 1 < B:
            assert float((got[k + 1] - ref[k + 1]).abs().max()) > 1e-6, f"slot {k + 1} ignores x_{p}"


# ----- 2. labels and positions -----


def test_rope_positions_are_absolute_positions(qwen3_target, monkeypatch):
    """Context rows rotate at 0..S-1, a block anchored at a at a..a+B-1, in training and in decoding."""
    import dominospec.drafter.model as model_module

    seen = []
    real = model_module.rope_tables
    monkeypatch.setattr(model_module, "rope_tables", lambda pos, *rest: seen.append(pos.tolist()) or real(pos, *rest))
    d = tiny_drafter(qwen3_target, head="none", block_size=B)
    feats = torch.randn(1, 12, len(d.config.target_layer_ids) * qwen3_target.hidden_size, dtype=torch.float64)
    ids = torch.arange(1, 13)
    with torch.no_grad():
        d.forward_blocks(feats, torch.tensor([3, 7]), ids[[3, 7]])
        assert seen == [[list(range(12))], [[3, 4, 5, 6, 7, 8, 9, 10]]]
        seen.clear()
        cache = d.new_cache()
        d.extend_cache(cache, feats[:, :5])
        d.extend_cache(cache, feats[:, 5:7])
        d.backbone_block(cache, ids[7:8])
    assert seen == [[[0, 1, 2, 3, 4]], [[5, 6]], [[7, 8, 9, 10]]]


def test_training_step_labels_slot_k_with_the_token_at_anchor_plus_1_plus_k(qwen3_target, tmp_path, monkeypatch):
    """Through Trainer.sequence_terms: an oracle whose slot k at anchor a outputs x_{a+1+k} has zero loss
    and simulated tau B+1. Any shift between slots and labels would score it tau 1."""
    target = qwen3_target
    d = tiny_drafter(target, head="none", block_size=B, randomize_head=False)
    ids = [3 + i for i in range(20)]  # distinct tokens: token = 3 + position
    sample = {"id": "x", "input_ids": ids, "loss_mask": [0] * 4 + [1] * 16}
    trainer = Trainer(target, d, [sample], tmp_path, TrainConfig(max_steps=1), progress=False)

    def oracle_blocks(features, anchor_pos, anchor_ids):  # z[n, k, 0] = the position slot k should predict
        z = torch.zeros(anchor_pos.shape[0], B, target.hidden_size)
        z[..., 0] = (anchor_pos.unsqueeze(1) + 1 + torch.arange(B)).float()
        return z

    def oracle_logits(z):
        out = torch.zeros(*z.shape[:-1], target.vocab_size)
        return out.scatter_(-1, (3 + z[..., :1].long()), 1e4)

    monkeypatch.setattr(d, "forward_blocks", oracle_blocks)
    monkeypatch.setattr(d, "base_logits", oracle_logits)
    feats = torch.zeros(len(ids), len(d.config.target_layer_ids) * target.hidden_size)
    _, terms, stats = trainer.sequence_terms(0, feats, None, torch.tensor([4, 9, 15]), 0.0)
    assert stats["tau_greedy"] == B + 1 and float(terms["ce"]) < 1e-6


# ----- 3. the drafter's base logits are the target's own LM head -----


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("draft_vocab", [0, 40], ids=["full-vocab", "draft-vocab"])
def test_base_logits_use_the_targets_lm_head(tied, draft_vocab):
    target = tiny_target("llama", tied=tied)
    head = target.output_embeddings().weight
    assert (head.data_ptr() == target.embed_weight.data_ptr()) == tied
    d = tiny_drafter(target, head="none", block_size=B, draft_vocab=draft_vocab)
    rows = (lambda w: w[d.draft_vocab]) if draft_vocab else (lambda w: w)
    torch.manual_seed(0)
    z = torch.randn(2, B, target.hidden_size, dtype=torch.float64)
    assert torch.allclose(d.base_logits(z), F.linear(z, rows(head)), atol=1e-12)
    # another target of the same shape: attaching to it changes the base logits to its head
    other = tiny_target("llama", tied=tied, seed=5)
    d.attach(other)
    other_head = other.output_embeddings().weight
    assert not torch.allclose(rows(other_head), rows(head))
    assert torch.allclose(d.base_logits(z), F.linear(z, rows(other_head)), atol=1e-12)
    if not draft_vocab:  # no copy is taken: a change to the target's head shows at once
        with torch.no_grad():
            other_head.mul_(-0.5)
        assert torch.allclose(d.base_logits(z), F.linear(z, other_head), atol=1e-12)


# ----- 4. feature layers: decoder-layer outputs, the same in training and in decoding -----


def decoder_layer_outputs(model, ids):
    """{j: output of decoder layer j [S, H]} captured by hooks on the layer modules (no hidden_states indexing)."""
    captured = {}
    hooks = [
        layer.register_forward_hook(lambda m, i, o, j=j: captured.__setitem__(j, o[0] if isinstance(o, tuple) else o))
        for j, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return {j: out[0] for j, out in captured.items()}


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_feature_layers_are_decoder_layer_outputs_in_training_and_decoding(backend):
    target = tiny_target("llama", backend=backend)
    assert target.backend == backend
    layers = target.layer_ids
    assert 0 in layers and target.num_layers - 2 in layers  # both ends of the usable range
    torch.manual_seed(2)
    seq = torch.randint(1, 63, (15,)).tolist()
    short = seq[:9]
    ref = decoder_layer_outputs(target.model, seq)
    want = torch.cat([ref[j] for j in layers], dim=-1)  # [S, n*H]
    # decoding pass: prefill, a verify-sized chunk and single steps through the cache
    cache = target.new_cache()
    parts = [
        target.forward(torch.tensor([seq[lo:hi]]), cache, layer_ids=layers).features[0]
        for lo, hi in ((0, 6), (6, 11), (11, 12), (12, 15))
    ]
    assert torch.allclose(torch.cat(parts), want, atol=1e-9)
    # training pass: right-padded batch (the trainer's and the validator's layout)
    got = target.sequence_features([short, seq], layers)[0]
    assert torch.allclose(got[1], want, atol=1e-9)
    assert torch.allclose(
        got[0], torch.cat([decoder_layer_outputs(target.model, short)[j] for j in layers], -1), atol=1e-9
    )


# ----- 5. EOS / end of turn is supervised -----


def test_sampled_answers_keep_their_end_of_turn_token(monkeypatch):
    """Every id the target lists as an end (generation config, model config) cuts an answer, and is kept."""
    target = tiny_target("llama")
    target.model.generation_config.eos_token_id = [9, 63]
    assert target.eos_ids == [9, 63]
    rows = [[5, 6, 9, 7, 7], [4, 63, 0, 0, 0], [8, 8, 8, 8, 8]]

    def fake_generate(ids, attention_mask=None, **kw):
        return torch.cat([ids, torch.tensor(rows)], dim=1)

    monkeypatch.setattr(target.model, "generate", fake_generate)
    assert target.sample_batch([[1, 2], [3], [1]], 5) == [[5, 6, 9], [4, 63], [8, 8, 8, 8, 8]]


class ScriptedTarget:
    """Answers each turn with fixed tokens ending in EOS (63)."""

    eos_ids = (63,)
    max_positions = None  # no context limit: nothing is cut

    def __init__(self, answers):
        self.answers = list(answers)

    def sample_batch(self, prompts, *args, **kwargs):
        return [self.answers.pop(0) for _ in prompts]


def test_end_of_turn_is_supervised_and_gets_a_block_label():
    # render: BOS, then per user turn [user, text, assistant-start], per answer its ids (from the text)
    codec = ChatCodec(
        encode=lambda msgs: (
            [1] + [t for m in msgs for t in ([2, 10, 3] if m["role"] == "user" else map(int, m["content"].split()))]
        ),
        decode=lambda ids: " ".join(map(str, ids)),
    )
    target = ScriptedTarget([[20, 21, 22, 63], [30, 31, 63]])
    samples, _ = regenerate_batch(
        target,
        codec,
        [Conversation(("q1", "q2"), "c:0")],
        0,
        PrepareConfig(max_new_tokens=8, batch_size=1, shard_size=1),
    )
    [s] = samples  # the second render extends the first: one sample with both answers
    ids, mask = torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])
    eos_at = [i for i, t in enumerate(s["input_ids"]) if t == 63]
    assert len(eos_at) == 2 and all(mask[i] == 1 for i in eos_at), s
    cand = anchor_candidates(mask).tolist()
    assert all(i - 1 in cand for i in eos_at)  # the token before each EOS anchors a block
    _, labels = make_blocks(ids, mask, torch.tensor([i - 1 for i in eos_at]), B)
    assert labels[:, 0].tolist() == [63, 63]  # ... whose slot 0 is labelled EOS
    assert labels[0, 1].item() == IGNORE  # the next user turn is not supervised


# ----- 6. replay: the training path reproduces a live greedy run cycle by cycle -----


def make_the_head_read_its_tokens(drafter, seed=7):
    """A fresh head's recurrent state barely moves its logits; scale its weights so that reading a
    wrong token (or the right one at the wrong slot) changes the drafts."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.head.named_parameters():
            if not name.startswith("w2"):  # w2 is already randomized by tiny_drafter
                gain = 10.0 if name.split(".")[0] in ("gru_ih", "w1") else 2.0  # token inputs are small
                p.normal_(std=gain / p.shape[-1] ** 0.5)


@pytest.mark.parametrize("head,draft_vocab", [("domino", 0), ("domino", 40), ("rnn", 0), ("none", 0)])
def test_teacher_forced_replay_equals_live_greedy_acceptance(head, draft_vocab, qwen3_target, monkeypatch):
    """Per cycle of generate_speculative: the training-path greedy hits at that cycle's anchor, on the
    final output, accept exactly as many drafts as the live run did; and run on the live drafts
    themselves, the training path proposes every one of them."""
    from dominospec.decode import proposers

    target = qwen3_target
    d = tiny_drafter(target, head=head, block_size=B, draft_vocab=draft_vocab)
    make_the_head_read_its_tokens(d)
    drafts = []
    real = proposers.draft_block

    def recording_draft_block(*args, **kwargs):
        proposal = real(*args, **kwargs)
        drafts.append(proposal.drafts.tolist())
        return proposal

    monkeypatch.setattr(proposers, "draft_block", recording_draft_block)
    layers = d.config.target_layer_ids
    cycles, accepted = 0, []
    for prompt in ([1, 2, 3], [5, 9, 11, 2, 7, 8, 30, 4, 4, 17]):
        drafts.clear()
        res = generate_speculative(target, d, prompt, 48, eos_ids=[])
        seq = prompt + res.tokens
        anchors = [len(prompt) + sum(res.committed[:i]) for i in range(res.cycles)]
        assert len(drafts) == res.cycles
        mask = torch.tensor([0] * len(prompt) + [1] * len(res.tokens))
        # the last cycles may have accepted drafts past the output's end, which the replay cannot see
        seen = [min(n, len(seq) - 1 - a) for n, a in zip(res.accepted, anchors)]
        feats = target.sequence_features([seq], layers)[0][0]
        with torch.no_grad():
            tf = teacher_forced_blocks(d, feats, torch.tensor(seq), mask, torch.tensor(anchors))
            hit, _ = greedy_hits(d, tf)
            assert accepted_lengths(hit).tolist() == seen
            # the live drafts as the "true" tokens after each anchor: every slot must propose them
            own = [seq[: anchors[i] + 1] + drafts[i] for i in range(res.cycles)]
            own_feats = target.sequence_features(own, layers)[0]
            for i, (s, f) in enumerate(zip(own, own_feats)):
                tf = teacher_forced_blocks(d, f, torch.tensor(s), torch.ones(len(s)), torch.tensor([anchors[i]]))
                assert d.to_target_ids(tf.final[0].argmax(-1)).tolist() == drafts[i], i
        cycles += res.cycles
        accepted += res.accepted
    assert cycles >= 40 and max(accepted) >= 1, accepted  # some drafts accepted: the hits are tested too
