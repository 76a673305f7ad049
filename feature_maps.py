"""
Feature maps phi for linear attention: every map the Hedgehog and OAL papers compare, fixed and learned.

Linear attention replaces the softmax kernel exp(q.k / sqrt(D)) with a dot product of features,
K(q, k) = phi_q(q) . phi_k(k), so that causal attention can be computed with running sums
(Hedgehog Sec. 2; OAL Sec. 2). Every map here is a module with

    forward(q, k, offset=0) -> (qf, kf)    q, k: (B, H, T, D)  ->  qf, kf: (B, H, T, F)

Both sides go in together because some maps are asymmetric (OAL and TaylorShift put their
coefficients on the query side; `exp` stabilises queries and keys differently) and one is
position-aware (cosFormer; `offset` is the index of the first token, for step-by-step decoding).
Features come out in float32 (float64 stays float64): they are exponentials and squares, and
fp16 cannot hold e^12. Linear attention accumulates in float32 anyway.

Fixed maps        elu, relu, exp (temperature t), performer, cosformer, taylor
Learned maps      t2r, hedgehog, taylorshift, dijiang, quadratic, oal

    Hedgehog paper (Zhang et al. 2024, arXiv 2402.04347): Sec. 3.2 and Table 2 (elu, relu,
    performer, cosformer, exp phi_t), Sec. 4.1 (taylor), Sec. 4.2 and App. A.1 (hedgehog),
    Sec. 5.4 (t2r).
    OAL paper (Sun et al. 2026, arXiv 2610.13674): Sec. 2 (global quadratic), Sec. 4.1-4.3 and
    App. D (grouped quadratic kernel; its grouping, Sec. 3.1, 4.2 and App. B, is oal_groups.py),
    App. F.1 (taylorshift, dijiang baselines).

make_feature_map(name, head_dim, num_heads, **kwargs) builds one; FEATURE_MAPS lists them all.
Learned maps keep one set of parameters per head (leading dimension H).
"""
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from oal_groups import contribution_scores, find_groups


def _fp32(x):
    """Upcast half precision to float32; float32 and float64 are left as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _positive_int(where, key, n):
    """Refuse a size or count that is not an integer >= 1 (0 builds empty features; True passes as 1)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {n!r}")


def pair_products(x):
    """(x_l x_m) for l >= m, in torch.tril_indices order: (..., D) -> (..., D(D+1)/2).
    Built row by row with slices, which on a CPU beats indexing with index tensors, mostly in backward."""
    return torch.cat([x[..., l:l + 1] * x[..., :l + 1] for l in range(x.shape[-1])], dim=-1)


def quadratic_features(x):
    """vec(x x^T) / sqrt(2) in packed form: (..., D) -> (..., D(D+1)/2), the pairs l >= m.

    The full vec(x x^T) / sqrt(2) has D^2 entries and each off-diagonal pair twice; keeping l >= m and
    scaling the off-diagonal ones by sqrt(2) gives the same dot product, (x.y)^2 / 2, with half the features.
    """
    D = x.shape[-1]
    l, m = torch.tril_indices(D, D, device=x.device)
    scale = torch.full(l.shape, 1.0, dtype=x.dtype, device=x.device)  # x's dtype: a float32 sqrt(2) costs float64 digits
    scale[l == m] = 1 / math.sqrt(2)
    return pair_products(x) * scale


def stable_exp_qk(yq, yk, max_exponent=60.0):
    """exp(yq), exp(yk) without overflow, leaving the normalised attention weights unchanged.

    Query side: subtract each token's max over features. That scales row i of the weights by a
    constant, which the normalisation removes, so the weights are exactly unchanged.
    Key side: a per-token shift would reweight the keys, so none is applied. Instead the exponent
    is clamped at 60, which only touches inputs that are already absurd: e^60 * 32K tokens * 2145
    features stays below the float32 maximum, so the running key sums cannot overflow.
    """
    qf = torch.exp(yq - yq.amax(dim=-1, keepdim=True).detach())
    kf = torch.exp(yk.clamp(max=max_exponent))
    return qf, kf


def _taylor_squares(q, k, half):
    """FeatureMap.squares of 1 + s + s^2/2 = (1 + s/2)^2 + (s/2)^2, with s/2 = sum_l half_l q_l k_l and
    half broadcastable to (H, 1, D)."""
    H, D = q.shape[1], q.shape[-1]
    c = torch.tensor([1.0, 0.0], dtype=q.dtype, device=q.device).expand(H, 2)
    return q, k, half.expand(H, 2, D), c, torch.zeros(H, dtype=q.dtype, device=q.device)


class FeatureMap(nn.Module):
    """A symmetric map: the same phi on both sides. Subclasses define phi (or override forward).
    Every map is built as Map(head_dim, num_heads, **options) and takes q, k of that head_dim and, when
    num_heads > 1, that many heads (with num_heads = 1, a learned map shares one set of parameters over all heads)."""

    def __init__(self, head_dim, num_heads=1):
        super().__init__()
        _positive_int(type(self).__name__, "head_dim", head_dim)
        _positive_int(type(self).__name__, "num_heads", num_heads)
        self.head_dim, self.num_heads = head_dim, num_heads

    def __call__(self, q, k, offset=0):
        """forward(q, k, offset), once q and k are checked."""
        self.check(q, k)
        return super().__call__(q, k, offset)

    def check(self, q, k):
        """q, k must be (B, H, T, D) with this map's D (and H, if built for more than one head). A wrong size
        would otherwise fail deep in an einsum, or not at all (Taylor's scale 1/D^(1/4) is the built D's)."""
        if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"{type(self).__name__}: expected q, k of shape (B, H, T, D), got "
                             f"{tuple(q.shape)} and {tuple(k.shape)}")
        if q.shape[-1] != self.head_dim or (self.num_heads > 1 and q.shape[1] != self.num_heads):
            raise ValueError(f"{type(self).__name__} was built for head_dim={self.head_dim}, num_heads={self.num_heads}; "
                             f"got q, k of shape {tuple(q.shape)} (B, H, T, D)")

    def forward(self, q, k, offset=0):
        return self.phi(_fp32(q)), self.phi(_fp32(k))

    def squares(self, q, k):
        """The kernel in closed form, or None (the default): (q', k', lam, c, base), q', k' (B, H, T, D),
        lam (H, SQ, D), c (H, SQ), base (H,), in float32 (float64 stays), with

            phi_q(q_i) . phi_k(k_j) = base + sum_r (c_r + sum_l lam_rl q'_il k'_jl)^2.

        The polynomial maps have one: their F = 1 + D + D(D+1)/2 features only carry the state, and the
        scores of nearby pairs cost SQ D each instead of F (kernel.causal_linear_attention's squares)."""
        return None

    def scores(self, q, k):
        """The kernel at every pair, phi_q(q_i) . phi_k(k_j): (B, H, T, S) in float32, unnormalised. The
        O(T^2) forms (attention.attention_weights, the distillation losses) start from this: from the
        closed form (squares) when that costs less per pair than the features."""
        self.check(q, k)
        sq, D = self.squares(q, k), q.shape[-1]
        if sq is None or sq[2].shape[1] * D >= 1 + D + D * (D + 1) // 2:  # per pair: SQ D against the polynomial maps' F
            qf, kf = self(q, k)
            return _fp32(qf) @ _fp32(kf).transpose(-1, -2)
        q, k, lam, c, base = sq
        K = base[:, None, None]
        for r in range(lam.shape[1]):
            K = K + ((q * lam[:, None, r]) @ k.transpose(-1, -2) + c[:, r, None, None]).square()
        return K


# ----------------------------------------------------------------------------------------------
# fixed maps


class Elu(FeatureMap):
    """1 + elu(x) (Katharopoulos et al. 2020). F = D.

    Written as relu(x) + exp(min(x, 0)), the same as where(x >= 0, x + 1, exp(x)): the textbook
    elu(x) + 1 computes 1 + (e^x - 1), which cancels to 0 near x = -8 in bf16 (x = -17 in fp32),
    and a zero feature can zero a row. (No torch.where: on a CPU it is slower, forward and backward.)
    """

    def phi(self, x):
        return F.relu(x) + torch.exp(x.clamp(max=0))


class Relu(FeatureMap):
    """relu(x). F = D. Rows can be all zero, which is why linear attention adds eps to its denominator."""

    def phi(self, x):
        return F.relu(x)


class Exp(FeatureMap):
    """phi_t(x) = exp(t x) element-wise (Hedgehog Table 2). F = D. In the paper t = 1 fails
    associative recall and t = 2 solves it (Sec. 3.2).

    When q and k come from learned, unnormalised projections, exp(t W x) = exp((t W) x): t only rescales
    the initialisation and the learning rate of W. normalize=True makes t a temperature: q and k are
    L2-normalised first, so every element lies in [-1, 1], each kernel term e^(t (q_l + k_l)) in
    [e^-2t, e^2t], and how peaked a row can be is set by t alone (exp_norm_ratio_bound, below).
    """

    def __init__(self, head_dim, num_heads=1, t=1.0, normalize=False):
        super().__init__(head_dim, num_heads)
        if not math.isfinite(t):
            raise ValueError(f"exp: t must be a finite number, got {t}")
        self.t, self.normalize = t, normalize

    def forward(self, q, k, offset=0):
        q, k = _fp32(q), _fp32(k)
        if self.normalize:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return stable_exp_qk(self.t * q, self.t * k)


def exp_norm_ratio_bound(t, head_dim):
    """How far Exp(normalize=True) can lift one key over another: for unit q, k, k' of D = head_dim,
    K(q, k) / K(q, k') is at most the value returned, K(q, k) = sum_l e^(t x_l) with x = q + k, |x| <= 2.
    Below, by Jensen, K >= D e^(t mean(x)) >= D e^(-2t / sqrt(D)). Above, by the power series,
    K <= D + 2t sqrt(D) + e^(2t) - 1 - 2t, since sum_l x_l <= 2 sqrt(D) and sum_l x_l^n <= |x|^n <= 2^n
    for n >= 2. So a row puts at most n R / (n R + m) on n positions against m others, R this bound."""
    D = head_dim
    return (math.exp(2 * t) + D - 1 + 2 * t * (math.sqrt(D) - 1)) / (D * math.exp(-2 * t / math.sqrt(D)))


class Performer(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021), unbiased for exp(s):

        phi(x) = m^-1/2 exp(W x' - |x'|^2 / 2),  x' = x / D^(1/4),   E[phi(q) . phi(k)] = exp(q.k / sqrt(D)).

    m defaults to round(D ln D) (266 at D = 64), the Performer paper's choice.
    W has m rows: orthogonal Gaussian blocks of D rows (QR of a Gaussian matrix), each row rescaled
    to a chi(D)-distributed norm so that it is marginally N(0, I). One W per head, a buffer, drawn once.
    No max is subtracted (the Performer code's stabilisation shifts the key side too, which biases the
    estimator). F = m.
    """

    def __init__(self, head_dim, num_heads=1, num_features=None):
        super().__init__(head_dim, num_heads)
        self.D, self.H = head_dim, num_heads
        if num_features is not None:
            _positive_int("performer", "num_features", num_features)
        self.m = num_features or max(1, round(head_dim * math.log(head_dim)))
        self.register_buffer("W", self.draw())

    def draw(self, generator=None):
        W = torch.empty(self.H, self.m, self.D)
        for h in range(self.H):
            blocks = []
            for _ in range(math.ceil(self.m / self.D)):
                G = torch.randn(self.D, self.D, generator=generator)
                Q, R = torch.linalg.qr(G)  # orthonormal columns
                Q = Q * torch.sign(torch.diagonal(R))  # Haar-uniform: without it one sign is fixed and exp(s) is biased
                blocks.append(Q.T)
            rows = torch.cat(blocks)[: self.m]  # (m, D), unit rows, orthogonal within a block
            norms = torch.randn(self.m, self.D, generator=generator).norm(dim=-1, keepdim=True)
            W[h] = rows * norms
        return W

    def phi(self, x):
        x = x / self.D ** 0.25
        y = torch.einsum("bhtd,hmd->bhtm", x, self.W.to(x.dtype)) - (x * x).sum(-1, keepdim=True) / 2
        return torch.exp(y) / math.sqrt(self.m)


class CosFormer(FeatureMap):
    """cosFormer (Qin et al. 2022): phi(x_i) = [relu(x_i) cos(pi i / 2M), relu(x_i) sin(pi i / 2M)],
    so phi(q_i) . phi(k_j) = relu(q_i) . relu(k_j) cos(pi (i - j) / 2M). F = 2D.

    M is the sequence length of the call (the paper's choice) or a fixed max_len. Decoding one
    token at a time needs max_len, since the final length is not known yet.
    """

    def __init__(self, head_dim, num_heads=1, max_len=None):
        super().__init__(head_dim, num_heads)
        if max_len is not None:
            _positive_int("cosformer", "max_len", max_len)
        self.max_len = max_len

    def forward(self, q, k, offset=0):
        T = q.shape[-2]
        if self.max_len is None and offset > 0:
            raise ValueError("cosformer: step-by-step decoding needs a fixed max_len "
                             "(make_feature_map('cosformer', D, max_len=...))")
        M = self.max_len or T
        if offset + T > M:
            raise ValueError(f"cosformer: position {offset + T - 1} is past max_len={M}")
        q, k = F.relu(_fp32(q)), F.relu(_fp32(k))
        i = torch.arange(offset, offset + T, device=q.device, dtype=q.dtype)  # float32 (or float64): MPS has no float64
        angle = (math.pi / (2 * M) * i)[:, None]  # (T, 1)
        return (torch.cat([q * angle.cos(), q * angle.sin()], dim=-1),
                torch.cat([k * angle.cos(), k * angle.sin()], dim=-1))


class Taylor(FeatureMap):
    """Second-order Taylor expansion of exp (Hedgehog Sec. 4.1, Keles et al. 2023):

        phi(x) = [1, x / D^(1/4), vec(x x^T) / (sqrt(2) sqrt(D))],   phi(q) . phi(k) = 1 + s + s^2 / 2 exactly.

    F = 1 + D + D(D+1)/2 (2145 at D = 64; the unpacked vec(x x^T) would give 4161).
    Always positive: 1 + s + s^2/2 = ((1 + s)^2 + 1) / 2.
    """

    def phi(self, x):
        x = x / self.head_dim ** 0.25
        return torch.cat([torch.ones_like(x[..., :1]), x, quadratic_features(x)], dim=-1)

    def squares(self, q, k):
        q, k = _fp32(q), _fp32(k)
        half = torch.full((1, 1, 1), 0.5 / math.sqrt(self.head_dim), dtype=q.dtype, device=q.device)  # s/2 = half q.k
        return _taylor_squares(q, k, half)


# ----------------------------------------------------------------------------------------------
# learned maps


class T2R(FeatureMap):
    """T2R (Kasai et al. 2021): relu(W x + b), one trainable linear layer per head, nn.Linear's
    initialisation. With the Hedgehog distillation loss it becomes the paper's "T2R-HH". F = D."""

    def __init__(self, head_dim, num_heads=1):
        super().__init__(head_dim, num_heads)
        bound = 1 / math.sqrt(head_dim)
        self.W = nn.Parameter(torch.empty(num_heads, head_dim, head_dim).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.empty(num_heads, 1, head_dim).uniform_(-bound, bound))

    def phi(self, x):  # (B, H, T, D) @ (H, D, F) -> (B, H, T, F)
        return F.relu(x @ self.W.to(x.dtype) + self.b.to(x.dtype))


class Hedgehog(FeatureMap):
    """Hedgehog (Hedgehog Sec. 4.2, App. A.1-A.2): one linear layer per head, identity init and zero
    bias, then the negation mapping so that negative dimensions also count. F = 2f, f = feature_dim (D).

        y = W x + b                (W: D x f, at init the identity on the first f dimensions)
        mode="softmax"  (default)  phi(x) = softmax([y, -y])          one softmax over all 2f features
        mode="softmax_halves"      phi(x) = [softmax(y), softmax(-y)]  a softmax per half
        mode="exp"                 phi(x) = [exp(y), exp(-y)]          the paper's Sec. 4.2 form

    The two softmax modes are the paper's stable variant (App. A.1); they are different functions
    (halves: each half sums to 1; all: the whole vector sums to 1), and both stay finite in bf16/fp16
    for any input because a softmax subtracts its max. The default is the single softmax. The exp
    mode is stabilised like `exp` (exact query-side max, key-side clamp at e^60).
    As in the paper, queries and keys of a head share one map. LoLCATs' configs give keys their own
    (separate_qk=True: W_k, b_k), a softmax per half and feature_dim = D / 2.
    """

    def __init__(self, head_dim, num_heads=1, mode="softmax", separate_qk=False, feature_dim=None):
        super().__init__(head_dim, num_heads)
        if mode not in ("softmax", "softmax_halves", "exp"):
            raise ValueError(f"hedgehog: mode must be 'softmax', 'softmax_halves' or 'exp', got {mode!r}")
        self.mode, f = mode, head_dim if feature_dim is None else feature_dim
        _positive_int("hedgehog", "feature_dim", f)
        eye = torch.eye(head_dim, f).expand(num_heads, head_dim, f)
        self.W = nn.Parameter(eye.clone())  # (H, D, f), y = x @ W + b
        self.b = nn.Parameter(torch.zeros(num_heads, 1, f))
        self.Wk = nn.Parameter(eye.clone()) if separate_qk else None
        self.bk = nn.Parameter(torch.zeros(num_heads, 1, f)) if separate_qk else None

    def forward(self, q, k, offset=0):
        q, k = _fp32(q), _fp32(k)
        Wk, bk = (self.W, self.b) if self.Wk is None else (self.Wk, self.bk)
        yq = q @ self.W.to(q.dtype) + self.b.to(q.dtype)  # (B, H, T, f)
        yk = k @ Wk.to(k.dtype) + bk.to(k.dtype)
        yq, yk = torch.cat([yq, -yq], dim=-1), torch.cat([yk, -yk], dim=-1)  # (B, H, T, 2f)
        if self.mode == "exp":
            return stable_exp_qk(yq, yk)
        if self.mode == "softmax":
            return yq.softmax(-1), yk.softmax(-1)
        halves = lambda y: torch.cat([half.softmax(-1) for half in y.chunk(2, dim=-1)], dim=-1)
        return halves(yq), halves(yk)


class TaylorShift(FeatureMap):
    """TaylorShift (Nauen et al. 2024; OAL App. F.1): q, k L2-normalised, a learned temperature tau
    per head (init 1), kernel 1 + tau x + (tau x)^2 / 2 with x = q_hat . k_hat.

    tau sits on the query side only, phi_q = [1, tau q_hat, tau^2 qq(q_hat)], phi_k = [1, k_hat, qq(k_hat)],
    so any sign of tau works. F = 1 + D + D(D+1)/2.
    """

    def __init__(self, head_dim, num_heads=1):
        super().__init__(head_dim, num_heads)
        self.tau = nn.Parameter(torch.ones(num_heads, 1, 1))

    def forward(self, q, k, offset=0):
        q, k = F.normalize(_fp32(q), dim=-1), F.normalize(_fp32(k), dim=-1)
        tau = self.tau.to(q.dtype)
        one = torch.ones_like(q[..., :1])
        qf = torch.cat([one, tau * q, tau ** 2 * quadratic_features(q)], dim=-1)
        kf = torch.cat([one, k, quadratic_features(k)], dim=-1)
        return qf, kf

    def squares(self, q, k):
        q, k = F.normalize(_fp32(q), dim=-1), F.normalize(_fp32(k), dim=-1)
        return _taylor_squares(q, k, self.tau.to(q.dtype) / 2)  # s = tau x


class DiJiang(FeatureMap):
    """DiJiang (Chen et al. 2024; OAL App. F.1): phi(x) = w * softmax(x P), P = C T, with C the
    orthonormal DCT-II matrix and T a diagonal of standard Gaussian quantiles Phi^-1(i / (D + 1)),
    i = 1..D (a quasi-Monte Carlo frequency grid). w: trainable positive weights per head, stored
    as log w (init 0, so w = 1). F = D."""

    def __init__(self, head_dim, num_heads=1):
        super().__init__(head_dim, num_heads)
        D = head_dim
        n, i = torch.arange(D, dtype=torch.float64)[:, None], torch.arange(D, dtype=torch.float64)[None, :]
        C = torch.cos(math.pi * (n + 0.5) * i / D) * math.sqrt(2 / D)  # C[n, i], orthonormal DCT-II
        C[:, 0] /= math.sqrt(2)
        quantiles = torch.special.ndtri(torch.arange(1, D + 1, dtype=torch.float64) / (D + 1))
        self.register_buffer("P", (C * quantiles).float())  # C @ diag(quantiles), (D, D)
        self.log_w = nn.Parameter(torch.zeros(num_heads, 1, D))

    def phi(self, x):
        return self.log_w.exp().to(x.dtype) * (x @ self.P.to(x.dtype)).softmax(-1)


class OAL(FeatureMap):
    """OAL grouped quadratic kernel (OAL Sec. 4.1-4.3, App. D). The learned global quadratic is the
    one-group case (make_feature_map("quadratic", ...)).

    Per head, with u_l = q_l k_l / sqrt(D) and group partial logits z_g = sum_{l in g} u_l (sum_g z_g = s):

        K(q, k) = eps + || [1, z_1 .. z_G] L ||^2,   L lower-triangular (G+1) x (G+1),  M = L L^T
                = a + sum_g b_g z_g + sum_gh C_gh z_g z_h,   a = M_00 + eps, b_g = 2 M_0g, C_gh = M_gh.

    K > 0 for every q, k by construction. It is separable, but only asymmetrically (b can be
    negative; K is positive but not a Mercer kernel), so every coefficient goes on the query side:

        phi_k(k) = [1, k_l, (k_l k_m)_{l>=m}]
        phi_q(q) = [a, s0 b_g(l) q_l, mu_lm s0^2 C_g(l)g(m) q_l q_m],  s0 = 1/sqrt(D), mu = 1 (l = m) or 2.

    F = 1 + D + D(D+1)/2. L starts at the Taylor factor (L_00 = 1, L_g0 = L_g1 = 1/2), which gives
    1 + s + s^2/2 for any grouping. groups: (H, D) group index of each dimension, 0 = the
    low-contribution bulk; all zeros (one group) until set_groups() or set_groups_from() is called.
    """

    def __init__(self, head_dim, num_heads=1, max_groups=5, eps=1e-6):
        super().__init__(head_dim, num_heads)
        _positive_int("oal", "max_groups", max_groups)
        if not 0 < eps < math.inf:
            raise ValueError(f"oal: eps must be a finite positive number, got {eps}")
        self.D, self.G, self.eps = head_dim, max_groups, eps
        L = torch.zeros(num_heads, max_groups + 1, max_groups + 1)
        L[:, 0, 0] = 1.0
        L[:, 1:, 0] = L[:, 1:, 1] = 0.5
        self.L = nn.Parameter(L)
        self.register_buffer("groups", torch.zeros(num_heads, head_dim, dtype=torch.long))

    @torch.no_grad()
    def set_groups(self, groups):
        """Fix the grouping, (H, D) ints in [0, max_groups)."""
        groups = torch.as_tensor(groups, dtype=torch.long, device=self.groups.device)
        if groups.shape != self.groups.shape or groups.min() < 0 or groups.max() >= self.G:
            raise ValueError(f"oal: groups must be {tuple(self.groups.shape)} ints in [0, {self.G}), "
                             f"got shape {tuple(groups.shape)}")
        self.groups.copy_(groups)

    def set_groups_from(self, q, k, causal=True, budget=None):
        """OAL Sec. 4.2: contribution scores of calibration q, k (B, H, T, D), one row per sequence,
        then each head's stable-gap groups (find_groups; budget=G: the G - 1 best boundaries). Returns the groups, (H, D)."""
        scores = contribution_scores(q, k, causal).cpu()  # (B, H, D)
        self.set_groups(torch.stack([find_groups(scores[:, h], budget=budget) for h in range(scores.shape[1])]))
        return self.groups

    def coefficients(self):
        """a: (H,), b: (H, G), C: (H, G, G) from L (the expanded kernel above)."""
        L = torch.tril(self.L)
        M = L @ L.transpose(-1, -2)
        return M[:, 0, 0] + self.eps, 2 * M[:, 0, 1:], M[:, 1:, 1:]

    def forward(self, q, k, offset=0):
        q, k = _fp32(q), _fp32(k)
        H, D = self.groups.shape
        s0 = 1 / math.sqrt(D)
        a, b, C = (c.to(q.dtype) for c in self.coefficients())  # (H,), (H, G), (H, G, G)
        l, m = torch.tril_indices(D, D, device=q.device)  # the P = D(D+1)/2 pairs l >= m
        group_l, group_m = self.groups[:, l], self.groups[:, m]  # (H, P): the groups of each pair's two dims
        heads = torch.arange(H, device=q.device)[:, None]
        b_dim = b[heads, self.groups]  # (H, D): b_g(l)
        C_pair = C[heads, group_l, group_m]  # (H, P): C_g(l)g(m)
        mu = torch.where(l == m, 1.0, 2.0).to(q.dtype)  # the pair (l, m) stands for both (l, m) and (m, l)
        kf = torch.cat([torch.ones_like(k[..., :1]), k, pair_products(k)], dim=-1)
        qf = torch.cat([a[:, None, None] * torch.ones_like(q[..., :1]),  # (B, H, T, 1)
                        s0 * b_dim[:, None, :] * q,  # (B, H, T, D)
                        s0 ** 2 * (mu * C_pair)[:, None, :] * pair_products(q)], dim=-1)  # (B, H, T, P)
        return qf, kf

    def squares(self, q, k):
        # K = eps + sum_r w_r^2,  w_r = ([1, z] L)_r = L_0r + sum_g z_g L_(g+1)r = L_0r + sum_l L_(g(l)+1)r q_l k_l / sqrt(D)
        q, k = _fp32(q), _fp32(k)
        H, D = self.groups.shape
        L = torch.tril(self.L).to(q.dtype)  # (H, G+1, G+1)
        lam = L[torch.arange(H, device=q.device)[:, None], self.groups + 1].transpose(1, 2) / math.sqrt(D)  # (H, G+1, D)
        return q, k, lam, L[:, 0], torch.full((H,), self.eps, dtype=q.dtype, device=q.device)


class Quadratic(OAL):
    """The learned global quadratic a + b s + c s^2 = eps + ||[1, s] L||^2 (OAL Sec. 2, App. D): one group."""

    def __init__(self, head_dim, num_heads=1, eps=1e-6):
        super().__init__(head_dim, num_heads, max_groups=1, eps=eps)


FEATURE_MAPS = {
    "elu": Elu, "relu": Relu, "exp": Exp, "performer": Performer, "cosformer": CosFormer,
    "taylor": Taylor, "t2r": T2R, "hedgehog": Hedgehog, "taylorshift": TaylorShift,
    "dijiang": DiJiang, "quadratic": Quadratic, "oal": OAL,
}


def make_feature_map(name, head_dim, num_heads=1, **kwargs):
    """Build feature map `name` for num_heads heads of size head_dim. kwargs are the map's options (e.g.
    t=2 for exp, mode='softmax_halves' for hedgehog, max_len=... for cosformer, max_groups=... for oal)."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; valid names: {', '.join(FEATURE_MAPS)}")
    options = list(inspect.signature(FEATURE_MAPS[name]).parameters)[2:]  # after head_dim, num_heads
    unknown = [key for key in kwargs if key not in options]
    if unknown:
        raise ValueError(f"feature map {name!r} has no option {', '.join(unknown)}; "
                         f"its options: {', '.join(options) or 'none'}")  # one line, not __init__'s TypeError
    return FEATURE_MAPS[name](head_dim, num_heads, **kwargs)
