"""Reading a PPO batch (any mapping of name -> tensor; a TensorDict works)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResponseInfo:
    """Masks and lengths of the prompt and response parts of a batch."""

    prompt_mask: Any  # [B, P] bool
    response_mask: Any  # [B, R] bool
    prompt_length: Any  # [B] float64
    response_length: Any  # [B] float64
    max_prompt_length: int
    max_response_length: int


def get(batch: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Return ``batch[key]`` or ``default``, for dicts and TensorDicts alike."""
    try:
        return batch[key] if key in batch.keys() else default
    except (KeyError, TypeError):
        return default


def response_info(batch: Mapping[str, Any]) -> ResponseInfo:
    """Split ``attention_mask`` into prompt and response parts, as verl and siiRL do.

    Raises:
        KeyError: the batch lacks ``responses`` or ``attention_mask``.
    """
    for key in ("responses", "attention_mask"):
        if get(batch, key) is None:
            raise KeyError(f"batch has no {key!r}; data metrics need it")
    torch = __import__("torch")
    max_response = int(batch["responses"].shape[-1])
    attention = batch["attention_mask"]
    response_mask = get(batch, "response_mask")
    if response_mask is None:
        response_mask = attention[:, -max_response:]
    prompt_mask = attention[:, :-max_response].bool()
    response_mask = response_mask.bool()
    return ResponseInfo(
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        prompt_length=prompt_mask.sum(-1).to(torch.float64),
        response_length=response_mask.sum(-1).to(torch.float64),
        max_prompt_length=int(prompt_mask.shape[-1]),
        max_response_length=max_response,
    )
