"""training.png: losses, simulated tau and validation tau over steps (optional: matplotlib may be missing)."""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_path
from ..log import log_once


def plot_metrics(metrics_path: Path, png: Path) -> bool:
    """Draw `png` from metrics.jsonl; False (said once) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log_once(f"matplotlib is not installed: no {png.name} (pip install matplotlib)")
        return False
    if not metrics_path.exists():  # no step ran here (a run resumed into a new --out at its last step)
        return False
    recs = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    vals = [r for r in recs if r.get("kind") == "val"]
    recs = [r for r in recs if r.get("kind") != "val"]
    if not recs:
        return False
    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for k in ("ce_final", "ce_base", "ce", "l1", "bce"):
        if k in recs[0]:
            a.plot(steps, [r[k] for r in recs], label=k)
    a.set_xlabel("step"), a.set_ylabel("loss (per weighted slot)"), a.legend(), a.set_title("losses")
    b.plot(steps, [r["tau_greedy"] for r in recs], label="train (greedy)")
    if "tau_sampled" in recs[0]:
        b.plot(steps, [r["tau_sampled"] for r in recs], label="train (T=1)")
    if vals:
        b.plot([r["step"] for r in vals], [r["val_tau"] for r in vals], "o-", label="validation (greedy)")
    b.set_xlabel("step"), b.set_ylabel("simulated tau"), b.legend(), b.set_title("simulated tau")
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return True
