"""Packed documents: a packed batch against one sequence of the same length and the documents
run one by one.

One run, on CUDA when available (else the CPU): documents of random lengths (log-uniform in
``--doc-lens``, seeded) packed into one row of ``--total`` tokens, H = 16, D = 128 (bf16 on CUDA,
float32 on the CPU), the LongNet schedule of ``longnet_schedule``. Three paths, forward and
forward+backward, each timed as the median of ``--repeats`` runs (CUDA events on CUDA,
``perf_counter`` on the CPU):

- ``packed``: ``dilated_attention(..., cu_seqlens=offsets)`` (the automatic kernel choice);
- ``one sequence``: the same tensors as one sequence (no ``cu_seqlens``) on the kernel the packed
  call chose: what that path reaches without document boundaries;
- ``one sequence (auto)``: the same with the automatic choice, where it picks another kernel
  (FlashAttention-4's slots at 1M tokens when installed, which take no packed documents);
- ``one by one``: each document in its own call, one after another (automatic choice).

And, where ``transformers`` is installed, one training step (forward and backward of the loss)
of a Llama-style model from a config through ``use_dilated_attention``: a
``DataCollatorWithFlattening`` batch of sequences of random lengths against the same sequences
padded to the longest (right padding with an attention mask); tokens per second over the real
tokens.

Effective TFLOP/s count the multiply-adds of the pairs each path computes (each branch's rows
of each segment against themselves, halved under causality; forward+backward = 3.5x forward),
so the packed path and one sequence, which compute different pairs, compare as rates. Memory
(CUDA): peak over the eight tensors every implementation holds (q, k, v, out, their gradients).

    python benchmarks/bench_packed.py  # -> benchmarks/results/packed_<device>.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import (
    OUT_HELP,
    environment,
    markdown_table,
    record_header,
    record_path,
    time_cuda,
    time_fwd_and_fwd_bwd,
    write_record,
)

from dilated_attention import dilated_attention, longnet_schedule
from dilated_attention.core.geometry.documents import document_groups
from dilated_attention.core.geometry.schedule import Schedule
from dilated_attention.resolve import DILATED, Request, resolve

HEADS = 16
#: Forward+backward over forward, in multiply-adds (FlashAttention's convention).
BACKWARD_FACTOR = 3.5


def document_lengths(total: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Log-uniform lengths in [shortest, longest] that add up to ``total`` (the last cut)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=gen))
        length = round(math.exp(math.log(shortest) + u * (math.log(longest) - math.log(shortest))))
        lengths.append(min(length, total - sum(lengths)))
    return lengths


def pair_flops(groups: tuple, head_dim: int, causal: bool) -> float:
    """Forward FLOPs (2 per multiply-add, QK^T and PV) of the pairs row groups compute."""
    flops = 0.0
    for g in groups:
        pairs = g.rows * (g.rows + 1) / 2 if causal else g.rows * g.rows
        flops += 4.0 * g.num_segments * len(g.heads) * pairs * head_dim
    return flops


def kernel_name(q: torch.Tensor, segs: list[int], rates: list[int], causal: bool,
                documents: tuple[int, ...] | None = None) -> str:  # fmt: skip
    """The kernel the automatic choice runs a (packed) dilated call on."""
    request = Request.of(DILATED, q, q, q, schedule=Schedule(segs, rates), is_causal=causal,
                         documents=documents)  # fmt: skip
    strategy = resolve(request)
    assert strategy.kernel is not None
    return strategy.kernel.backend.name


def rows_for(causal: bool, device: torch.device, args: argparse.Namespace) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = document_lengths(args.total, *args.doc_lens, seed=args.seed)
    offsets = [0, *itertools.accumulate(lengths)]
    segs, rates = longnet_schedule(args.total)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, args.total, HEADS, args.head_dim, device=device, dtype=dtype,
                           generator=gen).requires_grad_() for _ in "qkv")  # fmt: skip
    bounds = torch.tensor(offsets)

    def packed() -> torch.Tensor:
        return dilated_attention(q, k, v, segs, rates, is_causal=causal, cu_seqlens=bounds)

    same = kernel_name(q, segs, rates, causal, tuple(offsets))
    auto = kernel_name(q, segs, rates, causal)

    def one_sequence() -> torch.Tensor:
        return dilated_attention(q, k, v, segs, rates, is_causal=causal, backend=same)

    def one_sequence_auto() -> torch.Tensor:
        return dilated_attention(q, k, v, segs, rates, is_causal=causal)

    def one_by_one() -> torch.Tensor:
        parts = [dilated_attention(q[:, a:b], k[:, a:b], v[:, a:b], segs, rates,
                                   is_causal=causal)
                 for a, b in itertools.pairwise(offsets)]  # fmt: skip
        return torch.cat(parts, dim=1)

    packed_flops = pair_flops(document_groups(tuple(offsets), HEADS, tuple(segs), tuple(rates)),
                              args.head_dim, causal)  # fmt: skip
    layout = Schedule(segs, rates).at(args.total, HEADS, HEADS)
    one_flops = pair_flops(layout.groups, args.head_dim, causal)
    flops = {"packed": packed_flops, "one sequence": one_flops,
             "one sequence (auto)": one_flops, "one by one": packed_flops}  # fmt: skip
    paths = [("packed", packed, same), ("one sequence", one_sequence, same)]
    if auto != same:
        paths.append(("one sequence (auto)", one_sequence_auto, auto))
    paths.append(("one by one", one_by_one, "auto"))
    unavoidable = 8 * q.numel() * q.element_size()
    rows = []
    for path, run, kernel in paths:
        timing = time_fwd_and_fwd_bwd(run, [q, k, v], functools.partial(torch.randn_like, q),
                                      warmup=args.warmup, repeats=args.repeats,
                                      device=device)  # fmt: skip
        row = {"causal": causal, "path": path, "kernel": kernel, "documents": len(lengths),
               "total": args.total, **timing}
        row["fwd_tflops"] = flops[path] / timing["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = BACKWARD_FACTOR * flops[path] / timing["fwd_bwd_ms"] / 1e9
        if "fwd_bwd_peak_bytes" in timing:
            row["fwd_bwd_mem_ratio"] = timing["fwd_bwd_peak_bytes"] / unavoidable
        rows.append(row)
    base = {r["path"]: r for r in rows}
    for row in rows:
        row["fwd_bwd_tflops_vs_one_sequence"] = (
            row["fwd_bwd_tflops"] / base["one sequence"]["fwd_bwd_tflops"]
        )
        row["fwd_bwd_speedup_vs_one_by_one"] = (
            base["one by one"]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        )
    return rows


def hf_rows(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """Packed against padded training steps of a Llama-style model (empty without
    ``transformers``)."""
    try:
        import transformers
    except ImportError:
        return []
    from dilated_attention.integrations.transformers import use_dilated_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, longest, vocab = args.hf_hidden, args.hf_longest, 1024
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=longest,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).train()
    use_dilated_attention(model, *longnet_schedule(longest, first_segment=max(64, longest // 8)))
    lengths = document_lengths(args.hf_tokens, max(2, longest // 16), longest, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    packed = transformers.DataCollatorWithFlattening()([{"input_ids": s.tolist()}
                                                        for s in sequences])  # fmt: skip
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    padded = {"input_ids": ids, "attention_mask": mask,
              "labels": ids.masked_fill(mask == 0, -100)}  # fmt: skip
    rows = []
    for path, batch in (("packed", packed), ("padded", padded)):
        on_device = {name: value.to(device) for name, value in batch.items()}

        def step(batch: dict = on_device) -> None:
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()

        ms = time_cuda(step, warmup=args.warmup, repeats=args.repeats, device=device)
        tokens = sum(lengths)
        rows.append({
            "part": "hf", "path": path, "documents": len(lengths), "total": tokens,
            "fwd_bwd_ms": ms["median_ms"], "tokens_per_s": tokens / ms["median_ms"] * 1e3,
            "computed_tokens": int(batch["input_ids"].numel()),
        })  # fmt: skip
    rows[0]["packed_speedup"] = rows[1]["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--total", type=int, default=1048576 if cuda else 16384)
    parser.add_argument("--doc-lens", type=int, nargs=2, default=[1024, 262144] if cuda
                        else [64, 4096], metavar=("SHORTEST", "LONGEST"))  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-tokens", type=int, default=65536 if cuda else 8192)
    parser.add_argument("--hf-longest", type=int, default=16384 if cuda else 1024)
    parser.add_argument("--hf-hidden", type=int, default=1024 if cuda else 256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = [{"part": "attention", **row} for c in causal for row in rows_for(c, device, args)]
    hf = hf_rows(device, args)
    attention_columns = [
        "part", "causal", "path", "kernel", "documents", "total", "fwd_ms", "fwd_tflops",
        "fwd_bwd_ms", "fwd_bwd_tflops", "fwd_bwd_tflops_vs_one_sequence",
        "fwd_bwd_speedup_vs_one_by_one", *(["fwd_bwd_mem_ratio"] if cuda else []),
    ]  # fmt: skip
    columns = [*attention_columns, "tokens_per_s", "packed_speedup"]
    env = environment()
    out = record_path("packed", args.out)
    notes = (
        "packed documents (cu_seqlens) against the same tokens as one sequence on the same "
        "kernel (and on the automatic choice where it differs) and the documents one by one; "
        "TFLOP/s over the pairs each path computes. part hf: one "
        "training step of a Llama-style model, a DataCollatorWithFlattening batch against the "
        "same sequences padded; tokens/s over the real tokens"
    )
    write_record(out.with_suffix(".json"), env, rows + hf, columns=columns, notes=notes)
    table = record_header(env) + markdown_table(rows, attention_columns)
    if hf:
        hf_columns = ["path", "documents", "total", "computed_tokens", "fwd_bwd_ms",
                      "tokens_per_s", "packed_speedup"]  # fmt: skip
        table += "\n\n" + markdown_table(hf, hf_columns)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
