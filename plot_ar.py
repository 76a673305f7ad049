"""
The table and figures of associative-recall runs, from the ar.json files that train_ar.py writes.

train_ar.py calls report() at the end of every run. Run on its own, this file redraws them from saved
runs, and merges several files into one table, e.g. seeds trained at different times:

    python plot_ar.py --runs=results/ar.json
    python plot_ar.py --runs=results/ar_a/ar.json,results/ar_b/ar.json --out_dir=results/ar_ab
    python plot_ar.py --runs='results/ar_*/ar.json' --out_dir=results/ar_all     (a pattern: every match, sorted)

Files are merged only when their runs were trained with the same settings (all but the attentions,
seeds and feature sizes asked, where they ran, the time cap and --init_from), and each (attention, F,
seed) appears once, unless one of its runs is the other carried on for more epochs (rerun or resumed with
a longer --max_minutes, the same accuracy epoch for epoch as far as the shorter went): then the longer
one is kept.

The table: one row per (attention, F), the mean and, with several seeds, the standard deviation. Runs
stopped at different epochs (by a time cap, or on reaching the target) differ in budget, so a second
table gives each row's accuracy after equal numbers of epochs.
The figures (with matplotlib): ar_entropy.png (accuracy against the retrieval head's entropy, Hedgehog
Fig. 4), ar_lookup.png (the retrieval head's query row on one test sequence, Fig. 2), ar_curves.png
(accuracy against training steps), ar_runs.png (every run's accuracy, epoch by epoch), ar_heads.png (the
previous-token and answer heads forming, epoch by epoch), each with one panel per F asked, and, when F
varies, ar_capacity.png (Zoology Fig. 2).
With --compare, exact tests of the differences between attentions over seeds, in ar_tests.txt: how many
runs solve the task (Fisher's exact test) and when they leave the plateau, the first epoch at 50% (the exact
Mann-Whitney rank-sum test), e.g. python plot_ar.py --runs=... --compare=elu:exp_t2,hedgehog:exp_t2; name@F
picks an attention's runs of F features, to test across state sizes (--compare=exp_t2@64:exp_t2@32)
"""
import glob
import itertools
import json
import math
import os
import statistics

import torch

from configurator import configure, entries, pyplot, repeated, writable

# ---- config: plain values, override with --key=value ----
runs = "results/ar.json"  # comma-separated ar.json files of train_ar.py, or patterns (quoted, so the shell leaves them)
out_dir = ""  # where the table and figures go; "": the folder of the first file
plots = True
compare = ""  # attentions to test against each other over seeds: pairs "elu:exp_t2,hedgehog@32:exp_t2@32", or "all"
solve = 0.9  # compare: a run solves the task at this test accuracy or more
# -----------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

# settings that may differ between merged files: what was trained and kept, where, and for how long, not how
# (the table gives each row's epochs)
FREE = {"attentions", "seeds", "features", "out_dir", "plots", "save_models", "device", "workers", "max_minutes",
        "init_from"}


def first_difference(a, b):
    """The first setting outside FREE in which the configs a and b differ, as ("k=a's value", "k=b's value"),
    or None if they agree. early_stop counts only where patience stops runs early (runs recorded before it
    was a setting merge with later ones when neither had patience)."""
    said = lambda c, k: f"{k}={c[k]!r}" if k in c else f"{k} not recorded"
    free = FREE | (set() if a.get("patience") or b.get("patience") else {"early_stop"})
    keys = sorted(k for k in a.keys() | b.keys() if k not in free)
    return next(((said(a, k), said(b, k)) for k in keys if said(a, k) != said(b, k)), None)


def by_row(records):
    """{(attention, F): its runs}, in the order the runs came."""
    rows = {}
    for r in records:
        rows.setdefault((r["attention"], r["features"]), []).append(r)
    return rows


def mean_std(values, fmt):
    """"mean ± std" of several numbers in the format fmt, the number alone for one."""
    vals = torch.tensor([float(v) for v in values])
    return fmt.format(vals.mean()) + (f" ± {fmt.format(vals.std())}" if len(vals) > 1 else "")


def summarize(records):
    """One row per (attention, F): mean and, with several seeds, the standard deviation; steps to 50%
    as the mean over the seeds that got there, with how many did."""
    lines = [f"{'attention':<12} {'F':>4} {'D':>3} {'state':>6} {'seeds':>5} {'test acc':>14} {'retr. entropy':>13} "
             f"{'target mass':>13} {'head':>4} {'steps to 50%':>13} {'epochs':>6} {'seconds':>7}"]
    for (name, F_), rs in by_row(records).items():
        ms = lambda key, fmt: mean_std([r[key] for r in rs], fmt)

        got = [r["steps_to_50"] for r in rs if r["steps_to_50"] is not None]
        steps = f"{sum(got) / len(got):.0f} ({len(got)}/{len(rs)})" if got else f"never (0/{len(rs)})"
        heads = ",".join(sorted({f"{r['retrieval_layer']}.{r['retrieval_head']}" for r in rs}))
        epochs = sorted({r["epochs"] for r in rs})
        epochs = f"{epochs[0]}-{epochs[-1]}" if len(epochs) > 1 else str(epochs[0])
        lines.append(f"{name:<12} {F_:>4} {rs[0]['qk_dim']:>3} {rs[0]['state_size']:>6} {len(rs):>5} "
                     f"{ms('test_acc', '{:.3f}'):>14} {ms('retrieval_entropy', '{:.2f}'):>13} "
                     f"{ms('target_mass', '{:.2f}'):>13} {heads:>4} {steps:>13} {epochs:>6} {ms('seconds', '{:.0f}'):>7}")
    return "\n".join(lines)


def at_epochs(records, milestones=(5, 10, 20, 30, 50, 100)):
    """Accuracy at equal budgets: one row per (attention, F), the mean ± std over seeds of the accuracy
    on the 500 sequences checked after epoch E, for each milestone E up to the longest run; (k/n) says
    how many of the row's n runs count (acc_after). "" when no run passes the first milestone."""
    longest = max(len(r["test_acc_per_epoch"]) for r in records)
    epochs = [e for e in milestones if e <= longest]
    if not epochs:
        return ""
    lines = [f"{'attention':<12} {'F':>4} " + " ".join(f"{f'epoch {e}':>19}" for e in epochs)]
    for (name, F_), rs in by_row(records).items():
        cells = []
        for e in epochs:
            got = [a for a in (acc_after(r, e) for r in rs) if a is not None]
            cells.append(f"{mean_std(got, '{:.2f}') if got else '-'} ({len(got)}/{len(rs)})")
        lines.append(f"{name:<12} {F_:>4} " + " ".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)


def acc_after(r, epoch):
    """Run r's accuracy after `epoch` epochs: its last, if it stopped before on reaching its target (it had
    solved the task); None if it stopped before for another reason (a time cap, early stopping): it is left out."""
    acc = r["test_acc_per_epoch"]
    if len(acc) >= epoch:
        return acc[epoch - 1]
    return acc[-1] if acc[-1] >= r["config"]["target_acc"] else None


def names_in(records):
    return list(dict.fromkeys(r["attention"] for r in records))


def plot_entropy(plt, records, out_dir):
    """Hedgehog Fig. 4: test accuracy against the retrieval head's entropy, and against its weight on the
    answer's positions; one point per run."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for j, name in enumerate(names_in(records)):
        rs = [r for r in records if r["attention"] == name]
        for ax, key in zip(axes, ("retrieval_entropy", "target_mass")):
            ax.scatter([r[key] for r in rs], [r["test_acc"] for r in rs], color=f"C{j % 10}",
                       marker="o" if j < 10 else "s", label=name)
    axes[0].set(xlabel="entropy of the retrieval head's query row (nats)", ylabel="test accuracy")
    axes[1].set(xlabel="its weight on the answer's positions (target mass)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Associative recall: accuracy vs spikiness (cf. Hedgehog Fig. 4)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_entropy.png"), dpi=120)


def plot_lookup(plt, records, out_dir):
    """Hedgehog Fig. 2: each map's retrieval-head query row on the first test sequence, answers marked."""
    first = [next(r for r in records if r["attention"] == name) for name in names_in(records)]
    fig, axes = plt.subplots(len(first), 1, figsize=(8, 0.9 * len(first) + 0.6), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], first):
        row = r["query_row"]
        ax.bar(range(len(row)), row, width=1.0, color="C0")
        for p in r["answer_positions"]:
            ax.axvspan(p - 0.5, p + 0.5, color="C3", alpha=0.3, lw=0)
        ax.set_ylim(0, max(max(row), 1e-3) * 1.1)
        ax.set_yticks([])
        ax.set_ylabel(r["attention"], rotation=0, ha="right", va="center", fontsize=8)
        ax.text(1.0, 0.5, f" F {r['features']}, seed {r['seed']}\n acc {r['test_acc']:.2f}\n mass {r['target_mass']:.2f}"
                f"\n H {r['retrieval_entropy']:.2f}",
                transform=ax.transAxes, fontsize=7, va="center")
    axes[-1, 0].set_xlabel("position attended from the query (red: the answer's positions)")
    axes[0, 0].set_title("Query row of the retrieval head, one test sequence (cf. Hedgehog Fig. 2)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_lookup.png"), dpi=120)


def padded(runs):
    """Runs of unequal length as one (runs, longest) tensor: a run that stopped early keeps its last value."""
    n = max(map(len, runs))
    return torch.tensor([run + run[-1:] * (n - len(run)) for run in runs])


def by_size(records):
    """{F asked: its runs}, smallest F first: one panel each in the figures over epochs and steps. Runs that
    asked for no F (features=0, the q/k head decides it) are a group of their own, unless merged with runs
    that asked for one: then each counts at the F it got."""
    mixed = any(r["features_asked"] for r in records)
    groups = {}
    for r in records:
        groups.setdefault(r["features_asked"] or (r["features"] if mixed else 0), []).append(r)
    return dict(sorted(groups.items()))


def panels(plt, records, rows=1, height=4.5):
    """A figure with one column per F asked: (fig, axes (rows, sizes), {F asked: its runs})."""
    groups = by_size(records)
    fig, axes = plt.subplots(rows, len(groups), figsize=(5 * len(groups) + 2, height * rows), sharey="row",
                             squeeze=False)
    for ax, size in zip(axes[0], groups):
        ax.set_title(f"F asked: {size}" if size else "F set by each map's q/k head size")
    return fig, axes, groups


def line_style(j):
    """Colour and dash of the j-th attention, the same in every figure."""
    return dict(color=f"C{j % 10}", ls="-" if j < 10 else "--")


def plot_curves(plt, records, out_dir):
    """Accuracy against training steps, one panel per F asked: the mean over seeds, the band from min to
    max. A seed that stopped early keeps its last accuracy to the end of the longest one."""
    fig, axes, groups = panels(plt, records)
    for ax, runs in zip(axes[0], groups.values()):
        for j, name in enumerate(names_in(records)):
            curves = [r["curve"] for r in runs if r["attention"] == name]
            if curves:
                steps = [s for s, _ in max(curves, key=len)]
                accs = padded([[a for _, a in c] for c in curves])  # (seeds, n)
                ax.plot(steps, accs.mean(0), label=name, **line_style(j))
                ax.fill_between(steps, accs.min(0).values, accs.max(0).values, color=f"C{j % 10}", alpha=0.15)
        ax.set_xlabel("training step")
        ax.legend(fontsize=7, ncol=2)
    axes[0, 0].set_ylabel("test accuracy (500 sequences)")
    fig.suptitle("Associative recall: learning speed (mean and range over seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_curves.png"), dpi=120)


def plot_runs(plt, records, out_dir):
    """Every run's accuracy, epoch by epoch, one panel per F asked: the means of plot_curves hide whether
    a seed jumps (builds the previous-token head) or creeps."""
    fig, axes, groups = panels(plt, records)
    for ax, runs in zip(axes[0], groups.values()):
        for j, name in enumerate(names_in(records)):
            for i, r in enumerate(r for r in runs if r["attention"] == name):
                acc = r["test_acc_per_epoch"]
                ax.plot(range(1, len(acc) + 1), acc, lw=1, label=None if i else name, **line_style(j))
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.legend(fontsize=7, ncol=2)
    axes[0, 0].set_ylabel("test accuracy (500 sequences)")
    fig.suptitle("Associative recall: every run, one line each")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_runs.png"), dpi=120)


def plot_heads(plt, records, out_dir):
    """The two heads of the lookup forming, epoch by epoch, one column per F asked (mean over seeds; runs
    recorded before train_ar.py kept these are left out): the most weight any head puts on the
    previous token (top), and on the answer (bottom)."""
    fig, axes, groups = panels(plt, records, rows=2, height=3.5)
    for col, runs in zip(axes.T, groups.values()):
        for j, name in enumerate(names_in(records)):
            for ax, key in zip(col, ("prev_mass_per_epoch", "target_mass_per_epoch")):
                best = [[max(map(max, epoch)) for epoch in r[key]] for r in runs if r["attention"] == name and key in r]
                if best:
                    best = padded(best).mean(0)  # (epochs,)
                    ax.plot(range(1, len(best) + 1), best, label=name, **line_style(j))
        for ax in col:
            ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        col[1].set_xlabel("epoch")
        col[1].legend(fontsize=7, ncol=2)
    axes[0, 0].set_ylabel("on the previous token")
    axes[1, 0].set_ylabel("on the answer, from the query")
    fig.suptitle("Associative recall: the best head's weight, epoch by epoch (mean over seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_heads.png"), dpi=120)


def plot_capacity(plt, records, out_dir):
    """Zoology Fig. 2: accuracy against the state size of one layer, mean over seeds and min-max bars."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for j, name in enumerate(names_in(records)):
        points = {}
        for r in records:
            if r["attention"] == name:
                points.setdefault(r["state_size"], []).append(r["test_acc"])
        x = sorted(points)
        acc = [torch.tensor(points[s]) for s in x]
        mean = [a.mean().item() for a in acc]
        err = [[m - a.min().item() for m, a in zip(mean, acc)], [a.max().item() - m for m, a in zip(mean, acc)]]
        ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, color=f"C{j % 10}", label=name)
    ax.set_xscale("log")
    ax.set(xlabel="state size of one layer (numbers; softmax: its KV cache)", ylabel="test accuracy",
           title="Associative recall: accuracy vs memory (cf. Zoology Fig. 2)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ar_capacity.png"), dpi=120)


def report(records, out_dir, plots=True):
    """Print the table and save it as out_dir/ar_summary.txt; with matplotlib, save the figures."""
    table = summarize(records)
    if budgets := at_epochs(records):
        table += "\n\ntest accuracy (500 sequences) after equal numbers of epochs (k/n: the runs that got there)\n" + budgets
    print("\n" + table)
    with open(os.path.join(out_dir, "ar_summary.txt"), "w") as f:
        f.write(table + "\n")
    plt = pyplot() if plots else None
    if plt is not None:
        plot_entropy(plt, records, out_dir)
        plot_lookup(plt, records, out_dir)
        plot_curves(plt, records, out_dir)
        plot_runs(plt, records, out_dir)
        if any("prev_mass_per_epoch" in r for r in records):
            plot_heads(plt, records, out_dir)
        if len(by_size(records)) > 1:
            plot_capacity(plt, records, out_dir)
        print(f"figures: {out_dir}/ar_*.png")


# ---- differences over seeds: exact tests, computed here (no statistics package needed) ----

def first_epoch_at(r, acc=0.5):
    """The first epoch whose test accuracy is acc or more (where a run leaves the plateau), None if none."""
    return next((e for e, a in enumerate(r["test_acc_per_epoch"], 1) if a >= acc), None)


def fisher_exact(a, n, b, m):
    """Two-sided p of Fisher's exact test, a of n runs against b of m: with the margins fixed, the
    probability (hypergeometric) of every table no likelier than the one seen."""
    k = a + b
    p = lambda x: math.comb(n, x) * math.comb(m, k - x) / math.comb(n + m, k)
    seen = p(a) * (1 + 1e-7)  # a table as likely as the one seen counts, whatever the rounding
    return min(1.0, sum(p(x) for x in range(max(0, k - m), min(k, n) + 1) if p(x) <= seen))


def rank_sum_test(x, y):
    """Two-sided p of the exact Mann-Whitney (Wilcoxon rank-sum) test of x against y: the share of the ways
    to split the pooled values into groups of len(x) and len(y) that put the first group's rank sum at
    least as far from its mean as x's. Tied values share their mean rank (doubled, to stay integers); the
    rank sums of all the splits are counted exactly, by dynamic programming over (group size, rank sum)."""
    pooled = sorted(x + y)
    rank2 = {v: 2 * pooled.index(v) + pooled.count(v) + 1 for v in pooled}  # 2 x the mean of v's ranks
    ways = [{0: 1}] + [{} for _ in x]  # ways[c][s]: how many c-subsets of the values seen have rank sum s
    for v in pooled:
        for c in range(len(x), 0, -1):
            for s, w in ways[c - 1].items():
                ways[c][s + rank2[v]] = ways[c].get(s + rank2[v], 0) + w
    mean2, seen = len(x) * (len(pooled) + 1), sum(rank2[v] for v in x)  # 2 x the mean rank sum, 2 x x's
    far = sum(w for s, w in ways[len(x)].items() if abs(s - mean2) >= abs(seen - mean2))
    return far / math.comb(len(pooled), len(x))


def runs_of(records, spec):
    """The runs of `spec`: an attention's name, or name@F for its runs of F features."""
    name, _, F = spec.partition("@")
    return [r for r in records if r["attention"] == name and (not F or str(r["features"]) == F)]


def compare_runs(records, pairs, solve=0.9):
    """The tests of compare_pairs' pairs within each F asked (a pair that names its Fs, name@F, once over all
    the runs, with "-" for F asked), as text: how many runs of each solve the task (test accuracy >= solve)
    and Fisher's p; the median first epoch at 50% of the runs that reach it and
    the rank-sum test's p, over those runs, then over every run with the runs that never reach 50% ranked
    last (tied): a run the recipe ended on the plateau is the latest of all (one cut by a time cap counts
    as never too, so read that column where the recipe ended every run). Every p two-sided, not corrected
    for the number of tests."""
    lines = [f"tests over seeds: 'solve' is a test accuracy of {solve:.0%} or more (Fisher's exact test), 'epoch at "
             f"50%' the first epoch there, median (runs) of the runs that reach it (exact Mann-Whitney test); "
             f"'p, never last' the same test over every run, those that never reach 50% ranked last; "
             f"two-sided p, not corrected for multiple tests",
             f"{'F asked':>7} {'attention':<12} {'against':<12} {'solve':>6} {'solve':>6} {'p':>7} "
             f"{'epoch at 50%':>12} {'epoch at 50%':>12} {'p':>7} {'p, never last':>13}"]
    pairs = compare_pairs(pairs, records)
    rows = [(size, a, b, rs) for size, rs in by_size(records).items() for a, b in pairs if "@" not in a + b]
    rows += [("-", a, b, records) for a, b in pairs if "@" in a + b]
    for size, a, b, rs in rows:
        runs = {n: runs_of(rs, n) for n in (a, b)}
        if runs[a] and runs[b]:  # the pair has runs at this F
            solved = [sum(r["test_acc"] >= solve for r in runs[n]) for n in (a, b)]
            fisher = fisher_exact(solved[0], len(runs[a]), solved[1], len(runs[b]))
            firsts = [[first_epoch_at(r) for r in runs[n]] for n in (a, b)]
            e50 = [[e for e in f if e is not None] for f in firsts]
            cells = [f"{statistics.median(e):g} ({len(e)})" if e else "never" for e in e50]
            p = f"{rank_sum_test(*e50):.2g}" if all(e50) else "-"
            last = [[math.inf if e is None else e for e in f] for f in firsts]
            counts = [f"{solved[0]}/{len(runs[a])}", f"{solved[1]}/{len(runs[b])}"]
            lines.append(f"{size:>7} {a:<12} {b:<12} {counts[0]:>6} {counts[1]:>6} {fisher:>7.2g} "
                         f"{cells[0]:>12} {cells[1]:>12} {p:>7} {rank_sum_test(*last):>13.2g}")
    return "\n".join(lines)


def compare_pairs(pairs, records):
    """--compare's pairs: "all" is every pair of names (in their order), else "a:b,c:d" as given, checked."""
    names = names_in(records)
    if pairs == "all":
        return list(itertools.combinations(names, 2))
    got = [tuple(p.split(":")) for p in pairs.split(",")]
    for p in got:
        if len(p) != 2 or not all(runs_of(records, n) for n in p):
            raise SystemExit(f"error: --compare: {':'.join(p)!r} is not two attentions of these runs, a:b or "
                             f"a@F:b@F (they have {', '.join(names)}), or 'all'")
    return got


def load(paths):
    """The finished runs of several ar.json files, checked to be one experiment; runs that stopped on a
    non-finite loss are named and left out."""
    records, seen, settings = [], {}, None
    for path in paths:
        try:
            with open(path) as f:
                got = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read {path}: {e}")
        if not (isinstance(got, list) and got and all(isinstance(r, dict) and {"attention", "seed"} <= r.keys()
                                                      and ("config" in r or "stopped" in r) for r in got)):
            raise SystemExit(f"error: {path} is not an ar.json of train_ar.py (a list of run records)")
        for r in got:
            if "stopped" in r:
                print(f"{path}: {r['attention']} seed {r['seed']} stopped ({r['stopped']}): left out")
                continue
            if settings is None:
                settings = (r["config"], path)
            elif diff := first_difference(settings[0], r["config"]):
                raise SystemExit(f"error: {settings[1]} and {path} were trained with different settings: "
                                 f"{diff[0]} against {diff[1]}")
            key = (r["attention"], r["features"], r["seed"])
            if key in seen:
                i, before = seen[key]
                short, long = sorted((records[i], r), key=lambda x: x["epochs"])
                kept = path if long is r else before
                name = f"{r['attention']} F={r['features']} seed {r['seed']}"
                n = short["epochs"]
                if long["epochs"] == n or long["test_acc_per_epoch"][:n] != short["test_acc_per_epoch"]:
                    raise SystemExit(f"error: {name} is in both {before} and {path}, and neither run carries on the other")
                print(f"{name}: the {long['epochs']}-epoch run carries on the {n}-epoch one; kept from {kept}")
                records[i], seen[key] = long, (i, kept)
                continue
            seen[key] = (len(records), path)
            records.append(r)
    if not records:
        raise SystemExit(f"error: no finished runs in {', '.join(paths)}")
    return records


if __name__ == "__main__":
    cfg = configure(config)
    paths = []
    for p in entries(cfg, "runs") if cfg["runs"] else []:
        found = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
        if not found:
            raise SystemExit(f"error: --runs: no file matches {p}")
        paths += found
    if not paths:
        raise SystemExit("error: --runs: give one or more ar.json files, comma-separated")
    repeated("runs", [os.path.abspath(p) for p in paths])
    cfg["out_dir"] = cfg["out_dir"] or os.path.dirname(paths[0]) or "."
    writable(cfg, "out_dir", folder=True)
    records = load(paths)
    os.makedirs(cfg["out_dir"], exist_ok=True)
    if cfg["compare"]:  # a bad pair or threshold stops here, before any work
        compare_pairs(cfg["compare"], records)
        if not 0 < cfg["solve"] <= 1:
            raise SystemExit(f"error: --solve is a test accuracy in (0, 1], got {cfg['solve']}")
    report(records, cfg["out_dir"], cfg["plots"])
    if cfg["compare"]:
        tests = compare_runs(records, cfg["compare"], cfg["solve"])
        print("\n" + tests)
        with open(os.path.join(cfg["out_dir"], "ar_tests.txt"), "w") as f:
            f.write(tests + "\n")
