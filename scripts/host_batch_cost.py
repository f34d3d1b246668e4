"""Host cost of the batched engine's loop per step, with the forward taken out: a measurement tool for CPU.

BatchEngine (scheduler, drafters, the mechanisms, packing, commit) runs unchanged over a runner whose forward is a
lookup in known outputs: a verify block's argmax after position p is the known sequence's token p + 1, exactly what
the target would answer where its output is that sequence. So the engine walks the same steps (same drafts, same
acceptance) as on the GPU, and what the clock measures is the host's share of a step, per variant, which on the
H200 sits between the ~1.3-1.8 ms forwards. cProfile with --profile N.

It also predicts each variant's H200 throughput from the same walk: committed tokens over the sum, per step, of the
forward's cost at that step's token count (the H200 cost curve below) plus a host cost per step, once the same for
every variant (--host-ms: the mechanisms' effect on the GPU's work alone) and once this CPU's measured host time
scaled by --host-scale (the H200 host runs this loop ~2x slower). --oracle adds a bound: stock batching whose
n-gram proposals (up to --max-draft-len tokens) are cut to the prefix the target accepts, so no verify token is
wasted and none is missed that the lookup had: what any draft-length or verify-budget policy over this drafter
could reach at most.

Usage:
  python scripts/host_batch_cost.py [--outputs FILE.json[.gz]] [--requests 48] [--concurrency 16] [--profile 25]
FILE.json: {key: {"prompt": [ids], "out": [ids]}} (e.g. greedy outputs of SmolLM2 on the benchmark prompts);
without it, synthetic sequences that mix repeated phrases with fresh tokens (seeded).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gzip
import json
import pstats
import random
import time
from pathlib import Path

import numpy as np
import torch

from specpilot.bench.batched import ALL_LABEL, BatchVariant, standard_variants
from specpilot.engines.batch import BatchConfig, BatchEngine, BatchNgramDrafter, CostCurve, DevicePolicy, RequestSpec
from specpilot.engines.batch.config import mechanism_fields
from specpilot.engines.batch.drafting import NgramChainDrafter
from specpilot.engines.batch.paged_cache import CacheShape, PagedKVCache
from specpilot.engines.batch.runner import StepEntry, StepHandle
from specpilot.engines.config import DrafterKind, EngineConfig

# The H200's batched SmolLM2 forward (h200-s18-batch-baseline.txt in notes/h200-raw-s18-s19.tar.xz): the mechanisms
# price tokens with it.
H200_CURVE = ((1, 0.00106), (16, 0.00111), (32, 0.00130), (64, 0.00151), (128, 0.00186), (256, 0.00243),
              (512, 0.00444), (792, 0.00662))


VOCAB = 49152  # SmolLM2's: the replayed outputs' token ids


class ReplayRunner:
    """BatchRunner's interface to the engine, answering each step from the known sequences (no forward). Its own
    time (what the GPU would do) accumulates in device_s, which the host time excludes. With a lookup (a
    BatchNgramDrafter, for device_draft variants) each step also answers every row's next lookup chain, computed
    by a host drafter per row as the device would (same proposals), inside the replay."""

    def __init__(self, sequences: dict[tuple[int, ...], list[int]], rows: int, width: int, max_seq_len: int,
                 lookup: BatchNgramDrafter | None = None):
        self.B, self.W, self.vocab = rows, width, VOCAB
        self.cache = PagedKVCache(CacheShape(1, 1, 1, rows * (max_seq_len // 16 + 1), 16), torch.float32, "cpu")
        self.drafters = (lookup,) if lookup is not None else ()
        self.device_s = 0.0
        self._by_prompt = sequences  # prompt -> prompt + known output
        self._truth: dict[int, list[int]] = {}
        self._prompt: dict[int, list[int]] = {}  # a row's prompt chunks so far
        self._lookups: dict[int, NgramChainDrafter] = {}

    def bind(self, row: int, pages: list[int]) -> None:
        self._truth.pop(row, None)
        self._prompt[row] = []
        if self.drafters:
            d = self.drafters[0]
            self._lookups[row] = NgramChainDrafter(d.depth, d.ngram_max, d.ngram_min, d.extrapolate, d.vocab)

    def unbind(self, row: int) -> None:
        self._truth.pop(row, None)

    def launch(self, entries: list[StepEntry], draft=None) -> StepHandle:
        t = time.perf_counter()
        if draft is not None and (not self.drafters or draft is not self.drafters[0]):
            raise ValueError("the replayed runner drafts only with its lookup (no target features: no block drafter)")
        out = np.zeros((self.B, 1 + self.W + (self.drafters[0].columns if draft is not None else 0)), dtype=np.int64)
        drafted, positions = np.zeros(self.B, dtype=np.int64), np.full(self.B, -1, dtype=np.int64)
        for e in entries:
            positions[e.row] = e.start
            if e.last_only:  # a prompt chunk: the whole prompt, once its last chunk is in, names the sequence
                prompt = self._prompt[e.row]
                prompt += e.tokens
                if tuple(prompt) in self._by_prompt:  # only the last chunk's answer is read
                    self._truth[e.row] = self._by_prompt[tuple(prompt)]
                    out[e.row, 1] = self._truth[e.row][len(prompt)]
                    if draft is not None:
                        self._chain(out, e.row, len(prompt))
                continue
            truth = self._truth[e.row]
            n = len(e.tokens)
            argmax = [truth[min(e.start + j + 1, len(truth) - 1)] for j in range(n)]
            acc = 0
            while acc < n - 1 and e.tokens[acc + 1] == argmax[acc]:
                acc += 1
            out[e.row, 0], out[e.row, 1:1 + n] = acc, argmax
            drafted[e.row] = n - 1
            if draft is not None:
                self._chain(out, e.row, e.start + acc + 1)
        policy = self.drafters[0].policy if draft is not None else None
        if policy is not None:  # mechanisms a / b on the "device": the same torch code, on the CPU
            out[:, 1 + self.W] = policy.apply(torch.from_numpy(out[:, 1 + self.W].copy()), torch.from_numpy(out[:, 0]),
                                              torch.from_numpy(drafted), torch.from_numpy(positions)).numpy()
        self.device_s += time.perf_counter() - t
        return StepHandle(torch.from_numpy(out))

    def _chain(self, out: np.ndarray, row: int, pending_pos: int) -> None:
        """The lookup's answer for a row whose pending token sits at pending_pos: (count, tokens...)."""
        chain = self._lookups[row].propose(self._truth[row][:pending_pos + 1], self.drafters[0].depth)
        out[row, 1 + self.W] = len(chain)
        out[row, 2 + self.W:2 + self.W + len(chain)] = chain


class OracleCut:
    """An n-gram drafter's proposals cut to the prefix the known sequence continues with."""

    def __init__(self, truth: list[int], draft_len: int, ngram_max: int, ngram_min: int):
        self.truth, self.drafter = truth, NgramChainDrafter(draft_len, ngram_max, ngram_min)

    def propose(self, seq: list[int], k: int) -> list[int]:
        proposal, n = self.drafter.propose(seq, k), len(seq)
        keep = 0
        while keep < len(proposal) and n + keep < len(self.truth) and proposal[keep] == self.truth[n + keep]:
            keep += 1
        return proposal[:keep]


def synthetic(n: int, length: int, seed: int = 0) -> dict[str, dict]:
    rng = random.Random(seed)
    data = {}
    for i in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(40, 200))]
        out: list[int] = []
        while len(out) < length:
            if out and rng.random() < 0.6:  # repeat a stretch of earlier text (lookup can find it)
                a = rng.randrange(len(out))
                out += out[a:a + rng.randrange(4, 40)]
            else:
                out += [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 12))]
        data[f"synthetic/{i}"] = {"prompt": prompt, "out": out[:length]}
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-draft-len", type=int, default=32)
    ap.add_argument("--synthetic", default="25x1024", help="without --outputs: COUNTxLENGTH synthetic sequences")
    ap.add_argument("--profile", type=int, default=0, help="cProfile: the N functions with the most own time")
    ap.add_argument("--host-ms", type=float, default=0.48, help="host ms per step for the equal-host prediction "
                    "(stock's on the H200, session 14)")
    ap.add_argument("--host-scale", type=float, default=2.0, help="H200 host time / this CPU's")
    ap.add_argument("--oracle", action="store_true", help="add the oracle-cut lookup bound (see above)")
    a = ap.parse_args(argv)
    count, length = (int(x) for x in a.synthetic.split("x"))
    # .json.gz as notes/ keeps them (the checkout travels to the GPU host, so it stays small)
    data = (json.loads(gzip.decompress(a.outputs.read_bytes()) if a.outputs.suffix == ".gz" else a.outputs.read_text())
            if a.outputs else synthetic(count, length))
    items = list(data.values())
    sequences = {tuple(v["prompt"]): list(v["prompt"]) + list(v["out"]) for v in items}
    longest = max(len(s) for s in sequences.values())
    max_seq_len = -(-(longest + 64) // 256) * 256
    ar = EngineConfig.from_dict({"dtype": "float32", "max_seq_len": max_seq_len, "drafter": "none",
                                 "kernel_backend": "triton", "cuda_graphs": False})
    base = BatchConfig(max_batch=a.concurrency, max_draft_len=a.max_draft_len, cost_curve=H200_CURVE)
    spec = ar.replace(drafter=DrafterKind.NGRAM)
    variants = standard_variants(ar, spec, ["goodput_draft", "verify_budget", "overlap_draft", "device_draft",
                                            "extrapolate", ALL_LABEL], base)
    # "all" before device_draft existed: every mechanism drafting on the host
    variants.append(BatchVariant("all, host drafting", spec, base.replace(
        **mechanism_fields("goodput_draft", "verify_budget", "overlap_draft"))))
    # a and b on the host (all's run on the device, in the lookup's step: device_policy.py)
    variants.append(BatchVariant("goodput_draft+verify_budget", spec, base.replace(
        **mechanism_fields("goodput_draft", "verify_budget"))))
    specs = [RequestSpec(f"r{i}", tuple(items[i % len(items)]["prompt"]), len(items[i % len(items)]["out"]))
             for i in range(a.requests)]
    print(f"{len(items)} sequences, {a.requests} requests at concurrency {a.concurrency}")
    print("| variant | steps | tok/step | host us/step | host us per request-step | forward tokens/step | "
          "predicted H200 tok/s, equal host | predicted, scaled host |")
    print("|---|---|---|---|---|---|---|---|")
    curve = CostCurve(H200_CURVE)
    prof = cProfile.Profile() if a.profile else None
    runs = [(v, None) for v in variants]
    if a.oracle:
        stock = next(v for v in variants if v.label == "stock")
        oracle_engine = stock.engine.replace(draft_len=a.max_draft_len)

        def oracle(req, e=oracle_engine):
            return OracleCut(sequences[tuple(req.prompt)], e.draft_len, e.ngram_max, e.ngram_min)
        runs.append((dataclasses.replace(stock, label="oracle-cut lookup", engine=oracle_engine), oracle))
    for v, factory in runs:
        policy = DevicePolicy(a.concurrency, a.max_draft_len, "cpu") if v.batch.needs_cost_curve else None
        lookup = (BatchNgramDrafter(a.concurrency, max_seq_len, a.max_draft_len, v.engine.ngram_min, v.engine.ngram_max,
                                    "cpu", policy=policy, extrapolate=v.batch.extrapolate, vocab=VOCAB)
                  if v.batch.device_draft else None)
        runner = ReplayRunner(sequences, a.concurrency, 1 + a.max_draft_len, max_seq_len, lookup)
        engine = BatchEngine(runner, v.engine, v.batch, frozenset(), cost_curve=curve, drafter_factory=factory)
        if prof is not None and v.label == ALL_LABEL:
            prof.enable()
        t = time.perf_counter()
        res = engine.run(specs)
        wall = time.perf_counter() - t - runner.device_s  # the host's share: the replay stands for the GPU
        if prof is not None:
            prof.disable()
        for r, s in zip(res.requests, specs):  # the replay is only meaningful if the engine committed the truth
            truth = sequences[s.prompt][len(s.prompt):]
            assert r.tokens == truth[:len(r.tokens)] and len(r.tokens) == len(truth), f"{v.label} {r.id}: diverged"
        steps = len(res.steps)
        rows = sum(s.decode for s in res.steps)
        committed = sum(s.committed for s in res.steps)
        forward_s = sum(float(curve.at(st.tokens)) for st in res.steps)
        equal = committed / (forward_s + steps * a.host_ms * 1e-3)
        scaled = committed / (forward_s + wall * a.host_scale)
        print(f"| {v.label} | {steps} | {committed / max(1, rows):.2f} | {wall / steps * 1e6:.0f} | "
              f"{wall / max(1, rows) * 1e6:.1f} | {sum(st.tokens for st in res.steps) / steps:.1f} | {equal:.0f} | "
              f"{scaled:.0f} |")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
