"""Training data: prompts in, on-policy conversations (answers written by the target) out; off-policy
texts the target only reads, labelled by it.

prompts.py      prompt files (JSONL layouts) and Hugging Face datasets -> Conversations
builtin.py      the offline built-in prompt source (stdlib code, math templates, man pages)
selfwritten.py  prompts the target writes itself (--prompts self:N)
offpolicy.py    off-policy texts (--prompts pydoc:N) and their labels from one target pass
imports.py      public prompt sources -> prompts/train files with licences (import-prompts; mix:DIR:N)
overlap.py      word n-gram overlap of training prompts with benchmark prompts (contamination check)
sources.py      --prompts specs (FILE, builtin:N, self:N, pydoc:N, mix:DIR:N, hf:NAME) -> Conversations
sampler.py      answers through cache rows refilled as answers end (--sampler slots)
prepare.py      the prepare-data stage: regeneration by the target, sharded, resumable
store.py        data sets made of parts: manifest, compact npz samples, checksums
extend.py       prepare-data --extend: a finished run added as a data set's next part
dataset.py      reading a prepared directory or data set back (what train reads)
"""
