"""``--require-backends`` (``tests/support/required_backends.py``): a test that would skip while a
required backend is missing or broken fails with that backend's reasons; without the option it
skips. The inner sessions run this suite's own ``tests/conftest.py`` (pytester, in process)."""

from __future__ import annotations

import pytest
import torch
from support import REPO, required_backends
from support.backend_params import runs_on
from support.required_backends import ENV, named_in, parse, unavailable_reasons

from dilated_attention import list_backends
from dilated_attention.backends import get_backend


def _missing_cuda_backend() -> tuple[str, list[str]]:
    """A registered CUDA backend that is missing or broken here, and its reasons (every CUDA
    backend on a machine without a GPU; an uninstalled kernel package on a GPU machine)."""
    for name in list_backends():
        if "cuda" in get_backend(name).devices:
            reasons = unavailable_reasons(name)
            if reasons:
                return name, reasons
    pytest.skip("every CUDA backend is installed and working here")


def test_parse_takes_registered_names() -> None:
    assert parse(None) == parse("") == parse(" , ") == frozenset()
    assert parse(" flash_attn4, triton,,sdpa_cudnn ") == {"flash_attn4", "triton", "sdpa_cudnn"}
    with pytest.raises(ValueError, match=r"unknown \['fa4', 'nope'\].*registered: math, "):
        parse("nope,flash_attn4,fa4")


def test_names_are_whole_tokens() -> None:
    names = frozenset({"flex", "flash_attn4", "math", "sdpa_flash"})
    text = "test_cuda_flash_attn4_writes_into_slots[longnet-full-whole] reflexive mathematics"
    assert named_in(text, names) == ["flash_attn4"]
    assert named_in("test_flex_path[0-True-torch.bfloat16] flash_attn42", names) == ["flex"]
    assert named_in("x[cuda-sdpa_flash] skipped: math: no", names) == ["math", "sdpa_flash"]


def test_a_backend_that_runs_here_has_no_reasons() -> None:
    assert unavailable_reasons("math") == [] and unavailable_reasons("cpu_flash") == []
    name, reasons = _missing_cuda_backend()
    assert reasons == get_backend(name).availability_reasons(torch.device("cuda"))


def test_registry_suites_collect_a_required_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend_params``: a required backend is collected on its devices even where it cannot
    run (its tests then fail), never on a device it does not declare."""
    name, _ = _missing_cuda_backend()
    monkeypatch.setattr(required_backends, "REQUIRED", frozenset())
    assert not runs_on(name, "cuda")
    monkeypatch.setattr(required_backends, "REQUIRED", frozenset({name}))
    assert runs_on(name, "cuda") and not runs_on(name, "cpu")


INNER_TESTS = """
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["{name}", "math"])
def test_kernel(backend):
    pytest.skip(f"{{backend}} cannot run this case here")

def test_skip_naming_it():
    pytest.skip("{name}: cannot run")

def test_other_skip():
    pytest.skip("needs something else")

def test_passes():
    pass
"""


def test_required_backend_turns_its_skips_into_failures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing backend named on the command line (or in the environment variable): the tests
    that name it (in their id or their skip reason; a ``gpu`` test on a machine without CUDA)
    fail with its reasons; other skips stay skips; unknown names are a usage error."""
    name, reasons = _missing_cuda_backend()
    monkeypatch.setattr(required_backends, "REQUIRED", required_backends.REQUIRED)  # restored
    monkeypatch.delenv(ENV, raising=False)
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\naddopts = --strict-markers\nmarkers =\n    gpu: needs CUDA")
    pytester.makepyfile(test_inner=INNER_TESTS.format(name=name))

    plain = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1, skipped=4)

    for args in ([f"--require-backends={name},math"], []):
        if not args:
            monkeypatch.setenv(ENV, name)
        run = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA", *args)
        run.assert_outcomes(passed=1, skipped=2, failed=2)
        run.stdout.fnmatch_lines([f"FAILED test_inner.py::test_kernel[[]{name}[]]*"])
        run.stdout.fnmatch_lines(["FAILED test_inner.py::test_skip_naming_it*"])
        run.stdout.fnmatch_lines([f"*{name} is required (--require-backends*{reasons[0][:60]}*"])
        run.stdout.fnmatch_lines(["SKIPPED*needs something else*"])

    monkeypatch.delenv(ENV)
    unknown = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--require-backends=nope")
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    unknown.stderr.fnmatch_lines(["*unknown [[]'nope'[]]*registered: math*"])
