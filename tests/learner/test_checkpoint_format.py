"""The checkpoint's streamed model export: model.safetensors written a bucket at a time, in any order; reading a
checkpoint runs nothing planted in it (the DCP folder through an allow-list)."""

import dataclasses
import io
import os
import pickle
import random
import re
import shlex
import shutil
from pathlib import Path

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


# ------------------------------------------------------------------ planted checkpoints: nothing in one is run


class Payload:
    """Unpickled by a reader that trusts it, this runs `touch <marker>`: what a planted checkpoint file does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def plant_file(path: Path, marker: Path) -> None:
    """Replace the file with a pickle of the payload."""
    path.write_bytes(pickle.dumps(Payload(marker)))


def plant_entry(folder: Path, marker: Path, *, tensor: bool) -> Path:
    """Point one entry of the DCP folder (a tensor's, else a plain one such as a param_group's lr) at a torch.save
    of the payload appended to its file, the metadata rewritten as DCP writes it (pickle.dump); returns that file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from learner.checkpoint import read_dcp_metadata

    meta = read_dcp_metadata(folder / ".metadata")
    index, info = next((i, s) for i, s in meta.storage_data.items()
                       if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata) != tensor)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    f = folder / info.relative_path
    offset = f.stat().st_size
    with open(f, "ab") as out:
        out.write(buf.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return f


def _dcp_folder(folder: Path) -> dict:
    """A small DCP folder shaped like the learner's (AdamW moments and param_groups), saved without a process
    group; returns what was saved."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)}},
                       "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["w"], "foreach": None}]}}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_a_dcp_folder_loads_without_pickle_and_a_planted_one_is_refused_naming_file_and_class(tmp_path):
    """The allow-list reads our metadata and entries back exactly; a payload in the metadata, a plain entry or a
    tensor entry is refused naming the file and `posix.system`, and never runs. DCP's own reader does run it."""
    import torch.distributed.checkpoint as dcp

    from learner.checkpoint import CheckpointError, check_dcp_folder, load_dcp, read_dcp_metadata

    saved = _dcp_folder(tmp_path / "good")
    check_dcp_folder(tmp_path / "good")
    back = {"optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, 3)}},
                      "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["w"], "foreach": False}]}}
    load_dcp(back, tmp_path / "good")
    assert back["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert all(torch.equal(back["optim"]["state"]["w"][k], v) for k, v in saved["optim"]["state"]["w"].items())

    marker = tmp_path / "MARKER"
    for case in ("metadata", "plain", "tensor"):
        folder = tmp_path / case
        shutil.copytree(tmp_path / "good", folder)
        if case == "metadata":
            file = folder / ".metadata"
            plant_file(file, marker)
        else:
            file = plant_entry(folder, marker, tensor=case == "tensor")
        with pytest.raises(CheckpointError, match=re.escape(str(file)) + r".*posix\.system, which is not "
                                                  r"checkpoint data: refused"):
            check_dcp_folder(folder)
        with pytest.raises(CheckpointError, match=re.escape(str(folder)) + r".*posix\.system.*refused"):
            load_dcp(back, folder)  # without the check first: DCP's own reads through the allow-list too
        assert not marker.exists(), case

    with pytest.raises(CheckpointError, match="unreadable"):  # a truncated metadata: a message, not a traceback
        (tmp_path / "metadata" / ".metadata").write_bytes((tmp_path / "good" / ".metadata").read_bytes()[:100])
        read_dcp_metadata(tmp_path / "metadata" / ".metadata")
    plant_file(tmp_path / "metadata" / ".metadata", marker)
    try:  # the payload is live: DCP's own reader runs it
        dcp.FileSystemReader(str(tmp_path / "metadata")).read_metadata()
    except Exception:  # noqa: BLE001: os.system returns 0, which is no Metadata; whatever DCP then says
        pass
    assert marker.exists()
