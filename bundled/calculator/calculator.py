"""The calculator tool of the bundled tool task (tools.yaml): arithmetic on numbers, nothing else.

The expression is parsed, never eval'd: only numbers, + - * / and brackets are accepted, so a
model cannot run code through it. A wrong expression raises, and the agent loop answers the model
with the error.
"""

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"only numbers, + - * / and brackets are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    result = _value(tree.body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
