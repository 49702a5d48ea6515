"""The hardware a plan is costed on: each device's matmul rate and memory, and the
links a collective may cross: inside a host, between the hosts of a slice, and across
slices (a TPU multislice's data-centre network; elsewhere every device is in one slice
and the third link is never crossed).

A ``Hardware`` comes from a preset (``PRESETS``: H100 SXM, H800 SXM, H100 96GB at 500 W, H200,
A100 80GB, L4, TPU v5e, v5p and v6e, CPU),
from a probe of the live cluster (``redray/planning/probe.py``), or is written by hand.
Every preset number names its source; where a number is an assumption (how much of a
datasheet's peak a large matmul sustains, a collective's per-step latency) it says so,
and the probe replaces it with a measurement.
"""

from __future__ import annotations

import dataclasses

GB = 1e9  # vendors' bandwidths and rates are decimal


@dataclasses.dataclass(frozen=True)
class Link:
    """A link collectives cross, as the alpha-beta model sees it.

    Attributes:
      bandwidth: bytes per second each device sends (and receives) over it at once.
      latency: seconds each step of a ring collective costs besides its bytes.
    """
    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"a link needs a positive bandwidth and a latency >= 0, got "
                             f"bandwidth={self.bandwidth!r}, latency={self.latency!r}")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a plan's step time and memory are predicted on.

    Attributes:
      name: what it is ("H100 SXM", "probed: 2 hosts x 4 cpu").
      matmul_flops: floating-point operations per second one device sustains on the
        large matmuls of a training step, in the compute dtype.
      peak_flops: the datasheet's dense peak, for model FLOPs utilization (MFU).
      device_memory: bytes one device holds.
      devices_per_host: devices of one host (the unit the intra-host link joins).
      intra: the link between devices of one host (NVLink, ICI, shared memory).
      inter: the link between hosts of one slice (InfiniBand, Ethernet, a TPU slice's
        ICI), per device.
      overlap: the fraction of a layer's compute time that the gradient and FSDP
        collectives may hide behind (XLA's latency-hiding scheduler on GPU and TPU
        overlaps them with the layers' kernels; 0 on CPU, where collectives run in
        line; ``redray.planning.cost.exposed_seconds``). Tensor parallel all-reduces
        are on the critical path and never hidden.
      reduce_scatter: whether a sharded gradient is reduce-scattered (GPU and TPU) or
        all-reduced and sliced (XLA:CPU): the latter moves twice the bytes.
      micro_batch_overhead: seconds each micro-batch costs beside its matmuls and
        collectives (its launches, the accumulation loop's step).
      source: where the numbers come from.
      live: these are the devices this runtime runs on (the probe's numbers): a
        Trainer planning on them also times the model's own pass there
        (``redray.planning.cost.ModelTiming``).
      platform: "gpu", "tpu" or "cpu": which attention kernels a step has (GPUs and
        TPUs fused ones, which keep no (queries x keys) scores for the backward pass).
      memory_bandwidth: bytes per second one device's memory-bound kernels (norms,
        elementwise work, the optimizer's update) read and write; 0: not known, that
        work not costed.
      attention_flops: FLOPs per second a fused attention kernel sustains, forward and
        backward (``redray.planning.work.AttentionCall``'s count); 0: the matmul rate.
      slice_devices: devices of one slice (TPU multislice: the chips one ICI joins); 0:
        every device is in one slice. A collective whose group spans slices crosses
        ``dcn`` for its part across them (``redray.planning.cost``).
      dcn: the link between slices (the data-centre network), per device: a host's
        network bandwidth shared by its devices, as for ``inter`` (each of a host's
        devices sends its share of a hierarchical collective at once); None: ``inter``.
    """
    name: str
    matmul_flops: float
    peak_flops: float
    device_memory: float
    devices_per_host: int
    intra: Link
    inter: Link
    overlap: float = 1.0
    reduce_scatter: bool = True
    micro_batch_overhead: float = 0.0
    source: str = ""
    live: bool = False
    platform: str = "gpu"
    memory_bandwidth: float = 0.0
    attention_flops: float = 0.0
    slice_devices: int = 0
    dcn: Link | None = None

    @property
    def across_slices(self) -> Link:
        """The link a collective crosses between slices (``dcn``, else ``inter``)."""
        return self.dcn or self.inter

    def slices(self, devices: int) -> int:
        """How many slices ``devices`` devices fill (1 where no slice size is set)."""
        return max(1, devices // self.slice_devices) if self.slice_devices else 1

    def in_slices(self, slices: int, devices: int) -> "Hardware":
        """These devices as ``slices`` slices of ``devices / slices`` each (1: one
        slice, as every preset is).

        Raises:
          ValueError: ``slices`` does not divide ``devices``, or a slice would hold part
            of a host.
        """
        if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
            raise ValueError(f"slices must be a positive int, got {slices!r}")
        if slices == 1:
            return dataclasses.replace(self, slice_devices=0)
        per = devices // slices
        if devices % slices or per % self.devices_per_host:
            step = slices * self.devices_per_host
            raise ValueError(
                f"{devices} devices do not make {slices} slices of whole {self.name} hosts "
                f"({self.devices_per_host} devices each): give a device count that is a "
                f"multiple of {slices} x {self.devices_per_host} = {step} (--devices "
                f"{max(step, devices // step * step)}), or another --slices")
        return dataclasses.replace(self, slice_devices=per)

    @property
    def attention_rate(self) -> float:
        """The fused attention kernel's rate (the matmul rate where not known)."""
        return self.attention_flops or self.matmul_flops

    @property
    def fused_attention(self) -> bool:
        """Whether a step's attention runs a fused kernel here (GPU, TPU): its residuals
        are the blockwise kernel's (inputs, output, softmax statistics)."""
        return self.platform in ("gpu", "tpu")

    @property
    def grouped_matmuls(self) -> bool:
        """Whether a mixture of experts' grouped matmul (``jax.lax.ragged_dot``) computes
        each row against its own expert's kernel only (GPU, TPU), not against every
        expert's, masked (XLA:CPU's lowering)."""
        return self.platform in ("gpu", "tpu")

    def __post_init__(self):
        if not (self.matmul_flops > 0 and self.peak_flops > 0 and self.device_memory > 0):
            raise ValueError(f"Hardware {self.name!r}: matmul_flops, peak_flops and "
                             "device_memory must be positive")
        if not (isinstance(self.devices_per_host, int) and self.devices_per_host >= 1):
            raise ValueError(f"Hardware {self.name!r}: devices_per_host must be a positive "
                             f"int, got {self.devices_per_host!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Hardware {self.name!r}: overlap is a fraction in [0, 1], got "
                             f"{self.overlap!r}")
        if not (isinstance(self.slice_devices, int) and self.slice_devices >= 0):
            raise ValueError(f"Hardware {self.name!r}: slice_devices must be an int >= 0 "
                             f"(0: one slice), got {self.slice_devices!r}")

    def with_inter(self, bandwidth: float, latency: float, what: str) -> "Hardware":
        """The same devices joined across hosts by another link (``what`` names it)."""
        return dataclasses.replace(self, name=f"{self.name} over {what}",
                                   inter=Link(bandwidth, latency),
                                   source=f"{self.source}; between hosts: {what}")

    def to_dict(self) -> dict:
        """Every field as JSON-ready values (a plan keeps the hardware it was chosen on
        so: ``redray.sharding.plan.Plan.hardware``); ``from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Hardware":
        """The hardware ``to_dict`` wrote (one written before slices reads as one slice)."""
        dcn = d.get("dcn")
        return cls(**{**d, "intra": Link(**d["intra"]), "inter": Link(**d["inter"]),
                      "dcn": None if dcn is None else Link(**dcn)})

    def describe(self) -> dict:
        """The numbers, for the run's log and MLflow."""
        return {"hardware": self.name, "matmul_tflops": self.matmul_flops / 1e12,
                "peak_tflops": self.peak_flops / 1e12,
                "device_memory_gib": self.device_memory / (1 << 30),
                "devices_per_host": self.devices_per_host,
                "intra_gb_per_s": self.intra.bandwidth / GB,
                "intra_latency_us": self.intra.latency * 1e6,
                "inter_gb_per_s": self.inter.bandwidth / GB,
                "inter_latency_us": self.inter.latency * 1e6,
                "slice_devices": self.slice_devices,
                "dcn_gb_per_s": self.across_slices.bandwidth / GB,
                "dcn_latency_us": self.across_slices.latency * 1e6,
                "memory_gb_per_s": self.memory_bandwidth / GB,
                "attention_tflops": self.attention_rate / 1e12,
                "overlap": self.overlap, "reduce_scatter": self.reduce_scatter,
                "micro_batch_overhead_ms": self.micro_batch_overhead * 1e3}


# How much of a datasheet's rates a training step's kernels sustain, measured on this
# project's H200 (the device tool's KINDS.md, 2026-11-04: an 8192^3 bf16 matmul at 769
# to 798 TFLOP/s of 989; a device-to-device copy at 4.3 TB/s of 4.8) and in
# docs/performance/gpu-mfu.md (cuDNN's causal flash attention, 32 query and 8 key/value
# heads of 128, 4,096 tokens x 8, forward and backward in 8.3 ms: 464 TFLOP/s by
# ``AttentionCall``'s count). The same GH100 chip at its 700 W limit is taken to
# sustain the same shares on the H100 SXM; other chips' shares are assumptions
# (probe them).
MATMUL_SUSTAINED = 0.79
MEMORY_SUSTAINED = 0.9
ATTENTION_SUSTAINED = 0.47
# Per ring step: the order of NCCL's small-message latencies (a few microseconds on
# NVLink, about ten over InfiniBand, tens over TCP Ethernet): assumptions, probed on a
# live cluster.
NVLINK_LATENCY, IB_LATENCY, ETHERNET_LATENCY = 5e-6, 10e-6, 50e-6
TB = 1e12


def _gpu(name: str, peak: float, memory: float, bandwidth: float, nvlink: float,
         network: float, source: str, clock: float = 1.0) -> Hardware:
    """A GPU of ``peak`` dense bf16 FLOP/s, ``memory`` bytes of HBM at ``bandwidth``
    bytes/s, ``nvlink`` bytes/s each way to each other GPU of its host and ``network``
    bytes/s to other hosts, at the measured shares of each rate (``clock``: the share of
    its full clock it runs at under a power limit)."""
    return Hardware(name, MATMUL_SUSTAINED * clock * peak, peak, memory, 8,
                    intra=Link(nvlink, NVLINK_LATENCY), inter=Link(network, IB_LATENCY),
                    micro_batch_overhead=1e-3, source=source,
                    memory_bandwidth=MEMORY_SUSTAINED * bandwidth,
                    attention_flops=ATTENTION_SUSTAINED * clock * peak)


# A TPU's per-step latency on ICI (an assumption, as NVLink's); across slices a step
# goes through the hosts' network stacks: Ethernet's order, an assumption too.
ICI_LATENCY = 5e-6


def _tpu(name: str, peak: float, memory: float, bandwidth: float, ici: float, chips: int,
         dcn: float, source: str) -> Hardware:
    """A TPU chip of ``peak`` dense bf16 FLOP/s and ``memory`` bytes of HBM at
    ``bandwidth`` bytes/s, ``chips`` to a host, ``ici`` bytes/s each way inside its
    slice (between its hosts too) and ``dcn`` bytes/s per chip across slices, at the
    shares of each rate measured on the H200 (assumed: probe them)."""
    return Hardware(name, MATMUL_SUSTAINED * peak, peak, memory, chips,
                    intra=Link(ici, ICI_LATENCY), inter=Link(ici, ICI_LATENCY),
                    micro_batch_overhead=5e-4, platform="tpu",
                    memory_bandwidth=MEMORY_SUSTAINED * bandwidth,
                    attention_flops=ATTENTION_SUSTAINED * peak, source=source,
                    dcn=Link(dcn, ETHERNET_LATENCY))


# An H100 SXM held to 500 W (Meta's Grand Teton default, where torchtitan measured):
# the share of its 700 W compute rate, an assumption: a chip's dynamic power grows about
# as the cube of its clock (voltage scales with the clock), so 500/700 of the power
# sustains (500/700)^(1/3) of the clock. Not measured here; torchtitan publishes none.
POWER_500W = (500 / 700) ** (1 / 3)

PRESETS: dict[str, Hardware] = {
    "h100": _gpu(
        "H100 SXM", 989e12, 80 * GB, 3.35 * TB, 450 * GB, 50 * GB,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS dense BF16, 80 GB HBM3 "
        "at 3.35 TB/s, NVLink 900 GB/s both ways); DGX H100: one 400 Gb/s NDR InfiniBand "
        "port per GPU; sustained shares measured on an H200 (same chip)"),
    # DeepSeek-V3's cluster: the export-limited H800, an H100 SXM whose NVLink is cut
    # to 400 GB/s both ways; DeepSeek measured 160 GB/s of it per GPU each way
    "h800": _gpu(
        "H800 SXM", 989e12, 80 * GB, 3.35 * TB, 160 * GB, 50 * GB,
        "the H100 SXM datasheet's compute and memory (989 TFLOPS dense BF16, 80 GB HBM3 "
        "at 3.35 TB/s: the same GH100 chip), NVLink cut to 400 GB/s both ways; the "
        "DeepSeek-V3 technical report (arXiv 2412.19437, section 3.1): 8 GPUs per node, "
        "NVLink at 160 GB/s per GPU as they measured it, 8 x 400 Gb/s InfiniBand NICs "
        "per node (50 GB/s per GPU); sustained shares measured on an H200 (same chip)"),
    "h100-96gb-500w": _gpu(
        "H100 96GB at 500 W", 989e12, 96 * GB, 2.4 * TB, 450 * GB, 50 * GB,
        "Meta's Grand Teton H100 as torchtitan's benchmarks describe it (96 GB HBM2e at "
        "2.4 TB/s, NVLink within the host, 400 Gb/s RDMA per GPU, the default 500 W "
        "limit); the 500 W clock share is an assumption", clock=POWER_500W),
    "h200": _gpu(
        "H200 SXM", 989e12, 141 * GB, 4.8 * TB, 450 * GB, 50 * GB,
        "NVIDIA H200 datasheet (989 TFLOPS dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink "
        "900 GB/s both ways); A3 Ultra / DGX H200: 400 Gb/s per GPU between hosts; "
        "sustained shares measured on this project's H200"),
    "a100": Hardware(
        "A100 80GB SXM", MATMUL_SUSTAINED * 312e12, 312e12, 80 * GB, 8,
        intra=Link(300 * GB, NVLINK_LATENCY), inter=Link(25 * GB, IB_LATENCY),
        micro_batch_overhead=1e-3, memory_bandwidth=MEMORY_SUSTAINED * 2.04 * TB,
        attention_flops=ATTENTION_SUSTAINED * 312e12,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS dense BF16, "
               "2,039 GB/s HBM2e, NVLink 600 GB/s both ways); DGX A100: one 200 Gb/s HDR "
               "InfiniBand port per GPU; sustained shares assumed as on the H200"),
    "l4": Hardware(
        "L4", MATMUL_SUSTAINED * 121e12, 121e12, 24 * GB, 8,
        intra=Link(32 * GB, 10e-6), inter=Link(100 / 8 * GB / 8, ETHERNET_LATENCY),
        micro_batch_overhead=1e-3, memory_bandwidth=MEMORY_SUSTAINED * 300 * GB,
        attention_flops=ATTENTION_SUSTAINED * 121e12,
        source="NVIDIA L4 datasheet (121 TFLOPS dense BF16, 24 GB at 300 GB/s, PCIe Gen4 "
               "x16 64 GB/s both ways, no NVLink); Google Cloud g2-standard-96: 8 L4 per "
               "VM, 100 Gb/s of network per VM, shared by its 8 GPUs; sustained shares "
               "assumed as on the H200"),
    # TPUs: Google Cloud's system-architecture pages (cloud.google.com/tpu/docs/v5e, v5p,
    # v6e, read 2026-12). A chip's ICI bandwidth as the link each device sends over at
    # once (half the bidirectional figure); the hosts of one slice are joined by the
    # same ICI, so ``inter`` is ``intra``; across slices the hosts' data-centre network
    # (DCN), each host's NICs shared by its chips.
    "tpu-v5e": _tpu(
        "TPU v5e", 197e12, 16 * GB, 819 * GB, 200 * GB, 8, 2 * 100 / 8 * GB / 8,
        "Google Cloud TPU v5e documentation (197 TFLOPS BF16, 16 GB HBM2 at 819 GB/s, ICI "
        "1600 Gb/s per chip, 8 chips and 2 x 100 Gb/s NICs per host); the hosts of one "
        "slice are joined by the same ICI, slices by the hosts' NICs (DCN); sustained "
        "shares assumed as on the H200"),
    "tpu-v5p": _tpu(
        "TPU v5p", 459e12, 95 * GB, 2765 * GB, 600 * GB, 4, 50 / 8 * GB,
        "Google Cloud TPU v5p documentation (459 TFLOPS BF16, 95 GB HBM2e at 2,765 GB/s, "
        "ICI 4,800 Gb/s per chip (1,200 GB/s both ways) in a 3D torus, 4 chips per host "
        "(ct5p-hightpu-4t), DCN 50 Gb/s per chip); sustained shares assumed as on the "
        "H200"),
    "tpu-v6e": _tpu(
        "TPU v6e (Trillium)", 918e12, 32 * GB, 1640 * GB, 400 * GB, 4, 4 * 200 / 8 * GB / 8,
        "Google Cloud TPU v6e documentation (918 TFLOPS BF16, 32 GB HBM at 1,640 GB/s, "
        "ICI 800 GB/s per chip both ways in a 2D torus (3,584 Gb/s in the page's first "
        "version), 4 x 200 Gb/s NICs per 8-chip host; a multi-host slice's VMs hold 4 "
        "chips each (ct6e-standard-4t), the DCN per chip the same 100 Gb/s); sustained "
        "shares assumed as on the H200"),
    "cpu": Hardware(
        "CPU (simulated devices)", 5e9, 5e9, 24 * (1 << 30) / 8, 4,
        intra=Link(2 * GB, 20e-6), inter=Link(0.5 * GB, 100e-6), overlap=0.0,
        reduce_scatter=False, micro_batch_overhead=2e-3, platform="cpu",
        source="the order of what this project's 2-core CI machine gives each of 4 simulated "
               "devices (XLA:CPU, gloo across processes); probe the machine for its numbers"),
}


def ethernet(hardware: Hardware, gbit_per_host: float = 100.0) -> Hardware:
    """``hardware`` with hosts joined by TCP Ethernet of ``gbit_per_host`` Gb/s, shared by
    the host's devices (a cloud machine's NIC)."""
    per_device = gbit_per_host / 8 * GB / hardware.devices_per_host
    return hardware.with_inter(per_device, ETHERNET_LATENCY, f"{gbit_per_host:g} Gb/s Ethernet")


def preset(name: str) -> Hardware:
    """A preset by name (``h100``, ``h800``, ``h100-96gb-500w``, ``h200``, ``a100``, ``l4``,
    ``tpu-v5e``, ``tpu-v5p``, ``tpu-v6e``, ``cpu``); a name ending
    ``+ethernet`` joins its hosts by 100 Gb/s Ethernet instead."""
    base, _, link = name.partition("+")
    if base not in PRESETS or link not in ("", "ethernet"):
        raise ValueError(f"unknown hardware {name!r}: use one of "
                         f"{', '.join(sorted(PRESETS))}, optionally with '+ethernet'")
    return ethernet(PRESETS[base]) if link else PRESETS[base]


def for_backend() -> Hardware:
    """The preset of this process's JAX backend's kind of device (a GPU: ``h100``; a
    TPU: ``tpu-v5e``; else ``cpu``): what a choice takes where no hardware was probed
    or named."""
    import jax

    return preset({"gpu": "h100", "tpu": "tpu-v5e"}.get(jax.default_backend(), "cpu"))
