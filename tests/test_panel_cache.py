"""The packed weights saved once in the cache (targets/panel_cache.py): a second load reads them, bit-equal."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from dominospec.targets import kernels
from dominospec.targets.hf import Target

pytestmark = pytest.mark.skipif(kernels.load_kernels() is None, reason="the CPU kernel is not built here")


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A tiny Llama saved as a directory, and a cache of its own (the built kernels shared)."""
    real_kernels = kernels.kernel_dir().parent
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(real_kernels, target_is_directory=True)
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(cache))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        **TINY_SHAPE,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _load(path, weights):
    return Target(LlamaForCausalLM.from_pretrained(str(path)), name="tiny", backend="native", weights=weights)


def _linears(target):
    return [lin.kernel for b in target.native.blocks for lin in (b.qkv, b.o, b.gate_up, b.down)] + [
        target.native.lm_head.kernel
    ]


def _same_build(a, b):
    for x, y in zip(_linears(a), _linears(b), strict=True):
        assert x.format == y.format and x.group == y.group
        assert torch.equal(x.panels, y.panels)
        assert (x.scale is None) == (y.scale is None)
        if x.scale is not None:
            assert torch.equal(x.scale, y.scale)
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    assert torch.equal(a.native(ids, a.native.new_cache(1, 16))[0], b.native(ids, b.native.new_cache(1, 16))[0])


@pytest.mark.parametrize("weights", ["int8", "float32", "auto"])
def test_second_load_reads_the_saved_panels(model_dir, weights):
    first = _load(model_dir, weights)
    assert not first.packed_from_cache
    saved = list((model_dir.parent / "cache" / "panels").glob("*.pt"))
    assert len(saved) == 1
    second = _load(model_dir, weights)
    assert second.packed_from_cache
    assert (second.weight_only, second.exact_weights) == (first.weight_only, first.exact_weights)
    _same_build(first, second)


def test_a_damaged_cache_file_is_rebuilt_with_a_note(model_dir, capsys):
    fresh = _load(model_dir, "int8")
    (path,) = (model_dir.parent / "cache" / "panels").glob("*.pt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short, as a killed disk write would
    rebuilt = _load(model_dir, "int8")
    assert not rebuilt.packed_from_cache
    assert "do not load" in capsys.readouterr().err
    _same_build(fresh, rebuilt)
    again = _load(model_dir, "int8")
    assert again.packed_from_cache
    _same_build(fresh, again)


def test_a_changed_model_file_is_not_read_from_the_cache(model_dir):
    _load(model_dir, "int8")
    model = LlamaForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    model.save_pretrained(model_dir)  # same path, new weights
    assert not _load(model_dir, "int8").packed_from_cache
