"""Shared-memory transport: ranks on one host exchange tag-matched messages through lock-free
single-producer/single-consumer byte rings in ``/dev/shm``. The native half (atomics, futex,
copies) is ``_shm.pyx`` / ``ddl_shm.h``; this package is laid out as ``segments`` (the files),
``ring`` (layout, records, requests), ``pair`` and ``context``. Its capability beyond pairs, the
host collectives (``boards``, native half ``_arena.pyx`` / ``ddl_arena.h``), is what
`ShmContext.host_collectives` returns.

Layout. Every rank owns one *inbox* segment, ``/dev/shm/ddl-<pid>-<random>-r<rank>``, made at
context creation and published in the store (``shm/inbox/<rank>``: name, pid). It holds a
header (magic, the owner's doorbell, an attach counter) and one ring slot per possible source
rank; slot ``s`` carries the messages from rank ``s`` to the owner::

    inbox of rank r:  [header | slot 0: ring 0->r | slot 1: ring 1->r | ... ]
    slot:             [head u64 | tail u64 | producer state, pid, inbox name, abort reason | data]

The producer (rank s) alone writes ``head`` and the data; the consumer (rank r) alone writes
``tail``. Counters are published with release stores and read with acquire loads, so a reader
never sees bytes the writer has not finished. Records are a 32-byte header (kind, check, tag,
nbytes) then the payload, padded to 32 bytes; a message larger than the ring streams through it
in pieces of at most ``_PIECE`` bytes, so the consumer copies piece k while the producer writes
piece k+1: no round trip per piece, just the counters.

Progress. Each context runs one progress thread that pushes queued sends into the peers' rings,
copies arrived data straight into posted receive buffers (or, for a message nobody asked for
yet, into a new buffer that a later receive copies from: sends never wait for the receiver's
program), and sleeps on a futex doorbell when there is nothing to do. Producers ring the
consumer's bell when they publish data, consumers ring the producer's bell when they free space.
``isend`` on an idle pair writes into the ring from the caller's thread, and a thread waiting on
a request moves its pair's bytes itself (spinning briefly, then sleeping on the doorbell) while
the progress thread stands back, so a small message costs no thread hand-off. All copies release
the GIL (``_shm.pyx``).

Lifetime and failures. A rank that first uses a pair maps the peer's inbox and marks its slot
there ATTACHED (with its pid and inbox name, so the peer attaches back without the store).
A peer's state lives in the slot it produces into, i.e. in our own inbox: CLOSED (its context
closed: data already in the ring is still delivered, then requests fail), ABORTED (code and
reason: requests fail at once with that error class). A peer that dies is seen through a pidfd
within ``_LIVENESS_S``. Segments are unlinked by their owner's ``close()`` (or at its exit); a
survivor unlinks the segments of a peer it saw die, before it raises (here and in the host
collectives); ``ddlrun`` removes those of its ranks once they have exited
(`remove_segments_of`); and every new context first removes this user's segments whose owner is
gone (`remove_orphans`: the pid in the name is dead or was reused, and the owner's lock on the
file is free), which covers ranks that died unseen under any launcher. Names carry the owner's
pid and random bits, so two jobs on one host never collide.

Single copy. A message of ``_CMA_MIN`` bytes or more travels as a CMA record (the address of the
data in the sender); the receiver reads it with ``process_vm_readv`` straight into the posted
buffer (or one of its own) and answers with an ACK record, which completes the send. Off where
Yama forbids reading a peer's memory, or when the peer's pid does not name it here.

Device memory is host-staged above this layer; CUDA IPC handles are where it would go here.
"""

from ddlcore.transports.shm.context import ShmContext, ShmTransport
from ddlcore.transports.shm.pair import ShmPair
from ddlcore.transports.shm.ring import ShmRequest
from ddlcore.transports.shm.segments import (
    _ORPHAN_MIN_AGE_S,
    PREFIX,
    SHM_DIR,
    _boot_time,
    _owner_gone,
    cma_allowed,
    create_segment,
    remove_orphans,
    remove_segments_of,
    unlink_quietly,
)

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "ShmContext",
    "ShmPair",
    "ShmRequest",
    "ShmTransport",
    "_ORPHAN_MIN_AGE_S",
    "_boot_time",
    "_owner_gone",
    "cma_allowed",
    "create_segment",
    "remove_orphans",
    "remove_segments_of",
    "unlink_quietly",
]
