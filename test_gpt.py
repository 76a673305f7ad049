"""
The GPT of train_gpt.py and convert.py (gpt.py): every attention trains in it and decodes token by token as
its parallel forward does, generate's temperature and length, and the documented data split, initialisation
and evaluation, each by hand. The scripts that use it run in test_scripts.py and test_convert.py.
Run: python -m pytest -q test_gpt.py
"""
from test_all import NAMES, step_by_step, tiny_gpt  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch
import torch.nn.functional as F

import gpt
from attention import Block


def test_block_by_hand():
    """The pre-norm block: x + attn(ln1(x)), then + W2 gelu(W1 ln2(.) + b1) + b2 with mlp_ratio * C hidden
    units; without an MLP (mlp_ratio = 0) the attention alone. step() gives the same, token by token."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    for ratio in (3, 0):
        block = Block(16, 2, "elu", mlp_ratio=ratio)
        with torch.no_grad():  # the two layer norms apart from their start, where they are the same function
            for p in block.parameters():
                p.add_(0.1 * torch.randn_like(p))
        h = x + block.attn(F.layer_norm(x, (16,), block.ln1.weight, block.ln1.bias))
        if ratio:
            lin1, lin2 = block.mlp[0], block.mlp[2]
            assert lin1.weight.shape == (48, 16)
            u = F.layer_norm(h, (16,), block.ln2.weight, block.ln2.bias)
            h = h + F.gelu(u @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
        assert torch.allclose(block(x), h, atol=1e-6)
        assert torch.allclose(step_by_step(block, x), h, atol=1e-5)


@pytest.mark.parametrize("name", ["softmax"] + NAMES)
def test_every_attention_trains_and_decodes_in_the_gpt(name, torch_path):
    """train_gpt.py's model with each attention, as the script builds it (no extra arguments: cosFormer
    must get its fixed length from the GPT): a few AdamW steps on one batch lower the loss, then decoding
    token by token (KV cache or (S, z) state) gives the parallel forward's logits, and generate() runs."""
    model = tiny_gpt(name)
    idx = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    model.double()
    logits, _ = model(idx[:, :20])
    caches, steps = [None, None], []
    for t in range(20):
        step_logits, caches = model.step(idx[:, t], t, caches)
        steps.append(step_logits)
    assert torch.allclose(torch.stack(steps, 1), logits, atol=1e-6)
    assert model.generate(idx[:, :3], 5).shape == (4, 8)


def test_generate_samples_at_its_temperature_up_to_block_size_plus_one():
    """GPT.generate divides the logits by the temperature (near 0: the most likely token each time, checked
    against the parallel forward's argmax) and stops at block_size + 1 tokens, where learned positions end."""
    model = tiny_gpt("hedgehog").double()
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, 6, temperature=1e-9)
    assert torch.equal(out[:, :3], prompt) and out.shape == (2, 9)
    greedy = model(out[:, :-1])[0].argmax(-1)  # (2, 8): the most likely next token at each position
    assert torch.equal(out[:, 3:], greedy[:, 2:])
    assert model.generate(prompt, 100).shape == (2, model.block_size + 1)


def test_gpt_data_split_init_and_evaluation_as_documented(tmp_path, monkeypatch):
    """gpt.py's documented choices, by hand: prepare() keeps the last 10% of the tokens for validation,
    remaps ids to the sorted ids that occur and refuses a part of block_size + 1 tokens or fewer; GPT() starts as GPT-2 (weights N(0, 0.02), zero biases, a tied
    head); evaluate() is the mean loss over `iters` batches drawn from a generator seeded 1234."""
    class Chars:  # a tokenizer whose ids are the characters' code points
        name = "chars"

        def encode_ordinary(self, text):
            return [ord(c) for c in text]

    monkeypatch.setattr(gpt, "get_encoding", lambda name: Chars())
    text = "".join(chr(97 + (i * 7) % 13) for i in range(1000))
    (tmp_path / "t.txt").write_text(text)
    train, val, vocab, _ = gpt.prepare(str(tmp_path / "t.txt"), "chars", 8)
    assert (len(train), len(val)) == (900, 100)
    assert vocab.tolist() == sorted(set(map(ord, text)))
    assert "".join(chr(i) for i in vocab[torch.cat([train, val])].tolist()) == text
    assert len(gpt.prepare(str(tmp_path / "t.txt"), "chars", 98)[1]) == 100  # each part holds more than block_size + 1
    with pytest.raises(SystemExit, match="1000 tokens leave 100 for validation, but a window of block_size=99 needs"):
        gpt.prepare(str(tmp_path / "t.txt"), "chars", 99)

    torch.manual_seed(0)
    model = gpt.GPT(vocab_size=500, block_size=64, n_layer=2, n_head=4, d_model=128, bias=True)
    assert model.head.weight is model.tok.weight
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert not p.any(), name
        elif p.dim() == 2:
            assert abs(p.std().item() - 0.02) < 0.002, (name, p.std().item())

    gen = torch.Generator().manual_seed(1234)
    by_hand = [model(*gpt.get_batch(train, 64, 3, gen, "cpu"))[1].item() for _ in range(4)]
    assert gpt.evaluate(model, train, 3, 4, "cpu") == pytest.approx(sum(by_hand) / 4, rel=1e-6)
    assert gpt.evaluate(model, train, 3, 4, "cpu") == pytest.approx(sum(by_hand) / 4, rel=1e-6)  # the same batches


def test_get_batch_windows_and_their_targets():
    """Targets are the inputs one token on; starts are uniform over 0 .. len - block_size - 2 (the docstring:
    the last token is never a target)."""
    ids = torch.arange(100, 110)
    x, y = gpt.get_batch(ids, 4, 2000, torch.Generator().manual_seed(0), "cpu")
    assert x.shape == y.shape == (2000, 4) and torch.equal(y, x + 1) and torch.equal(x - x[:, :1], torch.arange(4).expand(2000, 4))
    counts = torch.bincount(x[:, 0] - 100)
    assert len(counts) == 5 and counts.min() > 300  # starts 0..4, each about 400 times
