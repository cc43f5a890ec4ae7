"""`slipstream serve` (slipstream.server.cli.main, the real command) over MockEngine and the byte tokenizer, for tests that
run it in a child process (test_unix_socket.py runs it where TCP sockets fail, as on the lent TPU machine):

    python -m tests.server.mock_serve [--step-sleep-s S] serve --uds PATH ...

Everything after the model load is the product's code: flags, path checks, listeners, drain, exit code.
"""
from __future__ import annotations

import sys

from slipstream.engine.mock_engine import MockEngine
from tests.server.conftest import EOS, ByteTokenizer


def main(argv: list[str]) -> int:
    import slipstream.server.cli

    step_sleep_s = 0.0
    if argv[:1] == ["--step-sleep-s"]:
        step_sleep_s, argv = float(argv[1]), argv[2:]

    def build_engines(args, *, max_slots=None, data_parallel=1):
        engine = MockEngine(vocab_size=ByteTokenizer.vocab_size, eos_token_ids=frozenset({EOS}), max_seq_len=128,
                            max_slots=4, num_pages=128, step_sleep_s=step_sleep_s)
        return [engine], ByteTokenizer(), "mock-model"

    slipstream.server.cli.build_engines = build_engines
    return slipstream.server.cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
