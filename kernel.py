"""
Causal linear attention, fast: Triton kernels (forward and backward) and a chunked PyTorch fallback.

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j)

(Hedgehog Sec. 2, OAL Sec. 2 and 4.4.) Public entry point:

    causal_linear_attention(qf, kf, v, eps=EPS, backend="auto")
        qf, kf: (B, H, T, F) features, v: (B, H, T, Dv) -> y: (B, H, T, Dv) in v's dtype, differentiable.
        backend "torch": the chunked fallback; "triton": the kernels; "auto": Triton on CUDA tensors for
        the sizes the build check covers (else the fallback, said once), Triton on CPU tensors when
        TRITON_INTERPRET=1 was set before import, else the fallback.

Both compute the same chunked algorithm: split time into chunks of C tokens; within a chunk, the
masked quadratic form tril(q k^T) v; across chunks, a running state S = sum_j k_j v_j^T (F x Dv) and
z = sum_j k_j, kept in float32. Memory is linear in T. The denominator is never a padded value column.

The Triton design (after flash-linear-attention's chunk kernels): two passes, so that chunks run in parallel.
  pass 1  _states_kernel   grid (B*H*N, F/BK, Dv/BV): every chunk's own k_n^T v_n (and k_n^T 1) at once,
                           then a prefix sum over chunks (torch.cumsum) gives the state before each
                           chunk, S[n] = sum_{m<n} k_m^T v_m (and z[n]), in memory.
  pass 2  _output_kernel   grid (Dv/BV, T/C, B*H): every chunk at once, y = (tril(q k^T) v + q S[n]) /
                           (tril(q k^T) 1 + q z[n] + eps), looping over F in BK tiles.
  backward                 pass 1 again for S (recomputed, not stored) and backwards for R[n] = sum_{m>n}
                           q_m^T dnum_m; then _dqk_kernel (grid F/BK, T/C, B*H) and _dv_kernel (Dv/BV, T/C,
                           B*H), parallel over chunks, with the algebra of _ChunkedLinearAttention below.
Cost per token and head, forward, C = 64: pass 1 2 F Dv flops; pass 2 2 C (F + Dv) + 2 F Dv flops (the
masked half of each chunk's scores is computed too), against FlashAttention's 2 D T (causal). Bytes per
token and head: q, k, v in, y out, and the state, F Dv 4 / C bytes written once and read three times
(the prefix sum reads and writes it once more). The states take B H (T/C) F Dv 4 bytes, twice that in
the backward. Pass 1 runs T/C times more programs than a pass that walks the chunks in order (the
design before this one, which docs/results.md measured on a GPU): no part of it is serial in T.
Tiles, warps and stages (_configs) were chosen with the build check: `python build_check.py` compiles
every launch ahead of time for sm_80 and sm_90 on any machine (triton.compile with a GPUTarget; ptxas
and cuobjdump ship with triton) and checks shared memory and register spills.

Where this was tested: both backends against a float64 reference, forward and gradients, with
float32/bfloat16/float16 inputs at odd sizes; the fallback on CPU (torch 2.13), the Triton kernels in
the Triton CPU interpreter (TRITON_INTERPRET=1, triton 3.9, float32 arithmetic), and compiled for sm_80
and sm_90 by the build check. The design with a serial pass 1 also ran on an NVIDIA H200 (triton 3.6,
where an fp32 tl.dot uses TF32); the chunk-parallel pass 1 has not yet run on a GPU.
`python bench_kernel.py` checks them against float64, then times them.
"""
import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import, so read it here too
EPS = 1e-6  # the denominator's guard against rows of zero weight (a ReLU map can give one)

# ----------------------------------------------------------------------------------------------
# PyTorch fallback: the chunked form, with a backward that reuses the forward's work


def _exclusive_cumsum(x, reverse=False):
    """out[:, n] = sum of x[:, m] over m < n (m > n if reverse). x: (BH, N, ...), N = number of chunks.
    On CUDA one cumsum over dim 1 (parallel); on CPU a loop over chunks of in-place adds, which is faster
    there. Both sum in chunk order."""
    if x.is_cuda:
        x = x.flip(1) if reverse else x
        out = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1].cumsum(1)], 1)
        return out.flip(1) if reverse else out
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
# Triton kernels: the same chunked algorithm, parallel over chunks (see the module docstring)
#
# Layout: q, k (BH, T, F), v (BH, T, Dv), contiguous; chunk n holds tokens [n C, n C + C).
# States: S (BH, N, F, Dv) and z (BH, N, F), float32; S[n] is the sum over the chunks before n.

if HAS_TRITON:

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _states_kernel(k_ptr, v_ptr, w_ptr, S_ptr, z_ptr, T, F, DV, N,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Pass 1. Program (bh * N + n, i_k, i_v): the (BK, BV) tile of chunk n's own sum  k_n^T v_n,
        # and, in the i_v = 0 programs, k_n^T w_n (w: one weight per token). Every chunk at once;
        # _states() then turns these into the running sums over earlier (or later) chunks.
        i_c, i_k, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # axis 0: up to 2^31 - 1 programs
        bh, n = i_c // N, i_c % N
        rk = i_k * BK + tl.arange(0, BK)
        rv = i_v * BV + tl.arange(0, BV)
        t = n * C + tl.arange(0, C)
        k = tl.load(k_ptr + bh * T * F + t[:, None] * F + rk[None, :], mask=(t[:, None] < T) & (rk[None, :] < F), other=0.0).to(tl.float32)
        v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=(t[:, None] < T) & (rv[None, :] < DV), other=0.0).to(tl.float32)
        S = tl.dot(tl.trans(k), v)  # (BK, BV)
        tl.store(S_ptr + i_c * F * DV + rk[:, None] * DV + rv[None, :], S, mask=(rk[:, None] < F) & (rv[None, :] < DV))
        if i_v == 0:
            w = tl.load(w_ptr + bh * T + t, mask=t < T, other=0.0).to(tl.float32)
            tl.store(z_ptr + i_c * F + rk, tl.sum(k * w[:, None], 0), mask=rk < F)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _output_kernel(q_ptr, k_ptr, v_ptr, S_ptr, z_ptr, y_ptr, den_ptr, T, F, DV, N, eps,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Pass 2 (forward). Program (i_v, n, bh): chunk n, value columns [i_v BV, +BV), all F in BK tiles.
        #     A = tril(q k^T),  y = (A v + q S[n]) / (A 1 + q z[n] + eps)
        i_v, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rv = i_v * BV + tl.arange(0, BV)
        rt = tl.arange(0, C)
        t = n * C + rt
        q_ptr += bh * T * F
        k_ptr += bh * T * F
        S_ptr += (bh * N + n) * F * DV
        z_ptr += (bh * N + n) * F
        A = tl.zeros((C, C), dtype=tl.float32)
        o = tl.zeros((C, BV), dtype=tl.float32)
        qz = tl.zeros((C,), dtype=tl.float32)
        for i in range(0, tl.cdiv(F, BK)):
            rk = i * BK + tl.arange(0, BK)
            in_k = (t[:, None] < T) & (rk[None, :] < F)
            q = tl.load(q_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)  # (C, BK)
            k = tl.load(k_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
            S = tl.load(S_ptr + rk[:, None] * DV + rv[None, :], mask=(rk[:, None] < F) & (rv[None, :] < DV), other=0.0)
            z = tl.load(z_ptr + rk, mask=rk < F, other=0.0)
            A += tl.dot(q, tl.trans(k))  # (C, C)
            o += tl.dot(q, S)  # (C, BV)
            qz += tl.sum(q * z[None, :], 1)
        A = tl.where(rt[:, None] >= rt[None, :], A, 0.0)
        in_v = (t[:, None] < T) & (rv[None, :] < DV)
        v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0).to(tl.float32)
        den = tl.sum(A, 1) + qz + eps  # (C,)
        y = (o + tl.dot(A, v)) / den[:, None]
        tl.store(y_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], y, mask=in_v)
        if i_v == 0:
            tl.store(den_ptr + bh * T + t, den, mask=t < T)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _dqk_kernel(q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, S_ptr, z_ptr, R_ptr, r_ptr, dq_ptr, dk_ptr,
                    T, F, DV, N, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Backward, program (i_k, n, bh): feature columns [i_k BK, +BK) of chunk n, all Dv in BV tiles.
        #     G  = tril(dnum v^T + dden 1^T)
        #     dq = G k + dnum S[n]^T + dden z[n]^T,     dk = G^T q + v R[n]^T + 1 r[n]^T
        i_k, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rk = i_k * BK + tl.arange(0, BK)
        rt = tl.arange(0, C)
        t = n * C + rt
        v_ptr += bh * T * DV
        dnum_ptr += bh * T * DV
        S_ptr += (bh * N + n) * F * DV
        R_ptr += (bh * N + n) * F * DV
        G = tl.zeros((C, C), dtype=tl.float32)
        dq = tl.zeros((C, BK), dtype=tl.float32)
        dk = tl.zeros((C, BK), dtype=tl.float32)
        for j in range(0, tl.cdiv(DV, BV)):
            rv = j * BV + tl.arange(0, BV)
            in_v = (t[:, None] < T) & (rv[None, :] < DV)
            in_s = (rk[:, None] < F) & (rv[None, :] < DV)
            v = tl.load(v_ptr + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0).to(tl.float32)  # (C, BV)
            dnum = tl.load(dnum_ptr + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0)
            S = tl.load(S_ptr + rk[:, None] * DV + rv[None, :], mask=in_s, other=0.0)  # (BK, BV)
            R = tl.load(R_ptr + rk[:, None] * DV + rv[None, :], mask=in_s, other=0.0)
            G += tl.dot(dnum, tl.trans(v))
            dq += tl.dot(dnum, tl.trans(S))
            dk += tl.dot(v, tl.trans(R))
        dden = tl.load(dden_ptr + bh * T + t, mask=t < T, other=0.0)
        G = tl.where(rt[:, None] >= rt[None, :], G + dden[:, None], 0.0)
        in_k = (t[:, None] < T) & (rk[None, :] < F)
        q = tl.load(q_ptr + bh * T * F + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bh * T * F + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + (bh * N + n) * F + rk, mask=rk < F, other=0.0)
        r = tl.load(r_ptr + (bh * N + n) * F + rk, mask=rk < F, other=0.0)
        dq += tl.dot(G, k) + dden[:, None] * z[None, :]
        dk += tl.dot(tl.trans(G), q) + r[None, :]
        tl.store(dq_ptr + bh * T * F + t[:, None] * F + rk[None, :], dq.to(dq_ptr.dtype.element_ty), mask=in_k)
        tl.store(dk_ptr + bh * T * F + t[:, None] * F + rk[None, :], dk.to(dk_ptr.dtype.element_ty), mask=in_k)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _dv_kernel(q_ptr, k_ptr, dnum_ptr, R_ptr, dv_ptr, T, F, DV, N,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # Backward, program (i_v, n, bh): value columns [i_v BV, +BV) of chunk n, all F in BK tiles.
        #     dv = A^T dnum + k R[n],   A^T_ji = k_j . q_i for i >= j
        i_v, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rv = i_v * BV + tl.arange(0, BV)
        rt = tl.arange(0, C)
        t = n * C + rt
        q_ptr += bh * T * F
        k_ptr += bh * T * F
        R_ptr += (bh * N + n) * F * DV
        At = tl.zeros((C, C), dtype=tl.float32)
        dv = tl.zeros((C, BV), dtype=tl.float32)
        for i in range(0, tl.cdiv(F, BK)):
            rk = i * BK + tl.arange(0, BK)
            in_k = (t[:, None] < T) & (rk[None, :] < F)
            q = tl.load(q_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)  # (C, BK)
            k = tl.load(k_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
            R = tl.load(R_ptr + rk[:, None] * DV + rv[None, :], mask=(rk[:, None] < F) & (rv[None, :] < DV), other=0.0)
            At += tl.dot(k, tl.trans(q))  # (C, C)
            dv += tl.dot(k, R)  # (C, BV)
        At = tl.where(rt[:, None] <= rt[None, :], At, 0.0)
        in_v = (t[:, None] < T) & (rv[None, :] < DV)
        dnum = tl.load(dnum_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0)
        dv += tl.dot(At, dnum)
        tl.store(dv_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], dv.to(dv_ptr.dtype.element_ty), mask=in_v)


CHUNK = 64  # tokens per chunk in the Triton kernels


def _tile(n, cap):
    """A power-of-2 tile for a dimension of size n: at least 16 (tl.dot's minimum), at most cap."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def _configs(F, Dv):
    """Tile sizes, warps and pipeline stages of each kernel for features F and values Dv. Chosen so that
    every launch fits sm_80's and sm_90's shared memory and spills no registers (`python build_check.py`
    compiles them all and prints the cost of each)."""
    return {"states": dict(BK=_tile(F, 32), BV=_tile(Dv, 32), num_warps=8, num_stages=2),
            "output": dict(BK=_tile(F, 32), BV=_tile(Dv, 64), num_warps=8, num_stages=2),
            "dqk": dict(BK=_tile(F, 32), BV=_tile(Dv, 32), num_warps=8, num_stages=2),
            # 4 warps at Dv <= 32: with 8, triton 3.6 spills 8 bytes on sm_80 (bf16 inputs, F not a multiple of 16)
            "dv": dict(BK=_tile(F, 32), BV=_tile(Dv, 64), num_warps=4 if Dv <= 32 else 8, num_stages=2)}


def _states(k, v, w, reverse):
    """Pass 1: exclusive running sums over chunks of k^T v (BH, N, F, Dv) and k^T w (BH, N, F), float32:
    every chunk's own sum in parallel (the kernel), then the fallback's prefix sum over chunks (one
    parallel cumsum on a GPU), so that no program walks the sequence."""
    BH, T, F_ = k.shape
    Dv, N = v.shape[-1], triton.cdiv(T, CHUNK)
    S = torch.empty(BH, N, F_, Dv, device=k.device, dtype=torch.float32)
    z = torch.empty(BH, N, F_, device=k.device, dtype=torch.float32)
    cfg = _configs(F_, Dv)["states"]
    grid = (BH * N, triton.cdiv(F_, cfg["BK"]), triton.cdiv(Dv, cfg["BV"]))
    _states_kernel[grid](k, v, w, S, z, T, F_, Dv, N, C=CHUNK, **cfg)
    return _exclusive_cumsum(S, reverse), _exclusive_cumsum(z, reverse)


def _triton_forward(q, k, v, eps):
    """q, k (BH, T, F), v (BH, T, Dv) contiguous -> y (BH, T, Dv), den (BH, T), both float32 (the backward
    needs y exactly: its dden = -(dnum . y) cancels against dnum . v)."""
    BH, T, F_ = q.shape
    Dv, N = v.shape[-1], triton.cdiv(T, CHUNK)
    S, z = _states(k, v, torch.ones(BH, T, device=q.device, dtype=torch.float32), reverse=False)
    y = torch.empty(BH, T, Dv, device=q.device, dtype=torch.float32)
    den = torch.empty(BH, T, device=q.device, dtype=torch.float32)
    cfg = _configs(F_, Dv)["output"]
    _output_kernel[(triton.cdiv(Dv, cfg["BV"]), N, BH)](q, k, v, S, z, y, den, T, F_, Dv, N, eps, C=CHUNK, **cfg)
    return y, den


def _triton_backward(q, k, v, y, den, dy):
    """Gradients of the forward above for the output gradient dy (BH, T, Dv). States are recomputed."""
    BH, T, F_ = q.shape
    Dv, N = v.shape[-1], triton.cdiv(T, CHUNK)
    dnum = dy.float() / den[..., None]  # dL/dnum, (BH, T, Dv)
    dden = -(dnum * y).sum(-1)  # dL/dden = -(dy . y) / den, (BH, T)
    S, z = _states(k, v, torch.ones_like(dden), reverse=False)
    R, r = _states(q, dnum, dden, reverse=True)  # R[n] = sum_{m>n} q_m^T dnum_m, r[n] = sum_{m>n} q_m^T dden_m
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg = _configs(F_, Dv)
    _dqk_kernel[(triton.cdiv(F_, cfg["dqk"]["BK"]), N, BH)](q, k, v, dnum, dden, S, z, R, r, dq, dk,
                                                             T, F_, Dv, N, C=CHUNK, **cfg["dqk"])
    _dv_kernel[(triton.cdiv(Dv, cfg["dv"]["BV"]), N, BH)](q, k, dnum, R, dv, T, F_, Dv, N, C=CHUNK, **cfg["dv"])
    return dq, dk, dv


class _TritonLinearAttention(torch.autograd.Function):
    """The Triton path: pass 1 (chunk states) then pass 2 (outputs), and the same two passes backward."""

    @staticmethod
    def forward(ctx, qf, kf, v, eps):
        B, H, T, F_ = qf.shape
        q, k, v3 = (x.reshape(B * H, T, x.shape[-1]).contiguous() for x in (qf, kf, v))
        y, den = _triton_forward(q, k, v3, eps)
        ctx.save_for_backward(q, k, v3, y, den)
        return y.view(B, H, T, -1).to(v.dtype)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, den = ctx.saved_tensors
        B, H, T, Dv = dy.shape
        dq, dk, dv = _triton_backward(q, k, v, y, den, dy.reshape(B * H, T, Dv))
        return dq.view(B, H, T, -1), dk.view(B, H, T, -1), dv.view(B, H, T, -1), None


# ----------------------------------------------------------------------------------------------
# Which sizes backend="auto" trusts on CUDA: those build_check.py compiles for sm_80 and sm_90

BUILD_F = (8, 16, 32, 45, 64, 128, 256, 561, 2145)  # feature sizes the maps produce (45, 2145: Taylor at D 8, 64)
BUILD_DV = (8, 32, 64, 128)


def _code_key(F_, Dv):
    """What decides the compiled code for sizes F_, Dv: the launch settings and whether F_, Dv divide by 16."""
    return repr(_configs(F_, Dv)), F_ % 16 == 0, Dv % 16 == 0, F_ == 1, Dv == 1


COVERED = {_code_key(F_, Dv) for F_ in BUILD_F for Dv in BUILD_DV} if HAS_TRITON else set()  # what the build check compiles
_said = set()


def triton_covered(F_, Dv):
    """True when the launches for features F_ and values Dv compile to code the build check has checked:
    same tiles, warps, stages and divisibility-by-16 of F and Dv as one of its shapes."""
    return _code_key(F_, Dv) in COVERED


def causal_linear_attention(qf, kf, v, eps=EPS, backend="auto"):
    """Normalised causal linear attention. qf, kf: (B, H, T, F); v: (B, H, T, Dv) -> (B, H, T, Dv)."""
    if qf.dim() != 4 or qf.shape != kf.shape or v.dim() != 4 or v.shape[:3] != qf.shape[:3]:
        raise ValueError(f"expected qf, kf of shape (B, H, T, F) and v of shape (B, H, T, Dv); "
                         f"got {tuple(qf.shape)}, {tuple(kf.shape)}, {tuple(v.shape)}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    F_, Dv = qf.shape[-1], v.shape[-1]
    triton_ok = HAS_TRITON and (qf.is_cuda or (INTERPRET and qf.device.type == "cpu"))
    if backend == "auto":
        backend = "triton" if triton_ok else "torch"
        if backend == "triton" and qf.is_cuda and not triton_covered(F_, Dv):
            backend = "torch"
            if (F_, Dv) not in _said:
                _said.add((F_, Dv))
                print(f"kernel.py: F = {F_}, Dv = {Dv} is outside the Triton build check; using the PyTorch fallback")
    if backend == "triton" and not triton_ok:
        why = "triton is not installed" if not HAS_TRITON else \
            f"tensors are on {qf.device.type}; Triton needs CUDA, or TRITON_INTERPRET=1 set before import for CPU"
        raise RuntimeError(f"backend='triton' cannot run here: {why}. Use backend='torch'.")
    if backend == "triton":
        return _TritonLinearAttention.apply(qf, kf, v, eps)
    # chunk C balances the per-token work within a chunk, C (F + Dv), against the state's, 2 F Dv:
    # C = 2 F Dv / (F + Dv) as a power of 2 in [16, 128] (64 at F = Dv = 64, the fastest there by measurement)
    chunk = min(128, max(16, 2 ** round(math.log2(2 * F_ * Dv / (F_ + Dv)))))
    return _ChunkedLinearAttention.apply(qf, kf, v, eps, chunk)
