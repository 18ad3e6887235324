#!/usr/bin/env python3
"""Test driver for the Python reward client (reward/clients/python/rlflow_reward.py), run by
tests/test_external_reward_py.c:

  --check-schema PROTO   the module's descriptor (SCHEMA) against proto/rlflow.proto: every
                         field of the seven reward-program messages, by name, number, type and
                         label; exit 1 listing the differences
  --encode-examples      the worked examples of docs/reward-api.md, encoded by the module, as
                         "Name hex" lines (the C test compares them with rlflow's encoder)
  --serve --connect EP   serve with an echo score function that returns everything it received
                         (the C test checks it field by field), with per-token rewards
                         response_ids[j] * 0.5 + 0.25 j, as a dict for even request ids and as a
                         4-tuple for odd ones; ground truth "fail" raises, "nan" returns NaN,
                         "badtok" one per-token reward too many, "inftok" an infinite last one,
                         "str" the reward "0.5" (a string), "bool" the reward True, "strtok" a
                         per-token reward "1", "compnan" a NaN component, "longname" a component
                         name of 64 bytes, "huge" a 65 MiB info, "slow" sleeps 2 s; --name, --capacity, --threads, --protocol,
                         --server-key FILE, --key FILE, --quiet
Exit codes of --serve: those of the module's errors (0 Shutdown, 3 no answer, 4 refused).
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "reward", "clients", "python"))
import rlflow_reward as rr  # noqa: E402

PROTO_TYPES = {"uint32": "UINT32", "uint64": "UINT64", "int32": "INT32", "int64": "INT64",
               "string": "STRING", "bool": "BOOL", "float": "FLOAT", "Role": "Role",
               "map<string, float>": "map<string,float>"}


def check_schema(path):
    text = re.sub(r"//[^\n]*", "", open(path).read())
    proto = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{([^}]*)\}", text):
        fields = []
        for m in re.finditer(r"(repeated\s+)?(map<\s*\w+\s*,\s*\w+\s*>|\w+)\s+(\w+)\s*=\s*(\d+)\s*;", body):
            ftype = re.sub(r"\s*,\s*", ", ", m.group(2))
            fields.append((m.group(3), int(m.group(4)), PROTO_TYPES.get(ftype, ftype),
                           bool(m.group(1))))
        proto[name] = fields
    problems = []
    for name, fields in rr.SCHEMA:
        if name not in proto:
            problems.append("message %s is not in %s" % (name, path))
        elif sorted(fields) != sorted(proto[name]):
            problems.append("%s: module %s, proto %s" % (name, sorted(fields), sorted(proto[name])))
    roles = re.search(r"enum\s+Role\s*\{([^}]*)\}", text)
    proto_roles = [n for n, _ in re.findall(r"(\w+)\s*=\s*(\d+)\s*;", roles.group(1))] if roles else []
    if proto_roles != rr.ROLES:
        problems.append("enum Role: module %s, proto %s" % (rr.ROLES, proto_roles))
    for p in problems:
        print(p)
    if not problems:
        print("%d messages and enum Role match %s" % (len(rr.SCHEMA), path))
    return 1 if problems else 0


def encode_examples():
    """The messages of docs/reward-api.md, section "Worked example"."""
    hello = rr.Hello(protocol_version=1, role=7, pid=4242, name="length_judge", capacity=8)
    req = rr.RewardRequest(request_id=17, prompt="2+2=", response="4", prompt_ids=[17, 10, 17, 28],
                           response_ids=[19], ground_truth="4", metadata_json='{"level": 1}',
                           sample_index=1, group_id=3)
    resp = rr.RewardResponse(request_id=17, reward=0.75, info="ok")
    resp.components["correct"] = 1.0
    resp.components["length"] = 1.0
    tokens = rr.RewardResponse(request_id=19, reward=1.5, token_rewards=[0.5, -0.25, 0.0])
    for name, tag, m in (("Hello", rr.HELLO, hello), ("RewardRequest", rr.REWARD_REQUEST, req),
                         ("RewardResponse", rr.REWARD_RESPONSE, resp),
                         ("RewardResponse token_rewards", rr.REWARD_RESPONSE, tokens),
                         ("Heartbeat", rr.HEARTBEAT, rr.Heartbeat(seq=5))):
        frame = bytes([tag]) + m.SerializeToString(deterministic=True)
        print(name, frame.hex())
    return 0


def echo(req):
    if req.ground_truth == "slow":
        time.sleep(2.0)
    if req.ground_truth == "fail":
        raise ValueError("cannot judge " + req.response)
    if req.ground_truth == "nan":
        return float("nan")
    bad = {"str": "0.5", "bool": True, "strtok": 0.5, "compnan": 0.5, "longname": 0.5, "huge": 0.5}
    if req.ground_truth in bad:
        comps = {"compnan": {"x": float("nan")}, "longname": {"n" * 64: 1.0}}.get(req.ground_truth)
        tokens = ["1"] * len(req.response_ids) if req.ground_truth == "strtok" else None
        info = "x" * (65 << 20) if req.ground_truth == "huge" else ""
        return bad[req.ground_truth], comps, info, tokens
    reward = len(req.response_ids) * 0.5 + req.sample_index + 0.25
    comps = {"n_resp": len(req.response_ids), "sum_resp": sum(req.response_ids),
             "sum_prompt": sum(req.prompt_ids)}
    info = "id=%d p=%s r=%s g=%s m=%s s=%d grp=%d k=%s" % (
        req.request_id, req.prompt, req.response, req.ground_truth, req.metadata_json,
        req.sample_index, req.group_id, req.metadata.get("k"))
    tokens = [v * 0.5 + 0.25 * j for j, v in enumerate(req.response_ids)]
    if req.ground_truth == "badtok":
        tokens.append(0.0)
    if req.ground_truth == "inftok" and tokens:
        tokens[-1] = float("inf")
    if req.request_id % 2 == 0:
        return {"reward": reward, "components": comps, "info": info, "token_rewards": tokens}
    return reward, comps, info, tokens


def serve(a):
    server_key = rr.load_key(a.server_key) if a.server_key else None
    secret = rr.load_key(a.key) if a.key else None
    try:
        n = rr.serve(echo, connect=a.connect, name=a.name, capacity=a.capacity, threads=a.threads,
                     hello_timeout=a.timeout, curve_server_key=server_key, curve_secret_key=secret,
                     protocol_version=a.protocol, quiet=a.quiet)
    except rr.RewardClientError as e:
        sys.stderr.write("%s: %s\n" % (a.name, e))
        return e.exit_code
    sys.stderr.write("%s: served %d requests\n" % (a.name, n))
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-schema")
    ap.add_argument("--encode-examples", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--connect")
    ap.add_argument("--name", default="pyecho")
    ap.add_argument("--capacity", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--protocol", type=int, default=rr.PROTOCOL_VERSION)
    ap.add_argument("--server-key")
    ap.add_argument("--key")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    if a.check_schema:
        return check_schema(a.check_schema)
    if a.encode_examples:
        return encode_examples()
    if a.serve:
        return serve(a)
    ap.error("one of --check-schema, --encode-examples, --serve")


if __name__ == "__main__":
    sys.exit(main())
