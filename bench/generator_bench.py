"""Generator engine throughput: vLLM vs transformers on the built-in model and a ~10M-parameter model.

    .venv/bin/python bench/generator_bench.py [--prompts 32] [--samples 8] [--max-new-tokens 24] [--threads 1]

Same prompts (the built-in countdown task's test split), same sampling settings (temperature 1,
top_p 1), same process and thread count for every engine. Each engine is timed on ONE generate call
of all prompts × samples (what a generator does with one lease), after a small warm-up call; the
weight-load time is the median of 3 `load_weights` of a full state dict (vLLM: reload_weights +
reset_prefix_cache; transformers: load_state_dict). Prints a table and the command that made it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32, help="questions per generate call")
    p.add_argument("--samples", type=int, default=8, help="samples per question (K)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="OMP / torch threads for every engine")
    p.add_argument("--engines", default="vllm,transformers")
    p.add_argument("--models", default="builtin,10m")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="generator-bench-"))
    models = {name: model_folder(name, work) for name in args.models.split(",")}
    prompts = load_prompts(next(iter(models.values()))[0], args.prompts)
    rows = []
    for model_name, (path, params, origin) in models.items():
        for engine_name in args.engines.split(","):
            rows.append(run_one(engine_name, model_name, path, params, origin, prompts, args))
            print(f"  done: {engine_name} on {model_name}", file=sys.stderr, flush=True)
    print(f"$ {shlex.join([sys.executable.split('/')[-1], *sys.argv])}")
    print(table(rows, args))
    return 0


def model_folder(name: str, work: Path) -> tuple[str, int, str]:
    """(folder, parameter count, where it came from) of the built-in-sized or the ~10M model."""
    from safetensors.torch import load_file

    from common.modeling import make_tiny_model_folder

    if name == "builtin":
        path, origin = trained_toy_model()
        if path is None:
            path = make_tiny_model_folder(work / "builtin", hidden_size=96, num_layers=3, num_heads=3)
            origin = "untrained"
    elif name == "10m":
        path, origin = make_tiny_model_folder(work / "10m", hidden_size=256, num_layers=12, num_heads=4), "untrained"
    else:
        raise SystemExit(f"unknown model {name!r}: use builtin or 10m")
    params = sum(t.numel() for t in load_file(str(Path(path) / "model.safetensors")).values())
    return str(path), params, origin


def trained_toy_model() -> tuple[Path | None, str]:
    """A cached trained built-in model of the default size, without building it (None if there is none).

    The exact cache entry of the default config is preferred; any other cached build with the same
    architecture (hidden size, layers, heads) runs at the same speed, so it is used otherwise.
    """
    import json

    from common.config import DataConfig, ModelConfig
    from common.toy_model import INFO_FILE, cache_key

    m, d = ModelConfig(), DataConfig()
    root = Path(m.cache_dir).expanduser()
    exact = root / f"toy-{d.task}-{cache_key(m.toy, d)}"
    if (exact / INFO_FILE).is_file():
        return exact, "trained"
    arch = {"hidden_size": m.toy.hidden_size, "num_layers": m.toy.num_layers, "num_heads": m.toy.num_heads}
    for folder in sorted(root.glob(f"toy-{d.task}-*")):
        info = folder / INFO_FILE
        if info.is_file() and all(json.loads(info.read_text()).get("settings", {}).get(k) == v for k, v in arch.items()):
            return folder, "trained"
    return None, ""


def load_prompts(model_path: str, n: int):
    from transformers import AutoTokenizer

    from common.config import DataConfig
    from common.data import load_questions

    tok = AutoTokenizer.from_pretrained(model_path)
    questions, _ = load_questions(DataConfig(num_test=max(n, 8)), tok, "test")
    return [q.prompt_ids for q in questions[:n]]


def run_one(engine_name: str, model_name: str, path: str, params: int, origin: str, prompts, args) -> dict:
    import gc

    import torch

    from actors.engines import make_engine
    from common.config import GeneratorConfig, TransformersEngineConfig, VllmEngineConfig

    engine_cfg = (VllmEngineConfig(max_model_len=256, cpu_kv_cache_gb=0.5) if engine_name == "vllm"
                  else TransformersEngineConfig(batch_rows=max(1, args.prompts * args.samples)))
    cfg = GeneratorConfig(engine=engine_cfg, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    t0 = time.perf_counter()
    engine = make_engine(cfg, path, seed=0)
    startup_s = time.perf_counter() - t0
    engine.generate(prompts[:2], [2, 2], seed=1)  # warm-up
    n = [args.samples] * len(prompts)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, n, seed=2)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for o in outs for s in o)
    rollouts = sum(len(o) for o in outs)

    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    loads = []
    for v in range(1, 4):
        t0 = time.perf_counter()
        engine.load_weights(state, v)
        loads.append(time.perf_counter() - t0)
    if engine_name == "vllm":
        del engine.llm
    del engine
    gc.collect()
    return dict(engine=engine_name, model=f"{model_name} ({origin})", params=params, rollouts=rollouts,
                tokens=tokens, gen_s=gen_s, tok_s=tokens / gen_s, roll_s=rollouts / gen_s,
                load_s=sorted(loads)[1], startup_s=startup_s)


def table(rows: list[dict], args) -> str:
    head = ["engine", "model", "params", "rollouts", "tokens", "gen s", "tokens/s", "rollouts/s", "weight load s",
            "startup s"]
    body = [[r["engine"], r["model"], f"{r['params'] / 1e6:.2f}M", str(r["rollouts"]), str(r["tokens"]),
             f"{r['gen_s']:.2f}", f"{r['tok_s']:.0f}", f"{r['roll_s']:.1f}", f"{r['load_s']:.3f}",
             f"{r['startup_s']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    note = (f"{args.prompts} prompts x {args.samples} samples, max_new_tokens={args.max_new_tokens}, temperature 1, "
            f"top_p 1, {args.threads} thread(s), one generate call each")
    return "\n".join([note, line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


if __name__ == "__main__":
    raise SystemExit(main())
