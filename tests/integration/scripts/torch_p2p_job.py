"""Point-to-point and subgroups on the "ddl" backend, as a torch program writes them (no ddlcore
import): send/recv, isend/irecv, batch_isend_irecv, tags, a strided tensor, a size mismatch,
and new_group over some of the ranks running collectives and send/recv in group ranks.
Run with 3 ranks; prints "torch p2p ok: rank R of N"."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("ddl", timeout=timedelta(seconds=20))
rank, size = dist.get_rank(), dist.get_world_size()
nxt, prv = (rank + 1) % size, (rank - 1) % size


def payload(src, n, dtype, tag=0):
    g = torch.Generator().manual_seed(1000 * src + 10 * n + tag)
    return torch.randint(1, 100, (n,), generator=g).to(dtype)


# Blocking send/recv around the ring, several dtypes and sizes (0, 1, a prime).
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
    for n in (0, 1, 1009):
        if rank % 2 == 0:
            dist.send(payload(rank, n, dtype), dst=nxt)
            got = torch.empty(n, dtype=dtype)
            dist.recv(got, src=prv)
        else:
            got = torch.empty(n, dtype=dtype)
            dist.recv(got, src=prv)
            dist.send(payload(rank, n, dtype), dst=nxt)
        assert torch.equal(got, payload(prv, n, dtype)), (dtype, n)

# isend/irecv with tags, received in the reverse order of sending.
sends = [dist.isend(payload(rank, 50, torch.float64, tag), dst=nxt, tag=tag) for tag in range(4)]
for tag in reversed(range(4)):
    got = torch.empty(50, dtype=torch.float64)
    dist.irecv(got, src=prv, tag=tag).wait()
    assert torch.equal(got, payload(prv, 50, torch.float64, tag)), tag
for work in sends:
    work.wait()

# batch_isend_irecv: both neighbours at once, into a strided (non-contiguous) tensor.
strided = torch.zeros(7, 2, dtype=torch.int32)[:, 1]
out = torch.zeros(2, 7, dtype=torch.int32)
ops = [
    dist.P2POp(dist.isend, payload(rank, 7, torch.int32), nxt),
    dist.P2POp(dist.isend, payload(rank, 7, torch.int32, 1), prv),
    dist.P2POp(dist.irecv, strided, prv),
    dist.P2POp(dist.irecv, out[1], nxt),
]
for work in dist.batch_isend_irecv(ops):
    work.wait()
assert torch.equal(strided, payload(prv, 7, torch.int32)), strided
assert torch.equal(out[1], payload(nxt, 7, torch.int32, 1)), out

# A size mismatch is torch's DistBackendError with both ranks named.
if rank == 0:
    dist.send(torch.ones(3), dst=1, tag=9)
elif rank == 1:
    try:
        dist.recv(torch.empty(4), src=0, tag=9)
    except dist.DistBackendError as exc:
        assert "rank 0 sent 12 bytes" in str(exc) and "rank 1" in str(exc), exc
    else:
        raise AssertionError("a size mismatch was not reported")
dist.barrier()

# new_group over some of the ranks: collectives and send/recv in group ranks.
evens = [r for r in range(size) if r % 2 == 0]
group = dist.new_group(evens)
lone = dist.new_group([size - 1])
if rank in evens:
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((5,), float(sum(r + 1 for r in evens)))), t
    got = [torch.empty(2, dtype=torch.int64) for _ in evens]
    dist.all_gather(got, torch.tensor([rank, rank]), group=group)
    assert [g.tolist() for g in got] == [[r, r] for r in evens], got
    if len(evens) > 1:
        g_rank = dist.get_group_rank(group, rank)
        peer = evens[(g_rank + 1) % len(evens)]
        back = evens[(g_rank - 1) % len(evens)]
        work = dist.isend(torch.tensor([rank]), dst=peer, group=group)
        buf = torch.empty(1, dtype=torch.int64)
        dist.recv(buf, src=back, group=group)
        work.wait()
        assert buf.item() == back, buf
if rank == size - 1:
    t = torch.ones(3)
    dist.all_reduce(t, group=lone)
    assert torch.equal(t, torch.ones(3))
# A second group over the same ranks is a communicator of its own.
again = dist.new_group(evens)
if rank in evens:
    t = torch.ones(2)
    dist.all_reduce(t, group=again)
    assert torch.equal(t, torch.full((2,), float(len(evens))))
dist.barrier()
sys.stdout.write(f"torch p2p ok: rank {rank} of {size}\n")
dist.destroy_process_group()
