"""
Causal linear attention, fast: Triton kernels (forward and backward) and a chunked PyTorch fallback.

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps),   S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j)

(Hedgehog Sec. 2, OAL Sec. 2 and 4.4.) Public entry point:

    causal_linear_attention(qf, kf, v, eps=EPS, backend="auto", squares=None)
        qf, kf: (B, H, T, F) features, v: (B, H, T, Dv) -> y: (B, H, T, Dv) in v's dtype, differentiable.
        backend "torch": the chunked fallback; "triton": the kernels; "auto": Triton on CUDA tensors for
        the sizes the build check covers (else the fallback, said once), Triton on CPU tensors when
        TRITON_INTERPRET=1 was set before import, else the fallback. The kernels need triton 3.6+
        (TRITON_MIN); an older one counts as none.
        squares: the polynomial maps' kernel in closed form (FeatureMap.squares; Taylor, TaylorShift, the
        quadratic and OAL), qf_i . kf_j = base + sum_r (c_r + sum_l lam_rl q_il k_jl)^2 on the raw q, k
        (B, H, T, D), with lam (H, SQ, D), c (H, SQ), base (H,). Then the scores within a chunk come from
        it: SQ D multiply-adds per pair instead of F = 1 + D + D(D+1)/2 (2 x 64 against 2145 for Taylor
        at D = 64; OAL's G groups give SQ = G + 1), and the features only carry the state.

Both compute the same chunked algorithm: split time into chunks of C tokens; within a chunk, the
masked quadratic form tril(q k^T) v; across chunks, a running state S = sum_j k_j v_j^T (F x Dv) and
z = sum_j k_j, kept in float32. Memory is linear in T. The denominator is never a padded value column.

The Triton design (after flash-linear-attention's chunk kernels): two passes, so that chunks run in parallel.
  pass 1  _states_kernel   grid (B*H*NS * F/BK * Dv/BV,), a segment's tiles side by side: the chunks split
                           into NS segments of L chunks (after flash-linear-attention's chunk_h_split);
                           every segment's sum of k_n^T v_n (and k_n^T 1) at once, their running sum over
                           segments (an in-place cumsum, small), then every segment walked from the sum of
                           the segments before it, storing the state before each chunk,
                           S[n] = sum_{m<n} k_m^T v_m (and z[n]), in memory. NS is chosen for about
                           STATE_PROGRAMS programs a launch, with segments of at least MIN_SEGMENT
                           chunks, so a short sequence is one walk.
  pass 2  _output_kernel   grid (Dv/BV, T/C, B*H): every chunk at once, y = (tril(q k^T) v + q S[n]) /
                           (tril(q k^T) 1 + q z[n] + eps), looping over F in BK tiles; y in float32
                           when a backward will need it, else in v's dtype at once.
  fused   _fused_kernel    grid (B*H*NS * Dv/BV,), the forward for bfloat16 inputs with F <= FUSED_MAX_F
                           and no closed form (one tile of state, Hedgehog's 2D at D <= 64; float32
                           dots or the closed form's terms do not fit the registers): pass 1's segment
                           sums and their running sum, then each segment walked once with pass 2's
                           output computed at every chunk from the state in registers, so the states
                           never go to memory, and a sequence of one segment is one launch (after
                           flash-linear-attention's fused_chunk, which walks a whole sequence in one
                           program). Its chunk is a launch setting of its own (C, 64 as the others'; at 32
                           one value tile of 64 fits the registers, for the sweep to time).
  backward                 pass 1 again for S (recomputed, not stored) and backwards for R[n] = sum_{m>n}
                           q_m^T dnum_m; then _dqk_kernel (grid F/BK, T/C, B*H) and _dv_kernel (Dv/BV, T/C,
                           B*H), parallel over chunks, with the algebra of _ChunkedLinearAttention below.
  squares                  the scores within a chunk from the closed form (_square_scores) in pass 2 and
                           _dv_kernel; their gradients in _dsquares_kernel (grid T/C, B*H, 2), which also
                           gives each chunk's share of dlam, dc, dbase (summed over chunks afterwards).
Precision: bfloat16 features go into tl.dot as bfloat16 (tensor cores, float32 accumulation); the state,
the score block and dnum are rounded to bfloat16 where they meet a dot, as in flash-linear-attention and
FlashAttention, and everything else (sums, the denominator, the state as it accumulates) is float32. So
pass 1 stores the states S[n] (and the backward's R[n]) in bfloat16, rounded as the dots would round them:
the same results for half the bytes. float32 and float16 features take float32 dots (TF32 on a GPU) and
float32 states: a state rounded to float16 could overflow.
Cost per token and head, forward, C = 64: pass 1 4 F Dv flops (2 F Dv with one segment); pass 2
2 C (F + Dv) + 2 F Dv flops (the masked half of each chunk's scores is computed too; with squares
2 C (SQ D + Dv) + 2 F Dv), against FlashAttention's 2 D T (causal). Bytes per token and head: q, k, v in
(k and v twice more in pass 1), y out, and the state, F Dv 2 / C bytes (bf16; 4 in float32) written once
by pass 1 and read once by pass 2. The states take B H (T/C) F Dv 2 (or 4) bytes, twice that in the
backward. The fused forward reads k and v once for the segment sums (not at all with one segment),
then q, k, v once, writes y, and keeps no states: the same flops, with the chunk scores computed Dv/BV
times. The serial part of pass 1 (and of the fused pass) is one segment's L chunks. docs/results.md has
the two earlier designs of pass 1 and their times on a GPU.
Tiles, warps and stages (_configs) were chosen with the build check:
`python build_check.py` compiles every launch ahead of time for sm_80 and sm_90 on any machine
(triton.compile with a GPUTarget; ptxas and cuobjdump ship with triton) and checks shared memory and
register spills.

Where this was tested: both backends against a float64 reference, forward and gradients, with
float32/bfloat16/float16 inputs at odd sizes, with and without squares; the fallback on CPU (torch 2.13),
the Triton kernels in the Triton CPU interpreter (TRITON_INTERPRET=1, triton 3.9; float32 arithmetic,
the bfloat16 dots emulated by rounding their operands, see _dot), and compiled for sm_80 and sm_90 by
the build check. An NVIDIA H200 ran an earlier version (triton 3.6), checked against float64 at the sizes
it timed; the fused forward and three smaller changes since have not run on a GPU (the README's "Still
needs a GPU" lists them).
`python bench_kernel.py` checks them against float64, then times them; `python report_kernel.py` on a GPU
against FlashAttention and flash-linear-attention.
"""
import functools
import math
import os
import re

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    TRITON_VERSION = triton.__version__
except ImportError:
    TRITON_VERSION = None
TRITON_MIN = (3, 6)  # the oldest triton build_check.py compiled every launch with, and a GPU ran them with


def new_enough(version):
    """Whether a triton version string ("3.9.0") is TRITON_MIN or later. An older triton counts as absent and
    the PyTorch fallback runs: torch 2.1's triton 2.1 aborts compiling the closed form."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2]) >= TRITON_MIN


HAS_TRITON = TRITON_VERSION is not None and new_enough(TRITON_VERSION)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import, so read it here too
# fused multiply-adds in the compiled kernels, as built and measured (triton <= 3.9's default, which 3.9 warns
# will be off from 3.10 unless this is set); a value the user set is kept
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
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


def _square_terms(q, k, lam, c):
    """W_r = c_r + (q * lam_r) k^T in every chunk, the terms of the closed-form scores (see squares in
    causal_linear_attention). q, k (B, H, N, C, D), lam (H, SQ, D), c (H, SQ) -> W (B, H, N, SQ, C, C), q * lam."""
    ql = q[:, :, :, None] * lam[:, None, :, None, :]  # (B, H, N, SQ, C, D)
    return (ql @ k[:, :, :, None].transpose(-1, -2)).add_(c[:, None, :, None, None]), ql


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
    (a 65th column slows them down). A sequence of one chunk has no state (S, z, R, r are 0), so its state
    terms are skipped: 6 matmuls, none of them F x Dv. Sums run in float32 (float64 stays float64).

    With squares, A comes from the closed form instead, A = tril(base + sum_r W_r^2), W_r = c_r + (q' lam_r) k'^T
    on the raw q', k' (D wide, not F), and the G k, G^T q terms become, with dW_r = 2 G W_r:
        dq' = sum_r lam_r (dW_r k'),   dk' = sum_r dW_r^T (q' lam_r),   dlam_r = sum_i q'_i (dW_r k')_i,
        dc_r = sum dW_r,   dbase = sum G.
    """

    @staticmethod
    def forward(ctx, qf, kf, v, eps, chunk, qs, ks, lam, c, base):
        B, H, T, F_ = qf.shape
        Dv = v.shape[-1]
        ctx.dtypes = (qf.dtype, kf.dtype, v.dtype)
        dtype = torch.promote_types(v.dtype, torch.float32)
        pad = (-T) % chunk  # zero rows at the end add nothing to the sums
        q, k, v = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (qf, kf, v))
        q, k, v = (x.to(dtype).reshape(-1, chunk, x.shape[-1]) for x in (q, k, v))  # (B*H*N, C, .)
        BH, N = B * H, q.shape[0] // (B * H)
        if qs is None:
            A = torch.bmm(q, k.transpose(1, 2)).tril_()  # (BHN, C, C)
            ctx.squares = None
        else:
            ctx.squares_dtypes = [x.dtype for x in (qs, ks, lam, c, base)]
            qs, ks = (F.pad(x, (0, 0, 0, pad)).to(dtype).view(B, H, N, chunk, -1) for x in (qs, ks))  # (B, H, N, C, D)
            lam, c, base = (x.to(dtype) for x in (lam, c, base))
            W, ql = _square_terms(qs, ks, lam, c)
            A = W.square().sum(3).add_(base[:, None, None, None]).view(-1, chunk, chunk).tril_()
            ctx.squares = (qs, ks, lam, W, ql)
        if N > 1:
            S = _exclusive_cumsum(torch.bmm(k.transpose(1, 2), v).view(BH, N, F_, Dv)).view(-1, F_, Dv)
            z = _exclusive_cumsum(k.sum(1).view(BH, N, F_)).view(-1, F_, 1)
            num = torch.bmm(A, v).baddbmm_(q, S)  # (BHN, C, Dv)
            den = torch.bmm(q, z).add_(A.sum(-1, keepdim=True)).add_(eps)  # (BHN, C, 1)
        else:  # one chunk: nothing before it, so no state (S = 0, z = 0), and its F x Dv products are skipped
            S = z = None
            num, den = torch.bmm(A, v), A.sum(-1, keepdim=True).add_(eps)
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
        dv = torch.bmm(A.transpose(1, 2), dnum)  # (BHN, C, Dv)
        if ctx.squares is None:
            dq, dk = torch.bmm(G, k), torch.bmm(G.transpose(1, 2), q)  # (BHN, C, F)
        else:  # the G terms go to the closed form's q', k' instead (below)
            dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        if N > 1:  # the state's terms (one chunk has none): R, r sum q^T dnum, q^T dden over the later chunks
            R = _exclusive_cumsum(torch.bmm(q.transpose(1, 2), dnum).view(BH, N, F_, Dv), reverse=True).view(-1, F_, Dv)
            r = _exclusive_cumsum(torch.bmm(q.transpose(1, 2), dden).view(BH, N, F_), reverse=True).view(-1, 1, F_)
            dq.baddbmm_(dnum, S.transpose(1, 2)).addcmul_(dden, z.transpose(1, 2))
            dk.baddbmm_(v, R.transpose(1, 2)).add_(r)
            dv.baddbmm_(k, R)
        dsquares = (None,) * 5
        if ctx.squares is not None:
            qs, ks, lam, W, ql = ctx.squares
            G5 = G.view(B, H, N, C, C)
            dW = 2 * G5[:, :, :, None] * W  # (B, H, N, SQ, C, C)
            dWk = dW @ ks[:, :, :, None]  # (B, H, N, SQ, C, D)
            dqs = (dWk * lam[:, None, :, None, :]).sum(3)
            dks = (dW.transpose(-1, -2) @ ql).sum(3)
            dlam, dc, dbase = (dWk * qs[:, :, :, None]).sum((0, 2, 4)), dW.sum((0, 2, 4, 5)), G5.sum((0, 2, 3, 4))
            dsquares = (dqs.flatten(2, 3)[:, :, :T], dks.flatten(2, 3)[:, :, :T], dlam, dc, dbase)
            dsquares = tuple(x.to(t) for x, t in zip(dsquares, ctx.squares_dtypes))
        grads = tuple(x.view(B, H, N * C, -1)[:, :, :T].to(t) for x, t in zip((dq, dk, dv), ctx.dtypes))
        return grads + (None, None) + dsquares


# ----------------------------------------------------------------------------------------------
# Triton kernels: the same chunked algorithm, parallel over chunks (see the module docstring)
#
# Layout: q, k (BH, T, F), v (BH, T, Dv), contiguous; chunk n holds tokens [n C, n C + C).
# States: S (BH, N, F, Dv), bfloat16 for bfloat16 inputs, else float32, and z (BH, N, F), float32; S[n] is
# the sum over the chunks before n, accumulated in float32. Segment sums: S0 and z0 share rows of F Dv + F
# floats, (BH, NS, F Dv + F).

if HAS_TRITON:
    EMULATE = tl.constexpr(INTERPRET)  # the CPU interpreter: bf16 dots emulated in float32 (see _dot)

    @triton.jit
    def _round_bf16(x):
        # float32 x rounded to the nearest bfloat16 (ties to even), kept in float32: the GPU's conversion.
        # The CPU interpreter's x.to(tl.bfloat16) truncates instead, so it is done on the bits here.
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # add half an ulp of bf16 (less at a tie to even), drop 16 bits
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dot(a, b, BF16: tl.constexpr):
        # a @ b of float32 tiles (bfloat16 ones too with BF16), accumulated in float32. BF16: both operands
        # rounded to bfloat16 first, a tensor-core dot on a GPU (float32 operands take TF32 there). The CPU
        # interpreter's bf16 tl.dot gives wrong results, so there the operands are rounded as the GPU rounds
        # them and go in as float32: the same products (exact in float32), summed in float32.
        if not BF16:
            return tl.dot(a, b)
        elif EMULATE:
            return tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)))
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))

    @triton.jit
    def _square_scores(a_ptr, b_ptr, lam_ptr, c_ptr, base_ptr, bh, t, T, D, H,
                       C: tl.constexpr, SQ: tl.constexpr, BD: tl.constexpr, BF16: tl.constexpr):
        # One chunk's scores in closed form from the raw a = q', b = k' (BH, T, D) of tokens t, (C, C):
        #     A_ij = base + sum_r W_r,ij^2,   W_r = c_r + (a lam_r) b^T      (a = k', b = q' gives A^T)
        # over SQ terms r, with head bh % H's lam (SQ, D), c (SQ,), base. D fits one tile of BD.
        h = bh % H
        rd = tl.arange(0, BD)
        in_d = (t[:, None] < T) & (rd[None, :] < D)
        a = tl.load(a_ptr + bh * T * D + t[:, None] * D + rd[None, :], mask=in_d, other=0.0).to(tl.float32)  # (C, BD)
        b = tl.load(b_ptr + bh * T * D + t[:, None] * D + rd[None, :], mask=in_d, other=0.0).to(tl.float32)
        A = tl.zeros((C, C), dtype=tl.float32) + tl.load(base_ptr + h)
        for r in range(SQ):
            lam = tl.load(lam_ptr + (h * SQ + r) * D + rd, mask=rd < D, other=0.0)
            W = tl.load(c_ptr + h * SQ + r) + _dot(a * lam[None, :], tl.trans(b), BF16)
            A += W * W
        return A

    @triton.jit(do_not_specialize=["T", "N", "L", "REVERSE"])  # one compiled kernel for every length
    def _states_kernel(k_ptr, v_ptr, w_ptr, S0_ptr, z0_ptr, S_ptr, z_ptr, T, F, DV, N, L, REVERSE,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr, WALK: tl.constexpr):
        # Pass 1. Program ((bh NS + s) NK + i_k) NV + i_v: the (BK, BV) tile of  sum k_n^T v_n  over the L chunks
        # of segment s, n in [s L, s L + L), and in the i_v = 0 programs that of  sum k_n^T w_n  (w: one weight
        # per token). Segments are numbered in walk order, p = s (NS - 1 - s if REVERSE).
        # WALK = False: store the segment's sum at S0[bh, p], z0[bh, p].
        # WALK = True: S0, z0 hold their inclusive prefix sums over p; start from S0[bh, p - 1], z0[bh, p - 1]
        # (the sum over the segments walked before this one; zero at p = 0) and walk the segment's chunks in
        # order (backwards if REVERSE), storing the running sum before each chunk at S[bh, n], z[bh, n].
        # Every segment at once: a program walks L chunks, the whole sequence only when NS = 1 (when B H and
        # the tiles alone give STATE_PROGRAMS programs).
        # One grid axis (up to 2^31 - 1 programs), a segment's tiles side by side on it (after
        # flash-linear-attention's grids, tiles first): they start together and read the same chunks of k (every
        # i_v) and v (every i_k), which the first to load them leaves in L2 for the others.
        pid, NK, NV = tl.program_id(0), tl.cdiv(F, BK), tl.cdiv(DV, BV)
        i_s, i_k, i_v = (pid // (NK * NV)).to(tl.int64), pid // NV % NK, pid % NV
        NS = tl.cdiv(N, L)
        bh, s = i_s // NS, i_s % NS
        p = bh * NS + s + REVERSE * (NS - 1 - 2 * s)  # the segment's row of S0, z0
        rk = i_k * BK + tl.arange(0, BK)
        rv = i_v * BV + tl.arange(0, BV)
        in_S = (rk[:, None] < F) & (rv[None, :] < DV)
        S_tile = rk[:, None] * DV + rv[None, :]
        acc = tl.zeros((BK, BV), dtype=tl.float32)
        acc_z = tl.zeros((BK,), dtype=tl.float32)
        if WALK:
            if p > bh * NS:  # after the first segment walked (which starts from zero)
                acc += tl.load(S0_ptr + (p - 1) * (F * DV + F) + S_tile, mask=in_S, other=0.0)
                acc_z += tl.load(z0_ptr + (p - 1) * (F * DV + F) + rk, mask=rk < F, other=0.0)
        for j in range(0, L):
            n = s * L + j + REVERSE * (L - 1 - 2 * j)  # s L + j, or s L + L - 1 - j walking backwards
            # (chunks past N, in the last segment, load zeros and store nothing)
            if WALK:
                f = tl.where(n < N, F, 0)  # the features stored: none past the last chunk
                out = acc
                if BF16 and EMULATE:  # S is bfloat16: round as the GPU does (the interpreter's store truncates)
                    out = _round_bf16(acc)
                tl.store(S_ptr + (bh * N + n) * F * DV + S_tile, out.to(S_ptr.dtype.element_ty),
                         mask=(rk[:, None] < f) & (rv[None, :] < DV))
                if i_v == 0:
                    tl.store(z_ptr + (bh * N + n) * F + rk, acc_z, mask=rk < f)
            t = n * C + tl.arange(0, C)
            k = tl.load(k_ptr + bh * T * F + t[:, None] * F + rk[None, :],
                        mask=(t[:, None] < T) & (rk[None, :] < F), other=0.0).to(tl.float32)
            v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + rv[None, :],
                        mask=(t[:, None] < T) & (rv[None, :] < DV), other=0.0).to(tl.float32)
            acc += _dot(tl.trans(k), v, BF16)  # (BK, BV)
            if i_v == 0:
                w = tl.load(w_ptr + bh * T + t, mask=t < T, other=0.0).to(tl.float32)
                acc_z += tl.sum(k * w[:, None], 0)
        if not WALK:
            tl.store(S0_ptr + p * (F * DV + F) + S_tile, acc, mask=in_S)
            if i_v == 0:
                tl.store(z0_ptr + p * (F * DV + F) + rk, acc_z, mask=rk < F)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _output_kernel(q_ptr, k_ptr, v_ptr, S_ptr, z_ptr, y_ptr, den_ptr, T, F, DV, N, eps,
                       qs_ptr, ks_ptr, lam_ptr, c_ptr, base_ptr, D, H,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
                       SQ: tl.constexpr, BD: tl.constexpr):
        # Pass 2 (forward). Program (i_v, n, bh): chunk n, value columns [i_v BV, +BV), all F in BK tiles.
        #     A = tril(q k^T),  y = (A v + q S[n]) / (A 1 + q z[n] + eps)
        # SQ > 0: A from the closed form (_square_scores), and the features only meet the state.
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
            in_S = (rk[:, None] < F) & (rv[None, :] < DV)
            S = tl.load(S_ptr + rk[:, None] * DV + rv[None, :], mask=in_S, other=0.0).to(tl.float32)  # (BK, BV)
            z = tl.load(z_ptr + rk, mask=rk < F, other=0.0)
            if SQ == 0:
                k = tl.load(k_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
                A += _dot(q, tl.trans(k), BF16)  # (C, C)
            o += _dot(q, S, BF16)  # (C, BV)
            qz += tl.sum(q * z[None, :], 1)
        if SQ > 0:
            A = _square_scores(qs_ptr, ks_ptr, lam_ptr, c_ptr, base_ptr, bh, t, T, D, H, C, SQ, BD, BF16)
        A = tl.where(rt[:, None] >= rt[None, :], A, 0.0)
        in_v = (t[:, None] < T) & (rv[None, :] < DV)
        v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0).to(tl.float32)
        den = tl.sum(A, 1) + qz + eps  # (C,)
        y = (o + _dot(A, v, BF16)) / den[:, None]
        if EMULATE and y_ptr.dtype.element_ty == tl.bfloat16:  # rounded as the GPU stores it (see _round_bf16)
            y = _round_bf16(y)
        tl.store(y_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], y.to(y_ptr.dtype.element_ty), mask=in_v)
        if i_v == 0:
            tl.store(den_ptr + bh * T + t, den, mask=t < T)

    @triton.jit(do_not_specialize=["T", "N", "L"])  # one compiled kernel for every length
    def _fused_kernel(q_ptr, k_ptr, v_ptr, S0_ptr, z0_ptr, y_ptr, den_ptr, T, F, DV, N, L, eps,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        # The forward in one pass for bf16 inputs with F within one tile (BK >= F): pass 1's walk and pass 2
        # together, the state kept in registers instead of stored. Program (bh NS + s) NV + i_v: segment s's L
        # chunks, value columns [i_v BV, +BV). It starts from S0[bh, s - 1], z0[bh, s - 1] (the running sums of
        # pass 1 with WALK = False over the segments before; zero at s = 0), and at each chunk n
        #     A = tril(q k^T),  y = (A v + q S) / (A 1 + q z + eps),  then  S += k^T v,  z += k^T 1
        # One grid axis, a segment's value tiles side by side on it, as in pass 1: they read the same q and k.
        pid, NV = tl.program_id(0), tl.cdiv(DV, BV)
        i_s, i_v = pid // NV, pid % NV
        NS = tl.cdiv(N, L)
        bh, s = i_s // NS, i_s % NS
        rk = tl.arange(0, BK)
        rv = i_v * BV + tl.arange(0, BV)
        rt = tl.arange(0, C)
        S = tl.zeros((BK, BV), dtype=tl.float32)
        z = tl.zeros((BK,), dtype=tl.float32)
        if s > 0:
            row = (i_s - 1).to(tl.int64) * (F * DV + F)
            S += tl.load(S0_ptr + row + rk[:, None] * DV + rv[None, :], mask=(rk[:, None] < F) & (rv[None, :] < DV),
                         other=0.0)
            z += tl.load(z0_ptr + row + rk, mask=rk < F, other=0.0)
        for j in range(0, L):
            # chunk s L + j: its first token's row, its tokens (past N, in the last segment: loads zeros, stores nothing)
            t0 = bh.to(tl.int64) * T + (s * L + j) * C
            t = (s * L + j) * C + rt
            in_k = (t[:, None] < T) & (rk[None, :] < F)
            in_v = (t[:, None] < T) & (rv[None, :] < DV)
            tile_k, tile_v = rt[:, None] * F + rk[None, :], rt[:, None] * DV + rv[None, :]  # int32 offsets in the chunk
            q = tl.load(q_ptr + t0 * F + tile_k, mask=in_k, other=0.0)  # (C, BK), in the inputs' dtype
            k = tl.load(k_ptr + t0 * F + tile_k, mask=in_k, other=0.0)
            v = tl.load(v_ptr + t0 * DV + tile_v, mask=in_v, other=0.0)  # (C, BV)
            A = tl.where(rt[:, None] >= rt[None, :], _dot(q, tl.trans(k), True), 0.0)  # (C, C)
            den = tl.sum(A, 1) + tl.sum(q.to(tl.float32) * z[None, :], 1) + eps  # (C,)
            y = (_dot(q, S, True) + _dot(A, v, True)) / den[:, None]  # S rounded to bf16 in the dot, as pass 1 stores it
            if EMULATE and y_ptr.dtype.element_ty == tl.bfloat16:  # rounded as the GPU stores it (see _round_bf16)
                y = _round_bf16(y)
            tl.store(y_ptr + t0 * DV + tile_v, y.to(y_ptr.dtype.element_ty), mask=in_v)
            if i_v == 0:
                tl.store(den_ptr + t0 + rt, den, mask=t < T)
            S += _dot(tl.trans(k), v, True)
            z += tl.sum(k.to(tl.float32), 0)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _dqk_kernel(q_ptr, k_ptr, v_ptr, dnum_ptr, dden_ptr, S_ptr, z_ptr, R_ptr, r_ptr, dq_ptr, dk_ptr,
                    T, F, DV, N, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
                    SQ: tl.constexpr):
        # Backward, program (i_k, n, bh): feature columns [i_k BK, +BK) of chunk n, all Dv in BV tiles.
        #     G  = tril(dnum v^T + dden 1^T)
        #     dq = G k + dnum S[n]^T + dden z[n]^T,     dk = G^T q + v R[n]^T + 1 r[n]^T
        # SQ > 0: the scores within a chunk came from the closed form; no G terms here (_dsquares_kernel's).
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
            S = tl.load(S_ptr + rk[:, None] * DV + rv[None, :], mask=in_s, other=0.0).to(tl.float32)  # (BK, BV)
            R = tl.load(R_ptr + rk[:, None] * DV + rv[None, :], mask=in_s, other=0.0).to(tl.float32)
            if SQ == 0:
                G += _dot(dnum, tl.trans(v), BF16)
            dq += _dot(dnum, tl.trans(S), BF16)
            dk += _dot(v, tl.trans(R), BF16)
        dden = tl.load(dden_ptr + bh * T + t, mask=t < T, other=0.0)
        in_k = (t[:, None] < T) & (rk[None, :] < F)
        z = tl.load(z_ptr + (bh * N + n) * F + rk, mask=rk < F, other=0.0)
        r = tl.load(r_ptr + (bh * N + n) * F + rk, mask=rk < F, other=0.0)
        dq += dden[:, None] * z[None, :]
        dk += r[None, :]
        if SQ == 0:
            G = tl.where(rt[:, None] >= rt[None, :], G + dden[:, None], 0.0)
            q = tl.load(q_ptr + bh * T * F + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + bh * T * F + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
            dq += _dot(G, k, BF16)
            dk += _dot(tl.trans(G), q, BF16)
        tl.store(dq_ptr + bh * T * F + t[:, None] * F + rk[None, :], dq.to(dq_ptr.dtype.element_ty), mask=in_k)
        tl.store(dk_ptr + bh * T * F + t[:, None] * F + rk[None, :], dk.to(dk_ptr.dtype.element_ty), mask=in_k)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _dv_kernel(q_ptr, k_ptr, dnum_ptr, R_ptr, dv_ptr, T, F, DV, N,
                   qs_ptr, ks_ptr, lam_ptr, c_ptr, base_ptr, D, H,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
                   SQ: tl.constexpr, BD: tl.constexpr):
        # Backward, program (i_v, n, bh): value columns [i_v BV, +BV) of chunk n, all F in BK tiles.
        #     dv = A^T dnum + k R[n],   A^T_ji = k_j . q_i for i >= j   (SQ > 0: A^T from the closed form)
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
            k = tl.load(k_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)  # (C, BK)
            in_R = (rk[:, None] < F) & (rv[None, :] < DV)
            R = tl.load(R_ptr + rk[:, None] * DV + rv[None, :], mask=in_R, other=0.0).to(tl.float32)  # (BK, BV)
            if SQ == 0:
                q = tl.load(q_ptr + t[:, None] * F + rk[None, :], mask=in_k, other=0.0).to(tl.float32)
                At += _dot(k, tl.trans(q), BF16)  # (C, C)
            dv += _dot(k, R, BF16)  # (C, BV)
        if SQ > 0:
            At = _square_scores(ks_ptr, qs_ptr, lam_ptr, c_ptr, base_ptr, bh, t, T, D, H, C, SQ, BD, BF16)
        At = tl.where(rt[:, None] <= rt[None, :], At, 0.0)
        in_v = (t[:, None] < T) & (rv[None, :] < DV)
        dnum = tl.load(dnum_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0)
        dv += _dot(At, dnum, BF16)
        tl.store(dv_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], dv.to(dv_ptr.dtype.element_ty), mask=in_v)

    @triton.jit(do_not_specialize=["T", "N"])  # one compiled kernel for every length
    def _dsquares_kernel(qs_ptr, ks_ptr, lam_ptr, c_ptr, v_ptr, dnum_ptr, dden_ptr, dqs_ptr, dks_ptr,
                         dlam_ptr, dc_ptr, dbase_ptr, T, D, DV, N, H, C: tl.constexpr, BV: tl.constexpr,
                         BF16: tl.constexpr, SQ: tl.constexpr, BD: tl.constexpr):
        # Backward of the closed-form scores, program (n, bh, side): chunk n, all D in one BD tile, Dv in BV tiles.
        #     G = tril(dnum v^T + dden 1^T),  W_r = c_r + (q' lam_r) k'^T,  dW_r = 2 G W_r
        #     side 0: dq' = sum_r lam_r (dW_r k'), and this chunk's share of dlam_r = sum_i q'_i (dW_r k')_i, dbase = sum G
        #     side 1: dk' = sum_r dW_r^T (q' lam_r), and this chunk's share of dc_r = sum dW_r
        # (two programs per chunk, each recomputing G and W: one holding dq' and dk' both spills registers)
        n, bh, side = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
        h = bh % H
        rt = tl.arange(0, C)
        rd = tl.arange(0, BD)
        t = n * C + rt
        G = tl.zeros((C, C), dtype=tl.float32)
        for j in range(0, tl.cdiv(DV, BV)):
            rv = j * BV + tl.arange(0, BV)
            in_v = (t[:, None] < T) & (rv[None, :] < DV)
            v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0).to(tl.float32)  # (C, BV)
            dnum = tl.load(dnum_ptr + bh * T * DV + t[:, None] * DV + rv[None, :], mask=in_v, other=0.0)
            G += _dot(dnum, tl.trans(v), BF16)
        dden = tl.load(dden_ptr + bh * T + t, mask=t < T, other=0.0)
        G = tl.where(rt[:, None] >= rt[None, :], G + dden[:, None], 0.0)  # (C, C)
        in_d = (t[:, None] < T) & (rd[None, :] < D)
        q = tl.load(qs_ptr + bh * T * D + t[:, None] * D + rd[None, :], mask=in_d, other=0.0).to(tl.float32)  # (C, BD)
        k = tl.load(ks_ptr + bh * T * D + t[:, None] * D + rd[None, :], mask=in_d, other=0.0).to(tl.float32)
        grad = tl.zeros((C, BD), dtype=tl.float32)  # dq' (side 0) or dk' (side 1)
        out = (bh * N + n) * SQ  # this chunk's row in dlam (BH*N*SQ, D) and dc (BH*N*SQ,)
        for r in range(SQ):
            lam = tl.load(lam_ptr + (h * SQ + r) * D + rd, mask=rd < D, other=0.0)
            ql = q * lam[None, :]
            dW = 2 * G * (tl.load(c_ptr + h * SQ + r) + _dot(ql, tl.trans(k), BF16))  # (C, C), 0 above the diagonal
            if side == 0:
                dWk = _dot(dW, k, BF16)  # (C, BD)
                grad += lam[None, :] * dWk
                tl.store(dlam_ptr + (out + r) * D + rd, tl.sum(q * dWk, 0), mask=rd < D)
            else:
                grad += _dot(tl.trans(dW), ql, BF16)
                tl.store(dc_ptr + out + r, tl.sum(tl.sum(dW, 1), 0))
        if side == 0:
            tl.store(dbase_ptr + bh * N + n, tl.sum(tl.sum(G, 1), 0))
            tl.store(dqs_ptr + bh * T * D + t[:, None] * D + rd[None, :], grad.to(dqs_ptr.dtype.element_ty), mask=in_d)
        else:
            tl.store(dks_ptr + bh * T * D + t[:, None] * D + rd[None, :], grad.to(dks_ptr.dtype.element_ty), mask=in_d)

CHUNK = 64  # tokens per chunk in the Triton kernels
STATE_PROGRAMS = 4096  # pass 1's programs per launch, about: enough to fill a GPU of ~100 SMs several times over
MIN_SEGMENT = 8  # chunks: pass 1 is one launch, a walk of the whole sequence, up to 8 chunks (512 tokens)
FUSED_MAX_F = 128  # features up to which a bf16 forward is the fused pass (the state one tile); 0: pass 1, pass 2


def _cdiv(n, d):
    """ceil(n / d) for the launches' Python ints, at every call: triton.cdiv, a Triton constexpr function,
    costs far more to call from Python than this arithmetic."""
    return -(-n // d)


def _tile(n, cap):
    """A power-of-2 tile for a dimension of size n: at least 16 (tl.dot's minimum), at most cap."""
    return min(cap, max(16, triton.next_power_of_2(n)))


@functools.cache  # read on every call of the kernels, and some microseconds of Python to build
def _configs(F, Dv, squares=False):
    """Tile sizes, warps and pipeline stages of each kernel for features F and values Dv (squares: with the
    closed-form scores). Chosen so that every launch fits sm_80's and sm_90's shared memory and spills no
    registers (`python build_check.py` compiles them all and prints the cost of each). Read only."""
    # states: BV = 32 at Dv <= 16 too; on 16-wide tiles its segment walk spills 8 bytes on sm_90 (bf16); and
    # 1 stage there: with 2 the backward's segment sums spill 4 bytes at F = Dv = 8 (bf16, sm_80)
    return {"states": dict(BK=_tile(F, 32), BV=32, num_warps=8, num_stages=1 if Dv <= 16 else 2),
            # fused (bf16 only): C is its chunk (and its segment sums'). At C = 64, BV = 64 spills on sm_80 (triton
            # 3.6), as do pipelined loads at F not a multiple of 16; at C = 32, BV = 64 fits both (for the sweep)
            "fused": dict(C=CHUNK, BK=_tile(F, 128), BV=_tile(Dv, 32), num_warps=8, num_stages=2 if F % 16 == 0 else 1),
            "output": dict(BK=_tile(F, 32), BV=_tile(Dv, 64), num_warps=8, num_stages=2),
            "dqk": dict(BK=_tile(F, 32), BV=_tile(Dv, 32), num_warps=8, num_stages=2),
            # 4 warps at Dv <= 32: with 8, triton 3.6 spills 8 bytes on sm_80 (bf16 inputs, F not a multiple of 16);
            # with squares 4 warps spill instead (float32, D = 64, 6 terms, sm_80)
            "dv": dict(BK=_tile(F, 32), BV=_tile(Dv, 64), num_warps=4 if Dv <= 32 and not squares else 8, num_stages=2),
            "dsquares": dict(BV=_tile(Dv, 32), num_warps=8, num_stages=2)}


def _squares_args(sq, q):
    """The closed form's launch arguments: (qs, ks, lam, c, base, D, H) and the constexprs SQ (its number
    of terms; 0 = scores from the features, when q stands in for the pointers, unread) and BD (D's tile)."""
    if sq is None:
        return (q, q, q, q, q, 1, 1), dict(SQ=0, BD=16)
    qs, ks, lam, c, base = sq
    return (qs, ks, lam, c, base, qs.shape[-1], lam.shape[0]), dict(SQ=lam.shape[1], BD=_tile(qs.shape[-1], 128))


def _segments(N, programs):
    """Pass 1's segments of N chunks when one segment takes `programs` programs (B H x the tiles):
    (L chunks per segment, NS segments), NS as near STATE_PROGRAMS / programs as N allows, and no
    segment shorter than MIN_SEGMENT chunks (shorter ones would sum and write the states twice over)."""
    L = max(MIN_SEGMENT, _cdiv(N, max(1, STATE_PROGRAMS // programs)))
    return L, _cdiv(N, L)


def _is_fused(F_, dtype, squares):
    """Whether the forward is the fused pass: bfloat16 inputs, F up to FUSED_MAX_F, no closed form."""
    return dtype == torch.bfloat16 and F_ <= FUSED_MAX_F and not squares


def _fused_segments(BH, T, F_, Dv):
    """The fused pass's chunks, segments and grid: (C tokens per chunk, L chunks per segment, NS segments,
    NV value tiles)."""
    cfg = _configs(F_, Dv)["fused"]
    NV = _cdiv(Dv, cfg["BV"])
    return (cfg["C"], *_segments(_cdiv(T, cfg["C"]), BH * NV), NV)


def _segment_sums(k, v, w, L, NS, reverse, C):
    """Pass 1 with WALK=False, then a running sum over segments: S0 (BH, NS, F, Dv) and z0 (BH, NS, F),
    float32, row p the sum of k^T v and k^T w (w: (BH, T), or None for ones) over the segments of L chunks
    of C tokens walked up to and including the p-th (in walk order). They share one buffer, rows of
    F Dv + F, so that one cumsum takes both. With NS = 1 nothing reads them: left unset, no launch."""
    BH, T, F_ = k.shape
    Dv, N = v.shape[-1], _cdiv(T, C)
    sums = torch.empty(BH, NS, F_ * Dv + F_, device=k.device, dtype=torch.float32)
    S0, z0 = sums[..., :F_ * Dv].unflatten(-1, (F_, Dv)), sums[..., F_ * Dv:]
    if NS > 1:
        cfg = _configs(F_, Dv)["states"]
        w = torch.ones(BH, T, device=k.device, dtype=torch.float32) if w is None else w
        tiles = (_cdiv(F_, cfg["BK"]), _cdiv(Dv, cfg["BV"]))
        _states_kernel[(BH * NS * tiles[0] * tiles[1],)](k, v, w, S0, z0, S0, z0, T, F_, Dv, N, L, int(reverse),
                                                         C=C, BF16=k.dtype == torch.bfloat16, WALK=False,
                                                         **cfg)  # (S, z unused)
        sums.cumsum_(1)
    return S0, z0


def _states(k, v, w, reverse):
    """Pass 1: exclusive running sums over chunks of k^T v (BH, N, F, Dv; stored in bfloat16 for bfloat16 k,
    else float32) and k^T w (BH, N, F, float32), accumulated in float32 (w: (BH, T), or None for ones).
    The chunks are split into NS segments of L: each segment's sum and their running sum (_segment_sums),
    then each segment walked from the sum before it (WALK=True), writing the state before each chunk once.
    NS gives about STATE_PROGRAMS programs per launch."""
    BH, T, F_ = k.shape
    Dv, N = v.shape[-1], _cdiv(T, CHUNK)
    cfg = _configs(F_, Dv)["states"]
    tiles = (_cdiv(F_, cfg["BK"]), _cdiv(Dv, cfg["BV"]))
    L, NS = _segments(N, BH * tiles[0] * tiles[1])
    w = torch.ones(BH, T, device=k.device, dtype=torch.float32) if w is None else w
    S0, z0 = _segment_sums(k, v, w, L, NS, reverse, CHUNK)
    bf16 = k.dtype == torch.bfloat16  # S meets only bf16 dots then: stored rounded, half the bytes, same results
    S = torch.empty(BH, N, F_, Dv, device=k.device, dtype=torch.bfloat16 if bf16 else torch.float32)
    z = torch.empty(BH, N, F_, device=k.device, dtype=torch.float32)
    _states_kernel[(BH * NS * tiles[0] * tiles[1],)](k, v, w, S0, z0, S, z, T, F_, Dv, N, L, int(reverse), C=CHUNK,
                                                     BF16=bf16, WALK=True, **cfg)
    return S, z


def _triton_forward(q, k, v, eps, sq=None, out_dtype=torch.float32):
    """q, k (BH, T, F), v (BH, T, Dv) contiguous -> y (BH, T, Dv) in out_dtype, den (BH, T) float32. The
    backward needs y in float32: its dden = -(dnum . y) cancels against dnum . v. Without a backward, y is
    written in v's dtype at once. sq: the closed form (qs, ks (BH, T, D), lam (H, SQ, D), c (H, SQ),
    base (H,)), or None. bfloat16 with F up to FUSED_MAX_F and no closed form: the fused pass (each
    segment's sum, then _fused_kernel); else pass 1 then pass 2."""
    BH, T, F_ = q.shape
    Dv = v.shape[-1]
    y = torch.empty(BH, T, Dv, device=q.device, dtype=out_dtype)
    den = torch.empty(BH, T, device=q.device, dtype=torch.float32)
    sq_args, sq_meta = _squares_args(sq, q)
    if _is_fused(F_, q.dtype, sq):
        C, L, NS, NV = _fused_segments(BH, T, F_, Dv)
        S0, z0 = _segment_sums(k, v, None, L, NS, False, C)
        _fused_kernel[(BH * NS * NV,)](q, k, v, S0, z0, y, den, T, F_, Dv, _cdiv(T, C), L, eps,
                                       **_configs(F_, Dv)["fused"])  # (C among the settings)
        return y, den
    S, z = _states(k, v, None, reverse=False)
    cfg, N = _configs(F_, Dv)["output"], _cdiv(T, CHUNK)
    _output_kernel[(_cdiv(Dv, cfg["BV"]), N, BH)](q, k, v, S, z, y, den, T, F_, Dv, N, eps, *sq_args, C=CHUNK,
                                                  BF16=q.dtype == torch.bfloat16, **sq_meta, **cfg)
    return y, den


def _triton_backward(q, k, v, y, den, dy, sq=None):
    """Gradients of the forward above for the output gradient dy (BH, T, Dv): dq, dk, dv, and with sq, the
    closed form's (dqs, dks, dlam, dc, dbase) (else None). States are recomputed."""
    BH, T, F_ = q.shape
    Dv, N = v.shape[-1], _cdiv(T, CHUNK)
    dnum = dy.float() / den[..., None]  # dL/dnum, (BH, T, Dv)
    dden = -(dnum * y).sum(-1)  # dL/dden = -(dy . y) / den, (BH, T)
    S, z = _states(k, v, None, reverse=False)
    R, r = _states(q, dnum, dden, reverse=True)  # R[n] = sum_{m>n} q_m^T dnum_m, r[n] = sum_{m>n} q_m^T dden_m
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cfg, bf16 = _configs(F_, Dv, squares=sq is not None), q.dtype == torch.bfloat16
    sq_args, sq_meta = _squares_args(sq, q)
    _dqk_kernel[(_cdiv(F_, cfg["dqk"]["BK"]), N, BH)](q, k, v, dnum, dden, S, z, R, r, dq, dk, T, F_, Dv, N, C=CHUNK,
                                                      BF16=bf16, SQ=sq_meta["SQ"], **cfg["dqk"])
    _dv_kernel[(_cdiv(Dv, cfg["dv"]["BV"]), N, BH)](q, k, dnum, R, dv, T, F_, Dv, N, *sq_args, C=CHUNK,
                                                    BF16=bf16, **sq_meta, **cfg["dv"])
    if sq is None:
        return dq, dk, dv, None
    qs, ks, lam, c, base = sq
    H, SQ, D = lam.shape
    dqs, dks = torch.empty_like(qs), torch.empty_like(ks)
    dlam = torch.empty(BH, N, SQ, D, device=q.device, dtype=torch.float32)  # each chunk's share, summed below
    dc = torch.empty(BH, N, SQ, device=q.device, dtype=torch.float32)
    dbase = torch.empty(BH, N, device=q.device, dtype=torch.float32)
    _dsquares_kernel[(N, BH, 2)](qs, ks, lam, c, v, dnum, dden, dqs, dks, dlam, dc, dbase, T, D, Dv, N, H, C=CHUNK,
                                 BF16=bf16, **sq_meta, **cfg["dsquares"])
    per_head = lambda x: x.view(BH // H, H, N, *x.shape[2:]).sum((0, 2))  # (H, ...)
    return dq, dk, dv, (dqs, dks, per_head(dlam), per_head(dc), per_head(dbase))


def _flat(qf, kf, v, qs, ks, lam, c, base):
    """The kernels' inputs: q, k, v (B, H, T, .) as (B H, T, .) contiguous, and the closed form's tuple (or None)."""
    B, H, T, F_ = qf.shape
    q, k, v3 = (x.reshape(B * H, T, x.shape[-1]).contiguous() for x in (qf, kf, v))
    if qs is None:
        return q, k, v3, None
    return q, k, v3, tuple(x.reshape(B * H, T, -1).contiguous() for x in (qs, ks)) + \
        tuple(x.float().contiguous() for x in (lam, c, base))


class _TritonLinearAttention(torch.autograd.Function):
    """The Triton path: pass 1 (chunk states) then pass 2 (outputs), or the fused pass, and backward pass 1
    twice (the states forward and backward) then the gradient kernels."""

    @staticmethod
    def forward(ctx, qf, kf, v, eps, qs, ks, lam, c, base):
        B, H, T, F_ = qf.shape
        q, k, v3, sq = _flat(qf, kf, v, qs, ks, lam, c, base)
        y, den = _triton_forward(q, k, v3, eps, sq)
        ctx.save_for_backward(q, k, v3, y, den, *(sq or ()))
        return y.view(B, H, T, -1).to(v.dtype)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, den, *sq = ctx.saved_tensors
        B, H, T, Dv = dy.shape
        dq, dk, dv, dsq = _triton_backward(q, k, v, y, den, dy.reshape(B * H, T, Dv), tuple(sq) or None)
        grads = tuple(x.view(B, H, T, -1) for x in (dq, dk, dv)) + (None,)
        if dsq is None:
            return grads + (None,) * 5
        dqs, dks, dlam, dc, dbase = dsq
        return grads + (dqs.view(B, H, T, -1), dks.view(B, H, T, -1), dlam, dc, dbase)


# ----------------------------------------------------------------------------------------------
# Which sizes backend="auto" trusts on CUDA: those build_check.py compiles for sm_80 and sm_90

BUILD_F = (8, 16, 32, 45, 64, 128, 256, 561, 2145)  # feature sizes the maps produce (45, 2145: Taylor at D 8, 64)
BUILD_DV = (8, 32, 64, 128)
BUILD_SQUARES = ((8, 2), (32, 2), (64, 2), (8, 6), (32, 6), (64, 6))  # (D, SQ) with F = 1 + D + D(D+1)/2: Taylor, OAL


def _code_key(F_, Dv, D=0, SQ=0):
    """What decides the compiled code for sizes F_, Dv (and the closed form's D, SQ): the launch settings and
    whether the sizes divide by 16 or equal 1."""
    sizes = (F_, Dv, D) if SQ else (F_, Dv)
    return repr(_configs(F_, Dv, SQ > 0)), SQ, SQ and _tile(D, 128), tuple((n % 16 == 0, n == 1) for n in sizes)


COVERED = set() if not HAS_TRITON else (
    {_code_key(F_, Dv) for F_ in BUILD_F for Dv in BUILD_DV}
    | {_code_key(1 + D + D * (D + 1) // 2, Dv, D, SQ) for D, SQ in BUILD_SQUARES for Dv in BUILD_DV})
_said = set()


@functools.cache
def triton_covered(F_, Dv, D=0, SQ=0):
    """True when the launches for features F_ and values Dv (with a closed form of SQ terms on D dims)
    compile to code the build check has checked: same tiles, warps, stages and divisibility by 16."""
    return D <= 128 and _code_key(F_, Dv, D, SQ) in COVERED


def check_shapes(a, b, v, names="qf, kf"):
    """a, b (B, H, T, .) alike (qf, kf here; q, k too in attention.py) and v (B, H, T, Dv) unless None, or one
    ValueError naming the shapes: a mismatch would otherwise fail inside a matmul, or broadcast."""
    if a.dim() != 4 or a.shape != b.shape or (v is not None and (v.dim() != 4 or v.shape[:3] != a.shape[:3])):
        what = f"{names} of shape (B, H, T, .) alike" + ("" if v is None else " and v of shape (B, H, T, Dv)")
        got = ", ".join(str(tuple(x.shape)) for x in (a, b, v) if x is not None)
        raise ValueError(f"expected {what}; got {got}")


def causal_linear_attention(qf, kf, v, eps=EPS, backend="auto", squares=None):
    """Normalised causal linear attention. qf, kf: (B, H, T, F); v: (B, H, T, Dv) -> (B, H, T, Dv).

    squares: None, or the kernel qf_i . kf_j in closed form, (q, k, lam, c, base) with q, k (B, H, T, D),
    lam (H, SQ, D), c (H, SQ), base (H,):  qf_i . kf_j = base + sum_r (c_r + sum_l lam_rl q_il k_jl)^2.
    The scores within a chunk then come from q, k, O(C SQ D) per token instead of O(C F), and qf, kf only
    carry the state between chunks. FeatureMap.squares gives it for Taylor, TaylorShift, the quadratic and
    OAL. Gradients flow to all five (autograd adds the paths through qf, kf). backend="auto" uses it only
    when it picks the Triton kernels: on a CPU the fallback is as fast on the features."""
    check_shapes(qf, kf, v)
    if not all(x.is_floating_point() for x in (qf, kf, v)):  # integers would be rounded back into v's dtype
        raise ValueError(f"expected floating-point qf, kf, v; got {qf.dtype}, {kf.dtype}, {v.dtype}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if not 0 <= eps < math.inf:  # a negative eps can zero the denominator of a row that a ReLU map leaves empty
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    F_, Dv = qf.shape[-1], v.shape[-1]
    D = SQ = 0
    if squares is not None:
        qs, ks, lam, c, base = squares
        H, D, SQ = qf.shape[1], qs.shape[-1], lam.shape[1] if lam.dim() == 3 else 0
        if qs.shape[:3] != qf.shape[:3] or ks.shape != qs.shape or lam.shape != (H, SQ, D) or SQ == 0 \
                or c.shape != (H, SQ) or base.shape != (H,):
            raise ValueError("squares: expected q, k (B, H, T, D) with qf's B, H, T, lam (H, SQ, D), c (H, SQ), "
                             "base (H,); got " + ", ".join(str(tuple(x.shape)) for x in squares))
    triton_ok = HAS_TRITON and (qf.is_cuda or (INTERPRET and qf.device.type == "cpu")) and D <= 128
    too_old = f"triton {TRITON_VERSION} is older than {TRITON_MIN[0]}.{TRITON_MIN[1]}, the oldest the kernels are built with"
    if backend == "auto":
        if qf.is_cuda and TRITON_VERSION and not HAS_TRITON and too_old not in _said:
            _said.add(too_old)
            print(f"kernel.py: {too_old}; using the PyTorch fallback")
        backend = "triton" if triton_ok else "torch"
        if backend == "torch":
            squares = None  # the fallback is as fast on the features (bench_kernel.py --closed_form=true)
        if backend == "triton" and qf.is_cuda and not triton_covered(F_, Dv, D, SQ):
            backend = "torch"
            if (F_, Dv, D, SQ) not in _said:
                _said.add((F_, Dv, D, SQ))
                sizes = f"F = {F_}, Dv = {Dv}" + (f", closed form D = {D}, {SQ} terms" if SQ else "")
                print(f"kernel.py: {sizes} is outside the Triton build check; using the PyTorch fallback")
    if backend == "triton" and not triton_ok:
        if TRITON_VERSION is None:
            why = "triton is not installed"
        elif not HAS_TRITON:
            why = too_old
        elif D > 128:
            why = f"the closed form's D = {D} is over the kernels' one tile of 128"
        else:
            why = f"tensors are on {qf.device.type}; Triton needs CUDA, or TRITON_INTERPRET=1 set before import for CPU"
        raise RuntimeError(f"backend='triton' cannot run here: {why}. Use backend='torch'.")
    if 0 in qf.shape[:3]:  # no batch, heads or tokens: nothing to attend (the kernels' shapes would not divide)
        return v.clone()
    squares = squares or (None,) * 5
    if backend == "triton":
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (qf, kf, v, *squares)):
            return _TritonLinearAttention.apply(qf, kf, v, eps, *squares)
        q, k, v3, sq = _flat(qf, kf, v, *squares)
        y, _ = _triton_forward(q, k, v3, eps, sq, out_dtype=v.dtype)  # no backward to come: y in v's dtype at once
        return y.view(*qf.shape[:3], -1)
    # chunk C balances the per-token work within a chunk, C (F + Dv), against the state's, 2 F Dv:
    # C = 2 F Dv / (F + Dv) as a power of 2 in [16, 128] (64 at F = Dv = 64, the fastest there by measurement)
    chunk = min(128, max(16, 2 ** round(math.log2(2 * F_ * Dv / (F_ + Dv)))))
    return _ChunkedLinearAttention.apply(qf, kf, v, eps, chunk, *squares)
