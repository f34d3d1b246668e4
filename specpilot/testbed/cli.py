"""`specpilot testbed ...`: fetch, convert, derive, generate, pack and unpack testbed models.

`register_cli(subparsers)` adds the `testbed` command to the top-level parser; every leaf command sets
`func`, a callable taking the parsed arguments and returning an exit status. Also runnable on its own:
`python -m specpilot.testbed.cli testbed fetch smollm2-135m`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from specpilot.cliutil import guarded, run_standalone
from specpilot.engines.config import DType
from specpilot.engines.family import TargetFamily
from specpilot.testbed.derive import derive_truncated
from specpilot.testbed.fetch import FetchError, convert_gguf, fetch_smollm2
from specpilot.testbed.modeldir import ModelDirError, check_model_dir
from specpilot.testbed.pack import PackError, pack, unpack
from specpilot.testbed.registry import TestbedName, resolve_testbed
from specpilot.testbed.synthetic import ShapeName, make_random_model

_ERRORS = (FetchError, ModelDirError, PackError, ValueError, OSError)


_guarded = guarded("testbed", "testbed_command", _ERRORS)


def _fetch(args: argparse.Namespace) -> Path:
    name = TestbedName.parse(args.model)
    if args.gguf is not None:  # fetch the base from the local GGUF first; smollm2-135m is the only base
        fetch_smollm2(args.cache, gguf_path=args.gguf)
    return resolve_testbed(name, args.cache)


def _random(args: argparse.Namespace) -> Path:
    return make_random_model(ShapeName(args.shape), args.out, seed=args.seed, dtype=DType(args.dtype),
                             tokenizer_dir=args.tokenizer)


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `testbed` and its commands to a top-level parser's subparsers; return the `testbed` parser."""
    parser = subparsers.add_parser("testbed", help="testbed models: fetch, convert, derive, random, pack, unpack")
    sub = parser.add_subparsers(dest="testbed_command", required=True, metavar="COMMAND")
    dtypes = [d.value for d in DType]

    p = sub.add_parser("fetch", help="fetch a testbed model into the cache (smollm2-135m, or smollm2-135m-l<N>)")
    p.add_argument("model", help="testbed name, e.g. smollm2-135m or smollm2-135m-l6 (first 6 layers)")
    p.add_argument("--cache", type=Path, default=None, help="cache directory (default $SPECPILOT_CACHE or ~/.cache/specpilot)")
    p.add_argument("--gguf", type=Path, default=None, help="use this local GGUF instead of downloading (also $SPECPILOT_SMOLLM2_GGUF)")
    p.set_defaults(func=_guarded(_fetch))

    p = sub.add_parser("convert", help="convert a Llama-family GGUF file into a model directory")
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=dtypes, default=DType.BF16.value)
    p.set_defaults(func=_guarded(lambda a: convert_gguf(a.gguf, a.out, DType(a.dtype))))

    p = sub.add_parser("pack", help="split a directory into size-limited parts with a sha256 manifest")
    p.add_argument("dir", type=Path)
    p.add_argument("--part-mb", type=float, required=True, help="largest part in MiB")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_guarded(lambda a: pack(a.dir, a.out, a.part_mb)))

    p = sub.add_parser("unpack", help="reassemble a packed directory, verifying every part and file")
    p.add_argument("parts", type=Path, help="the parts directory or its manifest.json")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_guarded(lambda a: unpack(a.parts, a.out)))

    p = sub.add_parser("derive", help="write a draft model made of a model's first N decoder layers")
    p.add_argument("dir", type=Path)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_guarded(lambda a: derive_truncated(a.dir, a.out, a.layers)))

    p = sub.add_parser("random", help="write a random-weight model of a known shape")
    p.add_argument("--shape", choices=[s.value for s in ShapeName if s.family is TargetFamily.LLAMA], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=dtypes, default=DType.BF16.value)
    p.add_argument("--tokenizer", type=Path, default=None, help="copy the tokenizer of this model directory")
    p.set_defaults(func=_guarded(_random))

    p = sub.add_parser("check", help="check that a directory is a usable model directory")
    p.add_argument("dir", type=Path)
    p.add_argument("--no-tokenizer", action="store_true", help="do not require tokenizer files")
    p.set_defaults(func=_guarded(lambda a: check_model_dir(a.dir, require_tokenizer=not a.no_tokenizer)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone(register_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
