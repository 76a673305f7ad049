"""
The Triton kernels compiled for GPUs this machine may not have. Every launch that
kernel.causal_linear_attention(backend="triton") makes, forward and backward (and the forward without a
backward, which writes y in the inputs' dtype), is compiled ahead of time
for sm_80 (A100) and sm_90 (H100/H200) with triton.compile and a GPUTarget, no GPU needed, and checked:
shared memory per block within the arch's limit, and no register spills (a stack frame in cuobjdump's
resource usage; ptxas and cuobjdump ship with triton).

    python build_check.py          # about 4 minutes on 2 cores with an empty Triton cache

Prints the worst case per kernel, arch and dtype and saves every launch to results/build_check.json;
exits 1 if any launch does not fit. The launches are recorded, not run: the forward and backward run
on meta tensors (shapes, no data) with kernel.py's six kernels swapped for recorders of their
launches. The shapes are kernel.BUILD_F x kernel.BUILD_DV, and for the closed-form scores (Taylor, the
quadratic, OAL) kernel.BUILD_SQUARES x kernel.BUILD_DV; kernel.COVERED (what backend="auto" trusts on
CUDA) is the set of launch settings they compile to. kernel._configs' tiles, warps and stages were
chosen with it. It is its own file because compiling for machines you do not have is its own question.
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

import kernel
from configurator import configure, writable

if kernel.HAS_TRITON:
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

SHARED_PER_BLOCK = {80: 166912, 90: 232448}  # bytes a block may use: A100 (sm_80) 163 KB, H100/H200 (sm_90) 227 KB


KERNELS = ("_states_kernel", "_fused_kernel", "_output_kernel", "_dqk_kernel", "_dv_kernel", "_dsquares_kernel")


class Recorder:
    """Stands in for a JIT kernel: recorder[grid](*args, **meta) appends (kernel, grid, args, meta) to log."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **meta: self.log.append((self.fn, grid, args, meta))


def recorded_launches(F_, Dv, T, dtype, D=0, SQ=0):
    """The kernel launches of one forward and one backward at these sizes (SQ > 0: with the closed-form
    scores on D dims), of one forward without a backward, and where the forward is fused (bfloat16, F
    within kernel.FUSED_MAX_F, no closed form), of the forwards not fused (pass 1 and pass 2, which
    report_kernel.py times too), recorded on meta tensors."""
    log, jitted, fused_max_f = [], {name: getattr(kernel, name) for name in KERNELS}, kernel.FUSED_MAX_F
    try:
        for name, fn in jitted.items():
            setattr(kernel, name, Recorder(fn, log))
        q, k = (torch.empty(1, T, F_, device="meta", dtype=dtype) for _ in range(2))
        v = torch.empty(1, T, Dv, device="meta", dtype=dtype)
        sq = None
        if SQ:
            sq = tuple(torch.empty(*shape, device="meta", dtype=torch.float32) for shape in
                       ((1, T, D), (1, T, D), (1, SQ, D), (1, SQ), (1,)))
        fused = kernel._is_fused(F_, dtype, sq)
        y, den = kernel._triton_forward(q, k, v, kernel.EPS, sq)
        kernel._triton_backward(q, k, v, y, den, torch.empty_like(v), sq)
        kernel._triton_forward(q, k, v, kernel.EPS, sq, out_dtype=dtype)  # without a backward: y in v's dtype
        if fused:
            kernel.FUSED_MAX_F = 0
            kernel._triton_forward(q, k, v, kernel.EPS, sq)
            kernel._triton_forward(q, k, v, kernel.EPS, sq, out_dtype=dtype)
        return log
    finally:
        kernel.FUSED_MAX_F = fused_max_f
        for name, fn in jitted.items():
            setattr(kernel, name, fn)


def compile_launch(fn, args, meta, arch):
    """Compile one launch for sm_<arch> with the specialisation the JIT would give these arguments.
    Returns (shared bytes, registers per thread, stack bytes) of the compiled kernel."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, arg) in enumerate(zip(fn.params, list(args) + [meta[p.name] for p in fn.params[len(args):]])):
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", arg
            continue
        # ("i32", "D"): an int divisible by 16
        ty, spec = native_specialize_impl(BaseBackend, arg, False, not param.do_not_specialize, True)
        signature[param.name] = ty
        if ty == "constexpr":  # an int equal to 1 is compiled in as a constant
            constexprs[(i,)] = spec
        elif spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return compiled.metadata.shared, regs, stack


def programs(kern, F_, Dv, BH, T):
    """Programs in one launch of kernel `kern` (the parallelism a GPU gets)."""
    cfg = kernel._configs(F_, Dv)[kern]
    N = triton.cdiv(T, cfg.get("C", kernel.CHUNK))  # the fused pass's chunk is a setting
    if kern == "dsquares":
        return 2 * N * BH  # two programs per chunk, dq' and dk'
    if kern in ("states", "fused"):
        tiles = triton.cdiv(F_, cfg["BK"]) * triton.cdiv(Dv, cfg["BV"]) * BH
        return tiles * kernel._segments(N, tiles)[1]
    return (triton.cdiv(F_, cfg["BK"]) if kern == "dqk" else triton.cdiv(Dv, cfg["BV"])) * N * BH


def build_check(archs=(80, 90), dtypes=(torch.float32, torch.bfloat16), T=4096, verbose=True):
    """Compile every launch that causal_linear_attention(backend="triton") makes, forward and backward,
    for every (F, Dv) in kernel.BUILD_F x kernel.BUILD_DV, and with the closed-form scores for every (D, SQ)
    in kernel.BUILD_SQUARES x kernel.BUILD_DV (F = 1 + D + D(D+1)/2), in each dtype, for each GPU arch; check
    that each fits the arch's shared memory per block and spills no registers (a stack frame means spills).
    Launches that compile to the same code are compiled once. Returns the rows; `ok` is False for a launch
    that fails."""
    shapes = [(F_, Dv, 0, 0) for F_ in kernel.BUILD_F for Dv in kernel.BUILD_DV] + \
        [(1 + D + D * (D + 1) // 2, Dv, D, SQ) for D, SQ in kernel.BUILD_SQUARES for Dv in kernel.BUILD_DV]
    rows, seen, t0 = [], {}, time.time()
    for dtype in dtypes:
        for F_, Dv, D, SQ in shapes:
            if verbose and Dv == kernel.BUILD_DV[0]:  # progress, a line per feature size
                print(f"{time.time() - t0:4.0f} s, {len(seen)} compiled: {str(dtype).removeprefix('torch.')}, F = {F_}"
                      + (f" (closed form, D = {D}, {SQ} terms)" if SQ else ""), flush=True)
            for fn, grid, args, meta in recorded_launches(F_, Dv, T, dtype, D, SQ):
                # ints matter (divisibility), pointers by dtype
                specs = tuple(None if torch.is_tensor(a) else a for a in args)
                dtypes_in = tuple(a.dtype for a in args if torch.is_tensor(a))
                for arch in archs:
                    ints = tuple((a % 16 == 0, a == 1) if isinstance(a, int) else a for a in specs)
                    key = (fn.fn.__name__, arch, dtypes_in, ints, tuple(sorted(meta.items())))
                    if key not in seen:
                        seen[key] = compile_launch(fn, args, meta, arch)
                    shared, regs, stack = seen[key]
                    rows.append(dict(kernel=fn.fn.__name__.strip("_").removesuffix("_kernel"), arch=arch,
                                     dtype=str(dtype).removeprefix("torch."), F=F_, Dv=Dv, D=D, SQ=SQ,
                                     programs=math.prod(grid), grid=grid, BK=meta.get("BK", meta.get("BD")),
                                     **{k: meta[k] for k in ("BV", "num_warps", "num_stages")},
                                     shared=shared, regs=regs, stack=stack,
                                     ok=shared <= SHARED_PER_BLOCK[arch] and stack == 0))
    if verbose:
        print(f"{len(seen)} distinct compilations for {len(rows)} launches ({len(archs)} archs x {len(dtypes)} dtypes x "
              f"{len(shapes)} shapes, a forward and a backward of 2-5 kernels each, a forward without one, "
              f"and both unfused where fused, T = {T}); "
              "worst case per kernel, arch and dtype:")
        print(f"{'kernel':<16} {'arch':>5} {'dtype':>9} {'tiles BK x BV':>13} {'warps':>5} {'stages':>6} "
              f"{'shared KB (limit)':>17} {'regs':>5} {'spills':>6} {'fail':>4}   programs at F = Dv = 64, BH = 12, T = 32K")
        groups = {}
        for r in rows:
            with_sq = r["SQ"] and r["kernel"] in ("output", "dqk", "dv")  # the kernels compiled differently for squares
            groups.setdefault((r["kernel"] + ("+squares" if with_sq else ""), r["arch"], r["dtype"]), []).append(r)
        for (kern, arch, dtype), rs in groups.items():
            tiles = sorted({f"{r['BK']}x{r['BV']}" for r in rs}, key=lambda t: [int(x) for x in t.split("x")])
            warps, stages = ("/".join(sorted({str(r[key]) for r in rs})) for key in ("num_warps", "num_stages"))
            print(f"{kern:<16} {'sm_' + str(arch):>5} {dtype:>9} {tiles[0] + '..' + tiles[-1]:>13} {warps:>5} "
                  f"{stages:>6} {max(r['shared'] for r in rs) / 1024:>8.1f} ({SHARED_PER_BLOCK[arch] // 1024})"
                  f" {max(r['regs'] for r in rs):>5} {sum(r['stack'] > 0 for r in rs):>6} {sum(not r['ok'] for r in rs):>4}"
                  f"   {programs(kern.removesuffix('+squares'), 64, 64, 12, 32768)}")
        bad = [r for r in rows if not r["ok"]]
        for r in bad:
            print(f"FAILS: {r}")
        print(f"build check: {len(rows) - len(bad)} of {len(rows)} launches fit in shared memory and do not spill")
    return rows


if __name__ == "__main__":
    cfg = configure({"out": "results/build_check.json"})
    writable(cfg, "out")
    if not kernel.HAS_TRITON or kernel.INTERPRET:
        sys.exit(f"error: the build check needs triton {kernel.TRITON_MIN[0]}.{kernel.TRITON_MIN[1]}+ (Linux only) "
                 "and TRITON_INTERPRET unset")
    rows = build_check()
    os.makedirs(os.path.dirname(cfg["out"]) or ".", exist_ok=True)
    with open(cfg["out"], "w") as f:
        json.dump(rows, f, indent=1)
    print(f"saved {cfg['out']}")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)
