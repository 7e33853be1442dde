/* kvsan._frames: who made an allocator call, read from the interpreter's own
 * frame stack without building Python frame objects.
 *
 * The pure-Python path (kvsan.hooks.engine_frame / owner_from_frames and
 * kvsan.hooks.vllm.allocator._site_of) walks ``sys._getframe()`` and reads the
 * owner frame's ``f_locals``.  On CPython 3.11 that materialises a frame
 * object for every frame walked (each then pays a copy when its function
 * returns) and converts the owner frame's fast locals into a dict: about
 * 10 µs per allocator event in situ, the largest single share of kvsan's
 * scheduler-side cost.  This module does the same walk over
 * ``_PyInterpreterFrame`` (CPython 3.11's internal frame layout, hence built
 * for 3.11 only) and reads one local slot.  The results are the same by
 * construction and by test (tests/test_frames.py compares both paths on the
 * real engine's stacks); the module is optional and kvsan falls back to the
 * Python path when it is missing, disabled (KVSAN_NATIVE=0) or built for
 * another ABI.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_capi.h"

#define KVSAN_FRAMES_ABI 1

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define KVSAN_HAVE_FRAMES 1
#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE
#endif

#ifdef KVSAN_HAVE_FRAMES

/* set by configure(): strong references */
static PyObject *trampoline_code = NULL; /* code object of kvsan's trampolines */
static PyObject *hooks_prefix = NULL;    /* str: directory of kvsan's hook modules */
static PyObject *engine_file = NULL;     /* str or NULL: the one file there whose frames
                                          * stand for the engine's (the injected faults) */
static PyObject *sites = NULL;           /* dict (id(code), f_lasti) -> (code, text) */
static PyObject *site_text = NULL;       /* callable(code, f_lasti) -> text (a miss) */
static PyObject *owner_slots = NULL;     /* dict id(code) -> (code, slot, attr|None) */
static PyObject *unknown_site = NULL;    /* "?" */
static int owner_depth = 8;

static inline _PyInterpreterFrame *
complete(_PyInterpreterFrame *f)
{
    /* as sys._getframe and frame.f_back: incomplete frames are not counted */
    while (f != NULL && _PyFrame_IsIncomplete(f)) {
        f = f->previous;
    }
    return f;
}

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
is_kvsan(_PyInterpreterFrame *f)
{
    PyCodeObject *code = f->f_code;
    if ((PyObject *)code == trampoline_code) {
        return 1;
    }
    /* the answer per code object, cached (a prefix compare of its file name
     * was a fifth of a hook's context read; the caller is the same few
     * engine functions every call) */
    uintptr_t p = (uintptr_t)code;
    KvsanEntry *e = &kvsan_cache[((p >> 4) ^ (p >> 12)) & (KVSAN_CACHE_SIZE - 1)];
    if (e->code == (PyObject *)code) {
        return e->kvsan;
    }
    Py_ssize_t r = PyUnicode_Tailmatch(code->co_filename, hooks_prefix, 0,
                                       PY_SSIZE_T_MAX, -1);
    if (r < 0) {
        return -1;
    }
    if (r == 1 && engine_file != NULL) {
        int same = PyUnicode_Compare(code->co_filename, engine_file);
        if (same == -1 && PyErr_Occurred()) {
            return -1;
        }
        r = same != 0;
    }
    e->kvsan = (int)r;
    Py_XSETREF(e->code, Py_NewRef((PyObject *)code));
    return (int)r;
}

/* the engine frame at or above ``f`` (NULL: none); -1 in *err on error */
static _PyInterpreterFrame *
engine_frame(_PyInterpreterFrame *f, int *err)
{
    f = complete(f);
    while (f != NULL) {
        int k = is_kvsan(f);
        if (k < 0) {
            *err = 1;
            return NULL;
        }
        if (!k) {
            return f;
        }
        f = complete(f->previous);
    }
    return NULL;
}

/* Direct-mapped caches in front of the two dicts, keyed by the code
 * object's address: a dict lookup needs a key object (an int, or a tuple
 * of two) made and hashed per frame, and an event walks several frames.
 * Entries hold strong references to their code objects, so an address in
 * the cache is never reused by another code object.  The site texts never
 * change once made; the owner-slot entries are dropped when that dict
 * changes (its version tag), and both when configure() is called again. */
#define CACHE_SIZE 256 /* a power of two */

typedef struct {
    PyObject *code; /* strong */
    int lasti;
    PyObject *text; /* strong */
} SiteEntry;

typedef struct {
    PyObject *code;  /* strong */
    PyObject *entry; /* strong: the dict's (code, slot, attr) tuple, or NULL: none */
} OwnerEntry;

static SiteEntry site_cache[CACHE_SIZE];
static OwnerEntry owner_cache[CACHE_SIZE];
static uint64_t owner_cache_version = 0;

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
site_of(_PyInterpreterFrame *f)
{
    if (f == NULL) {
        return Py_NewRef(unknown_site);
    }
    PyObject *code = (PyObject *)f->f_code;
    int lasti = _PyInterpreterFrame_LASTI(f);
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

static PyObject *
site_lookup(PyObject *code, int lasti)
{
    long lasti_bytes = lasti < 0 ? -1 : (long)lasti * (long)sizeof(_Py_CODEUNIT);
    PyObject *key = Py_BuildValue("(Nl)", PyLong_FromVoidPtr(code), lasti_bytes);
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
    PyObject *lasti_obj = PyLong_FromLong(lasti_bytes);
    if (lasti_obj == NULL) {
        return NULL;
    }
    PyObject *text = PyObject_CallFunctionObjArgs(site_text, code, lasti_obj, NULL);
    Py_DECREF(lasti_obj);
    return text;
}

/* new reference: the request the innermost owner frame at or above ``f``
 * acts for (None when there is none or its local is not a str) */
static PyObject *
owner_of(_PyInterpreterFrame *f)
{
    uint64_t version = ((PyDictObject *)owner_slots)->ma_version_tag;
    if (version != owner_cache_version) {
        clear_owner_cache();
        owner_cache_version = version;
    }
    for (int i = 0; i < owner_depth && f != NULL; i++, f = complete(f->previous)) {
        PyObject *code = (PyObject *)f->f_code;
        OwnerEntry *oe = &owner_cache[cache_index(code, 0)];
        PyObject *entry; /* borrowed */
        if (oe->code == code) {
            entry = oe->entry;
        } else {
            PyObject *id = PyLong_FromVoidPtr(code);
            if (id == NULL) {
                return NULL;
            }
            entry = PyDict_GetItemWithError(owner_slots, id);
            Py_DECREF(id);
            if (entry == NULL && PyErr_Occurred()) {
                return NULL;
            }
            Py_XSETREF(oe->code, Py_NewRef(code));
            Py_XSETREF(oe->entry, Py_XNewRef(entry));
        }
        if (entry == NULL) {
            continue;
        }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3
            || PyTuple_GET_ITEM(entry, 0) != code) {
            continue; /* a stale entry: the id of a code object since freed */
        }
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
        if (slot < 0 || slot >= f->f_code->co_nlocalsplus) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
        PyObject *value = f->localsplus[slot]; /* borrowed; NULL: unbound */
        if (value != NULL && PyCell_Check(value)) {
            value = PyCell_GET(value); /* a local captured by a closure */
        }
        if (value == NULL) {
            Py_RETURN_NONE;
        }
        PyObject *attr = PyTuple_GET_ITEM(entry, 2);
        if (attr != Py_None) {
            value = PyObject_GetAttr(value, attr); /* new reference */
            if (value == NULL) {
                PyErr_Clear(); /* as getattr(value, attr, None) */
                Py_RETURN_NONE;
            }
        } else {
            Py_INCREF(value);
        }
        if (!PyUnicode_Check(value)) {
            Py_DECREF(value);
            Py_RETURN_NONE;
        }
        return value;
    }
    Py_RETURN_NONE;
}

static int
configured(void)
{
    if (sites == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvsan._frames: configure() was not called");
        return 0;
    }
    return 1;
}

/* the engine frame at or above the frame ``depth_obj`` levels above the
 * calling Python frame (NULL: none).  Returns 1, 0 when the stack is not that
 * deep, -1 on error. */
static int
frame_at_depth(long depth, _PyInterpreterFrame **out)
{
    *out = NULL;
    if (!configured()) {
        return -1;
    }
    PyThreadState *ts = PyThreadState_Get();
    _PyInterpreterFrame *f = complete(ts->cframe->current_frame);
    for (long i = 0; i < depth && f != NULL; i++) {
        f = complete(f->previous);
    }
    if (f == NULL) {
        return 0;
    }
    int err = 0;
    *out = engine_frame(f, &err);
    return err ? -1 : 1;
}

static int
frame_at(PyObject *depth_obj, _PyInterpreterFrame **out)
{
    *out = NULL;
    long depth = PyLong_AsLong(depth_obj);
    if (depth == -1 && PyErr_Occurred()) {
        return -1;
    }
    return frame_at_depth(depth, out);
}

/* (site, owner) of the engine frame at or above ``f``: new references */
static int
context_of(_PyInterpreterFrame *f, PyObject *ctx, PyObject **site_out, PyObject **owner_out)
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
    _PyInterpreterFrame *f;
    int got = frame_at_depth(0, &f);
    if (got <= 0) {
        return got;
    }
    return context_of(f, ctx, site, owner);
}

static PyObject *
frames_context(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "context(depth, owner_ctx)");
        return NULL;
    }
    _PyInterpreterFrame *f;
    int got = frame_at(args[0], &f);
    if (got < 0) {
        return NULL;
    }
    if (got == 0) {
        Py_RETURN_NONE; /* the caller falls back (stack shallower than depth) */
    }
    PyObject *site, *owner;
    if (context_of(f, args[1], &site, &owner) < 0) {
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
frames_site(PyObject *self, PyObject *arg)
{
    _PyInterpreterFrame *f;
    if (frame_at(arg, &f) < 0) {
        return NULL;
    }
    return site_of(f);
}

static PyObject *
frames_configure(PyObject *self, PyObject *args)
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
    owner_cache_version = 0;
    Py_XSETREF(trampoline_code, Py_NewRef(tcode));
    Py_XSETREF(hooks_prefix, Py_NewRef(prefix));
    Py_XSETREF(engine_file, efile != NULL ? Py_NewRef(efile) : NULL);
    Py_XSETREF(sites, Py_NewRef(sites_));
    Py_XSETREF(site_text, Py_NewRef(text));
    Py_XSETREF(owner_slots, Py_NewRef(slots));
    owner_depth = depth;
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
    {NULL, NULL, 0, NULL},
};
#else
static PyMethodDef frames_methods[] = {{NULL, NULL, 0, NULL}};
#endif

static struct PyModuleDef frames_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._frames",
    .m_doc = "Engine call context read from CPython 3.11's frame stack (optional speed-up).",
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
#ifdef KVSAN_HAVE_FRAMES
    unknown_site = PyUnicode_InternFromString("?");
    if (unknown_site == NULL || PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0) {
#else
    if (PyModule_AddIntConstant(m, "AVAILABLE", 0) < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", KVSAN_FRAMES_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef KVSAN_HAVE_FRAMES
    static KvsanFramesAPI api = {KVSAN_CAPI_ABI, capi_context};
    PyObject *cap = PyCapsule_New(&api, KVSAN_FRAMES_CAPSULE, NULL);
    if (cap == NULL || PyModule_AddObject(m, "_C_API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
