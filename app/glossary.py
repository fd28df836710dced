"""The app's glossary: every technical term a page shows, with a plain label, what it means in
one or two sentences, and what a good value looks like where it has one.

Pages put the exact term in a tooltip with :func:`help_for` (``help=help_for("AUC")``); the
Glossary page lists :data:`TERMS` alphabetically and searches them with :func:`find_terms`.
Plain text only: this module imports no Streamlit, so that a test can read it at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    """One glossary entry."""

    #: What the app calls it in plain words
    label: str
    #: What it means, in one or two sentences
    meaning: str
    #: What a good value looks like ("" where the term has no value)
    good: str = ""


#: Term (as the pages and the technical docs write it) → its entry.
TERMS: dict[str, Term] = {
    "AUC": Term(
        "How well a score ranks successes above failures",
        "The chance that a randomly picked successful episode scores higher than a randomly picked failed "
        "one (area under the ROC curve).",
        "0.5 is a coin toss, 1 is perfect; above 0.7 is useful, above 0.8 is good."),
    "within-task AUC": Term(
        "Ranking within the same task",
        "The AUC over pairs of a success and a failure of the same task: whether the reward tells a good run "
        "of a task from a bad run of the same task, which is what a trainer compares.",
        "Above 0.7 is useful, above 0.8 is good; it needs tasks with both a success and a failure."),
    "all-pairs AUC": Term(
        "Ranking across all episodes",
        "The AUC over every pair of a success and a failure, whatever their tasks: easy tasks can make it look "
        "better than the within-task figure.",
        "Above 0.7 is useful; read it beside the within-task AUC."),
    "soft AUC": Term(
        "Smooth ranking figure used for tuning",
        "A smooth version of the AUC that a tuner can improve step by step (soft_auc, all_pairs).",
        "Higher is better; 0.5 is chance."),
    "Spearman's rank correlation": Term(
        "Agreement in order with a graded outcome",
        "Whether episodes with a higher score also have a higher graded outcome (a rank correlation from −1 "
        "to 1); used when outcomes are not just success or failure.",
        "Above 0.3 is useful, above 0.5 strong; 0 means no relation."),
    "Kendall's τ": Term(
        "Agreement in order (pairs)",
        "The share of pairs of episodes that score and outcome put in the same order, minus the share they "
        "put in opposite orders (−1 to 1).",
        "Above 0 agrees; above 0.3 agrees well."),
    "held-out split": Term(
        "Data kept aside for checking",
        "Episodes (grouped by task) that tuning or training never sees, so that the figures on them show how "
        "the result does on tasks it was not fitted to.",
        "The held-out figure should be close to the training one; far below means overfitting."),
    "calibration": Term(
        "Does a higher reward mean a higher chance of success?",
        "How the episode return maps to the observed success rate: a logistic curve fitted on some tasks and "
        "checked on the others.",
        "Success rate rises steadily with the return."),
    "Brier score": Term(
        "Error of the predicted success chance",
        "The mean squared difference between the predicted chance of success and what happened (0 or 1).",
        "Lower is better: 0 is perfect, 0.25 is what always saying 50% gets."),
    "90% interval": Term(
        "Range of plausible values",
        "The range the figure falls in 90% of the time when the tasks are resampled (a bootstrap interval); "
        "a wide interval means the data is too small to be sure.",
        "Narrow, and on the good side of the threshold that matters."),
    "bootstrap": Term(
        "Resampling to measure uncertainty",
        "Recomputing a figure on many random redraws of the tasks to see how much it moves."),
    "return Σγᵗr": Term(
        "Reward of an episode",
        "The sum of the step rewards of an episode, later steps discounted by γ per step (Σγᵗr), plus the "
        "episode terms of the template.",
        "Higher for the episodes you consider good."),
    "discount γ": Term(
        "How much later rewards count",
        "Each step's reward is multiplied by γ to the power of how many steps it lies ahead (γ = 0.95: a "
        "reward 10 steps later counts 60%).",
        "Close to 1 for long tasks."),
    "reward component": Term(
        "One thing the reward checks",
        "A small rule that gives each step (or each episode) a score, e.g. a valid tool call or an answer that "
        "agrees with the data; the template weighs and adds them up."),
    "reward pyramid": Term(
        "Reward template in levels",
        "Components grouped from basic (L1: valid calls) to business value (L4); a gate on a lower level can "
        "stop the levels above it from paying."),
    "gate": Term(
        "Minimum on a lower level",
        "A step earns nothing from the higher levels unless its score on this level reaches the gate (e.g. an "
        "unknown tool or a failed call)."),
    "expectation": Term(
        "A check the reward must pass",
        "An example the template states about itself (e.g. the expert scores above a reward hack); the page "
        "shows which pass.",
        "All pass."),
    "template version": Term(
        "Saved reward settings",
        "Every save of a reward template is a new numbered version (name@N); @0 is the file shipped with the "
        "workbench. Runs record the exact version they trained on."),
    "labelled share": Term(
        "Episodes with a known outcome",
        "The share of episodes whose log recorded whether they succeeded, or that a person labelled.",
        "The more the better: checking and tuning a reward needs outcomes."),
    "policy": Term(
        "Trained agent",
        "What training produces: a model that picks the next tool call (and its arguments) in each situation."),
    "PPO": Term(
        "The training method",
        "Proximal Policy Optimisation: the policy improves in small steps, each limited so that it never moves "
        "far from what it did before."),
    "advantage": Term(
        "Better or worse than expected",
        "How much better an action turned out than the critic expected in that situation; training makes "
        "actions with a positive advantage more likely."),
    "critic": Term(
        "Reward predictor",
        "The part of the model that predicts how much reward is still to come from a situation; it is the "
        "baseline the advantage is measured against."),
    "value loss": Term(
        "Reward-prediction error",
        "The mean squared error of the critic's predictions.",
        "Falls, then levels off."),
    "explained variance": Term(
        "How well the critic predicts rewards",
        "The share of the variation in returns the critic predicts (1 perfect, 0 no better than the average).",
        "Rises towards 1."),
    "policy loss": Term(
        "Policy objective",
        "PPO's clipped objective, negated; it is what each update minimises.",
        "Small; no trend needed."),
    "clip fraction": Term(
        "Share of changes cut short",
        "The share of training samples whose probability change PPO cut at its limit.",
        "Below about 0.2; higher means updates push too hard."),
    "KL divergence": Term(
        "How much an update changes the policy",
        "A measure of the difference between the policy before and after an update (KL(old ‖ new)), in nats.",
        "Small and steady, near the target."),
    "KL penalty β": Term(
        "Brake on policy changes",
        "The weight of the KL divergence in the objective; adaptive β rises when updates change the policy too "
        "much and falls when they change it little.",
        "Settles."),
    "entropy": Term(
        "Spread of the policy's choices",
        "How spread out the policy's choices are, in nats: 0 means it always makes the same choice.",
        "Stays above 0 while the policy still explores; a drop to 0 early means it stopped trying alternatives."),
    "nats": Term(
        "Unit of entropy",
        "Entropy measured with the natural logarithm: ln(2) ≈ 0.69 nats is a fair choice between two options, "
        "ln(10) ≈ 2.3 between ten."),
    "gradient norm": Term(
        "Size of each update's correction",
        "The length of the update the optimiser computes, before it is clipped.",
        "Steady, without spikes."),
    "curriculum": Term(
        "Training stages",
        "Training goes through stages: L0 behaviour cloning (copy the logs), L1 random tries, L2 an exploration "
        "bonus, L3 review of risky repeats; a stage unlocks when the one before works.",
        "Climbs as stages unlock."),
    "behaviour cloning": Term(
        "Copying the logs",
        "The first stage of training: the policy learns to do what the logged agent did, before it learns from "
        "the reward."),
    "ε-exploration": Term(
        "Share of random tries",
        "With probability ε the policy takes a random allowed action instead of its choice, to find better ones.",
        "0 outside stage L1."),
    "UCB bonus": Term(
        "Bonus for trying uncertain actions",
        "Extra reward for actions the critics disagree about (the spread of the critic ensemble): it pushes the "
        "policy to try what is not yet known.",
        "Small."),
    "mask": Term(
        "Forbidden actions",
        "Rules that rule out actions in given situations (e.g. no trade before a risk check); a masked action "
        "can never be chosen.",
        "Mask violations stay at 0."),
    "off-support rate": Term(
        "Actions unlike any in the logs",
        "The share of steps whose action no logged step took in a similar situation; the simulator is trusted "
        "only near the logs.",
        "Low."),
    "rollout": Term(
        "A batch of simulated episodes",
        "The episodes the policy plays in the simulator between two updates."),
    "env steps": Term(
        "Simulated steps",
        "Steps the policy took in the simulator: the measure of how much training was done (done / planned)."),
    "checkpoint": Term(
        "Saved state of a run",
        "The policy and trainer saved during a run, so that it can resume or be exported from there."),
    "greedy evaluation": Term(
        "Reward when always taking the best choice",
        "The policy's mean return when it always takes its most likely action instead of sampling.",
        "Rises with the average reward."),
    "best logged behaviour": Term(
        "The best agent in the logs",
        "Among the agents that produced the logs (expert, noisy, …) the one with the highest mean return on the "
        "same episodes: the bar a trained policy should clear.",
        "The policy's return at or above it."),
    "off-policy estimate": Term(
        "Estimate from the logs alone",
        "How the policy would have done on the logged episodes, by re-weighting each logged episode by how "
        "likely the policy was to act as the logged agent did (weighted importance sampling, no simulator).",
        "Trust it only when support and effective sample size are high enough; the page says so."),
    "support": Term(
        "Overlap with the logs",
        "The share of the policy's choices that the logged agent also made sometimes; without overlap the logs "
        "say nothing about the policy.",
        "High (above about 50%)."),
    "effective sample size": Term(
        "How many episodes the estimate really rests on",
        "After re-weighting, a few episodes can carry most of the weight; this counts how many equally weighted "
        "episodes the estimate is worth.",
        "Tens or more; a handful means the estimate is shaky."),
    "silhouette": Term(
        "How well groups stand apart",
        "A score from −1 to 1 of how much closer each point is to its own group (task type) than to the others.",
        "Above the shuffled baseline by 0.03 or more."),
    "t-SNE": Term(
        "Map of similar situations",
        "A 2-D picture in which steps that the encoder sees as similar lie close together; distances between "
        "far-apart clusters mean little."),
    "kNN agreement": Term(
        "Nearest steps of the same kind",
        "The share of each step's nearest neighbours (from other episodes) that have the same task type.",
        "Higher than chance."),
    "encoded state": Term(
        "What the policy sees",
        "A step turned into numbers: the request, the tools called so far and the recent trace, embedded by a "
        "sentence model."),
    "encoder gating": Term(
        "Weighting of the state's parts",
        "Whether the encoder weighs request, tool context and trace by the situation (on) or equally (off)."),
    "action token": Term(
        "Catalog action",
        "The entry of the dataset's action catalog a tool call maps to (a tool with a preset of its arguments, "
        "named like A12T3), or INVALID with the reason: the unit the policy chooses."),
    "catalog": Term(
        "Known tools and argument presets",
        "The tools of a dataset and the typical argument values seen in its logs; an action outside it is "
        "invalid."),
    "study": Term(
        "A tuning session",
        "A search for better template weights: many trials, each scoring the data with other weights."),
    "trial": Term(
        "One try of weights",
        "One set of weights a study tried, with its figure on the training and held-out tasks."),
    "bundle": Term(
        "Policy package",
        "A signed zip with a trained policy, its reward template and its evaluation, which the registry and "
        "production load."),
    "registry": Term(
        "List of policy versions",
        "Every registered policy version with its stage: candidate, approved, production or rolled back."),
    "four-eyes approval": Term(
        "A second person approves",
        "A policy must be approved by someone other than the person who trained or exported it."),
    "promotion gate": Term(
        "Checks before production",
        "A version reaches production only if its evaluation beats the logged behaviour and the current "
        "production version by the margin."),
    "rollback": Term(
        "Back to the previous version",
        "Production returns to the version promoted before the current one."),
    "review queue": Term(
        "Steps waiting for a person",
        "Steps flagged for a reviewer, who approves or rejects them; a rejection can add a mask rule."),
    # the data's own words
    "resolved": Term(
        "Task done",
        "Whether the log says the user's task was done: yes, no, or not recorded; a 0/1 or true/false success "
        "key sets it at import."),
    "final_reward": Term(
        "Logged reward",
        "The reward the log itself gives the whole episode, on the log's own scale.",
        "Higher is better."),
    "business_metric": Term(
        "Business result",
        "The business figure the log records for an episode, such as money recovered.",
        "Higher is better."),
    "sentiment": Term(
        "User sentiment",
        "How the user felt at the end, as the log scores it.",
        "Higher is happier."),
    "behaviour": Term(
        "Who acted",
        "The agent or behaviour the log names for an episode (expert, noisy, hacker …); evaluation compares a "
        "policy with each."),
    "task type": Term(
        "What the task was about",
        "The kind of task of an episode; a log without one gives its task id, so episodes of one task share it."),
    "archived dataset": Term(
        "Archived",
        "A dataset hidden from every picker whose episodes, labels and files are kept; Restore brings it back."),
    "dataset history": Term(
        "What happened to a dataset",
        "The record of every archive, restore and deletion of a dataset, refused ones included."),
    # review and governance
    "reviewer context": Term(
        "What a reviewer reads before deciding",
        "The user's request, the call with its arguments, the rule that flagged it and why, the step's reward "
        "components, the steps before it, the tool's result and how similar items were decided."),
    "flag rule": Term(
        "Why it is here",
        "The rule that put an item on the review queue, with the value that tripped it and its threshold (e.g. "
        "low confidence on a risky action, a risky action repeated while training)."),
    "similar decisions": Term(
        "How similar items were decided",
        "Decided items with the same tool, or flagged by the same rule, counted approved and rejected with their "
        "last notes."),
    "claim": Term(
        "Being reviewed",
        "A reviewer's five-minute hold on an item; when the hold runs out the item is waiting again."),
    "governance history": Term(
        "Decisions made in the workbench",
        "Every template save, outcome label, review decision, registration, approval, promotion, rollback and "
        "dataset archive or deletion, accepted or refused, with who, when and why."),
    "refused decision": Term(
        "Refused",
        "An action the workbench said no to (a role without the permission, the four-eyes rule, a failing gate, "
        "a folder it cannot write …), recorded with its reason."),
    "promotion target": Term(
        "Where promotion writes",
        "The policies folder a promotion copies the approved bundle into, and whether it can be written; the "
        "Policies page shows it before the click."),
    "run verdict": Term(
        "Is it learning? Is it better than the logs? How sure?",
        "One judgement of a run's latest checkpoint from its reward curve, its four health checks and its "
        "held-out comparison with the logs.",
        "All clear only when it learns, beats the logs, passes the checks and the comparison is firm; a policy "
        "that does not beat the best logged behaviour is never all clear."),
    "better than the logs": Term(
        "Better than the logs",
        "Whether the trained policy earns more reward per episode than the best logged behaviour on the same "
        "held-out requests, started from the same first state.",
        "Yes, by more than the simulator's run-to-run spread."),
    "how sure": Term(
        "How sure",
        "How firm the comparison with the logs is: how many held-out episodes it rests on, whether the gap is "
        "larger than the simulator's run-to-run spread, and whether the off-policy check agrees.",
        "High: 100 or more held-out episodes and an off-policy check that agrees."),
    "mask violations": Term(
        "Forbidden actions taken",
        "Actions the mask rules forbid that the policy took anyway.",
        "Always 0; anything else is a bug."),
    "random-in-mask": Term(
        "Random allowed actions",
        "A baseline that picks uniformly among the actions the masks allow: what a policy must clearly beat.",
        "The policy well above it."),
    "reward integrity": Term(
        "The rewards are sane",
        "Health check 1: no NaN or infinite rewards, and no flood of steps at the minimum reward (masks too "
        "strict leave the policy stuck on the floor).",
        "No NaN and few steps at the minimum."),
    "state-encoding fidelity": Term(
        "The policy tells task types apart",
        "Health check 2: the trained encoder places steps of the same task type together (silhouette above "
        "shuffled labels, neighbours of the same task type more often than chance).",
        "Clearly above the shuffled baseline."),
    "gradient flow": Term(
        "Every layer learns",
        "Health check 3: every layer's gradient norm in the last update is above 0.0000001 (not dead) and "
        "below 1,000 (not exploding).",
        "Every layer within those bounds."),
    "exploration quality": Term(
        "It still tries varied actions",
        "Health check 4: the entropy of the actions the policy takes over the states it visits.",
        "At least 1 nat."),
    "soft within-task AUC": Term(
        "Ranks each task's successes above its failures (smooth)",
        "The within-task AUC made smooth so that a tuner can follow it step by step (soft_within_task).",
        "Higher is better; 0.5 is chance."),
    "apply guard": Term(
        "Save asks first when the tuned weights do worse",
        "Weights whose figure on held-out episodes is below the current template's are saved only after a "
        "confirmation that names the drop.",
        ""),
    "feasible trial": Term(
        "Meets every expectation",
        "A tuning trial whose weights keep every expectation of the template (constraint value at most 0).",
        ""),
    "pruned trial": Term(
        "Cut short",
        "A trial Optuna stopped early because it was not going to beat the others.",
        ""),
    "interrupted study": Term(
        "Stopped unexpectedly",
        "A tuning study whose worker process ended without reporting why (killed, machine restarted).",
        "None: resume it or start it again."),
    "parameter importances": Term(
        "Which weights move the objective most",
        "Each tuned weight's share of the variation of the objective across trials (fANOVA).",
        ""),
    "parallel coordinates": Term(
        "Weights of the best trials",
        "One line per trial through one axis per weight, coloured by its objective.",
        ""),
    "R_final": Term(
        "End-of-episode terms",
        "The weighted terms scored once per episode (the outcome and the like); the return is "
        "a·Σγᵗr + b·R_final.",
        ""),
}


def _key(term: str) -> str:
    return term.casefold().strip()


_BY_KEY: dict[str, str] = {_key(term): term for term in TERMS}


def help_for(term: str) -> str:
    """A tooltip for ``term``: its plain label, meaning and what good looks like (KeyError for a
    term the glossary lacks: every tooltip term is in the glossary)."""
    name = _BY_KEY[_key(term)]
    entry = TERMS[name]
    text = f"{name} — {entry.label}: {entry.meaning}"
    return f"{text} Good: {entry.good}" if entry.good else text


def find_terms(query: str = "") -> list[tuple[str, Term]]:
    """The terms whose name, label, meaning or good value contain every word of ``query``
    (every term for an empty query), alphabetically (case aside; ε sorts as e)."""
    words = _key(query).split()
    found = [(name, entry) for name, entry in TERMS.items()
             if all(w in _key(" ".join((name, entry.label, entry.meaning, entry.good))) for w in words)]
    return sorted(found, key=lambda item: _key(item[0]).replace("ε", "e"))
