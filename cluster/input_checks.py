"""More checks of a run's inputs before Ray starts, each a "field: problem" line that names what to change
(None, or an empty list, when there is nothing to say), through `cluster.preflight.input_problems` (`exgrpo
config`, `train`, and every variant of `exgrpo experiment`) and `eval_problems` (`exgrpo eval`).

    model_problems(cfg)          the model folder agrees with itself (whole weights, config.json's vocab_size)
    tokenizer_vocab_problem(t)   the tokenizer's ids fit config.json's vocab_size
    lora_target_problem(cfg)     learner.lora.target_modules name Linear modules of the model
    attention_problem(cfg)       learner.levers.attn_implementation's package imports (a local run)
    cluster_address_problem(a)   cluster.address resolves and its port answers as a GCS, within a few seconds
What each reads (what is cheap: config.json, the weights' headers): docs/internals.md#clusterinput_checkspy
"""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

ADDRESS_TIMEOUT_S = 5.0
"""How long `cluster_address_problem` waits for the host name to resolve and for the port to accept."""

EMBEDDING_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "model.embed_in.weight",
                   "gpt_neox.embed_in.weight", "embed_tokens.weight", "lm_head.weight")
"""Weight names whose first dimension is the vocabulary (the input embeddings of common architectures, then the
head), looked up in this order."""


def model_folder(cfg) -> Path | None:
    """The folder a run loads: model.path, or the built-in model's cache folder when it is already built (None:
    not built yet; it is built to agree with itself)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        return path if (path / "config.json").is_file() else None
    if cfg.data.task is None:
        return None
    from common.toy_model import INFO_FILE, cache_key

    folder = Path(cfg.model.cache_dir).expanduser() / f"toy-{cfg.data.task}-{cache_key(cfg.model.toy, cfg.data)}"
    return folder if (folder / INFO_FILE).is_file() else None


def problems(cfg) -> list[str]:
    """Every check of this module that applies to `cfg` (the address probe only where cluster.address is set)."""
    found = [cluster_address_problem(cfg.cluster.address)] if cfg.cluster.address else [attention_problem(cfg)]
    path = model_folder(cfg)
    if path is not None:
        found += model_problems(path, "model.path" if cfg.model.path is not None else "the built-in model")
        if cfg.learner.lora is not None:
            found.append(lora_target_problem(path, cfg.learner.lora))
    return [p for p in found if p]


def attention_problem(cfg) -> str | None:
    """learner.levers.attn_implementation's package does not import here, where a local run's learner loads the model
    (on a cluster the learner's node decides: its rank says so at its start, `learner.setup.setup_rank`). GPUs
    asked of a machine without any: `preflight.gpus_missing` speaks for the whole GPU config instead."""
    if cfg.learner.levers.attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        return None  # no package to import (and no torch import for it)
    import torch

    from learner.levers import attention_problem as problem

    if cfg.learner.num_gpus > 0 and not torch.cuda.is_available():
        return None

    return problem(cfg.learner.levers.attn_implementation)


# ------------------------------------------------------------------------------------------ the model folder


def model_problems(path: Path, field: str = "model.path") -> list[str]:
    """The safetensors files whole (`weights_cut_short`), and config.json's vocab_size against the weights'
    embedding rows."""
    found = weights_cut_short(path, field)
    if found:
        return found
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, OSError):
        return []  # preflight.model_folder_problem says why
    vocab = _vocab_size(config) if isinstance(config, dict) else None
    if vocab is None:
        return []
    found = [weights_vocab_problem(path, vocab, field)]
    return [p for p in found if p]


def weights_cut_short(path: Path, field: str = "model.path") -> list[str]:
    """Safetensors files shorter than their header says (an interrupted download or copy), and shards that
    model.safetensors.index.json names but the folder lacks. A file holds 8 bytes (the header's length, little-endian),
    the JSON header, then the tensors: its size is at least 8 + header length + the largest `data_offsets` end."""
    index = path / "model.safetensors.index.json"
    try:
        files = sorted({path / f for f in json.loads(index.read_text()).get("weight_map", {}).values()}) \
            if index.is_file() else [path / "model.safetensors"]
    except (ValueError, OSError, AttributeError, TypeError) as e:
        return [f"{field}: {index} is not readable JSON with a weight_map ({type(e).__name__}); download it again"]
    found = []
    for file in files:
        if not file.is_file():
            if index.is_file():
                found.append(f"{field}: {index.name} names the shard {file.name}, which is not in {path}; download it")
            continue
        actual = file.stat().st_size
        try:
            header = safetensors_header(file)
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            expected = 8 + _header_length(file) + max(ends, default=0)
        except (ValueError, OSError, KeyError, TypeError, IndexError, struct.error):
            found.append(f"{field}: {file} is not a readable safetensors file (its header is cut short or damaged; "
                         f"{actual} bytes); download or copy it again")
            continue
        if actual < expected:
            found.append(f"{field}: {file} is cut short: its header says {expected} bytes, the file has {actual} "
                         f"({actual / expected:.0%}): an interrupted download or copy; download or copy it again")
    return found


def _header_length(file: Path) -> int:
    with file.open("rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _vocab_size(config: dict) -> int | None:
    """vocab_size of a config.json (a multimodal config's text_config holds it)."""
    for d in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        v = d.get("vocab_size") if isinstance(d, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def weights_vocab_problem(path: Path, vocab: int, field: str = "model.path") -> str | None:
    """The embedding's rows in the safetensors weights differ from config.json's vocab_size (transformers would
    refuse the folder inside every actor: "You set `ignore_mismatched_sizes` to `False`")."""
    found = embedding_rows(path)
    if found is None or found[1] == vocab:
        return None
    name, rows, file = found
    return (f"{field}: {path / 'config.json'} says vocab_size {vocab}, but the weights hold {rows} rows in {name} "
            f"({file.name}); the config and the weights come from different models: set vocab_size to {rows} in "
            "config.json, or copy the config.json that came with these weights")


def embedding_rows(path: Path) -> tuple[str, int, Path] | None:
    """(tensor name, its first dimension, the file) of the model's embedding, read from the safetensors headers
    (the first 8 bytes give the JSON header's length; no tensor is read). None: no safetensors, or no known name."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = {name: path / f for name, f in weight_map.items()}
        elif (path / "model.safetensors").is_file():
            files = {name: path / "model.safetensors" for name in safetensors_header(path / "model.safetensors")}
        else:
            return None
        name = next((n for n in EMBEDDING_NAMES if n in files), None)
        if name is None:
            return None
        shape = safetensors_header(files[name]).get(name, {}).get("shape")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable weights: the learner's own load says so
    return (name, shape[0], files[name]) if isinstance(shape, list) and shape else None


MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on a header."""


def safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets} (and __metadata__)."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{file}: a header of {n} bytes is not safetensors")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors header")
    return header


def tokenizer_vocab_problem(tok, path: Path, field: str = "model.path") -> str | None:
    """A token id of `tok` (the folder's tokenizer, as `preflight.train_questions` loaded it: loaded once) at or
    beyond config.json's vocab_size: a prompt holding that token would index past the embedding (a CUDA assert or an
    index error inside an actor)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, OSError):
        return None  # preflight.model_folder_problem says why
    vocab = _vocab_size(config) if isinstance(config, dict) else None
    if vocab is None:
        return None
    largest = max([len(tok) - 1, *(i for i in tok.get_added_vocab().values() if isinstance(i, int))])
    if largest < vocab:
        return None
    return (f"{field}: the tokenizer in {path} has token ids up to {largest}, but config.json's vocab_size is {vocab} "
            f"(the embedding has rows 0..{vocab - 1}): the tokenizer belongs to another model; copy the tokenizer "
            "files of the model these weights came from")


# ------------------------------------------------------------------------------------------------ LoRA


def lora_target_problem(path: Path, lora) -> str | None:
    """learner.lora.target_modules that match no Linear of the model: the learner's own check (`apply_lora`) on
    the model built on the meta device, so its message comes before Ray, alone."""
    try:
        from learner.loading import build_empty
        from learner.lora import apply_lora

        model = build_empty(path)
    except Exception:  # noqa: BLE001 - a config transformers cannot build: the learner reports it with its traceback
        return None
    try:
        apply_lora(model, lora)
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------- cluster


def cluster_address_problem(address: str | None, timeout_s: float = ADDRESS_TIMEOUT_S) -> str | None:
    """Why `cluster.address` cannot be joined from here (None: the host resolves and the port accepts a TCP
    connection within `timeout_s`, or the address is `auto`/`local`, which Ray resolves itself). Ray's own
    connect would retry an unreachable address for minutes, printing its C++ warnings and no line of ours."""
    if not address or address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    host, sep, port_text = address.removeprefix("ray://").rpartition(":")
    if not client and "://" in address:
        return (f"cluster.address: {address!r} is not a Ray address; write host:port (the head node's GCS port, "
                "6379 by default) or ray://host:10001")
    if not sep or not host:
        return (f"cluster.address: {address!r} has no port; write host:port (the head node's GCS port, 6379 by "
                "default)" + (", or ray://host:10001" if client else ""))
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return f"cluster.address: {address!r}: {port_text!r} is not a port (1 to 65535); the head's GCS port is 6379 by default"
    port = int(port_text)
    fix = ("check that the head runs (`ray start --head` there prints the address to join), the host and port "
           f"({'the Ray client server, 10001 by default' if client else 'the GCS port, 6379 by default'}), that no "
           "firewall blocks it, and RAY_AUTH_MODE (token auth: the cluster's token in RAY_AUTH_TOKEN)")
    try:
        infos = _resolve(host.strip("[]"), port, timeout_s)
    except OSError as e:
        return f"cluster.address: {address}: the host {host!r} does not resolve ({_reason(e)}); {fix}"
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout_s)
                s.connect(sockaddr)
            not_gcs = None if client else _not_a_gcs(address, timeout_s)
            return f"cluster.address: {address} answers, but not as a Ray cluster's GCS ({not_gcs}); {fix}" \
                if not_gcs else None
        except OSError as e:
            last = e
    why = f"no answer within {timeout_s:g} s" if isinstance(last, socket.timeout) else _reason(last)
    return f"cluster.address: {address} could not be reached ({why}); {fix}"


def _not_a_gcs(address: str, timeout_s: float) -> str | None:
    """Why the server at `address` is not a GCS (another program on that port: a web server, another gRPC
    service), or None: it answered GetClusterId, asked for a token, or was slow (not refused for that). The call
    `cluster.auth.cluster_auth_mode` makes too."""
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(b"", timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
            return f"{e.code().name}: {' '.join((e.details() or '').split())[:200]}"
    finally:
        channel.close()
    return None


def _resolve(host: str, port: int, timeout_s: float) -> list:
    """getaddrinfo with a bound (it has none of its own: a dead DNS server waits for its resolver's timeouts)."""
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Timeout

    pool = ThreadPoolExecutor(1, thread_name_prefix="resolve")
    try:
        return pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(timeout_s)
    except Timeout:
        raise OSError(f"no answer within {timeout_s:g} s") from None
    finally:
        pool.shutdown(wait=False)


def _reason(e: OSError | None) -> str:
    if e is None:
        return "no address"
    return e.strerror or str(e) or type(e).__name__
