"""Checksums of checkpoint files, and how many bytes their reads have read (store.py keeps
the manifests that record them; hashed_file.py computes them while writing).

A file's checksum is one of:

- `sha256`: of the whole file, as `sha256sum` prints it. Small files.
- `crc32_tree`: the file cut into `TREE_BLOCK` blocks, each block's CRC-32 (zlib's, 4 bytes
  big-endian), and the sha256 of those digests in order. Large files: several cores checksum
  one file at once, while writing it and again when verifying it. CRC-32 is what the checksum
  is for (a torn write, a flipped bit, a zeroed or misplaced block: any error burst up to 32
  bits is always caught, anything else missed with odds of 1 in 4 billion per block) at twice
  the speed of sha256 (3.8 vs 1.6 GB/s per core where measured), which on a few cores next to
  a fast disk was the difference between checkpointing at disk speed and not. It is not a
  defence against someone who can rewrite the files: they could rewrite the manifest too.
- `sha256_tree`: the same with each block's sha256; written by earlier versions, still verified.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_CHUNK = 8 << 20
TREE_BLOCK = 8 << 20
_checksummed = 0  # bytes the checksum reads below have read, in this process
_checksummed_lock = threading.Lock()


def checksummed_bytes() -> int:
    """checksummed_bytes is how many bytes `sha256_file` and `tree_file` have read so far in
    this process. It moves only as a read returns, so it stands still while a read hangs on
    storage: rank 0's beats while it chooses a checkpoint follow it (resume.py), not a timer."""
    return _checksummed


def _count_checksummed(n: int) -> None:
    global _checksummed
    with _checksummed_lock:  # a += from two threads could lose one's bytes
        _checksummed += n


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            _count_checksummed(len(chunk))
            h.update(chunk)
    return h.hexdigest()


def _crc32_block(block: bytes | memoryview) -> bytes:
    return zlib.crc32(block).to_bytes(4, "big")


def _sha256_block(block: bytes | memoryview) -> bytes:
    return hashlib.sha256(block).digest()


# Block digests of the tree checksums; zlib and hashlib release the GIL on large buffers.
TREE_KINDS = {"crc32_tree": _crc32_block, "sha256_tree": _sha256_block}
TREE_KIND = "crc32_tree"  # what new large files get
CHECKSUM_KINDS = (*TREE_KINDS, "sha256")


def block_digest(block: bytes | memoryview, kind: str = TREE_KIND) -> bytes:
    """block_digest is one TREE_BLOCK's digest for the tree checksum `kind`."""
    return TREE_KINDS[kind](block)


def tree_digest(block_digests: list[bytes]) -> str:
    """tree_digest combines the per-block digests of a file, in order, into its checksum."""
    return hashlib.sha256(b"".join(block_digests)).hexdigest()


def tree_file(path: Path, kind: str = TREE_KIND, threads: int = 0) -> str:
    """tree_file is the tree checksum `kind` of a file, computed by `threads` cores."""
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    digests: list[bytes] = []
    waiting: deque[Future] = deque()
    with path.open("rb", buffering=0) as f, ThreadPoolExecutor(threads) as pool:
        while block := f.read(TREE_BLOCK):
            _count_checksummed(len(block))
            waiting.append(pool.submit(block_digest, block, kind))
            if len(waiting) > 2 * threads:  # bounded read-ahead: a few blocks in memory
                digests.append(waiting.popleft().result())
        digests += [w.result() for w in waiting]
    return tree_digest(digests)
