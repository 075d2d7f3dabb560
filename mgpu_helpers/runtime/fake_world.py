"""``with fake_world(world_size, rank=0):`` be one rank of a world inside this process. torch's fake process group
(``torch.testing._internal.distributed.fake_pg``) returns from every collective at once, moving no data: shapes
and allocations are real, values not. Right for memory accounting, useless for training."""
import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """The default process group is a fake one of ``world_size`` (this process is ``rank``), torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
