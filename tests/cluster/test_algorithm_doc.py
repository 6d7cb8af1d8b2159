"""docs/algorithm.md's "paper's settings in one command" is the official ExGRPO run: its command line, resolved
by `exgrpo config`, has the official hyper-parameters."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "algorithm.md"

OFFICIAL = {  # the paper (arXiv 2510.02245) and its official code
    ("buffer", "max_lag"): 0,  # synchronous: generate, then train
    ("buffer", "batch_questions"): 128,
    ("buffer", "group_size"): 8,
    ("buffer", "replay_ratio"): 0.5,
    ("buffer", "fresh_draw"): "per_step",  # 128 fresh drawn per step, rho B of them replaced by replays
    ("buffer", "mixed_switch_accuracy"): 0.35,
    ("learner.batching", "mini_batches"): 2,
    ("learner.optim", "lr"): 1e-6,
    ("learner.loss", "clip_fresh"): "auto",  # clipped until mixed mode, not after
    ("learner.loss.policy_loss", "clip_low"): 0.2,
    ("learner.loss.policy_loss", "clip_high"): 0.2,
    ("learner.loss", "recompute_old_logprobs"): True,
    ("learner.loss", "loss_agg"): "constant",  # loss_remove_token_mean=True: sum / 8192
    ("learner.loss", "loss_constant"): 8192.0,
    ("learner.loss", "loss_world_size"): 8,  # FSDP averages over the official 8 GPUs: the divisor is 8192 * 8
    ("learner.loss", "entropy_agg"): "micro_batch",  # the entropy mean per micro-batch (use_dynamic_bsz), summed
    ("learner.batching", "micro_batch_tokens"): 32768,  # ppo_max_token_len_per_gpu
    ("learner.batching", "micro_batch_split"): "balanced",  # use_dynamic_bsz: ceil(tokens / 32768) parts, K-K
    ("learner.loss", "store_learner_logprobs"): "auto",  # stores the recomputed old_log_probs (with recompute)
    ("learner.loss", "shaping_beta"): 0.1,
    # mix_vllm_rollout appends EOS to every replayed o*, then cuts the response back to the length limit: a
    # full-length truncated o* keeps no EOS, as with replay_eos off (issue 52)
    ("learner.loss", "replay_eos"): False,
    ("learner.loss.policy_loss", "clip_ratio_c"): None,  # the official loss has no dual-clip (verl's vanilla has it at 3)
    ("model", "dtype"): "bfloat16",  # FSDP: bf16 compute, fp32 master weights, optimizer state, gradient reduction
    ("generator", "dtype"): "bfloat16",  # vLLM samples in bf16
    ("learner.loss.policy_loss", "kind"): "ppo_clip",
    ("learner.loss", "entropy_coef"): 0.001,
    ("learner.loss", "kl_coef"): 0.0,
    ("learner.optim", "grad_clip"): 1.0,
    ("learner.loss", "std_normalize"): False,
    ("generator", "max_new_tokens"): 8192,
    ("generator", "temperature"): 1.0,
    ("eval", "temperature"): 0.6,
    ("reward", "name"): "math_think",
    (None, "total_steps"): 700,
}


def paper_command() -> list[str]:
    section = DOC.read_text().split("## The paper's settings in one command", 1)[1]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["exgrpo", "train", "config.yaml"], words[:3]
    return words[3:]


def test_the_one_command_paper_run_has_the_official_hyper_parameters():
    # config.yaml stands for the user's model and math data: a task math_think can grade takes its place
    # (and the built-in model, with positions for 8k responses, stands for the user's model folder)
    overrides = ["data.task=think_arith", "model.toy.max_positions=10240", *paper_command()]
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "config", *overrides], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    got = {key: functools.reduce(dict.get, key[0].split("."), cfg)[key[1]] if key[0] else cfg[key[1]]
           for key in OFFICIAL}
    assert got == OFFICIAL
    # the derived divisor, printed under the YAML: the official gradient's scale at its GPU count (issue 35)
    assert "policy loss = the mini-batch's token sum / 65536 (loss_constant 8192 x loss_world_size 8)" in out.stdout
    # the aggregation in force, named against the loss's own (issue 52), and PPO's clip without dual-clip
    assert "loss_agg constant (named; ppo_clip's own is token_mean) (PPO clip until mixed mode [1-0.2, 1+0.2];" \
        in out.stdout
    # and the entropy term's micro-batches: the official 8 GPUs' whatever num_ranks is (issue 44)
    assert ("entropy bonus = entropy_coef x sum of the micro-batches' token means / 8, micro-batches: the mini-batch "
            "over loss_world_size 8 GPUs, ceil(its tokens / 32768) each, the largest count for all") in out.stdout
