"""Where a block-drafter step's time goes (random SmolLM2-135M target, random 2-layer block-16 drafter or --drafter's).

python3 scripts/gpu_block_drafter_step.py OUT_DIR [--device cpu] [--tokens N] [--reps R] [--tree-budget B]
    [--sections steps,engine,loop,ar] [--grid-dependency off] [--kernel-table FILE] [--only NAME,..]
    [--window W --position P]
steps: for each drafter step (`reference`: BlockStep, the trainer's bits; `fused`: FusedBlockStep, the engine's
Triton kernels; `fused, default launches`: that with DraftLaunches' projections at their defaults; `fused, top-k in
256-logit chunks`: DraftLaunches.topk_block 256 against 1024) the draft graph,
one replay + sync (BlockTreeDrafter.distributions), the observe graph of n accepted
tokens (n = 1, 4, 16), and the kernels both launch (torch.profiler). engine: SpecEngine.generate with chain and
tree-B verification (calibrated and grown; position- and block-ordered attention), host loop and device loop,
beside AR: ms/token and ms/step (a random drafter commits ~1 token a step, so ms/step is the cost of a speculative
step against AR's ms/token). loop: the kernels per step of AR, a chain and the trees + ngram_prefix on the device loop,
and each kernel's share of the timeline (what it adds to the wall time under PDL: its end past the one before).
ar: AR at 1..16 steps a graph. --grid-dependency off: kernels in plain stream order, so that the profiled times are
each kernel's own, not its wait for the one before (PDL). --kernel-table: every engine launches its kernels with that
table (a tuner's summary.json or [key, params JSON] pairs, kernels.table), e.g. an A/B of one launch field. On CPU
(no graphs) it times eager calls and counts no kernels: a smoke test of the script.
"""
import argparse
import collections
import contextlib
import importlib
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.drafting.checkpoint import load_drafter
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, DrafterLaunches, EngineConfig, VerifyMode
from specpilot.engines.drafters.block import BlockDrafterConfig, BlockDrafterModel
from specpilot.engines.drafters.block_fused import DraftLaunches
from specpilot.engines.drafters.block_tree import BlockTreeDrafter, TreeShape
from specpilot.engines.loader import random_model
from specpilot.engines.shapes import SMOLLM2_135M
from specpilot.kernels.pdl import grid_dependency, parse_grid_dependency
from specpilot.kernels.table import read_pairs

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--device", default="cuda")
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--reps", type=int, default=200, help="calls per timing (CPU smoke test: TRITON_INTERPRET=1, 1)")
ap.add_argument("--grid-dependency", default="",
                help="MODE[:PREFETCH_MIB[:LARGE_MODE]] (kernels.pdl): e.g. off, so the profiled kernel times are each "
                     "kernel's own, not its wait for the one before")
ap.add_argument("--tree-budget", type=int, default=31, help="the trees' nodes (15: the smollm2-135m-h200 grown tree)")
ap.add_argument("--sections", default="steps,engine,loop",
                help="which of steps, engine, loop, ar (AR at 1..16 steps a graph) to run")
ap.add_argument("--only", default="", help="engine section: only the engines whose name holds one of these "
                                          "comma-separated strings")
ap.add_argument("--kernel-table", default="",
                help="launch every engine with this kernel table (kernels.table); several, comma-separated: the "
                     "engine section builds its engines once per table and times them in turn, --rounds times "
                     "(an A/B of launch fields in one process, each round's order the same, drift shared)")
ap.add_argument("--rounds", type=int, default=3, help="engine section with several tables: timed rounds")
ap.add_argument("--pdl-off-too", default="",
                help="engine section with several tables: every engine also with these kernel modules' launches in "
                     "plain stream order (their pdl_launch patched while it builds and captures), comma-separated "
                     "'+'-joined sets of specpilot.kernels modules, e.g. attn,embed,attn+embed: '<config> [<table>, "
                     "pdl off: attn]'")
ap.add_argument("--drafter", default="", help="a saved drafter (e.g. specpilot/drafting/shipped/smollm2-135m) instead "
                                              "of a random default-shaped one: its shape's costs (its MLP width, "
                                              "the target layers it reads); acceptance stays meaningless")
ap.add_argument("--window", type=int, default=0,
                help="the drafter's context window (EngineConfig.drafter_window; 0: the whole context)")
ap.add_argument("--position", type=int, default=200, help="steps section: the pending position the draft runs at")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
dev, cuda = args.device, args.device.startswith("cuda")
target = random_model(SMOLLM2_135M, torch.bfloat16, dev, seed=0)
drafter = (load_drafter(args.drafter, target) if args.drafter else
           BlockDrafterModel(BlockDrafterConfig.for_target(SMOLLM2_135M, layers=2, block_size=16)).init_weights(0))
tables = {os.path.basename(f).removesuffix(".json"): read_pairs(f) for f in args.kernel_table.split(",") if f}
cfg = EngineConfig(drafter=DrafterKind.BLOCK, block_size=16, max_seq_len=4096, cuda_graphs=cuda,
                   kernel_backend="triton" if cuda else "torch",
                   kernel_table=next(iter(tables.values())) if len(tables) == 1 else (), drafter_window=args.window)
prompt = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(0)).tolist()
sync = torch.cuda.synchronize if cuda else (lambda: None)


def ms_per_call(fn) -> float:
    reps = args.reps
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t) / reps


def kernels(fn) -> dict:
    """Kernels fn launches (graph replays included) and their summed device time, by kernel name."""
    if not cuda:
        return {}
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    seen = collections.Counter()
    us = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            seen[e.name[:90]] += 1
            us[e.name[:90]] += e.device_time
    return {"count": sum(seen.values()), "device_us": round(sum(us.values()), 1),
            "by_kernel": {k: [seen[k], round(us[k], 1)] for k, _ in us.most_common()}}


def step_costs(fused: bool, launches: DraftLaunches = DraftLaunches()) -> dict:
    blocks = BlockTreeDrafter(drafter, target, TreeShape.from_config(cfg), cfg.max_seq_len, dev, cuda_graphs=cuda,
                              fused=fused, window=args.window, launches=launches)
    blocks.capture_all()
    position = args.position
    blocks.observe(0, torch.randn(position, blocks.step.config.feature_dim, dtype=torch.bfloat16, device=dev))
    features = torch.randn(16, blocks.step.config.feature_dim, dtype=torch.bfloat16, device=dev)
    draft = lambda: blocks.distributions(prompt[0], position, 15)  # noqa: E731
    observe = lambda n: (lambda: blocks.observe(position - 16, features[:n]))  # noqa: E731
    out = {"step": type(blocks.step).__name__, "draft_ms": ms_per_call(draft),
           "observe_ms": {n: ms_per_call(observe(n)) for n in (1, 4, 16)},
           "draft_kernels": kernels(draft), "observe_kernels": {n: kernels(observe(n)) for n in (1, 16)}}
    blocks.n_ctx = position  # the observes above ended at position - 16 + n
    return out


def engine_costs(c: EngineConfig, reps: int = 1) -> dict:
    """One request of --tokens tokens (the fastest of `reps`: A/Bs of ~1% want the noise of one run out)."""
    engine = build_engine(c, target, frozenset(), dev, block_drafter=drafter)
    engine.warm_up(prompt, 8)
    r = min((engine.generate(prompt, args.tokens) for _ in range(reps)), key=lambda g: g.decode_s)
    steps = len(r.steps) or 1
    return {"ms_per_token": 1e3 * r.decode_s / len(r.tokens), "ms_per_step": 1e3 * r.decode_s / steps,
            "tokens_per_step": r.accepted_per_step}


@contextlib.contextmanager
def pdl_off(mods: str):
    """specpilot.kernels modules ('+'-joined names) launching in plain stream order inside the block."""
    modules = [importlib.import_module(m if "." in m else f"specpilot.kernels.{m}") for m in mods.split("+") if m]
    saved = [m.pdl_launch for m in modules]
    for m in modules:
        m.pdl_launch = lambda *a, **kw: {"PDL": 0}
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.pdl_launch = f


def engine_rounds(configs: dict[str, EngineConfig]) -> dict:
    """Every config under every table, built once, then one request each in turn for --rounds rounds: per
    '<config> [<table>]' the fastest round (its ms_per_step etc.) and every round's ms/step."""
    engines = {}
    for name, c in configs.items():
        for stem, pairs in tables.items():
            for mods in ["", *(m for m in args.pdl_off_too.split(",") if m)]:
                with pdl_off(mods):  # the graphs keep the launches they were captured with
                    e = build_engine(c.replace(kernel_table=pairs), target, frozenset(), dev, block_drafter=drafter)
                    engines[f"{name} [{stem}{f', pdl off: {mods}' if mods else ''}]"] = e
                    e.warm_up(prompt, 8)
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            r = e.generate(prompt, args.tokens)
            runs[name].append((1e3 * r.decode_s / len(r.tokens), 1e3 * r.decode_s / (len(r.steps) or 1),
                               r.accepted_per_step))
    return {name: {"ms_per_token": min(rs)[0], "ms_per_step": min(rs, key=lambda x: x[1])[1],
                   "tokens_per_step": rs[0][2], "rounds_ms_per_step": [round(x[1], 4) for x in rs]}
            for name, rs in runs.items()}


def loop_kernels(c: EngineConfig, tokens: int = 128) -> dict:
    """Kernels per speculative step of a generate on the device loop (graph replays included; the prefill's
    kernels are counted too, spread over the steps): where a step's time goes besides the target's forward."""
    if not cuda:
        return {}
    engine = build_engine(c, target, frozenset(), dev, block_drafter=drafter)
    engine.warm_up(prompt, 8)
    engine.generate(prompt, tokens)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = engine.generate(prompt, tokens)
        sync()
    steps = len(r.steps) or 1
    seen, us = collections.Counter(), collections.Counter()
    spans = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            seen[e.name[:90]] += 1
            us[e.name[:90]] += e.device_time
            spans.append((e.time_range.start, e.time_range.end, e.name[:90]))
    # The timeline's critical path: with PDL a kernel starts before its predecessor ends and waits, so its duration
    # overstates what it adds; what it adds to the wall time is its end past the one before (idle: a gap before it).
    critical, idle = collections.Counter(), collections.Counter()
    last = None
    for start, end, name in sorted(spans):
        last = start if last is None else last
        idle[name] += max(0.0, start - last)
        critical[name] += max(0.0, end - max(start, last))
        last = max(last, end)
    per_step = lambda c: {k: round(v / steps, 2) for k, v in c.most_common()}  # noqa: E731
    return {"steps": steps, "kernels_per_step": round(sum(seen.values()) / steps, 1),
            "device_us_per_step": round(sum(us.values()) / steps, 1),
            "wall_us_per_step": round((max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / steps, 1)
            if spans else 0.0,
            "by_kernel": {k: [round(seen[k] / steps, 2), round(us[k] / steps, 2)] for k, _ in us.most_common()},
            "critical_us_per_step": per_step(critical), "idle_us_per_step": per_step(idle)}


# The bench's tree: --tree-budget nodes, position-ordered attention, led by lookup; a static tree's first steps
# calibrate its shape on the host loop, the rest run on the device loop.
tree = cfg.replace(verify=VerifyMode.TREE, tree_budget=args.tree_budget, position_ordered_attention=True,
                   device_steps=4)
grown = tree.replace(device_tree="per_step")
tb = f"tree {args.tree_budget}"
sections = set(args.sections.split(","))


def guarded(fn, *a, **kw) -> dict:
    """A section that fails records its error instead of losing the sections measured before it."""
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - a measurement script: report and go on
        return {"error": f"{type(e).__name__}: {e}"}


def measure() -> dict:
    engine, ar, loop = {}, {}, {}
    if "engine" in sections:
        configs = {
            "ar": cfg.replace(drafter=DrafterKind.NONE),
            "chain host loop": cfg.replace(device_steps=1),
            "chain device loop x4": cfg.replace(device_steps=4),
            "chain device loop x4 overlapped": cfg.replace(device_steps=4, device_overlap=True),
            "chain device loop x1 overlapped": cfg.replace(device_steps=1, device_overlap=True),
            f"{tb} device loop x4": tree,
            f"{tb} grown per step, device loop x4": grown,
            # EngineConfig.observe_overlap: the drafter's observe on a second stream beside the target's last layers
            f"{tb} grown per step, device loop x4, observe beside": grown.replace(observe_overlap=True),
            # the shipped line's chunks: one step each, queued ahead
            f"{tb} grown per step, device loop x1 overlapped": grown.replace(device_steps=1, device_overlap=True),
            f"{tb} grown per step, device loop x1 overlapped, observe beside": grown.replace(
                device_steps=1, device_overlap=True, observe_overlap=True),
            # led by lookup behind the shipped line's gate; EngineConfig.lookup_overlap: the lookup beside the draft
            **{f"{tb} grown per step + lookup, device loop x1 overlapped{name}": grown.replace(
                device_steps=1, device_overlap=True, ngram_prefix=True, lookup_agree_topk=2, lookup_doubt_prob=0.7,
                **over) for name, over in (("", {}), (", lookup beside", {"lookup_overlap": True}),
                                           (", observe and lookup beside",
                                            {"lookup_overlap": True, "observe_overlap": True}))},
            # what position-ordered attention costs: the chain with it, the trees without (not bit-exact)
            "chain device loop x4, position-ordered": cfg.replace(device_steps=4, position_ordered_attention=True),
            f"{tb} device loop x4, block-ordered": tree.replace(position_ordered_attention=False),
            f"{tb} grown, device loop x4, block-ordered": grown.replace(position_ordered_attention=False)}
        only = [o for o in args.only.split(",") if o]
        configs = {name: c for name, c in configs.items() if not only or any(o in name for o in only)}
        engine = (engine_rounds(configs) if len(tables) > 1 else
                  {name: guarded(engine_costs, c) for name, c in configs.items()})
    if "ar" in sections:  # AR's steps a graph (EngineConfig.ar_steps): what the host's round trip between graphs costs
        ar = {f"ar, {k} steps a graph": engine_costs(cfg.replace(drafter=DrafterKind.NONE, ar_steps=k), reps=5)
              for k in (1, 2, 4, 8, 16)}
    if "loop" in sections:
        # AR's kernels a token beside them: a step's premium over AR, kernel by kernel, is the difference of the two
        loop = {"ar": guarded(loop_kernels, cfg.replace(drafter=DrafterKind.NONE)),
                "chain + ngram_prefix, device loop x4": loop_kernels(cfg.replace(device_steps=4, ngram_prefix=True)),
                f"{tb} + ngram_prefix, device loop x4": guarded(loop_kernels, tree.replace(ngram_prefix=True), 256),
                f"{tb} grown + ngram_prefix, device loop x4": guarded(loop_kernels, grown.replace(ngram_prefix=True),
                                                                      256)}
    # "fused, default launches": the fused step with every projection at its wrapper's defaults (DraftLaunches' A/B)
    untuned = DraftLaunches.of(DrafterLaunches.DEFAULT)
    steps = {"reference": step_costs(False), "fused": step_costs(True),
             "fused, default launches": step_costs(True, untuned),
             "fused, top-k in 256-logit chunks": step_costs(True, DraftLaunches(topk_block=256))} \
        if "steps" in sections else {}
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "steps": steps, "engine": engine,
            "ar_steps": ar, "loop_kernels": loop}


with grid_dependency(**parse_grid_dependency(args.grid_dependency)) if args.grid_dependency else \
        contextlib.nullcontext():
    res = measure()
json.dump(res, open(os.path.join(args.out, "block_drafter_step.json"), "w"), indent=1)
for name, s in res["steps"].items():
    print(name, s["step"], "draft ms", round(s["draft_ms"], 4), "observe ms",
          {n: round(v, 4) for n, v in s["observe_ms"].items()},
          "draft kernels", s["draft_kernels"].get("count"), s["draft_kernels"].get("device_us"))
print("| engine | ms/token | ms/step | tokens/step |\n|---|---|---|---|")
for name, e in {**res["engine"], **res["ar_steps"]}.items():
    if "error" in e:
        print(f"| {name} | {e['error']} |")
        continue
    print(f"| {name} | {e['ms_per_token']:.4f} | {e['ms_per_step']:.4f} | {e['tokens_per_step']:.3f} |"
          + (f" rounds {e['rounds_ms_per_step']}" if "rounds_ms_per_step" in e else ""))
for name, k in res["loop_kernels"].items():
    if "error" in k:
        print(name, k["error"])
    elif k:
        print(f"{name}: {k['kernels_per_step']} kernels, {k['device_us_per_step']} us of kernels per step, "
              f"{k['wall_us_per_step']} us of timeline ({sum(k['idle_us_per_step'].values()):.1f} idle); top, "
              "with each kernel's share of the timeline (its end past the one before) and the idle gaps before it:")
        for kern, (n, t) in list(k["by_kernel"].items())[:25]:
            print(f"   {t:8.2f} us  {n:6.2f}x  critical {k['critical_us_per_step'].get(kern, 0):8.2f}  idle "
                  f"{k['idle_us_per_step'].get(kern, 0):7.2f}  {kern}")
