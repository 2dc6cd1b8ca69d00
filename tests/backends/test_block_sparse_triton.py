"""The block-sparse Triton kernels (``backends/triton_kernels/block_sparse.py``) against the float64
dense masked oracle: outputs, lse and all gradients; causal and not, ragged last blocks, query
and key lengths that differ, GQA, rows that see no key, head dims that are not powers of two.
Every output buffer starts NaN-filled, so a row no kernel writes shows.

Run-time block masks (per batch row and head, lists made on the device) have cases of their
own. The tests ask for ``backend="triton"`` (on CUDA the kernels are also the automatic choice for
calls without gradients); on a machine without a GPU, ``TRITON_INTERPRET=1 pytest
tests/backends/test_block_sparse_triton.py`` runs them through Triton's interpreter (float32 and
float16).
"""

from __future__ import annotations

import pytest
import torch
from support.block_sparse import (
    assert_end_aligned_refused,
    check_kernel_result,
    chosen_kernel,
    token_mask,
)
from support.runtime_masks import runtime_token_mask
from support.triton import KERNEL_DEVICES, poison_new_buffers, skip_without_triton

from dilated_attention import block_sparse_attention
from dilated_attention import patterns as P
from dilated_attention.backends import KernelInputs
from dilated_attention.backends.registry import registry_for

CASES = [
    # (Nq, Nk, block_size, kv_heads, head_dim, pattern)
    (256, 256, 64, 4, 64, P.LocalWindow(1)),
    (200, 200, 64, 2, 64, P.Random(0.3, seed=3) | P.LocalWindow(0)),
    (300, 190, 128, 1, 48, P.GlobalLocal(1, 0)),
    (130, 260, 64, 2, 64, P.DilatedBlocks((2,))),
    (320, 320, 64, 4, 32, P.Custom(torch.eye(5, dtype=torch.bool).roll(1, 1))),  # empty rows
    (512, 512, 256, 2, 64, P.Random(0.5, seed=1)),
    (384, 384, 128, 2, 128, P.Random(0.4, seed=2) | P.LocalWindow(0)),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_triton_kernels_match_oracle(
    device: str, dtypes: list[torch.dtype], case: int, is_causal: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    skip_without_triton(device)
    nq, nk, block_size, kv_heads, dim, pattern = CASES[case]
    backend = "triton"
    if is_causal and nq != nk:
        assert_end_aligned_refused(nq, nk, pattern, block_size, backend, device)
        return
    mask = token_mask(pattern, block_size, nq, nk, is_causal)
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(case)
        shapes = [(2, nq, 4, dim), (2, nk, kv_heads, dim), (2, nk, kv_heads, dim), (2, nq, 4, dim)]
        q, k, v, dout = (torch.randn(s, generator=gen).to(dtype) for s in shapes)
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        chosen = chosen_kernel(
            leaves[0], leaves[1], is_causal=is_causal, block_size=block_size, needs_grad=True,
            backend=backend,
        )  # fmt: skip
        assert chosen.runs_plan and chosen.backend.name == "triton", f"not the kernels: {chosen}"
        with monkeypatch.context() as patch:
            poison_new_buffers(patch)
            out, lse = block_sparse_attention(
                *leaves, pattern, block_size=block_size, is_causal=is_causal, backend=backend,
                return_lse=True,
            )  # fmt: skip
            grads = [g.cpu() for g in torch.autograd.grad(out, leaves, dout.to(device))]
        check_kernel_result(q, k, v, dout, mask, out.detach().cpu(), lse.cpu(), grads)


# Run-time block masks (Note [Run-time block masks]): (Nq, Nk, block_size, kv_heads, head_dim,
# mask batch, mask heads, index lists). Few and small: the interpreter is slow.
RUNTIME_CASES = [
    (200, 200, 64, 2, 32, 2, 4, False),  # per query head, ragged
    (256, 256, 128, 2, 32, 1, 2, True),  # per key/value head, shared by the batch, indices
    (192, 320, 64, 1, 32, 2, 1, False),  # rectangular, MQA, shared by every head
]
# Causal calls of a query shorter than the key are end-aligned: the fallback runs them
# (tests/ops/test_block_sparse_runtime.py).
RUNTIME_PARAMS = [
    (case, causal) for case, c in enumerate(RUNTIME_CASES) for causal in (False, True)
    if not causal or c[0] == c[1]
]


@pytest.mark.parametrize(("case", "is_causal"), RUNTIME_PARAMS)
@pytest.mark.parametrize(("device", "dtypes"), KERNEL_DEVICES)
def test_triton_kernels_take_run_time_masks(
    device: str, dtypes: list[torch.dtype], case: int, is_causal: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Per-(batch row, head) lists made on the device from a bool mask or index lists (with -1
    and repeats), forward and backward, against the float64 oracle; new buffers NaN-filled."""
    skip_without_triton(device)
    nq, nk, block_size, kv_heads, dim, mask_batch, mask_heads, indices = RUNTIME_CASES[case]
    mq, mk = -(-nq // block_size), -(-nk // block_size)
    gen = torch.Generator().manual_seed(case)
    if indices:
        mask = torch.randint(-1, mk, (mask_batch, mask_heads, mq, 3), generator=gen)
    else:
        mask = torch.rand(mask_batch, mask_heads, mq, mk, generator=gen) < 0.5
    tokens = runtime_token_mask(mask, block_size, batch=2, heads=4, query_len=nq, key_len=nk,
                                is_causal=is_causal)  # fmt: skip
    for dtype in dtypes[:1] if device == "cpu" else dtypes:
        shapes = [(2, nq, 4, dim), (2, nk, kv_heads, dim), (2, nk, kv_heads, dim), (2, nq, 4, dim)]
        q, k, v, dout = (torch.randn(s, generator=gen).to(dtype) for s in shapes)
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        with monkeypatch.context() as patch:
            poison_new_buffers(patch)
            out, lse = block_sparse_attention(
                *leaves, mask.to(device), block_size=block_size, is_causal=is_causal,
                backend="triton", return_lse=True,
            )  # fmt: skip
            grads = [g.cpu() for g in torch.autograd.grad(out, leaves, dout.to(device))]
        check_kernel_result(q, k, v, dout, tokens, out.detach().cpu(), lse.cpu(), grads)


def test_reasons_name_the_block_size_and_head_dim() -> None:
    """What keeps the Triton kernels from running is said, not guessed (checked without a GPU)."""
    registry = registry_for("block_sparse")

    def reasons(head_dim: int, block_size: int) -> str:
        inputs = KernelInputs(
            device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=head_dim, num_heads=2,
            num_kv_heads=2, query_len=96, key_len=96, block_size=block_size,
        )  # fmt: skip
        return "; ".join(registry.reasons("triton", inputs))

    assert "block_size 48 is not a multiple of 64" in reasons(256, 48)
    assert "head_dim 256 > 128" in reasons(256, 48)
    assert "multiple of 64" not in reasons(64, 128) and "head_dim" not in reasons(64, 128)


def test_named_triton_kernels_that_cannot_tile_raise_with_the_reason() -> None:
    """``backend="triton"`` names the block-sparse Triton kernels: where they cannot run (here: a
    block size they cannot tile, and a CPU), a ValueError says why and which kernels can; a
    dense kernel by name runs the plan."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 150, 2, 32, generator=gen) for _ in range(3))
    pattern = P.LocalWindow(1)
    with pytest.raises(ValueError, match=r"'triton' .*block_sparse attention.*block_size 48"):
        block_sparse_attention(q, k, v, pattern, block_size=48, is_causal=True, backend="triton")
    got = block_sparse_attention(q, k, v, pattern, block_size=48, is_causal=True, backend="math")
    want = block_sparse_attention(q, k, v, pattern, block_size=48, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_choice_by_gradients_block_size_and_dtype() -> None:
    """On CUDA, nothing asked for: FlashAttention-4's block sparsity where it runs (block sizes
    that are multiples of 128); else the Triton kernels for calls without gradients (16-bit
    inputs, block sizes that are multiples of 64), FlexAttention for training and for everything
    else."""
    from dilated_attention.backends import KernelInputs, get_backend

    q = torch.zeros(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    fa4 = get_backend("flash_attn4")
    fa4_runs = not fa4.import_reasons() and not fa4.block_sparse_reasons(
        KernelInputs.from_tensors(q, q, block_size=128)
    )

    def choose(x: torch.Tensor, block_size: int, needs_grad: bool, backend: str | None = None):
        chosen = chosen_kernel(
            x, x, is_causal=False, block_size=block_size, needs_grad=needs_grad, backend=backend
        )
        return chosen.backend.name if chosen.runs_plan else "plan"

    assert choose(q, 128, needs_grad=False) == ("flash_attn4" if fa4_runs else "triton")
    assert choose(q, 128, needs_grad=True) == ("flash_attn4" if fa4_runs else "flex")
    assert choose(q, 128, needs_grad=True, backend="triton") == "triton"
    assert choose(q, 48, needs_grad=False) == "flex"
    assert choose(q.float(), 64, needs_grad=False) == "flex"
    assert choose(q, 128, needs_grad=False, backend="flex") == "flex"
    assert choose(q, 128, needs_grad=False, backend="sdpa_cudnn") == "plan"
    leaf = q.clone().requires_grad_()
    with torch.no_grad():
        want = block_sparse_attention(leaf, leaf, leaf, P.LocalWindow(0), backend="triton",
                                      block_size=64)  # fmt: skip
        got = block_sparse_attention(leaf, leaf, leaf, P.LocalWindow(0), block_size=64)
    assert torch.equal(got, want)  # no grad, a block size FA4 does not take: Triton
