#!/usr/bin/env python3
"""Reads back what lockstep::ScalarLog wrote, with the readers people use: TensorBoard's own
EventAccumulator for the event file, Python's csv and json modules for the others.

Usage: read_scalars.py <tensorboard dir> <csv file> <jsonl file>
Prints one line per value: <source>\t<tag>\t<step>\t<value> (source: tb, csv or json; the value
as Python's repr, "null" for a JSON null).
"""
import csv
import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    logdir, csv_path, jsonl_path = sys.argv[1:4]
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = []
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.append(f"tb\t{tag}\t{e.step}\t{e.value!r}")
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["wall_time", "step", "tag", "value"], rows[0]
    for wall, step, tag, value in rows[1:]:
        float(wall)
        out.append(f"csv\t{tag}\t{int(step)}\t{float(value)!r}")
    with open(jsonl_path) as f:
        for line in f:
            o = json.loads(line)
            v = "null" if o["value"] is None else repr(float(o["value"]))
            out.append(f"json\t{o['tag']}\t{o['step']}\t{v}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
