"""
Causal linear attention, fast: a Triton kernel (forward and backward) and a chunked PyTorch fallback.

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j)

(Hedgehog Sec. 2, OAL Sec. 2 and 4.4.) Public entry point:

    causal_linear_attention(qf, kf, v, eps=1e-6, backend="auto")
        qf, kf: (B, H, T, F) features, v: (B, H, T, Dv) -> y: (B, H, T, Dv) in v's dtype, differentiable.
        backend "torch": the chunked fallback; "triton": the kernel; "auto": Triton on CUDA tensors
        (or on CPU tensors when TRITON_INTERPRET=1 was set before import), else the fallback.

Everything is built from one primitive, an unnormalised causal "dot" over time,

    causal_dot(a, b, c)_i = sum_{j<=i} (a_i . b_j) c_j          (reverse=True: sum over j >= i),

computed in chunks of C tokens: within a chunk, the masked quadratic form (a b^T * mask) c; across
chunks, a running state sum_j b_j c_j^T of size K x Dc, kept in float32.
- Forward: the denominator is one more value column: causal_dot(qf, kf, [v, 1]) gives [num, den].
- Backward: with do = [dy / den, -(dy . y) / den] (the gradient with respect to [num, den]), the
  three gradients are three more causal dots:
      dqf_i = sum_{j<=i} (do_i . [v, 1]_j) kf_j        causal_dot(do, [v, 1], kf)
      dkf_j = sum_{i>=j} ([v, 1]_j . do_i) qf_i        causal_dot([v, 1], do, qf, reverse=True)
      dv_j  = sum_{i>=j} (kf_j . qf_i) dnum_i          causal_dot(kf, qf, dnum, reverse=True)
So the Triton kernel and the PyTorch fallback each implement causal_dot once, and one
autograd.Function uses either. The recurrent (one token at a time) form is
attention.linear_attention_step; tests check it equals this parallel form.

Where this was tested: the Triton kernel was checked against a float64 reference in the Triton CPU
interpreter (TRITON_INTERPRET=1, triton 3.9, float32/bfloat16/float16 inputs, float32 arithmetic).
It has not been compiled or timed on a GPU in this repository yet; on NVIDIA GPUs an fp32 tl.dot
uses TF32 (about 1e-3 relative error). `python kernel.py` checks correctness, then benchmarks.
"""
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import, so read it here too

# ----------------------------------------------------------------------------------------------
# PyTorch fallback: the chunked form


def causal_dot_torch(a, b, c, reverse=False, chunk=None):
    """out_i = sum_{j<=i} (a_i . b_j) c_j (j >= i if reverse), chunked.

    a, b: (B, H, T, K), c: (B, H, T, Dc) -> (B, H, T, Dc) in float32 (float64 stays float64).
    Memory is linear in T: T/C chunk states of K x Dc and T/C blocks of C x C.
    Per token the work is C (K + Dc) multiply-adds within the chunk plus 2 K Dc for the state, so
    the default chunk balances the two: C = 2 K Dc / (K + Dc), as a power of 2 in [16, 128]
    (64 at K = Dc = 64; by measurement on CPU, 32 and 128 are 10-30% slower there).
    """
    B, H, T, K = a.shape
    if chunk is None:
        Dc = c.shape[-1]
        chunk = min(128, max(16, 2 ** round(math.log2(2 * K * Dc / (K + Dc)))))
    dtype = torch.promote_types(c.dtype, torch.float32)
    pad = (-T) % chunk  # zero rows at the end add nothing to the sums
    if pad:
        a, b, c = (F.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.to(dtype).unflatten(2, (-1, chunk)).flatten(0, 2) for x in (a, b, c))  # (B*H*N, C, .)
    scores = a @ b.transpose(-1, -2)  # (B*H*N, C, C), within each chunk
    scores = scores.triu_() if reverse else scores.tril_()
    kv = (b.transpose(-1, -2) @ c).unflatten(0, (B * H, -1))  # (B*H, N, K, Dc): each chunk's sum_j b_j c_j^T
    N = kv.shape[1]
    order = list(reversed(range(N))) if reverse else list(range(N))
    state = torch.empty_like(kv)  # state[:, n] = sum of kv over the chunks before n (after n, if reverse)
    state[:, order[0]] = 0
    for prev, n in zip(order, order[1:]):
        torch.add(state[:, prev], kv[:, prev], out=state[:, n])
    out = torch.baddbmm(scores @ c, a, state.flatten(0, 1))  # intra-chunk + a @ state, (B*H*N, C, Dc)
    return out.view(B, H, -1, c.shape[-1])[:, :, :T]


# ----------------------------------------------------------------------------------------------
# Triton kernel: the same chunked algorithm, one program per (K tile, Dc tile, batch*head)

if HAS_TRITON:

    @triton.jit
    def _causal_dot_kernel(a_ptr, b_ptr, c_ptr, out_ptr, T, K, DC, BH,
                           CHUNK: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, REVERSE: tl.constexpr):
        # Program (i_k, i_c, i_bh) owns columns [i_k*BK, +BK) of a, b and [i_c*BC, +BC) of c and out.
        # It walks the chunks in order (backwards if REVERSE) with its slice of the state in registers:
        #     out_chunk = (a b^T * mask) c + a S;   S += b^T c.
        # Slices of the K dimension add up, so each writes a partial output; the launcher sums them.
        i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rk = i_k * BK + tl.arange(0, BK)
        rc = i_c * BC + tl.arange(0, BC)
        rt = tl.arange(0, CHUNK)
        a_ptr += i_bh * T * K
        b_ptr += i_bh * T * K
        c_ptr += i_bh * T * DC
        out_ptr += (i_k * BH + i_bh) * T * DC
        if REVERSE:
            mask = rt[:, None] <= rt[None, :]  # token i sees j >= i
        else:
            mask = rt[:, None] >= rt[None, :]  # token i sees j <= i
        state = tl.zeros((BK, BC), dtype=tl.float32)
        num_chunks = tl.cdiv(T, CHUNK)
        for it in range(0, num_chunks):
            if REVERSE:
                n = num_chunks - 1 - it
            else:
                n = it
            t = n * CHUNK + rt
            in_k = (t[:, None] < T) & (rk[None, :] < K)
            in_c = (t[:, None] < T) & (rc[None, :] < DC)
            a = tl.load(a_ptr + t[:, None] * K + rk[None, :], mask=in_k, other=0.0).to(tl.float32)  # (CHUNK, BK)
            b = tl.load(b_ptr + t[:, None] * K + rk[None, :], mask=in_k, other=0.0).to(tl.float32)  # (CHUNK, BK)
            c = tl.load(c_ptr + t[:, None] * DC + rc[None, :], mask=in_c, other=0.0).to(tl.float32)  # (CHUNK, BC)
            scores = tl.where(mask, tl.dot(a, tl.trans(b)), 0.0)  # (CHUNK, CHUNK)
            out = tl.dot(scores, c) + tl.dot(a, state)  # (CHUNK, BC)
            tl.store(out_ptr + t[:, None] * DC + rc[None, :], out, mask=in_c)
            state += tl.dot(tl.trans(b), c)  # (BK, BC), float32 across chunks


def causal_dot_triton(a, b, c, reverse=False, chunk=64):
    """Same contract as causal_dot_torch, computed by _causal_dot_kernel. Returns float32."""
    B, H, T, K = a.shape
    DC = c.shape[-1]
    BK = min(128, max(16, triton.next_power_of_2(K)))  # tl.dot needs tiles of at least 16
    BC = min(128, max(16, triton.next_power_of_2(DC)))
    nk, nc = triton.cdiv(K, BK), triton.cdiv(DC, BC)
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    out = torch.empty(nk, B * H, T, DC, device=c.device, dtype=torch.float32)
    _causal_dot_kernel[(nk, nc, B * H)](a, b, c, out, T, K, DC, B * H, CHUNK=chunk, BK=BK, BC=BC,
                                        REVERSE=reverse, num_warps=8 if BK * BC >= 8192 else 4)
    out = out[0] if nk == 1 else out.sum(0)
    return out.view(B, H, T, DC)


# ----------------------------------------------------------------------------------------------
# the differentiable, normalised attention


class _CausalLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qf, kf, v, eps, backend):
        dot = causal_dot_triton if backend == "triton" else causal_dot_torch
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, Dv+1): last column = denominator
        out = dot(qf, kf, v1)
        den = out[..., -1:] + eps  # (B, H, T, 1) = qf_i . z_i + eps
        y = out[..., :-1] / den  # (B, H, T, Dv)
        ctx.save_for_backward(qf, kf, v, y, den)
        ctx.dot = dot
        return y.to(v.dtype)

    @staticmethod
    def backward(ctx, dy):
        qf, kf, v, y, den = ctx.saved_tensors
        dot = ctx.dot
        dnum = dy.to(y.dtype) / den  # dL/dnum, (B, H, T, Dv)
        dden = -(dnum * y).sum(-1, keepdim=True)  # dL/dden = -(dy . y) / den, (B, H, T, 1)
        do = torch.cat([dnum, dden], dim=-1)  # (B, H, T, Dv+1)
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        dqf = dot(do, v1, kf)
        dkf = dot(v1, do, qf, reverse=True)
        dv = dot(kf, qf, dnum, reverse=True)
        return dqf.to(qf.dtype), dkf.to(kf.dtype), dv.to(v.dtype), None, None


def causal_linear_attention(qf, kf, v, eps=1e-6, backend="auto"):
    """Normalised causal linear attention. qf, kf: (B, H, T, F); v: (B, H, T, Dv) -> (B, H, T, Dv)."""
    if qf.dim() != 4 or qf.shape != kf.shape or v.dim() != 4 or v.shape[:3] != qf.shape[:3]:
        raise ValueError(f"expected qf, kf of shape (B, H, T, F) and v of shape (B, H, T, Dv); "
                         f"got {tuple(qf.shape)}, {tuple(kf.shape)}, {tuple(v.shape)}")
    triton_ok = HAS_TRITON and (qf.is_cuda or (INTERPRET and qf.device.type == "cpu"))
    if backend == "auto":
        backend = "triton" if triton_ok else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not triton_ok:
        why = "triton is not installed" if not HAS_TRITON else \
            f"tensors are on {qf.device.type}; Triton needs CUDA, or TRITON_INTERPRET=1 set before import for CPU"
        raise RuntimeError(f"backend='triton' cannot run here: {why}. Use backend='torch'.")
    return _CausalLinearAttention.apply(qf, kf, v, eps, backend)


# ----------------------------------------------------------------------------------------------
# python kernel.py: check, then benchmark (Hedgehog Fig. 6: one layer, 12 heads, head dim 64)


def _time(fn, repeats):
    """Best of `repeats` wall-clock seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def benchmark(heads, dim, lengths, threads, repeats, quadratic_max, out):
    from attention import linear_attention_quadratic
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        torch.set_num_threads(threads)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)

    # correctness first: every backend against the float64 quadratic form, forward and gradients
    qf, kf = (torch.rand(1, 2, 300, dim, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 300, dim, generator=g, dtype=torch.float64)
    ref = linear_attention_quadratic(qf, kf, v)
    backends = ["torch"] + (["triton"] if HAS_TRITON and (dev == "cuda" or INTERPRET) else [])
    for b in backends:
        ins = [x.to(dev).float().requires_grad_() for x in (qf, kf, v)]
        y = causal_linear_attention(*ins, backend=b)
        y.sum().backward()
        print(f"check {b}: max |y - y_ref| = {(y.double().cpu() - ref).abs().max().item():.2e}")
    if "triton" not in backends:
        print("triton: not run (needs a CUDA GPU; TRITON_INTERPRET=1 only checks correctness, slowly)")

    methods = {"softmax (sdpa)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               "linear, quadratic form": lambda q, k, v: linear_attention_quadratic(q, k, v),
               "linear, torch chunked": lambda q, k, v: causal_linear_attention(q, k, v, backend="torch")}
    if dev == "cuda" and HAS_TRITON:
        methods["linear, triton"] = lambda q, k, v: causal_linear_attention(q, k, v, backend="triton")
    rows = []
    print(f"\ndevice {dev}{'' if dev == 'cuda' else f' ({threads} thread)'}, batch 1, {heads} heads, "
          f"head dim {dim}, F = Dv = {dim} (the inputs stand for features), {dtype}")
    print(f"{'method':<24} {'T':>6} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak MiB':>9}")
    for T in lengths:
        # exp-like positive features so that the normalisation is well conditioned
        q, k = (torch.rand(1, heads, T, dim, device=dev, dtype=dtype) for _ in range(2))
        v = torch.randn(1, heads, T, dim, device=dev, dtype=dtype)
        for name, fn in methods.items():
            if name.startswith("linear, quadratic") and T > quadratic_max:
                continue  # T x T weights per head: out of memory beyond this
            ins = [x.detach().requires_grad_() for x in (q, k, v)]
            r = max(1, repeats if T <= 4096 else repeats // 3)
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                fwd = _time(lambda: fn(*ins), r)
            both = _time(lambda: fn(*ins).sum().backward(), r)
            peak = torch.cuda.max_memory_allocated() / 2 ** 20 if dev == "cuda" else None
            rows.append({"method": name, "T": T, "fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3, "peak_mib": peak})
            print(f"{name:<24} {T:>6} {fwd * 1e3:>9.1f} {both * 1e3:>11.1f} {'n/a' if peak is None else f'{peak:.0f}':>9}", flush=True)
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "threads": threads,
              "heads": heads, "dim": dim, "dtype": str(dtype), "torch": torch.__version__, "rows": rows}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {out}")
    _plot(rows, out.replace(".json", ".png"))


def _plot(rows, path):
    from configurator import pyplot
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
    from configurator import configure
    gpu = torch.cuda.is_available()
    cfg = configure({
        "heads": 12 if gpu else 4,  # the paper's 12 heads on a GPU; B*H = 4 keeps the CPU run under 2 minutes
        "dim": 64,
        "lengths": "256,1024,4096,16384,32768" if gpu else "1024,4096,16384",
        "threads": 1,  # CPU threads (one, as the targets in the README are stated)
        "repeats": 3,
        "quadratic_max": 16384 if gpu else 4096,  # longest T for the O(T^2) linear form
        "out": "results/kernel.json",
    })
    benchmark(cfg["heads"], cfg["dim"], [int(t) for t in cfg["lengths"].split(",")], cfg["threads"],
              cfg["repeats"], cfg["quadratic_max"], cfg["out"])
