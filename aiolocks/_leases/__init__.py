"""Leases: held leases and the one keeper per client that renews them.

A `Lease` (`_lease`) carries its validity, counted from when the granting or renewing call
was sent, and tells its owner of a loss; the `LeaseKeeper` (`_keeper`) renews every held
lease in batches (`_renewal`, `_renewbatch`) and heartbeats waiters. Imports `_base`,
`_scripts`, `_transport` and `_waiting`. Read `_lease`, then `_keeper`.
"""
