"""Rotary position embedding (RoPE, Su et al. 2021) at explicit global positions.

Shape legend: B batch, N seq_len (this rank's shard), H heads, D head dim (even).

The positions are passed in rather than assumed to be ``0..N-1``, so a rank holding a shard of a
longer sequence rotates its tokens by their *global* positions
(:func:`dilated_attention.sequence_positions`) and the sharded model computes exactly what the
unsharded one does.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotate pairs of channels by position-dependent angles (the "rotate half" layout of GPT-NeoX).

    Channel ``i`` and ``i + D/2`` form a pair rotated by ``position * base ** (-2i / D)``. For
    a query at position ``m`` and a key at ``n``, ``<rot(q, m), rot(k, n)>`` depends on ``m - n``
    only.

    Args:
        head_dim: D; must be even.
        base: frequency base (10000 in the paper).

    Raises:
        ValueError: ``head_dim`` not a positive even int, ``base`` not positive.

    Holds no parameters or persistent buffers: the state dict is unchanged by it.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive even int, got head_dim={head_dim!r}")
        if head_dim % 2:
            raise ValueError(
                f"head_dim must be even for rotary embeddings (channels rotate in pairs), got "
                f"head_dim={head_dim}; pick embed_dim / num_heads even"
            )
        if not isinstance(base, (int, float)) or isinstance(base, bool) or not base > 0:
            raise ValueError(f"base must be a positive number, got base={base!r}")
        self.head_dim, self.base = head_dim, float(base)

    def _angle_dtype(self, device: torch.device) -> torch.dtype:
        # float64 angles: positions of long sequences (1e6+) times the highest frequency lose
        # whole radians of accuracy in float32. Devices without float64 fall back to float32.
        return torch.float64 if device.type in ("cpu", "cuda") else torch.float32

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables, each (N, 1, D), in ``dtype``, for positions (N,) int."""
        angle_dtype = self._angle_dtype(positions.device)
        half = self.head_dim // 2
        exponent = torch.arange(half, device=positions.device, dtype=angle_dtype) / half
        inv_freq = self.base**-exponent
        angles = positions.to(angle_dtype)[:, None] * inv_freq[None, :]  # (N, D/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # (N, 1, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` by its positions.

        Args:
            x: (B, N, H, D).
            positions: (N,) integer global positions of the N tokens.

        Returns:
            (B, N, H, D), same dtype as ``x``.

        Raises:
            ValueError: shapes do not match.
        """
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (batch, seq_len, num_heads, head_dim={self.head_dim}), got "
                f"x.shape={tuple(x.shape)}"
            )
        if positions.dim() != 1 or positions.shape[0] != x.shape[1]:
            raise ValueError(
                f"positions must have shape (seq_len={x.shape[1]},), got "
                f"positions.shape={tuple(positions.shape)}"
            )
        if positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"positions must be integers, got dtype {positions.dtype}")
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        cos, sin = self.cos_sin(positions, compute)
        xf = x.to(compute)
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
