"""Leases: held leases and the one keeper per client that renews them.

`_keeper` holds the whole layer, read top to bottom: a `Lease` carries its validity,
counted from when the granting or renewing call was sent, and tells its owner (its
`Holding`) of a loss; one renewal on the wire renews leases in batches (packed by
`_renewbatch`) and heartbeats waiters; the `LeaseKeeper` decides what is renewed when.
Imports `_base`, `_scripts`, `_transport` and `_waiting`.

"""
