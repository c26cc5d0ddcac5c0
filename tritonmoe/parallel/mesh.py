"""The parallel layout of an MoE model on a :class:`~torch.distributed.device_mesh.DeviceMesh`.

:class:`MoEMesh` names what each mesh dimension means for an MoE model and derives, from the
mesh alone, every process group the layer, the data-parallel wrapper and the checkpoint helpers
use. Dimensions, outer to inner (the innermost one gets consecutive ranks, so a node-local
expert-parallel group is the default):

=====  ===========================  ===================  =======================================
dim    tokens                       dense parameters     expert parameters
=====  ===========================  ===================  =======================================
dp     a different batch per rank   replicated           replicated (the expert-data-parallel
                                                         dimension: ranks holding the same
                                                         experts)
ep     a different batch per rank   replicated           partitioned: ep rank r owns experts
                                                         [r*E/ep, (r+1)*E/ep)
=====  ===========================  ===================  =======================================

Reserved for the model-parallel and expert-sharding layouts (Parm, PAPERS.md section 3): ``mp``
(dense parameters sharded, tokens replicated) and ``esp`` (each expert's hidden dimension
sharded). They extend the table above: a dimension states how tokens, dense and expert
parameters lie along it (:class:`DimRole`), and every derived group is a product of the
dimensions with the right roles, so adding them adds rows to :data:`ROLES`, not new code paths.

Derived groups (each a 1-D :class:`DeviceMesh` and its process group):

* ``ep``: the expert-parallel group (the layer's all-to-all);
* ``expert_dp``: the ranks that hold the same experts (dimensions where experts are replicated):
  expert gradients are summed over it;
* ``dense``: the ranks that hold the same dense parameters and see different tokens (every
  dimension where tokens differ): dense gradients are summed over it;
* ``data_parallel_size``: how many different batches one step sees (the product of the
  dimensions where tokens differ). Every gradient is divided by it, so the model's gradients
  are those of the mean over ranks of the ranks' losses (see :mod:`tritonmoe.parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tritonmoe.comm.errors import mesh_backend_override

__all__ = ["DimRole", "ROLES", "SUPPORTED_DIMS", "MoEMesh", "as_moe_mesh"]


@dataclass(frozen=True)
class DimRole:
    """How tokens, dense parameters and expert parameters lie along one mesh dimension.

    Attributes:
        tokens: "split" (each coordinate has its own batch) or "replicate".
        dense: "replicate" or "shard" (dense parameters).
        experts: "replicate", "partition" (different experts per coordinate) or "shard" (a slice
            of every local expert per coordinate).
    """

    tokens: str
    dense: str
    experts: str


#: The roles of the dimensions this package understands.
ROLES = {
    "dp": DimRole(tokens="split", dense="replicate", experts="replicate"),
    "ep": DimRole(tokens="split", dense="replicate", experts="partition"),
}
#: Dimension names accepted now, in mesh order (outer to inner).
SUPPORTED_DIMS = tuple(ROLES)
#: Names reserved for the Parm layouts (model parallelism, expert sharding).
RESERVED_DIMS = ("mp", "esp")


def _device_type() -> str:
    """The device type of the default process group's tensors: "cuda" for NCCL, else "cpu"."""
    backend = str(dist.get_backend()).lower()
    return "cuda" if ("nccl" in backend and torch.cuda.is_available()) else "cpu"


class MoEMesh:
    """A :class:`DeviceMesh` whose dimensions are named by role (see the module docstring).

    Build one with :meth:`build` (``MoEMesh.build(dp=2, ep=2)``: a new mesh over the default
    group's ranks, ``ep`` innermost) or wrap an existing mesh whose ``mesh_dim_names`` are a
    subset of ``("dp", "ep")`` in that order (``MoEMesh(mesh)``). Construction creates the
    derived groups, so it is collective: every rank of the mesh constructs it, in the same order
    as its other groups.

    Attributes:
        device_mesh: the underlying mesh.
        dim_names: its dimension names.
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(device_mesh).__name__}")
        names = tuple(device_mesh.mesh_dim_names or ())
        if not names:
            raise ValueError(
                "the DeviceMesh has no mesh_dim_names; name its dimensions, e.g. "
                "init_device_mesh(device, (dp, ep), mesh_dim_names=('dp', 'ep'))"
            )
        reserved = [n for n in names if n in RESERVED_DIMS]
        if reserved:
            raise NotImplementedError(
                f"mesh dimension(s) {reserved} (model parallelism / expert sharding) are reserved for the Parm "
                "layouts and not supported by MoEMesh yet; use dimensions named 'dp' and 'ep'"
            )
        unknown = [n for n in names if n not in ROLES]
        if unknown:
            raise ValueError(f"unknown mesh dimension name(s) {unknown}; MoEMesh understands {list(SUPPORTED_DIMS)}")
        order = [SUPPORTED_DIMS.index(n) for n in names]
        if order != sorted(order):
            raise ValueError(f"mesh dimensions {list(names)} must be ordered as {list(SUPPORTED_DIMS)} (outer to inner)")
        self.device_mesh = device_mesh
        self.dim_names = names
        self._dense = self._product(lambda r: r.tokens == "split" and r.dense == "replicate", "dense")
        self._expert_dp = self._product(lambda r: r.experts == "replicate", "expert_dp")
        self._checkpoint_mesh: Optional[DeviceMesh] = None

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def build(cls, *, dp: int = 1, ep: int = 1, device_type: Optional[str] = None) -> "MoEMesh":
        """A ("dp", "ep") mesh over the default group's ranks, ``ep`` innermost (rank =
        dp_coordinate * ep + ep_coordinate). ``dp * ep`` must be the world size. Collective."""
        for name, v in (("dp", dp), ("ep", ep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("MoEMesh.build needs torch.distributed: call torch.distributed.init_process_group() first")
        world = dist.get_world_size()
        if dp * ep != world:
            raise ValueError(f"dp*ep = {dp}*{ep} = {dp * ep} but the world has {world} ranks; choose dp*ep = {world}")
        # The mesh's groups inherit the default group's timeout (new_group's own default is 30 min).
        override = mesh_backend_override({"dp": dp, "ep": ep})
        mesh = init_device_mesh(device_type or _device_type(), (dp, ep), mesh_dim_names=("dp", "ep"),
                                **({"backend_override": override} if override else {}))
        return cls(mesh)

    def _product(self, keep, name: str) -> Optional[DeviceMesh]:
        """The 1-D mesh over the dimensions whose role satisfies ``keep`` (None when none does)."""
        dims = [n for n in self.dim_names if keep(ROLES[n])]
        if not dims:
            return None
        if len(dims) == 1:
            return self.device_mesh[dims[0]]
        name = "_".join(dims)
        sub = self.device_mesh[tuple(dims)]
        override = mesh_backend_override({name: sub.size()})  # the default group's timeout
        return sub._flatten(name, backend_override=override[name] if override else None)

    # -- sizes and coordinates ----------------------------------------------------------------

    def size(self, dim: str) -> int:
        """Ranks along ``dim`` (1 when the mesh has no such dimension)."""
        self._check_name(dim)
        return self.device_mesh.size(self.dim_names.index(dim)) if dim in self.dim_names else 1

    def coordinate(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (0 when the mesh has no such dimension)."""
        self._check_name(dim)
        return self.device_mesh.get_local_rank(dim) if dim in self.dim_names else 0

    def _check_name(self, dim: str) -> None:
        if dim not in ROLES and dim not in RESERVED_DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; use one of {list(SUPPORTED_DIMS)}")

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def data_parallel_size(self) -> int:
        """Different batches per step: the product of the dimensions where tokens differ."""
        return math.prod(self.size(n) for n in self.dim_names if ROLES[n].tokens == "split")

    # -- derived meshes and groups ------------------------------------------------------------

    @property
    def ep_mesh(self) -> Optional[DeviceMesh]:
        """The expert-parallel 1-D mesh (None when the mesh has no "ep" dimension)."""
        return self.device_mesh["ep"] if "ep" in self.dim_names else None

    @property
    def ep_group(self):
        """The expert-parallel process group, or None when experts are not partitioned
        (no "ep" dimension, or one of size 1)."""
        return self.ep_mesh.get_group() if self.size("ep") > 1 else None

    @property
    def expert_dp_mesh(self) -> Optional[DeviceMesh]:
        """The ranks holding the same experts (1-D), or None when every rank holds different ones."""
        return self._expert_dp

    @property
    def expert_dp_group(self):
        return self._expert_dp.get_group() if self._expert_dp is not None else None

    @property
    def dense_mesh(self) -> Optional[DeviceMesh]:
        """The ranks holding the same dense parameters and different tokens (1-D)."""
        return self._dense

    @property
    def dense_group(self):
        return self._dense.get_group() if self._dense is not None else None

    def ranks(self, which: str) -> list[int]:
        """Global ranks of this rank's ``which`` group ("ep", "expert_dp", "dense"), in group-rank
        order; ``[this rank]`` when the group does not exist."""
        mesh = {"ep": self.ep_mesh, "expert_dp": self._expert_dp, "dense": self._dense}[which]
        if mesh is None:
            return [dist.get_rank()]
        return [int(r) for r in mesh.mesh.flatten().tolist()]

    def checkpoint_mesh(self) -> Optional[DeviceMesh]:
        """The mesh expert tensors are described on in checkpoints: ("ep", "dp") ordered, so
        that sharding dim 0 on "ep" first gives expert-parallel rank r the experts
        [r*E/ep, (r+1)*E/ep) and "dp" then replicates (or, under FSDP, shards) each block.
        Reuses the existing groups (no collective). None without an "ep" dimension."""
        if self.ep_mesh is None:
            return None
        if self._checkpoint_mesh is None:
            if "dp" not in self.dim_names:
                self._checkpoint_mesh = self.ep_mesh
            else:
                i, j = self.dim_names.index("ep"), self.dim_names.index("dp")
                # The whole mesh with its dimensions reordered to (ep, dp).
                mesh_t = self.device_mesh.mesh.movedim((i, j), (0, 1))
                self._checkpoint_mesh = DeviceMesh.from_group(
                    [self.device_mesh["ep"].get_group(), self.device_mesh["dp"].get_group()],
                    self.device_type,
                    mesh=mesh_t,
                    mesh_dim_names=("ep", "dp"),
                )
        return self._checkpoint_mesh

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={self.size(n)}" for n in self.dim_names)
        return f"MoEMesh({dims}, {self.device_type})"


def as_moe_mesh(mesh) -> MoEMesh:
    """``mesh`` as a :class:`MoEMesh` (a DeviceMesh is wrapped; collective when it is)."""
    if isinstance(mesh, MoEMesh):
        return mesh
    if isinstance(mesh, DeviceMesh):
        return MoEMesh(mesh)
    raise TypeError(f"mesh must be a tritonmoe.parallel.MoEMesh or a DeviceMesh, got {type(mesh).__name__}")


def group_ranks(group) -> list[int]:
    """Global ranks of a process group (the default group when None), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]
