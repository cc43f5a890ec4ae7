"""Regenerates jetstream_pb2.py / jetstream_pb2_grpc.py from jetstream.proto with grpcio-tools.

Run from anywhere: `python -m slipstream.server.proto.generate`. Protoc reads the proto at its import
path, slipstream/server/proto/jetstream.proto in a staging tree, so the generated gRPC module imports
`slipstream.server.proto.jetstream_pb2` (the installed package path).
"""
from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

PROTO = pathlib.Path(__file__).resolve().with_name("jetstream.proto")
IMPORT_PATH = pathlib.PurePosixPath("slipstream/server/proto/jetstream.proto")
STUBS = ("jetstream_pb2.py", "jetstream_pb2_grpc.py")


def _protoc(*outputs: str, stage: pathlib.Path) -> None:
    staged = stage / IMPORT_PATH
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PROTO, staged)
    if protoc.main(["grpc_tools.protoc", f"-I{stage}", *outputs, str(staged)]) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}; see its message above")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs into `out_dir` and return their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        stage = pathlib.Path(tmp)
        _protoc(f"--python_out={stage}", f"--grpc_python_out={stage}", stage=stage)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = [out_dir / name for name in STUBS]
        for path in paths:
            shutil.copyfile(stage / IMPORT_PATH.parent / path.name, path)
    return paths


def descriptor_set(out: pathlib.Path) -> None:
    """Write the FileDescriptorSet protoc makes of jetstream.proto to `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(f"--descriptor_set_out={out}", stage=pathlib.Path(tmp))


def main() -> int:
    for path in generate(PROTO.parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
