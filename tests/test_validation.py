"""Bad input: every mistake raises its own clear error, naming the argument and the bad value.

Each case is a test of its own. Errors must come before any compute, so the last tests watch the
aten ops that run while a bad call is rejected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    attention,
    dilated_attention,
    list_backends,
)

B, N, H, D = 2, 16, 4, 8
SEGMENTS = [4, 8]
RATES = [1, 2]


def _qkv(
    q_shape: Sequence[int] = (B, N, H, D),
    k_shape: Sequence[int] | None = None,
    v_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random query, key, value; key and value default to the query's shape."""
    k_shape = q_shape if k_shape is None else k_shape
    v_shape = k_shape if v_shape is None else v_shape
    return (
        torch.randn(*q_shape, dtype=dtype),
        torch.randn(*k_shape, dtype=dtype),
        torch.randn(*v_shape, dtype=dtype),
    )


def _dilated(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``dilated_attention`` with the default test schedule."""
    kwargs.setdefault("segment_lengths", SEGMENTS)
    kwargs.setdefault("dilation_rates", RATES)
    return dilated_attention(q, k, v, **kwargs)


def _dense(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """Plain ``attention``."""
    return attention(q, k, v, **kwargs)


BOTH = pytest.mark.parametrize("fn", [_dilated, _dense], ids=["dilated_attention", "attention"])


def _shape_patterns(shape: Sequence[int]) -> list[str]:
    """Regexes for a shape printed as a tuple, a list or a ``torch.Size``."""
    inner = ", ".join(str(s) for s in shape)
    return [re.escape(f"({inner})"), re.escape(f"[{inner}]")]


def _number(x: float) -> str:
    """Regex for a number standing on its own (so 4 does not match 14 or 0.4)."""
    return rf"(?<![\w.]){re.escape(str(x))}(?![\w]|\.\d)"


def _assert_mentions(
    excinfo: pytest.ExceptionInfo[BaseException], *groups: str | list[str]
) -> None:
    """Each group (a regex, or a list of alternative regexes) must occur in the error message."""
    msg = str(excinfo.value)
    for group in groups:
        alternatives = [group] if isinstance(group, str) else group
        assert any(re.search(p, msg) for p in alternatives), (
            f"message does not mention any of {alternatives!r}: {msg!r}"
        )


# ------------------------------------------------------------------------------------ tensor ranks


@BOTH
def test_query_rank_3(fn: Callable[..., Any]) -> None:
    """A 3-D query (missing head dim) is rejected, and the message shows its shape."""
    q = torch.randn(B, N, H * D)
    _, k, v = _qkv()
    with pytest.raises(ValueError, match="query") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _shape_patterns(q.shape))


@BOTH
def test_key_rank_5(fn: Callable[..., Any]) -> None:
    """A 5-D key is rejected, and the message shows its shape."""
    q, _, v = _qkv()
    k = torch.randn(B, N, H, D, 1)
    with pytest.raises(ValueError, match="key") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _shape_patterns(k.shape))


@BOTH
def test_value_rank_2(fn: Callable[..., Any]) -> None:
    """A 2-D value is rejected."""
    q, k, _ = _qkv()
    v = torch.randn(N, D)
    with pytest.raises(ValueError, match="value") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _shape_patterns(v.shape))


# -------------------------------------------------------------------------------- shape mismatches


@BOTH
def test_batch_mismatch_query_key(fn: Callable[..., Any]) -> None:
    """Query batch 2, key/value batch 5."""
    q, k, v = _qkv((B, N, H, D), (5, N, H, D))
    with pytest.raises(ValueError, match="key") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, [*_shape_patterns(k.shape), _number(5)])


@BOTH
def test_seq_len_mismatch_key_value(fn: Callable[..., Any]) -> None:
    """Key has 16 positions, value 12."""
    q, k, v = _qkv((B, N, H, D), (B, N, H, D), (B, 12, H, D))
    with pytest.raises(ValueError, match="value") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, [*_shape_patterns(v.shape), _number(12)])


def test_seq_len_mismatch_query_key_dilated() -> None:
    """Dilated self-attention needs as many keys as queries: 16 queries, 12 keys is rejected."""
    q, k, v = _qkv((B, N, H, D), (B, 12, H, D))
    with pytest.raises(ValueError, match="key") as excinfo:
        _dilated(q, k, v)
    _assert_mentions(excinfo, [*_shape_patterns(k.shape), _number(12)])


@BOTH
def test_head_dim_mismatch(fn: Callable[..., Any]) -> None:
    """Query head_dim 8, key/value head_dim 6."""
    q, k, v = _qkv((B, N, H, D), (B, N, H, 6))
    with pytest.raises(ValueError, match="key") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, [*_shape_patterns(k.shape), _number(6)])


@BOTH
def test_value_head_dim_mismatch(fn: Callable[..., Any]) -> None:
    """Key head_dim 8, value head_dim 6 (also rejected: one head_dim everywhere)."""
    q, k, v = _qkv((B, N, H, D), (B, N, H, D), (B, N, H, 6))
    with pytest.raises(ValueError, match="value") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, [*_shape_patterns(v.shape), _number(6)])


@BOTH
def test_heads_not_divisible_by_kv_heads(fn: Callable[..., Any]) -> None:
    """6 query heads cannot share 4 kv heads; the message shows both counts."""
    q, k, v = _qkv((B, N, 6, D), (B, N, 4, D))
    with pytest.raises(ValueError, match="key") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _number(6), _number(4))


@BOTH
def test_key_value_head_count_mismatch(fn: Callable[..., Any]) -> None:
    """Key with 3 heads, value with 6 (query 6): key and value must agree."""
    q, k, v = _qkv((B, N, 6, D), (B, N, 3, D), (B, N, 6, D))
    with pytest.raises(ValueError, match="value") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _number(3), _number(6))


# ----------------------------------------------------------------------------------- dtypes, types


@BOTH
def test_dtype_mismatch(fn: Callable[..., Any]) -> None:
    """float32 query with float64 key/value."""
    q = torch.randn(B, N, H, D, dtype=torch.float32)
    k = torch.randn(B, N, H, D, dtype=torch.float64)
    v = torch.randn(B, N, H, D, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError), match="key") as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, "float64")


@BOTH
def test_query_not_a_tensor(fn: Callable[..., Any]) -> None:
    """A nested list as query is a TypeError naming ``query``."""
    _, k, v = _qkv()
    with pytest.raises(TypeError, match="query") as excinfo:
        fn(torch.randn(B, N, H, D).tolist(), k, v)
    _assert_mentions(excinfo, "list")


# --------------------------------------------------------------------------------- schedule checks


def test_empty_segment_lengths() -> None:
    """No branch at all."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="segment_lengths") as excinfo:
        dilated_attention(q, k, v, [], [])
    _assert_mentions(excinfo, [r"\[\]", r"\(\)", "empty"])


@pytest.mark.parametrize(
    ("segment_lengths", "dilation_rates"),
    [([8, 16], [1]), ([8], [1, 2])],
    ids=["more_segments", "more_rates"],
)
def test_schedule_length_mismatch(segment_lengths: list[int], dilation_rates: list[int]) -> None:
    """segment_lengths and dilation_rates must have one entry per branch."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dilation_rates") as excinfo:
        dilated_attention(q, k, v, segment_lengths, dilation_rates)
    _assert_mentions(
        excinfo,
        "segment_lengths",
        [_number(len(segment_lengths)), re.escape(str(segment_lengths))],
        [_number(len(dilation_rates)), re.escape(str(dilation_rates))],
    )


BAD_ENTRIES = pytest.mark.parametrize(
    "bad", [0, -4, 2.5, True], ids=["zero", "neg", "float", "bool"]
)
WHICH = pytest.mark.parametrize("which", ["segment_lengths", "dilation_rates"])


def _schedule_with(which: str, bad: Any) -> dict[str, list[Any]]:
    """The default schedule with its second entry of ``which`` replaced by ``bad``."""
    sched: dict[str, list[Any]] = {"segment_lengths": list(SEGMENTS), "dilation_rates": list(RATES)}
    sched[which][1] = bad
    return sched


def _bad_pattern(bad: Any) -> str:
    """Regex for the bad entry as printed."""
    return re.escape(repr(bad)) if isinstance(bad, bool) else _number(bad)


@WHICH
@BAD_ENTRIES
def test_bad_schedule_entry_functional(which: str, bad: Any) -> None:
    """Zero, negative, non-integer and bool entries are rejected by ``dilated_attention``."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=which) as excinfo:
        dilated_attention(q, k, v, **_schedule_with(which, bad))
    _assert_mentions(excinfo, _bad_pattern(bad))


@WHICH
@BAD_ENTRIES
def test_bad_schedule_entry_module_constructor(which: str, bad: Any) -> None:
    """``DilatedAttention`` validates its schedule when it is built, not at the first forward."""
    with pytest.raises(ValueError, match=which) as excinfo:
        DilatedAttention(**_schedule_with(which, bad))
    _assert_mentions(excinfo, _bad_pattern(bad))


@WHICH
@BAD_ENTRIES
def test_bad_schedule_entry_multihead_constructor(which: str, bad: Any) -> None:
    """``MultiheadDilatedAttention`` validates its schedule when it is built."""
    with pytest.raises(ValueError, match=which) as excinfo:
        MultiheadDilatedAttention(32, 4, **_schedule_with(which, bad))
    _assert_mentions(excinfo, _bad_pattern(bad))


def test_module_constructor_length_mismatch() -> None:
    """``DilatedAttention([8, 16], [1])`` fails at construction."""
    with pytest.raises(ValueError, match="dilation_rates"):
        DilatedAttention([8, 16], [1])


def test_module_constructor_empty_schedule() -> None:
    """``DilatedAttention([], [])`` fails at construction."""
    with pytest.raises(ValueError, match="segment_lengths"):
        DilatedAttention([], [])


# -------------------------------------------------------------------------------- key_padding_mask


@BOTH
@pytest.mark.parametrize("mask_shape", [(B, N - 1), (B + 1, N), (B, N, 1)], ids=str)
def test_key_padding_mask_wrong_shape(fn: Callable[..., Any], mask_shape: tuple[int, ...]) -> None:
    """The mask must be (batch, seq_len) of the keys."""
    q, k, v = _qkv()
    mask = torch.zeros(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_padding_mask") as excinfo:
        fn(q, k, v, key_padding_mask=mask)
    _assert_mentions(excinfo, _shape_patterns(mask_shape))


@BOTH
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_key_padding_mask_wrong_dtype(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    """Only a bool mask is accepted (a float mask is ambiguous: additive or boolean?)."""
    q, k, v = _qkv()
    mask = torch.zeros(B, N, dtype=dtype)
    with pytest.raises(ValueError, match="key_padding_mask") as excinfo:
        fn(q, k, v, key_padding_mask=mask)
    _assert_mentions(excinfo, re.escape(str(dtype).removeprefix("torch.")))


# ----------------------------------------------------------------------------------------- scalars


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5])
def test_dropout_p_out_of_range(dropout_p: float) -> None:
    """``dropout_p`` must lie in [0, 1)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_p") as excinfo:
        _dilated(q, k, v, dropout_p=dropout_p)
    _assert_mentions(excinfo, _number(dropout_p))


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
@pytest.mark.parametrize(
    "build",
    [
        lambda p: DilatedAttention(SEGMENTS, RATES, dropout=p),
        lambda p: MultiheadDilatedAttention(32, 4, SEGMENTS, RATES, dropout=p),
    ],
    ids=["DilatedAttention", "MultiheadDilatedAttention"],
)
def test_module_dropout_out_of_range(build: Callable[[float], Any], dropout: float) -> None:
    """Modules check ``dropout`` at construction."""
    with pytest.raises(ValueError, match="dropout") as excinfo:
        build(dropout)
    _assert_mentions(excinfo, _number(dropout))


@BOTH
@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_scale_not_positive(fn: Callable[..., Any], scale: float) -> None:
    """``scale`` must be positive."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale") as excinfo:
        fn(q, k, v, scale=scale)
    _assert_mentions(excinfo, [_number(scale), _number(int(scale))])


# ---------------------------------------------------------------------------------------- backends


@BOTH
def test_unknown_backend(fn: Callable[..., Any]) -> None:
    """An unknown backend name is a ValueError that lists the valid names."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend") as excinfo:
        fn(q, k, v, backend="nope")
    _assert_mentions(excinfo, "nope", "math")


def test_list_backends_has_math() -> None:
    """The ``math`` backend always exists (the error above points users at it)."""
    assert "math" in list(list_backends())


@pytest.mark.parametrize(
    "build",
    [
        lambda: DilatedAttention(SEGMENTS, RATES, backend="nope"),
        lambda: MultiheadDilatedAttention(32, 4, SEGMENTS, RATES, backend="nope"),
    ],
    ids=["DilatedAttention", "MultiheadDilatedAttention"],
)
def test_module_unknown_backend(build: Callable[[], Any]) -> None:
    """Modules reject an unknown backend name at construction."""
    with pytest.raises(ValueError, match="backend") as excinfo:
        build()
    _assert_mentions(excinfo, "nope", "math")


# -------------------------------------------------------------------------------- multihead module


def test_embed_dim_not_divisible_by_num_heads() -> None:
    """embed_dim 10 cannot be split over 3 heads."""
    with pytest.raises(ValueError, match="embed_dim") as excinfo:
        MultiheadDilatedAttention(10, 3, SEGMENTS, RATES)
    _assert_mentions(excinfo, "num_heads", _number(10), _number(3))


def test_num_heads_not_divisible_by_num_kv_heads() -> None:
    """4 query heads cannot share 3 kv heads."""
    with pytest.raises(ValueError, match="num_kv_heads") as excinfo:
        MultiheadDilatedAttention(32, 4, SEGMENTS, RATES, num_kv_heads=3)
    _assert_mentions(excinfo, _number(4), _number(3))


@pytest.mark.parametrize("num_heads", [0, -2])
def test_num_heads_not_positive(num_heads: int) -> None:
    """num_heads must be a positive integer."""
    with pytest.raises(ValueError, match="num_heads") as excinfo:
        MultiheadDilatedAttention(32, num_heads, SEGMENTS, RATES)
    _assert_mentions(excinfo, _number(num_heads))


def test_multihead_wrong_embed_dim_input() -> None:
    """An input whose last dim is not embed_dim is rejected, naming the bad size."""
    mha = MultiheadDilatedAttention(32, 4, SEGMENTS, RATES)
    x = torch.randn(B, N, 30)
    with pytest.raises(ValueError, match=r"query|embed_dim") as excinfo:
        mha(x)
    _assert_mentions(excinfo, [*_shape_patterns(x.shape), _number(30)])


def test_multihead_bad_key_padding_mask() -> None:
    """The module checks key_padding_mask too."""
    mha = MultiheadDilatedAttention(32, 4, SEGMENTS, RATES)
    x = torch.randn(B, N, 32)
    mask = torch.zeros(B, N + 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_padding_mask") as excinfo:
        mha(x, key_padding_mask=mask)
    _assert_mentions(excinfo, _shape_patterns(mask.shape))


def test_multihead_key_length_mismatch() -> None:
    """Dilated self-attention inside the module needs as many keys as queries."""
    mha = MultiheadDilatedAttention(32, 4, SEGMENTS, RATES)
    x, y = torch.randn(B, N, 32), torch.randn(B, 12, 32)
    with pytest.raises(ValueError, match="key") as excinfo:
        mha(x, y, y)
    _assert_mentions(excinfo, [*_shape_patterns(y.shape), _number(12)])


def test_multihead_need_weights_rejected() -> None:
    """Attention weights are never materialised, so need_weights=True is refused, not ignored."""
    mha = MultiheadDilatedAttention(32, 4, SEGMENTS, RATES)
    with pytest.raises(ValueError, match="need_weights"):
        mha(torch.randn(B, N, 32), need_weights=True)


# ----------------------------------------------------------------------------------------- devices


@pytest.mark.gpu
@BOTH
def test_device_mismatch(fn: Callable[..., Any]) -> None:
    """Query on CUDA with key/value on CPU is rejected before any kernel runs."""
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=r"key|device") as excinfo:
        fn(q.cuda(), k, v)
    _assert_mentions(excinfo, "cuda", "cpu")


# -------------------------------------------------------------------------------- no compute first

_COMPUTE_OPS = {
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "matmul",
    "einsum",
    "_softmax",
    "softmax",
    "_log_softmax",
    "exp",
    "logsumexp",
    "linear",
}


class _OpRecorder(TorchDispatchMode):
    """Records the name of every aten op that runs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def compute_ops(self) -> list[str]:
        """The recorded ops that do attention arithmetic."""
        return [op for op in self.ops if op in _COMPUTE_OPS or op.startswith("_scaled_dot_product")]


def test_recorder_sees_compute() -> None:
    """Control for the tests below: a valid call does show up as compute ops."""
    q, k, v = _qkv()
    with _OpRecorder() as rec:
        _dilated(q, k, v)
    assert rec.compute_ops(), rec.ops


@pytest.mark.parametrize(
    "bad_kwargs",
    [
        {"key_padding_mask": torch.zeros(B, N - 1, dtype=torch.bool)},
        {"dropout_p": 1.5},
        {"scale": -1.0},
        {"dilation_rates": [1, 0]},
        {"backend": "nope"},
    ],
    ids=["mask", "dropout_p", "scale", "rates", "backend"],
)
def test_no_compute_before_validation(bad_kwargs: dict[str, Any]) -> None:
    """A bad argument is rejected before any attention arithmetic, and no graph is built."""
    q, k, v = _qkv()
    q.requires_grad_(True)
    with _OpRecorder() as rec, pytest.raises(ValueError):
        _dilated(q, k, v, **bad_kwargs)
    assert rec.compute_ops() == [], rec.ops
    assert q.grad is None


@pytest.mark.parametrize(
    ("kv_len", "mask_len", "match"),
    [(N, N - 1, "key_padding_mask"), (12, None, "key")],
    ids=["mask", "key_len"],
)
def test_multihead_no_projection_before_validation(
    kv_len: int, mask_len: int | None, match: str
) -> None:
    """The module rejects a bad mask or key length before it projects anything."""
    mha = MultiheadDilatedAttention(32, 4, SEGMENTS, RATES)
    x = torch.randn(B, N, 32, requires_grad=True)
    y = torch.randn(B, kv_len, 32)
    mask = None if mask_len is None else torch.zeros(B, mask_len, dtype=torch.bool)
    with _OpRecorder() as rec, pytest.raises(ValueError, match=match):
        mha(x, y, y, key_padding_mask=mask)
    assert rec.compute_ops() == [], rec.ops
    assert x.grad is None
    assert all(p.grad is None for p in mha.parameters())
