"""Quality at equal steps: which attention learns long-range structure.

Small byte-level LongNet language models (``LongNetLM``), identical except for their attention
layers, train from the same seed on the same token stream (the installed torch's Python source,
as the demo uses, with key-value retrieval rows mixed in) for the same number of steps. Each run
then measures, on held-out text and fresh retrieval rows, the same for every run:

- bits per byte, overall and by position in the context (buckets 0-N/32, N/32-N/8, N/8-N/2,
  N/2-N: at 32K, 0-1K, 1K-4K, 4K-16K, 16K-32K): whether a method uses distant context at all;
- retrieval accuracy against distance: key-value needles at log-uniform distances up to the
  full context, queried at the row's end (Note [Retrieval rows] in ``_quality_tasks.py``);
- bits per byte on repeated passages against distance: held-out text whose end repeats
  passages from log-uniform distances up to the full context (Note [Repeated passages]);

beside wall time, training time, peak memory (CUDA), tokens/s and TFLOP/s. The methods are the
rows of ``METHODS`` (``--help`` lists them): dense, a sliding window, windows with a dense layer
every few (Gemma 3), LongNet's dilated schedule, windows with dilated layers, static block-sparse,
MoBA- and NSA-style content-selected blocks.

TFLOP/s are model FLOPs over the timed training steps (each call's first two steps, which choose
and compile kernels, not timed): 6 FLOPs per weight of every matmul (projections, FFN, LM head)
per token, and 3.5 times 4 * D FLOPs per (query, key) pair each attention layer visits per head
(its forward, and a backward 2.5 times the forward, as the other benchmarks count it): exact pair
counts of each layer's schedule, window or block mask, causal (MoBA's and NSA's: the blocks they
keep, NSA's three branches summed; their selection and gates not counted).

Runs are resumable: each (method, seed, context) keeps a checkpoint (model, optimizer, step, RNG
states, times, losses) in ``--run-dir`` while it trains, saved every ``--checkpoint-every-s``, when
``--time-budget-s`` runs out and at ``--stop-after``; the same command again continues every
unfinished run and skips finished ones. Every finished run is merged into the record
(``benchmarks/results/quality_<device>.json``: one row per run) with the rows already there, and
its table (``.md``) and plots (``_bpb_by_position.png``, ``_retrieval.png``, ``_copy.png``)
rewritten.

    python benchmarks/bench_quality.py --smoke          # every method, tiny, CPU, < 1 minute
    python benchmarks/bench_quality.py --context 16384 --seeds 0 1 --time-budget-s 520
    python benchmarks/bench_quality.py --merge --out benchmarks/results/quality_h100  # redraw

``docs/quality.md`` says more.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _quality_report as report
import _quality_tasks as tasks
from _records import RESULTS_DIR
from _timing import command_line, host_label
from bench_dilated import schedule_pairs
from bench_windows import FWD_BWD_FACTOR, window_pairs

from dilated_attention import (
    BlockSelectedConfig,
    CompressedSelectedWindowConfig,
    create_block_sparse_attention,
    list_kinds,
    longnet_schedule,
    patterns,
    register_kind,
)
from dilated_attention.models import LongNetConfig, LongNetLM
from dilated_attention.models.training import (
    MIN_CORPUS_BYTES,
    load_corpus,
    reference_bits_per_byte,
    warmup_cosine,
)

BLOCK_SPARSE_KIND = "quality_block_sparse"


@dataclass(frozen=True)
class Settings:
    """Everything that shapes a run's result besides its method and seed (runs with other
    settings are other runs)."""

    context: int
    steps: int
    batch: int
    embed_dim: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    lr: float
    window: int
    global_every: int
    first_segment: int
    block_size: int
    pairs: int
    retrieval_fraction: float
    answer_weight: float
    eval_rows: int
    retrieval_eval_rows: int
    corpus_bytes: int
    dtype: str


@dataclass(frozen=True)
class Method:
    """One attention method: its name, a line saying what it is, and how its model's
    :class:`LongNetConfig` differs from the shared one (every layer dense causal attention).

    Args:
        name: the method's name in ``--methods`` and the record.
        about: what its attention layers are, in a line.
        config: the LongNetConfig fields that differ, for the run's settings.
        kind: a factory kind the method needs: the method is listed (``available_methods``)
            only where ``list_kinds()`` has it.
        pattern: for block-sparse global layers, their pattern (built through the kind
            ``BLOCK_SPARSE_KIND``; Note [Block-sparse layers in LongNetLM]).
    """

    name: str
    about: str
    config: Callable[[Settings], dict[str, Any]]
    kind: str | None = None
    pattern: Callable[[Settings], patterns.Pattern] | None = None


def _dilated(s: Settings) -> dict[str, Any]:
    segments, rates = longnet_schedule(s.context, s.first_segment)
    return {"segment_lengths": tuple(segments), "dilation_rates": tuple(rates)}


def _block_sparse_pattern(s: Settings) -> patterns.Pattern:
    """A local window of ``window`` tokens in blocks, the first block global, and every
    ``window / block_size``-th block before (Sparse Transformer's strided pattern)."""
    blocks = max(1, s.window // s.block_size)
    return patterns.GlobalLocal(num_global=1, window=blocks) | patterns.DilatedBlocks((blocks,))


def _moba(s: Settings) -> dict[str, Any]:
    """MoBA-style layers with a window's budget: blocks of ``window / 4`` tokens (at least
    ``block_size``), each query block its own and the 3 most affine before it (4 blocks: the
    ``window`` keys of the window methods)."""
    sparse = BlockSelectedConfig(block_size=max(s.block_size, s.window // 4), topk=3)
    return {"kind": "moba", "sparse": sparse}


def _nsa(s: Settings) -> dict[str, Any]:
    """NSA-style layers at the paper's sizes for the GPU defaults (block 128, window 2048):
    compressed windows of ``block / 4`` every ``block / 8``, 15 selected blocks of ``block /
    2`` besides the own, a sliding window of ``window / 4``, gated."""
    b = s.block_size
    sparse = CompressedSelectedWindowConfig(
        compress_block=max(1, b // 4), compress_stride=max(1, b // 8),
        select_block=max(1, b // 2), topk=15, window=max(1, s.window // 4),
    )  # fmt: skip
    return {"kind": "nsa", "sparse": sparse}


METHODS: tuple[Method, ...] = (
    Method("dense", "causal full attention in every layer", lambda s: {}),
    Method("window", "a sliding window of --window tokens in every layer",
           lambda s: {"local_window": s.window}),
    Method("window_global", "sliding windows, every --global-every-th layer dense (Gemma 3: 6)",
           lambda s: {"local_window": s.window, "global_every": s.global_every}),
    Method("dilated", "LongNet's schedule (longnet_schedule from --first-segment) in every layer",
           _dilated),
    Method("window_dilated", "sliding windows, every --global-every-th layer LongNet's schedule",
           lambda s: {"local_window": s.window, "global_every": s.global_every, **_dilated(s)}),
    Method("block_sparse", "static blocks: a --window local band, block 0 global, every "
           "(window / block)-th block before (Sparse Transformer)",
           lambda s: {"kind": BLOCK_SPARSE_KIND}, pattern=_block_sparse_pattern),
    Method("moba", "MoBA-style: blocks of window/4, each query block its own and the 3 of "
           "highest mean-key affinity (window's keys)", _moba, kind="moba"),
    Method("nsa", "NSA-style: compressed keys, 15 selected blocks of block/2, a window/4 "
           "window, gated (NSA's sizes at the defaults)", _nsa, kind="nsa"),
)  # fmt: skip


def available_methods(kinds: list[str] | None = None) -> dict[str, Method]:
    """The methods of ``METHODS`` that can run here, by name: those without a ``kind`` and
    those whose kind is in ``kinds`` (default ``list_kinds()``)."""
    kinds = list_kinds() if kinds is None else kinds
    return {m.name: m for m in METHODS if m.kind is None or m.kind in kinds}


# Note [Block-sparse layers in LongNetLM]
#     LongNetLM hands every global layer's kind the dilated schedule; the block-sparse kind takes
#     a pattern instead. The benchmark registers a kind of its own (the factory's public
#     extension point) that drops the schedule and builds the library's block-sparse multihead
#     layer with the method's pattern, so the model is otherwise the same LongNetLM.
def _register_block_sparse(pattern: patterns.Pattern, block_size: int) -> None:
    def build(**params: Any) -> torch.nn.Module:
        for name in ("segment_lengths", "dilation_rates"):
            params.pop(name, None)
        if params.pop("dropout", 0.0):
            raise ValueError("the block-sparse layers take no attention dropout; pass dropout=0")
        return create_block_sparse_attention(
            pattern, block_size=block_size, kind="block_sparse", **params
        )

    register_kind(BLOCK_SPARSE_KIND, dilated=build, multihead=build)


def model_config(method: Method, s: Settings) -> LongNetConfig:
    """The method's model: the shared configuration with the method's fields."""
    base = dict(
        vocab_size=tasks.VOCAB_SIZE,
        embed_dim=s.embed_dim,
        num_heads=s.num_heads,
        num_layers=s.num_layers,
        ffn_dim=s.ffn_dim,
        segment_lengths=(s.context,),
        dilation_rates=(1,),
    )
    if method.pattern is not None:
        _register_block_sparse(method.pattern(s), s.block_size)
    return LongNetConfig(**{**base, **method.config(s)})


def _pattern_pairs(pattern: patterns.Pattern, n: int, block: int) -> int:
    """Causal (query, key) pairs of a block pattern over ``n`` tokens (the last block shorter)."""
    count = -(-n // block)
    size = torch.full((count,), block, dtype=torch.float64)
    size[-1] = n - block * (count - 1)
    mask = pattern.block_mask(count, count).tril(-1).double()
    diagonal = pattern.block_mask(count, count).diagonal().double()
    return int(size @ mask @ size + (diagonal * size * (size + 1) / 2).sum())


def _selected_pairs(n: int, block: int, topk: int) -> int:
    """Causal pairs of content-selected blocks: each query block its own block (causal) and
    ``min(topk, blocks before it)`` whole blocks, whichever they are."""
    count = -(-n // block)
    sizes = [block] * (count - 1) + [n - block * (count - 1)]
    return sum(min(topk, i) * block * m + m * (m + 1) // 2 for i, m in enumerate(sizes))


def _compressed_pairs(n: int, block: int, stride: int) -> int:
    """Pairs of NSA's compressed branch: position ``p`` sees the windows ``[c d, c d + l)``
    with ``c d + l - 1 <= p``."""
    if n < block:
        return 0
    return int(((torch.arange(n - block + 1) // stride) + 1).sum())


def _layer_pairs(method: Method, config: LongNetConfig, s: Settings) -> int | None:
    """(query, key) pairs of one global layer per row, summed over heads; None for a kind
    without a count here."""
    n, heads, sparse = s.context, config.num_heads, config.sparse
    if method.pattern is not None:
        return heads * _pattern_pairs(method.pattern(s), n, s.block_size)
    if isinstance(sparse, BlockSelectedConfig):
        return heads * _selected_pairs(n, sparse.block_size, sparse.topk)
    if isinstance(sparse, CompressedSelectedWindowConfig):
        compressed = _compressed_pairs(n, sparse.compress_block, sparse.compress_stride)
        selected = _selected_pairs(n, sparse.select_block, sparse.topk)
        return heads * (compressed + selected + window_pairs(n, sparse.window))
    if config.kind in ("auto", "dilated"):
        return schedule_pairs(n, heads, config.segment_lengths, config.dilation_rates, True)
    return None


def attention_pairs(method: Method, config: LongNetConfig, s: Settings) -> int | None:
    """(query, key) pairs a row's attention visits, summed over layers and heads; None for a
    layer kind without a count here."""
    glob = _layer_pairs(method, config, s)
    local = config.num_heads * window_pairs(s.context, config.local_window)
    layers = [config.is_global(i) for i in range(config.num_layers)]
    if glob is None and any(layers):
        return None
    return sum(glob if is_global else local for is_global in layers)


def step_flops(model: LongNetLM, pairs: int | None, s: Settings) -> float | None:
    """Model FLOPs of one training step (see the module docstring)."""
    if pairs is None:
        return None
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = s.embed_dim // s.num_heads
    per_row = 6.0 * weights * s.context + FWD_BWD_FACTOR * 4.0 * head_dim * pairs
    return per_row * s.batch


# -- one run: train (resumable), measure, write its result ----------------------------------------
@dataclass
class Progress:
    """What a run has done so far; saved in its checkpoint."""

    step: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    train_seconds: float = 0.0
    timed_seconds: float = 0.0
    timed_steps: int = 0
    wall_seconds: float = 0.0
    peak_bytes: int = 0
    commands: list[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """One (method, seed) run of the settings, kept in ``directory``."""

    method: Method
    seed: int
    settings: Settings
    directory: Path

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.method.name, self.seed, self.settings.context)

    @property
    def checkpoint(self) -> Path:
        return self.directory / "checkpoint.pt"


def _autocast(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext


def _save(run: Run, model: LongNetLM, optimizer: torch.optim.Optimizer, state: Progress) -> None:
    """The run's checkpoint, written whole or not at all (a temporary file renamed)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    payload = {
        "settings": dataclasses.asdict(run.settings),
        "method": run.method.name,
        "seed": run.seed,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "progress": dataclasses.asdict(state),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if cuda else [],
    }
    run.directory.mkdir(parents=True, exist_ok=True)
    partial = run.checkpoint.with_suffix(".partial")
    torch.save(payload, partial)
    partial.replace(run.checkpoint)


def _note_peak(state: Progress, device: torch.device) -> None:
    """Keep the device's peak memory of this call in the run's progress (CUDA only)."""
    if device.type == "cuda":
        state.peak_bytes = max(state.peak_bytes, torch.cuda.max_memory_allocated(device))


def _resume(run: Run, model: LongNetLM, optimizer: torch.optim.Optimizer) -> Progress:
    """The run's progress from its checkpoint (model, optimizer and RNG states restored), or a
    fresh start without one."""
    if not run.checkpoint.exists():
        return Progress()
    payload = torch.load(run.checkpoint, map_location="cpu", weights_only=True)
    if payload["settings"] != dataclasses.asdict(run.settings):
        changed = sorted(
            k
            for k, v in payload["settings"].items()
            if dataclasses.asdict(run.settings).get(k) != v
        )
        raise ValueError(
            f"{run.checkpoint} was saved with other settings ({changed}); continue it with the "
            f"flags it was started with, or pass another --run-dir (or delete that directory) "
            f"to start over"
        )
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["rng_cpu"])
    if payload["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng_cuda"])
    return Progress(**payload["progress"])


@dataclass
class Limits:
    """When a call stops training a run: ``deadline`` (``time.perf_counter()`` seconds) less the
    time the evaluation and a checkpoint need, ``stop_after`` steps, and how often it saves."""

    deadline: float | None = None
    stop_after: int | None = None
    checkpoint_every_s: float = 120.0
    progress: bool = True
    #: Set when the deadline stopped a run: no further run starts in this call.
    expired: bool = False


def _reserve(s: Settings, step_seconds: list[float]) -> float:
    """Seconds to keep for the evaluation (its forward passes at a third of a training step's
    time per row, doubled) and a checkpoint, once a step's time is known."""
    if not step_seconds:
        return 30.0
    per_row = sorted(step_seconds)[len(step_seconds) // 2] / s.batch / 3
    return 15.0 + 2 * per_row * (s.eval_rows + 2 * s.retrieval_eval_rows)  # needles, passages


def _train(
    run: Run,
    model: LongNetLM,
    optimizer: torch.optim.Optimizer,
    state: Progress,
    train: torch.Tensor,
    device: torch.device,
    limits: Limits,
) -> bool:
    """Train until the run's last step (True) or a limit (False, checkpoint saved)."""
    s, autocast = run.settings, _autocast(device)
    mark = last_save = time.perf_counter()
    first, seconds = state.step, []
    bar = tqdm(
        total=s.steps,
        initial=state.step,
        desc=f"{run.method.name} seed {run.seed}",
        unit="step",
        disable=not limits.progress,
        leave=False,
    )
    with bar:
        while state.step < s.steps:
            now = time.perf_counter()
            late = limits.deadline is not None and now + _reserve(s, seconds) > limits.deadline
            if late or (limits.stop_after is not None and state.step >= limits.stop_after):
                limits.expired = limits.expired or late
                state.wall_seconds += now - mark
                _note_peak(state, device)
                _save(run, model, optimizer, state)
                return False
            batch = tasks.training_batch(
                train,
                state.step,
                seed=run.seed,
                batch=s.batch,
                context=s.context,
                pairs=s.pairs,
                fraction=s.retrieval_fraction,
            )
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(state.step / s.steps, s.lr)
            begin = time.perf_counter()
            with autocast():
                logits = model(batch.rows[:, :-1].to(device))
            loss, lm = tasks.loss_terms(logits, batch, s.answer_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            state.losses.append(lm.item())  # waits for the step: the time below is its own
            elapsed = time.perf_counter() - begin
            state.train_seconds += elapsed
            if state.step - first >= 2:  # each call's first steps choose and compile kernels
                state.timed_seconds += elapsed
                state.timed_steps += 1
                seconds.append(elapsed)
            state.step += 1
            bar.update()
            bar.set_postfix(
                loss=f"{state.losses[-1]:.3f}", tok_s=f"{s.batch * s.context / elapsed:,.0f}"
            )
            if time.perf_counter() - last_save > limits.checkpoint_every_s:
                state.wall_seconds += time.perf_counter() - mark
                mark = last_save = time.perf_counter()
                _note_peak(state, device)
                _save(run, model, optimizer, state)
    state.wall_seconds += time.perf_counter() - mark
    return True


def _loss_summary(losses: list[float]) -> dict[str, Any]:
    """The mean loss of the first and of the last tenth of the steps (1 to 20 steps each), and
    the curve as at most 64 means of consecutive steps ``[[last step, loss], ...]``."""
    k = max(1, min(20, len(losses) // 10))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    width = max(1, math.ceil(len(losses) / 64))
    curve = [
        [min(i + width, len(losses)), sum(losses[i : i + width]) / len(losses[i : i + width])]
        for i in range(0, len(losses), width)
    ]
    return {"loss_first": first, "loss_last": last, "loss_fell": last < first, "loss_curve": curve}


def describe(config: LongNetConfig, method: Method, s: Settings) -> str:
    """The attention of a model in a line: each layer kind and its shape."""
    local = [i for i in range(config.num_layers) if not config.is_global(i)]
    if method.pattern is not None:
        glob = f"block-sparse {method.pattern(s)!r}, block {s.block_size}"
    elif config.sparse is not None:
        glob = f"{config.kind} {config.sparse!r}"
    else:
        glob = (
            f"segments {list(config.segment_lengths)} rates {list(config.dilation_rates)}"
            f"{'' if config.kind == 'auto' else f' kind {config.kind}'}"
        )
    if not local:
        return f"{config.num_layers} x {glob}"
    if len(local) == config.num_layers:
        return f"{config.num_layers} x window {config.local_window}"
    n = config.num_layers - len(local)
    return f"{len(local)} x window {config.local_window}, {n} x {glob}"


def run_one(
    run: Run,
    train: torch.Tensor,
    evaluation: tasks.Evaluation,
    device: torch.device,
    limits: Limits,
) -> dict[str, Any] | None:
    """Train (or continue) one run and measure it: its record row, or None when a limit
    stopped it first (its checkpoint then holds its progress)."""
    s, call = run.settings, time.perf_counter()
    torch.manual_seed(run.seed)
    config = model_config(run.method, s)
    model = LongNetLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = _resume(run, model, optimizer)
    state.commands.append(command_line())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    state.wall_seconds += time.perf_counter() - call
    if not _train(run, model, optimizer, state, train, device, limits):
        return None
    begin = time.perf_counter()
    measured = tasks.measure(model, evaluation, device, s.batch, _autocast(device))
    eval_seconds = time.perf_counter() - begin
    _note_peak(state, device)
    pairs = attention_pairs(run.method, config, s)
    flops = step_flops(model, pairs, s)
    timed = state.timed_seconds if state.timed_steps else None
    row: dict[str, Any] = {
        "method": run.method.name,
        "seed": run.seed,
        "context": s.context,
        "steps": state.step,
        "attention": describe(config, run.method, s),
        "parameters": model.num_parameters(),
        **measured,
        "bpb_far": list(measured["bpb_by_position"].values())[-1],
        "retrieval_far": list(measured["retrieval_by_distance"].values())[-1]["accuracy"],
        "copy_bpb_far": list(measured["copy_by_distance"].values())[-1]["bpb"],
        "tokens_per_s": None if timed is None else state.timed_steps * s.batch * s.context / timed,
        "tflops": None if None in (flops, timed) else state.timed_steps * flops / timed / 1e12,
        "train_seconds": state.train_seconds,
        "eval_seconds": eval_seconds,
        "wall_seconds": state.wall_seconds + time.perf_counter() - begin,
        "peak_memory_gib": state.peak_bytes / 2**30 if device.type == "cuda" else None,
        "step_flops": flops,
        "attention_pairs": pairs,
        "calls": len(state.commands),
        **_loss_summary(state.losses),
        "settings": dataclasses.asdict(s),
    }
    report.write_result(run.directory, row, state.commands, state.losses)
    run.checkpoint.unlink(missing_ok=True)
    return row


# -- the command line ------------------------------------------------------------------------------
#: Defaults of the GPU runs and of ``--smoke`` (tiny, CPU, every method in under a minute).
DEFAULTS: dict[str, Any] = dict(
    context=16384, steps=600, batch=None, embed_dim=512, num_heads=8, num_layers=6, ffn_dim=2048,
    lr=1e-3, window=2048, global_every=6, first_segment=2048, block_size=128, pairs=48,
    retrieval_fraction=0.5, answer_weight=1.0, eval_rows=32, retrieval_eval_rows=64,
    corpus_bytes=64 << 20,
)  # fmt: skip
SMOKE: dict[str, Any] = dict(
    context=128, steps=24, batch=4, embed_dim=32, num_heads=2, num_layers=3, ffn_dim=128,
    lr=5e-3, window=32, global_every=3, first_segment=32, block_size=16, pairs=2,
    retrieval_fraction=0.25, answer_weight=1.0, eval_rows=4, retrieval_eval_rows=8,
    corpus_bytes=1 << 20,
)  # fmt: skip
#: The fraction by which --smoke requires each method's training loss to fall (the mean of the
#: last tenth of the steps against the first tenth's).
SMOKE_FALL = 0.05
SMOKE_DIR = Path("outputs/quality_smoke")
#: A run starts only with this many seconds of the call's budget left (a model's first steps may
#: compile kernels for tens of seconds).
START_S = 90.0
_HELP = {
    "context": "tokens per row (the attention's sequence length)",
    "steps": "optimizer steps of every run (the LR schedule spans them)",
    "batch": "rows per step",
    "embed_dim": "model width",
    "num_heads": "attention heads",
    "num_layers": "layers",
    "ffn_dim": "FFN width",
    "lr": "peak learning rate (AdamW, 5%% warm-up, cosine)",
    "window": "sliding window (tokens) of the window methods and block_sparse's band",
    "global_every": "window_global / window_dilated: every k-th layer global",
    "first_segment": "first segment of longnet_schedule (dilated methods)",
    "block_size": "block_sparse's block (tokens)",
    "pairs": "key-value pairs per retrieval row",
    "retrieval_fraction": "fraction of the training rows that are retrieval rows",
    "answer_weight": "weight of the mean loss on the queries' values, added to the LM loss",
    "eval_rows": "held-out text rows for bits per byte",
    "retrieval_eval_rows": "fresh retrieval rows for accuracy by distance",
    "corpus_bytes": "bytes of torch's Python source to read (train + held out)",
}


def _parser(methods: dict[str, Method]) -> argparse.ArgumentParser:
    listing = "\n".join(f"  {m.name:15s} {m.about}" for m in methods.values())
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods:\n{listing}",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models, short context, on the CPU: every method in under a "
        "minute; exits nonzero if a method's training loss does not fall",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(methods),
        default=list(methods),
        metavar="METHOD",
        help=f"methods to run (listed below; default all): {', '.join(methods)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed")
    for name, help_text in _HELP.items():
        kind = float if name in ("lr", "retrieval_fraction", "answer_weight") else int
        gpu = "65536 // context" if DEFAULTS[name] is None else DEFAULTS[name]
        shown = f"{help_text} (GPU default {gpu}, --smoke {SMOKE[name]})"
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=shown)
    parser.add_argument(
        "--device", default=None, help="default: cuda when available (cpu with --smoke)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="checkpoints and results of the runs (default outputs/quality, "
        "with --smoke a fresh outputs/quality_smoke/runs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="record path without suffix (default benchmarks/results/"
        "quality_<device>; with --smoke outputs/quality_smoke/quality_<device>)",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="stop this call after this many seconds (0: no limit), "
        "checkpointing the run in progress; the same command continues it",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="stop each run at this step, as if interrupted",
    )
    parser.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=120.0,
        help="save the run in progress this often",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="train nothing: merge the finished runs into the record and "
        "redraw its table and plots",
    )
    parser.add_argument(
        "--require-loss-fall",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="exit nonzero if a run's loss did not fall by "
        f"{SMOKE_FALL * 100:.0f}%% (default: with --smoke)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error for every flag out of range, before any work."""
    for name in (
        "context",
        "steps",
        "batch",
        "embed_dim",
        "num_heads",
        "num_layers",
        "ffn_dim",
        "window",
        "global_every",
        "first_segment",
        "block_size",
        "pairs",
        "eval_rows",
        "retrieval_eval_rows",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        parser.error(
            f"--corpus-bytes must be >= {MIN_CORPUS_BYTES} (1 MiB), got {args.corpus_bytes}"
        )
    if not args.checkpoint_every_s > 0:
        parser.error(f"--checkpoint-every-s must be > 0, got {args.checkpoint_every_s}")
    if not 0 <= args.retrieval_fraction <= 1 or not args.answer_weight >= 0:
        parser.error(
            f"--retrieval-fraction must be in [0, 1] and --answer-weight >= 0, got "
            f"{args.retrieval_fraction} and {args.answer_weight}"
        )
    if args.pairs > tasks.MAX_PAIRS:
        parser.error(
            f"--pairs must be <= {tasks.MAX_PAIRS} (each pair takes "
            f"{tasks.PAIR_LEN} of the {tasks.SYMBOLS} symbols), got {args.pairs}"
        )
    if args.context < tasks.min_context(args.pairs):
        parser.error(
            f"--context {args.context} is too short for --pairs {args.pairs} (at "
            f"least {tasks.min_context(args.pairs)}); raise it or lower --pairs"
        )
    if args.embed_dim % args.num_heads or (args.embed_dim // args.num_heads) % 2:
        parser.error(
            f"--embed-dim ({args.embed_dim}) must be --num-heads ({args.num_heads}) "
            f"times an even head dim"
        )
    if args.global_every > args.num_layers or args.window > args.context:
        parser.error(
            f"--global-every ({args.global_every}) must be <= --num-layers "
            f"({args.num_layers}) and --window ({args.window}) <= --context "
            f"({args.context})"
        )
    if args.time_budget_s < 0 or (args.stop_after is not None and args.stop_after < 1):
        parser.error(
            f"--time-budget-s must be >= 0 and --stop-after >= 1, got "
            f"{args.time_budget_s} and {args.stop_after}"
        )


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    """The command line (``sys.argv`` when None) with its defaults filled in, and the runs'
    settings; usage errors before any work."""
    parser = _parser(available_methods())
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.batch is None:
        args.batch = max(1, 65536 // args.context)
    _check(parser, args)
    try:
        args.device = torch.device(
            args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        )
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; pass --device cpu")
    if args.require_loss_fall is None:
        args.require_loss_fall = args.smoke
    settings = Settings(
        **{
            f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if f.name != "dtype"
        },
        dtype="bfloat16" if args.device.type == "cuda" else "float32",
    )
    return args, settings


def _notes(held_out: torch.Tensor, s: Settings) -> str:
    """What the record measures, in a paragraph, with the held-out text's simple references."""
    scale = reference_bits_per_byte(held_out)
    length, skip, copies = tasks.passage_sizes(s.context)
    return (
        f"Byte-level LongNetLM models identical except for their attention (width {s.embed_dim}, "
        f"{s.num_layers} layers, {s.num_heads} heads), the same seed's token stream for every "
        f"method, {s.steps} steps of {s.batch} x {s.context} tokens, "
        f"{s.retrieval_fraction:.0%} of the rows retrieval rows ({s.pairs} key-value pairs "
        f"each). bpb: held-out bits per byte ({s.eval_rows} rows), bpb_far in the last "
        f"position bucket; retrieval_accuracy: exact match of the values of "
        f"{s.retrieval_eval_rows * s.pairs} fresh pairs, retrieval_far at the longest "
        f"distances; copy_bpb: bits per byte on {s.retrieval_eval_rows * copies} passages of "
        f"{length} bytes repeated in held-out text (the {length - skip} after their first {skip}), "
        f"copy_bpb_far at the longest distances, copy_source_bpb on the same bytes at their "
        f"source. For scale, on this held-out text byte frequencies alone give "
        f"{scale['unigram']:.2f} bits per byte and gzip -9 {scale['gzip']:.2f}."
    )


def _default_out(args: argparse.Namespace, label: str) -> Path:
    base = SMOKE_DIR if args.smoke else RESULTS_DIR
    return (args.out or base / f"quality_{label}").with_suffix(".json")


def _check_losses(rows: list[dict[str, Any]]) -> None:
    """SystemExit naming every run whose loss did not fall by ``SMOKE_FALL``."""
    flat = [
        f"{r['method']} seed {r['seed']}: {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
        for r in rows
        if not r["loss_last"] < (1 - SMOKE_FALL) * r["loss_first"]
    ]
    if flat:
        raise SystemExit(f"training loss did not fall by {SMOKE_FALL:.0%}: " + "; ".join(flat))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run (or continue) every requested run, merging each finished one into the record.

    Returns:
        The record as written, or None when this call finished no run.

    Raises:
        SystemExit: a usage error; with ``--require-loss-fall`` (``--smoke``), a run whose
            training loss did not fall.
    """
    args, s = parse_args(argv)
    run_dir = args.run_dir or (SMOKE_DIR / "runs" if args.smoke else Path("outputs/quality"))
    if args.smoke and args.run_dir is None and not args.merge:  # a smoke run starts afresh
        shutil.rmtree(SMOKE_DIR, ignore_errors=True)
    out = _default_out(args, host_label())
    if args.merge:
        record = report.merge(out, run_dir, order=list(available_methods()))
        print(f"nothing to merge into {out}" if record is None else f"wrote {out}")
        return record
    threads = torch.get_num_threads()
    if args.smoke and args.device.type == "cpu":
        # The tiny models' many small ops: one intra-op thread is fastest, and far faster when
        # other processes share the cores (idle threads spin at every op's barrier).
        torch.set_num_threads(1)
    try:
        rows, record = run_all(args, s, run_dir, out)
    finally:
        torch.set_num_threads(threads)
    if args.require_loss_fall:
        _check_losses(rows)
    return record


def run_all(
    args: argparse.Namespace, s: Settings, run_dir: Path, out: Path
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every run of ``args.methods`` x ``args.seeds`` not finished before (seed by seed, so a
    time budget that runs out leaves whole seeds); the rows finished by this call and the
    record."""
    start = time.perf_counter()
    methods = available_methods()
    train, held_out = load_corpus(s.corpus_bytes)
    if min(train.numel(), held_out.numel()) <= s.context + 1:
        raise SystemExit(
            f"--corpus-bytes {s.corpus_bytes} reads too little held-out text for rows of "
            f"--context {s.context}; raise --corpus-bytes"
        )
    evaluation = tasks.evaluation_rows(
        held_out, context=s.context, text_rows=s.eval_rows,
        retrieval_rows=s.retrieval_eval_rows, pairs=s.pairs,
    )  # fmt: skip
    notes = _notes(held_out, s)
    done = report.finished(report.collect(out, run_dir)[0], dataclasses.asdict(s))
    limits = Limits(
        deadline=start + args.time_budget_s if args.time_budget_s else None,
        stop_after=args.stop_after, checkpoint_every_s=args.checkpoint_every_s,
        progress=not args.no_progress,
    )  # fmt: skip
    rows, waiting, record = [], [], None
    for seed in args.seeds:
        for name in args.methods:
            run = Run(methods[name], seed, s, run_dir / f"ctx{s.context}" / f"{name}_seed{seed}")
            if run.key in done:
                print(f"{name} seed {seed}: finished before, skipped")
                continue
            near = limits.deadline is not None and time.perf_counter() > limits.deadline - START_S
            if near or limits.expired:  # too little time left to start it
                waiting.append(f"{name} seed {seed}")
                continue
            row = run_one(run, train, evaluation, args.device, limits)
            if row is None:
                waiting.append(f"{name} seed {seed}")
                continue
            rows.append(row)
            print(
                f"{name} seed {seed}: bpb {row['bpb']:.3f}, retrieval "
                f"{row['retrieval_accuracy']:.2f}, {row['train_seconds']:.0f} s training"
            )
            # Every finished run goes into the record at once: a kill later keeps it.
            record = report.merge(out, run_dir, notes, plots=False, order=list(methods))
    if waiting:
        print(
            f"unfinished (checkpointed in {run_dir}): {', '.join(waiting)}; run the same "
            f"command again to continue"
        )
    if record is not None:
        report.plot(record, out.with_suffix(""))
        print(f"record: {out} (+ .md, _bpb_by_position.png, _retrieval.png, _copy.png)")
    return rows, record


if __name__ == "__main__":
    main()
