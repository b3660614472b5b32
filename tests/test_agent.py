"""agent.py without an engine: tools, parsers, environments, observation tokens, the sandbox; the
multi-turn config keys and the rows' raw chat."""

import asyncio
import json
import os
import socket
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import agent
import sandbox
from agent import (
    PARSERS,
    BaseTool,
    Calculator,
    Environment,
    GuessNumberEnv,
    ObservationRenderer,
    OpenAIFunctionToolSchema,
    PythonTool,
    StepResult,
    ToolCall,
    ToolEnvironment,
    ToolResponse,
    end_of_turn_ids,
    evaluate_arithmetic,
    function_tool,
    load_tools,
    normalize_tool_result,
    parse_demo,
    parse_hermes,
    step_all,
    truncate_tool_text,
)
from config import TOOL_CALL_FORMATS, ConfigError, check_supported, load_config
from sandbox import run_python_sandboxed


def schema(name, **properties):
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in properties.items()}, "required": list(properties)}}}


def hermes(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# -----------------------------------------------------------------------------
# parsers


def test_the_config_names_every_parser():
    assert set(PARSERS) == set(TOOL_CALL_FORMATS)


def test_hermes_several_calls_malformed_blocks_and_content():
    text = ("Let me compute." + hermes("calc", expression="2+3") + "\n<tool_call>{not json}</tool_call>"
            + '<tool_call>{"name": "calc"}</tool_call>' + hermes("search", query="x", top_k=2)
            + '<tool_call>{"name": "calc", "arguments": "1+1"}</tool_call>' + "<tool_call>unclosed")
    content, calls = parse_hermes(text)
    # a block that is not JSON, or has no arguments, is no call (verl); arguments that are not an object
    # still make a call: the environment answers it with an error
    assert calls == [ToolCall("calc", '{"expression": "2+3"}'), ToolCall("search", '{"query": "x", "top_k": 2}'),
                     ToolCall("calc", '"1+1"')]
    assert content == "Let me compute.\n<tool_call>unclosed"
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>{bad}</tool_call>")[1] == []


def test_demo_parser():
    assert parse_demo("calc(37*48)") == ("", [ToolCall("calc", '{"expression": "37*48"}')])
    content, calls = parse_demo("first calc((1+2)*3) then calc(4) x.y(5) calc(6")
    assert [json.loads(c.arguments)["expression"] for c in calls] == ["(1+2)*3", "4"]
    assert content == "first  then  x.y(5) calc(6"  # a method call and an unclosed call are no calls
    assert parse_demo("#### 1776") == ("#### 1776", [])


@pytest.mark.parametrize("side, expected", [
    ("left", "(truncated)...6789"),  # verl >= 0.8: the side named is the side cut
    ("right", "0123...(truncated)"),
    ("middle", "01...(truncated)...89"),
])
def test_truncate_side_is_the_side_cut(side, expected):
    assert truncate_tool_text("0123456789", 4, side) == expected
    assert truncate_tool_text("0123", 4, side) == "0123"


# -----------------------------------------------------------------------------
# the tool surface and the environment


class CounterTool(BaseTool):
    """Written as a verl tool is: async, state per instance id, create_kwargs as verl 0.9 passes them."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.state, self.log = {}, []

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or uuid.uuid4().hex
        self.state[instance_id] = {"count": 0, "target": kwargs.get("create_kwargs", {}).get("target")}
        self.log.append(("create", instance_id))
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0.01)
        self.state[instance_id]["count"] += parameters["step"]
        return ToolResponse(text=f"count={self.state[instance_id]['count']}"), 0.1, {"steps": 1}

    def calc_reward(self, instance_id, **kwargs):  # sync methods are fine too
        return float(self.state[instance_id]["count"] == self.state[instance_id]["target"])

    async def release(self, instance_id, **kwargs):
        self.log.append(("release", instance_id))
        del self.state[instance_id]


def row(**tools_kwargs):
    return {"extra_info": {"tools_kwargs": {name: {"create_kwargs": kw} for name, kw in tools_kwargs.items()}}}


def test_one_instance_per_trajectory_scored_and_released_at_close():
    counter = CounterTool({}, schema("counter", step="integer"))
    env = ToolEnvironment({"counter": counter}, max_parallel_calls=4)
    assert isinstance(env, Environment)
    env.reset(row(counter={"target": 3}))
    first = env.step(hermes("counter", step=1) + hermes("counter", step=1))
    assert first.num_calls == 2 and first.num_failed_calls == 0
    assert sorted(m["content"] for m in first.messages) == ["count=1", "count=2"]
    assert first.reward == pytest.approx(0.2) and first.metrics["counter/steps"] == 2
    assert env.step(hermes("counter", step=1)).messages == [{"role": "tool", "content": "count=3"}]
    assert [e[0] for e in counter.log] == ["create"]  # created once, on first use, shared by parallel calls
    assert env.step("#### 3").messages is None  # no call: the trajectory ends
    assert env.close() == {"counter": 1.0}
    assert [e[0] for e in counter.log] == ["create", "release"] and counter.state == {}
    assert env.close() == {}  # nothing left to release
    env.reset(row(counter={"target": 9}))
    env.step(hermes("counter", step=1))
    env.reset(row())  # a reused environment releases the last trajectory's instance
    assert [e[0] for e in counter.log] == ["create", "release", "create", "release"]


class Flaky(BaseTool):
    released: list

    def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("mode") == "raise":
            raise RuntimeError("backend down")
        if parameters.get("mode") == "hang":
            time.sleep(5)
        if parameters.get("mode") == "bad-return":
            return "a", 1.0, {}, "extra"
        return "ok"

    async def calc_reward(self, instance_id, **kwargs):
        raise ValueError("no reward today")

    def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


def test_errors_and_timeouts_become_failed_observations():
    flaky = Flaky({}, schema("flaky", mode="string"))
    flaky.released = []
    env = ToolEnvironment({"flaky": flaky}, max_parallel_calls=8, timeout_s=0.5)
    env.reset({})
    start = time.monotonic()
    out = env.step(hermes("flaky", mode="raise") + hermes("flaky", mode="hang") + hermes("nope", x=1)
                   + '<tool_call>{"name": "flaky", "arguments": [1]}</tool_call>' + hermes("flaky", mode="bad-return")
                   + hermes("flaky", mode="fine"))
    assert time.monotonic() - start < 2  # the hanging call is abandoned at timeout_s
    texts = [m["content"] for m in out.messages]
    assert "RuntimeError: backend down" in texts[0]
    assert "did not answer within 0.5 s" in texts[1]
    assert "unknown tool 'nope'" in texts[2] and "flaky" in texts[2]
    assert "must be a JSON object" in texts[3]
    assert "TypeError" in texts[4]
    assert texts[5] == "ok"
    assert (out.num_calls, out.num_failed_calls) == (6, 5)
    assert env.close() == {"flaky": 0.0}  # calc_reward raised: 0, recorded, and release still ran
    assert len(flaky.released) == 1 and any("no reward today" in e for e in env.errors)


def test_calls_past_max_parallel_calls_are_dropped_before_running():
    ran = []

    @function_tool
    def slow(tag: str) -> str:
        """Sleep, then echo.

        Args:
            tag: what to echo
        """
        ran.append(tag)
        time.sleep(0.3)
        return tag

    env = ToolEnvironment({"slow": slow}, max_parallel_calls=2)
    env.reset({})
    start = time.monotonic()
    out = env.step(hermes("slow", tag="a") + hermes("slow", tag="b") + hermes("slow", tag="c"))
    assert time.monotonic() - start < 0.55  # the two calls ran concurrently
    assert [m["content"] for m in out.messages] == ["a", "b"] and sorted(ran) == ["a", "b"]
    assert out.num_calls == 2 and out.metrics["dropped_calls"] == 1


def test_long_answers_are_cut_in_characters():
    env = ToolEnvironment({"calc": Calculator()}, max_tool_response_length=6, tool_response_truncate_side="right")
    env.reset({})
    assert env.step(hermes("calc", expression="10**20")).messages[0]["content"] == "100000...(truncated)"


def test_tool_selection_and_schemas_for_the_prompt():
    tools = {"calc": Calculator(), "python": PythonTool({"isolation": "basic"})}
    env = ToolEnvironment(tools)
    env.reset({"extra_info": {"tool_selection": ["calc"]}})
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calc"]
    assert "unknown tool 'python'" in env.step(hermes("python", code="print(1)")).messages[0]["content"]
    env.reset({})
    assert len(env.tool_schemas) == 2


def test_step_all_runs_trajectories_concurrently():
    @function_tool
    async def nap(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "rested"

    envs = [ToolEnvironment({"nap": nap}) for _ in range(4)]
    for env in envs:
        env.reset({})
    start = time.monotonic()
    results = step_all(envs, [hermes("nap", seconds=0.3)] * 3 + ["no call"])
    assert time.monotonic() - start < 0.9
    assert [r.messages for r in results] == [[{"role": "tool", "content": "rested"}]] * 3 + [None]


def test_a_game_plugs_into_the_same_interface():
    env = GuessNumberEnv()
    assert isinstance(env, Environment)
    env.reset({"extra_info": {"secret": 37}})
    transcript = []
    for turn in ["50", "I guess 25", "37"]:
        result = env.step(turn)
        transcript.append(result.messages)
    assert transcript == [[{"role": "user", "content": "lower"}], [{"role": "user", "content": "higher"}], None]
    assert result.reward == 1.0 and env.close() == {"solved": 1.0, "guesses": 3.0}
    env.reset({"extra_info": {"secret": 5}})
    assert env.step("no idea") == StepResult(None) and env.close()["solved"] == 0.0


def test_function_tools_schema_and_return_shapes():
    @function_tool("multiply")
    def mul(a: int, b: int = 2) -> dict:
        """Multiply two numbers.

        Args:
            a: the first factor
            b: the second factor
        """
        return {"product": a * b}

    assert mul(3, 4) == {"product": 12}  # still a function
    assert mul.name == "multiply" and mul.tool_schema.function.parameters.required == ["a"]
    assert "return" not in mul.tool_schema.function  # as verl's schema: no return type in the prompt
    assert json.loads(json.dumps(mul.tool_schema))["function"]["description"] == "Multiply two numbers."
    assert normalize_tool_result("x") == (ToolResponse("x"), 0.0, {})
    assert normalize_tool_result({"a": 1})[0].text == '{"a": 1}'
    assert normalize_tool_result(("x", None, None)) == (ToolResponse("x"), 0.0, {})
    assert normalize_tool_result((ToolResponse("y"), 0.5, {"m": 1})) == (ToolResponse("y"), 0.5, {"m": 1})
    with pytest.raises(TypeError):
        normalize_tool_result(())
    env = ToolEnvironment({"multiply": mul})
    env.reset({})
    assert env.step(hermes("multiply", a=6, b=7)).messages[0]["content"] == '{"product": 42}'
    assert "TypeError" in env.step(hermes("multiply", c=1)).messages[0]["content"]

    def undocumented(x: int) -> int:
        return x

    def variadic(*args: int) -> int:
        """Sum.

        Args:
            args: numbers
        """
        return sum(args)

    with pytest.raises(ValueError, match="undocumented.*docstring"):
        function_tool(undocumented)
    with pytest.raises(ValueError, match=r"\*args"):
        function_tool(variadic)


def test_schema_reads_like_verls_model():
    s = OpenAIFunctionToolSchema.model_validate(schema("calc", expression="string"))
    assert s.function.name == "calc" and s.function.parameters.properties.expression.type == "string"
    assert s.model_dump() == schema("calc", expression="string") and isinstance(s, dict)
    with pytest.raises(ValueError, match="no name"):
        OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"description": "x"}})


def test_load_tools_from_verls_yaml_and_a_function_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools_dir").mkdir()
    (tmp_path / "tools_dir" / "my_echo_tools.py").write_text(textwrap.dedent("""
        from agent import BaseTool, ToolResponse

        class Echo(BaseTool):
            async def execute(self, instance_id, parameters, **kwargs):
                return ToolResponse(text=self.config["prefix"] + parameters["text"]), 0.0, {}
    """))
    yaml_file = tmp_path / "tools_dir" / "tools.yaml"
    yaml_file.write_text(textwrap.dedent("""
        tools:
          - class_name: my_echo_tools.Echo
            config: {type: native, prefix: "> "}
            tool_schema:
              type: function
              function: {name: echo, description: Echo., parameters: {type: object, properties: {text: {type: string}}}}
          - class_name: agent.Calculator
            config: {type: native}
    """))
    functions = tmp_path / "fns.py"
    functions.write_text(textwrap.dedent('''
        def shout(text: str) -> str:
            """Upper-case the text.

            Args:
                text: what to shout
            """
            return text.upper()

        def _helper():
            pass
    '''))
    tools = load_tools(str(yaml_file), str(functions))
    assert sorted(tools) == ["calc", "echo", "shout"]  # the YAML's module is found beside the YAML
    env = ToolEnvironment(tools, max_parallel_calls=3)
    env.reset({})
    out = env.step(hermes("echo", text="hi") + hermes("calc", expression="37*48") + hermes("shout", text="hey"))
    assert [m["content"] for m in out.messages] == ["> hi", "1776", "HEY"]

    decorated = tmp_path / "decorated.py"
    decorated.write_text(textwrap.dedent('''
        from agent import function_tool

        @function_tool
        def echo(text: str) -> str:
            """Echo.

            Args:
                text: the text
            """
            return text

        def not_a_tool(x):
            return x
    '''))
    assert list(load_tools(None, str(decorated))) == ["echo"]  # decorated functions only, when there are any
    with pytest.raises(ConfigError, match="two tools are named 'echo'"):
        load_tools(str(yaml_file), str(decorated))


@pytest.mark.parametrize("yaml_text, fragment", [
    ("tools: []", "non-empty list `tools:`"),
    ("tools:\n  - config: {}", "tools[0] needs class_name"),
    ("tools:\n  - class_name: no_such_module_xyz.Tool", "cannot import 'no_such_module_xyz'"),
    ("tools:\n  - class_name: agent.NoSuchTool", "has no tool class 'NoSuchTool'"),
    ("tools:\n  - class_name: agent.Calculator\n    config: {type: mcp}", "type: native"),
    ("tools:\n  - class_name: agent.BaseTool", "no tool_schema given"),
    ("tools:\n  - class_name: agent.Calculator\n    tool_schema: {type: function, function: {}}", "no name"),
    ("tools: [", "not valid YAML"),
])
def test_load_tools_errors_name_the_file_and_the_entry(tmp_path, yaml_text, fragment):
    f = tmp_path / "tools.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_tools(str(f))
    assert fragment in str(err.value) and "tool_config_path" in str(err.value) and str(f) in str(err.value)


def test_load_function_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="function_tool_path=.*no such"):
        load_tools(None, str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x\n")
    with pytest.raises(ConfigError, match="bad.py.*docstring"):
        load_tools(None, str(bad))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ConfigError, match="defines no tools"):
        load_tools(None, str(empty))


# -----------------------------------------------------------------------------
# observation tokens


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    import make_assets

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    make_assets.build_tokenizer_dir(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from transformers import AutoTokenizer

    import make_assets

    out = tmp_path_factory.mktemp("tok") / "tiny-chatml-tokenizer"
    make_assets.build_chatml_tokenizer_dir(out)
    return AutoTokenizer.from_pretrained(out)


def test_demo_tokenizer_observation_is_the_text_and_a_newline(char_tokenizer):
    tok = char_tokenizer
    assert end_of_turn_ids(tok) == [tok.eos_token_id]
    ids = ObservationRenderer(tok)([{"role": "tool", "content": "1776"}])
    assert tok.decode(ids) == "1776\n"
    # token-in / token-out: prompt + sampled turn + observation is what the template renders for the chat
    prompt = tok("37*48=\n", add_special_tokens=False)["input_ids"]
    sampled = tok("calc(37*48)", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    chat = [{"role": "user", "content": "37*48="}, {"role": "assistant", "content": "calc(37*48)"},
            {"role": "tool", "content": "1776"}]
    full = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert prompt + sampled + ids == full


def test_chatml_end_of_turn_is_sampled_and_the_newline_is_observation(chatml):
    tok = chatml
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)["input_ids"][0]
    assert tok.eos_token == "<|endoftext|>"  # a base-model eos: the template's end of turn must be found
    assert end_of_turn_ids(tok) == [tok.eos_token_id, im_end]
    tools = [Calculator().tool_schema.model_dump()]
    user = [{"role": "user", "content": "What is 2+3 and 4*5?"}]
    prompt = tok(tok.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    turn = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "4*5"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>')
    sampled = tok(turn, add_special_tokens=False)["input_ids"] + [im_end]  # the model stops at <|im_end|>

    # the loop decodes without special tokens; the tool tags are not special, so the calls survive
    env = ToolEnvironment({"calc": Calculator()}, max_parallel_calls=2)
    env.reset({})
    result = env.step(tok.decode(sampled, skip_special_tokens=True))
    assert [m["content"] for m in result.messages] == ["5", "20"]  # the third call was dropped
    obs = ObservationRenderer(tok, tools)(result.messages)
    assert obs == ObservationRenderer(tok)(result.messages)  # the system turn's tools do not change it
    assert obs[0] == newline and tok.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
                                                     "<tool_response>\n20\n</tool_response><|im_end|>\n"
                                                     "<|im_start|>assistant\n")
    ids, mask = prompt + sampled + obs, [0] * len(prompt) + [1] * len(sampled) + [0] * len(obs)
    assert ids[len(prompt) + len(sampled) - 1] == im_end and mask[len(prompt) + len(sampled) - 1] == 1
    assert ids[len(prompt) + len(sampled)] == newline and mask[len(prompt) + len(sampled)] == 0
    # what the template renders for the whole conversation, tool calls as messages, is exactly these ids
    calls = [{"type": "function", "function": {"name": "calc", "arguments": {"expression": e}}}
             for e in ("2+3", "4*5", "1+1")]
    chat = [*user, {"role": "assistant", "content": "", "tool_calls": calls}, *result.messages]
    full = tok(tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert ids == full


def test_a_template_that_rewrites_history_is_refused(char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)  # drops the assistant's text once anything follows it (like <think>)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                         "{% if loop.last %}{{ m['content'] }}{% endif %}<eos>"
                         "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="not prefix-preserving"):
        ObservationRenderer(tok)([{"role": "tool", "content": "x"}])


# -----------------------------------------------------------------------------
# safe tools


def test_calculator():
    assert evaluate_arithmetic("37*48") == 1776 and evaluate_arithmetic("-(2+3)**2 // 4 % 5") == 3
    assert evaluate_arithmetic("7/2") == 3.5 and evaluate_arithmetic("2**-1") == 0.5
    start = time.monotonic()
    for bad, fragment in [("9**9**9**9", "exponent"), ("(10**50)**3", "digits"), ("10**99", None), ("10**60*10**60", "larger"),
                          ("__import__('os').system('true')", "not arithmetic"), ("1/0", "division by zero"),
                          ("(-8)**0.5", "no real value"), ("1" * 201, "characters"), ("2 +", "not an arithmetic"),
                          ("a+1", "Name"), ("True+1", "Constant"), ("1e308*10", "larger")]:
        if fragment is None:  # within the limits
            assert evaluate_arithmetic(bad) == eval(bad)
            continue
        with pytest.raises(ValueError, match=fragment):
            evaluate_arithmetic(bad)
    assert time.monotonic() - start < 0.5
    env = ToolEnvironment({"calc": Calculator()}, parser="demo")
    env.reset({})
    good, bad = env.step("calc(37*48)"), env.step("calc(9**9**9**9)")
    assert good.messages == [{"role": "tool", "content": "1776"}] and good.num_failed_calls == 0
    assert "exponent" in bad.messages[0]["content"] and bad.num_failed_calls == 1


def _processes_of(pgid, uid):
    """Live processes (not zombies) in process group `pgid` or of user `uid`, read from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            uids = next(line for line in open(f"/proc/{entry}/status") if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        state, _, pgrp = stat[stat.rfind(")") + 2:].split()[:3]
        if state != "Z" and (int(pgrp) == pgid or (uid is not None and int(uids.split()[1]) == uid)):
            found.append(int(entry))
    return found


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux rlimits and /proc")
ISOLATIONS = ["full", "basic"]  # tests/test_sandbox.py: the hostile battery, as root and as an ordinary user


def sandboxed(code, isolation="full", **limits):
    limits = {"timeout_s": 3.0, "cpu_s": 1, "memory_mb": 512, **limits}
    start = time.monotonic()
    result = run_python_sandboxed(code, isolation=isolation, **limits)
    assert time.monotonic() - start < limits["timeout_s"] + 3
    assert _processes_of(result.pid, result.uid) == []  # nothing left behind, whatever the code did
    return result


@linux_only
def test_sandbox_reports_what_it_guarantees():
    plan = sandbox.sandbox_plan()
    print(plan.summary(), plan.describe())  # -s shows what this machine allows
    assert plan.mode == "full" and "bubblewrap" in plan.tool  # make installs bwrap (requirements-cpu.txt)
    assert plan.per_call_uid == (os.geteuid() == 0)


@linux_only
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sandbox_runs_code_in_a_fresh_scratch_dir(isolation):
    first = sandboxed("import os, json; open('f', 'w').write('x'); print(os.getcwd(), os.listdir('.'))", isolation)
    second = sandboxed("import os; print(os.listdir('.'))", isolation)
    assert first.exit_code == 0 and first.text.endswith("['f']\n") and second.text == "[]\n"
    if isolation == "basic":  # a directory on the host, deleted after the call (full: inside its private tmpfs)
        assert not os.path.exists(first.text.split()[0])
    assert "ZeroDivisionError" in sandboxed("1/0", isolation).text


@linux_only
@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("code, fragment", [
    ("while True: pass", "was killed"),  # the CPU limit (or the wall clock)
    ("print(9**9**9**9)", "was killed"),
    ("x = bytearray(2 * 1024**3)", "MemoryError"),
    ("while True: print('x' * 100000)", "File too large"),  # output goes to capped files
])
def test_sandbox_stops_hostile_code(isolation, code, fragment):
    result = sandboxed(code, isolation)
    assert fragment in result.text and result.exit_code != 0


@linux_only
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sandbox_survives_a_fork_bomb(isolation):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass"
    result = sandboxed(code, isolation, timeout_s=2.0)
    assert result.exit_code != 0 and "killed" in result.text


@linux_only
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sandbox_has_no_network(isolation):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        result = sandboxed(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                           "s.sendall(b'leak')", isolation)
        assert result.exit_code != 0 and ("refused" in result.text or "unreachable" in result.text
                                          or "disabled" in result.text)
        with pytest.raises(TimeoutError):
            server.accept()


@linux_only
def test_sandbox_takes_programs_by_file_and_leaves_nothing_named():
    """A program over Linux's 128 KiB limit on one argument runs (it travels in a file, not argv), and the
    call leaves no file or directory behind on the host."""
    before = {p.name for p in Path(tempfile.gettempdir()).iterdir()}
    result = sandboxed("x = 1  # " + "ab" * 70_000 + "\nprint(len(open('/proc/self/cmdline').read()))")
    assert result.exit_code == 0 and int(result.stdout) < 10_000
    assert {p.name for p in Path(tempfile.gettempdir()).iterdir()} - before == set()


@linux_only
def test_sandbox_writes_outside_its_dir_fail_or_vanish(tmp_path):
    repo_file, tmp_file = Path(agent.__file__).parent / f"sandbox-{uuid.uuid4().hex}", f"/tmp/{uuid.uuid4().hex}"
    secret = tmp_path / "secret.txt"
    secret.write_text("hidden")
    result = sandboxed(textwrap.dedent(f"""
        import os
        for path in ({str(repo_file)!r}, {tmp_file!r}):
            try:
                open(path, "w").write("x")
                print(path, "written")
            except OSError as e:
                print(path, type(e).__name__)
        print("usr", os.path.isdir("/usr/lib"))  # the system's read-only directories are there
        print("secret", os.path.exists({str(secret)!r}), "passwd", os.path.exists("/etc/passwd"))
    """))
    # the checkout is not in the sandbox (a write there fails, or lands in its tmpfs root and vanishes)
    assert not repo_file.exists()
    assert f"{tmp_file} written" in result.text and not os.path.exists(tmp_file)  # a private tmpfs, gone
    assert "usr True" in result.text and "secret False passwd False" in result.text


@linux_only
def test_python_tool_through_the_environment():
    tool = PythonTool({"timeout_s": 3, "cpu_s": 1})
    env = ToolEnvironment({"python": tool}, max_parallel_calls=2, timeout_s=10)
    env.reset({})
    start = time.monotonic()
    out = env.step(hermes("python", code="print(sum(range(10)))") + hermes("python", code="import time; time.sleep(60)"))
    assert time.monotonic() - start < 6
    assert out.messages[0]["content"] == "45\n" and "wall clock" in out.messages[1]["content"]
    assert out.num_failed_calls == 0  # the code's failure is the tool's answer, not a failed call
    assert "non-empty string" in env.step(hermes("python", code="")).messages[0]["content"]
    with pytest.raises(ValueError, match="unknown keys"):
        PythonTool({"timeout": 3})


def test_a_hung_sync_tool_is_abandoned_in_a_daemon_thread():
    release = threading.Event()

    @function_tool
    def stuck(x: int) -> str:
        """Block.

        Args:
            x: ignored
        """
        release.wait(10)
        return "late"

    env = ToolEnvironment({"stuck": stuck}, timeout_s=0.2)
    env.reset({})
    assert "did not answer within 0.2 s" in env.step(hermes("stuck", x=1)).messages[0]["content"]
    hung = [t for t in threading.enumerate() if t.name == "agent-tool-call" and t.is_alive()]
    assert hung and all(t.daemon for t in hung)  # nothing joins it at exit
    release.set()


# -----------------------------------------------------------------------------
# config keys and rows


@pytest.mark.parametrize("overrides, fragment", [
    (["actor_rollout_ref.rollout.multi_turn.format=qwen"], "format='qwen' names no tool-call parser; valid: hermes"),
    (["actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"], "valid: left (cut the head)"),
    (["actor_rollout_ref.rollout.multi_turn.tool_timeout_s=600"], "actor_rollout_ref.nccl_timeout=1800"),
    (["actor_rollout_ref.rollout.multi_turn.tool_timeout_s=0"], "tool_timeout_s=0 must be > 0"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true"], "enable=true needs tools"),
    (["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0"], "max_parallel_calls=0 must be >= 1"),
    (["actor_rollout_ref.rollout.multi_turn.max_user_turns=0"], "or null (no limit)"),
    (["actor_rollout_ref.rollout.mode=server"], "valid: sync, async"),
    (["actor_rollout_ref.rollout.multi_turn.tool_config_path=/no/such.yaml"], "tool_config_path='/no/such.yaml': no such"),
])
def test_multi_turn_config_checks(overrides, fragment):
    with pytest.raises(ConfigError) as err:  # train_files set: its own check comes first
        check_supported(load_config(None, ["data.train_files=configs/tiny_cpu.yaml", *overrides]))
    assert fragment in str(err.value)


def test_multi_turn_config_defaults_and_verls_example_keys(tmp_path):
    cfg = load_config(None)
    assert dict(cfg.actor_rollout_ref.rollout.multi_turn) == {
        "enable": False, "max_assistant_turns": None, "max_user_turns": None, "max_parallel_calls": 1,
        "max_tool_response_length": 256, "tool_response_truncate_side": "middle", "tool_config_path": None,
        "function_tool_path": None, "format": "hermes", "tool_timeout_s": 30.0, "environment": None}
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: agent.Calculator\n")
    for mode in ("sync", "async"):  # verl's multi-turn examples set these
        cfg = load_config(None, [f"actor_rollout_ref.rollout.mode={mode}", "data.return_raw_chat=true",
                                 "data.train_files=configs/tiny_cpu.yaml",
                                 "actor_rollout_ref.rollout.multi_turn.enable=true",
                                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"])
        check_supported(cfg)
    env = ToolEnvironment.from_config(cfg.actor_rollout_ref.rollout.multi_turn,
                                      load_tools(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path))
    assert (env.parser, env.timeout_s, list(env.tools)) == ("hermes", 30.0, ["calc"])


def test_prompts_keep_the_raw_chat_agent_name_and_extra_info(char_tokenizer, tmp_path):
    from data import load_prompts

    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "37*48="}]
    rows = [{"data_source": "arithmetic", "prompt": messages, "agent_name": "tool_agent",
             "reward_model": {"ground_truth": "1776"},
             "extra_info": {"index": 0, "tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "1776"}}}}},
            {"data_source": "arithmetic", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, _ = load_prompts(str(f), char_tokenizer, key="data.train_files", prompt_key="prompt",
                              max_prompt_length=64, filter_overlong=False, truncation="error")
    assert prompts[0].messages == messages and prompts[0].agent_name == "tool_agent"
    assert prompts[0].extra_info["tools_kwargs"]["calc"]["create_kwargs"] == {"ground_truth": "1776"}
    assert prompts[1].messages == [{"role": "user", "content": "1+1="}] and prompts[1].agent_name is None
    env = ToolEnvironment({"calc": Calculator()})
    env.reset(prompts[0])  # a Prompt is a row too
    assert env.step(hermes("calc", expression="37*48")).messages[0]["content"] == "1776"


def test_a_tool_that_exits_is_a_failed_call_and_later_calls_still_run():
    """sys.exit() inside a tool must not stop the tools' shared event loop (every later call would time out)."""
    import sys as _sys

    def bye(x: int) -> str:
        """Exit.

        Args:
            x: anything
        """
        _sys.exit(3)

    def echo(x: int) -> str:
        """Echo.

        Args:
            x: anything
        """
        return str(x)

    tools = {"bye": function_tool(bye), "echo": function_tool(echo)}
    first, second = ToolEnvironment(tools, timeout_s=2.0), ToolEnvironment(tools, timeout_s=2.0)
    first.reset({})
    failed = first.step('<tool_call>{"name": "bye", "arguments": {"x": 1}}</tool_call>')
    assert failed.num_failed_calls == 1 and "SystemExit" in failed.messages[0]["content"]
    second.reset({})
    assert second.step('<tool_call>{"name": "echo", "arguments": {"x": 7}}</tool_call>').messages[0]["content"] == "7"
