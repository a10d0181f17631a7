"""The ``train.packing`` section: sequence packing with a token budget per microbatch.

With packing on, a step's sequences (prompt + response in ``rl``, prompt + answer in
``sft`` / ``train`` on prompt data) are not padded to ``model.seq_length``: whole sequences go
side by side into rows of at most ``max_tokens_per_microbatch`` tokens, each attending only to
itself with its own positions, and the rows are dealt to the data-parallel ranks so that every
rank runs the same number of microbatches (``megatron_logra.packing``). Every pass over the
step's sequences uses the same rows: the policy update, the reference and "old" log-prob passes,
the supervised step.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.config.checks import check_choice, check_positive

PACKING_ALGORITHMS: tuple[str, ...] = ("lpt", "karmarkar_karp")
"""How sequences are spread over a step's rows (megatron_logra.packing.plan): ``lpt``, longest
first into the lightest row; ``karmarkar_karp``, the largest differencing method (tighter
balance, blind to the budget: retried with more rows when a row overflows)."""


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    enabled: bool | None = None
    """None (default): on for ``rl`` and for prompt data (``data.format=prompts``: ``sft``,
    ``train``), where sequences are ragged; off for the corpus, whose windows are all
    ``model.seq_length`` tokens; off with ``model.attention=te`` under context parallelism
    (untested there). Resolved once (Config.resolved)."""
    max_tokens_per_microbatch: int | None = None
    """Tokens of one packed row, padding included (None: ``train.micro_batch_size x
    model.seq_length``, the tokens of one unpacked microbatch, so activation memory stays what
    it was). A multiple of ``parallel.tp`` under sequence parallelism, of ``2 x parallel.cp``
    (x tp under SP) under context parallelism, which pads every sequence of a row to that
    multiple. A sequence longer than this is refused."""
    algorithm: str = "lpt"
    """One of PACKING_ALGORITHMS."""

    def validate(self, path: str = "train.packing") -> None:
        if self.max_tokens_per_microbatch is not None:
            check_positive(f"{path}.max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        check_choice(f"{path}.algorithm", self.algorithm, PACKING_ALGORITHMS)


def resolve_packing(packing: PackingConfig, *, data_format: str, command: str,
                    micro_batch_size: int, seq_length: int, row_multiple: int,
                    provided: frozenset[str], cp: int = 1,
                    attention: str = "sdpa") -> PackingConfig:
    """``packing`` with ``enabled`` and ``max_tokens_per_microbatch`` filled in for a run of
    ``command`` (``row_multiple``: what a row's length must be a multiple of -- the TP size
    under sequence parallelism, ``2 * cp`` (x TP under SP) under context parallelism); refuses
    packing a corpus, packing under context parallelism with Transformer Engine's attention
    (its ``thd`` CP path is not tested here; the default turns packing off there) and a budget
    the layout cannot split."""
    path = "train.packing"
    ragged = command == "rl" or data_format == "prompts"
    te_cp = cp > 1 and attention == "te"
    enabled = ragged and not te_cp if packing.enabled is None else packing.enabled
    if enabled and te_cp:
        raise ValueError(
            f"{path}.enabled=true with parallel.cp={cp} and model.attention=te: packed rows "
            f"under context parallelism are built and tested on model.attention=sdpa only; use "
            f"model.attention=sdpa or drop {path}.enabled (it is off by default there)"
        )
    if enabled and not ragged:
        raise ValueError(
            f"{path}.enabled=true with data.format={data_format}: the corpus is cut into windows "
            f"of exactly model.seq_length tokens, so there is no padding to pack away; drop "
            f"{path}.enabled or train on prompt data (data.format=prompts)"
        )
    budget = packing.max_tokens_per_microbatch
    if budget is None:
        budget = micro_batch_size * seq_length
    elif packing.enabled is False and f"{path}.max_tokens_per_microbatch" in provided:
        # (A budget beside packing left to its default is a preset's for the commands that
        # pack: it stays inert for the corpus and with te under context parallelism.)
        raise ValueError(
            f"{path}.max_tokens_per_microbatch={budget} with {path}.enabled=false: the "
            f"unpacked path pads every sequence to model.seq_length and batches "
            f"train.micro_batch_size of them; drop one of the two"
        )
    if enabled and budget % row_multiple:
        why = (f"{row_multiple} (2 x parallel.cp={cp}, x parallel.tp under sequence "
               "parallelism: every sequence of a row is split into 2 * cp equal chunks)"
               if cp > 1 else f"parallel.tp={row_multiple} under sequence parallelism (each "
               "row is split over the TP ranks)")
        raise ValueError(
            f"{path}.max_tokens_per_microbatch={budget} must be a multiple of {why}; use "
            f"{-(-budget // row_multiple) * row_multiple}"
        )
    return PackingConfig(enabled=enabled, max_tokens_per_microbatch=budget,
                         algorithm=packing.algorithm)
