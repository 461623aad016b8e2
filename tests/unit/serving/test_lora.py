"""LoRA adapters run on merged weights, made again when the base weights change."""

from __future__ import annotations

import torch

from agentstream.models import load_model
from tests.support.servers import make_lora


def test_an_adapter_runs_on_merged_weights_made_again_when_the_base_weights_change(tmp_path):
    from agentstream.serving.lora import applied, load_lora

    model = load_model("tiny").model
    reference = make_lora(tmp_path / "adapter")
    adapter = load_lora(tmp_path / "adapter", model, "skill", 1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    weights = {name: module.weight for name, module in model.named_modules() if name in adapter.layers}
    with torch.no_grad():
        with applied(adapter, model):
            merged = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
        assert torch.allclose(merged, expected, atol=1e-5)  # what peft computes unmerged
        assert all(module.weight is weights[name] for name, module in model.named_modules() if name in weights)
        assert not torch.allclose(model(input_ids=ids).logits, merged)  # the base model, untouched

        changed = next(iter(weights))
        weights[changed].mul_(1.5)  # a full-weight load assigns in place
        with applied(adapter, model):
            after = model(input_ids=ids).logits
        fresh = load_lora(tmp_path / "adapter", model, "skill", 1)  # no merged copies yet
        with applied(fresh, model):
            assert torch.equal(after, model(input_ids=ids).logits)
        assert not torch.allclose(after, merged)
