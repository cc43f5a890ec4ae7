"""Per-request types shared by the scheduler, the runner and the front ends: sampling settings,
requests and their outputs. Plain Python; nothing here touches JAX."""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import TYPE_CHECKING, Any

from slipstream.engine.errors import InvalidParam

if TYPE_CHECKING:
    from slipstream.engine.structured import Grammar

DEFAULT_MAX_TOKENS = 16         # a request that names none (OpenAI's completions default, gRPC's 0, generate)
MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1            # token counts, top_k and ids travel as int32 arrays
MAX_SEED = 2**63 - 1
MAX_N = 16
MAX_STOP = 8
MAX_STOP_CHARS = 1024            # the stop matcher scans every stop string per token
MAX_TEMPERATURE = 100.0          # far past any useful value; float32 holds it exactly
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are divided by it: keep it a normal float32
MAX_LOGIT_BIAS = 300             # tokens one request may bias (each slot holds this many (id, bias) pairs)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
POOLING = ("mean", "last")       # how an embedding is made of a prompt's last hidden states
_ids = itertools.count()


def _check_int(field: str, value: object, low: int, high: int, note: str = "") -> None:
    # bool is an int subclass; True as a token count is a client bug, not 1
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParam(field, f"{field} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidParam(field, f"{field} must be in [{low}, {high}]{note}, got {value}")


def _check_float(field: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidParam(field, f"{field} must be a number, got {value!r}")
    # NaN fails both comparisons, so it is rejected with the range
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidParam(field, f"{field} must be in {bracket}{low:g}, {high:g}], got {value!r}")


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS token or a stop string
    LENGTH = "length"      # max_tokens or the model's context
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What the client asked for. Carried into jit as batched arrays, never as static args."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the model's context (chat without a limit)
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
    # EOS and stop_token_ids masked, and stop strings not matched, before this many tokens (a constrained reply
    # still ends when its grammar does)
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    include_stop_str_in_output: bool = False  # a matched stop string ends the text instead of being cut off
    skip_special_tokens: bool = True          # special tokens (<|im_start|>...) left out of the text
    ignore_eos: bool = False
    logprobs: int | None = None      # None: no logprobs; k >= 0: chosen token + k alternatives
    # None: none; k >= 0: the model's log-probability of each prompt token after the first, given the ones
    # before it, with k alternatives (the prompt is computed whole: no prefix-cache hits below what is scored)
    prompt_logprobs: int | None = None
    # None: generate; "mean" or "last": embed the prompt (max_tokens 0): the mean of its tokens' last hidden states
    # after the final norm, or its last token's (a mean is computed whole: no prefix-cache hits)
    pooling: str | None = None
    n: int = 1
    constraint: Grammar | None = None  # structured output: the sampler masks tokens it refuses
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits before sampling

    def __post_init__(self) -> None:
        # Every range below is documented in the README and fits the int32/float32 arrays the
        # sampler builds: an out-of-range value must fail here, as the caller's error, never on
        # the engine thread (where it would fail every request in flight).
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, MAX_INT32, note=" (0: the prompt only, no output)")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, MAX_INT32, note=" (0 disables it)")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        _check_int("n", self.n, 1, MAX_N)
        _check_int("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids:
                raise InvalidParam("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
            for token in self.allowed_token_ids:
                _check_int("allowed_token_ids", token, 0, MAX_INT32)
            if self.constraint is not None:
                raise InvalidParam("allowed_token_ids", "allowed_token_ids cannot be combined with structured output "
                                   "(the grammar decides which tokens may come)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                               f"({self.max_tokens})")
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise InvalidParam("pooling", f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")
            if self.max_tokens != 0:
                raise InvalidParam("max_tokens", f"an embedding (pooling) generates nothing: max_tokens must be 0, "
                                   f"got {self.max_tokens}")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidParam(flag, f"{flag} must be a boolean, got {getattr(self, flag)!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", f"stop must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP:
            raise InvalidParam("stop", f"stop must be at most {MAX_STOP} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidParam("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters each")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidParam("stop_token_ids", "stop_token_ids must be a tuple of token ids")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, MAX_INT32)
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"logit_bias must bias at most {MAX_LOGIT_BIAS} tokens, got "
                               f"{len(self.logit_bias) if isinstance(self.logit_bias, tuple) else self.logit_bias!r}")
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InvalidParam("logit_bias", f"logit_bias entries must be (token id, bias) pairs, got {entry!r}")
            _check_int("logit_bias", entry[0], 0, MAX_INT32)
            _check_float("logit_bias", entry[1], *LOGIT_BIAS_RANGE)
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidParam("logit_bias", "logit_bias names a token twice")
        if self.constraint is not None and not callable(getattr(self.constraint, "matcher", None)):
            raise InvalidParam("response_format", "constraint must be a compiled engine.structured.Grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty or a logit bias is on (1/0/0 and no bias are the identity): its sampling reads its slot's
        token counts and bias rows, which the runner writes when it inserts the request."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: what the model's vision tower encodes (its preprocessed pixels) and the run of prompt
    positions its rows fill (each holding the model's image placeholder token). The engine encodes it when a step
    first feeds one of those positions; the prefix cache keys the pages it touches on `digest`."""

    pixels: Any    # numpy f32[3, H, W] (models/image_processor.py)
    offset: int    # the prompt position of its first row
    length: int    # rows it fills (the model's tokens per image)
    digest: bytes  # of the pixel values: the same image reuses cached pages, another never does

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass
class Request:
    """One sequence to generate. `n > 1` requests are expanded into n Requests sharing a prompt."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    priority: int = 0  # lower runs first; FCFS within a priority
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    lora: Any = None   # a models.lora.LoraAdapter to run under; None: the base model
    images: tuple[ImageInput, ...] = ()  # in prompt order, their position runs apart

    @property
    def cache_salt(self) -> bytes:
        """What the prefix cache keys on besides the tokens: KV computed under one adapter is
        never reused under another (or the base model)."""
        return b"" if self.lora is None else self.lora.digest


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
