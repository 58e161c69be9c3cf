"""A restart of the same job skips the second checksum pass over files it committed itself,
and only over files nobody touched since: a corrupt file is still never taken as good."""

from __future__ import annotations

import os

import pytest

from pyrecover.checkpoint import store
from pyrecover.checkpoint.store import CheckpointError

JOB = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[1-2]"}


def commit(root, monkeypatch, environ=JOB):
    for key in JOB:
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    pending = store.begin(root, 10)
    for name in ("state.pt", "extra.bin"):
        with pending.open(name) as f:
            f.write(os.urandom(5000))
    return pending.commit("vanilla", 2, {"step": 10})


def flip_first_byte_keeping_times(path):
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    with path.open("r+b") as f:  # in place: same inode, same size
        f.write(data[:1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back; ctime cannot be


def test_the_same_job_on_the_same_nodes_trusts_its_own_record_of_untouched_files(
        tmp_path, monkeypatch):
    folder = commit(tmp_path, monkeypatch)
    assert store.verify(folder, environ=JOB).checked == "same-job record"
    assert store.verify(folder).checked == "checksums"  # no environ: ckpt verify, status


@pytest.mark.parametrize("other", [{"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]"},
                                   {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[3-4]"},
                                   {}])
def test_another_job_other_nodes_or_no_slurm_check_every_byte(tmp_path, monkeypatch, other):
    folder = commit(tmp_path, monkeypatch)
    assert store.verify(folder, environ=other).checked == "checksums"
    flip_first_byte_keeping_times(folder / "state.pt")
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        store.verify(folder, environ=other)


def test_a_file_changed_in_place_with_its_mtime_put_back_is_still_checked_and_refused(
        tmp_path, monkeypatch):
    folder = commit(tmp_path, monkeypatch)
    flip_first_byte_keeping_times(folder / "extra.bin")
    with pytest.raises(CheckpointError, match="extra.bin: crc32_tree|extra.bin: sha256"):
        store.verify(folder, environ=JOB)
    assert [p for _, _, c, p in store.scan(tmp_path, environ=JOB) if c is None]


def test_a_file_replaced_by_a_same_size_copy_is_checked_in_full(tmp_path, monkeypatch):
    folder = commit(tmp_path, monkeypatch)
    path = folder / "state.pt"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    st = path.stat()
    tmp = path.with_name("swap")
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)  # a new inode under the old name
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        store.verify(folder, environ=JOB)


def test_a_checkpoint_written_outside_slurm_carries_no_record(tmp_path, monkeypatch):
    folder = commit(tmp_path, monkeypatch, environ={})
    assert "written_by" not in store.read_manifest(folder)
    assert store.verify(folder, environ=JOB).checked == "checksums"


def test_no_record_is_made_until_a_later_write_would_show_in_the_change_time(tmp_path,
                                                                          monkeypatch):
    """Kernels before 6.13 stamp file times once per tick: a write in the tick of the record
    would leave the stats unchanged. The record waits for a later stamp; where none comes
    (here: recorded times from the future), there is no record and a restart reads every
    byte. The folder is left as it was either way."""
    from pyrecover.checkpoint import trust

    (tmp_path / "state.pt").write_bytes(b"x" * 100)
    made = trust.record(tmp_path, ["state.pt"], JOB)
    assert made[trust.KEY]["files"]["state.pt"] == trust.signature(tmp_path / "state.pt")
    future = tmp_path.stat().st_ctime_ns + 3600 * 10**9
    assert trust._clock_moved_past(tmp_path, future, limit_s=0.05) is False
    real = trust.signature
    monkeypatch.setattr(trust, "signature", lambda path: [*real(path)[:3], future])
    assert trust.record(tmp_path, ["state.pt"], JOB) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
