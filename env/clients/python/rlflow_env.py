"""rlflow environment-program client for Python: write reset() and step(), call serve().

    import rlflow_env

    def reset(req):                       # req: rlflow_env.Reset
        return "You may call <calc>EXPR</calc>."      # the first observation ("" for none)

    def step(req):                        # req: rlflow_env.Step
        if req.finish == "eos":
            return "", 0.0, True          # observation, reward of this turn, done
        return "<result>42</result>", 0.0, False

    rlflow_env.serve(reset, step, connect="tcp://127.0.0.1:5558", name="my_env", capacity=8)
    # started by rlflow (env.programs): rlflow_env.serve(reset, step) finds the endpoint and keys

serve() speaks the whole environment protocol (docs/env-api.md): a ZeroMQ DEALER connected to
rlflow's endpoint (env.endpoint of the recipe), Hello / HelloAck as an environment program
(ROLE_ENVIRONMENT) with the protocol version checked, every Heartbeat answered, EnvReset and
EnvStep requests handed to reset() and step() on a pool of worker threads and their EnvReplies
sent back (in any order), Shutdown ending the loop, a fresh connection after rlflow drops this
program, and CURVE when given keys.

reset(req) returns the first observation: a str (None: ""). step(req) returns (observation,
reward), (observation, reward, done) or a dict with any of "observation", "reward", "done",
"info". An exception, or a reward that is not a finite number, is sent as the request's error:
rlflow logs it naming this program and the request, drops the program (serve() reconnects) and
sends the request to another program; a request refused max_attempts times stops the run.

Every request is self-contained: a Step carries its episode's Reset (req.reset), the first
observation and the earlier turns (req.history), so a program that keeps no state, or one that
lost it, can answer any step. A program may keep state keyed by req.episode_id.

Dependencies: Debian's python3-zmq and python3-protobuf (pip: pyzmq, protobuf); the message
classes are built at import time from the descriptor below (field for field from
proto/rlflow.proto), as rlflow_reward.py does: no protoc, no generated code.

Threads: serve() alone touches the socket; reset() and step() run on `threads` worker threads
(with threads > 1 they must be thread safe).
"""
import json
import math
import os
import socket as _socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

__all__ = ["serve", "Reset", "Step", "Turn", "EnvClientError", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 1
ROLE_ENVIRONMENT = 8
HELLO, HELLO_ACK, HEARTBEAT, ERROR, SHUTDOWN = 1, 2, 3, 4, 5
ENV_RESET, ENV_STEP, ENV_REPLY = 18, 19, 20

# (message, [(field, number, type, repeated)]), type a scalar name or "msg:<Message>".
SCHEMA = [
    ("Hello", [("protocol_version", 1, "UINT32", False), ("role", 2, "INT32", False),
               ("rank", 3, "INT32", False), ("pid", 4, "INT32", False), ("name", 5, "STRING", False),
               ("capacity", 6, "INT32", False), ("devices", 7, "STRING", True),
               ("hostname", 8, "STRING", False)]),
    ("HelloAck", [("accepted", 1, "BOOL", False), ("reason", 2, "STRING", False),
                  ("protocol_version", 3, "UINT32", False), ("heartbeat_interval_ms", 4, "UINT32", False),
                  ("peer_timeout_ms", 5, "UINT32", False)]),
    ("Heartbeat", [("seq", 1, "UINT64", False)]),
    ("Error", [("code", 1, "INT32", False), ("message", 2, "STRING", False), ("request_id", 3, "UINT64", False)]),
    ("Shutdown", [("reason", 1, "STRING", False)]),
    ("EnvReset", [("request_id", 1, "UINT64", False), ("episode_id", 2, "UINT64", False),
                  ("prompt", 3, "STRING", False), ("prompt_ids", 4, "INT32", True),
                  ("ground_truth", 5, "STRING", False), ("metadata_json", 6, "STRING", False),
                  ("sample_index", 7, "INT64", False), ("group_id", 8, "INT64", False)]),
    ("EnvTurn", [("action", 1, "STRING", False), ("action_ids", 2, "INT32", True),
                 ("observation", 3, "STRING", False), ("reward", 4, "FLOAT", False)]),
    ("EnvStep", [("request_id", 1, "UINT64", False), ("episode_id", 2, "UINT64", False),
                 ("turn", 3, "INT32", False), ("action", 4, "STRING", False), ("action_ids", 5, "INT32", True),
                 ("finish", 6, "STRING", False), ("last", 7, "BOOL", False), ("reset", 8, "msg:EnvReset", False),
                 ("first_observation", 9, "STRING", False), ("history", 10, "msg:EnvTurn", True)]),
    ("EnvReply", [("request_id", 1, "UINT64", False), ("observation", 2, "STRING", False),
                  ("reward", 3, "FLOAT", False), ("done", 4, "BOOL", False), ("error", 5, "STRING", False),
                  ("info", 6, "STRING", False)]),
]


def _build_classes():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="rlflow_env_client.proto", package="rlflow", syntax="proto3")
    for mname, fields in SCHEMA:
        m = fdp.message_type.add(name=mname)
        for fname, num, ftype, repeated in fields:
            f = m.field.add(name=fname, number=num, label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if ftype.startswith("msg:"):
                f.type, f.type_name = F.TYPE_MESSAGE, ".rlflow." + ftype[4:]
            else:
                f.type = getattr(F, "TYPE_" + ftype)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(fdp.SerializeToString())
    out = {}
    for mname, _ in SCHEMA:
        desc = pool.FindMessageTypeByName("rlflow." + mname)
        if hasattr(message_factory, "GetMessageClass"):
            out[mname] = message_factory.GetMessageClass(desc)
        else:
            out[mname] = message_factory.MessageFactory(pool).GetPrototype(desc)
    return out


MESSAGES = _build_classes()
_BY_TAG = {HELLO_ACK: "HelloAck", HEARTBEAT: "Heartbeat", ERROR: "Error", SHUTDOWN: "Shutdown",
           ENV_RESET: "EnvReset", ENV_STEP: "EnvStep"}


class EnvClientError(Exception):
    """A failure serve() cannot recover from; the message is a complete sentence."""


def _encode(tag, msg):
    return bytes([tag]) + msg.SerializeToString()


def _decode(frame):
    if not frame:
        raise ValueError("an empty frame")
    name = _BY_TAG.get(frame[0])
    if name is None:
        return frame[0], None
    m = MESSAGES[name]()
    m.ParseFromString(bytes(frame[1:]))
    return frame[0], m


class Reset:
    """An EnvReset: episode_id, prompt, prompt_ids, ground_truth, metadata (the example's other
    dataset fields, a dict), sample_index, group_id."""

    def __init__(self, m):
        self.request_id, self.episode_id = m.request_id, m.episode_id
        self.prompt, self.prompt_ids = m.prompt, list(m.prompt_ids)
        self.ground_truth, self.metadata_json = m.ground_truth, m.metadata_json
        self.sample_index, self.group_id = m.sample_index, m.group_id

    @property
    def metadata(self):
        return json.loads(self.metadata_json) if self.metadata_json else {}


class Turn:
    """An earlier turn: action (text), action_ids, observation (the answer it got), reward."""

    def __init__(self, m):
        self.action, self.action_ids = m.action, list(m.action_ids)
        self.observation, self.reward = m.observation, m.reward


class Step:
    """An EnvStep: episode_id, turn (0 first), action (the turn's text, cut before a stop
    string), action_ids, finish ("eos", "stop", "length"), last (a limit ends the episode after
    this turn: the observation is not used), reset (the episode's Reset), first_observation,
    history (a list of Turn, turns 0 .. turn - 1)."""

    def __init__(self, m):
        self.request_id, self.episode_id, self.turn = m.request_id, m.episode_id, m.turn
        self.action, self.action_ids, self.finish, self.last = m.action, list(m.action_ids), m.finish, m.last
        self.reset, self.first_observation = Reset(m.reset), m.first_observation
        self.history = [Turn(t) for t in m.history]


def _reply(fn, req, is_step):
    """The EnvReply of fn(req): its answer, or its failure as the error."""
    r = MESSAGES["EnvReply"](request_id=req.request_id)
    try:
        out = fn(req)
        obs, reward, done, info = (out if out is not None else ""), 0.0, False, ""
        if is_step:
            if isinstance(out, dict):
                obs, reward = out.get("observation", ""), out.get("reward", 0.0)
                done, info = out.get("done", False), out.get("info", "")
            elif isinstance(out, (tuple, list)) and len(out) in (2, 3):
                obs, reward, done = (tuple(out) + (False,))[:3]
            else:
                raise TypeError("step() returned %r; expected (observation, reward[, done]) or a dict" % (out,))
        if not isinstance(obs, str):
            raise TypeError("the observation must be a str, got %r" % (obs,))
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError("reward %r is not finite" % reward)
        r.observation, r.reward, r.done, r.info = obs, reward, bool(done), str(info or "")
    except Exception as e:  # the request's error: rlflow sends it to another program
        r.error = "%s: %s" % (type(e).__name__, e)
    return r


def _from_environment(connect, rank, server, secret, public):
    """A program rlflow started (env.programs) finds its endpoint, CURVE keys and rank in the
    environment (docs/env-api.md, "Programs started by rlflow"): the endpoint when connect is
    None, the keys when the endpoint is that one and no key is given, the rank when rank is
    None."""
    env = os.environ.get("RLFLOW_ENV_ENDPOINT") or None
    if connect is None:
        connect = env or "tcp://127.0.0.1:5558"
    if env is not None and connect == env and server is None and secret is None and public is None:
        server = os.environ.get("RLFLOW_ENV_SERVER_KEY") or None
        secret = os.environ.get("RLFLOW_ENV_SECRET_KEY") or None
        public = os.environ.get("RLFLOW_ENV_PUBLIC_KEY") or None
    if rank is None:
        try:
            rank = int(os.environ.get("RLFLOW_ENV_RANK") or 0)
        except ValueError:
            rank = 0
    return connect, rank, server, secret, public


def serve(reset, step, connect=None, name="env_program", capacity=None, threads=1,
          rank=None, hello_timeout=30.0, reconnect=True, curve_server_key=None, curve_secret_key=None,
          curve_public_key=None, quiet=False):
    """Serves rlflow's environment requests until rlflow sends Shutdown; returns the number
    answered. connect: rlflow's endpoint (env.endpoint of the recipe); None: the environment's
    RLFLOW_ENV_ENDPOINT (with its CURVE keys and RLFLOW_ENV_RANK), set for the programs rlflow
    starts (env.programs), else "tcp://127.0.0.1:5558". capacity: requests rlflow may send
    before an answer (default 2 * threads); curve_*: rlflow's public key and this program's key
    pair (Z85 str). Raises ValueError for bad arguments and EnvClientError when rlflow refuses
    this program or does not answer Hello."""
    connect, rank, curve_server_key, curve_secret_key, curve_public_key = _from_environment(
        connect, rank, curve_server_key, curve_secret_key, curve_public_key)
    if not isinstance(connect, str) or "://" not in connect:
        raise ValueError("rlflow_env.serve: connect must be an endpoint such as \"tcp://127.0.0.1:5558\"")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError("rlflow_env.serve: threads must be an int >= 1 (got %r)" % (threads,))
    capacity = 2 * threads if capacity is None else capacity
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError("rlflow_env.serve: capacity must be an int >= 1 (got %r)" % (capacity,))
    if bool(curve_server_key) != bool(curve_secret_key):
        raise ValueError("rlflow_env.serve: CURVE needs rlflow's public key and this program's secret key")
    ctx = zmq.Context.instance()
    pool = ThreadPoolExecutor(max_workers=threads)
    answered = 0
    try:
        while True:
            sock = _connect(ctx, connect, name, capacity, rank, hello_timeout, curve_server_key, curve_secret_key,
                            curve_public_key)
            try:
                n, again = _session(sock, pool, reset, step, name, quiet)
            finally:
                sock.close(linger=500)
            answered += n
            if not (again and reconnect):
                return answered
    finally:
        pool.shutdown(wait=False)


def _connect(ctx, endpoint, name, capacity, rank, hello_timeout, server_key, secret, public):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 500
    if server_key:
        sock.curve_serverkey = server_key.encode()
        sock.curve_secretkey = secret.encode()
        sock.curve_publickey = (public or zmq.curve_public(secret.encode()).decode()).encode()
    sock.connect(endpoint)
    hello = MESSAGES["Hello"](protocol_version=PROTOCOL_VERSION, role=ROLE_ENVIRONMENT, rank=rank,
                              pid=os.getpid(), name=name, capacity=capacity, hostname=_socket.gethostname())
    sock.send(_encode(HELLO, hello))
    deadline = time.monotonic() + hello_timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000) + 1):
            if time.monotonic() < deadline:
                continue
            sock.close(linger=0)
            raise EnvClientError("rlflow at %s did not answer Hello within %.1f s" % (endpoint, hello_timeout))
        tag, m = _decode(sock.recv())
        if tag == HEARTBEAT:
            sock.send(_encode(HEARTBEAT, MESSAGES["Heartbeat"](seq=m.seq)))
        elif tag == HELLO_ACK:
            if not m.accepted:
                sock.close(linger=0)
                raise EnvClientError("refused by rlflow at %s: %s" % (endpoint, m.reason))
            return sock


def _session(sock, pool, reset, step, name, quiet):
    """Answers requests until Shutdown (returns (n, False)) or an Error (n, True: reconnect)."""
    pending, n = set(), 0
    while True:
        for f in [f for f in pending if f.done()]:
            pending.discard(f)
            sock.send(_encode(ENV_REPLY, f.result()))
            n += 1
        if not sock.poll(5 if pending else 1000):
            continue
        try:
            tag, m = _decode(sock.recv())
        except Exception as e:  # not ours to fix: say so and go on
            if not quiet:
                sys.stderr.write("%s: rlflow sent a malformed message: %s\n" % (name, e))
            continue
        if tag == HEARTBEAT:
            sock.send(_encode(HEARTBEAT, MESSAGES["Heartbeat"](seq=m.seq)))
        elif tag == SHUTDOWN:
            return n, False
        elif tag == ERROR:
            if not quiet:
                sys.stderr.write("%s: rlflow says: %s\n" % (name, m.message))
            return n, True
        elif tag == ENV_RESET:
            pending.add(pool.submit(_reply, reset, Reset(m), False))
        elif tag == ENV_STEP:
            pending.add(pool.submit(_reply, step, Step(m), True))
