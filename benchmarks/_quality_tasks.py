"""The quality benchmark's data and measurements (``bench_quality.py``): the token stream every
method trains on, the key-value retrieval task, and held-out bits per byte by position and
retrieval accuracy by distance.

Shape legend: R rows, N tokens per row (the context; a row is N + 1 tokens with its last target),
M key-value pairs.

Note [Retrieval rows]
    Tokens 0-255 are bytes; 256 symbol tokens beyond them (256-511) never occur in text. A pair
    is a key symbol followed by four value symbols, ``k v1 v2 v3 v4``, all five drawn without
    replacement for the whole row, so no symbol appears in two pairs. A retrieval row is a
    window of real text with ``pairs`` such needles written over it, and at its end a block of
    queries: each pair again, so after a query's key the model must copy the four values it
    saw after that key earlier in the row (multi-query associative recall; one match of the
    token before each value finds it, as an induction head does, however far back it lies).
    The distance of a pair is the query's position minus its needle's; each is drawn
    log-uniformly from the distances that fit (the shortest puts the needle just before the
    query block, the longest at token 0, i.e. up to the full context), so every distance scale
    gets as many pairs, and needles never overlap. Accuracy is exact match of a pair's four
    values, each the model's most likely next token given the true prefix (teacher forcing).

Note [Repeated passages]
    Recall of needles needs a copying mechanism that small models trained for a few hundred
    steps may not have learned (every method is at chance then). A repeated passage needs only
    what text teaches: a held-out text row whose last ``copies * length`` bytes are replaced by
    copies of earlier passages of the same row, each of ``length`` bytes from a log-uniform
    distance (from the shortest that keeps the source before the copies to the copy's own
    position, i.e. up to the full context). The bits per byte a model spends on a copy's bytes
    after its first ``skip`` (which say which passage it is), against the distance, show how
    far back it finds and reuses text: near 0 where it copies, near its bits on the same bytes
    at their source (recorded beside them) where it cannot see or find the source.

Note [One token stream]
    Every method and every resumed call sees the same rows: the rows of step ``s`` come from a
    generator seeded by ``(seed, s)`` alone, so a resumed run needs no data state and two
    methods with one seed train on identical tokens. Row ``r`` of the stream (``r = s * B + b``)
    is a retrieval row when ``floor((r + 1) f) > floor(r f)`` for the retrieval fraction ``f``:
    exactly a fraction ``f`` of the rows, evenly spread. The evaluation rows are drawn once from
    the held-out text with fixed seeds, the same for every run.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dilated_attention.models.training import (
    bits_per_position,
    next_token_scores,
    sample_windows,
)

#: Bytes (0-255) and the retrieval task's symbols (256-511), which never occur in text.
VOCAB_SIZE = 512
SYMBOLS = 256
KEY_LEN, VALUE_LEN = 1, 4
PAIR_LEN = KEY_LEN + VALUE_LEN


def stream_generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded by a hash of ``parts`` (the same on every machine)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass(frozen=True)
class Batch:
    """Rows (R, N + 1) int64 and the pairs' answers: ``answers`` (R, N) bool marks the inputs
    whose next token is a value of a query; ``pair_row``, ``pair_start`` (M,) the row and
    the input position predicting each pair's first value byte; ``distance`` (M,) its distance
    (Note [Retrieval rows])."""

    rows: torch.Tensor
    answers: torch.Tensor
    pair_row: torch.Tensor
    pair_start: torch.Tensor
    distance: torch.Tensor


def min_context(pairs: int) -> int:
    """The shortest context that holds ``pairs`` needles and their queries with room to spare."""
    return 4 * pairs * PAIR_LEN


#: The most pairs a row holds: each takes PAIR_LEN of the symbols, none twice.
MAX_PAIRS = SYMBOLS // PAIR_LEN


def _keys(pairs: int, gen: torch.Generator) -> list[list[int]]:
    """``pairs`` pairs of a key and its value, as their tokens: symbols, none used twice."""
    symbols = (torch.randperm(SYMBOLS, generator=gen)[: pairs * PAIR_LEN] + 256).tolist()
    return [symbols[i * PAIR_LEN : (i + 1) * PAIR_LEN] for i in range(pairs)]


def _needle_start(query: int, last: int, placed: list[int], gen: torch.Generator) -> int:
    """Where the needle of the query at ``query`` goes: a log-uniform distance from the
    shortest (needle at ``last``, the last start before the query block) to the longest (at
    0), clear of the needles ``placed``; a free start at random when 64 draws found none."""
    lo, hi = query - last, query

    def free(start: int) -> bool:
        return all(abs(start - p) >= PAIR_LEN for p in placed)

    for _ in range(64):
        distance = round(lo * (hi / lo) ** float(torch.rand((), generator=gen)))
        if free(query - distance):
            return query - distance
    starts = [s for s in range(last + 1) if free(s)]
    return starts[int(torch.randint(0, len(starts), (), generator=gen))]


def retrieval_row(
    text: torch.Tensor, pairs: int, gen: torch.Generator
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A retrieval row (Note [Retrieval rows]) over ``text`` (N + 1,) int64.

    Returns:
        The row (N + 1,), and per pair ``(start, distance)``: the input position predicting its
        first value in the query block (its key's), and the query's position minus the
        needle's.
    """
    row = text.clone()
    first_query = row.numel() - pairs * PAIR_LEN
    placed: list[int] = []
    out = []
    for i, tokens in enumerate(_keys(pairs, gen)):
        query = first_query + i * PAIR_LEN
        start = _needle_start(query, first_query - PAIR_LEN, placed, gen)
        placed.append(start)
        pair = torch.tensor(tokens)
        row[start : start + PAIR_LEN] = pair
        row[query : query + PAIR_LEN] = pair
        out.append((query + KEY_LEN - 1, query - start))
    return row, out


def make_batch(
    texts: torch.Tensor, retrieval: list[bool], pairs: int, gen: torch.Generator
) -> Batch:
    """Rows of ``texts`` (R, N + 1), the rows marked in ``retrieval`` made retrieval rows."""
    rows, pair_row, pair_start, distance = [], [], [], []
    for r, (text, is_retrieval) in enumerate(zip(texts, retrieval, strict=True)):
        if not is_retrieval:
            rows.append(text)
            continue
        row, found = retrieval_row(text, pairs, gen)
        rows.append(row)
        for start, d in found:
            pair_row.append(r)
            pair_start.append(start)
            distance.append(d)
    stacked = torch.stack(rows)
    answers = torch.zeros(stacked.shape[0], stacked.shape[1] - 1, dtype=torch.bool)
    for r, start in zip(pair_row, pair_start, strict=True):
        answers[r, start : start + VALUE_LEN] = True
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return Batch(stacked, answers, as_long(pair_row), as_long(pair_start), as_long(distance))


@dataclass(frozen=True)
class Passages:
    """Rows (R, N + 1) int64 with repeated passages (Note [Repeated passages]); per copy (M,):
    ``row``, ``copy_start`` and ``source_start`` (the input positions predicting its first
    scored byte and the same byte at the source), ``distance``; ``scored`` bytes of each."""

    rows: torch.Tensor
    row: torch.Tensor
    copy_start: torch.Tensor
    source_start: torch.Tensor
    distance: torch.Tensor
    scored: int


def passage_sizes(context: int) -> tuple[int, int, int]:
    """``(length, skip, copies)`` of the repeated passages of rows of ``context`` tokens: 64, 8
    and 16 from 16K; shorter rows get shorter and fewer passages (at 128: 8, 1 and 2)."""
    length = max(8, min(64, context // 16))
    return length, max(1, length // 8), max(1, min(16, context // (8 * length)))


def passage_rows(texts: torch.Tensor, gen: torch.Generator) -> Passages:
    """``texts`` (R, N + 1) with the end of each row made repeated passages."""
    rows = texts.clone()
    length, skip, copies = passage_sizes(texts.shape[1] - 1)
    first_copy = rows.shape[1] - copies * length
    found: list[tuple[int, int, int, int]] = []
    for r in range(rows.shape[0]):
        for j in range(copies):
            copy = first_copy + j * length
            lo, hi = copy - (first_copy - length), copy
            distance = round(lo * (hi / lo) ** float(torch.rand((), generator=gen)))
            source = copy - distance
            rows[r, copy : copy + length] = texts[r, source : source + length]
            found.append((r, copy + skip - 1, source + skip - 1, distance))
    row, copy_start, source_start, distance = torch.tensor(found, dtype=torch.long).unbind(1)
    return Passages(rows, row, copy_start, source_start, distance, length - skip)


def is_retrieval(row: int, fraction: float) -> bool:
    """Whether row ``row`` of the stream is a retrieval row (Note [One token stream])."""
    return math.floor((row + 1) * fraction) > math.floor(row * fraction)


def training_batch(
    train: torch.Tensor,
    step: int,
    *,
    seed: int,
    batch: int,
    context: int,
    pairs: int,
    fraction: float,
) -> Batch:
    """The rows of step ``step`` of the stream of ``seed`` (Note [One token stream])."""
    gen = stream_generator("train", seed, step)
    texts = sample_windows(train, batch, context, gen)
    kinds = [is_retrieval(step * batch + b, fraction) for b in range(batch)]
    return make_batch(texts, kinds, pairs, gen)


@dataclass(frozen=True)
class Evaluation:
    """The held-out rows every run is measured on: ``text`` (text_rows, N + 1) plain text,
    ``retrieval`` rows with needles and ``passages`` rows with repeated passages."""

    text: torch.Tensor
    retrieval: Batch
    passages: Passages


def evaluation_rows(
    held_out: torch.Tensor, *, context: int, text_rows: int, retrieval_rows: int, pairs: int
) -> Evaluation:
    """The held-out rows every run is measured on, from fixed seeds: ``text_rows`` windows of
    plain text and ``retrieval_rows`` rows each of needles and of repeated passages."""
    text = sample_windows(held_out, text_rows, context, stream_generator("eval text"))
    gen = stream_generator("eval retrieval")
    hay = sample_windows(held_out, retrieval_rows, context, gen)
    retrieval = make_batch(hay, [True] * retrieval_rows, pairs, gen)
    gen = stream_generator("eval passages")
    texts = sample_windows(held_out, retrieval_rows, context, gen)
    return Evaluation(text, retrieval, passage_rows(texts, gen))


def loss_terms(
    logits: torch.Tensor, batch: Batch, answer_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training objective and its language-model part, from ``logits`` (R, N, V): the mean
    next-token cross-entropy over every target, plus ``answer_weight`` times the mean over the
    queries' values where the batch has any."""
    targets = batch.rows[:, 1:].to(logits.device)
    nats = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    lm = nats.mean()
    answers = int(batch.answers.sum())  # on the host: no wait for the device
    if answer_weight == 0 or answers == 0:
        return lm, lm
    mask = batch.answers.to(logits.device, nats.dtype)
    return lm + answer_weight * (nats * mask).sum() / answers, lm


def position_edges(context: int) -> list[int]:
    """Bucket edges of positions in the context: ``0, N/32, N/8, N/2, N`` (at 32K: 0-1K, 1K-4K,
    4K-16K, 16K-32K)."""
    return [0, context // 32, context // 8, context // 2, context]


def distance_edges(context: int) -> list[int]:
    """Bucket edges of retrieval distances: ``0`` and the context halved until the next half
    would be at most ``max(4 * PAIR_LEN, N / 64)`` (at 32K: 0-512, 512-1K, ..., 16K-32K)."""
    edges = [context]
    while edges[-1] // 2 > max(4 * PAIR_LEN, context // 64):
        edges.append(edges[-1] // 2)
    return [0, *reversed(edges)]


def label(lo: int, hi: int) -> str:
    """``"1K-4K"``: a bucket's name, in K = 1024 where whole."""

    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    return f"{short(lo)}-{short(hi)}"


def by_bucket(values: torch.Tensor, keys: torch.Tensor, edges: list[int]) -> dict[str, tuple]:
    """``{label: (mean of values whose key is in [lo, hi), count)}``; the last bucket includes
    its upper edge; mean None where empty."""
    out = {}
    for i, (lo, hi) in enumerate(itertools.pairwise(edges)):
        inside = (keys >= lo) & ((keys <= hi) if i == len(edges) - 2 else (keys < hi))
        count = int(inside.sum())
        out[label(lo, hi)] = (float(values[inside].double().mean()) if count else None, count)
    return out


def _spans(values: torch.Tensor, row: torch.Tensor, start: torch.Tensor, n: int) -> torch.Tensor:
    """(M, n): ``values`` (R, N) at positions ``start .. start + n - 1`` of row ``row``, (M,)."""
    return values[row[:, None], start[:, None] + torch.arange(n)]


def measure(
    model: torch.nn.Module,
    evaluation: Evaluation,
    device: torch.device,
    batch: int,
    autocast: Callable[[], object],
) -> dict[str, object]:
    """Held-out bits per byte (overall and by position bucket), retrieval accuracy (exact match
    of a pair's values, and the fraction of values right, graded) and bits per byte on
    repeated passages (Note [Repeated passages]), the last two overall and by distance bucket."""
    with autocast():  # type: ignore[attr-defined]
        bits = bits_per_position(model, evaluation.text, device, batch=batch)
        ok, _ = next_token_scores(model, evaluation.retrieval.rows, device, batch=batch)
        _, passage_bits = next_token_scores(model, evaluation.passages.rows, device, batch=batch)
    context = evaluation.text.shape[1] - 1
    positions = torch.arange(context)
    bpb = {k: v for k, (v, _) in by_bucket(bits, positions, position_edges(context)).items()}
    retrieval, passages = evaluation.retrieval, evaluation.passages
    right = _spans(ok, retrieval.pair_row, retrieval.pair_start, VALUE_LEN)
    exact, values = right.all(1).double(), right.double().mean(1)
    copy = _spans(passage_bits, passages.row, passages.copy_start, passages.scored).mean(1)
    source = _spans(passage_bits, passages.row, passages.source_start, passages.scored).mean(1)
    edges = distance_edges(context)
    buckets = by_bucket(exact, retrieval.distance, edges)
    graded = by_bucket(values, retrieval.distance, edges)
    copied = by_bucket(copy, passages.distance, edges)
    return {
        "bpb": float(bits.mean()),
        "bpb_by_position": bpb,
        "retrieval_accuracy": float(exact.mean()),
        "retrieval_value_accuracy": float(values.mean()),
        "retrieval_by_distance": {
            k: {"accuracy": a, "value_accuracy": graded[k][0], "pairs": n}
            for k, (a, n) in buckets.items()
        },
        "copy_bpb": float(copy.mean()),
        "copy_source_bpb": float(source.mean()),
        "copy_by_distance": {k: {"bpb": b, "copies": n} for k, (b, n) in copied.items()},
    }
