"""What ``explain(kind="moba" | "nsa")`` says: the calls a layer of blocks selected from the
content makes, each resolved as the library would run it.

Shape legend: N seq_len, H query heads, Hkv key/value heads, bs block size, Mk = ceil(N / bs).
"""

from __future__ import annotations

import dataclasses

from ..backends.registry import BLOCK_SPARSE, DENSE, BackendChoice
from ..block_sparse.runtime import MaskLayout
from ..config import CompressedSelectedWindowConfig
from ..resolve import Request, resolve

__all__ = ["LAYER_KINDS", "explain_layer"]

#: The factory kinds :func:`explain_layer` describes.
LAYER_KINDS = ("moba", "nsa")


def explain_layer(kind: object, request: Request) -> BackendChoice:
    """``explain(kind=...)``: the calls of a MoBA- or NSA-style layer, from the request
    ``explain`` built of its other arguments.

    Note [Explaining a selected-block layer]
        A layer of kind ``"moba"`` makes one block-sparse call on the run-time mask
        ``select_blocks`` chose: its choice is that call's, the selection's cost (pooling and
        a top-k on the device) said in words. A layer of kind ``"nsa"`` makes three: dense
        calls over the compressed keys (one per residue class of the stride, Note [The
        compressed branch exactly, per residue class] in ``sparse/nsa.py``), a block-sparse
        call on a mask per key/value head, and a dense call in a sliding window. Each is
        resolved as such a call would be; the selected blocks' choice is returned (the
        largest of the three where it matters), the three in ``.branches`` and its text.
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind must be one of {LAYER_KINDS} or None, got {kind!r}")
    if request.has_mask or request.dropout_p:
        raise ValueError(
            f"kind={kind!r}: its layers take no key_padding_mask and no dropout (got "
            f"key_padding_mask={request.has_mask}, dropout_p={request.dropout_p})"
        )
    mk = -(-request.key_len // request.block_size)
    heads = request.num_heads if kind == "moba" else request.num_kv_heads
    selected = resolve(dataclasses.replace(
        request, operation=BLOCK_SPARSE, window=None, block_mask=MaskLayout(False, 1, heads, mk)
    )).choice()  # fmt: skip
    if kind == "moba":
        text = (
            f"MoBA-style layer (kind 'moba'): select_blocks picks each query block's key "
            f"blocks on the device (mean-pooled queries and keys, a top-k), then\n{selected}"
        )
        return dataclasses.replace(selected, description=text)
    nsa = CompressedSelectedWindowConfig()
    rows = -(-request.query_len // nsa.compress_stride)
    compressed = resolve(dataclasses.replace(
        request, operation=DENSE, window=None, query_len=rows, key_len=rows
    )).choice()  # fmt: skip
    window = request.window or (nsa.window - 1, 0)
    local = resolve(dataclasses.replace(request, operation=DENSE, window=window)).choice()
    branches = (
        f"compressed keys: {compressed.backend} (causal: about {nsa.compress_stride} calls of "
        f"{rows} rows, one per residue class)",
        f"selected blocks: {selected.backend} (a run-time mask per key/value head)",
        f"window {window}: {local.backend}",
    )
    text = "\n".join([
        "NSA-style layer (kind 'nsa'): three branches, combined by gates or through their "
        "log-sum-exp", *(f"{line.split(':')[0]}:\n{choice}" for line, choice in
                          zip(branches, (compressed, selected, local), strict=True)),
    ])  # fmt: skip
    return dataclasses.replace(selected, branches=branches, description=text)
