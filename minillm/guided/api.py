"""OpenAI's structured-output fields -> GuidedDecodingParams, and tool calls (minillm/serving/server.py).

    response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  -> json=schema
    response_format={"type": "json_object"}                                            -> json_object
    guided_json / guided_regex / guided_choice / guided_grammar  (vLLM's extras, sent with extra_body)
    tools=[{"type": "function", "function": {"name", "description", "parameters"}}] with
    tool_choice={"type": "function", "function": {"name": N}}  -> the output IS N's arguments,
                                                                 constrained by N's parameters
    tool_choice="required"  -> the output is {"name": one of the tools, "arguments": {...}},
                               each alternative constrained by that tool's parameters

Tool choice "auto" (OpenAI's default when tools are given) would need the model to decide
between text and a call in a format it was trained on; it is refused rather than guessed. The
tools are described to the model in a system message. Every error is a ValueError naming the
field; the server answers it with a 400.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from minillm.engine.sampling import GuidedDecodingParams


@dataclass
class ToolCallPlan:
    """How the output of a request with tools is constrained and read back."""
    functions: list[dict]          # the tools' "function" objects that may be called
    named: bool                    # True: one named function, the output is its arguments

    def system_prompt(self) -> str:
        lines = ["You call a function by answering with its arguments as JSON. Functions:"]
        for f in self.functions:
            lines.append(f"- {f['name']}: {f.get('description', '')} Arguments (JSON schema): "
                         f"{json.dumps(f.get('parameters', {}))}")
        return "\n".join(lines)

    def guided(self) -> GuidedDecodingParams:
        if self.named:
            return GuidedDecodingParams(json=_parameters(self.functions[0]))
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        return GuidedDecodingParams(json={"anyOf": calls})

    def name_and_arguments(self, text: str) -> tuple[str, str]:
        """The function called and its arguments (JSON text) from the generated text."""
        if self.named:
            return self.functions[0]["name"], text
        call = json.loads(text)
        return call["name"], json.dumps(call["arguments"], ensure_ascii=False)

    def tool_calls(self, text: str) -> list[dict]:
        name, arguments = self.name_and_arguments(text)
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def guided_from_fields(response_format, guided_json, guided_regex, guided_choice, guided_grammar,
                       tools, tool_choice) -> tuple[GuidedDecodingParams | None, ToolCallPlan | None]:
    """The request's constraint (or None) and, for tool calls, how to read the output back."""
    plan = tool_plan(tools, tool_choice)
    sources = {"response_format": _from_response_format(response_format),
               "guided_json": guided_json is not None and GuidedDecodingParams(json=guided_json),
               "guided_regex": guided_regex is not None and GuidedDecodingParams(regex=guided_regex),
               "guided_choice": guided_choice is not None and GuidedDecodingParams(choice=guided_choice),
               "guided_grammar": guided_grammar is not None and GuidedDecodingParams(grammar=guided_grammar),
               "tool_choice": plan is not None and plan.guided()}
    given = {k: v for k, v in sources.items() if v}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; give one of them")
    return next(iter(given.values()), None), plan


def _from_response_format(response_format) -> GuidedDecodingParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema must be {'name': ..., 'schema': {...}, 'strict': ...}")
        return GuidedDecodingParams(json=spec["schema"])
    raise ValueError(f"response_format.type = {kind!r} is not supported; allowed: 'text', 'json_object', "
                     f"'json_schema'")


def tool_plan(tools, tool_choice) -> ToolCallPlan | None:
    if not tools or tool_choice == "none":
        return None
    functions = []
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"{{...}}}}}}")
        functions.append(f)
    if tool_choice == "required":
        return ToolCallPlan(functions, named=False)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(f['name'] for f in functions)})")
        return ToolCallPlan(chosen, named=True)
    raise ValueError(f"tool_choice = {tool_choice!r} is not supported with tools; allowed: 'none', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}} ('auto' is not: minillm does not "
                     f"let the model choose between text and a call)")
