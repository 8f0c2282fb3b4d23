"""`torch.save` files (the zip format PyTorch writes since 1.6): the pickle is read by kiln's restricted unpickler,
and each tensor views its storage's bytes in the memory-mapped archive (torch stores them uncompressed), so
opening reads only the pickle and the zip directory, and a tensor's bytes are read when it is used."""

from __future__ import annotations

import math
import struct
import zipfile

import numpy as np

from kiln.ir import RecordError

from .mapping import MappedFile
from .pytorch import TensorRef, load_state_dict

__all__ = ["PyTorchFile"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. sizes), name length, extra length
_PICKLE_PROTOCOL_2 = b"\x80\x02"


class PyTorchFile(MappedFile):
    """A parsed `torch.save` state dict whose tensor bytes stay in the mapped file until asked for."""

    def _parse(self, data: memoryview) -> None:
        self.tensors: dict[str, TensorRef] = {}
        self._storages: dict[str, int] = {}  # storage key -> offset of its bytes in the file
        if bytes(data[:2]) == _PICKLE_PROTOCOL_2:
            raise RecordError(f"{self.path}: a legacy (pre-1.6, non-zip) torch.save file; re-save it with "
                              f"torch.save's default zip format")
        try:
            archive = zipfile.ZipFile(_Reader(data))
            members = {info.filename: info for info in archive.infolist()}
            pickles = [name for name in members if name.count("/") == 1 and name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise RecordError(f"{len(pickles)} top-level data.pkl members, not one")
            prefix = pickles[0][: -len("data.pkl")]
            order = members.get(prefix + "byteorder")
            if order is not None and archive.read(order) != b"little":
                raise RecordError(f"byteorder {archive.read(order)[:16]!r}: only little-endian files are read")
            pickle_bytes = archive.read(members[pickles[0]])
        except RecordError as error:
            raise RecordError(f"{self.path}: {error}") from None
        except Exception as error:  # zipfile's and its decompressors' errors (zlib, bz2, lzma): a damaged archive
            raise RecordError(f"{self.path}: not a torch.save zip archive ({error})"[:300]) from None
        self.tensors = load_state_dict(pickle_bytes, self.path)
        for name, tensor in self.tensors.items():
            key = tensor.storage.key
            if key not in self._storages:
                self._storages[key] = self._storage_start(members.get(f"{prefix}data/{key}"), tensor, name)

    def _storage_start(self, info: zipfile.ZipInfo | None, tensor: TensorRef, name: str) -> int:
        """Where a storage's bytes start in the file, checked to be stored uncompressed and long enough."""
        what = f"{self.path}: tensor {name!r}: storage {tensor.storage.key!r}"
        if info is None:
            raise RecordError(f"{what} is not in the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise RecordError(f"{what} is compressed (method {info.compress_type}); torch stores storages plain")
        nbytes = tensor.storage.numel * tensor.storage.dtype.numpy.itemsize
        if info.file_size < nbytes:
            raise RecordError(f"{what} has {info.file_size:,} bytes, {tensor.storage.numel:,} "
                              f"{tensor.storage.dtype.value} elements need {nbytes:,}")
        data = self.data()
        at = info.header_offset
        if at + _LOCAL_HEADER.size > len(data):
            raise RecordError(f"{what}: its zip header is past the end of the file")
        signature, name_length, extra_length = _LOCAL_HEADER.unpack_from(data, at)
        start = at + _LOCAL_HEADER.size + name_length + extra_length
        if signature != b"PK\x03\x04" or start + nbytes > len(data):
            raise RecordError(f"{what}: its zip entry is damaged or past the end of the file")
        return start

    def array(self, name: str) -> np.ndarray:
        """One tensor as a read-only ndarray viewing the file's bytes (a strided view, as torch stored it)."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise RecordError(f"{self.path}: no tensor named {name!r}")
        storage, dtype = tensor.storage, tensor.storage.dtype.numpy
        start = self._storages[storage.key]
        flat = np.frombuffer(self.data()[start : start + storage.numel * dtype.itemsize], dtype=dtype)
        if not math.prod(tensor.shape):
            return np.zeros(tensor.shape, dtype)
        return np.lib.stride_tricks.as_strided(flat[tensor.offset:], tensor.shape,
                                               tuple(s * dtype.itemsize for s in tensor.stride), writeable=False)


class _Reader:
    """A seekable read-only file over a memoryview, for zipfile (which reads the directory through it)."""

    def __init__(self, data: memoryview):
        self._data, self._at = data, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = max(0, offset if whence == 0 else self._at + offset if whence == 1 else len(self._data) + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n is None or n < 0 else min(len(self._data), self._at + n)
        out = bytes(self._data[self._at : end])
        self._at = max(self._at, end)
        return out

    def seekable(self) -> bool:
        return True
