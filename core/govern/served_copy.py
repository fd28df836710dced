"""The served copy of a trained policy: a cheaper network serving runs in its place, kept
only when its decisions agree with the trained one on held-out states.

:func:`make_copy` builds a copy of one of :data:`PRECISIONS` (the same network with its
weights rounded to float16, bfloat16 or int8, or a smaller network distilled from the
trained one); :func:`stored_tensors` / :func:`float_weights` are its stored form and back;
:func:`heldout_states` walks the states agreement is measured on and :func:`agreement`
computes the figures the manifest records and the registry computes again.

Details: docs/serving.md (## The served copy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from core.base.errors import InputError
from core.rl.agent import Agent
from core.rl.common import MaskedCategorical
from core.state.features import StateEncoder, StateEncoderConfig

#: The copies ``--serve-precision`` may ask for (``full`` is the trained module itself;
#: core.govern.bundle.SERVE_PRECISIONS lists both, and bundle's manifest schema these).
PRECISIONS: tuple[str, ...] = ("float16", "bfloat16", "int8", "distilled")
#: Least share of held-out states on which the copy's most probable allowed action is the trained one's.
MIN_TOP1 = 0.99
#: Largest mean (over held-out states) of the largest gap between the two action distributions.
MAX_PROB_GAP_MEAN = 0.05
#: The walk over held-out states is seeded so that the registry draws the same states again.
STATES_SEED = 0
#: How the simulator walks the held-out episodes for the agreement figures: along the log and
#: the trained policy's greedy path (where the baseline and the policy lead a served
#: episode) and two of its sampled paths (states off those paths).
HELDOUT_PILOTS: tuple[str, ...] = ("log", "greedy", "sampled", "sampled")
#: What a manifest says of those states.
HELDOUT_STATES = ("every state of the run's held-out episodes as the simulator shows them along the log, along "
                  "the trained policy's greedy path and along two of its sampled paths (seed 0)")
#: A distilled copy learns from the training episodes walked these ways, over and over
#: (random-in-mask walks reach states the policy rarely chooses) until it has enough states.
TRAIN_PILOTS: tuple[str, ...] = ("log", "greedy", "sampled", "random")
DISTILL_STATES = 8_000
DISTILL_EPOCHS = 16
DISTILL_BATCH = 512
DISTILL_LR = 3e-3
#: Share of a batch's rows whose request is mixed with another row's (see :func:`distill`).
MIX_SHARE = 0.7
#: int8 weights are stored per row with a float32 scale under the row's name plus this.
SCALE_SUFFIX = ":scale"
#: Recomputed figures may differ from the recorded ones by float32 rounding, never more.
TOLERANCE = 1e-4
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Agreement:
    """How closely a copy reproduces the trained module on ``states`` states under their masks:
    the share where both rank the same allowed action first, the largest and the mean
    (over states) of the largest absolute gap between their action probabilities, and the
    same for the critic ensemble's mean value (the reward estimates RL-Boost compares)."""

    states: int
    top1: float
    prob_gap_max: float
    prob_gap_mean: float
    value_gap_max: float
    value_gap_mean: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problem(self) -> str | None:
        """Why a copy with these figures may not be served (None when it may)."""
        if self.top1 < MIN_TOP1:
            return (f"its most probable allowed action is the trained policy's on {self.top1:.2%} of "
                    f"{self.states} held-out states (at least {MIN_TOP1:.0%} needed)")
        if self.prob_gap_mean > MAX_PROB_GAP_MEAN:
            return (f"its action probabilities differ from the trained policy's by {self.prob_gap_mean:.3f} on "
                    f"average over {self.states} held-out states (at most {MAX_PROB_GAP_MEAN} allowed)")
        return None

    def differs_from(self, recorded: Mapping[str, Any]) -> str | None:
        """Why ``recorded`` (a manifest's figures) are not these (None when they are, to
        :data:`TOLERANCE`; the share on the same states within one state)."""
        if int(recorded.get("states", -1)) != self.states:
            return f"{recorded.get('states')} states recorded, {self.states} drawn"
        for key in ("top1", "prob_gap_max", "prob_gap_mean", "value_gap_max", "value_gap_mean"):
            want, got = recorded.get(key), getattr(self, key)
            if not math.isfinite(got):
                return f"{key} computed as {got}"
            slack = 1.0 / self.states + 1e-12 if key == "top1" else TOLERANCE * max(1.0, abs(got))
            if not isinstance(want, (int, float)) or not math.isfinite(want) or abs(want - got) > slack:
                return f"{key} recorded as {want}, computed as {got:.6g}"
        return None


# --------------------------------------------------------------------------- the states
def walk_states(tables: Any, episodes: Sequence[int], agent: Agent, pilots: Sequence[str], *, seed: int
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(obs, mask)`` of every state the simulator shows while each of ``pilots`` walks
    each of ``episodes`` from its start to its end: ``log`` follows the recorded actions,
    ``greedy`` / ``sampled`` the trained ``agent``'s most probable / drawn allowed action,
    ``random`` a uniform allowed one.  Deterministic for a seed."""
    from core.rl.sim import BatchedSim, random_masked_actions  # deferred: loads gymnasium

    starts = [int(e) for e in episodes]
    if not starts:
        raise InputError("no episodes to draw states from", field="episodes")
    parts: list[dict[str, torch.Tensor]] = []
    masks: list[torch.Tensor] = []
    for k, pilot in enumerate(pilots):
        sim = BatchedSim(tables, len(starts), seed=seed + k, episodes=starts, support_episodes="all")
        obs, mask = sim.reset(start_episodes=starts)
        gen = torch.Generator().manual_seed(seed + k)
        live = torch.ones(len(starts), dtype=torch.bool)
        for _ in range(int(tables.config.step_cap) + 1):
            parts.append({key: v[live].clone() for key, v in obs.items()})
            masks.append(mask[live].clone())
            if pilot == "log":
                action = sim.logged_actions()
            elif pilot == "random":
                action = random_masked_actions(mask, gen)
            else:
                with torch.inference_mode():
                    dist = MaskedCategorical(agent.heads(agent.state(obs))[0], mask)
                    action = dist.greedy() if pilot == "greedy" else dist.sample(gen)
            step = sim.step(action, auto_reset=False)
            live &= ~step.done
            if not bool(live.any()):
                break
            obs, mask = step.obs, step.mask
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}, torch.cat(masks)


def heldout_states(tables: Any, heldout: Sequence[int], agent: Agent) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The states agreement is measured on: the run's held-out episodes walked by
    :data:`HELDOUT_PILOTS` (never the states a distilled copy learnt from)."""
    return walk_states(tables, heldout, agent, HELDOUT_PILOTS, seed=STATES_SEED)


def agreement(full: Agent, copy: Agent, obs: Mapping[str, torch.Tensor], mask: torch.Tensor,
              *, batch: int = 4096) -> Agreement:
    """:class:`Agreement` of ``copy`` with ``full`` on ``obs`` under ``mask``."""
    n = int(mask.shape[0])
    if n == 0:
        raise InputError("no states to measure agreement on", field="states")
    same = 0
    gap_max = gap_sum = value_max = value_sum = 0.0
    with torch.inference_mode():
        for lo in range(0, n, batch):
            part = {k: v[lo:lo + batch] for k, v in obs.items()}
            m = mask[lo:lo + batch]
            lf, vf = full.heads(full.state(part))
            lc, vc = copy.heads(copy.state(part))
            pf, pc = MaskedCategorical(lf.float(), m), MaskedCategorical(lc.float(), m)
            same += int((pf.greedy() == pc.greedy()).sum())
            gap = (pf.probs - pc.probs).abs().amax(dim=1)
            value = (vf.float().mean(-1) - vc.float().mean(-1)).abs()
            gap_max, gap_sum = max(gap_max, float(gap.max())), gap_sum + float(gap.double().sum())
            value_max, value_sum = max(value_max, float(value.max())), value_sum + float(value.double().sum())
    return Agreement(states=n, top1=same / n, prob_gap_max=gap_max, prob_gap_mean=gap_sum / n,
                     value_gap_max=value_max, value_gap_mean=value_sum / n)


# --------------------------------------------------------------------------- the stored form
def stored_tensors(module: Agent, precision: str) -> dict[str, torch.Tensor]:
    """The copy's weights as they are stored: every floating tensor rounded to float16 or
    bfloat16; for int8, each matrix (a layer's weights, the action embedding) as int8 rows
    with one float32 scale per row (``name`` + :data:`SCALE_SUFFIX`), vectors in float32;
    a distilled network in float32."""
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    if precision == "distilled":
        return state
    if precision in _DTYPES:
        return {k: v.to(_DTYPES[precision]) if v.is_floating_point() else v for k, v in state.items()}
    if precision != "int8":
        raise InputError(f"unknown serve precision {precision!r}: one of full, {', '.join(PRECISIONS)}",
                         field="serve_precision")
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() == 2:
            scale = (v.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
            out[k] = torch.round(v / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[k + SCALE_SUFFIX] = scale.float().contiguous()
        else:
            out[k] = v
    return out


def float_weights(tensors: Mapping[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """The float32 weights serving computes with, from the stored form (the inverse of
    :func:`stored_tensors` up to its rounding).  ValueError when the tensors do not have
    the stored form of ``precision``."""
    if precision == "distilled":
        bad = [k for k, v in tensors.items() if v.is_floating_point() and v.dtype != torch.float32]
    elif precision in _DTYPES:
        bad = [k for k, v in tensors.items() if v.is_floating_point() and v.dtype != _DTYPES[precision]]
    elif precision == "int8":
        bad = [k for k, v in tensors.items() if v.dtype not in (torch.int8, torch.float32)]
    else:
        raise ValueError(f"unknown serve precision {precision!r}")
    if bad:
        raise ValueError(f"{bad[0]!r} is {tensors[bad[0]].dtype}, not the stored form of a {precision} copy")
    if precision != "int8":
        return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.endswith(SCALE_SUFFIX):
            if k.removesuffix(SCALE_SUFFIX) not in tensors:
                raise ValueError(f"{k!r} scales no stored matrix")
            continue
        if v.dtype == torch.int8:
            scale = tensors.get(k + SCALE_SUFFIX)
            if scale is None or v.dim() != 2 or tuple(scale.shape) != (v.shape[0],) or scale.dtype != torch.float32:
                raise ValueError(f"{k!r} is int8 without one float32 scale per row")
            out[k] = v.float() * scale[:, None]
        else:
            out[k] = v
    return out


def network(module: Agent) -> dict[str, Any]:
    """How to build the copy's network (what ``served.json`` holds beside its precision)."""
    return {"n_actions": module.n_actions, "hidden": module.hidden, "n_critics": module.n_critics,
            "encoder": module.encoder.config_dict()}


def empty_module(meta: Mapping[str, Any]) -> Agent:
    """The copy's network from ``served.json`` (:func:`network`), its weights not initialised
    (every one is loaded next)."""
    with torch.device("meta"):
        encoder = StateEncoder.from_config_dict(dict(meta["encoder"]))
        agent = Agent(int(meta["n_actions"]), encoder.config, hidden=int(meta["hidden"]),
                      n_critics=int(meta["n_critics"]))
    if agent.encoder.n_actions != int(meta["n_actions"]) or encoder.n_actions != agent.n_actions:
        raise ValueError("served.json's encoder and heads disagree on the number of actions")
    return agent.to_empty(device="cpu")


# --------------------------------------------------------------------------- making a copy
def make_copy(agent: Agent, precision: str, tables: Any, train: Sequence[int], *, seed: int = 0) -> Agent:
    """The copy of ``agent`` serving would run (eval mode, no gradients): the same network
    with the weights it would load from :func:`stored_tensors`, or a distilled one
    (:func:`distill`, on the training episodes ``train`` of ``tables``)."""
    if precision not in PRECISIONS:
        raise InputError(f"unknown serve precision {precision!r}: one of full, {', '.join(PRECISIONS)}",
                         field="serve_precision")
    if precision == "distilled":
        return distill(agent, tables, train, seed=seed)
    copy = empty_module(network(agent))
    copy.load_state_dict(float_weights(stored_tensors(agent, precision), precision))
    return copy.eval().requires_grad_(False)


def student_size(agent: Agent) -> tuple[int, int]:
    """``(encoded-state width, head width)`` of the distilled network: a quarter of the
    state and half the heads, so its per-request weights are about a tenth."""
    return max(16, agent.encoder.config.dim // 4), max(16, agent.hidden // 2)


def distill(teacher: Agent, tables: Any, train: Sequence[int], *, seed: int = 0,
            epochs: int | None = None, states: int | None = None) -> Agent:
    """A smaller network (:func:`student_size`) trained to give ``teacher``'s action
    distribution (masked cross-entropy) and critic values (squared error, in units of their
    spread) on at least ``states`` states of the training episodes ``train`` (walks of
    :data:`TRAIN_PILOTS`, repeated with new seeds).  In :data:`MIX_SHARE` of each batch's
    rows the request (intent inputs) is mixed with another row's, labelled by the teacher on
    the spot, so the copy learns the teacher's answer between the training requests, not
    only on them.  Seeded: the same run gives the same copy.  ``epochs`` and ``states``
    default to :data:`DISTILL_EPOCHS` and :data:`DISTILL_STATES`."""
    epochs = DISTILL_EPOCHS if epochs is None else int(epochs)
    states = DISTILL_STATES if states is None else int(states)
    walks: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
    drawn, rounds = 0, 0
    while drawn < states and rounds < 64:
        walks.append(walk_states(tables, train, teacher, TRAIN_PILOTS, seed=seed + 1000 * (rounds + 1)))
        drawn += int(walks[-1][1].shape[0])
        rounds += 1
    obs = {k: torch.cat([w[0][k] for w in walks]) for k in walks[0][0]}
    mask = torch.cat([w[1] for w in walks])
    with torch.inference_mode():
        value_scale = float(torch.cat([teacher.heads(teacher.state({k: v[lo:lo + 4096] for k, v in obs.items()}))[1]
                                       for lo in range(0, drawn, 4096)]).std())
    value_scale = max(value_scale, 1e-3)

    dim, hidden = student_size(teacher)
    config = {**teacher.encoder.config_dict()["config"], "dim": dim, "seed": seed}
    student = Agent(teacher.n_actions, StateEncoderConfig.from_dict(config), hidden=hidden,
                    n_critics=teacher.n_critics, seed=seed)
    # the actor's last layer starts at PPO's 0.01 scale, which leaves the layers below it
    # almost no gradient: a copy learns a distribution that is there already, so from scale 1
    last = student.actor[-1]
    assert isinstance(last, torch.nn.Linear), "the actor ends in a linear layer (core.rl.agent.Agent)"
    torch.nn.init.orthogonal_(last.weight, 1.0, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(student.parameters(), lr=DISTILL_LR)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=DISTILL_LR, pct_start=0.1,
                                                   total_steps=epochs * math.ceil(drawn / DISTILL_BATCH))
    gen = torch.Generator().manual_seed(seed)
    student.train()
    for _ in range(epochs):
        order = torch.randperm(drawn, generator=gen)
        for lo in range(0, drawn, DISTILL_BATCH):
            idx = order[lo:lo + DISTILL_BATCH]
            batch = {k: v[idx] for k, v in obs.items()}
            other = idx[torch.randperm(len(idx), generator=gen)]
            share = torch.rand(len(idx), 1, generator=gen) * (torch.rand(len(idx), 1, generator=gen) < MIX_SHARE)
            for key in ("intent_emb", "intent_rules"):
                batch[key] = (1 - share) * batch[key] + share * obs[key][other]
            m = mask[idx]
            with torch.inference_mode():
                t_logits, t_values = teacher.heads(teacher.state(batch))
                target_p = MaskedCategorical(t_logits.float(), m).probs
            target_p, t_values = target_p.clone(), t_values.float().clone()
            logits, values = student.heads(student.state(batch))
            log_p = torch.where(m, MaskedCategorical(logits, m).log_probs_all, torch.zeros_like(logits))
            loss = -(target_p * log_p).sum(1).mean() + (((values - t_values) / value_scale) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
    return student.eval().requires_grad_(False)


__all__ = ["Agreement", "HELDOUT_STATES", "MAX_PROB_GAP_MEAN", "MIN_TOP1", "PRECISIONS", "SCALE_SUFFIX",
           "agreement", "distill", "empty_module", "float_weights", "heldout_states", "make_copy", "network",
           "stored_tensors", "student_size", "walk_states"]
