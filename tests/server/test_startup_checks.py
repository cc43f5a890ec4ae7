"""`slipstream serve` refuses bad paths, ports and key files in one line, before loading a model."""
from __future__ import annotations

import socket

import pytest

from slipstream.server.cli import build_parser, main
from slipstream.server.startup_checks import check_args


def _serve(*flags: str):
    return build_parser().parse_args(["serve", "--port", "0", *flags])


def test_compile_cache_pointing_at_a_file_is_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "cache"
    path.write_text("x")
    assert main(["serve", "--port", "0", "--compile-cache", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is a file, not a directory" in err and "Traceback" not in err


def test_a_port_in_use_fails_before_loading(capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
        # a multi-host worker serves nothing: process 0 may hold the port on the same host
        check_args(build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", str(port), "--process-id", "1",
                                              "--num-processes", "2"]))
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err


def test_grpc_port_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"--grpc-port must be in \[0, 65535\], got 99999"):
        check_args(_serve("--grpc-port", "99999"))


def test_api_key_file_is_read_and_never_combined(tmp_path, monkeypatch) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    args = _serve("--api-key-file", str(key))
    check_args(args)
    assert args.api_key == "s3cret"
    with pytest.raises(ValueError, match="not both"):
        check_args(_serve("--api-key-file", str(key), "--api-key", "other"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty file"):
        check_args(_serve("--api-key-file", str(empty)))
    with pytest.raises(ValueError, match="cannot read it"):
        check_args(_serve("--api-key-file", str(tmp_path / "missing")))
    monkeypatch.setenv("SLIPSTREAM_API_KEY", "from-env")  # the key without a flag, out of `ps`
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
