"""Which replica gets a request: round robin, least load, cache-aware, or least work.

Cache-aware (after SGLang's router, with tier credits and a shared store): when the load is
unbalanced (the busiest replica has `balance_abs_threshold` more requests than the least busy
and `balance_rel_threshold` times its load), the least loaded replica; otherwise the replica
whose caches hold the most of the prompt (device blocks count 1, host and store blocks their
credit), if that is at least `cache_threshold` of the prompt; otherwise the least loaded one,
and among equally loaded ones the one whose device cache holds the fewest blocks (SGLang's
"smallest tree"): a new session whose prompt shares only a system prompt with the cached ones
goes where it adds least pressure, rather than to the first of several idle replicas, which
would gather every session on one replica whenever they arrive while the others idle.
With `spread_shared_prefixes` (the default) only replicas holding some of the conversation's own
blocks, past what it shares with other conversations (branches.py), count as holding the prompt:
a new session that shares a system prompt with cached ones is a new conversation, placed by load,
and the system prompt is computed once more on the replica it lands on; SGLang's rule (every
cached block counts) gathers such sessions on the replica that served the first.
A replica the router sent the conversation's previous turn to holds that history as far as the
router is concerned, whatever its KV events say yet (`Candidate.sent_blocks`): they lag behind the
answer, and a replica's index is forgotten when its events are lost or it misses health checks.
So a later turn stays with its own history, the longest match, instead of being placed by load
like a new conversation (SGLang's router likewise inserts a prompt into the chosen worker's tree
when it routes it).
The rule, then: the replica holding the longest match wins whenever that match reaches past the
part the prompt shares with other conversations (its own history: its index's blocks past that
part, or the previous turn the router sent it, even one whose last block this prompt renders
otherwise, branches.py); a prompt whose only match is that shared part (every agent session's
system prompt) is placed by load, which spreads sessions over the replicas. Agent sessions
sharing a long system prompt thus each stay on the replica holding their history
(issue 29's check: tests/router/test_held_out_sessions.py). Placing by load counts the blocks
routed to a replica since its device cache size last changed as cached there too: without them,
a second session arriving before the first one's KV events would join it on the same replica.

Least work: the replica where the request's first token is estimated to come soonest, the prompt
blocks it would compute there (the prompt less the replica's credit) plus `request_cost_blocks`
for each request already running or waiting there. Unlike cache-aware it moves a new session off
the replica holding a shared system prompt once that replica is busy enough to cost more than
computing the prompt elsewhere, while a session whose history is cached stays put.

Ties go to the replica that served the same session last (prompt_cache_key, metadata.user_id,
x-session-id), then to the least loaded, then to the first listed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from deepinfer.config.router import RouterConfig
from deepinfer.router.index import PrefixMatch

CREDIT_EPSILON = 1e-6


class Routable(Protocol):
    name: str

    @property
    def load(self) -> int: ...


@dataclass(slots=True)
class Candidate:
    replica: Routable
    match: PrefixMatch | None  # None: nothing known of the prompt (no features, or no events)
    total_blocks: int
    cached_blocks: int = 0  # blocks the replica's device cache holds (the router's index)
    # blocks of this prompt the router sent to this replica as the conversation's previous turn
    # (0: none, or that turn was only what other conversations share too)
    sent_blocks: int = 0

    @property
    def credit(self) -> float:
        return self.match.credit if self.match is not None else 0.0

    @property
    def held(self) -> float:
        """What the replica holds of the prompt: its index's credit, or the previous turn the
        router sent it when its events have not told (or no longer tell) as much."""
        return max(self.credit, float(self.sent_blocks))

    @property
    def holds_own_history(self) -> bool:
        return self.sent_blocks > 0 or (self.match is not None and self.match.own_credit > 0)


@dataclass(slots=True)
class Decision:
    replica: Routable
    reason: str  # round_robin | load | balance | cache | affinity | work
    credit: float
    total_blocks: int


class Policy:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turns = itertools.count()
        self._sessions: dict[str, str] = {}  # session key -> replica name that served it last
        # replica name -> (its cached_blocks when last chosen by cache_aware, the prompt blocks it
        # was sent to compute since that count last changed): what its events have not told yet
        self._unreported: dict[str, tuple[int, int]] = {}

    def choose(self, candidates: list[Candidate], session: str | None) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        policy = self.config.policy
        if policy == "round_robin":
            chosen = candidates[next(self._turns) % len(candidates)]
            decision = Decision(chosen.replica, "round_robin", chosen.credit, chosen.total_blocks)
        elif policy == "least_load":
            chosen = self._least_loaded(candidates, session)
            decision = Decision(chosen.replica, "load", chosen.credit, chosen.total_blocks)
        elif policy == "least_work":
            decision = self._least_work(candidates, session)
        else:
            decision = self._cache_aware(candidates, session)
        if session is not None:
            self._sessions[session] = decision.replica.name
            if len(self._sessions) > 100_000:  # bounded: the oldest sessions are forgotten
                self._sessions.pop(next(iter(self._sessions)))
        return decision

    def _least_loaded(self, candidates: list[Candidate], session: str | None) -> Candidate:
        last = self._sessions.get(session) if session is not None else None
        return min(candidates, key=lambda c: (c.replica.load, c.replica.name != last))

    def _cache_aware(self, candidates: list[Candidate], session: str | None) -> Decision:
        """The cache-aware choice; records the blocks sent to the chosen replica (`_unreported`)."""
        chosen, reason = self._cache_aware_choice(candidates, session)
        seen, routed = self._unreported.get(chosen.replica.name, (-1, 0))
        computed = max(chosen.total_blocks - round(chosen.held), 0)
        # a changed count means events arrived: they tell what the replica holds from then on
        routed = routed + computed if seen == chosen.cached_blocks else computed
        self._unreported[chosen.replica.name] = (chosen.cached_blocks, routed)
        return Decision(chosen.replica, reason, chosen.credit, chosen.total_blocks)

    def _cached_estimate(self, candidate: Candidate) -> int:
        """The replica's device blocks, with those sent since its count last changed."""
        seen, routed = self._unreported.get(candidate.replica.name, (-1, 0))
        return candidate.cached_blocks + (routed if seen == candidate.cached_blocks else 0)

    def _cache_aware_choice(self, candidates: list[Candidate], session: str | None) -> tuple[Candidate, str]:
        config = self.config
        loads = [c.replica.load for c in candidates]
        busiest, idlest = max(loads), min(loads)
        if (
            busiest - idlest > config.balance_abs_threshold
            and busiest > config.balance_rel_threshold * idlest
        ):
            return self._least_loaded(candidates, session), "balance"
        holders = candidates
        if config.spread_shared_prefixes:  # replicas holding some of this conversation's own blocks
            holders = [c for c in candidates if c.holds_own_history]
        best = max((c.held for c in holders), default=0.0)
        total = candidates[0].total_blocks
        if total and best / total >= config.cache_threshold:
            tied = [c for c in holders if c.held >= best - CREDIT_EPSILON]
            return self._least_loaded(tied, session), "cache"
        last = self._sessions.get(session) if session is not None else None
        chosen = min(
            candidates, key=lambda c: (c.replica.load, c.replica.name != last, self._cached_estimate(c))
        )
        return chosen, "affinity" if last == chosen.replica.name and len(candidates) > 1 else "load"

    def _least_work(self, candidates: list[Candidate], session: str | None) -> Decision:
        cost = self.config.request_cost_blocks
        last = self._sessions.get(session) if session is not None else None

        def work(c: Candidate) -> tuple[float, bool, int]:
            blocks_left = max(c.total_blocks - c.held, 0.0)
            return (round(blocks_left + cost * c.replica.load, 6), c.replica.name != last, c.replica.load)

        chosen = min(candidates, key=work)
        return Decision(chosen.replica, "work", chosen.credit, chosen.total_blocks)
