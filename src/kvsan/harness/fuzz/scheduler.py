"""The scheduler target: a fuzz program run on vLLM's real ``Scheduler`` (or
``AsyncScheduler``), its KV-cache managers and ``BlockPool``, with synthetic
model outputs as vLLM's own tests/v1/core feed them: one sampled token for
each scheduled request whose prompt the step completes, draft tokens and
their rejections, and a KV connector's worker reports (loads finished or
failed, sends finished) from :mod:`.connector`'s stub.

kvsan is whatever the process has installed (the fuzzer loads vLLM's
general plugins with ``KVSAN=1``; a reproducer runs once without).  Without
it, :func:`harm` checks what a lifetime bug does to vLLM's own state: a block
a live request holds with no reference left (free to be handed out), a
reference count below the number of requests holding the block, a free
count that differs from the free list, blocks still referenced once every
request is gone.
"""

from __future__ import annotations

import traceback
from collections import deque
from dataclasses import dataclass, field

from .program import BLOCK, continuation, prompt, segment

_MODEL = None
_VCFG: dict = {}
_HASHER = None
#: draft tokens proposed for each decoding request (spec decode)
WINDOW = 2 * BLOCK


def _model_config():
    global _MODEL
    if _MODEL is None:
        from vllm.config import ModelConfig

        from ..tinymodel import ensure_tiny_model

        _MODEL = ModelConfig(model=ensure_tiny_model(), skip_tokenizer_init=True,
                             dtype="float32", seed=0, max_model_len=2048)
    return _MODEL


def vllm_config(cfg: dict):
    """vLLM's config for a program's configuration (cached: building one
    takes about a second; the scheduler only reads it)."""
    key = (cfg["seqs"], cfg["budget"], cfg["async"], cfg["spec"], cfg["connector"],
           cfg.get("caching", True))
    if key not in _VCFG:
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig,
                                 SpeculativeConfig, VllmConfig)

        kw = {}
        if cfg["spec"]:
            kw["speculative_config"] = SpeculativeConfig(
                method="ngram", num_speculative_tokens=cfg["spec"],
                prompt_lookup_max=2, prompt_lookup_min=1)
        if cfg["connector"] == "mooncake":
            # (its scheduler half, as vLLM builds it; the worker half, which
            # needs the mooncake package and a store, is this target's output)
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                kv_connector_extra_config={"enable_lookup": False, "load_async": False})
        elif cfg["connector"]:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="FuzzConnector", kv_role="kv_both",
                kv_connector_module_path="kvsan.harness.fuzz.connector",
                kv_load_failure_policy="recompute")
        sched = SchedulerConfig(max_num_seqs=cfg["seqs"], max_num_batched_tokens=cfg["budget"],
                                max_model_len=2048, is_encoder_decoder=False,
                                enable_chunked_prefill=True, async_scheduling=cfg["async"])
        vcfg = VllmConfig(scheduler_config=sched, model_config=_model_config(),
                          cache_config=CacheConfig(block_size=BLOCK,
                                                   enable_prefix_caching=cfg.get("caching", True)),
                          device_config=DeviceConfig(device="cpu"), **kw)
        # overlapping steps as on a GPU host: vLLM's CPU platform turns async
        # scheduling off at config time, which would leave an AsyncScheduler
        # with a config that says one batch in flight (no deferred frees)
        vcfg.scheduler_config.async_scheduling = cfg["async"]
        _VCFG[key] = vcfg
    return _VCFG[key]


def kv_cache_config(cfg: dict):
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec)

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                dtype=torch.float32, sliding_window=WINDOW)
    groups = {"full": [KVCacheGroupSpec(["layer"], full)],
              "sliding": [KVCacheGroupSpec(["layer"], sliding)],
              "hybrid": [KVCacheGroupSpec(["full"], full),
                         KVCacheGroupSpec(["window"], sliding)]}[cfg["layout"]]
    return KVCacheConfig(num_blocks=cfg["blocks"], kv_cache_tensors=[], kv_cache_groups=groups)


_LENS: dict = {}


def max_model_len(cfg: dict) -> int:
    """The longest request the program's pool holds on its own, as vLLM's
    start-up check (``check_enough_kv_cache_memory``) requires of an
    engine's ``max_model_len``: at most this, or vLLM would not start.
    Counted over the usable blocks (the pool's null block aside) with
    vLLM's own per-request block count for each group."""
    key = (cfg["blocks"], cfg["layout"], cfg["budget"])
    if key not in _LENS:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        vcfg = vllm_config(cfg)
        kvc = kv_cache_config(dict(cfg, blocks=cfg["blocks"] - 1))
        mc = vcfg.model_config
        saved, lo, hi = mc.max_model_len, BLOCK, 2048
        try:
            while lo < hi:  # (the longest length with a concurrency of one)
                mid = (lo + hi + 1) // 2
                mc.max_model_len = mid
                if get_max_concurrency_for_kv_cache_config(vcfg, kvc) >= 1:
                    lo = mid
                else:
                    hi = mid - 1
        finally:
            mc.max_model_len = saved
        _LENS[key] = lo
    return _LENS[key]


def make_scheduler(cfg: dict):
    import copy

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vcfg = copy.copy(vllm_config(cfg))
    vcfg.cache_config = copy.copy(vcfg.cache_config)
    vcfg.cache_config.num_gpu_blocks = cfg["blocks"]
    vcfg.model_config = copy.copy(vcfg.model_config)
    vcfg.model_config.max_model_len = max_model_len(cfg)
    cls = AsyncScheduler if cfg["async"] else Scheduler
    return cls(vllm_config=vcfg, kv_cache_config=kv_cache_config(cfg),
               structured_output_manager=StructuredOutputManager(vcfg),
               block_size=BLOCK, log_stats=False)


def _hasher():
    global _HASHER
    if _HASHER is None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        h = get_hash_fn_by_name("sha256")
        init_none_hash(h)
        _HASHER = get_request_block_hasher(BLOCK, h)
    return _HASHER


def vllm_site(tb) -> str:
    """The innermost vLLM frame of a traceback, as ``vllm/...py:line func``."""
    site = "?"
    for fr in traceback.extract_tb(tb):
        f = fr.filename.replace("\\", "/")
        if "/vllm/" in f:
            site = f"vllm/{f.rsplit('/vllm/', 1)[1]}:{fr.lineno} {fr.name}"
    return site


def raised_in_vllm(e: BaseException) -> bool:
    """Whether the innermost frame of ``e`` is vLLM's (or the Python code it
    called), not the harness's."""
    frames = traceback.extract_tb(e.__traceback__)
    inner = [f.filename.replace("\\", "/") for f in frames]
    for f in reversed(inner):
        if "/kvsan/harness/fuzz/" in f:
            return False
        if "/vllm/" in f:
            return True
    return False


@dataclass
class Outcome:
    #: kvsan's records: dicts of kind, site, blocks, owners
    violations: list = field(default_factory=list)
    #: an exception vLLM raised: (type, site, message) or None
    error: tuple | None = None
    #: harm seen in vLLM's own state (the kvsan-off oracle), phrases
    harm: list = field(default_factory=list)
    #: kvsan's own errors counted during the run (sites)
    internal: list = field(default_factory=list)
    steps: int = 0
    requests: int = 0


class SchedulerRun:
    def __init__(self, program: dict, check_harm: bool = False):
        self.program, self.cfg = program, dict(program["config"])
        if self.cfg["connector"] is True:  # (programs written before the Mooncake choice)
            self.cfg["connector"] = "stub"
        self.check_harm = check_harm
        self.sched = None
        self.queue: deque = deque()
        self.order: list[str] = []
        self.versions = [0, 0]  # adapter reloads by name
        self.loads: dict[str, int] = {}      # async loads: rid -> steps left
        self.sending: dict[str, int] = {}    # delayed frees: rid -> steps left
        #: Mooncake store jobs in flight: job -> [steps left, {block: its
        #: hash when the job was emitted}] (the blocks the worker reads)
        self.stores: dict[int, list] = {}
        self.failed: set[str] = set()
        #: request id -> the token family its samples continue (-1: none)
        self.family: dict[str, int] = {}
        #: streaming-input sessions, in the order they were added
        self.sessions: list[str] = []
        #: session -> the most tokens it can reach with the segments sent
        self.session_len: dict[str, int] = {}
        #: steps in a row in which nothing was scheduled, finished or
        #: transferred while requests were waiting (the kvsan-off view of a stall)
        self.idle_steps = 0
        #: id of a step in flight -> {request: blocks the step writes}
        self.writes: dict[int, dict] = {}
        self.out = Outcome()

    # ------------------------------------------------------------ operations
    def add(self, op) -> None:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        n = len(self.order)
        rid = f"r{n}"
        salt, lora, kv = op[7], op[8], op[9]
        lr = None
        if lora >= 0:
            v = self.versions[lora]
            lr = LoRARequest(lora_name=f"adapter{lora}", lora_int_id=1 + lora + 2 * v,
                             lora_path=f"/nonexistent/kvsan-fuzz/adapter{lora}/v{v}")
        if kv is not None:
            from . import connector

            connector.PLAN[rid] = list(kv)
        resumable = len(op) > 10 and bool(op[10])
        # (vLLM's front end refuses a prompt of max_model_len tokens or more:
        # the program's traffic stays within it)
        toks = prompt(op, n)[: self.max_len - 1]
        # (a near duplicate's samples follow the family all the same: the
        # token after a changed one is still the family's likeliest)
        self.family[rid] = op[1] if op[2] * BLOCK + op[3] else -1
        self.sched.add_request(Request(
            request_id=rid, prompt_token_ids=toks, pooling_params=None,
            sampling_params=SamplingParams(max_tokens=op[6], ignore_eos=True),
            block_hasher=_hasher(), lora_request=lr,
            cache_salt=f"salt{salt}" if salt >= 0 else None, resumable=resumable))
        self.order.append(rid)
        if resumable:
            self.sessions.append(rid)
            self.session_len[rid] = len(toks) + op[6]
        self.out.requests += 1

    def update(self, op, n: int) -> None:
        """A streaming session's next segment (or its end), as the front end
        sends it: a request under the session's id."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        reqs = self.sched.requests
        open_ = [r for r in self.sessions if r in reqs and not reqs[r].is_finished()]
        if not open_:
            return
        rid = open_[op[1] % len(open_)]
        final = bool(op[6])
        toks = segment(op, n)
        # (a client keeps its session within max_model_len, counting the
        # segments vLLM has queued and not applied yet: vLLM itself does
        # not check, #42489, known upstream; the bound counts every sampled
        # token, of which vLLM keeps all but each segment's last)
        if not final and self.session_len[rid] + len(toks) + op[5] > self.max_len:
            return  # (the session would outgrow max_model_len: not sent)
        if not final:
            self.session_len[rid] += len(toks) + op[5]
        self.sched.add_request(Request(
            request_id=rid, prompt_token_ids=toks, pooling_params=None,
            sampling_params=SamplingParams(max_tokens=op[5], ignore_eos=True),
            block_hasher=_hasher(), lora_request=reqs[rid].lora_request,
            cache_salt=reqs[rid].cache_salt, resumable=not final))
        if final:
            self.sessions.remove(rid)

    def live(self) -> list[str]:
        reqs = self.sched.requests
        return [r for r in self.order if r in reqs and not reqs[r].is_finished()]

    def abort(self, rids) -> None:
        from vllm.v1.request import RequestStatus

        if rids:
            self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)

    def _connector(self):
        """The stub connector, where the program has it."""
        return self.sched.connector if self.cfg["connector"] == "stub" else None

    def _track_stores(self, so) -> None:
        """The store jobs the Mooncake scheduler half emitted this step:
        the worker reads their blocks until it reports them done, three
        steps later."""
        meta = getattr(so, "kv_connector_metadata", None)
        pool = self.sched.kv_cache_manager.block_pool
        for req in getattr(meta, "requests", None) or ():
            job = getattr(req, "store_job_id", None)
            if job is None or job in self.stores:
                continue
            bids = [p.block_id for p in getattr(req, "boundary_puts", None) or ()]
            if getattr(req, "token_len_chunk", None):
                bids += [b for group in req.block_ids or () for b in group]
            self.stores[job] = [3, {b: pool.blocks[b].block_hash for b in bids
                                    if not pool.blocks[b].is_null}]

    def output(self, so, accept: int):
        """The runner's output for ``so``: decided when it is scheduled."""
        import dataclasses

        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        reqs, ids, sampled = self.sched.requests, list(so.num_scheduled_tokens), []
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        invalid: set[int] = set()
        con = self._connector()
        for rid in ids:
            r = reqs.get(rid)
            drafts = spec.get(rid)
            if r is None:
                sampled.append([])
            elif drafts:
                k = min(accept, len(drafts))
                fam = self.family.get(rid, -1)
                sampled.append([continuation(fam, r.num_tokens + j) for j in range(k + 1)])
            elif r.num_computed_tokens >= r.num_tokens:
                sampled.append([continuation(self.family.get(rid, -1), r.num_tokens)])
            else:
                sampled.append([])
            if con is not None and rid in con.allocated and rid not in self.failed \
                    and rid not in con.loading and (self._plan(rid) or [0, 0, 0])[2]:
                invalid |= self._external_blocks(rid)  # a synchronous load that failed
        kw = {}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
        mro = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **kw)
        if self.cfg["connector"] == "mooncake":
            done = {}
            for job, entry in list(self.stores.items()):
                entry[0] -= 1
                if entry[0] <= 0:
                    done[job] = 1  # (one worker: every rank reported)
                    del self.stores[job]
            if done:
                from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
                    MooncakeStoreWorkerMetadata)

                mro.kv_connector_output = KVConnectorOutput(
                    kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves=done))
        if con is not None:
            recv, sent = set(), set()
            # (a report is counted down when its output is made, and taken
            # off the connector's books when the output is delivered: an
            # async scheduler delivers it a step later)
            for rid, left in self.loads.items():
                if left is not None:
                    self.loads[rid] = left = left - 1
                    if left <= 0:
                        self.loads[rid] = None
                        recv.add(rid)
                    if (self._plan(rid) or [0, 0, 0])[2]:
                        invalid |= self._external_blocks(rid)
            for rid, left in self.sending.items():
                if left is not None:
                    self.sending[rid] = left = left - 1
                    if left <= 0:
                        self.sending[rid] = None
                        sent.add(rid)
            if recv or sent or invalid:
                mro.kv_connector_output = KVConnectorOutput(
                    finished_recving=recv or None, finished_sending=sent or None,
                    invalid_block_ids=invalid)
        return mro

    def _plan(self, rid):
        from . import connector

        return connector.PLAN.get(rid)

    def _external_blocks(self, rid) -> set[int]:
        con = self.sched.connector
        n = con.allocated.pop(rid, 0)
        self.failed.add(rid)
        con.lost.add(rid)
        r = self.sched.requests.get(rid)
        if r is None or not n:
            return set()
        blocks = self.sched.kv_cache_manager.coordinator.single_type_managers[0] \
            .req_to_blocks.get(rid, [])
        start = con.starts.get(rid, 0) // BLOCK
        # (a window's dropped blocks are vLLM's null block: no load there)
        return {b.block_id for b in blocks[start: start + (n + BLOCK - 1) // BLOCK]
                if not b.is_null}

    def _track_connector(self) -> None:
        """The worker side's view: each load the scheduler side started and
        each free it delayed is reported two steps later."""
        con = self._connector()
        if con is None:
            return
        for rid in con.loading:
            self.loads.setdefault(rid, 2)
        for rid in con.delayed:
            self.sending.setdefault(rid, 2)

    def step(self, accept: int = 0) -> None:
        s = self.sched
        self.out.steps += 1
        # (as EngineCore.step: the engine schedules only while the scheduler
        # says it has work; an idle engine runs no step, so the worker
        # reports nothing either)
        if s.has_requests():
            so = s.schedule()
            self._stalled(so)
            self._track_connector()
            if self.cfg["connector"] == "mooncake":
                self._track_stores(so)
            mro = self.output(so, accept)
            if self.cfg["async"]:
                # (the blocks this step writes for each request, while it is
                # in flight: the kvsan-off view of a free under it)
                mgr = s.kv_cache_manager.coordinator.single_type_managers[0]
                writes = {}
                for rid, n in so.num_scheduled_tokens.items():
                    r = s.requests.get(rid)
                    if r is None or not n:
                        continue
                    end = r.num_computed_tokens  # (advanced by this step's tokens)
                    table = mgr.req_to_blocks.get(rid, ())
                    writes[rid] = [b.block_id for b in table[(end - n) // BLOCK:
                                                             -(-end // BLOCK)]
                                   if not b.is_null]
                self.writes[id(so)] = writes
                self.queue.appendleft((so, mro))
                if len(self.queue) < 2:
                    return
            else:
                self._update(so, mro)
                return
        if self.queue:
            self._update(*self.queue.pop())

    #: steps without progress after which the kvsan-off view calls it a
    #: stall (kvsan's KVSAN_STALL_STEPS default)
    STALL_STEPS = 8

    def _stalled(self, so) -> None:
        """The kvsan-off view of a stall: requests waiting, and for
        :data:`STALL_STEPS` steps in a row no token scheduled, no request
        finished and no transfer pending (nothing outside the engine that
        could unblock it)."""
        busy = (so.total_num_scheduled_tokens or so.finished_req_ids or self.queue
                or any(v is not None for v in self.loads.values())
                or any(v is not None for v in self.sending.values()) or self.stores)
        self.idle_steps = 0 if busy else self.idle_steps + 1
        if self.check_harm and self.idle_steps == self.STALL_STEPS:
            held = [r for r in self.sched.requests if self._holds(r)]
            self.out.harm.append(f"no progress for {self.STALL_STEPS} steps: requests "
                                 f"{held[:4]} wait holding blocks (the engine would hang)")

    def _holds(self, rid) -> bool:
        return any(not b.is_null for m in
                   self.sched.kv_cache_manager.coordinator.single_type_managers
                   for b in m.req_to_blocks.get(rid, ()))

    def _update(self, so, mro) -> None:
        self.writes.pop(id(so), None)
        self.sched.update_from_output(so, mro)
        kvo = mro.kv_connector_output
        if kvo is not None:
            con = self.sched.connector
            for rid in kvo.finished_recving or ():
                self.loads.pop(rid, None)
                con.loading.discard(rid)
            for rid in kvo.finished_sending or ():
                self.sending.pop(rid, None)
                con.delayed.discard(rid)
        self._after_update()

    def _after_update(self) -> None:
        self._track_connector()
        if self.cfg["spec"]:
            from vllm.v1.outputs import DraftTokenIds

            ids = [r.request_id for r in self.sched.running
                   if r.num_computed_tokens >= r.num_tokens - 1 and not r.is_finished()]
            drafts = [[(i * 13 + j) % 449 + 1 for j in range(self.cfg["spec"])]
                      for i in range(len(ids))]
            self.sched.update_draft_token_ids(DraftTokenIds(ids, drafts))
        if self.check_harm:
            self.harm(final=False)

    # ------------------------------------------------------------ running
    def run(self) -> Outcome:
        try:
            self.sched = make_scheduler(self.cfg)
            self.max_len = self.sched.max_model_len
            for i, op in enumerate(self.program["ops"]):
                name = op[0]
                if name == "add":
                    self.add(op)
                elif name == "step":
                    self.step(op[1])
                elif name == "steps":
                    for _ in range(op[1]):
                        self.step(0)
                elif name == "abort":
                    live = self.live()
                    if live:
                        self.abort([live[op[1] % len(live)]])
                elif name == "reset":
                    self.sched.reset_prefix_cache()
                elif name == "reload":
                    self.versions[op[1]] += 1
                elif name == "update":
                    self.update(op, i)
                if self.check_harm and name in ("abort", "reset"):
                    self.harm(final=False)
            self.drain()
        except Exception as e:  # noqa: BLE001 - vLLM raising is a finding
            if not raised_in_vllm(e):
                raise  # the harness's own bug, never a finding
            self.out.error = (type(e).__name__, vllm_site(e.__traceback__), str(e)[:200])
        return self.out

    def drain(self) -> None:
        """Every request aborted, then steps until nothing is in flight:
        what an engine going idle does."""
        self.abort(self.live())
        if self.check_harm:
            self.harm(final=False)
        for _ in range(64):
            if not (self.sched.has_requests() or self.queue):
                break
            self.step(0)
        if self.check_harm:
            self.harm(final=True)

    # ------------------------------------------------------------ kvsan off
    def harm(self, final: bool) -> None:
        """What a lifetime bug did to vLLM's state, seen without kvsan."""
        pool = self.sched.kv_cache_manager.block_pool
        found = self.out.harm
        holders: dict[int, int] = {}
        # (a finished request whose send is still pending holds its blocks
        # for the send as a live one does)
        live = set(self.live()) | {r for r, left in self.sending.items() if left is not None}
        live |= set(self.loads)
        for mgr in self.sched.kv_cache_manager.coordinator.single_type_managers:
            for rid, blocks in mgr.req_to_blocks.items():
                for b in blocks:
                    if b.is_null:
                        continue
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
                    if rid in live and b.ref_cnt <= 0:
                        found.append(f"block {b.block_id} of live request {rid} has no "
                                     f"reference left (in the free queue: reusable)")
        for bid, n in holders.items():
            if pool.blocks[bid].ref_cnt < n:
                found.append(f"block {bid}: ref_cnt {pool.blocks[bid].ref_cnt} below its "
                             f"{n} holders")
        for b in pool.blocks:
            if b.ref_cnt < 0 and not b.is_null:
                found.append(f"block {b.block_id}: ref_cnt {b.ref_cnt} below zero")
        q = pool.free_block_queue
        listed, node, tail = 0, q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        on_list: set[int] = set()
        while node is not None and node is not tail and listed <= len(pool.blocks):
            if node.block_id in on_list:
                found.append(f"block {node.block_id} twice on the free list")
                break
            on_list.add(node.block_id)
            if node.ref_cnt > 0:
                found.append(f"block {node.block_id} on the free list with ref_cnt "
                             f"{node.ref_cnt} (reusable while referenced)")
            listed += 1
            node = node.next_free_block
        if listed != q.num_free_blocks:
            found.append(f"free count {q.num_free_blocks} but {listed} blocks on the free list")
        for job, (_, blocks) in self.stores.items():
            for bid, was in blocks.items():
                b = pool.blocks[bid]
                if b.ref_cnt <= 0:
                    found.append(f"block {bid} free while store job {job} still reads it")
                elif was is not None and b.block_hash != was:
                    found.append(f"block {bid} handed to another request while store job "
                                 f"{job} still reads it")
        if getattr(self.sched, "defer_block_free", False):
            # (a consumer connector may load into a free block at once,
            # unordered with the device: vLLM keeps what a step in flight
            # writes until that step's output is processed)
            for so, _ in self.queue:
                for rid, bids in self.writes.get(id(so), {}).items():
                    for bid in bids:
                        if pool.blocks[bid].ref_cnt == 0:
                            found.append(f"block {bid} free while a step in flight still "
                                         f"writes it for {rid} (a KV load may be given it)")
        if final and not self.sched.requests:
            held = [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]
            if held:
                found.append(f"blocks {held[:8]} still referenced with no request left (leaked)")
        # (one record of each phrase: a broken state persists over steps)
        self.out.harm = list(dict.fromkeys(found))


def execute(program: dict, check_harm: bool = False) -> Outcome:
    """Run ``program`` and collect what kvsan (if installed) recorded."""
    from ... import runtime as _rt
    from . import connector

    rt = _rt.get()
    errors = 0
    if rt is not None:
        rt.clear()
        errors = rt.reporter.internal_errors
        sites_before = set(rt.reporter._error_sites)
    connector.PLAN.clear()
    run = SchedulerRun(program, check_harm=check_harm)
    out = run.run()
    if rt is not None:
        if out.error is None and run.sched is not None:
            from ...hooks.vllm.allocator import audit_scheduler

            try:
                audit_scheduler(rt, run.sched, site="kvsan.fuzz.drained")
            except Exception as e:  # noqa: BLE001
                out.error = (type(e).__name__, vllm_site(e.__traceback__), str(e)[:200])
        out.violations = [{"kind": v.kind, "site": v.site or "?", "blocks": list(v.blocks),
                           "owners": list(v.owners), "actor": v.actor,
                           "message": v.message, "details": v.details}
                          for v in rt.violations()]
        if rt.reporter.internal_errors != errors:
            out.internal = sorted(set(rt.reporter._error_sites) - sites_before) or ["?"]
        rt.clear()
    return out
