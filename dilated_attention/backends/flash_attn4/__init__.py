"""``flash_attn4``: FlashAttention-4 (``flash_attn.cute``, CuTe DSL, ``pip install flash-attn-4``).

Kernels are compiled just in time for Hopper (sm90) and Blackwell (sm100). This calls
``flash_attn.cute.interface._flash_attn_fwd`` with ``return_lse=True`` and
``_flash_attn_bwd(q, k, v, out, dout, lse, ...)``, the low-level backward that takes ``out`` and
``lse`` as inputs (the hook for merged statistics) and returns ``(dq, dk, dv)``. Arguments are
bound by name (``flash_attn2._bind``): the interface is still beta and its keyword lists grow.

Shapes: q (B, Nq, H, D), k/v (B, Nk, Hkv, D), out (B, Nq, H, D), lse (B, H, Nq) float32; the
(B, N, H, D) layout goes in without transposes. Causal masking is bottom-right aligned, so only
square causal calls are accepted. No dropout; GQA is native.

Note [FlashAttention-4 key padding]
    A key padding mask (B, 1 or H, Nk) reaches the kernel as a ``mask_mod`` reading it from an
    ``aux_tensors`` int32 copy: a score is kept where its key is not ignored (and, for a causal
    call, where the key is at or before the query: a ``mask_mod`` replaces FA4's own causal
    mask). Every tile then evaluates the mask, causal tiles above the diagonal included.
    Variable-length calls (``cu_seqlens_k``) would skip the padding instead of masking it, but
    express only padding at the end of each row, not an arbitrary mask. Tested on sm90 only, so
    masks are a reason on other architectures; packed GQA is off for masked calls (a per-head
    mask reads the query head).

Head dims (as of flash-attn-4 4.0.0b36): sm90 up to 256; sm100 up to 128, or exactly 256 (192
only with a 128 value dim, which this library never asks for). Training on sm90 needs head dims
of at least 32 (Note [FlashAttention-4 small head dims]).

Note [FlashAttention-4 small head dims]
    flash-attn-4 4.0.0b36's sm90 backward returns a wrong dq for head dims 8 and 16 once the
    queries span more than one 64-row block: on an H100 (bf16, B = 1, H = 2, against float64
    SDPA) the relative error of dq was 0.38-1.10 at N = 93, 128, 150 and 200, causal and not,
    while dk, dv and the forward stayed within 0.01, and every head dim from 32 up was within
    0.011 (``findings_h100``: "FlashAttention-4 sm90 backward at small head dims"). So a call
    that will be differentiated with a head dim below :data:`SM90_MIN_TRAINING_HEAD_DIM` is a
    reason on sm90 and another kernel trains it; forward-only calls keep FA4.

Note [FlashAttention-4 block sparsity]
    ``block_sparse_forward`` / ``block_sparse_backward`` run block-sparse attention as FA4's own
    block sparsity: per 128-row query tile the forward walks the key tiles of its lists, "full"
    tiles unmasked and "partial" ones through a ``mask_mod``; the backward walks, per 128-row
    key tile, its query tiles (the same lists transposed; Note [Kernel tiles of a block mask] in
    ``block_sparse/tiles.py``). The only ``mask_mod`` here is top-left causal (key ``n`` seen by
    query ``m`` when ``n <= m``), compiled once, so block sizes must be multiples of 128 (every
    other tile is full or skipped) and rectangular causal calls are exact. Calls pass
    ``pack_gqa=False``: packed GQA heads would change what a query tile is. This is set up for
    sm90, whose forward (128 x 128 for head dims up to 128) and backward tiles (64 or 128
    query rows by 128 keys) divide 128 x 128; sm100 takes block sparsity at 256 query rows.

Note [FlashAttention-4's compile warnings]
    Compiling a kernel, the CuTe DSL warns (``UserWarning``) that FA4's ``aux_data`` argument
    (a NamedTuple of the ``mask_mod``'s tensors) "cannot be converted to a JitArgument": two
    lines on a process's first forward and backward, about FA4's code, which the user cannot
    act on. Every call into FA4 first makes sure a filter of that one message leads the warnings
    filters (:func:`_filter_dsl_warning`; a filter the user adds later still comes first); any
    other warning passes. The filter is global rather than a ``catch_warnings`` around each call,
    which would reset Python's record of warnings already shown once and is not thread-safe.

Note [A whole call's launches from a CUDA graph]
    FA4's entry points spend ~0.1-0.4 ms of Python per call on the host, more than cuDNN's
    through SDPA, and at 4K-16K tokens that is as long as the kernel runs. So a whole call (dense
    ``attention()``, or a call of a plan not run in slots) allocates its results first (out and
    lse; dq, dk and dv) and runs FA4's call into them through ``run_launches``, which replays it
    from a CUDA graph once the same call has run at the same addresses (Note [A call's launches
    from a CUDA graph] in ``core/execution/graphs.py``): the key is the call's options (scale,
    causality, soft-cap, window), the tensors q, k, v, the key mask, the results (and for the
    backward dout, out and lse). The backward's finite stand-in for the lse (``finite_lse``,
    one launch that :meth:`Backend.backward` would make before the call) runs inside the
    launches too (a slotted plan's calls make it before their calls). What FA4's backward
    allocates inside (its float32 dQ accumulator, twice q's bytes, and that stand-in; a chunked
    call's accumulators and a later part's dk and dv) lives in the stream's shared pool (Note
    [Graphs share one memory pool per stream]) and stays reserved there. So a backward in chunks
    of heads (Note [FlashAttention-4's accumulators by head chunks]) replays only where each
    chunk adds less than ``MAX_REPLAYED_CHUNK_BYTES`` (``chunks.replayable``), the most an
    unchunked call below the chunks' floor keeps there; past it, the pool would keep up to 14%
    of the call's unavoidable bytes, and its kernels take a hundred milliseconds or more, which
    hide its host time. Measured on an H200 (16 query heads, D = 128, causal, forward+backward
    back to back, two alternating rounds), a backward's chunks replayed took the host time of a
    step from 2.5-3.2 to 0.57-0.65 ms at 64K tokens with 4 key/value heads (8 chunks), from 1.3
    to 0.57-0.73 with 16 (2 chunks) and from 3.0-3.5 to 0.62-0.70 at 128K with 4 (SDPA on cuDNN:
    0.30-0.54), the GPU's time within 0.5% and the peak the same, the pool 182-342 MiB larger. A
    slotted plan's calls write into buffers they are given and run inside their
    plan's own closure (Note [A slotted call's launches from a CUDA graph] in
    ``core/execution/executor.py``). Measured on an H200 (D = 128, causal, calls back to back):
    a forward's host time 0.08-0.13 ms where launching took 0.15-0.27 (SDPA's own 0.04-0.08),
    a forward+backward's 0.59-0.86 ms where it took 1.04-1.33, at 4K-32K.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ...core.autograd import Grads
from ...core.contract import Window
from .._compat import (
    _bind,
    _capability,
    _grads_from,
    _import_failure,
    _last_dim_contiguous,
    _parameters,
)
from ..base import Backend, KernelInputs, KernelOutput, finite_lse
from ..triton import TritonBackend
from .chunks import ListBytes, head_chunks, no_lists, replayable

_HALF = frozenset({torch.float16, torch.bfloat16})
_MAJORS = (9, 10)
#: The smallest head dim whose sm90 backward is right (Note [FlashAttention-4 small head dims]).
SM90_MIN_TRAINING_HEAD_DIM = 32


#: Rows of the tiles block sparsity is given at, query and key (Note [FlashAttention-4 block
#: sparsity]), and the largest head dim whose sm90 tiles divide them.
SPARSE_TILE = 128
SPARSE_MAX_HEAD_DIM = 128


#: The CuTe DSL's warning about FA4's ``aux_data`` argument (Note [FlashAttention-4's compile
#: warnings]), as ``warnings.filterwarnings`` matches it (from the message's start). In
#: nvidia-cutlass-dsl 4.8.1: "Argument aux_data (position N) cannot be converted to a
#: JitArgument for function '...'. Its type `...AuxData` is not supported. ..."
AUX_DATA_WARNING = r"Argument aux_data\b.*\bJitArgument\b"


def _filter_dsl_warning() -> None:
    """Put a filter for the CuTe DSL's ``aux_data`` warning first in the warnings filters,
    unless one is there (Note [FlashAttention-4's compile warnings])."""
    for action, message, category, _, _ in warnings.filters:
        pattern = getattr(message, "pattern", message)
        if action == "ignore" and pattern == AUX_DATA_WARNING and category is UserWarning:
            return
    warnings.filterwarnings("ignore", message=AUX_DATA_WARNING, category=UserWarning)


def _interface() -> ModuleType:
    # Imported here, never at module import: it pulls in the CuTe DSL (cutlass, cuda-python).
    _filter_dsl_warning()
    return importlib.import_module("flash_attn.cute.interface")


class SparseTiles(NamedTuple):
    """One direction's tile lists, int32 on the device (Note [Kernel tiles of a block mask]):
    per row tile, ``partial_count`` (1, 1, R) and ``partial_index`` (1, 1, R, C) of the tiles
    that need the mask, ``full_count`` / ``full_index`` of those that do not. Forward: R query
    tiles listing key tiles; backward: R key tiles listing query tiles."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor


@functools.cache
def _top_left_causal() -> Any:
    """The CuTe DSL ``mask_mod`` of a top-left causal mask, made once (its hash is part of the
    compiled kernel's key)."""
    cute = importlib.import_module("cutlass.cute")

    @cute.jit  # type: ignore[misc]
    def top_left_causal(batch: Any, head: Any, m_idx: Any, n_idx: Any, seqlen_info: Any,
                        aux_tensors: Any) -> Any:  # fmt: skip
        return n_idx <= m_idx

    return top_left_causal


@functools.cache
def _key_padding(per_head: bool, causal: bool) -> Any:
    """The CuTe DSL ``mask_mod`` of a key padding mask in ``aux_tensors[0]`` (B, Hm, Nk) int32,
    nonzero = ignore (Note [FlashAttention-4 key padding]), made once per variant."""
    cutlass = importlib.import_module("cutlass")
    cute = importlib.import_module("cutlass.cute")
    utils = importlib.import_module("flash_attn.cute.utils")

    @cute.jit  # type: ignore[misc]
    def key_padding(batch: Any, head: Any, m_idx: Any, n_idx: Any, seqlen_info: Any,
                    aux_tensors: Any) -> Any:  # fmt: skip
        key = cutlass.min(n_idx[0], seqlen_info.seqlen_k - 1)  # tile columns past the keys
        ignored = aux_tensors[0][batch[0], head[0] if per_head else 0, key]
        keep = utils.scalar_to_ssa(ignored, cutlass.Int32) == utils.scalar_to_ssa(0, cutlass.Int32)
        if causal:
            keep = keep & (n_idx <= m_idx)
        return keep

    return key_padding


def aux_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """``key_mask`` (B, Hm, Nk) bool as FA4's aux tensor: int32 with row-major strides on
    every dimension, its key dimension named as the stride-1 one (``__leading_dim__``). A
    gathered call's mask can have stride 1 on a size-1 head dimension too (``.contiguous()``
    keeps such a view), and every dimension of a one-key call's mask has stride 1 (a packed
    document of one token): the CuTe DSL refuses an aux tensor with no unique stride-1
    dimension unless it is named."""
    aux = key_mask.to(torch.int32, memory_format=torch.contiguous_format)
    aux.__leading_dim__ = aux.ndim - 1  # type: ignore[attr-defined]
    return aux


def _masked(values: dict[str, Any], key_mask: torch.Tensor | None, is_causal: bool) -> None:
    """Add ``key_mask`` (B, Hm, Nk) bool to a call's ``values`` as a ``mask_mod`` (Note
    [FlashAttention-4 key padding])."""
    if key_mask is None:
        return
    values.update(
        mask_mod=_key_padding(key_mask.shape[1] > 1, is_causal), causal=False, pack_gqa=False,
        aux_tensors=[aux_mask(key_mask)],
    )  # fmt: skip


def tiles_of_heads(tiles: SparseTiles, heads: slice) -> SparseTiles:
    """The lists of query heads ``heads`` (lists shared by every head stay whole)."""
    return SparseTiles(*(t if t.shape[1] == 1 else t[:, heads].contiguous() for t in tiles))


def _backward_calls(
    chunks: list[tuple[slice, slice]],
    grads: Grads,
    arguments: Callable[[slice, slice], dict[str, Any]],
) -> Grads:
    """FA4's backward once per chunk ``(query heads, key/value heads)`` (Note
    [FlashAttention-4's accumulators by head chunks]), with ``arguments(heads, kv_heads)``, each
    writing its heads' rows of ``grads`` (dq (B, Nq, H, D), dk and dv (B, Nk, Hkv, D)); a
    later part of a group writes its dk and dv beside them, added there after its call. A
    release that returns gradients of its own has them copied there, unless one call covers
    every head: then they are returned as they are."""
    bwd = _interface()._flash_attn_bwd
    dq, dk, dv = grads
    written_kv: set[int] = set()
    sums: tuple[torch.Tensor, torch.Tensor] | None = None
    for heads, kv in chunks:
        rows = target = dk[:, :, kv], dv[:, :, kv]
        later = kv.start in written_kv  # a later part of the group: into the sums, then added
        if later:
            sums = sums or (torch.empty_like(rows[0]), torch.empty_like(rows[1]))
            target = sums
        into = dq[:, :, heads], *target
        values = {**arguments(heads, kv), "dq": into[0], "dk": into[1], "dv": into[2]}
        written = _grads_from(bwd(**_bind(bwd, values)), *into)
        if len(chunks) == 1 and written[0].shape == dq.shape:
            return written
        _written(written, into)
        if later:
            rows[0].add_(into[1])
            rows[1].add_(into[2])
        written_kv.add(kv.start)
    return grads


def _sparse_tensors(tiles: SparseTiles) -> Any:
    sparsity = importlib.import_module("flash_attn.cute.block_sparsity")
    return sparsity.BlockSparseTensorsTorch(
        mask_block_cnt=tiles.partial_count, mask_block_idx=tiles.partial_index,
        full_block_cnt=tiles.full_count, full_block_idx=tiles.full_index,
        block_size=(SPARSE_TILE, SPARSE_TILE),
    )  # fmt: skip


class FlashAttn4Backend(Backend):
    """FlashAttention-4 (``flash_attn.cute``): sm90/sm100, fp16/bf16, forward and backward."""

    name = "flash_attn4"
    reads_strided_rows = True  # any strides with the last dim contiguous
    writes_into = True  # out / lse and dq / dk / dv of any aligned strides, last dim contiguous
    description = "FlashAttention-4 (flash_attn.cute, CuTe DSL), sm90/sm100; native GQA"
    devices = frozenset({"cuda"})
    dtypes = _HALF
    max_head_dim = 256
    head_dim_multiple = 8
    min_compute_capability = (9, 0)
    supports_mask = True  # through a mask_mod (Note [FlashAttention-4 key padding])
    supports_rectangular_causal = False
    supports_dropout = False
    aux_only_for_dropout = True  # no aux at all
    supports_softcap = True  # its softcap score_mod, forward and backward
    supports_window = True  # window_size_left / right, bottom-right aligned like ours
    native_gqa = True
    finite_lse_inside = True  # in _backward: in a whole call's graph, one launch less per call

    def import_reasons(self) -> list[str]:
        try:
            mod = _interface()
            fwd_params = _parameters(mod._flash_attn_fwd)
            bwd_params = _parameters(mod._flash_attn_bwd)
        except Exception as exc:  # any import-time failure is a reason, never a crash
            return [_import_failure("flash_attn.cute", exc)]
        missing = sorted({"softmax_scale", "causal"} - fwd_params.keys())
        # The backward must take out and lse as inputs: that is how merged statistics get in.
        missing += sorted({"out", "dout", "lse", "softmax_scale", "causal"} - bwd_params.keys())
        if missing:
            return [f"flash_attn.cute.interface entry points lack parameters {missing}"]
        return []

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        cc = _capability(inputs)
        if cc is not None and cc >= (9, 0):
            if cc[0] not in _MAJORS:
                return [f"needs compute capability sm90 or sm100, device is sm{cc[0]}{cc[1]}"]
            dim = inputs.head_dim
            if cc[0] == 10 and 128 < dim != 256:
                return [f"head_dim {dim} on sm{cc[0]}{cc[1]}: needs <= 128 or exactly 256"]
            if inputs.has_mask and cc[0] != 9:
                return [f"key padding masks (a mask_mod) are tested on sm90 only, device is "
                        f"sm{cc[0]}{cc[1]}"]  # fmt: skip
            if cc[0] == 9 and inputs.requires_grad and dim < SM90_MIN_TRAINING_HEAD_DIM:
                return [f"head_dim {dim} with gradients on sm90: its backward returns a wrong dq "
                        f"below head_dim {SM90_MIN_TRAINING_HEAD_DIM} (flash-attn-4 4.0.0b36, "
                        f"measured); forward-only calls run"]  # fmt: skip
        reasons = super().not_supported_reasons(inputs)
        if inputs.has_mask and inputs.window:
            reasons.append(
                "a local window with a key padding mask: its mask_mod replaces the window"
            )
        if inputs.has_mask and not reasons:
            reasons += self._mask_reasons()
        if (inputs.softcap or inputs.window) and not reasons:
            reasons += self._score_reasons(inputs)
        return reasons

    def _score_reasons(self, inputs: KernelInputs) -> list[str]:
        """Why this flash_attn.cute cannot soft-cap or window the scores as asked: its entry
        points lack the parameters (which ``_bind`` would otherwise drop silently)."""
        wanted = {"softcap"} if inputs.softcap else set()
        wanted |= {"window_size_left", "window_size_right"} if inputs.window else set()
        return _lacking(wanted, "this flash_attn.cute lacks {missing}")

    def _mask_reasons(self) -> list[str]:
        """Why this flash_attn.cute cannot take a key padding mask (Note [FlashAttention-4 key
        padding]): its entry points lack ``mask_mod`` / ``aux_tensors``."""
        return _lacking(
            {"mask_mod", "aux_tensors"},
            "no key padding mask: this flash_attn.cute has no mask_mod / aux_tensors",
        )

    def block_sparse_reasons(self, inputs: KernelInputs) -> list[str]:
        """Why FA4's block sparsity cannot run ``inputs`` (with ``inputs.block_size``) here."""
        # Top-left causal comes from our mask_mod, so rectangular causal calls are fine.
        reasons = self.not_supported_reasons(replace(inputs, is_causal=False))
        if inputs.softcap:
            reasons.append("no soft-capping in its block sparsity here")
        cc = _capability(inputs)
        if cc is not None and cc[0] != 9:
            reasons.append(
                f"block sparsity is set up for sm90 tiles here, device is sm{cc[0]}{cc[1]}"
            )
        if inputs.head_dim > SPARSE_MAX_HEAD_DIM:
            reasons.append(
                f"head_dim {inputs.head_dim} > {SPARSE_MAX_HEAD_DIM}: its sm90 tiles do not "
                f"divide the {SPARSE_TILE}-row tiles block sparsity is given at"
            )
        if inputs.block_size is not None and inputs.block_size % SPARSE_TILE:
            reasons.append(
                f"block_size {inputs.block_size} is not a multiple of {SPARSE_TILE} (its tile; "
                f"the Triton and FlexAttention kernels take any block size)"
            )
        if not reasons:
            params = _parameters(_interface()._flash_attn_fwd)
            if not {"mask_mod", "block_sparse_tensors", "pack_gqa"} <= params.keys():
                reasons.append("this flash_attn.cute has no block sparsity (mask_mod, "
                               "block_sparse_tensors, pack_gqa)")  # fmt: skip
        return reasons

    def block_sparse_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tiles: SparseTiles,
        *,
        scale: float,
        is_causal: bool,
        into: KernelOutput | None = None,
    ) -> KernelOutput:
        """Attention over the tiles of ``tiles`` (forward lists; Note [FlashAttention-4 block
        sparsity]). q (B, Nq, H, D), k/v (B, Nk, Hkv, D) -> out (B, Nq, H, D), lse (B, H, Nq);
        rows whose tiles list nothing are not defined here (the caller sets them). ``into``:
        contiguous out and lse to write (then, with q, k and v of a contiguous last dim, the
        call allocates nothing)."""
        fwd = _interface()._flash_attn_fwd
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        values = {
            "q": q, "k": k, "v": v, "softmax_scale": scale, "causal": False,
            "mask_mod": _top_left_causal() if is_causal else None,
            "block_sparse_tensors": _sparse_tensors(tiles), "pack_gqa": False, "return_lse": True,
        }  # fmt: skip
        if into is not None:
            values.update(out=into.out, lse=into.lse)
        out, lse = fwd(**_bind(fwd, values))[:2]
        if into is not None:  # a release without ``out=`` returns tensors of its own
            _written((out, lse), (into.out, into.lse))
            return KernelOutput(into.out, into.lse)
        return KernelOutput(out, lse)

    # Replayed from a CUDA graph once the same call has run at the same addresses, by the one
    # graph policy our Triton kernels follow (FA4 launches on the current stream, so a capture
    # holds its kernels; Note [A slotted call's launches from a CUDA graph] in
    # core/execution/executor.py).
    run_launches = TritonBackend.run_launches

    def forward_takes_outputs(self) -> bool:
        """Whether the installed forward takes ``out`` and ``lse`` to write (then
        :meth:`block_sparse_forward` with ``into`` allocates nothing)."""
        return {"out", "lse"} <= _parameters(_interface()._flash_attn_fwd).keys()

    def block_sparse_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        lists: Callable[[slice, slice], SparseTiles],
        *,
        scale: float,
        is_causal: bool,
        into: Grads,
        list_bytes: ListBytes = no_lists,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` from the given ``out`` and ``lse`` (B, H, Nq) over the tiles of
        ``lists(heads, kv_heads)``, the backward lists (per key tile its query tiles) of a
        chunk's query and key/value heads (Note [FlashAttention-4's accumulators by head
        chunks]), which ``list_bytes(heads, kv_heads)`` gives for a chunk of so many heads.
        Chunked, its calls share no key/value head between query heads. Written into ``into``
        (dq, dk, dv, contiguous, q's dtype), unless one call from a release that returns
        gradients of its own covers every head: then those are returned."""
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))

        def arguments(heads: slice, kv: slice) -> dict[str, Any]:
            return {
                "q": q[:, :, heads], "k": k[:, :, kv], "v": v[:, :, kv], "out": out[:, :, heads],
                "dout": dout[:, :, heads], "lse": lse[:, heads].contiguous(),
                "softmax_scale": scale, "causal": False,
                "mask_mod": _top_left_causal() if is_causal else None,
                "block_sparse_tensors": _sparse_tensors(lists(heads, kv)), "pack_gqa": False,
            }  # fmt: skip

        chunks = head_chunks(q, k, list_bytes, ungrouped=True)
        return _backward_calls(chunks, into, arguments)

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
        into: KernelOutput | None = None,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> KernelOutput:
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        options = (scale, is_causal, softcap, window)
        if into is not None:  # a slotted plan's call, inside its plan's replayed closure
            return _forward_call(q, k, v, key_mask, options, into)
        batch, rows, heads, _ = q.shape
        into = KernelOutput(
            q.new_empty(batch, rows, heads, v.shape[-1]),
            torch.empty(batch, heads, rows, dtype=torch.float32, device=q.device),
        )  # fmt: skip
        # Note [A whole call's launches from a CUDA graph]
        self.run_launches(("fa4 forward", *options), (q, k, v, key_mask, into.out, into.lse),
                          lambda: _forward_call(q, k, v, key_mask, options, into))  # fmt: skip
        return into

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
        into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
        if into is None:  # a whole call: its own gradients, in chunks of heads where large
            grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            chunks = head_chunks(q, k)
        else:  # a slotted plan's call (short; its peak is the slots')
            grads, chunks = into, [(slice(None), slice(None))]

        def calls() -> Grads:
            finite = finite_lse(lse)  # here, not in Backend.backward: inside the graph

            def arguments(heads: slice, kv: slice) -> dict[str, Any]:
                values = {
                    "q": q[:, :, heads], "k": k[:, :, kv], "v": v[:, :, kv],
                    "out": out[:, :, heads], "dout": dout[:, :, heads],
                    "lse": finite[:, heads].contiguous(), "softmax_scale": scale,
                    "causal": is_causal, "softcap": softcap or 0.0, **_window_sizes(window),
                }  # fmt: skip
                per_head = key_mask is not None and key_mask.shape[1] > 1
                _masked(values, key_mask[:, heads] if per_head else key_mask, is_causal)
                return values

            return _backward_calls(chunks, grads, arguments)

        if into is not None or not replayable(q, k, chunks):  # a slotted plan's, or large chunks
            return calls()
        # Note [A whole call's launches from a CUDA graph]
        key = ("fa4 backward", scale, is_causal, softcap, window)
        self.run_launches(key, (dout, q, k, v, out, lse, key_mask, *grads),
                          lambda: _written(calls(), grads))
        return grads


def _forward_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    options: tuple[float, bool, float | None, Window | None],
    into: KernelOutput,
) -> KernelOutput:
    """FA4's forward of q (B, Nq, H, D), k, v (B, Nk, Hkv, D) under ``options`` (scale, is_causal,
    softcap, window), written into ``into`` (out (B, Nq, H, D), lse (B, H, Nq) float32): a
    release that returns tensors of its own has them copied there. Returns a new result of
    those buffers, never ``into`` itself: the caller's own stays as it gave it, whatever
    :meth:`Backend.forward` then makes of the result (a key mask's empty rows, a new lse)."""
    fwd = _interface()._flash_attn_fwd
    scale, is_causal, softcap, window = options
    values = {"q": q, "k": k, "v": v, "softmax_scale": scale, "causal": is_causal,
              "return_lse": True, "softcap": softcap, "out": into.out, "lse": into.lse,
              **_window_sizes(window)}  # fmt: skip
    _masked(values, key_mask, is_causal)
    kwargs = _bind(fwd, values)
    if "return_lse" not in kwargs:
        # Releases before ``return_lse`` allocate the lse only when q requires grad.
        kwargs["q"] = q.detach().requires_grad_()
    out, lse = fwd(**kwargs)[:2]
    if lse is None:
        raise RuntimeError("flash_attn.cute._flash_attn_fwd returned no lse")
    _written((out, lse), (into.out, into.lse))
    return KernelOutput(into.out, into.lse)


def _written(results: Sequence[torch.Tensor], into: Sequence[torch.Tensor]) -> None:
    """Each of ``results`` copied into its buffer of ``into`` where it is another tensor (a
    release that returns tensors of its own rather than writing the ones it was given)."""
    for result, buffer in zip(results, into, strict=True):
        if result is not buffer:
            buffer.copy_(result)


def _lacking(names: set[str], reason: str) -> list[str]:
    """``[reason]`` (formatted with the sorted ``missing`` names) where the installed forward or
    backward entry point lacks one of ``names``, the import failure where the package cannot be
    read (a reason, never a crash), else nothing."""
    try:
        interface = _interface()
        found = _parameters(interface._flash_attn_fwd).keys()
        found &= _parameters(interface._flash_attn_bwd).keys()
    except Exception as exc:  # a package that cannot be read is a reason, never a crash
        return [_import_failure("flash_attn.cute", exc)]
    missing = sorted(names - found)
    return [reason.format(missing=missing)] if missing else []


def _window_sizes(window: Window | None) -> dict[str, int | None]:
    """``window`` as FA4's ``window_size_left`` / ``window_size_right`` (None: unbounded). Its
    local window is bottom-right aligned, as the contract's (``core/contract.py``)."""
    if window is None:
        return {}
    return {
        "window_size_left": None if window.left < 0 else window.left,
        "window_size_right": None if window.right < 0 else window.right,
    }
