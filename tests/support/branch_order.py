"""When autograd makes each branch's gradient and when the branch's backward starts: the order
Note [Branches joined as they come] in ``sparse/branches.py`` holds the library to."""

from __future__ import annotations

from typing import Any

import torch


def watch(total: torch.Tensor, branches: dict[Any, Any], events: list[str]) -> None:
    """Log in ``events`` each time a node of ``total``'s graph has made a gradient for branch
    ``c``'s output node ``branches[c]`` ("gradient c") and each time that node starts its
    backward ("backward c")."""
    seen: set[int] = set()
    stack = [total.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            for c, branch in branches.items():
                if nxt is branch:
                    node.register_hook(lambda *_, c=c: events.append(f"gradient {c}"))
            stack.append(nxt)
    for c, branch in branches.items():
        branch.register_prehook(lambda *_, c=c: events.append(f"backward {c}"))


def most_pending(events: list[str]) -> int:
    """The most branches whose gradient was made and whose backward had not yet started."""
    pending: set[str] = set()
    most = 0
    for event in events:
        kind, c = event.split()
        if kind == "gradient":
            pending.add(c)
        else:
            pending.discard(c)
        most = max(most, len(pending))
    return most


def backward_order(events: list[str]) -> list[str]:
    """The branches in the order their backwards started."""
    return [e.split()[1] for e in events if e.startswith("backward")]
