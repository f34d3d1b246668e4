"""containers/: the Docker build context (repository root minus .dockerignore) is assembled for real and each
Dockerfile is checked against it and pyproject.toml; prefect.yaml's Docker pool option is checked with docker-py,
which the Docker worker hands it to. No Docker engine is needed (none exists here)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from specpilot.containers import (REPO_ROOT, DockerIgnore, assemble_context, check_dockerfile, context_files,
                                  dockerfiles, parse_dockerfile)

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("ctx") / "context"
    return out, assemble_context(out)


def _touch(root: Path, *paths: str) -> None:
    for rel in paths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")


def test_dockerignore_follows_dockers_rules():
    ignore = DockerIgnore.parse("# comment\n*.md\n!README.md\n/build\ndocs/**/*.txt\n**/cache\n!keep/cache\nw?.bin\n")
    assert ignore.excludes("notes.md") and not ignore.excludes("README.md")  # the last matching pattern wins
    assert not ignore.excludes("sub/notes.md")  # '*' stays within one path segment, as in Docker
    assert ignore.excludes("build/x/y.o")  # a pattern naming a directory covers everything under it
    assert ignore.excludes("docs/a.txt") and ignore.excludes("docs/a/b/c.txt") and not ignore.excludes("docs/a.rst")
    assert ignore.excludes("x/y/cache/z") and ignore.excludes("cache") and not ignore.excludes("keep/cache/f")
    assert ignore.excludes("w1.bin") and not ignore.excludes("w12.bin")


def test_context_leaves_out_weights_venvs_wheels_and_caches(tmp_path):
    (tmp_path / ".dockerignore").write_text((REPO_ROOT / ".dockerignore").read_text())
    _touch(tmp_path, "pyproject.toml", "prefect.yaml", "README.md", "specpilot/__init__.py",
           "specpilot/deployments/a.yaml", "specpilot/__pycache__/x.cpython-311.pyc", "specpilot/engines/w.safetensors",
           "specpilot/testbed/m.gguf", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".whl/prefect/p.whl",
           "models/llama/model.safetensors", "runs/r1/steps.parquet", "memory.duckdb", ".git/HEAD",
           "specpilot.egg-info/PKG-INFO", "tests/test_x.py", ".tb/smollm2/model.safetensors")
    assert context_files(tmp_path) == ["prefect.yaml", "pyproject.toml", "specpilot/__init__.py",
                                       "specpilot/deployments/a.yaml"]


def test_the_real_context_holds_the_package_and_nothing_heavy(context):
    out, files = context
    assert {"pyproject.toml", "prefect.yaml", "specpilot/cli.py", "specpilot/flows/tune.py",
            "specpilot/deployments/smollm2-135m-cpu.yaml"} <= set(files)
    assert all((out / f).is_file() for f in files)
    heavy = (".safetensors", ".gguf", ".bin", ".pt", ".whl", ".pyc", ".duckdb", ".parquet")
    assert not [f for f in files if f.endswith(heavy) or f.split("/")[0] in (".venv", ".whl", ".tb", ".git", "tests")]
    assert sum((out / f).stat().st_size for f in files) < 5 * 2**20, "the build context should stay small"
    for dep in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]:  # entrypoints are shipped
        assert dep["entrypoint"].split(":")[0] in files


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_each_dockerfile_is_consistent_with_context_and_pyproject(name, context):
    dockerfile = REPO_ROOT / "containers" / name
    assert dockerfile in dockerfiles()
    assert check_dockerfile(dockerfile, context[1]) == []
    instructions = parse_dockerfile(dockerfile.read_text())
    (base,) = [i.args for i in instructions if i.keyword == "FROM"]
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    (workdir,) = [i.args for i in instructions if i.keyword == "WORKDIR"]
    # prefect.yaml's pull step changes to $SPECPILOT_REPO: it must be where prefect.yaml and the package land.
    assert f"SPECPILOT_REPO={workdir}" in env
    copied = " ".join(i.args for i in instructions if i.keyword == "COPY")
    assert "prefect.yaml" in copied and "specpilot ./specpilot" in copied
    runs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    if name == "Dockerfile.gpu":
        assert base.startswith(("nvidia/cuda:", "pytorch/pytorch:")) and '".[gpu]"' in runs
    else:
        assert base.startswith("python:") and "download.pytorch.org/whl/cpu" in runs


def test_entry_point_is_pyprojects_console_script():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {"specpilot": "specpilot.cli:main"}
    module, function = scripts["specpilot"].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    for dockerfile in dockerfiles():
        cmd = [i.args for i in parse_dockerfile(dockerfile.read_text()) if i.keyword == "CMD"]
        assert cmd == ['["specpilot", "--help"]'], dockerfile.name


def test_checker_reports_every_kind_of_broken_reference(tmp_path, context):
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM python:latest AS base\nFROM ubuntu\nFROM base\nCOPY missing.txt .venv/lib/x.py ./\n"
                   "ADD https://example.invalid/x.tar.gz /x\nCOPY --from=base /etc/hosts /h\n"
                   "RUN pip install torch==1.0.0 '.[nope]' \\\n  && true\nCMD [\"not-a-script\"]\n")
    problems = "\n".join(check_dockerfile(bad, context[1]))
    for expected in ("Dockerfile.bad:1: FROM python:latest is not pinned", "Dockerfile.bad:2: FROM ubuntu is not pinned",
                     "source 'missing.txt' is not in the build context", "source '.venv/lib/x.py' is not in the build",
                     "remote sources are not allowed", "installs torch==1.0.0 but pyproject.toml pins torch==",
                     "installs extra 'nope'", "runs 'not-a-script', not a console script",
                     "no RUN after the install runs the 'specpilot' console script"):
        assert expected in problems
    assert "FROM base" not in problems and "/etc/hosts" not in problems  # stage references are fine


def test_docker_pool_option_is_valid_for_docker_py():
    from docker.models.containers import _create_container_args

    config = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    (deployment,) = [d for d in config["deployments"] if d["name"] == "tune-docker"]
    tune = next(d for d in config["deployments"] if d["name"] == "tune")
    assert deployment["entrypoint"] == tune["entrypoint"]
    pool = deployment["work_pool"]
    variables = pool["job_variables"]
    assert pool["name"] == "specpilot-docker" and variables["image"] == f"specpilot-gpu:{VERSION}"
    for doc in (REPO_ROOT / "containers" / "Dockerfile.gpu", REPO_ROOT / "containers" / "README.md"):
        assert f"-t specpilot-gpu:{VERSION} ." in doc.read_text(), doc  # the documented build makes that tag
    # The Docker worker passes volumes and container_create_kwargs to docker-py's containers.create.
    args = _create_container_args({"image": variables["image"], "version": "1.44", "volumes": variables["volumes"],
                                   **variables["container_create_kwargs"]})
    (gpus,) = args["host_config"]["DeviceRequests"]
    assert gpus["Driver"] == "nvidia" and gpus["Count"] == -1 and gpus["Capabilities"] == [["gpu"]]
    env = " ".join(i.args for i in parse_dockerfile((REPO_ROOT / "containers/Dockerfile.gpu").read_text())
                   if i.keyword == "ENV")
    mounted = {v.split(":")[1] for v in variables["volumes"]}
    assert mounted == {"/data/benchmarks", "/cache"}
    assert "SPECPILOT_BENCHMARKS=/data/benchmarks" in env and "SPECPILOT_CACHE=/cache" in env


def test_cli_checks_and_assembles(tmp_path):
    check = subprocess.run([sys.executable, "-m", "specpilot.containers", "check"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "containers/Dockerfile.cpu: OK" in check.stdout and "containers/Dockerfile.gpu: OK" in check.stdout
    made = subprocess.run([sys.executable, "-m", "specpilot.containers", "context", "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "specpilot/cli.py" in made.stdout.split()
    assert (tmp_path / "c" / "prefect.yaml").is_file()
