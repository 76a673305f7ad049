"""
probe_ar.py on a saved associative-recall model: each measurement against the weights or the model
computed by hand, layer 0 replaced by its variants, and the linear probe of layer 1's input.
Run: python -m pytest -q test_probe_ar.py
"""
import json

from test_all import run_script  # first: sets TRITON_INTERPRET before triton is imported

import numpy
import pytest
import torch

import ar
import probe_ar
import train_ar


def test_probe_ar_measures_what_it_says(tmp_path, torch_path):
    """probe_ar.py on a saved model: the offsets, the weight on keys, on each pair's own key and on the
    first answer are the layers' own weights (loops over them here); the "previous token" truncations
    are forward passes written out by hand with layer 0 mixing only v[i - 1] (and nothing at the
    query); a full band leaves the weights as they are; the first-occurrence bins are those of a loop;
    and the probe reads the own key (and nothing older) exactly when layer 0 is that previous-token
    copy."""
    cfg = dict(train_ar.config, format="h3", vocab_size=20, seq_len=32, num_train=64, num_test=120, mlp_ratio=2,
               token_shift=False, d_model=32, epochs=1, batch_size=32, target_acc=2.0, save_models=True,
               out_dir=str(tmp_path))
    data = ar.make_data(cfg)  # probe_ar.py makes the test set again from the saved config
    train_ar.train_one("elu", 16, 0, data, cfg, "cpu")
    path = str(tmp_path / "model_elu_F16_seed0.pt")
    out = run_script("probe_ar.py", f"--model={path}", "--num=120")  # as a user runs it: the results go beside the model
    assert "(chance 0.111)" in out  # 9 keys: h3's vocabulary of 20 counts its two special tokens
    result = json.load(open(tmp_path / "probe_model_elu_F16_seed0.json"))
    model, _ = ar.load_model(path)
    x, y = data[2], data[3]
    with torch.no_grad():
        w0 = model(x, return_weights=True)[1][0][:, 0]  # (N, T, T)
    rows = [i for i in range(x.shape[1]) if i % 2 == 1 and x.shape[1] // 2 <= i < 32]
    for d in (0, 1, 5):
        expected = sum(w0[:, i, i - d].mean().item() for i in rows) / len(rows)
        assert result["layer0"][d][0] == pytest.approx(expected, rel=1e-5)
    assert result["uniform"] == pytest.approx(sum(1 / (i + 1) for i in rows) / len(rows), rel=1e-6)
    by_pair = result["layer0_own_key_by_pair"]  # every pair's value, the second half's among them
    assert len(by_pair) == 16
    assert sum(by_pair[p][0] for p in range(8, 16)) / 8 == pytest.approx(result["layer0"][1][0], rel=1e-5)
    for p in (0, 3, 15):
        assert by_pair[p][0] == pytest.approx(w0[:, 2 * p + 1, 2 * p].mean().item(), rel=1e-5)
    with torch.no_grad():
        w1 = model(x, return_weights=True)[1][1][:, 0, -1]  # (N, T): the query row
    firsts = [next(i for i in range(1, 33) if x[n, i - 1] == x[n, -1]) for n in range(120)]
    expected = sum(w1[n, i].item() for n, i in enumerate(firsts)) / 120
    assert result["layer1_first_answer"][0] == pytest.approx(expected, rel=1e-5)
    assert (result["layer1_first_answer"][0] + result["layer1_later_answers"][0]
            == pytest.approx(result["layer1_answer"][2][0], rel=1e-5))
    T = x.shape[1]
    answers = [[a for a in range(1, T - 1) if x[n, a - 1] == x[n, -1]] for n in range(120)]  # the query itself is none
    for d in (-2, 1, 4):  # the query row at the answers + d, the query's own weight never among them
        expected = sum(w1[n, a + d].item() for n in range(120) for a in answers[n] if 0 <= a + d < T - 1) / 120
        assert result["layer1_answer"][probe_ar.AROUND.index(d)][0] == pytest.approx(expected, rel=1e-5, abs=1e-7), d
    on_keys = sum(w0[:, i, 0:i + 1:2].sum(-1).mean().item() for i in rows) / len(rows)
    assert result["layer0_on_keys"][0] == pytest.approx(on_keys, rel=1e-5)
    W = (torch.rand(2, 1, 6, 6) + 0.1).tril()
    W = W / W.sum(-1, keepdim=True)  # every weight >= 0.1 / 6.6, so band's EPS moves them by < 1e-4
    assert torch.allclose(probe_ar.band(W, 6), W, atol=1e-4)
    assert torch.allclose(probe_ar.band(W, 1), torch.eye(6).expand_as(W), atol=1e-4)
    two = probe_ar.band(W, 2)[0, 0]
    assert torch.allclose(two[3, 2:4], W[0, 0, 3, 2:4] / W[0, 0, 3, 2:4].sum(), atol=1e-4) and two[3, :2].sum() == 0

    assert result["truncation"]["as trained"]["all"][1] == ar.evaluate(model.eval(), x, y)[0]
    with torch.no_grad():
        right = (model.eval()(x)[:, -1].argmax(-1) == y[:, -1]).tolist()
    first = [next(p for p in range(16) if x[n, 2 * p] == x[n, -1]) for n in range(120)]  # by a loop
    early = [r for r, p in zip(right, first) if p < 2]
    assert result["truncation"]["as trained"]["0-1"] == [len(early), sum(early) / len(early)]
    block0, block1 = model.blocks
    with torch.no_grad():  # layer 0 with only v[i - 1], by hand, and the same with nothing at the query
        embedded = model.embed(x)
        _, _, v = block0.attn.heads(block0.ln1(embedded))  # (N, 1, T, C)
        prev = torch.cat([v[:, :, :1], v[:, :, :-1]], 2)
        quiet = prev.clone()
        quiet[:, :, -1] = 0
        answers = {}
        for name, mixed in (("previous token", prev), ("previous token but the query", quiet)):
            h = embedded + block0.attn.o(mixed.transpose(1, 2).flatten(2))
            answers[name] = model.head(model.ln_f(block1(h + block0.mlp(block0.ln2(h)))))[:, -1]
            block0.attn.mix = probe_ar.truncated_mix(block0.attn, probe_ar.layer0_variants(x.shape[1])[name])
            assert torch.allclose(model(x)[:, -1], answers[name], atol=1e-5), name
            accuracy = (answers[name].argmax(-1) == y[:, -1]).double().mean().item()
            assert result["truncation"][name]["all"][1] == accuracy, name
        assert not torch.allclose(*answers.values(), atol=1e-3)
    for row in result["truncation"].values():
        assert sum(n for b, (n, _) in row.items() if b != "all") == row["all"][0] == 120
        assert row["0-1"][0] == sum(p < 2 for p in first) and row["8-15"][0] == sum(p >= 8 for p in first)
    planted = probe_ar.probe(model, x, 16, 9)  # layer 0 still the previous-token copy at the values it reads
    with torch.no_grad():  # the probe by hand (numpy's least squares): fitted on the first 60 sequences, scored on the rest
        h = block1.ln1(block0(model.embed(x)))[:, 17:32:2].flatten(0, 1).double().numpy()  # the second half's values
        h = numpy.concatenate([h, numpy.ones((len(h), 1))], 1)
    for d in (1, 3):
        keys = x[:, 17 - d:32 - d:2].flatten().numpy()
        fit = numpy.linalg.lstsq(h[:480], numpy.eye(9)[keys[:480]], rcond=None)[0]
        assert planted[d] == pytest.approx(((h[480:] @ fit).argmax(1) == keys[480:]).mean(), abs=1e-9), d
    assert planted[1] > 0.95 and planted[3] < 0.5 and planted[5] < 0.5, planted
    with torch.no_grad():  # the probe reads layer 1's input after its layer norm: with that zeroed, nothing
        block1.ln1.weight.zero_()
        block1.ln1.bias.zero_()
    assert max(probe_ar.probe(model, x, 16, 9).values()) < 0.5
