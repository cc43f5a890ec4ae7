"""Reading a safetensors checkpoint one tensor at a time: the header is parsed once, and each tensor
is read from its byte range into its own array when asked for, in the file's dtype (bf16 stays
bf16), so a loader holds at most the tensor it is converting. Reading (not mapping) the file keeps
the page cache out of the process's resident memory."""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors checkpoint (the message names the file)."""


class SafetensorsFile:
    """name -> (dtype, shape, absolute byte range) of one file; `read` loads one tensor."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise SafetensorsError(f"{path}: too short for a safetensors header ({size} bytes)")
                (header_len,) = struct.unpack("<Q", raw)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise SafetensorsError(f"{path}: header length {header_len} runs past the file ({size} bytes)")
                header = json.loads(f.read(header_len))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: cannot read the safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
        start = 8 + header_len
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = np.dtype(_DTYPES[entry["dtype"]])
                shape = tuple(int(n) for n in entry["shape"])
                begin, end = (int(n) for n in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsError(f"{path}: tensor {name} has a bad header entry {entry!r} ({e})") from None
            if end - begin != int(np.prod(shape)) * dtype.itemsize or begin < 0:
                raise SafetensorsError(f"{path}: tensor {name}'s byte range {begin}..{end} does not hold "
                                       f"{entry['dtype']} {list(shape)}")
            if start + end > size:
                raise SafetensorsError(f"{path}: tensor {name} ends at byte {start + end}, past the end of the "
                                       f"file ({size} bytes; truncated?)")
            self.entries[name] = (dtype, shape, start + begin, end - begin)

    def read(self, name: str) -> np.ndarray:
        dtype, shape, offset, nbytes = self.entries[name]
        try:
            data = np.fromfile(self.path, dtype=np.uint8, count=nbytes, offset=offset)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read tensor {name} ({e})") from None
        if data.size != nbytes:
            raise SafetensorsError(f"{self.path}: tensor {name} is cut short (truncated file?)")
        return data.view(dtype).reshape(shape)


def index_files(files: list[str]) -> dict[str, SafetensorsFile]:
    """tensor name -> the file holding it, over a checkpoint's (sharded) files; headers only."""
    where: dict[str, SafetensorsFile] = {}
    for file in files:
        opened = SafetensorsFile(file)
        for name in opened.entries:
            where.setdefault(name, opened)
    return where
