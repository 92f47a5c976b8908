"""dominospec: Domino speculative decoding for Hugging Face causal language models.

The data flow, one package per stage (tests/test_layout.py keeps imports one-way, bottom up):
  errors.py, version.py, log.py, io.py, devices.py, sampling.py
           the foundation: DominoError, logging, atomic files, devices, sampling and acceptance rules
  target/  the target model (the only package that calls transformers)
  drafter/ the drafter: parallel backbone + sequential head, checkpoints
  decode/  proposals, verification, the decoding loops, verify cost
  data/    prompts and on-policy training data
  train/   training a drafter
  bench/   measuring it
  cli/     the command line over all of them
"""

from .decode import GenerationResult, generate_autoregressive, generate_speculative
from .drafter import Drafter, DrafterConfig
from .errors import DominoError
from .sampling import SamplingConfig
from .target import Target
from .version import __version__

__all__ = [
    "DominoError",
    "Drafter",
    "DrafterConfig",
    "Target",
    "GenerationResult",
    "SamplingConfig",
    "generate_autoregressive",
    "generate_speculative",
    "__version__",
]
