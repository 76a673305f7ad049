"""
The tests of oal_groups.py (OAL Sec. 3.1, 4.2, App. B): the contribution scores against their pairwise
definition, the top-10% share and the stable-gap grouping worked by hand (thresholds, ranking, bootstrap
support), and a head grouped from its q, k and then calibrated.
Run: python -m pytest -q test_oal_groups.py
"""
from test_all import qkv  # first: sets TRITON_INTERPRET

import pytest
import torch

import distill
import feature_maps as fm
import oal_groups


def test_contribution_scores_match_pairwise_mean():
    q, k, _ = qkv(T=9)
    c = oal_groups.contribution_scores(q, k)
    i, j = torch.tril_indices(9, 9)  # causal pairs
    ref = (q[:, :, i].abs() * k[:, :, j].abs()).mean(2)
    assert torch.allclose(c, ref, atol=1e-12)
    i, j = torch.arange(9).repeat_interleave(9), torch.arange(9).repeat(9)  # all pairs
    ref = (q[:, :, i].abs() * k[:, :, j].abs()).mean(2)
    assert torch.allclose(oal_groups.contribution_scores(q, k, causal=False), ref, atol=1e-12)


def test_top_share_hand_worked():
    """D = 10, nine dimensions of 1 and one of 11 (sum 20): the top 10% is that one, 11 / 20; the top 20%
    adds a 1, 12 / 20; uniform scores give 10%."""
    c = torch.tensor([[1.0] * 9 + [11.0], [2.0] * 10], dtype=torch.float64)
    assert oal_groups.top_share(c).tolist() == pytest.approx([0.55, 0.1])
    assert oal_groups.top_share(c, frac=0.2).tolist() == pytest.approx([0.6, 0.2])
    # D = 16: 10% is 1.6 dimensions, rounded to 2: (1 + 3) / (15 + 3)
    assert oal_groups.top_share(torch.tensor([[1.0] * 15 + [3.0]])).tolist() == pytest.approx([4 / 18])


def constant_rows(c, N=8):
    """N calibration sequences that all have the mean scores c: every bootstrap resample is c itself."""
    return torch.tensor(c, dtype=torch.float64).expand(N, len(c))


def test_find_groups_hand_worked():
    """D = 16: candidates are 1 to ceil(16/4) - 1 = 3 dimensions above a boundary (t = 12, 13, 14 in the
    sorted order). With identical sequences the support of a candidate is 1 if its ratio >= 1.5, else 0."""
    # a clear outlier: ratios 1, 1, 10 -> t = 14 passes alone -> two groups, dim 15 alone
    assert oal_groups.find_groups(constant_rows([1.0] * 15 + [10.0])).tolist() == [0] * 15 + [1]
    # two moderate dims (x3) and a strong one (x10): t = 12 (ratio 3) and t = 14 (3.33) pass -> three groups
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [3.0, 3.0, 10.0])).tolist() == [0] * 13 + [1, 1, 2]
    # no outlier: ratios 1.1, 1.09, 1.17, none passes; the best-ranked (highest ratio, t = 14) is used anyway
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.1, 1.2, 1.4])).tolist() == [0] * 15 + [1]
    # a tie: ratios 1.25, 1.2, 1.25 (exact in binary); t = 12 and t = 14 tie, the lower index wins
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.25, 1.5, 1.875])).tolist() == [0] * 13 + [1, 1, 1]
    # never more than ceil(D/4) - 1 = 3 dims above the lowest boundary: a 4-dim outlier block is out of reach
    groups = oal_groups.find_groups(constant_rows([1.0] * 12 + [10.0] * 4))
    assert groups.max() == 1 and groups.sum() <= 3
    # the budget study's rule: the G - 1 best-ranked boundaries whatever their ratio: t = 14 (1.17), then t = 12 (1.1)
    assert oal_groups.find_groups(constant_rows([1.0] * 13 + [1.1, 1.2, 1.4]), budget=3).tolist() == [0] * 13 + [1, 1, 2]
    assert oal_groups.find_groups(constant_rows([1.0] * 16), budget=1).eq(0).all()


def test_find_groups_thresholds_include_their_values(monkeypatch):
    """The published rule keeps a boundary whose ratio is 1.5 or more and whose support is 90% or more (the
    equal values included), at most 4 of them, in rank order; a dimension's group counts the kept ones below it."""
    ranked = [([7], 1.5, 0.9), ([6, 7], 1.49, 1.0), ([5, 6, 7], 3.0, 0.89), ([4, 5, 6, 7], 2.0, 1.0)]
    monkeypatch.setattr(oal_groups, "rank_cuts", lambda scores, min_ratio, seed: ranked)
    assert oal_groups.find_groups(torch.ones(4, 8)).tolist() == [0] * 4 + [1, 1, 1, 2]
    ranked[:0] = [([3, 4, 5, 6, 7], 2.0, 1.0)] * 4  # four more that pass first: the cap of 4 leaves out the rest
    assert oal_groups.find_groups(torch.ones(4, 8)).tolist() == [0] * 3 + [4] * 5


def test_find_groups_support_comes_first():
    """A gap seen in only half the sequences (mean ratio 1.55) has bootstrap support below 90%: it is not
    kept by the thresholds, but as the only candidate with any support it ranks first and is the forced one.
    And support ranks before the ratio: a huge gap that one sequence makes ranks below a modest one in all."""
    g = torch.Generator().manual_seed(0)
    noisy = 1 + 0.05 * torch.rand(32, 16, generator=g)
    noisy[::2, 15] *= 2.1
    ranked = oal_groups.rank_cuts(noisy)
    assert ranked[0][0] == [15] and ranked[0][1] >= 1.5 and 0 < ranked[0][2] < 0.9
    assert all(support == 0 for _, _, support in ranked[1:])
    assert oal_groups.find_groups(noisy).tolist() == [0] * 15 + [1]
    # support before ratio: a gap of 2 in every sequence (three dims above it) outranks a gap of 32 on the
    # means that one sequence of 32 makes (dim 15 at 2000 there), which a resample misses about 1 time in 3
    rows = constant_rows([1.0] * 13 + [2.0, 2.0, 2.0], N=32).clone()
    rows[0, 15] = 2000.0
    (first, ratio_1, support_1), (second, ratio_2, support_2) = oal_groups.rank_cuts(rows)[:2]
    assert (first, ratio_1, support_1) == ([13, 14, 15], 2.0, 1.0)
    assert second == [15] and ratio_2 > 30 and 0.5 < support_2 < 0.9
    assert oal_groups.find_groups(rows, budget=2).tolist() == [0] * 13 + [1, 1, 1]
    # a resample supports a boundary only with the same dims above its gap: sequence A's outlier is dim 3,
    # B's dim 2 (the mean's top). A gap passes in AA and BB resamples, but only BB (1 in 4) has dim 2 above it
    one, = oal_groups.rank_cuts(torch.tensor([[1.0, 1, 1, 10], [1.0, 1, 12, 1]]))
    assert one[0] == [2] and 0.1 < one[2] < 0.4


def test_oal_grouping_then_calibration_keeps_the_best_checkpoint():
    """OAL grouped from the calibration q, k (2-5 groups per head, the outlier out of the bulk), then
    calibrated with held-out windows: the kept checkpoint's held-out loss is at most the Taylor start's."""
    q, k, v = qkv(B=4, T=24, D=16, Dv=16, seed=3)
    q[..., 3] *= 6  # an outlier dimension in every head
    fmap = fm.make_feature_map("oal", 16, 2).double()
    val = qkv(B=2, T=24, D=16, Dv=16, seed=4)
    val[0][..., 3] *= 6
    groups = fmap.set_groups_from(q, k)
    distill.distill_feature_map(fmap, q, k, v, loss="mse", steps=30, val=tuple(val))
    assert all(2 <= int(g.max()) + 1 <= 5 for g in groups)
    assert (groups[:, 3] > 0).all()  # the outlier is out of the bulk
    kept = distill.distill_loss(fmap, *val, loss="mse").item()
    fresh = fm.make_feature_map("oal", 16, 2).double()
    fresh.set_groups(groups)
    start = distill.distill_loss(fresh, *val, loss="mse").item()
    assert kept <= start  # never worse than the Taylor start on held-out data
