"""Run a function in a small CPU ``torch.distributed`` world (gloo), for tests.

:func:`run_world` spawns ``world_size`` processes; each joins a gloo process group through a fresh
file under ``tmp_path`` (no TCP port to collide on), calls ``fn(rank, world_size, *args)`` and
leaves the group in ``finally``. A failure on any rank fails the caller with that rank's message
and traceback; the other ranks are stopped instead of waiting for it.

Processes start through a ``forkserver`` that has imported torch once (``spawn`` costs ~2 s of
imports per rank, ~9 s for four ranks on two cores; forking the pytest process itself would copy
its OpenMP thread pool). The server starts with the first world and serves every later one: it
also fixes the environment variables the workers see to those at that moment, so pass settings
as arguments, not through ``os.environ``. Worker functions must be defined at module level in an
importable module (``tests/`` is on ``sys.path`` under pytest): they are pickled by reference.
Pytest does not rewrite ``assert`` in the worker processes: workers should assert with messages
(``torch.testing.assert_close`` or ``assert cond, msg``). An exception expected on every rank is
tested inside the worker with ``pytest.raises``, which works without the pytest plugin.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerError", "count_exchanges", "run_world"]

#: Imported once by the forkserver, before any worker forks from it.
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "dilated_attention"]


class WorkerError(RuntimeError):
    """A rank's worker raised: the message names the rank and carries the original error."""


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    init_file: str,
    error_dir: str,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    # Two CPU cores shared by up to four ranks: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    phase = "init_process_group"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        phase = fn.__name__
        fn(rank, world_size, *args)
        phase = "the final barrier"  # nobody leaves while a peer may still be receiving from it
        dist.barrier()
    except BaseException as exc:
        # Record when and why this rank failed: a peer of a failed rank fails too (connection
        # reset, timeout), and the parent reports the first failure first.
        report = f"{time.time():.6f}\nin {phase}:\n" + traceback.format_exc()
        path = os.path.join(error_dir, f"rank{rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(report)
        os.replace(path + ".tmp", path)
        raise WorkerError(
            f"rank {rank}/{world_size} in {phase}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path | str,
    *args: Any,
    timeout_s: float = 60,
    start_method: str = "forkserver",
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (spawned processes).

    Args:
        fn: a module-level function; ``args`` must be picklable.
        world_size: number of processes.
        tmp_path: a directory for the file rendezvous (pytest's ``tmp_path``).
        timeout_s: the process-group timeout (a collective waiting longer raises on that rank);
            the whole world is also stopped after ``2 * timeout_s + 30`` seconds.
        start_method: ``"forkserver"`` (fast, see the module docstring) or ``"spawn"``.

    Raises:
        WorkerError: some rank raised or died; the message holds every failed rank's traceback,
            the earliest first (a peer of a failed rank often fails too, e.g. "Connection reset").
        TimeoutError: the world did not finish in time.
    """
    tag = uuid.uuid4().hex
    init_file = os.path.join(str(tmp_path), f"rdv-{tag}")
    error_dir = os.path.join(str(tmp_path), f"errors-{tag}")
    os.makedirs(error_dir)
    if start_method == "forkserver":
        # Takes effect only before the server's first start (later calls are harmless no-ops).
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, init_file, error_dir, float(timeout_s), args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    try:
        _join(context, fn, world_size, timeout_s)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        # The report holds every rank's traceback: the exception chain would only repeat one.
        raise WorkerError(_failure_report(error_dir, fn, world_size, exc)) from None


def _failure_report(error_dir: str, fn: Callable[..., Any], world_size: int, exc: Exception) -> str:
    """Every failed rank's traceback, the earliest failure first."""
    reports = []
    for name in os.listdir(error_dir):
        if name.endswith(".txt"):
            with open(os.path.join(error_dir, name)) as f:
                stamp, _, text = f.read().partition("\n")
            reports.append((float(stamp), name.removesuffix(".txt"), text))
    reports.sort()
    head = f"{fn.__name__} failed in a world of {world_size} ranks"
    if isinstance(exc, mp.ProcessExitedException):
        # No Python exception (a signal: gloo aborts on mismatched message sizes); see stderr.
        head += f" ({exc}; see the captured stderr)"
    if not reports:
        return head
    parts = [f"{head}; {len(reports)} rank(s) raised, earliest first:"]
    parts += [f"--- {rank} ---\n{text}" for _, rank, text in reports]
    return "\n".join(parts)


def _join(context: Any, fn: Callable[..., Any], world_size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + 2 * timeout_s + 30
    # join() raises on the first failed rank after terminating the others.
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(5)
            raise TimeoutError(
                f"distributed world of {world_size} ranks running {fn.__name__} did not finish "
                f"within {2 * timeout_s + 30:.0f} s"
            )


@contextlib.contextmanager
def count_exchanges(**modules: ModuleType) -> Iterator[dict[str, list[int]]]:
    """Wrap ``exchange`` in each ``label=module`` (every module that imported it by name needs
    its own wrap, and ``_comm`` for its collectives); record the bytes every call sends and
    receives under ``"{label}_sent"`` / ``"{label}_recv"``, and under ``"{label}_calls"`` 1 for a
    call with anything to send or receive (else 0), one entry per call."""
    log: dict[str, list[int]] = {}

    def wrap(original: Callable[..., Any], label: str) -> Callable[..., Any]:
        sent, received = log.setdefault(f"{label}_sent", []), log.setdefault(f"{label}_recv", [])
        calls = log.setdefault(f"{label}_calls", [])

        def counting(send: Any, recv: Any) -> Any:
            sent.append(sum(t.numel() * t.element_size() for t, _ in send))
            received.append(sum(t.numel() * t.element_size() for t, _ in recv))
            calls.append(int(bool(send or recv)))
            return original(send, recv)

        return counting

    with pytest.MonkeyPatch.context() as mp:
        for label, module in modules.items():
            mp.setattr(module, "exchange", wrap(module.exchange, label))
        yield log


@contextlib.contextmanager
def raises_on_rank(
    what: str, match: str, error: type[Exception] = ValueError, within_s: float | None = None
) -> Iterator[None]:
    """``pytest.raises(error, match=...)`` for worker code, whose failure names the case
    (``what``; pytest does not rewrite ``assert`` in spawned workers). An error of another type
    (a gloo abort, a timeout) fails with that error; ``within_s``: the error must come sooner
    (one that took the process group's timeout would not)."""
    start = time.monotonic()
    expected = f"{error.__name__} matching {match!r}"
    try:
        with pytest.raises(error, match=match):
            yield
    except (AssertionError, pytest.fail.Exception) as exc:  # no raise, or another message
        raise AssertionError(f"{what}: expected {expected}: {exc}") from None
    except Exception as exc:
        raise AssertionError(
            f"{what}: expected {expected}, got {type(exc).__name__}: {exc}"
        ) from exc
    took = time.monotonic() - start
    if within_s is not None:
        assert took < within_s, f"{what}: the error took {took:.1f} s (a timeout?)"
