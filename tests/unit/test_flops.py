"""MFU: the peak table and the arithmetic count the logs and `bench train` report."""

from __future__ import annotations

import pytest

from pyrecover import flops
from pyrecover.config import ModelConfig
from pyrecover.model import GPT


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
])
def test_known_gpus_have_their_datasheet_peak(name, tflops):
    assert flops.peak_flops(name) == tflops * 1e12


def test_an_unknown_device_has_no_mfu_rather_than_a_guess():
    assert flops.peak_flops("Some Future GPU") is None
    assert flops.mfu(1e6, 1e9, None) is None


def test_mfu_counts_six_flops_per_parameter_and_the_attention_per_token_over_all_devices():
    cfg = ModelConfig(vocab_size=512, block_size=128, n_layer=2, n_head=2, n_embd=64)
    n = GPT(cfg).num_params()
    per_token = flops.flops_per_token(cfg, n)
    assert per_token == 6 * n + 12 * 2 * 64 * 128
    one = flops.mfu(1000.0, per_token, 1e12)
    assert one == pytest.approx(1000.0 * per_token / 1e12)
    assert flops.mfu(1000.0, per_token, 1e12, devices=4) == pytest.approx(one / 4)
