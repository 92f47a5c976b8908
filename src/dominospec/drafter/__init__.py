"""The drafter: proposes a block of tokens per cycle from the target's hidden states.

config.py      DrafterConfig (config.json)
layers.py      RMSNorm, RoPE, the KV-injection draft layer, the training block mask
heads.py       sequential heads (none, domino, markov, rnn) with their losses; the confidence head
model.py       Drafter: backbone, head, draft cache, borrowed target tables
fast.py        the inference path on the small-row kernel: packed linears, a rollout of few ops per slot
checkpoint.py  reading and writing drafter directories; the drafters the package ships
"""

from .checkpoint import shipped_drafter_dir
from .config import DrafterConfig
from .heads import HEADS
from .model import DraftCache, Drafter

__all__ = ["Drafter", "DrafterConfig", "DraftCache", "HEADS", "shipped_drafter_dir"]
