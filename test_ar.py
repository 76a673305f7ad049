"""
Associative recall as a user runs it: ar.py's data and model, train_ar.py's stopping rules and runs
(plot_ar.py's tables and merges: test_plot_ar.py; probe_ar.py: test_probe_ar.py). Scripts run in subprocesses (test_all.run_script), on
the fast PyTorch path.
Run: python -m pytest -q test_ar.py
"""
import json
import math
import os
import re

from test_all import HERE, NAMES, run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch
import torch.nn.functional as F

import ar
import configurator
import feature_maps as fm
import train_ar
from attention import attention_weights

def test_ar_data_labels_are_the_recalled_values():
    """Check every label against a plain scan of its sequence; at 4 pairs of 20 keys, a query drawn from
    every key instead of those in context would fail the scan."""
    for n, seq_len in ((20, 128), (200, 10)):
        x, y = ar.make_ar_data(n, seq_len=seq_len, seed=3)
        assert x.shape == (n, seq_len - 1) and x[:, 0:-1:2].max() < 20 and x[:, 1::2].min() >= 20
        for row, lab in zip(x.tolist(), y.tolist()):
            value_of = {}
            for t, tok in enumerate(row):
                assert lab[t] == (value_of.get(tok) if t == len(row) - 1 else -100)  # the query's key is in context
                if t % 2 == 1:
                    assert value_of.setdefault(row[t - 1], tok) == tok  # one value per key in a sequence


def test_h3_data_is_the_published_format():
    """H3's format: pairs, then => q v; every next token labelled in training, only the answer in test;
    the query key is in context and its label is its value there; every example unique."""
    n_keys, prefix = 19, 38
    for train in (True, False):
        x, y = ar.make_h3_data(300, seq_len=16, vocab_size=40, seed=4, train=train)
        assert x.shape == y.shape == (300, 18)
        assert len({tuple(r) for r in x.tolist()}) == 300  # unique (inputs determine the examples here)
        for row, lab in zip(x.tolist(), y.tolist()):
            assert row[-2] == prefix and row[-1] < n_keys and prefix not in row[:-2] and prefix + 1 not in row
            value_of = {}
            for t in range(0, 16, 2):
                assert row[t] < n_keys <= row[t + 1] < 2 * n_keys
                assert value_of.setdefault(row[t], row[t + 1]) == row[t + 1]
            assert lab[-1] == value_of[row[-1]]
            if train:
                assert lab[:-1] == row[1:]  # the next token at every position
            else:
                assert lab[:-1] == [-100] * 17


def test_h3_examples_are_unique_and_refused_when_too_few_exist():
    """One pair of two keys and two values makes 4 distinct sequences (key, its value, => key value): all 4
    come out, each once, and asking for a 5th is a one-line error, not a repeat."""
    x, _ = ar.make_h3_data(4, seq_len=2, vocab_size=6, seed=0)
    assert sorted(map(tuple, x.tolist())) == [(k, v, 4, k) for k in (0, 1) for v in (2, 3)]
    with pytest.raises(SystemExit, match="only 4 distinct h3 sequences"):
        ar.make_h3_data(5, seq_len=2, vocab_size=6, seed=0)


def test_h3_query_is_uniform_over_the_keys_in_context():
    """A query key drawn absent is redrawn uniformly from the keys present (generate_assoc_recall): with two
    distinct keys in context it is the smaller one about half the time, not nearly always (the first present)."""
    x, _ = ar.make_h3_data(4000, seq_len=4, vocab_size=40, seed=6)
    two = x[:, 0] != x[:, 2]  # (N,): two distinct keys in context
    smaller = (x[two, -1] == torch.minimum(x[two, 0], x[two, 2])).double().mean().item()
    assert two.sum() > 3000 and 0.45 < smaller < 0.55


@pytest.mark.parametrize("format", ["pairs", "h3"])
def test_ar_test_set_is_drawn_apart_from_the_training_set(format):
    """make_data draws the test set apart from the training set: no test sequence has the keys of a training
    one, in order (at these sizes a repeat by chance is all but impossible, so one means the same draw)."""
    cfg = dict(format=format, seq_len=16, vocab_size=40, num_train=1000, num_test=200)
    x_train, _, x_test, _ = ar.make_data(cfg)
    assert x_train.shape == (1000, x_test.shape[1]) and len(x_test) == 200
    keys = lambda x: {tuple(r) for r in x[:, 0:14:2].tolist()}  # the first 7 pairs' keys
    assert not keys(x_test) & keys(x_train)


def test_evaluate_and_lookup_stats_leave_the_model_training():
    """Both measure in eval mode (no dropout) and hand the model back in training mode, as training
    continues after them: left in eval mode, dropout would be off for the rest of the run."""
    torch.manual_seed(0)
    model = ar.ARModel("softmax", vocab_size=40, seq_len=15, d_model=16, dropout=0.5)
    x, y = ar.make_ar_data(8, seq_len=16)
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(m.training))
    for measure in (lambda: ar.evaluate(model, x, y), lambda: ar.lookup_stats(model, x)):
        model.train()
        measure()
        assert seen[-1] is False and model.training and all(m.training for m in model.modules())
    hook.remove()


def test_evaluate_is_accuracy_and_mean_loss_over_the_labelled_positions():
    """evaluate against a plain cross-entropy on h3 training labels, every position labelled but the first
    four of one sequence: a mean per sequence instead of per label, or over one batch of 3, would differ."""
    torch.manual_seed(0)
    model = ar.ARModel("softmax", vocab_size=12, seq_len=10, d_model=16)
    x, y = ar.make_h3_data(7, seq_len=8, vocab_size=12, seed=0)
    y[0, :4] = -100  # labels of unequal count per sequence
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    labelled = y != -100
    acc = (logits.argmax(-1)[labelled] == y[labelled]).double().mean().item()
    assert ar.evaluate(model, x, y, batch=3) == pytest.approx((acc, loss), rel=1e-5)


def test_answer_positions_and_the_retrieval_head():
    """answer_positions against a scan; lookup_stats on a stub whose layer 1, head 0 puts all its weight
    on the answers: that head has target mass 1 and entropy log(#answers); a uniform head 1/T of it each.
    The weight on the previous token: 1 for a head that only looks there (layer 1, head 1), and the mean
    of 1/(i + 1) over positions i >= 1 for a uniform head."""
    x, _ = ar.make_ar_data(6, seed=5)
    target = ar.answer_positions(x)
    for row, mask in zip(x.tolist(), target.tolist()):
        assert mask == [t > 0 and row[t - 1] == row[-1] for t in range(len(row))]
    N, T = x.shape

    class Stub(torch.nn.Module):
        def forward(self, idx, return_weights=False):
            uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # (T, T)
            spiky = uniform.clone().expand(N, T, T).clone()
            spiky[:, -1] = target / target.sum(-1, keepdim=True)
            w0 = uniform.expand(N, 2, T, T)
            previous = torch.eye(T).roll(-1, 1).tril().expand(N, T, T).clone()  # row i: all on i - 1
            previous[:, 0, 0] = 1
            w1 = torch.stack([spiky, previous], 1)  # (N, 2, T, T)
            return None, [w0, w1]

    mass, ent, rows, prev = ar.lookup_stats(Stub(), x)
    count = target.sum(-1).double()
    assert mass.shape == ent.shape == prev.shape == (2, 2) and rows.shape == (2, 2, N, T)
    assert abs(prev[1, 1] - 1) < 1e-6
    uniform_prev = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    assert abs(prev[0, 0] - uniform_prev) < 1e-6 and abs(prev[0, 1] - uniform_prev) < 1e-6
    assert mass.argmax().item() == 2 and abs(mass[1, 0] - 1) < 1e-6
    assert abs(ent[1, 0] - count.log().mean()) < 1e-5
    assert abs(mass[0, 0] - (count / T).mean()) < 1e-6 and abs(ent[0, 1] - math.log(T)) < 1e-5


def test_ar_model_shifts_tokens_and_returns_the_weights_it_uses():
    """With token_shift, position t's embedding adds the previous token's (an extra index at t = 0), and
    return_weights gives each layer the attention weights of the input its attention module really gets."""
    torch.manual_seed(0)
    model = ar.ARModel("softmax", vocab_size=10, seq_len=6, d_model=8).eval()
    idx = torch.tensor([[3, 1, 4, 1, 5, 9]])
    shifted = torch.tensor([[10, 3, 1, 4, 1, 5]])
    assert torch.equal(model.embed(idx), model.tok(idx) + model.pos.weight + model.prev(shifted))
    seen = []
    hooks = [b.attn.register_forward_hook(lambda m, args, out: seen.append(m.weights(args[0]))) for b in model.blocks]
    _, weights = model(idx, return_weights=True)
    for h in hooks:
        h.remove()
    assert len(weights) == len(seen) == 2 and all(torch.allclose(w, s) for w, s in zip(weights, seen))


@pytest.mark.parametrize("target", [16, 64])
def test_ar_gives_every_map_the_feature_size_asked(target):
    """qk_dim_for picks the q/k head size whose F is closest to the target; the model's map has that F."""
    for name in ["softmax", *NAMES]:
        D = train_ar.qk_dim_for(name, {}, target)
        F_ = train_ar.feature_size(name, D, {})
        assert all(abs(F_ - target) <= abs(train_ar.feature_size(name, d, {}) - target) for d in range(2, target + 1))
        assert abs(F_ - target) <= {"taylor": 12, "quadratic": 12, "oal": 12, "taylorshift": 12}.get(name, 2), (name, D, F_)
        model = ar.ARModel(name, qk_dim=D)
        if name != "softmax":
            q = torch.randn(1, 1, 5, D)
            assert model.blocks[0].attn.fmap(q, q)[0].shape[-1] == F_
    assert train_ar.state_size("elu", 64, 64, 1, 64, 127) == 64 * 64 + 64
    assert train_ar.state_size("softmax", 64, 64, 2, 64, 127) == 2 * 127 * (64 + 32)
    assert train_ar.state_size("swa", 32, 32, 1, 64, 127, window=40) == 40 * (32 + 64)
    assert train_ar.state_size("swa", 32, 32, 1, 64, 20, window=40) == 20 * (32 + 64)  # a window past the sequence
    assert train_ar.qk_dim_for("hedgehog", {}, target + 1) == target // 2 + 1  # F = 2D: a tie goes to the larger D
    path = train_ar.model_path("taylor", target, 3, dict(train_ar.config, out_dir="d"))  # named by the F it got
    assert path == os.path.join("d", f"model_taylor_F{train_ar.run_sizes('taylor', target, train_ar.config)[3]}_seed3.pt")
    assert path != os.path.join("d", f"model_taylor_F{target}_seed3.pt")


def test_ar_holds_the_window_attentions_to_the_same_state():
    """swa's window cache fills a linear map's state at F (lolcats' with its Hedgehog maps at F / 2) to within
    one token's keys and values, and the model gets that window: the last position's logits do not move when
    tokens out of two layers' reach (2w - 1 tokens back, with the token shift) change, except through
    lolcats' linear part."""
    for name in ("swa", "lolcats"):
        for features in (16, 64):
            _, _, qk, F_, w = train_ar.run_sizes(name, features, dict(train_ar.config))
            assert features * 65 - (qk + 64) < train_ar.state_size(name, F_, qk, 1, 64, 127, w) <= features * 65
            assert F_ == (features // 2 if name == "lolcats" else features)
            torch.manual_seed(0)
            model = ar.ARModel(name, qk_dim=qk, window=w).eval()
            x = torch.randint(0, 40, (1, 127))
            y = torch.cat([(x[:, :127 - 2 * w] + 1) % 40, x[:, 127 - 2 * w:]], 1)  # every token out of reach changed
            assert torch.allclose(model(x)[0, -1], model(y)[0, -1]) == (name == "swa"), (name, features)
    # the sizes the README's table gives: swa a window of 32 at D = 64; lolcats F = 32 (D = 16) and a window of 26
    assert [train_ar.run_sizes(name, 64, dict(train_ar.config))[2:] for name in ("swa", "lolcats")] == [(64, 64, 32), (16, 32, 26)]


def test_exp_normalize_makes_t_a_temperature():
    """exp with normalize=True: the weights of exp(t q_hat) . exp(t k_hat) in float64; doubling W does
    nothing to them (unlike the plain exp, where t W x = (t W) x)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 9, 8, dtype=torch.float64), torch.randn(2, 3, 9, 8, dtype=torch.float64)
    qh, kh = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    A = torch.exp(2.0 * qh) @ torch.exp(2.0 * kh).transpose(-1, -2)
    ref = (A * torch.tril(torch.ones(9, 9))) / (A * torch.tril(torch.ones(9, 9))).sum(-1, keepdim=True)
    fmap = fm.make_feature_map("exp", 8, t=2.0, normalize=True)
    assert torch.allclose(attention_weights(q, k, fmap), ref, atol=1e-12)
    assert torch.allclose(attention_weights(3 * q, 3 * k, fmap), ref, atol=1e-12)
    assert not torch.allclose(attention_weights(3 * q, 3 * k, fm.make_feature_map("exp", 8, t=2.0)),
                              attention_weights(q, k, fm.make_feature_map("exp", 8, t=2.0)), atol=1e-3)


def test_config_files(tmp_path):
    """A config file of literal assignments applies like flags (flags after it win); anything else is refused;
    config/ar_h3.py is valid for train_ar. Boolean flags and layer lists parse as configurator says, or are refused,
    as are a rate of 0, an empty name, a device the machine lacks, and in a file a boolean for an integer or a = b = 1;
    a flag whose value ends in .py stays a flag."""
    path = tmp_path / "c.py"
    path.write_text('"""doc"""\nepochs = 7\nlr = 1  # an int where a float is expected is fine\nformat = "h3"\n')
    cfg = configurator.configure(dict(train_ar.config), [str(path), "--epochs=2"])
    assert (cfg["epochs"], cfg["lr"], cfg["format"]) == (2, 1.0, "h3")
    for flag, value in (("1", True), ("0", False), ("TRUE", True), ("false", False)):  # true, false, 1, 0; any case
        assert configurator.configure(dict(train_ar.config), [f"--plots={flag}"])["plots"] is value
    with pytest.raises(SystemExit, match="expects a boolean"):
        configurator.configure(dict(train_ar.config), ["--plots=yes"])
    assert [configurator.layer_list({"layers": x}, 3) for x in ("all", "2,0")] == [[0, 1, 2], [2, 0]]
    for bad in ("3", "-1", "1,1", "a"):  # layer indices of a 3-layer model: 0..2, each once
        with pytest.raises(SystemExit, match="error: --layers"):
            configurator.layer_list({"layers": bad}, 3)
    with pytest.raises(SystemExit, match="--lr=0.0 is out of range: it must be greater than 0"):  # a rate of 0 learns nothing
        configurator.positive({"lr": 0.0}, "lr")
    with pytest.raises(SystemExit, match="--finetune=: give one of lora, full"):
        configurator.one_of({"finetune": ""}, "finetune", ("lora", "full"))
    assert configurator.configure(dict(train_ar.config), ["--out_dir=runs.py"])["out_dir"] == "runs.py"  # a flag, not a file
    if not torch.cuda.is_available():  # a device the machine lacks is refused, with or without an index
        for name in ("cuda", "cuda:0"):
            with pytest.raises(SystemExit, match="this machine or PyTorch build has no such device"):
                configurator.pick_device(name)
    for bad in ("epochs = 2 + 1\n", "import os\n", "nope = 1\n", "epochs = 'x'\n", "epochs = True\n", "epochs = lr = 1\n"):
        path.write_text(bad)
        with pytest.raises(SystemExit, match="error"):
            configurator.configure(dict(train_ar.config), [str(path)])
    cfg = configurator.configure(dict(train_ar.config), [os.path.join(HERE, "config", "ar_h3.py")])
    assert (cfg["format"], cfg["d_model"], cfg["mlp_ratio"], cfg["token_shift"], cfg["warmup"]) == ("h3", 32, 4, False, 0.1)


def test_writable_refuses_what_cannot_be_written(tmp_path, monkeypatch):
    """configurator.writable, the check of every output path before the work: a folder where a file is wanted,
    a file on the way to a folder, and (read-only places: a stand-in os.access, since root may write anywhere)
    a read-only file or folder; a new path below a writable folder passes, and nothing is created."""
    (tmp_path / "f.json").write_text("{}")
    ok = {"out": str(tmp_path / "new" / "deeper" / "x.json"), "dir": str(tmp_path / "new" / "runs")}
    configurator.writable(ok, "out")
    configurator.writable(ok, "dir", folder=True)
    assert os.listdir(tmp_path) == ["f.json"]
    for cfg, folder, message in [({"out": str(tmp_path)}, False, "is a folder: it must name a file"),
                                 ({"out": str(tmp_path / "f.json" / "x.json")}, False, "f.json is a file, not a folder"),
                                 ({"out": str(tmp_path / "f.json")}, True, "f.json is a file, not a folder")]:
        with pytest.raises(SystemExit, match=message):
            configurator.writable(cfg, "out", folder=folder)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit, match="the file is read-only"):
        configurator.writable({"out": str(tmp_path / "f.json")}, "out")
    with pytest.raises(SystemExit, match=f"{tmp_path} is not writable"):
        configurator.writable({"out": str(tmp_path / "new" / "runs")}, "out", folder=True)


AR_FIELDS = {"attention", "seed", "test_acc", "features", "state_size", "retrieval_entropy", "target_mass"}


def test_train_ar_smoke(tmp_path):
    """Guards: the loop trains (the training loss falls for every attention), the records are what the
    models are (parameter counts against an independent build) and carry the issue's fields, and the
    OAL regrouping runs."""
    out = run_script("train_ar.py", "--attentions=softmax,exp_norm_t2,oal", "--num_train=256", "--num_test=32",
                     "--epochs=3", "--batch_size=32", "--target_acc=2", f"--out_dir={tmp_path}")
    assert "oal: layer groups per head" in out
    records = json.load(open(tmp_path / "ar.json"))
    assert [r["attention"] for r in records] == ["softmax", "exp_norm_t2", "oal"]
    for r in records:
        line = rf"{r['attention']} F={r['features']} seed 0 \| epoch \d: train loss ([\d.]+)"
        losses = [float(x) for x in re.findall(line, out)]
        assert len(losses) == 3 and losses[-1] < losses[0], (r["attention"], losses)
        name, kw = train_ar.VARIANTS.get(r["attention"], (r["attention"], {}))
        assert r["params"] == sum(p.numel() for p in ar.ARModel(name, qk_dim=r["qk_dim"], **kw).parameters())
        assert AR_FIELDS <= set(r) and 0 <= r["test_acc"] <= 1 and 0 < r["retrieval_entropy"] <= math.log(127)
        assert 0 <= r["target_mass"] <= 1 and len(r["query_row"]) == 127
        assert len(r["prev_mass_per_epoch"]) == len(r["target_mass_per_epoch"]) == 3  # (epochs, layers, heads)
        assert torch.tensor(r["prev_mass_per_epoch"]).shape[1:] == torch.tensor(r["prev_mass_per_head"]).shape == (2, 1)
    assert {r["features"] for r in records} == {64, 66}
    for png in ("ar_entropy", "ar_lookup", "ar_curves", "ar_runs", "ar_heads"):
        assert (tmp_path / f"{png}.png").exists()


def test_train_ar_published_recipe_and_capacity_sweep(tmp_path):
    """config/ar_h3.py on a tiny budget: its data reach the model (dense train labels, last-only test), the
    schedule warms up and decays, and the records are complete; a two-size sweep makes the capacity figure."""
    out = run_script("train_ar.py", "config/ar_h3.py", "--attentions=softmax,hedgehog", "--num_train=64",
                     "--num_test=16", "--epochs=2", "--eval_every=1", f"--out_dir={tmp_path}")
    records = json.load(open(tmp_path / "ar.json"))
    assert "epoch 2" in out and [r["features"] for r in records] == [32, 64]  # softmax's D = 32, Hedgehog's 2D
    for r in records:
        assert AR_FIELDS <= set(r) and r["steps"] == 4
        assert r["state_size"] == (130 * 64 if r["attention"] == "softmax" else 64 * 32 + 64)
    run_script("train_ar.py", "--attentions=elu", "--features=8,16", "--num_train=64", "--num_test=16", "--epochs=1",
               f"--out_dir={tmp_path}")
    records = json.load(open(tmp_path / "ar.json"))
    assert [(r["features"], r["state_size"]) for r in records] == [(8, 8 * 64 + 8), (16, 16 * 64 + 16)]
    assert (tmp_path / "ar_capacity.png").exists()


def test_train_ar_max_minutes_stops_after_the_epoch():
    """--max_minutes ends a run after the epoch in which the time passed; 0 means no limit."""
    data = (*ar.make_ar_data(64, seed=1), *ar.make_ar_data(16, seed=2))
    for minutes, epochs in ((1e-9, 1), (0.0, 3)):
        cfg = dict(train_ar.config, epochs=3, batch_size=32, eval_every=1, target_acc=2.0, max_minutes=minutes)
        record = train_ar.train_one("softmax", 16, 0, data, cfg, "cpu")
        assert record["epochs"] == epochs and len(record["test_acc_per_epoch"]) == epochs
        assert [s for s, _ in record["curve"]] == list(range(0, 2 * epochs + 1))  # 2 steps an epoch, curve at each


def test_train_ar_keeps_the_finished_runs_when_stopped(tmp_path, monkeypatch):
    """ar.json is written after each run, so a sweep stopped by Ctrl-C during its second run keeps the first."""
    def run_then_stop(attention, *args):
        if attention == "elu":
            raise KeyboardInterrupt
        return {"attention": attention, "seed": 0}
    monkeypatch.setattr(train_ar, "train_one", run_then_stop)
    cfg = dict(train_ar.config, attentions="softmax,elu", num_train=8, num_test=8, workers=1, device="cpu",
               out_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        train_ar.main(cfg)
    assert [(r["attention"], r["device"]) for r in json.load(open(tmp_path / "ar.json"))] == [("softmax", "cpu")]


def test_train_ar_saves_models_that_load_back(tmp_path, torch_path):
    """--save_models writes each run's final model; load_model rebuilds it with its map's settings (exp_t2's
    t = 2), so the loaded model gives the run's own recorded attention weights. Another kind of file is a
    one-line error."""
    data = (*ar.make_ar_data(64, seed=1), *ar.make_ar_data(200, seed=2))
    cfg = dict(train_ar.config, epochs=1, batch_size=32, target_acc=2.0, save_models=True, out_dir=str(tmp_path))
    record = train_ar.train_one("exp_t2", 16, 3, data, cfg, "cpu")
    model, ckpt = ar.load_model(tmp_path / "model_exp_t2_F16_seed3.pt")
    assert ckpt["config"] == cfg and ckpt["epochs"] == 1
    mass, ent, _, prev = ar.lookup_stats(model, data[2][:200])
    assert mass.tolist() == record["target_mass_per_head"] and prev.tolist() == record["prev_mass_per_head"]
    assert ent.tolist() == record["entropy_per_head"]
    assert ar.evaluate(model, data[2], data[3])[0] == record["test_acc"]
    _, weights = model(data[2][:1], return_weights=True)  # Fig. 2's row: the retrieval head on the first test sequence
    row = weights[record["retrieval_layer"]][0, record["retrieval_head"], -1]
    assert record["query_row"] == pytest.approx(row.tolist(), abs=1e-6)
    first = data[2][0].tolist()  # the answers: the positions right after an earlier copy of the query key
    assert record["answer_positions"] == [t for t in range(1, len(first)) if first[t - 1] == first[-1]]
    torch.save({"kind": "train_gpt"}, tmp_path / "gpt.pt")
    with pytest.raises(SystemExit, match="is not a train_ar.py checkpoint"):
        ar.load_model(tmp_path / "gpt.pt")


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_train_ar_resume_carries_a_run_on_exactly(tmp_path, dev, torch_path):
    """A run stopped by its time cap after epoch 1 and carried on (--init_from=resume) is the run that was
    never stopped: the same record to the last digit (dropout and the shuffle draw from restored random
    states, AdamW and the warm-up schedule go on from theirs), its time aside; on a GPU too, where dropout
    draws from the GPU's random state. A finished run is not trained further. A file with other settings,
    or with a model only, is a one-line error."""
    data = (*ar.make_ar_data(64, seed=1), *ar.make_ar_data(16, seed=2))
    cfg = dict(train_ar.config, epochs=3, batch_size=16, eval_every=3, target_acc=2.0, dropout=0.1, warmup=0.5,
               save_models=True)
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    straight = train_ar.train_one("hedgehog", 16, 0, data, dict(cfg, out_dir=str(tmp_path / "a")), dev)
    cut = dict(cfg, out_dir=str(tmp_path / "b"), max_minutes=1e-9)
    assert train_ar.train_one("hedgehog", 16, 0, data, cut, dev)["epochs"] == 1
    carried = train_ar.train_one("hedgehog", 16, 0, data, dict(cut, max_minutes=0.0, init_from="resume"), dev)
    assert carried["seconds"] > 0 and {**carried, "seconds": 0} == {**straight, "seconds": 0}
    again = train_ar.train_one("hedgehog", 16, 0, data, dict(cut, max_minutes=0.0, init_from="resume"), dev)
    assert {**again, "seconds": 0} == {**straight, "seconds": 0}  # all 3 epochs done: nothing more to train
    path = tmp_path / "b" / "model_hedgehog_F16_seed0.pt"
    with pytest.raises(SystemExit, match=r"trained with lr=0.003, not lr=0.001; a run carries on"):
        train_ar.saved_run(str(path), dict(cut, lr=1e-3, init_from="resume"))
    args = ("train_ar.py", "--attentions=hedgehog", "--features=16", "--init_from=resume", f"--out_dir={tmp_path / 'b'}")
    assert "needs --save_models=true" in run_script(*args, ok=False)
    err = run_script(*args, "--save_models=true", "--epochs=3", "--batch_size=16", "--eval_every=3", ok=False)
    assert "trained with dropout=0.1, not dropout=0.0" in err  # the first setting that differs, before any work
    ckpt = torch.load(path, weights_only=False)
    del ckpt["train_state"]
    torch.save(ckpt, path)
    with pytest.raises(SystemExit, match="holds a model but not its optimiser"):
        train_ar.saved_run(str(path), dict(cut, init_from="resume"))


def test_train_ar_early_stopping_watches_the_test_loss(capsys, monkeypatch):
    """patience counts the epochs after the warm-up without a lower test loss (Hedgehog App. B.1), and that
    loss is the answer's cross-entropy. With lr 0 nothing changes, so patience 2 ends the run after epoch 3
    (after epoch 5 with a warm-up of half the steps), and the loss is that of the untrained model, built again
    here, as is the training loss printed each epoch (the mean over every labelled position). The epochs watch
    the first 500 test sequences, the record's accuracy is over all of them."""
    data = (*ar.make_h3_data(64, seq_len=16, vocab_size=12, seed=1),
            *ar.make_h3_data(600, seq_len=16, vocab_size=12, seed=2, train=False))
    cfg = dict(train_ar.config, format="h3", vocab_size=12, epochs=6, batch_size=32, target_acc=2.0, patience=2, lr=0.0)
    calls = []

    def spy(model, x, y):  # the real evaluate, noting how many sequences it was given
        calls.append((len(x), ar.evaluate(model, x, y)))
        return calls[-1][1]
    monkeypatch.setattr(train_ar, "evaluate", spy)
    record = train_ar.train_one("softmax", 16, 0, data, cfg, "cpu")
    assert record["epochs"] == 3 and len(record["test_loss_per_epoch"]) == 3
    assert [n for n, _ in calls] == [500] * 4 + [600] and record["test_acc"] == calls[-1][1][0]
    torch.manual_seed(0)
    model = ar.ARModel("softmax", 12, 18, qk_dim=16).eval()
    x_train, y_train, x_test, y_test = data
    with torch.no_grad():
        loss = F.cross_entropy(model(x_test[:500])[:, -1], y_test[:500, -1]).item()
        train_loss = F.cross_entropy(model(x_train).flatten(0, 1), y_train.flatten()).item()
    assert record["test_loss_per_epoch"] == pytest.approx([loss] * 3, rel=1e-6)
    printed = re.findall(r"train loss ([\d.]+)", capsys.readouterr().out)
    assert printed == [f"{train_loss:.3f}"] * 3
    # the warm-up's epochs do not count (2 steps an epoch, 6 of 12 warm: epochs 2 and 3 end within it), and
    # target_acc is reached when the accuracy equals it
    assert train_ar.train_one("softmax", 16, 0, data, dict(cfg, warmup=0.5), "cpu")["epochs"] == 5
    acc = record["test_acc_per_epoch"][0]
    assert train_ar.train_one("softmax", 16, 0, data, dict(cfg, patience=0, target_acc=acc), "cpu")["epochs"] == 1


def test_steps_to_a_level_is_the_first_step_that_reaches_it():
    """The table's "steps to 50%": the first step whose accuracy reaches the level, equal included."""
    curve = [(0, 0.05), (25, 0.5), (50, 0.9), (75, 0.4)]
    assert [train_ar.steps_to(curve, level) for level in (0.5, 0.9, 0.95)] == [25, 50, None]


def test_train_ar_learning_rate_warms_up_then_decays():
    """lr_factor by hand: 1 without warm-up; with 4 warm steps of 12, (s + 1) / 4 up to 1, then (12 - s) / 8."""
    assert [train_ar.lr_factor(s, 0, 12) for s in (0, 5, 11)] == [1.0, 1.0, 1.0]
    assert [train_ar.lr_factor(s, 4, 12) for s in (0, 1, 3, 4, 8, 11)] == [0.25, 0.5, 1.0, 1.0, 0.5, 0.125]


@pytest.mark.parametrize("rule,rising,epochs", [("loss", False, 6), ("accuracy", False, 3), ("loss", True, 3),
                                                ("accuracy", True, 6)])
def test_train_ar_early_stopping_tells_the_rules_apart(rule, rising, epochs, monkeypatch):
    """An evaluation whose loss falls every time while its accuracy stays put: the loss rule never runs
    out of patience (all 6 epochs), the accuracy rule stops after epoch 1 + patience 2. One whose accuracy
    rises while its loss stays put: the other way round."""
    calls = []

    def scripted(model, inputs, labels, batch=500):
        calls.append(None)
        return (1 - 1.0 / len(calls), 1.0) if rising else (0.5, 1.0 / len(calls))

    monkeypatch.setattr(train_ar, "evaluate", scripted)
    data = (*ar.make_ar_data(32, seq_len=9, seed=1), *ar.make_ar_data(8, seq_len=9, seed=2))
    cfg = dict(train_ar.config, epochs=6, batch_size=32, eval_every=1000, target_acc=2.0, patience=2, early_stop=rule)
    assert train_ar.train_one("softmax", 8, 0, data, cfg, "cpu")["epochs"] == epochs


def test_scripts_reject_unknown_settings():
    for args in (["--epoch=3"], ["--epochs=three"], ["--attentions=softmax,nope"], ["--early_stop=acc"]):
        assert "error" in run_script("train_ar.py", *args, ok=False)


@pytest.mark.parametrize("name", ["softmax", "swa", "lolcats", *train_ar.VARIANTS] + NAMES)
def test_every_attention_trains_in_the_ar_model(name, torch_path):
    """train_ar.py's model and names (its variants included): a few steps on one batch lower the loss."""
    fmap_name, kw = train_ar.VARIANTS.get(name, (name, {}))
    torch.manual_seed(0)
    model = ar.ARModel(fmap_name, **kw)
    x, y = ar.make_h3_data(16, seq_len=124, seed=0)  # 126 positions
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_train_ar_divergence_is_recorded_and_fails(tmp_path):
    err = run_script("train_ar.py", "--attentions=softmax", "--num_train=64", "--num_test=8", "--seq_len=16", "--epochs=1",
                     "--lr=1e9", "--workers=1", "--plots=false", f"--out_dir={tmp_path}", ok=False)
    assert "1 run(s) stopped on a non-finite loss" in err, err
    assert "step" in json.load(open(tmp_path / "ar.json"))[0]["stopped"]
