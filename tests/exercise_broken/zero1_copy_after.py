# Broken on purpose (tests/test_exercises.py): copies the master in after starting the all_gather.
def own_gradient(unit):
    return unit.own(unit.grad_flat).float()


def publish_update(comm, unit):
    handle = comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params",
                             unit=unit.name, async_op=True)
    unit.own(unit.param_flat).copy_(unit.master)
    return handle
