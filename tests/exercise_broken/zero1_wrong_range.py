# Broken on purpose (tests/test_exercises.py): every rank takes rank 0's range of the gradient.
def own_gradient(unit):
    return unit.grad_flat[:unit.shard_numel].float()


def publish_update(comm, unit):
    unit.own(unit.param_flat).copy_(unit.master)
    return comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params",
                           unit=unit.name, async_op=True)
