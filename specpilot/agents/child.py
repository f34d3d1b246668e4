"""The sandbox's child process: runs the engine with an agent-written policy and reports tokens and timings.

Started by specpilot.agents.sandbox as `python -I -B child.py RUN_DIR` with resource limits, a scrubbed
environment, cwd = RUN_DIR and (where available) a network namespace. It reads RUN_DIR/request.json, does its
own imports and loads the model while still trusted, then locks itself down (specpilot.agents.guard) and
only then imports the agent's module, builds the engine with its policy and decodes. Everything it writes
back (RUN_DIR/result.json) is untrusted: the parent compares tokens against the stock build it runs itself.

Modes: GENERATE decodes the prompts (free-running; this process never sees a reference output). FORCED
feeds the stock sequences through the candidate's target in its own verify shape and reports argmax,
runner-up and margin per position (token forcing's forced mode); it runs in a fresh process, last.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

# Under -I the script's directory is not on sys.path: make this checkout's package importable (in a container
# the package root is mounted read-only at the same path).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
if _PACKAGE_ROOT not in sys.path:
    sys.path.insert(0, _PACKAGE_ROOT)

from specpilot.agents.protocol import ChildMode, ChildRequest, ChildStatus  # noqa: E402

RESULT_FILE = "result.json"


def _load(request: ChildRequest):
    """Trusted preparation: every import the run needs, and the target's weights, before any guard is up."""
    import torch

    import specpilot.engines.build  # noqa: F401 - imported now, while imports may still write caches
    import specpilot.stages.candidate  # noqa: F401
    import specpilot.stages.validate  # noqa: F401
    from specpilot.engines.loader import load_model

    torch.set_num_threads(request.threads)
    dtype = request.target.dtype.torch
    target = load_model(Path(request.target.model_dir), dtype, request.target.device)
    draft = (load_model(Path(request.target.draft_model_dir), dtype, request.target.device)
             if request.target.draft_model_dir else None)
    if request.target.device.startswith("cuda"):
        # Triton compiles kernels and their launchers with ptxas and a C compiler (subprocesses): do it now, with
        # the stock policy, so the locked-down run finds them in the cache instead of needing to spawn anything.
        warm = specpilot.engines.build.build_engine(request.config, target, frozenset(request.target.eos),
                                                    request.target.device, draft_model=draft)
        warm.warm_up(list(request.prompts[0].ids), min(2, request.max_new_tokens))
    return target, draft


def _run(request: ChildRequest, target, draft) -> dict:
    """Untrusted part: agent code is imported and called from here on."""
    from specpilot.engines.build import build_engine
    from specpilot.stages.candidate import Candidate
    from specpilot.stages.validate import forced_pass, forced_runner

    policy = Candidate("sandboxed", request.config, policy=request.policy).load_policy()
    engine = build_engine(request.config, target, frozenset(request.target.eos), request.target.device,
                          draft_model=draft, policy=policy)
    first = request.prompts[0]
    engine.generate(list(first.ids), min(2, request.max_new_tokens))  # warm-up, as validate does
    if request.mode is ChildMode.GENERATE:
        runs = []
        for p in request.prompts:
            res = engine.generate(list(p.ids), request.max_new_tokens, p.key)
            runs.append({"key": p.key, "tokens": res.tokens, "stop_reason": res.stop_reason, "prefill_s": res.prefill_s,
                         "decode_s": res.decode_s, "committed": [s.committed for s in res.steps],
                         "accepted": [s.accepted for s in res.steps], "drafted": [s.drafted for s in res.steps]})
        return {"runs": runs}
    runner = forced_runner(engine)
    forced = []
    for p in request.prompts:
        fp = forced_pass(runner, p.ids, request.stock_outputs[p.key], request.max_new_tokens)
        forced.append({"key": p.key, "argmax": list(fp.argmax), "runner_up": list(fp.runner_up),
                       "margin": [float(m) for m in fp.margin]})
    return {"forced": forced}


def main(argv: list[str]) -> int:
    run_dir = Path(argv[1]).resolve()
    request = ChildRequest.from_dict(json.loads((run_dir / "request.json").read_text()))
    out: dict = {"status": ChildStatus.ERROR.value, "layers": [], "landlock_abi": 0}
    try:
        target, draft = _load(request)
        from specpilot.agents.guard import lock_down

        report = lock_down(str(run_dir), request.extra_writable, request.extra_readable)
        out.update(layers=list(report.layers()), landlock_abi=report.landlock_abi)
        out.update(_run(request, target, draft))
        out["status"] = ChildStatus.OK.value
    except BaseException as e:  # noqa: BLE001 - agent code may raise anything; report it, never hide it
        out["error"] = {"type": type(e).__name__, "message": str(e)[:2000],
                        "traceback": "".join(traceback.format_exception(e))[-6000:]}
    (run_dir / RESULT_FILE).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
