"""The drafter's configuration: what it must match in its target, its shape, and its head.

Stored as config.json next to model.safetensors; `from_dict` names unknown or missing keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import DominoError
from ..targets.features import check_layer_ids
from .heads import CONFIDENCE_INPUTS, HEADS

FORMAT = "dominospec-drafter/1"


@dataclass
class DrafterConfig:
    # what the drafter must match in its target
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    target_layer_ids: list[int]
    # backbone
    num_layers: int = 2
    intermediate_size: int = 1536
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    block_size: int = 8
    mask_token_id: int | None = None  # None: a learned mask vector
    draft_vocab_size: int = 0  # >0: score only this many frequent tokens (lossless; cheaper on CPU)
    # add a projection of the last context row before the anchor (the target's state there) to every block
    # row's input, as EAGLE feeds its drafter the target's last feature; no serving engine reads it
    fuse_context: bool = False
    # sequential head
    head: str = "domino"
    gru_hidden_size: int = 256
    rank: int = 64
    path_candidates: int = 16  # head "path": candidates per slot among which the pair scores choose
    confidence_head: bool = False
    confidence_inputs: str = "z_prev_embed"  # z_prev_embed: [z_k ; embed(x_{a+k})]; z: z_k alone (DSpark's form)
    # bookkeeping
    target_name: str = ""
    format: str = FORMAT
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        problems = []
        if self.head not in HEADS:
            problems.append(f"head {self.head!r} is not one of {list(HEADS)}")
        for name in (
            "hidden_size",
            "vocab_size",
            "num_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "block_size",
            "gru_hidden_size",
            "rank",
            "path_candidates",
        ):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % max(1, self.num_key_value_heads):
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.confidence_inputs not in CONFIDENCE_INPUTS:
            problems.append(f"confidence_inputs {self.confidence_inputs!r} is not one of {list(CONFIDENCE_INPUTS)}")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} outside 0..vocab_size {self.vocab_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}")
        if problems:
            raise DominoError("invalid drafter config: " + "; ".join(problems))
        check_layer_ids(self.target_layer_ids, self.target_num_layers)

    @classmethod
    def for_target(cls, target, **overrides) -> DrafterConfig:
        """Defaults that fit `target` (a dominospec Target); any field can be overridden (None: default)."""
        base = dict(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            target_num_layers=target.num_layers,
            target_layer_ids=list(target.layer_ids),
            target_name=str(target.name),
            **target.arch,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    @property
    def out_vocab(self) -> int:
        """Width of the drafter's logits: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise DominoError(f"{source}: unknown drafter config keys {unknown}")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [k for k in required if k not in data]
        if missing:
            raise DominoError(f"{source}: missing drafter config keys {missing}")
        if data.get("format", FORMAT) != FORMAT:
            raise DominoError(f"{source}: format {data['format']!r} is not {FORMAT!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise DominoError(f"{source}: {exc}") from None
