"""A token-id trie over cached trajectories: which sessions share how long a prefix with a prompt.

Plain Python, no tensors: the server's cross-adapter prefix reuse asks it, for a request's prompt,
every session whose trajectory starts with the same tokens, whatever adapter wrote them.
"""

from __future__ import annotations

from precache.engine.session import common_prefix


class _Node:
    __slots__ = ("children", "owners")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.owners: set[str] = set()


class TokenTrie:
    """Trajectories by key (a session id), stored as paths of token ids.

    Rule: every node on a key's path lists the key in ``owners``, and only those nodes do, so the
    owners of a child are a subset of its parent's. Updating a key touches only the tokens past its
    old and new paths' common prefix; :meth:`match` walks the prompt once. Costs are O(tokens) dict
    steps.
    """

    def __init__(self):
        self._root = _Node()
        self._paths: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, key: str) -> bool:
        return key in self._paths

    def set(self, key: str, token_ids: list[int]) -> None:
        """Store ``token_ids`` as the trajectory of ``key``, replacing what it had."""
        old = self._paths.get(key, [])
        new = [int(t) for t in token_ids]
        common = common_prefix(old, new)
        node = self._root
        node.owners.add(key)
        for t in new[:common]:
            node = node.children[t]
        self._drop_tail(node, old[common:], key)
        for t in new[common:]:
            node = node.children.setdefault(t, _Node())
            node.owners.add(key)
        self._paths[key] = new

    def remove(self, key: str) -> None:
        """Forget ``key`` (no error when absent)."""
        if key not in self._paths:
            return
        self._drop_tail(self._root, self._paths.pop(key), key)
        self._root.owners.discard(key)

    def match(self, token_ids: list[int]) -> list[tuple[str, int]]:
        """``(key, common prefix length)`` of every key sharing at least one token with ``token_ids``,
        longest first."""
        found: list[tuple[str, int]] = []
        node, depth = self._root, 0
        for t in token_ids:
            child = node.children.get(t)
            if child is None:
                break
            if depth and len(child.owners) != len(node.owners):
                found.extend((k, depth) for k in node.owners - child.owners)
            node, depth = child, depth + 1
        if depth:
            found.extend((k, depth) for k in node.owners)
        return sorted(found, key=lambda kv: -kv[1])

    @staticmethod
    def _drop_tail(node: _Node, tail: list[int], key: str) -> None:
        """Remove ``key`` from the nodes of ``tail`` below ``node``, pruning nodes nobody owns."""
        for t in tail:
            child = node.children[t]
            child.owners.discard(key)
            if not child.owners:
                del node.children[t]  # the rest of the tail belonged to ``key`` alone
                return
            node = child
