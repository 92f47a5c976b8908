"""Domino decoding behind transformers' own `model.generate`.

    from dominospec.integrations import domino_generate
    out = model.generate(**inputs, custom_generate=domino_generate, drafter="my-drafter", max_new_tokens=128)

transformers (5.x) prepares the call as usual (generation config, EOS, max_length, logits processors,
stopping criteria) and hands the decoding loop to `domino_generate`, with the extra keyword
arguments it declares (drafter, lookup, verify, block_size, seed, backend). Here the prepared objects are
mapped onto dominospec's batch-1 loops; what has no faithful mapping is refused by name, never
silently ignored. `write_custom_generate` writes DIR/custom_generate/generate.py so that
`custom_generate="DIR", trust_remote_code=True` does the same by path.

Honoured: max_new_tokens / max_length, do_sample, temperature, top_k, top_p, eos_token_id,
pad_token_id (nothing to pad at batch 1), the streamer, return_dict_in_generate (sequences only),
and any stopping criterion that reads token ids (StopStringCriteria, max_time, user criteria:
checked after every committed token). stop_strings= works by path; with the callable, transformers
itself refuses it (it does not pass the tokenizer on), so pass StopStringCriteria(tok, [...]).
Refused: batch > 1, num_beams > 1, num_return_sequences > 1, assisted decoding
(prompt_lookup_num_tokens: use drafter="lookup"), output_scores / output_logits / output_attentions /
output_hidden_states, a cache with content, inputs_embeds, and every logits processor other than the
temperature, top-k and top-p warpers (repetition_penalty, min_new_tokens, bad_words_ids, min_p, ...).
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..drafter import Drafter
from ..drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from ..errors import DominoError
from ..io import ensure_writable_dir, write_atomic
from ..log import log
from ..sampling import SamplingConfig
from ..targets import Target
from ..targets.hf import BACKENDS
from ..tune.spec import LOOKUP, SpecConfig, bind, parse_spec, run_spec

WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")  # what SamplingConfig expresses
REFUSED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class UnsupportedSetting(DominoError, ValueError):
    """A generate() setting dominospec cannot honour (a ValueError, as transformers' own refusals are)."""


# ----- one packed target per HF model object -----

# model -> (weights stamp, Target.backend_state(): the packed forward or why there is none). Weak keys: the
# entry dies with the model; the value holds weight tensors and packed copies, never the model itself, so it
# does not keep it alive.
_NATIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {(drafter directory, its weights' mtime): Drafter attached to it}
_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_stamp(model: nn.Module) -> tuple:
    # the native path keeps fused copies of the weights: an in-place update (an optimizer step bumps
    # `_version`), a reassignment or a .to() must repack them
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


def target_for(model: nn.Module, backend: str = "auto") -> Target:
    """A Target over the user's model; the native weights are packed once per model (and weights version).

    The user's model is left as it was: Target freezes and evaluates the model it wraps, so the
    requires_grad flags and train/eval mode are restored here.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    try:
        target = Target(model, tokenizer=None, name=name, backend="hf")
        if backend != "hf":
            stamp = _weights_stamp(model)
            entry = _NATIVE.get(model)
            if entry is None or entry[0] != stamp:
                packed = Target(model, tokenizer=None, name=name, backend=backend)
                entry = (stamp, packed.backend_state())
                _NATIVE[model] = entry
            target.use_backend_state(entry[1])
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(training)
    return target


def _drafter_word(model, drafter):
    """drafter= as parse_spec reads it: a directory is loaded once per model (again when retrained), unattached."""
    if drafter is None or isinstance(drafter, Drafter) or (isinstance(drafter, str) and drafter == LOOKUP):
        return drafter
    if isinstance(drafter, (str, os.PathLike)):
        weights = Path(drafter).resolve() / WEIGHTS_NAME
        key = (str(weights), weights.stat().st_mtime_ns if weights.exists() else None)  # retrained: reload
        loaded = _DRAFTERS.setdefault(model, {})
        if key not in loaded:
            loaded[key] = Drafter.from_pretrained(drafter)
        return loaded[key]
    raise UnsupportedSetting(
        f"drafter={drafter!r}: give a drafter directory, a dominospec Drafter, or {LOOKUP!r} (prompt lookup)"
    )


# ----- the generate() settings, mapped or refused -----


def _spec(model, drafter, lookup, verify, block_size, seed, backend) -> SpecConfig:
    """domino_generate's own keyword arguments, parsed by the one parser (tune/spec.py, the hook's row of
    SURFACE_DEFAULTS) and named as the caller wrote them (not as CLI flags)."""
    if backend not in BACKENDS:
        raise UnsupportedSetting(f"backend={backend!r}: choose from {', '.join(map(repr, BACKENDS))}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise UnsupportedSetting(f"seed={seed!r}: an integer, or None")
    try:
        word = _drafter_word(model, drafter)
        return parse_spec(
            "hook", drafter=word, lookup=lookup, verify=verify, block_size=block_size, seed=seed, flags=False
        )
    except UnsupportedSetting:
        raise
    except DominoError as exc:
        raise UnsupportedSetting(str(exc)) from None


def _check_generation_config(gc, model_kwargs: dict) -> None:
    if getattr(gc, "num_beams", 1) and gc.num_beams > 1:
        raise UnsupportedSetting(f"num_beams={gc.num_beams}: beam search is not speculative decoding; use num_beams=1")
    if getattr(gc, "num_return_sequences", 1) and gc.num_return_sequences > 1:
        raise UnsupportedSetting(
            f"num_return_sequences={gc.num_return_sequences}: dominospec decodes one sequence per call (batch 1)"
        )
    if getattr(gc, "prompt_lookup_num_tokens", None):
        raise UnsupportedSetting(
            f"prompt_lookup_num_tokens={gc.prompt_lookup_num_tokens}: transformers' assisted decoding; "
            "pass drafter='lookup' for dominospec's prompt lookup"
        )
    wanted = [name for name in REFUSED_OUTPUTS if getattr(gc, name, False)]
    if wanted:
        raise UnsupportedSetting(
            f"{', '.join(f'{n}=True' for n in wanted)}: dominospec returns the sequences only "
            "(scores, logits, attentions and hidden states are not computed per generated token)"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise UnsupportedSetting("inputs_embeds: dominospec decodes from input_ids")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0:
        raise UnsupportedSetting("a cache that already holds tokens: dominospec starts every call from the prompt")


def sampling_from(gc, logits_processor) -> SamplingConfig:
    """Greedy, or the warpers transformers built from temperature / top_k / top_p; any other processor is refused."""
    other = [type(p).__name__ for p in logits_processor or [] if type(p).__name__ not in WARPERS]
    if other:
        raise UnsupportedSetting(
            f"logits processors {', '.join(other)}: dominospec applies only temperature, top_k and top_p "
            "(the acceptance rule must see the same distribution the target samples from); drop the settings "
            "that add them (repetition_penalty, min_new_tokens, bad_words_ids, min_p, ...)"
        )
    if not gc.do_sample:
        return SamplingConfig()  # greedy: warpers never change the argmax
    temperature, top_k, top_p = 1.0, 0, 1.0
    for p in logits_processor:
        kind = type(p).__name__
        if kind == "TemperatureLogitsWarper":
            temperature = float(p.temperature)
        elif kind == "TopKLogitsWarper":
            top_k = int(p.top_k)
        elif kind == "TopPLogitsWarper":
            top_p = float(p.top_p)
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)


def _split_criteria(stopping_criteria, prompt_len: int) -> tuple[int | None, list[int] | None, list]:
    """(max_new_tokens, EOS ids, the criteria left to check token by token) from transformers' list:
    the length and EOS criteria become the loop's own arguments, any other is checked after every token."""
    max_new, eos, rest = None, None, []
    for c in stopping_criteria or []:
        kind = type(c).__name__
        if kind == "MaxLengthCriteria":
            room = int(c.max_length) - prompt_len
            max_new = room if max_new is None else min(max_new, room)
        elif kind == "EosTokenCriteria":
            ids = c.eos_token_id
            ids = ids.tolist() if torch.is_tensor(ids) else ids
            eos = sorted(set(eos or []) | set([ids] if isinstance(ids, int) else ids))
        else:
            rest.append(c)
    return max_new, eos, rest


class _Stop(Exception):
    """Raised from the token callback when a stopping criterion fires: ends the loop early."""


def _prompt_ids(input_ids: torch.Tensor, attention_mask) -> list[int]:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise UnsupportedSetting(
            f"input_ids of shape {tuple(input_ids.shape)}: dominospec's generate decodes batch 1 "
            "(one prompt per call); loop over the prompts"
        )
    ids = input_ids[0].tolist()
    if attention_mask is None:
        return ids
    mask = attention_mask[0].tolist()
    start = next((i for i, m in enumerate(mask) if m), len(mask))
    if not all(mask[start:]):
        raise UnsupportedSetting("attention_mask with holes: only left padding is supported at batch 1")
    return ids[start:]  # left padding dropped: positions then match transformers' own


def _caller_streamer():
    # transformers 5.x puts the prompt into the streamer, then leaves `streamer` out of a callable's
    # arguments (it keeps only the names the plain sampling loop lacks); it is still a local of generate()
    frame = inspect.currentframe().f_back.f_back
    while frame is not None:
        if frame.f_code.co_name == "generate" and "custom_generate" in frame.f_locals:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


# ----- the callable -----


def domino_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    streamer=None,
    drafter=None,
    verify: str | None = None,
    block_size: int | None = None,
    seed: int | None = None,
    backend: str = "auto",
    lookup: bool | None = None,
    **model_kwargs,
):
    """The decoding loop for `model.generate(..., custom_generate=domino_generate)`.

    drafter: a drafter directory, a dominospec Drafter, "lookup" (prompt lookup), or None (plain decoding
    on dominospec's path); lookup=True runs a drafter with prompt lookup (the hybrid). verify: a mode of
    decode/schedule.py VERIFY_MODES (see `dominospec generate --help`; fixed by default here: a caller passing
    a drafter gets no device measurement on its first call; tune/spec.py SURFACE_DEFAULTS). block_size:
    drafts per cycle (default: the drafter's). seed: the sampling seed (default: drawn from torch's global
    generator, so torch.manual_seed makes a sampled call repeatable). backend: auto | native | hf.
    Returns [1, prompt + new] ids, or a GenerateDecoderOnlyOutput when return_dict_in_generate.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    gc = generation_config if generation_config is not None else model.generation_config
    streamer = streamer if streamer is not None else _caller_streamer()
    spec = _spec(model, drafter, lookup, verify, block_size, seed, backend)
    _check_generation_config(gc, model_kwargs)
    prompt = _prompt_ids(input_ids, model_kwargs.get("attention_mask"))
    sampling = sampling_from(gc, logits_processor)
    max_new, eos, criteria = _split_criteria(stopping_criteria, input_ids.shape[1])
    if max_new is None:
        raise UnsupportedSetting("no max_length / max_new_tokens reached the call: set max_new_tokens")
    if max_new < 1:
        raise UnsupportedSetting(f"max_length {input_ids.shape[1] + max_new} leaves no room after the prompt")
    if seed is None and not sampling.greedy:
        spec = replace(spec, seed=int(torch.randint(0, 2**62, (1,))))
    target = target_for(model, backend)
    spec = bind(spec, target)  # cheap for a loaded drafter: checks the fit, borrows the tables

    new: list[int] = []

    def on_tokens(tokens: list[int]) -> None:
        for i, tok in enumerate(tokens):
            new.append(tok)
            if criteria:
                seq = torch.tensor([input_ids[0].tolist() + new], device=input_ids.device)
                if any(bool(c(seq, None).any()) for c in criteria):
                    if streamer is not None:
                        streamer.put(torch.tensor(tokens[: i + 1]))
                    raise _Stop
        if streamer is not None:
            streamer.put(torch.tensor(tokens))

    result = None
    try:
        result = run_spec(spec, target, prompt, max_new, sampling, eos_ids=eos, on_tokens=on_tokens)
    except _Stop:
        pass
    finally:
        if streamer is not None:
            streamer.end()
    for note in result.notes if result is not None else []:  # e.g. max_new_tokens capped at the context
        log(note)
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def generate_by_path(model, drafter=None, **generate_arguments):
    """What custom_generate/generate.py runs: transformers calls it with generate()'s own arguments
    (custom_generate="DIR" skips generate's preparation), so it runs generate with domino_generate."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    generate_arguments.pop("custom_generate", None)
    stop_strings, tokenizer = generate_arguments.pop("stop_strings", None), generate_arguments.get("tokenizer")
    if stop_strings and tokenizer is not None:
        # transformers keeps the tokenizer from a callable, and stop_strings need it: build the criterion here
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        criteria = StoppingCriteriaList(generate_arguments.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer, strings))
        generate_arguments["stopping_criteria"] = criteria
    elif stop_strings:
        generate_arguments["stop_strings"] = stop_strings  # transformers says a tokenizer is needed
    # the class's generate: from_pretrained(..., trust_remote_code=True) may have replaced the instance's
    return type(model).generate(model, custom_generate=domino_generate, drafter=drafter, **generate_arguments)


# ----- custom_generate/generate.py -----

GENERATE_PY = '''"""transformers custom_generate entry, written by `dominospec custom-generate`.

    model.generate(**inputs, custom_generate="{out}", trust_remote_code=True)

decodes with dominospec and the drafter in {drafter} (pass drafter=... to use another).
"""

from dominospec.integrations.transformers import generate_by_path

DRAFTER = {drafter!r}


def generate(model, drafter=DRAFTER, **kwargs):
    return generate_by_path(model, drafter=drafter, **kwargs)
'''


def write_custom_generate(drafter: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write OUT/custom_generate/generate.py (OUT defaults to the drafter directory); returns its path.

    transformers copies the file into its module cache before running it, so the drafter's absolute
    path is written into it: move the drafter, write it again.
    """
    if drafter == LOOKUP:
        if out is None:
            raise DominoError("DRAFTER lookup has no directory to write next to: give --out DIR")
        value = LOOKUP
    else:
        value = str(Path(drafter).resolve())
        if not (Path(value) / CONFIG_NAME).exists():
            raise DominoError(f"DRAFTER {drafter}: no {CONFIG_NAME} there (is it a drafter directory?)")
    root = Path(out if out is not None else value).resolve()
    folder = ensure_writable_dir(root / "custom_generate", "--out")
    path = folder / "generate.py"
    write_atomic(path, GENERATE_PY.format(out=root, drafter=value))
    return path
