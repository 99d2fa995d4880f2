"""Reading a PPO batch (any mapping of name -> tensor; a TensorDict works)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metricsvc.client.tensors import is_tensor, on_host


@dataclass(frozen=True)
class ResponseInfo:
    """Masks and lengths of the prompt and response parts of a batch."""

    prompt_mask: Any  # [B, P], as the attention mask holds it
    response_mask: Any  # [B, R] bool
    prompt_length: Any  # [B] float64
    response_length: Any  # [B] float64
    max_prompt_length: int
    max_response_length: int
    # The response part is the attention mask's own (no response_mask of its own): the
    # two lengths then sum to the attention mask's tokens.
    of_attention: bool = True


def get(batch: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Return ``batch[key]`` or ``default``, for dicts and TensorDicts alike."""
    try:
        return batch[key] if key in batch.keys() else default
    except (KeyError, TypeError):
        return default


_last_info: list[tuple[Any, ...]] = []  # the last batch's masks (weakly) and their info


def response_info(batch: Mapping[str, Any]) -> ResponseInfo:
    """Split ``attention_mask`` into prompt and response parts, as verl and siiRL do.

    The data, timing and throughput metrics of a step all read the same batch: the masks
    and lengths are worked out once (while the batch's mask tensors are alive and unchanged).

    Raises:
        KeyError: the batch lacks ``responses`` or ``attention_mask``.
    """
    for key in ("responses", "attention_mask"):
        if get(batch, key) is None:
            raise KeyError(f"batch has no {key!r}; data metrics need it")
    max_response = int(batch["responses"].shape[-1])
    attention = batch["attention_mask"]
    given = get(batch, "response_mask")
    for key, value in (("attention_mask", attention), ("response_mask", given)):
        if value is not None and not is_tensor(value):
            raise TypeError(
                f"batch[{key!r}] is a {type(value).__module__}.{type(value).__name__}: the "
                f"built-in recorders read a verl/siiRL batch of torch tensors (pip install "
                f"'metricsvc[torch]'); record other arrays with stat(), as any metric")
    held = held_response_info(batch, attention, given, max_response)
    if held is not None:
        return held
    info = _response_info(attention, given, max_response)
    _last_info[:] = [(weakref.ref(attention), _ref(given), _versions(attention, given,
                                                                    max_response), info)]
    return info


def held_response_info(batch: Mapping[str, Any], attention: Any = None, given: Any = None,
                       max_response: int | None = None) -> ResponseInfo | None:
    """The response info of ``batch`` if this step worked it out already (its masks the
    same tensors, unchanged since), else None."""
    held = _last_info[0] if _last_info else None
    if held is None:
        return None
    if max_response is None:
        attention, given = get(batch, "attention_mask"), get(batch, "response_mask")
        responses = get(batch, "responses")
        if (attention is None or responses is None or not is_tensor(attention)
                or (given is not None and not is_tensor(given))):
            return None
        max_response = int(responses.shape[-1])
    if (held[0]() is attention and held[1]() is given
            and held[2] == _versions(attention, given, max_response)):
        return held[3]
    return None


def _versions(attention: Any, given: Any, max_response: int) -> tuple:
    """What tells the masks changed since: their version counters, and the response width."""
    return attention._version, None if given is None else given._version, max_response


def _ref(t: Any) -> Any:
    return (lambda: None) if t is None else weakref.ref(t)


def _response_info(attention: Any, given: Any, max_response: int) -> ResponseInfo:
    torch = __import__("torch")
    response_mask = given
    if response_mask is None:
        response_mask = attention[:, -max_response:]
    prompt_mask = attention[:, :-max_response]
    # The lengths are the masks' sums, as siiRL's and verl's ``_compute_response_info``
    # take them; then the token-level metrics' valid tokens as bool, read while the
    # response mask is in cache from its sum.
    response_length = response_mask.sum(-1).to(torch.float64)
    return ResponseInfo(
        prompt_mask=prompt_mask,
        response_mask=response_mask.bool(),
        prompt_length=prompt_mask.sum(-1).to(torch.float64),
        response_length=response_length,
        max_prompt_length=int(prompt_mask.shape[-1]),
        max_response_length=max_response,
        of_attention=given is None,
    )


def plain_if_host(t: Any) -> Any:
    """A 0-d CPU tensor as a plain number (reading the CPU is no device sync); a device
    tensor as it is (reading it would wait for the device), and a CPU one on the
    accelerator's path (``accelerator_path_on_cpu``: how a CPU tests that path)."""
    return t.item() if on_host(t, None) else t
