/* kvsan._native._tokenlinks: the identity audit's token chain, computed in C.
 *
 * kvsan.checks.identity.RequestIdentity.extend links each block of a
 * request's tokens to its parent as ``hash((parent, tuple(block_tokens)))``
 * (CPython's tuple hash: deterministic for ints, no hash randomisation).  It
 * runs for every block a request caches and every prefix block it is served,
 * and in Python the slice, the two tuples and the loop cost several µs per
 * call.  ``links()`` returns the same values -- CPython 3.11's tuple hash
 * (xxHash-based, Objects/tupleobject.c) applied to the same items, each
 * item's hash taken with PyObject_Hash -- without building the tuples.
 * tests/test_identity.py checks it against ``hash()`` on edge values.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KVSAN_IDENTITY_SLOTS /* RequestIdentity's slots */
#include "_slots.h"

#if SIZEOF_PY_UHASH_T > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

static inline Py_uhash_t
acc_lane(Py_uhash_t acc, Py_uhash_t lane)
{
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    acc *= XXPRIME_1;
    return acc;
}

static inline Py_hash_t
acc_finish(Py_uhash_t acc, Py_ssize_t len)
{
    acc += (Py_uhash_t)len ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) {
        return 1546275796;
    }
    return (Py_hash_t)acc;
}

/* hash(item) for a token id, its value where it is a small int (small_int:
 * below 2**30, where CPython's long_hash gives the value, -1 becoming -2), else
 * PyObject_Hash: a block's 16 token hashes would be 16 calls through the type */
static inline Py_hash_t
token_hash(PyObject *item)
{
    Py_ssize_t v;
    if (small_int(item, &v)) {
        return v == -1 ? -2 : (Py_hash_t)v;
    }
    return PyObject_Hash(item);
}

/* hash(int(x)) for a previous link ``x``, as long_hash gives it: the
 * magnitude modulo 2**61 - 1 with x's sign, -1 becoming -2 (a link was made
 * an int to be hashed) */
static inline Py_hash_t
link_hash(Py_hash_t x)
{
#if SIZEOF_PY_HASH_T == 8
    /* sys.hash_info.modulus of a 64-bit build (documented: "Hashing of
     * numeric types"), which kvsan.checks.identity's tests compare with */
    const Py_uhash_t modulus = ((Py_uhash_t)1 << 61) - 1;
    Py_uhash_t mag = x < 0 ? (Py_uhash_t)0 - (Py_uhash_t)x : (Py_uhash_t)x;
    Py_hash_t h = (Py_hash_t)(mag % modulus);
    h = x < 0 ? -h : h;
    return h == -1 ? -2 : h;
#else
    PyObject *p = PyLong_FromSsize_t(x);
    if (p == NULL) {
        return -1;
    }
    Py_hash_t h = PyObject_Hash(p);
    Py_DECREF(p);
    return h;
#endif
}

/* ------------------------------------------------------------ Links */

static PyTypeObject LinksType;

#define Links_Check(o) Py_IS_TYPE((o), &LinksType)

/* room for ``n`` links: 0, or -1 with MemoryError */
static int
links_reserve(LinksObject *l, Py_ssize_t n)
{
    if (n <= l->cap) {
        return 0;
    }
    Py_ssize_t cap = l->cap < 4 ? 4 : l->cap;
    while (cap < n) {
        cap += cap >> 1; /* amortised growth, as a list's */
    }
    int64_t *v = PyMem_Realloc(l->v, sizeof(int64_t) * (size_t)cap);
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    l->v = v;
    l->cap = cap;
    return 0;
}

static inline int
links_push(LinksObject *l, int64_t x)
{
    if (l->n == l->cap && links_reserve(l, l->n + 1) < 0) {
        return -1;
    }
    l->v[l->n++] = x;
    return 0;
}

/* ``item`` as a link (any int that fits 64 bits): 0, or -1 with an exception */
static int
link_value(PyObject *item, int64_t *out)
{
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a link is an int, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    long long x = PyLong_AsLongLong(item);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

/* the links of ``items`` (a Links or any iterable of ints) appended to
 * ``l``, all or none: 0, or -1 with an exception */
static int
links_extend(LinksObject *l, PyObject *items)
{
    if (Links_Check(items)) {
        LinksObject *o = (LinksObject *)items;
        Py_ssize_t m = o->n; /* (o may be l) */
        if (links_reserve(l, l->n + m) < 0) {
            return -1;
        }
        memcpy(l->v + l->n, o->v, sizeof(int64_t) * (size_t)m);
        l->n += m;
        return 0;
    }
    PyObject *seq = PySequence_Fast(items, "Links.extend: an iterable of ints");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq), n0 = l->n;
    int r = links_reserve(l, n0 + m);
    for (Py_ssize_t i = 0; r == 0 && i < m; i++) {
        r = link_value(PySequence_Fast_GET_ITEM(seq, i), &l->v[n0 + i]);
    }
    Py_DECREF(seq);
    if (r == 0) {
        l->n = n0 + m;
    }
    return r;
}

static PyObject *
Links_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *items = NULL;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Links() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Links", 0, 1, &items)) {
        return NULL;
    }
    LinksObject *l = (LinksObject *)type->tp_alloc(type, 0);
    if (l != NULL && items != NULL && links_extend(l, items) < 0) {
        Py_CLEAR(l);
    }
    return (PyObject *)l;
}

/* a new, empty Links (new_identity's ``tok``) */
static PyObject *
links_empty(void)
{
    return LinksType.tp_alloc(&LinksType, 0);
}

static void
Links_dealloc(LinksObject *l)
{
    PyMem_Free(l->v);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static Py_ssize_t
Links_len(LinksObject *l)
{
    return l->n;
}

static PyObject *
Links_item(LinksObject *l, Py_ssize_t i)
{
    if (i < 0 || i >= l->n) {
        PyErr_SetString(PyExc_IndexError, "Links index out of range");
        return NULL;
    }
    return PyLong_FromLongLong(l->v[i]);
}

static PyObject *
Links_inplace_concat(LinksObject *l, PyObject *items)
{
    if (links_extend(l, items) < 0) {
        return NULL;
    }
    return Py_NewRef(l);
}

static PyObject *
Links_append(LinksObject *l, PyObject *item)
{
    int64_t x;
    if (link_value(item, &x) < 0 || links_push(l, x) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Links_extend(LinksObject *l, PyObject *items)
{
    if (links_extend(l, items) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Links_tolist(LinksObject *l, PyObject *Py_UNUSED(unused))
{
    PyObject *out = PyList_New(l->n);
    for (Py_ssize_t i = 0; out != NULL && i < l->n; i++) {
        PyObject *v = PyLong_FromLongLong(l->v[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* == and != with another Links or a list or tuple of ints (a chain's
 * ``tok`` is a list where kvsan._native._tokenlinks is not in use) */
static PyObject *
Links_richcompare(LinksObject *l, PyObject *other, int op)
{
    if ((op != Py_EQ && op != Py_NE)
        || !(Links_Check(other) || PyList_Check(other) || PyTuple_Check(other))) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    int eq;
    if (Links_Check(other)) {
        LinksObject *o = (LinksObject *)other;
        eq = o->n == l->n && (l->n == 0 || !memcmp(l->v, o->v, sizeof(int64_t) * (size_t)l->n));
    } else {
        PyObject *mine = Links_tolist(l, NULL);
        if (mine == NULL) {
            return NULL;
        }
        PyObject *theirs = PyList_Check(other) ? Py_NewRef(other) : PySequence_List(other);
        eq = theirs == NULL ? -1 : PyObject_RichCompareBool(mine, theirs, Py_EQ);
        Py_DECREF(mine);
        Py_XDECREF(theirs);
        if (eq < 0) {
            return NULL;
        }
    }
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyObject *
Links_repr(LinksObject *l)
{
    PyObject *lst = Links_tolist(l, NULL);
    if (lst == NULL) {
        return NULL;
    }
    PyObject *r = PyUnicode_FromFormat("Links(%R)", lst);
    Py_DECREF(lst);
    return r;
}

static PyObject *
Links_sizeof(LinksObject *l, PyObject *Py_UNUSED(unused))
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(LinksObject)
                              + (Py_ssize_t)sizeof(int64_t) * l->cap);
}

static PySequenceMethods Links_as_sequence = {
    .sq_length = (lenfunc)Links_len,
    .sq_item = (ssizeargfunc)Links_item,
    .sq_inplace_concat = (binaryfunc)Links_inplace_concat,
};

static PyMethodDef Links_methods[] = {
    {"append", (PyCFunction)Links_append, METH_O, "append(link): one link more"},
    {"extend", (PyCFunction)Links_extend, METH_O, "extend(links): an iterable of links more"},
    {"tolist", (PyCFunction)Links_tolist, METH_NOARGS, "tolist() -> the links as a list of ints"},
    {"__sizeof__", (PyCFunction)Links_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LinksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvsan._native._tokenlinks.Links",
    .tp_doc = "A token chain's links: a growable array of 64-bit ints (a list's "
              "len, [i], +=, append, extend; == with a list).",
    .tp_basicsize = sizeof(LinksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Links_new,
    .tp_dealloc = (destructor)Links_dealloc,
    .tp_as_sequence = &Links_as_sequence,
    .tp_richcompare = (richcmpfunc)Links_richcompare,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_repr = (reprfunc)Links_repr,
    .tp_methods = Links_methods,
};

/* ------------------------------------------------------------ links */

/* append to ``out`` (a list or a Links) the links of blocks [start, upto)
 * of ``tokens``, each ``hash((previous link, tuple(tokens[k*bs:(k+1)*bs])))``
 * starting from the link ``parent``; 0, or -1 with an exception */
static int
append_links(PyObject *out, PyObject *tokens, Py_ssize_t bs, Py_ssize_t start,
             Py_ssize_t upto, Py_hash_t parent)
{
    for (Py_ssize_t k = start; k < upto; k++) {
        /* tokens[k*bs:(k+1)*bs], clipped as a slice is */
        Py_ssize_t n = PyList_GET_SIZE(tokens);
        Py_ssize_t lo = k * bs < n ? k * bs : n;
        Py_ssize_t hi = (k + 1) * bs < n ? (k + 1) * bs : n;
        Py_uhash_t acc = XXPRIME_5;
        for (Py_ssize_t i = lo; i < hi; i++) {
            PyObject *item = Py_NewRef(PyList_GET_ITEM(tokens, i));
            Py_hash_t h = token_hash(item);
            Py_DECREF(item);
            if (h == -1 && PyErr_Occurred()) {
                return -1;
            }
            acc = acc_lane(acc, (Py_uhash_t)h);
            if (PyList_GET_SIZE(tokens) != n) {
                PyErr_SetString(PyExc_RuntimeError, "links: the token list changed");
                return -1;
            }
        }
        Py_hash_t inner = acc_finish(acc, hi - lo);
        /* hash((parent, inner tuple)): the parent's lane is hash(parent) */
        Py_hash_t ph = link_hash(parent);
        if (ph == -1 && PyErr_Occurred()) {
            return -1;
        }
        acc = acc_lane(XXPRIME_5, (Py_uhash_t)ph);
        acc = acc_lane(acc, (Py_uhash_t)inner);
        parent = acc_finish(acc, 2);
        if (Links_Check(out)) {
            if (links_push((LinksObject *)out, (int64_t)parent) < 0) {
                return -1;
            }
            continue;
        }
        PyObject *v = PyLong_FromSsize_t(parent);
        if (v == NULL) {
            return -1;
        }
        int r = PyList_Append(out, v);
        Py_DECREF(v);
        if (r < 0) {
            return -1;
        }
    }
    return 0;
}

static int
check_range(Py_ssize_t bs, Py_ssize_t start, Py_ssize_t upto)
{
    if (PyErr_Occurred()) {
        return -1;
    }
    if (bs <= 0 || start < 0 || upto < start) {
        PyErr_SetString(PyExc_ValueError, "links: bs > 0 and 0 <= start <= upto");
        return -1;
    }
    return 0;
}

/* links(tokens, bs, start, upto, parent) -> [link of block k for k in
 * range(start, upto)], each ``hash((previous link, tuple(tokens[k*bs:(k+1)*bs])))``
 * starting from ``parent`` */
static PyObject *
links(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "links(tokens: list, bs, start, upto, parent)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t upto = PyLong_AsSsize_t(args[3]);
    if (check_range(bs, start, upto) < 0) {
        return NULL;
    }
    Py_hash_t parent = PyObject_Hash(args[4]);
    if (parent == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    if (append_links(out, args[0], bs, start, upto, parent) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* a chain's ``tok`` (a Links, or a list where Python made it) */
static inline int
tok_check(PyObject *tok)
{
    return Links_Check(tok) || PyList_CheckExact(tok);
}

static inline Py_ssize_t
tok_size(PyObject *tok)
{
    return Links_Check(tok) ? ((LinksObject *)tok)->n : PyList_GET_SIZE(tok);
}

/* ``chain`` (a Links, or a list: a chain's ``tok``, ``mm`` or ``emb``) cut
 * back to its first ``n`` items: 0, or -1 with an exception */
static int
tok_cut(PyObject *chain, Py_ssize_t n)
{
    if (Links_Check(chain)) {
        LinksObject *l = (LinksObject *)chain;
        l->n = n < l->n ? n : l->n;
        return 0;
    }
    Py_ssize_t len = PyList_GET_SIZE(chain);
    return len > n ? PyList_SetSlice(chain, n, len, NULL) : 0;
}

/* extend_text(tok, mm, emb, tokens, bs, upto): a text-only request's
 * identity chain (RequestIdentity.extend without multimodal input or prompt
 * embeddings) in one call: ``tok`` gets the links of blocks [len(tok),
 * upto), from its last link (0 when empty), and ``mm`` / ``emb`` are padded
 * with b"" to at least that length (they may be one list, shared by every
 * text-only chain: RequestIdentity.TEXT_ONLY) */
static PyObject *
extend_text(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !tok_check(args[0]) || !PyList_CheckExact(args[1])
        || !PyList_CheckExact(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "extend_text(tok: Links | list, mm: list, emb: list, "
                                         "tokens: list, bs, upto)");
        return NULL;
    }
    PyObject *tok = args[0];
    Py_ssize_t start = tok_size(tok);
    Py_ssize_t bs = PyLong_AsSsize_t(args[4]);
    Py_ssize_t upto = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (upto <= start) {
        Py_RETURN_NONE;
    }
    if (check_range(bs, start, upto) < 0) {
        return NULL;
    }
    Py_hash_t parent = 0;
    if (start && Links_Check(tok)) {
        parent = (Py_hash_t)((LinksObject *)tok)->v[start - 1]; /* (hashed as a link) */
    } else if (start) {
        parent = PyObject_Hash(PyList_GET_ITEM(tok, start - 1));
        if (parent == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    Py_ssize_t mm0 = PyList_GET_SIZE(args[1]), emb0 = PyList_GET_SIZE(args[2]);
    PyObject *empty = NULL;
    if (append_links(tok, args[3], bs, start, upto, parent) < 0) {
        goto error;
    }
    empty = PyBytes_FromStringAndSize(NULL, 0);
    if (empty == NULL) {
        goto error;
    }
    for (int c = 1; c <= 2; c++) {
        PyObject *chain = args[c];
        while (PyList_GET_SIZE(chain) < upto) {
            if (PyList_Append(chain, empty) < 0) {
                goto error;
            }
        }
    }
    Py_DECREF(empty);
    Py_RETURN_NONE;
error: /* all or nothing: the three chains cut back to where they were */
    Py_XDECREF(empty);
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_ssize_t sizes[3] = {start, mm0, emb0};
        for (int c = 0; c < 3; c++) {
            if (tok_cut(args[c], sizes[c]) < 0) {
                PyErr_Clear();
            }
        }
        PyErr_Restore(type, value, tb);
    }
    return NULL;
}

/* known_chain(chains, request, bs, upto[, make]) -> the request's identity
 * chain extended to ``upto`` blocks, or None (the Python path decides: a
 * request without a chain yet and no ``make``, a new Request object under a
 * known id, multimodal input or prompt embeddings, tokens not in a list).
 * ``chains``: request id -> its RequestIdentity (a weak reference to the
 * Request), as kvsan.hooks.vllm.identity keeps them; the same steps as its
 * ``_chain`` for a known text-only request, without a Python frame.
 *
 * ``make``: (RequestIdentity, static digests, callback) to start the chain
 * of a request that has none yet and neither a LoRA adapter nor a
 * cache_salt, as ``_chain`` starts it: the static digests are those
 * ``_chain`` would give it (the caller passes them), and the callback drops
 * the entry with the Request. */
/* weakref.ref, the type RequestIdentity derives from (from the _weakref
 * module at init: a strong reference) */
static PyTypeObject *weakref_type = NULL;

static PyObject *s_request_id, *s_mm_features, *s_prompt_embeds, *s_all_token_ids,
    *s_lora_request, *s_cache_salt, *s_rid, *s_TEXT_ONLY;

/* a new RequestIdentity(static, request, callback, rid) -- a weak reference
 * to ``request`` -- without running its __init__ in Python (a frame per new
 * request): the object as weakref.ref's tp_new makes it (with the request
 * and the callback), with the five slots __init__ sets --
 * ``static``, an empty ``tok`` (a Links), ``mm`` and ``emb`` both the type's
 * TEXT_ONLY list, shared by every text-only chain, and ``rid``
 * (kvsan.checks.identity.RequestIdentity.__init__ says so too;
 * tests/test_identity.py compares the two).  New reference or NULL. */
static PyObject *
new_identity(PyObject *type, PyObject *statics, PyObject *request, PyObject *callback,
             PyObject *rid)
{
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, weakref_type)) {
        PyErr_SetString(PyExc_TypeError, "known_chain: make[0] must be a weakref.ref type");
        return NULL;
    }
    PyObject *targs = PyTuple_Pack(2, request, callback);
    if (targs == NULL) {
        return NULL;
    }
    /* weakref.ref's own __new__, as RequestIdentity.__new__ calls it */
    PyObject *ident = weakref_type->tp_new((PyTypeObject *)type, targs, NULL);
    Py_DECREF(targs);
    if (ident == NULL) {
        return NULL;
    }
    PyObject *tok = links_empty();
    PyObject *shared = tok == NULL ? NULL : PyObject_GetAttr(type, s_TEXT_ONLY);
    int r = shared == NULL ? -1 : 0;
    if (r == 0 && !PyList_CheckExact(shared)) {
        PyErr_SetString(PyExc_TypeError, "known_chain: make[0].TEXT_ONLY must be a list");
        r = -1;
    }
    if (r < 0 || ident_set(ident, I_STATIC, statics) < 0 || ident_set(ident, I_TOK, tok) < 0
        || ident_set(ident, I_MM, shared) < 0 || ident_set(ident, I_EMB, shared) < 0
        || ident_set(ident, I_RID, rid) < 0) {
        Py_XDECREF(tok);
        Py_XDECREF(shared);
        Py_DECREF(ident);
        return NULL;
    }
    Py_DECREF(tok);
    Py_DECREF(shared);
    return ident;
}

/* a new entry in ``chains`` for ``request`` (id ``rid``), as described
 * above: the new RequestIdentity (borrowed from the entry), None (borrowed:
 * not one ``make`` starts), or NULL with an exception */
static PyObject *
start_chain(PyObject *chains, PyObject *request, PyObject *rid, PyObject *make)
{
    if (!PyTuple_CheckExact(make) || PyTuple_GET_SIZE(make) != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "known_chain: make is (RequestIdentity, static, callback)");
        return NULL;
    }
    PyObject *lora = PyObject_GetAttr(request, s_lora_request);
    if (lora == NULL) {
        return NULL;
    }
    PyObject *salt = PyObject_GetAttr(request, s_cache_salt);
    if (salt == NULL) {
        Py_DECREF(lora);
        return NULL;
    }
    int plain = lora == Py_None && salt == Py_None;
    Py_DECREF(lora);
    Py_DECREF(salt);
    if (!plain) {
        return Py_None;
    }
    PyObject *ident = new_identity(PyTuple_GET_ITEM(make, 0), PyTuple_GET_ITEM(make, 1),
                                   request, PyTuple_GET_ITEM(make, 2), rid);
    if (ident == NULL) {
        return NULL;
    }
    if (PyDict_SetItem(chains, rid, ident) < 0) {
        Py_DECREF(ident);
        return NULL;
    }
    Py_DECREF(ident); /* the entry holds it */
    return ident;
}

static PyObject *
known_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 4 && nargs != 5) || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "known_chain(chains: dict, request, bs, upto[, make])");
        return NULL;
    }
    PyObject *request = args[1];
    PyObject *rid = PyObject_GetAttr(request, s_request_id);
    if (rid == NULL) {
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(args[0], rid); /* borrowed */
    PyObject *ident;
    if (entry == NULL) {
        if (PyErr_Occurred() || nargs == 4) {
            Py_DECREF(rid);
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        ident = start_chain(args[0], request, rid, args[4]);
        Py_DECREF(rid);
        if (ident == NULL || ident == Py_None) {
            return ident == NULL ? NULL : Py_NewRef(Py_None);
        }
    } else {
        Py_DECREF(rid);
        if (!PyWeakref_CheckRef(entry) || PyWeakref_GET_OBJECT(entry) != request) {
            Py_RETURN_NONE; /* (a new Request object under a known id: Python's) */
        }
        ident = entry;
    }
    Py_INCREF(ident); /* held while extending (a callback may drop the entry) */
    PyObject *out = NULL;
    Py_ssize_t upto = PyLong_AsSsize_t(args[3]);
    if (upto == -1 && PyErr_Occurred()) {
        Py_DECREF(ident);
        return NULL;
    }
    PyObject *tok = ident_get(ident, I_TOK);
    if (tok == NULL) {
        Py_DECREF(ident);
        return NULL;
    }
    if (!tok_check(tok)) {
        out = Py_NewRef(Py_None);
        Py_DECREF(tok);
        Py_DECREF(ident);
        return out;
    }
    if (tok_size(tok) >= upto) {
        Py_DECREF(tok);
        return ident;
    }
    /* to be extended: only a text-only request's chain, over a token list */
    PyObject *argv[6] = {tok, NULL, NULL, NULL, args[2], args[3]};
    PyObject *feats = NULL, *embeds = NULL;
    int text_only = 0;
    feats = PyObject_GetAttr(request, s_mm_features);
    embeds = feats == NULL ? NULL : PyObject_GetAttr(request, s_prompt_embeds);
    if (embeds == NULL) {
        goto done;
    }
    int has_feats = PyObject_IsTrue(feats);
    if (has_feats < 0) {
        goto done;
    }
    text_only = !has_feats && embeds == Py_None;
    if (!text_only) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    argv[3] = PyObject_GetAttr(request, s_all_token_ids);
    if (argv[3] == NULL) {
        PyErr_Clear(); /* the Python path reads all_token_ids */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (!PyList_CheckExact(argv[3])) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    argv[1] = ident_get(ident, I_MM);
    argv[2] = argv[1] == NULL ? NULL : ident_get(ident, I_EMB);
    if (argv[2] == NULL) {
        goto done;
    }
    if (!PyList_CheckExact(argv[1]) || !PyList_CheckExact(argv[2])) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *r = extend_text(module, argv, 6);
    if (r != NULL) {
        Py_DECREF(r);
        out = Py_NewRef(ident);
    }
done:
    Py_XDECREF(argv[1]);
    Py_XDECREF(argv[2]);
    Py_XDECREF(argv[3]);
    Py_XDECREF(feats);
    Py_XDECREF(embeds);
    Py_DECREF(tok);
    Py_DECREF(ident);
    return out;
}

/* reap(chains, chain): a chain's callback (it is a weak reference to its
 * Request), as kvsan.hooks.vllm.identity._reap (a Python frame per request
 * end): its Request went, so its entry goes, unless a newer Request under
 * the same id replaced it.  Bound to the chains dict with functools.partial. */
static PyObject *
reap(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "reap(chains: dict, ref)");
        return NULL;
    }
    PyObject *rid = PyObject_GetAttr(args[1], s_rid);
    if (rid == NULL) {
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(args[0], rid); /* borrowed */
    int r = 0;
    if (entry == args[1]) {
        r = PyDict_DelItem(args[0], rid);
    }
    Py_DECREF(rid);
    if (r < 0 || PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reap", (PyCFunction)(void (*)(void))reap, METH_FASTCALL,
     "reap(chains, chain): drop chain's entry (chains[chain.rid]) if it is still chain (its "
     "weak reference's callback)"},
    {"known_chain", (PyCFunction)(void (*)(void))known_chain, METH_FASTCALL,
     "known_chain(chains, request, bs, upto[, make]) -> a known (or, with make, new) "
     "text-only request's identity chain extended to upto blocks, or None (the Python path "
     "decides)"},
    {"links", (PyCFunction)(void (*)(void))links, METH_FASTCALL,
     "links(tokens, bs, start, upto, parent) -> the token chain's links of blocks "
     "[start, upto), as hash((parent, tuple(block tokens))) would give them"},
    {"extend_text", (PyCFunction)(void (*)(void))extend_text, METH_FASTCALL,
     "extend_text(tok, mm, emb, tokens, bs, upto): a text-only identity chain extended "
     "to upto blocks (links appended, mm / emb padded with b'')"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef tokenlinks_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsan._native._tokenlinks",
    .m_doc = "The identity audit's token chain in C (optional speed-up).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__tokenlinks(void)
{
    struct {
        PyObject **var;
        const char *text;
    } names[] = {{&s_request_id, "request_id"}, {&s_mm_features, "mm_features"},
                 {&s_prompt_embeds, "prompt_embeds"}, {&s_all_token_ids, "_all_token_ids"},
                 {&s_lora_request, "lora_request"}, {&s_cache_salt, "cache_salt"}, {&s_rid, "rid"},
                 {&s_TEXT_ONLY, "TEXT_ONLY"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if ((*names[i].var = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return NULL;
        }
    }
    if (ident_names_init() < 0 || PyType_Ready(&LinksType) < 0) {
        return NULL;
    }
    if (weakref_type == NULL) {
        PyObject *wr = PyImport_ImportModule("_weakref");
        PyObject *ref = wr == NULL ? NULL : PyObject_GetAttrString(wr, "ref");
        Py_XDECREF(wr);
        if (ref == NULL) {
            return NULL;
        }
        if (!PyType_Check(ref)) {
            Py_DECREF(ref);
            PyErr_SetString(PyExc_TypeError, "kvsan._native._tokenlinks: _weakref.ref is not a type");
            return NULL;
        }
        weakref_type = (PyTypeObject *)ref;
    }
    PyObject *m = PyModule_Create(&tokenlinks_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", KVSAN_TOKENLINKS_ABI) < 0
        || PyModule_AddIntConstant(m, "AVAILABLE", 1) < 0
        || PyModule_AddObjectRef(m, "Links", (PyObject *)&LinksType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
