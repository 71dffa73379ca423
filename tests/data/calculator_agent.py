"""An agent as users write them against an OpenAI-style API, for --agent-fn: it gets an `openai` client and a row,
talks to the model over several turns with its own calculator tool, and returns its reward. Nothing in it knows
the trainer. tests/test_agent_fn.py trains the bundled calculator task through it."""

import ast
import json
import operator
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Numbers and + - * / only: the tree is walked, never eval'd."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * / are allowed")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else result)


def run(client, row) -> float:
    messages = list(row["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except Exception as e:  # the model's bad call: it is told, as a tool would tell it
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    found = re.findall(r"<answer>(.*?)</answer>", message.content or "")
    return float(bool(found) and found[-1].strip() == str(row["ground_truth"]))
