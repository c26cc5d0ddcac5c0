"""The static expert-parallel mode's CUDA-graph capture, run in its own process by
tests/test_ep.py: a failed capture leaves the CUDA RNG in capture mode, which would fail every
later test of a shared process ("Offset increment outside graph capture"). Each stage is printed
to stderr as it is reached, and a hang dumps the stacks and ends the process after
TRITONMOE_CASE_TIMEOUT_S (default 120 s), so the caller's output says where it stopped."""

import faulthandler
import gc
import os
import sys
import threading
import time

import torch

import tritonmoe as tm

_T0 = time.monotonic()


def _stage(msg: str) -> None:  # where a hang stopped, in the caller's captured output
    print(f"[{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    import torch.distributed as dist

    # a hang dumps every thread's stack, then ends the process (the caller's timeout is longer)
    limit = float(os.environ.get("TRITONMOE_CASE_TIMEOUT_S", "120"))
    faulthandler.dump_traceback_later(limit, exit=True)
    created = not dist.is_initialized()
    if created:  # one rank: an in-process store, no port
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    graph = layer = None
    try:
        _stage("process group up")
        cfg = tm.MoEConfig(256, 512, 8, 2, ep_capacity=64)
        torch.manual_seed(0)
        layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # the router ran outside the capture (on the default stream): its
            _, routing = layer.route(x)  # backward must not be part of the captured one
        weights = layer.expert_weights()
        static_x = x.clone().requires_grad_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        _stage("routed")
        with torch.cuda.stream(stream):  # warm-up outside the capture
            layer.expert_path(static_x, routing, weights).float().sum().backward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        _stage("warm-up forward+backward done")
        # as PyTorch's whole-network capture recipe: no .grad from the warm-up (made outside the
        # capture) for the captured backward to accumulate into; the graph allocates its own
        layer.zero_grad(set_to_none=True)
        static_x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.expert_path(static_x, routing, weights)
            out.float().sum().backward()
        _stage("captured")
        new = torch.randn_like(x)
        static_x.data.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _stage("replayed")
        want = layer.expert_path(new, routing, weights)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    finally:
        # A live graph that captured NCCL kernels makes destroy_process_group wait forever (H100,
        # torch 2.11, NCCL 2.28: capture, replay and the check passed, then the teardown hung until
        # killed): NCCL's graceful comm destroy waits until every graph holding its captured work
        # has been destroyed (the graph's user objects are NCCL's "persistent" references), and a
        # graph is destroyed only by reset() or when the last reference to it goes. So: drop the
        # tensors and autograd state of the captured region (they live in the graph's pool), reset
        # the graph, let CUDA run the released objects' destructors (synchronize), collect, and
        # only then destroy the group, under a deadline: a teardown that still hangs ends this
        # process with its stacks and a distinct exit status instead of the caller's timeout.
        out = want = static_x = None  # noqa: F841 - the captured region's outputs and leaf
        try:
            if graph is not None:
                if layer is not None:
                    layer.zero_grad(set_to_none=True)
                graph.reset()
                graph = None
                gc.collect()
                torch.cuda.synchronize()
        finally:
            if created:
                _stage("destroying the process group")
                _bounded_destroy(dist, float(os.environ.get("TRITONMOE_TEARDOWN_TIMEOUT_S", "60")))
                _stage("destroyed")


def _bounded_destroy(dist, limit_s: float) -> None:
    """``dist.destroy_process_group()`` on a daemon thread; if it has not returned after
    ``limit_s``, dump every thread's stack and end the process with status 3 (a teardown hang,
    told apart from a failed capture or a wrong result)."""
    errors: list = []

    def run() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    t = threading.Thread(target=run, name="destroy_process_group", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        _stage(f"TEARDOWN HANG: destroy_process_group did not return in {limit_s:.0f} s")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main()
    print("captured and replayed: equal to eager")
