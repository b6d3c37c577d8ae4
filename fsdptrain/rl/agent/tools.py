"""Tools with verl's interface (so that a verl tool ports by changing its import from `verl.tools.base_tool` and
`verl.tools.schemas` to this module), the tool YAML that lists them, and the built-in calculator.

A tool's methods are async: `create(instance_id, **create_kwargs)` once per trajectory before its first call,
`execute(instance_id, parameters) -> (response, step_reward, metrics)` per call, `calc_reward(instance_id)` and
`release(instance_id)` when the trajectory ends. The response is a string, a dict with `text`, or a ToolResponse.
"""

import ast
import importlib
import operator
import os
from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import uuid4

import yaml

from fsdptrain.errors import ConfigError, UserError


@dataclass
class OpenAIFunctionSchema:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)
    strict: bool = False


@dataclass
class OpenAIFunctionToolSchema:
    """A tool's schema in OpenAI's form, as chat templates render it (`model_dump`) and verl's tools read it."""

    type: str
    function: OpenAIFunctionSchema

    @classmethod
    def model_validate(cls, data: dict) -> "OpenAIFunctionToolSchema":
        function = data.get("function") if isinstance(data, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool schema needs function.name, got {data!r}")
        known = {k: v for k, v in function.items() if k in OpenAIFunctionSchema.__dataclass_fields__}
        return cls(data.get("type", "function"), OpenAIFunctionSchema(**known))

    def model_dump(self, **_: Any) -> dict:
        return asdict(self)


@dataclass
class ToolResponse:
    text: str | None = None


class BaseTool:
    """verl's tool base class: one instance serves every trajectory, keyed by instance id."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid4())

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str | dict | ToolResponse, float, dict]:
        return "", 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


def response_text(response: Any, tool: str) -> str:
    """A tool's response as the text the model reads; one with images or videos (verl's ToolResponse can carry them)
    is refused naming the `tool`, rather than shown to the model without them."""
    if isinstance(response, str):
        return response
    read = response.get if isinstance(response, dict) else lambda key: getattr(response, key, None)
    if media := [key for key in ("image", "video") if read(key)]:
        raise ToolMediaError(f"the tool {tool!r} returned {' and '.join(media)}s: tool responses are read as text only")
    return str(read("text") or "")


class ToolMediaError(UserError, RuntimeError):
    """A tool answered with images or videos, which the agent loop does not feed the model."""


BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
          ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses; anything else (names,
    calls, exponents over 64, expressions over 200 characters) raises ValueError."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent over 64")
            return BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return int(result) if isinstance(result, float) and result.is_integer() else result


class CalculatorTool(BaseTool):
    """Evaluates an arithmetic expression: `{"expression": "123 * 45"}` -> `5535`; an invalid one -> `Error: ...`."""

    SCHEMA = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 123 * 45"}},
                       "required": ["expression"]}}}

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config or {}, tool_schema or OpenAIFunctionToolSchema.model_validate(self.SCHEMA))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        try:
            return str(evaluate_arithmetic(str(parameters.get("expression", "")))), 0.0, {}
        except ValueError as e:
            return f"Error: {e}", 0.0, {}


def tool_schemas(tools: dict[str, BaseTool]) -> list[dict] | None:
    """The tools as chat templates take them (`tools=`): the prompts are rendered with them."""
    return [tool.tool_schema.model_dump() for tool in tools.values()] or None


def import_class(dotted: str, key: str) -> type:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot import class_name {dotted!r}: {e}") from None


def read_yaml_list(path: str, section: str, key: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r}: no such file")
    with open(path) as f:
        entries = (yaml.safe_load(f) or {}).get(section)
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("class_name") for e in entries):
        raise ConfigError(f"{key}={path!r}: needs a list `{section}:` of entries, each with a class_name")
    return entries


def load_tools(path: str, key: str = "actor_rollout_ref.rollout.multi_turn.tool_config_path") -> dict[str, BaseTool]:
    """The tools of verl's tool YAML (`tools: [{class_name, config, tool_schema}]`), by their schema's name."""
    tools = {}
    for i, entry in enumerate(read_yaml_list(path, "tools", key)):
        schema = entry.get("tool_schema")
        try:
            schema = OpenAIFunctionToolSchema.model_validate(schema) if schema else None
            tool = import_class(entry["class_name"], f"{key} tools[{i}]")(entry.get("config") or {}, schema)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}={path!r} tools[{i}] ({entry['class_name']}): {e}") from None
        if tool.name in tools:
            raise ConfigError(f"{key}={path!r}: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
