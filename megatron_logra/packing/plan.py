"""Which sequences of a step go into which microbatch of which data-parallel rank.

A step's sequences (prompt + response, or prompt + answer) are packed whole into rows of at most
``max_tokens`` tokens, several sequences per row, and the rows are dealt to the data-parallel
ranks so that every rank runs the same number of microbatches (Megatron's schedules and the DP
gradient reduction need it) with as even a token count as the algorithm gets:

1. ``k``, the microbatches per rank, starts at the lower bound ``ceil(tokens / (max_tokens *
   dp))`` (rounded up to ``microbatch_multiple``: the interleaved schedule needs a multiple of
   ``pp``) and grows until the algorithm fits every sequence into ``dp * k`` packs of at most
   ``max_tokens``;
2. the algorithm fills those packs: ``lpt`` (longest sequence first into the currently lightest
   pack: never overfills when a fit exists for that order, packs within one sequence of each
   other) or ``karmarkar_karp`` (the largest differencing method for a ``dp * k``-way partition:
   the tightest balance, blind to the budget, so a partition that overflows it is retried with
   more packs);
3. the packs are dealt to the ranks, heaviest first, each to the rank with the fewest tokens
   among those holding fewer than ``k`` packs.

Padding: each sequence is padded to a multiple of ``sequence_multiple`` (1 without context
parallelism; context parallelism needs each sequence in ``2 * cp * tp`` pieces) and each row to
a multiple of ``row_multiple`` (the TP size under sequence parallelism, which splits the row);
``uniform_rows`` pads every row of the step to the longest one (pipeline parallelism: Megatron's
schedules allocate every stage-to-stage message from one ``(seq_length, micro_batch_size)`` per
step; its ``variable_seq_lengths`` would add a shape exchange before every message, and rows
balanced by the algorithm make the padding to the longest small: ~2% at an RL length mix).
``max_tokens`` bounds a row including its padding.

Everything is plain Python on the step's global lengths, identical on every rank, so no rank
needs another's plan. Deterministic: ties are broken by sequence index.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_logra.config.packing import PACKING_ALGORITHMS as ALGORITHMS


@dataclass(frozen=True)
class Pack:
    """One microbatch: whole sequences side by side in one row.

    Attributes:
        indices: the sequences' indices in the step's list, ascending (their order in the row).
        lengths: their real token counts.
        spans: the tokens each occupies in the row (its length padded to ``sequence_multiple``;
            the last one also takes the row's tail padding, so the spans add up to the row).
        row_length: tokens in the row, padding included.
    """

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    spans: tuple[int, ...]
    row_length: int

    @property
    def tokens(self) -> int:
        """Real tokens of the row."""
        return sum(self.lengths)

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each sequence starts in the row."""
        return span_starts(self.spans)


def span_starts(spans: Sequence[int]) -> tuple[int, ...]:
    """Where each of consecutive ``spans`` starts in their row."""
    starts, offset = [], 0
    for span in spans:
        starts.append(offset)
        offset += span
    return tuple(starts)


@dataclass(frozen=True)
class PackPlan:
    """Every data-parallel rank's packs of one step (``ranks[d][i]``: rank d's microbatch i)."""

    ranks: tuple[tuple[Pack, ...], ...]

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank (the same on every rank)."""
        return len(self.ranks[0])

    @property
    def real_tokens(self) -> int:
        return sum(pack.tokens for packs in self.ranks for pack in packs)

    @property
    def processed_tokens(self) -> int:
        """Tokens the model runs on over all data-parallel ranks, padding included."""
        return sum(pack.row_length for packs in self.ranks for pack in packs)

    @property
    def padding_fraction(self) -> float:
        """Padding tokens / processed tokens."""
        return 1.0 - self.real_tokens / self.processed_tokens

    @property
    def row_length(self) -> int:
        """The longest row of the step (every row's length under ``uniform_rows``)."""
        return max(pack.row_length for packs in self.ranks for pack in packs)

    def rank_tokens(self) -> list[int]:
        """Real tokens per data-parallel rank."""
        return [sum(pack.tokens for pack in packs) for packs in self.ranks]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _lpt(sizes: Sequence[int], bins: int, capacity: int) -> list[list[int]] | None:
    """Longest first into the lightest bin (lowest bin index on ties); None if one overflows."""
    heap = [(0, b) for b in range(bins)]
    contents: list[list[int]] = [[] for _ in range(bins)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)
        if load + sizes[index] > capacity:
            return None
        contents[b].append(index)
        heapq.heappush(heap, (load + sizes[index], b))
    return contents


def _karmarkar_karp(sizes: Sequence[int], bins: int, capacity: int) -> list[list[int]] | None:
    """The largest differencing method for a ``bins``-way partition; None if a bin overflows.

    Every sequence starts as a partial partition (itself in one bin, the rest empty); the two
    partial partitions with the largest spread are merged, the heaviest bin of one with the
    lightest of the other, until one remains."""
    heap = []
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        parts = [(sizes[index], (index,))] + [(0, ())] * (bins - 1)
        heap.append((-sizes[index], index, parts))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        a = sorted(a, key=lambda part: (-part[0], part[1]))
        b = sorted(b, key=lambda part: (part[0], part[1]))
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b, strict=True)]
        loads = [part[0] for part in merged]
        heapq.heappush(heap, (-(max(loads) - min(loads)), min(key_a, key_b), merged))
    parts = heap[0][2]
    if max(part[0] for part in parts) > capacity:
        return None
    return [sorted(part[1]) for part in parts]


_FILL = {"lpt": _lpt, "karmarkar_karp": _karmarkar_karp}


def _deal(bins: list[list[int]], sizes: Sequence[int], dp: int, per_rank: int
          ) -> list[list[list[int]]]:
    """Packs to ranks, heaviest first, each to the lightest rank with room (``per_rank`` each);
    a rank's packs keep the order they were dealt in."""
    loads = [sum(sizes[i] for i in b) for b in bins]
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    rank_load = [0] * dp
    for b in sorted(range(len(bins)), key=lambda i: (-loads[i], i)):
        rank = min((r for r in range(dp) if len(ranks[r]) < per_rank),
                   key=lambda r: (rank_load[r], r))
        ranks[rank].append(bins[b])
        rank_load[rank] += loads[b]
    return ranks


def plan_packs(
    lengths: Sequence[int],
    *,
    max_tokens: int,
    dp_size: int,
    algorithm: str = "lpt",
    sequence_multiple: int = 1,
    row_multiple: int = 1,
    microbatch_multiple: int = 1,
    uniform_rows: bool = False,
    budget_name: str = "train.packing.max_tokens_per_microbatch",
) -> PackPlan:
    """Pack sequences of ``lengths`` tokens into rows of at most ``max_tokens`` (the module
    docstring has the rules).

    Args:
        lengths: real tokens of every sequence of the step (all data-parallel ranks').
        max_tokens: the token budget of one row, padding included; a multiple of
            ``row_multiple``.
        dp_size: data-parallel ranks; every one gets the same number of packs.
        algorithm: ``lpt`` or ``karmarkar_karp``.
        sequence_multiple: each sequence's span is its length rounded up to this.
        row_multiple: each row's length is rounded up to this.
        microbatch_multiple: packs per rank are a multiple of this.
        uniform_rows: every row padded to the step's longest row.
        budget_name: the setting ``max_tokens`` came from, for error messages.

    Raises:
        ValueError: a sequence (with its padding) longer than ``max_tokens``, fewer sequences
            than data-parallel ranks, or bad arguments.
    """
    if algorithm not in _FILL:
        raise ValueError(f"packing algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
    for name, value in (("dp_size", dp_size), ("sequence_multiple", sequence_multiple),
                        ("row_multiple", row_multiple),
                        ("microbatch_multiple", microbatch_multiple)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if max_tokens < 1 or max_tokens % row_multiple:
        raise ValueError(f"{budget_name}={max_tokens} must be a positive multiple of "
                         f"{row_multiple} (the row multiple the parallel layout needs)")
    if any(length < 1 for length in lengths):
        raise ValueError(f"every sequence needs at least one token, got lengths {list(lengths)}")
    if len(lengths) < dp_size:
        raise ValueError(f"{len(lengths)} sequences cannot give each of the {dp_size} "
                         "data-parallel ranks a microbatch; use a larger batch")
    spans = [_round_up(length, sequence_multiple) for length in lengths]
    longest = max(range(len(spans)), key=lambda i: (spans[i], -i))
    if spans[longest] > max_tokens:
        padded = (f" ({lengths[longest]} padded to a multiple of {sequence_multiple})"
                  if spans[longest] != lengths[longest] else "")
        raise ValueError(
            f"sequence {longest} takes {spans[longest]} tokens{padded}, more than "
            f"{budget_name}={max_tokens}: a sequence is never split across microbatches; "
            f"raise {budget_name} to at least {_round_up(spans[longest], row_multiple)} or "
            "shorten the sequences (rl.sampling.max_new_tokens, shorter prompts)"
        )
    fill = _FILL[algorithm]
    per_rank = math.ceil(sum(spans) / (max_tokens * dp_size))
    per_rank = _round_up(max(per_rank, 1), microbatch_multiple)
    while True:
        bins = dp_size * per_rank
        if bins >= len(spans):
            # One sequence per pack always fits; the remaining packs stay empty.
            contents = [[i] for i in range(len(spans))] + [[] for _ in range(bins - len(spans))]
        else:
            contents = fill(spans, bins, max_tokens)
        if contents is not None:
            break
        per_rank += microbatch_multiple
    dealt = _deal([sorted(c) for c in contents], spans, dp_size, per_rank)
    rows = [[_round_up(max(sum(spans[i] for i in c), 1), row_multiple) for c in packs]
            for packs in dealt]
    if uniform_rows:
        longest_row = max(max(r) for r in rows)
        rows = [[longest_row] * len(r) for r in rows]
    return PackPlan(ranks=tuple(
        tuple(_pack(content, lengths, spans, row) for content, row in zip(packs, row_lengths,
                                                                          strict=True))
        for packs, row_lengths in zip(dealt, rows, strict=True)
    ))


def _pack(content: list[int], lengths: Sequence[int], spans: Sequence[int], row: int) -> Pack:
    own = [spans[i] for i in content]
    if own:
        own[-1] += row - sum(own)
    return Pack(indices=tuple(content), lengths=tuple(lengths[i] for i in content),
                spans=tuple(own), row_length=row)


def row_multiple(tp: int, sequence_parallel: bool) -> int:
    """What a row's length must be a multiple of without context parallelism: sequence
    parallelism splits it over TP."""
    return tp if sequence_parallel else 1


def layout_multiples(tp: int, sequence_parallel: bool, cp: int = 1) -> tuple[int, int]:
    """``(sequence_multiple, row_multiple)`` of a parallel layout. Under context parallelism
    every sequence of a row is split into ``2 * cp`` chunks (each a multiple of TP under
    sequence parallelism, which splits a rank's local row again), and the row's tail padding
    belongs to its last sequence, so the row takes the same multiple."""
    if cp > 1:
        multiple = 2 * cp * row_multiple(tp, sequence_parallel)
        return multiple, multiple
    return 1, row_multiple(tp, sequence_parallel)

