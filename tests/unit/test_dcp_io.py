"""DCP mode's storage: the files are DCP's own format, checksummed while written, read in place."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pyrecover.checkpoint import dcp_io


@pytest.fixture(autouse=True)
def _no_process_group_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(300, 70, generator=g),
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 1 << 40, (1000,), generator=g),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "view": big[10:20],  # shares a larger storage: must be written alone
        "strided": big.t(),  # not contiguous
    }


def zeros_like(state):
    return {k: torch.zeros_like(v).contiguous() for k, v in state.items()}


@pytest.mark.parametrize("threads", [1, 3])
def test_plain_dcp_reads_what_the_writer_wrote(tmp_path, threads):
    state = sample_state()
    dcp.save(state, storage_writer=dcp_io.Writer(tmp_path, threads=threads), no_dist=True)
    assert len(list(tmp_path.glob("__0_*.distcp"))) == min(threads, len(state))
    back = zeros_like(state)
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    again, reader = zeros_like(state), dcp_io.Reader(tmp_path)
    dcp.load(again, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(again[key], value), key
    # Views and strided tensors were written dense; DCP reads nothing for an empty tensor.
    assert reader.direct_items == sum(v.numel() > 0 for v in state.values())


def test_the_reader_places_tensors_directly_and_matches_plain_dcp(tmp_path):
    state = sample_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)  # stock
    back = zeros_like(state)
    reader = dcp_io.Reader(tmp_path, threads=2)
    dcp.load(back, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    # Stock DCP keeps a transposed tensor's strides: that record goes through torch.load;
    # every other one is read straight into its destination.
    assert reader.direct_items == sum(v.numel() > 0 for v in state.values()) - 1


def test_the_reader_hands_dtype_changes_and_partial_reads_to_dcp(tmp_path):
    state = sample_state()
    dcp.save(state, storage_writer=dcp_io.Writer(tmp_path), no_dist=True)
    back = {"f32": torch.zeros(300, 70, dtype=torch.float64),  # converted by DCP's reader
            "i64": torch.zeros(1000, dtype=torch.int64)}
    reader = dcp_io.Reader(tmp_path)
    dcp.load(back, storage_reader=reader, no_dist=True)
    assert torch.equal(back["f32"], state["f32"].double())
    assert torch.equal(back["i64"], state["i64"])
    assert reader.direct_items == 1


@pytest.mark.parametrize("crc", [True, False], ids=["crc", "no_crc"])
def test_a_tensors_bytes_are_found_inside_its_torch_save_record(crc):
    from torch.utils.serialization import config

    for key, tensor in sample_state().items():
        tensor = tensor.clone().contiguous()
        buf = io.BytesIO()
        with config.patch({"save.compute_crc32": crc}):
            torch.save(tensor, buf)
        record = buf.getvalue()
        start, stored = dcp_io.record_layout(record[:dcp_io.SMALL_READ])
        nbytes = tensor.numel() * tensor.element_size()
        assert (stored.dtype, stored.shape, stored.stride()) == (
            tensor.dtype, tensor.shape, tensor.stride()), key
        assert record[start:start + nbytes] == tensor.reshape(-1).view(torch.uint8).numpy(
        ).tobytes(), key
        assert record[start + nbytes:start + nbytes + 4] in dcp_io._AFTER_DATA, key
    assert dcp_io.record_layout(b"not a zip at all" * 40) is None


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_real_dcp_metadata_passes_the_restricted_unpickler(tmp_path):
    state = {**sample_state(), "plain": {"lr": 0.1, "betas": (0.9, 0.95), "name": "x"}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)  # stock
    back = {**zeros_like(sample_state()), "plain": {"lr": 0.0, "betas": (0, 0), "name": ""}}
    dcp.load(back, storage_reader=dcp_io.Reader(tmp_path), no_dist=True)
    assert back["plain"] == state["plain"] and torch.equal(back["f32"], state["f32"])


@pytest.mark.parametrize("where", [".metadata", "record"])
def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, where):
    import pickle

    from pyrecover.checkpoint.store import CheckpointError

    marker = tmp_path / "PWNED"
    dcp.save({"t": torch.ones(2), "v": {"x": 1}}, storage_writer=dcp_io.Writer(tmp_path / "c"),
             no_dist=True)
    evil = pickle.dumps(_RunsCode(marker))
    if where == ".metadata":
        (tmp_path / "c" / ".metadata").write_bytes(evil)
    else:  # a non-tensor value's record, which DCP itself loads with weights_only=False
        buf = io.BytesIO()
        torch.save(_RunsCode(marker), buf)
        # Offsets live in .metadata: point the value's entry at an appended record.
        reader = dcp_io.Reader(tmp_path / "c")
        meta = reader.checked_metadata
        (index, info), = [(k, v) for k, v in meta.storage_data.items() if k.fqn == "v.x"]
        path = tmp_path / "c" / info.relative_path
        offset = path.stat().st_size
        with path.open("ab") as f:
            f.write(buf.getvalue())
        meta.storage_data[index] = type(info)(info.relative_path, offset, len(buf.getvalue()))
        (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(meta))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((CheckpointError, CheckpointException), match="refused|never holds"):
        dcp.load({"t": torch.zeros(2), "v": {"x": 0}},
                 storage_reader=dcp_io.Reader(tmp_path / "c"), no_dist=True)
    assert not marker.exists()
