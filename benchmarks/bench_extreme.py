"""Extreme-length memory test: the longest sequence one dilated attention call fits in memory.

    python benchmarks/bench_extreme.py --out benchmarks/results/extreme_h100        # GPU, bf16
    python benchmarks/bench_extreme.py --max-memory-gib 2 --out /tmp/extreme_cpu    # CPU, fp32

The search and the measurement are ``dilated_attention.extreme`` (its docstring says exactly what
is measured and what "does not fit" means on CUDA and on CPU); ``examples/extreme_length.py`` is
the same search for newcomers. For forward only (``no_grad``) and for forward+backward, the
sequence length doubles from ``--start-len`` until a run does not fit, then ``--bisect`` halving
steps (in multiples of the first segment) narrow the gap. Every run is ``dilated_attention(q, k,
v)`` on (1, N, H, D) inputs with the LongNet schedule.

Writes ``OUT.json`` (``write_record``: the environment, and per mode the largest length that fits,
its peak memory and bytes per token, what stopped the search, and every attempt) and ``OUT.png``
(peak memory against length, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import environment, markdown_table, write_record

from dilated_attention.extreme import add_search_arguments, plot_peak_memory, search_from_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_search_arguments(parser)
    parser.add_argument(
        "--out", type=Path, default=None, help="write OUT.json and OUT.png (path without suffix)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the test; returns ``{"environment": ..., "results": [one row per mode]}``."""
    args = parse_args(argv)
    record = search_from_arguments(args)
    config, rows = record["config"], record["results"]
    env = environment()
    env["config"] = config
    print(
        markdown_table(rows, ["mode", "max_seq_len", "peak_gib", "bytes_per_token", "stopped_by"])
    )
    if args.out is not None:
        json_path = args.out.with_name(args.out.name + ".json")
        write_record(json_path, env, rows)
        print(f"wrote {json_path}")
        if not args.no_plot:
            png = args.out.with_name(args.out.name + ".png")
            title = f"{env['device']}, H={args.heads} D={args.head_dim} {config['dtype']}"
            if plot_peak_memory(rows, png, budget_gib=config["max_memory_gib"], title=title):
                print(f"wrote {png}")
            else:
                print("matplotlib is not installed: no plot")
    return {"environment": env, "results": rows}


if __name__ == "__main__":
    main()
