"""The Pallas TPU ragged paged attention, in Pallas' TPU interpret mode on CPU, equals the pure-JAX
reference: decode, prefill (fresh and after a prefix hit), mixed batches, GQA 1/4/8, head_dim 64/128,
sliding window, soft-cap, int8 pages with per-token scales, padding tokens and rows; and writes the
same K/V into the cache."""
from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from slipstream.kernels.tpu.ragged_paged_attention import ragged_paged_attention
from tests.kernels.tpu_cases import SPECS, build, check, tolerance


# Cases that test_short_tail_blocks runs (at shorter pages, in longer blocks; the same kernel paths) and
# test_kernel_matches_reference leaves to it: each case compiles its own programs, most of its time.
# name -> (page size, pages per block, prefetch depth run with eager DMAs and race detection, or None)
SHORT_TAILS = {"decode_gqa4_hd128": (4, 8, None), "mixed_window_softcap": (4, 8, 3), "mixed_int8_hd128": (2, 6, 2)}
ALONE = [s for s in SPECS if s.name not in SHORT_TAILS]


@pytest.mark.parametrize("spec", ALONE, ids=[s.name for s in ALONE])
def test_kernel_matches_reference(spec):
    # small blocks, so items span several KV blocks and prefill chunks several query blocks
    check(spec, interpret=True, atol=tolerance(spec), pages_per_block=2, prefill_rows=8)


def test_multi_row_decode_items():
    """decode_rows 4: a 3-token sequence goes through the decode call, whose 4-row blocks overrun it; and
    one softmax update per page instead of per block of pages."""
    spec = next(s for s in SPECS if s.name == "mixed_window_softcap")
    check(spec, interpret=True, atol=1e-4, pages_per_block=2, decode_rows=4, prefill_rows=16, merge_pages=False)


def test_int8_pages_written_by_the_pallas_write():
    """int8 K/V written by kernels/tpu/kv_write.py (32-token pages: the chunk crosses a page): the cache equals
    the reference's bit for bit and the outputs match."""
    spec = dataclasses.replace(next(s for s in SPECS if s.name == "mixed_int8_hd128"), page_size=32)
    check(spec, interpret=True, atol=tolerance(spec), pages_per_block=2, prefill_rows=8, int8_write="kernel")


@pytest.mark.parametrize("name,kernel", [("decode_gqa4_hd128", False), ("prefill_gqa1_hd64", True)])
def test_float_write_kernel_for_prefill_steps_only(name, kernel):
    """Float K/V go through the Pallas write in a step of more than two tokens a sequence row (a prefill's whole
    pages), and through the scatter in a decode step (the kernel moves a 16-row tile for each decode's row)."""
    args, kwargs, _ = build(next(s for s in SPECS if s.name == name))
    jaxpr = str(jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, **kwargs, interpret=True))(*args))
    assert ("kv_write_float" in jaxpr) == kernel
    assert ("scatter" in jaxpr) != kernel


@pytest.mark.parametrize("name", SHORT_TAILS)
def test_short_tail_blocks(name):
    """An item's last block computes the smallest power of two of pages (or the whole block) holding its keys:
    contexts of 3-21 pages end anywhere in blocks of 8 (and of 6: 4 < used <= 6 takes the whole block).
    With a prefetch depth (3, and the default 2), blocks are fetched that far ahead across items, with the
    interpreter landing each DMA when it starts and watching for races: a fetch into a slot still being read
    would show."""
    page_size, nb, prefetch = SHORT_TAILS[name]
    spec = dataclasses.replace(next(s for s in SPECS if s.name == name), page_size=page_size)
    if prefetch is None:
        check(spec, interpret=True, atol=tolerance(spec), pages_per_block=nb, prefill_rows=8)
        return
    eager = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    check(spec, interpret=eager, atol=tolerance(spec), pages_per_block=nb, prefill_rows=8, prefetch=prefetch,
          int8_write="scatter")
