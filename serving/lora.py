"""Serve peft LoRA adapters without wrapping the base model: each batch swaps in its adapter's merged weights.

Keeping the base model's own weights untouched lets several adapters share it, lets full-weight
swaps (``load_weights``) happen under them, and makes "no adapter" free. Supported: peft LoRA on
``nn.Linear`` modules saved as ``adapter_model.safetensors`` (plain or rsLoRA scaling,
``alpha_pattern``). Refused with a clear error: DoRA, bias training, ``modules_to_save``,
embedding LoRA, ``fan_in_fan_out``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from agentstream.models import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, NonFiniteWeights, check_finite
from agentstream.schemas.errors import AgentstreamError

KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class LoraError(AgentstreamError):
    """A LoRA adapter folder cannot be served on this model."""


class LoraNotFound(LoraError):
    """The adapter folder or its files do not exist."""


@dataclass(frozen=True)
class LoraLayer:
    """The low-rank update of one linear module: output += scale * (x A^T) B^T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its name, where it came from, the policy version it carries, and its layers."""

    name: str
    path: str
    version: int
    layers: dict[str, LoraLayer]


def load_lora(path: Path, model: torch.nn.Module, name: str, version: int) -> LoraAdapter:
    """Read a peft LoRA folder and check it against the model's modules."""
    from safetensors.torch import load_file

    if not (path / ADAPTER_CONFIG_FILE).is_file() or not (path / ADAPTER_WEIGHTS_FILE).is_file():
        raise LoraNotFound(f"No adapter found for {path} (need {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE})")
    config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    _check_supported(config)
    tensors = load_file(path / ADAPTER_WEIGHTS_FILE)
    try:
        check_finite(tensors, str(path / ADAPTER_WEIGHTS_FILE))  # a NaN adapter would make every answer garbage
    except NonFiniteWeights as error:
        raise LoraError(str(error)) from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            raise LoraError(f"unsupported tensor {key!r} in {path / ADAPTER_WEIGHTS_FILE} "
                            "(only LoRA A/B of linear layers)")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor.to(torch.float32)
    modules = dict(model.named_modules())
    layers = {}
    for module_name, pair in pairs.items():
        layers[module_name] = _layer(module_name, pair, modules.get(module_name), config)
    if not layers:
        raise LoraError(f"{path / ADAPTER_WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path), version=version, layers=layers)


def _check_supported(config: dict) -> None:
    """Refuse adapter features this runtime does not implement."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise LoraError(f"LoRA adapters with {flag}=true are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError("LoRA adapters that train biases are not supported")
    if config.get("modules_to_save"):
        raise LoraError("LoRA adapters with modules_to_save are not supported")


def _layer(module_name: str, pair: dict[str, torch.Tensor], module: torch.nn.Module | None,
           config: dict) -> LoraLayer:
    """One module's update, validated against the base module's shape."""
    if set(pair) != {"A", "B"}:
        raise LoraError(f"{module_name}: needs both lora_A and lora_B weights")
    if not isinstance(module, torch.nn.Linear):
        raise LoraError(f"{module_name}: the base model has no linear module of that name")
    a, b = pair["A"], pair["B"]
    rank = a.shape[0]
    if a.shape != (rank, module.in_features) or b.shape != (module.out_features, rank):
        raise LoraError(f"{module_name}: LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit "
                        f"Linear({module.in_features}, {module.out_features})")
    alpha = _pattern_value(module_name, config.get("alpha_pattern") or {}, config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    device, dtype = module.weight.device, module.weight.dtype  # where and how the base layer lives
    return LoraLayer(a=a.to(device=device, dtype=dtype), b=b.to(device=device, dtype=dtype), scale=float(scale))


def _pattern_value(module_name: str, patterns: dict[str, float], default: float) -> float:
    """peft's per-module override: a pattern matches the module's full name or a dotted suffix of it."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
            return value
    return default


class MergedWeights:
    """The merged weights (W + scale * B A) adapters run on: one per adapted module, shared by every adapter.

    A server holds many adapters but runs one batch, on one adapter, at a time, so it keeps one
    merged weight per module and makes it again when a batch on another adapter (or on new base
    weights) comes: memory for one adapter's merge however many are loaded, and a merge per
    switch of adapter, not per token. Forward hooks adding the low-rank update at every token made
    SmolLM2's decode steps 1.6x slower on a CPU thread; a merge per adapter kept for good cost a
    copy of every adapted weight per adapter (``bench/adapters.py`` measures both).
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[LoraAdapter, tuple[int, int], torch.Tensor]] = {}
        self.merges = 0  # modules merged so far (a switch of adapter merges every adapted module)

    @property
    def nbytes(self) -> int:
        """The memory the merged weights take (one copy of each module any adapter adapts)."""
        return sum(buffer.nbytes for _, _, buffer in self._held.values())

    def weight(self, name: str, adapter: LoraAdapter, base: torch.Tensor) -> torch.Tensor:
        """Module ``name``'s weight under ``adapter``, merged now unless it already holds exactly that."""
        made_from = (id(base), base._version)
        held = self._held.get(name)
        if held is not None and held[0] is adapter and held[1] == made_from:
            return held[2]
        layer = adapter.layers[name]
        reusable = held is not None and held[2].shape == base.shape and held[2].dtype == base.dtype
        buffer = held[2] if held is not None and reusable else torch.empty_like(base)
        with torch.no_grad():
            if base.dtype == torch.float32:  # in place, so never a second copy of the weight
                torch.matmul(layer.b, layer.a, out=buffer)
                buffer.mul_(layer.scale).add_(base)
            else:
                buffer.copy_(base.float() + layer.scale * (layer.b.float() @ layer.a.float()))
        self._held[name] = (adapter, made_from, buffer)
        self.merges += 1
        return buffer


@contextmanager
def applied(adapter: LoraAdapter | None, model: torch.nn.Module,
            merged: MergedWeights | None = None) -> Iterator[None]:
    """Run the model with the adapter's merged weights in place of its modules' own (None: as is).

    ``merged`` keeps them between calls (a server passes its one :class:`MergedWeights`); without
    it they are made for this call alone. A full-weight load changes the base weights in place
    (their version), and the next call merges again.
    """
    if adapter is None:
        yield
        return
    merged = merged if merged is not None else MergedWeights()
    modules = dict(model.named_modules())
    originals: dict[str, torch.nn.Parameter] = {}
    try:
        for name in adapter.layers:
            module = modules[name]
            originals[name] = module.weight
            module.weight = torch.nn.Parameter(merged.weight(name, adapter, module.weight), requires_grad=False)
        yield
    finally:
        for name, base in originals.items():
            modules[name].weight = base
