"""Talking to engines: the vLLM wire format (`wire`: every body sent, every answer read),
the pooled HTTP client and its streamed legs, upstream errors, SSE framing and the
`/metrics` names scraped.

May import observability (trace context, spans), config and the leaves.
"""
