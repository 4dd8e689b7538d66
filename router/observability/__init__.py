"""What the router tells its operators: the request record and its metrics (`record`,
`metrics`), OpenTelemetry spans and the trace context carried to engines, log output and
what is logged about clients.

May import config and the leaves (types of higher layers only under TYPE_CHECKING).
"""
