"""Admitting a client request: its body read within limits (`body`), parsed and validated
into an immutable `RequestSpec` (`spec`), the key's tenant (`auth`, `tenants`) and a slot
(`limiter`).

May import observability, config and the leaves.
"""
