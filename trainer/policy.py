"""The model being trained: a Hugging Face causal LM (full or LoRA) on its device and dtype, with its optimizer.

Weights are saved the way model servers load them: the full state dict as ``model.safetensors``
(``/v1/load_weights``, in ``trainer.checkpoint_dtype``), or a peft adapter folder
(``/v1/load_lora_adapter``). The optimizer state is saved beside them so a restarted trainer
continues exactly where it stopped.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentstream.infra.config import TrainerConfig
from agentstream.models import (
    ADAPTER_WEIGHTS_FILE,
    FULL_WEIGHTS_FILE,
    WeightsError,
    assign_weights,
    check_finite,
    check_weights,
    load_model,
    read_weights,
    write_safetensors,
)
from agentstream.models.precision import Precision, PrecisionError, resolve_precision
from agentstream.schemas.errors import AgentstreamError

OPTIMIZER_STATE = "optimizer.pt"

log = logging.getLogger(__name__)


class PolicyError(AgentstreamError, RuntimeError):
    """The policy cannot be built as configured, or a checkpoint does not fit it."""


@dataclass
class Policy:
    """The trained model, its tokenizer and optimizer, and the frozen reference used by the KL term (if any)."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    lora: bool
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None
    precision: Precision
    """Where the forward pass runs and in which dtype; weights and optimizer state stay ``dtype``."""
    checkpoint_dtype: torch.dtype
    """The dtype full weights are written in (``trainer.checkpoint_dtype``)."""

    @property
    def format(self) -> str:
        return "lora" if self.lora else "full"

    @property
    def weights_file(self) -> str:
        return ADAPTER_WEIGHTS_FILE if self.lora else FULL_WEIGHTS_FILE

    @property
    def pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return 0

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def training_attention(setting: str, device: torch.device) -> str:
    """The trained model's attention kernel (``trainer.attention``): ``auto`` is eager on the CPU, sdpa elsewhere."""
    if setting != "auto":
        return setting
    return "eager" if device.type == "cpu" else "sdpa"


def build_policy(config: TrainerConfig) -> Policy:
    """Load the model spec, move it to the configured device and dtype, wrap it in LoRA if asked, add the optimizer."""
    torch.manual_seed(config.seed)
    try:
        precision = resolve_precision(config.device, config.dtype, config.weights_dtype)
    except PrecisionError as error:
        raise PolicyError(f"trainer: {error}") from None
    loaded = load_model(config.model, precision=precision, threads=config.threads or None)
    model = loaded.model
    device, dtype = precision.device, precision.weights_dtype
    pretrained: Any = model  # a transformers PreTrainedModel (torch types a Module's attributes as Tensor)
    pretrained.set_attn_implementation(training_attention(config.attention, device))
    reference = None
    if config.lora:
        from peft import LoraConfig, get_peft_model

        targets = [name.strip() for name in config.lora_target_modules.split(",") if name.strip()]
        model = get_peft_model(model, LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                                 target_modules=targets, bias="none"))
    if config.kl_coef > 0 and (config.reference_model or not config.lora):  # LoRA's reference is its base model
        reference = load_model(config.reference_model or config.model, precision=precision, threads=None).model
        reference.requires_grad_(False).eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(config.beta1, config.beta2),
                                  weight_decay=config.weight_decay, fused=True)  # 0.3 s of a SmolLM2 CPU step
    checkpoint_dtype = dtype if config.checkpoint_dtype == "auto" else getattr(torch, config.checkpoint_dtype)
    return Policy(model, loaded.tokenizer, config.model_name or loaded.name, device, dtype, config.lora, optimizer,
                  reference, precision, checkpoint_dtype)


def save_weights(policy: Policy, folder: Path, optimizer_state: bool = True) -> Path:
    """Write the weights (or the adapter), and the optimizer state if asked, to ``folder``; returns the weights file."""
    return save_weights_later(policy, folder, optimizer_state)()[0]


Written = tuple[Path, str | None]
"""A written checkpoint's weights file and its sha256 (None: not computed on the way, hash the file)."""


def save_weights_later(policy: Policy, folder: Path, optimizer_state: bool = True) -> Callable[[], Written]:
    """``save_weights`` in two halves: copy the weights now (on the model's thread), write them when called.

    The copy, in ``policy.checkpoint_dtype``, is what the next optimizer step cannot change, so
    the write (0.5 GB for SmolLM2 in float32) can run on another thread beside that step; it
    hashes the bytes as it writes them. One tensor per storage is kept, as ``save_model`` does
    for a tied head. A LoRA adapter is small: it is written now.

    Raises ``models.NonFiniteWeights`` before anything is written when a weight to be saved
    (after the cast to the checkpoint dtype, where rounding may overflow) is NaN or infinite.
    """
    if policy.lora:
        from peft import get_peft_model_state_dict

        peft_model: Any = policy.model  # a PeftModel (torch types module attributes as Tensor | Module)
        check_finite(get_peft_model_state_dict(peft_model), f"{policy.name}'s LoRA adapter")
        peft_model.save_pretrained(folder, safe_serialization=True)
        if optimizer_state:
            torch.save(policy.optimizer.state_dict(), folder / OPTIMIZER_STATE)
        return lambda: (folder / ADAPTER_WEIGHTS_FILE, None)
    by_storage: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in policy.model.state_dict().items():  # the last name of a tied pair stays
        by_storage[tensor.data_ptr()] = (name, tensor.detach().to("cpu", policy.checkpoint_dtype, copy=True))
    tensors = dict(by_storage.values())
    check_finite(tensors, f"{policy.name}'s weights in {policy.checkpoint_dtype}")
    optimizer = copy.deepcopy(policy.optimizer.state_dict()) if optimizer_state else None

    def write() -> Written:
        sha256 = write_safetensors(tensors, folder / FULL_WEIGHTS_FILE)
        if optimizer is not None:
            torch.save(optimizer, folder / OPTIMIZER_STATE)
        return folder / FULL_WEIGHTS_FILE, sha256

    return write


def load_weights(policy: Policy, folder: Path) -> None:
    """Restore weights (or the adapter) and, when present, the optimizer state from a checkpoint folder."""
    from safetensors.torch import load_file

    try:
        if policy.lora:
            from peft import set_peft_model_state_dict

            state = load_file(folder / ADAPTER_WEIGHTS_FILE, device=str(policy.device))
            check_finite(state, str(folder / ADAPTER_WEIGHTS_FILE))
            result = set_peft_model_state_dict(policy.model, state)
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise PolicyError(f"adapter in {folder} has keys this model lacks: {unexpected[:3]}")
        else:
            state = read_weights(folder)
            check_weights(policy.model, state)
            width = torch.empty((), dtype=policy.dtype).element_size()
            narrower = sorted({str(t.dtype) for t in state.values() if t.element_size() < width})
            if narrower:
                log.warning("checkpoint %s holds %s weights: training resumes from them rounded, not from the "
                            "%s weights it trained (trainer.checkpoint_dtype)", folder, ", ".join(narrower),
                            policy.dtype)
            assign_weights(policy.model, state)
    except (WeightsError, FileNotFoundError) as error:
        raise PolicyError(f"checkpoint {folder} does not fit the policy: {error}") from None
    optimizer_file = folder / OPTIMIZER_STATE
    if optimizer_file.is_file():
        policy.optimizer.load_state_dict(torch.load(optimizer_file, map_location=policy.device, weights_only=True))


def forget_momentum(folder: Path) -> int:
    """Zero the first moment (``exp_avg``) of the AdamW state saved in ``folder``; returns how many tensors.

    The second moment and the step count stay, so the next steps keep each weight's scale; only the direction
    the saved run was moving in goes. With weight decay 0, that direction alone moved a saved warm start's
    weights for several steps and gained as much as RL or supervised steps did (docs/multistep.md), so a run
    that measures what its own gradient adds starts without it.
    """
    path = folder / OPTIMIZER_STATE
    if not path.is_file():
        raise PolicyError(f"{folder} holds no optimizer state ({OPTIMIZER_STATE}): no momentum to forget")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    moments = [state["exp_avg"] for state in saved["state"].values() if "exp_avg" in state]
    if not moments:
        raise PolicyError(f"{path} holds no AdamW first moment (exp_avg)")
    for moment in moments:
        moment.zero_()
    torch.save(saved, path)
    return len(moments)


def restore_last_good(policy: Policy, folder: Path) -> None:
    """Go back to a checkpoint's weights after a bad turn; AdamW's moments too, or afresh where it has none."""
    if not (folder / OPTIMIZER_STATE).is_file():
        policy.optimizer.state.clear()  # the moments that led to the bad weights are not kept
    load_weights(policy, folder)
