#!/usr/bin/env python3
"""A reward program for rlflow: rewards responses whose length is close to a target.

    reward = 1 - |len - target| / target        (unclipped: 1 at the target, 0 at 0 or 2x)

len is the response's token count (RewardRequest.response_ids), or its length in characters
when the request carries no token ids (or with --unit chars). Component "length" = len, info
"len <len>, target <target>".

    python3 examples/reward/length_judge.py --connect tcp://127.0.0.1:5557 --target 64
    python3 examples/reward/length_judge.py --connect tcp://10.0.0.1:5557 \\
        --server-key rlflow.pub --key judge.key          # CURVE (docs/reward-api.md)

It is built on the client module reward/clients/python/rlflow_reward.py, found relative to
this file (no install step), which needs Debian's python3-zmq and python3-protobuf (pip: pyzmq,
protobuf). examples/reward/length_judge.c is the same program in C.

Exit codes: 0 after rlflow's Shutdown, 2 missing modules or bad options, 3 no answer / idle /
connection lost, 4 refused by rlflow (protocol version, CURVE key).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "reward", "clients", "python"))
try:
    import rlflow_reward
except ImportError as e:
    sys.stderr.write("length_judge: %s (needs python3-zmq and python3-protobuf: apt-get install "
                     "python3-zmq python3-protobuf, or pip install pyzmq protobuf)\n" % e)
    sys.exit(2)


def make_score(target, unit):
    def score(req):
        n = len(req.response_ids) if unit == "tokens" and req.response_ids else len(req.response)
        return 1.0 - abs(n - target) / target, {"length": n}, "len %d, target %d" % (n, target)
    return score


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connect", default=None,
                    help="rlflow's reward endpoint (default: $RLFLOW_REWARD_ENDPOINT, set by rlflow for "
                         "reward.programs, else tcp://127.0.0.1:5557)")
    ap.add_argument("--target", type=int, default=64, help="target length (> 0)")
    ap.add_argument("--unit", choices=["tokens", "chars"], default="tokens")
    ap.add_argument("--name", default="length_judge")
    ap.add_argument("--capacity", type=int, default=8, help="requests accepted in flight")
    ap.add_argument("--threads", type=int, default=1, help="scoring threads")
    ap.add_argument("--rank", type=int, default=None, help="default: $RLFLOW_REWARD_RANK, else 0")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for rlflow's HelloAck (also after a reconnection)")
    ap.add_argument("--idle-exit", type=float, default=0.0,
                    help="exit after this many seconds without any message (0: never)")
    ap.add_argument("--server-key", help="rlflow's CURVE public key file (PREFIX.pub of rlflow keygen)")
    ap.add_argument("--key", help="this program's CURVE secret key file (PREFIX.key)")
    a = ap.parse_args()
    if a.target <= 0:
        ap.error("--target must be > 0")
    if bool(a.server_key) != bool(a.key):
        ap.error("--server-key and --key go together")
    try:
        server_key = rlflow_reward.load_key(a.server_key) if a.server_key else None
        secret = rlflow_reward.load_key(a.key) if a.key else None
        rlflow_reward.serve(make_score(a.target, a.unit), connect=a.connect, name=a.name,
                            capacity=a.capacity, threads=a.threads, rank=a.rank,
                            hello_timeout=a.timeout, idle_exit=a.idle_exit,
                            curve_server_key=server_key, curve_secret_key=secret)
    except (OSError, ValueError) as e:
        sys.stderr.write("%s: %s\n" % (a.name, e))
        return 2
    except rlflow_reward.RewardClientError as e:
        sys.stderr.write("%s: %s\n" % (a.name, e))
        return e.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
