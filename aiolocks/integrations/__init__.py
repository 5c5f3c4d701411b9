"""Web framework integrations: hold a lock for the duration of a request.

`aiolocks.integrations.fastapi` (extra `fastapi`) and `aiolocks.integrations.aiohttp`
(extra `aiohttp`). Nothing is imported here, so `import aiolocks` never needs either
framework.
"""
