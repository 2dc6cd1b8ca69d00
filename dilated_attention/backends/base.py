"""The base class of the kernel backends: capabilities, rejection reasons, forward and backward.

It implements the one contract (Note [The backend contract] in ``core/contract.py``). Every
backend computes dense attention over the rows it is given and returns the log-sum-exp, so the
engine can merge dilated branches, ring steps and sparse blocks (see ``core/merge.py``). Its
backward accepts an ``out``/``lse`` other than its own: the merged statistics (Note [Backward with
external statistics] in ``core/reference.py``).

Shape legend: B batch, Nq/Nk query/key rows, H query heads, Hkv key/value heads, D head dim.
``key_mask`` is (B, Hm, Nk) bool with Hm in {1, H}, ``True`` = ignore the key. Causal masking is
top-left aligned (query ``i`` sees keys ``j <= i``): the kernels' contract. The public functions'
causal queries shorter than the key are end-aligned (their last positions); the engine runs them
as square causal calls and calls without a mask (``core/decoding/decode.py``), never as a
rectangular causal kernel call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..core.contract import KernelOutput, Window
from ..core.hidden import poisoned
from ..core.reference import reference_backward, reference_forward


@dataclass(frozen=True)
class KernelInputs:
    """What a backend needs to know to accept or reject a call (metadata only, no tensors)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    query_len: int
    key_len: int
    is_causal: bool = False
    has_mask: bool = False
    dropout_p: float = 0.0
    requires_grad: bool = False
    # A dilated attention call (several branches or a rate > 1): fused backends rank first.
    dilated: bool = False
    # A block-sparse call: tokens per block (None otherwise).
    block_size: int | None = None
    # A dilated call whose branches can write into slots merged once (Note [Branch slots merged
    # once] in core/geometry/slots.py): kernels that write into given buffers run it fastest. False
    # also where the slots' memory rules them out (a ring shard's float32 output beside spanning
    # branches, resolve/resolver.py).
    branch_slots: bool = False
    # Rows holding packed documents (Note [Packed documents] in core/geometry/documents.py): the
    # executor runs each document's segments as their own calls.
    documents: bool = False
    # Soft-capped scores, a local window over the rows (Note [Scores a kernel call transforms]
    # in core/contract.py).
    softcap: bool = False
    window: bool = False
    # Attention sinks (Note [Local windows, soft-capping and sinks] in core/sinks.py): they join
    # every path's result under the one autograd Function, so only kernels with an autograd of
    # their own refuse them.
    sinks: bool = False
    # Batch rows on a launch grid's short axes (1 for packed documents, which run as one row,
    # and for a static cache's step): the grids bound them.
    batch: int = 1

    @classmethod
    def from_tensors(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        is_causal: bool = False,
        has_mask: bool = False,
        dropout_p: float = 0.0,
        requires_grad: bool | None = None,
        dilated: bool = False,
        block_size: int | None = None,
        branch_slots: bool = False,
    ) -> KernelInputs:
        """Describe a (B, Nq, H, D) query and (B, Nk, Hkv, D) key."""
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return cls(
            batch=q.shape[0],
            device=q.device,
            dtype=q.dtype,
            head_dim=q.shape[-1],
            num_heads=q.shape[2],
            num_kv_heads=k.shape[2],
            query_len=q.shape[1],
            key_len=k.shape[1],
            is_causal=is_causal,
            has_mask=has_mask,
            dropout_p=dropout_p,
            requires_grad=requires_grad,
            dilated=dilated,
            block_size=block_size,
            branch_slots=branch_slots,
        )


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` (B, H, Nq) with every infinity 0 (the finite stand-in of :meth:`Backend.backward`
    for rows that saw no key; NaN stays NaN), in one launch: this runs for every call of a
    plan's backward, whose host time per call counts (Note [Position-grouped plans])."""
    return torch.nan_to_num(lse, nan=math.nan, posinf=0.0, neginf=0.0)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    group = num_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _reduce_kv(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    batch, rows, heads, dim = dx.shape
    if heads == num_kv_heads:
        return dx
    return dx.view(batch, rows, num_kv_heads, heads // num_kv_heads, dim).sum(dim=3)


#: No keywords: what a kernel call without a soft-cap, a window or buffers to write into passes
#: (shared, never changed: most calls pass it).
_NO_OPTIONS: dict[str, object] = {}


def _score_options(softcap: float | None, window: Window | None) -> dict[str, object]:
    """The ``softcap`` / ``window`` keywords a kernel call passes on: only those asked for, so a
    backend that applies neither never receives them (Note [Scores a kernel call transforms])."""
    if softcap is None and window is None:
        return _NO_OPTIONS
    options: dict[str, object] = {}
    if softcap is not None:
        options["softcap"] = softcap
    if window is not None:
        options["window"] = window
    return options


def rows_without_keys(
    key_mask: torch.Tensor,
    num_heads: int,
    query_len: int,
    is_causal: bool,
    window: Window | None = None,
) -> torch.Tensor:
    """Which query rows see no key at all under ``key_mask`` (and causality, and ``window``).

    Args:
        key_mask: (B, Hm, Nk) bool, ``True`` = ignore.

    Returns:
        (B, H, Nq) bool.
    """
    batch, _, key_len = key_mask.shape
    if window is not None:  # every (row, key) pair: windows are for kernels that take them
        rows = torch.arange(query_len, device=key_mask.device).view(-1, 1)
        keys = torch.arange(key_len, device=key_mask.device).view(1, -1)
        hidden = window.hides(rows, keys, key_len - query_len)
        if is_causal:
            hidden = hidden | (torch.arange(key_len, device=key_mask.device) > rows)
        empty = (key_mask[:, :, None, :] | hidden).all(dim=-1)
        return empty.expand(batch, num_heads, query_len)
    if is_causal:
        # Row i sees keys 0..i: it is empty when that whole prefix is masked.
        prefix_masked = torch.cummin(key_mask.to(torch.uint8), dim=-1).values.bool()
        idx = torch.arange(query_len, device=key_mask.device).clamp_(max=key_len - 1)
        empty = prefix_masked[..., idx]
        if query_len > key_len:
            empty = empty & (torch.arange(query_len, device=key_mask.device) < key_len)
    else:
        empty = key_mask.all(dim=-1, keepdim=True).expand(batch, key_mask.shape[1], query_len)
    return empty.expand(batch, num_heads, query_len)


class Backend:
    """Base class of every kernel backend: implements the one contract,
    :class:`~dilated_attention.core.contract.KernelBackend` (Note [The backend contract]).

    Subclasses declare their capabilities as class constants and implement ``_forward`` and
    ``_backward``; this class turns the constants into rejection reasons, expands GQA key/value
    heads for kernels without native GQA, and gives rows with no visible key ``lse = -inf``.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    devices: ClassVar[frozenset[str]] = frozenset()
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    min_head_dim: ClassVar[int] = 1
    max_head_dim: ClassVar[int | None] = None
    head_dim_multiple: ClassVar[int] = 1
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    supports_causal: ClassVar[bool] = True
    supports_rectangular_causal: ClassVar[bool] = True
    supports_mask: ClassVar[bool] = False
    supports_dropout: ClassVar[bool] = False
    supports_backward: ClassVar[bool] = True
    # Soft-capped scores and local windows (Note [Scores a kernel call transforms] in
    # core/contract.py): a kernel that applies them receives ``softcap`` / ``window`` keywords.
    supports_softcap: ClassVar[bool] = False
    supports_window: ClassVar[bool] = False
    native_gqa: ClassVar[bool] = True
    # True when the kernel already returns lse = -inf for rows whose keys are all masked.
    empty_rows_have_neg_inf_lse: ClassVar[bool] = False
    # Calls with fewer query or key rows go to the plain-PyTorch kernel (cuDNN refuses 1 x 1).
    min_rows: ClassVar[int] = 1
    # Whether ``_backward`` takes the lse as it is and makes it finite itself (:func:`finite_lse`,
    # inside the launches it may replay from a CUDA graph), where :meth:`backward` would.
    finite_lse_inside: ClassVar[bool] = False
    # Whether the kernel's op is one that torch's autograd differentiates, run by
    # ``recorded_forward`` (Note [Dense calls on torch's autograd] in core/higher_order.py).
    records_autograd: ClassVar[bool] = False
    # Whether the kernel keeps a NaN or inf of a hidden key out of the rows it is hidden from. A
    # CPU backend that does not reruns a masked call whose results hold one on the plain-PyTorch
    # kernel, which does (Note [Hidden keys cannot poison rows] in core/hidden.py).
    exact_on_hidden_keys: ClassVar[bool] = False
    # Whether the kernel reads q, k, v given as strided views (last dim contiguous, any other
    # strides) as they are: dilated rows then reach it as views, not gathers (Note [Strided row
    # calls] in core/geometry/strided.py).
    reads_strided_rows: ClassVar[bool] = False
    # Whether the kernel writes its result into the buffers ``into`` hands it (Note [The backend
    # contract] in core/contract.py): dilated plans then merge their branches once (Note [Branch
    # slots merged once] in core/geometry/slots.py). ``_forward`` / ``_backward`` take ``into``
    # then.
    writes_into: ClassVar[bool] = False
    # Whether ``_forward`` returns ``aux`` None whenever ``dropout_p`` is 0: its backward then
    # needs nothing of the forward but the merged ``out`` and ``lse``, and the custom operators'
    # backward runs it without repeating the forward (Note [Custom operators for torch.compile
    # and torch.func] in compiled/operators.py). False (the forward is repeated) unless declared.
    aux_only_for_dropout: ClassVar[bool] = False
    # Whether this project's GPU tests have run the kernel on real hardware against the float64
    # oracle. A backend that has not is never chosen automatically, only by name.
    verified_on_hardware: ClassVar[bool] = True

    # -- availability -----------------------------------------------------------------------------
    def import_reasons(self) -> list[str]:
        """Reasons the backend's package or op cannot be loaded at all (empty when it can)."""
        return []

    def probe(self, device: torch.device) -> None:
        """Launch a tiny forward and backward on ``device``; raise if the kernel cannot run."""
        # Deterministic inputs: a probe must not advance the caller's random number generators.
        q = torch.linspace(-1.0, 1.0, 1 * 8 * 2 * 64, device=device).view(1, 8, 2, 64)
        q = q.to(self._probe_dtype()).requires_grad_()
        res = self.forward(q, q, q, scale=0.125)
        self.backward(torch.ones_like(res.out), q, q, q, res.out, res.lse, res.aux, scale=0.125)

    def _probe_dtype(self) -> torch.dtype:
        # float16 first: every CUDA generation has float16 kernels, not all have bfloat16.
        for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            if dt in self.dtypes:
                return dt
        raise RuntimeError(f"backend {self.name} declares no dtype")

    def availability_reasons(self, device: torch.device) -> list[str]:
        """Import and one cached launch probe on ``device`` (type and index)."""
        return list(_availability(self, device.type, device.index))

    # -- capabilities -----------------------------------------------------------------------------
    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        """Every reason this backend cannot run ``inputs``; empty when it can."""
        dev = inputs.device
        if dev.type not in self.devices:
            return [f"runs on {sorted(self.devices)}, not {dev.type}"]
        reasons = self.capability_reasons(inputs)
        if not reasons:
            reasons.extend(self.availability_reasons(dev))
        return reasons

    def capability_reasons(self, inputs: KernelInputs) -> list[str]:
        """The declared capabilities that ``inputs`` exceed (device type and probe aside)."""
        reasons: list[str] = []
        dev = inputs.device
        if inputs.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"dtype {str(inputs.dtype).removeprefix('torch.')} not in ({names})")
        if inputs.head_dim < self.min_head_dim:
            reasons.append(f"head_dim {inputs.head_dim} < {self.min_head_dim}")
        if self.max_head_dim is not None and inputs.head_dim > self.max_head_dim:
            reasons.append(f"head_dim {inputs.head_dim} > {self.max_head_dim}")
        if inputs.head_dim % self.head_dim_multiple:
            reasons.append(f"head_dim {inputs.head_dim} not a multiple of {self.head_dim_multiple}")
        if self.min_compute_capability is not None and dev.type == "cuda":
            cc = torch.cuda.get_device_capability(dev)
            if cc < self.min_compute_capability:
                need = "sm{}{}".format(*self.min_compute_capability)
                reasons.append(f"needs compute capability >= {need}, device is sm{cc[0]}{cc[1]}")
        if inputs.is_causal and not self.supports_causal:
            reasons.append("no causal mask")
        rectangular = inputs.query_len != inputs.key_len
        if inputs.is_causal and rectangular and not self.supports_rectangular_causal:
            reasons.append("causal mask needs query_len == key_len")
        if inputs.has_mask and not self.supports_mask:
            reasons.append("no key padding mask")
        if inputs.dropout_p > 0 and not self.supports_dropout:
            reasons.append("no dropout")
        if inputs.requires_grad and not self.supports_backward:
            reasons.append("no backward (inference only)")
        if inputs.softcap and not self.supports_softcap:
            reasons.append("no soft-capping (softcap)")
        if inputs.window and not self.supports_window:
            reasons.append("no local window (window_size)")
        return reasons

    # -- compute ----------------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        is_causal: bool = False,
        key_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        into: KernelOutput | None = None,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> KernelOutput:
        """Attention over these rows.

        Args:
            q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D); key_mask: (B, Hm, Nk) bool or None.
            into: ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq) to write the result into where
                the kernel can (``writes_into``); the result returned may be other tensors.
            softcap, window: Note [Scores a kernel call transforms] in ``core/contract.py``.

        Returns:
            :class:`KernelOutput` with ``out`` (B, Nq, H, D) and ``lse`` (B, H, Nq).
        """
        heads, rows = q.shape[2], q.shape[1]
        if rows < self.min_rows or k.shape[1] < self.min_rows:
            out, lse = reference_forward(
                q, k, v, scale=scale, is_causal=is_causal, key_mask=key_mask,
                dropout_p=dropout_p, **_score_options(softcap, window),
            )  # fmt: skip
            return KernelOutput(out, lse)
        expand = not self.native_gqa and heads != k.shape[2]
        kk, vv = (_expand_kv(k, heads), _expand_kv(v, heads)) if expand else (k, v)
        res = self._forward(
            q, kk, vv, scale=scale, is_causal=is_causal, key_mask=key_mask, dropout_p=dropout_p,
            **self._options(softcap, window, into),
        )  # fmt: skip
        if self._rerun_exact(is_causal, key_mask, window, dropout_p, res.out):
            out, lse = reference_forward(
                q, k, v, scale=scale, is_causal=is_causal, key_mask=key_mask,
                **_score_options(softcap, window),
            )  # fmt: skip
            return KernelOutput(out, lse)
        if key_mask is not None and not self.empty_rows_have_neg_inf_lse:
            empty = rows_without_keys(key_mask, heads, rows, is_causal, window)
            res.lse = res.lse.masked_fill(empty, float("-inf"))
        return res

    def backward(
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
        is_causal: bool = False,
        key_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        softcap: float | None = None,
        window: Window | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients for these rows given ``out`` and ``lse``, which may be merged statistics
        (``into``: buffers shaped like ``(q, k, v)`` to write them into, as in :meth:`forward`).

        Rows with ``lse = -inf`` saw no key: their probabilities are zero, which a finite stand-in
        for the lse reproduces in every kernel (masked scores are ``-inf``).

        Returns:
            ``(dq, dk, dv)`` shaped like ``(q, k, v)``.
        """
        kv_heads = k.shape[2]
        if q.shape[1] < self.min_rows or k.shape[1] < self.min_rows:
            return reference_backward(
                dout, q, k, v, out, lse, scale=scale, is_causal=is_causal, key_mask=key_mask,
                **_score_options(softcap, window),
            )  # fmt: skip
        heads = q.shape[2]
        expand = not self.native_gqa and heads != kv_heads
        kk, vv = (_expand_kv(k, heads), _expand_kv(v, heads)) if expand else (k, v)
        dq, dk, dv = self._backward(
            dout, q, kk, vv, out, lse if self.finite_lse_inside else finite_lse(lse), aux,
            scale=scale, is_causal=is_causal, key_mask=key_mask, dropout_p=dropout_p,
            **self._options(softcap, window, None if expand else into),
        )  # fmt: skip
        if expand:
            dk, dv = _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads)
        if self._rerun_exact(is_causal, key_mask, window, dropout_p, dq, dk, dv):
            return reference_backward(
                dout, q, k, v, out, lse, scale=scale, is_causal=is_causal, key_mask=key_mask,
                **_score_options(softcap, window),
            )  # fmt: skip
        return dq, dk, dv

    def recorded_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grads: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        *,
        scale: float,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One call as torch's autograd records the kernel's op (``records_autograd``; Note
        [Dense calls on torch's autograd] in ``core/higher_order.py``), ``grads`` hung on its
        node for ``create_graph=True`` (``CreateGraphSwap`` there).

        Args:
            q: (B, Nq, H, D); k, v: (B, Nk, Hkv, D), at least ``min_rows`` rows each.
            grads: dout (B, Nq, H, D) -> dq, dk, dv, differentiable, shaped like q, k, v.

        Returns:
            ``out`` (B, Nq, H, D), differentiable; ``lse`` (B, H, Nq), not.
        """
        raise NotImplementedError(f"{self.name}: torch's autograd does not record its op")

    def run_launches(
        self,
        key: tuple[Any, ...] | None,
        tensors: Sequence[torch.Tensor | None],
        launches: Callable[[], None],
        keep: object = None,
    ) -> None:
        """See ``KernelBackend.run_launches`` in ``core/contract.py``: run now (a backend whose
        kernels a CUDA graph can hold replays them instead)."""
        launches()

    def _rerun_exact(
        self,
        is_causal: bool,
        key_mask: torch.Tensor | None,
        window: Window | None,
        dropout_p: float,
        *results: torch.Tensor,
    ) -> bool:
        """Whether the ``results`` of a call that hides keys from some rows (causality, a key
        mask or a window) hold a NaN or inf that a hidden key may have put there: a CPU
        call's then reruns on the plain-PyTorch kernel's exact path (Note [Hidden keys cannot
        poison rows] in core/hidden.py). A backend that runs on CUDA only is never checked
        (:func:`~dilated_attention.core.hidden.poisoned` reads CPU results only)."""
        if self.exact_on_hidden_keys or dropout_p > 0 or "cpu" not in self.devices:
            return False
        hides = is_causal or key_mask is not None or window is not None
        return hides and poisoned(*results)

    def _options(
        self, softcap: float | None, window: Window | None, into: object
    ) -> dict[str, object]:
        """The keywords of ``_forward`` / ``_backward`` besides the call's own: ``softcap`` and
        ``window`` where asked for (:func:`_score_options`), ``into`` for kernels that write
        there; the shared empty dict for most calls."""
        if into is not None and self.writes_into:
            return {"into": into, **_score_options(softcap, window)}
        return _score_options(softcap, window)

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
    ) -> KernelOutput:
        raise NotImplementedError

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@functools.cache
def _availability(backend: Backend, device_type: str, device_index: int | None) -> tuple[str, ...]:
    reasons = backend.import_reasons()
    if reasons:
        return tuple(reasons)
    try:
        with torch.enable_grad():
            backend.probe(torch.device(device_type, device_index))
    except Exception as exc:  # a kernel that cannot launch is a reason, never a crash
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return (f"probe launch failed on {device_type}: {type(exc).__name__}: {first_line}",)
    return ()
