/* kvsan._native._hookfast: the hottest engine hooks as C callables.
 *
 * vLLM's scheduler makes about fifty BlockPool calls a step at 256 running
 * requests (get_new_blocks, touch, free_blocks, cache_full_blocks).  Through
 * kvsan's Python trampolines each costs a handful of Python frames of glue
 * before the clean-event work, which is already in C (kvsan._native._shadowfast,
 * kvsan._native._frames): the trampoline, the hook, the checker lookup, the call
 * context, the guard and its timer.  Measured in situ (py-spy), that glue was
 * most of kvsan's scheduler-side cost.  A ``Hook`` here replaces the
 * trampoline for these four methods: it calls vLLM's original with the
 * engine's own arguments, reads the call context, applies the event through
 * the pool's ``_shadowfast.Table`` and files the step journal, all without a
 * Python frame.  The identity audit rides on two of them: the cache hook
 * makes its producer records (identity_observe), and a fifth kind, HITS, on
 * ``KVCacheCoordinator.allocate_new_computed_blocks``, makes its hit check
 * (hits_call), both through kvsan's own C functions for the clean case.  A
 * sixth, END, on ``Scheduler._free_request``, files a clean request end,
 * and PREEMPT and FINISH, on ``Scheduler._preempt_request`` and
 * ``finish_requests``, pass a clean preemption or abort (ended_call).  A
 * seventh, SKIP, on
 * ``SingleTypeKVCacheManager._remove_blocks_in_range``, lets through the
 * calls that remove nothing (skip_call).  On the scheduler's step, SCHED,
 * on ``Scheduler.schedule``, ships the pool's step journal to the workers
 * (sched_call), and UPDATE, on ``Scheduler.update_from_output``, lets
 * through the steps with nothing to check after it (update_call); on the
 * worker's, STEP and GUARD, on the V1 runner's
 * ``execute_model`` and ``_prepare_inputs``, begin the quiet steps and
 * guard the common ones (step_call, guard_call).
 *
 * It is only a faster route to the same results:
 *  - anything it does not handle (kvsan off, a pool without a native table,
 *    keyword or unexpected arguments, a one-shot iterable it must not read
 *    twice) goes to the Python trampoline (``slow``) for the whole call,
 *    before vLLM's method runs;
 *  - an event the table does not find clean, or a call without a known
 *    owner, goes to the Python hook's second half (``post``) with the context
 *    already read, after vLLM's method ran (the table changes nothing when it
 *    declines an event);
 *  - a failure of kvsan's own is handed to ``error_fn`` (the Python guard's
 *    except branch: counted, and raised only outside ``log`` mode), except in
 *    the identity routes, which hand the call to the Python hook instead.
 * tests/test_native.py compares this route with the pure-Python one (the whole
 * shadow table, journal and violations of seeded traffic with faults);
 * tests/test_hookfast.py covers the call forms and the failure handling;
 * tests/test_identity.py and tests/test_scheduler_paths.py the identity
 * routes (taken for clean calls, a bad key still reported).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

#define KVSAN_HOOKFAST_ABI 13

#include "_capi.h"
#include "_slots.h"
#include <structmember.h>

enum { K_ALLOCATE = 0, K_TOUCH = 1, K_RELEASE = 2, K_CACHE = 3, K_HITS = 4, K_END = 5,
       K_SKIP = 6, K_STEP = 7, K_GUARD = 8, K_SCHED = 9, K_UPDATE = 10, K_PREEMPT = 11,
       K_FINISH = 12, K_ADMIT = 13, K_HELD = 14, K_ADMIT_ALL = 15, K_N = 16 };

/* set by configure(): strong references */
static PyObject *rt_globals = NULL; /* dict: kvsan.runtime's globals (``_runtime``) */
/* rt_globals' ``_runtime`` as last read (a strong reference), or NULL: read
 * it anew.  kvsan.runtime.set_runtime, the only place that assigns it,
 * calls runtime_changed() (its watcher list), which drops it. */
static PyObject *rt_cached = NULL;
static PyObject *context_fn = NULL; /* kvsan._native._frames.context(depth, owner_ctx) */
static PyObject *checker_fn = NULL; /* (pool) -> (runtime, checker or None) */
static PyObject *error_fn = NULL;   /* (runtime, where, exception): may raise */
static int enabled = 0;             /* enable(): off sends every call to ``slow`` */

/* kvsan._native._frames' and kvsan._native._shadowfast's C functions (see _capi.h), or NULL:
 * then their Python methods */
static const KvsanFramesAPI *fapi = NULL;
static const KvsanShadowAPI *sapi = NULL;

/* one-entry cache of checker_fn: the runtime, a weak reference to the pool
 * and its checker (whose ``fast`` table is read on every call: it may be
 * replaced) */
static PyObject *c_rt = NULL, *c_pool_ref = NULL, *c_ck = NULL;

static PyObject *s_runtime, *s_owner_ctx, *s_step, *s_journal, *s_uncached, *s_freed,
    *s_cached, *s_overhead_s, *s_fast, *s_allocate, *s_share, *s_snapshot, *s_release,
    *s_cache, *s_current_owner, *s_unknown, *s_request, *s_blocks, *s_num_cached,
    *s_num_full, *s_preempted, *s_request_id, *s_request_ids, *s_new_computed_blocks,
    *s_block_pool,
    *s_checked, *s_status,
    *s_requests, *s_req_to_blocks, *s_kv_cache_group_id, *s_is_null, *s_dropped, *s_block_id,
    *s_remove_blocks, *zero, *one;
/* the worker side's (K_STEP, K_GUARD) */
static PyObject *s_kvsan, *s_reset, *s_finished_req_ids, *s_preempted_req_ids,
    *s_scheduled_new_reqs, *s_kv_cache_block_copies, *s_step_hits, *s_pending_sums,
    *s_scheduled_cached_reqs, *s_resumed_req_ids, *s_new_block_ids, *s_poison_on,
    *s_checksum, *s_sums, *s__tick, *s_SAMPLE_BATCH_STEPS, *s_pending_seal, *s_pending_guard,
    *s_will_seal, *s_pending_release, *s_every_step, *s_total_num_scheduled_tokens,
    *s_config, *s_audit_every, *s_metrics, *s_metrics_due,
    *s_device_s, *s_input_batch, *s_num_reqs, *s_block_table, *s_block_tables,
    *s_slot_mapping, *s_gpu, *s_req_ids, *s__req_ids, *s_req_id_to_index, *s__fast,
    *s_rows_on, *s__row_order, *s_links,
    *s_guard_step, *s_guard_where,
    *s_idle_audited, *s_busy;

/* the running kvsan (kvsan.runtime._runtime, borrowed; None when off), or
 * NULL with an exception: read on every hook call, so the last read's
 * object until runtime_changed() says it was assigned again (a dict lookup
 * was a sixth of a touch's added instructions) */
static inline PyObject *
running(void)
{
    if (rt_cached != NULL) {
        return rt_cached;
    }
    PyObject *rt = PyDict_GetItemWithError(rt_globals, s_runtime);
    if (rt == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        rt = Py_None;
    }
    rt_cached = Py_NewRef(rt);
    return rt;
}

typedef struct {
    PyObject_HEAD
    int kind;
    PyObject *original; /* vLLM's function */
    PyObject *slow;     /* the Python trampoline: the whole call */
    PyObject *post;     /* the Python hook's second half */
    PyObject *where;    /* str: the guard's name for kvsan's own failures */
    PyObject *observer; /* K_CACHE: a further hook's second half, or None */
    PyObject *identity; /* K_CACHE / K_HITS: the identity audit's clean route in C,
                         * or None (see identity_observe, hits_call) */
    PyObject *state;    /* K_END etc.: the request-end check's state (see end_clean), or None */
    PyObject *dict;     /* __dict__ (__wrapped__, __name__, __kvsan_patched__) */
    vectorcallfunc vectorcall;
    unsigned long long calls; /* calls that took the native route */
    double seconds;           /* kvsan's own time in them (benchmarks.hookcost) */
    unsigned long long tick;  /* the BlockPool four: calls counted for TIME_EVERY */
    unsigned long long observed; /* K_CACHE: producer records made in C */
    double observe_seconds;      /* and the time they took */
} Hook;

/* kvsan's own time per timed hook call, read twice or four times: through
 * the vDSO a CLOCK_MONOTONIC read costs about 24 ns here, the time-stamp
 * counter about 9 ns (a 4-block touch: vLLM's own work is 190 ns).  The
 * counter is used where Linux itself keeps time with it (its clock source
 * is ``tsc``: invariant and synchronised across CPUs), scaled to seconds by
 * a calibration against CLOCK_MONOTONIC at configure(); elsewhere the clock. */
#if defined(__x86_64__)
#include <x86intrin.h>
#define HAVE_TSC 1
#endif

static double tsc_seconds = 0.0; /* seconds per counter tick; 0: the clock */

/* The BlockPool four (allocate, touch, free, cache) time one call in
 * TIME_EVERY (the first, then every TIME_EVERY-th) and file its time
 * TIME_EVERY times: an unbiased estimate of kvsan's own time in them.
 * Timing every call would read the counter twice a call and file the
 * result: in a 4-block prefix hit, where vLLM's own work is about 300 ns
 * and kvsan's about 250, that is a tenth of kvsan's share (side by side,
 * 1.97x of vLLM's touch against 1.89x with no timing). */
#define TIME_EVERY 8
#ifdef HAVE_TSC
static unsigned long long tsc_base = 0; /* ticks are read from here (a double's precision) */
#endif

static inline double
clock_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter's clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double
now(void)
{
#ifdef HAVE_TSC
    if (tsc_seconds > 0.0) {
        return (double)(long long)(__rdtsc() - tsc_base) * tsc_seconds;
    }
#endif
    return clock_now();
}

#ifdef HAVE_TSC
/* a CLOCK_MONOTONIC read and the counter at that moment: the read is
 * bracketed by two counter reads, retried while the bracket is wide (an
 * interrupt in between); 0 if it stays wide */
static int
clock_and_tsc(double *c, unsigned long long *t)
{
    unsigned long long best = ~0ULL;
    for (int i = 0; i < 16; i++) {
        unsigned long long a = __rdtsc();
        double now_c = clock_now();
        unsigned long long b = __rdtsc();
        if (b > a && b - a < best) {
            best = b - a;
            *c = now_c;
            *t = a + (b - a) / 2;
        }
        if (best < 2000) { /* under a microsecond or so: no interrupt */
            return 1;
        }
    }
    return best != ~0ULL && best < 100000;
}
#endif

/* tsc_seconds, where the kernel's clock source is the counter: its ticks
 * over about 2 ms of CLOCK_MONOTONIC, the median of five (once per
 * process: a preemption during one skews that one only) */
static void
calibrate(void)
{
#ifdef HAVE_TSC
    if (tsc_seconds > 0.0) {
        return;
    }
    char src[32] = {0};
    FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (f == NULL) {
        return;
    }
    size_t len = fread(src, 1, sizeof(src) - 1, f);
    fclose(f);
    if (len < 3 || strncmp(src, "tsc", 3) != 0 || (src[3] != '\n' && src[3] != '\0')) {
        return;
    }
    double got[5];
    int n = 0;
    for (int i = 0; i < 5; i++) {
        double c0 = 0.0, c1 = 0.0;
        unsigned long long t0 = 0, t1 = 0;
        if (!clock_and_tsc(&c0, &t0)) {
            continue;
        }
        do {
            c1 = clock_now();
        } while (c1 - c0 < 2e-3);
        if (clock_and_tsc(&c1, &t1) && t1 > t0) {
            got[n++] = (c1 - c0) / (double)(t1 - t0);
        }
    }
    if (n < 3) {
        return; /* the clock, then */
    }
    for (int i = 1; i < n; i++) { /* (insertion sort of n <= 5) */
        for (int j = i; j > 0 && got[j] < got[j - 1]; j--) {
            double x = got[j];
            got[j] = got[j - 1];
            got[j - 1] = x;
        }
    }
    tsc_base = __rdtsc();
    tsc_seconds = got[n / 2];
#endif
}

/* kvsan's own time in these hooks is kept here and added to the runtime's
 * ``overhead_s`` (kvsan_overhead_seconds_total) in one go, when another
 * runtime's call comes or flush_overhead() is called (before the metrics
 * read it): an attribute read, a float and an attribute write per event
 * cost more than the timer.  A weak reference: a runtime that goes away
 * takes its unflushed time with it. */
static PyObject *ov_ref = NULL;
static double ov_pending = 0.0;
/* the worker side's share of it (K_STEP, K_GUARD), also added to the
 * runtime's ``device_s`` */
static double dv_pending = 0.0;

/* rt.<name> += dt */
static int
add_to_attr(PyObject *rt, PyObject *name, double dt)
{
    PyObject *old = PyObject_GetAttr(rt, name);
    double v = old == NULL ? -1.0 : PyFloat_AsDouble(old);
    Py_XDECREF(old);
    PyObject *new = (v == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(v + dt);
    int r = new == NULL ? -1 : PyObject_SetAttr(rt, name, new);
    Py_XDECREF(new);
    return r;
}

static int
flush(void)
{
    PyObject *rt = ov_ref != NULL ? PyWeakref_GET_OBJECT(ov_ref) : Py_None;
    double dt = ov_pending, dv = dv_pending;
    ov_pending = dv_pending = 0.0;
    if (rt == Py_None || (dt == 0.0 && dv == 0.0)) {
        return 0;
    }
    Py_INCREF(rt);
    int r = dt != 0.0 ? add_to_attr(rt, s_overhead_s, dt) : 0;
    if (r == 0 && dv != 0.0) {
        r = add_to_attr(rt, s_device_s, dv);
    }
    Py_DECREF(rt);
    return r;
}

static int
add_overhead(PyObject *rt, double dt)
{
    if (ov_ref == NULL || PyWeakref_GET_OBJECT(ov_ref) != rt) {
        int r = flush();
        PyObject *ref = PyWeakref_NewRef(rt, NULL);
        if (ref == NULL) {
            return -1;
        }
        Py_XSETREF(ov_ref, ref);
        if (r < 0) {
            return -1;
        }
    }
    if (dt > 0.0) { /* (never less: the counter is synchronised across CPUs) */
        ov_pending += dt;
    }
    return 0;
}

/* a native call's own time: the hook's counts (benchmarks.hookcost) and
 * kvsan's overhead total; a failure to add it is dropped (the routes that
 * call this hand every other failure of theirs to Python) */
static void
took(Hook *h, PyObject *rt, double dt)
{
    h->calls++;
    h->seconds += dt;
    if (add_overhead(rt, dt) < 0) {
        PyErr_Clear();
    }
}

/* a worker-side call's own time: also the runtime's ``device_s`` */
static void
took_device(Hook *h, PyObject *rt, double dt)
{
    took(h, rt, dt); /* (add_overhead made ov_ref this runtime's) */
    if (dt > 0.0 && ov_ref != NULL && PyWeakref_GET_OBJECT(ov_ref) == rt) {
        dv_pending += dt;
    }
}

/* took() (``device``: took_device()) with the pending exception, if any,
 * set aside while the time is filed: vLLM's, a violation or a failure of
 * kvsan's own, which the caller then propagates or hands on */
static void
took_aside(Hook *h, PyObject *rt, double dt, int device)
{
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (device) {
        took_device(h, rt, dt);
    } else {
        took(h, rt, dt);
    }
    PyErr_Restore(et, ev, etb);
}

/* the pending exception went to error_fn: 0 handled (counted), -1 raised */
static int
failed(PyObject *rt, PyObject *where)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    PyObject *r = PyObject_CallFunctionObjArgs(error_fn, rt, where,
                                               value != NULL ? value : Py_None, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* An attribute read at a fixed offset where the type keeps it in a slot
 * (kvsan's Runtime.step, AllocatorChecker.fast, StepJournal's lists: read
 * on every event), resolved once per type and again whenever the type is
 * modified (its version tag), as CPython's own member descriptor reads it;
 * anything else (no slot, an unset one) through PyObject_GetAttr
 * (kvsan/_native/_slots.h: one table per attribute here). */
static SlotTable sr_step, sr_fast, sr_journal_of, sr_journal[3]; /* journal: uncached, freed, cached */

/* new reference to ``obj.<name>``, or NULL with an exception */
static inline PyObject *
slot_attr(PyObject *obj, PyObject *name, SlotTable *c)
{
    return slots_get(c, obj, 0, &name, 1);
}

/* (checker, table) of ``pool`` under ``rt`` as new references: 1 found with a
 * native table, 0 not (the Python route decides), -1 error */
static int
lookup(PyObject *rt, PyObject *pool, PyObject **ck, PyObject **fast)
{
    PyObject *checker; /* a new reference */
    if (c_rt == rt && c_pool_ref != NULL && PyWeakref_GET_OBJECT(c_pool_ref) == pool) {
        checker = Py_NewRef(c_ck);
    } else {
        PyObject *got = PyObject_CallOneArg(checker_fn, pool);
        if (got == NULL) {
            return -1;
        }
        if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2
            || PyTuple_GET_ITEM(got, 0) != rt || PyTuple_GET_ITEM(got, 1) == Py_None) {
            Py_DECREF(got);
            return 0;
        }
        checker = Py_NewRef(PyTuple_GET_ITEM(got, 1));
        Py_DECREF(got);
        PyObject *ref = PyWeakref_NewRef(pool, NULL);
        if (ref == NULL) {
            PyErr_Clear(); /* not weakly referenceable: not cached */
        } else {
            Py_XSETREF(c_rt, Py_NewRef(rt));
            Py_XSETREF(c_pool_ref, ref);
            Py_XSETREF(c_ck, Py_NewRef(checker));
        }
    }
    PyObject *table = slot_attr(checker, s_fast, &sr_fast);
    if (table == NULL || table == Py_None) {
        Py_XDECREF(table);
        Py_DECREF(checker);
        return table == NULL ? -1 : 0;
    }
    *ck = checker;
    *fast = table;
    return 1;
}

/* one-entry cache of the runtime's ``owner_ctx`` list, read on every event:
 * a Runtime never rebinds it (kvsan.runtime) */
static PyObject *r_rt = NULL, *r_ctx = NULL;

/* rt.owner_ctx, a new reference */
static PyObject *
rt_ctx(PyObject *rt)
{
    if (r_rt != rt) {
        PyObject *ctx = PyObject_GetAttr(rt, s_owner_ctx);
        if (ctx == NULL) {
            return NULL;
        }
        Py_XSETREF(r_ctx, ctx);
        Py_XSETREF(r_rt, Py_NewRef(rt));
    }
    return Py_NewRef(r_ctx);
}

/* the site and owner of the engine call being observed, as new references
 * in *site and *owner; -1 with an exception */
static int
context(PyObject *rt, PyObject **site, PyObject **owner)
{
    PyObject *ctx = rt_ctx(rt);
    if (ctx == NULL) {
        return -1;
    }
    /* depth 0: the calling Python frame is the engine's (or a kvsan hook's,
     * which the reader skips) */
    int got;
    if (fapi != NULL) {
        got = fapi->context(ctx, site, owner);
    } else {
        PyObject *argv[2] = {zero, ctx};
        PyObject *pair = PyObject_Vectorcall(context_fn, argv, 2, NULL);
        got = pair == NULL ? -1 : pair == Py_None ? 0 : 1;
        if (got == 1 && (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)) {
            PyErr_SetString(PyExc_TypeError, "kvsan._native._hookfast: context() returned no pair");
            got = -1;
        } else if (got == 1) {
            *site = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
            *owner = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        }
        Py_XDECREF(pair);
    }
    Py_DECREF(ctx);
    if (got != 0) {
        return got < 0 ? -1 : 0;
    }
    /* no Python frame at all: as kvsan.hooks.vllm.allocator._context */
    *owner = PyObject_CallMethodNoArgs(rt, s_current_owner);
    if (*owner == NULL) {
        return -1;
    }
    *site = Py_NewRef(s_unknown);
    return 0;
}

/* The worker's device checker's attributes the STEP and GUARD hooks read
 * every step (slots of kvsan.checks.device.DeviceChecker): between two
 * forward passes each read through the instance dict cost about 0.4 µs
 * (caches cold). */
enum { D_STEP_HITS, D_PENDING_SUMS, D_POISON_ON, D_CHECKSUM, D_SUMS, D_TICK, D_PENDING_SEAL,
       D_PENDING_GUARD, D_FAST, D_ROWS_ON, D_ROW_ORDER, N_DC };
static SlotTable sr_dc[N_DC];
static PyObject **const dc_names[N_DC] = {&s_step_hits, &s_pending_sums, &s_poison_on,
                                          &s_checksum,  &s_sums,         &s__tick,
                                          &s_pending_seal, &s_pending_guard, &s__fast,
                                          &s_rows_on,   &s__row_order};

/* new reference to the checker's attribute ``i``, or NULL with an exception */
static inline PyObject *
dc_get(PyObject *dc, int i)
{
    return slots_get(&sr_dc[i], dc, 0, dc_names[i], 1);
}

/* the truth of the checker's attribute ``i``: 1, 0, -1 error */
static inline int
dc_truth(PyObject *dc, int i)
{
    return truth_of(dc_get(dc, i));
}

/* new reference: ck.journal, the step journal of the checker's pool (a
 * slot of AllocatorChecker: its scheduler ships it to its workers) */
static PyObject *
pool_journal(PyObject *ck)
{
    return slot_attr(ck, s_journal, &sr_journal_of);
}

/* the slot table of the step journal's list ``name``, or NULL (read
 * through PyObject_GetAttr) */
static SlotTable *
journal_slots(PyObject *name)
{
    return name == s_uncached ? &sr_journal[0]
           : name == s_freed  ? &sr_journal[1]
           : name == s_cached ? &sr_journal[2]
                              : NULL;
}

/* new reference: journal.<name>, one of the step journal's lists */
static PyObject *
journal_get(PyObject *journal, PyObject *name)
{
    SlotTable *c = journal_slots(name);
    return c != NULL ? slot_attr(journal, name, c) : PyObject_GetAttr(journal, name);
}

/* new reference: ck.journal.<name>, the step journal's list ``name`` */
static PyObject *
journal_list(PyObject *ck, PyObject *name)
{
    PyObject *journal = pool_journal(ck);
    if (journal == NULL) {
        return NULL;
    }
    PyObject *list = journal_get(journal, name);
    Py_DECREF(journal);
    return list;
}

/* ck.journal.<name>.extend(items) when items is a non-empty list */
static int
journal_extend(PyObject *ck, PyObject *name, PyObject *items)
{
    if (!PyList_Check(items) || PyList_GET_SIZE(items) == 0) {
        return 0;
    }
    PyObject *list = journal_list(ck, name);
    if (list == NULL) {
        return -1;
    }
    int r;
    if (PyList_CheckExact(list)) {
        r = PyList_SetSlice(list, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, items);
    } else {
        PyObject *x = PyObject_CallMethod(list, "extend", "O", items);
        r = x == NULL ? -1 : 0;
        Py_XDECREF(x);
    }
    Py_DECREF(list);
    return r;
}

/* RELEASE's snapshot as the list the Python methods take (*snap replaced),
 * where the C function wrote it as an array */
#define SNAP_ON_STACK 64

static int
snap_as_list(PyObject **snap, const long long *csnap, Py_ssize_t k)
{
    if (csnap == NULL || *snap != Py_True) {
        return 0; /* already the list */
    }
    /* (an array is only made through sapi, and the module stays loaded) */
    PyObject *out = sapi != NULL ? sapi->snapshot_list(csnap, k) : NULL;
    if (out == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "kvsan._native._hookfast: the snapshot has no list");
        }
        return -1;
    }
    Py_SETREF(*snap, out);
    return 0;
}

/* the event of a hook's kind through the pool's table: 1 clean (applied,
 * its block ids filed in the step journal), 0 not clean (nothing changed),
 * -1 error.  ``blocks``: what the event is about (for CACHE, the blocks
 * given a key); ``snap``: RELEASE's snapshot.  Through the table's C
 * functions where it is _shadowfast's own table, else its Python methods
 * (tests swap in others). */
static int
apply_event(int kind, PyObject *ck, PyObject *fast, PyObject *rt, PyObject *blocks,
            PyObject **snap, const long long *csnap, Py_ssize_t csnap_n, PyObject *owner,
            PyObject *site)
{
    static PyObject **const journal_of[] = {&s_uncached, NULL, &s_freed, &s_cached};
    static PyObject **const method_of[] = {&s_allocate, &s_share, &s_release, &s_cache};
    PyObject *step = NULL, *dest = NULL, *res = NULL;
    if (kind != K_CACHE && (step = slot_attr(rt, s_step, &sr_step)) == NULL) {
        return -1;
    }
    Py_ssize_t n = kind == K_RELEASE ? 5 : kind == K_CACHE ? 1 : 4;
    int direct = sapi != NULL && Py_TYPE(fast) == sapi->table_type
                 && (kind != K_RELEASE
                     || (csnap != NULL && PyList_GET_SIZE(blocks) == csnap_n));
    if (direct && journal_of[kind] != NULL) {
        if ((dest = journal_list(ck, *journal_of[kind])) == NULL) {
            Py_XDECREF(step);
            return -1;
        }
        if (!PyList_CheckExact(dest)) { /* another kind of list: its own extend() */
            Py_CLEAR(dest);
            direct = 0;
        }
    }
    if (!direct && kind == K_RELEASE && snap_as_list(snap, csnap, csnap_n) < 0) {
        Py_XDECREF(step);
        return -1;
    }
    PyObject *argv[6] = {fast, blocks, owner, step, site, NULL};
    if (kind == K_RELEASE) {
        PyObject *a[6] = {fast, blocks, *snap, owner, step, site};
        memcpy(argv, a, sizeof(a));
    }
    if (!direct) {
        res = PyObject_VectorcallMethod(*method_of[kind], argv,
                                        (size_t)(n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    } else if (kind == K_ALLOCATE) {
        res = sapi->allocate(fast, argv + 1, n, dest);
    } else if (kind == K_TOUCH) {
        res = sapi->share(fast, argv + 1, n);
    } else if (kind == K_RELEASE) {
        res = sapi->release(fast, blocks, csnap, argv + 3, dest);
    } else {
        res = sapi->cache(fast, blocks, dest);
    }
    Py_XDECREF(step);
    Py_XDECREF(dest);
    if (res == NULL) {
        return -1;
    }
    int clean = res != Py_None, r = 0;
    if (clean && !direct && kind != K_TOUCH) { /* the journal from the method's result */
        PyObject *ids = res;
        if (kind != K_ALLOCATE) {
            Py_ssize_t at = kind == K_RELEASE ? 1 : 0;
            if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) <= at) {
                PyErr_Format(PyExc_TypeError, "kvsan._native._hookfast: %U() result", *method_of[kind]);
                Py_DECREF(res);
                return -1;
            }
            ids = PyTuple_GET_ITEM(res, at);
        }
        r = journal_extend(ck, *journal_of[kind], ids);
    }
    Py_DECREF(res);
    return r < 0 ? -1 : clean;
}

/* the argument ``name`` (position ``pos``, counting the pool as 0) of a call,
 * borrowed, or NULL when it was not passed */
static PyObject *
arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t pos,
    PyObject *name)
{
    if (pos < nargs) {
        return args[pos];
    }
    if (kwnames != NULL) {
        Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (k == name || PyUnicode_Compare(k, name) == 0) {
                return args[nargs + i];
            }
        }
    }
    return NULL;
}

/* the observer of a cache hook after vLLM's method ran (``rt``: the running
 * kvsan, borrowed); NULL with an exception when it raised */
/* The identity audit's producer record for a known text-only request, as
 * its Python observer makes it (kvsan.hooks.vllm.identity._cached) without
 * a Python frame.  ``h->identity`` is set by that observer once it handled
 * a call: (weak ref to the runtime, weak ref to the pool, the producer
 * records, chains dict, hash block size, [weights digest], known_chain,
 * identity_record, [make]), known_chain and identity_record being kvsan's
 * own C functions; with ``make`` known_chain starts a new text-only
 * request's chain as the observer would.  1: done; 0: not taken (another
 * runtime or pool, a request known_chain leaves to Python -- LoRA,
 * cache_salt, multimodal input --, a failure of its own): the Python
 * observer runs, and does the same or decides (identity_record is
 * idempotent). */
static int
identity_observe(Hook *h, PyObject *rt, PyObject *const *argv)
{
    PyObject *st = h->identity;
    if (!enabled || st == Py_None || !PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 9
        || !PyWeakref_Check(PyTuple_GET_ITEM(st, 0)) || !PyWeakref_Check(PyTuple_GET_ITEM(st, 1))
        || PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 0)) != rt
        || PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 1)) != argv[1]
        || !PyList_CheckExact(argv[3]) || !PyLong_CheckExact(argv[4])
        || !PyLong_CheckExact(argv[5]) || !PyList_CheckExact(PyTuple_GET_ITEM(st, 5))
        || PyList_GET_SIZE(PyTuple_GET_ITEM(st, 5)) != 1
        || !PyList_CheckExact(PyTuple_GET_ITEM(st, 8))
        || PyList_GET_SIZE(PyTuple_GET_ITEM(st, 8)) != 1) {
        return 0;
    }
    Py_ssize_t lo = PyLong_AsSsize_t(argv[4]), hi = PyLong_AsSsize_t(argv[5]);
    if (PyErr_Occurred()) { /* beyond Py_ssize_t: the Python observer decides */
        PyErr_Clear();
        return 0;
    }
    if (lo >= hi) {
        return 1; /* nothing registered: nothing to record */
    }
    double t0 = now();
    PyObject *request = argv[2];
    PyObject *kargv[5] = {PyTuple_GET_ITEM(st, 3), request, PyTuple_GET_ITEM(st, 4), argv[5],
                          PyList_GET_ITEM(PyTuple_GET_ITEM(st, 8), 0)};
    PyObject *ident = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 6), kargv, 5, NULL);
    if (ident == NULL || ident == Py_None) {
        Py_XDECREF(ident);
        PyErr_Clear();
        return 0;
    }
    PyObject *rid = PyObject_GetAttr(request, s_request_id);
    if (rid == NULL) {
        Py_DECREF(ident);
        PyErr_Clear();
        return 0;
    }
    PyObject *rargv[7] = {PyTuple_GET_ITEM(st, 2), rid, ident,
                          PyList_GET_ITEM(PyTuple_GET_ITEM(st, 5), 0), argv[3], argv[4],
                          argv[5]};
    PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 7), rargv, 7, NULL);
    Py_DECREF(rid);
    Py_DECREF(ident);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    int all = r == Py_True;
    Py_DECREF(r);
    if (!all) { /* a block it could not record: the Python observer records the call */
        return 0;
    }
    double dt = now() - t0;
    h->observed++;
    h->observe_seconds += dt;
    if (add_overhead(rt, dt) < 0) {
        PyErr_Clear();
    }
    return 1;
}

static PyObject *
observe(Hook *h, PyObject *rt, PyObject *ret, PyObject *const *argv)
{
    if (identity_observe(h, rt, argv)) {
        return ret;
    }
    PyObject *r = PyObject_Vectorcall(h->observer, argv, 6, NULL);
    if (r == NULL) {
        Py_DECREF(ret);
        return NULL;
    }
    Py_DECREF(r);
    return ret;
}

/* the whole call through the Python trampoline; a cache hook's observer (the
 * identity audit's second half) runs after it as after the native route */
static PyObject *
slow_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_INCREF(rt); /* borrowed from the runtime module, which the call may change */
    PyObject *ret = PyObject_Vectorcall(h->slow, args, nargsf, kwnames);
    if (ret != NULL && h->kind == K_CACHE && h->observer != Py_None && rt != Py_None) {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        PyObject *argv[6] = {rt, nargs > 0 ? args[0] : NULL,
                             arg(args, nargs, kwnames, 1, s_request),
                             arg(args, nargs, kwnames, 2, s_blocks),
                             arg(args, nargs, kwnames, 3, s_num_cached),
                             arg(args, nargs, kwnames, 4, s_num_full)};
        int all = 1;
        for (int i = 1; i < 6; i++) {
            all &= argv[i] != NULL; /* else vLLM accepted a call without them */
        }
        if (all) {
            ret = observe(h, rt, ret, argv);
        }
    }
    Py_DECREF(rt);
    return ret;
}

/* the hook's Python second half, ``h->post(*argv)``; its result dropped.
 * It fails only with a violation raised (raise / abort mode): then the
 * engine's result is dropped too and the exception propagates. */
static void
post(Hook *h, PyObject *const *argv, size_t n, PyObject **ret)
{
    PyObject *r = PyObject_Vectorcall(h->post, argv, n, NULL);
    if (r == NULL) {
        Py_CLEAR(*ret);
    } else {
        Py_DECREF(r);
    }
}

#define SLOW() slow_call(h, rt, args, nargsf, kwnames)

/* whether a hook's ``state`` (checked by hook_set_state: a tuple whose
 * first item, and second where ``obj`` is given, are weak references) was
 * set for the runtime ``rt`` and, unless ``obj`` is NULL, for ``obj`` (the
 * scheduler whose method this is): the first check of every route that
 * keeps one; any other call goes to the Python hook */
static inline int
state_for(PyObject *st, PyObject *rt, PyObject *obj)
{
    return st != Py_None && PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 0)) == rt
           && (obj == NULL || PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 1)) == obj);
}

/* 0 when no manager of ``managers`` (the scheduler's single-type
 * managers) lists blocks for request ``rid`` in its block tables
 * (``req_to_blocks``); 1 when one does; -1 error */
static int
listed(PyObject *managers, PyObject *rid)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(managers); i++) {
        PyObject *tables = PyObject_GetAttr(PyTuple_GET_ITEM(managers, i), s_req_to_blocks);
        if (tables == NULL || !PyDict_Check(tables)) {
            Py_XDECREF(tables);
            return -1;
        }
        PyObject *left = PyDict_GetItemWithError(tables, rid);
        int stale = left == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(left);
        Py_DECREF(tables);
        if (stale != 0) {
            return stale;
        }
    }
    return 0;
}

/* the last ``(text, step)`` end_clean filed: the ends of one step for one
 * reason share it (AllocatorChecker._note_end shares its own the same way).
 * A tuple per end was one more object for the garbage collector per
 * request, and until RECENT_ENDS of them were filed every one stayed: at
 * 256 live requests about one young collection in ten. */
static PyObject *end_value = NULL;

/* K_END: ``Scheduler._free_request(request, ...)``, after vLLM's method ran:
 * the request's end as kvsan.hooks.vllm.allocator._request_ended checks it,
 * for the clean case -- the scheduler no longer tracks the request (no
 * delayed free), no delayed free of its own is pending, the request holds
 * nothing in the shadow table and no manager's block table still lists it
 * -- where it only files the end (``recent_ends``, as
 * AllocatorChecker._note_end does).  ``h->state`` is set by that Python
 * function once it handled a call: (weak ref to the runtime, weak ref to
 * the scheduler, recent_ends, shadow.held, pending_release, status -> text,
 * RECENT_ENDS, the scheduler's single-type managers, the checker's
 * counters); the PREEMPT and FINISH hooks get the same.  Anything else -- no
 * state for this runtime or scheduler, a status not seen yet, something to
 * report, a failure of its own -- goes to ``post(scheduler, request)``, the
 * Python check, which decides. */
static int
end_clean(PyObject *st, PyObject *rt, PyObject *sched, PyObject *request)
{
    PyObject *rid = NULL, *status = NULL, *requests = NULL, *step = NULL, *value = NULL;
    PyObject *text = NULL;
    int ok = 0;
    PyObject *ends = PyTuple_GET_ITEM(st, 2), *held = PyTuple_GET_ITEM(st, 3);
    PyObject *pending = PyTuple_GET_ITEM(st, 4), *texts = PyTuple_GET_ITEM(st, 5);
    PyObject *managers = PyTuple_GET_ITEM(st, 7);
    Py_ssize_t most = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 6));
    if (most < 1 || !PyDict_CheckExact(pending)) {
        goto out;
    }
    rid = PyObject_GetAttr(request, s_request_id);
    status = rid == NULL ? NULL : PyObject_GetAttr(request, s_status);
    requests = status == NULL ? NULL : PyObject_GetAttr(sched, s_requests);
    if (requests == NULL || !PyUnicode_CheckExact(rid) || !PyDict_CheckExact(requests)) {
        goto out;
    }
    /* its own delayed free pending (Python drops that entry); other
     * requests' pending delayed frees do not concern this end: on a node
     * whose KV connector delays frees, some always are */
    if (PyDict_GET_SIZE(pending) != 0 && PyDict_Contains(pending, rid) != 0) {
        goto out;
    }
    text = Py_XNewRef(PyDict_GetItemWithError(texts, status));
    if (text == NULL || PyDict_Contains(requests, rid) != 0) {
        goto out; /* a status not seen yet, or a delayed free */
    }
    if (PySequence_Contains(held, rid) != 0 || listed(managers, rid) != 0) {
        goto out; /* it still holds blocks (or the map failed: Python decides) */
    }
    /* clean: ends.pop(rid, None); ends[rid] = (text, rt.step); trimmed */
    step = PyObject_GetAttr(rt, s_step);
    if (step == NULL) {
        goto out;
    }
    if (end_value != NULL && PyTuple_GET_ITEM(end_value, 0) == text
        && (PyTuple_GET_ITEM(end_value, 1) == step
            || PyObject_RichCompareBool(PyTuple_GET_ITEM(end_value, 1), step, Py_EQ) == 1)) {
        value = Py_NewRef(end_value);
    } else if ((value = PyTuple_Pack(2, text, step)) != NULL) {
        Py_XSETREF(end_value, Py_NewRef(value));
    } else {
        goto out;
    }
    /* (deleted first: the entry moves to the end, as ``pop`` then a set) */
    int had = PyDict_Contains(ends, rid);
    if (had < 0 || (had == 1 && PyDict_DelItem(ends, rid) < 0)) {
        goto out;
    }
    if (PyDict_SetItem(ends, rid, value) < 0) {
        goto out;
    }
    if (PyDict_GET_SIZE(ends) > most) {
        Py_ssize_t pos = 0;
        PyObject *first, *v;
        if (PyDict_Next(ends, &pos, &first, &v)) {
            Py_INCREF(first);
            int r = PyDict_DelItem(ends, first);
            Py_DECREF(first);
            if (r < 0) {
                goto out;
            }
        }
    }
    ok = 1;
out:
    PyErr_Clear();
    Py_XDECREF(rid);
    Py_XDECREF(status);
    Py_XDECREF(requests);
    Py_XDECREF(step);
    Py_XDECREF(value);
    Py_XDECREF(text);
    return ok;
}

/* K_PREEMPT: ``Scheduler._preempt_request(request, timestamp, ...)``,
 * after vLLM's method ran: the preempted request must hold nothing until
 * it resumes, as kvsan.hooks.vllm.allocator._preempted checks it.  The
 * clean case -- no delayed free of its own pending, nothing held in the
 * shadow table, no manager's block table listing it -- is counted here
 * (the checker's ``preempted`` counter, as
 * AllocatorChecker.on_request_released counts it); anything else goes to
 * ``post(scheduler, request)``.  1 counted, 0 not (nothing changed). */
static int
preempt_clean(PyObject *st, PyObject *request)
{
    PyObject *held = PyTuple_GET_ITEM(st, 3), *pending = PyTuple_GET_ITEM(st, 4);
    PyObject *managers = PyTuple_GET_ITEM(st, 7), *counters = PyTuple_GET_ITEM(st, 8);
    int ok = 0;
    PyObject *rid = PyObject_GetAttr(request, s_request_id);
    if (rid == NULL || !PyUnicode_CheckExact(rid)
        || (PyDict_GET_SIZE(pending) != 0 && PyDict_Contains(pending, rid) != 0)
        || PySequence_Contains(held, rid) != 0 || listed(managers, rid) != 0) {
        goto out;
    }
    PyObject *had = PyDict_GetItemWithError(counters, s_preempted); /* borrowed */
    long long n = had == NULL ? 0 : PyLong_AsLongLong(had);
    if (PyErr_Occurred()) {
        goto out;
    }
    PyObject *now_n = PyLong_FromLongLong(n + 1);
    ok = now_n != NULL && PyDict_SetItem(counters, s_preempted, now_n) == 0;
    Py_XDECREF(now_n);
out:
    PyErr_Clear();
    Py_XDECREF(rid);
    return ok;
}

/* K_FINISH: ``Scheduler.finish_requests(request_ids, finished_status)``,
 * after vLLM's method ran: every request it finished (its result, a list
 * of Requests) went through ``_free_request`` (filed in the checker's
 * recent ends) or has its delayed free pending, as
 * kvsan.hooks.vllm.allocator._finished checks it; anything else -- an
 * abort path that skipped the release -- goes to ``post(scheduler,
 * result)``.  1 clean, 0 not. */
static int
finish_clean(PyObject *st, PyObject *sched, PyObject *ids, PyObject *ret)
{
    PyObject *ends = PyTuple_GET_ITEM(st, 2), *pending = PyTuple_GET_ITEM(st, 4);
    if (!PyList_CheckExact(ret)) {
        return 0;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ret) && ok; i++) {
        PyObject *rid = PyObject_GetAttr(PyList_GET_ITEM(ret, i), s_request_id);
        ok = rid != NULL && PyUnicode_CheckExact(rid)
             && (PyDict_Contains(ends, rid) == 1 || PyDict_Contains(pending, rid) == 1);
        Py_XDECREF(rid);
    }
    /* and every request asked for left the scheduler's table, or waits on
     * its delayed free (else an abort may have lost it: Python looks, see
     * vllm_allocator._dropped); ids of other kinds (an iterator, spent by
     * now) are not read */
    PyObject *requests = ok && ids != NULL ? PyObject_GetAttr(sched, s_requests) : NULL;
    if (requests != NULL) {
        if (!PyDict_CheckExact(requests)) {
            ok = 0;
        } else if (ids == Py_None) { /* all of them */
            ok = PyDict_GET_SIZE(requests) <= PyDict_GET_SIZE(pending);
        } else if (PyUnicode_CheckExact(ids)) {
            ok = PyDict_Contains(requests, ids) == 0 || PyDict_Contains(pending, ids) == 1;
        } else if (PyList_CheckExact(ids) || PyTuple_CheckExact(ids) || PyAnySet_CheckExact(ids)) {
            PyObject *seq = PySequence_Fast(ids, "ids");
            for (Py_ssize_t i = 0; seq != NULL && i < PySequence_Fast_GET_SIZE(seq) && ok; i++) {
                PyObject *rid = PySequence_Fast_GET_ITEM(seq, i);
                ok = PyDict_Contains(requests, rid) == 0 || PyDict_Contains(pending, rid) == 1;
            }
            ok = ok && seq != NULL;
            Py_XDECREF(seq);
        }
        Py_DECREF(requests);
    }
    PyErr_Clear();
    return ok;
}

/* the END, PREEMPT and FINISH routes: vLLM's method, then the clean case
 * in C (end_clean, preempt_clean, finish_clean; ``request``: the ending or
 * preempted one, NULL for finish_requests, whose result is checked), else
 * ``post(scheduler, request or result)``, the Python check */
static PyObject *
ended_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames,
           PyObject *request)
{
    PyObject *st = h->state;
    if (!state_for(st, rt, args[0])) {
        return SLOW();
    }
    Py_INCREF(rt);
    Py_INCREF(st); /* the call may replace it */
    Py_XINCREF(request);
    PyObject *sched = Py_NewRef(args[0]);
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) {
        double t0 = now();
        PyObject *ids = h->kind == K_FINISH ? arg(args, PyVectorcall_NARGS(nargsf), kwnames, 1,
                                                 s_request_ids)
                                            : NULL; /* borrowed */
        int done = running() == rt
                   && (h->kind == K_END       ? end_clean(st, rt, sched, request)
                       : h->kind == K_PREEMPT ? preempt_clean(st, request)
                                              : finish_clean(st, sched, ids, ret));
        PyErr_Clear();
        double dt = now() - t0;
        if (done) {
            took(h, rt, dt);
        } else if (h->kind == K_FINISH && ids != NULL) {
            PyObject *pargv[3] = {sched, ret, ids};
            post(h, pargv, 3, &ret);
        } else {
            PyObject *pargv[2] = {sched, request != NULL ? request : ret};
            post(h, pargv, 2, &ret);
        }
    }
    Py_XDECREF(request);
    Py_DECREF(sched);
    Py_DECREF(st);
    Py_DECREF(rt);
    return ret;
}

/* K_HITS: ``KVCacheCoordinator.allocate_new_computed_blocks(request_id,
 * new_computed_blocks, ...)``, before vLLM's method runs: the identity
 * audit's hit check (kvsan.hooks.vllm.identity._check_hits) for a request
 * whose chain is known or that known_chain can start, when nothing
 * mismatches.  ``h->identity`` is set by the Python hook once it handled a
 * call: (weak ref to the runtime, weak ref to the pool, producer records, chains,
 * hash block size, [weights digest], known_chain, identity_hits, [make],
 * the scheduler's requests dict, the audit); the one-item lists are read on
 * every call (a weights update or a new KV dtype replaces their item).
 * Anything else -- another runtime or pool, a Request not in the
 * scheduler's table, a chain the Python path must make, a mismatch to
 * report, a failure of its own -- goes to the Python trampoline for the
 * whole call (until it reports, the check only records: a chain started
 * here is found there, so running it again changes nothing). */
static PyObject *
hits_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *st = h->identity;
    if (st == Py_None || !PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 11
        || !PyWeakref_Check(PyTuple_GET_ITEM(st, 0)) || !PyWeakref_Check(PyTuple_GET_ITEM(st, 1))
        || PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 0)) != rt
        || !PyDict_CheckExact(PyTuple_GET_ITEM(st, 9))
        || !PyList_CheckExact(PyTuple_GET_ITEM(st, 5))
        || PyList_GET_SIZE(PyTuple_GET_ITEM(st, 5)) != 1
        || !PyList_CheckExact(PyTuple_GET_ITEM(st, 8))
        || PyList_GET_SIZE(PyTuple_GET_ITEM(st, 8)) != 1) {
        return SLOW();
    }
    PyObject *rid = arg(args, nargs, kwnames, 1, s_request_id);
    PyObject *hits = arg(args, nargs, kwnames, 2, s_new_computed_blocks);
    if (rid == NULL || hits == NULL || !PyTuple_Check(hits)) {
        return SLOW();
    }
    PyObject *blocks = PyTuple_GET_SIZE(hits) ? PyTuple_GET_ITEM(hits, 0) : NULL;
    if (blocks == NULL || (PyList_CheckExact(blocks) && PyList_GET_SIZE(blocks) == 0)) {
        return PyObject_Vectorcall(h->original, args, nargsf, kwnames); /* nothing served */
    }
    if (!PyList_CheckExact(blocks)) {
        return SLOW();
    }
    double t0 = now();
    PyObject *pool = PyObject_GetAttr(args[0], s_block_pool);
    if (pool == NULL) {
        PyErr_Clear();
        return SLOW();
    }
    int same = PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(st, 1)) == pool;
    Py_DECREF(pool);
    PyObject *request = same ? PyDict_GetItemWithError(PyTuple_GET_ITEM(st, 9), rid) : NULL;
    if (request == NULL) {
        PyErr_Clear();
        return SLOW();
    }
    Py_INCREF(request);
    PyObject *upto = PyLong_FromSsize_t(PyList_GET_SIZE(blocks));
    PyObject *ident = NULL, *got = NULL;
    if (upto == NULL) {
        goto decline;
    }
    PyObject *kargv[5] = {PyTuple_GET_ITEM(st, 3), request, PyTuple_GET_ITEM(st, 4), upto,
                          PyList_GET_ITEM(PyTuple_GET_ITEM(st, 8), 0)};
    ident = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 6), kargv, 5, NULL);
    if (ident == NULL || ident == Py_None) {
        goto decline;
    }
    PyObject *hargv[4] = {PyTuple_GET_ITEM(st, 2), ident,
                          PyList_GET_ITEM(PyTuple_GET_ITEM(st, 5), 0), blocks};
    got = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 7), hargv, 4, NULL);
    if (got == NULL || !PyLong_CheckExact(got)) {
        goto decline; /* not compared here, or mismatches to report: the Python hook */
    }
    PyObject *audit = PyTuple_GET_ITEM(st, 10);
    PyObject *old = PyObject_GetAttr(audit, s_checked);
    PyObject *sum = old == NULL ? NULL : PyNumber_Add(old, got);
    Py_XDECREF(old);
    if (sum == NULL || PyObject_SetAttr(audit, s_checked, sum) < 0) {
        Py_XDECREF(sum);
        goto decline;
    }
    Py_DECREF(sum);
    Py_DECREF(got);
    Py_DECREF(ident);
    Py_DECREF(upto);
    Py_DECREF(request);
    double dt = now() - t0;
    took(h, rt, dt);
    return PyObject_Vectorcall(h->original, args, nargsf, kwnames);
decline:
    PyErr_Clear();
    Py_XDECREF(got);
    Py_XDECREF(ident);
    Py_XDECREF(upto);
    Py_DECREF(request);
    return SLOW();
}

/* skip_call's candidates (m new references), their array and the
 * request's block list, let go */
static void
drop_candidates(PyObject **cand, Py_ssize_t m, PyObject *blocks)
{
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_DECREF(cand[j]);
    }
    PyMem_Free(cand);
    Py_DECREF(blocks);
}

/* K_SKIP: ``SingleTypeKVCacheManager._remove_blocks_in_range(request_id,
 * first, last)``, which vLLM calls for every running request each step once
 * its attention window has passed a block.  What it removes from a request
 * of group 0 (the group the worker view follows) goes to the step journal's
 * ``dropped`` as (request id, block ids), as the Python hook
 * (kvsan.hooks.vllm.allocator._remove_blocks_in_range) files it: the
 * candidates are read as vLLM finds them, backward from ``last`` to the
 * first null block, and those no longer in the table after the call were
 * removed.  Most calls remove nothing (the range's last block is already
 * null) and cost a few attribute reads.  Another group's calls: vLLM's
 * method alone.  Other arguments or shapes: the Python hook, whole. */
static PyObject *
skip_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL) {
        return SLOW();
    }
    PyObject *gid = PyObject_GetAttr(args[0], s_kv_cache_group_id);
    long g = gid != NULL && PyLong_CheckExact(gid) ? PyLong_AsLong(gid) : -1;
    Py_XDECREF(gid);
    if (g != 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return g > 0 ? PyObject_Vectorcall(h->original, args, nargsf, kwnames) : SLOW();
    }
    PyObject *tables = PyObject_GetAttr(args[0], s_req_to_blocks);
    PyObject *blocks = tables != NULL && PyDict_Check(tables)
                           ? PyDict_GetItemWithError(tables, args[1]) : NULL; /* borrowed */
    Py_ssize_t first = PyLong_AsSsize_t(args[2]), last = PyLong_AsSsize_t(args[3]);
    if (tables == NULL || !PyDict_Check(tables) || PyErr_Occurred()
        || (blocks != NULL && !PyList_CheckExact(blocks))) {
        Py_XDECREF(tables);
        PyErr_Clear();
        return SLOW();
    }
    Py_XINCREF(blocks); /* held across vLLM's call */
    Py_DECREF(tables);
    Py_ssize_t n = blocks != NULL ? PyList_GET_SIZE(blocks) : 0;
    if (last > n) {
        last = n;
    }
    if (first < 0) {
        first = 0;
    }
    /* the candidates, as vLLM finds them: the table's items (new refs) */
    Py_ssize_t m = 0, cap = last > first ? last - first : 0;
    PyObject **cand = cap ? PyMem_Malloc(sizeof(PyObject *) * cap) : NULL;
    if (cap && cand == NULL) {
        Py_XDECREF(blocks);
        PyErr_Clear();
        return SLOW();
    }
    for (Py_ssize_t i = last - 1; i >= first; i--) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        PyObject *isnull = PyObject_GetAttr(b, s_is_null);
        int t = isnull == NULL ? -1 : PyObject_IsTrue(isnull);
        Py_XDECREF(isnull);
        if (t != 0) {
            if (t < 0) { /* not vLLM's blocks: the Python hook, whole */
                drop_candidates(cand, m, blocks);
                PyErr_Clear();
                return SLOW();
            }
            break;
        }
        cand[m++] = Py_NewRef(b);
    }
    if (m == 0) { /* nothing to remove */
        PyMem_Free(cand);
        Py_XDECREF(blocks);
        h->calls++;
        return PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    }
    /* the checker of the manager's pool: its journal takes what is removed */
    PyObject *pool = PyObject_GetAttr(args[0], s_block_pool), *ck = NULL, *fast = NULL;
    int found = pool == NULL ? -1 : lookup(rt, pool, &ck, &fast);
    Py_XDECREF(pool);
    Py_XDECREF(fast);
    if (found <= 0) { /* no native table or no checker (or an error): the Python hook */
        drop_candidates(cand, m, blocks);
        PyErr_Clear();
        return SLOW();
    }
    Py_INCREF(rt); /* borrowed from the runtime module, which the call may change */
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) { /* removed: the candidates no longer at their index */
        double t0 = now();
        PyObject *gone = PyList_New(0);
        int ok = gone != NULL;
        for (Py_ssize_t j = 0; ok && j < m; j++) {
            Py_ssize_t i = last - 1 - j;
            if (i < PyList_GET_SIZE(blocks) && PyList_GET_ITEM(blocks, i) != cand[j]) {
                PyObject *id = PyObject_GetAttr(cand[j], s_block_id);
                ok = id != NULL && PyList_Append(gone, id) == 0;
                Py_XDECREF(id);
            }
        }
        if (ok && PyList_GET_SIZE(gone)) {
            PyObject *entry = PyTuple_Pack(2, args[1], gone);
            PyObject *one = entry == NULL ? NULL : PyList_New(1);
            if (one != NULL) {
                PyList_SET_ITEM(one, 0, entry);
                entry = NULL;
                ok = journal_extend(ck, s_dropped, one) == 0;
                Py_DECREF(one);
            } else {
                ok = 0;
            }
            Py_XDECREF(entry);
        }
        Py_XDECREF(gone);
        took_aside(h, rt, now() - t0, 0); /* (a call that removes nothing is not timed) */
        if (!ok && failed(rt, s_remove_blocks) < 0) { /* kvsan's own failure:
            * counted (vLLM's result kept), raised only outside log mode */
            Py_CLEAR(ret);
        }
    }
    drop_candidates(cand, m, blocks);
    Py_DECREF(ck);
    Py_DECREF(rt);
    return ret;
}

/* ---- the worker side (kvsan.hooks.vllm.worker): the V1 runner's step ---- */

/* the truth of ``obj.name`` (a missing attribute counts as false where
 * ``optional``, as getattr(obj, name, None) does): 1, 0, -1 error */
static int
attr_truth(PyObject *obj, PyObject *name, int optional)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL && optional && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return truth_of(v);
}

/* the truth of ``d[key]`` for a dict (``optional``: d.get(key) ... ),
 * -1 with an exception (a missing key that is not optional included) */
static int
item_truth(PyObject *d, PyObject *key, int optional)
{
    PyObject *v = PyDict_GetItemWithError(d, key); /* borrowed */
    if (v == NULL) {
        if (!PyErr_Occurred() && !optional) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return PyErr_Occurred() ? -1 : 0;
    }
    return PyObject_IsTrue(v);
}

/* the checker of ``runner`` from vllm_worker's one-entry cache
 * ``[weak ref to the runner, checker]`` (borrowed), or NULL */
static PyObject *
last_checker(PyObject *last, PyObject *runner)
{
    if (!PyList_CheckExact(last) || PyList_GET_SIZE(last) != 2) {
        return NULL;
    }
    PyObject *ref = PyList_GET_ITEM(last, 0), *dc = PyList_GET_ITEM(last, 1);
    if (!PyWeakref_Check(ref) || PyWeakref_GET_OBJECT(ref) != runner || dc == Py_None) {
        return NULL;
    }
    return dc;
}

/* ---- the scheduler's step (kvsan.hooks.vllm.allocator._schedule) ---- */

/* a new dict: the pool's step journal's lists taken (ck.journal.take()) and the
 * step, in take()'s order, the journal left with new empty lists; NULL
 * with an exception when it could not be read (nothing taken).  Once the
 * dict is made the entries are in it: a failure to reset the journal
 * (its lists are slots) is cleared, and some entries would come twice,
 * none lost. */
static PyObject *
take_payload(PyObject *rt, PyObject *ck)
{
    PyObject *j = pool_journal(ck);
    if (j == NULL) {
        return NULL;
    }
    /* the four lists, the reset flag, the step */
    PyObject *v[6] = {NULL};
    PyObject *const keys[6] = {s_cached, s_uncached, s_freed, s_dropped, s_reset, s_step};
    PyObject *d = NULL;
    for (int i = 0; i < 4; i++) {
        if ((v[i] = journal_get(j, keys[i])) == NULL) {
            goto done;
        }
    }
    if ((v[4] = PyObject_GetAttr(j, s_reset)) == NULL
        || (v[5] = slot_attr(rt, s_step, &sr_step)) == NULL || (d = PyDict_New()) == NULL) {
        goto done;
    }
    for (int i = 0; i < 6; i++) {
        if (PyDict_SetItem(d, keys[i], v[i]) < 0) {
            Py_CLEAR(d);
            goto done;
        }
    }
    for (int i = 0; i < 4; i++) {
        PyObject *fresh = PyList_New(0);
        SlotTable *c = journal_slots(keys[i]);
        int r = fresh == NULL ? -1
                : c != NULL   ? slots_set(c, j, 0, fresh, &keys[i], 1)
                              : PyObject_SetAttr(j, keys[i], fresh);
        Py_XDECREF(fresh);
        if (r < 0) {
            PyErr_Clear();
        }
    }
    if (PyObject_SetAttr(j, s_reset, Py_False) < 0) {
        PyErr_Clear();
    }
done:
    for (int i = 0; i < 6; i++) {
        Py_XDECREF(v[i]);
    }
    Py_DECREF(j);
    return d;
}

/* 1 when the scheduler's step has more to do than its payload: what
 * _schedule_ends does then (blocks cached: the still-cached filter and
 * their token links for the workers; the delayed frees' sweep, a full
 * audit due, the metrics refresh due); 0 not; -1 error */
static int
sched_busy(PyObject *rt, PyObject *ck, PyObject *payload)
{
    int c = item_truth(payload, s_cached, 0);
    if (c != 0) {
        return c;
    }
    int t = attr_truth(ck, s_pending_release, 0);
    if (t != 0) {
        return t;
    }
    PyObject *cfg = PyObject_GetAttr(rt, s_config);
    PyObject *every = cfg == NULL ? NULL : PyObject_GetAttr(cfg, s_audit_every);
    Py_XDECREF(cfg);
    if (every == NULL) {
        return -1;
    }
    t = PyObject_IsTrue(every);
    if (t > 0) { /* due when rt.step % audit_every == 0 (Python's modulo) */
        PyObject *step = PyDict_GetItemWithError(payload, s_step); /* borrowed */
        PyObject *m = step == NULL ? NULL : PyNumber_Remainder(step, every);
        t = m == NULL ? -1 : PyObject_RichCompareBool(m, zero, Py_EQ);
        Py_XDECREF(m);
    }
    Py_DECREF(every);
    if (t != 0) {
        return t;
    }
    PyObject *metrics = PyObject_GetAttr(rt, s_metrics);
    if (metrics == NULL) {
        return -1;
    }
    t = metrics != Py_None;
    Py_DECREF(metrics);
    if (t) { /* time.monotonic() >= rt.metrics_due (the same clock) */
        PyObject *due = PyObject_GetAttr(rt, s_metrics_due);
        double at = due == NULL ? -1.0 : PyFloat_AsDouble(due);
        Py_XDECREF(due);
        if (at == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        t = clock_now() >= at;
    }
    return t;
}

/* 1 when the step goes to _schedule_ends anyway: a step that scheduled
 * no token (``total_num_scheduled_tokens`` 0: the liveness check counts
 * them), or a checker that watches every step (``every_step``: a
 * scheduler with a KV connector, whose new loads are leased); 0 not; -1
 * error */
static int
quiet_or_watched(PyObject *ck, PyObject *ret)
{
    int w = attr_truth(ck, s_every_step, 1);
    if (w != 0) {
        return w;
    }
    PyObject *n = PyObject_GetAttr(ret, s_total_num_scheduled_tokens);
    if (n == NULL) {
        return -1;
    }
    int z = PyLong_CheckExact(n) && PyObject_Not(n) == 1;
    Py_DECREF(n);
    return z;
}

/* K_SCHED: ``Scheduler.schedule()``, as the Python hook's _schedule runs
 * it: the runtime's step moved on before vLLM's method (its allocator
 * events are this step's), then the step journal taken into the
 * SchedulerOutput's ``kvsan`` payload for the workers.  A step with more
 * to do (see sched_busy) hands the payload to ``h->post(rt, scheduler,
 * result, payload)`` (_schedule_ends), as does a payload it could not
 * make or set (then None: Python takes the journal).  ``h->state`` is set
 * by that Python half: (weak ref to the runtime, weak ref to the
 * scheduler, its pool's checker); another runtime or scheduler, or
 * arguments vLLM 0.32 does not pass (it passes one, positionally: whether
 * to throttle prefills), go to the Python hook whole. */
static PyObject *
sched_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *st = h->state;
    if (nargs > 2 || kwnames != NULL /* (self[, throttle_prefills]) */
        || !state_for(st, rt, args[0])) {
        return SLOW();
    }
    double t0 = now();
    PyObject *step = slot_attr(rt, s_step, &sr_step);
    PyObject *next = step == NULL ? NULL : PyNumber_Add(step, one);
    Py_XDECREF(step);
    if (next == NULL || slots_set(&sr_step, rt, 0, next, &s_step, 1) < 0) {
        Py_XDECREF(next);
        PyErr_Clear(); /* nothing changed: the Python hook's */
        return SLOW();
    }
    Py_DECREF(next);
    Py_INCREF(rt);
    PyObject *ck = Py_NewRef(PyTuple_GET_ITEM(st, 2)), *sched = Py_NewRef(args[0]);
    double own = now() - t0;
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) {
        t0 = now();
        PyObject *payload = take_payload(rt, ck);
        int rest = payload == NULL ? -1 : sched_busy(rt, ck, payload);
        if (rest == 0) {
            rest = quiet_or_watched(ck, ret);
        }
        if (rest == 0 && PyObject_SetAttr(ret, s_kvsan, payload) < 0) {
            rest = -1;
        }
        if (rest < 0) {
            PyErr_Clear(); /* the Python half meets (and reports) the same */
        }
        own += now() - t0;
        if (rest) {
            PyObject *argv[4] = {rt, sched, ret, payload != NULL ? payload : Py_None};
            post(h, argv, 4, &ret);
        }
        Py_XDECREF(payload);
    }
    took_aside(h, rt, own, 0);
    Py_DECREF(sched);
    Py_DECREF(ck);
    Py_DECREF(rt);
    return ret;
}

/* K_ADMIT: ``Scheduler.add_request(request)``; K_HELD:
 * ``Scheduler._connector_finished(request)``, which vLLM calls for every
 * request that ends and which returns ``(delay_free, params)``.  vLLM's
 * method runs; the Python second half is due only when there is something
 * to do: ADMIT when the runtime is not ``busy`` yet (the scheduler at rest
 * takes a request: ``h->post(rt, scheduler, request)``), HELD when the result is
 * not a tuple whose first item is False (a free the connector delays:
 * ``h->post(rt, scheduler, request, result)``).  Any other shape of call
 * goes to the Python hook whole (the one-positional-argument call is the
 * one vLLM 0.32 makes).  Most calls: one attribute read or a tuple look.
 * K_ADMIT_ALL: ``add_request`` posting after every call, as
 * ``h->post(rt, scheduler, request)`` (production mode samples each
 * admission). */
static PyObject *
after_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL) {
        return SLOW();
    }
    Py_INCREF(rt);
    PyObject *self = Py_NewRef(args[0]), *request = Py_NewRef(args[1]);
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) {
        if (h->kind == K_ADMIT || h->kind == K_ADMIT_ALL) {
            /* every call (ADMIT_ALL), not busy, or unreadable (Python meets and
             * guards the same): posted */
            int busy = h->kind == K_ADMIT_ALL ? 0 : attr_truth(rt, s_busy, 0);
            if (busy <= 0) {
                PyErr_Clear();
                PyObject *argv[3] = {rt, self, request};
                post(h, argv, 3, &ret);
            }
        } else {
            int kept = !(PyTuple_CheckExact(ret) && PyTuple_GET_SIZE(ret) > 0
                         && PyTuple_GET_ITEM(ret, 0) == Py_False);
            if (kept) {
                PyObject *argv[4] = {rt, self, request, ret};
                post(h, argv, 4, &ret);
            }
        }
    }
    Py_DECREF(request);
    Py_DECREF(self);
    Py_DECREF(rt);
    return ret;
}

/* K_UPDATE: ``Scheduler.update_from_output(scheduler_output,
 * model_runner_output)``, after vLLM's method ran.  What the Python hook's
 * _update_from_output checks after it (``h->post(rt, scheduler, result)``,
 * _update_ends) is due only when delayed frees are pending (the checker's
 * ``pending_release``), when the scheduler has no request left and the idle
 * audit has not run yet, or when it has requests again after one (the
 * runtime's ``idle_audited``); any other step ends here.  ``h->state`` is
 * the SCHED hook's: (weak ref to the runtime, weak ref to the scheduler,
 * its pool's checker), set with it; other calls go to the Python hook
 * whole (vLLM 0.32 passes both arguments positionally). */
static PyObject *
update_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *st = h->state;
    if (nargs != 3 || kwnames != NULL || !state_for(st, rt, args[0])) {
        return SLOW();
    }
    Py_INCREF(rt);
    PyObject *ck = Py_NewRef(PyTuple_GET_ITEM(st, 2)), *sched = Py_NewRef(args[0]);
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) {
        double t0 = now();
        int rest = attr_truth(ck, s_pending_release, 0);
        if (rest == 0) {
            int busy = attr_truth(sched, s_requests, 0);
            int audited = busy < 0 ? -1 : attr_truth(rt, s_idle_audited, 0);
            /* idle and not audited yet, or busy again after an audit */
            rest = audited < 0 ? -1 : busy == audited;
        }
        if (rest < 0) {
            PyErr_Clear(); /* the Python half meets (and guards) the same */
        }
        double own = now() - t0;
        if (rest) {
            PyObject *argv[3] = {rt, sched, ret};
            post(h, argv, 3, &ret);
        }
        took_aside(h, rt, own, 0);
    }
    Py_DECREF(sched);
    Py_DECREF(ck);
    Py_DECREF(rt);
    return ret;
}

/* A quiet step begun as kvsan.hooks.vllm.worker.begin_step begins it: the
 * scheduler's output hands the worker view nothing to apply but blocks it
 * cached (no request finished, preempted, new or resumed, no new block, no
 * copy, nothing uncached or dropped, nothing to poison) and no prefix hit
 * is pending.  The blocks it cached go to the checker's ``will_seal``, as
 * there (most steps of a prompt's last chunk).  1 begun (rt.step and the
 * checker's sampling tick set), 2 begun but for the step's checksums: a
 * sampled batch is due, which the caller runs (``verify_step``, which sets
 * the tick), 0 not quiet (nothing changed), -1 error (nothing changed but
 * the checker's ``pending_seal``, whose entries ``will_seal`` sets again).
 * The conditions are all read before anything is set. */
static int
quiet_begin(PyObject *rt, PyObject *dc, PyObject *so)
{
    int r = -1;
    PyObject *payload = NULL, *cr = NULL, *news = NULL, *checksum = NULL, *tick = NULL,
             *batch = NULL, *newtick = NULL, *step = NULL;
    payload = PyObject_GetAttr(so, s_kvsan);
    if (payload == NULL || !PyDict_CheckExact(payload)) {
        PyErr_Clear(); /* no payload (the Python hook counts steps itself) */
        r = 0;
        goto done;
    }
    /* (held across the reads below, which may run Python code) */
    step = Py_XNewRef(PyDict_GetItemWithError(payload, s_step));
    if (step == NULL || !PyLong_CheckExact(step)) {
        r = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    /* what the scheduler sent: each test as begin_step makes it */
    struct { PyObject *obj; PyObject *name; int optional; int dict; } busy[] = {
        {so, s_finished_req_ids, 0, 0},  {so, s_preempted_req_ids, 1, 0},
        {payload, s_reset, 0, 1},        {payload, s_uncached, 0, 1},
        {payload, s_dropped, 1, 1},      {so, s_scheduled_new_reqs, 0, 0},
        {so, s_kv_cache_block_copies, 1, 0},
    };
    for (size_t i = 0; i < sizeof(busy) / sizeof(busy[0]); i++) {
        int t = busy[i].dict ? item_truth(busy[i].obj, busy[i].name, busy[i].optional)
                             : attr_truth(busy[i].obj, busy[i].name, busy[i].optional);
        if (t != 0) {
            r = t < 0 ? -1 : 0;
            goto done;
        }
    }
    for (int i = D_STEP_HITS; i <= D_PENDING_SUMS; i++) { /* the checker's own */
        int t = dc_truth(dc, i);
        if (t != 0) {
            r = t < 0 ? -1 : 0;
            goto done;
        }
    }
    if ((cr = PyObject_GetAttr(so, s_scheduled_cached_reqs)) == NULL) {
        goto done;
    }
    int t = attr_truth(cr, s_resumed_req_ids, 0);
    if (t != 0) {
        r = t < 0 ? -1 : 0;
        goto done;
    }
    if ((news = PyObject_GetAttr(cr, s_new_block_ids)) == NULL) {
        goto done;
    }
    if (!PyList_CheckExact(news)) {
        r = 0;
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(news); i++) {
        if (PyList_GET_ITEM(news, i) != Py_None) {
            r = 0; /* a running request has a new block */
            goto done;
        }
    }
    t = dc_truth(dc, D_POISON_ON);
    if (t != 0) {
        if (t < 0 || (t = item_truth(payload, s_freed, 0)) != 0) {
            r = t < 0 ? -1 : 0; /* blocks to poison */
            goto done;
        }
    }
    /* verify_step: nothing to verify (no hit), unless a sampled batch is
     * due (2) or every block is verified every step ("all": not quiet) */
    int due = 0;
    if ((checksum = dc_get(dc, D_CHECKSUM)) == NULL) {
        goto done;
    }
    if (!PyUnicode_Check(checksum)) {
        r = 0;
        goto done;
    }
    int off = PyUnicode_CompareWithASCIIString(checksum, "off") == 0;
    int sums = off ? 0 : dc_truth(dc, D_SUMS);
    if (sums < 0) {
        goto done;
    }
    if (sums) {
        if (PyUnicode_CompareWithASCIIString(checksum, "all") == 0) {
            r = 0;
            goto done;
        }
        if ((tick = dc_get(dc, D_TICK)) == NULL
            || (batch = PyObject_GetAttr(dc, s_SAMPLE_BATCH_STEPS)) == NULL) {
            goto done;
        }
        long long k = PyLong_CheckExact(tick) ? PyLong_AsLongLong(tick) : -1;
        long long every = PyLong_CheckExact(batch) ? PyLong_AsLongLong(batch) : -1;
        if (k < 0 || every <= 0) {
            r = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        due = (k + 1) % every == 0; /* (then verify_step moves the tick) */
        if (!due && (newtick = PyLong_FromLongLong(k + 1)) == NULL) {
            goto done;
        }
    }
    /* begun: the blocks cached first (the only call that may fail part way:
     * repeated, it sets the same), then the step (set again, to the same, if
     * the tick fails) */
    PyObject *cached = PyDict_GetItemWithError(payload, s_cached); /* borrowed */
    if (cached == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, s_cached);
        }
        goto done;
    }
    t = PyObject_IsTrue(cached);
    if (t < 0) {
        goto done;
    }
    if (t) { /* with their token links, where the scheduler sent them */
        PyObject *links = PyDict_GetItemWithError(payload, s_links); /* borrowed */
        if (links == NULL && PyErr_Occurred()) {
            goto done;
        }
        Py_XINCREF(links);
        PyObject *argv[3] = {dc, cached, links};
        PyObject *got = PyObject_VectorcallMethod(
            s_will_seal, argv, (links != NULL ? 3 : 2) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(links);
        if (got == NULL) {
            goto done;
        }
        Py_DECREF(got);
    }
    if (PyObject_SetAttr(rt, s_step, step) < 0
        || (newtick != NULL
            && slots_set(&sr_dc[D_TICK], dc, 0, newtick, dc_names[D_TICK], 1) < 0)) {
        goto done;
    }
    r = due ? 2 : 1;
done:
    Py_XDECREF(payload);
    Py_XDECREF(cr);
    Py_XDECREF(news);
    Py_XDECREF(checksum);
    Py_XDECREF(tick);
    Py_XDECREF(batch);
    Py_XDECREF(newtick);
    Py_XDECREF(step);
    return r;
}

static int batch_reqs(PyObject *batch, PyObject **n, PyObject **rids);

/* After a quiet step's forward: whether the runner's batch holds other
 * requests, or the same in another order, than at the checker's last
 * block-table row check (``_row_order``), where the checker checks rows
 * (``rows_on``).  A quiet step changes nothing in the worker view, but the
 * runner still moves rows on its own: a running request the scheduler
 * left out of the step (its token budget spent) leaves the batch, the
 * rows after it are condensed, and it is added back from the runner's
 * state when it is scheduled again.  Those rows go to the Python half's
 * row check (DeviceChecker.check_rows), as every step the Python hook
 * begins does.  1 moved, 0 not, -1 error. */
static int
rows_moved(PyObject *dc, PyObject *runner)
{
    int r = dc_truth(dc, D_ROWS_ON);
    if (r <= 0) {
        return r;
    }
    r = -1;
    PyObject *order = dc_get(dc, D_ROW_ORDER), *batch = NULL, *n = NULL, *rids = NULL;
    if (order == NULL || (batch = PyObject_GetAttr(runner, s_input_batch)) == NULL
        || batch_reqs(batch, &n, &rids) < 0) {
        goto done;
    }
    Py_ssize_t k = PyLong_AsSsize_t(n);
    if (k == -1 && PyErr_Occurred()) {
        goto done;
    }
    if (!PyList_Check(order) || !PyList_Check(rids) || PyList_GET_SIZE(rids) < k
        || PyList_GET_SIZE(order) != k) {
        r = 1; /* (the Python half reads them as they are) */
        goto done;
    }
    r = 0;
    for (Py_ssize_t i = 0; i < k && r == 0; i++) {
        PyObject *a = PyList_GET_ITEM(rids, i), *b = PyList_GET_ITEM(order, i);
        if (a != b) {
            int eq = PyObject_RichCompareBool(a, b, Py_EQ);
            r = eq < 0 ? -1 : !eq;
        }
    }
done:
    Py_XDECREF(order);
    Py_XDECREF(batch);
    Py_XDECREF(n);
    Py_XDECREF(rids);
    return r;
}

/* K_STEP: the V1 runner's ``execute_model(scheduler_output,
 * intermediate_tensors=None)``.  The runner's previous step, if it was
 * left unsealed, is sealed first (``seal_left(rt, runner)``, as the Python
 * hook does).  A quiet step (see quiet_begin: most decode steps) is then
 * begun here, without the Python hook's frames, its sampled checksums (when
 * a batch is due) through ``scrub(rt, runner, checker)``; vLLM's method
 * runs; what follows it (a seal, a deferred guard) goes to ``h->post(rt,
 * runner, checker, result)`` when the checker has any, or when the
 * runner moved its batch's rows (rows_moved).  Any other step --
 * a busy one, the runner's first, another runtime, a failure of ours --
 * goes to the Python hook whole, before vLLM's method runs.  ``h->state``
 * is set by the Python hook once it began a step: (weak ref to the
 * runtime, vllm_worker's one-entry checker cache [weak ref to the runner,
 * checker], its dict of unsealed steps, seal_left, scrub).  seal_left and
 * scrub guard themselves (counted in log mode); they fail only with a
 * violation raised, which propagates before vLLM's method runs, as it
 * does from the Python hook. */
static PyObject *
step_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *st = h->state;
    if (nargs < 2 || nargs > 3 || kwnames != NULL || !state_for(st, rt, NULL)) {
        return SLOW();
    }
    if (PyDict_GET_SIZE(PyTuple_GET_ITEM(st, 2)) != 0) { /* a step left unsealed */
        Py_INCREF(st); /* (the call may replace it) */
        Py_INCREF(rt);
        PyObject *argv[2] = {rt, args[0]};
        PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 3), argv, 2, NULL);
        /* what the call may have changed: another runner's step still
         * unsealed, the state, the running kvsan (read while rt is held) */
        int left = PyDict_GET_SIZE(PyTuple_GET_ITEM(st, 2)) != 0;
        int same = h->state == st;
        Py_DECREF(st);
        if (r == NULL) {
            Py_DECREF(rt);
            return NULL; /* a violation raised (raise / abort mode) */
        }
        Py_DECREF(r);
        PyObject *still = running();
        if (still == NULL) {
            PyErr_Clear();
        }
        if (left || !same || still != rt) {
            PyObject *ret = SLOW();
            Py_DECREF(rt);
            return ret;
        }
        Py_DECREF(rt); /* (still held by the runtime module) */
    }
    PyObject *dc = last_checker(PyTuple_GET_ITEM(st, 1), args[0]);
    if (dc == NULL) {
        return SLOW();
    }
    Py_INCREF(rt);
    Py_INCREF(dc);
    Py_INCREF(st);
    PyObject *runner = Py_NewRef(args[0]);
    double t0 = now();
    int q = quiet_begin(rt, dc, args[1]);
    if (q <= 0) {
        PyErr_Clear(); /* the Python hook meets (and guards) the same */
        PyObject *ret = SLOW();
        Py_DECREF(runner);
        Py_DECREF(st);
        Py_DECREF(dc);
        Py_DECREF(rt);
        return ret;
    }
    double own = now() - t0; /* (filed once, with the second half's) */
    PyObject *ret = NULL;
    if (q == 2) { /* the step's sampled checksums */
        PyObject *argv[3] = {rt, runner, dc};
        PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(st, 4), argv, 3, NULL);
        if (r == NULL) {
            goto filed; /* a violation raised (raise / abort mode) */
        }
        Py_DECREF(r);
    }
    ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret != NULL) {
        t0 = now();
        int rest = dc_truth(dc, D_PENDING_SEAL);
        if (rest == 0) {
            rest = dc_truth(dc, D_PENDING_SUMS);
        }
        if (rest == 0) {
            PyObject *g = dc_get(dc, D_PENDING_GUARD);
            rest = g == NULL ? -1 : g != Py_None;
            Py_XDECREF(g);
        }
        if (rest == 0) {
            rest = rows_moved(dc, runner);
        }
        if (rest < 0) {
            PyErr_Clear(); /* the Python half reads them again */
        }
        own += now() - t0;
        if (rest) {
            PyObject *argv[4] = {rt, runner, dc, ret};
            post(h, argv, 4, &ret);
        }
    }
filed:
    took_aside(h, rt, own, 1);
    Py_DECREF(runner);
    Py_DECREF(st);
    Py_DECREF(dc);
    Py_DECREF(rt);
    return ret;
}

/* The V1 input batch's ``num_reqs`` and ``req_ids`` (new references in
 * ``n`` and ``rids``; -1 with an exception).  Both are properties, three
 * Python frames a step between forward passes (``req_ids`` calls
 * ``typing.cast``), so what they return is read here where the batch has
 * it as vLLM 0.32 keeps it: ``len(req_id_to_index)`` (a dict) and the list
 * ``_req_ids``; else through the properties. */
static int
batch_reqs(PyObject *batch, PyObject **n, PyObject **rids)
{
    PyObject *index = PyObject_GetAttr(batch, s_req_id_to_index);
    PyObject *ids = index == NULL ? NULL : PyObject_GetAttr(batch, s__req_ids);
    if (ids != NULL && PyDict_CheckExact(index) && PyList_CheckExact(ids)) {
        *n = PyLong_FromSsize_t(PyDict_GET_SIZE(index));
        Py_DECREF(index);
        if (*n == NULL) {
            Py_DECREF(ids);
            return -1;
        }
        *rids = ids;
        return 0;
    }
    PyErr_Clear();
    Py_XDECREF(index);
    Py_XDECREF(ids);
    if ((*n = PyObject_GetAttr(batch, s_num_reqs)) == NULL) {
        return -1;
    }
    if ((*rids = PyObject_GetAttr(batch, s_req_ids)) == NULL) {
        Py_CLEAR(*n);
        return -1;
    }
    return 0;
}

/* K_GUARD: the V1 runner's ``_prepare_inputs(scheduler_output,
 * num_scheduled_tokens)``, after vLLM's method ran: the step's write
 * guard on the slot mapping it filled, through kvsan._native._devicefast's
 * guard_step (the common step in one call).  ``h->post(rt, runner,
 * num_scheduled_tokens, got)`` does the rest in Python: ``got`` False,
 * nothing was done here (no checker in the cache, a layout of another
 * vLLM: the Python hook's whole guard); None, guard_step declined the
 * step (DeviceChecker.guard); a list, the step guarded: the writes it
 * found and any prefix hit it found unwritten (left in the checker's
 * ``step_hits``), to report.
 * ``h->state``: (weak ref to the runtime, vllm_worker's one-entry checker
 * cache, guard_step). */
static PyObject *
guard_call(Hook *h, PyObject *rt, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *st = h->state;
    if (nargs != 3 || kwnames != NULL || !state_for(st, rt, NULL)) {
        return SLOW();
    }
    Py_INCREF(rt);
    Py_INCREF(st); /* the call may replace it */
    PyObject *runner = Py_NewRef(args[0]), *counts = Py_NewRef(args[2]);
    PyObject *ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    if (ret == NULL) {
        goto out;
    }
    double t0 = now();
    PyObject *got = NULL; /* for the Python half; NULL: nothing to do there */
    int own_failure = 0;
    PyObject *dc = Py_XNewRef(last_checker(PyTuple_GET_ITEM(st, 1), runner));
    PyObject *batch = NULL, *n = NULL, *bt = NULL, *tables = NULL, *table = NULL, *sm = NULL,
             *slots = NULL, *rids = NULL, *fast = NULL;
    if (dc == NULL
        || (batch = PyObject_GetAttr(runner, s_input_batch)) == NULL
        || batch_reqs(batch, &n, &rids) < 0
        || (bt = PyObject_GetAttr(batch, s_block_table)) == NULL
        || (tables = PyObject_GetAttr(bt, s_block_tables)) == NULL
        || (table = PySequence_GetItem(tables, 0)) == NULL
        || (sm = PyObject_GetAttr(table, s_slot_mapping)) == NULL
        || (slots = PyObject_GetAttr(sm, s_gpu)) == NULL
        || (fast = dc_get(dc, D_FAST)) == NULL || fast == Py_None) {
        PyErr_Clear(); /* the Python half meets (and guards) the same */
        got = Py_NewRef(Py_False);
    } else {
        PyObject *argv[6] = {fast, dc, slots, rids, n, counts};
        got = PyObject_VectorcallMethod(s_guard_step, argv, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                        NULL);
        if (got == NULL) {
            own_failure = 1; /* kvsan's own, in the guard: guarded below */
        } else if (got != Py_None && PyList_CheckExact(got) && PyList_GET_SIZE(got) == 0) {
            /* clean, unless a prefix hit was found unwritten (left for
             * Python to report) */
            int hits = dc_truth(dc, D_STEP_HITS);
            if (hits < 0) {
                PyErr_Clear(); /* (the Python half reads it again) */
            }
            if (hits == 0) {
                Py_CLEAR(got);
            }
        }
    }
    took_aside(h, rt, now() - t0, 1);
    if (own_failure) {
        if (failed(rt, s_guard_where) < 0) {
            Py_CLEAR(ret);
        }
    } else if (got != NULL) {
        PyObject *argv[4] = {rt, runner, counts, got};
        post(h, argv, 4, &ret);
    }
    Py_XDECREF(got);
    Py_XDECREF(dc);
    Py_XDECREF(batch);
    Py_XDECREF(n);
    Py_XDECREF(bt);
    Py_XDECREF(tables);
    Py_XDECREF(table);
    Py_XDECREF(sm);
    Py_XDECREF(slots);
    Py_XDECREF(rids);
    Py_XDECREF(fast);
out:
    Py_DECREF(counts);
    Py_DECREF(runner);
    Py_DECREF(st);
    Py_DECREF(rt);
    return ret;
}

static PyObject *
hook_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hook *h = (Hook *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *rt = running(); /* borrowed */
    if (rt == NULL) {
        return NULL;
    }
    if (rt == Py_None) { /* kvsan is not running: vLLM's method alone */
        return PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    }
    if (!enabled || nargs < 1) {
        return SLOW();
    }
    if (h->kind > K_CACHE) { /* the kinds with routes of their own (the BlockPool four first) */
        switch (h->kind) {
        case K_HITS:
            return hits_call(h, rt, args, nargsf, kwnames);
        case K_END:
        case K_PREEMPT: {
            PyObject *request = arg(args, nargs, kwnames, 1, s_request); /* borrowed */
            return request == NULL ? SLOW()
                                   : ended_call(h, rt, args, nargsf, kwnames, request);
        }
        case K_FINISH:
            return ended_call(h, rt, args, nargsf, kwnames, NULL);
        case K_SKIP:
            return skip_call(h, rt, args, nargsf, kwnames);
        case K_STEP:
            return step_call(h, rt, args, nargsf, kwnames);
        case K_GUARD:
            return guard_call(h, rt, args, nargsf, kwnames);
        case K_SCHED:
            return sched_call(h, rt, args, nargsf, kwnames);
        case K_UPDATE:
            return update_call(h, rt, args, nargsf, kwnames);
        case K_ADMIT:
        case K_ADMIT_ALL:
        case K_HELD:
            return after_call(h, rt, args, nargsf, kwnames);
        default:
            return SLOW();
        }
    }
    /* which calls this route takes: the shapes vLLM 0.32 makes */
    PyObject *blocks = NULL, *lo = NULL, *hi = NULL, *request = NULL;
    switch (h->kind) {
    case K_ALLOCATE: /* get_new_blocks(num_blocks) */
        if (nargs != 2 || kwnames != NULL) {
            return SLOW();
        }
        break;
    case K_TOUCH: /* touch(blocks): a list (anything else is materialised in Python) */
        if (nargs != 2 || kwnames != NULL || !PyList_CheckExact(args[1])) {
            return SLOW();
        }
        blocks = args[1];
        break;
    case K_RELEASE: /* free_blocks(ordered_blocks), often a one-shot reversed() */
        if (nargs != 2 || kwnames != NULL) {
            return SLOW();
        }
        break;
    case K_CACHE: /* cache_full_blocks(request, blocks, num_cached, num_full, ...) */
        request = arg(args, nargs, kwnames, 1, s_request);
        blocks = arg(args, nargs, kwnames, 2, s_blocks);
        lo = arg(args, nargs, kwnames, 3, s_num_cached);
        hi = arg(args, nargs, kwnames, 4, s_num_full);
        if (request == NULL || blocks == NULL || lo == NULL || hi == NULL
            || !PyList_CheckExact(blocks)) {
            return SLOW();
        }
        break;
    default:
        return SLOW();
    }
    PyObject *pool = args[0];
    Py_INCREF(rt);
    PyObject *ck = NULL, *fast = NULL;
    int got = lookup(rt, pool, &ck, &fast);
    if (got <= 0) {
        PyErr_Clear(); /* the Python route meets (and guards) the same */
        PyObject *r = SLOW();
        Py_DECREF(rt);
        return r;
    }

    PyObject *ret = NULL, *list = NULL, *snap = NULL, *site = NULL, *owner = NULL;
    PyObject *sliced = NULL;
    int timed = h->tick++ % TIME_EVERY == 0; /* this call's time is filed (see TIME_EVERY) */
    /* RELEASE's snapshot: from _shadowfast's C function an array (``snap``
     * is then True until a Python method needs it as a list), else a list */
    long long snap_stack[SNAP_ON_STACK], *csnap = NULL;
    Py_ssize_t csnap_n = 0; /* its entries: the list's length when it was taken */
    if (h->kind == K_RELEASE) {
        /* read once, as the Python hook does (list(args[0])), and pass the list on */
        list = PySequence_List(args[1]);
        if (list == NULL) {
            goto done; /* list() raised: so would the Python hook, before vLLM ran */
        }
        double t0 = timed ? now() : 0.0;
        Py_ssize_t k = PyList_GET_SIZE(list);
        if (sapi != NULL && Py_TYPE(fast) == sapi->table_type
            && (csnap = k <= SNAP_ON_STACK ? snap_stack
                                           : PyMem_Malloc((size_t)k * sizeof(long long)))
                   != NULL) {
            csnap_n = k;
            int r = sapi->snapshot(fast, list, pool, csnap);
            snap = r > 0 ? Py_NewRef(Py_True) : r == 0 ? Py_NewRef(Py_None) : NULL;
        } else {
            PyObject *argv[3] = {fast, list, pool};
            snap = PyObject_VectorcallMethod(s_snapshot, argv,
                                             3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        if (snap == NULL) {
            PyErr_Clear(); /* the Python route meets (and guards) the same */
        }
        if (timed) {
            double dt = (now() - t0) * TIME_EVERY;
            h->seconds += dt;
            if (add_overhead(rt, dt) < 0) {
                PyErr_Clear();
            }
        }
        if (snap == NULL || snap == Py_None) { /* the Python route, on the list */
            PyObject *argv2[2] = {pool, list};
            ret = slow_call(h, rt, argv2, 2, NULL);
            goto done;
        }
        PyObject *argv2[2] = {pool, list};
        ret = PyObject_Vectorcall(h->original, argv2, 2, NULL);
        blocks = list;
    } else {
        ret = PyObject_Vectorcall(h->original, args, nargsf, kwnames);
    }
    if (ret == NULL) {
        goto done;
    }

    double t0 = timed ? now() : 0.0;
    if (context(rt, &site, &owner) < 0) {
        goto fail;
    }
    int clean = 0;
    switch (h->kind) {
    case K_ALLOCATE:
        blocks = ret;
        if (owner != Py_None && PyList_CheckExact(ret)) {
            clean = apply_event(K_ALLOCATE, ck, fast, rt, ret, NULL, NULL, 0, owner, site);
        }
        break;
    case K_TOUCH:
    case K_RELEASE:
        if (owner != Py_None) {
            clean = apply_event(h->kind, ck, fast, rt, blocks, &snap, csnap, csnap_n, owner,
                                    site);
        }
        break;
    case K_CACHE: {
        PyObject *slice = PySlice_New(lo, hi, NULL);
        if (slice == NULL) {
            goto fail;
        }
        sliced = PyObject_GetItem(blocks, slice); /* blocks[lo:hi], Python's semantics */
        Py_DECREF(slice);
        if (sliced == NULL) {
            goto fail;
        }
        if (PyList_CheckExact(sliced)) {
            clean = apply_event(K_CACHE, ck, fast, rt, sliced, NULL, NULL, 0, NULL, NULL);
        }
        break;
    }
    }
    if (clean < 0) {
        goto fail;
    }
    h->calls++;
    if (timed) {
        double dt = (now() - t0) * TIME_EVERY;
        h->seconds += dt;
        if (add_overhead(rt, dt) < 0) {
            goto fail;
        }
    }
    if (!clean) { /* the Python hook's second half, with the context read here */
        PyObject *r;
        if (h->kind == K_RELEASE) {
            if (snap_as_list(&snap, csnap, csnap_n) < 0) {
                goto fail;
            }
            PyObject *argv[7] = {rt, ck, pool, blocks, snap, site, owner};
            r = PyObject_Vectorcall(h->post, argv, 7, NULL);
        } else if (h->kind == K_CACHE) {
            PyObject *argv[3] = {rt, ck, sliced};
            r = PyObject_Vectorcall(h->post, argv, 3, NULL);
        } else {
            PyObject *argv[5] = {rt, ck, blocks, site, owner};
            r = PyObject_Vectorcall(h->post, argv, 5, NULL);
        }
        if (r == NULL) { /* a violation raised (raise/abort mode): as the Python hook */
            Py_CLEAR(ret);
            goto done;
        }
        Py_DECREF(r);
    }
    goto observe;

fail: /* kvsan's own failure in the clean route: guarded */
    if (failed(rt, h->where) < 0) {
        Py_CLEAR(ret);
        goto done;
    }
observe:
    if (h->kind == K_CACHE && h->observer != Py_None) {
        PyObject *argv[6] = {rt, pool, request, blocks, lo, hi};
        ret = observe(h, rt, ret, argv);
    }
done:
    Py_XDECREF(sliced);
    Py_XDECREF(site);
    Py_XDECREF(owner);
    Py_XDECREF(snap);
    if (csnap != NULL && csnap != snap_stack) {
        PyMem_Free(csnap);
    }
    Py_XDECREF(list);
    Py_DECREF(ck);
    Py_DECREF(fast);
    Py_DECREF(rt);
    return ret;
}

/* ---- the Hook type: a method descriptor, so ``pool.touch(blocks)`` calls it
 * with the pool first and no bound-method object, as for a Python function */

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *names[] = {"kind", "original", "slow", "post", "where", NULL};
    int kind;
    PyObject *original, *slow, *post, *where;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOU", names, &kind, &original, &slow, &post,
                                     &where)) {
        return NULL;
    }
    if (kind < 0 || kind >= K_N || !PyCallable_Check(original) || !PyCallable_Check(slow)
        || !PyCallable_Check(post)) {
        PyErr_Format(PyExc_ValueError,
                     "Hook(kind 0-%d, original, slow, post: callables, where: str)", K_N - 1);
        return NULL;
    }
    Hook *h = (Hook *)type->tp_alloc(type, 0);
    if (h == NULL) {
        return NULL;
    }
    h->kind = kind;
    h->original = Py_NewRef(original);
    h->slow = Py_NewRef(slow);
    h->post = Py_NewRef(post);
    h->where = Py_NewRef(where);
    h->observer = Py_NewRef(Py_None);
    h->identity = Py_NewRef(Py_None);
    h->state = Py_NewRef(Py_None);
    h->vectorcall = hook_vectorcall;
    return (PyObject *)h;
}

static int
hook_traverse(Hook *h, visitproc visit, void *arg)
{
    Py_VISIT(h->original);
    Py_VISIT(h->slow);
    Py_VISIT(h->post);
    Py_VISIT(h->observer);
    Py_VISIT(h->identity);
    Py_VISIT(h->state);
    Py_VISIT(h->dict);
    return 0;
}

static int
hook_clear(Hook *h)
{
    Py_CLEAR(h->original);
    Py_CLEAR(h->slow);
    Py_CLEAR(h->post);
    Py_CLEAR(h->observer);
    Py_CLEAR(h->identity);
    Py_CLEAR(h->state);
    Py_CLEAR(h->dict);
    return 0;
}

static void
hook_dealloc(Hook *h)
{
    PyObject_GC_UnTrack(h);
    hook_clear(h);
    Py_CLEAR(h->where);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *
hook_descr_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static PyObject *
hook_get_observer(Hook *h, void *Py_UNUSED(closure))
{
    return Py_NewRef(h->observer);
}

static int
hook_set_observer(Hook *h, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        value = Py_None;
    }
    if (value != Py_None && !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "observer: a callable or None");
        return -1;
    }
    Py_XSETREF(h->observer, Py_NewRef(value));
    return 0;
}

static PyObject *
hook_get_identity(Hook *h, void *Py_UNUSED(closure))
{
    return Py_NewRef(h->identity);
}

static int
hook_set_identity(Hook *h, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        value = Py_None;
    }
    Py_ssize_t want = h->kind == K_HITS ? 11 : 9;
    if (value != Py_None && !(PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == want)) {
        PyErr_Format(PyExc_TypeError, "identity: a tuple of %zd or None", want);
        return -1;
    }
    Py_XSETREF(h->identity, Py_NewRef(value));
    return 0;
}

static PyObject *
hook_get_state(Hook *h, void *Py_UNUSED(closure))
{
    return Py_NewRef(h->state);
}

static int
hook_set_state(Hook *h, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        value = Py_None;
    }
    int ok = value == Py_None;
    if (!ok && (h->kind == K_END || h->kind == K_PREEMPT || h->kind == K_FINISH)
        && PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == 9) {
        ok = PyWeakref_Check(PyTuple_GET_ITEM(value, 0))
             && PyWeakref_Check(PyTuple_GET_ITEM(value, 1));
        for (int i = 2; i < 6; i++) {
            PyObject *o = PyTuple_GET_ITEM(value, i);
            /* the shadow's held owners (3): any container end_clean can ask */
            ok &= i == 3 ? Py_TYPE(o)->tp_as_sequence != NULL
                               && Py_TYPE(o)->tp_as_sequence->sq_contains != NULL
                         : PyDict_CheckExact(o);
        }
        ok &= PyLong_CheckExact(PyTuple_GET_ITEM(value, 6))
              && PyTuple_CheckExact(PyTuple_GET_ITEM(value, 7))
              && PyDict_Check(PyTuple_GET_ITEM(value, 8)); /* (a Counter) */
    }
    if (!ok && (h->kind == K_SCHED || h->kind == K_UPDATE) && PyTuple_CheckExact(value)
        && PyTuple_GET_SIZE(value) == 3) {
        ok = PyWeakref_Check(PyTuple_GET_ITEM(value, 0))
             && PyWeakref_Check(PyTuple_GET_ITEM(value, 1));
    }
    if (!ok && (h->kind == K_STEP || h->kind == K_GUARD) && PyTuple_CheckExact(value)
        && PyTuple_GET_SIZE(value) == (h->kind == K_STEP ? 5 : 3)) {
        PyObject *third = PyTuple_GET_ITEM(value, 2);
        ok = PyWeakref_Check(PyTuple_GET_ITEM(value, 0))
             && PyList_CheckExact(PyTuple_GET_ITEM(value, 1))
             && (h->kind == K_STEP ? PyDict_CheckExact(third) && PyCallable_Check(
                                         PyTuple_GET_ITEM(value, 3))
                                         && PyCallable_Check(PyTuple_GET_ITEM(value, 4))
                                   : third == Py_None);
    }
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "state: None; for an END, PREEMPT or FINISH hook (weak ref, weak "
                        "ref, dict, held owners (a container), dict, dict, int, tuple, dict); "
                        "for a STEP hook (weak ref, "
                        "list, dict, callable, callable); for a GUARD hook (weak ref, list, "
                        "None); for a SCHED or UPDATE hook (weak ref, weak ref, checker)");
        return -1;
    }
    Py_XSETREF(h->state, Py_NewRef(value));
    return 0;
}

static PyObject *
hook_get_calls(Hook *h, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(h->calls);
}

static PyObject *
hook_get_seconds(Hook *h, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(h->seconds);
}

static PyObject *
hook_get_observed(Hook *h, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(h->observed);
}

static PyObject *
hook_get_observe_seconds(Hook *h, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(h->observe_seconds);
}

static PyObject *
hook_get_kind(Hook *h, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(h->kind);
}

static PyGetSetDef hook_getset[] = {
    {"kind", (getter)hook_get_kind, NULL, "the route (the module's ALLOCATE ... HELD)", NULL},
    {"observed", (getter)hook_get_observed, NULL,
     "K_CACHE: the identity audit's producer records made in C (see identity_observe)", NULL},
    {"observe_seconds", (getter)hook_get_observe_seconds, NULL,
     "K_CACHE: kvsan's time in them (not in ``seconds``)", NULL},
    {"calls", (getter)hook_get_calls, NULL, "calls that took the native route", NULL},
    {"seconds", (getter)hook_get_seconds, NULL,
     "kvsan's own time in them (not vLLM's method, not the Python second halves)", NULL},
    {"observer", (getter)hook_get_observer, (setter)hook_set_observer,
     "K_CACHE: observer(rt, pool, request, blocks, num_cached, num_full), called after "
     "the allocator's part (another adapter's hook on the same method), or None",
     NULL},
    {"identity", (getter)hook_get_identity, (setter)hook_set_identity,
     "the identity audit's clean route in C, or None.  K_CACHE: (weak ref to the runtime, "
     "weak ref to the pool, producer records, chains, hash block size, [weights digest], "
     "known_chain, identity_record, [make]); K_HITS: (the same first six, known_chain, "
     "identity_hits, [make], the scheduler's requests, the audit)",
     NULL},
    {"state", (getter)hook_get_state, (setter)hook_set_state,
     "END, PREEMPT, FINISH: the request-end checks' state in C (see "
     "kvsan.hooks.vllm.allocator._hand_ends_to_native); STEP, GUARD: the "
     "worker's (see kvsan.hooks.vllm.worker._hand_to_native); SCHED, UPDATE: the scheduler's "
     "(see kvsan.hooks.vllm.allocator._hand_schedule_to_native); or None", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsan._native._hookfast.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Hook(kind, original, slow, post, where): an engine method observed in C",
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_descr_get = hook_descr_get,
    .tp_getset = hook_getset,
    .tp_dictoffset = offsetof(Hook, dict),
};

/* the C functions of _frames and _shadowfast, where they are there and of
 * this ABI (else their Python methods: the same results) */
static void
import_capi(void)
{
    fapi = PyCapsule_Import(KVSAN_FRAMES_CAPSULE, 0);
    if (fapi == NULL || fapi->abi != KVSAN_CAPI_ABI) {
        PyErr_Clear(); /* (a module built before the capsules: none) */
        fapi = NULL;
    }
    sapi = PyCapsule_Import(KVSAN_SHADOW_CAPSULE, 0);
    if (sapi == NULL || sapi->abi != KVSAN_CAPI_ABI) {
        PyErr_Clear();
        sapi = NULL;
    }
}

static PyObject *
hookfast_configure(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *globals, *ctxf, *ckf, *errf;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyDict_Type, &globals, &ctxf, &ckf, &errf)) {
        return NULL;
    }
    if (!PyCallable_Check(ctxf) || !PyCallable_Check(ckf) || !PyCallable_Check(errf)) {
        PyErr_SetString(PyExc_TypeError,
                        "configure(runtime module globals, context, checker, on_error)");
        return NULL;
    }
    Py_XSETREF(rt_globals, Py_NewRef(globals));
    Py_CLEAR(rt_cached); /* another dict: read it anew */
    Py_XSETREF(context_fn, Py_NewRef(ctxf));
    Py_XSETREF(checker_fn, Py_NewRef(ckf));
    Py_XSETREF(error_fn, Py_NewRef(errf));
    import_capi();
    calibrate();
    enabled = 1;
    Py_RETURN_NONE;
}

static PyObject *
hookfast_enable(PyObject *Py_UNUSED(self), PyObject *on)
{
    int v = PyObject_IsTrue(on);
    if (v < 0) {
        return NULL;
    }
    enabled = v && rt_globals != NULL;
    Py_CLEAR(c_rt); /* forget the cached checker: it may have been made otherwise */
    Py_CLEAR(c_pool_ref);
    Py_CLEAR(c_ck);
    Py_CLEAR(r_rt);
    Py_CLEAR(r_ctx);
    return PyBool_FromLong(enabled);
}

static PyObject *
hookfast_runtime_changed(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs; /* (kvsan.runtime's watchers get the new runtime: read anew) */
    Py_CLEAR(rt_cached);
    Py_RETURN_NONE;
}

static PyObject *
flush_overhead(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    if (flush() < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
hookfast_direct(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "direct([on])");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) { /* tests: both routes give the same */
        int on = PyObject_IsTrue(args[0]);
        if (on < 0) {
            return NULL;
        }
        if (on) {
            import_capi();
        } else {
            fapi = NULL;
            sapi = NULL;
        }
    }
    return Py_BuildValue("{s:O,s:O,s:O}", "frames", fapi != NULL ? Py_True : Py_False,
                         "shadow", sapi != NULL ? Py_True : Py_False, "tsc",
                         tsc_seconds > 0.0 ? Py_True : Py_False);
}

static PyMethodDef hookfast_methods[] = {
    {"direct", (PyCFunction)(void (*)(void))hookfast_direct, METH_FASTCALL,
     "direct([on]) -> {'frames': bool, 'shadow': bool, 'tsc': bool}: whether those modules' "
     "C functions are called directly (else their Python methods; ``on`` switches), and "
     "whether kvsan's own time is read from the time-stamp counter (else CLOCK_MONOTONIC)"},
    {"runtime_changed", (PyCFunction)(void (*)(void))hookfast_runtime_changed, METH_FASTCALL,
     "runtime_changed(*args): kvsan.runtime._runtime was assigned (read it anew)"},
    {"flush_overhead", flush_overhead, METH_NOARGS,
     "flush_overhead(): add kvsan's time in these hooks to its runtime's overhead_s"},
    {"configure", hookfast_configure, METH_VARARGS,
     "configure(runtime_globals, context, checker, on_error): what the hooks read"},
    {"enable", hookfast_enable, METH_O,
     "enable(on) -> whether hooks take the native route (off: the Python trampolines)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hookfast_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._native._hookfast",
    .m_doc = "kvsan's hottest BlockPool hooks in C (optional speed-up).",
    .m_size = -1,
    .m_methods = hookfast_methods,
};

#define INTERN(var, text)                                                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) {                                \
        return NULL;                                                                       \
    }

PyMODINIT_FUNC
PyInit__hookfast(void)
{
    INTERN(s_runtime, "_runtime");
    INTERN(s_owner_ctx, "owner_ctx");
    INTERN(s_step, "step");
    INTERN(s_journal, "journal");
    INTERN(s_uncached, "uncached");
    INTERN(s_freed, "freed");
    INTERN(s_cached, "cached");
    INTERN(s_overhead_s, "overhead_s");
    INTERN(s_fast, "fast");
    INTERN(s_allocate, "allocate");
    INTERN(s_share, "share");
    INTERN(s_snapshot, "snapshot");
    INTERN(s_release, "release");
    INTERN(s_cache, "cache");
    INTERN(s_current_owner, "current_owner");
    INTERN(s_unknown, "?");
    INTERN(s_request, "request");
    INTERN(s_blocks, "blocks");
    INTERN(s_num_cached, "num_cached_blocks");
    INTERN(s_num_full, "num_full_blocks");
    INTERN(s_request_ids, "request_ids");
    INTERN(s_request_id, "request_id");
    INTERN(s_preempted, "preempted");
    INTERN(s_new_computed_blocks, "new_computed_blocks");
    INTERN(s_block_pool, "block_pool");
    INTERN(s_checked, "checked");
    INTERN(s_status, "status");
    INTERN(s_requests, "requests");
    INTERN(s_req_to_blocks, "req_to_blocks");
    INTERN(s_kv_cache_group_id, "kv_cache_group_id");
    INTERN(s_is_null, "is_null");
    INTERN(s_dropped, "dropped");
    INTERN(s_block_id, "block_id");
    INTERN(s_remove_blocks, "remove_blocks");
    INTERN(s_kvsan, "kvsan");
    INTERN(s_reset, "reset");
    INTERN(s_finished_req_ids, "finished_req_ids");
    INTERN(s_preempted_req_ids, "preempted_req_ids");
    INTERN(s_scheduled_new_reqs, "scheduled_new_reqs");
    INTERN(s_kv_cache_block_copies, "kv_cache_block_copies");
    INTERN(s_step_hits, "step_hits");
    INTERN(s_pending_sums, "pending_sums");
    INTERN(s_scheduled_cached_reqs, "scheduled_cached_reqs");
    INTERN(s_resumed_req_ids, "resumed_req_ids");
    INTERN(s_new_block_ids, "new_block_ids");
    INTERN(s_poison_on, "poison_on");
    INTERN(s_checksum, "checksum");
    INTERN(s_sums, "sums");
    INTERN(s__tick, "_tick");
    INTERN(s_SAMPLE_BATCH_STEPS, "SAMPLE_BATCH_STEPS");
    INTERN(s_pending_seal, "pending_seal");
    INTERN(s_will_seal, "will_seal");
    INTERN(s_pending_release, "pending_release");
    INTERN(s_every_step, "every_step");
    INTERN(s_total_num_scheduled_tokens, "total_num_scheduled_tokens");
    INTERN(s_idle_audited, "idle_audited");
    INTERN(s_busy, "busy");
    INTERN(s_config, "config");
    INTERN(s_audit_every, "audit_every");
    INTERN(s_metrics, "metrics");
    INTERN(s_metrics_due, "metrics_due");
    INTERN(s_pending_guard, "pending_guard");
    INTERN(s_device_s, "device_s");
    INTERN(s_input_batch, "input_batch");
    INTERN(s_num_reqs, "num_reqs");
    INTERN(s_block_table, "block_table");
    INTERN(s_block_tables, "block_tables");
    INTERN(s_slot_mapping, "slot_mapping");
    INTERN(s_gpu, "gpu");
    INTERN(s_req_ids, "req_ids");
    INTERN(s__req_ids, "_req_ids");
    INTERN(s_req_id_to_index, "req_id_to_index");
    INTERN(s__fast, "_fast");
    INTERN(s_rows_on, "rows_on");
    INTERN(s__row_order, "_row_order");
    INTERN(s_links, "links");
    INTERN(s_guard_step, "guard_step");
    INTERN(s_guard_where, "_prepare_inputs.guard");
    if ((zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL
        || PyType_Ready(&HookType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&hookfast_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Hook", (PyObject *)&HookType) < 0
        || PyModule_AddIntConstant(m, "ABI", KVSAN_HOOKFAST_ABI) < 0
        || PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0
        || PyModule_AddIntConstant(m, "ALLOCATE", K_ALLOCATE) < 0
        || PyModule_AddIntConstant(m, "TOUCH", K_TOUCH) < 0
        || PyModule_AddIntConstant(m, "RELEASE", K_RELEASE) < 0
        || PyModule_AddIntConstant(m, "CACHE", K_CACHE) < 0
        || PyModule_AddIntConstant(m, "HITS", K_HITS) < 0
        || PyModule_AddIntConstant(m, "END", K_END) < 0
        || PyModule_AddIntConstant(m, "SKIP", K_SKIP) < 0
        || PyModule_AddIntConstant(m, "PREEMPT", K_PREEMPT) < 0
        || PyModule_AddIntConstant(m, "FINISH", K_FINISH) < 0
        || PyModule_AddIntConstant(m, "STEP", K_STEP) < 0
        || PyModule_AddIntConstant(m, "GUARD", K_GUARD) < 0
        || PyModule_AddIntConstant(m, "SCHED", K_SCHED) < 0
        || PyModule_AddIntConstant(m, "UPDATE", K_UPDATE) < 0
        || PyModule_AddIntConstant(m, "ADMIT", K_ADMIT) < 0
        || PyModule_AddIntConstant(m, "HELD", K_HELD) < 0
        || PyModule_AddIntConstant(m, "ADMIT_ALL", K_ADMIT_ALL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
