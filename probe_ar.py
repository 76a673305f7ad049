"""
Where a trained associative-recall model finds the answer, from a model train_ar.py saved
(--save_models=true).

The lookup without token shift is an induction circuit (Hedgehog Sec. 3.2, App. B.1): layer 0 brings
each key into the position of the value after it, and layer 1's query row (at the query key) matches
it there and reads the value. train_ar.py records two numbers per epoch for it: layer 0's weight on
the previous token, and layer 1's weight on the answer. Some linear runs climb far off the plateau
with the first no higher than a uniform row's. Three measurements say how:
- offsets: the mean weight that layer 0 puts d tokens back (d = 0..16) from the value positions of the
  second half of the sequence, where a uniform row gives each token under 1/64, and how much of it
  goes to keys and to the first quarter of the sequence; its weight on the own key at the value of
  every pair, since a head can be built for a stretch of the sequence only; where layer 1's query
  row lands relative to the answers (d = -2..4 around them), and how much on the first answer
  against the later ones;
- truncation: test accuracy when layer 0 keeps only its weights on the last w tokens (renormalised),
  for w = 1, 2, 4, ..., when it is exactly the previous token (at every position, or at every one
  but the query, where it is cut: in h3 the query's previous token is the copy prefix), exactly
  uniform, or cut out; over all test sequences and by the pair in which the query key first
  occurs. A lookup through a previous-token head does not care where that is; one through a
  running mean of the tokens so far, in which a key's share is 1 / (its position + 1), works best
  when it comes early;
- probe: how well a linear read-out of layer 1's input at the second half's value positions names the
  key d tokens back (d = 1: its own key; d = 3, 5: the keys of the pairs before), fitted on half of
  the test sequences and scored on the other half. Chance is one in the number of keys.

    python probe_ar.py --model=results/ar_h3_zoology_256_elu_seed1_model/model_elu_F256_seed1.pt

With token shift (train_ar.py's default) each value's position already holds its key, so either layer can
look up without the circuit; the ar.json's target_mass_per_head says which layers do, and the tables here
what each is worth (docs/results.md, the capacity picture: a seed whose layer 1 never joins).

Prints the three tables and writes them to probe_<model name>.json beside the model.
"""
import json
import os

import torch
import torch.nn.functional as F

import attention
from attention import attention_weights, causal_mask
from configurator import at_least, configure
from ar import answer_positions, load_model, make_data

# ---- config: plain values, override with --key=value ----
model = ""  # a model_*.pt that train_ar.py --save_models=true wrote
num = 1000  # test sequences to look at (from the start of the run's own test set)
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

WIDTHS = (1, 2, 4, 8, 16, 32)
OFFSETS = range(17)
AROUND = range(-2, 5)
KEY_BACK = (1, 3, 5)
FIRST = (0, 2, 4, 8, 16, 32, 64)  # bins of the pair index of the query key's first occurrence


def value_rows(pairs, start=0):
    """The value positions (odd, inside the pairs) from position start on: their key is 1 back."""
    values = torch.arange(1, 2 * pairs, 2)
    return values[values >= start]


@torch.no_grad()
def offsets(model, x, pairs):
    """Where the two layers look. From the second half's value positions, layer 0's mean weight d back
    (d in OFFSETS; "uniform": a uniform row's there), its total weight on key positions and on the first
    quarter of the sequence; layer 0's weight on the own key at the value of each pair (all pairs, not
    only the second half's); from the query, the last layer's weight at the answers + d (d in AROUND),
    and on the first answer and on the later ones. Every entry per head."""
    _, weights = model.eval()(x, return_weights=True)  # L x (N, H, T, T)
    T = x.shape[1]
    rows = value_rows(pairs, T // 2)
    w0 = weights[0][:, :, rows]  # (N, H, R, T)
    back = [w0[:, :, torch.arange(len(rows)), rows - d].mean((0, 2)).tolist() for d in OFFSETS]  # d x (H,)
    values = value_rows(pairs)
    by_pair = weights[0][:, :, values, values - 1].mean(0).T.tolist()  # pairs x (H,)
    keys = torch.arange(T) % 2 == 0
    keys[2 * pairs:] = False
    query = weights[-1][:, :, -1]  # (N, H, T): the last layer's query row
    answers = answer_positions(x)  # (N, T)
    answers[:, -1] = False  # the query itself
    first = torch.zeros_like(answers)
    first[torch.arange(len(x)), answers.int().argmax(-1)] = True  # every query key is in context
    around = []
    for d in AROUND:
        shifted = torch.zeros_like(answers)
        if d >= 0:
            shifted[:, d:-1] = answers[:, :T - 1 - d]
        else:
            shifted[:, :d - 1] = answers[:, -d:-1]
        around.append((query * shifted[:, None]).sum(-1).mean(0).tolist())  # (H,)
    start = torch.arange(T) < T // 4
    return {"layer0": back, "uniform": (1.0 / (rows + 1)).mean().item(),
            "layer0_on_keys": (w0 * keys).sum(-1).mean((0, 2)).tolist(),
            "layer0_on_first_quarter": (w0 * start).sum(-1).mean((0, 2)).tolist(),
            "layer0_own_key_by_pair": by_pair, "layer1_answer": around,
            "layer1_first_answer": (query * first[:, None]).sum(-1).mean(0).tolist(),
            "layer1_later_answers": (query * (answers & ~first)[:, None]).sum(-1).mean(0).tolist()}


def truncated_mix(attn, keep):
    """A replacement for attn.mix whose weights are keep(W) (B, H, T, T) of the layer's own weights W."""
    def mix(q, k, v):
        w = keep(attention_weights(q, k, attn.fmap, True, attention.EPS))
        return (w @ v.float()).to(v.dtype)
    return mix


def band(w, width):
    """w kept on the last `width` tokens (offsets 0 .. width - 1) and renormalised."""
    T = w.shape[-1]
    i = torch.arange(T)
    near = (i[:, None] - i[None, :] < width) & causal_mask(T)
    w = w * near
    return w / (w.sum(-1, keepdim=True) + attention.EPS)


def layer0_variants(T):
    """{name: keep}: what truncation() puts in place of layer 0's weights W (B, H, T, T); None keeps them.
    The previous-token rows put all on i - 1 (the first row on itself); "but the query" leaves the
    query's row empty."""
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    but_query = prev.clone()
    but_query[-1] = 0
    uniform = causal_mask(T) / torch.arange(1, T + 1)[:, None]
    return {"as trained": None, **{f"last {w}": (lambda W, w=w: band(W, w)) for w in WIDTHS},
            "previous token": lambda W: prev.expand_as(W),
            "previous token but the query": lambda W: but_query.expand_as(W),
            "uniform": lambda W: uniform.expand_as(W),
            "cut": lambda W: torch.zeros_like(W)}


def first_occurrence_bins(x, pairs):
    """{"a-b": (N,) bool}: the sequences whose query key first occurs in pairs a..b (bins of FIRST)."""
    first = (x[:, :2 * pairs:2] == x[:, -1:]).int().argmax(-1)  # (N,): the query is always in context
    bins = {f"{lo}-{min(hi, pairs) - 1}": (first >= lo) & (first < hi) for lo, hi in zip(FIRST, FIRST[1:]) if lo < pairs}
    return {"all": torch.ones_like(first, dtype=torch.bool), **bins}


@torch.no_grad()
def truncation(model, x, y, pairs):
    """{variant: {"all" or "a-b": [sequences, test accuracy]}}: accuracy over all test sequences and by the
    pair in which the query key first occurs, with layer 0's weights as they are, on the last w tokens
    only, exactly the previous token (the first token keeps itself) everywhere or everywhere but the
    query (whose row is then 0), exactly uniform, and cut out."""
    attn = model.eval().blocks[0].attn
    bins = first_occurrence_bins(x, pairs)
    table = {}
    for name, keep in layer0_variants(x.shape[1]).items():
        if keep is not None:
            attn.mix = truncated_mix(attn, keep)
        right = model(x)[:, -1].argmax(-1) == y[:, -1]  # (N,)
        attn.__dict__.pop("mix", None)  # back to the class's mix
        table[name] = {b: [m.sum().item(), right[m].double().mean().item()] for b, m in bins.items() if m.any()}
    return table


@torch.no_grad()
def probe(model, x, pairs, n_keys):
    """{d: held-out accuracy of a least-squares linear read-out, from layer 1's input (after its layer
    norm) at each value position, of the key d tokens back}."""
    h = model.eval().blocks[0](model.embed(x))
    h = model.blocks[1].ln1(h)  # (N, T, C)
    half, rows = len(x) // 2, value_rows(pairs, x.shape[1] // 2)  # the same positions for every d
    feats = F.pad(h[:, rows], (0, 1), value=1.0)  # (N, R, C + 1), with a bias
    result = {}
    for d in KEY_BACK:
        target = x[:, rows - d]  # (N, R): keys, 0 .. n_keys - 1
        fit = torch.linalg.lstsq(feats[:half].flatten(0, 1).double(),
                                 F.one_hot(target[:half].flatten(), n_keys).double()).solution
        guess = (feats[half:].flatten(0, 1).double() @ fit).argmax(-1)
        result[d] = (guess == target[half:].flatten()).double().mean().item()
    return result


def main(cfg):
    at_least(cfg, 2, "num")
    if not cfg["model"]:
        raise SystemExit("error: give --model=path/to/model_*.pt (train_ar.py --save_models=true writes them)")
    net, ckpt = load_model(cfg["model"])
    if len(net.blocks) < 2:
        raise SystemExit(f"error: {cfg['model']} has one layer; the lookup needs two (train it with --n_layer=2)")
    run = ckpt["config"]
    _, _, x, y = make_data(run)
    x, y = x[:cfg["num"]], y[:cfg["num"]]
    pairs = run["seq_len"] // 2 if run["format"] == "h3" else (run["seq_len"] - 1) // 2
    n_keys = (run["vocab_size"] - 2) // 2 if run["format"] == "h3" else run["vocab_size"] // 2
    print(f"{ckpt['run']} seed {ckpt['seed']} after {ckpt['epochs']} epochs, {len(x)} test sequences; "
          "the weights by offset and by pair", flush=True)
    result = {"model": cfg["model"], "run": ckpt["run"], "seed": ckpt["seed"], "epochs": ckpt["epochs"], "num": len(x),
              **offsets(net, x, pairs)}
    print(f"accuracy with layer 0's weights replaced, {len(layer0_variants(2))} ways", flush=True)
    result["truncation"] = truncation(net, x, y, pairs)
    print("linear probes of layer 1's input", flush=True)
    result["probe"] = probe(net, x, pairs, n_keys)
    print("layer 0, mean weight d tokens back from a value (second half; a uniform row gives "
          f"{result['uniform']:.4f}):")
    print("  " + "  ".join(f"{d}: {max(w):.3f}" for d, w in zip(OFFSETS, result["layer0"])))
    print(f"  in all, on key positions {max(result['layer0_on_keys']):.3f}, "
          f"on the first quarter of the sequence {max(result['layer0_on_first_quarter']):.3f}")
    print("layer 0, weight on its own key at the value of pair p (all pairs, 16 to a line):")
    by_pair = [max(w) for w in result["layer0_own_key_by_pair"]]
    for p in range(0, pairs, 16):
        print(f"  {p:>2}-{min(p + 16, pairs) - 1:<2} " + " ".join(f"{w:.2f}" for w in by_pair[p:p + 16]))
    print("layer 1, the query row's weight at the answers + d:")
    print("  " + "  ".join(f"{d:+d}: {max(w):.3f}" for d, w in zip(AROUND, result["layer1_answer"])))
    print(f"  on the first answer {max(result['layer1_first_answer']):.3f}, "
          f"on the later ones {max(result['layer1_later_answers']):.3f}")
    bins = result["truncation"]["as trained"]
    print("test accuracy with layer 0's attention as below: over all sequences, and by the pair where the query key "
          "first occurs")
    print(f"{'':>28} " + " ".join(f"{b} ({n})".rjust(11) for b, (n, _) in bins.items()))
    for name, row in result["truncation"].items():
        print(f"{name:>28} " + " ".join(f"{acc:11.3f}" for _, acc in row.values()))
    print(f"linear probe of layer 1's input at a value for the key d back (chance {1 / n_keys:.3f}): "
          + ", ".join(f"d = {d}: {a:.3f}" for d, a in result["probe"].items()))
    path = os.path.join(os.path.dirname(cfg["model"]), f"probe_{os.path.basename(cfg['model'])[:-3]}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main(configure(config))
