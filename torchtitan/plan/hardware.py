"""The GPUs and links a plan is made for: datasheet and published figures, each with its source."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "Link", "DEEPEP_INTERNODE", "DEEPEP_INTRANODE_EP8", "NON_ALLOCATOR_GIB", "NVLINK", "RDMA"]


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """What CUDA reports as the card's memory (torch.cuda.get_device_properties(0).total_memory)."""
    memory_source: str
    hbm_tb_per_s: float
    bf16_tflops: float = 989.0
    """Dense bf16 datasheet peak, the trainer's MFU denominator (components/metrics.py)."""


GPUS = {
    "h100": GPU(
        "H100 80GB HBM3",
        79.2,
        "our H100s: 77.90 GiB was 98.38% of the card (e2e_16b8L_ep1_compile_sac_h100_88e71a6_oom.json)",
        3.35,
    ),
    "h200": GPU(
        "H200 141GB HBM3e",
        139.8,
        "143,771 MiB per nvidia-smi less the driver's share (~0.5 GiB, as on the H100); not yet read on our H200s",
        4.8,
    ),
}

NON_ALLOCATOR_GIB = 1.7
"""What the CUDA context, cuBLAS workspaces and NCCL take outside PyTorch's allocator: the 16B at FSDP4 x EP4 died
with 77.2-77.5 of 79.2 GiB reserved (e2e_16b_ep4_sac_everywhere_oom_2251419.json, benchmarks/NOTES.md)."""


@dataclass(frozen=True)
class Link:
    name: str
    gb_per_s: float
    """Per GPU, per direction."""
    source: str


NVLINK = Link("NVLink4", 450.0, "NVIDIA H100/H200 datasheet: 900 GB/s per GPU both directions together")
RDMA = Link(
    "RDMA, one 400 Gb/s NIC per GPU",
    45.0,
    "50 GB/s line rate; DeepEP's internode kernels reach 40-50 GB/s of RDMA bandwidth on 400 Gb/s NICs (DeepEP README)",
)
DEEPEP_INTRANODE_EP8 = (
    153.0,
    158.0,
    "DeepEP README: intranode EP8 dispatch 153 GB/s, combine 158 GB/s (H800 NVLink)",
)
"""(dispatch, combine) GB/s of received bytes at EP8 inside one node."""
DEEPEP_INTERNODE = (
    45.0,
    45.0,
    "DeepEP README: internode 40-50 GB/s RDMA bandwidth on 400 Gb/s NICs; DeepEP's internode path has not run here",
)
