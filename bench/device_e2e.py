"""The parts of scripts/device_e2e.sh written in Python: the model it trains, the mismatch probe, the report.

    python bench/device_e2e.py make-model OUT [--size 0.5B|tiny]
    python bench/device_e2e.py report RUN_DIR --model MODEL --out JSON [--device cuda] [--dtype bfloat16]

`make-model`: a random-initialised Qwen2 (Qwen2.5-0.5B's layers: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, RoPE base 1e6, tied embeddings) over the built-in character tokenizer (`common.modeling.build_char_tokenizer`,
offline), saved in bfloat16 so that the learner's float32 master weights and the engine's bfloat16 copy start from
the same values. Its vocabulary is the tokenizer's (~100 rows, not 151,936: a random model samples every row it has,
and rows past the tokenizer's decode to nothing), so it has ~0.36B parameters, 0.49B with Qwen's vocabulary.

`report`: the run's figures from its metric points (`metrics-unsent.jsonl`: the device has no MLflow, so the tracker
keeps every point there; cluster/tracking.py) plus the train/inference mismatch measured token by token:

- in the run, on the fresh tokens of each step's first mini-batch (`learner/logprob_diff_mean`, the lag-0 spread of
  exp(d) `learner/logprob_ratio_std_lag0`; learner/step.py), d = log-prob(learner) - log-prob(generator);
- the probe (`mismatch_probe`): the transformers engine samples on `device` in `dtype`, the learner's forward
  (`learner.forward.prepare_model` + `forward_stats`: its chunked LM head in float32) scores the same tokens, and
  every token's d gives median exp|d| and the KL of the generator's from the learner's distribution on the sampled
  tokens, k3 = mean(exp(d) - 1 - d) (unbiased, >= 0) beside k1 = mean(-d). NeMo-RL's gates: median exp|d| < 1.1 and
  KL < 5e-4.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # last: an installed project (the device carry's wheel) comes first
    sys.path.append(str(ROOT))

SIZES = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128),
}


def make_model(out: Path, size: str = "0.5B", seed: int = 0) -> Path:
    """A random Qwen2 of `size`'s layers over the character tokenizer, in bfloat16, saved to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from common.modeling import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SIZES[size])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"device_e2e: random Qwen2 ({size}'s layers, vocabulary {len(tok)}): {n / 1e6:.1f}M parameters in {out}")
    return out


def mismatch_probe(model_path: str | Path, *, device: str = "cuda", dtype: str = "bfloat16", prompts: int = 16,
                   samples: int = 4, max_new_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """Sample with the transformers engine, score the same tokens with the learner's forward; d per token."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.base import Sampling
    from actors.engines.transformers_engine import TransformersEngine
    from common.config import LearnerConfig, TransformersEngineConfig
    from learner.batching import Row, collate
    from learner.forward import forward_stats, prepare_model

    torch_dtype = getattr(torch, dtype)
    engine = TransformersEngine(TransformersEngineConfig(batch_rows=64), Sampling(max_new_tokens=max_new_tokens),
                                str(model_path), dtype=dtype, device=device)
    rng = np.random.default_rng(seed)
    tok = engine.tokenizer
    texts = [f"Using {rng.integers(1, 20, 3).tolist()} reach {int(rng.integers(1, 60))}:" for _ in range(prompts)]
    ids = [np.array([tok.bos_token_id, *tok.encode(t, add_special_tokens=False)], dtype=np.int64) for t in texts]
    out = engine.generate(ids, [samples] * prompts, seed)
    rows = [Row(p, s.token_ids.astype(np.int64), s.logprobs, 0.0, False, f"{i}", i)
            for i, (p, group) in enumerate(zip(ids, out)) for s in group if len(s.token_ids)]
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).to(device).eval()
    model = prepare_model(model, LearnerConfig(), trainable=False)
    d = []
    with torch.no_grad():
        for i in range(0, len(rows), 32):
            mb = collate(rows[i:i + 32], tok.pad_token_id, torch.device(device))
            logp, _, _ = forward_stats(model, mb)
            mask = mb.response_mask > 0
            d.append((logp[mask].double() - mb.behaviour_logprobs[mask].double()).cpu())
    d = torch.cat(d)  # [N] log-prob(learner) - log-prob(engine)
    return {
        "tokens": int(d.numel()),
        "median_exp_abs_diff": float(torch.exp(d.abs()).median()),
        "mean_abs_diff": float(d.abs().mean()),
        "max_abs_diff": float(d.abs().max()),
        "kl_k3": float((torch.exp(d) - 1 - d).mean()),
        "kl_k1": float((-d).mean()),
        "device": device,
        "dtype": dtype,
    }


def read_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's metric points (key -> [(step, value)]) from its metrics-unsent.jsonl."""
    from cluster.tracking import UNSENT_FILE, read_unsent

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for key, value, _, step in read_unsent(run_dir / UNSENT_FILE):
        series[key].append((step, value))
    return series


def run_figures(series: dict[str, list[tuple[int, float]]], skip_steps: int = 2) -> dict[str, float]:
    """Medians over the steps after the first `skip_steps` (start-up, compile) of the figures the issue asks for;
    the peaks are the largest value seen."""
    def med(key: str) -> float:
        vals = [v for s, v in sorted(series.get(key, [])) if s > skip_steps] or [v for _, v in series.get(key, [])]
        return statistics.median(vals) if vals else math.nan

    def peak(key: str) -> float:
        return max((v for _, v in series.get(key, [])), default=math.nan)

    step_s = med("driver/step_s")
    ratio_std = med("learner/logprob_ratio_std_lag0")
    return {
        "steps": max((s for s, _ in series.get("learner/version", [])), default=0),
        "steps_per_s": 1 / step_s if step_s == step_s and step_s > 0 else math.nan,
        "step_s": step_s,
        "learner_step_time_s": med("learner/step_time_s"),
        "learner_tokens_per_s": med("learner/tokens_per_s"),
        "generated_tokens_per_s": med("generator/tokens_per_s"),
        "generated_wall_tokens_per_s": med("generator/wall_tokens_per_s"),
        "publication_s": med("driver/weight_publish_s"),
        "publication_blocking_s": med("weights/publish_blocking_s"),
        "load_s": med("generator/weight_load_s_last"),
        "learner_peak_memory_gib": peak("learner/peak_memory_gib"),
        "generator_peak_memory_gib": peak("generator/peak_memory_gib"),
        "run_logprob_diff_mean": med("learner/logprob_diff_mean"),
        "run_logprob_diff_max": peak("learner/logprob_diff_max"),
        "run_logprob_ratio_std_lag0": ratio_std,
        # for small d, Var(exp d) ~ E[d^2] ~ 2 KL: the in-run estimate of the KL on lag-0 tokens
        "run_kl_estimate_lag0": ratio_std ** 2 / 2 if ratio_std == ratio_std else math.nan,
    }


ROWS = [
    ("steps", "learner steps", "{:.0f}"),
    ("steps_per_s", "steps / s", "{:.3f}"),
    ("learner_step_time_s", "learner step time (s)", "{:.3f}"),
    ("learner_tokens_per_s", "learner tokens / s", "{:,.0f}"),
    ("generated_tokens_per_s", "generated tokens / s (engine busy)", "{:,.0f}"),
    ("generated_wall_tokens_per_s", "generated tokens / s (wall)", "{:,.0f}"),
    ("publication_s", "publication (s, driver waits)", "{:.3f}"),
    ("publication_blocking_s", "publication blocking the learner (s)", "{:.3f}"),
    ("load_s", "weight load in the generator (s)", "{:.3f}"),
    ("learner_peak_memory_gib", "learner peak memory (GiB)", "{:.2f}"),
    ("generator_peak_memory_gib", "generator peak memory (GiB)", "{:.2f}"),
    ("run_logprob_diff_mean", "run: mean |d log-prob| (fresh tokens)", "{:.2e}"),
    ("run_logprob_ratio_std_lag0", "run: std exp(d), lag 0", "{:.2e}"),
    ("run_kl_estimate_lag0", "run: KL ~ std^2/2, lag 0", "{:.2e}"),
    ("probe_median_exp_abs_diff", "probe: median exp|d| (gate < 1.1)", "{:.5f}"),
    ("probe_kl_k3", "probe: KL k3 (gate < 5e-4)", "{:.2e}"),
    ("probe_kl_k1", "probe: KL k1", "{:.2e}"),
    ("probe_max_abs_diff", "probe: max |d|", "{:.2e}"),
    ("probe_tokens", "probe: tokens", "{:.0f}"),
]


def table(fig: dict) -> str:
    width = max(len(label) for _, label, _ in ROWS)
    lines = []
    for key, label, fmt in ROWS:
        v = fig.get(key)
        text = "-" if v is None or (isinstance(v, float) and v != v) else fmt.format(v)
        lines.append(f"  {label:<{width}}  {text}")
    return "\n".join(lines)


def report(run_dir: Path, model: str, out: Path, device: str, dtype: str, min_steps: int) -> int:
    series = read_points(run_dir)
    fig = run_figures(series)
    started = time.monotonic()
    probe = mismatch_probe(model, device=device, dtype=dtype)
    fig.update({f"probe_{k}": v for k, v in probe.items()}, probe_s=time.monotonic() - started)
    fig["run_dir"] = str(run_dir)
    out.write_text(json.dumps(fig, indent=1))
    print(f"device_e2e: {run_dir.name} on {device} ({dtype})\n{table(fig)}")
    problems = []
    if fig["steps"] < min_steps:
        problems.append(f"{fig['steps']} learner steps in the metrics, fewer than {min_steps}")
    for key in ("probe_median_exp_abs_diff", "probe_kl_k3", "learner_step_time_s", "generated_tokens_per_s"):
        if not math.isfinite(fig.get(key, math.nan)):
            problems.append(f"{key} is not a finite number")
    for p in problems:
        print(f"device_e2e: FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out", type=Path)
    m.add_argument("--size", choices=sorted(SIZES), default="0.5B")
    r = sub.add_parser("report")
    r.add_argument("run_dir", type=Path)
    r.add_argument("--model", required=True, help="model folder for the mismatch probe")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--min-steps", type=int, default=1)
    args = p.parse_args()
    if args.command == "make-model":
        make_model(args.out, args.size)
        return 0
    return report(args.run_dir, args.model, args.out, args.device, args.dtype, args.min_steps)


if __name__ == "__main__":
    sys.exit(main())
