"""Disaggregated prefill under kvsan, as vLLM's own example runs it: a
producer engine (``kv_role="kv_producer"``) prefills each prompt and saves
its KV through vLLM's ``ExampleConnector`` to a shared directory, and a
consumer engine (``kv_role="kv_consumer"``) loads that KV for the same
prompts instead of computing it.

The producer runs in vLLM's default multi-process mode in a child process
(``tests/pd_child.py``: front end, EngineCore and worker processes, kvsan
loaded in each through the plugin entry point with ``KVSAN=1``), so the
module is marked ``slow``.  The consumer runs in this process (one engine
for the module), where a connector fault can be switched on between
requests: ``ConsumerConnector`` in ``kv_connectors.py``."""

import json
import os
import subprocess
import sys

import pytest

from kvsan import kinds
from kvsan.harness.tinymodel import ensure_tiny_model
from kvsan.reportfile import read_records, violations

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from pd_child import MARK, PROMPTS, connector_config  # noqa: E402


def run_child(report: str, store: str, role: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSAN") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=report + os.sep)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pd_child.py"),
                           ensure_tiny_model(), store, role],
                          env=env, capture_output=True, text=True, timeout=600, cwd=HERE)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len(MARK):])


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv_store"))
    report = str(tmp_path_factory.mktemp("producer"))
    return run_child(report, store, "producer"), report, store


@pytest.fixture(scope="module")
def consumer(producer, kvsan_rt):
    from vllm import LLM

    from kvsan.harness import traffic

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(**traffic.engine_kwargs(ensure_tiny_model(), num_blocks=64),
                  kv_transfer_config=connector_config("kv_consumer", producer[2],
                                                      "ConsumerConnector"))
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    yield llm


def checker_of(llm):
    """The device checker of the in-process consumer's runner."""
    from kvsan.hooks.vllm import worker as vllm_worker

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return vllm_worker._checkers[runner]


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)


def test_producer_saves_every_prompt_with_zero_violations_in_every_process(producer):
    got, report, store = producer
    # a prefill each (one token), the second prompt's first block a local hit
    assert got == {"cached": [0, 32, 0, 0, 0], "tokens": [1] * 5}
    assert len(os.listdir(store)) == len(PROMPTS)  # one saved prefix per prompt
    installed = [r for r in read_records(report) if r.get("event") == "kvsan.installed"]
    # the front end, its EngineCore and the worker (vLLM may start one more
    # front-end process of its own, a model-registry probe, which installs too)
    roles = [r["role"] for r in installed]
    assert roles.count("engine") == 1 and roles.count("worker") == 1 and "frontend" in roles
    assert len({r["pid"] for r in installed}) == len(installed)
    # the worker's checks, the input tokens included, are on under the connector
    on = [r for r in read_records(report) if r.get("event") == "kvsan.device_on"]
    assert [(r["role"], r["write_guard"], r["input_tokens"], r["kv_connector"]) for r in on] \
        == [("worker", True, "recorded", True)]
    assert violations(report) == []
    check = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_consumer_loads_seals_and_verifies_the_producers_kv_with_zero_violations(consumer, rt):
    from kv_connectors import ConsumerConnector

    llm = consumer
    ConsumerConnector.loads = 0
    outs = generate(llm, PROMPTS, 8)
    # every prompt's first 96 tokens came from the producer's store, loaded
    # by the connector's worker side (nothing was cached here before)
    assert [o.num_cached_tokens for o in outs] == [96] * len(PROMPTS)
    assert ConsumerConnector.loads == len(PROMPTS)
    dc = checker_of(llm)
    assert dc.fed_tokens is not None  # the input-token check is on under the connector
    before = dict(dc.counters)
    # the loaded blocks were sealed; served again as local prefix hits
    # (the connector has nothing more to load), each is verified first
    outs = generate(llm, PROMPTS, 4)
    assert [o.num_cached_tokens for o in outs] == [96] * len(PROMPTS)
    assert ConsumerConnector.loads == len(PROMPTS)
    assert before["sealed"] >= 3 * len(PROMPTS) - 1, before  # (two prompts share a block)
    assert dc.counters["verified"] - before["verified"] >= 3 * len(PROMPTS) - 1, dc.counters
    assert rt.violations() == [], [(v.kind, v.blocks, v.owners, v.details)
                                   for v in rt.violations()]


def test_a_load_into_blocks_another_live_request_reads_is_reported_at_the_load(consumer, rt):
    """The connector's stale destination: the second request's KV is loaded
    into the blocks of the first, which is still decoding from them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kv_connectors import ConsumerConnector

    llm = consumer
    assert llm.reset_prefix_cache()  # the prompts are loaded again, not hit
    rt.clear()
    engine = llm.llm_engine
    ConsumerConnector._last, ConsumerConnector.fired = None, None
    engine.add_request("first", TokensPrompt(prompt_token_ids=PROMPTS[2]),
                       SamplingParams(max_tokens=24, ignore_eos=True))
    for _ in range(3):  # loaded, then sealed
        engine.step()
    ConsumerConnector.stale = True
    try:
        engine.add_request("second", TokensPrompt(prompt_token_ids=PROMPTS[3]),
                           SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        ConsumerConnector.stale = False
    fired = ConsumerConnector.fired
    assert fired is not None and fired["into"] != fired["own"]
    assert fired["request"].startswith("second") and fired["owner"].startswith("first")
    found = rt.violations()
    assert [(v.kind, v.blocks, v.owners) for v in found] == [
        (kinds.CHECKSUM_MISMATCH, [b], [fired["owner"]]) for b in fired["into"]], \
        [(v.kind, v.blocks, v.owners, v.details) for v in found]
    # at the step of the load, by the check that follows a connector load
    assert all(v.step == fired["step"] for v in found), ([v.step for v in found], fired)
    assert all(v.details[0]["check"] == "after a KV connector load" for v in found)
