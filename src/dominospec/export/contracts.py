"""What each serving engine loads: exact tensor names, shapes, dtypes, and where each config value is read.

Written from the engines' published source (sglang 0.5.23, vllm 0.34.0, speculators 0.9.0, SpecForge
a6b6b02); each table cites file and line. Paths are relative to the package root of each:
[SGL] sglang/srt/, [VLLM] vllm/, [SPEC] speculators/, [SF] the SpecForge repository. The engines check
little at load (SGLang ignores unknown tensors, vLLM does not track missing ones), so the exporter and
the tests check an export against these tables instead.

Two engine kinds share our block layout (slot k predicts anchor+1+k):
  domino  SGLang DFLASH with projector_type "domino" and shift_label true: B-1 proposals per block
  dspark  DSpark with sample_from_anchor true (SGLang DSPARK, vLLM/speculators dspark): B proposals
Plain DFlash reads the slots shifted by one and is never a target.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("sglang", "vllm", "speculators", "specforge")
KINDS = ("domino", "dspark")

# (format, kind) -> the architecture name the engine's registry resolves
ARCHITECTURES = {
    # [SGL] models/dflash.py L1317-1324 (DFlashDraftModel is the only DFLASH class for a Qwen3-style
    # drafter; "DominoDraftModel" is not registered and falls back to TransformersForCausalLM,
    # models/registry.py L74-91)
    ("sglang", "domino"): "DFlashDraftModel",
    # [SGL] models/dspark.py L995; [VLLM] model_executor/models/registry.py L711 (a bare
    # DSparkDraftModel is DeepSeek-V4 in vLLM unless model_type is qwen3, config/speculative.py L788-795)
    ("sglang", "dspark"): "Qwen3DSparkModel",
    ("vllm", "dspark"): "Qwen3DSparkModel",
    # [VLLM] transformers_utils/configs/speculators/algos.py L120-177 (update_dspark keeps a listed one)
    ("speculators", "dspark"): "Qwen3DSparkModel",
    # [SF] specforge/modeling/auto.py L94-116, configs/qwen3-8b-{domino,dspark}.json
    ("specforge", "domino"): "DominoDraftModel",
    ("specforge", "dspark"): "DSparkDraftModel",
}

# Markov head types the engines build: [SGL] speculative/dspark_components/dspark_config.py L263-274
# (vanilla, gated, rnn); vLLM's Qwen3 DSpark has the vanilla head only ([VLLM] model_executor/models/
# qwen3_dspark.py L49-94; markov_head_type is not read there)
MARKOV_TYPES = {
    "sglang": ("vanilla", "rnn"),
    "vllm": ("vanilla",),
    "speculators": ("vanilla",),
    "specforge": ("vanilla", "rnn"),
}


@dataclass(frozen=True)
class Dims:
    """The numbers an export's tensor shapes follow from."""

    hidden: int  # H
    n_features: int  # len(target_layer_ids)
    heads: int
    kv_heads: int
    head_dim: int  # d
    intermediate: int  # I
    layers: int
    vocab: int  # V, the target's
    out_vocab: int  # rows of the head's output matrix: V, or Vd where the engine keeps a draft vocabulary
    gru: int  # G (domino)
    rank: int  # E for domino (emb_dim), r for dspark (markov_rank)
    markov_type: str = "vanilla"  # dspark: vanilla | rnn
    confidence_in: int = 0  # width of the confidence head's input (0: no head exported)
    reduced_vocab: bool = False  # vLLM/speculators: ship lm_head rows and d2t


FLOAT, INT64 = "float", "int64"  # float: the --dtype chosen; int64 for index tensors


def backbone_tensors(d: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """The HF-Qwen3 names all four formats share, without a `model.` prefix.

    [SGL] models/dflash.py L887-894 (q/k/v and gate/up fused at load), L905-920 (prefix either way);
    [VLLM] model_executor/models/qwen3_dflash.py L436-442 (same fusion), L996-997 (vLLM prepends
    `model.` itself: a prefixed name becomes model.model.* and raises). q_norm/k_norm always exist
    ([SGL] models/dflash.py L249-250; [VLLM] qwen3_dflash.py L298-299). `hidden_norm` is the context
    norm after `fc` ([SGL] models/dflash.py L825-845; [VLLM] qwen3_dflash.py L668-700).
    """
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {
        "fc.weight": ((h, d.n_features * h), FLOAT),  # column blocks in ascending layer order
        "hidden_norm.weight": ((h,), FLOAT),
        "norm.weight": ((h,), FLOAT),
    }
    for i in range(d.layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": ((h,), FLOAT),
            p + "self_attn.q_proj.weight": ((q, h), FLOAT),
            p + "self_attn.k_proj.weight": ((kv, h), FLOAT),
            p + "self_attn.v_proj.weight": ((kv, h), FLOAT),
            p + "self_attn.o_proj.weight": ((h, q), FLOAT),
            p + "self_attn.q_norm.weight": ((d.head_dim,), FLOAT),
            p + "self_attn.k_norm.weight": ((d.head_dim,), FLOAT),
            p + "post_attention_layernorm.weight": ((h,), FLOAT),
            p + "mlp.gate_proj.weight": ((d.intermediate, h), FLOAT),
            p + "mlp.up_proj.weight": ((d.intermediate, h), FLOAT),
            p + "mlp.down_proj.weight": ((h, d.intermediate), FLOAT),
        }
    return out


def domino_tensors(d: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """SGLang Domino's head: nn.GRU(H, G, bias=False) and Sequential(Linear(H+G, E), SiLU, Linear(E, V)).

    [SGL] models/dflash.py L784-806 (modules), L974-983 (shapes checked), L985-999 (all four required);
    [SF] specforge/modeling/draft/domino.py L42-54 (same names).
    """
    h, g, e = d.hidden, d.gru, d.rank
    return {
        "prefix_gru.weight_ih_l0": ((3 * g, h), FLOAT),
        "prefix_gru.weight_hh_l0": ((3 * g, g), FLOAT),
        "embed_proj.0.weight": ((e, h + g), FLOAT),
        "embed_proj.2.weight": ((d.vocab, e), FLOAT),  # always the full target vocabulary
    }


def dspark_tensors(d: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """DSpark's Markov head, its optional confidence head, and vLLM's reduced-vocabulary tensors.

    [SGL] models/dspark.py L186-199 (vanilla markov_w1/markov_w2), L340-355 (rnn joint_proj),
    L424-437 (confidence_head.proj), L654-660 (an unknown markov_head.* name raises);
    [VLLM] qwen3_dspark.py L72-80 (markov_w2 [Vd, r]), L165-190 (confidence), L287-291 (d2t: target
    id = i + d2t[i]); [VLLM] v1/worker/gpu/spec_decode/dspark/utils.py L136-145 (lm_head required when
    Vd < V); [SPEC] train/vocab_mapping.py L81-105 (d2t int64 [Vd], draft ids sorted ascending).
    """
    h, r = d.hidden, d.rank
    out = {
        "markov_head.markov_w1.weight": ((d.vocab, r), FLOAT),  # indexed by target ids
        "markov_head.markov_w2.weight": ((d.out_vocab, r), FLOAT),
    }
    if d.markov_type == "rnn":  # cat([s, W1[prev], z]) -> (gate, candidate, output)
        out["markov_head.joint_proj.weight"] = ((3 * r, 2 * r + h), FLOAT)
        out["markov_head.joint_proj.bias"] = ((3 * r,), FLOAT)
    if d.confidence_in:
        out["confidence_head.proj.weight"] = ((1, d.confidence_in), FLOAT)
        out["confidence_head.proj.bias"] = ((1,), FLOAT)
    if d.reduced_vocab:
        out["lm_head.weight"] = ((d.out_vocab, h), FLOAT)
        out["d2t"] = ((d.out_vocab,), INT64)
    return out


def expected_tensors(fmt: str, kind: str, d: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor an export holds, exactly: nothing missing, nothing extra."""
    head = domino_tensors(d) if kind == "domino" else dspark_tensors(d)
    return backbone_tensors(d) | head


@dataclass(frozen=True)
class ConfigRead:
    """One value an engine reads from config.json: where (a path of keys/attributes) and what it must hold."""

    path: tuple[str, ...]  # ("dflash_config", "mask_token_id"): nested; ("block_size",): top level
    value: str  # the name of the value in the exporter's `values` dict
    source: str  # file and line in the engine


DFU = "[SGL] speculative/dflash_utils.py"  # parse_dflash_draft_config: dflash_config first, then the top level


def _backbone_reads(where: tuple[str, ...] = ()) -> list[ConfigRead]:
    # read through transformers' Qwen3Config by both engines; unset values default silently to
    # numbers unlike ours: rms_norm_eps 1e-6, rope_theta 1e4 (SGLang) or 1e6 (vLLM), max positions 32768
    src = DFU + " L593-597, L545-551; models/dflash.py L205-210, L270; [VLLM] qwen3_dflash.py"
    reads = [
        ConfigRead(where + (k,), k, src)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
            "hidden_act",
        )
    ]
    # transformers 5 turns rope_theta into rope_parameters; [SGL] utils/hf_transformers/common.py L501-517,
    # [VLLM] transformers_utils/config.py L633-639 (vLLM defaults rope_theta to 1e6 when absent)
    reads.append(ConfigRead(where + ("rope_parameters", "rope_theta"), "rope_theta", src))
    return reads


# (format, kind) -> every value the engine reads, and where
CONFIG_READS: dict[tuple[str, str], list[ConfigRead]] = {
    ("sglang", "domino"): _backbone_reads()
    + [
        # parse_dflash_draft_config reads dflash_config first, then the top level
        ConfigRead(("architectures",), "architectures", "[SGL] models/dflash.py L1317-1324"),
        ConfigRead(("dflash_config", "target_layer_ids"), "target_layer_ids", DFU + " L657-675"),
        ConfigRead(("dflash_config", "num_target_layers"), "num_target_layers", "[SGL] models/dflash.py L749-754"),
        ConfigRead(("dflash_config", "mask_token_id"), "mask_token_id", DFU + " L688-703"),
        ConfigRead(("dflash_config", "block_size"), "block_size", DFU + " L609-617"),
        ConfigRead(("dflash_config", "projector_type"), "projector_domino", DFU + " L727"),
        ConfigRead(("dflash_config", "shift_label"), "shift_label", DFU + " L734-777"),
        ConfigRead(("dflash_config", "pure_draft_prefix_len"), "pure_prefix", DFU + " L779-783"),
        ConfigRead(("dflash_config", "gru_hidden_dim"), "gru_hidden_dim", DFU + " L785"),
        ConfigRead(("dflash_config", "emb_dim"), "emb_dim", DFU + " L753-787"),
        ConfigRead(("emb_dim",), "emb_dim", DFU + " L753-787 (both places must agree)"),
    ],
    ("sglang", "dspark"): _backbone_reads()
    + [
        ConfigRead(("architectures",), "architectures", "[SGL] models/dspark.py L995"),
        ConfigRead(("dflash_config", "target_layer_ids"), "target_layer_ids", "[SGL] dspark_config.py L206-211"),
        # build_markov_head / build_confidence_head read getattr(config, ...) at the top level only
        ConfigRead(("markov_rank",), "markov_rank", "[SGL] models/dspark.py L385-399"),
        ConfigRead(("markov_head_type",), "markov_head_type", "[SGL] dspark_config.py L263-274"),
        ConfigRead(("mask_token_id",), "mask_token_id", "[SGL] dspark_config.py L119-122"),
        ConfigRead(("block_size",), "block_size", "[SGL] dspark_config.py L51-58, L100-117"),
        ConfigRead(("sample_from_anchor",), "sample_from_anchor", "[SGL] dspark_config.py L29-31 (top level only)"),
        ConfigRead(("enable_confidence_head",), "enable_confidence_head", "[SGL] models/dspark.py L487-507"),
        ConfigRead(("confidence_head_with_markov",), "confidence_head_with_markov", "[SGL] models/dspark.py L487-507"),
    ],
    ("vllm", "dspark"): _backbone_reads()
    + [
        ConfigRead(("architectures",), "architectures", "[VLLM] model_executor/models/registry.py L711"),
        # target layers: dflash_config.target_layer_ids + 1 is the capture index ([VLLM] eagle3_utils.py L103-144)
        ConfigRead(("dflash_config", "target_layer_ids"), "target_layer_ids", "[VLLM] eagle/eagle3_utils.py L103-144"),
        ConfigRead(("markov_rank",), "markov_rank", "[VLLM] qwen3_dspark.py L210-219 (hard attribute)"),
        ConfigRead(("enable_confidence_head",), "enable_confidence_head", "[VLLM] qwen3_dspark.py L221-231"),
        ConfigRead(("confidence_head_with_markov",), "confidence_head_with_markov", "[VLLM] qwen3_dspark.py L221-231"),
        ConfigRead(("draft_vocab_size",), "draft_vocab_size", "[VLLM] qwen3_dspark.py L245-273"),
        ConfigRead(("sample_from_anchor",), "sample_from_anchor", "[VLLM] spec_decode/dspark/speculator.py L62-68"),
        ConfigRead(("block_size",), "block_size", "[VLLM] spec_decode/dspark/config.py L77-85"),
        ConfigRead(("mask_token_id",), "mask_token_id", "[VLLM] v1/worker/gpu/spec_decode/utils.py L141-163"),
    ],
    # speculators has no top-level model_type: vLLM reads it through SpeculatorsConfig and update_dspark
    ("speculators", "dspark"): [
        ConfigRead(("speculators_model_type",), "speculators_model_type", "[VLLM] configs/speculators/base.py L76-94"),
        ConfigRead(
            ("speculators_config", "proposal_methods", "0", "speculative_tokens"),
            "block_size",
            "[VLLM] configs/speculators/base.py L76-94",
        ),
        ConfigRead(
            ("speculators_config", "verifier", "name_or_path"), "verifier", "[VLLM] configs/speculators/base.py L76-94"
        ),
        ConfigRead(("aux_hidden_state_layer_ids",), "aux_layer_ids", "[VLLM] configs/speculators/algos.py L120-177"),
        ConfigRead(("sample_from_anchor",), "sample_from_anchor", "[VLLM] algos.py L120-177 (default False there)"),
        ConfigRead(("draft_vocab_size",), "draft_vocab_size", "[VLLM] algos.py L120-177"),
        ConfigRead(("mask_token_id",), "mask_token_id", "[VLLM] algos.py L120-177"),
        ConfigRead(("markov_rank",), "markov_rank", "[VLLM] algos.py L120-177"),
        ConfigRead(("block_size",), "block_size", "[VLLM] algos.py L120-177"),
        ConfigRead(("enable_confidence_head",), "enable_confidence_head", "[VLLM] algos.py L120-177"),
        ConfigRead(("confidence_head_with_markov",), "confidence_head_with_markov", "[VLLM] algos.py L120-177"),
    ]
    + _backbone_reads(("transformer_layer_config",)),
    ("specforge", "domino"): _backbone_reads()
    + [
        ConfigRead(("architectures",), "architectures", "[SF] specforge/modeling/auto.py L94-116"),
        ConfigRead(("dflash_config", "target_layer_ids"), "target_layer_ids", "[SF] configs/qwen3-8b-domino.json"),
        ConfigRead(("dflash_config", "mask_token_id"), "mask_token_id", "[SF] configs/qwen3-8b-domino.json"),
        ConfigRead(("dflash_config", "shift_label"), "shift_label", "[SF] dflash_family_model.py L501-535"),
        ConfigRead(("dflash_config", "pure_draft_prefix_len"), "pure_prefix", "[SF] domino.py L56-62"),
        ConfigRead(("dflash_config", "gru_hidden_dim"), "gru_hidden_dim", "[SF] domino.py L42-54"),
        ConfigRead(("emb_dim",), "emb_dim", "[SF] specforge/export/to_hf.py L68-118"),
    ],
    ("specforge", "dspark"): _backbone_reads()
    + [
        ConfigRead(("architectures",), "architectures", "[SF] specforge/modeling/auto.py L94-116"),
        ConfigRead(("dflash_config", "target_layer_ids"), "target_layer_ids", "[SF] configs/qwen3-8b-dspark.json"),
        ConfigRead(("markov_rank",), "markov_rank", "[SF] scripts/gates/normalize_dflash_export.py L11-16"),
        ConfigRead(("markov_head_type",), "markov_head_type", "[SF] normalize_dflash_export.py L49-63"),
        ConfigRead(("mask_token_id",), "mask_token_id", "[SF] normalize_dflash_export.py L49-63"),
    ],
}

# the mask override file: {"embedding": Tensor[H], "mask_token_id": int}, read from the LOCAL draft path by
# SGLang DFLASH only, which copies the vector into row mask_token_id of the TARGET's embedding table
# ([SGL] speculative/dflash_worker_v2.py L1318-1389, L1357-1369); no DSpark loader reads it (grep)
MASK_FILE = "mask_embedding.pt"
REPORT_FILE = "export_report.json"


def resolve(config: dict, path: tuple[str, ...]):
    """The value at `path` in a config dict (or object with attributes); KeyError when absent."""
    node = config
    for key in path:
        if isinstance(node, list):
            node = node[int(key)]
        elif isinstance(node, dict):
            node = node[key]
        else:
            if not hasattr(node, key):
                raise KeyError(key)
            node = getattr(node, key)
    return node


def speculators_update_dspark(config: dict) -> dict:
    """What vLLM derives from a speculators dspark config (the rules of [VLLM] transformers_utils/configs/
    speculators/algos.py L120-177, restated): the attributes its Qwen3 DSpark model then reads."""
    aux = list(config["aux_hidden_state_layer_ids"])
    out = {
        "architectures": config.get("architectures") or ["Qwen3DSparkModel"],
        "sample_from_anchor": bool(config.get("sample_from_anchor", False)),  # vLLM's default differs: False
        "eagle_aux_hidden_state_layer_ids": aux,
        "target_layer_ids": [i - 1 for i in aux],
    }
    out["dspark_bonus_anchor"] = not out["sample_from_anchor"]
    for key in (
        "draft_vocab_size",
        "mask_token_id",
        "markov_rank",
        "markov_head_type",
        "block_size",
        "enable_confidence_head",
        "confidence_head_with_markov",
    ):
        if key in config:
            out[key] = config[key]
    return out
