"""rlflow reward-program client for Python: write a score function, call serve().

    import rlflow_reward

    def score(req):                      # req: rlflow_reward.Request
        n = len(req.response_ids) or len(req.response)
        return 1.0 - abs(n - 64) / 64, {"length": n}, "len %d" % n

    rlflow_reward.serve(score, connect="tcp://127.0.0.1:5557", name="judge", capacity=8)

serve() speaks the whole reward-program protocol (docs/reward-api.md): a ZeroMQ DEALER
connected to rlflow's endpoint, Hello / HelloAck with the protocol version checked, every
Heartbeat answered, RewardRequests handed to score() on a pool of worker threads and their
RewardResponses sent back, Shutdown ending the loop, reconnection when rlflow goes away, and
CURVE encryption and authentication when given keys.

score(req) returns the reward as a float, or (reward, components), (reward, components, info)
or (reward, components, info, token_rewards), or a dict with the key "reward" and any of
"components", "info", "token_rewards": components a dict of name -> float (logged by rlflow as
metrics), info a one-line str kept with the sample, token_rewards a sequence of floats, one per
response token (len(req.response_ids) of them; None or empty: none), which rlflow adds to the
sample's reward per token. An exception, a value that is not a number (a str such as "0.5", a
bool), a NaN / infinite reward or component, a component name that is not a str of 1 to 63
UTF-8 bytes, per-token rewards of the wrong count or not finite, or an answer over rlflow's
64 MiB message limit, is sent as the request's error string: rlflow logs it naming this
program and the request, drops the program (serve() reconnects at once) and sends the request
again; a sample refused max_attempts times (3 by default) stops the run.

Dependencies: Debian's python3-zmq and python3-protobuf (pip: pyzmq, protobuf), nothing else;
no protoc and no generated code. The protobuf message classes are built at import time from a
descriptor written out below, field for field from proto/rlflow.proto (only the messages a
reward program exchanges). That is robust where generated *_pb2.py files are not: generated
code is tied to the protoc and runtime versions that made it (protobuf 4.x refuses old
gencode, 5.x checks versions), while a descriptor built at run time does not depend on them:
tested with protobuf 4.21.12 (Debian 12's python3-protobuf, C++ and pure-Python back ends) and
7.36.2 (pip, upb and pure-Python back ends); docs/reward-api.md section 11. The protobuf runtime then does all
the wire work (packed ids, negative int64, the components map, unknown fields).
tests/tools/reward_client_py.py --check-schema checks this descriptor against the .proto.

Threads: serve() blocks its thread, which alone touches the socket (ZeroMQ sockets are not
thread safe); score() runs on `threads` worker threads, so pings are answered while a long
score runs. With threads > 1, score() must be thread safe.
"""
import json
import math
import numbers
import os
import socket as _socket
import struct
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

__all__ = ["serve", "Request", "load_key", "public_key", "RewardClientError", "Refused",
           "NoAnswer", "ConnectionLost", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 1
ROLE_REWARD_PROGRAM = 7

# Type tags, the first byte of every frame (MsgType in proto/rlflow.proto).
HELLO, HELLO_ACK, HEARTBEAT, ERROR, SHUTDOWN = 1, 2, 3, 4, 5
REWARD_REQUEST, REWARD_RESPONSE = 16, 17


class RewardClientError(Exception):
    """serve() could not go on. exit_code is what a program should exit with."""
    exit_code = 3


class Refused(RewardClientError):
    """rlflow refused this program: protocol version, CURVE key, CURVE on one side only."""
    exit_code = 4


class NoAnswer(RewardClientError):
    """No rlflow answered Hello in time, or nothing came for idle_exit seconds."""
    exit_code = 3


class ConnectionLost(RewardClientError):
    """The connection was lost and reconnect=False."""
    exit_code = 3


# ---- the schema: a descriptor of the reward-program messages of proto/rlflow.proto ------------

# (message, [(field, number, type, repeated)]): types are protobuf's FieldDescriptorProto type
# names without TYPE_; "Role" is the enum, "map<string,float>" the components map.
SCHEMA = [
    ("Hello", [("protocol_version", 1, "UINT32", False), ("role", 2, "Role", False),
               ("rank", 3, "INT32", False), ("pid", 4, "INT32", False),
               ("name", 5, "STRING", False), ("capacity", 6, "INT32", False),
               ("devices", 7, "STRING", True), ("hostname", 8, "STRING", False)]),
    ("HelloAck", [("accepted", 1, "BOOL", False), ("reason", 2, "STRING", False),
                  ("protocol_version", 3, "UINT32", False),
                  ("heartbeat_interval_ms", 4, "UINT32", False),
                  ("peer_timeout_ms", 5, "UINT32", False)]),
    ("Heartbeat", [("seq", 1, "UINT64", False)]),
    ("Error", [("code", 1, "INT32", False), ("message", 2, "STRING", False),
               ("request_id", 3, "UINT64", False)]),
    ("Shutdown", [("reason", 1, "STRING", False)]),
    ("RewardRequest", [("request_id", 1, "UINT64", False), ("prompt", 2, "STRING", False),
                       ("response", 3, "STRING", False), ("prompt_ids", 4, "INT32", True),
                       ("response_ids", 5, "INT32", True), ("ground_truth", 6, "STRING", False),
                       ("metadata_json", 7, "STRING", False), ("sample_index", 8, "INT64", False),
                       ("group_id", 9, "INT64", False)]),
    ("RewardResponse", [("request_id", 1, "UINT64", False), ("reward", 2, "FLOAT", False),
                        ("components", 3, "map<string,float>", False),
                        ("info", 4, "STRING", False), ("error", 5, "STRING", False),
                        ("token_rewards", 6, "FLOAT", True)]),
]
ROLES = ["ROLE_UNSPECIFIED", "ROLE_CONTROLLER", "ROLE_ROLLOUT", "ROLE_ACTOR", "ROLE_CRITIC",
         "ROLE_REFERENCE", "ROLE_REWARD", "ROLE_REWARD_PROGRAM", "ROLE_ENVIRONMENT"]


def _build_classes():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="rlflow_reward_client.proto", package="rlflow",
                                             syntax="proto3")
    role = fdp.enum_type.add(name="Role")
    for i, n in enumerate(ROLES):
        role.value.add(name=n, number=i)
    for mname, fields in SCHEMA:
        m = fdp.message_type.add(name=mname)
        for fname, num, ftype, repeated in fields:
            f = m.field.add(name=fname, number=num,
                            label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if ftype == "Role":
                f.type, f.type_name = F.TYPE_ENUM, ".rlflow.Role"
            elif ftype.startswith("map<"):
                entry = m.nested_type.add(name="ComponentsEntry")
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, label=F.LABEL_OPTIONAL, type=F.TYPE_STRING)
                entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL, type=F.TYPE_FLOAT)
                f.label, f.type = F.LABEL_REPEATED, F.TYPE_MESSAGE
                f.type_name = ".rlflow.%s.ComponentsEntry" % mname
            else:
                f.type = getattr(F, "TYPE_" + ftype)
    pool = descriptor_pool.DescriptorPool()  # private: no clash with a user's own rlflow_pb2
    pool.AddSerializedFile(fdp.SerializeToString())
    classes = {}
    for mname, _ in SCHEMA:
        desc = pool.FindMessageTypeByName("rlflow." + mname)
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
            classes[mname] = message_factory.GetMessageClass(desc)
        else:
            classes[mname] = message_factory.MessageFactory(pool).GetPrototype(desc)
    return classes


MESSAGES = _build_classes()
Hello, HelloAck, Heartbeat = MESSAGES["Hello"], MESSAGES["HelloAck"], MESSAGES["Heartbeat"]
ErrorMsg, Shutdown = MESSAGES["Error"], MESSAGES["Shutdown"]
RewardRequest, RewardResponse = MESSAGES["RewardRequest"], MESSAGES["RewardResponse"]


def encode(tag, msg):
    """One frame: the type tag byte, then the message's protobuf bytes."""
    return bytes([tag]) + msg.SerializeToString()


def decode(frame):
    """(tag, message) of a frame; message is None for a tag this module does not know.
    Raises ValueError for an empty frame or bytes that do not decode."""
    if not frame:
        raise ValueError("an empty frame (no type tag)")
    cls = {HELLO: Hello, HELLO_ACK: HelloAck, HEARTBEAT: Heartbeat, ERROR: ErrorMsg,
           SHUTDOWN: Shutdown, REWARD_REQUEST: RewardRequest,
           REWARD_RESPONSE: RewardResponse}.get(frame[0])
    if cls is None:
        return frame[0], None
    m = cls()
    try:
        m.ParseFromString(bytes(frame[1:]))
    except Exception as e:  # DecodeError, or the C++ back end's own error types
        raise ValueError("%d bytes after tag %d do not decode as rlflow.%s (%s)"
                         % (len(frame) - 1, frame[0], cls.DESCRIPTOR.name, e))
    return frame[0], m


# ---- requests -----------------------------------------------------------------------------------

class Request:
    """One sample to score (a RewardRequest). metadata is the sample's other dataset fields,
    parsed from metadata_json ({} when there are none; a ValueError on first use when it is not
    a JSON object, which becomes the request's error)."""
    __slots__ = ("request_id", "prompt", "response", "prompt_ids", "response_ids",
                 "ground_truth", "metadata_json", "sample_index", "group_id", "_metadata")

    def __init__(self, m):
        self.request_id = m.request_id
        self.prompt, self.response = m.prompt, m.response
        self.prompt_ids, self.response_ids = list(m.prompt_ids), list(m.response_ids)
        self.ground_truth, self.metadata_json = m.ground_truth, m.metadata_json
        self.sample_index, self.group_id = m.sample_index, m.group_id
        self._metadata = None

    @property
    def metadata(self):
        if self._metadata is None:
            if not self.metadata_json:
                self._metadata = {}
            else:
                try:
                    v = json.loads(self.metadata_json)
                except ValueError as e:
                    raise ValueError("metadata_json is not JSON: %s" % e)
                if not isinstance(v, dict):
                    raise ValueError("metadata_json is not a JSON object")
                self._metadata = v
        return self._metadata

    def __repr__(self):
        return ("Request(id=%d, group=%d, sample=%d, response=%r)"
                % (self.request_id, self.group_id, self.sample_index, self.response[:40]))


_RESULT_KEYS = ("reward", "components", "info", "token_rewards")


def _unpack(out):
    """(reward, components, info, token_rewards) of what score_fn returned."""
    if isinstance(out, dict):
        unknown = sorted(set(out) - set(_RESULT_KEYS))
        if unknown:
            raise ValueError("score function returned a dict with unknown key%s %s; the keys are "
                             "%s" % ("s" if len(unknown) > 1 else "", ", ".join(map(repr, unknown)),
                                     ", ".join(_RESULT_KEYS)))
        if "reward" not in out:
            raise ValueError("score function returned a dict without \"reward\"")
        out = tuple(out.get(k) for k in _RESULT_KEYS)
    elif not isinstance(out, tuple):
        out = (out,)
    if not 1 <= len(out) <= 4:
        raise ValueError("score function returned a tuple of %d; expected (reward), "
                         "(reward, components), (reward, components, info) or "
                         "(reward, components, info, token_rewards)" % len(out))
    out = out + (None,) * (4 - len(out))
    return out[0], out[1] or {}, out[2] or "", out[3]


# rlflow refuses a message over 64 MiB by closing the connection (RF_MSG_EXTERNAL_MAX_BYTES,
# docs/reward-api.md section 8): an answer that large is sent as an error instead.
MAX_MESSAGE_BYTES = 64 << 20

# rlflow's limit on a component's name, in UTF-8 bytes (docs/reward-api.md section 4)
MAX_COMPONENT_NAME = 63


def _number(v, what):
    """v as a float when it is a real number (int, float, numpy's); anything else, a bool or a
    string such as "0.5" included, is the score function's mistake, not something to coerce."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError("the score function returned %s %r as the %s; it must be a number (an int "
                        "or a float, not a bool or a string)" % (type(v).__name__, v, what))
    return float(v)


def _float32(v, what):
    """v as a Python float that a protobuf float (IEEE 754 single) holds finitely."""
    v = _number(v, what)
    try:
        if math.isfinite(v):
            struct.pack("<f", v)
            return v
    except OverflowError:
        pass
    raise ValueError("the score function returned a non-finite %s (%r)" % (what, v))


def _token_rewards(values, n_ids):
    """The per-token rewards as floats, checked as rlflow checks them."""
    vals = [_number(v, "per-token reward at token %d" % k) for k, v in enumerate(values)]
    if vals and len(vals) != n_ids:
        raise ValueError("the score function returned %d per-token rewards for a response of %d "
                         "token%s" % (len(vals), n_ids, "" if n_ids == 1 else "s"))
    for k, v in enumerate(vals):
        try:
            _float32(v, "per-token reward")
        except ValueError:
            raise ValueError("the score function returned a non-finite per-token reward (%r at "
                             "token %d)" % (v, k))
    return vals


def _score(score_fn, req, quiet):
    """Runs score_fn on a worker thread; returns the RewardResponse to send."""
    r = RewardResponse(request_id=req.request_id)
    try:
        try:
            out = score_fn(req)
        except Exception:
            if not quiet:
                sys.stderr.write(traceback.format_exc())
            raise
        reward, comps, info, tokens = _unpack(out)
        reward = _float32(reward, "reward")
        tokens = _token_rewards(tokens, len(req.response_ids)) if tokens is not None else []
        for k, v in dict(comps).items():
            if not isinstance(k, str) or not 1 <= len(k.encode("utf-8")) <= MAX_COMPONENT_NAME:
                raise ValueError("the score function returned a component named %r; component "
                                 "names must be strings of 1 to %d bytes" % (k, MAX_COMPONENT_NAME))
            r.components[k] = _float32(v, "component %r" % k)
        r.reward, r.info = reward, str(info)
        r.token_rewards.extend(tokens)
        if r.ByteSize() + 1 > MAX_MESSAGE_BYTES:
            raise ValueError("the answer is %d bytes, over rlflow's message limit of %d bytes "
                             "(a long info?)" % (r.ByteSize() + 1, MAX_MESSAGE_BYTES))
    except Exception as e:
        r = RewardResponse(request_id=req.request_id,
                           error="%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__)
    return r


# ---- keys ---------------------------------------------------------------------------------------

def load_key(path):
    """The key of a key file (`rlflow keygen --out PREFIX` writes PREFIX.key and PREFIX.pub):
    the first word of the one line that is not blank or a comment (a first word starting with
    '#' that is not 40 characters long). Raises ValueError naming the file and line."""
    found = None
    with open(path, "r", encoding="ascii", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            words = line.split()
            if not words or (words[0].startswith("#") and len(words[0]) != 40):
                continue
            key = words[0]
            if len(key) != 40:
                raise ValueError("%s:%d: a CURVE key is 40 Z85 characters, got %d"
                                 % (path, lineno, len(key)))
            try:
                zmq.utils.z85.decode(key.encode())
            except Exception:
                raise ValueError("%s:%d: \"%s\" is not Z85 (ZeroMQ RFC 32)" % (path, lineno, key))
            if found:
                raise ValueError("%s:%d: a second key (the key is on line %d); a key file holds "
                                 "one key" % (path, lineno, found[1]))
            found = (key, lineno)
    if not found:
        raise ValueError("%s: no key in the file (expected one line of 40 Z85 characters, as "
                         "`rlflow keygen` writes)" % path)
    return found[0]


def public_key(secret):
    """The Z85 public key of a Z85 secret key."""
    return zmq.curve_public(secret.encode() if isinstance(secret, str) else secret).decode()



# ---- the connection -----------------------------------------------------------------------------

_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                   zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
                   zmq.EVENT_DISCONNECTED)
_MECHANISM_MISMATCH = 0x11000002
_monitor_seq = [0]


class _Conn:
    """One session: a DEALER socket with its monitor. The same sentences as rlflow's C client
    (common/msg.c) for every refusal."""

    def __init__(self, ctx, o):
        self.o, self.endpoint = o, o["connect"]
        self.curve = o["curve_server_key"] is not None
        self.established = self.disconnected = False
        self.weak_failures = 0
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 500
        self.sock.sndtimeo = int(o["hello_timeout"] * 1000)
        if self.curve:
            self.sock.curve_serverkey = o["curve_server_key"].encode()
            self.sock.curve_publickey = o["curve_public_key"].encode()
            self.sock.curve_secretkey = o["curve_secret_key"].encode()
        _monitor_seq[0] += 1
        addr = "inproc://rlflow-reward-monitor-%d-%d" % (os.getpid(), _monitor_seq[0])
        self.sock.monitor(addr, _MONITOR_EVENTS)
        self.mon = ctx.socket(zmq.PAIR)
        self.mon.linger = 0
        self.mon.connect(addr)
        try:
            self.sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self.close(linger=0)
            raise ValueError("cannot connect to %r: %s" % (self.endpoint, e))

    def close(self, linger=500):
        """linger: ms for the last answers to leave (0 after an error: nothing worth waiting)."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close()
        self.sock.close(linger=linger)

    def send(self, tag, msg):
        try:
            self.sock.send(encode(tag, msg))
        except zmq.Again:
            raise ConnectionLost("sending a %s to rlflow at %s timed out"
                                 % (msg.DESCRIPTOR.name, self.endpoint))

    def watch(self):
        """Reads the monitor; raises Refused when the handshake was refused."""
        while self.mon.poll(0):
            ev = parse_monitor_message(self.mon.recv_multipart())
            e, v = ev["event"], ev["value"]
            if e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.established, self.weak_failures = True, 0
            elif e == zmq.EVENT_DISCONNECTED and self.established:
                self.disconnected = True
            elif e == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                if v == 400:
                    raise Refused("refused by rlflow at %s: CURVE authentication failed (ZAP "
                                  "status 400): this client's public key %s is not among the "
                                  "keys it allows" % (self.endpoint, self.o["curve_public_key"]))
                raise Refused("refused by rlflow at %s: CURVE authentication failed (ZAP status "
                              "%d)" % (self.endpoint, v))
            elif e == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if v == _MECHANISM_MISMATCH and not self.curve:
                    raise Refused("rlflow at %s requires CURVE: connect with its public key and a "
                                  "key pair of this program's own whose public key it allows "
                                  "(docs/reward-api.md, \"CURVE\")" % self.endpoint)
                if v == _MECHANISM_MISMATCH:
                    raise Refused("rlflow at %s does not use CURVE, but this client was given a "
                                  "server key: connect without CURVE" % self.endpoint)
                raise Refused("the handshake with rlflow at %s failed (ZMTP protocol error 0x%x)"
                              % (self.endpoint, v))
            elif e == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # the server closed the connection during the handshake without a reason: with
                # CURVE it could not decrypt our Hello (a wrong server key); without, it requires
                # CURVE (a mismatch it reported by closing before we read its greeting)
                self.weak_failures += 1
                if self.weak_failures >= 3 and self.curve:
                    raise Refused("the CURVE handshake with rlflow at %s failed %d times (the "
                                  "server closed the connection each time): is the server public "
                                  "key right?" % (self.endpoint, self.weak_failures))
                if self.weak_failures >= 3:
                    raise Refused("the handshake with rlflow at %s failed %d times (the server "
                                  "closed the connection each time): it probably requires CURVE; "
                                  "connect with its public key and a key pair of this program's "
                                  "own whose public key it allows (docs/reward-api.md, \"CURVE\")"
                                  % (self.endpoint, self.weak_failures))

    def handshake(self):
        """Hello, then HelloAck within hello_timeout. Returns the HelloAck."""
        o = self.o
        self.send(HELLO, Hello(protocol_version=o["protocol_version"], role=ROLE_REWARD_PROGRAM,
                               rank=o["rank"], pid=os.getpid(), name=o["name"],
                               capacity=o["capacity"], hostname=_socket.gethostname()))
        deadline = time.monotonic() + o["hello_timeout"]
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        while True:
            self.watch()
            left = deadline - time.monotonic()
            if left <= 0:
                hint = (" (the server closed the connection during the handshake: check its "
                        "CURVE settings)" if self.weak_failures else "")
                raise NoAnswer("rlflow at %s did not answer Hello within %.1f s%s"
                               % (self.endpoint, o["hello_timeout"], hint))
            if self.sock not in dict(poller.poll(int(left * 1000) + 1)):
                continue
            try:
                tag, m = decode(self.sock.recv())
            except ValueError as e:
                raise RewardClientError("rlflow at %s sent a malformed message: %s"
                                        % (self.endpoint, e))
            if tag == HEARTBEAT:
                self.send(HEARTBEAT, Heartbeat(seq=m.seq))
                continue
            if tag != HELLO_ACK:
                raise RewardClientError("rlflow at %s answered Hello with tag %d"
                                        % (self.endpoint, tag))
            if not m.accepted:
                raise Refused("refused by rlflow at %s: %s" % (self.endpoint, m.reason))
            if m.protocol_version != o["protocol_version"]:
                raise Refused("rlflow at %s speaks protocol %d, this reward program speaks %d"
                              % (self.endpoint, m.protocol_version, o["protocol_version"]))
            return m


# ---- serve --------------------------------------------------------------------------------------

def _options(connect, name, capacity, threads, rank, hello_timeout, idle_exit,
             curve_server_key, curve_secret_key, curve_public_key, protocol_version):
    def bad(what):
        raise ValueError("rlflow_reward.serve: " + what)
    if not isinstance(connect, str) or "://" not in connect:
        bad("connect must be an endpoint such as \"tcp://127.0.0.1:5557\" (got %r)" % (connect,))
    if not isinstance(threads, int) or not 1 <= threads <= 1024:
        bad("threads must be an int in [1, 1024] (got %r)" % (threads,))
    if capacity is None:
        capacity = 2 * threads
    if not isinstance(capacity, int) or capacity < 1:
        bad("capacity must be an int >= 1 (got %r)" % (capacity,))
    if not (isinstance(hello_timeout, (int, float)) and hello_timeout > 0):
        bad("hello_timeout must be > 0 seconds (got %r)" % (hello_timeout,))
    if not (isinstance(idle_exit, (int, float)) and idle_exit >= 0):
        bad("idle_exit must be >= 0 seconds (got %r)" % (idle_exit,))
    if len(name.encode()) > 63:
        bad("name %r is longer than 63 bytes" % name)
    keys = [k.decode() if isinstance(k, bytes) else k
            for k in (curve_server_key, curve_secret_key, curve_public_key)]
    for what, k in zip(("curve_server_key", "curve_secret_key", "curve_public_key"), keys):
        if k is not None and (len(k) != 40 or not _is_z85(k)):
            bad("%s is not a 40-character Z85 key (got %r)" % (what, k))
    server, secret, public = keys
    if (secret or public) and not server:
        bad("a CURVE key pair without rlflow's public key (curve_server_key)")
    if server and not secret:
        bad("curve_server_key needs this program's own key pair too (curve_secret_key; "
            "rlflow keygen writes one)")
    if server:
        derived = public_key(secret)
        if public and public != derived:
            bad("curve_public_key %s is not the one of curve_secret_key (%s): the two are not one "
                "pair" % (public, derived))
        public = derived
    return {"connect": connect, "name": name, "capacity": capacity, "threads": threads,
            "rank": rank, "hello_timeout": float(hello_timeout), "idle_exit": float(idle_exit),
            "curve_server_key": server, "curve_secret_key": secret, "curve_public_key": public,
            "protocol_version": protocol_version}


def _is_z85(k):
    try:
        zmq.utils.z85.decode(k.encode())
        return True
    except Exception:
        return False


def _from_environment(connect, rank, server, secret, public):
    """A program rlflow started (reward.programs) finds its endpoint, CURVE keys and rank in
    the environment (docs/reward-api.md, "Programs started by rlflow"): the endpoint when
    connect is None, the keys when the endpoint is that one and no key is given, the rank when
    rank is None."""
    env = os.environ.get("RLFLOW_REWARD_ENDPOINT") or None
    if connect is None:
        connect = env or "tcp://127.0.0.1:5557"
    if env is not None and connect == env and server is None and secret is None and public is None:
        server = os.environ.get("RLFLOW_REWARD_SERVER_KEY") or None
        secret = os.environ.get("RLFLOW_REWARD_SECRET_KEY") or None
        public = os.environ.get("RLFLOW_REWARD_PUBLIC_KEY") or None
    if rank is None:
        try:
            rank = int(os.environ.get("RLFLOW_REWARD_RANK") or 0)
        except ValueError:
            rank = 0
    return connect, rank, server, secret, public


def serve(score_fn, connect=None, name="reward_program", capacity=None,
          threads=1, rank=None, hello_timeout=30.0, idle_exit=0.0, reconnect=True,
          curve_server_key=None, curve_secret_key=None, curve_public_key=None,
          stop_event=None, quiet=False, protocol_version=PROTOCOL_VERSION):
    """Serves rlflow's reward requests until rlflow sends Shutdown (or stop_event is set);
    returns the number of requests answered.

    connect        rlflow's endpoint (reward.external of the recipe); None: the environment's
                   RLFLOW_REWARD_ENDPOINT (with its CURVE keys), set for the programs rlflow
                   starts (reward.programs), else "tcp://127.0.0.1:5557"
    name, rank     how rlflow's logs name this program
    capacity       requests rlflow may send before an answer (default 2 * threads)
    threads        worker threads running score_fn
    hello_timeout  seconds to wait for rlflow's HelloAck, at first and after a reconnection
    idle_exit      raise NoAnswer after this many seconds without any message (0: never; rlflow
                   is silent between batches while it trains)
    reconnect      when rlflow closes the connection or drops this program (an Error): connect
                   again with a fresh socket and Hello (True), or raise ConnectionLost
    curve_*        CURVE: rlflow's public key and this program's key pair, Z85 str (load them
                   with load_key; the public key may be left out: derived from the secret)
    stop_event     a threading.Event that makes serve return
    protocol_version  the version claimed in Hello (tests)

    Raises ValueError for bad arguments, Refused (version, CURVE key), NoAnswer,
    ConnectionLost, RewardClientError; each message is a complete sentence.
    """
    connect, rank, curve_server_key, curve_secret_key, curve_public_key = _from_environment(
        connect, rank, curve_server_key, curve_secret_key, curve_public_key)
    o = _options(connect, name, capacity, threads, rank, hello_timeout, idle_exit,
                 curve_server_key, curve_secret_key, curve_public_key, protocol_version)
    return _Server(score_fn, o, reconnect, stop_event, quiet).run()


class _Server:
    def __init__(self, score_fn, o, reconnect, stop_event, quiet):
        self.score_fn, self.o, self.reconnect = score_fn, o, reconnect
        self.stop_event, self.quiet = stop_event, quiet
        self.session = 0
        self.scored = 0
        self.done = deque()  # (session, RewardResponse) from the workers
        self.pending = set()  # futures of this session
        self.lock = threading.Lock()  # the wake-up pipe is written by workers, closed by run()
        self.closed = False

    def say(self, text):
        if not self.quiet:
            sys.stderr.write("%s: %s\n" % (self.o["name"], text))
            sys.stderr.flush()

    def run(self):
        ctx = zmq.Context()
        pool = ThreadPoolExecutor(max_workers=self.o["threads"])
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        try:
            while True:
                self.session += 1
                conn = _Conn(ctx, self.o)
                end = None
                try:
                    try:
                        ack = conn.handshake()
                    except NoAnswer as e:
                        if self.session > 1:
                            raise NoAnswer("reconnecting after the connection was lost: %s" % e)
                        raise
                    self.say("connected to %s%s (protocol %d, capacity %d, %d thread%s; rlflow "
                             "pings every %.2f s)"
                             % (self.o["connect"], " with CURVE" if conn.curve else "",
                                ack.protocol_version, self.o["capacity"], self.o["threads"],
                                "" if self.o["threads"] == 1 else "s",
                                ack.heartbeat_interval_ms / 1000.0))
                    end = self.serve_session(conn, pool)
                finally:
                    conn.close(linger=500 if end else 0)
                    # requests no worker started yet: rlflow re-sends them elsewhere
                    for f in list(self.pending):
                        f.cancel()
                    self.pending.clear()
                if end != "lost":
                    return self.scored
                if not self.reconnect:
                    raise ConnectionLost("the connection to rlflow at %s was lost (reconnect=False)"
                                         % self.o["connect"])
                self.say("reconnecting to %s" % self.o["connect"])
        finally:
            # a score still running finishes on its own; its answer has nowhere to go
            pool.shutdown(wait=False, cancel_futures=True)
            with self.lock:
                self.closed = True
                os.close(self.wake_r)
                os.close(self.wake_w)
            ctx.destroy(linger=0)  # closes any socket an exception left open, then terminates

    def finished(self, session, fut):
        if fut.cancelled():
            return
        self.done.append((session, fut.result()))
        with self.lock:
            if self.closed:
                return
            try:
                os.write(self.wake_w, b"x")
            except BlockingIOError:  # a full pipe already holds a wake-up
                pass

    def flush(self, conn):
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self.done:
            session, resp = self.done.popleft()
            self.pending = {f for f in self.pending if not f.done()}
            if session == self.session:  # answers for a connection that is gone are dropped
                conn.send(REWARD_RESPONSE, resp)
                self.scored += 1

    def on_frame(self, conn, pool, frame):
        """Handles one frame; returns "shutdown" or "lost" when the session is over."""
        try:
            tag, m = decode(frame)
        except ValueError as e:
            self.say("rlflow at %s sent a malformed message: %s" % (self.o["connect"], e))
            return None
        if tag == HEARTBEAT:
            conn.send(HEARTBEAT, Heartbeat(seq=m.seq))
        elif tag == REWARD_REQUEST:
            session = self.session
            fut = pool.submit(_score, self.score_fn, Request(m), self.quiet)
            self.pending.add(fut)
            fut.add_done_callback(lambda f: self.finished(session, f))
        elif tag == SHUTDOWN:
            self.say("shutdown (%s) after %d requests" % (m.reason, self.scored))
            return "shutdown"
        elif tag == ERROR:  # rlflow drops a program with an Error, or answers an unknown one
            self.say("rlflow says: %s" % m.message)
            return "lost"
        return None  # a tag this version does not know: skipped, as the protocol asks

    def drain(self, conn, pool):
        """Handles every frame waiting on the socket; "shutdown" / "lost" ends the session."""
        while conn.sock.poll(0):
            end = self.on_frame(conn, pool, conn.sock.recv())
            if end:
                return end
        return None

    def serve_session(self, conn, pool):
        poller = zmq.Poller()
        poller.register(conn.sock, zmq.POLLIN)
        poller.register(conn.mon, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        last_heard = time.monotonic()
        while True:
            if self.stop_event is not None and self.stop_event.is_set():
                return "stop"
            ready = dict(poller.poll(250))
            if self.wake_r in ready:
                self.flush(conn)
            if conn.sock in ready:
                last_heard = time.monotonic()
                end = self.drain(conn, pool)
                if end:
                    return end
            conn.watch()
            if conn.disconnected:
                # what rlflow sent before it closed (a Shutdown) may still wait in the socket:
                # the monitor's event can overtake it
                end = self.drain(conn, pool)
                if end:
                    return end
                self.say("rlflow at %s closed the connection" % self.o["connect"])
                return "lost"
            if self.o["idle_exit"] > 0 and time.monotonic() - last_heard > self.o["idle_exit"]:
                raise NoAnswer("nothing from rlflow at %s for %.1f s (idle_exit)"
                               % (self.o["connect"], self.o["idle_exit"]))
