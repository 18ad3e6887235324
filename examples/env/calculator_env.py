#!/usr/bin/env python3
"""The calculator tool as an environment program in Python (docs/env-api.md): the same rules as
rlflow's built-in calculator (env.type = "calculator", env/calculator.c), answer for answer, so
that a recipe can use either:

    rlflow run examples/grpo_calculator.toml --set env.type=external \\
        --set env.endpoint=tcp://127.0.0.1:5558 --set 'rollout.stop=["</calc>"]'
    python3 examples/env/calculator_env.py --connect tcp://127.0.0.1:5558

A turn that ended at a stop string and holds "<calc>" is a tool call: what follows the last
"<calc>" is evaluated (integers, + - * /, parentheses, unary minus; 64-bit integers, a division
that is not exact rounded to 6 decimals) and answered "<result>VALUE</result>" or
"<result>error: WHY</result>". Any other turn ends the episode. No rewards of its own: the
run's reward rules score the last turn.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "env", "clients", "python"))
import rlflow_env  # noqa: E402

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class CalcError(Exception):
    pass


class _Parser:
    """env/calculator.c's recursive descent, error for error."""

    def __init__(self, text):
        self.s, self.p, self.depth = text, 0, 0

    def peek(self):
        return self.s[self.p] if self.p < len(self.s) else ""

    def skip(self):
        while self.peek() in (" ", "\t", "\n") and self.peek():
            self.p += 1

    @staticmethod
    def check(v):
        if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:
            raise CalcError("overflow")
        return v

    def number(self):
        if not self.peek().isdigit() or not self.peek().isascii():
            raise CalcError("cannot parse" if self.peek() else "the expression ends early")
        v = 0
        while self.peek() and self.peek() in "0123456789":
            v = self.check(v * 10 + int(self.peek()))
            self.p += 1
        return v

    def unary(self):
        self.skip()
        if self.peek() == "-":
            self.p += 1
            return self.check(-self.unary())
        if self.peek() == "(":
            self.depth += 1
            if self.depth > 64:
                raise CalcError("too deeply nested")
            self.p += 1
            v = self.expr()
            self.skip()
            if self.peek() != ")":
                raise CalcError("a parenthesis is not closed")
            self.p += 1
            self.depth -= 1
            return v
        return self.number()

    def apply(self, a, op, b):
        if isinstance(a, int) and isinstance(b, int):
            if op == "/":
                if b == 0:
                    raise CalcError("division by zero")
                q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
                if q * b == a:
                    return self.check(q)
                return float(a) / float(b)
            return self.check(a + b if op == "+" else a - b if op == "-" else a * b)
        x, y = float(a), float(b)
        if op == "/" and y == 0:
            raise CalcError("division by zero")
        return x + y if op == "+" else x - y if op == "-" else x * y if op == "*" else x / y

    def term(self):
        v = self.unary()
        self.skip()
        while self.peek() in ("*", "/") and self.peek():
            op = self.peek()
            self.p += 1
            v = self.apply(v, op, self.unary())
            self.skip()
        return v

    def expr(self):
        v = self.term()
        self.skip()
        while self.peek() in ("+", "-") and self.peek():
            op = self.peek()
            self.p += 1
            v = self.apply(v, op, self.term())
            self.skip()
        return v


def evaluate(text):
    """The tool's answer to text: the value, or "error: WHY"."""
    try:
        if len(text.encode()) > 256:
            raise CalcError("the expression is longer than 256 characters")
        p = _Parser(text)
        v = p.expr()
        p.skip()
        if p.peek():
            raise CalcError("cannot parse")
    except CalcError as e:
        return "error: %s" % e
    if isinstance(v, int):
        return str(v)
    s = "%.6f" % v
    s = s.rstrip("0")
    return s[:-1] if s.endswith(".") else s


def reset(req):
    return ""


def step(req):
    at = req.action.rfind("<calc>")
    if at < 0 or req.finish != "stop":
        return "", 0.0, True  # no tool call: the model answered
    return "<result>%s</result>" % evaluate(req.action[at + len("<calc>"):]), 0.0, False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connect", default=None, help="rlflow's env.endpoint (default: RLFLOW_ENV_ENDPOINT, set for "
                    "the programs rlflow starts with env.programs, else tcp://127.0.0.1:5558)")
    ap.add_argument("--name", default="calculator")
    ap.add_argument("--capacity", type=int, default=16)
    ap.add_argument("--eval", help="print the tool's answer to this expression and exit")
    a = ap.parse_args()
    if a.eval is not None:
        print(evaluate(a.eval))
        return 0
    n = rlflow_env.serve(reset, step, connect=a.connect, name=a.name, capacity=a.capacity)
    sys.stderr.write("%s: answered %d requests\n" % (a.name, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
