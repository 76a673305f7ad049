"""
How well does each feature map mimic a real pretrained model's softmax attention? (Hedgehog Sec. 5.1,
Tables 4-5, Fig. 7; OAL Sec. 3, 5.1, Fig. 1.)

    python fidelity.py                  # all-MiniLM-L6-v2 (offline), every feature map, every layer
    python fidelity.py --model=gpt2     # pretrained GPT-2 through transformers (online)
    python fidelity.py --model=gpt2 --text=wikitext103_valid.txt   # any text file

Text: windows of the Python reference manual (`pydoc_data.topics`) or of --text: calibration windows
from its first 80%, held-out windows and sentences from the rest. Four parts:
 1. Fidelity. At each layer every feature map goes behind the frozen q, k, v: fixed maps as they are,
    learned ones distilled on the calibration windows (Hedgehog's cross-entropy on the weights; OAL's
    output MSE for quadratic and oal, oal after its contribution-based grouping). Scored on held-out
    windows: KL to the softmax weights, output RelMSE per head and after the output projection,
    entropy, monotonicity (distill.mimicry). Also LoLCATs' hybrid (lolcats: softmax within the window,
    Hedgehog maps beyond it, attention transfer by output MSE) and the window alone (swa). MiniLM is
    bidirectional, so its window is the band |i - j| < window around each query (2 window - 1 keys).
 2. Contribution scores (OAL Fig. 1): per dimension mean |q|, mean |k| and share of sum_l |q_l k_l|;
    how much the top 10% of dimensions carry; the groups OAL finds.
 3. Length generalisation (Hedgehog Table 5): the same maps, distilled at seq_len, scored on held-out
    windows 2x, 4x, 8x longer.
 4. Conversion: every layer (and the middle ones only) switched to each map of `convert_maps` at once.
    MiniLM: cosine between the converted and the original sentence embeddings of held-out sentences.
    GPT-2: perplexity on the held-out windows (Hedgehog reports 16.7 on WikiText-103 for GPT-2 after
    distillation and finetuning; here there is no finetuning).
Saves results/fidelity_<model>.json and, with matplotlib, results/fidelity_<model>_attention.png (one
panel per map, Hedgehog Fig. 7) and results/fidelity_<model>_contributions.png (OAL Fig. 1).
"""
import copy
import json
import math
import os
import re
import time

import torch
import torch.nn.functional as F

import distill
import pretrained
from attention import ATTENTIONS, attention_weights
from configurator import at_least, choices, configure, integers, layer_list, positive, pyplot, writable
from oal_groups import contribution_scores, top_share
from gpt import load_text

# ---- config: plain values, override with --key=value ----
model = "minilm"  # "minilm" (offline) or a GPT-2 name for transformers ("gpt2", "gpt2-medium", ...)
text = "pydoc"  # "pydoc" (the Python reference manual) or a .txt file: calibration from its first 80%, held out the rest
maps = "elu,relu,exp,performer,cosformer,taylor,dijiang,taylorshift,t2r,hedgehog,quadratic,oal,swa,lolcats"
window = 8  # swa and lolcats: keys within this distance of the query (both sides in an encoder)
layers = "all"  # "all" or a comma-separated list of layer indices
seq_len = 64  # calibration and scoring windows, in tokens
lengths = "128,256,512"  # longer held-out windows for part 3 (MiniLM has 512 positions)
calib = 16  # calibration windows
val = 8  # held-out windows from the calibration text: the best checkpoint of each learned map is kept
test = 8  # held-out windows per length
steps = 100  # distillation steps per layer and map (full batch of calibration windows)
lr = 1e-2  # Hedgehog App. B: AdamW, lr 1e-2, no weight decay
convert_maps = "elu,t2r,hedgehog,taylor,quadratic,oal,swa,lolcats"
sentences = 100  # held-out sentences for the MiniLM embedding check
seed = 0
results = ""  # default results/fidelity_<model>.json
plots = True
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

LOSS = {"quadratic": "mse", "oal": "mse", "lolcats": "mse"}  # output MSE (OAL, LoLCATs); every other learned map: Hedgehog's


def held_out_sentences(text, encode, special, n, max_tokens):
    """The first n sentences of text with 8 to max_tokens - 2 tokens, each as a (1, T) id tensor."""
    out = []
    for s in re.split(r"(?<=[.!?])\s+", text):
        s = " ".join(s.split())
        ids = encode(s)
        if 8 <= len(ids) <= max_tokens - 2 and s[0].isupper():
            out.append(torch.tensor([[special[0], *ids, special[1]]]))
        if len(out) == n:
            break
    return out


def build_student(name, attn, calib, val, cfg):
    """A copy of one layer's attention (same projections) with attention `name` behind its q, k, v; its
    feature map (and lolcats' gates) distilled on the calibration (q, k, v) when it has parameters, keeping
    the best checkpoint on the held-out val (q, k, v). OAL is grouped first from the calibration q, k
    (OAL App. B). Returns (student, None or OAL's group of every dimension, (H, D) as lists)."""
    student = copy.deepcopy(attn)
    student.use(name, cfg["window"])
    if name == "oal":
        student.fmap.set_groups_from(calib[0], calib[1], attn.causal)
    if student.fmap is not None and any(p.requires_grad for p in student.fmap.parameters()):
        distill.distill_feature_map(student.fmap, *calib, loss=LOSS.get(name, "xent"), steps=cfg["steps"], lr=cfg["lr"],
                                    causal=attn.causal, val=val, window=student.window, gate_logit=student.gate)
    return student, student.fmap.groups.tolist() if name == "oal" else None


def student_mimicry(s, q, k, v, monotonicity=True):
    """distill.mimicry of student attention s on the teacher's q, k, v."""
    return distill.mimicry(q, k, v, s.fmap, s.causal, monotonicity, s.window, s.g())


def contributions(q, k, causal, top_frac=0.1):
    """Per head: the share of the contribution that the top 10% of dimensions carry (uniform: 10%),
    and per dimension the mean |q|, the mean |k| and the share. q, k: (B, H, T, D) -> lists over heads."""
    c = contribution_scores(q, k, causal).mean(0)  # (H, D)
    share = c / c.sum(-1, keepdim=True)
    return {"top_share": top_share(c, top_frac).tolist(),
            "q_abs": q.abs().mean((0, 2)).tolist(), "k_abs": k.abs().mean((0, 2)).tolist(), "share": share.tolist()}


@torch.no_grad()
def conversion(model, students, names, layer_ids, sentences, test_ids):
    """Swap the chosen layers to each map (distilled in part 1) and measure what survives."""
    def score(m):
        if sentences:  # MiniLM: sentence embeddings
            return torch.cat([m.sentence_embedding(s) for s in sentences])
        logits, _ = m(test_ids[:, :-1])  # GPT-2: next-token loss on the held-out windows
        return F.cross_entropy(logits.flatten(0, 1), test_ids[:, 1:].flatten()).item()
    ref = score(model)
    out = {"original": {"ppl": math.exp(ref)} if not sentences else {"cosine": 1.0}}
    for name in names:
        student = copy.deepcopy(model)
        for i in layer_ids:
            student.blocks[i].attn = students[name][i]
        got = score(student)
        if sentences:
            cos = (got * ref).sum(-1)
            out[name] = {"cosine": cos.mean().item(), "cosine_min": cos.min().item()}
        else:
            out[name] = {"ppl": math.exp(got)}
    return out


def main(cfg):
    t0 = time.time()
    cfg = dict(cfg, results=cfg["results"] or f"results/fidelity_{cfg['model']}.json")
    torch.manual_seed(cfg["seed"])
    at_least(cfg, 1, "seq_len", "calib", "val", "test", "window")
    at_least(cfg, 0, "steps", "sentences")
    positive(cfg, "lr")
    writable(cfg, "results")
    lengths = integers(cfg, "lengths", 1)
    names = choices(cfg, "maps", ATTENTIONS[1:])  # every feature map, swa and lolcats
    convert_names = choices(cfg, "convert_maps", names) if cfg["convert_maps"] else []  # converts what it distilled
    text = load_text(cfg["text"], "text")
    model, encode, special = pretrained.load(cfg["model"])
    model.requires_grad_(False)
    L, causal = len(model.blocks), model.blocks[0].attn.causal
    layer_ids = layer_list(cfg, L)
    pretrained.check_length(model, cfg["seq_len"])
    too_long = [T for T in lengths if T > model.block_size]  # the default lengths are MiniLM's
    if too_long:
        print(f"lengths past the model's {model.block_size} positions skipped: {too_long}")
        lengths = [T for T in lengths if T <= model.block_size]

    cut = int(0.8 * len(text))
    gen = torch.Generator().manual_seed(cfg["seed"])
    train_ids, test_tok = torch.tensor(encode(text[:cut])), torch.tensor(encode(text[cut:]))
    calib_x = pretrained.windows(train_ids, cfg["calib"], cfg["seq_len"], special, gen)
    test_x = {T: pretrained.windows(test_tok, cfg["test"], T, special, gen) for T in [cfg["seq_len"]] + lengths}
    # held out from calibration: it picks the best checkpoint
    val_x = pretrained.windows(train_ids, cfg["val"], cfg["seq_len"], special, gen)
    sents = held_out_sentences(text[cut:], encode, special, cfg["sentences"], cfg["seq_len"]) if special else []
    print(f"{cfg['model']}: {L} layers, {model.blocks[0].attn.n_head} heads of {model.blocks[0].attn.head_dim}, "
          f"{'bidirectional' if not causal else 'causal'}; calibration {tuple(calib_x.shape)}, held-out windows at "
          f"{list(test_x)} tokens, {len(sents)} held-out sentences")
    calib_qkv = distill.layer_qkv(model, calib_x, layer_ids)
    val_qkv = distill.layer_qkv(model, val_x, layer_ids)
    test_qkv = {T: distill.layer_qkv(model, x, layer_ids) for T, x in test_x.items()}

    # parts 1 and 3: every map at every layer, distilled once at seq_len, scored at every length
    rows, students, groups, contrib = [], {n: {} for n in names}, {}, {}
    for i in layer_ids:
        attn = model.blocks[i].attn
        contrib[i] = contributions(*calib_qkv[i][:2], causal)
        for name in names:
            t = time.time()
            s, g = build_student(name, attn, calib_qkv[i], val_qkv[i], cfg)
            students[name][i] = s
            if g is not None:
                groups[i] = g
            q, k, v = test_qkv[cfg["seq_len"]][i]
            row = {"layer": i, "map": name, **student_mimicry(s, q, k, v),
                   "rel_mse_out": distill.output_rel_mse(attn, s.fmap, q, k, v, s.window, s.g())[1]}
            row["by_length"] = {T: student_mimicry(s, *test_qkv[T][i], monotonicity=False) for T in lengths}
            rows.append(row)
            print(f"layer {i} {name:<12} kl {row['kl']:.3f}  rel_mse {row['rel_mse']:.3f}  "
                  f"after o {row['rel_mse_out']:.3f}  ({time.time() - t:.1f} s)", flush=True)

    # part 4: conversion with the distilled maps
    middle = layer_ids[1:-1] if len(layer_ids) > 2 else layer_ids
    convert = {}
    if convert_names and layer_ids == list(range(L)):
        convert = {"all": conversion(model, students, convert_names, layer_ids, sents, test_x[cfg["seq_len"]]),
                   "middle": conversion(model, students, convert_names, middle, sents, test_x[cfg["seq_len"]])}

    summary = report(rows, names, lengths, contrib, groups, convert, cfg)
    out = cfg["results"]
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": cfg["model"], "config": cfg, "summary": summary, "rows": rows, "groups": groups,
                   "contributions": contrib, "conversion": convert, "seconds": time.time() - t0}, f, indent=1)
    print(f"saved {out} ({time.time() - t0:.0f} s in all)")
    if cfg["plots"]:
        plot(model, students, names, layer_ids, test_qkv[cfg["seq_len"]], contrib, groups, out.removesuffix(".json"))
    return summary


def report(rows, names, lengths, contrib, groups, convert, cfg):
    """Print the tables; return the per-map means over layers."""
    def mean(name, value):  # mean over layers of value(row) for one map
        vals = [value(r) for r in rows if r["map"] == name]
        return sum(vals) / len(vals)

    summary = {}
    print(f"\nmean over layers, held-out windows of {cfg['seq_len']} tokens (softmax entropy "
          f"{mean(names[0], lambda r: r['entropy_softmax']):.2f} nats); KL at longer lengths on the right")
    print(f"{'map':<12} {'KL':>7} {'RelMSE':>7} {'after o':>7} {'entropy':>7} {'monot.':>7}"
          + "".join(f" {'KL@' + str(T):>7}" for T in lengths))
    for name in names:
        s = {key: mean(name, lambda r: r[key]) for key in ("kl", "rel_mse", "rel_mse_out", "entropy", "monotonicity")}
        s["kl_by_length"] = {T: mean(name, lambda r: r["by_length"][T]["kl"]) for T in lengths}
        s["rel_mse_by_length"] = {T: mean(name, lambda r: r["by_length"][T]["rel_mse"]) for T in lengths}
        summary[name] = s
        print(f"{name:<12} {s['kl']:>7.3f} {s['rel_mse']:>7.3f} {s['rel_mse_out']:>7.3f} {s['entropy']:>7.2f} "
              f"{s['monotonicity']:>7.3f}" + "".join(f" {s['kl_by_length'][T]:>7.3f}" for T in lengths))
    print("\ncontribution share of the top 10% of dimensions per head (uniform would be 0.10); OAL groups per head")
    for i, c in contrib.items():
        top = c["top_share"]
        print(f"layer {i}: mean {sum(top) / len(top):.2f}, max {max(top):.2f}" +
              (f"; groups {[max(g) + 1 for g in groups[i]]}" if i in groups else ""))
    if convert:
        sents = "cosine" in convert["all"]["original"]
        print("\nconversion: " + ("cosine of the sentence embeddings with the original's, mean / min over held-out sentences"
                                 if sents else "perplexity on the held-out windows"))
        print(f"{'map':<12} {'all layers':>14} {'middle layers':>14}")
        for name in convert["all"]:
            cells = [cell(convert[part][name], sents) for part in ("all", "middle")]
            print(f"{name:<12} {cells[0]:>14} {cells[1]:>14}")
    return summary


def cell(r, sentences):
    """One conversion result as text: cosine (mean / min) for sentence embeddings, else perplexity."""
    if "cosine_min" in r:
        return f"{r['cosine']:.3f} / {r['cosine_min']:.3f}"
    return f"{r['cosine']:.3f}" if sentences else f"{r['ppl']:.2f}"


def plot(model, students, names, layer_ids, qkv, contrib, groups, prefix):
    plt = pyplot()
    if plt is None:
        return
    i = layer_ids[len(layer_ids) // 2]  # a middle layer, head 0, the first held-out window (Hedgehog Fig. 7)
    q, k, _ = (x[:1] for x in qkv[i])  # (1, H, T, D): the maps have parameters per head
    causal = model.blocks[i].attn.causal
    with torch.no_grad():
        panels = [("softmax", attention_weights(q, k, causal=causal))]
        panels += [(n, attention_weights(q, k, s.fmap, causal, window=s.window, gate=s.g()))
                   for n, s in ((n, students[n][i]) for n in names)]
    cols = min(7, len(panels))
    vmax = panels[0][1][0, 0].quantile(0.99).item()  # one colour scale for all, set by softmax
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.7 * rows))
    for ax in axes.flat:
        ax.axis("off")
    for ax, (n, w) in zip(axes.flat, panels):
        ax.imshow(w[0, 0].numpy(), cmap="viridis", vmin=0, vmax=vmax)
        ax.set_title(n, fontsize=9)
    fig.suptitle(f"layer {i}, head 0: attention weights on a held-out window "
                 "(colour scale clipped at softmax's 99th percentile)")
    fig.tight_layout()
    fig.savefig(prefix + "_attention.png", dpi=110)

    # OAL Fig. 1: the head whose top dimensions carry the most
    heads = [(contrib[i]["top_share"][h], i, h) for i in contrib for h in range(len(contrib[i]["top_share"]))]
    _, i, h = max(heads)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3))
    group = groups[i][h] if i in groups else [0] * len(contrib[i]["share"][h])
    colours = [f"C{g}" for g in group]  # bars coloured by OAL's group
    for ax, key, title in zip(axes, ("q_abs", "k_abs", "share"), ("mean |q_l|", "mean |k_l|", "share of sum_l |q_l k_l|")):
        ax.bar(range(len(group)), contrib[i][key][h], color=colours)
        ax.set(title=title, xlabel="dimension l")
    fig.suptitle(f"layer {i}, head {h}: top 10% of dimensions carry {contrib[i]['top_share'][h]:.0%} of the contribution"
                 + (f"; OAL's groups: {max(group) + 1} (colours)" if i in groups else ""))
    fig.tight_layout()
    fig.savefig(prefix + "_contributions.png", dpi=110)
    print(f"figures: {prefix}_attention.png, {prefix}_contributions.png")


if __name__ == "__main__":
    main(configure(config))
