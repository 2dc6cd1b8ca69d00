"""The mask function of the transformers integration (``integrations/transformers.py``): what
transformers tells a layer about its call, passed on to the attention function, and read back
there (:func:`call_keys`, :func:`filled_keys`).

Note [What the mask function passes on]
    transformers builds each layer type's mask once per forward with the registered mask
    function, which receives the call's geometry: ``q_length`` queries at the absolute positions
    from ``q_offset`` (the tokens a cache held before them; a static cache's count is a
    tensor), ``kv_length`` key slots from the absolute position ``kv_offset`` (a sliding cache
    drops the oldest), the (B, tokens) padding mask, and the mask function (causal, a window or
    a chunk, packed sequences). The attention function receives only what the mask function
    returns, and some models (Llama 4, Whisper's decoder) give it no position ids, so the mask
    function returns what the attention function cannot find elsewhere:

    - A causal mask: the padding mask of every position up to the last query, (B, ``q_offset +
      q_length``) bool, ``True`` for a real token; ``None`` when the keys are exactly those
      positions and no mask was given. The call's keys are the last of those positions it holds:
      a static cache's slots after them are unfilled (causal attention never sees them: no
      query is after them) and are left out, and positions before them that the call lacks
      give the keys' absolute offset (a sliding cache dropped them; a chunk's boundaries count
      from the row's first real token). Reading a static cache's count is a host
      synchronization; under ``torch.compile`` a one-token call without gradients (the
      decoding step) gets a mask over the cache's slots instead, (B, ``kv_length``), ``False``
      at unfilled ones, which the static decode step takes (Note [Decoding with transformers'
      caches] in ``_transformers_paths.py``; a layer kept on transformers' attention computes
      it too, and a layer the step does not take, one with a window, a soft-cap or sinks, runs
      eagerly and cuts it after its last filled slot, the query's: :func:`trim_unfilled`);
      other calls read the count (a graph break).
    - Packed sequences (no padding mask, no cached tokens, ``check_positions``): each token's
      sequence index in its row, (B, N) int64, read from the mask function itself: a query that
      cannot see the token before it starts a sequence. transformers finds packing from position
      ids only without a cache (``use_cache=False``); position ids that reach the attention
      function are read there too (Note [Packed rows from transformers]). A mask over more keys
      than its window or chunk also hides the token before each chunk's first: when those are
      all it hides, it is a chunked mask, not packing.
    - A bidirectional mask (an encoder's, cross-attention's): the padding mask of the call's
      keys, as transformers gives it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Config attribute: whether position ids and masks are checked for packed sequences.
CHECK_POSITIONS_ATTR = "dilated_check_positions"
#: The fix that :func:`host_read` names by default: the checks that read values on the host.
SKIP_CHECKS = (
    "use_dilated_attention(..., check_positions=False) skips these checks for one graph "
    "(fullgraph=True) in a model that never sees packed rows"
)


def host_read(what: str, fix: str = SKIP_CHECKS) -> None:
    """Mark a host read of tensor values: under ``torch.compile`` a graph break whose message
    (``fullgraph=True`` raises it instead of torch's data-dependent guard error) names what is
    read and the ``fix``."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(
            msg=f"dilated attention reads {what} on the host, which a graph cannot hold; {fix}"
        )


def is_sequence_ids(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` is the packed rows' sequence indices (Note [What the mask function
    passes on]) rather than a padding mask."""
    return mask is not None and mask.dtype != torch.bool


def padding_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0, mask_function: Any = None, attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:  # fmt: skip
    """transformers' mask-function contract (Note [What the mask function passes on]).

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset: the call's geometry.
        mask_function: transformers' ``(batch, head, q, kv) -> bool`` index function.
        attention_mask: (B, tokens) padding mask, nonzero for a real token, or None.
        kwargs: transformers' further arguments (``config``, ``device``, ``local_size``, ...).

    Returns:
        A causal mask: (B, q_offset + q_length) bool (a compiled one-token step on a static
        cache: (B, kv_length)), (B, N) int64 sequence indices of packed rows, or None. A
        bidirectional one: (B, kv_length) bool or None.
    """
    if "allow_is_bidirectional_skip" in kwargs:  # an encoder's or cross-attention's mask
        return None if attention_mask is None else attention_mask[:, -kv_length:].bool()
    device = kwargs.get("device")
    mask = None if attention_mask is None else attention_mask.bool()
    end = q_offset + q_length  # one past the last query's absolute position
    if isinstance(end, torch.Tensor):
        if torch.compiler.is_compiling() and q_length == 1 and not torch.is_grad_enabled():
            return _cache_slots(mask, batch_size, kv_length, kv_offset, end)
        host_read(
            "a static cache's length (a call of several tokens into it)",
            "run the prompt eagerly and compile the one-token decoding step (as transformers' "
            "generate does)",
        )
        end = int(end)
    if mask is None and kv_offset == 0 and kv_length == end:
        return _sequence_ids(batch_size, kv_length, q_offset, mask_function, kwargs)
    if mask is None:
        return torch.ones(batch_size, end, dtype=torch.bool, device=device)
    return _fit(mask, end)


def _fit(mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, n) ``mask`` cut or padded (``False``: transformers takes missing entries for
    padding) to (B, length)."""
    if mask.shape[1] >= length:
        return mask[:, :length]
    return F.pad(mask, (0, length - mask.shape[1]))


def _cache_slots(
    mask: torch.Tensor | None, batch_size: int, kv_length: int, kv_offset: int,
    end: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """A static cache's slots for a one-token call under ``torch.compile``: (B, kv_length),
    ``True`` for a filled slot of a real token."""
    slots = torch.arange(kv_length, device=end.device) + kv_offset
    filled = (slots < end)[None].expand(batch_size, -1)
    if mask is None:
        return filled
    return filled & _fit(mask, kv_offset + kv_length)[:, kv_offset:].to(end.device)


def trim_unfilled(mask: torch.Tensor) -> torch.Tensor:
    """A one-token call's (B, n) mask cut after its last ``True`` column, the query's slot
    (Note [What the mask function passes on]: under ``torch.compile`` a static cache's unfilled
    slots follow it); a host read, in eager code."""
    filled = int(mask.any(dim=0).nonzero().max()) + 1 if bool(mask.any()) else mask.shape[1]
    return mask[:, :filled]


def _sequence_ids(
    batch_size: int, n: int, q_offset: int, mask_function: Any, kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """Packed rows' (B, n) int64 sequence indices from ``mask_function``, or None (Note [What
    the mask function passes on])."""
    config = kwargs.get("config")
    if q_offset != 0 or n < 2 or mask_function is None or kwargs.get("use_vmap"):
        return None
    if not getattr(config, CHECK_POSITIONS_ATTR, True):
        return None
    device = kwargs.get("device")
    rows = torch.arange(batch_size, device=device)[:, None]
    index = torch.arange(1, n, device=device)[None]
    head = torch.zeros((), dtype=torch.long, device=device)
    sees_previous = torch.as_tensor(mask_function(rows, head, index, index - 1), device=device)
    starts = ~sees_previous.expand(batch_size, n - 1)
    host_read("the mask's sequence starts (a check for packed sequences)")
    local = kwargs.get("local_size")
    if local is not None and n > local:
        chunk_starts = (index % local == 0).expand_as(starts)
        if bool((starts == chunk_starts).all()):
            return None
    if not bool(starts.any()):
        return None
    return F.pad(starts.long(), (1, 0)).cumsum(dim=1)


def sequence_offsets(ids: torch.Tensor) -> list[int]:
    """The offsets over the batch's ``B * N`` positions of packed rows' (B, N) sequence
    indices: 0, each sequence's end, ``B * N``."""
    batch, n = ids.shape
    starts = (ids.diff(dim=1) != 0).nonzero()
    inner = (starts[:, 0] * n + starts[:, 1] + 1).tolist()
    return sorted({*inner, *(row * n for row in range(batch)), batch * n})


def call_keys(
    mask: torch.Tensor | None, slots: int
) -> tuple[torch.Tensor | None, int, int]:
    """The call's keys from what the mask function passed on (Note [What the mask function
    passes on]): the padding mask of its filled keys (B, filled) (or the packed rows' sequence
    indices, or None), how many of its ``slots`` key slots are filled, and the absolute position
    of the first."""
    if mask is None or is_sequence_ids(mask):
        return mask, slots, 0
    filled = min(mask.shape[1], slots)
    offset = mask.shape[1] - filled
    return mask[:, offset:], filled, offset


def filled_keys(
    mask: torch.Tensor | None, positions: torch.Tensor | None, keys: int, check: bool = True
) -> int:
    """How many of the ``keys`` slots hold tokens: the mask's length, else one past the last
    query's position (a static cache has more slots than tokens and, unpadded, no mask); all of
    them when the queries are as many as the slots (no cache beyond them). ``check``: refuse
    position ids that restart within a row (a data-dependent test: ``torch.compile`` breaks the
    graph there, in every layer).

    Raises:
        ValueError: position ids that restart within a row (packed sequences), with ``check``.
    """
    if mask is not None:
        return min(mask.shape[1], keys)
    if positions is None or positions.numel() == 0:
        return keys
    if check and positions.shape[-1] > 1:
        host_read("position_ids (a check for packed sequences)")
    if check and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) != 1).any()):
        raise ValueError(
            "dilated attention cannot run packed sequences (position_ids restart within a row): "
            "segments follow each sequence's positions; give each sequence its own row"
        )
    if positions.shape[-1] == keys:  # every slot is one of these positions: no cache beyond them
        return keys
    host_read(
        "position_ids (the filled length of a cache that came without a mask)",
        "let transformers build the mask with the registered mask function "
        "(use_dilated_attention registers it)",
    )
    return min(int(positions[..., -1].max()) + 1, keys)
