"""Learner checkpoints: a Hugging Face model folder plus optimizer, counters and RNG states.

A checkpoint folder `D` holds `D/model/` (transformers / vLLM load it; in the run's `model.dtype`), `D/adapter/`
(with `learner.lora`: peft's format), `D/optimizer/` (torch.distributed.checkpoint of the AdamW state and, below
float32, the float32 master weights), `D/rng/rank{r}.json` and `D/meta.json`, written last. Everything is
written into a sibling `.D.tmp-<id>` folder renamed to `D` when complete; a folder without meta.json or with
unreadable files is refused with `CheckpointError`. Every rank writes its optimizer shards: on a multi-node
cluster `D` must be on shared storage. A checkpoint resumes exactly under either dtype.

Reading one runs no code from it: JSON, safetensors, and DCP's pickled `.metadata` through an unpickler that builds
only DCP's metadata classes (`read_dcp_metadata`), its entries through `torch.load(weights_only=True)`.

Details (the layout, precision, resume): docs/internals.md#learnercheckpointpy
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

FORMAT = 1
MODEL_DIR, OPTIM_DIR, RNG_DIR, META = "model", "optimizer", "rng", "meta.json"
ADAPTER_DIR = "adapter"  # LoRA runs: the adapters alone, in peft's format
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's file names
MASTER_KEY = "master"  # float32 master weights inside the DCP folder (saved when model.dtype is lower)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete or corrupt (the message names the file)."""


def tmp_dir_for(final: str | Path) -> Path:
    final = Path(final).absolute()
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: str | Path) -> Path:
    """Make `tmp` visible as `final` (replacing an older `final` only once the new one is in place)."""
    final = Path(final).absolute()
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)
    return final


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def tensor_specs(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple]]:
    """name -> (dtype once floating entries are cast to `dtype`, full shape): read from a (sharded) state
    dict's metadata, so every rank knows the export's layout before any tensor is gathered."""
    return {k: (dtype if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in state_dict.items()}


class SafetensorsWriter:
    """One `.safetensors` file written as its tensors arrive, in any order and a bucket at a time: the header
    (every name, dtype, shape and offset, from `specs`) first, then each tensor at its offset. The writer
    holds no tensor; `close` refuses a file with a tensor missing. Readers see the standard format."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple]]):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        self.offsets: dict[str, tuple[int, int]] = {}
        self.specs = specs
        for name in sorted(specs):
            dt, shape = specs[name]
            n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self.offsets[name] = (off, n)
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.base = 8 + len(raw)
        self.path, self.f = Path(path), open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.f.truncate(self.base + off)
        self.written: set[str] = set()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name not in self.specs:
                raise ValueError(f"{self.path.name}: tensor {name!r} is not in the export's layout")
            dt, shape = self.specs[name]
            if t.dtype != dt or tuple(t.shape) != shape:
                raise ValueError(f"{self.path.name}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                                 f"the layout says {dt} {shape}")
            off, n = self.offsets[name]
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            assert data.nbytes == n
            self.f.seek(self.base + off)
            self.f.write(memoryview(data))
            self.written.add(name)

    def close(self) -> None:
        missing = sorted(set(self.specs) - self.written)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if missing:
            raise ValueError(f"{self.path.name}: {len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")


def write_hf_folder(buckets, specs: dict[str, tuple[torch.dtype, tuple]], model_config, source_dir: str | Path,
                    out: Path, dtype: torch.dtype = torch.float32, aliases: dict[str, str] | None = None) -> None:
    """config.json + model.safetensors from `buckets` (an iterable of {name: tensor} dicts whose floating
    entries are already `dtype`: `learner.gather.iter_full_state(..., dtype=dtype)`, or a whole state dict
    in a list), written bucket by bucket in the layout `specs` (`tensor_specs`), so the writer never holds
    more than one bucket; config.json's `dtype` says `dtype`; tokenizer/generation files copied from
    `source_dir`. `aliases` ({alias: name}, `learner.gather.tied_aliases`): a tied tensor that travels once is
    written under its alias too, from the same bucket. Each bucket is written before the next is taken (the
    gather reuses its buffers)."""
    out.mkdir(parents=True, exist_ok=True)
    model_config = copy.deepcopy(model_config)
    model_config.dtype = dtype
    model_config.save_pretrained(out)
    writer = SafetensorsWriter(out / "model.safetensors", specs)
    try:
        for bucket in buckets:
            writer.write(bucket)
            writer.write({a: bucket[n] for a, n in (aliases or {}).items() if n in bucket and a not in bucket})
            del bucket
    finally:
        writer.close()
    for f in Path(source_dir).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)


def peft_key(name: str) -> str:
    """peft's name for one of our adapter tensors: `model.layers.0.self_attn.q_proj.lora_A` (a state-dict name,
    `learner.lora.adapter_names`) -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft saves
    `PeftModel.state_dict()` with the adapter name `default` removed). lora_A is [r, in], lora_B [out, r] in both."""
    if not name.endswith((".lora_A", ".lora_B")):
        raise ValueError(f"{name!r} is not a LoRA adapter tensor (...lora_A or ...lora_B)")
    return f"base_model.model.{name}.weight"


def peft_adapter_config(*, rank: int, alpha: float, dropout: float, target_modules: list[str],
                        base_model: str) -> dict:
    """adapter_config.json of peft's `LoraConfig` for our adapters: plain LoRA (scaling alpha / r, no rsLoRA or
    DoRA, no bias), `target_modules` matched by the last part of a module's name as ours are, Linear weights
    [out, in] (`fan_in_fan_out` false)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
            "revision": None, "inference_mode": True, "r": rank,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "lora_dropout": dropout,
            "target_modules": list(target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_peft_adapter(buckets, specs: dict[str, tuple[torch.dtype, tuple]], config: dict, out: Path) -> None:
    """`out`/adapter_config.json (`config`: `peft_adapter_config`) and `out`/adapter_model.safetensors from
    `buckets` of adapter tensors under our names (`learner.gather.iter_flat_buckets(..., adapters=True)`), each
    written under its peft name (`peft_key`) as it arrives, in the layout `specs` (keyed by our names)."""
    out.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(out / ADAPTER_WEIGHTS, {peft_key(k): v for k, v in specs.items()})
    try:
        for bucket in buckets:
            writer.write({peft_key(k): t for k, t in bucket.items()})
            del bucket
    finally:
        writer.close()
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


def load_hf_weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    path = Path(ckpt) / MODEL_DIR / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt}: model weights {path} are missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: model weights {path} are unreadable ({e})") from e


def has_master_weights(ckpt: str | Path) -> bool:
    """True when the DCP folder of `ckpt` holds float32 master weights (`MASTER_KEY`)."""
    meta = read_dcp_metadata(Path(ckpt) / OPTIM_DIR / ".metadata")
    return any(k.startswith(MASTER_KEY + ".") for k in meta.state_dict_metadata)


_DCP_META = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = frozenset({
    *((_DCP_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                               "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")})
"""What DCP's `.metadata` of our saves pickles (pickletools on fp32, bf16 with masters and LoRA saves), torch
dtypes aside: dataclasses, sizes and layouts built from plain values, nothing that runs a command."""

_UNPICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
                    OverflowError, MemoryError, RecursionError)


class _MetadataUnpickler(pickle.Unpickler):
    """Imports only `METADATA_CLASSES` and torch dtypes; any other global refuses the file (a planted
    `__reduce__` needs one, e.g. os.system)."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        # vars(), not getattr: torch's module __getattr__ would import a submodule for an unknown name
        if (module, name) in METADATA_CLASSES or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path} asks to load {module}.{name}, which is not checkpoint data: refused "
                              "(a checkpoint is tensors and plain data; nothing in it is run)")


def read_dcp_metadata(path: Path):
    """DCP's `Metadata` from `path` (a `.metadata` file) with `_MetadataUnpickler`; CheckpointError naming the file
    for a missing, corrupt or planted one."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, *_UNPICKLE_ERRORS) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict) \
            or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointError(f"{path} holds a {type(meta).__name__}, not DCP metadata")
    return meta


def _plain_load(f, path: Path, what: str, **kw):
    """`torch.load(weights_only=True)` of one DCP entry; CheckpointError naming the file and the refused global."""
    try:
        return torch.load(f, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {what} {_refusal(e)}") from None
    except (RuntimeError, *_UNPICKLE_ERRORS) as e:
        raise CheckpointError(f"{path}: {what} is unreadable ({type(e).__name__}: {e})") from None


def _refusal(e: pickle.UnpicklingError) -> str:
    """What torch's weights_only unpickler refused, in a line (its own message suggests weights_only=False)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    what = f"asks to load {found[1]}, which is not checkpoint data" if found else "is not plain data"
    return f"{what}: refused (a checkpoint is tensors and plain data; nothing in it is run)"


def check_dcp_folder(folder: Path):
    """Every entry of the DCP folder `folder` read as it would be on load, without running code: the metadata
    (`read_dcp_metadata`), each plain entry (param_groups) loaded, each tensor entry's pickle loaded onto the meta
    device (no data read), every slice inside its file. Returns the metadata; CheckpointError naming the file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.utils import _create_file_view

    meta = read_dcp_metadata(folder / ".metadata")
    for index, info in meta.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
                and isinstance(info.relative_path, str) and Path(info.relative_path).name == info.relative_path
                and type(info.offset) is int and type(info.length) is int and not info.transform_descriptors):
            raise CheckpointError(f"{folder / '.metadata'}: entry {index!r} points at {info!r}, not at bytes of a "
                                  "file of the folder")
        path = folder / info.relative_path
        try:
            size = path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{path} is unreadable ({e})") from None
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CheckpointError(f"{path} is truncated: entry {index.fqn!r} needs bytes up to "
                                  f"{info.offset + info.length}, the file has {size}")
        plain = isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        with open(path, "rb") as f:
            _plain_load(_create_file_view(f, info.offset, info.length), path, f"entry {index.fqn!r}",
                        **({} if plain else {"map_location": "meta"}))
    return meta


def load_dcp(state: dict, folder: Path) -> None:
    """Collective: `dcp.load` of `state` from `folder` through `_safe_dcp`'s reader and planner; CheckpointError (a
    rank's own, or naming what failed) instead of DCP's CheckpointException and its tracebacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_dcp()
    try:
        dcp.load(state, storage_reader=reader(str(folder)), planner=planner(folder))
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        own = next((x for x in errors if isinstance(x, CheckpointError)), None)
        if own is not None:
            raise CheckpointError(str(own)) from None
        refused = next((x for x in errors if isinstance(x, pickle.UnpicklingError)), None)
        if refused is not None:  # a tensor entry, read by DCP itself with weights_only=True
            raise CheckpointError(f"{folder}: an entry {_refusal(refused)}") from None
        raise CheckpointError(f"{folder} is unreadable (" + "; ".join(
            f"{type(x).__name__}: {x}" for x in errors) + ")") from None


@functools.cache
def _safe_dcp():
    """DCP's reader and load planner with every pickle read safely; made on first use (importing
    torch.distributed.checkpoint takes a second the driver's checks need not pay)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's reader with `read_metadata` through `_MetadataUnpickler` (DCP's own is `pickle.load`)."""

        def read_metadata(self, *args, **kwargs):
            meta = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner with plain entries read by `torch.load(weights_only=True)` (DCP's own: False)."""

        def __init__(self, folder: Path):
            super().__init__()
            self.folder = Path(folder)

        def load_bytes(self, read_item, value) -> None:
            info = self.metadata.storage_data.get(read_item.storage_index)
            path = self.folder / (info.relative_path if info is not None else ".metadata")
            obj = _plain_load(value, path, f"entry {read_item.dest_index.fqn!r}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader, SafePlanner


def write_meta(ckpt: Path, *, step: int, version: int, num_ranks: int) -> None:
    meta = {"format": FORMAT, "step": step, "version": version, "num_ranks": num_ranks, "created_at": time.time()}
    (ckpt / META).write_text(json.dumps(meta, indent=1))


def read_meta(ckpt: str | Path) -> dict:
    """meta.json of a complete checkpoint; CheckpointError for a missing, partial or corrupt one."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt} does not exist")
    try:
        meta = json.loads((ckpt / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {META} is missing (an interrupted save?)") from None
    except ValueError as e:  # not JSON, or not even text
        raise CheckpointError(f"{ckpt / META} is corrupt ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt / META} holds a {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT or not {"step", "version", "num_ranks"} <= meta.keys():
        raise CheckpointError(f"checkpoint {ckpt}: {META} has format {meta.get('format')!r} / keys {sorted(meta)}; "
                              f"expected format {FORMAT} with step, version, num_ranks")
    for sub in (MODEL_DIR, OPTIM_DIR):
        if not (ckpt / sub).is_dir():
            raise CheckpointError(f"checkpoint {ckpt}: {sub}/ is missing")
    return meta


def rng_state() -> dict:
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def save_rng(ckpt: Path, rank: int) -> None:
    (ckpt / RNG_DIR).mkdir(exist_ok=True)
    (ckpt / RNG_DIR / f"rank{rank}.json").write_text(json.dumps(rng_state()))


def load_rng(ckpt: Path, rank: int) -> bool:
    """Restore rank's RNG state; False when the checkpoint has none for this rank (other world size)."""
    f = Path(ckpt) / RNG_DIR / f"rank{rank}.json"
    if not f.is_file():
        return False
    try:
        set_rng_state(json.loads(f.read_text()))
    except (KeyError, ValueError, TypeError, IndexError) as e:  # ValueError: not JSON, or not even text
        raise CheckpointError(f"checkpoint {ckpt}: RNG state {f} is corrupt ({type(e).__name__}: {e})") from None
    return True
