"""`train.parallel: fsdp` on real GPUs: FSDP2's bf16 mixed precision over fp32 master weights,
NCCL reduce-scatters, and checkpoints of sharded CUDA state.

Written on a machine without a GPU (they skip there, saying why); `make gpu-test` runs them.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import pyrecover
from test_gpu import GPUS, TIMEOUT, check, gpu_args, losses, needs_gpus  # same folder

from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank_group(tmp_path):
    """A real process group of one rank on the first GPU (NCCL), for FSDP in this process."""
    import torch.distributed as tdist

    torch.cuda.set_device(0)
    tdist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                             world_size=1, device_id=torch.device("cuda", 0))
    yield
    tdist.destroy_process_group()


@needs_gpus(1)
def test_fsdp_computes_in_bf16_from_fp32_master_weights_and_reduces_in_fp32(one_rank_group):
    from pyrecover import config, parallel
    from pyrecover.model import GPT, GPTConfig

    device = torch.device("cuda", 0)
    cfg = config.load(None, ["model.n_layer=2", "model.n_embd=64", "model.n_head=2"])
    model = GPT(GPTConfig(**config.to_dict(cfg)["model"])).to(device)
    parallel.shard(model, device, "auto")
    seen: list[torch.dtype] = []
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, inp, out: seen.append(out.dtype))
    x = torch.randint(0, 320, (2, 32), device=device)
    _, loss = model(x, x)
    loss.backward()
    assert seen == [torch.bfloat16]  # the block's matmuls ran in bf16 without autocast
    assert loss.dtype == torch.float32  # the loss is taken over fp32 logits
    for name, p in model.named_parameters():  # master weights and their gradients stay fp32
        assert p.dtype == torch.float32 and p.grad is not None, name
        assert p.grad.dtype == torch.float32, name
    norm = parallel.clip_grad_norm(model, 1.0)
    assert norm.dtype == torch.float32 and math.isfinite(norm.item())

    cfg32 = config.load(None, ["train.precision=fp32"])
    assert not parallel.mixed_precision(device, cfg32.train.precision)


@needs_gpus(2)
@pytest.mark.parametrize("mode", ["dcp", "vanilla", "memory"])
def test_fsdp_on_nccl_trains_and_a_killed_run_resumes_where_it_was(tmp_path, corpus, mode):
    world = GPUS
    extra = ("train.parallel=fsdp", f"checkpoint.mode={mode}", "train.max_steps=12")
    ref = pyrecover("train", "--nproc", str(world),
                    *gpu_args(tmp_path, corpus, "ref", world, *extra), timeout=TIMEOUT)
    check(ref)
    starts = [e for e in read_jsonl(tmp_path / "ref" / "events.jsonl") if e["event"] == "start"]
    assert [e["parallel"] for e in starts] == ["fsdp"]
    ref_losses = losses(tmp_path / "ref")
    assert all(math.isfinite(v) for v in ref_losses.values())
    assert ref_losses[12] < ref_losses[1]

    killed = pyrecover("train", "--nproc", str(world),
                       *gpu_args(tmp_path, corpus, "run", world, *extra),
                       env={"PYRECOVER_KILL_AT_STEP": "8"}, timeout=TIMEOUT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    again = pyrecover("train", "--nproc", str(world),
                      *gpu_args(tmp_path, corpus, "run", world, *extra), timeout=TIMEOUT)
    check(again)
    assert "resumed from" in again.stderr and "(step 5," in again.stderr
    run_losses = losses(tmp_path / "run")
    # NCCL's reduction order is fixed at a fixed world size; the bf16 compute is not
    # guaranteed to be bitwise across process starts (kernel choice), hence a tolerance.
    for step in range(6, 13):
        assert run_losses[step] == pytest.approx(ref_losses[step], rel=1e-3), step
