"""Verify-length policies: what they cut, that cutting stays lossless, and why the search stops at its first drop."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    PROMPTS,
    SAMPLING,
    assert_matches_target_distribution,
    confident_drafter,
    soft_target,
    tiny_drafter,
)

from dominospec import DominoError, SamplingConfig, generate_autoregressive, generate_speculative
from dominospec.bench import methods as bench_methods
from dominospec.bench import runner
from dominospec.decode import CostTable, Proposal, draft_block
from dominospec.decode.schedule import CostPolicy, StaticPolicy, TopCalibration, VerifyPolicy, allocate_verify
from dominospec.tune.policy import make_policy

# verifying k drafts costs verify[k] (k+1 new tokens); steep enough that the cost policy cuts blocks
COSTS = CostTable({0: [1.0, 1.25, 1.45, 1.7, 2.0]})


def logit(p):
    return math.log(p / (1 - p))


def row(context=0, greedy=False):
    """What a policy reads of a row: its context (committed tokens before the anchor) and its sampling."""
    return SimpleNamespace(committed_len=context + 1, sampling=SamplingConfig() if greedy else SamplingConfig(1.0))


def cut(policy, p, context=0, greedy=False) -> int:
    """The policy's verify length for one row proposing p."""
    return policy.verify_lengths([p], [row(context, greedy)])[0]


def proposal(confidences, source="drafter"):
    n = len(confidences)
    return Proposal(torch.arange(n), None, torch.tensor([logit(c) for c in confidences]), source=source)


# ----- confidence at inference -----


@pytest.mark.parametrize("head", ["domino", "none"])
def test_confidence_logits_travel_with_the_proposal_and_read_the_token_before_each_slot(head, qwen3_target):
    """c_k = sigmoid(w . [z_k ; embed(x_{a+k})]): slot 1 reads the anchor, slot k the draft before it."""
    target = qwen3_target
    drafter = confident_drafter(target, head=head)
    ids = torch.tensor([[3, 8, 1, 9, 22, 5]])
    feats = target.forward(ids, target.new_cache()).features
    cache = drafter.new_cache()
    anchor = ids[0, 5:6]
    with torch.inference_mode():
        drafter.extend_cache(cache, feats[:, :5])
        prop = draft_block(drafter, cache, anchor, 4, SamplingConfig(), None)
        z = drafter.backbone_block(cache, anchor)[0, :4]
        want = drafter.confidence(z, drafter.embed(torch.cat([anchor, prop.drafts[:-1]])))
    assert prop.confidence_logits.shape == (4,) and prop.source == "drafter"
    assert torch.allclose(prop.confidence_logits, want, atol=1e-12)


# ----- what each policy cuts -----


def test_static_stops_before_the_first_slot_under_the_threshold():
    policy = StaticPolicy(threshold=0.5)
    assert cut(policy, proposal([0.9, 0.8, 0.4, 0.9])) == 2  # slot 4 is confident, but after a stop
    assert cut(policy, proposal([0.3, 0.9])) == 0
    assert cut(policy, proposal([0.6, 0.7, 0.9])) == 3
    # temperatures act on the logits: T = 3 pulls 0.8 (logit 1.39) to 0.61, T = 0.2 pushes 0.4 to 0.12
    assert cut(StaticPolicy([1.0, 3.0, 0.2], threshold=0.65), proposal([0.9, 0.8, 0.4])) == 1
    # lookup confidences are running acceptance estimates: no temperatures
    assert cut(StaticPolicy([1.0, 3.0, 0.2], threshold=0.65), proposal([0.9, 0.8, 0.4], "lookup")) == 2
    assert cut(VerifyPolicy(), proposal([0.1, 0.1])) == 2


def test_cost_policy_adds_drafts_while_expected_tokens_per_second_rise():
    policy = CostPolicy(costs=COSTS)
    # survival 0.9, 0.81, 0.73, 0.66: rates 1, 1.52, 1.87, 2.03, 2.08 -> all four
    assert cut(policy, proposal([0.9] * 4)) == 4
    # survival 0.5, 0.25, ...: rates 1, 1.2, 1.21, 1.1 -> stops at the first drop, k = 2
    assert policy.rates([0.5, 0.25, 0.125, 0.0625])[:4] == pytest.approx([1.0, 1.2, 1.75 / 1.45, 1.875 / 1.7])
    assert cut(policy, proposal([0.5] * 4)) == 2
    assert cut(policy, proposal([0.1] * 4)) == 0
    # a draft cost paid every cycle makes longer verifies relatively cheaper
    heavy = CostPolicy(costs=CostTable(COSTS.verify_s, draft_s=3.0))
    assert cut(heavy, proposal([0.5] * 4)) > 2
    # the table limits the search: 2 new tokens profiled -> at most 1 draft
    assert cut(CostPolicy(costs=CostTable({0: [1.0, 1.01]})), proposal([0.99] * 4)) == 1


def test_cost_policy_uses_the_profiled_context_nearest_to_the_current_one():
    table = CostTable({64: [1.0, 1.1, 1.2], 1024: [1.0, 3.0, 4.0]})
    policy = CostPolicy(costs=table)
    assert cut(policy, proposal([0.7, 0.7]), context=50) == 2
    assert cut(policy, proposal([0.7, 0.7]), context=900) == 0


# ----- DSpark's counterexample: the search must stop at its first drop -----

P_T = torch.tensor([0.7, 0.3], dtype=torch.float64)  # the target's next-token distribution, every position
P_D = torch.tensor([0.5, 0.5], dtype=torch.float64)  # the drafter's
# c_1 does not depend on the drafts; c_2 reads d_1: confident after token 0, not after token 1
C1, C2 = 0.5, {0: 0.99, 1: 0.01}
COUNTER_COSTS = CostTable({0: [1.0, 1.6, 1.7]})  # verifying 1 draft never pays; 2 may


def first_token_distribution(choose_k) -> torch.Tensor:
    """Exact distribution of the first committed token of one cycle with two drafts, by enumeration.

    choose_k(proposal) -> drafts to verify; acceptance is Leviathan/Chen rejection sampling.
    """
    out = torch.zeros(2, dtype=torch.float64)
    residual = (P_T - P_D).clamp_min(0)
    residual = residual / residual.sum()
    for d1 in (0, 1):
        for d2 in (0, 1):
            weight = P_D[d1] * P_D[d2]
            k = choose_k(Proposal(torch.tensor([d1, d2]), None, torch.tensor([logit(C1), logit(C2[d1])])))
            if k == 0:  # nothing verified: the target's own token
                out += weight * P_T
                continue
            accept = min(1.0, float(P_T[d1] / P_D[d1]))
            out[d1] += weight * accept
            out += weight * (1 - accept) * residual
    return out


def test_search_past_the_first_drop_changes_the_output_distribution_and_ours_does_not():
    policy = CostPolicy(costs=COUNTER_COSTS)

    def full_search(p):  # the best k over the whole block: c_2 (which read d_1) decides whether d_1 is verified
        rates = policy.rates(torch.cumprod(policy.confidences(p), 0).tolist())
        return max(range(len(rates)), key=rates.__getitem__)

    assert [
        full_search(Proposal(torch.tensor([d, 0]), None, torch.tensor([logit(C1), logit(C2[d])]))) for d in (0, 1)
    ] == [2, 0]
    assert first_token_distribution(full_search) == pytest.approx(
        torch.tensor([0.85, 0.15], dtype=torch.float64), abs=1e-12
    )
    assert first_token_distribution(lambda p: cut(policy, p)) == pytest.approx(P_T, abs=1e-12)
    # the static rule looks at c_1..c_k only, so it is safe on the same example
    assert first_token_distribution(lambda p: cut(StaticPolicy(threshold=0.4), p)) == pytest.approx(P_T, abs=1e-12)


def test_greedy_rows_search_the_whole_curve_and_sampled_rows_stop_at_the_first_drop():
    """Protects: a greedy row (T=0) takes the best k of the whole curve, past a first drop (the first-drop
    rule would stop at 0 on the counterexample's confident block); a sampled row keeps the first drop,
    also when both share one batch."""
    confident = Proposal(torch.tensor([0, 0]), None, torch.tensor([logit(C1), logit(C2[0])]))
    assert cut(CostPolicy(costs=COUNTER_COSTS), confident) == 0
    assert cut(CostPolicy(costs=COUNTER_COSTS), confident, greedy=True) == 2
    # control: where the curve only falls, both stop at 0
    doubtful = Proposal(torch.tensor([1, 0]), None, torch.tensor([logit(C1), logit(C2[1])]))
    assert cut(CostPolicy(costs=COUNTER_COSTS), doubtful, greedy=True) == 0
    # one batch of two rows: the first candidate drops the rate (B 3 costs 3.0); a greedy row walks on
    seconds = {2: 2.0, 3: 3.0, 4: 2.5, 5: 3.5, 6: 4.0}.__getitem__
    survival = [[0.5, 0.495], [0.5, 0.495]]
    assert allocate_verify(survival, seconds) == [0, 0]
    assert allocate_verify(survival, seconds, greedy=[True, False]) == [2, 0]  # the sampled row stays at 0
    assert allocate_verify(survival, seconds, greedy=[True, True]) == [1, 1]


def test_cost_policy_skips_the_drafter_while_it_does_not_pay_probes_and_resumes():
    """Protects: with a running acceptance too low to pay for the draft, cycles become plain decode
    steps except for a probe every probe_every cycles; good outcomes bring drafting back."""
    policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]}, draft_s=0.2), block_size=3, probe_every=4)
    assert policy.wants_draft([row()])  # the uniform prior (0.5 per position) pays for the draft here
    for _ in range(10):
        policy.observe(proposal([0.5] * 3), verified=3, accepted=0)  # every first draft rejected
    assert [policy.wants_draft([row()]) for _ in range(8)] == [False, False, False, True] * 2
    assert policy.skipped == 6
    for _ in range(30):
        policy.observe(proposal([0.5] * 3), verified=3, accepted=3)
    assert policy.wants_draft([row()]) and policy.wants_draft([row()])
    policy.start()  # a new generation forgets the estimate
    assert policy.skipped == 0 and policy.acceptance.conditional(2) == [0.5, 0.5]
    # lookup outcomes do not move the drafter's estimate; without a draft cost there is nothing to skip
    policy.observe(proposal([0.5] * 3, "lookup"), verified=3, accepted=0)
    assert policy.acceptance.judged == []
    assert CostPolicy(costs=COSTS).wants_draft([row()])


class Row(SimpleNamespace):
    """A row as the policy sees one: itself (hashable by identity), as SeqState is."""

    __hash__ = object.__hash__


def test_cost_policy_skip_decision_reads_each_requests_own_acceptance():
    """Protects: a request whose drafts keep failing stops paying for a drafter pass while one whose drafts
    are accepted keeps drafting (one pooled estimate would give both the same answer); a request that has not
    drafted yet reads the pooled estimate."""
    policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]}, draft_s=0.2), block_size=3, probe_every=100)
    code, chat, new = (Row(**vars(row())) for _ in range(3))
    for _ in range(20):
        policy.observe(proposal([0.5] * 3), verified=3, accepted=3, row=code)
        policy.observe(proposal([0.5] * 3), verified=3, accepted=0, row=chat)
    assert policy.acceptance_of(code).conditional(1)[0] > 0.9 > 0.1 > policy.acceptance_of(chat).conditional(1)[0]
    assert policy.drafting_pays([code]) and not policy.drafting_pays([chat])
    assert policy.acceptance_of(new) is policy.acceptance  # nothing of its own yet
    assert policy.wants_draft([code, chat])  # the batch's pass pays for the request whose drafts land


def test_top_probability_calibration_learns_each_positions_acceptance():
    """Protects: the online logistic fit turns the draft's top probability into what each position's outcomes
    say (an overconfident slot 2 is pulled down, an underconfident slot 1 up), and a policy without a
    confidence head reads it."""
    cal = TopCalibration()
    top = torch.tensor([0.5, 0.9])
    torch.testing.assert_close(cal(top), top.double())  # before any outcome: the raw top probability
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):  # slot 1 accepted 90% of the time, slot 2 (when reached) 20%
        first = bool(torch.rand(1, generator=gen) < 0.9)
        second = first and bool(torch.rand(1, generator=gen) < 0.2)
        cal.record(top, verified=2, accepted=int(first) + int(second))
    c = cal(top)
    assert abs(c[0] - 0.9) < 0.05 and abs(c[1] - 0.2) < 0.07
    policy = CostPolicy(costs=COSTS, block_size=2)
    policy.top_calibration = cal
    p = Proposal(torch.tensor([1, 2]), draft_top=top)
    assert policy.survival(p) == pytest.approx(torch.cumprod(c, 0).tolist())


@pytest.mark.parametrize("informative", ["head", "top"])
def test_the_cost_policy_reads_the_confidence_that_predicted_better(informative):
    """Protects: for a drafter with a confidence head, the cost policy scores the head's and the top
    probability's estimates on every judged position (log loss, before learning the outcome) and, after its
    warm-up, reads the one that predicted the outcomes better; before the warm-up, the head."""
    policy = CostPolicy(costs=COSTS, block_size=1)
    gen = torch.Generator().manual_seed(1)
    assert policy.choice.choice == "head"
    for _ in range(400):
        accepted = bool(torch.rand(1, generator=gen) < 0.5)
        sharp, flat = (0.95 if accepted else 0.05), 0.5  # one estimate knows the outcome, the other does not
        head, top = (sharp, flat) if informative == "head" else (flat, sharp)
        p = Proposal(torch.tensor([1]), None, torch.tensor([logit(head)]), draft_top=torch.tensor([top]))
        policy.observe(p, verified=1, accepted=int(accepted))
    assert policy.choice.choice == informative
    p = Proposal(torch.tensor([1]), None, torch.tensor([logit(0.9)]), draft_top=torch.tensor([0.3]))
    expected = 0.9 if informative == "head" else float(policy.top_calibration(torch.tensor([0.3]))[0])
    assert policy.survival(p) == pytest.approx([expected])
    assert policy.describe()["confidence"].startswith(informative)


# ----- lossless end to end -----


def policies():
    return {
        "static": StaticPolicy(threshold=0.6),
        "cost": CostPolicy(costs=COSTS),  # greedy rows: the whole curve
    }


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["static", "cost"])
def test_scheduled_verification_keeps_greedy_output(family, mode, llama_target, qwen3_target):
    target = llama_target if family == "llama" else qwen3_target
    drafter = confident_drafter(target, block_size=4)
    verified = set()
    for prompt in PROMPTS:
        ref = generate_autoregressive(target, prompt, 30, eos_ids=[])
        for b in (2, 4):
            spec = generate_speculative(target, drafter, prompt, 30, block_size=b, eos_ids=[], verify=policies()[mode])
            assert spec.tokens == ref.tokens, (family, mode, b, prompt)
            assert all(a <= v <= b for a, v in zip(spec.accepted, spec.verified))
            verified.update(spec.verified)
    assert len(verified) >= 2 and min(verified) < 4  # the policy really cut blocks, to several lengths


def test_skipping_the_drafter_keeps_greedy_output(llama_target):
    """Protects: cycles the cost policy runs without drafts (plain decode steps) keep the output token
    for token the plain greedy output, interleaved with drafted cycles."""
    drafter = confident_drafter(llama_target, block_size=4)
    skipped = drafted = 0
    for prompt in PROMPTS:
        ref = generate_autoregressive(llama_target, prompt, 30, eos_ids=[])
        policy = CostPolicy(costs=CostTable(COSTS.verify_s, draft_s=0.6), block_size=4, probe_every=3)
        spec = generate_speculative(llama_target, drafter, prompt, 30, eos_ids=[], verify=policy)
        assert spec.tokens == ref.tokens, prompt
        skipped += spec.draft_skipped
        drafted += spec.cycles - spec.draft_skipped
    assert skipped > 0 and drafted > 0  # both kinds of cycle really ran


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "cost"])
def test_scheduled_verification_preserves_target_distribution(mode):
    target = soft_target()
    drafter = confident_drafter(target, block_size=3, seed=4, scale=3.0)
    policy = {"static": StaticPolicy(threshold=0.5), "cost": CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]}))}

    def run(seed):
        return generate_speculative(
            target, drafter, [1, 2, 3, 4], 3, SAMPLING, seed=seed, eos_ids=[], verify=policy[mode]
        )

    seen = assert_matches_target_distribution(run, target, [1, 2, 3, 4])
    assert seen["accepted_any"] > 50 and len(seen["verified"]) >= 2


@pytest.mark.slow
def test_skipping_the_drafter_preserves_target_distribution():
    """Protects: at T=1 the skip decision (from earlier cycles' outcomes only) keeps the target's
    distribution; both drafted and skipped cycles occur."""
    target = soft_target()
    drafter = confident_drafter(target, block_size=3, seed=4, scale=3.0)

    def run(seed):
        policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]}, draft_s=0.25), block_size=3, probe_every=3)
        return generate_speculative(target, drafter, [1, 2, 3, 4], 3, SAMPLING, seed=seed, eos_ids=[], verify=policy)

    seen = assert_matches_target_distribution(run, target, [1, 2, 3, 4])
    assert seen["draft_skipped"] > 50 and seen["accepted_any"] > 50


@pytest.mark.slow
def test_calibrated_top_probability_preserves_target_distribution():
    """Protects: at T=1 the cost policy on a drafter without a confidence head, reading the draft's top
    probability through the online calibration fit from earlier outcomes (one policy across the runs, so the
    fit moves), keeps the target's distribution."""
    target = soft_target()
    drafter = tiny_drafter(target, block_size=3, seed=4)
    policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]}), block_size=3)

    def run(seed):
        return generate_speculative(target, drafter, [1, 2, 3, 4], 3, SAMPLING, seed=seed, eos_ids=[], verify=policy)

    seen = assert_matches_target_distribution(run, target, [1, 2, 3, 4])
    assert seen["accepted_any"] > 50 and len(seen["verified"]) >= 2
    assert policy.top_calibration.a and policy.top_calibration.a[0] != 1.0  # the fit really moved


class PeekingPolicy(VerifyPolicy):
    """Wrong on purpose: verifies drafts only while each is one of the tokens the target likes most here,
    i.e. reads d_k to decide about d_k."""

    def verify_lengths(self, proposals, rows):
        ks = []
        for proposal in proposals:
            k = 0
            while proposal is not None and k < len(proposal) and int(proposal.drafts[k]) in (0, 1, 2, 3):
                k += 1
            ks.append(k)
        return ks


@pytest.mark.slow
def test_distribution_test_detects_a_policy_that_reads_the_draft_it_judges():
    target = soft_target()
    drafter = confident_drafter(target, block_size=3, seed=4, scale=3.0)

    def run(seed):
        return generate_speculative(
            target, drafter, [1, 2, 3, 4], 3, SAMPLING, seed=seed, eos_ids=[], verify=PeekingPolicy()
        )

    with pytest.raises(AssertionError, match="pvalue"):  # the chi-square itself, not a side check
        assert_matches_target_distribution(run, target, [1, 2, 3, 4])


# ----- building policies -----


def test_policies_refuse_without_a_confidence_head_and_fall_back_to_raw_confidences(llama_target, tmp_path):
    with pytest.raises(DominoError, match="confidence head"):
        make_policy("static", tiny_drafter(llama_target, block_size=4), llama_target)
    with pytest.raises(DominoError, match="no drafter"):
        make_policy("cost", None, llama_target, costs=COSTS)
    with pytest.raises(DominoError, match="threshold"):
        make_policy("static", None, llama_target, threshold=1.0)
    assert type(make_policy("fixed")) is VerifyPolicy
    drafter = confident_drafter(llama_target)
    said = []
    policy = make_policy("static", drafter, llama_target, report=said.append)
    assert policy.temperatures is None and len(said) == 1 and "raw confidences" in said[0]
    drafter.directory = tmp_path
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2.0, 2.5, 3.0]}))
    said.clear()
    policy = make_policy("cost", drafter, llama_target, costs=COSTS, report=said.append)
    assert policy.temperatures == [1.5, 2.0, 2.5, 3.0] and not said
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.5, -1, 2.5, 3.0]}))
    with pytest.raises(DominoError, match="calibration.json"):
        make_policy("static", drafter, llama_target)
    # prompt lookup alone may be scheduled by its own running acceptance
    assert make_policy("static", None, llama_target, lookup=True).name == "static"


def test_cost_without_a_device_profile_measures_a_quick_one(llama_target, tmp_path, monkeypatch):
    """Protects: --verify cost no longer refuses to run before `dominospec profile`; it says in one
    line that it measures a short table, stores it, and the next policy reuses it silently."""
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    said = []
    drafter = confident_drafter(llama_target)
    policy = make_policy("cost", drafter, llama_target, report=said.append)
    assert policy.name == "cost" and any("measuring a quick one" in s for s in said)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    said.clear()
    again = make_policy("cost", drafter, llama_target, report=said.append)
    assert not any("measuring" in s for s in said) and again.costs.verify_s == policy.costs.verify_s


# ----- the benchmark runs them side by side -----


def test_bench_runs_each_verify_policy_lookup_and_hybrid_side_by_side(llama_target, tmp_path):
    drafters = [
        ("conf", confident_drafter(llama_target, block_size=3)),
        ("plain", tiny_drafter(llama_target, head="none", block_size=2, seed=5)),
    ]
    notes_said = []
    methods, notes = bench_methods.build_methods(
        ["drafters", "lookup", "hybrid", "sweep"],
        drafters,
        verify=runner.parse_verify("fixed,static,cost"),
        target=llama_target,
        costs=COSTS,
        threshold=0.6,
    )
    notes_said += notes
    names = [m.name for m in methods]
    assert names == [
        "ar",
        "lookup-b8",
        "lookup-b8-static",
        "lookup-b8-cost",
        "domino-2L-b3",
        "domino-2L-b3-static",
        "domino-2L-b3-cost",
        "hybrid-domino-2L-b3",
        "hybrid-domino-2L-b3-static",
        "hybrid-domino-2L-b3-cost",
        "domino-2L-b1",
        "domino-2L-b2",
        "none-2L-b2",
        "none-2L-b2-cost",  # cost without a confidence head reads the draft's own top probability
        "hybrid-none-2L-b2",
        "hybrid-none-2L-b2-cost",
        "none-2L-b1",
    ]
    assert any("none-2L-b2-static: skipped" in n and "confidence head" in n for n in notes_said)
    with pytest.raises(DominoError, match="--verify"):
        runner.parse_verify("fixed,greedy")
    datasets = {"loop": [[5, 9, 11, 2, 7, 8, 30, 4, 4, 17]], "short": [[1, 2, 3]]}
    res = runner.benchmark(llama_target, datasets, methods, tmp_path, max_new_tokens=16, progress=False, plots=False)
    for name, m in res["methods"].items():
        assert m["lossless_mismatches"] == 0, name
        if name != "ar":
            assert 0 <= m["wasted_per_cycle"] <= m["verified_per_cycle"] <= m["block_size"], name
    assert res["methods"]["ar"]["verified_per_cycle"] is None
    assert 0 < res["methods"]["lookup-b8"]["lookup_cycle_share"] <= 1  # the rest: no match, one plain step
    assert res["methods"]["domino-2L-b3"]["verified_per_cycle"] == 3.0
    assert res["methods"]["domino-2L-b3-cost"]["verified_per_cycle"] < 3.0
    assert "| verified/cycle | wasted/cycle |" in (tmp_path / "report.md").read_text()
    cfg = {m["name"]: m for m in res["config"]["methods"]}
    assert cfg["domino-2L-b3-static"]["confidence_threshold"] == 0.6
    assert cfg["hybrid-domino-2L-b3"]["hybrid_lookup_min_match"] == 3


def test_cost_policy_starts_from_the_drafters_measured_acceptance(llama_target, tmp_path):
    """acceptance.json (what `--block-size auto` reads) is the running estimate's prior: a drafter measured
    to be rarely accepted is not drafted for from the first cycle on; without the file, 0.5 everywhere."""
    drafter = confident_drafter(llama_target)
    costs = CostTable(COSTS.verify_s, draft_s=0.1)
    fresh = make_policy("cost", drafter, llama_target, costs=costs)
    assert fresh.acceptance.conditional(2) == [0.5, 0.5] and fresh.wants_draft([row()])
    drafter.directory = tmp_path
    (tmp_path / "acceptance.json").write_text(json.dumps({"conditional": [0.05, 0.1, 0.1, 0.1]}))
    policy = make_policy("cost", drafter, llama_target, costs=costs)
    assert policy.acceptance.conditional(2) == pytest.approx([0.05, 0.1])
    assert not policy.wants_draft([row()])
    for _ in range(40):  # then the live outcomes take over
        policy.acceptance.record(4, 4)
    assert policy.acceptance.conditional(1)[0] > 0.9 and policy.wants_draft([row()])
