"""
The benchmarks as a user runs them: bench_kernel.py (its CPU timings, the closed form both ways, a planted
error found by its check, whose oracle sees the bfloat16 inputs the backends get), report_kernel.py (the GPU
report's bookkeeping on tiny sizes, its crossovers, fla's layout through a stand-in, a method that fails, a
report stopped part-way, its split of our forward into passes), decode.py (its cache sizes, and its timing and
summary from scripted clocks), sweep_kernel.py (each launch setting run as it records it, in the Triton
interpreter, and one that fails) and report_gpu.sh (every part in order, each stopped at its time limit).
Scripts run in subprocesses (test_all.run_script), on the fast PyTorch path.
Run: python -m pytest -q test_bench.py
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

from test_all import DEV, HERE, needs_triton, run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

import bench_kernel
import configurator
import decode
import feature_maps
import kernel
import report_kernel
from attention import MultiHeadAttention
from test_docs import script_settings


@pytest.fixture
def report_on_cpu(monkeypatch):
    """The report's bookkeeping on the CPU whatever the machine has (a GPU would time, and call, more)."""
    monkeypatch.setattr(report_kernel, "_device", lambda: ("cpu", "cpu", torch.float32))


def test_kernel_benchmark_smoke(tmp_path):
    out = run_script("bench_kernel.py", "--lengths=128,200", "--heads=2", "--dim=16", "--features=16", "--repeats=1",
                     f"--out={tmp_path / 'kernel.json'}", cpu=True)
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
    run_script("report_kernel.py", "--shapes=1x2x8,1x1x16", "--families=hedgehog,elu,taylor,oal",
               "--lengths=64,96", "--repeats=1", "--max_gib=0.00005", "--bandwidth_tbs=4.8", f"--out={tmp_path / 'r.json'}",
               cpu=True)
    r = json.load(open(tmp_path / "r.json"))
    assert r["bandwidth_tbs"] == 4.8  # given; else from the GPU's name, and no memory bound for a GPU not in the table
    gpus = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "cpu")
    assert [report_kernel.peak_bandwidth({"bandwidth_tbs": 0.0}, gpu) for gpu in gpus] == [3.35, 4.8, 2.0, 1.555, None]
    errors = r["check_max_rel_error"]
    assert set(errors) == {"torch, float32", "torch, bfloat16", "torch, float32, closed form"}
    assert r["fla"] is (importlib.util.find_spec("fla") is not None)  # fla, where installed, fails on a CPU: a row error
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
    assert (tmp_path / "r.png").exists() or configurator.pyplot() is None  # the figure, where matplotlib is


def test_device_report_checks_the_sizes_it_times():
    """On a GPU --check=timed covers the (F, Dv) of each family at each shape's D that the build check covers
    (Hedgehog 2D, 1+ELU D, Taylor and OAL 1 + D + D(D+1)/2), and the closed form's (D, SQ, Dv) of Taylor
    (2 terms) and OAL (6); --check=all every build-checked size."""
    timed = lambda shapes, families: report_kernel.check_sizes(dict(check="timed", shapes=shapes, families=families))
    assert timed("1x12x64", "hedgehog,elu") == ([(128, 64), (64, 64)], [])
    assert timed("1x12x64,8x32x128", "hedgehog,taylor,oal") == ([(128, 64), (2145, 64), (256, 128)], [(64, 2, 64), (64, 6, 64)])
    every = report_kernel.check_sizes(dict(check="all"))
    assert len(every[0]) == len(kernel.BUILD_F) * len(kernel.BUILD_DV) and (2145, 64) in every[0]
    assert len(every[1]) == len(kernel.BUILD_SQUARES) * len(kernel.BUILD_DV) and (64, 6, 128) in every[1]


def test_device_report_crossovers():
    """The crossover is where ours stays at least as fast as FlashAttention (a tie counts) at every longer length
    timed: a length that wins once and then loses again does not count. Per shape and family, eager and graphed."""
    row = lambda T, s, g=None, family="hedgehog": dict(shape="1x12x64", family=family, T=T, speedup_vs_flash_fwd=s,
                                                     **({} if g is None else {"graph_speedup_vs_flash_fwd": g}))
    rows = [row(1024, 0.4, 0.9), row(2048, 1.1, 1.5), row(4096, 0.9, 2.0), row(8192, 1.0, 3.0), row(32768, 4.9, 6.1),
            row(1024, 0.3, family="elu"), row(32768, 0.8, family="elu"),
            dict(shape="1x12x64", family="oal", T=1024, skipped="x")]
    c = report_kernel.crossovers(rows)
    assert report_kernel.crossovers(rows[::-1]) == c  # rows in any order (--lengths=32768,1024 times them so)
    assert c["1x12x64 hedgehog"] == dict(crossover_T=8192, graph_crossover_T=2048, longest_T=32768, speedup_at_longest=4.9)
    assert c["1x12x64 elu"] == dict(crossover_T=None, longest_T=32768, speedup_at_longest=0.8)  # no graph timings there
    assert "1x12x64 oal" not in c


@needs_triton
def test_device_report_times_our_triton_kernels_and_skips_sizes_not_build_checked(tmp_path):
    """Where Triton runs (a GPU; here its interpreter) "ours" is the Triton kernel: a row also gives pass 1's
    time, and a size whose code the build check has not compiled (Dv = 1) is skipped, not run."""
    cfg = dict(check="timed", shapes="1x2x8,1x1x1", families="hedgehog", lengths="64", repeats=1, max_gib=40.0,
               out=str(tmp_path / "r.json"), bandwidth_tbs=0.0)
    ran, skipped = report_kernel.device_report(cfg)
    assert json.load(open(tmp_path / "r.json"))["ours"] == "triton" and ran["ours_pass1_ms"] > 0
    assert skipped["skipped"] == "not build-checked" and "ours_fwd_ms" not in skipped


def test_device_report_times_fla_on_its_layout(tmp_path, monkeypatch, report_on_cpu):
    """fla's chunk_linear_attn (here a stand-in that checks what it gets) takes our qf, kf, v as [B, T, H, K],
    with scale 1 and its normalisation, and the row gives our forward's time as a multiple of its own."""
    seen = []

    def fake_fla(q, k, v, scale, normalize):
        seen.append((q.shape, k.shape, v.shape, scale, normalize))
        y = bench_kernel.reference(*(x.transpose(1, 2) for x in (q, k, v)))  # ours, computed on fla's layout
        return y.transpose(1, 2), None
    monkeypatch.setattr(report_kernel, "fla_linear_attention", lambda: fake_fla)
    cfg = dict(check="timed", shapes="1x2x8", families="elu", lengths="64", repeats=1, max_gib=40.0,
               out=str(tmp_path / "r.json"), bandwidth_tbs=0.0)
    row, = report_kernel.device_report(cfg)
    assert set(seen) == {((1, 64, 2, 8), (1, 64, 2, 8), (1, 64, 2, 8), 1.0, True)}
    assert row["ours_vs_fla_fwd"] == pytest.approx(row["ours_fwd_ms"] / row["fla_fwd_ms"]) and row["fla_fwd_bwd_ms"] > 0
    assert json.load(open(tmp_path / "r.json"))["fla"] is True


def test_device_report_keeps_its_rows_when_stopped(tmp_path, monkeypatch, report_on_cpu):
    """A report stopped part-way (a time limit, Ctrl-C) has saved every row it finished: here the 7th
    timing raises, in the second row (the first takes flash's and ours' forward and forward+backward)."""
    calls = []
    real = report_kernel._time

    def timer(fn, repeats):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(fn, repeats)
    monkeypatch.setattr(report_kernel, "_time", timer)
    out = tmp_path / "r.json"
    cfg = dict(check="timed", shapes="1x2x8", families="hedgehog", lengths="64,96,128", repeats=1, max_gib=40.0,
               out=str(out), bandwidth_tbs=4.8)
    with pytest.raises(KeyboardInterrupt):
        report_kernel.device_report(cfg)
    rows = json.load(open(out))["rows"]
    assert [x["T"] for x in rows] == [64] and rows[0]["ours_fwd_bwd_ms"] > 0


def test_device_report_records_a_method_that_fails_and_goes_on(tmp_path, monkeypatch, report_on_cpu):
    """A peer that refuses a size (fla at F = 2145) gets its error in the row, and the row the rest of its
    times; when FlashAttention or ours fails, the row is saved without a speed-up and the report goes on."""
    def refuses(*args, **kwargs):
        raise ValueError("F too large")
    monkeypatch.setattr(report_kernel, "fla_linear_attention", lambda: refuses)
    cfg = dict(check="timed", shapes="1x2x8", families="elu", lengths="64,96", repeats=1, max_gib=40.0,
               out=str(tmp_path / "r.json"), bandwidth_tbs=0.0)
    rows = report_kernel.device_report(cfg)
    assert [(x["fla_error"], "fla_fwd_ms" in x, "speedup_vs_flash_fwd" in x) for x in rows] == \
        [("ValueError: F too large", False, True)] * 2
    monkeypatch.setattr(report_kernel, "flash", refuses)
    rows = report_kernel.device_report(cfg)
    assert [(x["flash_error"], "ours_fwd_ms" in x, "speedup_vs_flash_fwd" in x) for x in rows] == \
        [("ValueError: F too large", True, False)] * 2
    assert json.load(open(tmp_path / "r.json"))["rows"] == rows


def test_device_report_times_the_closed_form_as_ours(tmp_path, monkeypatch, report_on_cpu):
    """For Taylor and OAL, "ours" is our kernel with the closed form (squares) and "ours_features" the same
    without it; the other families have no closed form. A stand-in clock returns 1 ms for a call that used
    the closed form and 2 ms for one that did not."""
    used = []
    real = report_kernel.causal_linear_attention

    def spy(*args, squares=None, **kwargs):
        used.append(squares is not None)
        return real(*args, squares=squares, **kwargs)

    def clock(fn, repeats):
        used.clear()
        fn()
        return 1e-3 if any(used) else 2e-3
    monkeypatch.setattr(report_kernel, "causal_linear_attention", spy)
    monkeypatch.setattr(report_kernel, "_time", clock)
    cfg = dict(check="timed", shapes="1x2x8", families="hedgehog,taylor,oal", lengths="64", repeats=1, max_gib=40.0,
               out=str(tmp_path / "r.json"), bandwidth_tbs=0.0)
    got = {x["family"]: (x["ours_fwd_ms"], x.get("ours_features_fwd_ms")) for x in report_kernel.device_report(cfg)}
    assert got == {"hedgehog": (2.0, None), "taylor": (1.0, 2.0), "oal": (1.0, 2.0)}


def test_the_check_reports_the_worst_error_of_y_and_every_gradient(monkeypatch):
    """bench_kernel.check against a backend with a planted fault: at F = 16 only, v's gradient 1% too large
    (the forward unchanged). The check reports that 1% for the case, though y is right and the other shape,
    checked after it, is clean; the closed form (F = 45) stays clean."""
    real = bench_kernel.causal_linear_attention

    def faulty(qf, kf, v, backend, squares=None):
        if qf.shape[-1] == 16:
            v = v + 0.01 * (v - v.detach())  # the same values; d/dv is 1.01 times the true one
        return real(qf, kf, v, backend=backend, squares=squares)
    monkeypatch.setattr(bench_kernel, "causal_linear_attention", faulty)
    worst = bench_kernel.check("cpu", [(16, 8), (8, 8)], [(8, 6, 8)], T=64)
    assert worst["torch, float32"] == pytest.approx(0.01, rel=1e-3)
    assert worst["torch, bfloat16"] >= 0.0099 and worst["torch, float32, closed form"] < 1e-5


def test_the_check_holds_bfloat16_to_the_inputs_it_gives(monkeypatch):
    """The oracle of a bfloat16 case sees the rounded qf, kf and v that the backend gets, to the bit. Fed v
    unrounded instead, it would charge the backend bfloat16's rounding of v (2e-3), which no error bound of
    the check can tell from a kernel's own (its gradients come back in bfloat16, rounded as much)."""
    seen = {"oracle": [], "backend": []}
    real_reference, real_attention = bench_kernel.reference, bench_kernel.causal_linear_attention

    def oracle(qf, kf, v):
        seen["oracle"].append([x.detach().clone() for x in (qf, kf, v)])
        return real_reference(qf, kf, v)

    def backend(qf, kf, v, backend, squares=None):
        seen["backend"].append([x.detach().clone() for x in (qf, kf, v)])
        return real_attention(qf, kf, v, backend=backend, squares=squares)
    monkeypatch.setattr(bench_kernel, "reference", oracle)
    monkeypatch.setattr(bench_kernel, "causal_linear_attention", backend)
    backends = len(bench_kernel.check("cpu", [(16, 8)], T=64)) // 2  # torch, and triton in the interpreter
    assert [xs[0].dtype for xs in seen["backend"]] == [torch.float32] * backends + [torch.bfloat16] * backends
    assert len(seen["oracle"]) == 2
    for i, given in enumerate(seen["backend"]):  # each case's oracle, then its backends in turn
        oracle = seen["oracle"][i // backends]
        assert all(x.dtype == torch.float64 and torch.equal(x, y.double()) for x, y in zip(oracle, given))


def test_closed_form_benchmark_labels_its_columns(tmp_path, monkeypatch):
    """bench_kernel.py --closed_form=true: "closed_form_ms" is the time with the closed form (FeatureMap.scores
    from it, or the fallback given squares) and "features_ms" without; a stand-in clock says which ran."""
    used = []
    real_attention, real_scores = bench_kernel.causal_linear_attention, feature_maps.FeatureMap.scores

    def attention(*args, squares=None, **kwargs):
        used.append(squares is not None)
        return real_attention(*args, squares=squares, **kwargs)

    def scores(self, q, k):
        used.append(True)
        return real_scores(self, q, k)

    def clock(fn, repeats):
        used.clear()
        fn()
        return 1e-3 if any(used) else 2e-3
    monkeypatch.setattr(bench_kernel, "causal_linear_attention", attention)
    monkeypatch.setattr(feature_maps.FeatureMap, "scores", scores)
    monkeypatch.setattr(bench_kernel, "_time", clock)
    monkeypatch.chdir(tmp_path)
    bench_kernel.closed_form(dict(threads=1, repeats=1, closed_form_shapes="2x2x32x8"))
    rows = json.load(open(tmp_path / "results" / "closed_form.json"))["rows"]
    assert len(rows) == 6 and {(x["features_ms"], x["closed_form_ms"]) for x in rows} == {(2.0, 1.0)}


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
    assert torch.cuda.is_available() or {r["device"] for r in result["records"]} <= {"cpu (1 thread)", "mps (1 thread)"}  # --threads=1
    growth = {name: result["summary"][name]["state_growth"] for name in result["summary"]}
    assert growth == {"softmax": 4, "hedgehog": 1, "swa": 1, "lolcats": 1}  # from 64 to 256 tokens, window 16
    assert {r["part"] for r in result["records"]} == {"layer"}  # no checkpoints here: part 2 is skipped
    # a context shorter than the window: the window holds only its tokens (5 here)
    cache = decode.cache_of_length(MultiHeadAttention(16, 2, "lolcats", window=16), 5, "cpu")
    assert cache["window"]["k"].shape[2] == 5 and decode.cache_bytes(cache) == (2 * 2 * 5 * 8 + 2 * 5 * 16 + 2 * 16 * (8 + 1)) * 4


def test_decode_summary_and_timing_by_hand(tmp_path, monkeypatch):
    """decode.py's numbers from scripted clocks: a step's time is the median of the timed steps after two
    warm-up ones; the summary's growth is the last context's time over the first's, and the crossover the
    first context at which an attention is strictly faster than softmax. The KV cache check counts K and V
    in float32 and a copy of them: 2 x 2 H T D x 4 bytes."""
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


@needs_triton
def test_kernel_sweep_times_each_setting_it_names(tmp_path, monkeypatch):
    """sweep_kernel.py at tiny sizes in the interpreter: one row per setting, each run with
    the settings it records (seen from inside kernel._segments, and for the fused forward's segment sums
    alone from inside the sweep's call of them) and checked against the defaults' result; the defaults are
    back afterwards."""
    import sweep_kernel
    seen, segments = [], kernel._segments

    def spy(N, programs):  # called by kernel._states and the fused forward after they have read their settings
        cfg = kernel._configs(32, 16)
        seen.append((kernel.STATE_PROGRAMS, cfg["states"]["BK"], cfg["states"]["BV"], cfg["fused"]["BV"],
                     kernel.FUSED_MAX_F, kernel.MIN_SEGMENT, cfg["fused"]["C"]))
        return segments(N, programs)
    monkeypatch.setattr(kernel, "_segments", spy)
    seen_sums, fused_sums = [], sweep_kernel._fused_sums

    def spy_sums(*args):  # the sweep's rows of the fused forward's segment sums
        cfg = kernel._configs(32, 16)["states"]
        seen_sums.append((kernel.STATE_PROGRAMS, cfg["BK"], cfg["BV"]))
        return fused_sums(*args)
    monkeypatch.setattr(sweep_kernel, "_fused_sums", spy_sums)
    defaults = kernel._configs
    cfg = dict(shape="1x2x16", lengths="650", tiles="32,64", warps="4", stages="2", programs="8,4096",
               min_segments="2,8", chunks="64,32", repeats=1, out=str(tmp_path / "s.json"))
    rows = sweep_kernel.sweep(cfg)
    assert kernel._configs is defaults and kernel.STATE_PROGRAMS == 4096 and kernel.MIN_SEGMENT == 8
    states, sums = ([r for r in rows if r["kernel"] == name] for name in ("states", "sums"))
    fused = [r for r in rows if r["kernel"] == "fused"]
    assert len(states) == len(sums) == 8 and len(fused) == 16 and len([r for r in rows if r["kernel"] == "output"]) == 4
    assert {(r["programs"], r["BK"], r["BV"]) for r in states} <= {x[:3] for x in seen} and len(set(seen)) >= 8
    assert {(r["programs"], r["BK"], r["BV"]) for r in sums} == set(seen_sums)  # the segments' sums alone
    assert {(r["programs"], r["BV"], r["min_segment"], r["C"]) for r in fused} <= {(x[0], x[3], x[5], x[6]) for x in seen}
    assert {x[4] for x in seen} == {0, 128} and kernel.FUSED_MAX_F == 128  # the output kernel's rows ran unfused
    # against the defaults: forwards to float32 rounding; pass 1's states are stored in bf16 (the sweep's
    # dtype), where a sum in another order can round an element one bf16 ulp the other way; a fused forward in
    # chunks of 32 rounds the state for its dots at other tokens than in chunks of 64
    bf16_rounding = lambda r: r["kernel"] == "states" or r.get("C") == 32
    assert all(r["rel_error"] < (1e-2 if bf16_rounding(r) else 1e-5) and r["ms"] > 0 for r in rows)
    assert json.load(open(tmp_path / "s.json"))["rows"] == rows
    # 64 tokens, one chunk: the fused forward is one segment, with no sums to time (no row for them)
    # (and pass 1's states are all 0 there, the state before the first chunk: an error of 0, not 0 / 0)
    one = dict(cfg, lengths="64", tiles="32", programs="4096", min_segments="8", chunks="64")
    rows = sweep_kernel.sweep(one)
    assert [(r["kernel"], "ms" in r) for r in rows] == [("fused", True), ("states", True), ("output", True)]
    assert all(r["rel_error"] < 1e-5 for r in rows) and rows[1]["rel_error"] == 0.0


@needs_triton
@pytest.mark.parametrize("F,keys", [(32, {"ours_pass1_ms", "ours_unfused_fwd_ms"}), (300, {"ours_pass1_ms"})])
def test_kernel_report_times_the_passes(F, keys):
    """The device report's split of our forward (report_kernel._passes) in the interpreter, bf16: the
    segments' sums and the unfused forward where F is fused, pass 1 where it is not; the setting is back
    afterwards."""
    qf, kf, v = (torch.rand(1, 2, 200, d, device=DEV, dtype=torch.bfloat16) for d in (F, F, 16))
    ours = (lambda a, b, c: kernel.causal_linear_attention(a, b, c, backend="triton"), (qf, kf, v))
    out = report_kernel._passes(qf, kf, v, ours, repeats=1)
    assert set(out) == keys and all(x > 0 for x in out.values()) and kernel.FUSED_MAX_F == 128


@needs_triton
def test_kernel_sweep_records_a_setting_that_fails_and_goes_on(tmp_path, monkeypatch):
    """A setting that fails on the GPU (out of shared memory, say: the build check covers the defaults, not
    every setting swept) is a row with its error and no time, and the sweep goes on to the next; the
    defaults are back afterwards. Here the stand-in clock fails every setting with value tiles of 64."""
    import sweep_kernel
    real = sweep_kernel._time

    def clock(fn, repeats):
        if any(c.get("BV") == 64 for c in kernel._configs(32, 16).values()):  # none of the defaults' at these sizes
            raise RuntimeError("out of resources: shared memory")
        return real(fn, repeats)
    monkeypatch.setattr(sweep_kernel, "_time", clock)
    defaults = kernel._configs
    cfg = dict(shape="1x2x16", lengths="128", tiles="32,64", warps="4", stages="2", programs="4096",
               min_segments="8", chunks="64", repeats=1, out=str(tmp_path / "s.json"))  # two chunks: states not 0
    rows = sweep_kernel.sweep(cfg)
    assert kernel._configs is defaults
    assert [(r["kernel"], r["BV"], r.get("error"), "ms" in r) for r in rows if r["kernel"] != "states"] == [
        ("fused", 32, None, True), ("fused", 64, "RuntimeError: out of resources: shared memory", False),
        ("output", 32, None, True), ("output", 64, "RuntimeError: out of resources: shared memory", False),
        ("output", 32, None, True), ("output", 64, "RuntimeError: out of resources: shared memory", False)]
    assert json.load(open(tmp_path / "s.json"))["rows"] == rows


@pytest.mark.skipif(shutil.which("timeout") is None, reason="report_gpu.sh needs GNU timeout (Linux, where the GPUs are)")
def test_report_gpu_runs_every_part_each_under_its_limit(tmp_path):
    """report_gpu.sh with a stand-in for Python that notes each script it is given and its arguments (and runs
    the real one for the script's one-liners): the six parts in order, each with settings its script has and its
    output in OUT_DIR; a part that overruns its share of the budget (the sweep, here) is stopped at its limit,
    and the parts after it still run."""
    real = sys.executable
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {real} "$@"; fi\necho "$@" >> {tmp_path}/calls\n'
                        'if [ "$1" = sweep_kernel.py ]; then sleep 60; fi\necho "ran $1"\n')
    stand_in.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stand_in), PYTHONPATH=HERE, CUDA_VISIBLE_DEVICES="")
    start = time.time()
    out = subprocess.run(["bash", os.path.join(HERE, "report_gpu.sh"), str(tmp_path / "out"), "20"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and time.time() - start < 30, out.stdout + out.stderr  # the sweep stopped at 4 s
    calls = [line.split() for line in open(tmp_path / "calls")]
    assert [c[0] for c in calls] == ["report_kernel.py", "sweep_kernel.py", "report_kernel.py", "report_kernel.py", "-m",
                                     "decode.py"]
    tests = calls.pop(4)
    assert tests[:2] == ["-m", "pytest"] and all(os.path.exists(os.path.join(HERE, f)) for f in tests if f.endswith(".py"))
    for script, *args in calls:
        settings = dict(a[2:].split("=", 1) for a in args)
        assert set(settings) <= set(script_settings(script)), (script, settings)
        assert os.path.dirname(settings["out"]) == str(tmp_path / "out") and "_cpu" in settings["out"]  # the GPU's name
    names = ("fused", "sweep", "fla_shape", "poly", "tests", "decode")
    logs = {name: (tmp_path / "out" / f"{name}.log").read_text() for name in names}
    assert "== sweep: up to 4 s" in logs["sweep"] and "exit status 124" in logs["sweep"]
    assert all("ran " in log and "exit status 0" in log for name, log in logs.items() if name != "sweep")
    assert "torch" in (tmp_path / "out" / "env.txt").read_text()
    assert report_kernel.gpu_file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"  # as the files are named
