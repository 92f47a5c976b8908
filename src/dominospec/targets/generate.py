"""Batched and baseline generation: transformers' own `generate` (the baselines users know) and
the native batched sampler that makes training data.

`sample_batch` on a native target runs all prompts of a batch as rows of one ragged KV cache
(each row at its own length), samples every row with its own random stream (so a sample does not
depend on its batch mates' random draws), and drops finished rows from the cache as they end.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingConfig, sample_rows


@torch.inference_mode()
def hf_generate(
    target,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    prompt_lookup: int = 0,
) -> list[int]:
    """Plain transformers decoding (or its prompt lookup with `prompt_lookup` tokens), batch 1."""
    ids = torch.tensor([prompt_ids], device=target.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        eos_token_id=target.eos_ids or None,
        pad_token_id=target.pad_id,
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, ids.shape[1] :].tolist()


@torch.inference_mode()
def sample_batch(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.7,
    top_p: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
) -> list[list[int]]:
    """Batched generation; each answer cut after its first EOS (native ragged rows, or transformers' left padding)."""
    if not prompts:
        return []
    if getattr(target, "native", None) is not None:
        return native_sample_batch(target, prompts, max_new_tokens, temperature, top_p, top_k, seed)
    pad = target.pad_id if target.pad_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(target.device), mask.to(target.device)
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=target.eos_ids or None, pad_token_id=pad)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = target.model.generate(ids, attention_mask=mask, **kwargs)[:, width:].tolist()
    eos = set(target.eos_ids)
    answers = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


@torch.inference_mode()
def native_sample_batch(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.7,
    top_p: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
) -> list[list[int]]:
    native, dev = target.native, target.device
    sampling = SamplingConfig(temperature, top_k, top_p)
    cache = native.new_cache(batch=len(prompts), max_len=max(len(p) for p in prompts) + max_new_tokens + 1)
    last = []
    for b, p in enumerate(prompts):  # each prompt prefilled alone: no compute spent on padding
        row = cache.row(b)
        logits, _ = native(torch.tensor([p], device=dev), row, logits="last")  # [1, V]
        cache.set_length(b, row.length())
        last.append(logits)
    logits = torch.cat(last)  # [B, V]
    gens = [torch.Generator(device=dev).manual_seed((seed + 7919 * i) % 2**63) for i in range(len(prompts))]
    eos = set(target.eos_ids)
    answers: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # prompt index of each cache row (finished ones until dropped)
    done: set[int] = set()
    for _ in range(max_new_tokens):
        picks = sample_rows(logits, sampling, [gens[i] for i in rows])
        for i, t in zip(rows, picks):
            if i not in done:
                answers[i].append(t)
                if t in eos:
                    done.add(i)
        if len(done) == len(prompts):
            break
        alive = [r for r, i in enumerate(rows) if i not in done]
        if len(rows) - len(alive) >= max(1, len(rows) // 4):
            # finished rows leave the batch, a quarter at a time: dropping a row copies the whole cache
            cache.keep_rows(alive)
            rows = [rows[r] for r in alive]
            picks = [picks[r] for r in alive]
        logits, _ = native(torch.tensor(picks, device=dev)[:, None], cache, logits="last")
    return answers
