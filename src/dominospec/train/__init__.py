"""Training a drafter against a frozen target.

run.py          TrainJob and train_drafter: data in, the best drafter out (what `dominospec train` calls)
trainer.py      TrainConfig and Trainer: online features, losses, checkpoints, resume
blocks.py       anchors, labels, teacher-forced block inputs, simulated tau
objectives.py   D-PACE slot weights, the acceptance-aligned (LK) loss, token selection by target entropy
samples.py      data checks before the first step; the draft vocabulary; a fresh drafter
validate.py     held-out validation: greedy acceptance by position, the best drafter so far
distributed.py  torchrun helpers (one process is world 1)
plots.py        training.png
"""
