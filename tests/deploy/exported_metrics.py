"""What Slipstream's /metrics exposes, read from server.metrics itself so that deploy configs
(HPA, adapter rules, dashboard) are checked against the names the server really emits."""
from __future__ import annotations

import functools

from prometheus_client.parser import text_string_to_metric_families


@functools.lru_cache(maxsize=1)
def exposition() -> str:
    """One /metrics body from the real Metrics class; the engine is the mock (names do not depend on it)."""
    from slipstream.engine.mock_engine import MockEngine
    from slipstream.engine.scheduler import OutputProcessor, Scheduler, SchedulerConfig
    from slipstream.server.metrics import Metrics

    # Never started: a scrape only reads the scheduler's (empty) stats, no tokenizer is used.
    scheduler = Scheduler(MockEngine(), OutputProcessor(None), SchedulerConfig())
    return Metrics(scheduler, lambda: 0).render().decode()


def exposed_samples() -> dict[str, str]:
    """Sample name as a query must spell it (e.g. ..._total, ..._bucket) -> family type."""
    return {sample.name: family.type
            for family in text_string_to_metric_families(exposition()) for sample in family.samples}


def exposed_families() -> dict[str, str]:
    """Family name (e.g. jetstream_time_to_first_token) -> type (gauge, counter, histogram)."""
    return {family.name: family.type for family in text_string_to_metric_families(exposition())}
