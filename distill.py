"""
Teaching a feature map to mimic softmax: Hedgehog's attention distillation, OAL's output calibration,
and the fidelity metrics both papers report.

Hedgehog (Sec. 4.2, App. A.3): freeze q and k; train only the feature map so that the linear
attention weights match the softmax weights, with a soft-label cross-entropy per query row,

    loss = mean_i  - sum_{j<=i} a_ij log ahat_ij,   a = softmax(q k^T / sqrt(D)) (teacher, fp32, no grad),
                                                   ahat = normalised (qf kf^T) * mask (student, eps DISTILL_EPS = 1e-12).

OAL (Sec. 4.3, App. B): freeze q, k, v; fit the kernel so that the normalised causal outputs match
softmax's, with an MSE on the outputs (loss="mse"). loss="both" adds the two (successors of Hedgehog
combine them).

Fidelity, distill.mimicry (Hedgehog Sec. 3.1, 5.1, Table 4; OAL Sec. 5.1, App. C), per head and averaged:
    kl            KL(softmax || linear) per query row
    rel_mse       ||O_linear - O_softmax||^2 / ||O_softmax||^2 per sequence (OAL's metric)
    entropy       entropy of the linear weights per row, in nats (spikiness); entropy_softmax for the teacher
    monotonicity  Spearman correlation between q.k and the linear weight within each row

Public interface (q, k, v: (B, H, T, D) frozen tensors; fmap: a feature_maps module with H heads):
    layer_qkv(model, ids, layer_ids) -> {layer: (q, k, v)}: what each chosen layer's attention sees
    distill_loss(fmap, q, k, v=None, loss="xent", causal=True) -> the loss above, a scalar tensor
    distill_feature_map(fmap, q, k, v=None, loss="xent", steps=200, lr=1e-2, val=None) -> list of losses
    mimicry(q, k, v, fmap, causal=True, monotonicity=True) -> dict of floats
    output_rel_mse(attn, fmap, q, k, v) -> (RelMSE per head, RelMSE after attn's output projection)
All but layer_qkv also take window=w (with a gate): fmap is then the linear part of LoLCATs' hybrid.
"""
import torch

from attention import DISTILL_EPS, EPS, _fp32, attention_weights, entropy, linear_attention_quadratic, softmax_attention
from kernel import check_shapes


@torch.no_grad()
def layer_qkv(model, ids, layer_ids):
    """q, k, v (B, H, T, D) of the chosen layers when model runs on ids: model.blocks[i].attn's inputs,
    caught with forward pre-hooks. Run on the softmax teacher, each layer gets the inputs it has in the
    original model, so a map distilled there is fitted to what it will see."""
    out = {}

    def catch(i):
        def hook(attn, args):  # args[0]: the (B, T, C) input of block i's attention
            out[i] = attn.heads(args[0])
        return hook

    hooks = [model.blocks[i].attn.register_forward_pre_hook(catch(i)) for i in layer_ids]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def distill_loss(fmap, q, k, v=None, loss="xent", causal=True, window=0, gate=1.0):
    """The distillation loss of fmap on frozen q, k (and v for "mse" / "both"). window > 0: of LoLCATs'
    hybrid with fmap beyond the window and gate g (LoLCATs' attention transfer is loss="mse")."""
    if loss not in ("xent", "mse", "both"):
        raise ValueError(f"loss must be 'xent', 'mse' or 'both', got {loss!r}")
    if loss != "xent" and v is None:
        raise ValueError(f"loss={loss!r} matches attention outputs, so it needs v")
    check_shapes(q, k, v, "q, k")  # a shorter k or v would fail inside the causal mask or a matmul
    total = 0.0
    if loss in ("xent", "both"):
        with torch.no_grad():
            teacher = attention_weights(q, k, causal=causal)  # (B, H, T, T), fp32
        student = attention_weights(q, k, fmap, causal, DISTILL_EPS, window, gate)
        total = total - (teacher * student.clamp_min(1e-12).log()).sum(-1).mean()
    if loss in ("mse", "both"):
        with torch.no_grad():
            target = softmax_attention(q, k, _fp32(v), causal=causal)
        out = attention_weights(q, k, fmap, causal, EPS, window, gate) @ _fp32(v)  # the O(T^2) form's output
        total = total + (out - target).pow(2).mean()
    return total


def distill_feature_map(fmap, q, k, v=None, loss="xent", steps=200, lr=1e-2, causal=True, val=None, eval_every=10,
                        window=0, gate_logit=None):
    """Train fmap's parameters (only those) on frozen q, k, v with AdamW (Hedgehog: lr 1e-2, no weight
    decay). Returns the training loss at every step. The O(T^2) forms are used: this is for the short
    calibration sequences of one layer; a model-wide run distils every layer with one optimiser.

    Group an OAL map first (fmap.set_groups_from on the same q, k: OAL App. B). val = (q, k, v) of held-out
    windows: the loss there is checked every eval_every steps and the best parameters are kept (OAL selects
    its factors by validation output MSE). A non-finite loss stops the program with one line. window > 0:
    fmap is the linear part of LoLCATs' hybrid, and gate_logit, its (H,) gate before the sigmoid, trains with it.
    """
    params = [p for p in fmap.parameters() if p.requires_grad] + ([] if gate_logit is None else [gate_logit])
    gate = (lambda: 1.0) if gate_logit is None else gate_logit.sigmoid
    if not params:
        raise ValueError(f"{type(fmap).__name__} has no parameters to distil (it is a fixed map)")
    if steps < 0 or eval_every < 1:  # -1 step did nothing, eval_every = 0 divided by zero
        raise ValueError(f"distill_feature_map: steps must be >= 0 and eval_every >= 1, got {steps} and {eval_every}")
    q, k = q.detach(), k.detach()
    v = None if v is None else v.detach()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    history, best, best_params = [], float("inf"), None
    for step in range(steps + 1):
        if val is not None and (step % eval_every == 0 or step == steps):
            with torch.no_grad():
                held_out = distill_loss(fmap, *val, loss, causal, window, gate()).item()
            if held_out < best:
                best, best_params = held_out, [p.detach().clone() for p in params]
        if step == steps:
            break
        value = distill_loss(fmap, q, k, v, loss, causal, window, gate())
        if not torch.isfinite(value):  # the scripts' calibration loops: one line, exit status 1
            raise SystemExit(f"error: distillation step {step}: the {loss} loss is {value.item()}; "
                             f"try a lower lr (now {lr})")
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        history.append(value.item())
    if best_params is not None:
        with torch.no_grad():
            for p, b in zip(params, best_params):
                p.copy_(b)
    return history


def spearman_rows(x, y, causal=True):
    """Mean over rows i of the Spearman correlation of x_i. and y_i. over the keys row i sees (j <= i if
    causal); rows with fewer than 3 keys are skipped (nan if none is left). x, y: (B, H, T, T). Ties are
    ranked by position."""
    T = x.shape[-1]
    values = []
    for i in range(2 if causal else 0, T):
        J = i + 1 if causal else T
        rx = x[..., i, :J].argsort(-1).argsort(-1).float()  # ranks, (B, H, J)
        ry = y[..., i, :J].argsort(-1).argsort(-1).float()
        rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
        values.append((rx * ry).sum(-1) / (rx.norm(dim=-1) * ry.norm(dim=-1)))
    return torch.stack(values, -1).mean().item() if values else float("nan")


@torch.no_grad()
def mimicry(q, k, v, fmap, causal=True, monotonicity=True, window=0, gate=1.0):
    """How well fmap's linear attention (window > 0: LoLCATs' hybrid, or swa if fmap is None) mimics
    softmax on these q, k, v: see the module docstring. monotonicity=False skips its per-row loop (slow
    for long sequences)."""
    a = attention_weights(q, k, causal=causal)  # (B, H, T, T) teacher
    ahat = attention_weights(q, k, fmap, causal, DISTILL_EPS, window, gate)
    kl = (a * (a.clamp_min(1e-30).log() - ahat.clamp_min(1e-30).log())).sum(-1).mean()
    o = softmax_attention(q, k, _fp32(v), causal=causal)  # (B, H, T, Dv)
    ohat = attention_weights(q, k, fmap, causal, EPS, window, gate) @ _fp32(v)  # the output the model computes
    rel_mse = ((ohat - o).pow(2).sum((1, 2, 3)) / o.pow(2).sum((1, 2, 3))).mean()
    out = {"kl": kl.item(), "rel_mse": rel_mse.item(), "entropy": entropy(ahat).mean().item(),
           "entropy_softmax": entropy(a).mean().item()}
    if monotonicity:
        out["monotonicity"] = spearman_rows(_fp32(q) @ _fp32(k).transpose(-1, -2), ahat, causal)
    return out


@torch.no_grad()
def output_rel_mse(attn, fmap, q, k, v, window=0, gate=1.0):
    """OAL's RelMSE ||O_lin - O_soft||^2 / ||O_soft||^2 of one layer, attn (a MultiHeadAttention) with fmap
    behind its q, k, v: per head on the attention outputs (a list of H), and after the output projection o."""
    o = softmax_attention(q, k, v, causal=attn.causal)  # (B, H, T, D)
    if window:  # LoLCATs' hybrid with fmap beyond the window (swa if fmap is None)
        ohat = attention_weights(q, k, fmap, attn.causal, EPS, window, gate) @ _fp32(v)
    else:
        ohat = linear_attention_quadratic(*fmap(q, k), v, causal=attn.causal)
    per_head = ((ohat - o).pow(2).sum((2, 3)) / o.pow(2).sum((2, 3))).mean(0)  # (H,)
    y, yhat = (attn.o(x.transpose(1, 2).flatten(2)) for x in (o, ohat))  # (B, T, C): heads merged, projected
    return per_head.tolist(), ((yhat - y).pow(2).sum((1, 2)) / y.pow(2).sum((1, 2))).mean().item()
