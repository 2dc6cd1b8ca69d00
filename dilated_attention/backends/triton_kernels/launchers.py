"""Triton kernels that read dilated rows through strides: their launchers (forward, delta, dK/dV
and dQ) and the recording of launches for compiling ahead. The kernels themselves are in
``triton_kernels/forward.py`` and ``triton_kernels/backward.py``, their device helpers in
``triton_kernels/device.py``.

Imported only by ``backends/triton.py`` (lazily: this module needs the ``triton`` package).

Note [Strided dilated rows]
    One launch runs one branch ``(w, r)`` over the segments of a position range. A program owns
    the rows ``i`` of one (batch, segment, head) for a tile of ``BLOCK_M`` rows; head ``h`` reads,
    in the segment starting at ``t0``, the positions ``t0 + s + r*i`` with ``s = h mod r``, for
    queries and for keys of its key/value head ``h // G`` (GQA, ``G = H / Hkv``). The pointers step
    ``r * stride(seq)`` per row, so nothing is gathered. A segment of ``L`` positions gives head
    ``h`` ``ceil((L - s) / r)`` rows (fewer when ``r`` does not divide ``L``; none when ``s >= L``),
    so ragged segments and the short last segment need no special casing. Causal masking compares
    row indices, which within one offset class order like positions. A launch may cover a slice
    of the heads (the fused engine's head groups); ``head0`` names the layer head of the slice's
    first head, so offsets stay ``(head0 + h) mod r``.

    The forward keeps FlashAttention's running (max, sum, acc), the max over unscaled scores
    (Note [Exponents at large logits] in ``triton_kernels/device.py``), and with ``MERGE`` folds its
    result into the ``(out, lse)`` already stored for those rows (Note [Merging partial
    softmaxes]) in float32: branches run one launch after another, and rows of one launch
    belong to one program, so the read-modify-write needs no atomics. The backward kernels take
    the *merged* ``lse`` and ``delta = rowsum(dout * out)`` (Note [Exact gradients through the
    branch mix]); the dK/dV program of a key tile loops over every query head of its key/value
    head that has the same offset, so its rows are written by it alone, and ``ACCUMULATE`` adds
    into float32 gradient buffers shared by the branches.

Rectangular dense calls (one segment, ``r = 1``, different query and key lengths) use the same
kernels with separate query and key segment lengths.

Note [Rows through tensor descriptors]
    On Hopper the forward reads q, k and v with the tensor memory accelerator (TMA) instead of
    per-thread pointer loads: 9-14% faster at head dims 64 and 128 on an H100 on most branch
    shapes (``benchmarks/results/tma_forward_h100.md``). A (B, N, H, D) tensor whose length is a
    multiple of ``r`` is viewed as (B, N/r, r, H, D): position ``p`` is row ``p // r`` of class
    ``p % r``, so the rows ``first + r*i`` of one head in one segment are the consecutive rows
    ``first // r + i`` of class ``first % r``, whether or not the segment starts on a multiple
    of ``r``. One host-side descriptor per tensor and launch covers every segment and head (no
    per-program descriptors, no scratch memory). A box may run past a head's rows into the next
    segment, whose rows are real data: key scores there are masked like any row past the end,
    value rows there are zeroed (``0 * nan`` is nan), and query rows there are never stored.
    Everything else (mask, merge, output and lse stores) stays on pointers. ``_use_descriptors``
    says where this applies; anything else takes the pointer loads.

Shape legend: B batch, N positions, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton

from ...core.contract import BackwardPart, Window
from .._compat import _release
from .backward import _delta_kernel, _dkdv_kernel, _dq_kernel
from .compile import Launch, compile_launches
from .forward import _forward_kernel
from .launch import _hooked, launch_recorded, run_site, site_key  # noqa: F401 (site_key)
from .tiles import MAX_GRID_Y, TileConfig, cdiv, next_power_of_2

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

LOG2E = math.log2(math.e)

#: Where the forward reads rows through tensor descriptors (Note [Rows through tensor
#: descriptors]): ``"auto"`` (Hopper or newer, Triton >= 3.6, 16-bit inputs, 64 <= head dim
#: <= 128: where it was measured faster), ``"always"`` (wherever the layout allows; tests and
#: the interpreter) or ``"never"``.
DESCRIPTOR_POLICY = "auto"
#: Oldest Triton whose compile of the descriptor forward was tested (5-D boxes reshaped to 2-D);
#: older ones keep pointer loads under ``"auto"`` rather than risk a compile failure mid-call.
DESCRIPTOR_MIN_TRITON = (3, 6)
_TRITON_VERSION = _release(triton.__version__)


@dataclass(frozen=True)
class Branch:
    """One launch's geometry: segments of ``seg_q`` query / ``seg_k`` key positions at stride
    ``rate``, the first starting at ``start``; query positions end at ``end_q``, keys at ``end_k``
    (the last segment is clipped there).

    With ``bounds`` (packed documents, Note [Segments from a table] in ``triton_kernels/device.py``)
    the segments are instead ``[bounds[i], bounds[i + 1])`` for queries and keys alike, the
    longest ``seg_q == seg_k`` positions.
    """

    start: int
    seg_q: int
    seg_k: int
    end_q: int
    end_k: int
    rate: int
    bounds: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        if self.bounds is not None:
            return self.bounds.numel() - 1
        return cdiv(self.end_q - self.start, self.seg_q)

    @property
    def max_rows_q(self) -> int:
        return cdiv(min(self.seg_q, self.end_q - self.start), self.rate)

    @property
    def max_rows_k(self) -> int:
        return cdiv(min(self.seg_k, self.end_k - self.start), self.rate)


# Note [Specialization and first calls]
#     Triton compiles a kernel once per *specialization*: its constexprs, and for every integer
#     argument whether it equals 1 and whether it is divisible by 16. Left alone, positions
#     (segment starts and ends, row offsets) and the strides of the (B, H, N) tensors (lse, delta
#     and the mask, whose strides are N and H * N) make a new length compile again: 8 of 12
#     kernels recompiled for N = 5001 after N = 4096 on an H100, 11 s
#     (``benchmarks/bench_first_call.py``). So positions are not specialized at all, and those
#     strides not on alignment (a stride of 1 still compiles as the constant 1). What remains in a
#     specialization is a *shape family*: dtype, head dim, tiles, causal, mask, merge/accumulate,
#     a rate of 1 or not, and whether rows are read through tensor descriptors.
#
#     The batch strides of the (B, N, H, D) tensors (q, k, v, out, dout, gradients) keep their
#     alignment class: they are N * (a row's elements), a multiple of 16 for every N whenever a
#     row's H * D is, so they cost no recompile; and a row pointer is 16-byte aligned, which
#     vector loads and stores need, only when Triton knows every term of it is. Without that
#     class every load of q, k, v and dout compiled to 2-byte scalar loads (``ld.global.b16``
#     where 16-byte ``ld.global.v4`` / ``cp.async`` belong): forward+backward of LongNet at
#     N = 64K, D = 64 took 24.1 ms on an H100 against 13.1 ms with it
#     (``tests/backends/test_triton_codegen.py`` compiles the kernels for sm90 and checks).
#
#     A family's kernels are compiled together before its first call (``compile_ahead``): the
#     engine runs once with every launch recorded instead of run, the recorded kernels compile
#     in parallel (Note [Compiling in forked processes] in ``triton_kernels/compile.py``), and then
#     the engine runs for real. Compiled kernels are cached on disk by Triton (``TRITON_CACHE_DIR``,
#     default ``~/.triton/cache``), so a later process only loads them.

_RECORDED: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "dilated_attention_triton_recorded_launches", default=None
)


def _compiling() -> bool:
    """Whether launches are being recorded for :func:`compile_ahead` instead of run."""
    return _RECORDED.get() is not None


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel``, or inside :func:`compile_ahead` only record the launch."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(Launch.record(kernel, grid, args, kwargs))
        return
    launch_recorded(kernel, grid, args, kwargs)


def graphable() -> bool:
    """Whether launches may be captured into a CUDA graph now (Note [A call's launches from a
    CUDA graph] in ``core/execution/graphs.py``): not recorded for :func:`compile_ahead`, and no
    launch hook installed (a profiler's must see every launch)."""
    return not _compiling() and not _hooked()


def run_bound(
    site: tuple[Any, ...],
    roles: tuple[torch.Tensor | None, ...],
    body: Callable[[], None],
    constants: tuple[torch.Tensor, ...] = (),
) -> None:
    """Run the launches ``body`` makes, or where ``site`` ran before, their bound copies with
    ``roles`` (Note [Bound launches] in ``triton_kernels/launch.py``); ``constants``: tensors the
    launches take that the key keeps alive (a segment table)."""
    if _compiling():
        body()
        return
    run_site(site, roles, body, constants)


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Inside, launches are recorded instead of run; on a normal exit every recorded kernel is
    compiled, in parallel (Note [Compiling in forked processes] in ``triton_kernels/compile.py``).

    Outputs written inside are garbage: run the same calls again outside to compute.
    """
    recorded: list[Launch] = []
    token = _RECORDED.set(recorded)
    try:
        yield
    finally:
        _RECORDED.reset(token)
    compile_launches(recorded, workers)


# -- launchers -------------------------------------------------------------------------------------
@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """A GPU's compute capability; cached, as every launch asks."""
    return torch.cuda.get_device_capability(device_index)


def dot_precision(x: torch.Tensor) -> str:
    """``input_precision`` of the kernels' ``tl.dot`` for inputs like ``x``.

    Note [float32 products]
        16-bit inputs multiply exactly on tensor cores ("tf32" is ignored for them). float32
        inputs use "tf32x3" on GPUs with TF32 tensor cores (sm80+): each product is split into
        a high and a low TF32 part and three tensor-core products recover float32 accuracy. On
        an H100, forward+backward of four causal branches (N = 4,096, H = 8, D = 64) matched
        the float64 math backend as closely as with "ieee" (relative errors 2.7e-7 / 4.7e-7 /
        4.8e-7 / 3.5e-7 on out / dq / dk / dv, against 2.9e-7 / 4.1e-7 / 4.9e-7 / 4.2e-7) and
        ran 2.0x faster at N = 16,384 (5.0 against 10.2 ms;
        ``benchmarks/results/float32_products_h100.json``); "ieee" products are unrolled into
        FMA instructions, and one such kernel compiles for up to 4.1 s. Elsewhere (older
        GPUs, Triton's CPU interpreter) "ieee".
    """
    if x.dtype != torch.float32:
        return "tf32"
    if x.is_cuda and _capability(x.device.index) >= (8, 0):
        return "tf32x3"
    return "ieee"


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _mask_args(
    key_mask: torch.Tensor | None, like: torch.Tensor
) -> tuple[torch.Tensor, int, int, int]:
    """``(tensor, stride_b, stride_h, stride_n)`` of a (B, Hm, N) bool mask (Hm in {1, H})."""
    if key_mask is None:
        return like, 0, 0, 0
    mask = key_mask.view(torch.uint8)
    stride_h = 0 if mask.shape[1] == 1 else mask.stride(1)
    return mask, mask.stride(0), stride_h, mask.stride(2)


def _bounds(branch: Branch, like: torch.Tensor) -> torch.Tensor:
    """The segment table of a launch, or any tensor where there is none (never read)."""
    return like if branch.bounds is None else branch.bounds


def _bnh(x: torch.Tensor) -> tuple[int, ...]:
    return x.stride()[:3]


def _wide(branch: Branch, *tensors: torch.Tensor) -> bool:
    """Whether row offsets within one segment can pass 2**31 elements (then 64-bit offsets)."""
    return _wide_rows(branch, max(x.stride(1) for x in tensors))


def _wide_rows(branch: Branch, row_stride: int) -> bool:
    """:func:`_wide` for the largest row stride of a launch's tensors."""
    return max(branch.seg_q, branch.seg_k) * row_stride >= 2**31 - 2**20


def _descriptor_view_ok(x: torch.Tensor, rate: int) -> bool:
    """Whether (B, N, H, D) ``x`` can be read as (B, N/r, r, H, D) through a tensor descriptor:
    16-bit, last dim dense, base and (positive) strides 16-byte aligned, ``N`` a multiple of
    ``rate``."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(-1) != 1:
        return False
    size = x.element_size()
    return (
        x.data_ptr() % 16 == 0
        and all(stride > 0 and stride * size % 16 == 0 for stride in x.stride()[:3])
        and x.shape[1] % rate == 0
        and x.numel() > 0
    )


def _use_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rate: int) -> bool:
    """Whether the forward reads rows through tensor descriptors (``DESCRIPTOR_POLICY``)."""
    if TensorDescriptor is None or DESCRIPTOR_POLICY == "never":
        return False
    if DESCRIPTOR_POLICY == "auto":
        dim = q.shape[-1]
        if not (q.is_cuda and 64 <= dim <= 128) or _TRITON_VERSION < DESCRIPTOR_MIN_TRITON:
            return False
        if _capability(q.device.index) < (9, 0):  # no tensor memory accelerators
            return False
    return all(_descriptor_view_ok(x, rate) for x in (q, k, v))


def _row_descriptor(x: torch.Tensor, rate: int, rows: int, block_d: int) -> Any:
    """Descriptor of (B, N, H, D) ``x`` viewed as (B, N/r, r, H, D), box (1, rows, 1, 1, block_d)
    (Note [Rows through tensor descriptors])."""
    batch, length, heads, dim = x.shape
    return TensorDescriptor(
        x,
        [batch, length // rate, rate, heads, dim],
        [x.stride(0), rate * x.stride(1), x.stride(1), x.stride(2), 1],
        [1, rows, 1, 1, block_d],
    )


@dataclass(frozen=True)
class _Scores:
    """What a launch passes for its scores' soft-cap and window (Note [Soft-capped scores in the
    kernels], Note [Local windows in the kernels] in ``triton_kernels/device.py``): the window as
    the offsets ``win_lo <= j - i <= win_hi`` of key row ``j`` from query row ``i``."""

    softcap: float | None
    win_lo: int = 0
    win_hi: int = 0
    window: bool = False

    def forward(self, scale: float) -> tuple[float, ...]:
        """``(qk_scale, sm_scale, win_lo, win_hi, cap_in, softcap)`` of the forward kernel:
        with a cap, the capped scores are scaled already (exponents in log2(e), lse in 1)."""
        if self.softcap is None:
            return (scale * LOG2E, scale, self.win_lo, self.win_hi, 1.0, 1.0)
        return (LOG2E, 1.0, self.win_lo, self.win_hi, scale / self.softcap, self.softcap)

    def backward(self) -> tuple[float, ...]:
        """``(win_lo, win_hi, softcap)`` of the backward kernels."""
        return (self.win_lo, self.win_hi, 1.0 if self.softcap is None else self.softcap)

    def flags(self) -> dict[str, bool]:
        return {"WINDOW": self.window, "SOFTCAP": self.softcap is not None}


def _grid(tiles: int, groups: int, batch: int, is_causal: bool) -> tuple[tuple[int, ...], bool]:
    """A branch launch's grid ``(x, y, batch)`` and ``TILES_OUTER``: causal launches put the
    tiles on y, heavy ones first, where they fit (Note [Heavy tiles first] in
    ``triton_kernels/device.py``); so do launches with more (segment, head) groups than y holds.

    Raises:
        ValueError: neither layout fits, or more batch rows than z holds.
    """
    outer = tiles <= MAX_GRID_Y and (is_causal or groups > MAX_GRID_Y)
    grid = (groups, tiles, batch) if outer else (tiles, groups, batch)
    if grid[1] > MAX_GRID_Y or batch > MAX_GRID_Y:
        raise ValueError(
            f"a Triton launch of {tiles} tiles x {groups} (segment, head) groups x {batch} batch "
            f"rows does not fit a CUDA grid (at most {MAX_GRID_Y} along y and along z); call "
            f"with fewer batch rows at a time, or pass backend='sdpa'"
        )
    return grid, outer


def _scores(branch: Branch, softcap: float | None, window: Window | None) -> _Scores:
    """A launch's :class:`_Scores`. The window is the call's (Note [Scores a kernel call
    transforms] in ``core/contract.py``): query row ``i`` stands at key row ``i + Nk - Nq``; an
    unbounded side (``-1``), or one reaching past the rows, is clamped to the rows' span."""
    if window is None:
        return _Scores(softcap)
    if branch.rate != 1 or branch.num_segments != 1 or branch.bounds is not None:
        raise ValueError(f"a local window needs a dense launch (one segment, rate 1): {branch}")
    rows_q, rows_k = branch.max_rows_q, branch.max_rows_k
    shift = rows_k - rows_q
    low = -rows_q if window.left < 0 else max(shift - window.left, -rows_q)
    high = rows_k if window.right < 0 else min(shift + window.right, rows_k)
    return _Scores(softcap, low, high, True)


def forward_branch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_mask: torch.Tensor | None,
    branch: Branch,
    *,
    out_row0: int,
    scale: float,
    is_causal: bool,
    merge: bool,
    config: TileConfig,
    descriptor_config: TileConfig | None = None,
    head0: int = 0,
    merge_from: torch.Tensor | None = None,
    merge_row0: int = 0,
    allow_descriptors: bool = True,
    q_row0: int = 0,
    softcap: float | None = None,
    window: Window | None = None,
) -> None:
    """One branch's forward, written (or with ``merge``, merged) into ``out`` and ``lse``.

    Args:
        q: (B, Nq, H, D), row ``p - q_row0`` for query position ``p``; k, v: (B, Nk, Hkv, D),
            row ``p`` for position ``p``; any strides with stride(-1) == 1.
        out: (B, rows, H, D), row ``p - out_row0`` for query position ``p``.
        lse: (B, H, Nq) float32, natural log, column ``p - q_row0``.
        key_mask: (B, Hm, Nk) bool, ``True`` = ignore, or None.
        config: tiles of the pointer-load kernel; ``descriptor_config``: tiles when the rows are
            read through tensor descriptors (``_use_descriptors``), default ``config``.
        head0: the layer head that ``q``'s head 0 is (a call on a slice of the heads).
        merge_from: with ``merge``, where the running output is read (B, rows, H, D), row
            ``p - merge_row0``; default ``out`` itself. The merged rows go to ``out``.
        allow_descriptors: ``False`` reads rows through pointers even where descriptors apply.
        q_row0: the first position with a query (Note [A chunk in one fused forward] in
            ``core/execution/fused.py``): the branch's rows before it are neither computed nor
            stored. Such a launch reads rows through pointers.
        softcap, window: Note [Scores a kernel call transforms] in ``core/contract.py``; a
            window only on a dense branch (one segment, rate 1).
    """
    batch, _, heads, dim = q.shape
    scores = _scores(branch, softcap, window)
    block_d = _block_d(dim)
    mask, smb, smh, smn = _mask_args(key_mask, q)
    prev, prev_row0 = (out, out_row0) if merge_from is None else (merge_from, merge_row0)
    descriptors: tuple[Any, Any, Any] = (None, None, None)
    if allow_descriptors and q_row0 == 0 and _use_descriptors(q, k, v, branch.rate):
        if _compiling():
            # Lengths that r does not divide read through pointers: compile that variant too, so
            # a new length of the family compiles nothing (Note [Specialization and first calls]).
            forward_branch(
                q, k, v, out, lse, key_mask, branch, out_row0=out_row0, scale=scale,
                is_causal=is_causal, merge=merge, config=config, head0=head0,
                merge_from=merge_from, merge_row0=merge_row0, allow_descriptors=False,
                softcap=softcap, window=window,
            )  # fmt: skip
        config = descriptor_config or config
        descriptors = (
            _row_descriptor(q, branch.rate, config.block_m, block_d),
            _row_descriptor(k, branch.rate, config.block_n, block_d),
            _row_descriptor(v, branch.rate, config.block_n, block_d),
        )
    tiles = cdiv(branch.max_rows_q, config.block_m)
    grid, outer = _grid(tiles, branch.num_segments * heads, batch, is_causal)
    strides = [_bnh(x) for x in (q, k, v, out, prev)]
    _launch(
        _forward_kernel, grid, q, k, v, out, prev, lse, mask, _bounds(branch, lse),
        *descriptors, *itertools.chain.from_iterable(strides), *lse.stride(), smb, smh, smn,
        out_row0, prev_row0, q_row0, branch.start, branch.seg_q, branch.seg_k, branch.end_q,
        branch.end_k, branch.rate, head0, heads, heads // k.shape[2],
        *scores.forward(scale), HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, CAUSAL=is_causal, HAS_MASK=key_mask is not None, MERGE=merge,
        DOT_PRECISION=dot_precision(q), WIDE=_wide_rows(branch, max(s[1] for s in strides)),
        DESCRIPTORS=descriptors[0] is not None, TABLE=branch.bounds is not None, TILES_OUTER=outer,
        **scores.flags(), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def row_delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    start: int,
    end: int,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rowsum(out * dout)`` for positions [start, end): (B, H, end - start) float32, written
    into ``delta`` where given."""
    batch, _, heads, dim = out.shape
    if delta is None:
        delta = torch.empty(batch, heads, end - start, dtype=torch.float32, device=out.device)
    block = 64
    grid = (cdiv(end - start, block), heads, batch)
    _launch(
        _delta_kernel, grid, out, dout, delta, *_bnh(out), *_bnh(dout), *delta.stride(), start,
        end, heads,
        HEAD_DIM=dim, BLOCK_D=_block_d(dim), BLOCK_M=block,
    )  # fmt: skip
    return delta


def backward_branch(
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
    branch: Branch,
    *,
    delta_row0: int,
    grad_row0: int,
    scale: float,
    is_causal: bool,
    accumulate: bool,
    config_dkdv: TileConfig,
    config_dq: TileConfig,
    head0: int = 0,
    softcap: float | None = None,
    window: Window | None = None,
    part: BackwardPart = "both",
) -> None:
    """One branch's gradients, written (or with ``accumulate``, added) into dq, dk, dv.

    Args:
        dout, q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D).
        lse: (B, H, Nq) merged log-sum-exp; delta: (B, H, rows), row ``p - delta_row0``.
        dq: (B, rows, H, D); dk, dv: (B, rows, Hkv, D); row ``p - grad_row0`` for position ``p``.
        head0: the layer head that ``q``'s head 0 is (a call on a slice of the heads).
        softcap, window: as in :func:`forward_branch`.
        part: ``"keys"`` launches only the dK/dV kernel, ``"queries"`` only the dQ kernel.
    """
    scores = _scores(branch, softcap, window)
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    offsets = min(group, branch.rate)
    mask, smb, smh, smn = _mask_args(key_mask, q)
    common = (
        *_bnh(q), *_bnh(k), *_bnh(v), *_bnh(dout), *lse.stride(), *delta.stride(), smb, smh, smn,
    )  # fmt: skip
    geometry = (
        branch.start, branch.seg_q, branch.seg_k, branch.end_q, branch.end_k, branch.rate, head0,
    )  # fmt: skip
    flags = {
        "HEAD_DIM": dim, "BLOCK_D": _block_d(dim), "CAUSAL": is_causal,
        "HAS_MASK": key_mask is not None, "ACCUMULATE": accumulate,
        "DOT_PRECISION": dot_precision(q), "WIDE": _wide(branch, q, k, v, dout, dq, dk),
        "TABLE": branch.bounds is not None, **scores.flags(),
    }  # fmt: skip
    if part != "queries":
        grid, outer = _grid(cdiv(branch.max_rows_k, config_dkdv.block_n),
                            branch.num_segments * kv_heads * offsets, batch, is_causal)  # fmt: skip
        _launch(
            _dkdv_kernel, grid, q, k, v, dout, lse, delta, mask, _bounds(branch, lse), dk, dv,
            *common, *_bnh(dk), delta_row0, grad_row0, *geometry, kv_heads, group, offsets,
            scale, *scores.backward(), BLOCK_M=config_dkdv.block_m, BLOCK_N=config_dkdv.block_n,
            num_warps=config_dkdv.num_warps, num_stages=config_dkdv.num_stages,
            TILES_OUTER=outer, **flags,
        )  # fmt: skip
    if part != "keys":
        grid, outer = _grid(cdiv(branch.max_rows_q, config_dq.block_m),
                            branch.num_segments * heads, batch, is_causal)  # fmt: skip
        _launch(
            _dq_kernel, grid, q, k, v, dout, lse, delta, mask, _bounds(branch, lse), dq, *common,
            *_bnh(dq), delta_row0, grad_row0, *geometry, heads, group, scale, *scores.backward(),
            BLOCK_M=config_dq.block_m, BLOCK_N=config_dq.block_n,
            num_warps=config_dq.num_warps, num_stages=config_dq.num_stages, TILES_OUTER=outer,
            **flags,
        )  # fmt: skip
