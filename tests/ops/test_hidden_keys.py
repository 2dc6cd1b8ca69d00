"""A NaN or inf that a row cannot see leaves that row exact (Note [Hidden keys cannot poison rows]).

Keys hidden by ``key_padding_mask``, by causality, by a dilated branch (another segment, another
offset) or by a block-sparse pattern must not change any output or gradient. Every output and
dq, dk, dv is compared with the float64 oracle (``tests/support/oracle.py``, which forms its
products only on the pairs that see each other; ``tests/core/test_oracle_self.py`` checks that)
on the same poisoned inputs: the same non-finite entries (NaN where it has NaN, inf of the same
sign where it has inf) and the finite ones within the float32 tolerances. Before the fix a NaN
value at position ``t`` of a causal call turned the rows before ``t`` of its call NaN, and a NaN
key or value hidden by the padding mask every row of its call.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from support.backend_params import CPU_BACKENDS, backend_id
from support.distributed_utils import run_world
from support.oracle import dilated_multiplicity, masked_attention
from support.tolerances import TOLERANCES
from torch import Tensor

from dilated_attention import (
    DilatedKVCache,
    attention,
    block_sparse_attention,
    dilated_attention,
    ring_attention,
    ring_dilated_attention,
    shard_sequence,
)
from dilated_attention.patterns import DilatedBlocks, LocalWindow

B, N, H, D = 2, 40, 4, 8
SEGS, RATES = (8, 16, 32), (1, 2, 4)
PATTERN, BLOCK = LocalWindow(1) | DilatedBlocks(2), 4
#: The poisoned position: the middle of a w = 8 segment, an even offset of the r = 2 and r = 4
#: branches (rows of odd offsets never see it), in a block the pattern hides from some blocks.
T = 21
NAN, INF = math.nan, math.inf


def _mask() -> Tensor:
    """(B, N) bool: batch 1 hides T and a few keys around it, batch 0 a random few."""
    mask = torch.rand(B, N, generator=torch.Generator().manual_seed(7)) < 0.2
    mask[1] = False
    mask[1, [T, T + 3, 5]] = True
    return mask


def _block_multiplicity(causal: bool) -> Tensor:
    blocks = -(-N // BLOCK)
    tokens = PATTERN.block_mask(blocks, blocks).repeat_interleave(BLOCK, 0)
    M = tokens.repeat_interleave(BLOCK, 1)[:N, :N].to(torch.int64)
    return torch.tril(M) if causal else M


Run = Callable[[Tensor, Tensor, Tensor, str | None], Tensor]


def _dense(causal: bool, masked: bool) -> Run:
    def run(q: Tensor, k: Tensor, v: Tensor, backend: str | None) -> Tensor:
        mask = _mask() if masked else None
        return attention(q, k, v, is_causal=causal, key_padding_mask=mask, backend=backend)

    return run


def _dilated(causal: bool, masked: bool) -> Run:
    def run(q: Tensor, k: Tensor, v: Tensor, backend: str | None) -> Tensor:
        mask = _mask() if masked else None
        return dilated_attention(
            q, k, v, SEGS, RATES, is_causal=causal, key_padding_mask=mask, backend=backend
        )

    return run


def _sparse(causal: bool) -> Run:
    def run(q: Tensor, k: Tensor, v: Tensor, backend: str | None) -> Tensor:
        return block_sparse_attention(
            q, k, v, PATTERN, block_size=BLOCK, is_causal=causal, backend=backend
        )

    return run


def _cases() -> dict[str, tuple[Run, Tensor, bool]]:
    """name -> (run, multiplicity (H, N, N), whether it passes ``_mask()``)."""
    dense = torch.ones(H, N, N, dtype=torch.int64)
    cases: dict[str, tuple[Run, Tensor, bool]] = {
        "dilated": (_dilated(False, False), dilated_multiplicity(N, H, SEGS, RATES), False),
    }
    for causal, masked in ((True, False), (False, True), (True, True)):
        name = "-".join(["causal"] * causal + ["padded"] * masked)
        cases[f"dense-{name}"] = (_dense(causal, masked), dense.tril() if causal else dense, masked)
        M = dilated_multiplicity(N, H, SEGS, RATES, is_causal=causal)
        cases[f"dilated-{name}"] = (_dilated(causal, masked), M, masked)
    cases["block_sparse"] = (_sparse(False), _block_multiplicity(False), False)
    cases["block_sparse-causal"] = (_sparse(True), _block_multiplicity(True), False)
    return cases


CASES = _cases()
#: (tensor, position, head, value): a key or value element at T (hidden from some rows by
#: every case), the query row T (its keys' gradients must stay exact where it cannot see
#: them), an inf value, and a NaN key or value at a position every case shows some rows.
POISONS = [
    pytest.param("v", T, 1, NAN, id="v-nan"),
    pytest.param("k", T, 1, NAN, id="k-nan"),
    pytest.param("v", T, 0, INF, id="v-inf"),
    pytest.param("q", T, 2, NAN, id="q-nan"),
    pytest.param("v", 9, 1, NAN, id="v-visible-nan"),
]


def _inputs(kv_heads: int, where: str, pos: int, head: int, value: float) -> list[Tensor]:
    """float32 q, k, v, dout with ``value`` in batch 1 at ``pos``: element 0 of ``head`` of k or
    v, or the whole query row of ``head``."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, N, H, D, generator=gen)
    k = torch.randn(B, N, kv_heads, D, generator=gen)
    v = torch.randn(B, N, kv_heads, D, generator=gen)
    dout = torch.randn(B, N, H, D, generator=gen)
    if where == "q":
        q[1, pos, head] = value
    else:
        {"k": k, "v": v}[where][1, pos, head % kv_heads, 0] = value
    return [q, k, v, dout]


def _grads(fn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor,
           dout: Tensor) -> list[Tensor]:  # fmt: skip
    """``[out, dq, dk, dv]`` of ``fn`` on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def _oracle(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, M: Tensor,
            mask: Tensor | None) -> list[Tensor]:  # fmt: skip
    def fn(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return masked_attention(a, b, c, M, key_padding_mask=mask)[0]

    return _grads(fn, q.double(), k.double(), v.double(), dout.double())


def _check(got: list[Tensor], want: list[Tensor], what: str) -> None:
    """Same non-finite entries as the oracle, finite ones within float32's tolerances."""
    tol = TOLERANCES[torch.float32]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        atol, rtol = (tol.atol, tol.rtol) if name == "out" else (tol.grad_atol, tol.grad_rtol)
        bad, want_bad = ~torch.isfinite(g), ~torch.isfinite(w)
        assert torch.equal(bad, want_bad), (
            f"{what}: {name} non-finite at {bad.nonzero()[:8].tolist()} ({int(bad.sum())}), the "
            f"oracle at {want_bad.nonzero()[:8].tolist()} ({int(want_bad.sum())})"
        )
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")  # fmt: skip


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("where", "pos", "head", "value"), POISONS)
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_hidden_poison_changes_nothing(
    backend: str | None, case: str, where: str, pos: int, head: int, value: float, kv_heads: int
) -> None:
    """Outputs and dq, dk, dv equal the oracle's, NaN and inf entries included, on every CPU
    backend: rows that cannot see the poisoned element stay finite and exact."""
    run, M, masked = CASES[case]
    q, k, v, dout = _inputs(kv_heads, where, pos, head, value)
    got = _grads(lambda a, b, c: run(a, b, c, backend), q, k, v, dout)
    want = _oracle(q, k, v, dout, M, _mask() if masked else None)
    _check(got, want, f"{case}, {where}[1, {pos}, head {head}] = {value}")


def _decode(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cached: bool,
            backend: str | None) -> Tensor:  # fmt: skip
    """(B, N, H, D): every position decoded as a one-row causal query, against its keys or
    through a DilatedKVCache."""
    cache = DilatedKVCache(SEGS, RATES) if cached else None
    rows = []
    with torch.no_grad():
        for p in range(N):
            keys = slice(p, p + 1) if cached else slice(0, p + 1)
            rows.append(dilated_attention(
                q[:, p : p + 1], k[:, keys], v[:, keys], SEGS, RATES, is_causal=True,
                key_padding_mask=mask[:, keys], cache=cache, backend=backend,
            ))  # fmt: skip
    return torch.cat(rows, dim=1)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=backend_id)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("cached", [False, True], ids=["short-query", "cache"])
def test_decoding_with_hidden_poison(backend: str | None, where: str, cached: bool) -> None:
    """Decoding token by token with a padding mask: a NaN key or value at T changes no token
    when masked, and with T unmasked exactly the tokens whose branches show it."""
    q, k, v, _ = _inputs(H, where, T, 1, NAN)
    M = dilated_multiplicity(N, H, SEGS, RATES, is_causal=True)
    shown = _mask()
    shown[1, T] = False
    for mask in (_mask(), shown):
        got = _decode(q, k, v, mask, cached, backend)
        want = masked_attention(q.double(), k.double(), v.double(), M, key_padding_mask=mask)[0]
        bad, want_bad = ~torch.isfinite(got), ~torch.isfinite(want)
        assert torch.equal(bad, want_bad), (
            f"non-finite at {bad.nonzero()[:8].tolist()} ({int(bad.sum())}), the oracle at "
            f"{want_bad.nonzero()[:8].tolist()} ({int(want_bad.sum())})"
        )
        tol = TOLERANCES[torch.float32]
        torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol, equal_nan=True)
    # T shown: some later tokens of its head see it, others are hidden from it by the branches.
    assert bool(want_bad.any()) and not bool(want_bad[1, T:, 1].all())


def _ring_worker(rank: int, world_size: int) -> None:
    """Ring attention and ring dilated attention, causal with a padding mask, a NaN value and a
    NaN key at T: outputs and gradients of this rank's shard equal the oracle's."""
    for where in ("v", "k"):
        q, k, v, dout = _inputs(2, where, T, 1, NAN)
        mask = _mask()
        for name, M in (
            ("ring", torch.tril(torch.ones(H, N, N, dtype=torch.int64))),
            ("ring_dilated", dilated_multiplicity(N, H, SEGS, RATES, is_causal=True)),
        ):
            for masked in (False, True):
                hide = mask if masked else None
                shard_mask = None if hide is None else shard_sequence(hide, seq_dim=1)

                def fn(a: Tensor, b: Tensor, c: Tensor, hide: Tensor | None = shard_mask,
                       name: str = name) -> Tensor:  # fmt: skip
                    if name == "ring":
                        return ring_attention(a, b, c, is_causal=True, key_padding_mask=hide)
                    return ring_dilated_attention(
                        a, b, c, SEGS, RATES, is_causal=True, key_padding_mask=hide
                    )

                local = [shard_sequence(x, seq_dim=1) for x in (q, k, v, dout)]
                got = _grads(fn, *local)
                want = [shard_sequence(x, seq_dim=1) for x in _oracle(q, k, v, dout, M, hide)]
                # dk and dv: this rank's shard of the whole sequence's key gradients.
                _check(got, want, f"rank {rank}: {name}, masked={masked}, {where} NaN")


@pytest.mark.distributed
def test_ring_hidden_poison_changes_nothing(tmp_path: object) -> None:
    """Two gloo ranks: the ring paths get the same exact treatment (one spawn for all cases)."""
    run_world(_ring_worker, 2, tmp_path)
