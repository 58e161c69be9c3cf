"""Fast storage for DCP mode: writes and reads DCP's own file format, with less copying.

The files are exactly what `torch.distributed.checkpoint.FileSystemWriter` writes (one
`torch.save` record per tensor inside `__<rank>_<n>.distcp`, byte offsets in `.metadata`), so
plain `dcp.load` reads them. What differs is the path the bytes take:

- `Writer` serialises with torch.save's zip CRC off (every file gets a sha256 for the manifest
  instead) and streams the bytes through a small pipeline per file: copy into one of a few
  page-aligned buffers, sha256 in one thread, write in another. Each buffer is hashed from
  memory while it is being written, so the file is never read back to be checksummed. Writes
  bypass the page cache (O_DIRECT) where the filesystem allows it: on the machines measured,
  finding page-cache memory for a large write cost more than the device itself. A rank
  writes `threads` files in parallel, split by bytes.
- `Reader` finds each tensor's bytes inside its record and reads them straight into the
  destination tensor (`preadv`), in parallel threads; anything it cannot place that way
  (a dtype change, a partial chunk, a non-contiguous destination) goes through DCP's own
  reader.

`torch.distributed.checkpoint.filesystem._StorageInfo` is private to torch; it is what the
metadata must hold for DCP's reader to find the bytes, and the interop test fails if it moves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import mmap
import os
import queue
import struct
import threading
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

BUFFER = 8 << 20  # one pipeline buffer; a multiple of any device's block size
BUFFERS = 4  # per file: one filling, one hashing, one writing, one spare
SMALL_READ = 4096  # enough to hold the zip headers in front of a tensor's bytes


def default_threads() -> int:
    """default_threads is how many files a rank writes (and reads) at once: its share of the
    cores as torch sees it, at most 4 (beyond that a single device does not get faster)."""
    return max(1, min(4, torch.get_num_threads()))


# --- writing --------------------------------------------------------------------------------

class _Stop(Exception):
    pass


class HashedFile:
    """HashedFile is a write-only file that sha256s what it writes, without reading it back.

    `write` copies into a free buffer; full buffers go to a hashing thread and then to a
    writing thread, in order, and come back free. `close` flushes, fsyncs and returns
    (size, sha256 hex). Any error in a stage is raised by the next `write` or by `close`.
    """

    def __init__(self, path: str, direct: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:  # tmpfs and some FUSE mounts refuse O_DIRECT
                pass
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.size = 0
        self.sha = hashlib.sha256()
        self.error: BaseException | None = None
        self._free: queue.Queue = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(mmap.mmap(-1, BUFFER))  # page-aligned, as O_DIRECT needs
        self._to_hash: queue.Queue = queue.Queue()
        self._to_write: queue.Queue = queue.Queue()
        self._buf: mmap.mmap | None = None
        self._fill = 0
        self._threads = [
            threading.Thread(target=self._stage, args=(self._to_hash, self._hash, self._to_write),
                             name="pyrecover-dcp-hash", daemon=True),
            threading.Thread(target=self._stage, args=(self._to_write, self._write, self._free),
                             name="pyrecover-dcp-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def tell(self) -> int:
        return self.size

    def write(self, data: Any) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        n, done = view.nbytes, 0
        while done < n:
            if self._buf is None:
                self._buf, self._fill = self._free.get(), 0
            take = min(n - done, BUFFER - self._fill)
            self._buf[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == BUFFER:
                self._submit()
        self.size += n
        return n

    def flush(self) -> None:  # torch.save calls it; data leaves on close
        pass

    def _submit(self) -> None:
        self._to_hash.put((self._buf, self._fill))
        self._buf = None

    def _stage(self, inbox: queue.Queue, work: Callable[[mmap.mmap, int], None],
               outbox: queue.Queue) -> None:
        while True:
            item = inbox.get()
            if item is None:
                outbox.put(None)
                return
            if self.error is None:
                try:
                    work(*item)
                except BaseException as exc:  # keep the buffers moving; close() raises it
                    self.error = exc
            outbox.put(item if outbox is not self._free else item[0])

    def _hash(self, buf: mmap.mmap, n: int) -> None:
        self.sha.update(memoryview(buf)[:n])

    def _write(self, buf: mmap.mmap, n: int) -> None:
        view = memoryview(buf)[:n]
        if self.direct and n % 4096:
            self._buffered()  # the file's tail is not a whole number of blocks
        done = 0
        while done < n:
            try:
                done += os.write(self.fd, view[done:])
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self._buffered()  # opened with O_DIRECT, but this filesystem wants more

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> tuple[int, str]:
        try:
            if self._buf is not None and self._fill:
                self._submit()
            self._to_hash.put(None)
            for t in self._threads:
                t.join()
            if self.error is not None:
                raise self.error
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return self.size, self.sha.hexdigest()


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

    After a save, `digests` maps each file this rank wrote to (size, sha256).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None,
                 direct: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.threads = threads or default_threads()
        self.direct = direct
        self.digests: dict[str, tuple[int, str]] = {}

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
        out = HashedFile(os.path.join(self.path, name), self.direct)
        results = []
        try:
            for item in items:
                offset = out.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # torch.save writes the whole storage
                    torch.save(tensor, out)
                length = out.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        except BaseException:
            with contextlib.suppress(BaseException):
                out.close()  # stops its threads; the error that matters is the first one
            raise
        self.digests[name] = out.close()
        return results


# --- reading --------------------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_ZIP_LOCAL = b"PK\x03\x04"
_AFTER_DATA = (b"PK\x07\x08", b"PK\x03\x04", b"PK\x01\x02")  # descriptor, next entry, index


def tensor_bytes_offset(head: bytes) -> int | None:
    """tensor_bytes_offset finds where a tensor's bytes start inside one torch.save record.

    `head` is the record's first bytes. torch.save writes a zip of small entries
    (`data.pkl`, `byteorder`, ...) and then `data/0`, the storage, uncompressed; its local
    headers carry no sizes (they follow the data), so this walks the local headers by their
    signature. Returns the offset of `data/0`'s bytes if they are stored as-is and in
    little-endian order, else None (the caller then lets torch.load do it). The caller checks
    that a zip signature follows the expected number of bytes, which pins the size.
    """
    little = False
    pos = head.find(_ZIP_LOCAL)
    while pos != -1 and pos + _LOCAL_HEADER.size <= len(head):
        fields = _LOCAL_HEADER.unpack_from(head, pos)
        method, nlen, elen = fields[3], fields[9], fields[10]
        name = head[pos + 30:pos + 30 + nlen]
        start = pos + 30 + nlen + elen
        if name.endswith(b"/byteorder"):
            little = head[start:start + 6] == b"little"
        elif name.endswith(b"/data/0"):
            return start if method == 0 and little and start <= len(head) else None
        pos = head.find(_ZIP_LOCAL, start)
    return None


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


class Reader(FileSystemReader):
    """Reader is a DCP storage reader that reads tensors straight into their destination."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None) -> None:
        super().__init__(path)
        self.threads = threads or default_threads()
        self.direct_items = 0  # how many tensors took the fast path (for tests and benchmarks)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan, planner) -> Future:
        fast, slow = [], []
        for req in plan.items:
            (fast if self._placeable(req, planner) else slow).append(req)
        if slow:
            super().read_data(dataclasses.replace(plan, items=slow), planner).wait()
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
                    if moved is not None:  # the record was not as expected: DCP's way
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
        start = tensor_bytes_offset(head)
        if start is None or start + expected + 4 > info.length:
            return req
        if os.pread(fd, 4, info.offset + start + expected) not in _AFTER_DATA:
            return req  # the record holds another number of bytes than the metadata says
        if expected:
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
            _pread_into(fd, view, info.offset + start)
        planner.commit_tensor(req, target)
        self.direct_items += 1
        return None
