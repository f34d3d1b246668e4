"""How well a block drafter drafts: measured with the real engine on held-out prompts, in every verify mode.

Each mode's output is compared with the engine's own AR output token for token (a drafter can never change
the output; a mismatch is a bug in the engine, and the report says so instead of hiding it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specpilot.drafting.data import DraftData
from specpilot.drafting.objective import LossHead, block_loss, sample_batch
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, DType, EngineConfig, KernelBackend, VerifyMode
from specpilot.engines.drafters.block import BlockDrafterModel
from specpilot.engines.llama import LlamaModel


@dataclass(frozen=True)
class ModeAcceptance:
    mode: str
    committed_per_step: float  # tokens per verify step, bonus included (DFlash's "acceptance length")
    accepted_per_step: float  # draft tokens accepted per step (bonus excluded)
    verified_nodes_per_step: float  # draft nodes the full target verified per step
    max_accepted: int
    steps: int
    tokens: int
    equal_to_ar: bool


def engine_config(drafter: BlockDrafterModel, verify: VerifyMode, dtype: DType, device: str, max_seq_len: int,
                  **knobs) -> EngineConfig:
    """Position-ordered attention by default, for the AR reference and every mode alike: with it a tree verify
    is bit-exact against AR. Without it (plain SDPA over the slots) a bf16 tree is token-exact only up to
    near-ties, and the report would flag a flip as a mismatch of a lossless configuration."""
    cuda = device.startswith("cuda")
    # On a GPU the torch backend's cuBLAS GEMMs round a 16-node verify differently from a 1-token step (an H200
    # run: tree and two-level parted from AR, the chain did not); the fused Triton kernels are batch-invariant.
    knobs = {"position_ordered_attention": True, "kernel_backend": KernelBackend.TRITON if cuda else KernelBackend.TORCH,
             **knobs}
    return EngineConfig(drafter=DrafterKind.BLOCK, verify=verify, block_size=drafter.config.block_size, dtype=dtype,
                        max_seq_len=max(64, max_seq_len), cuda_graphs=cuda, **knobs)


def measure_acceptance(target: LlamaModel, drafter: BlockDrafterModel, prompts: list[list[int]], new_tokens: int,
                       eos: frozenset[int], device: str, dtype: DType,
                       modes: tuple[VerifyMode, ...] = (VerifyMode.CHAIN, VerifyMode.TREE, VerifyMode.TWO_LEVEL),
                       **knobs) -> list[ModeAcceptance]:
    """Mean accepted per verify step for each mode over `prompts` (greedy, `new_tokens` each)."""
    max_len = max(len(p) for p in prompts) + new_tokens + 2
    ar_cfg = engine_config(drafter, VerifyMode.CHAIN, dtype, device, max_len, **knobs).replace(drafter=DrafterKind.NONE)
    ar = build_engine(ar_cfg, target, eos, device)
    reference = [ar.generate(list(p), new_tokens).tokens for p in prompts]
    del ar
    out = []
    for mode in modes:
        engine = build_engine(engine_config(drafter, mode, dtype, device, max_len, **knobs), target, eos, device,
                              block_drafter=drafter)
        steps, committed, accepted, verified, most, equal = 0, 0, 0, 0, 0, True
        for p, ref in zip(prompts, reference):
            r = engine.generate(list(p), new_tokens)
            equal &= r.tokens == ref
            steps += len(r.steps)
            committed += sum(s.committed for s in r.steps)
            accepted += sum(s.accepted for s in r.steps)
            verified += sum(s.drafted for s in r.steps)
            most = max([most] + [s.accepted for s in r.steps])
        n = max(1, steps)
        out.append(ModeAcceptance(mode.value, committed / n, accepted / n, verified / n, most, steps,
                                  sum(len(t) for t in reference), equal))
        del engine
    return out


@torch.no_grad()
def teacher_forced(model: BlockDrafterModel, target: LlamaModel, data: DraftData, anchors: int, decay: float,
                   seed: int, batch_seqs: int = 16, window: int = 0, head_rows: int = 0) -> dict:
    """Per-slot top-1 accuracy, loss and teacher-forced accepted length on held-out generated data (window: the
    drafter's context window; head_rows: its LM head's rows, objective.LossHead)."""
    gen = torch.Generator().manual_seed(seed)
    embed, scored = target.embed_tokens.weight, LossHead.of(model, target, head_rows)
    was_training = model.training
    model.eval()
    losses, accs, accepted = [], [], []
    for s in range(0, len(data), batch_seqs):
        rows = torch.arange(s, min(s + batch_seqs, len(data)))
        batch = scored.batch(sample_batch(data, rows, anchors, model.config.block_size, gen))
        m = block_loss(model, embed, scored.head, batch, decay, window)
        losses.append(float(m.loss))
        accs.append(m.slot_accuracy)
        accepted.append(m.accepted)
    model.train(was_training)
    n = len(losses)
    return {"loss": sum(losses) / n, "accepted": sum(accepted) / n,
            "slot_accuracy": [sum(a[j] for a in accs) / n for j in range(len(accs[0]))]}


def as_dicts(rows: list[ModeAcceptance]) -> list[dict]:
    return [asdict(r) for r in rows]
