"""Shared pytest setup: seeds, the ``gpu`` marker skip, per-worker CPU threads, compile threads
(and GPUs), kernel caches shared between workers and warmed before they start, float64 defaults
for the oracle, and ``--require-backends`` (``tests/support/required_backends.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any


def _cores() -> int:
    """The cores this process may run on (its affinity, e.g. under ``taskset``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _spread_workers_over_gpus() -> None:
    """Under pytest-xdist with ``DILATED_ATTENTION_TEST_GPUS=G``, worker ``i`` sees GPU ``i % G``
    alone (set before CUDA starts), so ``-n 24`` on a host of 2 GPUs runs on both."""
    gpus, worker = (
        os.environ.get("DILATED_ATTENTION_TEST_GPUS"),
        os.environ.get("PYTEST_XDIST_WORKER"),
    )
    if gpus and worker and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker.removeprefix("gw")) % int(gpus))


def _share_flash_attn4_kernels() -> None:
    """FlashAttention-4 keeps what it compiles on disk where asked
    (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``): set before it is imported, so the workers of
    one run (and later runs on this machine) compile each of its kernels once, not once each.
    An explicit setting is kept."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")


def _share_compile_threads() -> None:
    """Under pytest-xdist, Inductor compiles with each worker's share of the cores (set before
    torch is imported): its default, a pool of one compile process per core in every worker,
    oversubscribes the cores as torch's threads would (``pytest_configure``). Our Triton
    kernels compile in forked children (Note [Compiling in forked processes]): a worker forks
    at most four times its share, at least 2 (a worker compiles a small part of the time, and
    one that does compiles a family of 10-20 kernels)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        share = max(1, _cores() // int(workers))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(share))
        children = min(16, max(2, 4 * share))
        os.environ.setdefault("DILATED_ATTENTION_COMPILE_PROCESSES", str(children))


_spread_workers_over_gpus()
_share_flash_attn4_kernels()
_share_compile_threads()

import pytest  # noqa: E402
import torch  # noqa: E402
from support import required_backends  # noqa: E402

from dilated_attention.backends import Backend, get_backend  # noqa: E402
from dilated_attention.core.execution import graphs  # noqa: E402
from dilated_attention.resolve.resolver import clear_resolved  # noqa: E402

#: pytester runs the ``--require-backends`` tests' inner sessions (tests/backends).
pytest_plugins = ("pytester",)

#: The message of a test that names a required backend this machine lacks (set at collection).
_MISSING = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        required_backends.OPTION,
        metavar="NAMES",
        default=None,
        help="comma-separated backend names this run must have: a test that would skip while one "
        f"of them is missing or broken fails instead (default: ${required_backends.ENV})",
    )


#: The most workers ``-n auto`` (the suite's default, pyproject.toml) starts: each holds torch
#: and its compiled kernels (~1-2 GiB), and past a few the CPU suite's longest tests dominate.
MAX_AUTO_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, at most :data:`MAX_AUTO_WORKERS`
    (2 cores: the whole CPU suite in ~8.5 minutes where one process took ~12)."""
    return max(1, min(_cores(), MAX_AUTO_WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, give each worker its share of the CPU's threads: torch's default
    (one intra-op thread per core in every worker) oversubscribes the cores many times over,
    and the float64 oracle's products then run 10-100x slower than alone (measured on a 16-core
    GPU host at ``-n 16``: 5-19 s tests took 83-199 s). Also: the required backends."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None:
        torch.set_num_threads(max(1, _cores() // int(workers)))
    # Known to pytest-xdist, which may be absent (--strict-markers).
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs in one worker")
    value = config.getoption(required_backends.OPTION) or os.environ.get(required_backends.ENV)
    try:
        required_backends.REQUIRED = required_backends.parse(value)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is present, saying why; one that names
    a required backend (``--require-backends``) fails instead."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            missing = required_backends.missing_named_in(item.nodeid)
            if missing:
                item.stash[_MISSING] = required_backends.failure_message(missing)
            else:
                item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist on a CUDA machine, the controller runs ``python -m dilated_attention
    info`` once before the workers start: its availability probes compile every compiling
    backend's probe kernel (FlexAttention through Inductor, FlashAttention-4's CuTe DSL, our
    Triton kernels) into their disk caches, so each worker's probes load them instead of all
    workers compiling the same kernels at once. Not for a run that collects only or deselects
    the GPU tests; ``DILATED_ATTENTION_TEST_WARMUP=0`` turns it off."""
    config = session.config
    workers = config.getoption("numprocesses", None)
    if os.environ.get("PYTEST_XDIST_WORKER") or not workers or not torch.cuda.is_available():
        return
    if config.option.collectonly or "not gpu" in (config.option.markexpr or ""):
        return
    if os.environ.get("DILATED_ATTENTION_TEST_WARMUP", "1") == "0":
        return
    command = [sys.executable, "-m", "dilated_attention", "info"]
    try:
        subprocess.run(command, capture_output=True, check=True, timeout=300, cwd=config.rootpath)
    except (subprocess.SubprocessError, OSError) as exc:
        warnings.warn(f"warming the kernel caches failed ({exc}); each worker compiles its own",
                      stacklevel=1)  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if _MISSING in item.stash:
        pytest.fail(item.stash[_MISSING], pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A test that skipped while a required backend it names (in its id or its skip reason) is
    missing or broken fails, with that backend's reasons (``--require-backends``)."""
    report: pytest.TestReport = yield
    if not required_backends.REQUIRED or not report.skipped or hasattr(report, "wasxfail"):
        return report
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    missing = required_backends.missing_named_in(f"{item.nodeid} {reason}")
    if missing:
        report.outcome = "failed"
        message = required_backends.failure_message(missing)
        report.longrepr = f"{message}\n(it would have skipped: {reason})"
    return report


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_choices() -> None:
    """Every test resolves its calls anew: tests change kernels' reasons, priorities and
    probes (monkeypatch), which a strategy kept from an earlier test would not see (Note
    [Resolved once per request] in ``resolve/resolver.py``), and no launch bound by an
    earlier test is replayed, bound or from a CUDA graph (tests change kernel settings between
    calls)."""
    clear_resolved()
    bound = sys.modules.get("dilated_attention.backends.triton_kernels.launch")
    if bound is not None:
        bound.clear_bound()
    graphs.clear()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the backends whose ``_forward`` ran (math and cpu_flash are spied on)."""
    calls: list[str] = []
    for name in ("math", "cpu_flash"):
        cls = type(get_backend(name))
        original = cls._forward

        def spy(self: Backend, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(self.name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_forward", spy)
    return calls
