"""
The causal linear attention kernels checked against float64, then timed against softmax (Hedgehog Fig. 6:
one layer, 12 heads, head dim 64; a GPU runs Hedgehog's F = 128 in bf16, a CPU a smaller float32 case).

    python bench_kernel.py                              # check, then benchmark; results/kernel.json and .png
    python bench_kernel.py --lengths=1024,4096 --threads=2
    python bench_kernel.py --closed_form=true --threads=2   # the polynomial maps' closed form, results/closed_form.json

The check runs every backend that can run here (the PyTorch fallback; Triton on CUDA) against the O(T^2)
definition in float64, forward and gradients, float32 and bfloat16 inputs, and OAL's closed form
(squares): at one size of each on a CPU, at every build-checked shape on a GPU. The benchmark times
forward and forward+backward of causal SDPA (FlashAttention on a GPU), the quadratic linear form, the
chunked fallback and the Triton kernels, with peak memory on CUDA.

The device report against FlashAttention and fla on a GPU is report_kernel.py; the kernels' launch
settings are timed by sweep_kernel.py.
"""
import json
import os
import time

import torch
import torch.nn.functional as F

from configurator import at_least, configure, integers, pyplot, sizes, writable
from feature_maps import make_feature_map
from kernel import BUILD_DV, BUILD_F, BUILD_SQUARES, HAS_TRITON, INTERPRET, causal_linear_attention

# every size build_check.py compiles, as check takes them: [(F, Dv)], and for the closed form [(D, SQ, Dv)]
BUILD_SIZES = ([(F_, Dv) for F_ in BUILD_F for Dv in BUILD_DV], [(D, SQ, Dv) for D, SQ in BUILD_SQUARES for Dv in BUILD_DV])


def reference(qf, kf, v, eps=1e-6):
    """The definition, O(T^2): A = tril(qf kf^T), y = A v / (A 1 + eps). The oracle (in float64) and a benchmark entry."""
    A = (qf @ kf.transpose(-1, -2)).tril()  # (B, H, T, T)
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


def check(dev, shapes, squares=(), T=300):
    """Every backend against the float64 reference, forward and gradients. At each (F, Dv) of shapes, random
    positive features in float32 and in bfloat16 (rounded inputs; the reference sees the rounded values).
    At each (D, SQ, Dv) of squares, OAL's features and closed form (SQ - 1 groups, random, parameters moved),
    float32, gradients to q, k, v and L. Prints the worst relative error per backend and case; returns them.
    On CUDA a float32 tl.dot is TF32 (~1e-3); bfloat16 dots round their operands (~1e-2). A long check (every
    build-checked size, compiled on first use) says how far it has got every 10 s."""
    g = torch.Generator().manual_seed(0)
    backends = ["torch"] + (["triton"] if HAS_TRITON and (dev == "cuda" or INTERPRET) else [])
    worst = {}
    cases = [(dtype, F_, Dv, 0) for dtype in (torch.float32, torch.bfloat16) for F_, Dv in shapes] + \
        [(torch.float32, D, Dv, SQ) for D, SQ, Dv in squares]
    t0 = said = time.time()
    for i, (dtype, n, Dv, SQ) in enumerate(cases):
        if time.time() - said > 10:
            print(f"check: {i} of {len(cases)} sizes, {time.time() - t0:.0f} s", flush=True)
            said = time.time()
        v, dy = (torch.randn(1, 2, T, Dv, generator=g, dtype=torch.float64) for _ in range(2))
        if SQ:  # n = D
            fmap = make_feature_map("oal", n, 2, max_groups=SQ - 1).double()
            fmap.set_groups(torch.randint(0, SQ - 1, (2, n), generator=g))
            with torch.no_grad():
                fmap.L.add_(0.1 * torch.randn(fmap.L.shape, generator=g, dtype=torch.float64))
            q, k = (torch.randn(1, 2, T, n, generator=g, dtype=torch.float64) for _ in range(2))
            leaves = [q, k, v, fmap.L]
        else:  # n = F
            qf, kf = (torch.rand(1, 2, T, n, generator=g).to(dtype).double() for _ in range(2))
            v = v.to(dtype).double()
            leaves = [qf, kf, v]
        for x in leaves:
            x.requires_grad_()
        ref = reference(*fmap(q, k), v) if SQ else reference(qf, kf, v)
        refs = [ref.detach(), *torch.autograd.grad(ref, leaves, dy)]
        case = f"{str(dtype).removeprefix('torch.')}" + (", closed form" if SQ else "")
        for b in backends:
            if SQ:
                fmap32 = make_feature_map("oal", n, 2, max_groups=SQ - 1).to(dev)
                fmap32.load_state_dict(fmap.state_dict())  # float64 values into float32 parameters
                q32, k32, v32 = (x.detach().to(dev).float().requires_grad_() for x in (q, k, v))
                ins = [q32, k32, v32, fmap32.L]
                y = causal_linear_attention(*fmap32(q32, k32), v32, backend=b, squares=fmap32.squares(q32, k32))
            else:
                ins = [x.detach().to(dev).to(dtype).requires_grad_() for x in leaves]
                y = causal_linear_attention(*ins, backend=b)
            got = [y, *torch.autograd.grad(y, ins, dy.to(dev).to(y.dtype))]
            err = max(((x.double().cpu() - r).norm() / r.norm()).item() for x, r in zip(got, refs))
            worst[f"{b}, {case}"] = max(worst.get(f"{b}, {case}", 0.0), err)
    for key, err in worst.items():
        print(f"check {key}: max relative error of y and the gradients against float64 = {err:.2e}")
    if "triton" not in backends:
        print("triton: not run (needs a CUDA GPU; TRITON_INTERPRET=1 only checks correctness, slowly)")
    return worst


def flash(q, k, v):
    """Causal softmax attention by SDPA: restricted to FlashAttention on CUDA, SDPA's choice on a CPU."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _time(fn, repeats):
    """Best of `repeats` wall-clock seconds after one warm-up call (of one call, when that took over 1 s)."""
    times = []
    for _ in range(1 + repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if times[0] > 1.0 and len(times) == 2:
            break
    return min(times[1:])


def benchmark(heads, dim, features, lengths, threads, repeats, quadratic_max, out):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        torch.set_num_threads(threads)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if dev == "cuda":
        check(dev, *BUILD_SIZES)
    else:
        check(dev, [(features, dim)], [(8, 6, dim)])

    methods = {"softmax (sdpa)": flash, "linear, quadratic form": reference,
               "linear, torch chunked": lambda q, k, v: causal_linear_attention(q, k, v, backend="torch")}
    if dev == "cuda" and HAS_TRITON:
        methods["linear, triton"] = lambda q, k, v: causal_linear_attention(q, k, v, backend="triton")
    rows = []
    print(f"\ndevice {torch.cuda.get_device_name() if dev == 'cuda' else f'cpu, threads: {threads}'}, batch 1, {heads} heads, "
          f"head dim {dim}; linear: F = {features} features, Dv = {dim} (the inputs stand for features), {dtype}")
    print(f"{'method':<24} {'T':>6} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak MiB':>9}")
    for T in lengths:
        # exp-like positive features so that the normalisation is well conditioned
        q, k = (torch.rand(1, heads, T, dim, device=dev, dtype=dtype) for _ in range(2))
        qf, kf = (torch.rand(1, heads, T, features, device=dev, dtype=dtype) for _ in range(2))
        v = torch.randn(1, heads, T, dim, device=dev, dtype=dtype)
        for name, fn in methods.items():
            if name.startswith("linear, quadratic") and T > quadratic_max:
                continue  # T x T weights per head: out of memory beyond this
            ins = [x.detach().requires_grad_() for x in ((q, k, v) if name.startswith("softmax") else (qf, kf, v))]
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                fwd = _time(lambda: fn(*ins), repeats)
            both = _time(lambda: fn(*ins).sum().backward(), repeats)
            peak = torch.cuda.max_memory_allocated() / 2 ** 20 if dev == "cuda" else None
            rows.append({"method": name, "T": T, "fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3, "peak_mib": peak})
            print(f"{name:<24} {T:>6} {fwd * 1e3:>9.2f} {both * 1e3:>11.2f} {'n/a' if peak is None else f'{peak:.0f}':>9}", flush=True)
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "threads": threads, "heads": heads,
              "dim": dim, "features": features, "dtype": str(dtype), "torch": torch.__version__, "rows": rows}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {out}")
    plot(rows, os.path.splitext(out)[0] + ".png")


def closed_form(cfg):
    """What the polynomial maps' closed form (FeatureMap.squares) buys here, forward + backward: the O(T^2)
    kernel matrix (fmap.scores, used by the distillation losses) from the closed form against the product
    of the features, and the chunked fallback with squares against without, at each B x H x T x D of
    closed_form_shapes (default: convert.py's GPT, 16 x 4 x 128 x 32, and Fig. 6's 12 heads of 64 at 2048 tokens)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        torch.set_num_threads(cfg["threads"])
    rows = []
    print(f"{'map':<10} {'B x H x T x D':>16} {'what':<28} {'features ms':>12} {'closed form ms':>15}")
    for name in ("taylor", "quadratic", "oal"):
        shapes = sizes(cfg, "closed_form_shapes", 4)
        for (B, H, T, D), what in [(shapes[0], "scores")] + [(shape, "chunked attention") for shape in shapes]:
            torch.manual_seed(0)
            fmap = make_feature_map(name, D, H).to(dev)
            if name == "oal":
                fmap.set_groups(torch.randint(0, fmap.G, (H, D)))
            q, k, v = (torch.randn(B, H, T, D, device=dev, requires_grad=True) for _ in range(3))

            def run(sq):
                if what == "scores" and sq:
                    return fmap.scores(q, k).sum().backward()
                qf, kf = fmap(q, k)
                if what == "scores":
                    return (qf @ kf.transpose(-1, -2)).sum().backward()
                causal_linear_attention(qf, kf, v, backend="torch", squares=fmap.squares(q, k) if sq else None).sum().backward()
            times = [_time(lambda: run(sq), cfg["repeats"]) * 1e3 for sq in (False, True)]
            rows.append(dict(map=name, B=B, H=H, T=T, D=D, what=what, features_ms=times[0], closed_form_ms=times[1]))
            print(f"{name:<10} {f'{B}x{H}x{T}x{D}':>16} {what:<28} {times[0]:>12.1f} {times[1]:>15.1f}", flush=True)
    out = "results/closed_form.json"
    os.makedirs("results", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else f"cpu ({cfg['threads']} threads)",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"saved {out}")


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == name]
        axes[0].loglog([r["T"] for r in rs], [r["fwd_bwd_ms"] for r in rs], "o-", label=name)
        if rs[0]["peak_mib"] is not None:
            axes[1].loglog([r["T"] for r in rs], [r["peak_mib"] for r in rs], "o-", label=name)
    axes[0].set(xlabel="sequence length", ylabel="forward+backward ms", title="time (cf. Hedgehog Fig. 6)")
    axes[1].set(xlabel="sequence length", ylabel="peak MiB", title="memory (CUDA only)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


if __name__ == "__main__":
    gpu = torch.cuda.is_available()
    cfg = configure({
        "heads": 12 if gpu else 4,  # the paper's 12 heads on a GPU; B*H = 4 keeps the CPU run under 2 minutes
        "dim": 64,  # head dim: softmax's q, k, v and linear attention's v
        "features": 128 if gpu else 64,  # F of linear attention's qf, kf: Hedgehog's is 2 x head dim
        "lengths": "1024,2048,4096,8192,16384,32768" if gpu else "1024,4096,16384",
        "threads": 1,  # CPU threads (one, as the targets in the README are stated)
        "repeats": 5,
        "quadratic_max": 16384 if gpu else 4096,  # longest T for the O(T^2) linear form
        "out": "results/kernel.json",
        "closed_form": False,  # the polynomial maps' closed form against their features instead (see closed_form)
        "closed_form_shapes": "16x4x128x32,1x12x2048x64",  # closed_form: B x H x T x D (scores timed at the first)
    })
    at_least(cfg, 1, "heads", "dim", "features", "threads", "repeats")
    writable(cfg, "out")
    sizes(cfg, "closed_form_shapes", 4)  # every list is checked here, before any work, whichever mode uses it
    integers(cfg, "lengths", 1)
    if cfg["closed_form"]:
        closed_form(cfg)
    else:
        benchmark(cfg["heads"], cfg["dim"], cfg["features"], integers(cfg, "lengths", 1), cfg["threads"],
                  cfg["repeats"], cfg["quadratic_max"], cfg["out"])
