"""On-policy answers through a fixed number of cache rows, each refilled as soon as its answer ends.

A static batch decodes until its longest answer ends: rows that finished early either ride along
as padding or are dropped, and the batch shrinks to its stragglers. Here the batch is a set of
slots (rows of one native KV cache, as in the serving engine): when a row's answer ends, the next
waiting job is prefilled into that row alone and joins the very next decode step, so every step
runs with a full batch until the work runs out.

A job is one answer: (prompt ids, token budget, seed). Each job draws from its own random
generator seeded by the job, so what it samples does not depend on which jobs share the batch.
Jobs may be added while others run (the next turn of a conversation, after its answer so far).

With `capture`, the target's hidden states at those layers are kept for every position a job's
passes compute (its prompt's prefill, then one row per decode step), and a finished row runs one
more step with its last token, so a job ends holding the states of every token of prompt + answer:
what a separate no-cache pass over the sample would give, up to batch-shape rounding, and the
trainer's feature pass need not run again. It also keeps the log-normaliser of the next-token logits
those passes compute (the prompt's last token and every answer token), which a distilling trainer
would otherwise get from one more pass of the full LM head over the sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingConfig, sample_rows


@dataclass
class AnswerJob:
    """One answer to write: the prompt it continues, how many tokens it may take, its sampling seed."""

    key: object  # the caller's handle (conversation index and turn)
    prompt: list[int]
    budget: int
    seed: int
    answer: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # with capture: [n, W] pieces, prompt then answer
    lse: list[torch.Tensor] = field(default_factory=list)  # with capture: [1] pieces, the prompt's last token on

    def captured(self) -> torch.Tensor:
        """[len(prompt) + len(answer), W]: the captured layers' states of every token, in order."""
        return torch.cat(self.states)

    def captured_lse(self) -> torch.Tensor:
        """[len(prompt) + len(answer)] fp32: the log-normaliser of the target's next-token logits at every position
        whose logits the passes computed (the prompt's last token and every answer token); NaN at the prompt's
        earlier positions, whose logits the prefill never computes."""
        head = torch.full((len(self.prompt) - 1,), float("nan"))
        return torch.cat([head, torch.cat(self.lse).float().cpu()])


@torch.inference_mode()
def sample_in_slots(
    target,
    next_job: Callable[[], AnswerJob | None],
    on_done: Callable[[AnswerJob], None],
    slots: int,
    sampling: SamplingConfig,
    max_len: int = 1024,
    capture: list[int] | None = None,
) -> int:
    """Answer jobs until next_job() has none left and every row is done; returns the decode steps run.

    next_job: the next waiting job or None (called whenever a row is free, so it may hand out jobs
    that on_done queued). on_done(job): called once per job, its answer complete (EOS included,
    or `budget` tokens). The cache starts at max_len positions per row and grows if a job needs more.
    capture: decoder layers whose states each job collects in job.states (the target dtype, the layers side by
    side, as the native forward's feature_layers gives them), complete when on_done sees the job.
    """
    dev = target.device
    eos = set(target.eos_ids)
    cache = target.new_row_cache(slots, max_len)
    jobs: list[AnswerJob | None] = [None] * slots  # the job in each cache row
    gens: list[torch.Generator | None] = [None] * slots
    logits = torch.zeros(
        slots, target.vocab_size, dtype=target.row_logits_dtype, device=dev
    )  # [R, V] next-token logits
    exhausted, steps = False, 0
    while True:
        for r in range(len(jobs)):  # refill free rows: each new prompt prefilled alone, no padding computed
            while jobs[r] is None and not exhausted:
                job = next_job()
                if job is None:
                    exhausted = True
                elif job.budget < 1:
                    on_done(job)  # nothing to write (no room left in the context); may queue more
                else:
                    _prefill(target, cache, r, job, logits, dev, capture)
                    jobs[r] = job
                    gens[r] = torch.Generator(device=dev).manual_seed(job.seed)
        busy = [r for r, job in enumerate(jobs) if job is not None]
        if not busy:
            return steps
        if exhausted and len(jobs) - len(busy) >= max(1, len(jobs) // 4):
            # no more work to fill them: free rows leave the cache, a quarter at a time (a drop copies it)
            cache.keep_rows(busy)
            logits = logits[busy]
            jobs, gens = [jobs[r] for r in busy], [gens[r] for r in busy]
            busy = list(range(len(jobs)))
        picks, closing = [0] * len(jobs), []
        for r, t in zip(busy, sample_rows(logits[busy], sampling, [gens[r] for r in busy])):
            job = jobs[r]
            job.answer.append(t)
            picks[r] = t
            if t in eos or len(job.answer) >= job.budget:
                closing.append(r)
        if not capture:  # a finished row leaves now; with capture, after one more step computes its last token
            _close(closing, jobs, gens, cache, on_done)
            exhausted = exhausted and not closing  # on_done may have queued a conversation's next turn
        going = [int(job is not None) for job in jobs]
        if not any(going):
            continue  # every row ended at once: refill before running anything
        cache.ensure(max(cache.lengths) + 1)
        ids = torch.tensor(picks, device=dev)[:, None]
        out = target.forward_rows(ids, cache, going, 0, "last", capture, with_features=bool(capture))
        logits, states = out.logits[:, 0], out.features  # [R, V], [R, 1, W]
        steps += 1
        if capture:
            lse = torch.logsumexp(logits.float(), -1, keepdim=True)  # [R, 1], before sampling reads the logits
            for r, job in enumerate(jobs):
                if job is not None:
                    job.states.append(states[r].clone())
                    job.lse.append(lse[r])
            _close(closing, jobs, gens, cache, on_done)
            exhausted = exhausted and not closing


def _close(rows: list[int], jobs: list, gens: list, cache, on_done) -> None:
    """Hand the jobs of these rows to on_done and free the rows."""
    for r in rows:
        on_done(jobs[r])
        jobs[r] = gens[r] = None
        cache.set_length(r, 0)


def _prefill(target, cache, r: int, job: AnswerJob, logits: torch.Tensor, dev, capture=None) -> None:
    """Run job.prompt into cache row r (emptied first); its last-token logits land in logits[r]."""
    cache.ensure(len(job.prompt) + job.budget + 1)  # before the row's forward: a row view cannot grow
    cache.set_length(r, 0)
    ids = torch.tensor([job.prompt], device=dev)  # [1, P]
    out = target.forward_rows(ids, cache, None, r, "last", capture, with_features=bool(capture))  # logits [1, 1, V]
    logits[r] = out.logits[0, 0]
    if capture:
        job.states = [out.features[0]]  # [len(prompt), W]
        job.lse = [torch.logsumexp(out.logits[0, 0].float(), -1, keepdim=True)]  # the prompt's last position
