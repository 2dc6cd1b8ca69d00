"""The oracle suite's cases: calls of dense and dilated attention, each with its float64 oracle.

A case with no ``segments`` is dense attention (``attention``); with segments and rates it is
dilated attention (``dilated_attention``). Inputs are drawn in float64 and rounded once to the
tested dtype, so the oracle sees exactly what the kernel saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dilated_attention import attention, dilated_attention

from .oracle import oracle_attention, oracle_dilated_attention


@dataclass(frozen=True)
class Case:
    """One call: its shape, padding, scale and (for dilated attention) branches.

    ``padding``: None; ``"random"`` (30% of keys); ``"prefix"`` (batch 1 pads its first 5 keys:
    causal rows 0..4 see nothing); ``"all"`` (batch 1 pads every key); ``"segment"`` (batch 1
    pads its first 32 keys: a whole w = 32 segment).
    """

    id: str
    N: int
    H: int
    H_kv: int | None = None
    D: int = 16
    B: int = 2
    padding: str | None = None
    scale: float | None = None
    segments: tuple[int, ...] = ()
    rates: tuple[int, ...] = ()

    @property
    def operation(self) -> str:
        return "dilated" if self.segments else "dense"

    @property
    def kv_heads(self) -> int:
        return self.H if self.H_kv is None else self.H_kv

    @property
    def param_id(self) -> str:
        return f"{self.operation}-{self.id}"

    def run(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        is_causal: bool,
        key_padding_mask: Tensor | None,
        backend: str | None,
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of the library's public function for this case."""
        options = {"is_causal": is_causal, "scale": self.scale, "backend": backend}
        if self.segments:
            out, lse = dilated_attention(
                q, k, v, list(self.segments), list(self.rates), key_padding_mask=key_padding_mask,
                return_lse=True, **options,
            )  # fmt: skip
        else:
            out, lse = attention(
                q, k, v, key_padding_mask=key_padding_mask, return_lse=True, **options
            )
        return out, lse

    def oracle(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        is_causal: bool,
        key_padding_mask: Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of the independent oracle (``compute_dtype``: its naive rounding)."""
        options: dict[str, Any] = {
            "is_causal": is_causal,
            "scale": self.scale,
            "key_padding_mask": key_padding_mask,
        }
        if compute_dtype is not None:
            options["compute_dtype"] = compute_dtype
        if self.segments:
            return oracle_dilated_attention(q, k, v, self.segments, self.rates, **options)
        return oracle_attention(q, k, v, **options)


def padding_mask(case: Case) -> Tensor | None:
    """(B, N) bool, True = ignore the key (see :class:`Case`)."""
    if case.padding is None:
        return None
    mask = torch.rand(case.B, case.N) < 0.3
    if case.padding == "prefix":
        mask[1] = False
        mask[1, :5] = True
    elif case.padding == "all":
        mask[1] = True
    elif case.padding == "segment":
        mask[1] = False
        mask[1, :32] = True
    return mask


def inputs(case: Case, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, dout drawn in float64 and rounded once to ``dtype``."""
    q = torch.randn(case.B, case.N, case.H, case.D, dtype=torch.float64)
    k = torch.randn(case.B, case.N, case.kv_heads, case.D, dtype=torch.float64)
    v = torch.randn(case.B, case.N, case.kv_heads, case.D, dtype=torch.float64)
    dout = torch.randn(case.B, case.N, case.H, case.D, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


DENSE_CASES = [
    Case("n1", N=1, H=2, H_kv=2, D=8),
    Case("odd_17", N=17, H=3, H_kv=3),
    Case("n64", N=64, H=4, H_kv=4, D=8),
    Case("odd_93", N=93, H=2, H_kv=2, B=1),
    Case("gqa_8_2", N=33, H=8, H_kv=2, D=8),
    Case("mqa_4_1", N=40, H=4, H_kv=1),
    Case("pad_random", N=48, H=4, H_kv=2, padding="random"),
    Case("pad_prefix", N=31, H=2, H_kv=2, padding="prefix"),
    Case("pad_all_row", N=24, H=2, H_kv=1, padding="all"),
    Case("explicit_scale", N=37, H=4, H_kv=4, scale=0.21),
]

DILATED_CASES = [
    Case("one_branch_dense", N=32, H=2, segments=(32,), rates=(1,), D=8),
    Case("pow2_three_branches", N=64, H=4, segments=(8, 16, 32), rates=(1, 2, 4)),
    Case("rates_3_6", N=72, H=6, segments=(12, 24, 72), rates=(1, 3, 6), D=8),
    # LongNet pairs r=6 with w=16384: rates that do not divide their segment -> ragged rows;
    # N=50 also leaves a last w=16 segment of length 2, shorter than most offsets.
    Case("ragged_w10r3_w16r6", N=50, H=6, segments=(10, 16), rates=(3, 6)),
    Case("partial_last_37", N=37, H=4, segments=(8, 16), rates=(1, 2), D=8),
    Case("partial_last_61", N=61, H=4, segments=(8, 24, 48), rates=(1, 2, 4)),
    Case("segment_longer_than_seq", N=40, H=4, segments=(16, 128), rates=(1, 4), D=8),
    Case("heads_more_than_rates", N=64, H=8, segments=(8, 16, 32), rates=(1, 2, 4), D=8),
    Case("heads_fewer_than_rate", N=64, H=2, segments=(8, 32), rates=(1, 4)),
    Case("long_schedule_r12", N=96, H=8, B=1, segments=(16, 32, 96), rates=(1, 6, 12), D=8),
    Case("gqa_8_2", N=64, H=8, H_kv=2, segments=(8, 16, 32), rates=(1, 2, 4), D=8),
    Case("mqa_4_1", N=48, H=4, H_kv=1, segments=(12, 24), rates=(1, 3)),
    Case("pad_random", N=64, H=4, H_kv=2, segments=(8, 16, 32), rates=(1, 2, 4), padding="random"),
    Case("pad_whole_segment", N=64, H=4, segments=(16, 32), rates=(1, 2), padding="segment"),
    # head 0 covers only even positions, head 1 only odd ones: half the rows are uncovered
    Case("uncovered_rows", N=32, H=2, segments=(8,), rates=(2,)),
    # one branch, rate 1: local attention in several segments (one dense row group) and, with
    # w = N, plain dense attention (the plan of one whole call)
    Case("one_branch_local", N=32, H=4, H_kv=2, segments=(8,), rates=(1,), D=8),
    Case("one_branch_whole", N=24, H=2, segments=(24,), rates=(1,), D=8),
    Case("uncovered_gqa_partial", N=43, H=3, H_kv=1, segments=(9,), rates=(4,), D=8),
    Case("segment_length_one", N=20, H=2, segments=(1, 8), rates=(1, 2), D=8),
    Case("explicit_scale", N=48, H=4, segments=(8, 16, 48), rates=(1, 2, 3), scale=0.3),
]


def case_named(cases: list[Case], case_id: str) -> Case:
    """The case named ``case_id`` in ``cases``."""
    return next(c for c in cases if c.id == case_id)
