"""Where and at what precision a model runs: one rule for the trainer and the model server, so their logprobs agree.

The standard mixed-precision recipe: weights (and the trainer's optimizer state) stay float32,
the forward pass runs under ``torch.autocast`` in bfloat16 where that is the compute dtype.
``auto`` means bfloat16 compute on a CUDA device that supports it and float32 elsewhere, so a
trainer and a server resolved from the same settings on the same machine compute the same
numbers for the same tokens. float32 means float32 on CUDA too (TF32 off): TF32 rounds matmul
inputs to a 10-bit mantissa and moved the first-step ratio to 2.4e-3 (tiny) and 2.7e-2
(SmolLM2) on an H100, over the 1e-3 bound. Pure bfloat16 weights (no float32 master copy)
are only used when asked for explicitly: AdamW's small updates fall below bfloat16's
resolution and are lost.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentstream.schemas.errors import AgentstreamError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("agentstream.models")

DEVICES_HELP = "auto (CUDA when present), cpu, cuda or cuda:N"
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
INITIAL_RATIO_BOUND = {"float32": 1e-3, "bfloat16": 0.25}
"""The largest |log ratio| a first step may show between the server's sampled logprobs and the trainer's
recomputation of the same tokens with the same weights, by compute dtype. In float32 the two differ only in the
summation order of batched, padded, KV-cached matmuls against one full forward (measured 5e-6 on the tiny model,
2e-5 on SmolLM2-135M). Under bfloat16 autocast both sides round activations to bfloat16 in a different order
(measured on the CPU: 0.03 on the tiny model, 0.17 on SmolLM2-135M over 96 sampled tokens, most tokens far
below). Mixing precisions is what this module exists to avoid: an fp32 server against a bf16 trainer gave 0.24."""
WEIGHTS_DTYPES = ("float32", "bfloat16")


class PrecisionError(AgentstreamError, ValueError):
    """A device or dtype setting that cannot be used on this machine."""


@dataclass(frozen=True)
class Precision:
    """A resolved device, the dtype the forward pass computes in, and the dtype the weights are stored in."""

    device: torch.device
    compute_dtype: torch.dtype
    weights_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """Whether the forward pass autocasts float32 weights to a lower compute dtype."""
        return self.compute_dtype != self.weights_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for a forward pass (a no-op when compute and weights dtypes are the same)."""
        import torch

        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def describe(self) -> str:
        """``cpu float32`` or ``cuda bfloat16 autocast over float32 weights``, for start-up lines."""
        compute, weights = (str(dtype).removeprefix("torch.") for dtype in (self.compute_dtype, self.weights_dtype))
        return f"{self.device} {compute}" + (f" autocast over {weights} weights" if self.mixed else "")


def resolve_device(spec: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without CUDA is an error, not a silent CPU run."""
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise PrecisionError(f"device {spec!r} asked for, but CUDA is not available on this machine")
    try:
        return torch.device(spec)
    except RuntimeError as error:
        raise PrecisionError(f"device {spec!r}: {error} (use {DEVICES_HELP})") from None


def resolve_precision(device: str = "auto", dtype: str = "auto", weights_dtype: str = "float32") -> Precision:
    """The precision for device/dtype settings (see the module docstring for what ``auto`` picks)."""
    import torch

    if dtype not in COMPUTE_DTYPES:
        raise PrecisionError(f"dtype {dtype!r}: use one of {', '.join(COMPUTE_DTYPES)}")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise PrecisionError(f"weights dtype {weights_dtype!r}: use one of {', '.join(WEIGHTS_DTYPES)}")
    resolved = resolve_device(device)
    if dtype == "auto":
        bf16 = resolved.type == "cuda" and torch.cuda.is_bf16_supported()
        compute = torch.bfloat16 if bf16 else torch.float32
    else:
        compute = getattr(torch, dtype)
    weights = getattr(torch, weights_dtype)
    if weights == torch.bfloat16:
        log.warning("pure bfloat16 weights: optimizer updates smaller than bfloat16's resolution are lost "
                    "(the default keeps float32 weights and computes in %s)", dtype)
        compute = torch.bfloat16
    return Precision(resolved, compute, weights)


def native_bfloat16(device: str = "auto") -> bool:
    """Whether the device multiplies bfloat16 natively: CUDA with bfloat16 support, or a CPU with AMX tiles.

    On such a CPU a bfloat16 matmul ran 6x faster than float32 (one thread, 512x576 by 576x1536);
    without AMX, bfloat16 autocast made the trainer 8x slower.
    """
    import torch

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def configure_backends(precision: Precision, threads: int | None) -> None:
    """Exact float32 matmuls on CUDA (no TF32); the CPU thread count only where the model runs on the CPU."""
    import torch

    if precision.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif threads:
        torch.set_num_threads(threads)


def cast_linears_for_inference(model: torch.nn.Module, precision: Precision) -> None:
    """Store each Linear weight of a model that only infers in the compute dtype, where autocast lowers it.

    Autocast casts float32 Linear weights to the compute dtype at every forward, that is at every
    decoded token; casting them once gives the same numbers (autocast rounds the same way) and
    made SmolLM2's generation on one CPU thread 1.6x faster. Embeddings and norms stay float32,
    as under autocast. A head tied to the input embeddings gets its own copy, which
    ``agentstream.models.weights.assign_weights`` refreshes from the embeddings.
    """
    import torch

    if not precision.mixed:
        return
    hf: Any = model  # a transformers model (torch types its attributes as Tensor | Module)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    embeddings = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    with torch.no_grad():
        if head is not None and embeddings is not None and head.weight is embeddings.weight:
            head.weight = torch.nn.Parameter(embeddings.weight.detach().to(precision.compute_dtype),
                                             requires_grad=False)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.to(precision.compute_dtype)
