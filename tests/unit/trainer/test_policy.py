"""The policy's weights: saved, saved later, in bfloat16, as a LoRA adapter, loaded back; its attention kernel."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agentstream.infra.config import ConfigError, load_config
from agentstream.models import sha256_file
from agentstream.trainer.batching import Batch, Counts
from agentstream.trainer.checkpoint_writer import (
    FolderStore,
    latest_manifest,
    open_store,
    write_checkpoint,
)
from agentstream.trainer.policy import (
    PolicyError,
    build_policy,
    forget_momentum,
    load_weights,
    save_weights,
    save_weights_later,
)
from agentstream.trainer.step import train_step
from tests.support.samples import generated


def test_full_weights_checkpoint_round_trips_and_fits_the_dev_server(tmp_path, tiny_config):
    from agentstream.models import check_weights, load_model, read_weights

    policy = build_policy(tiny_config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), tiny_config)
    store = open_store(tmp_path.as_uri())
    staging = store.staging()
    weights = save_weights(policy, staging)
    manifest = write_checkpoint(store, staging, weights, model="tiny", version=1, step=1, format="full",
                                offsets={"x:0": 4}, trained_ids=["s0", "s1"], metrics={"loss": 0.5})
    folder = store.get(manifest.uri)
    assert manifest.uri.startswith("file://") and manifest.sha256 == sha256_file(folder / "model.safetensors")
    assert latest_manifest(store, "tiny") == manifest
    served = load_model("tiny", threads=None)
    check_weights(served.model, read_weights(folder))  # what /v1/load_weights runs
    restored = build_policy(tiny_config)
    load_weights(restored, folder)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(tensor, restored.model.state_dict()[name])
    assert restored.optimizer.state_dict()["state"].keys() == policy.optimizer.state_dict()["state"].keys()


def test_weights_saved_later_are_the_ones_copied_before_the_next_step(tmp_path, tiny_config):
    from safetensors.torch import load_file

    policy = build_policy(tiny_config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), tiny_config)
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    write = save_weights_later(policy, tmp_path, optimizer_state=True)
    moments = {k: v["exp_avg"].clone() for k, v in policy.optimizer.state_dict()["state"].items()}
    train_step(policy, Batch(generated(policy, 2, 1.0), 1, Counts()), tiny_config)  # changes weights and moments
    assert any(not torch.equal(before[name], tensor) for name, tensor in policy.model.state_dict().items())
    weights, digest = write()
    assert digest == sha256_file(weights)  # hashed on the way, as written
    saved = load_file(weights)
    storages = {tensor.data_ptr() for tensor in policy.model.state_dict().values()}
    assert len(saved) == len(storages)  # a tied head is written once, as save_model writes it
    restored = build_policy(tiny_config)
    load_weights(restored, tmp_path)
    for name, tensor in before.items():
        assert torch.equal(tensor, restored.model.state_dict()[name]), name
    for key, state in restored.optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[key])


def _moved_by_a_zero_gradient_step(policy) -> bool:
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    for parameter in policy.trainable():
        parameter.grad = torch.zeros_like(parameter)
    policy.optimizer.step()
    return any(not torch.equal(tensor, before[name]) for name, tensor in policy.model.state_dict().items())


def test_forgetting_momentum_zeroes_the_saved_first_moment_and_keeps_the_second_and_the_step(tmp_path, tiny_config):
    policy = build_policy(tiny_config)
    for step in range(2):
        train_step(policy, Batch(generated(policy, 2, 1.0), step, Counts()), tiny_config)
    save_weights(policy, tmp_path)
    saved = {key: {name: value.clone() for name, value in state.items()}
             for key, state in policy.optimizer.state_dict()["state"].items()}
    carried = build_policy(tiny_config)
    load_weights(carried, tmp_path)
    assert _moved_by_a_zero_gradient_step(carried)  # the saved direction alone moves the weights

    assert forget_momentum(tmp_path) == len(saved)
    restored = build_policy(tiny_config)
    load_weights(restored, tmp_path)
    for key, state in restored.optimizer.state_dict()["state"].items():
        assert not state["exp_avg"].any()
        assert torch.equal(state["exp_avg_sq"], saved[key]["exp_avg_sq"])
        assert torch.equal(state["step"], saved[key]["step"])
    assert not _moved_by_a_zero_gradient_step(restored)


def test_forgetting_momentum_where_no_optimizer_state_was_saved_says_so(tmp_path, tiny_config):
    save_weights(build_policy(tiny_config), tmp_path, optimizer_state=False)
    with pytest.raises(PolicyError, match="no optimizer state"):
        forget_momentum(tmp_path)


def test_bfloat16_checkpoints_hold_the_weights_rounded_and_a_resumed_trainer_says_so(tmp_path, tiny_config, caplog):
    from agentstream.models import check_weights, load_model, read_weights

    config = replace(tiny_config, checkpoint_dtype="bfloat16")
    policy = build_policy(config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), config)
    weights, digest = save_weights_later(policy, tmp_path, optimizer_state=False)()
    state = read_weights(tmp_path)
    assert {tensor.dtype for tensor in state.values()} == {torch.bfloat16} and digest == sha256_file(weights)
    full = {name: tensor for name, tensor in policy.model.state_dict().items() if name in state}
    assert sum(tensor.numel() * 2 for tensor in state.values()) < weights.stat().st_size < \
        sum(tensor.numel() * 4 for tensor in full.values())  # half the bytes of float32, plus the header
    served = load_model("tiny", threads=None)
    check_weights(served.model, state)
    restored = build_policy(tiny_config)
    with caplog.at_level("WARNING", logger="agentstream.trainer.policy"):
        load_weights(restored, tmp_path)
    assert "rounded" in caplog.text and "torch.bfloat16" in caplog.text
    for name, tensor in full.items():
        assert torch.equal(restored.model.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    with pytest.raises(ConfigError, match="checkpoint_dtype"):
        replace(tiny_config, checkpoint_dtype="float16")


def test_lora_checkpoint_is_a_peft_adapter_the_dev_server_loads(tmp_path, tiny_config):
    from agentstream.models import load_model
    from agentstream.serving.lora import load_lora

    config = replace(tiny_config, lora=True, lora_r=4, lora_alpha=8, lr=1e-2)
    policy = build_policy(config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), config)
    store = FolderStore(tmp_path)
    staging = store.staging()
    weights = save_weights(policy, staging)
    assert weights.name == "adapter_model.safetensors"
    manifest = write_checkpoint(store, staging, weights, model="a/b", version=3, step=7, format="lora", offsets={},
                                trained_ids=[], metrics={})
    folder = store.get(manifest.uri)
    adapter = load_lora(folder, load_model("tiny", threads=None).model, "a/b@v3", 3)
    assert len(adapter.layers) == 2 * 4  # q, k, v, o in both layers
    restored = build_policy(config)
    load_weights(restored, folder)
    lora_state = {k: v for k, v in policy.model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(v, restored.model.state_dict()[k]) for k, v in lora_state.items())


def test_the_trained_model_runs_eager_attention_on_the_cpu_unless_told_otherwise(tmp_path, tiny_config):
    assert build_policy(tiny_config).model.config._attn_implementation == "eager"
    assert build_policy(replace(tiny_config, attention="sdpa")).model.config._attn_implementation == "sdpa"
    path = tmp_path / "agentstream.toml"
    path.write_text('[trainer]\nattention = "flash"\n')
    with pytest.raises(ConfigError, match="attention must be auto, eager or sdpa"):
        load_config(path, environ={})
