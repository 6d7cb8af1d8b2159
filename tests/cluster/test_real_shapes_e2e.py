"""`exgrpo train` at real shapes: a Qwen2-architecture model with Qwen2.5's 151,936-row vocabulary (tied
embeddings, GQA, 10,240 positions) at tiny width, the real vLLM engine generating 512-token responses, the
chunked learner under a token budget, its micro-batches packed without padding, and weight sync of the
real-vocabulary embeddings, end to end.

The model is untrained (random weights): it almost never samples EOS, so every response runs to
max_new_tokens, which is the shape under test. Its tokenizer is the built-in chat task's BPE tokenizer;
sampled ids past it decode to nothing, as a real model's padding rows would. (The built-in real-shaped
model, `model.toy.architecture=qwen2 model.toy.vocab_rows=151936`, is a trained model that stops early;
tests/common/test_toy_model.py builds it.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cluster.runs import history, mlflow_client, run_train, state
from tests.conftest import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")]

NEW_TOKENS = 512


@pytest.fixture(scope="module")
def real_shaped_model(tmp_path_factory) -> Path:
    from common.modeling import QWEN2_VOCAB_ROWS, TinyQwen2, save_model_folder, train_bpe_tokenizer
    from common.tasks import get_task

    task = get_task("think_arith")
    rows, _ = task.generate(0, 200, 10)
    tok = train_bpe_tokenizer(t for r in rows for t in [r["question"], *task.solutions(r["question"], r["answer"])])
    model = TinyQwen2(vocab_size=QWEN2_VOCAB_ROWS, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    return save_model_folder(model, tok, tmp_path_factory.mktemp("real-shapes") / "qwen2-152k")


def test_real_vocabulary_and_512_token_responses_train_end_to_end(tmp_path, real_shaped_model, joined):
    r = run_train(tmp_path, "shapes", f"model.path={real_shaped_model}", "data.task=think_arith",
                  "generator.engine.kind=vllm", f"generator.max_new_tokens={NEW_TOKENS}", "buffer.batch_questions=2",
                  "buffer.group_size=4", "learner.batching.micro_batch_tokens=2048", "learner.levers.padding_free=true", "learner.batching.mini_batches=2", "total_steps=2",
                  "checkpoint.every_steps=0", "eval.every_steps=0", "tracking.log_plots=false", *joined.overrides,
                  env=joined.env)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "step 2/2" in r.stdout
    client = mlflow_client(tmp_path)
    run_id = state(tmp_path / "shapes")["mlflow_run_id"]
    run = client.get_run(run_id)
    params = run.data.params
    assert params["generator.engine.max_model_len"] == str(int(params["data.max_prompt_tokens"]) + NEW_TOKENS)
    lengths = [v for _, v in history(client, run_id, "train/response_length_mean")]
    assert len(lengths) == 2 and min(lengths) >= NEW_TOKENS - 8, lengths  # (almost) every response runs to the cap
    tokens = [v for _, v in history(client, run_id, "learner/tokens")]
    assert min(tokens) >= 2 * 4 * (NEW_TOKENS - 8), tokens  # 8 rows of ~512 response tokens per step
    assert all(math.isfinite(v) for _, v in history(client, run_id, "learner/entropy_fresh"))
    # the learner packed each micro-batch's rows into one sequence: no forward token was padding
    assert [v for _, v in history(client, run_id, "learner/padding_free")] == [1.0, 1.0]
    assert [v for _, v in history(client, run_id, "learner/padding_frac")] == [0.0, 0.0]
    # the learner's entropy is the full-vocabulary one: a random model spreads mass over ~152k rows
    assert min(v for _, v in history(client, run_id, "learner/entropy_fresh")) > 9.0
