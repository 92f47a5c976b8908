"""The target model: the only package that calls transformers.

features.py  which decoder layers feed the drafter
context.py   how much of the context a prompt leaves for the answer
hf.py        Target: the adapter over a transformers model (forward, cache, tables, text)
native.py    the native forward for Llama-family models (fused, pre-packed; --backend native)
kernels.py   builds and loads the CPU kernels of cpu_kernels/ (C++, once per machine) and their packed linear
quant.py     weight formats on the CPU (--dtype): bf16 / int8 weights, the dot formats, a GGUF's own blocks
panel_cache.py  the packed weights of each format, saved once in the cache and memory-mapped by later loads
generate.py  transformers' own generate (benchmark baselines, batched sampling for data)
gguf.py      GGUF files as targets: checks, conversion (model, tokenizer, chat template), the raw 4/8-bit blocks
load.py      aliases, local directories, hub ids, .gguf files
checkpoint.py  a Llama-family directory read without transformers (config.json, mapped safetensors): native starts
tokenizer.py the directory's tokenizer from its saved state (tokenizers + jinja2), transformers' where needed
"""

from .context import MIN_ANSWER_TOKENS, cap_new_tokens, encode_if_fits, prompt_too_long
from .features import check_layer_ids, default_layer_ids, parse_layer_ids
from .hf import Target, TargetOutput
from .load import BUNDLED_ALIASES, DEFAULT_TARGET

load_target = Target.load

__all__ = [
    "Target",
    "TargetOutput",
    "load_target",
    "DEFAULT_TARGET",
    "BUNDLED_ALIASES",
    "MIN_ANSWER_TOKENS",
    "cap_new_tokens",
    "encode_if_fits",
    "prompt_too_long",
    "check_layer_ids",
    "default_layer_ids",
    "parse_layer_ids",
]
