"""``triton``: our own Triton kernels, reading dilated rows through strides (no gathers).

The kernels (``triton_kernels/launchers.py``, imported on first use because it needs the ``triton``
package) run a whole dilated branch per launch and merge into the running output in place
(Note [Strided dilated rows]); ``core/execution/fused.py`` drives them branch by branch (Note [Fused
branch engine]). Dense calls (ring steps, block-sparse pieces, ``attention``) are the one-segment,
rate-1 case of the same kernels.

With ``TRITON_INTERPRET=1`` in the environment (before the first use), Triton's interpreter runs
the kernels on CPU tensors: slow, for debugging and for testing the kernels without a GPU.

Shapes: (B, N, H, D) in and out; ``lse`` (B, H, N) float32.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from ..core.contract import BackwardPart, BranchSpan, Window
from ..core.execution import graphs
from ..core.execution.call_runs import register_in_place_merge
from ..core.execution.streams import side_by_side
from ..core.geometry.slots import register_slot_kernels
from ._compat import _import_failure, _last_dim_contiguous, _release
from .base import Backend, KernelInputs, KernelOutput
from .triton_kernels.compile import prepare_compiler
from .triton_kernels.tiles import (
    MAX_GRID_Y,
    SPLIT_KEY_ROWS,
    Tiles,
    descriptor_forward_config,
    dkdv_config,
    split_key_config,
    tile_configs,
)

_log = logging.getLogger("dilated_attention")

#: Oldest Triton release the kernels are tested with (``input_precision`` on ``tl.dot``).
MIN_TRITON = (3, 0)


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def announcement(family: tuple[Any, ...]) -> tuple[Any, ...]:
    """What the compile message of a shape family tells apart: the family without its segment
    lengths and with each rate only as "1 or not" (the kernels' own classes; Note
    [Specialization and first calls] in ``triton_kernels/launchers.py``). A call shorter than a
    segment runs it clipped to its length (Note [Effective branches] in
    ``core/geometry/segment.py``), so generation that recomputes every step makes a new family per
    length: these get one line.

    Returns:
        ``(device, dtype name, heads, head dim, key/value heads, rate-1 flags, causal, masked,
        grad, packed, chunk, softcap)``.
    """
    device, dtype, (heads, dim), kv_heads, branches, causal, masked, grad, packed, chunk, cap = (
        family
    )
    rate_one = tuple(r == 1 for _, r in branches)
    return (
        device, str(dtype).removeprefix("torch."), heads, dim, kv_heads, rate_one, causal, masked,
        grad, packed, chunk, cap,
    )  # fmt: skip


@functools.cache
def _kernels() -> ModuleType:
    from .triton_kernels import launchers as _triton_kernels

    return _triton_kernels


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """Our Triton kernel module ``triton_kernels.<name>``, imported on first use, or ``None``
    where it cannot be imported (no ``triton`` package): its callers fall back to torch."""
    try:
        return importlib.import_module(f"{__package__}.triton_kernels.{name}")
    except Exception:
        return None


def merge_kernel() -> Callable[..., None] | None:
    """The one-kernel in-place merge of a partial result into float32 accumulators on CUDA
    (``_triton_merge.merge_into``), or ``None`` where Triton cannot be imported."""
    module = kernel_module("merge")
    return None if module is None else module.merge_into


register_in_place_merge("cuda", merge_kernel)


def run_launches(
    key: tuple[Any, ...] | None,
    tensors: Sequence[torch.Tensor | None],
    launches: Callable[[], None],
    keep: object = None,
) -> None:
    """``launches`` (kernels into ``tensors``, allocating nothing that outlives them), replayed
    from a CUDA graph once the same call has run (Note [A call's launches from a CUDA graph] in
    ``core/execution/graphs.py``): for CUDA tensors with Triton importable, outside the
    interpreter, the compile-only dry run and a profiler's launch hook; else launched now.
    ``key`` None: launched now."""
    first = tensors[0]
    kernels = None if key is None or first is None or not first.is_cuda or interpreting() else (
        kernel_module("launchers")
    )  # fmt: skip
    if kernels is None or not kernels.graphable():
        launches()
        return
    graphs.run_launches((*key, kernels.DESCRIPTOR_POLICY), tensors, launches, keep)


def slot_kernels() -> Any:
    """The one-pass merge and sum of branch slots on CUDA (``_triton_merge.SlotKernels``; Note
    [Branch slots merged once] in ``core/geometry/slots.py``), or ``None`` where Triton cannot be
    imported."""
    module = kernel_module("merge")
    return None if module is None else module.SlotKernels()


register_slot_kernels("cuda", slot_kernels)


# Note [Split keys for few queries]
#     The forward kernel runs one program per (query tile, head, batch) and walks all of its keys:
#     a call of one query row (a decoded token) against ten thousand keys is B * H programs,
#     16 on a GPU of 132 SMs, each reading its keys alone. Measured on an H100 for one decoded
#     token of the LongNet schedule (H = 16, D = 128, bf16, ~10K keys per head): 310 us, where
#     the keys' bytes take ~30 us to read. So a non-causal call of at most ``SPLIT_KEY_ROWS``
#     query rows whose (head, batch) programs leave the GPU mostly idle splits its keys into
#     ``S`` runs (:func:`key_splits`) and runs the split runs as the segments of one launch:
#     segment ``s`` is query rows ``[s * n, (s + 1) * n)`` of the queries repeated ``S`` times
#     (a broadcast view for one row) against keys ``[s * L, (s + 1) * L)`` (the kernel's segment
#     addressing, Note [Strided dilated rows], at rate 1). Each run writes a float32 partial
#     output and its log-sum-exp, and one kernel merges the runs (``_triton_merge.merge_splits``,
#     the Note [Merging partial softmaxes] weights) with one rounding into the output. Flash
#     decoding (Dao et al., 2023) splits the same way.


#: Programs a split-key launch aims at per streaming multiprocessor (Note [Split keys for few
#: queries]); on Triton's CPU interpreter, programs in all.
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_PROGRAMS_INTERPRETED = 16
#: Fewest keys per split run.
SPLIT_MIN_KEYS = 128


@functools.cache
def _streaming_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def key_splits(q: torch.Tensor, key_len: int, is_causal: bool) -> int:
    """Into how many runs a forward call of ``q`` (B, Nq, H, D) against ``key_len`` keys splits
    its keys (Note [Split keys for few queries]); 1: not split."""
    batch, query_len, heads, _ = q.shape
    if is_causal or query_len > SPLIT_KEY_ROWS or batch * heads == 0:
        return 1
    if q.is_cuda:
        target = SPLIT_PROGRAMS_PER_SM * _streaming_multiprocessors(q.device.index)
    else:
        target = SPLIT_PROGRAMS_INTERPRETED
    splits = min(-(-target // (batch * heads)), key_len // SPLIT_MIN_KEYS)
    if splits < 2:
        return 1
    return -(-key_len // -(-key_len // splits))  # no empty run


def _tiles(x: torch.Tensor) -> Tiles:
    """The tile table's entry for ``x``'s GPU, head dim and dtype (``triton_kernels/tiles.py``)."""
    return _tile_entry(x.device.index if x.is_cuda else None, x.shape[-1], x.dtype)


@functools.cache  # every launch asks
def _tile_entry(device_index: int | None, head_dim: int, dtype: torch.dtype) -> Tiles:
    capability = None if device_index is None else _kernels()._capability(device_index)
    return tile_configs(capability, head_dim, dtype)


class TritonBackend(Backend):
    """Our Triton kernels: strided dilated rows, in-place branch merging, GQA, causal, key padding
    masks; fused dilated branches through ``core/execution/fused.py``."""

    name = "triton"
    reads_strided_rows = True  # any strides with the last dim contiguous (decoding's row views)
    description = (
        "our Triton kernels: reads dilated rows through strides and merges branches in place"
    )
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    max_head_dim = 256
    min_compute_capability = (8, 0)
    supports_rectangular_causal = True
    supports_mask = True
    # Forward and backward, dense and fused (Note [Soft-capped scores in the kernels]); windows
    # on dense calls, tiles outside skipped (Note [Local windows in the kernels]).
    supports_softcap = True
    supports_window = True
    native_gqa = True
    aux_only_for_dropout = True  # no aux at all
    empty_rows_have_neg_inf_lse = True

    def import_reasons(self) -> list[str]:
        try:
            import triton
        except Exception as exc:
            return [_import_failure("triton", exc)]
        if _release(triton.__version__) < MIN_TRITON:
            need = ".".join(map(str, MIN_TRITON))
            return [f"triton {triton.__version__} is older than {need}"]
        try:
            _kernels()
        except Exception as exc:
            return [_import_failure("dilated_attention's Triton kernels", exc)]
        return []

    def __init__(self) -> None:
        if interpreting():  # an instance attribute: the class constant stays CUDA-only
            self.devices = frozenset({"cuda", "cpu"})
        self._families: set[tuple[Any, ...]] = set()
        self._announced: set[tuple[Any, ...]] = set()

    def probe(self, device: torch.device) -> None:
        """On CUDA: compile and launch one small kernel (the backward's row delta) and check its
        numbers, i.e. whether Triton compiles for and runs on ``device``. The attention kernels
        compile with the first call of each shape family, together (``compile_ahead``); the
        forward-and-backward probe of ``Backend.probe`` compiled four more kernels first, 3 s of
        a fresh process's first call on an H100 (``benchmarks/results/first_call_h100.json``).
        Triton's once-per-process state is filled first, side by side (Note [The compiler's
        first use] in ``triton_kernels/compile.py``). Elsewhere (the interpreter):
        ``Backend.probe``."""
        if device.type != "cuda" or interpreting():
            super().probe(device)
            return
        prepare_compiler(torch.cuda.get_device_capability(device))
        # Inputs made and checked on the CPU: a first call loads no other CUDA kernels.
        out = torch.linspace(-1.0, 1.0, 2 * 8 * 2 * 64).view(2, 8, 2, 64).half()
        dout = out.flip(-1)
        delta = _kernels().row_delta(out.to(device), dout.to(device), 0, 8).cpu()  # (B, H, N)
        expected = (out.float() * dout.float()).sum(-1).transpose(1, 2)
        if not torch.allclose(delta, expected, rtol=1e-3, atol=1e-3):
            raise RuntimeError(f"Triton's row-delta kernel computed wrong numbers on {device}")

    def begin_compile(self, family: tuple[Any, ...]) -> AbstractContextManager[None] | None:
        """See ``FusedBackend.begin_compile`` in ``core/contract.py``: once per family and
        process, returns the kernels' compile-only context (none under the interpreter, which
        compiles nothing), and logs a line: at WARNING for the first family of its
        :func:`announcement` (the family up to segment lengths), at DEBUG after that."""
        if interpreting() or family in self._families:
            return None
        self._families.add(family)
        key = announcement(family)
        device, dtype, heads, dim, kv_heads, _, causal, masked, grad, packed, chunk, cap = key
        _log.log(
            logging.DEBUG if key in self._announced else logging.WARNING,
            "dilated_attention: compiling the Triton kernels of a new shape family on %s "
            "(%s, %d heads, %d key/value heads, head dim %d, branches %s, causal=%s, mask=%s, "
            "packed documents=%s, softcap=%s, %s); once per process and family (families that "
            "differ only in segment lengths, as a shorter call clips them, at DEBUG), and "
            "compiled kernels are cached on disk by Triton (TRITON_CACHE_DIR)",
            device, dtype, heads, kv_heads, dim, list(family[4]), causal, masked, packed, cap,
            "a chunk's forward" if chunk else "forward and backward" if grad else "forward",
        )  # fmt: skip
        self._announced.add(key)
        return _kernels().compile_ahead()

    def capability_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = super().capability_reasons(inputs)
        if inputs.device.type == "cpu" and inputs.dtype == torch.bfloat16:
            reasons.append("Triton's interpreter cannot compute bfloat16 (numpy has none)")
        if inputs.batch > MAX_GRID_Y:
            reasons.append(
                f"{inputs.batch} batch rows: its launches hold at most {MAX_GRID_Y} on a CUDA grid "
                f"axis (call with fewer rows at a time)"
            )
        return reasons

    # -- the static decode step (core/decoding/static_cache.py)
    # --------------------------------------------
    reads_decode_buffers = True  # decode_step: a static step's keys read in place

    def decode_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        positions: torch.Tensor,
        slots: tuple[torch.Tensor, ...],
        scale: float,
        row_offsets: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per batch row against a static cache's buffers, every branch in one
        launch reading the rows in place (Note [A decode kernel reading the buffers in place]
        in ``triton_kernels/decode.py``): q (B, 1, H, D), k and v (B, R, Hkv, D), key_padding_mask
        (B, R) bool or None, positions (B,) int64, ``slots`` the step's ``token_slots``,
        row_offsets (B,) int64 or None, ``softcap`` or None, sinks (H,) or None (joined, no
        gradient) -> out (B, 1, H, D), lse (B, H, 1) float32."""
        from .triton_kernels.decode import decode_step

        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        return decode_step(
            q, k, v, key_padding_mask, positions, slots, scale, row_offsets, softcap, sinks
        )

    # -- fused dilated branches (core/execution/fused.py)
    # ---------------------------------------------------
    def forward_branch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        key_mask: torch.Tensor | None,
        span: BranchSpan,
        *,
        out_row0: int,
        scale: float,
        is_causal: bool,
        merge: bool,
        head0: int = 0,
        merge_from: torch.Tensor | None = None,
        merge_row0: int = 0,
        q_row0: int = 0,
        softcap: float | None = None,
    ) -> None:
        """See ``FusedBackend.forward_branch`` in ``core/contract.py``; launched through
        bound launches (Note [Bound launches] in ``triton_kernels/launch.py``)."""
        kernels = _kernels()
        roles = (q, k, v, out, lse, key_mask, merge_from)
        site = kernels.site_key(
            "forward_branch", roles, _span_key(span), out_row0, scale, is_causal, merge, head0,
            merge_row0, q_row0, softcap, kernels.DESCRIPTOR_POLICY,
        )  # fmt: skip

        def body() -> None:
            configs = _tiles(q)
            kernels.forward_branch(
                q, k, v, out, lse, key_mask, _branch(span), out_row0=out_row0, scale=scale,
                is_causal=is_causal, merge=merge, config=configs["forward"],
                descriptor_config=descriptor_forward_config(configs, is_causal=is_causal),
                head0=head0, merge_from=merge_from, merge_row0=merge_row0, q_row0=q_row0,
                softcap=softcap,
            )  # fmt: skip

        kernels.run_bound(site, roles, body, _span_constants(span))

    def row_delta(
        self, out: torch.Tensor, dout: torch.Tensor, start: int, end: int, delta: torch.Tensor
    ) -> None:
        """``delta`` (B, H, end - start) float32 := ``rowsum(out * dout)`` of rows
        ``[start, end)``."""
        kernels = _kernels()
        roles = (out, dout, delta)
        site = kernels.site_key("row_delta", roles, start, end)
        kernels.run_bound(site, roles, lambda: kernels.row_delta(out, dout, start, end, delta))

    def run_launches(
        self,
        key: tuple[Any, ...] | None,
        tensors: Sequence[torch.Tensor | None],
        launches: Callable[[], None],
        keep: object = None,
    ) -> None:
        """See ``KernelBackend.run_launches`` in ``core/contract.py``: :func:`run_launches`."""
        run_launches(key, tensors, launches, keep)

    def backward_branch(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        key_mask: torch.Tensor | None,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        span: BranchSpan,
        *,
        delta_row0: int,
        grad_row0: int,
        scale: float,
        is_causal: bool,
        accumulate: bool,
        head0: int = 0,
        softcap: float | None = None,
        part: BackwardPart = "both",
    ) -> None:
        """See ``FusedBackend.backward_branch`` in ``core/contract.py``; launched through
        bound launches (Note [Bound launches] in ``triton_kernels/launch.py``)."""
        kernels = _kernels()
        roles = (dout, q, k, v, lse, delta, key_mask, dq, dk, dv)
        site = kernels.site_key(
            "backward_branch", roles, _span_key(span), delta_row0, grad_row0, scale, is_causal,
            accumulate, head0, softcap, part,
        )  # fmt: skip

        def body() -> None:
            configs = _tiles(q)
            kernels.backward_branch(
                dout, q, k, v, lse, delta, key_mask, dq, dk, dv, _branch(span),
                delta_row0=delta_row0, grad_row0=grad_row0, scale=scale, is_causal=is_causal,
                accumulate=accumulate, config_dq=configs["dq"], head0=head0, softcap=softcap,
                config_dkdv=dkdv_config(configs, is_causal=is_causal, rate=span.rate), part=part,
            )  # fmt: skip

        kernels.run_bound(site, roles, body, _span_constants(span))

    # -- dense calls ------------------------------------------------------------------------------
    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        is_causal: bool,
        key_mask: torch.Tensor | None,
        dropout_p: float,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> KernelOutput:
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        batch, query_len, heads, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, query_len, dtype=torch.float32, device=q.device)
        configs = _tiles(q)
        # A window reads only the keys it reaches: no split (its runs would each need a window)
        splits = 1 if window is not None else key_splits(q, k.shape[1], is_causal)
        if splits > 1:
            _split_key_forward(q, k, v, key_mask, out, lse, splits, scale, configs, softcap)
            return KernelOutput(out, lse)
        _kernels().forward_branch(
            q, k, v, out, lse, key_mask, _dense_branch(query_len, k.shape[1]), out_row0=0,
            scale=scale, is_causal=is_causal, merge=False, config=configs["forward"],
            descriptor_config=descriptor_forward_config(configs, is_causal=is_causal),
            softcap=softcap, window=window,
        )  # fmt: skip
        return KernelOutput(out, lse)

    def _backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        *,
        scale: float,
        is_causal: bool,
        key_mask: torch.Tensor | None,
        dropout_p: float,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        lse = lse.float()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        configs = _tiles(q)
        kernels = _kernels()
        delta = kernels.row_delta(out, dout, 0, q.shape[1])
        branch = _dense_branch(q.shape[1], k.shape[1])

        def launch(part: BackwardPart) -> None:
            kernels.backward_branch(
                dout, q, k, v, lse, delta, key_mask, dq, dk, dv, branch, delta_row0=0,
                grad_row0=0, scale=scale, is_causal=is_causal, accumulate=False,
                config_dkdv=dkdv_config(configs, is_causal=is_causal, rate=1),
                config_dq=configs["dq"], softcap=softcap, window=window, part=part,
            )  # fmt: skip

        side_by_side(q.device, lambda: launch("keys"), lambda: launch("queries"))
        return dq, dk, dv


def _split_key_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    splits: int,
    scale: float,
    configs: Tiles,
    softcap: float | None = None,
) -> None:
    """A non-causal forward with its keys in ``splits`` runs (Note [Split keys for few
    queries]), written into ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq)."""
    from .triton_kernels.merge import merge_splits

    batch, query_len, heads, dim = q.shape
    run = -(-k.shape[1] // splits)
    # Run s reads query rows [s * Nq, (s + 1) * Nq): one row is a broadcast view, more a copy.
    rows = q.expand(batch, splits, heads, dim) if query_len == 1 else q.repeat(1, splits, 1, 1)
    part = torch.empty(batch, splits * query_len, heads, dim, dtype=torch.float32,
                       device=q.device)  # fmt: skip
    part_lse = torch.empty(batch, heads, splits * query_len, dtype=torch.float32, device=q.device)
    kernels = _kernels()
    branch = kernels.Branch(0, query_len, run, splits * query_len, k.shape[1], 1)
    kernels.forward_branch(
        rows, k, v, part, part_lse, key_mask, branch, out_row0=0, scale=scale, is_causal=False,
        merge=False, config=split_key_config(configs), allow_descriptors=False, softcap=softcap,
    )  # fmt: skip
    merge_splits(part, part_lse, out, lse)


def _span_key(span: BranchSpan) -> tuple[int, ...]:
    """A span as a key: its segment table by identity (kept alive by the bound launches)."""
    return (span.start, span.end, span.segment_len, span.rate, id(span.bounds))


def _span_constants(span: BranchSpan) -> tuple[torch.Tensor, ...]:
    return () if span.bounds is None else (span.bounds,)


def _branch(span: BranchSpan) -> Any:
    if span.bounds is None:
        return _sequence_branch(span.start, span.end, span.segment_len, span.rate)
    return _kernels().Branch(
        span.start, span.segment_len, span.segment_len, span.end, span.end, span.rate, span.bounds
    )


@functools.lru_cache(maxsize=1024)  # every launch asks
def _sequence_branch(start: int, end: int, segment_len: int, rate: int) -> Any:
    return _kernels().Branch(start, segment_len, segment_len, end, end, rate)


def _dense_branch(query_len: int, key_len: int) -> Any:
    return _kernels().Branch(0, query_len, key_len, query_len, key_len, 1)


#: Query/key rows of the block-sparse kernels' tiles (``triton_kernels/block_sparse.py``).
BLOCK_SPARSE_TILE_ROWS = 64
BLOCK_SPARSE_MAX_HEAD_DIM = 128


def block_sparse_reasons(backend: Backend, inputs: KernelInputs) -> list[str]:
    """Why the block-sparse Triton kernels cannot run ``inputs`` (``inputs.block_size`` tokens
    per block); empty when they can. ``backend``: the registered ``triton`` backend, whose
    device, compiler and probe reasons come first."""
    reasons = backend.not_supported_reasons(replace(inputs, is_causal=False, has_mask=False))
    if inputs.window:  # soft-capping they take (Note [Soft-capped scores in the kernels])
        reasons.append("no local window in the block-sparse Triton kernels")
    if inputs.block_size is None or inputs.block_size % BLOCK_SPARSE_TILE_ROWS:
        reasons.append(
            f"block_size {inputs.block_size} is not a multiple of {BLOCK_SPARSE_TILE_ROWS} (the "
            "block-sparse Triton kernels' tile rows)"
        )
    if inputs.head_dim > BLOCK_SPARSE_MAX_HEAD_DIM:
        reasons.append(
            f"head_dim {inputs.head_dim} > {BLOCK_SPARSE_MAX_HEAD_DIM} (the block-sparse Triton "
            "kernels' tiles)"
        )
    if inputs.device.type == "cuda" and inputs.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(
            f"dtype {str(inputs.dtype).removeprefix('torch.')}: the block-sparse Triton kernels "
            "take float16/bfloat16 on CUDA (float32 tiles do not fit in shared memory)"
        )
    return reasons
