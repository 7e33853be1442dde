"""The child process of ``tests/test_data_parallel.py``: the tiny engine with
``data_parallel_size=2`` on the CPU build, through ``AsyncLLM`` -- the front
end ``vllm serve --data-parallel-size 2`` runs (its engine client is vLLM's
``DPLBAsyncMPClient``: two ``EngineCore_DP0/1`` processes, one worker each,
and a ``VLLM_DP_Coordinator``).  ``vllm.LLM`` refuses ``data_parallel_size``
> 1 unless each rank is started by hand (``external_launcher``).

kvsan is loaded by ``KVSAN=1`` (the parent sets the ``KVSAN_*`` variables,
``KVSAN_INJECT=leak_on_abort`` with ``KVSAN_INJECT_ONLY=kvsan-fault-``, and
``VLLM_CPU_OMP_THREADS_BIND``).  In order:

1. clean shared-prefix traffic, concurrent, routed by vLLM's load balancer
   over both engines, a few requests cancelled mid-stream;
2. the owners snapshot of every engine (``kvsan.hooks.vllm.owners.from_client``) and
   a scrape of each engine's and worker's exporter;
3. one fault-marked request pinned to engine 1 (``data_parallel_rank=1``)
   and cancelled mid-stream: the injected fault leaks its blocks there;
4. the owners snapshots again, then kvsan's real ``GET /kvsan/owners``
   route (its endpoint plugin on a FastAPI app served by uvicorn, as
   ``vllm serve`` mounts it) and ``kvsan owners URL`` against it.

Writes what it saw to OUT_JSON (too long for one atomic pipe write beside
the engine's own output).

    python tests/dp_child.py MODEL HTTP_PORT OUT_JSON
"""

import asyncio
import json
import os
import subprocess
import sys
import time

FAULT_MARK = "kvsan-fault-"


async def _stream(eng, rid, prompt, max_tokens, cancel_after=None, rank=None):
    """One request; cancelled (as a disconnecting client is) after
    ``cancel_after`` outputs.  Returns the number of outputs seen."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seen = 0
    got = asyncio.Event()

    async def run():
        nonlocal seen
        async for _ in eng.generate(TokensPrompt(prompt_token_ids=prompt), params, rid,
                                    data_parallel_rank=rank):
            seen += 1
            if cancel_after is not None and seen >= cancel_after:
                got.set()
        got.set()

    task = asyncio.create_task(run())
    if cancel_after is None:
        await task
        return seen
    await got.wait()
    task.cancel()  # AsyncLLM.generate aborts the request (vllm serve's disconnect path)
    try:
        await task
    except asyncio.CancelledError:
        pass
    return seen


def _scrape(url: str) -> str:
    from urllib.request import urlopen

    with urlopen(url, timeout=30) as r:  # noqa: S310 - loopback
        return r.read().decode()


async def main(model: str, http_port: int) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvsan.harness import traffic
    from kvsan.hooks.vllm import owners

    out: dict = {}
    t0 = time.monotonic()
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**traffic.engine_kwargs(model),
                                                    data_parallel_size=2))
    out["start_s"] = round(time.monotonic() - t0, 1)
    out["client"] = type(eng.engine_core).__name__
    try:
        # 1. clean traffic: 4 groups of 3 sharing a 2-block prefix, the load
        # balancer picks the engine; one of each group cancelled mid-stream
        jobs = []
        for g in range(4):
            prefix = [(g * 97 + i) % 500 + 1 for i in range(64)]
            for m in range(3):
                tail = [(g * 31 + m * 7 + i) % 500 + 1 for i in range(10)]
                cancel = 2 if m == 1 else None
                jobs.append(_stream(eng, f"clean-{g}-{m}", prefix + tail,
                                    40 if cancel else 12, cancel))
        out["clean_outputs"] = await asyncio.gather(*jobs)
        # a cancelled stream's abort reaches its engine after the client
        # moved on: poll the engines' own tables until every request's end
        # is filed there (or a minute passed: the test then says what is not)
        deadline = time.monotonic() + 60
        while True:
            snap = await owners.from_client(eng.engine_core)
            ended = sum(sum(e.get("recent_ends", {}).values()) for e in snap)
            if ended >= len(jobs) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        out["owners_clean"] = snap
        # each engine's and worker's own exporter, while they run
        base = int(os.environ["KVSAN_METRICS_PORT"])
        out["metrics"] = {}
        for name, port in (("engine0", base + 1), ("engine1", base + 2),
                           ("worker0", base + 100), ("worker1", base + 200)):
            text = await asyncio.to_thread(_scrape, f"http://127.0.0.1:{port}/metrics")
            out["metrics"][name] = [ln for ln in text.splitlines()
                                    if ln.startswith("kvsan_scheduler_steps_total")
                                    or ln.startswith("kvsan_violations_total")]

        # 3. the faulty request, on engine 1 only
        fault_prompt = [(i * 13) % 500 + 1 for i in range(70)]
        out["fault_outputs"] = await _stream(eng, f"{FAULT_MARK}0", fault_prompt, 400,
                                             cancel_after=2, rank=1)
        deadline = time.monotonic() + 60
        while True:
            snap = await owners.from_client(eng.engine_core)
            e1 = next(e for e in snap if e.get("engine") == 1)
            if any(FAULT_MARK in r["owner"] and r["state"] == "aborted"
                   for r in e1.get("owners", ())) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        out["owners_fault"] = snap

        # 4. the real route and CLI
        import uvicorn
        from fastapi import FastAPI

        app = FastAPI()
        plugin = owners.endpoint_plugin()
        plugin.attach_router(app)
        await plugin.init_state(eng, app.state, None)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port,
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{http_port}"
        for flag in ("--json", "--fail-on-orphans"):
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvsan.cli", "owners", url, flag, "--limit", "0",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVSAN")})
            so, se = await cli.communicate()
            out[f"cli{flag}"] = {"rc": cli.returncode, "stdout": so.decode(),
                                 "stderr": se.decode()[-2000:]}
        server.should_exit = True
        await serving
    finally:
        eng.shutdown()
    out["total_s"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":  # the CPU build spawns its processes
    result = asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    with open(sys.argv[3], "w") as f:
        json.dump(result, f, default=str)
