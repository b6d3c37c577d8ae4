"""Multi-turn agentic rollouts (rl/agent/): tool-call parsing, the calculator, the template's rendering of what a
trajectory appends on seven real templates, the drift check, sokoban's rules on hand-worked boards, and the loop on
a real tiny model trained (here, with plain torch) to call the calculator: trained tokens exactly the generated
ones, tool output byte-exact, caps, failures and timeouts, what reaches the reward function. The GRPO trainer's
multi-turn runs are in test_agent_runs.py."""

import asyncio
import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_chat_templates import FAMILIES, TURNS, template_tokenizer

from fsdptrain.errors import ConfigError
from fsdptrain.rl.agent.interactions import EnvironmentInteraction, check_interaction_names
from fsdptrain.rl.agent.loop import AgentLoop, MultiTurnSettings, truncate_response
from fsdptrain.rl.agent.sokoban import Sokoban, parse_action
from fsdptrain.rl.agent.templates import TurnRenderer
from fsdptrain.rl.agent.tool_calls import TOOL_CALL_FORMATS, ToolCall, parse_hermes, parse_llama3_json
from fsdptrain.rl.agent.tools import BaseTool, CalculatorTool, ToolMediaError, evaluate_arithmetic, load_tools, response_text
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rewards import Scorer
from fsdptrain.rl.rollout.base import group_ids
from fsdptrain.rl.rollout.hf import HFRollout

from conftest import CALL, REPO, tool_conversation

SCHEMAS = [CalculatorTool.SCHEMA]


# ---- parsing, the calculator, truncation -------------------------------------------------------------------------
def test_hermes_tool_calls_are_parsed_and_malformed_ones_counted():
    two = CALL + '\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
    assert parse_hermes(two).calls == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("search", {"q": "x"})]
    assert parse_hermes("no call here").calls == [] and parse_hermes("no call here").malformed == 0
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "calculator"',
                 '<tool_call>{"name": "c", "arguments": [1]}</tool_call>'):
        parsed = parse_hermes(text)
        assert parsed.calls == [] and parsed.malformed == 1, text


def test_llama_json_tool_calls_are_parsed_and_malformed_ones_counted():
    both = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*34"}}; {"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'
    assert parse_llama3_json(both).calls == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("search", {"q": "x"})]
    assert parse_llama3_json("12 * 34 = 408.\n#### 408").calls == [] and parse_llama3_json("12 * 34 = 408.").malformed == 0
    for text in ('{"name": "calculator"', '{"name": "c", "parameters": [1]}', '{"parameters": {}}', '{"name": "c", "parameters": {}} and more'):
        assert parse_llama3_json(text).malformed == 1, text


@pytest.mark.parametrize("template, fmt", [("qwen2_5", "hermes"), ("qwen3", "hermes"), ("llama3_1", "llama3_json"), ("llama3_2", "llama3_json")])
def test_each_format_reads_the_calls_its_template_writes(tokenizer_dir, template, fmt):
    """The parser of each template's format reads back the tool calls that the real template renders for an
    assistant turn: the form a model trained on that template's data writes."""
    tok = template_tokenizer(tokenizer_dir, template)
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]
    conversation = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = tok.apply_chat_template(conversation[:1], tools=SCHEMAS, tokenize=False, add_generation_prompt=True)
    turn = tok.apply_chat_template(conversation, tools=SCHEMAS, tokenize=False)[len(before):]
    turn = turn[: turn.index(TURNS[template][1])]
    assert TOOL_CALL_FORMATS[fmt](turn).calls == [ToolCall("calculator", {"expression": "12 * 34"})], turn


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate_arithmetic("12 * 34") == 408 and evaluate_arithmetic("(7 + 1) / 2") == 4 and evaluate_arithmetic("7 / 2") == 3.5
    assert evaluate_arithmetic("-3 ** 2") == -9 and evaluate_arithmetic("17 % 5 + 2 // 3") == 2
    run = lambda expression: asyncio.run(CalculatorTool().execute("id", {"expression": expression}))[0]  # noqa: E731
    assert run("123*45") == "5535"
    for bad, reason in (("__import__('os')", "unsupported syntax"), ("2 ** 1000", "exponent over 64"), ("1 / 0", "division by zero"),
                        ("1 +", "not an expression"), ("x" * 201, "longer than 200")):
        assert run(bad).startswith("Error: ") and reason in run(bad), bad


def test_tool_responses_are_cut_on_the_configured_side():
    text = "0123456789"
    assert truncate_response(text, 10, "left") == text
    assert truncate_response(text, 4, "left") == "0123...(truncated)"
    assert truncate_response(text, 4, "right") == "(truncated)...6789"
    assert truncate_response(text, 4, "middle") == "01...(truncated)...89"


def test_a_tool_response_is_read_as_text_and_one_with_images_is_refused_naming_the_tool():
    from types import SimpleNamespace

    assert response_text("408", "calculator") == "408" and response_text({"text": "408", "image": None}, "calculator") == "408"
    assert response_text(SimpleNamespace(text="408", image=[], video=None), "calculator") == "408"
    with pytest.raises(ToolMediaError, match="the tool 'zoom' returned images: tool responses are read as text only"):
        response_text({"text": "here", "image": ["a picture"]}, "zoom")


def test_the_tool_yaml_loads_verls_layout(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: fsdptrain.rl.agent.tools.CalculatorTool\n    config: {type: native}\n"
                    "    tool_schema:\n      type: function\n      function:\n        name: calc\n        description: d\n"
                    "        parameters: {type: object, properties: {expression: {type: string}}}\n")
    (tool,) = load_tools(str(path)).values()
    assert isinstance(tool, CalculatorTool) and tool.name == "calc" and tool.config == {"type": "native"}
    assert tool.tool_schema.model_dump()["function"]["parameters"]["properties"] == {"expression": {"type": "string"}}
    path.write_text("tools:\n  - class_name: no.such.Tool\n")
    with pytest.raises(ConfigError, match=r"tools\[0\]: cannot import class_name 'no.such.Tool'"):
        load_tools(str(path))


# ---- what a trajectory appends is the template's own rendering -----------------------------------------------------
@pytest.mark.parametrize("template", [None, *sorted(FAMILIES)])
def test_appended_tokens_continue_the_conversation_as_the_template_renders_it(tokenizer, tokenizer_dir, template):
    """Prompt ids (with the generation prompt), an assistant turn as generated (through its end-of-turn token),
    then what the renderer appends for two tool results: the same as the template's rendering of the whole
    conversation with the next generation prompt, on SmolLM2's own template and the real ones that render tool
    messages after an assistant turn. Qwen3 renders the earlier turn otherwise once the results follow it (it drops
    the empty reasoning block of a turn that is no longer the last): there the appended part alone matches."""
    tok = tokenizer if template is None else template_tokenizer(tokenizer_dir, template)
    user = [{"role": "user", "content": "What is 12 * 34?"}]
    try:
        renderer = TurnRenderer(tok, SCHEMAS, {}, ["tool"])
    except ConfigError as e:
        assert template in ("gemma", "mistral", "phi3"), e  # no tool role (Gemma), results dropped (Phi-3), or tied to a call id (Mistral)
        return
    prompt = tok(tok.apply_chat_template(user, tools=SCHEMAS, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    turn = tok("The answer needs a tool.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(renderer.end_text)]
    results = [{"role": "tool", "content": "408"}, {"role": "tool", "content": "x = 1\n"}]
    appended = renderer.append_ids(results)
    conversation = user + [{"role": "assistant", "content": "The answer needs a tool."}] + results
    full_text = tok.apply_chat_template(conversation, tools=SCHEMAS, tokenize=False, add_generation_prompt=True)
    assert tok(full_text, add_special_tokens=False)["input_ids"][-len(appended):] == appended
    if template != "qwen3":  # (the ids before differ where BPE merges across the generation prompt's end, as Llama's `\n\n`)
        assert tok.decode(prompt + turn + appended) == full_text
    assert "408" in tok.decode(appended) and "x = 1" in tok.decode(appended)


def test_the_drift_check_catches_a_re_templated_trajectory(tokenizer):
    """A trajectory built token-in, token-out agrees with the full re-render; one re-templated as the usual bug does
    (the newline after `<|im_end|>` lost at the tool boundary) is caught in strict mode, and passes
    ignore_strippable, which ignores whitespace-only tokens."""
    renderer = TurnRenderer(tokenizer, SCHEMAS, {}, ["tool"])
    conversation = tool_conversation(12, 34, with_tool=True)
    ids = tokenizer(tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids += tokenizer(CALL, add_special_tokens=False)["input_ids"] + [end] + renderer.append_ids(conversation[2:3])
    ids += tokenizer("#### 408", add_special_tokens=False)["input_ids"] + [end]
    assert not renderer.drifts(conversation, ids, "strict")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    position = next(i for i in range(len(ids) - 1) if ids[i] == end and ids[i + 1 : i + 1 + len(newline)] == newline and i > len(ids) // 2 - 30)
    retemplated = ids[:position + 1] + ids[position + 1 + len(newline):]
    assert renderer.drifts(conversation, retemplated, "strict")
    assert not renderer.drifts(conversation, retemplated, "ignore_strippable")


# ---- sokoban -----------------------------------------------------------------------------------------------------
def test_sokoban_follows_rolls_rules_on_hand_worked_boards():
    board = "######\n#PX_O#\n#____#\n######"
    env = Sokoban.from_text(board)
    assert env.render() == board
    observation, reward, terminated, truncated, info = env.step("<answer>Right</answer>")  # pushes the box one cell, not yet on target
    assert observation == "######\n#_PXO#\n#____#\n######" and reward == pytest.approx(-0.1) and not terminated and info["action_is_valid"]
    observation, reward, terminated, truncated, info = env.step("I push it. <answer>right</answer>")  # onto the target: solved
    assert observation == "######\n#__P√#\n#____#\n######" and reward == pytest.approx(-0.1 + 1 + 10) and terminated and info["success"]
    env = Sokoban.from_text("######\n#P√__#\n#____#\n######")  # pushing a box off its target costs 1
    assert env.step("<answer>Right</answer>")[1] == pytest.approx(-0.1 - 1)
    env = Sokoban.from_text("#####\n#PX##\n#___#\n#####")  # a box against a wall does not move, nor does the player
    assert env.step("<answer>Right</answer>")[0] == "#####\n#PX##\n#___#\n#####"
    env = Sokoban.from_text("######\n#PX_O#\n#____#\n######", format_penalty=-0.5, max_steps=2)
    assert env.step("up, I think")[1:] == (-0.5, False, False, {"action_is_valid": False, "success": False})  # no answer: the penalty
    assert env.step("<answer>Jump</answer>")[1:4] == (-0.5, False, True)  # not a move; and the step limit truncates
    assert parse_action("<answer>Up</answer> then <answer> Left </answer>") == (0, -1)


def test_generated_rooms_are_reproducible_and_solvable_by_the_rules():
    for seed in range(20):
        env = Sokoban(size=6, boxes=1)
        first = env.reset(seed=seed)[0]
        assert first == Sokoban(size=6, boxes=1).reset(seed=seed)[0] and first.count("X") == 1 and first.count("P") + first.count("S") == 1
        assert solvable(env), first


def solvable(env: Sokoban) -> bool:
    """Breadth-first search over (player, boxes) with the environment's own moves."""
    start = (env.player, frozenset(env.boxes))
    seen, frontier = {start}, [start]
    while frontier:
        following = []
        for player, boxes in frontier:
            for move in ("Up", "Down", "Left", "Right"):
                env.player, env.boxes = player, set(boxes)
                if env.step(f"<answer>{move}</answer>")[2]:
                    return True
                state = (env.player, frozenset(env.boxes))
                if state not in seen:
                    seen.add(state)
                    following.append(state)
        frontier = following
    return False


# ---- the loop on a real model ------------------------------------------------------------------------------------
SETTINGS = MultiTurnSettings(max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1, max_tool_response_length=256,
                             tool_response_truncate_side="middle", format="hermes", tokenization_sanity_check_mode="strict", tool_timeout_s=5.0)


def agent_loop(model: str, tokenizer, tools: dict | None = None, interactions: dict | None = None, **settings) -> AgentLoop:
    engine = HFRollout(model, torch.device("cpu"), torch.float32, pad_id=2)
    tools = {"calculator": CalculatorTool()} if tools is None else tools
    return AgentLoop(engine, tokenizer, MultiTurnSettings(**{**vars(SETTINGS), **settings}), tools, interactions or {})


def prompts_for(tokenizer, count: int, extra_info: dict | None = None) -> list[Prompt]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"What is {i + 3} * {2 * i + 5}?"}]
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(ids, messages, "arithmetic", "408", dict(extra_info or {})))
    return prompts


def segments(generation) -> list[tuple[int, list[int]]]:
    """The response as runs of equal mask: (mask, ids)."""
    runs = []
    for token, mask in zip(generation.response_ids, generation.response_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


@pytest.mark.slow
def test_trajectories_train_exactly_the_generated_tokens_and_read_tool_output_byte_exact(tool_model, tokenizer):
    """Sampled trajectories: each generated run is exactly what the engine sampled for that turn (replayed greedily
    is not possible, so it is checked as the engine's own output for the same context, with its log-probs), each
    mask-0 run is exactly the template's rendering of the calculator's result, and a full re-render agrees."""
    loop = agent_loop(tool_model, tokenizer)
    torch.manual_seed(0)
    generations = loop.generate(prompts_for(tokenizer, 4), n=4, max_new_tokens=96, batch_size=16, calculate_log_probs=True)
    calls = [g.trace.tool_calls for g in generations]
    assert 0 < sum(calls) < len(generations), calls  # both structures sampled
    tool_block = tokenizer("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for g in generations:
        runs = segments(g)
        assert [mask for mask, _ in runs] == ([1, 0, 1] if g.trace.tool_calls else [1]), runs
        if g.trace.tool_calls:
            assert runs[1][1] == tool_block and g.trace.messages[1] == {"role": "tool", "content": "408", "trained": False}
        assert g.trace.num_turns == 1 + g.trace.assistant_turns and not g.truncated
        # Drift where, and only where, a sampled turn is not the tokenization of its own text (the template joins
        # turns at special tokens, so nothing else can re-tokenize differently).
        canonical = all(tokenizer(text, add_special_tokens=False)["input_ids"] + [2] == ids
                        for text, (mask, ids) in zip([m["content"] for m in g.trace.messages if m["trained"]], [r for r in runs if r[0]]))
        assert g.trace.drift is (not canonical)
        assert len(g.log_probs) == len(g.response_ids) and all(lp == 0.0 for lp, m in zip(g.log_probs, g.response_mask) if not m)
        assert runs[-1][1][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The generated tokens' log-probs are the policy's own for the context the engine saw (the trajectory so far).
    model = loop.engine.model
    g = next(g for g in generations if g.trace.tool_calls)
    ids = torch.tensor([g.prompt_ids + g.response_ids])
    log_probs = torch.log_softmax(model(ids).logits[0, len(g.prompt_ids) - 1 : -1].float(), -1).gather(1, ids[0, len(g.prompt_ids):, None])[:, 0]
    mask = torch.tensor(g.response_mask, dtype=torch.bool)
    # cached decoding and one whole forward round apart by ~1e-4 on this trained model's peaked logits; a stale or
    # misaligned log-prob is off by far more
    torch.testing.assert_close(torch.tensor(g.log_probs)[mask], log_probs[mask], atol=2e-4, rtol=0)


def test_turn_caps_and_the_response_budget_hold(tool_model, tokenizer):
    prompts = prompts_for(tokenizer, 2)
    torch.manual_seed(0)
    one_turn = agent_loop(tool_model, tokenizer, max_assistant_turns=1).generate(prompts, n=4, max_new_tokens=96, batch_size=8)
    assert all(g.trace.assistant_turns == 1 and all(g.response_mask) for g in one_turn)
    assert any(g.trace.tool_calls == 0 and "<tool_call>" in g.trace.messages[0]["content"] for g in one_turn)  # the call was not run
    torch.manual_seed(0)
    for budget in (10, 30, 40):
        for g in agent_loop(tool_model, tokenizer).generate(prompts, n=4, max_new_tokens=budget, batch_size=8):
            assert len(g.response_ids) <= budget and (g.truncated or g.response_ids[-1] == 2)


class FailingTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema or CalculatorTool().tool_schema)

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the backend is down")


class HangingTool(FailingTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(3600)


class RewardingTool(FailingTool):
    """A stateful tool: create takes the row's create_kwargs, each call earns a step reward, calc_reward reads the
    state, and release is recorded."""

    released: list[str] = []

    async def create(self, instance_id=None, offset=0.0, **kwargs):
        self.state = {"offset": offset, "calls": 0}
        return "instance-1", None  # newer verl tools return (id, ToolResponse)

    async def execute(self, instance_id, parameters, **kwargs):
        self.state["calls"] += 1
        return {"text": "408"}, 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return self.state["offset"] + self.state["calls"]

    async def release(self, instance_id, **kwargs):
        RewardingTool.released.append(instance_id)


def test_failing_and_hanging_tools_answer_the_model_and_are_counted(tool_model, tokenizer):
    prompts = prompts_for(tokenizer, 2)
    torch.manual_seed(0)
    failing = agent_loop(tool_model, tokenizer, {"calculator": FailingTool({}, None)}).generate(prompts, n=4, max_new_tokens=96, batch_size=8)
    called = [g for g in failing if g.trace.tool_calls]
    assert called and all(g.trace.tool_errors == g.trace.tool_calls for g in called)
    assert called[0].trace.messages[1]["content"] == "Error: RuntimeError: the backend is down"
    start = time.monotonic()
    torch.manual_seed(0)
    hanging = agent_loop(tool_model, tokenizer, {"calculator": HangingTool({}, None)}, tool_timeout_s=0.5).generate(prompts, n=4, max_new_tokens=96,
                                                                                                                    batch_size=8)
    assert time.monotonic() - start < 30  # each turn's calls run together, each cut at 0.5 s
    called = [g for g in hanging if g.trace.tool_calls]
    assert called and all(g.trace.tool_timeouts == g.trace.tool_calls for g in called)
    assert called[0].trace.messages[1]["content"] == "Error: the tool calculator did not answer within 0.5 s"


def test_tool_rewards_and_scores_reach_the_reward_function(tool_model, tokenizer):
    extra = {"tools_kwargs": {"calculator": {"create_kwargs": {"offset": 10.0}}}}
    loop = agent_loop(tool_model, tokenizer, {"calculator": RewardingTool({}, None)})
    torch.manual_seed(0)
    prompts = prompts_for(tokenizer, 1, extra)
    generations = loop.generate(prompts, n=8, max_new_tokens=96, batch_size=8)
    seen = []

    def reward(data_source, solution, ground_truth, extra_info):
        seen.append(extra_info)
        return float(sum(extra_info["tool_rewards"]) + extra_info["rollout_reward_scores"].get("calculator", 0.0))

    scores = Scorer(reward, tokenizer, overlong=None)(generations, prompts, group_ids(len(prompts), 8), "step 1")
    for g, scored, info in zip(generations, scores, seen):
        assert info["num_turns"] == g.trace.num_turns and info["tools_kwargs"] == extra["tools_kwargs"]
        assert scored["score"] == (0.25 + 11.0 if g.trace.tool_calls else 0.0)
        assert scored["response_length"] == sum(g.response_mask) < len(g.response_ids) or not g.trace.tool_calls
    assert RewardingTool.released == ["instance-1"] * sum(1 for g in generations if g.trace.tool_calls)


def test_an_environment_answers_each_turn_until_its_cap(tool_model, tokenizer):
    """Sokoban through the gym adapter: each assistant turn is an action (the tiny model writes none that parses:
    the format penalty), each observation a user message with mask 0, the trajectories of a row share its seed,
    and the turn scores reach the trajectory. As in verl, the model answers the last reply the cap allows, and
    that turn is not answered."""
    sokoban = EnvironmentInteraction({"name": "sokoban", "env": "fsdptrain.rl.agent.sokoban.Sokoban", "env_config": {"format_penalty": -0.2}})
    loop = agent_loop(tool_model, tokenizer, tools={}, interactions={"sokoban": sokoban}, max_user_turns=2)
    prompts = prompts_for(tokenizer, 1, {"interaction_kwargs": {"seed": 7}})
    check_interaction_names(prompts, {"sokoban": sokoban}, "data.train_files")  # a row without a name: the only interaction
    assert prompts[0].extra_info["interaction_kwargs"]["name"] == "sokoban"
    with pytest.raises(ConfigError, match=r"data.val_files row 0: extra_info.interaction_kwargs.name='chess' names no interaction"):
        check_interaction_names(prompts_for(tokenizer, 1, {"interaction_kwargs": {"name": "chess"}}), {"sokoban": sokoban}, "data.val_files")
    torch.manual_seed(0)
    board = Sokoban().reset(seed=7)[0]
    for g in loop.generate(prompts, n=3, max_new_tokens=200, batch_size=3):
        assert g.trace.assistant_turns == 3 and g.trace.user_turns == 2 and g.trace.turn_scores == [-0.2, -0.2]
        assert [m["role"] for m in g.trace.messages] == ["assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in g.trace.messages if m["role"] == "user"] == [board, board] and g.trace.success is False
        assert [mask for mask, _ in segments(g)] == [1, 0, 1, 0, 1]
    assert sokoban.episodes == {}  # finalized
    assert (REPO / "fsdptrain/rl/agent/sokoban.py").exists() and json.dumps(board)


@pytest.mark.slow
def test_evaluate_answers_with_the_tool(tmp_path, tool_model):
    """`python -m fsdptrain.evaluate --tool-config`: greedy trajectories through the loop, each record with its turns."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i + 3} * {2 * i + 5}?"}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": "408"}} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rl_test.parquet")
    (tmp_path / "calculator_tool.yaml").write_text("tools:\n  - class_name: fsdptrain.rl.agent.tools.CalculatorTool\n")
    out = tmp_path / "answers.jsonl"
    result = subprocess.run([sys.executable, "-m", "fsdptrain.evaluate", tool_model, str(tmp_path / "rl_test.parquet"), "--tool-config",
                             str(tmp_path / "calculator_tool.yaml"), "--max-turns", "3", "--max-new-tokens", "96", "--out", str(out)],
                            cwd=REPO, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(out)]
    assert len(records) == 6 and "arithmetic" in result.stdout
    assert any(record["tool_calls"] for record in records)
    for record in records:
        roles = ["assistant", "tool", "assistant"] if record["tool_calls"] else ["assistant"]
        assert [t["role"] for t in record["turns"]] == roles and record["response"].endswith("#### 408")
        assert record["tool_calls"] == 0 or record["turns"][1]["content"] == "408"


def test_each_row_is_answered_by_the_loop_its_agent_name_names(tool_model, tokenizer):
    """verl's `agent_name`: in one batch, rows naming single_turn_agent get the engine's one turn, rows naming
    tool_agent the multi-turn loop's trajectories, and a user's registered loop its own answers, each in the row's
    place (n in a row) and each what its loop gives the row alone."""
    from fsdptrain.rl.agent.loop import AGENT_LOOPS, LoopContext
    from fsdptrain.rl.rollout.base import Generation
    from fsdptrain.rl.sampling import RolloutRequest, generate

    @AGENT_LOOPS.register("echo_test")
    def echo(context):
        class Echo:
            def generate(self, prompts, *, n, **request):
                return [Generation(p.ids, p.ids[-3:], [1, 1, 1], None, False) for p in prompts for _ in range(n)]
        return Echo()

    try:
        engine = HFRollout(tool_model, torch.device("cpu"), torch.float32, pad_id=2)
        context = LoopContext(engine, tokenizer, SETTINGS, {"calculator": CalculatorTool()}, {}, {})
        loops = {name: AGENT_LOOPS[name](context) for name in ("echo_test", "single_turn_agent", "tool_agent")}
        prompts = prompts_for(tokenizer, 6)
        names = ["tool_agent", "single_turn_agent", "echo_test", "single_turn_agent", "tool_agent", "echo_test"]
        for prompt, name in zip(prompts, names):
            prompt.agent_name = name
        request = RolloutRequest(n=2, max_new_tokens=96, batch_size=8, temperature=1.0, top_p=1.0, top_k=-1, do_sample=False,
                                 calculate_log_probs=False)
        generations = generate(engine, loops, prompts, request)
        assert len(generations) == 12
        for name in set(names):
            rows = [i for i, n in enumerate(names) if n == name]
            alone = loops[name].generate([prompts[i] for i in rows], n=2, max_new_tokens=96, batch_size=8, temperature=1.0, do_sample=False)
            mine = [generations[2 * i + k] for i in rows for k in range(2)]
            assert [g.response_ids for g in mine] == [g.response_ids for g in alone], name
            assert all((g.trace is not None) == (name == "tool_agent") for g in mine), name
        assert any(g.trace.tool_calls for i, g in enumerate(generations) if names[i // 2] == "tool_agent")
    finally:
        del AGENT_LOOPS.entries["echo_test"], AGENT_LOOPS.info["echo_test"]


def test_a_row_naming_no_registered_loop_is_refused_naming_the_row(tmp_path, tiny_llama, tokenizer):
    from hydra import compose, initialize_config_module

    from fsdptrain.distributed.mesh import World
    from fsdptrain.trainer.grpo import load_rl_prompts
    from fsdptrain.trainer.grpo_plan import plan_grpo, read_grpo_config

    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "data_source": "arithmetic", "reward_model": {"ground_truth": "4"},
             "agent_name": name} for name in (None, "single_turn_agent", "react_agent")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    world = World(0, 1, 1, torch.device("cpu"))
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = read_grpo_config(compose(config_name="grpo_trainer", overrides=[f"data.train_files={tmp_path / 'train.parquet'}",
                                                                                 f"actor_rollout_ref.model.path={tiny_llama}"]), world=world)
    plan = plan_grpo(config, world, pad_id=2)
    with pytest.raises(ConfigError, match=r"data.train_files row 2: agent_name='react_agent' is not a registered agent loop \(single_turn_agent\|tool_agent\)"):
        load_rl_prompts(plan.data, plan.default_agent_loop, [str(tmp_path / "train.parquet")], tokenizer, "data.train_files", {}, {})
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "train.parquet")
    prompts = load_rl_prompts(plan.data, plan.default_agent_loop, [str(tmp_path / "train.parquet")], tokenizer, "data.train_files", {}, {})
    assert [p.agent_name for p in prompts] == ["single_turn_agent", "single_turn_agent"]  # the default where the row names none
