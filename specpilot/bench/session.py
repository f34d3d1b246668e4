"""A deployment made runnable: models loaded once, engines built per EngineConfig, prompts tokenized."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.deployments import Deployment, DeviceKind, ModelRefKind, resolve_model
from specpilot.engines.build import build_engine
from specpilot.engines.config import DrafterKind, EngineConfig
from specpilot.engines.engine import SpecEngine
from specpilot.engines.llama import LlamaModel
from specpilot.engines.policy import STOCK, EnginePolicy
from specpilot.engines.loader import check_same_tokenizer, eos_ids, load_model, load_tokenizer
from specpilot.engines.targets import load_target, random_target
from specpilot.testbed.synthetic import ShapeName
from specpilot.workload import Prompt, apply_chat_template


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt: Prompt
    ids: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.prompt.key


class DeploymentSession:
    def __init__(self, deployment: Deployment, cache: str | None = None, device: str | None = None):
        self.deployment = deployment
        if device is None:
            device = "cuda" if deployment.device.kind is DeviceKind.CUDA else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"deployment {deployment.name} needs a CUDA device and none is available here")
        self.device = device
        self.cache = cache
        dtype = deployment.engine.dtype.torch
        ref = deployment.target
        if ref.kind is ModelRefKind.RANDOM:
            # Random weights: kernels and cost only; a fixed synthetic tokenizer is not needed (ids are ints).
            self.target_dir = None
            self.target = random_target(ShapeName(ref.value).shape, dtype, device, seed=ref.seed or 0)
            self.tokenizer = None
            self.eos: frozenset[int] = frozenset()
        else:
            self.target_dir = resolve_model(ref, cache)
            self.target = load_target(self.target_dir, dtype, device)  # either family (config.json's model_type)
            self.tokenizer = load_tokenizer(self.target_dir)
            self.eos = eos_ids(self.target_dir, self.tokenizer)
        self._draft_models: dict[str, object] = {}  # draft models and block drafters by label
        self._engines: dict[tuple[str, str, int], SpecEngine] = {}
        self._policies: list[EnginePolicy] = []  # keeps policy objects alive so their ids stay unique

    def _spec(self, label: str | None, kind: DrafterKind):
        """The deployment's drafter of this kind: the one labelled `label`, else the first of that kind."""
        specs = [d for d in self.deployment.drafters if d.kind is kind]
        return next((d for d in specs if d.label == label), specs[0] if specs else None)

    def draft_model(self, label: str | None) -> LlamaModel | None:
        spec = self._spec(label, DrafterKind.DRAFT_MODEL)
        if spec is None:
            return None
        if spec.label not in self._draft_models:
            path = resolve_model(spec.model, self.cache)
            if self.tokenizer is not None:
                check_same_tokenizer(self.tokenizer, load_tokenizer(path), spec.label)
            self._draft_models[spec.label] = load_model(path, self.deployment.engine.dtype.torch, self.device)
        return self._draft_models[spec.label]

    def block_drafter(self, label: str | None):
        """A block drafter checkpoint (ours or DFlash layout) for this target, or None if none is deployed."""
        from specpilot.drafting.checkpoint import load_drafter
        spec = self._spec(label, DrafterKind.BLOCK)
        if spec is None:
            return None
        if spec.label not in self._draft_models:
            # A drafter checkpoint is no standalone model directory (no tokenizer): take a path as it is.
            path = spec.model.value if spec.model.kind is ModelRefKind.PATH else resolve_model(spec.model, self.cache)
            self._draft_models[spec.label] = load_drafter(path, self.target)
        return self._draft_models[spec.label]

    def engine(self, cfg: EngineConfig, drafter_label: str | None = None, policy: EnginePolicy = STOCK) -> SpecEngine:
        """Engines are cached per (config, drafter, policy instance); models are shared between them."""
        key = (cfg.digest(), drafter_label or "", id(policy))
        if key not in self._engines:
            dm = self.draft_model(drafter_label) if cfg.drafter is DrafterKind.DRAFT_MODEL else None
            bd = self.block_drafter(drafter_label) if cfg.drafter is DrafterKind.BLOCK else None
            self._policies.append(policy)
            self._engines[key] = build_engine(cfg, self.target, self.eos, self.device, draft_model=dm, policy=policy,
                                              block_drafter=bd)
        return self._engines[key]

    def release(self, cfg: EngineConfig, drafter_label: str | None = None, policy: EnginePolicy = STOCK) -> None:
        """Drop a cached engine (its KV cache, graphs and any transformed weights) once it is no longer needed."""
        self._engines.pop((cfg.digest(), drafter_label or "", id(policy)), None)

    def tokenize(self, prompts: list[Prompt] | tuple[Prompt, ...]) -> list[TokenizedPrompt]:
        if self.tokenizer is None:  # random-weight targets: deterministic synthetic prompt ids
            g = torch.Generator().manual_seed(0)
            return [TokenizedPrompt(p, tuple(torch.randint(3, self.target.shape.vocab, (64,), generator=g).tolist()))
                    for p in prompts]
        return [TokenizedPrompt(p, tuple(apply_chat_template(self.tokenizer, p.text))) for p in prompts]
