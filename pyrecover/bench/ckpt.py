"""`pyrecover bench ckpt`: how fast checkpoints are on this storage, next to its own limit.

`bench_ckpt` measures, in one process (world size 1) and on one synthetic GPT-shaped state
(a real `GPT` and its AdamW state, sized to the target):

- `raw`: sequential write + fsync, and cold and warm sequential reads, of as many bytes as
  the state holds: the physical limit of this storage from one process; and one copy of the
  state into host buffers allocated beforehand (`raw` `blocked`): the least an asynchronous
  save can hold up a loop whose state is in host memory with no step beside the copy;
- `torch` / `torch-mmap`: `torch.save` + fsync, and `torch.load(weights_only=True)` plain and
  with `mmap=True`, copied into a live model and optimizer: what a user would do otherwise;
- each pyrecover mode through the real code (`CheckpointManager` and the mode classes): the
  save until committed, the time the training loop is blocked, the load (cold and warm) into
  a live model and optimizer, and a cold resume (pick the newest checkpoint, verify its
  checksums, load).

Between a write and a cold read the page cache of the written files is dropped with
`posix_fadvise(POSIX_FADV_DONTNEED)` after an fsync (no root needed), and `mincore` checks how
much of each file really left the cache. Every load ends by touching one element per page of
every tensor, so a lazily memory-mapped load is charged for reading what it maps.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pyrecover.bench.common import (
    MODES,
    BenchError,
    Note,
    Samples,
    at_least,
    available_memory,
    machine,
    make_dir,
    num,
    quiet,
    remove_made,
    timed,
)
from pyrecover.bench.state import State, build_state, own, touch
from pyrecover.bench.storage import cached_fraction, drop_cache, files_in, remove

METRICS = ("save", "blocked", "load_cold", "load_warm", "resume_cold")

# The torch figure each metric is compared with (`x torch`).
REFERENCE = {"save": "save", "blocked": "save", "load_cold": "load_cold",
             "load_warm": "load_warm", "resume_cold": "load_cold"}
# The raw figure each is compared with (`x raw`): a save's blocked time with the state's copy
# in memory, the rest with the storage's.
RAW_REFERENCE = {**REFERENCE, "blocked": "blocked"}
# Bytes resident per byte of state (peak RSS at 0.1, 0.5 and 1 GB): the two states, the
# stager's copies and a load's, plus what each mode holds between its runs.
MEMORY_BASE = 4.5
MEMORY_PER_MODE = {"vanilla": 0.5, "dcp-sync": 0.5, "dcp-async": 0.5, "memory": 2.5}

CHUNK = 16 << 20

ALIGN = 1 << 20  # raw transfers are whole MiB: aligned for O_DIRECT on any device


def _cold(paths: list[Path], samples: Samples, system: bool) -> None:
    drop_cache(paths, system)
    left = cached_fraction(paths)
    if left is not None:
        samples.cached.append(left)


def _raw(work: Path, nbytes: int, samples: Samples, system: bool) -> str:
    """_raw times a sequential write + fsync and cold and warm reads; returns the write kind.

    The write bypasses the page cache (O_DIRECT) where the filesystem allows it: the figure is
    then what the device takes, without the cost of finding memory for the page cache (which
    on a virtual machine can dominate). The reads go through the page cache, with its
    readahead, of the same bytes written again buffered + fsync: on a virtual disk a file
    written with O_DIRECT read back cold 2-5x slower the first time. That first read is timed
    too (`raw-direct`): dcp and memory mode write their large files with O_DIRECT.
    """
    path = work / "raw.bin"
    nbytes = -(-nbytes // ALIGN) * ALIGN  # O_DIRECT moves whole blocks
    block = mmap.mmap(-1, min(CHUNK, nbytes))  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    kind = "O_DIRECT"

    def write(direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, memoryview(block)[:min(nbytes - done, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    buf = bytearray(CHUNK)

    def read() -> None:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    try:
        seconds = timed(lambda: write(True))[0]
    except OSError:  # no O_DIRECT here (tmpfs, some FUSE mounts): through the page cache
        kind = "buffered"
        seconds = timed(lambda: write(False))[0]
    samples.add("raw", "save", seconds)
    if kind == "O_DIRECT":
        # The first cold read of a file written the way dcp and memory write theirs.
        _cold([path], samples, system)
        samples.add("raw-direct", "load_cold", timed(read)[0])
        samples.nbytes["raw-direct"] = nbytes
        # The same write through the page cache, as `dd conv=fsync` would: a second baseline.
        remove(path)
        samples.add("raw-buffered", "save", timed(lambda: write(False))[0])
        samples.nbytes["raw-buffered"] = nbytes
    _cold([path], samples, system)
    samples.add("raw", "load_cold", timed(read)[0])
    samples.add("raw", "load_warm", timed(read)[0])
    samples.nbytes["raw"] = nbytes
    block.close()
    remove(path)
    return kind


def _copy(sources: list[Any], targets: list[Any], samples: Samples) -> None:
    """_copy times one copy of the state's tensors into buffers written before (resident), as
    the stager makes it for an asynchronous save (`torch._foreach_copy_`, on every intra-op
    thread), in this thread: the memory's own limit on dcp-async's `blocked` here, where the
    state is in host memory and no training step runs beside the copy."""
    import torch

    samples.add("raw", "blocked", timed(lambda: torch._foreach_copy_(targets, sources))[0])


def _torch(work: Path, src: State, dst: State, samples: Samples, system: bool) -> None:
    import torch

    path = work / "torch.pt"

    def save() -> None:
        with path.open("wb") as f:
            torch.save({"model": src.parts.model.state_dict(),
                        "optimizer": src.parts.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(mapped: bool) -> Callable[[], None]:
        def run() -> None:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
            dst.parts.model.load_state_dict(sd["model"])
            dst.parts.optimizer.load_state_dict(sd["optimizer"])
            touch(dst)
        return run

    samples.add("torch", "save", timed(save)[0])
    samples.nbytes["torch"] = samples.nbytes["torch-mmap"] = path.stat().st_size
    for method, mapped in (("torch", False), ("torch-mmap", True)):
        _cold([path], samples, system)
        samples.add(method, "load_cold", timed(load(mapped))[0])
        samples.add(method, "load_warm", timed(load(mapped))[0])
        own(dst)
    remove(path)


class _ModeBench:
    """One pyrecover mode driven through CheckpointManager, as the training loop drives it."""

    def __init__(self, name: str, work: Path, src: State, dst: State) -> None:
        import torch

        from pyrecover.checkpoint import CheckpointManager
        from pyrecover.rundir import RunDir

        mode, async_save = MODES[name]
        self.name = name
        self.run = RunDir(work / name)
        self.run.create()
        cpu = torch.device("cpu")
        # Saves happen at even steps; the odd step after one only polls for its commit.
        self.saver = CheckpointManager(self.run, mode, 2, 2, 0, 1, src.parts, cpu, async_save)
        self.loader = CheckpointManager(self.run, mode, 2, 2, 0, 1, dst.parts, cpu, async_save)
        self.dst = dst
        self.step = 0

    def save(self) -> tuple[float, float, Path]:
        """save returns (seconds until committed, seconds the loop was blocked, the folder)."""
        self.step += 2
        started = time.perf_counter()
        # The loop also waits, before its next optimizer step, for a background copy of the
        # state that is not complete; here no step's compute hides any of it.
        blocked = self.saver.at_step(self.step) + self.saver.before_update()
        if self.saver.inflight is not None:
            # The write goes on in the background, off the loop's time. The commit (rank 0's
            # manifest, fsyncs, rename, retention) runs at the next step boundary that finds
            # the write done, and blocks the loop there as it does in training: one call.
            # (Polling at_step every 0.5 ms charged the loop for a step boundary per poll,
            # thousands per save, where a training loop has one per step.)
            self.saver.mode.result(wait=True)
            blocked += self.saver.at_step(self.step + 1)
        assert self.saver.inflight is None, "the save's write was done but did not commit"
        return time.perf_counter() - started, blocked, self.run.checkpoints / f"step-{self.step}"

    def load(self, folder: Path) -> float:
        from pyrecover.checkpoint import store

        ckpt = store.verify(folder, checksums=False)
        seconds = timed(lambda: (self.loader.restore(ckpt), touch(self.dst)))[0]
        own(self.dst)
        return seconds

    def resume(self) -> float:
        def run() -> None:
            ckpt = self.loader.find_resume()  # verifies the checksums, as a restart does
            assert ckpt is not None, "the benchmark's checkpoint did not verify"
            self.loader.restore(ckpt)
            touch(self.dst)
        seconds = timed(run)[0]
        own(self.dst)
        return seconds

    def close(self) -> None:
        self.saver.mode.close()
        self.loader.mode.close()


def _mode(bench: _ModeBench, samples: Samples, system: bool) -> None:
    total, blocked, folder = bench.save()
    samples.add(bench.name, "save", total)
    samples.add(bench.name, "blocked", blocked)
    files = files_in(folder)
    samples.nbytes[bench.name] = sum(p.stat().st_size for p in files)
    _cold(files, samples, system)
    samples.add(bench.name, "load_cold", bench.load(folder))
    samples.add(bench.name, "load_warm", bench.load(folder))
    _cold(files, samples, system)
    samples.add(bench.name, "resume_cold", bench.resume())


def bench_ckpt(directory: Path, size_gb: float, repeat: int = 3,
               modes: Sequence[str] = tuple(MODES), system_drop: bool = False,
               note: Note = quiet) -> dict[str, Any]:
    """bench_ckpt measures raw I/O, torch.save/load and each mode on `directory`; a report."""
    import torch

    if not size_gb > 0:
        raise BenchError(f"--size-gb must be > 0 (got {size_gb:g})")
    at_least(1, repeat=repeat)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise BenchError(f"unknown mode {unknown[0]!r}; known: {', '.join(MODES)}")
    modes = tuple(dict.fromkeys(modes))  # a mode named twice is measured once, --repeat times
    needed = (MEMORY_BASE + sum(MEMORY_PER_MODE.get(m, 1.0) for m in modes)) * size_gb * 1e9
    available = available_memory()
    if available is not None and available < needed:  # else the OOM killer, files left
        raise BenchError(f"{available / 1e9:.1f} GB of memory available; --size-gb {size_gb:g} "
                         f"with {', '.join(modes)} needs about {needed / 1e9:.1f} GB (fewer "
                         "--mode, or a smaller --size-gb)")
    if system_drop and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise BenchError("--drop-all-caches needs root (write access to /proc/sys/vm/drop_caches)")
    directory = Path(directory)
    made = make_dir(directory)
    target = int(size_gb * 1e9)
    free = shutil.disk_usage(directory).free
    if free < 3 * target:
        remove_made(directory, made)
        raise BenchError(f"{directory}: {free / 1e9:.1f} GB free; the benchmark needs about "
                         f"{3 * target / 1e9:.1f} GB (three copies of the state)")
    work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-", dir=directory))
    try:
        note(f"building a GPT + AdamW state of about {size_gb:g} GB")
        src, dst = build_state(target, seed=0), build_state(target, seed=1)
        samples = Samples()
        benches = [_ModeBench(m, work, src, dst) for m in modes]
        sources = src.tensors()
        copies = [torch.zeros_like(t) for t in sources]  # resident, like the stager's buffers
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            for b in benches:  # one uncounted save each: first-time buffers and threads
                b.save()
            for r in range(repeat):
                note(f"repeat {r + 1}/{repeat}: raw I/O")
                raw_write = _raw(work, src.nbytes, samples, system_drop)
                _copy(sources, copies, samples)
                note(f"repeat {r + 1}/{repeat}: torch.save / torch.load")
                _torch(work, src, dst, samples, system_drop)
                for b in benches:
                    note(f"repeat {r + 1}/{repeat}: {b.name}")
                    _mode(b, samples, system_drop)
            for b in benches:
                b.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        remove_made(directory, made)
    drop = "posix_fadvise(POSIX_FADV_DONTNEED) per file after fsync"
    if system_drop:
        drop += ", then /proc/sys/vm/drop_caches"
    return {
        "kind": "ckpt",
        "directory": str(directory),
        "machine": machine(directory),
        "torch": torch.__version__.split("+")[0],
        "world_size": 1,
        "repeat": repeat,
        "state_bytes": src.nbytes,
        "model": src.shape,
        "cache_drop": drop,
        "raw_write": f"{raw_write} sequential writes of {CHUNK >> 20} MiB, then fsync",
        "cached_after_drop_max": max(samples.cached) if samples.cached else None,
        "rows": rows(samples),
    }


def rows(samples: Samples) -> list[dict[str, Any]]:
    """rows summarises the samples: median, min, max, GB/s and the two ratios per figure.

    `vs_raw` and `vs_torch` are this figure's median seconds divided by the raw figure's
    (RAW_REFERENCE: the storage's, or for `blocked` the copy in memory) and torch's
    (REFERENCE) median seconds: 1.0 is as fast, 2.0 takes twice as long.
    """
    med = {key: statistics.median(v) for key, v in samples.seconds.items()}
    out = []
    for (method, metric), values in samples.seconds.items():
        m = med[(method, metric)]
        raw, base = med.get(("raw", RAW_REFERENCE[metric])), med.get(("torch", REFERENCE[metric]))
        if method == "torch-mmap":
            base = med.get(("torch", metric))
        nbytes = samples.nbytes.get(method, 0)
        out.append({
            "method": method, "metric": metric, "median_s": m, "min_s": min(values),
            "max_s": max(values), "bytes": nbytes, "gb_per_s": nbytes / m / 1e9,
            "vs_raw": m / raw if raw else None, "vs_torch": m / base if base else None,
        })
    return out


def format_ckpt(report: dict[str, Any]) -> str:
    """format_ckpt renders the checkpoint report as a table for people."""
    m = report["machine"]
    lines = [
        f"storage {report['directory']} ({m.get('fs_type', '?')} on {m.get('device', '?')}); "
        f"{m.get('cpu', '?')}, {m['cpus']} CPUs, {m.get('memory_gb', '?')} GB RAM, "
        f"load {m['load_avg_1m']}",
        f"state {report['state_bytes'] / 1e9:.3f} GB (GPT {report['model']['n_layer']} layers x "
        f"{report['model']['n_embd']} wide + AdamW), world size 1, torch {report['torch']}, "
        f"median of {report['repeat']} (min-max)",
        f"raw write: {report['raw_write']}",
        f"cold reads: {report['cache_drop']}; largest share still cached after a drop: "
        + ("unknown" if report["cached_after_drop_max"] is None
           else f"{100 * report['cached_after_drop_max']:.0f}%"),
        "x raw / x torch: seconds divided by the raw storage's / torch's for the same kind of "
        "figure (1.00 = as fast)",
        "",
        f"{'method':<12} {'figure':<12} {'seconds (min-max)':<24} {'GB/s':>7} {'x raw':>7} "
        f"{'x torch':>8}",
    ]
    for r in report["rows"]:
        span = f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})"
        lines.append(f"{r['method']:<12} {r['metric']:<12} {span:<24} {r['gb_per_s']:>7.2f} "
                     f"{num(r['vs_raw']):>7} {num(r['vs_torch']):>8}")
    return "\n".join(lines)

