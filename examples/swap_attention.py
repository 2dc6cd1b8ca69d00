"""Swap ``nn.MultiheadAttention`` in a stock ``nn.TransformerEncoder`` for dilated attention.

    python examples/swap_attention.py                    # CPU: 43 s on 2 shared cores
    python examples/swap_attention.py --seq-len 4096 --steps 200 --device cuda

1. Build a stock ``nn.TransformerEncoder`` (``batch_first=True``).
2. Replace every layer's ``self_attn`` by a ``MultiheadDilatedAttention`` built through
   ``dilated_attention.create_multihead_dilated_attention``, with the stock layer's q/k/v/out
   projection weights copied in. No adapter: the layer takes ``nn.MultiheadAttention``'s call
   (``attn_mask``, ``key_padding_mask``, ``need_weights=False``, ``is_causal``) and has the
   attributes torch's layers read (``batch_first``, ``_qkv_same_embed_dim``, ...), so the stock
   layer calls it in training and in eval alike (torch's fused inference kernels, which would
   compute dense attention, are never taken). The causal mask is accepted as ``attn_mask``; any
   other mask raises a ``ValueError``.
3. With one branch (segment = seq_len, rate 1: plain attention) and ``layer_norm=False`` the swapped
   encoder computes exactly what the stock one does: checked with ``torch.testing.assert_close``.
4. Switch the layers to a LongNet schedule (several segment lengths and dilation rates) and train a
   few steps on a toy causal task (predict the token seen ``--lag`` positions earlier), printing the
   falling loss.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from dilated_attention import MultiheadDilatedAttention, create_multihead_dilated_attention
from dilated_attention.demo import HelpFormatter


def _dilated(
    like: nn.Module, segment_lengths: list[int], dilation_rates: list[int], *, bias: bool
) -> MultiheadDilatedAttention:
    """A dilated layer shaped like ``like`` (stock or dilated), without MAGNETO's sub-LayerNorm
    so that one full branch is exactly ``nn.MultiheadAttention``."""
    weight = like.out_proj.weight
    layer = create_multihead_dilated_attention(
        "dilated", embed_dim=like.embed_dim, num_heads=like.num_heads,
        segment_lengths=segment_lengths, dilation_rates=dilation_rates, layer_norm=False,
        bias=bias, batch_first=like.batch_first, device=weight.device, dtype=weight.dtype,
    )  # fmt: skip
    assert isinstance(layer, MultiheadDilatedAttention)
    return layer


def dilated_from_stock(
    stock: nn.MultiheadAttention,
    segment_lengths: list[int],
    dilation_rates: list[int],
) -> MultiheadDilatedAttention:
    """A dilated layer with ``stock``'s projection weights (``layer_norm=False``: no sub-LN)."""
    E = stock.embed_dim
    layer = _dilated(stock, segment_lengths, dilation_rates, bias=stock.in_proj_bias is not None)
    with torch.no_grad():
        # nn.MultiheadAttention packs the three input projections into one (3E, E) matrix.
        for i, proj in enumerate((layer.q_proj, layer.k_proj, layer.v_proj)):
            proj.weight.copy_(stock.in_proj_weight[i * E : (i + 1) * E])
            if stock.in_proj_bias is not None:
                proj.bias.copy_(stock.in_proj_bias[i * E : (i + 1) * E])
        layer.out_proj.load_state_dict(stock.out_proj.state_dict())
    return layer


def swap_attention(encoder: nn.TransformerEncoder, segments: list[int], rates: list[int]) -> None:
    """Replace each layer's ``self_attn`` in place, weights carried over (stock or swapped)."""
    for layer in encoder.layers:
        old = layer.self_attn
        if isinstance(old, MultiheadDilatedAttention):  # already swapped: a new schedule only
            new = _dilated(old, segments, rates, bias=old.out_proj.bias is not None)
            # Same parameter names and shapes; the state dict also stores the schedule it was
            # built with, and loading refuses another: leave that entry out to change it.
            weights = {k: v for k, v in old.state_dict().items() if not k.endswith("_extra_state")}
            new.load_state_dict(weights)
            layer.self_attn = new
        else:
            layer.self_attn = dilated_from_stock(old, segments, rates)


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--embed-dim", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--layers", type=int, default=2, help="encoder layers")
    p.add_argument("--vocab", type=int, default=16, help="toy task: distinct token ids")
    p.add_argument("--lag", type=int, default=3, help="toy task: predict the token lag back")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    p.add_argument("--steps", type=int, default=60, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (CUDA when available)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    device, N = torch.device(args.device), args.seq_len

    # 1. A stock encoder. dropout=0 so that the comparison below is exact.
    layer = nn.TransformerEncoderLayer(
        args.embed_dim, args.heads, dim_feedforward=4 * args.embed_dim, dropout=0.0,
        batch_first=True,
    )  # fmt: skip
    encoder = nn.TransformerEncoder(layer, args.layers).to(device)
    x = torch.randn(2, N, args.embed_dim, device=device)
    causal = nn.Transformer.generate_square_subsequent_mask(N, device=device)
    encoder.eval()
    with torch.no_grad():
        expected = encoder(x, mask=causal, is_causal=True)

    # 2-3. Swap in dilated attention with one branch covering the whole sequence: plain attention.
    swap_attention(encoder, [N], [1])
    layers = f"{args.layers} layer{'' if args.layers == 1 else 's'}"
    print(f"swapped: {type(encoder.layers[0].self_attn).__name__} in {layers}")
    with torch.no_grad():
        got = encoder(x, mask=causal, is_causal=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    err = (got - expected).abs().max().item()
    print(f"equality check passed: swapped encoder == stock encoder (max abs diff {err:.2e})")

    # 4. A LongNet schedule: segments N/4, N/2, N with rates 1, 2, 4; then train on a toy task.
    segments = [max(1, N // 4), max(1, N // 2), N]
    rates = [1, 2, 4]
    swap_attention(encoder, segments, rates)
    print(f"LongNet schedule: segment_lengths {segments}, dilation_rates {rates}")
    embed = nn.Embedding(args.vocab, args.embed_dim).to(device)
    head = nn.Linear(args.embed_dim, args.vocab).to(device)
    model = nn.ModuleList([embed, encoder, head]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    first = last = float("nan")
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch_size, N), generator=gen).to(device)
        h = encoder(embed(tokens), mask=causal, is_causal=True)
        logits = head(h)[:, args.lag :]  # position i predicts tokens[i - lag]
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), tokens[:, : N - args.lag].flatten()
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last = loss.item()
        if step == 1:
            first = last
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step} loss {last:.4f}")
    print(f"loss {first:.4f} -> {last:.4f} (chance level {torch.tensor(args.vocab).log():.4f})")
    return last


if __name__ == "__main__":
    main()
