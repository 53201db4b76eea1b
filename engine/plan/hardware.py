"""GPU presets for predicted seconds: dense bf16 tensor-core peaks and memory, from the vendors' datasheets.

NVIDIA's datasheets print tensor throughput *with 2:4 structured sparsity*; the dense peak, which is what a
diffusion transformer's GEMMs can reach, is half of it:

* H100 SXM5 80 GB: "BFLOAT16 Tensor Core 1,979 teraFLOPS*" (* with sparsity) -> 989.4 TFLOPS dense
  (NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/).
* H200 SXM 141 GB: the same GH100 chip and clocks as H100 SXM, more and faster memory: "BFLOAT16 Tensor Core
  1,979 TFLOPS" with sparsity -> 989.4 dense (NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/).
* A100 SXM4 80 GB: "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*" (NVIDIA A100 datasheet,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf).
* GeForce RTX 4090 24 GB: "Peak BF16 Tensor TFLOPS with FP32 Accumulate 165.2 | 330.4" (NVIDIA Ada GPU
  Architecture whitepaper, appendix table of the RTX 4090,
  https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf). GeForce parts run
  fp16/bf16 with fp32 accumulation at half the fp16-accumulate rate; fp32 accumulation is what PyTorch uses.

A forward never runs at the peak: predicted seconds = FLOPs / (peak x MFU), where the model FLOP utilisation
``mfu`` is a knob (default 0.5: large bf16 DiT forwards on Hopper typically reach 0.4-0.6 with flash attention).

For the batched session-pool tick (``sessions.py``) the presets also carry the streaming multiprocessor count
and the memory bandwidth: H100 SXM5 132 SMs, 3.35 TB/s HBM3; H200 SXM the same 132-SM GH100, 4.8 TB/s HBM3e;
A100 SXM4 80 GB 108 SMs, 2.039 TB/s HBM2e; RTX 4090 128 SMs (16,384 CUDA cores, 128 a SM), 1.008 TB/s GDDR6X
(the same datasheets).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    label: str
    dense_bf16_tflops: float
    memory_gb: float  # 10^9 bytes, as the datasheets count
    source: str
    sms: int  # streaming multiprocessors: how many GEMM output tiles run at once
    memory_tb_s: float  # memory bandwidth, 10^12 bytes per second

    @property
    def peak_flops(self) -> float:
        return self.dense_bf16_tflops * 1e12


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "h100",
            "NVIDIA H100 SXM5 80GB",
            989.4,
            80,
            "NVIDIA H100 datasheet: 1,979 TFLOPS bf16 sparse / 2",
            132,
            3.35,
        ),
        GpuSpec(
            "h200",
            "NVIDIA H200 SXM 141GB",
            989.4,
            141,
            "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 sparse / 2",
            132,
            4.8,
        ),
        GpuSpec(
            "a100",
            "NVIDIA A100 SXM4 80GB",
            312.0,
            80,
            "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense",
            108,
            2.039,
        ),
        GpuSpec(
            "rtx4090",
            "NVIDIA GeForce RTX 4090 24GB",
            165.2,
            24,
            "NVIDIA Ada architecture whitepaper: 165.2 TFLOPS bf16 dense, fp32 accumulate",
            128,
            1.008,
        ),
    )
}

DEFAULT_MFU = 0.5


def gpu_spec(name: str, input_name: str = "gpu") -> GpuSpec:
    key = name.lower().replace(" ", "").replace("-", "")
    if key not in GPUS:
        raise InputError(input_name, f"unknown GPU preset {name!r}; known presets: {', '.join(GPUS)}")
    return GPUS[key]


def check_mfu(mfu: float, input_name: str = "mfu") -> float:
    if not 0 < mfu <= 1:
        raise InputError(input_name, f"{mfu} is not a model FLOP utilisation in (0, 1] (e.g. 0.5)")
    return float(mfu)
