"""
Softmax attention, linear attention in all its forms, LoLCATs' window + linear hybrid, and the
multi-head attention module every model uses.

Softmax attention (Hedgehog Sec. 2):   y_i = sum_j softmax_j(q_i . k_j / sqrt(D)) v_j
Linear attention (Hedgehog Sec. 2, OAL Sec. 2), with features qf = phi_q(q), kf = phi_k(k):

    y_i = qf_i^T S_i / (qf_i^T z_i + eps),   S_i = sum_{j<=i} kf_j v_j^T  (F x Dv),   z_i = sum_{j<=i} kf_j  (F)

computed five ways that must agree (test_all.py checks each against a float64 loop):
    linear_attention_quadratic   materialise A = (qf kf^T) * mask, normalise rows: O(T^2), the weights are visible
    linear_attention_cumsum      running sums of outer products kf_j v_j^T: O(T F Dv) memory, readable, slow
    linear_attention_chunked     the chunked algorithm written plainly: quadratic inside a chunk, state across
    linear_attention             causal: the same algorithm, fast (kernel.py, Triton or PyTorch); bidirectional: closed form
    linear_attention_step        one token at a time with an (S, z) state of size F x Dv: generation
EPS (1e-6) keeps the denominator away from 0 when a map (ReLU) gives a row of zero weights; every form
and every model uses it. DISTILL_EPS (1e-12) is the one of Hedgehog's distillation weights (Sec. 4.2).
States and sums are float32 whatever the input dtype.

Shapes: q, k (B, H, T, D); v (B, H, T, Dv); qf, kf (B, H, T, F). Public interface:
    softmax_attention(q, k, v, causal=True)
    linear_attention(qf, kf, v, causal=True, eps=EPS, backend="auto")
    attention_weights(q, k, fmap=None, causal=True, eps=DISTILL_EPS, window=0, gate=1.0) -> (B, H, T, T) weights
    entropy(weights) -> (B, H, T) row entropies in nats
    linear_attention_chunked(qf, kf, v, chunk=64)
    linear_attention_step(qf_t, kf_t, v_t, state=None) -> (y_t, state)
LoLCATs' hybrid (softmax over the last w tokens, linear attention beyond; see its section below) and
the window alone, in three forms each (test_hybrid.py checks them against a float64 loop):
    hybrid_attention_quadratic(q, k, qf, kf, v, window, gate)   O(T^2), hybrid_weights(...) the weights
    hybrid_attention(q, k, qf, kf, v, window, gate)             causal, O(T), by chunks
    hybrid_attention_step(q_t, k_t, qf_t, kf_t, v_t, window, gate, cache) -> (y_t, cache)
    sliding_window_attention(q, k, v, window)                   swa: the hybrid without features
The Triton kernels are linear-only: the hybrid and swa run these PyTorch forms.
The modules:
    MultiHeadAttention(d_model, n_head, attention: a name in ATTENTIONS, qk_dim=None, window=64)
    Block(d_model, n_head, attention, mlp_ratio=4): the pre-norm Transformer block of every model here
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from feature_maps import FEATURE_MAPS, _fp32, make_feature_map
from kernel import EPS, causal_linear_attention, check_shapes  # EPS = 1e-6, the linear attention denominator's guard

DISTILL_EPS = 1e-12  # the normaliser of the weights Hedgehog distils (Sec. 4.2)


def causal_mask(T, device=None):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T), True where j <= i


def entropy(weights):
    """Entropy in nats of each row of attention weights, -sum_j a_ij log a_ij: (..., T, T) -> (..., T).
    Low entropy = spiky attention (Hedgehog Sec. 3.1); uniform over n keys is log n."""
    return -(weights * weights.clamp_min(1e-30).log()).sum(-1)


def softmax_attention(q, k, v, causal=True):
    """The readable reference: softmax(q k^T / sqrt(D)) v. Models call F.scaled_dot_product_attention, which
    tests check equals this."""
    check_shapes(q, k, v, "q, k")
    return attention_weights(q, k, causal=causal).to(v.dtype) @ v


def _normalise(A, causal=True, eps=EPS):
    """Kernel values A (B, H, T, T) -> linear attention weights A_ij / (sum_l A_il + eps), j <= i if causal."""
    if causal:
        A = A.masked_fill(~causal_mask(A.shape[-1], A.device), 0.0)
    return A / (A.sum(-1, keepdim=True) + eps)


def linear_weights(qf, kf, causal=True, eps=EPS):
    """Normalised linear attention weights A_ij = qf_i . kf_j / (sum_l qf_i . kf_l + eps), (B, H, T, T)."""
    return _normalise(_fp32(qf) @ _fp32(kf).transpose(-1, -2), causal, eps)


def _features(fmap, q, k, offset=0):
    """(qf, kf) of fmap; zero-width when fmap is None (swa: the window alone, no linear part)."""
    return (q[..., :0], k[..., :0]) if fmap is None else fmap(q, k, offset=offset)


def attention_weights(q, k, fmap=None, causal=True, eps=DISTILL_EPS, window=0, gate=1.0):
    """(B, H, T, T) attention weights: softmax of q, k if fmap is None, else the linear weights of fmap's
    kernel (fmap.scores(q, k), the same as linear_weights(*fmap(q, k)), cheaper for the polynomial maps).
    eps = 1e-12 as in Hedgehog's distillation (Sec. 4.2); it only matters for all-zero rows.
    window > 0: LoLCATs' hybrid weights with gate g (hybrid_weights), or swa's if fmap is None."""
    check_shapes(q, k, None, "q, k")  # a shorter k failed inside the causal mask
    if window:
        return hybrid_weights(q, k, *_features(fmap, q, k), window, gate, causal)
    if fmap is not None:
        return _normalise(fmap.scores(q, k), causal, eps)
    s = _fp32(q) @ _fp32(k).transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T) logits
    if causal:
        s = s.masked_fill(~causal_mask(s.shape[-1], s.device), float("-inf"))
    return s.softmax(-1)


def linear_attention_quadratic(qf, kf, v, causal=True, eps=EPS):
    """O(T^2) form: the weights are materialised, then y = A v."""
    return (linear_weights(qf, kf, causal, eps) @ _fp32(v)).to(v.dtype)


def linear_attention_cumsum(qf, kf, v, eps=EPS):
    """Causal form with explicit running sums: S_i = cumsum_j kf_j v_j^T is (B, H, T, F, Dv). Slow; for reading."""
    qf, kf, vf = _fp32(qf), _fp32(kf), _fp32(v)
    S = torch.cumsum(kf.unsqueeze(-1) * vf.unsqueeze(-2), dim=2)  # (B, H, T, F, Dv)
    z = torch.cumsum(kf, dim=2)  # (B, H, T, F)
    num = (qf.unsqueeze(-2) @ S).squeeze(-2)  # (B, H, T, Dv)
    den = (qf * z).sum(-1, keepdim=True) + eps  # (B, H, T, 1)
    return (num / den).to(v.dtype)


def linear_attention_chunked(qf, kf, v, chunk=64, eps=EPS):
    """Causal linear attention by chunks, written to be read; kernel.py runs the same algorithm fast.

    Cut time into chunks of C tokens. A query sees two things: the earlier tokens of its own chunk,
    through the masked C x C block of kernel values (intra), and every earlier chunk, through the running
    state S = sum kf_j v_j^T, z = sum kf_j (inter). Then

        y = (intra @ v + qf @ S) / (intra.sum(-1) + qf @ z + eps)

    O(T C F) work, an F x Dv state between chunks, and autograd does the backward.
    """
    qf, kf, vf = _fp32(qf), _fp32(kf), _fp32(v)
    B, H, T, F_ = qf.shape
    S = qf.new_zeros(B, H, F_, vf.shape[-1])  # sum of kf_j v_j^T over the chunks done
    z = qf.new_zeros(B, H, F_, 1)  # sum of kf_j
    mask = causal_mask(chunk, qf.device)
    ys = []
    for start in range(0, T, chunk):
        q, k, v_c = qf[:, :, start:start + chunk], kf[:, :, start:start + chunk], vf[:, :, start:start + chunk]
        C = q.shape[2]  # the last chunk can be shorter
        intra = (q @ k.transpose(-1, -2)) * mask[:C, :C]  # (B, H, C, C): within the chunk, j <= i
        num = intra @ v_c + q @ S  # (B, H, C, Dv)
        den = intra.sum(-1, keepdim=True) + q @ z + eps  # (B, H, C, 1)
        ys.append(num / den)
        S = S + k.transpose(-1, -2) @ v_c  # the state after this chunk
        z = z + k.sum(2).unsqueeze(-1)
    return torch.cat(ys, dim=2).to(v.dtype) if ys else v.clone()  # T = 0: no chunks


def linear_attention(qf, kf, v, causal=True, eps=EPS, backend="auto", squares=None):
    """Linear attention in O(T): causal through kernel.causal_linear_attention (chunked; backend "auto"
    uses Triton when it can run; squares: the map's closed form, FeatureMap.squares, for the scores within
    a chunk), bidirectional as qf (kf^T v) / (qf . sum_j kf_j + eps)."""
    if causal:  # causal_linear_attention checks the shapes itself
        return causal_linear_attention(qf, kf, v, eps=eps, backend=backend, squares=squares)
    check_shapes(qf, kf, v)
    qf, kf, vf = _fp32(qf), _fp32(kf), _fp32(v)
    num = qf @ (kf.transpose(-1, -2) @ vf)  # (B, H, T, F) @ (B, H, F, Dv)
    den = qf @ kf.sum(-2).unsqueeze(-1) + eps  # (B, H, T, 1)
    return (num / den).to(v.dtype)


def linear_attention_step(qf_t, kf_t, v_t, state=None, eps=EPS):
    """One token of causal linear attention. qf_t, kf_t: (B, H, F), v_t: (B, H, Dv).
    state = (S, z): (B, H, F, Dv) and (B, H, F) in float32, None to start. Returns (y_t (B, H, Dv), state)."""
    qf, kf, vf = _fp32(qf_t), _fp32(kf_t), _fp32(v_t)
    if state is None:
        state = (qf.new_zeros(*kf.shape, vf.shape[-1]), qf.new_zeros(kf.shape))
    S, z = state
    S = S + kf.unsqueeze(-1) * vf.unsqueeze(-2)  # S_t = S_{t-1} + kf_t v_t^T
    z = z + kf
    num = (qf.unsqueeze(-2) @ S).squeeze(-2)  # (B, H, Dv)
    den = (qf * z).sum(-1, keepdim=True) + eps  # (B, H, 1)
    return (num / den).to(v_t.dtype), (S, z)


# ----------------------------------------------------------------------------------------------
# LoLCATs' hybrid: softmax over a sliding window, linear attention beyond it (Zhang et al. 2024, Sec. 3.2)
#
#   y_i = (g sum_{j in W(i)} e^{s_ij - m_i} v_j + sum_{j <= i-w} qf_i . kf_j v_j)
#       / (g sum_{j in W(i)} e^{s_ij - m_i}     + sum_{j <= i-w} qf_i . kf_j)
#
# W(i) = {j : i-w < j <= i}, the last w tokens, i itself included; s = q.k / sqrt(D); m_i is the
# largest score in the window only; g = sigmoid(w_h) is learned per head (LoLCATs' configs start at
# g = 0.1). Subtracting m_i from the window alone, and not from the linear terms, sets the balance of
# the two parts: the window's largest term is always g, so its total lies between g and g w whatever
# the scale of the scores, and the linear terms compete with that. Sharper window scores (a larger m_i)
# therefore do not drown the linear part, as they would under one softmax over both. It also means the
# hybrid is not softmax even if qf . kf were exactly e^{s} and g = 1: softmax would scale the linear
# terms by the same e^{-m_i} as the window's. No eps: the denominator is at least g.
# swa, the window-only baseline, is the same with no features (F = 0): g cancels.


def _gate(gate, like, window):
    """g as a tensor that broadcasts over (B, H, T, T'): a float, or one value per head (H,). Every form of
    the hybrid starts here, so the window is checked here too: w = 0 would leave softmax an empty row."""
    if window < 1:
        raise ValueError(f"the window must be at least 1 token, got {window}")
    return torch.as_tensor(gate, dtype=like.dtype, device=like.device).reshape(-1, 1, 1)


def _window_scores(q, k, in_window):
    """g-less window terms e^{s_ij - m_i}, 0 outside the window; q (B, H, Tq, D), k (B, H, Tk, D)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    s = s.masked_fill(~in_window, float("-inf"))
    if s.shape[-1] == 0:  # no keys (T = 0): nothing for amax to reduce
        return s
    return (s - s.amax(-1, keepdim=True)).exp()


def hybrid_weights(q, k, qf, kf, window, gate, causal=True):
    """The hybrid's (B, H, T, T) attention weights, every row summing to 1. causal=False (an encoder):
    the window is the band |i - j| < w on both sides, linear attention the rest."""
    q, k, qf, kf = (_fp32(x) for x in (q, k, qf, kf))
    T = q.shape[2]
    pos = torch.arange(T, device=q.device)
    d = pos[:, None] - pos[None, :]  # (T, T): i - j
    in_window = (d >= 0) & (d < window) if causal else d.abs() < window
    in_linear = d >= window if causal else d.abs() >= window
    a = _gate(gate, q, window) * _window_scores(q, k, in_window) + (qf @ kf.transpose(-1, -2)) * in_linear
    return a / a.sum(-1, keepdim=True)


def hybrid_attention_quadratic(q, k, qf, kf, v, window, gate, causal=True):
    """The hybrid with its weights materialised: O(T^2), the reference the other forms must equal."""
    check_shapes(q, k, v, "q, k")
    check_shapes(qf, kf, v)
    return (hybrid_weights(q, k, qf, kf, window, gate, causal) @ _fp32(v)).to(v.dtype)


def hybrid_attention(q, k, qf, kf, v, window, gate, chunk=64):
    """The causal hybrid in O(T): by chunks of C = max(chunk, window) tokens. A query of chunk n sees
    the keys of its own chunk and of chunk n-1 directly (up to 2C of them), each either in its window
    or in the masked linear block, and everything before chunk n-1 (at least C + 1 > w tokens back)
    through the state S = sum kf_j v_j^T, z = sum kf_j of those chunks."""
    check_shapes(q, k, v, "q, k")
    check_shapes(qf, kf, v)
    q, k, qf, kf, vf = (_fp32(x) for x in (q, k, qf, kf, v))
    B, H, T, _ = q.shape
    C, g = max(chunk, window), _gate(gate, q, window)
    S = q.new_zeros(B, H, qf.shape[-1], vf.shape[-1])  # the chunks before the previous one
    z = q.new_zeros(B, H, qf.shape[-1], 1)
    ys = []
    for start in range(0, T, C):
        lo, end = max(0, start - C), min(T, start + C)  # keys: the previous chunk and this one
        d = torch.arange(start, end, device=q.device)[:, None] - torch.arange(lo, end, device=q.device)[None, :]  # i - j
        q_c, qf_c = q[:, :, start:end], qf[:, :, start:end]
        a = g * _window_scores(q_c, k[:, :, lo:end], (d >= 0) & (d < window))  # (B, H, C, <= 2C)
        a = a + (qf_c @ kf[:, :, lo:end].transpose(-1, -2)) * (d >= window)
        num = a @ vf[:, :, lo:end] + qf_c @ S  # (B, H, C, Dv)
        den = a.sum(-1, keepdim=True) + qf_c @ z  # (B, H, C, 1)
        ys.append(num / den)
        S = S + kf[:, :, lo:start].transpose(-1, -2) @ vf[:, :, lo:start]  # the previous chunk moves into the state
        z = z + kf[:, :, lo:start].sum(2).unsqueeze(-1)
    return torch.cat(ys, dim=2).to(v.dtype) if ys else v.clone()  # T = 0: no chunks


def sliding_window_attention(q, k, v, window, chunk=64):
    """swa: softmax over the last `window` tokens (W(i) above), nothing beyond: the hybrid without features."""
    return hybrid_attention(q, k, *_features(None, q, k), v, window, 1.0, chunk)


def hybrid_attention_step(q_t, k_t, qf_t, kf_t, v_t, window, gate, cache=None):
    """One token of the causal hybrid. q_t, k_t (B, H, D), qf_t, kf_t (B, H, F), v_t (B, H, Dv).
    cache: the window's keys and values and their features, (B, H, <= w, .), and the state (S, z) of
    every older token, float32; None to start. Constant in size once the window is full. Returns
    (y_t (B, H, Dv), cache). With F = 0 features it is swa's step."""
    q, k, qf, kf, vf = (_fp32(x)[:, :, None] for x in (q_t, k_t, qf_t, kf_t, v_t))  # (B, H, 1, .)
    if cache is None:
        cache = {"k": k[:, :, :0], "v": vf[:, :, :0], "kf": kf[:, :, :0],
                 "S": q.new_zeros(*kf.shape[:2], kf.shape[-1], vf.shape[-1]),  # (B, H, F, Dv)
                 "z": q.new_zeros(*kf.shape[:2], kf.shape[-1], 1)}  # (B, H, F, 1)
    keys, values, feats = (torch.cat([cache[n], x], 2) for n, x in (("k", k), ("v", vf), ("kf", kf)))
    S, z = cache["S"], cache["z"]
    if keys.shape[2] > window:  # the oldest token leaves the window for the state
        S = S + feats[:, :, :1].transpose(-1, -2) @ values[:, :, :1]
        z = z + feats[:, :, :1].transpose(-1, -2)
        keys, values, feats = keys[:, :, 1:], values[:, :, 1:], feats[:, :, 1:]
    visible = torch.ones(1, keys.shape[2], dtype=torch.bool, device=q.device)
    a = _gate(gate, q, window) * _window_scores(q, keys, visible)  # (B, H, 1, n)
    y = (a @ values + qf @ S) / (a.sum(-1, keepdim=True) + qf @ z)  # (B, H, 1, Dv)
    return y[:, :, 0].to(v_t.dtype), {"k": keys, "v": values, "kf": feats, "S": S, "z": z}


WINDOWED = ("swa", "lolcats")  # attentions with a sliding window: alone, or LoLCATs' hybrid
LOLCATS_MAP = {"mode": "softmax_halves", "separate_qk": True}  # lolcats' Hedgehog maps, as in LoLCATs' configs
ATTENTIONS = ("softmax", *WINDOWED, *FEATURE_MAPS)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with softmax, a sliding window, LoLCATs' hybrid or any feature map:
    x (B, T, C) -> (B, T, C).

    Separate q, k, v, o projections (convert.py puts LoRA adapters on each), with biases if bias=True.
    attention (see use()): "softmax" (F.scaled_dot_product_attention); "swa", softmax over the last
    `window` tokens; "lolcats", that window plus linear attention with Hedgehog maps beyond it and a
    learned gate per head; or any feature map name, built as make_feature_map(attention, qk_dim, n_head,
    **fmap_options), one set of parameters per head (Hedgehog App. A.2).
    qk_dim: the head size of q and k (default C / n_head, the size of v): the feature size F of a map
    follows from it, so setting it per map is how train_ar.py gives every map the same F.
    max_len: the longest sequence the layer will see; cosFormer's fixed length M (so that it can decode
    token by token) unless fmap_options set one. Other maps ignore it.
    attn_dropout: dropout on softmax's weights while training (linear attention never forms them).
    """

    def __init__(self, d_model, n_head, attention="softmax", causal=True, bias=False, qk_dim=None,
                 max_len=None, attn_dropout=0.0, window=64, **fmap_options):
        super().__init__()
        if min(d_model, n_head) < 1 or d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head} (both must be at least 1)")
        if qk_dim is not None and qk_dim < 1:
            raise ValueError(f"qk_dim must be at least 1 (or None: d_model / n_head), got {qk_dim}")
        self.d_model, self.n_head, self.head_dim, self.causal = d_model, n_head, d_model // n_head, causal
        self.qk_dim, self.attn_dropout = self.head_dim if qk_dim is None else qk_dim, attn_dropout
        self.q, self.k = (nn.Linear(d_model, n_head * self.qk_dim, bias=bias) for _ in range(2))
        self.v, self.o = (nn.Linear(d_model, d_model, bias=bias) for _ in range(2))
        if attention == "cosformer":
            fmap_options.setdefault("max_len", max_len)
        self.use(attention, window, **fmap_options)

    def use(self, attention, window=64, gate=0.1, **fmap_options):
        """Set what mixes q, k, v (the projections stay): a fresh feature map, the window size for swa and
        lolcats, and lolcats' gates g = sigmoid(w_h), starting at `gate`. convert.py swaps layers with it.
        lolcats' map is Hedgehog as in LoLCATs' configs: a softmax per half, separate maps for q and k."""
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTIONS)}")
        if attention in WINDOWED and window < 1:
            raise ValueError(f"{attention}: window must be at least 1, got {window}")
        if attention in ("softmax", "swa") and fmap_options:
            raise ValueError(f"{attention} has no feature map to take the options {', '.join(fmap_options)}")
        self.attention, self.window = attention, window if attention in WINDOWED else 0
        if attention == "lolcats":
            attention = "hedgehog"
            fmap_options = {**LOLCATS_MAP, **fmap_options}
        device = self.q.weight.device
        self.fmap = None
        if attention not in ("softmax", "swa"):
            self.fmap = make_feature_map(attention, self.qk_dim, self.n_head, **fmap_options).to(device)
        self.gate = None
        if self.attention == "lolcats":  # w_h with sigmoid(w_h) = gate
            if not 0 < gate < 1:
                raise ValueError(f"lolcats: the gate must start strictly between 0 and 1, got {gate}")
            self.gate = nn.Parameter(torch.full((self.n_head,), math.log(gate / (1 - gate)), device=device))

    def g(self):
        """lolcats' gate per head, sigmoid(w_h) (H,); 1 for swa, where it cancels."""
        return 1.0 if self.gate is None else self.gate.sigmoid()

    def heads(self, x):
        """x (B, T, C) -> q, k (B, H, T, qk_dim) and v (B, H, T, D)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:  # else a matmul error deep inside
            raise ValueError(f"expected x of shape (B, T, {self.d_model}), got {tuple(x.shape)}")
        split = lambda y: y.unflatten(-1, (self.n_head, -1)).transpose(1, 2)
        return split(self.q(x)), split(self.k(x)), split(self.v(x))

    def features(self, q, k, offset=0):
        """(qf, kf) of the layer's map; zero-width for swa, whose window alone attends."""
        return _features(self.fmap, q, k, offset)

    def mix(self, q, k, v):
        """The attention itself on (B, H, T, .) heads -> (B, H, T, D)."""
        if self.window:
            qf, kf = self.features(q, k)
            if self.causal:
                return hybrid_attention(q, k, qf, kf, v, self.window, self.g())
            return hybrid_attention_quadratic(q, k, qf, kf, v, self.window, self.g(), causal=False)
        if self.fmap is None:
            p = self.attn_dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=p)
        qf, kf = self.fmap(q, k)
        squares = self.fmap.squares(q, k) if self.causal else None  # the polynomial maps' closed form, for the kernels
        return linear_attention(qf, kf, v, causal=self.causal, squares=squares)

    def forward(self, x):
        y = self.mix(*self.heads(x))  # (B, H, T, D)
        return self.o(y.transpose(1, 2).flatten(2))  # (B, T, C)

    def weights(self, x):
        """(B, H, T, T) attention weights of this layer on input x, exactly the ones forward() uses (same eps)."""
        q, k, _ = self.heads(x)
        return attention_weights(q, k, self.fmap, self.causal, EPS, self.window, self.g())

    def step(self, x_t, cache=None):
        """Decode one token: x_t (B, C) -> (y_t (B, C), cache). Softmax keeps every key and value (a KV
        cache that grows with t); linear attention keeps the fixed-size state (S, z); swa and lolcats keep
        the window's keys and values, and lolcats the state of everything older too."""
        if not self.causal:
            raise ValueError("step() is for causal attention")
        q, k, v = self.heads(x_t[:, None])  # (B, H, 1, D)
        t = 0 if cache is None else cache["t"]
        if self.window:
            qf, kf = self.features(q, k, offset=t)
            y, inner = hybrid_attention_step(q[:, :, 0], k[:, :, 0], qf[:, :, 0], kf[:, :, 0], v[:, :, 0],
                                             self.window, self.g(), None if cache is None else cache["window"])
            cache = {"t": t + 1, "window": inner}
        elif self.fmap is None:
            if cache is not None:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            y = F.scaled_dot_product_attention(q, k, v)[:, :, 0]  # the new token sees every cached one
            cache = {"t": t + 1, "k": k, "v": v}
        else:
            qf, kf = self.fmap(q, k, offset=t)
            y, state = linear_attention_step(qf[:, :, 0], kf[:, :, 0], v[:, :, 0], None if cache is None else cache["state"])
            cache = {"t": t + 1, "state": state}
        return self.o(y.flatten(1)), cache


class Block(nn.Module):
    """Pre-norm Transformer block, the unit every model here stacks: x + attn(ln(x)), then x + mlp(ln(x)).
    mlp_ratio = 0 leaves the MLP out (attention-only blocks). The other arguments go to MultiHeadAttention."""

    def __init__(self, d_model, n_head, attention="softmax", mlp_ratio=4, causal=True, bias=False, qk_dim=None,
                 max_len=None, attn_dropout=0.0, window=64, **fmap_options):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_head, attention, causal, bias, qk_dim, max_len, attn_dropout, window,
                                       **fmap_options)
        self.mlp = None
        if mlp_ratio:
            self.ln2 = nn.LayerNorm(d_model)
            hidden = mlp_ratio * d_model
            self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x if self.mlp is None else x + self.mlp(self.ln2(x))

    def step(self, x_t, cache=None):
        """One token x_t (B, C) through the block, with the attention's cache (see MultiHeadAttention.step)."""
        y, cache = self.attn.step(self.ln1(x_t), cache)
        x_t = x_t + y
        return (x_t if self.mlp is None else x_t + self.mlp(self.ln2(x_t))), cache
