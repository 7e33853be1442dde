"""Serving throughput while ``GET /kvsan/owners`` is polled, side by side
with no polling (docs/reliability.md).

    .venv/bin/python -m benchmarks.owners_poll                 # starts a server
    .venv/bin/python -m benchmarks.owners_poll --url URL [--api-key KEY]

A dashboard or an operator's script may poll the owners endpoint many
times a second; each poll must not make the engine pay a snapshot.  This
runs the same completion load (``--requests`` streaming completions,
``--concurrency`` at a time, ``--max-tokens`` each) in many short rounds,
alternately without polling and with ``--rate`` polls per second (ABBA:
each pair swaps which goes first, so drift favours neither side), and
prints each side's median throughput with its interquartile range and the
ratio of the medians.  Without ``--url`` it starts ``vllm serve`` on the
generated tiny model with kvsan on (``KVSAN=1``, ``VLLM_PLUGINS=kvsan``, an
API key) and stops it after.

Pinning (``--pin ENGINE/FRONT``, default ``0/1``; ``none`` to leave the
kernel to place them).  On a small host the load generator, the polling
client and the server share the cores, and where the kernel puts them
decides the figure more than anything measured: vLLM's CPU backend binds
the worker's OpenMP threads to one core (``VLLM_CPU_OMP_THREADS_BIND``
``auto``: core 0, the other "reserved") and leaves EngineCore and the API
server to float, and both engine processes busy-wait (``sched_yield``) on
their shared-memory queues for a second after each read.  A busy-waiter
sharing a core with a process it is not waiting for takes the core from
it, so each placement has its own throughput and the kernel keeps one for
seconds at a time: unpinned rounds of the same load vary up to 4x, in
clusters (benchmarks/results.md).  Pinned, the engine -- EngineCore and
its worker process, all their threads, with ``VLLM_CPU_OMP_THREADS_BIND``
set to the same cores -- runs on ENGINE, where each one's busy-wait yields
to the one process it waits for, and the API server (where the endpoint's
handler runs), the load generator and the polling client (this process) on
FRONT: what is measured is the engine's serving throughput and what
polling costs it, not the client's CPU competing with the engine, and
every round has the same placement.  A started server is pinned after it
answers ``/health`` (threads started later inherit their creator's cores);
with ``--url`` only this process is pinned.

Each side's median and interquartile range are printed, with the ratio
of the medians and the ratio within each back-to-back pair.  Each round
also reads CPU times from ``/proc/<pid>/stat``: the API server's per 1000
tokens, polled against not, is what polling costs the front end; the
engine's (EngineCore and worker) follows its wall time per token, since
its busy-waits keep its core busy through a round -- a check that it held
its core, not a separate measure of cost.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from statistics import quantiles

API_KEY = "kvsan-bench-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` on the tiny model with kvsan and its endpoint plugin."""

    def __init__(self, workdir: str, api_key: str | None = API_KEY, env: dict | None = None,
                 pin: tuple[set[int], set[int]] | None = None):
        from kvsan.harness.tinymodel import ensure_tiny_model

        self.model = ensure_tiny_model()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = os.path.join(workdir, "serve.log")
        self.report = os.path.join(workdir, "report") + os.sep
        full = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
        full.update(KVSAN="1", KVSAN_REPORT=self.report, VLLM_PLUGINS="kvsan",
                    **(env or {}))
        if pin is not None:  # the worker's OpenMP threads on the engine's cores
            full["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(pin[0])))
        vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
        cmd = [vllm, "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32",
               "--num-gpu-blocks-override", "96", "--max-model-len", "512",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
               "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
               "--gpu-memory-utilization", "0.3",
               "--disable-uvicorn-access-log", "--disable-log-stats"]
        if api_key:
            cmd += ["--api-key", api_key]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=workdir)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not up after 600 s:\n{self.log_tail()}")
                time.sleep(1)
        self.engine_pids: list[int] = []
        self.front_pids: list[int] = [self.proc.pid]
        if pin is not None:
            self.engine_pids, self.front_pids = pin_server(self.proc.pid, *pin)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


#: the process names (``/proc/<pid>/comm``, 15 characters) of vLLM's engine
#: processes: EngineCore and its worker
ENGINE_COMMS = ("VLLM::EngineCor", "VLLM::Worker")


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (``sched_setaffinity`` is per
    thread; threads started later inherit their creator's)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


def pin_server(pid: int, engine: set[int], front: set[int]) -> tuple[list[int], list[int]]:
    """The engine processes of the server ``pid`` onto ``engine``, the rest
    (the API server, its helpers) onto ``front``; returns both pid lists."""
    engine_pids, front_pids = [], []
    for p in _descendants(pid):
        (engine_pids if _comm(p).startswith(ENGINE_COMMS) else front_pids).append(p)
    if not engine_pids:
        raise RuntimeError(f"no EngineCore/worker process under pid {pid}")
    for p in engine_pids:
        pin_process(p, engine)
    for p in front_pids:
        pin_process(p, front)
    return engine_pids, front_pids


def parse_pin(text: str) -> tuple[set[int], set[int]] | None:
    """``ENGINE/FRONT`` core lists (``0/1``, ``0-3/4,5``), or ``none``."""
    if text == "none":
        return None

    def cores(part: str) -> set[int]:
        out: set[int] = set()
        for item in part.split(","):
            lo, _, hi = item.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out

    engine, sep, front = text.partition("/")
    if not sep:
        raise ValueError(f"--pin {text!r}: ENGINE/FRONT core lists, or none")
    return cores(engine), cores(front)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of ``pids`` (their ended threads included)."""
    ticks = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def get(url: str, path: str, api_key: str | None = None, timeout: float = 30):
    """``(status, parsed JSON body)`` of ``GET url+path``."""
    req = urllib.request.Request(url + path, headers=(
        {"Authorization": f"Bearer {api_key}"} if api_key else {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null")


def model_of(url: str, api_key: str | None) -> str:
    status, doc = get(url, "/v1/models", api_key)
    assert status == 200, (status, doc)
    return doc["data"][0]["id"]


def complete(url: str, model: str, api_key: str | None, prompt: list[int],
             max_tokens: int) -> int:
    """One streaming completion (token ids in, ``ignore_eos``); returns the
    number of chunks received."""
    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion: HTTP {resp.status}: {resp.read()[:300]!r}")
        chunks = 0
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks += 1
        return chunks
    finally:
        conn.close()


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts over four shared 64-token prefixes (prefix hits)."""
    out = []
    for i in range(n):
        prefix = [(37 * (i % 4) + 11 * j) % 400 + 5 for j in range(64)]
        out.append(prefix + [(i * 7 + j) % 400 + 5 for j in range(16)])
    return out


def run_load(url: str, model: str, api_key: str | None, n: int, concurrency: int,
             max_tokens: int) -> tuple[int, float]:
    """``(tokens, seconds)`` of ``n`` completions, ``concurrency`` at a time."""
    work = prompts(n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        tokens = sum(pool.map(lambda p: complete(url, model, api_key, p, max_tokens), work))
    return tokens, time.perf_counter() - t0


def load(url: str, model: str, api_key: str | None, n: int, concurrency: int,
         max_tokens: int) -> float:
    """Tokens per second over ``n`` completions, ``concurrency`` at a time."""
    tokens, secs = run_load(url, model, api_key, n, concurrency, max_tokens)
    return tokens / secs


class Poller:
    """``rate`` GETs of ``/kvsan/owners`` per second until stopped, from
    ``clients`` threads (each ``rate / clients`` a second, staggered: a slow
    answer does not lower the rate); counts answers and the distinct engine
    snapshots they carried."""

    def __init__(self, url: str, api_key: str | None, rate: float, clients: int = 4):
        self.url, self.api_key, self.rate = url, api_key, rate
        self.answers = 0
        self.snapshots: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, clients), daemon=True)
                         for i in range(clients)]

    def _run(self, i: int, clients: int):
        # as a dashboard's scraper polls: one kept-alive connection per
        # client, the body read whole, only the snapshot's time picked out
        # (this host's CPU is the server's too: the client must stay light)
        import re

        host, port = self.url.split("//", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        stamp = re.compile(rb'"time":([0-9.e+-]+)')
        period = clients / self.rate
        nxt = time.monotonic() + i * period / clients
        self._stop.wait(max(0.0, nxt - time.monotonic()))
        try:
            while not self._stop.is_set():
                conn.request("GET", "/kvsan/owners", headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                if resp.status == 200:
                    with self._lock:
                        self.answers += 1
                        self.snapshots.add(tuple(stamp.findall(body)))
                nxt += period
                self._stop.wait(max(0.0, nxt - time.monotonic()))
        finally:
            conn.close()

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(30)


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def one_round(url: str, model: str, api_key: str | None, requests: int, concurrency: int,
              max_tokens: int, rate: float | None, engine_pids: list[int],
              front_pids: list[int]) -> dict:
    """One round of the load, polled at ``rate`` (None: not polled): its
    throughput, the engine's and the front end's CPU seconds, the polls."""
    load0 = os.getloadavg()[0]
    e0, f0 = cpu_seconds(engine_pids), cpu_seconds(front_pids)
    if rate:
        with Poller(url, api_key, rate) as p:
            tokens, secs = run_load(url, model, api_key, requests, concurrency, max_tokens)
        answers, snaps = p.answers, len(p.snapshots)
    else:
        tokens, secs = run_load(url, model, api_key, requests, concurrency, max_tokens)
        answers = snaps = 0
    e1, f1 = cpu_seconds(engine_pids), cpu_seconds(front_pids)
    return {"polled": bool(rate), "tok_s": tokens / secs, "tokens": tokens, "seconds": secs,
            "engine_cpu_s": e1 - e0, "front_cpu_s": f1 - f0, "answers": answers,
            "snapshots": snaps, "load": (load0 + os.getloadavg()[0]) / 2}


def _side(rounds: list[dict], engine: bool) -> dict:
    out = {"tok_s": quartiles([r["tok_s"] for r in rounds])}
    if engine:
        out["engine_ms_per_ktok"] = quartiles([1e6 * r["engine_cpu_s"] / r["tokens"]
                                               for r in rounds])
        out["front_ms_per_ktok"] = quartiles([1e6 * r["front_cpu_s"] / r["tokens"]
                                              for r in rounds])
    return out


def measure(url: str, api_key: str | None, requests: int, concurrency: int,
            max_tokens: int, rate: float, rounds: int, out=sys.stdout,
            engine_pids: list[int] | None = None, front_pids: list[int] | None = None) -> dict:
    """``rounds`` pairs of rounds, one not polled and one polled at
    ``rate``, the pair's order swapped each time (ABBA...)."""
    engine_pids, front_pids = engine_pids or [], front_pids or []
    model = model_of(url, api_key)
    for warm in (None, rate):  # both paths warm before anything counts
        one_round(url, model, api_key, min(requests, 16), concurrency, max_tokens, warm, [], [])
    done: list[dict] = []
    for r in range(rounds):
        for polling in ((False, True) if r % 2 == 0 else (True, False)):
            res = one_round(url, model, api_key, requests, concurrency, max_tokens,
                            rate if polling else None, engine_pids, front_pids)
            res["round"] = r
            done.append(res)
            eng = (f", engine {1e6 * res['engine_cpu_s'] / res['tokens']:.0f} ms CPU per 1000 "
                   "tokens" if engine_pids else "")
            what = f"polled at {rate:g}/s" if polling else "no polling"
            extra = (f" ({res['answers']} answers in {res['seconds']:.1f} s, "
                     f"{res['snapshots']} engine snapshots)" if polling else "")
            print(f"  round {r}: {what}: {res['tok_s']:.1f} tok/s{eng}{extra} "
                  f"[load {res['load']:.1f}]", file=out, flush=True)
    plain = [d for d in done if not d["polled"]]
    polled = [d for d in done if d["polled"]]
    a, b = _side(plain, bool(engine_pids)), _side(polled, bool(engine_pids))
    res = {"rate": rate, "rounds": rounds, "requests": requests, "concurrency": concurrency,
           "max_tokens": max_tokens, "plain": a, "polled": b,
           "plain_tok_s": a["tok_s"][1], "polled_tok_s": b["tok_s"][1],
           "ratio": b["tok_s"][1] / a["tok_s"][1],
           "polls": sum(d["answers"] for d in polled),
           "snapshots": sum(d["snapshots"] for d in polled),
           "load": [min(d["load"] for d in done), max(d["load"] for d in done)],
           "per_round": done}
    # each pair's two rounds ran back to back: their ratio cancels the drift
    # between pairs that the two sides' medians still carry
    pair = {}
    for d in done:
        pair.setdefault(d["round"], {})[d["polled"]] = d["tok_s"]
    res["pair_ratio"] = quartiles([p[True] / p[False] for p in pair.values()])

    def iqr(q, digits=1):
        return f"{q[1]:.{digits}f} (IQR {q[0]:.{digits}f}-{q[2]:.{digits}f})"

    print(f"owners polling at {rate:g}/s, {rounds} rounds each (median, interquartile "
          f"range): {iqr(b['tok_s'])} tok/s polled against {iqr(a['tok_s'])} without: "
          f"ratio of medians {res['ratio']:.3f}; {res['polls']} answers from "
          f"{res['snapshots']} engine snapshots; host load {res['load'][0]:.1f}-"
          f"{res['load'][1]:.1f}", file=out)
    print(f"per pair (polled / not polled, back to back): ratio {iqr(res['pair_ratio'], 3)}",
          file=out)
    if engine_pids:
        res["engine_ratio"] = b["engine_ms_per_ktok"][1] / a["engine_ms_per_ktok"][1]
        res["front_ratio"] = b["front_ms_per_ktok"][1] / a["front_ms_per_ktok"][1]
        # the API server's CPU beyond what the same tokens cost it unpolled,
        # per answer: what one poll costs the front end
        extra_ms = (b["front_ms_per_ktok"][1] - a["front_ms_per_ktok"][1]) * sum(
            d["tokens"] for d in polled) / 1000
        res["front_ms_per_poll"] = extra_ms / max(1, res["polls"])
        print(f"engine CPU per 1000 tokens: {iqr(b['engine_ms_per_ktok'])} ms polled against "
              f"{iqr(a['engine_ms_per_ktok'])} ms without: ratio {res['engine_ratio']:.3f}; "
              f"API server: {b['front_ms_per_ktok'][1]:.0f} ms against "
              f"{a['front_ms_per_ktok'][1]:.0f} ms: ratio {res['front_ratio']:.3f}, about "
              f"{res['front_ms_per_poll']:.2f} ms per poll", file=out)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.owners_poll",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start vllm serve on the "
                                  "tiny model)")
    ap.add_argument("--api-key", default=None,
                    help="the server's --api-key (default: none; the started server's own)")
    ap.add_argument("--requests", type=int, default=128, help="completions per round "
                                                              "(default 128)")
    ap.add_argument("--concurrency", type=int, default=8, help="at a time (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="per completion (default 32)")
    ap.add_argument("--rate", type=float, default=20.0, help="polls per second (default 20)")
    ap.add_argument("--rounds", type=int, default=12, help="pairs of rounds, one of each (default 12)")
    ap.add_argument("--pin", default="0/1" if (os.cpu_count() or 1) > 1 else "none",
                    help="ENGINE/FRONT cores: the started server's EngineCore and worker on "
                         "ENGINE, its API server and this client on FRONT (default 0/1; "
                         "none: not pinned)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    pin = parse_pin(args.pin)
    if pin is not None:
        pin_process(os.getpid(), pin[1])  # before any client thread starts
    server = None
    engine_pids: list[int] = []
    front_pids: list[int] = []
    if args.url is None:
        import tempfile

        work = tempfile.mkdtemp(prefix="kvsan-owners-poll-")
        print(f"starting vllm serve on the tiny model (logs: {work})", file=sys.stderr)
        server = Server(work, pin=pin)
        url, key = server.url, server.api_key
        engine_pids, front_pids = server.engine_pids, server.front_pids
    else:
        url, key = args.url.rstrip("/"), args.api_key
    try:
        res = measure(url, key, args.requests, args.concurrency, args.max_tokens, args.rate,
                      args.rounds, engine_pids=engine_pids, front_pids=front_pids)
    finally:
        if server is not None:
            server.stop()
    res["pin"] = args.pin if pin is not None else "none"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
