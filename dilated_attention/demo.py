"""The main job: train a tiny LongNet as a byte-level language model on real text.

The text is the Python source of the installed ``torch`` package, which every install has (Note
[The corpus] in ``models/training.py``). The demo reports
held-out bits per byte before and after training, with what simple models reach on the same
text for scale (byte frequencies alone, gzip -9), the kernel chosen, and a sample: a held-out
prompt and the model's continuation of it.

    python -m dilated_attention demo               # at most two minutes of training
    python -m dilated_attention demo --steps 20    # a quick check
    python -m dilated_attention demo --save outputs/demo/model.pt
    python -m dilated_attention generate --checkpoint outputs/demo/model.pt --prompt "def "
"""

from __future__ import annotations

import argparse
import codecs
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .core.devices import resolve_device
from .factory import explain
from .models import PRESETS, CheckpointError, LongNetConfig, LongNetLM
from .models import load_checkpoint as _load_checkpoint
from .models import save_checkpoint as _save_checkpoint
from .models.training import (
    DEFAULT_CORPUS_BYTES,
    MIN_CORPUS_BYTES,
    bits_per_byte,
    load_corpus,
    reference_bits_per_byte,
    sample_windows,
    warmup_cosine,
)

__all__ = [
    "MIN_CORPUS_BYTES",
    "HelpFormatter",
    "add_demo_arguments",
    "add_generate_arguments",
    "bits_per_byte",
    "format_sample",
    "format_scale",
    "generate",
    "load_corpus",
    "reference_bits_per_byte",
    "run",
    "run_demo",
    "sample_windows",
]
# load_corpus, sample_windows, bits_per_byte, reference_bits_per_byte and MIN_CORPUS_BYTES live
# in models/training.py (shared with the examples and the quality benchmark); the demo's names
# for them stay.


#: Held-out bits per byte, lowest and highest method mean over seeds, of the quality benchmark's
#: byte-level models (6 layers, width 512, 600 steps of 4 x 16K tokens) on this corpus:
#: ``benchmarks/results/quality_h100.json``, held to it by ``tests/e2e/test_bench_quality.py``.
QUALITY_BPB = (1.6, 2.0)


def format_scale(scale: dict[str, float]) -> str:
    """The demo's lines that say how good a bits-per-byte figure is (``scale`` from
    :func:`reference_bits_per_byte` of the held-out text)."""
    # Note [Bits per byte for scale]: a model that predicts nothing gives log2(256) = 8. The
    # byte histogram and gzip are measured on the same held-out text at run time. Well-trained
    # byte-level transformers go well below gzip: on enwik8 (English Wikipedia) 12-layer models
    # of about 40M parameters reach 1.06-1.11 bits per byte (Al-Rfou et al. 2018; Dai et al.
    # 2019, Transformer-XL), where gzip -9 gives 2.92 (the Large Text Compression Benchmark).
    # On this corpus (torch's source) the quality benchmark's models reach QUALITY_BPB.
    low, high = QUALITY_BPB
    return (
        f"  for scale: 8 = random bytes; on this held-out text byte frequencies alone give "
        f"{scale['unigram']:.2f},\n  gzip -9 {scale['gzip']:.2f}; well-trained byte-level "
        f"models go well below gzip (enwik8, English\n  Wikipedia: about 1.1 for "
        f"40M-parameter transformers, gzip 2.9); on this kind of text\n  (torch's source) "
        f"6-layer, 19M-parameter models trained for 600 steps of 64K tokens\n  reach "
        f"{low}-{high} (docs/quality.md)"
    )


def _progress(step: int, steps: int, elapsed: float, budget: float) -> float:
    """The fraction of training done after ``step`` updates and ``elapsed`` seconds: the larger
    of the step count's and the time budget's (``budget`` 0: no time limit)."""
    by_steps = step / steps if steps > 0 else 1.0
    by_time = elapsed / budget if budget > 0 else 0.0
    return max(by_steps, by_time)


def _printable(data: bytes) -> str:
    """``data`` as text that is safe to print: UTF-8 where it decodes, ``\\xNN`` for bytes that
    do not and for control characters other than newline and tab (a model's raw bytes must not
    drive the terminal), and nothing the console's encoding cannot show."""
    return _safe_text(data.decode("utf-8", errors="backslashreplace"))


def _safe_text(text: str) -> str:
    """:func:`_printable` of text already decoded (with ``errors="backslashreplace"``)."""
    text = "".join(
        c if c in "\n\t" or c.isprintable() else c.encode("unicode_escape").decode() for c in text
    )
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(encoding, errors="backslashreplace").decode(encoding)


def _as_bytes(ids: list[int]) -> bytes:
    """Token ids as bytes; ids beyond a byte (a model with a larger vocabulary) become ``?``."""
    return bytes(i if 0 <= i < 256 else ord("?") for i in ids)


def format_sample(prompt: bytes, continuation: bytes, *, how: str = "") -> str:
    """The prompt and the model's continuation as labelled blocks of text.

    Args:
        prompt: the prompt's bytes.
        continuation: the generated bytes.
        how: how the continuation was sampled, added to its label (e.g. ``"temperature 0.8"``).

    Returns:
        Lines ``----- prompt (N bytes) -----``, the prompt, ``----- continuation (M bytes...)
        -----``, the continuation, ``----- end -----``. The continuation carries on from the
        prompt's last character (mid-line when the prompt does not end with a newline).
    """
    return (
        f"{_sample_head(prompt, len(continuation), how)}\n{_printable(continuation)}\n{_SAMPLE_END}"
    )


_SAMPLE_END = "----- end -----"


def _sample_head(prompt: bytes, length: int, how: str) -> str:
    """:func:`format_sample`'s lines before the continuation."""
    how = f", {how}" if how else ""
    return (
        f"----- prompt ({len(prompt)} byte{'s' * (len(prompt) != 1)}) -----\n"
        f"{_printable(prompt)}\n----- continuation ({length} byte{'s' * (length != 1)}{how}) -----"
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and states each flag's default, except ``None`` (the help
    text says what it means) and ``False`` of an on/off switch. The command line's and the
    examples' parsers use it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        switch = action.nargs == 0 and action.const is True and action.default is False
        if action.default is None or action.required or switch:
            return action.help
        return super()._get_help_string(action)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` command's flags."""
    parser.add_argument(
        "--steps", type=int, default=700,
        help="at most this many training steps (optimizer updates)",
    )  # fmt: skip
    parser.add_argument(
        "--time-budget", type=float, default=120.0, metavar="SECONDS",
        help="train for at most this long (the learning rate schedule follows whichever of "
        "--steps and the budget runs out first); 0 for no limit, which makes a run depend on "
        "the seed alone",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="bytes per training sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    parser.add_argument(
        "--eval-windows", type=int, default=32, help="held-out windows for bits per byte"
    )
    parser.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and sample")
    parser.add_argument(
        "--device", default=_default_device(), help="cpu, cuda or cuda:N (CUDA when available)"
    )
    parser.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="LongNetConfig preset"
    )
    parser.add_argument(
        "--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES,
        help=f"read at most this many bytes of source; less starts faster; at least "
        f"{MIN_CORPUS_BYTES} (1 MiB), since every tenth file is held out "
        "(default: %(default)s = 24 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--save", type=Path, default=None, metavar="PATH",
        help="save the trained model to PATH (a checkpoint for the generate command)",
    )  # fmt: skip
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )


def _check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be >= 1, got {value}")


def _check_demo_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A one-line usage error for each flag of ``demo`` outside its range."""
    if args.steps < 0:
        parser.error(f"--steps must be >= 0, got {args.steps}")
    _check_positive(
        parser, args, "batch_size", "seq_len", "eval_windows", "sample_bytes",
    )  # fmt: skip
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        parser.error(
            f"--corpus-bytes must be >= {MIN_CORPUS_BYTES} (1 MiB: every tenth file is held "
            f"out), got {args.corpus_bytes}"
        )
    if args.seq_len < 2:
        parser.error(
            f"--seq-len must be >= 2 (the sample's prompt is the first half of a window), "
            f"got {args.seq_len}"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}; e.g. --lr 2e-3")
    if not (math.isfinite(args.time_budget) and args.time_budget >= 0):
        parser.error(
            f"--time-budget must be a finite number of seconds >= 0 (0: no limit), "
            f"got {args.time_budget}"
        )


def _device_or_exit(parser: argparse.ArgumentParser, device: str) -> torch.device:
    try:
        return resolve_device(device, name="--device")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def run(argv: list[str] | None = None) -> dict[str, float]:
    """``python -m dilated_attention demo`` with these arguments (``sys.argv[1:]`` when ``None``).

    Returns:
        The measured figures (also printed): ``bits_per_byte_before``, ``bits_per_byte_after``,
        ``seconds``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m dilated_attention demo", description=__doc__, formatter_class=HelpFormatter
    )
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv), parser)


def _train(
    model: LongNetLM,
    optimizer: torch.optim.Optimizer,
    train: torch.Tensor,
    args: argparse.Namespace,
    gen: torch.Generator,
    device: torch.device,
) -> int:
    """Train on random windows of ``train`` until ``args.steps`` updates or ``args.time_budget``
    seconds, whichever comes first; returns the number of updates made."""
    start = time.perf_counter()
    bar = tqdm(total=args.steps, desc="training", unit="step", disable=not args.progress)
    step, tokens = 0, args.batch_size * args.seq_len
    with bar:
        while True:
            elapsed = time.perf_counter() - start
            progress = _progress(step, args.steps, elapsed, args.time_budget)
            if progress >= 1:
                return step
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(progress, args.lr)
            batch = sample_windows(train, args.batch_size, args.seq_len, gen).to(device)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            bar.update()
            tok_s = step * tokens / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:,.0f}")


def _layers_text(config: LongNetConfig) -> str:
    """``"layers 4"``, or for a hybrid stack ``"layers 6 (4 local, window 64)"``."""
    local = sum(not config.is_global(i) for i in range(config.num_layers))
    hybrid = f" ({local} local, window {config.local_window})" if local else ""
    return f"layers {config.num_layers}{hybrid}"


def run_demo(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> dict[str, float]:
    """Train and report, with the flags of :func:`add_demo_arguments` already parsed.

    Returns:
        ``bits_per_byte_before``, ``bits_per_byte_after``, ``seconds`` (of training), and for
        scale :func:`reference_bits_per_byte` of the held-out text: ``bits_per_byte_unigram``
        and ``bits_per_byte_gzip``.
    """
    parser = parser or argparse.ArgumentParser(prog="python -m dilated_attention demo")
    _check_demo_flags(parser, args)
    device = _device_or_exit(parser, args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    try:
        train, held_out = load_corpus(args.corpus_bytes)
    except ValueError as exc:
        parser.error(str(exc))
    if min(train.numel(), held_out.numel()) <= args.seq_len + 1:
        parser.error(
            f"--corpus-bytes {args.corpus_bytes} gives too little text for --seq-len "
            f"{args.seq_len}; raise --corpus-bytes"
        )
    config = LongNetConfig.from_preset(args.preset)
    model = LongNetLM(config).to(device)
    eval_windows = sample_windows(held_out, args.eval_windows, args.seq_len, gen)
    head_dim = config.embed_dim // config.num_heads
    choice = explain(
        device=device, dtype=torch.float32, head_dim=head_dim, num_heads=config.num_heads,
        seq_len=min(config.segment_lengths[0], args.seq_len), is_causal=True,
        softcap=config.softcap, sinks=config.sinks,
    )  # fmt: skip
    print(
        f"LongNet '{args.preset}': {model.num_parameters() / 1e6:.2f}M parameters, "
        f"{_layers_text(config)}, segments {list(config.segment_lengths)}, rates "
        f"{list(config.dilation_rates)}; kernel {choice.backend} on {device}"
    )
    print(
        f"data: Python source of torch {torch.__version__}: {train.numel() / 1e6:.1f} MB train, "
        f"{held_out.numel() / 1e6:.1f} MB held out"
    )
    before = bits_per_byte(model, eval_windows, device)
    print(f"held-out bits per byte before training: {before:.3f}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = time.perf_counter()
    steps = _train(model, optimizer, train, args, gen, device)
    seconds = time.perf_counter() - start
    after = bits_per_byte(model, eval_windows, device)
    print(
        f"held-out bits per byte after {steps} step{'' if steps == 1 else 's'}: {after:.3f} "
        f"(before {before:.3f})"
    )
    scale = reference_bits_per_byte(held_out)
    print(format_scale(scale))
    budget = f" (time budget {args.time_budget:g} s)" if steps < args.steps else ""
    print(f"training time {seconds:.1f} s{budget}")

    prompt = held_out[: args.seq_len // 2].long().unsqueeze(0).to(device)
    sample = model.generate(
        prompt, args.sample_bytes, temperature=0.8, top_k=20,
        generator=torch.Generator(device=device).manual_seed(args.seed),
    )  # fmt: skip
    n = prompt.shape[1]
    print("sample: the model continues a held-out prompt")
    print(
        format_sample(
            _as_bytes(sample[0, :n].tolist()), _as_bytes(sample[0, n:].tolist()),
            how=f"temperature 0.8, top-k 20, seed {args.seed}",
        )
    )  # fmt: skip
    if args.save is not None:
        _save(args, model, after)
    return {
        "bits_per_byte_before": before, "bits_per_byte_after": after, "seconds": seconds,
        **{f"bits_per_byte_{name}": value for name, value in scale.items()},
    }  # fmt: skip


def _save(args: argparse.Namespace, model: LongNetLM, after: float) -> None:
    """Save the trained model to ``args.save`` and say how to sample from it."""
    path = _save_checkpoint(
        args.save, model, command="demo", preset=args.preset, steps=args.steps,
        seed=args.seed, bits_per_byte=after,
    )  # fmt: skip
    size = path.stat().st_size / 1e6
    print(
        f"model saved to {path} ({size:.1f} MB); continue a prompt with:\n"
        f"  python -m dilated_attention generate --checkpoint {shlex.quote(str(path))} "
        f"--prompt 'def forward(self'"
    )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` command's flags."""
    parser.add_argument(
        "--checkpoint", type=Path, required=True, metavar="PATH",
        help="a model saved by `demo --save PATH` (or save_checkpoint)",
    )  # fmt: skip
    parser.add_argument("--prompt", required=True, help="text to continue (encoded as UTF-8 bytes)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="bytes to generate"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, metavar="T",
        help="sampling temperature; 0 always takes the most likely byte",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, default=20, metavar="K",
        help="sample among the K most likely bytes only; 0 for all",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    parser.add_argument(
        "--device", default=_default_device(), help="cpu, cuda or cuda:N (CUDA when available)"
    )


def generate(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> str:
    """Load ``args.checkpoint``, continue ``args.prompt`` and print both, the continuation as
    it is sampled (see :func:`add_generate_arguments` for the flags).

    Returns:
        The continuation as text (UTF-8, undecodable bytes replaced).
    """
    parser = parser or argparse.ArgumentParser(prog="python -m dilated_attention generate")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(
            f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}"
        )
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        parser.error("--prompt is empty; give at least one character to continue")
    device = _device_or_exit(parser, args.device)
    try:
        model = _load_checkpoint(args.checkpoint, device=device).model.eval()
    except (FileNotFoundError, CheckpointError) as exc:
        parser.error(str(exc))
    if model.config.vocab_size < 256:
        parser.error(
            f"{args.checkpoint} holds a model with vocab_size {model.config.vocab_size}; "
            f"generate feeds it UTF-8 bytes and needs a byte-level model (vocab_size >= 256)"
        )
    cap = model.config.max_seq_len
    if cap is not None and len(prompt) > cap:
        parser.error(
            f"--prompt is {len(prompt)} bytes, longer than the model's max_seq_len={cap}; "
            f"give a prompt of at most {cap} bytes (e.g. its last {cap})"
        )
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    steps = model.stream(
        tokens, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
        generator=torch.Generator(device=device).manual_seed(args.seed),
    )  # fmt: skip
    top_k = f"top-k {args.top_k}" if args.top_k else "no top-k"
    how = f"temperature {args.temperature:g}, {top_k}, seed {args.seed}"
    # format_sample's text, with the continuation printed as each byte is sampled.
    print(_sample_head(prompt, args.max_new_tokens, how), flush=True)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    continuation = bytearray()
    for step in steps:
        byte = _as_bytes(step[0].tolist())
        continuation += byte
        print(_safe_text(decoder.decode(byte)), end="", flush=True)
    print(_safe_text(decoder.decode(b"", final=True)))
    print(_SAMPLE_END)
    return bytes(continuation).decode("utf-8", errors="replace")
