"""The router's fixed vocabularies (routes, breaker states, verdicts, roles, modes) as
string enums.

They are `enum.StrEnum`s so that a member is its string: comparisons with config values,
metric labels, JSON log fields and `check-config` output read exactly as the plain
strings did.
"""

from __future__ import annotations

from enum import StrEnum


class Route(StrEnum):
    """How a request's first token was reached (the `route` log field and metric label)."""

    PROBE_HIT = "probe_hit"  # an engine accepted a probe
    PD = "pd"  # prefill on a producer, decode on a consumer
    DIRECT = "direct"  # sent to one engine at threshold 0
    FORWARD = "forward"  # a non-generation route relayed as it is


class BreakerState(StrEnum):
    """A backend's circuit breaker."""

    CLOSED = "closed"
    HALF_OPEN = "half_open"  # lets one trial request through
    OPEN = "open"


# The breaker's gauge value (cachehit_router_backend_breaker_state).
BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class RaceReason(StrEnum):
    """Why a request raced, or did not (the `race_reason` log field and metric label)."""

    RACED = "raced"  # engines the index cannot speak for may hold it: asked
    ALWAYS = "always"  # routing.race = "always"
    INDEX_KNOWS = "index_knows"  # the KV-event index speaks for every engine worth asking
    MEMORY_KNOWS = "memory_knows"  # the router's memory is current and complete: what it placed stands
    NOT_WORTH = "not_worth"  # past races saved less than waiting for verdicts costs
    SHORT_PROMPT = "short_prompt"  # no hit could save more than the wait
    NO_ACCEPTOR = "no_acceptor"  # no engine as an acceptor beats computing the prompt
    NO_PROBE_ENGINE = "no_probe_engine"  # no engine runs the threshold
    NOT_RACING = "not_racing"  # the policy never races


class Verdict(StrEnum):
    """What one engine said of a leg sent to it: the one vocabulary of the race, the
    request record and the metrics (an engine's own answer is the wire's finish reason,
    `router.engine.wire.CACHE_THRESHOLD`)."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"  # finished with cache_threshold and generated nothing
    FAILED = "failed"  # an upstream error before any verdict
    EXPIRED = "expired"  # silent at the race deadline
    LOST = "lost"  # accepted after the winner, or still running when the winner was chosen


class Role(StrEnum):
    """What a router backend does (`[[backends]].role`, `[[discovery]].role`)."""

    DECODE = "decode"
    PREFILL = "prefill"
    BOTH = "both"


class EngineRole(StrEnum):
    """What a launched engine does in NIXL's terms (`[[engines]].role`)."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"

    @property
    def backend_role(self) -> Role:
        return {EngineRole.PRODUCER: Role.PREFILL, EngineRole.CONSUMER: Role.DECODE, EngineRole.BOTH: Role.BOTH}[self]


class EngineKind(StrEnum):
    """What the launcher starts (`[[engines]].kind`)."""

    SIM = "sim"
    VLLM = "vllm"


class Mode(StrEnum):
    """`routing.race`: decided by the cost model, or every time."""

    AUTO = "auto"
    ALWAYS = "always"


class SplitMode(StrEnum):
    """`routing.split`: decided by the cost model (goodput), every time, or never."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class RouteReason(StrEnum):
    """Why a request was placed where it was (its log line's `route_reason`)."""

    PROBE_HIT = "probe_hit"  # an engine accepted the probe: it holds the prompt
    DIRECT = "direct"  # the strategy's own choice, no fallback weighed
    GOODPUT_DIRECT = "goodput_direct"  # computed on a decoder: loses the fewest requests
    GOODPUT_SPLIT = "goodput_split"  # prefill/decode: loses the fewest requests
    # Predicted to miss an SLO wherever it goes: prefilled on an idle producer, another idle
    SPARE_PRODUCER = "spare_producer"
    # Tied with a decoder on goodput's count, split through an idle producer: it delays the
    # sequences decoding on that decoder less than the prefill there would
    IDLE_PRODUCER = "idle_producer"
    SPLIT_ALWAYS = "split_always"  # routing.split = "always"
    SPLIT_NEVER = "split_never"  # routing.split = "never"
    NO_PRODUCER = "no_producer"  # no prefill engine to split with
    BELOW_SPLIT_FLOOR = "below_split_floor"  # what the decoders lack is under min_pd_prompt_tokens
