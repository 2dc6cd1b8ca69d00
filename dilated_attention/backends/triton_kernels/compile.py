"""Compiling the Triton kernels of a shape family ahead of its first call, in parallel.

Imported by ``backends/triton_kernels/launchers.py``; it imports ``triton`` only when it compiles,
so its bookkeeping is tested without Triton.

Note [Compiling in forked processes]
    Triton compiles a kernel in Python (its front end) and in MLIR passes that hold the GIL, so
    in a thread pool (``AsyncCompileMode``) the 12 to 15 compiles of a family run nearly one
    after another: 14-20 s in bfloat16 on an H100 (``benchmarks/bench_first_call.py``). A forked
    child has an interpreter of its own: the launches are split over children that compile at
    the same time, write the kernels into Triton's disk cache (``TRITON_CACHE_DIR``) and exit;
    the parent loads each child's kernels from there as soon as that child exits (30-50 ms per
    kernel on an H100, hidden behind the children still compiling). A child starts in
    milliseconds, since it inherits every module the parent imported.

    A child must not touch CUDA (a CUDA context does not survive ``fork``), and a compile does
    not need it: the launch arguments are recorded as stand-ins carrying what Triton
    specializes on (dtype, 16-byte alignment, descriptor block shapes), and the child answers
    Triton's device, stream and target queries with the parent's values. Where ``fork`` does
    not exist, where ``DILATED_ATTENTION_COMPILE_PROCESSES=0``, or where a child fails or takes
    longer than ``CHILD_TIMEOUT_S``, the parent compiles what is missing itself, in the thread
    pool, as before: the children only ever save time.

    The children are forked in the reverse of the order the launches were recorded: the
    backward's kernels, recorded last, compile slowest (dK/dV 3.1-3.2 s against 2.2-2.9 s for
    the forward at head dim 128 on an H100), so they start first.

    Several processes of one machine (the ranks of a ``torchrun`` job, test workers) reach the
    same family at about the same time. Each would compile all of it, forking children of its
    own: 8 ranks times 16 children on a node. So a family is compiled by one process at a
    time: it holds an exclusive lock on a file beside the family's marker while it compiles;
    another process wanting the family waits for the lock (at most ``CHILD_TIMEOUT_S``), finds
    the marker and loads the kernels from the disk cache. And a process forks at most its share
    of the cores it may run on: those cores divided by ``LOCAL_WORLD_SIZE`` (the processes
    ``torchrun`` starts on this machine), at most 16, or ``DILATED_ATTENTION_COMPILE_PROCESSES``.

Note [The compiler's first use]
    The first compile in a process also fills state Triton keeps per process, one piece after
    another: it builds its driver's C helpers with the C compiler (0.6 s on a cold cache), hashes
    its own source and libraries (``triton_key``, 0.5-0.7 s) and runs ``ptxas --version`` for
    its backend hash (0.26 s). On an H100 that was 1.6 s of a cold first call before the first
    kernel compiled. ``prepare_compiler`` runs the three side by side (the hashing and the
    compiler subprocess release the GIL); the backend's launch probe calls it first.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

#: The most children one process forks to compile in; ``0``: compile in this process only
#: (threads), e.g. where ``fork`` is unwelcome. Unset: this process's share of its cores (a
#: ``workers`` argument, given by tests, takes its place unless it is ``0``).
ENV_VAR = "DILATED_ATTENTION_COMPILE_PROCESSES"
#: Children per process at most, unless ``ENV_VAR`` says otherwise.
MAX_PROCESSES = 16
#: The lock file this process holds while it compiles (closed in its forked children, so that
#: only this process holds the lock).
_held_lock: int | None = None
#: A child still running after this long is killed; the parent compiles its kernels itself.
CHILD_TIMEOUT_S = 300.0
#: How long a process waits for another one compiling the same family.
LOCK_TIMEOUT_S = CHILD_TIMEOUT_S

_log = logging.getLogger("dilated_attention")


@dataclass(frozen=True)
class PointerArg:
    """A tensor argument as Triton specializes it: dtype and whether its address is 16-byte
    aligned (what ``JITFunction.warmup`` reads from a tensor)."""

    dtype: torch.dtype
    aligned: bool

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel, its grid, and its arguments with tensors replaced by
    :class:`PointerArg` stand-ins (so recording keeps no memory alive)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @classmethod
    def record(
        cls, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Launch:
        # In call order: Triton's in-memory cache key lists the options in the order given.
        return cls(kernel, grid, tuple(map(_stand_in, args)), tuple(kwargs.items()))

    def specialization(self) -> tuple[Any, ...]:
        """What tells two launches' compiles apart (a superset of Triton's key: integers are
        kept by their "== 1" and "divisible by 16" classes, positions included)."""
        return (id(self.kernel), tuple(map(_arg_class, self.args)), self.kwargs)

    def compile(self) -> Any:
        """Compile (or load from the cache) without launching; the compiled kernel, or a future
        of it inside ``AsyncCompileMode``."""
        return self.kernel.warmup(*self.args, grid=self.grid, **dict(self.kwargs))


def _is_descriptor(arg: Any) -> bool:
    """A host-side tensor descriptor (Triton's ``TensorDescriptor`` dataclass)."""
    return hasattr(arg, "block_shape") and isinstance(getattr(arg, "base", None), torch.Tensor)


def _stand_in(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return PointerArg(arg.dtype, arg.data_ptr() % 16 == 0)
    if _is_descriptor(arg):
        return replace(arg, base=PointerArg(arg.base.dtype, arg.base.data_ptr() % 16 == 0))
    return arg


def _arg_class(arg: Any) -> Any:
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return ("int", arg == 1, arg % 16 == 0)
    if isinstance(arg, float):
        return "float"
    if hasattr(arg, "block_shape"):
        return ("descriptor", arg.base, tuple(arg.block_shape))
    return arg


def compile_launches(launches: list[Launch], workers: int | None = None) -> None:
    """Compile every distinct kernel of ``launches``: in forked children first (Note [Compiling
    in forked processes]), then in this process, which loads what the children cached and
    compiles whatever they did not.

    A set of kernels compiled once is remembered by a marker file in Triton's cache directory:
    a later process finds them on disk and forks nothing (a fork of a process holding a CUDA
    context costs tens of milliseconds).
    """
    first: dict[tuple[Any, ...], Launch] = {}
    for launch in launches:
        first.setdefault(launch.specialization(), launch)
    distinct = list(first.values())
    marker = _marker(distinct)
    with _compiling_alone(marker):
        _compile_distinct(distinct, workers, marker)


def compile_processes() -> int:
    """How many children one process compiles in (Note [Compiling in forked processes]):
    ``DILATED_ATTENTION_COMPILE_PROCESSES`` where set (``0``: none), else this process's share
    of the cores (``_core_share``)."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return _core_share()
    if not value.strip().isdigit():
        raise ValueError(
            f"{ENV_VAR} must be a whole number of processes (0: compile in this process only), "
            f"got {value!r}; unset it to use this process's share of the cores"
        )
    return int(value)


def _core_share() -> int:
    """The cores this process may run on divided by ``LOCAL_WORLD_SIZE`` (the processes
    ``torchrun`` starts on this machine), at least 1 and at most ``MAX_PROCESSES``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    share = (cores or 1) // int(local) if local.isdigit() and int(local) > 0 else cores or 1
    return max(1, min(MAX_PROCESSES, share))


@contextlib.contextmanager
def _compiling_alone(marker: str | None) -> Iterator[None]:
    """Hold the lock file beside ``marker`` (Note [Compiling in forked processes]): another
    process of this machine compiling the same family finishes first. Waits at most
    ``CHILD_TIMEOUT_S``; where the lock cannot be had (no ``fcntl``, no such file, a long wait)
    this process goes on alone, as it would without one."""
    try:
        import fcntl
    except ImportError:
        fcntl = None  # type: ignore[assignment]
    if fcntl is None or marker is None or os.path.exists(marker):
        yield
        return
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        handle = os.open(marker + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    global _held_lock
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # held by another process
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:  # no locks on this file system: go on alone
                break
        _held_lock = handle
        yield
    finally:
        _held_lock = None
        os.close(handle)  # releases the lock: the children closed their copies


def _compile_distinct(distinct: list[Launch], workers: int | None, marker: str | None) -> None:
    """``compile_launches`` of distinct launches, this process holding the family's lock: in
    forked children (``workers``, else :func:`compile_processes`; none where that is 0), then in
    threads here."""
    started = time.perf_counter()
    children = 0
    compiled = marker is not None and os.path.exists(marker)
    if len(distinct) > 1 and hasattr(os, "fork") and not compiled:
        allowed = compile_processes()
        children = workers if workers is not None and allowed > 0 else allowed
    forked = children > 0
    threads = workers or _core_share()
    loaded: set[tuple[Any, ...]] = set()
    if forked:
        # Load each child's kernels as soon as it exits, while the others still compile.
        # Slowest first: the reverse of recording order (Note [Compiling in forked processes]).
        for share in _compile_in_children(distinct[::-1], children):
            for launch in share:
                with contextlib.suppress(Exception):  # _compile_here compiles it again
                    launch.compile()
                    loaded.add(launch.specialization())
    in_children = time.perf_counter() - started
    _compile_here([x for x in distinct if x.specialization() not in loaded], threads)
    _log.debug(
        "dilated_attention: %d distinct kernels: %.2f s in %s, then %.2f s here",
        len(distinct), in_children, "forked children" if forked else "no child",
        time.perf_counter() - started - in_children,
    )  # fmt: skip
    if marker is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()


def prepare_compiler(capability: tuple[int, int]) -> None:
    """Fill Triton's once-per-process state side by side (Note [The compiler's first use]):
    the hash of its own files and of ``ptxas --version`` in threads, while this thread builds
    (or loads) the driver's C helpers. Anything that fails here is left to Triton's own first
    use, which raises where it always did."""
    with ThreadPoolExecutor(2) as pool:
        hashes = [pool.submit(_triton_key), pool.submit(_backend_hash, capability)]
        with contextlib.suppress(Exception):
            _active_driver().get_current_target()
        for future in hashes:
            with contextlib.suppress(Exception):
                future.result()


def _triton_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()


def _backend_hash(capability: tuple[int, int]) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    make_backend(GPUTarget("cuda", capability[0] * 10 + capability[1], 32)).hash()


def _marker(launches: list[Launch]) -> str | None:
    """The marker file of these launches' kernels in Triton's cache directory: named by a hash of
    each kernel's source (Triton's ``cache_key``) and specialization, the Triton version and the
    target (a cache directory shared by GPUs of several kinds holds a marker per kind).
    ``None`` where it cannot be named."""
    try:
        import triton
        from triton import knobs

        cache_dir = knobs.cache.dir
        target = _active_driver().get_current_target()
    except (ImportError, AttributeError, RuntimeError):
        return None
    kernels = sorted(
        f"{getattr(launch.kernel, 'cache_key', launch.kernel)!r} "
        f"{launch.specialization()[1:]!r}"
        for launch in launches
    )  # fmt: skip
    parts = [triton.__version__, repr(target), *kernels]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, "dilated_attention_compiled", digest)


def _compile_here(launches: list[Launch], workers: int) -> None:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # older Triton: one after another
        for launch in launches:
            launch.compile()
        return
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
        for launch in launches:
            launch.compile()


def _active_driver() -> Any:
    from triton.runtime import driver

    return driver.active


def _compile_in_children(launches: list[Launch], workers: int) -> Iterator[list[Launch]]:
    """Fork up to ``workers`` children, each compiling a share of ``launches`` into the disk
    cache; yield each share whose child exited cleanly, as it exits. A child still running at
    ``CHILD_TIMEOUT_S`` is killed (its share is not yielded)."""
    active = _active_driver()
    device = active.get_current_device()
    target = active.get_current_target()
    children: dict[int, list[Launch]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: fork with threads
        for share in (launches[i::workers] for i in range(min(workers, len(launches)))):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:  # the child: compile, never return into the caller's code
                status = 1
                try:
                    if _held_lock is not None:
                        os.close(_held_lock)
                    _compile_detached(share, device, target)
                    status = 0
                finally:
                    os._exit(status)
            children[pid] = share
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while children and time.monotonic() <= deadline:
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    share = children.pop(pid)
                    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                        yield share
            time.sleep(0.005)
    finally:  # past the deadline, or the caller stopped early: no child outlives this
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def answer_device_queries(device: int, target: Any) -> Any:
    """Make Triton's active driver answer its device, stream and target queries with these
    values, without a CUDA call (a forked child, or a compile for another GPU); the driver."""
    active = _active_driver()
    active.get_current_device = lambda: device
    active.get_current_stream = lambda device=None: 0
    active.get_current_target = lambda: target
    return active


def _compile_detached(launches: list[Launch], device: int, target: Any) -> None:
    """In a forked child: compile into the disk cache with Triton's device queries answered
    from the parent's values (no CUDA call), including each kernel's launcher where this
    Triton builds one per kernel."""
    active = answer_device_queries(device, target)
    for launch in launches:
        kernel = launch.compile()
        with contextlib.suppress(Exception):  # the parent builds it on first launch instead
            active.launcher_cls(kernel.src, kernel.metadata)
