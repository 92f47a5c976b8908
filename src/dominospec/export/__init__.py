"""Exporting a drafter to the engines that serve this family of drafters at scale.

contracts.py  what SGLang, vLLM, speculators and SpecForge load: tensor names, shapes, config read-locations
plan.py       which combinations export exactly, approximately or not at all; `--serve-with` choices
convert.py    the conversion itself: tensors, config.json, mask_embedding.pt, export_report.json
"""

from .contracts import FORMATS
from .convert import export_drafter
from .plan import ENGINES, Plan, arch_for_engine, plan_export

__all__ = ["FORMATS", "ENGINES", "Plan", "arch_for_engine", "export_drafter", "plan_export"]
