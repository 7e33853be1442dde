/* kvsan._native._devicefast: the device checker's per-step work on host memory, in C.
 *
 * On a CPU device (vLLM's CPU backend, kvsan's own tests) the worker-side
 * checks of kvsan.checks.device.DeviceChecker are a dozen small numpy / torch
 * operations per step.  Between the forward passes of a real engine each of
 * those costs 20-120 µs (cold caches, the libraries' dispatch), which added
 * up to ~10% of a small model's step.  Two loops here replace them:
 *
 *   guard()     the write guard: every slot the step writes lies in a block
 *               its writer produces and that is not sealed; counts the slots
 *               written per block (``fill``);
 *   checksums() the weighted 64-bit word sums of sealed blocks, per layer
 *               (8-byte words with AVX2 / AVX-512 where the CPU has them:
 *               simd() tells and selects the level).
 *
 * Both give exactly what the torch path gives (tests/test_device_native.py
 * runs them side by side): the same bad (block, writer) pairs in the same
 * order, and the same sums -- sum(w[i] * word[i]) modulo 2^64 over each
 * block's raw bytes read as the widest of 8/4/2/1-byte signed words that
 * divides the row, with the caller's weights (given as a short period and
 * per-chunk multipliers, so that they stay in cache).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_slots.h"

#define KVSAN_DEVICEFAST_ABI 6

/* ------------------------------------------------------------ guard */

static int
get_1d(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
       const char *what)
{
    /* the slot mapping may be a strided row; the tables are whole arrays */
    int flags = (itemsize ? PyBUF_C_CONTIGUOUS : PyBUF_STRIDES) | PyBUF_FORMAT
                | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (view->ndim != 1 || (itemsize && view->itemsize != itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: a 1-d array of %zd-byte items is needed",
                     what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* the int64 or int32 item at ``at`` (``itemsize`` 8 or 4) */
static inline int64_t
load_int(const char *at, Py_ssize_t itemsize)
{
    if (itemsize == 8) {
        int64_t v;
        memcpy(&v, at, 8);
        return v;
    }
    int32_t v32;
    memcpy(&v32, at, 4);
    return v32;
}

static int
read_ints(PyObject *seq, Py_ssize_t n, int64_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

/* the guard's loop: ``nreq`` writers ``w`` with ``c`` tokens each over the
 * slots ``sb`` (their sum checked against it by the caller), the tables
 * ``lb`` / ``fb`` / ``mb`` (of the same length, at least one block) */
static PyObject *
guard_core(Py_buffer *sbp, const int64_t *w, const int64_t *c, Py_ssize_t nreq,
           Py_buffer *lbp, Py_buffer *fbp, Py_buffer *mbp, long long bs)
{
    Py_buffer sb = *sbp, lb = *lbp, fb = *fbp, mb = *mbp;
    Py_ssize_t nb = lb.shape[0];
    PyObject *bad = NULL, *out = NULL;
    const int32_t *lut = (const int32_t *)lb.buf;
    int32_t *fill = (int32_t *)fb.buf;
    const unsigned char *sealed = (const unsigned char *)mb.buf;
    Py_ssize_t pos = 0;
    for (Py_ssize_t r = 0; r < nreq; r++) {
        int64_t writer = w[r];
        for (int64_t k = 0; k < c[r]; k++, pos++) {
            int64_t s = load_int((const char *)sb.buf + pos * sb.strides[0], sb.itemsize);
            if (s < 0) {
                continue;  /* padding */
            }
            int64_t b = s / bs;
            if (b >= nb) {
                b = nb - 1;
            }
            fill[b] += 1;
            if (lut[b] == writer && !sealed[b]) {
                continue;
            }
            if (bad == NULL && (bad = PySet_New(NULL)) == NULL) {
                goto failed;
            }
            PyObject *pair = Py_BuildValue("(LL)", (long long)b, (long long)writer);
            if (pair == NULL || PySet_Add(bad, pair) < 0) {
                Py_XDECREF(pair);
                goto failed;
            }
            Py_DECREF(pair);
        }
    }
    if (bad == NULL) {
        return PyList_New(0);
    }
    if ((out = PySequence_List(bad)) != NULL && PyList_Sort(out) < 0) {
        Py_CLEAR(out);
    }
    Py_DECREF(bad);
    return out;
failed:
    Py_XDECREF(bad);
    return NULL;
}

/* the guard's buffers: the slot mapping (``slots``: int64 or int32 items,
 * possibly a strided row) and the tables lut / fill / sealed (covering the
 * same pool of at least one block), in ``b`` (released by guard_release);
 * -1 with ValueError naming what is wrong */
typedef struct {
    Py_buffer sb, lb, fb, mb;
    int have; /* how many of the four were taken, in that order */
} GuardBuffers;

/* whether a buffer's items are int32 or int64 (its format's last letter) */
static int
int_items(const Py_buffer *v)
{
    const char *fmt = (v->format && *v->format) ? v->format + strlen(v->format) - 1 : "B";
    return (v->itemsize == 8 || v->itemsize == 4) && strchr("qli", *fmt) != NULL;
}

static void
guard_release(GuardBuffers *b)
{
    Py_buffer *all[4] = {&b->sb, &b->lb, &b->fb, &b->mb};
    for (int i = 0; i < b->have; i++) {
        PyBuffer_Release(all[i]);
    }
    b->have = 0;
}

static int
guard_buffers(PyObject *slots, PyObject *lut, PyObject *fill, PyObject *sealed,
              GuardBuffers *b)
{
    b->have = 0;
    if (get_1d(slots, &b->sb, 0, 0, "slots") < 0) {
        return -1;
    }
    b->have = 1;
    if (!int_items(&b->sb)) {
        PyErr_SetString(PyExc_ValueError, "slots: int64 or int32 items are needed");
        goto fail;
    }
    if (get_1d(lut, &b->lb, 0, 4, "lut") < 0) {
        goto fail;
    }
    b->have = 2;
    if (get_1d(fill, &b->fb, 1, 4, "fill") < 0) {
        goto fail;
    }
    b->have = 3;
    if (get_1d(sealed, &b->mb, 0, 1, "sealed") < 0) {
        goto fail;
    }
    b->have = 4;
    Py_ssize_t nb = b->lb.shape[0];
    if (b->fb.shape[0] != nb || b->mb.shape[0] != nb || nb == 0) {
        PyErr_SetString(PyExc_ValueError, "lut, fill and sealed must cover the same pool");
        goto fail;
    }
    return 0;
fail:
    guard_release(b);
    return -1;
}

/* guard(slots, writers, counts, lut, fill, sealed, block_size)
 *   slots:   int64 or int32 array, the step's slot mapping (padding < 0)
 *   writers: list of the writing requests' ints, counts: tokens of each
 *   lut:     int32 array, the producer int of each block (-1: none)
 *   fill:    int32 array, slots written per block (updated)
 *   sealed:  bool array, the sealed blocks
 * -> sorted list of distinct (block, writer) of writes outside the writer's
 *    own unsealed blocks.  A slot past the pool counts against its last
 *    block, as the torch path's clamp does. */
static PyObject *
guard(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "guard(slots, writers, counts, lut, fill, sealed, block_size)");
        return NULL;
    }
    long long bs = PyLong_AsLongLong(args[6]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    GuardBuffers gb = {.have = 0};
    PyObject *writers = NULL, *counts = NULL, *out = NULL;
    int64_t *w = NULL, *c = NULL;

    if (guard_buffers(args[0], args[3], args[4], args[5], &gb) < 0) {
        goto done;
    }
    writers = PySequence_Fast(args[1], "writers must be a sequence");
    counts = writers ? PySequence_Fast(args[2], "counts must be a sequence") : NULL;
    if (counts == NULL) {
        goto done;
    }
    Py_ssize_t nreq = PySequence_Fast_GET_SIZE(writers);
    if (PySequence_Fast_GET_SIZE(counts) != nreq) {
        PyErr_SetString(PyExc_ValueError, "writers and counts differ in length");
        goto done;
    }
    w = PyMem_Malloc(sizeof(int64_t) * (nreq + 1));
    c = PyMem_Malloc(sizeof(int64_t) * (nreq + 1));
    if (w == NULL || c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_ints(writers, nreq, w) < 0 || read_ints(counts, nreq, c) < 0) {
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t r = 0; r < nreq; r++) {
        if (c[r] < 0) {
            PyErr_SetString(PyExc_ValueError, "a token count is negative");
            goto done;
        }
        total += c[r];
    }
    if (total > gb.sb.shape[0]) {
        PyErr_Format(PyExc_ValueError, "%lld tokens scheduled, %zd slots mapped",
                     (long long)total, gb.sb.shape[0]);
        goto done;
    }
    out = guard_core(&gb.sb, w, c, nreq, &gb.lb, &gb.fb, &gb.mb, bs);
done:
    PyMem_Free(w);
    PyMem_Free(c);
    Py_XDECREF(writers);
    Py_XDECREF(counts);
    guard_release(&gb);
    return out;
}

/* ---------------------------------------------------- guard_step */

/* kvsan.checks.device.DeviceChecker's attributes read by guard_step
 * (interned at import); the first G_NSLOTS are slots of the checker, read
 * at their offsets (kvsan/_native/_slots.h): between two forward passes each read
 * through the instance dict cost about 0.4 µs (caches cold), nine of them
 * a third of the guard's own time */
enum { G_PENDING, G_MAY_DEFER, G_STEP_HITS, G_LAST_BATCH, G_SLOTS_VIEW, G_NP, G_BLOCK_SIZE,
       G_COUNTERS, G_RID_INT, G_FED, G_READS, G_GUARDED, G_DATA_PTR, G_N };
static const char *g_names[G_N] = {"pending_guard", "_may_defer", "step_hits", "_last_batch",
                                   "_slots_view", "_np", "block_size", "counters", "_rid_int",
                                   "_fed", "_reads", "guarded_tokens", "data_ptr"};
static PyObject *g_str[G_N];

/* new reference to obj.<name> (NULL with an exception) */
#define G_NSLOTS (G_READS + 1)
static SlotTable g_slots;

/* new reference to checker.<g_names[i]> (NULL with an exception) */
#define GET(obj, i) slots_get(&g_slots, (obj), (i), g_str, G_NSLOTS)

/* The buffers of the last checker guard_step guarded, held between steps:
 * taking four buffers from numpy costs about 2 µs a step between forward
 * passes (cold caches), for arrays a checker keeps for its whole life.
 * Keyed by the objects they were taken from, held here (so none of them is
 * freed and its address reused): the checker's ``_np`` tuple (lut, fill,
 * sealed) and its slot view (``_slots_view[2]``).  A checker that replaces
 * either gets new buffers; the last checker's arrays stay alive until then
 * (three small arrays and a view of the runner's slot mapping). */
static struct {
    PyObject *tables; /* the ``_np`` tuple */
    PyObject *slots;  /* the slot view */
    GuardBuffers gb;  /* taken from them (gb.have 4), else none */
} held = {NULL, NULL, {.have = 0}};

/* the guard buffers of ``tables`` (a 3-tuple) and ``slots``, held (see
 * ``held``): NULL with an exception where they cannot be taken */
static GuardBuffers *
held_buffers(PyObject *tables, PyObject *slots)
{
    if (held.tables == tables && held.slots == slots && held.gb.have == 4) {
        return &held.gb;
    }
    guard_release(&held.gb);
    Py_CLEAR(held.tables);
    Py_CLEAR(held.slots);
    if (guard_buffers(slots, PyTuple_GET_ITEM(tables, 0), PyTuple_GET_ITEM(tables, 1),
                      PyTuple_GET_ITEM(tables, 2), &held.gb) < 0) {
        return NULL;
    }
    held.tables = Py_NewRef(tables);
    held.slots = Py_NewRef(slots);
    return &held.gb;
}

/* Two 1-d int buffers a checker keeps in a 2-tuple, held between steps as
 * the guard's are, keyed by the tuple (kept alive with them): its
 * input-token record (``_fed``: the engine's per-step input tokens; the
 * per-slot int32 table, written) and its read-extent record (``_reads``:
 * the engine's per-step sequence lengths and positions). */
typedef struct {
    PyObject *key;
    Py_buffer a, b;
    int have; /* how many of the two were taken, in that order */
} HeldPair;
static HeldPair held_fed = {NULL, .have = 0}, held_reads = {NULL, .have = 0};

static void
pair_release(HeldPair *h)
{
    if (h->have > 1) {
        PyBuffer_Release(&h->b);
    }
    if (h->have > 0) {
        PyBuffer_Release(&h->a);
    }
    h->have = 0;
    Py_CLEAR(h->key);
}

/* one int32 / int64 array of a pair (``table``: the written int32 one) */
static int
pair_take(PyObject *obj, Py_buffer *view, int table, const char *what)
{
    if (get_1d(obj, view, table, table ? 4 : 0, what) < 0) {
        return -1;
    }
    if (!table && !int_items(view)) {
        PyErr_Format(PyExc_ValueError, "%s: int64 or int32 items are needed", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* 0 with ``h`` holding ``pair``'s two buffers (the second a written int32
 * table where ``table``); -1 with an exception naming ``what`` */
static int
held_pair(HeldPair *h, PyObject *pair, int table, const char *what)
{
    if (h->key == pair && h->have == 2) {
        return 0;
    }
    pair_release(h);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_ValueError, "%s: a 2-tuple of arrays is needed", what);
        return -1;
    }
    if (pair_take(PyTuple_GET_ITEM(pair, 0), &h->a, 0, what) < 0) {
        return -1;
    }
    h->have = 1;
    if (pair_take(PyTuple_GET_ITEM(pair, 1), &h->b, table, what) < 0) {
        pair_release(h);
        return -1;
    }
    h->have = 2;
    h->key = Py_NewRef(pair);
    return 0;
}

/* table[slots[i]] = source[i] for the step's ``total`` tokens (padding
 * slots, < 0, and any past the table skipped), as
 * DeviceChecker._record_fed does */
static void
fed_scatter(const Py_buffer *sb, Py_ssize_t total, const Py_buffer *src, Py_buffer *dst)
{
    int32_t *table = (int32_t *)dst->buf;
    Py_ssize_t nt = dst->shape[0], n = total < src->shape[0] ? total : src->shape[0];
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *at = (const char *)sb->buf + i * sb->strides[0];
        const char *from = (const char *)src->buf + i * src->strides[0];
        int64_t slot = load_int(at, sb->itemsize);
        if (slot < 0 || slot >= nt) {
            continue;
        }
        table[slot] = (int32_t)load_int(from, src->itemsize);
    }
}

/* the step's read extents (DeviceChecker._bad_reads): each of the ``n``
 * requests that wrote tokens (``c``) reads ``seq[i]`` slots of its KV,
 * which must be the position of its last token (in ``pos``, over the
 * step's ``total`` tokens) + 1; a (writer, read, written) tuple appended to
 * ``out`` for each that does not.  0, or -1 with an exception. */
static int
bad_reads(PyObject *out, const int64_t *w, const int64_t *c, Py_ssize_t n, int64_t total,
          const Py_buffer *seq, const Py_buffer *pos)
{
    int64_t at = 0, npos = total < pos->shape[0] ? total : pos->shape[0];
    for (Py_ssize_t i = 0; i < n && i < seq->shape[0]; i++) {
        at += c[i];
        if (c[i] <= 0 || at > npos) {
            continue;
        }
        int64_t read = load_int((const char *)seq->buf + i * seq->strides[0], seq->itemsize);
        int64_t wrote = load_int((const char *)pos->buf + (at - 1) * pos->strides[0],
                                 pos->itemsize) + 1;
        if (read == wrote) {
            continue;
        }
        PyObject *t = Py_BuildValue("(LLL)", (long long)w[i], (long long)read, (long long)wrote);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    return 0;
}

/* release_held() -> None: let go of the held guard buffers (tests, and a
 * checker whose arrays must be freed now) */
static PyObject *
release_held(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    guard_release(&held.gb);
    Py_CLEAR(held.tables);
    Py_CLEAR(held.slots);
    pair_release(&held_fed);
    pair_release(&held_reads);
    Py_RETURN_NONE;
}

/* guard_step(checker, slot_mapping, batch_req_ids, n, tokens) ->
 * DeviceChecker.guard(slot_mapping, batch_req_ids[:n], tokens[:n]) for the
 * common step: the sorted distinct (block, writer) pairs of bad writes (the
 * step guarded: fill and the guarded-token count updated; the caller
 * reports them), or None, with nothing changed, for any other step (the
 * caller runs DeviceChecker.guard, which gives the same results).
 * A batch of other requests than the last guard's (or with no last batch,
 * after a request left) is the common step too when every one of them has
 * its int already (``_rid_int``): it becomes the new ``_last_batch``, as
 * DeviceChecker.guard makes it.  The step's prefix hits (``step_hits``) are
 * checked once its writes are counted, as check_hits_written checks them:
 * all written in full, they are cleared; else they stay, and the caller
 * runs check_hits_written (which reports them) before reporting the
 * writes.  Where the checker records input tokens (``_fed``:
 * DeviceChecker.record_inputs) the step's are stored per slot written, as
 * DeviceChecker._record_fed stores them; where it checks read extents
 * (``_reads``: DeviceChecker.record_reads), the requests whose extent
 * differs follow the bad writes as (writer, read, written), as
 * DeviceChecker._bad_reads finds them.
 *
 * Between two forward passes every Python frame is a cache miss, and a
 * step's guard took two (DeviceChecker.guard and _check_writes) and a list
 * of the tokens per request around this loop.  The common step: the tables
 * and the slot mapping in host memory with its view kept (_slots_view: the
 * same tensor at the same address), requests that all have their ints
 * (mostly the last guard's, in the same order: _last_batch, an engine's
 * persistent batch), nothing deferred or pending, and some tokens to guard.
 * ``tokens``: a 1-d buffer of int32 or int64 (an engine's numpy array). */
static PyObject *
guard_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "guard_step(checker, slot_mapping, batch_req_ids, n, tokens)");
        return NULL;
    }
    PyObject *dc = args[0], *sm = args[1], *rids = args[2];
    PyObject *o[G_N] = {NULL};
    PyObject *ptr = NULL, *out = NULL, *ids = NULL, *new_rids = NULL;
    Py_buffer cb;
    int have_c = 0;
    int64_t *w = NULL, *c = NULL;
    Py_ssize_t *hb = NULL; /* the prefix hits' blocks */
    int common = 0; /* 1: the common case, applied (out set) */

    for (int i = G_PENDING; i <= G_STEP_HITS; i++) {
        if ((o[i] = GET(dc, i)) == NULL) {
            goto done;
        }
    }
    int may = PyObject_IsTrue(o[G_MAY_DEFER]);
    if (may < 0) {
        goto done;
    }
    if (o[G_PENDING] != Py_None || may) {
        goto done;
    }
    /* the step's prefix hits, checked once its writes are counted: a list
     * of (request id, block) */
    PyObject *hits = o[G_STEP_HITS];
    if (!PyList_CheckExact(hits)) {
        goto done;
    }
    for (int i = G_LAST_BATCH; i <= G_READS; i++) {
        if ((o[i] = GET(dc, i)) == NULL) {
            goto done;
        }
    }
    PyObject *last = o[G_LAST_BATCH], *view = o[G_SLOTS_VIEW], *np = o[G_NP];
    if ((last != Py_None && (!PyTuple_Check(last) || PyTuple_GET_SIZE(last) != 2))
        || !PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 3 || !PyTuple_Check(np)
        || PyTuple_GET_SIZE(np) != 3 || !PyDict_Check(o[G_COUNTERS])
        || !PyDict_CheckExact(o[G_RID_INT]) || PyTuple_GET_ITEM(view, 2) == Py_None) {
        goto done;
    }
    /* no last batch (a request left since: its int may be another's now):
     * a batch of other requests */
    PyObject *last_rids = NULL, *last_ids = NULL;
    if (last != Py_None) {
        last_rids = PyTuple_GET_ITEM(last, 0);
        last_ids = PyTuple_GET_ITEM(last, 1);
        if (!PyList_Check(last_rids) || !PyList_Check(last_ids)
            || PyList_GET_SIZE(last_ids) != PyList_GET_SIZE(last_rids)) {
            goto done;
        }
    }
    long long bs = PyLong_AsLongLong(o[G_BLOCK_SIZE]);
    if (bs <= 0) {
        PyErr_Clear();
        goto done;
    }
    /* the batch: the same requests, in the same order, as the last guard,
     * or requests that all have their ints (``ids``: then the new batch's) */
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (n == -1 && PyErr_Occurred()) {
        goto done;
    }
    if (!PyList_CheckExact(rids) || PyList_GET_SIZE(rids) < n || n < 0) {
        goto done;
    }
    int same_batch = last_rids != NULL && n == PyList_GET_SIZE(last_rids);
    for (Py_ssize_t i = 0; i < n && same_batch; i++) {
        PyObject *a = PyList_GET_ITEM(rids, i), *b = PyList_GET_ITEM(last_rids, i);
        int eq = a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
        if (eq < 0) {
            goto done; /* (an error goes to Python too: it meets the same) */
        }
        same_batch = eq;
    }
    if (!same_batch) {
        if ((ids = PyList_New(n)) == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *id = PyDict_GetItemWithError(o[G_RID_INT], PyList_GET_ITEM(rids, i));
            if (id == NULL) {
                goto done; /* a request without its int yet (or an error): Python's */
            }
            PyList_SET_ITEM(ids, i, Py_NewRef(id));
        }
        if ((new_rids = PyList_GetSlice(rids, 0, n)) == NULL) {
            goto done;
        }
        last_ids = ids;
    }
    /* the slot mapping: the tensor whose view is kept, at the same address */
    if (sm != PyTuple_GET_ITEM(view, 0)) {
        goto done;
    }
    if ((ptr = PyObject_CallMethodNoArgs(sm, g_str[G_DATA_PTR])) == NULL) {
        goto done;
    }
    int same = PyObject_RichCompareBool(ptr, PyTuple_GET_ITEM(view, 1), Py_EQ);
    if (same <= 0) {
        goto done;
    }
    /* the tokens of each request: vLLM's numpy array, or any 1-d int buffer */
    if (PyObject_GetBuffer(args[4], &cb, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        goto done;
    }
    have_c = 1;
    if (cb.ndim != 1 || cb.shape[0] < n || !int_items(&cb)) {
        goto done;
    }
    w = PyMem_Malloc(sizeof(int64_t) * (n + 1));
    c = PyMem_Malloc(sizeof(int64_t) * (n + 1));
    if (w == NULL || c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (last_ids == NULL || PyList_GET_SIZE(last_ids) < n || PyList_GET_SIZE(rids) < n) {
        goto done; /* (changed by the Python code the calls above may run) */
    }
    /* (kept: the last batch's ids list may be replaced by that code) */
    Py_INCREF(last_ids);
    Py_XSETREF(ids, last_ids);
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        c[i] = load_int((const char *)cb.buf + i * cb.strides[0], cb.itemsize);
        long long id = PyLong_AsLongLong(PyList_GET_ITEM(last_ids, i));
        if (c[i] < 0 || (id == -1 && PyErr_Occurred())) {
            goto done;
        }
        w[i] = id;
        total += c[i];
    }
    if (total == 0) {
        goto done; /* (the hits' check runs there) */
    }
    GuardBuffers *gb = held_buffers(np, PyTuple_GET_ITEM(view, 2));
    if (gb == NULL || total > gb->sb.shape[0]) {
        goto done;
    }
    /* the input-token record, where the checker keeps one */
    int fed = o[G_FED] != Py_None, reads = o[G_READS] != Py_None;
    if (fed && held_pair(&held_fed, o[G_FED], 1, "_fed") < 0) {
        goto done;
    }
    /* the read-extent record, where the checker keeps one */
    if (reads && held_pair(&held_reads, o[G_READS], 0, "_reads") < 0) {
        goto done;
    }
    Py_ssize_t nhits = PyList_GET_SIZE(hits);
    if (nhits) { /* the blocks, read before anything is set */
        if ((hb = PyMem_Malloc(sizeof(Py_ssize_t) * nhits)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < nhits; i++) {
            PyObject *hit = PyList_GET_ITEM(hits, i);
            if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2
                || !PyLong_CheckExact(PyTuple_GET_ITEM(hit, 1))) {
                goto done;
            }
            hb[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(hit, 1));
            if (hb[i] < 0 || hb[i] >= gb->fb.shape[0]) {
                goto done; /* (an error, too: Python's) */
            }
        }
    }
    /* from here on the step is guarded: a failure is kvsan's own (raised) */
    common = 1;
    PyObject *had = PyDict_GetItemWithError(o[G_COUNTERS], g_str[G_GUARDED]);
    if (had == NULL && PyErr_Occurred()) {
        goto done;
    }
    long long before = had != NULL ? PyLong_AsLongLong(had) : 0;
    if (before == -1 && PyErr_Occurred()) {
        goto done;
    }
    PyObject *now = PyLong_FromLongLong(before + total);
    if (now == NULL) {
        goto done;
    }
    int r = PyDict_SetItem(o[G_COUNTERS], g_str[G_GUARDED], now);
    Py_DECREF(now);
    if (r < 0) {
        goto done;
    }
    if (new_rids != NULL) { /* the new batch, as DeviceChecker.guard keeps it */
        PyObject *pair = PyTuple_Pack(2, new_rids, ids);
        r = pair == NULL ? -1 : slots_set(&g_slots, dc, G_LAST_BATCH, pair, g_str, G_NSLOTS);
        Py_XDECREF(pair);
        if (r < 0) {
            goto done;
        }
    }
    out = guard_core(&gb->sb, w, c, n, &gb->lb, &gb->fb, &gb->mb, bs);
    if (out != NULL && fed) {
        fed_scatter(&gb->sb, (Py_ssize_t)total, &held_fed.a, &held_fed.b);
    }
    if (out != NULL && reads
        && bad_reads(out, w, c, n, total, &held_reads.a, &held_reads.b) < 0) {
        Py_CLEAR(out);
    }
    if (out != NULL && nhits) {
        /* every hit written in full: checked (check_hits_written); else the
         * hits stay for the caller to report, with their requests */
        const int32_t *fill = (const int32_t *)gb->fb.buf;
        int all_written = 1;
        for (Py_ssize_t i = 0; i < nhits && all_written; i++) {
            all_written = fill[hb[i]] >= bs;
        }
        PyObject *none = all_written ? PyList_New(0) : NULL;
        if (all_written
            && (none == NULL || slots_set(&g_slots, dc, G_STEP_HITS, none, g_str, G_NSLOTS) < 0)) {
            Py_CLEAR(out);
        }
        Py_XDECREF(none);
    }
done:
    if (!common && out == NULL) { /* not the common case: DeviceChecker.guard's */
        PyErr_Clear();
        out = Py_NewRef(Py_None);
    }
    PyMem_Free(w);
    PyMem_Free(c);
    PyMem_Free(hb);
    Py_XDECREF(ids);
    Py_XDECREF(new_rids);
    if (have_c) PyBuffer_Release(&cb);
    for (int i = 0; i < G_N; i++) {
        Py_XDECREF(o[i]);
    }
    Py_XDECREF(ptr);
    return out;
}

/* -------------------------------------------------------- checksums */

/* Widest word (8, 4, 2 or 1 bytes) dividing a row of nbytes. */
static Py_ssize_t
word_size(Py_ssize_t nbytes)
{
    return nbytes % 8 == 0 ? 8 : nbytes % 4 == 0 ? 4 : nbytes % 2 == 0 ? 2 : 1;
}

/* sum(W[i % P] * C[i / P] * word[i]) modulo 2^64 over the row's words:
 * per chunk of P words, the chunk's sum with the short weights W (which stay
 * in L1), times the chunk's odd multiplier C[chunk]. */
#define ROW_LOOP(T)                                                          \
    for (Py_ssize_t c0 = 0; c0 < n; c0 += period) {                          \
        Py_ssize_t m = n - c0 < period ? n - c0 : period;                    \
        const char *p = row + sizeof(T) * c0;                                \
        uint64_t part = 0;                                                   \
        for (Py_ssize_t j = 0; j < m; j++, p += sizeof(T)) {                 \
            T v;                                                             \
            memcpy(&v, p, sizeof(T));                                        \
            part += (uint64_t)w[j] * (uint64_t)(int64_t)v;                   \
        }                                                                    \
        acc += part * (uint64_t)chunk[c0 / period];                          \
    }

/* The 8-byte-word chunk sum (the common case: a float32 or bf16 row is a
 * multiple of 8 bytes) with vector multiplies where the CPU has them,
 * chosen at run time: the build itself targets the baseline x86-64.  A
 * 64-bit multiply is one per cycle in scalar code, which held the checksum
 * of a cache row to about 20 GB/s, so a sampled verification cost several
 * µs per block on a CPU cache.  Sums modulo 2^64 are the same in any
 * order, so lane-wise partial sums give the scalar loop's value
 * (tests/test_device_native.py compares every level on random rows). */
enum { SIMD_SCALAR = 0, SIMD_AVX2 = 1, SIMD_AVX512 = 2 };
static int simd_level = SIMD_SCALAR; /* the level in use (simd()) */
static int simd_best = SIMD_SCALAR;  /* the best this CPU has */

static uint64_t
chunk_sum64_scalar(const char *p, Py_ssize_t m, const int64_t *w, const char *pf)
{
    (void)pf;
    uint64_t part = 0;
    for (Py_ssize_t j = 0; j < m; j++, p += 8) {
        int64_t v;
        memcpy(&v, p, 8);
        part += (uint64_t)w[j] * (uint64_t)v;
    }
    return part;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define KVSAN_X86_SIMD 1

/* the low 64 bits of a * b per lane, from 32 x 32 -> 64 bit multiplies:
 * lo(a) lo(b) + ((hi(a) lo(b) + lo(a) hi(b)) << 32) */
__attribute__((target("avx2"))) static uint64_t
chunk_sum64_avx2(const char *p, Py_ssize_t m, const int64_t *w, const char *pf)
{
    __m256i acc = _mm256_setzero_si256();
    Py_ssize_t j = 0;
    for (; j + 4 <= m; j += 4) {
        if (pf != NULL && (j & 7) == 0) {
            _mm_prefetch(pf + 8 * j, _MM_HINT_T0); /* (one per 64-byte line) */
        }
        __m256i a = _mm256_loadu_si256((const __m256i *)(p + 8 * j));
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + j));
        __m256i lo = _mm256_mul_epu32(a, b);
        __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                         _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32)));
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3]
           + chunk_sum64_scalar(p + 8 * j, m - j, w + j, NULL);
}

__attribute__((target("avx512f,avx512dq"))) static uint64_t
chunk_sum64_avx512(const char *p, Py_ssize_t m, const int64_t *w, const char *pf)
{
    __m512i acc = _mm512_setzero_si512();
    Py_ssize_t j = 0;
    for (; j + 8 <= m; j += 8) {
        if (pf != NULL) {
            _mm_prefetch(pf + 8 * j, _MM_HINT_T0); /* (one per 64-byte line) */
        }
        __m512i a = _mm512_loadu_si512((const void *)(p + 8 * j));
        __m512i b = _mm512_loadu_si512((const void *)(w + j));
        acc = _mm512_add_epi64(acc, _mm512_mullo_epi64(a, b));
    }
    return (uint64_t)_mm512_reduce_add_epi64(acc)
           + chunk_sum64_scalar(p + 8 * j, m - j, w + j, NULL);
}
#endif

static void
simd_detect(void)
{
#ifdef KVSAN_X86_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        simd_best = SIMD_AVX512;
    } else if (__builtin_cpu_supports("avx2")) {
        simd_best = SIMD_AVX2;
    }
#endif
    simd_level = simd_best;
}

/* ``next``: the row summed after this one (of as many bytes), or NULL.
 * Sampled blocks are rarely in cache when they are checked, and a row of
 * a cache block is a few KB, too short for the hardware prefetcher to get
 * ahead: the vector loops touch the next row's lines while they sum this
 * one (measured: about 15% less time per block not in cache; no change
 * for blocks in cache). */
static uint64_t
row_sum(const char *row, Py_ssize_t nbytes, const int64_t *w, Py_ssize_t period,
        const int64_t *chunk, const char *next)
{
    Py_ssize_t ws = word_size(nbytes), n = nbytes / ws;
    uint64_t acc = 0;
    switch (ws) {
    case 8: {
        uint64_t (*sum)(const char *, Py_ssize_t, const int64_t *, const char *) =
            chunk_sum64_scalar;
#ifdef KVSAN_X86_SIMD
        if (simd_level == SIMD_AVX512) {
            sum = chunk_sum64_avx512;
        } else if (simd_level == SIMD_AVX2) {
            sum = chunk_sum64_avx2;
        }
#endif
        for (Py_ssize_t c0 = 0; c0 < n; c0 += period) {
            Py_ssize_t m = n - c0 < period ? n - c0 : period;
            acc += sum(row + 8 * c0, m, w, next != NULL ? next + 8 * c0 : NULL)
                   * (uint64_t)chunk[c0 / period];
        }
        break;
    }
    case 4:
        ROW_LOOP(int32_t)
        break;
    case 2:
        ROW_LOOP(int16_t)
        break;
    default:
        ROW_LOOP(int8_t)
    }
    return acc;
}

/* the bytes of one block's row of a layer (dims 1..) */
static Py_ssize_t
row_bytes(const Py_buffer *v)
{
    Py_ssize_t nbytes = v->itemsize;
    for (int d = 1; d < v->ndim; d++) {
        nbytes *= v->shape[d];
    }
    return nbytes;
}

/* checksums(layers, blocks, weights, chunks)
 *   layers:  block-major arrays (dim 0: the block), each block's row
 *            C-contiguous
 *   blocks:  list of block ids
 *   weights: int64 array of P odd weights, word i's is weights[i % P] ...
 *   chunks:  int64 array of odd multipliers, ... times chunks[i / P]
 * -> list (per block) of tuples (per layer) of signed 64-bit sums, or None
 *    when a layer's rows are not contiguous (the caller's torch path then
 *    handles the layers). */
static PyObject *
checksums(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "checksums(layers, blocks, weights, chunks)");
        return NULL;
    }
    PyObject *layers = PySequence_Fast(args[0], "layers must be a sequence");
    if (layers == NULL) {
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(args[1], "blocks must be a sequence");
    if (blocks == NULL) {
        Py_DECREF(layers);
        return NULL;
    }
    Py_ssize_t nl = PySequence_Fast_GET_SIZE(layers), nbk = PySequence_Fast_GET_SIZE(blocks);
    Py_buffer wb, cb;
    Py_buffer *views = PyMem_Calloc(nl ? nl : 1, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    int64_t *ids = PyMem_Malloc(sizeof(int64_t) * (nbk + 1));
    PyObject *out = NULL;
    int have_w = 0, have_c = 0, contiguous = 1;
    if (views == NULL || ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_1d(args[2], &wb, 0, 8, "weights") < 0) {
        goto done;
    }
    have_w = 1;
    if (get_1d(args[3], &cb, 0, 8, "chunks") < 0) {
        goto done;
    }
    have_c = 1;
    Py_ssize_t period = wb.shape[0];
    if (period == 0) {
        PyErr_SetString(PyExc_ValueError, "no weights");
        goto done;
    }
    for (; got < nl; got++) {
        Py_buffer *v = &views[got];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(layers, got), v, PyBUF_STRIDED_RO) < 0) {
            goto done;
        }
        if (v->ndim < 1) {
            PyErr_SetString(PyExc_ValueError, "a layer has no block dimension");
            got++;
            goto done;
        }
        /* dims 1.. C-contiguous: each block's row is one run of bytes */
        Py_ssize_t step = v->itemsize;
        for (int d = v->ndim - 1; d >= 1; d--) {
            if (v->shape[d] > 1 && v->strides[d] != step) {
                contiguous = 0;
            }
            step *= v->shape[d];
        }
        Py_ssize_t nbytes = step, words = nbytes / word_size(nbytes);
        if ((words + period - 1) / period > cb.shape[0]) {
            PyErr_Format(PyExc_ValueError, "%zd chunk multipliers for rows of %zd words",
                         cb.shape[0], words);
            got++;
            goto done;
        }
    }
    if (!contiguous) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (read_ints(blocks, nbk, ids) < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < nbk; k++) {
        for (Py_ssize_t l = 0; l < nl; l++) {
            if (ids[k] < 0 || ids[k] >= views[l].shape[0]) {
                PyErr_Format(PyExc_IndexError, "block %lld outside a layer of %zd blocks",
                             (long long)ids[k], views[l].shape[0]);
                goto done;
            }
        }
    }
    out = PyList_New(nbk);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < nbk; k++) {
        PyObject *row = PyTuple_New(nl);
        if (row == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, row);
        for (Py_ssize_t l = 0; l < nl; l++) {
            Py_buffer *v = &views[l];
            Py_ssize_t nbytes = row_bytes(v);
            const char *p = (const char *)v->buf + ids[k] * v->strides[0];
            /* the next row of as many bytes: this block's next layer, or
             * the next block's first */
            Py_ssize_t kn = l + 1 < nl ? k : k + 1, ln = l + 1 < nl ? l + 1 : 0;
            const char *next = NULL;
            if (kn < nbk && row_bytes(&views[ln]) == nbytes) {
                next = (const char *)views[ln].buf + ids[kn] * views[ln].strides[0];
            }
            uint64_t sum = row_sum(p, nbytes, (const int64_t *)wb.buf, period,
                                   (const int64_t *)cb.buf, next);
            PyObject *x = PyLong_FromLongLong((long long)(int64_t)sum);
            if (x == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyTuple_SET_ITEM(row, l, x);
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        if (views[i].obj != NULL) {
            PyBuffer_Release(&views[i]);
        }
    }
    if (have_w) PyBuffer_Release(&wb);
    if (have_c) PyBuffer_Release(&cb);
    PyMem_Free(views);
    PyMem_Free(ids);
    Py_DECREF(layers);
    Py_DECREF(blocks);
    return out;
}

/* ------------------------------------------------------ check_rows */

/* DeviceChecker.check_rows's attributes and the V1 input batch's, interned
 * at import */
enum { R_ROWS_DUE, R_ROW_ORDER, R_REQ_BLOCKS, R_ROW_SWEEP, R_SWEEP_N, R_COUNTERS, R_CHECKED,
       R_SWEPT, R_REQ_IDS, R_INDEX, R_N };
static const char *r_names[R_N] = {"rows_due", "_row_order", "req_blocks", "_row_sweep",
                                   "ROW_SWEEP", "counters", "rows_checked", "rows_swept",
                                   "_req_ids", "req_id_to_index"};
static PyObject *r_str[R_N];

/* a 1-d buffer (get_1d) of 4- or 8-byte ints, its items contiguous; 0
 * taken, -1 not (no exception: the caller declines) */
static int
int_buffer(PyObject *obj, Py_buffer *view)
{
    if (get_1d(obj, view, 0, 0, "rows") < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = view->format != NULL ? view->format : "B";
    char code = f[0] == '<' || f[0] == '=' || f[0] == '@' ? f[1] : f[0];
    if ((view->itemsize != 4 && view->itemsize != 8)
        || (code != 'i' && code != 'l' && code != 'q')
        || (view->strides != NULL && view->shape[0] > 1 && view->strides[0] != view->itemsize)) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* batch row ``i``'s first ``counts[i]`` entries of ``rows`` (``width`` a
 * row) against the list ``mine``: 1 the same, 0 not, -1 not readable here */
static int
row_same(PyObject *mine, const Py_buffer *rows, Py_ssize_t width, const Py_buffer *counts,
         Py_ssize_t i)
{
    if (!PyList_CheckExact(mine) || i >= counts->shape[0]) {
        return -1;
    }
    Py_ssize_t k = PyList_GET_SIZE(mine), start = i * width;
    if (load_int((const char *)counts->buf + i * counts->itemsize, counts->itemsize) != k) {
        return 0;
    }
    if (start + k > rows->shape[0]) {
        return 0;
    }
    const char *at = (const char *)rows->buf + start * rows->itemsize;
    for (Py_ssize_t j = 0; j < k; j++, at += rows->itemsize) {
        PyObject *x = PyList_GET_ITEM(mine, j);
        if (!PyLong_CheckExact(x)) {
            return -1;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1;
        }
        if (v != load_int(at, rows->itemsize)) {
            return 0;
        }
    }
    return 1;
}

/* where ``rid`` is among the first ``n`` of ``ids``, or -1 (-2: an error) */
static Py_ssize_t
row_of(PyObject *ids, Py_ssize_t n, PyObject *rid)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(ids, i) == rid) {
            return i;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(ids, i), rid, Py_EQ);
        if (eq != 0) {
            return eq < 0 ? -2 : i;
        }
    }
    return -1;
}

/* check_rows(checker, batch, rows, width, counts)
 *   DeviceChecker.check_rows for vLLM's V1 input batch (its requests read
 *   where the batch keeps them: ``_req_ids``, ``len(req_id_to_index)``),
 *   in one call: every row it compares matched, and the checker's row
 *   state moved on as the method moves it -> True.  Any row that differs,
 *   or anything read here in another form than expected -> None, nothing
 *   changed: the caller runs the method, which finds and reports the
 *   same.  Between two forward passes the method's frames and the batch's
 *   properties cost about 30 µs a call (cold caches). */
static PyObject *
check_rows(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "check_rows(checker, batch, rows, width, counts)");
        return NULL;
    }
    PyObject *dc = args[0], *batch = args[1];
    PyObject *o[R_N] = {NULL};
    PyObject *due = NULL, *later = NULL, *it = NULL, *order = NULL, *ret = NULL;
    Py_buffer rb, cb;
    int have_r = 0, have_c = 0;
    Py_ssize_t width = PyLong_AsSsize_t(args[3]);
    if (width < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    for (int i = 0; i < R_N; i++) {
        if (i == R_CHECKED || i == R_SWEPT) {
            continue;
        }
        o[i] = PyObject_GetAttr(i >= R_REQ_IDS ? batch : dc, r_str[i]);
        if (o[i] == NULL) {
            PyErr_Clear();
            goto decline;
        }
    }
    PyObject *ids = o[R_REQ_IDS], *before = o[R_ROW_ORDER], *held = o[R_REQ_BLOCKS];
    if (!PyList_CheckExact(ids) || !PyDict_CheckExact(o[R_INDEX]) || !PySet_CheckExact(o[R_ROWS_DUE])
        || !PyList_CheckExact(before) || !PyDict_CheckExact(held) || !PyDict_CheckExact(o[R_COUNTERS])
        || !PyLong_CheckExact(o[R_ROW_SWEEP]) || !PyLong_CheckExact(o[R_SWEEP_N])) {
        goto decline;
    }
    Py_ssize_t n = PyDict_GET_SIZE(o[R_INDEX]);
    Py_ssize_t at = PyLong_AsSsize_t(o[R_ROW_SWEEP]), sweep = PyLong_AsSsize_t(o[R_SWEEP_N]);
    if (n > PyList_GET_SIZE(ids) || at < 0 || sweep < 0) {
        PyErr_Clear();
        goto decline;
    }
    if (int_buffer(args[2], &rb) < 0) {
        goto decline;
    }
    have_r = 1;
    if (int_buffer(args[4], &cb) < 0) {
        goto decline;
    }
    have_c = 1;
    /* the rows due: those of the checker, and those at another row than at
     * the last check (moved, or new to the batch) */
    Py_ssize_t nb = PyList_GET_SIZE(before);
    int same = nb == n;
    if ((due = PySet_New(o[R_ROWS_DUE])) == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(ids, i);
        int eq = 0;
        if (i < nb) {
            PyObject *b = PyList_GET_ITEM(before, i);
            eq = b == r ? 1 : PyObject_RichCompareBool(b, r, Py_EQ);
        }
        if (eq < 0) {
            goto fail;
        }
        if (!eq) {
            same = 0;
            if (PySet_Add(due, r) < 0) {
                goto fail;
            }
        }
    }
    if ((later = PyList_New(0)) == NULL || (it = PyObject_GetIter(due)) == NULL) {
        goto fail;
    }
    Py_ssize_t checked = 0, swept = 0;
    PyObject *rid;
    while ((rid = PyIter_Next(it)) != NULL) {
        PyObject *mine = PyDict_GetItemWithError(held, rid);
        Py_ssize_t i = mine == NULL ? -1 : row_of(ids, n, rid);
        int r = i >= 0 ? row_same(mine, &rb, width, &cb, i) : 1;
        if (mine != NULL && i == -1 && PyList_Append(later, rid) < 0) {
            r = -2;
        }
        Py_DECREF(rid);
        if (PyErr_Occurred() || i == -2 || r == -2) {
            goto fail;
        }
        if (r != 1) {
            goto decline;
        }
        checked += i >= 0;
    }
    if (PyErr_Occurred()) {
        goto fail;
    }
    Py_ssize_t start = n ? at % n : 0;
    for (Py_ssize_t t = 0; n && t < (sweep < n ? sweep : n); t++) {
        Py_ssize_t i = (start + t) % n;
        PyObject *r = PyList_GET_ITEM(ids, i);
        PyObject *mine = PyDict_GetItemWithError(held, r);
        if (mine == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            continue;
        }
        int in = PySet_Contains(due, r);
        if (in < 0) {
            goto fail;
        }
        if (in) {
            continue;
        }
        int s = row_same(mine, &rb, width, &cb, i);
        if (s != 1) {
            goto decline;
        }
        swept++;
    }
    /* all matched: the checker's row state, as the method leaves it */
    if (!same) {
        if ((order = PyList_GetSlice(ids, 0, n)) == NULL
            || PyObject_SetAttr(dc, r_str[R_ROW_ORDER], order) < 0) {
            goto fail;
        }
    }
    Py_SETREF(due, PySet_New(later));
    if (due == NULL || PyObject_SetAttr(dc, r_str[R_ROWS_DUE], due) < 0) {
        goto fail;
    }
    PyObject *names[2] = {r_str[R_CHECKED], r_str[R_SWEPT]};
    Py_ssize_t by[2] = {checked, swept};
    for (int k = 0; k < 2; k++) { /* counters[name] += by */
        PyObject *was = PyDict_GetItemWithError(o[R_COUNTERS], names[k]);
        PyObject *add = was == NULL ? NULL : PyLong_FromSsize_t(by[k]);
        PyObject *sum = add == NULL ? NULL : PyNumber_Add(was, add);
        Py_XDECREF(add);
        if (sum == NULL || PyDict_SetItem(o[R_COUNTERS], names[k], sum) < 0) {
            Py_XDECREF(sum);
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_KeyError, "counters has no %R", names[k]);
            }
            goto fail;
        }
        Py_DECREF(sum);
    }
    if (n) {
        PyObject *next = PyLong_FromSsize_t(start + sweep);
        if (next == NULL || PyObject_SetAttr(dc, r_str[R_ROW_SWEEP], next) < 0) {
            Py_XDECREF(next);
            goto fail;
        }
        Py_DECREF(next);
    }
    ret = Py_NewRef(Py_True);
    goto done;
decline:
    ret = Py_NewRef(Py_None);
    goto done;
fail:
    ret = NULL;
done:
    if (have_r) PyBuffer_Release(&rb);
    if (have_c) PyBuffer_Release(&cb);
    for (int i = 0; i < R_N; i++) {
        Py_XDECREF(o[i]);
    }
    Py_XDECREF(due);
    Py_XDECREF(later);
    Py_XDECREF(it);
    Py_XDECREF(order);
    return ret;
}

/* simd([level]) -> the level in use (0 scalar, 1 AVX2, 2 AVX-512); with
 * ``level``, use that one (capped at what the CPU has): the tests compare
 * the levels */
static PyObject *
simd(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "simd([level])");
        return NULL;
    }
    if (nargs == 1) {
        long v = PyLong_AsLong(args[0]);
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (v < SIMD_SCALAR || v > SIMD_AVX512) {
            PyErr_SetString(PyExc_ValueError, "simd level: 0 scalar, 1 AVX2, 2 AVX-512");
            return NULL;
        }
        simd_level = v < simd_best ? (int)v : simd_best;
    }
    return PyLong_FromLong(simd_level);
}

static PyMethodDef methods[] = {
    {"release_held", (PyCFunction)release_held, METH_NOARGS,
     "release_held() -> None: let go of the guard buffers guard_step holds between steps"},
    {"simd", (PyCFunction)(void (*)(void))simd, METH_FASTCALL,
     "simd([level]) -> the checksums' vector level in use (0 scalar, 1 AVX2, 2 AVX-512); "
     "with level, use that one (at most what this CPU has)"},
    {"guard", (PyCFunction)(void (*)(void))guard, METH_FASTCALL,
     "guard(slots, writers, counts, lut, fill, sealed, block_size) -> sorted distinct "
     "(block, writer) pairs of writes outside the writer's own unsealed blocks; "
     "adds the slots written to fill"},
    {"guard_step", (PyCFunction)(void (*)(void))guard_step, METH_FASTCALL,
     "guard_step(checker, slot_mapping, batch_req_ids, n, tokens) -> the step's bad (block, "
     "writer) pairs, the step guarded; or None: not the common step, nothing changed (the "
     "caller runs DeviceChecker.guard)"},
    {"check_rows", (PyCFunction)(void (*)(void))check_rows, METH_FASTCALL,
     "check_rows(checker, batch, rows, width, counts) -> True: DeviceChecker.check_rows done, "
     "every row compared matched; or None: nothing changed (the caller runs the method)"},
    {"checksums", (PyCFunction)(void (*)(void))checksums, METH_FASTCALL,
     "checksums(layers, blocks, weights, chunks) -> per block, a tuple of per-layer weighted "
     "word sums (None if a layer's rows are not contiguous)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef devicefast_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._native._devicefast",
    .m_doc = "The device checker's host-memory loops in C (optional speed-up).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__devicefast(void)
{
    PyObject *m = PyModule_Create(&devicefast_module);
    if (m == NULL) {
        return NULL;
    }
    simd_detect();
    for (int i = 0; i < G_N; i++) {
        if ((g_str[i] = PyUnicode_InternFromString(g_names[i])) == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    for (int i = 0; i < R_N; i++) {
        if ((r_str[i] = PyUnicode_InternFromString(r_names[i])) == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "ABI", KVSAN_DEVICEFAST_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
