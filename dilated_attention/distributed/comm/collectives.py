"""Point-to-point collectives over an ordered list of ranks, on any ``torch.distributed`` backend.

gloo (CPU) has no reduce-scatter and no all-to-all, and both gloo and NCCL need every rank of a
subgroup to take part in creating it; so everything here is built from ``dist.batch_isend_irecv``
between explicit global ranks: a ring over any subset of ranks needs no new process group.
gloo rejects non-contiguous tensors: every buffer sent here is contiguous.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` when not distributed.

    Raises:
        ValueError: ``group`` is given but this process is not a member.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "group was given but torch.distributed is not initialised; call "
                "dist.init_process_group(...) first, or pass group=None for one process"
            )
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given group; "
            "call ring attention only on the group's ranks"
        )
    return rank, dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` in ``group``."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


class Traffic:
    """Bytes this process sent through :func:`exchange` while counted (:func:`count_traffic`):
    every tensor of the attention functions' data (keys, values, rows, gradients, head
    all-to-alls), not the small agreements before a call."""

    def __init__(self) -> None:
        self.bytes = 0


_COUNTERS: list[Traffic] = []


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes this process sends in the block (forward or backward of a ring or
    context-parallel call; nested counts each see them)."""
    traffic = Traffic()
    _COUNTERS.append(traffic)
    try:
        yield traffic
    finally:
        _COUNTERS.remove(traffic)


def exchange(
    send: Sequence[tuple[torch.Tensor, int]], recv: Sequence[tuple[torch.Tensor, int]]
) -> list[dist.Work]:
    """Post sends and receives (to/from global ranks) as one batch; returns the requests."""
    sent = sum(t.numel() * t.element_size() for t, _ in send)
    for counter in _COUNTERS:
        counter.bytes += sent
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in send]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recv]
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def wait_all(requests: Sequence[dist.Work]) -> None:
    """Wait for every request of :func:`exchange`."""
    for req in requests:
        req.wait()


def ring_all_gather(
    tensors: Sequence[torch.Tensor], ranks: Sequence[int], me: int
) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's ``tensors`` (the same shapes everywhere), in the order of ``ranks``, by passing
    them around the ring ``ranks`` (global ranks; ``me`` is this process's index in it) in
    ``len - 1`` steps, all of one rank's tensors in one batch per step."""
    size = len(ranks)
    out: list[tuple[torch.Tensor, ...] | None] = [None] * size
    out[me] = tuple(tensors)
    current = tuple(t.contiguous() for t in tensors)
    for step in range(1, size):
        incoming = tuple(torch.empty_like(t) for t in current)
        wait_all(
            exchange(
                [(t, ranks[(me + 1) % size]) for t in current],
                [(t, ranks[(me - 1) % size]) for t in incoming],
            )
        )
        out[(me - step) % size] = incoming
        current = incoming
    return [t for t in out if t is not None]


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small collective's tensor must live for this group's backend."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: The agreement field of grad mode (:func:`backward_follows`), and its advice on a mismatch.
GRAD_MODE = "grad mode (1: grad enabled and an input requires grad, so a backward may follow)"
GRAD_MODE_FIX = (
    "every rank must call in the same grad mode: all under torch.no_grad() (or with inputs that "
    "do not require grad), or all with grad enabled and inputs that require grad; the backward "
    "exchanges gradients between the ranks, so it cannot run on some ranks only"
)


def backward_follows(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` records a graph that a backward may run through (grad
    enabled and one of them requires grad). Ranks agree on it before a call whose backward
    communicates: a rank that records no graph never runs that backward, and its peers' backward
    would wait for it until the process group's timeout."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_same_on_all_ranks(
    values: Sequence[int],
    names: Sequence[str],
    group: dist.ProcessGroup | None,
    local_error: Exception | None = None,
    *,
    what: str = "ring attention inputs",
    labels: Mapping[str, Sequence[str]] | None = None,
    fixes: Mapping[str, str] | None = None,
    shown: Sequence[object] | None = None,
) -> None:
    """Exchange an error flag and ``values`` (the same count on every rank) in one all-gather,
    then raise on every rank if any rank's inputs were rejected or any value differs.

    Every rank takes part before any other communication, so a bad call is an error everywhere
    instead of a hang. The rank that rejected its inputs re-raises its own error. A rank with a
    ``local_error`` still passes ``len(names)`` values (any, e.g. zeros): the all-gather needs the
    same count everywhere.

    Args:
        values: this rank's integers, one per name.
        names: what each value is, for the messages.
        group: the process group (``None``: the world).
        local_error: this rank's own rejection of its inputs, or ``None``.
        what: what the call checks, for the message of the ranks that did not reject theirs.
        labels: for a name whose values are codes, the label of each code (an unknown code
            prints as itself).
        fixes: for a name, the advice that follows its mismatch message (else: shard alike).
        shown: this rank's readable form of each value (e.g. the schedule a checksum stands
            for), for the mismatch message; gathered only when some value differs.

    Raises:
        Exception: ``local_error``, on its rank.
        ValueError: on every other rank when some rank had a ``local_error``; on every rank when
            a value differs between ranks.
    """
    _, size = group_rank_and_size(group)
    if size == 1:
        if local_error is not None:
            raise local_error
        return
    mine = torch.tensor([int(local_error is not None), *values], dtype=torch.int64)
    mine = mine.to(_collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    if bool(table[:, 0].any()):
        # Rare path, taken by every rank together: tell everyone what the failing ranks said.
        said = f"{type(local_error).__name__}: {local_error}" if local_error else None
        messages: list[str | None] = [None] * size
        dist.all_gather_object(messages, said, group=group)
        if local_error is not None:
            raise local_error
        failed = {r: m for r, m in enumerate(messages) if m is not None}
        raise ValueError(
            f"rank(s) {sorted(failed)} rejected their {what} ({failed}); every rank "
            "must call with valid inputs of the same shape and options"
        )
    differ = [col for col in range(1, table.shape[1]) if len(set(table[:, col].tolist())) > 1]
    if differ:  # every rank sees the same table: all of them take this path together
        everyone: list[Sequence[object] | None] = [None] * size
        dist.all_gather_object(everyone, None if shown is None else list(shown), group=group)
        raise ValueError(_mismatch_message(table, differ, names, everyone, labels, fixes))



def raise_on_all_ranks(
    error: Exception,
    names: Sequence[str],
    group: dist.ProcessGroup | None,
    *,
    what: str = "ring attention inputs",
) -> NoReturn:
    """Take part in an agreement over ``names`` (:func:`check_same_on_all_ranks`) with this
    rank's ``error``, then raise it: for a call rejected on this rank before its ring function's
    own agreement was reached, so that the peers already waiting there raise too, instead of
    waiting until the process group's timeout.

    Raises:
        Exception: ``error`` on this rank (peers raise ``ValueError`` naming this rank).
    """
    check_same_on_all_ranks([0] * len(names), names, group, error, what=what)
    raise error  # not reached: check_same_on_all_ranks raises the local error

def _mismatch_message(
    table: torch.Tensor,
    differ: Sequence[int],
    names: Sequence[str],
    shown: Sequence[Sequence[object] | None],
    labels: Mapping[str, Sequence[str]] | None,
    fixes: Mapping[str, str] | None,
) -> str:
    """What :func:`check_same_on_all_ranks` says when the columns ``differ`` of ``table`` (one
    row per rank: the error flag, then the values) differ: each one's values by rank, readable
    where ``shown`` (per rank, or None) or ``labels`` say how, then the advice."""
    parts, advice = [], []
    for col in differ:
        name = names[col - 1]
        names_of = (labels or {}).get(name)
        column: list[object] = []
        for rank, code in enumerate(table[:, col].tolist()):
            if shown[rank] is not None:
                column.append(shown[rank][col - 1])  # type: ignore[index]
            elif names_of is not None and 0 <= code < len(names_of):
                column.append(names_of[code])
            else:
                column.append(code)
        parts.append(f"{name} differs across ranks ({column} by rank)")
        fix = (fixes or {}).get(name) or (
            "every rank must pass shards of the same shape and the same options; shard with "
            "dilated_attention.shard_sequence"
        )
        if fix not in advice:
            advice.append(fix)
    return f"{'; '.join(parts)}: {'; '.join(advice)}"
