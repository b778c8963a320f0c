"""An HF checkpoint's safetensors files, read by byte range: a whole tensor, a range of its rows
or a range of its columns, each read with positional reads of exactly those bytes.

This is how a trainer rank loads only its own shard of a checkpoint larger than its host memory
(mapping the files would leave the page cache, not the caller, deciding what is read). Every read
is counted, so what a rank reads can be compared with what it holds.

The format (a little-endian u64 header length, a JSON header of dtype, shape and data offsets,
then the data) is simple enough to read directly; the safetensors package writes the files.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_HEADER_LIMIT = 100 * 1024 * 1024
"""The largest header accepted, so a damaged length cannot make a reader allocate gigabytes."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and the absolute offset of its data."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (a whole 1-D tensor's element for 1-D tensors)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its header length")
        length = int.from_bytes(prefix, "little")
        if length > min(_HEADER_LIMIT, size - 8):
            raise ValueError(f"{path} is not a safetensors file: header length {length}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON") from e
    start = 8 + length
    entries = {}
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, raw, start, size)
    return entries


def _entry(path: Path, name: str, raw: dict, start: int, size: int) -> TensorEntry:
    dtype = _DTYPES.get(str(raw.get("dtype")))
    if dtype is None:
        raise ValueError(
            f"{path}: tensor {name} has dtype {raw.get('dtype')!r}; supported: {', '.join(_DTYPES)}"
        )
    shape = tuple(int(d) for d in raw["shape"])
    begin, end = (int(o) for o in raw["data_offsets"])
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or begin < 0 or start + end > size:
        raise ValueError(
            f"{path}: tensor {name} ({raw['dtype']} {list(shape)}) has data offsets "
            f"[{begin}, {end}] that do not fit its shape or the file"
        )
    return TensorEntry(name, path, dtype, shape, start + begin, nbytes)


class CheckpointFiles:
    """The tensors of an HF checkpoint directory (sharded with an index, or its *.safetensors
    files), read by byte range. A context manager: it holds one descriptor per file."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.entries = _entries(self.root)
        self.bytes_read = 0
        """Tensor bytes read so far (headers are not counted)."""
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        found = self.entries.get(name)
        if found is None:
            raise KeyError(f"the checkpoint in {self.root} has no tensor {name}")
        return found

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor."""
        entry = self.entry(name)
        return self._read(entry, entry.offset, entry.nbytes).reshape(entry.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0: one contiguous read."""
        entry = self.entry(name)
        _check_range(entry, 0, start, stop)
        row = entry.row_bytes
        flat = self._read(entry, entry.offset + start * row, (stop - start) * row)
        return flat.reshape(stop - start, *entry.shape[1:])

    def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of a 2-D tensor: one read per row, of that row's columns."""
        entry = self.entry(name)
        if len(entry.shape) != 2:
            raise ValueError(f"{name} has shape {list(entry.shape)}; columns need a 2-D tensor")
        _check_range(entry, 1, start, stop)
        rows, width = entry.shape[0], stop - start
        size = entry.dtype.itemsize
        out = bytearray(rows * width * size)
        view = memoryview(out)
        fd = self._fd(entry.file)
        for row in range(rows):
            at = entry.offset + (row * entry.shape[1] + start) * size
            _pread_into(fd, view[row * width * size : (row + 1) * width * size], at, entry)
        self.bytes_read += len(out)
        return _tensor(out, entry.dtype).reshape(rows, width)

    def _read(self, entry: TensorEntry, offset: int, nbytes: int) -> torch.Tensor:
        out = bytearray(nbytes)
        _pread_into(self._fd(entry.file), memoryview(out), offset, entry)
        self.bytes_read += nbytes
        return _tensor(out, entry.dtype)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd


def _entries(root: Path) -> dict[str, TensorEntry]:
    index_path = root / INDEX_NAME
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {root}; expected an HF checkpoint directory")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        path = root / name
        if not path.is_file():
            raise ValueError(f"{INDEX_NAME} in {root} lists {name}, which does not exist")
        found = read_header(path)
        duplicated = entries.keys() & found.keys()
        if duplicated:
            raise ValueError(f"tensors {sorted(duplicated)[:5]} appear in more than one file")
        entries.update(found)
    if weight_map is not None:
        misplaced = sorted(n for n, e in entries.items() if weight_map.get(n) != e.file.name)
        if set(weight_map) != set(entries) or misplaced:
            diff = sorted(set(weight_map) ^ set(entries)) or misplaced
            raise ValueError(
                f"{INDEX_NAME} in {root} disagrees with the shard contents: {diff[:5]}"
            )
    return entries


def _check_range(entry: TensorEntry, dim: int, start: int, stop: int) -> None:
    if len(entry.shape) <= dim or not 0 <= start <= stop <= entry.shape[dim]:
        raise ValueError(
            f"{entry.name} of shape {list(entry.shape)} has no range [{start}, {stop}) "
            f"along dim {dim}"
        )


def _pread_into(fd: int, view: memoryview, offset: int, entry: TensorEntry) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{entry.file} ends inside tensor {entry.name}")
        done += n


def _tensor(buffer: bytearray, dtype: torch.dtype) -> torch.Tensor:
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


class FileWriter:
    """Writes one safetensors file tensor by tensor, in the order its header lists them: the
    header goes first (every shape and offset is known in advance), each tensor's bytes follow as
    they come, and the file takes its name only once complete (until then it is ``NAME.partial``),
    so a reader never finds a file that ends early."""

    def __init__(self, path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = path
        self._partial = path.with_name(path.name + ".partial")
        self._pending = list(reversed(tensors))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in tensors:
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = self._partial.open("wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the header, cast to its dtype there."""
        if not self._pending:
            raise ValueError(f"{self.path.name}: {name} is not in its header")
        expected, shape, dtype = self._pending[-1]
        if name != expected or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path.name}: got {name} {list(tensor.shape)} where its header has "
                f"{expected} {list(shape)}"
            )
        data = tensor.detach().to("cpu", dtype).contiguous()
        self._file.write(data.view(torch.uint8).numpy().data)
        self._pending.pop()

    def close(self) -> None:
        """Completes the file: flushed to disk, then renamed to its final name."""
        if self._pending:
            raise ValueError(f"{self.path.name}: {self._pending[-1][0]} was never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)

    def abandon(self) -> None:
        """Drops an incomplete file."""
        self._file.close()
        self._partial.unlink(missing_ok=True)
