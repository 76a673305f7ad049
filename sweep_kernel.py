"""
The Triton kernels' launch settings timed on this machine, to choose kernel._configs, STATE_PROGRAMS and
MIN_SEGMENT from measurements rather than from the build check alone (which says what fits, not what is
fast): the fused forward and its segments' sums, pass 1 and pass 2, each over its tiles, warps, stages and
segment counts, and the fused forward over its chunk.

    python sweep_kernel.py                      # on a GPU: Hedgehog at 1 x 12 x 64, 4K and 32K tokens
    python sweep_kernel.py --stages=2,3         # also 3 pipeline stages (twice the settings)

Writes results/kernel_sweep_<gpu>.json after every setting, so a run stopped by a time limit keeps its rows.
On a CPU it needs TRITON_INTERPRET=1 (set before starting Python) and checks only the bookkeeping (the
tests run it so, at tiny sizes).
"""
import itertools
import json

import torch

import kernel
from bench_kernel import _time
from configurator import at_least, configure, integers, sizes, writable
from kernel import HAS_TRITON, INTERPRET
from report_kernel import _device, _one_line, _out_path


def _fused_sums(k, v, BH, T):
    """The fused forward's first launch alone: its segments' sums S0 (pass 1's kernel and settings)."""
    C, L, NS, _ = kernel._fused_segments(BH, T, k.shape[-1], v.shape[-1])
    if NS == 1:
        raise ValueError("one segment: the fused forward takes no sums")
    return kernel._segment_sums(k, v, None, L, NS, False, C)[0]


def sweep(cfg):
    """At the shape B x H x D of `shape` with Hedgehog's F = 2D, bf16, at each of `lengths`: the fused
    forward (when kernel._is_fused; the segments' sums at their defaults) for every BV in `tiles`,
    num_warps in `warps`, num_stages in `stages`, STATE_PROGRAMS in `programs`, MIN_SEGMENT in
    `min_segments` and chunk C in `chunks` (its rows' C; the other kernels take kernel.CHUNK); the fused
    forward's first launch alone, its segments' sums (pass 1's kernel and settings, "states", over the
    segments the fused pass asks for), and pass 1 (kernel._states), each for every BK, BV, warps, stages
    and STATE_PROGRAMS; and the forward not fused for every BK, BV, warps and stages of pass 2 (the
    output kernel; pass 1 at its defaults). Each is checked against the defaults' result before it is
    timed (to float32 rounding; in another chunk to bf16's, since the state meets the dots rounded at
    other tokens); settings that do not compile, or that leave the sums one segment (nothing to time),
    are recorded with their error. Writes `out` after every setting; returns the rows."""
    if not HAS_TRITON or not (torch.cuda.is_available() or INTERPRET):
        raise SystemExit("error: sweep_kernel.py times the Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1, "
                         "set before starting Python, to check the bookkeeping on a CPU)")
    dev, gpu, _ = _device()
    dtype = torch.bfloat16  # the GPU's fast path (the interpreter emulates it)
    out = _out_path(cfg["out"], "kernel_sweep", gpu)
    (B, H, D), = sizes(cfg, "shape", 3)
    tiles, warps, stages, programs, min_segments, chunks = (integers(cfg, key, 1) for key in (
        "tiles", "warps", "stages", "programs", "min_segments", "chunks"))
    defaults, default_programs, fused_max_f = kernel._configs, kernel.STATE_PROGRAMS, kernel.FUSED_MAX_F
    default_min_segment = kernel.MIN_SEGMENT
    rows = []
    try:
        for T in integers(cfg, "lengths", 1):
            g = torch.Generator().manual_seed(0)
            q, k = (torch.rand(B * H, T, 2 * D, generator=g).to(dev, dtype) for _ in range(2))
            v = torch.randn(B * H, T, D, generator=g).to(dev, dtype)
            forward = lambda: kernel._triton_forward(q, k, v, kernel.EPS)[0]
            runs = {}
            if kernel._is_fused(2 * D, dtype, False):
                runs["fused"] = forward
                if kernel._fused_segments(B * H, T, 2 * D, D)[2] > 1:  # (one segment takes no sums)
                    runs["sums"] = lambda: _fused_sums(k, v, B * H, T)
            runs.update(states=lambda: kernel._states(k, v, None, False)[0], output=forward)  # output: not fused
            for kern, fn in runs.items():
                key = "states" if kern == "sums" else kern  # the launch settings it takes
                kernel._configs, kernel.STATE_PROGRAMS = defaults, default_programs
                kernel.MIN_SEGMENT = default_min_segment
                kernel.FUSED_MAX_F = 0 if kern == "output" else fused_max_f
                ref = fn()
                BKs = [kernel._tile(2 * D, 128)] if kern == "fused" else tiles  # fused: the state is one tile of F
                counts = [default_programs] if kern == "output" else programs
                mins = min_segments if kern == "fused" else [default_min_segment]
                Cs = chunks if kern == "fused" else [None]  # the fused pass's chunk is a setting; the others' CHUNK
                for BK, BV, nw, ns, n_prog, n_min, C in itertools.product(BKs, tiles, warps, stages, counts, mins, Cs):
                    meta = dict(BK=BK, BV=BV, num_warps=nw, num_stages=ns, **({"C": C} if C else {}))
                    kernel._configs = lambda F_, Dv, squares=False: {**defaults(F_, Dv, squares), key: meta}
                    kernel.STATE_PROGRAMS, kernel.MIN_SEGMENT = n_prog, n_min
                    row = dict(kernel=kern, B=B, H=H, D=D, F=2 * D, T=T, programs=n_prog, min_segment=n_min, **meta)
                    try:
                        row["rel_error"] = ((fn() - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # (1 chunk: states 0)
                        row["ms"] = _time(fn, cfg["repeats"]) * 1e3
                    except Exception as e:  # e.g. out of shared memory
                        row["error"] = _one_line(e)
                    rows.append(row)
                    print(f"{kern:<6} T={T:<6} " + (f"C={C:<3} " if C else "") + f"BK={BK:<3} BV={BV:<3} warps={nw} "
                          f"stages={ns} programs={n_prog:<6} min_segment={n_min:<3} "
                          + (f"{row['ms']:.3f} ms (rel. error {row['rel_error']:.1e})" if "ms" in row else row["error"]),
                          flush=True)
                    with open(out, "w") as f:
                        json.dump({"device": gpu, "dtype": str(dtype), "torch": torch.__version__, "rows": rows,
                                   "defaults": defaults(2 * D, D), "state_programs": default_programs,
                                   "min_segment": default_min_segment, "config": cfg},
                                  f, indent=1)
    finally:
        kernel._configs, kernel.STATE_PROGRAMS, kernel.FUSED_MAX_F = defaults, default_programs, fused_max_f
        kernel.MIN_SEGMENT = default_min_segment
    print(f"saved {out}")
    return rows


if __name__ == "__main__":
    cfg = configure({
        "shape": "1x12x64",  # B x H x D, Hedgehog's F = 2D
        "lengths": "4096,32768",
        "tiles": "32,64",  # BK and BV
        "warps": "4,8",
        "stages": "2",
        "programs": "1024,4096,16384",  # STATE_PROGRAMS of pass 1 and the fused pass
        "min_segments": "8,32,64",  # MIN_SEGMENT of the fused pass (longer walks, fewer launches; 64: 4K is one launch)
        "chunks": "32,64",  # the fused pass's chunk C (at 32 one value tile of 64 fits: the scores once, not twice)
        "repeats": 5,
        "out": "",  # default results/kernel_sweep_<gpu>.json
    })
    for key in ("lengths", "stages", "programs", "min_segments"):
        integers(cfg, key, 1)  # every list checked before any work
    for key, low in (("tiles", 16), ("chunks", 16), ("warps", 1)):  # Triton's: powers of two, tl.dot's tiles >= 16
        if any(x & (x - 1) for x in integers(cfg, key, low)):
            raise SystemExit(f"error: --{key}={cfg[key]!r} must list powers of two")
    if len(sizes(cfg, "shape", 3)) != 1:
        raise SystemExit(f"error: --shape={cfg['shape']!r}: one size B x H x D, e.g. 1x12x64")
    at_least(cfg, 1, "repeats")
    if cfg["out"]:  # else named after the GPU, in results/
        writable(cfg, "out")
    sweep(cfg)
