"""`specpilot drafter train|eval`: train a block drafter for a target, or measure one's acceptance.

`register_cli(subparsers)` adds the `drafter` command; each leaf sets `func` (parsed args -> exit status).
`python -m specpilot.drafting.train` takes the same arguments as `drafter train` (for a bare GPU host, where
only torch, transformers, safetensors and tqdm are installed).
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

from specpilot.cliutil import guarded
from specpilot.engines.config import DType, VerifyMode

# Every TrainConfig field the command line can set (as --kebab-case), besides --lr and --target-layers.
_INT_KNOBS = ("steps", "block_size", "layers", "intermediate", "batch_seqs", "anchors", "mbpp_prompts",
              "free_prompts", "free_sampled", "gen_tokens", "gen_batch", "held_out", "eval_tokens", "ckpt_every",
              "warmup", "seed", "eval_every", "user_tokens", "context_window", "task_prompts",
              "steered_prompts", "grow_layers", "grow_intermediate", "soft_topk", "held_out_each", "head_rows")


def _dtype(args: argparse.Namespace) -> DType:
    return DType(args.dtype) if args.dtype else (DType.BF16 if args.device.startswith("cuda") else DType.FP32)


def add_train_args(p: argparse.ArgumentParser) -> None:
    from specpilot.drafting.checkpoint import WeightStorage
    from specpilot.drafting.train import TrainConfig

    defaults = TrainConfig()
    p.add_argument("--target", required=True, help="model directory, testbed name (smollm2-135m) or synthetic:<shape>")
    p.add_argument("--out", required=True, type=Path, help="output directory (checkpoint + report.json)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=[d.value for d in DType], help="target dtype (default: bf16 on GPU)")
    for name in _INT_KNOBS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=getattr(defaults, name))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--soft-weight", type=float, default=defaults.soft_weight,
                   help="with --soft-topk K: the weight of the target's top-K distribution in the loss (0-1, "
                        "default 0.5)")
    layer_list = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--target-layers", type=layer_list, default=None,
                   help="comma-separated target layers the drafter reads (default: 3 spread layers)")
    p.add_argument("--grow-target-layers", type=layer_list, default=(),
                   help="with --init: features from these target layers added (fc columns zero at first)")
    p.add_argument("--checkpoint-storage", default=defaults.checkpoint_storage.value,
                   choices=[s.value for s in WeightStorage], help="int8-rows: projections as int8 with row scales")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="wall budget of the whole run: training stops in time to evaluate and save")
    p.add_argument("--no-chat-free", dest="chat_free", action="store_false",
                   help="free generations from BOS, not a sampled user turn answered through the chat template")
    p.add_argument("--init", default=None, help="a saved drafter to continue training (its architecture wins); "
                                                "give a new --seed so the run generates new data")
    p.add_argument("--data-from", default=None, help="an earlier run's out dir: train on its saved sequences "
                                                     "(features recomputed) instead of generating data")
    p.add_argument("--no-progress", action="store_true")


def run_train(args: argparse.Namespace) -> int:
    from specpilot.drafting.sources import load_target
    from specpilot.drafting.train import TrainConfig, train_drafter

    bundle = load_target(args.target, args.device, _dtype(args))
    knobs = {k: getattr(args, k) for k in (*_INT_KNOBS, "lr", "soft_weight", "target_layers", "deadline_s", "chat_free",
                                              "init", "data_from", "grow_target_layers", "checkpoint_storage")}
    cfg = replace(TrainConfig(), **knobs, device=args.device, progress=not args.no_progress)
    result = train_drafter(bundle, cfg, args.out)
    base = {r["mode"]: r for r in result.report["untrained"]["engine"]}
    for r in result.report["trained"]["engine"]:
        print(f"{r['mode']:>9}: {r['committed_per_step']:.3f} tokens/step (untrained "
              f"{base[r['mode']]['committed_per_step']:.3f}), equal to AR: {r['equal_to_ar']}")
    print(f"wrote {result.checkpoint} ({result.report['checkpoint_bytes'] / 2**20:.2f} MiB) and report.json "
          f"in {result.report['seconds']['total']:.0f} s")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from specpilot.drafting.checkpoint import load_drafter
    from specpilot.drafting.evaluate import as_dicts, measure_acceptance
    from specpilot.drafting.sources import build_prompts, load_target

    dtype = _dtype(args)
    bundle = load_target(args.target, args.device, dtype)
    drafter = load_drafter(args.drafter, bundle.model, args.mask_token_id)
    # The same seeded shuffle as training, so the held-out prompts are the ones training never saw.
    ps = build_prompts(bundle.tokenizer, bundle.shape.vocab, args.mbpp_prompts, 0, args.held_out, args.seed)
    modes = tuple(VerifyMode(m) for m in args.modes.split(","))
    knobs = {k: getattr(args, k) for k in ("tree_budget", "tree_width", "level_one_keep", "drafter_window")
             if getattr(args, k)}
    rows = measure_acceptance(bundle.model, drafter, [list(p) for p in ps.held_out], args.new_tokens, bundle.eos,
                              args.device, dtype, modes, **knobs)
    text = json.dumps({"target": args.target, "drafter": str(args.drafter), "prompts": len(ps.held_out),
                       "new_tokens": args.new_tokens, "modes": as_dicts(rows)}, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if all(r.equal_to_ar for r in rows) else 1


def _ints(text: str) -> list[int]:
    """'0,15,31' -> [0, 15, 31] (none negative)."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated integers >= 0, e.g. 0,15")
    return values


def _gates(text: str) -> list[tuple[int, float]]:
    """'2:0.5,4:0.5' -> [(2, 0.5), (4, 0.5)]: lookup_agree_topk:lookup_doubt_prob pairs."""
    try:
        return [(int(k), float(p)) for k, p in (g.split(":") for g in text.split(",") if g)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want AGREE_TOPK:DOUBT_PROB[,...], e.g. 2:0.5,4:0.5") from None


def replay_policies(args: argparse.Namespace) -> list:
    """The replay command's LookupPolicy list: per tree budget the block alone, then each lookup variant (ngram_max
    x ngram_min x lookup depth (trees no shallower than it) x periodic), ungated and under each gate."""
    from specpilot.drafting.replay import LookupPolicy
    from specpilot.engines.drafters.ngram_prefix import LeadGate

    policies = []
    for budget in args.tree_budgets:
        kw = {"tree_budget": budget, "tree_width": args.tree_width}
        policies.append(LookupPolicy(lookup=False, **kw))
        for n_max, n, depth, periodic in itertools.product(args.ngram_maxes, args.ngram_mins, args.lookup_depths,
                                                           (False, True) if args.periodic else (False,)):
            if n > n_max or depth > budget:  # chains (budget 0): no lookup depth; deeper than the tree: moot
                continue
            lookup = {**kw, "ngram_min": n, "ngram_max": n_max, "lookup_depth": depth, "periodic": periodic}
            policies.append(LookupPolicy(**lookup))
            policies += [LookupPolicy(gate=LeadGate(k, p), **lookup) for k, p in args.gates]
    return policies


def run_replay(args: argparse.Namespace) -> int:
    from specpilot.bench.session import DeploymentSession
    from specpilot.deployments import load_deployment
    from specpilot.drafting.replay import cached_candidates, record_references, replay_all
    from specpilot.drafting.replay_report import as_rows, format_table, plot_position_accuracy, position_accuracy
    from specpilot.workload import WorkloadSpec

    dep = load_deployment(args.deployment)
    overrides = {k: v for k, v in (("prompts_per_benchmark", args.prompts_per_benchmark),
                                   ("max_new_tokens", args.max_new_tokens)) if v}
    wl = WorkloadSpec(**{**dep.workload.__dict__, **overrides})
    session = DeploymentSession(dep, device=args.device)
    if args.drafter is not None:  # a checkpoint to judge against the deployment's target and references
        from specpilot.drafting.checkpoint import load_drafter
        drafter = load_drafter(args.drafter, session.target)
    else:
        drafter = session.block_drafter(args.drafter_label)
    if drafter is None:
        raise ValueError(f"deployment {dep.name} has no block drafter to replay (or pass --drafter DIR)")
    split = wl.select(args.benchmarks_dir)
    prompts = session.tokenize(list(split.validate if args.split == "validate" else split.tune))
    ar_cfg = dep.ar_config()
    longest = max(len(p.ids) for p in prompts) + wl.max_new_tokens + 16
    ar_cfg = ar_cfg.replace(max_seq_len=max(ar_cfg.max_seq_len, longest))
    engine = session.engine(ar_cfg)
    refs = record_references(lambda ids: engine.generate(ids, wl.max_new_tokens).tokens,
                             [(p.key, p.prompt.benchmark.value, p.ids) for p in prompts],
                             args.out / "references.jsonl", progress=not args.no_progress)
    session.release(ar_cfg)
    policies = replay_policies(args)
    rows, positions = [], {}
    for window in args.drafter_windows:  # the candidates depend on the window, the policies not
        cands = cached_candidates(drafter, session.target, refs, args.out / "candidates",
                                  topk=max(4, args.tree_width), progress=not args.no_progress, window=window)
        positions[window] = position_accuracy(refs, cands)
        rows += [{"policy": (f"w{window} " if window else "") + r.policy.label, "drafter_window": window,
                  "tokens_per_step": r.overall(), "mean_tokens_per_step": r.mean(), "by_benchmark": r.by_benchmark(refs),
                  "per_request": r.tokens_per_step} for r in replay_all(refs, cands, policies)]
    (args.out / "replay.json").write_text(json.dumps({
        "deployment": dep.name, "split": args.split, "requests": len(refs), "max_new_tokens": wl.max_new_tokens,
        "policies": rows, "position_accuracy": {str(w): as_rows(b) for w, b in positions.items()}}, indent=1))
    picture = plot_position_accuracy(positions, args.out / "replay_positions.png")
    benches = sorted({r.benchmark for r in refs})
    print(f"{'policy':42s} {'tok/step':>8s} {'mean':>6s}  " + "  ".join(f"{b[:9]:>9s}" for b in benches))
    for row in rows:
        print(f"{row['policy']:42s} {row['tokens_per_step']:8.3f} {row['mean_tokens_per_step']:6.2f}  "
              + "  ".join(f"{row['by_benchmark'].get(b, float('nan')):9.3f}" for b in benches))
    print(f"tokens per step: geometric means over {len(refs)} requests ({args.split} split; `mean`: the arithmetic "
          f"mean, as the bench's tokens/step); wrote {args.out / 'replay.json'}")
    print("\nthe block's depth-1 top-1 accuracy / top-1 chain length by output position:\n" + format_table(positions)
          + (f"\n({picture})" if picture else ""))
    return 0


_guarded = guarded("drafter", "drafter_command", (ValueError, OSError), exit_code=True)


def run_rank_tokens(args: argparse.Namespace) -> int:
    from specpilot.drafting.checkpoint import read_config
    from specpilot.drafting.token_ranking import generated_counts, load_token_ranking, save_token_ranking

    vocab = read_config(args.drafter).get("drafter", {}).get("vocab")
    if not isinstance(vocab, int):
        raise ValueError(f"{args.drafter}/config.json names no drafter vocab: not a SpecPilot drafter checkpoint")
    counts = generated_counts(args.sequences, vocab)
    path = save_token_ranking(args.drafter, counts, ", ".join(map(str, args.sequences)))
    ranking = load_token_ranking(args.drafter, vocab)
    print(f"wrote {path}: {ranking.numel()} distinct tokens ranked from {int(counts.sum())} generated")
    for rows in (4096, 8192, 16384):
        if rows < ranking.numel():
            print(f"  the first {rows} rows hold {counts[ranking[:rows]].sum() / counts.sum():.2%} of them")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from specpilot.drafting.train import TrainConfig

    parser = subparsers.add_parser("drafter", help="block drafters: train one for a target, measure acceptance")
    sub = parser.add_subparsers(dest="drafter_command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a block drafter on data the target generates itself")
    add_train_args(p)
    p.set_defaults(func=_guarded(run_train))

    defaults = TrainConfig()
    p = sub.add_parser("eval", help="mean accepted per step of a drafter checkpoint (ours or DFlash) with the engine")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, type=Path, help="checkpoint directory (ours or DFlash layout)")
    p.add_argument("--mask-token-id", type=int, default=None, help="for DFlash checkpoints without one in their config")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=[d.value for d in DType])
    p.add_argument("--modes", default="chain,tree,two_level")
    p.add_argument("--new-tokens", type=int, default=defaults.eval_tokens)
    p.add_argument("--tree-budget", type=int, default=None)
    p.add_argument("--tree-width", type=int, default=None)
    p.add_argument("--level-one-keep", type=int, default=None)
    p.add_argument("--drafter-window", type=int, default=None,
                   help="the drafter's context window (EngineConfig.drafter_window; default: the whole context)")
    p.add_argument("--held-out", type=int, default=defaults.held_out)
    p.add_argument("--mbpp-prompts", type=int, default=defaults.mbpp_prompts)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.set_defaults(func=_guarded(run_eval))

    p = sub.add_parser("replay", help="tokens per step of lookup/gate/tree policies, replayed on recorded AR outputs")
    p.add_argument("--deployment", required=True, help="a deployment with a block drafter (YAML path or name)")
    p.add_argument("--drafter-label", default=None, help="which block drafter (default: the first)")
    p.add_argument("--drafter", default=None, help="a drafter checkpoint directory to replay instead of the "
                                                   "deployment's (e.g. a training run's out dir)")
    p.add_argument("--out", required=True, type=Path,
                   help="directory: references.jsonl (resumed), candidates/ (kept per drafter) and replay.json")
    p.add_argument("--device", default=None, help="default: the deployment's")
    p.add_argument("--split", choices=["tune", "validate"], default="validate")
    p.add_argument("--prompts-per-benchmark", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--benchmarks-dir", default=None)
    p.add_argument("--gates", type=_gates, default=_gates("1:0.5,2:0.5,4:0.5,2:0.3,2:0.7"),
                   help="AGREE_TOPK:DOUBT_PROB pairs to replay (default %(default)s)")
    p.add_argument("--tree-budgets", type=_ints, default=[0],
                   help="0 = chain; e.g. 0,31")
    p.add_argument("--tree-width", type=int, default=4)
    p.add_argument("--ngram-mins", type=_ints, default=[1],
                   help="the lookup's shortest suffix (ngram_min) values to replay, e.g. 1,2")
    p.add_argument("--drafter-windows", type=_ints, default=[0],
                   help="drafter context windows to replay (EngineConfig.drafter_window; 0: the whole context), "
                        "e.g. 0,256: the candidates are computed once per window")
    p.add_argument("--ngram-maxes", type=_ints, default=[4],
                   help="the lookup's longest suffix (ngram_max) values to replay, e.g. 4,8")
    p.add_argument("--lookup-depths", type=_ints, default=[0],
                   help="trees: how deep the lookup may lead, past the block's depth (EngineConfig.lookup_depth; "
                        "0: the block's depth), e.g. 0,31")
    p.add_argument("--periodic", action="store_true",
                   help="also replay every lookup policy with a periodic lookup (EngineConfig.lookup_periodic)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_guarded(run_replay))

    p = sub.add_parser("rank-tokens", help="rank the tokens a target generated (training sequences) beside a drafter: "
                                           "what EngineConfig.drafter_head_rows keeps")
    p.add_argument("--drafter", required=True, type=Path, help="the drafter's checkpoint directory (written into)")
    p.add_argument("sequences", nargs="+", type=Path,
                   help="saved training sequences (a training run's sequences/train.safetensors)")
    p.set_defaults(func=_guarded(run_rank_tokens))
    return parser
