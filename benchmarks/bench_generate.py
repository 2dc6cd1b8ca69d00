"""Decoding: per-token attention latency against context length, and LongNetLM.generate speed.

Three parts, in one run, on CUDA when available (else the CPU):

- ``decode``: one new token of one layer (B = 1, H = 16, Hkv = 16, D = 128; bf16 on CUDA,
  float32 on the CPU; the LongNet schedule w = 2048..32768, r = 1..16) at the last positions
  before ``--contexts`` tokens: multiples of every segment length, so the costliest positions,
  where each branch reads nearly its whole segment. ``dilated + cache``:
  ``dilated_attention(..., cache=DilatedKVCache)``, the cache filled with the context first,
  each timed call appending its token (what decoding does); ``static`` / ``captured``: the
  ``StaticDilatedKVCache`` step, eager and (CUDA) replayed from a CUDA graph, for one row and
  for ``--batch`` rows at different positions. ``dense SDPA``:
  ``scaled_dot_product_attention`` of the token against every key of the context, already in
  (B, H, N, D) (no concatenation: generous to it). Also the cache's bytes per layer against
  the dense cache's. The first context is run once untimed before the timed rows.
- ``prefill``: a ``--prefill-len`` prompt of the same layer through a cache in chunks of
  ``--prefill-chunk``, against one causal forward over the whole prompt.
- ``generate``: ``LongNetLM.generate`` of the "tiny" preset (greedy) after prompts of
  ``--prompts`` tokens: cached (eager steps, and on CUDA the captured step) against
  recomputing the whole forward for every token (what ``generate`` did before it had caches);
  tokens per second over the whole call.

- ``hf`` (with ``--hf-prompts``): time per new token of a Llama-style model decoding with a
  static cache and a compiled step (``mode="reduce-overhead"`` on CUDA), dilated against
  ``sdpa``.

Times: medians of ``--repeats`` runs (CUDA events on CUDA, ``perf_counter`` on the CPU).

    python benchmarks/bench_generate.py  # -> benchmarks/results/generate_<device>.{json,md}
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    captured,
    environment,
    markdown_table,
    record_header,
    record_path,
    time_cuda,
    write_record,
)

from dilated_attention import DilatedKVCache, StaticDilatedKVCache, dilated_attention
from dilated_attention.models import LongNetConfig, LongNetLM

SEGMENTS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
HEADS, DIM = 16, 128


def _median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    return time_cuda(fn, warmup=warmup, repeats=repeats, device=device)["median_ms"]


def decode_row(context: int, device: torch.device, args: argparse.Namespace) -> dict:
    """Per-token latency and cache bytes of one layer after ``context`` tokens."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    # The timed tokens are the last before ``context``, a multiple of every segment length: the
    # costliest positions, where every branch reads nearly its whole segment (a token right
    # after a boundary reads almost nothing).
    filled = context - args.warmup - args.repeats
    keys = torch.randn(1, filled, HEADS, DIM, device=device, dtype=dtype, generator=gen)
    values = torch.randn_like(keys)
    cache = DilatedKVCache(SEGMENTS, RATES)
    cache.append(keys, values)
    token = [torch.randn(1, 1, HEADS, DIM, device=device, dtype=dtype, generator=gen)
             for _ in "qkv"]  # fmt: skip
    q = token[0].transpose(1, 2)
    k, v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    with torch.no_grad():
        ms = _median_ms(
            lambda: dilated_attention(*token, SEGMENTS, RATES, is_causal=True, cache=cache),
            device, args.warmup, args.repeats,
        )  # fmt: skip
        dense_ms = _median_ms(
            lambda: F.scaled_dot_product_attention(q, k, v), device, args.warmup, args.repeats
        )
    one = static_step_ms(context, 1, device, args)
    many = static_step_ms(context, args.batch, device, args)
    fastest = one.get("captured_ms", one["static_ms"])
    return {
        "part": "decode", "context": context, "dtype": str(dtype).removeprefix("torch."),
        "dilated_ms": ms, "dense_sdpa_ms": dense_ms, "dilated_vs_dense": dense_ms / ms,
        "static_ms": one["static_ms"], "captured_ms": one.get("captured_ms"),
        "fastest_vs_dense": dense_ms / fastest,
        f"batch{args.batch}_over_batch1": many.get("captured_ms", many["static_ms"]) / fastest,
        "cache_mib": cache.nbytes / 2**20,
        "dense_cache_mib": 2 * context * keys[0, 0].numel() * keys.element_size() / 2**20,
    }  # fmt: skip


def _static_cache(
    context: int, batch: int, device: torch.device, dtype: torch.dtype, spare: int
) -> StaticDilatedKVCache:
    """A static cache whose buffers hold random keys, row ``b`` at position ``context - spare -
    b`` (rows at different positions, each just before a multiple of every segment length)."""
    cache = StaticDilatedKVCache(SEGMENTS, RATES)
    gen = torch.Generator(device=device).manual_seed(2)
    cache.allocate(torch.empty(batch, 1, HEADS, DIM, device=device, dtype=dtype))
    for buffer in (cache.key, cache.value):
        buffer.copy_(torch.randn(buffer.shape, device=device, dtype=dtype, generator=gen))
    cache.lengths.copy_(context - spare - torch.arange(batch, device=device))
    return cache


def static_step_ms(
    context: int, batch: int, device: torch.device, args: argparse.Namespace
) -> dict[str, float]:
    """One layer's static decode step (``StaticDilatedKVCache``) after ``context`` tokens,
    ``batch`` rows at different positions: eager, and on CUDA replayed from a CUDA graph."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spare = 2 * (args.warmup + args.repeats) + batch + 4
    cache = _static_cache(context, batch, device, dtype, spare)
    token = [torch.randn(batch, 1, HEADS, DIM, device=device, dtype=dtype) for _ in "qkv"]

    def step() -> torch.Tensor:
        return dilated_attention(*token, SEGMENTS, RATES, is_causal=True, cache=cache)

    with torch.no_grad():
        times = {"static_ms": _median_ms(step, device, args.warmup, args.repeats)}
        if device.type == "cuda":
            graph = captured(step)
            times["captured_ms"] = _median_ms(graph.replay, device, args.warmup, args.repeats)
    return times


def prefill_row(length: int, chunk: int, device: torch.device, args: argparse.Namespace) -> dict:
    """A prompt of ``length`` tokens of one layer through a cache in chunks of ``chunk``, against
    one causal forward over all of it (no cache)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(1, length, HEADS, DIM, device=device, dtype=dtype, generator=gen)
               for _ in "qkv")  # fmt: skip

    def chunked() -> None:
        cache = DilatedKVCache(SEGMENTS, RATES)
        for a in range(0, length, chunk):
            piece = (x[:, a : a + chunk] for x in (q, k, v))
            dilated_attention(*piece, SEGMENTS, RATES, is_causal=True, cache=cache)

    # Both after the same warmup: the host's own time per chunk fell by a third over the first
    # few passes on the H100's host (17 ms, then 12 ms per prompt), and chunks are host-bound.
    repeats = max(5, args.generate_repeats)
    with torch.no_grad():
        chunked_ms = _median_ms(chunked, device, args.warmup, repeats)
        full_ms = _median_ms(
            lambda: dilated_attention(q, k, v, SEGMENTS, RATES, is_causal=True), device,
            args.warmup, repeats,
        )  # fmt: skip
    return {
        "part": "prefill", "prefill_len": length, "chunk": chunk, "chunked_ms": chunked_ms,
        "full_forward_ms": full_ms, "chunked_over_full": chunked_ms / full_ms,
    }  # fmt: skip


def generate_row(
    model: LongNetLM, length: int, device: torch.device, args: argparse.Namespace
) -> dict:
    """Tokens per second of ``generate`` after a prompt of ``length`` tokens, cached and
    recomputing the whole forward for every token."""
    prompt = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    new = args.new_tokens

    def recompute() -> None:
        out = prompt
        with torch.no_grad():
            for _ in range(new):
                nxt = model(out)[:, -1].argmax(-1, keepdim=True)
                out = torch.cat([out, nxt], dim=1)

    def cached(graph: bool) -> float:
        return _median_ms(
            lambda: model.generate(prompt, new, temperature=0, cuda_graph=graph), device, 1,
            args.generate_repeats,
        )  # fmt: skip

    cached_ms = cached(False)
    graph_ms = cached(True) if device.type == "cuda" else None
    recompute_ms = _median_ms(recompute, device, 1, args.generate_repeats)
    fastest = graph_ms or cached_ms
    return {
        "part": "generate", "prompt": length, "new_tokens": new,
        "cached_tokens_per_s": new / cached_ms * 1e3,
        "graph_tokens_per_s": None if graph_ms is None else new / graph_ms * 1e3,
        "recompute_tokens_per_s": new / recompute_ms * 1e3, "speedup": recompute_ms / fastest,
    }  # fmt: skip


def hf_rows(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """Time per new token of a Llama-style model (``--hf-layers`` layers, hidden 2048, 16 query
    and 4 key/value heads of 128) decoding with a static cache and a compiled step, through
    ``use_dilated_attention`` (the LongNet schedule) and on ``sdpa``, after prompts of
    ``--hf-prompts`` tokens. Empty without ``transformers`` or without ``--hf-prompts``."""
    try:
        import transformers
    except ImportError:
        return []
    from dilated_attention.integrations.transformers import use_dilated_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for prompt_len in args.hf_prompts:
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=args.hf_hidden, intermediate_size=4 * args.hf_hidden,
            num_hidden_layers=args.hf_layers, num_attention_heads=16, num_key_value_heads=4,
            head_dim=args.hf_hidden // 16, max_position_embeddings=prompt_len + 64,
            attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
        prompt = torch.randint(0, 32000, (1, prompt_len), device=device)
        row: dict = {"part": "hf", "prompt": prompt_len, "layers": args.hf_layers}
        row["sdpa_ms"] = _hf_step_ms(base, prompt, device, args)
        model = use_dilated_attention(base, SEGMENTS, RATES)
        row["dilated_ms"] = _hf_step_ms(model, prompt, device, args)
        row["dilated_vs_sdpa"] = row["sdpa_ms"] / row["dilated_ms"]
        rows.append(_shown(row))
    return rows


def _hf_step_ms(
    model: torch.nn.Module, prompt: torch.Tensor, device: torch.device, args: argparse.Namespace
) -> float:
    """ms of one compiled decoding step of a transformers ``model`` with a static cache after
    ``prompt`` (1, N) (the same position every call: the step's cost, not the cache's growth)."""
    import transformers

    length = prompt.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=length + 32)
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    position = torch.full((1, 1), length, device=device)

    def step() -> torch.Tensor:
        return model(token, past_key_values=cache, position_ids=position,
                     cache_position=position[0], use_cache=True).logits  # fmt: skip

    mode = "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(step, mode=mode, fullgraph=True)
    with torch.no_grad():
        return _median_ms(compiled, device, 3, args.hf_repeats)


def _shown(row: dict) -> dict:
    """``row``, printed as it comes (a run cut short still shows what it measured)."""
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[16384, 131072, 1048576] if cuda else [16384, 131072],
    )
    parser.add_argument("--prefill-len", type=int, default=131072 if cuda else 8192)
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[8192 if cuda else 1024])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="rows of the batched static step")
    parser.add_argument("--parts", nargs="*", default=["decode", "prefill", "generate"],
                        choices=["decode", "prefill", "generate"],
                        help="parts to run (transformers rows: --hf-prompts)")  # fmt: skip
    parser.add_argument("--hf-prompts", type=int, nargs="*", default=[])
    parser.add_argument("--hf-layers", type=int, default=4)
    parser.add_argument("--hf-hidden", type=int, default=2048)
    parser.add_argument("--hf-repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()  # fmt: skip
    device = torch.device("cuda" if cuda else "cpu")
    # An untimed pass first: the first row of a fresh process measured slowest in both H100 runs
    # (16K: 2.47 ms against 1.67 at 128K; one call per branch: 7.14 against 6.70).
    rows = []
    if "decode" in args.parts:
        decode_row(args.contexts[0], device, args)
        rows += [_shown(decode_row(context, device, args)) for context in args.contexts]
        flat = max(r["dilated_ms"] for r in rows) / min(r["dilated_ms"] for r in rows)
        for row in rows:
            row["dilated_max_over_min"] = flat
    if "prefill" in args.parts:
        rows += [_shown(prefill_row(args.prefill_len, chunk, device, args))
                 for chunk in args.prefill_chunk]  # fmt: skip
    if "generate" in args.parts:
        torch.manual_seed(0)
        model = LongNetLM(LongNetConfig.from_preset("tiny")).to(device).eval()
        rows += [_shown(generate_row(model, length, device, args)) for length in args.prompts]
    rows += hf_rows(device, args)
    env = environment()
    out = record_path("generate", args.out)
    decode_cols = ["context", "dtype", "dilated_ms", "dense_sdpa_ms", "dilated_vs_dense",
                   "dilated_max_over_min", "static_ms", "captured_ms", "fastest_vs_dense",
                   f"batch{args.batch}_over_batch1", "cache_mib", "dense_cache_mib"]  # fmt: skip
    generate_cols = ["prompt", "new_tokens", "cached_tokens_per_s", "graph_tokens_per_s",
                     "recompute_tokens_per_s", "speedup"]  # fmt: skip
    notes = (
        "decode: one layer's per-token latency after `context` tokens, dilated attention with "
        "a DilatedKVCache against dense SDPA over the whole context, and each cache's MiB; "
        "static_ms / captured_ms: the StaticDilatedKVCache step, eager and replayed from a CUDA "
        "graph; fastest_vs_dense: dense SDPA's time over the fastest dilated step's; "
        f"batch{args.batch}_over_batch1: that step with {args.batch} rows at different "
        "positions over one row; prefill: a prompt through a cache in chunks against one "
        "causal forward over it; generate: LongNetLM 'tiny' greedy tokens/s, cached (eager "
        "steps, and on CUDA the captured step) against recomputing every step"
    )
    prefill_cols = ["prefill_len", "chunk", "chunked_ms", "full_forward_ms", "chunked_over_full"]
    hf_cols = ["prompt", "layers", "sdpa_ms", "dilated_ms", "dilated_vs_sdpa"]
    columns = ["part", "context", "prompt", *decode_cols[1:], *prefill_cols, *generate_cols[1:],
               *hf_cols[1:]]  # fmt: skip
    write_record(out.with_suffix(".json"), env, rows, columns=columns, notes=notes)
    table = (
        record_header(env)
        + markdown_table([r for r in rows if r["part"] == "decode"], decode_cols)
        + "\n\n"
        + markdown_table([r for r in rows if r["part"] == "prefill"], prefill_cols)
        + "\n\n"
        + markdown_table([r for r in rows if r["part"] == "generate"], generate_cols)
    )
    if any(r["part"] == "hf" for r in rows):
        table += "\n\n" + markdown_table([r for r in rows if r["part"] == "hf"], hf_cols)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
