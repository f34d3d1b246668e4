"""Docker build contexts and Dockerfile checks for containers/ (no Docker engine needed).

The images are built from the repository root (`docker build -f containers/Dockerfile.gpu .`), so what reaches
the daemon is the root minus `.dockerignore`. This module applies `.dockerignore` with Docker's rules (patterns
relative to the root, `*` and `?` within one path segment, `**` across segments, `!` re-includes, the last
matching pattern wins, a pattern matching a directory covers everything under it), assembles the context,
and checks each Dockerfile against it: every COPY/ADD source is in the context, every FROM is pinned, the
console scripts the image runs are the ones pyproject.toml declares, and installed extras exist.

    python -m specpilot.containers context --out DIR   # copy the build context to DIR, list what it holds
    python -m specpilot.containers check               # check every containers/Dockerfile.*; exit 1 on problems
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class IgnorePattern:
    text: str  # as cleaned: no leading '!' or '/'
    exclusion: bool  # True for '!pattern' (re-include)
    regex: re.Pattern[str]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1:end]
            out, i = out + "[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


@dataclass(frozen=True)
class DockerIgnore:
    patterns: tuple[IgnorePattern, ...]

    @classmethod
    def parse(cls, text: str) -> "DockerIgnore":
        patterns = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            cleaned = posixpath.normpath(line[1:].strip() if exclusion else line).lstrip("/")
            patterns.append(IgnorePattern(cleaned, exclusion, _pattern_regex(cleaned)))
        return cls(tuple(patterns))

    @classmethod
    def load(cls, root: Path) -> "DockerIgnore":
        path = Path(root) / ".dockerignore"
        return cls.parse(path.read_text()) if path.is_file() else cls(())

    def excludes(self, rel_path: str) -> bool:
        """Whether `rel_path` (posix, relative to the context root) stays out of the context."""
        parts = rel_path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        excluded = False
        for p in self.patterns:
            if any(p.regex.match(prefix) for prefix in prefixes):
                excluded = not p.exclusion
        return excluded

    def may_include_under(self, rel_dir: str) -> bool:
        """Whether some '!' pattern could re-include a path under excluded directory `rel_dir` (else the walk
        can skip it, as Docker does, instead of visiting e.g. every file of a virtual environment)."""
        dir_parts = rel_dir.split("/")
        for p in self.patterns:
            if not p.exclusion:
                continue
            segments = p.text.split("/")
            for i, d in enumerate(dir_parts):
                if i >= len(segments) or segments[i] == "**":
                    return True  # the pattern names an ancestor of rel_dir, or any depth
                if not fnmatch.fnmatchcase(d, segments[i]):
                    break
            else:
                return True
        return False


def context_files(root: Path = REPO_ROOT) -> list[str]:
    """Every file (posix path relative to `root`) that a `docker build` of `root` sends to the daemon."""
    root, ignore = Path(root), DockerIgnore.load(Path(root))
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for d in sorted(dirnames):
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if not (ignore.excludes(rel) and not ignore.may_include_under(rel)):
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f if rel_dir == "." else f"{rel_dir}/{f}"
            if not ignore.excludes(rel):
                found.append(rel)
    return sorted(found)


def assemble_context(out_dir: Path, root: Path = REPO_ROOT) -> list[str]:
    """Copy the build context of `root` to `out_dir` (which must not exist yet); returns its files."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; the context goes into a new directory")
    files = context_files(root)
    for rel in files:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(root) / rel, out_dir / rel)
    return files


@dataclass(frozen=True)
class Instruction:
    line: int  # where it starts in the Dockerfile
    keyword: str  # upper case: FROM, COPY, RUN, ...
    args: str  # the rest, continuation lines joined


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with backslash continuations joined; comments and blank lines dropped."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
        pending = ""
    if pending:
        raise ValueError(f"Dockerfile ends inside a continued instruction (line {start})")
    return out


def _words(args: str) -> list[str]:
    """Exec form (JSON array) or shell form, as a list of words."""
    if args.startswith("["):
        return json.loads(args)
    return shlex.split(args)


_PINNED_TAG = re.compile(r"\d+\.\d+")  # an explicit version such as 3.11.11-slim or 12.8.1-runtime-ubuntu24.04


def check_dockerfile(dockerfile: Path, files: list[str], pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """Problems of `dockerfile` against a context holding `files`; empty when it is consistent."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    scripts, extras = set(project.get("scripts", {})), set(project.get("optional-dependencies", {}))
    pins = {m.group(1).lower(): m.group(2) for dep in project["dependencies"]
            if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", dep.strip()))}
    name, problems, stages = Path(dockerfile).name, [], set()
    instructions = parse_dockerfile(Path(dockerfile).read_text())
    runs = [i for i in instructions if i.keyword == "RUN"]
    for ins in instructions:
        where = f"{name}:{ins.line}"
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = words[0]
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2].lower())
            if image.lower() in stages or "@sha256:" in image:
                continue
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            if "$" in image or not tag or tag == "latest" or not _PINNED_TAG.search(tag):
                problems.append(f"{where}: FROM {image} is not pinned (use an explicit version tag or @sha256 digest)")
        elif ins.keyword in ("COPY", "ADD"):
            words = _words(ins.args)
            flags = [w for w in words if w.startswith("--")]
            if any(f.startswith("--from=") for f in flags):
                continue  # copies from another stage or image, not from the context
            for src in [w for w in words if not w.startswith("--")][:-1]:
                if re.match(r"^[a-z]+://", src):
                    problems.append(f"{where}: {ins.keyword} {src}: remote sources are not allowed (unverified download)")
                    continue
                pattern = posixpath.normpath(src).lstrip("/")
                hit = pattern == "." or any(fnmatch.fnmatchcase(f, pattern) or f.startswith(pattern + "/")
                                            for f in files)
                if not hit:
                    problems.append(f"{where}: {ins.keyword} source {src!r} is not in the build context "
                                    "(missing, or excluded by .dockerignore)")
        elif ins.keyword in ("CMD", "ENTRYPOINT"):
            words = _words(ins.args)
            if words and words[0] not in scripts:
                problems.append(f"{where}: {ins.keyword} runs {words[0]!r}, not a console script of pyproject.toml "
                                f"({sorted(scripts)})")
        elif ins.keyword == "RUN":
            for extra in re.findall(r"\.\[([A-Za-z0-9_,-]+)\]", ins.args):
                for e in extra.split(","):
                    if e not in extras:
                        problems.append(f"{where}: installs extra {e!r}, which pyproject.toml does not define")
            for package, version in re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][^\s\"']*)", ins.args):
                if package.lower() in pins and pins[package.lower()] != version:
                    problems.append(f"{where}: installs {package}=={version} but pyproject.toml pins "
                                    f"{package}=={pins[package.lower()]}")
    installs = [i for i in runs if re.search(r"pip install[^&;]*\s[\"']?\.(\[|[\"'\s])", i.args + " ")]
    if not installs:
        problems.append(f"{name}: no RUN installs the project (pip install . or .[extra])")
    for script in sorted(scripts):  # the image proves its entry point works at build time
        if not any(re.search(rf"(^|[\s;&|]){re.escape(script)}(\s|$)", i.args) for i in runs
                   if installs and i.line >= installs[0].line):
            problems.append(f"{name}: no RUN after the install runs the {script!r} console script")
    return problems


def dockerfiles(root: Path = REPO_ROOT) -> list[Path]:
    return sorted((Path(root) / "containers").glob("Dockerfile.*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specpilot.containers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ctx = sub.add_parser("context", help="copy the Docker build context (repo root minus .dockerignore) to --out")
    ctx.add_argument("--out", required=True, type=Path)
    sub.add_parser("check", help="check every containers/Dockerfile.* against the build context")
    args = parser.parse_args(argv)
    if args.command == "context":
        files = assemble_context(args.out)
        print("\n".join(files))
        print(f"{len(files)} files in {args.out}", file=sys.stderr)
        return 0
    files, failed = context_files(), False
    for dockerfile in dockerfiles():
        problems = check_dockerfile(dockerfile, files)
        failed |= bool(problems)
        print(f"{dockerfile.relative_to(REPO_ROOT)}: " + ("OK" if not problems else "\n  " + "\n  ".join(problems)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
