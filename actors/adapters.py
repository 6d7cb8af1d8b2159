"""Adapter-only publications on the generator side (`learner.lora.publish: adapters`): merged into the base.

    merger = AdapterMerger(model_path, who=generator_id)        # once per generator; reads nothing yet
    if ann.adapters is not None:
        engine.load_weights(merger.merge(source.fetch_buckets(ann), ann.adapters), ann.version, partial=True)

The merger hands the engine a partial state: every block holding a target (read once from the model folder),
its targets' weights replaced by W + scaling B A, merged in float32 and cast to the publication's dtype.
Imports only torch and safetensors. Why whole blocks, and how it agrees with the learner's merge:
docs/internals.md#actorsadapterspy
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from common.messages import AdapterPublication

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20  # merged blocks handed to the engine per bucket (it holds one bucket beside its weights)


def block_of(target: str) -> str:
    """The module whose tensors load together with `target`'s (its parent; the target itself at the top level)."""
    return target.rpartition(".")[0] or target


class AdapterMerger:
    """The base tensors of the targets' blocks, on the host, and the merge of adapter publications into them."""

    def __init__(self, model_path: str | Path, *, who: str = "generator", bucket_bytes: int = BUCKET_BYTES):
        self.model_path, self.who, self.bucket_bytes = Path(model_path), who, bucket_bytes
        self.base: dict[str, torch.Tensor] = {}  # held folder tensors by name
        self.blocks: dict[str, list[str]] = {}  # block -> its tensors' names, in folder order

    def _index(self) -> dict[str, Path]:
        """{tensor name: its safetensors file} of the model folder."""
        from safetensors import safe_open

        files = sorted(self.model_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.model_path} holds no *.safetensors: an adapter publication is merged into "
                                    "the base weights of the run's model folder (or set learner.lora.publish=merged)")
        out: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    def hold(self, targets: Iterable[str]) -> None:
        """Read the folder's tensors of every block of `targets` not held yet. ValueError when a target has no
        `.weight` in the folder (the publication does not fit this model)."""
        from safetensors import safe_open

        targets = list(targets)
        new = [b for b in dict.fromkeys(block_of(t) for t in targets) if b not in self.blocks]
        if not new:
            return
        index = self._index()
        absent = [t for t in targets if f"{t}.weight" not in index]
        if absent:
            raise ValueError(f"adapter publication targets {absent[:3]} have no weight in {self.model_path} (of "
                             f"{len(index)} tensors, e.g. {next(iter(index))}): the learner's model is not this one")
        names = {b: [k for k in index if k.startswith(b + ".")] for b in new}
        by_file: dict[Path, list[str]] = {}
        for k in (k for b in new for k in names[b]):
            by_file.setdefault(index[k], []).append(k)
        for f, keys in by_file.items():
            with safe_open(str(f), "pt") as h:
                self.base.update({k: h.get_tensor(k) for k in keys})
        self.blocks.update(names)
        if len(self.blocks) == len(new):  # the first publication: once per generator
            log.info("%s: adapter publications are merged on this generator (W + scaling B A into the base of %s; "
                     "%d blocks, %d tensors, %.1f MB held on the host) and loaded as a partial state", self.who,
                     self.model_path, len(self.blocks), len(self.base),
                     sum(t.nbytes for t in self.base.values()) / 2**20)

    def merge(self, buckets: Iterable[dict[str, torch.Tensor]], spec: AdapterPublication
              ) -> Iterator[dict[str, torch.Tensor]]:
        """The partial state of an adapter publication (`buckets`, as a weight source yields them), in buckets of
        about `bucket_bytes`, block after block in the targets' order, merged as the engine asks for them. Eager
        before it returns: the base blocks are read and every adapter is received (they are small), so a failed
        transfer or a publication that does not fit raises here, before an engine has loaded anything (no torn
        load). ValueError when the adapters and `spec.targets` differ."""
        self.hold(spec.targets)
        adapters = {k: v.clone() for b in buckets for k, v in b.items()}  # a source may reuse its buffers
        expected = {f"{t}.{p}" for t in spec.targets for p in ("lora_A", "lora_B")}
        if adapters.keys() != expected:
            missing, unexpected = sorted(expected - adapters.keys()), sorted(adapters.keys() - expected)
            raise ValueError(f"adapter publication does not match its targets: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return self._merged(adapters, spec)

    def _merged(self, adapters: dict[str, torch.Tensor], spec: AdapterPublication
                ) -> Iterator[dict[str, torch.Tensor]]:
        targets = set(spec.targets)
        out: dict[str, torch.Tensor] = {}
        size = 0
        for block in dict.fromkeys(block_of(t) for t in spec.targets):
            for name in self.blocks[block]:
                w, module = self.base[name], name.rpartition(".")[0]
                if module in targets and name.endswith(".weight"):
                    a, b = adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"]  # [r, in], [out, r]
                    w = torch.addmm(w.float(), b.float(), a.float(), alpha=spec.scaling).to(a.dtype)  # [out, in]
                out[name] = w
                size += w.nbytes
            if size >= self.bucket_bytes:
                yield out
                out, size = {}, 0
        if out:
            yield out
