"""Converting a drafter into a directory an engine loads: tensors renamed and reshaped, config.json, report.

An export directory holds config.json, model.safetensors, mask_embedding.pt (a learned mask, SGLang
DFLASH only) and export_report.json (the mapping, every approximation, the serve command). It is
checked against contracts.py before anything is written, and written whole or not at all.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from ..drafter import Drafter
from ..drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from ..errors import DominoError
from ..io import ensure_writable_dir, read_json
from ..targets import BUNDLED_ALIASES
from ..targets.load import target_dir
from ..version import __version__
from .contracts import ARCHITECTURES, MASK_FILE, REPORT_FILE, Dims, expected_tensors
from .plan import Plan, plan_export

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# our backbone names -> the engines' (HF Qwen3) names; fc keeps its name but its column blocks move
BACKBONE_NAMES = {
    "ctx_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "input_norm.weight": "input_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}


def target_reference(target) -> str:
    """What an engine is given as the target: the converted directory for a bundled alias or a .gguf file, else the
    name."""
    name = str(target.name)
    return str(target_dir(name)) if name in BUNDLED_ALIASES or name.lower().endswith(".gguf") else name


def sorted_layer_order(layer_ids: list[int]) -> list[int]:
    """Positions of our feature blocks in ascending layer order (engines concatenate features that way)."""
    return sorted(range(len(layer_ids)), key=lambda i: layer_ids[i])


def backbone_tensors(drafter: Drafter) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (tensor, where it came from) for the shared backbone."""
    c = drafter.config
    state = drafter.state_dict()
    h = c.hidden_size
    order = sorted_layer_order(c.target_layer_ids)
    fc = state["fc.weight"]  # [H, n*H], column block i reads feature layer target_layer_ids[i]
    fc = torch.cat([fc[:, i * h : (i + 1) * h] for i in order], dim=1)
    out = {"fc.weight": (fc, f"fc.weight, column blocks reordered {order} (ascending layer ids)")}
    for ours, theirs in BACKBONE_NAMES.items():
        if ours in state:
            out[theirs] = (state[ours], ours)
    for i in range(c.num_layers):
        for ours, theirs in BACKBONE_NAMES.items():
            key = f"layers.{i}.{ours}"
            if key in state:
                out[f"layers.{i}.{theirs}"] = (state[key], key)
    return out


def _widened(w: torch.Tensor, drafter: Drafter) -> torch.Tensor:
    """[Vd, r] rows of the draft vocabulary scattered into zeros [V, r]."""
    full = w.new_zeros(drafter.config.vocab_size, w.shape[1])
    return full.index_copy_(0, drafter.draft_vocab, w)


def domino_head_tensors(drafter: Drafter, plan: Plan) -> tuple[dict[str, tuple[torch.Tensor, str]], int, int]:
    """SGLang's prefix_gru / embed_proj from our GRU and correction; (tensors, G, E)."""
    c = drafter.config
    if c.head == "none":  # a zero correction of the smallest shape the engine builds
        g = e = 1
        z = torch.zeros
        return (
            {
                "prefix_gru.weight_ih_l0": (z(3, c.hidden_size), "zeros (head none)"),
                "prefix_gru.weight_hh_l0": (z(3, 1), "zeros (head none)"),
                "embed_proj.0.weight": (z(1, c.hidden_size + 1), "zeros (head none)"),
                "embed_proj.2.weight": (z(c.vocab_size, 1), "zeros (head none)"),
            },
            g,
            e,
        )
    hd = drafter.head
    w2 = hd.w2.weight.detach()  # [out_vocab, E]
    w2_from = "head.w2.weight"
    if plan.widen_vocab:
        w2, w2_from = _widened(w2, drafter), "head.w2.weight scattered into zeros at rows draft_vocab"
    return (
        {
            # nn.GRU keeps the gates in the order (r, z, n), as our cell does
            "prefix_gru.weight_ih_l0": (hd.gru_ih.weight.detach(), "head.gru_ih.weight"),
            "prefix_gru.weight_hh_l0": (hd.gru_hh.weight.detach(), "head.gru_hh.weight"),
            # embed_proj.0 reads cat(z_k, s_k): W1 = [w1_z | w1_s]
            "embed_proj.0.weight": (
                torch.cat([hd.w1_z.weight, hd.w1_s.weight], dim=1).detach(),
                "cat([head.w1_z.weight, head.w1_s.weight], dim=1)",
            ),
            "embed_proj.2.weight": (w2, w2_from),
        },
        c.gru_hidden_size,
        c.rank,
    )


def dspark_head_tensors(drafter: Drafter, plan: Plan, target) -> tuple[dict[str, tuple[torch.Tensor, str]], int]:
    """markov_head.* (+ confidence_head.*, lm_head, d2t); (tensors, rank)."""
    c = drafter.config
    out: dict[str, tuple[torch.Tensor, str]] = {}
    if c.head == "none":
        rank = 1
        w1, w2 = torch.zeros(c.vocab_size, 1), torch.zeros(c.out_vocab, 1)
        w1_from = w2_from = "zeros (head none)"
    else:
        rank = c.rank
        w1, w2 = drafter.head.w1.weight.detach(), drafter.head.w2.weight.detach()
        w1_from, w2_from = "head.w1.weight", "head.w2.weight"
    if plan.reduced_vocab:
        # engines index the draft vocabulary in ascending target-id order (speculators' convention)
        perm = torch.argsort(drafter.draft_vocab)
        ids = drafter.draft_vocab[perm].cpu()
        w2, w2_from = w2[perm], w2_from + " rows in ascending draft-vocabulary order"
        head_rows = target.output_embeddings().weight.detach()
        lm = head_rows[ids.to(head_rows.device)].cpu()
        out["lm_head.weight"] = (lm, "target LM head rows at draft_vocab (ascending)")
        out["d2t"] = ((ids - torch.arange(ids.numel())).to(torch.int64), "draft_vocab - arange(Vd) (ascending)")
    elif plan.widen_vocab:
        w2, w2_from = _widened(w2, drafter), w2_from + " scattered into zeros at rows draft_vocab"
    out["markov_head.markov_w1.weight"] = (w1, w1_from)
    out["markov_head.markov_w2.weight"] = (w2, w2_from)
    if c.head == "rnn":  # the same cat([s, W1[prev], z]) -> (gate, candidate, output) cell
        out["markov_head.joint_proj.weight"] = (drafter.head.cell.weight.detach(), "head.cell.weight")
        out["markov_head.joint_proj.bias"] = (drafter.head.cell.bias.detach(), "head.cell.bias")
    if plan.confidence:
        out["confidence_head.proj.weight"] = (drafter.confidence.proj.weight.detach(), "confidence.proj.weight")
        out["confidence_head.proj.bias"] = (drafter.confidence.proj.bias.detach(), "confidence.proj.bias")
    return out, rank


def export_dims(drafter: Drafter, plan: Plan, gru: int, rank: int) -> Dims:
    c = drafter.config
    return Dims(
        hidden=c.hidden_size,
        n_features=len(c.target_layer_ids),
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        layers=c.num_layers,
        vocab=c.vocab_size,
        out_vocab=c.out_vocab if plan.reduced_vocab else c.vocab_size,
        gru=gru,
        rank=rank,
        markov_type="rnn" if c.head == "rnn" else "vanilla",
        confidence_in=c.hidden_size if plan.confidence else 0,
        reduced_vocab=plan.reduced_vocab,
    )


def export_values(drafter: Drafter, plan: Plan, target, dims: Dims, dtype: torch.dtype) -> dict:
    """Every value an engine reads from config.json, by the names contracts.CONFIG_READS uses."""
    c = drafter.config
    ids = sorted(c.target_layer_ids)
    return {
        "architectures": [ARCHITECTURES[(plan.fmt, plan.kind)]],
        "dtype": DTYPE_NAMES[dtype],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": target.max_positions or 32768,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "target_layer_ids": ids,
        "aux_layer_ids": [i + 1 for i in ids],  # speculators counts the embeddings as layer 0
        "num_target_layers": c.target_num_layers,
        "mask_token_id": plan.mask_token_id,
        "block_size": c.block_size,
        "projector_domino": "domino",
        "shift_label": True,
        "pure_prefix": 1,
        "gru_hidden_dim": dims.gru,
        "emb_dim": dims.rank,
        "markov_rank": dims.rank,
        "markov_head_type": dims.markov_type,
        "sample_from_anchor": True,
        "enable_confidence_head": plan.confidence,
        "confidence_head_with_markov": False,
        "draft_vocab_size": dims.out_vocab,
        "speculators_model_type": "dspark",
        "verifier": target_reference(target),
    }


def build_config(plan: Plan, v: dict, target) -> dict:
    """config.json for the engine: a Qwen3-style config with every value it would otherwise default."""
    backbone = {
        "model_type": "qwen3",
        "dtype": v["dtype"],
        "hidden_size": v["hidden_size"],
        "intermediate_size": v["intermediate_size"],
        "num_hidden_layers": v["num_hidden_layers"],
        "num_attention_heads": v["num_attention_heads"],
        "num_key_value_heads": v["num_key_value_heads"],
        "head_dim": v["head_dim"],
        "hidden_act": v["hidden_act"],
        "attention_bias": False,
        "rms_norm_eps": v["rms_norm_eps"],
        "rope_theta": v["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": v["rope_theta"]},
        "max_position_embeddings": v["max_position_embeddings"],
        "vocab_size": v["vocab_size"],
        "tie_word_embeddings": False,
    }
    if plan.kind == "domino":
        nested = {
            "mask_token_id": v["mask_token_id"],
            "target_layer_ids": v["target_layer_ids"],
            "num_target_layers": v["num_target_layers"],
            "block_size": v["block_size"],
            "projector_type": "domino",
            "shift_label": True,
            "pure_draft_prefix_len": 1,
            "gru_hidden_dim": v["gru_hidden_dim"],
            "emb_dim": v["emb_dim"],
        }
        return {
            "architectures": v["architectures"],
            **backbone,
            "block_size": v["block_size"],
            "num_target_layers": v["num_target_layers"],
            "emb_dim": v["emb_dim"],
            "dflash_config": nested,
        }
    dspark = {
        "markov_rank": v["markov_rank"],
        "markov_head_type": v["markov_head_type"],
        "mask_token_id": v["mask_token_id"],
        "block_size": v["block_size"],
        "enable_confidence_head": v["enable_confidence_head"],
        "confidence_head_with_markov": False,
    }
    if plan.fmt == "speculators":
        return {
            "speculators_model_type": "dspark",
            "architectures": v["architectures"],
            "transformer_layer_config": backbone,
            "draft_vocab_size": v["draft_vocab_size"],
            "aux_hidden_state_layer_ids": v["aux_layer_ids"],
            "sample_from_anchor": True,  # vLLM's update_dspark defaults it to False: always written
            **dspark,
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": v["block_size"]}],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": v["verifier"],
                    "architectures": list(getattr(target.model.config, "architectures", None) or []),
                },
            },
        }
    # sample_from_anchor is top level only: inside dflash_config vLLM's DFlash base raises on it
    nested = {**dspark, "target_layer_ids": v["target_layer_ids"], "projector_type": "dspark"}
    out = {
        "architectures": v["architectures"],
        **backbone,
        **dspark,
        "sample_from_anchor": True,
        "target_layer_ids": v["target_layer_ids"],
        "num_target_layers": v["num_target_layers"],
        "dflash_config": nested,
    }
    if plan.fmt == "vllm":
        out["draft_vocab_size"] = v["draft_vocab_size"]
    return out


def serve_command(plan: Plan, out: Path, target, block_size: int) -> str | None:
    """The command line that serves the export (None for SpecForge, a training format)."""
    model, draft = target_reference(target), str(out.resolve())
    if plan.fmt == "sglang":
        parts = ["python", "-m", "sglang.launch_server", "--model-path", model]
        if plan.kind == "domino":
            parts += ["--dtype", "bfloat16", "--speculative-algorithm", "DFLASH"]
            parts += ["--speculative-draft-model-path", draft, "--speculative-domino-candidate-pool-size", "0"]
        else:
            parts += ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", draft]
        return shlex.join(parts)
    if plan.fmt in ("vllm", "speculators"):
        spec = json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": block_size})
        return shlex.join(["vllm", "serve", model, "--speculative-config", spec])
    return None


def special_ids(target) -> dict[int, str]:
    """Special ids the target reads or writes in every chat -> a name: EOS (end of turn included), pad, BOS,
    and the special tokens its chat template writes around a message."""
    out: dict[int, str] = {}
    tok = getattr(target, "tokenizer", None)
    if tok is not None and getattr(tok, "chat_template", None):
        special = {int(i) for i in getattr(tok, "all_special_ids", [])}
        special |= {int(i) for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items() if t.special}
        try:
            written = target.encode_chat([{"role": "user", "content": "x"}])
        except Exception:  # a template that needs more than one message: the named ids below still count
            written = []
        for i in written:
            if i in special:
                out[i] = f"{tok.convert_ids_to_tokens(i)!r} (written by its chat template)"
    cfg = target.model.config
    for i in target.eos_ids:
        out[int(i)] = "EOS"
    for label, i in (("pad", target.pad_id), ("BOS", getattr(cfg, "bos_token_id", None))):
        if isinstance(i, int):
            out.setdefault(i, label)
    return out


def check_mask_row(plan: Plan, target, allow_approx: bool) -> None:
    """SGLang writes a learned mask vector into row mask_token_id of the target's embedding table.

    That row must not be a special token's (EOS, end of turn, pad, ...: the target reads them in every
    chat). On a target with tied embeddings the table is also the LM head, so the written row changes the
    target's logit for that token at every position: refused unless --allow-approx, and reported."""
    if not plan.mask_file:
        return
    mask, specials = plan.mask_token_id, special_ids(target)
    if mask in specials:
        raise DominoError(
            f"--mask-token-id {mask} is the target's special token {specials[mask]}: SGLang writes the mask vector "
            f"into that row of the target's embedding table; choose an unused, non-special id"
        )
    if getattr(target.model.config, "tie_word_embeddings", False):
        why = (
            f"the target ties its embeddings to its LM head, so the mask vector SGLang writes into row {mask} also "
            f"changes the target's own logit for token {mask} at every position (it may then draft and accept it)"
        )
        if not allow_approx:
            raise DominoError(f"--to sglang with a learned mask vector: {why}; pass --allow-approx to write it anyway")
        plan.approximations.append(why)


def check_against_contract(tensors: dict[str, torch.Tensor], expected: dict, dtype: torch.dtype) -> None:
    """The export holds exactly the contract's tensors, with its shapes and dtypes, all finite."""
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise DominoError(f"internal: export does not match its contract: missing {missing}, unexpected {extra}")
    for name, t in tensors.items():
        shape, kind = expected[name]
        want = torch.int64 if kind == "int64" else dtype
        if tuple(t.shape) != tuple(shape) or t.dtype != want:
            raise DominoError(f"internal: {name} is {tuple(t.shape)} {t.dtype}, the contract says {shape} {want}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DominoError(f"{name} holds NaN/inf values; the drafter is damaged")


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, byte-reproducible: safetensors writes its metadata map in hash order, which
    changes from call to call, so the header is written again with the metadata keys sorted (the tensors'
    entries keep safetensors' own order, and their data is untouched)."""
    from safetensors.torch import save

    blob = save(tensors, metadata=metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n :])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, MASK_FILE, REPORT_FILE)  # every name an export may write


def check_out(out: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Refuse an --out that an export must not write into, before any model loads; returns it absolute.

    Refused: the source drafter itself or a folder holding it, the current directory or one holding it,
    a file, a non-empty folder that holds no earlier export, and a folder (or its parent, where the
    temporary directory goes) that cannot be written.
    """
    out = Path(os.path.abspath(out))
    guarded = [(Path.cwd().resolve(), "the current directory")]
    if source is not None:
        guarded.insert(0, (Path(source).resolve(), f"the source drafter {source}"))
    real = out.resolve()
    for place, what in guarded:
        if real == place or real in place.parents:
            why = "is" if real == place else "holds"
            raise DominoError(f"--out {out} {why} {what}; an export goes into a folder of its own")
    if out.exists() and not out.is_dir():
        raise DominoError(f"--out {out} exists and is not a directory")
    replaceable(out)  # refuses a folder that holds files no earlier export wrote
    ensure_writable_dir(out.parent, "--out's parent folder")  # the temporary directory goes there
    if out.exists():  # (a new --out is renamed into place whole, so it is not made here)
        ensure_writable_dir(out, "--out")
    return out


def replaceable(out: Path) -> set[str]:
    """The files in `out` an earlier export wrote (listed in its report), which a new export may replace.

    A folder with files of its own that would collide with the export's names, or with anything at all
    and no report, is refused: an export never removes what it did not write.
    """
    if not out.is_dir():
        return set()
    present = {p.name for p in out.iterdir()}
    if not present:
        return set()
    if REPORT_FILE not in present:
        raise DominoError(
            f"--out {out} is a non-empty directory that holds no earlier export ({REPORT_FILE}); choose another"
        )
    report = read_json(out / REPORT_FILE, "an earlier export's report")
    listed = report.get("files") if isinstance(report, dict) else None
    if not isinstance(listed, list):
        raise DominoError(f"{out / REPORT_FILE} lists no files; it was not written by dominospec export")
    ours = {n for n in listed if isinstance(n, str) and n in EXPORT_FILES} & present
    foreign = sorted((present - ours) & set(EXPORT_FILES))
    if foreign:
        raise DominoError(
            f"--out {out} holds {', '.join(foreign)}, which the earlier export there did not write; "
            "an export replaces only its own files: choose another --out"
        )
    return ours


def _move(src: Path, dst: Path) -> None:
    """Rename `src` onto `dst` (atomic); across file systems, copy beside `dst` first, then rename."""
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        part = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
        shutil.copyfile(src, part)
        os.replace(part, dst)
        src.unlink()


def _place(tmp: Path, out: Path) -> None:
    """Move the finished export into `out`: a new folder is renamed into place whole; in an existing one
    only the files an earlier export wrote are replaced (or removed, when this export does not write
    them), the report last, and everything else there is left as it was."""
    old = replaceable(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    new = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in new if n != REPORT_FILE] + [REPORT_FILE]:
        _move(tmp / name, out / name)
    for name in sorted(old - set(new)):
        (out / name).unlink(missing_ok=True)


def export_drafter(
    drafter: Drafter,
    fmt: str,
    out: str | os.PathLike,
    target,
    mask_token_id: int | None = None,
    dtype: str | None = None,
    allow_approx: bool = False,
    source: str | os.PathLike | None = None,
) -> dict:
    """Write `drafter` as an export for `fmt` into `out`; returns the report (also written as export_report.json).

    `target` (a dominospec Target the drafter fits) supplies the LM-head rows of a draft vocabulary, the
    context length and the name the engine loads. Refusals raise DominoError before anything is written.
    """
    c = drafter.config
    plan = plan_export(c, fmt, mask_token_id, allow_approx)
    drafter.check_fits(target)
    check_mask_row(plan, target, allow_approx)
    if dtype is not None and dtype not in DTYPES:
        raise DominoError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if dtype is None:  # SGLang runs Domino in bf16 only; otherwise keep the drafter's own precision
        torch_dtype = torch.bfloat16 if (fmt, plan.kind) == ("sglang", "domino") else drafter.dtype
        torch_dtype = torch_dtype if torch_dtype in DTYPE_NAMES else torch.float32
    else:
        torch_dtype = DTYPES[dtype]
    out = check_out(out, source)
    with torch.no_grad():
        named = backbone_tensors(drafter)
        if plan.kind == "domino":
            head, gru, rank = domino_head_tensors(drafter, plan)
        else:
            (head, rank), gru = dspark_head_tensors(drafter, plan, target), 0
        named |= head
    tensors = {
        k: (t.detach().cpu().contiguous() if t.dtype == torch.int64 else t.detach().cpu().to(torch_dtype).contiguous())
        for k, (t, _) in named.items()
    }
    dims = export_dims(drafter, plan, gru, rank)
    check_against_contract(tensors, expected_tensors(fmt, plan.kind, dims), torch_dtype)
    values = export_values(drafter, plan, target, dims, torch_dtype)
    config = build_config(plan, values, target)
    if not target.max_positions:
        plan.notes.append("the target's config gives no max_position_embeddings; 32768 written")

    command = serve_command(plan, out, target, c.block_size)
    report = {
        "format": fmt,
        "kind": plan.kind,
        "architecture": values["architectures"][0],
        "status": plan.status,
        "dominospec_version": __version__,
        "target": values["verifier"],
        "dtype": values["dtype"],
        "head": c.head,
        "block_size": c.block_size,
        "proposals_per_block": plan.proposals,
        "mask_token_id": plan.mask_token_id,
        "target_layer_ids": {"drafter": list(c.target_layer_ids), "export": values["target_layer_ids"]},
        "approximations": plan.approximations,
        "notes": plan.notes,
        "tensors": {k: {"shape": list(tensors[k].shape), "from": named[k][1]} for k in sorted(tensors)},
        "serve_command": command,
    }
    if source is not None:
        src = Path(source)
        report["source"] = {
            "dir": str(src),
            **{f"{n}_sha256": _sha256(src / n) for n in (CONFIG_NAME, WEIGHTS_NAME) if (src / n).exists()},
        }
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # beside out, never inside it
    umask = os.umask(0)
    os.umask(umask)
    try:
        write_safetensors(tensors, tmp / WEIGHTS_NAME, {"format": "pt", "exported_by": f"dominospec {__version__}"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if plan.mask_file:
            emb = drafter.mask_embedding.detach().cpu().to(torch_dtype).clone()
            torch.save({"embedding": emb, "mask_token_id": plan.mask_token_id}, tmp / MASK_FILE)
        report["files"] = sorted(p.name for p in tmp.iterdir()) + [REPORT_FILE]
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        for p in [tmp, *tmp.iterdir()]:  # mkdtemp makes the directory private; an export is not
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
        _place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return report
