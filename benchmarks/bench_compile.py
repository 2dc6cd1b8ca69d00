"""torch.compile on a stack of dilated layers: eager against the compiled modes, forward+backward.

    python benchmarks/bench_compile.py    # -> benchmarks/results/compile_<device>.{json,md}

A stack of ``--layers`` (4) ``MultiheadDilatedAttention(E, H, *longnet_schedule(N))`` layers
(E = 2048, H = 16, bf16, B = 1) with residuals, ``x = x + layer(x, is_causal=True)[0]``, at each
of ``--seq-lens`` (4K-64K). One step is a forward and backward of ``y.float().pow(2).mean()``,
the parameters' gradients set to None first. Paths, on the same module and input:

- ``eager``: the module as it is;
- ``compile``: ``torch.compile(m)``;
- ``compile fullgraph``: ``torch.compile(m, fullgraph=True)`` (a graph break is its error);
- ``reduce-overhead``: ``torch.compile(m, mode="reduce-overhead")`` (CUDA graphs through
  cudagraph trees; each step begins with ``torch.compiler.cudagraph_mark_step_begin()``).

Each path starts from ``torch._dynamo.reset()``, so none inherits the compiled code, the
recompile count or the CUDA-graph pools of the one before. Every row has ``fwd_bwd_ms`` (the
median of ``--repeats`` steps timed with CUDA events after ``--warmup``), ``fwd_bwd_host_ms``
(the host's share of a step: the wall time of the Python call, the synchronisation after it not
counted; ``_timing.timed_call``), ``first_step_s`` (the first step's wall time, its compile
included), ``vs_eager`` (eager's time over the path's: above 1 is faster), ``graph_breaks``
and ``cudagraph_skips`` (Dynamo's and Inductor's counts, compiled paths: a ``reduce-overhead``
graph that could not be captured runs without CUDA graphs), ``loss_rel_diff`` and
``grad_rel_diff`` (a step after the timed ones against eager's: the loss's relative difference
and the parameters' gradients' relative L2 distance), and ``fwd_bwd_peak_gib`` (the timed
steps' peak memory). A path that fails records ``error`` (its type and the first line of its
message, 300 characters at most) and the run goes on.

The record of the 4K-64K stack:

    python benchmarks/bench_compile.py --seq-lens 4096 8192 16384 32768 65536
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    environment,
    error_text,
    markdown_table,
    record_header,
    record_path,
    recover,
    time_cuda,
    write_record,
)

from dilated_attention import MultiheadDilatedAttention, longnet_schedule

GIB = 2**30
#: Each path: how it wraps the module, and whether its steps mark cudagraph-tree steps.
PATHS: dict[str, tuple[Callable[[nn.Module], Callable[..., Any]], bool]] = {
    "eager": (lambda m: m, False),
    "compile": (torch.compile, False),
    "compile fullgraph": (lambda m: torch.compile(m, fullgraph=True), False),
    "reduce-overhead": (lambda m: torch.compile(m, mode="reduce-overhead"), True),
}
COLUMNS = ["seq_len", "path", "fwd_bwd_ms", "fwd_bwd_host_ms", "vs_eager", "first_step_s",
           "graph_breaks", "cudagraph_skips", "loss_rel_diff", "grad_rel_diff", "fwd_bwd_peak_gib",
           "error"]  # fmt: skip


class Stack(nn.Module):
    """``layers`` dilated multihead layers on the LongNet schedule of ``seq_len``, with residuals.

    Shape: x (B, N, E) -> (B, N, E).
    """

    def __init__(self, layers: int, embed_dim: int, heads: int, seq_len: int, *,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        segments, rates = longnet_schedule(seq_len)
        self.layers = nn.ModuleList(
            MultiheadDilatedAttention(embed_dim, heads, segments, rates, device=device, dtype=dtype)
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, is_causal=True)[0]
        return x


def training_step(run: Callable[..., Any], model: nn.Module, x: torch.Tensor,
                  mark_step: bool) -> Callable[[], torch.Tensor]:  # fmt: skip
    """One forward+backward of ``run`` (``model``, maybe compiled) on ``x``, the parameters'
    gradients set to None first; returns the loss."""
    params = list(model.parameters())

    def step() -> torch.Tensor:
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        loss = run(x).float().pow(2).mean()
        loss.backward()
        return loss

    return step


def _compile_counts() -> dict[str, int]:
    """Dynamo's graph breaks and Inductor's CUDA-graph skips so far in this process (a
    ``reduce-overhead`` graph that could not be captured runs without CUDA graphs, and says so
    only in a log)."""
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}  # fmt: skip


def _snapshot(step: Callable[[], torch.Tensor], model: nn.Module) -> list[torch.Tensor]:
    """One more step: its loss and the parameters' gradients, copied (a replayed graph writes
    over its outputs at the next step), in float32."""
    loss = step().detach().float().clone().reshape(1)
    grads = [p.grad.detach().float().clone().flatten() if p.grad is not None
             else torch.zeros(p.numel(), device=p.device) for p in model.parameters()]  # fmt: skip
    return [loss, *grads]


def _rel_diffs(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    """``loss_rel_diff``: |loss - eager's| / |eager's|; ``grad_rel_diff``: the gradients'
    distance from eager's over the norm of eager's (all parameters as one vector)."""
    loss_diff = (got[0] - ref[0]).abs().item() / max(ref[0].abs().item(), 1e-30)
    num = math.sqrt(sum(float((g - r).pow(2).sum()) for g, r in zip(got[1:], ref[1:], strict=True)))
    den = math.sqrt(sum(float(r.pow(2).sum()) for r in ref[1:]))
    return {"loss_rel_diff": loss_diff, "grad_rel_diff": num / max(den, 1e-30)}


def measure_path(wrap: Callable[[nn.Module], Callable[..., Any]], mark_step: bool,
                 model: nn.Module, x: torch.Tensor, args: argparse.Namespace,
                 compiled: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:  # fmt: skip
    """One path's row entries and its checked step's loss and gradients. Starts from
    ``torch._dynamo.reset()``: no compiled code, recompile count or CUDA-graph pool of the path
    before (eager included: the pools hold memory)."""
    torch._dynamo.reset()
    before = _compile_counts()
    step = training_step(wrap(model), model, x, mark_step)
    cuda = x.device.type == "cuda"
    begin = time.perf_counter()
    step()  # the compile
    if cuda:
        torch.cuda.synchronize()
    row: dict[str, Any] = {"first_step_s": time.perf_counter() - begin}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timing = time_cuda(step, warmup=args.warmup, repeats=args.repeats, device=x.device)
    row["fwd_bwd_ms"], row["fwd_bwd_host_ms"] = timing["median_ms"], timing["host_ms"]
    if cuda:
        row["fwd_bwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    if compiled:
        row.update({key: count - before[key] for key, count in _compile_counts().items()})
    return row, _snapshot(step, model)


def measure_cell(model: nn.Module, x: torch.Tensor, paths: list[str], args: argparse.Namespace,
                 wraps: dict[str, tuple[Callable[..., Any], bool]] = PATHS,
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """Every path of ``paths`` (names in ``wraps``) on ``model`` and ``x`` (B, N, E), one row
    each; ``vs_eager`` and the differences where ``eager`` ran first of them and was measured."""
    seq_len = x.shape[1]
    rows, reference = [], None
    for name in paths:
        row: dict[str, Any] = {"seq_len": seq_len, "path": name, "layers": args.layers,
                               "embed_dim": args.embed_dim, "heads": args.heads}  # fmt: skip
        wrap, mark_step = wraps[name]
        try:
            entries, checked = measure_path(wrap, mark_step, model, x, args, name != "eager")
            row.update(entries)
            if name == "eager":
                reference = checked
            elif reference is not None:
                row.update(_rel_diffs(checked, reference))
        except Exception as exc:  # recorded in the row; the other paths go on
            row["error"] = error_text(exc)
        for p in model.parameters():
            p.grad = None
        if "error" in row:  # out of the handler: its traceback no longer holds the tensors
            recover()
        print(row, flush=True)
        rows.append(row)
    eager = next((r for r in rows if r["path"] == "eager" and "fwd_bwd_ms" in r), None)
    for row in rows:
        if eager is not None and "fwd_bwd_ms" in row:
            row["vs_eager"] = eager["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv`` when ``argv`` is None), checked before any work."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        default=[4096, 8192, 16384, 32768, 65536])  # fmt: skip
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed-dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS),
                        help="eager first: the others' vs_eager and differences need it")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args(argv)
    for name in ("layers", "embed_dim", "heads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")  # fmt: skip
    if args.warmup < 0 or args.embed_dim % args.heads:
        parser.error(f"--warmup must be at least 0 and --embed-dim a multiple of --heads, got "
                     f"{args.warmup}, {args.embed_dim} and {args.heads}")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py needs a CUDA device")
    rows = []
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    for seq_len in args.seq_lens:
        torch.manual_seed(0)
        try:
            model = Stack(args.layers, args.embed_dim, args.heads, seq_len, device=cuda,
                          dtype=dtype)  # fmt: skip
            x = torch.randn(1, seq_len, args.embed_dim, device=cuda, dtype=dtype)
        except Exception as exc:  # the stack does not fit: every path says so
            rows += [{"seq_len": seq_len, "path": name, "error": error_text(exc)}
                     for name in args.paths]  # fmt: skip
            continue
        rows += measure_cell(model, x, args.paths, args)
        del model, x
    env = environment()
    out = record_path("compile", args.out)
    write_record(out.with_suffix(".json"), env, rows, columns=COLUMNS)
    table = record_header(env) + markdown_table(rows, COLUMNS)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
