"""The parts of scripts/device_e2e.sh written in Python: the models, the probe, the one-screen summary.

    python bench/device_e2e.py carry-model CARRY                 # the built-in model into CARRY/models (on the host)
    python bench/device_e2e.py make-model OUT [--size 0.5B|tiny]
    python bench/device_e2e.py widen-model OUT [--hidden 512] [--cache-dir DIR]   # the real-width run's model
    python bench/device_e2e.py cache-load ARCHIVE FOLDER --note JSON              # before the real-width run
    python bench/device_e2e.py cache-save FOLDER ARCHIVE --note JSON [--max-mib 8]  # after it
    python bench/device_e2e.py probe --model MODEL --out JSON [--device cuda] [--dtype bfloat16]
    python bench/device_e2e.py summary OUT_DIR [--run RUN_DIR] [--wide-run RUN_DIR] [--quick] [--budget-s 285]

`carry-model`: the built-in countdown model (common.toy_model, the default config's) built or taken from the cache
and copied into CARRY/models/, the folder `model.cache_dir` points at on the device: the learning run trains it
there without building it (minutes of CPU) first.

`make-model`: a random-initialised Qwen2 (Qwen2.5-0.5B's layers: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, RoPE base 1e6, tied embeddings) over the built-in character tokenizer (`common.modeling.build_char_tokenizer`,
offline), saved in bfloat16. Its vocabulary is the tokenizer's (~100 rows, not 151,936: a random model samples
every row it has, and rows past the tokenizer's decode to nothing), so it has ~0.36B parameters. Kept when the
folder already holds it (a warm machine).

`widen-model`: the built-in model (built or taken from `--cache-dir`) at `--hidden` wide, answering as it does
(`widen_model`): the real-width run's model, made in seconds on the machine. `cache-load` / `cache-save`: that run's
inductor cache folder (`learner.levers.compile_cache_dir`) made fresh from the last lease's archive, and archived
for the next one (scripts/device_out.py brings it back in compile-cache.tar).

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

Gates (--quick, the CPU check, judges the first four, the real-width run's compile and recompiles, the probe's and
tests/gpu's; the rest are shown): replayed rows > 0 (mixed groups trained, their stored trajectory in the learner's
loss), mixed mode on, candidates shipped > 0, rewards > 0, reward rising (the mean of the last third of the steps
above the first third's), the first update <= 60 s after `exgrpo train` started (`driver/first_update_s`); the
real-width run's (--wide-run): compile on (on the GPU: inductor, graphs compiled by the setup's trial), replayed rows
> 0, the first update <= 60 s cold (<= 30 s from a carried inductor cache), no graph compiled after its first step;
the probe's two gates, tests/gpu passed, and the whole check within --budget-s.
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
REAL_WIDTH_CACHE = "real-width-inductor.tar.gz"  # the real-width run's inductor cache, in OUT/compile-cache/
UNSENT_FILE = "metrics-unsent.jsonl"  # cluster.tracking.UNSENT_FILE (read here without importing the project)
FIRST_UPDATE_GATE_S = 60.0
CARRIED_FIRST_UPDATE_GATE_S = 30.0  # the real-width run's, when the last lease's inductor cache was carried in
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


def widen_model(src: Path, out: Path, hidden: int = 512, noise: float = 1e-3, seed: int = 0) -> Path:
    """The built-in countdown model (a Llama, `src`) at `hidden` wide, answering as it does, saved to `out` (kept
    when there): the real-width learning run's model, made in seconds where no GPU's time pays for a build.

    Each original block sits in the top-left corner of its wider matrix (heads of 32 added, the MLP 3 x `hidden`);
    RMSNorm's weights and epsilon are scaled by `src`'s width / `hidden`, which undoes the mean over more (zero)
    dimensions, so with `noise=0` every logit is the original's. The added entries are N(0, `noise`^2) instead of
    zero, so that every weight gets a gradient (a zero block would stay zero: a 96-wide model computed at 512)
    while the answers stay the built-in model's (rewards, mixed mode and replay as in the 96-wide run)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamp = out / "device_e2e.json"
    want = {"widened": str(src.name), "hidden": hidden, "noise": noise, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"device_e2e: the built-in model at {hidden} wide kept in {out}")
        return out
    small = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    c = small.config
    h, head_dim = c.hidden_size, c.hidden_size // c.num_attention_heads
    if c.model_type != "llama" or c.num_key_value_heads != c.num_attention_heads or hidden % head_dim or hidden < h:
        raise ValueError(f"{src}: widen_model takes the built-in Llama (multi-head, heads of {head_dim}) to a width "
                         f"that is a multiple of {head_dim} and >= {h}; got {c.model_type} with "
                         f"{c.num_key_value_heads} KV heads, hidden {hidden}")
    wide_cfg = type(c).from_dict({**c.to_dict(), "hidden_size": hidden, "intermediate_size": 3 * hidden,
                                  "num_attention_heads": hidden // head_dim, "num_key_value_heads": hidden // head_dim,
                                  "head_dim": head_dim, "rms_norm_eps": c.rms_norm_eps * h / hidden})
    torch.manual_seed(seed)
    wide = AutoModelForCausalLM.from_config(wide_cfg, dtype=torch.float32)
    scale = math.sqrt(h / hidden)  # RMS over `hidden` dims of a vector nonzero in `h` of them: sqrt(h/hidden) x
    small_params = dict(small.named_parameters())
    with torch.no_grad():
        for name, w in wide.named_parameters():
            old = small_params[name]
            if name.endswith("norm.weight"):  # [hidden]
                w.fill_(scale)
                w[:h] = old * scale
            else:  # [out, in] (embeddings: [vocabulary, hidden]): the original in the top-left corner
                w.normal_(0.0, noise)
                w[tuple(slice(0, n) for n in old.shape)] = old
    out.mkdir(parents=True, exist_ok=True)
    wide.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    stamp.write_text(json.dumps(want))
    n = sum(p.numel() for p in wide.parameters())
    print(f"device_e2e: the built-in model ({h} wide) widened to {hidden} ({wide_cfg.num_attention_heads} heads, "
          f"MLP {3 * hidden}, added weights N(0, {noise:g}^2)): {n / 1e6:.1f}M parameters in {out}")
    return out


def cache_load(archive: Path, folder: Path) -> dict:
    """`folder` (the real-width run's `learner.levers.compile_cache_dir`) made fresh, holding what `archive` (the
    last lease's `cache_save`, brought back by scripts/device_out.py and carried) holds: a run with it is warm, one
    without it cold, whatever an earlier call on a warm machine left. {"carried", "files", "bytes"}."""
    import tarfile

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if not archive.is_file():
        return {"carried": False, "files": 0, "bytes": 0}
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:  # cut short or not ours: the run compiles cold, and says so
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return {"carried": False, "files": 0, "bytes": 0, "refused": f"{archive.name}: {type(e).__name__}: {e}"}
    files = [f for f in folder.rglob("*") if f.is_file()]
    return {"carried": True, "files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def cache_save(folder: Path, archive: Path, max_mib: float) -> dict:
    """`folder`'s files (inductor's on-disk cache: FX graphs, AOTAutograd entries, kernels) into `archive`
    (tar.gz), unless it comes to more than `max_mib` (what the next call can carry beside the rest; then no
    archive, and the next lease compiles cold). {"files", "bytes" (the archive's), "left_out" (why, or "")}."""
    import tarfile

    files = sorted(f for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else []
    if not files:
        return {"files": 0, "bytes": 0, "left_out": "nothing compiled"}
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(folder)))
    size = tmp.stat().st_size
    if size > max_mib * 2**20:
        tmp.unlink()
        return {"files": len(files), "bytes": size, "left_out": f"{size / 2**20:.1f} MiB gzip'd, over {max_mib:g}"}
    tmp.replace(archive)
    return {"files": len(files), "bytes": size, "left_out": ""}


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
                 "learner/step_time_s", "learner/recompiles")


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


TRIAL_LINE = re.compile(r"the trial compiled (\d+) graph\(s\) in ([\d.]+) s")
LEVERS_LINE = re.compile(r"learner levers on (\S+): compile (on|off) \(([^)]*)\)"
                         r"(?:: each decoder layer, backend ([\w.-]+))?")


def compile_figures(run_dir: Path | None) -> dict:
    """Whether the run's learner compiled, read from its rank's start line (`learner.setup`: "learner levers on cpu:
    compile on (set): each decoder layer, backend inductor, ...; the trial compiled 4 graph(s) in 72.7 s") in the
    run folder's Ray logs, and from state.json's `levers_off` (a compile that failed its trial trains eager)."""
    fig = {"compile_on": False, "compile_backend": "", "compile_device": "", "compile_why": "no learner start line",
           "trial_graphs": math.nan, "trial_s": math.nan}
    logs = sorted((run_dir / "logs").rglob("*.err")) if run_dir is not None and (run_dir / "logs").is_dir() else []
    for log in logs:
        text = log.read_text(errors="replace")
        levers = LEVERS_LINE.search(text)
        if levers is None:
            continue
        fig.update(compile_device=levers[1], compile_on=levers[2] == "on", compile_why=levers[3],
                   compile_backend=levers[4] or "")
        trial = TRIAL_LINE.search(text)
        if trial is not None:
            fig.update(trial_graphs=float(trial[1]), trial_s=float(trial[2]))
        break
    state = run_dir / "state.json" if run_dir is not None else None
    off = (json.loads(state.read_text()).get("levers_off") or {}) if state is not None and state.is_file() else {}
    if "compile" in off:
        fig.update(compile_on=False, compile_why=f"failed its trial at setup: {off['compile']}")
    return fig


def real_width_figures(run_dir: Path | None, out_dir: Path) -> dict:
    """The real-width run: its learning figures, its width (the model's config.json), recompiles after its first
    step (`learner/recompiles`: graphs compiled during a step, after the trial compiled the run's graphs), whether
    it compiled, and the inductor cache it started from and saved (real-width-cache-{in,out}.json of `cache_load`
    and `cache_save`). The first update falls back to the run's profile.json (`first_update_s`)."""
    series = read_points(run_dir)
    fig: dict = learning_figures(series)
    if not math.isfinite(fig["first_update_s"]) and run_dir is not None and (run_dir / "profile.json").is_file():
        fig["first_update_s"] = json.loads((run_dir / "profile.json").read_text()).get("first_update_s") or math.nan
    recompiles = series.get("learner/recompiles", [])
    fig["recompiles_first_step"] = recompiles[0][1] if recompiles else math.nan
    fig["recompiles_after_first_step"] = float(sum(v for _, v in recompiles[1:])) if len(recompiles) > 1 else math.nan
    fig["hidden_size"] = math.nan
    config = run_dir / "config.yaml" if run_dir is not None else None
    if config is not None and config.is_file():
        import yaml

        model = Path(str((yaml.safe_load(config.read_text()).get("model") or {}).get("path")))
        if (model / "config.json").is_file():
            fig["hidden_size"] = float(json.loads((model / "config.json").read_text())["hidden_size"])
    fig.update(compile_figures(run_dir))
    for side in ("in", "out"):
        note = out_dir / f"real-width-cache-{side}.json"
        fig[f"cache_{side}"] = json.loads(note.read_text()) if note.is_file() else {}
    return fig


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


def _fin(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def compile_words(wide: dict, quick: bool) -> str:
    """What the real-width run's learner compiled, said plainly (a CPU run without inductor says so)."""
    if not wide["compile_on"]:
        return f"compile off ({wide['compile_why']})"
    words = f"compile on ({wide['compile_backend'] or '?'} on {wide['compile_device'] or '?'})"
    if _fin(wide["trial_graphs"]):
        words += f": the trial compiled {wide['trial_graphs']:.0f} graph(s) in {wide['trial_s']:.1f} s"
    if quick and wide["compile_backend"] != "inductor":
        words += ("; inductor NOT exercised: this backend traces (dynamo, AOTAutograd) and generates no kernels, "
                  "and no inductor cache is saved")
    return words


def real_width_gates(quick: bool, parts: dict[str, dict], wide: dict) -> list[tuple[str, bool | None, str]]:
    """The real-width run's gates: compile on (on the GPU: inductor, graphs compiled by the trial), replayed rows
    and the first update (judged on the GPU: <= 60 s cold, <= 30 s from a carried inductor cache), no graph
    compiled after the first step."""
    status = part_status(parts.get("real-width run"))
    run_note = "" if status == "ok" else f" ({status})"
    carried = bool(wide["cache_in"].get("carried"))
    limit = CARRIED_FIRST_UPDATE_GATE_S if carried else FIRST_UPDATE_GATE_S
    first, after = wide["first_update_s"], wide["recompiles_after_first_step"]
    inductor = wide["compile_on"] and wide["compile_backend"] == "inductor" and wide["trial_graphs"] > 0
    mixed = (f"mixed mode from step {wide['mixed_from_step']:.0f}" if wide["mixed_mode"] > 0 else "mixed mode never on")
    return [
        ("real-width compile on", wide["compile_on"] if quick else inductor, compile_words(wide, quick) + run_note),
        ("real-width replayed rows > 0", None if quick else wide["replayed_rows"] > 0 and wide["replayed_tokens"] > 0,
         f"{wide['replayed_rows']:.0f} rows, {wide['replayed_tokens']:,.0f} tokens; {mixed}{run_note}"),
        (f"real-width first update <= {limit:.0f} s", None if quick else _fin(first) and first <= limit,
         (f"{first:.1f} s after exgrpo train started" if _fin(first) else "-")
         + f", {'carried' if carried else 'cold'} inductor cache{run_note}"),
        ("real-width recompiles after step 1 = 0", _fin(after) and after == 0,
         f"{after:.0f} over steps 2-{wide['steps']:.0f} (step 1: {wide['recompiles_first_step']:.0f})" if _fin(after)
         else f"- (needs 2 steps; {wide['steps']:.0f} logged){run_note}"),
    ]


def gates(quick: bool, parts: dict[str, dict], learn: dict, probe_fig: dict, whole_s: float,
          budget_s: float, tests: str, wide: dict | None = None) -> list[tuple[str, bool | None, str]]:
    """(gate, passed (None: shown, not judged), value) in the summary's order."""
    fin = _fin
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
        *(real_width_gates(quick, parts, wide) if wide is not None else []),
        (f"probe median exp|d| < {MEDIAN_EXP_GATE}", fin(med) and med < MEDIAN_EXP_GATE,
         f"{med:.5f}" if fin(med) else part_status(parts.get("mismatch probe"))),
        (f"probe KL < {KL_GATE:g}", fin(kl) and kl < KL_GATE, f"{kl:.2e}" if fin(kl) else
         part_status(parts.get("mismatch probe"))),
        # on the GPU some must have run: all skipped means CUDA was not there (--quick: skipped is the CPU's pass)
        ("tests/gpu passed", part_status(parts.get("tests/gpu")) == "ok" and (quick or " passed" in f" {tests}"),
         f"{tests or '-'} ({part_status(parts.get('tests/gpu'))})"),
        (f"whole check <= {budget_s:.0f} s", None if quick else whole_s <= budget_s, f"{whole_s:.0f} s"),
    ]


def summary(out_dir: Path, run_dir: Path | None, quick: bool, budget_s: float, whole_s: float, device: str,
            wide_run: Path | None = None) -> int:
    parts = {p["name"]: p for p in read_parts(out_dir)}
    learn = learning_figures(read_points(run_dir))
    wide = real_width_figures(wide_run, out_dir)
    probe_path = out_dir / "probe.json"
    probe_fig = json.loads(probe_path.read_text()) if probe_path.is_file() else {}
    tests = pytest_outcome(out_dir / "pytest-gpu.log")
    judged = gates(quick, parts, learn, probe_fig, whole_s, budget_s, tests, wide)
    failed = [g for g, ok, _ in judged if ok is False]
    lines = [f"device_e2e summary{' (--quick)' if quick else ''}: {device}, {whole_s:.0f} s of a {budget_s:.0f} s budget",
             f"  {'part':<18} {'status':<12} {'seconds':>8} {'budget':>7}  note"]
    for p in parts.values():
        budget = f"{p['budget']:.0f}" if p["budget"] else "-"
        lines.append(f"  {p['name']:<18} {part_status(p):<12} {p['seconds']:>8.1f} {budget:>7}  {p['note']}")
    lines.append(f"learning run ({run_dir.name if run_dir else '-'}): {learn['steps']:.0f} steps, "
                 f"{learn['step_s']:.2f} s a step (median), learner {learn['learner_step_time_s']:.3f} s; "
                 f"{learn['candidates_scored']:.0f} candidates scored for o*")
    cache_in, cache_out = wide["cache_in"], wide["cache_out"]
    loaded = (f"carried ({cache_in['files']} files, {cache_in['bytes'] / 1e6:.1f} MB)" if cache_in.get("carried")
              else "cold")
    saved = (f"{cache_out['files']} files saved ({cache_out['bytes'] / 1e6:.1f} MB gzip'd, "
             f"compile-cache/{REAL_WIDTH_CACHE})" if cache_out.get("files") and not cache_out.get("left_out") else
             f"not saved ({cache_out.get('left_out') or 'no note'})")
    lines.append(f"real-width run ({wide_run.name if wide_run else '-'}): {wide['hidden_size']:.0f} wide, "
                 f"{wide['steps']:.0f} steps, {wide['step_s']:.2f} s a step (median), learner "
                 f"{wide['learner_step_time_s']:.3f} s; inductor cache {loaded}, {saved}")
    if probe_fig:
        lines.append(f"probe ({probe_fig['parameters'] / 1e6:,.1f}M parameters, {probe_fig['dtype']} on "
                     f"{probe_fig['device']}): {probe_fig['tokens']} tokens, max |d| {probe_fig['max_abs_diff']:.2e}, "
                     f"KL k1 {probe_fig['kl_k1']:.2e}; tokens/s: generated {probe_fig['generated_tokens_per_s']:,.0f}, "
                     f"scored {probe_fig['scored_tokens_per_s']:,.0f}, forward+backward "
                     f"{probe_fig['train_tokens_per_s']:,.0f}")
    lines.append("gates:")
    width = max(len(g) for g, _, _ in judged)
    for g, ok, value in judged:
        lines.append(f"  {'PASS' if ok else 'FAIL' if ok is False else 'info'}  {g:<{width}} {value}")
    n = sum(ok is not None for _, ok, _ in judged)
    lines.append(f"device_e2e: {'PASSED' if not failed else 'FAILED'} ({n - len(failed)} of {n} gates"
                 + (f"; failed: {', '.join(failed)})" if failed else ")"))
    print("\n".join(lines))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "device_e2e.json").write_text(json.dumps(_finite(
        {"quick": quick, "device": device, "whole_s": whole_s, "budget_s": budget_s, "parts": list(parts.values()),
         "learning": learn, "real_width": wide, "probe": probe_fig, "tests_gpu": tests,
         "run_dir": str(run_dir) if run_dir else None, "wide_run_dir": str(wide_run) if wide_run else None,
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
    w = sub.add_parser("widen-model")
    w.add_argument("out", type=Path)
    w.add_argument("--hidden", type=int, default=512)
    w.add_argument("--cache-dir", default=None, help="model.cache_dir of the built-in model (default: the config's)")
    for verb in ("cache-load", "cache-save"):
        k = sub.add_parser(verb)
        k.add_argument("archive" if verb == "cache-load" else "folder", type=Path)
        k.add_argument("folder" if verb == "cache-load" else "archive", type=Path)
        k.add_argument("--note", type=Path, required=True, help="JSON: what was loaded / saved (the summary reads it)")
        if verb == "cache-save":
            k.add_argument("--max-mib", type=float, default=8.0)
    r = sub.add_parser("probe")
    r.add_argument("--model", required=True, help="model folder for the mismatch probe")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16")
    s = sub.add_parser("summary")
    s.add_argument("out_dir", type=Path)
    s.add_argument("--run", type=Path, default=None, help="the learning run's folder")
    s.add_argument("--wide-run", type=Path, default=None, help="the real-width run's folder")
    s.add_argument("--quick", action="store_true", help="the CPU check: judge replay, rewards, probe, tests/gpu")
    s.add_argument("--budget-s", type=float, default=285.0)
    s.add_argument("--whole-s", type=float, default=math.nan, help="seconds the whole check took so far")
    s.add_argument("--device", default="cpu", help="what ran it, in words")
    args = p.parse_args()
    if args.command == "carry-model":
        carry_model(args.carry)
        return 0
    if args.command == "make-model":
        make_model(args.out, args.size)
        return 0
    if args.command == "widen-model":
        from common.config import RunConfig
        from common.toy_model import ensure_toy_model

        cfg = RunConfig()
        model = cfg.model if args.cache_dir is None else cfg.model.model_copy(update={"cache_dir": args.cache_dir})
        widen_model(ensure_toy_model(model, cfg.data, verbose=True), args.out, args.hidden)
        return 0
    if args.command in ("cache-load", "cache-save"):
        note = (cache_load(args.archive, args.folder) if args.command == "cache-load" else
                cache_save(args.folder, args.archive, args.max_mib))
        args.note.write_text(json.dumps(note))
        print(f"device_e2e: {args.command}: {json.dumps(note)}")
        return 0
    if args.command == "probe":
        return probe(args.model, args.out, args.device, args.dtype)
    return summary(args.out_dir, args.run, args.quick, args.budget_s, args.whole_s, args.device, args.wide_run)


if __name__ == "__main__":
    sys.exit(main())
