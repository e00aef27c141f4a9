"""Prompt pages kept after their requests finish, found again by content (automatic prefix caching).

A prompt's full pages are blocks of `page_size` tokens whose keys and values depend only on the tokens
up to and including the block (and the parameter set). The cache is a trie over those blocks: node
(parent node, block tokens) → the page holding that block, the root per parameter set. A new prompt
walks the trie from its first block; the pages of the blocks it finds are reused (not prefilled
again). This is what makes Eval-Opt's growing chat cheap: each call's prompt starts with the previous
call's history, so only the messages since are prefilled.

The cache holds one reference to each page it keeps; a page no request uses any more (reference count
1: the cache's) can be evicted, least recently used leaf first (a leaf: no cached block continues it),
when the pool needs pages. Exact: blocks are matched on their tokens, never on a hash alone.
"""
from __future__ import annotations

import dataclasses
import heapq

from marljax.sampling.engine.kv_pages import PagePool


@dataclasses.dataclass
class _Node:
    key: tuple[int, tuple[int, ...]]  # (parent node id, block tokens)
    page: int
    used: int  # the cache clock when last looked up or added
    children: int = 0


class PrefixCache:
    """See the module docstring. Node ids: ≥ 0 for blocks, −1 − set for the root of a parameter set."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self.trie: dict[tuple[int, tuple[int, ...]], int] = {}
        self.nodes: dict[int, _Node] = {}
        self.clock = self.next_id = 0
        self.hit_tokens = 0  # prompt tokens found in the cache (not prefilled)

    def _blocks(self, prompt: tuple[int, ...], n: int):
        ps = self.page_size
        return (prompt[j * ps: (j + 1) * ps] for j in range(n))

    def lookup(self, group: int, prompt: tuple[int, ...]) -> list[int]:
        """Pages of the prompt's leading full blocks found in the cache (at most all but its last token:
        the last one must be prefilled for its hidden state); each gets a reference for the caller."""
        self.clock += 1
        parent, pages = -1 - group, []
        for block in self._blocks(prompt, (len(prompt) - 1) // self.page_size):
            node = self.trie.get((parent, block))
            if node is None:
                break
            self.nodes[node].used = self.clock
            pages.append(self.nodes[node].page)
            parent = node
        self.pool.retain(pages)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, group: int, prompt: tuple[int, ...], pages: list[int]) -> None:
        """Keep the prompt's full pages (`pages`, in order, already prefilled) for later prompts; the
        blocks already cached keep their pages."""
        self.clock += 1
        parent = -1 - group
        for block, page in zip(self._blocks(prompt, len(pages)), pages):
            node = self.trie.get((parent, block))
            if node is None:
                node, self.next_id = self.next_id, self.next_id + 1
                self.trie[(parent, block)] = node
                self.nodes[node] = _Node((parent, block), page, self.clock)
                if parent >= 0:
                    self.nodes[parent].children += 1
                self.pool.retain([page])
            self.nodes[node].used = self.clock
            parent = node

    def evictable(self) -> int:
        """Pages only the cache holds (evicting leaves first frees every one of them)."""
        return sum(self.pool.refs[n.page] == 1 for n in self.nodes.values())

    def evict(self, n: int) -> None:
        """Free n pages held by the cache alone, least recently used leaves first (a parent whose last
        child goes becomes a leaf)."""
        refs = self.pool.refs
        heap = [(x.used, i) for i, x in self.nodes.items() if x.children == 0 and refs[x.page] == 1]
        heapq.heapify(heap)
        for _ in range(n):
            if not heap:
                raise RuntimeError(f"prefix cache: {n} pages to evict, none is free of requests.")
            node = self.nodes.pop(heapq.heappop(heap)[1])
            del self.trie[node.key]
            self.pool.release([node.page])
            parent = node.key[0]
            if parent >= 0:
                up = self.nodes[parent]
                up.children -= 1
                if up.children == 0 and refs[up.page] == 1:
                    heapq.heappush(heap, (up.used, parent))
