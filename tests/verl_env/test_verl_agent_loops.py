"""verl 0.9's own SingleTurnAgentLoop and ToolAgentLoop, unmodified, through rltool's verl loop.

Runs only where verl is installed (it cannot share rltool's environment):

    bash scripts/verl_env.sh && .venv-verl/bin/python -m pytest tests/verl_env

Elsewhere the whole module is skipped. The model is a tiny random Qwen2 and the
tokenizer the demo's byte-level BPE with a ChatML chat template that shows
tools, calls and tool responses (Qwen style, written here); nothing comes from a
hub. The tool is rltool's calculator as a verl ``BaseTool``, loaded by verl from
its tool config YAML.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "verl.experimental.agent_loop", reason="verl is not installed (scripts/verl_env.sh)"
)

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.verl import VerlAgentLoop
from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines.base import Generation, RolloutEngine
from rltool.engines.hf import HFEngine
from rltool.rollout.contract import check_group, check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, Status

REPO = Path(__file__).resolve().parents[2]
SINGLE_TURN = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"
TOOL_AGENT = "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"
CALCULATOR = {"tool_config_path": "builtin:calculator_tool.yaml", "max_assistant_turns": 3}
TASKS = [
    {"question": "What is 2 + 3?", "answer": "#### 5"},
    {"question": "What is 4 + 4?", "answer": "#### 8"},
]

# ChatML with tools: the tool list in the system turn, calls as <tool_call> JSON in the
# assistant turn, consecutive tool responses in one user turn (what verl's hermes parser
# and its Qwen continuous-token builder expect).
TOOLS_TEMPLATE = (
    "{%- set first_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools or first_system %}{{- '<|im_start|>system\\n' }}"
    "{%- if first_system %}{{- messages[0]['content'] }}{%- endif %}"
    "{%- if tools %}{{- '\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\' }}'
    "{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{- (c['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_demo_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


class CountingEngine(HFEngine):
    """The real engine, counting its generate calls (batching is part of what is tested)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_sizes: list[int] = []

    def generate(self, prompts, sampling):
        self.batch_sizes.append(len(prompts))
        return super().generate(prompts, sampling)


def assert_canonical(groups) -> None:
    for group in groups:
        assert errors(check_group(group)) == [], errors(check_group(group))
        for s in group:
            assert s.status == Status.COMPLETED, s.error
            assert errors(check_sample(s)) == []


@pytest.mark.parametrize("loop_class", [SINGLE_TURN, TOOL_AGENT])
def test_verl_loops_on_a_random_qwen2(model, tokenizer, loop_class: str) -> None:
    engine = CountingEngine(model, tokenizer)
    options = {"multi_turn": CALCULATOR} if loop_class == TOOL_AGENT else {}
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=12), task_name="verl")
    loop = VerlAgentLoop(ctx, loop_class=loop_class, reward="gsm8k", **options)
    groups = loop.generate_groups(TASKS, 3, ["g0", "g1"])
    assert_canonical(groups)
    # a random model calls no tool: one turn, every response token generated
    assert engine.batch_sizes == [6]  # 2 tasks x 3 trajectories in one engine call
    for s in (s for g in groups for s in g):
        p = len(s.prompt_ids)
        assert s.labels[p:].tolist() == s.response_ids.tolist()
        assert 1 <= len(s.response_ids) <= 12
        assert all(lp < 0 for lp in s.logprobs[p:]) and set(s.logprobs[:p]) == {0.0}
        assert s.response_model_steps.tolist() == [0] * len(s.response_ids)
        assert s.extra["num_turns"] == 2 and s.reward["source"] == "gsm8k"
    prompt = tokenizer.decode(groups[0][0].prompt_ids)
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert ('"name": "calculator"' in prompt) == (loop_class == TOOL_AGENT)  # verl passed tools


class ToolCallingEngine(RolloutEngine):
    """Calls the calculator on the first turn, answers after the tool response.

    Scripted text, so that verl's ToolAgentLoop takes its tool path; every token
    gets logprob -0.5 and the engine's step.
    """

    CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.batch_sizes: list[int] = []
        self.step = 7

    @property
    def model_step(self) -> int:
        return self.step

    def sync_weights(self, model_step: int) -> None:
        self.step = model_step

    def load_weights(self, state_dict, model_step: int) -> None:
        self.step = model_step

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        self.batch_sizes.append(len(prompts))
        response = self.tokenizer.convert_tokens_to_ids("<tool_response>")
        out = []
        for p in prompts:
            text = "#### 5" if response in p else self.CALL
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
            out.append(Generation(ids, [-0.5] * len(ids), [self.step] * len(ids), "stop", text))
        return out


def test_tool_agent_loop_tool_turn_is_unsupervised(tokenizer) -> None:
    engine = ToolCallingEngine(tokenizer)
    loop = VerlAgentLoop(
        LoopContext(
            engine,
            tokenizer,
            SamplingConfig(max_new_tokens=160),  # the trajectory's budget (verl's response_length)
            task_name="verl",
        ),
        loop_class=TOOL_AGENT,
        reward="gsm8k",
        multi_turn=CALCULATOR,
        hf_model_type="qwen2",  # no model object to read it from; picks verl's ChatML handling
    )
    [group] = loop.generate_groups(TASKS[:1], 2, ["g0"])
    assert_canonical([group])
    assert engine.batch_sizes == [2, 2]  # two turns, both trajectories in each call

    s = group[0]
    ids, labels = np.asarray(s.input_ids), np.asarray(s.labels)  # [T]
    supervised = labels != IGNORE_INDEX  # [T]
    call = tokenizer.encode(ToolCallingEngine.CALL, add_special_tokens=False)
    answer = tokenizer.encode("#### 5", add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    # exactly the engine's tokens are supervised, in order, with its logprobs
    assert ids[supervised].tolist() == call + eos + answer + eos
    assert np.asarray(s.logprobs)[supervised].tolist() == [-0.5] * supervised.sum()
    assert set(np.asarray(s.logprobs)[~supervised].tolist()) == {0.0}
    # between the two turns: verl's tool response, unsupervised
    p = len(s.prompt_ids)
    gap = ids[p + len(call) + 1 : len(ids) - len(answer) - 1]
    assert not supervised[p + len(call) + 1 : len(ids) - len(answer) - 1].any()
    assert tokenizer.decode(gap) == (
        "\n<|im_start|>user\n<tool_response>\n2 + 3 = 5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert s.response_model_steps.tolist() == [7] * len(s.response_ids)
    assert s.extra["num_turns"] == 4  # user, assistant, tool, assistant
    assert s.extra["tool_rewards"] == [0.0]
    assert s.reward["correct"] is True  # judged on the last turn, "#### 5"
    assert loop.pop_metrics()["verl/turns_mean"] == 4.0


@pytest.mark.slow
def test_verl_tool_recipe_trains(tmp_path) -> None:
    """``rltool train recipes/verl_tool.yaml``, two small steps, rollouts dumped and validated."""
    rltool = [sys.executable, "-c", "from rltool.cli.app import main; main()"]
    train = subprocess.run(
        [*rltool, "train", "recipes/verl_tool.yaml", "trainer.steps=2",
         "data.prompts_per_step=4", "data.group_size=2", "data.eval_limit=4",
         "trainer.eval_every=0", f"logging.run_dir={tmp_path}", "--dump-rollouts", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    dumps = sorted(tmp_path.glob("verl_tool/rollouts/step_*.jsonl"))
    assert len(dumps) == 2
    validate = subprocess.run(
        [*rltool, "validate-rollouts", *map(str, dumps)], cwd=REPO, capture_output=True, text=True
    )
    assert validate.returncode == 0, validate.stdout[-3000:]


class RoutingToolEngine(ToolCallingEngine):
    """ToolCallingEngine whose generations carry MoE routing [C + n, 1, 2]: position t of a
    turn-u call goes to experts ((3u + t) % 8, (3u + t + 1) % 8), the last row -1, so each
    turn routes the shared positions differently."""

    def generate(self, prompts, sampling):
        gens = super().generate(prompts, sampling)
        response = self.tokenizer.convert_tokens_to_ids("<tool_response>")
        for p, g in zip(prompts, gens, strict=True):
            g.routed_experts = expected_rows(2 if response in p else 1, len(p) + len(g.token_ids))
            g.routed_experts[-1] = -1
        return gens


def expected_rows(turn: int, n: int) -> np.ndarray:
    t = np.arange(n)[:, None, None]  # [n, 1, 1]
    return np.concatenate([(3 * turn + t) % 8, (3 * turn + t + 1) % 8], axis=2)  # [n, 1, 2]


def test_tool_agent_loop_routing_is_stitched_over_its_turns(tokenizer) -> None:
    """Each token's routing is that of the turn that first fed it: turn 1 for its prompt and
    generated tokens but the last; turn 2's prefill for that last token and the tool tokens,
    then turn 2's decode; the trajectory's last token is never fed (-1)."""
    loop = VerlAgentLoop(
        LoopContext(
            RoutingToolEngine(tokenizer), tokenizer, SamplingConfig(max_new_tokens=160), "verl"
        ),
        loop_class=TOOL_AGENT,
        reward="gsm8k",
        multi_turn=CALCULATOR,
        hf_model_type="qwen2",
    )
    [group] = loop.generate_groups(TASKS[:1], 1, ["g0"])
    assert_canonical([group])
    s = group[0]
    n = len(s.input_ids)
    call = tokenizer.encode(ToolCallingEngine.CALL, add_special_tokens=False)
    first = len(s.prompt_ids) + len(call) + 1  # tokens turn 1 fed or generated
    want = expected_rows(2, n)
    want[: first - 1] = expected_rows(1, first - 1)
    want[-1] = -1
    assert s.routed_experts.shape == (n, 1, 2)
    assert s.routed_experts.tolist() == want.tolist()
