/* kvsan's C modules calling one another directly.
 *
 * kvsan._native._hookfast runs an allocator event through kvsan._native._frames (the call
 * context) and kvsan._native._shadowfast (the event itself).  Through their Python
 * methods each call costs a method lookup, an argument check and a result
 * object (a (site, owner) tuple, a result tuple, a list of freed ids then
 * copied into the step journal): on a 4-block prefix hit that was more than
 * vLLM's own ``touch``.  Each module therefore also exports a capsule of C
 * functions (``kvsan._native._frames._C_API``, ``kvsan._native._shadowfast._C_API``) that do
 * the same work without those objects.  _hookfast imports them at
 * configure(); where one is missing or of another ABI it keeps the method
 * route, which gives the same results.
 */
#ifndef KVSAN_CAPI_H
#define KVSAN_CAPI_H

#define KVSAN_CAPI_ABI 3

typedef struct {
    int abi;
    /* the (site, owner) of the engine frame that called the running C
     * function (depth 0), as new references in *site and *owner: 1 found,
     * 0 no Python frame at all (the caller falls back), -1 error */
    int (*context)(PyObject *owner_ctx, PyObject **site, PyObject **owner);
} KvsanFramesAPI;

typedef struct {
    int abi;
    PyTypeObject *table_type; /* the functions below take a table of this type */
    /* Table.allocate / share / release / cache, returning Py_True (a new
     * reference) where the method returns a result and None where it does
     * (not clean).  The block ids the method returns for the step journal
     * (evicted, freed, cached) are appended to ``dest`` (a list) instead. */
    PyObject *(*allocate)(PyObject *t, PyObject *const *args, Py_ssize_t nargs, PyObject *dest);
    PyObject *(*share)(PyObject *t, PyObject *const *args, Py_ssize_t nargs);
    /* release: the snapshot as ``snapshot`` wrote it; args: owner, step, site */
    PyObject *(*release)(PyObject *t, PyObject *blocks, const long long *snap,
                         PyObject *const *args, PyObject *dest);
    PyObject *(*cache)(PyObject *t, PyObject *blocks, PyObject *dest);
    /* Table.snapshot into ``out`` (one entry per block: ref << 1 | linked,
     * -1 for a null block): 1 done, 0 not simple (the method's None), -1 error */
    int (*snapshot)(PyObject *t, PyObject *blocks, PyObject *pool, long long *out);
    /* that snapshot of ``k`` blocks as Table.snapshot's list */
    PyObject *(*snapshot_list)(const long long *snap, Py_ssize_t k);
} KvsanShadowAPI;

#define KVSAN_FRAMES_CAPSULE "kvsan._native._frames._C_API"
#define KVSAN_SHADOW_CAPSULE "kvsan._native._shadowfast._C_API"

#endif
