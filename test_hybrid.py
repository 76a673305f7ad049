"""
LoLCATs' sliding window + linear attention (attention.hybrid_attention*) and the window alone
(sliding_window_attention): every form (quadratic, chunked, one token at a time) against a float64
definition computed one query at a time, gradients too, and the window max that sets the balance of
the two parts. Run: python -m pytest -q test_hybrid.py
"""
import math

import pytest
import torch
import torch.nn.functional as F

from test_all import NAMES, make_map, qkv, step_by_step  # first: sets TRITON_INTERPRET before triton is imported
from attention import (MultiHeadAttention, hybrid_attention, hybrid_attention_quadratic, hybrid_attention_step,
                       hybrid_weights, sliding_window_attention)


def hybrid_loop_reference(q, k, qf, kf, v, window, gate, causal=True):
    """The definition, one query at a time: window terms g e^{s_ij - m_i} for j in W(i) (m_i: the window's
    max), linear terms qf_i . kf_j for every other visible j; y_i = their weighted sum of v / their sum."""
    B, H, T, D = q.shape
    g = torch.as_tensor(gate, dtype=q.dtype).expand(H)
    out = torch.zeros(B, H, T, v.shape[-1], dtype=q.dtype)
    for i in range(T):
        keys = range(i + 1) if causal else range(T)
        win = [j for j in keys if (0 <= i - j < window if causal else abs(i - j) < window)]
        lin = [j for j in keys if j not in win]
        s = (q[:, :, i:i + 1] * k[:, :, win]).sum(-1) / math.sqrt(D)  # (B, H, |W|)
        w_win = g[:, None] * (s - s.max(-1, keepdim=True).values).exp()
        w_lin = (qf[:, :, i:i + 1] * kf[:, :, lin]).sum(-1)  # (B, H, |L|)
        num = (w_win[..., None] * v[:, :, win]).sum(2) + (w_lin[..., None] * v[:, :, lin]).sum(2)
        out[:, :, i] = num / (w_win.sum(-1) + w_lin.sum(-1))[..., None]
    return out


@pytest.mark.parametrize("window,chunk", [(1, 8), (3, 8), (8, 8), (11, 4), (40, 8)])  # w = 11 > chunk: C = w
@pytest.mark.parametrize("gate", [0.1, "per-head"])
def test_hybrid_forms_match_float64_reference(window, chunk, gate):
    fmap = make_map("hedgehog", mode="softmax_halves", separate_qk=True)
    q, k, v = qkv(T=37, scale=2.0)
    qf, kf = fmap(q, k)
    g = torch.tensor([0.1, 0.7], dtype=torch.float64) if gate == "per-head" else gate
    ref = hybrid_loop_reference(q, k, qf, kf, v, window, g)
    assert torch.allclose(hybrid_attention_quadratic(q, k, qf, kf, v, window, g), ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(hybrid_attention(q, k, qf, kf, v, window, g, chunk), ref, rtol=1e-10, atol=1e-12)
    cache, ys = None, []
    for t in range(q.shape[2]):
        y, cache = hybrid_attention_step(q[:, :, t], k[:, :, t], qf[:, :, t], kf[:, :, t], v[:, :, t], window, g, cache)
        ys.append(y)
    assert torch.allclose(torch.stack(ys, 2), ref, rtol=1e-10, atol=1e-12)
    assert cache["k"].shape[2] == min(window, q.shape[2])  # the cache holds the window, no more
    bidirectional = hybrid_loop_reference(q, k, qf, kf, v, window, g, causal=False)
    assert torch.allclose(hybrid_attention_quadratic(q, k, qf, kf, v, window, g, causal=False), bidirectional,
                          rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_with_every_map_matches_float64_reference(name):
    """The hybrid takes any map's features beyond the window: every form, and the chunked form's gradients
    to q, k, v and the map's parameters, equal the definition (zero rows of ReLU's features included)."""
    fmap = make_map(name)
    q, k, v = (x.requires_grad_() for x in qkv(T=29))
    qf, kf = fmap(q, k)
    ref = hybrid_loop_reference(q, k, qf, kf, v, 5, 0.3)
    cache, ys = None, []
    for t in range(q.shape[2]):
        y, cache = hybrid_attention_step(q[:, :, t], k[:, :, t], qf[:, :, t], kf[:, :, t], v[:, :, t], 5, 0.3, cache)
        ys.append(y)
    for y in (hybrid_attention_quadratic(q, k, qf, kf, v, 5, 0.3), hybrid_attention(q, k, qf, kf, v, 5, 0.3, 8),
              torch.stack(ys, 2)):
        assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12)
    params = [q, k, v] + list(fmap.parameters())
    g_out = torch.randn_like(ref)
    expected = torch.autograd.grad((ref * g_out).sum(), params, retain_graph=True)
    got = torch.autograd.grad((hybrid_attention(q, k, qf, kf, v, 5, 0.3, 8) * g_out).sum(), params)
    for x, r in zip(got, expected):
        assert torch.allclose(x, r, rtol=1e-9, atol=1e-10 * r.abs().max().item())


def test_hybrid_gradients_match_the_definition():
    """Autograd through the chunked form equals autograd through the loop reference: q, k, v, the gate and the map."""
    fmap = make_map("hedgehog", mode="softmax_halves", separate_qk=True)
    q, k, v = (x.requires_grad_() for x in qkv(T=30))
    w = torch.tensor([-2.0, 0.5], dtype=torch.float64, requires_grad=True)
    params = [q, k, v, w] + list(fmap.parameters())
    g_out = torch.randn(2, 2, 30, 5, dtype=torch.float64)

    def grads(form):
        return torch.autograd.grad((form(q, k, *fmap(q, k), v, 5, w.sigmoid()) * g_out).sum(), params)

    for r, x in zip(grads(hybrid_loop_reference), grads(lambda *a: hybrid_attention(*a, chunk=8))):
        assert torch.allclose(x, r, rtol=1e-9, atol=1e-10 * r.abs().max().item())


def test_swa_is_softmax_over_the_last_w_tokens():
    q, k, v = qkv(T=29)
    T, w = 29, 6
    d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = (d >= 0) & (d < w)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert torch.allclose(sliding_window_attention(q, k, v, w, chunk=8), ref, rtol=1e-10, atol=1e-12)
    cache, ys = None, []
    for t in range(T):
        y, cache = hybrid_attention_step(q[:, :, t], k[:, :, t], q[:, :, t, :0], k[:, :, t, :0], v[:, :, t], w, 1.0, cache)
        ys.append(y)
    assert torch.allclose(torch.stack(ys, 2), ref, rtol=1e-10, atol=1e-12)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    g_out = torch.randn_like(ref)
    expected = torch.autograd.grad((F.scaled_dot_product_attention(q, k, v, attn_mask=allowed) * g_out).sum(), (q, k, v))
    for x, r in zip(torch.autograd.grad((sliding_window_attention(q, k, v, w, chunk=8) * g_out).sum(), (q, k, v)), expected):
        assert torch.allclose(x, r, rtol=1e-9, atol=1e-10)
    # the layer: its heads through that window, forward and step by step, and weights zero beyond it
    layer = MultiHeadAttention(16, 2, "swa", window=w).double()
    x = torch.randn(1, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = layer.heads(x)
    ref = layer.o(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).flatten(2))
    assert torch.allclose(layer(x), ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(step_by_step(layer, x), ref, rtol=1e-10, atol=1e-12)
    assert (layer.weights(x)[..., ~allowed] == 0).all()


@pytest.mark.parametrize("name", ["swa", "lolcats"])
def test_an_encoder_layer_attends_both_ways_through_its_window(name):
    """A bidirectional (encoder) swa or lolcats layer is the quadratic form with the band |i - j| < w on both
    sides: the first token sees the next w - 1, and not the one after them (swa) or only through the linear
    part (lolcats)."""
    layer = MultiHeadAttention(16, 2, name, causal=False, window=3).double()
    x = torch.randn(1, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q, k, v = layer.heads(x)
    qf, kf = layer.features(q, k)
    y = hybrid_attention_quadratic(q, k, qf, kf, v, 3, layer.g(), causal=False)
    assert torch.allclose(layer(x), layer.o(y.transpose(1, 2).flatten(2)), rtol=1e-10, atol=1e-12)
    for t, seen in ((2, True), (3, name == "lolcats")):  # does token t change the first token's output?
        x2 = x.clone()
        x2[:, t] += 1
        assert ((layer(x2)[:, 0] - layer(x)[:, 0]).abs().max() > 1e-6) == seen


def test_every_hybrid_form_refuses_an_empty_window():  # w = 0 leaves softmax no key: NaN rows
    q, k, v = qkv(T=8)
    for form in (lambda: hybrid_attention_quadratic(q, k, q, k, v, 0, 1.0), lambda: hybrid_attention(q, k, q, k, v, 0, 1.0),
                 lambda: hybrid_attention_step(q[:, :, 0], k[:, :, 0], q[:, :, 0], k[:, :, 0], v[:, :, 0], 0, 1.0),
                 lambda: sliding_window_attention(q, k, v, 0)):
        with pytest.raises(ValueError, match="the window must be at least 1 token, got 0"):
            form()


def test_the_window_max_sets_the_balance_of_the_two_parts():
    """m_i comes from the window alone, so the window's share of a row does not depend on the scale of
    its scores: with w equal window keys, the window's terms are all exactly g and its share is
    g w / (g w + linear sum), at any scale. Under one normaliser over both parts (the softmax-like
    alternative, window terms g e^{s}) the share grows with the scale."""
    T, w, g = 20, 4, 0.1
    q, k, _ = qkv(B=1, H=1, T=T, D=4)
    qf, kf = q.exp(), k.exp()  # positive features, independent of the window's keys
    shares = []
    for scale in (1.0, 10.0):
        k2 = k.clone()
        k2[:, :, T - w:] = scale * q[:, :, -1:]  # the last query's window: w identical keys
        a = hybrid_weights(q, k2, qf, kf, w, g)[0, 0, -1]  # the last row
        linear = (qf[0, 0, -1] * kf[0, 0, :T - w]).sum(-1).sum()
        assert a[T - w:].sum() == pytest.approx((g * w / (g * w + linear)).item(), rel=1e-12)
        s = (q[0, 0, -1] * k2[0, 0, T - 1]).sum() / 2.0  # the window's (equal) score, sqrt(D) = 2
        shares.append((g * w * s.exp() / (g * w * s.exp() + linear)).item())  # one normaliser over both
    assert shares[1] > shares[0] + 0.1


def test_lolcats_layer_starts_at_its_gate_with_lolcats_maps():
    """A lolcats layer's gate g = sigmoid(w_h) starts at the value asked (0.1, LoLCATs' configs, by default),
    one per head; its Hedgehog maps are LoLCATs' (a softmax per half, keys with their own weights) unless
    options say otherwise."""
    layer = MultiHeadAttention(16, 2, "lolcats")
    assert torch.allclose(layer.g(), torch.tensor([0.1, 0.1]), atol=1e-7) and layer.g().shape == (2,)
    assert layer.fmap.mode == "softmax_halves" and layer.fmap.Wk is not None
    layer.use("lolcats", gate=0.7, mode="softmax")
    assert torch.allclose(layer.g(), torch.tensor([0.7, 0.7]), atol=1e-7) and layer.fmap.mode == "softmax"
