/* Reading and setting an object's ``__slots__`` in line, as CPython's own
 * member descriptor does it (and a one-digit int's value from its digit).
 *
 * kvsan's C modules read a few attributes of the same few classes on every
 * event: vLLM's KVCacheBlock (kvsan._shadowfast), kvsan's own
 * RequestIdentity (kvsan._shadowfast, kvsan._tokenlinks) and its runtime,
 * checker and step journal (kvsan._hookfast).  Through
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
     * NULL (kvsan._shadowfast reads vLLM's ``block_hash`` property so) */
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

/* resolve ``names[0..n)`` for ``tp``; where the type has no valid version
 * tag after the lookups (which give it one where they can), no offsets */
static inline void
slots_resolve(SlotTable *t, PyTypeObject *tp, PyObject *const *names, int n)
{
    Py_XSETREF(t->type, (PyTypeObject *)Py_NewRef(tp));
    for (int i = 0; i < n && i < KVSAN_SLOTS_MAX; i++) {
        PyObject *d = _PyType_Lookup(tp, names[i]); /* borrowed */
        if (d != NULL && t->property_slot != NULL && Py_IS_TYPE(d, &PyProperty_Type)) {
            d = t->property_slot(tp, d); /* borrowed, or NULL */
        }
        t->offset[i] = slot_member_offset(tp, d);
    }
    t->version = (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ? tp->tp_version_tag : 0;
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

/* 1 with ``*out`` set when ``v`` is an exact int of at most one digit (block
 * ids, counts, steps, token ids), read from its digit; 0 otherwise (then
 * PyLong_AsSsize_t or PyObject_Hash) */
static inline int
small_int(PyObject *v, Py_ssize_t *out)
{
#if PY_VERSION_HEX < 0x030C0000 /* ob_size and ob_digit: CPython 3.10 and 3.11 */
    if (v != NULL && PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        if (size == 0) {
            *out = 0;
            return 1;
        }
        if (size == 1 || size == -1) {
            Py_ssize_t d = (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
            *out = size < 0 ? -d : d;
            return 1;
        }
    }
#else
    (void)v;
    (void)out;
#endif
    return 0;
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

/* kvsan._tokenlinks.Links: a chain's token links (its ``tok``) as a
 * growable array of 64-bit ints.  A list held an int object per link
 * (32 B + its 8 B slot per cached block) and was one more object per
 * request for the garbage collector to track; a Links is neither tracked
 * nor a holder of objects.  Its interface version is kvsan._tokenlinks's
 * ABI, which kvsan._shadowfast checks before it reads one in line. */
#define KVSAN_TOKENLINKS_ABI 8

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;   /* links held */
    Py_ssize_t cap; /* room in ``v`` */
    int64_t *v;
} LinksObject;
#endif /* KVSAN_IDENTITY_SLOTS */

#endif /* KVSAN_SLOTS_H */
