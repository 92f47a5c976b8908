"""dominospec: Domino speculative decoding for Hugging Face causal language models."""

from .errors import DominoError
from .drafter import Drafter, DrafterConfig
from .target import Target
from .decoding import GenerationResult, SamplingConfig, generate_autoregressive, generate_speculative

__version__ = "0.1.0"
__all__ = ["DominoError", "Drafter", "DrafterConfig", "Target", "GenerationResult", "SamplingConfig",
           "generate_autoregressive", "generate_speculative", "__version__"]
