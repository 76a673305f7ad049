"""
The causal linear attention kernels checked against float64, then timed against softmax (Hedgehog Fig. 6:
one layer, 12 heads, head dim 64; a GPU runs Hedgehog's F = 128 in bf16, a CPU a smaller float32 case).

    python bench_kernel.py                              # check, then benchmark; results/kernel.json and .png
    python bench_kernel.py --lengths=1024,4096 --threads=2

The check runs every backend that can run here (the PyTorch fallback; Triton on CUDA) against the O(T^2)
definition in float64, forward and gradients: at one (F, Dv) on a CPU, at every build-checked shape on a
GPU. The benchmark times forward and forward+backward of causal SDPA (FlashAttention on a GPU), the
quadratic linear form, the chunked fallback and the Triton kernels, with peak memory on CUDA.
"""
import json
import os
import time

import torch
import torch.nn.functional as F

from configurator import at_least, configure, integers, pyplot
from kernel import BUILD_DV, BUILD_F, HAS_TRITON, INTERPRET, causal_linear_attention


def reference(qf, kf, v, eps=1e-6):
    """The definition, O(T^2): A = tril(qf kf^T), y = A v / (A 1 + eps). The oracle (in float64) and a benchmark entry."""
    A = (qf @ kf.transpose(-1, -2)).tril()  # (B, H, T, T)
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


def check(dev, shapes, T=300):
    """Every backend against the float64 reference, forward and gradients, at each (F, Dv) of shapes.
    Prints the worst relative error per backend; returns it. On CUDA an fp32 tl.dot is TF32 (~1e-3)."""
    g = torch.Generator().manual_seed(0)
    backends = ["torch"] + (["triton"] if HAS_TRITON and (dev == "cuda" or INTERPRET) else [])
    worst = {b: 0.0 for b in backends}
    for F_, Dv in shapes:
        qf, kf = (torch.rand(1, 2, T, F_, generator=g, dtype=torch.float64) for _ in range(2))
        v, dy = (torch.randn(1, 2, T, Dv, generator=g, dtype=torch.float64) for _ in range(2))
        ref_in = [x.requires_grad_() for x in (qf, kf, v)]
        ref = reference(*ref_in)
        refs = [ref.detach(), *torch.autograd.grad(ref, ref_in, dy)]
        for b in backends:
            ins = [x.detach().to(dev).float().requires_grad_() for x in (qf, kf, v)]
            y = causal_linear_attention(*ins, backend=b)
            got = [y, *torch.autograd.grad(y, ins, dy.to(dev).float())]
            err = max(((x.double().cpu() - r).norm() / r.norm()).item() for x, r in zip(got, refs))
            worst[b] = max(worst[b], err)
    for b, err in worst.items():
        print(f"check {b}: max relative error of y, dqf, dkf, dv against float64 over {len(shapes)} shapes = {err:.2e}")
    if "triton" not in backends:
        print("triton: not run (needs a CUDA GPU; TRITON_INTERPRET=1 only checks correctness, slowly)")
    return worst


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
    check(dev, [(F_, Dv) for F_ in BUILD_F for Dv in BUILD_DV] if dev == "cuda" else [(features, dim)])

    def sdpa(q, k, v):
        if dev != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    methods = {"softmax (sdpa)": sdpa, "linear, quadratic form": reference,
               "linear, torch chunked": lambda q, k, v: causal_linear_attention(q, k, v, backend="torch")}
    if dev == "cuda" and HAS_TRITON:
        methods["linear, triton"] = lambda q, k, v: causal_linear_attention(q, k, v, backend="triton")
    rows = []
    print(f"\ndevice {torch.cuda.get_device_name() if dev == 'cuda' else f'cpu ({threads} thread)'}, batch 1, {heads} heads, "
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
    plot(rows, out.replace(".json", ".png"))


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
    })
    at_least(cfg, 1, "heads", "dim", "features", "threads", "repeats")
    benchmark(cfg["heads"], cfg["dim"], cfg["features"], integers(cfg, "lengths", 1), cfg["threads"],
              cfg["repeats"], cfg["quadratic_max"], cfg["out"])
