"""
The tests of distill.py (Hedgehog Sec. 3.1, 4.2, App. A.3; OAL Sec. 4.3, 5.1): the fidelity metrics and the
distillation losses worked by hand, the training loop (the last step checked, held-out windows, the map
alone moved, AdamW without weight decay) and its refusals.
Run: python -m pytest -q test_distill.py
"""
from test_all import qkv, tiny_gpt  # first: sets TRITON_INTERPRET

import math

import pytest
import torch
import torch.nn as nn

import distill
import feature_maps as fm
from attention import MultiHeadAttention, linear_attention_quadratic, softmax_attention


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


def test_distillation_losses_and_output_errors_by_hand(monkeypatch):
    """The example above: xent is -sum_j p_j log r_j per row, 0 in row 0, averaged over the 2 rows; mse the
    mean of the 4 output entries' squared errors; "both" their sum. With two windows in a batch, mimicry's
    RelMSE and output_rel_mse's per head are means of each window's own (not pooled), and output_rel_mse
    after the output projection is computed here with its weights. layer_qkv leaves no hooks behind."""
    q = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 1, 2, 1)
    k = torch.tensor([1.0, 3.0], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.eye(2, dtype=torch.float64).view(1, 1, 2, 2)
    p = torch.tensor([1 / (1 + math.e ** 4), math.e ** 4 / (1 + math.e ** 4)], dtype=torch.float64)
    r = torch.tensor([0.25, 0.75], dtype=torch.float64)
    relu = fm.make_feature_map("relu", 1)
    xent, mse = -(p * r.log()).sum().item() / 2, ((p - r) ** 2).sum().item() / 4
    for loss, want in (("xent", xent), ("mse", mse), ("both", xent + mse)):
        assert distill.distill_loss(relu, q, k, v, loss).item() == pytest.approx(want, rel=1e-6), loss

    q, k, v = qkv(B=2, H=2, T=6, D=4, Dv=4, seed=3)
    q[1], k[1] = 3 * q[1], 3 * k[1]  # the second window is sharper: its errors differ from the first's
    elu = fm.make_feature_map("elu", 4)
    one = [distill.mimicry(q[b:b + 1], k[b:b + 1], v[b:b + 1], elu)["rel_mse"] for b in (0, 1)]
    assert one[0] != pytest.approx(one[1], rel=0.1)
    assert distill.mimicry(q, k, v, elu)["rel_mse"] == pytest.approx(sum(one) / 2, rel=1e-6)
    o, ohat = softmax_attention(q[:1], k[:1], v[:1]), linear_attention_quadratic(*elu(q[:1], k[:1]), v[:1])
    assert one[0] == pytest.approx(((ohat - o) ** 2).sum().item() / (o ** 2).sum().item(), rel=1e-9)  # heads pooled
    attn = MultiHeadAttention(8, 2, bias=True).double()
    heads = [distill.output_rel_mse(attn, elu, q[b:b + 1], k[b:b + 1], v[b:b + 1])[0] for b in (0, 1)]
    per_head, after_o = distill.output_rel_mse(attn, elu, q, k, v)
    assert per_head == pytest.approx([(x + y) / 2 for x, y in zip(*heads)], rel=1e-9)
    merge = lambda x: x.transpose(1, 2).reshape(2, 6, 8) @ attn.o.weight.T + attn.o.bias  # (B, T, C), projected
    y, yhat = merge(softmax_attention(q, k, v)), merge(linear_attention_quadratic(*elu(q, k), v))
    assert after_o == pytest.approx((((yhat - y) ** 2).sum((1, 2)) / (y ** 2).sum((1, 2))).mean().item(), rel=1e-9)

    model = tiny_gpt()
    distill.layer_qkv(model, torch.zeros(1, 4, dtype=torch.long), [0, 1])
    assert not any(block.attn._forward_pre_hooks for block in model.blocks)


def test_distillation_checks_the_last_step_and_trains_the_gate(monkeypatch):
    """distill_feature_map checks the held-out loss at every eval_every steps and at the last: with it scripted
    to 3, 2, 1 at steps 0, 10 and 15, the last parameters are kept (those of the same run without held-out
    windows). With a window, the hybrid's gate trains with the map."""
    q, k, v = qkv(B=2, T=16, D=8, Dv=8, seed=1)
    real, scripted = distill.distill_loss, iter([3.0, 2.0, 1.0])
    monkeypatch.setattr(distill, "distill_loss", lambda *a, **kw: real(*a, **kw) if torch.is_grad_enabled()
                        else torch.tensor(next(scripted)))
    maps = []
    for val in ((q, k, v), None):
        fmap = fm.make_feature_map("hedgehog", 8, 2).double()
        distill.distill_feature_map(fmap, q, k, v, loss="mse", steps=15, val=val)
        maps.append(torch.cat([p.detach().flatten() for p in fmap.parameters()]))
    assert next(scripted, None) is None and torch.equal(*maps)
    gate = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    distill.distill_feature_map(fm.make_feature_map("hedgehog", 8, 2).double(), q, k, v, loss="mse", steps=3,
                                window=4, gate_logit=gate)
    assert (gate != 0).all()


def test_spearman_rows_by_hand():
    """Causal, T = 4: rows 0 and 1 see fewer than 3 keys and are skipped. Row 2 ranks its keys 0 1 2 and 0 2 1:
    rho = 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 12 / 24 = 0.5; row 3 ranks them in reverse: -1. The mean is -0.25,
    and the keys a row does not see (here larger than every seen one) change nothing."""
    x = torch.tensor([[0.1, 9, 9, 9], [0.1, 0.2, 9, 9], [0.1, 0.2, 0.3, 9], [1, 2, 3, 4]], dtype=torch.float64)
    y = torch.tensor([[0.1, 9, 9, 9], [0.2, 0.1, 9, 9], [0.1, 0.3, 0.2, 9], [4, 3, 2, 1]], dtype=torch.float64)
    assert math.isclose(distill.spearman_rows(x.view(1, 1, 4, 4), y.view(1, 1, 4, 4)), -0.25, abs_tol=1e-6)  # float32 ranks


def test_distillation_keeps_the_parameters_best_on_held_out_windows():
    """Calibrated on sharp q, k (scale 3) and checked on soft ones (0.3), where OAL's Taylor start is already
    nearly exact: every step makes the held-out loss worse, so the parameters kept are the start's, bit for
    bit, while the same 30 steps without held-out windows move them."""
    q, k, v = qkv(B=2, T=16, D=8, Dv=8, scale=3.0, seed=1)
    val = qkv(B=2, T=16, D=8, Dv=8, scale=0.3, seed=2)
    for held_out in (val, None):
        fmap = fm.make_feature_map("oal", 8, 2).double()
        distill.distill_feature_map(fmap, q, k, v, loss="mse", steps=30, lr=0.1, val=held_out)
        assert torch.equal(fmap.L, fm.make_feature_map("oal", 8, 2).double().L) == (held_out is not None)


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


def test_distillation_is_adamw_without_weight_decay(monkeypatch):
    """Hedgehog App. A.3: AdamW at lr 1e-2 with no weight decay (AdamW's own default is 0.01), on the map alone."""
    made, adamw, fmap = [], torch.optim.AdamW, fm.make_feature_map("hedgehog", 8, 2)
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: made.append((list(params), kw)) or adamw(params, **kw))
    distill.distill_feature_map(fmap, *qkv()[:2], steps=1)
    assert made == [(list(fmap.parameters()), {"lr": 1e-2, "weight_decay": 0.0})]


def test_distill_rejects_fixed_maps_missing_v_and_shapes_that_do_not_fit():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="no parameters"):
        distill.distill_feature_map(fm.make_feature_map("elu", 8), q, k)
    with pytest.raises(ValueError, match="needs v"):
        distill.distill_feature_map(fm.make_feature_map("oal", 8, 2), q, k, loss="mse")
    for steps, eval_every in [(-1, 10), (5, 0)]:
        with pytest.raises(ValueError, match=f"steps must be >= 0 and eval_every >= 1, got {steps} and {eval_every}"):
            distill.distill_feature_map(fm.make_feature_map("hedgehog", 8, 2), q, k, steps=steps, eval_every=eval_every,
                                        val=(q, k, v))
    for bad_k, bad_v, loss in [(k[:, :, :3], None, "xent"), (k, v[:, :, :3], "both")]:  # a RuntimeError in the mask
        with pytest.raises(ValueError, match="expected q, k of shape"):
            distill.distill_feature_map(fm.make_feature_map("hedgehog", 8, 2), q, bad_k, bad_v, loss=loss)
