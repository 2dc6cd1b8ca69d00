"""The quality benchmark (``benchmarks/bench_quality.py``): its smoke mode trains every method and
fails when a loss does not fall, runs resume from their checkpoints, the record carries what a
reader needs, and the retrieval task and the FLOP counts are what they say."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _quality_report as report
import _quality_tasks as tasks
import bench_quality
from _records import check_record
from _timing import host_label

import dilated_attention.factory as factory
from dilated_attention import MultiheadDilatedAttention, patterns, register_kind

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
#: Every run of these tests: quiet, its own directories.
QUIET = ["--no-progress"]


@pytest.fixture(autouse=True)
def own_kinds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kinds the benchmark registers (its block-sparse kind, a stand-in) stay in the test."""
    monkeypatch.setattr(factory, "_KINDS", dict(factory._KINDS))
    yield


def _paths(tmp_path: Path, name: str) -> list[str]:
    # The record's name carries this host's label, as the record check requires.
    return ["--run-dir", str(tmp_path / name), "--out", str(tmp_path / f"quality_{host_label()}")]


def test_smoke_trains_every_method_and_writes_a_complete_record(tmp_path: Path) -> None:
    """``--smoke`` runs every method of the table, each one's training loss falls by 5%, and the
    record (one row per run with method, seed, context and the measurements), its table and its
    plots are written; the record passes the checks every benchmark record passes."""
    record = bench_quality.main(["--smoke", *QUIET, *_paths(tmp_path, "runs")])
    assert record is not None
    rows = record["results"]
    assert [r["method"] for r in rows] == [m.name for m in bench_quality.METHODS]
    for row in rows:
        missing = [f for f in report.REQUIRED if f not in row]
        assert not missing, (row["method"], missing)
        assert row["loss_last"] < 0.95 * row["loss_first"], row["method"]
        assert (row["seed"], row["context"], row["steps"]) == (0, 128, 24)
        assert 0 < row["bpb"] < 9 and 0 <= row["retrieval_accuracy"] <= 1
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["peak_memory_gib"] is None
        assert len(row["bpb_by_position"]) == 4 and row["bpb_far"] is not None
        assert 0 < row["copy_bpb"] < 10 and 0 < row["copy_source_bpb"] < 10
    path = tmp_path / f"quality_{host_label()}.json"
    assert check_record(path, json.loads(path.read_text())) == []
    assert json.loads(path.read_text()) == record
    assert "| dense |" in path.with_suffix(".md").read_text()
    pytest.importorskip("matplotlib")
    for suffix in ("bpb_by_position", "retrieval", "copy"):
        assert (tmp_path / f"quality_{host_label()}_{suffix}.png").stat().st_size > 0


def test_smoke_fails_when_a_loss_does_not_fall(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"training loss did not fall by 5%: dense seed 0"):
        bench_quality.main(["--smoke", "--methods", "dense", "--steps", "3", "--lr", "1e-12",
                            *QUIET, *_paths(tmp_path, "runs")])  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pairs", "60"], r"--pairs must be <= 51"),
        (["--context", "64", "--pairs", "4"], r"--context 64 is too short for --pairs 4"),
        (["--embed-dim", "30", "--num-heads", "4"], r"--embed-dim \(30\) must be --num-heads"),
        (["--global-every", "4"], r"--global-every \(4\) must be <= --num-layers \(3\)"),
        (["--lr", "nan"], r"--lr must be a finite number > 0"),
        (["--retrieval-fraction", "1.5"], r"--retrieval-fraction must be in \[0, 1\]"),
        (["--steps", "0"], r"--steps must be >= 1, got 0"),
        (["--corpus-bytes", "1000"], r"--corpus-bytes must be >= 1048576"),
    ],
)
def test_bad_flags_are_usage_errors_before_any_work(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_quality.main(["--smoke", *flags, *_paths(tmp_path, "runs")])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def _losses(run_dir: Path) -> list[float]:
    [result] = run_dir.rglob("result.json")
    return json.loads(result.read_text())["losses"]


def test_a_resumed_run_continues_from_its_checkpoint(tmp_path: Path) -> None:
    """A run stopped at step 3 keeps a checkpoint of step 3; the same command continues it to
    the end: every step's loss and the measurements equal those of a run never stopped. A
    finished run is skipped, and a checkpoint of other settings is refused."""
    tiny = ["--smoke", "--methods", "window_dilated", "--steps", "6", "--no-require-loss-fall",
            *QUIET]  # fmt: skip
    stopped = tiny + _paths(tmp_path, "stopped")
    assert bench_quality.main([*stopped, "--stop-after", "3"]) is None
    [checkpoint] = (tmp_path / "stopped").rglob("checkpoint.pt")
    progress = torch.load(checkpoint, weights_only=True)["progress"]
    assert progress["step"] == 3 and len(progress["losses"]) == 3
    with pytest.raises(ValueError, match=r"saved with other settings \(\['steps'\]\)"):
        bench_quality.main([*stopped, "--steps", "7"])
    [resumed] = bench_quality.main(stopped)["results"]
    assert resumed["steps"] == 6 and resumed["calls"] == 2 and not checkpoint.exists()
    [whole] = bench_quality.main(tiny + _paths(tmp_path / "b", "whole"))["results"]
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "b" / "whole")
    assert len(_losses(tmp_path / "stopped")) == 6
    for name in ("bpb", "bpb_by_position", "retrieval_by_distance"):
        assert resumed[name] == whole[name], name
    again = bench_quality.main(stopped)  # nothing left to run: the record as it was
    assert again is None and json.loads((tmp_path / f"quality_{host_label()}.json").read_text())[
        "results"
    ] == [resumed]


def test_a_time_budget_pauses_runs_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose budget has too little left for the evaluation stops before the next step,
    saves the run there and starts no other; one with too little left to start a run starts
    none."""
    args = ["--smoke", "--methods", "dense", "window", "--no-require-loss-fall", *QUIET]
    args += _paths(tmp_path, "runs")
    steps_left = iter([0.0, 0.0, 0.0, 1e9])  # the evaluation's reserve fits 3 steps, then not
    monkeypatch.setattr(bench_quality, "_reserve", lambda s, seconds: next(steps_left))
    assert bench_quality.main([*args, "--time-budget-s", "1000"]) is None
    [checkpoint] = (tmp_path / "runs").rglob("checkpoint.pt")
    assert checkpoint.parent.name == "dense_seed0"  # window was not started
    assert torch.load(checkpoint, weights_only=True)["progress"]["step"] == 3
    monkeypatch.setattr(bench_quality, "START_S", 1e9)
    assert bench_quality.main([*args, "--time-budget-s", "1000"]) is None
    assert torch.load(checkpoint, weights_only=True)["progress"]["step"] == 3


def test_methods_share_their_weights_and_differ_in_attention() -> None:
    """The same seed gives every method the same parameters: only the attention differs. NSA's
    layers add their gate projections (attention parameters), drawn before the later blocks'."""
    _, settings = bench_quality.parse_args(["--smoke"])
    params = {}
    for name, method in bench_quality.available_methods().items():
        torch.manual_seed(0)
        config = bench_quality.model_config(method, settings)
        params[name] = dict(bench_quality.LongNetLM(config).named_parameters())
    dense = params.pop("dense")
    nsa = params.pop("nsa")
    assert set(nsa) > set(dense) and all(".attn." in k for k in set(nsa) - set(dense))
    for name, named in params.items():
        assert named.keys() == dense.keys(), name
        assert all(torch.equal(named[k], dense[k]) for k in dense), name


def test_methods_are_listed_where_their_kind_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A method of a factory kind is offered only where the factory has the kind (``--methods``
    refuses it elsewhere); a kind without a pair count here gets no TFLOP/s."""
    names = [m.name for m in bench_quality.METHODS]
    assert list(bench_quality.available_methods()) == names  # moba and nsa are here
    assert "moba" not in bench_quality.available_methods(["auto", "dilated", "nsa"])
    monkeypatch.setattr(bench_quality, "list_kinds", lambda: ["auto", "dilated", "nsa"])
    with pytest.raises(SystemExit) as exc:
        bench_quality.main(["--smoke", "--methods", "moba", *QUIET, *_paths(tmp_path, "no")])
    assert exc.value.code == 2  # a usage error: no such method here
    register_kind("stand_in", dilated=nn.Identity, multihead=MultiheadDilatedAttention)
    method = bench_quality.Method("stand_in", "", lambda s: {"kind": "stand_in"}, kind="stand_in")
    _, s = bench_quality.parse_args(["--smoke"])
    config = bench_quality.model_config(method, s)
    assert bench_quality.attention_pairs(method, config, s) is None
    model = bench_quality.LongNetLM(config)
    assert bench_quality.step_flops(model, None, s) is None


def test_retrieval_rows_hold_each_pair_twice_at_its_distance() -> None:
    """Each needle is its query's tokens, ``distance`` before it, needles never overlap, no
    symbol serves two pairs, and the answers mark the inputs that predict the queries' values
    (the key and the first three values)."""
    text = torch.randint(0, 128, (3, 513), generator=torch.Generator().manual_seed(1))
    batch = tasks.make_batch(text, [True, False, True], 8, torch.Generator().manual_seed(2))
    assert torch.equal(batch.rows[1], text[1])  # a plain text row
    assert batch.answers[1].sum() == 0 and batch.answers.sum() == 2 * 8 * tasks.VALUE_LEN
    for r in (0, 2):
        mine = batch.pair_row == r
        needles = []
        for start, distance in zip(
            batch.pair_start[mine].tolist(), batch.distance[mine].tolist(), strict=True
        ):
            query = start + 1 - tasks.KEY_LEN
            needle = query - distance
            pair = batch.rows[r, query : query + tasks.PAIR_LEN]
            assert (pair >= 256).all() and (pair < tasks.VOCAB_SIZE).all()
            assert torch.equal(batch.rows[r, needle : needle + tasks.PAIR_LEN], pair)
            assert batch.answers[r, start : start + tasks.VALUE_LEN].all()
            assert 0 <= needle <= 513 - 8 * tasks.PAIR_LEN - tasks.PAIR_LEN
            needles.append(needle)
        needles.sort()
        assert all(b - a >= tasks.PAIR_LEN for a, b in itertools.pairwise(needles))
        symbols = batch.rows[r][batch.rows[r] >= 256]
        assert symbols.numel() == 2 * 8 * tasks.PAIR_LEN
        assert symbols.unique().numel() == 8 * tasks.PAIR_LEN  # each once as needle, once queried


def test_token_stream_is_the_same_for_every_call_and_mixes_the_fraction() -> None:
    train = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    common = dict(seed=3, batch=4, context=256, pairs=2, fraction=0.25)
    first = tasks.training_batch(train, 7, **common)
    assert torch.equal(first.rows, tasks.training_batch(train, 7, **common).rows)
    assert not torch.equal(first.rows, tasks.training_batch(train, 8, **common).rows)
    retrieval = [tasks.is_retrieval(r, 0.25) for r in range(400)]
    assert sum(retrieval) == 100 and all(sum(retrieval[i : i + 4]) == 1 for i in range(0, 400, 4))


class _Perfect(nn.Module):
    """The right next token of every row it was built with, except (``miss``) the last value of
    every query."""

    def __init__(self, batch: tasks.Batch, miss: bool, others: torch.Tensor) -> None:
        super().__init__()
        self.nxt = {tuple(row[:-1].tolist()): row[1:] for row in others}
        for row, answers in zip(batch.rows, batch.answers, strict=True):
            target = row[1:].clone()
            last = answers & ~torch.cat([answers[1:], torch.tensor([False])])
            if miss:
                target[last] = 0  # a byte, never a value
            self.nxt[tuple(row[:-1].tolist())] = target

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, tasks.VOCAB_SIZE)
        for i, row in enumerate(tokens):
            logits[i].scatter_(1, self.nxt[tuple(row.tolist())][:, None], 30.0)
        return logits


@pytest.mark.parametrize("miss", [False, True])
def test_retrieval_accuracy_reads_the_answers(miss: bool) -> None:
    """A model right everywhere scores 1 at every distance; one wrong only at each query's last
    value gets no pair exactly but 3 values in 4."""
    text = torch.randint(0, 128, (4, 1025), generator=torch.Generator().manual_seed(0))
    retrieval = tasks.make_batch(text, [True] * 4, 8, torch.Generator().manual_seed(1))
    passages = tasks.passage_rows(text, torch.Generator().manual_seed(2))
    model = _Perfect(retrieval, miss, passages.rows)
    evaluation = tasks.Evaluation(retrieval.rows, retrieval, passages)
    measured = tasks.measure(model, evaluation, torch.device("cpu"), 2, lambda: torch.no_grad())
    assert measured["retrieval_accuracy"] == (0.0 if miss else 1.0)
    assert measured["retrieval_value_accuracy"] == (0.75 if miss else 1.0)
    buckets = measured["retrieval_by_distance"]
    assert sum(b["pairs"] for b in buckets.values()) == 32
    assert list(buckets) == ["0-32", "32-64", "64-128", "128-256", "256-512", "512-1K"]
    assert all(b["value_accuracy"] in (None, 0.75 if miss else 1.0) for b in buckets.values())
    assert measured["bpb"] < 0.1 if not miss else measured["bpb"] > 0.1


def test_passages_repeat_earlier_text_at_their_distance() -> None:
    """Each copy is its source's bytes, ``distance`` before it, its source lies before the
    copies, every row's end is copies and the rest of the row is untouched."""
    text = torch.randint(0, 256, (3, 4097), generator=torch.Generator().manual_seed(3))
    passages = tasks.passage_rows(text, torch.Generator().manual_seed(4))
    length, skip, copies = tasks.passage_sizes(4096)
    assert (length, skip, copies, passages.scored) == (64, 8, 8, 56)
    first_copy = 4097 - copies * length
    assert torch.equal(passages.rows[:, :first_copy], text[:, :first_copy])
    assert passages.row.tolist() == [r for r in range(3) for _ in range(copies)]
    for r, copy, source, distance in zip(
        *(t.tolist() for t in (passages.row, passages.copy_start, passages.source_start,
                                passages.distance)),
        strict=True,
    ):  # fmt: skip
        copy, source = copy + 1 - skip, source + 1 - skip  # the passages' first bytes
        assert copy - source == distance and 0 <= source <= first_copy - length
        repeated = passages.rows[r, copy : copy + length]
        assert torch.equal(repeated, text[r, source : source + length])
    assert passages.distance.max() > 2048 and passages.distance.min() < 256  # log-uniform


class _Copier(nn.Module):
    """Certain of the scored bytes of every copy at most ``reach`` from its source, uniform
    over the vocabulary everywhere else."""

    def __init__(self, passages: tasks.Passages, reach: int) -> None:
        super().__init__()
        self.sure = {}
        for r, row in enumerate(passages.rows):
            sure = torch.full((row.numel() - 1,), -1)
            for i in (passages.row == r).nonzero().flatten().tolist():
                if passages.distance[i] <= reach:
                    span = passages.copy_start[i] + torch.arange(passages.scored)
                    sure[span] = row[span + 1]
            self.sure[tuple(row[:-1].tolist())] = sure

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, tasks.VOCAB_SIZE)
        for i, row in enumerate(tokens):
            sure = self.sure.get(tuple(row.tolist()), torch.full((row.numel(),), -1))
            logits[i][sure >= 0] = logits[i][sure >= 0].scatter(1, sure[sure >= 0, None], 60.0)
        return logits


def test_passage_bits_read_the_copies_by_distance() -> None:
    """A model that copies passages from at most 512 tokens back spends no bits on their
    scored bytes there and log2(V) bits further back and at every source."""
    text = torch.randint(0, 256, (4, 4097), generator=torch.Generator().manual_seed(5))
    passages = tasks.passage_rows(text, torch.Generator().manual_seed(6))
    retrieval = tasks.make_batch(text, [True] * 4, 8, torch.Generator().manual_seed(7))
    evaluation = tasks.Evaluation(text, retrieval, passages)
    measured = tasks.measure(
        _Copier(passages, 512), evaluation, torch.device("cpu"), 2, lambda: torch.no_grad()
    )
    uniform = math.log2(tasks.VOCAB_SIZE)
    buckets = measured["copy_by_distance"]
    assert sum(b["copies"] for b in buckets.values()) == passages.row.numel()
    assert list(buckets) == ["0-128", "128-256", "256-512", "512-1K", "1K-2K", "2K-4K"]
    for name, expected in zip(buckets, [0, 0, 0, uniform, uniform, uniform], strict=True):
        bucket = buckets[name]
        assert bucket["bpb"] == (None if not bucket["copies"] else pytest.approx(expected)), name
    assert buckets["256-512"]["copies"] and buckets["2K-4K"]["copies"]
    assert measured["copy_source_bpb"] == pytest.approx(uniform)
    near = (passages.distance <= 512).double().mean()
    assert measured["copy_bpb"] == pytest.approx(float(1 - near) * uniform)


def test_pair_counts() -> None:
    """Dense layers visit N (N + 1) / 2 pairs per head; a block pattern's count equals the
    pairs of its token mask (causal), the last block shorter."""
    _, s = bench_quality.parse_args(["--smoke", "--num-layers", "2", "--global-every", "2"])
    methods = bench_quality.available_methods()
    dense = bench_quality.model_config(methods["dense"], s)
    n = s.context
    assert bench_quality.attention_pairs(methods["dense"], dense, s) == 2 * 2 * n * (n + 1) // 2
    pattern = patterns.GlobalLocal(num_global=1, window=1) | patterns.DilatedBlocks((3,))
    blocks = pattern.block_mask(5, 5).repeat_interleave(16, 0).repeat_interleave(16, 1)
    tokens = blocks[:70, :70].tril()
    assert bench_quality._pattern_pairs(pattern, 70, 16) == int(tokens.sum())
    # Selected blocks: any min(topk, i) whole blocks before block i, and its own causally.
    chosen = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        chosen[i, i] = True
        chosen[i, torch.randperm(i)[: min(2, i)]] = True
    tokens = chosen.repeat_interleave(16, 0).repeat_interleave(16, 1)[:70, :70].tril()
    assert bench_quality._selected_pairs(70, 16, 2) == int(tokens.sum())
    # Compressed keys: windows [c d, c d + l) inside the row, seen once wholly at or before p.
    seen = sum(1 for p in range(70) for c in range(70) if c * 3 + 8 <= min(p + 1, 70))
    assert bench_quality._compressed_pairs(70, 8, 3) == seen


def test_the_demo_quotes_the_committed_record() -> None:
    """The demo's scale line names the range of held-out bits per byte that the committed H100
    record's methods reach (each method's mean over its seeds)."""
    from dilated_attention.demo import QUALITY_BPB

    record = json.loads((RESULTS / "quality_h100.json").read_text())
    means: dict[str, list[float]] = {}
    for row in record["results"]:
        means.setdefault(row["method"], []).append(row["bpb"])
    per_method = [sum(v) / len(v) for v in means.values()]
    assert len(per_method) == len(bench_quality.METHODS)
    low, high = QUALITY_BPB
    assert low <= min(per_method) < low + 0.1 and high - 0.1 < max(per_method) <= high
