"""Where a prompt branches off the prompts routed before it: the part of a cached prefix that is
shared with other conversations rather than this conversation's own.

Every routed prompt's chain of block hashes is recorded as parent -> child links. A prompt that
follows a recorded chain and then leaves it where another conversation went on differently (a
new session after a common system prompt) shares the blocks up to that point with someone else:
a replica holding only them holds nothing of this conversation, and every replica will hold
them after computing them once. A later turn of the same conversation follows its own chain past
that point, and the blocks beyond are its own.
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

    def __len__(self) -> int:
        return len(self._child)

    def record(self, chain: list[bytes]) -> None:
        """Add a routed prompt's links (mutates the tree; the oldest nodes go beyond max_nodes)."""
        for parent, child in pairwise(chain):
            known = self._child.get(parent)
            if known is None:
                self._child[parent] = child
            elif known != child:
                self._child[parent] = _BRANCH
        excess = len(self._child) - self.max_nodes
        if excess > 0:
            for node in list(islice(self._child, excess)):
                del self._child[node]

    def shared_blocks(self, chain: list[bytes]) -> int:
        """How many leading blocks of `chain` some other recorded prompt shares and then leaves it
        (0: none); mutates nothing."""
        shared = 0
        for depth, (node, following) in enumerate(pairwise(chain), start=1):
            known = self._child.get(node)
            if known is None:
                break
            if known != following:  # another conversation goes on differently from here
                shared = depth
            if known != _BRANCH and known != following:
                break  # this prompt leaves every recorded chain here
        return shared
