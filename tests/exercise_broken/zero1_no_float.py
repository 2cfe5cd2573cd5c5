# Broken on purpose (tests/test_exercises.py): no fp32 conversion (a bf16 view of the bucket
# with bf16 weights; the fp32 check alone would not see it).
def own_gradient(unit):
    return unit.own(unit.grad_flat)


def publish_update(comm, unit):
    unit.own(unit.param_flat).copy_(unit.master)
    return comm.all_gather(unit.param_flat, unit.own(unit.param_flat), what="params",
                           unit=unit.name, async_op=True)
