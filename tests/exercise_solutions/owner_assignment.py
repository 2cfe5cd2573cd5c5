def assign_owners(shapes, world_size):
    """A learner's correct answer, written without zerolab: largest first (stable), each to the
    least-loaded rank, the lowest on a tie."""
    numel = []
    for shape in shapes:
        k = 1
        for d in shape:
            k *= d
        numel.append(k)
    loads, owners = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -numel[i]):
        r = loads.index(min(loads))
        owners[i] = r
        loads[r] += numel[i]
    return owners
