"""Regenerates jetstream_pb2.py / jetstream_pb2_grpc.py from jetstream.proto with grpcio-tools.

Run from anywhere: `python -m server.proto.generate`. Protoc is given the repository root as its
include path, so the generated gRPC module imports `server.proto.jetstream_pb2` (a package path).
"""
from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

PROTO = pathlib.Path(__file__).resolve().with_name("jetstream.proto")
ROOT = PROTO.parents[2]  # the directory holding the `server` package
STUBS = ("jetstream_pb2.py", "jetstream_pb2_grpc.py")


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs under `out_root`/server/proto/ and return their paths."""
    rel = PROTO.relative_to(ROOT)
    (out_root / rel.parent).mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--grpc_python_out={out_root}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}; see its message above")
    return [out_root / rel.parent / name for name in STUBS]


def main() -> int:
    for path in generate(ROOT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
