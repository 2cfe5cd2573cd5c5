# Broken on purpose (tests/test_exercises.py): all_gathers the weights without first writing the
# updated master shard into them (every rank keeps its old weights).
def own_gradient(unit):
    return unit.own(unit.grad_flat).float()


def publish_update(comm, unit):
    return comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params",
                           unit=unit.name, async_op=True)
