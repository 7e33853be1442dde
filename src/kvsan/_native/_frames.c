/* kvsan._native._frames: who made an allocator call, read from the interpreter's
 * frame stack in C.
 *
 * The pure-Python path (kvsan.hooks.engine_frame / owner_from_frames and
 * kvsan.hooks.site_of) walks ``sys._getframe()`` and reads the owner
 * frame's ``f_locals``: on every frame a Python-level attribute read, and on
 * the owner frame a conversion of its fast locals into a dict (CPython 3.11
 * and earlier) or a locals proxy; about 10 µs per allocator event in situ,
 * the largest single share of kvsan's scheduler-side cost.  This module
 * does the same walk in C and reads one local.
 *
 * Two routes, chosen at build time, give the same results:
 *
 * - CPython 3.11: the walk reads ``_PyInterpreterFrame`` (3.11's internal
 *   frame records, ``Py_BUILD_CORE``) and the owner's local slot directly,
 *   without making frame objects.  The public route below costs about
 *   350 ns per read there against 110 ns, so 3.11 keeps this one.
 * - Any other CPython (3.10, 3.12, 3.13): the public C API --
 *   PyThreadState_GetFrame, PyFrame_GetBack, PyFrame_GetCode,
 *   PyFrame_GetLasti (3.10: the frame's ``f_lasti`` field, in code units) and
 *   PyFrame_GetVar for the owner local (3.10: the frame's ``f_locals`` after
 *   PyFrame_FastToLocalsWithError, as ``frame.f_locals`` reads it).
 *
 * The results are the same by construction and by test
 * (tests/test_native.py compares both paths on the real engine's stacks,
 * tests/test_native_portable.py on hand-made ones on every CPython); the
 * module is optional and kvsan falls back to the Python path when it is
 * missing, disabled (KVSAN_NATIVE=0) or built for another ABI.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_capi.h"

#define KVSAN_FRAMES_ABI 2

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define KVSAN_INTERNAL_FRAMES 1
#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE
/* a frame: a borrowed interpreter frame record */
typedef _PyInterpreterFrame *frame_t;
#else
#include <frameobject.h> /* CPython 3.10: PyFrameObject's f_lasti, f_locals */
/* a frame: a strong reference to a frame object */
typedef PyFrameObject *frame_t;
#endif

/* set by configure(): strong references */
static PyObject *trampoline_code = NULL; /* code object of kvsan's trampolines */
static PyObject *hooks_prefix = NULL;    /* str: directory of kvsan's hook modules */
static PyObject *engine_file = NULL;     /* str or NULL: the one file there whose frames
                                          * stand for the engine's (the injected faults) */
static PyObject *sites = NULL;           /* dict (id(code), f_lasti) -> (code, text) */
static PyObject *site_text = NULL;       /* callable(code, f_lasti) -> text (a miss) */
static PyObject *owner_slots = NULL;     /* dict id(code) -> (code, slot, attr|None, name) */
static PyObject *unknown_site = NULL;    /* "?" */
static int owner_depth = 8;

#ifdef KVSAN_INTERNAL_FRAMES
static inline _PyInterpreterFrame *
complete(_PyInterpreterFrame *f)
{
    /* as sys._getframe and frame.f_back: incomplete frames are not counted */
    while (f != NULL && _PyFrame_IsIncomplete(f)) {
        f = f->previous;
    }
    return f;
}

/* the innermost frame of this thread, or NULL */
static inline frame_t
frame_top(void)
{
    return complete(PyThreadState_Get()->cframe->current_frame);
}

/* the frame that called ``f`` (``f`` let go of), or NULL */
static inline frame_t
frame_up(frame_t f)
{
    return complete(f->previous);
}

static inline frame_t
frame_hold(frame_t f)
{
    return f;
}

static inline void
frame_release(frame_t f)
{
    (void)f;
}

/* the frame's code object (borrowed: the frame holds it) */
static inline PyObject *
frame_code(frame_t f)
{
    return (PyObject *)f->f_code;
}

/* the frame's position as ``frame.f_lasti`` gives it (bytes; -1: none) */
static inline int
frame_lasti(frame_t f)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
}
#else
static inline frame_t
frame_top(void)
{
    return PyThreadState_GetFrame(PyThreadState_Get()); /* new reference or NULL */
}

static inline frame_t
frame_up(frame_t f)
{
    PyFrameObject *back = PyFrame_GetBack(f); /* new reference or NULL */
    Py_DECREF(f);
    return back;
}

static inline frame_t
frame_hold(frame_t f)
{
    Py_XINCREF(f);
    return f;
}

static inline void
frame_release(frame_t f)
{
    Py_XDECREF(f);
}

static inline PyObject *
frame_code(frame_t f)
{
    PyCodeObject *code = PyFrame_GetCode(f); /* new reference, never NULL */
    Py_DECREF(code);                         /* the frame keeps its own */
    return (PyObject *)code;
}

static inline int
frame_lasti(frame_t f)
{
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else /* CPython 3.10: f_lasti counts code units, of 2 bytes each (as
       * frame.f_lasti converts it) */
    return f->f_lasti < 0 ? -1 : f->f_lasti * 2;
#endif
}
#endif

/* is_kvsan's answers: code object (a strong reference, so its address is
 * never another code object's while here) -> 1 / 0; cleared by configure() */
#define KVSAN_CACHE_SIZE 64 /* a power of two */

typedef struct {
    PyObject *code;
    int kvsan;
} KvsanEntry;

static KvsanEntry kvsan_cache[KVSAN_CACHE_SIZE];

/* 1: the frame is kvsan's patching (a trampoline or a hook function), 0: not,
 * -1: error */
static int
is_kvsan(frame_t f)
{
    PyObject *code = frame_code(f);
    if (code == trampoline_code) {
        return 1;
    }
    /* the answer per code object, cached (a prefix compare of its file name
     * was a fifth of a hook's context read; the caller is the same few
     * engine functions every call) */
    uintptr_t p = (uintptr_t)code;
    KvsanEntry *e = &kvsan_cache[((p >> 4) ^ (p >> 12)) & (KVSAN_CACHE_SIZE - 1)];
    if (e->code == code) {
        return e->kvsan;
    }
    PyObject *filename = ((PyCodeObject *)code)->co_filename;
    Py_ssize_t r = PyUnicode_Tailmatch(filename, hooks_prefix, 0, PY_SSIZE_T_MAX, -1);
    if (r < 0) {
        return -1;
    }
    if (r == 1 && engine_file != NULL) {
        int same = PyUnicode_Compare(filename, engine_file);
        if (same == -1 && PyErr_Occurred()) {
            return -1;
        }
        r = same != 0;
    }
    e->kvsan = (int)r;
    Py_XSETREF(e->code, Py_NewRef(code));
    return (int)r;
}

/* the engine frame at or above ``f`` (``f`` let go of; NULL: none); -1 in
 * *err on error */
static frame_t
engine_frame(frame_t f, int *err)
{
    while (f != NULL) {
        int k = is_kvsan(f);
        if (k < 0) {
            frame_release(f);
            *err = 1;
            return NULL;
        }
        if (!k) {
            return f;
        }
        f = frame_up(f);
    }
    return NULL;
}

/* Direct-mapped caches in front of the two dicts, keyed by the code
 * object's address: a dict lookup needs a key object (an int, or a tuple
 * of two) made and hashed per frame, and an event walks several frames.
 * Entries hold strong references to their code objects, so an address in
 * the cache is never reused by another code object.  The site texts never
 * change once made; the owner-slot entries are dropped when that dict
 * changes (owners_changed(), which kvsan.hooks calls whenever it adds or
 * removes an owner frame), and both when configure() is called again. */
#define CACHE_SIZE 256 /* a power of two */

typedef struct {
    PyObject *code; /* strong */
    int lasti;
    PyObject *text; /* strong */
} SiteEntry;

typedef struct {
    PyObject *code;  /* strong */
    PyObject *entry; /* strong: the dict's (code, slot, attr, name) tuple, or NULL: none */
} OwnerEntry;

static SiteEntry site_cache[CACHE_SIZE];
static OwnerEntry owner_cache[CACHE_SIZE];

static inline size_t
cache_index(PyObject *code, int lasti)
{
    uintptr_t p = (uintptr_t)code;
    return (size_t)(((p >> 4) ^ (p >> 12) ^ (uintptr_t)lasti * 0x9E3779B1u) & (CACHE_SIZE - 1));
}

static void
clear_owner_cache(void)
{
    for (int i = 0; i < CACHE_SIZE; i++) {
        Py_CLEAR(owner_cache[i].code);
        Py_CLEAR(owner_cache[i].entry);
    }
}

static void
clear_caches(void)
{
    for (int i = 0; i < KVSAN_CACHE_SIZE; i++) {
        Py_CLEAR(kvsan_cache[i].code);
    }
    for (int i = 0; i < CACHE_SIZE; i++) {
        Py_CLEAR(site_cache[i].code);
        Py_CLEAR(site_cache[i].text);
    }
    clear_owner_cache();
}

static PyObject *site_lookup(PyObject *code, int lasti);

/* new reference: the memoised 'file:function:line' text of the frame's
 * current position */
static PyObject *
site_of(frame_t f)
{
    if (f == NULL) {
        return Py_NewRef(unknown_site);
    }
    PyObject *code = frame_code(f);
    int lasti = frame_lasti(f);
    SiteEntry *e = &site_cache[cache_index(code, lasti)];
    if (e->code == code && e->lasti == lasti) {
        return Py_NewRef(e->text);
    }
    PyObject *text = site_lookup(code, lasti);
    if (text != NULL && PyUnicode_CheckExact(text)) {
        Py_XSETREF(e->code, Py_NewRef(code));
        Py_XSETREF(e->text, Py_NewRef(text));
        e->lasti = lasti;
    }
    return text;
}

/* ``lasti``: in bytes, as frame.f_lasti */
static PyObject *
site_lookup(PyObject *code, int lasti)
{
    PyObject *key = Py_BuildValue("(Ni)", PyLong_FromVoidPtr(code), lasti);
    if (key == NULL) {
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(sites, key); /* borrowed */
    Py_DECREF(key);
    if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2
        && PyTuple_GET_ITEM(entry, 0) == code) {
        return Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    /* a miss: Python formats and memoises it (once per code position) */
    PyObject *lasti_obj = PyLong_FromLong(lasti);
    if (lasti_obj == NULL) {
        return NULL;
    }
    PyObject *text = PyObject_CallFunctionObjArgs(site_text, code, lasti_obj, NULL);
    Py_DECREF(lasti_obj);
    return text;
}

/* the owner local of frame ``f`` described by ``entry`` (code, slot, attr,
 * name): a new reference, or NULL with no exception set when it is unbound,
 * or NULL with an exception */
static PyObject *
owner_local(frame_t f, PyObject *entry)
{
#ifdef KVSAN_INTERNAL_FRAMES
    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
    if (slot < 0 || slot >= f->f_code->co_nlocalsplus) {
        return NULL; /* (an error from PyLong_AsSsize_t stays set) */
    }
    PyObject *value = f->localsplus[slot]; /* borrowed; NULL: unbound */
    if (value != NULL && PyCell_Check(value)) {
        value = PyCell_GET(value); /* a local captured by a closure */
    }
    return Py_XNewRef(value);
#else
    PyObject *name = PyTuple_GET_ITEM(entry, 3);
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyFrame_GetVar(f, name); /* reads cells too */
    if (value == NULL && PyErr_ExceptionMatches(PyExc_NameError)) {
        PyErr_Clear(); /* unbound */
    }
    return value;
#else /* CPython 3.10: as frame.f_locals reads it */
    if (PyFrame_FastToLocalsWithError(f) < 0) {
        return NULL;
    }
    if (f->f_locals == NULL) {
        return NULL;
    }
    PyObject *value = PyObject_GetItem(f->f_locals, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyErr_Clear();
    }
    return value;
#endif
#endif
}

/* new reference: the request the innermost owner frame at or above ``f``
 * acts for (None when there is none or its local is not a str) */
static PyObject *
owner_of(frame_t start)
{
    frame_t f = frame_hold(start);
    PyObject *out = NULL;
    for (int i = 0; i < owner_depth && f != NULL; i++, f = frame_up(f)) {
        PyObject *code = frame_code(f);
        OwnerEntry *oe = &owner_cache[cache_index(code, 0)];
        PyObject *entry; /* borrowed */
        if (oe->code == code) {
            entry = oe->entry;
        } else {
            PyObject *id = PyLong_FromVoidPtr(code);
            if (id == NULL) {
                goto done;
            }
            entry = PyDict_GetItemWithError(owner_slots, id);
            Py_DECREF(id);
            if (entry == NULL && PyErr_Occurred()) {
                goto done;
            }
            Py_XSETREF(oe->code, Py_NewRef(code));
            Py_XSETREF(oe->entry, Py_XNewRef(entry));
        }
        if (entry == NULL) {
            continue;
        }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4
            || PyTuple_GET_ITEM(entry, 0) != code) {
            continue; /* a stale entry: the id of a code object since freed */
        }
        PyObject *value = owner_local(f, entry);
        if (value == NULL) {
            if (!PyErr_Occurred()) {
                out = Py_NewRef(Py_None);
            }
            goto done;
        }
        PyObject *attr = PyTuple_GET_ITEM(entry, 2);
        if (attr != Py_None) {
            Py_SETREF(value, PyObject_GetAttr(value, attr));
            if (value == NULL) {
                PyErr_Clear(); /* as getattr(value, attr, None) */
                out = Py_NewRef(Py_None);
                goto done;
            }
        }
        if (!PyUnicode_Check(value)) {
            Py_DECREF(value);
            out = Py_NewRef(Py_None);
            goto done;
        }
        out = value;
        goto done;
    }
    out = Py_NewRef(Py_None);
done:
    frame_release(f);
    return out;
}

static int
configured(void)
{
    if (sites == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvsan._native._frames: configure() was not called");
        return 0;
    }
    return 1;
}

/* the engine frame at or above the frame ``depth`` levels above the calling
 * Python frame, in *out (NULL: none; held: the caller lets it go with
 * frame_release).  Returns 1, 0 when the stack is not that deep, -1 on
 * error. */
static int
frame_at_depth(long depth, frame_t *out)
{
    *out = NULL;
    if (!configured()) {
        return -1;
    }
    frame_t f = frame_top();
    for (long i = 0; i < depth && f != NULL; i++) {
        f = frame_up(f);
    }
    if (f == NULL) {
        return 0;
    }
    int err = 0;
    *out = engine_frame(f, &err);
    return err ? -1 : 1;
}

static int
frame_at(PyObject *depth_obj, frame_t *out)
{
    *out = NULL;
    long depth = PyLong_AsLong(depth_obj);
    if (depth == -1 && PyErr_Occurred()) {
        return -1;
    }
    return frame_at_depth(depth, out);
}

/* (site, owner) of the engine frame ``f`` (borrowed): new references */
static int
context_of(frame_t f, PyObject *ctx, PyObject **site_out, PyObject **owner_out)
{
    PyObject *site = site_of(f);
    if (site == NULL) {
        return -1;
    }
    PyObject *owner;
    if (PyList_Check(ctx) && PyList_GET_SIZE(ctx) > 0) {
        PyObject *top = PyList_GET_ITEM(ctx, PyList_GET_SIZE(ctx) - 1);
        /* the hooks push (owner, why) tuples: the first item read in line */
        owner = PyTuple_CheckExact(top) && PyTuple_GET_SIZE(top) > 0
                    ? Py_NewRef(PyTuple_GET_ITEM(top, 0))
                    : PySequence_GetItem(top, 0);
    } else {
        owner = owner_of(f);
    }
    if (owner == NULL) {
        Py_DECREF(site);
        return -1;
    }
    *site_out = site;
    *owner_out = owner;
    return 1;
}

/* the capsule's context(): the engine frame that called the running C function */
static int
capi_context(PyObject *ctx, PyObject **site, PyObject **owner)
{
    frame_t f;
    int got = frame_at_depth(0, &f);
    if (got <= 0) {
        return got;
    }
    got = context_of(f, ctx, site, owner);
    frame_release(f);
    return got;
}

static PyObject *
frames_context(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "context(depth, owner_ctx)");
        return NULL;
    }
    frame_t f;
    int got = frame_at(args[0], &f);
    if (got < 0) {
        return NULL;
    }
    if (got == 0) {
        Py_RETURN_NONE; /* the caller falls back (stack shallower than depth) */
    }
    PyObject *site, *owner;
    got = context_of(f, args[1], &site, &owner);
    frame_release(f);
    if (got < 0) {
        return NULL;
    }
    PyObject *out = PyTuple_New(2);
    if (out == NULL) {
        Py_DECREF(site);
        Py_DECREF(owner);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, site);
    PyTuple_SET_ITEM(out, 1, owner);
    return out;
}

static PyObject *
frames_site(PyObject *Py_UNUSED(self), PyObject *arg)
{
    frame_t f;
    if (frame_at(arg, &f) < 0) {
        return NULL;
    }
    PyObject *site = site_of(f);
    frame_release(f);
    return site;
}

static PyObject *
frames_configure(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *tcode, *prefix, *sites_, *text, *slots, *efile = NULL;
    int depth;
    if (!PyArg_ParseTuple(args, "OUO!OO!i|U", &tcode, &prefix, &PyDict_Type, &sites_,
                          &text, &PyDict_Type, &slots, &depth, &efile)) {
        return NULL;
    }
    if (!PyCode_Check(tcode) || !PyCallable_Check(text)) {
        PyErr_SetString(PyExc_TypeError,
                        "configure(trampoline code, hooks dir, sites dict, site_text "
                        "callable, owner slots dict, owner depth)");
        return NULL;
    }
    clear_caches();
    Py_XSETREF(trampoline_code, Py_NewRef(tcode));
    Py_XSETREF(hooks_prefix, Py_NewRef(prefix));
    Py_XSETREF(engine_file, efile != NULL ? Py_NewRef(efile) : NULL);
    Py_XSETREF(sites, Py_NewRef(sites_));
    Py_XSETREF(site_text, Py_NewRef(text));
    Py_XSETREF(owner_slots, Py_NewRef(slots));
    owner_depth = depth;
    Py_RETURN_NONE;
}

static PyObject *
frames_owners_changed(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused))
{
    clear_owner_cache();
    Py_RETURN_NONE;
}

static PyMethodDef frames_methods[] = {
    {"configure", frames_configure, METH_VARARGS,
     "configure(trampoline_code, hooks_dir, sites, site_text, owner_slots, owner_depth"
     "[, engine_file])"},
    {"context", (PyCFunction)(void (*)(void))frames_context, METH_FASTCALL,
     "context(depth, owner_ctx) -> (site, owner) of the engine frame at or above the "
     "frame depth levels up, or None when the stack is shallower"},
    {"site", frames_site, METH_O, "site(depth) -> 'file:function:line' of the engine frame"},
    {"owners_changed", frames_owners_changed, METH_NOARGS,
     "owners_changed(): the owner slots dict was changed (drops the cache in front of it)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef frames_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._native._frames",
    .m_doc = "Engine call context read from the interpreter's frame stack (optional speed-up).",
    .m_size = -1,
    .m_methods = frames_methods,
};

PyMODINIT_FUNC
PyInit__frames(void)
{
    PyObject *m = PyModule_Create(&frames_module);
    if (m == NULL) {
        return NULL;
    }
    unknown_site = PyUnicode_InternFromString("?");
    if (unknown_site == NULL || PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0
        || PyModule_AddIntConstant(m, "ABI", KVSAN_FRAMES_ABI) < 0
#ifdef KVSAN_INTERNAL_FRAMES
        || PyModule_AddStringConstant(m, "ROUTE", "internal") < 0
#else
        || PyModule_AddStringConstant(m, "ROUTE", "public") < 0
#endif
    ) {
        Py_DECREF(m);
        return NULL;
    }
    static KvsanFramesAPI api = {KVSAN_CAPI_ABI, capi_context};
    PyObject *cap = PyCapsule_New(&api, KVSAN_FRAMES_CAPSULE, NULL);
    if (cap == NULL || PyModule_AddObject(m, "_C_API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
