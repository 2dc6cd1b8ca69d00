"""Command line: ``python -m dilated_attention {demo,generate,layer,warmup,info} [--help]``.

``demo`` (the main job) trains a tiny LongNet byte-level language model on the installed torch's
Python source and reports held-out bits per byte (``demo.py``); ``demo --save PATH`` keeps the
model, and ``generate --checkpoint PATH --prompt TEXT`` continues a prompt with it. ``layer``
builds one :class:`MultiheadDilatedAttention` layer with a LongNet schedule, runs forward and
backward on one long random sequence, and prints the kernel chosen and the timings. ``warmup``
compiles a schedule's GPU kernels into the disk cache ahead of a job. ``info`` prints the
software and devices here and, for each device, every kernel backend: whether it can
run, which one is chosen, and why the others are not. Every command's ``--help`` lists its flags
and their defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

from . import demo
from ._version import __version__
from .backends.registry import get_backend, list_backends
from .config import longnet_schedule
from .core.devices import resolve_device
from .demo import HelpFormatter
from .factory import explain
from .functional import dilated_attention
from .modules import MultiheadDilatedAttention

_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of one dilated attention call (``layer`` and ``warmup``; defaults sized for a CPU)."""
    parser.add_argument(
        "--seq-len", type=int, default=16384,
        help="tokens in the sequence (sized for a CPU; try 1048576 on a GPU)",
    )  # fmt: skip
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--head-dim", type=int, default=32, help="dimension of each head")
    parser.add_argument(
        "--first-segment", type=int, default=2048,
        help="first segment length; segments double (rates 1, 2, 4, ...) until one covers "
        "--seq-len (LongNet schedule)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default=demo._default_device(),
        help="cpu, cuda or cuda:N (CUDA when available)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default=None, choices=_DTYPES, help="default: float32 on CPU, bfloat16 on CUDA"
    )
    parser.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention"
    )


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``layer`` command's flags."""
    add_shape_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (the median is shown)")


def _shape_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser, counts: tuple[str, ...]
) -> tuple[torch.device, torch.dtype]:
    """Check the positive counts named in ``counts`` and resolve ``--device`` and ``--dtype``
    (a clear usage error otherwise)."""
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        device = resolve_device(args.device, name="--device")
    except ValueError as exc:
        parser.error(str(exc))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    return device, dtype


def layer_timing(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Forward and backward of one multihead dilated attention layer on a long random sequence."""
    device, dtype = _shape_from_args(
        args, parser, ("seq_len", "heads", "head_dim", "first_segment", "repeats")
    )
    segments, rates = longnet_schedule(args.seq_len, args.first_segment)
    embed_dim = args.heads * args.head_dim
    layer = MultiheadDilatedAttention(
        embed_dim, args.heads, segments, rates, device=device, dtype=dtype
    )
    x = torch.randn(1, args.seq_len, embed_dim, device=device, dtype=dtype, requires_grad=True)
    choice = explain(
        device=device, dtype=dtype, head_dim=args.head_dim, num_heads=args.heads,
        seq_len=args.seq_len, is_causal=args.causal, segment_lengths=segments,
        dilation_rates=rates,
    )  # fmt: skip
    print(
        f"MultiheadDilatedAttention: seq_len={args.seq_len:,} heads={args.heads} "
        f"head_dim={args.head_dim} {str(dtype).removeprefix('torch.')} on {device} "
        f"causal={args.causal}"
    )
    print(f"  segment_lengths={segments}\n  dilation_rates={rates}")
    print(f"  backend chosen: {choice.backend} ({choice.source})")
    for name, why in choice.reasons.items():
        print(f"    {name}: not used ({'; '.join(why)})")
    print("  branches:")
    for line in choice.branches:
        print(f"    {line}")

    def timed(step: str) -> float:
        times = []
        for _ in range(args.repeats):
            _synchronize(device)
            start = time.perf_counter()
            out, _ = layer(x, x, x, is_causal=args.causal, need_weights=False)
            if step == "fwd+bwd":
                out.float().square().mean().backward()
            _synchronize(device)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        timed("fwd")  # warm-up
        fwd = timed("fwd")
    fwd_bwd = timed("fwd+bwd")
    finite = x.grad is not None and bool(torch.isfinite(x.grad).all())
    print(f"  forward          {fwd * 1e3:9.1f} ms  ({args.seq_len / fwd:,.0f} tokens/s)")
    print(f"  forward+backward {fwd_bwd * 1e3:9.1f} ms  ({args.seq_len / fwd_bwd:,.0f} tokens/s)")
    print(f"  input gradient finite: {finite}")


def add_warmup_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``warmup`` command's flags."""
    add_shape_arguments(parser)
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)"
    )
    parser.add_argument(
        "--key-padding", action="store_true", help="also for calls with a key padding mask"
    )
    parser.add_argument(
        "--grad", action=argparse.BooleanOptionalAction, default=True,
        help="also compile the backward (training)",
    )  # fmt: skip


def warmup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Compile the kernels of one shape family ahead, so that a later process's first call
    of that family loads them from the disk cache instead of compiling.

    A family is the device, dtype, head counts, head dim, schedule (segment lengths and
    dilation rates), causality, key padding and whether a backward follows; the sequence
    length is not part of it (a new length compiles nothing). Triton keeps compiled kernels in
    ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``): warm up with the same value the job
    will use, e.g. once per machine image or before ``torchrun``.

        python -m dilated_attention warmup --seq-len 1048576 --heads 16 --head-dim 128
    """
    device, dtype = _shape_from_args(
        args, parser, ("seq_len", "heads", "head_dim", "first_segment")
    )
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if kv_heads < 1 or args.heads % kv_heads:
        parser.error(f"--kv-heads must divide --heads ({args.heads}), got {kv_heads}")
    segments, rates = longnet_schedule(args.seq_len, args.first_segment)
    kind = "forward and backward" if args.grad else "forward"
    print(
        f"warmup: {str(dtype).removeprefix('torch.')} on {device}, heads={args.heads} "
        f"kv_heads={kv_heads} head_dim={args.head_dim} causal={args.causal} "
        f"key_padding={args.key_padding}, {kind}\n"
        f"  segment_lengths={segments}\n  dilation_rates={rates}"
    )
    if device.type != "cuda":
        print(f"  nothing to compile on {device.type}: its kernels come with torch")
        return
    seq_len = args.seq_len
    q = torch.randn(1, seq_len, args.heads, args.head_dim, device=device, dtype=dtype)
    k, v = (
        torch.randn(1, seq_len, kv_heads, args.head_dim, device=device, dtype=dtype) for _ in "kv"
    )
    # A mask that pads nothing: the masked kernels, on real rows.
    mask = torch.zeros(1, seq_len, dtype=torch.bool, device=device) if args.key_padding else None
    for x in (q, k, v):
        x.requires_grad_(args.grad)
    start = time.perf_counter()
    with torch.set_grad_enabled(args.grad):
        out = dilated_attention(
            q, k, v, segments, rates, is_causal=args.causal, key_padding_mask=mask
        )
        if args.grad:
            out.sum().backward()
    _synchronize(device)
    cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    print(f"  done in {time.perf_counter() - start:.1f} s; compiled kernels are in {cache}")


def _devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``info`` command's flags."""
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension to explain")
    parser.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="causal attention"
    )


def info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Versions, devices, and every backend with available / chosen / reasons, per device."""
    if args.head_dim < 1:
        parser.error(f"--head-dim must be >= 1, got {args.head_dim}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"torch {torch.__version__}  CUDA {torch.version.cuda}  cuDNN {cudnn}")
    for dev in _devices():
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            label = f"{dev}: {torch.cuda.get_device_name(dev)} (sm{major}{minor})"
        else:
            threads = torch.get_num_threads()
            label = f"{dev}: {threads} thread{'s' if threads != 1 else ''}"
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        print(f"\n{label}")
        try:
            choice = explain(device=dev, dtype=dtype, head_dim=args.head_dim, is_causal=args.causal)
        except ValueError as exc:  # e.g. DILATED_ATTENTION_BACKEND names a kernel this cannot run
            print(f"  no backend: {exc}")
            continue
        print(
            f"  inputs: {str(dtype).removeprefix('torch.')}, head_dim {args.head_dim}, "
            f"causal={args.causal}, training"
        )
        print(f"  {'backend':<16}{'available':<11}{'chosen':<8}reasons")
        for name in list_backends():
            backend = get_backend(name)
            available = "no" if backend.availability_reasons(dev) else "yes"
            if dev.type not in backend.devices:
                available = "-"
            chosen = "*" if name == choice.backend else ""
            why = "; ".join(choice.reasons.get(name, []))
            print(f"  {name:<16}{available:<11}{chosen:<8}{why}")
        _print_strategies(dev, dtype, args)


def _print_strategies(dev: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> None:
    """The resolve step's strategy, in its own words, for dilated attention with a LongNet
    schedule and for block-sparse attention on ``dev``."""
    seq_len = 65536
    segments, rates = longnet_schedule(seq_len, 2048)
    for operation, schedule in (("dilated", (segments, rates)), ("block_sparse", (None, None))):
        try:
            choice = explain(
                device=dev, dtype=dtype, head_dim=args.head_dim, is_causal=args.causal,
                operation=operation, seq_len=seq_len, segment_lengths=schedule[0],
                dilation_rates=schedule[1],
            )  # fmt: skip
        except ValueError as exc:
            print(f"  {operation} attention: no kernel: {exc}")
            continue
        lines = str(choice).splitlines()
        print("\n".join(f"  {line}" for line in lines if ": not used (" not in line))


_Command = Callable[[argparse.Namespace, argparse.ArgumentParser], object]

#: name -> (one-line help, flags, the function that runs it, description)
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], _Command, str]] = {
    "demo": (
        "train a tiny byte-level LongNet on real text and sample from it",
        demo.add_demo_arguments, demo.run_demo, demo.__doc__ or "",
    ),
    "generate": (
        "continue a prompt with a model saved by `demo --save PATH`",
        demo.add_generate_arguments, demo.generate,
        "Load a LongNet checkpoint and print the prompt followed by the model's continuation.\n\n"
        "    python -m dilated_attention demo --save outputs/demo/model.pt\n"
        "    python -m dilated_attention generate --checkpoint outputs/demo/model.pt "
        "--prompt 'def '",
    ),
    "layer": (
        "forward+backward timing of one multihead dilated attention layer",
        add_layer_arguments, layer_timing, layer_timing.__doc__ or "",
    ),
    "warmup": (
        "compile a schedule's GPU kernels ahead, into the disk cache",
        add_warmup_arguments, warmup, warmup.__doc__ or "",
    ),
    "info": (
        "versions, devices, and which attention kernel runs where and why",
        add_info_arguments, info, info.__doc__ or "",
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dilated_attention`` parser, one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="python -m dilated_attention",
        description="LongNet dilated attention for PyTorch: a demo and tools.",
        epilog="`python -m dilated_attention COMMAND --help` shows a command's flags and their "
        "defaults.\nStart with: python -m dilated_attention demo   (at most 2 minutes of training)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dilated_attention {__version__}")
    # Not `required`: without a command, main prints the whole help (the commands), not
    # argparse's bare "arguments are required: COMMAND".
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name, (summary, add_arguments, func, description) in _COMMANDS.items():
        sub = commands.add_parser(
            name, help=summary, description=description, formatter_class=HelpFormatter
        )
        add_arguments(sub)
        sub.set_defaults(_run=func, _parser=sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run ``python -m dilated_attention <command> [flags]`` (``sys.argv[1:]`` when ``None``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        parser.exit(2, f"\n{parser.prog}: error: name a command: {', '.join(_COMMANDS)}\n")
    args._run(args, args._parser)


if __name__ == "__main__":
    main()
