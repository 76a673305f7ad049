"""
The device report, the one script for a GPU session (Hedgehog Fig. 6; OAL Sec. 4.4): our causal linear
attention kernels checked against float64, then timed against FlashAttention and against
flash-linear-attention's chunk kernel, at the paper's shape and at fla's, for each map family.

    python report_kernel.py                              # on a GPU: results/kernel_<gpu>.json and .png
    python report_kernel.py --check=timed --shapes=1x12x64 --families=hedgehog,elu --out=results/part.json

It takes several minutes; --shapes and --families split it into parts, and it saves after every row, so a
run stopped by a time limit keeps its rows. First the check (bench_kernel.check) at every build-checked
shape (--check=timed: only at the sizes timed, fewer kernels to compile). Then forward and forward+backward
times at 1K-32K tokens of our kernels against FlashAttention (SDPA restricted to it) and against
flash-linear-attention's chunk_linear_attn (fla, imported only here; normalize=True, its normalisation a
separate pass, timed as it is), for the shapes B x H x D of `shapes` (Hedgehog Fig. 6: 1 x 12 x 64; fla's
benchmarks: 8 x 32 x 128) and each map family's feature size: Hedgehog F = 2D, 1+ELU F = D, Taylor and OAL
F = 1 + D + D(D+1)/2, these two with their closed form in-tile (SQ = 2 and 6 terms; "ours_features" times
the same without it). Sizes whose inputs and states would pass max_gib, or that are not build-checked, are
recorded as skipped; a peer that refuses a size (fla's chunk kernel at F = 2145) is recorded with its error.
On a GPU each row also has the time of our pass 1 alone (the chunk states, pass 2 the remainder; where the
forward is fused, the segments' sums before the fused kernel), the unfused forward beside a fused one, and
the forwards of FlashAttention, ours and fla replayed from a CUDA graph (the GPU's time without the CPU's
kernel launches, which decide short sequences at batch 1). The forwards run under torch.no_grad, as
inference does. Writes the rows, and per shape and family the crossover length against FlashAttention
(eager and from CUDA graphs) and the speed-up at the longest length, with the distance to the memory bound.
On a CPU it runs the same bookkeeping with SDPA and the PyTorch fallback, or with TRITON_INTERPRET=1 set
the Triton kernels in Triton's interpreter (the tests do both, at tiny sizes). The kernels' launch settings
are timed by sweep_kernel.py.
"""
import json
import os
import time

import torch

import kernel
from bench_kernel import BUILD_SIZES, _time, check, flash
from configurator import at_least, choices, configure, integers, one_of, positive, pyplot, sizes, writable
from kernel import BUILD_DV, BUILD_F, BUILD_SQUARES, HAS_TRITON, INTERPRET, causal_linear_attention, triton_covered


# map family -> (F at head dim D, SQ): the polynomial families run with their closed form (squares) in-tile
FAMILIES = {"hedgehog": (lambda D: 2 * D, 0), "elu": (lambda D: D, 0),
            "taylor": (lambda D: 1 + D + D * (D + 1) // 2, 2), "oal": (lambda D: 1 + D + D * (D + 1) // 2, 6)}
PEAK_TBS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),  # memory bandwidth by GPU name
            ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555))  # (NVIDIA's data sheets)


def peak_bandwidth(cfg, gpu):
    """TB/s for the memory bound: --bandwidth_tbs, else the first entry of PEAK_TBS in the GPU's name; None
    (no bound) when neither says."""
    return cfg["bandwidth_tbs"] or next((tbs for name, tbs in PEAK_TBS if name in gpu), None)


def fla_linear_attention():
    """flash-linear-attention's chunk_linear_attn, or None when fla is not installed."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    return chunk_linear_attn


def _one_line(e):
    """An exception as one short line: a row records why a method did not run there."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _device():
    """("cuda" or "cpu", the GPU's name or "cpu", the dtype timed there: bfloat16 on a GPU, else float32)."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(), torch.bfloat16
    return "cpu", "cpu", torch.float32


def gpu_file_name(gpu):
    """The GPU's name as a file name: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3" (report_gpu.sh too)."""
    return "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_")


def _out_path(given, stem, gpu):
    """given, or results/<stem>_<gpu_file_name(gpu)>.json; its folder is made."""
    out = given or f"results/{stem}_{gpu_file_name(gpu)}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    return out


def _time_methods(row, methods, repeats):
    """Each method's forward (under no_grad) and forward+backward, into row as name_fwd_ms, name_fwd_bwd_ms.
    methods: name -> (fn, args). One that raises (a peer's kernel may refuse a size: fla at F = 2145) is
    recorded as name_error, said, and dropped from methods."""
    for name, (fn, args) in list(methods.items()):
        ins = [x.detach().requires_grad_() for x in args]
        try:
            with torch.no_grad():
                fwd = _time(lambda: fn(*ins), repeats)
            both = _time(lambda: fn(*ins).sum().backward(), repeats)
        except Exception as e:
            row[f"{name}_error"] = _one_line(e)
            print(f"{row['shape']} {row['family']:<8} T={row['T']:<6} {name}: {row[f'{name}_error']}")
            del methods[name]
            continue
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = fwd * 1e3, both * 1e3


def _graph_time(fn, args, repeats):
    """Best of `repeats` replays of fn(*args), forward only, captured in a CUDA graph: the GPU's time
    without the CPU's kernel launches (what torch.compile(mode="reduce-overhead") gives a model). fn has
    run before (compiled, autotuned); one more call on a side stream precedes the capture, as
    torch.cuda.graph asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        fn(*args)
    return _time(graph.replay, repeats)


def check_sizes(cfg):
    """The sizes the check covers on a GPU, as bench_kernel.check takes them: [(F, Dv)] and, for the closed
    form, [(D, SQ, Dv)]. Every build-checked one (--check=all), or those of the sizes timed (--check=timed:
    fewer kernels to compile)."""
    if cfg["check"] == "all":
        return BUILD_SIZES
    dims = sorted({D for _, _, D in sizes(cfg, "shapes", 3)})
    fams = [FAMILIES[f] for f in choices(cfg, "families", FAMILIES)]
    return (list(dict.fromkeys((f(D), D) for D in dims for f, _ in fams if f(D) in BUILD_F and D in BUILD_DV)),
            [(D, SQ, D) for D in dims for _, SQ in fams if SQ and (D, SQ) in BUILD_SQUARES])


def device_report(cfg):
    """Check against float64, then time ours, FlashAttention and fla; the rows, saved after each one."""
    dev, gpu, dtype = _device()
    out = _out_path(cfg["out"], "kernel", gpu)
    t0 = time.time()
    worst = check(dev, *check_sizes(cfg)) if dev == "cuda" else check(dev, [(16, 8)], [(8, 6, 8)])
    check_s = time.time() - t0  # on a GPU mostly Triton compiling each shape's kernels
    print(f"check: {check_s:.0f} s")
    fla = fla_linear_attention()  # its Triton kernels want CUDA: on a CPU it is timed as an error, if installed
    if dev == "cuda" and fla is None:
        print("fla: not installed (pip install flash-linear-attention fla-core); timing ours and FlashAttention only")
    ours = "triton" if HAS_TRITON and (dev == "cuda" or INTERPRET) else "torch"  # as the check runs them
    tbs = peak_bandwidth(cfg, gpu)
    print(f"memory bound at {tbs} TB/s" if tbs else f"no memory bound: give --bandwidth_tbs (TB/s) for {gpu}")

    rows = []

    def save(row):  # after every row, so that a run stopped by a time limit keeps what it measured
        rows.append(row)
        with open(out, "w") as f:
            json.dump({"device": gpu, "bandwidth_tbs": tbs, "dtype": str(dtype), "torch": torch.__version__,
                       "check_max_rel_error": worst, "check_seconds": check_s, "ours": ours, "fla": fla is not None,
                       "crossovers": crossovers(rows), "rows": rows, "config": cfg}, f, indent=1)

    for B, H, D in sizes(cfg, "shapes", 3):
        shape = f"{B}x{H}x{D}"
        for family in choices(cfg, "families", FAMILIES):
            F_, SQ = FAMILIES[family][0](D), FAMILIES[family][1]
            if fla is not None and dev == "cuda":  # progress: the first row takes minutes
                print(f"{shape} {family}: fla autotunes on its first call at these sizes (about 45 s a direction)", flush=True)
            for T in integers(cfg, "lengths", 1):
                row = dict(shape=shape, B=B, H=H, D=D, family=family, F=F_, SQ=SQ, T=T)
                gib = (2 * B * H * T * F_ * 2 + B * H * -(-T // 64) * F_ * D * 2 * 2) / 2 ** 30  # bf16 features, states (x2 backward)
                if gib > cfg["max_gib"] or (ours == "triton" and not triton_covered(F_, D, D, SQ)):
                    save(dict(row, skipped=f"{gib:.3g} GiB > max_gib" if gib > cfg["max_gib"] else "not build-checked"))
                    print(f"{shape} {family:<8} T={T:<6} skipped: {rows[-1]['skipped']}")
                    continue
                q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype) for _ in range(3))
                qf, kf = (torch.rand(B, H, T, F_, device=dev, dtype=dtype) for _ in range(2))
                methods = {"flash": (flash, (q, k, v)),
                           "ours": (lambda a, b, c: causal_linear_attention(a, b, c, backend=ours), (qf, kf, v))}
                if SQ:  # timing only: the closed form's values need not match the random features here
                    closed = (q, k, torch.rand(H, SQ, D, device=dev) / D, torch.rand(H, SQ, device=dev), torch.zeros(H, device=dev))
                    methods["ours_features"] = methods["ours"]
                    methods["ours"] = (lambda a, b, c: causal_linear_attention(a, b, c, backend=ours, squares=closed), (qf, kf, v))
                if fla is not None:  # fla wants (B, T, H, K)
                    methods["fla"] = (lambda a, b, c: fla(a, b, c, scale=1.0, normalize=True)[0],
                                      tuple(x.transpose(1, 2).contiguous() for x in (qf, kf, v)))
                _time_methods(row, methods, cfg["repeats"])
                if "ours_fwd_ms" not in row or "flash_fwd_ms" not in row:
                    save(row)
                    continue
                row["speedup_vs_flash_fwd"] = row["flash_fwd_ms"] / row["ours_fwd_ms"]
                if dev == "cuda":  # the forward without launch overhead: where short sequences stand on the GPU alone
                    for name in [m for m in ("flash", "ours", "fla") if m in methods]:
                        try:
                            row[f"{name}_graph_fwd_ms"] = _graph_time(*methods[name], cfg["repeats"]) * 1e3
                        except Exception as e:
                            row[f"{name}_graph_error"] = _one_line(e)
                    if "ours_graph_fwd_ms" in row and "flash_graph_fwd_ms" in row:
                        row["graph_speedup_vs_flash_fwd"] = row["flash_graph_fwd_ms"] / row["ours_graph_fwd_ms"]
                if ours == "triton":  # where the forward's time goes: pass 1 (the chunk states), pass 2
                    row.update(_passes(qf, kf, v, methods["ours"], cfg["repeats"], closed_form=SQ > 0))
                if tbs:
                    io = B * H * T * (2 * F_ + 2 * D) * q.element_size()  # qf, kf, v in; y out (v's dtype, no_grad)
                    row["memory_bound_ms"] = io / (tbs * 1e12) * 1e3  # reading and writing them once
                    row["ours_vs_memory_bound"] = row["ours_fwd_ms"] / row["memory_bound_ms"]
                if "fla_fwd_ms" in row:
                    row["ours_vs_fla_fwd"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
                save(row)
                print(f"{shape} {family:<8} T={T:<6} F={F_:<5} " + "  ".join(
                    f"{m} {row[m + '_fwd_ms']:.3f} / {row[m + '_fwd_bwd_ms']:.3f} ms" for m in methods)
                    + (f"  (ours: pass 1 {row['ours_pass1_ms']:.3f} ms)" if "ours_pass1_ms" in row else "")
                    + (f"  (ours unfused {row['ours_unfused_fwd_ms']:.3f} ms)" if "ours_unfused_fwd_ms" in row else "")
                    + "".join(f"  {m} graphed {row[m + '_graph_fwd_ms']:.3f}" for m in methods if m + "_graph_fwd_ms" in row), flush=True)
    for name, entry in crossovers(rows).items():
        print(f"{name}: crossover at {entry.get('crossover_T')} tokens (CUDA graphs: {entry.get('graph_crossover_T')}), "
              f"{entry['speedup_at_longest']:.1f}x FlashAttention at {entry['longest_T']}")
    print(f"saved {out}")
    plot_report(rows, os.path.splitext(out)[0] + ".png")
    return rows


def _passes(qf, kf, v, ours, repeats, closed_form=False):
    """Where our Triton forward's time goes (B, H, T, . inputs; ours: the timed forward, (fn, args)):
    pass 1 alone, the chunk states, or where the forward is fused (bf16, F <= kernel.FUSED_MAX_F, no
    closed form), what comes before the fused kernel, the segments' sums; and for a fused forward, the
    same forward unfused (pass 1 then pass 2), to compare the two designs."""
    B, H, T, F_ = qf.shape
    k, v3 = (x.reshape(B * H, T, -1) for x in (kf, v))
    out = {}
    fused_max_f = kernel.FUSED_MAX_F
    if kernel._is_fused(F_, qf.dtype, closed_form):
        C, L, NS, _ = kernel._fused_segments(B * H, T, F_, v.shape[-1])
        out["ours_pass1_ms"] = _time(lambda: kernel._segment_sums(k, v3, None, L, NS, False, C), repeats) * 1e3
        try:
            kernel.FUSED_MAX_F = 0
            with torch.no_grad():  # as the forward above was timed
                out["ours_unfused_fwd_ms"] = _time(lambda: ours[0](*ours[1]), repeats) * 1e3
        finally:
            kernel.FUSED_MAX_F = fused_max_f
    else:
        out["ours_pass1_ms"] = _time(lambda: kernel._states(k, v3, None, False), repeats) * 1e3
    return out


def crossovers(rows):
    """Per shape and family of the report's rows: crossover_T, the shortest length from which our forward
    is at least as fast as FlashAttention's at every length timed above it (None if none is), the same
    from the CUDA-graph timings (graph_crossover_T, where they ran), and the speed-up at the longest
    length. The paper's Fig. 6: a crossover near 2K and about 6x at 32K."""
    out = {}
    for shape, family in dict.fromkeys((r["shape"], r["family"]) for r in rows):
        rs = sorted((r for r in rows if (r["shape"], r["family"]) == (shape, family) and "speedup_vs_flash_fwd" in r),
                    key=lambda r: r["T"])
        if not rs:
            continue
        entry = {}
        for name, field in (("crossover_T", "speedup_vs_flash_fwd"), ("graph_crossover_T", "graph_speedup_vs_flash_fwd")):
            timed = [r for r in rs if field in r]
            if timed:
                entry[name] = next((r["T"] for i, r in enumerate(timed) if all(x[field] >= 1 for x in timed[i:])), None)
        entry.update(longest_T=rs[-1]["T"], speedup_at_longest=rs[-1]["speedup_vs_flash_fwd"])
        out[f"{shape} {family}"] = entry
    return out


def plot_report(rows, path):
    """Forward time against tokens, a panel per shape: FlashAttention, and per family ours (with the closed
    form where there is one, and without it) and fla, each line drawn through the rows where that method ran."""
    plt = pyplot()
    if plt is None:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        here = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["T"])
        flash = {}  # T -> FlashAttention's time, as first timed (each family's rows time it again)
        for r in here:
            if "flash_fwd_ms" in r:
                flash.setdefault(r["T"], r["flash_fwd_ms"])
        ax.loglog(list(flash), list(flash.values()), "k-o", label="FlashAttention")
        for family in dict.fromkeys(r["family"] for r in here):
            for key, style, name in (("ours", "o-", "ours"), ("ours_features", ":", "ours, scores from features"),
                                     ("fla", "x--", "fla")):
                rs = [r for r in here if r["family"] == family and f"{key}_fwd_ms" in r]
                if rs:
                    ax.loglog([r["T"] for r in rs], [r[f"{key}_fwd_ms"] for r in rs], style,
                              label=f"{name}, {family} (F={rs[0]['F']})")
        ax.set(xlabel="tokens", ylabel="forward ms", title=f"B x H x D = {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


if __name__ == "__main__":
    cfg = configure({
        "shapes": "1x12x64,8x32x128",  # B x H x D
        "families": "hedgehog,elu,taylor,oal",  # feature sizes 2D, D, 1 + D + D(D+1)/2 (the last two in-tile)
        "lengths": "1024,2048,4096,8192,16384,32768" if torch.cuda.is_available() else "1024,4096",  # tokens
        "repeats": 5,
        "max_gib": 40.0,  # skip sizes whose features and states would take more
        "check": "all",  # float64 check at every build-checked shape ("all") or at the timed sizes only ("timed")
        "bandwidth_tbs": 0.0,  # the GPU's memory bandwidth in TB/s for the memory bound; 0: from PEAK_TBS
        "out": "",  # default results/kernel_<gpu>.json
    })
    at_least(cfg, 1, "repeats")
    positive(cfg, "max_gib")
    at_least(cfg, 0, "bandwidth_tbs")
    if cfg["out"]:  # else named after the GPU, in results/
        writable(cfg, "out")
    one_of(cfg, "check", ("all", "timed"))
    choices(cfg, "families", FAMILIES)
    sizes(cfg, "shapes", 3)
    integers(cfg, "lengths", 1)
    device_report(cfg)
