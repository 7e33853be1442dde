/* kvsan._tokenlinks: the identity audit's token chain, computed in C.
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

#define KVSAN_TOKENLINKS_ABI 6

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

/* hash(item) for a token id, read from the int's digit where it has at most
 * one (small_int; CPython's long_hash gives the value, -1 becoming -2), else
 * PyObject_Hash: a block's 16 token hashes were 16 calls through the type */
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
#if defined(_PyHASH_MODULUS) && SIZEOF_PY_HASH_T == 8
    Py_uhash_t mag = x < 0 ? (Py_uhash_t)0 - (Py_uhash_t)x : (Py_uhash_t)x;
    Py_hash_t h = (Py_hash_t)(mag % (Py_uhash_t)_PyHASH_MODULUS);
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

/* append to ``out`` the links of blocks [start, upto) of ``tokens``, each
 * ``hash((previous link, tuple(tokens[k*bs:(k+1)*bs])))`` starting from the
 * link ``parent``; 0, or -1 with an exception */
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
links(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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

/* extend_text(tok, mm, emb, tokens, bs, upto): a text-only request's
 * identity chain (RequestIdentity.extend without multimodal input or prompt
 * embeddings) in one call: ``tok`` gets the links of blocks [len(tok),
 * upto), from its last link (0 when empty), and ``mm`` / ``emb`` are padded
 * with b"" to at least that length (they may be one list, shared by every
 * text-only chain: RequestIdentity.TEXT_ONLY) */
static PyObject *
extend_text(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])
        || !PyList_CheckExact(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "extend_text(tok: list, mm: list, emb: list, tokens: list, bs, upto)");
        return NULL;
    }
    PyObject *tok = args[0];
    Py_ssize_t start = PyList_GET_SIZE(tok);
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
    if (start) {
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
            if (PyList_GET_SIZE(args[c]) > sizes[c]
                && PyList_SetSlice(args[c], sizes[c], PyList_GET_SIZE(args[c]), NULL) < 0) {
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
 * ``chains``: request id -> (weak reference to the Request, its
 * RequestIdentity), as kvsan.hooks.vllm_identity keeps them; the same steps
 * as its ``_chain`` for a known text-only request, without a Python frame.
 *
 * ``make``: (RequestIdentity, static digests, weak reference type, its
 * callback) to start the chain of a request that has none yet and neither
 * a LoRA adapter nor a cache_salt, as ``_chain`` starts it: the static
 * digests are those ``_chain`` would give it (the caller passes them), and
 * the weak reference (a ``weakref.ref`` subclass with a ``rid`` slot) drops
 * the entry with the Request. */
static PyObject *s_request_id, *s_mm_features, *s_prompt_embeds, *s_all_token_ids,
    *s_lora_request, *s_cache_salt, *s_rid, *s_TEXT_ONLY, *empty_tuple;

/* a new RequestIdentity(static) without running its __init__ in Python (a
 * frame per new request): the object as the type's tp_new makes it, with
 * the four slots __init__ sets -- ``static``, an empty ``tok`` list, and
 * ``mm`` and ``emb`` both the type's TEXT_ONLY list, shared by every
 * text-only chain (kvsan.checks.identity.RequestIdentity.__init__ says so
 * too; tests/test_identity.py compares the two).  New reference or NULL. */
static PyObject *
new_identity(PyObject *type, PyObject *statics)
{
    if (!PyType_Check(type) || ((PyTypeObject *)type)->tp_new == NULL) {
        PyErr_SetString(PyExc_TypeError, "known_chain: make[0] must be a type");
        return NULL;
    }
    PyObject *ident = ((PyTypeObject *)type)->tp_new((PyTypeObject *)type, empty_tuple, NULL);
    if (ident == NULL) {
        return NULL;
    }
    PyObject *tok = PyList_New(0);
    PyObject *shared = tok == NULL ? NULL : PyObject_GetAttr(type, s_TEXT_ONLY);
    int r = shared == NULL ? -1 : 0;
    if (r == 0 && !PyList_CheckExact(shared)) {
        PyErr_SetString(PyExc_TypeError, "known_chain: make[0].TEXT_ONLY must be a list");
        r = -1;
    }
    if (r < 0 || ident_set(ident, I_STATIC, statics) < 0 || ident_set(ident, I_TOK, tok) < 0
        || ident_set(ident, I_MM, shared) < 0 || ident_set(ident, I_EMB, shared) < 0) {
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
    if (!PyTuple_CheckExact(make) || PyTuple_GET_SIZE(make) != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "known_chain: make is (RequestIdentity, static, ref type, callback)");
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
    PyObject *ident = new_identity(PyTuple_GET_ITEM(make, 0), PyTuple_GET_ITEM(make, 1));
    if (ident == NULL) {
        return NULL;
    }
    PyObject *rargs[2] = {request, PyTuple_GET_ITEM(make, 3)};
    PyObject *ref = PyObject_Vectorcall(PyTuple_GET_ITEM(make, 2), rargs, 2, NULL);
    PyObject *entry = NULL;
    if (ref == NULL || PyObject_SetAttr(ref, s_rid, rid) < 0
        || (entry = PyTuple_Pack(2, ref, ident)) == NULL
        || PyDict_SetItem(chains, rid, entry) < 0) {
        Py_XDECREF(entry);
        Py_XDECREF(ref);
        Py_DECREF(ident);
        return NULL;
    }
    Py_DECREF(entry);
    Py_DECREF(ref);
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
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2
            || !PyWeakref_Check(PyTuple_GET_ITEM(entry, 0))
            || PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(entry, 0)) != request) {
            Py_RETURN_NONE;
        }
        ident = PyTuple_GET_ITEM(entry, 1);
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
    if (!PyList_CheckExact(tok)) {
        out = Py_NewRef(Py_None);
        Py_DECREF(tok);
        Py_DECREF(ident);
        return out;
    }
    if (PyList_GET_SIZE(tok) >= upto) {
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

/* reap(chains, ref): the weak-reference callback of a chain entry, as
 * kvsan.hooks.vllm_identity._reap (a Python frame per request end): its
 * Request went, so its entry goes, unless a newer Request under the same
 * id replaced it.  Bound to the chains dict with functools.partial. */
static PyObject *
reap(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) >= 1
        && PyTuple_GET_ITEM(entry, 0) == args[1]) {
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
     "reap(chains, ref): drop ref's entry from chains if it is still ref's (a weakref "
     "callback)"},
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
    .m_name = "kvsan._tokenlinks",
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
    if (ident_names_init() < 0 || (empty_tuple = PyTuple_New(0)) == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&tokenlinks_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", KVSAN_TOKENLINKS_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
