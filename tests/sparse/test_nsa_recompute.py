"""``nsa_attention(recompute=True)``: the branches run again in the backward a group of heads
at a time (Note [Branches recomputed by heads] in ``sparse/recompute.py``). Against the float64
re-implementation (outputs and the gradients of q, k, v and the gates) with groups of whole
key/value heads and of parts of one, both combinations, causal and not, GQA, odd lengths, an
end-aligned query; what autograd keeps; the groups' sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.sparse_oracle import nsa_reference
from test_moba_nsa import NSA_CASES, _assert_same_with_gradients, _gates, _leaves, _nsa_kwargs
from torch import Tensor

import dilated_attention.sparse.recompute as recompute_module
from dilated_attention.sparse import nsa_attention
from dilated_attention.sparse.recompute import head_groups

#: CHUNK_SHARE values: groups of one query head (parts of a key/value head's group where it
#: has more), and of all heads at once.
SHARES = {"one-head-groups": 10**6, "one-group": 1}


@pytest.mark.parametrize("share", SHARES.values(), ids=SHARES.keys())
@pytest.mark.parametrize("combine", ["gates", "lse"])
@pytest.mark.parametrize("case", NSA_CASES.values(), ids=NSA_CASES.keys())
def test_recomputed_nsa_matches_the_reference(
    case: dict[str, Any], combine: str, share: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recompute_module, "CHUNK_FLOOR_BYTES", 0)
    monkeypatch.setattr(recompute_module, "CHUNK_SHARE", share)
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"], seed=11)
    gates = _gates(q) if combine == "gates" else None
    kw = _nsa_kwargs(case)
    out = nsa_attention(q, k, v, gates, combine=combine, recompute=True, **kw)
    ref = nsa_reference(q, k, v, gates, **kw)
    _assert_same_with_gradients(out, ref, [q, k, v] + ([gates] if gates is not None else []))


def test_a_key_value_head_split_across_groups_sums_its_gradients_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight query heads on two key/value heads, groups of three heads rounded down to two (a
    divisor of the four heads per key/value head): each key/value head's gradient is the sum
    over two groups (the second added into the first in bf16, one rounding more), about as
    close to the float64 reference as the unrecomputed gradient; only the key asks for a
    gradient."""
    q, k, v = _leaves(1, 40, 8, 2, seed=12)
    q_head = q[:, :, :1].nbytes
    monkeypatch.setattr(recompute_module, "CHUNK_SHARE", 10**6)
    monkeypatch.setattr(recompute_module, "CHUNK_FLOOR_BYTES", 3 * q_head)
    assert head_groups(8, 2, q_head) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    kw = _nsa_kwargs(NSA_CASES["causal-gqa-odd"])
    q16, k16, v16, g16 = (x.detach().bfloat16() for x in (q, k, v, _gates(q)))
    dout = torch.randn(q16.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    k_ref = k16.double().requires_grad_()
    ref = nsa_reference(q16.double(), k_ref, v16.double(), g16.double(), **kw)
    (exact,) = torch.autograd.grad(ref, k_ref, dout.double())
    errors = []
    for recompute in (True, False):
        k_leaf = k16.clone().requires_grad_()
        out = nsa_attention(q16, k_leaf, v16, g16, recompute=recompute, **kw)
        (got,) = torch.autograd.grad(out, k_leaf, dout)
        errors.append((got.double() - exact).abs().max().item())
    scale = exact.abs().max().item()
    assert errors[0] <= max(1.5 * errors[1], 2**-8 * scale), (errors, scale)


def test_groups_of_several_key_value_heads_match_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight query heads on four key/value heads in two groups of two key/value heads each."""
    monkeypatch.setattr(recompute_module, "CHUNK_FLOOR_BYTES", 0)
    monkeypatch.setattr(recompute_module, "CHUNK_SHARE", 2)
    q, k, v = _leaves(1, 37, 8, 4, seed=15)
    assert head_groups(8, 4, q[:, :, :1].nbytes) == [(0, 4), (4, 8)]
    gates = _gates(q)
    kw = _nsa_kwargs(NSA_CASES["causal-gqa-odd"])
    out = nsa_attention(q, k, v, gates, recompute=True, **kw)
    _assert_same_with_gradients(out, nsa_reference(q, k, v, gates, **kw), [q, k, v, gates])


def test_no_heads_give_empty_gradients() -> None:
    q, k, v = (x[:, :, :0].detach().requires_grad_() for x in _leaves(1, 16, 2, 1))
    gates = _gates(q)
    out = nsa_attention(q, k, v, gates, recompute=True, **_nsa_kwargs(NSA_CASES["not-causal"]))
    grads = torch.autograd.grad(out.sum(), [q, k, v, gates], allow_unused=True)
    assert all(g is not None and g.numel() == 0 for g in grads)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "share", "floor_heads", "want"),
    [
        (16, 4, 16, 0, [(h, h + 1) for h in range(16)]),  # one head each
        (16, 4, 2, 0, [(0, 8), (8, 16)]),  # whole key/value heads
        (16, 4, 16, 6, [(0, 4), (4, 8), (8, 12), (12, 16)]),  # the floor, whole kv heads
        (12, 2, 4, 0, [(0, 3), (3, 6), (6, 9), (9, 12)]),  # a divisor of six
        (6, 6, 4, 0, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]),  # no GQA: 1 (6 // 4)
        (4, 1, 1, 0, [(0, 4)]),  # all at once
        (0, 0, 16, 0, []),  # no heads
    ],
)
def test_head_groups_split_key_value_heads_evenly(
    heads: int, kv_heads: int, share: int, floor_heads: int, want: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Each query head once, in order; a group is whole key/value heads' query heads or a
    divisor of one's; a share of the heads unless the floor's bytes are more."""
    monkeypatch.setattr(recompute_module, "CHUNK_SHARE", share)
    monkeypatch.setattr(recompute_module, "CHUNK_FLOOR_BYTES", floor_heads * 100)
    assert head_groups(heads, kv_heads, 100) == want


def test_recompute_keeps_only_the_inputs_and_output() -> None:
    """What autograd keeps for the backward: q, k, v, the gates and the output, nothing else;
    without ``recompute`` the selected and window branches' outputs beside q (the compressed
    branch's parts are its calls' own, smaller), more than twice those bytes in all."""
    case = NSA_CASES["causal-gqa-odd"]
    q, k, v = _leaves(2, case["nq"], case["heads"], case["kv"], nk=case["nk"], seed=13)
    gates = _gates(q)
    for recompute in (True, False):
        # a first call outside the hooks: the library's one-time checks save their own tensors
        nsa_attention(q, k, v, gates, recompute=recompute, **_nsa_kwargs(case)).sum().backward()
        kept: dict[int, int] = {}

        def pack(x: Tensor, kept: dict[int, int] = kept) -> Tensor:
            kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = nsa_attention(q, k, v, gates, recompute=recompute, **_nsa_kwargs(case))
        given = {x.untyped_storage().data_ptr(): x.nbytes for x in (q, k, v, gates, out)}
        if recompute:
            assert kept == given, kept
        else:
            assert sorted(kept.values()).count(q.nbytes) == 3, kept  # q, o_slc, o_win
            assert sum(kept.values()) > 2 * sum(given.values()), kept


def test_without_gradients_recompute_changes_nothing() -> None:
    case = NSA_CASES["end-aligned"]
    q, k, v = (x.detach() for x in _leaves(1, case["nq"], case["heads"], case["kv"],
                                           nk=case["nk"], seed=14))  # fmt: skip
    gates = _gates(q).detach()
    kw = _nsa_kwargs(case)
    assert torch.equal(nsa_attention(q, k, v, gates, recompute=True, **kw),
                       nsa_attention(q, k, v, gates, **kw))  # fmt: skip


def test_recompute_must_be_a_bool() -> None:
    q, k, v = _leaves(1, 16, 2, 1)
    with pytest.raises(TypeError, match="recompute"):
        nsa_attention(q, k, v, _gates(q), recompute="yes", **_nsa_kwargs(NSA_CASES["not-causal"]))


def test_ring_layers_refuse_recompute_before_any_change() -> None:
    """The ring's branches keep their outputs: ``context_parallel`` of a layer built with
    ``recompute=True`` raises, naming it, and leaves the layer as it was; so does building the
    ring layer with it."""
    from dilated_attention import create_multihead_dilated_attention
    from dilated_attention.distributed import context_parallel
    from dilated_attention.distributed.rings.nsa_ring import CompressedSelectedWindowRingAttention

    nsa = dict(compress_block=4, compress_stride=2, select_block=4, topk=1, window=3)
    layer = create_multihead_dilated_attention("nsa", embed_dim=32, num_heads=4, recompute=True,
                                               **nsa)  # fmt: skip
    with pytest.raises(ValueError, match=r"attention \(CompressedSelectedWindowAttention\).*"
                                         r"recompute=True.*recompute=False"):  # fmt: skip
        context_parallel(layer, None)
    assert type(layer.attention).__name__ == "CompressedSelectedWindowAttention"
    with pytest.raises(ValueError, match="recompute=False"):
        CompressedSelectedWindowRingAttention(recompute=True, **nsa)
    with pytest.raises(TypeError, match="recompute must be True or False"):
        CompressedSelectedWindowRingAttention(recompute="no", **nsa)


@pytest.mark.gpu
def test_on_the_gpu_recompute_lowers_the_peak_without_a_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 on CUDA (the automatic kernels), 16 query heads on 4 key/value heads, 8K tokens,
    groups of one query head: gradients within a rounding of the unrecomputed ones; the
    forward+backward's peak over the bytes of q, k, v, out, dout and the gradients well below
    the unrecomputed peak (1.19x against 2.31x at 64K on an H200); no host synchronisation."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(recompute_module, "CHUNK_FLOOR_BYTES", 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((1, 8192, 16, 128), (1, 8192, 4, 128), (1, 8192, 4, 128), (1, 8192, 16, 3))
    q, k, v, gates = (torch.randn(s, generator=g, device="cuda").bfloat16() for s in shapes)
    gates = gates.sigmoid()
    dout = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    kw = dict(compress_block=32, compress_stride=16, select_block=128, topk=7, window=512)
    unavoidable = 4 * q.nbytes + 4 * k.nbytes
    results, peaks = [], []
    for recompute in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gates)]
        out = nsa_attention(*leaves, recompute=recompute, **kw)  # kernels built, outside
        torch.autograd.grad(out, leaves, dout)
        del out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = nsa_attention(*leaves, recompute=recompute, **kw)
            grads = torch.autograd.grad(out, leaves, dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        given = 2 * q.nbytes + 2 * k.nbytes + gates.nbytes  # the leaves and dout, in base
        peaks.append((torch.cuda.max_memory_allocated() - base + given) / unavoidable)
        results.append([out.detach(), *grads])
        del out, grads, leaves
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgates"), *results, strict=True):
        a, b = a.float(), b.float()
        if name in ("dk", "dv"):  # four groups' partial sums, each rounded to bf16, added up
            atol = 2**-5 * b.abs().max().item()
            assert (a - b).abs().mean() <= 2**-6 * b.abs().mean(), name
        else:
            atol = 3e-2
        torch.testing.assert_close(a, b, atol=atol, rtol=3e-2, msg=lambda m, n=name: f"{n}: {m}")
    assert peaks[1] < 0.75 * peaks[0], peaks
