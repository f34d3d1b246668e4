"""Wheelhouse for the offline GPU host (scripts/gpu_two_explorers.sh), built here where PyPI is reachable.

`build`: resolves what the tune flow imports beyond the host's image (prefect, duckdb, boto3, optuna, gguf,
anthropic, at the versions this venv runs) for CPython 3.12 on manylinux x86-64, drops every distribution the
host image already has (its package list, devices' KINDS.md, as read 2026-11-17) and those a run never imports
(LEAVE_OUT), downloads the rest as wheels into .whl/prefect with two small prompt sets, and fails if the folder
exceeds its size budget.

`verify`: the same install and run path without a GPU host: the same distributions as CPython 3.11 wheels,
installed by scripts/gpu_two_explorers.sh with `--no-index --no-deps --target` into a bare virtual
environment that sees only this venv's copies of the host image's packages, then a CPU tune through it.

    .venv/bin/python scripts/gpu_wheelhouse.py build [--out .whl/prefect] [--max-mib 56]
    .venv/bin/python scripts/gpu_wheelhouse.py verify [--work /tmp/wheelhouse-verify]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import distributions, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("prefect", "duckdb", "boto3", "optuna", "gguf", "anthropic")
BENCHMARK_FILES = ("humaneval.jsonl", "mt_bench.questions.jsonl")  # the random-weight run's two prompt sets
HOST_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()) - {"certifi"}  # the host's certifi 2026.7.22 is older than prefect 3.9.1 needs (>= 2026.10.19): carried
# Required by the roots' metadata but never imported by a tune run with a local store (traced over a whole CPU run,
# main process and ephemeral server): left out so the wheelhouse fits one device call. The offline run's
# requirement check reports them as left out, not as missing.
LEAVE_OUT = {
    **dict.fromkeys(("boto3", "botocore", "s3transfer", "jmespath"),
                    "S3 stores only (specpilot imports boto3 when one is opened; the run uses a local store)"),
    **dict.fromkeys(("anthropic", "jiter"), "the LLM proposer (needs the Anthropic API; the host has no network)"),
    **dict.fromkeys(("apprise", "oauthlib", "requests-oauthlib"), "Prefect notification blocks"),
    **dict.fromkeys(("cyclopts", "rich-rst", "docstring-parser", "readchar", "dateparser", "tzlocal", "ruamel-yaml",
                     "griffe", "semver"), "the prefect command line (the run calls the flow in-process)"),
    **dict.fromkeys(("docker",), "Docker work pools"),
    **dict.fromkeys(("httpx2", "httpcore2", "truststore", "jsonpatch", "python-json-logger", "text-unidecode",
                     "pycparser"), "optional code paths of Prefect and its dependencies, not reached"),
}
LEFT_OUT_NAME = "left-out.txt"
# The host runs CPython 3.12 on x86-64 Linux (glibc 2.39); pip matches manylinux tags exactly, so name them all.
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
          *[f"--platform=manylinux_2_{n}_x86_64" for n in range(17, 40)], "--platform=manylinux2014_x86_64",
          "--platform=manylinux1_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def needed() -> list[tuple[str, str]]:
    """(name, version) of every distribution the roots need on the host and the host lacks."""
    with tempfile.TemporaryDirectory() as tmp:
        # This venv's versions as constraints: the host runs what the tests here ran.
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text("".join(f"{d.metadata['Name']}=={d.version}\n" for d in distributions()
                                       if norm(d.metadata["Name"]) not in {"specpilot", "torch", "triton"}
                                       and not norm(d.metadata["Name"]).startswith("nvidia")))
        report = Path(tmp, "report.json")
        pip("install", "-q", "--dry-run", "--ignore-installed", "--report", str(report), "--target", f"{tmp}/t",
            *TARGET, "-c", str(constraints), *[f"{r}=={version(r)}" for r in ROOTS])
        items = json.loads(report.read_text())["install"]
    names = {norm(i["metadata"]["name"]) for i in items}
    unknown = set(LEAVE_OUT) - names
    if unknown:  # a renamed or dropped dependency: the list above must follow the resolution
        raise SystemExit(f"LEAVE_OUT names {sorted(unknown)}, which the resolution no longer contains")
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in items
                  if norm(i["metadata"]["name"]) not in HOST_PACKAGES | set(LEAVE_OUT))


def build(out: Path, max_mib: float) -> int:
    keep = needed()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # a previous build's wheels: only the current set may stay (one version each)
        old.unlink()
    pip("download", "-q", "--no-deps", *TARGET, "-d", str(out), *[f"{n}=={v}" for n, v in keep])
    (out / LEFT_OUT_NAME).write_text("".join(f"{name}\t{why}\n" for name, why in sorted(LEAVE_OUT.items())))
    from specpilot.workload import benchmarks_dir
    (out / "benchmarks").mkdir(exist_ok=True)
    for name in BENCHMARK_FILES:
        shutil.copy(benchmarks_dir() / name, out / "benchmarks" / name)
    sizes = {p.name: p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    total = sum(sizes.values()) / 2**20
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{len(keep)} wheels + {len(BENCHMARK_FILES)} prompt sets in {out}: {total:.1f} MiB (budget {max_mib} MiB)")
    return 0 if total <= max_mib else 1


def fake_host_site(dest: Path) -> None:
    """This venv's copies of the host image's packages (and only those), linked into one folder."""
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    dest.mkdir(parents=True)
    for dist in distributions(path=[str(site)]):
        if norm(dist.metadata["Name"]) not in HOST_PACKAGES:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            if (site / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site / top)


def verify(work: Path, wheels: Path) -> int:
    if work.exists():
        shutil.rmtree(work)
    twin = work / "wheels-cp311"
    versions = [f"{p.name.split('-')[0]}=={p.name.split('-')[1]}" for p in sorted(wheels.glob("*.whl"))]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(twin), *versions)
    shutil.copytree(wheels / "benchmarks", twin / "benchmarks")
    shutil.copy(wheels / LEFT_OUT_NAME, twin / LEFT_OUT_NAME)
    subprocess.run([sys.executable, "-m", "venv", str(work / "bare")], check=True)
    fake_host_site(work / "host-site")
    env = {**os.environ, "WHEELS": str(twin), "SITE": str(work / "site"), "PYTHON": str(work / "bare/bin/python"),
           "PYTHONPATH": str(work / "host-site"), "OUT": str(work / "out"), "OMP_NUM_THREADS": "1"}
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_two_explorers.sh"), "--device", "cpu", "--trials", "2",
                          "--max-new-tokens", "16"], env=env, cwd=REPO)
    print(f"verify: gpu_two_explorers.sh --device cpu exited {run.returncode} with {len(versions)} carried "
          f"distributions over the host image's packages only")
    return run.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=REPO / ".whl/prefect")
    b.add_argument("--max-mib", type=float, default=56.0)
    v = sub.add_parser("verify")
    v.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "wheelhouse-verify")
    v.add_argument("--wheels", type=Path, default=REPO / ".whl/prefect")
    a = parser.parse_args()
    return build(a.out, a.max_mib) if a.command == "build" else verify(a.work, a.wheels)


if __name__ == "__main__":
    sys.exit(main())
