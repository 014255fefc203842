"""Where a prompt branches off the prompts routed before it: the part of a cached prefix that is
shared with other conversations rather than this conversation's own.

Every routed prompt's chain of block hashes is recorded as parent -> child links. A prompt that
follows a recorded chain and then leaves it where another conversation went on differently (a
new session after a common system prompt) shares the blocks up to that point with someone else:
a replica holding only them holds nothing of this conversation, and every replica will hold
them after computing them once. A later turn of the same conversation follows its own chain past
that point, and the blocks beyond are its own.

The tree also remembers where each routed prompt was sent (by its last block): a later turn that
extends a previous prompt of its conversation knows the replica computing or holding that
history from the router's own decisions, before (or without) that replica's KV events.

A later turn need not repeat its previous prompt to the last token: the reply header a prompt
ends with (a `<think>` the history writes otherwise, tokens merged across the boundary) may be
rendered differently once the reply follows it. So a recorded prompt whose chain this one follows
to its last block, then leaves there while going on for more than a block, is this
conversation's previous turn told again, not another conversation: its blocks count as this
conversation's own, and the replica it went to as the one holding them. (A new conversation whose
sibling ends one block past their common prefix looks the same; that only gathers the two, as
without the tree.)
"""

from __future__ import annotations

from itertools import islice, pairwise

_BRANCH = b""  # a node whose recorded children differ: a block hash is never empty


class ConversationTree:
    # ~170 bytes a node (a 32-byte hash key, its child, the dict slot): 2^18 nodes, about 45 MB,
    # hold the prefixes of 4M prompt tokens; the oldest recorded are forgotten first (a forgotten
    # branch only makes a new conversation look like a continuation, as without the tree)
    def __init__(self, max_nodes: int = 1 << 18) -> None:
        self.max_nodes = max_nodes
        self._child: dict[bytes, bytes] = {}  # node -> its only recorded child, or _BRANCH
        # (pool, a routed prompt's last block) -> the replica of that pool it went to
        self._sent: dict[tuple[str, bytes], str] = {}

    def __len__(self) -> int:
        return len(self._child)

    def record(self, chain: list[bytes], replica: str | None = None, pool: str = "both") -> None:
        """Add a routed prompt's links and, with `replica`, where it was sent in `pool` (both,
        prefill or decode) (mutates the tree; the oldest nodes and prompt ends go beyond
        max_nodes)."""
        for parent, child in pairwise(chain):
            known = self._child.get(parent)
            if known is None:
                self._child[parent] = child
            elif known != child:
                self._child[parent] = _BRANCH
        if replica is not None and chain:
            self._sent.pop((pool, chain[-1]), None)  # re-inserted: the latest is the youngest
            self._sent[pool, chain[-1]] = replica
        for table in (self._child, self._sent):
            excess = len(table) - self.max_nodes
            if excess > 0:
                for node in list(islice(table, excess)):
                    del table[node]

    def previous_turn(self, chain: list[bytes], pool: str = "both") -> tuple[int, str] | None:
        """The longest prompt routed in `pool` that `chain` starts with, or follows to its last
        block (a retold tail): how many of its blocks `chain` holds and the replica it was sent
        to (None: no routed prompt is a prefix of this one); mutates nothing. Block hashes are
        chained, so a prompt's last block stands for all of it."""
        for depth in range(len(chain), 0, -1):
            replica = self._sent.get((pool, chain[depth - 1]))
            if replica is None and self._retold_tail(chain, depth):
                replica = self._sent.get((pool, self._child[chain[depth - 1]]))
            if replica is not None:
                return depth, replica
        return None

    def shared_blocks(self, chain: list[bytes]) -> int:
        """How many leading blocks of `chain` some other recorded prompt shares and then leaves it
        (0: none); mutates nothing."""
        shared = 0
        for depth, (node, following) in enumerate(pairwise(chain), start=1):
            known = self._child.get(node)
            if known is None or self._retold_tail(chain, depth):
                break  # past every recorded chain, or past this conversation's previous turn
            if known != following:  # another conversation goes on differently from here
                shared = depth
            if known != _BRANCH and known != following:
                break  # this prompt leaves every recorded chain here
        return shared

    def _retold_tail(self, chain: list[bytes], depth: int) -> bool:
        """Whether `chain` leaves, after `depth` blocks, a recorded prompt that ends one block
        later (nothing recorded follows that block) and goes on for more than a block: that
        prompt is this conversation's previous turn with its last block rendered otherwise.
        Mutates nothing."""
        if len(chain) <= depth + 1:
            return False  # a later turn adds its reply and new input: it is longer
        known = self._child.get(chain[depth - 1])
        return known is not None and known != _BRANCH and known != chain[depth] and known not in self._child
