"""Measuring decoding: speed, tau, acceptance by position, losslessness.

metrics.py  pure functions over per-prompt run records
methods.py  the ways of decoding (ar, hf, pld, drafters, ablations, lookup, hybrids): one class each
runner.py   the interleaved run, results on disk, prompt files, acceptance.json
report.py   markdown tables, report.md, plots
concurrency.py  the engine under closed-loop load (bench --concurrency)
server.py   a running server under closed-loop load, per prompt category (bench --server)
loadtest.py closed-loop streaming clients against a running server, with a fault round (dominospec loadtest)
"""
