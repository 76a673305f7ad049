"""
Associative recall: the task's data, the small Transformer that learns it, and where it looks.

Hedgehog Sec. 3.2 and App. B.1: for a key seen before in the sequence, recall the value that followed
it. Two data formats:
- "pairs" (Hedgehog App. B.1): k v k v ... q; the last token is the query and the only
  label. make_ar_data.
- "h3", H3's generator as published (safari, src/dataloaders/synthetics.py): k v ... => q v, the next
  token labelled at every training position, only the last in test. make_h3_data.

ARModel is the Transformer of train_ar.py; load_model reads back one that it saved. answer_positions
and lookup_stats measure the lookup (Fig. 2, Fig. 4): the weight of the query row on the answers, its
entropy, and the weight each position puts on the token before it.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import Block, entropy
from gpt import load_checkpoint


def make_ar_data(n, seq_len=128, vocab_size=40, seed=0):
    """n "pairs" sequences -> (inputs, labels), both (n, 2P + 1) long tensors with P = (seq_len - 1) // 2 pairs:
    seq_len - 1 tokens and the answer for an even seq_len, such as the default 128 (Hedgehog App. B.1).

    Half the vocabulary is keys, half values. Each sequence draws its own random key -> value map,
    then (key, value) pairs with keys drawn uniformly: with 20 keys and 63 pairs each key recurs
    about 3 times. The last input token is a key drawn from those in context, and the only label is
    its value (the 128th token). Unlabelled positions are -100. Keys as letters, values as numbers:

        input    c  27  h  31  c  27  q  22  ...  m  25  h          (127 tokens)
        label    .   .  .   .   .   .  .   .  ...  .   .  31

    Chance is 1/20, a loss of ln 20 = 3.0.
    """
    if seq_len < 3 or vocab_size < 2:  # one pair and the query; a key and a value
        raise ValueError(f"pairs format: seq_len must be at least 3 and vocab_size 2, got {seq_len} and {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    n_keys, pairs = vocab_size // 2, (seq_len - 1) // 2
    keys = torch.randint(0, n_keys, (n, pairs), generator=g)  # (n, P)
    table = torch.randint(n_keys, vocab_size, (n, n_keys), generator=g)  # each sequence's key -> value map
    values = torch.gather(table, 1, keys)  # (n, P)
    query = torch.gather(keys, 1, torch.randint(0, pairs, (n, 1), generator=g))  # (n, 1), a key in context
    inputs = torch.cat([torch.stack([keys, values], dim=-1).flatten(1), query], dim=1)  # (n, 2P + 1): k v k v ... q
    labels = torch.full_like(inputs, -100)
    labels[:, -1] = torch.gather(table, 1, query)[:, 0]
    return inputs, labels


def make_h3_data(n, seq_len=128, vocab_size=40, seed=0, train=True):
    """n "h3" sequences -> (inputs, labels), both (n, seq_len + 2) long tensors: H3's associative recall
    as published (safari: src/dataloaders/synthetics.py, generate_assoc_recall and ICLDataModule).

    vocab_size counts two special tokens, the copy prefix "=>" (id vocab_size - 2) and a no-op
    (vocab_size - 1, never drawn), so there are (vocab_size - 2) / 2 keys and as many values. A sequence
    is seq_len // 2 (key, value) pairs from its own random map, then => q v with q a key in context
    (drawn uniformly from all keys, redrawn from those present if absent). Inputs are the tokens but
    the last, labels the tokens but the first: in training every position is labelled with its next
    token (keys are random, so only values and the query's answer can be learned), in test only the
    last (the answer). Every sequence is unique, as in the published code.

        input    c  27  h  31  c  27  ...  m  25  =>  h
        train   27   h 31   c 27   q  ...  25  =>   h  31
        test     .   .  .   .  .   .  ...   .   .   .  31
    """
    if seq_len < 2 or vocab_size < 4:  # one pair; a key, a value and the two special tokens
        raise ValueError(f"h3 format: seq_len must be at least 2 and vocab_size 4, got {seq_len} and {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    n_keys, pairs = (vocab_size - 2) // 2, seq_len // 2
    copy_prefix = vocab_size - 2
    rows = torch.empty(0, 2 * pairs + 3, dtype=torch.long)
    for _ in range(1000):
        if len(rows) >= n:
            break
        m = n - len(rows)
        keys = torch.randint(0, n_keys, (m, pairs), generator=g)  # (m, P)
        table = torch.randint(n_keys, 2 * n_keys, (m, n_keys), generator=g)  # (m, n_keys)
        present = F.one_hot(keys, n_keys).any(1)  # (m, n_keys)
        query = torch.randint(0, n_keys, (m,), generator=g)
        redraw = torch.where(present, torch.rand(m, n_keys, generator=g), -1.0).argmax(-1)  # uniform over present keys
        query = torch.where(present[torch.arange(m), query], query, redraw)[:, None]  # (m, 1)
        seq = torch.cat([torch.stack([keys, torch.gather(table, 1, keys)], -1).flatten(1),
                         torch.full_like(query, copy_prefix), query, torch.gather(table, 1, query)], dim=1)
        rows = torch.cat([rows, seq]).unique(dim=0)  # unique examples (sorted: shuffled below)
    else:
        raise SystemExit(f"error: seq_len={seq_len} and vocab_size={vocab_size} give only {len(rows)} distinct h3 "
                         f"sequences, fewer than the {n} asked: use longer sequences or a larger vocabulary")
    rows = rows[torch.randperm(len(rows), generator=g)[:n]]
    inputs, labels = rows[:, :-1], rows[:, 1:].clone()
    if not train:
        labels[:, :-1] = -100
    return inputs, labels


def make_data(cfg):
    """(x_train, y_train, x_test, y_test) in the configured format."""
    n, v = cfg["seq_len"], cfg["vocab_size"]
    if cfg["format"] == "pairs":
        return (*make_ar_data(cfg["num_train"], n, v, seed=1234), *make_ar_data(cfg["num_test"], n, v, seed=5678))
    return (*make_h3_data(cfg["num_train"], n, v, seed=1234, train=True),  # "h3"
            *make_h3_data(cfg["num_test"], n, v, seed=5678, train=False))


class ARModel(nn.Module):
    """Token + learned position embeddings, n_layer blocks, a linear head.

    With token_shift, position t also adds an embedding of token t-1 (what Zoology's short convolution
    gives its models; the pre-Based linear attentions had none). Then a value's position already
    knows its key, and one attention lookup (query: the current key; match: the positions right after
    earlier copies of it) solves the task. Without it the model must first learn to copy the previous
    token with attention. qk_dim is the q/k head size (see MultiHeadAttention); dropout applies to the
    embeddings and to softmax's weights; window is the one of swa and lolcats.
    """

    def __init__(self, attention="softmax", vocab_size=40, seq_len=127, n_layer=2, d_model=64, n_head=1,
                 mlp_ratio=0, token_shift=True, qk_dim=None, dropout=0.0, window=64, **fmap_options):
        super().__init__()
        self.token_shift = token_shift
        self.tok = nn.Embedding(vocab_size, d_model)
        self.prev = nn.Embedding(vocab_size + 1, d_model) if token_shift else None  # index vocab_size: no previous token
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, attention, mlp_ratio, qk_dim=qk_dim, max_len=seq_len,
                                          attn_dropout=dropout, window=window, **fmap_options) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def embed(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        if self.token_shift:
            prev = F.pad(idx[:, :-1], (1, 0), value=self.prev.num_embeddings - 1)  # (B, T): token t-1
            x = x + self.prev(prev)
        return self.drop(x)

    def forward(self, idx, return_weights=False):
        x = self.embed(idx)
        weights = []
        for block in self.blocks:
            if return_weights:
                weights.append(block.attn.weights(block.ln1(x)))  # (B, H, T, T)
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return (logits, weights) if return_weights else logits


def load_model(path, dev="cpu"):
    """(model, checkpoint): the ARModel that a run with --save_models=true wrote to path, in eval mode, and
    the rest of what it saved (its config, so make_data(ckpt["config"]) gives its data)."""
    ckpt = load_checkpoint(path, dev, kind="train_ar")
    model = ARModel(**ckpt["model_args"]).to(dev)
    model.load_state_dict(ckpt["model"])
    return model.eval(), ckpt


@torch.inference_mode()
def evaluate(model, inputs, labels, batch=500):
    """(accuracy, mean cross-entropy) on the labelled positions (the last one in test)."""
    model.eval()
    correct = total = loss = 0
    for i in range(0, len(inputs), batch):
        x, y = inputs[i:i + batch], labels[i:i + batch]
        logits = model(x)
        mask = y != -100
        correct += (logits.argmax(-1)[mask] == y[mask]).sum().item()
        loss += F.cross_entropy(logits[mask], y[mask], reduction="sum").item()
        total += mask.sum().item()
    model.train()
    return correct / total, loss / total


def answer_positions(x):
    """(N, T) bool: the positions that hold the answer to each sequence's query (its last token): a value
    right after an earlier copy of the query key. Those are where the lookup lands."""
    target = torch.zeros_like(x, dtype=torch.bool)
    target[:, 1:] = x[:, :-1] == x[:, -1:]
    return target


@torch.no_grad()
def lookup_stats(model, x):
    """Where each layer and head looks from the query (the last position) of sequences x (N, T).
    Returns target_mass (L, H), the mean weight on answer_positions; entropy (L, H), the mean entropy
    of the query row in nats; rows (L, H, N, T), the query rows; prev (L, H), the mean weight that a
    position puts on the one before it over every position but the first (the previous-token head
    that an induction head needs when there is no token shift)."""
    model.eval()
    _, weights = model(x, return_weights=True)  # L x (N, H, T, T)
    model.train()
    rows = torch.stack([w[:, :, -1] for w in weights]).transpose(1, 2).float().cpu()  # (L, H, N, T)
    mass = (rows * answer_positions(x).cpu()).sum(-1).mean(-1)  # (L, H)
    prev = torch.stack([w.diagonal(-1, -2, -1).float().mean((0, 2)) for w in weights]).cpu()  # (L, H): w[i, i-1]
    return mass, entropy(rows).mean(-1), rows, prev
