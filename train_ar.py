"""
Associative recall: does spiky (low-entropy) attention matter? Every attention side by side.

Hedgehog Sec. 3.2 (Fig. 2, Fig. 4, Table 3) and App. B.1: a small Transformer must recall, for a key
it has seen before in the sequence, the value that followed it. The paper: softmax solves it with
spiky attention (0.5-1.5 nats); 1+ELU, ReLU, Performer and cosFormer stay below 20% with diffuse
attention; exp with t = 1 fails and t = 2 solves; Taylor and Hedgehog solve it. Each attention here
is trained from scratch on the same data with the same budget.

What the default holds equal, so that the comparison is about spikiness:
- The feature size F. A linear attention's state (S: F x Dv, z: F) must hold the key-value pairs, so
  more features is more memory (Zoology, Arora et al. 2023, Fig. 2). Each map gets the q/k head size
  whose F is closest to `features` (64): 1+ELU, ReLU, exp, T2R at D = 64; Hedgehog and cosFormer
  (F = 2D) at 32; Performer (F = round(D ln D)) at 21; Taylor and the quadratics (F = 1 + D + D(D+1)/2)
  at 10, F = 66. v keeps the model width, so every linear state has F x 64 + F numbers a layer.
  Softmax gets D = F too; its memory is its KV cache, which grows with the sequence. The window
  attentions get the linear maps' state (run_sizes): swa keeps the last w tokens' keys (D = F) and values,
  w = 32 at F = 64; lolcats (LoLCATs' window + Hedgehog hybrid) spends half on Hedgehog maps (F = 32, D = 16)
  and the rest on a window of 26 tokens. A query then sees the last w tokens exactly, and swa nothing older.
- The head that does the lookup. With token shift a value's position already holds its key, so one
  attention row (the query's) finds the answer by looking at the positions right after earlier copies
  of the query key; without it, an induction circuit looks at the same positions. The retrieval head
  is the layer and head whose query row puts the most weight there (target_mass); its entropy is the
  spikiness that matters, not an average over heads that do other things. The induction circuit also
  needs a head that looks at the previous token; each epoch records every head's weight there and on
  the answer, so a run shows when the two form.
- Temperature. With learned projections exp(t W x) = exp((t W) x), so exp_t1 and exp_t2 differ only
  in initial scale. exp_norm_t* L2-normalises q and k first (feature_maps.Exp), which bounds each
  kernel term to [e^-2t, e^2t]: there t really sets how peaked a row can be (feature_maps.exp_norm_ratio_bound).

The data, the model and the measurements of the lookup are in ar.py: two data formats, "pairs" (the
default, with token shift) and "h3", H3's generator as published. config/ar_h3.py is H3's whole recipe.

    python train_ar.py                                    # every attention, one seed
    python train_ar.py --seeds=0,1,2 --attentions=softmax,exp_norm_t1,exp_norm_t2,exp_norm_t4
    python train_ar.py --features=8,16,32,64,128 --attentions=softmax,elu,exp_t2,hedgehog,taylor \\
        --seeds=0,1,2 --out_dir=results/ar_capacity      # accuracy against state size
    python train_ar.py config/ar_h3.py --d_model=64       # the published recipe, 64 wide (see the config)

Writes out_dir/ar.json, one record per run, rewritten as the runs finish (in order), then plot_ar.report's
table (ar_summary.txt) and figures: accuracy against the retrieval head's entropy (Fig. 4), its query row on
one sequence (Fig. 2), the learning curves and, when `features` sweeps, accuracy against state size.
plot_ar.py redraws them from saved files and merges runs made at different times. With --save_models=true
each run's model goes to out_dir too, after every epoch; ar.load_model reads it back, probe_ar.py looks
inside, and --init_from=resume carries a run on from it, e.g. one stopped by --max_minutes, with a longer cap:

    python train_ar.py config/ar_h3.py --save_models=true --max_minutes=60 --out_dir=results/ar_long
    python train_ar.py config/ar_h3.py --save_models=true --max_minutes=120 --out_dir=results/ar_long --init_from=resume
"""
import json
import os
import time

import torch
import torch.nn.functional as F

from ar import ARModel, answer_positions, evaluate, lookup_stats, make_data
from attention import LOLCATS_MAP, WINDOWED
from configurator import at_least, choices, configure, integers, one_of, pick_device, positive, writable
from feature_maps import FEATURE_MAPS, make_feature_map
from gpt import load_checkpoint, save_checkpoint
from plot_ar import first_difference, report

# ---- config: plain values, override with --key=value or a config file ----
format = "pairs"  # "pairs": k v ... k, one label (Hedgehog App. B.1); "h3": k v ... => k v, every next token (H3)
vocab_size = 40  # "pairs": 20 keys, 20 values; "h3": counts H3's two special tokens, so 19 keys, 19 values
seq_len = 128  # "pairs": the whole sequence, 63 pairs and the query; "h3": input_seq_len, 64 pairs, then => k v
num_train = 10_000  # training sequences, each with its own key -> value map
num_test = 2_000  # test sequences
n_layer = 2
d_model = 64  # model width, and v's head size times n_head
n_head = 1
features = "64"  # F per head, the same for every map; comma-separated sweeps it; 0: q/k head size d_model / n_head
mlp_ratio = 0  # hidden size of each block's MLP in units of d_model; 0 = attention-only blocks
token_shift = True  # each position also sees the previous token's embedding (see ARModel)
dropout = 0.0  # on the embeddings and on softmax's attention weights
attentions = (  # softmax, swa, lolcats, a feature map, or a name of VARIANTS (exp_t2, exp_norm_t4, hedgehog_exp, ...)
    "softmax,elu,relu,performer,cosformer,exp_t1,exp_t2,taylor,hedgehog,t2r,quadratic,oal,"
    "exp_norm_t1,exp_norm_t2,exp_norm_t4,exp_norm_t8,swa,lolcats")
epochs = 3  # at most, the same for every attention; stops early at target_acc or after `patience` epochs
batch_size = 64
lr = 3e-3  # AdamW
weight_decay = 0.1
warmup = 0.0  # > 0: linear warm-up over this fraction of all steps, then linear decay to 0; 0: constant lr
patience = 0  # stop after this many epochs after the warm-up without a better `early_stop` (0: no such stop)
early_stop = "loss"  # what patience watches on the first 500 test sequences: "loss" (Hedgehog App. B.1) or "accuracy"
max_minutes = 0.0  # per run, its time before a resume too: stop after the epoch in which it passes (0: no limit)
target_acc = 0.99  # stop when the per-epoch accuracy (on the first 500 test sequences) reaches this (above 1: never)
eval_every = 25  # training steps between accuracy checks on the first 500 test sequences (the learning curves)
seeds = "0"  # comma-separated; more than one reports mean and spread
device = "auto"  # auto: cuda, then mps, then cpu
workers = 0  # runs in parallel, in processes of one thread each; 0 = one per core on the CPU, one on a GPU
out_dir = "results"  # ar.json, ar_summary.txt, the figures and any saved models go here
plots = True  # the figures (needs matplotlib)
save_models = False  # after every epoch, each run's model and training state to out_dir (ar.load_model reads it)
init_from = "scratch"  # or "resume": carry each run on from its saved model in out_dir (same settings, a longer cap)
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

# names in `attentions` that are a feature map with settings
VARIANTS = {"exp_t1": ("exp", {"t": 1.0}), "exp_t2": ("exp", {"t": 2.0}),
            "hedgehog_exp": ("hedgehog", {"mode": "exp"}),  # Sec. 4.2's raw exp, not App. A.1's softmax
            "hedgehog_lolcats": ("hedgehog", LOLCATS_MAP),  # lolcats' maps without its window
            **{f"exp_norm_t{t}": ("exp", {"t": float(t), "normalize": True}) for t in (1, 2, 4, 8, 16)}}


def feature_size(name, qk_dim, kw):
    """F, the features per head of map `name` at q/k head size qk_dim (softmax and swa: qk_dim; lolcats: its
    Hedgehog maps')."""
    if name in ("softmax", "swa"):
        return qk_dim
    name = "hedgehog" if name == "lolcats" else name
    x = torch.zeros(1, 1, 1, qk_dim)
    return make_feature_map(name, qk_dim, **kw)(x, x)[0].shape[-1]


def qk_dim_for(name, kw, features):
    """The q/k head size (>= 2) whose feature size is closest to `features`; the larger one on a tie."""
    return min(range(features, 1, -1), key=lambda d: abs(feature_size(name, d, kw) - features))


def state_size(name, F, qk_dim, n_head, d_model, T, window=0):
    """Numbers a layer keeps to attend at position T: linear attention's S (F x Dv) and z (F) per head;
    softmax's KV cache (T keys of qk_dim and T values of Dv per head); swa's, of the last `window` tokens only;
    lolcats' window cache and linear state."""
    dv = d_model // n_head
    cache = min(T, window) * (qk_dim + dv) if name in WINDOWED else T * (qk_dim + dv)
    if name in ("softmax", "swa"):
        return n_head * cache
    return n_head * (F * dv + F + (cache if name == "lolcats" else 0))


def run_sizes(attention, features, cfg):
    """(map name, its settings, q/k head size, F, window) of a run of `attention` asked for `features` features.
    swa and lolcats are held to the same state as a linear map at `features` (F Dv + F numbers a head; with
    features = 0, F = Dv): swa's window cache (w keys of its q/k head size and w values) fills it; lolcats'
    Hedgehog maps get half the features, and its window what they leave."""
    name, kw = VARIANTS.get(attention, (attention, {}))
    dv = cfg["d_model"] // cfg["n_head"]
    asked = max(2, (features or dv) // 2) if name == "lolcats" else features
    qk_dim = qk_dim_for(name, kw, asked) if asked else dv
    F_, window = feature_size(name, qk_dim, kw), 0
    if name in WINDOWED:
        budget = (features or dv) * (dv + 1) - (F_ * (dv + 1) if name == "lolcats" else 0)
        window = max(1, budget // (qk_dim + dv))
    return name, kw, qk_dim, F_, window


def model_path(attention, features, seed, cfg):
    """Where --save_models=true writes a run's model and training state."""
    return os.path.join(cfg["out_dir"], f"model_{attention}_F{run_sizes(attention, features, cfg)[3]}_seed{seed}.pt")


def saved_run(path, cfg):
    """With --init_from=resume, the checkpoint at path to carry a run on from (None when there is none yet), or a
    one-line error when it cannot be: it holds no training state, or the run had other settings."""
    if not (cfg["init_from"] == "resume" and os.path.exists(path)):
        return None
    ckpt = load_checkpoint(path, "cpu", kind="train_ar")  # on the CPU: the random states must stay there
    if diff := first_difference(ckpt["config"], cfg):
        raise SystemExit(f"error: --init_from=resume: {path} was trained with {diff[0]}, not {diff[1]}; "
                         "a run carries on with the settings it had (the time cap may grow)")
    if "train_state" not in ckpt:
        raise SystemExit(f"error: --init_from=resume: {path} holds a model but not its optimiser and random "
                         "states, so its run cannot carry on; train it again with --init_from=scratch")
    return ckpt


def lr_factor(step, warm, total):
    """The learning rate's multiplier at `step` (from 0) of `total`: 1 throughout when warm = 0; else a linear
    warm-up to 1 over the first `warm` steps, then a linear decay to 0 at `total`."""
    return 1.0 if not warm else min((step + 1) / warm, (total - step) / (total - warm))


def rng_states(dev):
    """The random states that dropout draws from: the CPU's and, on a GPU, the GPU's."""
    kind, states = torch.device(dev).type, {"cpu": torch.get_rng_state()}
    if kind == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(dev)
    if kind == "mps":
        states["mps"] = torch.mps.get_rng_state()
    return states


def set_rng_states(states, dev):
    """Restore what rng_states(dev) returned."""
    torch.set_rng_state(states["cpu"])
    kind = torch.device(dev).type
    if kind == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], dev)
    if kind == "mps" and "mps" in states:
        torch.mps.set_rng_state(states["mps"])


def train_one(attention, features, seed, data, cfg, dev):
    """Train one attention from scratch at `features` features per head, or carry its run on from its file
    (--init_from=resume); returns its record."""
    name, kw, qk_dim, F_, window = run_sizes(attention, features, cfg)
    x_train, y_train, x_test, y_test = (t.to(dev) for t in data)
    T = x_train.shape[1]
    torch.manual_seed(seed)
    model_args = dict(attention=name, vocab_size=cfg["vocab_size"], seq_len=T, n_layer=cfg["n_layer"],
                      d_model=cfg["d_model"], n_head=cfg["n_head"], mlp_ratio=cfg["mlp_ratio"],
                      token_shift=cfg["token_shift"], qk_dim=qk_dim, dropout=cfg["dropout"],
                      **({"window": window} if window else {}), **kw)
    model = ARModel(**model_args).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps_per_epoch = -(-len(x_train) // cfg["batch_size"])
    total_steps = cfg["epochs"] * steps_per_epoch
    warm = int(cfg["warmup"] * total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warm, total_steps))
    g = torch.Generator().manual_seed(seed)
    x_val, y_val = x_test[:500], y_test[:500]  # a quarter of the test set: cheap enough for every epoch and the curves
    path = model_path(attention, features, seed, cfg)
    ckpt = saved_run(path, cfg)
    if ckpt:  # everything the next step depends on, as it was after the checkpoint's epoch
        state = ckpt["train_state"]
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        g.set_state(state["shuffle"])
        set_rng_states(state["rng"], dev)
        epoch = ckpt["epochs"]
        step, best, since_best, seconds, log = (state[k] for k in ("step", "best", "since_best", "seconds", "log"))
        print(f"{attention} F={F_} seed {seed}: carried on from {path} after epoch {epoch}", flush=True)
    else:
        epoch, step, best, since_best, seconds = 0, 0, float("inf"), 0, 0.0
        log = {"test_acc_per_epoch": [], "test_loss_per_epoch": [], "target_mass_per_epoch": [],
               "prev_mass_per_epoch": [], "curve": [(0, evaluate(model, x_val, y_val)[0])]}
    t0 = time.time() - seconds
    while not (epoch == cfg["epochs"] or 0 < cfg["patience"] <= since_best  # a stop after the last epoch
               or epoch and 0 < cfg["max_minutes"] * 60 < time.time() - t0
               or log["test_acc_per_epoch"] and log["test_acc_per_epoch"][-1] >= cfg["target_acc"]):
        epoch += 1
        total = 0.0
        perm = torch.randperm(len(x_train), generator=g)
        for i in range(0, len(perm), cfg["batch_size"]):
            idx = perm[i:i + cfg["batch_size"]].to(dev)
            logits = model(x_train[idx])
            loss = F.cross_entropy(logits.flatten(0, 1), y_train[idx].flatten(), ignore_index=-100)
            if not torch.isfinite(loss):  # stop this run; main() reports it and exits with status 1
                print(f"{attention} F={F_} seed {seed}: step {step}: the training loss is {loss.item()}; this run stops "
                      f"(try a lower --lr, now {cfg['lr']})", flush=True)
                return {"attention": attention, "seed": seed, "features": F_,
                        "stopped": f"loss {loss.item()} at step {step}"}
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            total += loss.item() * len(idx)
            step += 1
            if step % cfg["eval_every"] == 0:
                log["curve"].append((step, evaluate(model, x_val, y_val)[0]))
        if name == "oal" and epoch == 1:
            regroup_oal(model, x_train[:256])
        acc, test_loss = evaluate(model, x_val, y_val)
        mass, _, _, prev = lookup_stats(model, x_val[:100])  # how the two heads the lookup needs are forming
        for key, value in (("test_acc", acc), ("test_loss", test_loss), ("target_mass", mass.tolist()),
                           ("prev_mass", prev.tolist())):
            log[key + "_per_epoch"].append(value)
        watched = test_loss if cfg["early_stop"] == "loss" else -acc  # lower is better; warm-up epochs do not count
        best, since_best = (watched, 0) if watched < best else (best, since_best + (step > warm))
        print(f"{attention} F={F_} seed {seed} | epoch {epoch}: train loss {total / len(x_train):.3f}, "
              f"test loss {test_loss:.3f}, test acc {acc:.3f}, {time.time() - t0:.0f}s | weight on the previous token "
              f"{'/'.join(f'{p:.2f}' for p in prev.amax(1).tolist())} (best head of each layer), "
              f"on the answer {mass.max():.2f}", flush=True)
        if cfg["save_models"]:  # after every epoch, so that a run stopped by its time cap or a kill can carry on
            state = {"optimizer": opt.state_dict(), "schedule": schedule.state_dict(), "shuffle": g.get_state(),
                     "rng": rng_states(dev), "step": step, "best": best, "since_best": since_best,
                     "seconds": time.time() - t0, "log": log}
            save_checkpoint({"kind": "train_ar", "model_args": model_args, "model": model.state_dict(), "config": cfg,
                             "run": attention, "seed": seed, "epochs": epoch, "train_state": state}, path)
    seconds = time.time() - t0
    mass, ent, rows, prev = lookup_stats(model, x_test[:200])
    if not (mass.isfinite().all() and ent.isfinite().all()):  # finite losses, but weights too large for a forward
        print(f"{attention} F={F_} seed {seed}: the attention weights are not finite after step {step} "
              f"(try a lower --lr, now {cfg['lr']})", flush=True)
        return {"attention": attention, "seed": seed, "features": F_, "stopped": f"non-finite attention after step {step}"}
    layer, head = divmod(mass.argmax().item(), mass.shape[1])  # the retrieval head
    return {"attention": attention, "seed": seed, "test_acc": evaluate(model, x_test, y_test)[0],
            "features": F_, "features_asked": features, "qk_dim": qk_dim,
            "state_size": state_size(name, F_, qk_dim, cfg["n_head"], cfg["d_model"], T, window),
            **({"window": window} if window else {}),
            "retrieval_entropy": ent[layer, head].item(), "target_mass": mass[layer, head].item(),
            "retrieval_layer": layer, "retrieval_head": head,
            "entropy_per_head": ent.tolist(), "target_mass_per_head": mass.tolist(), "prev_mass_per_head": prev.tolist(),
            "query_row": rows[layer, head, 0].tolist(),
            "answer_positions": answer_positions(x_test[:1])[0].nonzero()[:, 0].tolist(),
            "params": sum(p.numel() for p in model.parameters()), "epochs": epoch, "steps": step, **log,
            "steps_to_50": steps_to(log["curve"], 0.5), "steps_to_90": steps_to(log["curve"], 0.9), "seconds": seconds}


def run_job(job):
    """train_one on one tuple of its arguments, for Pool.imap."""
    return train_one(*job)


def steps_to(curve, level):
    """The first training step at which the accuracy curve [(step, acc), ...] reaches level; None if never."""
    return next((step for step, acc in curve if acc >= level), None)


@torch.no_grad()
def regroup_oal(model, x):
    """OAL's grouping (OAL Sec. 4.2), done once after the first epoch, when q and k mean something:
    contribution scores per (layer, head) on a batch of training sequences, then the stable-gap groups.
    Until now every head was one group; each new group starts as a copy of that group's coefficients
    (rows 2.. of L copy row 1), so that [1, z_1 .. z_G] L, and the kernel, do not change at the split."""
    h = model.embed(x)
    for block in model.blocks:  # layer by layer: each layer's input comes after the earlier ones are split
        fmap = block.attn.fmap
        fmap.L[:, 2:] = 0
        fmap.L[:, 2:, :2] = fmap.L[:, 1:2, :2]
        q, k, _ = block.attn.heads(block.ln1(h))
        groups = fmap.set_groups_from(q, k)
        print(f"oal: layer groups per head {[int(g.max()) + 1 for g in groups]}")
        h = block(h)


def check(cfg):
    """Every setting in range for the task, before any work."""
    one_of(cfg, "format", ("pairs", "h3"))
    one_of(cfg, "early_stop", ("loss", "accuracy"))
    at_least(cfg, 1, "num_train", "num_test", "n_layer", "d_model", "n_head", "epochs", "batch_size", "eval_every")
    at_least(cfg, 0, "mlp_ratio", "dropout", "warmup", "patience", "max_minutes", "weight_decay", "workers")
    positive(cfg, "lr")
    writable(cfg, "out_dir", folder=True)
    at_least(cfg, 3 if cfg["format"] == "pairs" else 2, "seq_len")  # one pair, and the query (pairs)
    at_least(cfg, 2 if cfg["format"] == "pairs" else 4, "vocab_size")  # keys and values (and h3's two special tokens)
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit(f"error: --d_model={cfg['d_model']} is not divisible by --n_head={cfg['n_head']}")
    if not 0 <= cfg["dropout"] < 1 or cfg["warmup"] >= 1:
        raise SystemExit("error: --dropout and --warmup are fractions below 1")
    one_of(cfg, "init_from", ("scratch", "resume"))
    if cfg["init_from"] == "resume" and not cfg["save_models"]:
        raise SystemExit("error: --init_from=resume needs --save_models=true (it writes what a run carries on from)")


def main(cfg):
    check(cfg)
    names = choices(cfg, "attentions", ["softmax", *WINDOWED, *FEATURE_MAPS, *VARIANTS])
    seeds, sizes = integers(cfg, "seeds"), integers(cfg, "features")
    if 1 in sizes:  # a q/k head is at least 2 wide
        raise SystemExit(f"error: --features={cfg['features']!r}: each F must be 0 (the q/k head d_model / n_head) "
                         "or at least 2")
    dev = pick_device(cfg["device"])
    print(f"device: {dev}, torch threads: {torch.get_num_threads()}")
    os.makedirs(cfg["out_dir"], exist_ok=True)
    runs = [(name, f, seed) for f in sizes for name in names for seed in seeds]
    for run in runs:  # resuming, a file that cannot be carried on stops us before any work
        saved_run(model_path(*run, cfg), cfg)
    data = make_data(cfg)
    jobs = [(*run, data, cfg, dev) for run in runs]
    workers = min(len(jobs), cfg["workers"] or ((os.cpu_count() or 1) if dev == "cpu" else 1))
    pool = None
    if workers > 1:  # small models use cores better as one-thread processes than as threads, and a GPU's idle time
        print(f"training {len(jobs)} runs in {workers} processes of one thread each")
        pool = torch.multiprocessing.get_context("spawn").Pool(workers, torch.set_num_threads, (1,))
    path = os.path.join(cfg["out_dir"], "ar.json")
    records, stopped = [], []
    try:
        for r in pool.imap(run_job, jobs) if pool else map(run_job, jobs):  # in the order of jobs
            if "stopped" in r:
                stopped.append(r)
            else:
                records.append(dict(r, device=dev, torch=torch.__version__, config=cfg))
            with open(path, "w") as f:  # after every run: stopping early (Ctrl-C) keeps the runs written so far
                json.dump(records + stopped, f, indent=1)
    finally:
        if pool:  # its workers end with main, on an error or Ctrl-C too
            pool.terminate()
    print(f"saved {path}")
    if records:
        report(records, cfg["out_dir"], cfg["plots"])
    if stopped:
        raise SystemExit(f"error: {len(stopped)} run(s) stopped on a non-finite loss: "
                         + "; ".join(f"{r['attention']} seed {r['seed']} {r['stopped']}" for r in stopped)
                         + f" (recorded in {path}); try a lower --lr")
    return records


if __name__ == "__main__":
    main(configure(config))
