"""The fused engine as a plan's kernel: :class:`FusedRunner` (forward, backward and the
differentiable recompute of a dilated plan, and ``compile_ahead``: a shape family's kernels
compiled together before its first call).

Shape legend: B batch, N seq_len, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ..autograd import Backward, Forward, Grads, Inputs, Saved
from ..contract import FusedBackend
from ..geometry.documents import document_groups
from ..geometry.segment import group_calls, plan_branches
from ..higher_order import differentiable_grads, no_higher_order_message
from .fused import ChunkQueries, fused_backward, fused_forward

__all__ = ["FusedRunner"]

_SOFTCAP_MESSAGE = no_higher_order_message(
    "dilated_attention with softcap",
    "the differentiable recompute of the gradients applies causality and key masks only",
    "Call it without softcap for a gradient penalty or other double backward.",
)


@dataclass(frozen=True)
class FusedRunner:
    """The dilated registry's plan kernel as a :class:`~dilated_attention.core.autograd.Runner`:
    :func:`fused_forward` / :func:`fused_backward` over ``branches`` ((w, r) pairs); under
    ``create_graph=True`` the recompute over the branches' row groups (Note [Double
    backward]). ``documents``: packed documents' offsets, or None; ``first_head``: the layer
    head that q's head 0 is (Note [Heads from a later layer head]); ``chunk``: a chunk's
    queries, forward only (Note [A chunk in one fused forward]), or None; ``softcap``: every
    branch's scores soft-capped, or None (then no differentiable recompute: it knows causality
    and key masks only)."""

    branches: tuple[tuple[int, int], ...]
    backend: FusedBackend
    is_causal: bool
    scale: float
    documents: tuple[int, ...] | None = None
    first_head: int = 0
    chunk: ChunkQueries | None = None
    softcap: float | None = None

    @property
    def first_order_message(self) -> str:
        return "" if self.softcap is None else _SOFTCAP_MESSAGE

    def compile_ahead(self, x: Inputs, needs_grad: bool) -> None:
        """Compile every kernel a call of this shape family runs, together, before its first
        call.

        Note [Compiling a shape family ahead]
            A backend that compiles its kernels on first use (Triton) would otherwise compile
            them one after another as the engine reaches each launch: 12 to 15 kernels for a
            LongNet schedule, 23-29 s in bfloat16 on an H100 (``benchmarks/bench_first_call.py``).
            Instead the engine runs once with the backend's launches turned into compiles,
            which the backend runs concurrently, and then runs for real. A family is what the
            kernels specialize on, not the sequence length (Note [Specialization and first
            calls] in ``backends/triton_kernels/launchers.py``). The dry run writes into buffers
            of its own, which it drops; the inputs are only read.

        Args:
            x: the call's own inputs, q (B, N, H, D), k and v (B, N, Hkv, D), the key padding
                mask or None (their alignment and strides are part of what the kernels
                specialize on).
            needs_grad: also compile the backward's kernels.
        """
        q, k, _, key_padding_mask = x
        family = (
            q.device, q.dtype, q.shape[2:], k.shape[2], tuple(self.branches), self.is_causal,
            key_padding_mask is not None, needs_grad, self.documents is not None,
            self.chunk is not None, self.softcap is not None,
        )  # fmt: skip
        compiling = self.backend.begin_compile(family)
        if compiling is not None:
            self._dry_run(x, needs_grad, compiling)

    # A host-side dry run, once per shape family: never traced. Only the dry run is kept from
    # torch.compile: its wrapper costs host time on every call it wraps.
    @torch.compiler.disable
    def _dry_run(
        self, x: Inputs, needs_grad: bool, compiling: AbstractContextManager[None]
    ) -> None:
        """:meth:`compile_ahead`'s run of the engine with the backend's launches turned into
        compiles (``compiling``)."""
        q, k, v, key_padding_mask = x
        with torch.no_grad(), compiling:
            out, lse = fused_forward(
                q, k, v, key_padding_mask, self.branches, self.backend, is_causal=self.is_causal,
                scale=self.scale, documents=self.documents, chunk=self.chunk,
                softcap=self.softcap,
            )  # fmt: skip
            if needs_grad:
                fused_backward(
                    out, q, k, v, out, lse, key_padding_mask, self.branches, self.backend,
                    is_causal=self.is_causal, scale=self.scale, documents=self.documents,
                    softcap=self.softcap,
                )  # fmt: skip

    def forward(self, x: Inputs) -> Forward:
        q, k, v, key_padding_mask = x
        out, lse = fused_forward(
            q, k, v, key_padding_mask, self.branches, self.backend, is_causal=self.is_causal,
            scale=self.scale, documents=self.documents, first_head=self.first_head,
            chunk=self.chunk, softcap=self.softcap,
        )  # fmt: skip
        return Forward(out, lse, saved=(k, v, key_padding_mask))

    def _check_backward(self) -> None:
        if self.chunk is not None:  # the resolver runs such chunks without gradients
            raise RuntimeError("a chunk's fused forward has no backward: run decoding rows")

    def backward(self, b: Backward) -> Grads:
        self._check_backward()
        dout, q, out, lse, saved, _ = b
        k, v, key_padding_mask = saved
        return fused_backward(
            dout.contiguous(), q, k, v, out, lse, key_padding_mask, self.branches, self.backend,
            is_causal=self.is_causal, scale=self.scale, documents=self.documents,
            first_head=self.first_head, softcap=self.softcap,
        )  # fmt: skip

    def saved_without_forward(self, x: Inputs) -> Saved | None:
        return None if self.chunk is not None else (x.k, x.v, x.key_padding_mask)

    def differentiable_backward(self, b: Backward) -> Grads | None:
        self._check_backward()
        if self.softcap is not None:
            return None  # the recompute knows causality and key masks only
        dout, q, _, lse, saved, _ = b
        k, v, key_padding_mask = saved
        segs, rates = zip(*self.branches, strict=True)
        if self.documents is None:
            plan = plan_branches(q.shape[1], q.shape[2], segs, rates, self.first_head)
        else:
            plan = document_groups(self.documents, q.shape[2], segs, rates)
        calls = [
            call.row_call(q, k) for call in group_calls(plan, k.shape[2], q.device, self.is_causal)
        ]
        return differentiable_grads(
            dout, q, k, v, lse, calls, scale=self.scale, key_padding_mask=key_padding_mask
        )
