"""Block drafter training and checkpoints: `specpilot drafter train|eval`, `python -m specpilot.drafting.train`.

Needs only torch, safetensors, tqdm and (for tokenized targets) transformers, like engines/: it runs on a
bare GPU host. Modules: sources (allowed prompts), data (target-generated sequences and features),
objective (the batched block loss), train (the loop, report, CLI entry), evaluate (acceptance with the real
engine), checkpoint (our format and DFlash's), target (loading the target), cli (subcommands).
"""
