"""What a reviewer reads before deciding an item of the review queue (docs/governance.md,
## What a reviewer sees).

:func:`review_context` gathers, for one item of :mod:`core.guard.review`: the user's request,
the call with its arguments, the steps before it, the tool's result, the reward components of
the step (scored with a template of its dataset: :func:`choose_template` says which and why),
the rule that flagged it and why, and how similar items were decided.  A recorded or training
step is read from its dataset; a served one from the audit trail.  Every text is bounded
(:func:`clip`), so one long tool result cannot flood a page or a terminal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core import rewards
from core.access.audit import served_episodes
from core.access.choices import GENERIC_TEMPLATE, dataset_domain, last_choice, pick_template
from core.access.users import Actor
from core.base.errors import RwbError
from core.guard import review
from core.records.episodes import Episode, Step
from core.rewards.components import COMPONENTS
from core.rewards.versions import get_template, list_versions, template_names
from core.rl.runs import get_run, list_runs, run_template

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace
    from core.rewards import ScoreResult, Template

#: Longest request, arguments or tool result shown (characters).
MAX_TEXT = 2000
#: Longest text of one earlier step (its arguments, its result, a message).
MAX_STEP_TEXT = 160
#: How many earlier steps are shown (the ones nearest the flagged step).
MAX_STEPS_BEFORE = 30


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters with a marker saying how much was left out:
    ``"abc…(1,234 more characters)"``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text) - limit:,} more characters)"


def _text(value: Any, *, pretty: bool = False) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=False,
                      indent=2 if pretty else None)


@dataclass(frozen=True)
class ContextStep:
    """One step before the flagged one: a message the agent read, or what the agent did."""

    t: int
    #: "user" (a message the agent read) or "agent" (what it did).
    who: str
    #: "message" for the user; the action's kind for the agent: "tool_call", "reply", "final_answer", …
    kind: str
    tool: str | None
    #: The message, the call's arguments or the reply, shortened.
    text: str
    #: The tool's result or error, shortened (None: nothing recorded).
    result: str | None
    #: The step's reward under the context's template (None: a message, or not scored).
    reward: float | None


@dataclass(frozen=True)
class ComponentValue:
    """One reward component of the flagged step."""

    #: The template's component name ("tool_validity").
    name: str
    #: Plain label ("Tool validity").
    label: str
    #: Its weighted (and gated) contribution to the step's reward.
    value: float
    #: What it measures, in one line (the template's description, else the component's).
    description: str


@dataclass(frozen=True)
class TemplateChoice:
    """The template the reward components are scored with, and why that one."""

    #: ``name@N`` (a saved or shipped version) or ``run <id>`` for a run's stored template.
    label: str
    #: Why this one, in words: "the template this run trains against".
    why: str


@dataclass(frozen=True)
class ReviewContext:
    """Everything a reviewer reads about one review item (:func:`review_context`)."""

    item: review.ReviewItemDetail
    #: What the user asked, shortened; None when nothing was recorded.
    request: str | None
    #: Where ``request`` comes from: "the first user message", "the task's request", "the served request".
    request_source: str | None
    #: The call on one line: ``return_order(order_id="#W25", reason="…")``, shortened.
    call: str
    #: The call's arguments as indented JSON, shortened ("" for an action without arguments).
    arguments: str
    #: How exact the arguments are: None when recorded, else what they are instead.
    arguments_note: str | None
    #: The tool's result (or error) for the flagged step, shortened; None when none was recorded.
    result: str | None
    #: The steps before the flagged one, the nearest :data:`MAX_STEPS_BEFORE`, oldest first.
    steps_before: list[ContextStep]
    #: How many entries (messages and actions) come before it (``steps_before`` may show fewer).
    steps_before_total: int
    #: The step's reward components (empty when they could not be scored: see ``components_note``).
    components: list[ComponentValue]
    #: The step's reward: the sum of its step components (None when not scored).
    step_reward: float | None
    #: The template the components were scored with (None: recorded with the item, or none).
    template: TemplateChoice | None
    #: Where the components come from, or why there are none.
    components_note: str
    #: The rule that put the item on the queue, its threshold and the value that tripped it.
    rule: review.FlagRule
    #: How decided items with the same tool, and with the same rule, were decided.
    similar: list[review.SimilarDecisions]
    #: What rejecting the item blocks, in words.
    reject_blocks: str
    #: Whether the call is a training policy's own proposal (not a recorded or served call).
    proposed_by_policy: bool = False


# --------------------------------------------------------------------------- template
def _run_choice(ws: "Workspace", run_id: str, why: str) -> tuple["Template", TemplateChoice] | None:
    try:
        run = get_run(ws, run_id)
        version = run.template_version
        label = (f"{run.template_name}{version}" if version.startswith("@")
                 else f"{run.template_name} (as stored with run {run_id})")
        return run_template(ws, run_id), TemplateChoice(label=label, why=why)
    except RwbError:
        return None


def _named_choice(ws: "Workspace", spec: str, why: str) -> tuple["Template", TemplateChoice]:
    name, version = spec.partition("@")[0], spec.partition("@")[2]
    tv = get_template(ws, name, int(version) if version.isdigit() else None)
    return tv.template(), TemplateChoice(label=tv.label, why=why)


def _specs(ws: "Workspace") -> list[str]:
    """Every version of every template, as ``name@N``."""
    return [v.label for name in template_names(ws) for v in list_versions(ws, name)]


def choose_template(ws: "Workspace", item: review.ReviewItem, *, actor: Actor | None = None,
                    template: str | None = None) -> tuple["Template", TemplateChoice]:
    """The template an item's reward components are scored with, and why: ``template`` when
    given; else the one the item's training run trains against; else the one its producer
    recorded (``meta["template"]``); else the one ``actor`` used last on the dataset's domain
    (:func:`core.access.choices.last_choice`; None: the local admin of a workspace without
    users); else that of the newest training run on the
    dataset; else the newest template made for the dataset's domain, else the generic
    tool-agent template (:func:`core.access.choices.pick_template`)."""
    if template is not None:
        return _named_choice(ws, template, "the template you chose")
    if item.run_id is not None:
        found = _run_choice(ws, item.run_id, f"the template training run {item.run_id} trains against")
        if found is not None:
            return found
    recorded = item.meta.get("template")
    if isinstance(recorded, str) and recorded:
        try:
            return _named_choice(ws, recorded, "the template recorded with the item")
        except RwbError:
            pass  # a template deleted since: fall through to the dataset's
    specs = _specs(ws)
    domain = dataset_domain(ws, item.dataset)
    last = last_choice(ws, actor, "template", scope=domain)
    if last in specs:
        return _named_choice(ws, str(last), "the template you used last on this kind of data")
    if item.dataset is not None:
        for run in list_runs(ws, dataset=item.dataset, limit=5):
            found = _run_choice(ws, run.id, f"the template of the newest training run on {item.dataset}")
            if found is not None:
                return found
    pick = pick_template(ws, actor, specs, dataset=item.dataset)
    return _named_choice(ws, pick.default or GENERIC_TEMPLATE, pick.reason)


# --------------------------------------------------------------------------- the step
def _first_user_message(episode: Episode) -> str | None:
    for step in episode.steps:
        obs = step.observation
        messages = obs.get("messages") if isinstance(obs, Mapping) else None
        for m in messages if isinstance(messages, list) else []:
            if isinstance(m, Mapping) and m.get("role") == "user" and isinstance(m.get("content"), str) \
                    and m["content"].strip():
                return str(m["content"])
    return None


def _call_line(step: Step) -> str:
    action = step.action
    if action.kind != "tool_call":
        return action.kind
    if action.raw_arguments is not None and not action.params:
        return f"{action.tool}({action.raw_arguments})"
    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}"
                     for k, v in action.params.items())
    return f"{action.tool}({args})"


def _arguments(step: Step) -> str:
    action = step.action
    if action.params:
        return _text(dict(action.params), pretty=True)
    return action.raw_arguments or ""


def _result(step: Step) -> str | None:
    if step.tool_error:
        return f"error: {step.tool_error}"
    if step.tool_result is not None:
        return _text(step.tool_result, pretty=True)
    return None


def _user_lines(step: Step) -> list[str]:
    obs = step.observation
    messages = obs.get("messages") if isinstance(obs, Mapping) else None
    return [str(m.get("content")) for m in (messages if isinstance(messages, list) else [])
            if isinstance(m, Mapping) and m.get("role") == "user" and m.get("content")]


def _steps_before(steps: Sequence[Step], rewards_by_t: Mapping[int, float], request: str | None
                  ) -> list[ContextStep]:
    """The entries before the flagged step: each user message the agent read (but the
    request, shown on its own) and each action with its result and reward."""
    out: list[ContextStep] = []
    for step in steps:
        for line in _user_lines(step):
            if line == request:
                continue
            out.append(ContextStep(t=step.t, who="user", kind="message", tool=None,
                                   text=clip(line, MAX_STEP_TEXT), result=None, reward=None))
        action = step.action
        if action.kind == "tool_call":
            text = _text(dict(action.params)) if action.params else (action.raw_arguments or "")
        else:
            text = step.output_text or ""
        result = _result(step)
        out.append(ContextStep(
            t=step.t, who="agent", kind=action.kind, tool=action.tool, text=clip(text, MAX_STEP_TEXT),
            result=None if result is None else clip(" ".join(result.split()), MAX_STEP_TEXT),
            reward=rewards_by_t.get(step.t)))
    return out


# --------------------------------------------------------------------------- reward components
def _plain(name: str) -> str:
    return name.replace("_", " ").strip().capitalize()


def _description(spec: Any) -> str:
    if spec.description:
        return str(spec.description)
    cls = COMPONENTS.get(spec.component)
    return cls.description() if cls is not None else ""


def _short_description(spec: Any) -> str:
    return clip(" ".join(_description(spec).split()), 300)


def _scored_step(scored: "ScoreResult", episode_id: str, step_t: int
                 ) -> tuple[list[ComponentValue], float, dict[int, float]] | None:
    """(components of step ``step_t``, its reward, reward by t of every step of the episode);
    None when the scored data lacks the step."""
    frame = scored.frame
    e = frame.episode_index().get(episode_id)
    if e is None:
        return None
    start, n = int(frame.ep_start[e]), int(frame.ep_len[e])
    ts = frame.t[start:start + n].tolist()
    if step_t not in ts:
        return None
    position = ts.index(step_t)
    specs = {c.name: c for c in scored.template.all_components}
    comps = [ComponentValue(name=c.name, label=_plain(c.name), value=float(c.value),
                            description=_short_description(specs[c.name]) if c.name in specs else "")
             for c in scored.explain(episode_id, position)]
    reward = float(scored.step_reward[start + position])
    by_t = {int(t): float(r) for t, r in zip(ts, scored.step_reward[start:start + n].tolist())}
    return comps, reward, by_t


def _recorded_components(item: review.ReviewItem) -> list[ComponentValue]:
    return [ComponentValue(name=str(c["name"]), label=_plain(str(c["name"])), value=float(c["value"]),
                           description="recorded with the item when it was queued")
            for c in item.reward_components]


# --------------------------------------------------------------------------- the context
@dataclass
class _Found:
    """What is known of the flagged step and the steps before it."""

    request: str | None = None
    request_source: str | None = None
    step: Step | None = None
    before: Sequence[Step] = ()
    resolved: bool | None = None
    final_reward: float | None = None


def _recorded(ws: "Workspace", item: review.ReviewItem) -> tuple[_Found, Episode | None]:
    from core.records.store import WorkspaceError  # deferred: loads pandas

    if item.dataset is None or item.episode_id is None:
        return _Found(), None
    try:
        episode = ws.get_episode(item.dataset, item.episode_id)
    except WorkspaceError:
        return _Found(), None
    message = _first_user_message(episode)
    request, source = ((message, "the first user message") if message
                       else (episode.task.query or None, "the task's request"))
    step = next((s for s in episode.steps if s.t == item.step_t), None)
    before = [s for s in episode.steps if item.step_t is not None and s.t < item.step_t]
    return _Found(request=request, request_source=source if request else None, step=step, before=before,
                  resolved=episode.outcome.resolved, final_reward=episode.outcome.final_reward), episode


def _served(ws: "Workspace", item: review.ReviewItem) -> _Found:
    query = item.meta.get("query")
    found = _Found(request=query if isinstance(query, str) and query else None,
                   request_source="the served request" if isinstance(query, str) and query else None)
    if item.episode_id is None:
        return found
    try:
        for episode in served_episodes(ws, episode_id=item.episode_id):
            served = episode.meta.get("audit", [])
            at = next((k for k, r in enumerate(served) if r.get("decision_id") == item.decision_id), None)
            if at is None:
                continue
            found.step = episode.steps[at]
            found.before = episode.steps[:at]
            if found.request is None and episode.task.query:
                found.request, found.request_source = episode.task.query, "the served request"
    except RwbError:
        pass  # records kept without their decoded calls: the item's own fields are what there is
    return found


def review_context(ws: "Workspace", item_id: int, *, actor: Actor | None = None,
                   template: str | None = None) -> ReviewContext:
    """What a reviewer reads about review item ``item_id`` before deciding it (reads only).

    The reward components of a recorded or training step are scored with
    :func:`choose_template` (``template`` overrides it) over the step's whole dataset, so
    they are the figures the Reward Pyramid shows (component columns come from the
    workspace's cache when scored before); a served step shows the components recorded when
    it was served.  ``actor``: who reads (None: anyone; the queue is readable by every role),
    whose last template on the dataset's domain is the default."""
    item = review.get_item(ws, item_id)
    episode: Episode | None = None
    if item.origin == "serving":
        found = _served(ws, item)
    else:
        found, episode = _recorded(ws, item)
    step = found.step

    components: list[ComponentValue] = []
    step_reward: float | None = None
    rewards_by_t: dict[int, float] = {}
    choice: TemplateChoice | None = None
    if episode is not None and step is not None and item.dataset is not None:
        try:
            tpl, choice = choose_template(ws, item, actor=actor, template=template)
            scored = rewards.score(ws, tpl, dataset=item.dataset)
            got = _scored_step(scored, episode.episode_id, step.t)
        except RwbError as exc:
            got = None
            note = f"Could not score this step{'' if choice is None else f' with {choice.label}'}: {exc}"
        else:
            note = ("" if got is not None
                    else f"The scored data of {item.dataset} has no step {step.t} of {episode.episode_id}.")
        if got is not None:
            components, step_reward, rewards_by_t = got
            assert choice is not None  # set before scoring
            note = f"Scored with {choice.label}: {choice.why}."
    elif item.origin == "serving":
        note = "The decision engine recorded no reward components for this step."
    else:
        note = (f"Step {item.step_t} of episode {item.episode_id} is not in dataset {item.dataset}: "
                "nothing to score.")
    # A training run's item is the policy's own proposal in the state of a recorded step: the
    # call under review is the proposed action, and the logged call and its result are what
    # the recorded agent did there instead.
    proposal = item.origin == "training" and item.run_id is not None
    if proposal and item.reward_components:
        components, step_reward = _recorded_components(item), None
        note = ("The simulator's reward for the proposed action, recorded when the item was queued "
                "(the earlier steps are scored as logged).")
    if not components and item.reward_components:
        components = _recorded_components(item)
        note = ("The components recorded with the item when it was queued."
                if item.origin == "serving" else f"{note} Shown: the components recorded when it was queued.")

    if proposal:
        call = item.action_label or item.token_name or f"token {item.token_id}"
        arguments, result = "", None
        logged = "" if step is None else f"; the logged agent called {clip(_call_line(step), 200)} here instead"
        arguments_note = ("the policy's proposed action, as its action token (… stands for arguments the token "
                          f"leaves open){logged}")
    elif step is not None:
        call, arguments, arguments_note = _call_line(step), _arguments(step), None
        result = _result(step)
    else:
        call = item.action_label or item.token_name or f"token {item.token_id}"
        arguments, result = "", None
        arguments_note = ("the exact call was not recorded: this is the action token, where … "
                          "stands for arguments the token leaves open")
    repeat = None
    if item.run_id is not None:
        try:
            repeat = int(get_run(ws, item.run_id).config.get("high_risk_repeat", 3))
        except RwbError:
            repeat = None
    rule = review.flag_rule(item, repeat_threshold=repeat, resolved=found.resolved,
                            final_reward=found.final_reward)
    try:
        blocks = clip(f"{item.action_label or item.token_name or item.token_id} whenever "
                      f"{review.pattern_text(review.state_pattern(item))}", 600)
    except RwbError:
        blocks = "nothing until a state pattern is given (this item records no state)"
    before = _steps_before(found.before, rewards_by_t, found.request)
    return ReviewContext(
        item=item, request=None if found.request is None else clip(found.request),
        request_source=found.request_source, call=clip(call, 300), arguments=clip(arguments),
        arguments_note=arguments_note, result=None if result is None else clip(result),
        steps_before=before[-MAX_STEPS_BEFORE:], steps_before_total=len(before),
        components=components, step_reward=step_reward, template=choice, components_note=note,
        rule=rule, similar=review.similar_decisions(ws, item), reject_blocks=blocks,
        proposed_by_policy=proposal)
