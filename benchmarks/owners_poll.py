"""Serving throughput while ``GET /kvsan/owners`` is polled, side by side
with no polling (docs/reliability.md).

    .venv/bin/python -m benchmarks.owners_poll                 # starts a server
    .venv/bin/python -m benchmarks.owners_poll --url URL [--api-key KEY]

A dashboard or an operator's script may poll the owners endpoint many
times a second; each poll must not make the engine pay a snapshot.  This
runs the same completion load (``--requests`` streaming completions,
``--concurrency`` at a time, ``--max-tokens`` each) in alternating rounds,
without polling and with ``--rate`` polls per second, and prints the
throughput of each and their ratio.  Without ``--url`` it starts ``vllm
serve`` on the generated tiny model with kvsan on (``KVSAN=1``,
``VLLM_PLUGINS=kvsan``, an API key) and stops it after.
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
from statistics import median

API_KEY = "kvsan-bench-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` on the tiny model with kvsan and its endpoint plugin."""

    def __init__(self, workdir: str, api_key: str | None = API_KEY, env: dict | None = None):
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


def load(url: str, model: str, api_key: str | None, n: int, concurrency: int,
         max_tokens: int) -> float:
    """Tokens per second over ``n`` completions, ``concurrency`` at a time."""
    work = prompts(n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        tokens = sum(pool.map(lambda p: complete(url, model, api_key, p, max_tokens), work))
    return tokens / (time.perf_counter() - t0)


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


def measure(url: str, api_key: str | None, requests: int, concurrency: int,
            max_tokens: int, rate: float, rounds: int, out=sys.stdout) -> dict:
    model = model_of(url, api_key)
    load(url, model, api_key, min(requests, 8), concurrency, max_tokens)  # warm-up
    plain, polled, polls, snaps = [], [], 0, 0
    for r in range(rounds):
        # alternate which goes first, so that drift favours neither
        for polling in ((False, True) if r % 2 == 0 else (True, False)):
            if polling:
                with Poller(url, api_key, rate) as p:
                    t0 = time.monotonic()
                    polled.append(load(url, model, api_key, requests, concurrency, max_tokens))
                    secs = time.monotonic() - t0
                polls += p.answers
                snaps += len(p.snapshots)
                print(f"  round {r}: polled at {rate:g}/s: {polled[-1]:.1f} tok/s "
                      f"({p.answers} answers in {secs:.1f} s, {len(p.snapshots)} engine "
                      "snapshots)", file=out, flush=True)
            else:
                plain.append(load(url, model, api_key, requests, concurrency, max_tokens))
                print(f"  round {r}: no polling: {plain[-1]:.1f} tok/s", file=out, flush=True)
    res = {"plain_tok_s": median(plain), "polled_tok_s": median(polled),
           "ratio": median(polled) / median(plain), "polls": polls, "snapshots": snaps}
    print(f"owners polling at {rate:g}/s: {res['polled_tok_s']:.1f} tok/s against "
          f"{res['plain_tok_s']:.1f} tok/s without (median of {rounds}): ratio "
          f"{res['ratio']:.3f}; {polls} answers from {snaps} engine snapshots", file=out)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.owners_poll",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start vllm serve on the "
                                  "tiny model)")
    ap.add_argument("--api-key", default=None,
                    help="the server's --api-key (default: none; the started server's own)")
    ap.add_argument("--requests", type=int, default=64, help="completions per round "
                                                             "(default 64)")
    ap.add_argument("--concurrency", type=int, default=8, help="at a time (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="per completion (default 32)")
    ap.add_argument("--rate", type=float, default=20.0, help="polls per second (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    server = None
    if args.url is None:
        import tempfile

        work = tempfile.mkdtemp(prefix="kvsan-owners-poll-")
        print(f"starting vllm serve on the tiny model (logs: {work})", file=sys.stderr)
        server = Server(work)
        url, key = server.url, server.api_key
    else:
        url, key = args.url.rstrip("/"), args.api_key
    try:
        res = measure(url, key, args.requests, args.concurrency, args.max_tokens, args.rate,
                      args.rounds)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
