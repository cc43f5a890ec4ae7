"""The narrow contract between the scheduler and a backend: one ragged step.

The scheduler owns page bookkeeping and passes page ids in; the engine owns device arrays. A step
is a flat batch of sequences, each feeding some tokens: a decode feeds one (its last sampled
token), a prefill chunk feeds many. Every sequence whose chunk reaches the end of its known tokens
gets one sample (or several: speculative verification). Sampling settings are bound to a slot with `insert` before the sequence's first
step and forgotten with `free`.

`launch` dispatches a step and returns at once; its samples come back with `result()`. A step may
be launched before the previous one's samples are collected: a decode then feeds PREVIOUS_SAMPLE,
which the engine replaces on the device with the token that slot's latest launched step sampled,
so the host work of one step (collecting, planning, dispatching) overlaps the next step's compute.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from slipstream.engine.request import ImageInput, SamplingParams, TokenLogprob

# A decode's input token that is still on the device: the token the slot's latest launched step
# sampled. Only as the one token of a decode, and never for a grammar-constrained slot whose
# latest sample is uncollected (its mask for this step needs that token on the host).
PREVIOUS_SAMPLE = -1


@dataclasses.dataclass(frozen=True)
class SlotState:
    """What `insert` binds to a sampling slot: the history the penalties see and the settings."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # non-empty when a preempted sequence resumes
    params: SamplingParams
    lora_slot: int = 0   # the device's LoRA slot of its adapter (0: the base model)
    lora: Any = None     # that adapter (models.lora.LoraAdapter), which the engine puts in the slot;
                         # None with a lora_slot: the slot already holds it (multi-host workers)


@dataclasses.dataclass(frozen=True)
class ImageRows:
    """Rows of a chunk that an image fills: the chunk's rows [at, at + count) are the image's rows
    [first, first + count). The engine feeds them in place of the placeholder tokens' embeddings."""

    image: ImageInput
    at: int
    first: int
    count: int

    @property
    def last(self) -> bool:
        """They end the image: no later chunk needs its rows."""
        return self.first + self.count == self.image.length


def image_rows(images: Sequence[ImageInput], start: int, end: int) -> tuple[ImageRows, ...]:
    """The image rows of a chunk of positions [start, end)."""
    out = []
    for image in images:
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            out.append(ImageRows(image, lo - start, lo - image.offset, hi - lo))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StepSeq:
    """One sequence in a step: feed `token_ids` at positions start_pos.., attending over the pages."""

    slot: int                  # its sampling slot (bound by insert)
    token_ids: Sequence[int]   # 1 for a decode (maybe PREVIOUS_SAMPLE), a chunk for a prefill
    start_pos: int             # positions [0, start_pos) are already in its pages
    page_ids: Sequence[int]    # covering at least start_pos + len(token_ids)
    sample: bool               # the chunk ends at its last known token: sample the next one
    # Speculative verification: samples at the chunk's last num_samples positions (its last known
    # token and the drafts after it), in position order. A slot's PREVIOUS_SAMPLE after such a step
    # is its last row's sample, not the accepted one: collect the step before feeding that slot.
    num_samples: int = 1
    lora_slot: int = 0         # its adapter's LoRA slot (SlotState.lora_slot); 0: the base model
    # Prompt scoring (SamplingParams.prompt_logprobs): the tokens after the chunk's first len(targets)
    # positions (the prompt's next tokens); the step returns the model's log-probability of each where it
    # stands, with the slot's top alternatives (StepResult.scores).
    targets: Sequence[int] = ()
    # Embeddings (SamplingParams.pooling): the step returns the sum of the last hidden states (after the final norm)
    # of the chunk's last `pool` rows (StepResult.pooled)
    pool: int = 0
    # Images (a vision-language model): chunk rows fed the image's encoded rows instead of their tokens'
    # embeddings (image_rows)
    images: tuple[ImageRows, ...] = ()

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One engine step: decodes first, then prefill chunks, at most max_num_batched_tokens tokens. A row's role
    is its token's: prompt (a position before the prompt length its slot was inserted with) or generated, and
    with the hybrid weights (EngineConfig.prompt_w16) the roles multiply different weight forms; so there no chunk
    crosses its prompt's end, and the chunks of prompt tokens come after all others (the engine checks)."""

    seqs: Sequence[StepSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def prompt_rows_from(self, prompt_len) -> int:
        """Where the step's prompt rows start: its rows at positions before their slot's prompt length
        (prompt_len[slot], as insert bound it) are its last rows, from this one on (num_tokens if none). Raises
        ValueError where a chunk crosses its prompt's end or a chunk of generated tokens follows a prompt one."""
        at, first = 0, None
        for seq in self.seqs:
            n = len(seq.token_ids)
            prompt = min(max(int(prompt_len[seq.slot]) - seq.start_pos, 0), n)  # the chunk's first rows
            if 0 < prompt < n:
                raise ValueError(f"sequence in slot {seq.slot}: a chunk of positions {seq.start_pos}.."
                                 f"{seq.end_pos - 1} crosses its prompt's end ({int(prompt_len[seq.slot])} tokens)")
            if prompt and first is None:
                first = at
            elif not prompt and first is not None:
                raise ValueError(f"sequence in slot {seq.slot}: a chunk of generated tokens after a chunk of prompt "
                                 "tokens; a step puts the prompt chunks last")
            at += n
        return at if first is None else first


@dataclasses.dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None  # only when the slot's params ask for logprobs


class StepResult(Protocol):
    def result(self) -> list[Sampled]:
        """Block until the step ran; num_samples samples per `sample` sequence, in batch order.
        Collect launched steps in launch order."""

    def scores(self) -> list[tuple[TokenLogprob, ...]]:
        """After result(): per sequence with targets, in batch order, one TokenLogprob per target (its
        log-probability and the slot's prompt_logprobs alternatives)."""

    def pooled(self) -> list[Any]:
        """After result(): per sequence with pool rows, in batch order, the sum of those rows' last hidden states
        (numpy f32[hidden_size])."""


class Engine(Protocol):
    max_slots: int
    page_size: int
    max_seq_len: int
    num_pages: int               # including the reserved padding page 0
    max_num_batched_tokens: int  # tokens per step (the largest step bucket)
    vocab_size: int              # token ids the model accepts (requests are checked against it)
    hidden_size: int             # the width of a pooled hidden state (an embedding)
    eos_token_ids: frozenset[int]

    def insert(self, slot: int, state: SlotState) -> None:
        """Bind a sequence's sampling settings and penalty history to a slot (no KV work)."""

    def launch(self, batch: StepBatch) -> StepResult:
        """Dispatch every sequence's tokens as one program and return without waiting for it."""

    def step(self, batch: StepBatch) -> list[Sampled]:
        """launch(batch).result(): run one step and wait for its samples."""

    def free(self, slot: int) -> None:
        """Forget the slot's sampling state; its pages are the scheduler's to release."""

    @property
    def compile_count(self) -> int:
        """How many XLA compilations this engine has done (flat in steady state)."""
