"""The engine: one acquisition, one holding, one release, shared by every primitive.

`ClientContext` (`_context`) ties a client's runner, wait queue, notifier and keeper
together; `_acquire` is the one acquisition (TRY, PARK, SLEEP, OUTAGE); `LeasedLock`
(`_leasedlock`) is what users call, with holdings (`_holding`, `_lockcore`), release and
clean-up that outlives its caller (`_release`), local hand-off (`_cohort`) and hand-over
(`_handover`).
Imports every folder below it, never a primitive. Read `_acquire`, then `_leasedlock`.
"""
