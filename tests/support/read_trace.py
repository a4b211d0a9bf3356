#!/usr/bin/env python3
"""Checks a LOCKSTEP_TRACE file with Python's json module (the format Perfetto and
chrome://tracing read) and prints what it holds, one line per event, in time order:
<ph>\t<track name>\t<name>\t<ts>\t<dur>\t<detail>

Usage: read_trace.py <lockstep_trace.rank<R>.json>
"""
import json
import sys


def main():
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(procs) == 1, procs
    print(f"process\t{procs[0]}")
    timed = [e for e in events if e["ph"] in ("X", "i")]
    for e in sorted(timed, key=lambda e: e["ts"]):
        assert e["cat"] == "lockstep" and e.get("dur", 0) >= 0, e
        detail = e.get("args", {}).get("detail", "")
        print(f"{e['ph']}\t{tracks[e['tid']]}\t{e['name']}\t{e['ts']:.3f}\t{e.get('dur', 0):.3f}\t{detail}")


if __name__ == "__main__":
    main()
