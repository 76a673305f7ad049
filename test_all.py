"""
The test suite: every attention path against an independent float64 oracle, softmax and the weights,
the module, and no float64 in float32 runs; the shared helpers. Run: python -m pytest -q
(test_feature_maps.py tests each map against its closed form; test_oal_groups.py OAL's grouping;
test_distill.py the distillation and the fidelity metrics;
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
