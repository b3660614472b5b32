"""Tools and environments for multi-turn rollouts: what the rollout loop drives between two turns.

One home for the pieces that do not need the engine or a process group:

  * verl's tool surface (`BaseTool`, `ToolResponse`, `OpenAIFunctionToolSchema`): a verl tool ports
    by changing its import line to `from agent import BaseTool, ToolResponse, ...`; its methods may be
    sync or async. Plain typed functions with Google docstrings are tools too (`function_tool`).
  * `load_tools`: verl's tool YAML (`tools: [{class_name, config, tool_schema}]`) and a .py of functions.
  * `PARSERS`: assistant text -> (content, tool calls): `hermes` (Qwen2.5 / Qwen3 `<tool_call>` JSON)
    and `demo` (`calc(37*48)`, short enough for the character-level demo model).
  * `Environment`, the reset/step/close interface the loop drives once per trajectory, and
    `ToolEnvironment`, verl's tool semantics behind it (a game or a simulated user implements the
    same three methods: `GuessNumberEnv` is a small example).
  * `ObservationRenderer`: the token ids that follow the assistant's end of turn for new messages, from
    the chat template, so that generated ids are never re-tokenised (token-in / token-out).
  * Tools that cannot hurt the run: `Calculator` (an AST walk with size limits, never eval) and
    `PythonTool` (each call in a fresh interpreter, sandboxed by sandbox.py).

Nothing here raises out of `Environment.step` or `close`: a tool that raises, hangs past
`timeout_s`, is unknown or gets arguments that are not a JSON object becomes an error observation
and counts as a failed call, so no TP rank can leave a collective because of a tool.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from config import ConfigError
from sandbox import run_python_sandboxed, sandbox_plan

_MT = "actor_rollout_ref.rollout.multi_turn"
TRUNCATE_SIDES = ("left", "right", "middle")

# -----------------------------------------------------------------------------
# verl's tool surface


@dataclass
class ToolResponse:
    """What a tool call returns to the model: text (image / video kept for verl's multimodal tools)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video


class _AttrDict(dict):
    """A dict whose keys also read as attributes, nested dicts included."""

    def __init__(self, data: Mapping[str, Any] = (), **kwargs: Any) -> None:
        super().__init__()
        for key, value in {**dict(data), **kwargs}.items():
            self[key] = _attr(value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = _attr(value)


def _attr(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, _AttrDict):
        return _AttrDict(value)
    if isinstance(value, list):
        return [_attr(v) for v in value]
    return value


def _plain(value: Any, drop_none: bool) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v, drop_none) for k, v in value.items() if not (drop_none and v is None)}
    if isinstance(value, list):
        return [_plain(v, drop_none) for v in value]
    return value


class OpenAIFunctionToolSchema(_AttrDict):
    """`{"type": "function", "function": {name, description, parameters}}`: a plain dict (chat
    templates render it as is) that reads like verl's pydantic model (`schema.function.name`)."""

    @classmethod
    def model_validate(cls, obj: Any) -> OpenAIFunctionToolSchema:
        if hasattr(obj, "model_dump"):  # verl's own pydantic schema
            obj = obj.model_dump(exclude_unset=True, exclude_none=True)
        if not isinstance(obj, Mapping):
            raise ValueError(f"a tool schema must be a mapping, got {type(obj).__name__}")
        function = obj.get("function")
        if obj.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(f"a tool schema is {{type: function, function: {{name, description, parameters}}}}, "
                             f"got {dict(obj)!r}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"the tool schema's function has no name: {dict(function)!r}")
        # transformers' get_json_schema adds the return type; verl's schema (and the prompt) has none
        function = {k: v for k, v in function.items() if k != "return"}
        return cls({**obj, "type": "function", "function": function})

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = False, **_: Any) -> dict[str, Any]:
        return _plain(self, exclude_none)


class BaseTool:
    """verl's tool base class: one instance serves every trajectory; per-trajectory state is keyed by
    the instance id that `create` returns. Override any method, sync or async."""

    def __init__(self, config: dict | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        schema = tool_schema or self.get_openai_tool_schema()
        if not schema:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and get_openai_tool_schema() has none")
        self.tool_schema = OpenAIFunctionToolSchema.model_validate(schema)
        self.name: str = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return self.__dict__.get("tool_schema")

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start this tool's state for one trajectory; kwargs: `create_kwargs` (the row's, as verl 0.9 passes them)."""
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict]:
        """One call: (response, step reward, metrics)."""
        return ToolResponse(text=""), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class FunctionTool(BaseTool):
    """A plain function as a stateless tool; the schema comes from its signature and Google docstring.
    Calling the tool calls the function, so a decorated function still works as one."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, schema: Any = None) -> None:
        self.fn = fn
        super().__init__({}, schema or _function_schema(fn, name or fn.__name__))
        self.__doc__, self.__wrapped__ = fn.__doc__, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        return normalize_tool_result(await _invoke(self.fn, **parameters))


def function_tool(fn: Callable[..., Any] | str | None = None, *, name: str | None = None,
                  schema: Any = None) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """`function_tool(fn)`, or as verl's decorator: `@function_tool`, `@function_tool("name")`,
    `@function_tool(schema={...})`."""
    if callable(fn):
        return FunctionTool(fn, name, schema)
    name = fn if isinstance(fn, str) else name
    return lambda f: FunctionTool(f, name, schema)


def _function_schema(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    where = f"{getattr(fn, '__qualname__', fn)!s} ({inspect.getsourcefile(fn) or '?'})"
    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"function tool {where}: *args / **kwargs ({', '.join(variadic)}) have no JSON schema; "
                         f"name every parameter.")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"function tool {where}: {e} (a function tool needs a type hint on every parameter and "
                         f"a Google-style docstring with an Args: line for each)") from None
    schema["function"]["name"] = name
    return schema


def normalize_tool_result(result: Any) -> tuple[ToolResponse, float, dict]:
    """A tool's return -> (ToolResponse, reward, metrics). Accepts a ToolResponse (or anything with
    .text), a str, a dict (sent as JSON text), or a tuple (response[, reward[, metrics]])."""
    if isinstance(result, tuple):
        if not 1 <= len(result) <= 3:
            raise TypeError(f"a tool returned a tuple of {len(result)}; return (response, reward, metrics)")
        response, reward, metrics = (*result, None, None)[:3]
        metrics = dict(metrics) if isinstance(metrics, Mapping) else {}
        return _response(response), 0.0 if reward is None else float(reward), metrics
    return _response(result), 0.0, {}


def _response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, Mapping):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    if value is None:
        return ToolResponse(text="")
    if hasattr(value, "text"):  # another ToolResponse class (verl's, ported as is)
        return ToolResponse(text=value.text, image=getattr(value, "image", None), video=getattr(value, "video", None))
    return ToolResponse(text=str(value))


def tool_schemas(tools: Mapping[str, BaseTool]) -> list[dict[str, Any]]:
    """The tools' schemas as plain dicts, for apply_chat_template(tools=...)."""
    return [tool.tool_schema.model_dump(exclude_none=True) for tool in tools.values()]


# -----------------------------------------------------------------------------
# Loading tools from the config's files


def load_tools(tool_config_path: str | None, function_tool_path: str | None = None) -> dict[str, BaseTool]:
    """{name: tool} from verl's tool YAML and/or a .py of function tools; ConfigError names the file,
    the entry and what is wrong."""
    tools: dict[str, BaseTool] = {}
    where: dict[str, str] = {}
    found = []
    if tool_config_path:
        found += [(t, f"{tool_config_path} tools[{i}]") for i, t in enumerate(_yaml_tools(Path(tool_config_path)))]
    if function_tool_path:
        found += [(t, f"{function_tool_path}") for t in _file_tools(Path(function_tool_path))]
    for tool, source in found:
        if tool.name in tools:
            raise ConfigError(f"two tools are named {tool.name!r} ({where[tool.name]} and {source}); tool names must "
                              f"be unique across {_MT}.tool_config_path and {_MT}.function_tool_path.")
        tools[tool.name], where[tool.name] = tool, source
    return tools


def _yaml_tools(path: Path) -> list[BaseTool]:
    key = f"{_MT}.tool_config_path={path}"
    if not path.is_file():
        raise ConfigError(f"{key}: no such file.")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: not valid YAML ({e}).") from None
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}: expected verl's format, a mapping with a non-empty list `tools:` of "
                          f"{{class_name: pkg.module.Class, config: {{type: native}}, tool_schema: {{...}}}}.")
    tools = []
    for i, entry in enumerate(entries):
        at = f"{key}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str) or "." not in entry["class_name"]:
            raise ConfigError(f"{at} needs class_name: 'pkg.module.Class', got {entry!r}.")
        config, schema = entry.get("config") or {}, entry.get("tool_schema")
        if not isinstance(config, dict) or config.get("type", "native") != "native":
            raise ConfigError(f"{at}.config must be a mapping with type: native (verl's other types, such as mcp, "
                              f"are not supported here), got {config!r}.")
        if schema is not None and not isinstance(schema, dict):
            raise ConfigError(f"{at}.tool_schema must be a mapping {{type: function, function: {{...}}}}.")
        cls = _import_class(entry["class_name"], at, [Path.cwd(), path.resolve().parent])
        try:
            tools.append(cls(config=config, tool_schema=schema))
        except Exception as e:
            raise ConfigError(f"{at}: {entry['class_name']}(config, tool_schema) failed: {type(e).__name__}: {e}") from e
    return tools


def _import_class(class_name: str, at: str, search: list[Path], method: str = "execute",
                  what: str = "tool class {attr!r} (a class with create / execute / calc_reward / release, e.g. a "
                              "BaseTool subclass)") -> type:
    """The class `pkg.module.Class`, from the import path plus `search` (appended, so installed packages win);
    it must have `method` (what: how the error describes the class wanted)."""
    module_name, _, attr = class_name.rpartition(".")
    for d in map(str, search):
        if d not in sys.path:
            sys.path.append(d)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{at}: cannot import {module_name!r} for class_name={class_name!r} ({type(e).__name__}: "
                          f"{e}); modules are found on the import path, the current directory and the YAML's "
                          f"directory ({', '.join(map(str, search))}).") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not callable(getattr(cls, method, None)):
        raise ConfigError(f"{at}: {module_name} ({getattr(module, '__file__', '?')}) has no "
                          f"{what.format(attr=attr)}.")
    return cls


def load_environment_class(class_name: str) -> type:
    """multi_turn.environment: `module.Class` of an Environment, found as tool classes are."""
    return _import_class(class_name, f"{_MT}.environment={class_name!r}", [Path.cwd()], method="step",
                         what="environment class {attr!r} (reset / step / close, as agent.Environment)")


def _file_tools(path: Path) -> list[BaseTool]:
    """The tools in a .py file: its function_tool-decorated functions (and BaseTool instances), or, when
    it has none, every public function defined in it."""
    key = f"{_MT}.function_tool_path={path}"
    if not path.is_file() or path.suffix != ".py":
        raise ConfigError(f"{key}: no such .py file.")
    name = "_function_tools_" + re.sub(r"\W", "_", str(path.resolve()))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so dataclasses, pickling and sibling imports see it
    if str(path.resolve().parent) not in sys.path:
        sys.path.append(str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{key}: importing it failed: {type(e).__name__}: {e}") from e
    tools = [v for v in vars(module).values() if isinstance(v, BaseTool)]
    if not tools:
        functions = [v for k, v in vars(module).items()
                     if inspect.isfunction(v) and v.__module__ == name and not k.startswith("_")]
        try:
            tools = [FunctionTool(fn) for fn in functions]
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if not tools:
        raise ConfigError(f"{key}: defines no tools (public functions with type hints and a Google docstring, or "
                          f"functions decorated with @function_tool).")
    return tools


# -----------------------------------------------------------------------------
# Tool-call parsers: the assistant's decoded turn -> (its text without the calls, the calls)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text; the environment checks it is an object


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5 / Qwen3, several per
    turn). A block that is not JSON with a name and arguments is no call, as in verl."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            calls.append(ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    return _HERMES.sub("", text), calls


DEMO_ARGUMENT = "expression"  # the demo format's single argument: Calculator's parameter
_DEMO_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")


def parse_demo(text: str) -> tuple[str, list[ToolCall]]:
    """`name(text)` on one line, parentheses balanced, e.g. `calc(37*48)` -> calc with
    {"expression": "37*48"}: a format short enough for the character-level demo model."""
    calls, kept, pos = [], [], 0
    for m in _DEMO_CALL.finditer(text):
        if m.start() < pos:
            continue
        depth, end = 1, None
        for j in range(m.end(), len(text)):
            if text[j] == "\n":
                break
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                end = j
                break
        if end is None:  # unbalanced: no call
            continue
        calls.append(ToolCall(m.group(1), json.dumps({DEMO_ARGUMENT: text[m.end():end]})))
        kept.append(text[pos:m.start()])
        pos = end + 1
    return "".join(kept) + text[pos:], calls


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {"hermes": parse_hermes, "demo": parse_demo}


# -----------------------------------------------------------------------------
# Environments: what the loop drives, one per trajectory, on the rank that owns the trajectory


@dataclass
class StepResult:
    messages: list[dict] | None  # chat messages to append (role "tool", ...); None: the trajectory ends
    num_calls: int = 0  # calls executed (those past max_parallel_calls are dropped, not counted)
    num_failed_calls: int = 0
    reward: float = 0.0  # the step rewards, summed (counted also when messages is None: a game's last move)
    metrics: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, prompt_row: Any) -> None:
        """A new trajectory for this row (a dict, or data.Prompt): extra_info, agent_name, ..."""

    def step(self, assistant_text: str) -> StepResult:
        """The assistant's decoded turn -> what comes back; never raises."""

    def close(self) -> dict[str, float]:
        """The trajectory is over: final rewards by name; frees what reset made; never raises."""


def _row_field(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)


def truncate_tool_text(text: str, max_chars: int, side: str) -> str:
    """Cut a tool's text to max_chars characters, as verl >= 0.8 does: `side` is the side that is cut
    (left keeps the tail, right keeps the head, middle keeps both ends)."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - max_chars:]
    if side == "right":
        return text[:max_chars] + "...(truncated)"
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


class ToolEnvironment:
    """verl's tool semantics for one trajectory at a time: parse the turn, run at most
    max_parallel_calls calls concurrently, answer with one `tool` message per call.

    Each tool's instance is made on its first call in the trajectory (`create(create_kwargs=...)`
    with the row's extra_info.tools_kwargs.<tool>.create_kwargs, as verl 0.9 calls it), kept for
    the trajectory's later calls, and at close scored (`calc_reward`) and released (always)."""

    def __init__(self, tools: Mapping[str, BaseTool], parser: str = "hermes", max_parallel_calls: int = 1,
                 max_tool_response_length: int = 256, tool_response_truncate_side: str = "middle",
                 timeout_s: float = 30.0) -> None:
        if parser not in PARSERS:
            raise ValueError(f"{_MT}.format={parser!r}: no such tool-call parser; valid: {', '.join(PARSERS)}.")
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"{_MT}.tool_response_truncate_side={tool_response_truncate_side!r}; "
                             f"valid: {', '.join(TRUNCATE_SIDES)}.")
        if max_parallel_calls < 1 or max_tool_response_length < 1 or not timeout_s > 0:
            raise ValueError("max_parallel_calls and max_tool_response_length must be >= 1 and timeout_s > 0.")
        self.tools, self.parser = dict(tools), parser
        self.max_parallel_calls, self.timeout_s = max_parallel_calls, float(timeout_s)
        self.max_chars, self.truncate_side = max_tool_response_length, tool_response_truncate_side
        self.active: dict[str, BaseTool] = self.tools
        self.errors: list[str] = []  # what went wrong inside tools, for the loop to log
        self._kwargs: dict[str, dict] = {}
        self._instances: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_config(cls, multi_turn: Mapping[str, Any], tools: Mapping[str, BaseTool]) -> ToolEnvironment:
        """From the actor_rollout_ref.rollout.multi_turn section."""
        return cls(tools, multi_turn["format"], multi_turn["max_parallel_calls"], multi_turn["max_tool_response_length"],
                   multi_turn["tool_response_truncate_side"], multi_turn["tool_timeout_s"])

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The schemas of this trajectory's tools (extra_info.tool_selection, if any), for the prompt."""
        return tool_schemas(self.active)

    def reset(self, prompt_row: Any) -> None:
        if self._instances:  # a reused environment releases the last trajectory's instances first
            self.close()
        extra_info = _row_field(prompt_row, "extra_info") or {}
        self._kwargs = dict(extra_info.get("tools_kwargs") or {})
        selection = extra_info.get("tool_selection")
        self.active = {n: self.tools[n] for n in selection if n in self.tools} if selection else self.tools
        self.errors, self._locks = [], {}

    def step(self, assistant_text: str) -> StepResult:
        try:
            _, calls = PARSERS[self.parser](assistant_text)
        except Exception as e:  # a parser bug must not take the rank down
            self.errors.append(f"parser {self.parser!r}: {type(e).__name__}: {e}")
            return StepResult(None)
        if not calls:
            return StepResult(None)
        run = calls[: self.max_parallel_calls]
        start = time.perf_counter()
        try:  # each call is bounded by timeout_s; this bound only matters if a tool blocks the event loop itself
            outcomes = _run(self._calls(run), self.timeout_s + 5)
        except Exception as e:
            outcomes = [(f"Error: tool {c.name!r} did not answer within {self.timeout_s:g} s.", 0.0, True, {})
                        for c in run]
            self.errors.append(f"step: {type(e).__name__}: {e}")
        metrics: dict[str, float] = {"tool_time_s": time.perf_counter() - start, "dropped_calls": len(calls) - len(run)}
        for call, (_, _, _, tool_metrics) in zip(run, outcomes, strict=True):
            for k, v in tool_metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    metrics[f"{call.name}/{k}"] = metrics.get(f"{call.name}/{k}", 0.0) + v
        messages = [{"role": "tool", "content": truncate_tool_text(text, self.max_chars, self.truncate_side)}
                    for text, _, _, _ in outcomes]
        return StepResult(messages, num_calls=len(run), num_failed_calls=sum(o[2] for o in outcomes),
                          reward=sum(o[1] for o in outcomes), metrics=metrics)

    def close(self) -> dict[str, float]:
        instances, self._instances = self._instances, {}
        if not instances:
            return {}
        try:
            return _run(self._finish(instances), 2 * self.timeout_s + 5)
        except Exception as e:
            self.errors.append(f"close: {type(e).__name__}: {e}")
            return {}

    async def _calls(self, calls: list[ToolCall]) -> list[tuple[str, float, bool, dict]]:
        return await asyncio.gather(*(self._call(c) for c in calls))

    async def _call(self, call: ToolCall) -> tuple[str, float, bool, dict]:
        """(text, reward, failed, metrics) for one call; every failure becomes text."""
        tool = self.active.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.active)) or 'none'}.", \
                0.0, True, {}
        try:
            args = json.loads(call.arguments)
        except ValueError as e:
            return f"Error: the arguments of {call.name!r} are not valid JSON ({e}).", 0.0, True, {}
        if not isinstance(args, dict):
            return f"Error: the arguments of {call.name!r} must be a JSON object, got {call.arguments[:100]}.", \
                0.0, True, {}
        try:
            response, reward, metrics = await asyncio.wait_for(self._execute(tool, args), self.timeout_s)
        except TimeoutError:
            return f"Error: tool {call.name!r} did not answer within {self.timeout_s:g} s.", 0.0, True, {}
        except Exception as e:
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}", 0.0, True, {}
        return response.text or "", reward, False, metrics

    async def _execute(self, tool: BaseTool, args: dict[str, Any]) -> tuple[ToolResponse, float, dict]:
        kwargs = self._kwargs.get(tool.name) or {}
        async with self._locks.setdefault(tool.name, asyncio.Lock()):  # parallel calls share one instance
            if tool.name not in self._instances:
                created = await _invoke(tool.create, create_kwargs=dict(kwargs.get("create_kwargs") or {}))
                self._instances[tool.name] = created[0] if isinstance(created, tuple) else created
        result = await _invoke(tool.execute, self._instances[tool.name], args, **(kwargs.get("execute_kwargs") or {}))
        return normalize_tool_result(result)

    async def _finish(self, instances: dict[str, str]) -> dict[str, float]:
        async def finish(name: str, instance_id: str) -> tuple[str, float]:
            tool, kwargs = self.tools[name], self._kwargs.get(name) or {}
            reward = 0.0
            try:
                reward = float(await asyncio.wait_for(
                    _invoke(tool.calc_reward, instance_id, **(kwargs.get("calc_reward_kwargs") or {})), self.timeout_s))
            except Exception as e:
                self.errors.append(f"{name}.calc_reward: {type(e).__name__}: {e}")
            finally:
                try:
                    await asyncio.wait_for(
                        _invoke(tool.release, instance_id, **(kwargs.get("release_kwargs") or {})), self.timeout_s)
                except Exception as e:
                    self.errors.append(f"{name}.release: {type(e).__name__}: {e}")
            return name, reward

        return dict(await asyncio.gather(*(finish(n, i) for n, i in instances.items())))


def step_all(envs: Sequence[Environment], texts: Sequence[str]) -> list[StepResult]:
    """envs[i].step(texts[i]) for all i, concurrently (one slow tool does not serialise the batch)."""
    if len(envs) <= 1:
        return [env.step(text) for env, text in zip(envs, texts, strict=True)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, len(envs))) as pool:
        return list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs, texts, strict=True)))


class GuessNumberEnv:
    """An environment that is not a tool set: guess the row's extra_info.secret (1..100) from the
    hints "higher" / "lower", given as user turns; the trajectory ends on the right number (reward 1)
    or on a turn with no number. A template for games and simulated users."""

    def reset(self, prompt_row: Any) -> None:
        self.secret = int((_row_field(prompt_row, "extra_info") or {})["secret"])
        self.guesses, self.solved = 0, False

    def step(self, assistant_text: str) -> StepResult:
        numbers = re.findall(r"-?\d+", assistant_text)
        if not numbers:
            return StepResult(None)
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.secret:
            self.solved = True
            return StepResult(None, reward=1.0)
        return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

    def close(self) -> dict[str, float]:
        return {"solved": float(self.solved), "guesses": float(self.guesses)}


# -----------------------------------------------------------------------------
# Observation tokens from the chat template (token-in / token-out)

_PROBE_REPLY = "Hello"
_SYNTHETIC_PREFIX = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY}]


def _render_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; multi-turn rollouts render observations with one.")
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids that end an assistant turn, for the engine's stop_token_ids: the tokenizer's eos, the
    special token the chat template puts after an assistant reply (e.g. <|im_end|>), and the model's
    generation_config eos (given, or read from the tokenizer's directory)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(_SYNTHETIC_PREFIX, tokenize=False)
        tail = tokenizer(text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY):], add_special_tokens=False)["input_ids"]
        special = set(tokenizer.all_special_ids) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        if tail and tail[0] in special:
            ids.append(tail[0])
    if generation_config is None:
        path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
        generation_config = json.loads(path.read_text()) if path.is_file() else {}
    eos = (generation_config.get("eos_token_id") if isinstance(generation_config, Mapping)
           else getattr(generation_config, "eos_token_id", None))
    ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(ids))


class ObservationRenderer:
    """messages -> the token ids that follow the assistant's end-of-turn token, as the chat template
    renders them (the template's separator after that token, e.g. ChatML's newline, the messages,
    then the next assistant header): what the loop appends with loss mask 0.

    Rendered as a suffix: a synthetic [user, assistant] prefix, cut after its last end-of-turn token,
    then prefix + messages with the generation prompt; the difference is the observation."""

    def __init__(self, tokenizer: Any, tools_schemas: list[dict] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, list(tools_schemas) if tools_schemas else None
        ends = set(end_of_turn_ids(tokenizer))
        prefix = _render_ids(tokenizer, _SYNTHETIC_PREFIX, self.tools, add_generation_prompt=False)
        last = max((i for i, t in enumerate(prefix) if t in ends), default=None)
        if last is None:
            raise ValueError(f"the chat template renders an assistant turn without an end-of-turn token (looked for "
                             f"ids {sorted(ends)}); the observation boundary is undefined.")
        self.prefix_ids = prefix[: last + 1]

    def __call__(self, messages: list[dict]) -> list[int]:
        full = _render_ids(self.tokenizer, _SYNTHETIC_PREFIX + list(messages), self.tools, add_generation_prompt=True)
        n = len(self.prefix_ids)
        if full[:n] != self.prefix_ids:
            raise ValueError("the chat template renders the conversation differently once messages follow the "
                             "assistant turn (it is not prefix-preserving, e.g. it drops earlier reasoning), so "
                             "observation ids cannot be appended to the sampled ids; use a training chat template "
                             "that renders earlier turns unchanged.")
        return full[n:]


# -----------------------------------------------------------------------------
# Running tool methods, sync or async, from synchronous code
#
# One event loop in a daemon thread serves every environment of the process, so async tools keep
# their loop-bound resources (HTTP sessions) from create to release. Sync methods run in daemon
# threads: one that hangs past the timeout is abandoned, never joined, so it cannot block exit.

_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        # a forked child has the object but not the thread; a loop that died is replaced
        if _LOOP is None or _LOOP[0] != os.getpid() or not _LOOP[1].is_running():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agent-tools", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


def _run(coroutine: Any, timeout_s: float) -> Any:
    """Run a coroutine on the tools' loop from any other thread; concurrent.futures.TimeoutError past timeout_s."""
    future = asyncio.run_coroutine_threadsafe(coroutine, _event_loop())
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


async def _invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        try:
            result = await fn(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt) as e:  # out of a task, they would stop the tools' event loop
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
    else:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():  # the caller may have timed out and cancelled
                done.set_result(value) if ok else done.set_exception(value)

        def target() -> None:
            try:
                value, ok = fn(*args, **kwargs), True
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                # SystemExit / KeyboardInterrupt out of a task would stop the tools' event loop itself
                value, ok = (e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}")), False
            loop.call_soon_threadsafe(settle, ok, value)

        threading.Thread(target=target, name="agent-tool-call", daemon=True).start()
        result = await done
    if inspect.isawaitable(result):  # a sync wrapper around a coroutine
        result = await result
    return result


# -----------------------------------------------------------------------------
# Calculator: arithmetic by walking the AST, with limits, never eval

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}


def evaluate_arithmetic(expression: str, max_length: int = 200, max_digits: int = 100,
                        max_exponent: int = 1000) -> int | float:
    """+ - * / // % ** on int and float literals with parentheses; ValueError for anything else and
    for numbers past max_digits digits or exponents past max_exponent (so `9**9**9**9` is refused
    before it is computed)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression must be a non-empty string")
    if len(expression) > max_length:
        raise ValueError(f"the expression has {len(expression)} characters, more than {max_length}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    limit = 10 ** max_digits

    def check(x: int | float) -> int | float:
        if isinstance(x, float) and not math.isfinite(x) or abs(x) >= limit:
            raise ValueError(f"a number in {expression!r} is larger than 10**{max_digits}")
        return x

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
            a, b = walk(node.left), walk(node.right)
            try:
                if not isinstance(node.op, ast.Pow):
                    return check(_BINARY[type(node.op)](a, b))
                if abs(b) > max_exponent:
                    raise ValueError(f"the exponent {b} is larger than {max_exponent}")
                if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b * math.log10(abs(a)) > max_digits + 1:
                    raise ValueError(f"{a}**{b} has more than {max_digits} digits")  # refused before it is computed
                result = a ** b
                if isinstance(result, complex):  # (-8) ** 0.5
                    raise ValueError(f"{a}**{b} has no real value")
                return check(result)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            except OverflowError:
                raise ValueError(f"a number in {expression!r} is larger than 10**{max_digits}") from None
        raise ValueError(f"{type(node).__name__} is not arithmetic; use numbers, + - * / // % ** and parentheses")

    return walk(tree.body)


class Calculator(BaseTool):
    """The demo's tool: `calc(expression)` -> the value as text. verl YAML: `class_name: agent.Calculator`,
    config {max_length, max_digits, max_exponent} optional, tool_schema optional (this one by default).
    A bad expression raises, so the call counts as failed."""

    SCHEMA = {"type": "function", "function": {
        "name": "calc", "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "required": [DEMO_ARGUMENT], "properties": {
            DEMO_ARGUMENT: {"type": "string", "description": "the expression, e.g. 37*48"}}}}}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(self.SCHEMA)

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        limits = {k: int(self.config[k]) for k in ("max_length", "max_digits", "max_exponent") if k in self.config}
        return ToolResponse(text=repr(evaluate_arithmetic(parameters.get(DEMO_ARGUMENT), **limits))), 0.0, {}


# -----------------------------------------------------------------------------
# PythonTool: code in the sandbox of sandbox.py


class PythonTool(BaseTool):
    """Runs the call's `code` with run_python_sandboxed and answers with what it printed (a traceback is
    an answer, not a failed call). verl YAML: `class_name: agent.PythonTool`, config: any of
    run_python_sandboxed's limits (timeout_s, cpu_s, memory_mb, ...) and max_code_chars."""

    SCHEMA = {"type": "function", "function": {
        "name": "python", "description": "Run Python 3 code in a fresh sandbox and return what it prints.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "a complete program; print the results you need"}}}}}
    LIMITS = {"timeout_s": 10.0, "cpu_s": 5, "memory_mb": 1024, "max_processes": 32, "max_file_mb": 16,
              "max_output_chars": 4096, "tmpfs_mb": 64, "isolation": "full"}

    def __init__(self, config: dict | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        unknown = set(self.config) - set(self.LIMITS) - {"type", "max_code_chars"}
        if unknown:
            raise ValueError(f"PythonTool config has unknown keys {sorted(unknown)}; valid: "
                             f"{', '.join([*self.LIMITS, 'max_code_chars'])}")
        self.limits = {k: type(v)(self.config.get(k, v)) for k, v in self.LIMITS.items()}
        self.max_code_chars = int(self.config.get("max_code_chars", 20_000))
        self.plan = sandbox_plan(self.limits["isolation"])

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(self.SCHEMA)

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError("the argument `code` must be a non-empty string")
        if len(code) > self.max_code_chars:
            raise ValueError(f"the code has {len(code)} characters, more than {self.max_code_chars}")
        result = run_python_sandboxed(code, **self.limits)
        return ToolResponse(text=result.text), 0.0, {"exit_code": result.exit_code, "wall_s": result.wall_s,
                                                     "timed_out": float(result.timed_out)}
