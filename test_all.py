"""
The test suite: every attention path against an independent float64 oracle, every feature map against
its closed form, the module, distillation, and no float64 in float32 runs. Run: python -m pytest -q
(test_kernel.py tests kernel.py and the build check; test_ar.py and test_scripts.py run the scripts;
test_pretrained.py the pretrained models.)

The Triton kernel runs here in Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before triton
is imported, so it is set below, before importing our modules (on a CUDA machine the real kernel runs).
Scripts are smoke-tested in subprocesses without it, so they take the fast PyTorch path.
"""
import math
import os
import subprocess
import sys
from importlib import metadata

import torch


def _interpreter_runs_our_kernels():
    """Triton's CPU interpreter runs the kernels from 3.7 on: 3.6's cannot loop to a bound passed at run
    time (range(0, N)). The compiled kernels are not affected (they ran on an H200 with triton 3.6)."""
    try:
        return tuple(int(x) for x in metadata.version("triton").split(".")[:2]) >= (3, 7)
    except metadata.PackageNotFoundError:
        return False


if not torch.cuda.is_available() and _interpreter_runs_our_kernels():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

import convert
import distill
import feature_maps as fm
import kernel
import oal_groups
import train_ar
from attention import (MultiHeadAttention, attention_weights, hybrid_attention, hybrid_attention_quadratic, hybrid_attention_step,
                       hybrid_weights, linear_attention, linear_attention_chunked, linear_attention_cumsum, linear_attention_quadratic,
                       linear_attention_step, sliding_window_attention, softmax_attention)
from gpt import GPT

NAMES = list(fm.FEATURE_MAPS)
POLYNOMIAL = ["taylor", "taylorshift", "quadratic", "oal"]  # the maps with a closed form (FeatureMap.squares)
HAS_TRITON = kernel.HAS_TRITON and (torch.cuda.is_available() or kernel.INTERPRET)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (Linux only), and 3.7+ for its CPU interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(*args, cwd=HERE, ok=True):
    """Run a script of this folder in a subprocess on the fast PyTorch path (no Triton interpreter).
    Returns stdout; with ok=False the run must fail, and stderr comes back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = HERE
    script = [os.path.join(HERE, args[0]) if args[0].endswith(".py") else args[0], *args[1:]]
    out = subprocess.run([sys.executable, *script], capture_output=True, text=True, env=env, timeout=600, cwd=cwd)
    if not ok:
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
        return out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def make_map(name, D=8, H=2, seed=0, **kw):
    """A feature map in float64 with its learned parameters moved away from their initial values."""
    torch.manual_seed(seed)
    fmap = fm.make_feature_map(name, D, H, **kw).double()
    if isinstance(fmap, fm.OAL):
        fmap.set_groups(torch.randint(0, fmap.G, (H, D)))
    with torch.no_grad():
        for p in fmap.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return fmap


def loop_reference(qf, kf, v, causal=True, eps=1e-6):
    """The definition, one query at a time: y_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = qf_i . kf_j."""
    T = qf.shape[2]
    out = []
    for i in range(T):
        J = i + 1 if causal else T
        w = (qf[:, :, i:i + 1] * kf[:, :, :J]).sum(-1)  # (B, H, J)
        out.append((w.unsqueeze(-1) * v[:, :, :J]).sum(2) / (w.sum(-1, keepdim=True) + eps))
    return torch.stack(out, dim=2)


def qkv(B=2, H=2, T=37, D=8, Dv=5, scale=1.0, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(B, H, T, d, generator=g, dtype=dtype) for d in (D, D, Dv)]


def tiny_gpt(attention="softmax", **kw):
    torch.manual_seed(0)
    return GPT(vocab_size=50, block_size=24, n_layer=2, n_head=2, d_model=16, attention=attention, **kw)



# ----------------------------------------------------------------------------------------------
# linear attention: every form equals the float64 definition, for every feature map


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False])
def test_forms_match_float64_reference(name, causal):
    fmap = make_map(name)
    q, k, v = qkv(T=37)
    qf, kf = fmap(q, k)
    ref = loop_reference(qf, kf, v, causal)
    assert torch.allclose(linear_attention_quadratic(qf, kf, v, causal), ref, rtol=1e-9, atol=1e-9)
    assert torch.allclose(linear_attention(qf, kf, v, causal, backend="torch"), ref, rtol=1e-9, atol=1e-9)
    if causal:
        assert torch.allclose(linear_attention_cumsum(qf, kf, v), ref, rtol=1e-9, atol=1e-9)
        for chunk in (8, 64):  # a partial last chunk (37 = 4 x 8 + 5), and one chunk longer than T
            assert torch.allclose(linear_attention_chunked(qf, kf, v, chunk), ref, rtol=1e-9, atol=1e-9)
        state, ys = None, []
        for t in range(q.shape[2]):
            y, state = linear_attention_step(qf[:, :, t], kf[:, :, t], v[:, :, t], state)
            ys.append(y)
        assert torch.allclose(torch.stack(ys, 2), ref, rtol=1e-9, atol=1e-9)
        if HAS_TRITON:  # the kernel computes in float32
            y = linear_attention(qf.to(DEV), kf.to(DEV), v.to(DEV), causal, backend="triton").cpu()
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_quadratic_autograd(name):
    """Gradients through the kernel's hand-written backward, and autograd through the plain chunked form,
    equal autograd through the O(T^2) form, for q, k, v and the feature map's own parameters."""
    fmap = make_map(name)
    q, k, v = (x.requires_grad_() for x in qkv(T=70))
    params = [q, k, v] + list(fmap.parameters())
    g = torch.randn(2, 2, 70, 5, dtype=torch.float64)

    def grads(form):
        return torch.autograd.grad((form(*fmap(q, k), v) * g).sum(), params, allow_unused=True)

    ref = grads(linear_attention_quadratic)
    for form in (lambda a, b, c: linear_attention(a, b, c, backend="torch"), lambda a, b, c: linear_attention_chunked(a, b, c, 16)):
        for r, x in zip(ref, grads(form)):
            if r is not None:
                assert torch.allclose(x, r, rtol=1e-8, atol=1e-9 * r.abs().max().item())




# ----------------------------------------------------------------------------------------------
# LoLCATs' hybrid and the window alone: every form equals the float64 definition


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
    assert torch.allclose(hybrid_attention_quadratic(q, k, qf, kf, v, window, g, causal=False), bidirectional, rtol=1e-10, atol=1e-12)


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


# ----------------------------------------------------------------------------------------------
# softmax and the weights


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_matches_sdpa(causal):
    q, k, v = qkv(T=29, Dv=8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(softmax_attention(q, k, v, causal), ref, atol=1e-12)


def test_linear_weights_by_hand():
    """A 2-token example by hand with relu: q = [[1, 0], [1, 1]], k = [[2, 0], [1, 3]].
    Row 0 sees key 0 only: weight 1. Row 1: q1.k0 = 2, q1.k1 = 4, so weights 2/6 and 4/6."""
    q = torch.tensor([[1.0, 0], [1, 1]], dtype=torch.float64)[None, None]
    k = torch.tensor([[2.0, 0], [1, 3]], dtype=torch.float64)[None, None]
    A = attention_weights(q, k, fm.make_feature_map("relu", 2))[0, 0]
    assert torch.allclose(A, torch.tensor([[1.0, 0], [2 / 6, 4 / 6]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# each feature map against its closed form


def logits(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # s = q.k / sqrt(D), (B, H, T, T)


def kernel_matrix(fmap, q, k):
    qf, kf = fmap(q, k)
    return qf @ kf.transpose(-1, -2)


@pytest.mark.parametrize("name", NAMES)
def test_squares_is_the_kernel_in_closed_form(name):
    """FeatureMap.squares: base + sum_r (c_r + (q' lam_r) . k')^2 equals phi_q . phi_k for every polynomial map
    (OAL with random groups, learned parameters moved); the other maps have none. scores() agrees either way."""
    fmap = make_map(name, D=6)
    q, k, _ = qkv(D=6, scale=1.5)
    sq = fmap.squares(q, k)
    assert (sq is not None) == (name in POLYNOMIAL)
    K = kernel_matrix(fmap, q, k)
    if sq is not None:
        qs, ks, lam, c, base = sq
        by_terms = base[:, None, None] + sum(((qs * lam[:, None, r]) @ ks.transpose(-1, -2) + c[:, r, None, None]) ** 2
                                             for r in range(lam.shape[1]))
        assert torch.allclose(by_terms, K, rtol=1e-12, atol=1e-12)
    assert torch.allclose(fmap.scores(q, k), K, rtol=1e-12, atol=1e-12)


def test_unknown_feature_map_lists_valid_names():
    with pytest.raises(ValueError, match="hedgehog.*oal|oal.*hedgehog"):
        fm.make_feature_map("softmaxx", 8)


def test_taylor_is_exact_second_order():
    """Float64 throughout: a float32 constant inside (it happened: sqrt(2)) shows up at 1e-9."""
    q, k, _ = qkv(D=6, scale=2.0)
    s = logits(q, k)
    fmap = fm.make_feature_map("taylor", 6)
    assert torch.allclose(kernel_matrix(fmap, q, k), 1 + s + s ** 2 / 2, rtol=1e-13, atol=1e-13)
    assert fmap(q, k)[0].shape[-1] == 1 + 6 + 21


def oal_kernel_by_definition(fmap, q, k):
    """K = eps + ||[1, z_1..z_G] L||^2 with z_g = sum_{l in g} q_l k_l / sqrt(D), straight from OAL Sec. 4."""
    D = q.shape[-1]
    u = q.unsqueeze(3) * k.unsqueeze(2) / math.sqrt(D)  # (B, H, T, T, D) per-dimension contributions
    onehot = F.one_hot(fmap.groups, fmap.G).to(q.dtype)  # (H, D, G)
    z = torch.einsum("bhijd,hdg->bhijg", u, onehot)
    z1 = torch.cat([torch.ones_like(z[..., :1]), z], -1)  # (B, H, T, T, G+1)
    L = torch.tril(fmap.L)  # (H, G+1, G+1)
    return fmap.eps + (torch.einsum("bhijg,hgc->bhijc", z1, L) ** 2).sum(-1)


def test_oal_matches_its_definition_and_stays_positive():
    for seed in range(3):
        fmap = make_map("oal", seed=seed)
        with torch.no_grad():
            fmap.L.normal_()  # any L: b can be negative, K must stay positive
        q, k, _ = qkv(T=11, scale=2.0, seed=seed)
        K = kernel_matrix(fmap, q, k)
        assert torch.allclose(K, oal_kernel_by_definition(fmap, q, k), rtol=1e-9, atol=1e-9)
        assert (K > 0).all()


def test_oal_taylor_init_is_taylor_for_any_grouping():
    q, k, _ = qkv()
    s = logits(q, k)
    for seed in range(3):
        fmap = fm.make_feature_map("oal", 8, 2).double()
        fmap.set_groups(torch.randint(0, 5, (2, 8), generator=torch.Generator().manual_seed(seed)))
        assert torch.allclose(kernel_matrix(fmap, q, k), 1 + s + s ** 2 / 2 + fmap.eps, atol=1e-10)


def test_oal_one_group_is_global_quadratic():
    """With every dimension in one group, OAL is the learned global quadratic a + b s + c s^2."""
    quad = make_map("quadratic")
    oal = fm.make_feature_map("oal", 8, 2).double()
    with torch.no_grad():
        oal.L.zero_()
        oal.L[:, :2, :2] = quad.L  # groups all 0: only L's first two rows and columns matter
    q, k, _ = qkv()
    s = logits(q, k)
    a, b, C = quad.coefficients()
    expected = a[:, None, None] + b[:, 0, None, None] * s + C[:, 0, 0, None, None] * s ** 2
    assert torch.allclose(kernel_matrix(quad, q, k), expected, atol=1e-10)
    assert torch.allclose(kernel_matrix(oal, q, k), expected, atol=1e-10)


def test_oal_split_keeps_the_kernel():
    """Splitting a trained one-group head, as train_ar.regroup_oal does after the first epoch, changes
    nothing at once: the model's outputs before and after are the same."""
    torch.manual_seed(0)
    model = train_ar.ARModel("oal", n_layer=2, d_model=16, qk_dim=8).double()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.fmap.L.add_(0.3 * torch.randn_like(block.attn.fmap.L))
    x, _ = train_ar.make_ar_data(8, seed=0)
    before = model(x)
    train_ar.regroup_oal(model, x)
    assert any((block.attn.fmap.groups > 0).any() for block in model.blocks)
    assert torch.allclose(model(x), before, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_scores_equal_the_features_products(name):
    """fmap.scores, where the O(T^2) forms and the distillation start, is qf kf^T for every map."""
    fmap = make_map(name)
    q, k, _ = qkv(T=11)
    assert torch.allclose(fmap.scores(q, k), kernel_matrix(fmap, q, k), rtol=1e-10, atol=1e-10)


def test_oal_direct_scores_match_definition_and_features_with_gradients():
    """At D = 16 with 5 groups OAL's scores skip the features (group logits, then eps + ||[1, z] L||^2):
    values and gradients (q, k, L) equal both the features' and the test's own einsum of the definition.
    With one group per dimension it uses the features (cheaper there), also checked."""
    for G in (5, 16):
        torch.manual_seed(G)
        fmap = fm.make_feature_map("oal", 16, 2, max_groups=G).double()
        fmap.set_groups(torch.randint(0, G, (2, 16)))
        with torch.no_grad():
            fmap.L.normal_()
        q, k, _ = (x.requires_grad_() for x in qkv(T=9, D=16, scale=1.5, seed=G))
        dy = torch.randn(2, 2, 9, 9, dtype=torch.float64)
        results = []
        for K in (fmap.scores, lambda q, k: kernel_matrix(fmap, q, k), lambda q, k: oal_kernel_by_definition(fmap, q, k)):
            out = K(q, k)
            results.append([out, *torch.autograd.grad(out, (q, k, fmap.L), dy)])
        for got, ref in zip(results[0], results[1]):
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)
        for got, ref in zip(results[0], results[2]):
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_oal_rejects_bad_groups():
    with pytest.raises(ValueError, match="groups"):
        fm.make_feature_map("oal", 8, 2).set_groups(torch.full((2, 8), 7))


@pytest.mark.parametrize("mode", ["softmax", "softmax_halves", "exp"])
def test_hedgehog_init_closed_form(mode):
    """Identity W and zero bias: phi(x) is the negation mapping of x itself."""
    q, k, _ = qkv()
    qf, kf = fm.make_feature_map("hedgehog", 8, 2, mode=mode).double()(q, k)
    x = torch.cat([k, -k], -1)
    expected = {"softmax": x.softmax(-1),
                "softmax_halves": torch.cat([k.softmax(-1), (-k).softmax(-1)], -1),
                "exp": x.exp()}[mode]
    assert torch.allclose(kf, expected, atol=1e-12)
    if mode == "exp":  # the query side is scaled per token, which leaves the weights unchanged
        xq = torch.cat([q, -q], -1).exp()
        assert torch.allclose(qf / qf.sum(-1, keepdim=True), xq / xq.sum(-1, keepdim=True), atol=1e-12)


def test_exp_weights_unchanged_by_stabilisation():
    q, k, _ = qkv(scale=3.0)
    for t in (1.0, 2.0):
        A = attention_weights(q, k, fm.make_feature_map("exp", 8, t=t))
        raw = (t * q).exp() @ (t * k).exp().transpose(-1, -2)
        raw = raw.tril()
        assert torch.allclose(A, raw / raw.sum(-1, keepdim=True), atol=1e-12)


def test_performer_estimates_exp():
    """E[phi(q).phi(k)] = exp(s): over 300 independent draws of W, the mean ratio to exp(s) is within
    4 standard errors of 1 for every pair (the QR sign bug this guards against gave a 15% bias)."""
    q, k, _ = qkv(B=1, H=1, T=6, D=8, scale=0.3)
    fmap = fm.make_feature_map("performer", 8, 1, num_features=64).double()
    g = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(300):
        fmap.W.copy_(fmap.draw(g))
        ratios.append(kernel_matrix(fmap, q, k) / logits(q, k).exp())
    ratios = torch.stack(ratios)
    stderr = ratios.std(0) / 300 ** 0.5
    assert ((ratios.mean(0) - 1).abs() < 4 * stderr).all()
    assert stderr.max() < 0.03


def test_performer_rows_are_orthogonal_blocks_with_chi_norms():
    W = fm.make_feature_map("performer", 16, 1, num_features=48).W[0]  # 3 blocks of 16
    for blk in W.split(16):
        unit = blk / blk.norm(dim=-1, keepdim=True)
        assert torch.allclose(unit @ unit.T, torch.eye(16), atol=1e-5)
    assert not torch.allclose(W.norm(dim=-1), W.norm(dim=-1)[0])  # rescaled, not unit rows


def test_cosformer_reweights_by_cos_distance():
    q, k, _ = qkv(T=13)
    for max_len in (None, 40):
        M = max_len or 13
        i = torch.arange(13, dtype=torch.float64)
        expected = F.relu(q) @ F.relu(k).transpose(-1, -2) * torch.cos(math.pi * (i[:, None] - i[None, :]) / (2 * M))
        assert torch.allclose(kernel_matrix(fm.make_feature_map("cosformer", 8, max_len=max_len), q, k), expected, atol=1e-12)


def test_taylorshift_kernel():
    fmap = make_map("taylorshift")
    q, k, _ = qkv()
    x = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    tx = fmap.tau[None] * x  # (H, 1, 1) temperature per head
    assert torch.allclose(kernel_matrix(fmap, q, k), 1 + tx + tx ** 2 / 2, atol=1e-10)


def test_dijiang_dct_and_form():
    fmap = make_map("dijiang")
    D = 8
    n = torch.arange(D, dtype=torch.float64)
    C = torch.stack([torch.cos(math.pi * (n + 0.5) * i / D) for i in range(D)], 1)  # unnormalised DCT-II basis
    C = C / C.norm(dim=0)
    quantiles = torch.distributions.Normal(0, 1).icdf(torch.arange(1, D + 1, dtype=torch.float64) / (D + 1))
    assert torch.allclose(fmap.P, C * quantiles, atol=1e-6)
    q, k, _ = qkv()
    assert torch.allclose(fmap(q, k)[1], fmap.log_w.exp() * (k @ fmap.P).softmax(-1), atol=1e-12)


def test_t2r_form():
    fmap = make_map("t2r")
    q, k, _ = qkv()
    expected = torch.stack([F.relu(k[:, h] @ fmap.W[h] + fmap.b[h]) for h in range(2)], 1)
    assert torch.allclose(fmap(q, k)[1], expected, atol=1e-12)


def test_elu_stays_positive_in_bf16():
    """1 + elu(x) = e^x for x < 0. The textbook F.elu(x) + 1 cancels to exactly 0 at x = -10 in bf16
    and at x = -30 even in float32 (where the map computes), zeroing a whole row of weights."""
    x = torch.tensor([-10.0, -30.0], dtype=torch.bfloat16).view(1, 1, 1, 2)
    qf, _ = fm.make_feature_map("elu", 2)(x, x)
    assert torch.allclose(qf, x.float().exp(), rtol=1e-6)
    assert (F.elu(x) + 1 == 0).all() and (F.elu(x.float()) + 1)[..., 1] == 0  # the textbook form


@pytest.mark.parametrize("name", ["exp", "hedgehog", "performer", "dijiang", "elu", "taylor", "oal", "taylorshift"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exp_maps_finite_in_half_precision(name, dtype):
    q, k, v = (x.to(dtype) for x in qkv(scale=50.0))
    for kw in ([{"t": 1.0}, {"t": 2.0}] if name == "exp" else [{}]):
        fmap = fm.make_feature_map(name, 8, 2, **kw)
        qf, kf = fmap(q, k)
        assert torch.isfinite(qf).all() and torch.isfinite(kf).all()
        y = linear_attention(qf, kf, v, backend="torch")
        assert torch.isfinite(y).all() and y.dtype == dtype
        A = attention_weights(q, k, fmap)
        assert torch.isfinite(A).all() and (A.sum(-1) <= 1 + 1e-5).all()


def test_long_sequence_32k_does_not_overflow():
    q, k, v = qkv(B=1, H=1, T=32768, D=8, Dv=4, scale=20.0, dtype=torch.float32)
    for name in ("exp", "hedgehog"):
        qf, kf = fm.make_feature_map(name, 8, 1)(q, k)
        y = linear_attention(qf, kf, v, backend="torch")
        assert torch.isfinite(y).all()
        assert (y.abs() <= v.abs().max() * (1 + 1e-4)).all()  # a convex combination of values


# ----------------------------------------------------------------------------------------------
# OAL grouping


def test_contribution_scores_match_pairwise_mean():
    q, k, _ = qkv(T=9)
    c = oal_groups.contribution_scores(q, k)
    i, j = torch.tril_indices(9, 9)  # causal pairs
    ref = (q[:, :, i].abs() * k[:, :, j].abs()).mean(2)
    assert torch.allclose(c, ref, atol=1e-12)
    i, j = torch.arange(9).repeat_interleave(9), torch.arange(9).repeat(9)  # all pairs
    ref = (q[:, :, i].abs() * k[:, :, j].abs()).mean(2)
    assert torch.allclose(oal_groups.contribution_scores(q, k, causal=False), ref, atol=1e-12)


def constant_rows(c, N=8):
    """N calibration sequences that all have the mean scores c: every bootstrap resample is c itself."""
    return torch.tensor(c, dtype=torch.float64).expand(N, len(c))


def test_find_groups_hand_worked():
    """D = 16: candidates are 1 to ceil(16/4) - 1 = 3 dimensions above a boundary (t = 12, 13, 14 in the
    sorted order). With identical sequences the support of a candidate is 1 if its ratio >= 1.5, else 0."""
    # a clear outlier: ratios 1, 1, 10 -> t = 14 passes alone -> two groups, dim 15 alone
    assert oal_groups.find_groups(constant_rows([1.0] * 15 + [10.0])).tolist() == [0] * 15 + [1]
    # two moderate dims (x3) and a strong one (x10): t = 12 (ratio 3) and t = 14 (3.33) pass -> three groups
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [3.0, 3.0, 10.0])).tolist() == [0] * 13 + [1, 1, 2]
    # no outlier: ratios 1.1, 1.09, 1.17, none passes; the best-ranked (highest ratio, t = 14) is used anyway
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.1, 1.2, 1.4])).tolist() == [0] * 15 + [1]
    # a tie: ratios 1.25, 1.2, 1.25 (exact in binary); t = 12 and t = 14 tie, the lower index wins
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.25, 1.5, 1.875])).tolist() == [0] * 13 + [1, 1, 1]
    # never more than ceil(D/4) - 1 = 3 dims above the lowest boundary: a 4-dim outlier block is out of reach
    groups = oal_groups.find_groups(constant_rows([1.0] * 12 + [10.0] * 4))
    assert groups.max() == 1 and groups.sum() <= 3
    # the budget study's rule: the G - 1 best-ranked boundaries whatever their ratio: t = 14 (1.17), then t = 12 (1.1)
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.1, 1.2, 1.4]), budget=3).tolist() == [0] * 13 + [1, 1, 2]
    assert oal_groups.find_groups(constant_rows([1.0] * 16), budget=1).eq(0).all()


def test_find_groups_support_comes_first():
    """A gap seen in only half the sequences (mean ratio 1.55) has bootstrap support below 90%: it is not
    kept by the thresholds, but as the only candidate with any support it ranks first and is the forced one."""
    g = torch.Generator().manual_seed(0)
    noisy = 1 + 0.05 * torch.rand(32, 16, generator=g)
    noisy[::2, 15] *= 2.1
    ranked = oal_groups.rank_cuts(noisy)
    assert ranked[0][0] == [15] and ranked[0][1] >= 1.5 and 0 < ranked[0][2] < 0.9
    assert all(support == 0 for _, _, support in ranked[1:])
    assert oal_groups.find_groups(noisy).tolist() == [0] * 15 + [1]


def test_oal_grouping_then_calibration_keeps_the_best_checkpoint():
    """OAL grouped from the calibration q, k (2-5 groups per head, the outlier out of the bulk), then
    calibrated with held-out windows: the kept checkpoint's held-out loss is at most the Taylor start's."""
    q, k, v = qkv(B=4, T=24, D=16, Dv=16, seed=3)
    q[..., 3] *= 6  # an outlier dimension in every head
    fmap = fm.make_feature_map("oal", 16, 2).double()
    val = qkv(B=2, T=24, D=16, Dv=16, seed=4)
    val[0][..., 3] *= 6
    groups = fmap.set_groups_from(q, k)
    distill.distill_feature_map(fmap, q, k, v, loss="mse", steps=30, val=tuple(val))
    assert all(2 <= int(g.max()) + 1 <= 5 for g in groups)
    assert (groups[:, 3] > 0).all()  # the outlier is out of the bulk
    kept = distill.distill_loss(fmap, *val, loss="mse").item()
    fresh = fm.make_feature_map("oal", 16, 2).double()
    fresh.set_groups(groups)
    start = distill.distill_loss(fresh, *val, loss="mse").item()
    assert kept <= start  # never worse than the Taylor start on held-out data


# ----------------------------------------------------------------------------------------------
# the module: causality, decoding


@pytest.mark.parametrize("name", ["softmax", "swa", "lolcats"] + NAMES)
def test_causality_and_decoding(name):
    """Changing a future token changes no past output; decoding token by token equals the parallel forward."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, name, max_len=32, window=4).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    y = mha(x)
    x2 = x.clone()
    x2[:, 7] += 1.0
    assert torch.allclose(mha(x2)[:, :7], y[:, :7], atol=1e-6)
    assert not torch.allclose(mha(x2)[:, 7:], y[:, 7:], atol=1e-6)
    cache, ys = None, []
    for t in range(12):
        y_t, cache = mha.step(x[:, t], cache)
        ys.append(y_t)
    assert torch.allclose(torch.stack(ys, 1), y, atol=1e-5)  # the parallel path may run the float32 kernel


@pytest.mark.parametrize("name", ["softmax", "hedgehog", "relu"])
def test_mha_weights_are_the_ones_forward_uses(name):
    """weights(x) applied to v and projected gives forward(x): the weights shown are the ones used. Small
    inputs make relu's row sums ~1e-4, where the eps of the denominator (1e-6) changes the weights by ~1%;
    forward may run the float32 kernel, hence 1e-4."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, attention=name).double()
    x = 0.05 * torch.randn(2, 10, 16, dtype=torch.float64)
    A = mha.weights(x)  # (B, H, T, T)
    assert (A.triu(1) == 0).all()
    _, _, v = mha.heads(x)
    y, ref = mha.o((A @ v).transpose(1, 2).flatten(2)), mha(x)
    assert (y - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("name", ["softmax", "hedgehog", "taylor"])
def test_qk_dim_narrower_than_v(name, torch_path):
    """MultiHeadAttention with q, k of qk_dim and v of C / H: the output against softmax_attention or
    the linear loop reference in float64, and its step() decoding against the parallel form."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 2, attention=name, qk_dim=3).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    q, k, v = mha.heads(x)
    assert q.shape == k.shape == (2, 2, 7, 3) and v.shape == (2, 2, 7, 6)
    y = softmax_attention(q, k, v) if mha.fmap is None else loop_reference(*mha.fmap(q, k), v)
    ref = mha.o(y.transpose(1, 2).flatten(2))
    assert torch.allclose(mha(x), ref, atol=1e-10)
    cache, steps = None, []
    for t in range(7):
        y_t, cache = mha.step(x[:, t], cache)
        steps.append(y_t)
    assert torch.allclose(torch.stack(steps, 1), ref, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# distillation and fidelity


def test_fidelity_by_hand():
    """Two tokens, relu map, D = 1: q = [1, 2], k = [1, 3]. Row 0 sees only key 0: both weights are 1.
    Row 1: softmax of [2*1, 2*3] = [2, 6] -> [1/(1+e^4), e^4/(1+e^4)]; relu weights [2, 6] / 8.
    KL is the mean over the two rows; the first row contributes 0."""
    q = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 1, 2, 1)
    k = torch.tensor([1.0, 3.0], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64).view(1, 1, 2, 2)
    p = torch.tensor([1 / (1 + math.e ** 4), math.e ** 4 / (1 + math.e ** 4)], dtype=torch.float64)
    r = torch.tensor([0.25, 0.75], dtype=torch.float64)
    f = distill.mimicry(q, k, v, fm.make_feature_map("relu", 1))
    assert math.isclose(f["kl"], (p * (p / r).log()).sum().item() / 2, rel_tol=1e-6)
    # outputs: row 0 is v_0 for both; row 1 is p (softmax) vs r (relu) since v is the identity
    assert math.isclose(f["rel_mse"], ((p - r) ** 2).sum().item() / (1 + (p ** 2).sum().item()), rel_tol=1e-5)
    entropy_r = -(r * r.log()).sum().item()
    assert math.isclose(f["entropy"], entropy_r / 2, rel_tol=1e-6)


def test_monotonicity_of_taylor_and_relu():
    q, k, v = qkv(T=30, D=8, scale=0.4)  # |s| < 1, where 1 + s + s^2/2 increases with s
    s = logits(q, k)
    assert s.abs().max() < 1
    assert distill.mimicry(q, k, v, fm.make_feature_map("taylor", 8))["monotonicity"] == pytest.approx(1.0)
    assert distill.mimicry(q, k, v, fm.make_feature_map("relu", 8))["monotonicity"] < 0.9


@pytest.mark.parametrize("name,loss,metric,gain", [("hedgehog", "xent", "kl", 0.8), ("t2r", "xent", "kl", 0.95),
                                                   ("oal", "mse", "rel_mse", 0.8), ("hedgehog", "both", "kl", 0.8)])
def test_distillation_improves_fidelity_and_moves_only_the_map(name, loss, metric, gain):
    """Distil on frozen q, k, v of a real module; its projections must not move, the map's parameters must.
    gain: the fidelity metric must drop below gain x its start in 60 steps. T2R gets 0.95: its relu
    features cannot be spiky, and 60 steps took its KL from 2.27 to 1.98 (x0.88)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 2, attention=name)
    x = torch.randn(4, 40, 32) * 2
    q, k, v = mha.heads(x)
    q, k = 3 * q, 3 * k  # sharper teacher attention, where the untrained maps are far off
    proj = {n: p.detach().clone() for n, p in mha.named_parameters() if not n.startswith("fmap.")}
    fmap_before = [p.detach().clone() for p in mha.fmap.parameters()]
    before = distill.mimicry(q, k, v, mha.fmap)[metric]
    losses = distill.distill_feature_map(mha.fmap, q, k, v, loss=loss, steps=60, lr=1e-2)
    after = distill.mimicry(q, k, v, mha.fmap)[metric]
    assert losses[-1] < losses[0] and after < gain * before, (before, after)
    assert all(torch.equal(p, proj[n]) for n, p in mha.named_parameters() if not n.startswith("fmap."))
    assert any(not torch.equal(a, b) for a, b in zip(fmap_before, mha.fmap.parameters()))


def test_distill_rejects_fixed_maps_and_missing_v():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="no parameters"):
        distill.distill_feature_map(fm.make_feature_map("elu", 8), q, k)
    with pytest.raises(ValueError, match="needs v"):
        distill.distill_feature_map(fm.make_feature_map("oal", 8, 2), q, k, loss="mse")


# ----------------------------------------------------------------------------------------------
# device portability: no float64 anywhere when the inputs are float32 (MPS has no float64)


class NoFloat64(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any operation that takes or makes a float64 tensor. We have no Mac: this catches on a
    CPU what would stop a run on Apple's MPS backend."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_flatten((args, kwargs, out))[0]:
            if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
                raise AssertionError(f"float64 in {func}")
        return out


def test_float64_guard_catches_float64():
    with pytest.raises(AssertionError, match="float64"), NoFloat64():
        torch.ones(3) * torch.ones(3, dtype=torch.float64)


@pytest.mark.parametrize("name", ["softmax"] + NAMES)
def test_no_float64_in_any_map_or_form(name, torch_path):
    """Every feature map and every attention form, forward and backward, in float32 (on the PyTorch path)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, name, max_len=16)
    x = torch.randn(2, 12, 16, requires_grad=True)
    with NoFloat64():
        q, k, v = mha.heads(x)
        if mha.fmap is None:
            outs = [softmax_attention(q, k, v), mha(x)]
        else:
            qf, kf = mha.fmap(q, k)
            outs = [linear_attention(qf, kf, v, backend="torch"), linear_attention(qf, kf, v, causal=False),
                    linear_attention_quadratic(qf, kf, v), linear_attention_cumsum(qf, kf, v),
                    linear_attention_chunked(qf, kf, v, 8), linear_attention_step(qf[:, :, 0], kf[:, :, 0], v[:, :, 0])[0]]
        outs.append(mha.weights(x))
        sum(o.sum() for o in outs).backward()
        mha.step(x[:, 0].detach())


def test_no_float64_in_a_training_step_of_each_script(torch_path):
    """One AdamW step of train_ar.py's and train_gpt.py's models, and one step of each convert.py stage."""
    with NoFloat64():
        for model, (x, y) in ((train_ar.ARModel("oal"), train_ar.make_ar_data(4, seed=0)),
                              (tiny_gpt("cosformer"), (torch.randint(0, 50, (2, 24)),) * 2)):
            opt = torch.optim.AdamW(model.parameters())
            logits = model(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).backward()
            opt.step()
        teacher, model = tiny_gpt(), tiny_gpt()
        convert.swap(model, "hedgehog", [0, 1])
        qkv = distill.layer_qkv(teacher, torch.randint(0, 50, (2, 24)), [0])
        distill.distill_loss(model.blocks[0].attn.fmap, *qkv[0], loss="both").backward()
        convert.finetune_model(model, torch.randint(0, 50, (200,)), dict(finetune="lora", lora_r=2, lora_alpha=4,
                               finetune_lr=1e-3, finetune_iters=1, seed=0, batch_size=2), "cpu")
