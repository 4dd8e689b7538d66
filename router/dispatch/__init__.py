"""Carrying out a plan: the request pipeline from the first leg to the last (`pipeline`),
finding the leg that answers next (`placement`: probe race, fallback, retries), the race,
the prefill/decode protocol, resume after preemption, and the request's context.

May import answer, fleet, routing, engine, admission, observability, config and the
leaves; never the server.
"""
