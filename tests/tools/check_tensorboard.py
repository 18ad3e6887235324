#!/usr/bin/env python3
"""Checks that TensorBoard itself reads the event files rlflow writes (not run by ctest).

Usage:
    python3 -m venv /tmp/tbvenv && /tmp/tbvenv/bin/pip install tensorboard
    RF_KEEP_TMP=1 build/test_metrics          # prints "kept /tmp/rf_metrics_XXXXXX"
    /tmp/tbvenv/bin/python tests/tools/check_tensorboard.py /tmp/rf_metrics_XXXXXX/run1

For every run directory given it
  1. reads each events.out.tfevents.* file with TensorBoard's own TFRecord reader (which
     checks both masked CRCs) and parses every record with TensorBoard's event_pb2.Event,
     then checks that re-serializing the parsed Event gives back the very same bytes (our
     hand-written protobuf is canonical), and that the first record is "brain.Event:2";
  2. loads the directory with EventAccumulator, the loader TensorBoard's scalar dashboard
     uses, and prints every scalar tag with its (step, value) points;
  3. when metrics.jsonl is present, checks that every TensorBoard point equals the JSONL
     value of that step and name (last line of a step wins), to float precision;
  4. checks that each step of each scalar tag is written once across all the event files, read
     raw (no SessionLog purge): after `rlflow run --resume` the files hold each step once, for
     readers that do not purge too;
  5. when samples.jsonl is present, checks that the text summaries (tags samples/<i>, plugin
     "text", string tensors as TensorBoard's text dashboard reads them) are there for each
     logged step and that sample i's text holds that step's i-th prompt and response.
Exit status 0 when all of this holds.
"""
import glob
import json
import math
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2


def check_records(path):
    records = list(RawEventFileLoader(path).Load())
    if not records:
        raise SystemExit(f"{path}: no records")
    for i, raw in enumerate(records):
        ev = event_pb2.Event.FromString(raw)
        if ev.SerializeToString() != raw:
            raise SystemExit(f"{path}: record {i} is not canonical protobuf")
        if i == 0 and ev.file_version != "brain.Event:2":
            raise SystemExit(f"{path}: first record has file_version {ev.file_version!r}")
    return len(records)


def load_jsonl(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    by_step = {}
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            by_step[obj.pop("step")] = obj  # a repeated step (resume): the last line wins
            obj.pop("time")
    return by_step


def check_raw_steps(files):
    seen = set()
    for path in files:
        for raw in RawEventFileLoader(path).Load():
            ev = event_pb2.Event.FromString(raw)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    if (v.tag, ev.step) in seen:
                        raise SystemExit(f"{path}: {v.tag} step {ev.step} written twice")
                    seen.add((v.tag, ev.step))


def check_samples(run):
    path = os.path.join(run, "samples.jsonl")
    if not os.path.exists(path):
        return
    from tensorboard.util import tensor_util
    want = {}
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            want.setdefault(obj["step"], []).append(obj)
    acc = event_accumulator.EventAccumulator(run, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    tags = sorted(t for t in acc.Tags()["tensors"] if t.startswith("samples/"))
    if not tags:
        raise SystemExit(f"{run}: no samples/ text summaries")
    n = 0
    for tag in tags:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            raise SystemExit(f"{run}: {tag} is not a text summary")
        i = int(tag.split("/")[1])
        for ev in acc.Tensors(tag):
            text = tensor_util.make_ndarray(ev.tensor_proto).item().decode("utf-8")
            rows = want.get(ev.step)
            if rows is None or i >= len(rows):
                raise SystemExit(f"{run}: {tag} step {ev.step} is not in samples.jsonl")
            if rows[i]["prompt"] not in text or rows[i]["response"] not in text:
                raise SystemExit(f"{run}: {tag} step {ev.step}: the text does not hold sample {i}")
            n += 1
    if n != sum(len(v) for v in want.values()):
        raise SystemExit(f"{run}: {n} text summaries, samples.jsonl has {sum(len(v) for v in want.values())} lines")
    print(f"{run}: ok ({n} sample texts in {len(tags)} tags)")


def check_run(run):
    files = sorted(glob.glob(os.path.join(run, "events.out.tfevents.*")))
    if not files:
        raise SystemExit(f"{run}: no event files")
    for path in files:
        print(f"{os.path.basename(path)}: {check_records(path)} records, CRCs and protobuf ok")

    acc = event_accumulator.EventAccumulator(run, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if not tags:
        raise SystemExit(f"{run}: TensorBoard found no scalars")
    jsonl = load_jsonl(run)
    for tag in tags:
        points = acc.Scalars(tag)
        print(f"  {tag}: " + ", ".join(f"({p.step}, {p.value:.6g})" for p in points))
        if jsonl is None:
            continue
        for p in points:
            want = jsonl.get(p.step, {}).get(tag, "missing")
            if want == "missing":
                raise SystemExit(f"{run}: {tag} step {p.step} is not in metrics.jsonl")
            if want is None:  # JSON null stands for NaN / inf
                ok = not math.isfinite(p.value)
            else:
                ok = math.isclose(p.value, want, rel_tol=1e-6, abs_tol=1e-30)
            if not ok:
                raise SystemExit(f"{run}: {tag} step {p.step}: tensorboard {p.value}, jsonl {want}")
        if jsonl is not None and len(points) != sum(tag in v for v in jsonl.values()):
            raise SystemExit(f"{run}: {tag}: {len(points)} points, jsonl has a different count")
    check_raw_steps(files)
    print(f"{run}: ok ({len(tags)} scalar tags)")
    check_samples(run)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for run in sys.argv[1:]:
        check_run(run)


if __name__ == "__main__":
    main()
