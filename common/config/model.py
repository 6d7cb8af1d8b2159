"""The `model` section: the model folder, or the built-in toy model's recipe."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config.base import Section


class ToyModelConfig(Section):
    """The built-in model: a tiny Llama trained briefly and offline on the built-in task."""

    hidden_size: int = Field(96, ge=16, le=4096)
    """Hidden width of the toy Llama."""
    num_layers: int = Field(3, ge=1, le=48)
    """Number of decoder layers."""
    num_heads: int = Field(3, ge=1, le=64)
    """Attention heads; hidden_size / num_heads must be 32, 64 or 128 (head sizes vLLM's CPU attention supports)."""
    max_train_steps: int = Field(1500, ge=10, le=100_000)
    """Upper bound on supervised steps; training stops earlier once the accuracy spread is reached."""
    batch_size: int = Field(128, ge=1, le=4096)
    """Supervised batch size (examples)."""
    lr: float = Field(3e-3, gt=0, le=1.0)
    """Supervised learning rate."""
    target_mean_accuracy: float = Field(0.3, gt=0, lt=1)
    """Stop training once sampled accuracy (temperature 1) on the probe set reaches this."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Seed for the toy model's initialisation and data order."""
    eval_every: int = Field(50, ge=1, le=100_000)
    """Measure sampled accuracy on the probe set every this many steps (the best measured checkpoint is kept)."""
    probe_questions: int = Field(128, ge=8, le=100_000)
    """Training questions in the probe set used to choose the checkpoint."""
    samples: int = Field(8, ge=2, le=1024)
    """Samples per probe question (the spread: always / partly / never right)."""
    max_train_seconds: float = Field(150.0, gt=0, le=86_400)
    """Stop supervised training after this long even if the target accuracy was not reached."""
    supervised_questions: int = Field(4000, ge=1, le=1_000_000)
    """Training-split questions the model is trained on (at least data.num_train; the first data.num_train of
    them are the RL training split, none are in the test split). More than the RL split helps it generalise."""
    threads: int = Field(1, ge=1, le=256)
    """torch threads while building (restored afterwards)."""
    architecture: Literal["llama", "qwen2"] = "llama"
    """llama, or qwen2: Qwen2.5's architecture at this width (grouped-query attention with one KV head, RoPE
    base 1e6, tied input/output embeddings)."""
    vocab_rows: int | None = Field(None, ge=16, le=1_000_000)
    """Embedding rows, padded past the tokenizer's tokens as real models pad theirs (Qwen2.5: 151936). The padded
    rows are set after training so that the model gives them no probability. None: the tokenizer's size."""
    max_positions: int = Field(512, ge=64, le=1_000_000)
    """max_position_embeddings of the built model (prompt + response must fit)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ToyModelConfig:
        if self.architecture == "qwen2" and self.num_heads < 2:
            raise ValueError("model.toy.num_heads: the qwen2 architecture shares one KV head between at least 2 "
                             "query heads; set num_heads >= 2")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads not in (32, 64, 128):
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be 32, 64 or 128 "
                "(the head sizes vLLM's CPU attention supports)"
            )
        return self


class ModelConfig(Section):
    """Which policy model to train."""

    path: str | None = None
    """Local Hugging Face model folder. None builds (once, cached) the built-in toy model for the task."""
    cache_dir: str = "~/.cache/exgrpo"
    """Where the built-in model is cached."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the learner (FSDP2 mixed precision: float32 master weights, optimizer state and
    gradient reduction), of the generators' engines (unless generator.dtype is set) and of the model folder
    saved in checkpoints. bfloat16 for GPU runs; it also runs on CPU (slower there than float32)."""
    toy: ToyModelConfig = ToyModelConfig()
    """Settings of the built-in model (used only when path is None)."""
