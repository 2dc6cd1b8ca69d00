"""Every launch of our Triton kernels puts the batch rows on a CUDA grid axis of at most
65,535 programs: more rows are a reason the resolver names (so the automatic choice takes
another kernel), and a call that asks for the Triton backend by name gets a ValueError before
any work, where it used to fail inside a launch after its buffers were allocated."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dilated_attention import backend_reasons, dilated_attention
from dilated_attention.backends import KernelInputs, get_backend
from dilated_attention.backends.triton_kernels.tiles import MAX_GRID_Y
from dilated_attention.resolve.request import Request, kernel_inputs

_BASE = KernelInputs(device=torch.device("cpu"), dtype=torch.float16, head_dim=64, num_heads=4,
                     num_kv_heads=2, query_len=256, key_len=256)  # fmt: skip


def _grid_reasons(batch: int) -> list[str]:
    reasons = get_backend("triton").capability_reasons(replace(_BASE, batch=batch))
    return [r for r in reasons if "batch rows" in r]


def test_more_batch_rows_than_a_grid_axis_holds_is_a_reason() -> None:
    assert MAX_GRID_Y == 65535
    assert _grid_reasons(MAX_GRID_Y) == []
    (reason,) = _grid_reasons(MAX_GRID_Y + 1)
    assert "65536 batch rows" in reason and "fewer rows at a time" in reason


def test_a_request_gives_its_batch_and_packed_documents_one_row() -> None:
    """What the registries judge: the request's batch rows; packed documents run as one row
    of the batch's positions, and a static cache's step puts its rows on the grid's long axis,
    so neither is bounded."""
    q = torch.empty(MAX_GRID_Y + 1, 4, 2, 8, device="meta")
    assert kernel_inputs(Request.of("dilated", q, q, q)).batch == MAX_GRID_Y + 1
    packed = Request.of("dilated", q, q, q, documents=(0, 4 * (MAX_GRID_Y + 1)))
    assert kernel_inputs(packed).batch == 1
    step = torch.empty(MAX_GRID_Y + 1, 1, 2, 8, device="meta")
    assert kernel_inputs(Request.of("decode", step, q, q, static=True)).batch == 1


@pytest.mark.gpu
def test_the_reason_reaches_the_public_report_and_an_explicit_call() -> None:
    q = torch.randn(MAX_GRID_Y + 1, 8, 2, 8, device="cuda", dtype=torch.float16)
    k = v = torch.randn_like(q)
    assert any("65536 batch rows" in r for r in backend_reasons(q, k, v)["triton"])
    with pytest.raises(ValueError, match="65536 batch rows: its launches hold at most 65535"):
        dilated_attention(q, k, v, [4, 8], [1, 2], backend="triton")
