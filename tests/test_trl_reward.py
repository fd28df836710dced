"""The exported reward trains a real TRL ``GRPOTrainer`` (docs/export.md, issue 29 acceptance).

A tiny random Qwen2 built from a config and a tokenizer trained here (no download) runs two GRPO
steps on CPU with ``trl_reward_funcs("tool_agent")``; the per-component means TRL logs equal the
scorer's values for the very completions the reward functions received.
"""

from __future__ import annotations

import json
import math
import time

import pytest

trl = pytest.importorskip("trl", reason="the rl extra (trl, transformers, datasets) is not installed")

from core.rewards.export import trl_reward_funcs  # noqa: E402
from core.rewards.markup import completion_messages  # noqa: E402
from core.rewards.trajectory import TrajectoryScorer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order by its id.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]
TASK = {"expected_calls": [{"name": "get_order", "arguments": {"order_id": 7}}], "communicate": ["shipped"]}
#: Words of the tiny model's vocabulary, Hermes tool-call markup among them: a random model writes
#: replies, broken calls and (rarely) whole ones, so the completions' values differ.
WORDS = ("where is my order seven it shipped yesterday please wait the parcel is on its way "
         "thank you hello can i help with anything else sorry no yes "
         '<tool_call> </tool_call> {"name": "get_order", "arguments": {"order_id": 7}}').split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([" ".join(WORDS)] * 4 + ["user assistant system"],
                            trainers.WordLevelTrainer(special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token=None, eos_token="<|im_end|>", padding_side="left",
                                   chat_template=CHAT_TEMPLATE)


def _model(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


class Recording:
    """A reward function that records each batch it is handed (and passes it on unchanged)."""

    def __init__(self, func, batches):
        self.func, self.batches, self.__name__ = func, batches, func.__name__

    def __call__(self, prompts, completions, completion_ids=None, **kwargs):
        self.batches.append({"step": kwargs["trainer_state"].global_step, "prompts": prompts,
                             "completions": completions, "tools": kwargs["tools"], "task": kwargs["task"],
                             "keys": sorted(kwargs), "completion_ids": completion_ids})
        return self.func(prompts, completions, completion_ids, **kwargs)


def test_grpo_trainer_logs_each_component_as_the_scorer_scores_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    reward = trl_reward_funcs("tool_agent")
    tokenizer = _tokenizer()
    rows = [{"prompt": [{"role": "user", "content": text}], "tools": json.dumps(TOOLS), "task": json.dumps(TASK)}
            for text in ("where is my order seven", "hello can i help", "is the parcel on its way",
                         "thank you")]
    batches: list[dict] = []
    # sync and async functions side by side: TRL runs the async ones in its event loop thread,
    # and all of them still share the batch's one scoring
    half = len(reward.funcs) // 2
    funcs = [Recording(reward.funcs[0], batches), *reward.funcs[1:half], *reward.async_funcs[half:]]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, use_cpu=True, report_to=[], save_strategy="no",
                      logging_steps=1, reward_weights=reward.weights, seed=0)
    trainer = GRPOTrainer(model=_model(tokenizer), reward_funcs=funcs, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    print(f"2 GRPO steps with the exported reward: {time.perf_counter() - started:.1f} s")

    assert [b["step"] for b in batches] == [0, 1]
    assert {"trainer_state", "log_extra", "log_metric", "tools", "task"} <= set(batches[0]["keys"])
    assert len(batches[0]["completion_ids"]) == 4
    logged = {e["step"]: e for e in trainer.state.log_history if "rewards/tool_validity/mean" in e}
    assert sorted(logged) == [1, 2]
    scorer = TrajectoryScorer("tool_agent")
    spread: set[str] = set()
    for batch in batches:
        assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in batch["completions"])
        # the trajectory is the prompt and the completion, its tool-call markup read as calls
        trajectories = [{"messages": p + completion_messages(c[0]["content"]), "tools": json.loads(t),
                         "task": json.loads(k)}
                        for p, c, t, k in zip(batch["prompts"], batch["completions"], batch["tools"], batch["task"])]
        scores = scorer.score_batch(trajectories)
        entry = logged[batch["step"] + 1]
        for name in reward.names:
            values = [s.components[name] for s in scores]
            expected = sum(values) / len(values)
            assert entry[f"rewards/{name}/mean"] == pytest.approx(expected, abs=1e-6), name
        # TRL's reward is Σ weights·funcs: the score less the part of components that do not apply
        total = sum(s.score - s.constant for s in scores) / len(scores)
        assert entry["reward"] == pytest.approx(total, abs=1e-5)
        assert not any(math.isnan(entry[f"rewards/{n}/mean"]) for n in reward.names)
        spread.update(n for n in reward.names if len({s.components[n] for s in scores}) > 1)
    assert {"tool_validity", "answered"} <= spread   # the completions differ: the means are not all alike
