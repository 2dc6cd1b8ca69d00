"""Run-time block masks in the resolve step (Note [Run-time block masks] in
``block_sparse/runtime.py``): which kernel takes a request's mask, and the strategy that turns
the mask into that kernel's lists on the device when the call runs.

The same kernels take a run-time mask as a pattern, for the same reasons (the block-sparse
registry's): FlashAttention-4's block sparsity, our block-sparse Triton kernels and FlexAttention
walk per-(batch row, head) lists of the kept pairs; elsewhere the fallback runs on a dense kernel
that takes key masks (Note [Run-time masks on a dense kernel] in ``block_sparse/rows.py``). As
for patterns, an end-aligned causal query (shorter than the key) runs the fallback, and naming
one of the three kernels for it raises. Packed documents need no plan of their own: they are
pairs the kept blocks drop, and every kernel runs the rows whole. Unlike a pattern, a mask that
keeps every pair is not sent to the dense kernel (Note [Dense fallback]): knowing it would read
the mask on the host.

Shape legend: B batch, Nq query rows, Nk key rows, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import _validation as V
from ..backends.registry import BLOCK_SPARSE as BLOCK_SPARSE_REGISTRY
from ..backends.registry import DENSE as DENSE_REGISTRY
from ..backends.registry import _requested, registry_for
from ..block_sparse.fa4 import FlashAttn4BlockSparseRunner, runtime_fa4_tiles
from ..block_sparse.flex import _flex_forward
from ..block_sparse.lists import tiles_aligned
from ..block_sparse.rows import MaskedRowsRunner, row_plan
from ..block_sparse.runtime import (
    BlockIndices,
    kept_blocks,
    per_query_head,
    same_document,
)
from ..block_sparse.triton_autograd import TritonBlockSparseRunner, runtime_lists
from ..core.autograd import Inputs, Runner
from ..core.execution.executor import PlanRunner
from .request import Request, kernel_inputs
from .strategy import EmptyStrategy, Prepared, Strategy

__all__ = ["RuntimeMaskStrategy", "refuse_end_aligned_kernels", "runtime_blocks"]


def refuse_end_aligned_kernels(request: Request) -> None:
    """Raise where a block-sparse kernel of the registry's own (FlashAttention-4's block
    sparsity, our Triton kernels, FlexAttention) is asked for by name for an end-aligned causal
    request, which they cannot run (Note [End-aligned causal blocks] in ``resolver.py``).

    Raises:
        ValueError: with the reason and the fix.
    """
    requested, source = _requested(request.backend)
    if requested in registry_for(BLOCK_SPARSE_REGISTRY).plan_kernels:
        nq, nk = request.query_len, request.key_len
        raise ValueError(
            f"backend {requested!r} (from {source}) cannot run block_sparse_attention with "
            f"is_causal=True and a query shorter than the key (query length {nq}, key length "
            f"{nk}): its causal mask is top-left aligned, and such a query holds the last {nq} "
            f"of the {nk} positions (end-aligned). Let the library choose (backend=None), "
            f"which runs the block-sparse plan on a dense kernel, or name a dense kernel from "
            f"list_backends()"
        )


def runtime_blocks(request: Request) -> Strategy:
    """The strategy of a block-sparse request with a run-time mask: one of the block-sparse
    kernels where it runs (and the query is not end-aligned), else the fallback on the kernel
    chosen for its calls, which read key masks."""
    if request.empty:
        return EmptyStrategy(request, None, BLOCK_SPARSE_REGISTRY, None, "no query rows")
    inputs = replace(kernel_inputs(request, block_size=request.block_size), documents=False)
    notes = () if request.documents is None else (
        f"{V.counted(len(request.documents) - 1, 'packed document')}: pairs of two documents "
        f"dropped from the kept blocks, each row run whole",
    )  # fmt: skip
    registry = BLOCK_SPARSE_REGISTRY
    if request.is_causal and request.query_len < request.key_len:
        refuse_end_aligned_kernels(request)
        registry = DENSE_REGISTRY  # the fallback's calls, as a pattern's end-aligned plan
    else:
        kernel = registry_for(registry).select(inputs, request.backend)
        if kernel.runs_plan:
            how = (
                f"{registry_for(registry).plan_kernels[kernel.backend.name].summary}: lists "
                f"made from the run-time mask on the device, per batch row and head"
            )
            return RuntimeMaskStrategy(request, kernel, registry, inputs, how, notes)
    inputs = replace(inputs, has_mask=True)
    kernel = registry_for(registry).select(inputs, request.backend)
    how = (
        "one query block at a time against the keys it may see, the mask's row as the calls' "
        "key mask (Note [Run-time masks on a dense kernel])"
    )
    return RuntimeMaskStrategy(request, kernel, registry, inputs, how, notes)


@dataclass(frozen=True)
class RuntimeMaskStrategy(Strategy):
    """A block-sparse request whose blocks a run-time mask gives (the call's mask tensor:
    Note [The call's mask tensor] in ``request.py``): each call turns the mask into the kept
    blocks and the kernel's lists on the device, then runs it."""

    def _kernel_name(self) -> str:
        assert self.kernel is not None  # runtime_blocks gives every such strategy a kernel
        return self.kernel.backend.name if self.kernel.runs_plan else "plan"

    def _kept(self, mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        """The kept blocks (Bm, Hm, Mq, Mk) bool of the call's mask, for q (B, Nq, H, D)."""
        return kept_blocks(self._checked(mask), **self._geometry(q))

    def _kept_narrow(
        self, mask: torch.Tensor | None, q: torch.Tensor
    ) -> torch.Tensor | BlockIndices:
        """:meth:`_kept`, but int indices stay indices where the kernel's tiles lie inside
        blocks (Note [Narrow lists of block indices] in ``block_sparse/lists.py``)."""
        given, r = self._checked(mask), self.request
        if given.dtype == torch.bool or not tiles_aligned(
            r.block_size, r.query_len, r.key_len, r.is_causal
        ):
            return self._kept(given, q)
        return BlockIndices(given, **self._geometry(q))

    @staticmethod
    def _checked(mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            raise ValueError(
                "a block-sparse request with a run-time block mask runs with the mask tensor "
                "(the call's mask: block_sparse_attention passes it); got None"
            )
        return mask

    def _geometry(self, q: torch.Tensor) -> dict[str, Any]:
        """The keywords of :func:`kept_blocks` / :func:`kept_indices` for q (B, Nq, H, D)."""
        r = self.request
        documents = None
        if r.documents is not None:
            documents = same_document(
                r.documents, q.shape[0], r.query_len, r.block_size, q.device
            )
        return {"block_size": r.block_size, "query_len": r.query_len, "key_len": r.key_len,
                "is_causal": r.is_causal, "documents": documents}  # fmt: skip

    def _run(self, q, k, v, mask, sinks):  # type: ignore[no-untyped-def]
        if self._kernel_name() == "flex":  # differentiable by itself: no runner
            r = self.request
            return _flex_forward(
                q, k, v, self._kept(mask, q), block_size=r.block_size, is_causal=r.is_causal,
                scale=r.softmax_scale,
            )  # fmt: skip
        return super()._run(q, k, v, mask, sinks)

    def prepare(self, q, k, v, mask) -> Prepared | None:  # type: ignore[no-untyped-def]
        assert self.kernel is not None
        name, r = self._kernel_name(), self.request
        if name == "flex":
            return None
        runner: Runner
        if name == "flash_attn4":  # FlashAttention-4 reads strided rows
            tiles = runtime_fa4_tiles(
                self._kept_narrow(mask, q), r.block_size, r.query_len, r.key_len,
                r.is_causal, k.shape[2], q.shape[2],
            )  # fmt: skip
            runner = FlashAttn4BlockSparseRunner(
                self.kernel.backend, tiles, r.block_size, r.is_causal, r.softmax_scale,  # type: ignore[arg-type]
            )  # fmt: skip
            return runner, Inputs(q, k, v, None)
        kept = self._kept(mask, q)
        if name == "triton":
            runner = TritonBlockSparseRunner(
                runtime_lists(kept), r.block_size, r.is_causal, r.softmax_scale, r.softcap,
                run_time=True,
            )  # fmt: skip
            return runner, Inputs(*(x.contiguous() for x in (q, k, v)), None)
        plan = row_plan(r.query_len, r.key_len, r.block_size, r.is_causal)
        plan_runner = PlanRunner(
            plan, self.kernel.backend, r.softmax_scale, 0.0, "block_sparse_attention", r.softcap
        )
        runner = MaskedRowsRunner(plan_runner)
        rows = per_query_head(kept, q.shape[2])  # the calls' key masks: 1 or H heads
        rows = rows.expand(q.shape[0], *rows.shape[1:])
        return runner, Inputs(*(x.contiguous() for x in (q, k, v)), rows)
