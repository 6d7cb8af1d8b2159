"""LoRA publication bench (issue 38): bytes per version, merged vs adapter-only, and an engine's load of each.

    python bench/lora_bench.py [--ranks 8 16] [--dtype bfloat16] [--engines transformers vllm] [--repeats 5]

Models: the built-in model (`exgrpo train`'s default: built and cached by `common.toy_model.ensure_toy_model`, a
char-level Llama, h96 L3) and a Qwen2 test model with Qwen2.5's 151,936-row vocabulary (tied head) at h256 L4
(`common.modeling.TinyQwen2`, untrained: bytes and load times depend on the shapes only). Per model and LoRA
rank, the default targets (q/k/v/o, gate/up/down), alpha = 2 rank, B drawn random (a trained-looking adapter):

- bytes per version: the payload a publication carries (`learner.gather.iter_flat_buckets` on one rank, the
  gather every publication runs; what `WeightsAnnouncement.num_bytes` reports), merged (`learner.lora.publish:
  merged`, the whole model) vs adapters (`publish: adapters`), in `--dtype` (the generators' dtype);
- load ms: the engine's load of one version, median of `--repeats` after a warm-up: a full load of the merged
  publication vs the generator's path for adapters (`actors.adapters.AdapterMerger.merge`, W + s B A on the host,
  then `Engine.load_weights(partial=True)`); the merger's one-time read of the base blocks from the model folder is
  its own column. The transport is not timed (bench/weights_bench.py times it; it scales with the bytes).

The ratio adapters / merged is r (in + out) / (in out) per target plus nothing for the embeddings, norms and head:
under 2% needs wide layers or a large vocabulary; at tiny widths it is not (the table says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN = dict(vocab_size=151_936, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--engines", nargs="+", choices=["transformers", "vllm"], default=["transformers", "vllm"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    models = {"built-in (h96 L3)": builtin_model(), "Qwen2 152k vocab (h256 L4)": qwen_model(tmp / "qwen")}
    rows = []
    for name, folder in models.items():
        for rank in args.ranks:
            rows.append(measure(name, folder, rank, args))
            print(rows[-1], flush=True)

    cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    print(f"\n$ {cmd}    (torch {torch.__version__}, {os.cpu_count()} CPUs, {args.dtype} publications)\n")
    head = ["model", "params", "rank", "merged bytes", "adapter bytes", "adapters / merged"]
    for e in args.engines:
        head += [f"{e}: full load ms", f"{e}: adapter merge+load ms", f"{e}: base read once ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        cells = [r["model"], f"{r['params'] / 1e6:.2f}M", str(r["rank"]), mib(r["merged"]), mib(r["adapters"]),
                 f"{100 * r['adapters'] / r['merged']:.2f}%"]
        for e in args.engines:
            full, part, base = r[e]
            cells += [f"{full:.1f}", f"{part:.1f}", f"{base:.0f}"]
        print("| " + " | ".join(cells) + " |")


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def builtin_model() -> Path:
    """The built-in model folder of the default config (built, minutes, when not cached)."""
    from common.config import load_config
    from common.toy_model import ensure_toy_model

    cfg = load_config(None, [])
    return ensure_toy_model(cfg.model, cfg.data)


def qwen_model(path: Path) -> Path:
    from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder

    tok = build_char_tokenizer()
    model = TinyQwen2(vocab_size=QWEN["vocab_size"], hidden_size=QWEN["hidden_size"], num_layers=QWEN["num_layers"],
                      num_heads=QWEN["num_heads"], num_kv_heads=QWEN["num_kv_heads"], max_positions=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    return save_model_folder(model, tok, path)


def measure(name: str, folder: Path, rank: int, args) -> dict:
    """One row: the publications of one adapted version of `folder` and each engine's load of them."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.config import LoRAConfig
    from common.messages import AdapterPublication
    from learner.gather import iter_flat_buckets
    from learner.lora import apply_lora, init_adapters, lora_modules

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRAConfig(rank=rank, alpha=2.0 * rank))
    init_adapters(model, 0, 0, 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.02)
    dtype = getattr(torch, args.dtype)
    merged = [{k: v.clone() for k, v in b.items()} for b in iter_flat_buckets(model, 0, 1, dtype=dtype)]
    adapters = [{k: v.clone() for k, v in b.items()} for b in iter_flat_buckets(model, 0, 1, dtype=dtype,
                                                                               adapters=True)]
    spec = AdapterPublication(scaling=2.0, targets=list(lora_modules(model)))
    row = {"model": name, "params": params, "rank": rank, "merged": nbytes(merged), "adapters": nbytes(adapters)}
    for e in args.engines:
        row[e] = load_times(e, folder, merged, adapters, spec, args)
    return row


def nbytes(buckets: list[dict]) -> int:
    return sum(t.nbytes for b in buckets for t in b.values())


def load_times(kind: str, folder: Path, merged, adapters, spec, args) -> tuple[float, float, float]:
    """(full load ms, adapter merge + partial load ms: medians; the merger's first read of the base, ms)."""
    from actors.adapters import AdapterMerger
    from actors.engines import make_engine
    from common.config import GeneratorConfig, TransformersEngineConfig, VllmEngineConfig

    engine_cfg = TransformersEngineConfig() if kind == "transformers" else \
        VllmEngineConfig(max_model_len=256, block_size=32, cpu_kv_cache_gb=0.25)
    engine = make_engine(GeneratorConfig(engine=engine_cfg, dtype=args.dtype, max_new_tokens=8), str(folder))
    try:
        merger = AdapterMerger(folder)
        t0 = time.perf_counter()
        merger.hold(spec.targets)
        base_ms = (time.perf_counter() - t0) * 1e3
        full, part = [], []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            engine.load_weights(iter(merged), 2 * i + 1)
            t1 = time.perf_counter()
            engine.load_weights(merger.merge(iter(adapters), spec), 2 * i + 2, partial=True)
            t2 = time.perf_counter()
            if i:  # the first is a warm-up
                full.append((t1 - t0) * 1e3)
                part.append((t2 - t1) * 1e3)
        return statistics.median(full), statistics.median(part), base_ms
    finally:
        if kind == "vllm":
            del engine.llm


if __name__ == "__main__":
    main()
