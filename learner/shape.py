"""The shape of what the learner trains: lengths, dtypes, ranks and the model's special tokens, one frozen value
resolved once and handed down whole, not field by field.

    shape = TrainShape(max_new_tokens=..., prompt_tokens=..., batch_rows=..., dtype=..., publish_dtype=...)  # driver
    pool = LearnerPool(cfg.learner, model_path, shape, run=run, namespace=ns)    # sets `world` (its rank count)
    shape = shape.with_model(model)                                              # a rank, once it built the model

Each holder completes what it alone knows: the driver the run's lengths and dtypes, the pool its rank count, the
rank its model's positions and tokens. `learner.setup` budgets activation checkpointing "auto" with it, the step and
its objective (`learner.objective`) read the lengths and tokens, and publication casts to `publish_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

DEFAULT_PROMPT_TOKENS = 2048
"""The longest prompt checkpointing "auto" budgets for where the run does not say (`TrainShape.prompt_tokens`)."""


@dataclass(frozen=True)
class TrainShape:
    """The run's sizes and dtypes the learner needs beside its config section (see the module doc)."""

    max_new_tokens: int  # generator.max_new_tokens: the overlong penalty's limit, the constant divisor's rows x it
    prompt_tokens: int | None = None  # data.max_prompt_tokens (None: DEFAULT_PROMPT_TOKENS for checkpointing auto)
    batch_rows: int | None = None  # rows of one training batch, buffer.batch_questions x group_size (None: unknown)
    dtype: str = "float32"  # model.dtype: the ranks' compute dtype (master weights stay float32)
    publish_dtype: str = "float32"  # generator.dtype: what publications carry (the engines' dtype; float32: exact)
    world: int = 1  # learner ranks (`LearnerPool` sets learner.num_ranks)
    max_positions: int | None = None  # the model's max_position_embeddings: prompt + response tokens a row may have
    eos_id: int | None = None  # the model's EOS token (replay_eos); None: it names none
    pad_id: int = 0  # the model's pad token (0 where it names none)

    def with_model(self, model: Any) -> TrainShape:
        """This shape with the model's positions, EOS and pad tokens (its config and generation config: no weight
        is read, so a model on the meta device serves)."""
        pad = model.config.pad_token_id
        return replace(self, max_positions=int(model.config.max_position_embeddings), eos_id=eos_token_id(model),
                       pad_id=0 if pad is None else int(pad))

    def rows_per_update(self, mini_batches: int) -> int | None:
        """The rows one rank trains per optimizer step: a batch's rows over `mini_batches` updates and the ranks
        (None where the batch's rows are unknown)."""
        if self.batch_rows is None:
            return None
        return max(1, self.batch_rows // (mini_batches * self.world))

    @property
    def torch_dtype(self):
        """`dtype` as a torch.dtype."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_publish_dtype(self):
        """`publish_dtype` as a torch.dtype."""
        import torch

        return getattr(torch, self.publish_dtype)

    @property
    def max_length(self) -> int:
        """The longest row: the longest prompt and response, within the model's positions (once known)."""
        longest = self.max_new_tokens + (DEFAULT_PROMPT_TOKENS if self.prompt_tokens is None else self.prompt_tokens)
        return longest if self.max_positions is None else min(self.max_positions, longest)


def eos_token_id(model: Any) -> int | None:
    """The model's EOS token: generation_config.json's, else config.json's (the first of a list), else None."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return None
