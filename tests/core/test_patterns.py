"""Block-sparse patterns: every block mask against its definition (brute-force loops), composition,
densities, presets, determinism, and bad input."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dilated_attention import patterns as P

SHAPES = [(1, 1), (5, 5), (7, 4), (4, 9), (12, 12)]


def _brute(nq: int, nk: int, keep: Callable[[int, int], bool]) -> torch.Tensor:
    return torch.tensor([[bool(keep(i, j)) for j in range(nk)] for i in range(nq)]).view(nq, nk)


def _assert_mask(pattern: P.Pattern, nq: int, nk: int, expected: torch.Tensor) -> None:
    mask = pattern.block_mask(nq, nk)
    assert mask.dtype == torch.bool and mask.shape == (nq, nk)
    assert torch.equal(mask, expected), f"{pattern} ({nq}, {nk}):\n{mask.int()}\n{expected.int()}"
    assert pattern.density(nq, nk) == pytest.approx(expected.sum().item() / (nq * nk))


@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_local_window_definition(nq: int, nk: int, window: int) -> None:
    _assert_mask(P.LocalWindow(window), nq, nk, _brute(nq, nk, lambda i, j: abs(i - j) <= window))


@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("num_global,window", [(0, 0), (1, 0), (2, 1), (3, 2), (20, 0)])
def test_global_local_definition(nq: int, nk: int, num_global: int, window: int) -> None:
    def keep(i: int, j: int) -> bool:
        return abs(i - j) <= window or i < num_global or j < num_global

    _assert_mask(P.GlobalLocal(num_global, window), nq, nk, _brute(nq, nk, keep))


@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("rates", [(1,), (2,), (3,), (2, 3), (4, 6, 5)])
def test_dilated_blocks_definition(nq: int, nk: int, rates: tuple[int, ...]) -> None:
    def keep(i: int, j: int) -> bool:
        return any((i - j) % r == 0 for r in rates)

    _assert_mask(P.DilatedBlocks(rates), nq, nk, _brute(nq, nk, keep))
    assert P.DilatedBlocks(list(rates)) == P.DilatedBlocks(rates)  # lists are accepted


def test_dilated_blocks_accepts_one_int() -> None:
    assert P.DilatedBlocks(3) == P.DilatedBlocks((3,))  # type: ignore[arg-type]


@pytest.mark.parametrize("nq,nk", SHAPES)
def test_custom_is_its_mask(nq: int, nk: int) -> None:
    mask = torch.rand(nq, nk, generator=torch.Generator().manual_seed(nq * 31 + nk)) < 0.4
    pattern = P.Custom(mask)
    _assert_mask(pattern, nq, nk, mask)
    mask[0, 0] = not bool(mask[0, 0])  # the pattern copied the mask
    assert bool(pattern.block_mask(nq, nk)[0, 0]) != bool(mask[0, 0])


def test_random_is_deterministic_in_seed_and_shape() -> None:
    a = P.Random(0.3, seed=7)
    assert torch.equal(a.block_mask(20, 30), P.Random(0.3, seed=7).block_mask(20, 30))
    assert torch.equal(a.block_mask(20, 30), a.block_mask(20, 30))
    assert not torch.equal(a.block_mask(20, 30), P.Random(0.3, seed=8).block_mask(20, 30))
    assert a == P.Random(0.3, seed=7) and hash(a) == hash(P.Random(0.3, seed=7))
    assert P.Random(1.0).block_mask(5, 6).all()


def test_masks_are_drawn_once_and_handed_out_as_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``block_mask`` keeps each (pattern, block counts) mask: the second call draws nothing,
    and changing a returned mask changes no later one."""
    drawn: list[tuple[int, int]] = []
    real = P.Random._mask

    def counting(self: P.Random, nq: int, nk: int) -> torch.Tensor:
        drawn.append((nq, nk))
        return real(self, nq, nk)

    monkeypatch.setattr(P.Random, "_mask", counting)
    P._cached_mask.cache_clear()
    pattern = P.Random(0.3, seed=11)
    first = pattern.block_mask(16, 24)
    expected = first.clone()
    first.logical_not_()
    assert torch.equal(pattern.block_mask(16, 24), expected)
    assert torch.equal(P.Random(0.3, seed=11).block_mask(16, 24), expected)  # equal patterns
    assert drawn == [(16, 24)]
    pattern.block_mask(24, 16)
    assert drawn == [(16, 24), (24, 16)]


def test_a_wrong_custom_size_fails_on_every_call() -> None:
    pattern = P.Custom(torch.ones(3, 4, dtype=torch.bool))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"\(3, 4\)"):
            pattern.block_mask(4, 4)


def test_random_matches_its_definition() -> None:
    """Each pair kept independently with probability density: check mean and independence."""
    mask = P.Random(0.25, seed=3).block_mask(200, 200).double()
    assert abs(mask.mean().item() - 0.25) < 0.01
    # Independence between neighbouring pairs: P(both) ~ p^2.
    both = (mask[:, 1:] * mask[:, :-1]).mean().item()
    assert abs(both - 0.0625) < 0.01


@pytest.mark.parametrize(
    "name,nominal", [("sparse_10", 0.1), ("sparse_25", 0.25), ("sparse_50", 0.5)]
)
def test_presets_near_their_nominal_density(name: str, nominal: float) -> None:
    pattern = P.preset(name)
    assert P.PRESETS[name] is pattern
    for blocks in (64, 128, 512):
        assert abs(pattern.density(blocks, blocks) - nominal) < 0.03, (name, blocks)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="sparse_10"):
        P.preset("sparse_99")


def test_union_and_intersection() -> None:
    a, b = P.LocalWindow(1), P.DilatedBlocks((3,))
    c = P.Random(0.5, seed=1)
    for nq, nk in SHAPES:
        ma, mb, mc = (p.block_mask(nq, nk) for p in (a, b, c))
        _assert_mask(a | b, nq, nk, ma | mb)
        _assert_mask(a & b, nq, nk, ma & mb)
        _assert_mask((a | b) & c, nq, nk, (ma | mb) & mc)
        _assert_mask(a | b | c, nq, nk, ma | mb | mc)
    assert isinstance(a | b, P.Union) and isinstance(a & b, P.Intersection)
    assert (a | b) == (P.LocalWindow(1) | P.DilatedBlocks((3,)))


def test_density_is_fraction_of_kept_pairs() -> None:
    assert P.LocalWindow(0).density(4, 4) == 0.25
    assert P.LocalWindow(100).density(3, 7) == 1.0
    assert P.GlobalLocal(1, 0).density(4, 4) == pytest.approx(10 / 16)
    assert P.Custom(torch.zeros(2, 3, dtype=torch.bool)).density(2, 3) == 0.0


# -- bad input ------------------------------------------------------------------------------------
def test_negative_window() -> None:
    with pytest.raises(ValueError, match="window"):
        P.LocalWindow(-1)
    with pytest.raises(ValueError, match="window"):
        P.GlobalLocal(1, -2)


def test_negative_num_global() -> None:
    with pytest.raises(ValueError, match="num_global"):
        P.GlobalLocal(-1, 0)


def test_non_int_window() -> None:
    with pytest.raises(TypeError, match="window"):
        P.LocalWindow(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="window"):
        P.LocalWindow(True)  # type: ignore[arg-type]


@pytest.mark.parametrize("rates", [(), (0,), (2, -1)])
def test_bad_rates(rates: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="rates"):
        P.DilatedBlocks(rates)


def test_non_int_rates() -> None:
    with pytest.raises(TypeError, match="rates"):
        P.DilatedBlocks((2.0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rates"):
        P.DilatedBlocks("12")  # type: ignore[arg-type]


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval(density: float) -> None:
    with pytest.raises(ValueError, match="density"):
        P.Random(density)


def test_non_numeric_density_and_seed() -> None:
    with pytest.raises(TypeError, match="density"):
        P.Random("0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        P.Random(0.1, seed=1.5)  # type: ignore[arg-type]


def test_custom_mask_must_be_bool() -> None:
    with pytest.raises(TypeError, match="bool"):
        P.Custom(torch.ones(2, 2))
    with pytest.raises(TypeError, match="mask"):
        P.Custom([[True]])  # type: ignore[arg-type]


def test_custom_mask_must_be_2d() -> None:
    with pytest.raises(ValueError, match="2-D"):
        P.Custom(torch.ones(2, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D"):
        P.Custom(torch.ones(0, 2, dtype=torch.bool))


def test_custom_mask_shape_mismatch() -> None:
    pattern = P.Custom(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(4, 4\)"):
        pattern.block_mask(4, 4)
    with pytest.raises(ValueError, match="block_size"):
        (pattern | P.LocalWindow(1)).block_mask(3, 5)


@pytest.mark.parametrize("count", [0, -1])
def test_bad_block_counts(count: int) -> None:
    with pytest.raises(ValueError, match="num_query_blocks"):
        P.LocalWindow(1).block_mask(count, 3)
    with pytest.raises(ValueError, match="num_key_blocks"):
        P.LocalWindow(1).block_mask(3, count)


def test_non_int_block_counts() -> None:
    with pytest.raises(TypeError, match="num_query_blocks"):
        P.LocalWindow(1).block_mask(2.0, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("other", [torch.ones(2, 2, dtype=torch.bool), 1, "local"])
def test_composing_with_non_patterns(other: object) -> None:
    with pytest.raises(TypeError, match="Pattern"):
        P.LocalWindow(1) | other  # type: ignore[operator]
    with pytest.raises(TypeError, match="Pattern"):
        P.LocalWindow(1) & other  # type: ignore[operator]
    if not isinstance(other, torch.Tensor):  # a tensor's own | takes precedence on the left
        with pytest.raises(TypeError, match="Pattern"):
            other | P.LocalWindow(1)  # type: ignore[operator]
        with pytest.raises(TypeError, match="Pattern"):
            other & P.LocalWindow(1)  # type: ignore[operator]


def test_union_of_non_patterns() -> None:
    with pytest.raises(TypeError, match="Pattern"):
        P.Union((P.LocalWindow(1), 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple"):
        P.Intersection(())
