"""Side by side in separate processes, stepped in turn.

Each setting runs in its own process (a *lane*), set up once as a user would
run it: kvsan installed for the whole life of the process or not at all.  A
coordinator tells one lane at a time to take one step, in a new random
order every turn, so all lanes see the same machine at the same moments,
only one runs at a time, and none always follows the same other lane.  Each lane times its own step (CPU time of its thread)
and reports it.

Why not one process switching kvsan on and off between steps: switching re-patches vLLM's classes
before every step, and a class modified just before it runs costs the step
about 5% more (CPython drops its attribute and method caches for the
class: measured with a lane that re-patched and restored without running a
single hook).  That cost is the benchmark's, not kvsan's.

Protocol: the coordinator writes ``step`` lines to the lane's stdin; the
lane answers each with one ``KVSAN_LANE {json}`` line on stdout (vLLM's own
logging may share stdout: other lines are skipped): the step's record (a
dict: its CPU time and whatever else the lane measures) or ``{"end":
{...}}`` when its work is done.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

PREFIX = "KVSAN_LANE "


# ------------------------------------------------------------- lane side
def serve(stepper) -> None:
    """Run in the lane process: ``stepper()`` takes one step and returns its
    record (a JSON-able dict), or None when done; ``stepper.summary()`` is
    sent last."""
    out = sys.stdout
    out.write(PREFIX + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip() != "step":
            continue
        got = stepper()
        if got is None:
            out.write(PREFIX + json.dumps({"end": stepper.summary()}) + "\n")
            out.flush()
            return
        out.write(PREFIX + json.dumps({"step": got}) + "\n")
        out.flush()


# -------------------------------------------------------- coordinator side
class LaneProcess:
    def __init__(self, name: str, code: str, env_extra: dict):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
        # one compute thread each: the lanes take turns, none spins meanwhile
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
        env.update(env_extra)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.name = name
        self.err_path = f"/tmp/kvsan-lane-{os.getpid()}-{name.replace(' ', '_')}.log"
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, bufsize=1)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        self._err.flush()
        with open(self.err_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"lane {self.name} exited (rc={self.proc.wait()}):\n{tail}")

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._err.close()
        try:
            os.unlink(self.err_path)
        except OSError:
            pass


def run(lanes: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """Start one process per lane (name -> (python code, extra env)), step
    them in turn until each is done.  Returns name -> {"steps": [each
    step's record], "summary": ...}."""
    procs = {n: LaneProcess(n, code, env) for n, (code, env) in lanes.items()}
    res = {n: {"steps": [], "summary": None} for n in lanes}
    try:
        for p in procs.values():  # boots run concurrently; wait for all
            if not p.read().get("ready"):
                raise RuntimeError(f"lane {p.name} did not start")
        live = list(procs.values())
        k = 0
        t0 = time.time()
        order = random.Random(0)
        while live:
            k += 1
            # a new order every turn: with a rotation each lane would mostly
            # follow the same other lane, whose memory traffic (the
            # strictest setting's, say) then biases its step
            for p in order.sample(live, len(live)):
                got = p.step()
                if "end" in got:
                    res[p.name]["summary"] = got["end"]
                    live.remove(p)
                else:
                    res[p.name]["steps"].append(got["step"])
        print(f"[lanes] {len(procs)} lanes, {k} turns in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
    finally:
        for p in procs.values():
            p.close()
    return res
