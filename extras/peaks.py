"""MFU (model FLOPs utilisation): the TFLOP/s a run achieves over its GPU's dense peak for the
run's precision, from a table of the GPUs runs are most often on; --peak-tflops gives any other.
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger("train")

# Dense peak TFLOP/s (no 2:4 sparsity) of bfloat16 and float16 tensor cores, TF32 and FP32,
# matched on torch.cuda.get_device_name() in this order (a variant before its family); None where
# the GPU has no such tensor core. From NVIDIA's data sheets, whose tensor-core figures are "with
# sparsity" (halved here): H100 SXM 1979, PCIe 1513, NVL 1671 bfloat16; H200 1979, NVL 1671; A100
# 624; L4 242; A10 250; L40S 362 (dense); V100 SXM2 125, PCIe 112 and T4 65 float16 (dense).
PEAKS = [
    (r"\bH100\b.*\bNVL\b", 835.5, 835.5, 417.5, 60.0),
    (r"\bH100\b.*\bPCIe\b", 756.5, 756.5, 378.0, 51.0),
    (r"\bH100\b", 989.5, 989.5, 494.5, 67.0),
    (r"\bH200\b.*\bNVL\b", 835.5, 835.5, 417.5, 60.0),
    (r"\bH200\b", 989.5, 989.5, 494.5, 67.0),
    (r"\bA100\b", 312.0, 312.0, 156.0, 19.5),
    (r"\bL40S\b", 362.0, 362.0, 183.0, 91.6),
    (r"\bL4\b", 121.0, 121.0, 60.0, 30.3),
    (r"\bA10\b", 125.0, 125.0, 62.5, 31.2),
    (r"\bV100\b.*\bPCIE\b", None, 112.0, None, 14.0),
    (r"\bV100\b", None, 125.0, None, 15.7),
    (r"\bT4\b", None, 65.0, None, 8.1),
]


def known_peak(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """The table's dense peak TFLOP/s of the GPU named name for dtype (float32: TF32's where tf32
    and the GPU has it); None for a GPU it does not hold, or a precision with no tensor core."""
    for pattern, bf16, fp16, tf32_peak, fp32 in PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            if dtype == torch.float32:
                return tf32_peak if tf32 and tf32_peak else fp32
            return {torch.bfloat16: bf16, torch.float16: fp16}.get(dtype)
    return None


def peak_tflops(
    device: torch.device,
    dtype: torch.dtype,
    given: float | None,
    devices: int,
    convolutions: float = 0.0,
) -> float | None:
    """The peak a run's MFU is measured against, over its devices: given (--peak-tflops, a
    device's), or the table's for this GPU (a CUDA device) and the run's precision; says which, or
    why there is none, once. In float32, convolutions (their share of the FLOPs: first_step_flops)
    run in TF32 where cuDNN allows it (its default), matmuls only where the matmul precision does
    ("high"; PyTorch's default "highest" runs them in float32): each part at its own peak."""
    if given:
        log.info(f"mfu over {devices} x {given:g} TFLOP/s (--peak-tflops)")
        return devices * given
    if device.type != "cuda":  # no table of CPUs
        return None
    name = torch.cuda.get_device_name(device)
    peak = known_peak(name, dtype, torch.backends.cuda.matmul.allow_tf32)
    if peak is None:
        log.info(f"no mfu: no known {dtype} peak for {name} (give one with --peak-tflops)")
        return None
    if dtype == torch.float32 and convolutions:
        convolution_peak = known_peak(name, dtype, torch.backends.cudnn.allow_tf32)
        # the time of each part at its peak, added: the whole's
        peak = 1 / (convolutions / convolution_peak + (1 - convolutions) / peak)
    log.info(f"mfu over {devices} x {peak:.4g} TFLOP/s, the dense {dtype} peak of {name}")
    return devices * peak
