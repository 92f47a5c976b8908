"""Sequential heads: what turns the backbone's parallel base logits into left-to-right drafts.

Every head sees, for block slot k, the backbone state z_k and the token realised just before
the slot's target, prev_k = x_{a+k} (slot 0: the anchor). It also sees the slot's base
logits base_k (what a head that re-ranks candidates needs) and returns a logit correction
delta_k (None: no correction) so that final_k = base_k + delta_k. At inference `step` runs left
to right over drafted tokens; in training `teacher_forced` runs all slots at once over the true
tokens. Each head also owns its training loss and says what that loss needs, so adding a head
means adding a class here and a line in HEADS.

  none    the backbone alone
  domino  GRU causal encoder over realised block tokens + low-rank logit correction; trained
          with the base-anchored curriculum (1-λ)·CE(final) + λ·CE(base)
  markov  DSpark's rank-r bigram correction, trained with 0.1·CE + 0.9·L1(p_d, p_t)
  rnn     DSpark's gated recurrent correction, same loss as markov
  path    a path selector (after DFlash2): among the top-m base candidates of each slot, a low-rank
          pair score of (previous token, candidate) gated by the context re-ranks; the Domino loss
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import acceptance_rate

# ce(logits [N, B, V']) -> position-weighted cross-entropy sum over the step's labels
WeightedCE = Callable[[torch.Tensor], torch.Tensor]


class NoHead(nn.Module):
    corrects = False  # proposes straight from the base logits
    needs_target_probs = False  # its loss needs the target's distribution at each slot
    uses_curriculum = False  # its loss reads the curriculum weight λ
    vocab_rows: tuple[str, ...] = ()  # weights with one row per draft-vocabulary slot (follow a new vocabulary)

    def __init__(self, c=None):
        super().__init__()

    def init_state(self, z):
        return None

    def step(self, k, z_k, prev_emb, prev_id, state, base_k):
        return None, state

    def teacher_forced(self, z, prev_emb, prev_ids, base):
        return None

    def zero_correction(self) -> None:
        """Make an untrained head leave the base logits unchanged."""

    def loss(self, base, final, ce: WeightedCE, p_t, weights, lam: float):
        terms = {"ce": ce(base)}
        return terms["ce"], terms


class DominoHead(NoHead):
    """GRU causal encoder over realised block tokens + low-rank logit correction."""

    corrects = True
    vocab_rows = ("w2.weight",)
    uses_curriculum = True

    def __init__(self, c):
        super().__init__()
        g = c.gru_hidden_size
        self.g = g
        self.gru_ih = nn.Linear(c.hidden_size, 3 * g, bias=False)  # gates in PyTorch order r, z, n
        self.gru_hh = nn.Linear(g, 3 * g, bias=False)
        self.w1_z = nn.Linear(c.hidden_size, c.rank, bias=False)  # W1 split over [z ; s]
        self.w1_s = nn.Linear(g, c.rank, bias=False)
        self.w2 = nn.Linear(c.rank, c.out_vocab, bias=False)
        self.zero_correction()

    def zero_correction(self) -> None:
        nn.init.zeros_(self.w2.weight)

    def gru_cell(self, x_proj, s):
        r_i, z_i, n_i = x_proj.chunk(3, dim=-1)
        r_h, z_h, n_h = self.gru_hh(s).chunk(3, dim=-1)
        r = torch.sigmoid(r_i + r_h)
        u = torch.sigmoid(z_i + z_h)
        n = torch.tanh(n_i + r * n_h)
        return (1 - u) * n + u * s

    def init_state(self, z):
        return z.new_zeros(z.shape[0], self.g)

    def step(self, k, z_k, prev_emb, prev_id, state, base_k):
        state = self.gru_cell(self.gru_ih(prev_emb), state)
        if k == 0:  # slot 0 stays pure: the backbone already sees the anchor
            return None, state
        return self.w2(F.silu(self.w1_z(z_k) + self.w1_s(state))), state

    def teacher_forced(self, z, prev_emb, prev_ids, base):
        # z: [N, B, H]; prev_emb: [N, B, H] embeddings of x_{a..a+B-1}
        x_proj = self.gru_ih(prev_emb)
        s = z.new_zeros(z.shape[0], self.g)
        states = []
        for k in range(z.shape[1]):
            s = self.gru_cell(x_proj[:, k], s)
            states.append(s)
        states = torch.stack(states, dim=1)  # [N, B, G]
        delta = self.w2(F.silu(self.w1_z(z) + self.w1_s(states)))
        return torch.cat([torch.zeros_like(delta[:, :1]), delta[:, 1:]], dim=1)

    def loss(self, base, final, ce: WeightedCE, p_t, weights, lam: float):
        # base-anchored curriculum: without the CE(base) anchor the correction path lets the backbone collapse
        terms = {"ce_final": ce(final), "ce_base": ce(base)}
        return (1 - lam) * terms["ce_final"] + lam * terms["ce_base"], terms


class DSparkHead(NoHead):
    """Shared loss of DSpark's heads: a little CE, mostly L1 between draft and target distributions."""

    corrects = True
    vocab_rows = ("w2.weight",)
    needs_target_probs = True

    def zero_correction(self) -> None:
        nn.init.zeros_(self.w2.weight)

    def loss(self, base, final, ce: WeightedCE, p_t, weights, lam: float):
        p_d = torch.softmax(final, -1)
        # L1 = 2·TV, counting target mass outside a draft vocabulary as disagreement
        l1 = (2 * (1 - acceptance_rate(p_d, p_t)) * weights).sum()
        terms = {"ce": ce(final), "l1": l1}
        return 0.1 * terms["ce"] + 0.9 * l1, terms


class MarkovHead(DSparkHead):
    """DSpark's rank-r bigram correction B(x_{k-1}, .) = W2 W1[x_{k-1}]."""

    def __init__(self, c):
        super().__init__()
        self.w1 = nn.Embedding(c.vocab_size, c.rank)
        self.w2 = nn.Linear(c.rank, c.out_vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(c.rank))
        self.zero_correction()

    def step(self, k, z_k, prev_emb, prev_id, state, base_k):
        return self.w2(self.w1(prev_id)), state

    def teacher_forced(self, z, prev_emb, prev_ids, base):
        return self.w2(self.w1(prev_ids))


class RNNHead(DSparkHead):
    """DSpark's gated recurrent correction over [s_{k-1} ; W1[x_{k-1}] ; h_k]."""

    def __init__(self, c):
        super().__init__()
        r = c.rank
        self.r = r
        self.w1 = nn.Embedding(c.vocab_size, r)
        self.cell = nn.Linear(2 * r + c.hidden_size, 3 * r, bias=True)
        self.w2 = nn.Linear(r, c.out_vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(r))
        self.zero_correction()

    def init_state(self, z):
        return z.new_zeros(z.shape[0], self.r)

    def _cell(self, s, e, h):
        g, c, o = self.cell(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        s = gate * s + (1 - gate) * torch.tanh(c)
        return s, self.w2(torch.tanh(o))

    def step(self, k, z_k, prev_emb, prev_id, state, base_k):
        state, delta = self._cell(state, self.w1(prev_id), z_k)
        return delta, state

    def teacher_forced(self, z, prev_emb, prev_ids, base):
        e = self.w1(prev_ids)
        s = z.new_zeros(z.shape[0], self.r)
        deltas = []
        for k in range(z.shape[1]):
            s, d = self._cell(s, e[:, k], z[:, k])
            deltas.append(d)
        return torch.stack(deltas, dim=1)


class PathHead(NoHead):
    """A path selector over the top-m base candidates of each slot (after DFlash2, August 2026).

    Slot k keeps the m best tokens of its base logits and adds to each candidate c a pair score
    <A[x_{a+k}] * sigmoid(G z_k), C[c]>: a rank-r code of the previous token, gated by the context,
    against a rank-r code of the candidate. Everything outside the candidates keeps its base logit,
    so the distribution drafted from is a full one (sampling stays lossless) and greedy walks one
    path through the candidates. Slot 0 stays pure, as in the Domino head. Trained with the Domino
    loss and curriculum; the candidates are chosen without gradient.
    """

    corrects = True
    vocab_rows = ("w2.weight",)
    uses_curriculum = True

    def __init__(self, c):
        super().__init__()
        self.m = min(c.path_candidates, c.out_vocab)
        self.w1 = nn.Embedding(c.vocab_size, c.rank)  # previous token (target id) -> its code
        self.gate = nn.Linear(c.hidden_size, c.rank, bias=False)  # context z_k -> which code dimensions count
        self.w2 = nn.Embedding(c.out_vocab, c.rank)  # candidate (draft-vocabulary index) -> its code
        # unit-scale codes: the candidate codes start at zero, and Adam moves each element by about the learning
        # rate per step, so the pair scores grow as fast as the previous token's code is large
        nn.init.normal_(self.w1.weight, std=1.0)
        self.zero_correction()

    def zero_correction(self) -> None:
        nn.init.zeros_(self.w2.weight)

    def scores(self, base, z, prev_ids):
        """(candidates [..., m] by base logit, their pair scores [..., m]) of base [..., V'], z [..., H], prev ids."""
        cands = base.detach().topk(self.m, dim=-1).indices
        a = self.w1(prev_ids) * torch.sigmoid(self.gate(z))  # [..., r]
        pair = (self.w2(cands) * a.unsqueeze(-2).to(self.w2.weight.dtype)).sum(-1)
        return cands, pair

    def step(self, k, z_k, prev_emb, prev_id, state, base_k):
        if k == 0:
            return None, state
        cands, pair = self.scores(base_k, z_k, prev_id)
        return torch.zeros_like(base_k).scatter_(-1, cands, pair.to(base_k.dtype)), state

    def teacher_forced(self, z, prev_emb, prev_ids, base):
        cands, pair = self.scores(base, z, prev_ids)  # [N, B, m]
        delta = torch.zeros_like(base).scatter(-1, cands, pair.to(base.dtype))
        return torch.cat([torch.zeros_like(delta[:, :1]), delta[:, 1:]], dim=1)

    loss = DominoHead.loss


HEADS: dict[str, type[NoHead]] = {
    "none": NoHead,
    "domino": DominoHead,
    "markov": MarkovHead,
    "rnn": RNNHead,
    "path": PathHead,
}


# what the confidence head reads: z_prev_embed = [z_k ; embed(x_{a+k})]; z = z_k alone, DSpark's
# confidence head without the Markov input, which SGLang and vLLM compute (an exact export)
CONFIDENCE_INPUTS = ("z_prev_embed", "z")


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w . [z_k ; embed(x_{a+k})]) (or w . z_k): P(slot k's draft survives | earlier ones did).

    Trained with soft BCE against the analytic acceptance (or the greedy hit); at inference its
    logits travel with each proposal, for a verify-length policy to read.
    """

    def __init__(self, c):
        super().__init__()
        self.reads_prev = c.confidence_inputs == "z_prev_embed"
        self.proj = nn.Linear((2 if self.reads_prev else 1) * c.hidden_size, 1, bias=True)

    def forward(self, z, prev_emb):
        x = torch.cat([z, prev_emb], dim=-1) if self.reads_prev else z
        return self.proj(x).squeeze(-1)  # logits [N, B]

    def loss(self, z, prev_emb, final, labels, p_t, weights):
        conf = self(z, prev_emb)
        with torch.no_grad():
            if p_t is None:  # without the target's distribution, the greedy hit is the label
                label = (final.argmax(-1) == labels).float()
            else:
                label = acceptance_rate(torch.softmax(final, -1), p_t)
        return (F.binary_cross_entropy_with_logits(conf, label, reduction="none") * weights).sum()
