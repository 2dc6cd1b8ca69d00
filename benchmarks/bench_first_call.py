"""First-call latency: how long the first ``dilated_attention`` forward+backward of a new shape
family takes in a fresh process, and a new sequence length of a family already run.

Each case runs in child processes so that nothing is warm:

- ``cold``: a new process with an empty Triton cache directory (what a user meets first);
- ``disk``: a second new process sharing that cache directory (compiled kernels on disk);
- in each child, after the first call: the same call again (``again``) and a call at a new
  sequence length of the same family (``new_length``).

Every Triton compile in a child is recorded (kernel, seconds) through Triton's JIT hooks, so a
record says how many compiles each step needed. Times are wall-clock seconds around a
synchronized forward+backward.

    python benchmarks/bench_first_call.py --json benchmarks/results/first_call_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import environment, markdown_table, write_record

#: (name, dtype, seq_len, heads, head_dim, segment_lengths, dilation_rates, causal, new_len)
CASES: dict[str, dict[str, Any]] = {
    "float32, 4 branches": dict(
        dtype="float32", seq_len=4096, heads=8, head_dim=64, segments=[512, 1024, 2048, 4096],
        rates=[1, 2, 4, 8], causal=True, new_len=8192,
    ),
    "bfloat16, 4 branches": dict(
        dtype="bfloat16", seq_len=4096, heads=8, head_dim=64, segments=[512, 1024, 2048, 4096],
        rates=[1, 2, 4, 8], causal=True, new_len=8192,
    ),
    "bfloat16, 4 branches, odd new length": dict(
        dtype="bfloat16", seq_len=4096, heads=8, head_dim=64, segments=[512, 1024, 2048, 4096],
        rates=[1, 2, 4, 8], causal=True, new_len=5001,
    ),
    "bfloat16, LongNet 64K, D=128": dict(
        dtype="bfloat16", seq_len=65536, heads=16, head_dim=128, segments=None, rates=None,
        causal=True, new_len=131072,
    ),
}  # fmt: skip


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: time the first call, the same call again and a new length."""
    start = time.perf_counter()
    import torch

    import dilated_attention as da

    compiles: list[dict[str, Any]] = []
    pending: dict[str, float] = {}
    try:
        from triton import knobs

        def before(**kwargs: Any) -> bool:
            pending[str(kwargs["key"])] = time.perf_counter()
            return False

        def after(**kwargs: Any) -> None:
            began = pending.pop(str(kwargs["key"]), time.perf_counter())
            name = getattr(kwargs.get("fn"), "name", "?")
            compiles.append({"kernel": name, "seconds": time.perf_counter() - began})

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after
    except (ImportError, AttributeError):
        pass
    import_s = time.perf_counter() - start
    import logging

    messages: list[str] = []  # the library's log lines, e.g. how long the compiles took
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(  # type: ignore[method-assign]
        f"{time.perf_counter() - start:7.2f} s  {record.getMessage()}"
    )
    logger = logging.getLogger("dilated_attention")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)

    dtype = getattr(torch, spec["dtype"])
    device = torch.device("cuda")

    def schedule(n: int) -> tuple[list[int], list[int]]:
        if spec["segments"] is not None:
            return spec["segments"], spec["rates"]
        return da.longnet_schedule(spec["seq_len"])

    def call(n: int) -> dict[str, Any]:
        shape = (1, n, spec["heads"], spec["head_dim"])
        q, k, v = (
            torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
        )
        segments, rates = schedule(n)
        before_count = len(compiles)
        torch.cuda.synchronize()
        began = time.perf_counter()
        out = da.dilated_attention(q, k, v, segments, rates, is_causal=spec["causal"])
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        new = compiles[before_count:]
        return {
            "seconds": time.perf_counter() - began,
            "compiles": len(new),
            "compile_seconds": sum(c["seconds"] for c in new),
            "kernels": new,
        }

    if spec.get("profile"):
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        first = profiler.runcall(call, spec["seq_len"])
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        first["profile"] = text.getvalue()
    else:
        first = call(spec["seq_len"])
    again = call(spec["seq_len"])
    new_length = call(spec["new_len"])
    return {
        "import_s": import_s, "first": first, "again": again, "new_length": new_length,
        "log": messages,
    }  # fmt: skip


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a child's result, as flat fields (the results README shows
    these)."""
    if "error" in result:
        return {}
    return {
        "first s": round(result["first"]["seconds"], 3),
        "first compiles": result["first"]["compiles"],
        "again s": round(result["again"]["seconds"], 4),
        "new length s": round(result["new_length"]["seconds"], 4),
        "new length compiles": result["new_length"]["compiles"],
    }


def _run_child(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run every case cold and with a warm disk cache; print a table; write a JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", action="store_true",
        help="profile each first call (cProfile, top 40 by cumulative time, in the record)",
    )  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return
    rows = []
    for name in args.cases:
        spec = dict(CASES[name], profile=args.profile)
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache_dir:
            for state in ("cold", "disk"):
                result = _run_child(spec, cache_dir)
                row = {"case": name, "cache": state, **_summary(result), **spec, **result}
                rows.append(row)
                if "error" in result:
                    print(f"{name} ({state}): failed\n{result['error']}", flush=True)
                    continue
                print(
                    f"{name} ({state}): first {result['first']['seconds']:.2f} s "
                    f"({result['first']['compiles']} compiles), again "
                    f"{result['again']['seconds']:.3f} s, new length "
                    f"{result['new_length']['seconds']:.3f} s "
                    f"({result['new_length']['compiles']} compiles)",
                    flush=True,
                )
    table = [
        {"case": r["case"], "cache": r["cache"], **_summary(r)} for r in rows if "error" not in r
    ]
    print(markdown_table(table, list(table[0])))
    if args.json is not None:
        write_record(args.json, environment(), rows)


if __name__ == "__main__":
    main()
