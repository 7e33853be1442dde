"""A sliding-window model on the real engine (the tiny model's weights with
a 64-token window, as Mistral runs it: every layer in one sliding-window
KV cache group, the group the worker view follows).  vLLM frees a running
request's blocks once its window has moved past them, while the worker's
block table keeps them; kvsan's journal tells the worker view, so their
reuse by another request is not reported."""

import gc
import json
import shutil

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    from kvsan.harness.tinymodel import ensure_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-sliding"
    shutil.copytree(ensure_tiny_model(), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_blocks_a_window_moved_past_are_no_reuse(sliding_model, rt, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsan.harness import traffic
    from kvsan.hooks.vllm import worker as vllm_worker

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    dropped = []
    begin = vllm_worker.begin_step

    def spy(rt_, dc, so, layers):
        dropped.extend(getattr(so, "kvsan", {}).get("dropped", ()))
        return begin(rt_, dc, so, layers)

    monkeypatch.setattr(vllm_worker, "begin_step", spy)
    llm = LLM(**traffic.engine_kwargs(sliding_model, num_blocks=40))
    try:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        assert type(manager.coordinator.single_type_managers[0]).__name__ == \
            "SlidingWindowManager"
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 400 + 1 for i in range(90)])
                   for j in range(10)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outs) == 10
        assert dropped  # windows moved past blocks, and the worker was told
        assert rt.violations() == []  # without it: reuse_with_live_owners, 17 times
    finally:
        del llm
        gc.collect()
