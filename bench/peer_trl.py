"""Peer comparison: TRL's GRPOTrainer against `exgrpo train`, same model, data, reward and settings.

    .venv/bin/python bench/peer_trl.py [--steps 60] [--quick] [--repeat 1] [--trl-python PATH]
                                       [--rows trl,grpo,exgrpo] [--eval-limit N]

Rows (each a fresh subprocess, one after the other):
- `trl`: TRL's `GRPOTrainer` (transformers generation, one process) run by `--trl-python`;
- `grpo`: `exgrpo train buffer.replay_ratio=0 buffer.collect=false` (plain on-policy GRPO);
- `exgrpo`: `exgrpo train` with the ExGRPO defaults (replay ratio 0.5, max_lag 1);
- `exgrpo-vllm` (not in the default rows): ExGRPO with `generator.engine.kind=vllm` (the built-in model is
  below `cpu_vllm_min_params`, so `auto` picks the transformers engine on CPU).

Same for every row: the built-in countdown model (`exgrpo toy-model`, a local Hugging Face folder with its
tokenizer) and its 2,000 training questions, prompts encoded as `common.data.encode_prompt` does (BOS +
question; TRL gets the text `<s>` + question, checked to give the same ids), the countdown verifier
through our `RewardPool`, `--steps` optimizer steps of 16 questions x 8 samples, 24 new tokens,
temperature 1, top_p 1, AdamW lr 1e-4 (constant, weight decay 0.01, betas 0.9/0.999), gradient clip 1.0,
no KL (TRL beta=0), clip 0.2, entropy bonus 0.001, advantages not divided by the group's std
(TRL scale_rewards="none"), token-mean loss over the batch (TRL loss_type="dapo"), float32, seed 0.

Columns:
- whole command s: wall time of the subprocess (imports, start-up, training, saving the final model);
- training loop s: end of the first optimizer step to the end of the last (TRL: a trainer callback;
  ours: the MLflow timestamps of `policy/version`), so both leave out start-up and the first batch;
- completions/s: completions trained in those steps (TRL: 128 a step; ours: `train/groups` x 8, replayed
  trajectories included) / training loop s;
- held-out pass@1: `exgrpo eval --model <final model>` (200 test questions x 8 samples at T=0.6), the
  same command for every row; the starting model's is printed under the table;
- peak memory: the largest sum of RSS over the process and all its descendants (Ray's raylet, GCS and
  actors included), sampled every 0.2 s; shared pages count once per process;
- peak PSS: the same sum of PSS (proportional set size: a page shared by n processes counts 1/n in each,
  so shared libraries such as torch's count once over the tree) — the memory the tree actually holds.

TRL is not a dependency of this project and this script installs nothing. It runs TRL with a separate
interpreter, a venv beside the checkout holding TRL, the torch and transformers builds of `.venv` (same
versions, so the same kernels and tokenizer code) and what `common/` imports (pydantic, msgpack, pyyaml);
vLLM is left out, as in a CPU install of TRL (TRL imports vLLM at start when it is installed):

    python3.11 -m venv ../trl-venv          # the Python that made .venv
    ../trl-venv/bin/pip install trl==1.16.0 torch==2.13.0+cpu transformers==5.19.0 pydantic msgpack pyyaml
    .venv/bin/python bench/peer_trl.py --trl-python ../trl-venv/bin/python

(`pip` takes torch from the local wheel the project's setup uses; about 1 minute and 1.5 GB.)
Without it (or when it cannot import trl) the script prints these lines and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRL_PYTHON = ROOT.parent / "trl-venv" / "bin" / "python"

QUESTIONS, SAMPLES, MAX_NEW_TOKENS, LR, TEMPERATURE, ENTROPY_COEF = 16, 8, 24, 1e-4, 1.0, 0.001
"""The shared settings (our defaults, written out so that a change of a default cannot skew the comparison)."""

OURS_COMMON = [f"buffer.batch_questions={QUESTIONS}", f"buffer.group_size={SAMPLES}",
               f"generator.max_new_tokens={MAX_NEW_TOKENS}", f"generator.temperature={TEMPERATURE}",
               "generator.top_p=1.0", f"learner.optim.lr={LR}", "learner.loss.kl_coef=0.0", f"learner.loss.entropy_coef={ENTROPY_COEF}",
               "learner.loss.std_normalize=false", "learner.loss.loss_agg=token_mean", "learner.optim.weight_decay=0.01",
               "learner.optim.grad_clip=1.0", "learner.loss.policy_loss.clip_low=0.2", "learner.loss.policy_loss.clip_high=0.2", "learner.batching.mini_batches=1",
               "model.dtype=float32", "checkpoint.every_steps=0", "eval.every_steps=0", "tracking.log_plots=false"]
OURS_ROWS = {
    "grpo": ("exgrpo train, plain GRPO (replay_ratio=0 collect=false)",
             ["buffer.replay_ratio=0", "buffer.collect=false"]),
    "exgrpo": ("exgrpo train, ExGRPO defaults", []),
    "exgrpo-vllm": ("exgrpo train, ExGRPO defaults, vLLM engine", ["generator.engine.kind=vllm"]),
}
TRL_LABEL = "TRL GRPOTrainer"
SAMPLE_EVERY_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of every row")
    p.add_argument("--quick", action="store_true", help="smoke test: 5 steps, pass@1 on 32 questions")
    p.add_argument("--repeat", type=int, default=1, help="runs per row (seeds 0..N-1); mean ± sd")
    p.add_argument("--rows", default="trl,grpo,exgrpo", help=f"comma list of trl,{','.join(OURS_ROWS)}")
    p.add_argument("--eval-limit", type=int, default=None, help="evaluate on at most this many test questions")
    p.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON,
                   help=f"a python that imports trl and this project's dependencies (default {DEFAULT_TRL_PYTHON})")
    p.add_argument("--trl-child", type=Path, metavar="OUT", help=argparse.SUPPRESS)  # run by --trl-python
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.trl_python = args.trl_python.expanduser().absolute()  # not resolve(): a venv's python is a symlink
    if args.quick:
        args.steps, args.eval_limit = 5, args.eval_limit or 32
    unknown = set(args.rows.split(",")) - {"trl", *OURS_ROWS}
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}: use trl,{','.join(OURS_ROWS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_child is not None:
        trl_child(args.trl_child, args.model, args.steps, args.seed)
        return 0
    rows = args.rows.split(",")
    trl_version = check_trl(args.trl_python) if "trl" in rows else None
    sys.path.insert(0, str(ROOT))
    from common.config import DataConfig, ModelConfig
    from common.toy_model import ensure_toy_model

    model = ensure_toy_model(ModelConfig(), DataConfig(), verbose=True)
    start_pass1 = eval_pass1(model, args.eval_limit)
    work = Path(tempfile.mkdtemp(prefix="peer-trl-"))
    try:
        results = {row: [run_row(row, work / f"{row}-{seed}", model, args, seed) for seed in range(args.repeat)]
                   for row in rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"$ {shlex.join(['python', *sys.argv])}")
    print(f"({args.steps} steps x {QUESTIONS} questions x {SAMPLES} samples, {MAX_NEW_TOKENS} new tokens, lr {LR:g}, "
          f"no KL, T={TEMPERATURE:g}; built-in countdown model {model.name}, starting held-out pass@1 "
          f"{start_pass1:.3f}; {'trl ' + trl_version if trl_version else 'no TRL row'}; "
          f"{args.repeat} run(s) a row, {os.cpu_count()} CPUs)")
    print(table(results))
    return 0


# ------------------------------------------------------------------------------------------- TRL side

def check_trl(python: Path) -> str:
    """TRL's version under `python`, or exit 2 with the lines that create such an interpreter."""
    probe = "import trl, transformers, common.rewards; print(trl.__version__)"
    try:
        out = subprocess.run([str(python), "-c", probe], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    except OSError as e:
        why = f"{python}: {e.strerror}"
    else:
        if out.returncode == 0:
            return out.stdout.strip()
        why = (out.stderr.strip().splitlines() or ["exit code %d" % out.returncode])[-1]
    print(f"TRL is not usable with --trl-python {python} ({why}).\n{venv_help()}", file=sys.stderr)
    raise SystemExit(2)


def venv_help() -> str:
    """The commands that make a TRL interpreter matching .venv, where --trl-python looks by default."""
    from importlib.metadata import version

    venv = DEFAULT_TRL_PYTHON.parent.parent
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    pins = " ".join(f"{p}=={version(p)}" for p in ("torch", "transformers"))
    return ("TRL stays out of the project's install; create a separate venv for it:\n"
            f"  {base} -m venv {venv}\n"
            f"  {venv}/bin/pip install trl==1.16.0 {pins} pydantic msgpack pyyaml\n"
            f"then: {sys.executable} {Path(__file__).relative_to(ROOT)} --trl-python {venv}/bin/python")


def trl_child(out: Path, model: str, steps: int, seed: int) -> None:
    """Inside --trl-python: GRPOTrainer on our model, questions and verifier; writes out/model and out/trl.json."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from common.config import DataConfig, RewardConfig
    from common.data import load_questions
    from common.rewards import RewardPool, ScoreRequest

    tok = AutoTokenizer.from_pretrained(model)
    questions, _ = load_questions(DataConfig(), tok, "train")
    rows = [{"prompt": tok.bos_token + q.prompt, "answer": q.answer, "qid": q.id} for q in questions]
    for q, row in zip(questions, rows):  # TRL encodes prompt text as tok(text); this tokenizer adds no BOS itself
        if tok(text=row["prompt"], add_special_tokens=True)["input_ids"] != q.prompt_ids.tolist():
            raise SystemExit(f"TRL's prompt ids differ from ours for {row['prompt']!r}")
    pool = RewardPool(RewardConfig(name="countdown"), "countdown")

    def countdown(prompts, completions, answer, qid, **_) -> list[float]:
        reqs = [ScoreRequest(i, c, a) for i, c, a in zip(qid, completions, answer)]
        return [r.reward for r in pool.score(reqs)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.monotonic())

    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=countdown, args=trl_config(out, steps, seed),
                              train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[clock])
    trainer.train()
    trainer.save_model(str(out / "model"))
    pool.close()
    ends = clock.ends
    trained = (len(ends) - 1) * QUESTIONS * SAMPLES  # steps 2..N
    (out / "trl.json").write_text(json.dumps({"loop_s": ends[-1] - ends[0], "trained": trained}))


def trl_config(out: Path, steps: int, seed: int):
    """GRPOConfig with our settings (TRL's own defaults differ: bf16, linear decay, lr 1e-6, std scaling)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=steps, seed=seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=QUESTIONS * SAMPLES, gradient_accumulation_steps=1, num_generations=SAMPLES,
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, entropy_coef=ENTROPY_COEF, scale_rewards="none", loss_type="dapo",
        gradient_checkpointing=False, save_strategy="no", report_to="none", logging_steps=10, disable_tqdm=True,
    )


def run_trl(work: Path, model: Path, args: argparse.Namespace, seed: int) -> dict:
    cmd = [str(args.trl_python), str(Path(__file__).resolve()), "--trl-child", str(work), "--model", str(model),
           "--steps", str(args.steps), "--seed", str(seed)]
    wall, peak, pss = run_measured(cmd, work)
    loop = json.loads((work / "trl.json").read_text())
    return {"whole_s": wall, "loop_s": loop["loop_s"], "completions_s": loop["trained"] / loop["loop_s"],
            "pass1": eval_pass1(work / "model", args.eval_limit), "peak_mib": peak, "pss_mib": pss}


# ------------------------------------------------------------------------------------------- our side

def run_ours(row: str, work: Path, args: argparse.Namespace, seed: int) -> dict:
    seeds = [f"{k}={seed}" for k in ("seed", "generator.seed", "buffer.seed", "learner.seed")]
    cmd = [sys.executable, "-m", "cluster.cli", "train", "name=peer", f"checkpoint.runs_root={work}",
           f"total_steps={args.steps}", *OURS_COMMON, *seeds, *OURS_ROWS[row][1]]
    wall, peak, pss = run_measured(cmd, work)
    state = json.loads((work / "peer" / "state.json").read_text())
    loop_s, trained = loop_from_mlflow(work, state["mlflow_run_id"])
    final = work / "peer" / state["checkpoints"][-1] / "learner" / "model"  # relative to the run folder
    return {"whole_s": wall, "loop_s": loop_s, "completions_s": trained / loop_s,
            "pass1": eval_pass1(final, args.eval_limit), "peak_mib": peak, "pss_mib": pss}


def loop_from_mlflow(runs_root: Path, run_id: str) -> tuple[float, float]:
    """(end of step 1 to end of the last step in s, completions trained in steps 2..N)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs_root / 'mlflow.db'}")
    ends = sorted(client.get_metric_history(run_id, "policy/version"), key=lambda m: m.step)
    groups = sorted(client.get_metric_history(run_id, "train/groups"), key=lambda m: m.step)
    return (ends[-1].timestamp - ends[0].timestamp) / 1000, SAMPLES * sum(m.value for m in groups[1:])


# --------------------------------------------------------------------------------------------- shared

def run_row(row: str, work: Path, model: Path, args: argparse.Namespace, seed: int) -> dict:
    work.mkdir(parents=True)
    print(f"  running {row} (seed {seed}, {args.steps} steps) ...", file=sys.stderr, flush=True)
    result = run_trl(work, model, args, seed) if row == "trl" else run_ours(row, work, args, seed)
    print(f"  {row}: {result}", file=sys.stderr, flush=True)
    return result


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error"}


def run_measured(cmd: list[str], work: Path) -> tuple[float, float, float]:
    """Run `cmd` to the end: (wall s, peak MiB of RSS and of PSS summed over it and its descendants). Exits on
    failure."""
    import psutil

    log = work / "command.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
        peak = peak_pss = 0
        while proc.poll() is None:
            rss, pss = tree_memory(psutil.Process(proc.pid))
            peak, peak_pss = max(peak, rss), max(peak_pss, pss)
            time.sleep(SAMPLE_EVERY_S)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return wall, peak / 2**20, peak_pss / 2**20


def tree_memory(root) -> tuple[int, int]:
    """(RSS, PSS) bytes of `root` and its descendants (processes that end while being read count 0)."""
    import psutil

    rss = pss = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for p in procs:
        try:
            m = p.memory_full_info()  # reads smaps: PSS needs it
            rss, pss = rss + m.rss, pss + m.pss
        except psutil.NoSuchProcess:
            pass  # ended between listing and reading: it holds no memory any more
    return rss, pss


def eval_pass1(model: Path, limit: int | None) -> float:
    """Held-out pass@1 of a model folder by `exgrpo eval` (defaults: 8 samples at T=0.6), not logged to MLflow."""
    cmd = [sys.executable, "-m", "cluster.cli", "eval", "--model", str(model),
           *(["--limit", str(limit)] if limit else []), "tracking.enabled=false"]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("pass@1 (")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{shlex.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(lines[0].split()[-1])


def table(results: dict[str, list[dict]]) -> str:
    cols = [("whole_s", "whole command s", "{:.1f}"), ("loop_s", "training loop s", "{:.1f}"),
            ("completions_s", "completions/s", "{:.0f}"), ("pass1", "held-out pass@1 after", "{:.3f}"),
            ("peak_mib", "peak memory MiB", "{:.0f}"), ("pss_mib", "peak PSS MiB", "{:.0f}")]
    lines = ["| system | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for row, runs in results.items():
        label = TRL_LABEL if row == "trl" else OURS_ROWS[row][0]
        lines.append(f"| {label} | " + " | ".join(cell([r[k] for r in runs], f) for k, _, f in cols) + " |")
    return "\n".join(lines)


def cell(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


if __name__ == "__main__":
    sys.exit(main())
