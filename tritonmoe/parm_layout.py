"""Parm's parallel layout: model, expert and expert-sharding parallelism over P ranks.

Three groups meet in a Parm MoE layer (paper 003, PAPERS.md section 3):

* **EP** (expert parallelism, ``n_ep`` ranks): EP rank ``a`` owns the experts
  [a*E/n_ep, (a+1)*E/n_ep).
* **ESP** (expert-sharding parallelism, ``n_esp`` ranks): the ranks of an ESP group hold the same
  experts, each a slice of the FFN hidden dimension (shard ``s`` holds hidden units
  [s*F/n_esp, (s+1)*F/n_esp)); their outputs are partial sums.
* **MP** (model parallelism, ``n_mp`` ranks): the dense part of the model is tensor parallel, so
  the layer's input is replicated over an MP group (one batch per MP group).

The P = n_ep * n_esp ranks form a grid: rank i has coordinates (ep a, esp s), the EP group of i is
{(a', s)}, its ESP group {(a, s')}; all P ranks together are the "EP&ESP" group of Parm's fused
all-to-all. MP groups partition the same P ranks (n_mp divides P). Group rank order is the order
of global ranks (torch.distributed sorts group members), so a coordinate is a rank's position in
its group.

Placement (the paper's reading, PAPERS.md 3.5/3.2 ambiguity 4): MP groups are ``n_mp``
consecutive ranks ("model parallel are placed in the same node whenever possible": consecutive
ranks share a node when n_mp divides the GPUs per node); the (ep, esp) grid is laid out either
ESP-inner (rank = a*n_esp + s, the paper's Fig. 2 has ESP across nodes... on 2 GPUs per node with
n_esp = 2 this is EP-inner) or EP-inner (rank = s*n_ep + a). Any other rank -> (mp group, mp rank,
ep, esp) map can be given explicitly (:meth:`ParmLayout.from_coords`).

:class:`ParmLayout` is a pure description (the simulator uses it without processes);
:class:`ParmGroups` adds the torch.distributed groups of one rank. Both constructions check what
can go wrong before any data moves: group sizes that do not divide, a grid that is not one, and
(:func:`groups_from_process_groups`) ranks that pass inconsistent groups, which raises the same
``ValueError`` on every rank after one small exchange over the default group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from tritonmoe.comm.errors import mesh_backend_override
from tritonmoe.comm.compat import all_gather_single
from tritonmoe.comm.errors import backend_errors, new_group
from tritonmoe.comm.splits import comm_device

__all__ = ["PLACEMENTS", "ParmLayout", "ParmGroups", "groups_from_process_groups", "LayoutError"]

#: Canonical placements of the (ep, esp) grid.
PLACEMENTS = ("esp_inner", "ep_inner")


class LayoutError(ValueError):
    """An invalid or inconsistent Parm layout (raised with the same message on every rank when it
    comes from an exchange)."""


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LayoutError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class ParmLayout:
    """Rank -> (mp group, mp rank, ep, esp) over the P ranks of a Parm MoE layer.

    Layout ranks 0..P-1 are the positions of the members in the EP&ESP group (sorted global
    ranks, ``ranks[i]`` is the global rank of layout rank i).

    Attributes:
        n_mp, n_ep, n_esp: group sizes; P = n_ep * n_esp, n_mp divides P.
        ep, esp: per layout rank, its EP and ESP coordinate.
        mp_group, mp_rank: per layout rank, its MP group index (the batch it holds; groups
            numbered by their lowest rank) and its rank inside the MP group.
        ranks: global ranks, in layout order (increasing).
    """

    n_mp: int
    n_ep: int
    n_esp: int
    ep: tuple[int, ...]
    esp: tuple[int, ...]
    mp_group: tuple[int, ...]
    mp_rank: tuple[int, ...]
    ranks: tuple[int, ...]

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def make(
        cls, n_mp: int, n_ep: int, n_esp: int, *, placement: str = "esp_inner", ranks: Optional[Sequence[int]] = None
    ) -> "ParmLayout":
        """A canonical layout: MP groups of ``n_mp`` consecutive ranks; the (ep, esp) grid
        ESP-inner (rank = a*n_esp + s) or EP-inner (rank = s*n_ep + a)."""
        n_mp, n_ep, n_esp = _positive("n_mp", n_mp), _positive("n_ep", n_ep), _positive("n_esp", n_esp)
        if placement not in PLACEMENTS:
            raise LayoutError(f"placement={placement!r}; use one of {', '.join(PLACEMENTS)} or ParmLayout.from_coords")
        P = n_ep * n_esp
        if P % n_mp:
            raise LayoutError(
                f"n_mp={n_mp} does not divide the P = n_ep*n_esp = {n_ep}*{n_esp} = {P} ranks of the layer; "
                "MP groups must partition them (choose n_mp dividing P)"
            )
        coords = []
        for r in range(P):
            a, s = (divmod(r, n_esp) if placement == "esp_inner" else divmod(r, n_ep)[::-1])
            coords.append((r // n_mp, r % n_mp, a, s))
        return cls.from_coords(coords, n_mp=n_mp, n_ep=n_ep, n_esp=n_esp, ranks=ranks)

    @classmethod
    def from_coords(
        cls,
        coords: Sequence[tuple[int, int, int, int]],
        *,
        n_mp: int,
        n_ep: int,
        n_esp: int,
        ranks: Optional[Sequence[int]] = None,
    ) -> "ParmLayout":
        """A layout from an explicit map: ``coords[i] = (mp_group, mp_rank, ep, esp)`` of layout
        rank i. Checked: P = n_ep*n_esp ranks, every (ep, esp) once, every MP group n_mp ranks
        with mp ranks 0..n_mp-1, and coordinates increasing with the rank inside each group
        (group rank order is global rank order in torch.distributed)."""
        n_mp, n_ep, n_esp = _positive("n_mp", n_mp), _positive("n_ep", n_ep), _positive("n_esp", n_esp)
        P = n_ep * n_esp
        coords = [tuple(int(v) for v in c) for c in coords]
        if len(coords) != P:
            raise LayoutError(f"{len(coords)} coordinates for P = n_ep*n_esp = {P} ranks")
        if P % n_mp:
            raise LayoutError(f"n_mp={n_mp} does not divide P={P}; MP groups must partition the ranks")
        if ranks is None:
            ranks = tuple(range(P))
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) != P or any(b <= a for a, b in zip(ranks, ranks[1:])):
            raise LayoutError(f"ranks must be {P} increasing global ranks, got {ranks}")
        grid = {(c[2], c[3]) for c in coords}
        if len(grid) != P or any(not (0 <= a < n_ep and 0 <= s < n_esp) for a, s in grid):
            raise LayoutError(f"every (ep, esp) in [0,{n_ep})x[0,{n_esp}) must appear once, got {sorted(grid)}")
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, (g, m, _, _) in enumerate(coords):
            groups.setdefault(g, []).append((i, m))
        if sorted(groups) != list(range(P // n_mp)):
            raise LayoutError(f"MP group indices must be 0..{P // n_mp - 1}, got {sorted(groups)}")
        for g, members in groups.items():
            if [m for _, m in members] != list(range(n_mp)):
                raise LayoutError(
                    f"MP group {g} has mp ranks {[m for _, m in members]} at ranks {[i for i, _ in members]}; "
                    f"it needs mp ranks 0..{n_mp - 1} in increasing rank order"
                )
        firsts = [groups[g][0][0] for g in sorted(groups)]
        if firsts != sorted(firsts):
            raise LayoutError("MP groups must be numbered in the order of their lowest rank")
        layout = cls(
            n_mp=n_mp, n_ep=n_ep, n_esp=n_esp,
            ep=tuple(c[2] for c in coords), esp=tuple(c[3] for c in coords),
            mp_group=tuple(c[0] for c in coords), mp_rank=tuple(c[1] for c in coords), ranks=ranks,
        )
        for i in range(P):  # a coordinate is a position in a group: increasing with the rank
            for name, members, coord in (
                ("EP", layout.ep_group_of(i), layout.ep),
                ("ESP", layout.esp_group_of(i), layout.esp),
            ):
                if [coord[j] for j in members] != list(range(len(members))):
                    raise LayoutError(
                        f"the {name} group of rank {i} ({list(members)}) has coordinates "
                        f"{[coord[j] for j in members]}; they must increase with the rank"
                    )
        return layout

    # -- queries ---------------------------------------------------------------------------------

    @property
    def P(self) -> int:
        """Ranks of the layer (the EP&ESP group)."""
        return self.n_ep * self.n_esp

    @property
    def num_batches(self) -> int:
        """Distinct batches (one per MP group)."""
        return self.P // self.n_mp

    def holder(self, a: int, s: int) -> int:
        """The layout rank with coordinates (ep a, esp s)."""
        for i in range(self.P):
            if self.ep[i] == a and self.esp[i] == s:
                return i
        raise IndexError(f"no rank at (ep={a}, esp={s})")

    def ep_group_of(self, i: int) -> tuple[int, ...]:
        """Layout ranks of rank i's EP group (same esp), increasing."""
        return tuple(j for j in range(self.P) if self.esp[j] == self.esp[i])

    def esp_group_of(self, i: int) -> tuple[int, ...]:
        """Layout ranks of rank i's ESP group (same ep), increasing."""
        return tuple(j for j in range(self.P) if self.ep[j] == self.ep[i])

    def mp_group_of(self, i: int) -> tuple[int, ...]:
        """Layout ranks of rank i's MP group, increasing."""
        return tuple(j for j in range(self.P) if self.mp_group[j] == self.mp_group[i])

    def all_groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every distinct group of each kind ("mp", "ep", "esp", "ep_esp") as layout ranks."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, fn in (("mp", self.mp_group_of), ("ep", self.ep_group_of), ("esp", self.esp_group_of)):
            seen: list[tuple[int, ...]] = []
            for i in range(self.P):
                g = fn(i)
                if g not in seen:
                    seen.append(g)
            out[name] = seen
        out["ep_esp"] = [tuple(range(self.P))]
        return out

    def check_model(self, num_experts: int, d_ffn: int) -> None:
        """The expert count and FFN width fit the layout (E divisible by n_ep, F by n_esp)."""
        if num_experts % self.n_ep:
            raise LayoutError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size n_ep={self.n_ep}; "
                "each EP rank must own E/n_ep experts (use a multiple of n_ep)"
            )
        if d_ffn % self.n_esp:
            raise LayoutError(
                f"d_ffn={d_ffn} is not divisible by the expert-sharding size n_esp={self.n_esp}; each shard "
                "holds d_ffn/n_esp hidden units (use a multiple of n_esp)"
            )

    def device_meshes(self, device_type: str = "cpu"):
        """``(moe_mesh, dense_mesh)``: a DeviceMesh with dimensions ("ep", "esp") over the P
        ranks as this layout places them, and one with ("dp", "mp") (MP groups innermost, the
        dense model's tensor-parallel mesh). Collective over the default group.
        ``ParmGroups.from_device_mesh(moe_mesh, dense_mesh["mp"])`` gives the layer's groups."""
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.empty(self.n_ep, self.n_esp, dtype=torch.int64)
        for i in range(self.P):
            grid[self.ep[i], self.esp[i]] = self.ranks[i]
        dense = torch.empty(self.num_batches, self.n_mp, dtype=torch.int64)
        for i in range(self.P):
            dense[self.mp_group[i], self.mp_rank[i]] = self.ranks[i]

        def mesh(t: torch.Tensor, names: tuple[str, str]) -> DeviceMesh:
            # The mesh's groups inherit the default group's timeout (not new_group's 30 minutes).
            override = mesh_backend_override({n: t.shape[i] for i, n in enumerate(names)}) or {}
            return DeviceMesh(device_type, t, mesh_dim_names=names,
                              backend_override=tuple(override.get(n, (None, None)) for n in names))

        return mesh(grid, ("ep", "esp")), mesh(dense, ("dp", "mp"))

    def describe(self) -> str:
        return f"ParmLayout(n_mp={self.n_mp}, n_ep={self.n_ep}, n_esp={self.n_esp}, P={self.P})"

    def encode(self) -> list[int]:
        """A fixed-length integer encoding (for cross-rank agreement checks)."""
        out = [self.n_mp, self.n_ep, self.n_esp]
        for i in range(self.P):
            out += [self.ranks[i], self.mp_group[i], self.mp_rank[i], self.ep[i], self.esp[i]]
        return out

    # -- process groups ----------------------------------------------------------------------------

    def process_groups(self, *, cache: Optional[dict] = None) -> "ParmGroups":
        """This rank's torch.distributed groups of the layout. Collective over the default group:
        every rank of it calls with the same layout (checked first: one small exchange; a rank
        with another layout makes every rank raise the same :class:`LayoutError`), then every
        group of the layout is created in the same order everywhere.

        ``cache`` (a dict the caller keeps) reuses groups with the same members across layouts.
        """
        import torch.distributed as dist


        enc = self.encode()
        width = torch.tensor([len(enc)], dtype=torch.int64)
        W = dist.get_world_size()
        sizes = [torch.zeros_like(width) for _ in range(W)]
        with backend_errors("the ParmLayout check (all-gather of the layouts' lengths)"):
            dist.all_gather(sizes, width)
        n = max(int(t) for t in sizes)  # host sync: construction only
        vec = torch.full((n,), -1, dtype=torch.int64, device=comm_device(None))
        vec[: len(enc)] = torch.tensor(enc, dtype=torch.int64)
        table = torch.empty(W * n, dtype=torch.int64, device=vec.device)
        with backend_errors("the ParmLayout check (all-gather of the layouts)"):
            all_gather_single(table, vec)
        rows = table.view(W, n).tolist()  # host sync: the verdict is a host decision
        differ = [r for r in range(W) if rows[r] != rows[0]]
        if differ:
            sizes = ", ".join(f"rank {r}: n_mp={rows[r][0]} n_ep={rows[r][1]} n_esp={rows[r][2]}" for r in [0] + differ)
            raise LayoutError(
                f"ranks {differ} passed another layout than rank 0 ({sizes}); every rank of the default group "
                "must build the same ParmLayout"
            )
        me = dist.get_rank()
        cache = {} if cache is None else cache

        def group(layout_ranks: tuple[int, ...], tag: str = ""):
            key = (tuple(self.ranks[j] for j in layout_ranks), tag)
            if key not in cache:
                cache[key] = new_group(key[0])  # the default group's timeout, not the 30-minute default
            return cache[key]

        mine = self.ranks.index(me) if me in self.ranks else None
        made: dict[str, Any] = {}
        for name, groups in self.all_groups().items():
            for g in groups:
                if len(g) < 2:
                    continue
                pg = group(g)
                if mine is not None and mine in g:
                    made[name] = pg
        # SAA runs the MP all-gather beside the EP&ESP all-to-all: two process groups, so the two
        # lanes progress concurrently, even when the MP group has the same members.
        mp_lane = None
        if self.n_mp > 1:
            for g in self.all_groups()["mp"]:
                pg = group(g, "saa") if len(g) == self.P else None
                if mine is not None and mine in g:
                    mp_lane = pg if pg is not None else made.get("mp")
        if mine is None:
            raise LayoutError(f"rank {me} is not one of the layout's ranks {self.ranks}")
        return ParmGroups(
            layout=self, rank=mine, mp=made.get("mp"), ep=made.get("ep"), esp=made.get("esp"),
            ep_esp=made.get("ep_esp"), mp_lane=mp_lane,
        )


@dataclass(frozen=True)
class ParmGroups:
    """One rank's process groups of a :class:`ParmLayout` (None for a group of one rank).

    Attributes:
        layout: the layout; ``rank``: this process's layout rank.
        mp, ep, esp: its MP, EP and ESP groups; ``ep_esp``: the group of all P ranks (the fused
            all-to-all's); ``mp_lane``: the group SAA's all-gather lane uses (``mp``, or a second
            group with the same members when ``mp`` has the members of ``ep_esp``).
    """

    layout: ParmLayout
    rank: int
    mp: Any = None
    ep: Any = None
    esp: Any = None
    ep_esp: Any = None
    mp_lane: Any = None

    @classmethod
    def from_device_mesh(cls, mesh, mp_mesh=None, *, values: Optional[dict] = None) -> "ParmGroups":
        """This rank's groups from a DeviceMesh with dimensions named "ep" and "esp" (either may
        be absent: size 1) over the P ranks of the layer, and ``mp_mesh`` (a 1-D DeviceMesh, or
        one with an "mp" dimension) for the model-parallel group; the EP&ESP group is the
        flattened mesh. Collective over the default group (the same check as
        :func:`groups_from_process_groups`)."""
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        extra = [n for n in names if n not in ("ep", "esp")]
        if not names or extra:
            raise LayoutError(
                f"the Parm mesh has dimensions {list(names)}; name them 'ep' and/or 'esp' (build it with "
                "ParmLayout.device_meshes or init_device_mesh(..., mesh_dim_names=('ep', 'esp')))"
            )
        ep = mesh.get_group("ep") if "ep" in names and mesh.size(names.index("ep")) > 1 else None
        esp = mesh.get_group("esp") if "esp" in names and mesh.size(names.index("esp")) > 1 else None
        union = None
        if len(names) == 2 and mesh.size() > 1:

            override = mesh_backend_override({"ep_esp": mesh.size()})  # the default group's timeout
            union = mesh._flatten("ep_esp", backend_override=override["ep_esp"] if override else None).get_group()
        mp = None
        if mp_mesh is not None:
            if not isinstance(mp_mesh, DeviceMesh):
                raise TypeError(f"mp_mesh must be a DeviceMesh, got {type(mp_mesh).__name__}")
            mp_names = tuple(mp_mesh.mesh_dim_names or ())
            sub = mp_mesh["mp"] if "mp" in mp_names and len(mp_names) > 1 else mp_mesh
            mp = sub.get_group() if sub.size() > 1 else None
        return groups_from_process_groups(ep_group=ep, esp_group=esp, mp_group=mp, ep_esp_group=union, values=values)

    @property
    def a(self) -> int:
        return self.layout.ep[self.rank]

    @property
    def s(self) -> int:
        return self.layout.esp[self.rank]

    @property
    def g(self) -> int:
        return self.layout.mp_group[self.rank]

    @property
    def m(self) -> int:
        return self.layout.mp_rank[self.rank]


# ---------------------------------------------------------------------------------------------
# From process groups the caller made: one exchange, the same verdict everywhere
# ---------------------------------------------------------------------------------------------


def _members(group, world_rank: int) -> tuple[int, ...]:
    import torch.distributed as dist

    if group is None:
        return (world_rank,)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"groups must be torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _fingerprint(members: tuple[int, ...]) -> int:
    h = hashlib.sha1(",".join(map(str, members)).encode()).digest()
    return int.from_bytes(h[:7], "little")


_ROLES = ("ep", "esp", "mp", "ep_esp")


def groups_from_process_groups(
    *,
    ep_group=None,
    mp_group=None,
    esp_group=None,
    ep_esp_group=None,
    values: Optional[dict[str, int]] = None,
    what: str = "the Parm MoE layer",
) -> ParmGroups:
    """The :class:`ParmGroups` of this rank from the groups it was given.

    Collective over the default group (every rank calls it, e.g. while building the model): each
    rank contributes a fingerprint of each of its groups and the integer ``values`` (settings
    that must agree, e.g. the config); every rank checks the same table, so an inconsistency
    (two ranks that disagree on a group's members, EP and ESP groups that are not a grid, an MP
    group that leaves the EP&ESP group, disagreeing ``values``) raises the same
    :class:`LayoutError` on every rank before any data moves. ``ep_esp_group`` (all ranks of
    the grid) is created when not given (a group-local collective among its members).
    """
    import torch.distributed as dist


    me = dist.get_rank()
    W = dist.get_world_size()
    mine = {"ep": _members(ep_group, me), "esp": _members(esp_group, me), "mp": _members(mp_group, me)}
    given_union = _members(ep_esp_group, me) if ep_esp_group is not None else ()
    names = sorted(values or {})
    vec = []
    for role in ("ep", "esp", "mp"):
        g = mine[role]
        vec += [len(g), g[0], _fingerprint(g), int(me in g)]
    vec += [len(given_union), given_union[0] if given_union else -1, _fingerprint(given_union) if given_union else 0]
    vec += [int((values or {})[k]) for k in names]
    t = torch.tensor(vec, dtype=torch.int64, device=comm_device(None))
    table_t = torch.empty(W * len(vec), dtype=torch.int64, device=t.device)
    with backend_errors(f"the layout check of {what} (all-gather over the default group)"):
        all_gather_single(table_t, t)
    table = table_t.view(W, len(vec)).tolist()  # host sync: construction only
    layout, problems = _layout_from_table(table, names, what)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise LayoutError(f"inconsistent layout for {what}: {shown}")
    assert layout is not None
    i = layout.ranks.index(me)
    union = layout.ranks
    ep_esp = ep_esp_group
    if ep_esp is None and len(union) > 1:
        if ep_group is not None and len(mine["ep"]) == len(union):
            ep_esp = ep_group
        elif esp_group is not None and len(mine["esp"]) == len(union):
            ep_esp = esp_group
        else:
            ep_esp = new_group(union, parent=_parent(ep_group, esp_group, mp_group), use_local_synchronization=True)
    mp_lane = mp_group
    if mp_group is not None and len(mine["mp"]) == len(union):
        mp_lane = new_group(union, parent=mp_group, use_local_synchronization=True)
    return ParmGroups(layout=layout, rank=i, mp=mp_group, ep=ep_group, esp=esp_group, ep_esp=ep_esp, mp_lane=mp_lane)


def _parent(*groups):
    """The group a new group of the layout inherits its timeout from: the first given one (None:
    the default group)."""
    return next((g for g in groups if g is not None), None)


def _layout_from_table(table: list[list[int]], names: list[str], what: str):
    """(layout of rank 0's grid, problems): the same on every rank (a function of the table)."""
    W = len(table)
    problems: list[str] = []
    roles = {}
    for k, role in enumerate(("ep", "esp", "mp")):
        roles[role] = [tuple(row[4 * k : 4 * k + 4]) for row in table]
    for role, rows in roles.items():
        buckets: dict[tuple, list[int]] = {}
        for r, (size, lo, fp, inside) in enumerate(rows):
            buckets.setdefault((size, lo, fp), []).append(r)
        for (size, lo, fp), rs in buckets.items():
            if len(rs) != size or min(rs) != lo:
                problems.append(
                    f"ranks {rs} pass a {role.upper()} group of {size} ranks starting at rank {lo}, but only ranks "
                    f"{rs} pass it (every member of a group must pass that same group as its {role}_group)"
                )
    vals = [row[15:] for row in table]
    for j, name in enumerate(names):
        seen = {v[j] for v in vals}
        if len(seen) > 1:
            problems.append(f"{name}: " + ", ".join(f"rank {r}={vals[r][j]}" for r in range(W)))
    if problems:
        return None, problems

    def group_of(role: str, r: int) -> tuple[int, ...]:
        key = roles[role][r][:3]
        return tuple(q for q in range(W) if roles[role][q][:3] == key)

    layouts = {}
    for r in range(W):
        ep_r = group_of("ep", r)
        union = tuple(sorted({q for p in ep_r for q in group_of("esp", p)}))
        layouts.setdefault(union, []).append(r)
    unions = list(layouts)
    if any(set(a) & set(b) for i, a in enumerate(unions) for b in unions[i + 1 :]):
        problems.append(f"the EP and ESP groups do not form disjoint grids: {unions}")
        return None, problems
    result = None
    for union, _ in layouts.items():
        n_ep = len(group_of("ep", union[0]))
        n_esp = len(group_of("esp", union[0]))
        n_mp = len(group_of("mp", union[0]))
        if len(union) != n_ep * n_esp:
            problems.append(
                f"ranks {list(union)}: their EP groups (size {n_ep}) and ESP groups (size {n_esp}) do not form a "
                f"{n_ep}x{n_esp} grid (an EP group and an ESP group must share exactly one rank)"
            )
            continue
        coords = []
        for r in union:
            ep_r, esp_r, mp_r = group_of("ep", r), group_of("esp", r), group_of("mp", r)
            if len(ep_r) != n_ep or len(esp_r) != n_esp or len(mp_r) != n_mp:
                problems.append(f"rank {r}: group sizes ep={len(ep_r)} esp={len(esp_r)} mp={len(mp_r)} differ from its grid's")
                continue
            if not set(mp_r) <= set(union):
                problems.append(f"rank {r}: its MP group {list(mp_r)} leaves the EP&ESP group {list(union)}")
                continue
            coords.append((min(mp_r), mp_r.index(r), ep_r.index(r), esp_r.index(r)))
        if problems:
            continue
        if len(union) % n_mp:
            problems.append(f"n_mp={n_mp} does not divide the {len(union)} ranks of the grid {list(union)}")
            continue
        mins = sorted({c[0] for c in coords})
        coords = [(mins.index(c[0]), c[1], c[2], c[3]) for c in coords]
        given = {tuple(table[r][12:15]) for r in union}
        if len(given) > 1:
            problems.append(f"ranks {list(union)} passed different ep_esp_group arguments")
            continue
        (gsize, glo, gfp), = given
        if gsize and (gsize != len(union) or glo != union[0] or gfp != _fingerprint(tuple(union))):
            problems.append(f"ep_esp_group does not hold exactly the ranks {list(union)} of the EP x ESP grid")
            continue
        try:
            layout = ParmLayout.from_coords(coords, n_mp=n_mp, n_ep=n_ep, n_esp=n_esp, ranks=union)
        except LayoutError as e:
            problems.append(f"ranks {list(union)}: {e}")
            continue
        layouts[union] = layout
    if problems:
        return None, problems
    import torch.distributed as dist

    me = dist.get_rank()
    result = next(l for u, l in layouts.items() if me in u)
    return result, problems
