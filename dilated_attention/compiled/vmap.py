"""``torch.func.vmap`` rules of the custom operators: the mapped dimension folded into the batch
dimension (dim 0 of every input is the batch), the operator run once, the results unfolded.

Shape legend: B batch, V the size of a vmapped dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .options import PUBLIC_NAME, dropout_p

__all__ = ["backward_rule", "forward_rule"]


def _fold(x: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """(..V at dim.., B, ...) or unmapped (B, ...) -> (V * B, ...)."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _fold_block_mask(
    x: torch.Tensor | None, dim: int | None, size: int, batch: int
) -> torch.Tensor | None:
    """A run-time block mask (..V at dim.., Bm, Hm, Mq, W) or unmapped, with Bm 1 or B ->
    (V * B, Hm, Mq, W): a mask of one batch row serves each of the B rows it is mapped with."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    x = x.expand(size, batch, *x.shape[2:])
    return x.reshape(size * batch, *x.shape[2:])


def _fold_all(
    kind: str, args: Sequence[Any], in_dims: Sequence[int | None], size: int, query: int
) -> list[torch.Tensor | None]:
    """Every tensor of ``args`` folded (:func:`_fold`); ``args[query]`` is the query and
    ``args[query + 3]`` the call's mask, a block-sparse call's run-time block mask folded by
    :func:`_fold_block_mask`."""
    tensors = [_fold(x, d, size) for x, d in zip(args, in_dims, strict=True)]
    mask = query + 3
    if kind == "block_sparse" and args[mask] is not None:
        batch = tensors[query].shape[0] // size  # type: ignore[union-attr]
        tensors[mask] = _fold_block_mask(args[mask], in_dims[mask], size, batch)
    return tensors


def _unfold(x: torch.Tensor, size: int) -> torch.Tensor:
    """(V * B, ...) -> (V, B, ...)."""
    return x.view(size, x.shape[0] // size, *x.shape[1:])


def _check_vmap(kind: str, info: Any, options: Sequence[Any]) -> None:
    if dropout_p(kind, options) > 0 and info.randomness != "different":
        raise RuntimeError(
            f"{PUBLIC_NAME[kind]} with dropout_p > 0 under torch.func.vmap needs "
            f"randomness='different' (each mapped element draws its own dropout mask), got "
            f"randomness={info.randomness!r}; pass torch.func.vmap(..., randomness='different'), "
            "or dropout_p=0 (module.eval())"
        )


def forward_rule(op: Any, kind: str) -> Callable[..., Any]:
    """The vmap rule of operator ``kind``'s forward ``op``."""

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        _check_vmap(kind, info, args[4:])
        size = info.batch_size
        tensors = _fold_all(kind, args[:4], in_dims[:4], size, 0)
        out, lse, rng_state = op(*tensors, *args[4:])
        return (_unfold(out, size), _unfold(lse, size), rng_state), (0, 0, None)

    return rule


def backward_rule(op: Any, kind: str) -> Callable[..., Any]:
    """The vmap rule of operator ``kind``'s backward ``op``."""

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        # args: grad_out, q, k, v, key_padding_mask, out, lse, rng_state, options...
        if in_dims[7] is not None:
            raise RuntimeError(
                f"torch.func.vmap over the backward of {PUBLIC_NAME[kind]}: the dropout RNG "
                "state cannot be mapped; map over the forward too"
            )
        _check_vmap(kind, info, args[8:])
        size = info.batch_size
        tensors = _fold_all(kind, args[:7], in_dims[:7], size, 1)
        grads = op(*tensors, args[7], *args[8:])
        return tuple(_unfold(g, size) for g in grads), (0, 0, 0)

    return rule
