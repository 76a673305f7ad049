"""
Causal linear attention, fast: a Triton kernel (forward and backward) and a chunked PyTorch fallback.

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j)

(Hedgehog Sec. 2, OAL Sec. 2 and 4.4.) Public entry point:

    causal_linear_attention(qf, kf, v, eps=1e-6, backend="auto")
        qf, kf: (B, H, T, F) features, v: (B, H, T, Dv) -> y: (B, H, T, Dv) in v's dtype, differentiable.
        backend "torch": the chunked fallback; "triton": the kernel; "auto": Triton on CUDA tensors
        (or on CPU tensors when TRITON_INTERPRET=1 was set before import), else the fallback.

Both compute the same chunked algorithm: split time into chunks of C tokens; within a chunk, the
masked quadratic form tril(q k^T) v; across chunks, a running state S = sum_j k_j v_j^T (F x Dv) and
z = sum_j k_j, kept in float32. Memory is linear in T.

The Triton kernel implements one primitive, an unnormalised causal "dot" over time,

    causal_dot(a, b, c)_i = sum_{j<=i} (a_i . b_j) c_j          (reverse=True: sum over j >= i),

- Forward: the denominator is one more value column: causal_dot(qf, kf, [v, 1]) gives [num, den].
- Backward: with do = [dy / den, -(dy . y) / den] (the gradient with respect to [num, den]), the
  three gradients are three more causal dots:
      dqf_i = sum_{j<=i} (do_i . [v, 1]_j) kf_j        causal_dot(do, [v, 1], kf)
      dkf_j = sum_{i>=j} ([v, 1]_j . do_i) qf_i        causal_dot([v, 1], do, qf, reverse=True)
      dv_j  = sum_{i>=j} (kf_j . qf_i) dnum_i          causal_dot(kf, qf, dnum, reverse=True)
The PyTorch fallback (what CPU users run) writes the same algebra out per chunk instead, so that the
backward reuses the forward's chunk scores and states (see _ChunkedLinearAttention). The recurrent
(one token at a time) form is attention.linear_attention_step; tests check it equals this parallel form.

Where this was tested: both backends against a float64 reference, forward and gradients, with
float32/bfloat16/float16 inputs at odd sizes; the fallback on CPU (torch 2.13), the Triton kernel in
the Triton CPU interpreter (TRITON_INTERPRET=1, triton 3.9, float32 arithmetic).
It has not been compiled or timed on a GPU in this repository yet; on NVIDIA GPUs an fp32 tl.dot
uses TF32 (about 1e-3 relative error). `python kernel.py` checks correctness, then benchmarks.
"""
import json
import math
import os
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
# PyTorch fallback: the chunked form, with a backward that reuses the forward's work


def _exclusive_cumsum(x, reverse=False):
    """out[:, n] = sum of x[:, m] over m < n (m > n if reverse). x: (BH, N, ...), N = number of chunks.
    A loop over chunks of in-place adds: exact running sums, and faster on CPU than cumsum over dim 1."""
    out = torch.zeros_like(x)
    N = x.shape[1]
    for n in (range(N - 2, -1, -1) if reverse else range(1, N)):
        m = n + 1 if reverse else n - 1
        torch.add(out[:, m], x[:, m], out=out[:, n])
    return out


class _ChunkedLinearAttention(torch.autograd.Function):
    """Causal linear attention in chunks of C tokens, forward and backward by hand.

    Per chunk (rows = its C tokens; S, z = the sums over all earlier chunks):
        A   = tril(q k^T)                                 (C, C)  the chunk's own causal scores
        num = A v + q S,      S = sum_{earlier} k^T v     (C, Dv)
        den = A 1 + q z + eps, z = sum_{earlier} k^T 1    (C, 1)
        y   = num / den
    Backward, with dnum = dy / den and dden = -(dy . y) / den (both per row):
        G  = tril(dnum v^T + dden 1^T)        (C, C)  G_ij = d(score_ij), shared by dq and dk
        dq = G k + dnum S^T + dden z^T
        dk = G^T q + v R^T + 1 r^T,           R = sum_{later} q^T dnum,  r = sum_{later} q^T dden
        dv = A^T dnum + k R
    The forward's A and S are saved and reused, so forward + backward is 12 batched C x 64 x 64-sized
    matmuls (three separate causal dots would take 16), and the denominator is kept out of the matmuls
    (a 65th column slows them down). Sums run in float32 (float64 stays float64).
    """

    @staticmethod
    def forward(ctx, qf, kf, v, eps, chunk):
        B, H, T, F_ = qf.shape
        Dv = v.shape[-1]
        ctx.dtypes = (qf.dtype, kf.dtype, v.dtype)
        dtype = torch.promote_types(v.dtype, torch.float32)
        pad = (-T) % chunk  # zero rows at the end add nothing to the sums
        q, k, v = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (qf, kf, v))
        q, k, v = (x.to(dtype).reshape(-1, chunk, x.shape[-1]) for x in (q, k, v))  # (B*H*N, C, .)
        BH, N = B * H, q.shape[0] // (B * H)
        A = torch.bmm(q, k.transpose(1, 2)).tril_()  # (BHN, C, C)
        S = _exclusive_cumsum(torch.bmm(k.transpose(1, 2), v).view(BH, N, F_, Dv)).view(-1, F_, Dv)
        z = _exclusive_cumsum(k.sum(1).view(BH, N, F_)).view(-1, F_, 1)
        num = torch.bmm(A, v).baddbmm_(q, S)  # (BHN, C, Dv)
        den = torch.bmm(q, z).add_(A.sum(-1, keepdim=True)).add_(eps)  # (BHN, C, 1)
        y = num.div_(den)
        ctx.save_for_backward(q, k, v, A, S, z, y, den)
        return y.view(B, H, -1, Dv)[:, :, :T].to(ctx.dtypes[2])

    @staticmethod
    def backward(ctx, dy):
        q, k, v, A, S, z, y, den = ctx.saved_tensors
        BHN, C, F_ = q.shape
        B, H, T, Dv = dy.shape
        BH, N = B * H, BHN // (B * H)
        if N * C > T:
            dy = F.pad(dy, (0, 0, 0, N * C - T))
        dnum = dy.to(y.dtype).reshape(BHN, C, Dv) / den
        dden = -(dnum * y).sum(-1, keepdim=True)  # (BHN, C, 1)
        G = torch.bmm(dnum, v.transpose(1, 2)).add_(dden).tril_()  # (BHN, C, C)
        R = _exclusive_cumsum(torch.bmm(q.transpose(1, 2), dnum).view(BH, N, F_, Dv), reverse=True).view(-1, F_, Dv)
        r = _exclusive_cumsum(torch.bmm(q.transpose(1, 2), dden).view(BH, N, F_), reverse=True).view(-1, 1, F_)
        dq = torch.bmm(G, k).baddbmm_(dnum, S.transpose(1, 2)).addcmul_(dden, z.transpose(1, 2))
        dk = torch.bmm(G.transpose(1, 2), q).baddbmm_(v, R.transpose(1, 2)).add_(r)
        dv = torch.bmm(A.transpose(1, 2), dnum).baddbmm_(k, R)
        return tuple(x.view(B, H, N * C, -1)[:, :, :T].to(t) for x, t in zip((dq, dk, dv), ctx.dtypes)) + (None, None)


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
    """out_i = sum_{j<=i} (a_i . b_j) c_j (j >= i if reverse), by _causal_dot_kernel.

    a, b: (B, H, T, K), c: (B, H, T, Dc) -> (B, H, T, Dc) in float32."""
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


class _TritonLinearAttention(torch.autograd.Function):
    """Forward: one causal dot with the denominator as an extra value column; backward: three more."""

    @staticmethod
    def forward(ctx, qf, kf, v, eps):
        dot = causal_dot_triton
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, Dv+1): last column = denominator
        out = dot(qf, kf, v1)
        den = out[..., -1:] + eps  # (B, H, T, 1) = qf_i . z_i + eps
        y = out[..., :-1] / den  # (B, H, T, Dv)
        ctx.save_for_backward(qf, kf, v, y, den)
        return y.to(v.dtype)

    @staticmethod
    def backward(ctx, dy):
        qf, kf, v, y, den = ctx.saved_tensors
        dot = causal_dot_triton
        dnum = dy.to(y.dtype) / den  # dL/dnum, (B, H, T, Dv)
        dden = -(dnum * y).sum(-1, keepdim=True)  # dL/dden = -(dy . y) / den, (B, H, T, 1)
        do = torch.cat([dnum, dden], dim=-1)  # (B, H, T, Dv+1)
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        dqf = dot(do, v1, kf)
        dkf = dot(v1, do, qf, reverse=True)
        dv = dot(kf, qf, dnum, reverse=True)
        return dqf.to(qf.dtype), dkf.to(kf.dtype), dv.to(v.dtype), None


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
    if backend == "triton":
        return _TritonLinearAttention.apply(qf, kf, v, eps)
    # chunk C balances the per-token work within a chunk, C (F + Dv), against the state's, 2 F Dv:
    # C = 2 F Dv / (F + Dv) as a power of 2 in [16, 128] (64 at F = Dv = 64, the fastest there by measurement)
    F_, Dv = qf.shape[-1], v.shape[-1]
    chunk = min(128, max(16, 2 ** round(math.log2(2 * F_ * Dv / (F_ + Dv)))))
    return _ChunkedLinearAttention.apply(qf, kf, v, eps, chunk)


# ----------------------------------------------------------------------------------------------
# python kernel.py: check, then benchmark (Hedgehog Fig. 6: one layer, 12 heads, head dim 64)


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
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                fwd = _time(lambda: fn(*ins), repeats)
            both = _time(lambda: fn(*ins).sum().backward(), repeats)
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
        "repeats": 5,
        "quadratic_max": 16384 if gpu else 4096,  # longest T for the O(T^2) linear form
        "out": "results/kernel.json",
    })
    benchmark(cfg["heads"], cfg["dim"], [int(t) for t in cfg["lengths"].split(",")], cfg["threads"],
              cfg["repeats"], cfg["quadratic_max"], cfg["out"])
