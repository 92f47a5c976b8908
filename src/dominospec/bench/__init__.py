"""Measuring decoding: speed, tau, acceptance by position, losslessness.

metrics.py  pure functions over per-prompt run records
runner.py   methods (ar, hf, pld, drafters, ablations), the interleaved run, results on disk
report.py   markdown tables, report.md, plots
"""
