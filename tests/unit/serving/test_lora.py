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


def test_adapters_take_turns_on_one_merged_copy_and_each_answers_as_its_own(tmp_path):
    from agentstream.serving.lora import MergedWeights, applied, load_lora

    model = load_model("tiny").model
    references = {name: make_lora(tmp_path / name, seed) for name, seed in (("calc", 0), ("words", 1))}
    adapters = {name: load_lora(tmp_path / name, model, name, 1) for name in references}
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    merged = MergedWeights()
    with torch.no_grad():
        expected = {name: reference(input_ids=ids).logits for name, reference in references.items()}
        assert not torch.allclose(expected["calc"], expected["words"], atol=1e-3)
        for turn, name in enumerate(["calc", "words", "words", "calc", "words", "calc"]):
            before = merged.merges
            with applied(adapters[name], model, merged):
                logits = model(input_ids=ids).logits
            assert torch.allclose(logits, expected[name], atol=1e-5), (turn, name)
            switched = turn in (0, 1, 3, 4, 5)  # the same adapter twice in a row merges nothing again
            assert merged.merges - before == (len(adapters[name].layers) if switched else 0)
    modules = dict(model.named_modules())
    one_copy = sum(modules[name].weight.nbytes for name in adapters["calc"].layers)
    assert set(adapters["calc"].layers) == set(adapters["words"].layers) and merged.nbytes == one_copy
