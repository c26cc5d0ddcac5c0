"""Cluster descriptions: a cost model from the hardware, without measuring it.

A :class:`Cluster` says what a machine is made of: nodes, GPUs per node, the GPU (tensor-core
FLOP/s per dtype, memory bandwidth), the intra-node link (NVLink/NVSwitch, or PCIe when GPUs talk
through the host), the inter-node NICs (bandwidth, how many per node, so GPUs may share one) and
the host<->device link. :meth:`Cluster.cost_model` turns it into a
:class:`~tritonmoe.plan.CostModel` whose collectives are decomposed into link traffic:

* **all-to-all** (and point-to-point): every member sends its rows to every peer at once (NCCL
  groups the P-1 sends/receives); bytes to peers on the same node cross the GPU's intra-node link,
  bytes to other nodes the GPU's NIC (shared by the GPUs that share it). Latency: the slowest
  link's plus a per-peer cost for each of the P-1 peers.
* **all-gather / reduce-scatter**: a ring of P-1 steps of one chunk (the shard; the input / P);
  a multi-node ring crosses each node boundary through the NICs of the members on that node
  (NCCL runs one ring per NIC). **all-reduce** = reduce-scatter + all-gather (2(P-1) steps).
* **copies**: the GPU's PCIe link (shared with its intra-node traffic when that is PCIe too).

Every transfer takes ``latency + demand`` alone, where ``demand`` is the busiest link's
bytes / bandwidth; concurrent transfers fair-share the links they cross
(:mod:`tritonmoe.plan.engine`). Rates are spec-sheet peaks times one set of efficiencies
(:data:`EFFICIENCY`), the same for every cluster: nothing here is tuned to any paper's result.

:data:`PRESETS` holds the papers' testbeds (``../shared/PAPERS.md`` §6), one description per
testbed, and modern DGX nodes; ``Cluster.preset("dgx-h100", nodes=128)`` is 1,024 H100s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from .cost_model import ComputeRate, CostModel, LinearFit
from ..suggest import suggest_unknown_kwargs

__all__ = ["GPU", "Link", "Cluster", "PRESETS", "GPUS", "LINKS", "EFFICIENCY"]

GB = 1e9

#: Fractions of spec-sheet peaks that real kernels and collectives reach, one set for every
#: cluster (assumptions, stated once): large grouped GEMMs reach ~70% of dense tensor peak;
#: streaming kernels ~80% of memory bandwidth; NCCL ~80% of a link's line rate.
EFFICIENCY = {"gemm": 0.70, "memory": 0.80, "link": 0.80}

#: Per-kernel launch + tail overhead of a GPU kernel (seconds), and per-peer cost of an
#: all-to-all (NCCL send/recv setup per peer).
KERNEL_LAUNCH_S = 5e-6
PER_PEER_S = 1e-6


@dataclass(frozen=True)
class GPU:
    """A GPU model: dense tensor-core FLOP/s per dtype name, memory bandwidth and size (bytes)."""

    name: str
    flops: Mapping[str, float]
    mem_bw: float
    memory: float

    def rate(self, dtype: str) -> float:
        try:
            return self.flops[dtype]
        except KeyError:
            raise ValueError(
                f"{self.name} has no {dtype} rate in its description (has {', '.join(self.flops)}); pick one of those"
            ) from None


@dataclass(frozen=True)
class Link:
    """A link technology: bandwidth per direction (bytes/s, per GPU for intra-node links, per NIC
    for inter-node ones) and the latency of one transfer (seconds)."""

    name: str
    bw: float
    latency: float


#: GPUs (public spec sheets; dense tensor-core rates with fp32 accumulation).
GPUS = {
    "V100-SXM2-16GB": GPU("V100-SXM2-16GB", {"float16": 125e12, "float32": 15.7e12}, 900 * GB, 16 * 2**30),
    "RTX2080Ti": GPU("RTX2080Ti", {"float16": 53.8e12, "float32": 13.4e12}, 616 * GB, 11 * 2**30),
    "RTX4090": GPU("RTX4090", {"float16": 165.2e12, "bfloat16": 165.2e12, "float32": 82.6e12}, 1008 * GB, 24 * 2**30),
    "A100-SXM4-40GB": GPU(
        "A100-SXM4-40GB", {"float16": 312e12, "bfloat16": 312e12, "float32": 19.5e12}, 1555 * GB, 40 * 2**30
    ),
    "H100-SXM5-80GB": GPU(
        "H100-SXM5-80GB", {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12}, 3350 * GB, 80 * 2**30
    ),
    "H200-SXM-141GB": GPU(
        "H200-SXM-141GB", {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12}, 4800 * GB, 141 * 2**30
    ),
}

#: Links (per direction). NVLink: per-GPU aggregate (NVLink2 6 x 25 GB/s, NVLink3 12 x 25,
#: NVLink4 18 x 25); PCIe x16 per GPU; NICs per port.
LINKS = {
    "nvlink2": Link("NVLink2", 150 * GB, 3e-6),
    "nvlink3": Link("NVLink3", 300 * GB, 3e-6),
    "nvlink4": Link("NVLink4", 450 * GB, 3e-6),
    "pcie3": Link("PCIe 3.0 x16", 15.75 * GB, 8e-6),
    "pcie4": Link("PCIe 4.0 x16", 31.5 * GB, 8e-6),
    "pcie5": Link("PCIe 5.0 x16", 63.0 * GB, 8e-6),
    "ib56": Link("56 Gb/s InfiniBand", 7.0 * GB, 6e-6),
    "ib100": Link("100 Gb/s InfiniBand/RoCE", 12.5 * GB, 6e-6),
    "ib200": Link("200 Gb/s HDR InfiniBand", 25.0 * GB, 6e-6),
    "ib400": Link("400 Gb/s NDR InfiniBand", 50.0 * GB, 6e-6),
}


@suggest_unknown_kwargs
@dataclass(frozen=True)
class Cluster:
    """A cluster of ``nodes`` x ``gpus_per_node`` GPUs (see the module docstring).

    Attributes:
        name: a label; ``gpu``: the :class:`GPU`.
        intra: the intra-node :class:`Link` (per GPU); ``intra_is_pcie``: GPUs reach each other
            (and the NIC, and host memory) over their PCIe link, so all of that traffic shares it.
        inter: the NIC :class:`Link`; ``nics_per_node``: NICs per node (GPUs of a node share them
            evenly: 1 NIC for 4 GPUs means 4 GPUs share one NIC).
        host_link: the host<->device :class:`Link` of each GPU.
        efficiency: the fractions of peak reached (:data:`EFFICIENCY` unless overridden).
        interference: MPMoE's retained-speed factors (``(y, x) -> fraction``); none by default
            (their measured values are lost from the paper; link sharing is modelled by the
            fair-share engine instead).
        notes: where each number comes from, and which ones the source leaves free.
    """

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Optional[Link]
    nics_per_node: int
    host_link: Link
    intra_is_pcie: bool = False
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(EFFICIENCY))
    launch_s: float = KERNEL_LAUNCH_S
    per_peer_s: float = PER_PEER_S
    interference: Mapping[tuple, float] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "nics_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "nics_per_node" else 1):
                raise ValueError(f"Cluster.{name}={v!r} must be a positive int")
        if self.nodes > 1 and (self.inter is None or self.nics_per_node < 1):
            raise ValueError(f"a cluster of {self.nodes} nodes needs an inter-node link and nics_per_node >= 1")

    # -- layout --------------------------------------------------------------------------------

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nic_of(self, rank: int) -> tuple:
        local = rank % self.gpus_per_node
        return ("nic", self.node_of(rank), local * self.nics_per_node // self.gpus_per_node)

    def gpus_per_nic(self) -> int:
        return max(1, self.gpus_per_node // max(1, self.nics_per_node))

    def link_class(self, ranks: Sequence[int]) -> str:
        return "intra" if len({self.node_of(r) for r in ranks}) == 1 else "inter"

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes)

    def describe(self) -> str:
        inter = f", {self.nics_per_node} x {self.inter.name} per node" if self.inter is not None and self.nodes > 1 else ""
        return (
            f"{self.name}: {self.nodes} x {self.gpus_per_node} {self.gpu.name}, intra {self.intra.name}"
            f"{' (through the host)' if self.intra_is_pcie else ''}{inter}"
        )

    # -- link traffic --------------------------------------------------------------------------

    def _bw(self, link: Link) -> float:
        return link.bw * self.efficiency["link"]

    def _gpu_res(self, r: int) -> tuple:
        return ("gpu", r)

    def copy_resource(self, r: int) -> tuple:
        """The resource a host<->device copy of rank r uses (its PCIe link)."""
        return ("gpu", r) if self.intra_is_pcie else ("pcie", r)

    def collective_cost(
        self,
        op: str,
        ranks: Sequence[int],
        send: Sequence[Sequence[float]],
        recv: Sequence[Sequence[float]],
        *,
        members: Optional[Sequence[int]] = None,
    ) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of one collective over group ``ranks``.

        ``send[i]`` / ``recv[i]`` are the per-peer bytes of the i-th listed member (group-rank
        order; for all-gather ``(shard,) * P``, for reduce-scatter / all-reduce ``(nbytes,)``).
        ``members`` lists which group ranks those rows belong to (default: all); with a single
        listed member the others are taken to move the same bytes (the engine's symmetric
        mode), and only that member's resources are returned."""
        P = len(ranks)
        if members is None:
            members = list(range(P))
        symmetric = len(members) < P
        node = [self.node_of(r) for r in ranks]
        if op in ("all_to_all", "send_recv"):
            return self._pairwise(ranks, node, send, recv, members, symmetric)
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            return self._ring(op, ranks, node, send, members, symmetric)
        raise ValueError(f"unknown collective {op!r}")

    def _pairwise(self, ranks, node, send, recv, members, symmetric):
        P = len(ranks)
        demands: dict = {}
        nic_out: dict = {}
        nic_in: dict = {}
        any_inter = False
        any_bytes = False
        intra_bw = self._bw(self.intra)
        for row, m in enumerate(members):
            r = ranks[m]
            io = ii = eo = ei = 0.0
            for j in range(P):
                if j == m:
                    continue
                s, q = send[row][j], recv[row][j]
                if node[j] == node[m]:
                    io += s
                    ii += q
                else:
                    eo += s
                    ei += q
            any_bytes = any_bytes or (io + ii + eo + ei) > 0
            any_inter = any_inter or (eo + ei) > 0
            gpu_bytes = max(io + eo, ii + ei) if self.intra_is_pcie else max(io, ii)
            if gpu_bytes:
                demands[self._gpu_res(r)] = demands.get(self._gpu_res(r), 0.0) + gpu_bytes / intra_bw
            if eo or ei:
                nic = self.nic_of(r)
                share = self._nic_sharers(ranks, r) if symmetric else 1
                nic_out[nic] = nic_out.get(nic, 0.0) + eo * share
                nic_in[nic] = nic_in.get(nic, 0.0) + ei * share
        if nic_out or nic_in:
            nic_bw = self._bw(self.inter)
            for nic in set(nic_out) | set(nic_in):
                demands[nic] = max(nic_out.get(nic, 0.0), nic_in.get(nic, 0.0)) / nic_bw
        if not any_bytes:
            return self.per_peer_s, {}
        lat = (self.inter.latency if any_inter else self.intra.latency) + self.per_peer_s * (P - 1)
        return lat, demands

    def _nic_sharers(self, ranks, r) -> int:
        """Members of the group on the same NIC as rank r."""
        nic = self.nic_of(r)
        return sum(1 for q in ranks if self.nic_of(q) == nic)

    def _ring(self, op, ranks, node, send, members, symmetric):
        P = len(ranks)
        if P == 1:
            return 0.0, {}
        x = max(float(row[0]) for row in send) if send else 0.0
        steps, chunk = (P - 1, x) if op == "all_gather" else ((P - 1, x / P) if op == "reduce_scatter" else (2 * (P - 1), x / P))
        nodes = sorted(set(node))
        multi = len(nodes) > 1
        lat = steps * (self.inter.latency if multi else self.intra.latency)
        if x <= 0:
            return lat, {}
        demands: dict = {}
        intra_bw = self._bw(self.intra)
        for m in members:
            demands[self._gpu_res(ranks[m])] = steps * chunk / intra_bw
        if multi:
            nic_bw = self._bw(self.inter)
            mine = {node[m] for m in members}
            for n in mine:
                nics = {self.nic_of(r) for r, nd in zip(ranks, node) if nd == n}
                listed = {self.nic_of(ranks[m]) for m in members if node[m] == n}
                for nic in listed:
                    demands[nic] = steps * chunk / (len(nics) * nic_bw)
        return lat, demands

    def collective_line(self, kind: str, group_size: int, link_class: str = "intra") -> LinearFit:
        """The alpha-beta line of ``kind`` over ``group_size`` ranks with uniform traffic (for
        the Parm-style selectors): placed on one node ("intra"), or across nodes ("inter":
        contiguous blocks of a node's GPUs, or one rank per node when the group is smaller
        than the node count)."""
        P = int(group_size)
        if P < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        if link_class == "intra":
            if P > self.gpus_per_node:
                raise ValueError(
                    f"{self.name}: an intra-node group of {P} ranks does not fit on a node of {self.gpus_per_node} GPUs"
                )
            ranks = list(range(P))
        else:
            if self.nodes < 2:
                raise ValueError(f"{self.name} has one node: no inter-node group")
            if P <= self.nodes:
                ranks = [i * self.gpus_per_node for i in range(P)]
            else:
                if P > self.num_gpus:
                    raise ValueError(f"{self.name}: a group of {P} ranks exceeds its {self.num_gpus} GPUs")
                ranks = list(range(P))
        if P == 1:
            return LinearFit.line(0.0, 0.0)
        x = float(2**20)

        def traffic(nbytes):
            if kind in ("all_to_all", "send_recv"):
                row = [nbytes / P] * P
                return [row] * P, [row] * P
            return [[nbytes] * (P if kind == "all_gather" else 1)] * P, None

        s1, r1 = traffic(x)
        lat, dem = self.collective_cost(kind, ranks, s1, r1 if r1 is not None else s1)
        return LinearFit.line(lat, max(dem.values(), default=0.0) / x)

    def copy_line(self) -> LinearFit:
        return LinearFit.line(self.host_link.latency, 1.0 / self._bw(self.host_link))

    # -- the cost model ------------------------------------------------------------------------

    def cost_model(self, dtype: str | object = "bfloat16") -> CostModel:
        """A :class:`~tritonmoe.plan.CostModel` of this cluster for ``dtype`` (a name or a
        torch dtype): collectives decomposed into link traffic, compute from the GPU's roofline
        times :data:`EFFICIENCY`, asynchronous (CUDA) host model."""
        name = str(dtype).replace("torch.", "")
        peak = self.gpu.rate(name)
        mem = self.gpu.mem_bw * self.efficiency["memory"]
        vector = self.gpu.flops.get("float32", peak)
        compute = {
            "gemm": ComputeRate(peak * self.efficiency["gemm"], mem, self.launch_s),
            "elementwise": ComputeRate(vector, mem, self.launch_s),
            "copy": ComputeRate(math.inf, mem, self.launch_s),
            "host": ComputeRate(math.inf, math.inf, 0.0),  # the launches of the kernels cover it
        }
        return CostModel(
            compute=compute,
            interference=dict(self.interference),
            host_compute=False,
            dtype=name,
            cluster=self,
            ranks_per_node=self.gpus_per_node,
            source=f"cluster:{self.name}",
            meta={"notes": self.notes},
        )

    # -- persistence ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        d = asdict(self)
        d["interference"] = [[y, x, v] for (y, x), v in self.interference.items()]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Cluster":
        d = dict(d)
        d["gpu"] = GPU(**d["gpu"])
        for k in ("intra", "inter", "host_link"):
            if d.get(k) is not None:
                d[k] = Link(**d[k])
        d["interference"] = {(y, x): float(v) for y, x, v in d.get("interference", [])}
        return cls(**d)

    @classmethod
    def preset(cls, name: str, nodes: Optional[int] = None) -> "Cluster":
        """A preset of :data:`PRESETS`, with ``nodes`` nodes when given."""
        try:
            factory = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown cluster preset {name!r}; choose from {', '.join(PRESETS)}") from None
        c = factory()
        return c.with_nodes(nodes) if nodes is not None else c


def _lina() -> Cluster:
    return Cluster(
        "lina", 4, 4, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib100"], 1, LINKS["pcie4"],
        notes="Lina (001 §7.1): 4 nodes x 4 A100 40 GB, 100 Gbps InfiniBand. Free (not stated): the intra-node link "
        "(NVLink3 of an HGX A100 4-GPU board assumed) and one NIC per node.",
    )


def _parm_a() -> Cluster:
    return Cluster(
        "parm-a", 1, 8, GPUS["RTX4090"], LINKS["pcie4"], None, 0, LINKS["pcie4"], intra_is_pcie=True,
        notes="Parm testbed A (003 §VI-A): one server, 8 x RTX 4090 24 GB on PCIe 4.0 x16, no NVLink (GeForce: "
        "no peer-to-peer, GPU traffic goes through the host over each GPU's PCIe link).",
    )


def _parm_b() -> Cluster:
    return Cluster(
        "parm-b", 8, 4, GPUS["RTX2080Ti"], LINKS["pcie3"], LINKS["ib100"], 1, LINKS["pcie3"], intra_is_pcie=True,
        notes="Parm testbed B (003 §VI-A): 8 nodes x 4 RTX 2080Ti 11 GB on PCIe 3.0 x16, ConnectX-5 100 Gb/s "
        "(one per node: the 4 GPUs share it). 2 nodes = the 8-GPU rows, 8 nodes = the 32-GPU rows.",
    )


def _adira() -> Cluster:
    return Cluster(
        "mpmoe-adira", 8, 8, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib200"], 8, LINKS["pcie4"],
        notes="MPMoE Adira (004 §V-A): 8 DGX A100 nodes x 8 A100 40 GB, NVLink 3, 200 Gbps HDR InfiniBand. Free: "
        "one HDR NIC per GPU (the DGX A100 has 8 compute ports); the paper states the rate, not the count.",
    )


def _valor() -> Cluster:
    return Cluster(
        "mpmoe-valor", 4, 4, GPUS["V100-SXM2-16GB"], LINKS["nvlink2"], LINKS["ib56"], 1, LINKS["pcie3"],
        notes="MPMoE Valor (004 §V-A): 4 nodes x 4 Tesla V100 16 GiB, NVLink 2, '56 Gbps' InfiniBand (an FDR rate, "
        "as printed). Free: one NIC per node.",
    )


def _semoe() -> Cluster:
    return Cluster(
        "se-moe", 4, 8, GPUS["A100-SXM4-40GB"], LINKS["nvlink3"], LINKS["ib200"], 8, LINKS["pcie4"],
        notes="SE-MoE (002 §5.3): 4 nodes x 8 A100 with NVSwitch. Free: the inter-node network (the paper does not "
        "state it; 8 x 200 Gb HDR per node, as on a DGX A100, assumed).",
    )


def _dgx_h100() -> Cluster:
    return Cluster(
        "dgx-h100", 1, 8, GPUS["H100-SXM5-80GB"], LINKS["nvlink4"], LINKS["ib400"], 8, LINKS["pcie5"],
        notes="NVIDIA DGX H100: 8 x H100 SXM5 80 GB, NVLink4 via NVSwitch (900 GB/s bidirectional per GPU), 8 x 400 "
        "Gb/s NDR (ConnectX-7) per node, PCIe 5.0 host links. Use nodes=N for N nodes.",
    )


def _dgx_h200() -> Cluster:
    return Cluster(
        "dgx-h200", 1, 8, GPUS["H200-SXM-141GB"], LINKS["nvlink4"], LINKS["ib400"], 8, LINKS["pcie5"],
        notes="NVIDIA DGX H200: 8 x H200 141 GB (HBM3e 4.8 TB/s), NVLink4 via NVSwitch, 8 x 400 Gb/s NDR per node, "
        "PCIe 5.0 host links. Use nodes=N for N nodes.",
    )


#: The papers' testbeds (PAPERS.md §6) and modern nodes: name -> factory.
PRESETS: dict[str, Callable[[], Cluster]] = {
    "lina": _lina,
    "parm-a": _parm_a,
    "parm-b": _parm_b,
    "mpmoe-adira": _adira,
    "mpmoe-valor": _valor,
    "se-moe": _semoe,
    "dgx-h100": _dgx_h100,
    "dgx-h200": _dgx_h200,
}
