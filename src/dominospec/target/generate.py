"""Batched and baseline generation: transformers' own `generate` (the baselines users know) and
the native batched sampler that makes training data.

`sample_batch` on a native target runs all prompts of a batch as rows of one ragged KV cache
(each row at its own length), samples every row with its own random stream (so a sample does not
depend on its batch mates' random draws), and drops finished rows from the cache as they end.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingConfig, warp_probs


@torch.inference_mode()
def hf_generate(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, prompt_lookup: int = 0) -> list[int]:
    """Plain transformers decoding (or its prompt lookup with `prompt_lookup` tokens), batch 1."""
    ids = torch.tensor([prompt_ids], device=target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                  eos_token_id=target.eos_ids or None, pad_token_id=target.pad_id)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def sample_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.7,
                 top_p: float = 0.8, top_k: int = 0, seed: int = 0) -> list[list[int]]:
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
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
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
def native_sample_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.7,
                        top_p: float = 0.8, top_k: int = 0, seed: int = 0) -> list[list[int]]:
    native, dev = target.native, target.device
    sampling = SamplingConfig(temperature, top_k, top_p)
    lens = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lens), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)  # right padding: row i's real tokens start at position 0
    cache = native.new_cache(batch=len(prompts), max_len=max(lens) + max_new_tokens + 1)
    logits, _ = native(ids.to(dev), cache, num_new=lens, logits="last")  # [B, V]
    gens = [torch.Generator(device=dev).manual_seed((seed + 7919 * i) % 2**63) for i in range(len(prompts))]
    eos = set(target.eos_ids)
    answers: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # prompt index of each live cache row
    for _ in range(max_new_tokens):
        if sampling.greedy:
            picks = logits.argmax(-1).tolist()
        else:
            probs = warp_probs(logits, sampling)  # [rows, V]
            picks = [int(torch.multinomial(probs[r], 1, generator=gens[i])) for r, i in enumerate(rows)]
        alive = []
        for r, (i, t) in enumerate(zip(rows, picks)):
            answers[i].append(t)
            if t not in eos:
                alive.append(r)
        if not alive:
            break
        if len(alive) < len(rows):  # finished rows leave the batch: no compute spent on them
            cache.keep_rows(alive)
            rows = [rows[r] for r in alive]
            picks = [picks[r] for r in alive]
        logits, _ = native(torch.tensor(picks, device=dev)[:, None], cache, logits="last")
    return answers
