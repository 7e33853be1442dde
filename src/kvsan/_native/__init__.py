"""kvsan's native layer: the optional C speed-ups, all in this package.

Every function here is a faster route to a result a Python function
computes; the Python one is the reference (the rule lives there), and the
differential tests (tests/test_differential.py, tests/test_native*.py,
tests/test_device_native.py, tests/test_hookfast.py) drive both on the same
inputs and compare.  A C function that finds anything unusual declines
(returns None or a "not clean" code) and the Python path runs.  None of it
is loaded when ``KVSAN_NATIVE=0`` (:func:`kvsan.hooks.use_native`,
:func:`kvsan.checks.native.load` are the only loaders) or where it was not
built (another Python, no compiler): kvsan then runs the Python paths.

===============================  ===============================================
native (``kvsan._native.``)      the Python reference it twins
===============================  ===============================================
``_frames.context``, ``site``    ``kvsan.hooks.engine_frame``,
                                 ``owner_from_frames``, ``site_of``
``_shadowfast.Table.allocate``   ``checks.allocator.AllocatorChecker.on_allocate``
``Table.share``                  ``AllocatorChecker.on_share``
``Table.snapshot``, ``release``  ``hooks.vllm.allocator._release_obs``,
                                 ``AllocatorChecker.on_release``
``Table.cache``, ``uncache``     ``AllocatorChecker.on_cached``, ``on_uncached``
``Table.settle``                 (the counts C keeps, added to the checker's)
``Table.read_pool``              ``hooks.vllm.allocator.pool_view``
``Table.identity_record``,       ``checks.identity.IdentityAudit.on_cached``,
``identity_hits``                ``on_hits`` (the clean records and hits)
``_shadowfast.HeldMap``,         ``kvsan.shadow.PyHeldMap``, ``PyHold``
``Hold``
``_tokenlinks.links``,           ``checks.identity.RequestIdentity.extend``
``extend_text``, ``Links``       (the token chain) and its ``tok`` list
``_tokenlinks.known_chain``,     ``hooks.vllm.identity``'s chains of known
``reap``                         requests and their weak-reference callback
``_devicefast.guard``            ``checks.device.guard`` (``DeviceChecker.guard``)
``_devicefast.guard_step``       ``hooks.vllm.worker._guard_step``'s Python route
``_devicefast.checksums``        ``DeviceChecker.checksums`` (the torch path)
``_devicefast.check_rows``       ``checks.device.rows``'s ``check_rows``
``_hookfast.Hook`` (ALLOCATE,    the trampoline and Python hook of the same
TOUCH, RELEASE, CACHE, HITS,     method in ``hooks.vllm.allocator``,
END, PREEMPT, FINISH, SKIP,      ``identity``, ``worker`` or ``sampled``;
SCHED, UPDATE, STEP, GUARD,      ``Target.fast`` names the Python second half
ADMIT, ADMIT_ALL, HELD)          it calls
===============================  ===============================================

Files: ``_capi.h`` is the C interface _frames and _shadowfast export to
_hookfast (capsules); ``_slots.h`` the in-line slot reads of vLLM's
``KVCacheBlock`` and kvsan's own slotted classes that _shadowfast,
_tokenlinks, _devicefast and _hookfast share.  Every vLLM attribute the C
reads by name is declared in the start-up contract
(:mod:`kvsan.hooks.vllm.layouts`: a release without one runs the Python
paths).  Build: ``setup.py`` and ``scripts/build_native.py`` (warning-free
under ``-Wall -Wextra``: tests/test_native_build.py); design:
docs/design.md, "Native modules".
"""
