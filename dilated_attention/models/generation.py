"""Sampling from the LongNet language model: :class:`GenerationMixin` gives
:class:`~dilated_attention.models.LongNetLM` its :meth:`~GenerationMixin.generate` and
:meth:`~GenerationMixin.stream`, which decode with one
:class:`~dilated_attention.DilatedKVCache` per layer, or on CUDA with a captured step over
:class:`~dilated_attention.StaticDilatedKVCache` caches (and their windowed forms for the
local layers of a hybrid stack).

Shape legend: B batch, N0 prompt length, V vocab_size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .. import _validation as V
from ..core.decoding.caches import Cache
from ..core.decoding.static_cache import StaticKVCache
from .captured import CapturedStep, KeptStep, cache_addresses, model_addresses
from .config import LongNetConfig

__all__ = ["GenerationMixin"]

#: Devices where :meth:`GenerationMixin.stream` can decode with a captured step.
GRAPH_DEVICE_TYPES = frozenset({"cuda"})
#: The model attribute holding its kept captured step (Note [A captured step kept across calls]
#: in ``captured.py``).
_KEPT = "_kept_captured_step"


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """(B, 1) token ids from (B, V) float logits: the argmax at temperature 0, else a sample
    from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


class GenerationMixin:
    """:meth:`generate` and :meth:`stream` for :class:`~dilated_attention.models.LongNetLM`.

    It reads the model's ``config``, ``blocks``, ``new_caches()`` and ``_check_tokens()``, and
    calls the model on token ids for their (B, N, V) logits.
    """

    config: LongNetConfig
    blocks: nn.ModuleList

    if TYPE_CHECKING:  # what the model provides (LongNetLM, nn.Module)
        training: bool

        def __call__(
            self, tokens: torch.Tensor, *, caches: list[Cache] | None = None
        ) -> torch.Tensor: ...
        def eval(self) -> nn.Module: ...
        def train(self, mode: bool = True) -> nn.Module: ...
        def new_caches(self, *, static: bool = False) -> list[Cache]: ...
        def _check_tokens(self, tokens: object) -> torch.Tensor: ...
        def _ring(self) -> Any | None: ...

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
        cuda_graph: bool | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Sample a continuation, one token at a time: the prompt followed by what
        :meth:`stream` yields.

        Args:
            prompt, max_new_tokens, temperature, top_k, generator, stop_token, cuda_graph:
                as in :meth:`stream`.

        Returns:
            For a (B, N0) prompt, (B, N0 + n) token ids: the prompt followed by the
            n <= ``max_new_tokens`` samples (fewer only when every sequence has produced
            ``stop_token``; a sequence that stopped earlier is filled with ``stop_token``). For a
            list of prompts, a list of 1-D tensors: each prompt followed by its samples, up to
            and including its ``stop_token``.

        Raises:
            ValueError, TypeError: as :meth:`stream`.
        """
        steps = list(
            self.stream(
                prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                generator=generator, stop_token=stop_token, cuda_graph=cuda_graph,
            )
        )  # fmt: skip
        if isinstance(prompt, torch.Tensor):
            return torch.cat([prompt.long(), *steps], dim=1)
        samples = torch.cat(steps, dim=1) if steps else None
        out = []
        for row, tokens in enumerate(prompt):
            sampled = samples[row] if samples is not None else tokens.new_empty(0)
            if stop_token is not None:
                hits = (sampled == stop_token).nonzero()
                sampled = sampled[: int(hits[0]) + 1] if hits.numel() else sampled
            out.append(torch.cat([tokens.long().to(sampled.device), sampled.long()]))
        return out

    def stream(
        self,
        prompt: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
        cuda_graph: bool | None = None,
    ) -> Iterator[torch.Tensor]:
        """Sample a continuation token by token, yielding each step's (B, 1) token ids as soon
        as they are sampled (to print or send them while generation goes on).

        The arguments are checked when this is called, before anything runs. While the iterator
        runs the model is in eval mode; its training mode comes back when the iterator finishes
        or is closed. The prompt runs once into one :class:`~dilated_attention.DilatedKVCache`
        per layer and each new token reads the keys it can see from them (Note [Decoding
        rows]): the same logits as recomputing the whole forward, at a per-token cost set by the
        schedule, not the length. When ``max_seq_len`` is set and the sequence would outgrow it,
        every step instead recomputes the forward over the last ``max_seq_len`` tokens. Local
        attention only: a context-parallel model (ring layers, ``kind="ring"`` or
        ``context_parallel(model, group)``) raises (Note [Generating from a sharded model]).

        On CUDA (``cuda_graph`` None or True) the steps after the prompt decode every row at
        once with static caches (:class:`~dilated_attention.StaticDilatedKVCache`,
        :class:`~dilated_attention.StaticWindowKVCache` for a local layer), as one CUDA graph
        replayed per token (Note [A captured decoding step]): the same tokens, without the
        host's work per layer (docs/benchmarks.md has the tokens per second of both).

        Prompts of different lengths come as a list of 1-D token id tensors: each is sampled
        exactly as it would be alone (no padding: the rows of each length share one batch and
        one set of caches, and the batches advance together, one step at a time).

        Args:
            prompt: (B, N0) token ids, or a list of B 1-D token id tensors (any lengths >= 1).
            max_new_tokens: the most tokens to sample (>= 0).
            temperature: > 0 samples from softmax(logits / temperature); 0 is greedy.
            top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
            generator: a ``torch.Generator`` for reproducible sampling.
            stop_token: a token id in [0, vocab_size) that ends a sequence: once a sequence
                has produced it, its later steps are ``stop_token`` too, and the iterator ends
                after the step where every sequence has (``None``: run ``max_new_tokens``
                steps).
            cuda_graph: True: decode every row at once with the captured step (needs a CUDA
                device and decoding caches: every layer local (dilated or windowed) attention,
                and the longest prompt plus ``max_new_tokens`` within ``max_seq_len``); False:
                one eager forward per step; None (default): the captured step wherever True
                would run, else eager steps. The model keeps the captured step and its caches
                for its next call of the same batch size (:meth:`release_captured_step` frees
                them).

        Yields:
            (B, 1) token ids (int64), one step at a time.

        Raises:
            ValueError: a context-parallel model; bad prompt, ``max_new_tokens < 0``,
                ``temperature`` negative or not finite, ``top_k < 1``, ``stop_token`` not a
                token id.
            TypeError: ``generator`` is not a ``torch.Generator``.
        """
        self._refuse_context_parallel()
        groups = self._prompt_groups(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = Sampling.checked(temperature, top_k, generator, stop_token, self.config)
        if self._check_cuda_graph(cuda_graph, groups, max_new_tokens):
            return self._sample_static(groups, max_new_tokens, sampling)
        return self._sample(groups, max_new_tokens, sampling)

    def _refuse_context_parallel(self) -> None:
        """Raise ``ValueError`` for a model whose attention runs over ranks, before anything
        communicates.

        Note [Generating from a sharded model]
            A context-parallel model's forward takes each rank's shard of one sequence: every
            rank would take its whole prompt as a shard of a longer sequence (other tokens than
            the local model's), and a rank that generates alone would wait for its peers in the
            first collective. Decoding is one sequence in one process, so it needs the local
            model of the same weights; ``generate`` refuses the sharded one on the rank that
            calls it, without a collective, so a rank calling it alone raises too.
        """
        ring = self._ring()
        if ring is None:
            return
        from ..distributed.context import ContextParallel

        group = getattr(ring, "group", None)
        over = "the world" if group is None else (
            str(group) if isinstance(group, ContextParallel) else "a process group"
        )  # fmt: skip
        raise ValueError(
            f"generate and stream decode one sequence in one process, but this model's "
            f"attention layers are context parallel ({type(ring).__name__} over {over}): "
            f"each rank would take its prompt "
            f"as a shard of one longer sequence. Generate with a local model of the same "
            f"weights: build one without the group (LongNetLM(dataclasses.replace("
            f"model.config, kind='dilated')), not passed through context_parallel) and load "
            f"these weights into it (local.load_state_dict(model.state_dict())), or load the "
            f"same checkpoint with load_checkpoint(path, overrides={{'kind': 'dilated'}})"
        )

    def _decodes(self, groups: list[tuple[torch.Tensor, torch.Tensor]], new: int) -> bool:
        """Whether the steps decode with caches: every layer takes one, and the longest prompt
        plus ``new`` tokens fits ``max_seq_len``."""
        cap = self.config.max_seq_len
        longest = max(tokens.shape[1] for _, tokens in groups)
        return (cap is None or longest + new <= cap) and all(
            getattr(block.attn.mha.attention, "decodes_with_cache", False) for block in self.blocks
        )

    def _check_cuda_graph(
        self, cuda_graph: object, groups: list[tuple[torch.Tensor, torch.Tensor]], new: int
    ) -> bool:
        """Whether the steps run captured: ``cuda_graph``, checked (True needs a CUDA device
        and decoding caches; None takes them where they are)."""
        if cuda_graph is not None and not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True, False or None, got {cuda_graph!r}")
        device = groups[0][1].device
        if cuda_graph is None:
            return device.type in GRAPH_DEVICE_TYPES and self._decodes(groups, new)
        if not cuda_graph:
            return False
        if device.type not in GRAPH_DEVICE_TYPES:
            raise ValueError(
                f"cuda_graph=True needs the model and prompt on a CUDA device, got {device}; "
                f"pass cuda_graph=False"
            )
        if not self._decodes(groups, new):
            raise ValueError(
                f"cuda_graph=True needs decoding caches: every layer local (dilated or windowed) "
                f"attention "
                f"and the longest prompt plus max_new_tokens={new} within max_seq_len="
                f"{self.config.max_seq_len} (past it every step recomputes the forward); "
                f"pass cuda_graph=False, or raise max_seq_len"
            )
        return True

    def _prompt_groups(self, prompt: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(rows, tokens)`` per prompt length: the batch rows (int64 indices) and their
        (b, N0) int64 token ids, after checking every prompt."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 2:
                raise ValueError(
                    f"prompt must be a (batch, seq_len) tensor of token ids or a list of 1-D "
                    f"token id tensors (prompts of any lengths), got a {prompt.dim()}-D tensor of "
                    f"shape {tuple(prompt.shape)}; for one prompt pass prompt.unsqueeze(0) (or "
                    f"[prompt], which returns a list)"
                )
            tokens = self._check_tokens(prompt).long()
            return [(torch.arange(tokens.shape[0]), tokens)]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(
                f"prompt must be a (batch, seq_len) tensor of token ids or a non-empty list of "
                f"1-D token id tensors (prompts of different lengths), got {type(prompt).__name__}"
            )
        by_length: dict[int, list[int]] = {}
        for row, tokens in enumerate(prompt):
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
                shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
                raise ValueError(
                    f"prompt[{row}] must be a non-empty 1-D tensor of token ids, got {shape}; "
                    f"pass prompts of one length as a (batch, seq_len) tensor instead"
                )
            if tokens.device != prompt[0].device:
                raise ValueError(
                    f"prompt[{row}] is on {tokens.device} and prompt[0] on {prompt[0].device}; "
                    f"move every prompt to one device"
                )
            self._check_tokens(tokens.unsqueeze(0))
            by_length.setdefault(tokens.numel(), []).append(row)
        return [
            (torch.tensor(rows), torch.stack([prompt[i] for i in rows]).long())
            for rows in by_length.values()
        ]

    def _sample(
        self,
        groups: list[tuple[torch.Tensor, torch.Tensor]],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Iterator[torch.Tensor]:
        """:meth:`stream`'s loop over checked arguments: ``groups`` of (rows, (b, N0) tokens)
        advance together, each with caches of its own."""
        with _eval_mode(self):
            batch = sum(rows.numel() for rows, _ in groups)
            device = groups[0][1].device
            cap = self.config.max_seq_len
            # Per group: its rows, the tokens its next forward reads (with caches the new ones
            # only, else all so far) and its caches.
            states = []
            for rows, tokens in groups:
                decodes = self._decodes([(rows, tokens)], max_new_tokens)
                states.append([rows.to(device), tokens, self.new_caches() if decodes else None])
            stopped = torch.zeros(batch, 1, dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                step = torch.empty(batch, 1, dtype=torch.long, device=device)
                for state in states:
                    rows, tokens, caches = state
                    with torch.no_grad():
                        if caches is not None:  # the new tokens against the cached keys
                            logits = self(tokens, caches=caches)[:, -1, :]
                        else:
                            window = tokens if cap is None else tokens[:, -cap:]
                            logits = self(window)[:, -1, :]
                    nxt = sampling.next(logits, stopped[rows]).to(device)
                    step[rows] = nxt
                    state[1] = nxt if caches is not None else torch.cat([tokens, nxt], dim=1)
                stopped |= sampling.stops(step)
                yield step
                if sampling.stop_token is not None and bool(stopped.all()):
                    return

    @torch.no_grad()
    def _sample_static(
        self,
        groups: list[tuple[torch.Tensor, torch.Tensor]],
        max_new_tokens: int,
        sampling: Sampling,
    ) -> Iterator[torch.Tensor]:
        """:meth:`_sample` with every row decoded at once by a captured step (Note [A captured
        decoding step]): each prompt group into static caches of its own, their rows loaded
        into the batch's caches, each row at its own position."""
        with _eval_mode(self), self._holding_kept_step() as holder:
            batch = sum(rows.numel() for rows, _ in groups)
            device = groups[0][1].device
            recorded_for = model_addresses(self, batch, device)
            kept = holder[0]
            if kept is not None and kept.model == recorded_for:
                caches = kept.caches
                for cache in caches:
                    cache.reset()
            else:
                kept = None
                caches = self.new_caches(static=True)
            logits = torch.empty(batch, self.config.vocab_size, device=device)
            for rows, tokens in groups:
                rows = rows.to(device)
                own = caches if len(groups) == 1 else self.new_caches(static=True)
                logits[rows] = self(tokens, caches=own)[:, -1, :].float()
                if own is not caches:
                    for cache, part in zip(caches, own, strict=True):
                        cache.load_rows(rows, part, batch)  # type: ignore[union-attr]
            made = self._captured_step(kept, recorded_for, caches, max_new_tokens)
            holder[0] = made or holder[0]
            step = None if made is None else made.step
            stopped = torch.zeros(batch, 1, dtype=torch.bool, device=device)
            for i in range(max_new_tokens):
                nxt = sampling.next(logits, stopped).to(device)
                stopped |= sampling.stops(nxt)
                yield nxt
                if sampling.stop_token is not None and bool(stopped.all()):
                    return
                if step is not None and i + 1 < max_new_tokens:
                    logits = step(nxt)

    @contextlib.contextmanager
    def _holding_kept_step(self) -> Iterator[list[KeptStep | None]]:
        """The model's kept step taken out for one call (another call meanwhile, such as a
        second ``stream`` of the same batch size, records its own instead of sharing these
        caches), as ``holder[0]``; what the call leaves there is kept when it ends, where it is
        a CUDA graph (Note [A captured step kept across calls])."""
        holder: list[KeptStep | None] = [self.__dict__.pop(_KEPT, None)]
        try:
            yield holder
        finally:
            if holder[0] is not None and holder[0].step.graph is not None:
                self.__dict__[_KEPT] = holder[0]

    def _captured_step(
        self,
        kept: KeptStep | None,
        recorded_for: tuple[object, ...],
        caches: list[Cache],
        max_new_tokens: int,
    ) -> KeptStep | None:
        """The step of :meth:`_sample_static` with what it reads: ``kept`` where it reads these
        caches' buffers, else a new one (Note [A captured step kept across calls]); None for a
        single new token."""
        if max_new_tokens <= 1:
            return None
        static = cast(list[StaticKVCache], caches)
        buffers = cache_addresses(static)
        if kept is not None and kept.buffers == buffers:
            return kept
        batch, device = cast(int, recorded_for[0]), static[0].key.device  # type: ignore[union-attr]
        return KeptStep(recorded_for, static, buffers, CapturedStep(self, static, batch, device))

    def release_captured_step(self) -> None:
        """Free the captured decoding step and the caches ``generate`` / ``stream`` keep for
        their next call (Note [A captured step kept across calls])."""
        self.__dict__.pop(_KEPT, None)

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without a kept captured step (a CUDA graph is not pickled)."""
        state = self.__dict__.copy()
        state.pop(_KEPT, None)
        return state


@dataclass(frozen=True)
class Sampling:
    """How :meth:`GenerationMixin.stream` picks tokens (its checked arguments)."""

    temperature: float
    top_k: int | None
    generator: torch.Generator | None
    stop_token: int | None

    @classmethod
    def checked(
        cls,
        temperature: object,
        top_k: object,
        generator: object,
        stop_token: object,
        config: LongNetConfig,
    ) -> Sampling:
        """The arguments of :meth:`GenerationMixin.stream`, checked.

        Raises:
            ValueError: ``temperature`` negative or not finite, ``top_k < 1``, ``stop_token``
                not a token id of ``config``'s vocabulary.
            TypeError: ``generator`` is not a ``torch.Generator``.
        """
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ValueError(
                f"temperature must be a finite number >= 0, got temperature={temperature!r} "
                f"({type(temperature).__name__})"
            )
        temperature = V.check_positive_float(
            "temperature", temperature, allow_zero=True,
            fix="0 is greedy decoding, 1.0 samples from the model's distribution",
        )  # fmt: skip
        if top_k is not None:
            V.check_positive_int("top_k", top_k)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {generator!r} "
                f"({type(generator).__name__}); e.g. torch.Generator().manual_seed(0)"
            )
        vocab = config.vocab_size
        if stop_token is not None and (
            isinstance(stop_token, bool)
            or not isinstance(stop_token, int)
            or not 0 <= stop_token < vocab
        ):
            raise ValueError(
                f"stop_token must be a token id in [0, {vocab}) or None, got "
                f"stop_token={stop_token!r}; e.g. the id of your end-of-text token"
            )
        return cls(temperature, top_k, generator, stop_token)  # type: ignore[arg-type]

    def next(self, logits: torch.Tensor, stopped: torch.Tensor) -> torch.Tensor:
        """(B, 1) token ids from (B, V) logits; ``stop_token`` where ``stopped`` (B, 1)."""
        nxt = _next_token(logits.float(), self.temperature, self.top_k, self.generator)
        if self.stop_token is None:
            return nxt
        return nxt.masked_fill(stopped.to(nxt.device), self.stop_token)

    def stops(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, 1) bool: the rows whose ``tokens`` (B, 1) are ``stop_token``."""
        if self.stop_token is None:
            return torch.zeros_like(tokens, dtype=torch.bool)
        return tokens == self.stop_token


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, its training mode back afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
