"""What enters and leaves the prefix cache, as updates a remote copy of its hash map can apply.

The block pool records, in order, each content hash that enters its hash map (with the hash of
the block before it in the chain: its parent, or the root hash for a first block) and each
hash that leaves it. ``group_updates`` turns that record into updates that a subscriber applies
``removed`` first, then ``stored``; ``apply_update`` is that subscriber's side. Replaying every
update since the pool was made gives exactly the pool's hash map.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# The version of ``GET /v1/kv_events``'s lines, in its snapshot (2: LoRA adapters listed).
FEED_VERSION = 2

# blake2b digest size of ``block_manager.block_hash``.
HASH_BYTES = 16

# One recorded change of the hash map: (hash, parent) for a hash that entered it, (hash, None)
# for one that left it.
CacheEvent = tuple[bytes, bytes | None]


@dataclass
class KVUpdate:
    """Hashes that left the hash map, then hashes that entered it (with their parents), in the
    order they entered: a parent present when its child entered comes before the child."""

    stored: list[tuple[bytes, bytes]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Checked here so that what arrives over the wire is checked too (decoding builds it).
        for pair in self.stored:
            _check_hash(pair[0])
            _check_hash(pair[1])
        for h in self.removed:
            _check_hash(h)


@dataclass
class NodeLoad:
    """The scheduler's request counts and the fraction of KV blocks in use, as its metrics
    report them."""

    running: int
    waiting: int
    kv_usage: float

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0:
            raise ValueError(f"negative request counts {self.running}, {self.waiting}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")


@dataclass(frozen=True)
class AdapterState:
    """A LoRA adapter requests may name on the node, and whether the workers hold it loaded
    (a request for it then needs no load): what a router places adapter requests by."""

    name: str
    path: str
    loaded: bool

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError("an adapter needs a name and a path")

    @property
    def key(self) -> tuple[str, str]:
        """``LoRARequest.key``: the identity its prefix-cache blocks are rooted at."""
        return self.name, self.path


def adapter_states(served: dict[str, str], loaded: Iterable[tuple[str, str]]) -> list[AdapterState]:
    """The adapters requests may name (name -> directory), each marked loaded or not, by
    name. An adapter unloaded at runtime but still held for requests queued before is not
    listed: no new request may name it."""
    held = set(loaded)
    return [AdapterState(n, p, (n, p) in held) for n, p in sorted(served.items())]


def _check_hash(h: bytes) -> None:
    if len(h) != HASH_BYTES:
        raise ValueError(f"a block hash has {HASH_BYTES} bytes, got {len(h)}")


def group_updates(events: list[CacheEvent]) -> list[KVUpdate]:
    """``events`` as updates to apply in order, each ``removed`` before ``stored``.

    Within one update the order of different hashes does not matter, but that of one hash
    does: a hash stored and then removed again would be kept by the removed-first rule, so its
    removal starts the next update. (A hash removed and then stored needs nothing: removed
    first is its order.)
    """
    updates: list[KVUpdate] = []
    current = KVUpdate()
    stored_now: set[bytes] = set()
    for h, parent in events:
        if parent is not None:
            current.stored.append((h, parent))
            stored_now.add(h)
            continue
        if h in stored_now:
            updates.append(current)
            current, stored_now = KVUpdate(), set()
        current.removed.append(h)
    if current.stored or current.removed:
        updates.append(current)
    return updates


def apply_update(blocks: dict[bytes, bytes], update: KVUpdate) -> None:
    """Apply ``update`` to ``blocks`` (hash -> parent, in the order the hashes entered)."""
    for h in update.removed:
        blocks.pop(h, None)
    for h, parent in update.stored:
        blocks[h] = parent


def parents_first(blocks: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Every (hash, parent) of ``blocks``, each parent that is present before its children.

    Insertion order nearly is that order already; it is not where a parent left the map and
    came back after its child (another request computed it again), so such a parent is moved
    up before its first child.
    """
    ordered: list[tuple[bytes, bytes]] = []
    placed: set[bytes] = set()
    for h in blocks:
        chain: list[bytes] = []
        node: bytes | None = h
        while node is not None and node in blocks and node not in placed:
            chain.append(node)
            placed.add(node)
            node = blocks[node]
        for member in reversed(chain):
            ordered.append((member, blocks[member]))
    return ordered
