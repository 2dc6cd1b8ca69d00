"""Bad input: every mistake raises its own clear error, naming the argument and the bad value.

Each case is a test of its own. Errors must come before any compute, so the last tests watch the
aten ops that run while a bad call is rejected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dilated_attention import (
    BlockSparseAttention,
    BlockSparseMultiheadAttention,
    DilatedAttention,
    LongNetConfig,
    LongNetLM,
    MultiheadDilatedAttention,
    MultiheadDilatedConfig,
    attention,
    backend_reasons,
    block_sparse_attention,
    dilated_attention,
    explain,
    list_backends,
    longnet_schedule,
    patterns,
    register_backend,
    register_kind,
    use_backend,
)
from dilated_attention.backends.math import MathBackend
from dilated_attention.backends.registry import ENV_VAR

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


#: Calls that (batch, num_heads, seq_len, head_dim) tensors fail: 8 query heads over 2 key/value
#: heads (GQA), 64 positions; or cross-attention of 48 queries over 32 keys.
TRANSPOSED_CALLS = {
    "dilated": lambda q, k, v: _dilated(q, k, v),
    "dilated causal": lambda q, k, v: _dilated(q, k, v, is_causal=True),
    "attention causal": lambda q, k, v: attention(q, k, v, is_causal=True),
    "block-sparse causal": lambda q, k, v: block_sparse_attention(
        q, k, v, patterns.LocalWindow(1), block_size=16, is_causal=True
    ),
}


@pytest.mark.parametrize("call", list(TRANSPOSED_CALLS))
def test_tensors_in_the_heads_first_layout_are_told_the_layout(call: str) -> None:
    q, k, v = _qkv((B, 8, 64, 16), (B, 2, 64, 16))
    with pytest.raises(ValueError, match=re.escape(
        "if these are (batch, num_heads, seq_len, head_dim), note that this library takes "
        "(batch, seq_len, num_heads, head_dim): pass query.transpose(1, 2)"
    )):  # fmt: skip
        TRANSPOSED_CALLS[call](q, k, v)
    TRANSPOSED_CALLS[call](*(x.transpose(1, 2) for x in (q, k, v)))  # the fix runs


def test_heads_first_cross_attention_is_told_the_layout() -> None:
    """48 queries over 32 keys, 4 heads, read as 48 query heads over 32 key heads."""
    q, k, v = _qkv((B, 4, 48, D), (B, 4, 32, D))
    with pytest.raises(ValueError, match=r"query heads must be a multiple.*\.transpose\(1, 2\)"):
        attention(q, k, v)
    attention(*(x.transpose(1, 2) for x in (q, k, v)))


@pytest.mark.parametrize(
    ("shapes", "call"),
    [
        (((B, N, 6, D), (B, N, 4, D)), _dense),  # heads that do not divide
        (((B, N, H, D), (B, 12, H, D)), _dilated),  # lengths that differ
        (((B, 10, H, D), (B, 5, H, D)), _dilated),  # swapped, they would fit: key dim 1 > dim 2
        (((B, 8, 64, 16), (B, 2, 64, 16), (B, 2, 32, 16)), _dense),  # key and value differ
    ],
    ids=["heads", "lengths", "long-heads", "key-value"],
)
def test_other_shape_mistakes_get_no_layout_hint(shapes, call) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _qkv(*shapes)
    with pytest.raises(ValueError) as info:
        call(q, k, v)
    assert "transpose" not in str(info.value), str(info.value)


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


# ------------------------------------------------------- invalid values accepted before (issue 21)

_LONGNET = {
    "vocab_size": 16, "embed_dim": 16, "num_heads": 2, "num_layers": 1,
    "segment_lengths": (8,), "dilation_rates": (1,), "ffn_dim": 16,
}  # fmt: skip


@pytest.mark.parametrize("seq_len", [0, -5, 16.5, True, torch.tensor(16)], ids=str)
def test_longnet_schedule_bad_seq_len(seq_len: Any) -> None:
    """``longnet_schedule(0)`` returned ``([0], [1])``; now every non-positive-int is refused."""
    with pytest.raises(ValueError, match="seq_len") as excinfo:
        longnet_schedule(seq_len)
    _assert_mentions(excinfo, re.escape(repr(seq_len)), "positive int")


@pytest.mark.parametrize("field", ["rotary_base", "layer_norm_eps"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=str)
def test_longnet_config_non_finite(field: str, bad: float) -> None:
    """``LongNetConfig(rotary_base=inf)`` / ``layer_norm_eps=inf`` were accepted."""
    with pytest.raises(ValueError, match=field) as excinfo:
        LongNetConfig(**_LONGNET, **{field: bad})
    _assert_mentions(excinfo, re.escape(repr(bad)), "finite")


_MULTIHEAD = {
    "MultiheadDilatedAttention": lambda **kw: MultiheadDilatedAttention(16, 2, [8], [1], **kw),
    "MultiheadDilatedConfig": lambda **kw: MultiheadDilatedConfig(
        embed_dim=16, num_heads=2, segment_lengths=[8], dilation_rates=[1], **kw
    ),
    "BlockSparseMultiheadAttention": lambda **kw: BlockSparseMultiheadAttention(
        16, 2, patterns.LocalWindow(1), **kw
    ),
}
MULTIHEAD = pytest.mark.parametrize("build", list(_MULTIHEAD.values()), ids=list(_MULTIHEAD))


@MULTIHEAD
@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("layer_norm_eps", -1.0),
        ("layer_norm_eps", 0.0),
        ("layer_norm_eps", math.inf),
        ("gamma_init", math.nan),
        ("gamma_init", -1.0),
        ("gamma_init", math.inf),
    ],
    ids=str,
)
def test_multihead_bad_float(build: Callable[..., Any], field: str, bad: float) -> None:
    """``layer_norm_eps=-1`` gave NaN outputs; ``gamma_init=nan`` failed inside ``nn.init``."""
    with pytest.raises(ValueError, match=field) as excinfo:
        build(**{field: bad})
    _assert_mentions(excinfo, re.escape(repr(bad)), "finite number > 0")


@MULTIHEAD
@pytest.mark.parametrize(("field", "bad"), [("bias", "no"), ("layer_norm", 0)], ids=str)
def test_multihead_flags_must_be_bool(build: Callable[..., Any], field: str, bad: Any) -> None:
    """``bias="no"`` built biases and ``layer_norm=0`` dropped the norm, silently."""
    with pytest.raises(TypeError, match=field) as excinfo:
        build(**{field: bad})
    _assert_mentions(excinfo, re.escape(repr(bad)))


@pytest.mark.parametrize("gamma_init", ["1", None], ids=str)
def test_multihead_gamma_init_type(gamma_init: Any) -> None:
    """A non-number gain is a TypeError naming it (it failed inside ``nn.init``)."""
    with pytest.raises(TypeError, match="gamma_init"):
        MultiheadDilatedAttention(16, 2, [8], [1], gamma_init=gamma_init)


@pytest.mark.parametrize(
    "call",
    [
        lambda q, s: dilated_attention(q, q, q, [8], [1], scale=s),
        lambda q, s: attention(q, q, q, scale=s),
        lambda q, s: block_sparse_attention(q, q, q, patterns.LocalWindow(0), scale=s),
        lambda q, s: DilatedAttention([8], [1], scale=s),
        lambda q, s: BlockSparseAttention(patterns.LocalWindow(0), scale=s),
    ],
    ids=["dilated_attention", "attention", "block_sparse_attention", "DilatedAttention",
         "BlockSparseAttention"],
)  # fmt: skip
def test_scale_infinite(call: Callable[..., Any]) -> None:
    """``scale=inf`` gave NaN outputs; it is refused like 0 and NaN."""
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="scale") as excinfo:
        call(q, math.inf)
    _assert_mentions(excinfo, "inf", "finite")


# ------------------------------------------------------------------------------ empty batch, heads


def _grads(*tensors: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(t.grad.shape) for t in tensors]  # type: ignore[union-attr]


_FUNCTIONS = {
    "dilated_attention": lambda q, k, v: dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True),
    "attention": lambda q, k, v: attention(q, k, v),
    "block_sparse_attention": lambda q, k, v: block_sparse_attention(
        q, k, v, patterns.LocalWindow(0), block_size=4
    ),
    "block_sparse_attention_dense": lambda q, k, v: block_sparse_attention(
        q, k, v, patterns.LocalWindow(8), block_size=4
    ),
    "DilatedAttention": lambda q, k, v: DilatedAttention([4, 8], [1, 2])(q, k, v),
    "BlockSparseAttention": lambda q, k, v: BlockSparseAttention(
        patterns.LocalWindow(0), block_size=4
    )(q, k, v),
}


@pytest.mark.parametrize("fn", list(_FUNCTIONS.values()), ids=list(_FUNCTIONS))
@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(0, 4, 2), (2, 0, 0)], ids=["B0", "H0"])
def test_empty_batch_or_heads(
    fn: Callable[..., Any], batch: int, heads: int, kv_heads: int
) -> None:
    """A batch of 0 (or 0 heads) gives empty outputs and empty gradients, as SDPA does (dilated
    attention failed in core/geometry/segment.py; every function failed on 0 heads)."""
    q = torch.randn(batch, 12, heads, 8, requires_grad=True)
    k = torch.randn(batch, 12, kv_heads, 8, requires_grad=True)
    v = torch.randn(batch, 12, kv_heads, 8, requires_grad=True)
    out = fn(q, k, v)
    assert out.shape == q.shape
    out.sum().backward()
    assert _grads(q, k, v) == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


@pytest.mark.parametrize("fn", [dilated_attention, attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_empty_batch_lse(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    """``return_lse=True`` gives a (0, H, N) lse in the documented dtype."""
    q = torch.randn(0, 12, 4, 8, dtype=dtype)
    args = ([4], [1]) if fn is dilated_attention else ()
    out, lse = fn(q, q, q, *args, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (0, 4, 12)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize(
    "build",
    [
        lambda: MultiheadDilatedAttention(32, 4, [4, 8], [1, 2], num_kv_heads=2),
        lambda: BlockSparseMultiheadAttention(32, 4, patterns.LocalWindow(0), block_size=4),
    ],
    ids=["MultiheadDilatedAttention", "BlockSparseMultiheadAttention"],
)
def test_multihead_empty_batch(build: Callable[[], Any]) -> None:
    """A (0, N, E) batch goes through the multihead layers, forward and backward."""
    layer = build()
    x = torch.randn(0, 12, 32, requires_grad=True)
    out, weights = layer(x, is_causal=True)
    assert out.shape == x.shape and weights is None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_longnet_empty_batch() -> None:
    """``LongNetLM`` on a (0, N) token batch gives (0, N, V) logits ("min(): Expected reduction
    dim" before), and trains through it; ``generate`` returns (0, N0 + new)."""
    model = LongNetLM(LongNetConfig(**_LONGNET))
    logits = model(torch.zeros(0, 8, dtype=torch.long))
    assert logits.shape == (0, 8, 16)
    logits.sum().backward()
    assert model.embed.weight.grad is not None
    assert model.generate(torch.zeros(0, 4, dtype=torch.long), 2).shape == (0, 6)


@BOTH
def test_zero_seq_len_is_a_clear_error(fn: Callable[..., Any]) -> None:
    """An empty sequence (unlike an empty batch) is refused, naming seq_len, the shapes and what
    to do instead."""
    q = torch.randn(B, 0, H, D)
    with pytest.raises(ValueError, match="seq_len") as excinfo:
        fn(q, q, q)
    _assert_mentions(excinfo, _shape_patterns(q.shape), "skip the call", "batch of 0")


def test_longnet_zero_seq_len() -> None:
    model = LongNetLM(LongNetConfig(**_LONGNET))
    with pytest.raises(ValueError, match="tokens") as excinfo:
        model(torch.zeros(2, 0, dtype=torch.long))
    _assert_mentions(excinfo, _shape_patterns((2, 0)))


@BOTH
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "word"),
    [((B, N, H, 0), (B, N, H, 0), "head_dim"), ((B, N, H, D), (B, N, 0, D), "head")],
    ids=["head_dim0", "kv_heads0"],
)
def test_zero_head_dim_or_kv_heads(
    fn: Callable[..., Any], q_shape: tuple[int, ...], k_shape: tuple[int, ...], word: str
) -> None:
    """head_dim 0, or 0 kv heads for 4 query heads (ZeroDivisionError before), are refused."""
    q, k, v = _qkv(q_shape, k_shape)
    with pytest.raises(ValueError, match=word) as excinfo:
        fn(q, k, v)
    _assert_mentions(excinfo, _shape_patterns(k_shape))


# -------------------------------------------------------------------------- backend="auto" (issue)


_AUTO_CALLS = {
    "dilated_attention": lambda q, be: dilated_attention(q, q, q, [4, 8], [1, 2], backend=be),
    "attention": lambda q, be: attention(q, q, q, backend=be),
    "block_sparse_attention": lambda q, be: block_sparse_attention(
        q, q, q, patterns.LocalWindow(0), block_size=4, backend=be
    ),
    "DilatedAttention": lambda q, be: DilatedAttention([4, 8], [1, 2], backend=be)(q, q, q),
    "BlockSparseAttention": lambda q, be: BlockSparseAttention(
        patterns.LocalWindow(0), block_size=4, backend=be
    )(q, q, q),
    "MultiheadDilatedAttention": lambda q, be: _seeded(
        lambda: MultiheadDilatedAttention(32, 4, [4, 8], [1, 2], backend=be)
    )(q.flatten(2))[0],
    "BlockSparseMultiheadAttention": lambda q, be: _seeded(
        lambda: BlockSparseMultiheadAttention(32, 4, patterns.LocalWindow(0), backend=be)
    )(q.flatten(2))[0],
}


def _seeded(build: Callable[[], Any]) -> Any:
    torch.manual_seed(1)
    return build()


@pytest.mark.parametrize("call", list(_AUTO_CALLS.values()), ids=list(_AUTO_CALLS))
def test_backend_auto_means_default(call: Callable[..., Any]) -> None:
    """``backend="auto"`` was rejected by these; it now means exactly ``backend=None``."""
    q = torch.randn(1, 12, 4, 8)
    torch.testing.assert_close(call(q, "auto"), call(q, None), rtol=0, atol=0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: DilatedAttention([8], [1], backend="auto"),
        lambda: MultiheadDilatedAttention(16, 2, [8], [1], backend="auto").attention,
        lambda: BlockSparseAttention(patterns.LocalWindow(0), backend="auto"),
    ],
    ids=["DilatedAttention", "MultiheadDilatedAttention", "BlockSparseAttention"],
)
def test_module_backend_auto_is_stored_as_none(build: Callable[[], Any]) -> None:
    """Modules keep ``backend=None`` for "auto", as the factory's modules do."""
    assert build().backend is None


def test_explain_and_use_backend_accept_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """``explain(backend="auto")`` is the automatic choice; ``use_backend("auto")`` is no override;
    an explicit "auto" does not override ``use_backend`` (it is the default)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    auto = explain(device="cpu", backend="auto")
    assert auto.source == "auto" and auto.backend == explain(device="cpu").backend
    with use_backend("auto"):
        assert explain(device="cpu").source == "auto"
    with use_backend("math"):
        assert explain(device="cpu", backend="auto").backend == "math"


@pytest.mark.parametrize(
    "call",
    [
        lambda: dilated_attention(*_qkv(), SEGMENTS, RATES, backend=3),
        lambda: DilatedAttention(SEGMENTS, RATES, backend=3),
        lambda: MultiheadDilatedAttention(32, 4, SEGMENTS, RATES, backend=3),
        lambda: use_backend(3).__enter__(),  # type: ignore[arg-type]
        lambda: explain(device="cpu", backend=3),  # type: ignore[arg-type]
    ],
    ids=[
        "dilated_attention",
        "DilatedAttention",
        "MultiheadDilatedAttention",
        "use_backend",
        "explain",
    ],
)
def test_backend_not_a_string(call: Callable[[], Any]) -> None:
    """A backend that is not a string is a TypeError listing the names (and "auto")."""
    with pytest.raises(TypeError, match="backend") as excinfo:
        call()
    _assert_mentions(excinfo, "'auto'", "math", _number(3))


# ---------------------------------------------------------------- errors from deep inside (issue)


@pytest.mark.parametrize(
    ("which", "bad"),
    [("segment_lengths", torch.tensor(8)), ("segment_lengths", torch.tensor([[8]]))],
    ids=["0-D", "2-D"],
)
def test_schedule_tensor_of_wrong_rank(which: str, bad: torch.Tensor) -> None:
    """``segment_lengths=torch.tensor(8)`` failed with "'int' object is not iterable"."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=which) as excinfo:
        dilated_attention(q, k, v, bad, [1])
    _assert_mentions(excinfo, f"{bad.dim()}-D tensor", re.escape("[8]"))


@WHICH
@pytest.mark.parametrize("bad", [2**63, 2**70], ids=["2**63", "2**70"])
def test_schedule_entry_too_big(which: str, bad: int) -> None:
    """``dilation_rates=[2**70]`` raised OverflowError from the index arithmetic."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape(f"{which}[1]")) as excinfo:
        dilated_attention(q, k, v, **_schedule_with(which, bad))
    _assert_mentions(excinfo, str(bad), re.escape("2**63 - 1"))


@pytest.mark.parametrize(
    ("build", "word"),
    [
        (lambda: patterns.LocalWindow(2**70), "window"),
        (lambda: patterns.GlobalLocal(2**70, 1), "num_global"),
        (lambda: patterns.DilatedBlocks((2**70,)), "rates"),
    ],
    ids=["LocalWindow", "GlobalLocal", "DilatedBlocks"],
)
def test_pattern_int_too_big(build: Callable[[], Any], word: str) -> None:
    """Pattern sizes beyond int64 overflowed when the mask was drawn."""
    with pytest.raises(ValueError, match=word) as excinfo:
        build()
    _assert_mentions(excinfo, str(2**70))


@pytest.mark.parametrize("temperature", [math.nan, math.inf, True], ids=str)
def test_generate_bad_temperature(temperature: Any) -> None:
    """``generate(temperature=nan)`` failed inside ``torch.multinomial``."""
    model = LongNetLM(LongNetConfig(**_LONGNET))
    with pytest.raises(ValueError, match="temperature") as excinfo:
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2, temperature=temperature)
    _assert_mentions(excinfo, re.escape(repr(temperature)))


def test_generate_bad_generator() -> None:
    model = LongNetLM(LongNetConfig(**_LONGNET))
    with pytest.raises(TypeError, match="generator") as excinfo:
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2, generator=3)  # type: ignore[arg-type]
    _assert_mentions(excinfo, "torch.Generator", _number(3))


def test_longnet_config_bad_backend_name() -> None:
    """An unknown backend name fails in the config, not later when the model is built."""
    with pytest.raises(ValueError, match="backend") as excinfo:
        LongNetConfig(**_LONGNET, backend="nope")
    _assert_mentions(excinfo, "nope", "math")


def test_longnet_config_size_too_big() -> None:
    with pytest.raises(ValueError, match="vocab_size") as excinfo:
        LongNetConfig(**{**_LONGNET, "vocab_size": 2**70})
    _assert_mentions(excinfo, str(2**70))


class _NamedAuto(MathBackend):
    name = "auto"


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        (123, TypeError, ["backend", "Backend", _number(123)]),
        (MathBackend, TypeError, ["backend", "instance"]),
        (_NamedAuto(), ValueError, ["name", "'auto'"]),
    ],
    ids=["int", "class", "named_auto"],
)
def test_register_backend_bad(bad: Any, exc: type[Exception], words: list[str]) -> None:
    """``register_backend(123)`` failed with AttributeError; nothing is registered."""
    before = list_backends()
    with pytest.raises(exc, match=words[0]) as excinfo:
        register_backend(bad)
    _assert_mentions(excinfo, *words[1:])
    assert list_backends() == before


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"name": 123}, TypeError, "name"),
        ({"name": "auto"}, ValueError, "name"),
        ({"dilated": 1}, TypeError, "dilated"),
        ({"multihead": "MultiheadDilatedAttention"}, TypeError, "multihead"),
    ],
    ids=["name_int", "name_auto", "dilated", "multihead"],
)
def test_register_kind_bad(kwargs: dict[str, Any], exc: type[Exception], word: str) -> None:
    """``register_kind`` accepted anything and failed when the kind was built."""
    args = {"name": "k", "dilated": DilatedAttention, "multihead": MultiheadDilatedAttention}
    with pytest.raises(exc, match=word):
        register_kind(**{**args, **kwargs})


def test_explain_bad_device() -> None:
    """Verified: ``explain(device="junk")`` names the device and the valid forms."""
    with pytest.raises(ValueError, match="device") as excinfo:
        explain(device="junk")
    _assert_mentions(excinfo, "junk", "cuda:N")


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"head_dim": -1}, ValueError, "head_dim"),
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"num_heads": math.nan}, ValueError, "num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, ValueError, "num_kv_heads"),
        ({"dropout_p": 2.0}, ValueError, "dropout_p"),
        ({"is_causal": "yes"}, TypeError, "is_causal"),
    ],
    ids=["head_dim", "seq_len", "num_heads", "num_kv_heads", "dropout_p", "is_causal"],
)
def test_explain_bad_arguments(kwargs: dict[str, Any], exc: type[Exception], word: str) -> None:
    """``explain`` accepted these and explained a call that cannot exist."""
    with pytest.raises(exc, match=word):
        explain(device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("call", "exc", "word"),
    [
        (lambda q: backend_reasons([1], q, q), TypeError, "query"),
        (lambda q: backend_reasons(q, q, q, dropout_p=math.nan), ValueError, "dropout_p"),
        (lambda q: backend_reasons(q, q, q, is_causal=1), TypeError, "is_causal"),
    ],
    ids=["query", "dropout_p", "is_causal"],
)
def test_backend_reasons_validates(
    call: Callable[..., Any], exc: type[Exception], word: str
) -> None:
    """``backend_reasons`` checked nothing (AttributeError on a list, NaN dropout accepted)."""
    with pytest.raises(exc, match=word):
        call(torch.randn(1, 8, 2, 4))


def _huge_schedule_pair(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal dilated attention with w = r = 2**63 - 1 next to w = r = N (the same geometry: one
    segment, head j reads row j), plus a rate-1 branch."""
    big = 2**63 - 1
    n, heads, dim = (256, 4, 16) if device == "cpu" else (4096, 8, 64)  # GPU: the fused kernels
    q, k, v = (torch.randn(1, n, heads, dim, device=device, dtype=dtype) for _ in range(3))
    huge = dilated_attention(q, k, v, [big, 64], [big, 1], is_causal=True)
    plain = dilated_attention(q, k, v, [n, 64], [n, 1], is_causal=True)
    return huge, plain


def test_largest_schedule_entries_compute_their_geometry() -> None:
    """The largest accepted values give exactly the result of the equivalent small schedule."""
    huge, plain = _huge_schedule_pair("cpu", torch.float32)
    torch.testing.assert_close(huge, plain, rtol=0, atol=0)


@pytest.mark.gpu
def test_largest_schedule_entries_on_gpu() -> None:
    """On an H100 the fused Triton kernels overflowed at w = r = 2**63 - 1 (max error 0.48)."""
    huge, plain = _huge_schedule_pair("cuda", torch.bfloat16)
    torch.testing.assert_close(huge, plain, rtol=0, atol=0)
