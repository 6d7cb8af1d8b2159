"""Checks shared by the two engine test modules: teacher-forced log-probs of a plain HF model."""

from __future__ import annotations

import numpy as np
import torch


def perturbed_state_dict(model: torch.nn.Module, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: a "new policy version" with Hugging Face names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        noise = torch.randn(v.shape, generator=g, dtype=v.dtype) * scale * (v.float().std() if v.numel() > 1 else 1)
        out[k] = (v + noise).contiguous()
    return out


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, prompt: np.ndarray, response: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs [T], entropies [T]) of `response` after `prompt` at temperature 1, full vocabulary."""
    ids = torch.as_tensor(np.concatenate([prompt, response]).astype(np.int64))[None]  # [1, P+T]
    logits = model(input_ids=ids).logits[0].float()  # [P+T, V]
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [T, V]
    tok = torch.as_tensor(response.astype(np.int64))
    lp = logp.gather(1, tok[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp.numpy(), ent.numpy()
