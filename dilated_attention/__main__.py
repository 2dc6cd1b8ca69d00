"""Command line: ``python -m dilated_attention demo|layer|info``.

``demo`` (the main job) trains a tiny LongNet byte-level language model on the installed torch's
Python source and reports held-out bits per byte (``demo.py``). ``layer`` builds one
:class:`MultiheadDilatedAttention` layer with a LongNet schedule, runs forward and backward on one
long random sequence, and prints the kernel chosen and the timings. ``info`` prints the software and
devices here and, for each device, every kernel backend: whether it can run, which one is chosen,
and why the others are not.
"""

from __future__ import annotations

import argparse
import time

import torch

from .backends.registry import get_backend, list_backends
from .config import longnet_schedule
from .factory import explain
from .modules import MultiheadDilatedAttention


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_timing(argv: list[str] | None = None) -> None:
    """Forward and backward of one multihead dilated attention layer on a long random sequence."""
    parser = argparse.ArgumentParser(
        prog="python -m dilated_attention layer", description=layer_timing.__doc__
    )
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--first-segment", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    segments, rates = longnet_schedule(args.seq_len, args.first_segment)
    embed_dim = args.heads * args.head_dim
    layer = MultiheadDilatedAttention(
        embed_dim, args.heads, segments, rates, device=device, dtype=dtype
    )
    x = torch.randn(1, args.seq_len, embed_dim, device=device, dtype=dtype, requires_grad=True)
    choice = explain(
        device=device, dtype=dtype, head_dim=args.head_dim, num_heads=args.heads,
        seq_len=min(args.seq_len, args.first_segment), is_causal=args.causal,
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

    def timed(step: str) -> float:
        times = []
        for _ in range(args.repeats):
            _synchronize(device)
            start = time.perf_counter()
            out, _ = layer(x, is_causal=args.causal)
            if step == "fwd+bwd":
                out.float().square().mean().backward()
            _synchronize(device)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        timed("fwd")  # warm-up
        fwd = timed("fwd")
    fwd_bwd = timed("fwd+bwd")
    grad = x.grad
    assert grad is not None
    print(f"  forward          {fwd * 1e3:9.1f} ms  ({args.seq_len / fwd:,.0f} tokens/s)")
    print(f"  forward+backward {fwd_bwd * 1e3:9.1f} ms  ({args.seq_len / fwd_bwd:,.0f} tokens/s)")
    print(f"  input gradient finite: {bool(torch.isfinite(grad).all())}")


def _devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def info(argv: list[str] | None = None) -> None:
    """Versions, devices, and every backend with available / chosen / reasons, per device."""
    parser = argparse.ArgumentParser(
        prog="python -m dilated_attention info", description=info.__doc__
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"torch {torch.__version__}  CUDA {torch.version.cuda}  cuDNN {cudnn}")
    for dev in _devices():
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            label = f"{dev}: {torch.cuda.get_device_name(dev)} (sm{major}{minor})"
        else:
            label = f"{dev}: {torch.get_num_threads()} threads"
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
        dilated = explain(
            device=dev, dtype=dtype, head_dim=args.head_dim, is_causal=args.causal, dilated=True
        )
        print(f"  dilated attention (several branches or rate > 1) runs on: {dilated.backend}")


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``python -m dilated_attention <command>``."""
    parser = argparse.ArgumentParser(prog="python -m dilated_attention")
    parser.add_argument(
        "command",
        choices=["demo", "layer", "info"],
        help="demo: train a tiny LongNet on real text; layer: forward+backward timing of one "
        "layer; info: versions, devices and kernel choice",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import run  # the model stack is imported only for the demo

        run(rest)
    else:
        {"layer": layer_timing, "info": info}[args.command](rest)


if __name__ == "__main__":
    main()
