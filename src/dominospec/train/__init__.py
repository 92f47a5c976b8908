"""Training a drafter against a frozen target.

blocks.py       anchors, labels, teacher-forced block inputs, simulated tau
samples.py      data checks before the first step; the draft vocabulary
trainer.py      TrainConfig and Trainer: online features, losses, checkpoints, resume
distributed.py  torchrun helpers (one process is world 1)
plots.py        training.png
"""
