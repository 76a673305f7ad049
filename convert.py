"""
Turn a trained softmax GPT into a linear-attention one: swap, distil, finetune (Hedgehog Sec. 5.3-5.4,
App. B.5; OAL Sec. 4.3, 5.2, App. F).

    1. swap      in the chosen layers keep q, k, v, o and put a feature map behind them
    2. distil    stage 1: everything frozen but the feature maps, trained jointly with one optimiser
                 to match each layer's softmax attention on the teacher's own hidden states:
                 Hedgehog's cross-entropy on the weights (hedgehog, t2r-hh), or OAL's MSE on the
                 outputs after contribution-based grouping (quadratic, oal), or, for LoLCATs' hybrid
                 (lolcats: softmax over the last `window` tokens, Hedgehog maps beyond, learned gates),
                 its attention transfer, the MSE on the outputs; early stopping on validation
    3. finetune  stage 2: LoRA (rank 8, alpha 16) on q, k, v, o of every layer, or full finetuning,
                 (the "softmax" method finetunes the unconverted teacher the same way: the fair baseline)
                 feature maps and lolcats' gates trainable too (--finetune_maps=false freezes them, as
                 LoLCATs' LoRA stage does), on the language-modelling loss

    python convert.py                                     # every method on the same budget
    python convert.py --methods=softmax,hedgehog,swa,lolcats-untrained,lolcats --seeds=0,1,2   # LoLCATs' Table 6
    python convert.py --methods=hedgehog,lolcats --finetune_maps=false   # LoLCATs' stage 2: the adapters alone
    python convert.py --methods=lolcats --finetune_maps=false --map_init=random --map_dim=16   # LoLCATs' maps: D / 2, random
    python convert.py --methods=hedgehog,oal --layers=middle --finetune=full
    python convert.py --init=gpt2 --data=wikitext103 --methods=softmax,hedgehog   # pretrained GPT-2 (online)

Reads the softmax checkpoint of train_gpt.py (out/softmax/ckpt.pt: run python train_gpt.py first), its
data and tokenizer from its config, or
with --init=gpt2 (any GPT-2 name) pretrained GPT-2 through transformers, with --data tokenised by
GPT-2's own tokenizer (the last 10% is validation),
prints validation perplexity after each stage and attention fidelity (KL, entropy, monotonicity,
output RelMSE) per method, saves results/convert.json and, with matplotlib, results/convert_monotonicity.png
(Hedgehog Fig. 3) and results/convert_attention.png (Hedgehog Fig. 7).
"""
import copy
import json
import math
import os
import time

import torch
import torch.nn as nn

import distill
from attention import attention_weights, entropy
from configurator import at_least, choices, configure, integers, one_of, pick_device, positive, pyplot, writable
from gpt import GPT, evaluate, get_batch, load_checkpoint, load_text, prepare

# ---- config: plain values, override with --key=value ----
ckpt = "out/softmax/ckpt.pt"  # a train_gpt.py checkpoint of a softmax GPT
init = "ckpt"  # "ckpt", or a pretrained GPT-2 name for transformers: "gpt2", "gpt2-medium", ...
data = "pydoc"  # with --init=gpt2*: "pydoc", "wikitext103" (downloads) or a .txt file
methods = "softmax,t2r,t2r-hh,hedgehog,hedgehog-untrained,quadratic,oal"  # also swa, lolcats, lolcats-untrained
window = 16  # swa and lolcats: the softmax window w, in tokens (LoLCATs: 64 of 2K+; our context is 128)
layers = "all"  # "all", or "middle": softmax stays in the first and last layers (OAL Sec. 5.2)
distill_iters = 60
distill_lr = 1e-2  # Hedgehog App. B: AdamW, lr 1e-2, no weight decay
finetune = "lora"  # "lora" or "full"
finetune_iters = 60
finetune_lr = 1e-3
map_init = "identity"  # Hedgehog maps: "identity" (Hedgehog's init) or "random" (LoLCATs': W kaiming-uniform)
map_dim = 0  # Hedgehog maps project the head size D to this many dimensions, F = 2 map_dim; 0: D (LoLCATs: D / 2)
finetune_maps = True  # stage 2 trains the feature maps and lolcats' gates too (Hedgehog Sec. 5.3); False: frozen, as LoLCATs
lora_r = 8
lora_alpha = 16
batch_size = 16
eval_iters = 20
seed = 0
seeds = ""  # comma-separated: every method once per seed, then mean ± std per method (instead of seed)
device = "auto"
results = "results/convert.json"
plots = True
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

METHODS = {  # method: (attention behind q, k, v, stage-1 loss or None for no distillation)
    "t2r": ("t2r", None),  # swap and finetune (Kasai et al.)
    "t2r-hh": ("t2r", "xent"),  # T2R trained with Hedgehog's loss
    "hedgehog": ("hedgehog", "xent"),
    "hedgehog-untrained": ("hedgehog", None),  # the ablation: the Hedgehog map, no distillation
    "quadratic": ("quadratic", "mse"),  # OAL's learned global quadratic, output calibration
    "oal": ("oal", "mse"),
    "swa": ("swa", None),  # the window alone: what the linear part of lolcats adds
    "lolcats": ("lolcats", "mse"),  # window + Hedgehog maps, attention transfer by output MSE (LoLCATs Sec. 3)
    "lolcats-untrained": ("lolcats", None),  # the hybrid without the transfer (LoLCATs Table 6)
}


class LoRA(nn.Module):
    """y = W x + (alpha / r) B A x with W frozen (Hu et al. 2021). B starts at 0: an exact no-op at first."""

    def __init__(self, base, r=8, alpha=16):
        super().__init__()
        self.base, self.scale = base, alpha / r
        like = dict(dtype=base.weight.dtype, device=base.weight.device)  # the base layer's, on any device
        self.A = nn.Parameter(torch.randn(r, base.in_features, **like) / math.sqrt(base.in_features))  # (r, in)
        self.B = nn.Parameter(torch.zeros(base.out_features, r, **like))  # (out, r)

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.A.T) @ self.B.T


def add_lora(model, r, alpha):
    for block in model.blocks:
        for name in "qkvo":
            setattr(block.attn, name, LoRA(getattr(block.attn, name), r, alpha))


def swap(model, attention, layer_ids, window=16, map_init="identity", map_dim=0):
    """Put a fresh feature map, window or hybrid behind q, k, v, o of the given layers (their weights are kept).
    map_init="random" starts Hedgehog maps as LoLCATs' configs do: W kaiming-uniform (its bias stays 0 at first);
    map_dim > 0 makes Hedgehog maps project to map_dim dimensions (feature_dim) instead of the head size."""
    hedgehog = attention in ("hedgehog", "lolcats")  # lolcats' linear part is a Hedgehog map
    for i in layer_ids:
        attn = model.blocks[i].attn
        attn.use(attention, window, **({"feature_dim": map_dim} if hedgehog and map_dim else {}))
        if hedgehog and map_init == "random":
            for W in (attn.fmap.W, attn.fmap.Wk):
                if W is not None:
                    nn.init.kaiming_uniform_(W.data)  # (H, D, f): fan-in D f, as LoLCATs' (H, D, F) has D F


def trainable_attention(attn):
    """What stage 1 trains in a converted layer: its feature map, and lolcats' gates."""
    return ([] if attn.fmap is None else list(attn.fmap.parameters())) + ([] if attn.gate is None else [attn.gate])


def set_oal_groups(model, teacher, idx, layer_ids):
    """OAL Sec. 4.2: per (layer, head), contribution scores on the teacher's calibration q, k, then stable-gap groups."""
    groups_found = {}
    for i, (q, k, _) in distill.layer_qkv(teacher, idx, layer_ids).items():
        groups = model.blocks[i].attn.fmap.set_groups_from(q, k)
        groups_found[i] = [int(g.max()) + 1 for g in groups]
    return groups_found


def distill_model(model, teacher, loss, layer_ids, train_ids, val_ids, cfg, dev):
    """Stage 1: train every converted layer's feature map jointly on the teacher's q, k, v; keep the
    best on a validation batch."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for i in layer_ids for p in trainable_attention(model.blocks[i].attn)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg["distill_lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg["seed"])

    def teacher_qkv(ids, generator):  # {layer: (q, k, v)} of the teacher on one batch
        x, _ = get_batch(ids, model.block_size, cfg["batch_size"], generator, dev)
        return distill.layer_qkv(teacher, x, layer_ids)

    def total_loss(qkv):  # summed over the converted layers
        attns = {i: model.blocks[i].attn for i in qkv}
        return sum(distill.distill_loss(attns[i].fmap, q, k, v, loss, True, attns[i].window, attns[i].g())
                   for i, (q, k, v) in qkv.items())

    val = teacher_qkv(val_ids, torch.Generator().manual_seed(1))
    best, best_state = float("inf"), None
    for it in range(cfg["distill_iters"] + 1):
        if it % 20 == 0 or it == cfg["distill_iters"]:
            with torch.no_grad():
                v_loss = total_loss(val).item()
            stop_if_not_finite(v_loss, f"distillation step {it} (validation)", "--distill_lr", cfg)
            print(f"  distill step {it}: val {loss} loss {v_loss:.4f}")
            if v_loss < best:
                best, best_state = v_loss, [p.detach().clone() for p in params]
        if it == cfg["distill_iters"]:
            break
        value = total_loss(teacher_qkv(train_ids, gen))
        stop_if_not_finite(value, f"distillation step {it}", "--distill_lr", cfg)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
    with torch.no_grad():
        for p, b in zip(params, best_state):
            p.copy_(b)


class Diverged(Exception):
    """A stage's loss is not finite: main() records the stop, saves the results so far and exits with status 1."""


def stop_if_not_finite(loss, where, lr_key, cfg):
    value = loss.item() if torch.is_tensor(loss) else loss
    if not math.isfinite(value):
        raise Diverged(f"{where}: the loss is {value}; try a lower {lr_key} (now {cfg[lr_key[2:]]})")


def finetune_model(model, train_ids, cfg, dev):
    """Stage 2: LoRA on q, k, v, o (or everything) plus, with finetune_maps, the feature maps and gates, on
    next-token loss."""
    if cfg["finetune"] == "lora":
        model.requires_grad_(False)
        add_lora(model, cfg["lora_r"], cfg["lora_alpha"])
    else:
        model.requires_grad_(True)
    for block in model.blocks:
        for p in trainable_attention(block.attn):
            p.requires_grad_(cfg["finetune_maps"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["finetune_lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    model.train()
    for it in range(cfg["finetune_iters"]):
        _, loss = model(*get_batch(train_ids, model.block_size, cfg["batch_size"], gen, dev))
        stop_if_not_finite(loss, f"finetuning step {it}", "--finetune_lr", cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return sum(p.numel() for p in params)


def converted_mimicry(model, teacher, idx, layer_ids):
    """distill.mimicry averaged over the converted layers, on the teacher's q, k, v."""
    attns = {i: model.blocks[i].attn for i in layer_ids}
    rows = [distill.mimicry(q, k, v, attns[i].fmap, True, True, attns[i].window, attns[i].g())
            for i, (q, k, v) in distill.layer_qkv(teacher, idx, layer_ids).items()]
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}


def load_teacher(cfg, dev):
    """The softmax teacher and its train / validation ids: a train_gpt.py checkpoint, or pretrained GPT-2."""
    if cfg["init"] != "ckpt":
        import pretrained
        try:
            model, tok = pretrained.load_gpt2(cfg["init"])
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
        ids = torch.tensor(tok(load_text(cfg["data"]), verbose=False)["input_ids"])
        n = int(0.9 * len(ids))
        return model.to(dev), ids[:n], ids[n:]
    if not os.path.exists(cfg["ckpt"]):
        raise SystemExit(f"error: no checkpoint at {cfg['ckpt']}; train the softmax teacher first: python train_gpt.py")
    ck = load_checkpoint(cfg["ckpt"], dev, attention="softmax")
    model = GPT(**ck["model_args"]).to(dev)
    model.load_state_dict(ck["model"])
    tokenizer = ck["config"].get("tokenizer", "cl100k_base")
    train_ids, val_ids, vocab, _ = prepare(ck["config"]["data"], tokenizer)
    if not torch.equal(vocab, ck["vocab"]):
        raise SystemExit(f"error: {ck['config']['data']!r} tokenised with {tokenizer} no longer gives the "
                         "checkpoint's vocabulary")
    return model, train_ids, val_ids


def convert_one(name, teacher, teacher_ppl, train_ids, val_ids, calib, probe, layer_ids, ppl, cfg, dev):
    """Method `name` on a copy of the teacher: swap, distil, finetune. Returns (record, model)."""
    model = copy.deepcopy(teacher)
    if name == "softmax":  # the teacher gets the same finetuning budget, so that "gap closed" is fair
        finetune_model(model, train_ids, cfg, dev)
        return {"method": name, "val_ppl": ppl(model), "val_ppl_swap": teacher_ppl, "val_ppl_distill": teacher_ppl,
                "kl": 0.0, "monotonicity": 1.0, "rel_mse": 0.0, "entropy": softmax_entropy(teacher, probe, layer_ids)}, model
    attention, loss = METHODS[name]
    swap(model, attention, layer_ids, cfg["window"], cfg["map_init"], cfg["map_dim"])
    window = model.blocks[layer_ids[0]].attn.window
    print(f"{name}: {attention} in layers {layer_ids}" + (f", window {window}" if window else ""))
    if attention == "oal":
        print(f"  oal groups per head, by layer: {set_oal_groups(model, teacher, calib, layer_ids)}")
    ppl_swap = ppl(model)
    if loss is not None:
        distill_model(model, teacher, loss, layer_ids, train_ids, val_ids, cfg, dev)
    ppl_distill = ppl(model)
    fid = converted_mimicry(model, teacher, probe, layer_ids)
    trained = finetune_model(model, train_ids, cfg, dev)
    return {"method": name, "feature_map": attention, "window": window, "distill_loss": loss, "val_ppl_swap": ppl_swap,
            "val_ppl_distill": ppl_distill, "val_ppl": ppl(model), "trainable_params": trained, **fid}, model


def main(cfg):
    names = choices(cfg, "methods", ["softmax", *METHODS])
    one_of(cfg, "layers", ("all", "middle"))
    one_of(cfg, "finetune", ("lora", "full"))
    one_of(cfg, "map_init", ("identity", "random"))
    at_least(cfg, 0, "distill_iters", "finetune_iters", "map_dim")
    at_least(cfg, 1, "lora_r", "batch_size", "eval_iters", "window")
    positive(cfg, "distill_lr", "finetune_lr", "lora_alpha")
    writable(cfg, "results")
    seeds = integers(cfg, "seeds") if cfg["seeds"] else [cfg["seed"]]
    dev = pick_device(cfg["device"])
    print(f"device: {dev}, torch threads: {torch.get_num_threads()}")
    teacher, train_ids, val_ids = load_teacher(cfg, dev)
    L = len(teacher.blocks)
    layer_ids = list(range(L)) if cfg["layers"] == "all" else list(range(1, L - 1))
    if not layer_ids:
        raise SystemExit(f"error: --layers=middle needs at least 3 layers; the model has {L}")

    def ppl(m):
        loss = evaluate(m, val_ids, cfg["batch_size"], cfg["eval_iters"], dev)
        stop_if_not_finite(loss, "evaluation", "--finetune_lr", cfg)
        return math.exp(min(loss, 700.0))

    calib, _ = get_batch(train_ids, teacher.block_size, 32, torch.Generator().manual_seed(2), dev)
    probe, _ = get_batch(val_ids, teacher.block_size, 4, torch.Generator().manual_seed(3), dev)
    teacher_ppl = ppl(teacher)
    done = []  # every seed's records
    for seed in seeds:
        run = dict(cfg, seed=seed)
        records, converted = [], {}
        for name in names:
            t0 = time.time()
            torch.manual_seed(seed)  # each method's random inits (feature maps, LoRA) from the same seed
            try:
                record, model = convert_one(name, teacher, teacher_ppl, train_ids, val_ids, calib, probe, layer_ids,
                                            ppl, run, dev)
            except Diverged as e:
                save(done + records + [{"method": name, "seed": seed, "stopped": str(e), "config": run}], cfg)
                raise SystemExit(f"error: {name}: {e}; conversion stopped, the methods before it are in "
                                 f"{cfg['results']}") from None
            records.append(dict(record, seed=seed, seconds=time.time() - t0, config=run))
            print(f"{name}: val ppl swap {record['val_ppl_swap']:.2f} -> distil {record['val_ppl_distill']:.2f} -> finetune "
                  f"{record['val_ppl']:.2f}; KL {record['kl']:.3f}, entropy {record['entropy']:.2f}, monotonicity "
                  f"{record['monotonicity']:.2f}, RelMSE {record['rel_mse']:.3f}, {time.time() - t0:.0f}s", flush=True)
            if name != "softmax":
                converted[name] = model
        report(records, teacher_ppl, seed)
        done += records
        if cfg["plots"] and converted and seed == seeds[0]:
            plot(teacher, converted, probe, layer_ids[len(layer_ids) // 2], os.path.dirname(cfg["results"]) or ".")
    if len(seeds) > 1:
        print(f"\nvalidation perplexity over seeds {seeds}: mean ± std")
        for name in names:
            ppls = torch.tensor([r["val_ppl"] for r in done if r["method"] == name])
            print(f"{name:<20} {ppls.mean():.2f} ± {ppls.std():.2f}   ({', '.join(f'{p:.2f}' for p in ppls.tolist())})")
    save(done, cfg)
    return done


@torch.no_grad()
def softmax_entropy(model, idx, layer_ids):
    """Mean row entropy of the softmax weights over the given layers."""
    rows = [entropy(attention_weights(q, k)).mean().item() for q, k, _ in distill.layer_qkv(model, idx, layer_ids).values()]
    return sum(rows) / len(rows)


def report(records, teacher_ppl, seed):
    """One seed's table; gap closed is added to each record."""
    by = {r["method"]: r for r in records}
    base = by.get("t2r", {}).get("val_ppl")
    teacher_ppl = by.get("softmax", {}).get("val_ppl", teacher_ppl)  # the finetuned teacher when it ran
    print(f"\nseed {seed}\n{'method':<20} {'ppl swap':>9} {'ppl distil':>11} {'ppl final':>10} {'gap closed':>11} "
          f"{'KL':>7} {'entropy':>8} {'monot.':>7} {'RelMSE':>7} {'seconds':>8}")
    for r in records:
        if base is not None and base != teacher_ppl:
            r["gap_closed_vs_t2r"] = (base - r["val_ppl"]) / (base - teacher_ppl)
        gap = f"{100 * r['gap_closed_vs_t2r']:.0f}%" if "gap_closed_vs_t2r" in r else "-"
        print(f"{r['method']:<20} {r['val_ppl_swap']:>9.2f} {r['val_ppl_distill']:>11.2f} {r['val_ppl']:>10.2f} {gap:>11} "
              f"{r['kl']:>7.3f} {r['entropy']:>8.2f} {r['monotonicity']:>7.2f} {r['rel_mse']:>7.3f} {r['seconds']:>8.0f}")
    print("gap closed = (ppl_t2r - ppl) / (ppl_t2r - ppl_softmax): 0% is T2R, 100% is the softmax teacher "
          "(finetuned like the others when 'softmax' is among the methods)")


def save(records, cfg):
    for r in records:
        r.update(torch=torch.__version__)
        r.setdefault("config", cfg)
    os.makedirs(os.path.dirname(cfg["results"]) or ".", exist_ok=True)
    with open(cfg["results"], "w") as f:
        json.dump(records, f, indent=1)
    print(f"saved {cfg['results']}")


@torch.no_grad()
def plot(teacher, converted, idx, layer, out_dir):
    plt = pyplot()
    if plt is None:
        return
    q, k, _ = distill.layer_qkv(teacher, idx[:1], [layer])[layer]  # (1, H, T, D), the teacher's
    weights = {"softmax": attention_weights(q, k)}
    attns = {n: m.blocks[layer].attn for n, m in converted.items()}
    weights.update({n: attention_weights(q, k, a.fmap, window=a.window, gate=a.g()) for n, a in attns.items()})
    dots = (q @ k.transpose(-1, -2))[0, 0, -1]  # last query of head 0: q.k for every key
    n = len(weights)
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n, 2.6), squeeze=False)
    for ax, (name, w) in zip(axes[0], weights.items()):
        ax.scatter(dots.cpu(), w[0, 0, -1].cpu(), s=4)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("q.k", fontsize=7)
    axes[0, 0].set_ylabel("weight")
    fig.suptitle(f"weight vs q.k, layer {layer} head 0, last query (cf. Hedgehog Fig. 3)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "convert_monotonicity.png"), dpi=120)
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n, 2.6), squeeze=False)
    for ax, (name, w) in zip(axes[0], weights.items()):
        ax.imshow(w[0, 0, :64, :64].cpu() ** 0.5, cmap="viridis")
        ax.set_title(name, fontsize=8)
        ax.axis("off")
    fig.suptitle(f"attention weights, layer {layer} head 0, first 64 tokens (cf. Hedgehog Fig. 7)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "convert_attention.png"), dpi=120)
    print(f"figures: {out_dir}/convert_monotonicity.png, {out_dir}/convert_attention.png")


if __name__ == "__main__":
    main(configure(config))
