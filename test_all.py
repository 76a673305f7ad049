"""
The test suite: every attention path against an independent float64 oracle, softmax and the weights,
the module, distillation, and no float64 in float32 runs; the shared helpers. Run: python -m pytest -q
(test_feature_maps.py tests each map against its closed form; test_oal_groups.py OAL's grouping;
test_hybrid.py LoLCATs' window + linear hybrid; test_kernel.py kernel.py; test_build_check.py the build
check; test_ar.py, test_scripts.py and test_bench.py run the scripts; test_pretrained.py the pretrained
models.)

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
import torch.nn as nn
import torch.nn.functional as F

import ar
import convert
import distill
import feature_maps as fm
import kernel
from attention import (MultiHeadAttention, attention_weights, hybrid_attention, hybrid_attention_quadratic,
                       linear_attention, linear_attention_chunked, linear_attention_cumsum, linear_attention_quadratic,
                       linear_attention_step, sliding_window_attention, softmax_attention)
from gpt import GPT

NAMES = list(fm.FEATURE_MAPS)
POLYNOMIAL = ["taylor", "taylorshift", "quadratic", "oal"]  # the maps with a closed form (FeatureMap.squares)
HAS_TRITON = kernel.HAS_TRITON and (torch.cuda.is_available() or kernel.INTERPRET)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (Linux only), and 3.7+ for its CPU interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(*args, cwd=HERE, ok=True, cpu=False):
    """Run a script of this folder in a subprocess on the fast PyTorch path (no Triton interpreter); cpu=True
    hides any GPU from it. Returns stdout; with ok=False the run must fail, and stderr comes back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = HERE
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
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


def step_by_step(module, x):
    """module.step over x (B, T, C) one token at a time from an empty cache: the outputs, (B, T, C)."""
    cache, ys = None, []
    for t in range(x.shape[1]):
        y, cache = module.step(x[:, t], cache)
        ys.append(y)
    return torch.stack(ys, 1)


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


def logits(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # s = q.k / sqrt(D), (B, H, T, T)


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
    for form in (lambda a, b, c: linear_attention(a, b, c, backend="torch"),
                 lambda a, b, c: linear_attention_chunked(a, b, c, 16)):
        for r, x in zip(ref, grads(form)):
            if r is not None:
                assert torch.allclose(x, r, rtol=1e-8, atol=1e-9 * r.abs().max().item())


def test_the_public_forms_refuse_shapes_that_do_not_fit():
    """k of another head count would broadcast, v of another length fail inside a matmul, and so would the
    module's input of the wrong width, and the GPT's of too many tokens; sizes and a gate that cannot work
    failed in torch or later: one ValueError each."""
    q, k, v = qkv(T=8)
    for form, names in [(lambda q, k, v: softmax_attention(q, k, v), "q, k"),
                        (lambda q, k, v: linear_attention(q.exp(), k.exp(), v, causal=False), "qf, kf"),
                        (lambda q, k, v: linear_attention(q.exp(), k.exp(), v), "qf, kf"),
                        (lambda q, k, v: hybrid_attention_quadratic(q, k, q, k, v, 2, 1.0), "q, k"),
                        (lambda q, k, v: hybrid_attention(q, k, q, k, v, 2, 1.0), "q, k"),
                        (lambda q, k, v: sliding_window_attention(q, k, v, 2), "q, k")]:
        for bad in [(q, k[:, :1], v), (q, k, v[:, :, :5]), (q[0], k[0], v[0])]:
            with pytest.raises(ValueError, match=f"expected {names} of shape \\(B, H, T, \\.\\) alike"):
                form(*bad)
    for bad in [(q, k[:, :, :5], None), (q[0], k[0], None), (q, k[:, :, :5], fm.make_feature_map("elu", 8))]:
        with pytest.raises(ValueError, match="expected q, k of shape \\(B, H, T, \\.\\) alike; got"):
            attention_weights(*bad)  # the weights: a RuntimeError inside the causal mask
    mha = MultiHeadAttention(16, 2, attention="hedgehog")
    for bad in (torch.randn(2, 8, 12), torch.randn(8, 16)):  # the wrong width; no batch dimension
        with pytest.raises(ValueError, match="expected x of shape \\(B, T, 16\\), got"):
            mha(bad)
    with pytest.raises(ValueError, match="expected x of shape \\(B, T, 16\\), got \\(2, 1, 12\\)"):
        mha.step(torch.randn(2, 12))
    for bad in (torch.zeros(2, 25, dtype=torch.long), torch.zeros(24, dtype=torch.long)):  # tiny_gpt: block_size 24
        with pytest.raises(ValueError, match="expected token ids \\(B, T\\) with T <= block_size = 24, got"):
            tiny_gpt()(bad)
    for build, match in [(lambda: MultiHeadAttention(16, 0), "must be at least 1"),  # a modulo by 0
                         (lambda: GPT(0, 24, 2, 2, 16), "must be at least 1"),  # a GPT of no ids
                         (lambda: MultiHeadAttention(16, 2).use("lolcats", gate=1.0), "strictly between 0 and 1"),
                         (lambda: MultiHeadAttention(16, 2, qk_dim=-4), "qk_dim must be at least 1"),  # torch's error
                         (lambda: MultiHeadAttention(16, 2, "softmax", t=2.0), "softmax has no feature map"),  # ignored
                         (lambda: ar.make_ar_data(4, seq_len=2), "seq_len must be at least 3"),  # torch's random_ error
                         (lambda: ar.make_h3_data(4, vocab_size=3), "vocab_size 4")]:
        with pytest.raises(ValueError, match=match):
            build()


@pytest.mark.parametrize("B,T", [(0, 8), (2, 0)])
def test_every_form_takes_no_sequences_or_no_tokens(B, T):
    """An empty batch, or sequences of no tokens: every form returns the empty output, as softmax does, and
    the module its gradient (the chunked forms had no chunk to concatenate, the kernels' shapes did not divide)."""
    q, k, v = (x[:B, :, :T] for x in qkv(T=8))
    qf, kf = q.exp(), k.exp()
    forms = [softmax_attention(q, k, v), linear_attention_quadratic(qf, kf, v), linear_attention_cumsum(qf, kf, v),
             linear_attention_chunked(qf, kf, v, chunk=4), linear_attention(qf, kf, v, backend="torch"),
             hybrid_attention_quadratic(q, k, qf, kf, v, 2, 0.5), hybrid_attention(q, k, qf, kf, v, 2, 0.5, chunk=4),
             sliding_window_attention(q, k, v, 2)]
    forms += [linear_attention(*(x.float().to(DEV) for x in (qf, kf, v)), backend="triton")] if HAS_TRITON else []
    assert all(y.shape == v.shape for y in forms)
    for name in ["softmax", "swa", "lolcats", "hedgehog", "taylor"]:
        x = torch.randn(B, T, 16, requires_grad=True)
        MultiHeadAttention(16, 2, attention=name)(x).sum().backward()
        assert x.grad.shape == x.shape


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
    assert torch.allclose(step_by_step(mha, x), y, atol=1e-5)  # the parallel path may run the float32 kernel


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


def test_softmax_dropout_only_while_training():
    """attn_dropout drops softmax weights in training mode only: in eval mode the output is the module's
    without dropout, in training mode it is not."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, attn_dropout=0.5).double()
    plain = MultiHeadAttention(16, 2).double()
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    assert torch.equal(mha.eval()(x), plain(x))
    assert not torch.allclose(mha.train()(x), plain(x))


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
    assert torch.allclose(step_by_step(mha, x), ref, atol=1e-10)


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
    """One AdamW step of ar.py's and gpt.py's models, and one step of each convert.py stage."""
    with NoFloat64():
        for model, (x, y) in ((ar.ARModel("oal"), ar.make_ar_data(4, seed=0)),
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
                               finetune_lr=1e-3, finetune_iters=1, seed=0, batch_size=2, finetune_maps=True), "cpu")
