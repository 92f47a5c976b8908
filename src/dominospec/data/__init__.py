"""Training data: prompts in, on-policy conversations (answers written by the target) out.

prompts.py  prompt files (JSONL layouts) and Hugging Face datasets -> Conversations
builtin.py  the offline built-in prompt source (stdlib code, math templates, man pages)
sources.py  --prompts specs (FILE, builtin:N, hf:NAME) -> Conversations
prepare.py  the prepare-data stage: regeneration by the target, sharded, resumable
dataset.py  reading a prepared directory back (what train reads)
"""
