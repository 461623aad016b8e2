"""Models shared by the dev model server and the trainer: loading, weights files, teacher-forced logprobs.

Below serving and trainer: it imports torch/transformers, infra's local files and schemas' errors, so serving
and trainer can both depend on it without depending on each other.
"""

from agentstream.infra.files import local_path, sha256_file
from agentstream.models.loading import (
    SMOLLM2_NAME,
    LoadedModel,
    ModelLoadError,
    context_length,
    eos_token_ids,
    load_model,
    model_cache_root,
    model_display_name,
    smollm2_tokenizer,
    tiny_tokenizer,
)
from agentstream.models.logprobs import teacher_forced_logprobs
from agentstream.models.weights import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    FULL_WEIGHTS_FILE,
    WEIGHTS_FILES,
    NonFiniteWeights,
    WeightsError,
    assign_weights,
    check_finite,
    check_weights,
    read_weights,
    verify_finite,
    verify_sha256,
    write_safetensors,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "FULL_WEIGHTS_FILE",
    "SMOLLM2_NAME",
    "WEIGHTS_FILES",
    "LoadedModel",
    "ModelLoadError",
    "NonFiniteWeights",
    "WeightsError",
    "assign_weights",
    "check_finite",
    "check_weights",
    "context_length",
    "eos_token_ids",
    "load_model",
    "local_path",
    "model_cache_root",
    "model_display_name",
    "read_weights",
    "sha256_file",
    "smollm2_tokenizer",
    "teacher_forced_logprobs",
    "tiny_tokenizer",
    "verify_finite",
    "verify_sha256",
    "write_safetensors",
]
