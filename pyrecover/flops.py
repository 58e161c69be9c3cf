"""Model FLOPs utilisation (MFU): the training's useful arithmetic against the GPU's peak.

The peak table is the one place that knows GPUs: dense bf16 tensor-core TFLOP/s from each
vendor datasheet (no sparsity). A device it does not know has no MFU (None), never a guess.
"""

from __future__ import annotations

from pyrecover.config import ModelConfig

# Matched in order against `torch.cuda.get_device_name()`, case-insensitively: the more
# specific names first ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200 NVL", 835.0),  # the PCIe card: 600 W, against the SXM part's 700 W
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
)


def peak_flops(device_name: str) -> float | None:
    """peak_flops is the dense bf16 peak in FLOP/s of the GPU named `device_name`, if known."""
    name = device_name.lower()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in name:
            return tflops * 1e12
    return None


def flops_per_token(model: ModelConfig, n_params: int) -> float:
    """flops_per_token is the forward + backward arithmetic per trained token: 6 per parameter
    (the matrix products) plus the attention scores and their use, 12 x layers x width x
    sequence length (PaLM's appendix B; what nanoGPT's MFU counts). Position embeddings are
    counted in `n_params`, a 1% overstatement for small models, as nanoGPT does."""
    return 6.0 * n_params + 12.0 * model.n_layer * model.n_embd * model.block_size


def mfu(tokens_per_s: float, per_token: float, peak: float | None,
        devices: int = 1) -> float | None:
    """mfu is the fraction of `devices` GPUs' `peak` that `tokens_per_s` tokens a second (all
    ranks together) use; None where the peak is unknown (a CPU, an unlisted GPU)."""
    if not peak or tokens_per_s <= 0:
        return None
    return tokens_per_s * per_token / (peak * devices)
