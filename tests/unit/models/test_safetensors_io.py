"""safetensors_io: the `safetensors` library underneath, dpojax's errors (file and tensor named)
on top."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from dpojax.models.safetensors_io import (
    DTYPES,
    ModelFileError,
    TensorReader,
    load_tensors,
    save_tensors,
    tensor_shapes,
)


def _all_dtypes():
    rng = np.random.default_rng(0)
    out = {}
    for name, dtype in DTYPES.items():
        values = rng.normal(size=(3, 5)) * 50
        out[f"t.{name.lower()}"] = values.astype(dtype)
    return out


def _raw_file(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_round_trip_every_dtype_with_pt_metadata(tmp_path):
    tensors = _all_dtypes()
    path = tmp_path / "m.safetensors"
    save_tensors(tensors, path)
    assert not (tmp_path / "m.safetensors.tmp").exists()
    again = load_tensors(path)
    assert sorted(again) == sorted(tensors)
    for name, arr in tensors.items():
        assert again[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(again[name], arr)
    assert again["t.bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    assert header["__metadata__"] == {"format": "pt"}  # what transformers expects
    assert header["t.bf16"]["dtype"] == "BF16" and header["t.bf16"]["shape"] == [3, 5]
    assert tensor_shapes(path) == {name: (3, 5) for name in tensors}
    assert load_tensors(path, ["t.f32"]).keys() == {"t.f32"}


def test_bfloat16_file_reads_in_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    values = np.array([[1.5, -2.25, 3e5]], dtype=ml_dtypes.bfloat16)
    save_tensors({"w": values, "b": np.arange(3, dtype=np.int64)}, tmp_path / "x.safetensors")
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded["w"].dtype == torch.bfloat16
    np.testing.assert_array_equal(loaded["w"].float().numpy(), values.astype(np.float32))
    assert loaded["b"].tolist() == [0, 1, 2]


def test_reader_reads_tensors_of_several_files_on_demand(tmp_path):
    save_tensors({"a": np.ones((2, 3), np.float32)}, tmp_path / "1.safetensors")
    save_tensors({"b": np.zeros(4, np.float16)}, tmp_path / "2.safetensors")
    files = {"a": tmp_path / "1.safetensors", "b": tmp_path / "2.safetensors"}
    with TensorReader(files) as reader:
        assert reader.shape("a") == (2, 3) and reader.shape("b") == (4,)
        a = reader.get("a")
        a += 1  # a copy, writable
        np.testing.assert_array_equal(reader.get("a"), np.ones((2, 3), np.float32))
        assert reader.get("b").dtype == np.float16
        assert len(reader._handles) == 2
    assert not reader._handles
    np.testing.assert_array_equal(a, np.full((2, 3), 2.0, np.float32))


def test_missing_tensor_names_file_and_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    save_tensors({"a": np.ones(2, np.float32)}, path)
    with pytest.raises(ModelFileError, match=r"m\.safetensors: tensor 'nope' is missing"):
        load_tensors(path, ["a", "nope"])
    with (
        TensorReader({"nope": path}) as reader,
        pytest.raises(ModelFileError, match=r"tensor 'nope' is missing"),
    ):
        reader.get("nope")


@pytest.mark.parametrize(
    "header, data, message",
    [
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            bytes(10),
            r"tensor 'w' ends at byte \d+ but the file has only \d+ bytes; the file is truncated",
        ),
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
            bytes(12),
            r"tensor 'w' declares shape \[4\] \(16 bytes of F32\) but spans 12 bytes",
        ),
        (
            {"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}},
            bytes(4),
            r"tensor 'w' has unsupported dtype 'Q4'",
        ),
        (
            {"w": {"dtype": "F32", "data_offsets": [0, 4]}},
            bytes(4),
            r"tensor 'w' has a malformed header entry",
        ),
    ],
)
def test_bad_header_names_the_tensor(tmp_path, header, data, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ModelFileError, match=r"bad\.safetensors: " + message):
        load_tensors(path)


def test_dtype_the_library_knows_but_dpojax_does_not_read(tmp_path):
    header = {"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}
    path = _raw_file(tmp_path / "f8.safetensors", header, bytes(4))
    with pytest.raises(ModelFileError, match=r"f8\.safetensors: tensor 'w' has unsupported dtype"):
        tensor_shapes(path)


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelFileError, match=r"tiny\.safetensors: not a safetensors file"):
        load_tensors(tmp_path / "tiny.safetensors")
    (tmp_path / "text.safetensors").write_bytes(b"this is a text file, not tensors")
    with pytest.raises(ModelFileError, match=r"text\.safetensors: header length \d+ exceeds"):
        load_tensors(tmp_path / "text.safetensors")
    blob = b"{oops}   "
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(ModelFileError, match=r"json\.safetensors: the safetensors header is not"):
        load_tensors(tmp_path / "json.safetensors")


def test_unsavable_dtype_names_the_tensor_and_writes_nothing(tmp_path):
    path = tmp_path / "m.safetensors"
    bad = {"a": np.ones(2, np.float32), "z": np.ones(2, np.complex64)}
    with pytest.raises(ModelFileError, match=r"tensor 'z': dtype complex64 cannot be saved"):
        save_tensors(bad, path)
    assert list(tmp_path.iterdir()) == []


def test_big_endian_input_is_written_little_endian(tmp_path):
    arr = np.arange(4, dtype=">f4")
    save_tensors({"w": arr}, tmp_path / "be.safetensors")
    again = load_tensors(tmp_path / "be.safetensors")["w"]
    np.testing.assert_array_equal(again, arr)


def test_a_full_disk_while_writing_is_the_disks_error_not_the_models(tmp_path, monkeypatch):
    """Before: the library's "No space left on device (os error 28)" became a ModelFileError:
    an export on a full disk exited 3 ("bad data") instead of 74 (the workdir cannot be
    written)."""
    from safetensors import SafetensorError

    from dpojax.errors import EXIT_IO, exit_code_of, exit_line
    from dpojax.models import safetensors_io

    def full(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors_io, "save_file", full)
    target = tmp_path / "export" / "model.safetensors"
    target.parent.mkdir()
    with pytest.raises(OSError) as info:
        save_tensors({"w": np.zeros(3, np.float32)}, target)
    assert exit_code_of(info.value) == EXIT_IO
    line = exit_line(info.value, EXIT_IO, tmp_path)
    assert line.startswith(f"cannot write {target}: No space left on device; free space")
    assert not list(target.parent.iterdir())  # no temporary file left
