# An environment program written from docs/env-api.md alone, with no rlflow code and no protobuf
# library: pyzmq (python3-zmq) and the wire format encoded by hand (sections 4, 5, 12). It plays
# the calculator's tool call: a turn that stopped at a stop string and holds <calc> gets
# <result>VALUE</result> (integers and + - * / ( ); anything else: <result>error: cannot parse</result>);
# any other turn ends the episode. Run it under env.programs (section 15):
#   rlflow run examples/grpo_calculator.toml --set env.type=external --set 'rollout.stop=["</calc>"]' \
#       --set 'env.programs=[["python3", "examples/env/wire_env.py"]]'
# or by hand: RLFLOW_ENV_ENDPOINT=tcp://127.0.0.1:5558 python3 examples/env/wire_env.py
import ast, os, struct, sys, zmq

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7f; n >>= 7
        if n: out.append(b | 0x80)
        else: out.append(b); return bytes(out)

def key(f, wt): return varint((f << 3) | wt)
def f_varint(f, v): return key(f, 0) + varint(v) if v else b""
def f_bytes(f, b):
    if isinstance(b, str): b = b.encode()
    return key(f, 2) + varint(len(b)) + b if b else b""
def f_float(f, x): return key(f, 5) + struct.pack("<f", x) if x else b""

def decode(buf):
    """{field: [values]}; varint -> int, len -> bytes, fixed32 -> bytes, fixed64 -> bytes"""
    out, i = {}, 0
    while i < len(buf):
        k, i = read_varint(buf, i)
        f, wt = k >> 3, k & 7
        if wt == 0: v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i); v = buf[i:i + n]; i += n
        elif wt == 5: v = buf[i:i + 4]; i += 4
        elif wt == 1: v = buf[i:i + 8]; i += 8
        else: raise ValueError("wire type %d" % wt)
        out.setdefault(f, []).append(v)
    return out

def read_varint(buf, i):
    n = s = 0
    while True:
        b = buf[i]; i += 1
        n |= (b & 0x7f) << s; s += 7
        if not b & 0x80: return n, i

def one(d, f, default=None): return d.get(f, [default])[-1]
def text(d, f): return one(d, f, b"").decode()

OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

def value(n):
    """An integer expression's value: + - * on integers, / giving a float, unary minus."""
    if isinstance(n, ast.Constant) and type(n.value) is int: return n.value
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub): return -value(n.operand)
    if isinstance(n, ast.BinOp) and type(n.op) in OPS: return OPS[type(n.op)](value(n.left), value(n.right))
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div): return value(n.left) / value(n.right)
    raise ValueError("not an integer expression")

def calc(action):
    expr = action.rsplit("<calc>", 1)[1]
    try:
        if len(expr) > 256: raise ValueError("too long")
        v = value(ast.parse(expr, mode="eval").body)
        if abs(v) >= 2 ** 63: raise ValueError("overflow")
        return str(v) if isinstance(v, int) else ("%.6f" % v).rstrip("0").rstrip(".")
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return "error: cannot parse"

def reply(req, obs="", reward=0.0, done=False):
    return bytes([20]) + f_varint(1, req) + f_bytes(2, obs) + f_float(3, reward) + f_varint(4, int(done))

def connect(ctx):
    s = ctx.socket(zmq.DEALER)
    sk = os.environ.get("RLFLOW_ENV_SERVER_KEY", "")
    if sk:
        s.curve_serverkey = sk.encode()
        s.curve_publickey = os.environ["RLFLOW_ENV_PUBLIC_KEY"].encode()
        s.curve_secretkey = os.environ["RLFLOW_ENV_SECRET_KEY"].encode()
    s.connect(os.environ.get("RLFLOW_ENV_ENDPOINT", "tcp://127.0.0.1:5558"))
    rank = int(os.environ.get("RLFLOW_ENV_RANK", "0"))
    s.send(bytes([1]) + f_varint(1, 1) + f_varint(2, 8) + f_varint(3, rank) + f_varint(4, os.getpid())
           + f_bytes(5, "wire_env") + f_varint(6, 4))
    return s

def main():
    ctx = zmq.Context()
    s = connect(ctx)
    answered = 0
    while True:
        m = s.recv()
        tag, d = m[0], decode(m[1:])
        if tag == 2:
            if not one(d, 1, 0):
                print("refused:", text(d, 2), file=sys.stderr); return 1
        elif tag == 3:
            s.send(bytes([3]) + f_varint(1, one(d, 1, 0)))
        elif tag == 4:
            print("dropped:", text(d, 2), file=sys.stderr)
            s.close(0); s = connect(ctx)
        elif tag == 5:
            print("shutdown after", answered, "answers", file=sys.stderr); return 0
        elif tag == 18:
            s.send(reply(one(d, 1, 0))); answered += 1
        elif tag == 19:
            req, action, finish = one(d, 1, 0), text(d, 4), text(d, 6)
            if "<calc>" in action and finish == "stop":
                s.send(reply(req, "<result>%s</result>" % calc(action)))
            else:
                s.send(reply(req, done=True))
            answered += 1

sys.exit(main())
