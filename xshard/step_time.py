"""Step time predicted before renting the machines: compute and communication of one training step per device,
and which of the two bounds it (``xshard estimate --machine``).

The model, stated so it can be checked (``benchmarks/published_runs.py`` sets it beside published runs):

- compute: the step's tokens per device times the FLOPs of a trained token (``runtime.throughput.ModelFlops``:
  6N + 12 L d s, the PaLM formula, N without the input embedding), at ``mfu`` of the device's dense peak
  (the backends' ``Backend.peak_tflops``). The MFU is an assumption (0.40 by default, ``--mfu``): published
  FSDP runs of 7-8B models on H100s report 33-40%; measure your own with ``accelerator.throughput()``.
- communication: what each device sends in one step by ring collectives over the data-parallel world (W
  devices): an all-gather or a reduce-scatter of S bytes sends S (W-1)/W, an all-reduce twice that. Per
  step (psi: the parameters' bytes in the compute dtype, ``estimate.PRECISIONS``; one micro-batch a step):
  stage 0 all-reduces the gradients (2 psi), stages 1-2 reduce-scatter them and all-gather the updated
  parameters (2 psi), stage 3 gathers the parameters for forward and backward and reduce-scatters the
  gradients (3 psi). On one node the
  links are the node's (NVLink, HCCS, Infinity Fabric, ICI); across nodes a ring crosses them at the
  network's speed per device (one NIC per device, as the machines of the table have), which bounds it. The
  links run at ``COMM_EFFICIENCY`` of their datasheet speed (NCCL's all-reduce bus bandwidth on 8 H100s is
  about 80% of NVLink's 450 GB/s per direction).
- overlap: xshard issues each unit's gathers ahead of its compute and reduces each unit's gradients as
  backward goes, so the step takes the longer of the two (``bound`` names it), not their sum.

Not modelled: activation recomputation (add a third of the compute for full checkpointing), pipeline or tensor
parallelism, the optimizer's own time, data loading, stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .backends import peak_tflops_table
from .estimate import PRECISIONS, EstimateError, ModelSize
from .runtime.throughput import ModelFlops

#: the fraction of a link's datasheet speed that ring collectives reach
COMM_EFFICIENCY = 0.8
#: the MFU assumed when none is given
DEFAULT_MFU = 0.40


@dataclass(frozen=True)
class Machine:
    """One node type: its devices' peak (``family``, a model of ``xshard.backends.peak_tflops_table()``), the
    links' speed per device and direction in GB/s inside a node and across nodes, the devices per node, and where
    the figures come from."""

    family: str
    intra_node_gbs: float
    inter_node_gbs: float
    devices_per_node: int
    source: str


MACHINES: dict[str, Machine] = {
    "a100": Machine("A100", 300.0, 25.0, 8, "DGX A100: NVLink 3, 600 GB/s per GPU both ways; 8 x 200 Gb/s HDR "
                    "InfiniBand, one per GPU"),
    "h100": Machine("H100", 450.0, 50.0, 8, "DGX H100: NVLink 4, 900 GB/s per GPU both ways; 8 x 400 Gb/s NDR "
                    "InfiniBand (ConnectX-7), one per GPU"),
    "h200": Machine("H200", 450.0, 50.0, 8, "HGX H200: NVLink 4, 900 GB/s per GPU both ways; 8 x 400 Gb/s NDR, one "
                    "per GPU"),
    "b200": Machine("B200", 900.0, 50.0, 8, "DGX B200: NVLink 5, 1.8 TB/s per GPU both ways; 8 x 400 Gb/s "
                    "(ConnectX-7), one per GPU"),
    "mi300x": Machine("MI300X", 448.0, 50.0, 8, "AMD MI300X platform: 7 Infinity Fabric links, 896 GB/s per GPU both "
                      "ways; 8 x 400 Gb/s NICs, one per GPU"),
    "910b": Machine("Ascend910B", 196.0, 25.0, 8, "Atlas 800T A2: HCCS full mesh, 392 GB/s per NPU both ways; 8 x "
                    "200 Gb/s RoCE, one per NPU"),
    "tpu-v5p": Machine("TPU v5p", 600.0, 600.0, 4, "Google Cloud TPU v5p: ICI 4,800 Gbps per chip, in the pod's torus "
                       "(no slower network inside a slice)"),
    "tpu-v6e": Machine("TPU v6e", 448.0, 448.0, 8, "Google Cloud TPU v6e: ICI 3,584 Gbps per chip, in the slice's "
                       "torus"),
}


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds per device, and what bounds it."""

    compute_s: float
    comm_s: float
    tokens_per_device: int
    comm_bytes_per_device: float
    flops_per_token: float

    @property
    def step_s(self) -> float:
        """Compute and communication overlap: the longer one is the step."""
        return max(self.compute_s, self.comm_s)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_device / self.step_s

    @property
    def bound(self) -> str:
        """"compute" or "communication": which of the two sets the step's time."""
        return "compute" if self.compute_s >= self.comm_s else "communication"


def comm_bytes_per_device(params: int, stage: int, world: int, dtype: str = "bf16") -> float:
    """Bytes one device sends in one step by ring collectives (the module docstring's table): parameters
    gathered in the compute dtype, gradients reduced in it (stages 1-3 reduce in the compute dtype)."""
    if world <= 1:
        return 0.0
    state = PRECISIONS[dtype]
    gathered, reduced = params * state.param_bytes, params * state.grad_bytes
    volume = {0: 2 * reduced, 1: reduced + gathered, 2: reduced + gathered, 3: reduced + 2 * gathered}[stage]
    return volume * (world - 1) / world


def predict(size: ModelSize, stage: int, world: int, machine: Machine, *, micro_batch: int = 1, seq_len: int = 2048,
            dtype: str = "bf16", mfu: float = DEFAULT_MFU) -> StepTime:
    """The step time of ``size`` trained at ``stage`` on ``world`` devices of ``machine`` (the module docstring)."""
    if not 0 < mfu <= 1:
        raise EstimateError(f"--mfu {mfu}: give the fraction of the peak the model's compute reaches, e.g. 0.4")
    figures = peak_tflops_table().figures[machine.family]
    peak = figures.get(dtype)
    if peak is None:
        raise EstimateError(f"{machine.family} has no published {dtype} peak; use {' or '.join(figures)}")
    flops = ModelFlops(size.total_params, size.vocab_size * size.hidden_size, size.num_layers, size.hidden_size)
    per_token = flops.per_token(seq_len)
    tokens = micro_batch * seq_len
    compute_s = tokens * per_token / (peak[0] * 1e12 * mfu)
    sent = comm_bytes_per_device(size.total_params, stage, world, dtype)
    link = machine.inter_node_gbs if world > machine.devices_per_node else machine.intra_node_gbs
    comm_s = sent / (link * 1e9 * COMM_EFFICIENCY)
    return StepTime(compute_s, comm_s, tokens, sent, per_token)
