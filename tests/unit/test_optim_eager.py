"""pyrecover's AdamW is torch's, bit for bit, without the torch._dynamo import of its first use;
and a vanilla start at world size 1 builds, resumes and trains without importing it at all."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from helpers import pyrecover, tiny_args

from pyrecover.optim import AdamW


def model_and_batches(seed: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    return model, [torch.randn(5, 8) for _ in range(6)]


def train(optimizer_cls, fused: bool | None, seed: int = 0, steps: int = 6):
    model, batches = model_and_batches(seed)
    optimizer = optimizer_cls([{"params": list(model[0].parameters()), "weight_decay": 0.1},
                               {"params": list(model[1:].parameters()), "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    posted = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: posted.append(1))
    for x in batches[:steps]:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler, len(posted)


@pytest.mark.parametrize("fused", [True, None], ids=["fused", "foreach-or-single"])
def test_it_trains_to_the_same_bits_and_state_as_torchs_adamw(fused):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. the scheduler's "step() before optimizer.step()"
        ours, ours_opt, _, ours_hooks = train(AdamW, fused)
    theirs, theirs_opt, _, theirs_hooks = train(torch.optim.AdamW, fused)
    assert ours_hooks == theirs_hooks == 6  # the step hooks ran, once per step
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    mine, other = ours_opt.state_dict(), theirs_opt.state_dict()
    assert mine["param_groups"] == other["param_groups"]
    assert mine["state"].keys() == other["state"].keys()
    for i, state in mine["state"].items():
        for key, value in state.items():
            assert torch.equal(value, other["state"][i][key]), (i, key)


@pytest.mark.parametrize("saved_by, loaded_by", [(torch.optim.AdamW, AdamW),
                                                  (AdamW, torch.optim.AdamW)],
                         ids=["torchs-into-ours", "ours-into-torchs"])
def test_a_state_saved_by_either_loads_into_the_other_and_training_goes_on_alike(saved_by,
                                                                                loaded_by):
    saved, saved_opt, _, _ = train(saved_by, True, steps=3)
    model, batches = model_and_batches(0)
    model.load_state_dict(saved.state_dict())
    again = loaded_by([{"params": list(model[0].parameters()), "weight_decay": 0.1},
                       {"params": list(model[1:].parameters()), "weight_decay": 0.0}],
                      lr=1e-2, betas=(0.9, 0.95), fused=True)
    buffer = io.BytesIO()  # as a checkpoint carries it (and no tensor shared with saved_opt)
    torch.save(saved_opt.state_dict(), buffer)
    buffer.seek(0)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    for x in batches[3:]:
        for m, opt in ((saved, saved_opt), (model, again)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(saved.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


# Runs `python -m pyrecover ARGS` and writes the file NOTE if torch._dynamo is imported.
PROBE = """
import runpy, sys
note = sys.argv[1]
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            open(note, "w").close()
        return None
sys.meta_path.insert(0, Probe())
sys.argv = ["pyrecover", *sys.argv[2:]]
runpy.run_module("pyrecover", run_name="__main__", alter_sys=True)
"""


def imports_dynamo(tmp_path, *args: str) -> bool:
    note = tmp_path / "imported-torch-dynamo"
    note.unlink(missing_ok=True)
    done = pyrecover(*args, via=("-c", PROBE, str(note)))
    assert done.returncode == 0, done.stderr[-3000:]
    return note.exists()


def test_a_vanilla_run_at_world_size_1_starts_and_resumes_without_importing_torch_dynamo(
        tmp_path, corpus):
    """torch._dynamo took 1.0-1.1 s of every start on the 2-core VM, imported by torch's
    optimizer wrappers and by `nn.init.normal_` on the meta device (a resume's model). DDP
    and DCP's state_dict helpers still import it: world sizes above 1, the dcp and memory
    modes, and compiled runs."""
    run = ["train", *tiny_args(tmp_path, corpus, "run", "train.device=cpu",
                               "checkpoint.interval=5")]
    assert not imports_dynamo(tmp_path, *run, "--set", "train.max_steps=10")  # a fresh start
    assert not imports_dynamo(tmp_path, *run, "--set", "train.max_steps=15")  # a resume
    # The probe sees an import where there is one: a dcp checkpoint's state_dict helpers.
    assert imports_dynamo(tmp_path, "train", *tiny_args(
        tmp_path, corpus, "dcp", "train.device=cpu", "checkpoint.interval=5",
        "train.max_steps=5", "checkpoint.mode=dcp"))
