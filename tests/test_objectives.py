"""Training objectives of issue 32 item 3: each against a hand-computed value, and each trains a tiny
drafter whose loss falls."""

import json
import math

import pytest
import torch
from conftest import synthetic_samples, tiny_drafter

from dominospec import DominoError
from dominospec.train.blocks import IGNORE, anchor_candidates, first_misses, replay_anchors
from dominospec.train.objectives import acceptance_loss, dpace_factors, entropy_selection, greedy_labels
from dominospec.train.trainer import TrainConfig, Trainer


def logits_of(rows: list[list[float]]) -> torch.Tensor:
    """[1, B, V] logits whose softmax is the given probability rows."""
    return torch.tensor(rows, dtype=torch.float64).log().unsqueeze(0)


def test_dpace_weighs_each_slot_by_half_plus_half_its_survival():
    # the drafter gives its label 0.5 at slot 0, 0.25 at slot 1: the draft reaches slot 1 with
    # chance 0.5, slot 2 with 0.5 * 0.25 = 0.125
    final = logits_of([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    labels = torch.tensor([[0, 3, 1]])
    assert dpace_factors(final, labels, IGNORE)[0].tolist() == pytest.approx([1.0, 0.75, 0.5625])
    # an unsupervised slot ends what can survive: the slots after it weigh one half
    cut = torch.tensor([[0, IGNORE, 1]])
    assert dpace_factors(final, cut, IGNORE)[0].tolist() == pytest.approx([1.0, 0.75, 0.5])


def test_acceptance_loss_is_minus_log_of_the_shared_mass():
    final = logits_of([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]])
    # slot 0: sum min([.5,.3,.2], [.2,.5,.3]) = .2+.3+.2 = 0.7; slot 1: the target puts 0.1 outside
    # the draft vocabulary, which no draft can win: sum min([.1,.6,.2], [.2,.5,.3]) = 0.8
    p_t = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.2]]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 0.5]])
    want = -math.log(0.7) * 1.0 - math.log(0.8) * 0.5
    assert float(acceptance_loss(final, p_t, weights)) == pytest.approx(want)


def test_entropy_selection_keeps_the_slots_the_target_is_least_sure_of():
    p_t = torch.tensor(
        [
            [
                [1.0, 0.0, 0.0, 0.0],  # entropy 0
                [0.25, 0.25, 0.25, 0.25],  # log 4, the highest
                [0.5, 0.5, 0.0, 0.0],  # log 2 = 0.69
                [0.7, 0.1, 0.1, 0.1],  # -(0.7 log 0.7 + 0.3 log 0.1) = 0.94
                [0.25, 0.25, 0.25, 0.25],  # high, but unsupervised: never chosen
            ]
        ]
    )
    weights = torch.tensor([[1.0, 1.0, 0.5, 1.0, 0.0]])
    kept = entropy_selection(p_t, weights, keep=0.5)
    assert kept.tolist() == [[0.0, 2.0, 0.0, 2.0, 0.0]]  # the top 2 of 4 supervised slots, scaled by 1 / 0.5
    assert entropy_selection(p_t, weights, keep=1.0) is weights


def test_greedy_labels_are_the_targets_most_likely_draft_token_where_supervised():
    p_t = torch.tensor([[[0.1, 0.6, 0.2, 0.0], [0.9, 0.0, 0.0, 0.1], [0.3, 0.1, 0.0, 0.4]]])  # row 2 sums below 1
    labels = torch.tensor([[2, IGNORE, 0]])
    assert greedy_labels(labels, p_t, IGNORE).tolist() == [[1, IGNORE, 3]]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("position_weighting", "linear", "--position-weighting"),
        ("accept_loss", 1.5, "--accept-loss"),
        ("entropy_keep", 0.0, "--entropy-keep"),
        ("replay", 1.0, "--replay"),
    ],
)
def test_objective_options_are_range_checked(field, value, message):
    with pytest.raises(DominoError, match=message):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(
    "options, term",
    [
        ({"position_weighting": "dpace"}, "ce_final"),
        ({"accept_loss": 1.0}, "lk"),  # mixed with the CE at 0.5 the CE leads on the toy target (see docs)
        ({"entropy_keep": 0.5}, "ce_final"),
        ({"replay": 0.5}, "ce_final"),
        ({"greedy_labels": True, "distill": 0.5}, "ce_final"),
    ],
)
def test_each_objective_trains_a_tiny_drafter_whose_loss_falls(options, term, tmp_path, qwen3_target):
    samples = synthetic_samples(qwen3_target, n=8, answer_len=24)
    d = tiny_drafter(qwen3_target, head="domino", block_size=4, randomize_head=False).float()
    cfg = TrainConfig(max_steps=30, batch_size=4, anchors=8, lr=3e-3, save_every=1000, **options)
    Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False).fit()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = (sum(r[term] for r in rs) / len(rs) for rs in (recs[:5], recs[-5:]))
    assert last < 0.7 * first, (term, first, last)


def test_first_misses_are_where_a_greedy_verify_rejects():
    """Protects: on-policy replay records, per block, only the position of the first draft a greedy verify
    rejects (slots before it hit); a block that hits to its last label, or whose first miss has no label,
    records nothing."""
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, IGNORE, 3]])
    picks = torch.tensor([[1, 0, 3], [1, 2, 3], [0, 2, 3], [1, 0, 0]])  # miss at slot 1; none; slot 0; unlabelled
    final = torch.nn.functional.one_hot(picks, 5).float()
    assert first_misses(final, labels, torch.tensor([10, 20, 30, 40])) == [11, 30]


def test_replay_anchors_take_their_share_from_the_misses():
    """Protects: replay draws round(share x n) anchors from the recorded misses that are still anchor candidates,
    the rest from the other candidates, without duplicates."""
    import random

    mask = torch.tensor([0, 0] + [1] * 30)
    cand = set(anchor_candidates(mask).tolist())
    missed = [5, 9, 12, 20, 0]  # 0 is no candidate (its token is not supervised)
    a = replay_anchors(mask, 8, missed, 0.5, random.Random(0)).tolist()
    assert len(a) == len(set(a)) == 8 and set(a) <= cand
    assert len(set(a) & {5, 9, 12, 20}) >= 4


def test_a_replay_run_anchors_where_its_drafts_were_rejected(tmp_path, qwen3_target):
    """Protects: with --replay the trainer records, per trained sample, exactly the first-miss positions of its
    blocks, and the next epoch draws that share of the sample's anchors from them."""
    samples = synthetic_samples(qwen3_target, n=4, answer_len=24)
    d = tiny_drafter(qwen3_target, head="domino", block_size=4, randomize_head=False).float()
    cfg = TrainConfig(max_steps=2, batch_size=4, anchors=6, lr=1e-3, save_every=1000, replay=0.5)
    trainer = Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False)
    trainer.train_step()
    assert trainer.missed and set(trainer.missed) <= set(range(len(samples)))
    for i, positions in trainer.missed.items():
        assert set(positions) <= set(anchor_candidates(torch.tensor(samples[i]["loss_mask"])).tolist()) | {
            len(samples[i]["input_ids"]) - 1
        }
    recorded = {i: set(p) for i, p in trainer.missed.items()}
    seen = {}
    original = trainer.__class__._packed_terms

    def spy(self, batch, den, lam):
        for i, (anchors, _, _) in batch:
            seen.setdefault(i, set()).update(anchors.tolist())
        return original(self, batch, den, lam)

    trainer.__class__._packed_terms = spy
    try:
        trainer.step += 1  # the next step is the next epoch (4 samples, batch 4)
        trainer.train_step()
    finally:
        trainer.__class__._packed_terms = original
    for i, positions in recorded.items():
        candidates = positions & set(anchor_candidates(torch.tensor(samples[i]["loss_mask"])).tolist())
        assert len(seen[i] & candidates) >= min(len(candidates), 3), (i, candidates, seen[i])
