"""
plot_ar.py as a user runs it: the AR table and figures, panels by the feature size asked, accuracy at equal
budgets, runs made apart merged into one table (or refused in one line), and the exact tests between
attentions.
Run: python -m pytest -q test_plot_ar.py
"""
import itertools
import json
import random

from test_all import run_script  # first: sets TRITON_INTERPRET before triton is imported

import pytest
import torch

import configurator
import plot_ar


def test_plot_ar_panels_by_the_feature_size_asked():
    """The figures over epochs and steps have one panel per F asked, smallest first. Runs that asked for no
    F (features=0) are a group of their own, or, merged with runs that asked for one, count at the F they got."""
    runs = lambda *pairs: [{"features_asked": asked, "features": got} for asked, got in pairs]
    assert list(plot_ar.by_size(runs((0, 128), (0, 256), (0, 128)))) == [0]
    merged = runs((0, 256), (128, 128), (0, 128), (256, 256))
    groups = plot_ar.by_size(merged)
    assert list(groups) == [128, 256] and groups[128] == [merged[1], merged[2]] and groups[256] == [merged[0], merged[3]]


def test_plot_ar_summary_row_by_hand():
    """A row of the table: the mean ± std over seeds; steps to 50% as the mean over the seeds that got there,
    with how many did ("never" if none); the retrieval heads seen, as layer.head; the range of epochs."""
    run = lambda seed, acc, steps, layer, epochs: {
        "attention": "elu", "features": 64, "qk_dim": 64, "state_size": 4160, "seed": seed, "test_acc": acc,
        "retrieval_entropy": 2.0 + seed, "target_mass": 0.5, "retrieval_layer": layer, "retrieval_head": 0,
        "steps_to_50": steps, "epochs": epochs, "seconds": 10.0 * epochs}
    table = plot_ar.summarize([run(0, 0.9, 100, 1, 3), run(1, 0.6, None, 0, 5), run(2, 0.3, 300, 1, 5),
                               dict(run(0, 0.05, None, 1, 2), attention="relu")])
    acc, entropy, seconds = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([2.0, 3.0, 4.0]), torch.tensor([30.0, 50, 50])
    assert table.splitlines()[1].split() == ["elu", "64", "64", "4160", "3", f"{acc.mean():.3f}", "±", f"{acc.std():.3f}",
                                             f"{entropy.mean():.2f}", "±", f"{entropy.std():.2f}", "0.50", "±", "0.00",
                                             "0.0,1.0", "200", "(2/3)", "3-5", f"{seconds.mean():.0f}", "±",
                                             f"{seconds.std():.0f}"]
    assert table.splitlines()[2].split()[-5:] == ["1.0", "never", "(0/1)", "2", "20"]


def test_plot_ar_capacity_and_curves_data(tmp_path):
    """The capacity figure plots each attention's mean accuracy against the state size (not F), and the
    curves of runs that stopped early keep their last value to the longest run's length."""
    assert plot_ar.padded([[0.25, 0.5, 0.75], [0.125]]).tolist() == [[0.25, 0.5, 0.75], [0.125] * 3]
    plt = configurator.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    runs = [{"attention": "elu", "features": F_, "state_size": size, "test_acc": acc}
            for F_, size, acc in ((16, 1040, 0.9), (8, 520, 0.5), (8, 520, 0.7))]
    plot_ar.plot_capacity(plt, runs, str(tmp_path))
    line = plt.gcf().axes[0].lines[0]
    assert list(line.get_xdata()) == [520, 1040] and list(line.get_ydata()) == pytest.approx([0.6, 0.9])
    plt.close("all")


def test_plot_ar_compares_runs_at_equal_budgets():
    """The table at equal epochs: a run that stopped on reaching its target counts with its last epoch,
    one cut short by a time cap is left out after its last, and milestones stop at the longest run."""
    run = lambda acc: {"attention": "elu", "features": 64, "test_acc_per_epoch": acc, "config": {"target_acc": 0.99}}
    slow, solved, capped = run([0.1] * 9 + [0.4] * 21), run([0.2, 0.5, 0.995]), run([0.3] * 7)
    header, row = plot_ar.at_epochs([slow, solved, capped]).splitlines()
    assert header.split()[2:] == ["epoch", "5", "epoch", "10", "epoch", "20", "epoch", "30"]
    at5 = torch.tensor([0.1, 0.995, 0.3])
    at10 = torch.tensor([0.4, 0.995])
    assert row.split("  ")[-4:] == ([f" {at5.mean():.2f} ± {at5.std():.2f} (3/3)"]
                                    + [f" {at10.mean():.2f} ± {at10.std():.2f} (2/3)"] * 3)
    assert plot_ar.at_epochs([solved, run([0.3] * 4)]) == ""  # no run passes epoch 5


def test_exact_tests_by_hand_and_by_counting_every_split():
    """Fisher's exact test and the exact rank-sum test against known values, and against counting by brute
    force every way to split the pooled runs into the two groups (ties included)."""
    assert plot_ar.fisher_exact(3, 4, 1, 4) == pytest.approx(34 / 70)  # the lady tasting tea, two-sided
    assert plot_ar.fisher_exact(3, 3, 0, 3) == pytest.approx(2 / 20)  # only the two extreme tables
    assert plot_ar.fisher_exact(2, 4, 3, 6) == pytest.approx(1.0)
    assert plot_ar.rank_sum_test([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)  # x below y, or above: 2 of 20
    assert plot_ar.rank_sum_test([1, 2], [2, 3]) == pytest.approx(4 / 6)  # midranks 1, 2.5 | 2.5, 4
    g = random.Random(0)
    for n, m in [(3, 4), (5, 6), (6, 2), (7, 7)]:
        x, y = [g.randint(30, 40) for _ in range(n)], [g.randint(33, 45) for _ in range(m)]
        pooled = sorted(x + y)
        rank = {v: sum(i + 1 for i, u in enumerate(pooled) if u == v) / pooled.count(v) for v in pooled}
        mean = n * (n + m + 1) / 2
        sums = [sum(rank[pooled[i]] for i in split) for split in itertools.combinations(range(n + m), n)]
        far = sum(abs(s - mean) >= abs(sum(rank[v] for v in x) - mean) - 1e-9 for s in sums)
        assert plot_ar.rank_sum_test(x, y) == pytest.approx(far / len(sums))
        solved = [v >= 36 for v in x + y]  # Fisher: the share of splits whose count is no likelier than x's
        counts = [sum(solved[i] for i in split) for split in itertools.combinations(range(n + m), n)]
        likely = {c: counts.count(c) for c in counts}
        seen = likely[sum(solved[:n])]
        assert plot_ar.fisher_exact(sum(solved[:n]), n, sum(solved[n:]), m) == pytest.approx(
            sum(k for k in likely.values() if k <= seen) / len(counts))


def test_compare_row_by_hand():
    """One row of --compare's table worked by hand. a reaches 50% at epoch 2 in one run of three, b at
    epochs 1, 1, 3. Over the runs that reach it, ranks 1.5 1.5 3 4: every split is as far from the mean as
    a's, p = 1. With a's two others ranked last (tied at 5.5): a's rank sum 14 against a mean of 10.5, and
    4 splits of 20 are as far (both last with the 3 or the 4, and their mirror images), p = 0.2."""
    run = lambda name, acc: {"attention": name, "features_asked": 64, "test_acc": acc[-1], "test_acc_per_epoch": acc}
    a = [run("a", [0.3, 0.95]), run("a", [0.3, 0.3, 0.3]), run("a", [0.2, 0.4])]
    b = [run("b", [0.6, 0.92]), run("b", [0.5, 0.7]), run("b", [0.3, 0.3, 0.99])]
    row = plot_ar.compare_runs(a + b, "a:b").splitlines()[2].split()
    assert row == ["64", "a", "b", "1/3", "2/3", f"{plot_ar.fisher_exact(1, 3, 2, 3):.2g}", "2", "(1)", "1", "(3)",
                   "1", "0.2"]
    # the same runs as one attention at two state sizes, named by F: the same row, over all the runs
    one = [dict(r, attention="a", features=F) for rs, F in ((a, 32), (b, 64)) for r in rs]
    row = plot_ar.compare_runs(one, "a@32:a@64").splitlines()[2].split()
    assert row == ["-", "a@32", "a@64", "1/3", "2/3", f"{plot_ar.fisher_exact(1, 3, 2, 3):.2g}", "2", "(1)", "1",
                   "(3)", "1", "0.2"]


def test_runs_merge_across_the_early_stop_setting_only_without_patience():
    """Runs recorded before early_stop was a setting merge with later ones where no run stopped early."""
    old, new = {"lr": 1e-3, "patience": 0}, {"lr": 1e-3, "patience": 0, "early_stop": "loss"}
    assert plot_ar.first_difference(old, new) is None
    assert plot_ar.first_difference(dict(old, patience=10), dict(new, patience=10)) == ("early_stop not recorded",
                                                                                        "early_stop='loss'")


def test_plot_ar_merges_runs_made_apart(tmp_path):
    """Seeds trained in one run, split into two files and merged by plot_ar.py (named, or by a pattern),
    give that run's own table, with the mean and spread over both seeds; a run cut short by a time cap
    gives way to the same run carried on. Files of another experiment, a run twice, two runs of one
    seed that part ways, a file that is not an ar.json or a pattern that matches none are refused in one line."""
    run_script("train_ar.py", "--attentions=softmax,elu", "--seeds=0,1", "--num_train=64", "--num_test=16",
               "--seq_len=16", "--epochs=2", "--workers=1", "--plots=false", f"--out_dir={tmp_path}")
    records = json.load(open(tmp_path / "ar.json"))
    for seed in (0, 1):
        json.dump([r for r in records if r["seed"] == seed], open(tmp_path / f"seed{seed}.json", "w"))
    merged = tmp_path / "merged"
    run_script("plot_ar.py", f"--runs={tmp_path / 'seed0.json'},{tmp_path / 'seed1.json'}", f"--out_dir={merged}")
    table = (merged / "ar_summary.txt").read_text()
    assert table == (tmp_path / "ar_summary.txt").read_text()
    softmax = torch.tensor([r["test_acc"] for r in records if r["attention"] == "softmax"], dtype=torch.float64)
    assert f"{softmax.mean():.3f} ± {softmax.std():.3f}" in table.splitlines()[1]
    assert (merged / "ar_entropy.png").exists() and (merged / "ar_curves.png").exists()

    # seed 1 as a 1-epoch run stopped by a time cap, and the same run carried on to 2 epochs, in either order
    cut = lambda r: dict(r, epochs=1, test_acc_per_epoch=r["test_acc_per_epoch"][:1],
                         config=dict(r["config"], max_minutes=1))
    json.dump([cut(r) for r in records if r["seed"] == 1], open(tmp_path / "seed1_cut.json", "w"))
    for runs in (tmp_path / "seed*.json", ",".join(str(tmp_path / f"{n}.json") for n in ("seed0", "seed1_cut", "seed1"))):
        run_script("plot_ar.py", f"--runs={runs}", f"--out_dir={merged}", "--plots=false")
        assert (merged / "ar_summary.txt").read_text() == table

    # the tests between two attentions over the two seeds, and a pair that is not in the runs
    run_script("plot_ar.py", f"--runs={tmp_path / 'ar.json'}", f"--out_dir={merged}", "--plots=false",
               "--compare=softmax:elu")
    row = (merged / "ar_tests.txt").read_text().splitlines()[2].split()
    solved = [sum(r["test_acc"] >= 0.9 for r in records if r["attention"] == n) for n in ("softmax", "elu")]
    assert row[:5] == ["64", "softmax", "elu", f"{solved[0]}/2", f"{solved[1]}/2"]
    for bad in ("softmax:relu", "softmax@32:elu"):  # no relu runs; no softmax runs of F = 32
        err = run_script("plot_ar.py", f"--runs={tmp_path / 'ar.json'}", f"--out_dir={merged}", f"--compare={bad}",
                         ok=False)
        assert f"--compare: '{bad}' is not two attentions of these runs" in err and len(err.strip().splitlines()) == 1

    other = [dict(r, config=dict(r["config"], lr=1.0)) for r in records if r["seed"] == 1]
    json.dump(other, open(tmp_path / "other.json", "w"))
    parted = [dict(r, test_acc_per_epoch=[-1.0, -1.0]) for r in records if r["seed"] == 1]
    json.dump(parted, open(tmp_path / "parted.json", "w"))
    json.dump({"rows": []}, open(tmp_path / "kernel.json", "w"))
    for runs, message in ([("seed0", "other"), "trained with different settings: lr=0.003 against lr=1.0"],
                          [("seed0", "seed0"), "seed0.json more than once"],
                          [("seed1_cut", "parted"), "softmax F=64 seed 1 is in both"],
                          [("kernel",), "is not an ar.json of train_ar.py"],
                          [("missing",), "cannot read"],
                          [("missing*",), "no file matches"]):
        err = run_script("plot_ar.py", "--runs=" + ",".join(str(tmp_path / f"{n}.json") for n in runs),
                         f"--out_dir={tmp_path / 'refused'}", ok=False)
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "refused").exists()
