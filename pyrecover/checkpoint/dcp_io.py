"""Fast storage for DCP mode: writes and reads DCP's own file format, with less copying.

The files are exactly what `torch.distributed.checkpoint.FileSystemWriter` writes (one
`torch.save` record per tensor inside `__<rank>_<n>.distcp`, byte offsets in `.metadata`), so
plain `dcp.load` reads them. What differs is the path the bytes take:

- `Writer` serialises with torch.save's zip CRC off (every file gets the manifest's checksum
  instead) into a `HashedFile` (hashed_file.py: checksummed from memory while written, on a
  few cores, page cache bypassed). A rank writes `threads` files in parallel, split by bytes.
- `Reader` finds each tensor's bytes inside its record and reads them straight into the
  destination tensor (`preadv`), in parallel threads; anything it cannot place that way
  (a dtype change, a partial chunk, a non-contiguous destination) goes through DCP's own
  reader.

Nothing the Reader reads can run code: `.metadata` goes through a restricted unpickler
(safe_pickle.py) and every non-tensor record through torch's weights-only one before DCP's
planner unpickles it.

`torch.distributed.checkpoint.filesystem._StorageInfo` is private to torch; it is what the
metadata must hold for DCP's reader to find the bytes, and the interop test fails if it moves.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from pyrecover.checkpoint import safe_pickle
from pyrecover.checkpoint.hashed_file import HashedFile, pread_into
from pyrecover.checkpoint.store import CheckpointError, plain_name_problem

SMALL_READ = 4096  # enough to hold the zip headers in front of a tensor's bytes


def default_threads() -> int:
    """default_threads is how many files a rank writes (and reads) at once: its share of the
    cores as torch sees it, at most 4 (beyond that a single device does not get faster)."""
    return max(1, min(4, torch.get_num_threads()))


# --- writing --------------------------------------------------------------------------------

def split_by_bytes(items: list[Any], size: Callable[[Any], int], bins: int) -> list[list[Any]]:
    """split_by_bytes deals items into `bins` lists of nearly equal total size (largest first,
    each to the lightest list), keeping no empty list."""
    bins = max(1, min(bins, len(items)))
    out: list[list[Any]] = [[] for _ in range(bins)]
    load = [0] * bins
    for item in sorted(items, key=size, reverse=True):
        i = load.index(min(load))
        out[i].append(item)
        load[i] += size(item)
    return [b for b in out if b]


def _item_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype
                                                       ).element_size()


class Writer(FileSystemWriter):
    """Writer is a DCP storage writer that writes DCP's format with less copying (see above).

    After a save, `entries` maps each file this rank wrote to its manifest entry (size and
    checksum, from HashedFile).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None,
                 direct: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.threads = threads or default_threads()
        self.direct = direct
        self.entries: dict[str, dict[str, Any]] = {}

    def write_data(self, plan, planner) -> Future:
        prefix = plan.storage_data.prefix
        buckets = split_by_bytes(list(plan.items), _item_bytes, self.threads)
        names = [f"{prefix}{i}.distcp" for i in range(len(buckets))]
        # The zip CRC inside each record would be a second checksum over every byte. The
        # switch is process-wide, so it is set here, once around all of this save's files.
        with serialization_config.patch({"save.compute_crc32": False}), \
                ThreadPoolExecutor(len(buckets) or 1, thread_name_prefix="pyrecover-dcp") as pool:
            jobs = [pool.submit(self._write_file, name, bucket, planner)
                    for name, bucket in zip(names, buckets, strict=True)]
            results = [r for job in jobs for r in job.result()]
        done: Future = Future()
        done.set_result(results)
        return done

    def _write_file(self, name: str, items: list[Any], planner) -> list[WriteResult]:
        results = []
        with HashedFile(os.path.join(self.path, name), self.direct) as out:
            for item in items:
                offset = out.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if not (tensor.is_contiguous() and tensor.storage_offset() == 0
                            and tensor.untyped_storage().nbytes() == tensor.nbytes):
                        # torch.save writes the whole storage, in memory order; a record
                        # of exactly the tensor's bytes can be read straight into place.
                        tensor = tensor.clone(memory_format=torch.contiguous_format)
                    torch.save(tensor, out)
                length = out.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            self.entries[name] = out.close()
        return results


# --- reading --------------------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_ZIP_LOCAL = b"PK\x03\x04"
_AFTER_DATA = (b"PK\x07\x08", b"PK\x03\x04", b"PK\x01\x02")  # descriptor, next entry, index


def _record_entries(head: bytes):
    """_record_entries yields (name, start of its bytes) for each zip entry whose local header
    lies in `head`. torch.save's local headers carry no sizes (a descriptor follows the data),
    so the headers are found by their signature; a caller checks what it relies on."""
    pos = head.find(_ZIP_LOCAL)
    while pos != -1 and pos + _LOCAL_HEADER.size <= len(head):
        fields = _LOCAL_HEADER.unpack_from(head, pos)
        method, nlen, elen = fields[3], fields[9], fields[10]
        start = pos + 30 + nlen + elen
        if method != 0:  # compressed: not torch.save's
            return
        yield head[pos + 30:pos + 30 + nlen], start
        pos = head.find(_ZIP_LOCAL, start)


def _meta_storage(saved_id):
    """_meta_storage stands in for a storage while unpickling a record's `data.pkl`: a storage
    on the meta device has a size and a dtype but no memory, and nothing is read."""
    _, storage_type, _key, _location, numel = saved_id
    dtype = storage_type.dtype
    untyped = torch.UntypedStorage(numel * torch._utils._element_size(dtype), device="meta")
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def record_layout(head: bytes) -> tuple[int, torch.Tensor] | None:
    """record_layout reads the front of one torch.save record of a tensor.

    Returns (where the storage's bytes start, the tensor as a meta tensor: dtype, shape,
    strides, storage offset and storage size) when the storage is stored as-is in
    little-endian order; else None, and the caller lets torch.load do it. `data.pkl` goes
    through torch's weights-only unpickler, as torch.load(weights_only=True) would.
    """
    from torch import _weights_only_unpickler

    layout, little = None, False
    for name, start in _record_entries(head):
        if name.endswith(b"/data.pkl"):
            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(head[start:]),
                                                          encoding="utf-8")
            unpickler.persistent_load = _meta_storage
            try:
                layout = unpickler.load()
            except Exception:  # not a lone tensor, or cut off by the end of `head`
                return None
        elif name.endswith(b"/byteorder"):
            little = head[start:start + 6] == b"little"
        elif name.endswith(b"/data/0"):
            ok = isinstance(layout, torch.Tensor) and little and start <= len(head)
            return (start, layout) if ok else None
    return None


class _WeightsOnlyBytes:
    """_WeightsOnlyBytes is a load planner whose `load_bytes` first unpickles the record with
    torch's weights-only unpickler: DCP's default planner calls `torch.load(weights_only=False)`
    on every non-tensor value (the optimizer's param groups, say)."""

    def __init__(self, planner) -> None:
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, req, value: io.BytesIO) -> None:
        raw = value.read()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"{req.storage_index.fqn}: refused ({type(exc).__name__}); a checkpoint file "
                f"is never allowed to run code") from None
        self._planner.load_bytes(req, io.BytesIO(raw))


class Reader(FileSystemReader):
    """Reader is a DCP storage reader that reads tensors straight into their destination."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None) -> None:
        super().__init__(path)
        # Read (safely) up front: a refused `.metadata` is then one CheckpointError here, not
        # a CheckpointException from inside dcp.load with DCP's tracebacks logged per rank.
        self.checked_metadata = self._load_metadata()
        self.threads = threads or default_threads()
        self.direct_items = 0  # how many tensors took the fast path (for tests and benchmarks)

    def read_metadata(self, *args: Any, **kwargs: Any):
        """read_metadata is FileSystemReader's, with the pickle read by safe_pickle."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = self.checked_metadata if kwargs.get("rank") is None else \
            self._load_metadata(kwargs["rank"])
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _load_metadata(self, rank: int | None = None):
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = safe_pickle.load_metadata(f, path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
        for info in (metadata.storage_data or {}).values():  # DCP opens these names
            name = getattr(info, "relative_path", None)
            if problem := plain_name_problem(name):
                raise CheckpointError(f"{path}: {problem}")
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan, planner) -> Future:
        fast, slow = [], []
        for req in plan.items:
            (fast if self._placeable(req, planner) else slow).append(req)
        if slow:
            super().read_data(dataclasses.replace(plan, items=slow), _WeightsOnlyBytes(planner)
                              ).wait()
        by_file: dict[str, list[Any]] = {}
        for req in fast:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        fds = {name: os.open(os.path.join(self.path, name), os.O_RDONLY) for name in by_file}
        try:
            for fd in fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

            def offset(req) -> int:
                return self.storage_data[req.storage_index].offset

            jobs = [(fds[name], req) for name, reqs in by_file.items()
                    for req in sorted(reqs, key=offset)]
            with ThreadPoolExecutor(self.threads, thread_name_prefix="pyrecover-dcp-read") as pool:
                for moved in pool.map(lambda job: self._read_one(*job, planner), jobs):
                    if moved is None:
                        self.direct_items += 1
                    else:  # the record was not as expected: DCP's way
                        super().read_data(dataclasses.replace(plan, items=[moved]),
                                          planner).wait()
        finally:
            for fd in fds.values():
                os.close(fd)
        done: Future = Future()
        done.set_result(None)
        return done

    def _placeable(self, req, planner) -> bool:
        """_placeable: a whole stored tensor going into a contiguous CPU tensor of its dtype."""
        if req.type != LoadItemType.TENSOR or any(req.storage_offsets):
            return False
        stored = self._metadata.state_dict_metadata.get(req.storage_index.fqn)
        chunk = next((c for c in getattr(stored, "chunks", ())
                      if list(c.offsets) == list(req.storage_index.offset or c.offsets)), None)
        if chunk is None or list(req.lengths) != list(chunk.sizes):
            return False
        target = planner.resolve_tensor(req)
        return (target.device.type == "cpu" and target.is_contiguous()
                and target.dtype == stored.properties.dtype
                and list(target.shape) == list(chunk.sizes))

    def _read_one(self, fd: int, req, planner):
        info = self.storage_data[req.storage_index]
        target = planner.resolve_tensor(req).detach()
        expected = target.numel() * target.element_size()
        head = os.pread(fd, min(SMALL_READ, info.length), info.offset)
        found = record_layout(head)
        if found is None:
            return req
        start, stored = found
        if not (stored.dtype == target.dtype and stored.shape == target.shape
                and stored.is_contiguous() and stored.storage_offset() == 0
                and stored.untyped_storage().nbytes() == expected
                and start + expected + 4 <= info.length):
            return req  # strided, a view, another dtype: torch.load and DCP's copy do it right
        if os.pread(fd, 4, info.offset + start + expected) not in _AFTER_DATA:
            return req  # the record holds another number of bytes than the metadata says
        if expected:
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
            pread_into(fd, view, info.offset + start)
        planner.commit_tensor(req, target)
        return None
