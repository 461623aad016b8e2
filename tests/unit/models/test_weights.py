"""Weight files: safetensors written in one pass read back as safetensors writes them."""

from __future__ import annotations

import pytest
import torch

from agentstream.models import sha256_file


def test_safetensors_written_in_one_pass_read_back_as_safetensors_writes_them(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from agentstream.models import WeightsError, write_safetensors

    tensors = {"b.weight": torch.randn(3, 4), "a.norm": torch.randn(5).to(torch.bfloat16), "step": torch.tensor(7),
               "empty": torch.zeros(0, 2), "transposed": torch.arange(6).reshape(2, 3).t(),
               "mask": torch.tensor([True, False, True])}
    digest = write_safetensors(tensors, tmp_path / "w.safetensors")
    assert digest == sha256_file(tmp_path / "w.safetensors")
    back = load_file(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # what transformers and vLLM look for
    header_size = int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")
    assert header_size % 8 == 0
    with pytest.raises(WeightsError, match="complex64"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")
