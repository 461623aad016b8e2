"""Model loading: the tiny model is deterministic and a bad spec is a named error."""

from __future__ import annotations

import pytest
import torch

from agentstream.models import ModelLoadError, load_model


def test_tiny_model_is_deterministic_and_bad_specs_fail(tiny):
    again = load_model("tiny")
    pairs = zip(tiny.model.state_dict().values(), again.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ModelLoadError):
        load_model("/nonexistent/model")
