"""Critic-free advantage estimators (``docs/objective.md``, "Advantages").

A group is the samples of one prompt. Groups may have lost members (failed or dropped
rollouts): every estimator works on whatever group sizes it is given, and a group of one
sample has advantage 0 under both GRPO and RLOO (there is nothing to compare it with; RLOO's
leave-one-out mean of an empty set is undefined, and 0 keeps the sample out of the gradient
instead of pushing it by its raw reward). All arithmetic is float64.

Standard deviations (GRPO's group std, the batch normalisation's std) are unbiased (divide by
n - 1) by default, as AReaL does; ``unbiased=False`` gives the population std (divide by n).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist


def _group_index(group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Dense group index per sample (first-seen order) and the number of groups."""
    seen: dict = {}
    idx = [seen.setdefault(g, len(seen)) for g in group_ids]
    return torch.tensor(idx, dtype=torch.long), len(seen)


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    estimator: str = "grpo",
    std_norm: bool = True,
    unbiased: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Per-sample scalar advantages, float64 [N].

    - ``grpo``: ``(R - mean_g) / (std_g + eps)`` with the unbiased (default) or population
      (``unbiased=False``) std (``std_norm=False``: ``R - mean_g``, Dr. GRPO). A group of one has
      advantage 0 (its centred reward is 0; std 0 by convention, the unbiased one is undefined).
    - ``rloo``: ``R_i - mean_{j != i} R_j`` = ``n / (n - 1) * (R_i - mean_g)``; 0 for n = 1.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if len(group_ids) != r.numel():
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {r.numel()}")
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r))[0].item()
        raise ValueError(f"reward of sample {bad} is not finite: {r[bad].item()}")
    if r.numel() == 0:
        return r
    gi, n_groups = _group_index(group_ids)
    cnt = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gi, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gi, r) / cnt
    centred = r - mean[gi]
    n = cnt[gi]
    if estimator == "grpo":
        if not std_norm:
            return centred
        ss = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gi, centred * centred)
        dof = (cnt - 1).clamp(min=1) if unbiased else cnt
        std = torch.where(cnt > 1, (ss / dof).sqrt(), torch.zeros_like(ss))
        return centred / (std[gi] + eps)
    if estimator == "rloo":
        return torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(centred))
    raise ValueError(f"estimator must be 'grpo' or 'rloo', got {estimator!r}")


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` (when torch.distributed is initialised), on the device
    the backend needs (the current CUDA device for nccl, CPU for gloo); returns a CPU tensor."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t.cpu()
    nccl = dist.get_backend(group) == "nccl"
    t = t.to(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    dist.all_reduce(t, group=group)
    return t.cpu()


def batch_normalize(
    advantages: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    unbiased: bool = True,
    eps: float = 1e-5,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``(A - mean) / (std + eps)`` over the whole batch, all ranks together.

    ``weights`` (e.g. each sample's number of generated tokens) makes it a token-level
    normalisation of broadcast sequence advantages: the weights count observations (frequency
    weights), so the std is that of the advantages repeated once per token. Sums of w, wA, wA^2
    are all-reduced in float64 over ``group`` when torch.distributed is initialised (each rank
    passes only its own samples). ``unbiased`` (default): divide the squared deviations by
    ``sum w - 1`` (Bessel's correction, as AReaL does); else by ``sum w`` (population std).
    """
    a = advantages.to(torch.float64)
    w = torch.ones_like(a) if weights is None else torch.as_tensor(weights, dtype=torch.float64).reshape(a.shape)
    sums = all_reduce_sum(torch.stack([w.sum(), (w * a).sum(), (w * a * a).sum()]), group)
    total_w, s1, s2 = sums.tolist()
    if total_w <= 0:
        return a.clone()
    mean = s1 / total_w
    ss = max(s2 - total_w * mean * mean, 0.0)  # sum of w (A - mean)^2
    dof = total_w - 1.0 if unbiased else total_w
    var = ss / dof if dof > 0 else 0.0
    return (a - mean) / (var**0.5 + eps)


def approx_prox_logprobs(
    behav_logprobs: torch.Tensor,
    cur_logprobs: torch.Tensor,
    behav_versions: torch.Tensor,
    theta_version: int,
) -> torch.Tensor:
    """Log-linear proximal approximation (``docs/objective.md``): ``p = b + alpha (l - b)``,
    ``alpha = clamp((v_prox - v_b) / (v_theta - v_b), 0, 1)``, ``v_prox = v_theta - 1``, alpha = 0
    where ``v_theta == v_b``. Returns fp32 with no gradient."""
    b = behav_logprobs.float()
    vb = behav_versions.to(torch.float64)
    vt = float(theta_version)
    den = vt - vb
    alpha = torch.where(den != 0, ((vt - 1 - vb) / torch.where(den != 0, den, 1.0)).clamp(0, 1), 0.0)
    return (b + alpha.float() * (cur_logprobs.detach().float() - b)).detach()
