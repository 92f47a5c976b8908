"""dominospec: Domino speculative decoding for Hugging Face causal language models.

The data flow, one package per stage (tests/test_layout.py keeps imports one-way, bottom up):
  errors.py, version.py, log.py, io.py, devices.py, sampling.py
           the foundation: DominoError, logging, atomic files, devices, sampling and acceptance rules
  targets/ the target model (the only package that calls transformers)
  drafter/ the drafter: parallel backbone + sequential head, checkpoints
  decode/  the online step for any number of rows (propose, verify, accept), the batch-1 loops, the policies
  tune/    what the step reads, measured once: the device profile, the STS calibration, the policy built from them
  engine/  many requests at once: slots, ragged verification, DSpark's scheduler
  data/    prompts and on-policy training data
  export/  drafters in the formats SGLang, vLLM, speculators and SpecForge load
  train/   training a drafter
  bench/   measuring it
  serve/   the OpenAI-compatible server on the engine, and its load test
  integrations/  model.generate(custom_generate=...) for transformers users
  cli/     the command line over all of them
"""

from .decode import GenerationResult, generate_autoregressive, generate_speculative
from .drafter import Drafter, DrafterConfig
from .errors import DominoError
from .sampling import SamplingConfig
from .targets import Target
from .tune.spec import generate
from .version import __version__

__all__ = [
    "DominoError",
    "Drafter",
    "DrafterConfig",
    "Target",
    "GenerationResult",
    "SamplingConfig",
    "generate",
    "generate_autoregressive",
    "generate_speculative",
    "__version__",
]
