"""Train a block drafter for any Llama-family target on data the target generates itself.

Pipeline: allowed prompts (MBPP train split, synthetic task prompts, free generation, free generation steered by a
benchmark-style opening; never test prompts) -> the target's greedy
continuations and features -> AdamW with a cosine schedule on the position-decayed block loss (tqdm bar,
periodic checkpoints) -> a report: loss curve, teacher-forced per-slot accuracy on held-out generations,
and mean accepted per step in chain, tree and two-level mode measured with the real engine (before and
after training), each checked token for token against AR.

Runs on CPU for tiny models (tests) and on a GPU for real ones. Also a script for a bare GPU host (defaults
sized for SmolLM2-135M on one H200: 4000 steps, a ~13 MB bf16 checkpoint):
    SPECPILOT_BENCHMARKS=/path/to/benchmarks \
    python -m specpilot.drafting.train --target /path/to/smollm2-135m --out runs/drafter --device cuda
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specpilot.drafting.checkpoint import WeightStorage, as_stored, load_drafter, save_drafter
from specpilot.drafting.data import (DraftData, concat, generate_batched, load_sequences, recompute, sample_turns,
                                     save_sequences)
from specpilot.drafting.evaluate import as_dicts, measure_acceptance, teacher_forced
from specpilot.drafting.grow import grow_drafter
from specpilot.drafting.objective import LossHead, block_loss, sample_batch
from specpilot.drafting.sources import PromptSet, TargetBundle, build_prompts, split_off
from specpilot.drafting.task_prompts import TURN_STARTS
from specpilot.drafting.token_ranking import generated_counts, padded_counts, ranking_of, save_token_ranking
from specpilot.engines.config import DType
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.drafters.block_step import check_window
from specpilot.engines.llama import LlamaModel


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000  # sized for SmolLM2-135M on one H200: ~35-45 ms/step
    block_size: int = 16
    layers: int = 2
    intermediate: int | None = None  # drafter MLP width; None = 2 x hidden
    target_layers: tuple[int, ...] | None = None  # None = 3 spread layers (default_target_layers)
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_seqs: int = 16  # sequences per step
    anchors: int = 64  # anchors (blocks) per sequence per step
    decay: float = 7.0  # slot j's loss weight: exp(-(j-1)/decay)
    # Soft labels: the target's soft_topk likeliest tokens at every generated position are recorded while it
    # generates, and the loss mixes their cross-entropy in with weight soft_weight (objective.block_loss); 0: the
    # greedy tokens alone. soft_weight None: 0.5 with soft_topk (a value set without soft_topk is refused)
    soft_topk: int = 0
    soft_weight: float | None = None
    # Train (and evaluate) with the drafter's attention on the context's last context_window positions (0: all),
    # the EngineConfig.drafter_window the drafter will run at.
    context_window: int = 0
    mbpp_prompts: int = 366  # MBPP train prompts (random prefixes for targets without a tokenizer)
    # free generations (a chat-framed user turn and its answer, or BOS + sampled tokens then greedy: see chat_free
    # below). H200 runs, BOS-started, memorised their data: with 512 (878 sequences,
    # ~225k tokens) train loss 0.003, held-out 8.2, chain 1.61 tokens/step; with 3072 (3410 sequences, 740k tokens,
    # 51 s to generate, ~40 epochs in 400 s) train 0.7, held-out 4.4, chain 2.06. Data is cheap next to training.
    free_prompts: int = 12288
    # Synthetic task prompts (drafting.task_prompts: word problems, LaTeX problems, function stubs from MBPP train
    # tasks), answered greedily: the benchmarks' kinds of answer, which free chat generations rarely are.
    task_prompts: int = 0
    # Free generations whose user turn opens with one of task_prompts.TURN_STARTS (the target writes the rest of the
    # question, then answers it): needs a chat template
    steered_prompts: int = 0
    free_sampled: int = 8  # sampled tokens at the start of each free generation (no chat template)
    # With a chat template, free generations are a sampled user turn of at most this many tokens, then the target's
    # greedy answer (chat_free=False: from BOS instead, as before)
    user_tokens: int = 48
    chat_free: bool = True
    gen_tokens: int = 256  # greedy tokens generated per prompt
    gen_batch: int = 1536  # sequences decoded together (GPU: launch-bound, so wide batches are nearly free)
    held_out: int = 8  # prompts kept aside for the acceptance measurement
    # And this many of each other source (task prompts, steered turns, free chat turns) held out beside them, so the
    # held-out numbers and the step kept by them cover what the drafter trains on, not MBPP alone (0: MBPP only,
    # the set earlier runs measured)
    held_out_each: int = 0
    eval_tokens: int = 128
    eval_anchors: int = 32
    ckpt_every: int = 1000
    # Held-out teacher-forced accepted length every this many steps; the best state is the one kept (an H200 run
    # memorised its data while the held-out numbers stopped improving). 0: never, the last state is kept. The
    # report's engine acceptance runs on the same held-out prompts, so with selection it is mildly optimistic.
    eval_every: int = 500
    log_every: int = 10
    seed: int = 0
    device: str = "cpu"
    progress: bool = True
    # Wall budget of the whole run in seconds (a GPU call has a hard limit): training then ends in time for the
    # final evaluation and save, and its cosine schedule follows the clock instead of `steps` (the cap).
    deadline_s: float | None = None
    # A saved drafter (checkpoint directory) to continue training instead of a fresh one: its architecture wins
    # over layers / block_size / intermediate / target_layers. A GPU call has a hard limit, so a long training run
    # is several calls, each resuming the last one's drafter; give each a new seed, or it regenerates the same data.
    init: str | None = None
    # Grow the init drafter first (drafting.grow: the same outputs, room to learn more): this many layers appended,
    # features from these target layers added, MLPs widened to this many channels (0: as they are)
    grow_layers: int = 0
    grow_target_layers: tuple[int, ...] = ()
    grow_intermediate: int = 0
    # How the checkpoint holds the weights (int8 rows: a drafter over the 16 MB a shipped one may take in bf16); the
    # final evaluation measures the weights as stored
    checkpoint_storage: WeightStorage = WeightStorage.BF16
    # Train and evaluate the drafter's softmax over the LM head rows it drafts from at EngineConfig.drafter_head_rows
    # = head_rows (objective.LossHead): the tokens this call's data generates most (its token_ranking.json); 0: the
    # whole head. Run the engine with drafter_head_rows at most this: rows beyond it never trained against the rest.
    head_rows: int = 0
    # A training run's out dir whose saved sequences (its sequences/ folder) to train on
    # instead of generating: the features are recomputed in one forward per batch, so nearly the whole call trains.
    # The prompt knobs (mbpp_prompts, free_prompts, ...) are then unused.
    data_from: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "block_size", "layers", "batch_seqs", "anchors", "gen_tokens", "gen_batch", "user_tokens",
                     "eval_tokens", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        check_window(self.context_window, "context_window")
        object.__setattr__(self, "checkpoint_storage", WeightStorage(self.checkpoint_storage))
        object.__setattr__(self, "grow_target_layers", tuple(self.grow_target_layers))
        if self.grows and self.init is None:
            raise ValueError("grow_layers / grow_target_layers / grow_intermediate grow a saved drafter: set init")
        if self.soft_weight is not None and not self.soft_topk:
            raise ValueError(f"soft_weight={self.soft_weight} weighs soft labels: set soft_topk too")
        if self.soft_topk and self.soft_weight is None:
            object.__setattr__(self, "soft_weight", 0.5)
        if self.soft_weight is not None and not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"soft_weight={self.soft_weight}: must be in [0, 1]")
        # (free generations from BOS, chat_free False, are never held out)
        for name in ("free_prompts",) * self.chat_free + ("task_prompts", "steered_prompts"):
            if 0 < getattr(self, name) <= self.held_out_each:
                raise ValueError(f"{name}={getattr(self, name)} with held_out_each={self.held_out_each} holds all of "
                                 "them out: none would train")
        if self.steered_prompts and not self.chat_free:
            raise ValueError("steered_prompts are chat-framed user turns: they need chat_free (drop --no-chat-free)")
        if self.soft_topk and self.data_from is not None:
            raise ValueError("soft_topk needs the target's distributions, recorded while it generates; saved "
                             "sequences (data_from) carry none")
        if self.head_rows and self.head_rows < 16:  # EngineConfig.drafter_head_rows's floor: what the engine runs
            raise ValueError(f"head_rows={self.head_rows}: must be 0 (the whole head) or >= 16")
        if self.head_rows and self.soft_topk:
            raise ValueError("head_rows restricts the loss to the drafter's head rows; soft labels (soft_topk) cover "
                             "the whole vocabulary: set one of them")
        for name in ("task_prompts", "steered_prompts", "grow_layers", "grow_intermediate", "soft_topk",
                     "held_out_each", "head_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every}: must be >= 0")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s={self.deadline_s}: must be > 0 (or None)")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (the pending token plus at least one draft)")

    @property
    def grows(self) -> bool:
        return bool(self.grow_layers or self.grow_target_layers or self.grow_intermediate)


@dataclass
class TrainResult:
    model: BlockDrafterModel
    report: dict[str, Any] = field(default_factory=dict)
    checkpoint: Path | None = None


def lr_at(step: int, cfg: TrainConfig, done: float | None = None) -> float:
    """Linear warmup, then cosine decay to 10% of the peak over the steps, or over `done` (the fraction of a time
    budget spent) when training runs against the clock."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup) if done is None else done
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


Collected = tuple[DraftData, DraftData, list[list[int]], dict]  # train data, held-out data and prompts, provenance


def collect(bundle: TargetBundle, cfg: TrainConfig, capture: tuple[int, ...]) -> Collected:
    """(train data, held-out data, held-out prompts, provenance), all generated by the target (or by an earlier
    run: cfg.data_from)."""
    if cfg.data_from is not None:
        return reuse(bundle, cfg, capture)
    t = bundle.model
    if cfg.soft_topk > t.shape.vocab:  # before minutes of generation, not inside it
        raise ValueError(f"soft_topk={cfg.soft_topk}: more than the target's {t.shape.vocab} tokens")
    ps = build_prompts(bundle.tokenizer, t.shape.vocab, cfg.mbpp_prompts, cfg.free_prompts, cfg.held_out, cfg.seed,
                       chat=cfg.chat_free, tasks=cfg.task_prompts, tasks_held=cfg.held_out_each)
    store = cfg.device
    steered = steered_prompts(bundle, ps, cfg) if cfg.steered_prompts else []  # fails before any generation
    steered, held_prompts = split_off(steered, cfg.held_out_each, cfg.seed)
    held_prompts = [list(p) for p in ps.held_out] + held_prompts
    total = len(ps.train) + len(ps.free) + len(steered) + len(held_prompts)
    with tqdm(total=total, desc="generate", unit="seq", disable=not cfg.progress, file=sys.stderr) as bar:
        gen = dict(capture=capture, eos=bundle.eos, batch=cfg.gen_batch, store=store, progress=bar.update,
                   soft_topk=cfg.soft_topk)
        parts = [generate_batched(t, [list(p) for p in ps.train], cfg.gen_tokens, seed=cfg.seed, **gen)]
        if ps.free and ps.user_turn_end:  # the target writes a user turn, then answers it
            users = sample_turns(t, list(ps.user_turn_start), len(ps.free), cfg.user_tokens,
                                 frozenset({ps.user_turn_end[0]}) | bundle.eos, cfg.seed + 7919, cfg.gen_batch)
            turns, aside = split_off([list(ps.user_turn_start) + u + list(ps.user_turn_end) for u in users],
                                     cfg.held_out_each, cfg.seed)
            held_prompts += aside
            parts.append(generate_batched(t, turns, cfg.gen_tokens, seed=cfg.seed + 7919, **gen))
        elif ps.free:
            parts.append(generate_batched(t, [list(p) for p in ps.free], cfg.free_sampled + cfg.gen_tokens,
                                          sampled=cfg.free_sampled, seed=cfg.seed + 7919, **gen))
        if steered:
            parts.append(generate_batched(t, steered, cfg.gen_tokens, seed=cfg.seed + 104729, **gen))
        # scored on the greedy tokens only (teacher_forced, the engine check): no soft labels to record
        held = generate_batched(t, held_prompts, cfg.gen_tokens, seed=cfg.seed, **{**gen, "soft_topk": 0})
    train = concat(parts)
    steer = {"steered_generations": len(steered), "turn_starts": len(TURN_STARTS)} if cfg.steered_prompts else {}
    return train, held, held_prompts, {**ps.sources, **steer, "held_out_prompts": len(held_prompts),
                                       "train_sequences": len(train), "train_target_tokens": train.target_tokens}


def steered_prompts(bundle: TargetBundle, ps: PromptSet, cfg: TrainConfig) -> list[list[int]]:
    """cfg.steered_prompts chat-framed user turns, shared evenly among TURN_STARTS, each start's rest sampled by the
    target (turns that end at once are dropped), closed by the frame for the answer."""
    if not ps.user_turn_end:
        raise ValueError("steered prompts need a chat template whose user turn ends in a special token "
                         "(this target has none)")
    stop = frozenset({ps.user_turn_end[0]}) | bundle.eos
    share, extra = divmod(cfg.steered_prompts, len(TURN_STARTS))
    prompts: list[list[int]] = []
    for i, start in enumerate(tqdm(TURN_STARTS, desc="steered turns", disable=not cfg.progress, file=sys.stderr)):
        if share + (i < extra) == 0:
            break
        head = list(ps.user_turn_start) + bundle.tokenizer.encode(start, add_special_tokens=False)
        users = sample_turns(bundle.model, head, share + (i < extra), cfg.user_tokens, stop, cfg.seed + 104729 + i,
                             cfg.gen_batch)
        prompts += [head + u + list(ps.user_turn_end) for u in users]
    return prompts


# In a subfolder of the out dir: a checkpoint directory's own *.safetensors are the drafter's weights.
TRAIN_SEQUENCES, HELD_OUT_SEQUENCES = "sequences/train.safetensors", "sequences/held_out.safetensors"


def reuse(bundle: TargetBundle, cfg: TrainConfig, capture: tuple[int, ...]) -> Collected:
    """collect's result from the sequences an earlier run saved in cfg.data_from, features recomputed."""
    src = Path(cfg.data_from)
    vocab = bundle.model.shape.vocab
    (train_s, train_p), (held_s, held_p) = (load_sequences(src / f, vocab)
                                            for f in (TRAIN_SEQUENCES, HELD_OUT_SEQUENCES))
    batch = max(1, cfg.gen_batch // 4)  # whole sequences at once: a quarter of the decode batch in memory
    with tqdm(total=len(train_s) + len(held_s), desc="recompute features", unit="seq", disable=not cfg.progress,
              file=sys.stderr) as bar:
        train = recompute(bundle.model, train_s, train_p, capture, batch, cfg.device, bar.update)
        held = recompute(bundle.model, held_s, held_p, capture, batch, cfg.device, bar.update)
    earlier = json.loads((src / "report.json").read_text()).get("data", {}) if (src / "report.json").is_file() else {}
    return train, held, [s[:p] for s, p in zip(held_s, held_p)], {**earlier, "reused_from": str(src),
                                                                  "train_sequences": len(train),
                                                                  "train_target_tokens": train.target_tokens}


def new_drafter(bundle: TargetBundle, cfg: TrainConfig) -> BlockDrafterModel:
    if cfg.init is not None:  # continue a saved drafter (its checks: the same target shape, intact weights)
        model = load_drafter(cfg.init, bundle.model).train()
        if cfg.grows:
            model = grow_drafter(model, cfg.grow_layers, cfg.grow_target_layers, seed=cfg.seed,
                                 intermediate=cfg.grow_intermediate or None)
            model.config.check_target(bundle.model.shape)
        return model.to(cfg.device)
    config = BlockDrafterConfig.for_target(bundle.model.shape, cfg.layers, cfg.block_size, cfg.intermediate,
                                           cfg.target_layers)
    model = BlockDrafterModel(config).init_weights(cfg.seed)
    with torch.no_grad():  # mask inputs start at the scale of real token embeddings
        emb_std = float(bundle.model.embed_tokens.weight.float().std())
        g = torch.Generator().manual_seed(cfg.seed + 1)
        model.mask_embed.copy_(torch.randn(model.mask_embed.shape, generator=g) * emb_std)
    return model.to(cfg.device)


def evaluate_all(model, bundle: TargetBundle, cfg: TrainConfig, held: DraftData, prompts: list[list[int]]) -> dict:
    dtype = DType(str(bundle.model.embed_tokens.weight.dtype).removeprefix("torch."))
    return {"teacher_forced": teacher_forced(model, bundle.model, held, cfg.eval_anchors, cfg.decay, cfg.seed,
                                             window=cfg.context_window, head_rows=cfg.head_rows),
            "engine": as_dicts(measure_acceptance(bundle.model, model, prompts, cfg.eval_tokens, bundle.eos,
                                                  cfg.device, dtype, drafter_window=cfg.context_window,
                                                  drafter_head_rows=cfg.head_rows))}


def train_autocast(device: str, target_dtype: torch.dtype) -> torch.autocast:
    """bf16 autocast on the GPU, and on CPU when the target itself runs in bf16: the LM-head GEMMs dominate a
    step and run ~4x faster in bf16 on CPUs with AVX512-BF16. Float32 CPU targets (tests) train in float32."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=kind == "cuda" or target_dtype == torch.bfloat16)


def fit(model: BlockDrafterModel, target: LlamaModel, data: DraftData, cfg: TrainConfig,
        out: Path | None = None, seconds: float | None = None, held: DraftData | None = None,
        keep_start: bool = False) -> list[dict]:
    """The training loop (AdamW, warmup + cosine, gradient clipping, bf16 autocast: train_autocast); returns the loss
    curve. With `out`, writes a checkpoint every cfg.ckpt_every steps under out/checkpoints/. With `seconds`,
    stops after that long (or cfg.steps), the schedule decaying over the time. With `held`, scores the held-out
    teacher-forced accepted length every cfg.eval_every steps and at the end, and leaves the model in its best
    state (curve rows with "held_out"; the last row names the step kept). keep_start: the state before the first
    step competes too (a continuation of a trained drafter: on an H200 one at lr 1e-3 fell from 4.32 to 3.55
    held-out and would otherwise have replaced its better start, notes/h200.md session 15)."""
    embed, scored = target.embed_tokens.weight, LossHead.of(model, target, cfg.head_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    autocast = train_autocast(cfg.device, embed.dtype)
    curve: list[dict] = []
    model.train()
    bar = tqdm(range(cfg.steps), desc="train", disable=not cfg.progress, file=sys.stderr)
    start = time.perf_counter()
    best = _HeldOutBest(model, target, held, cfg) if held is not None and cfg.eval_every else None
    trained = 0  # steps taken
    for step in bar:
        done = None if seconds is None else (time.perf_counter() - start) / seconds
        if done is not None and done >= 1.0:
            curve.append({"step": step, "stopped": "time budget"})
            break
        if best is not None and (step > 0 or keep_start) and step % cfg.eval_every == 0:
            curve.append(best.score(step))
        lr = lr_at(step, cfg, done)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.randint(len(data), (cfg.batch_seqs,), generator=gen)
        batch = scored.batch(sample_batch(data, rows, cfg.anchors, model.config.block_size, gen))
        with autocast:
            m = block_loss(model, embed, scored.head, batch, cfg.decay, cfg.context_window,
                           cfg.soft_weight or 0.0)
        opt.zero_grad(set_to_none=True)
        m.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.log_every == 0 or step + 1 == cfg.steps:
            row = {"step": step, "loss": round(float(m.loss.detach()), 5), "accepted_tf": round(m.accepted, 4), "lr": lr}
            curve.append(row)
            bar.set_postfix(loss=row["loss"], acc_len=row["accepted_tf"])
        if out is not None and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps:
            save_drafter(model, out / "checkpoints" / f"step-{step + 1:06d}", target, {"step": step + 1},
                         cfg.checkpoint_storage)
        trained = step + 1
    bar.close()
    if best is not None:
        curve.append(best.score(trained))
        curve.append({"kept_step": best.restore()})
    return curve


class _HeldOutBest:
    """The model state with the best held-out teacher-forced accepted length so far (a copy on its device)."""

    def __init__(self, model: BlockDrafterModel, target: LlamaModel, held: DraftData, cfg: TrainConfig):
        self.model, self.target, self.held, self.cfg = model, target, held, cfg
        self.best, self.step, self.state = float("-inf"), 0, None

    def score(self, step: int) -> dict:
        tf = teacher_forced(self.model, self.target, self.held, self.cfg.eval_anchors, self.cfg.decay, self.cfg.seed,
                            window=self.cfg.context_window, head_rows=self.cfg.head_rows)
        if tf["accepted"] > self.best:
            self.best, self.step = tf["accepted"], step
            self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {"step": step, "held_out": {"loss": round(tf["loss"], 5), "accepted": round(tf["accepted"], 4)}}

    def restore(self) -> int:
        if self.state is not None:
            self.model.load_state_dict(self.state)
        return self.step


def final_eval_reserve(first_eval_s: float, device: str) -> float:
    """Seconds a deadline keeps for the final evaluation and the save. On a GPU the first evaluation compiles the
    engine's kernels and captures its graphs (57-61 s on the H100 / H200 in a fresh host, sessions 43-44) and the
    final one reuses them (18-21 s): half the first plus 20 s (1.5x, as reserved before, left 33-86 s of each call's
    deadline unused). On the CPU nothing is compiled: as long as the first, with a margin."""
    return (0.5 if str(device).startswith("cuda") else 1.2) * first_eval_s + 20.0


def train_drafter(bundle: TargetBundle, cfg: TrainConfig, out_dir: str | Path | None = None) -> TrainResult:
    """Generate data, train, evaluate, and (with out_dir) write checkpoints, the final drafter and report.json."""
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    vocab = bundle.model.shape.vocab
    if cfg.head_rows >= vocab:  # before minutes of generation
        raise ValueError(f"head_rows={cfg.head_rows}: must be below the target's vocabulary ({vocab}), or 0")
    model = new_drafter(bundle, cfg)
    data, held, prompts, provenance = collect(bundle, cfg, model.config.target_layers)
    t_data = time.perf_counter() - t0
    if cfg.head_rows:  # the rows this call trains: its data's ranking, which it saves beside the drafter
        model.token_ranking = torch.tensor(ranking_of(padded_counts(data.tokens, data.prompt_len, data.length, vocab)),
                                           dtype=torch.long)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:  # minutes of generation, kept before anything else can fail (a later run: cfg.data_from)
        (out / TRAIN_SEQUENCES).parent.mkdir(parents=True, exist_ok=True)
        save_sequences(data, out / TRAIN_SEQUENCES)
        save_sequences(held, out / HELD_OUT_SEQUENCES)
    t_eval0 = time.perf_counter()
    before = evaluate_all(model, bundle, cfg, held, prompts)
    t1 = time.perf_counter()
    t_eval = t1 - t_eval0
    seconds, reserve = None, final_eval_reserve(t_eval, cfg.device)
    if cfg.deadline_s is not None:  # leave the final evaluation and the save their time
        seconds = max(1.0, cfg.deadline_s - (t1 - t0) - reserve)
        if seconds < max(30.0, 0.1 * cfg.deadline_s):  # session 44: 270 s on an H100 left 1 s, 16 steps, silently
            print(f"warning: deadline_s={cfg.deadline_s:g} leaves {seconds:.0f} s to train: generating took "
                  f"{t_data:.0f} s, evaluating {t_eval:.0f} s, and the final evaluation and save keep "
                  f"{reserve:.0f} s; raise the deadline (or reuse this data: --data-from)", file=sys.stderr)
    curve = fit(model, bundle.model, data, cfg, out, seconds, held, keep_start=cfg.init is not None)
    t_train = time.perf_counter() - t1
    as_stored(model, cfg.checkpoint_storage).eval()
    kept_step = next((r["kept_step"] for r in curve if "kept_step" in r), None)
    checkpoint = None
    if out is not None:  # the drafter before its final evaluation: a call killed during it keeps the training
        trained = max([r["step"] + 1 for r in curve if "loss" in r] + [r["step"] for r in curve if "stopped" in r])
        meta = {"steps": trained, "kept_step": kept_step, "target": bundle.name, "init": cfg.init,
                "context_window": cfg.context_window}
        checkpoint = save_drafter(model, out, bundle.model, meta, cfg.checkpoint_storage)
        save_token_ranking(out, generated_counts([out / TRAIN_SEQUENCES], bundle.model.shape.vocab),
                           f"{TRAIN_SEQUENCES} of this training call")
    after = evaluate_all(model, bundle, cfg, held, prompts)
    report = {"target": bundle.name, "config": _jsonable(asdict(cfg)), "drafter": model.config.to_dict(),
              "data": provenance, "loss_curve": [r for r in curve if "held_out" not in r and "kept_step" not in r],
              "held_out_curve": [r for r in curve if "held_out" in r],
              "kept_step": kept_step, "untrained": before, "trained": after,
              "seconds": {"data": round(t_data, 2), "eval": round(t_eval, 2), "train": round(t_train, 2),
                          "train_budget": None if seconds is None else round(seconds, 2),
                          "total": round(time.perf_counter() - t0, 2)}}
    if out is not None:
        report["checkpoint_bytes"] = (out / "model.safetensors").stat().st_size
        (out / "report.json").write_text(json.dumps(report, indent=2))
    return TrainResult(model, report, checkpoint)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    """`python -m specpilot.drafting.train ...`: the same arguments as `specpilot drafter train`."""
    import argparse

    from specpilot.drafting.cli import add_train_args, run_train

    p = argparse.ArgumentParser(prog="python -m specpilot.drafting.train", description=__doc__.split("\n")[0])
    add_train_args(p)
    return run_train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
