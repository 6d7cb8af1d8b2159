"""The built-in model: a tiny Llama trained briefly (supervised) on the built-in task, offline.

`ensure_toy_model(model_cfg, data_cfg)` returns a Hugging Face folder (config, safetensors, tokenizer)
cached under `model_cfg.cache_dir` in a folder named by a hash of everything that changes
the result (task, data seed and sizes, toy model settings, recipe version). A second call is
instant; a build writes into a temporary folder and renames it into place, so a crash never leaves a
half-written model where a later call would pick it up.

The recipe (data, tokenizer, which checkpoint is kept, when it stops): docs/internals.md#commontoy_modelpy
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.config import DataConfig, ModelConfig, ToyModelConfig

if TYPE_CHECKING:  # torch is imported by the build's functions: a cached model is found without it
    import torch

RECIPE_VERSION = 3
"""Bump when the training recipe or a built-in task's generator changes so cached models are rebuilt."""
CHAT_RECIPE_VERSION = 1
"""Also in the cache key of chat tasks' models (their tokenizer and format): bump when those change."""
BPE_VOCAB_SIZE = 320
"""Vocabulary of a chat task's BPE tokenizer (bytes, specials and the merges the corpus offers, at most)."""
NEW_SETTINGS = ("architecture", "vocab_rows", "max_positions")
"""Settings added after models were cached: in the cache key only when changed from their defaults."""
PADDED_MASS = 1e-6
"""The padded vocabulary rows get at most this much probability in total on the build's probe tokens."""
INFO_FILE = "exgrpo_toy.json"
"""Written last into a finished folder: the build's settings and measured spread."""


@dataclass(frozen=True)
class Policy:
    """A model answering a task's questions: the model, its tokenizer, the task (its prompts' format and its
    verifier) and the tokens a sampled answer may take."""

    model: Any
    tok: Any
    task: Any
    max_new_tokens: int = 12


@dataclass
class Spread:
    """Sampled accuracy (temperature 1) of a model over questions, `samples` rollouts each."""

    mean: float
    always: float  # fraction of questions right in every sample
    partly: float  # fraction right in some but not all samples
    never: float  # fraction never right
    questions: int
    samples: int

    def line(self) -> str:
        return (f"mean accuracy {self.mean:.3f} over {self.questions} questions x {self.samples} samples: "
                f"always right {self.always:.0%}, partly {self.partly:.0%}, never {self.never:.0%}")


def ensure_toy_model(model_cfg: ModelConfig, data_cfg: DataConfig, force: bool = False, verbose: bool = False) -> Path:
    """The cached built-in model folder for this task and settings, built (minutes) when absent or `force`."""
    if data_cfg.task is None:
        raise ValueError("the built-in model is trained on a built-in task: set data.task, or set model.path "
                         "to your own model folder")
    folder = Path(model_cfg.cache_dir).expanduser() / f"toy-{data_cfg.task}-{cache_key(model_cfg.toy, data_cfg)}"
    if (folder / INFO_FILE).is_file() and not force:
        if verbose:
            info = json.loads((folder / INFO_FILE).read_text())
            print(f"built-in model (cached): {folder}\n  train {Spread(**info['train_spread']).line()}\n"
                  f"  test  {Spread(**info['test_spread']).line()}")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        info = build_toy_model(model_cfg.toy, data_cfg, tmp, verbose=verbose)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
        if folder.exists() and not (folder / INFO_FILE).is_file() and any(folder.iterdir()):
            raise ValueError(f"{folder} is in the way of the built-in model's cache and is not one (no {INFO_FILE}): "
                             "move it, or set model.cache_dir to another folder")
        if folder.exists() and (force or not (folder / INFO_FILE).is_file()):
            shutil.rmtree(folder)  # a built-in model of ours (its INFO_FILE says so), or an empty folder
        if not folder.exists():  # else another process finished the same build first: keep its folder
            os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"built-in model saved to {folder}")
    return folder


def cache_key(toy: ToyModelConfig, data_cfg: DataConfig) -> str:
    """16 hex chars of blake2b over the settings that change the built model (not `threads`)."""
    toy_settings = toy.model_dump(mode="json", exclude={"threads"})
    for name in NEW_SETTINGS:  # at their defaults they leave the key (and every cached model) as it was
        if toy_settings[name] == ToyModelConfig.model_fields[name].default:
            del toy_settings[name]
    relevant = {"recipe": RECIPE_VERSION, "toy": toy_settings, "task": data_cfg.task,
                "seed": data_cfg.seed, "num_train": data_cfg.num_train, "num_test": data_cfg.num_test}
    if _is_chat_task(data_cfg.task):  # only there: the keys of the character-level models stay as they were
        relevant["chat_recipe"] = CHAT_RECIPE_VERSION
    return hashlib.blake2b(json.dumps(relevant, sort_keys=True).encode(), digest_size=8).hexdigest()


# --------------------------------------------------------------------------------------------- build


def build_toy_model(toy: ToyModelConfig, data_cfg: DataConfig, out: Path, *, verbose: bool = False) -> dict:
    """Train and save the model into `out`; return the info dict (settings, steps, measured spreads)."""
    import torch
    from common.modeling import TinyLlama, TinyQwen2, save_model_folder
    from common.tasks import get_task

    threads = torch.get_num_threads()
    torch.set_num_threads(toy.threads)
    try:
        start = time.monotonic()
        task = get_task(data_cfg.task)
        n_supervised = max(data_cfg.num_train, toy.supervised_questions)
        supervised, test_rows = task.generate(data_cfg.seed, n_supervised, data_cfg.num_test)
        train_rows = supervised[: data_cfg.num_train]  # the RL training split (a prefix: same stream)
        tok = _tokenizer(task, supervised)
        sizes = dict(vocab_size=len(tok), hidden_size=toy.hidden_size, num_layers=toy.num_layers,
                     num_heads=toy.num_heads, max_positions=toy.max_positions, seed=toy.seed,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        tiny = TinyQwen2(num_kv_heads=1, **sizes) if toy.architecture == "qwen2" else TinyLlama(**sizes)
        model = tiny.build()
        examples = _examples(task, supervised, tok)
        probe = random.Random(toy.seed).sample(train_rows, min(toy.probe_questions, len(train_rows)))
        budget = max(12, max(len(r) for _, rs in examples for r in rs) + 4)
        policy = Policy(model, tok, task, budget)
        best_state, best, steps = _train(policy, examples, probe, toy, start, verbose)
        model.load_state_dict(best_state)
        train_probe = train_rows[: 2 * toy.probe_questions]
        train_spread = measure_spread(policy, train_probe, toy.samples, toy.seed + 1)
        test_spread = measure_spread(policy, test_rows, toy.samples, toy.seed + 2)
        padded_mass = None  # after the spreads: at most PADDED_MASS of probability moves, and sampling stays cheap
        if toy.vocab_rows is not None and toy.vocab_rows > len(tok):
            padded_mass = pad_vocabulary(model, toy.vocab_rows, examples[: toy.probe_questions], tok.pad_token_id)
        save_model_folder(model, tok, out)
        seconds = time.monotonic() - start
        if verbose:
            print(f"built-in model for task {task.name}: {sum(p.numel() for p in model.parameters())} parameters, "
                  f"checkpoint of step {best[0]} (of {steps}) chosen by sampled accuracy, {seconds:.0f} s\n"
                  f"  train {train_spread.line()}\n  test  {test_spread.line()}")
        return {"task": task.name, "settings": toy.model_dump(mode="json"), "chosen_step": best[0], "steps": steps,
                "seconds": round(seconds, 1), "max_new_tokens": budget, "vocab_size": len(tok),
                "vocab_rows": model.config.vocab_size, "padded_mass_max": padded_mass,
                "train_spread": asdict(train_spread), "test_spread": asdict(test_spread)}
    finally:
        torch.set_num_threads(threads)


def pad_vocabulary(model, rows: int, examples, pad_id: int) -> float:
    """Grow the vocabulary to `rows` embedding rows (tied or not) whose logits stay far below the real ones.

    A real model's padded rows were trained never to be sampled; here they are set to -beta * u, with u the
    unit mean direction of the final hidden states on the examples, and beta the smallest scale that keeps
    the padded rows' total probability under `PADDED_MASS` on every example token. Returns the largest
    such total measured afterwards; RuntimeError when no direction separates them (never seen)."""
    import torch

    with torch.no_grad():
        model.eval()
        old = model.config.vocab_size
        ids, mask, labels = _batch(examples, list(range(len(examples))), random.Random(0), pad_id)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        keep = mask.bool()
        h = out.hidden_states[-1][keep]  # [N, H] final hidden states (after the final norm)
        lse = torch.logsumexp(out.logits[keep].float(), dim=-1)  # [N]
        u = _separating_direction(h)
        m = h @ u  # [N]
        if float(m.min()) <= 0:
            raise RuntimeError("model.toy.vocab_rows: no direction has every final hidden state on its positive side; "
                               "the padded rows cannot be kept unlikely (use vocab_rows: null)")
        n_pad = rows - old
        # n_pad * exp(-beta * m_i) <= PADDED_MASS * exp(lse_i) for every token i (e: a margin for the noise below)
        target = math.log(n_pad) - math.log(PADDED_MASS) + 1.0
        beta = max(0.0, float(((target - lse) / m).max()))
        model.resize_token_embeddings(rows, mean_resizing=False)
        emb = model.get_input_embeddings().weight
        g = torch.Generator().manual_seed(0)
        emb[old:] = -beta * u + 1e-3 * torch.randn(n_pad, emb.shape[1], generator=g)
        if model.get_output_embeddings().weight is not emb:
            model.get_output_embeddings().weight[old:] = emb[old:]
        # padded mass = 1 / (1 + exp(lse_real - lse_padded)), the padded logits a chunk of tokens at a time:
        # the probe's [N, rows] logits at a 152k vocabulary would be gigabytes
        pad = emb[old:]  # [n_pad, H]
        lse_pad = torch.cat([torch.logsumexp((h[i:i + 256] @ pad.T).float(), dim=-1)
                             for i in range(0, len(h), 256)])  # [N]
        return float(torch.sigmoid(lse_pad - lse).max())


def _separating_direction(h: torch.Tensor, steps: int = 2000) -> torch.Tensor:
    """A unit vector u with min_i h_i . u as large as found: the mean direction, then gradient ascent on a
    soft minimum of the margins (the hard-margin problem through the origin). h [N, H] -> [H]."""
    import torch

    x = h.double() / h.double().norm(dim=-1, keepdim=True)  # [N, H] unit rows: the margin of the worst row
    u = x.mean(0)
    u = (u / u.norm()).requires_grad_(True)
    opt = torch.optim.Adam([u], lr=0.01)
    with torch.enable_grad():
        for _ in range(steps):
            m = x @ (u / u.norm())  # [N]
            loss = torch.logsumexp(-m / 0.01, dim=0)  # soft max of -margin
            opt.zero_grad()
            loss.backward()
            opt.step()
    u = u.detach() / u.detach().norm()
    return u.to(h.dtype)


def _is_chat_task(name: str | None) -> bool:
    from common.tasks import TASKS

    return name in TASKS and TASKS[name].chat


def _tokenizer(task, rows: list[dict]):
    """The character tokenizer, or for a chat task a BPE tokenizer (with chat template) trained on `rows`."""
    from common.modeling import build_char_tokenizer, train_bpe_tokenizer

    if not task.chat:
        return build_char_tokenizer()
    texts = (text for row in rows for text in [row["question"], *task.solutions(row["question"], row["answer"])])
    return train_bpe_tokenizer(texts, vocab_size=BPE_VOCAB_SIZE)


def _examples(task, rows: list[dict], tok) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt ids, [response ids + EOS for each correct response]) per training question."""
    from common.data import encode_prompt

    out = []
    for row in rows:
        _, prompt_ids = encode_prompt(tok, row["question"], use_chat_template=task.chat)
        eos = [tok.eos_token_id]
        solutions = task.solutions(row["question"], row["answer"])
        responses = [tok.encode(s, add_special_tokens=False) + eos for s in solutions]
        out.append((prompt_ids.tolist(), responses))
    return out


def _batch(examples, idx: list[int], rng: random.Random, pad_id: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside responses), each [B, L]."""
    import torch

    seqs, label_seqs = [], []
    for i in idx:
        prompt, responses = examples[i]
        resp = rng.choice(responses)
        seqs.append(prompt + resp)
        label_seqs.append([-100] * len(prompt) + resp)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, L]
    for r, (s, lab) in enumerate(zip(seqs, label_seqs)):
        ids[r, : len(s)] = torch.tensor(s)
        labels[r, : len(s)] = torch.tensor(lab)
        mask[r, : len(s)] = 1
    return ids, mask, labels


def _spread_score(s: Spread, target: float) -> float:
    """Higher is better: a mean near the target first, then many partly-right questions (with 8
    samples a 0.05 step of the mean weighs as much as 20% more partly-right questions)."""
    return s.partly - 4.0 * abs(s.mean - target)


def _train(policy: Policy, examples, probe, toy: ToyModelConfig, start: float, verbose: bool):
    """Supervised training of `policy.model` on `examples`, its spread measured on `probe` every `toy.eval_every`
    steps; returns (best state dict, (best step, best spread), steps run)."""
    import torch

    model, tok = policy.model, policy.tok
    opt = torch.optim.AdamW(model.parameters(), lr=toy.lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    rng = random.Random(toy.seed)
    order: list[int] = []
    best_state, best, best_score = copy.deepcopy(model.state_dict()), (0, None), -np.inf
    step = 0
    for step in range(1, toy.max_train_steps + 1):
        if len(order) < toy.batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        idx, order = order[: toy.batch_size], order[toy.batch_size:]
        ids, mask, labels = _batch(examples, idx, rng, tok.pad_token_id)
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        out_of_time = time.monotonic() - start > toy.max_train_seconds
        if step % toy.eval_every and not out_of_time and step != toy.max_train_steps:
            continue
        spread = measure_spread(policy, probe, toy.samples, toy.seed + step)
        score = _spread_score(spread, toy.target_mean_accuracy)
        if verbose:
            print(f"  step {step:5d}  loss {loss.item():.3f}  {spread.line()}", flush=True)
        if score > best_score:
            best_state, best, best_score = copy.deepcopy(model.state_dict()), (step, spread), score
        if spread.mean >= toy.target_mean_accuracy + 0.1 or out_of_time:
            break
    return best_state, best, step


# ------------------------------------------------------------------------------------------ sampling


def sample_responses(policy: Policy, prompts: list[str], n: int, seed: int, temperature: float = 1.0,
                     rows_per_call: int = 1024) -> list[list[str]]:
    """`n` sampled response texts per prompt (the `encode_prompt` encoding, the chat template for a chat task;
    stop at EOS or after `policy.max_new_tokens`). No gradients: `generate` runs without them."""
    import torch

    from common.data import encode_prompt

    model, tok, chat, max_new_tokens = policy.model, policy.tok, policy.task.chat, policy.max_new_tokens
    torch.manual_seed(seed)
    model.eval()
    flat = [p for p in prompts for _ in range(n)]
    texts: list[str] = []
    for lo in range(0, len(flat), rows_per_call):
        chunk = [encode_prompt(tok, p, use_chat_template=chat)[1].tolist() for p in flat[lo: lo + rows_per_call]]
        width = max(len(c) for c in chunk)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(c)) + c for c in chunk])  # [R, P] left-padded
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(c) for c in chunk])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        texts += tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return [texts[i * n: (i + 1) * n] for i in range(len(prompts))]


def measure_spread(policy: Policy, rows: list[dict], samples: int, seed: int) -> Spread:
    """Per-question sampled accuracy at temperature 1, summarised as a Spread."""
    outs = sample_responses(policy, [r["question"] for r in rows], samples, seed)
    acc = np.array([np.mean([policy.task.verify(t, r["answer"]) for t in ts]) for r, ts in zip(rows, outs)])
    return Spread(mean=float(acc.mean()), always=float((acc == 1).mean()), partly=float(((acc > 0) & (acc < 1)).mean()),
                  never=float((acc == 0).mean()), questions=len(rows), samples=samples)
