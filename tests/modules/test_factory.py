"""The factory: kinds and aliases, lazy providers, backends, frozen configs, ``from_config``."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dilated_attention
from dilated_attention import (
    KIND_ALIASES,
    DilatedAttention,
    DilatedConfig,
    MultiheadDilatedAttention,
    MultiheadDilatedConfig,
    create_dilated_attention,
    create_multihead_dilated_attention,
    factory,
    list_kinds,
    register_kind,
)
from dilated_attention.backends.registry import ENV_VAR

SEGS, RATES = [8, 16], [1, 2]
F64 = torch.float64


@pytest.fixture(autouse=True)
def _isolated_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets copies of the kind tables, and the automatic backend choice."""
    monkeypatch.setattr(factory, "_KINDS", dict(factory._KINDS))
    monkeypatch.setattr(factory, "_PROVIDERS", dict(factory._PROVIDERS))
    monkeypatch.delenv(ENV_VAR, raising=False)


def _qkv(dtype: torch.dtype = F64, n: int = 40, heads: int = 4, kv_heads: int = 2) -> tuple:
    q = torch.randn(2, n, heads, 8, dtype=dtype)
    k = torch.randn(2, n, kv_heads, 8, dtype=dtype)
    v = torch.randn(2, n, kv_heads, 8, dtype=dtype)
    return q, k, v


def _kind_available(kind: str) -> bool:
    return KIND_ALIASES.get(kind, kind) in list_kinds()


# -- create_dilated_attention ---------------------------------------------------------------------
@pytest.mark.parametrize("is_causal", [False, True])
def test_default_factory_matches_functional(is_causal: bool) -> None:
    module = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert type(module) is DilatedAttention
    assert module.backend is None
    assert module.segment_lengths == (8, 16) and module.dilation_rates == (1, 2)
    q, k, v = _qkv()
    out = module(q, k, v, is_causal=is_causal)
    ref = dilated_attention.dilated_attention(q, k, v, SEGS, RATES, is_causal=is_causal)
    assert out.dtype == F64
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", ["dilated", "standard", "improved", "auto"])
def test_local_kinds_and_aliases(kind: str) -> None:
    module = create_dilated_attention(kind, segment_lengths=SEGS, dilation_rates=RATES)
    assert type(module) is DilatedAttention
    layer = create_multihead_dilated_attention(
        kind, embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
    )
    assert type(layer) is MultiheadDilatedAttention


def test_list_kinds() -> None:
    kinds = list_kinds()
    assert kinds[0] == "auto" and "dilated" in kinds
    assert len(kinds) == len(set(kinds))
    assert {"standard", "improved"} <= set(KIND_ALIASES)
    assert KIND_ALIASES["standard"] == KIND_ALIASES["improved"] == "dilated"


def test_auto_without_process_group_is_local() -> None:
    assert factory._distributed_world_size() == 1
    module = create_dilated_attention("auto", segment_lengths=SEGS, dilation_rates=RATES)
    assert type(module) is DilatedAttention


def test_unknown_kind_raises_listing_valid_kinds() -> None:
    with pytest.raises(ValueError, match="dilated") as err:
        create_dilated_attention("no_such_kind", segment_lengths=SEGS, dilation_rates=RATES)
    assert "no_such_kind" in str(err.value)
    with pytest.raises(ValueError, match="dilated"):
        create_multihead_dilated_attention(
            "no_such_kind", embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
        )


def test_non_string_kind_raises_type_error() -> None:
    with pytest.raises(TypeError, match="kind"):
        create_dilated_attention(3, segment_lengths=SEGS, dilation_rates=RATES)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["ring", "distributed", "block_sparse", "block_sparse_ring"])
def test_kinds_still_to_land(kind: str) -> None:
    """Ring and block-sparse kinds: refused with "not available" until their modules land, then
    built like any other kind (block-sparse kinds from a ``pattern``, refusing a dilated
    schedule with an error naming ``pattern``)."""
    if not _kind_available(kind):
        with pytest.raises(ValueError, match="not available") as err:
            create_dilated_attention(kind, segment_lengths=SEGS, dilation_rates=RATES)
        assert kind in str(err.value)
        with pytest.raises(ValueError, match="not available"):
            create_multihead_dilated_attention(
                kind, embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
            )
    elif kind.startswith("block_sparse"):
        # Block-sparse kinds take a pattern, not a dilated schedule: a clear error naming it.
        with pytest.raises(ValueError, match="pattern") as err:
            create_dilated_attention(kind, segment_lengths=SEGS, dilation_rates=RATES)
        assert kind in str(err.value)
        with pytest.raises(ValueError, match="pattern"):
            create_multihead_dilated_attention(kind, embed_dim=32, num_heads=4)
        pattern = dilated_attention.patterns.LocalWindow(1)
        module = create_dilated_attention(kind, pattern=pattern, block_size=8)
        assert isinstance(module, nn.Module)
        layer = create_multihead_dilated_attention(
            kind, embed_dim=32, num_heads=4, pattern=pattern, block_size=8
        )
        assert isinstance(layer, nn.Module)
    else:
        module = create_dilated_attention(kind, segment_lengths=SEGS, dilation_rates=RATES)
        assert isinstance(module, nn.Module)


def test_unknown_backend_raises_listing_names() -> None:
    with pytest.raises(ValueError, match="math") as err:
        create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES, backend="nope")
    assert "nope" in str(err.value)
    with pytest.raises(ValueError, match="math"):
        create_multihead_dilated_attention(
            embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES, backend="nope"
        )
    with pytest.raises(TypeError, match="backend"):
        create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES, backend=1)  # type: ignore[arg-type]


def test_auto_backend_is_none() -> None:
    module = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES, backend="auto")
    assert module.backend is None
    layer = create_multihead_dilated_attention(
        embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES, backend="auto"
    )
    assert layer.attention.backend is None


def test_named_backend_is_used(kernel_calls: list[str]) -> None:
    module = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES, backend="math")
    assert module.backend == "math"
    q, k, v = _qkv()
    out = module(q, k, v, is_causal=True)
    assert set(kernel_calls) == {"math"}
    ref = dilated_attention.dilated_attention(q, k, v, SEGS, RATES, is_causal=True, backend="math")
    assert torch.equal(out, ref)

    kernel_calls.clear()
    layer = create_multihead_dilated_attention(
        embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES, backend="math",
        dtype=F64,
    )  # fmt: skip
    layer(torch.randn(2, 40, 32, dtype=F64))
    assert set(kernel_calls) == {"math"}


def test_extra_kwargs_reach_the_constructor() -> None:
    module = create_dilated_attention(
        segment_lengths=SEGS, dilation_rates=RATES, scale=0.5, dropout=0.25
    )
    assert module.scale == 0.5 and module.dropout == 0.25
    with pytest.raises(TypeError):
        create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES, no_such_arg=1)


def test_bad_branches_raise_from_the_factory() -> None:
    with pytest.raises(ValueError, match="segment_lengths"):
        create_dilated_attention(segment_lengths=[0, 8], dilation_rates=RATES)
    with pytest.raises(ValueError, match="dilation_rates"):
        create_dilated_attention(segment_lengths=SEGS, dilation_rates=[1])


# -- create_multihead_dilated_attention -----------------------------------------------------------
def test_multihead_factory_shapes_and_forward() -> None:
    layer = create_multihead_dilated_attention(
        embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES, num_kv_heads=2
    )
    assert type(layer) is MultiheadDilatedAttention
    assert (layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.head_dim) == (32, 4, 2, 8)
    assert layer.q_proj.weight.shape == (32, 32)
    assert layer.k_proj.weight.shape == (16, 32)
    assert layer.v_proj.weight.shape == (16, 32)
    assert layer.out_proj.weight.shape == (32, 32)
    assert layer.config.num_kv_heads == 2
    x = torch.randn(2, 40, 32, requires_grad=True)
    out, weights = layer(x, is_causal=True)
    assert weights is None
    assert out.shape == (2, 40, 32) and out.dtype == torch.float32
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_multihead_factory_matches_constructor() -> None:
    kwargs: dict[str, Any] = {
        "embed_dim": 32, "num_heads": 4, "segment_lengths": SEGS, "dilation_rates": RATES,
        "num_kv_heads": 2, "dtype": F64,
    }  # fmt: skip
    torch.manual_seed(1)
    made = create_multihead_dilated_attention(**kwargs)
    torch.manual_seed(1)
    direct = MultiheadDilatedAttention(**kwargs)
    made_state, direct_state = made.state_dict(), direct.state_dict()
    assert list(made_state) == list(direct_state)
    for name, tensor in made_state.items():
        assert torch.equal(tensor, direct_state[name]), name
    x = torch.randn(2, 40, 32, dtype=F64)
    assert torch.equal(made(x)[0], direct(x)[0])


def test_multihead_factory_device_and_dtype() -> None:
    layer = create_multihead_dilated_attention(
        embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES, num_kv_heads=2,
        device="cpu", dtype=F64,
    )  # fmt: skip
    params = list(layer.parameters())
    assert params and all(p.dtype == F64 and p.device.type == "cpu" for p in params)
    out, _ = layer(torch.randn(1, 24, 32, dtype=F64))
    assert out.dtype == F64


def test_multihead_factory_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="embed_dim"):
        create_multihead_dilated_attention(
            embed_dim=30, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
        )


# -- configs --------------------------------------------------------------------------------------
def _cfg(**kwargs: Any) -> DilatedConfig:
    return DilatedConfig(**{"segment_lengths": SEGS, "dilation_rates": RATES, **kwargs})


def _mcfg(**kwargs: Any) -> MultiheadDilatedConfig:
    args = {"embed_dim": 32, "num_heads": 4, "segment_lengths": SEGS, "dilation_rates": RATES}
    return MultiheadDilatedConfig(**{**args, **kwargs})


def test_configs_normalise_to_tuples() -> None:
    cfg = _cfg()
    assert cfg.segment_lengths == (8, 16) and isinstance(cfg.segment_lengths, tuple)
    assert cfg.dilation_rates == (1, 2) and isinstance(cfg.dilation_rates, tuple)
    assert cfg == _cfg(segment_lengths=(8, 16), dilation_rates=(1, 2))
    assert hash(cfg) == hash(_cfg(segment_lengths=(8, 16), dilation_rates=(1, 2)))
    mcfg = _mcfg(num_kv_heads=2)
    assert mcfg.segment_lengths == (8, 16) and isinstance(mcfg.dilation_rates, tuple)


def test_configs_are_frozen() -> None:
    cfg, mcfg = _cfg(), _mcfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.segment_lengths = (4,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "math"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mcfg.embed_dim = 64  # type: ignore[misc]
    replaced = dataclasses.replace(cfg, dropout=0.1)
    assert replaced.dropout == 0.1 and cfg.dropout == 0.0


def test_configs_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        DilatedConfig(SEGS, RATES)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"segment_lengths": [0, 8]}, ValueError, "segment_lengths"),
        ({"segment_lengths": []}, ValueError, "segment_lengths"),
        ({"segment_lengths": [8, -16]}, ValueError, "segment_lengths"),
        ({"dilation_rates": [1]}, ValueError, "dilation_rates"),
        ({"dilation_rates": [1, 0]}, ValueError, "dilation_rates"),
        ({"dropout": 1.5}, ValueError, "dropout"),
        ({"backend": 3}, TypeError, "backend"),
    ],
)
def test_dilated_config_validates(kwargs: dict[str, Any], exc: type, word: str) -> None:
    with pytest.raises(exc, match=word):
        _cfg(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"embed_dim": 30}, "embed_dim"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"segment_lengths": [8, 0]}, "segment_lengths"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_multihead_config_validates(kwargs: dict[str, Any], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        _mcfg(**kwargs)


def test_dilated_from_config() -> None:
    cfg = _cfg(scale=0.3)
    module = DilatedAttention.from_config(cfg)
    assert type(module) is DilatedAttention
    assert module.config == cfg
    q, k, v = _qkv()
    ref = dilated_attention.dilated_attention(q, k, v, SEGS, RATES, scale=0.3)
    assert torch.equal(module(q, k, v), ref)


def test_multihead_from_config() -> None:
    cfg = _mcfg(num_kv_heads=2, bias=False, layer_norm=False)
    layer = MultiheadDilatedAttention.from_config(cfg, dtype=F64)
    assert layer.config == cfg
    assert layer.norm is None and layer.q_proj.bias is None
    assert all(p.dtype == F64 for p in layer.parameters())
    out, _ = layer(torch.randn(2, 40, 32, dtype=F64))
    assert out.shape == (2, 40, 32)


def test_module_config_matches_constructor_arguments() -> None:
    module = DilatedAttention(SEGS, RATES, dropout=0.1, backend="math")
    assert module.config == _cfg(dropout=0.1, backend="math")
    layer = MultiheadDilatedAttention(32, 4, SEGS, RATES, num_kv_heads=2)
    assert layer.config == _mcfg(num_kv_heads=2)


def test_factory_config_argument() -> None:
    cfg = _cfg(backend="math")
    module = create_dilated_attention(config=cfg)
    assert type(module) is DilatedAttention
    assert module.config == cfg and module.backend == "math"
    assert create_dilated_attention("dilated", config=cfg, dropout=0.2).dropout == 0.2

    mcfg = _mcfg(num_kv_heads=2)
    layer = create_multihead_dilated_attention(config=mcfg, dtype=F64)
    assert type(layer) is MultiheadDilatedAttention
    assert layer.config == mcfg
    assert layer.k_proj.weight.shape == (16, 32)
    assert all(p.dtype == F64 for p in layer.parameters())


@pytest.mark.parametrize("which", ["dilated", "multihead"])
def test_factory_config_with_backend_argument_is_not_ignored(which: str) -> None:
    # An explicit backend= next to config= must be honoured or refused, never silently dropped.
    try:
        if which == "dilated":
            module = create_dilated_attention(config=_cfg(), backend="math")
        else:
            module = create_multihead_dilated_attention(config=_mcfg(), backend="math").attention
    except (ValueError, TypeError):
        return
    assert module.backend == "math", f"{which}: backend='math' next to config= was dropped"


def test_factory_config_with_unknown_backend_raises() -> None:
    with pytest.raises(ValueError, match="math"):
        create_dilated_attention(config=_cfg(backend="nope"))


# -- registered and lazily provided kinds ---------------------------------------------------------
class _CustomDilated(DilatedAttention):
    pass


class _CustomMultihead(MultiheadDilatedAttention):
    pass


def test_register_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def build(**kwargs: Any) -> nn.Module:
        seen.append(kwargs)
        return _CustomDilated(**kwargs)

    with monkeypatch.context() as m:
        m.setattr(factory, "_KINDS", dict(factory._KINDS))
        register_kind("custom", dilated=build, multihead=_CustomMultihead)
        assert "custom" in list_kinds()
        module = create_dilated_attention(
            "custom", segment_lengths=SEGS, dilation_rates=RATES, dropout=0.1
        )
        assert type(module) is _CustomDilated
        assert seen == [
            {"segment_lengths": SEGS, "dilation_rates": RATES, "dropout": 0.1, "backend": None}
        ]
        layer = create_multihead_dilated_attention(
            "custom", embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
        )
        assert type(layer) is _CustomMultihead
        # A kind registered under an existing name replaces it.
        register_kind("dilated", dilated=_CustomDilated, multihead=_CustomMultihead)
        built = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
        assert type(built) is _CustomDilated
    assert "custom" not in list_kinds()
    built = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert type(built) is DilatedAttention


_PROVIDER_SOURCE = """
import dilated_attention
from dilated_attention import DilatedAttention, MultiheadDilatedAttention


class LazyDilated(DilatedAttention):
    pass


class LazyMultihead(MultiheadDilatedAttention):
    pass


if REGISTER:
    dilated_attention.register_kind(KIND, dilated=LazyDilated, multihead=LazyMultihead)
"""


def _provider(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    kind: str,
    *,
    register: bool = True,
) -> str:
    """Write a provider module for ``kind``, list it in ``factory._PROVIDERS``; its name."""
    name = f"_da_test_provider_{uuid.uuid4().hex}"
    source = f"KIND = {kind!r}\nREGISTER = {register}\n" + textwrap.dedent(_PROVIDER_SOURCE)
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(factory._PROVIDERS, kind, name)
    request.addfinalizer(lambda: sys.modules.pop(name, None))
    return name


def test_lazy_provider_is_imported_on_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    module_name = _provider(tmp_path, monkeypatch, request, "lazy_kind")
    assert "lazy_kind" in list_kinds()
    # Listing kinds and building other kinds never imports the provider.
    create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert module_name not in sys.modules
    module = create_dilated_attention("lazy_kind", segment_lengths=SEGS, dilation_rates=RATES)
    assert module_name in sys.modules
    assert type(module).__name__ == "LazyDilated"
    assert type(module).__module__ == module_name
    layer = create_multihead_dilated_attention(
        "lazy_kind", embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
    )
    assert type(layer).__name__ == "LazyMultihead"
    assert list_kinds().count("lazy_kind") == 1


def test_lazy_provider_that_registers_nothing_is_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    module_name = _provider(tmp_path, monkeypatch, request, "empty_kind", register=False)
    with pytest.raises(ValueError, match="not available"):
        create_dilated_attention("empty_kind", segment_lengths=SEGS, dilation_rates=RATES)
    assert module_name in sys.modules


# -- kind="auto" under a process group ------------------------------------------------------------
class _FakeRing(DilatedAttention):
    pass


class _FakeRingMultihead(MultiheadDilatedAttention):
    pass


def test_auto_picks_ring_when_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    register_kind("ring", dilated=_FakeRing, multihead=_FakeRingMultihead)
    monkeypatch.setattr(factory, "_distributed_world_size", lambda: 2)
    assert type(create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)) is _FakeRing
    layer = create_multihead_dilated_attention(
        "auto", embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES
    )
    assert type(layer) is _FakeRingMultihead
    # "distributed" is an alias of "ring"; "dilated" stays local under a process group.
    ring = create_dilated_attention("distributed", segment_lengths=SEGS, dilation_rates=RATES)
    assert type(ring) is _FakeRing
    local = create_dilated_attention("dilated", segment_lengths=SEGS, dilation_rates=RATES)
    assert type(local) is DilatedAttention

    monkeypatch.setattr(factory, "_distributed_world_size", lambda: 1)
    built = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert type(built) is DilatedAttention


def test_auto_stays_local_when_distributed_without_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    factory._KINDS.pop("ring", None)
    factory._PROVIDERS.pop("ring", None)
    monkeypatch.setattr(factory, "_distributed_world_size", lambda: 4)
    built = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert type(built) is DilatedAttention


def test_auto_imports_a_ring_provider_when_distributed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    factory._KINDS.pop("ring", None)
    module_name = _provider(tmp_path, monkeypatch, request, "ring")
    monkeypatch.setattr(factory, "_distributed_world_size", lambda: 1)
    create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert module_name not in sys.modules
    monkeypatch.setattr(factory, "_distributed_world_size", lambda: 2)
    module = create_dilated_attention(segment_lengths=SEGS, dilation_rates=RATES)
    assert type(module).__name__ == "LazyDilated" and module_name in sys.modules


def test_longnet_schedule_is_geometric_and_covers_the_sequence() -> None:
    from dilated_attention import longnet_schedule

    assert longnet_schedule(16384) == ([2048, 4096, 8192, 16384], [1, 2, 4, 8])
    assert longnet_schedule(10000, 4096) == ([4096, 8192, 16384], [1, 2, 4])
    assert longnet_schedule(1000) == ([1000], [1])
    with pytest.raises(ValueError, match="first_segment"):
        longnet_schedule(1000, 0)


# -- explain: bad devices -------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda"), 0])
def test_explain_cuda_without_a_gpu_is_a_clear_value_error(device: object) -> None:
    with pytest.raises(ValueError, match="no CUDA device is available here") as info:
        dilated_attention.explain(device=device)
    message = str(info.value)
    assert message.startswith("device=") and "device='cpu'" in message  # names it and the fix


def test_explain_unknown_device_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="device='junk' is not a device; use cpu, cuda or cuda:N"):
        dilated_attention.explain(device="junk")
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        dilated_attention.explain(device=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        dilated_attention.explain(device="cpu", dtype="float32")  # type: ignore[arg-type]
    assert dilated_attention.explain(device="cpu").backend in dilated_attention.list_backends()


def test_kind_with_only_an_inner_constructor_gets_the_library_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``register_kind(name, dilated=...)`` alone: the factory's multihead layer is
    ``MultiheadAttention`` around the inner module, the layer's arguments going to the layer and
    the rest to the inner constructor; it computes what ``MultiheadDilatedAttention`` does."""
    seen: list[dict[str, Any]] = []

    def inner(**kwargs: Any) -> nn.Module:
        seen.append(kwargs)
        return DilatedAttention(**kwargs)

    monkeypatch.setattr(factory, "_KINDS", dict(factory._KINDS))
    register_kind("inner_only", dilated=inner)
    layer = create_multihead_dilated_attention(
        "inner_only", embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES,
        num_kv_heads=2, gamma_init=0.5, dtype=torch.float64,
    )  # fmt: skip
    assert type(layer) is dilated_attention.MultiheadAttention
    assert seen == [{"segment_lengths": SEGS, "dilation_rates": RATES, "backend": None}]
    assert layer.num_kv_heads == 2 and layer.gamma_init == 0.5
    reference = MultiheadDilatedAttention(
        32, 4, SEGS, RATES, num_kv_heads=2, gamma_init=0.5, dtype=torch.float64
    )
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    torch.testing.assert_close(layer(x, is_causal=True)[0], reference(x, is_causal=True)[0])
    with pytest.raises(TypeError, match=r"attention must be an nn.Module"):
        dilated_attention.MultiheadAttention(32, 4, lambda q, k, v: q)  # type: ignore[arg-type]


# -- explain: how each branch of a schedule runs ---------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "kv_heads", "segments", "rates"),
    [
        # rate 1 (reshape), r = 4 > 8 / 4 (diagonal calls), r = 2 (offset classes), ragged w = 250
        # (offset classes of 84 and 83 rows)
        (8, 8, [100, 1000, 200, 250], [1, 4, 2, 3]),
        # GQA 8:4 with r = 3 (no strided key/value slice), r = 2 and r = 4 (slices), a short last
        # segment of w = 300 (100 positions, classes of different lengths)
        (8, 4, [300, 200, 1000], [3, 2, 4]),
    ],
)
def test_explain_says_how_each_branch_runs_as_the_plan_runs_it(
    heads: int, kv_heads: int, segments: list[int], rates: list[int]
) -> None:
    """With a schedule, ``explain`` gives one line per row group, and each says what the
    executor's plan does with that group on the chosen kernel: the number and kind of view calls,
    a reshape, or a gather with its reason."""
    from dilated_attention.core.geometry.segment import (
        dilated_plan,
        effective_branches,
        plan_branches,
    )

    seq_len = 1000
    choice = dilated_attention.explain(
        device="cpu", seq_len=seq_len, num_heads=heads, num_kv_heads=kv_heads,
        segment_lengths=segments, dilation_rates=rates, backend="math",
    )  # fmt: skip
    assert choice.operation == "dilated" and choice.backend == "math"
    groups = plan_branches(seq_len, heads, *effective_branches(seq_len, heads, segments, rates))
    assert len(choice.branches) == len(groups)
    seen = set()
    for group, line in zip(groups, choice.branches, strict=True):
        assert line.startswith(f"w={group.segment_len} r={group.rate}, positions {group.start}..")
        calls = dilated_plan((group,), seq_len, kv_heads, torch.device("cpu"), False, True).calls
        kinds = {type(call).__name__ for call in calls}
        if "gathered" in line:
            seen.add(line.split("gathered into one call: ")[1].split(":")[0])
            assert kinds == {"GroupCall"} and len(calls) == 1 and not group.is_dense
        elif "reshape" in line:
            seen.add("reshape")
            assert kinds == {"GroupCall"} and len(calls) == 1 and group.is_dense
        else:
            count = int(line.rsplit(": ", 1)[1].split()[0])
            kind = "DiagonalCall" if "diagonal" in line else "StridedCall"
            seen.add(kind)
            assert kinds == {kind} and len(calls) == count, (line, kinds, len(calls))
    want = {"reshape", "DiagonalCall", "StridedCall"} if heads == kv_heads else {
        "GQA", "StridedCall"
    }  # fmt: skip
    assert seen == want, seen


def test_explain_schedule_on_a_kernel_without_strided_rows_and_the_fused_kernels() -> None:
    """On a kernel that does not read strided rows every group that is not a whole segment is
    gathered, saying so; the fused plan kernel runs every branch itself, one line per branch;
    a schedule with another operation, or half a schedule, is a clear error."""
    from dilated_attention.core.geometry.schedule import Schedule
    from dilated_attention.core.geometry.segment import describe_plan, plan_branches
    from dilated_attention.resolve.resolver import fused_notes

    groups = plan_branches(1000, 8, (100, 1000), (1, 4))
    lines = describe_plan(groups, 1000, 8, strided=False)
    assert "reshape" in lines[0]
    assert all("the kernel does not read strided rows" in line for line in lines[1:])
    paths = fused_notes("triton", Schedule((100, 4000), (1, 4)).at(1000, 8, 8).branches)
    assert len(paths) == 2 and paths[1].startswith("w=1000 r=4: triton's plan kernel")
    with pytest.raises(ValueError, match="segment_lengths and dilation_rates together"):
        dilated_attention.explain(device="cpu", segment_lengths=[100])
    with pytest.raises(ValueError, match="segment_lengths"):
        dilated_attention.explain(device="cpu", segment_lengths=[0], dilation_rates=[1])
    with pytest.raises(ValueError, match="dilation_rates"):
        dilated_attention.explain(device="cpu", segment_lengths=[64, 128], dilation_rates=[1])
    with pytest.raises(ValueError, match="operation='dilated'"):
        dilated_attention.explain(
            device="cpu", segment_lengths=[100], dilation_rates=[1], operation="dense"
        )
