"""The backend registry: names, per-device priority, and selection with reasons.

Selection walks the priority list for the device (by compute capability, never GPU names) and
takes the first backend with no reason to refuse the inputs. The lists, the rules that put some
backends first for some inputs and their thresholds are data: ``priorities.json`` beside this
module, each entry naming the benchmark record under benchmarks/results/ that measured it.
``choose`` also records why each other backend was not taken. A backend whose
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
from . import priority_rules as rules
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


def _unverified_reason(name: str) -> str:
    return (
        f"never chosen automatically: not yet run on real hardware in this project's GPU tests; "
        f"available by name (backend={name!r})"
    )


def _order(inputs: KernelInputs) -> list[str]:
    """The priority walked for ``inputs``: dilated calls and calls with a key padding mask try the
    backends of the device's ``dilated`` / ``masked`` rules first where those rules were measured
    (dtype, head dim when training: :func:`~.priority_rules.rule_measured`)."""
    entry = rules.device_class(inputs.device)
    return priority(
        inputs.device,
        dilated=inputs.dilated and rules.rule_measured(rules.first_rule(entry, "dilated"), inputs),
        masked=inputs.has_mask and rules.rule_measured(rules.first_rule(entry, "masked"), inputs),
    )


_BACKENDS: dict[str, Backend] = {}
_GENERATION = [0]


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
    _GENERATION[0] += 1


for _backend in (
    MathBackend(), CpuFlashBackend(), SdpaFlashBackend(), SdpaEfficientBackend(),
    SdpaCudnnBackend(), FlashAttn2Backend(), FlashAttn3Backend(), FlashAttn4Backend(),
    XformersBackend(), FlexBackend(), TritonBackend(),
):  # fmt: skip
    register_backend(_backend)


def generation() -> int:
    """How many times a backend was registered: changes whenever the kernels to choose from
    do (what a cached choice is kept under)."""
    return _GENERATION[0]


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
    """Backend names in the order they are tried on ``device`` (``priorities.json``);
    ``dilated`` / ``masked`` put the backends measured faster on that device for dilated calls /
    calls with a key padding mask first."""
    entry = rules.device_class(device)
    first: list[str] = []
    for rule, wanted in (("dilated", dilated), ("masked", masked)):
        names = (rules.first_rule(entry, rule) or {}).get("names", []) if wanted else []
        first = first + [name for name in names if name not in first]
    order = first + [name for name in entry["order"]["names"] if name not in first]
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
        description: the whole strategy in words (the resolve step's ``describe()``): what
            ``print(choice)`` shows.
    """

    backend: str
    reasons: dict[str, list[str]]
    order: list[str]
    source: str
    operation: str = "dense"
    runs_plan: bool = False
    branches: tuple[str, ...] = ()
    description: str = ""

    def __str__(self) -> str:
        return self.description or f"{self.operation} attention runs on {self.backend}"


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
    backend once per kernel call (Note [One executor] in ``core/execution/executor.py``). In its
    operation's registry it answers to a backend's name, which there means this kernel.

    Attributes:
        name: the backend name it answers to.
        summary: what it runs, for ``explain`` and ``python -m dilated_attention info``.
        reasons: why it cannot run some inputs (empty: it can).
        takes_documents: it runs packed documents itself (Note [Packed documents] in
            ``core/geometry/documents.py``); others are refused them.
    """

    name: str
    summary: str
    reasons: Callable[[KernelInputs], list[str]]
    takes_documents: bool = False


@dataclass(frozen=True)
class Selection:
    """The kernel an operation runs on: ``backend``, called per kernel call by the executor, or,
    when ``runs_plan``, the operation's plan kernel answering to ``backend.name``."""

    backend: Backend
    runs_plan: bool = False


#: Why an operation's own kernels do not run packed documents (Note [Packed documents] in
#: core/geometry/documents.py): they take whole rows; the executor's plan runs each document's
#: calls.
_PACKED_REASON = (
    "packed documents (cu_seqlens): this kernel runs each row as one sequence; the executor's "
    "plan runs each document's calls on a dense kernel"
)


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
            refused = inputs.documents and not plan_kernel.takes_documents
            return [*([_PACKED_REASON] if refused else []), *plan_kernel.reasons(inputs)]
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
    sinks = ["no sinks (its autograd is its own)"] if inputs.sinks else []
    return sinks + _BACKENDS["flex"].not_supported_reasons(replace(inputs, has_mask=False))


def _block_sparse_fa4_reasons(inputs: KernelInputs) -> list[str]:
    backend = _BACKENDS["flash_attn4"]
    if not isinstance(backend, FlashAttn4Backend):  # replaced by a registration of that name
        return [f"{backend.name!r} registered under 'flash_attn4' has no block sparsity"]
    return backend.block_sparse_reasons(inputs)


_REGISTRIES = {
    DENSE: OperationRegistry(DENSE, first=rules.dense_first),
    DILATED: OperationRegistry(
        DILATED,
        [PlanKernel("triton", "our fused dilated kernels: every branch from the full q, k, v "
                    "through strides, merged in place (core/execution/fused.py)",
                    _fused_dilated_reasons,
                    takes_documents=True)],
        first=rules.dilated_first,
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
        first=rules.block_sparse_first,
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
