"""FlexAttention kernel options for block-sparse attention: which are fastest on this GPU (CUDA).

    python benchmarks/tune_flex_block_sparse.py --out /tmp/tune_flex                # both phases
    python benchmarks/tune_flex_block_sparse.py --phase warm --out /tmp/tune_flex   # compile only
    python benchmarks/tune_flex_block_sparse.py --phase time --out /tmp/tune_flex   # time only

One shape (default N = 65536, H = 16, D = 128, bf16, a random 10% block mask of block 128, the
same mask as ``bench_block_sparse.py``), the library's ``BlockMask`` for it (``flex_block_mask``),
and compiled ``flex_attention`` with ``return_lse=True`` as block-sparse attention calls it, under
several ``kernel_options`` (see ``VARIANTS``), under ``torch.compile(mode="max-autotune-no-
cudagraphs")``, and dense cuDNN SDPA on the same shape. Forward (no grad) and forward+backward
median times with CUDA events.

Every variant runs in its own subprocess with a timeout, so a slow compile or autotune cannot eat
the run. ``--phase warm`` compiles all variants in parallel (filling Inductor's on-disk caches)
without timing them; ``--phase time`` then times them one at a time, each mostly a cache hit.
Writes ``OUT.json`` and ``OUT.md`` (OUT defaults to ``benchmarks/results/
tune_flex_block_sparse_<device>``, ``<device>`` as in ``_timing.host_label``); autotune choices
Inductor prints land in each variant's ``log_tail``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: name -> kernel_options (None: dense cuDNN; "autotune": max-autotune compile, default options;
#: "bnhd": default options on (B, N, H, D) tensors seen as (B, H, N, D) views, as the library
#: passes them; "ours": ``block_sparse_attention`` itself; "ours after 16K": the same after one
#: call at N = 16384, so that the 65536 call is a recompile, as in ``bench_block_sparse.py``).
VARIANTS: dict[str, Any] = {
    "dense cuDNN": None,
    "flex default": {},
    "flex default, BNHD views": "bnhd",
    "ours": "ours",
    "ours after 16K": "ours after 16K",
    "flex max-autotune": "autotune",
    "USE_TMA": {"USE_TMA": True},
    "fwd 128/64 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8,
                         "fwd_num_stages": 2},
    "fwd 128/128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8,
                          "fwd_num_stages": 2},
    "fwd 128/128 w8 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8,
                          "fwd_num_stages": 3},
    "fwd 128/64 w4 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4,
                         "fwd_num_stages": 3},
    "bwd 64/128/128/64 w8 s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd 64/64/64/64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                              "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 32/128/128/32 w4 s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                "bwd_BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/128/128/64 w8 s3 + TMA": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128,
                                      "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                                      "bwd_num_warps": 8, "bwd_num_stages": 3, "USE_TMA": True},
}  # fmt: skip


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, compile and (unless warming) time one variant in this process."""
    import torch
    import torch.nn.functional as F
    from _timing import time_cuda
    from bench_block_sparse import random_block_mask
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from dilated_attention.block_sparse.flex import flex_block_mask
    from dilated_attention.block_sparse.plan import num_blocks
    from dilated_attention.patterns import Custom

    options = VARIANTS[name]
    n, h, d = args.seq_len, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [
        torch.randn(1, h, n, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    ]
    dout = torch.randn_like(leaves[0])
    if options is None:

        def call() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*leaves)

    elif isinstance(options, str) and options.startswith("ours"):
        from dilated_attention import block_sparse_attention

        mask = random_block_mask(num_blocks(n, args.block_size), args.density)
        leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
        dout = dout.transpose(1, 2).contiguous()
        if options == "ours after 16K":
            small = [t[:, :16384].detach().requires_grad_() for t in leaves]
            pattern = Custom(random_block_mask(num_blocks(16384, args.block_size), args.density))
            out = block_sparse_attention(*small, pattern, block_size=args.block_size)
            torch.autograd.grad(out, small, dout[:, :16384])

        def call() -> torch.Tensor:
            return block_sparse_attention(*leaves, Custom(mask), block_size=args.block_size)

    else:
        mask = random_block_mask(num_blocks(n, args.block_size), args.density)
        block_mask, _ = flex_block_mask(
            Custom(mask), args.block_size, n, n, False, torch.device("cuda")
        )
        if options == "autotune":
            compiled = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
            kwargs: dict[str, Any] = {}
        else:
            compiled = torch.compile(flex_attention)
            kwargs = {"kernel_options": options} if isinstance(options, dict) and options else {}
        if options == "bnhd":
            leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in leaves]
            dout = dout.transpose(1, 2).contiguous()

        def call() -> torch.Tensor:
            views = [t.transpose(1, 2) for t in leaves] if options == "bnhd" else leaves
            out, _ = compiled(*views, block_mask=block_mask, return_lse=True, **kwargs)
            return out.transpose(1, 2) if options == "bnhd" else out

    def fwd() -> None:
        with torch.no_grad():
            call()

    def fwd_bwd() -> None:
        torch.autograd.grad(call(), leaves, dout)

    row: dict[str, Any] = {"variant": name, "kernel_options": options}
    if options is not None:
        row["density"] = float(mask.float().mean())
    start = time.perf_counter()
    fwd()
    fwd_bwd()
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - start
    if args.phase != "warm":
        for step, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            row[f"{step}_ms"] = time_cuda(fn, warmup=args.warmup, repeats=args.repeats)["median_ms"]
    return row


def _child_cmd(name: str, args: argparse.Namespace, phase: str) -> list[str]:
    return [
        sys.executable, __file__, "--child", name, "--phase", phase,
        "--seq-len", str(args.seq_len), "--heads", str(args.heads),
        "--head-dim", str(args.head_dim), "--density", str(args.density),
        "--block-size", str(args.block_size), "--warmup", str(args.warmup),
        "--repeats", str(args.repeats),
    ]  # fmt: skip


def _parse_child(name: str, proc: subprocess.CompletedProcess | None, note: str) -> dict:
    if proc is None:
        return {"variant": name, "error": note}
    lines = proc.stdout.strip().splitlines()
    log = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("RESULT ")]
    tail = [ln for ln in log if "AUTOTUNE" in ln or "BLOCK_" in ln or "Error" in ln][-40:]
    for line in reversed(lines):
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT ") :])
            if tail:
                row["log_tail"] = tail
            return row
    return {"variant": name, "error": f"rc {proc.returncode}", "log_tail": log[-40:]}


def warm(args: argparse.Namespace, names: list[str]) -> list[dict]:
    """Compile the variants at once (one process each), so the timing phase hits the caches;
    then the max-autotune one alone, so that its benchmarking shares the GPU with less."""
    tuned = [n for n in names if VARIANTS[n] == "autotune"]
    rows = _warm_group(args, [n for n in names if n not in tuned])
    return rows + _warm_group(args, tuned)


def _warm_group(args: argparse.Namespace, names: list[str]) -> list[dict]:
    procs = {
        name: subprocess.Popen(
            _child_cmd(name, args, "warm"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    }
    rows = []
    deadline = time.monotonic() + args.timeout
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            rows.append(_parse_child(name, done, ""))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append({"variant": name, "error": f"compile over {args.timeout:.0f} s"})
        print(rows[-1], flush=True)
    return rows


def time_all(args: argparse.Namespace, names: list[str]) -> list[dict]:
    rows = []
    deadline = time.monotonic() + args.budget
    for name in names:
        left = deadline - time.monotonic()
        if left < 5:
            rows.append({"variant": name, "error": "skipped: time budget spent"})
            continue
        try:
            proc = subprocess.run(
                _child_cmd(name, args, "time"), capture_output=True, text=True,
                timeout=min(args.timeout, left),
            )  # fmt: skip
            rows.append(_parse_child(name, proc, ""))
        except subprocess.TimeoutExpired:
            rows.append(_parse_child(name, None, f"over {min(args.timeout, left):.0f} s"))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--phase", choices=["warm", "time", "both"], default="both")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all timings")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="path without suffix (default: benchmarks/results/<benchmark>_<device>)",
    )  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(run_variant(args.child, args)), flush=True)
        return

    import torch
    from _timing import environment, markdown_table, record_header, record_path, write_record

    if not torch.cuda.is_available():
        raise SystemExit("tune_flex_block_sparse.py needs a CUDA device")
    rows: list[dict] = []
    if args.phase in ("warm", "both"):
        rows = warm(args, args.variants)
    if args.phase in ("time", "both"):
        rows = time_all(args, args.variants)
        dense = next((r for r in rows if r["variant"] == "dense cuDNN" and "fwd_ms" in r), None)
        default = next((r for r in rows if r["variant"] == "flex default" and "fwd_ms" in r), None)
        for row in rows:
            for step in ("fwd", "fwd_bwd"):
                if f"{step}_ms" not in row:
                    continue
                if dense is not None:
                    row[f"{step}_speedup_vs_dense"] = dense[f"{step}_ms"] / row[f"{step}_ms"]
                if default is not None:
                    row[f"{step}_vs_flex_default"] = default[f"{step}_ms"] / row[f"{step}_ms"]
    if args.out is None:
        warm_only = args.phase == "warm"
        path = record_path("tune_flex_block_sparse_warm" if warm_only else "tune_flex_block_sparse")
    else:
        path = args.out.with_name(args.out.name + ("_warm" if args.phase == "warm" else ""))
    env = {**environment(), "shape": vars(args) | {"out": str(path)}}
    cols = ["variant", "fwd_ms", "fwd_bwd_ms", "fwd_speedup_vs_dense", "fwd_bwd_speedup_vs_dense",
            "fwd_vs_flex_default", "fwd_bwd_vs_flex_default", "first_call_s", "error"]  # fmt: skip
    write_record(path.with_suffix(".json"), env, rows, columns=cols)
    table = record_header(env) + markdown_table(rows, cols)
    path.with_suffix(".md").write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
