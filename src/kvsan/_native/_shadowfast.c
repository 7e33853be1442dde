/* kvsan._native._shadowfast: the clean case of the shadow table's hot updates in C.
 *
 * kvsan.checks.AllocatorChecker is the reference: every rule lives there,
 * in Python.  On the scheduler's hot path (every allocate, prefix hit, free
 * and cache registration) almost every event is clean, and the Python
 * checker's cost is mostly per-call overhead: attribute reads on vLLM's
 * blocks, tuples built to describe them, and the table updates.  A
 * :class:`Table` here holds the shadow table's own arrays and lists and does,
 * for one event, what the Python checker would do when *nothing* is wrong.
 *
 * Each method first verifies, without changing anything, that the event is
 * clean (counts agree, the owner holds what it releases, no block is seen
 * twice, none is in the checker's unresolved-mismatch set, ...).  If any
 * check fails it returns None and the caller runs the Python checker, which
 * finds and reports the fault exactly as without this module.  Only a clean
 * event is applied here, with the same updates in the same order as the
 * Python code (tests/test_native.py drives both on the same sequences and
 * compares the whole table).  The event's bookkeeping is done here too:
 * the checker's counters and the shadow's owned / cached-free totals (kept
 * as C integers until read: see Table_settle), each owner's held count and
 * "since" time, and the call site's interned id (a new site through
 * ``site_id``).  In situ a Python call costs microseconds between the
 * engine's work; these are a few dict updates.
 *
 * The module also holds the other loops over vLLM's blocks on the hot path,
 * which read the same block fields: the full audit's pool read
 * (``read_pool``) and the identity audit's producer records and hit checks
 * (``identity_record``, ``identity_hits``, whose mismatches Python reports).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KVSAN_SHADOWFAST_ABI 12

#include "_capi.h"
#define KVSAN_IDENTITY_SLOTS /* RequestIdentity's slots too */
#include "_slots.h"

#include <structmember.h>
#include <time.h>

/* The engine block's attributes read here.  vLLM's KVCacheBlock is a slotted
 * dataclass: its fields are member descriptors at fixed offsets, so once per
 * block type (and again whenever the type is modified) the offsets are
 * resolved and a field is read as a pointer load, the way CPython's own
 * descriptor does it.  Anything else (another type, a property, an unset
 * slot) goes through PyObject_GetAttr. */
enum { A_BLOCK_ID, A_REF_CNT, A_PREV_FREE, A_IS_NULL, A_POOL, A_BLOCK_HASH, N_ATTRS };
static const char *attr_names[N_ATTRS] = {"block_id", "ref_cnt", "prev_free_block",
                                          "is_null", "pool", "block_hash"};
static PyObject *names[N_ATTRS];

/* The slot a property only returns, or NULL.  vLLM's ``block_hash`` is
 * ``@property def block_hash(self): return self._block_hash``: read through
 * the property, every read runs a Python frame (a block's hash is read on
 * every cache and last-release event).  Whether a property's getter only
 * returns a slot is decided in Python (kvsan.hooks.property_slot: the
 * getter's instructions, then a probe instance), which registers the pair
 * here with property_slot(prop, member); a property not registered is
 * read as a property.  property object -> member descriptor (strong). */
static PyObject *prop_slots = NULL;

static PyObject *
registered_slot(PyTypeObject *tp, PyObject *prop)
{
    if (prop_slots == NULL) {
        return NULL;
    }
    PyObject *d = PyDict_GetItemWithError(prop_slots, prop); /* borrowed */
    if (d == NULL) {
        PyErr_Clear();
        return NULL;
    }
    /* only where the getter's ``self.<slot>`` is that member on this type
     * too (a subclass may hide the slot behind something else) */
    return slots_type_lookup(tp, PyDescr_NAME(d)) == d ? d : NULL;
}

/* the block type's offsets (kvsan/_native/_slots.h), with ``block_hash``'s property
 * read as the slot it returns */
static SlotTable block_slots = {.property_slot = registered_slot};

/* new reference to attribute ``i`` of ``obj``, or NULL with an exception */
static PyObject *
get_field(PyObject *obj, int i)
{
    return slots_get(&block_slots, obj, i, names, N_ATTRS);
}

/* Field ``i`` of ``obj`` as a borrowed pointer, read in line where the
 * block's type is the one the offsets were resolved for and the slot is
 * set; NULL otherwise (no exception set: the caller then takes get_field,
 * which resolves, falls back and raises as before).  A 4-block touch read
 * 16 fields through get_field's call, reference count and release, which
 * took as many instructions as vLLM's own touch.  The type's version tag
 * alone tells that it is unchanged: CPython clears the valid flag and sets
 * the tag to 0 together (PyType_Modified), and where slots_resolve found
 * no valid tag it left no offsets (a 4-block touch reads 16 fields). */
static inline PyObject *
peek(PyObject *obj, int i)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp == block_slots.type && tp->tp_version_tag == block_slots.version
        && block_slots.offset[i] >= 0) {
        return *(PyObject **)((char *)obj + block_slots.offset[i]);
    }
    return NULL;
}

/* a tuple of ``n`` new references (stolen; NULL items allowed: then all are
 * released and NULL returned, the exception set by whoever made the NULL).
 * Py_BuildValue parses its format string on every call: on the hot path,
 * that parse cost as much as the tuple. */
static PyObject *
tuple_steal(Py_ssize_t n, PyObject **items)
{
    PyObject *t = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            goto fail;
        }
    }
    t = PyTuple_New(n);
    if (t == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
fail:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(items[i]);
    }
    return NULL;
}

/* What an owner holds: its reference count and since when it holds any,
 * as Python reads an entry of the shadow's ``held`` (a HeldMap, below,
 * which keeps its entries inline and makes one of these per read).  Not
 * tracked by the garbage collector: it holds a complex and an int, which
 * can be in no cycle. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;   /* references held (>= 1 while in ``held``) */
    PyObject *when; /* complex(monotonic time, step) it began to hold */
} Hold;

static PyTypeObject HoldType;

/* a new Hold of ``n`` references since ``when`` (a new reference), NULL with
 * an exception */
static PyObject *
hold_new(Py_ssize_t n, PyObject *when)
{
    Hold *h = PyObject_New(Hold, &HoldType);
    if (h == NULL) {
        return NULL;
    }
    h->n = n;
    h->when = Py_NewRef(when);
    return (PyObject *)h;
}

static PyObject *
Hold_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"n", "when", NULL};
    Py_ssize_t n;
    PyObject *when;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO:Hold", kwlist, &n, &when)) {
        return NULL;
    }
    if (type != &HoldType) {
        PyErr_SetString(PyExc_TypeError, "Hold cannot be subclassed");
        return NULL;
    }
    return hold_new(n, when);
}

static void
Hold_dealloc(Hold *h)
{
    Py_XDECREF(h->when);
    PyObject_Free(h);
}

static PyObject *
Hold_repr(Hold *h)
{
    return PyUnicode_FromFormat("Hold(n=%zd, when=%R)", h->n, h->when);
}

static PyMemberDef Hold_members[] = {
    {"n", T_PYSSIZET, offsetof(Hold, n), 0, "references held"},
    {"when", T_OBJECT_EX, offsetof(Hold, when), READONLY,
     "complex(monotonic time, step) at which the owner began to hold"},
    {NULL},
};

static PyTypeObject HoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsan._native._shadowfast.Hold",
    .tp_basicsize = sizeof(Hold),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hold(n, when): an owner's references and since when it holds any",
    .tp_new = Hold_tp_new,
    .tp_dealloc = (destructor)Hold_dealloc,
    .tp_repr = (reprfunc)Hold_repr,
    .tp_members = Hold_members,
};

/* ---- HeldMap: shadow.held, owner -> what it holds ------------------------
 *
 * Every request's first reference (its prefix hit or first allocation)
 * makes an entry here and its last release removes it.  As a dict of Hold
 * records that was a dict insert (with the churn's periodic rebuild of the
 * dict: deleted entries are not reused), a Hold allocated, a dict delete
 * and a Hold freed per request: profiled in a 4-block prefix hit, 480 of
 * kvsan's 1,700 instructions.  Here an owner is one inline entry of an
 * open-addressed table (its count, time and step in place, no object per
 * owner), keyed by the owner str with its cached hash.  Owners are strs;
 * Python reads an entry as a Hold snapshot.
 *
 * Linear probing with backward-shift deletion: a removal moves the entries
 * after it back, so the table keeps no removed-slot markers and is never
 * rebuilt to clear them.  With markers (Python's dict scheme, this table's
 * first form) the churn of requests, each an insert and a remove, filled
 * the table with them: every new owner probed past them, and the table was
 * rebuilt every few dozen requests (in the per-event benchmark, once per
 * 128 owners: 3.3 µs a rebuild).  A probe here walks adjacent entries (two
 * per cache line); an owner's take and drop through Python went from 130
 * and 79 ns to about 55 and 50. */

/* 32 bytes: the map is part of the shadow's memory per block (a request
 * holds 16 blocks or so, and a table is at most two thirds full) */
typedef struct {
    PyObject *key;   /* the owner; NULL an empty slot */
    double t;        /* monotonic time (coarse clock) it began to hold */
    Py_ssize_t n;    /* references held (>= 1 while in the map) */
    uint32_t hash;   /* the key's hash, its low 32 bits (probes compare it first) */
    int step;        /* the step it began to hold (a C int, as acq_step's) */
} HeldEntry;

typedef struct {
    PyObject_HEAD
    HeldEntry *e;
    size_t mask; /* capacity - 1; the capacity is a power of two */
    Py_ssize_t used; /* owners */
} HeldMap;

#define HELD_MIN 8
/* a table this large or smaller is never shrunk (32 KB): a rebuild costs a
 * pass over the table, and the number of requests in flight swings between
 * a few and a few hundred step after step */
#define HELD_KEEP 1024

static PyTypeObject HeldMapType;

static inline int
held_key(PyObject *owner, Py_hash_t *h)
{
    if (!PyUnicode_Check(owner)) {
        PyErr_Format(PyExc_TypeError, "kvsan shadow.held: an owner is a str, not %.100s",
                     Py_TYPE(owner)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(owner) < 0) {
        return -1;
    }
#endif
    *h = PyObject_Hash(owner); /* a str's is cached: the engine's request ids have one */
    return *h == -1 ? -1 : 0;
}

/* two ready strs with the same value, as str's own equality compares them:
 * length and kind, then the bytes (no call: used where owners are compared
 * on the hot path, after their hashes where the caller has them) */
static inline int
str_same(PyObject *a, PyObject *b)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    if (n != PyUnicode_GET_LENGTH(b) || PyUnicode_KIND(a) != PyUnicode_KIND(b)) {
        return 0;
    }
    return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * PyUnicode_KIND(a)) == 0;
}

/* ``owner``'s entry (*found 1), or the empty slot that ended its probe
 * (*found 0: where it goes in) */
static HeldEntry *
held_find(HeldMap *m, PyObject *owner, Py_hash_t h, int *found)
{
    /* placed by the hash's low 32 bits, which the entry keeps (held_resize,
     * held_remove) */
    size_t mask = m->mask, i = (uint32_t)h & mask;
    for (;;) {
        HeldEntry *e = &m->e[i];
        PyObject *k = e->key;
        if (k == NULL) {
            *found = 0;
            return e;
        }
        if (k == owner || (e->hash == (uint32_t)h && str_same(k, owner))) {
            *found = 1;
            return e;
        }
        i = (i + 1) & mask;
    }
}

/* the table rebuilt with a capacity of at least ``factor`` * ``need``: 2
 * when it grows (it doubles, to a third full: a step of 4 and a half-full
 * limit would cost 10 bytes per block of shadow memory at 100k blocks,
 * against 5), 4 when it shrinks (a quarter full: it takes more than as many owners
 * again before it grows); -1 with MemoryError (the table unchanged) */
static int
held_resize(HeldMap *m, Py_ssize_t need, size_t factor)
{
    size_t cap = HELD_MIN;
    while (cap < (size_t)need * factor) {
        cap <<= 1;
    }
    HeldEntry *e = PyMem_Calloc(cap, sizeof(HeldEntry));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    HeldEntry *old = m->e;
    size_t old_cap = old != NULL ? m->mask + 1 : 0;
    m->e = e;
    m->mask = cap - 1;
    for (size_t j = 0; j < old_cap; j++) {
        if (old[j].key != NULL) {
            int found; /* (never: the owners are distinct) */
            *held_find(m, old[j].key, old[j].hash, &found) = old[j];
        }
    }
    PyMem_Free(old);
    return 0;
}

/* the held-since clock: time.monotonic's on Linux, read at its last tick
 * (a few ms: "held since" is reported in seconds; 3 ns a read instead of
 * 24).  Never later than time.monotonic(), so a time held is never < 0. */
static double
held_clock(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ``owner`` holds ``k`` more references; a new owner is stamped (now,
 * ``step``).  0, or -1 with an exception (nothing changed). */
static int
held_take(HeldMap *m, PyObject *owner, Py_ssize_t k, long long step)
{
    Py_hash_t h;
    if (held_key(owner, &h) < 0) {
        return -1;
    }
    int found;
    HeldEntry *e = held_find(m, owner, h, &found);
    if (found) {
        e->n += k;
        return 0;
    }
    if ((size_t)(m->used + 1) * 3 > (m->mask + 1) * 2) { /* at most two thirds full */
        if (held_resize(m, m->used + 1, 2) < 0) {
            return -1;
        }
        e = held_find(m, owner, h, &found);
    }
    m->used++;
    e->key = Py_NewRef(owner);
    e->hash = (uint32_t)h;
    e->n = k;
    e->t = held_clock();
    e->step = step > INT_MAX ? INT_MAX : step < INT_MIN ? INT_MIN : (int)step;
    return 0;
}

/* ``owner``'s entry, or NULL (with an exception only for a key that is not
 * a str) */
static HeldEntry *
held_get(HeldMap *m, PyObject *owner)
{
    Py_hash_t h;
    if (held_key(owner, &h) < 0) {
        return NULL;
    }
    int found;
    HeldEntry *e = held_find(m, owner, h, &found);
    return found ? e : NULL;
}

/* ``e`` (an entry of ``m``) removed: each entry after it on the run up to
 * the next empty slot moves back into the hole where its own probe (from
 * its home slot) passes the hole, so every probe still finds its owner
 * before an empty slot.  A large table left mostly empty is shrunk (a
 * failure to is ignored: the table stays as it is). */
static void
held_remove(HeldMap *m, HeldEntry *e)
{
    PyObject *k = e->key;
    size_t mask = m->mask, hole = (size_t)(e - m->e), j = hole;
    for (;;) {
        j = (j + 1) & mask;
        HeldEntry *f = &m->e[j];
        if (f->key == NULL) {
            break;
        }
        size_t home = f->hash & mask;
        /* f may move to the hole unless its home lies after the hole, up
         * to f itself (cyclically) */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->e[hole] = *f;
            hole = j;
        }
    }
    m->e[hole].key = NULL;
    m->used--;
    Py_DECREF(k);
    if (m->mask + 1 > HELD_KEEP && (size_t)m->used * 16 < m->mask + 1
        && held_resize(m, m->used, 4) < 0) {
        PyErr_Clear();
    }
}

static PyObject *
held_snapshot(HeldEntry *e)
{
    PyObject *when = PyComplex_FromDoubles(e->t, (double)e->step);
    if (when == NULL) {
        return NULL;
    }
    PyObject *h = hold_new(e->n, when);
    Py_DECREF(when);
    return h;
}

static PyObject *
HeldMap_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, ":HeldMap", kwlist)) {
        return NULL;
    }
    if (type != &HeldMapType) {
        PyErr_SetString(PyExc_TypeError, "HeldMap cannot be subclassed");
        return NULL;
    }
    HeldMap *m = PyObject_New(HeldMap, &HeldMapType);
    if (m == NULL) {
        return NULL;
    }
    m->e = NULL;
    m->used = 0;
    if (held_resize(m, 0, 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
HeldMap_dealloc(HeldMap *m)
{
    if (m->e != NULL) {
        for (size_t j = 0; j <= m->mask; j++) {
            if (m->e[j].key != NULL) {
                Py_DECREF(m->e[j].key);
            }
        }
        PyMem_Free(m->e);
    }
    PyObject_Free(m);
}

static Py_ssize_t
HeldMap_len(HeldMap *m)
{
    return m->used;
}

static int
HeldMap_contains(HeldMap *m, PyObject *owner)
{
    HeldEntry *e = held_get(m, owner);
    if (e == NULL && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            return -1;
        }
        PyErr_Clear(); /* not a str: not an owner */
    }
    return e != NULL;
}

static PyObject *
HeldMap_getitem(HeldMap *m, PyObject *owner)
{
    HeldEntry *e = held_get(m, owner);
    if (e == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, owner);
        }
        return NULL;
    }
    return held_snapshot(e);
}

/* the owners, in table order (a list: iterating never sees the map change) */
static PyObject *
HeldMap_keys(HeldMap *m, PyObject *Py_UNUSED(unused))
{
    PyObject *out = PyList_New(m->used);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (size_t j = 0; j <= m->mask && i < m->used; j++) {
        PyObject *k = m->e[j].key;
        if (k != NULL) {
            PyList_SET_ITEM(out, i++, Py_NewRef(k));
        }
    }
    return out;
}

static PyObject *
HeldMap_iter(HeldMap *m)
{
    PyObject *keys = HeldMap_keys(m, NULL);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
HeldMap_items(HeldMap *m, PyObject *Py_UNUSED(unused))
{
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (size_t j = 0; j <= m->mask; j++) {
        HeldEntry *e = &m->e[j];
        if (e->key == NULL) {
            continue;
        }
        PyObject *h = held_snapshot(e);
        PyObject *pair = h == NULL ? NULL : PyTuple_Pack(2, e->key, h);
        Py_XDECREF(h);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *
HeldMap_get(HeldMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get(owner[, default]): %zd arguments given", nargs);
        return NULL;
    }
    HeldEntry *e = held_get(m, args[0]);
    if (e == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                return NULL;
            }
            PyErr_Clear();
        }
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    }
    return held_snapshot(e);
}

/* take(owner, n, step): ``owner`` holds ``n`` more references (stamped
 * with the time and ``step`` if it held none) */
static PyObject *
HeldMap_take(HeldMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    long long step;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "take(owner, n, step): %zd arguments given", nargs);
        return NULL;
    }
    if ((n = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((step = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (held_take(m, args[0], n, step) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* drop(owner, n) -> what it still holds: ``n`` references fewer; an owner
 * left with none is forgotten.  KeyError for an owner that holds nothing. */
static PyObject *
HeldMap_drop(HeldMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "drop(owner, n): %zd arguments given", nargs);
        return NULL;
    }
    if ((n = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    HeldEntry *e = held_get(m, args[0]);
    if (e == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, args[0]);
        }
        return NULL;
    }
    e->n -= n;
    Py_ssize_t left = e->n;
    if (!left) {
        held_remove(m, e);
    }
    return PyLong_FromSsize_t(left);
}

static PyObject *
HeldMap_repr(HeldMap *m)
{
    PyObject *items = HeldMap_items(m, NULL);
    if (items == NULL) {
        return NULL;
    }
    PyObject *r = PyUnicode_FromFormat("HeldMap(%R)", items);
    Py_DECREF(items);
    return r;
}

static PyMappingMethods HeldMap_as_mapping = {
    .mp_length = (lenfunc)HeldMap_len,
    .mp_subscript = (binaryfunc)HeldMap_getitem,
};

static PySequenceMethods HeldMap_as_sequence = {
    .sq_contains = (objobjproc)HeldMap_contains,
};

static PyMethodDef HeldMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))HeldMap_get, METH_FASTCALL,
     "get(owner, default=None): the owner's Hold (a snapshot), or default"},
    {"keys", (PyCFunction)HeldMap_keys, METH_NOARGS, "the owners (a list)"},
    {"items", (PyCFunction)HeldMap_items, METH_NOARGS, "(owner, Hold) pairs (a list)"},
    {"take", (PyCFunction)(void (*)(void))HeldMap_take, METH_FASTCALL,
     "take(owner, n, step): n more references (stamped now and at step if new)"},
    {"drop", (PyCFunction)(void (*)(void))HeldMap_drop, METH_FASTCALL,
     "drop(owner, n) -> references left (0: the owner is forgotten)"},
    {NULL},
};

static PyTypeObject HeldMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsan._native._shadowfast.HeldMap",
    .tp_basicsize = sizeof(HeldMap),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* holds strs only: in no reference cycle */
    .tp_doc = "HeldMap(): owner -> what it holds (shadow.held), entries inline",
    .tp_new = HeldMap_tp_new,
    .tp_dealloc = (destructor)HeldMap_dealloc,
    .tp_repr = (reprfunc)HeldMap_repr,
    .tp_as_mapping = &HeldMap_as_mapping,
    .tp_as_sequence = &HeldMap_as_sequence,
    .tp_iter = (getiterfunc)HeldMap_iter,
    .tp_methods = HeldMap_methods,
};

/* the call-site cache in front of site_ids: two ways per set (a site and
 * the one it would evict), 32 sets.  A one-way cache of 16 entries indexed
 * by the str's address bits 4-7 is too small: a scheduler step meets tens
 * of sites, and two of them sharing those bits miss on every call (a dict lookup and
 * an int read, about 190 instructions: a tenth of what kvsan adds to a
 * 4-block touch) */
#define SITE_CACHE 64 /* a power of two */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    PyObject *own0;      /* list: first owner of each block or None */
    PyObject *own1;      /* list: second owner of each block or None */
    PyObject *more;      /* dict: block -> its third owner, or a list of them from the third */
    PyObject *hashes;    /* list: cache key of each cached block */
    PyObject *acq_owner; /* list */
    PyObject *rel_owner; /* list */
    PyObject *null;      /* frozenset of null block ids */
    PyObject *mism;      /* set: blocks with an unresolved count mismatch */
    PyObject *sh;        /* the ShadowTable (totals, _hold/_unhold, site_id) */
    PyObject *counters;  /* dict: the checker's event counters */
    PyObject *held;      /* HeldMap: shadow.held */
    PyObject *ended;     /* dict: shadow.ended */
    PyObject *nonrequest; /* set: shadow.nonrequest */
    PyObject *leased;    /* dict: shadow.leased (blocks under a transfer's lease) */
    PyObject *site_ids;  /* dict: call site -> interned id (shadow._site_ids) */
    Py_buffer nown, cached, acq_step, acq_site, rel_step, rel_site;
    unsigned char *seen; /* scratch: blocks already met in this call, a bit each */
    void *scratch;       /* an event's per-block arrays (see scratch_get) */
    size_t scratch_cap;
    int scratch_busy;
    /* bookkeeping not yet added to the Python objects (see Table_settle):
     * counters allocated / evicted / shared / released, the shadow's totals */
    long long d_count[4], d_owned, d_cached_free;
    Py_ssize_t null_ids[4]; /* the null blocks (a pool has one) */
    int n_null;
    /* in front of site_ids: the last call sites met, by address (a site is
     * one str for the life of the process, and its id never changes) */
    PyObject *site_key[SITE_CACHE];
    int site_val[SITE_CACHE];
    int ready; /* Table_init set every object field above (Table_clear unsets it) */
} Table;

/* the ``seen`` bits: a bit per block, not a byte (an eighth of the memory,
 * and the shadow's bytes per block are a target) */
#define SEEN(t, b) (((t)->seen[(size_t)(b) >> 3] >> ((size_t)(b) & 7)) & 1)
#define SEEN_SET(t, b) ((t)->seen[(size_t)(b) >> 3] |= (unsigned char)(1u << ((size_t)(b) & 7)))
#define SEEN_CLR(t, b) ((t)->seen[(size_t)(b) >> 3] &= (unsigned char)~(1u << ((size_t)(b) & 7)))

static int
get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t n, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view->itemsize != itemsize || view->len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "Table: %s must hold %zd items of %zd bytes", what, n,
                     itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* A Table holds its ShadowTable, whose clock is the runtime's step method:
 * the runtime -> checker -> Table -> shadow -> runtime cycle must be one
 * the garbage collector can see and break. */
static int
Table_traverse(Table *self, visitproc visit, void *arg)
{
    Py_VISIT(self->own0);
    Py_VISIT(self->own1);
    Py_VISIT(self->more);
    Py_VISIT(self->hashes);
    Py_VISIT(self->acq_owner);
    Py_VISIT(self->rel_owner);
    Py_VISIT(self->null);
    Py_VISIT(self->mism);
    Py_VISIT(self->sh);
    Py_VISIT(self->counters);
    Py_VISIT(self->held);
    Py_VISIT(self->ended);
    Py_VISIT(self->nonrequest);
    Py_VISIT(self->leased);
    Py_VISIT(self->site_ids);
    return 0;
}

static int
Table_clear(Table *self)
{
    self->ready = 0;
    Py_CLEAR(self->own0);
    Py_CLEAR(self->own1);
    Py_CLEAR(self->more);
    Py_CLEAR(self->hashes);
    Py_CLEAR(self->acq_owner);
    Py_CLEAR(self->rel_owner);
    Py_CLEAR(self->null);
    Py_CLEAR(self->mism);
    Py_CLEAR(self->sh);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->held);
    Py_CLEAR(self->ended);
    Py_CLEAR(self->nonrequest);
    Py_CLEAR(self->leased);
    Py_CLEAR(self->site_ids);
    for (int i = 0; i < SITE_CACHE; i++) {
        Py_CLEAR(self->site_key[i]);
    }
    return 0;
}

static void
Table_dealloc(Table *self)
{
    PyObject_GC_UnTrack(self);
    Table_clear(self);
    Py_buffer *bufs[] = {&self->nown, &self->cached, &self->acq_step,
                         &self->acq_site, &self->rel_step, &self->rel_site};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        if (bufs[i]->obj != NULL) {
            PyBuffer_Release(bufs[i]);
        }
    }
    PyMem_Free(self->seen);
    PyMem_Free(self->scratch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Table_init(Table *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"shadow", "mismatched", "counters", NULL};
    PyObject *sh, *mism, *counters;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!", kwlist, &sh, &PySet_Type, &mism,
                                     &PyDict_Type, &counters)) {
        return -1;
    }
    PyObject *num = PyObject_GetAttrString(sh, "num_blocks");
    if (num == NULL) {
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(num);
    Py_DECREF(num);
    if (n < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "Table: negative num_blocks");
        }
        return -1;
    }
    self->ready = 0; /* until every field below is set */
    self->n = n;
    for (int i = 0; i < SITE_CACHE; i++) { /* (site_ids may be another dict now) */
        Py_CLEAR(self->site_key[i]);
    }
    struct {
        const char *name;
        PyObject **slot;
        PyTypeObject *type;
    } objs[] = {
        {"own0", &self->own0, &PyList_Type},       {"own1", &self->own1, &PyList_Type},
        {"more", &self->more, &PyDict_Type},
        {"hashes", &self->hashes, &PyList_Type},   {"acq_owner", &self->acq_owner, &PyList_Type},
        {"rel_owner", &self->rel_owner, &PyList_Type}, {"null", &self->null, &PyFrozenSet_Type},
        {"held", &self->held, &HeldMapType},       {"_site_ids", &self->site_ids, &PyDict_Type},
        {"ended", &self->ended, &PyDict_Type},
        {"nonrequest", &self->nonrequest, &PySet_Type},
        {"leased", &self->leased, &PyDict_Type},
    };
    for (size_t i = 0; i < sizeof(objs) / sizeof(objs[0]); i++) {
        PyObject *o = PyObject_GetAttrString(sh, objs[i].name);
        if (o == NULL) {
            return -1;
        }
        if (!Py_IS_TYPE(o, objs[i].type)
            || (objs[i].type == &PyList_Type && PyList_GET_SIZE(o) != n)) {
            PyErr_Format(PyExc_TypeError, "Table: shadow.%s is not a %s of %zd items",
                         objs[i].name, objs[i].type->tp_name, n);
            Py_DECREF(o);
            return -1;
        }
        Py_XSETREF(*objs[i].slot, o);
    }
    Py_XSETREF(self->mism, Py_NewRef(mism));
    Py_XSETREF(self->sh, Py_NewRef(sh));
    Py_XSETREF(self->counters, Py_NewRef(counters));
    if (PySet_GET_SIZE(self->null) > (Py_ssize_t)(sizeof(self->null_ids) / sizeof(self->null_ids[0]))) {
        PyErr_SetString(PyExc_ValueError, "Table: more null blocks than supported");
        return -1;
    }
    self->n_null = 0;
    {
        PyObject *it = PyObject_GetIter(self->null), *item;
        if (it == NULL) {
            return -1;
        }
        while ((item = PyIter_Next(it)) != NULL) {
            Py_ssize_t v = PyLong_AsSsize_t(item);
            Py_DECREF(item);
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(it);
                return -1;
            }
            self->null_ids[self->n_null++] = v;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    struct {
        const char *name;
        Py_buffer *view;
        Py_ssize_t itemsize;
    } bufs[] = {
        {"nown", &self->nown, 4},         {"cached", &self->cached, 1},
        {"acq_step", &self->acq_step, 4}, {"acq_site", &self->acq_site, 2},
        {"rel_step", &self->rel_step, 4}, {"rel_site", &self->rel_site, 2},
    };
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        PyObject *o = PyObject_GetAttrString(sh, bufs[i].name);
        if (o == NULL) {
            return -1;
        }
        if (bufs[i].view->obj != NULL) {
            PyBuffer_Release(bufs[i].view);
        }
        int r = get_buf(o, bufs[i].view, n, bufs[i].itemsize, bufs[i].name);
        Py_DECREF(o);
        if (r < 0) {
            return -1;
        }
    }
    PyMem_Free(self->seen);
    self->seen = PyMem_Calloc(n > 0 ? (size_t)n / 8 + 1 : 1, 1);
    if (self->seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

#define NOWN(t) ((int *)(t)->nown.buf)
#define CACHED(t) ((unsigned char *)(t)->cached.buf)
#define I32(v) ((int *)(v).buf)
#define U16(v) ((unsigned short *)(v).buf)

/* an int attribute of an engine block: 0 ok, -1 error, 1 not an int */
static inline int
int_attr(PyObject *obj, int name, Py_ssize_t *out)
{
    if (small_int(peek(obj, name), out)) {
        return 0;
    }
    PyObject *v = get_field(obj, name);
    if (v == NULL) {
        return -1;
    }
    if (!PyLong_CheckExact(v)) {
        Py_DECREF(v);
        return 1;
    }
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* 1 / 0: the attribute is / is not None; -1 error */
static inline int
attr_is_none(PyObject *obj, int name)
{
    PyObject *p = peek(obj, name);
    if (p != NULL) {
        return p == Py_None;
    }
    PyObject *v = get_field(obj, name);
    if (v == NULL) {
        return -1;
    }
    int r = v == Py_None;
    Py_DECREF(v);
    return r;
}

static inline int
attr_true(PyObject *obj, int name)
{
    PyObject *p = peek(obj, name);
    if (p == Py_True || p == Py_False) {
        return p == Py_True;
    }
    return truth_of(get_field(obj, name));
}

/* 1: ``b`` is one of the table's null blocks or in the mismatch set */
/* a block's id and engine count: 1 both read and the id within the table,
 * 0 not usable here (not ints, or an id out of range: the Python path), -1
 * error */
static inline int
id_and_ref(Table *t, PyObject *blk, Py_ssize_t *b, Py_ssize_t *ref)
{
    int r = int_attr(blk, A_BLOCK_ID, b);
    if (r == 0) {
        r = int_attr(blk, A_REF_CNT, ref);
    }
    if (r < 0) {
        return -1;
    }
    return r == 0 && *b >= 0 && *b < t->n;
}

static inline int
is_null_id(Table *t, Py_ssize_t b)
{
    for (int i = 0; i < t->n_null; i++) {
        if (t->null_ids[i] == b) {
            return 1;
        }
    }
    return 0;
}

static int
special(Table *t, Py_ssize_t b)
{
    if (is_null_id(t, b)) {
        return 1;
    }
    int in_mism = PySet_GET_SIZE(t->mism) != 0;
    int in_lease = t->leased != NULL && PyDict_GET_SIZE(t->leased) != 0;
    if (!in_mism && !in_lease) {
        return 0;
    }
    PyObject *key = PyLong_FromSsize_t(b);
    if (key == NULL) {
        return -1;
    }
    /* a block with an unresolved count mismatch, or under a transfer's
     * lease: the Python checker takes the event */
    int r = in_mism ? PySet_Contains(t->mism, key) : 0;
    if (r == 0 && in_lease) {
        r = PyDict_Contains(t->leased, key);
    }
    Py_DECREF(key);
    return r;
}

/* the table's lists still have one item per block (nothing in kvsan resizes
 * them; checked on every call all the same: an index is never out of range) */
static int
table_ok(Table *t)
{
    if (!t->ready || PyList_GET_SIZE(t->own0) != t->n || PyList_GET_SIZE(t->own1) != t->n
        || PyList_GET_SIZE(t->hashes) != t->n || PyList_GET_SIZE(t->acq_owner) != t->n
        || PyList_GET_SIZE(t->rel_owner) != t->n || t->seen == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvsan._native._shadowfast: the shadow table changed size or was not set up");
        return 0;
    }
    return 1;
}

/* list[i] = v: in line for the table's own lists (a call to PyList_SetItem
 * per store would be 8 of a 4-block touch's calls), PyList_SetItem otherwise */
static inline int
set_list(PyObject *list, Py_ssize_t i, PyObject *v)
{
    Py_INCREF(v);
    if (PyList_CheckExact(list) && (size_t)i < (size_t)PyList_GET_SIZE(list)) {
        PyObject *old = PyList_GET_ITEM(list, i);
        PyList_SET_ITEM(list, i, v);
        Py_XDECREF(old);
        return 0;
    }
    return PyList_SetItem(list, i, v);
}

/* ``o == owner`` as Python's ``==`` (1, 0, -1 error), without a call when
 * both are strs, as owners are: the pointer first (a request's id is one
 * str from its first reference to its last), then what str's own equality
 * compares (length, kind, bytes).  A shared block's release compares
 * its first owner with the one leaving. */
static inline int
same_owner(PyObject *o, PyObject *owner)
{
    if (o == owner) {
        return 1;
    }
    if (PyUnicode_CheckExact(o) && PyUnicode_CheckExact(owner)
#if PY_VERSION_HEX < 0x030C0000 /* (every str is ready from 3.12 on) */
        && PyUnicode_IS_READY(o) && PyUnicode_IS_READY(owner)
#endif
    ) {
        return str_same(o, owner);
    }
    return PyObject_RichCompareBool(o, owner, Py_EQ);
}

/* index of ``owner`` in list ``lst``, -1 if absent, -2 on error.  The
 * pointer is compared first, over the whole list: a request's id is one str
 * object from its first reference to its last, so this almost always finds
 * it; equal but distinct strs are found by a second pass.  A block shared by
 * every live request (a system prompt) has hundreds of extra owners, and a
 * comparison per owner per released block made a request's end cost
 * milliseconds at 1024 sharers. */
static Py_ssize_t
find_owner(PyObject *lst, PyObject *owner)
{
    Py_ssize_t n = PyList_GET_SIZE(lst);
    PyObject **items = ((PyListObject *)lst)->ob_item;
    for (Py_ssize_t j = 0; j < (n + 1) / 2; j++) { /* from both ends: the oldest
                                                     * and the newest sharers end first */
        if (items[j] == owner) {
            return j;
        }
        if (items[n - 1 - j] == owner) {
            return n - 1 - j;
        }
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(lst); j++) {
        int r = same_owner(PyList_GET_ITEM(lst, j), owner);
        if (r != 0) {
            return r < 0 ? -2 : j;
        }
    }
    return -1;
}

/* block ``b``'s key in ``more``, a new reference: the engine block's own
 * block_id int, which the engine keeps for the pool's life (a new int per
 * shared block cost 32 bytes, and an allocation per lookup), or a new int
 * where ``blk`` is NULL or no longer gives this id */
static PyObject *
block_key(PyObject *blk, Py_ssize_t b)
{
    PyObject *key = blk != NULL ? get_field(blk, A_BLOCK_ID) : NULL;
    if (key == NULL || !PyLong_CheckExact(key) || PyLong_AsSsize_t(key) != b) {
        PyErr_Clear();
        Py_XDECREF(key);
        key = PyLong_FromSsize_t(b);
    }
    return key;
}

/* ``owner`` is an owner of ``b`` (engine block ``blk``, or NULL): 1 as
 * own0, 4 as own1, 2 in more's list (its index there in *pos_out), 3 as
 * more's one further owner, 0 not, -1 error */
static int
owns(Table *t, Py_ssize_t b, PyObject *blk, PyObject *owner, PyObject **extra_out,
     Py_ssize_t *pos_out)
{
    *extra_out = NULL;
    PyObject *o = PyList_GET_ITEM(t->own0, b);
    if (o == Py_None) {
        return 0;
    }
    int r = same_owner(o, owner);
    if (r != 0) {
        return r;
    }
    o = PyList_GET_ITEM(t->own1, b);
    if (o == Py_None) {
        return 0;
    }
    r = same_owner(o, owner);
    if (r != 0) {
        return r > 0 ? 4 : r;
    }
    if (NOWN(t)[b] < 3) {
        return 0; /* no third owner (nown counts the owners: own0, own1, more's) */
    }
    PyObject *key = block_key(blk, b);
    if (key == NULL) {
        return -1;
    }
    PyObject *extra = PyDict_GetItemWithError(t->more, key);
    Py_DECREF(key);
    if (extra == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyList_CheckExact(extra)) { /* the one further owner */
        r = same_owner(extra, owner);
        if (r > 0) {
            *extra_out = extra;
            return 3;
        }
        return r;
    }
    Py_ssize_t j = find_owner(extra, owner);
    if (j >= 0) {
        *extra_out = extra;
        *pos_out = j;
        return 2;
    }
    return j == -1 ? 0 : -1;
}

/* Take the owner at index ``j`` (-1: the last) out of ``extra``, block
 * ``key``'s entry in ``more`` (borrowed), and return it (a new reference).
 * A list left with one owner becomes that owner; an emptied entry goes. */
static PyObject *
pop_extra(Table *t, PyObject *key, PyObject *extra, Py_ssize_t j)
{
    if (!PyList_CheckExact(extra)) { /* the one further owner */
        PyObject *got = Py_NewRef(extra);
        if (PyDict_DelItem(t->more, key) < 0) {
            Py_DECREF(got);
            return NULL;
        }
        return got;
    }
    Py_ssize_t n = PyList_GET_SIZE(extra);
    if (j < 0) {
        j = n - 1;
    }
    if (j < 0 || j >= n) {
        PyErr_SetString(PyExc_RuntimeError, "kvsan._native._shadowfast: owner vanished");
        return NULL;
    }
    PyObject *got = Py_NewRef(PyList_GET_ITEM(extra, j));
    int r;
    if (n == 2) { /* (the dict takes the other before it lets the list go) */
        r = PyDict_SetItem(t->more, key, PyList_GET_ITEM(extra, 1 - j));
    } else if (n == 1) {
        r = PyDict_DelItem(t->more, key);
    } else {
        r = PyList_SetSlice(extra, j, j + 1, NULL);
    }
    if (r < 0) {
        Py_DECREF(got);
        return NULL;
    }
    return got;
}

/* ---- the event's bookkeeping (what AllocatorChecker / ShadowTable do in
 * Python after an event: counters, totals, held counts, site ids) ---- */
enum { K_ALLOCATED, K_EVICTED, K_SHARED, K_RELEASED, K_N_OWNED, K_N_CACHED_FREE, K_UNHOLD,
       K_SITE_ID, N_KEYS };
static const char *key_names[N_KEYS] = {"allocated", "evicted", "shared", "released",
                                        "_n_owned", "_n_cached_free", "_unhold",
                                        "site_id"};
static PyObject *keys[N_KEYS];

/* dict[key] += d, a missing key counting 0 (collections.Counter's +=) */
static int
dict_add(PyObject *dict, PyObject *key, Py_ssize_t d)
{
    PyObject *had = PyDict_GetItemWithError(dict, key); /* borrowed */
    if (had == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *dv = PyLong_FromSsize_t(d);
    if (dv == NULL) {
        return -1;
    }
    PyObject *v = had == NULL ? Py_NewRef(dv) : PyNumber_Add(had, dv);
    Py_DECREF(dv);
    if (v == NULL) {
        return -1;
    }
    int r = PyDict_SetItem(dict, key, v);
    Py_DECREF(v);
    return r;
}

/* obj.name += d */
static int
attr_add(PyObject *obj, PyObject *name, Py_ssize_t d)
{
    PyObject *had = PyObject_GetAttr(obj, name);
    if (had == NULL) {
        return -1;
    }
    PyObject *dv = PyLong_FromSsize_t(d);
    PyObject *v = dv == NULL ? NULL : PyNumber_Add(had, dv);
    Py_DECREF(had);
    Py_XDECREF(dv);
    if (v == NULL) {
        return -1;
    }
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

/* the shadow's method keys[name](owner, k), its result dropped */
static int
call_shadow(Table *t, int name, PyObject *owner, Py_ssize_t k)
{
    PyObject *kv = PyLong_FromSsize_t(k);
    if (kv == NULL) {
        return -1;
    }
    PyObject *r = PyObject_CallMethodObjArgs(t->sh, keys[name], owner, kv, NULL);
    Py_DECREF(kv);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* the owner's held count after it took (``sign`` +1) or dropped (-1) ``k``
 * references, as the shadow's ``_hold`` / ``_unhold`` keep it: an owner's
 * first references make its entry (stamped with the time and ``step``), a
 * count change is a store into it, its last references forget it (held,
 * ended, nonrequest).  Anything odd (an owner dropping what it does not
 * hold) goes through the Python method, which raises or decides there. */
static int
held_add(Table *t, PyObject *owner, Py_ssize_t k, int sign, int step)
{
    if (!k) {
        return 0;
    }
    HeldMap *m = (HeldMap *)t->held;
    if (sign > 0) {
        return held_take(m, owner, k, step);
    }
    HeldEntry *e = held_get(m, owner);
    if (e == NULL) {
        if (PyErr_Occurred()) {
            return -1;
        }
        return call_shadow(t, K_UNHOLD, owner, k);
    }
    if (e->n != k) {
        e->n -= k;
        return 0;
    }
    held_remove(m, e); /* _unhold of its last references */
    if (PyDict_GET_SIZE(t->ended) != 0) { /* ended.pop(owner, None): empty but for leaks */
        int had = PyDict_Contains(t->ended, owner);
        if (had < 0 || (had == 1 && PyDict_DelItem(t->ended, owner) < 0)) {
            return -1;
        }
    }
    if (PySet_GET_SIZE(t->nonrequest) == 0) {
        return 0;
    }
    return PySet_Discard(t->nonrequest, owner) < 0 ? -1 : 0;
}

/* shadow.site_id(site): a known site is a dict lookup, anything else goes
 * through Python (a new site is interned there); -1 with an exception */
static int
site_id(Table *t, PyObject *site)
{
    size_t p = (size_t)site;
    size_t at = ((p >> 4) ^ (p >> 9) ^ (p >> 15)) & (SITE_CACHE - 2); /* the set's first way */
    if (t->site_key[at] == site) {
        return t->site_val[at];
    }
    if (t->site_key[at + 1] == site) {
        return t->site_val[at + 1];
    }
    PyObject *sid = PyUnicode_CheckExact(site) ? PyDict_GetItemWithError(t->site_ids, site)
                                               : NULL;
    if (sid == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (sid != NULL) {
        long v = PyLong_AsLong(sid);
        if (v >= 0 && v <= USHRT_MAX) {
            /* the newest in the first way, the one it displaces in the second */
            Py_XSETREF(t->site_key[at + 1], t->site_key[at]);
            t->site_val[at + 1] = t->site_val[at];
            t->site_key[at] = Py_NewRef(site);
            t->site_val[at] = (int)v;
            return (int)v;
        }
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "kvsan._native._shadowfast: site id out of range");
        }
        return -1;
    }
    PyObject *got = PyObject_CallMethodObjArgs(t->sh, keys[K_SITE_ID], site, NULL);
    if (got == NULL) {
        return -1;
    }
    long v = PyLong_AsLong(got);
    Py_DECREF(got);
    if (v < 0 || v > USHRT_MAX) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "kvsan._native._shadowfast: site id out of range");
        }
        return -1;
    }
    return (int)v;
}

/* settle() adds the bookkeeping kept here to the checker's counters and
 * the shadow's totals.  Per event, two dict updates and two attribute
 * updates on cold Python objects cost more than the event's own checks, so
 * the table keeps them as C integers until something reads them: the
 * shadow's ``n_owned`` / ``n_cached_free`` and the checker's ``counters``
 * call settle() first (kvsan.shadow.ShadowTable.settle). */
static PyObject *
Table_settle(Table *t, PyObject *Py_UNUSED(unused))
{
    if (t->counters == NULL || t->sh == NULL) {
        Py_RETURN_NONE;
    }
    for (int i = 0; i < 4; i++) {
        long long d = t->d_count[i];
        if (d) {
            t->d_count[i] = 0;
            if (dict_add(t->counters, keys[i], (Py_ssize_t)d) < 0) {
                t->d_count[i] = d;
                return NULL;
            }
        }
    }
    long long d = t->d_owned;
    if (d) {
        t->d_owned = 0;
        if (attr_add(t->sh, keys[K_N_OWNED], (Py_ssize_t)d) < 0) {
            t->d_owned = d;
            return NULL;
        }
    }
    d = t->d_cached_free;
    if (d) {
        t->d_cached_free = 0;
        if (attr_add(t->sh, keys[K_N_CACHED_FREE], (Py_ssize_t)d) < 0) {
            t->d_cached_free = d;
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* what AllocatorChecker's counters and ShadowTable.acquired / released do
 * for an event applied here: counters[counter] += k (and "evicted" when
 * some were), the totals, and the owner's held count (``sign`` +1 for
 * references taken, -1 for references dropped) */
static int
bookkeep(Table *t, int counter, Py_ssize_t k, Py_ssize_t evicted, PyObject *owner,
         Py_ssize_t d_owned, Py_ssize_t d_cached_free, int sign, int step)
{
    t->d_count[counter] += k;
    t->d_count[K_EVICTED] += evicted;
    t->d_owned += d_owned;
    t->d_cached_free += d_cached_free;
    return held_add(t, owner, k, sign, step);
}

/* METH_FASTCALL arguments, checked as PyArg_ParseTuple's "O!" (a list),
 * "U" (a str) and "i" (an int) would (its tuple and format string cost more
 * than the event itself on a small call) */
static int
n_args(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", fn, want,
                 nargs);
    return 0;
}

static int
list_arg(const char *fn, int pos, PyObject *o)
{
    if (PyList_Check(o)) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s() argument %d must be list, not %.50s", fn, pos,
                 Py_TYPE(o)->tp_name);
    return 0;
}

static int
str_arg(const char *fn, int pos, PyObject *o)
{
    if (PyUnicode_Check(o)) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s() argument %d must be str, not %.50s", fn, pos,
                 Py_TYPE(o)->tp_name);
    return 0;
}

static int
int_arg(const char *fn, int pos, PyObject *o, int *out)
{
    Py_ssize_t small; /* the step: an int of one digit for the first 2**30 steps */
    if (small_int(o, &small)) {
        *out = (int)small;
        return 1;
    }
    long v = PyLong_Check(o) ? PyLong_AsLong(o) : -1;
    if (!PyLong_Check(o) || (v == -1 && PyErr_Occurred()) || v < INT_MIN || v > INT_MAX) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s() argument %d must be an int in C int range", fn,
                         pos);
        }
        return 0;
    }
    *out = (int)v;
    return 1;
}

/* an event's per-block arrays: the table's own buffer, kept between calls
 * (an allocation and a free per event otherwise), or a fresh one when the
 * buffer is in use (an event method running inside another's Python
 * callback); give it back with scratch_put.  NULL with MemoryError. */
static void *
scratch_get(Table *t, size_t bytes)
{
    if (bytes == 0) {
        bytes = 1;
    }
    if (t->scratch_busy) {
        void *p = PyMem_Malloc(bytes);
        if (p == NULL) {
            PyErr_NoMemory();
        }
        return p;
    }
    if (bytes > t->scratch_cap) {
        size_t cap = t->scratch_cap ? t->scratch_cap : 256;
        while (cap < bytes) {
            cap *= 2;
        }
        void *p = PyMem_Realloc(t->scratch, cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        t->scratch = p;
        t->scratch_cap = cap;
    }
    t->scratch_busy = 1;
    return t->scratch;
}

static void
scratch_put(Table *t, void *p)
{
    if (p == t->scratch) {
        t->scratch_busy = 0;
    } else {
        PyMem_Free(p);
    }
}

/* the arguments every event method takes: (blocks, owner, step, site), and a
 * scratch array of ``slots`` entries per block of the call (the block ids,
 * then whatever else the event keeps per block), NULL with an exception */
static Py_ssize_t *
event_args(Table *t, const char *fn, PyObject *const *args, Py_ssize_t nargs,
           PyObject **blocks, PyObject **owner, int *step, int *site, size_t slots)
{
    if (!n_args(fn, nargs, 4) || !list_arg(fn, 1, args[0]) || !str_arg(fn, 2, args[1])
        || !int_arg(fn, 3, args[2], step) || !table_ok(t)) {
        return NULL;
    }
    *blocks = args[0];
    *owner = args[1];
    *site = site_id(t, args[3]);
    if (*site == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(*blocks);
    return scratch_get(t, (size_t)k * slots * sizeof(Py_ssize_t));
}

/* allocate(blocks, owner, step, site) -> list of evicted block ids, or None
 * (not clean: run the Python checker).  Fresh blocks from the free queue:
 * each unowned in the table, engine count 1, met once. */
static PyObject *
allocate_impl(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *dest)
{
    Table *t = (Table *)self;
    PyObject *blocks, *owner;
    int step, site;
    Py_ssize_t *ids = event_args(t, "allocate", args, nargs, &blocks, &owner, &step, &site, 1);
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(blocks);
    int *nown = NOWN(t);
    Py_ssize_t i, marked = 0;
    int clean = 1;
    for (i = 0; i < k && clean; i++) {
        PyObject *blk = PyList_GET_ITEM(blocks, i);
        Py_ssize_t b = 0, ref = 0; /* (set by id_and_ref where it returns 1) */
        int r = id_and_ref(t, blk, &b, &ref);
        if (r < 0) {
            goto error;
        }
        if (!r || ref != 1 || nown[b] != 0 || SEEN(t, b)
            || PyList_GET_ITEM(t->own0, b) != Py_None) {
            clean = 0;
            break;
        }
        int s = special(t, b);
        if (s < 0) {
            goto error;
        }
        if (s) {
            clean = 0;
            break;
        }
        SEEN_SET(t, b);
        ids[marked++] = b;
    }
    for (i = 0; i < marked; i++) {
        SEEN_CLR(t, ids[i]);
    }
    if (!clean) {
        scratch_put(t, ids);
        Py_RETURN_NONE;
    }
    /* the evicted ids: into ``dest`` (the C API), else the result */
    PyObject *evicted = dest != NULL ? Py_NewRef(dest) : PyList_New(0);
    if (evicted == NULL) {
        goto error_nomarks;
    }
    Py_ssize_t ne0 = PyList_GET_SIZE(evicted);
    unsigned char *cached = CACHED(t);
    for (i = 0; i < k; i++) {
        Py_ssize_t b = ids[i];
        if (cached[b]) {
            PyObject *id = PyLong_FromSsize_t(b);
            if (id == NULL || PyList_Append(evicted, id) < 0) {
                Py_XDECREF(id);
                Py_DECREF(evicted);
                goto error_nomarks;
            }
            Py_DECREF(id);
            cached[b] = 0;
            if (set_list(t->hashes, b, Py_None) < 0) {
                Py_DECREF(evicted);
                goto error_nomarks;
            }
        }
        if (set_list(t->own0, b, owner) < 0 || set_list(t->acq_owner, b, owner) < 0) {
            Py_DECREF(evicted);
            goto error_nomarks;
        }
        nown[b] = 1;
        I32(t->acq_step)[b] = step;
        U16(t->acq_site)[b] = (unsigned short)site;
    }
    scratch_put(t, ids);
    Py_ssize_t ne = PyList_GET_SIZE(evicted) - ne0;
    if (bookkeep(t, K_ALLOCATED, k, ne, owner, k, -ne, 1, step) < 0) {
        Py_DECREF(evicted);
        return NULL;
    }
    if (dest != NULL) {
        Py_DECREF(evicted);
        Py_RETURN_TRUE;
    }
    return evicted;
error:
    for (Py_ssize_t j = 0; j < marked; j++) {
        SEEN_CLR(t, ids[j]);
    }
error_nomarks:
    scratch_put(t, ids);
    return NULL;
}

/* share(blocks, owner, step, site) -> (blocks taken, newly owned, of them
 * cached), or None.  Prefix hits: each non-null block met once, out of the
 * free queue, its engine count one more than its owners. */
static PyObject *
Table_allocate(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    return allocate_impl((PyObject *)t, args, nargs, NULL);
}

/* share(), the method (``lean`` 0) or the C API's (1: Py_True for a result) */
static PyObject *
share_impl(Table *t, PyObject *const *args, Py_ssize_t nargs, int lean)
{
    PyObject *blocks, *owner;
    int step, site;
    /* per block met: its id, and its place in ``blocks`` */
    Py_ssize_t *ids = event_args(t, "share", args, nargs, &blocks, &owner, &step, &site, 2);
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(blocks);
    Py_ssize_t *at = ids + k;
    int *nown = NOWN(t);
    Py_ssize_t i, m = 0;
    int clean = 1;
    for (i = 0; i < k && clean; i++) {
        PyObject *blk = PyList_GET_ITEM(blocks, i);
        int isnull = attr_true(blk, A_IS_NULL);
        if (isnull < 0) {
            goto error;
        }
        if (isnull) {
            continue; /* the hook leaves null blocks out */
        }
        Py_ssize_t b, ref;
        int r = id_and_ref(t, blk, &b, &ref);
        if (r < 0) {
            goto error;
        }
        int unlinked = r ? attr_is_none(blk, A_PREV_FREE) : 1;
        if (unlinked < 0) {
            goto error;
        }
        if (!r || !unlinked || SEEN(t, b) || ref != nown[b] + 1) {
            clean = 0;
            break;
        }
        int s = special(t, b);
        if (s < 0) {
            goto error;
        }
        if (s) {
            clean = 0;
            break;
        }
        SEEN_SET(t, b);
        at[m] = i;
        ids[m++] = b;
    }
    for (i = 0; i < m; i++) {
        SEEN_CLR(t, ids[i]);
    }
    if (!clean) {
        scratch_put(t, ids);
        Py_RETURN_NONE;
    }
    unsigned char *cached = CACHED(t);
    Py_ssize_t newly = 0, claimed = 0;
    for (i = 0; i < m; i++) {
        Py_ssize_t b = ids[i];
        if (PyList_GET_ITEM(t->own0, b) == Py_None) {
            if (set_list(t->own0, b, owner) < 0) {
                goto error_nomarks;
            }
            newly++;
            if (cached[b]) {
                claimed++;
            }
        } else if (PyList_GET_ITEM(t->own1, b) == Py_None) {
            /* a second owner (a prefix hit): a store in a list, where a dict
             * entry was a hash insert here and a delete at its release */
            if (set_list(t->own1, b, owner) < 0) {
                goto error_nomarks;
            }
        } else {
            /* keyed by the block's own id, an int the engine keeps for the
             * pool's life: a new int per shared block cost 32 bytes (a new
             * one only if the block no longer gives this id) */
            PyObject *key = block_key(
                at[i] < PyList_GET_SIZE(blocks) ? PyList_GET_ITEM(blocks, at[i]) : NULL, b);
            if (key == NULL) {
                goto error_nomarks;
            }
            /* the first further owner goes in with the lookup itself (one
             * hash lookup, not two); an entry already there is held across
             * the allocation below (a collection may run) */
            Py_ssize_t had = PyDict_GET_SIZE(t->more);
            PyObject *got = PyDict_SetDefault(t->more, key, owner); /* borrowed */
            PyObject *extra = got != NULL && PyDict_GET_SIZE(t->more) == had ? Py_NewRef(got)
                                                                              : NULL;
            int r;
            if (got == NULL) {
                r = -1;
            } else if (extra == NULL) {
                r = 0; /* the first further owner, now in */
            } else if (PyList_CheckExact(extra)) {
                r = PyList_Append(extra, owner);
            } else if (extra != NULL) { /* a second further owner: a list of both */
                PyObject *lst = PyList_New(2);
                r = lst == NULL ? -1 : 0;
                if (lst != NULL) {
                    /* a list of owner strs holds no container: it can be in
                     * no reference cycle, and left tracked, the thousands
                     * that live from a prefix hit to its release make the
                     * collector run (and walk them) every few steps */
                    PyObject_GC_UnTrack(lst);
                    PyList_SET_ITEM(lst, 0, Py_NewRef(extra));
                    PyList_SET_ITEM(lst, 1, Py_NewRef(owner));
                    r = PyDict_SetItem(t->more, key, lst);
                    Py_DECREF(lst);
                }
            }
            Py_XDECREF(extra);
            Py_DECREF(key);
            if (r < 0) {
                goto error_nomarks;
            }
        }
        nown[b] += 1;
        if (set_list(t->acq_owner, b, owner) < 0) {
            goto error_nomarks;
        }
        I32(t->acq_step)[b] = step;
        U16(t->acq_site)[b] = (unsigned short)site;
    }
    scratch_put(t, ids);
    if (bookkeep(t, K_SHARED, m, 0, owner, newly, -claimed, 1, step) < 0) {
        return NULL;
    }
    if (lean) {
        Py_RETURN_TRUE;
    }
    PyObject *out[3] = {PyLong_FromSsize_t(m), PyLong_FromSsize_t(newly),
                        PyLong_FromSsize_t(claimed)};
    return tuple_steal(3, out);
error:
    for (Py_ssize_t j = 0; j < m; j++) {
        SEEN_CLR(t, ids[j]);
    }
error_nomarks:
    scratch_put(t, ids);
    return NULL;
}

static PyObject *
Table_share(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    return share_impl(t, args, nargs, 0);
}

static PyObject *
capi_share(PyObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    return share_impl((Table *)t, args, nargs, 1);
}

/* snapshot(blocks, pool) -> list of (ref << 1 | linked) per block, None for
 * a null block; or None when the call is not simple (a block of another
 * pool, a block met twice, a non-int count): the hook then reads the
 * blocks itself. */
/* snapshot's work into ``out`` (k entries: ref << 1 | linked, -1 for a
 * null block): 1 simple, 0 not (see snapshot), -1 error */
static int
snapshot_core(Table *t, PyObject *blocks, PyObject *pool, long long *out)
{
    Py_ssize_t k = PyList_GET_SIZE(blocks);
    Py_ssize_t *ids = scratch_get(t, (size_t)k * sizeof(Py_ssize_t));
    if (ids == NULL) {
        return -1;
    }
    Py_ssize_t i, m = 0;
    int clean = 1, err = 0;
    for (i = 0; i < k; i++) {
        PyObject *blk = PyList_GET_ITEM(blocks, i);
        PyObject *bp = peek(blk, A_POOL), *got = NULL; /* got: get_field's reference */
        if (bp == NULL && (bp = got = get_field(blk, A_POOL)) == NULL) {
            err = 1;
            break;
        }
        int ours = bp == Py_None || bp == pool;
        Py_XDECREF(got);
        if (!ours) {
            clean = 0;
            break;
        }
        int isnull = attr_true(blk, A_IS_NULL);
        if (isnull < 0) {
            err = 1;
            break;
        }
        if (isnull) {
            out[i] = -1;
            continue;
        }
        Py_ssize_t b = 0, ref = 0;
        int r = id_and_ref(t, blk, &b, &ref);
        if (r < 0) {
            err = 1;
            break;
        }
        int unlinked = r ? attr_is_none(blk, A_PREV_FREE) : 1;
        if (unlinked < 0) {
            err = 1;
            break;
        }
        if (!r || SEEN(t, b) || ref < 0) {
            clean = 0;
            break;
        }
        SEEN_SET(t, b);
        ids[m++] = b;
        out[i] = (long long)ref * 2 + (unlinked ? 0 : 1);
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        SEEN_CLR(t, ids[j]);
    }
    scratch_put(t, ids);
    return err ? -1 : clean;
}

/* the C API's snapshot: into ``out``, k entries */
static int
capi_snapshot(PyObject *t, PyObject *blocks, PyObject *pool, long long *out)
{
    if (!PyList_Check(blocks) || !table_ok((Table *)t)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "snapshot(list of blocks, pool)");
        }
        return -1;
    }
    return snapshot_core((Table *)t, blocks, pool, out);
}

/* snapshot's entries as the method's list (None for a null block) */
static PyObject *
snapshot_list(const long long *snap, Py_ssize_t k)
{
    PyObject *out = PyList_New(k);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *v = snap[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(snap[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *
Table_snapshot(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!n_args("snapshot", nargs, 2) || !list_arg("snapshot", 1, args[0]) || !table_ok(t)) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(args[0]);
    long long *snap = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(long long));
    if (snap == NULL) {
        return PyErr_NoMemory();
    }
    int r = snapshot_core(t, args[0], args[1], snap);
    PyObject *out = r < 0 ? NULL : r == 0 ? Py_NewRef(Py_None) : snapshot_list(snap, k);
    PyMem_Free(snap);
    return out;
}

/* release(blocks, snap, owner, step, site) -> (references dropped, freed
 * block ids, blocks left unowned, of them cached), or None.  Each block's
 * engine count dropped by one from ``snap``, ``owner`` held it, the count
 * left equals the owners left, and a block back in the free queue was not
 * in it before and has no owner left. */
static PyObject *
release_core(Table *t, PyObject *blocks, const long long *snap, PyObject *const *args,
             PyObject *dest)
{
    int step;
    if (!str_arg("release", 3, args[0]) || !int_arg("release", 4, args[1], &step)
        || !table_ok(t)) {
        return NULL;
    }
    PyObject *owner = args[0];
    int site = site_id(t, args[2]);
    if (site == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(blocks);
    /* per released block: its id, whether it goes back unhashed, how the
     * owner held it (1 first owner, 4 second, 2 in a ``more`` list, 3
     * ``more``'s one further owner) and that ``more`` entry (borrowed: only this block's
     * entry changes it, and each block is met once) */
    Py_ssize_t n1 = k ? k : 1;
    Py_ssize_t *ids = scratch_get(t, (size_t)n1 * (5 * sizeof(Py_ssize_t) + sizeof(PyObject *)));
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t *freed_flag = ids + n1, *how = ids + 2 * n1, *pos = ids + 3 * n1;
    Py_ssize_t *where = ids + 4 * n1; /* its place in ``blocks`` */
    PyObject **extras = (PyObject **)(ids + 5 * n1);
    int *nown = NOWN(t);
    unsigned char *cached = CACHED(t);
    Py_ssize_t i, m = 0;
    int clean = 1;
    for (i = 0; i < k; i++) {
        if (snap[i] < 0) {
            continue; /* a null block */
        }
        PyObject *blk = PyList_GET_ITEM(blocks, i);
        Py_ssize_t b = 0, ref = 0, before = (Py_ssize_t)snap[i];
        int linked_before = (int)(before & 1);
        Py_ssize_t ref_before = (before - linked_before) / 2;
        int r = id_and_ref(t, blk, &b, &ref);
        if (r < 0) {
            goto error;
        }
        if (!r || SEEN(t, b) || ref != ref_before - 1 || ref < 0 || ref != nown[b] - 1) {
            clean = 0; /* a block met twice: the Python checker sorts it out */
            break;
        }
        PyObject *extra;
        Py_ssize_t at = -1;
        int o = owns(t, b, blk, owner, &extra, &at);
        if (o < 0) {
            goto error;
        }
        int s = o ? special(t, b) : 0;
        if (s < 0) {
            goto error;
        }
        if (!o || s) {
            clean = 0;
            break;
        }
        freed_flag[m] = 0;
        if (ref == 0) {
            int unlinked = attr_is_none(blk, A_PREV_FREE);
            int nohash = unlinked < 0 ? -1 : attr_is_none(blk, A_BLOCK_HASH);
            if (nohash < 0) {
                goto error;
            }
            if (!unlinked && linked_before) {
                clean = 0; /* inserted twice into the free queue */
                break;
            }
            if (nohash) {
                if (cached[b]) {
                    clean = 0; /* a cache entry dropped behind kvsan's back */
                    break;
                }
                freed_flag[m] = 1;
            }
        }
        SEEN_SET(t, b);
        how[m] = o;
        where[m] = i;
        pos[m] = at;
        extras[m] = extra;
        ids[m++] = b;
    }
    for (i = 0; i < m; i++) {
        SEEN_CLR(t, ids[i]);
    }
    if (!clean) {
        scratch_put(t, ids);
        Py_RETURN_NONE;
    }
    /* the freed ids: into ``dest`` (the C API), else the result */
    PyObject *freed = dest != NULL ? Py_NewRef(dest) : PyList_New(0);
    if (freed == NULL) {
        scratch_put(t, ids);
        return NULL;
    }
    Py_ssize_t unowned = 0, unowned_cached = 0;
    for (i = 0; i < m; i++) {
        Py_ssize_t b = ids[i];
        PyObject *extra = extras[i];
        PyObject *key = NULL; /* made when a dict or the freed list needs it */
        if (how[i] == 1 || how[i] == 4) {
            /* the first or second owner leaves: the last of ``more``'s takes
             * its place; else the second moves up (the first leaves) or
             * goes (the second leaves) */
            PyObject *slot = how[i] == 1 ? t->own0 : t->own1;
            extra = NULL;
            if (nown[b] > 2) {
                key = block_key(PyList_GET_ITEM(blocks, where[i]), b);
                if (key == NULL) {
                    goto error_freed;
                }
                extra = PyDict_GetItemWithError(t->more, key);
                if (extra == NULL && PyErr_Occurred()) {
                    goto error_key;
                }
            }
            PyObject *o1 = PyList_GET_ITEM(t->own1, b);
            if (extra != NULL) {
                PyObject *next = pop_extra(t, key, extra, -1);
                if (next == NULL || PyList_SetItem(slot, b, next) < 0) {
                    goto error_key;
                }
            } else if (how[i] == 4) {
                if (set_list(t->own1, b, Py_None) < 0) {
                    goto error_key;
                }
            } else if (o1 != Py_None) { /* own0 = own1, which goes */
                if (set_list(t->own0, b, o1) < 0 || set_list(t->own1, b, Py_None) < 0) {
                    goto error_key;
                }
            } else {
                if (set_list(t->own0, b, Py_None) < 0) {
                    goto error_key;
                }
                unowned++;
                if (cached[b]) {
                    unowned_cached++;
                }
            }
        } else {
            /* the owner leaves more, at the index owns() found: only this
             * block's entry changes it, and each block is met once */
            key = block_key(PyList_GET_ITEM(blocks, where[i]), b);
            PyObject *gone = key == NULL ? NULL
                                         : pop_extra(t, key, extra, how[i] == 2 ? pos[i] : -1);
            if (gone == NULL) {
                goto vanished;
            }
            Py_DECREF(gone);
        }
        nown[b] -= 1;
        if (set_list(t->rel_owner, b, owner) < 0) {
            goto error_key;
        }
        I32(t->rel_step)[b] = step;
        U16(t->rel_site)[b] = (unsigned short)site;
        if (freed_flag[i]) {
            if (key == NULL
                && (key = block_key(PyList_GET_ITEM(blocks, where[i]), b)) == NULL) {
                goto error_freed;
            }
            if (PyList_Append(freed, key) < 0) {
                goto error_key;
            }
        }
        Py_XDECREF(key);
        continue;
    vanished:
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "kvsan._native._shadowfast: owner vanished");
        }
    error_key:
        Py_XDECREF(key);
        goto error_freed;
    }
    scratch_put(t, ids);
    if (bookkeep(t, K_RELEASED, m, 0, owner, -unowned, unowned_cached, -1, step) < 0) {
        Py_DECREF(freed);
        return NULL;
    }
    if (dest != NULL) {
        Py_DECREF(freed);
        Py_RETURN_TRUE;
    }
    PyObject *out[4] = {PyLong_FromSsize_t(m), freed, PyLong_FromSsize_t(unowned),
                        PyLong_FromSsize_t(unowned_cached)};
    return tuple_steal(4, out);
error_freed:
    Py_DECREF(freed);
    scratch_put(t, ids);
    return NULL;
error:
    for (Py_ssize_t j = 0; j < m; j++) {
        SEEN_CLR(t, ids[j]);
    }
    scratch_put(t, ids);
    return NULL;
}

/* the C API's release: ``snap`` as snapshot_core made it, args (owner,
 * step, site) */
static PyObject *
capi_release(PyObject *t, PyObject *blocks, const long long *snap, PyObject *const *args,
             PyObject *dest)
{
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "release(list of blocks, ...)");
        return NULL;
    }
    return release_core((Table *)t, blocks, snap, args, dest);
}

static PyObject *
Table_release(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!n_args("release", nargs, 5) || !list_arg("release", 1, args[0])
        || !list_arg("release", 2, args[1])) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != k) {
        Py_RETURN_NONE;
    }
    long long *snap = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(long long));
    if (snap == NULL) {
        return PyErr_NoMemory();
    }
    int simple = 1;
    for (Py_ssize_t i = 0; i < k; i++) { /* the snapshot's list: None or a count */
        PyObject *sv = PyList_GET_ITEM(args[1], i);
        long long v = sv == Py_None ? -1 : PyLong_AsLongLong(sv);
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(snap);
            return NULL;
        }
        if (v < 0 && sv != Py_None) {
            simple = 0; /* not a snapshot's: the Python checker decides */
        }
        snap[i] = v;
    }
    PyObject *out = simple ? release_core(t, args[0], snap, args + 2, NULL) : Py_NewRef(Py_None);
    PyMem_Free(snap);
    return out;
}

/* cache(blocks) -> (block ids given a cache key, of them unowned), or None.
 * Registers each non-null block whose key is set, as on_cached does. */
static PyObject *
cache_impl(PyObject *self, PyObject *arg, PyObject *dest)
{
    Table *t = (Table *)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "cache(list of blocks)");
        return NULL;
    }
    if (!table_ok(t)) {
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(arg);
    unsigned char *cached = CACHED(t);
    for (Py_ssize_t i = 0; i < k; i++) { /* check first: nothing half-done */
        PyObject *blk = PyList_GET_ITEM(arg, i);
        Py_ssize_t b;
        int r = int_attr(blk, A_BLOCK_ID, &b);
        if (r < 0) {
            return NULL;
        }
        if (r > 0 || b < 0 || b >= t->n) {
            Py_RETURN_NONE;
        }
    }
    /* the ids given a key: into ``dest`` (the C API), else the result */
    PyObject *ids = dest != NULL ? Py_NewRef(dest) : PyList_New(0);
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t unowned = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *blk = PyList_GET_ITEM(arg, i);
        int isnull = attr_true(blk, A_IS_NULL);
        if (isnull < 0) {
            goto error;
        }
        if (isnull) {
            continue;
        }
        PyObject *key = get_field(blk, A_BLOCK_HASH);
        if (key == NULL) {
            goto error;
        }
        if (key == Py_None) {
            Py_DECREF(key);
            continue;
        }
        PyObject *id = get_field(blk, A_BLOCK_ID);
        Py_ssize_t b = id == NULL ? -1 : PyLong_AsSsize_t(id);
        if (b < 0) {
            Py_XDECREF(id);
            Py_DECREF(key);
            goto error;
        }
        if (is_null_id(t, b)) {
            Py_DECREF(id);
            Py_DECREF(key);
            continue; /* the table's null block is never cached */
        }
        int r = PyList_Append(ids, id);
        Py_DECREF(id);
        if (r < 0) {
            Py_DECREF(key);
            goto error;
        }
        if (!cached[b]) {
            cached[b] = 1;
            if (PyList_GET_ITEM(t->own0, b) == Py_None) {
                unowned++;
            }
        }
        if (PyList_SetItem(t->hashes, b, key) < 0) { /* steals key */
            goto error;
        }
    }
    t->d_cached_free += unowned; /* added to the shadow's total by settle() */
    if (dest != NULL) {
        Py_DECREF(ids);
        Py_RETURN_TRUE;
    }
    PyObject *out[2] = {ids, PyLong_FromSsize_t(unowned)};
    return tuple_steal(2, out);
error:
    Py_DECREF(ids);
    return NULL;
}

static PyObject *
Table_cache(Table *t, PyObject *arg)
{
    return cache_impl((PyObject *)t, arg, NULL);
}



/* uncache(ids, blocks) -> the ids whose engine block (``blocks[id]``) has
 * no cache key, each dropped from the table's cache as
 * ShadowTable.set_uncached does (after ``evict_blocks(ids)``, which drops
 * keys of blocks that may still be in use); None when an id is not an int
 * within the pool and the table, or ``blocks`` is not a list (the Python
 * hook decides).  Dropping twice changes nothing. */
static PyObject *
Table_uncache(Table *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (!n_args("uncache", nargs, 2) || !table_ok(t)) {
        return NULL;
    }
    PyObject *blocks = args[1];
    if (!PyList_Check(blocks)) {
        Py_RETURN_NONE;
    }
    PyObject *ids = PySequence_List(args[0]); /* read once, checked before any change */
    if (ids == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids), nb = PyList_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(ids, i);
        Py_ssize_t b = PyLong_CheckExact(v) ? PyLong_AsSsize_t(v) : -1;
        if (b == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
        if (b < 0 || b >= nb || b >= t->n) {
            Py_DECREF(ids);
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(ids);
        return NULL;
    }
    unsigned char *cached = CACHED(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(ids, i);
        Py_ssize_t b = PyLong_AsSsize_t(v);
        int nohash = attr_is_none(PyList_GET_ITEM(blocks, b), A_BLOCK_HASH);
        if (nohash < 0) {
            goto error;
        }
        if (!nohash) {
            continue;
        }
        if (PyList_Append(out, v) < 0) {
            goto error;
        }
        if (cached[b]) {
            cached[b] = 0;
            if (PyList_GET_ITEM(t->own0, b) == Py_None) {
                t->d_cached_free -= 1;
            }
        }
        if (set_list(t->hashes, b, Py_None) < 0) {
            goto error;
        }
    }
    Py_DECREF(ids);
    return out;
error:
    Py_DECREF(ids);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef Table_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Table_allocate, METH_FASTCALL,
     "allocate(blocks, owner, step, site) -> evicted block ids, or None (not clean; "
     "site: a call site, interned here)"},
    {"share", (PyCFunction)(void (*)(void))Table_share, METH_FASTCALL,
     "share(blocks, owner, step, site) -> (taken, newly owned, of them cached), or None"
     " (site: a call site, interned here)"},
    {"snapshot", (PyCFunction)(void (*)(void))Table_snapshot, METH_FASTCALL,
     "snapshot(blocks, pool) -> [ref << 1 | linked or None per block], or None"},
    {"release", (PyCFunction)(void (*)(void))Table_release, METH_FASTCALL,
     "release(blocks, snap, owner, step, site) -> (dropped, freed ids, unowned, of them "
     "cached), or None (site: a call site, interned here)"},
    {"uncache", (PyCFunction)(void (*)(void))Table_uncache, METH_FASTCALL,
     "uncache(ids, blocks) -> the ids whose block has no cache key, dropped from the "
     "table's cache; or None (the Python hook decides)"},
    {"settle", (PyCFunction)Table_settle, METH_NOARGS,
     "settle(): add the counts kept here to the checker's counters and the shadow's totals"},
    {"cache", (PyCFunction)Table_cache, METH_O,
     "cache(blocks) -> (block ids given a key, of them unowned), or None"},
    {NULL, NULL, 0, NULL},
};

/* read_pool(blocks) -> (int64 counts as bytes, free-queue flags as bytes),
 * or None when a block's count is not an int: the full audit's view of a
 * whole pool (a million blocks: one pass of pointer loads instead of two
 * Python list comprehensions). */
/* property_slot(prop, member or None): read property ``prop`` as the slot
 * of member descriptor ``member`` (None: as a property again) */
static PyObject *
property_slot(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !Py_IS_TYPE(args[0], &PyProperty_Type)
        || (args[1] != Py_None && !Py_IS_TYPE(args[1], &PyMemberDescr_Type))) {
        PyErr_SetString(PyExc_TypeError, "property_slot(property, member descriptor or None)");
        return NULL;
    }
    if (prop_slots == NULL && (prop_slots = PyDict_New()) == NULL) {
        return NULL;
    }
    if (args[1] == Py_None) {
        if (PyDict_Contains(prop_slots, args[0]) == 1 && PyDict_DelItem(prop_slots, args[0]) < 0) {
            return NULL;
        }
    } else if (PyDict_SetItem(prop_slots, args[0], args[1]) < 0) {
        return NULL;
    }
    Py_CLEAR(block_slots.type); /* resolved anew on the next read */
    block_slots.version = 0;
    Py_RETURN_NONE;
}

/* which of the block's fields get_field reads as a slot (tests, diagnostics) */
static PyObject *
slot_reads(PyObject *Py_UNUSED(module), PyObject *block)
{
    slots_resolve(&block_slots, Py_TYPE(block), names, N_ATTRS);
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i < N_ATTRS; i++) {
        if (block_slots.version && block_slots.offset[i] >= 0
            && PyList_Append(out, names[i]) < 0) {
            Py_CLEAR(out);
        }
    }
    return out;
}

static PyObject *
read_pool(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (!PyList_Check(arg)) {
        Py_RETURN_NONE; /* the caller reads it in Python */
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *refs = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    PyObject *linked = PyBytes_FromStringAndSize(NULL, n);
    if (refs == NULL || linked == NULL) {
        goto error;
    }
    int64_t *r = (int64_t *)PyBytes_AS_STRING(refs);
    char *l = PyBytes_AS_STRING(linked);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(arg)) {
            goto resized;
        }
        PyObject *blk = Py_NewRef(PyList_GET_ITEM(arg, i)); /* held while read */
        Py_ssize_t ref = 0;
        int k = int_attr(blk, A_REF_CNT, &ref);
        int unlinked = k == 0 ? attr_is_none(blk, A_PREV_FREE) : 0;
        Py_DECREF(blk);
        if (k < 0 || unlinked < 0) {
            goto error;
        }
        if (k > 0) {
            goto resized; /* not an int: the Python path */
        }
        r[i] = ref;
        l[i] = unlinked ? 0 : 1;
    }
    return Py_BuildValue("(NN)", refs, linked);
resized:
    Py_DECREF(refs);
    Py_DECREF(linked);
    Py_RETURN_NONE;
error:
    Py_XDECREF(refs);
    Py_XDECREF(linked);
    return NULL;
}

/* ---- identity audit: producer records and hit checks over vLLM's blocks ----
 * kvsan.checks.identity.IdentityAudit keeps, per block, its producer record
 * in five per-block lists (``records``: engine key, producer, producer
 * chain, index in it, weights digest; key None: no record).  These two
 * functions do what the adapter's list comprehensions and
 * IdentityAudit.on_cached / on_hits do, reading the blocks here; a mismatch
 * is returned to Python, which reports it with the same code. */

enum { R_KEY, R_PRODUCER, R_CHAIN, R_INDEX, R_WEIGHTS, N_RECORD };

/* the records tuple's five lists (borrowed) and their common length, or -1
 * with a TypeError */
static Py_ssize_t
records_arg(PyObject *rec, PyObject **lists, const char *fn)
{
    if (PyTuple_CheckExact(rec) && PyTuple_GET_SIZE(rec) == N_RECORD) {
        Py_ssize_t n = -1;
        int i;
        for (i = 0; i < N_RECORD; i++) {
            lists[i] = PyTuple_GET_ITEM(rec, i);
            if (!PyList_CheckExact(lists[i])
                || (n >= 0 && PyList_GET_SIZE(lists[i]) != n)) {
                break;
            }
            n = PyList_GET_SIZE(lists[i]);
        }
        if (i == N_RECORD) {
            return n;
        }
    }
    PyErr_Format(PyExc_TypeError, "%s: records must be a tuple of 5 lists of one length", fn);
    return -1;
}

/* identity_record(records, producer, ident, weights, blocks, lo, hi) -> bool:
 * blocks[lo:hi] cached by ``producer``; a block keeps its first producer
 * while its key and the weights digest are unchanged.  True: all recorded; False: a block this
 * cannot record (beyond the records, or an id that is not a plain int) was
 * met, and Python must record the call (IdentityAudit.on_cached, which grows
 * the records; records already made here are made again, the same). */
static PyObject *
identity_record(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "identity_record(records, producer, ident, weights, blocks: list, lo, hi)");
        return NULL;
    }
    PyObject *lists[N_RECORD];
    Py_ssize_t n = records_arg(args[0], lists, "identity_record");
    if (n < 0) {
        return NULL;
    }
    PyObject *blocks = args[4];
    Py_ssize_t lo = PyLong_AsSsize_t(args[5]), hi = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (lo < 0) {
        lo = 0;
    }
    for (Py_ssize_t i = lo; i < hi && i < PyList_GET_SIZE(blocks); i++) {
        PyObject *blk = Py_NewRef(PyList_GET_ITEM(blocks, i));
        PyObject *key = NULL;
        int isnull = attr_true(blk, A_IS_NULL);
        if (isnull < 0) {
            goto fail;
        }
        if (isnull) {
            Py_DECREF(blk);
            continue;
        }
        key = get_field(blk, A_BLOCK_HASH);
        if (key == NULL) {
            goto fail;
        }
        if (key == Py_None) {
            Py_DECREF(key);
            Py_DECREF(blk);
            continue;
        }
        Py_ssize_t b = -1;
        int r = int_attr(blk, A_BLOCK_ID, &b);
        if (r < 0) {
            goto fail;
        }
        if (r > 0 || b < 0 || b >= n) { /* not a plain id, or beyond the records */
            Py_DECREF(key);
            Py_DECREF(blk);
            Py_RETURN_FALSE; /* Python records them (and grows the records) */
        }
        PyObject *known = PyList_GET_ITEM(lists[R_KEY], b);
        int same = 0;
        if (known != Py_None) {
            same = PyObject_RichCompareBool(known, key, Py_EQ);
            if (same < 0) {
                goto fail;
            }
        }
        if (same) { /* re-cached under other weights: the new producer's KV */
            PyObject *wk = PyList_GET_ITEM(lists[R_WEIGHTS], b);
            if (wk != args[3]) {
                same = PyObject_RichCompareBool(wk, args[3], Py_EQ);
                if (same < 0) {
                    goto fail;
                }
            }
        }
        if (!same) {
            PyObject *k = PyLong_FromSsize_t(i);
            if (k == NULL) {
                goto fail;
            }
            PyObject *vals[N_RECORD] = {key, args[1], args[2], k, args[3]};
            for (int f = 0; f < N_RECORD; f++) {
                if (set_list(lists[f], b, vals[f]) < 0) {
                    Py_DECREF(k);
                    goto fail;
                }
            }
            Py_DECREF(k);
        }
        Py_DECREF(key);
        Py_DECREF(blk);
        continue;
    fail:
        Py_XDECREF(key);
        Py_DECREF(blk);
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* item ``i`` of list attribute ``f`` of chain ``obj`` (new reference), or
 * NULL (*err set on a Python error; unset: not a list or out of range) */
static PyObject *
list_item(PyObject *obj, int f, Py_ssize_t i, int *err)
{
    PyObject *lst = ident_get(obj, f);
    if (lst == NULL) {
        *err = 1;
        return NULL;
    }
    PyObject *v = NULL;
    if (PyList_Check(lst) && i >= 0 && i < PyList_GET_SIZE(lst)) {
        v = Py_NewRef(PyList_GET_ITEM(lst, i));
    }
    Py_DECREF(lst);
    return v;
}

/* kvsan._native._tokenlinks.Links (a chain's ``tok`` where that module is in use),
 * read in line; NULL where it is not built for this module's layout */
static PyTypeObject *links_type = NULL;

/* 1: link ``k`` of chain ``a`` and link ``i`` of chain ``b`` are equal, 0:
 * not, -1: error, -2: not both Links (or out of range): compare as lists */
static int
same_link(PyObject *a, Py_ssize_t k, PyObject *b, Py_ssize_t i)
{
    if (links_type == NULL) {
        return -2;
    }
    PyObject *x = ident_get(a, I_TOK);
    PyObject *y = x == NULL ? NULL : ident_get(b, I_TOK);
    int r = -1;
    if (y != NULL) {
        LinksObject *lx = (LinksObject *)x, *ly = (LinksObject *)y;
        r = !Py_IS_TYPE(x, links_type) || !Py_IS_TYPE(y, links_type) || k < 0 || i < 0
                    || k >= lx->n || i >= ly->n
                ? -2
                : lx->v[k] == ly->v[i];
    }
    Py_XDECREF(x);
    Py_XDECREF(y);
    return r;
}

/* 1: block ``k`` of chain ``a`` has the inputs of block ``i`` of chain ``b``
 * (RequestIdentity.same), 0: not, -1: error, -2: cannot tell here */
static int
same_inputs(PyObject *a, Py_ssize_t k, PyObject *b, Py_ssize_t i)
{
    static const int fields[3] = {I_TOK, I_MM, I_EMB};
    for (int n = 0; n < 3; n++) {
        /* the token links: in line where both are Links */
        int r = n == 0 ? same_link(a, k, b, i) : -2;
        if (r == -2) {
            int err = 0;
            PyObject *x = list_item(a, fields[n], k, &err);
            PyObject *y = x == NULL ? NULL : list_item(b, fields[n], i, &err);
            if (x == NULL || y == NULL) {
                Py_XDECREF(x);
                return err ? -1 : -2;
            }
            r = PyObject_RichCompareBool(x, y, Py_EQ);
            Py_DECREF(x);
            Py_DECREF(y);
        }
        if (r <= 0) {
            return r;
        }
        if (n == 0) { /* static digests: shared tuples, compared by identity first */
            PyObject *sa = ident_get(a, I_STATIC);
            PyObject *sb = sa == NULL ? NULL : ident_get(b, I_STATIC);
            int eq = sb == NULL ? -1 : PyObject_RichCompareBool(sa, sb, Py_EQ);
            Py_XDECREF(sa);
            Py_XDECREF(sb);
            if (eq <= 0) {
                return eq;
            }
        }
    }
    return 1;
}

/* identity_hits(records, ident, weights, blocks) -> the number of blocks
 * compared when all matched (an int: no tuple and no list are made for the
 * common check, two objects per prefix hit for the garbage collector),
 * else (blocks compared, [(index, block, key, producer record) of each
 * mismatch]), or None (the Python check must run: also for a block served
 * without a cache key, which it reports) */
static PyObject *
identity_hits(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "identity_hits(records, ident, weights, blocks: list)");
        return NULL;
    }
    PyObject *lists[N_RECORD];
    Py_ssize_t n = records_arg(args[0], lists, "identity_hits");
    if (n < 0) {
        return NULL;
    }
    PyObject *ident = args[1], *weights = args[2], *blocks = args[3];
    PyObject *mism = NULL; /* made at the first mismatch */
    Py_ssize_t checked = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *blk = Py_NewRef(PyList_GET_ITEM(blocks, i));
        PyObject *key = NULL;
        int isnull = attr_true(blk, A_IS_NULL);
        if (isnull < 0) {
            goto fail;
        }
        if (isnull) {
            Py_DECREF(blk);
            continue;
        }
        Py_ssize_t b = -1;
        int r = int_attr(blk, A_BLOCK_ID, &b);
        if (r < 0) {
            goto fail;
        }
        if (r > 0) {
            goto python; /* not a plain id */
        }
        key = get_field(blk, A_BLOCK_HASH);
        if (key == NULL) {
            goto fail;
        }
        if (key == Py_None) {
            goto python; /* served without a cache key: Python reports it */
        }
        PyObject *known = b >= 0 && b < n ? PyList_GET_ITEM(lists[R_KEY], b) : Py_None;
        if (known == Py_None) {
            goto next; /* cached on a path kvsan did not see */
        }
        int eq = PyObject_RichCompareBool(known, key, Py_EQ);
        if (eq < 0) {
            goto fail;
        }
        if (!eq) {
            goto next;
        }
        checked++;
        PyObject *pweights = PyList_GET_ITEM(lists[R_WEIGHTS], b);
        int ok = pweights == weights ? 1 : PyObject_RichCompareBool(pweights, weights, Py_EQ);
        if (ok == 1) {
            Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(lists[R_INDEX], b));
            if (k == -1 && PyErr_Occurred()) {
                goto fail;
            }
            ok = same_inputs(PyList_GET_ITEM(lists[R_CHAIN], b), k, ident, i);
        }
        if (ok == -2) {
            goto python; /* a chain shorter than its index */
        }
        if (ok < 0) {
            goto fail;
        }
        if (!ok) {
            PyObject *rec[N_RECORD];
            for (int f = 0; f < N_RECORD; f++) {
                rec[f] = Py_NewRef(PyList_GET_ITEM(lists[f], b));
            }
            PyObject *record = tuple_steal(N_RECORD, rec);
            PyObject *m = record == NULL ? NULL : Py_BuildValue("(nnON)", i, b, key, record);
            if (m != NULL && mism == NULL && (mism = PyList_New(0)) == NULL) {
                Py_CLEAR(m);
            }
            if (m == NULL || PyList_Append(mism, m) < 0) {
                Py_XDECREF(m);
                goto fail;
            }
            Py_DECREF(m);
        }
    next:
        Py_DECREF(key);
        Py_DECREF(blk);
        continue;
    python: /* let the Python check look */
        Py_XDECREF(key);
        Py_DECREF(blk);
        Py_XDECREF(mism);
        Py_RETURN_NONE;
    fail:
        Py_XDECREF(key);
        Py_DECREF(blk);
        Py_XDECREF(mism);
        return NULL;
    }
    if (mism == NULL) { /* all matched: the count alone (no tuple, no list per hit check) */
        return PyLong_FromSsize_t(checked);
    }
    PyObject *out[2] = {PyLong_FromSsize_t(checked), mism};
    return tuple_steal(2, out);
}

static PyMethodDef module_methods[] = {
    {"identity_record", (PyCFunction)(void (*)(void))identity_record, METH_FASTCALL,
     "identity_record(records, producer, ident, weights, blocks, lo, hi) -> all recorded"},
    {"identity_hits", (PyCFunction)(void (*)(void))identity_hits, METH_FASTCALL,
     "identity_hits(records, ident, weights, blocks) -> compared (an int: all matched), "
     "(compared, mismatches), or None"},
    {"read_pool", read_pool, METH_O,
     "read_pool(blocks) -> (int64 ref counts as bytes, free-queue flags as bytes), or None"},
    {"property_slot", (PyCFunction)(void (*)(void))property_slot, METH_FASTCALL,
     "property_slot(prop, member): read property prop as the slot of member descriptor "
     "member (None: as a property); kvsan.hooks.property_slot decides"},
    {"slot_reads", slot_reads, METH_O,
     "slot_reads(block) -> the block fields read here as slots (the rest: getattr)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsan._native._shadowfast.Table",
    .tp_doc = "Table(shadow, mismatched, counters): the clean-event fast path over a kvsan "
              "ShadowTable's arrays, with the event's bookkeeping.",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Table_traverse,
    .tp_clear = (inquiry)Table_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

static struct PyModuleDef shadowfast_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._native._shadowfast",
    .m_doc = "The clean case of kvsan's shadow-table updates in C (optional speed-up).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__shadowfast(void)
{
    if (PyType_Ready(&HeldMapType) < 0) {
        return NULL;
    }
    if (PyType_Ready(&HoldType) < 0) {
        return NULL;
    }
    if (PyType_Ready(&TableType) < 0) {
        return NULL;
    }
    for (int i = 0; i < N_ATTRS; i++) {
        names[i] = PyUnicode_InternFromString(attr_names[i]);
        if (names[i] == NULL) {
            return NULL;
        }
    }
    for (int i = 0; i < N_KEYS; i++) {
        keys[i] = PyUnicode_InternFromString(key_names[i]);
        if (keys[i] == NULL) {
            return NULL;
        }
    }
    if (ident_names_init() < 0) {
        return NULL;
    }
    /* Links of the same layout: kvsan._native._tokenlinks built from this source */
    PyObject *tl = PyImport_ImportModule("kvsan._native._tokenlinks");
    PyObject *abi = tl == NULL ? NULL : PyObject_GetAttrString(tl, "ABI");
    PyObject *lt = abi == NULL ? NULL : PyObject_GetAttrString(tl, "Links");
    if (lt != NULL && PyType_Check(lt) && PyLong_Check(abi)
        && PyLong_AsLong(abi) == KVSAN_TOKENLINKS_ABI) {
        links_type = (PyTypeObject *)Py_NewRef(lt);
    }
    PyErr_Clear(); /* (not built: chains are lists, compared as lists) */
    Py_XDECREF(lt);
    Py_XDECREF(abi);
    Py_XDECREF(tl);
    PyObject *m = PyModule_Create(&shadowfast_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", KVSAN_SHADOWFAST_ABI) < 0
        || PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0
        || PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0
        || PyModule_AddObjectRef(m, "Hold", (PyObject *)&HoldType) < 0
        || PyModule_AddObjectRef(m, "HeldMap", (PyObject *)&HeldMapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    static KvsanShadowAPI api = {KVSAN_CAPI_ABI, &TableType, allocate_impl, capi_share,
                                 capi_release, cache_impl, capi_snapshot, snapshot_list};
    PyObject *cap = PyCapsule_New(&api, KVSAN_SHADOW_CAPSULE, NULL);
    if (cap == NULL || PyModule_AddObject(m, "_C_API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
