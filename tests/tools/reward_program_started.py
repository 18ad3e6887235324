#!/usr/bin/env python3
"""A reward program for tests/test_programs.c, started by rlflow (reward.programs): it takes no
endpoint nor keys (the client library reads RLFLOW_REWARD_ENDPOINT and the CURVE keys from the
environment rlflow sets) and scores each response by its token ids alone:

    reward = ((sum of response_ids) % 17) / 16 - 0.5      (exact in float32)

It appends one line per answered request to --log: "pid request_id group_id sample_index reward
rank", written before the answer is sent. --exit-after N: on receiving request N + 1 (counted
in this process), it waits 0.5 s (so the answers already computed leave), prints a line and
exits with status 5 without answering: rlflow must restart it and send that request again.

Usage: reward_program_started.py --log FILE [--exit-after N]
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "reward", "clients", "python"))
import rlflow_reward  # noqa: E402


def main():
    log, exit_after = None, -1
    args = sys.argv[1:]
    while args:
        k = args.pop(0)
        if k == "--log":
            log = args.pop(0)
        elif k == "--exit-after":
            exit_after = int(args.pop(0))
        else:
            sys.stderr.write("reward_program_started: unknown option %s\n" % k)
            return 2
    seen = [0]
    out = open(log, "a")

    def score(req):
        seen[0] += 1
        if exit_after >= 0 and seen[0] > exit_after:
            time.sleep(0.5)
            sys.stdout.write("reward_program_started: exiting after %d requests\n" % exit_after)
            sys.stdout.flush()
            os._exit(5)
        r = (sum(req.response_ids) % 17) / 16.0 - 0.5
        out.write("%d %d %d %d %.9g %s\n" % (os.getpid(), req.request_id, req.group_id, req.sample_index, r,
                                           os.environ.get("RLFLOW_REWARD_RANK", "?")))
        out.flush()
        return r

    rlflow_reward.serve(score, name="started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
