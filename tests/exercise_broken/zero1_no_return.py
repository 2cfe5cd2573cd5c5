# Broken on purpose (tests/test_exercises.py): right, but the handle is not returned.
def own_gradient(unit):
    return unit.own(unit.grad_flat).float()


def publish_update(comm, unit):
    unit.own(unit.param_flat).copy_(unit.master)
    comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params", unit=unit.name,
                    async_op=True)
