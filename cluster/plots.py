"""End-of-run plots drawn from the tracker's metric history (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

History = dict[str, list[tuple[int, float]]]


def _series(history: History, key: str) -> tuple[list[int], list[float]]:
    pts = history.get(key, [])
    return [s for s, _ in pts], [v for _, v in pts]


def _line_plot(history: History, keys: list[str], title: str, ylabel: str, path: Path) -> Path | None:
    present = [k for k in keys if history.get(k)]
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in present:
        x, y = _series(history, k)
        ax.plot(x, y, label=k)
    ax.set_xlabel("learner step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _buckets(history: History, path: Path) -> Path | None:
    keys = sorted((k for k in history if k.startswith("buffer/bucket_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if not keys:
        return None
    steps = sorted({s for k in keys for s, _ in history[k]})
    fig, ax = plt.subplots(figsize=(7, 4))
    values = []
    for k in keys:
        d = dict(history[k])
        values.append([d.get(s, 0.0) for s in steps])
    ax.stackplot(steps, values, labels=[k.removeprefix("buffer/") for k in keys])
    ax.set_xlabel("learner step")
    ax.set_ylabel("questions")
    ax.set_title("Replay buffer: questions per accuracy bucket")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _staleness_hist(history: History, path: Path) -> Path | None:
    counts = {int(k.rsplit("_", 1)[1]): sum(v for _, v in history[k])
              for k in history if k.startswith("staleness/lag_")}
    if not counts:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    lags = sorted(counts)
    ax.bar(range(len(lags)), [counts[lag] for lag in lags])  # numeric positions: string x would be "categorical"
    ax.set_xticks(range(len(lags)), [str(lag) for lag in lags])
    ax.set_xlabel("policy versions behind the learner")
    ax.set_ylabel("rollouts trained")
    ax.set_title("Staleness of trained rollouts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_all(history: History, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        _buckets(history, out_dir / "bucket_occupancy.png"),
        _line_plot(history, ["train/reward_mean", "train/accuracy_fresh", "eval/greedy_accuracy", "eval/pass_at_1"],
                   "Reward and accuracy", "value", out_dir / "reward_accuracy.png"),
        _staleness_hist(history, out_dir / "staleness_hist.png"),
        _line_plot(history, ["learner/entropy_fresh", "learner/entropy_replayed"],
                   "Token entropy: fresh vs replayed", "nats/token", out_dir / "entropy.png"),
        _line_plot(history, ["train/response_length_mean", "train/response_length_p90", "train/response_length_max"],
                   "Response length (fresh rollouts)", "tokens", out_dir / "response_length.png"),
    ]
    return [p for p in made if p is not None]
