"""Reading and writing safetensors files through the `safetensors` library (numpy arrays,
bfloat16 through ml_dtypes), with errors that name the file and the tensor.

The library checks a file as it opens it (header, dtypes, offsets, size) and memory-maps it, so a
tensor is copied out when asked for and a checkpoint is never held twice in host memory. Where it
refuses a file its reason is generic ("incomplete metadata, file not fully covered"), so
`_explain` reads the header once more to say which tensor or field is at fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # bfloat16 as a numpy dtype, which safetensors' numpy side reads and writes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dpojax.errors import InputProblem, io_error

# The dtypes dpojax reads and writes (safetensors' names).
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


class ModelFileError(InputProblem):
    """A checkpoint file that cannot be used; the message names the file and the tensor or field."""


def _explain(path: Path, error: Exception) -> str:
    """Why the library refused `path`: the tensor or field at fault where the header tells, else
    the library's own reason."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return f"{path}: not a safetensors file (only {size} bytes)"
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            return (
                f"{path}: header length {n} exceeds the file size ({size} bytes); the file is "
                "truncated or not a safetensors file"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"{path}: the safetensors header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return f"{path}: the safetensors header is not a JSON object"
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return f"{path}: tensor {name!r} has a malformed header entry"
        if dtype not in DTYPES:
            return f"{path}: tensor {name!r} has unsupported dtype {dtype!r}"
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            return (
                f"{path}: tensor {name!r} declares shape {shape} ({nbytes} bytes of {dtype}) but "
                f"spans {end - begin} bytes"
            )
        if 8 + n + end > size:
            return (
                f"{path}: tensor {name!r} ends at byte {8 + n + end} but the file has only "
                f"{size} bytes; the file is truncated (re-download or re-save it)"
            )
    return f"{path}: not a readable safetensors file ({error})"


def _open(path: Path) -> Any:
    """The library's handle on `path` (use it as a context manager), every tensor's dtype
    checked."""
    try:
        handle = safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise ModelFileError(_explain(path, e)) from None
    for name in handle.keys():  # noqa: SIM118 - the handle has keys() only, no iteration
        dtype = handle.get_slice(name).get_dtype()
        if dtype not in DTYPES:
            with handle:
                raise ModelFileError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    return handle


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and the byte offset where its data starts
    (the file validated by the library first, so a bad one is a ModelFileError naming it)."""
    path = Path(path)
    with _open(path):
        pass
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file (its header only)."""
    with _open(Path(path)) as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def _get(handle: Any, path: Path, name: str) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        if name not in handle.keys():  # noqa: SIM118 - no __contains__ either
            raise ModelFileError(f"{path}: tensor {name!r} is missing") from None
        raise ModelFileError(f"{path}: tensor {name!r} cannot be read ({e})") from None


def load_tensors(
    path: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as numpy arrays (copies; the file is closed on return)."""
    path = Path(path)
    with _open(path) as f:
        wanted = f.keys() if names is None else list(names)
        return {name: _get(f, path, name) for name in wanted}


class TensorReader:
    """Tensors by name from several safetensors files, each file opened (memory-mapped) once and
    each tensor copied out when asked for (so a checkpoint is never held twice in host memory).

    With `transient`, a file is mapped only while one tensor is copied out of it: the pages read
    leave the process with the mapping, so its resident memory never holds more of the files
    than one tensor (kept open, every page read stays resident until the reader closes)."""

    def __init__(self, files: Mapping[str, Path], *, transient: bool = False):
        self.files = dict(files)
        self.transient = transient
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()

    def shape(self, name: str) -> tuple[int, ...]:
        if self.transient:
            with _open(self.files[name]) as handle:
                return tuple(handle.get_slice(name).get_shape())
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        path = self.files[name]
        if self.transient:
            with _open(path) as handle:
                return _get(handle, path, name)
        return _get(self._handle(path), path, name)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the tensor `name` (only those copied out of the file)."""
        path = self.files[name]
        with contextlib.ExitStack() as stack:
            handle = stack.enter_context(_open(path)) if self.transient else self._handle(path)
            try:
                return handle.get_slice(name)[start:stop]
            except SafetensorError as e:
                raise ModelFileError(f"{path}: tensor {name!r} cannot be read ({e})") from None

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(_open(path))
        return self._handles[path]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensors_to_save(tensors: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype.newbyteorder("=") not in _NAMES:
            raise ModelFileError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved")
        yield name, arr


def save_tensors(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes `tensors` to `path` atomically (a temporary file renamed into place)."""
    arrays = dict(_tensors_to_save(tensors))
    tmp = Path(str(path) + ".tmp")
    try:
        save_file(arrays, tmp, metadata=dict(metadata or {"format": "pt"}))
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, SafetensorError):
            disk = io_error(e)  # a full or read-only disk: the workdir's problem (exit 74)
            if disk is not None:
                raise OSError(disk.errno, disk.strerror, str(path)) from e
            raise ModelFileError(f"{path}: cannot be written ({e})") from e
        raise
    os.replace(tmp, path)
