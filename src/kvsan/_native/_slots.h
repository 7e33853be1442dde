/* Reading and setting an object's ``__slots__`` in line, as CPython's own
 * member descriptor does it (and a small int's value).
 *
 * kvsan's C modules read a few attributes of the same few classes on every
 * event: vLLM's KVCacheBlock (kvsan._native._shadowfast), kvsan's own
 * RequestIdentity (kvsan._native._shadowfast, kvsan._native._tokenlinks) and its runtime,
 * checker and step journal (kvsan._native._hookfast).  Through
 * PyObject_GetAttr each read costs a type lookup and a descriptor call,
 * about 130 instructions; a prefix hit's identity check read eight
 * attributes per block that way.  A slot is a pointer at a fixed offset in
 * the object, so once per type (and again whenever the type is modified)
 * the offsets are resolved and a read is a load.
 *
 * A SlotTable holds the offsets of a list of names for one type.  The type's
 * version tag tells that it is unchanged: CPython clears the valid flag and
 * sets the tag to 0 together (PyType_Modified), and where no valid tag is
 * found no offsets are kept, so a read goes through PyObject_GetAttr.
 * Anything other than a plain object member (another type, a property, a
 * base whose ``__getattribute__`` is overridden) is read through
 * PyObject_GetAttr too.
 */
#ifndef KVSAN_SLOTS_H
#define KVSAN_SLOTS_H

#include <Python.h>
#include <structmember.h>

#define KVSAN_SLOTS_MAX 16

typedef struct {
    PyTypeObject *type; /* strong reference: the type the offsets belong to */
    unsigned int version;
    Py_ssize_t offset[KVSAN_SLOTS_MAX]; /* -1: read through PyObject_GetAttr */
    /* optional: the slot descriptor a property of the type only returns, or
     * NULL (kvsan._native._shadowfast reads vLLM's ``block_hash`` property so) */
    PyObject *(*property_slot)(PyTypeObject *tp, PyObject *prop);
} SlotTable;

/* the offset of descriptor ``d`` (found on ``tp``) when it is a plain object
 * member that object.__getattribute__ reads as a slot, else -1 */
static inline Py_ssize_t
slot_member_offset(PyTypeObject *tp, PyObject *d)
{
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)
        && tp->tp_getattro == PyObject_GenericGetAttr && PyType_IsSubtype(tp, PyDescr_TYPE(d))) {
        PyMemberDef *md = ((PyMemberDescrObject *)d)->d_member;
        if (md->type == T_OBJECT_EX && !(md->flags & READ_RESTRICTED)) {
            return md->offset;
        }
    }
    return -1;
}

/* the attribute ``name`` as found in the dicts of ``tp``'s MRO (what
 * object.__getattribute__ looks up on the type), borrowed (the type's dict
 * holds it), or NULL (no exception set) */
static inline PyObject *
slots_type_lookup(PyTypeObject *tp, PyObject *name)
{
    PyObject *mro = tp->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(mro); k++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, k);
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *dict = PyType_GetDict(base); /* new reference (a static type's too) */
#else
        PyObject *dict = Py_XNewRef(base->tp_dict);
#endif
        if (dict == NULL) {
            continue;
        }
        PyObject *d = PyDict_GetItemWithError(dict, name); /* borrowed */
        Py_DECREF(dict); /* (the type keeps its dict) */
        if (d != NULL) {
            return d;
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;
        }
    }
    return NULL;
}

/* 1 when ``tp`` has a valid version tag after CPython was asked to give it
 * one (it does so lazily, on its attribute cache's lookups) */
static inline int
slots_version_tag(PyTypeObject *tp, PyObject *name)
{
#if PY_VERSION_HEX >= 0x030C0000
    (void)name;
    return PyUnstable_Type_AssignVersionTag(tp);
#else
    /* CPython 3.10 and 3.11 have no public call for it: a lookup of an
     * attribute through the type, which goes through its cache, assigns
     * one where it can */
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        PyObject *v = PyObject_GetAttr((PyObject *)tp, name);
        if (v == NULL) {
            PyErr_Clear();
        }
        Py_XDECREF(v);
    }
    return (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
#endif
}

/* resolve ``names[0..n)`` for ``tp``; where the type has no valid version
 * tag (which is asked for first), no offsets */
static inline void
slots_resolve(SlotTable *t, PyTypeObject *tp, PyObject *const *names, int n)
{
    Py_XSETREF(t->type, (PyTypeObject *)Py_NewRef(tp));
    int tagged = n > 0 && slots_version_tag(tp, names[0]);
    for (int i = 0; i < n && i < KVSAN_SLOTS_MAX; i++) {
        PyObject *d = slots_type_lookup(tp, names[i]); /* borrowed */
        if (d != NULL && t->property_slot != NULL && Py_IS_TYPE(d, &PyProperty_Type)) {
            d = t->property_slot(tp, d); /* borrowed, or NULL */
        }
        t->offset[i] = slot_member_offset(tp, d);
    }
    /* (a valid tag is never 0: PyType_Modified sets 0 where it invalidates;
     * CPython 3.13 no longer keeps Py_TPFLAGS_VALID_VERSION_TAG) */
    t->version = tagged ? tp->tp_version_tag : 0;
    if (t->version == 0) {
        for (int i = 0; i < n && i < KVSAN_SLOTS_MAX; i++) {
            t->offset[i] = -1;
        }
    }
}

/* the address of slot ``i`` of ``obj`` (resolving for its type first when
 * the table is for another type or an older version), or NULL: the caller
 * then reads or sets the attribute through PyObject_GetAttr / SetAttr */
static inline PyObject **
slots_at(SlotTable *t, PyObject *obj, int i, PyObject *const *names, int n)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp != t->type || t->version == 0 || tp->tp_version_tag != t->version) {
        slots_resolve(t, tp, names, n);
    }
    if (t->version != 0 && t->offset[i] >= 0) {
        return (PyObject **)((char *)obj + t->offset[i]);
    }
    return NULL;
}

/* attribute ``names[i]`` of ``obj``: a new reference, or NULL with an
 * exception (an unset slot raises AttributeError there, as it would) */
static inline PyObject *
slots_get(SlotTable *t, PyObject *obj, int i, PyObject *const *names, int n)
{
    PyObject **at = slots_at(t, obj, i, names, n);
    if (at != NULL && *at != NULL) {
        return Py_NewRef(*at);
    }
    return PyObject_GetAttr(obj, names[i]);
}

/* ``obj.names[i] = value``: 0, or -1 with an exception.  For the slots a
 * class's ``__slots__`` declares (never read-only members) */
static inline int
slots_set(SlotTable *t, PyObject *obj, int i, PyObject *value, PyObject *const *names, int n)
{
    PyObject **at = slots_at(t, obj, i, names, n);
    if (at != NULL) {
        Py_XSETREF(*at, Py_NewRef(value));
        return 0;
    }
    return PyObject_SetAttr(obj, names[i], value);
}

/* the truth of ``v`` (a new reference, let go; NULL: an error already
 * set): 1, 0, -1 */
static inline int
truth_of(PyObject *v)
{
    if (v == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* 1 with ``*out`` set when ``v`` is an exact int of magnitude below 2**30
 * (block ids, counts, steps, token ids; CPython's one-digit, "compact"
 * ints); 0 otherwise (then PyLong_AsSsize_t or PyObject_Hash).  The bound
 * is part of the answer: a caller may take such a value as its own hash */
#define KVSAN_SMALL_INT_LIMIT ((Py_ssize_t)1 << 30)

static inline int
small_int(PyObject *v, Py_ssize_t *out)
{
    if (v == NULL || !PyLong_CheckExact(v)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        *out = PyUnstable_Long_CompactValue((PyLongObject *)v);
        return 1;
    }
    return 0;
#else
    int overflow;
    long x = PyLong_AsLongAndOverflow(v, &overflow); /* (never raises for an int) */
    if (overflow || x >= KVSAN_SMALL_INT_LIMIT || x <= -KVSAN_SMALL_INT_LIMIT) {
        return 0;
    }
    *out = (Py_ssize_t)x;
    return 1;
#endif
}

#ifdef KVSAN_IDENTITY_SLOTS
/* kvsan.checks.identity.RequestIdentity's slots, which _shadowfast
 * (a hit's check compares them per block) and _tokenlinks (a chain made
 * and extended) read and set in line.  Each module has its own copy. */
enum { I_STATIC, I_TOK, I_MM, I_EMB, I_RID, N_IDENT };
static PyObject *ident_names[N_IDENT]; /* the interned names, in that order */
static SlotTable ident_slots;

/* 0, or -1 with an exception: the names interned (at module init) */
static int
ident_names_init(void)
{
    static const char *const text[N_IDENT] = {"static", "tok", "mm", "emb", "rid"};
    for (int i = 0; i < N_IDENT; i++) {
        if ((ident_names[i] = PyUnicode_InternFromString(text[i])) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* attribute ``f`` of a chain (new reference), or NULL with an exception */
static inline PyObject *
ident_get(PyObject *chain, int f)
{
    return slots_get(&ident_slots, chain, f, ident_names, N_IDENT);
}

/* ``chain.<f> = value``: 0, or -1 with an exception */
static inline int
ident_set(PyObject *chain, int f, PyObject *value)
{
    return slots_set(&ident_slots, chain, f, value, ident_names, N_IDENT);
}

/* kvsan._native._tokenlinks.Links: a chain's token links (its ``tok``) as a
 * growable array of 64-bit ints.  A list held an int object per link
 * (32 B + its 8 B slot per cached block) and was one more object per
 * request for the garbage collector to track; a Links is neither tracked
 * nor a holder of objects.  Its interface version is kvsan._native._tokenlinks's
 * ABI, which kvsan._native._shadowfast checks before it reads one in line. */
#define KVSAN_TOKENLINKS_ABI 9

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;   /* links held */
    Py_ssize_t cap; /* room in ``v`` */
    int64_t *v;
} LinksObject;
#endif /* KVSAN_IDENTITY_SLOTS */

#endif /* KVSAN_SLOTS_H */
