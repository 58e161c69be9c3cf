"""On real GPUs: DDP over NCCL on every local GPU, bf16 autocast, checkpoints of CUDA tensors.

Each test skips with the reason where torch sees no CUDA GPU, or fewer than it needs. `make
gpu-test` runs them inside the image (`apptainer exec --nv ... python -m pytest tests/gpu`).
Training runs are the real CLI in fresh processes, on the tiny experiment config.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from helpers import pyrecover, tiny_args

from pyrecover import config as config_mod
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TIMEOUT = 900


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless torch sees at least n CUDA GPUs, saying what it does see."""
    if not torch.cuda.is_available():
        reason = (f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                  f"CUDA build {torch.version.cuda})")
    else:
        reason = f"needs {n} CUDA GPUs, torch sees {GPUS}"
    return pytest.mark.skipif(GPUS < n, reason=reason)


def gpu_args(storage, corpus, name: str, world: int, *extra: str) -> list[str]:
    """The tiny experiment on CUDA: 2 sequences per GPU per micro-step, 2 micro-steps."""
    return tiny_args(storage, corpus, name, "train.device=cuda", "train.micro_batch_size=2",
                     f"train.global_batch_size={4 * world}", "checkpoint.interval=5", *extra)


def events(run_dir) -> list[dict]:
    """The run's events without its phase timings (which end with the process's exit)."""
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] != "phase"]


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m}


def check(done) -> None:
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])


@needs_gpus(2)
def test_ddp_on_nccl_trains_on_every_gpu_and_resumes_from_its_checkpoint(tmp_path, corpus):
    world, run = GPUS, tmp_path / "ddp"
    first = pyrecover("train", "--nproc", str(world),
                      *gpu_args(tmp_path, corpus, "ddp", world, "train.max_steps=10"),
                      env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}, timeout=TIMEOUT)
    check(first)
    # NCCL itself reports its set-up: the process group really runs on NCCL.
    assert "NCCL INFO" in first.stdout + first.stderr
    second = pyrecover("train", "--nproc", str(world),
                       *gpu_args(tmp_path, corpus, "ddp", world, "train.max_steps=20"),
                       timeout=TIMEOUT)
    check(second)
    log = events(run)
    assert [e["world_size"] for e in log if e["event"] == "start"] == [world]
    [resume] = [e for e in log if e["event"] == "resume"]
    assert (resume["step"], resume["world_size"]) == (10, world)
    assert (log[-1]["event"], log[-1]["step"]) == ("finish", 20)
    assert all(math.isfinite(loss) for loss in losses(run).values())


@needs_gpus(1)
def test_cuda_training_runs_the_model_under_bf16_autocast():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(0)} does not support bf16")
    from pyrecover.devices import autocast_for
    from pyrecover.model import GPT, GPTConfig

    device = torch.device("cuda", 0)
    for precision, dtype in (("auto", torch.bfloat16), ("bf16", torch.bfloat16),
                             ("fp32", torch.float32)):
        cfg = config_mod.load(None, [f"train.precision={precision}", "model.n_layer=2",
                                     "model.n_embd=64", "model.n_head=2", "model.block_size=64"])
        model = GPT(GPTConfig(**config_mod.to_dict(cfg)["model"])).to(device)
        x = torch.randint(0, 256, (2, 64), device=device)
        with autocast_for(cfg, device)():
            logits, loss = model(x, x)
        loss.backward()
        assert logits.dtype == dtype, precision
        # Autocast computes in bf16 but keeps the weights and their gradients in fp32.
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {
            torch.float32}
        assert math.isfinite(loss.item())


@needs_gpus(1)
@pytest.mark.parametrize("mode", config_mod.CHECKPOINT_MODES)
def test_a_cuda_run_killed_mid_way_resumes_from_its_checkpoint(tmp_path, corpus, mode):
    run, straight = tmp_path / "resumed", tmp_path / "straight"
    args = ("train.max_steps=20", f"checkpoint.mode={mode}")
    killed = pyrecover("train", *gpu_args(tmp_path, corpus, "resumed", 1, *args),
                       env={"PYRECOVER_KILL_AT_STEP": "14"}, timeout=TIMEOUT)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL, see pyrecover/faults.py
    saved = [e["step"] for e in events(run) if e["event"] == "checkpoint"]
    assert saved and saved[-1] in (5, 10)
    check(pyrecover("train", *gpu_args(tmp_path, corpus, "resumed", 1, *args), timeout=TIMEOUT))
    check(pyrecover("train", *gpu_args(tmp_path, corpus, "straight", 1, *args), timeout=TIMEOUT))
    [resume] = [e for e in events(run) if e["event"] == "resume"]
    assert (resume["step"], resume["mode"]) == (saved[-1], mode)
    assert (events(run)[-1]["event"], events(run)[-1]["step"]) == ("finish", 20)

    # The CUDA tensors were saved and come back, onto the GPU or the CPU alike.
    out = tmp_path / "weights.pt"
    check(pyrecover("ckpt", "export", str(run), "--out", str(out)))
    on_gpu = torch.load(out, weights_only=True, map_location="cuda")
    on_cpu = torch.load(out, weights_only=True, map_location="cpu")
    assert on_gpu.keys() == on_cpu.keys() and on_gpu
    for name, tensor in on_gpu.items():
        assert tensor.is_cuda, name
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor.cpu(), on_cpu[name]), name

    # GPU kernels are not bitwise deterministic, so the resumed run only has to stay close to
    # the uninterrupted one; a lost optimizer state, LR step or data position would not.
    resumed, uninterrupted = losses(run), losses(straight)
    assert resumed[20] == pytest.approx(uninterrupted[20], rel=0.02)


@needs_gpus(1)
def test_a_cuda_run_skips_non_finite_steps_on_the_device_and_counts_them(tmp_path, corpus):
    """On CUDA the fused AdamW skips a NaN step itself (`found_inf`) and the step's loss and
    gradient norm come back through pinned memory and an event, read while the next step is
    queued (loop.py): the skips, their count in the checkpoints and the run's end must be
    those of the CPU tests."""
    import json

    run = tmp_path / "nan"
    done = pyrecover("train", *gpu_args(tmp_path, corpus, "nan", 1, "train.max_steps=12",
                                        "train.log_interval=100", "checkpoint.interval=3",
                                        "checkpoint.keep=4"),
                     env={"PYRECOVER_NAN_AT_STEPS": "2,3,7,9"}, timeout=TIMEOUT)
    check(done)
    assert [e["step"] for e in events(run) if e["event"] == "bad_step"] == [2, 3, 7, 9]
    saved = {int(p.parent.name.split("-")[1]): json.loads(p.read_text())["train_state"]
             for p in (run / "checkpoints").glob("step-*/manifest.json")}
    assert {s: t["bad_steps"] for s, t in saved.items()} == {3: 2, 6: 0, 9: 1, 12: 0}
    assert math.isfinite(losses(run)[12])
    weights = tmp_path / "weights.pt"
    check(pyrecover("ckpt", "export", str(run), "--out", str(weights)))
    assert all(torch.isfinite(t).all() for t in torch.load(weights, weights_only=True).values())


@needs_gpus(1)
def test_an_unfused_cpu_optimizer_state_loads_into_the_fused_cuda_update():
    """A CPU checkpoint of an older version holds unfused groups, so torch leaves its step
    counts on the CPU; the fused CUDA kernel (and its found_inf skip) needs them on the GPU
    (optim.keep_fused)."""
    from pyrecover.model import GPT, GPTConfig
    from pyrecover.optim import build_optimizer

    cfg = config_mod.load(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                                 "model.block_size=16"])
    shape = GPTConfig(**config_mod.to_dict(cfg)["model"])
    x = torch.randint(0, 256, (2, 16))
    old = GPT(shape)
    on_cpu = build_optimizer(old, cfg, torch.device("cpu"))
    old(x, x)[1].backward()
    on_cpu.step()
    saved = on_cpu.state_dict()
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = None, None  # as an older version saved it
    device = torch.device("cuda", 0)
    model = GPT(shape).to(device)
    model.load_state_dict(old.state_dict())
    optimizer = build_optimizer(model, cfg, device)
    optimizer.load_state_dict(saved)
    assert all(s["step"].device == device for s in optimizer.state.values())
    model(x.to(device), x.to(device))[1].backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.found_inf = torch.ones((), device=device)
    optimizer.step()  # skipped on the device
    optimizer.found_inf = None
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    optimizer.step()
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}


@needs_gpus(1)
def test_cuda_staging_copies_the_state_of_its_moment_on_every_save_and_fences_the_update():
    """The one staging path on CUDA: pinned buffers, a side stream, an event. An update queued
    right after the fence must not reach the copy, on the first save and on every later one
    (torch 2.11's own stager failed every save after the first)."""
    from pyrecover.checkpoint.staging import StateStager

    device = torch.device("cuda", 0)
    model = torch.nn.Linear(2048, 2048, device=device)
    live = {"model": dict(model.named_parameters()), "extra": {"kind": torch.nn.Linear}}
    stager = StateStager(device)
    try:
        for save in range(3):
            expect = model.weight.detach().cpu()
            future = stager.stage(live)
            stager.fence()  # the loop's stream now waits for the copy; the host does not
            with torch.no_grad():
                model.weight.add_(1.0)  # the optimizer's update, queued behind the copy
            staged = future.result()
            assert staged["model"]["weight"].is_pinned(), save
            assert type(staged["model"]["weight"]) is torch.Tensor
            assert torch.equal(staged["model"]["weight"], expect), save
            assert staged["extra"]["kind"] is torch.nn.Linear
        # A fence right after a large copy starts: the loop's stream stands still until the
        # copy is done. The host never waited, so only the events can tell, and must.
        big = {"x": torch.randn(64 << 20, device=device)}  # 256 MB
        stager.copier.device_waits(drain=True)  # the three saves' fences, counted already
        staged_at = time.perf_counter()
        stager.stage(big)
        stager.fence()
        waits = stager.copier.device_waits(drain=True)
        assert len(waits) == 1 and waits[0][0] > 0.001, waits
        assert staged_at < waits[0][1] <= time.perf_counter()  # its end, on the host's clock
        assert stager.copier.device_waits(drain=True) == []  # counted once
    finally:
        stager.close()


@needs_gpus(1)
def test_a_cuda_run_compiles_by_default_and_logs_its_mfu(tmp_path, corpus):
    from pyrecover import flops

    if flops.peak_flops(torch.cuda.get_device_name(0)) is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in the peak table")
    run = tmp_path / "mfu"
    done = pyrecover("train", *gpu_args(tmp_path, corpus, "mfu", 1, "train.max_steps=6"),
                     timeout=TIMEOUT)
    check(done)
    assert "MFU" in done.stderr
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if m["step"] > 1]  # 1 compiles
    assert any(m["mfu"] > 0 for m in metrics), metrics
    assert all(0 <= m["mfu"] < 1 for m in metrics), metrics


@needs_gpus(1)
def test_a_profiled_cuda_run_says_what_the_device_did_per_step(tmp_path, corpus):
    """train.profile on a GPU: kernels, the copies of memory mode's snapshot (one a step, to
    pinned host memory) and the device's idle time, per step, beside a trace."""
    done = pyrecover("train", *gpu_args(tmp_path, corpus, "prof", 1, "train.max_steps=6",
                                        "train.profile=3-4", "checkpoint.mode=memory",
                                        "checkpoint.snapshot_interval=1"), timeout=TIMEOUT)
    check(done)
    [event] = [e for e in events(tmp_path / "prof") if e["event"] == "profile"]
    assert (event["first"], event["last"]) == (3, 4)
    assert event["kernels_s"] > 0 and event["to_host_s"] > 0, event
    # The device synchronized at both ends: its kernels lie inside the window, and the tiny
    # model's kernels are too short to keep it busy (annotations, spans with gaps, left out).
    assert event["kernels_s"] < event["wall_s"] and event["idle_s"] > 0, event
    assert (tmp_path / "prof" / "profile" / "steps-3-4-rank-0.trace.json.gz").is_file()
    assert "copies to host" in done.stderr


@needs_gpus(1)
def test_a_compiled_cuda_restart_on_a_new_node_loads_its_kernels_from_the_run(tmp_path,
                                                                               corpus):
    """Each attempt gets a fresh TMPDIR (Inductor's default cache is the node's /tmp): the
    restart must find its graphs and Triton kernels in the run's compile-cache."""
    run = tmp_path / "compiled"

    def attempt(steps: int, node: str) -> dict:
        (tmp_path / node).mkdir()
        done = pyrecover("train", *gpu_args(tmp_path, corpus, "compiled", 1,
                                            f"train.max_steps={steps}", "train.compile=true"),
                         env={"TMPDIR": str(tmp_path / node), "TORCHINDUCTOR_CACHE_DIR": ""},
                         timeout=TIMEOUT)
        check(done)
        return [e for e in read_jsonl(run / "events.jsonl")
                if e.get("phase") == "first_step"][-1]["compile_cache"]

    first = attempt(5, "node1")
    assert first["hits"] == 0 and first["misses"] > 0
    assert any((run / "compile-cache" / "triton").rglob("*.cubin")), "no Triton kernel cached"
    assert attempt(10, "node2") == {"hits": first["misses"], "misses": 0}


@pytest.mark.skipif(GPUS != 1, reason=f"needs exactly 1 CUDA GPU, torch sees {GPUS}")
def test_more_processes_than_gpus_is_one_clear_line(tmp_path, corpus):
    done = pyrecover("train", "--nproc", "2", *gpu_args(tmp_path, corpus, "dup", 2),
                     timeout=TIMEOUT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: 2 processes on this machine")
    assert "train.device=cpu" in done.stderr and "Traceback" not in done.stderr


@needs_gpus(1)
def test_the_health_check_s_gpu_part_passes_on_a_working_gpu_and_counts_the_gpus():
    from pyrecover import health

    assert health.check_gpu("cuda", 0, 1) is None  # the matmul matches the CPU's
    if GPUS == 1:  # one visible GPU may be the task's own (SLURM's per-task binding)
        assert health.check_gpu("cuda", 3, 4) is None
        return
    said = health.check_gpu("cuda", 0, GPUS + 1)
    assert said == f"{GPUS} GPU(s) visible, this node's {GPUS + 1} tasks need one each"


@pytest.mark.skipif(GPUS != 1, reason=f"needs exactly 1 CUDA GPU, torch sees {GPUS}")
def test_two_tasks_shown_the_same_single_gpu_stop_in_one_line_once_the_group_is_up(tmp_path,
                                                                                  corpus):
    """torchrun shows both of its workers this machine's one GPU, as a cluster without
    per-task binding would: each sees one GPU, as with --gpus-per-task=1, so only comparing
    the GPUs' UUIDs tells the two apart, before NCCL starts (which would say 'Duplicate GPU
    detected' in a traceback)."""
    via = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pyrecover")
    done = pyrecover("train", *gpu_args(tmp_path, corpus, "shared", 2), via=via,
                     timeout=TIMEOUT)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "ranks 0 and 1 on" in said[0], done.stderr[-3000:]
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert f"see the same single GPU ({uuid})" in said[0] and "train.device=cpu" in said[0]
    assert "Duplicate GPU" not in done.stderr
    errors = [e for e in events(tmp_path / "shared") if e["event"] == "error"]
    assert [e["error"].startswith("DistError: ranks 0 and 1 on") for e in errors] == [True]


@needs_gpus(1)
def test_a_cuda_run_passes_the_health_check_before_training(tmp_path, corpus):
    done = pyrecover("train", *gpu_args(tmp_path, corpus, "health", 1, "train.max_steps=2"),
                     timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    passed = [e for e in read_jsonl(tmp_path / "health" / "events.jsonl")
              if e["event"] == "health"]
    assert [e["ok"] for e in passed] == [True]


@needs_gpus(1)
def test_a_process_on_the_cpu_keeps_no_cuda_rng_and_one_on_the_gpu_keeps_its_own():
    """A CPU run on a GPU node (train.device=cpu, gpu-check's CPU benches) started CUDA on
    GPU 0 at every save, for its generator state; a CUDA process still saves that state."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from pyrecover.checkpoint import rng\n"
            "rng.restore(rng.capture())\n"
            "assert torch.cuda.is_available() and not torch.cuda.is_initialized()\n"
            "torch.zeros(1, device='cuda')\n"
            "state = rng.capture()\n"
            "assert len(state['cuda']) == 1, state['cuda']\n"
            "rng.restore(state)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
