"""Per-request types shared by the scheduler, the runner and the front ends: sampling settings,
requests and their outputs. Plain Python; nothing here touches JAX."""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import time

MAX_TOP_LOGPROBS = 20
_ids = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS token or a stop string
    LENGTH = "length"      # max_tokens or the model's context
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What the client asked for. Carried into jit as batched arrays, never as static args."""

    max_tokens: int = 16
    temperature: float = 1.0         # 0 means greedy
    top_p: float = 1.0               # 1 means off
    top_k: int = 0                   # 0 means off
    min_p: float = 0.0               # 0 means off
    repetition_penalty: float = 1.0  # HF style, over prompt + output; 1 means off
    presence_penalty: float = 0.0    # OpenAI style, over output tokens
    frequency_penalty: float = 0.0   # OpenAI style, over output tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None      # None: no logprobs; k >= 0: chosen token + k alternatives
    n: int = 1

    def __post_init__(self) -> None:
        def bad(field: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", ">= 1", self.max_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", ">= 0", self.temperature)
        if not (0 < self.top_p <= 1):
            raise bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise bad("top_k", ">= 0 (0 disables it)", self.top_k)
        if not (0 <= self.min_p <= 1):
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if not (-2 <= self.presence_penalty <= 2):
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not (-2 <= self.frequency_penalty <= 2):
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad("seed", "in [0, 2**63)", self.seed)
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise bad("logprobs", f"in [0, {MAX_TOP_LOGPROBS}]", self.logprobs)
        if not isinstance(self.n, int) or not (1 <= self.n <= 16):
            raise bad("n", "in [1, 16]", self.n)
        if any(not s for s in self.stop):
            raise bad("stop", "non-empty strings", self.stop)
        if len(self.stop) > 8:
            raise bad("stop", "at most 8 strings", len(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class Request:
    """One sequence to generate. `n > 1` requests are expanded into n Requests sharing a prompt."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    priority: int = 0  # lower runs first; FCFS within a priority
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Tokens produced for one request in one engine step (usually one token)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
