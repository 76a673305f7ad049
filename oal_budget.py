"""
OAL's group budget study (OAL Sec. 4.2) on a real pretrained model: how much of the benefit of
dimension-aware kernel coefficients do a few contribution-based groups capture?

    python oal_budget.py                    # all-MiniLM-L6-v2, all 6 layers x 12 heads, G = 1..5 and G = D
                                            # (about 5 min on 2 cores)
    python oal_budget.py --layers=3 --steps=600 --budgets=1,2

For every layer, the frozen q, k, v of calibration windows (the same windows as fidelity.py), and for
every group budget G the OAL kernel is calibrated by output MSE (OAL Sec. 4.3) with the best checkpoint
on held-out windows (distill.distill_feature_map), then scored by RelMSE on held-out test windows:
    contribution   G groups per head from the G - 1 best-ranked boundaries (oal_groups.find_groups,
                   budget=G); G = 1 is the learned global quadratic
    random         the same group sizes with dimensions drawn at random (the control)
    G = D          one group per dimension: fully dimension-aware coefficients (the bound)
    published      the published rule (2-5 groups per head, oal_groups.find_groups)
RelMSE is per head on the attention outputs, and per layer after the output projection. Saves
results/oal_budget.json and, with matplotlib, results/oal_budget.png.
"""
import json
import os
import time

import torch

import distill
import pretrained
from configurator import at_least, configure, integers, layer_list, positive, pyplot, writable
from feature_maps import OAL
from oal_groups import contribution_scores, find_groups, top_share
from gpt import load_text

# ---- config: plain values, override with --key=value ----
model = "minilm"
text = "pydoc"
layers = "all"  # "all" or comma-separated layer indices
budgets = "1,2,3,4,5"
seq_len = 64
calib = 16  # calibration windows (from the first 80% of the text)
test = 8  # held-out test windows (from the rest)
val = 8  # held-out windows from the calibration text, for the best checkpoint
steps = 150  # AdamW steps of output-MSE calibration per layer and grouping (more do not help: docs/results.md)
lr = 1e-2
seed = 0
out = "results/oal_budget.json"
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


def random_like(groups, gen):
    """The same number of dimensions in each group as `groups` (H, D), the dimensions drawn at random."""
    return torch.stack([g[torch.randperm(len(g), generator=gen)] for g in groups])


def calibrate(groups, max_groups, attn, calib_qkv, val_qkv, cfg):
    """An OAL map with these groups (H, D), calibrated by output MSE with the best held-out checkpoint."""
    fmap = OAL(attn.head_dim, attn.n_head, max_groups=max_groups)
    fmap.set_groups(groups)
    distill.distill_feature_map(fmap, *calib_qkv, loss="mse", steps=cfg["steps"], lr=cfg["lr"], causal=attn.causal,
                                val=val_qkv)
    return fmap


def main(cfg):
    t0 = time.time()
    torch.manual_seed(cfg["seed"])
    at_least(cfg, 1, "seq_len", "calib", "test", "val")
    at_least(cfg, 0, "steps")
    positive(cfg, "lr")
    writable(cfg, "out")
    budgets = integers(cfg, "budgets", 1)
    corpus = load_text(cfg["text"], "text")
    net, encode, special = pretrained.load(cfg["model"])
    net.requires_grad_(False)
    L, D = len(net.blocks), net.blocks[0].attn.head_dim
    layer_ids = layer_list(cfg, L)
    pretrained.check_length(net, cfg["seq_len"])
    cut = int(0.8 * len(corpus))
    gen = torch.Generator().manual_seed(cfg["seed"])
    train_ids, test_ids = torch.tensor(encode(corpus[:cut])), torch.tensor(encode(corpus[cut:]))
    calib_x = pretrained.windows(train_ids, cfg["calib"], cfg["seq_len"], special, gen)
    test_x = pretrained.windows(test_ids, cfg["test"], cfg["seq_len"], special, gen)
    val_x = pretrained.windows(train_ids, cfg["val"], cfg["seq_len"], special, gen)
    calib_qkv, test_qkv, val_qkv = (distill.layer_qkv(net, x, layer_ids) for x in (calib_x, test_x, val_x))
    rand_gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    rows = []
    print(f"{cfg['model']}: layers {layer_ids}, {net.blocks[0].attn.n_head} heads of {D}; {cfg['steps']} steps each")
    for i in layer_ids:
        attn = net.blocks[i].attn
        scores = contribution_scores(*calib_qkv[i][:2], attn.causal).cpu()  # (B, H, D)
        share = top_share(scores.mean(0)).tolist()  # (H,): the top 10% of dimensions' share of the contribution
        groupings = {}
        for G in budgets:
            groups = torch.stack([find_groups(scores[:, h], budget=G) for h in range(scores.shape[1])])
            groupings[("contribution", G)] = groups
            if G > 1:
                groupings[("random", G)] = random_like(groups, rand_gen)
        groupings[("published", 0)] = torch.stack([find_groups(scores[:, h]) for h in range(scores.shape[1])])
        groupings[("per dimension", D)] = torch.arange(D).expand(attn.n_head, D)
        fitted = {}  # (groups, max_groups) -> test RelMSEs: the published rule often picks a budget's groups
        for (kind, G), groups in groupings.items():
            t = time.time()
            max_groups = D if kind == "per dimension" else max(budgets + [5])
            key = (groups.numpy().tobytes(), max_groups)
            if key not in fitted:
                fmap = calibrate(groups, max_groups, attn, calib_qkv[i], val_qkv[i], cfg)
                fitted[key] = distill.output_rel_mse(attn, fmap, *test_qkv[i])
            per_head, after_o = fitted[key]
            n_groups = [int(g.max()) + 1 for g in groups]
            rows.append({"layer": i, "kind": kind, "G": G, "groups_per_head": n_groups, "rel_mse_heads": per_head,
                         "rel_mse": sum(per_head) / len(per_head), "rel_mse_out": after_o, "top_share": share})
            print(f"layer {i} {kind:<13} G={G:<2} RelMSE {rows[-1]['rel_mse']:.4f}, after o {after_o:.4f} "
                  f"(groups per head {min(n_groups)}-{max(n_groups)}; {time.time() - t:.0f} s)", flush=True)
    summary = report(rows, D)
    os.makedirs(os.path.dirname(cfg["out"]) or ".", exist_ok=True)
    with open(cfg["out"], "w") as f:
        json.dump({"config": cfg, "rows": rows, "summary": summary, "seconds": time.time() - t0,
                   "torch": torch.__version__}, f, indent=1)
    print(f"saved {cfg['out']} ({time.time() - t0:.0f} s)")
    plot(summary, os.path.splitext(cfg["out"])[0] + ".png")


def report(rows, D):
    """Mean RelMSE over every head of every layer, and for the most skewed head, per (kind, G); and in how many
    heads each grouping is below the global quadratic (G = 1), head against the same head."""
    share = {r["layer"]: r["top_share"] for r in rows}  # top-10% contribution share of each head
    skewed = max(((i, h) for i in share for h in range(len(share[i]))), key=lambda ih: share[ih[0]][ih[1]])
    summary = {"most_skewed_head": {"layer": skewed[0], "head": skewed[1]}, "results": []}
    print(f"\nmean over heads (RelMSE on the heads' outputs, and after the output projection); most skewed head: "
          f"layer {skewed[0]}, head {skewed[1]}")
    print(f"{'grouping':<14} {'G':>3} {'RelMSE':>8} {'after o':>8} {'skewed head':>12} {'heads below G = 1':>18}")
    keys = list(dict.fromkeys((r["kind"], r["G"]) for r in rows))
    heads_of = {key: [x for r in rows if (r["kind"], r["G"]) == key for x in r["rel_mse_heads"]] for key in keys}
    one_group = heads_of.get(("contribution", 1))
    for kind, G in sorted(keys, key=lambda k: (k[1] if k[0] != "published" else 0.5, k[0])):
        rs = [r for r in rows if r["kind"] == kind and r["G"] == G]
        heads = heads_of[(kind, G)]
        below = None if one_group is None else sum(x < y for x, y in zip(heads, one_group))
        s = {"kind": kind, "G": G, "rel_mse": sum(heads) / len(heads),
             "rel_mse_out": sum(r["rel_mse_out"] for r in rs) / len(rs),
             "skewed_head": next((r["rel_mse_heads"][skewed[1]] for r in rs if r["layer"] == skewed[0]), None),
             "heads_below_one_group": below}
        summary["results"].append(s)
        label = "2-5" if kind == "published" else str(G)
        below = "" if below is None or G == 1 else f"{below} of {len(heads)}"
        print(f"{kind:<14} {label:>3} {s['rel_mse']:>8.4f} {s['rel_mse_out']:>8.4f} {s['skewed_head']:>12.4f} {below:>18}")
    return summary


def plot(summary, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("rel_mse", "skewed_head"), ("mean over all heads", "most skewed head")):
        for kind, style in (("contribution", "o-"), ("random", "s--")):
            rs = [r for r in summary["results"]  # this kind's groups, and G = 1 (which is the same for every kind)
                  if r["G"] <= 5 and (r["kind"] == kind or (r["kind"] == "contribution" and r["G"] == 1))]
            ax.plot([r["G"] for r in rs], [r[key] for r in rs], style, label=f"{kind} groups")
        for r in summary["results"]:
            if r["kind"] == "per dimension":
                ax.axhline(r[key], color="gray", ls=":", label=f"one group per dimension (G = {r['G']})")
        ax.set(xlabel="group budget G", ylabel="held-out RelMSE", title=title)
        ax.legend(fontsize=8)
    fig.suptitle("OAL group budget (cf. OAL Sec. 4.2): all-MiniLM-L6-v2, output-MSE calibration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


if __name__ == "__main__":
    main(configure(config))
