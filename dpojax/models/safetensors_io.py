"""Reading and writing safetensors files with numpy (bfloat16 through ml_dtypes), with errors that
name the file and the tensor.

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian data. Reading
memory-maps the file, so a checkpoint is never held twice in host memory.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dpojax.errors import InputProblem

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class ModelFileError(InputProblem):
    """A checkpoint file that cannot be used; the message names the file and the tensor or field."""


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and the byte offset where the data starts."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelFileError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER):
            raise ModelFileError(
                f"{path}: header length {n} exceeds the file size ({size} bytes); the file is "
                "truncated or not a safetensors file"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(
                f"{path}: the safetensors header is not valid JSON ({e})"
            ) from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPES:
            raise ModelFileError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise ModelFileError(
                f"{path}: tensor {name!r} declares shape {shape} ({nbytes} bytes of {dtype}) but "
                f"spans {end - begin} bytes"
            )
        if data_start + end > size:
            raise ModelFileError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has only "
                f"{size} bytes; the file is truncated (re-download or re-save it)"
            )
    return header, data_start


def load_tensors(
    path: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as numpy arrays (copies; the file is closed on return)."""
    header, start = read_header(path)
    wanted = [k for k in header if k != "__metadata__"] if names is None else list(names)
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name in wanted:
            if name not in header:
                raise ModelFileError(f"{path}: tensor {name!r} is missing")
            out[name] = _copy_tensor(mm, start, header[name])
    return out


class TensorReader:
    """Tensors by name from several safetensors files, each file memory-mapped once and each
    tensor copied out when asked for (so a checkpoint is never held twice in host memory)."""

    def __init__(self, files: Mapping[str, Path]):
        self.files = dict(files)
        self._maps: dict[Path, tuple[dict, int, mmap.mmap, Any]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        header, _, _, _ = self._open(self.files[name])
        return tuple(header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        path = self.files[name]
        header, start, mm, _ = self._open(path)
        if name not in header:
            raise ModelFileError(f"{path}: tensor {name!r} is missing")
        return _copy_tensor(mm, start, header[name])

    def _open(self, path: Path):
        if path not in self._maps:
            header, start = read_header(path)
            f = open(path, "rb")  # noqa: SIM115 - closed in close()
            self._maps[path] = (header, start, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), f)
        return self._maps[path]

    def close(self) -> None:
        for _, _, mm, f in self._maps.values():
            mm.close()
            f.close()
        self._maps.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _copy_tensor(buffer: mmap.mmap, start: int, info: dict) -> np.ndarray:
    begin, end = info["data_offsets"]
    dtype = DTYPES[info["dtype"]].newbyteorder("<")
    view = np.frombuffer(
        buffer, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
    )
    return view.reshape(info["shape"]).astype(dtype.newbyteorder("="), copy=True)


def save_tensors(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes `tensors` to `path` atomically (a temporary file renamed into place)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise ModelFileError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)
