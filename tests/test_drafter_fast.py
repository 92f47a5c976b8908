"""The drafter's packed inference path (drafter/fast.py) proposes what the library path proposes: greedy drafts
identical, the distributions sampled drafts are drawn from equal to fp32 rounding, for every head, with and
without a confidence head and a draft vocabulary, at one row and several; speculative output stays exactly
plain greedy decoding. The packed copies are never used where autograd records and follow weight changes."""

import copy
import math

import pytest
import torch
from conftest import confident_drafter, tiny_drafter, tiny_target

from dominospec import Drafter, SamplingConfig, generate_autoregressive, generate_speculative
from dominospec.decode.rollout import draft_block, draft_rows
from dominospec.decode.schedule import profile_drafter_label
from dominospec.drafter import shipped_drafter_dir
from dominospec.drafter.fast import ENV_SWITCH
from dominospec.engine import Engine, EngineRequest
from dominospec.targets.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the small-row kernel is not built here")

GREEDY, T1, WARPED = SamplingConfig(), SamplingConfig(1.0), SamplingConfig(0.8, top_k=20, top_p=0.9)
HEADS = ["domino", "none", "markov", "rnn", "path"]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [5, 9, 11, 2, 7, 8, 30, 4, 4, 17, 3, 3], [4, 4, 1]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", dtype=torch.float32, backend="native")  # fp32: the packed path's dtype


def make_drafter(target, head, confidence, draft_vocab):
    """A random drafter in eval mode whose head weights are large enough that its state changes the drafts."""
    if confidence:
        d = confident_drafter(target, head=head, draft_vocab=draft_vocab)
    else:
        d = tiny_drafter(target, head=head, draft_vocab=draft_vocab)
    with torch.no_grad():
        for name, p in d.head.named_parameters():
            if p.dim() == 2 and not name.startswith("w2"):
                torch.nn.init.normal_(p, std=2.0 / math.sqrt(p.shape[1]))
    return d.eval()


def propose_both(monkeypatch, target, drafter, rows, samplings, b=4):
    """Proposals of the packed path and of the library path for `rows` prompts in one draft cache, each row
    drawing with its own seeded generator (the same seeds on both paths)."""
    out = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(ENV_SWITCH, mode)
        with torch.inference_mode():
            assert (drafter.fast() is not None) == (mode == "on")
            cache = drafter.new_row_cache(len(rows), 64)
            for slot, prompt in enumerate(rows):
                feats = target.forward(
                    torch.tensor([prompt]),
                    target.new_cache(),
                    layer_ids=drafter.config.target_layer_ids,
                    with_features=True,
                ).features
                cache.claimed[slot] = True
                drafter.extend_cache(_slot(drafter, cache, slot), feats)
            gens = [torch.Generator().manual_seed(10 + r) for r in range(len(rows))]
            anchors = torch.tensor([p[-1] for p in rows])
            if len(rows) == 1:
                props = [draft_block(drafter, _slot(drafter, cache, 0), anchors, b, samplings[0], gens[0], top=True)]
            else:
                props = draft_rows(
                    drafter, cache, list(range(len(rows))), anchors, [b] * len(rows), samplings, gens, top=True
                )
            out[mode] = props
    return out["on"], out["off"]


def _slot(drafter, cache, slot):
    from dominospec.drafter import DraftCache

    return DraftCache(cache, slot)


def assert_same_proposals(fast, lib):
    for p, q in zip(fast, lib):
        assert p.drafts.tolist() == q.drafts.tolist()
        for a, b in (
            (p.draft_probs, q.draft_probs),
            (p.confidence_logits, q.confidence_logits),
            (p.draft_top, q.draft_top),
        ):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("confidence,draft_vocab", [(False, 0), (True, 40)])
@pytest.mark.parametrize("n_rows", [1, 3])
def test_packed_greedy_drafts_equal_the_library_path(monkeypatch, target, head, confidence, draft_vocab, n_rows):
    drafter = make_drafter(target, head, confidence, draft_vocab)
    fast, lib = propose_both(monkeypatch, target, drafter, PROMPTS[:n_rows], [GREEDY] * n_rows)
    assert_same_proposals(fast, lib)
    assert len({tuple(p.drafts.tolist()) for p in fast}) == n_rows or n_rows == 1  # rows differ: the check has teeth


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("confidence,draft_vocab", [(True, 0), (False, 40)])
@pytest.mark.parametrize("n_rows", [1, 3])
def test_packed_sampled_drafts_come_from_the_library_paths_distribution(
    monkeypatch, target, head, confidence, draft_vocab, n_rows
):
    """Same generators, distributions equal to fp32 rounding, so the same draws; a mixed batch keeps its greedy row."""
    drafter = make_drafter(target, head, confidence, draft_vocab)
    samplings = [T1, WARPED, GREEDY][:n_rows] if n_rows > 1 else [T1]
    fast, lib = propose_both(monkeypatch, target, drafter, PROMPTS[:n_rows], samplings)
    assert_same_proposals(fast, lib)
    assert fast[0].draft_probs is not None and fast[0].draft_probs.shape == (4, target.vocab_size)


def test_context_cache_and_block_states_equal_the_library_path(monkeypatch, target):
    drafter = make_drafter(target, "domino", True, 0)
    feats = target.forward(
        torch.tensor([PROMPTS[1]]), target.new_cache(), layer_ids=drafter.config.target_layer_ids, with_features=True
    )
    states = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(ENV_SWITCH, mode)
        with torch.inference_mode():
            cache = drafter.new_cache()
            drafter.extend_cache(cache, feats.features[:, :5])
            drafter.extend_cache(cache, feats.features[:, 5:])  # two chunks: positions continue
            z = drafter.backbone_block(cache, torch.tensor([3]))
            states[mode] = (cache.rows.k[:, 0, :, :12].clone(), cache.rows.v[:, 0, :, :12].clone(), z)
    for a, b in zip(states["on"], states["off"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_packed_path_never_runs_where_autograd_records_or_off_cpu_fp32(monkeypatch, target):
    drafter = make_drafter(target, "domino", False, 0)
    with torch.no_grad():
        assert drafter.fast() is not None
    assert drafter.fast() is None  # gradients on: training keeps the nn.Linear parameters
    monkeypatch.setenv(ENV_SWITCH, "off")
    with torch.no_grad():
        assert drafter.fast() is None  # the A/B switch
    fp64 = tiny_drafter(tiny_target("qwen3", backend="native"), head="domino").eval()
    with torch.no_grad():
        assert fp64.fast() is None  # float64: the library path


def test_draft_costs_are_kept_apart_by_path(monkeypatch, target):
    """A device profile's draft cost timed on one path or weight format is not read for another (it is measured
    again)."""
    drafter = make_drafter(target, "domino", False, 0)
    packed = profile_drafter_label(drafter)
    monkeypatch.setattr(drafter, "weight_format", "int8")
    assert profile_drafter_label(drafter) == packed + "-int8"
    monkeypatch.setenv(ENV_SWITCH, "off")
    assert drafter.inference_path == "library" and profile_drafter_label(drafter) + "/packed" == packed


def test_packed_copies_follow_weight_changes(target):
    """An in-place edit or load_state_dict (copying or assigning) repacks at the next use, and the packed outputs
    follow the new weights; attaching to the same target again does not repack."""
    drafter = make_drafter(target, "domino", True, 40)
    z = torch.randn(2, 4, drafter.config.hidden_size)
    with torch.no_grad():
        first = drafter.fast()
        assert drafter.fast() is first  # unchanged weights: packed once
        drafter.head.w2.weight.mul_(-1.0)
        drafter.confidence.proj.bias.add_(1.0)
        assert drafter.fast() is not first
        other = make_drafter(target, "domino", True, 40)
        other.load_state_dict({k: v * 0.5 for k, v in drafter.state_dict().items() if k != "draft_vocab"}, strict=False)
        packed = other.fast()
        torch.testing.assert_close(packed.base_logits(z), _library_base(other, z), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            packed.conf(torch.cat([z, z], -1))[..., 0], other.confidence(z, z), rtol=1e-4, atol=1e-5
        )
        assert other.attach(target).fast() is packed  # attaching to the same target again keeps the copies
        state = {k: v.clone() for k, v in other.state_dict().items()}
        other.load_state_dict(state, assign=True)  # new tensor objects with the same values
        assert other.fast() is not packed


def test_a_copied_drafter_packs_its_own_copies(target):
    drafter = make_drafter(target, "domino", True, 40)
    with torch.no_grad():
        packed = drafter.fast()
        twin = copy.deepcopy(drafter)  # the kernel's panels and module are not copied along
        assert twin.fast() is not None and twin.fast() is not packed
        z = torch.randn(1, 4, drafter.config.hidden_size)
        torch.testing.assert_close(twin.fast().base_logits(z), packed.base_logits(z))


def _library_base(drafter, z):
    return torch.nn.functional.linear(z, drafter._head_rows)


@pytest.mark.parametrize("head", ["domino", "markov"])
def test_greedy_speculative_output_with_the_packed_drafter_is_plain_greedy(target, head):
    """Through the batch-1 loop and the engine (rows of different lengths sharing one packed backbone pass)."""
    drafter = confident_drafter(target, head=head, draft_vocab=40).eval()
    engine = Engine(target, drafter, policy="fixed", max_batch=3)
    handles = [engine.submit(EngineRequest(p, 20, eos_ids=[])) for p in PROMPTS]
    engine.run_until_idle()
    accepted = 0
    for p, h in zip(PROMPTS, handles):
        ref = generate_autoregressive(target, p, 20, eos_ids=[]).tokens
        spec = generate_speculative(target, drafter, p, 20, eos_ids=[])
        assert spec.tokens == ref and h.wait(0).tokens == ref
        accepted += sum(spec.accepted)
    assert accepted > 0  # drafts were accepted: the check has teeth


def _python_domino_slot(steps, drafter, k, prev, base_k, w1z, xs):
    """One slot of the Domino head as the packed path ran it in Python before the kernel took the loop."""
    H, g = steps.hidden, steps.g
    xs[:, :H] = drafter.embed(prev)
    pre = steps.gates(xs)
    ru = torch.sigmoid(pre[:, : 2 * g])
    n = torch.addcmul(pre[:, 2 * g : 3 * g], ru[:, :g], pre[:, 3 * g :]).tanh_()
    s = torch.lerp(n, xs[:, H:], ru[:, g:])
    xs[:, H:] = s
    if k == 0:
        return base_k
    return steps.w2(torch.nn.functional.silu(w1z[:, k] + steps.w1_s(s))).add_(base_k)


@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_the_kernels_domino_rollout_gives_the_bits_of_the_same_ops_in_python(target, weights, draft_vocab):
    """Protects: the Domino head's slots moved into the kernel (cpu_kernels/drafter_rollout.cpp) run the same ops
    in the same order, so greedy drafts, top probabilities and each slot's logits are bit for bit what the packed
    path gave with a Python loop per slot (no new rounding: the drafts cannot change)."""
    drafter = make_drafter(target, "domino", True, draft_vocab)
    drafter.weight_format = weights
    R, b = 3, 6
    with torch.inference_mode():
        fast = drafter.fast()
        steps = fast.steps
        z = torch.randn(R, b, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
        anchors = torch.tensor([3, 17, 40])
        base = fast.base_logits(z)
        w1z, xs = steps.start(z)
        drafts, tops = steps.greedy((w1z, xs), base, anchors, True)
        ref_xs, kern_xs, prev = xs.clone(), xs.clone(), anchors
        ref_drafts, ref_tops = [], []
        for k in range(b):
            logits = _python_domino_slot(steps, drafter, k, prev, base[:, k], w1z, ref_xs)
            assert torch.equal(steps(k, None, prev, base[:, k], (w1z, kern_xs)), logits)  # one slot (sampled rows)
            assert torch.equal(kern_xs, ref_xs)
            ref_tops.append(torch.softmax(logits, -1).amax(-1))
            prev = drafter.to_target_ids(logits.argmax(-1))
            ref_drafts.append(prev)
    assert torch.equal(drafts, torch.stack(ref_drafts, 1)) and torch.equal(tops, torch.stack(ref_tops, 1))
    assert len({tuple(r) for r in drafts.tolist()}) == R  # rows differ: the check has teeth


# ----- the shipped drafter on the bundled target -----

CHAT = ["Write a Python function that reverses a string.", "What is 17 times 23?", "Name three colours."]


@pytest.fixture(scope="module")
def shipped(smollm):
    return Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=smollm)


@pytest.mark.integration
@pytest.mark.parametrize("n_rows", [1, 3])
def test_shipped_drafter_packed_path_equals_the_library_path(monkeypatch, smollm, shipped, n_rows):
    monkeypatch.setattr(shipped, "weight_format", "float32")  # the bundled target's own (int8) is tested below
    rows = [smollm.encode_chat(t) for t in CHAT[:n_rows]]
    for samplings in ([GREEDY] * n_rows, [T1] * n_rows):
        fast, lib = propose_both(monkeypatch, smollm, shipped, rows, samplings, b=8)
        assert_same_proposals(fast, lib)


@pytest.mark.integration
@pytest.mark.parametrize("weights", ["float32", "int8", "bfloat16-dot"])
def test_shipped_drafter_packed_output_is_plain_greedy(monkeypatch, smollm, shipped, weights):
    """Protects: whatever format the drafter's weights stream in (fast.py: the target's own by default, int8 for
    the bundled model), speculative output through the loop and the engine is the target's plain greedy."""
    monkeypatch.setattr(shipped, "weight_format", weights)
    ids = [smollm.encode_chat(t) for t in CHAT[:2]]
    engine = Engine(smollm, shipped, policy="fixed", max_batch=2)
    handles = [engine.submit(EngineRequest(p, 24)) for p in ids]
    engine.run_until_idle()
    for p, h in zip(ids, handles):
        ref = generate_autoregressive(smollm, p, 24).tokens
        assert generate_speculative(smollm, shipped, p, 24).tokens == ref
        assert h.wait(0).tokens == ref


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_drafter_weights_follow_the_target_on_its_dot_product_or_the_switch(monkeypatch, fmt):
    """Protects: the packed drafter streams the target's weight format, int8 on the kernel's int8 dot product
    where it has one, unless DOMINOSPEC_DRAFTER_WEIGHTS says otherwise (a bad value is refused by name); int8 and
    bf16 panels stream fewer bytes."""
    from dominospec.drafter.fast import WEIGHTS_SWITCH

    module = load_kernels()
    if module is None:
        pytest.skip("the small-M kernel does not build here")
    target = tiny_target("qwen3", dtype=torch.float32, backend="native", weights=fmt)
    drafter = make_drafter(target, "domino", confidence=True, draft_vocab=40)
    assert drafter.weight_format == ("int8-dot" if fmt == "int8" and module.int8_dot_paths() else fmt or "float32")
    monkeypatch.setattr(module, "int8_dot_paths", lambda: [])  # a CPU without one
    assert drafter.attach(target).weight_format == (fmt or "float32")
    sizes = {}
    for weights in ("float32", "bfloat16-dot", "int8"):
        monkeypatch.setenv(WEIGHTS_SWITCH, weights)
        drafter.attach(target)
        assert drafter.weight_format == weights
        with torch.no_grad():
            packed = drafter.fast()
        assert packed.format == weights
        sizes[weights] = sum(layer.qkv.nbytes for layer in packed.layers)
    assert sizes["int8"] < sizes["bfloat16-dot"] < sizes["float32"]
    monkeypatch.setenv(WEIGHTS_SWITCH, "int4")
    with pytest.raises(ValueError, match="DOMINOSPEC_DRAFTER_WEIGHTS='int4'"):
        drafter.attach(target)
