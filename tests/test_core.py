"""Core properties: lossless greedy output, distribution-preserving sampling, label shift, caches."""

import pytest
import torch
from conftest import BACKENDS, PROMPTS, assert_matches_target_distribution, soft_target, tiny_drafter

from dominospec import SamplingConfig, generate_autoregressive, generate_speculative
from dominospec.decode.proposers import make_proposer
from dominospec.decode.single import decode
from dominospec.sampling import accept_drafts, accept_rejection, warp_probs

HEADS = ["none", "domino", "markov", "rnn", "path"]


class OracleDrafter(torch.nn.Module):
    """Wraps a drafter so slot k of a block anchored at position a proposes ref[a+1+k].

    It keeps the real drafter's cache bookkeeping (the anchor position is the draft cache's
    length), so it checks the decoding loop's label-shift alignment end to end.
    """

    def __init__(self, drafter, reference: list[int], vocab: int):
        super().__init__()
        self.inner, self.ref, self.vocab = drafter, reference, vocab
        self.config, self.head, self.confidence = drafter.config, drafter.head, None

    def new_cache(self):
        return self.inner.new_cache()

    def extend_cache(self, cache, features):
        self.inner.extend_cache(cache, features)

    def embed(self, ids):
        return self.inner.embed(ids)

    def backbone_block(self, cache, anchor):
        z = torch.zeros(1, self.config.block_size, self.config.hidden_size, dtype=torch.float64)
        z[0, :, 0] = torch.arange(cache.length + 1, cache.length + 1 + self.config.block_size)
        return z

    def to_target_ids(self, ids):
        return ids

    def base_logits(self, z):
        logits = torch.zeros(z.shape[0], self.vocab, dtype=z.dtype)
        for row, pos in enumerate(z[:, 0].long().tolist()):
            logits[row, self.ref[pos] if pos < len(self.ref) else 0] = 1e4
        return logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("head", HEADS + ["domino+subvocab", "rnn+subvocab", "domino+fuse"])
def test_greedy_output_matches_target(family, head, backend, tiny_targets):
    target = tiny_targets[family, backend]
    name, _, sub = head.partition("+")
    drafter = tiny_drafter(
        target, head=name, block_size=4, draft_vocab=40 if sub == "subvocab" else 0, fuse_context=sub == "fuse"
    )
    for prompt in PROMPTS:
        ref = generate_autoregressive(target, prompt, 30, eos_ids=[])
        for b in (1, 3, 4):
            spec = generate_speculative(target, drafter, prompt, 30, block_size=b, eos_ids=[])
            assert spec.tokens == ref.tokens, (family, head, backend, b, prompt)
            assert spec.cycles > 0 and sum(spec.committed) + 1 == len(spec.tokens)


@pytest.mark.parametrize("head", HEADS)
def test_label_shift_oracle_gets_full_tau_and_stops_inside_blocks(head, llama_target):
    """A drafter that proposes the true next tokens is accepted whole: tau = block + 1.

    The same oracle then puts EOS and the token limit in the middle of accepted blocks.
    """
    target = llama_target
    prompt, b = PROMPTS[0], 4
    ref = generate_autoregressive(target, prompt, 41, eos_ids=[])
    oracle = OracleDrafter(
        tiny_drafter(target, head=head, block_size=b, randomize_head=False), prompt + ref.tokens, target.vocab_size
    )
    spec = generate_speculative(target, oracle, prompt, 41, eos_ids=[])
    assert spec.tokens == ref.tokens
    assert spec.accepted == [b] * spec.cycles
    assert spec.tau == b + 1 and spec.cycles == 8

    # max-new-tokens inside a block: 1 (prefill) + 5 + 5 + 2 of the third block
    spec = generate_speculative(target, oracle, prompt, 13, eos_ids=[])
    assert spec.tokens == ref.tokens[:13] and spec.committed == [5, 5, 2]

    # EOS inside an accepted block: a token whose first occurrence is not a block's last slot
    pos = next(i for i in range(8, 40) if ref.tokens[i] not in ref.tokens[:i] and (i - 1) % (b + 1) < b)
    eos = ref.tokens[pos]
    want = generate_autoregressive(target, prompt, 41, eos_ids=[eos])
    spec = generate_speculative(target, oracle, prompt, 41, eos_ids=[eos])
    assert spec.tokens == want.tokens == ref.tokens[: pos + 1]
    assert spec.committed[-1] == (pos - 1) % (b + 1) + 1 < b + 1
    assert spec.accepted[-1] == b  # the target accepted past EOS; only the commit was cut


def test_greedy_matches_with_eos_from_real_rejections(qwen3_target):
    """EOS reached through ordinary (partly rejected) cycles also stops exactly where the target does."""
    target = qwen3_target
    drafter = tiny_drafter(target, head="domino", block_size=4)
    ref = generate_autoregressive(target, PROMPTS[0], 40, eos_ids=[])
    for eos in sorted(set(ref.tokens[3:20])):
        want = generate_autoregressive(target, PROMPTS[0], 40, eos_ids=[eos])
        got = generate_speculative(target, drafter, PROMPTS[0], 40, eos_ids=[eos])
        assert got.tokens == want.tokens and got.tokens[-1] == eos


# ----- sampling -----


def test_rejection_step_preserves_first_token_distribution():
    """One acceptance step: the first committed token is distributed as the target row 0.

    Chi-square against the exact row; the control: the same counts do not fit the draft's own row.
    """
    from scipy.stats import chisquare

    torch.manual_seed(0)
    v, b, n = 5, 3, 8000
    p_t = torch.softmax(torch.randn(b + 1, v) * 1.5, -1).double()
    p_d = torch.softmax(torch.randn(b, v) * 1.5, -1).double()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(v)
    for _ in range(n):
        drafts = torch.multinomial(p_d, 1, generator=gen).squeeze(-1)
        k, nxt = accept_rejection(drafts, p_d, p_t, gen)
        first = int(drafts[0]) if k > 0 else nxt
        counts[first] += 1

    def fit(p):
        return chisquare(counts.tolist(), (p / p.sum() * n).tolist()).pvalue

    assert fit(p_t[0]) > 1e-3
    assert fit(p_d[0]) < 1e-6  # the control: the test can tell the two apart


def mixed_batch(gen, V=7, ks=(0, 3, 2, 4), samplings=None):
    """One step's inputs for rows of different kinds: padded logits [R, S, V], drafts per row, draft distributions."""
    samplings = samplings or [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.0), SamplingConfig(0.7, 3)]
    S = max(ks) + 1
    logits = torch.randn(len(ks), S, V, generator=gen, dtype=torch.float64) * 2
    drafts, probs = [], []
    for r, k in enumerate(ks):
        p_d = torch.softmax(torch.randn(k, V, generator=gen, dtype=torch.float64) * 2, -1)
        greedy_path = logits[r, :k].argmax(-1)  # greedy rows: drafts that agree for a while, then may not
        d = torch.where(torch.rand(k, generator=gen) < 0.7, greedy_path, torch.multinomial(p_d, 1, generator=gen)[:, 0])
        drafts.append(d if samplings[r].greedy else torch.multinomial(p_d, 1, generator=gen)[:, 0] if k else d)
        probs.append(None if samplings[r].greedy else p_d)
    return logits, drafts, probs, samplings


def accept_in_one_call(logits, drafts, probs, samplings, seeds):
    R, S, V = logits.shape
    cu = [0]
    for d in drafts:
        cu.append(cu[-1] + len(d))
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    flat = torch.cat(drafts)
    return accept_drafts(flat, cu, logits.reshape(R * S, V), [r * S for r in range(R)], probs, samplings, gens)


def test_one_acceptance_call_equals_the_per_row_reference_with_greedy_and_sampled_rows():
    """Greedy rows: the longest prefix equal to the target's argmax (bit-identical); sampled rows: exactly the
    per-row rejection sampler's draws, each row with its own generator, whatever shares the call."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits, drafts, probs, samplings = mixed_batch(gen)
        seeds = [trial * 10 + r for r in range(len(drafts))]
        ns, nxts, errors = accept_in_one_call(logits, drafts, probs, samplings, seeds)
        assert errors == [None] * len(drafts)
        for r, (d, s) in enumerate(zip(drafts, samplings)):
            k = len(d)
            if s.greedy:
                picks = logits[r, : k + 1].argmax(-1).tolist()
                n = next((i for i in range(k) if picks[i] != int(d[i])), k)
                want = (n, picks[n])
            else:
                row_gen = torch.Generator().manual_seed(seeds[r])
                p_d = probs[r] if k else logits[r, :0]
                want = accept_rejection(d, p_d, warp_probs(logits[r, : k + 1], s), row_gen)
            assert (ns[r], nxts[r]) == want, (trial, r)


def test_a_sampled_row_in_a_mixed_call_commits_the_target_distribution():
    """The chi-square harness on one sampled row sharing its call with greedy rows: its first committed token is
    distributed as the target's first row; the control (the draft's own row) does not fit."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(1)
    samplings = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.0)]
    logits, drafts, _, _ = mixed_batch(gen, ks=(2, 3, 1), samplings=samplings)
    p_t = torch.softmax(logits[1, 0], -1)
    p_d = torch.softmax(torch.randn(3, logits.shape[-1], generator=gen, dtype=torch.float64) * 1.5, -1)
    n, counts = 6000, torch.zeros(logits.shape[-1])
    draw = torch.Generator().manual_seed(2)
    for i in range(n):
        drafts[1] = torch.multinomial(p_d, 1, generator=draw)[:, 0]
        ns, nxts, _ = accept_in_one_call(logits, drafts, [None, p_d, None], samplings, [0, 1000 + i, 0])
        counts[int(drafts[1][0]) if ns[1] > 0 else nxts[1]] += 1

    def fit(p):
        return chisquare(counts.tolist(), (p / p.sum() * n).tolist()).pvalue

    assert fit(p_t) > 1e-3
    assert fit(p_d[0]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling,draft_vocab,head",
    [
        (SamplingConfig(1.0), 0, "domino"),
        (SamplingConfig(0.8, top_k=4), 0, "domino"),
        (SamplingConfig(1.0, top_p=0.7), 0, "domino"),
        (SamplingConfig(1.0), 5, "domino"),
        (SamplingConfig(1.0), 0, "path"),  # drafts re-ranked among 3 of the 8 tokens per slot
    ],
    ids=["T1", "topk", "topp", "T1-subvocab", "T1-path"],
)
def test_rejection_sampling_preserves_target_distribution(sampling, draft_vocab, head, rule=accept_rejection):
    """Speculative sampling commits 3-token continuations with exactly the target's probabilities.

    Chi-square goodness of fit (fixed seeds) against enumeration (conftest). With a draft vocabulary
    the draft puts zero mass outside it, and the output must not care. rule: the rejection sampler the
    loop runs (the control below passes a wrong one).
    """
    target = soft_target()
    drafter = tiny_drafter(target, head=head, block_size=3, seed=4, draft_vocab=draft_vocab, path_candidates=3)
    prompt = [1, 2, 3, 4]
    proposer = make_proposer(drafter, False)

    @torch.inference_mode()
    def run(seed):
        layers = drafter.config.target_layer_ids
        return decode(target, proposer, None, prompt, 3, sampling, seed, [], layers=layers, rule=rule)

    seen = assert_matches_target_distribution(run, target, prompt, sampling)
    assert seen["accepted_any"] > 100  # drafts are really being accepted, not only resampled


@pytest.mark.slow
def test_sampling_distribution_test_detects_a_wrong_acceptance_rule():
    """The chi-square test above has power: always accepting the drafts must fail it."""

    def accept_all(drafts, draft_probs, target_probs, gen):
        return drafts.shape[0], int(torch.multinomial(target_probs[-1], 1, generator=gen))

    with pytest.raises(AssertionError, match="pvalue|cannot produce"):
        test_rejection_sampling_preserves_target_distribution(SamplingConfig(1.0), 0, "domino", rule=accept_all)


# ----- caches -----


@pytest.mark.parametrize("fuse", [False, True])
def test_draft_context_cache_matches_recomputation(fuse, qwen3_target):
    """Blocks drafted over an incrementally built context cache equal one uncached training forward; with
    the fused last context row, the cache keeps the rows it needs (and grows them when it doubles)."""
    target = qwen3_target
    drafter = tiny_drafter(target, head="domino", block_size=4, fuse_context=fuse)
    ids = torch.tensor([[3, 8, 1, 9, 22, 5, 7, 7, 40, 2, 11, 13, 6, 6, 19]])
    out = target.forward(ids, target.new_cache())
    feats = out.features  # [1, S, n*H]
    cache = drafter.new_cache(max_len=4)  # it doubles on the way
    anchors_pos, z_cached = [], []
    with torch.inference_mode():
        for upto in (5, 6, 9, 14):  # grow the cache in uneven chunks
            drafter.extend_cache(cache, feats[:, cache.length : upto])
            z_cached.append(drafter.backbone_block(cache, ids[0, upto : upto + 1])[0])
            anchors_pos.append(upto)
        pos = torch.tensor(anchors_pos)
        z_full = drafter.forward_blocks(feats, pos, ids[0, pos])
    assert torch.allclose(torch.stack(z_cached), z_full, atol=1e-10)
    if fuse:  # control: the fusion reaches the blocks (without it they move)
        with torch.no_grad():
            drafter.fuse.weight.zero_()
            assert not torch.allclose(drafter.forward_blocks(feats, pos, ids[0, pos]), z_full, atol=1e-6)


def test_target_cache_rollback_matches_recomputation(llama_target):
    """Cropping the target cache after a rejected block gives the same logits as never running it."""
    target = llama_target
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7]])
    full = target.forward(ids, target.new_cache())
    cache = target.new_cache()
    target.forward(ids[:, :4], cache)
    target.forward(torch.tensor([[9, 9, 9]]), cache)  # a block that gets rejected
    target.crop_cache(cache, 4)
    rest = target.forward(ids[:, 4:], cache)
    assert torch.allclose(rest.logits, full.logits[:, 4:], atol=1e-10)
    assert torch.allclose(rest.features, full.features[:, 4:], atol=1e-10)
