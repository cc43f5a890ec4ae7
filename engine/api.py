"""The narrow contract between the scheduler and a backend (after JetStream's first engine API).

The scheduler owns page bookkeeping and passes page ids in; the engine owns device arrays.
Sampling happens only in `generate`: a prompt's last token is fed to the decode step that
produces the first generated token, so `prefill` writes KV and returns nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from engine.request import SamplingParams, TokenLogprob


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start_pos, start_pos + len(token_ids)) of one sequence, to be written to its pages."""

    token_ids: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]  # the sequence's pages, covering at least start_pos + len(token_ids)


@dataclasses.dataclass(frozen=True)
class SlotState:
    """What `insert` binds to a decode slot: the history the penalties see and the sampling settings."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # non-empty when a preempted sequence resumes
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One occupied slot in a decode step: feed `token_id` at `position`, sample the next token."""

    slot: int
    token_id: int
    position: int
    page_ids: Sequence[int]  # covering at least position + 1


@dataclasses.dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None  # only when the slot's params ask for logprobs


class Engine(Protocol):
    max_slots: int
    page_size: int
    max_seq_len: int
    num_pages: int             # including the reserved padding page 0
    max_prefill_chunk: int     # largest prefill bucket
    eos_token_ids: frozenset[int]

    def prefill(self, chunk: PrefillChunk) -> None:
        """Write the chunk's K/V into its pages, attending over the pages already written."""

    def insert(self, slot: int, state: SlotState) -> None:
        """Bind a prefilled sequence to a decode slot (bookkeeping, no KV copy)."""

    def generate(self, rows: Sequence[DecodeRow]) -> list[Sampled]:
        """One decode step over the given slots; returns one sample per row, in order."""

    def free(self, slot: int) -> None:
        """Forget the slot's sampling state; its pages are the scheduler's to release."""

    @property
    def compile_count(self) -> int:
        """How many XLA compilations this engine has done (flat in steady state)."""
