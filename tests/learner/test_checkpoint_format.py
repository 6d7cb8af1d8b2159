"""The checkpoint's streamed model export: model.safetensors written a bucket at a time, in any order."""

import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from learner.checkpoint import SafetensorsWriter, tensor_specs


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g)
    return {"model.embed_tokens.weight": emb, "lm_head.weight": emb,  # tied: the same storage twice
            "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.ones(8), "scale": torch.tensor(3.0), "steps": torch.arange(5),
            "mask": torch.tensor([True, False])}


def test_buckets_in_any_order_give_the_standard_file(tmp_path):
    sd = state()
    specs = tensor_specs(sd, torch.float32)
    specs["model.layers.0.w"] = (torch.bfloat16, (8, 8))  # a layout may keep an entry's own dtype
    names = list(sd)
    random.Random(1).shuffle(names)
    w = SafetensorsWriter(tmp_path / "model.safetensors", specs)
    for i in range(0, len(names), 3):  # buckets of three, out of order
        w.write({k: sd[k] for k in names[i : i + 3]})
    w.close()
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_missing_or_misshapen_tensor_is_refused(tmp_path):
    sd = state()
    specs = tensor_specs(sd, torch.float32)
    specs["model.layers.0.w"] = (torch.bfloat16, (8, 8))
    w = SafetensorsWriter(tmp_path / "a.safetensors", specs)
    with pytest.raises(ValueError, match="the layout says"):
        w.write({"model.norm.weight": torch.ones(9)})
    with pytest.raises(ValueError, match="not in the export's layout"):
        w.write({"extra": torch.ones(1)})
    w.write({"scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="never arrived"):
        w.close()
