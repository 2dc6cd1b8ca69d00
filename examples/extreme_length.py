"""How long a sequence fits? Step the length up until dilated attention runs out of memory.

    python examples/extreme_length.py                        # CPU: 2 GiB budget, small sizes
    python examples/extreme_length.py --max-memory-gib 8     # CPU: a bigger budget
    python examples/extreme_length.py --bisect 4             # GPU: bf16, until out of memory

For forward only and for forward+backward it reports the largest sequence length that fits, the
peak memory and the memory per token (``dilated_attention.extreme``, whose docstring says exactly
what is measured), and writes ``extreme_length.json`` and ``extreme_length.png`` (when matplotlib
is installed) to ``--output-dir`` (default ``outputs/extreme_length/``, created on demand). Needs
only the installed package: it runs from any directory. ``benchmarks/bench_extreme.py`` is the
same search writing the benchmark records.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import dilated_attention
from dilated_attention.demo import HelpFormatter
from dilated_attention.extreme import add_search_arguments, plot_peak_memory, search_from_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_search_arguments(parser)
    parser.add_argument(
        "--output-dir", type=Path, default=Path("outputs/extreme_length"),
        help="where extreme_length.json/.png go",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the search; returns ``{"environment": ..., "results": [one row per mode]}``."""
    args = parse_args(argv)
    record = search_from_arguments(args)
    config, rows = record["config"], record["results"]
    cuda = config["device"].startswith("cuda")
    environment = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dilated_attention": dilated_attention.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "config": config,
    }
    for row in rows:
        if row["max_seq_len"]:
            print(
                f"{row['mode']}: {row['max_seq_len']:,} tokens fit "
                f"({row['peak_gib']:.3f} GiB peak, {row['bytes_per_token'] / 1024:.1f} KiB/token; "
                f"stopped by {row['stopped_by']})"
            )
        else:
            print(f"{row['mode']}: not even the first length fits ({row['stopped_by']})")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.output_dir / "extreme_length.json"
    result = {"environment": environment, "results": rows}
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {json_path}")
    if not args.no_plot:
        png = args.output_dir / "extreme_length.png"
        title = f"{environment['device']}, H={args.heads} D={args.head_dim} {config['dtype']}"
        if plot_peak_memory(rows, png, budget_gib=config["max_memory_gib"], title=title):
            print(f"wrote {png}")
        else:
            print("matplotlib is not installed (pip install matplotlib): no plot")
    return result


if __name__ == "__main__":
    main()
