"""Meeting users where they already are; this package may import transformers (tests/test_layout.py).

transformers.py  `model.generate(..., custom_generate=domino_generate, drafter=...)` and the
                 `custom_generate/generate.py` directory that makes `custom_generate="DIR"` work
"""

from .transformers import domino_generate, write_custom_generate

__all__ = ["domino_generate", "write_custom_generate"]
