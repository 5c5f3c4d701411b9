"""The engine: one acquisition, one holding, one release, shared by every primitive.

`ClientContext` (`_context`) ties a client's runner, wait queue, notifier and keeper
together; `_acquire` is the one acquisition (TRY, PARK, SLEEP, OUTAGE); `LeasedLock`
(`_leasedlock`) is what users call, read whole in one class (holdings, `max_hold`, a lost
lease, `replicas=`, hand-over), with its local hand-off among a process's tasks (`Cohort`,
in the same module); release and clean-up that outlives its caller (`_release`).
Imports every folder below it, never a primitive. Read `_acquire`, then `_leasedlock`.
"""
