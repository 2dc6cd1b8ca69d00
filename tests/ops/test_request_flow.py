"""Every public function is checks -> one ``Request`` -> one route (Note [One resolve step]),
packed documents and decoding caches included (Note [A cache call is one request], Note
[Packed documents as one row]).

A call followed from ``DilatedAttention.forward`` (or a public function) reaches
``functional.py`` once: the frames of ``functional.py`` call checks, build one request and call
``compiled.route`` last, nothing else; the eager route resolves once. Read with
``sys.setprofile``, so the test sees what actually runs.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dilated_attention as da
from dilated_attention.block_sparse.runtime import check_block_mask
from dilated_attention.modules import DilatedAttention
from dilated_attention.patterns import LocalWindow
from dilated_attention.resolve import Request, resolver
from dilated_attention.resolve.packed import PackedStrategy

PACKAGE = Path(da.__file__).parent
FUNCTIONAL = str(PACKAGE / "functional.py")
SEGS, RATES = (4, 8), (1, 2)
B, N, H, HKV, D = 2, 8, 4, 2, 8
CU = [0, 3, 8, 13, 16]  # every row start among them


def _qkv(n: int = N, batch: int = B) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(batch, n, h, D) for h in (H, HKV, HKV))


def _dilated(q, k, v, **kw):  # type: ignore[no-untyped-def]
    return da.dilated_attention(q, k, v, SEGS, RATES, **kw)


def _layer(q, k, v, **kw):  # type: ignore[no-untyped-def]
    return DilatedAttention(SEGS, RATES)(q, k, v, **kw)


def _block_sparse(q, k, v, **kw):  # type: ignore[no-untyped-def]
    return da.block_sparse_attention(q, k, v, LocalWindow(1), block_size=2, **kw)


def _dense_window(q, k, v, **kw):  # type: ignore[no-untyped-def]
    return da.attention(q, k, v, window_size=(3, 0), **kw)


#: name -> (the call, a new cache or None, packed); each cache call runs a prompt then a token.
CASES: dict[str, tuple[Callable[..., Any], Callable[[], Any] | None, bool]] = {
    "dense packed": (da.attention, None, True),
    "dense window packed": (_dense_window, None, True),
    "dilated packed": (_dilated, None, True),
    "layer packed": (_layer, None, True),
    "block_sparse packed": (_block_sparse, None, True),
    "dilated cache": (_dilated, lambda: da.DilatedKVCache(SEGS, RATES), False),
    "layer cache": (_layer, lambda: da.DilatedKVCache(SEGS, RATES), False),
    "dilated static cache": (_dilated, lambda: da.StaticDilatedKVCache(SEGS, RATES), False),
    "layer static cache": (_layer, lambda: da.StaticDilatedKVCache(SEGS, RATES), False),
    "window cache": (_dense_window, lambda: da.WindowKVCache((3, 0)), False),
    "window static cache": (_dense_window, lambda: da.StaticWindowKVCache((3, 0)), False),
    "dilated packed prompt": (_dilated, lambda: da.DilatedKVCache(SEGS, RATES), True),
    "layer static packed prompt": (_layer, lambda: da.StaticDilatedKVCache(SEGS, RATES), True),
    "window packed prompt": (_dense_window, lambda: da.WindowKVCache((3, 0)), True),
}


class _Flow:
    """What the frames of ``functional.py`` call in the package (module, function), and how many
    requests are built before the route."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.requests_before_route = 0
        self.routed = False

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if event != "call":
            return
        code, caller = frame.f_code, frame.f_back
        if code.co_name == "__init__" and type(frame.f_locals.get("self")) is Request:
            self.requests_before_route += not self.routed
        if caller is None or caller.f_code.co_filename != FUNCTIONAL:
            return
        path = Path(code.co_filename)
        if code.co_filename == FUNCTIONAL or PACKAGE not in path.parents:
            return
        self.calls.append((path.relative_to(PACKAGE).as_posix(), code.co_name))
        self.routed = self.routed or code.co_name == "route"


@pytest.fixture(scope="module", autouse=True)
def _probed() -> None:
    """The kernels' first-use probes run once, outside the profiler (they are slow under it)."""
    for packed in (None, CU):
        da.attention(*_qkv(), cu_seqlens=packed)


def _traced(call: Callable[..., Any]) -> _Flow:
    flow = _Flow()
    sys.setprofile(flow)
    try:
        call()
    finally:
        sys.setprofile(None)
    return flow


#: What ``functional.py`` may call before the route: checks and the request's description, and
#: the requests kept for call signatures already checked (Note [Checked once per call
#: signature] in ``resolve/request.py``).
_DESCRIBING = {
    ("core/geometry/schedule.py", "__init__"), ("resolve/request.py", "of"),
    ("resolve/request.py", "dilated_operation"), ("resolve/caches.py", "cache_fields"),
}  # fmt: skip
_KEPT = {("resolve/request.py", name) for name in ("request", "_signature", "_get", "_keep")}
ROUTE = ("compiled/routing.py", "route")


def _check_flow(flow: _Flow, *, requests: int = 1) -> None:
    assert flow.calls[-1] == ROUTE, flow.calls
    assert flow.calls.count(ROUTE) == 1, flow.calls
    others = [
        c for c in flow.calls[:-1] if c[1].startswith("check") or c in _DESCRIBING | _KEPT
    ]
    assert others == flow.calls[:-1], f"functional.py runs more than checks: {flow.calls}"
    assert flow.requests_before_route == requests


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_or_cache_call_is_one_request_and_one_route(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed documents and cache calls (a prompt, then a token) reach ``functional.py`` once:
    checks, one request, one route, and the eager route resolves that request once."""
    call, new_cache, packed = CASES[case]
    resolved: list[Request] = []
    real = resolver.resolve
    monkeypatch.setattr(resolver, "resolve", lambda r: resolved.append(r) or real(r))
    cache = None if new_cache is None else new_cache()
    kw: dict[str, Any] = {"is_causal": True}
    if cache is not None:
        kw["cache"] = cache
    batch = 1 if packed and cache is not None else B
    q, k, v = _qkv(N * B // batch if packed else N, batch)
    if packed:
        kw["cu_seqlens"] = [0, 5, 16] if batch == 1 else CU
    with torch.no_grad():
        flow = _traced(lambda: call(q, k, v, **kw))
    _check_flow(flow)
    assert len(resolved) == 1
    assert resolved[0].documents == (tuple(kw["cu_seqlens"]) if packed else None)
    assert resolved[0].cache == (None if cache is None else type(cache).__name__)
    if cache is None:
        return
    resolved.clear()
    with torch.no_grad():
        flow = _traced(lambda: call(*_qkv(1, batch), cache=cache, is_causal=True))
    _check_flow(flow)
    assert len(resolved) == 1 and resolved[0].cache == type(cache).__name__


@pytest.mark.parametrize("case", ["dense", "dilated", "block_sparse"])
def test_a_plain_call_is_one_request_and_one_route(case: str) -> None:
    """Calls without documents or a cache: the same shape."""
    q, k, v = _qkv()
    call = {"dense": da.attention, "dilated": _dilated, "block_sparse": _block_sparse}[case]
    _check_flow(_traced(lambda: call(q, k, v, is_causal=True)))


@pytest.mark.parametrize("case", ["dense", "dilated"])
def test_a_call_signature_already_checked_takes_its_request(case: str) -> None:
    """A dense or dilated call with the metadata of one already checked runs no check and
    describes no request again: it takes the one kept for its signature (Note [Checked once per
    call signature]), and routes it once; a call that differs in any argument is checked anew."""
    call = {"dense": da.attention, "dilated": _dilated}[case]
    q, k, v = _qkv()
    first = _traced(lambda: call(q, k, v, is_causal=True))
    _check_flow(first)
    again = _traced(lambda: call(*_qkv(), is_causal=True))  # same metadata, new tensors
    _check_flow(again, requests=0)
    assert not [c for c in again.calls if c[1].startswith("check")], again.calls
    for changed in ({"is_causal": False}, {"scale": 0.5}, {"backend": "math"}):
        other = _traced(lambda changed=changed: call(q, k, v, **changed))
        _check_flow(other)
        assert ("_validation.py", "check_qkv") in other.calls


def test_functional_holds_no_packed_or_decoding_execution() -> None:
    """``functional.py`` defines the public functions, their checks and its compile wrapper
    only, and reaches the layers below through ``compiled.route`` alone: nothing that flattens
    documents, resolves, runs a strategy or changes a cache."""
    tree = ast.parse(Path(FUNCTIONAL).read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    public = {"attention", "dilated_attention", "block_sparse_attention"}
    checks = {name for name in defined if name.startswith("_check")}
    assert defined - checks == public | {"_eager_under_compile", "_runs_eagerly"}
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}  # fmt: skip
    running = {"resolve", "execute", "flatten", "unflatten", "last_document", "hide_masked_keys",
               "decode_step", "window_decode", "Strategy"}  # fmt: skip
    assert not imported & running
    on_compiled = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Name) and n.value.id == "compiled"}  # fmt: skip
    assert on_compiled == {"route"}


def test_a_packed_call_with_a_run_time_block_mask_runs_its_rows_whole() -> None:
    """A run-time block mask's blocks are the rows' (Note [Run-time block masks]): its packed
    call is one request and one route as well, resolved without the flattening of Note [Packed
    documents as one row]."""
    q, k, v = _qkv()
    mask = torch.ones(1, 1, N // 2, N // 2, dtype=torch.bool)
    cu = [0, 4, 8, 12, 16]  # documents start at multiples of the block size in their rows
    flow = _traced(lambda: da.block_sparse_attention(q, k, v, mask, block_size=2, cu_seqlens=cu))
    _check_flow(flow)
    layout = check_block_mask(mask, q, k, 2)
    request = Request.of("block_sparse", q, k, v, block_mask=layout, block_size=2,
                         documents=tuple(cu))  # fmt: skip
    assert not isinstance(resolver.resolve(request), PackedStrategy)
