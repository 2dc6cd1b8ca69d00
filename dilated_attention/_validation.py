"""Input checks for the public API.

Every check reads metadata only (shapes, dtypes, devices, Python values), so validation costs
nothing and runs before any work. Each failure raises ``ValueError`` (or ``TypeError`` for a wrong
type) naming the argument, the expected form, the actual value and a fix.

Shape legend: B batch, N sequence length, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

_LAYOUT = "(batch, seq_len, num_heads, head_dim)"

#: The largest int a size, length or rate may be: it must fit the int64 index arithmetic of the
#: kernels. (A segment length beyond the sequence means one segment, so none needs more.)
MAX_INT = 2**63 - 1


def values_unreadable() -> bool:
    """Whether tensor values cannot be read on the host now: while ``torch.compile`` traces
    (a graph cannot branch on them) or a CUDA graph captures (a read would synchronize, which
    capture forbids). Checks of values then become device assertions or are left to the
    caller."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_tensor(name: str, x: object) -> torch.Tensor:
    """Return ``x`` if it is a 4-D tensor in the (B, N, H, D) layout, else raise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {_LAYOUT}, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have shape {_LAYOUT}, got {name}.shape={tuple(x.shape)} ({x.dim()}-D); "
            "reshape it to 4-D (e.g. x.view(batch, seq_len, num_heads, head_dim))"
        )
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_qkv(
    query: object, key: object, value: object, *, same_length: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check that query, key and value agree on batch, length, head_dim, dtype and device.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D).
        value: (B, Nk, Hkv, D).
        same_length: require ``Nq == Nk`` (dilated self-attention segments one sequence).
    """
    q = check_tensor("query", query)
    k = check_tensor("key", key)
    v = check_tensor("value", value)
    for name, t in (("key", k), ("value", v)):
        check_like_query(name, t, q)
    problem = _shape_problem(q.shape, k.shape, v.shape, same_length)
    if problem is not None:

        def fits(q_shape: Sequence[int], k_shape: Sequence[int]) -> bool:
            return _shape_problem(q_shape, k_shape, _swap(v.shape), same_length) is None

        raise ValueError(problem + _layout_hint(q.shape, k.shape, fits))
    return q, k, v


def check_query_key(query: object, key: object) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`check_qkv` for a function of the query and key alone (no value): they agree on
    batch, head_dim, dtype and device, the query's heads are a multiple of the key's (GQA), and
    the lengths may differ.

    Args:
        query: (B, Nq, H, D).
        key: (B, Nk, Hkv, D).
    """
    q = check_tensor("query", query)
    k = check_tensor("key", key)
    check_like_query("key", k, q)
    problem = _shape_problem(q.shape, k.shape, None, same_length=False)
    if problem is not None:

        def fits(q_shape: Sequence[int], k_shape: Sequence[int]) -> bool:
            return _shape_problem(q_shape, k_shape, None, same_length=False) is None

        raise ValueError(problem + _layout_hint(q.shape, k.shape, fits))
    return q, k


def check_like_query(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    """``t`` (the argument ``name``) has the query's dtype and device."""
    if t.dtype != q.dtype:
        raise TypeError(
            f"{name} must have the same dtype as query, got {name}.dtype={t.dtype} and "
            f"query.dtype={q.dtype}; cast with .to(query.dtype)"
        )
    if t.device != q.device:
        raise ValueError(
            f"{name} must be on the same device as query, got {name}.device={t.device} and "
            f"query.device={q.device}; move it with .to(query.device)"
        )


# Note [A hint for the (B, H, N, D) layout]
#     Many attention APIs (SDPA, FlashAttention's internals, most model code before the
#     projection's reshape) hold tensors as (batch, num_heads, seq_len, head_dim); passed here by
#     mistake they fail a shape check under another name (heads that do not divide, lengths that
#     differ, a causal query longer than its key). Where the same check passes with dims 1 and 2
#     swapped, and the key's dim 1 is shorter than its dim 2 (heads are few, positions many), the
#     message adds that this library takes (batch, seq_len, num_heads, head_dim) and that
#     ``.transpose(1, 2)`` converts. It is worded as a condition ("if these are ..."), so that it
#     stays true for the rare tensors of the right layout that happen to fit it.

_TRANSPOSED = (
    f"; if these are (batch, num_heads, seq_len, head_dim), note that this library takes "
    f"{_LAYOUT}: pass query.transpose(1, 2), key.transpose(1, 2) and value.transpose(1, 2)"
)


def _swap(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with dims 1 and 2 swapped: (B, H, N, D) read as (B, N, H, D)."""
    return (shape[0], shape[2], shape[1], *shape[3:])


def _layout_hint(
    q_shape: Sequence[int], k_shape: Sequence[int], fits: Callable[..., bool]
) -> str:
    """:data:`_TRANSPOSED` where the shapes look like the (B, H, N, D) layout (Note [A hint
    for the (B, H, N, D) layout]): ``fits(swapped query shape, swapped key shape)`` and the
    key's dim 1 shorter than its dim 2; else ``""``."""
    if len(q_shape) != 4 or len(k_shape) != 4 or k_shape[1] >= k_shape[2]:
        return ""
    return _TRANSPOSED if fits(_swap(q_shape), _swap(k_shape)) else ""


def _shape_problem(
    q: Sequence[int], k: Sequence[int], v: Sequence[int] | None, same_length: bool
) -> str | None:
    """What is wrong with the shapes of query (B, Nq, H, D), key and value (B, Nk, Hkv, D), or
    None (:func:`check_qkv`); ``v`` None for a function without a value
    (:func:`check_query_key`)."""
    # One f-string each: Dynamo traces this on every compiled call and cannot join strings. The
    # shapes are written out only for a message (every call runs this, at least once per
    # request).
    if v is not None and tuple(k) != tuple(v):
        return f"key and value must have the same shape, got {_shapes(q, k, v)}"
    if k[0] != q[0]:
        return f"key must have the same batch size as query (dim 0), got {_shapes(q, k, v)}"
    if k[3] != q[3]:
        return f"key must have the same head_dim as query (dim 3), got {_shapes(q, k, v)}"
    if same_length and k[1] != q[1]:
        return (
            f"key must have the same seq_len as query (dim 1) for dilated attention, got "
            f"{_shapes(q, k, v)}"
        )
    if q[3] == 0:
        return (
            f"head_dim (dim 3) must be at least 1, got {_shapes(q, k, v)}; every head needs at "
            f"least one channel"
        )
    if k[2] == 0 and q[2] != 0:
        return (
            f"key must have at least one head (dim 2) when query has {q[2]}, got "
            f"{_shapes(q, k, v)}; use a kv head count that divides {q[2]}"
        )
    if k[2] != 0 and q[2] % k[2] != 0:
        return (
            f"query heads must be a multiple of key/value heads (GQA), got {q[2]} query "
            f"heads and {k[2]} key heads ({_shapes(q, k, v)}); use a kv head count that "
            f"divides {q[2]}"
        )
    if q[1] == 0 or k[1] == 0:
        return (
            f"seq_len (dim 1) must be at least 1, got {_shapes(q, k, v)}; skip the call for an "
            f"empty sequence (a batch of 0 sequences, or 0 heads, is fine and gives an empty "
            f"result)"
        )
    return None


def _shapes(q: Sequence[int], k: Sequence[int], v: Sequence[int] | None) -> str:
    """The shapes of query, key (and value) as :func:`_shape_problem`'s messages show them."""
    if v is None:
        return f"query.shape={tuple(q)}, key.shape={tuple(k)}"
    return f"query.shape={tuple(q)}, key.shape={tuple(k)}, value.shape={tuple(v)}"


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun`` agreeing in number, for messages: ``counted(1, "layer")`` is
    ``"1 layer"``, ``counted(2, "layer")`` is ``"2 layers"`` (``plural``: the plural where it
    is not ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as an int if it is a positive integer (not a bool) of at most
    :data:`MAX_INT`, else raise ``ValueError``."""
    return _positive_int(name, value)


def _positive_int(name: str, value: object, too_big_fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = "; pass a plain int, e.g. int(x.item())" if isinstance(value, torch.Tensor) else ""
        raise ValueError(
            f"{name} must be a positive int, got {value!r} ({type(value).__name__}){hint}"
        )
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > MAX_INT:
        raise ValueError(
            f"{name} must be a positive int of at most 2**63 - 1 (int64), got {value!r}"
            f"{'; ' + too_big_fix if too_big_fix else ''}"
        )
    return int(value)


_TOO_BIG_FIX = {
    "segment_lengths": "a segment longer than the sequence means one segment: pass seq_len",
    "dilation_rates": "a rate beyond the segment length picks one row per segment: use a "
    "rate no larger than the segment length",
}


#: Fixes for the multihead layers' float arguments (shared by the modules and their configs).
EPS_FIX = "the LayerNorm epsilon is a small positive number such as 1e-5 (the default)"
GAMMA_FIX = (
    "it is the MAGNETO gain on the value and output projections: 1.0 (the default), or "
    "sqrt(log(2 * num_layers)) in a deep stack"
)


def check_causal_lengths(q: torch.Tensor, k: torch.Tensor, is_causal: bool, function: str) -> None:
    """A causal query is the last ``Nq`` of the ``Nk`` key positions (end-aligned), so it may
    be shorter than the key but not longer.

    Args:
        q: (B, Nq, H, D); k: (B, Nk, Hkv, D).
        function: the public function's name, for the message.
    """
    if is_causal and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"{function} with is_causal=True: the query rows are the last Nq of the Nk key "
            f"positions (end-aligned, as for decoding), so the query cannot be longer than the "
            f"key, got query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}; pass keys and "
            f"values for every query position, or is_causal=False"
            + _layout_hint(q.shape, k.shape, _fits_lengths(is_causal, same_length=False))
        )


def _fits_lengths(is_causal: bool, *, same_length: bool) -> Callable[..., bool]:
    """Whether query and key shapes pass :func:`check_qkv` (without ``same_length``: a
    query may be shorter than its key only when causal, and never longer)."""

    def fits(q: Sequence[int], k: Sequence[int]) -> bool:
        if _shape_problem(q, k, k, same_length=same_length) is not None:
            return False
        return q[1] == k[1] or (is_causal and q[1] < k[1])

    return fits


def check_decoding_lengths(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> None:
    """A dilated query shorter than the key is the last positions of a causal call (decoding);
    nothing else. q: (B, Nq, H, D); k: (B, Nk, Hkv, D)."""
    if q.shape[1] == k.shape[1]:
        return
    shapes = f"query.shape={tuple(q.shape)}, key.shape={tuple(k.shape)}"
    hint = _layout_hint(q.shape, k.shape, _fits_lengths(is_causal, same_length=False))
    if q.shape[1] > k.shape[1]:
        raise ValueError(
            f"query may be shorter than key (its rows are then the last key positions, for "
            f"decoding) but not longer, got {shapes}; pass keys and values for every position"
            f"{hint}"
        )
    if not is_causal:
        raise ValueError(
            f"a query shorter than key (decoding: its rows are the last {q.shape[1]} of "
            f"{k.shape[1]} positions) needs is_causal=True, got {shapes} with is_causal=False; "
            f"for non-causal attention pass queries for every position{hint}"
        )


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (not merely truthy), else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {name}={value!r} ({type(value).__name__})"
        )
    return value


def check_positive_float(
    name: str, value: object, *, allow_zero: bool = False, fix: str = ""
) -> float:
    """Return ``value`` as a float if it is a finite real number > 0 (>= 0 with ``allow_zero``).

    Args:
        name: the argument's name, for the message.
        value: the value to check (bools and tensors are refused: pass a Python number).
        allow_zero: accept 0.
        fix: how to correct a bad value, appended to the message.

    Raises:
        TypeError: not a real number.
        ValueError: NaN, infinite, negative (or 0 without ``allow_zero``).
    """
    bound = ">= 0" if allow_zero else "> 0"
    tail = f"; {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a finite number {bound}, got {name}={value!r} "
            f"({type(value).__name__}){tail}"
        )
    x = float(value)
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {bound}, got {name}={value!r}{tail}")
    return x


def check_branches(
    segment_lengths: object, dilation_rates: object
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check the branch schedule and return it as two tuples of positive ints."""
    pairs = []
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Tensor)):
            raise ValueError(
                f"{name} must be a non-empty sequence of positive ints, got {values!r}; "
                "pass e.g. segment_lengths=[2048, 4096], dilation_rates=[1, 2]"
            )
        if isinstance(values, torch.Tensor) and values.dim() != 1:
            raise ValueError(
                f"{name} must be a non-empty sequence of positive ints, got {values!r} (a "
                f"{values.dim()}-D tensor); pass a list or a 1-D tensor, e.g. "
                f"{name}={values.flatten().tolist()}"
            )
        seq = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        if not seq:
            raise ValueError(
                f"{name} must be a non-empty sequence of positive ints, got {values!r}; "
                "pass at least one branch, e.g. segment_lengths=[seq_len], dilation_rates=[1]"
            )
        fix = _TOO_BIG_FIX[name]
        pairs.append(tuple(_positive_int(f"{name}[{i}]", x, fix) for i, x in enumerate(seq)))
    segs, rates = pairs
    if len(segs) != len(rates):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length (one (w, r) per "
            f"branch), "
            f"got segment_lengths={list(segs)} ({len(segs)}) and dilation_rates={list(rates)} "
            f"({len(rates)})"
        )
    return segs, rates


def check_key_padding_mask(mask: object, batch: int, key_len: int, device: torch.device) -> None:
    """Check a ``(B, Nk)`` bool key padding mask (``True`` = ignore that key)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool tensor of shape (batch, seq_len), got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must have dtype torch.bool (True = ignore that key), got "
            f"{mask.dtype}; convert with mask.bool() or build it as (tokens == pad_id)"
        )
    if tuple(mask.shape) != (batch, key_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_len) = {(batch, key_len)}, got "
            f"{tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(
            f"key_padding_mask must be on the same device as query, got {mask.device} and "
            f"{device}; move it with .to(query.device)"
        )


ATTN_MASK_FIX = (
    "only the causal mask is supported (dilated attention has its own sparsity pattern): pass "
    "attn_mask=None with is_causal=True for causal attention, and key_padding_mask (batch, "
    "seq_len) to ignore padded keys"
)


def check_no_key_padding_mask(mask: object) -> None:
    """Block-sparse attention takes no key padding mask: ``None`` or a ``ValueError`` saying how
    to leave padded keys out instead."""
    if mask is not None:
        raise ValueError(
            "key_padding_mask is not supported by block-sparse attention; pass None (leave the "
            "padded key blocks out of the pattern, e.g. pattern & patterns.Custom(mask))"
        )


def check_attn_mask(mask: object, query_len: int, device: torch.device) -> torch.Tensor:
    """Check the metadata of an ``nn.MultiheadAttention``-style ``attn_mask``; return it.

    The only mask a dilated layer can honour is the causal one, so the form checked here is the
    2-D ``(L, L)`` mask of ``nn.Transformer.generate_square_subsequent_mask(L)`` (float, ``-inf``
    above the diagonal) or its bool form (``True`` above the diagonal). Whether the values are
    causal is a data-dependent test left to the caller.

    Args:
        mask: the ``attn_mask`` argument (not None).
        query_len: L, the query sequence length.
        device: the query's device.

    Returns:
        ``mask``, a 2-D bool or floating tensor of shape (L, L) on ``device``.

    Raises:
        TypeError: ``mask`` is not a tensor.
        ValueError: ``mask`` has another dtype, rank, shape or device.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attn_mask must be None or a tensor of shape (seq_len, seq_len), got "
            f"{type(mask).__name__}; {ATTN_MASK_FIX}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"attn_mask must be a bool (True = masked) or float (-inf = masked) causal mask, got "
            f"dtype {mask.dtype}; {ATTN_MASK_FIX}"
        )
    if mask.dim() != 2 or tuple(mask.shape) != (query_len, query_len):
        raise ValueError(
            f"attn_mask must be the causal mask of shape (seq_len, seq_len) = "
            f"{(query_len, query_len)} (per-batch or per-head 3-D masks are not supported), got "
            f"attn_mask.shape={tuple(mask.shape)}; {ATTN_MASK_FIX}"
        )
    if mask.device != device:
        raise ValueError(
            f"attn_mask must be on the same device as query, got {mask.device} and {device}; "
            f"move it with .to(query.device), or pass is_causal=True instead"
        )
    return mask


def check_dropout(name: str, p: object) -> float:
    """Check a dropout probability in ``[0, 1)``."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {p!r} ({type(p).__name__})")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p!r}; use 0.0 to disable dropout")
    return float(p)


def check_scale(scale: object) -> float | None:
    """Check an optional positive softmax scale."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive float or None, got {scale!r}")
    if not 0.0 < float(scale) < math.inf:
        raise ValueError(
            f"scale must be a positive finite float or None (None = head_dim ** -0.5), got "
            f"{scale!r}"
        )
    return float(scale)


def check_heads(embed_dim: object, num_heads: object, num_kv_heads: object | None) -> int:
    """Check multihead sizes and return ``num_kv_heads`` (``num_heads`` when None)."""
    embed_dim = _positive_int("embed_dim", embed_dim)
    num_heads = _positive_int("num_heads", num_heads)
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
            f"num_heads={num_heads}; head_dim = embed_dim // num_heads must be an integer"
        )
    if num_kv_heads is None:
        return num_heads
    kv = _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % kv != 0:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads, got num_heads={num_heads} and "
            f"num_kv_heads={kv}; pick num_kv_heads among the divisors of {num_heads}"
        )
    return kv


def check_window_size(window_size: object) -> tuple[int, int] | None:
    """Check a local window ``(left, right)`` (FlashAttention's convention, ``-1`` = unbounded
    on that side; Note [Local windows, soft-capping and sinks] in ``core/sinks.py``). Returns
    None for no window (None, or ``(-1, -1)``)."""
    if window_size is None:
        return None
    fix = "e.g. window_size=(W - 1, 0) with is_causal=True for a sliding window of W tokens"
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(
            f"window_size must be None or a pair (left, right) of ints, got "
            f"window_size={window_size!r}; {fix}"
        )
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(
                f"window_size must be a pair of ints, got window_size={window_size!r}; {fix}"
            )
        if side < -1:
            raise ValueError(
                f"window_size sides must be >= 0, or -1 for unbounded, got "
                f"window_size={tuple(window_size)!r}; {fix}"
            )
    left, right = (int(side) for side in window_size)
    return None if (left, right) == (-1, -1) else (left, right)


def check_softcap(softcap: object) -> float | None:
    """Check an optional soft-cap ``c`` of the scores (``s -> c * tanh(s / c)``): a positive
    finite float, or None (0 also means none, as in FlashAttention)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(
            f"softcap must be a positive float or None, got softcap={softcap!r} "
            f"({type(softcap).__name__}); e.g. softcap=50.0 as in Gemma 2"
        )
    if float(softcap) == 0.0:
        return None
    if not 0.0 < float(softcap) < math.inf:
        raise ValueError(
            f"softcap must be a positive finite float (or None / 0 for no cap), got "
            f"softcap={softcap!r}; e.g. softcap=50.0 as in Gemma 2"
        )
    return float(softcap)


def check_sinks(sinks: object, query: torch.Tensor) -> torch.Tensor | None:
    """Check optional attention sinks: a floating (H,) tensor, one logit per query head of the
    (B, N, H, D) ``query``, on its device."""
    if sinks is None:
        return None
    heads = query.shape[2]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be a tensor of shape (num_heads={heads},) or None, got "
            f"{type(sinks).__name__}; e.g. sinks=torch.zeros({heads}, requires_grad=True)"
        )
    if sinks.shape != (heads,):
        raise ValueError(
            f"sinks must have shape (num_heads,) = ({heads},), one logit per query head, got "
            f"sinks.shape={tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating tensor, got sinks.dtype={sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(
            f"sinks must be on the query's device {query.device}, got sinks.device="
            f"{sinks.device}; move them with sinks.to(query.device)"
        )
    return sinks
