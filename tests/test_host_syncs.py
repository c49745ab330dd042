"""`overlap.HostSyncs` counts the host's reads of tensor values and its synchronizes, and says where they came."""
import torch

import overlap
from overlap import HostSyncs, host_reads_allowed, no_host_sync


def test_every_kind_of_host_sync_is_counted_with_its_scope_and_line():
    x = torch.arange(6)
    with HostSyncs() as syncs:
        x.sum().item()
        x.tolist()
        bool(x.any())
        x[x > 2]
        with no_host_sync("step 1"):
            int(x[0])
            torch.nonzero(x)
            x.repeat_interleave(x)
            overlap.synchronize()
    kinds = [s.what for s in syncs.found]
    assert kinds == ["Tensor.item", "Tensor.tolist", "Tensor.__bool__", "Tensor.__getitem__", "Tensor.__int__",
                     "torch.nonzero", "Tensor.repeat_interleave", "overlap.synchronize"]
    assert [s.what for s in syncs.inside("step 1")] == kinds[4:]
    assert all(s.where.startswith(__file__) for s in syncs.found), [s.where for s in syncs.found]


def test_shapes_known_on_the_host_are_not_syncs():
    x = torch.arange(6)
    with HostSyncs() as syncs:
        x[1:3], x[torch.tensor([0, 2])], x.repeat_interleave(2)
        x.repeat_interleave(torch.ones(6, dtype=torch.long), output_size=6)
        torch.tensor([1, 2, 3])  # a copy from the host, not a read of the device
    assert syncs.found == []


def test_leaving_restores_torch_and_a_scope_forbids_host_reads():
    before = (torch.Tensor.__dict__.get("item"), torch.Tensor.__dict__.get("__bool__"), overlap.synchronize)
    with HostSyncs():
        assert torch.Tensor.__dict__.get("item") is not None
    assert (torch.Tensor.__dict__.get("item"), torch.Tensor.__dict__.get("__bool__"), overlap.synchronize) == before
    assert host_reads_allowed()
    with no_host_sync():
        assert not host_reads_allowed()
    assert host_reads_allowed()


def test_a_synchronize_that_makes_another_is_one_sync(monkeypatch):
    """On a device `overlap.synchronize` waits with the device's own synchronize: one host sync, not two."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a device's, on this CPU host
    monkeypatch.setattr(overlap.backends.current(), "synchronize", lambda: torch.cuda.synchronize())
    with HostSyncs() as syncs:
        overlap.synchronize()
        torch.cuda.synchronize()  # made by itself: one more
    assert [s.what for s in syncs.found] == ["overlap.synchronize", "torch.cuda.synchronize"], syncs.found
