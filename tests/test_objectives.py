"""Training objectives of issue 32 item 3: each against a hand-computed value, and each trains a tiny
drafter whose loss falls."""

import json
import math

import pytest
import torch
from conftest import synthetic_samples, tiny_drafter

from dominospec import DominoError
from dominospec.train.blocks import IGNORE
from dominospec.train.objectives import acceptance_loss, dpace_factors, entropy_selection
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


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("position_weighting", "linear", "--position-weighting"),
        ("accept_loss", 1.5, "--accept-loss"),
        ("entropy_keep", 0.0, "--entropy-keep"),
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
