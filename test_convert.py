"""
convert.py's parts: LoRA's formula, and LoRA as an exact no-op that trains only the adapters (and the maps,
unless frozen), the swap (projections kept, maps started as asked), the hooks that catch each layer's q, k, v,
LoLCATs' attention transfer, and a checkpoint of the wrong kind refused. The whole script runs in test_scripts.py.
Run: python -m pytest -q test_convert.py
"""
from test_all import run_script, tiny_gpt  # first: sets TRITON_INTERPRET before convert imports triton

import pytest
import torch

import convert
import distill


@pytest.mark.parametrize("finetune_maps", [True, False])
def test_lora_starts_as_exact_noop_and_trains_only_adapters(torch_path, finetune_maps):
    """After add_lora the model computes exactly what it did; a training step then moves the adapters
    (and the feature maps and gates, unless finetune_maps is False, LoLCATs' recipe) and nothing else."""
    model = tiny_gpt("lolcats", window=4).double()  # a window shorter than the sequence: the maps matter
    idx = torch.randint(0, 50, (2, 20))
    before = model(idx)[0]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    convert.finetune_model(model, idx.flatten().repeat(4), dict(finetune="lora", lora_r=4, lora_alpha=8, finetune_lr=1e-2,
                                                                finetune_iters=0, seed=0, batch_size=2,
                                                                finetune_maps=finetune_maps), "cpu")
    assert torch.equal(model(idx)[0], before)  # B = 0 at the start
    lora = [n for n, _ in model.named_parameters() if n.endswith((".A", ".B"))]
    assert len(lora) == 2 * 4 * 2  # A and B on q, k, v, o of 2 layers
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(idx, idx)[1].backward()
    opt.step()
    for n, p in model.named_parameters():
        base = n.replace(".base", "")
        if n.endswith(".B") or (finetune_maps and (".fmap." in n or n.endswith(".gate"))):
            assert not torch.equal(p, frozen.get(base, torch.zeros_like(p))), n  # trained
        elif base in frozen:
            assert torch.equal(p, frozen[base]), n  # frozen: embeddings, projections, MLP, norms


def test_lora_adds_its_scaled_low_rank_product():
    """LoRA(W) x = W x + b + (alpha / r) B A x, with alpha / r = 3 here, once B has left zero."""
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5).double()
    lora = convert.LoRA(base, r=2, alpha=6)
    with torch.no_grad():
        lora.B.normal_()
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = x @ base.weight.T + base.bias + 3.0 * (x @ lora.A.T) @ lora.B.T
    assert torch.allclose(lora(x), expected, atol=1e-12) and not torch.allclose(lora(x), base(x), atol=1e-3)


def test_swap_starts_hedgehog_maps_as_asked(torch_path):
    """map_init: Hedgehog's identity (on the first f dimensions), or LoLCATs' kaiming-uniform W
    (|W| <= sqrt(6 / (D f)) at D x f), q's and k's drawn apart, the bias 0; map_dim: f, else the head size D = 8."""
    for attention in ("hedgehog", "lolcats"):
        for init in ("identity", "random"):
            for map_dim, f in ((0, 8), (3, 3)):
                model = tiny_gpt()
                convert.swap(model, attention, [0, 1], window=4, map_init=init, map_dim=map_dim)
                fmap = model.blocks[1].attn.fmap
                Ws = [W for W in (fmap.W, fmap.Wk) if W is not None]
                assert len(Ws) == (2 if attention == "lolcats" else 1) and not fmap.b.any()
                assert Ws[0].shape == (2, 8, f) and fmap.b.shape == (2, 1, f)
                eye = torch.eye(8, f).expand_as(Ws[0])
                bound = (6 / (8 * f)) ** 0.5
                for W in Ws:
                    drawn = bool(W.abs().max() <= bound and W.std() > bound / 3)
                    assert torch.equal(W, eye) if init == "identity" else drawn
                if init == "random" and attention == "lolcats":
                    assert not torch.equal(fmap.W, fmap.Wk)


def test_swap_keeps_projections_and_layer_qkv_matches_model():
    """layer_qkv catches each attention's input with hooks; check it against the blocks run by hand."""
    model = tiny_gpt().double()
    idx = torch.randint(0, 50, (2, 20))
    qkv = distill.layer_qkv(model, idx, [0, 1])
    x = model.tok(idx) + model.pos(torch.arange(20))
    x = model.blocks[0](x)
    q, k, v = model.blocks[1].attn.heads(model.blocks[1].ln1(x))
    assert torch.allclose(qkv[1][0], q) and torch.allclose(qkv[1][2], v)
    w = model.blocks[1].attn.q.weight.clone()
    convert.swap(model, "hedgehog", [1])
    assert model.blocks[1].attn.fmap is not None and model.blocks[0].attn.fmap is None
    assert torch.equal(model.blocks[1].attn.q.weight, w)


def test_fidelity_of_a_converted_model_is_the_mean_over_its_layers():
    """converted_mimicry over layers 0 and 1 is the mean of its values for each layer alone."""
    teacher, model = tiny_gpt().double(), tiny_gpt().double()
    torch.manual_seed(1)
    convert.swap(model, "hedgehog", [0, 1])
    for p in model.parameters():  # maps that differ from their identity start, so the layers differ
        p.data.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    both, one, two = (convert.converted_mimicry(model, teacher, idx, ids) for ids in ([0, 1], [0], [1]))
    assert one["kl"] != pytest.approx(two["kl"])
    for key in both:
        assert both[key] == pytest.approx((one[key] + two[key]) / 2, rel=1e-9), key


def test_lolcats_attention_transfer_trains_the_maps_and_gates():
    """Stage 1 for lolcats: the output MSE of the hybrid against softmax falls, and the Hedgehog maps (one
    per side) and the gates move; the projections do not."""
    teacher, model = tiny_gpt(), tiny_gpt()
    convert.swap(model, "lolcats", [0, 1], window=4)
    attn = model.blocks[1].attn
    assert attn.window == 4 and attn.fmap.mode == "softmax_halves" and attn.fmap.Wk is not None
    assert attn.g().tolist() == pytest.approx([0.1, 0.1])
    ids = torch.randint(0, 50, (400,))
    idx = ids[:96].view(4, 24)
    before = sum(distill.distill_loss(model.blocks[i].attn.fmap, *qkv, "mse", True, 4, model.blocks[i].attn.g())
                 for i, qkv in distill.layer_qkv(teacher, idx, [0, 1]).items()).item()
    q_weight, gate = attn.q.weight.clone(), attn.gate.detach().clone()
    cfg = dict(distill_lr=1e-2, distill_iters=20, seed=0, batch_size=4)
    convert.distill_model(model, teacher, "mse", [0, 1], ids, ids, cfg, "cpu")
    after = sum(distill.distill_loss(model.blocks[i].attn.fmap, *qkv, "mse", True, 4, model.blocks[i].attn.g())
                for i, qkv in distill.layer_qkv(teacher, idx, [0, 1]).items()).item()
    assert after < before and not torch.equal(attn.gate, gate) and torch.equal(attn.q.weight, q_weight)


def test_distill_model_trains_on_training_batches_and_checks_on_validation(monkeypatch):
    """Stage 1 draws one fixed validation batch from the validation ids and each step's batch from the training ids."""
    real, drawn = convert.get_batch, []
    monkeypatch.setattr(convert, "get_batch", lambda ids, *a: drawn.append(ids) or real(ids, *a))
    train, val = torch.randint(0, 50, (400,)), torch.randint(0, 50, (400,))
    model = tiny_gpt()
    convert.swap(model, "hedgehog", [0, 1])
    cfg = dict(distill_lr=1e-2, distill_iters=3, seed=0, batch_size=4)
    convert.distill_model(model, tiny_gpt(), "xent", [0, 1], train, val, cfg, "cpu")
    assert ["val" if ids is val else "train" if ids is train else "?" for ids in drawn] == ["val", "train", "train", "train"]


def test_distill_model_keeps_the_maps_best_on_validation(monkeypatch):
    """Stage 1 keeps the maps of its best validation check (every 20 steps, and at the last): with the validation
    losses scripted to 3, 1, 2, a 40-step run ends with the maps of the same run stopped at step 20."""
    teacher, real = tiny_gpt(), distill.distill_loss
    ids = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0))

    def maps_after(iters, val_losses):
        checks = iter([x / 2 for x in val_losses for _ in range(2)])  # one call per converted layer
        monkeypatch.setattr(distill, "distill_loss", lambda *a, **kw: real(*a, **kw) if torch.is_grad_enabled()
                            else torch.tensor(next(checks)))
        model = tiny_gpt()
        convert.swap(model, "hedgehog", [0, 1])
        cfg = dict(distill_lr=1e-2, distill_iters=iters, seed=0, batch_size=4)
        convert.distill_model(model, teacher, "xent", [0, 1], ids, ids, cfg, "cpu")
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(maps_after(40, [3, 1, 2]), maps_after(20, [3, 1]))
    assert not torch.equal(maps_after(40, [3, 2, 1]), maps_after(20, [3, 2]))
    assert not torch.equal(maps_after(30, [3, 2, 1]), maps_after(20, [3, 2]))  # the last step is checked too


def test_both_stages_use_adamw_without_weight_decay_and_finetuning_clips(monkeypatch):
    """Stage 1 and stage 2 each make one AdamW at their own learning rate and no weight decay (Hedgehog App. B:
    AdamW's own default is 0.01); stage 2 clips the gradient norm at 1 at every step."""
    made, clipped, adamw, clip = [], [], torch.optim.AdamW, torch.nn.utils.clip_grad_norm_

    def spy_adamw(params, **kw):  # the real optimiser, noting its settings
        made.append((kw["lr"], kw.get("weight_decay", "AdamW's default")))
        return adamw(params, **kw)

    def spy_clip(params, max_norm):
        clipped.append(max_norm)
        return clip(params, max_norm)
    monkeypatch.setattr(torch.optim, "AdamW", spy_adamw)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
    model, ids = tiny_gpt(), torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(0))
    convert.swap(model, "hedgehog", [0, 1])
    convert.distill_model(model, tiny_gpt(), "xent", [0, 1], ids, ids,
                          dict(distill_lr=1e-2, distill_iters=2, seed=0, batch_size=4), "cpu")
    convert.finetune_model(model, ids, dict(finetune="lora", lora_r=4, lora_alpha=8, finetune_lr=1e-3, finetune_iters=3,
                                            seed=0, batch_size=2, finetune_maps=True), "cpu")
    assert made == [(1e-2, 0.0), (1e-3, 0.0)] and clipped == [1.0] * 3


def test_each_method_distils_with_its_papers_loss():
    """Stage 1 as each paper has it: Hedgehog's cross-entropy to softmax's weights (Sec. 4.2; T2R-HH borrows
    it), OAL's output calibration (Sec. 4.3), LoLCATs' attention transfer by output MSE (Sec. 3), and none
    for T2R, the window alone and the untrained ablations."""
    assert convert.METHODS == {
        "t2r": ("t2r", None), "t2r-hh": ("t2r", "xent"), "hedgehog": ("hedgehog", "xent"),
        "hedgehog-untrained": ("hedgehog", None), "quadratic": ("quadratic", "mse"), "oal": ("oal", "mse"),
        "swa": ("swa", None), "lolcats": ("lolcats", "mse"), "lolcats-untrained": ("lolcats", None)}


def test_convert_rejects_a_checkpoint_of_another_kind(tmp_path):
    torch.save({"kind": "something else"}, tmp_path / "bad.pt")
    assert "not a train_gpt.py checkpoint" in run_script("convert.py", f"--ckpt={tmp_path / 'bad.pt'}", ok=False)
    torch.save({"kind": "train_gpt", "model_args": {"attention": "hedgehog"}}, tmp_path / "linear.pt")
    err = run_script("convert.py", f"--ckpt={tmp_path / 'linear.pt'}", ok=False)
    assert "not a train_gpt.py checkpoint of a softmax model" in err
