"""The backend registry: names, per-device priority, and selection with reasons.

Selection walks the priority list for the device (by compute capability, never GPU names; the
measurements behind it sit next to ``_CUDA_PRIORITY``) and takes the first backend with no reason to
refuse the inputs. ``choose`` also records why each other backend was not taken. A backend whose
``verified_on_hardware`` is false (its kernel has not run in this project's GPU tests: flash-attn
2/3 and xformers, tested against fakes of their packages) is taken only by name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch

from .. import _validation as V
from .base import Backend, KernelInputs
from .flash_attn2 import FlashAttn2Backend
from .flash_attn3 import FlashAttn3Backend
from .flash_attn4 import FlashAttn4Backend
from .flex import FlexBackend
from .math import MathBackend
from .sdpa import CpuFlashBackend, SdpaCudnnBackend, SdpaEfficientBackend, SdpaFlashBackend
from .triton import TritonBackend, block_sparse_reasons
from .xformers import XformersBackend

ENV_VAR = "DILATED_ATTENTION_BACKEND"
#: The name that means "choose automatically", accepted wherever ``None`` is.
AUTO = "auto"

# Tried in this order; the first backend with no reason to refuse the inputs wins. Keys are compute
# capability majors. sm90/sm100: FlashAttention-3/4 when installed. FA3 (740 TFLOP/s forward
# published on H100) is never taken automatically here (see verified_on_hardware). FA4 measured
# faster than cuDNN forward+backward at every shape of benchmarks/results/
# kernels_fa4_cudnn_h100.json (H100, bf16, N = 4K-64K, D = 64/128, causal and not: 1.05-1.23x;
# forward 0.96-1.18x, cuDNN ahead by 1-4% on four forward-only shapes, three of them at N = 4K).
# Then cuDNN (600-650 fwd / 540-570 fwd+bwd measured on our H100, bf16, D=128), then FA2
# (flash-attn package, then PyTorch's copy: 350 / 315), then the memory-efficient kernel (180/150).
# sm80-89: FA2-class first; cuDNN measured 0.8-1.0x of FA2 there (transformers#48163). sm75: the
# memory-efficient kernel or xformers. Older GPUs, CPU and other devices: what runs, then math.
# FlexAttention compiles per shape (seconds), so it is never chosen for dense attention
# automatically; it runs block-sparse masks and whenever asked for by name.
_CUDA_PRIORITY: dict[int, list[str]] = {
    10: [
        "flash_attn4",
        "sdpa_cudnn",
        "flash_attn2",
        "sdpa_flash",
        "sdpa_efficient",
        "triton",
        "math",
    ],
    9: [
        "flash_attn3",
        "flash_attn4",
        "sdpa_cudnn",
        "flash_attn2",
        "sdpa_flash",
        "sdpa_efficient",
        "triton",
        "math",
    ],
    8: ["flash_attn2", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "xformers", "triton", "math"],
    7: ["sdpa_efficient", "xformers", "math"],
}
_HOST_PRIORITY = ["cpu_flash", "math"]
# Dilated calls: our Triton kernels (no gathers, branches merged in place) ahead of gather + the
# dense kernel where benchmarks/bench_dilated.py measured them faster (H100, bf16, LongNet
# schedule, N = 64K and 1M, 64a341b; benchmarks/results/dilated_gather_h100.json): D = 64 forward
# 1.9-2.7x / forward+backward 1.3-2.0x; D = 128 forward 2.0-2.9x, forward+backward 1.4-1.8x with
# the backward tiles of benchmarks/results/tune_triton_h100.json. The fused kernels' latest run
# is benchmarks/results/dilated_h100.json. Training with head dims above 128 has not been
# measured and keeps gather + the dense kernel.
_CUDA_DILATED_FIRST: dict[int, list[str]] = {9: ["triton"]}
# Key padding masks: cuDNN and FlashAttention take none, so 16-bit masked calls would fall to the
# memory-efficient kernel. Our Triton kernels take masks and measured 2.5-3.3x its speed on the
# H100 (benchmarks/results/kernels_masked_h100.md: bf16, the last 1/8 of the keys masked,
# N = 4K-64K, D = 64 and 128, forward+backward 258-340 against 90-132 TFLOP/s). float32 and
# other devices have not been measured and keep the list's order.
_CUDA_MASKED_FIRST: dict[int, list[str]] = {9: ["triton"]}
_FUSED_MAX_TRAINING_HEAD_DIM = 128


def _unverified_reason(name: str) -> str:
    return (
        f"never chosen automatically: not yet run on real hardware in this project's GPU tests; "
        f"available by name (backend={name!r})"
    )


def _order(inputs: KernelInputs) -> list[str]:
    """The priority walked for ``inputs``: dilated calls (see _CUDA_DILATED_FIRST) and 16-bit calls
    with a key padding mask (see _CUDA_MASKED_FIRST) try our Triton kernels first, unless they
    train with a head dim above ``_FUSED_MAX_TRAINING_HEAD_DIM``."""
    tiles_measured = not inputs.requires_grad or inputs.head_dim <= _FUSED_MAX_TRAINING_HEAD_DIM
    masked_16bit = inputs.has_mask and inputs.dtype in (torch.float16, torch.bfloat16)
    return priority(
        inputs.device,
        dilated=inputs.dilated and tiles_measured,
        masked=masked_16bit and tiles_measured,
    )


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend instance under ``backend.name`` (replacing one of the same name).

    Raises:
        TypeError: ``backend`` is not an instance of ``dilated_attention.backends.base.Backend``.
        ValueError: its ``name`` is not a non-empty string, or is ``"auto"`` (reserved for the
            automatic choice).
    """
    if not isinstance(backend, Backend):
        what = "a class" if isinstance(backend, type) else type(backend).__name__
        raise TypeError(
            f"backend must be an instance of dilated_attention.backends.base.Backend, got "
            f"{backend!r} ({what}); subclass Backend, set its name, and pass an instance, e.g. "
            f"register_backend(MyBackend())"
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name.strip() or name == AUTO:
        raise ValueError(
            f"backend.name must be a non-empty string other than {AUTO!r} (which means the "
            f"automatic choice), got name={name!r} on {type(backend).__name__}; set the class "
            f"attribute name = 'my_kernel'"
        )
    _BACKENDS[name] = backend


for _backend in (
    MathBackend(),
    CpuFlashBackend(),
    SdpaFlashBackend(),
    SdpaEfficientBackend(),
    SdpaCudnnBackend(),
    FlashAttn2Backend(),
    FlashAttn3Backend(),
    FlashAttn4Backend(),
    XformersBackend(),
    FlexBackend(),
    TritonBackend(),
):
    register_backend(_backend)


def list_backends() -> list[str]:
    """Names of every registered backend, available here or not."""
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(
            f"backend must be one of {list_backends()}, {AUTO!r} or None (automatic choice), got "
            f"{name!r}"
        )
    return _BACKENDS[name]


def check_backend_name(backend: object, *, argument: str = "backend") -> str | None:
    """The one check of a ``backend=`` argument: a registered name, or the automatic choice.

    Every public function and module that takes a backend name calls this (and the selection in
    :func:`choose` resolves names through it), so ``"auto"`` means ``None`` everywhere.

    Args:
        backend: a name from :func:`list_backends`, ``"auto"`` or ``None``.
        argument: how the argument is named in the error message.

    Returns:
        The name, or ``None`` for ``None`` and ``"auto"``.

    Raises:
        TypeError: not a string or None.
        ValueError: a string that names no registered backend (the message lists them).
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(
            f"{argument} must be a backend name (one of {list_backends()}), {AUTO!r} or None "
            f"(automatic choice), got {backend!r} ({type(backend).__name__})"
        )
    if backend == AUTO:
        return None
    if backend not in _BACKENDS:
        raise ValueError(
            f"{argument} must be one of {list_backends()}, {AUTO!r} or None (automatic choice), "
            f"got {backend!r}"
        )
    return backend


def priority(device: torch.device, *, dilated: bool = False, masked: bool = False) -> list[str]:
    """Backend names in the order they are tried on ``device`` (see the module docstring);
    ``dilated`` / ``masked`` put the backends measured faster on that device for dilated calls /
    calls with a key padding mask first."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        order = _CUDA_PRIORITY.get(major, _CUDA_PRIORITY[8] if major > 10 else _CUDA_PRIORITY[7])
        first = _CUDA_DILATED_FIRST.get(major, []) if dilated else []
        if masked:
            first = first + [n for n in _CUDA_MASKED_FIRST.get(major, []) if n not in first]
        order = first + [name for name in order if name not in first]
    else:
        order = _HOST_PRIORITY
    known = [name for name in order if name in _BACKENDS]
    return known + [name for name in _BACKENDS if name not in known]


@dataclass(frozen=True)
class BackendChoice:
    """The kernel chosen for some inputs of one operation, and why every other kernel was not.

    Attributes:
        backend: the chosen kernel's name.
        reasons: for every other name in the operation's registry, at least one reason it was
            not chosen (it cannot run the inputs, or it can but ranks lower).
        order: the priority order that was walked.
        source: what decided: ``"auto"``, ``"argument"``, ``"use_backend"`` or ``"environment"``.
        operation: ``"dense"``, ``"dilated"`` or ``"block_sparse"`` (:data:`OPERATIONS`).
        runs_plan: the name is one of the operation's plan kernels (:class:`PlanKernel`), which
            runs the whole plan itself; otherwise the executor calls the backend once per kernel
            call of the plan.
        branches: for a dilated schedule given to ``explain``, one line per branch (or row
            group) saying how it runs on this kernel: views or gathers, how many calls, and why.
    """

    backend: str
    reasons: dict[str, list[str]]
    order: list[str]
    source: str
    operation: str = "dense"
    runs_plan: bool = False
    branches: tuple[str, ...] = ()


_OVERRIDE: ContextVar[str | None] = ContextVar("dilated_attention_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run every attention call inside the block on backend ``name`` (``None`` or ``"auto"``:
    automatic).

    An explicit ``backend=`` argument still wins. Raises ``ValueError`` for an unknown name,
    ``TypeError`` for a name that is not a string.
    """
    token = _OVERRIDE.set(check_backend_name(name, argument="use_backend(name)"))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def _requested(name: str | None) -> tuple[str | None, str]:
    name = check_backend_name(name)
    if name is not None:
        return name, "argument"
    override = _OVERRIDE.get()
    if override is not None:
        return override, "use_backend"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env != AUTO:
        if env not in _BACKENDS:
            raise ValueError(
                f"environment variable {ENV_VAR}={env!r} names no backend; valid names: "
                f"{list_backends()} (or unset it / set it to 'auto')"
            )
        return env, "environment"
    return None, "auto"


#: The operations a kernel is chosen for, one registry each (:func:`registry_for`).
DENSE, DILATED, BLOCK_SPARSE = "dense", "dilated", "block_sparse"
OPERATIONS = (DENSE, DILATED, BLOCK_SPARSE)


@dataclass(frozen=True)
class PlanKernel:
    """A kernel that runs a whole plan of one operation itself instead of the executor calling a
    backend once per kernel call (Note [One executor] in ``core/engine.py``). In its operation's
    registry it answers to a backend's name, which there means this kernel.

    Attributes:
        name: the backend name it answers to.
        summary: what it runs, for ``explain`` and ``python -m dilated_attention info``.
        reasons: why it cannot run some inputs (empty: it can).
    """

    name: str
    summary: str
    reasons: Callable[[KernelInputs], list[str]]


@dataclass(frozen=True)
class Selection:
    """The kernel an operation runs on: ``backend``, called per kernel call by the executor, or,
    when ``runs_plan``, the operation's plan kernel answering to ``backend.name``."""

    backend: Backend
    runs_plan: bool = False


class OperationRegistry:
    """Every kernel that can run one operation, each with its rejection reasons, and the choice
    among them: every registered backend (run by the executor once per kernel call of the
    operation's plan) and the operation's plan kernels. A name is validated once, here, and means
    one kernel per operation.

    Args:
        operation: one of :data:`OPERATIONS`.
        plan_kernels: the operation's plan kernels.
        first: for some inputs, the names tried before the device's priority list (measured
            faster there); ``None``: the list as it is.
    """

    def __init__(
        self,
        operation: str,
        plan_kernels: Sequence[PlanKernel] = (),
        first: Callable[[KernelInputs], list[str]] | None = None,
    ) -> None:
        self.operation = operation
        self.plan_kernels = {kernel.name: kernel for kernel in plan_kernels}
        self._first = first

    def _describe(self, inputs: KernelInputs) -> KernelInputs:
        return replace(inputs, dilated=self.operation == DILATED)

    def order(self, inputs: KernelInputs) -> list[str]:
        """The names in the order they are tried for ``inputs``."""
        inputs = self._describe(inputs)
        first = self._first(inputs) if self._first is not None else []
        return first + [name for name in _order(inputs) if name not in first]

    def reasons(self, name: str, inputs: KernelInputs) -> list[str]:
        """Why kernel ``name`` of this operation cannot run ``inputs`` (empty: it can)."""
        inputs = self._describe(inputs)
        plan_kernel = self.plan_kernels.get(name)
        if plan_kernel is not None:
            return plan_kernel.reasons(inputs)
        return _BACKENDS[name].not_supported_reasons(inputs)

    def _automatic_reasons(self, name: str, inputs: KernelInputs) -> list[str]:
        """Why the automatic choice does not take ``name``: what it cannot run, and whether its
        backend was never verified on hardware."""
        reasons = self.reasons(name, inputs)
        if not _BACKENDS[name].verified_on_hardware:
            reasons = [*reasons, _unverified_reason(name)]
        return reasons

    def choose(self, inputs: KernelInputs, name: str | None = None) -> BackendChoice:
        """Choose a kernel for ``inputs`` and record why every other one was not chosen.

        Precedence: the ``name`` argument, then :func:`use_backend`, then the environment
        variable ``DILATED_ATTENTION_BACKEND``, then the priority list for the device.

        Raises:
            ValueError: a requested name is unknown or its kernel cannot run the inputs, or none
                can; the message lists every rejected kernel with its reasons.
        """
        requested, source = _requested(name)
        order = self.order(inputs)
        what = "" if self.operation == DENSE else f" for {self.operation} attention"
        if requested is not None:
            reasons = {c: self.reasons(c, inputs) for c in order}
            if reasons[requested]:
                able = [n for n, r in reasons.items() if not r]
                raise ValueError(
                    f"backend {requested!r} (from {source}) cannot run these inputs{what}: "
                    f"{'; '.join(reasons[requested])}. Backends that can: {able}; or let the "
                    f"library choose (backend=None)"
                )
            chosen = requested
        else:
            reasons = {c: self._automatic_reasons(c, inputs) for c in order}
            chosen = next((n for n in order if not reasons[n]), None)
            if chosen is None:
                detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
                raise ValueError(
                    f"no backend can run these inputs{what} ({inputs}). Rejected: {detail}"
                )
        why_not = {}
        for candidate in order:
            if candidate == chosen:
                continue
            why_not[candidate] = reasons[candidate] or (
                [f"{chosen!r} was requested ({source})"]
                if requested is not None
                else [f"able, but ranks after {chosen!r} on this device"]
            )
        return BackendChoice(
            backend=chosen, reasons=why_not, order=order, source=source,
            operation=self.operation, runs_plan=chosen in self.plan_kernels,
        )  # fmt: skip

    def select(self, inputs: KernelInputs, name: str | None = None) -> Selection:
        """The kernel :meth:`choose` picks for ``inputs``, probing only as far as needed.

        The same choice as :meth:`choose`, which probes every kernel to say why each one is not
        chosen; this stops at the requested kernel or at the first one of the priority list that
        can run the inputs, so the kernels ranked after it are never imported or launched (a
        FlexAttention probe alone imports TorchInductor: seconds of a first call on a GPU). When
        none can, :meth:`choose` raises its error with every kernel's reasons.
        """
        requested, _ = _requested(name)
        chosen: str | None = None
        if requested is not None:
            if not self.reasons(requested, inputs):
                chosen = requested
        else:
            for candidate in self.order(inputs):  # an unverified backend is not even probed
                if _BACKENDS[candidate].verified_on_hardware and not self.reasons(
                    candidate, inputs
                ):
                    chosen = candidate
                    break
        if chosen is None:
            chosen = self.choose(inputs, name).backend
        return Selection(_BACKENDS[chosen], runs_plan=chosen in self.plan_kernels)


def _fused_dilated_reasons(inputs: KernelInputs) -> list[str]:
    return _BACKENDS["triton"].not_supported_reasons(inputs)


def _block_sparse_triton_reasons(inputs: KernelInputs) -> list[str]:
    return block_sparse_reasons(_BACKENDS["triton"], inputs)


def _block_sparse_flex_reasons(inputs: KernelInputs) -> list[str]:
    return _BACKENDS["flex"].not_supported_reasons(replace(inputs, has_mask=False))


def _block_sparse_fa4_reasons(inputs: KernelInputs) -> list[str]:
    backend = _BACKENDS["flash_attn4"]
    if not isinstance(backend, FlashAttn4Backend):  # replaced by a registration of that name
        return [f"{backend.name!r} registered under 'flash_attn4' has no block sparsity"]
    return backend.block_sparse_reasons(inputs)


def _block_sparse_first(inputs: KernelInputs) -> list[str]:
    """On CUDA: FlashAttention-4's block sparsity where it runs (H100, 64K tokens, D = 128, 10%
    density: forward 6.3 ms and forward+backward 25.1 ms against 8.5 / 33.1 for our Triton
    kernels, 9.2 / 33.6 for FlexAttention; ``block_sparse_64k_h100``); then our block-sparse
    Triton kernels for calls without gradients (their forward is 1.1-1.4x FlexAttention's),
    FlexAttention for training (its backward is up to 6% faster at 64K tokens:
    docs/block_sparse.md); elsewhere the device's list, where none of them runs."""
    if inputs.device.type != "cuda":
        return []
    rest = ["flex", "triton"] if inputs.requires_grad else ["triton", "flex"]
    return ["flash_attn4", *rest]


#: Positions from which FlashAttention-4 writing into branch slots runs dilated calls on sm90
#: ahead of our fused Triton kernels (see :func:`_dilated_first`).
FA4_DILATED_MIN_LEN = 262144


def _dilated_first(inputs: KernelInputs) -> list[str]:
    """On sm90: FlashAttention-4 first for dilated calls of at least ``FA4_DILATED_MIN_LEN``
    positions whose branches write into slots (Note [Branch slots merged once] in
    core/slots.py), with head dims up to 128, where bench_dilated measured it faster than our
    fused Triton kernels (H100, bf16, H = 16, D = 64 and 128, causal and not; LongNet's schedule,
    benchmarks/results/dilated_h100.json: at 256K and 1M tokens forward+backward 1.43-1.60x,
    forward 1.20-1.44x, at 64K within run-to-run noise; ragged branches, the paper's r = 6 and 12
    at 256K and 1M tokens (dilated_paper_h100) and LongNet's at 1,000,000 tokens, shorter last
    segments (dilated_ragged_h100): forward+backward 1.30-1.62x, forward 1.13-1.37x; GQA, 16
    query heads over 4 key/value heads, LongNet's schedule at 256K and 1M (dilated_gqa_h100):
    forward+backward 1.31-1.50x, forward 1.18-1.43x; ring dilated attention's local branches at
    262,144 tokens per GPU on 2 H200s (ring_dilated_fa4_h200x2): forward+backward 1.37-1.42x at
    W = 2, 1.52-1.59x at W = 1); elsewhere the device's list, where our fused kernels come
    first. Where FlashAttention-4 is not installed that is a reason, and the fused kernels run.
    Masked calls keep our kernels first: FlashAttention-4 masks through a mask_mod
    (kernels_masked_fa4_h100)."""
    if inputs.device.type != "cuda" or not inputs.branch_slots or inputs.has_mask:
        return []  # masked calls: our kernels first (_CUDA_MASKED_FIRST)
    if inputs.query_len < FA4_DILATED_MIN_LEN or inputs.head_dim > _FUSED_MAX_TRAINING_HEAD_DIM:
        return []
    major, _ = torch.cuda.get_device_capability(inputs.device)
    return ["flash_attn4"] if major == 9 else []


_REGISTRIES = {
    DENSE: OperationRegistry(DENSE),
    DILATED: OperationRegistry(
        DILATED,
        [PlanKernel("triton", "our fused dilated kernels: every branch from the full q, k, v "
                    "through strides, merged in place (core/fused.py)", _fused_dilated_reasons)],
        first=_dilated_first,
    ),
    BLOCK_SPARSE: OperationRegistry(
        BLOCK_SPARSE,
        [
            PlanKernel("triton", "our block-sparse Triton kernels, walking the kept blocks' "
                       "lists", _block_sparse_triton_reasons),
            PlanKernel("flex", "FlexAttention on the pattern's BlockMask",
                       _block_sparse_flex_reasons),
            PlanKernel("flash_attn4", "FlashAttention-4's block sparsity on the pattern's "
                       "128 x 128 tiles", _block_sparse_fa4_reasons),
        ],
        first=_block_sparse_first,
    ),
}  # fmt: skip


def registry_for(operation: str) -> OperationRegistry:
    """The kernel registry of ``operation`` (one of :data:`OPERATIONS`)."""
    if operation not in _REGISTRIES:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")
    return _REGISTRIES[operation]


def choose(inputs: KernelInputs, name: str | None = None) -> BackendChoice:
    """:meth:`OperationRegistry.choose` of the dilated registry when ``inputs.dilated``, else of
    the dense one."""
    return registry_for(DILATED if inputs.dilated else DENSE).choose(inputs, name)


def select_backend(inputs: KernelInputs, name: str | None = None) -> Backend:
    """The backend that runs dense attention on ``inputs`` (:meth:`OperationRegistry.select`)."""
    return _REGISTRIES[DENSE].select(inputs, name).backend


def reasons_for(inputs: KernelInputs) -> dict[str, list[str]]:
    """For every registered backend, why it cannot run ``inputs`` (empty list: it can)."""
    order = _order(inputs)
    return {name: _BACKENDS[name].not_supported_reasons(inputs) for name in order}


def backend_reasons(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> dict[str, list[str]]:
    """For every registered backend, why it cannot run attention on these tensors.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D).
        value: (B, Nk, Hkv, D).

    Returns:
        ``{name: reasons}``; an empty list means the backend can run these inputs.

    Raises:
        ValueError / TypeError: malformed tensors, mask, flag or ``dropout_p``, as in
            :func:`dilated_attention.attention`.
    """
    q, k, _ = V.check_qkv(query, key, value, same_length=False)
    V.check_bool("is_causal", is_causal)
    V.check_causal_lengths(q, k, is_causal, "attention")
    V.check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1], q.device)
    dropout_p = V.check_dropout("dropout_p", dropout_p)
    if is_causal:  # an end-aligned query runs as square causal calls, as in attention()
        k = k[:, : q.shape[1]]
    inputs = KernelInputs.from_tensors(
        q, k, is_causal=is_causal, has_mask=key_padding_mask is not None, dropout_p=dropout_p
    )
    return reasons_for(inputs)
