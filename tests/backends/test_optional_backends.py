"""Optional kernel backends (flash-attn 2/3/4, xformers) against fakes of their packages.

None of these packages can be installed where the tests run, so each test puts small fake modules
in ``sys.modules``. A fake implements the entry points a backend calls with plain-PyTorch
attention on the CPU, in float64, and records the arguments it receives. That checks import
handling, the argument mapping across package versions, the use of external ``out``/``lse`` in the
backward, and the capability logic (on a fake CUDA device); the real kernels are only exercised
where the packages are installed.

Shape legend: B batch, N rows, H query heads, Hkv key/value heads, D head dim; (B, N, H, D) layout,
lse (B, H, N).
"""

import importlib.abc
import sys
import types
from typing import Any

import pytest
import torch

import dilated_attention.backends.flash_attn4 as flash_attn4
import dilated_attention.backends.flash_attn4.chunks as chunk_rule
from dilated_attention.backends.base import KernelInputs, KernelOutput
from dilated_attention.backends.flash_attn2 import FlashAttn2Backend
from dilated_attention.backends.flash_attn3 import FlashAttn3Backend
from dilated_attention.backends.flash_attn4 import FlashAttn4Backend
from dilated_attention.backends.xformers import XformersBackend
from dilated_attention.core.reference import reference_backward

B, N, H, HKV, D = 2, 12, 4, 2, 8
SCALE = 0.3


# -- attention math for the fakes and the reference ----------------------------------------------
def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """(B, H, Nq, Nk) float64 scaled scores; causal is bottom-right aligned, as in flash-attn."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), _expand(k, q.shape[2]).double()) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        mask = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _fake_forward(q, k, v, scale, causal):
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.shape[2]).double())
    return out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32))


def _fake_backward(dout, q, k, v, out, lse, scale, causal):
    """Gradients from the given ``out``/``lse`` (FlashAttention-2 Alg. 2), GQA reduced."""
    heads, kv_heads = q.shape[2], k.shape[2]
    p = torch.exp(_scores(q, k, scale, causal) - lse.double().unsqueeze(-1))
    do, vd, kd = dout.double(), _expand(v, heads).double(), _expand(k, heads).double()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
    delta = (do * out.double()).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale

    def reduce(x: torch.Tensor) -> torch.Tensor:
        b, n, _, d = x.shape
        return x.view(b, n, kv_heads, heads // kv_heads, d).sum(3)

    return dq.to(q.dtype), reduce(dk).to(k.dtype), reduce(dv).to(v.dtype)


def _reference(q, k, v, dout, *, causal: bool):
    """Plain softmax attention in float64 with autograd (top-left causal): out, lse, grads."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    s = torch.einsum("bqhd,bkhd->bhqk", qd, _expand(kd, qd.shape[2])) * SCALE
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), _expand(vd, qd.shape[2]))
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), grads


def _inputs(seed: int = 0, kv_heads: int = HKV) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=gen)
    k = torch.randn(B, N, kv_heads, D, generator=gen)
    v = torch.randn(B, N, kv_heads, D, generator=gen)
    dout = torch.randn(B, N, H, D, generator=gen)
    return q, k, v, dout


def _assert_matches_reference(backend, causal: bool, kv_heads: int = HKV) -> None:
    q, k, v, dout = _inputs(kv_heads=kv_heads)
    res = backend.forward(q, k, v, scale=SCALE, is_causal=causal)
    grads = backend.backward(
        dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE, is_causal=causal
    )
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal=causal)
    assert res.out.shape == (B, N, H, D) and res.lse.shape == (B, H, N)
    assert res.lse.dtype == torch.float32
    torch.testing.assert_close(res.out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for got, want, name in zip(grads, ref_grads, ("dq", "dk", "dv"), strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=name)


# -- fake packages --------------------------------------------------------------------------------
def _install(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    monkeypatch.setitem(sys.modules, name, mod)
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        monkeypatch.setattr(sys.modules[parent], child, mod, raising=False)
    return mod


def _fa26_functions(calls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """flash-attn 2.6: ``window_size`` tuple, 8-tuple forward, backward returns its grads."""

    def _flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_softmax,
    ):  # fmt: skip
        calls["fwd"] = dict(locals())
        out, lse = _fake_forward(q, k, v, softmax_scale, causal)
        return out, q, k, v, out, lse, None, torch.tensor([7, 11])

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, rng_state=None,
    ):  # fmt: skip
        calls["bwd"] = dict(locals())
        grads = _fake_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        return dq, dk, dv, torch.zeros(1)

    return {
        "_flash_attn_forward": _flash_attn_forward,
        "_flash_attn_backward": _flash_attn_backward,
    }


# flash-attn 2.7+/2.8: torch custom ops (so ``inspect.signature`` sees ``(*args, **kwargs)`` and
# the backend must read ``_init_fn``), split window sizes, 4-tuple forward, in-place backward.
_FA28_CALLS: dict[str, dict[str, Any]] = {}


@torch.library.custom_op("dilated_attention_tests::fa28_forward", mutates_args=())
def _fa28_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _FA28_CALLS["fwd"] = dict(locals())
    out, lse = _fake_forward(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.tensor([7, 11])


@torch.library.custom_op("dilated_attention_tests::fa28_backward", mutates_args=("dq", "dk", "dv"))
def _fa28_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    _FA28_CALLS["bwd"] = dict(locals())
    assert dq is not None and dk is not None and dv is not None
    grads = _fake_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(grad)
    return torch.zeros(1)


def _install_fa2(monkeypatch: pytest.MonkeyPatch, style: str) -> dict[str, dict[str, Any]]:
    if style == "2.6":
        calls: dict[str, dict[str, Any]] = {}
        funcs = _fa26_functions(calls)
    else:
        _FA28_CALLS.clear()
        calls = _FA28_CALLS
        funcs = {"_flash_attn_forward": _fa28_forward, "_flash_attn_backward": _fa28_backward}
    _install(monkeypatch, "flash_attn", __version__="2.6.3" if style == "2.6" else "2.8.3")
    _install(monkeypatch, "flash_attn.flash_attn_interface", **funcs)
    return calls


def _fa3_new_functions(calls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """FlashAttention-3, custom-op era: keyword defaults, split windows, in-place backward."""

    def _flash_attn_forward(
        q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
        softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
        attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, sm_margin=0,
    ):  # fmt: skip
        calls["fwd"] = dict(locals())
        out, lse = _fake_forward(q, k, v, softmax_scale, causal)
        return out, lse, torch.empty(0), torch.empty(0)

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
        sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
        softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
        softcap=0.0, deterministic=False, sm_margin=0,
    ):  # fmt: skip
        calls["bwd"] = dict(locals())
        grads = _fake_backward(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal)
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        return torch.zeros(1)

    return {
        "_flash_attn_forward": _flash_attn_forward,
        "_flash_attn_backward": _flash_attn_backward,
    }


def _fa3_old_functions(calls: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """FlashAttention-3, 2025 era: optional tensors as required positionals, tuple windows."""

    def _flash_attn_forward(
        q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
        causal, window_size=(-1, -1), softcap=0.0, num_splits=1, pack_gqa=None, sm_margin=0,
    ):  # fmt: skip
        calls["fwd"] = dict(locals())
        o, lse = _fake_forward(q, k, v, softmax_scale, causal)
        return o, lse, torch.empty(0), torch.empty(0)

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
        max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
        softcap=0.0, deterministic=False, sm_margin=0,
    ):  # fmt: skip
        calls["bwd"] = dict(locals())
        grads = _fake_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        return dq, dk, dv, torch.zeros(1)

    return {
        "_flash_attn_forward": _flash_attn_forward,
        "_flash_attn_backward": _flash_attn_backward,
    }


# FlashAttention-3 as registered ops only (``torch.ops.flash_attn_3.fwd/bwd``), in the older
# TORCH_LIBRARY form whose schema gives no defaults.
_FA3_OP_CALLS: dict[str, dict[str, Any]] = {}
_FA3_FWD_ARGS = [
    "q", "k", "v", "k_new", "out", "softmax_scale", "is_causal", "window_size_left",
    "window_size_right", "softcap", "num_splits", "pack_gqa", "sm_margin",
]  # fmt: skip
_FA3_BWD_ARGS = [
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "max_seqlen_q",
    "softmax_scale", "is_causal", "window_size_left", "window_size_right", "softcap",
    "deterministic", "sm_margin",
]  # fmt: skip
_FA3_LIB = torch.library.Library("dilated_attention_tests_fa3", "DEF")
_FA3_LIB.define(
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new, Tensor? out, float softmax_scale, "
    "bool is_causal, int window_size_left, int window_size_right, float softcap, int num_splits, "
    "bool? pack_gqa, int sm_margin) -> Tensor[]"
)
_FA3_LIB.define(
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor? dq, "
    "Tensor? dk, Tensor? dv, Tensor? cu_seqlens_q, int? max_seqlen_q, float softmax_scale, "
    "bool is_causal, int window_size_left, int window_size_right, float softcap, "
    "bool deterministic, int sm_margin) -> Tensor[]"
)


def _fa3_op_fwd(*args: Any) -> list[torch.Tensor]:
    a = _FA3_OP_CALLS["fwd"] = dict(zip(_FA3_FWD_ARGS, args, strict=True))
    out, lse = _fake_forward(a["q"], a["k"], a["v"], a["softmax_scale"], a["is_causal"])
    return [out, lse, torch.empty(0), torch.empty(0)]


def _fa3_op_bwd(*args: Any) -> list[torch.Tensor]:
    a = _FA3_OP_CALLS["bwd"] = dict(zip(_FA3_BWD_ARGS, args, strict=True))
    grads = _fake_backward(
        a["dout"], a["q"], a["k"], a["v"], a["out"], a["softmax_lse"], a["softmax_scale"],
        a["is_causal"],
    )  # fmt: skip
    for buf, grad in zip((a["dq"], a["dk"], a["dv"]), grads, strict=True):
        buf.copy_(grad)
    return [torch.zeros(1)]


_FA3_LIB.impl("fwd", _fa3_op_fwd, "CPU")
_FA3_LIB.impl("bwd", _fa3_op_bwd, "CPU")


def _install_fa3(monkeypatch: pytest.MonkeyPatch, style: str) -> dict[str, dict[str, Any]]:
    calls: dict[str, dict[str, Any]] = {}
    if style == "ops":
        _FA3_OP_CALLS.clear()
        calls = _FA3_OP_CALLS
        funcs: dict[str, Any] = {}
        monkeypatch.setattr(
            torch.ops, "flash_attn_3", torch.ops.dilated_attention_tests_fa3, raising=False
        )
    elif style == "new":
        funcs = _fa3_new_functions(calls)
    else:
        funcs = _fa3_old_functions(calls)
    _install(monkeypatch, "flash_attn_3")
    _install(monkeypatch, "flash_attn_3.flash_attn_interface", **funcs)
    return calls


def _install_fa4(monkeypatch: pytest.MonkeyPatch, with_backward: bool = True) -> dict[str, Any]:
    calls: dict[str, dict[str, Any]] = {}

    def _flash_attn_fwd(
        q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False,
        softcap=None, window_size_left=None, window_size_right=None, num_splits=1,
        pack_gqa=None, return_lse=False, out=None, lse=None,
    ):  # fmt: skip
        calls["fwd"] = dict(locals())
        o, lse_ = _fake_forward(q, k, v, softmax_scale, causal)
        return o, (lse_ if return_lse else None)

    def _flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
        window_size_left=None, window_size_right=None, deterministic=False, dq=None, dk=None,
        dv=None,
    ):  # fmt: skip
        calls["bwd"] = dict(locals())
        return _fake_backward(dout, q, k, v, out, lse, softmax_scale, causal)

    funcs = {"_flash_attn_fwd": _flash_attn_fwd}
    if with_backward:
        funcs["_flash_attn_bwd"] = _flash_attn_bwd
    _install(monkeypatch, "flash_attn")
    _install(monkeypatch, "flash_attn.cute")
    _install(monkeypatch, "flash_attn.cute.interface", **funcs)
    return calls


class _LowerTriangularMask:
    """Stand-in for ``xformers.ops.fmha.attn_bias.LowerTriangularMask`` (top-left causal)."""


def _install_xformers(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: dict[str, dict[str, Any]] = {}

    def memory_efficient_attention_forward_requires_grad(
        query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None
    ):
        calls["fwd"] = dict(locals())
        assert key.shape[2] == query.shape[2], "4-D xformers inputs need expanded kv heads"
        causal = isinstance(attn_bias, _LowerTriangularMask)
        out, lse = _fake_forward(query, key, value, scale, causal)
        # The CUTLASS operator pads the lse rows to a multiple of 32.
        padded = torch.full((*lse.shape[:-1], 32), float("inf"), dtype=lse.dtype)
        padded[..., : lse.shape[-1]] = lse
        return out, padded

    def memory_efficient_attention_backward(
        grad, output, lse, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None
    ):
        calls["bwd"] = dict(locals())
        causal = isinstance(attn_bias, _LowerTriangularMask)
        return _fake_backward(grad, query, key, value, output, lse, scale, causal)

    _install(monkeypatch, "xformers")
    _install(monkeypatch, "xformers.ops")
    _install(
        monkeypatch, "xformers.ops.fmha",
        memory_efficient_attention_forward_requires_grad=(
            memory_efficient_attention_forward_requires_grad
        ),
        memory_efficient_attention_backward=memory_efficient_attention_backward,
        LowerTriangularMask=_LowerTriangularMask,
    )  # fmt: skip
    return calls


_INSTALLERS = {
    "flash_attn2": (FlashAttn2Backend, lambda mp: _install_fa2(mp, "2.8")),
    "flash_attn3": (FlashAttn3Backend, lambda mp: _install_fa3(mp, "new")),
    "flash_attn4": (FlashAttn4Backend, _install_fa4),
    "xformers": (XformersBackend, _install_xformers),
}
# Top-level modules whose absence or failure each backend must report.
_TOP_MODULES = {
    "flash_attn2": ("flash_attn",),
    "flash_attn3": ("flash_attn_3", "flash_attn_interface"),
    "flash_attn4": ("flash_attn",),
    "xformers": ("xformers",),
}


# -- (1) import reasons --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(_INSTALLERS))
def test_import_reasons_empty_with_package(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, install = _INSTALLERS[name]
    install(monkeypatch)
    assert cls().import_reasons() == []


def _forget_modules(monkeypatch: pytest.MonkeyPatch, tops: tuple[str, ...]) -> None:
    for mod_name in list(sys.modules):
        if mod_name.split(".")[0] in tops:
            monkeypatch.delitem(sys.modules, mod_name)


@pytest.mark.parametrize("name", list(_INSTALLERS))
def test_import_reasons_when_package_missing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, _ = _INSTALLERS[name]
    _forget_modules(monkeypatch, _TOP_MODULES[name])
    for top in _TOP_MODULES[name]:
        monkeypatch.setitem(sys.modules, top, None)  # makes `import top` raise ImportError
    reasons = cls().import_reasons()
    assert len(reasons) == 1 and "import failed" in reasons[0], reasons
    assert "ModuleNotFoundError" in reasons[0] or "ImportError" in reasons[0], reasons


class _ExplodingFinder(importlib.abc.MetaPathFinder):
    """Import hook whose modules fail the way a broken CUDA extension does."""

    def __init__(self, tops: tuple[str, ...]) -> None:
        self.tops = tops

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.split(".")[0] in self.tops:
            raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")


@pytest.mark.parametrize("name", list(_INSTALLERS))
def test_import_reasons_when_import_raises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, _ = _INSTALLERS[name]
    _forget_modules(monkeypatch, _TOP_MODULES[name])
    monkeypatch.setattr(sys, "meta_path", [_ExplodingFinder(_TOP_MODULES[name]), *sys.meta_path])
    reasons = cls().import_reasons()
    assert len(reasons) == 1, reasons
    assert "RuntimeError" in reasons[0] and "CUDA driver version" in reasons[0], reasons


def test_backends_import_nothing_at_module_import() -> None:
    for top in ("flash_attn", "flash_attn_3", "flash_attn_interface", "xformers"):
        assert top not in sys.modules or sys.modules[top] is None


def test_flash_attn4_without_external_stats_backward_is_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _install_fa4(monkeypatch, with_backward=False)
    reasons = FlashAttn4Backend().import_reasons()
    assert len(reasons) == 1 and "_flash_attn_bwd" in reasons[0], reasons


# -- (2) results against the float64 reference, every package flavour ----------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("style", ["2.6", "2.8"])
def test_flash_attn2_matches_reference(
    style: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_fa2(monkeypatch, style)
    _assert_matches_reference(FlashAttn2Backend(), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("style", ["new", "old", "ops"])
def test_flash_attn3_matches_reference(
    style: str, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_fa3(monkeypatch, style)
    _assert_matches_reference(FlashAttn3Backend(), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn4_matches_reference(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fa4(monkeypatch)
    _assert_matches_reference(FlashAttn4Backend(), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_xformers_matches_reference(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_xformers(monkeypatch)
    _assert_matches_reference(XformersBackend(), causal)


def test_xformers_rectangular_causal_is_top_left(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_xformers(monkeypatch)
    q, k, v, _ = _inputs()
    res = XformersBackend().forward(q[:, :5], k, v, scale=SCALE, is_causal=True)
    assert isinstance(calls["fwd"]["attn_bias"], _LowerTriangularMask)
    assert res.lse.shape == (B, H, 5)


# -- (3) argument mapping -------------------------------------------------------------------------
def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


@pytest.mark.parametrize("style", ["2.6", "2.8"])
def test_flash_attn2_argument_mapping(style: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_fa2(monkeypatch, style)
    q, k, v, dout = _inputs()
    backend = FlashAttn2Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=True, dropout_p=0.25)
    fwd = calls["fwd"]
    assert fwd["softmax_scale"] == SCALE and fwd["causal"] is True and fwd["dropout_p"] == 0.25
    assert fwd["softcap"] == 0.0 and fwd["alibi_slopes"] is None and fwd["return_softmax"] is False
    if style == "2.6":
        assert fwd["window_size"] == (-1, -1)
    else:
        assert (fwd["window_size_left"], fwd["window_size_right"]) == (-1, -1)
    # (B, N, H, D) goes in as is: no transposes, no copies, GQA heads not expanded.
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert _same_storage(fwd[name], tensor), name
    assert res.lse.shape == (B, H, N)
    assert torch.equal(res.aux, torch.tensor([7, 11]))  # rng_state, kept for the backward

    backend.backward(
        dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE, is_causal=True, dropout_p=0.25
    )
    bwd = calls["bwd"]
    assert bwd["softmax_scale"] == SCALE and bwd["causal"] is True and bwd["dropout_p"] == 0.25
    assert bwd["deterministic"] is False and torch.equal(bwd["rng_state"], res.aux)
    for name, tensor in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", res.out)):
        assert _same_storage(bwd[name], tensor), name
    assert bwd["dq"].shape == q.shape and bwd["dk"].shape == k.shape


def test_flash_attn2_copies_only_a_strided_last_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_fa2(monkeypatch, "2.8")
    _, k, v, _ = _inputs()
    wide = torch.randn(B, 2 * N, H, 2 * D)
    q_rows = wide[:, ::2, :, :D]  # dilated rows: strided, last dim contiguous
    q_cols = wide[:, :N, :, ::2]  # strided last dim
    FlashAttn2Backend().forward(q_rows, k, v, scale=SCALE)
    assert _same_storage(calls["fwd"]["q"], q_rows)
    FlashAttn2Backend().forward(q_cols, k, v, scale=SCALE)
    assert calls["fwd"]["q"].stride(-1) == 1
    torch.testing.assert_close(calls["fwd"]["q"], q_cols)


@pytest.mark.parametrize("style", ["new", "old", "ops"])
def test_flash_attn3_argument_mapping(style: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_fa3(monkeypatch, style)
    q, k, v, dout = _inputs()
    backend = FlashAttn3Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=True)
    fwd = calls["fwd"]
    causal_key = "is_causal" if style == "ops" else "causal"
    assert fwd["softmax_scale"] == SCALE and fwd[causal_key] is True
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert _same_storage(fwd[name], tensor), name
    if style == "old":
        assert fwd["k_new"] is None and fwd["out"] is None and fwd["window_size"] == (-1, -1)
    if style == "ops":  # schema ints without defaults get the kernel's own defaults
        assert (fwd["window_size_left"], fwd["window_size_right"], fwd["num_splits"]) == (-1, -1, 1)
        assert fwd["softcap"] == 0.0 and fwd["sm_margin"] == 0 and fwd["k_new"] is None
    assert res.lse.shape == (B, H, N)

    backend.backward(dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE, is_causal=True)
    bwd = calls["bwd"]
    causal_key = "causal" if style == "old" else "is_causal"
    assert bwd["softmax_scale"] == SCALE and bwd[causal_key] is True
    assert bwd["dq"].shape == q.shape and bwd["dk"].shape == k.shape
    for name, tensor in (("dout", dout), ("q", q), ("out", res.out)):
        assert _same_storage(bwd[name], tensor), name


def test_flash_attn4_argument_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_fa4(monkeypatch)
    q, k, v, dout = _inputs()
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=True)
    fwd = calls["fwd"]
    assert fwd["return_lse"] is True and fwd["softmax_scale"] == SCALE and fwd["causal"] is True
    assert fwd["window_size_left"] is None and fwd["window_size_right"] is None
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert _same_storage(fwd[name], tensor), name
    assert res.lse.shape == (B, H, N)
    backend.backward(dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE, is_causal=True)
    bwd = calls["bwd"]
    assert bwd["softmax_scale"] == SCALE and bwd["causal"] is True
    assert _same_storage(bwd["out"], res.out) and _same_storage(bwd["dout"], dout)


def _chunk_calls(
    monkeypatch: pytest.MonkeyPatch, per: str = "kv head"
) -> list[dict[str, Any]]:
    """FA4's backward calls, each one's arguments, with the chunks forced to one per key/value
    head, or to one per query head (Note [FlashAttention-4's accumulators by head chunks])."""
    monkeypatch.setattr(chunk_rule, "MIN_CHUNKED_ACCUMULATOR_BYTES", 0)
    if per == "kv head":
        monkeypatch.setattr(chunk_rule, "accumulator_chunks", lambda q, k, *rule: k.shape[2])
    else:
        monkeypatch.setattr(chunk_rule, "ACCUMULATOR_SHARE", 0.0)
    interface = sys.modules["flash_attn.cute.interface"]
    real_bwd, seen = interface._flash_attn_bwd, []

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, dq=None, dk=None,
            dv=None, mask_mod=None, aux_tensors=None, pack_gqa=None):  # fmt: skip
        seen.append(dict(locals()))
        return real_bwd(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal)

    monkeypatch.setattr(interface, "_flash_attn_bwd", bwd)
    return seen


@pytest.mark.parametrize("per", ["kv head", "query head"])
@pytest.mark.parametrize("kv_heads", [H, HKV, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn4_dense_backward_in_head_chunks(
    kv_heads: int, causal: bool, per: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole dense backward runs one FA4 call per chunk of key/value heads, or per query head
    (each later head of a group writing its dk and dv beside the gradients, added there), each
    over its query heads' rows of q, out, dout and lse (the fake returns gradients of its own,
    copied into the chunk's rows); the whole matches the reference from merged statistics."""
    _install_fa4(monkeypatch)
    seen = _chunk_calls(monkeypatch, per)
    q, k, v, dout = _inputs(kv_heads=kv_heads)
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=causal)
    gen = torch.Generator().manual_seed(5)
    lse = res.lse + torch.rand(res.lse.shape, generator=gen)  # another branch's mass
    grads = backend.backward(dout, q, k, v, res.out, lse, res.aux, scale=SCALE, is_causal=causal)
    group = H // kv_heads
    step = group if per == "kv head" else 1
    assert len(seen) == H // step
    for j, call in enumerate(seen):
        heads, kv = slice(j * step, (j + 1) * step), j * step // group
        assert torch.equal(call["q"], q[:, :, heads])
        assert torch.equal(call["k"], k[:, :, kv : kv + 1])
        assert torch.equal(call["dout"], dout[:, :, heads])
        assert torch.equal(call["lse"], lse[:, heads]) and call["lse"].is_contiguous()
        if len(seen) > 1:  # one call of every head returns the release's own gradients
            assert call["dq"].data_ptr() == grads[0][:, :, heads].data_ptr()
            first = j * step % group == 0  # a group's first part writes dk's rows, later ones not
            assert (call["dk"].data_ptr() == grads[1][:, :, kv].data_ptr()) == first
    want = reference_backward(dout, q, k, v, res.out, lse, scale=SCALE, is_causal=causal)
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=name)


def test_flash_attn4_backward_into_slots_is_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that writes into given buffers (a slotted plan's) stays one FA4 call whatever the
    chunks would be, writing those buffers."""
    _install_fa4(monkeypatch)
    seen = _chunk_calls(monkeypatch)
    q, k, v, dout = _inputs()
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=True)
    into = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backend._backward(dout, q, k, v, res.out, res.lse, None, scale=SCALE, is_causal=True,
                      key_mask=None, dropout_p=0.0, into=into)  # fmt: skip
    assert len(seen) == 1 and seen[0]["q"].shape == q.shape
    for name, buffer in zip(("dq", "dk", "dv"), into, strict=True):
        assert _same_storage(seen[0][name], buffer), name


@pytest.mark.parametrize("path", ["one-call", "chunked", "large chunks"])
def test_flash_attn4_whole_calls_run_through_run_launches(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole call allocates its results and runs FA4's call into them through
    ``run_launches`` (Note [A whole call's launches from a CUDA graph]), keyed by its options and
    naming every tensor it reads or writes, a backward in chunks too; the fake returns tensors
    of its own, copied into the results, which match the reference. A backward whose chunks
    each add ``MAX_REPLAYED_CHUNK_BYTES`` or more, and a slotted plan's calls (given their
    buffers), launch without it."""
    from dilated_attention.core.contract import Window

    _install_fa4(monkeypatch)
    chunked = path != "one-call"
    if chunked:
        _chunk_calls(monkeypatch)
    if path == "large chunks":
        monkeypatch.setattr(chunk_rule, "MAX_REPLAYED_CHUNK_BYTES", 0)
    runs: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

    def run_launches(self, key, tensors, launches, keep=None):  # type: ignore[no-untyped-def]
        runs.append((key, tuple(tensors)))
        launches()

    monkeypatch.setattr(FlashAttn4Backend, "run_launches", run_launches)
    monkeypatch.setattr(flash_attn4, "_key_padding", lambda *variant: "mm")
    q, k, v, dout = _inputs()
    mask = torch.zeros(B, 1, N, dtype=torch.bool)  # hides nothing: the fake's gradients hold
    window = Window(5, -1)
    backend = FlashAttn4Backend()
    res = backend._forward(q, k, v, scale=SCALE, is_causal=False, key_mask=None,
                           dropout_p=0.0, softcap=20.0, window=window)  # fmt: skip
    ((key, tensors),) = runs
    assert key == ("fa4 forward", SCALE, False, 20.0, window)
    assert tensors[:4] == (q, k, v, None) and tensors[4] is res.out and tensors[5] is res.lse
    returned = _fake_forward(q, k, v, SCALE, False)  # what the fake returned: copied
    assert torch.equal(res.out, returned[0]) and torch.equal(res.lse, returned[1])
    runs.clear()
    grads = backend._backward(dout, q, k, v, res.out, res.lse, None, scale=SCALE,
                              is_causal=False, key_mask=mask, dropout_p=0.0)  # fmt: skip
    if path == "large chunks":
        assert runs == []
    else:
        ((key, tensors),) = runs
        assert key == ("fa4 backward", SCALE, False, None, None)
        assert tensors[:7] == (dout, q, k, v, res.out, res.lse, mask)
        assert all(a is b for a, b in zip(tensors[7:], grads, strict=True))
    want = reference_backward(dout, q, k, v, res.out, res.lse, scale=SCALE)
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=name)
    runs.clear()
    buffers = torch.empty_like(q), torch.empty(B, H, N)
    into = KernelOutput(*buffers)
    empty = torch.zeros(B, 1, N, dtype=torch.bool)
    empty[1] = True  # batch row 1 sees no key: the result's lse is -inf there, a new tensor
    slot = backend.forward(q, k, v, scale=SCALE, key_mask=empty, into=into)
    backend._backward(dout, q, k, v, slot.out, slot.lse, None, scale=SCALE, is_causal=True,
                      key_mask=None, dropout_p=0.0, into=grads)  # fmt: skip
    assert runs == []
    # The caller's result object keeps its buffers (a slotted plan reads them after the call).
    assert into.out is buffers[0] and into.lse is buffers[1] and slot.out is buffers[0]
    assert torch.equal(into.out, _fake_forward(q, k, v, SCALE, False)[0])
    assert torch.isneginf(slot.lse[1]).all() and torch.isfinite(slot.lse[0]).all()


@pytest.mark.parametrize("path", ["one-call", "chunked", "large chunks", "into"])
def test_flash_attn4_backward_makes_the_lse_finite_itself(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FA4's backward gets the lse through ``Backend.backward`` as it is and makes its
    infinities 0 itself (NaN stays): a whole call, chunked or not, inside its ``run_launches``
    (so a replayed graph holds that launch), a call in chunks too large to replay or a slotted
    plan's call before its FA4 calls."""
    import dilated_attention.backends.base as base

    calls = _install_fa4(monkeypatch)
    chunked = path in ("chunked", "large chunks")
    seen = _chunk_calls(monkeypatch) if chunked else []
    if path == "large chunks":
        monkeypatch.setattr(chunk_rule, "MAX_REPLAYED_CHUNK_BYTES", 0)

    def not_here(lse: torch.Tensor) -> torch.Tensor:
        raise AssertionError("Backend.backward made FA4's lse finite")

    real_finite = base.finite_lse
    monkeypatch.setattr(base, "finite_lse", not_here)
    inside: list[bool] = []
    made: list[bool] = []  # per stand-in made: whether inside run_launches
    monkeypatch.setattr(flash_attn4, "finite_lse",
                        lambda lse: made.append(bool(inside)) or real_finite(lse))  # fmt: skip

    def run_launches(self, key, tensors, launches, keep=None):  # type: ignore[no-untyped-def]
        inside.append(True)
        launches()
        inside.clear()

    monkeypatch.setattr(FlashAttn4Backend, "run_launches", run_launches)
    q, k, v, dout = _inputs()
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=False)
    lse = res.lse.clone()
    lse[0, 0, 1], lse[0, 1, 2], lse[1, 2, 3] = float("-inf"), float("inf"), float("nan")
    into = None
    if path == "into":
        into = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backend.backward(dout, q, k, v, res.out, lse, res.aux, scale=SCALE, into=into)
    seen = seen or [calls["bwd"]]
    assert made == [path in ("one-call", "chunked")]
    assert len(seen) == (HKV if chunked else 1)
    group = H // HKV
    for j, call in enumerate(seen):
        heads = slice(j * group, (j + 1) * group) if chunked else slice(None)
        want = _finite_reference(lse)[:, heads]
        torch.testing.assert_close(call["lse"], want, equal_nan=True, atol=0, rtol=0)
        assert torch.isfinite(call["lse"]).sum() == want.numel() - want.isnan().sum()


def _finite_reference(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with each infinity 0 and NaN kept, written out element by element."""
    out = lse.clone()
    out[lse == float("inf")] = 0.0
    out[lse == float("-inf")] = 0.0
    return out


def test_flash_attn4_dense_backward_chunks_take_their_key_mask_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With chunks, a per-head key padding mask reaches each call as its heads' rows (and a
    mask shared by the heads whole), through the mask_mod of its own shape."""
    _install_fa4(monkeypatch)
    seen = _chunk_calls(monkeypatch)
    mods: list[tuple[bool, bool]] = []
    monkeypatch.setattr(flash_attn4, "_key_padding", lambda *variant: mods.append(variant) or "mm")
    q, k, v, dout = _inputs()
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=False)
    gen = torch.Generator().manual_seed(7)
    masks = torch.rand(B, H, N, generator=gen) < 0.3, torch.rand(B, 1, N, generator=gen) < 0.3
    for mask in masks:
        seen.clear()
        backend._backward(dout, q, k, v, res.out, res.lse, None, scale=SCALE, is_causal=False,
                          key_mask=mask, dropout_p=0.0)  # fmt: skip
        assert len(seen) == HKV
        group = H // HKV
        for j, call in enumerate(seen):
            rows = mask[:, j * group : (j + 1) * group] if mask.shape[1] > 1 else mask
            assert torch.equal(call["aux_tensors"][0], rows.to(torch.int32))
            assert call["mask_mod"] == "mm" and call["pack_gqa"] is False
    assert mods == [(True, False)] * HKV + [(False, False)] * HKV


def test_flash_attn4_key_padding_through_mask_mod(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key padding mask reaches FA4 as a mask_mod over an int32 copy of the mask, causal
    folded into the mask_mod, packed GQA off (Note [FlashAttention-4 key padding]); a package
    without mask_mod / aux_tensors, or a GPU other than sm90, gives a reason instead."""
    calls = _install_fa4(monkeypatch)
    assert "mask_mod" in " ".join(_reasons(FlashAttn4Backend, (9, 0), monkeypatch, has_mask=True))
    mods: list[tuple[bool, bool]] = []
    monkeypatch.setattr(flash_attn4, "_key_padding", lambda *variant: mods.append(variant) or "mm")
    interface = sys.modules["flash_attn.cute.interface"]
    real_fwd, real_bwd = interface._flash_attn_fwd, interface._flash_attn_bwd

    def fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, mask_mod=None,
            aux_tensors=None, pack_gqa=None):  # fmt: skip
        calls["masked_fwd"] = dict(locals())
        return real_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, dq=None, dk=None,
            dv=None, mask_mod=None, aux_tensors=None, pack_gqa=None):  # fmt: skip
        calls["masked_bwd"] = dict(locals())
        return real_bwd(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal)

    monkeypatch.setattr(interface, "_flash_attn_fwd", fwd)
    monkeypatch.setattr(interface, "_flash_attn_bwd", bwd)
    assert _reasons(FlashAttn4Backend, (9, 0), monkeypatch, has_mask=True) == []
    assert "sm90 only" in " ".join(_reasons(FlashAttn4Backend, (10, 0), monkeypatch, has_mask=True))
    q, k, v, dout = _inputs()
    mask = torch.zeros(B, 1, N, dtype=torch.bool)
    mask[1, 0, 3:] = True
    backend = FlashAttn4Backend()
    res = backend._forward(q, k, v, scale=SCALE, is_causal=True, key_mask=mask, dropout_p=0.0)
    backend._backward(dout, q, k, v, res.out, res.lse, None, scale=SCALE, is_causal=True,
                      key_mask=mask, dropout_p=0.0)  # fmt: skip
    for seen in (calls["masked_fwd"], calls["masked_bwd"]):
        assert seen["mask_mod"] == "mm" and seen["causal"] is False and seen["pack_gqa"] is False
        (aux,) = seen["aux_tensors"]
        assert aux.dtype == torch.int32 and torch.equal(aux, mask.to(torch.int32))
    assert mods == [(False, True), (False, True)]  # one head in the mask, causal
    per_head = torch.zeros(B, H, N, dtype=torch.bool)
    backend._forward(q, k, v, scale=SCALE, is_causal=False, key_mask=per_head, dropout_p=0.0)
    assert mods[-1] == (True, False)


def test_flash_attn4_softcap_and_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A soft-cap and a window reach FA4's softcap and window_size_left / right (-1: None),
    forward and backward; a window beside a key padding mask, an interface without the
    parameters, and FA4's block sparsity with a soft-cap are reasons instead."""
    from dilated_attention.core.contract import Window

    calls = _install_fa4(monkeypatch)
    assert _reasons(FlashAttn4Backend, (9, 0), monkeypatch, softcap=True, window=True) == []
    both = " ".join(_reasons(FlashAttn4Backend, (9, 0), monkeypatch, window=True, has_mask=True))
    assert "its mask_mod replaces the window" in both
    assert "no soft-capping in its block sparsity" in " ".join(
        FlashAttn4Backend().block_sparse_reasons(_cuda_inputs(softcap=True, block_size=128))
    )
    q, k, v, dout = _inputs()
    backend = FlashAttn4Backend()
    res = backend.forward(q, k, v, scale=SCALE, softcap=30.0, window=Window(7, -1))
    fwd = calls["fwd"]
    assert fwd["softcap"] == 30.0
    assert fwd["window_size_left"] == 7 and fwd["window_size_right"] is None
    backend.backward(dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE, softcap=30.0,
                     window=Window(7, 0))  # fmt: skip
    bwd = calls["bwd"]
    assert bwd["softcap"] == 30.0 and bwd["window_size_left"] == 7
    assert bwd["window_size_right"] == 0
    interface = sys.modules["flash_attn.cute.interface"]

    def bare(q, k, v, softmax_scale=None, causal=False, return_lse=False):
        raise AssertionError("never called")

    monkeypatch.setattr(interface, "_flash_attn_fwd", bare)
    lacks = " ".join(_reasons(FlashAttn4Backend, (9, 0), monkeypatch, softcap=True))
    assert "lacks ['softcap']" in lacks


def test_xformers_argument_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _install_xformers(monkeypatch)
    q, k, v, dout = _inputs()
    backend = XformersBackend()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=False)
    fwd = calls["fwd"]
    assert fwd["scale"] == SCALE and fwd["p"] == 0.0 and fwd["attn_bias"] is None
    assert _same_storage(fwd["query"], q) and fwd["key"].shape == (B, N, H, D)
    assert res.lse.shape == (B, H, N)  # padded rows cut off
    backend.backward(dout, q, k, v, res.out, res.lse, res.aux, scale=SCALE)
    bwd = calls["bwd"]
    assert bwd["scale"] == SCALE and bwd["p"] == 0.0 and bwd["lse"].shape == (B, H, N)
    assert _same_storage(bwd["grad"], dout) and _same_storage(bwd["output"], res.out)


# -- (4) capabilities on a fake CUDA device --------------------------------------------------------
def _cuda_inputs(**overrides: Any) -> KernelInputs:
    fields = dict(
        device=torch.device("cuda", 0), dtype=torch.bfloat16, head_dim=64, num_heads=H,
        num_kv_heads=HKV, query_len=N, key_len=N, is_causal=True, requires_grad=True,
    )  # fmt: skip
    fields.update(overrides)
    return KernelInputs(**fields)


def _reasons(cls: type, cc: tuple[int, int], monkeypatch: pytest.MonkeyPatch, **overrides: Any):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **kw: cc)
    monkeypatch.setattr(cls, "availability_reasons", lambda self, device: [])
    return cls().not_supported_reasons(_cuda_inputs(**overrides))


# Which compute capabilities each backend accepts (None: accepted), and the reason otherwise.
CAPABILITY_CASES = {
    FlashAttn2Backend: {(7, 5): "sm80", (8, 0): None, (8, 6): None, (9, 0): None, (10, 0): None},
    FlashAttn3Backend: {(7, 5): "sm90", (8, 0): "sm90", (9, 0): None, (10, 0): "sm90 (Hopper)"},
    FlashAttn4Backend: {
        (7, 5): "sm90", (8, 0): "sm90", (9, 0): None, (10, 0): None, (12, 0): "sm90 or sm100",
    },
    XformersBackend: {(7, 5): None, (8, 0): None, (9, 0): None, (10, 0): None},
}  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "cc", "expected"),
    [(cls, cc, want) for cls, table in CAPABILITY_CASES.items() for cc, want in table.items()],
    ids=lambda x: x.__name__ if isinstance(x, type) else str(x),
)
def test_compute_capability(cls, cc, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = _reasons(cls, cc, monkeypatch)
    if expected is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expected in reasons[0], reasons
        assert f"sm{cc[0]}{cc[1]}" in reasons[0], reasons


def test_cpu_device_is_refused() -> None:
    for cls in CAPABILITY_CASES:
        inputs = _cuda_inputs(device=torch.device("cpu"))
        assert cls().not_supported_reasons(inputs) == ["runs on ['cuda'], not cpu"]


# (backend, overrides, substring of the one expected reason; None = accepted) at sm90.
FEATURE_CASES = [
    (FlashAttn2Backend, {"dtype": torch.float32}, "dtype float32"),
    (FlashAttn2Backend, {"head_dim": 256}, None),
    (FlashAttn2Backend, {"head_dim": 264}, "head_dim 264 > 256"),
    (FlashAttn2Backend, {"head_dim": 36}, "not a multiple of 8"),
    (FlashAttn2Backend, {"query_len": 5}, "causal mask needs query_len == key_len"),
    (FlashAttn2Backend, {"query_len": 5, "is_causal": False}, None),
    (FlashAttn2Backend, {"has_mask": True}, "no key padding mask"),
    (FlashAttn2Backend, {"dropout_p": 0.1}, None),
    (FlashAttn2Backend, {"num_kv_heads": 1}, None),
    (FlashAttn3Backend, {"dropout_p": 0.1}, "no dropout"),
    (FlashAttn3Backend, {"has_mask": True}, "no key padding mask"),
    (FlashAttn3Backend, {"query_len": 5}, "causal mask needs query_len == key_len"),
    (FlashAttn3Backend, {"head_dim": 256, "dtype": torch.float16}, None),
    (FlashAttn3Backend, {"dtype": torch.float32}, "dtype float32"),
    (FlashAttn4Backend, {"dropout_p": 0.1}, "no dropout"),
    (FlashAttn4Backend, {"head_dim": 192}, None),
    (FlashAttn4Backend, {"query_len": 5}, "causal mask needs query_len == key_len"),
    (XformersBackend, {"dtype": torch.float32}, None),
    (XformersBackend, {"dtype": torch.float64}, "dtype float64"),
    (XformersBackend, {"query_len": 5}, None),
    (XformersBackend, {"dropout_p": 0.1}, "no dropout"),
    (XformersBackend, {"has_mask": True}, "no key padding mask"),
]


@pytest.mark.parametrize(("cls", "overrides", "expected"), FEATURE_CASES)
def test_features(cls, overrides, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = _reasons(cls, (9, 0), monkeypatch, **overrides)
    if expected is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expected in reasons[0], reasons


@pytest.mark.parametrize(("head_dim", "ok"), [(128, True), (192, False), (256, True)])
def test_flash_attn4_head_dims_on_sm100(head_dim, ok, monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = _reasons(FlashAttn4Backend, (10, 0), monkeypatch, head_dim=head_dim)
    assert (reasons == []) == ok, reasons


# (compute capability, head_dim, dropout_p, accepted for training)
WIDE_HEAD_CASES = [
    ((8, 0), 256, 0.1, True), ((9, 0), 256, 0.1, True), ((8, 6), 256, 0.1, False),
    ((8, 9), 256, 0.0, True), ((8, 6), 224, 0.0, False), ((10, 0), 200, 0.0, False),
    ((8, 6), 192, 0.1, True),
]  # fmt: skip


@pytest.mark.parametrize(("cc", "head_dim", "dropout_p", "ok"), WIDE_HEAD_CASES)
def test_flash_attn2_wide_head_backward(
    cc, head_dim, dropout_p, ok, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons = _reasons(FlashAttn2Backend, cc, monkeypatch, head_dim=head_dim, dropout_p=dropout_p)
    assert (reasons == []) == ok, reasons
    if not ok:
        assert "needs sm80 or sm90" in reasons[0]
    # Inference is fine everywhere.
    inference = _reasons(
        FlashAttn2Backend, cc, monkeypatch, head_dim=head_dim, dropout_p=dropout_p,
        requires_grad=False,
    )  # fmt: skip
    assert inference == []


def test_availability_reasons_are_checked_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **kw: (9, 0))
    monkeypatch.setattr(
        FlashAttn2Backend, "availability_reasons", lambda self, device: ["probe launch failed"]
    )
    backend = FlashAttn2Backend()
    assert backend.not_supported_reasons(_cuda_inputs()) == ["probe launch failed"]
    # A capability reason wins: no probe is launched for inputs refused anyway.
    assert backend.not_supported_reasons(_cuda_inputs(dtype=torch.float32)) == [
        "dtype float32 not in (bfloat16, float16)"
    ]


# -- (5) backward with external (merged) statistics -----------------------------------------------
EXTERNAL_CASES = [
    ("flash_attn2-2.6", FlashAttn2Backend, lambda mp: _install_fa2(mp, "2.6"), "softmax_lse"),
    ("flash_attn2-2.8", FlashAttn2Backend, lambda mp: _install_fa2(mp, "2.8"), "softmax_lse"),
    ("flash_attn3-new", FlashAttn3Backend, lambda mp: _install_fa3(mp, "new"), "softmax_lse"),
    ("flash_attn3-old", FlashAttn3Backend, lambda mp: _install_fa3(mp, "old"), "softmax_lse"),
    ("flash_attn3-ops", FlashAttn3Backend, lambda mp: _install_fa3(mp, "ops"), "softmax_lse"),
    ("flash_attn4", FlashAttn4Backend, _install_fa4, "lse"),
    ("xformers", XformersBackend, _install_xformers, "lse"),
]
_OUT_KEY = {"softmax_lse": "out", "lse": "out"}


@pytest.mark.parametrize(
    ("cls", "install", "lse_key"),
    [c[1:] for c in EXTERNAL_CASES],
    ids=[c[0] for c in EXTERNAL_CASES],
)
def test_backward_takes_external_statistics(
    cls, install, lse_key, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = install(monkeypatch)
    q, k, v, dout = _inputs()
    backend = cls()
    res = backend.forward(q, k, v, scale=SCALE, is_causal=True)
    # Merged statistics: another part of the softmax carried extra mass and moved the output.
    gen = torch.Generator().manual_seed(3)
    lse = res.lse + torch.rand(res.lse.shape, generator=gen)
    out = res.out + 0.1 * torch.randn(res.out.shape, generator=gen)
    grads = backend.backward(dout, q, k, v, out, lse, res.aux, scale=SCALE, is_causal=True)
    bwd = calls["bwd"]
    assert torch.equal(bwd[lse_key], lse)
    out_key = "output" if cls is XformersBackend else _OUT_KEY[lse_key]
    assert torch.equal(bwd[out_key], out)
    want = reference_backward(dout, q, k, v, out, lse, scale=SCALE, is_causal=True)
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=name)
