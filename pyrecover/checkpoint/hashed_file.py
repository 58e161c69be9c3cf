"""Files written at disk speed with their checksum, and read straight into place.

`HashedFile` is how pyrecover writes a large checkpoint file: the bytes are checksummed from
memory while they are written, on a few cores, so the file is never read back to be hashed,
and writes bypass the page cache (O_DIRECT) where the filesystem allows it: on the machines
measured, finding page-cache memory for a large write cost more than the device itself. DCP
mode (dcp_io.py) and memory mode's part files use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import queue
import threading
from concurrent.futures import Future as Task
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from pyrecover.checkpoint import store

BLOCK = store.TREE_BLOCK  # one pipeline buffer: a checksum block, a multiple of any sector
BUFFERS = 3  # per file, besides one per hashing thread: filling, writing, spare


# Pipeline buffers are kept for the life of the process and reused by every file of every
# save: on the VM this was measured on, touching fresh memory cost about 4 ms per MiB, more
# than writing it to disk. A save keeps (BUFFERS + hashing threads) x BLOCK per file it
# writes at once: 40 MiB each by default.
_POOL: list[mmap.mmap] = []
_POOL_LOCK = threading.Lock()


def _open(path: str, direct: bool) -> tuple[int, bool]:
    """_open opens `path` for writing: (fd, whether with O_DIRECT)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError:  # tmpfs and some FUSE mounts refuse O_DIRECT
            pass
    return os.open(path, flags, 0o644), False


def _take_buffers(n: int) -> list[mmap.mmap]:
    with _POOL_LOCK:
        reused = [_POOL.pop() for _ in range(min(n, len(_POOL)))]
    return reused + [mmap.mmap(-1, BLOCK) for _ in range(n - len(reused))]  # page-aligned


def _give_back(buffers: list[mmap.mmap]) -> None:
    with _POOL_LOCK:
        _POOL.extend(buffers)


class HashedFile:
    """HashedFile is a write-only file that checksums what it writes, without reading it back.

    `write` copies into a free page-aligned buffer of `store.TREE_BLOCK` bytes; each full
    buffer is checksummed by a small thread pool (blocks in parallel: a tree checksum of
    store.py, `crc32_tree` unless `kind` says otherwise) while a writer thread writes the
    buffers in order; a buffer is free again once both are done. `close` fsyncs and returns the
    file's manifest entry, {"size": bytes, kind: hex}. An error in the writer is raised by the
    next `write` or by `close`.
    """

    def __init__(self, path: str, direct: bool = True, hash_threads: int = 2,
                 kind: str = store.TREE_KIND) -> None:
        if kind not in store.TREE_KINDS or hash_threads < 1:
            raise ValueError(f"HashedFile: kind must be one of {sorted(store.TREE_KINDS)} and "
                             f"hash_threads >= 1 (got {kind!r}, {hash_threads})")
        self.size = 0
        self.kind = kind
        self.error: BaseException | None = None
        self._digests: list[Task] = []
        self._free: queue.Queue = queue.Queue()
        for buf in _take_buffers(BUFFERS + hash_threads):
            self._free.put(buf)
        self._to_write: queue.Queue = queue.Queue()
        self._buf: mmap.mmap | None = None
        self._fill = 0
        self.fd = -1
        try:  # last, so nothing that can fail leaves it open
            self.fd, self.direct = _open(path, direct)
        except BaseException:
            _give_back(list(self._free.queue))
            raise
        self._hashers = ThreadPoolExecutor(hash_threads, thread_name_prefix="pyrecover-hash")
        self._writer = threading.Thread(target=self._write_loop, name="pyrecover-write",
                                        daemon=True)
        self._writer.start()

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
            take = min(n - done, BLOCK - self._fill)
            self._buf[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == BLOCK:
                self._submit()
        self.size += n
        return n

    def flush(self) -> None:  # torch.save calls it; data leaves on close
        pass

    def _submit(self) -> None:
        block = memoryview(self._buf)[:self._fill]
        digest = self._hashers.submit(store.block_digest, block, self.kind)
        self._digests.append(digest)
        self._to_write.put((self._buf, self._fill, digest))
        self._buf = None

    def _write_loop(self) -> None:
        while (item := self._to_write.get()) is not None:
            buf, n, digest = item
            try:
                if self.error is None:
                    self._write(buf, n)
                digest.result()  # the hasher may still read this buffer
            except BaseException as exc:  # keep the buffers moving; write/close raise it
                if self.error is None:
                    self.error = exc
                wait([digest])  # a failed write: the buffer is free once its hashing ended
            finally:
                self._free.put(buf)

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

    def close(self) -> dict[str, Any]:
        if self.fd < 0:
            raise ValueError("HashedFile closed twice")
        try:
            if self._buf is not None and self._fill:
                self._submit()
            self._to_write.put(None)
            self._writer.join()
            self._hashers.shutdown()
            spare = [self._buf] if self._buf is not None else []
            while not self._free.empty():
                spare.append(self._free.get_nowait())
            self._buf = None
            _give_back(spare)
            if self.error is not None:
                raise self.error
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        return {"size": self.size,
                self.kind: store.tree_digest([d.result() for d in self._digests])}

    def __enter__(self) -> HashedFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving a `with` block by an error abandons the file; `close` stays explicit, since
        it returns the manifest entry."""
        if exc_type is not None:
            self.abandon()

    def abandon(self) -> None:
        """abandon stops the threads after a failed write; the file is left as it is."""
        if self.fd >= 0:
            with contextlib.suppress(BaseException):  # the error that matters is the caller's
                self.close()


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """pread_into fills `view` with the file's bytes from `offset` on (short reads retried)."""
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
