"""MoELayer: a drop-in replacement for a transformer FFN."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import reference
from .dispatch import implementation
from .config import MoEConfig
from .types import Routing

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN: ``forward(x[..., d_model]) -> [..., d_model]``.

    Parameters: ``router`` (nn.Linear(d_model, E, bias=False)), ``w1`` [E_local, d_model, n1]
    (n1 = 2*d_ffn for swiglu, gate columns first) and ``w2`` [E_local, d_ffn, d_model], each
    expert initialized like an nn.Linear. With ``config.expert_bias`` a buffer ``expert_bias``
    (fp32 [E], zeros) biases selection only.

    After each forward, ``ffn_path_used`` says which expert path ran (``config.ffn_path``), and
    ``aux_loss`` holds ``aux_loss_coef * load_balancing_loss +
    z_loss_coef * z_loss`` (a zero tensor when both coefficients are 0) and ``last_routing`` the
    :class:`Routing` of that batch.

    The layer produces its own routing metadata, so its internal op calls skip the value checks
    of the public functional API (no validation syncs on the hot path).

    Expert parallelism (``ep_group``, a process group of P ranks; E divisible by P): rank r owns
    the experts [r*E/P, (r+1)*E/P), so ``w1``/``w2`` hold E/P experts; communication goes through
    ``self.dispatcher`` (:class:`tritonmoe.comm.AllToAllDispatcher`). Semantics:

    * Each rank routes its own tokens, so capacity is computed from the local token count
      (``config.capacity(T_local)``): the layer equals a single-process layer holding all E
      experts applied to each rank's batch separately, not to the concatenated global batch.
    * The router is replicated: initialize it identically on every rank; its gradient is this
      rank's (a data-parallel wrapper averages it). ``aux_loss`` is this rank's batch's loss.
    * ``config.pipeline_degree`` = n cuts the local tokens into n micro-batches whose dispatch,
      expert FFN and combine are pipelined (:mod:`tritonmoe.comm.pipeline`); every rank of the
      group must use the same n. Routing is decided once for the whole local batch, so n changes
      the schedule, not the result: bitwise in fp64 on the reference backend (see that module).
    * Set ``layer.timeline = tritonmoe.comm.Timeline()`` to record each micro-op's spans.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_group=None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a tritonmoe.MoEConfig, got {type(config).__name__}")
        self.config = config
        self.ep_group = ep_group
        self.num_local_experts = config.num_experts
        self.expert_start = 0
        self.dispatcher = None
        self.timeline = None
        if ep_group is not None:
            self._init_expert_parallel(ep_group, dtype if dtype is not None else torch.get_default_dtype())
        elif config.pipeline_degree != 1:
            raise ValueError(
                f"pipeline_degree={config.pipeline_degree} overlaps expert-parallel communication with "
                "expert compute and needs ep_group (a torch.distributed process group); use "
                "pipeline_degree=1 without expert parallelism"
            )
        factory = {"device": device, "dtype": dtype}
        E, d, f = config.num_experts, config.d_model, config.d_ffn
        self.router = nn.Linear(d, E, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(self.num_local_experts, d, config.n1, **factory))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, f, d, **factory))
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.aux_loss: torch.Tensor = torch.zeros((), device=device)
        self.last_routing: Routing | None = None
        #: The expert path ("fused" or "unfused") the last forward used (None before the first).
        self.ffn_path_used: str | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        self.router.reset_parameters()
        with torch.no_grad():
            b1 = 1.0 / math.sqrt(self.config.d_model)
            b2 = 1.0 / math.sqrt(self.config.d_ffn)
            self.w1.uniform_(-b1, b1)
            self.w2.uniform_(-b2, b2)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"d_model={c.d_model}, d_ffn={c.d_ffn}, num_experts={c.num_experts}, top_k={c.top_k}, "
            f"activation={c.activation}, score_func={c.score_func}"
        )

    # -- the steps of a forward, separate so that expert parallelism can interleave them --------

    def _impl(self, op: str, device: torch.device):
        return implementation(op, self.config.backend, device, self.w1.dtype)

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """Router logits and routing for flattened tokens."""
        c = self.config
        logits_TE = self.router(x_TD)
        need_aux = c.aux_loss_coef > 0 or c.z_loss_coef > 0
        routing = self._impl("route", x_TD.device)(
            logits_TE,
            c.top_k,
            score_func=c.score_func,
            renormalize=c.renormalize,
            expert_bias=self.expert_bias,
            n_groups=c.n_groups,
            topk_groups=c.topk_groups,
            capacity=c.capacity(x_TD.shape[0]),
            with_aux=need_aux,
        )
        return logits_TE, routing

    def compute_aux_loss(self, logits_TE: torch.Tensor, routing: Routing) -> torch.Tensor:
        c = self.config
        loss = torch.zeros((), device=logits_TE.device, dtype=torch.float32)
        if c.aux_loss_coef > 0:
            loss = loss + c.aux_loss_coef * reference.load_balancing_loss(logits_TE, routing)
        if c.z_loss_coef > 0:
            loss = loss + c.z_loss_coef * reference.z_loss(logits_TE, routing)
        return loss

    def choose_ffn_path(self, x_TD: torch.Tensor) -> str:
        """"fused" or "unfused" for this call, from ``config.ffn_path``.

        The "auto" policy is provisional (no GPU measurement behind it yet): "fused" whenever the
        expert FFN runs on the Triton kernels, since it skips the permuted copy of x and the
        expert-ordered y (two [T*k, d] round trips through memory and two launches) and its GEMMs
        are the unfused ones' with gathered row loads; "unfused" on the reference backend, where
        both paths are the same plain-PyTorch composition. Replace with a per-shape rule once the
        benchmark harness has measured both paths on a GPU.
        """
        c = self.config
        if c.ffn_path != "auto":
            return c.ffn_path
        uses_kernel = self._impl("moe_ffn", x_TD.device) is not reference.moe_ffn
        return "fused" if uses_kernel else "unfused"

    def local_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert FFN and weighted combine, all experts on this device, on the path chosen by
        :meth:`choose_ffn_path` (recorded in ``ffn_path_used``)."""
        dev = x_TD.device
        path = self.choose_ffn_path(x_TD)
        self.ffn_path_used = path
        if path == "fused":
            return self._impl("moe_ffn", dev)(x_TD, routing, self.w1, self.w2, self.config.activation)
        x_perm, info = self._impl("permute", dev)(x_TD, routing.topk_ids, self.config.num_experts)
        y_perm = self._impl("grouped_ffn", dev)(x_perm, info.expert_offsets, self.w1, self.w2, self.config.activation)
        return self._impl("unpermute", dev)(y_perm, info, routing.topk_weights)

    # -- expert parallelism (the communication steps live in tritonmoe.comm) -------------------

    def _init_expert_parallel(self, ep_group, dtype) -> None:
        """Own the experts [r*E/P, (r+1)*E/P) of this rank r of the group (P ranks)."""
        from .comm import AllToAllDispatcher, check_agreement

        c = self.config
        # The sizes of every later collective follow from these; a rank that disagrees would
        # make gloo abort mid-forward, so compare them once here (one small collective), before
        # any check that could fail on some ranks only.
        dtype_code = _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1
        check_agreement(
            dict(num_experts=c.num_experts, d_model=c.d_model, pipeline_degree=c.pipeline_degree, dtype=dtype_code),
            group=ep_group,
            what="the expert-parallel MoEConfig",
        )
        self.dispatcher = AllToAllDispatcher(c.num_experts, ep_group, backend=c.backend)
        self.num_local_experts = self.dispatcher.num_local_experts
        self.expert_start = self.dispatcher.local_expert_start

    def expert_parallel(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts of the whole group over this rank's tokens.

        Local steps here, communication in ``self.dispatcher``: permute each of the
        ``pipeline_degree`` micro-batches (contiguous token ranges; routing and capacity were
        decided once for the whole local batch), exchange the per-expert counts once, then
        dispatch / expert FFN / combine per micro-op, pipelined (forward and backward), and
        unpermute each micro-batch. The expert FFN runs on the expert-major re-layout of the
        received rows: one grouped FFN per micro-op over the local experts.
        """
        c = self.config
        dev = x_TD.device
        disp = self.dispatcher
        disp.timeline = self.timeline
        # Received rows arrive already grouped, so the experts run the grouped FFN on them; the
        # fused gather/scatter path applies to local experts only.
        self.ffn_path_used = "unfused"
        bounds = _micro_batch_bounds(x_TD.shape[0], c.pipeline_degree)
        permute = self._impl("permute", dev)
        sends, infos = [], []
        for a, b in bounds:
            x_perm, info = permute(x_TD[a:b], routing.topk_ids[a:b], c.num_experts)
            sends.append(x_perm)
            infos.append(info)
        plan = disp.exchange_counts(torch.stack([info.counts for info in infos]))
        ffn = self._impl("grouped_ffn", dev)

        def experts(i: int, recv_RD: torch.Tensor, params) -> torch.Tensor:
            w1, w2 = params
            x_RD = disp.to_expert_major(recv_RD, plan, i)
            y_RD = ffn(x_RD, disp.expert_offsets(plan, i), w1, w2, c.activation)
            return disp.to_source_major(y_RD, plan, i)

        backs = disp.run_pipelined(sends, plan, experts, (self.w1, self.w2))
        unpermute = self._impl("unpermute", dev)
        outs = [unpermute(backs[i], infos[i], routing.topk_weights[a:b]) for i, (a, b) in enumerate(bounds)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != c.d_model:
            raise ValueError(f"x has shape {tuple(x.shape)}; the last dimension must be d_model={c.d_model}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"x is {x.dtype} but the layer's parameters are {self.w1.dtype}; cast one of them")
        if x.device != self.w1.device:
            raise ValueError(f"x is on {x.device} but the layer is on {self.w1.device}; move one of them")
        x_TD = x.reshape(-1, c.d_model)
        logits_TE, routing = self.route(x_TD)
        self.aux_loss = self.compute_aux_loss(logits_TE, routing)
        self.last_routing = routing
        if self.dispatcher is None:
            out_TD = self.local_experts(x_TD, routing)
        else:
            out_TD = self.expert_parallel(x_TD, routing)
        return out_TD.view(x.shape)


#: dtypes as small ints for the cross-rank agreement check.
_DTYPE_CODES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _micro_batch_bounds(num_tokens: int, n: int) -> list[tuple[int, int]]:
    """n contiguous token ranges covering [0, num_tokens), sizes differing by at most one (the
    first num_tokens % n one longer); empty ranges when num_tokens < n."""
    base, extra = divmod(num_tokens, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
