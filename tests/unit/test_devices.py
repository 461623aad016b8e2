"""The GPU path, on every device this machine has: CPU always, CUDA when present (``make gpu-check`` requires it).

Generation, the server contract, teacher-forced logprobs, LoRA serving and the trainer step run
on the model's device at the configured precision, and trainer and server agree on the logprobs
of the same tokens (the importance ratio starts at 1 within the documented bound).
"""

from __future__ import annotations

import logging
import os

import openai
import pytest
import torch

from agentstream.gpu_check import initial_ratio_max_abs_dev
from agentstream.infra.config import TrainerConfig
from agentstream.models import assign_weights, check_weights, load_model, teacher_forced_logprobs
from agentstream.models.precision import (
    INITIAL_RATIO_BOUND,
    PrecisionError,
    cast_linears_for_inference,
    resolve_precision,
)
from agentstream.serving.app import create_app
from agentstream.serving.generation import BatchRequest, SamplingParams, generate_batch
from agentstream.serving.lora import applied, load_lora
from agentstream.trainer.batching import Batch, Counts, Sample
from agentstream.trainer.policy import build_policy
from agentstream.trainer.step import train_step
from tests.support.http_thread import ServerThread
from tests.support.servers import make_lora

CUDA = torch.cuda.is_available()
if os.environ.get("AGENTSTREAM_REQUIRE_CUDA") and not CUDA:
    raise RuntimeError("AGENTSTREAM_REQUIRE_CUDA is set (make gpu-check) but torch sees no CUDA device")
DEVICES = ["cpu", *(["cuda"] if CUDA else [])]
DTYPES = ["float32", "bfloat16"]
PROMPT = [5, 6, 7, 8, 9, 10]


def test_auto_is_float32_on_the_cpu_and_refuses_cuda_it_does_not_have():
    auto = resolve_precision("cpu", "auto")
    assert auto.compute_dtype == auto.weights_dtype == torch.float32 and not auto.mixed
    mixed = resolve_precision("cpu", "bfloat16")
    assert mixed.mixed and mixed.weights_dtype == torch.float32 and mixed.compute_dtype == torch.bfloat16
    if not CUDA:
        with pytest.raises(PrecisionError, match="CUDA is not available"):
            resolve_precision("cuda", "auto")
    with pytest.raises(PrecisionError):
        resolve_precision("cpu", "float16")


def test_pure_bfloat16_weights_are_explicit_and_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="agentstream.models"):
        pure = resolve_precision("cpu", "auto", weights_dtype="bfloat16")
    assert pure.weights_dtype == torch.bfloat16 and not pure.mixed
    assert "updates smaller than bfloat16's resolution are lost" in caplog.text


def changed_fraction(config: TrainerConfig) -> float:
    """Share of trainable weight elements one optimizer step changes, at lr 1e-5 (the default).

    The input embedding is left out: the rows of tokens absent from the batch get no gradient,
    so AdamW leaves them as they are at any precision.
    """
    policy = build_policy(config)
    embedding = policy.model.get_input_embeddings().weight
    weights = [parameter for parameter in policy.trainable() if parameter is not embedding]
    before = [parameter.detach().clone() for parameter in weights]
    samples = [Sample(f"s{i}", "r", 0, PROMPT, [40 + i, 41, 42], [-3.0, -3.0, -3.0], 1.0, 1.0 if i % 2 else -1.0)
               for i in range(4)]
    train_step(policy, Batch(samples, 0, Counts()), config)
    changed = sum(int((old != new.detach()).sum()) for old, new in zip(before, weights, strict=True))
    return changed / sum(old.numel() for old in before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_default_mixed_precision_step_changes_almost_every_weight(device):
    """fp32 master weights keep AdamW's small updates; pure bf16 weights round most of them away."""
    config = TrainerConfig(model="tiny", device=device, dtype="bfloat16", threads=1, lr=1e-5)
    assert changed_fraction(config) >= 0.99
    assert changed_fraction(TrainerConfig(model="tiny", device=device, weights_dtype="bfloat16", threads=1,
                                          lr=1e-5)) < 0.5, "the test tells kept updates from lost ones"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_generation_runs_on_the_device_and_matches_teacher_forcing(device, dtype):
    loaded = load_model("tiny", precision=resolve_precision(device, dtype))
    assert next(loaded.model.parameters()).device.type == device
    params = SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=3, logprobs=True)
    states = generate_batch(loaded.model, loaded.tokenizer, [BatchRequest(PROMPT, params)], eos_ids=set(),
                            autocast=loaded.autocast)[0]
    for state in states:
        assert len(state.token_ids) == 12
        sampled = [entry.logprob for entry in state.logprobs]
        forced = teacher_forced_logprobs(loaded.model, PROMPT, state.token_ids, 1.0, loaded.autocast())
        assert max(abs(a - b) for a, b in zip(sampled, forced, strict=True)) < INITIAL_RATIO_BOUND[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_trainer_and_server_agree_on_the_first_step(device, dtype):
    """Same weights, same tokens: the trainer's recomputed logprobs are the server's within the bound.

    The bench's sample (8 prompts x 32 tokens): with TF32 on, 4 x 16 tokens came out exact on an
    H100 while 8 x 32 did not.
    """
    deviation = initial_ratio_max_abs_dev("tiny", device, dtype)
    assert deviation < INITIAL_RATIO_BOUND[dtype]


def tied_tiny(device: str, inference_only: bool):
    """The tiny model under bfloat16 autocast with its head tied to its embeddings, as SmolLM2's is."""
    loaded = load_model("tiny", precision=resolve_precision(device, "bfloat16"))
    model = loaded.model
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    if inference_only:
        cast_linears_for_inference(model, loaded.precision)
    return loaded


@pytest.mark.parametrize("device", DEVICES)
def test_a_server_casts_its_linears_once_and_samples_exactly_what_autocast_samples(device):
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=5, logprobs=True)
    runs = []
    for inference_only in (False, True):
        loaded = tied_tiny(device, inference_only)
        states = generate_batch(loaded.model, loaded.tokenizer, [BatchRequest(PROMPT, params)], eos_ids=set(),
                                autocast=loaded.autocast)[0]
        runs.append([(s.token_ids, [e.logprob for e in s.logprobs]) for s in states])
    assert runs[0] == runs[1]
    assert loaded.model.lm_head.weight.dtype == loaded.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert loaded.model.get_input_embeddings().weight.dtype == torch.float32


@pytest.mark.parametrize("saved", ["lm_head.weight", "model.embed_tokens.weight"])
def test_loading_weights_refreshes_a_servers_own_copy_of_a_tied_head(saved):
    trained = tied_tiny("cpu", inference_only=False).model
    with torch.no_grad():
        trained.get_input_embeddings().weight.mul_(2.0)
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    state = {name: tensor for name, tensor in trained.state_dict().items() if name not in tied - {saved}}
    served = tied_tiny("cpu", inference_only=True).model
    check_weights(served, state)  # a checkpoint of a tied model carries one of the two
    assign_weights(served, state)
    assert torch.equal(served.lm_head.weight, trained.get_input_embeddings().weight.to(torch.bfloat16))
    assert torch.equal(served.get_input_embeddings().weight, trained.get_input_embeddings().weight)
    assert torch.equal(served.model.layers[0].mlp.up_proj.weight,
                       trained.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_the_server_contract_and_lora_serving_on_the_device(device, tmp_path):


    loaded = load_model("tiny", precision=resolve_precision(device, "auto"))
    server = ServerThread(create_app(loaded))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6, logprobs=True, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        assert len(choice.model_extra["token_ids"]) == len(choice.logprobs.content) > 0
    finally:
        server.stop()
    make_lora(tmp_path / "adapter")
    adapter = load_lora(tmp_path / "adapter", loaded.model, "skill", 1)
    assert {layer.a.device.type for layer in adapter.layers.values()} == {device}
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True)
    with applied(adapter, loaded.model):
        (state,) = generate_batch(loaded.model, loaded.tokenizer, [BatchRequest(PROMPT, params)], eos_ids=set(),
                                  autocast=loaded.autocast)[0]
    assert len(state.token_ids) == 4
