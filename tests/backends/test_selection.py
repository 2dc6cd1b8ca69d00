"""Backend selection: priority per compute capability, rejection reasons, overrides, the CLI.

GPU choices are tested without a GPU: ``torch.cuda.get_device_capability`` is faked and every
backend's availability (import + launch probe) is replaced by "available", or by "not installed"
for the optional packages (flash-attn 2/3/4, xformers). What remains is the declared capability
check (``Backend.not_supported_reasons``) and the priority walk (``registry.choose``): exactly what
decides the kernel on real hardware once the probes pass.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from support import REPO

import dilated_attention
from dilated_attention import backend_reasons, explain, list_backends, use_backend
from dilated_attention.backends import priority_rules, registry, slots_thresholds
from dilated_attention.backends.base import Backend, KernelInputs, KernelOutput
from dilated_attention.backends.registry import ENV_VAR, choose

OPTIONAL = ("flash_attn2", "flash_attn3", "flash_attn4", "xformers")
CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selection tests start from the automatic choice, whatever the caller's environment."""
    monkeypatch.delenv(ENV_VAR, raising=False)


def explain_cpu(**kwargs: Any) -> registry.BackendChoice:
    """``explain`` for the CPU: the override tests must not depend on whether a GPU is present
    (``explain()`` defaults to CUDA when there is one)."""
    return explain(device="cpu", **kwargs)


def _gpu_inputs(**overrides: Any) -> KernelInputs:
    args: dict[str, Any] = {
        "device": CUDA0,
        "dtype": torch.bfloat16,
        "head_dim": 64,
        "num_heads": 8,
        "num_kv_heads": 8,
        "query_len": 65536,  # past the short_dense rule's lengths (priorities.json)
        "key_len": 65536,
        "is_causal": True,
        "requires_grad": True,
    }
    args.update(overrides)
    return KernelInputs(**args)


def _cpu_inputs(**overrides: Any) -> KernelInputs:
    return _gpu_inputs(**{"device": CPU, "dtype": torch.float32, **overrides})


def _backend_class(name: str) -> type[Backend]:
    """The real backend class registered as ``name`` in ``dilated_attention.backends.<name>``."""
    try:
        module = importlib.import_module(f"dilated_attention.backends.{name}")
    except Exception as exc:
        pytest.skip(f"dilated_attention.backends.{name} does not import: {exc}")
    for value in vars(module).values():
        is_backend = isinstance(value, type) and issubclass(value, Backend)
        if is_backend and value is not Backend and getattr(value, "name", None) == name:
            return value
    pytest.skip(f"no Backend subclass named {name!r} in dilated_attention.backends.{name}")


def _fake_gpu(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], installed: Iterable[str] = ()
) -> None:
    """Pretend to be on a GPU of ``capability`` where every kernel launches, except the optional
    packages not in ``installed``, which report "not installed". Backends in ``installed`` that are
    not registered yet get a fresh instance of their real class (removed after the test).
    """
    installed = set(installed)
    for name in installed:
        if name not in registry._BACKENDS:
            monkeypatch.setitem(registry._BACKENDS, name, _backend_class(name)())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def availability_reasons(self: Backend, device: torch.device) -> list[str]:
        if self.name in OPTIONAL and self.name not in installed:
            return [f"{self.name} is not installed"]
        return []

    for cls in {type(b) for b in registry._BACKENDS.values()}:
        monkeypatch.setattr(cls, "availability_reasons", availability_reasons)


def _check_reasons_cover_others(choice: registry.BackendChoice) -> None:
    """Every registered backend but the chosen one has at least one reason."""
    assert set(choice.reasons) == set(list_backends()) - {choice.backend}
    for name, why in choice.reasons.items():
        assert why, f"{name} has no reason for not being chosen"
        assert all(isinstance(r, str) and r for r in why), why


def _check_order(choice: registry.BackendChoice) -> None:
    """The choice is the first backend of the walked order that can run the inputs: every one
    before it was unable (a reason other than ranking), every able one after it ranks after it;
    the order lists every backend once. (Which backend that is, per architecture and installed
    packages, is the behaviour each case states; the list itself is not restated here.)"""
    assert sorted(choice.order) == sorted(list_backends()), "order must list every backend once"
    position = choice.order.index(choice.backend)
    ranks_after = f"able, but ranks after {choice.backend!r} on this device"
    for name in choice.order[:position]:
        assert ranks_after not in choice.reasons[name], (name, choice.reasons[name])
    for name in choice.order[position + 1 :]:
        assert choice.reasons[name], name


# -- priority per architecture --------------------------------------------------------------------
#: (the kernel inputs, the dense choice on sm90 with FlashAttention-4 installed): square calls
#: like those the ``short_dense`` rule was measured on (bf16, 4K up to its lengths, at most 16
#: heads of at most 128) take cuDNN first; everything else keeps the device's order (where
#: neither FlashAttention-4 nor cuDNN soft-caps, our Triton kernels run).
SHORT_DENSE: dict[str, tuple[dict[str, Any], str]] = {
    "4K training": ({"query_len": 4096, "key_len": 4096}, "sdpa_cudnn"),
    "8191 training": ({"query_len": 8191, "key_len": 8191}, "sdpa_cudnn"),
    "8K training": ({"query_len": 8192, "key_len": 8192}, "flash_attn4"),
    "16383 forward": ({"query_len": 16383, "key_len": 16383, "requires_grad": False},
                      "sdpa_cudnn"),
    "16K forward": ({"query_len": 16384, "key_len": 16384, "requires_grad": False},
                    "flash_attn4"),
    "shorter than measured": ({"query_len": 256, "key_len": 256}, "flash_attn4"),
    "a decoding row": ({"query_len": 1, "key_len": 1}, "flash_attn4"),
    "not square": ({"query_len": 4096, "key_len": 8192, "is_causal": False}, "flash_attn4"),
    "float16": ({"query_len": 4096, "key_len": 4096, "dtype": torch.float16}, "flash_attn4"),
    "32 heads": ({"query_len": 4096, "key_len": 4096, "num_heads": 32, "num_kv_heads": 32},
                 "flash_attn4"),
    "packed documents": ({"query_len": 4096, "key_len": 4096, "documents": True},
                         "flash_attn4"),
    "soft-capped": ({"query_len": 4096, "key_len": 4096, "softcap": True}, "triton"),
}


@pytest.mark.parametrize("case", list(SHORT_DENSE))
def test_short_square_dense_calls_take_cudnn_first(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """FlashAttention-4's host time per call lost to cuDNN through ``attention()`` at 4K-8K
    (``short_dense`` in ``priorities.json``); longer, shorter and other calls keep the device's
    order."""
    _fake_gpu(monkeypatch, (9, 0), ("flash_attn4",))
    fields, expected = SHORT_DENSE[case]
    choice = choose(_gpu_inputs(**fields))
    assert choice.backend == expected, choice
    assert (choice.order[0] == "sdpa_cudnn") == (expected == "sdpa_cudnn"), choice.order
    _check_order(choice)


CASES = [
    # (capability, optional packages faked installed, expected choice)
    ((10, 0), (), "sdpa_cudnn"),
    ((10, 0), ("flash_attn4",), "flash_attn4"),
    ((10, 0), ("flash_attn3",), "sdpa_cudnn"),  # FA3 has no Blackwell kernels
    ((9, 0), (), "sdpa_cudnn"),
    ((9, 0), ("flash_attn3",), "sdpa_cudnn"),  # FA3 not yet verified on hardware
    ((9, 0), ("flash_attn4",), "flash_attn4"),
    ((9, 0), ("flash_attn3", "flash_attn4"), "flash_attn4"),
    ((9, 0), ("flash_attn2",), "sdpa_cudnn"),  # cuDNN ranks above FA2 on Hopper
    ((8, 6), (), "sdpa_flash"),
    ((8, 6), ("flash_attn2",), "sdpa_flash"),  # the package's FA2: not yet verified
    ((8, 0), (), "sdpa_flash"),
    ((8, 0), ("flash_attn2",), "sdpa_flash"),
    ((8, 0), ("flash_attn3", "flash_attn4"), "sdpa_flash"),  # both need sm90+
    ((7, 5), (), "sdpa_efficient"),
    ((7, 5), ("flash_attn2",), "sdpa_efficient"),  # FA2 needs sm80
    ((6, 0), (), "sdpa_efficient"),
]


@pytest.mark.parametrize(
    ("capability", "installed", "expected"),
    CASES,
    ids=[f"sm{c[0]}{c[1]}-{'+'.join(i) or 'none'}" for c, i, _ in CASES],
)
def test_priority_per_architecture(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    installed: tuple[str, ...],
    expected: str,
) -> None:
    _fake_gpu(monkeypatch, capability, installed)
    # Pre-Ampere GPUs have no bfloat16 attention kernels: test them with float16, their dtype.
    dtype = torch.float16 if capability < (8, 0) else torch.bfloat16
    choice = choose(_gpu_inputs(dtype=dtype))
    assert choice.backend == expected, choice
    assert choice.source == "auto"
    _check_order(choice)
    _check_reasons_cover_others(choice)
    # Everything ranked before the winner was rejected for a real reason, not for ranking.
    for name in choice.order[: choice.order.index(expected)]:
        assert not any("ranks after" in r for r in choice.reasons[name]), (name, choice.reasons)
    # Optional packages that are registered but not installed say so (unless the device rules
    # them out first).
    for name in set(OPTIONAL) & set(list_backends()) - set(installed):
        why = " ".join(choice.reasons[name])
        assert "not installed" in why or "compute capability" in why, (name, why)


def test_flash_attn4_does_not_train_small_head_dims_on_sm90(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On sm90 FlashAttention-4's backward is wrong below head dim 32 (Note [FlashAttention-4
    small head dims]): a call with gradients at head dim 16 goes to cuDNN with FA4's reason
    naming it; without gradients, and at head dim 32, FA4 stays first; sm100 is not affected."""
    from dilated_attention.backends.flash_attn4 import SM90_MIN_TRAINING_HEAD_DIM

    _fake_gpu(monkeypatch, (9, 0), ["flash_attn4"])
    small = SM90_MIN_TRAINING_HEAD_DIM // 2
    choice = choose(_gpu_inputs(head_dim=small, requires_grad=True))
    assert choice.backend == "sdpa_cudnn", choice
    assert f"head_dim {small} with gradients on sm90" in " ".join(choice.reasons["flash_attn4"])
    assert choose(_gpu_inputs(head_dim=small, requires_grad=False)).backend == "flash_attn4"
    enough = _gpu_inputs(head_dim=SM90_MIN_TRAINING_HEAD_DIM, requires_grad=True)
    assert choose(enough).backend == "flash_attn4"
    _fake_gpu(monkeypatch, (10, 0), ["flash_attn4"])
    assert choose(_gpu_inputs(head_dim=small, requires_grad=True)).backend == "flash_attn4"


def _cell_inputs(key: str, **overrides: Any) -> KernelInputs:
    """A slotted dilated call of a cell of ``slots_thresholds.json`` (``mha/training/d64/full``)."""
    kv, direction, dim, causal = key.split("/")
    fields = dict(
        dilated=True, branch_slots=True, head_dim=int(dim[1:]), is_causal=causal == "causal",
        requires_grad=direction == "training", num_kv_heads=2 if kv == "gqa" else 8,
    )  # fmt: skip
    return _gpu_inputs(**{**fields, **overrides})


@pytest.mark.parametrize("installed", [True, False], ids=["fa4", "no-fa4"])
def test_long_slotted_dilated_calls_follow_the_measured_table_on_sm90(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    """Each cell of ``slots_thresholds.json`` (Note [The measured slots table]): from its length
    a dilated call whose branches run in slots takes FlashAttention-4 first on sm90, one position
    shorter it does not, and a cell with no length never does; head dims below a measured one
    take its cell; schedules without slots, head dims above 128, masks and other architectures
    keep their order; without the package the fused kernels run and FlashAttention-4's reason
    says why."""
    _fake_gpu(monkeypatch, (9, 0), ["flash_attn4"] if installed else [])
    cells = slots_thresholds.table()["majors"]["9"]
    assert len(cells) == 16 and priority_rules.FA4_DILATED_MIN_LEN is not None
    for key, entry in cells.items():
        least = entry["min_query_len"]
        if least is None:
            assert choose(_cell_inputs(key, query_len=1 << 24)).order[0] != "flash_attn4", key
            continue
        choice = choose(_cell_inputs(key, query_len=least, key_len=least))
        assert choice.order[0] == "flash_attn4", key
        assert choice.backend == ("flash_attn4" if installed else "triton"), choice
        if not installed:
            assert "not installed" in " ".join(choice.reasons["flash_attn4"])
        shorter = _cell_inputs(key, query_len=least - 1, key_len=least - 1)
        assert choose(shorter).order[0] != "flash_attn4", key
        smaller = _cell_inputs(key, query_len=least, head_dim=int(key.split("/")[2][1:]) - 8)
        assert choose(smaller).order[0] == "flash_attn4", key
        for other in (
            dict(branch_slots=False), dict(head_dim=256), dict(has_mask=True),
        ):
            assert choose(_cell_inputs(key, query_len=least, **other)).order[0] != "flash_attn4"
    _fake_gpu(monkeypatch, (10, 0), ["flash_attn4"] if installed else [])
    long = _cell_inputs("mha/training/d128/full", query_len=1 << 20)
    assert priority_rules.dilated_first(long) == []  # sm100: the device's list


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), "triton"), ((10, 0), "sdpa_cudnn"), ((8, 0), "sdpa_flash")],
)
def test_dilated_calls_prefer_the_fused_kernels_where_measured(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: str
) -> None:
    """Dilated calls put ``triton`` first on sm90 only (the architecture it was measured on);
    dense calls keep the dense kernels first everywhere."""
    _fake_gpu(monkeypatch, capability)
    dilated = choose(_gpu_inputs(dilated=True))
    assert dilated.backend == expected, dilated
    _check_reasons_cover_others(dilated)
    assert choose(_gpu_inputs()).backend != "triton"
    # Training with head_dim 128 was measured (fused faster); above that, gather + cuDNN stays.
    training = choose(_gpu_inputs(dilated=True, head_dim=128, requires_grad=True))
    assert training.backend == expected, training
    wide = choose(_gpu_inputs(dilated=True, head_dim=256, requires_grad=True))
    assert wide.backend != "triton", wide
    if expected == "triton":  # inference takes the fused kernels at any head dim they run
        inference = choose(_gpu_inputs(dilated=True, head_dim=256, requires_grad=False))
        assert inference.backend == "triton", inference


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), "triton"), ((10, 0), "sdpa_efficient"), ((8, 0), "sdpa_efficient")],
)
def test_masked_16bit_calls_prefer_triton_where_measured(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: str
) -> None:
    """cuDNN and FlashAttention take no key padding mask. On sm90 (where it was measured 2.5-3.3x
    faster) 16-bit masked calls take ``triton`` ahead of the memory-efficient kernel; float32,
    training with head dims above 128 and other architectures keep the list's order."""
    _fake_gpu(monkeypatch, capability)
    masked = choose(_gpu_inputs(has_mask=True))
    assert masked.backend == expected, masked
    assert "no key padding mask" in " ".join(masked.reasons["sdpa_cudnn"]), masked.reasons
    _check_reasons_cover_others(masked)
    assert choose(_gpu_inputs(has_mask=True, dtype=torch.float16)).backend == expected
    assert choose(_gpu_inputs(has_mask=True, dtype=torch.float32)).backend == "sdpa_efficient"
    wide = choose(_gpu_inputs(has_mask=True, head_dim=256, requires_grad=True))
    assert wide.backend == "sdpa_efficient", wide
    assert choose(_gpu_inputs()).backend != "triton"  # unmasked: the dense kernels first


@pytest.mark.parametrize("capability", [(7, 5), (6, 0)])
def test_pre_ampere_rejects_sm80_kernels_by_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
) -> None:
    _fake_gpu(monkeypatch, capability, installed=("flash_attn2",))
    choice = choose(_gpu_inputs(dtype=torch.float16))
    assert choice.backend == "sdpa_efficient"
    sm = f"sm{capability[0]}{capability[1]}"
    for name in ("sdpa_flash", "sdpa_cudnn", "flash_attn2", "flex"):
        if name not in list_backends():
            continue
        why = " ".join(choice.reasons[name])
        assert "compute capability" in why and "sm80" in why and sm in why, (name, why)
    assert not any("compute capability" in r for r in choice.reasons["math"])


@pytest.mark.parametrize("capability", [(7, 5), (6, 0)])
def test_pre_ampere_bfloat16_is_not_sent_to_the_efficient_kernel(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
) -> None:
    """PyTorch builds the memory-efficient kernel's bfloat16 variant for sm80+ only."""
    _fake_gpu(monkeypatch, capability)
    choice = choose(_gpu_inputs(dtype=torch.bfloat16))
    assert choice.backend == "math"
    assert any("bfloat16" in r and "sm80" in r for r in choice.reasons["sdpa_efficient"])


@pytest.mark.parametrize(
    ("capability", "name"), [((9, 0), "flash_attn3"), ((8, 0), "flash_attn2"), ((8, 0), "xformers")]
)
def test_a_backend_not_verified_on_hardware_is_taken_only_by_name(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str
) -> None:
    """Installed and able, but never run in this project's GPU tests: the automatic choice
    passes it over and says why; asked for by name, it runs."""
    _fake_gpu(monkeypatch, capability, installed=(name,))
    choice = choose(_gpu_inputs(dtype=torch.float16))
    assert choice.backend != name
    assert any("never chosen automatically" in r for r in choice.reasons[name]), choice.reasons
    assert registry.select_backend(_gpu_inputs(dtype=torch.float16)).name == choice.backend
    assert choose(_gpu_inputs(dtype=torch.float16), name).backend == name


def test_sm90_fa3_first_once_verified_then_lower_ranks_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The priority table still ranks FA3 first on sm90, for when it is verified there."""
    _fake_gpu(monkeypatch, (9, 0), installed=("flash_attn3",))
    monkeypatch.setattr(registry.get_backend("flash_attn3"), "verified_on_hardware", True)
    choice = choose(_gpu_inputs())
    assert choice.backend == "flash_attn3"
    # Able backends below it are listed with the ranking reason.
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "math"):
        why = " ".join(choice.reasons[name])
        assert "ranks after" in why and "flash_attn3" in why, (name, why)


def test_sm90_cudnn_refuses_large_head_dim_falls_to_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    # sdpa_cudnn declares max_head_dim 128; sdpa_flash goes to 256.
    _fake_gpu(monkeypatch, (9, 0))
    choice = choose(_gpu_inputs(head_dim=192))
    assert choice.backend == "sdpa_flash"
    assert any("head_dim 192" in r for r in choice.reasons["sdpa_cudnn"])


def test_gpu_float64_goes_to_math(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (9, 0))
    choice = choose(_gpu_inputs(dtype=torch.float64))
    assert choice.backend == "math"
    assert any("dtype float64" in r for r in choice.reasons["sdpa_efficient"])


def test_explain_defaults_to_bf16_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (9, 0))
    seen: list[KernelInputs] = []
    real_choose = registry.OperationRegistry.choose

    def spy(
        self: registry.OperationRegistry, inputs: KernelInputs, name: str | None = None
    ) -> registry.BackendChoice:
        seen.append(inputs)
        return real_choose(self, inputs, name)

    monkeypatch.setattr(registry.OperationRegistry, "choose", spy)
    assert explain(device="cuda:0").backend == "sdpa_cudnn"
    assert seen[-1].dtype == torch.bfloat16 and seen[-1].device == CUDA0


# -- CPU ------------------------------------------------------------------------------------------
def test_cpu_chooses_cpu_flash() -> None:
    choice = choose(_cpu_inputs())
    assert choice.backend == "cpu_flash"
    assert choice.order[:2] == ["cpu_flash", "math"]
    _check_reasons_cover_others(choice)
    assert choice.reasons["math"] == ["able, but ranks after 'cpu_flash' on this device"]
    for name in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn"):
        assert any("not cpu" in r for r in choice.reasons[name]), choice.reasons[name]


def test_cpu_with_dropout_chooses_math() -> None:
    choice = choose(_cpu_inputs(dropout_p=0.1))
    assert choice.backend == "math"
    assert any("dropout" in r for r in choice.reasons["cpu_flash"])
    _check_reasons_cover_others(choice)


def test_cpu_float64_chooses_cpu_flash() -> None:
    choice = choose(_cpu_inputs(dtype=torch.float64))
    assert choice.backend == "cpu_flash"
    _check_reasons_cover_others(choice)


def test_cpu_with_key_padding_mask_chooses_cpu_flash() -> None:
    assert choose(_cpu_inputs(has_mask=True)).backend == "cpu_flash"


# -- installed but broken, or not installed -------------------------------------------------------
class _FakeBroken(Backend):
    """Imports fine, cannot launch: its probe fails; its kernels would return garbage."""

    name = "fake_broken"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})

    def __init__(self) -> None:
        self.probes = 0
        self.calls = 0

    def probe(self, device: torch.device) -> None:
        self.probes += 1
        raise RuntimeError("no kernel image")

    def _forward(self, q: Any, k: Any, v: Any, **kwargs: Any) -> KernelOutput:
        self.calls += 1
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        return KernelOutput(torch.full_like(q, 1234.5), lse)

    def _backward(self, dout: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return torch.full_like(q, 1234.5), torch.full_like(k, 1234.5), torch.full_like(v, 1234.5)


class _FakeMissing(_FakeBroken):
    """Its package is not installed; the probe must never run."""

    name = "fake_missing"

    def import_reasons(self) -> list[str]:
        return ["fake_pkg is not installed"]


def _set_host_order(m: pytest.MonkeyPatch, names: list[str]) -> None:
    """Make the priority table's host order ``names`` (restored with ``m``)."""
    table = copy.deepcopy(priority_rules.table())
    table["host"]["order"]["names"] = names
    m.setattr(priority_rules, "table", lambda: table)


def _host_order() -> list[str]:
    return list(priority_rules.table()["host"]["order"]["names"])


@contextlib.contextmanager
def _first_on_host(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> Iterator[Backend]:
    with monkeypatch.context() as m:
        m.setitem(registry._BACKENDS, backend.name, backend)
        _set_host_order(m, [backend.name, *_host_order()])
        yield backend
    assert backend.name not in list_backends()


def _qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 16, 2, 8, dtype=dtype) for _ in range(3))


def test_probe_failure_rejects_and_is_never_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    with _first_on_host(monkeypatch, _FakeBroken()) as fake:
        assert "fake_broken" in list_backends()
        choice = choose(_cpu_inputs())
        assert choice.order[0] == "fake_broken"
        assert choice.backend == "cpu_flash"
        why = " ".join(choice.reasons["fake_broken"])
        assert "probe" in why and "no kernel image" in why, why
        assert "no kernel image" in " ".join(backend_reasons(*_qkv())["fake_broken"])

        q, k, v = _qkv()
        out = dilated_attention.dilated_attention(q, k, v, [8], [1])
        ref = dilated_attention.dilated_attention(q, k, v, [8], [1], backend="math")
        torch.testing.assert_close(out, ref)
        with pytest.raises(ValueError, match="no kernel image") as err:
            dilated_attention.dilated_attention(q, k, v, [8], [1], backend="fake_broken")
        assert "fake_broken" in str(err.value) and "probe" in str(err.value)
        with pytest.raises(ValueError, match="no kernel image"), use_backend("fake_broken"):
            dilated_attention.dilated_attention(q, k, v, [8], [1])
        assert fake.calls == 0, "a backend whose probe failed ran a kernel"
        assert fake.probes == 1, "the probe result must be cached per device"


def test_calls_never_probe_the_backends_ranked_after_the_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call stops at the first backend that can run it; ``choose`` (``explain``) probes all."""
    with monkeypatch.context() as m:
        fake = _FakeBroken()
        m.setitem(registry._BACKENDS, fake.name, fake)
        _set_host_order(m, [*_host_order(), fake.name])
        q, k, v = _qkv()
        dilated_attention.dilated_attention(q, k, v, [8, 16], [1, 2])
        dilated_attention.attention(q, k, v)
        assert fake.probes == 0, "a backend ranked after the chosen one was probed"
        choice = choose(_cpu_inputs())
        assert fake.probes == 1 and "no kernel image" in " ".join(choice.reasons[fake.name])


def test_capability_reason_comes_before_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    with _first_on_host(monkeypatch, _FakeBroken()) as fake:
        choice = choose(_cpu_inputs(dtype=torch.float64))
        assert choice.reasons["fake_broken"] == ["dtype float64 not in (float32)"]
        assert fake.probes == 0


def test_missing_package_rejects_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with _first_on_host(monkeypatch, _FakeMissing()) as fake:
        choice = choose(_cpu_inputs())
        assert choice.backend == "cpu_flash"
        assert choice.reasons["fake_missing"] == ["fake_pkg is not installed"]
        q, k, v = _qkv()
        with pytest.raises(ValueError, match="fake_pkg is not installed"):
            dilated_attention.dilated_attention(q, k, v, [8], [1], backend="fake_missing")
        assert fake.probes == 0 and fake.calls == 0


# -- explicit backends ----------------------------------------------------------------------------
def test_explicit_cuda_backend_on_cpu_raises_with_reasons() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cuda") as err:
        dilated_attention.dilated_attention(q, k, v, [8], [1], backend="sdpa_cudnn")
    msg = str(err.value)
    assert "sdpa_cudnn" in msg and "cpu_flash" in msg  # names the backends that can


def test_explicit_backend_without_dropout_support_raises() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout"):
        dilated_attention.dilated_attention(q, k, v, [8], [1], dropout_p=0.1, backend="cpu_flash")


def test_unknown_backend_name_raises_listing_names() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="math"):
        dilated_attention.dilated_attention(q, k, v, [8], [1], backend="no_such_backend")


# -- use_backend ----------------------------------------------------------------------------------
def test_use_backend_forces_and_restores(kernel_calls: list[str]) -> None:
    assert explain_cpu().backend == "cpu_flash"
    with use_backend("math"):
        choice = explain_cpu()
        assert (choice.backend, choice.source) == ("math", "use_backend")
        assert choice.reasons["cpu_flash"] == ["'math' was requested (use_backend)"]
        q, k, v = _qkv()
        kernel_calls.clear()  # the first choice in a process probes cpu_flash with a call
        dilated_attention.dilated_attention(q, k, v, [8], [1])
        assert set(kernel_calls) == {"math"}
    choice = explain_cpu()
    assert (choice.backend, choice.source) == ("cpu_flash", "auto")


def test_use_backend_restores_after_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), use_backend("math"):
        assert explain_cpu().backend == "math"
        raise RuntimeError("boom")
    assert (explain_cpu().backend, explain_cpu().source) == ("cpu_flash", "auto")


def test_use_backend_nests() -> None:
    with use_backend("math"):
        with use_backend("cpu_flash"):
            assert (explain_cpu().backend, explain_cpu().source) == ("cpu_flash", "use_backend")
            with use_backend(None):
                assert (explain_cpu().backend, explain_cpu().source) == ("cpu_flash", "auto")
                assert explain_cpu(dropout_p=0.1).backend == "math"
        assert explain_cpu().backend == "math"
    assert explain_cpu().source == "auto"


def test_use_backend_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="no_such_backend"), use_backend("no_such_backend"):
        pass  # pragma: no cover
    assert explain_cpu().source == "auto"


def test_explicit_argument_wins_over_use_backend(kernel_calls: list[str]) -> None:
    with use_backend("math"):
        choice = explain_cpu(backend="cpu_flash")
        assert (choice.backend, choice.source) == ("cpu_flash", "argument")
        q, k, v = _qkv()
        dilated_attention.dilated_attention(q, k, v, [8], [1], backend="cpu_flash")
        assert set(kernel_calls) == {"cpu_flash"}


def test_use_backend_that_cannot_run_raises_on_call() -> None:
    q, k, v = _qkv()
    with use_backend("sdpa_flash"), pytest.raises(ValueError, match="use_backend"):
        dilated_attention.dilated_attention(q, k, v, [8], [1])


# -- environment variable -------------------------------------------------------------------------
def test_environment_override(monkeypatch: pytest.MonkeyPatch, kernel_calls: list[str]) -> None:
    monkeypatch.setenv(ENV_VAR, "math")
    choice = explain_cpu()
    assert (choice.backend, choice.source) == ("math", "environment")
    q, k, v = _qkv()
    dilated_attention.dilated_attention(q, k, v, [8], [1])
    assert set(kernel_calls) == {"math"}


@pytest.mark.parametrize("value", ["auto", "", "  auto  "])
def test_environment_auto_means_automatic(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    choice = explain_cpu()
    assert (choice.backend, choice.source) == ("cpu_flash", "auto")


def test_environment_unknown_name_raises_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "no_such_backend")
    with pytest.raises(ValueError, match=ENV_VAR) as err:
        explain_cpu()
    assert "no_such_backend" in str(err.value)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=ENV_VAR):
        dilated_attention.dilated_attention(q, k, v, [8], [1])


def test_environment_ranks_below_use_backend_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "math")
    with use_backend("cpu_flash"):
        assert (explain_cpu().backend, explain_cpu().source) == ("cpu_flash", "use_backend")
    assert (explain_cpu(backend="cpu_flash").backend, explain_cpu(backend="cpu_flash").source) == (
        "cpu_flash",
        "argument",
    )


def test_environment_backend_that_cannot_run_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sdpa_flash")
    with pytest.raises(ValueError, match="environment"):
        explain_cpu()


# -- explain --------------------------------------------------------------------------------------
def test_explain_defaults_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[KernelInputs] = []
    real_choose = registry.OperationRegistry.choose

    def spy(
        self: registry.OperationRegistry, inputs: KernelInputs, name: str | None = None
    ) -> registry.BackendChoice:
        seen.append(inputs)
        return real_choose(self, inputs, name)

    monkeypatch.setattr(registry.OperationRegistry, "choose", spy)
    choice = explain()
    assert choice.backend == "cpu_flash" and choice.source == "auto"
    assert seen[-1].device == CPU and seen[-1].dtype == torch.float32
    _check_reasons_cover_others(choice)
    assert explain(dropout_p=0.1).backend == "math"
    assert explain(dtype=torch.float64).backend == "cpu_flash"
    with pytest.raises(ValueError, match="sdpa_flash"):
        explain(backend="sdpa_flash")
    with pytest.raises(ValueError, match="math"):
        explain(backend="no_such_backend")


def test_backend_reasons_cover_every_backend() -> None:
    q, k, v = _qkv()
    reasons = backend_reasons(q, k, v, is_causal=True)
    assert set(reasons) == set(list_backends())
    assert reasons["cpu_flash"] == [] and reasons["math"] == []
    assert backend_reasons(q, k, v, dropout_p=0.1)["cpu_flash"]


# -- command line ---------------------------------------------------------------------------------
def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dilated_attention", *args],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _cpu_table(stdout: str) -> dict[str, list[str]]:
    """The CPU section of ``info``: backend name -> the columns after it."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("cpu:"))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cols = line.split()
        if cols and cols[0] in list_backends():
            rows[cols[0]] = cols[1:]
    return rows


def _starred(rows: dict[str, list[str]]) -> list[str]:
    return [name for name, cols in rows.items() if len(cols) > 1 and cols[1] == "*"]


def test_cli_info() -> None:
    proc = _run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "math" in proc.stdout and "cpu_flash" in proc.stdout
    rows = _cpu_table(proc.stdout)
    assert set(rows) == set(list_backends())
    assert _starred(rows) == ["cpu_flash"]
    assert rows["cpu_flash"][0] == "yes" and rows["math"][0] == "yes"


def test_cli_info_follows_the_environment() -> None:
    proc = _run_cli("info", env={ENV_VAR: "math"})
    assert proc.returncode == 0, proc.stderr
    assert _starred(_cpu_table(proc.stdout)) == ["math"]


# On the CPU explicitly: these check the CPU choice, whatever GPU the machine has.
LAYER_ARGS = ("layer", "--device", "cpu", "--seq-len", "1024", "--heads", "2", "--head-dim", "16")
LAYER_ARGS += ("--repeats", "1")


def test_cli_layer() -> None:
    proc = _run_cli(*LAYER_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert "backend chosen: cpu_flash" in proc.stdout
    assert "input gradient finite: True" in proc.stdout


def test_cli_layer_reports_the_backend_it_runs() -> None:
    # With DILATED_ATTENTION_BACKEND=math every attention call runs on math, so the layer timing
    # must say so rather than report the automatic choice.
    proc = _run_cli(*LAYER_ARGS, env={ENV_VAR: "math"})
    assert proc.returncode == 0, proc.stderr
    assert "backend chosen: math" in proc.stdout, proc.stdout


# -- one registry per operation -------------------------------------------------------------------
@pytest.mark.parametrize(("capability", "fused"), [((9, 0), True), ((10, 0), False)])
def test_dilated_registry_says_when_the_plan_kernel_runs(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], fused: bool
) -> None:
    """In the dilated registry ``triton`` is the fused plan kernel (``runs_plan``); every other
    name is a dense kernel the executor calls per gathered call. The dense registry has no plan
    kernel: ``triton`` there is one dense call."""
    _fake_gpu(monkeypatch, capability)
    dilated = explain(device="cuda:0", operation="dilated")
    assert (dilated.backend == "triton") is fused and dilated.runs_plan is fused, dilated
    assert dilated.operation == "dilated" and explain(device="cuda:0", dilated=True) == dilated
    named = explain(device="cuda:0", operation="dilated", backend="triton")
    assert named.runs_plan and named.backend == "triton"
    dense = explain(device="cuda:0", backend="triton")
    assert not dense.runs_plan and dense.operation == "dense"
    assert not explain(device="cuda:0", operation="dilated", backend="sdpa_cudnn").runs_plan


def test_block_sparse_registry_order_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-sparse on CUDA: FlashAttention-4's block sparsity first (not installed here), then
    the Triton kernels for inference, FlexAttention for training (all plan kernels), the
    executor's plan on a dense kernel by name; on the CPU the dense list, with why each plan
    kernel cannot run."""
    _fake_gpu(monkeypatch, (9, 0))

    def block_sparse(**kwargs: Any) -> registry.BackendChoice:
        return explain(device="cuda:0", operation="block_sparse", **kwargs)

    inference = block_sparse(requires_grad=False)
    assert (inference.backend, inference.runs_plan, inference.order[:3]) == (
        "triton", True, ["flash_attn4", "triton", "flex"],
    )  # fmt: skip
    assert inference.reasons["flash_attn4"]  # not installed here: FA4's block sparsity is first
    training = block_sparse(requires_grad=True)
    assert (training.backend, training.runs_plan, training.order[:3]) == (
        "flex", True, ["flash_attn4", "flex", "triton"],
    )  # fmt: skip
    assert training.reasons["triton"] == ["able, but ranks after 'flex' on this device"]
    untileable = block_sparse(requires_grad=False, block_size=48)
    assert untileable.backend == "flex"
    assert any("block_size 48 is not a multiple of 64" in r for r in untileable.reasons["triton"])
    dense = block_sparse(requires_grad=False, backend="sdpa_efficient")
    assert not dense.runs_plan and dense.backend == "sdpa_efficient", dense
    with pytest.raises(ValueError, match=r"'triton' .*block_sparse attention: .*head_dim 256"):
        block_sparse(head_dim=256, backend="triton")
    monkeypatch.undo()
    cpu = explain(device="cpu", operation="block_sparse")
    assert cpu.backend == "cpu_flash" and not cpu.runs_plan
    assert any("not cpu" in r for r in cpu.reasons["triton"])
    assert any("inference-only" in r for r in cpu.reasons["flex"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"operation": "sparse"},
            r"operation must be one of \('dense', 'dilated', 'block_sparse'\)",
        ),
        ({"operation": "dense", "dilated": True}, r"got operation='dense' with dilated=True"),
        ({"operation": "block_sparse", "block_size": 0}, r"block_size"),
        ({"operation": "block_sparse", "key_padding_mask": True}, r"no key_padding_mask"),
        ({"operation": "block_sparse", "dropout_p": 0.1}, r"no dropout"),
    ],
)
def test_explain_rejects_unknown_operations(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        explain(device="cpu", **kwargs)
    with pytest.raises(ValueError, match=r"operation must be one of"):
        registry.registry_for("sparse")
