"""
OAL's grouping of a head's dimensions (OAL Sec. 3.1, 4.2, App. B): which dimensions carry the outliers
of q . k and get their own coefficients in the grouped quadratic kernel (feature_maps.OAL).

    contribution_scores(q, k, causal)  c_l = mean over attending pairs of |q_il k_jl|, per head
    top_share(c)                       per head, the share of the contribution its top 10% of dimensions carry
    rank_cuts(scores)                  the candidate boundaries between groups, best first (bootstrap support)
    find_groups(scores)                the published rule (ratio >= 1.5, support >= 90%, at most 4 cuts), or a budget

OAL.set_groups_from(q, k) runs the first and the last per head; oal_budget.py compares groupings.
"""
import math

import torch


def contribution_scores(q, k, causal=True):
    """c_l = mean over the pairs (i, j) that attend (j <= i if causal) of |q_il k_jl|, per head:
    (B, H, T, D) -> (B, H, D).

    sum_{j<=i} |q_il| |k_jl| = |q_il| * cumsum_j |k_jl|, so this is O(T D), not O(T^2 D); over all
    pairs it is mean_i |q_il| * mean_j |k_jl|.
    """
    if not causal:
        return q.abs().mean(-2) * k.abs().mean(-2)
    T = q.shape[-2]
    pairs = T * (T + 1) / 2
    return (q.abs() * k.abs().cumsum(-2)).sum(-2) / pairs


def top_share(c, frac=0.1):
    """Per head, the share of the summed contribution that the top `frac` of dimensions carry (uniform
    scores: frac). c: (H, D) contribution scores -> (H,)."""
    share = c / c.sum(-1, keepdim=True)
    top = max(1, round(frac * c.shape[-1]))
    return share.sort(-1, descending=True).values[:, :top].sum(-1)


def rank_cuts(scores, min_ratio=1.5, bootstrap=100, seed=0):
    """The candidate group boundaries of one head, best first (OAL Sec. 4.2, App. B).

    scores: (N, D) contribution scores of N calibration sequences. Sort the mean scores ascending; a
    boundary after sorted position t puts the D-1-t highest dimensions above it. Candidates lie in the
    top quarter: 1 to ceil(D/4) - 1 dimensions above (at least 1). Each gets its gap ratio
    c_(t+1) / c_(t) on the mean scores and its bootstrap support: the fraction of resamples of the N
    sequences in which the same dimensions sit above a gap of at least min_ratio. Ranked by support,
    then ratio (both descending), then t (ascending). Returns [(dims above, ratio, support), ...].
    """
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"scores must be (N, D), one row per calibration sequence, N >= 1; got {tuple(scores.shape)}")
    N, D = scores.shape
    top = max(1, math.ceil(D / 4) - 1)
    positions = range(D - 1 - top, D - 1)
    c, order = scores.mean(0).sort()
    above = {t: frozenset(order[t + 1:].tolist()) for t in positions}
    ratio = {t: (c[t + 1] / c[t].clamp_min(1e-30)).item() for t in positions}
    support = {t: 0 for t in positions}
    gen = torch.Generator().manual_seed(seed)
    for _ in range(bootstrap):
        c_b, order_b = scores[torch.randint(N, (N,), generator=gen)].mean(0).sort()
        passing = {frozenset(order_b[t + 1:].tolist()) for t in positions if c_b[t + 1] >= min_ratio * c_b[t]}
        for t in positions:
            support[t] += above[t] in passing
    ranked = sorted(positions, key=lambda t: (-support[t], -ratio[t], t))
    return [(sorted(above[t]), ratio[t], support[t] / bootstrap) for t in ranked]


def find_groups(scores, min_ratio=1.5, min_support=0.9, max_cuts=4, budget=None, seed=0):
    """Stable-gap grouping of one head's dimensions (OAL Sec. 4.2, App. B). scores: (N, D) contribution
    scores of N calibration sequences. Returns a (D,) long tensor of group ids: 0 is the low-contribution
    bulk, higher ids hold higher-contribution dimensions (a dimension's id = how many boundaries it is above).

    The published rule: keep the ranked candidates (rank_cuts) whose ratio >= 1.5 and support >= 90%, at
    most 4, so 2-5 groups; the official code admits no other count. When no candidate passes, the code
    that still makes a second group is not released; we use the best-ranked candidate anyway (our reading
    of the enforced minimum). budget=G instead takes the G - 1 best-ranked boundaries (OAL Sec. 4.2's
    budget study), thresholds ignored.
    """
    ranked = rank_cuts(scores, min_ratio, seed=seed)
    if budget is not None:
        cuts = ranked[:budget - 1]
    else:
        cuts = [cut for cut in ranked if cut[1] >= min_ratio and cut[2] >= min_support][:max_cuts] or ranked[:1]
    groups = torch.zeros(scores.shape[1], dtype=torch.long)
    for dims, _, _ in cuts:
        groups[dims] += 1
    return groups
