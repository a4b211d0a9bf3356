#!/usr/bin/env python3
"""lockstep-run's questions, answered through a pseudo-terminal (as a person would): a wrong
answer is asked again, the answers decide the launch and LOCKSTEP_LR_SCALING, the equivalent
command is printed before the run, the end of input stops it, and nothing is asked when stdin
is not a terminal.

Usage: interactive.py <lockstep-run> <child program>
"""
import os
import pty
import re
import select
import subprocess
import sys
import time

LAUNCHER, CHILD = sys.argv[1:3]


class Session:
    def __init__(self, args, env=None):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.text = ""

    def expect(self, pattern, timeout=20):
        """Reads until `pattern` (a regular expression) appears after what was matched before."""
        rx = re.compile(pattern)
        deadline = time.time() + timeout
        while True:
            m = rx.search(self.text)
            if m:
                self.text = self.text[m.end():]
                return m
            left = deadline - time.time()
            if left <= 0:
                raise AssertionError(f"waited {timeout} s for {pattern!r}; the terminal shows:\n{self.text}")
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    chunk = os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the other side closed: the program ended
                    chunk = ""
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"ended before {pattern!r}; the terminal shows:\n{self.text}")
                self.text += chunk

    def send(self, line):
        os.write(self.master, (line + "\n").encode())

    def rest(self, timeout=30):
        """Everything until the program ends, and its exit status."""
        deadline = time.time() + timeout
        while self.proc.poll() is None or select.select([self.master], [], [], 0)[0]:
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError(f"did not end within {timeout} s:\n{self.text}")
            r, _, _ = select.select([self.master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(self.master, 4096).decode(errors="replace")
                except OSError:
                    break
                if not chunk:
                    break
                self.text += chunk
        return self.proc.wait(), self.text


def env_with(**kv):
    e = dict(os.environ)
    e.pop("LOCKSTEP_NO_PROMPT", None)
    e.update(kv)
    return e


def count_question(s):
    """Answers the count question with 2 (GPUs or CPU ranks, whichever this machine has)."""
    m = s.expect(r"How many (?:of the (\d+) GPUs|CPU ranks) \(1-(\d+)\)\? \[(\d+)\]: ")
    most = int(m.group(2))
    assert m.group(3) == str(most), m.group(0)
    return most


# 1. Processes: a wrong mode, an impossible count, linear scaling.
s = Session([LAUNCHER, CHILD, "env"], env_with())
s.expect(r"Run as \[a\]uto .*\[p\]rocesses \(one per rank\)\? \[a\]: ")
s.send("x")
s.expect(r"please answer a, t or p")
s.expect(r"Run as \[a\]uto")
s.send("p")
most = count_question(s)
s.send(str(most + 1))
s.expect(rf"please answer a whole number from 1 to {most}")
m = s.expect(r"How many [^\n]*\[\d+\]: ")
n = min(2, most)
s.send(str(n))
s.expect(r"\[n\]o, \[l\]inear or \[s\]quare root\? \[n\]: ")
s.send("l")
m = s.expect(r"the same without questions:\r?\n  ([^\r\n]*)\r?\n")
cmd = m.group(1)
assert cmd.startswith(f"LOCKSTEP_LR_SCALING=linear lockstep-run --nproc {n} "), cmd
assert cmd.endswith(f"{CHILD} env"), cmd
rc, out = s.rest()
assert rc == 0, (rc, out)
ranks = sorted(set(re.findall(r"\[(\d+)\] LOCKSTEP_LR_SCALING=linear", out)))
assert ranks == [str(r) for r in range(n)], out
print(f"processes: ok ({cmd})")

# 2. Threads: the program runs once, with the count in LOCKSTEP_CPU_RANKS / LOCKSTEP_DEVICES.
s = Session([LAUNCHER, CHILD, "env", "out=argument with spaces"], env_with())
s.expect(r"Run as \[a\]uto")
s.send("t")
count_question(s)
s.send("1")
s.expect(r"quare root\? \[n\]: ")
s.send("s")
cmd = s.expect(r"the same without questions:\r?\n  ([^\r\n]*)\r?\n").group(1)
assert cmd.startswith("LOCKSTEP_LR_SCALING=sqrt LOCKSTEP_"), cmd
assert cmd.endswith("env 'out=argument with spaces'"), cmd
rc, out = s.rest()
assert rc == 0, (rc, out)
assert "LOCKSTEP_LR_SCALING=sqrt" in out and "RANK=<unset>" in out, out
assert re.search(r"LOCKSTEP_(CPU_RANKS=1|DEVICES=0)\r?\n", out), out
assert "argument with spaces" in out, out
print(f"threads: ok ({cmd})")

# 3. The end of input at a question: nothing runs, exit 2.
s = Session([LAUNCHER, CHILD, "out=SHOULD-NOT-RUN"], env_with())
s.expect(r"Run as \[a\]uto")
os.write(s.master, b"\x04")  # ^D: end of input on the terminal
rc, out = s.rest()
assert rc == 2 and "no answer" in out and "SHOULD-NOT-RUN" not in out, (rc, out)
print("end of input: ok")

# 4. stdin not a terminal, or LOCKSTEP_NO_PROMPT=1: no question.
p = subprocess.run([LAUNCHER, "--cpu", "--nproc", "1", CHILD, "out=hello"], stdin=subprocess.DEVNULL,
                   capture_output=True, text=True, timeout=30, env=env_with())
assert p.returncode == 0 and "Run as" not in p.stdout + p.stderr and "[0] hello" in p.stdout, p
p = subprocess.run([LAUNCHER, CHILD, "out=hello"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                   timeout=30, env=env_with())
assert "Run as" not in p.stdout + p.stderr, p
s = Session([LAUNCHER, "--cpu", "--nproc", "1", CHILD, "out=hi"], env_with())  # options given: no question
rc, out = s.rest()
assert rc == 0 and "Run as" not in out and "[0] hi" in out, (rc, out)
s = Session([LAUNCHER, CHILD, "out=hi"], env_with(LOCKSTEP_NO_PROMPT="1"))
rc, out = s.rest()
assert "Run as" not in out, (rc, out)
print("no questions without a terminal, with options or LOCKSTEP_NO_PROMPT: ok")
