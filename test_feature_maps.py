"""
The tests of feature_maps.py: each map against its closed form (the kernel it stands for, written out
independently in float64), its initialisation, its numerics in half precision and at 32K tokens; OAL's
kernel against its definition (its grouping, oal_groups.py: test_oal_groups.py).
"""
import math

from test_all import NAMES, POLYNOMIAL, logits, make_map, qkv  # first: sets TRITON_INTERPRET

import pytest
import torch
import torch.nn.functional as F

import ar
import distill
import feature_maps as fm
import oal_groups
import train_ar
from attention import attention_weights, linear_attention


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


@pytest.mark.parametrize("name", NAMES)
def test_a_map_refuses_q_k_of_another_size(name):
    """Built for D = 8 and H = 2: another D or H, q and k apart, or a missing batch axis is one clear
    ValueError, through the features and through scores (the closed form's path for Taylor at this D)."""
    fmap = make_map(name, D=8, H=2)
    q, k, _ = qkv(D=8)
    for args, match in [((q[..., :6], k[..., :6]), "built for head_dim=8, num_heads=2; got q, k of shape \\(2, 2, 37, 6\\)"),
                        ((torch.cat([q, q], 1), torch.cat([k, k], 1)), "built for head_dim=8, num_heads=2"),
                        ((q, k[:, :1]), "expected q, k of shape \\(B, H, T, D\\)"),
                        ((q[0], k[0]), "expected q, k of shape \\(B, H, T, D\\)")]:
        for call in (fmap, fmap.scores):
            with pytest.raises(ValueError, match=match):
                call(*args)
    assert fm.make_feature_map(name, 8, 1).double()(q, k)[0].shape[:3] == q.shape[:3]  # one head's map serves all


def test_unknown_names_and_options_are_refused():
    """An unknown name lists the valid ones; a size or an option that cannot work is one ValueError at
    construction (D = 0 and t = nan built maps that gave empty or NaN features, Performer at D = 1 no features)."""
    with pytest.raises(ValueError, match="hedgehog.*oal|oal.*hedgehog"):
        fm.make_feature_map("softmaxx", 8)
    for name in NAMES:
        for D, H in [(0, 1), (8, 0), (2.5, 1), (True, 1)]:
            with pytest.raises(ValueError, match="must be a positive integer"):
                fm.make_feature_map(name, D, H)
        assert fm.make_feature_map(name, 1)(torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1))[0].shape[-1] >= 1
    for name, options, match in [("oal", dict(max_groups=0), "oal: max_groups must be a positive integer, got 0"),
                                 ("oal", dict(eps=0.0), "oal: eps must be a finite positive number"),
                                 ("exp", dict(t=float("nan")), "exp: t must be a finite number, got nan"),
                                 ("performer", dict(num_features=0), "performer: num_features must be a positive"),
                                 ("cosformer", dict(max_len=0), "cosformer: max_len must be a positive integer"),
                                 ("elu", dict(t=2.0), "'elu' has no option t; its options: none"),  # a TypeError
                                 ("exp", dict(temp=2.0), "'exp' has no option temp; its options: t, normalize")]:
        with pytest.raises(ValueError, match=match):
            fm.make_feature_map(name, 8, **options)


def test_taylor_is_exact_second_order():
    """Float64 throughout: a float32 constant inside (it happened: sqrt(2)) shows up at 1e-9."""
    q, k, _ = qkv(D=6, scale=2.0)
    s = logits(q, k)
    fmap = fm.make_feature_map("taylor", 6)
    assert torch.allclose(kernel_matrix(fmap, q, k), 1 + s + s ** 2 / 2, rtol=1e-13, atol=1e-13)
    assert fmap(q, k)[0].shape[-1] == 1 + 6 + 21


def test_monotonicity_of_taylor_and_relu():
    q, k, v = qkv(T=30, D=8, scale=0.4)  # |s| < 1, where 1 + s + s^2/2 increases with s
    s = logits(q, k)
    assert s.abs().max() < 1
    assert distill.mimicry(q, k, v, fm.make_feature_map("taylor", 8))["monotonicity"] == pytest.approx(1.0)
    assert distill.mimicry(q, k, v, fm.make_feature_map("relu", 8))["monotonicity"] < 0.9


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


def test_oal_split_keeps_the_kernel(monkeypatch):
    """Splitting a trained one-group head, as train_ar.regroup_oal does after the first epoch, changes
    nothing at once: the model's outputs before and after are the same. Each layer is grouped on the q, k
    of its own input, the output of the layers before it."""
    torch.manual_seed(0)
    model = ar.ARModel("oal", n_layer=2, d_model=16, qk_dim=8).double()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.fmap.L.add_(0.3 * torch.randn_like(block.attn.fmap.L))
    x, _ = ar.make_ar_data(8, seed=0)
    before = model(x)
    with torch.no_grad():
        h1 = model.blocks[0](model.embed(x))
        q_by_hand = [model.blocks[i].attn.heads(model.blocks[i].ln1(h))[0] for i, h in enumerate((model.embed(x), h1))]
    seen, set_groups_from = [], fm.OAL.set_groups_from

    def spy(self, q, k):  # the real grouping, noting the q it was given
        seen.append(q)
        return set_groups_from(self, q, k)
    monkeypatch.setattr(fm.OAL, "set_groups_from", spy)
    train_ar.regroup_oal(model, x)
    assert len(seen) == 2 and all(torch.allclose(q, q0) for q, q0 in zip(seen, q_by_hand))
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
    for scores in (torch.rand(8), torch.rand(0, 8)):  # one head's scores, no sequence: torch errors inside
        with pytest.raises(ValueError, match="scores must be \\(N, D\\)"):
            oal_groups.find_groups(scores)


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


@pytest.mark.parametrize("mode,separate_qk", [("softmax", False), ("softmax_halves", True)])
def test_hedgehog_feature_dim_projects_to_f(mode, separate_qk):
    """feature_dim = f (LoLCATs' configs: D / 2) gives F = 2f: at init the first f dimensions of x, then
    with W, b moved [y, -y] through the mode's softmax, y = x W + b with W (H, D, f), by hand."""
    q, k, _ = qkv()  # D = 8
    fmap = fm.make_feature_map("hedgehog", 8, 2, mode=mode, separate_qk=separate_qk, feature_dim=3).double()
    phi = {"softmax": lambda y: torch.cat([y, -y], -1).softmax(-1),
           "softmax_halves": lambda y: torch.cat([y.softmax(-1), (-y).softmax(-1)], -1)}[mode]
    assert torch.allclose(fmap(q, k)[1], phi(k[..., :3]), atol=1e-12)
    with torch.no_grad():
        for p in fmap.parameters():
            p.add_(torch.randn_like(p))
    Wk, bk = (fmap.Wk, fmap.bk) if separate_qk else (fmap.W, fmap.b)
    qf, kf = fmap(q, k)
    assert qf.shape[-1] == kf.shape[-1] == 6
    assert torch.allclose(qf, phi(torch.einsum("bhtd,hdf->bhtf", q, fmap.W) + fmap.b), atol=1e-12)
    assert torch.allclose(kf, phi(torch.einsum("bhtd,hdf->bhtf", k, Wk) + bk), atol=1e-12)
    with pytest.raises(ValueError, match="feature_dim must be a positive integer"):
        fm.make_feature_map("hedgehog", 8, feature_dim=0)


def test_exp_weights_unchanged_by_stabilisation():
    q, k, _ = qkv(scale=3.0)
    for t in (1.0, 2.0):
        A = attention_weights(q, k, fm.make_feature_map("exp", 8, t=t))
        raw = (t * q).exp() @ (t * k).exp().transpose(-1, -2)
        raw = raw.tril()
        assert torch.allclose(A, raw / raw.sum(-1, keepdim=True), atol=1e-12)


def test_exp_norm_ratio_bound_holds_against_an_adversary():
    """exp_norm's ratio K(q, k) / K(q, k') for unit q, k, k', pushed up by gradient ascent through the map
    itself, stays under fm.exp_norm_ratio_bound. Where every vector sits on its own axis the ratio is
    (e^2t + D - 1) / (2 e^t + D - 2), which the ascent must pass: that arrangement is not the largest. The
    bound's value is checked too, since a smaller wrong one would still hold here."""
    for D in (8, 64):
        for t in (1.0, 2.0, 4.0, 8.0):
            fmap = fm.make_feature_map("exp", D, t=t, normalize=True)
            torch.manual_seed(0)
            x = torch.randn(3, D, requires_grad=True)  # q, k, k' before the map normalises them
            opt = torch.optim.Adam([x], lr=0.05)
            for _ in range(300):
                qf, kf = fmap(x[None, None, :1], x[None, None, 1:])
                K = (qf @ kf.transpose(-1, -2)).flatten().double()  # (2,): K(q, k), K(q, k')
                log_ratio = K[0].log() - K[1].log()
                opt.zero_grad()
                (-log_ratio).backward()
                opt.step()
            on_axes = (math.exp(2 * t) + D - 1) / (2 * math.exp(t) + D - 2)
            assert on_axes < log_ratio.exp().item() <= fm.exp_norm_ratio_bound(t, D), (D, t)
    for t in (1.0, 2.0, 4.0, 8.0):  # the bound itself, at D = 64 written out as docs/results.md gives it
        hand = (math.exp(2 * t) + 63 + 14 * t) / (64 * math.exp(-t / 4))
        assert fm.exp_norm_ratio_bound(t, 64) == pytest.approx(hand, rel=1e-12)


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
    assert [fm.make_feature_map("performer", D).m for D in (8, 64)] == [17, 266]  # round(D ln D), the Performer paper's


def test_cosformer_reweights_by_cos_distance():
    q, k, _ = qkv(T=13)
    for max_len in (None, 40):
        M = max_len or 13
        i = torch.arange(13, dtype=torch.float64)
        expected = F.relu(q) @ F.relu(k).transpose(-1, -2) * torch.cos(math.pi * (i[:, None] - i[None, :]) / (2 * M))
        got = kernel_matrix(fm.make_feature_map("cosformer", 8, max_len=max_len), q, k)
        assert torch.allclose(got, expected, atol=1e-12)
    fmap = fm.make_feature_map("cosformer", 8, max_len=5)  # decoding: positions 0..4, the last at offset 4
    fmap(q[:, :, :1], k[:, :, :1], offset=4)
    with pytest.raises(ValueError, match="position 5 is past max_len=5"):
        fmap(q[:, :, :1], k[:, :, :1], offset=5)


def test_taylorshift_kernel():
    """1 + tau x + (tau x)^2 / 2 from the features and from the closed form, for a temperature of either sign."""
    fmap = make_map("taylorshift")
    q, k, _ = qkv()
    x = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    with torch.no_grad():
        fmap.tau[0] = -0.7
    tx = fmap.tau[None] * x  # (H, 1, 1) temperature per head
    assert torch.allclose(kernel_matrix(fmap, q, k), 1 + tx + tx ** 2 / 2, atol=1e-10)
    assert torch.allclose(fmap.scores(q, k), 1 + tx + tx ** 2 / 2, atol=1e-10)


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
    fresh = fm.make_feature_map("dijiang", D, 2).double()  # w starts at 1: each feature vector sums to 1
    assert torch.allclose(fresh(q, k)[1].sum(-1), torch.ones(()).double(), atol=1e-12)


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
