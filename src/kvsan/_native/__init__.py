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

=================================  ===========================================
native (``kvsan._native.<mod>``)   Python reference it twins
=================================  ===========================================
``_frames.context``, ``site``      ``kvsan.hooks.engine_frame``,
                                   ``owner_from_frames``, ``site_of``
``_shadowfast.Table.allocate``,    ``kvsan.checks.allocator.AllocatorChecker``
``share``, ``release``,            ``.on_allocate``, ``on_share``,
``uncache``, ``cache``, ``settle`` ``on_release``, ``on_cached`` (clean case)
``_shadowfast.Table.read_pool``    the full audit's pool read
                                   (``kvsan.hooks.vllm.allocator``)
``_shadowfast.Table.identity_*``   ``kvsan.checks.identity`` producer records
                                   and hit checks (clean case)
``_shadowfast.HeldMap``, ``Hold``  ``kvsan.shadow.HeldMap``, ``Hold``
``_tokenlinks.links``,             ``kvsan.checks.identity.RequestIdentity``
``extend_text``, ``known_chain``,  ``.extend`` (the token chain), and its
``reap``, ``Links``                chain bookkeeping
``_devicefast.guard``,             ``kvsan.checks.device.guard`` (write guard)
``guard_step``                     and ``kvsan.hooks.vllm.worker._guard_step``
``_devicefast.checksums``          ``kvsan.checks.device.checksums`` (torch)
``_devicefast.check_rows``         ``kvsan.hooks.vllm.inputs`` row check
``_devicefast.release_held``       ``kvsan.hooks.vllm.worker.forget_runner``
``_hookfast.Hook`` (ALLOCATE,      the Python hooks of
TOUCH, RELEASE, CACHE, HITS, END,  ``kvsan.hooks.vllm.allocator`` /
PREEMPT, FINISH, SKIP, SCHED,      ``identity`` / ``worker`` it replaces
UPDATE, STEP, GUARD)               (``Target.fast`` names each one's pair)
=================================  ===========================================

Files: ``_capi.h`` is the C interface _frames and _shadowfast export to
_hookfast (capsules); ``_slots.h`` the in-line slot reads of vLLM's
``KVCacheBlock`` and kvsan's own slotted classes that _shadowfast,
_tokenlinks, _devicefast and _hookfast share.  Every vLLM attribute the C
reads by name is declared in the adapters' start-up contract
(:mod:`kvsan.hooks.contract`); build: ``setup.py`` and
``scripts/build_native.py``; design: docs/design.md, "Native modules".
"""
