#!/usr/bin/env python3
"""A reward program for rlflow: rewards responses whose length is close to a target.

    reward = 1 - |len - target| / target        (unclipped: 1 at the target, 0 at 0 or 2x)

len is the response's token count (RewardRequest.response_ids), or its length in characters
when the request carries no token ids (or with --unit chars).

    python3 examples/reward/length_judge.py --connect tcp://127.0.0.1:5557 --target 64

Needs only pyzmq (Debian: python3-zmq; pip: pyzmq). The few protobuf messages of the protocol
are encoded and decoded by hand below, straight from docs/message-api.md, so this file is also
a worked example of the wire format for languages without a protobuf library. (With the
official runtime instead: `protoc --python_out=. proto/rlflow.proto` and use rlflow_pb2.)

Protocol, in short (docs/message-api.md is the reference): one ZeroMQ DEALER socket connected
to rlflow's endpoint; every message is one frame = 1 type byte + protobuf bytes; send Hello,
wait for HelloAck; then answer every RewardRequest with a RewardResponse carrying the same
request_id, echo every Heartbeat, and exit on Shutdown.
"""
import argparse
import os
import socket
import struct
import sys

try:
    import zmq
except ImportError:
    sys.stderr.write("length_judge: needs pyzmq (apt-get install python3-zmq, or pip install pyzmq)\n")
    sys.exit(2)

PROTOCOL_VERSION = 1
ROLE_REWARD_PROGRAM = 7

# Type tags (the first byte of every frame): the MsgType enum of proto/rlflow.proto.
HELLO, HELLO_ACK, HEARTBEAT, ERROR, SHUTDOWN = 1, 2, 3, 4, 5
REWARD_REQUEST, REWARD_RESPONSE = 16, 17

# ---- protobuf wire format, by hand (https://protobuf.dev/programming-guides/encoding/) --------

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def varint(n):
    n &= (1 << 64) - 1  # negative int32/int64 go out as 10-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf, i):
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def signed(n, bits=64):
    n &= (1 << 64) - 1
    n &= (1 << bits) - 1
    return n - (1 << bits) if n >> (bits - 1) else n


def field_varint(num, value):
    return varint(num << 3 | VARINT) + varint(value) if value else b""


def field_bytes(num, data):
    if isinstance(data, str):
        data = data.encode("utf-8")
    return varint(num << 3 | LEN) + varint(len(data)) + data if data else b""


def field_float(num, value):
    return varint(num << 3 | I32) + struct.pack("<f", value) if value != 0.0 else b""


def parse(buf):
    """Protobuf bytes -> {field number: [raw values]} (ints for varint/fixed, bytes for LEN)."""
    fields, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == VARINT:
            v, i = read_varint(buf, i)
        elif wt == I64:
            v, i = buf[i:i + 8], i + 8
        elif wt == I32:
            v, i = buf[i:i + 4], i + 4
        elif wt == LEN:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError("unsupported wire type %d" % wt)
        if i > len(buf):
            raise ValueError("truncated field %d" % num)
        fields.setdefault(num, []).append(v)
    return fields


def get_int(f, num, default=0):
    return f[num][-1] if num in f else default


def get_str(f, num):
    return f[num][-1].decode("utf-8", "replace") if num in f else ""


def get_int32s(f, num):
    """A repeated int32: packed (one LEN record of varints) or not (one varint each)."""
    out = []
    for v in f.get(num, []):
        if isinstance(v, int):
            out.append(signed(v, 32))
        else:
            i = 0
            while i < len(v):
                n, i = read_varint(v, i)
                out.append(signed(n, 32))
    return out


# ---- messages ----------------------------------------------------------------------------------

def hello(name, capacity, rank):
    return bytes([HELLO]) + (field_varint(1, PROTOCOL_VERSION) + field_varint(2, ROLE_REWARD_PROGRAM)
                             + field_varint(3, rank) + field_varint(4, os.getpid())
                             + field_bytes(5, name) + field_varint(6, capacity)
                             + field_bytes(8, socket.gethostname()))


def heartbeat(seq):
    return bytes([HEARTBEAT]) + field_varint(1, seq)


def reward_response(request_id, reward, components, info="", error=""):
    body = field_varint(1, request_id) + field_float(2, reward)
    for key, value in components.items():  # map<string, float>: repeated {1: key, 2: value}
        entry = field_bytes(1, key) + field_float(2, value)
        body += varint(3 << 3 | LEN) + varint(len(entry)) + entry
    return bytes([REWARD_RESPONSE]) + body + field_bytes(4, info) + field_bytes(5, error)


def reward_request(f):
    return {
        "request_id": get_int(f, 1),
        "prompt": get_str(f, 2),
        "response": get_str(f, 3),
        "prompt_ids": get_int32s(f, 4),
        "response_ids": get_int32s(f, 5),
        "ground_truth": get_str(f, 6),
        "metadata_json": get_str(f, 7),
        "sample_index": signed(get_int(f, 8)),
        "group_id": signed(get_int(f, 9)),
    }


# ---- the judge ---------------------------------------------------------------------------------

def score(req, target, unit):
    ids = req["response_ids"]
    n = len(ids) if unit == "tokens" and ids else len(req["response"])
    reward = 1.0 - abs(n - target) / target
    return reward, {"length": float(n)}, "len %d, target %d" % (n, target)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connect", default="tcp://127.0.0.1:5557", help="rlflow's reward endpoint")
    ap.add_argument("--target", type=int, default=64, help="target length (> 0)")
    ap.add_argument("--unit", choices=["tokens", "chars"], default="tokens")
    ap.add_argument("--name", default="length_judge")
    ap.add_argument("--capacity", type=int, default=8, help="requests accepted in flight")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for HelloAck")
    ap.add_argument("--idle-exit", type=float, default=0.0,
                    help="exit after this many seconds without any message (0: never)")
    a = ap.parse_args()
    if a.target <= 0:
        ap.error("--target must be > 0")

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(a.connect)
    sock.send(hello(a.name, a.capacity, a.rank))
    if not sock.poll(int(a.timeout * 1000)):
        sys.stderr.write("%s: rlflow at %s did not answer Hello within %.1f s\n" % (a.name, a.connect, a.timeout))
        return 3
    frame = sock.recv()
    f = parse(frame[1:])
    if frame[:1] != bytes([HELLO_ACK]) or not get_int(f, 1):
        reason = get_str(f, 2) if frame[:1] == bytes([HELLO_ACK]) else "unexpected reply to Hello"
        sys.stderr.write("%s: refused by rlflow at %s: %s\n" % (a.name, a.connect, reason))
        return 4
    sys.stderr.write("%s: connected to %s (protocol %d)\n" % (a.name, a.connect, get_int(f, 3)))

    scored = 0
    while True:
        if not sock.poll(int(a.idle_exit * 1000) if a.idle_exit > 0 else None):
            sys.stderr.write("%s: nothing from rlflow for %.1f s; exiting\n" % (a.name, a.idle_exit))
            return 3
        frame = sock.recv()
        tag, body = frame[0] if frame else 0, frame[1:]
        try:
            f = parse(body)
        except ValueError as e:
            sys.stderr.write("%s: malformed message (tag %d): %s\n" % (a.name, tag, e))
            continue
        if tag == HEARTBEAT:
            sock.send(heartbeat(get_int(f, 1)))
        elif tag == REWARD_REQUEST:
            req = reward_request(f)
            try:
                reward, comps, info = score(req, a.target, a.unit)
                sock.send(reward_response(req["request_id"], reward, comps, info))
            except Exception as e:  # report, never crash: rlflow names the request
                sock.send(reward_response(req["request_id"], 0.0, {}, error=str(e)))
            scored += 1
        elif tag == SHUTDOWN:
            sys.stderr.write("%s: shutdown (%s) after %d requests\n" % (a.name, get_str(f, 1), scored))
            return 0
        elif tag == ERROR:
            sys.stderr.write("%s: rlflow says: %s\n" % (a.name, get_str(f, 2)))


if __name__ == "__main__":
    sys.exit(main())
