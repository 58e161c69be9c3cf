"""HashedFile: large checkpoint files written with their checksum, never read back to hash."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import zlib

import pytest

from pyrecover.checkpoint import hashed_file, store

BLOCK = store.TREE_BLOCK


def tree_of(data: bytes, kind: str) -> str:
    """The tree checksum as store.py defines it, computed the plainest way."""
    def digest(block: bytes) -> bytes:
        if kind == "crc32_tree":
            return zlib.crc32(block).to_bytes(4, "big")
        return hashlib.sha256(block).digest()
    return hashlib.sha256(b"".join(digest(data[i:i + BLOCK])
                                   for i in range(0, len(data), BLOCK))).hexdigest()


def direct_io_works(folder) -> bool:
    """Whether this filesystem takes O_DIRECT (tmpfs does not; then both cases are buffered)."""
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


SIZES = [0, 1, 4095, 4096, BLOCK - 1, BLOCK, 2 * BLOCK + 12345]


@pytest.mark.parametrize("kind", list(store.TREE_KINDS))
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("size", SIZES)
def test_a_hashed_file_holds_exactly_what_was_written_and_its_checksum(tmp_path, size, direct,
                                                                        kind):
    rnd = random.Random(size)
    data = rnd.randbytes(size)
    out = hashed_file.HashedFile(str(tmp_path / "f"), direct, kind=kind)
    assert out.direct == (direct and direct_io_works(tmp_path))  # (a tail goes buffered)
    pos = 0
    while pos < size:  # uneven pieces, as torch.save writes headers and storages
        n = min(size - pos, rnd.choice([1, 30, 4096, 1_000_003, 9 << 20]))
        out.write(memoryview(data)[pos:pos + n])
        pos += n
    entry = out.close()
    assert entry == {"size": size, kind: tree_of(data, kind)}
    assert (tmp_path / "f").read_bytes() == data
    assert store.tree_file(tmp_path / "f", kind, threads=3) == entry[kind]
    assert store.checksum_ok(tmp_path / "f", entry)


def test_new_files_get_the_crc32_tree_checksum(tmp_path):
    out = hashed_file.HashedFile(str(tmp_path / "f"))
    out.write(b"x" * 10)
    assert set(out.close()) == {"size", "crc32_tree"}


@pytest.mark.parametrize("kind", list(store.TREE_KINDS))
@pytest.mark.parametrize("damage", ["flip", "zero", "swap"])
def test_damage_to_a_committed_file_fails_verify_and_names_the_checksum(tmp_path, kind, damage):
    pending = store.begin(tmp_path, 1)
    out = hashed_file.HashedFile(str(pending.tmp / "part.bin"), kind=kind)
    out.write(random.Random(0).randbytes(5 * BLOCK // 2))
    pending.files["part.bin"] = out.close()
    for name in (".metadata", "extra.json"):  # what a dcp manifest must list besides
        with pending.open(name) as f:
            f.write(b"{}")
    folder = pending.commit("dcp", 1, {"step": 1})
    store.verify(folder)
    raw = bytearray((folder / "part.bin").read_bytes())
    if damage == "flip":
        raw[BLOCK + 7] ^= 0x10
    elif damage == "zero":  # a block that never reached the disk
        raw[BLOCK:2 * BLOCK] = bytes(BLOCK)
    else:  # two whole blocks in each other's place
        raw[:BLOCK], raw[BLOCK:2 * BLOCK] = raw[BLOCK:2 * BLOCK], raw[:BLOCK]
    (folder / "part.bin").write_bytes(bytes(raw))
    with pytest.raises(store.CheckpointError, match=f"part.bin: {kind} does not match"):
        store.verify(folder)


def test_a_manifest_entry_without_a_known_checksum_is_refused_in_one_line(tmp_path):
    pending = store.begin(tmp_path, 1)
    (pending.tmp / "f").write_bytes(b"abc")
    pending.files["f"] = {"size": 3, "xxh128": "00"}
    folder = pending.commit("dcp", 1, {"step": 1})
    with pytest.raises(store.CheckpointError, match="no checksum this version knows"):
        store.verify(folder)


def test_a_full_disk_is_raised_as_the_os_error_and_the_buffers_come_back():
    before = len(hashed_file._POOL)
    out = hashed_file.HashedFile("/dev/full")  # every write fails with ENOSPC
    with pytest.raises(OSError) as caught:
        out.write(bytes(3 * BLOCK))  # the writer's error surfaces on a later write ...
        out.close()  # ... or at the latest here
    assert caught.value.errno == errno.ENOSPC
    out.abandon()
    assert len(hashed_file._POOL) >= max(before, hashed_file.BUFFERS + 2)


def test_a_failing_checksum_is_raised_and_never_hangs_the_writer(tmp_path, monkeypatch):
    calls = []

    def flaky(block):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("checksum thread failed")
        return b"x"

    monkeypatch.setitem(store.TREE_KINDS, "flaky", flaky)
    out = hashed_file.HashedFile(str(tmp_path / "f"), kind="flaky")
    outcome: list[BaseException] = []

    def run() -> None:  # more blocks than there are buffers: a lost buffer would hang here
        try:
            out.write(bytes(3 * (hashed_file.BUFFERS + 2) * BLOCK))
            out.close()
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "HashedFile hung after a checksum failed"
    assert len(outcome) == 1 and isinstance(outcome[0], MemoryError)
    out.abandon()


def test_a_checksum_kind_that_is_not_a_tree_is_refused_before_the_file_exists(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        hashed_file.HashedFile(str(tmp_path / "f"), kind="sha256")
    assert not (tmp_path / "f").exists()


def test_an_error_inside_a_with_block_stops_the_file_and_returns_its_buffers(tmp_path):
    with pytest.raises(KeyError), hashed_file.HashedFile(str(tmp_path / "f")) as out:
        out.write(bytes(BLOCK + 1))
        raise KeyError("the caller's own error")
    assert out.fd < 0 and not out._writer.is_alive()
    assert len(hashed_file._POOL) >= hashed_file.BUFFERS + 2


def test_every_file_reuses_the_same_pipeline_buffers(tmp_path):
    def write_one() -> set[int]:
        out = hashed_file.HashedFile(str(tmp_path / "f"))
        out.write(bytes(3 * BLOCK + 5))
        out.close()
        return {id(b) for b in hashed_file._POOL}

    first = write_one()
    assert len(first) >= hashed_file.BUFFERS + 2
    assert write_one() == first  # no fresh memory to touch on the next save
