"""The batched engine: a request's output never depends on the batch, slots are reused, the scheduler
allocates verify budgets as DSpark's Algorithm 1, and the caller's surface (queue, cancel, errors) holds."""

import math
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_matches_distribution, exact_distribution, tiny_drafter, tiny_target

from dominospec import DominoError, SamplingConfig, Target, generate_autoregressive, generate_speculative
from dominospec.decode import CostTable, PromptLookup, Proposal
from dominospec.decode.schedule import BatchCostTable, CostPolicy, VerifyPolicy, allocate_verify
from dominospec.engine import Engine, EngineFull, EngineRequest
from dominospec.engine.memory import slot_bytes_needed
from dominospec.tune.policy import make_policy
from dominospec.tune.spec import SpecConfig

GREEDY, T1 = SamplingConfig(), SamplingConfig(1.0)
ROW, SAMPLED = SimpleNamespace(committed_len=1, sampling=GREEDY), SimpleNamespace(committed_len=1, sampling=T1)
COSTS = CostTable({0: [1.0, 1.1, 1.2, 1.35, 1.5, 1.7]})  # cheap extra tokens: the cost policy verifies some


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", backend="native")


@pytest.fixture(scope="module")
def drafter(target):
    d = tiny_drafter(target, head="domino", block_size=4, confidence=True)
    with torch.no_grad():  # confidences that vary from slot to slot
        torch.nn.init.normal_(d.confidence.proj.weight, std=2.0 / math.sqrt(d.confidence.proj.in_features))
    return d


def engine_for(kind, target, drafter, **kw):
    """plain / fixed / static / cost with the drafter; lookup alone; hybrid (drafter + lookup)."""
    if kind == "plain":
        return Engine(target, **kw)
    if kind == "lookup":
        return Engine(target, lookup=True, policy="fixed", **kw)
    if kind == "hybrid":
        return Engine(target, drafter, lookup=True, policy="fixed", **kw)
    if kind == "lookup-cost":
        return Engine(target, lookup=True, policy="cost", costs=COSTS, **kw)
    if kind == "hybrid-cost-skipping":  # a dear draft pass: many steps run on the lookup's copies alone
        return Engine(target, drafter, lookup=True, policy="cost", costs=CostTable(COSTS.verify_s, 1.0), **kw)
    return Engine(target, drafter, policy=kind, costs=COSTS if kind == "cost" else None, **kw)


def run_one(engine, prompt, budget, sampling, seed, eos=()):
    h = engine.submit(EngineRequest(prompt, budget, sampling, seed=seed, eos_ids=list(eos)))
    engine.run_until_idle()
    return h.wait(0)


# ----- output equals the batch-1 loops -----


@pytest.mark.parametrize(
    "kind,sampling",
    [("plain", GREEDY), ("plain", T1), ("fixed", T1), ("lookup", T1), ("hybrid", GREEDY), ("cost", T1)],
)
def test_one_request_through_the_engine_equals_the_batch1_loop(kind, sampling, target, drafter):
    prompt = [5, 9, 11, 2, 7, 8, 30, 4, 4, 17, 5, 9, 11]
    got = run_one(engine_for(kind, target, drafter, max_batch=2), prompt, 40, sampling, seed=7)
    if kind == "plain":
        ref = generate_autoregressive(target, prompt, 40, sampling, seed=7, eos_ids=[])
        assert got.cycles == 0 and got.accepted == []
    else:
        policy = engine_for("cost", target, drafter).policy if kind == "cost" else None  # the engine's own policy
        ref = generate_speculative(
            target,
            None if kind == "lookup" else drafter,
            prompt,
            40,
            sampling,
            seed=7,
            eos_ids=[],
            lookup=PromptLookup() if kind in ("lookup", "hybrid") else None,
            verify=policy,
        )
        assert got.accepted == ref.accepted and got.verified == ref.verified and got.cycles == ref.cycles > 0
    assert got.tokens == ref.tokens and got.finish_reason == "length"


@pytest.mark.parametrize(
    "kind", ["plain", "fixed", "static", "cost", "lookup", "hybrid", "lookup-cost", "hybrid-cost-skipping"]
)
def test_mixed_batch_gives_every_greedy_request_its_batch1_output(kind, target, drafter):
    """Different prompt lengths, budgets and sampling settings; rows join mid-run, leave at EOS or budget."""
    engine = engine_for(kind, target, drafter, max_batch=3, prefill_chunk=4)
    reqs = [
        ([1, 2, 3], 20, GREEDY, ()),
        ([5, 9, 11, 2, 7, 8, 30, 4, 4, 17], 9, SamplingConfig(0.8, top_p=0.9), ()),
        ([4, 4, 4, 4, 4, 4], 30, GREEDY, ()),
        ([7], 12, T1, ()),
        ([9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 13, 14, 15], 25, GREEDY, ()),
    ]
    first = generate_autoregressive(target, [2, 6, 2, 6], 30, eos_ids=[]).tokens
    reqs.append(([2, 6, 2, 6], 30, GREEDY, (first[10],)))  # leaves at its EOS, mid-block
    handles = [
        engine.submit(EngineRequest(p, m, s, seed=i, eos_ids=list(e))) for i, (p, m, s, e) in enumerate(reqs[:4])
    ]
    for _ in range(5):
        engine.step()
    late = [engine.submit(EngineRequest(p, m, s, seed=9, eos_ids=list(e))) for p, m, s, e in reqs[4:]]
    engine.run_until_idle()
    for (prompt, budget, sampling, eos), h in zip(reqs, handles + late):
        got = h.wait(0)
        if sampling.greedy:
            ref = generate_autoregressive(target, prompt, budget, eos_ids=list(eos))
            assert got.tokens == ref.tokens, (kind, prompt)
        assert got.finish_reason == ("stop" if eos else "length") and 0 < len(got.tokens) <= budget
    assert engine.stats()["active_rows"] == 0 and engine.stats()["requests_finished"] == len(reqs)
    if kind == "hybrid-cost-skipping":
        assert engine.stats()["draft_skipped"] > 0


@pytest.mark.parametrize("head", ["domino", "none", "domino+fuse"])
def test_one_drafter_pass_for_all_rows_proposes_what_each_row_would_alone(head, target):
    """Rows with different context lengths share one masked backbone pass: every cycle accepts exactly as
    many drafts as the batch-1 loop's (greedy: the proposals themselves must agree); with the fused last
    context row, each row reads its own."""
    name, _, fuse = head.partition("+")
    drafter = tiny_drafter(
        target,
        head=name,
        block_size=4,
        seed=2 if fuse else 1,  # a random fused drafter that has drafts accepted
        draft_vocab=40 if name == "none" else 0,
        fuse_context=bool(fuse),
    )
    engine = Engine(target, drafter, policy="fixed", max_batch=3)
    assert engine.slot_bytes == slot_bytes_needed(target, drafter, engine.max_len)  # what the memory check counts
    prompts = [[1, 2, 3], [5, 9, 11, 2, 7, 8, 30, 4, 4, 17], [4, 4, 4, 4, 4, 4, 1]]
    handles = [engine.submit(EngineRequest(p, 24, eos_ids=[])) for p in prompts]
    engine.run_until_idle()
    for p, h in zip(prompts, handles):
        ref = generate_speculative(target, drafter, p, 24, eos_ids=[])
        assert h.wait(0).accepted == ref.accepted and h.wait(0).tokens == ref.tokens
    assert sum(sum(h.wait(0).accepted) for h in handles) > 0  # drafts were accepted: the check has teeth


def test_engine_refuses_the_transformers_backend(llama_target):
    with pytest.raises(DominoError, match="native backend"):
        Engine(llama_target)


# ----- the distribution at T > 0, rows joining and leaving -----


def _soft_target():
    model = tiny_target("qwen3", vocab=8, layers=2, seed=3).model
    with torch.no_grad():  # soft: many likely outcomes, so a wrong rule shows
        model.get_output_embeddings().weight.mul_(0.7)
    return Target(model, name="tiny-soft", backend="native")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["plain", "cost", "cost-skipping", "cost-greedy-mates"])
def test_engine_sampling_preserves_the_target_distribution_with_rows_joining_and_leaving(policy):
    """cost-skipping: a draft pass so dear that the policy runs many steps without one (and probes), decided
    from each request's own running acceptance (rows join with none and build their own).
    cost-greedy-mates: the joining rows decode greedily, so the scheduler walks past its first drop for
    them in the same batch, and the sampled rows keep the target's distribution. (This drafter's confidences
    hardly read the drafts, so a sampled row walking on would not show here: the rule itself is pinned
    exactly by test_a_sampled_row_keeps_the_first_drop_beside_a_greedy_row.)"""
    target = _soft_target()
    drafter = tiny_drafter(target, block_size=3, seed=4, confidence=True) if policy != "plain" else None
    costs = CostTable({0: [1.0, 1.1, 1.2, 1.3]}, draft_s=0.3 if policy == "cost-skipping" else 0.0)
    if policy == "cost-greedy-mates":  # a bump at the first draft of two rows: the curve drops, then rises again
        costs = CostTable({0: [1.0, 1.1, 1.4, 1.45, 1.5, 1.55]})  # (the greedy walk then changes most cuts)
    engine = Engine(target, drafter, policy=policy.split("-")[0], costs=costs, max_batch=4, prefill_chunk=3)
    prompt, n = [1, 2, 3, 4], 800
    handles = []
    for i in range(n):  # other requests (longer, different prompts) keep joining and leaving between them
        handles.append(engine.submit(EngineRequest(prompt, 3, T1, seed=i, eos_ids=[])))
        if i % 3 == 0:
            mate = GREEDY if policy == "cost-greedy-mates" else T1
            engine.submit(EngineRequest([5, 6, 7, 1, 2], 1 + i % 7, mate, seed=n + i, eos_ids=[]))
        if i % 4 == 3:
            engine.run_until_idle() if i % 8 == 7 else engine.step()
    engine.run_until_idle()
    samples = [h.wait(0).tokens for h in handles]
    assert_matches_distribution(samples, exact_distribution(target, prompt, 3, T1))
    stats = engine.stats()
    if policy == "cost":
        assert stats["tau"] > 1.2 and stats["draft_skipped"] == 0  # drafts really accepted, not only resampled
    if policy == "cost-skipping":  # both kinds of step ran between the samples
        assert 0 < stats["draft_skipped"] < stats["steps"] and stats["tau"] > 1.0


def test_cost_engine_skips_the_drafter_while_it_does_not_pay_and_stays_exact(target, drafter):
    """A draft pass as dear as a target step: after a few rejected cycles the engine decodes plain, probing
    every 16th step; the greedy output is still each request's plain output. Control: a free draft pass
    is never skipped."""
    outcome = {}
    for draft_s in (1.0, 0.0):
        engine = Engine(target, drafter, policy="cost", costs=CostTable(COSTS.verify_s, draft_s), max_batch=2)
        prompts = [[1, 2, 3], [4, 4, 4, 4, 4, 4]]
        handles = [engine.submit(EngineRequest(p, 40, eos_ids=[])) for p in prompts]
        engine.run_until_idle()
        for p, h in zip(prompts, handles):
            assert h.wait(0).tokens == generate_autoregressive(target, p, 40, eos_ids=[]).tokens
        outcome[draft_s] = engine.stats()["draft_skipped"], engine.stats()["steps"]
    skipped, steps = outcome[1.0]
    assert steps / 2 < skipped < steps  # mostly plain steps, and some probes drafted
    assert outcome[0.0][0] == 0


def test_engine_cost_policy_measures_a_missing_batched_table_once(target, drafter, tmp_path, monkeypatch):
    """No manual profile step for the engine either: the first cost engine measures a quick table with the
    batched rows, stores it, and the next one reuses it silently."""
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path))
    said = []
    policy = make_policy("cost", drafter, target, rows=2, report=said.append)
    assert any("quick one" in s for s in said) and any("batched cost table" in s for s in said)
    assert sorted(policy.costs.seconds) == [1, 2, 4, 8] and len(list((tmp_path / "profiles").glob("*.json"))) == 1
    said.clear()
    again = make_policy("cost", drafter, target, rows=2, report=said.append)
    assert not any("measuring" in s for s in said) and again.costs.seconds == policy.costs.seconds
    engine = Engine(target, drafter, policy="cost", max_batch=2)  # reads the stored table
    h = engine.submit(EngineRequest([1, 2, 3], 12, eos_ids=[]))
    engine.run_until_idle()
    assert h.wait(0).tokens == generate_autoregressive(target, [1, 2, 3], 12, eos_ids=[]).tokens


def test_batch_policy_skips_drafting_from_earlier_steps_and_probes():
    table = BatchCostTable({1: [1.0, 1.05, 1.1, 1.15, 1.2]}, {1: 0.1})
    policy = CostPolicy(costs=table, block_size=4)
    rows = [ROW, ROW]
    assert policy.wants_draft(rows)  # prior 0.5 per slot: drafting pays at first
    for _ in range(30):
        policy.observe(Proposal(torch.tensor([1, 2, 3, 4]), source="drafter"), 4, 0)  # all rejected
    decisions = [policy.wants_draft(rows) for _ in range(32)]
    assert decisions.count(True) == 2 and decisions[15] and decisions[31]  # one probe every 16 steps
    for _ in range(60):
        policy.observe(Proposal(torch.tensor([1, 2, 3, 4]), source="drafter"), 4, 4)  # all accepted
    assert policy.wants_draft(rows)
    assert VerifyPolicy().wants_draft(rows)  # only cost skips


# ----- DSpark's Algorithm 1 over the batch -----


def test_algorithm_1_allocates_by_survival_and_stops_at_the_first_drop():
    flat_then_linear = lambda B: max(1.0, B / 4)  # noqa: E731  (a forward costs the same up to 4 tokens)
    # anchors B = 2; 0.9 -> B 3 (rate 2.9), 0.8 -> B 4 (3.7), 0.7 -> B 5 costs 1.25: 4.4 / 1.25 = 3.52 < 3.7
    assert allocate_verify([[0.9, 0.8, 0.7], [0.6, 0.3]], flat_then_linear) == [2, 0]
    # when every token costs the same, no draft pays: rate tau / B falls with the first one (0.9 < 1)
    assert allocate_verify([[0.9, 0.8], [0.95]], lambda B: float(B)) == [0, 0]
    # a cheap forward: everything is verified
    assert allocate_verify([[0.9, 0.5], [0.6]], lambda B: 1 + 0.1 * (B - 1)) == [2, 1]
    # the first drop ends the search even if a later candidate would raise the rate again
    bumpy = {1: 1.0, 2: 1.6, 3: 1.7}
    assert allocate_verify([[0.5, 0.495]], bumpy.__getitem__) == [0]


def test_algorithm_1_shrinks_each_requests_budget_as_the_batch_grows():
    curve = [0.9, 0.81, 0.73, 0.66, 0.59, 0.53, 0.48]
    cost = lambda B: max(1.0, B / 8)  # noqa: E731
    per_row = {R: allocate_verify([curve] * R, cost) for R in (1, 2, 4, 8)}
    assert per_row[1] == [7] and per_row[2] == [3, 3] and per_row[4] == [1, 1, 1, 1] and per_row[8] == [0] * 8


P_T = torch.tensor([0.7, 0.3], dtype=torch.float64)
P_D = torch.tensor([0.5, 0.5], dtype=torch.float64)
C1, C2 = 0.5, {0: 0.99, 1: 0.01}  # c_2 reads d_1


def _first_token_distribution(choose_k) -> torch.Tensor:
    """Exact distribution of the first committed token of one cycle with two drafts (DSpark's example)."""
    out = torch.zeros(2, dtype=torch.float64)
    residual = (P_T - P_D).clamp_min(0) / (P_T - P_D).clamp_min(0).sum()
    for d1 in (0, 1):
        for d2 in (0, 1):
            weight = P_D[d1] * P_D[d2]
            logits = torch.tensor([math.log(C1 / (1 - C1)), math.log(C2[d1] / (1 - C2[d1]))])
            k = choose_k(Proposal(torch.tensor([d1, d2]), None, logits))
            if k == 0:
                out += weight * P_T
                continue
            accept = min(1.0, float(P_T[d1] / P_D[d1]))
            out[d1] += weight * accept
            out += weight * (1 - accept) * residual
    return out


def test_batch_scheduler_on_dsparks_counterexample_keeps_the_distribution():
    table = BatchCostTable({1: [1.0, 1.6, 1.7]})
    policy = CostPolicy(costs=table)
    other = Proposal(torch.tensor([0, 1]), None, torch.tensor([2.0, 1.0]))  # a second row in the batch

    def ours(p):
        return policy.verify_lengths([p, other], [SAMPLED, SAMPLED])[0]

    def full_search(p):  # the best total over all prefixes: c_2 (which read d_1) decides about d_1
        a = torch.cumprod(torch.sigmoid(p.confidence_logits.double()), 0).tolist()
        rates = [(1 + sum(a[:k])) / table.seconds[1][k] for k in range(3)]
        return max(range(3), key=rates.__getitem__)

    assert _first_token_distribution(full_search) == pytest.approx(torch.tensor([0.85, 0.15], dtype=torch.float64))
    assert _first_token_distribution(ours) == pytest.approx(P_T, abs=1e-12)


def test_a_sampled_row_keeps_the_first_drop_beside_a_greedy_row():
    """Protects: in one batch, a greedy row may walk past the first drop but a sampled row may not. On
    DSpark's counterexample in a two-row batch, the sampled row keeps the target's distribution whether its
    mate samples or decodes greedily; the control, the same row allowed to walk on, gets (0.85, 0.15)."""
    policy = CostPolicy(costs=BatchCostTable({2: [1.0, 1.6, 1.7]}))
    other = Proposal(torch.tensor([0, 1]), None, torch.tensor([2.0, 1.0]))
    for mate in (SAMPLED, ROW):
        ours = _first_token_distribution(lambda p, mate=mate: policy.verify_lengths([p, other], [SAMPLED, mate])[0])
        assert ours == pytest.approx(P_T, abs=1e-12)
    walking = _first_token_distribution(lambda p: policy.verify_lengths([p, other], [ROW, SAMPLED])[0])
    assert walking == pytest.approx(torch.tensor([0.85, 0.15], dtype=torch.float64))


def test_batch_cost_table_interpolates_over_total_tokens():
    table = BatchCostTable({1: [1.0, 1.5, 2.0], 4: [2.0, 4.0]})
    assert table.step_seconds(1, 2) == pytest.approx(1.5)
    assert table.step_seconds(4, 4) == pytest.approx(2.0) and table.step_seconds(4, 6) == pytest.approx(3.0)
    assert table.step_seconds(4, 10) == pytest.approx(5.0)  # past the table: its last slope
    assert table.step_seconds(3, 6) == pytest.approx(3.0)  # 3 rows read the nearest profiled count (4)
    assert BatchCostTable({1: [1.0, 0.9]}).step_seconds(1, 50) == pytest.approx(0.9)  # noise never extrapolates down


# ----- slots, queue, cancellation, errors, the background thread -----


def test_row_forward_touches_only_its_rows_and_refuses_to_outgrow_the_cache(target):
    cache = target.new_row_cache(3, 16)
    assert [cache.claim(), cache.claim()] == [0, 1]
    target.forward_rows(torch.tensor([[1, 2, 3, 4]]), cache, start=1)
    assert not cache.k[:, 0].any() and not cache.k[:, 2].any() and cache.k[:, 1].any()
    target.forward_rows(torch.tensor([[5, 6, 0], [7, 0, 0]]), cache, num_new=[2, 1], start=0)
    assert cache.lengths == [2, 5, 0] and cache.k[:, 0].any() and not cache.k[:, 2].any()
    target.set_row_length(cache, 1, 3)  # per-row rollback
    cache.release(0)
    assert cache.claim() == 0 and cache.lengths[0] == 0 and cache.claimed == [True, True, False]
    with pytest.raises(DominoError, match="would pass the cache's 16 positions"):
        target.forward_rows(torch.zeros(1, 14, dtype=torch.long), cache, start=1)
    assert cache.lengths[1] == 3


def test_a_full_engine_queues_new_requests_and_refuses_past_max_queue(target):
    engine = Engine(target, max_batch=1, max_queue=2)
    a = engine.submit(EngineRequest([1, 2, 3], 5, eos_ids=[]))
    b = engine.submit(EngineRequest([4, 5], 5, eos_ids=[]))
    engine.step()
    assert engine.stats()["active_rows"] == 1 and engine.stats()["queue_depth"] == 1
    engine.submit(EngineRequest([6], 2, eos_ids=[]))
    with pytest.raises(EngineFull, match="2 requests wait"):
        engine.submit(EngineRequest([7], 2, eos_ids=[]))
    engine.run_until_idle()
    ra, rb = a.wait(0), b.wait(0)
    assert len(ra.tokens) == len(rb.tokens) == 5 and rb.queued_s > 0 and rb.ttft_s >= rb.queued_s


def test_cancellation_frees_the_slot_for_the_next_request(target, drafter):
    engine = Engine(target, drafter, policy="fixed", max_batch=1)
    finished = []
    a = engine.submit(EngineRequest([1, 2, 3], 200, eos_ids=[], on_finish=finished.append))
    b = engine.submit(EngineRequest([4, 5, 6], 6, eos_ids=[]))
    c = engine.submit(EngineRequest([7, 8], 6, eos_ids=[]))
    for _ in range(3):
        engine.step()
    c.cancel()  # still queued: never runs
    a.cancel()
    engine.step()
    assert a.done and a.wait(0).finish_reason == "cancelled" and 0 < len(a.wait(0).tokens) < 200
    assert finished == [a.wait(0)]
    assert c.wait(0).finish_reason == "cancelled" and c.wait(0).tokens == []
    assert engine.stats()["active_rows"] == 1  # b took the freed slot in the same step
    engine.run_until_idle()
    assert b.wait(0).tokens == generate_autoregressive(target, [4, 5, 6], 6, eos_ids=[]).tokens
    assert engine.cache.claimed == [False] and engine.proposer.rows.claimed == [False]


def test_slot_memory_stays_bounded_over_many_requests(target, drafter):
    engine = Engine(target, drafter, policy="fixed", max_batch=2, max_len=64)
    before = (engine.cache.k.data_ptr(), engine.cache.k.shape, engine.proposer.rows.k.data_ptr())
    for i in range(30):
        engine.submit(EngineRequest([1 + i % 5, 2, 3 + i % 7], 3 + i % 11, eos_ids=[]))
        if i % 2:
            engine.step()
    engine.run_until_idle()
    after = (engine.cache.k.data_ptr(), engine.cache.k.shape, engine.proposer.rows.k.data_ptr())
    assert before == after  # no growth, no reallocation
    assert engine.stats()["requests_finished"] == 30 and engine.cache.claimed == [False, False]
    assert engine.slot_bytes == engine.cache.bytes_per_row + engine.proposer.rows.bytes_per_row


def test_submit_refuses_bad_requests_with_the_numbers(target, drafter):
    engine = Engine(target, drafter, policy="fixed", max_len=40)
    with pytest.raises(DominoError, match="empty"):
        engine.submit(EngineRequest([], 5))
    with pytest.raises(DominoError, match="token id 64 is outside"):
        engine.submit(EngineRequest([1, 64], 5))
    with pytest.raises(DominoError, match="max_new_tokens must be >= 1"):
        engine.submit(EngineRequest([1], 0))
    with pytest.raises(DominoError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(30\) \+ 4 draft positions"):
        engine.submit(EngineRequest(list(range(10)), 30))
    with pytest.raises(DominoError, match="verify='fast': choose from fixed, static, cost"):
        Engine(target, policy="fast")
    with pytest.raises(DominoError, match="verify='fixed' schedules drafts, and this run proposes none"):
        Engine(target, policy="fixed")
    engine.shutdown()
    with pytest.raises(DominoError, match="shut down"):
        engine.submit(EngineRequest([1], 5))


def test_background_thread_streams_tokens_in_order_and_drains_on_shutdown(target, drafter):
    engine = Engine(target, drafter, lookup=True, policy="fixed", max_batch=2)
    engine.start()
    streamed, finished, lock = {}, {}, threading.Lock()

    def request(i):
        def on_tokens(toks):
            assert i not in finished  # never after on_finish
            with lock:
                streamed.setdefault(i, []).extend(toks)

        def on_finish(res):
            finished[i] = res

        return EngineRequest([1 + i, 2, 3], 10 + i, eos_ids=[], on_tokens=on_tokens, on_finish=on_finish)

    handles = [engine.submit(request(i)) for i in range(5)]
    results = [h.wait(timeout=60) for h in handles]
    engine.shutdown(drain=True, timeout=60)
    for i, res in enumerate(results):
        assert streamed[i] == res.tokens == generate_autoregressive(target, [1 + i, 2, 3], 10 + i, eos_ids=[]).tokens
        assert finished[i] is res
    st = engine.stats()
    assert st["requests_finished"] == 5 and st["tau"] >= 1 and st["policy"] == "fixed"


# ----- the cost table and the benchmark under concurrency -----


def test_batched_profile_feeds_the_scheduler(target, drafter):
    from dominospec.tune.profile import profile_batch_cost

    table = profile_batch_cost(target, drafter, rows=(1, 3), context=12, max_k=3, repeats=1)
    assert table["rows"] == [1, 3] and table["k"] == [1, 2, 3]
    assert len(table["seconds"]) == 2 and all(len(r) == 3 and min(r) > 0 for r in table["seconds"])
    assert len(table["draft_seconds"]) == 2
    costs = BatchCostTable.from_profile({"batch": table})
    assert costs.step_seconds(3, 3) == pytest.approx(table["seconds"][1][0] + table["draft_seconds"][1])
    engine = Engine(target, drafter, policy="cost", costs=costs, max_batch=3)
    got = run_one(engine, [1, 2, 3], 12, GREEDY, seed=0)
    assert got.tokens == generate_autoregressive(target, [1, 2, 3], 12, eos_ids=[]).tokens


def test_bench_concurrency_reports_every_policy_and_level(target, drafter, tmp_path):
    from dominospec.bench.concurrency import bench_concurrency, parse_concurrency, write_concurrency

    assert parse_concurrency("1, 2,4") == [1, 2, 4]
    for bad in ("0,2", "a", ""):
        with pytest.raises(DominoError, match="--concurrency"):
            parse_concurrency(bad)
    data = {"set": [[1, 2, 3], [4, 5, 6, 7], [9, 9]]}
    specs = {
        "plain": SpecConfig(),
        "drafter-fixed": SpecConfig("drafter", "fixed", drafter),
        "lookup-cost": SpecConfig("lookup", "cost"),
        # a drafter without a confidence head cannot run static: skipped, with a note
        "drafter-static": SpecConfig("drafter", "static", tiny_drafter(target, block_size=4)),
    }
    res = bench_concurrency(target, specs, data, [1, 2], max_new_tokens=6, costs=COSTS)
    assert res["notes"] and res["notes"][0].startswith("drafter-static: skipped")
    assert [(r["policy"], r["concurrency"]) for r in res["rows"]] == [
        (p, c) for p in ("plain", "drafter-fixed", "lookup-cost") for c in (1, 2)
    ]
    for r in res["rows"]:
        assert r["requests"] == 3 and r["tokens"] <= 18 and r["tokens_per_s"] > 0 and r["errors"] == 0
        assert (r["tau"] is None) == (r["policy"] == "plain")
        assert r["mismatches"] == 0  # greedy, float64-exact tiny model: every run answers like the first
    paths = write_concurrency(res, tmp_path, plots=False)
    assert {p.name for p in paths} == {"concurrency.json", "concurrency.md"}
    assert "| drafter-fixed | 2 |" in (tmp_path / "concurrency.md").read_text()
