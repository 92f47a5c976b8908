"""transformers' own `generate`: the baselines users know, and batched sampling for data making."""

from __future__ import annotations

import torch


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
    """Batched generation (left padded); each answer cut after its first EOS."""
    if not prompts:
        return []
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
