"""Ahead-of-time compilation of Triton kernels for a CUDA target, without a GPU.

Triton's interpreter runs a kernel's Python, not the compiler, so it accepts code the compiler
rejects (loop-carried type changes, non-constexpr globals, shared memory over the limit) and says
nothing about what the code becomes. This module compiles a ``@triton.jit`` kernel for a GPU
target straight from its source (``triton.compile`` + ``GPUTarget``, Triton's bundled ptxas and
cuobjdump; no driver, no device) and reports facts about the result::

    from aot_compile import Ptr, compile_kernel
    facts = compile_kernel(K._route_fwd_kernel, dict(logits_ptr=Ptr("bf16"), T=4096, ..., BLOCK_T=16),
                           num_warps=4)
    facts.registers, facts.stack_bytes, facts.loop_spills, facts.shared, facts.wgmma
    facts.main_loop_int_divs, facts.wgmma_wait_depth, facts.pipeline_buffers

Arguments are given as at a launch (``Ptr(dtype)`` for a tensor, plain values otherwise) and
specialized the way a launch specializes them (:func:`specialize`), so the compiled code is the
code a launch with those values would run. The process must not have ``TRITON_INTERPRET`` set
(tests run this in a subprocess: see ``tests/test_aot_compile.py``). Works with Triton 3.6 to 3.9
(only ``triton.compile``, ``ASTSource``, ``GPUTarget``, ``triton.knobs.nvidia`` tool paths and the
``asm`` / ``metadata`` of the compiled kernel are used).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
import time
from typing import Any, Mapping, Optional

__all__ = [
    "SM90_MAX_SHARED",
    "Desc",
    "GluonDesc",
    "KernelFacts",
    "Ptr",
    "compile_jobs",
    "compile_kernel",
    "compile_many",
    "find_tool",
    "main_loop_barriers",
    "main_loop_facts",
    "mma_shapes",
    "pipeline_buffers",
    "ptx_loops",
    "run_compile_script",
    "specialize",
    "unavailable_reason",
]

#: Largest shared memory one block may use on sm90 (H100/H200): 227 KiB.
SM90_MAX_SHARED = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Ptr:
    """A tensor argument of element type ``dtype`` (Triton's names: "bf16", "fp16", "fp32",
    "fp64", "i32", "i64"), 16-byte aligned like every tensor torch allocates."""

    dtype: str

    def __post_init__(self) -> None:
        if self.dtype.startswith("*"):
            raise ValueError(f"Ptr({self.dtype!r}): give the element type without '*', e.g. Ptr('bf16')")


@dataclasses.dataclass(frozen=True)
class Desc:
    """A host-side tensor descriptor argument (``triton.tools.tensor_descriptor.TensorDescriptor``)
    of element type ``dtype`` and box ``block_shape``: a launch specializes it by these alone
    (``tensordesc<bf16[1, 64, 128]>``); shape and strides are runtime values."""

    dtype: str
    block_shape: tuple[int, ...]

    @property
    def signature(self) -> str:
        return f"tensordesc<{self.dtype}[{', '.join(str(b) for b in self.block_shape)}]>"


@dataclasses.dataclass(frozen=True)
class GluonDesc(Desc):
    """A Gluon host-side tensor descriptor (``triton.experimental.gluon.nvidia.hopper.TensorDescriptor``):
    a launch specializes it by dtype, box and its shared-memory ``layout`` (an
    ``NVMMASharedLayout``): ``tensordesc<bf16[128,64],NVMMASharedLayout(...)>``."""

    layout: Any = None

    @property
    def signature(self) -> str:
        return f"tensordesc<{self.dtype}[{','.join(str(b) for b in self.block_shape)}],{self.layout!r}>"


@functools.lru_cache(maxsize=None)
def find_tool(name: str) -> Optional[str]:
    """Path of Triton's CUDA tool ``name`` ("ptxas", "cuobjdump"): ``TRITON_<NAME>_PATH`` or the
    binary bundled in the triton wheel (resolved by ``triton.knobs``); None when neither runs."""
    try:
        import triton

        return getattr(triton.knobs.nvidia, name).path
    except Exception:  # no CUDA backend in this triton, or the tool is missing or does not run
        return None


def unavailable_reason() -> Optional[str]:
    """Why kernels cannot be compiled for CUDA here (None if they can): no CUDA backend in this
    triton, or no ptxas / cuobjdump."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        return f"triton has no CUDA backend ({exc})"
    for tool in ("ptxas", "cuobjdump"):
        if find_tool(tool) is None:
            return f"no {tool} (neither TRITON_{tool.upper()}_PATH nor the one bundled with triton runs)"
    return None


def specialize(fn, args: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``ASTSource`` as a launch of ``fn`` with ``args`` would
    produce them.

    ``args`` maps every parameter of ``fn`` to its value (parameters with defaults may be left
    out): ``Ptr`` for tensors, ``Desc`` for tensor descriptors, ints / floats / bools, None (a
    constexpr, as at a launch), and any value for ``tl.constexpr`` parameters. Like Triton's
    launcher: an int equal to 1 becomes the constant 1, an int that is
    a multiple of 16 and every pointer are marked 16-divisible, ints pick i32 / i64 / u64 by
    range, and parameters listed in ``do_not_specialize`` (``..._on_alignment``) are left
    unspecialized (unaligned).
    """
    known = {p.name for p in fn.params}
    extra = set(args) - known
    if extra:
        raise TypeError(f"{fn.__name__} has no parameters {sorted(extra)}; it takes {[p.name for p in fn.params]}")
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, p in enumerate(fn.params):
        if p.name in args:
            v = args[p.name]
        elif p.has_default:
            v = p.default
        else:
            raise TypeError(f"{fn.__name__}: no value for parameter {p.name!r}")
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        aligned = not p.do_not_specialize and not p.do_not_specialize_on_alignment
        if v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = None
            continue
        if isinstance(v, Desc):
            signature[p.name] = v.signature
            continue
        if isinstance(v, Ptr):
            signature[p.name] = f"*{v.dtype}"
        elif isinstance(v, bool):
            signature[p.name] = "i1"
            continue
        elif isinstance(v, int):
            if v == 1 and not p.do_not_specialize:
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
                continue
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else ("i64" if -(2**63) <= v < 2**63 else "u64")
            aligned = aligned and v % 16 == 0
        elif isinstance(v, float):
            signature[p.name] = "fp32"
            continue
        else:
            raise TypeError(f"{fn.__name__}: {p.name}={v!r} is not a Ptr, int, float or bool (and not a constexpr)")
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


@dataclasses.dataclass
class KernelFacts:
    """What the compiler made of one kernel specialization.

    registers: registers per thread (cuobjdump). stack_bytes: per-thread stack frame; register
    spills land there (0 means no spills). spills: local-memory load/store instructions (LDL/STL)
    in the SASS; loop_spills: those inside the main loop (the loop running the MMAs, see
    :func:`_main_loop_mask`; in kernels without MMAs, any loop) rather than its prologue or
    epilogue. shared: bytes of shared
    memory the launch needs. wgmma / mma_sync: the PTX uses Hopper warpgroup MMAs / warp-level
    MMAs. async_loads: distinct source loads the pipeliner turned into asynchronous global ->
    shared copies (cp.async); 0 means every load is synchronous.

    Main loop (a kernel's loops that run tensor-core MMAs; see :func:`main_loop_facts`):
    main_loop_int_divs: integer division / remainder instructions in it (``div``/``rem`` on
    s32/u32/s64/u64 in the PTX, which ptxas expands into dozens of instructions or a call to a
    software routine; a constant divisor becomes a multiply-shift and does not count);
    wgmma_wait_depth: the smallest N of the ``wgmma.wait_group N`` in it (0: every MMA must finish
    before the next step is issued, i.e. no MMA overlaps the next one; None: no wgmma in a loop);
    pipeline_buffers: the smallest buffer count among the multi-buffered shared-memory tiles the
    software pipeliner allocated (``[stages, rows, cols]`` allocations in the TTGIR; 0: none).

    TMA: tma_loads / tma_stores: TMA
    (``cp.async.bulk.tensor``) global -> shared / shared -> global instructions in the PTX.
    barriers: CTA-wide barriers (``bar.sync`` / ``barrier.sync``) in the PTX; a reduction over an
    axis that the layout spreads over several warps goes through shared memory between two of
    them.
    tcgen05_kinds: on sm_100a, the distinct ``cta_group::N.kind::K`` of the PTX's ``tcgen05.mma``
    (Blackwell's tensor-core MMA into tensor memory), e.g. ``("cta_group::1.kind::f16",)``.
    setmaxnreg: the ``setmaxnreg`` register reallocations of a warp-specialized kernel, in PTX
    order, e.g. ``("inc 240", "dec 232", "inc 40", "dec 24")`` (empty for a kernel whose warps all
    run the same code).
    mma_types: the distinct operand-type suffixes of the PTX MMAs, accumulator first, e.g.
    ``("wgmma.f32.e4m3.e4m3",)`` for FP8 wgmma or ``("mma.f32.bf16.bf16.f32",)``.
    main_loop_barriers: those of ``barriers`` inside the main loop (:func:`main_loop_barriers`).
    mma_shapes: the distinct MMA shapes (``m64n256k16``...) of the PTX (:func:`mma_shapes`).
    mma_loop_stores (only with ``compile_kernel(..., loop_facts=True)``, else None): global
    stores (STG, UTMASTG) inside the innermost loop that issues the tensor-core MMAs; > 0 means
    the epilogue runs inside the pipelined loop (a persistent kernel whose tile and K loops
    were fused), 0 that the MMA loop only loads and multiplies.
    """

    name: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    spills: int
    loop_spills: int
    shared: int
    wgmma: bool
    mma_sync: bool
    async_loads: int
    main_loop_int_divs: int
    wgmma_wait_depth: Optional[int]
    pipeline_buffers: int
    compile_s: float
    tma_loads: int = 0
    tma_stores: int = 0
    mma_loop_stores: Optional[int] = None
    barriers: int = 0
    mma_types: tuple = ()
    tcgen05_kinds: tuple = ()
    setmaxnreg: tuple = ()
    main_loop_barriers: int = 0
    mma_shapes: tuple = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_TMA_LOAD = re.compile(r"\bcp\.async\.bulk\.tensor\.\d+d\.shared::(?:cta|cluster)\.global\b")
_TMA_STORE = re.compile(r"\bcp\.async\.bulk\.tensor\.\d+d\.global\.shared::cta\b")
_BARRIER = re.compile(r"\b(?:bar|barrier)\.sync\b")
#: Blackwell's (sm_100a) tensor-core MMA issued from one thread into tensor memory, e.g.
#: ``tcgen05.mma.cta_group::1.kind::f16`` (16-bit operands) or ``kind::f8f6f4`` (FP8).
_SETMAXNREG = re.compile(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
_TCGEN05_MMA = re.compile(r"\btcgen05\.mma\.(cta_group::\d)\.(kind::\w+)")
_LOCAL_MEM = re.compile(r"^(@!?U?P\w+\s+)?(LDL|STL)\b")


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("cuobjdump not found (set TRITON_CUOBJDUMP_PATH)")
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, *flags, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def _innermost(pos: int, loops: list[tuple[int, int]]) -> Optional[tuple[int, int]]:
    inside = [lp for lp in loops if lp[0] <= pos <= lp[1]]
    return min(inside, key=lambda lp: lp[1] - lp[0]) if inside else None


def _main_loop_mask(positions: list[int], is_mma: list[bool], loops: list[tuple[int, int]]) -> list[bool]:
    """Which instructions are in the main loop: those whose innermost enclosing loop is the
    innermost enclosing loop of some MMA instruction (a GEMM's K loop, not the loops around it,
    e.g. a persistent kernel's tile loop with its epilogue), or, in a kernel without MMAs, those in
    any loop."""
    inner = [_innermost(p, loops) for p in positions]
    if not any(is_mma):
        return [lp is not None for lp in inner]
    mains = {lp for lp, mma in zip(inner, is_mma) if mma and lp is not None}
    return [lp in mains for lp in inner]


_SASS_MMA = re.compile(r"\b(HGMMA|HMMA|QGMMA|QMMA)\b")


def _local_memory_ops(sass: str) -> tuple[int, int]:
    """(LDL/STL instructions, those inside the main loop) of a cuobjdump SASS listing (see
    :func:`_main_loop_mask`). A loop is the address range from a backward branch's target to the
    branch; ptxas lays loops out contiguously for these kernels, and a block it moves out of line
    would only widen the range (more instructions counted as in a loop, never fewer)."""
    insts = []
    loops = []
    for m in _SASS.finditer(sass):
        addr, text = int(m.group(1), 16), m.group(2).strip()
        insts.append((addr, text))
        b = _BRA.search(text)
        if b is not None:
            target = int(b.group(1), 16)
            if target < addr:  # a backward branch closes a loop [target, addr]; a self-loop is the trap at the end
                loops.append((target, addr))
    main = _main_loop_mask([a for a, _ in insts], [bool(_SASS_MMA.search(t)) for _, t in insts], loops)
    local = [i for i, (_, t) in enumerate(insts) if _LOCAL_MEM.match(t)]
    return len(local), sum(main[i] for i in local)


_MMA = re.compile(r"^(@!?U?P\w+\s+)?(HGMMA|HMMA|QGMMA|QMMA)\b")
_GLOBAL_STORE = re.compile(r"^(@!?U?P\w+\s+)?(STG|UTMASTG)\b")


def _mma_loop_stores(sass: str) -> Optional[int]:
    """Global stores in the innermost loop (smallest backward-branch range, as in
    :func:`_local_memory_ops`) that contains a tensor-core MMA; None when no loop has one. Blocks
    ptxas moves out of line (mbarrier wait retries) can widen a loop's range, which is why the
    smallest range is taken."""
    insts = [(int(m.group(1), 16), m.group(2).strip()) for m in _SASS.finditer(sass)]
    loops = []
    for addr, text in insts:
        b = _BRA.search(text)
        if b is not None and int(b.group(1), 16) < addr:
            loops.append((int(b.group(1), 16), addr))
    best = None
    for lo, hi in loops:
        body = [t for a, t in insts if lo <= a <= hi]
        if any(_MMA.match(t) for t in body) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi, sum(1 for t in body if _GLOBAL_STORE.match(t)))
    return None if best is None else best[2]


def _async_loads(ttgir: str) -> int:
    """Distinct source loads lowered to async global -> shared copies (the pipeliner emits one
    copy per stage for each; their debug locations tell them apart)."""
    ops = [line for line in ttgir.splitlines() if "async_copy_global_to_local" in line]
    locs = {m.group(1) for line in ops if (m := re.search(r"loc\((#loc\d+)\)\s*$", line))}
    return len(locs) if locs else len(ops)


_PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_PTX_MMA = re.compile(r"\bwgmma\.mma_async\.|\bmma\.sync\.")
_PTX_INT_DIV = re.compile(r"^\s*(?:@!?%p\d+\s+)?(div|rem)\.(s|u)(16|32|64)\b")
_PTX_WGMMA_TYPES = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.(\w+)\.(\w+)\.(\w+)")
_PTX_MMA_TYPES = re.compile(r"\bmma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.(\w+)\.(\w+)\.(\w+)\.(\w+)")
_PTX_WGMMA_WAIT = re.compile(r"\bwgmma\.wait_group\.sync\.aligned\s+(\d+)")
_TTGIR_BUFFERS = re.compile(r"local_alloc\b[^\n]*?memdesc<(\d+)x(\d+)x(\d+)x")


def ptx_loops(ptx: str) -> list[tuple[int, int]]:
    """(first line, last line) of every loop of a PTX listing: a branch to a label defined on an
    earlier line closes the loop [label, branch]. LLVM lays a loop's blocks out contiguously in
    the kernels here (and a block moved out of line only narrows the range, so instructions in it
    would be missed, never miscounted)."""
    lines = ptx.splitlines()
    labels = {}
    loops = []
    for i, line in enumerate(lines):
        m = _PTX_LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = i
            continue
        b = _PTX_BRANCH.search(line)
        if b and b.group(1) in labels and labels[b.group(1)] < i:
            loops.append((labels[b.group(1)], i))
    return loops


def main_loop_facts(ptx: str) -> tuple[int, Optional[int]]:
    """(integer divisions / remainders, smallest wgmma wait depth) in a kernel's main loop: the
    instructions whose innermost enclosing loop is the innermost enclosing loop of an MMA
    instruction (``wgmma.mma_async`` / ``mma.sync``), i.e. a GEMM's K loop without the loops
    around it (a persistent kernel's tile loop, whose once-per-tile index arithmetic may divide)
    unless the compiler put MMAs there too. (0, None) for a kernel without MMAs in loops."""
    lines = ptx.splitlines()
    is_mma = [bool(_PTX_MMA.search(line)) for line in lines]
    if not any(is_mma):
        return 0, None
    main = _main_loop_mask(list(range(len(lines))), is_mma, ptx_loops(ptx))
    divs, waits = 0, []
    for line, in_main in zip(lines, main):
        if not in_main:
            continue
        if _PTX_INT_DIV.match(line):
            divs += 1
        w = _PTX_WGMMA_WAIT.search(line)
        if w:
            waits.append(int(w.group(1)))
    return divs, (min(waits) if waits else None)


def main_loop_barriers(ptx: str) -> int:
    """CTA-wide barriers (``bar.sync`` / ``barrier.sync``) in a kernel's main loop (as in
    :func:`main_loop_facts`: the innermost loop of the MMAs; for a persistent kernel whose tile
    and K loops were fused, that loop holds the per-tile prologue and epilogue too, so a
    per-tile reduction across warps shows here). 0 for a kernel without MMAs in loops."""
    lines = ptx.splitlines()
    is_mma = [bool(_PTX_MMA.search(line)) for line in lines]
    if not any(is_mma):
        return 0
    main = _main_loop_mask(list(range(len(lines))), is_mma, ptx_loops(ptx))
    return sum(1 for line, in_main in zip(lines, main) if in_main and _BARRIER.search(line))


_PTX_MMA_SHAPE = re.compile(r"\b(?:wgmma\.mma_async\.sync\.aligned|mma\.sync\.aligned)\.(m\d+n\d+k\d+)\b")


def mma_shapes(ptx: str) -> tuple:
    """The distinct MMA instruction shapes of a PTX listing, e.g. ``("m64n256k16",)``."""
    return tuple(sorted(set(_PTX_MMA_SHAPE.findall(ptx))))


def pipeline_buffers(ttgir: str) -> int:
    """Smallest buffer count of the multi-buffered 2-D tiles in shared memory (the software
    pipeliner allocates ``[buffers, rows, cols]``; index vectors are 2-D allocations and do not
    count); 0 when there are none."""
    counts = [int(m.group(1)) for m in _TTGIR_BUFFERS.finditer(ttgir)]
    return min(counts) if counts else 0


def compile_kernel(fn, args: Mapping[str, Any], *, num_warps: int = 4, num_stages: int = 3, arch: int = 90,
                   name: Optional[str] = None, loop_facts: bool = False) -> KernelFacts:
    """Compile ``fn`` for CUDA capability ``arch`` (90 = sm_90a) as a launch with ``args`` (see
    :func:`specialize`), ``num_warps`` and ``num_stages`` would, and return its :class:`KernelFacts`
    (``loop_facts``: also disassemble to find ``mma_loop_stores``).
    Raises what the compiler raises (e.g. ``CompilationError``, ptxas errors)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: this process runs the interpreter, not the compiler; "
                           "compile in a process without it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(fn, args)
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel (triton.experimental.gluon)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    # enable_fp_fusion=True is the launch default; saying so silences triton 3.9's warning about it
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True})
    res = _cuobjdump(kernel.asm["cubin"], "-res-usage")
    m = _RES.search(res)
    if m is None:
        raise RuntimeError(f"cannot parse cuobjdump -res-usage output for {fn.__name__}:\n{res}")
    registers, stack = int(m.group(2)), int(m.group(3))
    spills = loop_spills = 0
    if stack or int(m.group(5)):  # no stack frame and no local memory: nothing to disassemble
        spills, loop_spills = _local_memory_ops(_cuobjdump(kernel.asm["cubin"], "-sass"))
    ptx = kernel.asm["ptx"]
    divs, wait_depth = main_loop_facts(ptx)
    return KernelFacts(
        name=name or fn.__name__,
        arch=arch,
        num_warps=num_warps,
        num_stages=num_stages,
        registers=registers,
        stack_bytes=stack,
        spills=spills,
        loop_spills=loop_spills,
        shared=int(kernel.metadata.shared),
        wgmma="wgmma.mma_async" in ptx,
        mma_sync=re.search(r"\bmma\.sync\.", ptx) is not None,
        async_loads=_async_loads(kernel.asm["ttgir"]),
        main_loop_int_divs=divs,
        wgmma_wait_depth=wait_depth,
        pipeline_buffers=pipeline_buffers(kernel.asm["ttgir"]),
        compile_s=round(time.perf_counter() - t0, 2),
        tma_loads=len(_TMA_LOAD.findall(ptx)),
        tma_stores=len(_TMA_STORE.findall(ptx)),
        barriers=len(_BARRIER.findall(ptx)),
        mma_types=tuple(sorted({"wgmma." + ".".join(m) for m in _PTX_WGMMA_TYPES.findall(ptx)}
                               | {"mma." + ".".join(m) for m in _PTX_MMA_TYPES.findall(ptx)})),
        main_loop_barriers=main_loop_barriers(ptx),
        mma_shapes=mma_shapes(ptx),
        mma_loop_stores=_mma_loop_stores(_cuobjdump(kernel.asm["cubin"], "-sass")) if loop_facts else None,
        tcgen05_kinds=tuple(sorted({".".join(m) for m in _TCGEN05_MMA.findall(ptx)})),
        setmaxnreg=tuple(f"{d} {n}" for d, n in _SETMAXNREG.findall(ptx)),
    )


# ---------------------------------------------------------------------------------------------
# Many kernels at once: forked workers, one JSON line each, and the subprocess that runs them
# ---------------------------------------------------------------------------------------------

_TO_COMPILE: dict = {}  # name -> (fn, args, compile_kernel keywords), filled before the workers fork


def _compile_one(name: str) -> dict:
    fn, args, kw = _TO_COMPILE[name]
    rec: dict = {"name": name}
    try:
        rec.update(ok=True, **compile_kernel(fn, args, name=name, **kw).as_dict())
    except Exception as exc:  # report every kernel, then fail
        rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-3000:]}")
    return rec


def compile_jobs() -> int:
    """Worker processes for :func:`compile_many`: ``TRITONMOE_AOT_JOBS``, else one per CPU this
    process may use (Triton compiles one kernel on one core; the kernels are independent)."""
    env = os.environ.get("TRITONMOE_AOT_JOBS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def compile_many(kernels: Mapping[str, tuple]) -> int:
    """Compile ``kernels`` (name -> ``(fn, args, compile_kernel keywords)``) in
    :func:`compile_jobs` forked workers and print one JSON line per kernel as it finishes (its
    :class:`KernelFacts`, or ``ok: false`` and the error), then a ``done`` line. Returns the exit
    status: 1 if any failed. The process must not run the interpreter (see :func:`compile_kernel`)."""
    import concurrent.futures as cf
    import json
    import multiprocessing as mp

    t0 = time.perf_counter()
    _TO_COMPILE.clear()
    _TO_COMPILE.update(kernels)
    names = list(_TO_COMPILE)
    jobs = min(compile_jobs(), max(1, len(names)))
    failed = 0
    pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) if jobs > 1 else None
    records = map(_compile_one, names) if pool is None else \
        (f.result() for f in cf.as_completed([pool.submit(_compile_one, n) for n in names]))
    for rec in records:
        failed += not rec["ok"]
        print(json.dumps(rec), flush=True)
    if pool is not None:
        pool.shutdown()
    print(json.dumps({"done": True, "jobs": jobs, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 1 if failed else 0


def run_compile_script(path: str, timeout: float) -> dict:
    """Run the script at ``path`` (whose main prints :func:`compile_many`'s lines) in a process
    without ``TRITON_INTERPRET``; name -> JSON record, plus ``"__done__"`` when it finished.
    Raises RuntimeError with the end of its stderr when the subprocess died before its done line."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.abspath(path)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            records[rec.get("name", "__done__")] = rec
    if "__done__" not in records:
        raise RuntimeError(f"the compile subprocess died (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return records
