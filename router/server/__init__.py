"""The HTTP server: the aiohttp application and its lifecycle (`app`, `state`), the
handlers (generation routes, vLLM's other routes, the admin API), answers written to the
client (`respond`), SIGHUP reloads.

The top layer: may import every other package; nothing imports it but `router.cli`.
Handlers are given the narrow services they use (`services`), not the whole state.
"""
