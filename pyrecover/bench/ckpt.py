"""`pyrecover bench`: how fast checkpoints are on this storage, next to the storage's own limit.

`bench_ckpt` measures, in one process (world size 1) and on one synthetic GPT-shaped state
(a real `GPT` and its AdamW state, sized to the target):

- `raw`: sequential write + fsync, and cold and warm sequential reads, of as many bytes as
  the state holds: the physical limit of this storage from one process;
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

`bench_train` runs the real trainer (`pyrecover.train.main`, world size 1) once per mode and
repeat, all in this process, modes interleaved so that a noisy neighbour hits them alike, and
compares steady-state throughput (tokens/s over the steps after a warm-up) with a run that
saves no checkpoint in the measured steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import json
import logging
import math
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A checkpoint mode joins the benchmark with one entry: its name here -> (checkpoint.mode,
# checkpoint.async_save). Everything else is driven through CheckpointManager.
MODES: dict[str, tuple[str, bool]] = {
    "vanilla": ("vanilla", False),
    "dcp-sync": ("dcp", False),
    "dcp-async": ("dcp", True),
    # At world size 1 memory mode has no peer to replicate to: this measures its disk
    # checkpoint (and, in `bench train`, its in-memory snapshots every snapshot_interval).
    "memory": ("memory", False),
}
METRICS = ("save", "blocked", "load_cold", "load_warm", "resume_cold")
# The raw and torch figure each metric is compared with.
REFERENCE = {"save": "save", "blocked": "save", "load_cold": "load_cold",
             "load_warm": "load_warm", "resume_cold": "load_cold"}
CHUNK = 16 << 20
ALIGN = 1 << 20  # raw transfers are whole MiB: aligned for O_DIRECT on any device
BYTES_PER_PARAM = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq


class BenchError(ValueError):
    """The benchmark cannot run as asked (bad directory, size, mode); one line says why."""


Note = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# --- the synthetic state ---------------------------------------------------------------------

def gpt_shape(target_bytes: int) -> dict[str, int]:
    """gpt_shape picks GPT dimensions whose weights + AdamW state come near `target_bytes`.

    Width grows with depth as in published GPTs (about 64 channels per layer); heads are 64
    wide. Parameters are 12 * layers * width^2 plus the embeddings.
    """
    params = max(1.0, target_bytes / BYTES_PER_PARAM)
    layers = max(1, round((params / (12 * 64 * 64)) ** (1 / 3)))
    width = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
    layers = max(1, round((params - 1344 * width) / (12 * width * width)))
    return {"vocab_size": 320, "block_size": 1024, "n_layer": layers,
            "n_head": width // 64, "n_embd": width}


@dataclass
class State:
    """A live model + AdamW (with its state filled in) as pyrecover's checkpoint code sees it."""

    parts: Any  # pyrecover.checkpoint.manager.Parts
    shape: dict[str, int]

    def tensors(self) -> list[Any]:
        """tensors lists every distinct tensor of the model and the optimizer state."""
        seen, out = set(), []
        items = list(self.parts.model.state_dict().values())
        for per_param in self.parts.optimizer.state.values():
            items += [v for v in per_param.values() if hasattr(v, "data_ptr")]
        for t in items:
            key = (t.data_ptr(), t.numel())
            if key not in seen and t.numel() > 1:
                seen.add(key)
                out.append(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def build_state(target_bytes: int, seed: int = 0) -> State:
    """build_state makes a GPT + AdamW of about `target_bytes` with every optimizer slot filled."""
    import torch

    from pyrecover.checkpoint.manager import Parts
    from pyrecover.model import GPT, GPTConfig

    shape = gpt_shape(target_bytes)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # fills exp_avg and exp_avg_sq, as after the first real step
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    train = {"step": 0, "tokens_seen": 0, "data_position": 0, "bad_steps": 0}
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler,
                  config={"bench": shape}, train_state=lambda: dict(train))
    return State(parts, shape)


def own(state: State) -> None:
    """own copies optimizer tensors that still map a checkpoint file into private memory.

    A memory-mapped load leaves them backed by the file; mapped pages cannot be evicted, so
    the next cold read of that file would not be cold. Not part of any measured time.
    """
    for per_param in state.parts.optimizer.state.values():
        for key, value in per_param.items():
            if hasattr(value, "clone"):
                per_param[key] = value.clone()


def touch(state: State) -> None:
    """touch reads one element per 4 KiB page of every tensor (faults in a lazy mmap load)."""
    for t in state.tensors():
        stride = max(1, 4096 // t.element_size())
        t.reshape(-1)[::stride].sum()


# --- the page cache ------------------------------------------------------------------------

def drop_cache(paths: Iterable[Path], system: bool = False) -> None:
    """drop_cache evicts the files from the page cache: fsync then POSIX_FADV_DONTNEED.

    With `system`, also writes 1 to /proc/sys/vm/drop_caches (root only; drops every file).
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if system:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """cached_fraction is the share of the files' pages in the page cache (mincore), or None."""
    libc = _libc()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def remove(path: Path) -> None:
    """remove deletes a file and commits the deletion (fsync of its folder), outside any timing.

    ext4 reuses freed blocks only once the deletion is committed to its journal; without this,
    whichever write comes next would wait for that commit and be charged for it.
    """
    from pyrecover.checkpoint.store import fsync_dir

    path.unlink()
    fsync_dir(path.parent)


def files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


# --- measuring -----------------------------------------------------------------------------

@dataclass
class Samples:
    """Every repeat's figures: (method, metric) -> seconds, and the bytes each method moved."""

    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    cached: list[float] = field(default_factory=list)  # page-cache share left after each drop

    def add(self, method: str, metric: str, seconds: float) -> None:
        self.seconds.setdefault((method, metric), []).append(max(seconds, 1e-9))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


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
        seconds = _timed(lambda: write(True))[0]
    except OSError:  # no O_DIRECT here (tmpfs, some FUSE mounts): through the page cache
        kind = "buffered"
        seconds = _timed(lambda: write(False))[0]
    samples.add("raw", "save", seconds)
    if kind == "O_DIRECT":
        # The first cold read of a file written the way dcp and memory write theirs.
        _cold([path], samples, system)
        samples.add("raw-direct", "load_cold", _timed(read)[0])
        samples.nbytes["raw-direct"] = nbytes
        # The same write through the page cache, as `dd conv=fsync` would: a second baseline.
        remove(path)
        samples.add("raw-buffered", "save", _timed(lambda: write(False))[0])
        samples.nbytes["raw-buffered"] = nbytes
    _cold([path], samples, system)
    samples.add("raw", "load_cold", _timed(read)[0])
    samples.add("raw", "load_warm", _timed(read)[0])
    samples.nbytes["raw"] = nbytes
    block.close()
    remove(path)
    return kind


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

    samples.add("torch", "save", _timed(save)[0])
    samples.nbytes["torch"] = samples.nbytes["torch-mmap"] = path.stat().st_size
    for method, mapped in (("torch", False), ("torch-mmap", True)):
        _cold([path], samples, system)
        samples.add(method, "load_cold", _timed(load(mapped))[0])
        samples.add(method, "load_warm", _timed(load(mapped))[0])
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
        while self.saver.inflight is not None:
            time.sleep(0.0005)
            self.saver.at_step(self.step + 1)
        return time.perf_counter() - started, blocked, self.run.checkpoints / f"step-{self.step}"

    def load(self, folder: Path) -> float:
        from pyrecover.checkpoint import store

        ckpt = store.verify(folder, checksums=False)
        seconds = _timed(lambda: (self.loader.restore(ckpt), touch(self.dst)))[0]
        own(self.dst)
        return seconds

    def resume(self) -> float:
        def run() -> None:
            ckpt = self.loader.find_resume()  # verifies the checksums, as a restart does
            assert ckpt is not None, "the benchmark's checkpoint did not verify"
            self.loader.restore(ckpt)
            touch(self.dst)
        seconds = _timed(run)[0]
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
               note: Note = _quiet) -> dict[str, Any]:
    """bench_ckpt measures raw I/O, torch.save/load and each mode on `directory`; a report."""
    import torch

    if size_gb <= 0 or repeat < 1:
        raise BenchError(f"--size-gb must be > 0 and --repeat >= 1 (got {size_gb}, {repeat})")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise BenchError(f"unknown mode {unknown[0]!r}; known: {', '.join(MODES)}")
    if system_drop and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise BenchError("--drop-all-caches needs root (write access to /proc/sys/vm/drop_caches)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = int(size_gb * 1e9)
    free = shutil.disk_usage(directory).free
    if free < 3 * target:
        raise BenchError(f"{directory}: {free / 1e9:.1f} GB free; the benchmark needs about "
                         f"{3 * target / 1e9:.1f} GB (three copies of the state)")
    work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-", dir=directory))
    try:
        note(f"building a GPT + AdamW state of about {size_gb:g} GB")
        src, dst = build_state(target, seed=0), build_state(target, seed=1)
        samples = Samples()
        benches = [_ModeBench(m, work, src, dst) for m in modes]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            for b in benches:  # one uncounted save each: first-time buffers and threads
                b.save()
            for r in range(repeat):
                note(f"repeat {r + 1}/{repeat}: raw I/O")
                raw_write = _raw(work, src.nbytes, samples, system_drop)
                note(f"repeat {r + 1}/{repeat}: torch.save / torch.load")
                _torch(work, src, dst, samples, system_drop)
                for b in benches:
                    note(f"repeat {r + 1}/{repeat}: {b.name}")
                    _mode(b, samples, system_drop)
            for b in benches:
                b.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
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

    `vs_raw` and `vs_torch` are this figure's median seconds divided by the raw storage's and
    torch's median seconds for the same kind of figure: 1.0 is as fast, 2.0 takes twice as long.
    """
    med = {key: statistics.median(v) for key, v in samples.seconds.items()}
    out = []
    for (method, metric), values in samples.seconds.items():
        m = med[(method, metric)]
        ref = REFERENCE[metric]
        raw, base = med.get(("raw", ref)), med.get(("torch", ref))
        if method == "torch-mmap":
            base = med.get(("torch", metric))
        nbytes = samples.nbytes.get(method, 0)
        out.append({
            "method": method, "metric": metric, "median_s": m, "min_s": min(values),
            "max_s": max(values), "bytes": nbytes, "gb_per_s": nbytes / m / 1e9,
            "vs_raw": m / raw if raw else None, "vs_torch": m / base if base else None,
        })
    return out


# --- training throughput -------------------------------------------------------------------

TRAIN_MODES: dict[str, tuple[str, bool] | None] = {"none": None, **MODES}


def bench_train(config: Path | None, overrides: Sequence[str], interval: int, steps: int,
                warmup: int = 5, repeat: int = 1, modes: Sequence[str] = tuple(TRAIN_MODES),
                workdir: Path | None = None, note: Note = _quiet) -> dict[str, Any]:
    """bench_train trains `warmup + steps` steps per mode and compares tokens/s with `none`.

    `none` saves nothing within the measured steps (its interval is past the end); the final
    save every run makes after its last step is outside the measurement.
    """
    from pyrecover import config as config_mod

    if interval < 1 or steps < 1 or warmup < 0 or repeat < 1:
        raise BenchError("--interval and --steps must be >= 1, --warmup >= 0, --repeat >= 1")
    unknown = [m for m in modes if m not in TRAIN_MODES]
    if unknown:
        raise BenchError(f"unknown mode {unknown[0]!r}; known: {', '.join(TRAIN_MODES)}")
    if "none" not in modes:
        modes = ("none", *modes)
    from pyrecover import dist

    if dist.detect(os.environ).launcher != "single":
        raise BenchError("pyrecover bench train runs one process; start it outside srun and "
                         "torchrun (unset RANK/WORLD_SIZE or SLURM_PROCID/SLURM_STEP_ID)")
    total = warmup + steps
    base = list(overrides) + [f"train.max_steps={total}", "train.log_interval=1",
                              "tracking.wandb=disabled", "checkpoint.keep=2"]
    cfg = config_mod.load(config, base)  # a bad config fails here, before any run
    work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-train-", dir=workdir))
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for r in range(repeat):
            turn = r % len(modes)  # rotate, so no mode always runs first
            for name in (*modes[turn:], *modes[:turn]):
                spec = TRAIN_MODES[name]
                extra = [f"checkpoint.interval={total + 1}"] if spec is None else [
                    f"checkpoint.mode={spec[0]}", f"checkpoint.async_save={spec[1]}",
                    f"checkpoint.interval={interval}"]
                note(f"repeat {r + 1}/{repeat}: training {total} steps with checkpoints "
                     f"{'never' if spec is None else f'every {interval} steps ({name})'}")
                run_dir = work / f"{name}-{r}"
                _train_once(config, base + extra, run_dir)
                results[name].append(_throughput(run_dir, warmup))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows_out = []
    baseline = statistics.median(x["tokens_per_s"] for x in results["none"])
    for name in modes:
        tps = [x["tokens_per_s"] for x in results[name]]
        med = statistics.median(tps)
        rows_out.append({
            "mode": name, "tokens_per_s": med, "min": min(tps), "max": max(tps),
            "vs_none": med / baseline,
            "saves": statistics.median(x["saves"] for x in results[name]),
            "blocked_s": statistics.median(x["blocked_s"] for x in results[name]),
            "blocked_share": statistics.median(x["blocked_share"] for x in results[name]),
            "checkpoint_bytes": max(x["checkpoint_bytes"] for x in results[name]),
        })
    return {"kind": "train", "config": str(config) if config else "defaults",
            "machine": machine(work.parent), "steps": steps, "warmup": warmup,
            "interval": interval, "repeat": repeat, "world_size": 1,
            "model": config_mod.to_dict(cfg)["model"], "rows": rows_out}


def _train_once(config: Path | None, overrides: Sequence[str], run_dir: Path) -> None:
    """_train_once runs the real trainer in this process, its log captured, not shown."""
    from pyrecover import config as config_mod
    from pyrecover import train as train_mod

    cfg = config_mod.load(config, list(overrides))
    logger = logging.getLogger("pyrecover")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            train_mod.main(cfg, run_dir)
    except Exception as exc:
        tail = "\n".join(captured.getvalue().strip().splitlines()[-10:])
        raise BenchError(f"the training run in {run_dir} failed: {type(exc).__name__}: {exc}"
                         + (f"\n{tail}" if tail else "")) from exc
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


def _throughput(run_dir: Path, warmup: int) -> dict[str, float]:
    from pyrecover.rundir import RunDir

    run = RunDir(run_dir)
    measured = [m for m in run.read_metrics() if m.get("step", 0) > warmup]
    if not measured:
        raise BenchError(f"{run.metrics}: no steps after the warm-up were logged")
    last = max(m["step"] for m in measured)
    seconds = sum(m["step_time"] for m in measured)
    tokens = sum(m["tokens_per_s"] * m["step_time"] for m in measured)
    saves = [e for e in run.read_events()
             if e.get("event") == "checkpoint" and warmup <= e.get("step", 0) < last]
    blocked = sum(e.get("blocked", 0.0) for e in saves)
    return {"tokens_per_s": tokens / seconds, "saves": len(saves), "blocked_s": blocked,
            "blocked_share": blocked / seconds,
            "checkpoint_bytes": max((e.get("bytes", 0) for e in saves), default=0)}


# --- describing the machine and printing ---------------------------------------------------

def machine(directory: Path) -> dict[str, Any]:
    """machine describes the CPU, memory, load and the filesystem holding `directory`."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                            "cpus": len(os.sched_getaffinity(0)),
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gb"] = round(int(line.split()[1]) / 1e6, 1)
                break
    except OSError:
        pass
    info.update(filesystem(directory))
    return info


def filesystem(directory: Path) -> dict[str, str]:
    """filesystem returns the mount point, type and device holding `directory` (Linux)."""
    target = str(Path(directory).resolve())
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, kind = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, kind, dev)
    except OSError:
        return {}
    return {"mount": best[0], "fs_type": best[1], "device": best[2]}


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
                     f"{_num(r['vs_raw']):>7} {_num(r['vs_torch']):>8}")
    return "\n".join(lines)


def format_train(report: dict[str, Any]) -> str:
    """format_train renders the training-throughput report as a table for people."""
    m = report["machine"]
    model = report["model"]
    lines = [
        f"config {report['config']}: GPT {model['n_layer']} layers x {model['n_embd']}, "
        f"{report['steps']} measured steps after {report['warmup']} warm-up, checkpoint every "
        f"{report['interval']} steps, world size 1; {m.get('cpu', '?')}, {m['cpus']} CPUs, "
        f"load {m['load_avg_1m']}; median of {report['repeat']}",
        "",
        "x none: tokens/s over the no-checkpoint run's; blocked: the loop's wait for saves, "
        "in seconds and as a share of the measured time (less noisy on a busy machine)",
        "",
        f"{'mode':<10} {'tokens/s (min-max)':<26} {'x none':>7} {'saves':>6} {'blocked s':>10} "
        f"{'blocked %':>10} {'ckpt MB':>8}",
    ]
    for r in report["rows"]:
        span = f"{r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f})"
        lines.append(f"{r['mode']:<10} {span:<26} {r['vs_none']:>7.3f} {r['saves']:>6.0f} "
                     f"{r['blocked_s']:>10.3f} {100 * r['blocked_share']:>10.2f} "
                     f"{r['checkpoint_bytes'] / 1e6:>8.1f}")
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1)
