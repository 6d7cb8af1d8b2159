"""The parts of scripts/device_e2e.sh written in Python: the models, the probe, the one-screen summary.

    python bench/device_e2e.py carry-model CARRY                 # the built-in model into CARRY/models (on the host)
    python bench/device_e2e.py make-model OUT [--size 0.5B|tiny]
    python bench/device_e2e.py probe --model MODEL --out JSON [--device cuda] [--dtype bfloat16]
    python bench/device_e2e.py summary OUT_DIR [--run RUN_DIR] [--quick] [--budget-s 240]

`carry-model`: the built-in countdown model (common.toy_model, the default config's) built or taken from the cache
and copied into CARRY/models/, the folder `model.cache_dir` points at on the device: the learning run trains it
there without building it (minutes of CPU) first.

`make-model`: a random-initialised Qwen2 (Qwen2.5-0.5B's layers: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, RoPE base 1e6, tied embeddings) over the built-in character tokenizer (`common.modeling.build_char_tokenizer`,
offline), saved in bfloat16. Its vocabulary is the tokenizer's (~100 rows, not 151,936: a random model samples
every row it has, and rows past the tokenizer's decode to nothing), so it has ~0.36B parameters. Kept when the
folder already holds it (a warm machine).

`probe`: the train/inference mismatch and the throughput at that width. The transformers engine samples on `device`
in `dtype` (64 sequences of 64 new tokens), the learner's forward (`learner.forward.prepare_model` +
`forward_stats`: its chunked LM head in float32) scores the same tokens, and every token's
d = log-prob(learner) - log-prob(engine) gives median exp|d| and the KL of the engine's from the learner's
distribution on the sampled tokens, k3 = mean(exp(d) - 1 - d) (unbiased, >= 0) beside k1 = mean(-d). NeMo-RL's
gates: median exp|d| < 1.1 and KL < 5e-4. Throughput: the engine's generated tokens/s, the learner's scoring forward
and one forward+backward (eager) in response tokens/s.

`summary`: reads what the parts left in OUT_DIR (parts.tsv: each part's exit code, seconds and budget; the learning
run's metric points, `<run>/metrics-unsent.jsonl`, kept there by the offline tracker; probe.json; pytest-gpu.log)
and prints one screen: the parts, the learning run's figures, the probe's, and the gates judged. A part that failed
or ran out of time leaves its gates failed (or judged on what it logged before it stopped); the summary is printed
whatever happened. Writes OUT_DIR/device_e2e.json; exit 0 when every gate judged passed.

Gates (--quick, the CPU check, judges the first four, the probe's and tests/gpu's; the rest are shown):
replayed rows > 0 (mixed groups trained, their stored trajectory in the learner's loss), mixed mode on, candidates
shipped > 0, rewards > 0, reward rising (the mean of the last third of the steps above the first third's), the
first update <= 60 s after `exgrpo train` started (`driver/first_update_s`), the probe's two gates, tests/gpu passed,
and the whole check within --budget-s.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
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
UNSENT_FILE = "metrics-unsent.jsonl"  # cluster.tracking.UNSENT_FILE (read here without importing the project)
FIRST_UPDATE_GATE_S = 60.0
MEDIAN_EXP_GATE, KL_GATE = 1.1, 5e-4  # NeMo-RL's mismatch gates


# ------------------------------------------------------------------------------------------------ models


def carry_model(carry: Path) -> Path:
    """The default config's built-in model (built once, cached) copied into `carry`/models/<its cache name>."""
    from common.config import RunConfig
    from common.toy_model import ensure_toy_model

    cfg = RunConfig()
    src = ensure_toy_model(cfg.model, cfg.data, verbose=True)
    dst = carry / "models" / src.name
    if not dst.is_dir():
        tmp = dst.with_name(dst.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.rename(dst)
    size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"device_e2e: the built-in model in {dst} ({size / 1e6:.1f} MB): scripts/device_e2e.sh trains it with "
          f"model.cache_dir={dst.parent}")
    return dst


def make_model(out: Path, size: str = "0.5B", seed: int = 0) -> Path:
    """A random Qwen2 of `size`'s layers over the character tokenizer, in bfloat16, saved to `out` (kept when there)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from common.modeling import build_char_tokenizer

    stamp = out / "device_e2e.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"size": size, "seed": seed}:
        print(f"device_e2e: random Qwen2 ({size}'s layers) kept in {out}")
        return out
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **SIZES[size])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps({"size": size, "seed": seed}))
    n = sum(p.numel() for p in model.parameters())
    print(f"device_e2e: random Qwen2 ({size}'s layers, vocabulary {len(tok)}): {n / 1e6:.1f}M parameters in {out}")
    return out


# ------------------------------------------------------------------------------------------------- probe


def mismatch_probe(model_path: str | Path, *, device: str = "cuda", dtype: str = "bfloat16", prompts: int = 16,
                   samples: int = 4, max_new_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """Sample with the transformers engine, score the same tokens with the learner's forward; d per token. Also the
    throughput of each (tokens/s: generated, scored, forward+backward)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.base import Sampling
    from actors.engines.transformers_engine import TransformersEngine
    from common.config import LearnerConfig, TransformersEngineConfig
    from learner.batching import Row, collate
    from learner.forward import forward_stats, prepare_model

    def sync() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    torch_dtype = getattr(torch, dtype)
    engine = TransformersEngine(TransformersEngineConfig(batch_rows=64), Sampling(max_new_tokens=max_new_tokens),
                                str(model_path), dtype=dtype, device=device)
    rng = np.random.default_rng(seed)
    tok = engine.tokenizer
    texts = [f"Using {rng.integers(1, 20, 3).tolist()} reach {int(rng.integers(1, 60))}:" for _ in range(prompts)]
    ids = [np.array([tok.bos_token_id, *tok.encode(t, add_special_tokens=False)], dtype=np.int64) for t in texts]
    engine.generate(ids[:1], [1], seed + 1)  # warm-up (CUDA context, kernels): not timed
    t0 = sync()
    out = engine.generate(ids, [samples] * prompts, seed)
    gen_s = sync() - t0
    rows = [Row(p, s.token_ids.astype(np.int64), s.logprobs, 0.0, False, f"{i}", i)
            for i, (p, group) in enumerate(zip(ids, out)) for s in group if len(s.token_ids)]
    tokens = sum(len(r.response_ids) for r in rows)
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).to(device).eval()
    model = prepare_model(model, LearnerConfig(), trainable=False)
    micro = [collate(rows[i:i + 32], tok.pad_token_id, torch.device(device)) for i in range(0, len(rows), 32)]
    d = []
    t0 = sync()
    with torch.no_grad():
        for mb in micro:
            logp, _, _ = forward_stats(model, mb)
            mask = mb.response_mask > 0
            d.append((logp[mask].double() - mb.behaviour_logprobs[mask].double()).cpu())
    score_s = sync() - t0
    t0 = sync()
    for mb in micro:  # one eager forward+backward at this width (the learner's step without the optimizer)
        logp, _, _ = forward_stats(model, mb)
        (logp * mb.response_mask).sum().backward()
    train_s = sync() - t0
    d = torch.cat(d)  # [N] log-prob(learner) - log-prob(engine)
    return {
        "tokens": int(d.numel()),
        "median_exp_abs_diff": float(torch.exp(d.abs()).median()),
        "mean_abs_diff": float(d.abs().mean()),
        "max_abs_diff": float(d.abs().max()),
        "kl_k3": float((torch.exp(d) - 1 - d).mean()),
        "kl_k1": float((-d).mean()),
        "generated_tokens_per_s": tokens / gen_s if gen_s > 0 else math.nan,
        "scored_tokens_per_s": tokens / score_s if score_s > 0 else math.nan,
        "train_tokens_per_s": tokens / train_s if train_s > 0 else math.nan,
        "parameters": float(sum(p.numel() for p in model.parameters())),
        "device": device,
        "dtype": dtype,
    }


def probe(model: str, out: Path, device: str, dtype: str) -> int:
    started = time.monotonic()
    fig = mismatch_probe(model, device=device, dtype=dtype)
    fig["seconds"] = time.monotonic() - started
    out.write_text(json.dumps(fig, indent=1))
    print(f"device_e2e: probe on {device} ({dtype}, {fig['parameters'] / 1e6:,.1f}M parameters): median exp|d| "
          f"{fig['median_exp_abs_diff']:.5f}, KL k3 {fig['kl_k3']:.2e} over {fig['tokens']} tokens; generated "
          f"{fig['generated_tokens_per_s']:,.0f} tokens/s, scored {fig['scored_tokens_per_s']:,.0f}, forward+backward "
          f"{fig['train_tokens_per_s']:,.0f}")
    return 0


# ----------------------------------------------------------------------------------------------- summary


LEARNING_KEYS = ("train/reward_mean", "train/mixed_mode", "train/mixed_groups", "learner/replay_tokens",
                 "learner/candidates_scored", "buffer/candidates_shipped", "driver/first_update_s", "driver/step_s",
                 "learner/step_time_s")


def read_points(run_dir: Path | None) -> dict[str, list[tuple[int, float]]]:
    """The run's metric points (key -> [(step, value)], by step) from its metrics-unsent.jsonl (the device has no
    MLflow: the tracker keeps every point there; a line cut short by a killed run is skipped), else, where MLflow is
    installed, from the run's MLflow run in the store beside the run folders (the default tracking.uri)."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    path = run_dir / UNSENT_FILE if run_dir is not None else None
    if path is not None and path.is_file():
        for line in path.read_text().splitlines():
            try:
                p = json.loads(line)
                series[str(p["key"])].append((int(p["step"]), float(p["value"])))
            except (ValueError, KeyError, TypeError):
                continue
    elif run_dir is not None and (run_dir / "state.json").is_file() and (run_dir.parent / "mlflow.db").is_file():
        from mlflow.tracking import MlflowClient

        run_id = json.loads((run_dir / "state.json").read_text()).get("mlflow_run_id")
        client = MlflowClient(f"sqlite:///{(run_dir.parent / 'mlflow.db').resolve()}")
        for key in LEARNING_KEYS if run_id else ():
            series[key] = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
    for v in series.values():
        v.sort()
    return series


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def learning_figures(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """What the learning run shows: steps, the first update, mixed mode, replay, rewards."""
    def values(key: str) -> list[float]:
        return [v for _, v in series.get(key, [])]

    def total(key: str) -> float:
        return float(sum(values(key)))

    rewards = values("train/reward_mean")
    third = max(1, len(rewards) // 3)
    mixed_steps = [s for s, v in series.get("train/mixed_mode", []) if v > 0]
    first = values("driver/first_update_s")
    return {
        "steps": float(max((s for s, _ in series.get("train/reward_mean", [])), default=0)),
        "first_update_s": first[0] if first else math.nan,
        "mixed_mode": 1.0 if mixed_steps else 0.0,
        "mixed_from_step": float(mixed_steps[0]) if mixed_steps else math.nan,
        "replayed_rows": total("train/mixed_groups"),
        "replayed_tokens": total("learner/replay_tokens"),
        "candidates_shipped": max(values("buffer/candidates_shipped"), default=0.0),
        "candidates_scored": total("learner/candidates_scored"),
        "reward_max": max(rewards, default=math.nan),
        "reward_first": statistics.mean(rewards[:third]) if rewards else math.nan,
        "reward_last": statistics.mean(rewards[-third:]) if rewards else math.nan,
        "reward_window": float(third),
        "step_s": median(values("driver/step_s")),
        "learner_step_time_s": median(values("learner/step_time_s")),
    }


def read_parts(out_dir: Path) -> list[dict]:
    """parts.tsv: name, exit code, seconds, budget (0: none), note; a line per part that ran."""
    path = out_dir / "parts.tsv"
    parts = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, rc, seconds, budget, note = (line.split("\t") + [""] * 5)[:5]
        parts.append({"name": name, "rc": int(rc), "seconds": float(seconds), "budget": float(budget), "note": note})
    return parts


def part_status(p: dict | None) -> str:
    if p is None:
        return "not run"
    if p["rc"] == 0:
        return "ok"
    return "out of time" if p["rc"] in (124, 137) else f"failed ({p['rc']})"


def pytest_outcome(log: Path) -> str:
    """The last pytest summary line of the log ("7 passed, 2 skipped in 63.2s"), or what it got through."""
    if not log.is_file():
        return ""
    text = log.read_text(errors="replace")
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error|deselected).*?)\s*=*$", text, re.M)
    if found:
        return found[-1]
    return f"{len(re.findall(r'PASSED', text))} passed before it stopped"


def gates(quick: bool, parts: dict[str, dict], learn: dict, probe_fig: dict, whole_s: float,
          budget_s: float, tests: str) -> list[tuple[str, bool | None, str]]:
    """(gate, passed (None: shown, not judged), value) in the summary's order."""
    def fin(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    run_note = "" if part_status(parts.get("learning run")) == "ok" else f" ({part_status(parts.get('learning run'))})"
    rise = f"{learn['reward_first']:.3f} -> {learn['reward_last']:.3f}" if fin(learn["reward_first"]) else "-"
    med, kl = probe_fig.get("median_exp_abs_diff", math.nan), probe_fig.get("kl_k3", math.nan)
    first = learn["first_update_s"]
    return [
        ("replayed rows > 0", learn["replayed_rows"] > 0 and learn["replayed_tokens"] > 0,
         f"{learn['replayed_rows']:.0f} rows, {learn['replayed_tokens']:,.0f} tokens in the learner's loss{run_note}"),
        ("mixed mode on", learn["mixed_mode"] > 0,
         f"from step {learn['mixed_from_step']:.0f}" if learn["mixed_mode"] > 0 else f"never{run_note}"),
        ("candidates shipped > 0", learn["candidates_shipped"] > 0, f"{learn['candidates_shipped']:.0f}"),
        ("rewards > 0", fin(learn["reward_max"]) and learn["reward_max"] > 0,
         f"best step's mean {learn['reward_max']:.3f}" if fin(learn["reward_max"]) else "-"),
        ("reward rising", None if quick else fin(learn["reward_first"]) and learn["reward_last"] > learn["reward_first"],
         f"{rise} (mean of the first / last {learn['reward_window']:.0f} steps)"),
        (f"first update <= {FIRST_UPDATE_GATE_S:.0f} s", None if quick else fin(first) and first <= FIRST_UPDATE_GATE_S,
         f"{first:.1f} s after exgrpo train started" if fin(first) else f"-{run_note}"),
        (f"probe median exp|d| < {MEDIAN_EXP_GATE}", fin(med) and med < MEDIAN_EXP_GATE,
         f"{med:.5f}" if fin(med) else part_status(parts.get("mismatch probe"))),
        (f"probe KL < {KL_GATE:g}", fin(kl) and kl < KL_GATE, f"{kl:.2e}" if fin(kl) else
         part_status(parts.get("mismatch probe"))),
        # on the GPU some must have run: all skipped means CUDA was not there (--quick: skipped is the CPU's pass)
        ("tests/gpu passed", part_status(parts.get("tests/gpu")) == "ok" and (quick or " passed" in f" {tests}"),
         f"{tests or '-'} ({part_status(parts.get('tests/gpu'))})"),
        (f"whole check <= {budget_s:.0f} s", None if quick else whole_s <= budget_s, f"{whole_s:.0f} s"),
    ]


def summary(out_dir: Path, run_dir: Path | None, quick: bool, budget_s: float, whole_s: float, device: str) -> int:
    parts = {p["name"]: p for p in read_parts(out_dir)}
    learn = learning_figures(read_points(run_dir))
    probe_path = out_dir / "probe.json"
    probe_fig = json.loads(probe_path.read_text()) if probe_path.is_file() else {}
    tests = pytest_outcome(out_dir / "pytest-gpu.log")
    judged = gates(quick, parts, learn, probe_fig, whole_s, budget_s, tests)
    failed = [g for g, ok, _ in judged if ok is False]
    lines = [f"device_e2e summary{' (--quick)' if quick else ''}: {device}, {whole_s:.0f} s of a {budget_s:.0f} s budget",
             f"  {'part':<18} {'status':<12} {'seconds':>8} {'budget':>7}  note"]
    for p in parts.values():
        budget = f"{p['budget']:.0f}" if p["budget"] else "-"
        lines.append(f"  {p['name']:<18} {part_status(p):<12} {p['seconds']:>8.1f} {budget:>7}  {p['note']}")
    lines.append(f"learning run ({run_dir.name if run_dir else '-'}): {learn['steps']:.0f} steps, "
                 f"{learn['step_s']:.2f} s a step (median), learner {learn['learner_step_time_s']:.3f} s; "
                 f"{learn['candidates_scored']:.0f} candidates scored for o*")
    if probe_fig:
        lines.append(f"probe ({probe_fig['parameters'] / 1e6:,.1f}M parameters, {probe_fig['dtype']} on "
                     f"{probe_fig['device']}): {probe_fig['tokens']} tokens, max |d| {probe_fig['max_abs_diff']:.2e}, "
                     f"KL k1 {probe_fig['kl_k1']:.2e}; tokens/s: generated {probe_fig['generated_tokens_per_s']:,.0f}, "
                     f"scored {probe_fig['scored_tokens_per_s']:,.0f}, forward+backward "
                     f"{probe_fig['train_tokens_per_s']:,.0f}")
    lines.append("gates:")
    for g, ok, value in judged:
        lines.append(f"  {'PASS' if ok else 'FAIL' if ok is False else 'info'}  {g:<26} {value}")
    n = sum(ok is not None for _, ok, _ in judged)
    lines.append(f"device_e2e: {'PASSED' if not failed else 'FAILED'} ({n - len(failed)} of {n} gates"
                 + (f"; failed: {', '.join(failed)})" if failed else ")"))
    print("\n".join(lines))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "device_e2e.json").write_text(json.dumps(_finite(
        {"quick": quick, "device": device, "whole_s": whole_s, "budget_s": budget_s, "parts": list(parts.values()),
         "learning": learn, "probe": probe_fig, "tests_gpu": tests, "run_dir": str(run_dir) if run_dir else None,
         "gates": [{"gate": g, "passed": ok, "value": v} for g, ok, v in judged], "passed": not failed}), indent=1))
    return 1 if failed else 0


def _finite(x):
    """`x` with NaN and infinities as None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


# -------------------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("carry-model")
    c.add_argument("carry", type=Path, nargs="?", default=Path("device-carry"))
    m = sub.add_parser("make-model")
    m.add_argument("out", type=Path)
    m.add_argument("--size", choices=sorted(SIZES), default="0.5B")
    r = sub.add_parser("probe")
    r.add_argument("--model", required=True, help="model folder for the mismatch probe")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16")
    s = sub.add_parser("summary")
    s.add_argument("out_dir", type=Path)
    s.add_argument("--run", type=Path, default=None, help="the learning run's folder")
    s.add_argument("--quick", action="store_true", help="the CPU check: judge replay, rewards, probe, tests/gpu")
    s.add_argument("--budget-s", type=float, default=240.0)
    s.add_argument("--whole-s", type=float, default=math.nan, help="seconds the whole check took so far")
    s.add_argument("--device", default="cpu", help="what ran it, in words")
    args = p.parse_args()
    if args.command == "carry-model":
        carry_model(args.carry)
        return 0
    if args.command == "make-model":
        make_model(args.out, args.size)
        return 0
    if args.command == "probe":
        return probe(args.model, args.out, args.device, args.dtype)
    return summary(args.out_dir, args.run, args.quick, args.budget_s, args.whole_s, args.device)


if __name__ == "__main__":
    sys.exit(main())
