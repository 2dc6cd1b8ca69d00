"""Messages and descriptions that count agree in number: "1 layer", "2 layers" (a count that can
be 1 goes through ``_validation.counted``). Each case reaches its message with a count of 1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dilated_attention import DilatedKVCache, StaticDilatedKVCache, dilated_attention, explain
from dilated_attention._validation import counted
from dilated_attention.core.decoding.caches import check_caches
from dilated_attention.demo import format_sample
from dilated_attention.distributed.context import kv_repeats
from dilated_attention.models import CheckpointError, load_checkpoint
from dilated_attention.resolve import DENSE, Request, resolve

SEGS, RATES = (4, 8), (1, 2)


def _qkv(batch: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(batch, n, 4, 8), (batch, n, 2, 8), (batch, n, 2, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def test_counted() -> None:
    assert [counted(n, "layer") for n in (0, 1, 2)] == ["0 layers", "1 layer", "2 layers"]
    assert counted(1, "index", "indices") == "1 index"
    assert counted(3, "index", "indices") == "3 indices"


def test_a_dense_call_over_one_position_is_described_in_the_singular() -> None:
    described = str(explain(seq_len=1, dilated=True, segment_lengths=[1], dilation_rates=[1],
                            head_dim=8, num_heads=2, device="cpu"))  # fmt: skip
    assert "one dense call over all 1 position\n" in described, described


def test_a_one_token_causal_query_is_described_in_the_singular() -> None:
    q, k, v = _qkv(1, 5)
    how = resolve(Request.of(DENSE, q[:, -1:], k, v, is_causal=True)).how
    assert how.endswith("one square causal call of 1 row"), how


def test_caches_at_other_lengths_count_one_token() -> None:
    caches = [DilatedKVCache(SEGS, RATES), DilatedKVCache(SEGS, RATES)]
    q, k, v = _qkv(1, 1)
    dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=caches[1])
    with pytest.raises(ValueError, match=r"caches\[1\] has seen 1 token and caches\[0\] 0"):
        check_caches(caches, [c.layer for c in caches], torch.zeros(1, 1, dtype=torch.long), None)


def test_a_packed_prompt_into_a_cache_holding_one_position() -> None:
    cache = DilatedKVCache(SEGS, RATES)
    q, k, v = _qkv(1, 6)
    dilated_attention(q[:, :1], k[:, :1], v[:, :1], SEGS, RATES, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="got one holding 1 position;"):
        dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=cache, cu_seqlens=[0, 6])


def test_load_rows_of_a_cache_of_one_row() -> None:
    source = StaticDilatedKVCache(SEGS, RATES, max_length=1)
    q, k, v = _qkv(1, 1)
    with torch.no_grad():
        dilated_attention(q, k, v, SEGS, RATES, is_causal=True, cache=source)
    with pytest.raises(ValueError, match=r"in 1 row, this cache .* in 8; load caches of one"):
        StaticDilatedKVCache(SEGS, RATES).load_rows(torch.tensor([0]), source, 1)
    with pytest.raises(ValueError, match=r"pass 1 index, one per prompt the source holds"):
        StaticDilatedKVCache(SEGS, RATES, max_length=1).load_rows(torch.tensor([0, 1]), source, 2)


def test_key_value_heads_repeated_once() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "4 x 1 = 4 key/value heads (the 4 repeated to split over 2 ranks) do not divide the 6 "
        "query heads"
    )):  # fmt: skip
        kv_repeats(6, 4, 2)


def test_a_checkpoint_of_one_byte(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    path.write_bytes(b"D")  # the first byte of the checkpoint header
    with pytest.raises(CheckpointError, match=r"is truncated: only 1 byte, cut short inside"):
        load_checkpoint(path)


def test_the_demo_sample_of_one_byte_each() -> None:
    text = format_sample(b"a", b"b", how="greedy")
    assert text.startswith("----- prompt (1 byte) -----\na\n----- continuation (1 byte, greedy)")
    assert "(2 bytes)" in format_sample(b"ab", b"")
