def assign_owners(shapes, world_size):
    """Greedy, but in the order of the list (no sort)."""
    loads, owners = [0] * world_size, []
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        r = loads.index(min(loads))
        owners.append(r)
        loads[r] += numel
    return owners
